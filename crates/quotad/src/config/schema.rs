//! The configuration file's schema and its defaults (unknown fields rejected).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The whole configuration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// This daemon's region.
    pub region: String,
    /// Which `[[regions]]` entry this daemon is (its `node_id`): needed when its region runs
    /// several daemons, each an entry of the same `id`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_id: Option<u64>,
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
    /// Every daemon of the cluster, this one included, one entry each (a region of several
    /// daemons repeats its `id`); empty means a single region of one daemon.
    pub regions: Vec<RegionConfig>,
    pub telemetry: TelemetryConfig,
    pub runtime: RuntimeConfig,
    pub envoy: EnvoyConfig,
}

/// Envoy's global rate limit service (RLS v3) and rate limit quota service (RLQS) for
/// Envoy-based gateways: off unless `listen` is set. Each descriptor or bucket id names a tenant
/// (and a policy, or the request's domain is the policy).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnvoyConfig {
    /// The gRPC listener, e.g. `127.0.0.1:8081`.
    pub listen: Option<String>,
    /// The descriptor entry key whose value is the tenant id.
    pub tenant_key: String,
    /// The descriptor entry key whose value is the policy name.
    pub policy_key: String,
    /// TLS on the gRPC listener, as `[api] tls_*`.
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    pub tls_client_ca_file: Option<PathBuf>,
    pub tls_check_ms: u64,
    /// A descriptor entry key whose value is an identity (e.g. `remote_address`): a
    /// descriptor without the tenant entry is decided for that identity, hashed with the
    /// identity key like a check's `identity`.
    pub identity_key: Option<String>,
    /// RLQS: the answer for a bucket id that names no tenant, or a policy the tenant lacks.
    pub rlqs_unknown_bucket: Blanket,
    /// RLQS: the answer for a budget pinned to another region (its Envoys hold nothing here).
    pub rlqs_elsewhere: Blanket,
    /// RLQS: how often Envoys report (Envoy's client reports every 5 s, whatever its
    /// `reporting_interval` says); assignments live two of these and a second.
    pub rlqs_report_ms: u64,
}

/// A blanket RLQS answer: every request of the bucket allowed, or every one denied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Blanket {
    AllowAll,
    DenyAll,
}

impl Default for EnvoyConfig {
    fn default() -> Self {
        Self {
            listen: None,
            tenant_key: "tenant".into(),
            policy_key: "policy".into(),
            tls_cert_file: None,
            tls_key_file: None,
            tls_client_ca_file: None,
            tls_check_ms: 10_000,
            identity_key: None,
            rlqs_unknown_bucket: Blanket::AllowAll,
            rlqs_elsewhere: Blanket::DenyAll,
            rlqs_report_ms: 5_000,
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
    /// Named, scoped tokens (TOML `[[tokens]]`: `name`, `scope`, `token_sha256` or
    /// `token_file`), re-read every `tokens_check_ms`. See docs/operations.md.
    pub tokens_file: Option<PathBuf>,
    /// A file holding the identity key (used when `QUOTAD_IDENTITY_KEY` is unset): checks
    /// naming an `identity` hash it with this key. The same key in every region.
    pub identity_key_file: Option<PathBuf>,
    /// How often `tokens_file` is read again; 0 reads it at start only.
    pub tokens_check_ms: u64,
    /// Decisions (`/v1/check`, `/v1/check/batch`) without a token; `false` asks for a `check`
    /// (or `admin`) token.
    pub open_checks: bool,
    pub body_limit_bytes: usize,
    pub request_timeout_ms: u64,
    /// How long in-flight requests may take to drain on shutdown.
    pub drain_timeout_ms: u64,
    /// How long to wait for a pinned tenant's home region before the policy decides.
    pub forward_timeout_ms: u64,
    /// TLS on the listener (both or none): its PEM certificate chain and key.
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// With TLS: clients must present a certificate from these PEM CAs.
    pub tls_client_ca_file: Option<PathBuf>,
    /// How often the TLS files are read again (rotation); 0 reads them at start only.
    pub tls_check_ms: u64,
}

/// The peer (Raft) listener.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeerConfig {
    pub listen: String,
    /// A file holding the peer token (used when `QUOTAD_PEER_TOKEN` is unset).
    pub token_file: Option<PathBuf>,
    /// Mutual TLS between regions (all three or none): this region's PEM certificate chain,
    /// its key, and the CA peers' certificates must chain to.
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    pub tls_ca_file: Option<PathBuf>,
    /// How often the TLS files are read again (rotation); 0 reads them at start only.
    pub tls_check_ms: u64,
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
    /// Take a hot token bucket's tokens in batches and hand them out in the daemon, so it
    /// costs Redis a call per batch instead of one per decision (docs/architecture.md,
    /// "Reservations").
    pub reservations: bool,
    /// Answer checks of a token bucket that stands denied for R ms as denials until R has
    /// passed, without Redis (docs/architecture.md, "The denial cache").
    pub denial_cache: bool,
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

/// One daemon of the cluster: a region runs one or several.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionConfig {
    /// The region the daemon serves.
    pub id: String,
    /// Raft node id; unique and non-zero.
    pub node_id: u64,
    /// The daemon's API address, `host:port` or `IP:port` (pinned checks are forwarded here
    /// without peer TLS).
    pub api: String,
    /// The daemon's peer (Raft) address, `host:port` or `IP:port`: resolved per connection,
    /// and with peer TLS the name (or IP) its certificate must carry.
    pub peer: String,
    /// With peer TLS: the URI SAN this region's certificate names (default
    /// `quotad://region/<id>`; e.g. a SPIFFE id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
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
            node_id: None,
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
            tokens_file: None,
            identity_key_file: None,
            tokens_check_ms: 5_000,
            open_checks: true,
            body_limit_bytes: 64 * 1024,
            request_timeout_ms: 5_000,
            drain_timeout_ms: 10_000,
            forward_timeout_ms: 500,
            tls_cert_file: None,
            tls_key_file: None,
            tls_client_ca_file: None,
            tls_check_ms: 10_000,
        }
    }
}

impl Default for PeerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7451".into(),
            token_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_ca_file: None,
            tls_check_ms: 10_000,
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
            reservations: true,
            denial_cache: true,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
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
}
