//! What the store was last told for each bucket, and the writes a pass makes from it: pure
//! bookkeeping with no I/O, so every rule about what to write, renew, sweep and acknowledge is
//! tested here.

use std::collections::{BTreeSet, HashMap};

use imbl::ordmap::DiffItem;

use quota_core::share::limit_for_share;
use quota_core::{PolicyName, RegionId, TenantId};
use quota_store::{BucketRef, Limit, SetParams};

use crate::coordination::view::{ClusterView, PolicyEntry, PolicyMap};

type Key = (TenantId, PolicyName);

/// Without a lease nothing a bucket holds runs out, but a store emptied without a restart (a
/// `FLUSHALL`, say) is still refilled: every bucket is rewritten at least this often.
const REFRESH_WITHOUT_LEASE_MS: u64 = 10 * 60 * 1000;

/// How often the store is swept for parameters nothing holds any more, besides once per
/// store instance: a `SCAN` of the whole keyspace, so rarely.
const SWEEP_EVERY_MS: u64 = 60 * 60 * 1000;

/// How soon a sweep that failed is tried again.
pub(super) const SWEEP_RETRY_MS: u64 = 60 * 1000;

/// Fewest lease renewals one pass may make, so small deployments renew all at once.
const MIN_RENEWALS_PER_PASS: usize = 1024;

/// How the agent paces lease renewals.
#[derive(Debug, Clone, Copy)]
pub struct Pacing {
    pub report_interval_ms: u64,
    pub lease_ms: u64,
}

impl Pacing {
    /// Renewals one pass may make for `buckets` buckets: enough to renew them all within a
    /// quarter of a lease, however they bunch up.
    fn renewal_budget(&self, buckets: usize) -> usize {
        let quarter = (self.lease_ms / 4).max(1);
        let per_pass = (buckets as u128 * u128::from(self.report_interval_ms.max(1))
            / u128::from(quarter)) as usize;
        per_pass.saturating_add(1).max(MIN_RENEWALS_PER_PASS)
    }
}

/// What the store was last told for one bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Held {
    version: u64,
    limit: Limit,
    /// The floor from the lease end on; `None` without a lease.
    floor: Option<Limit>,
    /// The share the store may hold, until when (local monotonic ms, see
    /// [`crate::clock::monotonic_ms`]; `u64::MAX` = no end): the lease end the write carried,
    /// which the store never outlasts however late the write runs (it also gets that end on
    /// its own clock, [`quota_store::LeaseEnd::not_after_ms`]). After a failed write: the
    /// larger of what it held and what was sent.
    share: u32,
    pub(super) until_ms: u64,
    /// When to rewrite it unchanged, to renew the lease end it carries.
    renew_at_ms: u64,
    /// The store instance (see [`Written::generation`]) it was written to.
    generation: u64,
    /// A write for it succeeded in this run: what an earlier run wrote is overwritten.
    confirmed: bool,
    /// The last write failed: the store holds this or what it held before.
    dirty: bool,
}

/// One parameter write a pass makes.
#[derive(Debug, Clone)]
pub(super) struct Write {
    pub(super) req: SetParams,
    pub(super) held: Held,
    /// The write changes what the store enforces (not only a renewal of its lease): denials
    /// remembered under the old parameters no longer stand.
    pub(super) changes: bool,
}

impl Write {
    /// The bucket's key in [`Written`], taken from the request.
    fn into_key(self) -> ((TenantId, PolicyName), Held) {
        let b = self.req.bucket;
        ((b.tenant, b.policy), self.held)
    }
}

