//! The daemon's view of the coordinator: policies, pins and each region's share with its lease.
//!
//! Handlers and the region agent read an immutable [`ClusterView`] snapshot (an `Arc` behind a
//! `watch` channel: one short read lock, never held across an await) and send mutations through
//! [`Coordinator`]: either [`LocalCoordinator`], a one-node coordinator for a single region
//! that keeps its state in `<data_dir>/local.redb` ([`local_store`]), or the
//! Raft-backed [`Replicated`] one ([`replicated`]); the API and the decision path do not tell them apart.
//!
//! Pins are per tenant: a pinned tenant's policies, including ones created later, are decided
//! by its home region (other regions forward their checks there).
//!
//! Nothing outside this module tells the two apart by matching [`Coordinator`]: what needs
//! the replicated member itself (the region agent's reports, the peer listener, the leader's
//! rounds) is handed an `Arc<Replicated>` by the server.

mod local;
pub mod local_store;
mod mutation;
pub mod readiness;
pub mod replicated;
mod status;
pub mod view;

use std::sync::Arc;

use quota_core::{PlanName, Policy, PolicyName, RegionId, TenantId};
use tokio::sync::watch;

pub use local::LocalCoordinator;
pub use mutation::{CoordError, PlanAssignment, PolicyPut, Removal};
pub use readiness::Awaited;
pub use replicated::Replicated;
pub use status::{CoordinatorStatus, MemberStatus};
pub use view::{
    tenant_policies, ClusterView, Grant, PlanAssignments, PolicyEntry, PolicyMap, Resolved,
};

/// The coordinator behind the daemon.
// One per daemon, behind an `Arc`: the size of the local variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Coordinator {
    /// One region, no Raft.
    Local(LocalCoordinator),
    /// A member of a Raft-replicated multi-region cluster.
    Replicated(Arc<Replicated>),
}

impl Coordinator {
    /// A receiver of view snapshots; changes wake `changed()`.
    pub fn subscribe(&self) -> watch::Receiver<Arc<ClusterView>> {
        match self {
            Coordinator::Local(c) => c.subscribe(),
            Coordinator::Replicated(c) => c.subscribe(),
        }
    }

    /// The current view.
    pub fn view(&self) -> Arc<ClusterView> {
        match self {
            Coordinator::Local(c) => c.view(),
            Coordinator::Replicated(c) => c.view(),
        }
    }

    /// Looks at this region's lease (multi-region): logs a lapse not told yet and brings
    /// `quotad_lease_remaining_ms` up to date. A single region's lease never ends.
    pub fn observe_lease(&self) {
        if let Coordinator::Replicated(c) = self {
            c.observe_lease();
        }
    }

    /// Creates or replaces a policy; returns it with its new version.
    pub async fn put_policy(
        &self,
        tenant: TenantId,
        name: PolicyName,
        policy: Policy,
    ) -> Result<Policy, CoordError> {
        match self {
            Coordinator::Local(c) => c
                .put_policies(vec![(tenant, name, policy)])
                .map(|mut stored| stored.remove(0)),
            Coordinator::Replicated(c) => c.put_policy(tenant, name, policy).await,
        }
    }

    /// Creates or replaces several policies in one step, all or none; returns them with their
    /// new versions, in order.
    pub async fn put_policies(&self, batch: Vec<PolicyPut>) -> Result<Vec<Policy>, CoordError> {
        match self {
            Coordinator::Local(c) => c.put_policies(batch),
            Coordinator::Replicated(c) => c.put_policies(batch).await,
        }
    }

    /// Deletes a policy; `false` if there was none.
    pub async fn delete_policy(
        &self,
        tenant: TenantId,
        name: PolicyName,
    ) -> Result<bool, CoordError> {
        match self {
            Coordinator::Local(c) => c.delete_policy(&tenant, &name),
            Coordinator::Replicated(c) => c.delete_policy(tenant, name).await,
        }
    }

    /// Pins a tenant to a home region: its policies, present and future, are decided there.
    /// A tenant without policies may be pinned.
    pub async fn pin(&self, tenant: TenantId, region: RegionId) -> Result<(), CoordError> {
        match self {
            Coordinator::Local(c) => c.pin(&tenant, region),
            Coordinator::Replicated(c) => c.pin(tenant, region).await,
        }
    }

    /// Removes a tenant's pin; `false` if there was none.
    pub async fn unpin(&self, tenant: TenantId) -> Result<bool, CoordError> {
        match self {
            Coordinator::Local(c) => c.unpin(&tenant),
            Coordinator::Replicated(c) => c.unpin(tenant).await,
        }
    }

