//! Promotion: a subject of a plan's class that is denied at the class's share gets a share
//! vector of its own, and goes back to the class's once its demand fits it again.
//!
//! A class's one share vector follows the class's aggregate demand, so a subject whose demand
//! is all in region r gets only `share_r` of its limit there. Each region's usage report names
//! the subjects denied at their class share in the interval (a space-saving top-K,
//! [`crate::heavy`]); the leader ([`PromotionTracker`]) gives each one certainly denied an
//! entry of its own ([`Promoted`]), moved with the tenant machinery: its own demand estimate,
//! target and revoke-before-grant steps, undamped. The subject keeps deciding in the same
//! bucket (the class's version), now at its own share.
//!
//! # Why every subject stays within its limit
//! - A promotion (epoch E) starts the entry at the class's granted shares `g_r` and counts for
//!   each region the class's enforceable share `E_r ≥ g_r` as a revocation of E
//!   ([`CoordinatorState::promoted_start`]): a region that has not applied E enforces at most
//!   `E_r`, one that has at most the entry's enforceable share, so `Σ_r ≤ Σ_r E_r ≤ PPM` at
//!   once, and the entry's own revoke-before-grant keeps it (`apply` checks every change).
//! - An eviction is accepted only once the entry's enforceable share is at most the class's
//!   granted share in every region, so a region enforces at most the class's enforceable share
//!   whether it has applied the eviction or not.
//! - A change of the class's terms carries over to its promoted entries (same shares, new
//!   version); a deleted class drops them with it, its subjects resolving elsewhere.
//!
//! # Bounds
//! The state holds at most [`MAX_PROMOTED`] entries; the leader keeps to
//! [`PromotionConfig::max_promoted`] (1 000 by default, per cluster).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::allocator::{step_revoking_first, AllocatorConfig, Round, Slots};
use crate::bucket::UT;
// A change is part of the replicated command vocabulary, defined with the other operations'
// payloads; it is built here, by the tracker.
pub use crate::coordinator::PromotedChange;
use crate::coordinator::{
    acked_of, add_revocation, prune, CoordinatorState, Entry, PolicyKey, Response,
};
use crate::demand::{DemandTracker, Usage};
use crate::ids::TenantId;
use crate::lease::Revocation;
use crate::mode::BudgetMode;
use crate::policy::{Policy, PPM};
use crate::split::{target_into, MAX_REGIONS};

/// The most promoted entries the state holds, whatever a leader proposes.
pub const MAX_PROMOTED: usize = 10_000;

/// A subject of a class with a share vector of its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Promoted {
    /// The reserved subject of the plan whose class this is ([`TenantId::for_plan`]).
    pub class: TenantId,
    /// The subject's shares and revocations; its policy is the class's, version included, so
    /// the subject keeps its bucket.
    pub entry: Entry,
}

impl CoordinatorState {
    /// Whether `key`'s promoted entry is what its checks decide under: the subject has no
    /// explicit policy of that name and still resolves to the entry's class.
    pub fn promotion_applies(&self, key: &PolicyKey, p: &Promoted) -> bool {
        let explicit = self.entries.get(key).is_some_and(|e| !e.deleted);
        !explicit
            && self
                .class_of(&key.tenant, &key.policy)
                .is_some_and(|c| c.tenant == p.class)
    }

    /// A promoted entry as a promotion at `epoch` starts it: the class's granted shares, with
    /// the class's enforceable share of each region counted as a revocation of `epoch`.
    pub fn promoted_start(&self, class: &Entry, epoch: u64, now: u64) -> Entry {
        let slots = self.regions.len();
        let mut entry = Entry {
            policy: class.policy.clone(),
            pin: None,
            shares_ppm: (0..slots).map(|r| class.share(r)).collect(),
            revocations: Vec::new(),
            deleted: false,
        };
        for r in 0..slots {
            let Some(region) = self.region(r) else {
                continue;
            };
            let enforceable = self.enforceable(class, r, now);
            if enforceable > entry.share(r) {
                entry.revocations.push(Revocation {
                    region: r as u8,
                    share_ppm: enforceable,
                    floor_ppm: self.floor_of(&class.policy, r).min(enforceable),
                    epoch,
                    deadline_ms: region
                        .lease_expires_at_ms
                        .saturating_add(self.lease.drift_margin_ms),
                });
            }
        }
        entry
    }

