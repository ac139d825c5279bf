//! [`Coordinator`]: one node of the replicated coordinator, as the daemon uses it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use openraft::error::{CheckIsLeaderError, ClientWriteError, InitializeError, RaftError};
use openraft::ServerState;
use quota_core::coordinator::{Command, CoordinatorState, Response};
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::config::{ConfigErrors, RaftConfig};
use crate::election;
use crate::network::HttpNetwork;
use crate::peer_api::{self, PeerApiConfig};
use crate::proposal::local_write;
pub use crate::proposal::LeaderClock;
use crate::protocol::{ForwardRefusal, ForwardRequest};
use crate::storage::{self, OpenError, StateHandle};
use crate::telemetry;
use crate::tls::PeerTls;
use crate::types::alias::Raft;
use crate::types::{Member, NodeId};

/// First pause between retries while no leader is known; doubles up to [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_millis(20);
const RETRY_MAX: Duration = Duration::from_millis(500);

/// How long [`Coordinator::shutdown`] waits for openraft's tasks to release the database.
pub const STORAGE_CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a coordinator could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigErrors),
    #[error("openraft rejected the derived config: {source}")]
    OpenraftConfig { source: openraft::ConfigError },
    #[error(transparent)]
    Storage(#[from] OpenError),
    #[error("cannot build the HTTP client: {source}")]
    HttpClient { source: reqwest::Error },
    #[error("raft failed to start: {message}")]
    Raft { message: String },
    #[error("bootstrap failed: {message}")]
    Bootstrap { message: String },
}

/// Why a write was not (known to be) committed.
///
/// After `Timeout` or `Forward` the write may still commit later; commands carry request ids
/// so that retrying is safe.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    #[error("not committed within {timeout_ms} ms (no reachable leader with a quorum)")]
    Timeout { timeout_ms: u64 },
    #[error("raft stopped: {message}")]
    Fatal { message: String },
    #[error("write refused: {message}")]
    Rejected { message: String },
    #[error("the command encodes to {bytes} bytes; at most {max_bytes} are accepted")]
    TooLarge { bytes: usize, max_bytes: usize },
    #[error("the log entry carried no command response")]
    NoResponse,
}

/// Why a linearizable read failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("this node is not the leader (leader: {leader_id:?})")]
    NotLeader { leader_id: Option<NodeId> },
    #[error("leadership not confirmed by a quorum: {message}")]
    NoQuorum { message: String },
    #[error("leadership not confirmed within {timeout_ms} ms")]
    Timeout { timeout_ms: u64 },
    #[error("raft stopped: {message}")]
    Fatal { message: String },
}

/// Why a membership change failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MembershipError {
    #[error("this node is not the leader (leader: {leader_id:?}); send membership changes there")]
    NotLeader { leader_id: Option<NodeId> },
    #[error("membership change refused: {message}")]
    Rejected { message: String },
    #[error("membership change not done within {timeout_ms} ms")]
    Timeout { timeout_ms: u64 },
    #[error("node {node_id} is not a member")]
    UnknownNode { node_id: NodeId },
    #[error("raft stopped: {message}")]
    Fatal { message: String },
}

/// Why shutdown was not clean.
#[derive(Debug, thiserror::Error)]
#[error("raft shutdown failed: {message}")]
pub struct ShutdownError {
    pub message: String,
}

/// A node's role in the Raft group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Leader,
    Follower,
    Candidate,
    Learner,
    Shutdown,
}

/// A snapshot of this node's view of the group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Status {
    pub node_id: NodeId,
    pub role: Role,
    pub leader_id: Option<NodeId>,
    pub term: u64,
    pub last_applied_index: Option<u64>,
    pub last_log_index: Option<u64>,
    pub voters: BTreeSet<NodeId>,
    pub members: BTreeMap<NodeId, Member>,
    /// On the leader: entries each peer is behind the leader's log (`None` elsewhere).
    pub replication_lag: Option<BTreeMap<NodeId, u64>>,
    /// Set once Raft stopped with a fatal error.
    pub fatal: Option<String>,
}

