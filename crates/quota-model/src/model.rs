//! The transition system: the initial state (built by the real `apply`), the actions each
//! actor may take in a state, and what each does.
//!
//! Every step is one event: the leader proposes shares, a message is delivered (or delivered
//! and kept, a duplicate), a daemon catches up with the log, renews, claims, writes or hears
//! its write's reply, a Redis replicates or fails over, region A is cut off or healed, or
//! time advances one tick (with at most one clock stepping). A message never delivered is a
//! lost one; one delivered late is delayed; any in flight may go first, so they reorder.

use quota_core::coordinator::{
    Command, HomeChange, Operation, RegionShare, RequestId, Response, ShareEntry,
};
use quota_core::lease::LeaseConfig;
use quota_core::policy::{Algorithm, FailMode, Policy, PolicyMode, Tier};
use quota_core::region::{RegionLease, RegionView};
use quota_core::{CoordinatorState, PolicyKey, PolicyName, RegionId, TenantId, PPM};
use quota_store::{Fence, LeaseEnd, Limit};
use stateright::Property;

use crate::state::{
    Clock, Coord, Daemon, Held, Msg, Outstanding, Redis, Spent, State, Step, Stored, Write,
};
use crate::world::{
    node_of, Bounds, Guard, A, B, BASE_MS, BUDGET_UNITS, DAEMONS, FLOOR_PPM, LEASE_MS, MARGIN_MS,
    REGIONS, REGION_NAMES, UNIT_PPM,
};

/// One event of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// True time advances one tick; with a step, one clock drifts by one.
    Tick(Option<Step>),
    /// The leader proposes moving region `region`'s share one unit up or down
    /// (`Operation::SetShares`; the searches propose cutting A and raising B); taken only if
    /// `apply` accepts it.
    Reshare {
        region: u8,
        up: bool,
    },
    /// A daemon's replica applies the log up to the leader's state.
    CatchUp(u8),
    /// A daemon's `RenewDaemonLease`, with the epoch it acknowledges, commits.
    Renew(u8),
    /// A daemon's `ClaimAgent`, with the fence its view shows, commits; it holds the role.
    Claim(u8),
    /// The holder sends its view's parameters with its lease end and fence to its Redis.
    Write(u8),
    /// The holder's write is answered by the primary: its pass is complete if `WAIT` finds
    /// the replica has it.
    WriteOk(u8),
    /// The agent's `AgentPassed` commits: its pass under its fence is complete and replicated.
    Passed(u8),
    /// A daemon stops (SIGTERM): it decides and writes nothing more and commits
    /// `ReleaseAgent` with the fence it holds (0 for a standby). Its writes in flight may
    /// still land.
    Stop(u8),
    /// A daemon dies without a word (SIGKILL, or its `ReleaseAgent` lost): as [`Action::Stop`]
    /// but nothing commits.
    Kill(u8),
    Deliver(Msg),
    /// Delivered, and a copy stays in flight.
    Duplicate(Msg),
    /// Redis A's replica takes the primary's state.
    Replicate,
    /// Redis A's replica becomes the primary, losing what was not replicated.
    Failover,
    /// Region A can no longer reach the coordinator.
    Cut,
    Heal,
}

/// Every clock step the world allows: the leader's clock ahead (a leader change to a node
/// ahead), a daemon's clock slow or fast, Redis's clock slow. The other directions only
/// shorten what a region enforces (a leader behind is clamped by `apply`).
const STEPS: [Step; 6] = [
    Step::Fast(Clock::Leader),
    Step::Slow(Clock::Daemon(0)),
    Step::Slow(Clock::Daemon(1)),
    Step::Fast(Clock::Daemon(0)),
    Step::Fast(Clock::Daemon(1)),
    Step::Slow(Clock::Redis),
];

/// The protocol of leases, epochs and fences, with every guard on or one switched off.
#[derive(Debug, Clone)]
pub struct LeaseModel {
    pub bounds: Bounds,
    /// The guard switched off, if any.
    pub mutant: Option<Guard>,
    /// A liveness run: every daemon renews each tick and nothing waits that need not (see
    /// [`LeaseModel::urgent`]).
    pub liveness: bool,
    pub key: PolicyKey,
    pub region_ids: [RegionId; REGIONS],
    /// Each region's grant in the initial state.
    pub initial_shares_ppm: [u32; REGIONS],
    /// Keeps every end as it is, for traces; searches forget ends that cannot be reached
    /// before the horizon (see [`LeaseModel::settle`]).
    exact: bool,
    init: State,
}

impl LeaseModel {
    /// The safety model with every guard on except `mutant`.
    pub fn new(bounds: Bounds, mutant: Option<Guard>) -> Self {
        Self::build(bounds, mutant, false)
    }

    /// The liveness model: renewals every tick and urgent events before time moves.
    pub fn liveness(bounds: Bounds) -> Self {
        Self::build(bounds, None, true)
    }

    fn build(bounds: Bounds, mutant: Option<Guard>, liveness: bool) -> Self {
        let key = PolicyKey::new(
            TenantId::new("t").unwrap(),
            PolicyName::new("calls").unwrap(),
        );
        let region_ids = REGION_NAMES.map(|n| RegionId::new(n).unwrap());
        let margin_ms = if mutant == Some(Guard::DriftMargin) {
            0
        } else {
            MARGIN_MS
        };
        let init = initial(&key, &region_ids, margin_ms);
        let initial_shares_ppm = std::array::from_fn(|r| grant_of(&init.coord, &key, r).share_ppm);
        Self {
            bounds,
            mutant,
            liveness,
            key,
            region_ids,
            initial_shares_ppm,
            exact: false,
            init,
        }
    }

    /// The same model keeping every end as it is, to tell a run (its states are the same
    /// but for ends past the horizon).
    pub fn exact(&self) -> Self {
        Self {
            exact: true,
            ..self.clone()
        }
    }

    /// Whether `guard` is on in this model.
    pub fn guarded(&self, guard: Guard) -> bool {
        self.mutant != Some(guard)
    }

    /// The drift margin the protocol runs with (0 for the `DriftMargin` mutant).
    pub fn margin_ms(&self) -> u64 {
        if self.guarded(Guard::DriftMargin) {
            MARGIN_MS
        } else {
            0
        }
    }

    /// `Written::bounded_by`'s slack: how long past a stored end, on the agent's clock, it
    /// counts the share as run out. Two margins, as quotad passes it (one with the
    /// `WriteRunOut` mutant).
    pub fn slack_ms(&self) -> u64 {
        if self.guarded(Guard::WriteRunOut) {
            2 * self.margin_ms()
        } else {
            self.margin_ms()
        }
    }

