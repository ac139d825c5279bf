//! The region agent: applies this region's grants to its store and collects usage.
//!
//! On every committed change of the coordinator view, and every report interval, it writes the
//! bucket parameters this region enforces (`BucketParams::for_share(policy, enforced share)`)
//! into its store, so any caller of the store (this daemon, a gateway running the Lua script
//! directly) enforces the current share; the periodic pass also re-applies shares after a Redis
//! restart and drops a share to the floor once its lease runs out. Every report interval it
//! drains usage from the store; with a one-node coordinator the usage only feeds metrics.

use std::sync::Arc;
use std::time::Duration;

use quota_store::{BucketRef, Store as _};
use tokio::sync::watch;

use crate::clock;
use crate::coordination::{enforced_share_ppm, ClusterView};
use crate::decision::{limit_for_share, Decider};
use crate::telemetry;

/// Most usage records drained per report: bounds one report's size.
const MAX_USAGE_RECORDS: usize = 10_000;

/// Runs until `shutdown` fires.
pub async fn run(
    decider: Arc<Decider>,
    mut view: watch::Receiver<Arc<ClusterView>>,
    report_interval: Duration,
    drift_margin_ms: u64,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(report_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            changed = view.changed() => {
                if changed.is_err() {
                    break;
                }
                let v = view.borrow_and_update().clone();
                apply_shares(&decider, &v, drift_margin_ms).await;
            }
            _ = tick.tick() => {
                let v = view.borrow().clone();
                apply_shares(&decider, &v, drift_margin_ms).await;
                match decider.store().collect_usage(MAX_USAGE_RECORDS).await {
                    Ok(usage) => tracing::debug!(records = usage.len(), "Usage collected."),
                    Err(e) => tracing::debug!(error = %e, "Usage collection failed."),
                }
            }
        }
    }
}

/// Writes the enforced share of every policy into the store; returns how many were written.
pub async fn apply_shares(decider: &Decider, view: &ClusterView, drift_margin_ms: u64) -> usize {
    let region = decider.region();
    let now = clock::wall_ms();
    let mut written = 0;
    let mut min_lease_ms: Option<u64> = None;
    for ((tenant, name), entry) in &view.policies {
        let grant = entry.grants.get(region);
        if let Some(g) = grant.filter(|g| g.lease_expires_ms != u64::MAX) {
            let left = g.lease_expires_ms.saturating_sub(now);
            min_lease_ms = Some(min_lease_ms.map_or(left, |m| m.min(left)));
        }
        let share = enforced_share_ppm(&entry.policy, grant, drift_margin_ms);
        let limit = limit_for_share(&entry.policy, share);
        let b = BucketRef {
            tenant: tenant.clone(),
            policy: name.clone(),
            version: entry.policy.version,
        };
        match decider.store().set_params(&b, limit).await {
            Ok(()) => written += 1,
            Err(e) => {
                tracing::debug!(tenant = %tenant, policy = %name, error = %e, "Applying a share failed.");
                break;
            }
        }
    }
    if let Some(ms) = min_lease_ms {
        metrics::gauge!(telemetry::LEASE_REMAINING_MS, "region" => region.as_str().to_string())
            .set(ms as f64);
    }
    written
}
