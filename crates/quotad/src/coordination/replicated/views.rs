//! Views built from the applied state: only what changed is rebuilt.

use std::collections::BTreeMap;
use std::sync::Arc;

use quota_core::coordinator::{CoordinatorState, Entry, PolicyKey};
use quota_core::{PolicyName, RegionId, TenantId};
use quota_raft::Changes;

use super::{Derived, Replicated};
use crate::coordination::view::{
    ClusterView, Grant, PlanAssignments, PolicyEntry, PolicyMap, PromotedEntry, PromotedMap,
};

impl Replicated {
    /// Rebuilds the view from the applied state and this region's lease; publishes it if it
    /// changed.
    pub fn rebuild_view(&self) {
        let lease_end = {
            let lease = self.lease.lock().unwrap_or_else(|e| e.into_inner());
            lease
                .lease()
                .map_or(0, |l| l.end_local_ms(self.lease_config.drift_margin_ms))
        };
        let view = {
            let mut derived = self.derived.lock().unwrap_or_else(|e| e.into_inner());
            let since = derived.as_ref().map(|d| d.revision);
            self.raft.read_changes(since, |s, revision, changes| {
                view_of(&mut derived, s, revision, &changes, lease_end)
            })
        };
        self.tx.send_if_modified(|old| {
            if **old == view {
                false
            } else {
                *old = Arc::new(view);
                true
            }
        });
    }
}

/// The view of `s` at `revision`, `changes` naming what changed since `derived` was built.
/// Its policies are `derived`'s brought in line with only the policies `changes` names
/// (O(changed · log n); lease renewals change none: O(regions) per view), and walked whole
/// ([`sync_policies`]) only when anything may have changed (a region added or removed, a
/// snapshot installed, a reader too far behind).
fn view_of(
    derived: &mut Option<Derived>,
    s: &CoordinatorState,
    revision: u64,
    changes: &Changes,
    lease_end_local_ms: u64,
) -> ClusterView {
    let d = match derived.take() {
        Some(d) if d.revision == revision => d,
        Some(mut d) => {
            if changes.all {
                sync_policies(&mut d.policies, s);
                d.plan_assignments = assignments_of(s);
            } else {
                for key in &changes.keys {
                    sync_key(&mut d.policies, s, key);
                }
                for tenant in &changes.tenants {
                    sync_tenant(&mut d.policies, s, tenant);
                    sync_assignment(&mut d.plan_assignments, s, tenant);
                }
            }
            if changes.all || !changes.tenants.is_empty() {
                d.tenant_pins = Arc::new(pins_of(s));
            }
            if changes.all || changes.promoted {
                d.promoted = promoted_of(s);
            }
            d.revision = revision;
            d
        }
        None => {
            let mut policies = PolicyMap::new();
            sync_policies(&mut policies, s);
            Derived {
                revision,
                policies,
                tenant_pins: Arc::new(pins_of(s)),
                plan_assignments: assignments_of(s),
                promoted: promoted_of(s),
            }
        }
    };
    let view = ClusterView {
        policies: d.policies.clone(),
        tenant_pins: d.tenant_pins.clone(),
        plan_assignments: d.plan_assignments.clone(),
        promoted: d.promoted.clone(),
        region_leases: region_leases_of(s),
        epoch: s.epoch,
        lease_end_local_ms,
        last_version: s.last_version,
    };
    *derived = Some(d);
    view
}

/// Brings one policy's entry in `map` in line with `s`.
fn sync_key(map: &mut PolicyMap, s: &CoordinatorState, key: &PolicyKey) {
    let k = (key.tenant.clone(), key.policy.clone());
    match s.entries.get(key).filter(|e| !e.deleted) {
        None => {
            map.remove(&k);
        }
        Some(entry) => {
            if !map.get(&k).is_some_and(|old| entry_matches(s, entry, old)) {
                map.insert(k, entry_of(s, entry));
            }
        }
    }
}

/// Brings every policy of `tenant` in `map` in line with `s`: a range of each, not a walk.
fn sync_tenant(map: &mut PolicyMap, s: &CoordinatorState, tenant: &TenantId) {
    let mut keys: Vec<PolicyKey> = crate::coordination::view::tenant_keys(map, tenant)
        .into_iter()
        .map(|(t, p)| PolicyKey::new(t, p))
        .collect();
    // "-" is the least valid name: '-' sorts before every other allowed character.
    if let Ok(first) = PolicyName::new("-") {
        keys.extend(
            s.entries
                .range(PolicyKey::new(tenant.clone(), first)..)
                .take_while(|(k, _)| &k.tenant == tenant)
                .map(|(k, _)| k.clone()),
        );
    }
    for key in keys {
        sync_key(map, s, &key);
    }
}

