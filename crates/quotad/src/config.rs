//! The daemon's configuration: a TOML file (unknown fields rejected), then `QUOTAD_…`
//! environment overrides, then one validation pass that reports every problem at once.
//!
//! Secrets (the admin token, the peer token, the Redis password) never live in the file itself:
//! they come from the environment or from a file the config names, so a config can be printed,
//! committed and diffed without leaking anything.

use std::collections::BTreeSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use quota_core::RegionId;
use serde::{Deserialize, Serialize};

use crate::secret::Secret;

/// Environment variable holding the admin bearer token.
pub const ENV_ADMIN_TOKEN: &str = "QUOTAD_ADMIN_TOKEN";
/// Environment variable holding the token peers present to each other.
pub const ENV_PEER_TOKEN: &str = "QUOTAD_PEER_TOKEN";
/// Environment variable holding the Redis password.
pub const ENV_REDIS_PASSWORD: &str = "QUOTAD_REDIS_PASSWORD";
/// The sentinels' own password (`requirepass` on the sentinels), Sentinel mode only.
pub const ENV_REDIS_SENTINEL_PASSWORD: &str = "QUOTAD_REDIS_SENTINEL_PASSWORD";

/// The whole configuration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// This daemon's region.
    pub region: String,
    /// Where durable coordinator state lives: `raft/` (log and snapshots) with `[[regions]]`,
    /// `local.redb` (policies, pins, versions) without. Created if missing.
    pub data_dir: PathBuf,
    pub api: ApiConfig,
    pub peer: PeerConfig,
    /// The regional Redis; absent means the embedded in-process store.
    pub redis: Option<RedisConfig>,
    pub breaker: BreakerConfig,
    pub coordination: CoordinationConfig,
    pub raft: RaftTimings,
    /// Every region of the cluster, this one included; empty means a single region.
    pub regions: Vec<RegionConfig>,
    pub telemetry: TelemetryConfig,
    pub runtime: RuntimeConfig,
    pub envoy: EnvoyConfig,
}

/// Envoy's global rate limit service (RLS v3) for Envoy-based gateways: off unless `listen` is
/// set. Each descriptor names a tenant (and a policy, or the request's domain is the policy).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnvoyConfig {
    /// The gRPC listener, e.g. `127.0.0.1:8081`.
    pub listen: Option<String>,
    /// The descriptor entry key whose value is the tenant id.
    pub tenant_key: String,
    /// The descriptor entry key whose value is the policy name.
    pub policy_key: String,
}

impl Default for EnvoyConfig {
    fn default() -> Self {
        Self {
            listen: None,
            tenant_key: "tenant".into(),
            policy_key: "policy".into(),
        }
    }
}

/// The admin and decision API listener.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    pub listen: String,
    /// A file holding the admin token (used when `QUOTAD_ADMIN_TOKEN` is unset).
    pub admin_token_file: Option<PathBuf>,
    pub body_limit_bytes: usize,
    pub request_timeout_ms: u64,
    /// How long in-flight requests may take to drain on shutdown.
    pub drain_timeout_ms: u64,
    /// How long to wait for a pinned tenant's home region before the policy decides.
    pub forward_timeout_ms: u64,
}

/// The peer (Raft) listener.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeerConfig {
    pub listen: String,
    /// A file holding the peer token (used when `QUOTAD_PEER_TOKEN` is unset).
    pub token_file: Option<PathBuf>,
}

/// The regional Redis.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// One server, or a Redis Cluster.
    pub mode: RedisMode,
    /// `redis://host:port/db`, without a password; in Cluster mode, any node of the cluster
    /// (database 0); in Sentinel mode, a sentinel.
    pub url: String,
    /// Cluster mode: more nodes to discover the cluster from when `url` does not answer.
    /// Sentinel mode: the other sentinels.
    pub seed_urls: Vec<String>,
    /// Sentinel mode: the name the sentinels monitor the master under.
    pub master_name: Option<String>,
    /// Sentinel mode: a file holding the sentinels' own password (used when
    /// `QUOTAD_REDIS_SENTINEL_PASSWORD` is unset); the master's is `password_file`.
    pub sentinel_password_file: Option<PathBuf>,
    /// The Redis ACL user to authenticate as; unset means the `default` user (a
    /// `requirepass` password alone). Needs a password.
    pub username: Option<String>,
    /// A file holding the Redis password (used when `QUOTAD_REDIS_PASSWORD` is unset).
    pub password_file: Option<PathBuf>,
    /// How often `password_file` is read again for a new password, taken once Redis accepts
    /// it (rotation without a restart); 0 reads it at start only.
    pub password_check_ms: u64,
    /// PEM CA certificates to verify a `rediss://` Redis against, instead of the system's.
    pub tls_ca_file: Option<PathBuf>,
    /// PEM client certificate chain, for a Redis with `tls-auth-clients yes` (with the key).
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of the client certificate.
    pub tls_key_file: Option<PathBuf>,
    /// Per-call timeout; a slower answer counts against the circuit breaker.
    pub timeout_ms: u64,
}

/// How the regional Redis is deployed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RedisMode {
    /// One server, or a primary behind one fixed address (a proxy, Sentinel-managed DNS).
    #[default]
    Standalone,
    /// Redis Cluster: keys spread over its masters by slot, found through `url` and `seed_urls`.
    Cluster,
    /// A master the sentinels at `url` and `seed_urls` name for `master_name`, followed
    /// through failovers (database 0; over TLS when the sentinels' addresses are `rediss://`).
    Sentinel,
}

/// When the circuit breaker around the regional Redis trips and how it recovers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Consecutive failures (errors or slow calls) that open the breaker.
    pub failure_threshold: u32,
    /// A call slower than this counts as a failure.
    pub slow_call_ms: u64,
    /// How long the breaker stays open before one probe call is let through.
    pub open_ms: u64,
}

/// The coordination loop timings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoordinationConfig {
    pub report_interval_ms: u64,
    pub rebalance_interval_ms: u64,
    pub lease_ms: u64,
    /// Bound on clock-rate drift over one lease: the region stops this much early and the
    /// coordinator reuses a share this much late.
    pub drift_margin_ms: u64,
}

