//! The daemon's view of the coordinator: policies, pins and each region's share with its lease.
//!
//! Handlers and the region agent read an immutable [`ClusterView`] snapshot (an `Arc` behind a
//! `watch` channel: one short read lock, never held across an await) and send mutations through
//! [`Coordinator`]. Today the only implementation is [`LocalCoordinator`], a one-node
//! coordinator for a single region; the Raft-backed one (quota-raft) slots in as another variant
//! of [`Coordinator`] without touching the API or the decision path.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use quota_core::{Policy, PolicyName, RegionId, TenantId, PPM};
use serde::Serialize;
use tokio::sync::watch;

use crate::replicated::Replicated;

/// One region's grant for a tenant's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Grant {
    pub share_ppm: u32,
    /// What the region falls back to once its lease is over (never above the share).
    pub floor_ppm: u32,
    /// Coordinator time (wall-clock ms) the region's lease ends, for display; `u64::MAX` =
    /// never. Regions count their own lease, see [`ClusterView::lease_end_local_ms`].
    pub lease_expires_ms: u64,
}

/// A tenant's policy with every region's grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyEntry {
    pub policy: Policy,
    pub grants: BTreeMap<RegionId, Grant>,
    /// The home region of a pinned policy.
    pub home: Option<RegionId>,
}

/// An immutable snapshot of coordinator state, as this region sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterView {
    pub policies: BTreeMap<(TenantId, PolicyName), PolicyEntry>,
    /// Bumped on every committed change regions must apply.
    pub epoch: u64,
    /// Local wall-clock ms at which this region must stop enforcing more than its floors (its
    /// lease end minus the drift margin, counted by its own clock); `u64::MAX` = never.
    pub lease_end_local_ms: u64,
}

impl ClusterView {
    /// A tenant's policy, if any.
    pub fn policy(&self, tenant: &TenantId, policy: &PolicyName) -> Option<&PolicyEntry> {
        // BTreeMap lookups need an owned key; ids are short, and this avoids a second map.
        self.policies.get(&(tenant.clone(), policy.clone()))
    }

    /// The share this region enforces for a grant at local time `now_ms`: the grant while the
    /// lease holds, the floor after.
    pub fn enforced_share_ppm(&self, grant: Option<&Grant>, now_ms: u64) -> u32 {
        match grant {
            Some(g) if now_ms < self.lease_end_local_ms => g.share_ppm,
            Some(g) => g.floor_ppm.min(g.share_ppm),
            None => 0,
        }
    }

    /// The home of a tenant: the home of any of its pinned policies.
    pub fn tenant_home(&self, tenant: &TenantId) -> Option<&RegionId> {
        self.policies
            .iter()
            .filter(|((t, _), _)| t == tenant)
            .find_map(|(_, e)| e.home.as_ref())
    }
}

/// The coordinator's role and progress, for /v1/status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CoordinatorStatus {
    /// `leader`, `follower`, `candidate`, `learner` or `single` (one-node, no Raft).
    pub role: &'static str,
    pub leader: Option<RegionId>,
    pub term: u64,
    pub applied_index: u64,
    pub members: Vec<MemberStatus>,
}

/// One cluster member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemberStatus {
    pub region: RegionId,
    pub node_id: u64,
    pub voter: bool,
}

/// Why a mutation did not commit. Business answers ("no such policy") are values, not errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoordError {
    #[error("region {region} is not a member of this cluster")]
    UnknownRegion { region: RegionId },
    #[error("the coordinator is unavailable: {reason}")]
    Unavailable { reason: String },
    #[error("a single-region daemon has no cluster membership")]
    NotClustered,
    #[error("only the leader changes membership (leader: node {leader:?})")]
    NotLeader { leader: Option<u64> },
    #[error("membership change rejected: {message}")]
    Rejected { message: String },
    #[error("node {node_id} is not a member")]
    UnknownNode { node_id: u64 },
}

