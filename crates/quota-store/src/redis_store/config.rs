//! Where Redis is, how to authenticate, and how long to wait for it.

use std::fmt;
use std::time::Duration;

use super::tls::Tls;
use crate::{StoreError, DEFAULT_MIN_IDLE_TTL_MS};

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
