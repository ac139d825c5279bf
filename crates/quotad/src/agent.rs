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

    /// Forgets buckets `view` no longer has (deleted policies, old versions): only the view's
    /// buckets are asked about.
    pub fn retain_in(&mut self, view: &ClusterView) {
        self.shares.retain(|b, _| {
            view.policies
                .get(&(b.tenant.clone(), b.policy.clone()))
                .is_some_and(|e| e.policy.version == b.version)
        });
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
        written.retain_in(&v);
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use quota_core::{PolicyName, PolicySpec, TenantId};

    use super::*;
    use crate::coordination::{Grant, PolicyEntry};

    fn view(share_ppm: u32) -> (ClusterView, BucketRef, RegionId) {
        let region = RegionId::new("b").unwrap();
        let mut policy = PolicySpec {
            limit: 100.0,
            window_ms: 1000.0,
            floor: Some(0.1),
            ..Default::default()
        }
        .validate()
        .unwrap();
        policy.version = 7;
        let grant = Grant {
            share_ppm,
            floor_ppm: 100_000,
            lease_expires_ms: 50_000,
        };
        let (t, p) = (
            TenantId::new("acme").unwrap(),
            PolicyName::new("w").unwrap(),
        );
        let entry = PolicyEntry {
            policy,
            grants: BTreeMap::from([(region.clone(), grant)]),
            home: None,
        };
        let v = ClusterView {
            policies: BTreeMap::from([((t.clone(), p.clone()), entry)]),
            epoch: 3,
            lease_end_local_ms: 40_000,
            ..ClusterView::default()
        };
        let b = BucketRef {
            tenant: t,
            policy: p,
            version: 7,
        };
        (v, b, region)
    }

    #[test]
    fn only_a_cut_share_still_held_by_the_store_blocks_the_acknowledgement() {
        let (v, b, r) = view(300_000);
        let mut w = Written::new(0, 3_000);
        // Never written in this run: a previous run's share may hold for one lease.
        assert!(!w.bounded_by(&v, &r, 2_999));
        assert!(w.bounded_by(&v, &r, 3_000));
        // The store holds 0.3 until 10 s: a new epoch granting 0.3 or more is fine at once.
        w.shares.insert(b.clone(), (300_000, 10_000));
        assert!(w.bounded_by(&v, &r, 5_000));
        // Cut to 0.2: only once the stored lease of 0.3 has ended.
        let (cut, _, _) = view(200_000);
        assert!(!w.bounded_by(&cut, &r, 9_999));
        assert!(w.bounded_by(&cut, &r, 10_000));
        // Past this region's own lease (40 s) the view enforces the floor, 0.1: a cut too.
        w.shares.insert(b, (300_000, 45_000));
        assert!(w.bounded_by(&v, &r, 39_999));
        assert!(!w.bounded_by(&v, &r, 40_000));
        assert!(w.bounded_by(&v, &r, 45_000));
    }

    #[test]
    fn buckets_the_view_no_longer_has_are_forgotten() {
        let (v, b, _) = view(300_000);
        let mut w = Written::new(0, 0);
        let old = BucketRef {
            version: 6,
            ..b.clone()
        };
        w.shares.insert(b.clone(), (1, 1));
        w.shares.insert(old.clone(), (1, 1));
        w.retain_in(&v);
        assert!(w.shares.contains_key(&b) && !w.shares.contains_key(&old));
    }
}
