//! One daemon against two daemons of one region on one Redis, side by side in one run: checks
//! a second through the daemons' HTTP API and Redis calls per decision, from the same load
//! generator, in alternating slices so the host's drift falls on both alike.
//!
//! ```text
//! cargo build --release -p quotad && cargo bench -p quotad-system-tests --bench region_set
//! # QUOTAD_BENCH_CONCURRENCY (32), QUOTAD_BENCH_SLICES (8), QUOTAD_BENCH_SLICE_MS (2000)
//! ```
//!
//! - `one`: a single-region daemon (no `[[regions]]`) on its own Redis;
//! - `two`: a region of two daemons (one `[[regions]]` entry each, a Raft pair) on another
//!   Redis, the load spread round robin over both.
//!
//! Every check is admitted (64 tenants, budgets far above what a run spends), so both do the
//! same script work; the hot tenants take tokens in reservation batches in both. On a 2-core
//! host the two daemons, Redis and the load generator share the cores: the ratio shows what a
//! second daemon costs or gains there, not what a second host adds.

// A benchmark measures real elapsed time.
#![allow(clippy::disallowed_methods)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{env_or, pct};
use quotad_system_tests::{redis_config, Daemon, RegionSet, Timings};
use redis_harness::{evalsha_calls, RedisServer};
use serde_json::json;

const TENANTS: usize = 64;

/// Drives `ports` round robin with `concurrency` workers for `slice`: checks done and their
/// latencies.
async fn drive(ports: &[u16], concurrency: usize, slice: Duration) -> (u64, Vec<Duration>) {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..concurrency {
        let port = ports[w % ports.len()];
        let (done, stop) = (done.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let http = reqwest::Client::builder()
                .pool_max_idle_per_host(1)
                .build()
                .unwrap();
            let url = format!("http://127.0.0.1:{port}/v1/check");
            let mut lat = Vec::new();
            let mut n = w;
            while !stop.load(Ordering::Relaxed) {
                let body = json!({"tenant": format!("t{}", n % TENANTS), "policy": "w", "cost": 1});
                n += 1;
                let t = Instant::now();
                if let Ok(r) = http.post(&url).json(&body).send().await {
                    if r.status().is_success() {
                        lat.push(t.elapsed());
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            lat
        }));
    }
    tokio::time::sleep(slice).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap_or_default());
    }
    (done.load(Ordering::Relaxed), all)
}

async fn put_policies(d: &Daemon) -> anyhow::Result<()> {
    for t in 0..TENANTS {
        d.put_policy(
            &format!("t{t}"),
            "w",
            json!({"limit": 5_000_000, "window_ms": 1000}),
        )
        .await?;
    }
    Ok(())
}

/// One side of the comparison.
struct Side {
    name: &'static str,
    ports: Vec<u16>,
    redis: redis::aio::MultiplexedConnection,
    checks: u64,
    secs: f64,
    evalsha: u64,
    rates: Vec<f64>,
    lat: Vec<Duration>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let concurrency: usize = env_or("QUOTAD_BENCH_CONCURRENCY", 32);
    let slices: usize = env_or("QUOTAD_BENCH_SLICES", 8);
    let slice = Duration::from_millis(env_or("QUOTAD_BENCH_SLICE_MS", 2_000));

    let one_redis = RedisServer::start()?;
    let one = Daemon::start(&redis_config(&one_redis.url())).await?;
    put_policies(&one).await?;
    let set = RegionSet::start(
        &["r"],
        2,
        &Timings {
            report_interval_ms: 1_000,
            rebalance_interval_ms: 5_000,
            lease_ms: 30_000,
            drift_margin_ms: 1_000,
            ..Timings::default()
        },
    )
    .await?;
    put_policies(&set.daemons[0]).await?;
    // Both daemons of the pair decide every policy under their lease before the run.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let mut sides = [
        Side {
            name: "one",
            ports: vec![one.api_port],
            redis: one_redis
                .client()
                .get_multiplexed_async_connection()
                .await?,
            checks: 0,
            secs: 0.0,
            evalsha: 0,
            rates: Vec::new(),
            lat: Vec::new(),
        },
        Side {
            name: "two",
            ports: set.daemons.iter().map(|d| d.api_port).collect(),
            redis: set.redis[0]
                .client()
                .get_multiplexed_async_connection()
                .await?,
            checks: 0,
            secs: 0.0,
            evalsha: 0,
            rates: Vec::new(),
            lat: Vec::new(),
        },
    ];
    // A warm-up slice each, then alternating slices, the order reversed every other set.
    for s in &sides {
        drive(&s.ports, concurrency, Duration::from_millis(500)).await;
    }
    for k in 0..slices {
        let order: [usize; 2] = if k % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let s = &mut sides[i];
            let before = evalsha_calls(&mut s.redis).await?;
            let t = Instant::now();
            let (n, lat) = drive(&s.ports, concurrency, slice).await;
            let secs = t.elapsed().as_secs_f64();
            s.evalsha += evalsha_calls(&mut s.redis).await? - before;
            s.checks += n;
            s.secs += secs;
            s.rates.push(n as f64 / secs);
            s.lat.extend(lat);
        }
    }
    println!("concurrency {concurrency}, {slices} slices of {slice:?} each, alternating\n");
    println!("| daemons | checks/s (median of slices) | range | p50 ms | p99 ms | Redis calls per check |");
    println!("|---|---|---|---|---|---|");
    // Per set of slices: the pair over the single daemon (before the rates are sorted).
    let mut ratios: Vec<f64> = sides[1]
        .rates
        .iter()
        .zip(&sides[0].rates)
        .map(|(two, one)| two / one)
        .collect();
    let mut medians = Vec::new();
    for s in &mut sides {
        s.rates.sort_by(f64::total_cmp);
        s.lat.sort();
        let median = s.rates[s.rates.len() / 2];
        medians.push(median);
        println!(
            "| {} | {:.0} | {:.0}–{:.0} | {:.2} | {:.2} | {:.3} |",
            s.name,
            median,
            s.rates[0],
            s.rates[s.rates.len() - 1],
            pct(&s.lat, 0.5),
            pct(&s.lat, 0.99),
            s.evalsha as f64 / s.checks.max(1) as f64,
        );
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "\ntwo / one: {:.2} (medians), per-slice ratios {:.2}–{:.2}",
        medians[1] / medians[0],
        ratios[0],
        ratios[ratios.len() - 1]
    );
    Ok(())
}
