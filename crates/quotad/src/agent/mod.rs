//! The region agent: applies this region's grants to its store, collects usage, reports it and
//! keeps the lease.
//!
//! Two loops, so a slow coordinator write never delays enforcement:
//!
//! - **apply**: on every view change, every report interval and at the moment the lease runs
//!   out, brings the bucket parameters this region enforces (`for_share(policy, enforced
//!   share)`) in its store in line with the view, so any caller of the store (this daemon, or a
//!   gateway running the Lua script directly) enforces the current share; once every write
//!   succeeded it acknowledges the view's epoch. A pass writes only buckets whose parameters
//!   changed, renewals that are due, and everything when the store is a new instance (a
//!   restarted Redis is empty), [`WRITE_CONCURRENCY`] at a time. Each write carries the lease
//!   end (also mapped onto the store's clock, [`store_clock`], so no stored end outlasts the
//!   region's lease) and the floor, so the store falls back on its own if this daemon dies.
//!   A pass that cannot read the store's clock writes nothing. With the store
//!   unreachable it still acknowledges once the store cannot hold more than the epoch grants
//!   (no share was cut, or the cut share's stored lease ran out): the `local` fail mode
//!   enforces the granted share in process, and the region's lease must not lapse meanwhile.
//!   Once per store instance and hourly, after a pass that wrote everything and while the
//!   lease holds (the view is then current), it sweeps the store for parameters the view has
//!   no use for (a policy deleted or replaced while this daemon was down) and clears them.
//! - **report** (multi-region only): every report interval, drains usage from the store and
//!   sends it to the leader, then renews the lease through the log with the acknowledged epoch.

mod ledger;
mod store_clock;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{self, StreamExt as _};
use quota_core::heavy::TopK;
use quota_core::{PolicyName, TenantId};
use quota_store::{BucketRef, Store as _, StoreError, UsageRecord};
use tokio::sync::watch;

pub use ledger::{Pacing, Written};

use crate::clock;
use crate::coordination::{ClusterView, Coordinator, Replicated};
use crate::decision::Decider;
use crate::telemetry::{AgentMetrics, ReportMetrics, Reported, WriteOutcomes};
use ledger::{Write, SWEEP_RETRY_MS};
use store_clock::lease_end_on_store;

/// Most usage records drained per report: bounds one report's size.
const MAX_USAGE_RECORDS: usize = 10_000;

/// How long to sleep when no lease end is coming (a single region's lease never ends).
const FAR: Duration = Duration::from_secs(3600);

/// Parameter writes in flight at once: pipelined on the store's connection, so a pass over many
/// buckets costs Redis time, not round trips.
const WRITE_CONCURRENCY: usize = 64;