    pub(crate) fn set_promoted(
        &mut self,
        membership: u64,
        changes: &[PromotedChange],
        now: u64,
    ) -> Response {
        if membership != self.membership {
            return Response::StaleMembership {
                planned: membership,
                current: self.membership,
            };
        }
        let epoch = self.epoch + 1;
        let (mut accepted, mut rejected) = (0u32, 0u32);
        for change in changes {
            let ok = match change {
                PromotedChange::Promote {
                    key,
                    class,
                    shares_ppm,
                } => self.promote(key, class, shares_ppm, epoch, now),
                PromotedChange::Shares { key, shares_ppm } => {
                    self.move_promoted(key, shares_ppm, epoch, now)
                }
                PromotedChange::Evict { key } => self.evict(key, now),
            };
            if ok {
                accepted += 1;
            } else {
                rejected += 1;
            }
        }
        if accepted > 0 {
            self.epoch = epoch;
        }
        Response::PromotedSet {
            epoch: self.epoch,
            accepted,
            rejected,
        }
    }

    fn promote(
        &mut self,
        key: &PolicyKey,
        class: &TenantId,
        shares_ppm: &[u32],
        epoch: u64,
        now: u64,
    ) -> bool {
        if key.tenant.reserved().is_some()
            || self.promoted.contains_key(key)
            || self.promoted.len() >= MAX_PROMOTED
            || self.entries.get(key).is_some_and(|e| !e.deleted)
        {
            return false;
        }
        let class_key = PolicyKey::new(class.clone(), key.policy.clone());
        if self.class_of(&key.tenant, &key.policy).as_ref() != Some(&class_key) {
            return false;
        }
        let Some(class_entry) = self.entries.get(&class_key) else {
            return false;
        };
        // A budget too small to split lives whole at home: exact already.
        if self.budget_mode(&class_entry.policy) == BudgetMode::Home {
            return false;
        }
        let mut entry = self.promoted_start(class_entry, epoch, now);
        if shares_ppm.len() == self.regions.len() {
            if let Ok(revocations) = self.check_shares(&entry, shares_ppm, epoch, now) {
                self.set_entry_shares(&mut entry, revocations, shares_ppm, now);
            }
        }
        self.promoted.insert(
            key.clone(),
            Promoted {
                class: class.clone(),
                entry,
            },
        );
        true
    }

    fn move_promoted(&mut self, key: &PolicyKey, shares_ppm: &[u32], epoch: u64, now: u64) -> bool {
        let Some(p) = self.promoted.get(key) else {
            return false;
        };
        if shares_ppm.len() != self.regions.len() {
            return false;
        }
        let Ok(revocations) = self.check_shares(&p.entry, shares_ppm, epoch, now) else {
            return false;
        };
        let mut entry = p.entry.clone();
        self.set_entry_shares(&mut entry, revocations, shares_ppm, now);
        if let Some(p) = self.promoted.get_mut(key) {
            p.entry = entry;
        }
        true
    }

    fn set_entry_shares(
        &self,
        entry: &mut Entry,
        revocations: Vec<Revocation>,
        shares_ppm: &[u32],
        now: u64,
    ) {
        for rev in revocations {
            add_revocation(entry, rev, acked_of(&self.regions, rev.region.into()), now);
        }
        entry.shares_ppm = shares_ppm.to_vec();
        prune(entry, &self.regions, now);
    }

    fn evict(&mut self, key: &PolicyKey, now: u64) -> bool {
        let Some(p) = self.promoted.get(key) else {
            return false;
        };
        let class_key = PolicyKey::new(p.class.clone(), key.policy.clone());
        let done = match self.entries.get(&class_key).filter(|e| !e.deleted) {
            Some(class) if self.promotion_applies(key, p) => (0..self.regions.len())
                .all(|r| self.enforceable(&p.entry, r, now) <= class.share(r)),
            // The subject decides under something else now: the entry is no one's.
            _ => true,
        };
        if done {
            self.promoted.remove(key);
        }
        done
    }

