//! The control plane of the rebalancing strategies, driving quota-core's real coordinator.
//!
//! ```text
//!  each daemon, every report interval:  RenewDaemonLease{node, acked epoch} ──WAN──▶ leader
//!                                       the agent's holder: + usage report
//!                                       a standby whose holder went quiet: ClaimAgent
//!  a holder stopping (SIGTERM):         ReleaseAgent{node, fence} ──WAN──▶ leader
//!  a new holder, after its first pass:  AgentPassed{node, fence} ──WAN──▶ leader
//!  leader, on a report:                 DemandTracker::record
//!  leader, on a daemon's write:         propose it
//!  leader, every rebalance interval:    allocator::plan(committed, demand) ─▶ SetShares commands
//!  proposal ──(quorum round trip)──▶ commit: CoordinatorState::apply on the log's state
//!  commit ──WAN──▶ each region's replica applies the log; LeaseRenewed / AgentClaimed ──WAN──▶
//!                  the daemon that asked
//!  region decision: enforced_share(grant the holder wrote, lease it wrote, own drifted clock)
//! ```
//!
//! Replication is modelled, not run: a command commits one quorum round trip after the leader
//! proposed it (the k-th fastest reachable follower), if the leader is up and reaches a
//! majority, and is then applied to the committed [`CoordinatorState`]. Each region holds a
//! replica (its daemons share it) and applies the committed log once it can hear the leader. A
//! leader that is down or cut off from the majority is replaced after the election timeout by
//! the lowest region that reaches a majority; the new leader starts with empty demand
//! estimates (they are soft state) and relearns them. Proposals not committed when leadership
//! changes are lost.
//!
//! Elections model quotad's election guard (a pre-vote): a node campaigns only when a majority
//! has lost its leader, so a cut-off or flapping follower never unseats a leader that reaches a
//! majority. In [`LeaseMode::Leased`] a region whose lease has lapsed stops counting in the
//! allocator (quota-core's rule), so its share, all but the floor, moves to the others. Without
//! leases there is no such signal, so the leader treats a region it has not heard from for
//! three report intervals as having no demand (it records empty reports for it). In
//! [`LeaseMode::NoLease`] every share decrease is acknowledged on the region's behalf as soon
//! as it commits (the coordinator does not wait), and regions ignore leases and keep enforcing
//! their last grant.
//!
//! A region runs one daemon, or two where its agent's holder stops
//! ([`crate::faults::Fault::AgentStop`]). Each daemon renews a lease of its own and
//! acknowledges the epoch it enforces: the holder the epoch of its last complete pass (every
//! bucket written to Redis), a standby its view's. The region's acknowledgement is quota-core's:
//! the least among daemons whose lease and margin have not run out. Checks are decided against
//! what Redis holds, the grants and lease end the holder last wrote. A holder stopping on
//! SIGTERM sends `ReleaseAgent` once it no longer writes: the role is free at once and the
//! standby claims at its next look. A killed one may only be paused: its record counts as a
//! live daemon's, and the standby claims after [`TAKEOVER_INTERVALS`] report intervals without
//! its renewals (quotad's watch). Either way the stopped holder's record stays, its
//! acknowledgement frozen at its last pass (quota-core marks it as left at the release or at the
//! claim that replaces it). Meanwhile usage stays counted in Redis; the new holder writes every
//! bucket at its replica's epoch, then sends `AgentPassed`. Its commit drops a released
//! holder's record, whose pass Redis held until then. A killed holder's record, deposed by the
//! claim, holds until its lease and margin run out, whatever the new holder writes: a paused
//! daemon may resume and decide in process on its old view until its own lease ends. The new
//! holder's first report carries the usage since the last one, over that whole interval.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use quota_core::allocator::{plan, AllocatorConfig};
use quota_core::coordinator::{AgentRole, RegionShare};
use quota_core::demand::{DemandTracker, Usage};
use quota_core::lease::LeaseConfig;
use quota_core::region::{enforced_share, RegionLease, RegionView};
use quota_core::{
    Command, CoordinatorState, Operation, Policy, PolicyKey, PolicyName, RegionId, RequestId,
    Response, TenantId,
};
use serde::Serialize;

use crate::faults::{Stop, RESTART_MS};
use crate::traffic::Tenant;
use crate::world::{RegionIx, World};

/// Control-plane timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ControlConfig {
    /// Regions send usage reports (and lease renewals) this often.
    pub report_ms: u64,
    /// The leader runs the allocator this often.
    pub rebalance_ms: u64,
    /// How long a renewal lets a region enforce its share.
    pub lease_ms: u64,
    /// Subtracted by regions, added by the coordinator (see `quota_core::lease`).
    pub drift_margin_ms: u64,
    /// How long the survivors take to elect a new leader after losing the old one.
    pub election_ms: u64,
}

impl Default for ControlConfig {
    fn default() -> Self {
        Self {
            report_ms: 1_000,
            rebalance_ms: 2_000,
            lease_ms: 10_000,
            drift_margin_ms: 1_000,
            election_ms: 4_500,
        }
    }
}

/// Whether regions honour leases (quotad) or keep their last grant for ever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseMode {
    Leased,
    NoLease,
}

/// Reports missed before the leader counts a region's demand as zero ([`LeaseMode::NoLease`]).
const SILENT_REPORTS: u64 = 3;

/// Report intervals without the holder's renewals after which a standby claims the agent role
/// (quotad's `TAKEOVER_INTERVALS`: a renewal or two lost to an election must not depose it).
pub const TAKEOVER_INTERVALS: u64 = 3;

/// Whom a proposal answers once it commits.
#[derive(Debug, Clone, Copy)]
enum Reply {
    /// No one (the allocator's shares, a release).
    None,
    /// A renewal's lease, to daemon `node` of `region`, counted from when it was sent.
    Lease {
        region: RegionIx,
        node: u64,
        sent_local_ms: u64,
    },
    /// A claim's answer, to daemon `node` of `region`.
    Claim { region: RegionIx, node: u64 },
    /// An `AgentPassed`'s answer, to daemon `node` of `region` holding `fence`.
    Passed {
        region: RegionIx,
        node: u64,
        fence: u64,
    },
}

#[derive(Debug)]
enum Event {
    /// The agent's usage report reaches the leader `to`, over the last `interval_ms`.
    Usage {
        from: RegionIx,
        to: RegionIx,
        usage: Vec<(PolicyKey, Usage)>,
        interval_ms: u64,
    },
    /// A daemon's write (a renewal, a claim, a release) reaches the leader `to`.
    Write {
        to: RegionIx,
        op: Operation,
        reply: Reply,
    },
    /// A proposal reaches its quorum.
    Commit {
        term: u64,
        cmd: Command,
        reply: Reply,
    },
    /// A renewal's lease reaches its daemon.
    Lease {
        region: RegionIx,
        node: u64,
        lease: RegionLease,
    },
    /// A won claim's fence reaches its daemon.
    Claimed {
        region: RegionIx,
        node: u64,
        fence: u64,
    },
    /// The answer to a holder's `AgentPassed` under `fence` reaches it.
    Passed {
        region: RegionIx,
        node: u64,
        fence: u64,
    },
    /// A daemon started in a stopped one's place joins `region` as a standby.
    Join { region: RegionIx },
}