/// The view's entry for a live policy: its grant in every region, and its home.
fn entry_of(s: &CoordinatorState, entry: &Entry) -> PolicyEntry {
    let mut grants = BTreeMap::new();
    for (i, slot) in s.regions.iter().enumerate() {
        if let Some(r) = slot {
            grants.insert(r.id.clone(), grant_of(s, entry, i));
        }
    }
    let home = entry
        .pin
        .and_then(|p| s.region(usize::from(p.home)))
        .map(|r| r.id.clone());
    PolicyEntry {
        policy: entry.policy.clone(),
        grants,
        home,
        mode: s.budget_mode(&entry.policy),
    }
}

fn grant_of(s: &CoordinatorState, entry: &Entry, slot: usize) -> Grant {
    let share_ppm = entry.share(slot);
    Grant {
        share_ppm,
        floor_ppm: s.floor_of(&entry.policy, slot).min(share_ppm),
    }
}

/// Whether `old` is what [`entry_of`] would build now, without building it.
fn entry_matches(s: &CoordinatorState, entry: &Entry, old: &PolicyEntry) -> bool {
    let home = entry
        .pin
        .and_then(|p| s.region(usize::from(p.home)))
        .map(|r| &r.id);
    if old.policy != entry.policy
        || old.home.as_ref() != home
        || old.mode != s.budget_mode(&entry.policy)
    {
        return false;
    }
    let mut regions = 0;
    for (i, slot) in s.regions.iter().enumerate() {
        if let Some(r) = slot {
            regions += 1;
            if old.grants.get(&r.id) != Some(&grant_of(s, entry, i)) {
                return false;
            }
        }
    }
    regions == old.grants.len()
}

/// Brings `map` in line with the live policies of `s`: one walk over both in key order, which
/// allocates nothing for an unchanged entry; changed, new and gone entries are then updated in
/// place, each O(log n).
fn sync_policies(map: &mut PolicyMap, s: &CoordinatorState) {
    use std::cmp::Ordering;
    let order = |k: &(TenantId, PolicyName), key: &PolicyKey| {
        k.0.cmp(&key.tenant).then_with(|| k.1.cmp(&key.policy))
    };
    let mut upserts = Vec::new();
    let mut removals = Vec::new();
    let mut old = map.iter().peekable();
    for (key, entry) in s.entries.iter().filter(|(_, e)| !e.deleted) {
        loop {
            match old.peek() {
                Some((k, v)) => match order(k, key) {
                    Ordering::Less => {
                        removals.push((*k).clone());
                        old.next();
                    }
                    Ordering::Equal => {
                        if !entry_matches(s, entry, v) {
                            upserts.push((key, entry));
                        }
                        old.next();
                        break;
                    }
                    Ordering::Greater => {
                        upserts.push((key, entry));
                        break;
                    }
                },
                None => {
                    upserts.push((key, entry));
                    break;
                }
            }
        }
    }
    removals.extend(old.map(|(k, _)| k.clone()));
    for k in removals {
        map.remove(&k);
    }
    for (key, entry) in upserts {
        map.insert((key.tenant.clone(), key.policy.clone()), entry_of(s, entry));
    }
}

/// Every promoted subject, at its class's policy and its own grants (a small set, rebuilt
/// whole when it may have changed).
fn promoted_of(s: &CoordinatorState) -> PromotedMap {
    s.promoted
        .iter()
        .map(|(k, p)| {
            let entry = PolicyEntry {
                home: None,
                ..entry_of(s, &p.entry)
            };
            let promoted = PromotedEntry {
                class: p.class.clone(),
                entry,
            };
            ((k.tenant.clone(), k.policy.clone()), promoted)
        })
        .collect()
}

/// Every plan assignment (a whole rebuild only).
fn assignments_of(s: &CoordinatorState) -> PlanAssignments {
    s.plan_assignments
        .iter()
        .map(|(t, p)| (t.clone(), p.clone()))
        .collect()
}

/// Brings one tenant's plan assignment in line with `s`.
fn sync_assignment(map: &mut PlanAssignments, s: &CoordinatorState, tenant: &TenantId) {
    match s.plan_assignments.get(tenant) {
        Some(plan) if map.get(tenant) != Some(plan) => {
            map.insert(tenant.clone(), plan.clone());
        }
        Some(_) => {}
        None => {
            map.remove(tenant);
        }
    }
}

