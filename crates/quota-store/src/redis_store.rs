//! The Redis store: one EVALSHA per decision on the region's Redis.
//!
//! Scripts are compiled in (`include_str!`) and invoked by SHA; a NOSCRIPT reply (after
//! `SCRIPT FLUSH`, a restart or a failover) is answered by loading the script and retrying once,
//! so callers never see it. Standalone Redis goes through a `ConnectionManager`, which reconnects
//! on its own; Redis Cluster through the cluster client, which routes each call by its first key.
//! Every call is bounded by a timeout.
//!
//! Usage collection drains activity indexes (see `quota_core::keys`): one set on standalone
//! Redis; on Cluster one per slot, so a full collection walks all 16 384 slot indexes: 16 384
//! small script calls (issued [`CLUSTER_COLLECT_CONCURRENCY`] at a time) plus O(active
//! buckets) — a fixed cost per report interval, independent of the number of tenants.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use quota_core::keys::{self, StateKind};
use quota_core::Decision;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{FromRedisValue, RedisError, Script, ServerErrorKind, Value};

use crate::script::{self, Arg, COLLECT_BATCH_MAX};
use crate::{
    BucketRef, CheckRequest, SetParams, Store, StoreError, UsageRecord, DEFAULT_MIN_IDLE_TTL_MS,
};

/// Slot indexes drained at once during a cluster usage collection.
pub const CLUSTER_COLLECT_CONCURRENCY: usize = 64;

/// Standalone Redis or Redis Cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// One server (or a primary behind a fixed address).
    Standalone { url: String },
    /// A Redis Cluster reached through any of these nodes.
    Cluster { urls: Vec<String> },
    /// The master that these sentinels name for `master_name`, followed through failovers.
    Sentinel {
        urls: Vec<String>,
        master_name: String,
    },
}

/// How to reach Redis and how long to wait for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisStoreConfig {
    pub topology: Topology,
    /// Upper bound on every call, connection set-up included.
    pub timeout: Duration,
    /// Minimum idle lifetime of a bucket or window state (ms precision, at least 1 ms): keeps
    /// the usage counters of an idle bucket until the next collection, so collect more often.
    pub min_idle_ttl: Duration,
    /// How to authenticate (`AUTH`), if at all: kept out of the URL, so a password needs no
    /// URL encoding and never shows in an address that is logged.
    pub credentials: Option<Credentials>,
    /// Certificates for a `rediss://` address; without them a TLS address is verified against
    /// the system's trusted roots.
    pub tls: Option<Tls>,
    /// Sentinel only: how to authenticate to the sentinels themselves (`credentials` are the
    /// master's).
    pub sentinel_credentials: Option<Credentials>,
}

/// TLS material for `rediss://`, PEM-encoded.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Tls {
    /// CA certificates to trust instead of the system's (e.g. a private CA).
    pub ca_pem: Option<Vec<u8>>,
    /// A client certificate chain and its key, for a Redis with `tls-auth-clients yes`.
    pub client: Option<ClientIdentity>,
}

/// A client certificate chain and its private key, PEM-encoded.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("ca_pem", &self.ca_pem.as_ref().map(|_| "<pem>"))
            .field("client", &self.client)
            .finish()
    }
}

impl fmt::Debug for ClientIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientIdentity")
            .field("cert_pem", &"<pem>")
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// One PEM of [`Tls`], to say which one is wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsPart {
    Ca,
    ClientCert,
    ClientKey,
}

impl TlsPart {
    fn name(self) -> &'static str {
        match self {
            Self::Ca => "TLS CA certificates",
            Self::ClientCert => "TLS client certificate",
            Self::ClientKey => "TLS client key",
        }
    }
}

impl Tls {
    /// The first PEM that does not hold what it should, and why: redis-rs would take a CA
    /// file without a certificate as an empty trust store.
    pub fn problem(&self) -> Option<(TlsPart, String)> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = |pem: &[u8]| match CertificateDer::pem_slice_iter(pem)
            .try_fold(0, |n, c| c.map(|_| n + 1))
        {
            Ok(0) => Some("no PEM certificate found".to_string()),
            Ok(_) => None,
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = self.ca_pem.as_deref().and_then(certs) {
            return Some((TlsPart::Ca, why));
        }
        let c = self.client.as_ref()?;
        if let Some(why) = certs(&c.cert_pem) {
            return Some((TlsPart::ClientCert, why));
        }
        // The key's own error would quote nothing of it, but say only that it is bad.
        PrivateKeyDer::from_pem_slice(&c.key_pem)
            .is_err()
            .then(|| (TlsPart::ClientKey, "no PEM private key found".to_string()))
    }

    /// [`problem`](Self::problem) as an error.
    pub fn check(&self) -> Result<(), StoreError> {
        match self.problem() {
            None => Ok(()),
            Some((part, why)) => Err(StoreError::Invalid {
                reason: format!("{}: {why}", part.name()),
            }),
        }
    }

    fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self.client.as_ref().map(|c| redis::ClientTlsConfig {
                client_cert: c.cert_pem.clone(),
                client_key: c.key_pem.clone(),
            }),
            root_cert: self.ca_pem.clone(),
        }
    }
}

