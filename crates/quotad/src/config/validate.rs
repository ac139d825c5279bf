//! One validation pass over a configuration: every problem reported at once, each naming its
//! field.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;

use quota_core::RegionId;

use crate::config::problem::{problem, ConfigErrors, ConfigProblem};
use crate::config::schema::{Config, RedisConfig, RedisMode, RegionConfig, RuntimeConfig};
use crate::config::secrets::{ENV_PEER_TOKEN, ENV_REDIS_PASSWORD};
use crate::config::settings::{RegionSettings, Settings};

/// The listeners a configuration asks for, parsed.
struct Listeners {
    api: Option<SocketAddr>,
    peer: Option<SocketAddr>,
    envoy: Option<SocketAddr>,
}

/// Most a host clock's rate may be off, in parts per million: NTP slews a clock by at most
/// 500 ppm, and an undisciplined quartz clock drifts less.
const CLOCK_RATE_PPM: u64 = 500;

impl Config {
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
        let listen = self.check_listeners(p);
        self.check_envoy_keys(p);
        self.check_api_limits(p);
        if let Some(redis) = &self.redis {
            check_redis(p, redis);
        }
        self.check_breaker(p);
        self.check_coordination(p);
        let regions = check_regions(p, &self.regions, region.as_ref());
        let node_id = check_node_id(p, &regions, region.as_ref(), self.node_id);
        self.check_raft_runtime_and_logs(p);
        let secrets = self.resolve_secrets(p, env);
        let redis_tls = self.redis.as_ref().and_then(|r| check_redis_tls(p, r));
        let peer_tls = self.check_peer_tls(p, &regions, region.as_ref());
        let (api_tls, envoy_tls) = self.check_listener_tls(p);
        if self.regions.len() > 1 && secrets.peer_token.is_none() {
            p.push(problem(
                "peer.token_file",
                format!("a multi-region cluster needs a peer token, the same on every region: set {ENV_PEER_TOKEN} (e.g. `export {ENV_PEER_TOKEN}=$(openssl rand -hex 24)`) or peer.token_file"),
            ));
        }
        match (region, listen.api, listen.peer) {
            (Some(region), Some(api_listen), Some(peer_listen)) if problems.is_empty() => {
                Ok(Settings {
                    config: self,
                    region,
                    node_id,
                    api_listen,
                    peer_listen,
                    envoy_listen: listen.envoy,
                    regions,
                    redis_tls,
                    peer_tls,
                    api_tls,
                    envoy_tls,
                    secrets,
                })
            }
            _ => Err(ConfigErrors(problems)),
        }
    }

    /// `api.listen`, `peer.listen` and `envoy.listen`: addresses, all different.
    fn check_listeners(&self, p: &mut Vec<ConfigProblem>) -> Listeners {
        let api = parse_addr(p, "api.listen", &self.api.listen);
        let peer = parse_addr(p, "peer.listen", &self.peer.listen);
        if api.is_some() && api == peer {
            p.push(problem("peer.listen", "must differ from api.listen"));
        }
        let envoy = self
            .envoy
            .listen
            .as_deref()
            .and_then(|l| parse_addr(p, "envoy.listen", l));
        if envoy.is_some() && (envoy == api || envoy == peer) {
            p.push(problem(
                "envoy.listen",
                "must differ from api.listen and peer.listen",
            ));
        }
        Listeners { api, peer, envoy }
    }

    fn check_envoy_keys(&self, p: &mut Vec<ConfigProblem>) {
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
        // Envoy counts assignment lifetimes in whole seconds; an assignment lives two reports,
        // and an Envoy that went away holds its part that long.
        if !(1_000..=60_000).contains(&self.envoy.rlqs_report_ms) {
            p.push(problem(
                "envoy.rlqs_report_ms",
                "must be between 1000 and 60000",
            ));
        }
    }

    fn check_api_limits(&self, p: &mut Vec<ConfigProblem>) {
        // The upper bound is axum's own cap on a buffered body: a larger limit would not hold.
        if self.api.body_limit_bytes < 256 || self.api.body_limit_bytes > 2 * 1024 * 1024 {
            p.push(problem(
                "api.body_limit_bytes",
                "must be between 256 and 2097152",
            ));
        }
        positive(p, "api.request_timeout_ms", self.api.request_timeout_ms);
        positive(p, "api.forward_timeout_ms", self.api.forward_timeout_ms);
    }

    fn check_breaker(&self, p: &mut Vec<ConfigProblem>) {
        if self.breaker.failure_threshold == 0 {
            p.push(problem("breaker.failure_threshold", "must be at least 1"));
        }
        positive(p, "breaker.slow_call_ms", self.breaker.slow_call_ms);
        positive(p, "breaker.open_ms", self.breaker.open_ms);
    }

    fn check_coordination(&self, p: &mut Vec<ConfigProblem>) {
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
        if self.regions.len() > 1 {
            self.check_failover_fits_the_lease(p);
            self.check_margin_covers_the_store_clock(p);
        }
    }

    /// The agent stores this region's lease end in Redis mapped onto Redis's clock through a
    /// `TIME` reading (docs/architecture.md, lease safety): what the mapping cannot know is how
    /// far the two clocks' rates drift apart over the lease, each within [`CLOCK_RATE_PPM`],
    /// and where in the `TIME` round trip (at most `redis.timeout_ms`) Redis read its clock.
    /// `drift_margin_ms` budgets both.
    fn check_margin_covers_the_store_clock(&self, p: &mut Vec<ConfigProblem>) {
        let c = &self.coordination;
        let drift_ms =
            (u128::from(c.lease_ms) * u128::from(2 * CLOCK_RATE_PPM)).div_ceil(1_000_000);
        let round_trip_ms = self.redis.as_ref().map_or(0, |r| r.timeout_ms);
        let needed_ms = drift_ms as u64 + round_trip_ms;
        if c.drift_margin_ms < needed_ms {
            p.push(problem(
                "coordination.drift_margin_ms",
                format!(
                    "must cover the rate drift between this daemon's clock and Redis's over one \
                     lease ({drift_ms} ms: {CLOCK_RATE_PPM} ppm each over lease_ms) plus a Redis \
                     TIME round trip (redis.timeout_ms, {round_trip_ms} ms): at least \
                     {needed_ms} ms"
                ),
            ));
        }
    }

    /// A renewal must get through before the lease runs out even when the leader dies just
    /// after the last one: `lease_ms − drift_margin_ms ≥ report_interval_ms + failover + one
    /// forwarding attempt`, where failover is the election guard's worst case
    /// (`election_timeout_max + (max − min) + heartbeat / 2 + 2 × heartbeat`) and an attempt on
    /// a leader that stopped answering gives up after `election_timeout_max_ms`.
    fn check_failover_fits_the_lease(&self, p: &mut Vec<ConfigProblem>) {
        let c = &self.coordination;
        let mut raft = quota_raft::RaftConfig::new(0, Default::default(), "", "");
        let t = &self.raft;
        if let Some(v) = t.heartbeat_interval_ms {
            raft.heartbeat_interval_ms = v;
        }
        if let Some(v) = t.election_timeout_min_ms {
            raft.election_timeout_min_ms = v;
        }
        if let Some(v) = t.election_timeout_max_ms {
            raft.election_timeout_max_ms = v;
        }
        let needed_ms = c.report_interval_ms
            + raft.failover_worst_case().as_millis() as u64
            + raft.forward_attempt_timeout().as_millis() as u64;
        let usable_ms = c.lease_ms.saturating_sub(c.drift_margin_ms);
        if usable_ms < needed_ms {
            p.push(problem(
                "coordination.lease_ms",
                format!(
                    "lease_ms − drift_margin_ms ({usable_ms} ms) must cover report_interval_ms + \
                     a Raft failover + one forwarding attempt ({needed_ms} ms with \
                     raft.heartbeat_interval_ms {}, raft.election_timeout_min_ms {}, \
                     raft.election_timeout_max_ms {}), or a leader's death ends every lease",
                    raft.heartbeat_interval_ms,
                    raft.election_timeout_min_ms,
                    raft.election_timeout_max_ms
                ),
            ));
        }
    }

    fn check_raft_runtime_and_logs(&self, p: &mut Vec<ConfigProblem>) {
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
    }
}