    /// Applies one operation as the leader would: stamped with its clock. The deduplication
    /// window is emptied after it (see [`Coord`]).
    fn apply(&self, s: &mut State, op: Operation) -> Response {
        let now_ms = s.leader_now_ms();
        commit(s.coord.make_mut(), now_ms, op)
    }

    /// The epoch daemon `d` acknowledges in a renewal it sends now, as quotad's apply loop
    /// sets it: a standby its view's epoch, at once; the agent its view's epoch after a
    /// complete pass or with the store bounded by the view ([`LeaseModel::bounded`]),
    /// otherwise what it last acknowledged.
    pub fn ack_of(&self, s: &State, d: usize) -> u64 {
        let daemon = &s.daemons[d];
        let applied = daemon.view.applied_epoch();
        if !self.guarded(Guard::AckApplied) {
            return applied.max(daemon.heard_epoch);
        }
        if daemon.fence.is_none() || self.complete(s, d) || self.bounded(s, d) {
            daemon.acked.max(applied)
        } else {
            daemon.acked
        }
    }

    /// Whether a pass of the agent's now writes nothing and is complete: what it last wrote
    /// was answered, is its view's share, and (`WAIT`) the replica has it.
    pub fn complete(&self, s: &State, d: usize) -> bool {
        let enforced = in_process(self, s, d);
        s.daemons[d].held.is_some_and(|h| {
            h.confirmed && !h.dirty && h.share_ppm == enforced && self.replicated(s, &h)
        })
    }

    /// `Written::bounded_by`: the store cannot enforce more than the agent's view grants now,
    /// though its writes are not all answered — what it holds is at most the view's share or
    /// has run out (`slack` past its end), and was written by this agent or an earlier
    /// agent's shares have run out. With [`Guard::BoundedAfterWait`] (quotad's rule), only
    /// once `WAIT` has confirmed every write the primary answered.
    pub fn bounded(&self, s: &State, d: usize) -> bool {
        let daemon = &s.daemons[d];
        let local = s.local_ms(d);
        let over = |until: u64| local >= until.saturating_add(self.slack_ms());
        let earlier_run_over = over(daemon.unknown_until_ms);
        let enforced = in_process(self, s, d);
        if self.guarded(Guard::BoundedAfterWait) && daemon.unconfirmed.is_some() {
            return false;
        }
        match daemon.held {
            Some(h) => {
                (h.share_ppm <= enforced || over(h.until_ms)) && (h.confirmed || earlier_run_over)
            }
            None => earlier_run_over,
        }
    }

    /// `WAIT 1`: the replica has taken the primary's stream up to the write `h` (always, for
    /// the `WaitBeforeAck` mutant).
    pub fn replicated(&self, s: &State, h: &Held) -> bool {
        let replica = s.redis.replica;
        !self.guarded(Guard::WaitBeforeAck)
            || (replica.fence >= h.fence && replica.epoch >= h.epoch)
    }

    /// Whether a message can be delivered now (a cut holds up the coordinator's answers).
    fn deliverable(&self, s: &State, m: &Msg) -> bool {
        match m {
            Msg::Lease { .. } => !s.cut,
            Msg::Write { .. } => true,
        }
    }

    /// Whether daemon `d`'s view lags the leader's state.
    fn behind(&self, s: &State, d: usize) -> bool {
        let c = &s.coord;
        let daemon = &s.daemons[d];
        !daemon.stopped
            && (daemon.view.applied_epoch() < c.epoch || daemon.view_fence != holder_fence(c))
    }

    /// Liveness runs: events that happen before time moves on — a deliverable answer
    /// delivered, a connected replica caught up, each daemon's renewal for this tick sent.
    /// What stays nondeterministic is the environment: cuts, heals, clock steps, shares.
    pub fn urgent(&self, s: &State) -> bool {
        s.net.iter().any(|m| self.deliverable(s, m))
            || (0..DAEMONS).any(|d| {
                (!s.cut && self.behind(s, d))
                    || !(s.daemons[d].renewed_this_tick || s.daemons[d].stopped)
            })
    }

    fn reshare(&self, s: &mut State, region: usize, up: bool) -> Option<()> {
        let entry = s.coord.entries.get(&self.key)?;
        let mut shares = entry.shares_ppm.clone();
        shares[region] = if up {
            shares[region].checked_add(UNIT_PPM).filter(|&v| v <= PPM)?
        } else {
            shares[region].checked_sub(UNIT_PPM)?
        };
        let op = Operation::SetShares {
            membership: s.coord.membership,
            entries: vec![ShareEntry {
                key: self.key.clone(),
                shares_ppm: shares,
                home: HomeChange::Keep,
            }],
        };
        match self.apply(s, op) {
            Response::SharesSet { accepted: 1, .. } => {}
            _ => return None,
        }
        if !self.guarded(Guard::RevokeBeforeGrant) {
            s.coord
                .make_mut()
                .entries
                .get_mut(&self.key)?
                .revocations
                .clear();
        }
        s.spent.reshares += 1;
        Some(())
    }

    fn catch_up(&self, s: &mut State, d: usize) -> Option<()> {
        if s.cut || !self.behind(s, d) {
            return None;
        }
        let c = &s.coord;
        let (epoch, fence, grant) = (c.epoch, holder_fence(c), grant_of(c, &self.key, A));
        let daemon = &mut s.daemons[d];
        daemon.view.on_applied(epoch);
        daemon.grant = grant;
        daemon.view_fence = fence;
        // Deposed: the view shows another holder's fence, so it stops writing and is a
        // standby (its ledger goes with the role: a claim starts a new one).
        if daemon.fence.is_some_and(|f| f != fence) {
            daemon.fence = None;
            daemon.held = None;
            daemon.unknown_until_ms = 0;
            daemon.passed = true;
        }
        Some(())
    }

