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
    /// TLS handshakes the peer listener refused (plain HTTP, another CA, an expired or missing
    /// client certificate).
    pub const PEER_TLS_HANDSHAKE_FAILURES_TOTAL: &str = "quotad_peer_tls_handshake_failures_total";
    /// Peer requests refused because the connection's certificate names no member, or another
    /// region than the request claims, by `route`.
    pub const PEER_IDENTITY_REFUSED_TOTAL: &str = "quotad_peer_identity_refused_total";
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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use metrics::{
        Counter, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };

    use super::*;

    type Seen = Arc<Mutex<Vec<(String, Vec<(String, String)>, f64)>>>;

    #[derive(Default)]
    struct Capture(Seen);

    struct Cell(Seen, String, Vec<(String, String)>);

    impl GaugeFn for Cell {
        fn increment(&self, _: f64) {}
        fn decrement(&self, _: f64) {}
        fn set(&self, value: f64) {
            self.0
                .lock()
                .unwrap()
                .push((self.1.clone(), self.2.clone(), value));
        }
    }

    impl Recorder for Capture {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::noop()
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            let labels = key
                .labels()
                .map(|l| (l.key().to_string(), l.value().to_string()))
                .collect();
            Gauge::from_arc(Arc::new(Cell(
                self.0.clone(),
                key.name().to_string(),
                labels,
            )))
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    #[test]
    fn exports_term_leader_applied_and_lag_with_node_and_region_labels_only() {
        let mut m = RaftMetrics::new_initial(2);
        m.current_term = 7;
        m.current_leader = Some(2);
        m.state = ServerState::Leader;
        m.last_log_index = Some(10);
        m.last_applied = Some(openraft::LogId::new(
            openraft::CommittedLeaderId::new(7, 2),
            9,
        ));
        m.replication = Some(
            [
                (1, None),
                (
                    3,
                    Some(openraft::LogId::new(
                        openraft::CommittedLeaderId::new(7, 2),
                        8,
                    )),
                ),
            ]
            .into(),
        );
        let capture = Capture::default();
        metrics::with_local_recorder(&capture, || export(&m, "2", "eu"));
        let seen = capture.0.lock().unwrap().clone();
        let value = |name: &str, peer: Option<&str>| {
            seen.iter()
                .find(|(n, l, _)| {
                    n == name
                        && l.iter()
                            .any(|(k, v)| k == "peer" && Some(v.as_str()) == peer)
                            == peer.is_some()
                })
                .map(|(_, _, v)| *v)
        };
        assert_eq!(value(names::RAFT_TERM, None), Some(7.0));
        assert_eq!(value(names::RAFT_LEADER_ID, None), Some(2.0));
        assert_eq!(value(names::RAFT_IS_LEADER, None), Some(1.0));
        assert_eq!(value(names::RAFT_LAST_APPLIED_INDEX, None), Some(9.0));
        assert_eq!(
            value(names::RAFT_REPLICATION_LAG_ENTRIES, Some("1")),
            Some(10.0)
        );
        assert_eq!(
            value(names::RAFT_REPLICATION_LAG_ENTRIES, Some("3")),
            Some(2.0)
        );
        for (_, labels, _) in &seen {
            for (k, _) in labels {
                assert!(
                    ["node", "region", "peer"].contains(&k.as_str()),
                    "unexpected label {k}"
                );
            }
        }
    }
}
