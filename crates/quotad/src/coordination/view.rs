//! The view snapshots handlers and the region agent read: policies, pins and each region's
//! share with its lease. A leaf: both coordinators build these, and nothing here knows them.

use std::collections::BTreeMap;
use std::sync::Arc;

use quota_core::mode::BudgetMode;
use quota_core::plan::DEFAULT_PLAN;
use quota_core::{PlanName, Policy, PolicyName, RegionId, TenantId};
use serde::Serialize;

/// One region's grant for a tenant's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Grant {
    pub share_ppm: u32,
    /// What the region falls back to once its lease is over (never above the share).
    pub floor_ppm: u32,
}

/// A tenant's policy with every region's grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyEntry {
    pub policy: Policy,
    pub grants: BTreeMap<RegionId, Grant>,
    /// The home region of a pinned policy (its tenant's pin, or the allocator's automatic pin
    /// of a `critical` policy or of a budget too small to split).
    pub home: Option<RegionId>,
    /// Whether the budget is split over the regions or lives whole in its home.
    pub mode: BudgetMode,
}

/// Every tenant's policies with their grants, in key order. A plan's policies are here too,
/// under the plan's reserved subject ([`TenantId::for_plan`]).
pub type PolicyMap = imbl::OrdMap<(TenantId, PolicyName), PolicyEntry>;

/// Tenants assigned to a plan: persistent, so a view after one assignment copies one path.
pub type PlanAssignments = imbl::OrdMap<TenantId, PlanName>;

/// A subject of a plan's class with shares of its own ([`quota_core::promotion`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromotedEntry {
    /// The plan's reserved subject whose class this is.
    pub class: TenantId,
    /// The class's policy (same version, so the subject keeps its bucket) at the subject's
    /// own grants.
    pub entry: PolicyEntry,
}

/// Promoted subjects by (subject, policy name): at most a few thousand.
pub type PromotedMap = imbl::OrdMap<(TenantId, PolicyName), PromotedEntry>;

/// The policy a check of a subject decides under, and whose it is.
#[derive(Debug, Clone, Copy)]
pub struct Resolved<'a> {
    pub entry: &'a PolicyEntry,
    /// The plan whose policy this is (the subject decides in its own bucket at this class's
    /// share and version); `None` for the subject's explicit policy.
    pub plan: Option<&'a TenantId>,
    /// The subject is promoted: `entry` holds the class's policy at the subject's own grants.
    pub promoted: bool,
}

/// An immutable snapshot of coordinator state, as this region sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterView {
    /// A persistent map: views share it, and a new view after a change copies only the
    /// changed entries' paths (lease renewals change only `region_leases` and
    /// `lease_end_local_ms`, and share it whole).
    pub policies: PolicyMap,
    /// Pinned tenants and their home region.
    pub tenant_pins: Arc<BTreeMap<TenantId, RegionId>>,
    /// Tenants assigned to a plan.
    pub plan_assignments: PlanAssignments,
    /// Subjects of a class with shares of their own.
    pub promoted: PromotedMap,
    /// Coordinator time (wall-clock ms) each region's lease ends, for display; `u64::MAX` =
    /// never. Regions count their own lease, see [`ClusterView::lease_end_local_ms`].
    pub region_leases: BTreeMap<RegionId, u64>,
    /// Bumped on every committed change regions must apply.
    pub epoch: u64,
    /// Local monotonic ms ([`crate::clock::monotonic_ms`]) at which this region must stop
    /// enforcing more than its floors: the instant it sent the renewal plus the lease minus the
    /// drift margin, counted on its own monotonic clock, so no wall-clock step moves it;
    /// `u64::MAX` = never.
    pub lease_end_local_ms: u64,
    /// The last policy version issued when this view was taken. Versions are never reused, so
    /// a bucket at a version up to this one that the view does not hold is gone for good;
    /// one above it belongs to a change this view has not seen yet.
    pub last_version: u64,
}