    /// Commits a renewal and puts its answer in flight; a renewal sent into a cut is lost.
    fn renew(&self, s: &mut State, d: usize) -> Option<()> {
        if s.daemons[d].stopped {
            return None;
        }
        if self.liveness {
            if s.daemons[d].renewed_this_tick {
                return None;
            }
            s.daemons[d].renewed_this_tick = true;
            if s.cut {
                return Some(());
            }
        } else {
            if s.cut || s.daemons[d].renewals >= self.bounds.renewals_per_daemon {
                return None;
            }
            s.daemons[d].renewals += 1;
        }
        let acked_epoch = self.ack_of(s, d);
        let sent_local_ms = s.local_ms(d);
        let op = Operation::RenewDaemonLease {
            region: self.region_ids[A].clone(),
            node: node_of(d),
            acked_epoch,
        };
        let mut response = self.apply(s, op);
        // The coordinator grants a deposed agent's renewal no lease; the mutant grants it one.
        if !self.guarded(Guard::RecordCoversLease) {
            if let Response::LeaseRenewed { lease_ms, .. } = &mut response {
                if *lease_ms == 0 {
                    *lease_ms = s.coord.lease.lease_ms;
                }
            }
        }
        if !self.guarded(Guard::LeastLiveAck) {
            let r = s.coord.make_mut().regions[A].as_mut()?;
            r.acked_epoch = r.acked_epoch.max(acked_epoch);
        }
        let lease = RegionLease::from_response(&response, sent_local_ms)?;
        let deposed = s
            .coord
            .region(A)
            .and_then(|r| r.daemons.get(&node_of(d)))
            .is_some_and(|r| r.deposed);
        if deposed && self.guarded(Guard::RecordCoversLease) {
            return Some(());
        }
        s.send(Msg::Lease {
            daemon: d as u8,
            epoch: lease.epoch,
            start_local_ms: lease.start_local_ms,
            lease_ms: lease.lease_ms,
        });
        Some(())
    }

    /// A claim that wins starts the agent afresh (`Written::new`): nothing written yet,
    /// an earlier agent's shares possibly held for a lease from now, its first pass to tell.
    fn claim(&self, s: &mut State, d: usize) -> Option<()> {
        let daemon = &s.daemons[d];
        if s.cut || s.spent.claims >= self.bounds.claims || daemon.fence.is_some() || daemon.stopped
        {
            return None;
        }
        s.spent.claims += 1;
        let replaced = s.coord.region(A).and_then(|r| r.agent).map(|a| a.node);
        let op = Operation::ClaimAgent {
            region: self.region_ids[A].clone(),
            node: node_of(d),
            fence_seen: s.daemons[d].view_fence,
        };
        let Response::AgentClaimed { fence } = self.apply(s, op) else {
            return Some(());
        };
        if !self.guarded(Guard::ClaimMarksLeft) {
            let r = s.coord.make_mut().regions[A].as_mut()?;
            if let Some(record) = replaced.and_then(|n| r.daemons.get_mut(&n)) {
                record.left = false;
                record.deposed = false;
            }
        }
        let local = s.local_ms(d);
        let daemon = &mut s.daemons[d];
        daemon.fence = Some(fence);
        // As a standby it acknowledged its view.
        daemon.acked = daemon.acked.max(daemon.view.applied_epoch());
        daemon.held = None;
        daemon.unknown_until_ms = local + LEASE_MS;
        daemon.passed = false;
        if !self.guarded(Guard::PassedAfterFirstPass) {
            self.pass(s, d, fence);
        }
        Some(())
    }

    fn write(&self, s: &mut State, d: usize) -> Option<()> {
        let margin = self.margin_ms();
        let local = s.local_ms(d);
        let redis_now = s.redis_ms();
        let daemon = &mut s.daemons[d];
        let fence = daemon.fence?;
        if daemon.writes >= self.bounds.writes_per_daemon {
            return None;
        }
        let end = daemon.view.lease()?.end_local_ms(margin);
        let remaining_ms = end.checked_sub(local).filter(|&r| r > 0)?;
        let epoch = daemon.view.applied_epoch();
        let share_ppm = daemon.grant.share_ppm;
        let write = Write {
            fence,
            epoch,
            share_ppm,
            floor_ppm: daemon.grant.floor_ppm,
            remaining_ms,
            // Redis read its clock at the local reading: the latest end the mapping allows.
            not_after_ms: self
                .guarded(Guard::NotAfter)
                .then_some(redis_now + remaining_ms),
        };
        daemon.writes += 1;
        daemon.outstanding = Some(Outstanding {
            fence,
            epoch,
            share_ppm,
            until_ms: end,
            landed: false,
        });
        // Recorded as a write whose outcome is unknown (`Written::record` of a failure) until
        // it is answered: the agent may give up on it at any time.
        daemon.held = Some(match daemon.held {
            Some(old) => Held {
                fence,
                epoch,
                share_ppm: old.share_ppm.max(share_ppm),
                until_ms: old.until_ms.max(end),
                confirmed: old.confirmed,
                dirty: true,
            },
            None => Held {
                fence,
                epoch,
                share_ppm,
                until_ms: end,
                confirmed: false,
                dirty: true,
            },
        });
        s.send(Msg::Write {
            daemon: d as u8,
            write,
        });
        Some(())
    }

    /// The primary's answer (`Written::record` of a success); then `WAIT`: the pass is
    /// complete, and acknowledged, if the replica has the write.
    fn write_ok(&self, s: &mut State, d: usize) -> Option<()> {
        let o = s.daemons[d].outstanding.filter(|o| o.landed)?;
        let held = Held {
            fence: o.fence,
            epoch: o.epoch,
            share_ppm: o.share_ppm,
            until_ms: o.until_ms,
            confirmed: true,
            dirty: false,
        };
        let replicated = self.replicated(s, &held);
        let daemon = &mut s.daemons[d];
        daemon.outstanding = None;
        if daemon.fence != Some(o.fence) {
            return Some(());
        }
        daemon.held = Some(held);
        if replicated {
            daemon.acked = daemon.acked.max(o.epoch);
            daemon.unconfirmed = None;
        } else {
            daemon.unconfirmed = Some((o.fence, o.epoch));
        }
        Some(())
    }

    /// The agent's first complete, replicated pass under its fence: it commits
    /// `AgentPassed`, and the left records of agents that stopped go.
    fn passed(&self, s: &mut State, d: usize) -> Option<()> {
        let daemon = &s.daemons[d];
        let fence = daemon.fence?;
        let h = daemon.held?;
        let done = h.fence == fence && h.confirmed && !h.dirty && self.replicated(s, &h);
        if s.cut || daemon.passed || !done {
            return None;
        }
        self.pass(s, d, fence);
        Some(())
    }

    fn pass(&self, s: &mut State, d: usize, fence: u64) {
        let op = Operation::AgentPassed {
            region: self.region_ids[A].clone(),
            node: node_of(d),
            fence,
        };
        let r = self.apply(s, op);
        assert!(
            matches!(r, Response::AgentPassed | Response::AgentHeld { .. }),
            "{r:?}"
        );
        s.daemons[d].passed = true;
    }