/// `[redis]`: its addresses, its timeout, how often the password file is read.
fn check_redis(p: &mut Vec<ConfigProblem>, redis: &RedisConfig) {
    check_redis_addresses(p, redis);
    positive(p, "redis.timeout_ms", redis.timeout_ms);
    if redis.timeout_ms >= quota_core::bounds::ONCE_KEY_MS {
        p.push(problem(
            "redis.timeout_ms",
            format!(
                "must be below {} ms: a retried refund or usage collection is recognised for \
                 that long",
                quota_core::bounds::ONCE_KEY_MS
            ),
        ));
    }
    if (1..100).contains(&redis.password_check_ms) {
        p.push(problem(
            "redis.password_check_ms",
            "must be 0 (read at start only) or at least 100",
        ));
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

/// A `host:port` or `IP:port` a region is reached at (a host name is resolved per connection).
fn parse_authority(p: &mut Vec<ConfigProblem>, field: &str, s: &str) -> Option<String> {
    match check_authority(s) {
        Ok(()) => Some(s.to_string()),
        Err(why) => {
            p.push(problem(field, format!("{why} (got {s:?})")));
            None
        }
    }
}

/// Checks an address a region is reached at, in `[[regions]]` and in `POST /v1/cluster/members`
/// alike: `host:port` with a DNS name, or `IP:port` (IPv6 in brackets), the port 1–65535.
///
/// Only the form is checked: a host name is resolved by the peer transport at each new
/// connection, so a region that moves to another address is followed.
pub fn check_authority(s: &str) -> Result<(), &'static str> {
    if s.is_empty() {
        return Err("must be host:port or IP:port, not empty");
    }
    // An IPv6 address holds colons itself: its port follows the closing bracket.
    let split = match s.strip_prefix('[') {
        Some(rest) => rest
            .split_once("]:")
            .map(|(ip, port)| (format!("[{ip}]"), port)),
        None => s
            .rsplit_once(':')
            .map(|(host, port)| (host.to_string(), port)),
    };
    let Some((host, port)) = split else {
        return Err("has no port: expected host:port or IP:port");
    };
    if !port.parse::<u16>().is_ok_and(|p| p > 0) {
        return Err("the port must be a number from 1 to 65535");
    }
    if s.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let dns_name = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        });
    if dns_name {
        Ok(())
    } else {
        Err("the host must be a DNS name or an IP address (IPv6 in brackets)")
    }
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
impl Config {
    /// `[api] tls_*` and `[envoy] tls_*`: certificate and key both or neither, a client CA
    /// only with them, every file readable and the key fitting the certificate.
    fn check_listener_tls(
        &self,
        p: &mut Vec<ConfigProblem>,
    ) -> (
        Option<quota_raft::tls::ServerFiles>,
        Option<quota_raft::tls::ServerFiles>,
    ) {
        let api = &self.api;
        let api_tls = check_server_tls(
            p,
            "api",
            (
                &api.tls_cert_file,
                &api.tls_key_file,
                &api.tls_client_ca_file,
            ),
        );
        let envoy = &self.envoy;
        let envoy_tls = check_server_tls(
            p,
            "envoy",
            (
                &envoy.tls_cert_file,
                &envoy.tls_key_file,
                &envoy.tls_client_ca_file,
            ),
        );
        if envoy_tls.is_some() && envoy.listen.is_none() {
            p.push(problem(
                "envoy.tls_cert_file",
                "is for the Envoy listener: set envoy.listen, or remove it",
            ));
        }
        (api_tls, envoy_tls)
    }