struct Inner {
    raft: Raft,
    clock: Option<LeaderClock>,
    /// Dead once openraft's tasks dropped the storage, so a restart can reopen the file.
    db: std::sync::Weak<redb::Database>,
    config: RaftConfig,
    state: StateHandle,
    net: HttpNetwork,
    security: Option<PeerSecurity>,
    exporter: JoinHandle<()>,
    /// The election guard ([`election`]): openraft's own election timer is off.
    guard: JoinHandle<()>,
}

/// Peers over mutual TLS: this node's material, and which certificate identity is which
/// region.
#[derive(Debug, Clone)]
pub struct PeerSecurity {
    pub tls: PeerTls,
    /// Certificate identity (URI SAN) → the region it authenticates.
    pub identities: Arc<HashMap<String, String>>,
}

/// One running node of the replicated coordinator. Cheap to clone.
#[derive(Clone)]
pub struct Coordinator {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("node_id", &self.inner.config.node_id)
            .finish()
    }
}

impl Coordinator {
    /// Validates `config`, opens the redb store in `data_dir`, starts Raft, and on a fresh
    /// cluster lets the lowest member id initialize it with the static membership.
    ///
    /// Idempotent across restarts: a node with existing state never initializes again.
    pub async fn start(config: RaftConfig) -> Result<Self, StartError> {
        Self::start_with_clock(config, None).await
    }

    /// [`Coordinator::start`], with the clock the leader stamps commands with ([`LeaderClock`]).
    /// Without one, commands keep the timestamp their issuer gave them.
    pub async fn start_with_clock(
        config: RaftConfig,
        clock: Option<LeaderClock>,
    ) -> Result<Self, StartError> {
        Self::start_secured(config, clock, None).await
    }

    /// Like [`Coordinator::start_with_clock`], with peers over mutual TLS when `security` is
    /// given: every outbound call over TLS, and [`Coordinator::peer_router`] admitting only
    /// the identities it names.
    pub async fn start_secured(
        config: RaftConfig,
        clock: Option<LeaderClock>,
        security: Option<PeerSecurity>,
    ) -> Result<Self, StartError> {
        config.validate()?;
        let raft_config = config
            .openraft_config()
            .validate()
            .map_err(|source| StartError::OpenraftConfig { source })?;
        let (log, sm) = storage::open(&config.data_dir)?;
        let state = sm.handle();
        let db = log.closed_signal();
        let net = HttpNetwork::with_tls(
            config.node_id,
            &config.cluster_secret,
            security.as_ref().map(|s| &s.tls),
        )
        .map_err(|source| StartError::HttpClient { source })?;
        let raft = Raft::new(config.node_id, Arc::new(raft_config), net.clone(), log, sm)
            .await
            .map_err(|e| StartError::Raft {
                message: e.to_string(),
            })?;

        if config.bootstrapper() == Some(config.node_id) {
            let initialized = raft
                .is_initialized()
                .await
                .map_err(|e| StartError::Bootstrap {
                    message: e.to_string(),
                })?;
            if !initialized {
                match raft.initialize(config.members.clone()).await {
                    Ok(()) => tracing::info!(node = config.node_id, "Cluster initialized."),
                    Err(RaftError::APIError(InitializeError::NotAllowed(_))) => {}
                    Err(e) => {
                        return Err(StartError::Bootstrap {
                            message: e.to_string(),
                        })
                    }
                }
            }
        }
        let region = config
            .members
            .get(&config.node_id)
            .map(|m| m.region.clone())
            .unwrap_or_default();
        let exporter = telemetry::spawn_exporter(&raft, config.node_id, region);
        let guard = election::spawn_guard(
            raft.clone(),
            config.node_id,
            net.clone(),
            config.election_timings(),
        );
        Ok(Self {
            inner: Arc::new(Inner {
                raft,
                clock,
                db,
                config,
                state,
                net,
                security,
                exporter,
                guard,
            }),
        })
    }

