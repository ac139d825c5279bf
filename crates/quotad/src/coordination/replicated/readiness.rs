//! This member's readiness ([`crate::coordination::readiness`]): read from the view the
//! decider reads (the regions it holds leases for are the registered ones), the Raft group and
//! the lease clock; kept once reached.

use std::sync::atomic::Ordering;

use quota_core::RegionId;

use super::Replicated;
use crate::coordination::readiness::{awaited, Awaited};

impl Replicated {
    /// What this member still waits for before it takes traffic; empty once it is ready, and
    /// from then on until it stops.
    pub fn readiness(&self) -> Vec<Awaited> {
        if self.ready.load(Ordering::Acquire) {
            return Vec::new();
        }
        let view = self.view();
        let group: Vec<RegionId> = self
            .raft
            .status()
            .members
            .values()
            .filter_map(|m| RegionId::new(m.region.as_str()).ok())
            .collect();
        // A lease is adopted only once it is usable (renewed, its epoch applied to the store);
        // 0 means none was ever adopted.
        let leased = self.lease_end_local_ms() > 0;
        let waits = awaited(
            &self.region,
            |r| view.region_leases.contains_key(r),
            &group,
            leased,
        );
        if waits.is_empty() && !self.ready.swap(true, Ordering::AcqRel) {
            tracing::info!(region = %self.region, "Ready: registered, with every region of the group, and holding a lease.");
        }
        waits
    }
}