    /// `[peer] tls_*`: all three or none, readable, a key that fits the certificate, and a
    /// certificate naming this region's identity.
    fn check_peer_tls(
        &self,
        p: &mut Vec<ConfigProblem>,
        regions: &[RegionSettings],
        me: Option<&RegionId>,
    ) -> Option<quota_raft::tls::TlsFiles> {
        let peer = &self.peer;
        let files = match (&peer.tls_cert_file, &peer.tls_key_file, &peer.tls_ca_file) {
            (None, None, None) => return None,
            (Some(cert), Some(key), Some(ca)) => quota_raft::tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            },
            _ => {
                p.push(problem(
                    "peer.tls_cert_file",
                    "set all three of peer.tls_cert_file, peer.tls_key_file and peer.tls_ca_file, or none",
                ));
                return None;
            }
        };
        if self.regions.len() <= 1 {
            p.push(problem(
                "peer.tls_cert_file",
                "peer TLS is for a multi-region cluster ([[regions]]); a single region has no peer listener",
            ));
        }
        let identity = match quota_raft::tls::check(&files) {
            Ok(identity) => identity,
            Err(e) => {
                let field = match &e {
                    quota_raft::tls::TlsError::Key { .. } => "peer.tls_key_file",
                    quota_raft::tls::TlsError::Ca { .. } => "peer.tls_ca_file",
                    quota_raft::tls::TlsError::Read { path, .. } if *path == files.key => {
                        "peer.tls_key_file"
                    }
                    quota_raft::tls::TlsError::Read { path, .. } if *path == files.ca => {
                        "peer.tls_ca_file"
                    }
                    _ => "peer.tls_cert_file",
                };
                p.push(problem(field, e.to_string()));
                return None;
            }
        };
        let expected = me.and_then(|me| {
            regions
                .iter()
                .find(|r| r.id == *me && self.node_id.is_none_or(|n| n == r.node_id))
        });
        if let Some(r) = expected {
            if identity.as_deref() != Some(r.identity.as_str()) {
                p.push(problem(
                    "peer.tls_cert_file",
                    format!(
                        "the certificate must name this region's identity {} as a URI SAN (it names {})",
                        r.identity,
                        identity.as_deref().unwrap_or("none")
                    ),
                ));
            }
        }
        Some(files)
    }
}

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