/// The coordinator behind the daemon.
#[derive(Debug)]
pub enum Coordinator {
    /// One region, no Raft.
    Local(LocalCoordinator),
    /// A member of a Raft-replicated multi-region cluster.
    Replicated(Replicated),
}

impl Coordinator {
    /// A receiver of view snapshots; changes wake `changed()`.
    pub fn subscribe(&self) -> watch::Receiver<Arc<ClusterView>> {
        match self {
            Coordinator::Local(c) => c.tx.subscribe(),
            Coordinator::Replicated(c) => c.subscribe(),
        }
    }

    /// The current view.
    pub fn view(&self) -> Arc<ClusterView> {
        match self {
            Coordinator::Local(c) => c.tx.borrow().clone(),
            Coordinator::Replicated(c) => c.view(),
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
            Coordinator::Local(c) => Ok(c.put_policy(tenant, name, policy)),
            Coordinator::Replicated(c) => c.put_policy(tenant, name, policy).await,
        }
    }

    /// Deletes a policy; `false` if there was none.
    pub async fn delete_policy(
        &self,
        tenant: TenantId,
        name: PolicyName,
    ) -> Result<bool, CoordError> {
        match self {
            Coordinator::Local(c) => Ok(c.delete_policy(&tenant, &name)),
            Coordinator::Replicated(c) => c.delete_policy(tenant, name).await,
        }
    }

    /// Pins every policy of a tenant to a home region; `false` if the tenant has none.
    pub async fn pin(&self, tenant: TenantId, region: RegionId) -> Result<bool, CoordError> {
        match self {
            Coordinator::Local(c) => c.pin(&tenant, region),
            Coordinator::Replicated(c) => c.pin(tenant, region).await,
        }
    }

