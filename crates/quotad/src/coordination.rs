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

use crate::clock;

/// One region's grant for a tenant's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Grant {
    pub share_ppm: u32,
    /// Wall-clock ms at which the coordinator's lease for this share ends; `u64::MAX` = never.
    pub lease_expires_ms: u64,
    pub epoch: u64,
}

/// A tenant's policy with every region's grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyEntry {
    pub policy: Policy,
    pub grants: BTreeMap<RegionId, Grant>,
}

/// An immutable snapshot of coordinator state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterView {
    pub policies: BTreeMap<(TenantId, PolicyName), PolicyEntry>,
    pub pins: BTreeMap<TenantId, RegionId>,
    /// Bumped on every committed change.
    pub epoch: u64,
}

impl ClusterView {
    /// A tenant's policy, if any.
    pub fn policy(&self, tenant: &TenantId, policy: &PolicyName) -> Option<&PolicyEntry> {
        // BTreeMap lookups need an owned key; ids are short, and this avoids a second map.
        self.policies.get(&(tenant.clone(), policy.clone()))
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
}

/// The coordinator behind the daemon.
#[derive(Debug)]
pub enum Coordinator {
    Local(LocalCoordinator),
}

impl Coordinator {
    /// A receiver of view snapshots; changes wake `changed()`.
    pub fn subscribe(&self) -> watch::Receiver<Arc<ClusterView>> {
        match self {
            Coordinator::Local(c) => c.tx.subscribe(),
        }
    }

    /// The current view.
    pub fn view(&self) -> Arc<ClusterView> {
        match self {
            Coordinator::Local(c) => c.tx.borrow().clone(),
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
        }
    }

    /// Pins a tenant to a home region.
    pub async fn pin(&self, tenant: TenantId, region: RegionId) -> Result<(), CoordError> {
        match self {
            Coordinator::Local(c) => c.pin(tenant, region),
        }
    }

    /// Removes a pin; `false` if there was none.
    pub async fn unpin(&self, tenant: TenantId) -> Result<bool, CoordError> {
        match self {
            Coordinator::Local(c) => Ok(c.unpin(&tenant)),
        }
    }

    /// Role, leader, term and members.
    pub fn status(&self) -> CoordinatorStatus {
        match self {
            Coordinator::Local(c) => c.status(),
        }
    }

    /// This daemon's region.
    pub fn region(&self) -> &RegionId {
        match self {
            Coordinator::Local(c) => &c.region,
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
        let (tx, _) = watch::channel(Arc::new(ClusterView::default()));
        Self {
            region,
            state: Mutex::new(ClusterView::default()),
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
            policy.version = s.policies.get(&key).map_or(1, |e| e.policy.version + 1);
            let grant = Grant {
                share_ppm: PPM,
                lease_expires_ms: u64::MAX,
                epoch: s.epoch + 1,
            };
            let entry = PolicyEntry {
                policy: policy.clone(),
                grants: BTreeMap::from([(region, grant)]),
            };
            s.policies.insert(key, entry);
            policy
        })
    }

    fn delete_policy(&self, tenant: &TenantId, name: &PolicyName) -> bool {
        let key = (tenant.clone(), name.clone());
        self.mutate(|s| s.policies.remove(&key).is_some())
    }

    fn pin(&self, tenant: TenantId, region: RegionId) -> Result<(), CoordError> {
        if region != self.region {
            return Err(CoordError::UnknownRegion { region });
        }
        self.mutate(|s| s.pins.insert(tenant, region));
        Ok(())
    }

    fn unpin(&self, tenant: &TenantId) -> bool {
        self.mutate(|s| s.pins.remove(tenant).is_some())
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

/// The share this region enforces for a grant right now: the granted share while its lease
/// (shortened by the drift margin) runs, the policy's floor after.
pub fn enforced_share_ppm(policy: &Policy, grant: Option<&Grant>, drift_margin_ms: u64) -> u32 {
    let now_ms = clock::wall_ms();
    match grant {
        Some(g) if now_ms.saturating_add(drift_margin_ms) < g.lease_expires_ms => g.share_ppm,
        _ => policy.floor_ppm,
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
        let (t, _) = ids();
        let err = c
            .pin(t.clone(), RegionId::new("us").unwrap())
            .await
            .unwrap_err();
        assert!(matches!(err, CoordError::UnknownRegion { .. }));
        c.pin(t.clone(), RegionId::new("eu").unwrap())
            .await
            .unwrap();
        assert!(c.view().pins.contains_key(&t));
        assert!(c.unpin(t).await.unwrap());
    }

    #[test]
    fn an_expired_lease_falls_back_to_the_floor() {
        let p = policy();
        let live = Grant {
            share_ppm: 600_000,
            lease_expires_ms: u64::MAX,
            epoch: 1,
        };
        let dead = Grant {
            share_ppm: 600_000,
            lease_expires_ms: 1,
            epoch: 1,
        };
        assert_eq!(enforced_share_ppm(&p, Some(&live), 1000), 600_000);
        assert_eq!(enforced_share_ppm(&p, Some(&dead), 1000), 100_000);
        assert_eq!(enforced_share_ppm(&p, None, 1000), 100_000);
    }
}