#[derive(Debug)]
struct Timed {
    at_ms: u64,
    seq: u64,
    event: Event,
}

impl PartialEq for Timed {
    fn eq(&self, other: &Self) -> bool {
        (self.at_ms, self.seq) == (other.at_ms, other.seq)
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Timed {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at_ms, self.seq).cmp(&(other.at_ms, other.seq))
    }
}

/// One running daemon of a region.
#[derive(Debug)]
struct Daemon {
    /// Its Raft node id: its lease record's key.
    node: u64,
    /// Its lease clock: the epoch it acknowledges and the lease of its own renewals.
    view: RegionView,
    /// The fence it won the agent role with, while it holds the role.
    fence: Option<u64>,
    /// Standing by: the holder's fence and lease end it last saw change, and its local time
    /// then (quotad's watch).
    seen: Option<((u64, u64), u64)>,
    /// Holding: whether the log has answered its `AgentPassed` (the holder the region boots
    /// with has nothing to replace). Until then it sends one after each complete pass, as
    /// quotad's apply loop retries a failed one at its next pass.
    passed: bool,
}

impl Daemon {
    fn new(node: u64, epoch: u64) -> Self {
        let mut view = RegionView::new();
        view.on_applied(epoch);
        Self {
            node,
            view,
            fence: None,
            seen: None,
            passed: true,
        }
    }
}

/// What a daemon does about the agent role at a look.
enum Act {
    Hold,
    Stand,
    Claim { fence_seen: u64 },
}

/// One region: its daemons, their replica of the coordinator state, and what its Redis holds.
#[derive(Debug)]
pub struct RegionDaemons {
    replica: CoordinatorState,
    /// How much of the committed log the replica applied.
    applied: usize,
    /// The running daemons; at most one holds the agent role.
    daemons: Vec<Daemon>,
    /// Per tenant: the grant the holder last wrote to Redis.
    pub grants: Vec<RegionShare>,
    /// The lease end the holder last wrote with them (its own lease).
    stored_lease: Option<RegionLease>,
    /// Per tenant: the home region when pinned.
    pub homes: Vec<Option<RegionIx>>,
    /// Per tenant: the other region granted the largest share (the lowest on a tie), where a
    /// check this region's share cannot hold is forwarded.
    pub richest: Vec<Option<RegionIx>>,
    /// Per tenant: tokens admitted and denied since the last report (counted in Redis).
    usage: Vec<Usage>,
    /// When `usage` started counting: the last report's time.
    usage_since_ms: u64,
    /// When the last holder stopped, while no daemon has taken the role over.
    holder_stopped_ms: Option<u64>,
}

impl RegionDaemons {
    /// The index of the daemon holding the agent role, if one does.
    fn holder(&self) -> Option<usize> {
        self.daemons.iter().position(|d| d.fence.is_some())
    }

    /// The agent role in the replica, and its holder's lease end there.
    fn role(&self, r: RegionIx) -> (Option<AgentRole>, u64) {
        let Some(s) = self.replica.region(r) else {
            return (None, 0);
        };
        let end = s
            .agent
            .and_then(|a| s.daemons.get(&a.node))
            .map_or(0, |d| d.lease_expires_at_ms);
        (s.agent, end)
    }

    /// The holder writes the lease end it holds now (it renews the stored one as it goes).
    fn write_lease(&mut self) {
        if let Some(h) = self.holder() {
            self.stored_lease = self.daemons[h].view.lease().copied();
        }
    }
}

/// What each region's agent did over a run, per region.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct AgentCounts {
    /// Usage reports sent to a leader.
    pub usage_reports: Vec<u64>,
    /// Times the daemon holding the agent role stopped.
    pub stops: Vec<u64>,
    /// Per takeover: from the holder's stop to the next holder's first complete pass, in ms.
    pub takeovers_ms: Vec<Vec<u64>>,
}

/// The coordinator cluster and the region agents, driven in virtual time.
#[derive(Debug)]
pub struct Control {
    cfg: ControlConfig,
    mode: LeaseMode,
    alloc: AllocatorConfig,
    keys: Vec<PolicyKey>,
    region_ids: Vec<RegionId>,
    committed: CoordinatorState,
    /// Committed commands with their commit times.
    log: Vec<(u64, Command)>,
    events: BinaryHeap<Reverse<Timed>>,
    seq: u64,
    next_request: u128,
    /// The node id the next daemon started gets.
    next_node: u64,
    leader: Option<RegionIx>,
    term: u64,
    leader_lost_at_ms: Option<u64>,
    demand: DemandTracker,
    last_report_ms: Vec<u64>,
    next_report_ms: u64,
    next_rebalance_ms: u64,
    /// Agent stops before this time have been played.
    next_stop_ms: u64,
    pub regions: Vec<RegionDaemons>,
    /// Holders stopped since the strategy last asked: their in-process state goes with them.
    stopped: Vec<(RegionIx, Stop)>,
    /// Commands `apply` answered with something other than success (should stay 0).
    pub rejected_commands: u64,
    pub counts: AgentCounts,
}

/// The policy key of tenant `i` in the simulated cluster.
fn key_of(i: usize) -> PolicyKey {
    let tenant = TenantId::new(format!("t{i}")).expect("t<digits> is a valid tenant id");
    PolicyKey::new(
        tenant,
        PolicyName::new("requests").expect("a valid policy name"),
    )
}

impl Control {
    /// Boots a cluster of `world.regions` regions with every tenant's policy registered, every
    /// daemon holding a fresh lease at time 0 and the first of each region the agent role.
    /// `policies` are what gets registered (the caller decides, e.g., whether critical tiers
    /// stay critical).
    pub fn new(
        world: &World,
        tenants: &[Tenant],
        policies: impl Fn(&Tenant) -> Policy,
        cfg: ControlConfig,
        mode: LeaseMode,
    ) -> Self {
        let n = world.regions;
        let alloc = AllocatorConfig::default();
        let region_ids: Vec<RegionId> = (0..n)
            .map(|r| RegionId::new(format!("r{r}")).expect("valid region id"))
            .collect();
        let keys: Vec<PolicyKey> = (0..tenants.len()).map(key_of).collect();
        let mut c = Self {
            cfg,
            mode,
            alloc,
            keys,
            region_ids,
            committed: CoordinatorState::default(),
            log: Vec::new(),
            events: BinaryHeap::new(),
            seq: 0,
            next_request: 0,
            next_node: 1,
            leader: Some(0),
            term: 1,
            leader_lost_at_ms: None,
            demand: DemandTracker::new(alloc.ewma_alpha_ppm),
            last_report_ms: vec![0; n],
            next_report_ms: cfg.report_ms,
            next_rebalance_ms: cfg.rebalance_ms,
            next_stop_ms: 0,
            regions: Vec::new(),
            stopped: Vec::new(),
            rejected_commands: 0,
            counts: AgentCounts {
                usage_reports: vec![0; n],
                stops: vec![0; n],
                takeovers_ms: vec![Vec::new(); n],
            },
        };
        c.boot(tenants, policies);
        for r in 0..n {
            c.add_region(world, r, tenants.len());
        }
        c
    }

