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
//!   lease end and the floor, so the store falls back on its own if this daemon dies. With the
//!   store unreachable it still acknowledges once the store cannot hold more than the epoch
//!   grants (no share was cut, or the cut share's stored lease ran out): the `local` fail mode
//!   enforces the granted share in process, and the region's lease must not lapse meanwhile.
//! - **report** (multi-region only): every report interval, drains usage from the store and
//!   sends it to the leader, then renews the lease through the log with the acknowledged epoch.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use quota_core::RegionId;
use quota_store::{BucketRef, SetParams, Store as _};
use tokio::sync::watch;

use crate::clock;
use crate::coordination::{ClusterView, Coordinator};
use crate::decision::{limit_for_share, Decider};

/// Most usage records drained per report: bounds one report's size.
const MAX_USAGE_RECORDS: usize = 10_000;

/// How long to sleep when no lease end is coming (a single region's lease never ends).
const FAR: Duration = Duration::from_secs(3600);

/// What the store was last told for each bucket: the share, and until when (local wall-clock
/// ms) the store itself holds it before falling to the floor.
#[derive(Debug, Default)]
pub struct Written {
    shares: HashMap<BucketRef, (u32, u64)>,
    /// Until when shares written by an earlier run of this daemon may hold in the store.
    unknown_until_ms: u64,
}

impl Written {
    /// Before anything is written, the store may hold shares from a previous run of this
    /// daemon for up to one lease.
    pub fn new(now_ms: u64, lease_ms: u64) -> Self {
        Self {
            shares: HashMap::new(),
            unknown_until_ms: now_ms.saturating_add(lease_ms),
        }
    }

    /// Whether the store cannot enforce more than `view` grants at `now_ms`, though some writes
    /// failed: for every bucket, what it holds is at most the new share or has run out. Then
    /// the epoch may be acknowledged with the store unreachable (`local` fail mode keeps the
    /// granted share in process), and only a share *cut* waits for the old one to end.
    pub fn bounded_by(&self, view: &ClusterView, region: &RegionId, now_ms: u64) -> bool {
        view.policies.iter().all(|((tenant, name), entry)| {
            let share = view.enforced_share_ppm(entry.grants.get(region), now_ms);
            let b = BucketRef {
                tenant: tenant.clone(),
                policy: name.clone(),
                version: entry.policy.version,
            };
            match self.shares.get(&b) {
                Some(&(held, until)) => held <= share || now_ms >= until,
                None => now_ms >= self.unknown_until_ms,
            }
        })
    }
}

/// Runs the apply loop until `shutdown` fires.
pub async fn run_apply(
    decider: Arc<Decider>,
    coordinator: Arc<Coordinator>,
    report_interval: Duration,
    lease_ms: u64,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut written = Written::new(clock::wall_ms(), lease_ms);
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
        let all = apply_shares(&decider, &v, &mut written).await;
        if let Coordinator::Replicated(r) = coordinator.as_ref() {
            if all {
                r.on_applied(v.epoch);
            } else if written.bounded_by(&v, decider.region(), clock::wall_ms()) {
                tracing::debug!(
                    epoch = v.epoch,
                    "Store unreachable; its shares are within this epoch's."
                );
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
pub async fn apply_shares(decider: &Decider, view: &ClusterView, written: &mut Written) -> bool {
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
        let mut holds_until = u64::MAX;
        if let (Some(left), Some(g)) = (lease_left, grant) {
            let floor = limit_for_share(&entry.policy, g.floor_ppm.min(g.share_ppm));
            req = req.with_lease(left, floor);
            holds_until = now + left;
        }
        if let Err(e) = decider.store().set_params(&req).await {
            tracing::debug!(tenant = %tenant, policy = %name, error = %e, "Applying a share failed.");
            return false;
        }
        written.shares.insert(req.bucket, (share, holds_until));
    }
    true
}
