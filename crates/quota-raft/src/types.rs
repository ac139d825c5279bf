//! The openraft type configuration: what the log carries and who the members are.

use std::fmt;

use quota_core::coordinator::{Command, Response};
use serde::{Deserialize, Serialize};

use crate::runtime::SeededRuntime;

/// A node id: unique across the cluster and stable for the life of a node's data directory.
pub type NodeId = u64;

/// What applying one log entry returns: the command's [`Response`], or `None` for entries that
/// carry no command (openraft's blank and membership entries), so quota-core never has to invent
/// a response for them.
pub type Reply = Option<Response>;

openraft::declare_raft_types!(
    /// The type configuration of the coordinator's Raft group.
    pub TypeConfig:
        D = Command,
        R = Reply,
        NodeId = NodeId,
        Node = Member,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Vec<u8>,
        AsyncRuntime = SeededRuntime,
);

/// A cluster member as recorded in the Raft membership: enough to reach it and to label it.
///
/// The region is a plain string (validated as a [`quota_core::RegionId`] by
/// [`crate::RaftConfig::validate`]) because openraft requires `Node: Default`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Member {
    /// The region this node runs in.
    pub region: String,
    /// `host:port` of the node's peer (Raft) listener.
    pub peer_addr: String,
    /// `host:port` of the node's admin API, so clients can be pointed at the leader.
    pub admin_addr: String,
}

impl fmt::Display for Member {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.region, self.peer_addr)
    }
}

/// openraft types specialised to [`TypeConfig`].
pub mod alias {
    use super::{Member, NodeId, TypeConfig};

    pub type Raft = openraft::Raft<TypeConfig>;
    pub type Entry = openraft::Entry<TypeConfig>;
    pub type LogId = openraft::LogId<NodeId>;
    pub type Vote = openraft::Vote<NodeId>;
    pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, Member>;
    pub type Snapshot = openraft::Snapshot<TypeConfig>;
    pub type StoredMembership = openraft::StoredMembership<NodeId, Member>;
    pub type StorageError = openraft::StorageError<NodeId>;
    pub type RaftMetrics = openraft::RaftMetrics<NodeId, Member>;
}