/// Pinned tenants and their home region.
fn pins_of(s: &CoordinatorState) -> BTreeMap<TenantId, RegionId> {
    s.tenant_pins
        .iter()
        .filter_map(|(t, &home)| {
            s.region(usize::from(home))
                .map(|r| (t.clone(), r.id.clone()))
        })
        .collect()
}

/// Every region's lease end (coordinator time), for display.
fn region_leases_of(s: &CoordinatorState) -> BTreeMap<RegionId, u64> {
    s.regions
        .iter()
        .flatten()
        .map(|r| (r.id.clone(), r.lease_expires_at_ms))
        .collect()
}

#[cfg(test)]
mod tests {
    use quota_core::coordinator::{
        Command, HomeChange, Operation, PolicyKey, RequestId, Response, ShareEntry,
    };
    use quota_core::{PolicySpec, PPM};
    use rand::{Rng as _, SeedableRng as _};

    use super::*;

    /// Applies `op`, noting in `changed` what it may change (as the state machine's journal
    /// does).
    fn apply(
        s: &mut CoordinatorState,
        changed: &mut Changes,
        id: u128,
        now_ms: u64,
        op: Operation,
    ) -> Response {
        changed.merge(Changes::of(&op));
        s.apply(&Command {
            request: RequestId(id),
            now_ms,
            op,
        })
    }

    fn key(tenant: &str, policy: &str) -> PolicyKey {
        PolicyKey::new(
            TenantId::new(tenant).unwrap(),
            PolicyName::new(policy).unwrap(),
        )
    }

    fn put_policy(s: &mut CoordinatorState, c: &mut Changes, id: u128, tenant: &str) {
        let policy = PolicySpec {
            limit: 100.0,
            window_ms: 1000.0,
            ..Default::default()
        }
        .validate()
        .unwrap();
        let r = apply(
            s,
            c,
            id,
            1_000,
            Operation::PutPolicy {
                key: key(tenant, "w"),
                policy,
            },
        );
        assert!(matches!(r, Response::PolicyStored { .. }), "{r:?}");
    }

    fn put_region(s: &mut CoordinatorState, c: &mut Changes, id: u128, name: &str) {
        let op = Operation::PutRegion {
            region: RegionId::new(name).unwrap(),
            reserves_floor: true,
            draining: false,
        };
        apply(s, c, id, 1_000, op);
    }

    /// The reference: every live policy built from scratch.
    fn full(s: &CoordinatorState) -> PolicyMap {
        s.entries
            .iter()
            .filter(|(_, e)| !e.deleted)
            .map(|(k, e)| ((k.tenant.clone(), k.policy.clone()), entry_of(s, e)))
            .collect()
    }

    #[test]
    fn renewals_reuse_the_policies_and_other_changes_update_them() {
        let mut s = CoordinatorState::default();
        let mut c = Changes::default();
        put_region(&mut s, &mut c, 1, "eu");
        put_region(&mut s, &mut c, 2, "us");
        for i in 0..3 {
            put_policy(&mut s, &mut c, 10 + i, &format!("t{i}"));
        }
        let mut derived = None;
        let v1 = view_of(&mut derived, &s, 7, &std::mem::take(&mut c), 100);
        assert_eq!(v1.policies, full(&s));
        assert_eq!(v1.policies.len(), 3);

        let eu = RegionId::new("eu").unwrap();
        let renew = Operation::RenewLease {
            region: eu.clone(),
            acked_epoch: s.epoch,
        };
        apply(&mut s, &mut c, 20, 5_000, renew);
        let v2 = view_of(&mut derived, &s, 7, &std::mem::take(&mut c), 200);
        assert!(v1.policies.ptr_eq(&v2.policies), "kept across a renewal");
        assert!(Arc::ptr_eq(&v1.tenant_pins, &v2.tenant_pins));
        assert_eq!(v2.lease_end_local_ms, 200);
        assert!(v2.region_leases[&eu] > v1.region_leases[&eu], "{v2:?}");
        assert_eq!(v2.policies, full(&s), "and still what a full build gives");

        put_policy(&mut s, &mut c, 30, "t9");
        let v3 = view_of(&mut derived, &s, 8, &std::mem::take(&mut c), 200);
        assert_eq!(v3.policies.len(), 4);
        assert_eq!(v3.policies, full(&s));
        // The version counter comes with the view, for the agent's sweep.
        assert_eq!((v1.last_version, v3.last_version), (3, 4));
        assert_eq!(v2.policies.len(), 3, "an earlier view is not changed");
    }

