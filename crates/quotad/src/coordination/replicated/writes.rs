//! Policy, pin and membership commands: each one Raft write, the view rebuilt on success.

use quota_core::coordinator::{InvalidEntry, Operation, PinSource, PolicyKey, Response};
use quota_core::{Policy, PolicyName, RegionId, TenantId};
use quota_raft::Member;

use super::{unavailable, Replicated};
use crate::coordination::mutation::{CoordError, PolicyPut, Removal};

impl Replicated {
    pub async fn put_policy(
        &self,
        tenant: TenantId,
        name: PolicyName,
        policy: Policy,
    ) -> Result<Policy, CoordError> {
        let key = PolicyKey::new(tenant, name);
        match self
            .write(Operation::PutPolicy {
                key,
                policy: policy.clone(),
            })
            .await?
        {
            Response::PolicyStored { version, .. } => {
                self.rebuild_view();
                Ok(Policy { version, ..policy })
            }
            // The coordinator's own rules beyond the API's (a floor the regions cannot all
            // reserve): the caller's mistake, named like a batch's.
            Response::InvalidPolicy { fields } => Err(CoordError::InvalidPolicies {
                entries: vec![InvalidEntry { index: 0, fields }],
                total: 1,
            }),
            Response::FloorsExceedBudget { .. } => Err(CoordError::InvalidPolicies {
                entries: vec![InvalidEntry {
                    index: 0,
                    fields: vec!["floor".into()],
                }],
                total: 1,
            }),
            other => Err(unavailable(format!("unexpected answer {other:?}"))),
        }
    }

