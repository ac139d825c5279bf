//! The world the model runs in: its fixed cast, the lease timing in ticks, the bounds of a
//! search, and the guards a mutant switches off.
//!
//! One tick of true time is one millisecond to the real functions the model calls, so
//! `LeaseConfig { lease_ms: 4, drift_margin_ms: 1 }` is a lease of four ticks. Every clock
//! reads `BASE_MS + t + offset`, its offset changed only by drift steps, so no reading goes
//! below zero.

use std::fmt;

/// What every clock reads at true time 0 (before its offset).
pub const BASE_MS: u64 = 10;
/// The lease a renewal grants, in ticks: the shortest `LeaseConfig::validate` accepts with
/// a margin of one, so a lease runs out within a few ticks of a search.
pub const LEASE_MS: u64 = 3;
/// The drift margin, in ticks: `2 · margin < lease`, as `LeaseConfig::validate` demands.
pub const MARGIN_MS: u64 = 1;
/// One unit of the policy's budget.
pub const UNIT_PPM: u32 = 100_000;
/// The policy's budget in units (a burst of 10 tokens): the whole, `PPM`.
pub const BUDGET_UNITS: u32 = 10;
/// Each region's floor: one unit.
pub const FLOOR_PPM: u32 = UNIT_PPM;

/// Regions: A, modelled in full (two daemons contending for its agent role, its Redis), and
/// B, the worst case of a correct region (it enforces, at every instant, all the coordinator
/// counts for it).
pub const REGIONS: usize = 2;
/// Region A's slot.
pub const A: usize = 0;
/// Region B's slot.
pub const B: usize = 1;
/// Region A's daemons: a1 (the agent at the start) and a2.
pub const DAEMONS: usize = 2;
/// Names used in traces.
pub const DAEMON_NAMES: [&str; DAEMONS] = ["a1", "a2"];
/// Names used in traces and region ids in the coordinator.
pub const REGION_NAMES: [&str; REGIONS] = ["A", "B"];

/// The Raft node id of daemon `d`.
pub fn node_of(d: usize) -> u64 {
    d as u64 + 1
}

/// A share in ppm as units of the budget, for traces.
pub fn units(ppm: u32) -> String {
    if ppm.is_multiple_of(UNIT_PPM) {
        (ppm / UNIT_PPM).to_string()
    } else {
        format!("{:.2}", f64::from(ppm) / f64::from(UNIT_PPM))
    }
}

/// A guard of the protocol. The model runs with all of them on, or with one switched off (a
/// mutant), for which the checker must find a counterexample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Guard {
    /// `CoordinatorState::apply` keeps a revocation for every cut, and refuses a grant while
    /// it is live. Off: the revocations a cut creates are dropped.
    RevokeBeforeGrant,
    /// Daemons stop `drift_margin_ms` early and the coordinator waits as much longer. Off: a
    /// margin of 0 on both sides, in the same world (clocks still drift `2 · MARGIN_MS`).
    DriftMargin,
    /// `set_params.lua` refuses a write whose fence or epoch is below the stored one
    /// (`quota_store::Fence::refuses`). Off: every write lands.
    FenceCheck,
    /// A daemon acknowledges only an epoch it has applied; the agent only that of a complete
    /// pass, or its view once the store is bounded by it. Off: each acknowledges the newest
    /// epoch it has heard of.
    AckApplied,
    /// The region's acknowledgement is the least over its daemons still live. Off: the
    /// latest renewal's acknowledgement is the region's (as with one daemon).
    LeastLiveAck,
    /// The holder counts a pass complete only once `WAIT 1` saw the replica take it. Off:
    /// once the primary answered.
    WaitBeforeAck,
    /// A write carries the writer's lease end mapped onto Redis's clock (`not_after`), so a
    /// write that lands late stores no later end. Off: `until = now + remaining`.
    NotAfter,
    /// A lease renewed at epoch E is usable only once the daemon applied E
    /// (`RegionView::on_renewal`). Off: usable at once, for whatever the daemon applied.
    LeaseAfterApply,
    /// A claim marks the replaced agent's lease record as deposed (`claim_agent`): its
    /// renewals neither raise its acknowledgement nor lengthen it, so it holds the region's
    /// until its lease and the margin are over. Off: the marks are cleared right after the
    /// claim, so the deposed agent, renewing as a standby, acknowledges its view.
    ClaimMarksLeft,
    /// A stopped agent's record (left, by `ReleaseAgent`) goes with the next agent's
    /// `AgentPassed`, which it commits only after its first complete pass, confirmed by a
    /// replica (`WAIT`). Off: with its claim, before it has written anything.
    PassedAfterFirstPass,
    /// With its writes unanswered, the agent acknowledges its view only once each share it
    /// may have stored above the view's has run out two margins past the stored end, on its
    /// own clock (`Written::bounded_by`'s slack). Off: one margin.
    WriteRunOut,
    /// The agent's bounded acknowledgement (`bounded_by`, its writes not all answered) waits,
    /// as a complete pass does, until `WAIT` has confirmed what the primary answered (quotad's
    /// `unconfirmed`). Off: a write the primary answered counts as the store's at once.
    BoundedAfterWait,
    /// A renewal grants no lease the daemon's record does not count: a deposed agent's
    /// renewal, which leaves its record as it is, is answered with none (quota-core's
    /// `renew_lease`). Off: it is answered with a whole lease.
    RecordCoversLease,
}