    /// Commits, at time 0, the lease config, every region and every tenant's policy.
    fn boot(&mut self, tenants: &[Tenant], policies: impl Fn(&Tenant) -> Policy) {
        let lease = LeaseConfig {
            lease_ms: self.cfg.lease_ms,
            drift_margin_ms: self.cfg.drift_margin_ms,
        };
        let mut boot = vec![Operation::SetLeaseConfig { config: lease }];
        for id in &self.region_ids {
            boot.push(Operation::PutRegion {
                region: id.clone(),
                reserves_floor: true,
                draining: false,
            });
        }
        for (key, t) in self.keys.iter().zip(tenants) {
            boot.push(Operation::PutPolicy {
                key: key.clone(),
                policy: policies(t),
            });
        }
        for op in boot {
            self.commit_now(0, op);
        }
    }

    /// Region `r`'s daemons, each with a first lease committed at time 0, the first holding
    /// the agent role.
    fn add_region(&mut self, world: &World, r: RegionIx, tenants: usize) {
        let epoch = self.committed.epoch;
        let id = self.region_ids[r].clone();
        let mut daemons = Vec::new();
        for _ in 0..world.daemons(r) {
            let node = self.next_node;
            self.next_node += 1;
            self.commit_now(
                0,
                Operation::RenewDaemonLease {
                    region: id.clone(),
                    node,
                    acked_epoch: epoch,
                },
            );
            let mut d = Daemon::new(node, epoch);
            d.view.on_renewal(RegionLease {
                epoch,
                start_local_ms: world.local_ms(r, 0),
                lease_ms: self.cfg.lease_ms,
            });
            daemons.push(d);
        }
        let claim = Operation::ClaimAgent {
            region: id,
            node: daemons[0].node,
            fence_seen: 0,
        };
        let Response::AgentClaimed { fence } = self.commit_now(0, claim) else {
            panic!("a free agent role is claimed");
        };
        daemons[0].fence = Some(fence);
        self.regions.push(RegionDaemons {
            replica: self.committed.clone(),
            applied: self.log.len(),
            daemons,
            grants: Vec::new(),
            stored_lease: None,
            homes: Vec::new(),
            richest: Vec::new(),
            usage: vec![Usage::default(); tenants],
            usage_since_ms: 0,
            holder_stopped_ms: None,
        });
        self.refresh_routing(r);
        self.refresh_grants(r);
        self.regions[r].write_lease();
    }

    fn request_id(&mut self) -> RequestId {
        self.next_request += 1;
        RequestId(self.next_request)
    }

    /// Applies an operation to the committed state at once (bootstrap only).
    fn commit_now(&mut self, now_ms: u64, op: Operation) -> Response {
        let cmd = Command {
            request: self.request_id(),
            now_ms,
            op,
        };
        let resp = self.committed.apply(&cmd);
        self.log.push((now_ms, cmd));
        resp
    }

    fn push(&mut self, at_ms: u64, event: Event) {
        self.seq += 1;
        self.events.push(Reverse(Timed {
            at_ms,
            seq: self.seq,
            event,
        }));
    }

    /// Whether `l` is up and reaches a majority of the cluster at `t_ms`.
    fn has_quorum(&self, world: &World, l: RegionIx, t_ms: u64) -> bool {
        world.quorum_rtt_ms(l, t_ms).is_some()
    }

    /// The current leader, if one is serving.
    pub fn leader(&self) -> Option<RegionIx> {
        self.leader
    }

    fn propose(&mut self, world: &World, t_ms: u64, op: Operation, reply: Reply) {
        let Some(l) = self.leader else { return };
        let Some(rtt) = world.quorum_rtt_ms(l, t_ms) else {
            return;
        };
        let cmd = Command {
            request: self.request_id(),
            now_ms: world.local_ms(l, t_ms),
            op,
        };
        let term = self.term;
        self.push(t_ms + rtt, Event::Commit { term, cmd, reply });
    }

    /// The leader `from` reaches at `at_ms`, if any: a message to it arrives one one-way delay
    /// later.
    fn reachable_leader(&self, world: &World, from: RegionIx, at_ms: u64) -> Option<RegionIx> {
        let l = self.leader?;
        (world.link_up(from, l, at_ms) && world.daemon_up(l, at_ms)).then_some(l)
    }

    /// Sends a daemon's write from region `r` to the leader (lost if it cannot be reached).
    fn send_write(&mut self, world: &World, r: RegionIx, at_ms: u64, op: Operation, reply: Reply) {
        if let Some(l) = self.reachable_leader(world, r, at_ms) {
            let arrive = at_ms + world.owd_ms(r, l);
            let write = Event::Write { to: l, op, reply };
            self.push(arrive, write);
        }
    }

    fn elect(&mut self, world: &World, t_ms: u64) {
        if let Some(l) = self.leader {
            if self.has_quorum(world, l, t_ms) {
                self.leader_lost_at_ms = None;
                return;
            }
        }
        let lost = *self.leader_lost_at_ms.get_or_insert(t_ms);
        if t_ms < lost + self.cfg.election_ms {
            return;
        }
        let candidate = (0..world.regions).find(|&r| self.has_quorum(world, r, t_ms));
        if let Some(c) = candidate {
            if self.leader != Some(c) {
                // Soft state does not survive a change of leader.
                self.demand = DemandTracker::new(self.alloc.ewma_alpha_ppm);
                self.last_report_ms.fill(t_ms);
            }
            self.leader = Some(c);
            self.term += 1;
            self.leader_lost_at_ms = None;
        } else {
            self.leader = None;
        }
    }

