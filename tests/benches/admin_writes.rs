//! Admin-write benchmark: sequential policy PUTs to the leader of three regions (real `quotad`
//! and `redis-server` processes on loopback), first with nothing stored, then with many
//! policies and as many plan assignments stored, in the same run. An admin write should cost
//! the daemons what changed, not what is stored.
//!
//! ```text
//! cargo build --release -p quotad && cargo bench -p quotad-system-tests --bench admin_writes
//! QUOTAD_BENCH_STORED=100000 QUOTAD_BENCH_PUTS=300 cargo bench -p quotad-system-tests --bench admin_writes
//! ```
//!
//! The stored policies are loaded through `POST /v1/policies/batch` and the assignments (of
//! tenants with no policy of their own, to one plan) through `POST /v1/plans/assignments/batch`,
//! 500 a request; the run waits until every region's view holds them before measuring again.

// A benchmark measures real elapsed time.
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::{Duration, Instant};

use common::{env_or, pct};
use quotad_system_tests::Daemon;
use serde_json::json;

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

fn row(policies: usize, assignments: usize, (lat, failed): &(Vec<Duration>, usize)) {
    println!(
        "{policies:>9} {assignments:>11} {:>6} {:>7} {:>9.2} {:>9.2} {:>9.2}",
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
    let cluster = common::three_regions().await?;
    let leader = common::leader(&cluster).await?;

    let empty = measure(leader, "empty", puts).await;
    eprintln!("measured with none stored; loading {stored} policies and {stored} assignments");
    common::put_plan(
        leader,
        "bench",
        json!({"calls": {"limit": 100, "window_ms": 60000}}),
    )
    .await?;
    let t0 = Instant::now();
    common::load_policies(leader, "s-", stored).await?;
    common::load_assignments(leader, "a-", stored, "bench").await?;
    // The plan's policy is one more.
    common::policies_everywhere(&cluster, (stored + puts + 1) as u64).await?;
    common::assigned_everywhere(&cluster, &format!("a-{}", stored - 1), "bench").await?;
    let loaded_in = t0.elapsed();
    eprintln!("loaded in {:.1} s", loaded_in.as_secs_f64());
    let full = measure(leader, "full", puts).await;

    println!("policy PUT to the leader of three regions, sequential, latency in ms");
    println!(
        "{:>9} {:>11} {:>6} {:>7} {:>9} {:>9} {:>9}",
        "policies", "assignments", "puts", "failed", "p50", "p99", "max"
    );
    row(0, 0, &empty);
    row(stored + puts + 1, stored, &full);
    println!(
        "ratio p50 {:.2}, p99 {:.2}; {stored} policies and {stored} assignments loaded and in \
         every view in {:.1} s",
        pct(&full.0, 0.5) / pct(&empty.0, 0.5),
        pct(&full.0, 0.99) / pct(&empty.0, 0.99),
        loaded_in.as_secs_f64()
    );
    Ok(())
}
