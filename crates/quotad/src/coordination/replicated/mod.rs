//! The Raft-backed coordinator of a multi-region cluster (quota-raft), as the daemon uses it.
//!
//! ```text
//!  every region, each report interval:  usage ──HTTP (peer port)──> leader's DemandTracker
//!                                        RenewLease{acked_epoch} ──Raft──> LeaseRenewed ──> RegionView
//!  leader, each rebalance interval:      allocator::plan(state, demand) ──> SetShares ──Raft──> all
//!  every region, on each applied change: ClusterView rebuilt ──> region agent writes shares to Redis
//! ```
//!
//! Usage reports are soft state: they go to the leader over the peer listener, never through
//! the Raft log. Policies, pins, shares and lease renewals are commands; the leader stamps them
//! with its wall clock and `apply` never reads one. The region counts its own lease with
//! quota-core's `RegionView` on its monotonic clock (from when it sent the renewal, minus the
//! drift margin; a wall clock stepped back does not lengthen it), so it
//! stops enforcing a share before the coordinator can hand it to anyone else.
//!
//! The member's jobs, one file each: [`writes`] (policy, pin and membership commands),
//! [`lease`] (renewing this daemon's lease), [`agent_role`] (which of a region's daemons is
//! its agent), [`usage`] (usage reports, sent and received),
//! [`round`] (the leader's round), [`views`] (views built from the applied state) and
//! [`readiness`] (what this member waits for before it takes traffic).

mod agent_role;
mod lease;
mod peer_auth;
mod plans;
mod readiness;
mod round;
pub mod standby_usage;
pub mod usage;
mod views;
mod writes;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quota_core::allocator::AllocatorConfig;
use quota_core::coordinator::{Operation, RequestId, Response};
use quota_core::demand::DemandTracker;
use quota_core::lease::LeaseConfig;
use quota_core::promotion::{PromotionConfig, PromotionTracker};
use quota_core::{Command, RegionId, TenantId};
use quota_raft::{Member, RaftConfig, Role};
use tokio::sync::watch;

use crate::clock;
use crate::config::{RegionSettings, Settings};
use crate::coordination::mutation::CoordError;
use crate::coordination::status::{CoordinatorStatus, MemberStatus};
use crate::coordination::view::{ClusterView, PolicyMap};
use crate::secret::Secret;
use quota_raft::coordinator::PeerSecurity;
use quota_raft::tls::{PeerHttp, PeerTls};

/// One member of a replicated cluster.
#[derive(Debug)]
pub struct Replicated {
    raft: quota_raft::Coordinator,
    region: RegionId,
    regions: Vec<RegionId>,
    tx: watch::Sender<Arc<ClusterView>>,
    lease: Mutex<lease::LeaseClock>,
    lease_config: LeaseConfig,
    demand: Mutex<DemandTracker>,
    /// Candidates for promotion and promoted subjects' calm, on the leader (soft state).
    promotion: Mutex<PromotionTracker>,
    allocator: AllocatorConfig,
    rebalance_interval_ms: u64,
    id_prefix: u64,
    next_id: AtomicU64,
    http: PeerHttp,
    peer_token: Secret,
    /// Peer mutual TLS, when `[peer] tls_*` is set: the material (reloaded by the daemon),
    /// and which certificate identity is which region.
    peer_tls: Option<PeerSecurity>,
    /// The policies and pins of the last view, with the state revision they were built from.
    derived: Mutex<Option<Derived>>,
    /// Set once this member was ready ([`Replicated::readiness`]), and kept.
    ready: AtomicBool,
    /// This daemon's watch on its region's agent role.
    agent: Mutex<agent_role::Watch>,
    /// Woken when this daemon wins the agent role, so the apply loop starts its pass at once.
    agent_won: tokio::sync::Notify,
    /// What standbys handed over for the agent's next report.
    standby_usage: Mutex<standby_usage::Received>,
}