/// Runs the apply loop until `shutdown` fires.
///
/// `replicated` is the replicated member of a multi-region cluster (`None` for a single
/// region): it is told each epoch the store enforces, and its lease is watched. `owner` is
/// this daemon's mark on its Redis ([`crate::store_owner`]), renewed while it writes.
pub async fn run_apply(
    decider: Arc<Decider>,
    coordinator: Arc<Coordinator>,
    replicated: Option<Arc<Replicated>>,
    owner: Option<(String, Duration)>,
    report_interval: Duration,
    lease_ms: u64,
    mut shutdown: watch::Receiver<bool>,
) {
    // A replicated daemon's view may lag the log at start; after a lease of renewals going
    // through it, it has caught up with everything committed before this daemon started.
    let settle = if replicated.is_some() { lease_ms } else { 0 };
    let mut written = Written::new(clock::monotonic_ms(), lease_ms).with_sweep_settle(settle);
    let pacing = Pacing {
        report_interval_ms: report_interval.as_millis() as u64,
        lease_ms,
    };
    let mut view = coordinator.subscribe();
    let metrics = AgentMetrics::new(decider.region());
    let mut tick = tokio::time::interval(report_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The fence this daemon last wrote with: a new one (a won claim) starts from a full pass.
    let mut holding: Option<u64> = None;
    // Parameters changed by a pass that no replica has confirmed yet.
    let mut unconfirmed = false;
    // Whether the log has heard of this agent's first complete pass under its fence.
    let mut passed = true;
    loop {
        let current = view.borrow_and_update().clone();
        let now = clock::monotonic_ms();
        let until_lease_end = if current.lease_end_local_ms > now {
            Duration::from_millis(current.lease_end_local_ms - now).min(FAR)
        } else {
            FAR
        };
        let won = async {
            match &replicated {
                Some(r) => r.agent_won().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = shutdown.changed() => break,
            changed = view.changed() => {
                if changed.is_err() {
                    break;
                }
            }
            _ = tick.tick() => {}
            () = tokio::time::sleep(until_lease_end) => {}
            () = won => {}
        }
        if let Some(r) = &replicated {
            // Here, not on a view change: a cut-off region applies nothing, and its lease
            // must still be seen running out (a lapse this misses, the next renewal tells).
            r.observe_lease();
        }
        let v = view.borrow().clone();
        metrics.committed_epoch.set(v.epoch as f64);
        // Every daemon of a region keeps its mark on the region's Redis, the agent or not.
        if let Some((mark, ttl)) = &owner {
            crate::store_owner::renew(decider.store(), mark, *ttl).await;
        }
        let fence = match &replicated {
            Some(r) => match r.agent_fence() {
                Some(f) => Some(f),
                None => {
                    // A standby writes nothing: it enforces its view (the parameters checks
                    // pass, the `local` fail mode), and acknowledges that.
                    metrics.holder.set(0.0);
                    holding = None;
                    // Envoys hold assignments of this daemon until they expire: a cut share
                    // is acknowledged once they fit it.
                    if decider.envoys_fit(&v) {
                        r.on_applied(v.epoch);
                        metrics.applied_epoch.set(v.epoch as f64);
                    }
                    continue;
                }
            },
            None => None,
        };
        if replicated.is_some() && holding != fence {
            // The role is new to this daemon: what the store holds is another daemon's
            // writing, so everything is written again under this fence.
            written = Written::new(clock::monotonic_ms(), lease_ms).with_sweep_settle(settle);
            holding = fence;
            passed = false;
            metrics.holder.set(1.0);
        }
        let (all, outcomes) = apply_shares(&decider, &v, &mut written, pacing, fence).await;
        metrics.share_writes(outcomes);
        // Fault: a Redis failover that loses the last writes would bring back the shares they
        // cut. A pass that changed parameters is acknowledged only once a replica has them.
        unconfirmed |= outcomes.changed > 0;
        let all = all && !(unconfirmed && replicated.is_some() && !durable(&decider).await);
        if all {
            unconfirmed = false;
        }
        let applied = match &replicated {
            Some(r) => {
                let slack = 2 * r.drift_margin_ms();
                // Writes a replica has not confirmed may be lost in a failover: what they
                // replaced is not bounded (found by the model checker, `BoundedAfterWait`).
                let bounded = !all
                    && !unconfirmed
                    && written.bounded_by(&v, decider.region(), clock::monotonic_ms(), slack);
                if bounded {
                    tracing::debug!(
                        epoch = v.epoch,
                        "Store unreachable; its shares are within this epoch's."
                    );
                }
                // Envoys' assignments (RLQS) are enforced by the Envoys, not the store.
                let applied = (all || bounded) && decider.envoys_fit(&v);
                if applied {
                    r.on_applied(v.epoch);
                }
                applied
            }
            None => all,
        };
        if applied {
            metrics.applied_epoch.set(v.epoch as f64);
        }
        // The store holds this agent's whole view now (a complete pass, replicated): what
        // agents that stopped before it wrote is replaced.
        if let (Some(r), Some(f), true, false) = (&replicated, fence, all, passed) {
            passed = r.agent_passed(f).await;
        }
    }
}

/// Whether the store's replicas have what this daemon wrote ([`quota_store::AnyStore::durable`]).
async fn durable(decider: &Decider) -> bool {
    match decider.store().durable().await {
        Ok(true) => true,
        Ok(false) => {
            tracing::debug!("No replica confirmed the parameters written: not acknowledged yet.");
            false
        }
        Err(e) => {
            tracing::debug!(error = %e, "Asking the store's replicas failed.");
            false
        }
    }
}

/// Usage of subjects' buckets under a plan's policy, summed into that class (its reserved
/// subject): the allocator learns class demand, and a report is O(classes + explicit
/// policies + promoted subjects) entries however many subjects were active. A promoted
/// subject's usage stays its own (its entry has its own demand estimate). A bucket of a
/// version the view does not resolve to (a superseded one) is kept as it is; the leader
/// ignores what it does not know.
pub(crate) fn by_class(view: &ClusterView, usage: Vec<UsageRecord>) -> Vec<UsageRecord> {
    let mut classes: std::collections::BTreeMap<BucketRef, (u64, u64)> = Default::default();
    let mut out = Vec::with_capacity(usage.len());
    for u in usage {
        match class_of(view, &u.bucket) {
            Some(class) => {
                let key = BucketRef {
                    tenant: class.clone(),
                    policy: u.bucket.policy,
                    version: u.bucket.version,
                };
                let slot = classes.entry(key).or_default();
                slot.0 = slot.0.saturating_add(u.admitted);
                slot.1 = slot.1.saturating_add(u.denied);
            }
            None => out.push(u),
        }
    }
    out.extend(
        classes
            .into_iter()
            .map(|(bucket, (admitted, denied))| UsageRecord {
                bucket,
                admitted,
                denied,
            }),
    );
    out
}

/// Adds `cached` (denied tokens the daemon answered without Redis) to the records of the same
/// buckets in `usage`, or as records of their own: a bucket's denials are one figure, for
/// demand and for the heavy subjects alike.
pub(crate) fn add_denied(usage: &mut Vec<UsageRecord>, cached: &[UsageRecord]) {
    let mut left: std::collections::HashMap<&BucketRef, u64> = Default::default();
    for c in cached {
        let d = left.entry(&c.bucket).or_default();
        *d = d.saturating_add(c.denied);
    }
    for u in usage.iter_mut() {
        if let Some(d) = left.remove(&u.bucket) {
            u.denied = u.denied.saturating_add(d);
        }
    }
    usage.extend(cached.iter().filter_map(|c| {
        let denied = left.remove(&c.bucket)?;
        Some(UsageRecord {
            bucket: c.bucket.clone(),
            admitted: 0,
            denied,
        })
    }));
}

/// The class a subject's bucket decides under at its class's share: `None` for an explicit
/// policy, a promoted subject, or a bucket of another version.
fn class_of<'a>(view: &'a ClusterView, bucket: &BucketRef) -> Option<&'a TenantId> {
    let r = view.resolve(&bucket.tenant, &bucket.policy)?;
    r.plan
        .filter(|_| !r.promoted && r.entry.policy.version == bucket.version)
}

