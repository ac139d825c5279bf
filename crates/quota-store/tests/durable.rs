//! `AnyStore::durable`: the region agent acknowledges an epoch only once what it wrote is on
//! a replica, so a failover that loses the last writes cannot bring back a share the
//! coordinator gave away. Real redis-servers: a master alone, a master with a live replica,
//! and one whose replica is stopped (SIGSTOP).

mod common;

use std::time::Duration;

use quota_store::{AnyStore, RedisStore, RedisStoreConfig, SetParams, Store};
use redis_harness::RedisServer;

async fn store(server: &RedisServer) -> AnyStore {
    let cfg = RedisStoreConfig::standalone(server.url()).with_timeout(Duration::from_millis(300));
    AnyStore::Redis(RedisStore::connect(cfg).await.unwrap())
}

async fn write(s: &AnyStore, n: u64) {
    let b = common::fresh_bucket("durable");
    s.set_params(&SetParams::new(b, common::tokens(n, 1)))
        .await
        .unwrap();
}

fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig} {pid}");
}

#[tokio::test]
async fn writes_are_durable_once_a_replica_has_them() {
    // Without replicas there is nothing to fail over to.
    let alone = RedisServer::start().unwrap();
    let s = store(&alone).await;
    write(&s, 10).await;
    assert!(s.durable().await.unwrap());
    assert!(AnyStore::embedded().durable().await.unwrap());

    let master = RedisServer::start().unwrap();
    let port = master.port().to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]).unwrap();
    let mut conn = master
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let linked = async {
        loop {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query_async(&mut conn)
                .await
                .unwrap();
            if info.contains("connected_slaves:1") && info.contains("state=online") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), linked)
        .await
        .expect("the replica links up");
    let s = store(&master).await;
    write(&s, 20).await;
    // WAIT gives a replica 10 ms: on a busy host a later call confirms what an earlier missed.
    let mut took = false;
    for _ in 0..100 {
        if s.durable().await.unwrap_or(false) {
            took = true;
            break;
        }
    }
    assert!(took, "the live replica took the write");

    // A replica that stops acknowledging: the write is not durable, so not acknowledged.
    signal(replica.pid(), "STOP");
    write(&s, 30).await;
    let paused = s.durable().await;
    signal(replica.pid(), "CONT");
    assert!(matches!(paused, Ok(false)), "{paused:?}");
    // Once it catches up, the same writes are durable.
    let back = async {
        while !s.durable().await.unwrap_or(false) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), back)
        .await
        .expect("durable again once the replica resumed");
}