/// What the store was last told for each bucket, so a pass writes only what changed, what is
/// due for renewal, and everything after the store was replaced (a restarted Redis is empty).
#[derive(Debug, Default)]
pub struct Written {
    held: HashMap<Key, Held>,
    /// `(renew_at_ms, key)` of every held bucket: the renewals due are a range, not a walk.
    renewals: BTreeSet<(u64, Key)>,
    /// Held buckets whose last write failed.
    dirty: BTreeSet<Key>,
    /// What the last complete pass accounted for (see [`Written::planned`]): a pass compares
    /// the view with it and plans only the entries that changed, failed or are due.
    planned: Option<Planned>,
    /// Until when shares written by an earlier run of this daemon may hold in the store.
    unknown_until_ms: u64,
    /// The store instance last seen ([`quota_store::Store::instance`]).
    instance: Option<String>,
    /// Bumped when the instance changes: buckets written to an older one are rewritten.
    generation: u64,
    /// Buckets the view no longer has (deleted policies, old versions), still to be cleared
    /// from the store.
    pub(super) to_clear: Vec<BucketRef>,
    /// Policies whose terms changed: the version held before, until the new version's first
    /// write succeeds (it carries what the old bucket had spent, [`SetParams::replacing`]).
    replaced: HashMap<Key, u64>,
    /// The generation whose store was last swept for buckets this daemon never saw go, and
    /// when (local monotonic ms).
    swept: Option<(u64, u64)>,
    /// How long after its lease first holds the view is surely caught up with the log.
    sweep_settle_ms: u64,
    /// When the first sweep may run: set once the lease first holds.
    sweep_from_ms: Option<u64>,
}

/// The view a complete pass planned from, and what its per-bucket answers depended on.
#[derive(Debug, Clone)]
struct Planned {
    policies: PolicyMap,
    leased: bool,
    lease_ends: bool,
    generation: u64,
}

/// Whether the lease holds at `now_ms`, and whether it ends at all.
fn lease_state(view: &ClusterView, now_ms: u64) -> (bool, bool) {
    (
        view.lease_end_local_ms > now_ms,
        view.lease_end_local_ms != u64::MAX,
    )
}

impl Written {
    /// Before anything is written, the store may hold shares from a previous run of this
    /// daemon for up to one lease.
    pub fn new(now_ms: u64, lease_ms: u64) -> Self {
        Self {
            unknown_until_ms: now_ms.saturating_add(lease_ms),
            ..Self::default()
        }
    }

    fn put_held(&mut self, key: Key, h: Held) {
        if let Some(old) = self.held.get(&key) {
            self.renewals.remove(&(old.renew_at_ms, key.clone()));
        }
        self.renewals.insert((h.renew_at_ms, key.clone()));
        if h.dirty {
            self.dirty.insert(key.clone());
        } else {
            self.dirty.remove(&key);
        }
        self.held.insert(key, h);
    }

    /// Notes that a pass planned from `view` at `now_ms` has recorded every write it made
    /// (`complete`), so the next pass need only look at what changed since; after an
    /// incomplete one (a write failed or was not tried) the next pass looks at everything.
    pub(super) fn planned(&mut self, view: &ClusterView, now_ms: u64, complete: bool) {
        self.planned = complete.then(|| {
            let (leased, lease_ends) = lease_state(view, now_ms);
            Planned {
                policies: view.policies.clone(),
                leased,
                lease_ends,
                generation: self.generation,
            }
        });
    }

