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
//! quota-core's `RegionView` (from when it sent the renewal, minus the drift margin), so it
//! stops enforcing a share before the coordinator can hand it to anyone else.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use quota_core::allocator::{self, AllocatorConfig};
use quota_core::coordinator::{
    CoordinatorState, Entry, InvalidEntry, Operation, PolicyKey, RequestId, Response,
};
use quota_core::demand::{DemandTracker, Usage};
use quota_core::lease::LeaseConfig;
use quota_core::region::{RegionLease, RegionView};
use quota_core::{Command, Policy, PolicyName, RegionId, TenantId};
use quota_raft::{Member, RaftConfig, Role};
use quota_store::UsageRecord;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::api::auth::token_matches;
use crate::clock;
use crate::config::{Secret, Settings};
use crate::coordination::{
    ClusterView, CoordError, Coordinator, CoordinatorStatus, Grant, MemberStatus, PolicyEntry,
    PolicyMap, PolicyPut,
};
use crate::telemetry;

/// The peer-port route where regions send usage reports to the leader.
pub const PATH_USAGE: &str = "/quotad/v1/usage";

/// A usage report: soft state for the leader's demand estimates.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageReport {
    pub region: RegionId,
    pub interval_ms: u64,
    /// `(tenant, policy, admitted, denied)`.
    pub usage: Vec<(TenantId, PolicyName, u64, u64)>,
}

/// One member of a replicated cluster.
#[derive(Debug)]
pub struct Replicated {
    raft: quota_raft::Coordinator,
    region: RegionId,
    regions: Vec<RegionId>,
    tx: watch::Sender<Arc<ClusterView>>,
    lease: Mutex<RegionView>,
    lease_config: LeaseConfig,
    demand: Mutex<DemandTracker>,
    allocator: AllocatorConfig,
    rebalance_interval_ms: u64,
    id_prefix: u64,
    next_id: AtomicU64,
    http: reqwest::Client,
    peer_token: Secret,
    /// The policies and pins of the last view, with the state revision they were built from.
    derived: Mutex<Option<Derived>>,
}