impl ClusterView {
    /// A tenant's policy, if any.
    pub fn policy(&self, tenant: &TenantId, policy: &PolicyName) -> Option<&PolicyEntry> {
        // BTreeMap lookups need an owned key; ids are short, and this avoids a second map.
        self.policies.get(&(tenant.clone(), policy.clone()))
    }

    /// What a check of `subject`'s `policy` decides under: the subject's explicit policy of
    /// that name, else its own shares of its class if it is promoted there, else its assigned
    /// plan's policy, else the `default` plan's.
    pub fn resolve(&self, subject: &TenantId, policy: &PolicyName) -> Option<Resolved<'_>> {
        if let Some(entry) = self.policy(subject, policy) {
            return Some(Resolved {
                entry,
                plan: None,
                promoted: false,
            });
        }
        let class = |plan: &PlanName| {
            let key = (TenantId::for_plan(plan), policy.clone());
            self.policies
                .get_key_value(&key)
                .map(|((t, _), entry)| Resolved {
                    entry,
                    plan: Some(t),
                    promoted: false,
                })
        };
        let resolved = self
            .plan_assignments
            .get(subject)
            .and_then(class)
            .or_else(|| PlanName::new(DEFAULT_PLAN).ok().as_ref().and_then(class))?;
        if self.promoted.is_empty() {
            return Some(resolved);
        }
        // Promoted within this class at its current version only: a subject that moved to
        // another plan decides there, whatever entry it still has.
        let own = self
            .promoted
            .get(&(subject.clone(), policy.clone()))
            .filter(|p| {
                Some(&p.class) == resolved.plan
                    && p.entry.policy.version == resolved.entry.policy.version
            });
        Some(match own {
            Some(p) => Resolved {
                entry: &p.entry,
                plan: resolved.plan,
                promoted: true,
            },
            None => resolved,
        })
    }

    /// Every plan (a plan exists while it holds a policy) after `after`, in name order.
    pub fn plans_after(&self, after: Option<&PlanName>) -> Vec<PlanName> {
        let (Ok(start), Ok(first)) = (TenantId::new("--plan--"), PolicyName::new("-")) else {
            return Vec::new();
        };
        let mut plans: Vec<PlanName> = Vec::new();
        for ((t, _), _) in self.policies.range((start, first)..) {
            let Some(plan) = t.plan() else { break };
            if after.is_some_and(|a| &plan <= a) || plans.last() == Some(&plan) {
                continue;
            }
            plans.push(plan);
        }
        plans
    }

    /// A plan's policies in name order (none: no such plan).
    pub fn plan_policies<'a>(
        &'a self,
        plan: &'a PlanName,
    ) -> impl Iterator<Item = (&'a PolicyName, &'a PolicyEntry)> + 'a {
        let class = TenantId::for_plan(plan);
        let first = PolicyName::new("-").ok();
        first
            .into_iter()
            .flat_map(move |first| self.policies.range((class.clone(), first)..))
            .take_while(move |((t, _), _)| t.plan().as_ref() == Some(plan))
            .map(|((_, p), e)| (p, e))
    }

    /// The share this region enforces for a grant at local monotonic time `now_ms`
    /// ([`crate::clock::monotonic_ms`]): the grant while the lease holds, the floor after.
    pub fn enforced_share_ppm(&self, grant: Option<&Grant>, now_ms: u64) -> u32 {
        match grant {
            Some(g) if now_ms < self.lease_end_local_ms => g.share_ppm,
            Some(g) => g.floor_ppm.min(g.share_ppm),
            None => 0,
        }
    }

    /// The home a tenant is pinned to, if any.
    pub fn tenant_home(&self, tenant: &TenantId) -> Option<&RegionId> {
        self.tenant_pins.get(tenant)
    }
}

