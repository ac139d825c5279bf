//! The single-region coordinator: one node, no Raft, its state in `<data_dir>/local.redb`
//! ([`crate::coordination::local_store`]).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use quota_core::coordinator::{InvalidEntry, MAX_BATCH_ASSIGNMENTS, MAX_LISTED_INVALID};
use quota_core::mode::BudgetMode;
use quota_core::{PlanName, Policy, PolicyName, RegionId, TenantId, PPM};
use tokio::sync::watch;

use crate::coordination::local_store::{LocalStore, LocalStoreError};
use crate::coordination::mutation::{CoordError, PlanAssignment, PolicyPut};
use crate::coordination::status::{CoordinatorStatus, MemberStatus};
use crate::coordination::view::{tenant_keys, ClusterView, Grant, PolicyEntry, PolicyMap};

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

impl LocalCoordinator {
    /// A receiver of view snapshots; changes wake `changed()`.
    pub fn subscribe(&self) -> watch::Receiver<Arc<ClusterView>> {
        self.tx.subscribe()
    }

    /// The current view.
    pub fn view(&self) -> Arc<ClusterView> {
        self.tx.borrow().clone()
    }

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
            plan_assignments: loaded.assignments.into_iter().collect(),
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
            // One region holds every budget whole.
            mode: BudgetMode::Split,
        }
    }

    /// Runs `f` under the lock: it writes to the store first and then changes the view; on
    /// success the new view is published.
    fn mutate<T>(
        &self,
        f: impl FnOnce(&mut ClusterView) -> Result<T, LocalStoreError>,
    ) -> Result<T, CoordError> {
        self.try_mutate(|view| f(view).map_err(|e| write_failed(&e)))
    }

    /// As [`Self::mutate`], for a change `f` may refuse after looking at the view under the
    /// lock; a refusal changes and publishes nothing.
    fn try_mutate<T>(
        &self,
        f: impl FnOnce(&mut ClusterView) -> Result<T, CoordError>,
    ) -> Result<T, CoordError> {
        let mut view = self.view.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(&mut view)?;
        view.epoch += 1;
        self.tx.send_replace(Arc::new(view.clone()));
        Ok(out)
    }

    /// Stores `batch` in one transaction, with consecutive versions in order. An entry equal
    /// to the live policy (all but the version) keeps its version and is not written, so its
    /// bucket keeps its tokens; a batch of such entries only is no change at all.
    pub fn put_policies(&self, mut batch: Vec<PolicyPut>) -> Result<Vec<Policy>, CoordError> {
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
                    live => {
                        policy.replaces = live.map(|p| p.version);
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

    pub fn delete_policy(&self, tenant: &TenantId, name: &PolicyName) -> Result<bool, CoordError> {
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

    pub fn pin(&self, tenant: &TenantId, region: RegionId) -> Result<(), CoordError> {
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

    pub fn unpin(&self, tenant: &TenantId) -> Result<bool, CoordError> {
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

    /// Replaces a plan's policies in one transaction: changed ones get new versions, equal
    /// ones keep theirs, ones the plan no longer holds go.
    pub fn put_plan(
        &self,
        plan: &PlanName,
        mut policies: Vec<(PolicyName, Policy)>,
    ) -> Result<Vec<Policy>, CoordError> {
        let mut names: Vec<&PolicyName> = policies.iter().map(|(n, _)| n).collect();
        names.sort();
        names.dedup();
        if policies.is_empty() || names.len() != policies.len() {
            return Err(CoordError::InvalidPlan {
                field: "policies".into(),
            });
        }
        let class = TenantId::for_plan(plan);
        self.mutate(|s| {
            let gone: Vec<(TenantId, PolicyName)> = s
                .plan_policies(plan)
                .filter(|(n, _)| !policies.iter().any(|(m, _)| m == *n))
                .map(|(n, _)| (class.clone(), n.clone()))
                .collect();
            let mut version = s.last_version;
            let mut changed = Vec::new();
            for (name, policy) in &mut policies {
                match s.policy(&class, name).map(|e| &e.policy) {
                    Some(p) if p.same_terms(policy) => policy.version = p.version,
                    _ => {
                        version += 1;
                        policy.version = version;
                        changed.push((&class, &*name, &*policy));
                    }
                }
            }
            self.store.replace_policies(&changed, &gone, version)?;
            s.last_version = version;
            for key in gone {
                s.policies.remove(&key);
            }
            for (name, policy) in &policies {
                let entry = Self::entry(&self.region, policy.clone(), None);
                s.policies.insert((class.clone(), name.clone()), entry);
            }
            Ok(policies.into_iter().map(|(_, p)| p).collect())
        })
    }

    /// Deletes a plan's policies; `false` if it had none.
    pub fn delete_plan(&self, plan: &PlanName) -> Result<bool, CoordError> {
        let class = TenantId::for_plan(plan);
        self.mutate(|s| {
            let gone: Vec<(TenantId, PolicyName)> = s
                .plan_policies(plan)
                .map(|(n, _)| (class.clone(), n.clone()))
                .collect();
            if gone.is_empty() {
                return Ok(false);
            }
            self.store.replace_policies(&[], &gone, s.last_version)?;
            for key in gone {
                s.policies.remove(&key);
            }
            Ok(true)
        })
    }

    /// Assigns a tenant to an existing plan.
    pub fn assign_plan(&self, tenant: &TenantId, plan: &PlanName) -> Result<(), CoordError> {
        if tenant.reserved().is_some() {
            return Err(CoordError::InvalidPlan {
                field: "tenant".into(),
            });
        }
        if self.view().plan_policies(plan).next().is_none() {
            return Err(CoordError::UnknownPlan);
        }
        self.mutate(|s| {
            self.store.put_assignment(tenant, Some(plan))?;
            s.plan_assignments.insert(tenant.clone(), plan.clone());
            Ok(())
        })
    }

    /// Removes a tenant's plan assignment; `false` if it had none.
    pub fn unassign_plan(&self, tenant: &TenantId) -> Result<bool, CoordError> {
        if !self.view().plan_assignments.contains_key(tenant) {
            return Ok(false);
        }
        self.mutate(|s| {
            self.store.put_assignment(tenant, None)?;
            s.plan_assignments.remove(tenant);
            Ok(true)
        })
    }

    /// Assigns or unassigns `batch` in one transaction, all or none, refusing it as the
    /// replicated coordinator does (a reserved tenant, a plan that does not exist).
    pub fn assign_plans(&self, batch: &[PlanAssignment]) -> Result<(), CoordError> {
        if batch.len() > MAX_BATCH_ASSIGNMENTS {
            return Err(CoordError::Rejected {
                message: format!("a batch holds at most {MAX_BATCH_ASSIGNMENTS} assignments"),
            });
        }
        if batch.is_empty() {
            return Ok(());
        }
        // Checked under the lock the write takes, so no plan goes in between.
        self.try_mutate(|s| {
            let mut entries = Vec::new();
            let mut total = 0;
            for (index, (tenant, plan)) in batch.iter().enumerate() {
                let mut fields = Vec::new();
                if tenant.reserved().is_some() {
                    fields.push("tenant".to_string());
                }
                if plan
                    .as_ref()
                    .is_some_and(|p| s.plan_policies(p).next().is_none())
                {
                    fields.push("plan".to_string());
                }
                if !fields.is_empty() {
                    total += 1;
                    if entries.len() < MAX_LISTED_INVALID {
                        entries.push(InvalidEntry {
                            index: index as u32,
                            fields,
                        });
                    }
                }
            }
            if total > 0 {
                return Err(CoordError::InvalidAssignments { entries, total });
            }
            let entries: Vec<_> = batch.iter().map(|(t, p)| (t, p.as_ref())).collect();
            self.store
                .put_assignments(&entries)
                .map_err(|e| write_failed(&e))?;
            for (tenant, plan) in batch {
                match plan {
                    Some(plan) => {
                        s.plan_assignments.insert(tenant.clone(), plan.clone());
                    }
                    None => {
                        s.plan_assignments.remove(tenant);
                    }
                }
            }
            Ok(())
        })
    }

    pub fn status(&self) -> CoordinatorStatus {
        let applied_index = self.view.lock().unwrap_or_else(|e| e.into_inner()).epoch;
        CoordinatorStatus {
            role: "single",
            leader: Some(self.region.clone()),
            leader_node: Some(1),
            node_id: 1,
            term: 0,
            applied_index,
            members: vec![MemberStatus {
                region: self.region.clone(),
                node_id: 1,
                voter: true,
                agent: true,
            }],
        }
    }
}

/// A failed write of the state file: logged, and the mutation unavailable.
fn write_failed(e: &LocalStoreError) -> CoordError {
    tracing::error!(error = %e, "Writing the single-region coordinator state failed.");
    CoordError::Unavailable {
        reason: e.to_string(),
    }
}