/// One listener's `tls_cert_file`, `tls_key_file` and `tls_client_ca_file` in `[section]`.
fn check_server_tls(
    p: &mut Vec<ConfigProblem>,
    section: &str,
    (cert, key, ca): (&Option<PathBuf>, &Option<PathBuf>, &Option<PathBuf>),
) -> Option<quota_raft::tls::ServerFiles> {
    use quota_raft::tls::TlsError;
    let field = |f: &str| format!("{section}.{f}");
    let files = match (cert, key) {
        (None, None) => {
            if ca.is_some() {
                p.push(problem(
                    field("tls_client_ca_file"),
                    format!(
                        "needs TLS on the listener: set {0}.tls_cert_file and {0}.tls_key_file",
                        section
                    ),
                ));
            }
            return None;
        }
        (Some(cert), Some(key)) => quota_raft::tls::ServerFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: ca.clone(),
        },
        _ => {
            p.push(problem(
                field("tls_cert_file"),
                format!("set both {section}.tls_cert_file and {section}.tls_key_file, or neither"),
            ));
            return None;
        }
    };
    if let Err(e) = quota_raft::tls::check_server(&files) {
        let at = match &e {
            TlsError::Key { .. } => "tls_key_file",
            TlsError::Ca { .. } => "tls_client_ca_file",
            TlsError::Read { path, .. } if *path == files.key => "tls_key_file",
            TlsError::Read { path, .. } if Some(path) == files.client_ca.as_ref() => {
                "tls_client_ca_file"
            }
            _ => "tls_cert_file",
        };
        p.push(problem(field(at), e.to_string()));
        return None;
    }
    Some(files)
}

