//! Configuration of one coordinator node: who the members are, where data lives, timeouts.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::types::{Member, NodeId};

/// The shortest accepted cluster secret, in bytes.
pub const MIN_SECRET_LEN: usize = 16;

/// Everything needed to start a [`crate::Coordinator`].
///
/// Timeout defaults suit regions 50–150 ms apart: in openraft 0.9 the heartbeat interval is also
/// the timeout of every AppendEntries RPC, so it must exceed the slowest round trip with margin.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RaftConfig {
    /// This node's id; must be a key of `members`.
    pub node_id: NodeId,
    /// The static initial membership: node id → region and addresses. Identical on every node.
    pub members: BTreeMap<NodeId, Member>,
    /// Directory of `raft.redb`.
    pub data_dir: PathBuf,
    /// Shared by all members; every peer request carries it.
    pub cluster_secret: String,
    #[serde(default = "defaults::heartbeat_interval_ms")]
    pub heartbeat_interval_ms: u64,
    #[serde(default = "defaults::election_timeout_min_ms")]
    pub election_timeout_min_ms: u64,
    #[serde(default = "defaults::election_timeout_max_ms")]
    pub election_timeout_max_ms: u64,
    /// Deadline of one whole-snapshot transfer.
    #[serde(default = "defaults::install_snapshot_timeout_ms")]
    pub install_snapshot_timeout_ms: u64,
    /// How long [`crate::Coordinator::write`] may take, forwarding and retries included.
    #[serde(default = "defaults::write_timeout_ms")]
    pub write_timeout_ms: u64,
    /// Build a snapshot after this many applied entries since the last one.
    #[serde(default = "defaults::snapshot_every_entries")]
    pub snapshot_every_entries: u64,
    /// Log entries kept after a snapshot, so briefly lagging followers catch up by log.
    #[serde(default = "defaults::log_entries_kept")]
    pub log_entries_kept: u64,
    /// Log entries per AppendEntries request.
    #[serde(default = "defaults::max_payload_entries")]
    pub max_payload_entries: u64,
    /// The largest accepted body of a vote, append or forward request. A command larger than
    /// `max_rpc_body_bytes / max_payload_entries` is refused before it enters the log, so a full
    /// AppendEntries batch always fits and replication cannot wedge on an oversized entry.
    #[serde(default = "defaults::max_rpc_body_bytes")]
    pub max_rpc_body_bytes: usize,
    /// The largest accepted snapshot body.
    #[serde(default = "defaults::max_snapshot_body_bytes")]
    pub max_snapshot_body_bytes: usize,
}

mod defaults {
    pub fn heartbeat_interval_ms() -> u64 {
        500
    }
    pub fn election_timeout_min_ms() -> u64 {
        1_500
    }
    pub fn election_timeout_max_ms() -> u64 {
        3_000
    }
    pub fn install_snapshot_timeout_ms() -> u64 {
        30_000
    }
    pub fn write_timeout_ms() -> u64 {
        10_000
    }
    pub fn snapshot_every_entries() -> u64 {
        10_000
    }
    pub fn log_entries_kept() -> u64 {
        1_000
    }
    pub fn max_payload_entries() -> u64 {
        64
    }
    pub fn max_rpc_body_bytes() -> usize {
        64 << 20
    }
    pub fn max_snapshot_body_bytes() -> usize {
        1 << 30
    }
}

impl std::fmt::Debug for RaftConfig {
    // Hand-written so the secret never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftConfig")
            .field("node_id", &self.node_id)
            .field("members", &self.members)
            .field("data_dir", &self.data_dir)
            .field("cluster_secret", &"<redacted>")
            .field("heartbeat_interval_ms", &self.heartbeat_interval_ms)
            .field("election_timeout_min_ms", &self.election_timeout_min_ms)
            .field("election_timeout_max_ms", &self.election_timeout_max_ms)
            .field(
                "install_snapshot_timeout_ms",
                &self.install_snapshot_timeout_ms,
            )
            .field("write_timeout_ms", &self.write_timeout_ms)
            .field("snapshot_every_entries", &self.snapshot_every_entries)
            .field("log_entries_kept", &self.log_entries_kept)
            .field("max_payload_entries", &self.max_payload_entries)
            .field("max_rpc_body_bytes", &self.max_rpc_body_bytes)
            .field("max_snapshot_body_bytes", &self.max_snapshot_body_bytes)
            .finish()
    }
}

/// One problem with a [`RaftConfig`], naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

/// Every problem found in a [`RaftConfig`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid raft config: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct ConfigErrors(pub Vec<ConfigError>);