    /// Carries a class's new terms to its promoted entries (their shares stay).
    pub(crate) fn sync_promoted_policy(&mut self, class_key: &PolicyKey, policy: &Policy) {
        if class_key.tenant.plan().is_none() {
            return;
        }
        for (k, p) in &mut self.promoted {
            if p.class == class_key.tenant && k.policy == class_key.policy {
                p.entry.policy = policy.clone();
            }
        }
    }

    /// Drops the promoted entries of a deleted class.
    pub(crate) fn drop_promoted_of(&mut self, class_key: &PolicyKey) {
        if class_key.tenant.plan().is_none() {
            return;
        }
        self.promoted
            .retain(|k, p| !(p.class == class_key.tenant && k.policy == class_key.policy));
    }
}

/// The leader's promotion tuning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromotionConfig {
    /// Counters in each region's top-K of subjects denied at their class's share, per report;
    /// the leader reads at most this many subjects of one report.
    pub top_k: usize,
    /// Denials a subject must certainly have had in one report to be promoted.
    pub min_denied: u64,
    /// A promoted subject whose demand stays below `evict_below_ppm` of its class's share in
    /// every region for this long moves back to the class's shares and is then evicted.
    pub idle_ms: u64,
    pub evict_below_ppm: u32,
    /// The most promoted entries in the cluster (at most [`MAX_PROMOTED`]): heavy subjects
    /// are a count, not a fraction of the subjects, which the coordinator does not know.
    pub max_promoted: usize,
    /// The most a promoted share moves in one round (undamped: [`PPM`]).
    pub max_step_ppm: u32,
}

impl Default for PromotionConfig {
    fn default() -> Self {
        Self {
            top_k: 64,
            min_denied: 1,
            idle_ms: 60_000,
            evict_below_ppm: 250_000,
            max_promoted: 1_000,
            max_step_ppm: PPM,
        }
    }
}

/// A subject reported denied at its class's share since the last round.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Candidate {
    denied: u64,
    /// Demand (admitted + denied) per region slot, in micro-tokens per second.
    rates: Vec<u64>,
}

/// Most candidates held between two rounds, however many reports arrive.
const MAX_CANDIDATES: usize = 4_096;

/// The leader's soft state for promotion: candidates from reports, and how long each promoted
/// subject has been calm. A new leader relearns it; the state stays safe meanwhile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromotionTracker {
    config: PromotionConfig,
    candidates: BTreeMap<PolicyKey, Candidate>,
    calm_since_ms: BTreeMap<PolicyKey, u64>,
    evicting: BTreeSet<PolicyKey>,
}

