//! Plans: a named set of policies that applies to every subject assigned to it (or, for the
//! plan named [`DEFAULT_PLAN`], to every subject without a plan or an explicit policy).
//!
//! Each (plan, policy) is one allocation *class*: an ordinary coordinator entry stored under
//! the plan's reserved subject ([`TenantId::for_plan`]), so it has its own version, share
//! vector, floor and home like any policy, and the allocator learns its demand from the
//! usage of every subject's bucket under it. A subject decides in its own bucket (tagged by
//! the subject, at the class version) at the class share of the limit, so Σ shares ≤ 1 keeps
//! every subject within its limit worldwide while the state stays O(plans + assignments).

use std::collections::BTreeMap;

use crate::coordinator::{
    CoordinatorState, InvalidEntry, PolicyKey, Response, MAX_BATCH_ASSIGNMENTS, MAX_BATCH_POLICIES,
    MAX_LISTED_INVALID,
};
use crate::ids::{PlanName, PolicyName, TenantId};
use crate::policy::Policy;

/// The plan that applies to subjects with no plan and no explicit policy of a name.
pub const DEFAULT_PLAN: &str = "default";

impl CoordinatorState {
    /// The live policy names of a plan, in order (empty: no such plan).
    pub fn plan_policies(&self, plan: &PlanName) -> Vec<PolicyName> {
        let class = TenantId::for_plan(plan);
        self.live_of(&class).map(|k| k.policy.clone()).collect()
    }

