//! NOSCRIPT: after `SCRIPT FLUSH` and after a redis-server restart, the next call through the
//! store succeeds; the caller never sees NOSCRIPT or the dropped connection.

mod common;

use common::{fresh_bucket, req, tokens};
use quota_store::{Limit, Store};
use redis_harness::RedisServer;

async fn scripts_loaded(server: &RedisServer) -> usize {
    let mut c = server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let shas: Vec<String> = [
        quota_store::script::TOKEN_BUCKET_LUA,
        quota_store::script::SLIDING_WINDOW_LUA,
        quota_store::script::COLLECT_USAGE_LUA,
    ]
    .iter()
    .map(|src| redis::Script::new(src).get_hash().to_string())
    .collect();
    let exists: Vec<bool> = redis::cmd("SCRIPT")
        .arg("EXISTS")
        .arg(&shas)
        .query_async(&mut c)
        .await
        .unwrap();
    exists.into_iter().filter(|e| *e).count()
}

async fn flush(server: &RedisServer) {
    let mut c = server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut c)
        .await
        .unwrap();
}

#[tokio::test]
async fn script_flush_is_answered_by_one_reload() {
    let server = RedisServer::start().unwrap();
    let s = common::store(&server).await;
    let b = fresh_bucket("flush");
    let w = Limit::SlidingWindow {
        limit: 5,
        window_ms: 1000,
    };
    assert!(
        s.check(&req(&b, tokens(2, 0), 1, None))
            .await
            .unwrap()
            .allowed
    );
    assert!(s.check(&req(&b, w, 1, None)).await.unwrap().allowed);
    assert_eq!(s.collect_usage(10).await.unwrap().len(), 2);
    assert_eq!(scripts_loaded(&server).await, 3);
    flush(&server).await;
    assert_eq!(scripts_loaded(&server).await, 0);
    // Each script is reloaded on first use; state survived the flush.
    let d = s.check(&req(&b, tokens(2, 0), 1, None)).await.unwrap();
    assert_eq!((d.allowed, d.remaining), (true, 0));
    assert!(s.check(&req(&b, w, 1, None)).await.unwrap().allowed);
    assert_eq!(s.collect_usage(10).await.unwrap().len(), 2);
    assert_eq!(scripts_loaded(&server).await, 3);
}

#[tokio::test]
async fn restart_is_answered_by_reconnect_and_reload() {
    let mut server = RedisServer::start().unwrap();
    let s = common::store(&server).await;
    let b = fresh_bucket("restart");
    let l = tokens(3, 0);
    s.check(&req(&b, l, 3, None)).await.unwrap();
    assert!(!s.check(&req(&b, l, 1, None)).await.unwrap().allowed);
    server.restart().unwrap();
    // The restarted server is empty (no persistence): no scripts, and the bucket is new.
    let d = s.check(&req(&b, l, 1, None)).await.unwrap();
    assert_eq!((d.allowed, d.remaining), (true, 2));
    assert_eq!(s.collect_usage(10).await.unwrap().len(), 1);
    // And again, twice in a row, for the sliding window and the collector too.
    server.restart().unwrap();
    let w = Limit::SlidingWindow {
        limit: 5,
        window_ms: 1000,
    };
    assert!(s.check(&req(&b, w, 1, None)).await.unwrap().allowed);
    server.restart().unwrap();
    assert_eq!(s.collect_usage(10).await.unwrap(), vec![]);
}
