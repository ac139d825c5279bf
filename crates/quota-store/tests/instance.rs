//! `Store::instance`: the same while Redis keeps what was written, new after a restart (the
//! region agent then rewrites every bucket's parameters); constant for the embedded store.

use std::time::Duration;

use quota_store::{EmbeddedStore, RedisStore, RedisStoreConfig, Store};
use redis_harness::RedisServer;

#[tokio::test]
async fn a_restarted_redis_is_a_new_instance() {
    let mut redis = RedisServer::start().unwrap();
    let cfg = RedisStoreConfig::standalone(redis.url()).with_timeout(Duration::from_secs(5));
    let s = RedisStore::connect(cfg).await.unwrap();
    let first = s.instance().await.unwrap();
    assert_eq!(first.len(), 40, "one run id: {first}");
    assert_eq!(
        s.instance().await.unwrap(),
        first,
        "stable while Redis runs"
    );

    redis.restart().unwrap();
    // The first call after the restart may meet the dead connection; the manager reconnects.
    let mut after = s.instance().await;
    for _ in 0..50 {
        if after.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = s.instance().await;
    }
    let after = after.unwrap();
    assert_eq!(after.len(), 40);
    assert_ne!(after, first, "a restarted Redis has a new run id");

    redis.stop();
    assert!(
        s.instance().await.is_err(),
        "a down Redis names no instance"
    );
}

#[tokio::test]
async fn the_embedded_store_is_always_the_same_instance() {
    let s = EmbeddedStore::new();
    assert_eq!(s.instance().await.unwrap(), s.instance().await.unwrap());
}
