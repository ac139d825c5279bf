//! `quotad_reserved`: quotad whose daemons decide a hot bucket's checks from reservations. One
//! store call spends a batch of tokens of the regional bucket ([`quota_core::bucket::reserve`],
//! sized by [`quota_core::reservation::Sizer`]) and the daemon hands them out from a
//! [`quota_core::reservation::Pool`] in process; what is left
//! goes back ([`quota_core::bucket::refund`]) when the pool ages out, when the limit it was
//! taken at changes (a new share, the lease lapsing to the floor), and at the end of the run.
//!
//! While a region's Redis is down its daemon keeps handing out a pool it holds (those tokens
//! were spent in Redis) until the pool ages out; the refund then fails and the tokens are lost,
//! never minted. A check the pool cannot answer goes to the policy's fail mode, as in quotad.
//! The control plane, leases and forwarding are [`Quotad`]'s; the reservations are
//! [`Reservations`].

use super::quotad::Quotad;
use super::reservation::Reservations;
use super::Setup;
use crate::control::LeaseMode;

/// Builds quotad with reservations.
pub fn new(setup: &Setup<'_>) -> Quotad {
    Quotad::with(setup, LeaseMode::Leased, false)
        .reserving(Reservations::new(setup.world.regions, setup.tenants.len()))
}