impl PromotionTracker {
    /// A tracker with no candidates and no calm subjects yet.
    pub fn new(config: PromotionConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// The tuning it was made with.
    pub fn config(&self) -> &PromotionConfig {
        &self.config
    }

    /// Folds in one region's denied subjects for an interval: `(subject, policy)` with the
    /// subject's admitted tokens and the denials it certainly had. Only the first
    /// [`PromotionConfig::top_k`] are read.
    pub fn record(&mut self, region: u8, interval_ms: u64, denied: &[(PolicyKey, Usage)]) {
        let r = usize::from(region);
        if r >= MAX_REGIONS || interval_ms == 0 {
            return;
        }
        for (key, u) in denied.iter().take(self.config.top_k) {
            if u.denied < self.config.min_denied.max(1) {
                continue;
            }
            if !self.candidates.contains_key(key) && self.candidates.len() >= MAX_CANDIDATES {
                continue;
            }
            let c = self.candidates.entry(key.clone()).or_default();
            c.denied = c.denied.saturating_add(u.denied);
            if c.rates.len() <= r {
                c.rates.resize(r + 1, 0);
            }
            let tokens = u128::from(u.admitted) + u128::from(u.denied);
            c.rates[r] = (tokens * u128::from(UT) * 1000 / u128::from(interval_ms))
                .min(u128::from(u64::MAX)) as u64;
        }
    }

    /// How many candidates wait for the next round.
    pub fn candidates(&self) -> usize {
        self.candidates.len()
    }

    /// One round: moves promoted entries towards their own demand (or back to their class's
    /// shares once calm), evicts those back at the class's shares, and promotes the most
    /// denied candidates while there is room. Promoted subjects' demand estimates live in
    /// `demand` (under the subject's key); a promotion seeds its estimate.
    pub fn plan(
        &mut self,
        state: &CoordinatorState,
        demand: &mut DemandTracker,
        alloc: &AllocatorConfig,
        now_ms: u64,
    ) -> Vec<PromotedChange> {
        let now = now_ms.max(state.last_now_ms);
        let slots = Slots::of(state, now);
        let n = slots.n;
        let cfg = self.config;
        let round = Round {
            state,
            slots: &slots,
            max_step_ppm: cfg.max_step_ppm.max(1),
            now,
        };
        let mut changes = Vec::new();
        self.calm_since_ms
            .retain(|k, _| state.promoted.contains_key(k));
        self.evicting.retain(|k| state.promoted.contains_key(k));
        for (key, p) in &state.promoted {
            let class_key = PolicyKey::new(p.class.clone(), key.policy.clone());
            let class = match state.entries.get(&class_key) {
                Some(c) if !c.deleted && state.promotion_applies(key, p) => c,
                _ => {
                    changes.push(PromotedChange::Evict { key: key.clone() });
                    continue;
                }
            };
            let demand_ppm = demand_ppm_of(demand.get(key).unwrap_or(&[]), &p.entry.policy, &slots);
            let class_shares: Vec<u32> = (0..n).map(|r| class.share(r)).collect();
            let calm = (0..n).all(|r| {
                u128::from(demand_ppm[r]) * u128::from(PPM)
                    <= u128::from(class_shares[r]) * u128::from(cfg.evict_below_ppm)
            });
            if calm {
                let since = *self.calm_since_ms.entry(key.clone()).or_insert(now);
                if now >= since.saturating_add(cfg.idle_ms) {
                    self.evicting.insert(key.clone());
                }
            } else {
                self.calm_since_ms.remove(key);
                self.evicting.remove(key);
            }
            let evicting = self.evicting.contains(key);
            if evicting && (0..n).all(|r| state.enforceable(&p.entry, r, now) <= class_shares[r]) {
                changes.push(PromotedChange::Evict { key: key.clone() });
                continue;
            }
            let floors: Vec<u32> = (0..n)
                .map(|r| state.guaranteed_floor(&p.entry.policy, r))
                .collect();
            let target = if evicting {
                class_shares
            } else {
                let mut t = vec![0; n];
                target_into(&floors, &demand_ppm, &slots.eligible[..n], &mut t);
                t
            };
            let current: Vec<u32> = (0..n).map(|r| p.entry.share(r)).collect();
            let new = step_revoking_first(&round, &p.entry, &current, &target, &floors);
            let distance: u64 = (0..n)
                .map(|r| u64::from(current[r].abs_diff(target[r])))
                .sum();
            let threshold = alloc
                .change_threshold_ppm
                .min(p.entry.policy.min_share_ppm())
                .max(1);
            if new[..n] != current[..] && (evicting || distance >= u64::from(threshold)) {
                changes.push(PromotedChange::Shares {
                    key: key.clone(),
                    shares_ppm: new[..n].to_vec(),
                });
            }
        }
        let mut candidates: Vec<(PolicyKey, Candidate)> =
            std::mem::take(&mut self.candidates).into_iter().collect();
        candidates.sort_by(|a, b| {
            Reverse(a.1.denied)
                .cmp(&Reverse(b.1.denied))
                .then(a.0.cmp(&b.0))
        });
        let mut room = cfg
            .max_promoted
            .min(MAX_PROMOTED)
            .saturating_sub(state.promoted.len());
        for (key, candidate) in candidates {
            if room == 0 {
                break;
            }
            if state.promoted.contains_key(&key)
                || state.entries.get(&key).is_some_and(|e| !e.deleted)
            {
                continue;
            }
            let Some(class_key) = state.class_of(&key.tenant, &key.policy) else {
                continue;
            };
            let Some(class) = state.entries.get(&class_key) else {
                continue;
            };
            if state.budget_mode(&class.policy) == BudgetMode::Home {
                continue;
            }
            let start = state.promoted_start(class, state.epoch + 1, now);
            let mut rates = candidate.rates;
            rates.resize(n, 0);
            let demand_ppm = demand_ppm_of(&rates, &class.policy, &slots);
            demand.set(key.clone(), rates);
            let floors: Vec<u32> = (0..n)
                .map(|r| state.guaranteed_floor(&class.policy, r))
                .collect();
            let mut target = vec![0; n];
            target_into(&floors, &demand_ppm, &slots.eligible[..n], &mut target);
            let current: Vec<u32> = (0..n).map(|r| start.share(r)).collect();
            let new = step_revoking_first(&round, &start, &current, &target, &floors);
            changes.push(PromotedChange::Promote {
                key,
                class: class_key.tenant,
                shares_ppm: new[..n].to_vec(),
            });
            room -= 1;
        }
        changes
    }
}

/// Demand per slot as a fraction of the policy's rate, in ppm; a lapsed region's is 0.
fn demand_ppm_of(rates: &[u64], policy: &Policy, slots: &Slots) -> Vec<u64> {
    let rate = policy.rate_ut_per_s().max(1);
    (0..slots.n)
        .map(|r| {
            if slots.lapsed[r] {
                return 0;
            }
            let d = rates.get(r).copied().unwrap_or(0);
            (u128::from(d) * u128::from(PPM) / u128::from(rate)).min(u128::from(u64::MAX / 4))
                as u64
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::{Command, Operation, RequestId};
    use crate::ids::{PlanName, PolicyName, RegionId};
    use crate::policy::PolicySpec;

    const REGIONS: [&str; 3] = ["eu", "us", "ap"];

    /// A cluster of three regions with plan "pro" (100 a minute, burst 100) and subjects
    /// s0..s9 assigned to it; time is the caller's.
    struct Cluster {
        s: CoordinatorState,
        next: u128,
        now: u64,
        tracker: PromotionTracker,
        demand: DemandTracker,
    }

    fn policy(limit: f64) -> Policy {
        PolicySpec {
            limit,
            window_ms: 60_000.0,
            ..Default::default()
        }
        .validate()
        .unwrap()
    }

    fn subject(i: usize) -> PolicyKey {
        PolicyKey::new(
            TenantId::new(format!("s{i}")).unwrap(),
            PolicyName::new("calls").unwrap(),
        )
    }

    fn pro() -> TenantId {
        TenantId::for_plan(&PlanName::new("pro").unwrap())
    }

    impl Cluster {
        fn new(config: PromotionConfig) -> Self {
            let mut c = Self {
                s: CoordinatorState::default(),
                next: 1,
                now: 1_000,
                tracker: PromotionTracker::new(config),
                demand: DemandTracker::new(PPM),
            };
            for r in REGIONS {
                c.apply(Operation::PutRegion {
                    region: RegionId::new(r).unwrap(),
                    reserves_floor: true,
                    draining: false,
                });
            }
            c.put_plan(100.0);
            for i in 0..10 {
                let r = c.apply(Operation::AssignPlan {
                    tenant: subject(i).tenant,
                    plan: PlanName::new("pro").unwrap(),
                });
                assert_eq!(r, Response::PlanAssigned);
            }
            c.renew_all();
            c
        }

        fn apply(&mut self, op: Operation) -> Response {
            self.next += 1;
            let r = self.s.apply(&Command {
                request: RequestId(self.next),
                now_ms: self.now,
                op,
            });
            self.s.check_invariant().unwrap();
            r
        }

        fn put_plan(&mut self, limit: f64) -> Response {
            self.apply(Operation::PutPlan {
                plan: PlanName::new("pro").unwrap(),
                policies: vec![(PolicyName::new("calls").unwrap(), policy(limit))],
            })
        }

        /// Every region renews and acknowledges the current epoch.
        fn renew_all(&mut self) {
            let epoch = self.s.epoch;
            for r in REGIONS {
                self.apply(Operation::RenewLease {
                    region: RegionId::new(r).unwrap(),
                    acked_epoch: epoch,
                });
            }
        }

        /// One leader round after `ms`: plans and applies the promoted changes.
        fn round(&mut self, ms: u64) -> Vec<PromotedChange> {
            self.now += ms;
            let changes = self.tracker.plan(
                &self.s,
                &mut self.demand,
                &AllocatorConfig::default(),
                self.now,
            );
            if !changes.is_empty() {
                let r = self.apply(Operation::SetPromoted {
                    membership: self.s.membership,
                    changes: changes.clone(),
                });
                let Response::PromotedSet { rejected, .. } = r else {
                    panic!("{r:?}")
                };
                assert_eq!(rejected, 0, "{changes:?}");
            }
            changes
        }

        fn shares(&self, i: usize) -> Vec<u32> {
            self.s.promoted[&subject(i)].entry.shares_ppm.clone()
        }

        fn class_shares(&self) -> Vec<u32> {
            self.s.entries[&PolicyKey::new(pro(), subject(0).policy)]
                .shares_ppm
                .clone()
        }

        /// Subject `i` reported by region `r` with `per_s` demand a second, half denied.
        fn denied(&mut self, r: u8, i: usize, per_s: u64) {
            let u = Usage {
                admitted: per_s / 2,
                denied: per_s - per_s / 2,
            };
            self.tracker.record(r, 1_000, &[(subject(i), u)]);
        }
    }

    #[test]
    fn a_denied_subject_starts_at_its_class_shares_then_takes_its_demand() {
        let mut c = Cluster::new(PromotionConfig::default());
        let class = c.class_shares();
        // 5 a second in region 2: three times the policy's rate.
        c.denied(2, 0, 5);
        let changes = c.round(1_000);
        assert!(
            matches!(&changes[..], [PromotedChange::Promote { .. }]),
            "{changes:?}"
        );
        // Every region enforces the class's share until it acknowledges: nothing granted yet
        // above it, the other regions already cut.
        let first = c.shares(0);
        assert_eq!(first[2], class[2], "{first:?} from {class:?}");
        assert!(first[0] < class[0] && first[1] < class[1], "{first:?}");
        assert_eq!(c.s.promoted[&subject(0)].entry.policy.version, 1);
        // Once the regions applied it, region 2 gets all but the others' floors.
        c.renew_all();
        c.demand.set(subject(0), vec![0, 0, 5 * UT]);
        c.round(1_000);
        let floors: u32 = (0..2)
            .map(|r| {
                c.s.guaranteed_floor(&c.s.promoted[&subject(0)].entry.policy, r)
            })
            .sum();
        assert_eq!(c.shares(0)[2], PPM - floors, "{:?}", c.shares(0));
        assert_eq!(c.s.promoted.len(), 1);
        // Region 2 enforces more than its class share: not evicted yet, whoever asks.
        let r = c.apply(Operation::SetPromoted {
            membership: c.s.membership,
            changes: vec![PromotedChange::Evict { key: subject(0) }],
        });
        assert!(
            matches!(r, Response::PromotedSet { accepted: 0, .. }),
            "{r:?}"
        );
        assert_eq!(c.s.promoted.len(), 1);
    }

    #[test]
    fn a_promotion_counts_what_unapplied_regions_may_still_enforce() {
        let mut c = Cluster::new(PromotionConfig::default());
        // The class moves share from region 0 to region 2; region 0 has not acknowledged.
        let class = c.class_shares();
        let key = PolicyKey::new(pro(), subject(0).policy);
        let moved = vec![class[0] - 200_000, class[1], class[2]];
        c.apply(Operation::SetShares {
            membership: c.s.membership,
            entries: vec![crate::coordinator::ShareEntry {
                key: key.clone(),
                shares_ppm: moved.clone(),
                home: crate::coordinator::HomeChange::Keep,
            }],
        });
        c.denied(1, 0, 5);
        c.round(1_000);
        let p = &c.s.promoted[&subject(0)];
        // Region 0 may still enforce the class's old share: counted against the subject.
        assert_eq!(c.s.enforceable(&p.entry, 0, c.now), class[0]);
        assert!(c.s.enforceable_total(&p.entry, c.now) <= u64::from(PPM));
        // A leader asking for more than the room promotes at the class's shares only.
        let r = c.apply(Operation::SetPromoted {
            membership: c.s.membership,
            changes: vec![PromotedChange::Promote {
                key: subject(1),
                class: pro(),
                shares_ppm: vec![0, PPM, 0],
            }],
        });
        assert!(
            matches!(r, Response::PromotedSet { accepted: 1, .. }),
            "{r:?}"
        );
        assert_eq!(c.shares(1), moved);
    }

    #[test]
    fn a_calm_subject_goes_back_to_its_class_and_is_then_evicted() {
        let mut c = Cluster::new(PromotionConfig::default());
        c.denied(2, 0, 5);
        c.round(1_000);
        c.renew_all();
        c.demand.set(subject(0), vec![0, 0, 5 * UT]);
        c.round(1_000);
        assert!(c.shares(0)[2] > 900_000);
        // Demand far below a quarter of the class's share everywhere: the entry follows it
        // (its target spreads the spare budget evenly) and is evicted after 60 s of calm.
        c.demand.set(subject(0), vec![0, 0, UT / 100]);
        let mut evicted_at = None;
        for second in 1..=90 {
            c.renew_all();
            let changes = c.round(1_000);
            if changes
                .iter()
                .any(|ch| matches!(ch, PromotedChange::Evict { .. }))
            {
                evicted_at = Some(second);
                break;
            }
        }
        let at = evicted_at.expect("evicted within 90 s");
        assert!((60..=63).contains(&at), "evicted after {at} s of calm");
        assert!(c.s.promoted.is_empty());
    }

    #[test]
    fn demand_again_cancels_an_eviction() {
        let mut c = Cluster::new(PromotionConfig::default());
        c.denied(2, 0, 5);
        c.round(1_000);
        c.renew_all();
        c.demand.set(subject(0), vec![0, 0, UT / 100]);
        c.round(59_000);
        c.demand.set(subject(0), vec![0, 0, 5 * UT]);
        for _ in 0..10 {
            c.renew_all();
            c.round(1_000);
        }
        assert!(c.shares(0)[2] > 900_000, "{:?}", c.shares(0));
    }

    #[test]
    fn promotions_stop_at_the_cap_most_denied_first() {
        let mut c = Cluster::new(PromotionConfig {
            max_promoted: 2,
            ..PromotionConfig::default()
        });
        for i in 0..5 {
            c.denied(2, i, 2 + i as u64);
        }
        c.round(1_000);
        let promoted: Vec<_> = c.s.promoted.keys().cloned().collect();
        assert_eq!(promoted, vec![subject(3), subject(4)]);
        c.denied(2, 0, 50);
        c.round(1_000);
        assert_eq!(c.s.promoted.len(), 2);
    }

    #[test]
    fn a_class_change_carries_over_and_its_deletion_drops_the_entries() {
        let mut c = Cluster::new(PromotionConfig::default());
        c.denied(2, 0, 5);
        c.round(1_000);
        let before = c.shares(0);
        let Response::PlanStored { versions, .. } = c.put_plan(200.0) else {
            panic!()
        };
        let p = &c.s.promoted[&subject(0)];
        assert_eq!(p.entry.policy.version, versions[0]);
        assert_eq!(p.entry.policy.limit, 200);
        assert_eq!(p.entry.shares_ppm, before);
        c.apply(Operation::DeletePlan {
            plan: PlanName::new("pro").unwrap(),
        });
        assert!(c.s.promoted.is_empty());
    }

    #[test]
    fn a_subject_that_no_longer_decides_under_its_class_is_evicted_at_once() {
        let mut c = Cluster::new(PromotionConfig::default());
        c.denied(2, 0, 5);
        c.round(1_000);
        c.apply(Operation::UnassignPlan {
            tenant: subject(0).tenant,
        });
        let changes = c.round(1_000);
        assert_eq!(changes, vec![PromotedChange::Evict { key: subject(0) }]);
        assert!(c.s.promoted.is_empty());
        // Nor is a subject without the class promoted.
        c.denied(2, 0, 5);
        assert!(c.round(1_000).is_empty());
    }

    #[test]
    fn bad_promotions_change_nothing() {
        let mut c = Cluster::new(PromotionConfig::default());
        let before = c.s.promoted.clone();
        let stale = c.s.membership + 1;
        let r = c.apply(Operation::SetPromoted {
            membership: stale,
            changes: vec![],
        });
        assert!(matches!(r, Response::StaleMembership { .. }));
        let bad = [
            PromotedChange::Promote {
                key: PolicyKey::new(pro(), subject(0).policy),
                class: pro(),
                shares_ppm: vec![0; 3],
            },
            PromotedChange::Promote {
                key: subject(42),
                class: pro(),
                shares_ppm: vec![0; 3],
            },
            PromotedChange::Shares {
                key: subject(0),
                shares_ppm: vec![PPM; 3],
            },
            PromotedChange::Evict { key: subject(0) },
        ];
        let r = c.apply(Operation::SetPromoted {
            membership: c.s.membership,
            changes: bad.to_vec(),
        });
        assert!(
            matches!(
                r,
                Response::PromotedSet {
                    accepted: 0,
                    rejected: 4,
                    ..
                }
            ),
            "{r:?}"
        );
        assert_eq!(c.s.promoted, before);
    }

    /// The share region `r` enforces for subject `i` in state `s`: its promoted share if its
    /// checks decide under the entry, else its class's share.
    fn effective(s: &CoordinatorState, i: usize, r: usize) -> u32 {
        let key = subject(i);
        match s.promoted.get(&key) {
            Some(p) if s.promotion_applies(&key, p) => p.entry.share(r),
            _ => s
                .class_of(&key.tenant, &key.policy)
                .and_then(|c| s.entries.get(&c))
                .map_or(0, |e| e.share(r)),
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]
        /// Whatever the leader proposes and in whatever order regions acknowledge, no subject
        /// is enforced more than its budget: each region may enforce what any state since
        /// the epoch it acknowledged gave the subject (leases never run out here), and those
        /// sum to at most the whole.
        #[test]
        fn a_subject_is_never_enforced_more_than_its_budget(
            ops in proptest::collection::vec((0u8..6, 0usize..3, 0u32..=100, 0u32..=100, 0u32..=100), 1..40)
        ) {
            let mut c = Cluster::new(PromotionConfig::default());
            let mut history = vec![c.s.clone()];
            for (kind, r, x, y, z) in ops {
                let shares = vec![x * 10_000, y * 10_000, z * 10_000];
                let i = r % 2;
                match kind {
                    0 => {
                        c.apply(Operation::SetShares {
                            membership: c.s.membership,
                            entries: vec![crate::coordinator::ShareEntry {
                                key: PolicyKey::new(pro(), subject(0).policy),
                                shares_ppm: shares,
                                home: crate::coordinator::HomeChange::Keep,
                            }],
                        });
                    }
                    1 => {
                        let region = c.s.region(r).unwrap();
                        let acked = region.acked_epoch
                            + u64::from(x) * (c.s.epoch - region.acked_epoch) / 100;
                        c.apply(Operation::RenewLease {
                            region: RegionId::new(REGIONS[r]).unwrap(),
                            acked_epoch: acked,
                        });
                    }
                    2 => {
                        c.denied(r as u8, i, u64::from(x) / 10 + 1);
                        c.demand.set(subject(i), shares.iter().map(|&v| u64::from(v) * 20).collect());
                        c.now += 100;
                        let changes = c.tracker.plan(&c.s, &mut c.demand, &AllocatorConfig::default(), c.now);
                        c.apply(Operation::SetPromoted { membership: c.s.membership, changes });
                    }
                    3 => {
                        c.apply(Operation::SetPromoted {
                            membership: c.s.membership,
                            changes: vec![PromotedChange::Shares { key: subject(i), shares_ppm: shares }],
                        });
                    }
                    4 => {
                        c.apply(Operation::SetPromoted {
                            membership: c.s.membership,
                            changes: vec![PromotedChange::Evict { key: subject(i) }],
                        });
                    }
                    _ => {
                        c.apply(Operation::SetPromoted {
                            membership: c.s.membership,
                            changes: vec![PromotedChange::Promote { key: subject(i), class: pro(), shares_ppm: shares }],
                        });
                    }
                }
                c.now += 10;
                history.push(c.s.clone());
                for i in 0..2 {
                    let total: u64 = (0..3)
                        .map(|r| {
                            let acked = c.s.region(r).unwrap().acked_epoch;
                            history
                                .iter()
                                .filter(|h| h.epoch >= acked)
                                .map(|h| u64::from(effective(h, i, r)))
                                .max()
                                .unwrap_or(0)
                        })
                        .sum();
                    proptest::prop_assert!(total <= u64::from(PPM), "subject {} enforced {} ppm", i, total);
                }
            }
        }
    }
}