    /// Creates or replaces a plan in one step (all or none); returns its policies with their
    /// versions, in order. Every tenant assigned to it sees the change at once.
    pub async fn put_plan(
        &self,
        plan: PlanName,
        policies: Vec<(PolicyName, Policy)>,
    ) -> Result<Vec<Policy>, CoordError> {
        match self {
            Coordinator::Local(c) => c.put_plan(&plan, policies),
            Coordinator::Replicated(c) => c.put_plan(plan, policies).await,
        }
    }

    /// Deletes a plan; `false` if there was none.
    pub async fn delete_plan(&self, plan: PlanName) -> Result<bool, CoordError> {
        match self {
            Coordinator::Local(c) => c.delete_plan(&plan),
            Coordinator::Replicated(c) => c.delete_plan(plan).await,
        }
    }

    /// Assigns a tenant to an existing plan.
    pub async fn assign_plan(&self, tenant: TenantId, plan: PlanName) -> Result<(), CoordError> {
        match self {
            Coordinator::Local(c) => c.assign_plan(&tenant, &plan),
            Coordinator::Replicated(c) => c.assign_plan(tenant, plan).await,
        }
    }

    /// Removes a tenant's plan assignment; `false` if it had none.
    pub async fn unassign_plan(&self, tenant: TenantId) -> Result<bool, CoordError> {
        match self {
            Coordinator::Local(c) => c.unassign_plan(&tenant),
            Coordinator::Replicated(c) => c.unassign_plan(tenant).await,
        }
    }

    /// Assigns or unassigns several tenants in one step, all or none.
    pub async fn assign_plans(&self, batch: Vec<PlanAssignment>) -> Result<(), CoordError> {
        match self {
            Coordinator::Local(c) => c.assign_plans(&batch),
            Coordinator::Replicated(c) => c.assign_plans(batch).await,
        }
    }

    /// Adds a node as a learner (leader only); it catches up, then may be promoted.
    pub async fn add_member(
        &self,
        node_id: u64,
        member: quota_raft::Member,
    ) -> Result<(), CoordError> {
        match self {
            Coordinator::Local(_) => Err(CoordError::NotClustered),
            Coordinator::Replicated(c) => c.add_member(node_id, member).await,
        }
    }

    /// Makes a learner a voter (leader only).
    pub async fn promote_member(&self, node_id: u64) -> Result<(), CoordError> {
        match self {
            Coordinator::Local(_) => Err(CoordError::NotClustered),
            Coordinator::Replicated(c) => c.promote_member(node_id).await,
        }
    }

    /// Removes a member (leader only): its region drains, then leaves the coordinator's state
    /// and the Raft group.
    pub async fn remove_member(&self, node_id: u64) -> Result<Removal, CoordError> {
        match self {
            Coordinator::Local(_) => Err(CoordError::NotClustered),
            Coordinator::Replicated(c) => c.remove_member(node_id).await,
        }
    }

    /// What this daemon waits for before it takes traffic ([`readiness`]): nothing for a
    /// single region; empty for a member once it was ready, and from then on.
    pub fn readiness(&self) -> Vec<Awaited> {
        match self {
            Coordinator::Local(_) => Vec::new(),
            Coordinator::Replicated(c) => c.readiness(),
        }
    }