fn valid_addr(addr: &str) -> Result<(), String> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(format!("expected host:port (got {addr:?})"));
    };
    if host.is_empty() {
        return Err(format!("missing host (got {addr:?})"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(format!("bad port {port:?}")),
    }
}

impl RaftConfig {
    /// A config with default timeouts and limits.
    pub fn new(
        node_id: NodeId,
        members: BTreeMap<NodeId, Member>,
        data_dir: impl Into<PathBuf>,
        cluster_secret: impl Into<String>,
    ) -> Self {
        Self {
            node_id,
            members,
            data_dir: data_dir.into(),
            cluster_secret: cluster_secret.into(),
            heartbeat_interval_ms: defaults::heartbeat_interval_ms(),
            election_timeout_min_ms: defaults::election_timeout_min_ms(),
            election_timeout_max_ms: defaults::election_timeout_max_ms(),
            install_snapshot_timeout_ms: defaults::install_snapshot_timeout_ms(),
            write_timeout_ms: defaults::write_timeout_ms(),
            snapshot_every_entries: defaults::snapshot_every_entries(),
            log_entries_kept: defaults::log_entries_kept(),
            max_payload_entries: defaults::max_payload_entries(),
            max_rpc_body_bytes: defaults::max_rpc_body_bytes(),
            max_snapshot_body_bytes: defaults::max_snapshot_body_bytes(),
        }
    }

    /// Timeouts for a loopback cluster (tests, benchmarks): failover in well under a second.
    pub fn with_loopback_timeouts(mut self) -> Self {
        self.heartbeat_interval_ms = 50;
        self.election_timeout_min_ms = 150;
        self.election_timeout_max_ms = 300;
        self.write_timeout_ms = 3_000;
        self
    }

    /// Checks every field and reports all problems at once.
    pub fn validate(&self) -> Result<(), ConfigErrors> {
        let mut errors = Vec::new();
        self.check_members(&mut errors);
        self.check_storage(&mut errors);
        self.check_timing(&mut errors);
        self.check_sizes(&mut errors);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ConfigErrors(errors))
        }
    }

    /// The members: this node among them, valid regions and addresses, no peer address twice.
    fn check_members(&self, errors: &mut Vec<ConfigError>) {
        let mut err = |field: String, message: String| errors.push(ConfigError { field, message });
        if self.members.is_empty() {
            err("members".into(), "at least one member is required".into());
        } else if !self.members.contains_key(&self.node_id) {
            err(
                "node_id".into(),
                format!("{} is not one of the members", self.node_id),
            );
        }
        let mut peer_addrs = BTreeSet::new();
        for (id, m) in &self.members {
            if let Err(e) = quota_core::RegionId::new(m.region.clone()) {
                err(format!("members.{id}.region"), e.to_string());
            }
            if let Err(e) = valid_addr(&m.peer_addr) {
                err(format!("members.{id}.peer_addr"), e);
            } else if !peer_addrs.insert(m.peer_addr.as_str()) {
                err(
                    format!("members.{id}.peer_addr"),
                    format!("{} is used twice", m.peer_addr),
                );
            }
            if let Err(e) = valid_addr(&m.admin_addr) {
                err(format!("members.{id}.admin_addr"), e);
            }
        }
    }

    /// The data directory and the cluster secret.
    fn check_storage(&self, errors: &mut Vec<ConfigError>) {
        let mut err = |field: String, message: String| errors.push(ConfigError { field, message });
        if self.data_dir.as_os_str().is_empty() {
            err("data_dir".into(), "must not be empty".into());
        }
        if self.cluster_secret.len() < MIN_SECRET_LEN {
            err(
                "cluster_secret".into(),
                format!(
                    "must be at least {MIN_SECRET_LEN} bytes (got {})",
                    self.cluster_secret.len()
                ),
            );
        }
    }

    /// Heartbeats, elections and request timeouts, and how they must order.
    fn check_timing(&self, errors: &mut Vec<ConfigError>) {
        let mut err = |field: String, message: String| errors.push(ConfigError { field, message });
        if self.heartbeat_interval_ms == 0 {
            err("heartbeat_interval_ms".into(), "must be positive".into());
        }
        if self.election_timeout_min_ms <= self.heartbeat_interval_ms {
            err(
                "election_timeout_min_ms".into(),
                "must exceed heartbeat_interval_ms, or followers start elections between heartbeats".into(),
            );
        }
        if self.election_timeout_max_ms <= self.election_timeout_min_ms {
            err(
                "election_timeout_max_ms".into(),
                "must exceed election_timeout_min_ms".into(),
            );
        }
        if self.install_snapshot_timeout_ms == 0 {
            err(
                "install_snapshot_timeout_ms".into(),
                "must be positive".into(),
            );
        }
        if self.write_timeout_ms == 0 {
            err("write_timeout_ms".into(), "must be positive".into());
        }
    }

    /// Snapshot cadence and the size limits of RPC bodies.
    fn check_sizes(&self, errors: &mut Vec<ConfigError>) {
        let mut err = |field: String, message: String| errors.push(ConfigError { field, message });
        if self.snapshot_every_entries == 0 {
            err("snapshot_every_entries".into(), "must be positive".into());
        }
        if self.max_payload_entries == 0 {
            err("max_payload_entries".into(), "must be positive".into());
        } else if self.max_command_bytes() < 512 {
            err(
                "max_rpc_body_bytes".into(),
                "must allow at least 512 bytes per entry of a full AppendEntries batch".into(),
            );
        }
        if self.max_snapshot_body_bytes < self.max_rpc_body_bytes {
            err(
                "max_snapshot_body_bytes".into(),
                "must be at least max_rpc_body_bytes".into(),
            );
        }
    }

    /// The openraft configuration derived from this one.
    pub fn openraft_config(&self) -> openraft::Config {
        openraft::Config {
            cluster_name: "quotad".into(),
            heartbeat_interval: self.heartbeat_interval_ms,
            election_timeout_min: self.election_timeout_min_ms,
            election_timeout_max: self.election_timeout_max_ms,
            install_snapshot_timeout: self.install_snapshot_timeout_ms,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(self.snapshot_every_entries),
            max_in_snapshot_log_to_keep: self.log_entries_kept,
            max_payload_entries: self.max_payload_entries,
            // quota-raft's election guard decides when to campaign (see `crate::election`).
            enable_elect: false,
            ..Default::default()
        }
    }

    /// The election guard's timing: quiet for openraft's leader lease (`election_timeout_max`),
    /// jitter up to `election_timeout_max − election_timeout_min`, a pre-vote bounded by one
    /// heartbeat interval (the same bound openraft puts on AppendEntries).
    pub fn election_timings(&self) -> crate::election::ElectionTimings {
        let ms = Duration::from_millis;
        crate::election::ElectionTimings {
            quiet: ms(self.election_timeout_max_ms),
            jitter: ms(self
                .election_timeout_max_ms
                .saturating_sub(self.election_timeout_min_ms)),
            tick: ms((self.heartbeat_interval_ms / 2).max(10)),
            ask_timeout: ms(self.heartbeat_interval_ms),
        }
    }

    /// The largest encoded command accepted into the log (see `max_rpc_body_bytes`).
    pub fn max_command_bytes(&self) -> usize {
        let entries = usize::try_from(self.max_payload_entries.max(1)).unwrap_or(usize::MAX);
        // Leave a quarter for the entry and request framing around each command.
        self.max_rpc_body_bytes / entries / 4 * 3
    }

    /// How long one forwarded write may wait for the leader's answer: a live leader commits
    /// within a quorum round trip (under a heartbeat interval), so after
    /// `election_timeout_max_ms` the leader is taken for gone and the write is retried, against
    /// a new leader once one is known.
    pub fn forward_attempt_timeout(&self) -> Duration {
        Duration::from_millis(self.election_timeout_max_ms)
    }

    /// The longest a healthy majority waits for a new leader after the old one stops: the
    /// election guard's worst case ([`crate::election::ElectionTimings::worst_case_failover`]).
    pub fn failover_worst_case(&self) -> Duration {
        self.election_timings().worst_case_failover()
    }

    /// The write deadline as a duration.
    pub fn write_timeout(&self) -> Duration {
        Duration::from_millis(self.write_timeout_ms)
    }

    /// The node that bootstraps a fresh cluster: the lowest member id, so exactly one node
    /// initializes and a restarted cluster never initializes twice.
    pub fn bootstrapper(&self) -> Option<NodeId> {
        self.members.keys().next().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(region: &str, port: u16) -> Member {
        Member {
            region: region.into(),
            peer_addr: format!("127.0.0.1:{port}"),
            admin_addr: format!("127.0.0.1:{}", port + 1000),
        }
    }

    fn good() -> RaftConfig {
        let members = BTreeMap::from([(1, member("eu", 7001)), (2, member("us", 7002))]);
        RaftConfig::new(1, members, "/tmp/x", "0123456789abcdef")
    }

    #[test]
    fn good_config_validates() {
        good().validate().unwrap();
        good().with_loopback_timeouts().validate().unwrap();
    }

    #[test]
    fn every_problem_is_reported() {
        let mut c = good();
        c.node_id = 9;
        c.cluster_secret = "short".into();
        c.election_timeout_max_ms = c.election_timeout_min_ms;
        c.members.insert(
            3,
            Member {
                region: "bad region".into(),
                peer_addr: "127.0.0.1:7001".into(),
                admin_addr: "nope".into(),
            },
        );
        let errs = c.validate().unwrap_err().0;
        let fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "node_id",
                "members.3.region",
                "members.3.peer_addr",
                "members.3.admin_addr",
                "cluster_secret",
                "election_timeout_max_ms"
            ]
        );
    }

    #[test]
    fn debug_hides_the_secret() {
        let s = format!("{:?}", good());
        assert!(!s.contains("0123456789abcdef"));
    }

    #[test]
    fn openraft_accepts_the_derived_config() {
        good().openraft_config().validate().unwrap();
    }
}
