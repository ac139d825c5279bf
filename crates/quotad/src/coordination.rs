//! The daemon's view of the coordinator: policies, pins and each region's share with its lease.
//!
//! Handlers and the region agent read an immutable [`ClusterView`] snapshot (an `Arc` behind a
//! `watch` channel: one short read lock, never held across an await) and send mutations through
//! [`Coordinator`]: either [`LocalCoordinator`], a one-node coordinator for a single region
//! that keeps its state in `<data_dir>/local.redb` ([`crate::local_store`]), or the
//! Raft-backed [`Replicated`] one; the API and the decision path do not tell them apart.
//!
//! Pins are per tenant: a pinned tenant's policies, including ones created later, are decided
//! by its home region (other regions forward their checks there).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use quota_core::coordinator::InvalidEntry;
use quota_core::{Policy, PolicyName, RegionId, TenantId, PPM};
use serde::Serialize;
use tokio::sync::watch;

use crate::local_store::{LocalStore, LocalStoreError};
use crate::replicated::Replicated;

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
    /// of a `critical` policy).
    pub home: Option<RegionId>,
}

/// Every tenant's policies with their grants, in key order.
pub type PolicyMap = imbl::OrdMap<(TenantId, PolicyName), PolicyEntry>;

/// An immutable snapshot of coordinator state, as this region sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterView {
    /// A persistent map: views share it, and a new view after a change copies only the
    /// changed entries' paths (lease renewals change only `region_leases` and
    /// `lease_end_local_ms`, and share it whole).
    pub policies: PolicyMap,
    /// Pinned tenants and their home region.
    pub tenant_pins: Arc<BTreeMap<TenantId, RegionId>>,
    /// Coordinator time (wall-clock ms) each region's lease ends, for display; `u64::MAX` =
    /// never. Regions count their own lease, see [`ClusterView::lease_end_local_ms`].
    pub region_leases: BTreeMap<RegionId, u64>,
    /// Bumped on every committed change regions must apply.
    pub epoch: u64,
    /// Local wall-clock ms at which this region must stop enforcing more than its floors (its
    /// lease end minus the drift margin, counted by its own clock); `u64::MAX` = never.
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

    /// The share this region enforces for a grant at local time `now_ms`: the grant while the
    /// lease holds, the floor after.
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
    /// Policies the coordinator refused (e.g. a floor every region cannot reserve), by their
    /// place in the request (the first ones of `total`); nothing was stored.
    #[error("{total} policies refused: {entries:?}")]
    InvalidPolicies {
        entries: Vec<InvalidEntry>,
        total: u32,
    },
}

/// One policy of a batch: whose, which, and what.
pub type PolicyPut = (TenantId, PolicyName, Policy);

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
/// that never expires.
///
/// Every mutation is committed to its redb file before the in-memory view changes and before
/// the caller gets an answer; a failed write fails the mutation (`Unavailable`) and changes
/// nothing. Mutations are serialized by one lock, held across the write (they are rare).
#[derive(Debug)]
pub struct LocalCoordinator {
    region: RegionId,
    store: LocalStore,
    /// The view, whose `last_version` is the version counter: versions are never reused, so a
    /// re-put policy gets fresh Redis keys instead of a deleted one's bucket.
    view: Mutex<ClusterView>,
    tx: watch::Sender<Arc<ClusterView>>,
    /// Keeps a test's data directory alive as long as the coordinator.
    #[cfg(test)]
    _dir: Option<tempfile::TempDir>,
}