/// Raft timings; unset values take quota-raft's defaults (sized for regions 50–150 ms apart).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RaftTimings {
    pub heartbeat_interval_ms: Option<u64>,
    pub election_timeout_min_ms: Option<u64>,
    pub election_timeout_max_ms: Option<u64>,
    /// Bound on one coordinator write, forwarding to the leader included.
    pub write_timeout_ms: Option<u64>,
}

/// One region of the cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionConfig {
    pub id: String,
    /// Raft node id; unique and non-zero.
    pub node_id: u64,
    /// The region's admin API address (pinned checks are forwarded here).
    pub api: String,
    /// The region's peer (Raft) address.
    pub peer: String,
}

/// The async runtime.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// Worker threads; 0 = one per core but one, at least one. quotad shares its host with the
    /// region's Redis (and often the gateways): on 2 cores one worker decides 0.40× raw EVALSHA
    /// at concurrency 64 against 0.32× with two, and adds 25 µs p50 instead of 42 at
    /// concurrency 1 (cross-thread wake-ups cost more than the second core gives).
    pub worker_threads: usize,
}

impl RuntimeConfig {
    /// The most worker threads accepted.
    pub const MAX_WORKER_THREADS: usize = 1024;

    /// Worker threads to start on a host with `cores` cores.
    pub fn workers(&self, cores: usize) -> usize {
        match self.worker_threads {
            0 => cores.saturating_sub(1).max(1),
            n => n,
        }
    }
}

/// Logging.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    pub log_format: LogFormat,
    /// A `tracing` filter, e.g. `info` or `quotad=debug,info`.
    pub log_level: String,
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            region: "local".into(),
            data_dir: PathBuf::from("quotad-data"),
            api: ApiConfig::default(),
            peer: PeerConfig::default(),
            redis: None,
            breaker: BreakerConfig::default(),
            coordination: CoordinationConfig::default(),
            raft: RaftTimings::default(),
            regions: Vec::new(),
            telemetry: TelemetryConfig::default(),
            runtime: RuntimeConfig::default(),
            envoy: EnvoyConfig::default(),
        }
    }
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7450".into(),
            admin_token_file: None,
            body_limit_bytes: 64 * 1024,
            request_timeout_ms: 5_000,
            drain_timeout_ms: 10_000,
            forward_timeout_ms: 500,
        }
    }
}

impl Default for PeerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7451".into(),
            token_file: None,
        }
    }
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            mode: RedisMode::Standalone,
            url: "redis://127.0.0.1:6379".into(),
            seed_urls: Vec::new(),
            master_name: None,
            sentinel_password_file: None,
            username: None,
            password_file: None,
            password_check_ms: 10_000,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            timeout_ms: 50,
        }
    }
}

impl RedisConfig {
    /// Where the store finds this Redis.
    pub fn topology(&self) -> quota_store::Topology {
        match self.mode {
            RedisMode::Standalone => quota_store::Topology::Standalone {
                url: self.url.clone(),
            },
            RedisMode::Cluster => quota_store::Topology::Cluster { urls: self.urls() },
            RedisMode::Sentinel => quota_store::Topology::Sentinel {
                urls: self.urls(),
                master_name: self.master_name.clone().unwrap_or_default(),
            },
        }
    }

    /// `url`, then `seed_urls`.
    fn urls(&self) -> Vec<String> {
        std::iter::once(&self.url)
            .chain(&self.seed_urls)
            .cloned()
            .collect()
    }
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            slow_call_ms: 100,
            open_ms: 500,
        }
    }
}

impl Default for CoordinationConfig {
    fn default() -> Self {
        Self {
            report_interval_ms: 1_000,
            rebalance_interval_ms: 5_000,
            lease_ms: 30_000,
            drift_margin_ms: 1_000,
        }
    }
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            log_format: LogFormat::Text,
            log_level: "info".into(),
        }
    }
}

/// One problem with a configuration, naming where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Every problem found while loading a configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration:\n{}", .0.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
pub struct ConfigErrors(pub Vec<ConfigProblem>);

/// Where a secret came from, for the effective-config printout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SecretSource {
    Environment,
    File,
    Generated,
    Unset,
}

/// The secrets, resolved from the environment or files.
#[derive(Debug, Clone)]
pub struct Secrets {
    /// `None` means "generate one at start-up".
    pub admin_token: Option<Secret>,
    pub admin_token_source: SecretSource,
    pub peer_token: Option<Secret>,
    pub peer_token_source: SecretSource,
    pub redis_password: Option<Secret>,
    pub redis_password_source: SecretSource,
    pub redis_sentinel_password: Option<Secret>,
    pub redis_sentinel_password_source: SecretSource,
}

/// A configuration checked and resolved: addresses parsed, ids validated, secrets loaded.
#[derive(Debug, Clone)]
pub struct Settings {
    pub config: Config,
    pub region: RegionId,
    pub api_listen: SocketAddr,
    pub peer_listen: SocketAddr,
    /// Envoy's rate limit service listener, if on.
    pub envoy_listen: Option<SocketAddr>,
    pub regions: Vec<RegionSettings>,
    pub secrets: Secrets,
    /// TLS material for a `rediss://` Redis, read from the files named in `[redis]`.
    pub redis_tls: Option<quota_store::Tls>,
}

/// A cluster member, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSettings {
    pub id: RegionId,
    pub node_id: u64,
    pub api: SocketAddr,
    pub peer: SocketAddr,
}

/// Environment overrides: variable name → what it sets.
pub const ENV_OVERRIDES: &[(&str, &str)] = &[
    ("QUOTAD_REGION", "region"),
    ("QUOTAD_DATA_DIR", "data_dir"),
    ("QUOTAD_API_LISTEN", "api.listen"),
    ("QUOTAD_PEER_LISTEN", "peer.listen"),
    ("QUOTAD_ENVOY_LISTEN", "envoy.listen"),
    ("QUOTAD_REDIS_URL", "redis.url"),
    ("QUOTAD_REDIS_MODE", "redis.mode"),
    ("QUOTAD_REDIS_USERNAME", "redis.username"),
    ("QUOTAD_LOG_FORMAT", "telemetry.log_format"),
    ("QUOTAD_LOG_LEVEL", "telemetry.log_level"),
    ("QUOTAD_WORKER_THREADS", "runtime.worker_threads"),
];

fn problem(field: impl Into<String>, message: impl Into<String>) -> ConfigProblem {
    ConfigProblem {
        field: field.into(),
        message: message.into(),
    }
}

