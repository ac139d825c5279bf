//! PLACEHOLDER — the coordinator state machine (issue 3). The names `CoordinatorState`,
//! `Command`, `Response` and `CoordinatorState::apply` are fixed; the contents are not.

use serde::{Deserialize, Serialize};

use crate::ids::{PolicyName, TenantId};
use crate::policy::Policy;

/// Replicated coordinator state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordinatorState {
    pub policies: std::collections::BTreeMap<(TenantId, PolicyName), Policy>,
}

/// A replicated command, stamped by the leader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    PutPolicy { now_ms: u64, tenant: TenantId, policy: PolicyName, spec: Policy },
}

/// The answer to a command. Business rejections are responses, never errors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    Ok,
}

impl CoordinatorState {
    /// Applies one command. Pure: never reads a clock.
    pub fn apply(&mut self, cmd: &Command) -> Response {
        match cmd {
            Command::PutPolicy { tenant, policy, spec, .. } => {
                self.policies.insert((tenant.clone(), policy.clone()), spec.clone());
                Response::Ok
            }
        }
    }
}