/// The subjects most denied at their class's share in `usage`: a space-saving top-K
/// ([`quota_core::heavy`]) of their denials, each with its admitted tokens and the denials it
/// certainly had, heaviest first. Subject ids are the bucket's (identities arrive hashed).
pub(crate) fn denied_at_class_share(
    view: &ClusterView,
    usage: &[UsageRecord],
    k: usize,
) -> Vec<(TenantId, PolicyName, u64, u64)> {
    let mut top = TopK::new(k);
    let mut admitted: std::collections::BTreeMap<(&TenantId, &PolicyName), u64> =
        Default::default();
    for u in usage.iter().filter(|u| u.denied > 0) {
        if class_of(view, &u.bucket).is_some() {
            let key = (&u.bucket.tenant, &u.bucket.policy);
            top.add(key, u.denied);
            let a = admitted.entry(key).or_default();
            *a = a.saturating_add(u.admitted);
        }
    }
    top.heavy()
        .into_iter()
        .filter(|h| h.guaranteed() > 0)
        .map(|h| {
            let (t, p) = h.key;
            let a = admitted.get(&h.key).copied().unwrap_or(0);
            (t.clone(), p.clone(), a, h.guaranteed())
        })
        .collect()
}

/// How many report intervals of silence from the agent make a standby take its role over:
/// a renewal or two lost to a leader election must not depose a live agent.
pub const TAKEOVER_INTERVALS: u32 = 3;