    #[test]
    fn plan_changes_and_assignments_reach_the_view_by_what_they_touch() {
        use quota_core::PlanName;
        let mut s = CoordinatorState::default();
        let mut c = Changes::default();
        put_region(&mut s, &mut c, 1, "eu");
        put_region(&mut s, &mut c, 2, "us");
        let mut derived = None;
        view_of(&mut derived, &s, 1, &std::mem::take(&mut c), 0);
        let plan = PlanName::new("pro").unwrap();
        let policy = |limit: f64| {
            PolicySpec {
                limit,
                window_ms: 1000.0,
                ..Default::default()
            }
            .validate()
            .unwrap()
        };
        let put = |limit| Operation::PutPlan {
            plan: plan.clone(),
            policies: vec![(PolicyName::new("calls").unwrap(), policy(limit))],
        };
        apply(&mut s, &mut c, 10, 1_000, put(10.0));
        for i in 0..50u128 {
            let op = Operation::AssignPlan {
                tenant: TenantId::new(format!("t{i}")).unwrap(),
                plan: plan.clone(),
            };
            assert_eq!(
                apply(&mut s, &mut c, 100 + i, 1_000, op),
                Response::PlanAssigned
            );
        }
        assert!(!c.all, "plan commands never ask for a whole rebuild");
        let v = view_of(&mut derived, &s, 2, &std::mem::take(&mut c), 0);
        assert_eq!(v.plan_assignments.len(), 50);
        assert_eq!(v.policies, full(&s));
        let t7 = TenantId::new("t7").unwrap();
        let calls = PolicyName::new("calls").unwrap();
        assert_eq!(v.resolve(&t7, &calls).unwrap().entry.policy.limit, 10);
        // One command changes the plan for every tenant on it.
        apply(&mut s, &mut c, 11, 2_000, put(20.0));
        apply(
            &mut s,
            &mut c,
            12,
            2_000,
            Operation::UnassignPlan { tenant: t7.clone() },
        );
        let v = view_of(&mut derived, &s, 3, &std::mem::take(&mut c), 0);
        assert_eq!(v.policies, full(&s));
        let t8 = TenantId::new("t8").unwrap();
        assert_eq!(v.resolve(&t8, &calls).unwrap().entry.policy.limit, 20);
        assert!(v.resolve(&t7, &calls).is_none(), "no plan and no default");
        assert_eq!(v.plan_assignments.len(), 49);
        assert_eq!(v.plans_after(None), vec![plan.clone()]);
        // A batch assigns and unassigns many tenants in one command, named one by one.
        let batch = Operation::AssignPlans {
            assignments: (0..60)
                .map(|i| {
                    let tenant = TenantId::new(format!("t{i}")).unwrap();
                    (tenant, (i % 2 == 0).then(|| plan.clone()))
                })
                .collect(),
        };
        assert_eq!(
            apply(&mut s, &mut c, 13, 3_000, batch),
            Response::PlansAssigned
        );
        assert!(
            !c.all,
            "a batch of assignments never asks for a whole rebuild"
        );
        let v = view_of(&mut derived, &s, 4, &std::mem::take(&mut c), 0);
        assert_eq!(v.plan_assignments.len(), 30);
        assert_eq!(v.plan_assignments, assignments_of(&s));
        assert!(v.resolve(&t7, &calls).is_none());
        assert_eq!(v.resolve(&t8, &calls).unwrap().entry.policy.limit, 20);
    }