impl Config {
    /// Parses TOML text (unknown fields are errors).
    pub fn from_toml(text: &str) -> Result<Self, ConfigErrors> {
        toml::from_str(text).map_err(|e| ConfigErrors(vec![problem("(file)", e.to_string())]))
    }

    /// Reads and parses a config file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigErrors> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigErrors(vec![problem(
                "(file)",
                format!("cannot read {}: {e}", path.display()),
            )])
        })?;
        Self::from_toml(&text)
    }

    /// Applies `QUOTAD_…` overrides from `env`, noting values that do not parse.
    pub fn apply_env(
        &mut self,
        env: &dyn Fn(&str) -> Option<String>,
        problems: &mut Vec<ConfigProblem>,
    ) {
        for (var, _) in ENV_OVERRIDES {
            let Some(value) = env(var) else { continue };
            match *var {
                "QUOTAD_REGION" => self.region = value,
                "QUOTAD_DATA_DIR" => self.data_dir = PathBuf::from(value),
                "QUOTAD_API_LISTEN" => self.api.listen = value,
                "QUOTAD_PEER_LISTEN" => self.peer.listen = value,
                "QUOTAD_ENVOY_LISTEN" => self.envoy.listen = Some(value),
                "QUOTAD_REDIS_URL" => {
                    self.redis.get_or_insert_with(RedisConfig::default).url = value;
                }
                // Not a way to turn Redis on: it names whom to connect as, not where.
                "QUOTAD_REDIS_USERNAME" => match self.redis.as_mut() {
                    Some(redis) => redis.username = Some(value),
                    None => problems.push(problem(
                        *var,
                        "is set but no Redis is configured (redis.url or QUOTAD_REDIS_URL)",
                    )),
                },
                "QUOTAD_REDIS_MODE" => match (self.redis.as_mut(), value.as_str()) {
                    (None, _) => problems.push(problem(
                        *var,
                        "is set but no Redis is configured (redis.url or QUOTAD_REDIS_URL)",
                    )),
                    (Some(redis), "standalone") => redis.mode = RedisMode::Standalone,
                    (Some(redis), "cluster") => redis.mode = RedisMode::Cluster,
                    (Some(redis), "sentinel") => redis.mode = RedisMode::Sentinel,
                    (Some(_), other) => problems.push(problem(
                        *var,
                        format!(
                            "must be \"standalone\", \"cluster\" or \"sentinel\" (got {other:?})"
                        ),
                    )),
                },
                "QUOTAD_LOG_FORMAT" => match value.as_str() {
                    "text" => self.telemetry.log_format = LogFormat::Text,
                    "json" => self.telemetry.log_format = LogFormat::Json,
                    other => problems.push(problem(
                        *var,
                        format!("must be \"text\" or \"json\" (got {other:?})"),
                    )),
                },
                "QUOTAD_LOG_LEVEL" => self.telemetry.log_level = value,
                "QUOTAD_WORKER_THREADS" => match value.parse() {
                    Ok(n) => self.runtime.worker_threads = n,
                    Err(_) => problems.push(problem(
                        *var,
                        format!("must be a whole number of threads (got {value:?})"),
                    )),
                },
                _ => {}
            }
        }
    }

    /// Validates everything and resolves secrets, reporting every problem at once.
    pub fn resolve(
        self,
        env: &dyn Fn(&str) -> Option<String>,
        mut problems: Vec<ConfigProblem>,
    ) -> Result<Settings, ConfigErrors> {
        let p = &mut problems;
        let region = RegionId::new(self.region.clone())
            .map_err(|e| p.push(problem("region", e.to_string())))
            .ok();
        let api_listen = parse_addr(p, "api.listen", &self.api.listen);
        let peer_listen = parse_addr(p, "peer.listen", &self.peer.listen);
        if api_listen.is_some() && api_listen == peer_listen {
            p.push(problem("peer.listen", "must differ from api.listen"));
        }
        let envoy_listen = self
            .envoy
            .listen
            .as_deref()
            .and_then(|l| parse_addr(p, "envoy.listen", l));
        if envoy_listen.is_some() && (envoy_listen == api_listen || envoy_listen == peer_listen) {
            p.push(problem(
                "envoy.listen",
                "must differ from api.listen and peer.listen",
            ));
        }
        for (field, key) in [
            ("envoy.tenant_key", &self.envoy.tenant_key),
            ("envoy.policy_key", &self.envoy.policy_key),
        ] {
            if key.is_empty() {
                p.push(problem(field, "must not be empty"));
            }
        }
        if self.envoy.tenant_key == self.envoy.policy_key {
            p.push(problem(
                "envoy.policy_key",
                "must differ from envoy.tenant_key",
            ));
        }
        // The upper bound is axum's own cap on a buffered body: a larger limit would not hold.
        if self.api.body_limit_bytes < 256 || self.api.body_limit_bytes > 2 * 1024 * 1024 {
            p.push(problem(
                "api.body_limit_bytes",
                "must be between 256 and 2097152",
            ));
        }
        positive(p, "api.request_timeout_ms", self.api.request_timeout_ms);
        positive(p, "api.forward_timeout_ms", self.api.forward_timeout_ms);
        if let Some(redis) = &self.redis {
            check_redis_addresses(p, redis);
            positive(p, "redis.timeout_ms", redis.timeout_ms);
            if (1..100).contains(&redis.password_check_ms) {
                p.push(problem(
                    "redis.password_check_ms",
                    "must be 0 (read at start only) or at least 100",
                ));
            }
        }
        if self.breaker.failure_threshold == 0 {
            p.push(problem("breaker.failure_threshold", "must be at least 1"));
        }
        positive(p, "breaker.slow_call_ms", self.breaker.slow_call_ms);
        positive(p, "breaker.open_ms", self.breaker.open_ms);
        let c = &self.coordination;
        positive(p, "coordination.report_interval_ms", c.report_interval_ms);
        positive(
            p,
            "coordination.rebalance_interval_ms",
            c.rebalance_interval_ms,
        );
        positive(p, "coordination.lease_ms", c.lease_ms);
        if c.lease_ms <= 2 * c.drift_margin_ms {
            p.push(problem(
                "coordination.lease_ms",
                "must exceed twice coordination.drift_margin_ms, or a lease is over before it starts",
            ));
        }
        if c.lease_ms <= c.rebalance_interval_ms {
            p.push(problem(
                "coordination.lease_ms",
                "must exceed coordination.rebalance_interval_ms so leases are renewed in time",
            ));
        }
        let regions = check_regions(p, &self.regions, region.as_ref());
        if let (Some(min), Some(max)) = (
            self.raft.election_timeout_min_ms,
            self.raft.election_timeout_max_ms,
        ) {
            if min >= max {
                p.push(problem(
                    "raft.election_timeout_min_ms",
                    "must be below election_timeout_max_ms",
                ));
            }
        }
        if self.runtime.worker_threads > RuntimeConfig::MAX_WORKER_THREADS {
            p.push(problem(
                "runtime.worker_threads",
                format!(
                    "must be at most {} (0 = one per core but one)",
                    RuntimeConfig::MAX_WORKER_THREADS
                ),
            ));
        }
        if tracing_subscriber::EnvFilter::try_new(&self.telemetry.log_level).is_err() {
            p.push(problem(
                "telemetry.log_level",
                "is not a valid tracing filter",
            ));
        }
        let (admin_token, admin_token_source) = secret(
            p,
            env,
            ENV_ADMIN_TOKEN,
            "api.admin_token_file",
            self.api.admin_token_file.as_deref(),
        );
        let (peer_token, peer_token_source) = secret(
            p,
            env,
            ENV_PEER_TOKEN,
            "peer.token_file",
            self.peer.token_file.as_deref(),
        );
        let (redis_password, redis_password_source) = secret(
            p,
            env,
            ENV_REDIS_PASSWORD,
            "redis.password_file",
            self.redis.as_ref().and_then(|r| r.password_file.as_deref()),
        );
        check_redis_username(
            p,
            self.redis.as_ref().and_then(|r| r.username.as_deref()),
            redis_password.is_some(),
        );
        let (redis_sentinel_password, redis_sentinel_password_source) = secret(
            p,
            env,
            ENV_REDIS_SENTINEL_PASSWORD,
            "redis.sentinel_password_file",
            self.redis
                .as_ref()
                .and_then(|r| r.sentinel_password_file.as_deref()),
        );
        let sentinel = self
            .redis
            .as_ref()
            .is_some_and(|r| r.mode == RedisMode::Sentinel);
        if redis_sentinel_password.is_some() && !sentinel {
            p.push(problem(
                "redis.sentinel_password_file",
                format!("the sentinels' password ({ENV_REDIS_SENTINEL_PASSWORD} or redis.sentinel_password_file) is for redis.mode = \"sentinel\""),
            ));
        }
        let redis_tls = self.redis.as_ref().and_then(|r| check_redis_tls(p, r));
        if self.regions.len() > 1 && peer_token.is_none() {
            p.push(problem(
                "peer.token_file",
                format!("a multi-region cluster needs a peer token (set {ENV_PEER_TOKEN} or peer.token_file)"),
            ));
        }
        match (region, api_listen, peer_listen) {
            (Some(region), Some(api_listen), Some(peer_listen)) if problems.is_empty() => {
                Ok(Settings {
                    config: self,
                    region,
                    api_listen,
                    peer_listen,
                    envoy_listen,
                    regions,
                    redis_tls,
                    secrets: Secrets {
                        admin_token,
                        admin_token_source,
                        peer_token,
                        peer_token_source,
                        redis_password,
                        redis_password_source,
                        redis_sentinel_password,
                        redis_sentinel_password_source,
                    },
                })
            }
            _ => Err(ConfigErrors(problems)),
        }
    }

    /// Loads a config file (or the built-in default), applies the environment and validates.
    pub fn load(
        path: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Settings, ConfigErrors> {
        let mut config = match path {
            Some(path) => Self::from_file(path)?,
            None => Self::default(),
        };
        let mut problems = Vec::new();
        config.apply_env(env, &mut problems);
        config.resolve(env, problems)
    }
}

