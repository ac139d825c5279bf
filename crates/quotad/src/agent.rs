//! The region agent: applies this region's grants to its store, collects usage, reports it and
//! keeps the lease.
//!
//! Two loops, so a slow coordinator write never delays enforcement:
//!
//! - **apply**: on every view change, every report interval (which re-applies shares after a
//!   Redis restart) and at the moment the lease runs out, writes the bucket parameters this
//!   region enforces (`for_share(policy, enforced share)`) into its store, so any caller of the
//!   store (this daemon, or a gateway running the Lua script directly) enforces the current
//!   share; once every write succeeded it acknowledges the view's epoch. Each write carries the
//!   lease end and the floor, so the store falls back on its own if this daemon dies.
//! - **report** (multi-region only): every report interval, drains usage from the store and
//!   sends it to the leader, then renews the lease through the log with the acknowledged epoch.

use std::sync::Arc;
use std::time::Duration;

use quota_store::{BucketRef, SetParams, Store as _};
use tokio::sync::watch;

use crate::clock;
use crate::coordination::{ClusterView, Coordinator};
use crate::decision::{limit_for_share, Decider};

/// Most usage records drained per report: bounds one report's size.
const MAX_USAGE_RECORDS: usize = 10_000;

/// How long to sleep when no lease end is coming (a single region's lease never ends).
const FAR: Duration = Duration::from_secs(3600);

/// Runs the apply loop until `shutdown` fires.
pub async fn run_apply(
    decider: Arc<Decider>,
    coordinator: Arc<Coordinator>,
    report_interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut view = coordinator.subscribe();
    let mut tick = tokio::time::interval(report_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let current = view.borrow_and_update().clone();
        let now = clock::wall_ms();
        let until_lease_end = if current.lease_end_local_ms > now {
            Duration::from_millis(current.lease_end_local_ms - now).min(FAR)
        } else {
            FAR
        };
        tokio::select! {
            _ = shutdown.changed() => break,
            changed = view.changed() => {
                if changed.is_err() {
                    break;
                }
            }
            _ = tick.tick() => {}
            () = tokio::time::sleep(until_lease_end) => {
                tracing::warn!(region = %decider.region(), "Lease ran out: enforcing floors.");
            }
        }
        let v = view.borrow().clone();
        let all = apply_shares(&decider, &v).await;
        if all {
            if let Coordinator::Replicated(r) = coordinator.as_ref() {
                r.on_applied(v.epoch);
            }
        }
    }
}

/// Runs the report loop (multi-region) until `shutdown` fires.
pub async fn run_report(
    decider: Arc<Decider>,
    coordinator: Arc<Coordinator>,
    report_interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let Coordinator::Replicated(r) = coordinator.as_ref() else {
        return;
    };
    let mut tick = tokio::time::interval(report_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = clock::monotonic();
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            _ = tick.tick() => {}
        }
        let interval_ms = last.elapsed().as_millis() as u64;
        last = clock::monotonic();
        match decider.store().collect_usage(MAX_USAGE_RECORDS).await {
            Ok(usage) => {
                if let Err(e) = r.report_usage(&usage, interval_ms.max(1)).await {
                    tracing::debug!(error = %e, "Usage report not delivered.");
                }
            }
            Err(e) => tracing::debug!(error = %e, "Usage collection failed."),
        }
        if let Err(e) = r.renew_lease().await {
            tracing::debug!(error = %e, "Lease renewal failed.");
        }
    }
}

/// Writes the enforced share of every policy into the store; true if every write succeeded.
///
/// While the lease holds, each write carries the time left on it and the floor: the store drops
/// to the floor at the lease end by itself, so if this daemon dies, its Redis (which gateways
/// may call directly) stops holding share the coordinator gives elsewhere. Every application
/// renews that end, so it trails the lease by at most one report interval.
pub async fn apply_shares(decider: &Decider, view: &ClusterView) -> bool {
    let region = decider.region();
    let now = clock::wall_ms();
    let lease_left = (view.lease_end_local_ms != u64::MAX && view.lease_end_local_ms > now)
        .then(|| view.lease_end_local_ms - now);
    for ((tenant, name), entry) in &view.policies {
        let grant = entry.grants.get(region);
        let share = view.enforced_share_ppm(grant, now);
        let b = BucketRef {
            tenant: tenant.clone(),
            policy: name.clone(),
            version: entry.policy.version,
        };
        let mut req = SetParams::new(b, limit_for_share(&entry.policy, share));
        if let (Some(left), Some(g)) = (lease_left, grant) {
            let floor = limit_for_share(&entry.policy, g.floor_ppm.min(g.share_ppm));
            req = req.with_lease(left, floor);
        }
        if let Err(e) = decider.store().set_params(&req).await {
            tracing::debug!(tenant = %tenant, policy = %name, error = %e, "Applying a share failed.");
            return false;
        }
    }
    true
}