/// rustls needs one process-wide crypto provider; redis-rs asks for it when it builds a TLS
/// client. Installs ring's unless the process chose one.
fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race with another installer is fine: one is installed either way.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// An ACL user (or the `default` user when `username` is `None`) and its password.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: Option<String>,
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// Checks that `url` is a Redis address this store can use (`redis://host:port/db`), without
/// connecting: for configuration checks.
pub fn check_url(url: &str) -> Result<(), StoreError> {
    redis::IntoConnectionInfo::into_connection_info(url)
        .map(drop)
        .map_err(|e| StoreError::Invalid {
            reason: format!("redis url: {e}"),
        })
}

impl RedisStoreConfig {
    /// Redis at `topology` with the default 250 ms timeout.
    pub fn new(topology: Topology) -> Self {
        Self {
            topology,
            timeout: DEFAULT_TIMEOUT,
            min_idle_ttl: DEFAULT_MIN_IDLE_TTL,
            credentials: None,
            tls: None,
            sentinel_credentials: None,
        }
    }

    /// Standalone Redis at `url` with the default 250 ms timeout.
    pub fn standalone(url: impl Into<String>) -> Self {
        Self::new(Topology::Standalone { url: url.into() })
    }

    /// Redis Cluster through `urls` with the default 250 ms timeout.
    pub fn cluster(urls: Vec<String>) -> Self {
        Self::new(Topology::Cluster { urls })
    }

    /// The same with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The same with another minimum idle lifetime of state.
    pub fn with_min_idle_ttl(mut self, ttl: Duration) -> Self {
        self.min_idle_ttl = ttl;
        self
    }

    /// The same, authenticating with `credentials` (they replace any in the URL).
    pub fn with_credentials(mut self, credentials: Credentials) -> Self {
        self.credentials = Some(credentials);
        self
    }

    /// The same, authenticating to the sentinels with `credentials` (Sentinel only).
    pub fn with_sentinel_credentials(mut self, credentials: Credentials) -> Self {
        self.sentinel_credentials = Some(credentials);
        self
    }

    /// The same with TLS certificates (the addresses must be `rediss://`).
    pub fn with_tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }
}

/// The default minimum idle lifetime of a state ([`DEFAULT_MIN_IDLE_TTL_MS`]).
pub const DEFAULT_MIN_IDLE_TTL: Duration = Duration::from_millis(DEFAULT_MIN_IDLE_TTL_MS);

/// The default bound on a call: far above a healthy local round trip, short enough that the
/// daemon's circuit breaker reacts within a second.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

/// The least [`RedisStore::reachable`] waits: time for a first connection's retries.
pub const CONNECT_WAIT: Duration = Duration::from_secs(1);

/// One call's connection.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(LazyCluster),
    Sentinel(Arc<SentinelMaster>),
}

/// Where calls get their connection.
enum Source {
    Single(Arc<Standalone>),
    Cluster(LazyCluster),
    Sentinel(Arc<SentinelMaster>),
}

/// How often the sentinels are asked again at most while calls keep failing (a master that
/// is down stays named until the sentinels agree to fail it over).
const SENTINEL_ASK_INTERVAL: Duration = Duration::from_millis(100);

/// The master some sentinels name, asked for by the first call that needs it and again after
/// a call meets a sign of failover: the master unreachable or too slow, or `READONLY` (it was
/// demoted to a replica).
struct SentinelMaster {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    config: ConnectionManagerConfig,
    current: ArcSwapOption<SentinelNamed>,
    /// Set by a call that met a sign of failover: the next call asks the sentinels again.
    stale: AtomicBool,
    /// When the sentinels were last asked.
    asked: Mutex<Option<Instant>>,
}

/// The master the sentinels last named (`host:port`) and the connection to it.
struct SentinelNamed {
    addr: String,
    manager: ConnectionManager,
}

impl SentinelMaster {
    /// The current master's connection, asking the sentinels first if there is none or it is
    /// stale (at most once per [`SENTINEL_ASK_INTERVAL`]).
    async fn manager(&self) -> redis::RedisResult<ConnectionManager> {
        let fresh = |this: &Self| {
            let current = this.current.load_full()?;
            let recent = this
                .asked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some_and(|at| at.elapsed() < SENTINEL_ASK_INTERVAL);
            (!this.stale.load(Ordering::Relaxed) || recent).then(|| current.manager.clone())
        };
        if let Some(m) = fresh(self) {
            return Ok(m);
        }
        let mut sentinel = self.sentinel.lock().await;
        // Another call may have asked while this one waited.
        if let Some(m) = fresh(self) {
            return Ok(m);
        }
        *self.asked.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        let client = sentinel.async_get_client().await?;
        let addr = client.get_connection_info().addr().to_string();
        self.stale.store(false, Ordering::Relaxed);
        // The same master as before: keep its connection. A new one would start over with a
        // handshake (a TLS one is slow), and a call timing out on that would have the
        // sentinels asked again, another connection made, and so on without end.
        if let Some(current) = self.current.load_full().filter(|c| c.addr == addr) {
            return Ok(current.manager.clone());
        }
        let manager = ConnectionManager::new_lazy_with_config(client, self.config.clone())?;
        self.current.store(Some(Arc::new(SentinelNamed {
            addr,
            manager: manager.clone(),
        })));
        Ok(manager)
    }
}