impl Guard {
    /// Every guard, in the order the tests report them.
    pub const ALL: [Guard; 13] = [
        Guard::RevokeBeforeGrant,
        Guard::DriftMargin,
        Guard::FenceCheck,
        Guard::AckApplied,
        Guard::LeastLiveAck,
        Guard::WaitBeforeAck,
        Guard::NotAfter,
        Guard::LeaseAfterApply,
        Guard::ClaimMarksLeft,
        Guard::PassedAfterFirstPass,
        Guard::WriteRunOut,
        Guard::BoundedAfterWait,
        Guard::RecordCoversLease,
    ];
}

/// The bounds of one exhaustive search: each counts events over a whole run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// True time runs from 0 to this tick.
    pub horizon_ticks: u8,
    /// Share changes the leader proposes (each one a new epoch when accepted).
    pub reshares: u8,
    /// Lease renewals each daemon sends (in liveness runs: one per tick, unbounded).
    pub renewals_per_daemon: u8,
    /// Parameter writes each daemon sends while it holds the agent role.
    pub writes_per_daemon: u8,
    /// Claims of region A's agent role, by either of its daemons.
    pub claims: u8,
    /// Daemons of A that stop (SIGTERM: they decide and write nothing more and leave,
    /// `ReleaseAgent`) or are killed (no word).
    pub stops: u8,
    /// Messages delivered twice.
    pub duplicates: u8,
    /// Failovers of region A's Redis.
    pub failovers: u8,
    /// Times region A is cut off (each healed at most once).
    pub cuts: u8,
    /// Clock steps, summed over every clock: `2 · MARGIN_MS`, what the margin must cover.
    pub drift_steps: u8,
}

impl fmt::Display for Bounds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "regions {REGIONS} (A: 2 daemons and Redis, B: worst case), budget {BUDGET_UNITS} units, floors 1, \
             lease {LEASE_MS} ticks, margin {MARGIN_MS}; ticks 0..={}, reshares {}, \
             renewals/daemon {}, writes/daemon {}, claims {}, stops {}, duplicates {}, \
             failovers {}, cuts {}, clock steps {}",
            self.horizon_ticks,
            self.reshares,
            if self.renewals_per_daemon == 0 {
                "1 per tick".to_string()
            } else {
                self.renewals_per_daemon.to_string()
            },
            self.writes_per_daemon,
            self.claims,
            self.stops,
            self.duplicates,
            self.failovers,
            self.cuts,
            self.drift_steps
        )
    }
}