    #[test]
    fn a_removed_region_leaves_every_entry() {
        let mut s = CoordinatorState::default();
        let mut c = Changes::default();
        for (i, r) in ["eu", "us", "ap"].iter().enumerate() {
            put_region(&mut s, &mut c, i as u128, r);
        }
        for i in 0..4 {
            put_policy(&mut s, &mut c, 10 + i, &format!("t{i}"));
        }
        let mut derived = None;
        let v1 = view_of(&mut derived, &s, 1, &std::mem::take(&mut c), 0);
        assert!(v1.policies.values().all(|e| e.grants.len() == 3));
        // Drain ap: no floor, its shares cut to nothing, then removed.
        let ap = RegionId::new("ap").unwrap();
        let drain = Operation::PutRegion {
            region: ap.clone(),
            reserves_floor: false,
            draining: true,
        };
        apply(&mut s, &mut c, 20, 2_000, drain);
        let entries = s
            .entries
            .iter()
            .map(|(k, e)| ShareEntry {
                key: k.clone(),
                shares_ppm: vec![e.share(0), e.share(1), 0],
                home: HomeChange::Keep,
            })
            .collect();
        let membership = s.membership;
        let r = apply(
            &mut s,
            &mut c,
            21,
            3_000,
            Operation::SetShares {
                membership,
                entries,
            },
        );
        assert!(
            matches!(r, Response::SharesSet { accepted: 4, .. }),
            "{r:?}"
        );
        let r = apply(
            &mut s,
            &mut c,
            22,
            4_000,
            Operation::RemoveRegion { region: ap },
        );
        assert!(matches!(r, Response::RegionRemoved { .. }), "{r:?}");
        let v2 = view_of(&mut derived, &s, 2, &std::mem::take(&mut c), 0);
        assert!(v2.policies.values().all(|e| e.grants.len() == 2), "{v2:?}");
        assert_eq!(v2.policies, full(&s));
    }

    /// Seeded random commands of every kind that changes the view; after every few, the view
    /// brought in line entry by entry equals a full rebuild.
    #[test]
    fn entry_by_entry_updates_equal_a_full_rebuild() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut s = CoordinatorState::default();
        let mut c = Changes::default();
        put_region(&mut s, &mut c, 1, "eu");
        put_region(&mut s, &mut c, 2, "us");
        let mut derived = None;
        let regions = ["eu", "us", "ap"];
        let mut id = 100u128;
        let mut now = 1_000u64;
        let mut shares_moved = 0;
        for round in 0..400u64 {
            id += 1;
            now += 10;
            let tenant = format!("t{}", rng.random_range(0..30));
            let policy = ["a", "b", "c"][rng.random_range(0..3)];
            let op = match rng.random_range(0..9) {
                0 | 1 => Operation::PutPolicy {
                    key: key(&tenant, policy),
                    policy: PolicySpec {
                        limit: f64::from(rng.random_range(1..1000u32)),
                        window_ms: 1000.0,
                        floor: Some(0.05),
                        ..Default::default()
                    }
                    .validate()
                    .unwrap(),
                },
                2 => Operation::DeletePolicy {
                    key: key(&tenant, policy),
                },
                3 => Operation::PinTenant {
                    tenant: TenantId::new(&tenant).unwrap(),
                    home: RegionId::new(regions[rng.random_range(0..2)]).unwrap(),
                },
                4 => Operation::UnpinTenant {
                    tenant: TenantId::new(&tenant).unwrap(),
                },
                5 | 6 => {
                    // A small cut of one region's share of every live policy.
                    let slots = s.regions.len();
                    let entries = s
                        .entries
                        .iter()
                        .filter(|(_, e)| !e.deleted)
                        .map(|(k, e)| {
                            let mut shares: Vec<u32> = (0..slots).map(|i| e.share(i)).collect();
                            // Cuts only: always safe, so the state takes them.
                            let from = rng.random_range(0..slots);
                            let step = shares[from].min(rng.random_range(1..PPM / 10));
                            shares[from] -= step;
                            ShareEntry {
                                key: k.clone(),
                                shares_ppm: shares,
                                home: HomeChange::Keep,
                            }
                        })
                        .collect();
                    Operation::SetShares {
                        membership: s.membership,
                        entries,
                    }
                }
                7 => Operation::PutRegion {
                    region: RegionId::new(regions[rng.random_range(0..3)]).unwrap(),
                    reserves_floor: rng.random_bool(0.5),
                    draining: false,
                },
                _ => Operation::RenewLease {
                    region: RegionId::new(regions[rng.random_range(0..2)]).unwrap(),
                    acked_epoch: s.epoch,
                },
            };
            if let Response::SharesSet { accepted, .. } = apply(&mut s, &mut c, id, now, op) {
                shares_moved += accepted;
            }
            if round % 3 == 0 {
                let v = view_of(&mut derived, &s, round, &std::mem::take(&mut c), 0);
                assert_eq!(v.policies, full(&s), "round {round}");
                assert_eq!(*v.tenant_pins, pins_of(&s), "round {round}");
            }
        }
        assert!(!full(&s).is_empty(), "the run left policies to compare");
        assert!(shares_moved > 50, "shares moved {shares_moved} times");
    }
}
