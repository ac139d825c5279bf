//! What the system benchmarks share: percentiles, loading many policies and plan assignments
//! through the batch routes, and waiting until every region's view holds them.

// Each bench uses its own part of this module.
#![allow(dead_code)]

use std::time::Duration;

use anyhow::Context as _;
use quotad_system_tests::{eventually, Cluster, Daemon, Timings, TOKEN};
use serde_json::json;

/// Entries a load request carries (within the default 64 KiB body limit).
pub const BATCH: usize = 500;

pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Percentile `q` (0..=1) of sorted latencies, in ms.
pub fn pct(sorted: &[Duration], q: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

/// Three regions on loopback with the benches' timings (0.5 s reports, 2 s rounds, 30 s
/// leases), and their leader.
pub async fn three_regions() -> anyhow::Result<Cluster> {
    let timings = Timings {
        report_interval_ms: 500,
        rebalance_interval_ms: 2_000,
        lease_ms: 30_000,
        drift_margin_ms: 500,
        ..Timings::default()
    };
    Cluster::start(&["a", "b", "c"], &timings).await
}

/// PUTs `plan` with `policies` (a plan body's `policies` object) on `d`; fails unless 200.
pub async fn put_plan(d: &Daemon, plan: &str, policies: serde_json::Value) -> anyhow::Result<()> {
    let body = json!({ "policies": policies });
    let r = d
        .request(
            "PUT",
            &format!("/v1/plans/{plan}"),
            Some(TOKEN),
            Some(body.to_string()),
        )
        .await?;
    anyhow::ensure!(
        r.status == 200,
        "plan PUT answered {}: {}",
        r.status,
        r.body
    );
    Ok(())
}

/// The leader of `cluster`, as the first daemon sees it.
pub async fn leader(cluster: &Cluster) -> anyhow::Result<&Daemon> {
    let s = cluster.daemons[0].get("/v1/status").await?;
    let id = s.body["raft"]["leader"]
        .as_str()
        .context("no leader")?
        .to_string();
    Ok(cluster.daemon(&id))
}

/// POSTs `body` to `path` with the admin token; fails unless 200.
async fn post(d: &Daemon, path: &str, body: serde_json::Value) -> anyhow::Result<()> {
    let r = d
        .request("POST", path, Some(TOKEN), Some(body.to_string()))
        .await?;
    anyhow::ensure!(r.status == 200, "{path} answered {}: {}", r.status, r.body);
    Ok(())
}

/// Stores `n` policies `<prefix><i>/writes` on `leader` in batches of [`BATCH`].
pub async fn load_policies(leader: &Daemon, prefix: &str, n: usize) -> anyhow::Result<()> {
    for start in (0..n).step_by(BATCH) {
        let policies: Vec<_> = (start..(start + BATCH).min(n))
            .map(|i| json!({"tenant": format!("{prefix}{i}"), "policy": "writes", "limit": 100, "window_ms": 60000}))
            .collect();
        post(
            leader,
            "/v1/policies/batch",
            json!({ "policies": policies }),
        )
        .await?;
    }
    Ok(())
}

/// Assigns tenants `<prefix>0` to `<prefix><n-1>` to `plan` on `leader`, in batches of
/// [`BATCH`].
pub async fn load_assignments(
    leader: &Daemon,
    prefix: &str,
    n: usize,
    plan: &str,
) -> anyhow::Result<()> {
    for start in (0..n).step_by(BATCH) {
        let assignments: Vec<_> = (start..(start + BATCH).min(n))
            .map(|i| json!({"tenant": format!("{prefix}{i}"), "plan": plan}))
            .collect();
        post(
            leader,
            "/v1/plans/assignments/batch",
            json!({ "assignments": assignments }),
        )
        .await?;
    }
    Ok(())
}

/// Waits until every region's view holds at least `n` policies.
pub async fn policies_everywhere(cluster: &Cluster, n: u64) -> anyhow::Result<()> {
    for d in &cluster.daemons {
        eventually(
            Duration::from_secs(600),
            Duration::from_millis(500),
            || async {
                let s = d.get("/v1/status").await.ok()?;
                (s.body["policies"].as_u64()? >= n).then_some(())
            },
        )
        .await
        .with_context(|| format!("a region never held {n} policies"))?;
    }
    Ok(())
}

/// Waits until every region's view assigns `tenant` to `plan` (batches apply in order, so the
/// last tenant loaded stands for all before it).
pub async fn assigned_everywhere(
    cluster: &Cluster,
    tenant: &str,
    plan: &str,
) -> anyhow::Result<()> {
    let path = format!("/v1/tenants/{tenant}/plan");
    for d in &cluster.daemons {
        eventually(
            Duration::from_secs(600),
            Duration::from_millis(500),
            || async {
                let r = d.get(&path).await.ok()?;
                (r.body["plan"] == plan).then_some(())
            },
        )
        .await
        .with_context(|| format!("a region never assigned {tenant} to {plan}"))?;
    }
    Ok(())
}