    /// The entries a pass at `now_ms` must look at: all of them, or, after a complete pass
    /// under the same lease state and store instance, those that changed since, failed, or
    /// are due for renewal (O(changed · log n) with the view's shared structure).
    fn candidates<'a>(
        &self,
        view: &'a ClusterView,
        now_ms: u64,
    ) -> Option<Vec<(&'a Key, &'a PolicyEntry)>> {
        let p = self.planned.as_ref()?;
        if (p.leased, p.lease_ends) != lease_state(view, now_ms) || p.generation != self.generation
        {
            return None;
        }
        let mut keys: BTreeSet<&Key> = BTreeSet::new();
        for d in p.policies.diff(&view.policies) {
            match d {
                DiffItem::Add(k, _) | DiffItem::Update { new: (k, _), .. } => {
                    keys.insert(k);
                }
                DiffItem::Remove(..) => {}
            }
        }
        let due = self
            .renewals
            .iter()
            .take_while(|(at, _)| *at <= now_ms)
            .map(|(_, k)| k);
        let mut out: Vec<_> = keys
            .into_iter()
            .chain(self.dirty.iter())
            .chain(due)
            .filter_map(|k| view.policies.get_key_value(k))
            .collect();
        out.sort_unstable_by(|a, b| a.0.cmp(b.0));
        out.dedup_by(|a, b| a.0 == b.0);
        Some(out)
    }

    /// Notes the store instance; a new one (not the first seen) means everything is rewritten.
    pub(super) fn observe_instance(&mut self, id: String) {
        if self.instance.as_ref() != Some(&id) {
            if self.instance.is_some() {
                self.generation += 1;
            }
            self.instance = Some(id);
        }
    }

    /// Forgets buckets `view` no longer has (deleted policies, old versions) and queues them
    /// to be cleared from the store.
    pub fn retain_in(&mut self, view: &ClusterView) {
        self.replaced.retain(|k, _| view.policies.contains_key(k));
        // After a complete pass the held buckets are exactly that pass's view: only what left
        // the view since, or changed version, can be gone.
        let gone: Vec<Key> = match &self.planned {
            Some(p) => p
                .policies
                .diff(&view.policies)
                .filter_map(|d| match d {
                    DiffItem::Remove(k, _) => Some(k.clone()),
                    DiffItem::Update {
                        old: (k, o),
                        new: (_, n),
                    } if o.policy.version != n.policy.version => Some(k.clone()),
                    _ => None,
                })
                .collect(),
            None => self.held.keys().cloned().collect(),
        };
        for k in gone {
            let now_at = view.policies.get(&k).map(|e| e.policy.version);
            if self.held.get(&k).is_none_or(|h| now_at == Some(h.version)) {
                continue;
            }
            if let Some(h) = self.held.remove(&k) {
                self.renewals.remove(&(h.renew_at_ms, k.clone()));
                self.dirty.remove(&k);
                if now_at.is_some() {
                    // Written before the old bucket is cleared: clearing waits for every write.
                    self.replaced.entry(k.clone()).or_insert(h.version);
                }
                self.to_clear.push(BucketRef {
                    tenant: k.0,
                    policy: k.1,
                    version: h.version,
                });
            }
        }
    }

    /// Waits `ms` after the lease first holds before the first sweep (a replicated daemon's
    /// view may lag the log at start; a single region's never does).
    pub fn with_sweep_settle(mut self, ms: u64) -> Self {
        self.sweep_settle_ms = ms;
        self
    }

    /// Whether to sweep the store now: only while the lease holds (the view is recent), once
    /// it has settled, then once per store instance and every [`SWEEP_EVERY_MS`].
    pub(super) fn sweep_due(&mut self, view: &ClusterView, now_ms: u64) -> bool {
        if now_ms >= view.lease_end_local_ms {
            return false;
        }
        let from = *self
            .sweep_from_ms
            .get_or_insert(now_ms.saturating_add(self.sweep_settle_ms));
        now_ms >= from
            && self.swept.is_none_or(|(generation, at)| {
                generation != self.generation || now_ms >= at.saturating_add(SWEEP_EVERY_MS)
            })
    }

    /// Puts the next sweep off after one failed (a `SCAN` refused or timed out): not every
    /// pass, since a sweep is a walk over the whole keyspace.
    pub(super) fn sweep_failed(&mut self, now_ms: u64) {
        self.sweep_from_ms = Some(now_ms.saturating_add(SWEEP_RETRY_MS));
    }

    /// Queues for clearing each of `held` (buckets the store holds parameters for) that is
    /// gone for good: at a version `view` has issued but does not hold. That is what a policy
    /// deleted or replaced while this daemon was down left behind. A bucket above the view's
    /// last version belongs to a change the view has not caught up with, and stays.
    pub(super) fn sweep(&mut self, view: &ClusterView, held: Vec<BucketRef>, now_ms: u64) {
        let gone = held.into_iter().filter(|b| {
            b.version <= view.last_version
                && view
                    .policy(&b.tenant, &b.policy)
                    .is_none_or(|e| e.policy.version != b.version)
        });
        self.to_clear.extend(gone);
        self.swept = Some((self.generation, now_ms));
    }

    /// The writes one pass makes at `now_ms`: every bucket whose parameters differ from what
    /// the store was told (or whose write failed, or that was written to an older store
    /// instance), then the renewals that are due, earliest lease end first, up to the budget
    /// (and past it for any lease end within two report intervals).
    pub(super) fn plan(
        &self,
        view: &ClusterView,
        region: &RegionId,
        now_ms: u64,
        pacing: Pacing,
    ) -> Vec<Write> {
        let lease_left = (view.lease_end_local_ms != u64::MAX && view.lease_end_local_ms > now_ms)
            .then(|| view.lease_end_local_ms - now_ms);
        let mut writes = Vec::new();
        let mut due = Vec::new();
        let candidates = self.candidates(view, now_ms);
        let entries: Box<dyn Iterator<Item = (&Key, &PolicyEntry)>> = match &candidates {
            Some(c) => Box::new(c.iter().copied()),
            None => Box::new(view.policies.iter()),
        };
        for (key, entry) in entries {
            let grant = entry.grants.get(region);
            let share = view.enforced_share_ppm(grant, now_ms);
            let limit: Limit = limit_for_share(&entry.policy, share).into();
            let (floor, until_ms, renew_at_ms) = match (lease_left, grant) {
                (Some(left), Some(g)) => (
                    Some(limit_for_share(&entry.policy, g.floor_ppm.min(g.share_ppm)).into()),
                    now_ms + left,
                    now_ms + left / 2,
                ),
                _ => (
                    None,
                    u64::MAX,
                    now_ms.saturating_add(REFRESH_WITHOUT_LEASE_MS),
                ),
            };
            let version = entry.policy.version;
            let old = self.held.get(key).filter(|h| h.version == version);
            let changed = old.is_none_or(|h| {
                h.limit != limit || h.floor != floor || h.dirty || h.generation != self.generation
            });
            if !changed && old.is_some_and(|h| now_ms < h.renew_at_ms) {
                continue;
            }
            let bucket = BucketRef {
                tenant: key.0.clone(),
                policy: key.1.clone(),
                version,
            };
            let mut req = SetParams::new(bucket, limit);
            if let (Some(left), Some(floor)) = (lease_left, floor) {
                req = req.with_lease(left, floor);
            }
            // The coordinator records what a changed policy replaced, so this holds after a
            // restart too; the map covers a version this daemon saw change in memory.
            let replaced = self.replaced.get(key).copied().or(entry.policy.replaces);
            if let Some(v) = replaced.filter(|&v| v != version) {
                req = req.replacing(v);
            }
            let w = Write {
                req,
                held: Held {
                    version,
                    limit,
                    floor,
                    share,
                    until_ms,
                    renew_at_ms,
                    generation: self.generation,
                    confirmed: true,
                    dirty: false,
                },
                changes: changed,
            };
            match old {
                Some(h) if !changed => due.push((h.until_ms, w)),
                _ => writes.push(w),
            }
        }
        due.sort_unstable_by_key(|(until, _)| *until);
        let budget = pacing.renewal_budget(view.policies.len());
        let urgent_before = now_ms.saturating_add(2 * pacing.report_interval_ms);
        writes.extend(
            due.into_iter()
                .enumerate()
                .take_while(|(i, (until, _))| *i < budget || *until <= urgent_before)
                .map(|(_, (_, w))| w),
        );
        writes
    }

    /// Records the outcome of a write. A failed one may or may not have reached the store:
    /// the larger share and later end are kept, and it is rewritten next pass.
    pub(super) fn record(&mut self, w: Write, ok: bool) {
        let (key, sent) = w.into_key();
        if ok {
            self.replaced.remove(&key);
            self.put_held(key, sent);
            return;
        }
        let h = match self.held.get(&key).filter(|h| h.version == sent.version) {
            Some(old) => Held {
                share: old.share.max(sent.share),
                until_ms: old.until_ms.max(sent.until_ms),
                confirmed: old.confirmed,
                dirty: true,
                ..sent
            },
            None => Held {
                confirmed: false,
                dirty: true,
                ..sent
            },
        };
        self.put_held(key, h);
    }

    /// Whether the store cannot enforce more than `view` grants at `now_ms`, though some writes
    /// failed: for every bucket, what it holds is at most the new share or has run out. Then
    /// the epoch may be acknowledged with the store unreachable (`local` fail mode keeps the
    /// granted share in process), and only a share *cut* waits for the old one to end: `slack_ms`
    /// past it on this daemon's clock, for Redis's clock running slower (two drift margins:
    /// found by the model checker, `quota-model`'s mutant `WriteRunOut`).
    pub fn bounded_by(
        &self,
        view: &ClusterView,
        region: &RegionId,
        now_ms: u64,
        slack_ms: u64,
    ) -> bool {
        let over = |until: u64| now_ms >= until.saturating_add(slack_ms);
        let earlier_run_over = over(self.unknown_until_ms);
        view.policies.iter().all(|(key, entry)| {
            let share = view.enforced_share_ppm(entry.grants.get(region), now_ms);
            match self
                .held
                .get(key)
                .filter(|h| h.version == entry.policy.version)
            {
                Some(h) => {
                    (h.share <= share || over(h.until_ms)) && (h.confirmed || earlier_run_over)
                }
                None => earlier_run_over,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use quota_core::{PolicySpec, PPM};

    use super::*;
    use crate::coordination::view::{Grant, PolicyEntry};

    /// Two drift margins of 300 ms.
    const SLACK: u64 = 600;

    const PACING: Pacing = Pacing {
        report_interval_ms: 1_000,
        lease_ms: 30_000,
    };

    fn region() -> RegionId {
        RegionId::new("b").unwrap()
    }

    fn key(i: usize) -> (TenantId, PolicyName) {
        (
            TenantId::new(format!("t{i}")).unwrap(),
            PolicyName::new("w").unwrap(),
        )
    }

    fn entry(version: u64, share_ppm: u32) -> PolicyEntry {
        let mut policy = PolicySpec {
            limit: 100.0,
            window_ms: 1000.0,
            floor: Some(0.1),
            ..Default::default()
        }
        .validate()
        .unwrap();
        policy.version = version;
        let grant = Grant {
            share_ppm,
            floor_ppm: 100_000,
        };
        PolicyEntry {
            policy,
            grants: BTreeMap::from([(region(), grant)]),
            home: None,
            mode: quota_core::mode::BudgetMode::Split,
        }
    }

    /// `n` buckets at version 7 and `share_ppm`, the lease ending at `lease_end`.
    fn view_of(n: usize, share_ppm: u32, lease_end: u64) -> ClusterView {
        ClusterView {
            policies: (0..n).map(|i| (key(i), entry(7, share_ppm))).collect(),
            epoch: 3,
            lease_end_local_ms: lease_end,
            ..ClusterView::default()
        }
    }

    /// One pass whose writes all succeed; returns how many it made.
    fn pass(w: &mut Written, v: &ClusterView, now: u64) -> usize {
        let writes = w.plan(v, &region(), now, PACING);
        let n = writes.len();
        for x in writes {
            w.record(x, true);
        }
        n
    }

    /// A daemon that restarts between a policy change and its new version's first write has
    /// no memory of the change: the replaced version comes from the policy itself, as the
    /// coordinator recorded it, so the new bucket still carries what the old one spent.
    #[test]
    fn a_restarted_daemon_carries_the_replaced_version_from_the_policy() {
        let mut fresh = Written::new(0, 30_000);
        fresh.observe_instance("r1".into());
        let mut changed = entry(8, 300_000);
        changed.policy.replaces = Some(7);
        let v = ClusterView {
            policies: [(key(0), changed), (key(1), entry(9, 300_000))]
                .into_iter()
                .collect(),
            epoch: 3,
            lease_end_local_ms: u64::MAX,
            ..ClusterView::default()
        };
        let writes = fresh.plan(&v, &region(), 1_000, PACING);
        let mut replacing: Vec<_> = writes
            .iter()
            .map(|x| (x.req.bucket.tenant.clone(), x.req.replaces))
            .collect();
        replacing.sort();
        assert_eq!(replacing, vec![(key(0).0, Some(7)), (key(1).0, None)]);
    }

    #[test]
    fn only_changed_buckets_are_rewritten() {
        let mut w = Written::new(0, 30_000);
        w.observe_instance("r1".into());
        let v = view_of(100, 300_000, u64::MAX);
        assert_eq!(
            pass(&mut w, &v, 1_000),
            100,
            "the first pass writes every bucket"
        );
        assert_eq!(
            pass(&mut w, &v, 2_000),
            0,
            "nothing changed, nothing written"
        );
        // One share moves, one policy gets a new version, one is added, one removed.
        let mut v2 = v.clone();
        let p = &mut v2.policies;
        p.insert(key(3), entry(7, 500_000));
        p.insert(key(4), entry(8, 300_000));
        p.insert(key(100), entry(7, 300_000));
        p.remove(&key(5));
        w.retain_in(&v2);
        let mut cleared: Vec<_> = w
            .to_clear
            .iter()
            .map(|b| (b.tenant.as_str(), b.version))
            .collect();
        cleared.sort_unstable();
        assert_eq!(
            cleared,
            vec![("t4", 7), ("t5", 7)],
            "the old version and the deleted policy"
        );
        let writes = w.plan(&v2, &region(), 3_000, PACING);
        let mut keys: Vec<_> = writes
            .iter()
            .map(|x| (x.req.bucket.tenant.clone(), x.req.bucket.policy.clone()))
            .collect();
        keys.sort();
        assert_eq!(keys, vec![key(100), key(3), key(4)]);
        // Only the changed policy's write replaces a version: the one it held.
        let replacing: Vec<_> = writes
            .iter()
            .filter_map(|x| x.req.replaces.map(|v| (x.req.bucket.tenant.clone(), v)))
            .collect();
        assert_eq!(replacing, vec![(key(4).0, 7)]);
        assert_eq!(
            writes
                .iter()
                .find(|x| x.req.bucket.tenant == key(4).0)
                .unwrap()
                .req
                .bucket
                .version,
            8
        );
        for x in writes {
            w.record(x, true);
        }
        assert!(w.replaced.is_empty(), "written: nothing left to replace");
        assert_eq!(pass(&mut w, &v2, 4_000), 0);
        // Without a lease the parameters are still refreshed, rarely.
        assert_eq!(pass(&mut w, &v2, 4_000 + REFRESH_WITHOUT_LEASE_MS), 100);
    }

    #[test]
    fn the_sweep_clears_only_what_is_gone_for_good() {
        // Tenants t0 and t1 hold version 7; the counter has issued up to 9.
        let v = ClusterView {
            last_version: 9,
            ..view_of(2, PPM / 2, u64::MAX)
        };
        let bucket = |i: usize, version: u64| BucketRef {
            tenant: key(i).0,
            policy: key(i).1,
            version,
        };
        let mut w = Written::new(0, 0);
        w.sweep(
            &v,
            vec![
                bucket(0, 7),  // current: kept
                bucket(0, 5),  // an older version of a live policy: cleared
                bucket(1, 9),  // issued, but not what the view holds: cleared
                bucket(2, 3),  // a deleted policy: cleared
                bucket(3, 10), // newer than the view (it lags): kept
            ],
            500,
        );
        let mut cleared: Vec<_> = w
            .to_clear
            .iter()
            .map(|b| (b.tenant.as_str().to_string(), b.version))
            .collect();
        cleared.sort();
        assert_eq!(
            cleared,
            [("t0".into(), 5), ("t1".into(), 9), ("t2".into(), 3)]
        );
        assert_eq!(w.swept, Some((w.generation, 500)));
    }

    #[test]
    fn sweeps_wait_for_a_settled_lease_then_come_once_per_instance_and_hourly() {
        let lease_from = |end: u64| view_of(1, PPM, end);
        let mut w = Written::new(0, 30_000).with_sweep_settle(30_000);
        // No lease (or an expired one): the view may be stale.
        assert!(!w.sweep_due(&lease_from(0), 1_000));
        assert!(!w.sweep_due(&lease_from(1_000), 1_000));
        // The lease holds from 2 000: not before it has held for the settle time.
        let v = lease_from(100_000_000);
        assert!(!w.sweep_due(&v, 2_000));
        assert!(!w.sweep_due(&v, 31_999));
        assert!(w.sweep_due(&v, 32_000));
        w.sweep(&v, Vec::new(), 32_000);
        assert!(!w.sweep_due(&v, 33_000), "once per instance");
        w.observe_instance("a".into());
        w.observe_instance("b".into());
        assert!(w.sweep_due(&v, 34_000), "a new instance is swept");
        w.sweep(&v, Vec::new(), 34_000);
        assert!(!w.sweep_due(&v, 34_000 + SWEEP_EVERY_MS - 1));
        assert!(w.sweep_due(&v, 34_000 + SWEEP_EVERY_MS), "and hourly");
        // A failed sweep is tried again a while later, not every pass.
        let failed_at = 34_000 + SWEEP_EVERY_MS;
        w.sweep_failed(failed_at);
        assert!(!w.sweep_due(&v, failed_at + 1_000));
        assert!(w.sweep_due(&v, failed_at + SWEEP_RETRY_MS));
        // A single region's view never lags: no wait.
        let mut single = Written::new(0, 30_000);
        assert!(single.sweep_due(&lease_from(u64::MAX), 0));
    }

    #[test]
    fn a_new_store_instance_gets_everything_again() {
        let mut w = Written::new(0, 30_000);
        w.observe_instance("r1".into());
        let v = view_of(10, 300_000, u64::MAX);
        pass(&mut w, &v, 1_000);
        w.observe_instance("r1".into());
        assert_eq!(pass(&mut w, &v, 2_000), 0, "the same instance");
        w.observe_instance("r2".into());
        assert_eq!(pass(&mut w, &v, 3_000), 10, "a restarted Redis is empty");
        assert_eq!(pass(&mut w, &v, 4_000), 0);
    }

    #[test]
    fn a_failed_write_is_retried_and_counts_as_the_larger_share() {
        let mut w = Written::new(0, 3_000);
        let v = view_of(1, 300_000, 40_000);
        pass(&mut w, &v, 5_000);
        // Raised to 0.5; the write fails (it may still have landed).
        let up = view_of(1, 500_000, 40_000);
        for x in w.plan(&up, &region(), 6_000, PACING) {
            w.record(x, false);
        }
        // Cut to 0.2: the store may hold 0.5 until the end that write carried (40 s), and
        // two margins more on this daemon's clock.
        let cut = view_of(1, 200_000, 40_000);
        assert!(!w.bounded_by(&cut, &region(), 40_599, SLACK));
        assert!(w.bounded_by(&cut, &region(), 40_600, SLACK));
        assert_eq!(
            pass(&mut w, &cut, 7_000),
            1,
            "the failed bucket is written again"
        );
        assert!(w.bounded_by(&cut, &region(), 7_001, SLACK));
    }

    #[test]
    fn only_a_cut_share_still_held_by_the_store_blocks_the_acknowledgement() {
        let r = region();
        let v = view_of(1, 300_000, 40_000);
        let mut w = Written::new(0, 3_000);
        // Never written in this run: a previous run's share may hold for one lease.
        assert!(!w.bounded_by(&v, &r, 3_599, SLACK));
        assert!(w.bounded_by(&v, &r, 3_600, SLACK));
        // Written at 0.3 at 5 s: the store holds it until the lease end, 40 s.
        pass(&mut w, &v, 5_000);
        assert!(w.bounded_by(&v, &r, 5_000, SLACK));
        // Cut to 0.2: only once the stored 0.3 has ended.
        let cut = view_of(1, 200_000, 40_000);
        assert!(!w.bounded_by(&cut, &r, 40_599, SLACK));
        assert!(w.bounded_by(&cut, &r, 40_600, SLACK));
        // Past this region's own lease the view enforces the floor, 0.1: a cut too.
        assert!(w.bounded_by(&v, &r, 39_999, SLACK));
        assert!(
            w.bounded_by(&v, &r, 40_600, SLACK),
            "the stored share ended with the lease"
        );
        // A bucket whose first write failed: an earlier run's share may still hold.
        let mut fresh = Written::new(0, 45_000);
        for x in fresh.plan(&v, &r, 5_000, PACING) {
            fresh.record(x, false);
        }
        assert!(!fresh.bounded_by(&v, &r, 45_599, SLACK));
        assert!(fresh.bounded_by(&v, &r, 45_600, SLACK));
    }

    /// Many buckets, a lease renewed every report interval, passes every interval for several
    /// leases: no stored lease end ever runs out, renewals stay within the budget and spread
    /// out, and on average each bucket is written once per half lease.
    #[test]
    fn renewals_keep_every_stored_end_ahead_and_spread_out() {
        let n = 20_000;
        let mut w = Written::new(0, PACING.lease_ms);
        w.observe_instance("r1".into());
        let mut v = view_of(n, PPM / 3, PACING.lease_ms);
        let budget = PACING.renewal_budget(n);
        assert!(budget < n, "a budget below one full rewrite: {budget}");
        let mut total = 0;
        let mut most = 0;
        let passes = 200;
        for t in 1..=passes {
            let now = t * PACING.report_interval_ms;
            // The coordinator renews the lease every interval.
            v.lease_end_local_ms = now + PACING.lease_ms;
            for (k, h) in &w.held {
                assert!(h.until_ms > now, "{k:?} ran out at {now}: {h:?}");
            }
            let made = pass(&mut w, &v, now);
            if t > 1 {
                most = most.max(made);
                total += made;
            }
        }
        assert!(most <= budget, "{most} > {budget}");
        // One write per bucket per half lease: n / 15 per pass, give or take the spreading.
        let per_pass = total as f64 / (passes - 1) as f64;
        let ideal = n as f64 / (PACING.lease_ms as f64 / 2.0 / 1000.0);
        assert!(
            (0.8 * ideal..=1.25 * ideal).contains(&per_pass),
            "{per_pass} writes per pass, ideal {ideal}"
        );
    }

    #[test]
    fn small_deployments_renew_everything_in_one_pass() {
        assert_eq!(PACING.renewal_budget(10), MIN_RENEWALS_PER_PASS);
        // A lease of a few intervals: 10 k buckets must all fit in a quarter lease.
        let short = Pacing {
            report_interval_ms: 100,
            lease_ms: 1_000,
        };
        assert!(short.renewal_budget(10_000) >= 10_000 * 100 / 250);
    }

    /// A ledger that plans only what changed since its last complete pass makes exactly the
    /// writes, and clears exactly the buckets, of one that looks at everything every pass:
    /// over seeded random share moves, new versions, added and deleted policies, leases
    /// renewed and lapsing, failed writes and a replaced store.
    #[test]
    fn planning_what_changed_equals_planning_everything() {
        use rand::{Rng as _, SeedableRng as _};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let lease = PACING.lease_ms;
        let (mut delta, mut full) = (Written::new(0, lease), Written::new(0, lease));
        for w in [&mut delta, &mut full] {
            w.observe_instance("r1".into());
        }
        let mut v = view_of(300, PPM / 3, lease);
        let mut next_key = 300;
        let (mut delta_passes, mut writes_seen) = (0, 0);
        for step in 1..=600u64 {
            let now = step * 250;
            let k = key(rng.random_range(0..next_key));
            match rng.random_range(0..10) {
                0 => {
                    if let Some(e) = v.policies.get(&k).cloned() {
                        let share = rng.random_range(0..=PPM);
                        v.policies.insert(k, entry(e.policy.version, share));
                    }
                }
                1 => {
                    if let Some(e) = v.policies.get(&k).cloned() {
                        v.policies.insert(k, entry(e.policy.version + 1, PPM / 3));
                    }
                }
                2 => {
                    v.policies.insert(key(next_key), entry(7, PPM / 4));
                    next_key += 1;
                }
                3 => {
                    v.policies.remove(&k);
                }
                4 if step % 97 == 0 => {
                    let id = format!("r{step}");
                    delta.observe_instance(id.clone());
                    full.observe_instance(id);
                }
                _ => {}
            }
            // Renewed most intervals; now and then it lapses for a while.
            if step % 150 < 120 && rng.random_bool(0.8) {
                v.lease_end_local_ms = now + lease;
            }
            delta.retain_in(&v);
            full.retain_in(&v);
            let sorted = |w: &mut Written| {
                let mut c: Vec<_> = std::mem::take(&mut w.to_clear)
                    .into_iter()
                    .map(|b| format!("{b:?}"))
                    .collect();
                c.sort();
                c
            };
            assert_eq!(sorted(&mut delta), sorted(&mut full), "step {step}");
            delta_passes += usize::from(delta.candidates(&v, now).is_some());
            let a = delta.plan(&v, &region(), now, PACING);
            let b = full.plan(&v, &region(), now, PACING);
            assert_eq!(format!("{a:?}"), format!("{b:?}"), "step {step}");
            writes_seen += a.len();
            let fail_from = if rng.random_bool(0.05) {
                rng.random_range(0..=a.len())
            } else {
                usize::MAX
            };
            let complete = fail_from >= a.len();
            // As a pass records them: the writes after the first failure are not tried.
            for (i, (x, y)) in a
                .into_iter()
                .zip(b)
                .enumerate()
                .take(fail_from.saturating_add(1))
            {
                delta.record(x, i < fail_from);
                full.record(y, i < fail_from);
            }
            delta.planned(&v, now, complete);
        }
        assert!(
            delta_passes > 300,
            "{delta_passes} passes planned from the changes"
        );
        assert!(writes_seen > 1_000, "{writes_seen} writes compared");
    }
}