    fn live_of<'a>(&'a self, subject: &'a TenantId) -> impl Iterator<Item = &'a PolicyKey> + 'a {
        let first = PolicyName::new("-").ok();
        first
            .into_iter()
            .flat_map(move |first| {
                self.entries
                    .range(PolicyKey::new(subject.clone(), first)..)
                    .take_while(move |(k, _)| &k.tenant == subject)
            })
            .filter(|(_, e)| !e.deleted)
            .map(|(k, _)| k)
    }

    pub(crate) fn put_plan(
        &mut self,
        plan: &PlanName,
        policies: &[(PolicyName, Policy)],
        now: u64,
    ) -> Response {
        if policies.is_empty() {
            return Response::InvalidPlan {
                field: "policies".into(),
            };
        }
        if policies.len() > MAX_BATCH_POLICIES {
            return Response::BatchTooLarge {
                max: MAX_BATCH_POLICIES as u32,
            };
        }
        let mut names: Vec<&PolicyName> = policies.iter().map(|(n, _)| n).collect();
        names.sort();
        names.dedup();
        if names.len() != policies.len() {
            return Response::InvalidPlan {
                field: "policies".into(),
            };
        }
        let entries: Vec<(PolicyKey, Policy)> = policies
            .iter()
            .map(|(n, p)| {
                (
                    PolicyKey::new(TenantId::for_plan(plan), n.clone()),
                    p.clone(),
                )
            })
            .collect();
        let invalid: Vec<_> = entries
            .iter()
            .enumerate()
            .filter_map(|(index, (_, p))| {
                self.policy_problem(p)
                    .map(|fields| crate::coordinator::InvalidEntry {
                        index: index as u32,
                        fields,
                    })
            })
            .collect();
        if !invalid.is_empty() {
            let total = invalid.len() as u32;
            return Response::InvalidPolicies {
                entries: invalid
                    .into_iter()
                    .take(crate::coordinator::MAX_LISTED_INVALID)
                    .collect(),
                total,
            };
        }
        let class = TenantId::for_plan(plan);
        let gone: Vec<PolicyKey> = self
            .live_of(&class)
            .filter(|k| !names.contains(&&k.policy))
            .cloned()
            .collect();
        for key in &gone {
            self.delete_policy(key, now);
        }
        let versions = entries
            .iter()
            .map(|(key, policy)| self.store_policy(key, policy, now).0)
            .collect();
        Response::PlanStored {
            versions,
            epoch: self.epoch,
        }
    }

    pub(crate) fn delete_plan(&mut self, plan: &PlanName, now: u64) -> Response {
        let class = TenantId::for_plan(plan);
        let live: Vec<PolicyKey> = self.live_of(&class).cloned().collect();
        if live.is_empty() {
            return Response::UnknownPlan;
        }
        for key in &live {
            self.delete_policy(key, now);
        }
        Response::PlanDeleted { epoch: self.epoch }
    }

    pub(crate) fn assign_plan(&mut self, tenant: &TenantId, plan: &PlanName) -> Response {
        if tenant.reserved().is_some() {
            return Response::InvalidPlan {
                field: "tenant".into(),
            };
        }
        let class = TenantId::for_plan(plan);
        if self.live_of(&class).next().is_none() {
            return Response::UnknownPlan;
        }
        self.plan_assignments.insert(tenant.clone(), plan.clone());
        Response::PlanAssigned
    }

    pub(crate) fn unassign_plan(&mut self, tenant: &TenantId) -> Response {
        match self.plan_assignments.remove(tenant) {
            Some(_) => Response::PlanUnassigned,
            None => Response::TenantHasNoPlan,
        }
    }

    /// Every entry is checked before any is applied, so a refused batch changes nothing; each
    /// distinct plan is looked up once.
    pub(crate) fn assign_plans(
        &mut self,
        assignments: &[(TenantId, Option<PlanName>)],
    ) -> Response {
        if assignments.len() > MAX_BATCH_ASSIGNMENTS {
            return Response::BatchTooLarge {
                max: MAX_BATCH_ASSIGNMENTS as u32,
            };
        }
        let mut live: BTreeMap<&PlanName, bool> = BTreeMap::new();
        let mut invalid = Vec::new();
        let mut total = 0u32;
        for (index, (tenant, plan)) in assignments.iter().enumerate() {
            let mut fields = Vec::new();
            if tenant.reserved().is_some() {
                fields.push("tenant".to_string());
            }
            if let Some(plan) = plan {
                let exists = *live
                    .entry(plan)
                    .or_insert_with(|| self.live_of(&TenantId::for_plan(plan)).next().is_some());
                if !exists {
                    fields.push("plan".to_string());
                }
            }
            if !fields.is_empty() {
                total += 1;
                if invalid.len() < MAX_LISTED_INVALID {
                    invalid.push(InvalidEntry {
                        index: index as u32,
                        fields,
                    });
                }
            }
        }
        if total > 0 {
            return Response::InvalidAssignments {
                entries: invalid,
                total,
            };
        }
        for (tenant, plan) in assignments {
            match plan {
                Some(plan) => {
                    self.plan_assignments.insert(tenant.clone(), plan.clone());
                }
                None => {
                    self.plan_assignments.remove(tenant);
                }
            }
        }
        Response::PlansAssigned
    }

    /// The class entry a check of `subject`'s `policy` decides under when the subject has no
    /// explicit policy of that name: its assigned plan's, else the default plan's.
    pub fn class_of(&self, subject: &TenantId, policy: &PolicyName) -> Option<PolicyKey> {
        let live = |plan: &PlanName| {
            let key = PolicyKey::new(TenantId::for_plan(plan), policy.clone());
            self.entries.get(&key).filter(|e| !e.deleted).map(|_| key)
        };
        self.plan_assignments
            .get(subject)
            .and_then(live)
            .or_else(|| PlanName::new(DEFAULT_PLAN).ok().as_ref().and_then(live))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::{Command, Operation, RequestId};
    use crate::ids::RegionId;
    use crate::policy::PolicySpec;
    use proptest::prelude::*;

    fn policy(limit: f64) -> Policy {
        PolicySpec {
            limit,
            window_ms: 60_000.0,
            ..Default::default()
        }
        .validate()
        .unwrap()
    }

    fn apply(s: &mut CoordinatorState, id: u128, op: Operation) -> Response {
        s.apply(&Command {
            request: RequestId(id),
            now_ms: 1_000 + id as u64,
            op,
        })
    }

    fn name(s: &str) -> PolicyName {
        PolicyName::new(s).unwrap()
    }

    fn plan(s: &str) -> PlanName {
        PlanName::new(s).unwrap()
    }

    fn tenant(s: &str) -> TenantId {
        TenantId::new(s).unwrap()
    }

    fn with_regions() -> CoordinatorState {
        let mut s = CoordinatorState::default();
        for (i, r) in ["eu", "us", "ap"].into_iter().enumerate() {
            apply(
                &mut s,
                900 + i as u128,
                Operation::PutRegion {
                    region: RegionId::new(r).unwrap(),
                    reserves_floor: true,
                    draining: false,
                },
            );
        }
        s
    }

    #[test]
    fn a_plan_change_is_one_command_with_new_versions() {
        let mut s = with_regions();
        let put = |limit| Operation::PutPlan {
            plan: plan("pro"),
            policies: vec![
                (name("calls"), policy(limit)),
                (name("exports"), policy(5.0)),
            ],
        };
        let Response::PlanStored { versions: v1, .. } = apply(&mut s, 1, put(100.0)) else {
            panic!()
        };
        assert_eq!(v1, vec![1, 2]);
        for i in 0..100 {
            let r = apply(
                &mut s,
                10 + i,
                Operation::AssignPlan {
                    tenant: tenant(&format!("t{i}")),
                    plan: plan("pro"),
                },
            );
            assert_eq!(r, Response::PlanAssigned);
        }
        let Response::PlanStored { versions: v2, .. } = apply(&mut s, 2, put(200.0)) else {
            panic!()
        };
        // Only the changed policy gets a new version, never a reused one.
        assert_eq!(v2, vec![3, 2]);
        for i in 0..100 {
            let key = s
                .class_of(&tenant(&format!("t{i}")), &name("calls"))
                .unwrap();
            assert_eq!(s.entries[&key].policy.limit, 200);
            assert_eq!(s.entries[&key].policy.version, 3);
        }
        s.check_invariant().unwrap();
    }

    #[test]
    fn resolution_prefers_the_assigned_plan_then_default() {
        let mut s = with_regions();
        assert_eq!(s.class_of(&tenant("a"), &name("login")), None);
        let r = apply(
            &mut s,
            1,
            Operation::PutPlan {
                plan: plan(DEFAULT_PLAN),
                policies: vec![(name("login"), policy(5.0))],
            },
        );
        assert!(matches!(r, Response::PlanStored { .. }), "{r:?}");
        apply(
            &mut s,
            2,
            Operation::PutPlan {
                plan: plan("pro"),
                policies: vec![(name("login"), policy(50.0))],
            },
        );
        let class = |s: &CoordinatorState, t| s.class_of(&tenant(t), &name("login")).unwrap();
        assert_eq!(
            class(&s, "a").tenant,
            TenantId::for_plan(&plan(DEFAULT_PLAN))
        );
        apply(
            &mut s,
            3,
            Operation::AssignPlan {
                tenant: tenant("a"),
                plan: plan("pro"),
            },
        );
        assert_eq!(class(&s, "a").tenant, TenantId::for_plan(&plan("pro")));
        // A deleted plan leaves the assignment, which falls back to the default plan.
        assert!(matches!(
            apply(&mut s, 4, Operation::DeletePlan { plan: plan("pro") }),
            Response::PlanDeleted { .. }
        ));
        assert_eq!(
            class(&s, "a").tenant,
            TenantId::for_plan(&plan(DEFAULT_PLAN))
        );
        assert!(s.plan_policies(&plan("pro")).is_empty());
        s.check_invariant().unwrap();
    }

    #[test]
    fn bad_plan_commands_change_nothing() {
        let mut s = with_regions();
        let before = s.clone();
        let cases = [
            Operation::PutPlan {
                plan: plan("p"),
                policies: vec![],
            },
            Operation::PutPlan {
                plan: plan("p"),
                policies: vec![(name("a"), policy(1.0)), (name("a"), policy(2.0))],
            },
            Operation::PutPlan {
                plan: plan("p"),
                policies: vec![(
                    name("a"),
                    Policy {
                        window_ms: 0,
                        ..policy(1.0)
                    },
                )],
            },
            Operation::AssignPlan {
                tenant: tenant("a"),
                plan: plan("nope"),
            },
            Operation::AssignPlan {
                tenant: TenantId::for_plan(&plan("p")),
                plan: plan("p"),
            },
            Operation::UnassignPlan {
                tenant: tenant("a"),
            },
            Operation::DeletePlan { plan: plan("p") },
        ];
        for (i, op) in cases.into_iter().enumerate() {
            let r = apply(&mut s, 50 + i as u128, op);
            assert!(
                matches!(
                    r,
                    Response::InvalidPlan { .. }
                        | Response::InvalidPolicies { .. }
                        | Response::UnknownPlan
                        | Response::TenantHasNoPlan
                ),
                "{r:?}"
            );
            assert_eq!(s.entries, before.entries);
            assert_eq!(s.plan_assignments, before.plan_assignments);
            assert_eq!(s.last_version, before.last_version);
        }
    }

    #[test]
    fn an_assignment_batch_is_all_or_none() {
        let mut s = with_regions();
        for (id, p) in [(1, "pro"), (2, "free")] {
            apply(
                &mut s,
                id,
                Operation::PutPlan {
                    plan: plan(p),
                    policies: vec![(name("calls"), policy(10.0))],
                },
            );
        }
        let batch = |entries: &[(&str, Option<&str>)]| Operation::AssignPlans {
            assignments: entries
                .iter()
                .map(|(t, p)| (tenant(t), p.map(plan)))
                .collect(),
        };
        let r = apply(
            &mut s,
            3,
            batch(&[("a", Some("pro")), ("b", Some("free")), ("c", Some("pro"))]),
        );
        assert_eq!(r, Response::PlansAssigned);
        assert_eq!(s.plan_assignments.len(), 3);
        // One unknown plan and one reserved tenant refuse the whole batch, each named.
        let before = s.clone();
        let reserved = TenantId::for_plan(&plan("pro"));
        let r = apply(
            &mut s,
            4,
            Operation::AssignPlans {
                assignments: vec![
                    (tenant("a"), None),
                    (tenant("d"), Some(plan("nope"))),
                    (reserved, Some(plan("pro"))),
                ],
            },
        );
        assert_eq!(
            r,
            Response::InvalidAssignments {
                entries: vec![
                    InvalidEntry {
                        index: 1,
                        fields: vec!["plan".into()]
                    },
                    InvalidEntry {
                        index: 2,
                        fields: vec!["tenant".into()]
                    },
                ],
                total: 2,
            }
        );
        assert_eq!(s.plan_assignments, before.plan_assignments);
        // `None` unassigns (a tenant without a plan too); later entries win.
        let r = apply(
            &mut s,
            5,
            batch(&[
                ("a", None),
                ("z", None),
                ("b", Some("pro")),
                ("b", Some("free")),
            ]),
        );
        assert_eq!(r, Response::PlansAssigned);
        assert_eq!(s.plan_assignments.get(&tenant("a")), None);
        assert_eq!(s.plan_assignments.get(&tenant("b")), Some(&plan("free")));
        let too_many = (0..=MAX_BATCH_ASSIGNMENTS)
            .map(|i| (tenant(&format!("t{i}")), None))
            .collect();
        let r = apply(
            &mut s,
            6,
            Operation::AssignPlans {
                assignments: too_many,
            },
        );
        assert_eq!(
            r,
            Response::BatchTooLarge {
                max: MAX_BATCH_ASSIGNMENTS as u32
            }
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Any sequence of plan commands keeps the safety invariant, never reuses a version
        /// and leaves every assignment naming a plan that existed when it was made.
        #[test]
        fn plan_commands_keep_the_invariants(ops in proptest::collection::vec((0u8..5, 0u8..3, 0u8..4, 1u64..50), 1..40)) {
            let mut s = with_regions();
            let mut last = 0;
            for (i, (kind, p, t, limit)) in ops.into_iter().enumerate() {
                let pl = plan(&format!("p{p}"));
                let op = match kind {
                    0 | 1 => Operation::PutPlan {
                        plan: pl,
                        policies: (0..=t % 3).map(|n| (name(&format!("n{n}")), policy(limit as f64))).collect(),
                    },
                    2 => Operation::DeletePlan { plan: pl },
                    3 => Operation::AssignPlan { tenant: tenant(&format!("t{t}")), plan: pl },
                    _ => Operation::UnassignPlan { tenant: tenant(&format!("t{t}")) },
                };
                apply(&mut s, i as u128 + 1, op);
                s.check_invariant().unwrap();
                prop_assert!(s.last_version >= last);
                last = s.last_version;
                let mut versions: Vec<u64> = s.entries.values().map(|e| e.policy.version).collect();
                let n = versions.len();
                versions.sort_unstable();
                versions.dedup();
                prop_assert_eq!(versions.len(), n);
            }
        }
    }
}