/// Runs the report and renewal loops (multi-region) until `shutdown` fires: every daemon
/// renews its lease and looks at the agent role; the agent reports the region's usage.
pub async fn run_report(
    decider: Arc<Decider>,
    r: Arc<Replicated>,
    report_interval: Duration,
    shutdown: watch::Receiver<bool>,
) {
    let metrics = ReportMetrics::new(decider.region());
    // Two loops, each on its own tick. Fault: a report or an agent claim stuck on a leader
    // that stopped answering (a claim may wait a whole write timeout, as long as a lease) must
    // not hold up the next renewal, or the region would enforce its floors meanwhile.
    tokio::join!(
        report_loop(&decider, &r, report_interval, &metrics, shutdown.clone()),
        renew_loop(&r, report_interval, &metrics, shutdown),
    );
}

/// Renews this daemon's lease every `interval` until `shutdown` fires.
async fn renew_loop(
    r: &Replicated,
    interval: Duration,
    metrics: &ReportMetrics,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            _ = tick.tick() => {}
        }
        let renewed = r.renew_lease().await;
        if let Err(e) = &renewed {
            tracing::debug!(error = %e, "Lease renewal failed.");
        }
        metrics.lease_renewal(renewed.is_ok());
    }
}

/// Looks at the agent role every `interval` until `shutdown` fires: the agent reports the
/// region's usage, a standby hands what it counted to the agent.
async fn report_loop(
    decider: &Decider,
    r: &Replicated,
    interval: Duration,
    metrics: &ReportMetrics,
    mut shutdown: watch::Receiver<bool>,
) {
    let takeover_ms = (interval * TAKEOVER_INTERVALS).as_millis() as u64;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = clock::monotonic();
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            _ = tick.tick() => {}
        }
        let interval_ms = last.elapsed().as_millis() as u64;
        last = clock::monotonic();
        let report = async {
            // Only the agent drains the store's usage and reports it: a report is the
            // region's demand over the interval, and the store counts every daemon's checks.
            match r.keep_agent_role(takeover_ms).await {
                Ok(true) => {}
                Ok(false) => {
                    // What a standby counts without the store goes to the agent's report:
                    // checks it forwarded, denials it answered from its cache.
                    let mut forwarded = decider.take_forwarded_usage();
                    // Envoys' requests (RLQS) are demand here, where the Envoys are.
                    let envoys = decider.envoy_holdings();
                    forwarded.extend(envoys.take_usage(interval_ms, clock::monotonic_ms()));
                    let cached = decider.take_cached_denials();
                    if let Err(e) = r.hand_over_usage(&forwarded, &cached).await {
                        tracing::debug!(error = %e, "Handing usage to the agent failed.");
                        decider.restore_cached_denials(cached);
                    }
                    return None;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "Looking at the agent role failed.");
                    return None;
                }
            }
            // Envoys' requests (RLQS), over this interval: the store never sees them.
            let envoys = decider
                .envoy_holdings()
                .take_usage(interval_ms, clock::monotonic_ms());
            // The first report after a takeover drains what Redis counted since the replaced
            // agent's last report: over that time, not one interval.
            let mut interval_ms = interval_ms;
            if let Some(since) = r.take_takeover_since() {
                interval_ms = interval_ms.max(clock::monotonic_ms().saturating_sub(since));
            }
            Some(
                match decider.store().collect_usage(MAX_USAGE_RECORDS).await {
                    Ok(mut usage) => {
                        let (standby_forwarded, standby_cached) = r.take_standby_usage();
                        // Checks sent to another region are demand here, where their callers are.
                        usage.extend(decider.take_forwarded_usage());
                        usage.extend(envoys);
                        usage.extend(standby_forwarded);
                        // Denials answered from the denial cache never reached Redis's counters.
                        let mut cached = decider.take_cached_denials();
                        cached.extend(standby_cached);
                        add_denied(&mut usage, &cached);
                        let view = decider.view();
                        let denied = denied_at_class_share(&view, &usage, r.promotion_top_k());
                        let usage = by_class(&view, usage);
                        drop(view);
                        match r.report_usage(&usage, denied, interval_ms.max(1)).await {
                            Ok(()) => Reported::Delivered,
                            Err(e) => {
                                // They go with the next report instead.
                                decider.restore_cached_denials(cached);
                                tracing::debug!(error = %e, "Usage report not delivered.");
                                Reported::Undelivered
                            }
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "Usage collection failed.");
                        Reported::Uncollected
                    }
                },
            )
        };
        if let Some(reported) = report.await {
            metrics.usage_report(reported);
        }
    }
}