    /// The router to mount on the peer listener (not the admin listener).
    pub fn peer_router(&self) -> Router {
        let c = &self.inner.config;
        peer_api::router(
            self.inner.raft.clone(),
            &PeerApiConfig {
                cluster_secret: c.cluster_secret.clone(),
                max_rpc_body_bytes: c.max_rpc_body_bytes,
                max_snapshot_body_bytes: c.max_snapshot_body_bytes,
                max_command_bytes: c.max_command_bytes(),
                write_timeout: c.write_timeout(),
                leader_clock: self.inner.clock.clone(),
                election_quiet: c.election_timings().quiet,
                identities: self.inner.security.as_ref().map(|s| s.identities.clone()),
            },
        )
    }

    /// Commits `command` and returns quota-core's response to it.
    ///
    /// On a follower the write is forwarded to the leader; while no leader is known it retries
    /// with backoff. Everything is bounded by `write_timeout_ms`: a 0.9 leader cut off from its
    /// majority does not step down, so its writes would otherwise hang.
    pub async fn write(&self, command: Command) -> Result<Response, WriteError> {
        self.write_within(command, self.inner.config.write_timeout())
            .await
    }

    /// [`Coordinator::write`] within `timeout` instead of `write_timeout_ms`: for writes whose
    /// use runs out sooner (a lease renewal must fail and be retried well within its lease).
    ///
    /// Each forwarding attempt is bounded by [`RaftConfig::forward_attempt_timeout`], so a
    /// leader that stopped answering costs one attempt, and the write goes to the next leader
    /// as soon as this node learns of one.
    pub async fn write_within(
        &self,
        command: Command,
        timeout: Duration,
    ) -> Result<Response, WriteError> {
        let timeout_ms = timeout.as_millis() as u64;
        let deadline = Instant::now() + timeout;
        let mut pause = RETRY_MIN;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(WriteError::Timeout { timeout_ms });
            }
            let max = self.inner.config.max_command_bytes();
            let refusal = match local_write(
                &self.inner.raft,
                command.clone(),
                remaining,
                max,
                self.inner.clock.as_ref(),
            )
            .await
            {
                Ok(reply) => return reply.ok_or(WriteError::NoResponse),
                Err(r) => r,
            };
            match refusal {
                ForwardRefusal::NotLeader {
                    leader_id: Some(leader),
                } if leader != self.inner.config.node_id => {
                    if let Some(reply) = self.forward(leader, &command, deadline).await? {
                        return reply.ok_or(WriteError::NoResponse);
                    }
                }
                ForwardRefusal::NotLeader { .. } => {}
                ForwardRefusal::Timeout { .. } => return Err(WriteError::Timeout { timeout_ms }),
                ForwardRefusal::Fatal { message } => return Err(WriteError::Fatal { message }),
                ForwardRefusal::Rejected { message } => {
                    return Err(WriteError::Rejected { message })
                }
                ForwardRefusal::TooLarge { bytes, max_bytes } => {
                    return Err(WriteError::TooLarge { bytes, max_bytes })
                }
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            tokio::time::sleep(pause.min(remaining)).await;
            pause = (pause * 2).min(RETRY_MAX);
        }
    }

    /// One forwarding attempt; `Ok(None)` means "retry".
    async fn forward(
        &self,
        leader: NodeId,
        command: &Command,
        deadline: Instant,
    ) -> Result<Option<crate::types::Reply>, WriteError> {
        let timeout_ms = self.inner.config.write_timeout_ms;
        let Some(member) = self.member(leader) else {
            return Ok(None);
        };
        let remaining = deadline
            .saturating_duration_since(Instant::now())
            .min(self.inner.config.forward_attempt_timeout());
        let req = ForwardRequest {
            command: command.clone(),
            timeout_ms: remaining.as_millis() as u64,
        };
        match self.inner.net.forward(&member, &req, remaining).await {
            Ok(Ok(reply)) => Ok(Some(reply)),
            Ok(Err(ForwardRefusal::NotLeader { .. })) => Ok(None),
            Ok(Err(ForwardRefusal::Timeout { .. })) => Err(WriteError::Timeout { timeout_ms }),
            Ok(Err(ForwardRefusal::Fatal { .. })) => Ok(None), // that leader is gone; find the next
            Ok(Err(ForwardRefusal::Rejected { message })) => Err(WriteError::Rejected { message }),
            Ok(Err(ForwardRefusal::TooLarge { bytes, max_bytes })) => {
                Err(WriteError::TooLarge { bytes, max_bytes })
            }
            Err(e) => {
                tracing::debug!(leader, error = %e, "Forwarding failed; retrying.");
                // Retry at once if this node has meanwhile heard of another leader.
                self.wait_leader_change(leader, RETRY_MAX).await;
                Ok(None)
            }
        }
    }

    /// Waits up to `at_most` for this node to know a leader other than `old`.
    async fn wait_leader_change(&self, old: NodeId, at_most: Duration) {
        let mut rx = self.inner.raft.metrics();
        let changed = async {
            loop {
                let now = rx.borrow_and_update().current_leader;
                if now.is_some_and(|l| l != old) || rx.changed().await.is_err() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(at_most, changed).await;
    }

    fn member(&self, id: NodeId) -> Option<Member> {
        let m = self.inner.raft.metrics();
        let membership = m.borrow().membership_config.clone();
        membership.membership().get_node(&id).cloned()
    }

    /// Runs `f` on the applied state (which may trail the leader's commits by a moment).
    pub fn read<R>(&self, f: impl FnOnce(&CoordinatorState) -> R) -> R {
        self.inner.state.read(f)
    }

    /// Runs `f` on the applied state and its revision ([`StateHandle::read_revised`]).
    pub fn read_revised<R>(&self, f: impl FnOnce(&CoordinatorState, u64) -> R) -> R {
        self.inner.state.read_revised(f)
    }

    /// Runs `f` on the applied state, its revision and what changed since `since`
    /// ([`StateHandle::read_changes`]).
    pub fn read_changes<R>(
        &self,
        since: Option<u64>,
        f: impl FnOnce(&CoordinatorState, u64, crate::storage::Changes) -> R,
    ) -> R {
        self.inner.state.read_changes(since, f)
    }

    /// Runs `f` on a state that includes every write committed before this call (a ReadIndex
    /// round: one quorum round trip). Leader only; bounded by `write_timeout_ms`.
    pub async fn read_linearizable<R>(
        &self,
        f: impl FnOnce(&CoordinatorState) -> R,
    ) -> Result<R, ReadError> {
        let timeout = self.inner.config.write_timeout();
        match tokio::time::timeout(timeout, self.inner.raft.ensure_linearizable()).await {
            Err(_) => Err(ReadError::Timeout {
                timeout_ms: timeout.as_millis() as u64,
            }),
            Ok(Ok(_)) => Ok(self.inner.state.read(f)),
            Ok(Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f)))) => {
                Err(ReadError::NotLeader {
                    leader_id: f.leader_id,
                })
            }
            Ok(Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(e)))) => {
                Err(ReadError::NoQuorum {
                    message: e.to_string(),
                })
            }
            Ok(Err(RaftError::Fatal(f))) => Err(ReadError::Fatal {
                message: f.to_string(),
            }),
        }
    }

    /// A read handle on the applied state, to hand to other tasks.
    pub fn state(&self) -> StateHandle {
        self.inner.state.clone()
    }

    /// A receiver that changes whenever the applied index does.
    pub fn subscribe_applied(&self) -> watch::Receiver<Option<u64>> {
        self.inner.state.subscribe()
    }

    /// This node's view of the group.
    pub fn status(&self) -> Status {
        let m = self.inner.raft.metrics().borrow().clone();
        let role = match m.state {
            ServerState::Leader => Role::Leader,
            ServerState::Follower => Role::Follower,
            ServerState::Candidate => Role::Candidate,
            ServerState::Learner => Role::Learner,
            ServerState::Shutdown => Role::Shutdown,
        };
        let last = m.last_log_index.unwrap_or(0);
        let membership = m.membership_config.membership();
        Status {
            node_id: m.id,
            role,
            leader_id: m.current_leader,
            term: m.current_term,
            last_applied_index: m.last_applied.map(|l| l.index),
            last_log_index: m.last_log_index,
            voters: membership.voter_ids().collect(),
            members: membership.nodes().map(|(id, n)| (*id, n.clone())).collect(),
            replication_lag: m.replication.as_ref().map(|r| {
                r.iter()
                    .map(|(id, matched)| (*id, last.saturating_sub(matched.map_or(0, |l| l.index))))
                    .collect()
            }),
            fatal: m.running_state.as_ref().err().map(ToString::to_string),
        }
    }

    /// Whether this node currently believes it leads (a cut-off 0.9 leader still does).
    pub fn is_leader(&self) -> bool {
        self.inner.raft.metrics().borrow().state == ServerState::Leader
    }

    /// Adds `member` as a learner and waits until it has caught up. Leader only.
    pub async fn add_learner(&self, id: NodeId, member: Member) -> Result<(), MembershipError> {
        self.membership_op(self.inner.raft.add_learner(id, member, true))
            .await
    }

    /// Makes learner `id` a voter. Leader only.
    pub async fn promote(&self, id: NodeId) -> Result<(), MembershipError> {
        let status = self.status();
        if !status.members.contains_key(&id) {
            return Err(MembershipError::UnknownNode { node_id: id });
        }
        let mut voters = status.voters;
        voters.insert(id);
        self.membership_op(self.inner.raft.change_membership(voters, false))
            .await
    }

    /// Removes `id` from the group entirely. Leader only.
    pub async fn remove(&self, id: NodeId) -> Result<(), MembershipError> {
        let status = self.status();
        if !status.members.contains_key(&id) {
            return Err(MembershipError::UnknownNode { node_id: id });
        }
        let mut voters = status.voters;
        voters.remove(&id);
        self.membership_op(self.inner.raft.change_membership(voters, false))
            .await
    }

    async fn membership_op<T>(
        &self,
        op: impl std::future::Future<
            Output = Result<T, RaftError<NodeId, ClientWriteError<NodeId, Member>>>,
        >,
    ) -> Result<(), MembershipError> {
        let timeout = self.inner.config.write_timeout();
        match tokio::time::timeout(timeout, op).await {
            Err(_) => Err(MembershipError::Timeout {
                timeout_ms: timeout.as_millis() as u64,
            }),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
                Err(MembershipError::NotLeader {
                    leader_id: f.leader_id,
                })
            }
            Ok(Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(e)))) => {
                Err(MembershipError::Rejected {
                    message: e.to_string(),
                })
            }
            Ok(Err(RaftError::Fatal(f))) => Err(MembershipError::Fatal {
                message: f.to_string(),
            }),
        }
    }

    /// Resolves when Raft has stopped with a fatal error (storage failure, panic, shutdown);
    /// the daemon should then exit so its supervisor restarts it from disk.
    pub async fn wait_fatal(&self) -> String {
        let mut rx = self.inner.raft.metrics();
        loop {
            if let Err(e) = &rx.borrow_and_update().running_state {
                return e.to_string();
            }
            if rx.changed().await.is_err() {
                return "raft metrics channel closed".into();
            }
        }
    }

    /// The underlying openraft handle, for what this API does not cover.
    pub fn raft(&self) -> &Raft {
        &self.inner.raft
    }

    /// This node's config.
    pub fn config(&self) -> &RaftConfig {
        &self.inner.config
    }

    /// Stops Raft and waits (up to [`STORAGE_CLOSE_TIMEOUT`]) until openraft's tasks have
    /// closed the database, so the same data directory can be opened again.
    pub async fn shutdown(&self) -> Result<(), ShutdownError> {
        self.inner.exporter.abort();
        self.inner.guard.abort();
        self.inner
            .raft
            .shutdown()
            .await
            .map_err(|e| ShutdownError {
                message: e.to_string(),
            })?;
        let deadline = Instant::now() + STORAGE_CLOSE_TIMEOUT;
        // redb may finish closing a moment after the last handle is dropped (a transaction
        // ending on another thread), so check by opening the file ourselves.
        while self.inner.db.strong_count() > 0 || !storage::is_closed(&self.inner.config.data_dir) {
            if Instant::now() >= deadline {
                return Err(ShutdownError {
                    message: "storage still in use after shutdown".into(),
                });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }
}
