//! The control plane of the rebalancing strategies, driving quota-core's real coordinator.
//!
//! ```text
//!  region r, every report interval:   usage + RenewLease{acked epoch} ──WAN──▶ leader
//!  leader, on a report:               DemandTracker::record; propose RenewLease
//!  leader, every rebalance interval:  allocator::plan(committed, demand) ─▶ SetShares commands
//!  proposal ──(quorum round trip)──▶ commit: CoordinatorState::apply on the log's state
//!  commit ──WAN──▶ each region's replica applies the log; LeaseRenewed ──WAN──▶ RegionView
//!  region decision: RegionView::enforced_share(grant, own drifted clock) ─▶ bucket params
//! ```
//!
//! Replication is modelled, not run: a command commits one quorum round trip after the leader
//! proposed it (the k-th fastest reachable follower), if the leader is up and reaches a
//! majority, and is then applied to the committed [`CoordinatorState`]. Each region holds its
//! own replica and applies the committed log once it can hear the leader. A leader that is
//! down or cut off from the majority is replaced after the election timeout by the lowest
//! region that reaches a majority; the new leader starts with empty demand estimates (they are
//! soft state) and relearns them. Proposals not committed when leadership changes are lost.
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
//! A region's agent role can be between its daemons (a killed holder,
//! [`crate::faults::Fault::AgentMove`]): the region's renewals go on without usage, still
//! acknowledging the epoch its Redis holds; its Redis keeps the grants and lease end last
//! written, and the renewals answered meanwhile wait for the next holder. Once that holder has
//! claimed the role it takes them up, writes every bucket at its replica's epoch, and its first
//! report carries the usage Redis counted since the last one, over that whole interval.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use quota_core::allocator::{plan, AllocatorConfig};
use quota_core::coordinator::RegionShare;
use quota_core::demand::{DemandTracker, Usage};
use quota_core::lease::LeaseConfig;
use quota_core::region::{RegionLease, RegionView};
use quota_core::{
    Command, CoordinatorState, Operation, Policy, PolicyKey, PolicyName, RegionId, RequestId,
    Response, TenantId,
};
use serde::Serialize;

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

