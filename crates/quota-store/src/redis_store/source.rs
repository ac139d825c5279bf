//! Where calls get their connection: one kind per topology, each made lazily so a store opens
//! while Redis is down.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::RoutingInfo;
use redis::{RedisError, Value};

use super::sentinel::SentinelMaster;
use super::tls::ensure_crypto_provider;
use super::{RedisStoreConfig, Topology};
use crate::StoreError;

/// One call's connection.
#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(LazyCluster),
    Sentinel(Arc<SentinelMaster>),
}

/// Where calls get their connection.
pub(super) enum Source {
    Single(Arc<Standalone>),
    Cluster(LazyCluster),
    Sentinel(Arc<SentinelMaster>),
}

/// The standalone connection manager, replaced after an authentication failure: redis-rs's
/// manager reconnects after I/O errors only, so one refused once (a password changed under
/// it, an ACL loaded late) would go on failing after Redis is put right.
pub(super) struct Standalone {
    client: redis::Client,
    config: ConnectionManagerConfig,
    pub(super) current: ArcSwap<ConnectionManager>,
}

impl Standalone {
    /// Replaces `refused` (unless another call already has) with a manager that connects
    /// afresh on first use.
    pub(super) fn replace(&self, refused: &Arc<ConnectionManager>) {
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
pub(super) struct LazyCluster {
    client: Arc<ClusterClient>,
    conn: Arc<tokio::sync::OnceCell<ClusterConnection>>,
}

impl LazyCluster {
    /// The connection, connecting first if no call has yet.
    pub(super) async fn get(&self) -> redis::RedisResult<ClusterConnection> {
        self.conn
            .get_or_try_init(|| self.client.get_async_connection())
            .await
            .cloned()
    }

    /// Sends `cmd` where `routing` says (e.g. to every master), connecting first if need be.
    pub(super) async fn route(
        &self,
        cmd: redis::Cmd,
        routing: RoutingInfo,
    ) -> redis::RedisResult<Value> {
        self.get().await?.route_command(cmd, routing).await
    }
}

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

/// The connection(s) `config` describes, made lazily: fails only on a malformed address or
/// TLS material.
pub(super) fn build_source(config: &RedisStoreConfig) -> Result<Source, StoreError> {
    match &config.topology {
        Topology::Standalone { url } => standalone(config, url),
        Topology::Cluster { urls } => cluster(config, urls),
        Topology::Sentinel { urls, master_name } => {
            SentinelMaster::build(config, urls, master_name).map(|s| Source::Sentinel(Arc::new(s)))
        }
    }
}

/// One server at `url`, through a connection manager that reconnects on its own.
fn standalone(config: &RedisStoreConfig, url: &str) -> Result<Source, StoreError> {
    let invalid = |e: RedisError| StoreError::Invalid {
        reason: format!("redis url: {e}"),
    };
    let mut info = redis::IntoConnectionInfo::into_connection_info(url).map_err(invalid)?;
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
    let m = ConnectionManager::new_lazy_with_config(client.clone(), cfg.clone()).map_err(|e| {
        StoreError::Invalid {
            reason: format!("redis connection settings: {e}"),
        }
    })?;
    let single = Standalone {
        client,
        config: cfg,
        current: ArcSwap::from_pointee(m),
    };
    Ok(Source::Single(Arc::new(single)))
}

/// A Redis Cluster through any of `urls`, connected by the first call that needs it.
fn cluster(config: &RedisStoreConfig, urls: &[String]) -> Result<Source, StoreError> {
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
    Ok(Source::Cluster(lazy))
}

pub(super) fn is_tls(addr: &redis::ConnectionAddr) -> bool {
    matches!(addr, redis::ConnectionAddr::TcpTls { .. })
}

/// How a connection manager connects and retries: every call is bounded as a whole
/// (`bounded`, retry included), so there is no per-response timer as well.
pub(super) fn manager_config(timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(None)
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500))
}
