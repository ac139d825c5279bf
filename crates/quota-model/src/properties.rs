//! What the checker holds the model to, and what each region enforces at an instant.
//!
//! Region A enforces, at true time t, the larger of what a gateway deciding against its
//! Redis primary gets (the stored share before the stored lease end on Redis's clock, the
//! floor after) and what each of its daemons enforces in process (quota-core's
//! `RegionView::enforced_share` on the daemon's own clock). The two decide the same callers
//! (the daemon's buckets stand in for Redis while it is out), so A counts the larger, not the
//! sum. Region B enforces everything the coordinator counts for it at that instant
//! (`CoordinatorState::enforceable`): more than any correct region could, so a property that
//! holds against it holds against every B that keeps the per-region property A is held to.

use quota_core::PPM;
use stateright::Property;

use crate::model::LeaseModel;
use crate::state::State;
use crate::world::{node_of, A, B, DAEMONS, REGIONS};

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