/// How often a single region drains its activity index: the index then holds at most the
/// buckets checked in this long, and a drain costs a Redis Cluster 16 384 small calls, which
/// must not come every report interval.
pub const DRAIN_INTERVAL: Duration = Duration::from_secs(10);

/// A single region reports usage to no one, but its store still lists every bucket checked in
/// the activity index; draining it every [`DRAIN_INTERVAL`] (or report interval, if longer)
/// keeps one-shot subjects (identities) from leaving an entry behind once their buckets expire.
/// Never while the breaker is open: a failing store (a Cluster master failing over) gets no
/// extra load from it, and a drain that fails waits twice as long before the next, up to 8×.
pub async fn run_drain(
    decider: Arc<Decider>,
    report_interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let every = report_interval.max(DRAIN_INTERVAL);
    let mut wait = every;
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            () = tokio::time::sleep(wait) => {}
        }
        if decider.store_degraded() {
            continue;
        }
        wait = match decider.store().collect_usage(MAX_USAGE_RECORDS).await {
            Ok(_) => {
                // Reported to no one either: kept, they would only fill their maps.
                drop(decider.take_cached_denials());
                drop(decider.take_forwarded_usage());
                every
            }
            Err(e) => {
                tracing::debug!(error = %e, "Usage collection failed.");
                (wait * 2).min(every * 8)
            }
        };
    }
}