    /// Every report interval, in each region whose daemons run: every daemon looks at the agent
    /// role (claiming it if free or its holder went quiet), the holder reports the usage Redis
    /// counted, and every daemon renews its lease with the epoch it acknowledges.
    fn send_reports(&mut self, world: &World, at_ms: u64) {
        for r in 0..world.regions {
            if !world.daemon_up(r, at_ms) {
                self.regions[r].usage_since_ms = at_ms;
                continue;
            }
            for d in 0..self.regions[r].daemons.len() {
                match self.look(world, r, d, at_ms) {
                    Act::Hold => self.report_usage(world, r, at_ms),
                    Act::Stand => {}
                    Act::Claim { fence_seen } => {
                        let op = Operation::ClaimAgent {
                            region: self.region_ids[r].clone(),
                            node: self.regions[r].daemons[d].node,
                            fence_seen,
                        };
                        let node = self.regions[r].daemons[d].node;
                        self.send_write(world, r, at_ms, op, Reply::Claim { region: r, node });
                    }
                }
                let daemon = &self.regions[r].daemons[d];
                let (node, acked_epoch) = (daemon.node, daemon.view.applied_epoch());
                let op = Operation::RenewDaemonLease {
                    region: self.region_ids[r].clone(),
                    node,
                    acked_epoch,
                };
                let sent_local_ms = world.local_ms(r, at_ms);
                let reply = Reply::Lease {
                    region: r,
                    node,
                    sent_local_ms,
                };
                self.send_write(world, r, at_ms, op, reply);
            }
        }
    }

    /// What daemon `d` of region `r` does about the agent role at `at_ms`, as quotad's watch
    /// decides from the replica: a holder the replica no longer shows is deposed; a standby
    /// claims a free role at once, and a held one once its holder's fence and lease end have
    /// not moved for [`TAKEOVER_INTERVALS`] report intervals.
    fn look(&mut self, world: &World, r: RegionIx, d: usize, at_ms: u64) -> Act {
        let takeover_ms = TAKEOVER_INTERVALS * self.cfg.report_ms;
        let local = world.local_ms(r, at_ms);
        let region = &mut self.regions[r];
        let (role, end) = region.role(r);
        let daemon = &mut region.daemons[d];
        if let Some(fence) = daemon.fence {
            if role
                == Some(AgentRole {
                    node: daemon.node,
                    fence,
                })
            {
                return Act::Hold;
            }
            daemon.fence = None;
        }
        let Some(role) = role else {
            return Act::Claim { fence_seen: 0 };
        };
        if role.node == daemon.node {
            // Its own claim won but the answer was lost: claimed anew.
            return Act::Claim {
                fence_seen: role.fence,
            };
        }
        let seen = (role.fence, end);
        match daemon.seen {
            Some((s, since)) if s == seen => {
                if local.saturating_sub(since) >= takeover_ms {
                    Act::Claim {
                        fence_seen: role.fence,
                    }
                } else {
                    Act::Stand
                }
            }
            _ => {
                daemon.seen = Some((seen, local));
                Act::Stand
            }
        }
    }

    /// The holder of region `r` drains the usage Redis counted and sends it to the leader, over
    /// the interval since the last report.
    fn report_usage(&mut self, world: &World, r: RegionIx, at_ms: u64) {
        let region = &mut self.regions[r];
        let interval_ms = at_ms - region.usage_since_ms;
        region.usage_since_ms = at_ms;
        let usage: Vec<_> = region
            .usage
            .iter_mut()
            .enumerate()
            .filter(|(_, u)| u.admitted + u.denied > 0)
            .map(|(i, u)| (self.keys[i].clone(), std::mem::take(u)))
            .collect();
        if let Some(l) = self.reachable_leader(world, r, at_ms) {
            self.counts.usage_reports[r] += 1;
            let arrive = at_ms + world.owd_ms(r, l);
            let report = Event::Usage {
                from: r,
                to: l,
                usage,
                interval_ms,
            };
            self.push(arrive, report);
        }
    }

    fn rebalance(&mut self, world: &World, at_ms: u64) {
        let Some(l) = self.leader else { return };
        if !self.has_quorum(world, l, at_ms) {
            return;
        }
        for r in (0..world.regions).filter(|_| self.mode == LeaseMode::NoLease) {
            if at_ms > self.last_report_ms[r] + SILENT_REPORTS * self.cfg.report_ms {
                self.demand.record(r as u8, self.cfg.rebalance_ms, &[]);
            }
        }
        let stamp = world.local_ms(l, at_ms);
        let p = plan(&self.committed, &self.demand, &self.alloc, stamp);
        let mut next = self.next_request;
        let cmds = p.into_commands(stamp, self.alloc.max_entries_per_command, || {
            next += 1;
            RequestId(next)
        });
        self.next_request = next;
        for cmd in cmds {
            self.propose(world, at_ms, cmd.op, Reply::None);
        }
    }

    fn on_commit(&mut self, world: &World, at_ms: u64, cmd: Command, reply: Reply) {
        let resp = self.committed.apply(&cmd);
        let is_shares = matches!(cmd.op, Operation::SetShares { .. });
        self.log.push((at_ms, cmd));
        let answer = match (&resp, reply) {
            (
                Response::LeaseRenewed {
                    epoch, lease_ms, ..
                },
                Reply::Lease {
                    region,
                    node,
                    sent_local_ms,
                },
            ) => {
                let lease = RegionLease {
                    epoch: *epoch,
                    start_local_ms: sent_local_ms,
                    lease_ms: *lease_ms,
                };
                Some((
                    region,
                    Event::Lease {
                        region,
                        node,
                        lease,
                    },
                ))
            }
            (Response::AgentClaimed { fence }, Reply::Claim { region, node }) => Some((
                region,
                Event::Claimed {
                    region,
                    node,
                    fence: *fence,
                },
            )),
            (Response::SharesSet { rejected_total, .. }, _) => {
                self.rejected_commands += u64::from(*rejected_total);
                None
            }
            // Done, or moot: the role moved on since.
            (
                Response::AgentPassed | Response::AgentHeld { .. },
                Reply::Passed {
                    region,
                    node,
                    fence,
                },
            ) => Some((
                region,
                Event::Passed {
                    region,
                    node,
                    fence,
                },
            )),
            // A claim that lost the race, a release.
            (Response::AgentHeld { .. } | Response::AgentReleased, _) => None,
            _ => {
                self.rejected_commands += 1;
                None
            }
        };
        if let (Some((r, event)), Some(l)) = (answer, self.leader) {
            if world.link_up(l, r, at_ms) {
                self.push(at_ms + world.owd_ms(l, r), event);
            }
        }
        if is_shares && self.mode == LeaseMode::NoLease {
            // No revoke-before-grant: every decrease counts as acknowledged at once, by every
            // daemon the region's record lists. A left record (its holder stopped or was
            // replaced) acknowledges nothing more: renewing it would only keep it holding the
            // region back.
            let epoch = self.committed.epoch;
            let nodes: Vec<(RegionIx, u64)> = (0..world.regions)
                .flat_map(|r| {
                    let daemons = self.committed.region(r).map(|s| &s.daemons);
                    daemons.into_iter().flat_map(move |d| {
                        d.iter().filter(|(_, l)| !l.left).map(move |(&n, _)| (r, n))
                    })
                })
                .collect();
            for (r, node) in nodes {
                let op = Operation::RenewDaemonLease {
                    region: self.region_ids[r].clone(),
                    node,
                    acked_epoch: epoch,
                };
                let cmd = Command {
                    request: self.request_id(),
                    now_ms: self.committed.last_now_ms,
                    op,
                };
                self.committed.apply(&cmd);
                self.log.push((at_ms, cmd));
            }
        }
    }

