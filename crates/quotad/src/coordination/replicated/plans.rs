//! Plan commands: each one Raft write (a plan change reaches every assigned tenant in it), the
//! view rebuilt on success.

use quota_core::coordinator::{Operation, Response};
use quota_core::{PlanName, Policy, PolicyName, TenantId};

use super::{unavailable, Replicated};
use crate::coordination::mutation::{CoordError, PlanAssignment};

impl Replicated {
    /// Creates or replaces a plan; returns its policies with their versions, in order.
    pub async fn put_plan(
        &self,
        plan: PlanName,
        policies: Vec<(PolicyName, Policy)>,
    ) -> Result<Vec<Policy>, CoordError> {
        let mut stored: Vec<Policy> = policies.iter().map(|(_, p)| p.clone()).collect();
        match self.write(Operation::PutPlan { plan, policies }).await? {
            Response::PlanStored { versions, .. } => {
                self.rebuild_view();
                for (version, policy) in versions.into_iter().zip(&mut stored) {
                    policy.version = version;
                }
                Ok(stored)
            }
            Response::InvalidPolicies { entries, total } => {
                Err(CoordError::InvalidPolicies { entries, total })
            }
            Response::InvalidPlan { field } => Err(CoordError::InvalidPlan { field }),
            Response::BatchTooLarge { max } => Err(CoordError::Rejected {
                message: format!("a plan holds at most {max} policies"),
            }),
            other => Err(unavailable(format!("unexpected answer {other:?}"))),
        }
    }

    /// Deletes a plan and its policies; `false` if there was none.
    pub async fn delete_plan(&self, plan: PlanName) -> Result<bool, CoordError> {
        let r = self.write(Operation::DeletePlan { plan }).await?;
        self.rebuild_view();
        Ok(matches!(r, Response::PlanDeleted { .. }))
    }

    /// Assigns `tenant` to an existing plan.
    pub async fn assign_plan(&self, tenant: TenantId, plan: PlanName) -> Result<(), CoordError> {
        match self.write(Operation::AssignPlan { tenant, plan }).await? {
            Response::PlanAssigned => {
                self.rebuild_view();
                Ok(())
            }
            Response::UnknownPlan => Err(CoordError::UnknownPlan),
            Response::InvalidPlan { field } => Err(CoordError::InvalidPlan { field }),
            other => Err(unavailable(format!("unexpected answer {other:?}"))),
        }
    }

    /// Removes `tenant`'s plan assignment; `false` if it had none.
    pub async fn unassign_plan(&self, tenant: TenantId) -> Result<bool, CoordError> {
        match self.write(Operation::UnassignPlan { tenant }).await? {
            Response::PlanUnassigned => {
                self.rebuild_view();
                Ok(true)
            }
            Response::TenantHasNoPlan => Ok(false),
            other => Err(unavailable(format!("unexpected answer {other:?}"))),
        }
    }

    /// Assigns or unassigns `batch` as one replicated command: all or none.
    pub async fn assign_plans(&self, batch: Vec<PlanAssignment>) -> Result<(), CoordError> {
        if batch.is_empty() {
            return Ok(());
        }
        match self
            .write(Operation::AssignPlans { assignments: batch })
            .await?
        {
            Response::PlansAssigned => {
                self.rebuild_view();
                Ok(())
            }
            Response::InvalidAssignments { entries, total } => {
                Err(CoordError::InvalidAssignments { entries, total })
            }
            Response::BatchTooLarge { max } => Err(CoordError::Rejected {
                message: format!("a batch holds at most {max} assignments"),
            }),
            other => Err(unavailable(format!("unexpected answer {other:?}"))),
        }
    }
}