    /// Stores `batch` as one replicated command: all or none, consecutive versions in order.
    pub async fn put_policies(&self, batch: Vec<PolicyPut>) -> Result<Vec<Policy>, CoordError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let mut policies = Vec::with_capacity(batch.len());
        let entries = batch
            .into_iter()
            .map(|(tenant, name, policy)| {
                policies.push(policy.clone());
                (PolicyKey::new(tenant, name), policy)
            })
            .collect();
        match self.write(Operation::PutPolicies { entries }).await? {
            Response::PoliciesStored { versions, .. } => {
                self.rebuild_view();
                for (version, policy) in versions.into_iter().zip(&mut policies) {
                    policy.version = version;
                }
                Ok(policies)
            }
            Response::InvalidPolicies { entries, total } => {
                Err(CoordError::InvalidPolicies { entries, total })
            }
            Response::BatchTooLarge { max } => Err(CoordError::Rejected {
                message: format!("a batch holds at most {max} policies"),
            }),
            other => Err(unavailable(format!("unexpected answer {other:?}"))),
        }
    }

    pub async fn delete_policy(
        &self,
        tenant: TenantId,
        name: PolicyName,
    ) -> Result<bool, CoordError> {
        let key = PolicyKey::new(tenant, name);
        let r = self.write(Operation::DeletePolicy { key }).await?;
        self.rebuild_view();
        Ok(matches!(r, Response::PolicyDeleted { .. }))
    }

    /// Pins `tenant` to `home` in one command: its live policies now, and any put later.
    pub async fn pin(&self, tenant: TenantId, home: RegionId) -> Result<(), CoordError> {
        if !self.regions.contains(&home) {
            return Err(CoordError::UnknownRegion { region: home });
        }
        match self.write(Operation::PinTenant { tenant, home }).await? {
            Response::TenantPinned { .. } => {
                self.rebuild_view();
                Ok(())
            }
            // Configured but not registered yet (the leader adds regions on its first round).
            Response::UnknownRegion { region } => Err(CoordError::UnknownRegion { region }),
            other => Err(unavailable(format!("unexpected answer {other:?}"))),
        }
    }

    /// Removes `tenant`'s pin and its policies' operator pins in one command; `false` if the
    /// tenant was not pinned.
    pub async fn unpin(&self, tenant: TenantId) -> Result<bool, CoordError> {
        match self.write(Operation::UnpinTenant { tenant }).await? {
            Response::TenantUnpinned { .. } => {
                self.rebuild_view();
                Ok(true)
            }
            Response::TenantNotPinned => Ok(false),
            other => Err(unavailable(format!("unexpected answer {other:?}"))),
        }
    }

    /// Adds a learner and registers its region, so the allocator may give it share once it
    /// holds a lease.
    pub async fn add_member(&self, node_id: u64, member: Member) -> Result<(), CoordError> {
        let region = RegionId::new(member.region.as_str()).map_err(|e| CoordError::Rejected {
            message: e.to_string(),
        })?;
        self.raft
            .add_learner(node_id, member)
            .await
            .map_err(membership_error)?;
        self.write(Operation::PutRegion {
            region,
            reserves_floor: true,
            draining: false,
        })
        .await?;
        Ok(())
    }

    /// Promotes a learner to voter.
    pub async fn promote_member(&self, node_id: u64) -> Result<(), CoordError> {
        self.raft.promote(node_id).await.map_err(membership_error)
    }

    /// Starts removing a member (on the leader): its region drains (`PutRegion { draining }`:
    /// no floor guaranteed any more, the allocator moves everything it holds to the others,
    /// revoke before grant), and once it enforces nothing the leader's round removes the Raft
    /// node and then the region ([`Replicated::finish_removals`]). A region an operator pinned
    /// tenants or policies to is refused: unpin them first.
    pub async fn remove_member(&self, node_id: u64) -> Result<Removal, CoordError> {
        let status = self.raft.status();
        let member = status
            .members
            .get(&node_id)
            .ok_or(CoordError::UnknownNode { node_id })?;
        if !self.raft.is_leader() {
            return Err(CoordError::NotLeader {
                leader: status.leader_id,
            });
        }
        let region = RegionId::new(member.region.as_str()).map_err(|e| CoordError::Rejected {
            message: e.to_string(),
        })?;
        // One daemon of a region that keeps others: the region stays, only the member goes.
        // Its lease record counts until its lease ends (it may still be running).
        if status
            .members
            .iter()
            .any(|(id, m)| *id != node_id && m.region == member.region)
        {
            self.raft.remove(node_id).await.map_err(membership_error)?;
            tracing::info!(%region, node_id, "Removed one daemon of the region.");
            return Ok(Removal::Removed);
        }
        let found = self.raft.read(|s| {
            let index = s.region_index(&region)?;
            let pinned = s.tenant_pins.values().any(|&h| h == index)
                || s.entries.values().any(|e| {
                    e.pin
                        .is_some_and(|p| p.home == index && p.source == PinSource::Operator)
                });
            Some((s.region(usize::from(index))?.reserves_floor, pinned))
        });
        let Some((reserves_floor, pinned)) = found else {
            self.raft.remove(node_id).await.map_err(membership_error)?;
            return Ok(Removal::Removed);
        };
        if pinned {
            return Err(CoordError::Rejected {
                message: format!(
                    "tenants or policies are pinned to region {region}: unpin them first"
                ),
            });
        }
        match self
            .write(Operation::PutRegion {
                region: region.clone(),
                reserves_floor,
                draining: true,
            })
            .await?
        {
            Response::RegionStored { .. } => {
                tracing::info!(%region, node_id, "Region draining: its shares and floors go to the others, then it leaves.");
                self.rebuild_view();
                Ok(Removal::Draining)
            }
            other => Err(unavailable(format!("unexpected answer {other:?}"))),
        }
    }
}

fn membership_error(e: quota_raft::MembershipError) -> CoordError {
    use quota_raft::MembershipError as M;
    match e {
        M::NotLeader { leader_id } => CoordError::NotLeader { leader: leader_id },
        M::Rejected { message } => CoordError::Rejected { message },
        M::UnknownNode { node_id } => CoordError::UnknownNode { node_id },
        other => unavailable(other),
    }
}