    fn stop(&self, s: &mut State, d: usize, release: bool) -> Option<()> {
        if s.daemons[d].stopped || s.spent.stops >= self.bounds.stops {
            return None;
        }
        s.spent.stops += 1;
        if release && !s.cut {
            let op = Operation::ReleaseAgent {
                region: self.region_ids[A].clone(),
                node: node_of(d),
                fence: s.daemons[d].fence.unwrap_or(0),
            };
            self.apply(s, op);
        }
        let daemon = &mut s.daemons[d];
        daemon.stopped = true;
        daemon.view = RegionView::new();
        daemon.fence = None;
        daemon.held = None;
        daemon.unknown_until_ms = 0;
        daemon.passed = true;
        daemon.unconfirmed = None;
        daemon.outstanding = None;
        Some(())
    }

    fn deliver(&self, s: &mut State, m: Msg) -> Option<()> {
        if !self.deliverable(s, &m) {
            return None;
        }
        match m {
            Msg::Lease {
                daemon,
                epoch,
                start_local_ms,
                lease_ms,
            } => {
                let d = &mut s.daemons[usize::from(daemon)];
                if !self.guarded(Guard::AckApplied) {
                    d.heard_epoch = d.heard_epoch.max(epoch);
                }
                let mut lease = RegionLease {
                    epoch,
                    start_local_ms,
                    lease_ms,
                };
                if !self.guarded(Guard::LeaseAfterApply) {
                    lease.epoch = lease.epoch.min(d.view.applied_epoch());
                }
                d.view.on_renewal(lease);
            }
            Msg::Write { daemon, write } => self.land(s, usize::from(daemon), write),
        }
        Some(())
    }

    /// A write reaches its Redis primary: `set_params.lua`'s fence rule, then its lease end.
    fn land(&self, s: &mut State, d: usize, w: Write) {
        let now = s.redis_ms();
        let before = s.redis.primary;
        let stored = Fence {
            token: before.fence,
            epoch: before.epoch,
        };
        let this = Fence {
            token: w.fence,
            epoch: w.epoch,
        };
        if self.guarded(Guard::FenceCheck) && Fence::refuses(Some(stored), Some(this)).is_some() {
            return;
        }
        let after = Stored {
            fence: w.fence,
            epoch: w.epoch,
            share_ppm: w.share_ppm,
            floor_ppm: w.floor_ppm,
            until_ms: lease_end(w.remaining_ms, w.not_after_ms).end_at(now),
        };
        if w.fence < before.fence && after.share_ppm > before.share_ppm {
            s.deposed_raise = true;
        }
        s.redis.primary = after;
        if let Some(o) = s.daemons[d].outstanding.as_mut() {
            if o.fence == w.fence && o.epoch == w.epoch {
                o.landed = true;
            }
        }
    }

    fn tick(&self, s: &mut State, step: Option<Step>) -> Option<()> {
        if s.t >= self.bounds.horizon_ticks || (self.liveness && self.urgent(s)) {
            return None;
        }
        if let Some(step) = step {
            if s.spent.drift_steps >= self.bounds.drift_steps {
                return None;
            }
            s.spent.drift_steps += 1;
            let (clock, by) = match step {
                Step::Slow(c) => (c, -1),
                Step::Fast(c) => (c, 1),
            };
            match clock {
                Clock::Leader => s.leader_off += by,
                Clock::Daemon(d) => s.daemons[usize::from(d)].off += by,
                Clock::Redis => s.redis.off += by,
            }
        }
        s.t += 1;
        for d in &mut s.daemons {
            d.renewed_this_tick = false;
        }
        Some(())
    }
}

impl LeaseModel {
    /// Forgets what can no longer change anything, so that states which behave alike are one
    /// state: a stored end already passed (Redis's clock never goes back), the replica once no
    /// failover is left (only WAIT reads it then, and it would find every write), an end in
    /// the agent's ledger once it has run out (slack included), an earlier agent's end that
    /// cannot run out before the horizon, an answer whose lease is over, a write the primary
    /// will refuse whenever it lands, and a pending write that can no longer land.
    pub(crate) fn settle(&self, s: &mut State) {
        let margin = self.margin_ms();
        let failover_left = s.spent.failovers < self.bounds.failovers;
        let redis_now = s.redis_ms();
        for stored in [&mut s.redis.primary, &mut s.redis.replica] {
            if stored.until_ms <= redis_now {
                stored.until_ms = 0;
            }
        }
        if !failover_left {
            s.redis.replica = s.redis.primary;
        }
        let locals: [u64; DAEMONS] = std::array::from_fn(|d| s.local_ms(d));
        let slack = self.slack_ms();
        let replica = s.redis.replica;
        // The latest reading each daemon's clock can reach in the run.
        let steps_left = u64::from(self.bounds.drift_steps - s.spent.drift_steps);
        let latest: [u64; DAEMONS] = std::array::from_fn(|d| {
            let ticks_left = u64::from(self.bounds.horizon_ticks - s.t);
            locals[d] + ticks_left + steps_left
        });
        for (d, daemon) in s.daemons.iter_mut().enumerate() {
            // A standby acknowledges its view, and what it acknowledged as the agent is no
            // later; its write's answer changes nothing (a claim starts a new ledger).
            if daemon.fence.is_none() {
                daemon.acked = 0;
                daemon.outstanding = None;
                daemon.unconfirmed = None;
            }
            // The next pass's `WAIT` finds it.
            if daemon
                .unconfirmed
                .is_some_and(|(f, e)| replica.fence >= f && replica.epoch >= e)
            {
                daemon.unconfirmed = None;
            }
            let unknown = daemon.unknown_until_ms.saturating_add(slack);
            if locals[d] >= unknown {
                daemon.unknown_until_ms = 0;
            } else if latest[d] < unknown && !self.exact {
                daemon.unknown_until_ms = u64::MAX;
            }
            if let Some(h) = daemon.held.as_mut() {
                let end = h.until_ms.saturating_add(slack);
                if locals[d] >= end {
                    h.until_ms = 0;
                } else if latest[d] < end && !self.exact {
                    h.until_ms = u64::MAX;
                }
            }
            if let Some(o) = daemon.outstanding.as_mut() {
                if latest[d] < o.until_ms.saturating_add(slack) && !self.exact {
                    o.until_ms = u64::MAX;
                }
            }
        }
        let primary = s.redis.primary;
        let refused = |w: &Write| {
            let stored = Fence {
                token: primary.fence,
                epoch: primary.epoch,
            };
            let this = Fence {
                token: w.fence,
                epoch: w.epoch,
            };
            !failover_left
                && self.guarded(Guard::FenceCheck)
                && Fence::refuses(Some(stored), Some(this)).is_some()
        };
        let stopped: [bool; DAEMONS] = std::array::from_fn(|d| s.daemons[d].stopped);
        s.net.retain(|m| match m {
            Msg::Lease {
                daemon,
                start_local_ms,
                lease_ms,
                ..
            } => {
                let d = usize::from(*daemon);
                !stopped[d] && start_local_ms + lease_ms > locals[d] + margin
            }
            Msg::Write { write, .. } => !refused(write),
        });
        for (d, daemon) in s.daemons.iter_mut().enumerate() {
            if let Some(o) = daemon.outstanding.filter(|o| !o.landed) {
                let in_flight = s.net.iter().any(|m| {
                    matches!(m, Msg::Write { daemon, write }
                        if usize::from(*daemon) == d && write.fence == o.fence && write.epoch == o.epoch)
                });
                if !in_flight {
                    daemon.outstanding = None;
                }
            }
        }
    }
}