    /// Re-reads every tenant's grant from region `r`'s replica: the holder writes them to Redis.
    fn refresh_grants(&mut self, r: RegionIx) {
        let region = &mut self.regions[r];
        region.grants = self
            .keys
            .iter()
            .map(|k| {
                region.replica.region_share(k, r).unwrap_or(RegionShare {
                    share_ppm: 0,
                    floor_ppm: 0,
                })
            })
            .collect();
    }

    /// Re-reads every tenant's home and richest other region from region `r`'s replica: the
    /// daemons' view, which follows the log whichever daemon holds the agent role.
    fn refresh_routing(&mut self, r: RegionIx) {
        let region = &mut self.regions[r];
        region.homes = self
            .keys
            .iter()
            .map(|k| {
                region
                    .replica
                    .entries
                    .get(k)
                    .and_then(|e| e.pin)
                    .map(|p| usize::from(p.home))
            })
            .collect();
        region.richest = self
            .keys
            .iter()
            .map(|k| {
                let e = region.replica.entries.get(k)?;
                (0..e.shares_ppm.len())
                    .filter(|&o| o != r && e.share(o) > 0)
                    .max_by_key(|&o| (e.share(o), Reverse(o)))
            })
            .collect();
    }

    /// The holder of region `r` writes every bucket at its replica's epoch, with its lease, and
    /// counts that epoch as applied (what it acknowledges from then on). Until the log has
    /// answered its `AgentPassed`, it sends one: Redis now holds its whole view, so the record
    /// of the holder it replaced no longer holds the region's acknowledgement back.
    fn write_pass(&mut self, world: &World, r: RegionIx, at_ms: u64) {
        let Some(h) = self.regions[r].holder() else {
            return;
        };
        self.refresh_grants(r);
        let region = &mut self.regions[r];
        let epoch = region.replica.epoch;
        region.daemons[h].view.on_applied(epoch);
        region.write_lease();
        let holder = &region.daemons[h];
        if !holder.passed {
            let node = holder.node;
            let fence = holder.fence.expect("the holder holds a fence");
            let op = Operation::AgentPassed {
                region: self.region_ids[r].clone(),
                node,
                fence,
            };
            let reply = Reply::Passed {
                region: r,
                node,
                fence,
            };
            self.send_write(world, r, at_ms, op, reply);
        }
    }

    fn replicate(&mut self, world: &World, t_ms: u64) {
        let Some(l) = self.leader else { return };
        if !world.daemon_up(l, t_ms) {
            return;
        }
        for r in 0..world.regions {
            if !world.daemon_up(r, t_ms) || !world.link_up(l, r, t_ms) {
                continue;
            }
            let owd = world.owd_ms(l, r);
            let region = &mut self.regions[r];
            let before = region.replica.epoch;
            while region.applied < self.log.len() && self.log[region.applied].0 + owd <= t_ms {
                region.replica.apply(&self.log[region.applied].1);
                region.applied += 1;
            }
            let epoch = region.replica.epoch;
            if epoch != before {
                self.refresh_routing(r);
                // A standby enforces its view: that is what it acknowledges. The holder writes
                // the new parameters to Redis, then counts the epoch as applied.
                for d in &mut self.regions[r].daemons {
                    d.view.on_applied(epoch);
                }
                self.write_pass(world, r, t_ms);
            }
        }
    }

    /// Plays the agent stops of `from_ms..=t_ms`: the holder stops deciding and writing (Redis
    /// keeps what it wrote); on SIGTERM it then sends `ReleaseAgent`. A daemon started in its
    /// place joins [`RESTART_MS`] later.
    fn stop_holders(&mut self, world: &World, from_ms: u64, t_ms: u64) {
        for r in 0..world.regions {
            let stops: Vec<(u64, Stop)> = world.faults.agent_stops(r, from_ms, t_ms).collect();
            for (at_ms, how) in stops {
                let region = &mut self.regions[r];
                let Some(h) = region.holder() else { continue };
                let gone = region.daemons.remove(h);
                region.holder_stopped_ms = Some(at_ms);
                self.counts.stops[r] += 1;
                self.stopped.push((r, how));
                if how == Stop::Graceful {
                    let op = Operation::ReleaseAgent {
                        region: self.region_ids[r].clone(),
                        node: gone.node,
                        fence: gone.fence.expect("the holder holds a fence"),
                    };
                    self.send_write(world, r, at_ms, op, Reply::None);
                }
                self.push(at_ms + RESTART_MS, Event::Join { region: r });
            }
        }
    }

    /// The holders stopped since the last call, with how each stopped.
    pub fn take_stops(&mut self) -> Vec<(RegionIx, Stop)> {
        std::mem::take(&mut self.stopped)
    }

    /// Runs the control plane up to true time `t_ms`.
    pub fn advance(&mut self, world: &World, t_ms: u64) {
        self.elect(world, t_ms);
        if self.next_stop_ms <= t_ms {
            self.stop_holders(world, self.next_stop_ms, t_ms);
            self.next_stop_ms = t_ms + 1;
        }
        while self.next_report_ms <= t_ms {
            let at = self.next_report_ms;
            self.send_reports(world, at);
            self.next_report_ms += self.cfg.report_ms;
        }
        while self.next_rebalance_ms <= t_ms {
            let at = self.next_rebalance_ms;
            self.rebalance(world, at);
            self.next_rebalance_ms += self.cfg.rebalance_ms;
        }
        while self.events.peek().is_some_and(|e| e.0.at_ms <= t_ms) {
            let Reverse(Timed { at_ms, event, .. }) = self.events.pop().expect("peeked");
            self.on_event(world, at_ms, event);
        }
        self.replicate(world, t_ms);
    }

