//! The searches the tests run: each exhaustive within its bounds, every guard on.
//!
//! One search over every fault at once does not fit the time a test may take (two daemons,
//! their leases, writes and views, a Redis pair and the coordinator multiply to tens of
//! millions of states by the fifth tick), so each scenario switches on the faults that meet
//! one part of the protocol, with the clocks steps the margin must cover wherever time runs.
//! Every mutant's counterexample is found in the scenario named for it.
//!
//! A cut is in none of the safety scenarios: it only keeps region A's daemons from
//! renewing, claiming, catching up, hearing answers and saying they stop, all of which they
//! may leave undone in any run anyway (a daemon may die without a word), so every state a
//! cut reaches is reached without one (properties do not read the cut). The liveness
//! scenario has one.

use crate::world::{Bounds, Guard, MARGIN_MS};

/// A named search.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    pub name: &'static str,
    pub bounds: Bounds,
}

/// No time passes: the agent role moved by a claim, or by a daemon stopping, with writes in
/// flight, duplicated and reordered, views that lag, renewals with their acknowledgements, a
/// Redis failover, two share changes.
pub const INSTANT: Scenario = Scenario {
    name: "instant: agent move or stop, writes, failover",
    bounds: Bounds {
        horizon_ticks: 0,
        reshares: 2,
        renewals_per_daemon: 1,
        writes_per_daemon: 1,
        claims: 1,
        stops: 1,
        duplicates: 1,
        failovers: 1,
        cuts: 0,
        drift_steps: 0,
    },
};

/// No time passes: each holder writes twice, so its own writes land reordered and twice.
pub const REORDERED_WRITES: Scenario = Scenario {
    name: "instant: reordered writes",
    bounds: Bounds {
        horizon_ticks: 0,
        reshares: 2,
        renewals_per_daemon: 1,
        writes_per_daemon: 2,
        claims: 0,
        stops: 0,
        duplicates: 1,
        failovers: 0,
        cuts: 0,
        drift_steps: 0,
    },
};

/// Leases running out under clock drift of twice the margin (the leader's clock ahead, a
/// daemon's slow or fast, Redis's slow): renewals, share changes, lease answers delayed.
pub const LEASES: Scenario = Scenario {
    name: "leases under drift",
    bounds: Bounds {
        horizon_ticks: 5,
        reshares: 2,
        renewals_per_daemon: 1,
        writes_per_daemon: 0,
        claims: 0,
        stops: 0,
        duplicates: 0,
        failovers: 0,
        cuts: 0,
        drift_steps: 2 * MARGIN_MS as u8,
    },
};

/// Writes that land late, after the writer's lease, under one clock step.
pub const LATE_WRITES: Scenario = Scenario {
    name: "late writes",
    bounds: Bounds {
        horizon_ticks: 5,
        reshares: 2,
        renewals_per_daemon: 1,
        writes_per_daemon: 1,
        claims: 0,
        stops: 0,
        duplicates: 0,
        failovers: 0,
        cuts: 0,
        drift_steps: MARGIN_MS as u8,
    },
};

/// An agent move while time runs: the deposed agent goes on renewing and deciding on its old
/// view, its record holds the region's acknowledgement until its lease is over, and the new
/// agent acknowledges once an earlier agent's shares have run out, under one clock step.
pub const TIMED_TAKEOVER: Scenario = Scenario {
    name: "agent move over time",
    bounds: Bounds {
        horizon_ticks: 5,
        reshares: 2,
        renewals_per_daemon: 1,
        writes_per_daemon: 0,
        claims: 1,
        stops: 0,
        duplicates: 0,
        failovers: 0,
        cuts: 0,
        drift_steps: MARGIN_MS as u8,
    },
};

/// [`TIMED_TAKEOVER`] under two clock steps, the whole drift the margin must cover: about 14
/// million states, over two minutes' search, so the tests run it only on request
/// (`--ignored`).
pub const TIMED_TAKEOVER_FULL_DRIFT: Scenario = Scenario {
    name: "agent move over time, two clock steps",
    bounds: Bounds {
        drift_steps: 2 * MARGIN_MS as u8,
        ..TIMED_TAKEOVER.bounds
    },
};

/// The liveness search: region A cut off and reconnected, renewals every tick, clock steps
/// of twice the margin, two share changes.
pub const LIVENESS: Scenario = Scenario {
    name: "reconnection",
    bounds: Bounds {
        horizon_ticks: 6,
        reshares: 2,
        renewals_per_daemon: 0,
        writes_per_daemon: 0,
        claims: 0,
        stops: 0,
        duplicates: 0,
        failovers: 0,
        cuts: 1,
        drift_steps: 2 * MARGIN_MS as u8,
    },
};

/// The safety scenarios, in the order the tests report them.
pub const SAFETY: [Scenario; 5] = [
    INSTANT,
    REORDERED_WRITES,
    LEASES,
    LATE_WRITES,
    TIMED_TAKEOVER,
];

/// The scenario in which the checker finds a mutant's counterexample.
pub fn for_mutant(guard: Guard) -> Scenario {
    match guard {
        Guard::DriftMargin | Guard::LeaseAfterApply | Guard::WriteRunOut => LEASES,
        Guard::NotAfter => LATE_WRITES,
        Guard::FenceCheck => REORDERED_WRITES,
        Guard::RevokeBeforeGrant
        | Guard::AckApplied
        | Guard::LeastLiveAck
        | Guard::WaitBeforeAck
        | Guard::ClaimMarksLeft
        | Guard::PassedAfterFirstPass
        | Guard::BoundedAfterWait => INSTANT,
        Guard::RecordCoversLease => TIMED_TAKEOVER,
    }
}