/// The keys of one tenant's policies.
fn tenant_keys(policies: &PolicyMap, tenant: &TenantId) -> Vec<(TenantId, PolicyName)> {
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

impl LocalCoordinator {
    /// Opens (or creates) `data_dir/local.redb` and publishes what it holds. Fails, naming the
    /// file, on anything it cannot read: starting empty would forget policies.
    pub fn open(region: RegionId, data_dir: &Path) -> Result<Self, LocalStoreError> {
        let (store, loaded) = LocalStore::open(data_dir)?;
        let mut policies = PolicyMap::new();
        for ((tenant, name), policy) in loaded.policies {
            let home = loaded.pins.get(&tenant).cloned();
            let entry = Self::entry(&region, policy, home);
            policies.insert((tenant, name), entry);
        }
        let view = ClusterView {
            lease_end_local_ms: u64::MAX,
            policies,
            tenant_pins: Arc::new(loaded.pins),
            region_leases: BTreeMap::from([(region.clone(), u64::MAX)]),
            last_version: loaded.last_version,
            ..ClusterView::default()
        };
        tracing::info!(
            path = %store.path().display(),
            policies = view.policies.len(),
            pins = view.tenant_pins.len(),
            last_version = loaded.last_version,
            "Single-region coordinator state loaded."
        );
        let (tx, _) = watch::channel(Arc::new(view.clone()));
        Ok(Self {
            region,
            store,
            view: Mutex::new(view),
            tx,
            #[cfg(test)]
            _dir: None,
        })
    }

    /// A coordinator on a fresh temporary directory, removed when it is dropped.
    #[cfg(test)]
    pub(crate) fn in_temp_dir(region: RegionId) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Self::open(region, dir.path()).unwrap();
        c._dir = Some(dir);
        c
    }

    fn entry(region: &RegionId, policy: Policy, home: Option<RegionId>) -> PolicyEntry {
        let grant = Grant {
            share_ppm: PPM,
            floor_ppm: policy.floor_ppm,
        };
        PolicyEntry {
            policy,
            grants: BTreeMap::from([(region.clone(), grant)]),
            home,
        }
    }

    /// Runs `f` under the lock: it writes to the store first and then changes the view; on
    /// success the new view is published.
    fn mutate<T>(
        &self,
        f: impl FnOnce(&mut ClusterView) -> Result<T, LocalStoreError>,
    ) -> Result<T, CoordError> {
        let mut view = self.view.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(&mut view).map_err(|e| {
            tracing::error!(error = %e, "Writing the single-region coordinator state failed.");
            CoordError::Unavailable {
                reason: e.to_string(),
            }
        })?;
        view.epoch += 1;
        self.tx.send_replace(Arc::new(view.clone()));
        Ok(out)
    }

    /// Stores `batch` in one transaction, with consecutive versions in order. An entry equal
    /// to the live policy (all but the version) keeps its version and is not written, so its
    /// bucket keeps its tokens; a batch of such entries only is no change at all.
    fn put_policies(&self, mut batch: Vec<PolicyPut>) -> Result<Vec<Policy>, CoordError> {
        {
            let view = self.view.lock().unwrap_or_else(|e| e.into_inner());
            let live = |t: &TenantId, n: &PolicyName, p: &Policy| {
                view.policy(t, n)
                    .map(|e| &e.policy)
                    .filter(|live| live.same_terms(p))
                    .map(|live| live.version)
            };
            if batch.iter().all(|(t, n, p)| live(t, n, p).is_some()) {
                for (t, n, p) in &mut batch {
                    p.version = live(t, n, p).unwrap_or_default();
                }
                return Ok(batch.into_iter().map(|(_, _, p)| p).collect());
            }
        }
        self.mutate(|s| {
            let mut version = s.last_version;
            let mut changed = Vec::with_capacity(batch.len());
            for (tenant, name, policy) in &mut batch {
                let key = (tenant.clone(), name.clone());
                match s.policies.get(&key).map(|e| &e.policy) {
                    Some(p) if p.same_terms(policy) => {
                        policy.version = p.version;
                    }
                    _ => {
                        version += 1;
                        policy.version = version;
                        changed.push((&*tenant, &*name, &*policy));
                    }
                }
            }
            self.store.put_policies(&changed, version)?;
            s.last_version = version;
            let mut stored = Vec::with_capacity(batch.len());
            for (tenant, name, policy) in batch {
                let home = s.tenant_pins.get(&tenant).cloned();
                let entry = Self::entry(&self.region, policy.clone(), home);
                s.policies.insert((tenant, name), entry);
                stored.push(policy);
            }
            Ok(stored)
        })
    }

    fn delete_policy(&self, tenant: &TenantId, name: &PolicyName) -> Result<bool, CoordError> {
        let key = (tenant.clone(), name.clone());
        self.mutate(|s| {
            if !s.policies.contains_key(&key) {
                return Ok(false);
            }
            self.store.delete_policy(tenant, name)?;
            s.policies.remove(&key);
            Ok(true)
        })
    }

    fn pin(&self, tenant: &TenantId, region: RegionId) -> Result<(), CoordError> {
        if region != self.region {
            return Err(CoordError::UnknownRegion { region });
        }
        self.mutate(|s| {
            self.store.put_pin(tenant, &region)?;
            Arc::make_mut(&mut s.tenant_pins).insert(tenant.clone(), region.clone());
            for key in tenant_keys(&s.policies, tenant) {
                if let Some(e) = s.policies.get_mut(&key) {
                    e.home = Some(region.clone());
                }
            }
            Ok(())
        })
    }

    fn unpin(&self, tenant: &TenantId) -> Result<bool, CoordError> {
        self.mutate(|s| {
            if !s.tenant_pins.contains_key(tenant) {
                return Ok(false);
            }
            self.store.delete_pin(tenant)?;
            Arc::make_mut(&mut s.tenant_pins).remove(tenant);
            for key in tenant_keys(&s.policies, tenant) {
                if let Some(e) = s.policies.get_mut(&key) {
                    e.home = None;
                }
            }
            Ok(true)
        })
    }

    fn status(&self) -> CoordinatorStatus {
        let applied_index = self.view.lock().unwrap_or_else(|e| e.into_inner()).epoch;
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
        let c = Coordinator::Local(LocalCoordinator::in_temp_dir(RegionId::new("eu").unwrap()));
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
            let c = Coordinator::Local(LocalCoordinator::open(eu.clone(), dir.path()).unwrap());
            c.put_policy(t.clone(), p.clone(), policy()).await.unwrap();
            c.put_policy(t.clone(), other.clone(), policy())
                .await
                .unwrap();
            c.pin(t.clone(), eu.clone()).await.unwrap();
            // Delete and re-put: a new version, never a reused one (fresh Redis keys).
            assert!(c.delete_policy(t.clone(), p.clone()).await.unwrap());
            let again = c.put_policy(t.clone(), p.clone(), policy()).await.unwrap();
            assert_eq!(again.version, 3);
            c.view()
        };
        let c = Coordinator::Local(LocalCoordinator::open(eu.clone(), dir.path()).unwrap());
        let after = c.view();
        assert_eq!(after.policies, before.policies);
        assert_eq!((before.last_version, after.last_version), (3, 3));
        assert_eq!(after.tenant_pins, before.tenant_pins);
        assert_eq!(after.tenant_home(&t), Some(&eu));
        assert_eq!(after.policy(&t, &p).unwrap().policy.version, 3);
        assert_eq!(after.policy(&t, &other).unwrap().home.as_ref(), Some(&eu));
        // The counter survived too: the next version is 4, even after deleting everything.
        assert!(c.delete_policy(t.clone(), p.clone()).await.unwrap());
        assert!(c.delete_policy(t.clone(), other.clone()).await.unwrap());
        drop(c);
        let c = Coordinator::Local(LocalCoordinator::open(eu.clone(), dir.path()).unwrap());
        assert!(c.view().policies.is_empty());
        let v = c.put_policy(t.clone(), p, policy()).await.unwrap();
        assert_eq!(v.version, 4);
        // An unpin is durable as well.
        assert!(c.unpin(t.clone()).await.unwrap());
        drop(c);
        let c = Coordinator::Local(LocalCoordinator::open(eu, dir.path()).unwrap());
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
            let c = Coordinator::Local(LocalCoordinator::open(eu.clone(), dir.path()).unwrap());
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
        let c = Coordinator::Local(LocalCoordinator::open(eu, dir.path()).unwrap());
        assert_eq!(c.view().policies, before.policies);
        assert_eq!(c.view().last_version, 51);
        assert_eq!(c.put_policy(t, p, policy()).await.unwrap().version, 52);
    }

    #[test]
    fn a_file_that_is_not_a_store_fails_start_up_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(crate::local_store::DB_FILE);
        std::fs::write(&path, b"this is not a redb file, and never was one").unwrap();
        let err = LocalCoordinator::open(RegionId::new("eu").unwrap(), dir.path()).unwrap_err();
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
    }

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
}