impl Settings {
    /// The multi-region peers, or `None` for a single region run.
    pub fn is_single_region(&self) -> bool {
        self.regions.len() <= 1
    }

    /// The effective configuration as TOML plus where each secret came from; no secret values.
    pub fn redacted(&self) -> String {
        let mut out = toml::to_string_pretty(&self.config)
            .unwrap_or_else(|e| format!("# cannot render: {e}\n"));
        let s = &self.secrets;
        out.push_str("\n# secrets (values redacted)\n");
        for (name, source) in [
            ("admin_token", s.admin_token_source),
            ("peer_token", s.peer_token_source),
            ("redis_password", s.redis_password_source),
            ("redis_sentinel_password", s.redis_sentinel_password_source),
        ] {
            let source = match source {
                SecretSource::Environment => "from the environment",
                SecretSource::File => "from a file",
                SecretSource::Generated => "generated at start-up",
                SecretSource::Unset if name == "admin_token" => "unset: generated at start-up",
                SecretSource::Unset => "unset",
            };
            out.push_str(&format!("# {name} = <redacted> ({source})\n"));
        }
        out
    }
}

fn positive(p: &mut Vec<ConfigProblem>, field: &str, v: u64) {
    if v == 0 {
        p.push(problem(field, "must be greater than 0"));
    }
}

fn parse_addr(p: &mut Vec<ConfigProblem>, field: &str, s: &str) -> Option<SocketAddr> {
    s.parse()
        .map_err(|_| {
            p.push(problem(
                field,
                format!("must be an IP:port address (got {s:?})"),
            ))
        })
        .ok()
}

