//! A usage collection holds Redis a short while at a time: a script blocks every other client
//! while it runs, so a drain of many buckets goes in calls of at most
//! [`COLLECT_CALL_KEYS`] keys, and checks go between them.

mod common;

use common::{conn, fresh_bucket, req, store, tokens};
use quota_store::redis_store::COLLECT_CALL_KEYS;
use quota_store::Store;
use redis_harness::{command_calls, RedisServer};

#[tokio::test]
async fn a_drain_of_many_buckets_takes_them_a_few_hundred_a_call() {
    let server = RedisServer::start().unwrap();
    let s = store(&server).await;
    let l = tokens(10, 1);
    let n = 2 * COLLECT_CALL_KEYS + 100;
    let checks: Vec<_> = (0..n)
        .map(|_| req(&fresh_bucket("drain"), l, 1, None))
        .collect();
    futures::future::try_join_all(checks.iter().map(|c| s.check(c)))
        .await
        .unwrap();
    let mut conn = conn(&server).await;
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .unwrap();
    let usage = s.collect_usage(10_000).await.unwrap();
    assert_eq!(usage.len(), n);
    assert!(usage.iter().all(|u| (u.admitted, u.denied) == (1, 0)));
    // Each collect_usage.lua call pops the index once: 256, 256 and the last 100. (EVALSHA
    // counts one more: the first call's NOSCRIPT, the script not yet loaded.)
    assert_eq!(command_calls(&mut conn, "spop").await.unwrap(), 3);
    assert!(s.collect_usage(10_000).await.unwrap().is_empty());
}
