//! Plan-change propagation: three regions (real `quotad` and `redis-server` processes on
//! loopback) with many tenants assigned to one plan; one `PUT /v1/plans/<plan>` changes its
//! limit, and each region is polled until it enforces the new one. Printed: the PUT's own
//! latency and, per region, the time from sending the PUT until that region's answer follows
//! the new limit.
//!
//! ```text
//! cargo build --release -p quotad && cargo bench -p quotad-system-tests --bench plan_propagation
//! # QUOTAD_BENCH_TENANTS (100000), QUOTAD_BENCH_ROUNDS (5)
//! ```
//!
//! The probe is a check of cost 100 by one assigned tenant (a different one each round): the
//! small limit (10 an hour) refuses it (a cost above its burst: 400 naming `cost`) and the
//! large one (1 000 000 an hour) admits it in every region, so a region's answer tells which
//! limit it enforces. A refused probe takes nothing.

// A benchmark measures real elapsed time.
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use common::{env_or, pct};
use quotad_system_tests::{Cluster, Daemon, TOKEN};
use serde_json::json;

const PLAN: &str = "bench";
const SMALL: u64 = 10;
const LARGE: u64 = 1_000_000;
const COST: u64 = 100;
/// Between two probes of one region.
const POLL: Duration = Duration::from_millis(5);

async fn put_plan(leader: &Daemon, limit: u64) -> anyhow::Result<()> {
    let policies = json!({"calls": {"limit": limit, "window_ms": 3_600_000}});
    common::put_plan(leader, PLAN, policies).await
}

/// Polls `d` with the probe until its answer is `admitted`; the time since `t0`.
async fn until(d: &Daemon, tenant: &str, admitted: bool, t0: Instant) -> anyhow::Result<Duration> {
    let body = json!({"tenant": tenant, "policy": "calls", "cost": COST}).to_string();
    loop {
        let r = d
            .request("POST", "/v1/check", Some(TOKEN), Some(body.clone()))
            .await?;
        let now_admitted = match r.status {
            200 => Some(true),
            429 => Some(false),
            // A cost above the small limit's burst is refused as one that can never succeed.
            400 if r.body["errors"][0]["field"] == "cost" => Some(false),
            // The region cannot decide yet (a forward to the home region of a budget too
            // small to split failed): it enforces neither limit, so polling goes on.
            503 => None,
            other => bail!("the probe answered {other}: {}", r.body),
        };
        if now_admitted == Some(admitted) {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() > Duration::from_secs(120) {
            bail!("a region did not enforce the new limit within 120 s");
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Changes the plan's limit to `limit` and measures: the PUT's latency, then each region's
/// time until it enforces the new limit.
async fn change(
    cluster: &Cluster,
    leader: &Daemon,
    limit: u64,
    tenant: &str,
) -> anyhow::Result<(Duration, Vec<Duration>)> {
    let t0 = Instant::now();
    put_plan(leader, limit).await?;
    let put = t0.elapsed();
    let admitted = limit == LARGE;
    let [a, b, c] = &cluster.daemons[..] else {
        bail!("three regions expected");
    };
    let (a, b, c) = tokio::join!(
        until(a, tenant, admitted, t0),
        until(b, tenant, admitted, t0),
        until(c, tenant, admitted, t0)
    );
    Ok((put, vec![a?, b?, c?]))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let tenants: usize = env_or("QUOTAD_BENCH_TENANTS", 100_000);
    let rounds: usize = env_or("QUOTAD_BENCH_ROUNDS", 5);
    let cluster = common::three_regions().await?;
    let leader = common::leader(&cluster).await?;
    put_plan(leader, SMALL).await?;
    let t0 = Instant::now();
    common::load_assignments(leader, "a-", tenants, PLAN).await?;
    common::assigned_everywhere(&cluster, &format!("a-{}", tenants - 1), PLAN).await?;
    eprintln!(
        "{tenants} tenants assigned to {PLAN} in every region in {:.1} s",
        t0.elapsed().as_secs_f64()
    );

    println!("plan change on three regions, {tenants} tenants assigned; ms from sending the PUT");
    println!(
        "{:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "round", "limit", "put", cluster.names[0], cluster.names[1], cluster.names[2], "all"
    );
    let mut all = Vec::new();
    let mut puts = Vec::new();
    for round in 0..rounds {
        // A different assigned tenant each round, spread over the set.
        let tenant = format!("a-{}", (round * 7_919 + 13) % tenants);
        for limit in [LARGE, SMALL] {
            let (put, regions) = change(&cluster, leader, limit, &tenant)
                .await
                .with_context(|| format!("round {round}, limit {limit}"))?;
            let worst = regions.iter().copied().max().unwrap_or_default();
            println!(
                "{round:>5} {limit:>9} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
                ms(put),
                ms(regions[0]),
                ms(regions[1]),
                ms(regions[2]),
                ms(worst)
            );
            all.push(worst);
            puts.push(put);
        }
    }
    all.sort_unstable();
    puts.sort_unstable();
    println!(
        "every region enforcing the new limit: p50 {:.1} ms, max {:.1} ms over {} changes \
         (the PUT itself: p50 {:.1} ms)",
        pct(&all, 0.5),
        pct(&all, 1.0),
        all.len(),
        pct(&puts, 0.5)
    );
    Ok(())
}