    /// Removes a tenant's pins; `false` if there was none.
    pub async fn unpin(&self, tenant: TenantId) -> Result<bool, CoordError> {
        match self {
            Coordinator::Local(c) => Ok(c.unpin(&tenant)),
            Coordinator::Replicated(c) => c.unpin(tenant).await,
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

    /// Removes a node from the Raft group (leader only).
    pub async fn remove_member(&self, node_id: u64) -> Result<(), CoordError> {
        match self {
            Coordinator::Local(_) => Err(CoordError::NotClustered),
            Coordinator::Replicated(c) => c.remove_member(node_id).await,
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

/// A one-node coordinator: the single region holds every policy's whole budget under a lease
/// that never expires. Mutations apply under a lock and publish a new view.
#[derive(Debug)]
pub struct LocalCoordinator {
    region: RegionId,
    state: Mutex<ClusterView>,
    tx: watch::Sender<Arc<ClusterView>>,
}

impl LocalCoordinator {
    pub fn new(region: RegionId) -> Self {
        let view = ClusterView {
            lease_end_local_ms: u64::MAX,
            ..ClusterView::default()
        };
        let (tx, _) = watch::channel(Arc::new(view.clone()));
        Self {
            region,
            state: Mutex::new(view),
            tx,
        }
    }

    fn mutate<T>(&self, f: impl FnOnce(&mut ClusterView) -> T) -> T {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(&mut state);
        state.epoch += 1;
        self.tx.send_replace(Arc::new(state.clone()));
        out
    }

    fn put_policy(&self, tenant: TenantId, name: PolicyName, mut policy: Policy) -> Policy {
        let region = self.region.clone();
        self.mutate(|s| {
            let key = (tenant, name);
            let old = s.policies.get(&key);
            policy.version = old.map_or(1, |e| e.policy.version + 1);
            let home = old.and_then(|e| e.home.clone());
            let grant = Grant {
                share_ppm: PPM,
                floor_ppm: policy.floor_ppm,
                lease_expires_ms: u64::MAX,
            };
            let entry = PolicyEntry {
                policy: policy.clone(),
                grants: BTreeMap::from([(region, grant)]),
                home,
            };
            s.policies.insert(key, entry);
            policy
        })
    }

    fn delete_policy(&self, tenant: &TenantId, name: &PolicyName) -> bool {
        let key = (tenant.clone(), name.clone());
        self.mutate(|s| s.policies.remove(&key).is_some())
    }

    fn pin(&self, tenant: &TenantId, region: RegionId) -> Result<bool, CoordError> {
        if region != self.region {
            return Err(CoordError::UnknownRegion { region });
        }
        Ok(self.mutate(|s| {
            let mut any = false;
            for ((t, _), e) in s.policies.iter_mut() {
                if t == tenant {
                    e.home = Some(region.clone());
                    any = true;
                }
            }
            any
        }))
    }

    fn unpin(&self, tenant: &TenantId) -> bool {
        self.mutate(|s| {
            let mut any = false;
            for ((t, _), e) in s.policies.iter_mut() {
                if t == tenant && e.home.take().is_some() {
                    any = true;
                }
            }
            any
        })
    }

    fn status(&self) -> CoordinatorStatus {
        let applied_index = self.state.lock().unwrap_or_else(|e| e.into_inner()).epoch;
        CoordinatorStatus {
            role: "single",
            leader: Some(self.region.clone()),
            term: 0,
            applied_index,
            members: vec![MemberStatus {
                region: self.region.clone(),
                node_id: 1,
                voter: true,
            }],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quota_core::PolicySpec;

    fn ids() -> (TenantId, PolicyName) {
        (
            TenantId::new("acme").unwrap(),
            PolicyName::new("writes").unwrap(),
        )
    }

    fn policy() -> Policy {
        PolicySpec {
            limit: 100.0,
            window_ms: 60_000.0,
            floor: Some(0.1),
            ..Default::default()
        }
        .validate()
        .unwrap()
    }

    #[tokio::test]
    async fn local_coordinator_versions_policies_and_notifies() {
        let c = Coordinator::Local(LocalCoordinator::new(RegionId::new("eu").unwrap()));
        let mut rx = c.subscribe();
        let (t, p) = ids();
        let v1 = c.put_policy(t.clone(), p.clone(), policy()).await.unwrap();
        let v2 = c.put_policy(t.clone(), p.clone(), policy()).await.unwrap();
        assert_eq!((v1.version, v2.version), (1, 2));
        assert!(rx.has_changed().unwrap());
        let view = rx.borrow_and_update().clone();
        let entry = view.policy(&t, &p).unwrap();
        assert_eq!(entry.grants.values().next().unwrap().share_ppm, PPM);
        assert!(c.delete_policy(t.clone(), p.clone()).await.unwrap());
        assert!(!c.delete_policy(t, p).await.unwrap());
    }

    #[tokio::test]
    async fn pins_only_to_known_regions() {
        let c = Coordinator::Local(LocalCoordinator::new(RegionId::new("eu").unwrap()));
        let (t, p) = ids();
        c.put_policy(t.clone(), p, policy()).await.unwrap();
        let err = c
            .pin(t.clone(), RegionId::new("us").unwrap())
            .await
            .unwrap_err();
        assert!(matches!(err, CoordError::UnknownRegion { .. }));
        assert!(c
            .pin(t.clone(), RegionId::new("eu").unwrap())
            .await
            .unwrap());
        assert_eq!(c.view().tenant_home(&t).map(RegionId::as_str), Some("eu"));
        assert!(c.unpin(t.clone()).await.unwrap());
        assert!(!c.unpin(t).await.unwrap());
    }

    #[test]
    fn an_expired_lease_falls_back_to_the_floor() {
        let g = Grant {
            share_ppm: 600_000,
            floor_ppm: 100_000,
            lease_expires_ms: 0,
        };
        let view = ClusterView {
            lease_end_local_ms: 1_000,
            ..ClusterView::default()
        };
        assert_eq!(view.enforced_share_ppm(Some(&g), 999), 600_000);
        assert_eq!(view.enforced_share_ppm(Some(&g), 1_000), 100_000);
        assert_eq!(view.enforced_share_ppm(None, 0), 0);
    }
}
