//! Admin-write benchmark: sequential policy PUTs to the leader of three regions (real `quotad`
//! and `redis-server` processes on loopback), first with no policies stored, then with many,
//! in the same run. An admin write should cost the daemons what changed, not what is stored.
//!
//! ```text
//! cargo build --release -p quotad && cargo bench -p quotad-system-tests --bench admin_writes
//! QUOTAD_BENCH_STORED=100000 QUOTAD_BENCH_PUTS=300 cargo bench -p quotad-system-tests --bench admin_writes
//! ```
//!
//! The stored policies are loaded through `POST /v1/policies/batch` (500 a request) and the
//! run waits until every region's view holds them before measuring again.

// A benchmark measures real elapsed time.
#![allow(clippy::disallowed_methods)]

use std::time::{Duration, Instant};

use anyhow::Context as _;
use quotad_system_tests::{eventually, Cluster, Daemon, Timings, TOKEN};
use serde_json::json;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Percentile `q` (0..=1) of sorted latencies, in ms.
fn pct(sorted: &[Duration], q: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

/// `puts` sequential PUTs of fresh policies (tenant `t-<tag>-<i>`) to `leader`: the latency
/// of each (a failed one counts with its time) and how many failed.
async fn measure(leader: &Daemon, tag: &str, puts: usize) -> (Vec<Duration>, usize) {
    let mut lat = Vec::with_capacity(puts);
    let mut failed = 0;
    for i in 0..puts {
        let spec = json!({"limit": 100, "window_ms": 60000});
        let t0 = Instant::now();
        if let Err(e) = leader
            .put_policy(&format!("t-{tag}-{i}"), "writes", spec)
            .await
        {
            failed += 1;
            eprintln!("PUT {i} ({tag}) failed: {e:#}");
        }
        lat.push(t0.elapsed());
    }
    lat.sort_unstable();
    (lat, failed)
}

/// Policies a load request stores (within the default body limit).
const BATCH: usize = 500;

/// Stores `n` policies on `leader` in batches of [`BATCH`].
async fn load(leader: &Daemon, n: usize) -> anyhow::Result<()> {
    for start in (0..n).step_by(BATCH) {
        let policies: Vec<_> = (start..(start + BATCH).min(n))
            .map(|i| json!({"tenant": format!("s-{i}"), "policy": "writes", "limit": 100, "window_ms": 60000}))
            .collect();
        let r = leader
            .request(
                "POST",
                "/v1/policies/batch",
                Some(TOKEN),
                Some(json!({ "policies": policies }).to_string()),
            )
            .await?;
        anyhow::ensure!(r.status == 200, "batch answered {}: {}", r.status, r.body);
    }
    Ok(())
}

/// Waits until every region's view holds at least `n` policies.
async fn settled(cluster: &Cluster, n: u64) -> anyhow::Result<()> {
    for d in &cluster.daemons {
        eventually(
            Duration::from_secs(600),
            Duration::from_millis(500),
            || async {
                let s = d
                    .request("GET", "/v1/status", Some(TOKEN), None)
                    .await
                    .ok()?;
                (s.body["policies"].as_u64()? >= n).then_some(())
            },
        )
        .await
        .with_context(|| format!("a region never held {n} policies"))?;
    }
    Ok(())
}

fn row(name: &str, (lat, failed): &(Vec<Duration>, usize)) {
    println!(
        "{name:<10} {:>6} {:>7} {:>9.2} {:>9.2} {:>9.2}",
        lat.len(),
        failed,
        pct(lat, 0.5),
        pct(lat, 0.99),
        pct(lat, 1.0)
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let stored: usize = env_or("QUOTAD_BENCH_STORED", 100_000);
    let puts: usize = env_or("QUOTAD_BENCH_PUTS", 200);
    let timings = Timings {
        report_interval_ms: 500,
        rebalance_interval_ms: 2_000,
        lease_ms: 30_000,
        drift_margin_ms: 500,
        ..Timings::default()
    };
    let cluster = Cluster::start(&["a", "b", "c"], &timings).await?;
    let s = cluster.daemons[0].get("/v1/status").await?;
    let leader_id = s.body["raft"]["leader"]
        .as_str()
        .context("no leader")?
        .to_string();
    let leader = cluster.daemon(&leader_id);

    let empty = measure(leader, "empty", puts).await;
    eprintln!("measured with none stored; loading {stored}");
    let t0 = Instant::now();
    load(leader, stored).await?;
    settled(&cluster, (stored + puts) as u64).await?;
    let loaded_in = t0.elapsed();
    eprintln!("loaded in {:.1} s", loaded_in.as_secs_f64());
    let full = measure(leader, "full", puts).await;

    println!("policy PUT to the leader of three regions, sequential, latency in ms");
    println!(
        "{:<10} {:>6} {:>7} {:>9} {:>9} {:>9}",
        "stored", "puts", "failed", "p50", "p99", "max"
    );
    row("0", &empty);
    row(&format!("{}", stored + puts), &full);
    println!(
        "ratio p50 {:.2}, p99 {:.2}; {stored} policies loaded and in every view in {:.1} s",
        pct(&full.0, 0.5) / pct(&empty.0, 0.5),
        pct(&full.0, 0.99) / pct(&empty.0, 0.99),
        loaded_in.as_secs_f64()
    );
    Ok(())
}