/// Whether an error may mean the master changed: it is gone, or it became a replica.
fn failover_sign(e: &RedisError) -> bool {
    e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_io_error()
        || e.is_timeout()
        || e.code() == Some("READONLY")
}

/// The standalone connection manager, replaced after an authentication failure: redis-rs's
/// manager reconnects after I/O errors only, so one refused once (a password changed under
/// it, an ACL loaded late) would go on failing after Redis is put right.
struct Standalone {
    client: redis::Client,
    config: ConnectionManagerConfig,
    current: ArcSwap<ConnectionManager>,
}

impl Standalone {
    /// Replaces `refused` (unless another call already has) with a manager that connects
    /// afresh on first use.
    fn replace(&self, refused: &Arc<ConnectionManager>) {
        match ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone()) {
            Ok(fresh) => {
                self.current.compare_and_swap(refused, Arc::new(fresh));
            }
            // The settings that built the first manager build this one.
            Err(e) => tracing::warn!(error = %e, "Could not rebuild the Redis connection."),
        }
    }
}

/// A Redis Cluster connection made by the first call that needs it, so a store can be opened
/// while the cluster is unreachable; a failed attempt is made again by the next call. (A
/// standalone `ConnectionManager` made lazily does the same on its own.)
#[derive(Clone)]
struct LazyCluster {
    client: Arc<ClusterClient>,
    conn: Arc<tokio::sync::OnceCell<ClusterConnection>>,
}

impl LazyCluster {
    /// The connection, connecting first if no call has yet.
    async fn get(&self) -> redis::RedisResult<ClusterConnection> {
        self.conn
            .get_or_try_init(|| self.client.get_async_connection())
            .await
            .cloned()
    }

    /// Sends `cmd` where `routing` says (e.g. to every master), connecting first if need be.
    async fn route(&self, cmd: redis::Cmd, routing: RoutingInfo) -> redis::RedisResult<Value> {
        self.get().await?.route_command(cmd, routing).await
    }
}

/// Keys one `SCAN` step looks at: large enough that a sweep of a big keyspace takes few round
/// trips, small enough that no step holds Redis for long.
const SCAN_COUNT: usize = 1000;

/// Either connection, so one code path issues every command.
impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => {
                Box::pin(async move { c.get().await?.req_packed_command(cmd).await })
            }
            Conn::Sentinel(s) => {
                Box::pin(async move { s.manager().await?.req_packed_command(cmd).await })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => {
                Box::pin(
                    async move { c.get().await?.req_packed_commands(cmd, offset, count).await },
                )
            }
            Conn::Sentinel(s) => Box::pin(async move {
                s.manager()
                    .await?
                    .req_packed_commands(cmd, offset, count)
                    .await
            }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            // Redis Cluster has database 0 only; the sentinels' master is used on database 0.
            Conn::Cluster(_) | Conn::Sentinel(_) => 0,
        }
    }
}

#[derive(Debug)]
struct Scripts {
    token_bucket: Script,
    sliding_window: Script,
    collect_usage: Script,
    set_params: Script,
}

/// The Redis-backed store. Cheap to clone; clones share connections.
#[derive(Clone)]
pub struct RedisStore {
    /// Replaced as a whole when new credentials are taken ([`RedisStore::use_credentials`]).
    source: Arc<ArcSwap<Source>>,
    /// What built `source`, to build it again with other credentials.
    config: Arc<RedisStoreConfig>,
    scripts: Arc<Scripts>,
    timeout: Duration,
    /// The minimum idle TTL argument of the decision scripts (ms, decimal).
    min_idle_ttl_ms: Arc<str>,
    /// Cluster only: the hash tag of every slot, for the per-slot activity indexes.
    slot_tags: Option<Arc<Vec<String>>>,
    /// Cluster only: the slot the next collection starts at, so a small `max` cannot starve
    /// the high slots.
    next_slot: Arc<AtomicUsize>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("topology", &self.topology_name())
            .field("timeout", &self.timeout)
            .finish()
    }
}

fn unavailable(e: &RedisError) -> StoreError {
    StoreError::Unavailable {
        reason: e.to_string(),
    }
}

/// Whether Redis refused this client's credentials or permissions. redis-rs's Cluster client
/// reports a refusal met while making its first connections only as text inside an I/O error.
fn refused(e: &RedisError) -> bool {
    const REFUSALS: [&str; 4] = ["AuthenticationFailed", "NOAUTH", "WRONGPASS", "NOPERM"];
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || e.code().is_some_and(|code| REFUSALS.contains(&code))
        || (e.kind() == redis::ErrorKind::Io
            && e.detail()
                .is_some_and(|d| REFUSALS.iter().any(|r| d.contains(r))))
}

