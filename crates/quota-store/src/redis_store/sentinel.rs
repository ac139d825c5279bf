//! Redis behind Sentinel: the master the sentinels name, followed through failovers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use futures::future::{BoxFuture, FutureExt, Shared};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{ErrorKind, RedisError};

use super::config::manager_config;
use super::tls::{ensure_crypto_provider, is_tls};
use super::RedisStoreConfig;
use crate::StoreError;

/// How often the sentinels are asked again at most while calls keep failing (a master that
/// is down stays named until the sentinels agree to fail it over).
const SENTINEL_ASK_INTERVAL: Duration = Duration::from_millis(100);

/// The master some sentinels name, asked for by the first call that needs it and again after
/// a call meets a sign of failover: the master unreachable or too slow, or `READONLY` (it was
/// demoted to a replica).
pub(super) struct SentinelMaster {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    config: ConnectionManagerConfig,
    current: ArcSwapOption<SentinelNamed>,
    /// Set by a call that met a sign of failover: the next call asks the sentinels again.
    pub(super) stale: AtomicBool,
    /// When the sentinels were last asked.
    asked: Mutex<Option<Instant>>,
    /// The lookup under way, which every call that needs the master awaits.
    lookup: Mutex<Option<Lookup>>,
}

/// A lookup of the master, in a task of its own (see [`SentinelMaster::manager`]).
type Lookup = Shared<BoxFuture<'static, redis::RedisResult<ConnectionManager>>>;

/// The master the sentinels last named (`host:port`) and the connection to it.
struct SentinelNamed {
    addr: String,
    manager: ConnectionManager,
}

impl SentinelMaster {
    /// The current master's connection, asking the sentinels first if there is none or it is
    /// stale (at most once per [`SENTINEL_ASK_INTERVAL`]).
    ///
    /// The sentinels are asked in a task of its own, which every waiting call shares: a call
    /// that times out must not cancel the lookup. A lookup checks the master it is given with a
    /// connection of its own, a TLS handshake under TLS; cancelled with each call, one slower
    /// than the call timeout would start over on every call and never end.
    pub(super) async fn manager(self: &Arc<Self>) -> redis::RedisResult<ConnectionManager> {
        if let Some(m) = self.fresh() {
            return Ok(m);
        }
        let lookup = {
            let mut slot = self.lookup.lock().unwrap_or_else(|e| e.into_inner());
            match &*slot {
                Some(l) => l.clone(),
                None => {
                    let this = Arc::clone(self);
                    let task = tokio::spawn(async move {
                        let r = this.ask().await;
                        *this.lookup.lock().unwrap_or_else(|e| e.into_inner()) = None;
                        r
                    });
                    let l = async move {
                        task.await.unwrap_or_else(|e| {
                            Err(RedisError::from((
                                ErrorKind::Io,
                                "the sentinel lookup failed",
                                e.to_string(),
                            )))
                        })
                    }
                    .boxed()
                    .shared();
                    *slot = Some(l.clone());
                    l
                }
            }
        };
        lookup.await
    }

    /// The current master's connection unless the sentinels are to be asked.
    fn fresh(&self) -> Option<ConnectionManager> {
        let current = self.current.load_full()?;
        let recent = self
            .asked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|at| at.elapsed() < SENTINEL_ASK_INTERVAL);
        (!self.stale.load(Ordering::Relaxed) || recent).then(|| current.manager.clone())
    }

    /// Asks the sentinels for the master and keeps its connection.
    async fn ask(&self) -> redis::RedisResult<ConnectionManager> {
        let mut sentinel = self.sentinel.lock().await;
        // Answered since the lookup began.
        if let Some(m) = self.fresh() {
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
pub(super) fn failover_sign(e: &RedisError) -> bool {
    e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_io_error()
        || e.is_timeout()
        || e.code() == Some("READONLY")
}

impl SentinelMaster {
    /// The sentinels at `urls` (all `rediss://` or all `redis://`, without credentials: those
    /// are [`RedisStoreConfig::sentinel_credentials`]) and the master they name `master_name`;
    /// nothing is asked until a call needs the master.
    pub(super) fn build(
        config: &RedisStoreConfig,
        urls: &[String],
        master_name: &str,
    ) -> Result<Self, StoreError> {
        let addrs =
            urls.iter()
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
        Ok(Self {
            sentinel: tokio::sync::Mutex::new(sentinel),
            config: manager_config(config.timeout),
            current: ArcSwapOption::empty(),
            stale: AtomicBool::new(false),
            asked: Mutex::new(None),
            lookup: Mutex::new(None),
        })
    }
}