/// Brings the store in line with `view`: writes the parameters of every bucket that changed,
/// renews those due, and rewrites everything once the store was replaced. True if every write
/// succeeded; with the writes that succeeded and that failed.
///
/// While the lease holds, each write carries the time left on it, its end on the store's clock
/// (the store keeps the earlier end, however late the write runs) and the floor: the store drops
/// to the floor at the lease end by itself, so if this daemon dies, its Redis (which gateways
/// may call directly) stops holding share the coordinator gives elsewhere. A bucket's stored
/// end is renewed once half of it has passed, so it trails the lease by at most about half a
/// lease and never runs out while the daemon lives; that costs `buckets / (lease / 2)` writes
/// a second, spread out, instead of every bucket every report interval.
///
/// `fence` is the agent role's fence when the region runs several daemons: every write carries
/// it with the view's epoch, and the store refuses the writes of a deposed agent and of an
/// older allocation landing late ([`quota_store::Fence`]).
pub async fn apply_shares(
    decider: &Decider,
    view: &ClusterView,
    written: &mut Written,
    pacing: Pacing,
    fence: Option<u64>,
) -> (bool, WriteOutcomes) {
    let store = decider.store();
    match store.instance().await {
        Ok(id) => written.observe_instance(id),
        Err(e) => tracing::debug!(error = %e, "Store instance unknown."),
    }
    written.retain_in(view);
    let planned_at = clock::monotonic_ms();
    let mut writes = written.plan(view, decider.region(), planned_at, pacing);
    if let Some(token) = fence {
        for w in &mut writes {
            w.req.fence = Some(quota_store::Fence {
                token,
                epoch: view.epoch,
            });
        }
    }
    if writes.iter().any(|w| w.req.lease.is_some()) {
        // Each write carries the lease end mapped onto the store's clock as well as the time
        // left, and the store keeps the earlier: however late a write runs, what it stores
        // ends no later than the region's lease.
        match lease_end_on_store(store, view.lease_end_local_ms).await {
            Ok(not_after) => {
                for lease in writes.iter_mut().filter_map(|w| w.req.lease.as_mut()) {
                    lease.not_after_ms = Some(not_after);
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "Reading the store's clock failed.");
                written.planned(view, planned_at, false);
                return (false, WriteOutcomes::default());
            }
        }
    }
    let results = until_first_failure(writes, |w: Write| async move {
        let r = store.set_params(&w.req).await;
        // Whether or not it succeeded, the store may now hold the new parameters.
        if w.changes {
            decider.forget_denials();
        }
        match &r {
            // Fault: this daemon was deposed (a standby took the role while it was paused or
            // cut off), or this write's epoch is older than one already stored. The store
            // changed nothing.
            Err(StoreError::Fenced { reason }) => {
                tracing::warn!(tenant = %w.req.bucket.tenant, policy = %w.req.bucket.policy, %reason, "A share write was fenced off.");
            }
            Err(e) => {
                tracing::debug!(tenant = %w.req.bucket.tenant, policy = %w.req.bucket.policy, error = %e, "Applying a share failed.");
            }
            Ok(()) => {}
        }
        (w, r)
    })
    .await;
    let mut all = true;
    let mut outcomes = WriteOutcomes::default();
    for (w, outcome) in results {
        match outcome {
            Some(r) => {
                let ok = r.is_ok();
                all &= ok;
                if ok {
                    outcomes.ok += 1;
                    outcomes.changed += u64::from(w.changes);
                } else {
                    outcomes.failed += 1;
                }
                if matches!(r, Err(StoreError::Fenced { .. })) {
                    outcomes.fenced += 1;
                }
                written.record(w, ok);
            }
            None => all = false,
        }
    }
    written.planned(view, planned_at, all);
    if all && written.sweep_due(view, clock::monotonic_ms()) {
        // With the view applied: leftovers of what was deleted while this daemon was down (a
        // restarted Redis is empty, and the sweep then finds nothing).
        match store.list_params().await {
            Ok(held) => written.sweep(view, held, clock::monotonic_ms()),
            Err(e) => {
                tracing::warn!(error = %e, retry_in_ms = SWEEP_RETRY_MS, "Sweeping stored parameters failed.");
                written.sweep_failed(clock::monotonic_ms());
            }
        }
    }
    if all {
        clear_obsolete(decider, written).await;
    }
    (all, outcomes)
}

/// Clears the buckets of deleted policies and old versions from the store, so neither their
/// parameters nor their state stay behind; those it could not clear wait for the next pass.
async fn clear_obsolete(decider: &Decider, written: &mut Written) {
    let store = decider.store();
    let buckets = std::mem::take(&mut written.to_clear);
    let results = until_first_failure(buckets, |b: BucketRef| async move {
        let r = store.clear_params(&b).await;
        if let Err(e) = &r {
            tracing::debug!(tenant = %b.tenant, policy = %b.policy, error = %e, "Clearing an old bucket failed.");
        }
        (b, r)
    })
    .await;
    for (b, outcome) in results {
        if !matches!(outcome, Some(Ok(()))) {
            written.to_clear.push(b);
        }
    }
}

/// Runs `call` on every item, [`WRITE_CONCURRENCY`] at a time, and starts no more calls after
/// the first that finds the store out: a store that is down would otherwise cost a timeout per
/// item. A refusal of one bucket's write (its data or its request at fault) fails that item
/// only. Each item comes back with its call's outcome, or `None` if it never ran.
async fn until_first_failure<T, F, Fut>(
    items: Vec<T>,
    call: F,
) -> Vec<(T, Option<Result<(), StoreError>>)>
where
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = (T, Result<(), StoreError>)>,
{
    let failed = AtomicBool::new(false);
    stream::iter(items)
        .map(|item| {
            let (failed, call) = (&failed, &call);
            async move {
                if failed.load(Ordering::Relaxed) {
                    return (item, None);
                }
                let (item, r) = call(item).await;
                if r.as_ref().is_err_and(StoreError::is_outage) {
                    failed.store(true, Ordering::Relaxed);
                }
                (item, Some(r))
            }
        })
        .buffer_unordered(WRITE_CONCURRENCY)
        .collect()
        .await
}

