//! Store errors are classified: a request or a bucket's data at fault is
//! [`StoreError::Rejected`] (no outage, the store goes on deciding for everyone else), apart
//! from a store that failed: down, too slow, or answering with a server error. Against a real
//! redis-server, and the embedded store for the same bad input.

mod common;

use std::time::Duration;

use common::{fresh_bucket, req, tokens};
use quota_core::keys::StateKind;
use quota_store::{
    CheckRequest, EmbeddedStore, Limit, RedisStore, RedisStoreConfig, Store, StoreError,
};
use redis_harness::RedisServer;

/// Requests every store refuses as they are: a window past the scripts' seven days, a limit
/// over 10⁹, limit × window over 2^51, a cost over the largest.
fn bad_requests() -> Vec<CheckRequest> {
    let b = fresh_bucket("bad");
    let window = |limit, window_ms| Limit::SlidingWindow { limit, window_ms };
    vec![
        req(&b, window(10, 8 * 24 * 3_600_000), 1, None),
        req(&b, window(1_000_000_001, 1000), 1, None),
        req(&b, window(1_000_000_000, 3_000_000), 1, None),
        req(&b, tokens(1, 1), quota_store::MAX_COST + 1, None),
    ]
}

fn assert_rejected(r: Result<quota_core::Decision, StoreError>, what: &str) {
    match r {
        Err(e @ StoreError::Rejected { .. }) => assert!(!e.is_outage(), "{what}: {e}"),
        other => panic!("{what}: expected Rejected, got {other:?}"),
    }
}

/// A store whose calls give up after `ms`.
async fn store_with_timeout(server: &RedisServer, ms: u64) -> RedisStore {
    let cfg = RedisStoreConfig::standalone(server.url()).with_timeout(Duration::from_millis(ms));
    RedisStore::connect(cfg).await.unwrap()
}

/// The store is fine after a rejection: a fresh bucket under `limit` is decided (and admitted).
async fn still_decides_for_others(store: &RedisStore, limit: Limit) {
    let other = fresh_bucket("healthy");
    let d = store.check(&req(&other, limit, 1, None)).await;
    assert!(d.as_ref().is_ok_and(|d| d.allowed), "{d:?}");
}

#[tokio::test]
async fn bad_requests_are_rejected_alike_by_both_stores() {
    let server = RedisServer::start().unwrap();
    let redis = common::store(&server).await;
    let embedded = EmbeddedStore::new();
    for r in &bad_requests() {
        assert_rejected(redis.check(r).await, &format!("redis {r:?}"));
        assert_rejected(embedded.check(r).await, &format!("embedded {r:?}"));
    }
}

#[tokio::test]
async fn a_scripts_refusal_of_stored_data_is_rejected() {
    let server = RedisServer::start().unwrap();
    let store = common::store(&server).await;
    let b = fresh_bucket("corrupt");
    let limit = Limit::SlidingWindow {
        limit: 10,
        window_ms: 1000,
    };
    // Parameters written by something other than this store: the script answers
    // `ERR quotad: …` for them.
    let mut c = common::sync_conn(&server);
    let _: () = redis::cmd("HSET")
        .arg(b.params_key())
        .arg("limit")
        .arg("ten")
        .arg("window")
        .arg("1000")
        .query(&mut c)
        .unwrap();
    assert_rejected(
        store.check(&req(&b, limit, 1, None)).await,
        "corrupt params",
    );
    still_decides_for_others(&store, limit).await;
}

#[tokio::test]
async fn a_key_of_another_type_is_rejected() {
    let server = RedisServer::start().unwrap();
    let store = common::store(&server).await;
    let mut c = common::sync_conn(&server);
    let window = Limit::SlidingWindow {
        limit: 10,
        window_ms: 1000,
    };
    for (limit, kind) in [
        (tokens(5, 1), StateKind::Bucket),
        (window, StateKind::Window),
    ] {
        let b = fresh_bucket("listed");
        let _: i64 = redis::cmd("RPUSH")
            .arg(b.state_key(kind))
            .arg("x")
            .query(&mut c)
            .unwrap();
        assert_rejected(
            store.check(&req(&b, limit, 1, None)).await,
            &format!("{kind:?} state holding a list"),
        );
        still_decides_for_others(&store, limit).await;
    }
}

#[tokio::test]
async fn a_stopped_server_is_an_outage() {
    let mut server = RedisServer::start().unwrap();
    let store = store_with_timeout(&server, 500).await;
    server.stop();
    let e = store
        .check(&req(&fresh_bucket("down"), tokens(5, 1), 1, None))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::Unavailable { .. } | StoreError::Timeout { .. }
        ),
        "{e:?}"
    );
    assert!(e.is_outage(), "{e}");
}

#[tokio::test]
async fn a_server_that_stops_answering_times_out() {
    let server = RedisServer::start().unwrap();
    let store = store_with_timeout(&server, 200).await;
    // Every client's commands wait for two seconds.
    let mut c = common::sync_conn(&server);
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(2000)
        .arg("ALL")
        .query(&mut c)
        .unwrap();
    let e = store
        .check(&req(&fresh_bucket("paused"), tokens(5, 1), 1, None))
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Timeout { ms: 200 }), "{e:?}");
    assert!(e.is_outage());
}

#[tokio::test]
async fn a_server_out_of_memory_is_an_outage() {
    let server = RedisServer::start().unwrap();
    let store = common::store(&server).await;
    let b = fresh_bucket("oom");
    // Loaded while there is memory, so the refusal below is the script call's own.
    assert!(
        store
            .check(&req(&b, tokens(5, 1), 1, None))
            .await
            .unwrap()
            .allowed
    );
    let mut c = common::sync_conn(&server);
    for (name, value) in [("maxmemory-policy", "noeviction"), ("maxmemory", "1")] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(&mut c)
            .unwrap();
    }
    let e = store
        .check(&req(&b, tokens(5, 1), 1, None))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, StoreError::Script { message } if message.starts_with("OOM")),
        "{e:?}"
    );
    assert!(e.is_outage());
}