impl LeaseModel {
    /// Liveness runs: while anything is urgent, the first urgent event in a fixed order
    /// (answers delivered, replicas caught up, renewals sent); otherwise the environment
    /// chooses — time passes (with a clock step or not), a share changes, A is cut off or
    /// reconnected.
    fn liveness_actions(&self, s: &State, out: &mut Vec<Action>) {
        let deliver = s
            .net
            .iter()
            .find(|m| self.deliverable(s, m))
            .map(|&m| Action::Deliver(m));
        let catch_up = (0..DAEMONS)
            .find(|&d| !s.cut && self.behind(s, d))
            .map(|d| Action::CatchUp(d as u8));
        let renew = (0..DAEMONS)
            .find(|&d| !(s.daemons[d].renewed_this_tick || s.daemons[d].stopped))
            .map(|d| Action::Renew(d as u8));
        if let Some(urgent) = deliver.or(catch_up).or(renew) {
            out.push(urgent);
            return;
        }
        let b = &self.bounds;
        if s.t < b.horizon_ticks {
            out.push(Action::Tick(None));
            if s.spent.drift_steps < b.drift_steps {
                out.extend(STEPS.iter().map(|&step| Action::Tick(Some(step))));
            }
        }
        if s.spent.reshares < b.reshares {
            out.push(Action::Reshare {
                region: A as u8,
                up: false,
            });
            out.push(Action::Reshare {
                region: crate::world::B as u8,
                up: true,
            });
        }
        if s.cut {
            out.push(Action::Heal);
        } else if s.spent.cuts < b.cuts {
            out.push(Action::Cut);
        }
    }
}

impl stateright::Model for LeaseModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.init.clone()]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        if self.liveness {
            return self.liveness_actions(s, out);
        }
        let b = &self.bounds;
        if s.t < b.horizon_ticks {
            out.push(Action::Tick(None));
            if s.spent.drift_steps < b.drift_steps {
                out.extend(STEPS.iter().map(|&step| Action::Tick(Some(step))));
            }
        }
        // The leader moves share from A to B: A is the region whose cuts the protocol must
        // make safe (B's side of a move is the same protocol, worst case assumed).
        if s.spent.reshares < b.reshares {
            out.push(Action::Reshare {
                region: A as u8,
                up: false,
            });
            out.push(Action::Reshare {
                region: crate::world::B as u8,
                up: true,
            });
        }
        for d in 0..DAEMONS {
            let daemon = &s.daemons[d];
            let d8 = d as u8;
            if daemon.stopped {
                continue;
            }
            if s.spent.stops < b.stops {
                out.push(Action::Stop(d8));
                out.push(Action::Kill(d8));
            }
            if !s.cut && self.behind(s, d) {
                out.push(Action::CatchUp(d8));
            }
            let renew = if self.liveness {
                !daemon.renewed_this_tick
            } else {
                !s.cut && daemon.renewals < b.renewals_per_daemon
            };
            if renew {
                out.push(Action::Renew(d8));
            }
            if !s.cut && s.spent.claims < b.claims && daemon.fence.is_none() {
                out.push(Action::Claim(d8));
            }
            if daemon.fence.is_some() && daemon.writes < b.writes_per_daemon {
                out.push(Action::Write(d8));
            }
            if daemon.outstanding.is_some_and(|o| o.landed) {
                out.push(Action::WriteOk(d8));
            }
            if !s.cut && daemon.fence.is_some() && !daemon.passed {
                out.push(Action::Passed(d8));
            }
        }
        let mut last = None;
        for &m in &s.net {
            if last == Some(m) || !self.deliverable(s, &m) {
                continue;
            }
            last = Some(m);
            out.push(Action::Deliver(m));
            if s.spent.duplicates < b.duplicates {
                out.push(Action::Duplicate(m));
            }
        }
        if s.redis.replica != s.redis.primary {
            out.push(Action::Replicate);
            if s.spent.failovers < b.failovers {
                out.push(Action::Failover);
            }
        }
        if s.cut {
            out.push(Action::Heal);
        } else if s.spent.cuts < b.cuts {
            out.push(Action::Cut);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Tick(step) => self.tick(&mut s, step)?,
            Action::Reshare { region, up } => self.reshare(&mut s, usize::from(region), up)?,
            Action::CatchUp(d) => self.catch_up(&mut s, usize::from(d))?,
            Action::Renew(d) => self.renew(&mut s, usize::from(d))?,
            Action::Claim(d) => self.claim(&mut s, usize::from(d))?,
            Action::Write(d) => self.write(&mut s, usize::from(d))?,
            Action::WriteOk(d) => self.write_ok(&mut s, usize::from(d))?,
            Action::Passed(d) => self.passed(&mut s, usize::from(d))?,
            Action::Stop(d) => self.stop(&mut s, usize::from(d), true)?,
            Action::Kill(d) => self.stop(&mut s, usize::from(d), false)?,
            Action::Deliver(m) => {
                if !s.take(&m) {
                    return None;
                }
                self.deliver(&mut s, m)?;
            }
            Action::Duplicate(m) => {
                if s.spent.duplicates >= self.bounds.duplicates || !s.net.contains(&m) {
                    return None;
                }
                s.spent.duplicates += 1;
                self.deliver(&mut s, m)?;
            }
            Action::Replicate => {
                if s.redis.replica == s.redis.primary {
                    return None;
                }
                s.redis.replica = s.redis.primary;
            }
            Action::Failover => {
                if s.spent.failovers >= self.bounds.failovers || s.redis.replica == s.redis.primary
                {
                    return None;
                }
                s.spent.failovers += 1;
                s.redis.primary = s.redis.replica;
            }
            Action::Cut => {
                if s.cut || s.spent.cuts >= self.bounds.cuts {
                    return None;
                }
                s.spent.cuts += 1;
                s.cut = true;
            }
            Action::Heal => {
                if !s.cut {
                    return None;
                }
                s.cut = false;
                s.healed_at = Some(s.t);
            }
        }
        if s.cut && !s.lapsed {
            let margin = self.margin_ms();
            s.lapsed = (0..DAEMONS).all(|d| {
                let lease = s.daemons[d].view.lease();
                lease.is_none_or(|l| s.local_ms(d) >= l.end_local_ms(margin))
            });
        }
        self.settle(&mut s);
        Some(s)
    }

    fn properties(&self) -> Vec<stateright::Property<Self>> {
        all(self)
    }
}