#[cfg(test)]
mod tests {
    use quota_core::{PolicyName, PolicySpec, TenantId};

    use super::*;
    use crate::api::tests::state_on;
    use crate::config::BreakerConfig;
    use crate::decision::breaker::Breaker;

    fn policy(limit: f64, burst: f64) -> quota_core::Policy {
        PolicySpec {
            limit,
            window_ms: 3_600_000.0,
            burst: Some(burst),
            ..PolicySpec::default()
        }
        .validate()
        .unwrap()
    }

    /// Issue 22: a changed policy keeps what its bucket had spent. A drained bucket stays
    /// drained across a limit change, and a raised burst gives only the difference.
    #[tokio::test]
    async fn a_changed_policy_keeps_the_level_of_its_bucket() {
        let state = state_on(
            quota_store::AnyStore::embedded(),
            Breaker::new(&BreakerConfig::default(), "eu"),
        );
        let (decider, coordinator) = (&state.decider, &state.coordinator);
        let (t, p) = (
            TenantId::new("acme").unwrap(),
            PolicyName::new("writes").unwrap(),
        );
        let mut written = Written::new(0, 30_000);
        let pacing = Pacing {
            report_interval_ms: 1000,
            lease_ms: 30_000,
        };
        let put = |limit, burst| coordinator.put_policy(t.clone(), p.clone(), policy(limit, burst));
        let check = |cost| decider.check(t.clone(), p.clone(), cost, false);
        put(4.0, 4.0).await.unwrap();
        assert!(
            apply_shares(decider, &coordinator.view(), &mut written, pacing, None)
                .await
                .0
        );
        assert!(check(4).await.unwrap().decision.allowed);
        // New terms, the same burst: still drained.
        assert_eq!(put(5.0, 4.0).await.unwrap().version, 2);
        assert!(
            apply_shares(decider, &coordinator.view(), &mut written, pacing, None)
                .await
                .0
        );
        assert!(
            !check(1).await.unwrap().decision.allowed,
            "refilled by a change"
        );
        // A raised burst, 4 → 10: 6 tokens, no more.
        put(5.0, 10.0).await.unwrap();
        assert!(
            apply_shares(decider, &coordinator.view(), &mut written, pacing, None)
                .await
                .0
        );
        assert!(check(6).await.unwrap().decision.allowed);
        assert!(
            !check(1).await.unwrap().decision.allowed,
            "more than the difference"
        );
    }

    fn record(tenant: &TenantId, policy: &str, version: u64, a: u64, d: u64) -> UsageRecord {
        UsageRecord {
            bucket: BucketRef {
                tenant: tenant.clone(),
                policy: PolicyName::new(policy).unwrap(),
                version,
            },
            admitted: a,
            denied: d,
        }
    }

    /// A view with plan "pro" (`calls` at version 7), subjects a, b, c assigned to it, b
    /// promoted, and an explicit policy `calls` of tenant x at version 3.
    fn plan_view() -> (ClusterView, TenantId) {
        use crate::coordination::view::{Grant, PolicyEntry, PromotedEntry};
        let pro = TenantId::for_plan(&quota_core::PlanName::new("pro").unwrap());
        let entry = |version| PolicyEntry {
            policy: quota_core::Policy {
                version,
                ..policy(100.0, 100.0)
            },
            grants: [(
                quota_core::RegionId::new("eu").unwrap(),
                Grant {
                    share_ppm: 500_000,
                    floor_ppm: 0,
                },
            )]
            .into(),
            home: None,
            mode: quota_core::mode::BudgetMode::Split,
        };
        let calls = PolicyName::new("calls").unwrap();
        let t = |s: &str| TenantId::new(s).unwrap();
        let mut view = ClusterView::default();
        view.policies.insert((pro.clone(), calls.clone()), entry(7));
        view.policies.insert((t("x"), calls.clone()), entry(3));
        for s in ["a", "b", "c"] {
            view.plan_assignments
                .insert(t(s), quota_core::PlanName::new("pro").unwrap());
        }
        view.promoted.insert(
            (t("b"), calls),
            PromotedEntry {
                class: pro.clone(),
                entry: entry(7),
            },
        );
        (view, pro)
    }

