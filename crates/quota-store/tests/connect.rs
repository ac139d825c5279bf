//! Opening a store does not wait for Redis: a store opened while its Redis is down fails each
//! call as unavailable and connects by itself once Redis answers, without being reopened.

mod common;

use std::time::{Duration, Instant};

use common::{fresh_bucket, req, tokens};
use quota_store::{RedisStore, RedisStoreConfig, Store, StoreError};
use redis_harness::RedisServer;

fn down(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Unavailable { .. } | StoreError::Timeout { .. }
    )
}

#[tokio::test]
async fn a_store_opened_while_redis_is_down_connects_once_it_answers() {
    let mut redis = RedisServer::start().unwrap();
    redis.stop();
    let cfg = RedisStoreConfig::standalone(redis.url()).with_timeout(Duration::from_secs(2));

    let e = RedisStore::connect(cfg.clone()).await.unwrap_err();
    assert!(down(&e), "connect waits for Redis: {e}");

    let s = RedisStore::open(cfg).unwrap();
    let e = s.reachable().await.unwrap_err();
    assert!(down(&e), "{e}");
    let b = fresh_bucket("lazy");
    let l = tokens(3, 0);
    let e = s.check(&req(&b, l, 1, None)).await.unwrap_err();
    assert!(down(&e), "{e}");

    redis.restart().unwrap();
    // The same store, never reopened: the next calls connect.
    let back = Instant::now();
    let mut first = None;
    while back.elapsed() < Duration::from_secs(5) {
        match s.check(&req(&b, l, 1, None)).await {
            Ok(d) => {
                first = Some(d);
                break;
            }
            Err(e) => assert!(down(&e), "{e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let d = first.expect("a check succeeds within 5 s of Redis answering");
    assert!(d.allowed);
    assert_eq!(d.remaining, 2, "the failed calls spent nothing");
    s.reachable().await.unwrap();
}

#[test]
fn a_malformed_address_is_refused_at_open() {
    for url in ["http://127.0.0.1:6379/", "redis://127.0.0.1:notaport/", ""] {
        let e = RedisStore::open(RedisStoreConfig::standalone(url)).unwrap_err();
        assert!(matches!(e, StoreError::Invalid { .. }), "{url:?}: {e}");
    }
    let e = RedisStore::open(RedisStoreConfig::cluster(vec!["bogus".into()])).unwrap_err();
    assert!(matches!(e, StoreError::Invalid { .. }), "{e}");
}