/// Applies `op` at `now_ms` and empties the deduplication window.
fn commit(c: &mut CoordinatorState, now_ms: u64, op: Operation) -> Response {
    let response = c.apply(&Command {
        request: RequestId(0),
        now_ms,
        op,
    });
    c.recent.clear();
    response
}

/// The fence of region A's agent role in `c` (0: nobody holds it).
fn holder_fence(c: &CoordinatorState) -> u64 {
    c.region(A).and_then(|r| r.agent).map_or(0, |a| a.fence)
}

/// The stored lease end rule of `set_params.lua`, as quota-store states it: `min(now +
/// remaining, not_after)`.
fn lease_end(remaining_ms: u64, not_after_ms: Option<u64>) -> LeaseEnd {
    LeaseEnd {
        remaining_ms,
        // The floor's terms do not matter here: the model reads the floor as a share.
        floor: Limit::SlidingWindow {
            limit: 1,
            window_ms: 1_000,
        },
        not_after_ms,
    }
}

/// The policy: a burst of 10 tokens (one unit each), a floor of one unit per region, split
/// (not home) mode with two regions.
fn policy() -> Policy {
    Policy {
        limit: u64::from(BUDGET_UNITS),
        window_ms: 1_000,
        burst: u64::from(BUDGET_UNITS),
        version: 0,
        tier: Tier::Standard,
        fail_mode: FailMode::Local,
        floor_ppm: FLOOR_PPM,
        algorithm: Algorithm::TokenBucket,
        mode: PolicyMode::Enforcing,
        replaces: None,
        debt_limit: 0,
        after_the_fact: false,
    }
}

/// The start of every run: the policy put with its even split (5 units each), both daemons
/// of A renewed at epoch e and caught up (B renewed too), a1 holding A's agent role, and A's
/// Redis holding a1's write of epoch e, replicated.
fn initial(key: &PolicyKey, region_ids: &[RegionId; REGIONS], margin: u64) -> State {
    let mut c = CoordinatorState::default();
    let config = LeaseConfig {
        lease_ms: LEASE_MS,
        drift_margin_ms: margin,
    };
    assert_eq!(
        commit(&mut c, BASE_MS, Operation::SetLeaseConfig { config }),
        Response::LeaseConfigSet
    );
    for id in region_ids {
        let op = Operation::PutRegion {
            region: id.clone(),
            reserves_floor: true,
            draining: false,
        };
        let r = commit(&mut c, BASE_MS, op);
        assert!(matches!(r, Response::RegionStored { .. }), "{r:?}");
    }
    let put = Operation::PutPolicy {
        key: key.clone(),
        policy: policy(),
    };
    let r = commit(&mut c, BASE_MS, put);
    assert!(matches!(r, Response::PolicyStored { .. }), "{r:?}");
    let epoch = c.epoch;
    let mut renew = |region: usize, node: u64| {
        let op = Operation::RenewDaemonLease {
            region: region_ids[region].clone(),
            node,
            acked_epoch: epoch,
        };
        let r = commit(&mut c, BASE_MS, op);
        RegionLease::from_response(&r, BASE_MS).expect("renewed")
    };
    let leases: [RegionLease; DAEMONS] = std::array::from_fn(|d| renew(A, node_of(d)));
    renew(crate::world::B, node_of(DAEMONS));
    let op = Operation::ClaimAgent {
        region: region_ids[A].clone(),
        node: node_of(0),
        fence_seen: 0,
    };
    let fence = match commit(&mut c, BASE_MS, op) {
        Response::AgentClaimed { fence } => fence,
        r => panic!("claim refused: {r:?}"),
    };
    let grant = grant_of(&c, key, A);
    // a1's ledger: its write of epoch e, answered and replicated, and no earlier agent.
    let held = Held {
        fence,
        epoch,
        share_ppm: grant.share_ppm,
        until_ms: leases[0].end_local_ms(margin),
        confirmed: true,
        dirty: false,
    };
    let daemons = std::array::from_fn(|d| {
        let holder = d == 0;
        let mut view = RegionView::new();
        view.on_applied(epoch);
        view.on_renewal(leases[d]);
        Daemon {
            off: 0,
            view,
            grant,
            view_fence: fence,
            heard_epoch: epoch,
            fence: holder.then_some(fence),
            acked: if holder { epoch } else { 0 },
            held: holder.then_some(held),
            unknown_until_ms: 0,
            passed: true,
            unconfirmed: None,
            stopped: false,
            outstanding: None,
            renewals: 0,
            writes: 0,
            renewed_this_tick: false,
        }
    });
    let end = leases[0].end_local_ms(margin);
    let stored = Stored {
        fence,
        epoch,
        share_ppm: grant.share_ppm,
        floor_ppm: grant.floor_ppm,
        until_ms: lease_end(end - BASE_MS, Some(end)).end_at(BASE_MS),
    };
    State {
        t: 0,
        leader_off: 0,
        coord: Coord::new(c),
        daemons,
        redis: Redis {
            off: 0,
            primary: stored,
            replica: stored,
        },
        net: Vec::new(),
        cut: false,
        healed_at: None,
        spent: Spent::default(),
        deposed_raise: false,
        lapsed: false,
    }
}

/// A region's grant as its daemons read it from their replica.
pub fn grant_of(c: &CoordinatorState, key: &PolicyKey, region: usize) -> RegionShare {
    c.region_share(key, region).expect("the policy exists")
}

// What the checker holds the model to, and what each region enforces at an instant
// (re-exported as `crate::properties`, whose documentation says how regions count).