    #[test]
    fn by_class_sums_subjects_into_their_class_and_keeps_the_rest() {
        let (view, pro) = plan_view();
        let t = |s: &str| TenantId::new(s).unwrap();
        let usage = vec![
            record(&t("a"), "calls", 7, 5, 1),
            record(&t("c"), "calls", 7, 2, 3),
            // Superseded version: kept as it is, the leader ignores it.
            record(&t("a"), "calls", 6, 4, 0),
            // Promoted: its own demand.
            record(&t("b"), "calls", 7, 9, 9),
            // Explicit policy.
            record(&t("x"), "calls", 3, 1, 1),
        ];
        let mut out = by_class(&view, usage);
        out.sort_by(|a, b| {
            (&a.bucket.tenant, a.bucket.version).cmp(&(&b.bucket.tenant, b.bucket.version))
        });
        let got: Vec<_> = out
            .iter()
            .map(|u| {
                (
                    u.bucket.tenant.clone(),
                    u.bucket.version,
                    u.admitted,
                    u.denied,
                )
            })
            .collect();
        let mut want = vec![
            (pro, 7, 7, 4),
            (t("a"), 6, 4, 0),
            (t("b"), 7, 9, 9),
            (t("x"), 3, 1, 1),
        ];
        want.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        assert_eq!(got, want);
    }

    #[test]
    fn denied_subjects_of_classes_are_reported_heaviest_first() {
        let (view, _) = plan_view();
        let t = |s: &str| TenantId::new(s).unwrap();
        let usage = vec![
            record(&t("a"), "calls", 7, 5, 1),
            record(&t("c"), "calls", 7, 2, 30),
            record(&t("b"), "calls", 7, 9, 99),
            record(&t("x"), "calls", 3, 1, 50),
            record(&t("a"), "calls", 6, 4, 70),
        ];
        let calls = PolicyName::new("calls").unwrap();
        // Only subjects at their class's share: not promoted b, explicit x or version 6.
        assert_eq!(
            denied_at_class_share(&view, &usage, 64),
            vec![
                (t("c"), calls.clone(), 2, 30),
                (t("a"), calls.clone(), 5, 1)
            ]
        );
        // One counter: c takes a's over, counting 31 with an error of 1, so 30 certain.
        assert_eq!(
            denied_at_class_share(&view, &usage, 1),
            vec![(t("c"), calls, 2, 30)]
        );
    }

    #[test]
    fn cached_denials_join_their_buckets_in_demand_and_heavy_subjects() {
        let (view, pro) = plan_view();
        let t = |s: &str| TenantId::new(s).unwrap();
        let calls = PolicyName::new("calls").unwrap();
        // What Redis counted: c, flooded, saw one probe a retry interval denied.
        let mut usage = vec![
            record(&t("a"), "calls", 7, 5, 1),
            record(&t("c"), "calls", 7, 2, 1),
        ];
        // What the daemon answered from its cache: c's flood, and x, never seen by Redis in
        // this interval.
        let cached = vec![
            record(&t("c"), "calls", 7, 0, 40),
            record(&t("x"), "calls", 3, 0, 6),
        ];
        add_denied(&mut usage, &cached);
        let mut got: Vec<_> = usage
            .iter()
            .map(|u| (u.bucket.tenant.clone(), u.admitted, u.denied))
            .collect();
        got.sort();
        assert_eq!(
            got,
            [(t("a"), 5, 1), (t("c"), 2, 41), (t("x"), 0, 6)],
            "one record a bucket, denials added once"
        );
        // The flooded subject leads the promotion candidates...
        assert_eq!(
            denied_at_class_share(&view, &usage, 1),
            vec![(t("c"), calls.clone(), 2, 41)]
        );
        // ...and its class reports the flood as demand.
        let class = by_class(&view, usage)
            .into_iter()
            .find(|u| u.bucket.tenant == pro)
            .unwrap();
        assert_eq!((class.admitted, class.denied), (7, 42));
    }
}
