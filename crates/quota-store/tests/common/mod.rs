//! Helpers shared by the integration tests: servers, buckets, direct script calls.
#![allow(dead_code)] // each test binary uses a different subset

use std::sync::atomic::{AtomicU64, Ordering};

use quota_core::bucket::UT;
use quota_core::{BucketParams, PolicyName, TenantId};
use quota_store::{BucketRef, CheckRequest, Limit, RedisStore, RedisStoreConfig};
use redis_harness::RedisServer;

/// A bucket ref unique within this process (tenant `<prefix>-<n>`).
pub fn fresh_bucket(prefix: &str) -> BucketRef {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    BucketRef {
        tenant: TenantId::new(format!("{prefix}-{n}")).unwrap(),
        policy: PolicyName::new("writes").unwrap(),
        version: 1,
    }
}

/// Token-bucket parameters in whole tokens and tokens per second.
pub fn tokens(cap: u64, per_s: u64) -> Limit {
    Limit::TokenBucket(BucketParams::new(cap * UT, per_s * UT).unwrap())
}

pub fn req(bucket: &BucketRef, limit: Limit, cost: u64, now_ms: Option<u64>) -> CheckRequest {
    CheckRequest {
        bucket: bucket.clone(),
        limit,
        cost,
        now_ms,
    }
}

/// A store on `server` with a generous timeout (debug builds on a busy CI machine).
pub async fn store(server: &RedisServer) -> RedisStore {
    let cfg =
        RedisStoreConfig::standalone(server.url()).with_timeout(std::time::Duration::from_secs(5));
    RedisStore::connect(cfg).await.unwrap()
}

/// A plain synchronous connection for direct EVAL / HMGET calls.
pub fn sync_conn(server: &RedisServer) -> redis::Connection {
    server.client().get_connection().unwrap()
}

/// Loads a script and returns its SHA.
pub fn load(conn: &mut redis::Connection, src: &str) -> String {
    redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(src)
        .query(conn)
        .unwrap()
}

/// The first decision `store` makes for `req` within `within`, retrying every 20 ms; each
/// failed call's error goes to `on_error` (to assert what a failure may be).
pub async fn first_decision(
    store: &RedisStore,
    req: &CheckRequest,
    within: std::time::Duration,
    on_error: impl Fn(&quota_store::StoreError),
) -> Option<quota_core::Decision> {
    use quota_store::Store as _;
    let start = std::time::Instant::now();
    while start.elapsed() < within {
        match store.check(req).await {
            Ok(d) => return Some(d),
            Err(e) => on_error(&e),
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    None
}

/// Runs a command on `server` as the `default` user with `password` (e.g. `CONFIG SET`).
pub async fn admin(server: &RedisServer, password: &str, args: &[&str]) -> redis::Value {
    let info = redis::IntoConnectionInfo::into_connection_info(server.url().as_str()).unwrap();
    let settings = info.redis_settings().clone().set_password(password);
    let client = redis::Client::open(info.set_redis_settings(settings)).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd(args[0])
        .arg(&args[1..])
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// TLS settings from `pki`: its CA, and its client certificate when `client`.
pub fn tls(pki: &redis_harness::pki::TestPki, client: bool) -> quota_store::Tls {
    let read = |p: &std::path::Path| std::fs::read(p).unwrap();
    quota_store::Tls {
        ca_pem: Some(read(&pki.ca_cert)),
        client: client.then(|| quota_store::ClientIdentity {
            cert_pem: read(&pki.client_cert),
            key_pem: read(&pki.client_key),
        }),
    }
}

/// A plain connection to `server`, for reading or resetting its state beside a store.
pub async fn conn(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}