/// `redis.url` and, in Cluster and Sentinel mode, `redis.seed_urls`: each a Redis address
/// without credentials, all TLS or all plain text; a Cluster's all on database 0; sentinels
/// with the name of the master they watch (over TLS, the master is reached over TLS too).
fn check_redis_addresses(p: &mut Vec<ConfigProblem>, redis: &RedisConfig) {
    check_redis_url(p, "redis.url", &redis.url);
    let sentinel = redis.mode == RedisMode::Sentinel;
    match (&redis.master_name, sentinel) {
        (None, true) => p.push(problem(
            "redis.master_name",
            "is required with redis.mode = \"sentinel\": the name the sentinels monitor",
        )),
        (Some(_), false) => p.push(problem(
            "redis.master_name",
            "is for Sentinel: set redis.mode = \"sentinel\", or remove it",
        )),
        (Some(name), true) if name.is_empty() || !name.chars().all(|c| c.is_ascii_graphic()) => p
            .push(problem(
                "redis.master_name",
                "must be printable ASCII without spaces",
            )),
        _ => {}
    }
    match redis.mode {
        RedisMode::Standalone => {
            if !redis.seed_urls.is_empty() {
                p.push(problem(
                    "redis.seed_urls",
                    "are for a Redis Cluster or sentinels: set redis.mode, or remove them",
                ));
            }
        }
        RedisMode::Cluster | RedisMode::Sentinel => {
            let tls = redis.url.starts_with("rediss://");
            for (i, url) in std::iter::once(&redis.url)
                .chain(&redis.seed_urls)
                .enumerate()
            {
                let field = match i {
                    0 => "redis.url".to_string(),
                    i => format!("redis.seed_urls[{}]", i - 1),
                };
                if i > 0 {
                    check_redis_url(p, &field, url);
                    if url.starts_with("rediss://") != tls {
                        p.push(problem(
                            &field,
                            "must use the same scheme as redis.url (all rediss:// or all redis://)",
                        ));
                    }
                }
                let db = url
                    .split_once("://")
                    .and_then(|(_, rest)| rest.split_once('/'))
                    .map(|(_, db)| db);
                if db.is_some_and(|db| !db.is_empty() && db != "0") {
                    p.push(problem(
                        &field,
                        "names a database: a Redis Cluster has only database 0, and quotad uses database 0 of a Sentinel's master",
                    ));
                }
            }
        }
    }
}

fn check_redis_url(p: &mut Vec<ConfigProblem>, field: &str, url: &str) {
    let Some(rest) = url
        .strip_prefix("redis://")
        .or_else(|| url.strip_prefix("rediss://"))
    else {
        p.push(problem(
            field,
            "must start with redis:// (or rediss:// for TLS)",
        ));
        return;
    };
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.contains('@') {
        p.push(problem(
            field,
            format!("must not carry credentials; set {ENV_REDIS_PASSWORD} or redis.password_file, and redis.username"),
        ));
    } else if authority.is_empty() {
        p.push(problem(field, "names no host"));
    } else if let Err(e) = quota_store::check_url(url) {
        p.push(problem(field, e.to_string()));
    }
}

/// The TLS files of `[redis]`, read and checked: they need a `rediss://` address, and a client
/// certificate comes with its key.
fn check_redis_tls(p: &mut Vec<ConfigProblem>, redis: &RedisConfig) -> Option<quota_store::Tls> {
    let (ca, cert, key) = (
        &redis.tls_ca_file,
        &redis.tls_cert_file,
        &redis.tls_key_file,
    );
    if ca.is_none() && cert.is_none() && key.is_none() {
        return None;
    }
    if !redis.url.starts_with("rediss://") {
        p.push(problem(
            "redis.url",
            "must start with rediss:// when redis.tls_* files are set",
        ));
    }
    let mut read = |field: &str, path: &Option<PathBuf>| {
        let path = path.as_ref()?;
        std::fs::read(path)
            .map_err(|e| {
                p.push(problem(
                    field,
                    format!("cannot read {}: {e}", path.display()),
                ))
            })
            .ok()
    };
    let ca_pem = read("redis.tls_ca_file", ca);
    let cert_pem = read("redis.tls_cert_file", cert);
    let key_pem = read("redis.tls_key_file", key);
    let client = match (cert_pem, key_pem) {
        (Some(cert_pem), Some(key_pem)) => Some(quota_store::ClientIdentity { cert_pem, key_pem }),
        (None, None) => None,
        _ => {
            if cert.is_some() != key.is_some() {
                p.push(problem(
                    "redis.tls_cert_file",
                    "a client certificate needs its key (redis.tls_key_file), and a key its certificate",
                ));
            }
            None
        }
    };
    let tls = quota_store::Tls { ca_pem, client };
    if let Some((part, why)) = tls.problem() {
        let field = match part {
            quota_store::TlsPart::Ca => "redis.tls_ca_file",
            quota_store::TlsPart::ClientCert => "redis.tls_cert_file",
            quota_store::TlsPart::ClientKey => "redis.tls_key_file",
        };
        p.push(problem(field, why));
    }
    Some(tls)
}

/// An ACL user name as Redis takes it in `AUTH`: one word of printable characters.
fn check_redis_username(p: &mut Vec<ConfigProblem>, username: Option<&str>, password: bool) {
    let Some(name) = username else { return };
    if name.is_empty() || name.len() > 128 || !name.chars().all(|c| c.is_ascii_graphic()) {
        p.push(problem(
            "redis.username",
            "must be 1 to 128 printable ASCII characters without spaces",
        ));
    } else if !password {
        p.push(problem(
            "redis.username",
            format!("needs a password: set {ENV_REDIS_PASSWORD} or redis.password_file"),
        ));
    }
}

fn check_regions(
    p: &mut Vec<ConfigProblem>,
    regions: &[RegionConfig],
    me: Option<&RegionId>,
) -> Vec<RegionSettings> {
    let mut out = Vec::new();
    let mut ids = BTreeSet::new();
    let mut nodes = BTreeSet::new();
    for (i, r) in regions.iter().enumerate() {
        let field = |f: &str| format!("regions[{i}].{f}");
        let id = RegionId::new(r.id.clone())
            .map_err(|e| p.push(problem(field("id"), e.to_string())))
            .ok();
        if !ids.insert(r.id.clone()) {
            p.push(problem(field("id"), format!("duplicate region {:?}", r.id)));
        }
        if r.node_id == 0 {
            p.push(problem(field("node_id"), "must be at least 1"));
        } else if !nodes.insert(r.node_id) {
            p.push(problem(
                field("node_id"),
                format!("duplicate node id {}", r.node_id),
            ));
        }
        let api = parse_addr(p, &field("api"), &r.api);
        let peer = parse_addr(p, &field("peer"), &r.peer);
        if let (Some(id), Some(api), Some(peer)) = (id, api, peer) {
            out.push(RegionSettings {
                id,
                node_id: r.node_id,
                api,
                peer,
            });
        }
    }
    if let Some(me) = me {
        if !regions.is_empty() && !regions.iter().any(|r| r.id == me.as_str()) {
            p.push(problem(
                "regions",
                format!("does not list this daemon's region {:?}", me.as_str()),
            ));
        }
    }
    out
}