    fn on_event(&mut self, world: &World, at_ms: u64, event: Event) {
        match event {
            Event::Usage {
                from,
                to,
                usage,
                interval_ms,
            } => {
                if self.leader == Some(to) && world.daemon_up(to, at_ms) {
                    self.demand.record(from as u8, interval_ms, &usage);
                    self.last_report_ms[from] = at_ms;
                }
            }
            Event::Write { to, op, reply } => {
                if self.leader == Some(to) && world.daemon_up(to, at_ms) {
                    self.propose(world, at_ms, op, reply);
                }
            }
            Event::Commit { term, cmd, reply } => {
                let alive = self
                    .leader
                    .is_some_and(|l| self.has_quorum(world, l, at_ms));
                if term == self.term && alive {
                    self.on_commit(world, at_ms, cmd, reply);
                }
            }
            Event::Lease {
                region,
                node,
                lease,
            } => {
                if !world.daemon_up(region, at_ms) {
                    return;
                }
                let r = &mut self.regions[region];
                if let Some(d) = r.daemons.iter_mut().find(|d| d.node == node) {
                    d.view.on_renewal(lease);
                    r.write_lease();
                }
            }
            Event::Claimed {
                region,
                node,
                fence,
            } => {
                let r = &mut self.regions[region];
                if !world.daemon_up(region, at_ms) {
                    return;
                }
                if !r.daemons.iter().any(|d| d.node == node) {
                    return;
                }
                // Redis refuses any earlier holder's writes once this one's have a later fence.
                for d in &mut r.daemons {
                    d.fence = (d.node == node).then_some(fence);
                    d.seen = None;
                    d.passed = d.node != node;
                }
                // The role is new to it: what Redis holds is another daemon's writing, so it
                // writes every bucket, then reports the usage counted since the last report.
                if let Some(stopped) = r.holder_stopped_ms.take() {
                    self.counts.takeovers_ms[region].push(at_ms - stopped);
                }
                self.write_pass(world, region, at_ms);
                self.report_usage(world, region, at_ms);
            }
            Event::Passed {
                region,
                node,
                fence,
            } => {
                if !world.daemon_up(region, at_ms) {
                    return;
                }
                let r = &mut self.regions[region];
                if let Some(d) = r
                    .daemons
                    .iter_mut()
                    .find(|d| d.node == node && d.fence == Some(fence))
                {
                    d.passed = true;
                }
            }
            Event::Join { region } => {
                let node = self.next_node;
                self.next_node += 1;
                let r = &mut self.regions[region];
                let epoch = r.replica.epoch;
                r.daemons.push(Daemon::new(node, epoch));
            }
        }
    }

    /// The share region `r` enforces for `tenant` at its local time `local_ms`: the grant its
    /// holder last wrote to Redis, under the lease end written with it.
    pub fn enforced_ppm(&self, r: RegionIx, tenant: usize, local_ms: u64) -> u32 {
        let region = &self.regions[r];
        let grant = &region.grants[tenant];
        match self.mode {
            LeaseMode::Leased => enforced_share(
                grant,
                region.stored_lease.as_ref(),
                local_ms,
                self.cfg.drift_margin_ms,
            ),
            LeaseMode::NoLease => grant.share_ppm,
        }
    }

    /// Whether region `r` enforces only its floors at its local time `local_ms`: the lease end
    /// Redis holds has passed (or none was written).
    pub fn on_floor(&self, r: RegionIx, local_ms: u64) -> bool {
        self.mode == LeaseMode::Leased
            && self.regions[r]
                .stored_lease
                .is_none_or(|l| local_ms >= l.end_local_ms(self.cfg.drift_margin_ms))
    }

    /// The share `region` is granted for `tenant`, as region `r`'s replica sees it.
    pub fn granted_ppm(&self, r: RegionIx, tenant: usize, region: RegionIx) -> u32 {
        self.regions[r]
            .replica
            .entries
            .get(&self.keys[tenant])
            .map_or(0, |e| e.share(region))
    }

    /// Counts a decision in region `r`'s next usage report.
    pub fn count(&mut self, r: RegionIx, tenant: usize, cost: u32, allowed: bool) {
        let u = &mut self.regions[r].usage[tenant];
        if allowed {
            u.admitted += u64::from(cost);
        } else {
            u.denied += u64::from(cost);
        }
    }

    /// Checks the coordinator's own invariant (Σ enforceable ≤ 1) on the committed state.
    pub fn invariant_holds(&self) -> bool {
        self.committed.check_invariant().is_ok()
    }
}

#[cfg(test)]
mod tests {
    use quota_core::{PolicySpec, PPM};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::faults::{Fault, Faults, Stop};
    use crate::world::WorldSpec;

    const FLOOR: u32 = 50_000;

    fn tenants() -> Vec<Tenant> {
        let spec = PolicySpec {
            limit: 6000.0,
            window_ms: 60_000.0,
            floor: Some(0.05),
            ..Default::default()
        };
        vec![Tenant {
            policy: spec.validate().unwrap(),
        }]
    }

    fn world(faults: Vec<Fault>) -> World {
        World::new(
            &WorldSpec::default(),
            Faults { list: faults },
            &mut ChaCha8Rng::seed_from_u64(5),
        )
    }

    /// Runs the control plane to `until_ms`, reporting `per_s` tokens of demand a second in each
    /// region of `demand`, and checking at every tick the coordinator's invariant and, with
    /// leases, that what the regions' Redis instances enforce sums to at most the budget.
    fn drive(c: &mut Control, w: &World, from_ms: u64, until_ms: u64, demand: &[u32]) {
        for t in (from_ms..until_ms).step_by(10) {
            if t % 1000 == 0 {
                for (r, &d) in demand.iter().enumerate() {
                    c.count(r, 0, d, true);
                }
            }
            c.advance(w, t);
            assert!(c.invariant_holds(), "Σ enforceable > 1 at {t} ms");
            let enforced: u32 = shares(c, w, t).iter().sum();
            assert!(
                c.mode == LeaseMode::NoLease || enforced <= PPM,
                "Σ enforced {enforced} > 1 at {t} ms"
            );
        }
    }

    fn shares(c: &Control, w: &World, t_ms: u64) -> Vec<u32> {
        (0..3)
            .map(|r| c.enforced_ppm(r, 0, w.local_ms(r, t_ms)))
            .collect()
    }

    #[test]
    fn shares_follow_demand_without_exceeding_the_budget() {
        let w = world(vec![]);
        let mut c = Control::new(
            &w,
            &tenants(),
            |t| t.policy.clone(),
            ControlConfig::default(),
            LeaseMode::Leased,
        );
        drive(&mut c, &w, 0, 40_000, &[10, 80, 10]);
        let s = shares(&c, &w, 40_000);
        assert!(s[1] > 700_000, "the busy region got {s:?}");
        assert!(s.iter().map(|&x| u64::from(x)).sum::<u64>() <= u64::from(PPM));
        assert_eq!(c.rejected_commands, 0);
    }

    #[test]
    fn a_cut_off_region_falls_to_its_floor_and_the_others_take_its_share() {
        let w = world(vec![Fault::Isolate {
            region: 2,
            from_ms: 10_000,
            until_ms: 60_000,
        }]);
        let cfg = ControlConfig::default();
        let mut c = Control::new(&w, &tenants(), |t| t.policy.clone(), cfg, LeaseMode::Leased);
        drive(&mut c, &w, 0, 10_000, &[40, 40, 40]);
        assert!(shares(&c, &w, 10_000)[2] > 300_000);
        // Its last renewal left before the cut: the lease ends within one lease length.
        drive(&mut c, &w, 10_000, 10_000 + cfg.lease_ms, &[40, 40, 40]);
        assert_eq!(shares(&c, &w, 10_000 + cfg.lease_ms)[2], FLOOR);
        drive(&mut c, &w, 10_000 + cfg.lease_ms, 55_000, &[40, 40, 40]);
        let s = shares(&c, &w, 55_000);
        assert!(
            s[0] + s[1] > 850_000,
            "the majority did not get the share back: {s:?}"
        );
        // After the partition heals, the region renews and gets share again.
        drive(&mut c, &w, 55_000, 90_000, &[40, 40, 40]);
        assert!(shares(&c, &w, 90_000)[2] > 200_000);
    }

