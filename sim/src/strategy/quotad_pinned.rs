//! `quotad_pinned`: quotad where critical tenants are pinned by the allocator to the region
//! carrying most of their demand. The home enforces the whole budget (less the other regions'
//! floors); another region first decides a pinned tenant's check against its own floor, and
//! forwards what its floor denies to the home daemon (exact accounting, a WAN round trip) when
//! it can reach the home.

use super::quotad::Quotad;
use super::Setup;
use crate::control::{Control, LeaseMode};
use crate::traffic::Request;
use crate::world::{RegionIx, World, LOCAL_DECISION_US};

/// Builds the pinned variant of quotad.
pub fn new(setup: &Setup<'_>) -> Quotad {
    Quotad::with(setup, LeaseMode::Leased, true)
}

/// Where a request denied locally goes next: `(home, true time it is decided there, the
/// caller's total latency in µs)`, or `None` when it is not pinned elsewhere or the home is
/// unreachable.
pub fn forward(
    control: &Control,
    world: &World,
    t_ms: u64,
    req: &Request,
) -> Option<(RegionIx, u64, u64)> {
    let here = req.region;
    let home = control.agents[here].homes[req.tenant as usize]?;
    if home == here || !world.link_up(here, home, t_ms) || !world.daemon_up(home, t_ms) {
        return None;
    }
    let rtt = world.rtt_ms(here, home);
    Some((home, t_ms + rtt / 2, rtt * 1000 + 2 * LOCAL_DECISION_US))
}