/// The O(policies) part of a view, kept while the state's revision stays the same.
#[derive(Debug)]
struct Derived {
    revision: u64,
    policies: PolicyMap,
    tenant_pins: Arc<BTreeMap<TenantId, RegionId>>,
    plan_assignments: crate::coordination::view::PlanAssignments,
    promoted: crate::coordination::view::PromotedMap,
}

fn unavailable(e: impl std::fmt::Display) -> CoordError {
    CoordError::Unavailable {
        reason: e.to_string(),
    }
}

impl Replicated {
    /// Starts the Raft member described by `settings` (multi-region, peer token set).
    pub async fn start(settings: &Settings) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        let cfg = &settings.config;
        let peer_token = settings
            .secrets
            .peer_token
            .clone()
            .context("a multi-region cluster needs a peer token")?;
        let me = settings
            .me()
            .context("this daemon is not listed in [[regions]]")?;
        let raft_cfg = raft_config(settings, me, &peer_token);
        std::fs::create_dir_all(&raft_cfg.data_dir)
            .with_context(|| format!("creating {}", raft_cfg.data_dir.display()))?;
        // The leader stamps every command it appends with its own clock, so `apply`'s lease
        // arithmetic never runs on a follower's (possibly skewed) clock.
        let leader_clock: quota_raft::LeaderClock = Arc::new(clock::wall_ms);
        let peer_tls = match &settings.peer_tls {
            None => None,
            Some(files) => Some(PeerSecurity {
                tls: PeerTls::load(files.clone()).context("reading the peer TLS files")?,
                identities: Arc::new(
                    settings
                        .regions
                        .iter()
                        .map(|r| (r.identity.clone(), r.id.to_string()))
                        .collect(),
                ),
            }),
        };
        let raft =
            quota_raft::Coordinator::start_secured(raft_cfg, Some(leader_clock), peer_tls.clone())
                .await
                .context("starting the Raft coordinator")?;
        // Rebuilt after a rotation of the peer TLS files (quota_raft::tls::PeerHttp).
        let http = PeerHttp::new(peer_tls.as_ref().map(|s| &s.tls), |b| {
            b.timeout(Duration::from_secs(2))
        })
        .context("building the peer HTTP client")?;
        let (tx, _) = watch::channel(Arc::new(ClusterView::default()));
        let allocator = AllocatorConfig::default();
        Ok(Self {
            raft,
            region: settings.region.clone(),
            regions: settings.region_ids(),
            tx,
            lease: Mutex::new(lease::LeaseClock::default()),
            lease_config: LeaseConfig {
                lease_ms: cfg.coordination.lease_ms,
                drift_margin_ms: cfg.coordination.drift_margin_ms,
            },
            demand: Mutex::new(DemandTracker::new(allocator.ewma_alpha_ppm)),
            promotion: Mutex::new(PromotionTracker::new(PromotionConfig::default())),
            allocator,
            rebalance_interval_ms: cfg.coordination.rebalance_interval_ms,
            id_prefix: rand::random(),
            next_id: AtomicU64::new(1),
            http,
            peer_token,
            peer_tls,
            derived: Mutex::new(None),
            ready: AtomicBool::new(false),
            agent: Mutex::new(agent_role::Watch::default()),
            agent_won: tokio::sync::Notify::new(),
            standby_usage: Mutex::default(),
        })
    }

    /// The peer TLS material, when peers talk over mutual TLS.
    pub fn peer_tls(&self) -> Option<&PeerTls> {
        self.peer_tls.as_ref().map(|s| &s.tls)
    }

    /// `https` with peer TLS, else `http`.
    fn peer_scheme(&self) -> &'static str {
        self.http.scheme()
    }

    /// Certificate identity → region, with peer TLS.
    pub fn peer_identities(&self) -> Option<Arc<std::collections::HashMap<String, String>>> {
        self.peer_tls.as_ref().map(|s| s.identities.clone())
    }

    /// This daemon's region.
    pub fn region(&self) -> &RegionId {
        &self.region
    }

    /// Snapshot receiver.
    pub fn subscribe(&self) -> watch::Receiver<Arc<ClusterView>> {
        self.tx.subscribe()
    }

    /// The current view.
    pub fn view(&self) -> Arc<ClusterView> {
        self.tx.borrow().clone()
    }

    /// Applied-index change notifications from Raft.
    pub fn subscribe_applied(&self) -> watch::Receiver<Option<u64>> {
        self.raft.subscribe_applied()
    }

    /// Resolves when Raft stopped for good.
    pub async fn wait_fatal(&self) -> String {
        self.raft.wait_fatal().await
    }

    fn request_id(&self) -> RequestId {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        RequestId((u128::from(self.id_prefix) << 64) | u128::from(n))
    }

    async fn write(&self, op: Operation) -> Result<Response, CoordError> {
        self.write_within(op, self.raft.config().write_timeout())
            .await
    }

    /// [`Replicated::write`] bounded by `timeout` (forwarding retries included).
    async fn write_within(&self, op: Operation, timeout: Duration) -> Result<Response, CoordError> {
        let cmd = Command {
            request: self.request_id(),
            now_ms: clock::wall_ms(),
            op,
        };
        self.raft
            .write_within(cmd, timeout)
            .await
            .map_err(unavailable)
    }

    /// Raft role, leader, term and members for /v1/status.
    pub fn status(&self) -> CoordinatorStatus {
        let s = self.raft.status();
        let region_of = |id: &u64| {
            s.members
                .get(id)
                .and_then(|m| RegionId::new(m.region.as_str()).ok())
        };
        // Each region's agent, as this daemon's applied state says.
        let agents: BTreeMap<String, u64> = self.raft.read(|st| {
            st.regions
                .iter()
                .flatten()
                .filter_map(|r| Some((r.id.as_str().to_string(), r.agent?.node)))
                .collect()
        });
        CoordinatorStatus {
            role: match s.role {
                Role::Leader => "leader",
                Role::Follower => "follower",
                Role::Candidate => "candidate",
                Role::Learner => "learner",
                Role::Shutdown => "shutdown",
            },
            leader: s.leader_id.as_ref().and_then(region_of),
            leader_node: s.leader_id,
            node_id: s.node_id,
            term: s.term,
            applied_index: s.last_applied_index.unwrap_or(0),
            members: s
                .members
                .keys()
                .filter_map(|id| {
                    region_of(id).map(|region| MemberStatus {
                        agent: agents.get(region.as_str()) == Some(id),
                        region,
                        node_id: *id,
                        voter: s.voters.contains(id),
                    })
                })
                .collect(),
        }
    }

    /// Stops Raft.
    pub async fn shutdown(&self) {
        if let Err(e) = self.raft.shutdown().await {
            tracing::warn!(error = %e, "Raft shutdown was not clean.");
        }
    }
}

/// The Raft member's configuration: every region as a member, timings from `[raft]` where set.
fn raft_config(settings: &Settings, me: &RegionSettings, peer_token: &Secret) -> RaftConfig {
    let cfg = &settings.config;
    let members: BTreeMap<u64, Member> = settings
        .regions
        .iter()
        .map(|r| {
            let m = Member {
                region: r.id.as_str().to_string(),
                peer_addr: r.peer.to_string(),
                admin_addr: r.api.to_string(),
            };
            (r.node_id, m)
        })
        .collect();
    let mut raft_cfg = RaftConfig::new(
        me.node_id,
        members,
        cfg.data_dir.join("raft"),
        peer_token.expose(),
    );
    let t = &cfg.raft;
    if let Some(v) = t.heartbeat_interval_ms {
        raft_cfg.heartbeat_interval_ms = v;
    }
    if let Some(v) = t.election_timeout_min_ms {
        raft_cfg.election_timeout_min_ms = v;
    }
    if let Some(v) = t.election_timeout_max_ms {
        raft_cfg.election_timeout_max_ms = v;
    }
    if let Some(v) = t.write_timeout_ms {
        raft_cfg.write_timeout_ms = v;
    }
    raft_cfg
}