    #[test]
    fn a_crashed_leader_is_replaced_and_rebalancing_resumes() {
        let w = world(vec![Fault::Crash {
            region: 0,
            from_ms: 5_000,
            until_ms: 200_000,
        }]);
        let cfg = ControlConfig::default();
        let mut c = Control::new(&w, &tenants(), |t| t.policy.clone(), cfg, LeaseMode::Leased);
        drive(&mut c, &w, 0, 5_000 + cfg.election_ms + 100, &[10, 10, 10]);
        assert_eq!(c.leader(), Some(1));
        drive(&mut c, &w, 10_000, 60_000, &[0, 10, 90]);
        let s = shares(&c, &w, 60_000);
        assert!(s[2] > 600_000, "no rebalancing under the new leader: {s:?}");
    }

    fn stop(how: Stop) -> World {
        world(vec![Fault::AgentStop {
            region: 1,
            at_ms: 20_000,
            how,
        }])
    }

    /// The committed record of region 1's daemon `node`, if any.
    fn record(c: &Control, node: u64) -> Option<quota_core::coordinator::DaemonLease> {
        c.committed.region(1).unwrap().daemons.get(&node).copied()
    }

    fn acked(c: &Control) -> u64 {
        c.committed.region(1).unwrap().acked_epoch
    }

    /// A killed holder may only be paused, deciding in process on its old view until its lease
    /// ends: the claim that replaces it marks its record as left and deposed, and the record
    /// holds region 1's acknowledgement at its last pass until its lease and margin run out,
    /// whatever the new holder writes (its `AgentPassed` included).
    #[test]
    fn a_killed_holder_holds_the_acknowledgement_until_its_lease_and_margin_run_out() {
        let w = stop(Stop::Killed);
        let cfg = ControlConfig::default();
        let mut c = Control::new(&w, &tenants(), |t| t.policy.clone(), cfg, LeaseMode::Leased);
        drive(&mut c, &w, 0, 20_000, &[10, 80, 10]);
        let r1 = &c.regions[1];
        let (before, lease) = (r1.grants[0], r1.stored_lease.unwrap());
        let (dead, standby) = (r1.daemons[0].node, r1.daemons[1].node);
        let dead_ack = r1.daemons[0].view.applied_epoch();
        let reports = c.counts.usage_reports.clone();
        assert!(before.share_ppm > 600_000, "region 1 got {before:?}");
        assert_eq!(r1.daemons.len(), 2);
        // Demand leaves region 1 with its holder killed: the coordinator moves the share, the
        // replica follows, Redis keeps what the dead holder wrote; the standby waits for three
        // report intervals without the holder's renewals.
        drive(&mut c, &w, 20_000, 23_000, &[10, 10, 80]);
        let r1 = &c.regions[1];
        assert!(r1.holder().is_none() && r1.daemons.len() == 1);
        assert!(
            r1.replica.epoch > dead_ack,
            "no new allocation to hold back"
        );
        assert_eq!((r1.grants[0], r1.stored_lease), (before, Some(lease)));
        assert!(!c.on_floor(1, w.local_ms(1, 23_000)));
        assert_eq!(
            c.counts.usage_reports[1], reports[1],
            "usage without a holder"
        );
        assert_eq!(acked(&c), dead_ack);
        let dead_record = record(&c, dead).unwrap();
        assert!(!dead_record.left && !dead_record.deposed);
        // Its lease, from its last renewal before the kill, and the margin end here (the
        // coordinator's time).
        let out_ms = dead_record.lease_expires_at_ms + cfg.drift_margin_ms;
        assert!((30_000..30_500).contains(&out_ms), "{out_ms}");
        // The standby claims (one commit, which marks the dead record as left and deposed),
        // writes every bucket and sends AgentPassed. The acknowledgement stays at the dead
        // holder's last pass until the record's lease and margin are over, though the standby
        // acknowledges later epochs and its AgentPassed commits long before.
        let claimed = |op: &Operation| matches!(op, Operation::ClaimAgent { .. });
        let passed = |op: &Operation| matches!(op, Operation::AgentPassed { .. });
        let mut held_back = false;
        let mut t = 23_000;
        while acked(&c) == dead_ack {
            assert!(t < 33_000, "the acknowledgement still held at {t} ms");
            drive(&mut c, &w, t, t + 10, &[10, 10, 80]);
            t += 10;
            if acked(&c) == dead_ack {
                let replaced = committed_at(&c, 20_000, claimed).is_some();
                let d = record(&c, dead).expect("the dead record holds");
                assert_eq!((d.left, d.deposed), (replaced, replaced), "at {t} ms");
                assert_eq!(d.lease_expires_at_ms, dead_record.lease_expires_at_ms);
                held_back |= record(&c, standby).unwrap().acked_epoch > dead_ack;
            }
        }
        assert!(
            held_back,
            "the standby never acknowledged past the dead holder's pass"
        );
        let passed_ms = committed_at(&c, 20_000, passed).expect("AgentPassed committed");
        assert!((23_000..24_000).contains(&passed_ms), "{passed_ms}");
        // The first renewal committed after the record's end drops it and raises the
        // acknowledgement: not before, and within a report interval and a round trip.
        assert!(c.committed.last_now_ms > out_ms, "{out_ms}");
        assert!((30_000..31_500).contains(&t), "{t}");
        assert_eq!(record(&c, dead), None);
        assert!(acked(&c) > dead_ack);
        let taken = c.counts.takeovers_ms[1].clone();
        assert!(
            taken.len() == 1 && (3_000..3_000 + cfg.report_ms).contains(&taken[0]),
            "{taken:?}"
        );
        let r1 = &c.regions[1];
        let holder = &r1.daemons[r1.holder().unwrap()];
        assert!(holder.passed);
        assert_eq!(holder.view.applied_epoch(), r1.replica.epoch);
        assert!(r1.grants[0].share_ppm < before.share_ppm);
        assert!(r1.stored_lease.unwrap().start_local_ms > lease.start_local_ms);
        assert!(c.counts.usage_reports[1] > reports[1]);
        // A daemon started in the killed one's place stands by as a new node.
        assert_eq!(r1.daemons.len(), 2);
        assert!(r1.daemons.iter().all(|d| d.node != dead));
        assert_eq!(c.counts.stops, vec![0, 1, 0]);
        assert_eq!(c.take_stops(), vec![(1, Stop::Killed)]);
        assert_eq!(c.rejected_commands, 0);
    }