/// Maps a Redis error: server replies (script errors) vs. transport problems.
fn from_redis(e: &RedisError) -> StoreError {
    if refused(e) {
        return StoreError::Refused {
            reason: e.to_string(),
        };
    }
    match e.kind() {
        redis::ErrorKind::Server(_) | redis::ErrorKind::Extension => StoreError::Script {
            message: match (e.code(), e.detail()) {
                (Some(code), Some(detail)) => format!("{code} {detail}"),
                _ => e.to_string(),
            },
        },
        redis::ErrorKind::Parse | redis::ErrorKind::UnexpectedReturnType => StoreError::Protocol {
            reason: e.to_string(),
        },
        _ => unavailable(e),
    }
}

/// The connection(s) `config` describes, made lazily: fails only on a malformed address or
/// TLS material.
fn build_source(config: &RedisStoreConfig) -> Result<Source, StoreError> {
    Ok(match &config.topology {
        Topology::Standalone { url } => {
            let invalid = |e: RedisError| StoreError::Invalid {
                reason: format!("redis url: {e}"),
            };
            let mut info =
                redis::IntoConnectionInfo::into_connection_info(url.as_str()).map_err(invalid)?;
            if let Some(c) = &config.credentials {
                let mut redis = info.redis_settings().clone().set_password(&c.password);
                if let Some(user) = &c.username {
                    redis = redis.set_username(user);
                }
                info = info.set_redis_settings(redis);
            }
            let tls_addr = is_tls(info.addr());
            if tls_addr {
                ensure_crypto_provider();
            }
            let client = match &config.tls {
                Some(tls) if tls_addr => {
                    tls.check()?;
                    redis::Client::build_with_tls(info, tls.certificates()).map_err(|e| {
                        StoreError::Invalid {
                            reason: format!("redis TLS settings: {e}"),
                        }
                    })?
                }
                Some(_) => {
                    return Err(StoreError::Invalid {
                        reason: "TLS certificates need a rediss:// address".into(),
                    })
                }
                None => redis::Client::open(info).map_err(invalid)?,
            };
            let cfg = manager_config(config.timeout);
            let m = ConnectionManager::new_lazy_with_config(client.clone(), cfg.clone()).map_err(
                |e| StoreError::Invalid {
                    reason: format!("redis connection settings: {e}"),
                },
            )?;
            let single = Standalone {
                client,
                config: cfg,
                current: ArcSwap::from_pointee(m),
            };
            Source::Single(Arc::new(single))
        }
        Topology::Cluster { urls } => {
            let mut builder = ClusterClient::builder(urls.iter().map(String::as_str))
                .connection_timeout(config.timeout)
                .response_timeout(config.timeout);
            if let Some(c) = &config.credentials {
                builder = builder.password(c.password.clone());
                if let Some(user) = &c.username {
                    builder = builder.username(user.clone());
                }
            }
            if urls.iter().any(|u| u.starts_with("rediss://")) {
                ensure_crypto_provider();
                if let Some(tls) = &config.tls {
                    tls.check()?;
                    builder = builder.certs(tls.certificates());
                }
            } else if config.tls.is_some() {
                return Err(StoreError::Invalid {
                    reason: "TLS certificates need rediss:// addresses".into(),
                });
            }
            let client = builder.build().map_err(|e| StoreError::Invalid {
                reason: format!("cluster urls: {e}"),
            })?;
            let lazy = LazyCluster {
                client: Arc::new(client),
                conn: Arc::new(tokio::sync::OnceCell::new()),
            };
            Source::Cluster(lazy)
        }
        Topology::Sentinel { urls, master_name } => {
            let addrs = urls
                .iter()
                .map(|url| {
                    let info = redis::IntoConnectionInfo::into_connection_info(url.as_str())
                        .map_err(|e| StoreError::Invalid {
                            reason: format!("sentinel url: {e}"),
                        })?;
                    let r = info.redis_settings();
                    if r.password().is_some() || r.username().is_some() {
                        return Err(StoreError::Invalid {
                            reason: "sentinel urls must not carry credentials: use \
                                     with_sentinel_credentials"
                                .into(),
                        });
                    }
                    Ok(info.addr().clone())
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            let tls = match addrs.iter().filter(|a| is_tls(a)).count() {
                0 => false,
                n if n == addrs.len() => true,
                _ => {
                    return Err(StoreError::Invalid {
                        reason: "sentinel urls must all be rediss:// or all redis://".into(),
                    })
                }
            };
            let invalid_sentinel = |e: redis::RedisError| StoreError::Invalid {
                reason: format!("sentinel settings: {e}"),
            };
            let mut b = SentinelClientBuilder::new(addrs, master_name, SentinelServerType::Master)
                .map_err(invalid_sentinel)?;
            if let Some(c) = &config.credentials {
                b = b.set_client_to_redis_password(&c.password);
                if let Some(user) = &c.username {
                    b = b.set_client_to_redis_username(user);
                }
            }
            if let Some(c) = &config.sentinel_credentials {
                b = b.set_client_to_sentinel_password(&c.password);
                if let Some(user) = &c.username {
                    b = b.set_client_to_sentinel_username(user);
                }
            }
            match (&config.tls, tls) {
                // Sentinels reached over TLS name masters that serve TLS (`tls-replication`).
                (certs, true) => {
                    ensure_crypto_provider();
                    b = b.set_client_to_redis_tls_mode(redis::TlsMode::Secure);
                    if let Some(certs) = certs {
                        certs.check()?;
                        b = b
                            .set_client_to_sentinel_certificates(certs.certificates())
                            .set_client_to_redis_certificates(certs.certificates());
                    }
                }
                (Some(_), false) => {
                    return Err(StoreError::Invalid {
                        reason: "TLS certificates need rediss:// addresses".into(),
                    })
                }
                (None, false) => {}
            }
            let sentinel = b.build().map_err(invalid_sentinel)?;
            Source::Sentinel(Arc::new(SentinelMaster {
                sentinel: tokio::sync::Mutex::new(sentinel),
                config: manager_config(config.timeout),
                current: ArcSwapOption::empty(),
                stale: AtomicBool::new(false),
                asked: Mutex::new(None),
            }))
        }
    })
}

fn is_tls(addr: &redis::ConnectionAddr) -> bool {
    matches!(addr, redis::ConnectionAddr::TcpTls { .. })
}

/// How a connection manager connects and retries: every call is bounded as a whole
/// (`bounded`, retry included), so there is no per-response timer as well.
fn manager_config(timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(None)
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500))
}