fn secret(
    p: &mut Vec<ConfigProblem>,
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    field: &str,
    file: Option<&Path>,
) -> (Option<Secret>, SecretSource) {
    if let Some(v) = env(var).filter(|v| !v.is_empty()) {
        return (Some(Secret::new(v)), SecretSource::Environment);
    }
    let Some(path) = file else {
        return (None, SecretSource::Unset);
    };
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => {
            (Some(Secret::new(s.trim().to_string())), SecretSource::File)
        }
        Ok(_) => {
            p.push(problem(field, format!("{} is empty", path.display())));
            (None, SecretSource::Unset)
        }
        Err(e) => {
            p.push(problem(
                field,
                format!("cannot read {}: {e}", path.display()),
            ));
            (None, SecretSource::Unset)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    /// The fields `text` has problems with, in order (none if it resolves).
    fn problem_fields(text: &str) -> Vec<String> {
        Config::from_toml(text)
            .unwrap()
            .resolve(&no_env, Vec::new())
            .err()
            .map(|e| e.0.into_iter().map(|p| p.field).collect())
            .unwrap_or_default()
    }

    #[test]
    fn the_default_config_is_valid_and_single_region() {
        let s = Config::load(None, &no_env).unwrap();
        assert_eq!(s.api_listen.to_string(), "127.0.0.1:7450");
        assert_eq!(s.peer_listen.to_string(), "127.0.0.1:7451");
        assert!(s.is_single_region());
        assert!(s.config.redis.is_none());
        assert_eq!(s.secrets.admin_token_source, SecretSource::Unset);
    }

    #[test]
    fn worker_threads_default_to_one_per_core_but_one() {
        let auto = RuntimeConfig::default();
        assert_eq!(
            [1, 2, 4, 16].map(|cores| auto.workers(cores)),
            [1, 1, 3, 15]
        );
        assert_eq!(RuntimeConfig { worker_threads: 2 }.workers(8), 2);
        let env = |k: &str| (k == "QUOTAD_WORKER_THREADS").then(|| "3".to_string());
        let s = Config::load(None, &env).unwrap();
        assert_eq!(s.config.runtime.worker_threads, 3);
        let env = |k: &str| (k == "QUOTAD_WORKER_THREADS").then(|| "many".to_string());
        let e = Config::load(None, &env).unwrap_err();
        assert!(e.to_string().contains("QUOTAD_WORKER_THREADS"), "{e}");
        let e = Config::from_toml("[runtime]\nworker_threads = 5000\n")
            .unwrap()
            .resolve(&no_env, Vec::new())
            .unwrap_err();
        assert!(e.to_string().contains("runtime.worker_threads"), "{e}");
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let e = Config::from_toml("region = \"a\"\n[api]\nlisten = \"127.0.0.1:1\"\nbogus = 1\n")
            .unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let text = r#"
region = "bad region"
[api]
listen = "nowhere"
body_limit_bytes = 1
[redis]
url = "redis://user:hunter2@127.0.0.1:6379"
[coordination]
lease_ms = 100
drift_margin_ms = 100
[[regions]]
id = "a"
node_id = 0
api = "127.0.0.1:1"
peer = "x"
[[regions]]
id = "a"
node_id = 2
api = "127.0.0.1:2"
peer = "127.0.0.1:3"
"#;
        let config = Config::from_toml(text).unwrap();
        let errs = config.resolve(&no_env, Vec::new()).unwrap_err();
        let fields: Vec<_> = errs.0.iter().map(|p| p.field.as_str()).collect();
        for f in [
            "region",
            "api.listen",
            "api.body_limit_bytes",
            "redis.url",
            "coordination.lease_ms",
            "regions[0].node_id",
            "regions[0].peer",
            "regions[1].id",
            "peer.token_file",
        ] {
            assert!(fields.contains(&f), "{f} missing from {fields:?}");
        }
        // The password in the URL is named as a problem but never echoed.
        assert!(!errs.to_string().contains("hunter2"));
    }

    #[test]
    fn the_body_limit_stays_within_what_the_extractor_can_hold() {
        for (limit, ok) in [
            (255, false),
            (256, true),
            (2 << 20, true),
            ((2 << 20) + 1, false),
        ] {
            let text = format!("[api]\nbody_limit_bytes = {limit}\n");
            let resolved = Config::from_toml(&text)
                .unwrap()
                .resolve(&no_env, Vec::new());
            let named = resolved
                .as_ref()
                .err()
                .is_some_and(|e| e.0.iter().any(|p| p.field == "api.body_limit_bytes"));
            assert_eq!(!named, ok, "body_limit_bytes = {limit}");
        }
    }

    #[test]
    fn environment_overrides_and_secrets() {
        let env = |k: &str| match k {
            "QUOTAD_API_LISTEN" => Some("127.0.0.1:9000".to_string()),
            "QUOTAD_LOG_FORMAT" => Some("json".to_string()),
            "QUOTAD_REDIS_URL" => Some("redis://127.0.0.1:7000".to_string()),
            ENV_ADMIN_TOKEN => Some("s3cret-token".to_string()),
            _ => None,
        };
        let s = Config::load(None, &env).unwrap();
        assert_eq!(s.api_listen.port(), 9000);
        assert_eq!(s.config.telemetry.log_format, LogFormat::Json);
        assert_eq!(
            s.config.redis.as_ref().unwrap().url,
            "redis://127.0.0.1:7000"
        );
        assert_eq!(
            s.secrets.admin_token.as_ref().unwrap().expose(),
            "s3cret-token"
        );
        let printed = s.redacted();
        assert!(!printed.contains("s3cret-token"));
        assert!(printed.contains("admin_token = <redacted> (from the environment)"));
        assert!(!format!("{s:?}").contains("s3cret-token"));
    }

    #[test]
    fn a_redis_user_needs_a_password_and_a_plain_name() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| (*v).to_string())
            }
        };
        let redis = "[redis]\nurl = \"redis://127.0.0.1:6379/0\"\n";
        let fields = |toml: &str, vars: &'static [(&'static str, &'static str)]| {
            Config::from_toml(toml)
                .unwrap()
                .resolve(&env(vars), Vec::new())
                .err()
                .map(|e| e.0.into_iter().map(|p| p.field).collect::<Vec<_>>())
        };
        let named = format!("{redis}username = \"quotad\"\n");
        assert_eq!(
            fields(&named, &[]),
            Some(vec!["redis.username".to_string()]),
            "a user without a password"
        );
        assert_eq!(fields(&named, &[(ENV_REDIS_PASSWORD, "pw")]), None);
        for bad in ["", "two words", "tab\\t"] {
            let toml = format!("{redis}username = \"{bad}\"\n");
            assert_eq!(
                fields(&toml, &[(ENV_REDIS_PASSWORD, "pw")]),
                Some(vec!["redis.username".to_string()]),
                "{bad:?}"
            );
        }
        // The environment names the user of a configured Redis, and never turns one on.
        let vars: &[(&str, &str)] = &[
            ("QUOTAD_REDIS_USERNAME", "from-env"),
            (ENV_REDIS_PASSWORD, "pw"),
        ];
        let s = Config::load(None, &env(vars));
        assert_eq!(
            s.unwrap_err().0[0].field,
            "QUOTAD_REDIS_USERNAME",
            "no Redis configured"
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("quotad.toml");
        std::fs::write(&path, redis).unwrap();
        let s = Config::load(Some(&path), &env(vars)).unwrap();
        assert_eq!(
            s.config.redis.unwrap().username.as_deref(),
            Some("from-env")
        );
        // A URL that names a host but does not parse is named too.
        assert_eq!(
            fields("[redis]\nurl = \"redis://127.0.0.1:notaport/\"\n", &[]),
            Some(vec!["redis.url".to_string()])
        );
    }

    #[test]
    fn redis_tls_files_are_read_checked_and_need_a_tls_address() {
        let dir = tempfile::tempdir().unwrap();
        let pki = redis_harness::pki::TestPki::generate(dir.path(), "cfg").unwrap();
        let toml = |url: &str, files: &[(&str, &Path)]| {
            let mut t = format!("[redis]\nurl = \"{url}\"\n");
            for (field, path) in files {
                t.push_str(&format!("{field} = {:?}\n", path.display().to_string()));
            }
            t
        };
        let resolve = |t: &str| Config::from_toml(t).unwrap().resolve(&no_env, Vec::new());
        let fields = |t: &str| -> Vec<String> {
            resolve(t)
                .err()
                .map(|e| e.0.into_iter().map(|p| p.field).collect())
                .unwrap_or_default()
        };
        let all = [
            ("tls_ca_file", pki.ca_cert.as_path()),
            ("tls_cert_file", pki.client_cert.as_path()),
            ("tls_key_file", pki.client_key.as_path()),
        ];
        let s = resolve(&toml("rediss://redis.internal:6380", &all)).unwrap();
        let tls = s.redis_tls.expect("TLS material");
        assert!(tls.ca_pem.is_some() && tls.client.is_some());
        assert!(!format!("{tls:?}").contains("PRIVATE KEY"));
        // The system's roots alone: a rediss:// address and no files.
        assert!(resolve(&toml("rediss://redis.internal:6380", &[]))
            .unwrap()
            .redis_tls
            .is_none());

        assert_eq!(
            fields(&toml("redis://redis.internal:6379", &all)),
            ["redis.url"]
        );
        assert_eq!(
            fields(&toml("rediss://r:6380", &all[..2])),
            ["redis.tls_cert_file"],
            "a certificate without its key"
        );
        let missing = dir.path().join("missing.pem");
        assert_eq!(
            fields(&toml("rediss://r:6380", &[("tls_ca_file", &missing)])),
            ["redis.tls_ca_file"]
        );
        // Files that hold the wrong thing are named.
        assert_eq!(
            fields(&toml(
                "rediss://r:6380",
                &[("tls_ca_file", &pki.client_key)]
            )),
            ["redis.tls_ca_file"]
        );
        let swapped = [
            ("tls_cert_file", pki.client_cert.as_path()),
            ("tls_key_file", pki.client_cert.as_path()),
        ];
        assert_eq!(
            fields(&toml("rediss://r:6380", &swapped)),
            ["redis.tls_key_file"]
        );
    }

    #[test]
    fn a_redis_cluster_is_found_through_its_url_and_seeds() {
        let text = r#"
[redis]
mode = "cluster"
url = "redis://10.0.0.1:7000"
seed_urls = ["redis://10.0.0.2:7000", "redis://10.0.0.3:7000/0"]
"#;
        let s = Config::from_toml(text)
            .unwrap()
            .resolve(&no_env, Vec::new())
            .unwrap();
        assert_eq!(
            s.config.redis.unwrap().topology(),
            quota_store::Topology::Cluster {
                urls: vec![
                    "redis://10.0.0.1:7000".into(),
                    "redis://10.0.0.2:7000".into(),
                    "redis://10.0.0.3:7000/0".into(),
                ]
            }
        );
        // Standalone is the default, and the environment can switch a configured Redis.
        let standalone = Config::from_toml("[redis]\nurl = \"redis://10.0.0.1:6379/2\"\n").unwrap();
        assert_eq!(
            standalone.redis.as_ref().unwrap().topology(),
            quota_store::Topology::Standalone {
                url: "redis://10.0.0.1:6379/2".into()
            }
        );
        let mut switched = standalone.clone();
        let mut problems = Vec::new();
        let env = |k: &str| (k == "QUOTAD_REDIS_MODE").then(|| "cluster".to_string());
        switched.apply_env(&env, &mut problems);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(switched.redis.as_ref().unwrap().mode, RedisMode::Cluster);
        // ... and then names its database, which a Cluster does not have.
        let errs = switched.resolve(&no_env, Vec::new()).unwrap_err();
        assert_eq!(
            errs.0.iter().map(|p| p.field.as_str()).collect::<Vec<_>>(),
            ["redis.url"],
            "{errs}"
        );
        assert!(errs.to_string().contains("only database 0"), "{errs}");

        // Seeds without Cluster mode would be silently ignored: named instead.
        assert_eq!(
            problem_fields("[redis]\nseed_urls = [\"redis://10.0.0.2:7000\"]\n"),
            ["redis.seed_urls"]
        );
        // Each seed is checked like the URL, by its index; schemes may not mix.
        assert_eq!(
            problem_fields(
                r#"
[redis]
mode = "cluster"
url = "rediss://10.0.0.1:7000"
seed_urls = ["rediss://10.0.0.2:7000", "http://10.0.0.3:7000", "redis://10.0.0.4:7000", "rediss://u:pw@10.0.0.5:7000", "rediss://10.0.0.6:7000/3"]
"#
            ),
            [
                "redis.seed_urls[1]",
                "redis.seed_urls[1]",
                "redis.seed_urls[2]",
                "redis.seed_urls[3]",
                "redis.seed_urls[4]",
            ]
        );
        assert!(Config::from_toml("[redis]\nmode = \"replicated\"\n").is_err());
        // A mode set in the environment with no Redis configured, or an unknown one.
        for (value, redis) in [("cluster", false), ("replicated", true)] {
            let mut c = Config::default();
            if redis {
                c.redis = Some(RedisConfig::default());
            }
            let mut problems = Vec::new();
            c.apply_env(
                &|k: &str| (k == "QUOTAD_REDIS_MODE").then(|| value.to_string()),
                &mut problems,
            );
            assert_eq!(problems.len(), 1, "{value}: {problems:?}");
            assert_eq!(problems[0].field, "QUOTAD_REDIS_MODE");
        }
    }

    #[test]
    fn sentinels_need_the_master_name_and_one_scheme() {
        let text = r#"
[redis]
mode = "sentinel"
master_name = "quotad"
url = "redis://10.0.0.1:26379"
seed_urls = ["redis://10.0.0.2:26379", "redis://10.0.0.3:26379"]
"#;
        let s = Config::from_toml(text)
            .unwrap()
            .resolve(&no_env, Vec::new())
            .unwrap();
        assert_eq!(
            s.config.redis.unwrap().topology(),
            quota_store::Topology::Sentinel {
                urls: vec![
                    "redis://10.0.0.1:26379".into(),
                    "redis://10.0.0.2:26379".into(),
                    "redis://10.0.0.3:26379".into(),
                ],
                master_name: "quotad".into(),
            }
        );
        // The sentinels' own password, from the environment or a file, for Sentinel only.
        let env = |k: &str| (k == ENV_REDIS_SENTINEL_PASSWORD).then(|| "s3ntinel".to_string());
        let s = Config::from_toml(text)
            .unwrap()
            .resolve(&env, Vec::new())
            .unwrap();
        assert_eq!(
            s.secrets
                .redis_sentinel_password
                .as_ref()
                .map(Secret::expose),
            Some("s3ntinel")
        );
        assert!(!s.redacted().contains("s3ntinel"));
        let errs = Config::from_toml("[redis]\n")
            .unwrap()
            .resolve(&env, Vec::new())
            .unwrap_err();
        assert_eq!(errs.0[0].field, "redis.sentinel_password_file");
        assert_eq!(
            problem_fields("[redis]\nmode = \"sentinel\"\n"),
            ["redis.master_name"]
        );
        assert_eq!(
            problem_fields("[redis]\nmaster_name = \"quotad\"\n"),
            ["redis.master_name"]
        );
        assert_eq!(
            problem_fields(
                "[redis]\nmode = \"sentinel\"\nmaster_name = \"a b\"\nurl = \"rediss://10.0.0.1:26379\"\nseed_urls = [\"redis://10.0.0.2:26379/2\"]\n"
            ),
            [
                "redis.master_name",
                "redis.seed_urls[0]",
                "redis.seed_urls[0]"
            ]
        );
    }

    #[test]
    fn the_password_file_is_read_again_at_a_sane_interval_or_never() {
        for (ms, ok) in [
            (0, true),
            (1, false),
            (99, false),
            (100, true),
            (10_000, true),
        ] {
            let fields = problem_fields(&format!("[redis]\npassword_check_ms = {ms}\n"));
            assert_eq!(fields.is_empty(), ok, "{ms}: {fields:?}");
            if !ok {
                assert_eq!(fields, ["redis.password_check_ms"]);
            }
        }
    }

    #[test]
    fn the_envoy_listener_is_off_by_default_and_checked_when_on() {
        let s = Config::load(None, &no_env).unwrap();
        assert_eq!(s.envoy_listen, None);
        assert!(problem_fields("[envoy]\nlisten = \"127.0.0.1:8081\"\n").is_empty());
        assert_eq!(
            problem_fields("[envoy]\nlisten = \"localhost\"\n"),
            ["envoy.listen"]
        );
        assert_eq!(
            problem_fields("[envoy]\nlisten = \"127.0.0.1:7450\"\n"),
            ["envoy.listen"]
        );
        assert_eq!(
            problem_fields("[envoy]\ntenant_key = \"\"\npolicy_key = \"\"\n"),
            ["envoy.tenant_key", "envoy.policy_key", "envoy.policy_key"]
        );
        let mut c = Config::default();
        let mut problems = Vec::new();
        c.apply_env(
            &|k: &str| (k == "QUOTAD_ENVOY_LISTEN").then(|| "127.0.0.1:9081".to_string()),
            &mut problems,
        );
        let s = c.resolve(&no_env, problems).unwrap();
        assert_eq!(s.envoy_listen.map(|a| a.port()), Some(9081));
    }

    #[test]
    fn a_bad_environment_value_is_reported() {
        let env = |k: &str| (k == "QUOTAD_LOG_FORMAT").then(|| "xml".to_string());
        let errs = Config::load(None, &env).unwrap_err();
        assert_eq!(errs.0[0].field, "QUOTAD_LOG_FORMAT");
    }

    #[test]
    fn secrets_come_from_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "from-file\n").unwrap();
        let mut c = Config::default();
        c.api.admin_token_file = Some(path);
        c.peer.token_file = Some(dir.path().join("missing"));
        let errs = c.clone().resolve(&no_env, Vec::new()).unwrap_err();
        assert_eq!(errs.0.len(), 1);
        assert_eq!(errs.0[0].field, "peer.token_file");
        c.peer.token_file = None;
        let s = c.resolve(&no_env, Vec::new()).unwrap();
        assert_eq!(s.secrets.admin_token.unwrap().expose(), "from-file");
    }

    #[test]
    fn every_example_config_parses_and_validates() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config");
        let env = |k: &str| (k == ENV_PEER_TOKEN).then(|| "peer-secret".to_string());
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let result = Config::load(Some(&path), &env);
                assert!(
                    result.is_ok(),
                    "{}: {}",
                    path.display(),
                    result.unwrap_err()
                );
                seen += 1;
            }
        }
        assert!(
            seen >= 4,
            "expected the example configs in {}",
            dir.display()
        );
    }
}
