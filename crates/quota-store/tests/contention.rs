//! Contention: 200 concurrent clients over several connections against one 100-token bucket
//! with no refill admit exactly 100, in each of 100 runs — within one process, and with the load
//! split over 3 OS processes (this test binary re-executed with `contention_child`).

mod common;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{req, tokens};
use quota_core::{PolicyName, TenantId};
use quota_store::{BucketRef, RedisStore, RedisStoreConfig, Store};
use redis_harness::RedisServer;

const RUNS: usize = 100;
const CLIENTS: usize = 200;
const CAPACITY: u64 = 100;
const CONNECTIONS: usize = 4;

fn run_bucket(prefix: &str, run: usize) -> BucketRef {
    BucketRef {
        tenant: TenantId::new(format!("{prefix}-{run}")).unwrap(),
        policy: PolicyName::new("writes").unwrap(),
        version: 1,
    }
}

async fn stores(url: &str) -> Vec<RedisStore> {
    let mut v = Vec::new();
    for _ in 0..CONNECTIONS {
        let cfg = RedisStoreConfig::standalone(url).with_timeout(Duration::from_secs(10));
        v.push(RedisStore::connect(cfg).await.unwrap());
    }
    v
}

/// `clients` concurrent single-token checks on one bucket; returns how many were admitted.
async fn contend(stores: &[RedisStore], bucket: &BucketRef, clients: usize) -> u64 {
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..clients {
        let s = stores[i % stores.len()].clone();
        let r = req(bucket, tokens(CAPACITY, 0), 1, None);
        tasks.spawn(async move { s.check(&r).await.unwrap().allowed });
    }
    let mut admitted = 0;
    while let Some(r) = tasks.join_next().await {
        admitted += u64::from(r.unwrap());
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_clients_admit_exactly_the_capacity() {
    let server = RedisServer::start().unwrap();
    let stores = stores(&server.url()).await;
    for run in 0..RUNS {
        let b = run_bucket("inproc", run);
        assert_eq!(contend(&stores, &b, CLIENTS).await, CAPACITY, "run {run}");
    }
    let usage = stores[0].collect_usage(usize::MAX).await.unwrap();
    assert_eq!(usage.len(), RUNS);
    assert!(usage
        .iter()
        .all(|u| u.admitted == CAPACITY && u.denied == CLIENTS as u64 - CAPACITY));
}

#[test]
fn three_processes_admit_exactly_the_capacity() {
    let server = RedisServer::start().unwrap();
    let exe = std::env::current_exe().unwrap();
    let shares = [67, 67, 66];
    let children: Vec<_> = shares
        .iter()
        .map(|clients| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "contention_child",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("QUOTAD_CONTENTION_URL", server.url())
                .env("QUOTAD_CONTENTION_CLIENTS", clients.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect();
    // Release all children at once, so their loads overlap.
    let mut c = common::sync_conn(&server);
    let ready = std::time::Instant::now();
    loop {
        let n: u64 = redis::cmd("SCARD")
            .arg("contention:ready")
            .query(&mut c)
            .unwrap();
        if n == 3 {
            break;
        }
        assert!(
            ready.elapsed() < Duration::from_secs(60),
            "children did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let _: () = redis::cmd("SET")
        .arg("contention:go")
        .arg(1)
        .query(&mut c)
        .unwrap();
    let mut per_run: BTreeMap<usize, u64> = BTreeMap::new();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "child failed");
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // libtest may print "test contention_child ... " on the same line as the first one.
            if let Some((_, rest)) = line.split_once("admitted ") {
                let (run, n) = rest.split_once(' ').unwrap();
                *per_run.entry(run.parse().unwrap()).or_default() += n.parse::<u64>().unwrap();
            }
        }
    }
    assert_eq!(per_run.len(), RUNS, "every child reports every run");
    for (run, admitted) in per_run {
        assert_eq!(admitted, CAPACITY, "run {run}");
    }
}

/// The child side of `three_processes_admit_exactly_the_capacity`; does nothing on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by three_processes_admit_exactly_the_capacity"]
async fn contention_child() {
    let Ok(url) = std::env::var("QUOTAD_CONTENTION_URL") else {
        return;
    };
    let clients: usize = std::env::var("QUOTAD_CONTENTION_CLIENTS")
        .unwrap()
        .parse()
        .unwrap();
    let stores = stores(&url).await;
    let mut c = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("SADD")
        .arg("contention:ready")
        .arg(std::process::id())
        .query_async(&mut c)
        .await
        .unwrap();
    loop {
        let go: Option<String> = redis::cmd("GET")
            .arg("contention:go")
            .query_async(&mut c)
            .await
            .unwrap();
        if go.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    for run in 0..RUNS {
        let admitted = contend(&stores, &run_bucket("multiproc", run), clients).await;
        println!("admitted {run} {admitted}");
    }
}