impl RedisStore {
    /// Prepares the store without waiting for Redis: the first call connects, and one made
    /// while Redis is unreachable fails as [`StoreError::Unavailable`] (or `Timeout`) and
    /// leaves the next call to try again. A process can therefore start while its Redis is
    /// down. Fails only on a malformed address or TLS material. Scripts are loaded lazily
    /// too: the first EVALSHA that meets NOSCRIPT loads its script. Call it within a Tokio
    /// runtime (the standalone connection manager spawns a task).
    pub fn open(config: RedisStoreConfig) -> Result<Self, StoreError> {
        let source = build_source(&config)?;
        let slot_tags = match config.topology {
            Topology::Standalone { .. } | Topology::Sentinel { .. } => None,
            Topology::Cluster { .. } => Some(Arc::new(keys::slot_tags())),
        };
        let scripts = Arc::new(Scripts {
            token_bucket: Script::new(script::TOKEN_BUCKET_LUA),
            sliding_window: Script::new(script::SLIDING_WINDOW_LUA),
            collect_usage: Script::new(script::COLLECT_USAGE_LUA),
            set_params: Script::new(script::SET_PARAMS_LUA),
        });
        let min_idle_ttl_ms = (config.min_idle_ttl.as_millis() as u64)
            .clamp(1, quota_core::bucket::MAX_CAPACITY_UT)
            .to_string()
            .into();
        Ok(Self {
            source: Arc::new(ArcSwap::from_pointee(source)),
            timeout: config.timeout,
            config: Arc::new(config),
            scripts,
            min_idle_ttl_ms,
            slot_tags,
            next_slot: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// `standalone`, `cluster` or `sentinel`, for status pages.
    pub fn topology_name(&self) -> &'static str {
        match **self.source.load() {
            Source::Single(_) => "standalone",
            Source::Cluster(_) => "cluster",
            Source::Sentinel(_) => "sentinel",
        }
    }

    /// [`open`](Self::open), then waits for Redis to answer (see [`reachable`](Self::reachable)):
    /// for callers that cannot go on without it.
    pub async fn connect(config: RedisStoreConfig) -> Result<Self, StoreError> {
        let store = Self::open(config)?;
        store.reachable().await?;
        Ok(store)
    }

    /// Whether Redis answers a `PING` (every master of a Cluster), connecting first if need be,
    /// within the call timeout but at least [`CONNECT_WAIT`]: a first connection may take
    /// longer than a call.
    pub async fn reachable(&self) -> Result<(), StoreError> {
        self.ping(&self.source.load_full()).await
    }

    /// Switches to `credentials` once Redis takes them: a connection made with them must
    /// answer a `PING` (every master of a Cluster) first, so a password Redis does not yet
    /// accept never replaces one it does. Until then, and when Redis refuses them, calls go on
    /// over the current connection; the error says why they were not taken.
    pub async fn use_credentials(&self, credentials: Credentials) -> Result<(), StoreError> {
        let mut config = (*self.config).clone();
        config.credentials = Some(credentials);
        let candidate = build_source(&config)?;
        self.ping(&candidate).await?;
        self.source.store(Arc::new(candidate));
        Ok(())
    }

    /// PINGs Redis through `source`, as [`reachable`](Self::reachable) describes.
    async fn ping(&self, source: &Source) -> Result<(), StoreError> {
        let wait = self.timeout.max(CONNECT_WAIT);
        let ping = async {
            match source {
                Source::Single(s) => {
                    let used = s.current.load_full();
                    let r = redis::cmd("PING")
                        .query_async::<Value>(&mut (*used).clone())
                        .await;
                    if r.as_ref()
                        .is_err_and(|e| e.kind() == redis::ErrorKind::AuthenticationFailed)
                    {
                        s.replace(&used);
                    }
                    r
                }
                Source::Cluster(c) => {
                    let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                    c.route(redis::cmd("PING"), all).await
                }
                Source::Sentinel(s) => {
                    let r = match s.manager().await {
                        Ok(mut m) => redis::cmd("PING").query_async::<Value>(&mut m).await,
                        Err(e) => Err(e),
                    };
                    if r.as_ref().is_err_and(failover_sign) {
                        s.stale.store(true, Ordering::Relaxed);
                    }
                    r
                }
            }
        };
        match tokio::time::timeout(wait, ping).await {
            Ok(r) => r.map(drop).map_err(|e| from_redis(&e)),
            Err(_) => Err(StoreError::Timeout {
                ms: wait.as_millis() as u64,
            }),
        }
    }

    /// A connection for one call, and the standalone manager it came from.
    fn connection(&self) -> (Conn, Option<Arc<ConnectionManager>>) {
        match &**self.source.load() {
            Source::Single(s) => {
                let m = s.current.load_full();
                (Conn::Single((*m).clone()), Some(m))
            }
            Source::Cluster(c) => (Conn::Cluster(c.clone()), None),
            Source::Sentinel(s) => (Conn::Sentinel(s.clone()), None),
        }
    }

    /// Passes a call's result on, replacing the standalone manager `used` when Redis refused
    /// its credentials (see [`Standalone`]), and having the sentinels asked again after a sign
    /// of failover (see [`SentinelMaster`]).
    fn after<T>(
        &self,
        r: redis::RedisResult<T>,
        used: Option<&Arc<ConnectionManager>>,
    ) -> redis::RedisResult<T> {
        if let Err(e) = &r {
            match (&**self.source.load(), used) {
                (Source::Single(s), Some(used))
                    if e.kind() == redis::ErrorKind::AuthenticationFailed =>
                {
                    s.replace(used)
                }
                (Source::Sentinel(s), _) if failover_sign(e) => {
                    s.stale.store(true, Ordering::Relaxed)
                }
                _ => {}
            }
        }
        r
    }

    /// The activity index a state key is listed in.
    fn index_key(&self, state_key: &str) -> String {
        match &self.slot_tags {
            None => keys::ACTIVE_INDEX.to_string(),
            Some(tags) => {
                keys::slot_index_key_for_tag(&tags[usize::from(keys::key_slot(state_key))])
            }
        }
    }

    /// Awaits a Redis call within the configured timeout, mapping its errors.
    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(r) => r.map_err(|e| from_redis(&e)),
            Err(_) => {
                // A master that stopped answering without closing its connections.
                if let Source::Sentinel(s) = &**self.source.load() {
                    s.stale.store(true, Ordering::Relaxed);
                }
                Err(StoreError::Timeout {
                    ms: self.timeout.as_millis() as u64,
                })
            }
        }
    }

