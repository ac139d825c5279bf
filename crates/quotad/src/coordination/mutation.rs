//! What a mutation takes and why one did not commit, for either coordinator.

use quota_core::coordinator::InvalidEntry;
use quota_core::{PlanName, Policy, PolicyName, RegionId, TenantId};

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
    /// An assignment to a plan that does not exist.
    #[error("no such plan")]
    UnknownPlan,
    /// Assignments the coordinator refused (a reserved tenant, a plan that does not exist), by
    /// their place in the request (the first ones of `total`); nothing changed.
    #[error("{total} assignments refused: {entries:?}")]
    InvalidAssignments {
        entries: Vec<InvalidEntry>,
        total: u32,
    },
    /// A plan command the coordinator refused, naming the field.
    #[error("{field}: refused by the coordinator")]
    InvalidPlan { field: String },
}

/// Where the removal of a member stands once the request is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// Its region is draining: the leader's rounds move its shares and floors to the others
    /// (revoke before grant), then remove the region and the Raft node.
    Draining,
    /// Its region had left the coordinator's state already; the Raft node is gone now.
    Removed,
}

/// One policy of a batch: whose, which, and what.
pub type PolicyPut = (TenantId, PolicyName, Policy);

/// One entry of an assignment batch: a tenant and its plan (`None`: no plan).
pub type PlanAssignment = (TenantId, Option<PlanName>);