    /// Role, leader, term and members.
    pub fn status(&self) -> CoordinatorStatus {
        match self {
            Coordinator::Local(c) => c.status(),
            Coordinator::Replicated(c) => c.status(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quota_core::{PolicySpec, PPM};

    fn ids() -> (TenantId, PolicyName) {
        (
            TenantId::new("acme").unwrap(),
            PolicyName::new("writes").unwrap(),
        )
    }

    fn policy() -> Policy {
        policy_of(100.0)
    }

    fn policy_of(limit: f64) -> Policy {
        PolicySpec {
            limit,
            window_ms: 60_000.0,
            floor: Some(0.1),
            ..Default::default()
        }
        .validate()
        .unwrap()
    }

    /// A single-region coordinator on the state in `dir`.
    fn open_local(region: &RegionId, dir: &std::path::Path) -> Coordinator {
        Coordinator::Local(LocalCoordinator::open(region.clone(), dir).unwrap())
    }

    #[tokio::test]
    async fn local_coordinator_versions_policies_and_notifies() {
        let c = Coordinator::Local(LocalCoordinator::in_temp_dir(RegionId::new("eu").unwrap()));
        let mut rx = c.subscribe();
        let (t, p) = ids();
        let v1 = c.put_policy(t.clone(), p.clone(), policy()).await.unwrap();
        let v2 = c
            .put_policy(t.clone(), p.clone(), policy_of(200.0))
            .await
            .unwrap();
        assert_eq!((v1.version, v2.version), (1, 2));
        assert!(rx.has_changed().unwrap());
        let view = rx.borrow_and_update().clone();
        let entry = view.policy(&t, &p).unwrap();
        assert_eq!(entry.grants.values().next().unwrap().share_ppm, PPM);
        // The same policy again changes nothing: same version, so the bucket keeps its tokens.
        let again = c
            .put_policy(t.clone(), p.clone(), policy_of(200.0))
            .await
            .unwrap();
        assert_eq!(again.version, 2);
        assert!(!rx.has_changed().unwrap());
        assert!(c.delete_policy(t.clone(), p.clone()).await.unwrap());
        assert!(!c.delete_policy(t, p).await.unwrap());
    }

    #[tokio::test]
    async fn pins_only_to_known_regions() {
        let c = Coordinator::Local(LocalCoordinator::in_temp_dir(RegionId::new("eu").unwrap()));
        let (t, p) = ids();
        c.put_policy(t.clone(), p, policy()).await.unwrap();
        let err = c
            .pin(t.clone(), RegionId::new("us").unwrap())
            .await
            .unwrap_err();
        assert!(matches!(err, CoordError::UnknownRegion { .. }));
        c.pin(t.clone(), RegionId::new("eu").unwrap())
            .await
            .unwrap();
        assert_eq!(c.view().tenant_home(&t).map(RegionId::as_str), Some("eu"));
        assert!(c.unpin(t.clone()).await.unwrap());
        assert!(!c.unpin(t).await.unwrap());
    }

    #[tokio::test]
    async fn a_tenant_pin_covers_policies_created_later() {
        let c = Coordinator::Local(LocalCoordinator::in_temp_dir(RegionId::new("eu").unwrap()));
        let (t, p) = ids();
        // No policy yet: pinning still succeeds.
        c.pin(t.clone(), RegionId::new("eu").unwrap())
            .await
            .unwrap();
        c.put_policy(t.clone(), p.clone(), policy()).await.unwrap();
        let view = c.view();
        assert_eq!(
            view.policy(&t, &p)
                .unwrap()
                .home
                .as_ref()
                .map(RegionId::as_str),
            Some("eu")
        );
        assert!(c.unpin(t.clone()).await.unwrap());
        assert_eq!(c.view().policy(&t, &p).unwrap().home, None);
        assert_eq!(c.view().tenant_home(&t), None);
    }

    #[tokio::test]
    async fn a_restart_keeps_policies_versions_and_pins() {
        let dir = tempfile::tempdir().unwrap();
        let eu = RegionId::new("eu").unwrap();
        let (t, p) = ids();
        let other = PolicyName::new("reads").unwrap();
        let before = {
            let c = open_local(&eu, dir.path());
            c.put_policy(t.clone(), p.clone(), policy()).await.unwrap();
            c.put_policy(t.clone(), other.clone(), policy())
                .await
                .unwrap();
            // A changed policy records the version it replaced.
            let changed = c
                .put_policy(t.clone(), other.clone(), policy_of(200.0))
                .await
                .unwrap();
            assert_eq!((changed.version, changed.replaces), (3, Some(2)));
            c.pin(t.clone(), eu.clone()).await.unwrap();
            // Delete and re-put: a new version, never a reused one (fresh Redis keys).
            assert!(c.delete_policy(t.clone(), p.clone()).await.unwrap());
            let again = c.put_policy(t.clone(), p.clone(), policy()).await.unwrap();
            assert_eq!((again.version, again.replaces), (4, None));
            c.view()
        };
        let c = open_local(&eu, dir.path());
        let after = c.view();
        assert_eq!(after.policies, before.policies);
        assert_eq!((before.last_version, after.last_version), (4, 4));
        assert_eq!(after.tenant_pins, before.tenant_pins);
        assert_eq!(after.tenant_home(&t), Some(&eu));
        assert_eq!(after.policy(&t, &p).unwrap().policy.version, 4);
        // What a changed policy replaced survives a restart, for its first parameter write.
        assert_eq!(after.policy(&t, &other).unwrap().policy.replaces, Some(2));
        assert_eq!(after.policy(&t, &other).unwrap().home.as_ref(), Some(&eu));
        // The counter survived too: the next version is 5, even after deleting everything.
        assert!(c.delete_policy(t.clone(), p.clone()).await.unwrap());
        assert!(c.delete_policy(t.clone(), other.clone()).await.unwrap());
        drop(c);
        let c = open_local(&eu, dir.path());
        assert!(c.view().policies.is_empty());
        let v = c.put_policy(t.clone(), p, policy()).await.unwrap();
        assert_eq!(v.version, 5);
        // An unpin is durable as well.
        assert!(c.unpin(t.clone()).await.unwrap());
        drop(c);
        let c = open_local(&eu, dir.path());
        assert_eq!(c.view().tenant_home(&t), None);
    }

    #[tokio::test]
    async fn a_policy_batch_is_one_durable_step_with_consecutive_versions() {
        let dir = tempfile::tempdir().unwrap();
        let eu = RegionId::new("eu").unwrap();
        let (t, p) = ids();
        let names: Vec<_> = (0..50)
            .map(|i| PolicyName::new(format!("p{i}")).unwrap())
            .collect();
        let before = {
            let c = open_local(&eu, dir.path());
            c.put_policy(t.clone(), p.clone(), policy()).await.unwrap();
            c.pin(t.clone(), eu.clone()).await.unwrap();
            let mut rx = c.subscribe();
            rx.borrow_and_update();
            let batch = names
                .iter()
                .map(|n| (t.clone(), n.clone(), policy()))
                .collect();
            let stored = c.put_policies(batch).await.unwrap();
            let versions: Vec<u64> = stored.iter().map(|p| p.version).collect();
            assert_eq!(versions, (2..52).collect::<Vec<_>>());
            // One view change for the whole batch, every policy in it, each pinned like a
            // single put.
            assert!(rx.has_changed().unwrap());
            let view = rx.borrow_and_update().clone();
            assert_eq!(view.policies.len(), 51);
            assert!(names
                .iter()
                .all(|n| view.policy(&t, n).unwrap().home.as_ref() == Some(&eu)));
            assert!(c.put_policies(Vec::new()).await.unwrap().is_empty());
            c.view()
        };
        let c = open_local(&eu, dir.path());
        assert_eq!(c.view().policies, before.policies);
        assert_eq!(c.view().last_version, 51);
        assert_eq!(
            c.put_policy(t, p, policy_of(200.0)).await.unwrap().version,
            52
        );
    }

    #[tokio::test]
    async fn an_assignment_batch_is_one_durable_step_all_or_none() {
        let dir = tempfile::tempdir().unwrap();
        let eu = RegionId::new("eu").unwrap();
        let pro = PlanName::new("pro").unwrap();
        let tenant = |t: &str| TenantId::new(t).unwrap();
        {
            let c = open_local(&eu, dir.path());
            let calls = PolicyName::new("calls").unwrap();
            c.put_plan(pro.clone(), vec![(calls, policy())])
                .await
                .unwrap();
            let batch = vec![
                (tenant("a"), Some(pro.clone())),
                (tenant("b"), Some(pro.clone())),
            ];
            c.assign_plans(batch).await.unwrap();
            let mut rx = c.subscribe();
            rx.borrow_and_update();
            let refused = c
                .assign_plans(vec![
                    (tenant("a"), None),
                    (tenant("c"), Some(PlanName::new("nope").unwrap())),
                ])
                .await
                .unwrap_err();
            assert_eq!(
                refused,
                CoordError::InvalidAssignments {
                    entries: vec![quota_core::coordinator::InvalidEntry {
                        index: 1,
                        fields: vec!["plan".into()],
                    }],
                    total: 1,
                }
            );
            assert!(
                !rx.has_changed().unwrap(),
                "a refused batch changes nothing"
            );
            assert_eq!(c.view().plan_assignments.get(&tenant("a")), Some(&pro));
            c.assign_plans(vec![(tenant("b"), None)]).await.unwrap();
        }
        let c = open_local(&eu, dir.path());
        let view = c.view();
        assert_eq!(view.plan_assignments.get(&tenant("a")), Some(&pro));
        assert_eq!(view.plan_assignments.get(&tenant("b")), None);
        assert_eq!(view.plan_assignments.len(), 1);
    }

    #[test]
    fn a_file_that_is_not_a_store_fails_start_up_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(local_store::DB_FILE);
        std::fs::write(&path, b"this is not a redb file, and never was one").unwrap();
        let err = LocalCoordinator::open(RegionId::new("eu").unwrap(), dir.path()).unwrap_err();
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
    }
}