    /// Runs `script` with EVALSHA (loading it on NOSCRIPT) within the timeout.
    ///
    /// The command is built straight into one `Cmd` (a `ScriptInvocation` would first copy every
    /// key and argument into a vector of its own): this is the decision hot path.
    async fn invoke<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[Arg<'_>],
    ) -> Result<T, StoreError> {
        let hash = script.get_hash();
        let len = keys.iter().map(|k| k.len()).sum::<usize>()
            + args.iter().map(Arg::max_len).sum::<usize>()
            + hash.len()
            + 16;
        let mut cmd = redis::Cmd::with_capacity(3 + keys.len() + args.len(), len);
        cmd.arg("EVALSHA")
            .arg(hash)
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        let call = async {
            let once = || async {
                let (mut conn, used) = self.connection();
                let r = match cmd.query_async(&mut conn).await {
                    Err(e) if e.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript) => {
                        match script.prepare_invoke().load_async(&mut conn).await {
                            Ok(_) => cmd.query_async(&mut conn).await,
                            Err(e) => Err(e),
                        }
                    }
                    r => r,
                };
                self.after(r, used.as_ref())
            };
            match once().await {
                // A connection found dead (e.g. Redis restarted) is replaced by the manager;
                // one retry on the new connection hides that from the caller. If the script did
                // run before the connection broke, the retry counts the cost twice: that errs
                // towards denying, never towards over-admitting.
                Err(e)
                    if e.is_connection_dropped()
                        || e.is_connection_refusal()
                        || e.is_io_error() =>
                {
                    once().await
                }
                r => r,
            }
        };
        self.bounded(call).await
    }

    /// Runs one plain command within the timeout.
    async fn command<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, StoreError> {
        let (mut conn, used) = self.connection();
        let call = async { self.after(cmd.query_async(&mut conn).await, used.as_ref()) };
        self.bounded(call).await
    }

    /// Takes up to `max` keys from one activity index; returns how many were taken and the
    /// usage of those still alive.
    async fn collect_index(
        &self,
        index: &str,
        max: usize,
    ) -> Result<(usize, Vec<UsageRecord>), StoreError> {
        let n = Arg::Num(max.clamp(1, COLLECT_BATCH_MAX) as u64);
        let reply: Vec<Value> = self
            .invoke(&self.scripts.collect_usage, &[index], &[n])
            .await?;
        parse_usage(reply)
    }

    /// The run ids of the servers behind this store, sorted and joined (every master of a
    /// Cluster). A restarted or failed-over server has a new one.
    async fn run_ids(&self) -> Result<String, StoreError> {
        let mut info = redis::cmd("INFO");
        info.arg("server");
        let reply: Value = match &*self.source.load_full() {
            Source::Single(_) | Source::Sentinel(_) => self.command(&info).await?,
            Source::Cluster(c) => {
                let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                self.bounded(c.route(info, all)).await?
            }
        };
        let mut ids = Vec::new();
        info_values(&reply, "run_id", &mut ids);
        if ids.is_empty() {
            return Err(StoreError::Protocol {
                reason: "INFO server reported no run_id".into(),
            });
        }
        ids.sort_unstable();
        Ok(ids.join(","))
    }

    /// Every bucket whose parameters this Redis holds, on every master of a Cluster, by `SCAN`:
    /// O(keys in the database), for the agent's sweeps (per store instance and hourly).
    async fn params_held(&self) -> Result<Vec<BucketRef>, StoreError> {
        let mut out = Vec::new();
        match &*self.source.load_full() {
            Source::Single(_) | Source::Sentinel(_) => self.scan_params(None, &mut out).await?,
            Source::Cluster(c) => {
                // A command without a reply policy sent to every master answers with a map
                // keyed by each node's address.
                let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                let reply: Value = self.bounded(c.route(redis::cmd("PING"), all)).await?;
                let Value::Map(nodes) = reply else {
                    return Err(StoreError::Protocol {
                        reason: "PING to every master gave no map of nodes".into(),
                    });
                };
                for (addr, _) in nodes {
                    let addr: String = redis::from_redis_value(addr).map_err(|e| protocol(&e))?;
                    let node = addr
                        .rsplit_once(':')
                        .and_then(|(host, port)| Some((host.to_string(), port.parse().ok()?)))
                        .ok_or_else(|| StoreError::Protocol {
                            reason: format!("node address {addr:?}"),
                        })?;
                    self.scan_params(Some(node), &mut out).await?;
                }
            }
        }
        Ok(out)
    }

    /// SCANs one server (a Cluster node by address) for parameters keys into `out`.
    async fn scan_params(
        &self,
        node: Option<(String, u16)>,
        out: &mut Vec<BucketRef>,
    ) -> Result<(), StoreError> {
        let mut cursor: u64 = 0;
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(keys::PARAMS_KEY_PATTERN)
                .arg("COUNT")
                .arg(SCAN_COUNT);
            let reply: Value = match (&*self.source.load_full(), &node) {
                (Source::Cluster(c), Some((host, port))) => {
                    let at = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.clone(),
                        port: *port,
                    });
                    self.bounded(c.route(scan, at)).await?
                }
                _ => self.command(&scan).await?,
            };
            let (next, found): (u64, Vec<String>) =
                redis::from_redis_value(reply).map_err(|e| protocol(&e))?;
            out.extend(found.iter().filter_map(|k| {
                let (tenant, policy, version) = keys::parse_params_key(k)?;
                Some(BucketRef {
                    tenant,
                    policy,
                    version,
                })
            }));
            if next == 0 {
                return Ok(());
            }
            cursor = next;
        }
    }

    /// Reads one field of `INFO` (e.g. `used_memory`) from a standalone server.
    pub async fn info_field(
        &self,
        section: &str,
        field: &str,
    ) -> Result<Option<String>, StoreError> {
        let info: Value = self.command(redis::cmd("INFO").arg(section)).await?;
        let mut values = Vec::new();
        info_values(&info, field, &mut values);
        Ok(values.into_iter().next())
    }
}