/// Safety: Σ over regions of what each enforces ≤ the budget.
pub const BUDGET: &str = "the regions together enforce at most the budget";
/// Safety: region A never enforces more than its enforceable share at the coordinator.
pub const ENFORCEABLE: &str = "A never enforces more than the coordinator counts for it";
/// Safety: no region's floor is ever given to another, and no grant goes below a floor.
pub const FLOORS: &str = "floors are never granted to another region";
/// Safety: `CoordinatorState::check_invariant` holds.
pub const COORDINATOR: &str = "the coordinator's enforceable shares sum to at most the budget";
/// Safety: a write of a deposed agent never lands over a newer holder's and raises it.
pub const DEPOSED: &str = "a deposed agent never raises a share";
/// Liveness (bounded): region A, reconnected for a tick, holds a lease again.
pub const LEASE_BACK: &str = "A, reconnected for a tick, holds a lease again";
/// Reachability: A was cut off until its leases ran out, then reconnected for a tick.
pub const LAPSED_AND_BACK: &str = "reachable: A's leases ran out in a cut, then it was reconnected";
/// Reachability: the share taken from one region is enforced by the other.
pub const MOVED: &str = "reachable: B enforces a share taken from A";
/// Reachability: a2 took A's agent role from a1 and its write landed.
pub const TAKEOVER: &str = "reachable: a2 took A's role and its write landed";
/// Reachability: a1 stopped as agent, and a2's `AgentPassed` ended its left record.
pub const PASSED: &str = "reachable: a2 passed after a1 stopped, and a1's record went";
/// Reachability: a failover loses a write (the replica lags the primary when it is promoted).
pub const LOST_WRITE: &str = "reachable: a failover lost a write";

/// The safety properties, the liveness property of a liveness model, and reachability
/// properties (the checker must find each, so the safety checks are not vacuous).
pub fn all(m: &LeaseModel) -> Vec<Property<LeaseModel>> {
    if m.liveness {
        return vec![
            Property::always(LEASE_BACK, lease_back),
            Property::always(BUDGET, |m, s| total(m, s) <= u64::from(PPM)),
            Property::sometimes(LAPSED_AND_BACK, |m: &LeaseModel, s: &State| {
                s.lapsed
                    && s.healed_at
                        .is_some_and(|h| !s.cut && s.t > h && !m.urgent(s))
            }),
        ];
    }
    vec![
        Property::always(BUDGET, |m, s| total(m, s) <= u64::from(PPM)),
        Property::always(ENFORCEABLE, within_enforceable),
        Property::always(FLOORS, floors_kept),
        Property::always(COORDINATOR, |_, s: &State| {
            s.coord.check_invariant().is_ok()
        }),
        Property::always(DEPOSED, |_, s: &State| !s.deposed_raise),
        Property::sometimes(MOVED, |m, s| {
            region_enforced(m, s, B) > m.initial_shares_ppm[B]
        }),
        Property::sometimes(TAKEOVER, |_, s: &State| {
            let holder = s.coord.region(A).and_then(|r| r.agent);
            holder.is_some_and(|a| a.node == node_of(1) && s.redis.primary.fence == a.fence)
        }),
        Property::sometimes(PASSED, |_, s: &State| {
            let r = s.coord.region(A);
            s.daemons[0].stopped
                && s.daemons[1].fence.is_some()
                && s.daemons[1].passed
                && r.is_some_and(|r| !r.daemons.contains_key(&node_of(0)))
        }),
        // A failover is taken only when the replica lags, so each one loses a write.
        Property::sometimes(LOST_WRITE, |_, s: &State| s.spent.failovers > 0),
    ]
}

/// What daemon `d` enforces in process now (nothing once stopped).
pub fn in_process(m: &LeaseModel, s: &State, d: usize) -> u32 {
    let daemon = &s.daemons[d];
    if daemon.stopped {
        return 0;
    }
    daemon
        .view
        .enforced_share(&daemon.grant, s.local_ms(d), m.margin_ms())
}

/// What a gateway deciding against region A's Redis primary gets now.
pub fn gateway(s: &State) -> u32 {
    s.redis.primary.enforced(s.redis_ms())
}

/// What region `r` enforces now: for A the larger of its Redis and its daemons, for B all it
/// may (see the module doc).
pub fn region_enforced(m: &LeaseModel, s: &State, r: usize) -> u32 {
    if r == A {
        (0..DAEMONS)
            .map(|d| in_process(m, s, d))
            .fold(gateway(s), u32::max)
    } else {
        enforceable(m, s, r)
    }
}

/// Σ over regions of what each enforces now.
pub fn total(m: &LeaseModel, s: &State) -> u64 {
    (0..REGIONS)
        .map(|r| u64::from(region_enforced(m, s, r)))
        .sum()
}

/// The coordinator's time for its next command: the leader's clock, clamped as `apply` does.
fn coordinator_now(s: &State) -> u64 {
    s.leader_now_ms().max(s.coord.last_now_ms)
}

/// What the coordinator counts region `r` as possibly enforcing now.
pub fn enforceable(m: &LeaseModel, s: &State, r: usize) -> u32 {
    let c = &s.coord;
    let entry = &c.entries[&m.key];
    c.enforceable(entry, r, coordinator_now(s))
}

fn within_enforceable(m: &LeaseModel, s: &State) -> bool {
    region_enforced(m, s, A) <= enforceable(m, s, A)
}

fn floors_kept(m: &LeaseModel, s: &State) -> bool {
    let c = &s.coord;
    let entry = &c.entries[&m.key];
    (0..REGIONS).all(|r| {
        let floor = c.floor_of(&entry.policy, r);
        let others: u64 = (0..REGIONS)
            .filter(|&o| o != r)
            .map(|o| u64::from(region_enforced(m, s, o)))
            .sum();
        entry.share(r) >= c.guaranteed_floor(&entry.policy, r)
            && u64::from(floor) + others <= u64::from(PPM)
    })
}

/// Once region A has been reconnected for a full tick and nothing urgent is left, every
/// daemon of A holds a lease in force.
fn lease_back(m: &LeaseModel, s: &State) -> bool {
    let Some(healed) = s.healed_at else {
        return true;
    };
    if s.cut || s.t < healed + 1 || m.urgent(s) {
        return true;
    }
    (0..DAEMONS).all(|d| {
        s.daemons[d]
            .view
            .lease()
            .is_some_and(|l| s.local_ms(d) < l.end_local_ms(m.margin_ms()))
    })
}

#[cfg(test)]
mod tests {
    use stateright::Model as _;

    use super::*;
    use super::{region_enforced, total};
    use crate::world::B;

    fn model(mutant: Option<Guard>) -> LeaseModel {
        LeaseModel::new(crate::scenario::INSTANT.bounds, mutant)
    }

    fn run(m: &LeaseModel, actions: &[Action]) -> State {
        crate::check::replay(m, actions)
            .expect("every action enabled")
            .pop()
            .unwrap()
    }

