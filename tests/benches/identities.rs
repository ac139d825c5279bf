//! One-shot identities through the daemon: 1 000 000 checks, each naming a fresh `identity`
//! under the `default` plan, sent to one `quotad` (release build) on a real `redis-server`.
//! Printed: the daemon's resident memory (`VmRSS` from `/proc/<pid>/status`) and Redis's
//! `used_memory` at start, at their peaks during the load, at its end, and once the buckets'
//! TTLs have passed and Redis holds no bucket any more.
//!
//! ```text
//! cargo build --release -p quotad && cargo bench -p quotad-system-tests --bench identities
//! # QUOTAD_BENCH_IDENTITIES (1000000), QUOTAD_BENCH_CONCURRENCY (32)
//! ```
//!
//! A bucket's idle TTL is at least the store's minimum (60 s), so the run waits about a minute
//! after the load for Redis's active expiry.

// A benchmark measures real elapsed time.
#![allow(clippy::disallowed_methods)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use common::env_or;
use quotad_system_tests::{redis_config, Daemon, TOKEN};
use redis_harness::RedisServer;
use serde_json::json;

/// The daemon's resident set, in bytes.
fn rss(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS")?;
    Ok(kb * 1024)
}

/// Redis's `used_memory` and key count.
async fn redis_memory(c: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<(u64, u64)> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(c).await?;
    let used = info
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .context("no used_memory")?;
    let keys: u64 = redis::cmd("DBSIZE").query_async(c).await?;
    Ok((used, keys))
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: usize = env_or("QUOTAD_BENCH_IDENTITIES", 1_000_000);
    let concurrency: usize = env_or("QUOTAD_BENCH_CONCURRENCY", 32);
    let redis = RedisServer::start()?;
    let daemon = Daemon::start_with_env(
        &redis_config(&redis.url()),
        &[("QUOTAD_IDENTITY_KEY", "bench-identity-key-0123456789")],
    )
    .await?;
    let pid = daemon.pid().context("no pid")?;
    common::put_plan(
        &daemon,
        "default",
        json!({"login": {"limit": 5, "window_ms": 1000}}),
    )
    .await?;
    let mut c = redis.client().get_multiplexed_async_connection().await?;
    // Let the agent apply the plan and settle before the baseline.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_start = rss(pid)?;
    let (mem_start, keys_start) = redis_memory(&mut c).await?;

    let next = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let base = daemon.base();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .timeout(Duration::from_secs(10))
        .build()?;
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (next, failed, http) = (next.clone(), failed.clone(), http.clone());
        let url = format!("{base}/v1/check");
        workers.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let body = json!({"identity": format!("one-shot-{i}"), "policy": "login"});
                let ok = http
                    .post(&url)
                    .bearer_auth(TOKEN)
                    .json(&body)
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200);
                if !ok {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    let (mut rss_peak, mut mem_peak) = (rss_start, mem_start);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while !workers.is_empty() {
        tokio::select! {
            r = workers.join_next() => { if let Some(r) = r { r?; } }
            _ = tick.tick() => {
                rss_peak = rss_peak.max(rss(pid)?);
                mem_peak = mem_peak.max(redis_memory(&mut c).await?.0);
            }
        }
    }
    let load_s = started.elapsed().as_secs_f64();
    let rss_end = rss(pid)?;
    let (mem_end, keys_end) = redis_memory(&mut c).await?;
    rss_peak = rss_peak.max(rss_end);
    mem_peak = mem_peak.max(mem_end);
    let failed = failed.load(Ordering::Relaxed);
    eprintln!("{n} checks in {load_s:.1} s ({failed} not admitted); waiting for the TTLs");

    // The TTLs pass, active expiry removes the buckets: wait until Redis holds its baseline
    // key count again (or give up after 5 minutes).
    let waited = Instant::now();
    let (mut mem_after, mut keys_after);
    loop {
        (mem_after, keys_after) = redis_memory(&mut c).await?;
        if keys_after <= keys_start {
            break;
        }
        if waited.elapsed() > Duration::from_secs(300) {
            eprintln!("{keys_after} keys left after 5 minutes");
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    // A few more agent rounds with nothing to do.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let rss_after = rss(pid)?;
    mem_after = mem_after.min(redis_memory(&mut c).await?.0);
    if failed > n / 100 {
        bail!("{failed} of {n} checks were not admitted");
    }

    println!(
        "{n} one-shot identities, {concurrency} connections, {load_s:.1} s ({:.0} checks/s)",
        n as f64 / load_s
    );
    println!(
        "{:<22} {:>9} {:>9} {:>9} {:>9}",
        "MB", "start", "peak", "end", "after TTL"
    );
    println!(
        "{:<22} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
        "quotad VmRSS",
        mb(rss_start),
        mb(rss_peak),
        mb(rss_end),
        mb(rss_after)
    );
    println!(
        "{:<22} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
        "redis used_memory",
        mb(mem_start),
        mb(mem_peak),
        mb(mem_end),
        mb(mem_after)
    );
    println!(
        "redis keys: start {keys_start}, end {keys_end}, after {keys_after} ({:.0} s after the load)",
        waited.elapsed().as_secs_f64() + 5.0
    );
    // What is left, by key (ids in keys are hashed, never raw identities).
    let left: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut c).await?;
    for key in left {
        let kind: String = redis::cmd("TYPE").arg(&key).query_async(&mut c).await?;
        let bytes: Option<u64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(&key)
            .query_async(&mut c)
            .await?;
        println!("left: {key} ({kind}, {} B)", bytes.unwrap_or(0));
    }
    Ok(())
}