/// The values of every `field:` line in an `INFO` reply: one text, or a map or array of them
/// (one per node of a Cluster).
fn info_values(v: &Value, field: &str, out: &mut Vec<String>) {
    let mut from_text = |text: &str| {
        out.extend(text.lines().filter_map(|l| {
            l.strip_prefix(field)
                .and_then(|rest| rest.strip_prefix(':'))
                .map(|v| v.trim().to_string())
        }));
    };
    match v {
        Value::BulkString(b) => from_text(&String::from_utf8_lossy(b)),
        Value::VerbatimString { text, .. } => from_text(text),
        Value::Array(items) | Value::Set(items) => {
            items.iter().for_each(|i| info_values(i, field, out));
        }
        Value::Map(pairs) => pairs.iter().for_each(|(_, i)| info_values(i, field, out)),
        _ => {}
    }
}

/// Decodes `{taken, key, admitted, denied, …}`; keys this schema did not write are skipped.
fn protocol(e: &redis::ParsingError) -> StoreError {
    StoreError::Protocol {
        reason: e.to_string(),
    }
}

fn parse_usage(reply: Vec<Value>) -> Result<(usize, Vec<UsageRecord>), StoreError> {
    let parse = |e: redis::ParsingError| protocol(&e);
    let mut it = reply.into_iter();
    let taken: usize = match it.next() {
        Some(v) => redis::from_redis_value(v).map_err(parse)?,
        None => {
            return Err(StoreError::Protocol {
                reason: "empty usage reply".into(),
            })
        }
    };
    let reply: Vec<Value> = it.collect();
    if !reply.len().is_multiple_of(3) {
        return Err(StoreError::Protocol {
            reason: format!("usage reply of {} items", reply.len()),
        });
    }
    let mut out = Vec::with_capacity(reply.len() / 3);
    let mut it = reply.into_iter();
    while let (Some(k), Some(a), Some(d)) = (it.next(), it.next(), it.next()) {
        let key: String = redis::from_redis_value(k).map_err(parse)?;
        let admitted: u64 = redis::from_redis_value(a).map_err(parse)?;
        let denied: u64 = redis::from_redis_value(d).map_err(parse)?;
        match keys::parse_state_key(&key) {
            Some((_, tenant, policy, version)) => {
                out.push(UsageRecord {
                    bucket: BucketRef {
                        tenant,
                        policy,
                        version,
                    },
                    admitted,
                    denied,
                });
            }
            None => tracing::warn!("Skipped a foreign key in the activity index."),
        }
    }
    Ok((taken, out))
}

