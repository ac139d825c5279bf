//! `quotad_pinned`: quotad where critical tenants are pinned by the allocator to the region
//! carrying most of their demand. The home enforces the whole budget (less the other regions'
//! floors); another region first decides a pinned tenant's check against its own floor, and
//! forwards what its floor denies to the home daemon (exact accounting, a WAN round trip) when
//! it can reach the home (the forwarding is [`Quotad`]'s, on when `pinned`).

use super::quotad::Quotad;
use super::Setup;
use crate::control::LeaseMode;

/// Builds the pinned variant of quotad.
pub fn new(setup: &Setup<'_>) -> Quotad {
    Quotad::with(setup, LeaseMode::Leased, true)
}