fn check_regions(
    p: &mut Vec<ConfigProblem>,
    regions: &[RegionConfig],
    me: Option<&RegionId>,
) -> Vec<RegionSettings> {
    let mut out = Vec::new();
    let mut apis = BTreeSet::new();
    let mut nodes = BTreeSet::new();
    for (i, r) in regions.iter().enumerate() {
        let field = |f: &str| format!("regions[{i}].{f}");
        let id = RegionId::new(r.id.clone())
            .map_err(|e| p.push(problem(field("id"), e.to_string())))
            .ok();
        if !apis.insert(r.api.as_str()) {
            p.push(problem(field("api"), format!("{} is used twice", r.api)));
        }
        if r.node_id == 0 {
            p.push(problem(field("node_id"), "must be at least 1"));
        } else if !nodes.insert(r.node_id) {
            p.push(problem(
                field("node_id"),
                format!("duplicate node id {}", r.node_id),
            ));
        }
        let api = parse_authority(p, &field("api"), &r.api);
        let peer = parse_authority(p, &field("peer"), &r.peer);
        if let (Some(id), Some(api), Some(peer)) = (id, api, peer) {
            let identity = match &r.identity {
                Some(uri) if !uri.contains("://") => {
                    p.push(problem(
                        field("identity"),
                        "a URI, e.g. spiffe://example.org/quotad/eu",
                    ));
                    uri.clone()
                }
                Some(uri) => uri.clone(),
                None => quota_raft::tls::region_identity(id.as_str()),
            };
            out.push(RegionSettings {
                id,
                node_id: r.node_id,
                api,
                peer,
                identity,
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

/// Which `[[regions]]` entry this daemon is: `node_id` when set (an entry of this region),
/// else this region's only entry. `None` for a single region, or when it cannot be told.
fn check_node_id(
    p: &mut Vec<ConfigProblem>,
    regions: &[RegionSettings],
    me: Option<&RegionId>,
    node_id: Option<u64>,
) -> Option<u64> {
    let me = me?;
    let mine: Vec<u64> = regions
        .iter()
        .filter(|r| r.id == *me)
        .map(|r| r.node_id)
        .collect();
    match (node_id, mine.as_slice()) {
        (None, []) => None,
        (None, [only]) => Some(*only),
        (None, many) => {
            p.push(problem(
                "node_id",
                format!(
                    "region {:?} runs {} daemons in [[regions]] (node ids {many:?}): name this one's",
                    me.as_str(),
                    many.len()
                ),
            ));
            None
        }
        (Some(n), _) if mine.contains(&n) => Some(n),
        (Some(n), _) if regions.is_empty() => {
            p.push(problem(
                "node_id",
                format!("{n} names an entry of [[regions]], which is empty"),
            ));
            None
        }
        (Some(n), _) => {
            p.push(problem(
                "node_id",
                format!(
                    "{n} is not a [[regions]] entry of region {:?} (its node ids: {mine:?})",
                    me.as_str()
                ),
            ));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::secrets::ENV_REDIS_SENTINEL_PASSWORD;
    use crate::secret::Secret;

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

    /// The Redis topology `text` resolves to.
    fn topology(text: &str) -> quota_store::Topology {
        let resolved = Config::from_toml(text)
            .unwrap()
            .resolve(&no_env, Vec::new())
            .unwrap();
        resolved.config.redis.unwrap().topology()
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
api = "127.0.0.1:1"
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
            "regions[1].api",
            "peer.token_file",
        ] {
            assert!(fields.contains(&f), "{f} missing from {fields:?}");
        }
        // The password in the URL is named as a problem but never echoed.
        assert!(!errs.to_string().contains("hunter2"));
    }

    /// Issue 31: a region of several daemons repeats its id, one `[[regions]]` entry per
    /// daemon, and each daemon names its own entry with `node_id`.
    #[test]
    fn each_daemon_of_a_region_names_its_entry() {
        let text = |me: &str| {
            format!(
                "region = \"a\"\n{me}\n\
                 [[regions]]\nid = \"a\"\nnode_id = 1\napi = \"127.0.0.1:1\"\npeer = \"127.0.0.1:2\"\n\
                 [[regions]]\nid = \"a\"\nnode_id = 2\napi = \"127.0.0.1:3\"\npeer = \"127.0.0.1:4\"\n\
                 [[regions]]\nid = \"b\"\nnode_id = 3\napi = \"127.0.0.1:5\"\npeer = \"127.0.0.1:6\"\n"
            )
        };
        let resolve = |t: &str| {
            Config::from_toml(t).unwrap().resolve(
                &|k| (k == ENV_PEER_TOKEN).then(|| "x".repeat(32)),
                Vec::new(),
            )
        };
        let s = resolve(&text("node_id = 2")).unwrap();
        assert_eq!(s.node_id, Some(2));
        assert_eq!(s.me().map(|m| m.api.as_str()), Some("127.0.0.1:3"));
        assert_eq!(s.region_ids().len(), 2, "each region once");
        for (me, says) in [
            ("", "runs 2 daemons"),
            ("node_id = 3", "not a [[regions]] entry of region \"a\""),
            ("node_id = 9", "not a [[regions]] entry"),
        ] {
            let e = resolve(&text(me)).unwrap_err();
            let p =
                e.0.iter()
                    .find(|p| p.field == "node_id")
                    .expect("node_id named");
            assert!(p.message.contains(says), "{me}: {}", p.message);
        }
    }

    #[test]
    fn a_lease_must_outlast_a_failover_in_a_multi_region_cluster() {
        let text = |lease: u64, margin: u64, raft: &str| {
            format!(
                "[coordination]\nreport_interval_ms = 500\nlease_ms = {lease}\n\
                 drift_margin_ms = {margin}\n[raft]\n{raft}\n\
                 [[regions]]\nid = \"a\"\nnode_id = 1\napi = \"127.0.0.1:1\"\npeer = \"127.0.0.1:2\"\n\
                 [[regions]]\nid = \"b\"\nnode_id = 2\napi = \"127.0.0.1:3\"\npeer = \"127.0.0.1:4\"\n"
            )
        };
        let refused = |t: String| problem_fields(&t).contains(&"coordination.lease_ms".to_string());
        // 6 s leases with the default Raft timings: 5.5 s usable, 9.25 s needed.
        assert!(refused(text(6_000, 500, "")));
        assert!(!refused(text(30_000, 2_000, "")));
        // Faster elections make the short lease work: 500 + 1 450 + 800 ≤ 5 500.
        let fast = "heartbeat_interval_ms = 100\nelection_timeout_min_ms = 400\n\
                    election_timeout_max_ms = 800";
        assert!(!refused(text(6_000, 500, fast)));
        let message = Config::from_toml(&text(6_000, 500, ""))
            .unwrap()
            .resolve(&no_env, Vec::new())
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("raft.election_timeout_max_ms 3000"),
            "{message}"
        );
    }

    /// Issue 36: the lease end stored in Redis is mapped onto Redis's clock; the margin covers
    /// the clocks' rate drift over a lease and a TIME round trip.
    #[test]
    fn the_margin_covers_the_store_clock_mapping() {
        let text = |lease: u64, margin: u64, redis_timeout: u64| {
            format!(
                "[redis]\nurl = \"redis://127.0.0.1:6379\"\ntimeout_ms = {redis_timeout}\n\
                 [coordination]\nreport_interval_ms = 500\nlease_ms = {lease}\n\
                 drift_margin_ms = {margin}\n[raft]\nheartbeat_interval_ms = 100\n\
                 election_timeout_min_ms = 400\nelection_timeout_max_ms = 800\n\
                 [[regions]]\nid = \"a\"\nnode_id = 1\napi = \"127.0.0.1:1\"\npeer = \"127.0.0.1:2\"\n\
                 [[regions]]\nid = \"b\"\nnode_id = 2\napi = \"127.0.0.1:3\"\npeer = \"127.0.0.1:4\"\n"
            )
        };
        let refused =
            |t: String| problem_fields(&t).contains(&"coordination.drift_margin_ms".to_string());
        // 300 s leases: 300 ms of rate drift, plus a 50 ms round trip.
        assert!(!refused(text(300_000, 350, 50)));
        assert!(refused(text(300_000, 349, 50)));
        assert!(refused(text(300_000, 350, 51)));
        // The defaults (30 s, 1 s margin, 50 ms timeout) leave room.
        assert!(!refused(text(30_000, 1_000, 50)));
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
        assert_eq!(
            topology(text),
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
        assert_eq!(
            topology(text),
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
    fn the_redis_timeout_stays_below_the_life_of_a_calls_once_key() {
        for (ms, ok) in [(0, false), (1, true), (9_999, true), (10_000, false)] {
            let fields = problem_fields(&format!("[redis]\ntimeout_ms = {ms}\n"));
            assert_eq!(fields.is_empty(), ok, "{ms}: {fields:?}");
            if !ok {
                assert_eq!(fields, ["redis.timeout_ms"]);
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
        for bad in ["999", "60001"] {
            assert_eq!(
                problem_fields(&format!("[envoy]\nrlqs_report_ms = {bad}\n")),
                ["envoy.rlqs_report_ms"]
            );
        }
        let rlqs = "[envoy]\nrlqs_unknown_bucket = \"deny_all\"\nrlqs_elsewhere = \"allow_all\"\n";
        assert!(problem_fields(rlqs).is_empty());
        let c = Config::from_toml(rlqs).unwrap();
        assert_eq!(
            (c.envoy.rlqs_unknown_bucket, c.envoy.rlqs_elsewhere),
            (
                crate::config::Blanket::DenyAll,
                crate::config::Blanket::AllowAll
            )
        );
        assert!(Config::from_toml("[envoy]\nrlqs_elsewhere = \"maybe\"\n").is_err());
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
    fn peer_tls_files_come_together_fit_and_name_this_region() {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, SanType};
        let dir = tempfile::tempdir().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
        let write = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p.display().to_string()
        };
        let ca_path = write("ca.pem", &ca.pem());
        let leaf = |id: &str| {
            let mut p = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
            p.subject_alt_names.push(SanType::URI(
                format!("quotad://region/{id}").try_into().unwrap(),
            ));
            let key = KeyPair::generate().unwrap();
            (p.signed_by(&key, &ca).unwrap().pem(), key.serialize_pem())
        };
        let (a_cert, a_key) = leaf("a");
        let (b_cert, _) = leaf("b");
        let (a_cert, a_key, b_cert) = (
            write("a.pem", &a_cert),
            write("a-key.pem", &a_key),
            write("b.pem", &b_cert),
        );
        let text = |peer: &str| {
            format!(
                "region = \"a\"\n[peer]\n{peer}\n\
                 [[regions]]\nid = \"a\"\nnode_id = 1\napi = \"127.0.0.1:7450\"\npeer = \"127.0.0.1:7451\"\n\
                 [[regions]]\nid = \"b\"\nnode_id = 2\napi = \"127.0.0.1:7460\"\npeer = \"127.0.0.1:7461\"\n"
            )
        };
        let env = |k: &str| (k == ENV_PEER_TOKEN).then(|| "peer-secret-0123456789".to_string());
        let fields = |peer: &str| -> Vec<String> {
            Config::from_toml(&text(peer))
                .unwrap()
                .resolve(&env, Vec::new())
                .err()
                .map(|e| e.0.into_iter().map(|p| p.field).collect())
                .unwrap_or_default()
        };
        let files = |cert: &str, key: &str| {
            format!(
                "tls_cert_file = \"{cert}\"\ntls_key_file = \"{key}\"\ntls_ca_file = \"{ca_path}\""
            )
        };
        assert!(fields(&files(&a_cert, &a_key)).is_empty());
        assert_eq!(
            fields(&format!("tls_cert_file = \"{a_cert}\"")),
            ["peer.tls_cert_file"],
            "all three or none"
        );
        // b's certificate with a's key: the key does not fit.
        assert_eq!(fields(&files(&b_cert, &a_key)), ["peer.tls_key_file"]);
        let garbage = write("garbage.pem", "not pem");
        assert_eq!(fields(&files(&garbage, &a_key)), ["peer.tls_cert_file"]);
        // A certificate naming another region than this one.
        let (b_cert2, b_key2) = leaf("b");
        let (b_cert2, b_key2) = (write("b2.pem", &b_cert2), write("b2-key.pem", &b_key2));
        assert_eq!(fields(&files(&b_cert2, &b_key2)), ["peer.tls_cert_file"]);
    }

    #[test]
    fn listener_tls_files_come_together_and_must_parse() {
        use rcgen::{CertificateParams, KeyPair};
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p.display().to_string()
        };
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let (cert, key, other_key) = (
            write("api.pem", &cert.pem()),
            write("api-key.pem", &key.serialize_pem()),
            write(
                "other-key.pem",
                &KeyPair::generate().unwrap().serialize_pem(),
            ),
        );
        let garbage = write("garbage.pem", "not pem");
        let fields = |section: &str| {
            problem_fields(&format!("[envoy]\nlisten = \"127.0.0.1:7452\"\n{section}"))
        };
        let both = format!("tls_cert_file = \"{cert}\"\ntls_key_file = \"{key}\"\n");
        assert!(fields(&format!("[api]\n{both}")).is_empty());
        assert!(fields(&format!("{both}tls_client_ca_file = \"{cert}\"")).is_empty());
        assert_eq!(
            fields(&format!("[api]\ntls_cert_file = \"{cert}\"")),
            ["api.tls_cert_file"],
            "both or neither"
        );
        assert_eq!(
            fields(&format!("[api]\ntls_client_ca_file = \"{cert}\"")),
            ["api.tls_client_ca_file"],
            "a client CA needs TLS"
        );
        assert_eq!(
            fields(&format!(
                "tls_cert_file = \"{cert}\"\ntls_key_file = \"{other_key}\""
            )),
            ["envoy.tls_key_file"]
        );
        assert_eq!(
            fields(&format!("{both}tls_client_ca_file = \"{garbage}\"")),
            ["envoy.tls_client_ca_file"]
        );
        assert_eq!(
            problem_fields(&format!("[envoy]\n{both}")),
            ["envoy.tls_cert_file"],
            "TLS without the listener"
        );
    }

    #[test]
    fn region_addresses_take_host_names() {
        let text = |peer: &str| {
            format!(
                "region = \"a\"\n\
                 [[regions]]\nid = \"a\"\nnode_id = 1\napi = \"quotad-a.quotad:7450\"\npeer = \"{peer}\"\n\
                 [[regions]]\nid = \"b\"\nnode_id = 2\napi = \"10.0.2.10:7450\"\npeer = \"10.0.2.10:7451\"\n"
            )
        };
        let env = |k: &str| (k == ENV_PEER_TOKEN).then(|| "peer-secret-0123456789".to_string());
        let fields = |peer: &str| -> Vec<String> {
            Config::from_toml(&text(peer))
                .unwrap()
                .resolve(&env, Vec::new())
                .err()
                .map(|e| e.0.into_iter().map(|p| p.field).collect())
                .unwrap_or_default()
        };
        assert!(fields("quotad-a-0.quotad-a.quotad.svc.cluster.local:7451").is_empty());
        assert!(fields("[::1]:7451").is_empty());
        for bad in [
            "quotad-a",
            "quotad-a:0",
            "127.0.0.1:0",
            "[::1]:0",
            "[::1]",
            "::1:7451",
            "quotad-a:65536",
            "-a.example:7451",
            "a..b:7451",
            "a_b:7451",
            ":7451",
        ] {
            assert_eq!(fields(bad), ["regions[0].peer"], "{bad}");
        }
    }
}