/// The O(policies) part of a view, kept while the state's revision stays the same.
#[derive(Debug)]
struct Derived {
    revision: u64,
    policies: PolicyMap,
    tenant_pins: Arc<BTreeMap<TenantId, RegionId>>,
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
            .regions
            .iter()
            .find(|r| r.id == settings.region)
            .context("this region is not listed in [[regions]]")?;
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
        std::fs::create_dir_all(&raft_cfg.data_dir)
            .with_context(|| format!("creating {}", raft_cfg.data_dir.display()))?;
        // The leader stamps every command it appends with its own clock, so `apply`'s lease
        // arithmetic never runs on a follower's (possibly skewed) clock.
        let leader_clock: quota_raft::LeaderClock = Arc::new(clock::wall_ms);
        let raft = quota_raft::Coordinator::start_with_clock(raft_cfg, Some(leader_clock))
            .await
            .context("starting the Raft coordinator")?;
        let (tx, _) = watch::channel(Arc::new(ClusterView::default()));
        let allocator = AllocatorConfig::default();
        Ok(Self {
            raft,
            region: settings.region.clone(),
            regions: settings.regions.iter().map(|r| r.id.clone()).collect(),
            tx,
            lease: Mutex::new(RegionView::new()),
            lease_config: LeaseConfig {
                lease_ms: cfg.coordination.lease_ms,
                drift_margin_ms: cfg.coordination.drift_margin_ms,
            },
            demand: Mutex::new(DemandTracker::new(allocator.ewma_alpha_ppm)),
            allocator,
            rebalance_interval_ms: cfg.coordination.rebalance_interval_ms,
            id_prefix: rand::random(),
            next_id: AtomicU64::new(1),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()
                .context("building the peer HTTP client")?,
            peer_token,
            derived: Mutex::new(None),
        })
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
        let cmd = Command {
            request: self.request_id(),
            now_ms: clock::wall_ms(),
            op,
        };
        self.raft.write(cmd).await.map_err(unavailable)
    }

    /// Rebuilds the view from the applied state and this region's lease; publishes it if it
    /// changed.
    pub fn rebuild_view(&self) {
        let lease_end = {
            let lease = self.lease.lock().unwrap_or_else(|e| e.into_inner());
            lease
                .lease()
                .map_or(0, |l| l.end_local_ms(self.lease_config.drift_margin_ms))
        };
        let view = self.raft.read_revised(|s, revision| {
            let mut derived = self.derived.lock().unwrap_or_else(|e| e.into_inner());
            view_of(&mut derived, s, revision, lease_end)
        });
        self.tx.send_if_modified(|old| {
            if **old == view {
                false
            } else {
                *old = Arc::new(view);
                true
            }
        });
    }

    /// Local wall-clock ms at which this region's lease (minus the margin) ends; 0 without one.
    pub fn lease_end_local_ms(&self) -> u64 {
        let lease = self.lease.lock().unwrap_or_else(|e| e.into_inner());
        lease
            .lease()
            .map_or(0, |l| l.end_local_ms(self.lease_config.drift_margin_ms))
    }

    /// Records that this region's store now enforces the allocation of `epoch`.
    pub fn on_applied(&self, epoch: u64) {
        self.lease
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .on_applied(epoch);
        self.rebuild_view();
    }

    /// Renews this region's lease through the log, acknowledging the applied epoch.
    ///
    /// Only under this region's configured lease timing: until the leader has committed it, a
    /// renewal would carry the state machine's default (30 s) and delay the reuse of this
    /// region's share by that much if it were then cut off.
    pub async fn renew_lease(&self) -> Result<(), CoordError> {
        let cluster = self.raft.read(|s| s.lease);
        if cluster != self.lease_config {
            if cluster != LeaseConfig::default() {
                tracing::warn!(
                    configured_ms = self.lease_config.lease_ms,
                    cluster_ms = cluster.lease_ms,
                    "The cluster's lease timing differs from this region's configuration: not \
                     renewing. Configure the same [coordination] lease on every region."
                );
            }
            return Err(unavailable(
                "the configured lease timing is not committed yet",
            ));
        }
        let acked_epoch = self
            .lease
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .applied_epoch();
        let sent = clock::wall_ms();
        let op = Operation::RenewLease {
            region: self.region.clone(),
            acked_epoch,
        };
        match self.write(op).await? {
            Response::LeaseRenewed {
                epoch, lease_ms, ..
            } => {
                let lease = RegionLease {
                    epoch,
                    start_local_ms: sent,
                    lease_ms,
                };
                self.lease
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .on_renewal(lease);
                self.rebuild_view();
                Ok(())
            }
            Response::UnknownRegion { region } => Err(CoordError::UnknownRegion { region }),
            other => Err(unavailable(format!("lease renewal answered {other:?}"))),
        }
    }

    /// Sends this region's usage to the leader (or records it, on the leader).
    pub async fn report_usage(
        &self,
        usage: &[UsageRecord],
        interval_ms: u64,
    ) -> Result<(), CoordError> {
        let report = UsageReport {
            region: self.region.clone(),
            interval_ms,
            usage: usage
                .iter()
                .map(|u| {
                    (
                        u.bucket.tenant.clone(),
                        u.bucket.policy.clone(),
                        u.admitted,
                        u.denied,
                    )
                })
                .collect(),
        };
        let status = self.raft.status();
        if status.role == Role::Leader {
            self.record_report(&report);
            return Ok(());
        }
        let leader = status
            .leader_id
            .and_then(|id| status.members.get(&id).cloned())
            .ok_or_else(|| unavailable("no leader known"))?;
        let resp = self
            .http
            .post(format!("http://{}{PATH_USAGE}", leader.peer_addr))
            .bearer_auth(self.peer_token.expose())
            .json(&report)
            .send()
            .await
            .map_err(unavailable)?;
        if resp.status().is_success() {
            Ok(())
        } else {
            Err(unavailable(format!(
                "the leader answered {}",
                resp.status()
            )))
        }
    }

    fn record_report(&self, report: &UsageReport) {
        let Some(slot) = self.raft.read(|s| s.region_index(&report.region)) else {
            return;
        };
        let usage: Vec<(PolicyKey, Usage)> = report
            .usage
            .iter()
            .map(|(t, p, admitted, denied)| {
                (
                    PolicyKey::new(t.clone(), p.clone()),
                    Usage {
                        admitted: *admitted,
                        denied: *denied,
                    },
                )
            })
            .collect();
        self.demand
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(slot, report.interval_ms, &usage);
    }

    /// One leader round: register missing regions and the lease timing, then rebalance.
    /// A no-op on followers.
    pub async fn leader_round(&self) {
        if !self.raft.is_leader() {
            return;
        }
        let started = clock::monotonic();
        let (missing, lease) = self.raft.read(|s| {
            let missing: Vec<RegionId> = self
                .regions
                .iter()
                .filter(|r| s.region_index(r).is_none())
                .cloned()
                .collect();
            (missing, s.lease)
        });
        for region in missing {
            let op = Operation::PutRegion {
                region,
                reserves_floor: true,
                draining: false,
            };
            if let Err(e) = self.write(op).await {
                tracing::warn!(error = %e, "Registering a region failed.");
                return;
            }
        }
        if lease != self.lease_config {
            if let Err(e) = self
                .write(Operation::SetLeaseConfig {
                    config: self.lease_config,
                })
                .await
            {
                tracing::warn!(error = %e, "Setting the lease timing failed.");
                return;
            }
        }
        let now = clock::wall_ms();
        // A region whose lease ran out cannot report (it is cut off or down): count it as
        // having no demand, so the allocator hands its non-floor share to regions that do.
        let silent: Vec<u8> = self.raft.read(|s| {
            s.regions
                .iter()
                .enumerate()
                .filter_map(|(i, r)| r.as_ref().map(|r| (i, r)))
                .filter(|(_, r)| {
                    now > r
                        .lease_expires_at_ms
                        .saturating_add(s.lease.drift_margin_ms)
                })
                .map(|(i, _)| i as u8)
                .collect()
        });
        let plan = {
            let mut demand = self.demand.lock().unwrap_or_else(|e| e.into_inner());
            for slot in silent {
                demand.record(slot, self.rebalance_interval_ms, &[]);
            }
            self.raft
                .read(|s| allocator::plan(s, &demand, &self.allocator, now))
        };
        let commands = plan.into_commands(now, self.allocator.max_entries_per_command, || {
            self.request_id()
        });
        for cmd in commands {
            match self.raft.write(cmd).await {
                Ok(Response::SharesSet {
                    epoch,
                    accepted,
                    rejected_total,
                    ..
                }) => {
                    tracing::debug!(epoch, accepted, rejected_total, "Shares committed.");
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "Committing shares failed.");
                    break;
                }
            }
        }
        metrics::histogram!(telemetry::REBALANCE_DURATION_SECONDS, "region" => self.region.as_str().to_string())
            .record(started.elapsed().as_secs_f64());
    }

    /// The peer listener's router: Raft's protocol plus the usage endpoint.
    /// `coordinator` must be the [`Coordinator::Replicated`] holding `self`.
    pub fn peer_router_arc(&self, coordinator: &Arc<Coordinator>) -> Router {
        let usage = Router::new()
            .route(PATH_USAGE, post(receive_usage))
            .with_state(coordinator.clone());
        self.raft.peer_router().merge(usage)
    }

    pub async fn put_policy(
        &self,
        tenant: TenantId,
        name: PolicyName,
        policy: Policy,
    ) -> Result<Policy, CoordError> {
        let key = PolicyKey::new(tenant, name);
        match self
            .write(Operation::PutPolicy {
                key,
                policy: policy.clone(),
            })
            .await?
        {
            Response::PolicyStored { version, .. } => {
                self.rebuild_view();
                Ok(Policy { version, ..policy })
            }
            // The coordinator's own rules beyond the API's (a floor the regions cannot all
            // reserve): the caller's mistake, named like a batch's.
            Response::InvalidPolicy { fields } => Err(CoordError::InvalidPolicies {
                entries: vec![InvalidEntry { index: 0, fields }],
                total: 1,
            }),
            Response::FloorsExceedBudget { .. } => Err(CoordError::InvalidPolicies {
                entries: vec![InvalidEntry {
                    index: 0,
                    fields: vec!["floor".into()],
                }],
                total: 1,
            }),
            other => Err(unavailable(format!("unexpected answer {other:?}"))),
        }
    }

    /// Stores `batch` as one replicated command: all or none, consecutive versions in order.
    pub async fn put_policies(&self, batch: Vec<PolicyPut>) -> Result<Vec<Policy>, CoordError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let mut policies = Vec::with_capacity(batch.len());
        let entries = batch
            .into_iter()
            .map(|(tenant, name, policy)| {
                policies.push(policy.clone());
                (PolicyKey::new(tenant, name), policy)
            })
            .collect();
        match self.write(Operation::PutPolicies { entries }).await? {
            Response::PoliciesStored { versions, .. } => {
                self.rebuild_view();
                for (version, policy) in versions.into_iter().zip(&mut policies) {
                    policy.version = version;
                }
                Ok(policies)
            }
            Response::InvalidPolicies { entries, total } => {
                Err(CoordError::InvalidPolicies { entries, total })
            }
            Response::BatchTooLarge { max } => Err(CoordError::Rejected {
                message: format!("a batch holds at most {max} policies"),
            }),
            other => Err(unavailable(format!("unexpected answer {other:?}"))),
        }
    }

    pub async fn delete_policy(
        &self,
        tenant: TenantId,
        name: PolicyName,
    ) -> Result<bool, CoordError> {
        let key = PolicyKey::new(tenant, name);
        let r = self.write(Operation::DeletePolicy { key }).await?;
        self.rebuild_view();
        Ok(matches!(r, Response::PolicyDeleted { .. }))
    }

    /// Pins `tenant` to `home` in one command: its live policies now, and any put later.
    pub async fn pin(&self, tenant: TenantId, home: RegionId) -> Result<(), CoordError> {
        if !self.regions.contains(&home) {
            return Err(CoordError::UnknownRegion { region: home });
        }
        match self.write(Operation::PinTenant { tenant, home }).await? {
            Response::TenantPinned { .. } => {
                self.rebuild_view();
                Ok(())
            }
            // Configured but not registered yet (the leader adds regions on its first round).
            Response::UnknownRegion { region } => Err(CoordError::UnknownRegion { region }),
            other => Err(unavailable(format!("unexpected answer {other:?}"))),
        }
    }

    /// Removes `tenant`'s pin and its policies' operator pins in one command; `false` if the
    /// tenant was not pinned.
    pub async fn unpin(&self, tenant: TenantId) -> Result<bool, CoordError> {
        match self.write(Operation::UnpinTenant { tenant }).await? {
            Response::TenantUnpinned { .. } => {
                self.rebuild_view();
                Ok(true)
            }
            Response::TenantNotPinned => Ok(false),
            other => Err(unavailable(format!("unexpected answer {other:?}"))),
        }
    }

    /// Adds a learner and registers its region, so the allocator may give it share once it
    /// holds a lease.
    pub async fn add_member(&self, node_id: u64, member: Member) -> Result<(), CoordError> {
        let region = RegionId::new(member.region.as_str()).map_err(|e| CoordError::Rejected {
            message: e.to_string(),
        })?;
        self.raft
            .add_learner(node_id, member)
            .await
            .map_err(membership_error)?;
        self.write(Operation::PutRegion {
            region,
            reserves_floor: true,
            draining: false,
        })
        .await?;
        Ok(())
    }

    /// Promotes a learner to voter.
    pub async fn promote_member(&self, node_id: u64) -> Result<(), CoordError> {
        self.raft.promote(node_id).await.map_err(membership_error)
    }

    /// Removes a node from the Raft group (its region's share stays until drained).
    pub async fn remove_member(&self, node_id: u64) -> Result<(), CoordError> {
        self.raft.remove(node_id).await.map_err(membership_error)
    }

    /// Raft role, leader, term and members for /v1/status.
    pub fn status(&self) -> CoordinatorStatus {
        let s = self.raft.status();
        let region_of = |id: &u64| {
            s.members
                .get(id)
                .and_then(|m| RegionId::new(m.region.as_str()).ok())
        };
        CoordinatorStatus {
            role: match s.role {
                Role::Leader => "leader",
                Role::Follower => "follower",
                Role::Candidate => "candidate",
                Role::Learner => "learner",
                Role::Shutdown => "shutdown",
            },
            leader: s.leader_id.as_ref().and_then(region_of),
            term: s.term,
            applied_index: s.last_applied_index.unwrap_or(0),
            members: s
                .members
                .keys()
                .filter_map(|id| {
                    region_of(id).map(|region| MemberStatus {
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

/// The view of `s` at `revision`. Its policies are `derived`'s as they are when built at the
/// same revision (lease renewals leave it alone: O(regions) per view), and otherwise brought
/// in line entry by entry ([`sync_policies`]: an allocation-free walk, and only changed
/// entries rebuilt), never rebuilt whole after the first view.
fn view_of(
    derived: &mut Option<Derived>,
    s: &CoordinatorState,
    revision: u64,
    lease_end_local_ms: u64,
) -> ClusterView {
    let d = match derived.take() {
        Some(d) if d.revision == revision => d,
        Some(mut d) => {
            sync_policies(&mut d.policies, s);
            d.tenant_pins = Arc::new(pins_of(s));
            d.revision = revision;
            d
        }
        None => {
            let mut policies = PolicyMap::new();
            sync_policies(&mut policies, s);
            Derived {
                revision,
                policies,
                tenant_pins: Arc::new(pins_of(s)),
            }
        }
    };
    let view = ClusterView {
        policies: d.policies.clone(),
        tenant_pins: d.tenant_pins.clone(),
        region_leases: region_leases_of(s),
        epoch: s.epoch,
        lease_end_local_ms,
        last_version: s.last_version,
    };
    *derived = Some(d);
    view
}

/// The view's entry for a live policy: its grant in every region, and its home.
fn entry_of(s: &CoordinatorState, entry: &Entry) -> PolicyEntry {
    let mut grants = BTreeMap::new();
    for (i, slot) in s.regions.iter().enumerate() {
        if let Some(r) = slot {
            grants.insert(r.id.clone(), grant_of(s, entry, i));
        }
    }
    let home = entry
        .pin
        .and_then(|p| s.region(usize::from(p.home)))
        .map(|r| r.id.clone());
    PolicyEntry {
        policy: entry.policy.clone(),
        grants,
        home,
    }
}

fn grant_of(s: &CoordinatorState, entry: &Entry, slot: usize) -> Grant {
    let share_ppm = entry.share(slot);
    Grant {
        share_ppm,
        floor_ppm: s.floor_of(&entry.policy, slot).min(share_ppm),
    }
}

/// Whether `old` is what [`entry_of`] would build now, without building it.
fn entry_matches(s: &CoordinatorState, entry: &Entry, old: &PolicyEntry) -> bool {
    let home = entry
        .pin
        .and_then(|p| s.region(usize::from(p.home)))
        .map(|r| &r.id);
    if old.policy != entry.policy || old.home.as_ref() != home {
        return false;
    }
    let mut regions = 0;
    for (i, slot) in s.regions.iter().enumerate() {
        if let Some(r) = slot {
            regions += 1;
            if old.grants.get(&r.id) != Some(&grant_of(s, entry, i)) {
                return false;
            }
        }
    }
    regions == old.grants.len()
}

/// Brings `map` in line with the live policies of `s`: one walk over both in key order, which
/// allocates nothing for an unchanged entry; changed, new and gone entries are then updated in
/// place, each O(log n).
fn sync_policies(map: &mut PolicyMap, s: &CoordinatorState) {
    use std::cmp::Ordering;
    let order = |k: &(TenantId, PolicyName), key: &PolicyKey| {
        k.0.cmp(&key.tenant).then_with(|| k.1.cmp(&key.policy))
    };
    let mut upserts = Vec::new();
    let mut removals = Vec::new();
    let mut old = map.iter().peekable();
    for (key, entry) in s.entries.iter().filter(|(_, e)| !e.deleted) {
        loop {
            match old.peek() {
                Some((k, v)) => match order(k, key) {
                    Ordering::Less => {
                        removals.push((*k).clone());
                        old.next();
                    }
                    Ordering::Equal => {
                        if !entry_matches(s, entry, v) {
                            upserts.push((key, entry));
                        }
                        old.next();
                        break;
                    }
                    Ordering::Greater => {
                        upserts.push((key, entry));
                        break;
                    }
                },
                None => {
                    upserts.push((key, entry));
                    break;
                }
            }
        }
    }
    removals.extend(old.map(|(k, _)| k.clone()));
    for k in removals {
        map.remove(&k);
    }
    for (key, entry) in upserts {
        map.insert((key.tenant.clone(), key.policy.clone()), entry_of(s, entry));
    }
}

/// Pinned tenants and their home region.
fn pins_of(s: &CoordinatorState) -> BTreeMap<TenantId, RegionId> {
    s.tenant_pins
        .iter()
        .filter_map(|(t, &home)| {
            s.region(usize::from(home))
                .map(|r| (t.clone(), r.id.clone()))
        })
        .collect()
}

/// Every region's lease end (coordinator time), for display.
fn region_leases_of(s: &CoordinatorState) -> BTreeMap<RegionId, u64> {
    s.regions
        .iter()
        .flatten()
        .map(|r| (r.id.clone(), r.lease_expires_at_ms))
        .collect()
}

/// POST /quotad/v1/usage on the leader, authenticated with the peer token.
async fn receive_usage(
    State(coordinator): State<Arc<Coordinator>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> StatusCode {
    let Coordinator::Replicated(me) = coordinator.as_ref() else {
        return StatusCode::NOT_FOUND;
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !token_matches(me.peer_token.expose(), presented) {
        return StatusCode::UNAUTHORIZED;
    }
    let Ok(report) = serde_json::from_slice::<UsageReport>(&body) else {
        return StatusCode::BAD_REQUEST;
    };
    if !me.raft.is_leader() {
        return StatusCode::MISDIRECTED_REQUEST;
    }
    me.record_report(&report);
    StatusCode::NO_CONTENT
}

fn membership_error(e: quota_raft::MembershipError) -> CoordError {
    use quota_raft::MembershipError as M;
    match e {
        M::NotLeader { leader_id } => CoordError::NotLeader { leader: leader_id },
        M::Rejected { message } => CoordError::Rejected { message },
        M::UnknownNode { node_id } => CoordError::UnknownNode { node_id },
        other => unavailable(other),
    }
}

#[cfg(test)]
mod tests {
    use quota_core::coordinator::{
        Command, HomeChange, Operation, PolicyKey, RequestId, ShareEntry,
    };
    use quota_core::{PolicySpec, PPM};
    use rand::{Rng as _, SeedableRng as _};

    use super::*;

    fn apply(s: &mut CoordinatorState, id: u128, now_ms: u64, op: Operation) -> Response {
        s.apply(&Command {
            request: RequestId(id),
            now_ms,
            op,
        })
    }

    fn key(tenant: &str, policy: &str) -> PolicyKey {
        PolicyKey::new(
            TenantId::new(tenant).unwrap(),
            PolicyName::new(policy).unwrap(),
        )
    }

    fn put_policy(s: &mut CoordinatorState, id: u128, tenant: &str) {
        let policy = PolicySpec {
            limit: 100.0,
            window_ms: 1000.0,
            ..Default::default()
        }
        .validate()
        .unwrap();
        let r = apply(
            s,
            id,
            1_000,
            Operation::PutPolicy {
                key: key(tenant, "w"),
                policy,
            },
        );
        assert!(matches!(r, Response::PolicyStored { .. }), "{r:?}");
    }

    fn put_region(s: &mut CoordinatorState, id: u128, name: &str) {
        let op = Operation::PutRegion {
            region: RegionId::new(name).unwrap(),
            reserves_floor: true,
            draining: false,
        };
        apply(s, id, 1_000, op);
    }

    /// The reference: every live policy built from scratch.
    fn full(s: &CoordinatorState) -> PolicyMap {
        s.entries
            .iter()
            .filter(|(_, e)| !e.deleted)
            .map(|(k, e)| ((k.tenant.clone(), k.policy.clone()), entry_of(s, e)))
            .collect()
    }

    #[test]
    fn renewals_reuse_the_policies_and_other_changes_update_them() {
        let mut s = CoordinatorState::default();
        put_region(&mut s, 1, "eu");
        put_region(&mut s, 2, "us");
        for i in 0..3 {
            put_policy(&mut s, 10 + i, &format!("t{i}"));
        }
        let mut derived = None;
        let v1 = view_of(&mut derived, &s, 7, 100);
        assert_eq!(v1.policies, full(&s));
        assert_eq!(v1.policies.len(), 3);

        let eu = RegionId::new("eu").unwrap();
        let renew = Operation::RenewLease {
            region: eu.clone(),
            acked_epoch: s.epoch,
        };
        apply(&mut s, 20, 5_000, renew);
        let v2 = view_of(&mut derived, &s, 7, 200);
        assert!(v1.policies.ptr_eq(&v2.policies), "kept across a renewal");
        assert!(Arc::ptr_eq(&v1.tenant_pins, &v2.tenant_pins));
        assert_eq!(v2.lease_end_local_ms, 200);
        assert!(v2.region_leases[&eu] > v1.region_leases[&eu], "{v2:?}");
        assert_eq!(v2.policies, full(&s), "and still what a full build gives");

        put_policy(&mut s, 30, "t9");
        let v3 = view_of(&mut derived, &s, 8, 200);
        assert_eq!(v3.policies.len(), 4);
        assert_eq!(v3.policies, full(&s));
        // The version counter comes with the view, for the agent's sweep.
        assert_eq!((v1.last_version, v3.last_version), (3, 4));
        assert_eq!(v2.policies.len(), 3, "an earlier view is not changed");
    }

    #[test]
    fn a_removed_region_leaves_every_entry() {
        let mut s = CoordinatorState::default();
        for (i, r) in ["eu", "us", "ap"].iter().enumerate() {
            put_region(&mut s, i as u128, r);
        }
        for i in 0..4 {
            put_policy(&mut s, 10 + i, &format!("t{i}"));
        }
        let mut derived = None;
        let v1 = view_of(&mut derived, &s, 1, 0);
        assert!(v1.policies.values().all(|e| e.grants.len() == 3));
        // Drain ap: no floor, its shares cut to nothing, then removed.
        let ap = RegionId::new("ap").unwrap();
        let drain = Operation::PutRegion {
            region: ap.clone(),
            reserves_floor: false,
            draining: true,
        };
        apply(&mut s, 20, 2_000, drain);
        let entries = s
            .entries
            .iter()
            .map(|(k, e)| ShareEntry {
                key: k.clone(),
                shares_ppm: vec![e.share(0), e.share(1), 0],
                home: HomeChange::Keep,
            })
            .collect();
        let membership = s.membership;
        let r = apply(
            &mut s,
            21,
            3_000,
            Operation::SetShares {
                membership,
                entries,
            },
        );
        assert!(
            matches!(r, Response::SharesSet { accepted: 4, .. }),
            "{r:?}"
        );
        let r = apply(&mut s, 22, 4_000, Operation::RemoveRegion { region: ap });
        assert!(matches!(r, Response::RegionRemoved { .. }), "{r:?}");
        let v2 = view_of(&mut derived, &s, 2, 0);
        assert!(v2.policies.values().all(|e| e.grants.len() == 2), "{v2:?}");
        assert_eq!(v2.policies, full(&s));
    }

    /// Seeded random commands of every kind that changes the view; after every few, the view
    /// brought in line entry by entry equals a full rebuild.
    #[test]
    fn entry_by_entry_updates_equal_a_full_rebuild() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut s = CoordinatorState::default();
        put_region(&mut s, 1, "eu");
        put_region(&mut s, 2, "us");
        let mut derived = None;
        let regions = ["eu", "us", "ap"];
        let mut id = 100u128;
        let mut now = 1_000u64;
        let mut shares_moved = 0;
        for round in 0..400u64 {
            id += 1;
            now += 10;
            let tenant = format!("t{}", rng.random_range(0..30));
            let policy = ["a", "b", "c"][rng.random_range(0..3)];
            let op = match rng.random_range(0..9) {
                0 | 1 => Operation::PutPolicy {
                    key: key(&tenant, policy),
                    policy: PolicySpec {
                        limit: f64::from(rng.random_range(1..1000u32)),
                        window_ms: 1000.0,
                        floor: Some(0.05),
                        ..Default::default()
                    }
                    .validate()
                    .unwrap(),
                },
                2 => Operation::DeletePolicy {
                    key: key(&tenant, policy),
                },
                3 => Operation::PinTenant {
                    tenant: TenantId::new(&tenant).unwrap(),
                    home: RegionId::new(regions[rng.random_range(0..2)]).unwrap(),
                },
                4 => Operation::UnpinTenant {
                    tenant: TenantId::new(&tenant).unwrap(),
                },
                5 | 6 => {
                    // A small cut of one region's share of every live policy.
                    let slots = s.regions.len();
                    let entries = s
                        .entries
                        .iter()
                        .filter(|(_, e)| !e.deleted)
                        .map(|(k, e)| {
                            let mut shares: Vec<u32> = (0..slots).map(|i| e.share(i)).collect();
                            // Cuts only: always safe, so the state takes them.
                            let from = rng.random_range(0..slots);
                            let step = shares[from].min(rng.random_range(1..PPM / 10));
                            shares[from] -= step;
                            ShareEntry {
                                key: k.clone(),
                                shares_ppm: shares,
                                home: HomeChange::Keep,
                            }
                        })
                        .collect();
                    Operation::SetShares {
                        membership: s.membership,
                        entries,
                    }
                }
                7 => Operation::PutRegion {
                    region: RegionId::new(regions[rng.random_range(0..3)]).unwrap(),
                    reserves_floor: rng.random_bool(0.5),
                    draining: false,
                },
                _ => Operation::RenewLease {
                    region: RegionId::new(regions[rng.random_range(0..2)]).unwrap(),
                    acked_epoch: s.epoch,
                },
            };
            if let Response::SharesSet { accepted, .. } = apply(&mut s, id, now, op) {
                shares_moved += accepted;
            }
            if round % 3 == 0 {
                let v = view_of(&mut derived, &s, round, 0);
                assert_eq!(v.policies, full(&s), "round {round}");
                assert_eq!(*v.tenant_pins, pins_of(&s), "round {round}");
            }
        }
        assert!(!full(&s).is_empty(), "the run left policies to compare");
        assert!(shares_moved > 50, "shares moved {shares_moved} times");
    }
}