#[derive(Debug)]
enum Event {
    /// A lease renewal reaches the leader, with a usage report over the last `interval_ms`
    /// unless the region's agent role is between daemons.
    Report {
        from: RegionIx,
        to: RegionIx,
        usage: Option<Vec<(PolicyKey, Usage)>>,
        interval_ms: u64,
        acked_epoch: u64,
        sent_local_ms: u64,
    },
    /// A proposal reaches its quorum.
    Commit {
        term: u64,
        cmd: Command,
        renewal: Option<(RegionIx, u64)>,
    },
    /// A lease renewal's answer reaches its region.
    Lease {
        region: RegionIx,
        lease: RegionLease,
    },
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

/// One region's daemons: their replica of the coordinator state, the region agent's lease
/// clock, and what the region enforces per tenant.
#[derive(Debug)]
pub struct RegionAgent {
    replica: CoordinatorState,
    /// How much of the committed log the replica applied.
    applied: usize,
    pub view: RegionView,
    /// Per tenant: the grant the agent last wrote to Redis (at the applied epoch).
    pub grants: Vec<RegionShare>,
    /// Per tenant: the home region when pinned.
    pub homes: Vec<Option<RegionIx>>,
    /// Per tenant: the other region granted the largest share (the lowest on a tie), where a
    /// check this region's share cannot hold is forwarded.
    pub richest: Vec<Option<RegionIx>>,
    /// Per tenant: tokens admitted and denied since the last report.
    usage: Vec<Usage>,
    /// When `usage` started counting: the last report's time.
    usage_since_ms: u64,
    /// The agent role is between daemons: no reports, no parameter writes.
    paused: bool,
    /// Renewals answered while the role was between daemons, for the next holder's lease
    /// clock (Redis keeps the lease end last written until then).
    held_leases: Vec<RegionLease>,
}

/// What each region's agent did over a run, per region.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct AgentCounts {
    /// Usage reports sent to a leader.
    pub usage_reports: Vec<u64>,
    /// Times the agent role left its daemon for another.
    pub moves: Vec<u64>,
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
    leader: Option<RegionIx>,
    term: u64,
    leader_lost_at_ms: Option<u64>,
    demand: DemandTracker,
    last_report_ms: Vec<u64>,
    next_report_ms: u64,
    next_rebalance_ms: u64,
    pub agents: Vec<RegionAgent>,
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
    /// Boots a cluster of `world.regions` regions with every tenant's policy registered and
    /// every region holding a fresh lease at time 0. `policies` are what gets registered (the
    /// caller decides, e.g., whether critical tiers stay critical).
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
            leader: Some(0),
            term: 1,
            leader_lost_at_ms: None,
            demand: DemandTracker::new(alloc.ewma_alpha_ppm),
            last_report_ms: vec![0; n],
            next_report_ms: cfg.report_ms,
            next_rebalance_ms: cfg.rebalance_ms,
            agents: Vec::new(),
            rejected_commands: 0,
            counts: AgentCounts {
                usage_reports: vec![0; n],
                moves: vec![0; n],
            },
        };
        c.boot(tenants, policies);
        for r in 0..n {
            c.add_agent(world, r, tenants.len());
        }
        c
    }

    /// Commits, at time 0, the lease config, every region and every tenant's policy, then a
    /// first lease for each region.
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
        for r in 0..self.region_ids.len() {
            let acked_epoch = self.committed.epoch;
            self.commit_now(
                0,
                Operation::RenewLease {
                    region: self.region_ids[r].clone(),
                    acked_epoch,
                },
            );
        }
    }

    /// Region `r`'s agent, starting from the booted state with its first lease.
    fn add_agent(&mut self, world: &World, r: RegionIx, tenants: usize) {
        let mut agent = RegionAgent {
            replica: self.committed.clone(),
            applied: self.log.len(),
            view: RegionView::new(),
            grants: Vec::new(),
            homes: Vec::new(),
            richest: Vec::new(),
            usage: vec![Usage::default(); tenants],
            usage_since_ms: 0,
            paused: false,
            held_leases: Vec::new(),
        };
        agent.view.on_applied(self.committed.epoch);
        agent.view.on_renewal(RegionLease {
            epoch: self.committed.epoch,
            start_local_ms: world.local_ms(r, 0),
            lease_ms: self.cfg.lease_ms,
        });
        self.agents.push(agent);
        self.refresh_routing(r);
        self.refresh_grants(r);
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

    fn propose(
        &mut self,
        world: &World,
        t_ms: u64,
        op: Operation,
        renewal: Option<(RegionIx, u64)>,
    ) {
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
        self.push(t_ms + rtt, Event::Commit { term, cmd, renewal });
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

    /// Every region's renewal, with its usage report unless its agent role is between daemons
    /// (the usage then stays counted in Redis for the next holder's first report).
    fn send_reports(&mut self, world: &World, at_ms: u64) {
        for r in 0..world.regions {
            if !world.daemon_up(r, at_ms) {
                self.agents[r].usage_since_ms = at_ms;
                continue;
            }
            let agent = &mut self.agents[r];
            let interval_ms = at_ms - agent.usage_since_ms;
            let usage = (!world.agent_paused(r, at_ms)).then(|| {
                agent.usage_since_ms = at_ms;
                agent
                    .usage
                    .iter_mut()
                    .enumerate()
                    .filter(|(_, u)| u.admitted + u.denied > 0)
                    .map(|(i, u)| (self.keys[i].clone(), std::mem::take(u)))
                    .collect::<Vec<_>>()
            });
            let acked_epoch = agent.view.applied_epoch();
            let Some(l) = self.leader else { continue };
            if world.link_up(r, l, at_ms) && world.daemon_up(l, at_ms) {
                if usage.is_some() {
                    self.counts.usage_reports[r] += 1;
                }
                let sent_local_ms = world.local_ms(r, at_ms);
                let arrive = at_ms + world.owd_ms(r, l);
                self.push(
                    arrive,
                    Event::Report {
                        from: r,
                        to: l,
                        usage,
                        interval_ms,
                        acked_epoch,
                        sent_local_ms,
                    },
                );
            }
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
            self.propose(world, at_ms, cmd.op, None);
        }
    }

    fn on_commit(
        &mut self,
        world: &World,
        at_ms: u64,
        cmd: Command,
        renewal: Option<(RegionIx, u64)>,
    ) {
        let resp = self.committed.apply(&cmd);
        let is_shares = matches!(cmd.op, Operation::SetShares { .. });
        self.log.push((at_ms, cmd));
        match (&resp, renewal) {
            (
                Response::LeaseRenewed {
                    epoch, lease_ms, ..
                },
                Some((r, sent_local_ms)),
            ) => {
                if let Some(l) = self.leader {
                    if world.link_up(l, r, at_ms) {
                        let lease = RegionLease {
                            epoch: *epoch,
                            start_local_ms: sent_local_ms,
                            lease_ms: *lease_ms,
                        };
                        self.push(
                            at_ms + world.owd_ms(l, r),
                            Event::Lease { region: r, lease },
                        );
                    }
                }
            }
            (Response::SharesSet { rejected_total, .. }, _) => {
                self.rejected_commands += u64::from(*rejected_total);
            }
            (Response::LeaseRenewed { .. }, None) => {}
            _ => self.rejected_commands += 1,
        }
        if is_shares && self.mode == LeaseMode::NoLease {
            // No revoke-before-grant: every decrease counts as acknowledged at once.
            let epoch = self.committed.epoch;
            for r in 0..world.regions {
                let op = Operation::RenewLease {
                    region: self.region_ids[r].clone(),
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

    /// Re-reads every tenant's grant from region `r`'s replica: the agent writes them to Redis.
    fn refresh_grants(&mut self, r: RegionIx) {
        let agent = &mut self.agents[r];
        agent.grants = self
            .keys
            .iter()
            .map(|k| {
                agent.replica.region_share(k, r).unwrap_or(RegionShare {
                    share_ppm: 0,
                    floor_ppm: 0,
                })
            })
            .collect();
    }

    /// Re-reads every tenant's home and richest other region from region `r`'s replica: the
    /// daemons' view, which follows the log whichever daemon holds the agent role.
    fn refresh_routing(&mut self, r: RegionIx) {
        let agent = &mut self.agents[r];
        agent.homes = self
            .keys
            .iter()
            .map(|k| {
                agent
                    .replica
                    .entries
                    .get(k)
                    .and_then(|e| e.pin)
                    .map(|p| usize::from(p.home))
            })
            .collect();
        agent.richest = self
            .keys
            .iter()
            .map(|k| {
                let e = agent.replica.entries.get(k)?;
                (0..e.shares_ppm.len())
                    .filter(|&o| o != r && e.share(o) > 0)
                    .max_by_key(|&o| (e.share(o), Reverse(o)))
            })
            .collect();
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
            let before = self.agents[r].replica.epoch;
            let agent = &mut self.agents[r];
            while agent.applied < self.log.len() && self.log[agent.applied].0 + owd <= t_ms {
                agent.replica.apply(&self.log[agent.applied].1);
                agent.applied += 1;
            }
            let epoch = agent.replica.epoch;
            if epoch != before {
                self.refresh_routing(r);
                // The agent writes the new parameters to its Redis, then counts the epoch as
                // applied (what it acknowledges in its next report); while the role is between
                // daemons no one does.
                if !self.agents[r].paused {
                    self.refresh_grants(r);
                    self.agents[r].view.on_applied(epoch);
                }
            }
        }
    }

    /// Follows each region's agent role between daemons at `t_ms`: a move is counted when the
    /// holder is killed; once another daemon has claimed the role it takes up the renewals
    /// answered meanwhile and writes every bucket (a full apply pass) at the epoch its
    /// replica reached.
    fn follow_agents(&mut self, world: &World, t_ms: u64) {
        for r in 0..world.regions {
            let paused = world.agent_paused(r, t_ms);
            match (self.agents[r].paused, paused) {
                (false, true) => self.counts.moves[r] += 1,
                (true, false) => {
                    let agent = &mut self.agents[r];
                    for lease in std::mem::take(&mut agent.held_leases) {
                        agent.view.on_renewal(lease);
                    }
                    let epoch = agent.replica.epoch;
                    self.refresh_grants(r);
                    self.agents[r].view.on_applied(epoch);
                }
                _ => {}
            }
            self.agents[r].paused = paused;
        }
    }

    /// Runs the control plane up to true time `t_ms`.
    pub fn advance(&mut self, world: &World, t_ms: u64) {
        self.elect(world, t_ms);
        self.follow_agents(world, t_ms);
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
            match event {
                Event::Report {
                    from,
                    to,
                    usage,
                    interval_ms,
                    acked_epoch,
                    sent_local_ms,
                } => {
                    if self.leader != Some(to) || !world.daemon_up(to, at_ms) {
                        continue;
                    }
                    if let Some(usage) = usage {
                        self.demand.record(from as u8, interval_ms, &usage);
                        self.last_report_ms[from] = at_ms;
                    }
                    let op = Operation::RenewLease {
                        region: self.region_ids[from].clone(),
                        acked_epoch,
                    };
                    self.propose(world, at_ms, op, Some((from, sent_local_ms)));
                }
                Event::Commit { term, cmd, renewal } => {
                    let alive = self
                        .leader
                        .is_some_and(|l| self.has_quorum(world, l, at_ms));
                    if term == self.term && alive {
                        self.on_commit(world, at_ms, cmd, renewal);
                    }
                }
                Event::Lease { region, lease } => {
                    let agent = &mut self.agents[region];
                    if !world.daemon_up(region, at_ms) {
                        continue;
                    }
                    if agent.paused {
                        agent.held_leases.push(lease);
                    } else {
                        agent.view.on_renewal(lease);
                    }
                }
            }
        }
        self.replicate(world, t_ms);
    }

    /// The share region `r` enforces for `tenant` at its local time `local_ms`.
    pub fn enforced_ppm(&self, r: RegionIx, tenant: usize, local_ms: u64) -> u32 {
        let agent = &self.agents[r];
        let grant = &agent.grants[tenant];
        match self.mode {
            LeaseMode::Leased => {
                agent
                    .view
                    .enforced_share(grant, local_ms, self.cfg.drift_margin_ms)
            }
            LeaseMode::NoLease => grant.share_ppm,
        }
    }

    /// Whether region `r` enforces only its floors at its local time `local_ms`: its lease ran
    /// out (or it never had one).
    pub fn on_floor(&self, r: RegionIx, local_ms: u64) -> bool {
        self.mode == LeaseMode::Leased
            && self.agents[r]
                .view
                .lease()
                .is_none_or(|l| local_ms >= l.end_local_ms(self.cfg.drift_margin_ms))
    }

    /// The share `region` is granted for `tenant`, as region `r`'s replica sees it.
    pub fn granted_ppm(&self, r: RegionIx, tenant: usize, region: RegionIx) -> u32 {
        self.agents[r]
            .replica
            .entries
            .get(&self.keys[tenant])
            .map_or(0, |e| e.share(region))
    }

    /// Counts a decision in region `r`'s next usage report.
    pub fn count(&mut self, r: RegionIx, tenant: usize, cost: u32, allowed: bool) {
        let u = &mut self.agents[r].usage[tenant];
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
    use crate::faults::{Fault, Faults};
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
    /// region of `demand`, and checking the coordinator's invariant at every tick.
    fn drive(c: &mut Control, w: &World, from_ms: u64, until_ms: u64, demand: &[u32]) {
        for t in (from_ms..until_ms).step_by(10) {
            if t % 1000 == 0 {
                for (r, &d) in demand.iter().enumerate() {
                    c.count(r, 0, d, true);
                }
            }
            c.advance(w, t);
            assert!(c.invariant_holds(), "Σ enforceable > 1 at {t} ms");
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

    #[test]
    fn a_region_without_its_agent_keeps_what_redis_holds_while_its_lease_is_renewed() {
        let w = world(vec![Fault::AgentMove {
            region: 1,
            from_ms: 20_000,
            until_ms: 26_000,
        }]);
        let cfg = ControlConfig::default();
        let mut c = Control::new(&w, &tenants(), |t| t.policy.clone(), cfg, LeaseMode::Leased);
        drive(&mut c, &w, 0, 20_000, &[10, 80, 10]);
        let before = c.agents[1].grants[0];
        let epoch = c.agents[1].view.applied_epoch();
        let lease = *c.agents[1].view.lease().unwrap();
        let reports = c.counts.usage_reports.clone();
        assert!(before.share_ppm > 600_000, "region 1 got {before:?}");
        // Demand leaves region 1 while no daemon holds its agent role: the coordinator moves
        // the share, region 1's replica follows, its Redis does not.
        drive(&mut c, &w, 20_000, 25_990, &[10, 10, 80]);
        let a = &c.agents[1];
        assert!(c.committed.epoch > epoch, "no new allocation to hold back");
        assert!(
            a.replica.epoch > epoch,
            "region 1's replica stopped following the log"
        );
        assert!(a.replica.region_share(&c.keys[0], 1).unwrap().share_ppm < before.share_ppm);
        assert_eq!((a.grants[0], a.view.applied_epoch()), (before, epoch));
        assert_eq!(a.view.lease(), Some(&lease));
        assert!(!a.held_leases.is_empty(), "the survivors stopped renewing");
        assert!(!c.on_floor(1, w.local_ms(1, 25_990)));
        let sent: Vec<u64> = (0..3)
            .map(|r| c.counts.usage_reports[r] - reports[r])
            .collect();
        assert_eq!(sent[1], 0, "usage reported without an agent: {sent:?}");
        assert!(sent[0] >= 5 && sent[2] >= 5, "{sent:?}");
        // The next holder takes the renewals up and applies the replica's epoch.
        drive(&mut c, &w, 25_990, 26_010, &[10, 10, 80]);
        let a = &c.agents[1];
        assert_eq!(a.view.applied_epoch(), a.replica.epoch);
        assert!(a.grants[0].share_ppm < before.share_ppm);
        assert!(a.view.lease().unwrap().start_local_ms > lease.start_local_ms);
        assert!(a.held_leases.is_empty());
        assert_eq!(c.counts.moves, vec![0, 1, 0]);
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