impl Store for RedisStore {
    async fn check(&self, req: &CheckRequest) -> Result<Decision, StoreError> {
        req.validate()?;
        let kind = req.limit.kind();
        let state = req.bucket.state_key(kind);
        let params = req.bucket.params_key();
        let index = self.index_key(&state);
        let args = script::decision_args(req, &self.min_idle_ttl_ms);
        let s = match kind {
            StateKind::Bucket => &self.scripts.token_bucket,
            StateKind::Window => &self.scripts.sliding_window,
        };
        let reply: Vec<i64> = self.invoke(s, &[&state, &params, &index], &args).await?;
        script::decision_from_reply(&reply)
    }

    async fn set_params(&self, req: &SetParams) -> Result<(), StoreError> {
        req.validate()?;
        // One script: the params hash and the copy inside the token-bucket state change
        // together (both keys share the tenant's hash tag, so one slot).
        let key = req.bucket.params_key();
        let state = req.bucket.state_key(StateKind::Bucket);
        let args = script::set_params_args(req, &self.min_idle_ttl_ms);
        let args: Vec<Arg> = args.iter().map(|a| Arg::Str(a)).collect();
        let _: i64 = self
            .invoke(&self.scripts.set_params, &[&key, &state], &args)
            .await?;
        Ok(())
    }

    async fn clear_params(&self, bucket: &BucketRef) -> Result<(), StoreError> {
        // One DEL: the keys share the tenant's hash tag, so one Cluster slot.
        let mut del = redis::cmd("DEL");
        del.arg(bucket.params_key())
            .arg(bucket.state_key(StateKind::Bucket))
            .arg(bucket.state_key(StateKind::Window));
        let _: i64 = self.command(&del).await?;
        Ok(())
    }

    async fn instance(&self) -> Result<String, StoreError> {
        self.run_ids().await
    }

    async fn list_params(&self) -> Result<Vec<BucketRef>, StoreError> {
        self.params_held().await
    }

    async fn collect_usage(&self, max: usize) -> Result<Vec<UsageRecord>, StoreError> {
        match &self.slot_tags {
            None => {
                let mut out = Vec::new();
                // Go on while batches come back full: expired keys leave the index without a
                // record, so a batch may hold fewer records than keys taken.
                while out.len() < max {
                    let want = (max - out.len()).min(COLLECT_BATCH_MAX);
                    let (taken, batch) = self.collect_index(keys::ACTIVE_INDEX, want).await?;
                    out.extend(batch);
                    if taken < want {
                        break;
                    }
                }
                Ok(out)
            }
            Some(tags) => {
                // Slots are drained in chunks, starting where the previous collection stopped;
                // the asks of a chunk never add up to more than what is still wanted, so
                // nothing is taken out of Redis and then dropped.
                let start = self.next_slot.load(Ordering::Relaxed) % tags.len();
                let mut out = Vec::new();
                let mut done = 0;
                while done < tags.len() && out.len() < max {
                    let remaining = max - out.len();
                    let chunk = CLUSTER_COLLECT_CONCURRENCY
                        .min(remaining)
                        .min(tags.len() - done);
                    let ask = (remaining / chunk).min(COLLECT_BATCH_MAX);
                    let calls = (done..done + chunk).map(|i| {
                        let index = keys::slot_index_key_for_tag(&tags[(start + i) % tags.len()]);
                        async move { self.collect_index(&index, ask).await }
                    });
                    let batches = futures::future::try_join_all(calls).await?;
                    out.extend(batches.into_iter().flat_map(|(_, records)| records));
                    done += chunk;
                }
                self.next_slot
                    .store((start + done) % tags.len(), Ordering::Relaxed);
                Ok(out)
            }
        }
    }
}
