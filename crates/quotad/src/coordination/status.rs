//! The coordinator's role, progress and members, as /v1/status shows them.

use quota_core::RegionId;
use serde::Serialize;

/// The coordinator's role and progress, for /v1/status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CoordinatorStatus {
    /// `leader`, `follower`, `candidate`, `learner` or `single` (one-node, no Raft).
    pub role: &'static str,
    pub leader: Option<RegionId>,
    /// The leader's node id (several daemons may serve one region).
    pub leader_node: Option<u64>,
    /// This daemon's node id.
    pub node_id: u64,
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
    /// Whether it holds its region's agent role (writes the region's store, reports usage).
    pub agent: bool,
}
