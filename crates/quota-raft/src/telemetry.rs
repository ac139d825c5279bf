//! Raft metrics exported to the `metrics` facade as gauges.
//!
//! Labels are only `node` and `region` (and `peer` for replication lag): few distinct values,
//! never a tenant.

use metrics::gauge;
use openraft::ServerState;
use tokio::task::JoinHandle;

use crate::types::alias::{Raft, RaftMetrics};
use crate::types::NodeId;

/// Metric names, in one place so dashboards and code agree.
pub mod names {
    /// The current Raft term.
    pub const RAFT_TERM: &str = "quotad_raft_term";
    /// The id of the leader this node knows of; absent leader = 0.
    pub const RAFT_LEADER_ID: &str = "quotad_raft_leader_id";
    /// 1 on the leader, 0 elsewhere.
    pub const RAFT_IS_LEADER: &str = "quotad_raft_is_leader";
    /// Index of the last applied log entry.
    pub const RAFT_LAST_APPLIED_INDEX: &str = "quotad_raft_last_applied_index";
    /// Index of the last log entry.
    pub const RAFT_LAST_LOG_INDEX: &str = "quotad_raft_last_log_index";
    /// On the leader, per peer: entries the peer is behind the leader's log.
    pub const RAFT_REPLICATION_LAG_ENTRIES: &str = "quotad_raft_replication_lag_entries";
    /// 1 once Raft stopped with a fatal error; the process should exit.
    pub const RAFT_FATAL: &str = "quotad_raft_fatal";
}

/// Spawns a task that mirrors `raft`'s metrics into gauges until Raft shuts down.
pub fn spawn_exporter(raft: &Raft, node_id: NodeId, region: String) -> JoinHandle<()> {
    let mut rx = raft.metrics();
    tokio::spawn(async move {
        let node = node_id.to_string();
        loop {
            // Clone out of the watch: holding borrow() across work blocks RaftCore.
            let m = rx.borrow_and_update().clone();
            export(&m, &node, &region);
            if rx.changed().await.is_err() {
                return;
            }
        }
    })
}

fn export(m: &RaftMetrics, node: &str, region: &str) {
    let labels = [("node", node.to_string()), ("region", region.to_string())];
    gauge!(names::RAFT_TERM, &labels).set(m.current_term as f64);
    gauge!(names::RAFT_LEADER_ID, &labels).set(m.current_leader.unwrap_or(0) as f64);
    let leader = m.state == ServerState::Leader;
    gauge!(names::RAFT_IS_LEADER, &labels).set(if leader { 1.0 } else { 0.0 });
    gauge!(names::RAFT_LAST_APPLIED_INDEX, &labels)
        .set(m.last_applied.map_or(0, |l| l.index) as f64);
    gauge!(names::RAFT_LAST_LOG_INDEX, &labels).set(m.last_log_index.unwrap_or(0) as f64);
    gauge!(names::RAFT_FATAL, &labels).set(if m.running_state.is_err() { 1.0 } else { 0.0 });
    if let Some(replication) = &m.replication {
        let last = m.last_log_index.unwrap_or(0);
        for (peer, matched) in replication {
            let lag = last.saturating_sub(matched.map_or(0, |l| l.index));
            let peer_labels = [
                ("node", node.to_string()),
                ("region", region.to_string()),
                ("peer", peer.to_string()),
            ];
            gauge!(names::RAFT_REPLICATION_LAG_ENTRIES, &peer_labels).set(lag as f64);
        }
    }
}
