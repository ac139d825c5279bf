//! `rebalance_no_lease`: quota-core's allocator and state machine, but without leases. Every
//! share decrease is acknowledged on the region's behalf the moment it commits, so the freed
//! share is granted elsewhere at once, and regions enforce their last grant for ever instead
//! of falling back to their floor. While all regions hear the leader this is nearly quotad; a
//! region cut off keeps its old share while the others receive it too.

use super::quotad::Quotad;
use super::Setup;
use crate::control::LeaseMode;

/// Builds quotad's machinery with leases bypassed.
pub fn new(setup: &Setup<'_>) -> Quotad {
    Quotad::with(setup, LeaseMode::NoLease, false)
}