    #[test]
    fn every_run_starts_from_the_even_split_with_a1_as_agent() {
        let m = model(None);
        let s = m.init_states().remove(0);
        assert_eq!(m.initial_shares_ppm, [5 * UNIT_PPM, 5 * UNIT_PPM]);
        assert_eq!(total(&m, &s), u64::from(PPM));
        assert_eq!(s.daemons[0].fence, Some(holder_fence(&s.coord)));
        assert_eq!(s.daemons[1].fence, None);
        // a1's write holds until its lease's local end, mapped onto Redis's clock.
        let end = s.daemons[0].view.lease().unwrap().end_local_ms(MARGIN_MS);
        assert_eq!(s.redis.primary.until_ms, end);
        assert!(m
            .properties()
            .iter()
            .all(|p| !p.expectation.discovery_is_failure() || (p.condition)(&m, &s)));
    }

    #[test]
    fn a_cut_is_refused_while_the_revocation_lives_and_granted_after_the_acks() {
        let m = model(None);
        let cut = Action::Reshare {
            region: A as u8,
            up: false,
        };
        let raise = Action::Reshare {
            region: B as u8,
            up: true,
        };
        let s = run(&m, &[cut]);
        assert!(m.next_state(&s, raise).is_none(), "A may still enforce 5");
        // Both daemons apply the cut; a1 writes it, hears it replicated; both acknowledge.
        let write = |s: &State| {
            *s.net
                .iter()
                .find(|m| matches!(m, Msg::Write { .. }))
                .unwrap()
        };
        let s = run(
            &m,
            &[
                cut,
                Action::CatchUp(0),
                Action::CatchUp(1),
                Action::Write(0),
            ],
        );
        let s = run_from(&m, s.clone(), &[Action::Deliver(write(&s))]);
        let s = run_from(
            &m,
            s,
            &[
                Action::Replicate,
                Action::WriteOk(0),
                Action::Renew(0),
                Action::Renew(1),
                raise,
            ],
        );
        assert_eq!(region_enforced(&m, &s, A), 4 * UNIT_PPM);
        assert_eq!(region_enforced(&m, &s, B), 6 * UNIT_PPM);
    }

    fn run_from(m: &LeaseModel, mut s: State, actions: &[Action]) -> State {
        for &a in actions {
            s = m
                .next_state(&s, a)
                .unwrap_or_else(|| panic!("{a:?} not enabled"));
        }
        s
    }

    const CUT: Action = Action::Reshare {
        region: A as u8,
        up: false,
    };

    fn region_acked(s: &State) -> u64 {
        s.coord.region(A).unwrap().acked_epoch
    }

    fn the_write(s: &State, d: u8) -> Msg {
        *s.net
            .iter()
            .find(|m| matches!(m, Msg::Write { daemon, .. } if *daemon == d))
            .expect("a write in flight")
    }

    #[test]
    fn a_standby_acks_its_view_the_agent_its_pass_and_a_deposed_agents_record_holds() {
        let m = model(None);
        let s = run(&m, &[CUT, Action::CatchUp(0), Action::CatchUp(1)]);
        let (old, new) = (s.coord.epoch - 1, s.coord.epoch);
        assert_eq!(
            m.ack_of(&s, 0),
            old,
            "the agent: Redis may hold 5 until its pass"
        );
        assert_eq!(m.ack_of(&s, 1), new, "a standby: its view, at once");
        // a2 takes the role; a1 sees it and stands by, acknowledging its view.
        let s = run_from(&m, s, &[Action::Claim(1), Action::CatchUp(0)]);
        assert_eq!(s.daemons[0].fence, None);
        assert_eq!(m.ack_of(&s, 0), new);
        // Its record is deposed: its renewal changes nothing, and it holds A's back.
        let s = run_from(&m, s, &[Action::Renew(0), Action::Renew(1)]);
        assert_eq!(region_acked(&s), old);
    }

    #[test]
    fn the_bounded_ack_waits_two_margins_past_the_stored_end() {
        // Exact ends: the instant search's horizon would forget this one.
        let (strict, one) = (model(None).exact(), model(Some(Guard::WriteRunOut)).exact());
        let s = run(&strict, &[CUT, Action::CatchUp(0)]);
        let end = s.daemons[0].held.unwrap().until_ms;
        let at = |local: u64| {
            let mut x = s.clone();
            x.daemons[0].off = (local - s.local_ms(0)) as i8;
            x
        };
        assert!(!strict.bounded(&at(end + MARGIN_MS), 0));
        assert!(strict.bounded(&at(end + 2 * MARGIN_MS), 0));
        assert_eq!(strict.ack_of(&at(end + 2 * MARGIN_MS), 0), s.coord.epoch);
        assert!(one.bounded(&at(end + MARGIN_MS), 0));
    }

    #[test]
    fn a_write_the_primary_answered_bounds_the_store_only_once_wait_confirmed_it() {
        let m = model(None);
        let s = run(&m, &[CUT, Action::CatchUp(0), Action::Write(0)]);
        let s = run_from(
            &m,
            s.clone(),
            &[Action::Deliver(the_write(&s, 0)), Action::WriteOk(0)],
        );
        assert_eq!(s.daemons[0].unconfirmed, Some((1, s.coord.epoch)));
        assert!(!m.bounded(&s, 0));
        assert!(
            model(Some(Guard::BoundedAfterWait)).bounded(&s, 0),
            "quotad's rule"
        );
        let s = run_from(&m, s, &[Action::Replicate]);
        assert_eq!(s.daemons[0].unconfirmed, None);
        assert!(m.bounded(&s, 0) && m.complete(&s, 0));
    }

    #[test]
    fn a_stopped_agents_record_holds_the_region_until_its_successor_passed() {
        let m = model(None);
        let s = run(
            &m,
            &[
                CUT,
                Action::CatchUp(1),
                Action::Renew(1),
                Action::Stop(0),
                Action::CatchUp(1),
                Action::Claim(1),
                Action::Write(1),
            ],
        );
        let (old, new) = (s.coord.epoch - 1, s.coord.epoch);
        assert!(s.coord.region(A).unwrap().daemons[&node_of(0)].left);
        assert_eq!(region_acked(&s), old);
        let s = run_from(
            &m,
            s.clone(),
            &[Action::Deliver(the_write(&s, 1)), Action::WriteOk(1)],
        );
        assert!(m.next_state(&s, Action::Passed(1)).is_none(), "WAIT first");
        let s = run_from(&m, s, &[Action::Replicate, Action::Passed(1)]);
        assert!(!s.coord.region(A).unwrap().daemons.contains_key(&node_of(0)));
        assert_eq!(region_acked(&s), new);
    }
}