    #[test]
    fn a_holder_stopping_on_sigterm_leaves_and_the_standby_claims_at_its_next_look() {
        let w = stop(Stop::Graceful);
        let cfg = ControlConfig::default();
        let mut c = Control::new(&w, &tenants(), |t| t.policy.clone(), cfg, LeaseMode::Leased);
        drive(&mut c, &w, 0, 20_000, &[10, 80, 10]);
        let gone = c.regions[1].daemons[0].node;
        let standby = c.regions[1].daemons[1].node;
        let before = c.regions[1].grants[0];
        // The release commits within a round trip: the role is free, and the record stays
        // (Redis holds what it wrote) until the next holder's first pass.
        drive(&mut c, &w, 20_000, 20_500, &[10, 10, 80]);
        assert_eq!(c.committed.region(1).unwrap().agent, None);
        assert!(record(&c, gone).is_some_and(|d| d.left));
        assert_eq!(c.regions[1].grants[0], before, "Redis holds what it wrote");
        // The standby claims at its next report tick and writes every bucket.
        drive(&mut c, &w, 20_500, 22_000, &[10, 10, 80]);
        let taken = c.counts.takeovers_ms[1].clone();
        assert!(
            taken.len() == 1 && (1_000..1_500).contains(&taken[0]),
            "{taken:?}"
        );
        let s = c.committed.region(1).unwrap();
        assert_eq!(s.agent.map(|a| a.node), Some(standby));
        let r1 = &c.regions[1];
        assert_eq!(r1.daemons[r1.holder().unwrap()].node, standby);
        drive(&mut c, &w, 22_000, 40_000, &[10, 10, 80]);
        assert!(c.regions[1].grants[0].share_ppm < before.share_ppm);
        assert!(!c.on_floor(1, w.local_ms(1, 40_000)));
        assert_eq!(c.committed.region(1).unwrap().daemons.len(), 2);
        assert_eq!(c.take_stops(), vec![(1, Stop::Graceful)]);
        assert_eq!(c.rejected_commands, 0);
    }

    /// When an operation matching `op` first committed at or after `from_ms`, if one did.
    fn committed_at(c: &Control, from_ms: u64, op: impl Fn(&Operation) -> bool) -> Option<u64> {
        c.log
            .iter()
            .find_map(|&(t, ref cmd)| (t >= from_ms && op(&cmd.op)).then_some(t))
    }

    /// Demand leaves region 1 just before its holder stops on SIGTERM, so the rebalance at the
    /// stop raises the epoch: the standby acknowledges it while Redis still holds the stopped
    /// holder's last pass. The region's acknowledgement stays at that pass until the new
    /// holder's `AgentPassed` (sent after its first pass) commits, and rises then.
    #[test]
    fn after_a_release_the_acknowledgement_waits_for_the_next_holders_first_pass() {
        let w = stop(Stop::Graceful);
        let cfg = ControlConfig::default();
        let mut c = Control::new(&w, &tenants(), |t| t.policy.clone(), cfg, LeaseMode::Leased);
        drive(&mut c, &w, 0, 17_000, &[10, 80, 10]);
        drive(&mut c, &w, 17_000, 20_000, &[10, 10, 80]);
        let (gone, standby) = (c.regions[1].daemons[0].node, c.regions[1].daemons[1].node);
        let last_pass = c.regions[1].daemons[0].view.applied_epoch();
        let released = |op: &Operation| matches!(op, Operation::ReleaseAgent { .. });
        let passed = |op: &Operation| matches!(op, Operation::AgentPassed { .. });
        let mut held_back = false;
        let mut t = 20_000;
        while committed_at(&c, 20_000, passed).is_none() {
            assert!(t < 25_000, "no AgentPassed committed by {t} ms");
            drive(&mut c, &w, t, t + 10, &[10, 10, 80]);
            t += 10;
            if committed_at(&c, 20_000, released).is_some()
                && committed_at(&c, 20_000, passed).is_none()
            {
                assert_eq!(acked(&c), last_pass, "at {t} ms");
                assert!(record(&c, gone).is_some_and(|d| d.left && !d.deposed));
                held_back |= record(&c, standby).unwrap().acked_epoch > last_pass;
            }
        }
        assert!(
            held_back,
            "the standby never acknowledged past the stopped holder's pass"
        );
        // One report interval, a claim and an AgentPassed after the stop, long before the
        // stopped holder's lease and margin run out.
        assert!((21_000..22_000).contains(&t), "{t}");
        assert!(acked(&c) > last_pass);
        assert_eq!(acked(&c), record(&c, standby).unwrap().acked_epoch);
        assert_eq!(record(&c, gone), None);
        // The answer reaches the holder a one-way delay later: it sends no more.
        let r1 = &c.regions[1];
        assert!(!r1.daemons[r1.holder().unwrap()].passed);
        drive(&mut c, &w, t, t + 200, &[10, 10, 80]);
        let r1 = &c.regions[1];
        assert!(r1.daemons[r1.holder().unwrap()].passed);
        assert_eq!(c.rejected_commands, 0);
    }

    /// What Redis holds stays as the last holder wrote it, lease end included: a takeover
    /// longer than that (three report intervals of 3.5 s against a 10 s lease) puts the
    /// region on its floors, though its standby renews throughout.
    #[test]
    fn a_takeover_past_the_stored_lease_end_puts_the_region_on_its_floors() {
        let w = stop(Stop::Killed);
        let cfg = ControlConfig {
            report_ms: 3_500,
            ..ControlConfig::default()
        };
        let mut c = Control::new(&w, &tenants(), |t| t.policy.clone(), cfg, LeaseMode::Leased);
        drive(&mut c, &w, 0, 29_000, &[10, 80, 10]);
        assert!(c.on_floor(1, w.local_ms(1, 29_000)));
        assert!(!c.on_floor(0, w.local_ms(0, 29_000)) && !c.on_floor(2, w.local_ms(2, 29_000)));
        assert!(c.committed.region(1).unwrap().lease_expires_at_ms > 35_000);
        drive(&mut c, &w, 29_000, 33_000, &[10, 80, 10]);
        assert!(!c.on_floor(1, w.local_ms(1, 33_000)));
        let taken = &c.counts.takeovers_ms[1];
        assert!(taken.len() == 1 && taken[0] > 10_500, "{taken:?}");
    }

    #[test]
    fn without_leases_a_cut_off_region_keeps_a_share_granted_again_elsewhere() {
        let w = world(vec![Fault::Isolate {
            region: 2,
            from_ms: 10_000,
            until_ms: 60_000,
        }]);
        let cfg = ControlConfig::default();
        let mut c = Control::new(
            &w,
            &tenants(),
            |t| t.policy.clone(),
            cfg,
            LeaseMode::NoLease,
        );
        drive(&mut c, &w, 0, 50_000, &[40, 40, 40]);
        let s = shares(&c, &w, 50_000);
        let total: u64 = s.iter().map(|&x| u64::from(x)).sum();
        assert!(
            total > u64::from(PPM) + 200_000,
            "enforced shares sum to only {total}: {s:?}"
        );
    }
}