/// The keys of one tenant's policies.
pub(crate) fn tenant_keys(policies: &PolicyMap, tenant: &TenantId) -> Vec<(TenantId, PolicyName)> {
    tenant_policies(policies, tenant)
        .map(|(k, _)| k.clone())
        .collect()
}

/// One tenant's policies in name order: a range of the map, not a scan of it.
pub fn tenant_policies<'a>(
    policies: &'a PolicyMap,
    tenant: &'a TenantId,
) -> impl Iterator<Item = (&'a (TenantId, PolicyName), &'a PolicyEntry)> + 'a {
    // "-" is the least valid name: '-' sorts before every other allowed character.
    let first = PolicyName::new("-").ok();
    first
        .into_iter()
        .flat_map(move |first| policies.range((tenant.clone(), first)..))
        .take_while(move |((t, _), _)| t == tenant)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expired_lease_falls_back_to_the_floor() {
        let g = Grant {
            share_ppm: 600_000,
            floor_ppm: 100_000,
        };
        let view = ClusterView {
            lease_end_local_ms: 1_000,
            ..ClusterView::default()
        };
        assert_eq!(view.enforced_share_ppm(Some(&g), 999), 600_000);
        assert_eq!(view.enforced_share_ppm(Some(&g), 1_000), 100_000);
        assert_eq!(view.enforced_share_ppm(None, 0), 0);
    }

    fn entry(version: u64, share_ppm: u32) -> PolicyEntry {
        let policy = quota_core::PolicySpec {
            limit: 100.0,
            window_ms: 60_000.0,
            ..Default::default()
        }
        .validate()
        .unwrap();
        PolicyEntry {
            policy: Policy { version, ..policy },
            grants: [(
                RegionId::new("eu").unwrap(),
                Grant {
                    share_ppm,
                    floor_ppm: 0,
                },
            )]
            .into(),
            home: None,
            mode: BudgetMode::Split,
        }
    }

    #[test]
    fn resolution_is_explicit_then_promoted_then_plan_then_default() {
        let t = |s: &str| TenantId::new(s).unwrap();
        let calls = PolicyName::new("calls").unwrap();
        let (pro, default) = (
            TenantId::for_plan(&PlanName::new("pro").unwrap()),
            TenantId::for_plan(&PlanName::new(DEFAULT_PLAN).unwrap()),
        );
        let mut v = ClusterView::default();
        v.policies
            .insert((pro.clone(), calls.clone()), entry(5, 300_000));
        v.policies
            .insert((default.clone(), calls.clone()), entry(6, 300_000));
        v.plan_assignments
            .insert(t("s"), PlanName::new("pro").unwrap());
        let promoted = |class: &TenantId, version| PromotedEntry {
            class: class.clone(),
            entry: entry(version, 900_000),
        };
        v.promoted
            .insert((t("s"), calls.clone()), promoted(&pro, 5));
        let share = |v: &ClusterView, s: &str| {
            let r = v.resolve(&t(s), &calls).unwrap();
            (
                r.entry.policy.version,
                r.entry.grants.values().next().unwrap().share_ppm,
                r.promoted,
            )
        };
        // Promoted in its class: the class's version, its own share.
        assert_eq!(share(&v, "s"), (5, 900_000, true));
        // Not promoted: the default plan's class.
        assert_eq!(share(&v, "o"), (6, 300_000, false));
        // An entry of another class (the subject moved plans) is not used.
        v.promoted
            .insert((t("o"), calls.clone()), promoted(&pro, 5));
        assert_eq!(share(&v, "o"), (6, 300_000, false));
        // Nor one of an older version of the class.
        v.policies.insert((pro, calls.clone()), entry(7, 300_000));
        assert_eq!(share(&v, "s"), (7, 300_000, false));
        // An explicit policy comes first.
        v.policies
            .insert((t("s"), calls.clone()), entry(8, 1_000_000));
        assert_eq!(share(&v, "s"), (8, 1_000_000, false));
    }
}
