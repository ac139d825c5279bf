//! The region side: what a region enforces, given its last grant, its own clock and the drift
//! margin.
//!
//! A region enforces its granted share while it holds a usable lease, then falls back to its
//! floor (never more than the share it was granted). A lease comes from a
//! [`Response::LeaseRenewed`] and is counted by the
//! region's own clock from when it *sent* the renewal (a time before the commit, so its window
//! ends before the coordinator's), minus the drift margin. A lease renewed at epoch `E` is usable
//! only once the region has applied an allocation of epoch `≥ E`: the coordinator bounded the
//! revocations of older epochs by the leases that were in force then.
//!
//! Driving loop (region agent): every round send `RenewLease { acked_epoch:
//! view.applied_epoch() }` noting the local send time; on `LeaseRenewed` call
//! [`RegionView::on_renewal`]; whenever the local replica applied a new epoch and the bucket
//! parameters were written, call [`RegionView::on_applied`]; before enforcing, ask
//! [`RegionView::enforced_share`].

use serde::{Deserialize, Serialize};

use crate::coordinator::{RegionShare, Response};

/// A lease as the region counts it, by its own clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionLease {
    /// The coordinator's epoch when the renewal committed.
    pub epoch: u64,
    /// Local time the renewal request was sent (or, with a larger margin, received).
    pub start_local_ms: u64,
    pub lease_ms: u64,
}

impl RegionLease {
    /// The lease a [`Response::LeaseRenewed`] grants, counted from `start_local_ms` (the local
    /// time the renewal was sent). `None` for any other response.
    pub fn from_response(response: &Response, start_local_ms: u64) -> Option<Self> {
        match *response {
            Response::LeaseRenewed {
                epoch, lease_ms, ..
            } => Some(Self {
                epoch,
                start_local_ms,
                lease_ms,
            }),
            _ => None,
        }
    }

    /// Local time at which the region must stop enforcing more than its floor.
    pub fn end_local_ms(&self, drift_margin_ms: u64) -> u64 {
        self.start_local_ms
            .saturating_add(self.lease_ms)
            .saturating_sub(drift_margin_ms)
    }
}

/// The share a region enforces: its grant while the lease holds, afterwards its floor (never
/// above the grant). `lease` must be usable for the grant's epoch (see [`RegionView`]).
pub fn enforced_share(
    grant: &RegionShare,
    lease: Option<&RegionLease>,
    local_now_ms: u64,
    drift_margin_ms: u64,
) -> u32 {
    match lease {
        Some(l) if local_now_ms < l.end_local_ms(drift_margin_ms) => grant.share_ppm,
        _ => grant.floor_ppm.min(grant.share_ppm),
    }
}

/// Whether lease `a` ends after lease `b` (by the region's clock).
fn ends_later(a: &RegionLease, b: &RegionLease) -> bool {
    a.start_local_ms.saturating_add(a.lease_ms) > b.start_local_ms.saturating_add(b.lease_ms)
}

/// A region's lease clock: which allocation epoch it applied and which lease it may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct RegionView {
    applied_epoch: u64,
    usable: Option<RegionLease>,
    /// The renewal of the oldest epoch not applied yet, usable once it is. A later renewal of
    /// a newer epoch does not replace it: while epochs commit faster than the region applies
    /// them (a new leader rebalancing every round under a slow store), the newest renewal's
    /// epoch would always be ahead, no lease would ever become usable, and the region would
    /// fall to its floors with a live lease.
    pending: Option<RegionLease>,
}

impl RegionView {
    /// A region that has applied nothing and holds no lease.
    pub fn new() -> Self {
        Self::default()
    }

    /// The epoch whose allocation this region enforces (what it acknowledges).
    pub fn applied_epoch(&self) -> u64 {
        self.applied_epoch
    }

    /// The lease the region may enforce under, if any.
    pub fn lease(&self) -> Option<&RegionLease> {
        self.usable.as_ref()
    }

    /// Records a renewal. It replaces the current lease only if it ends later; one of an epoch
    /// not applied yet waits, unless a renewal of an older epoch already does.
    pub fn on_renewal(&mut self, lease: RegionLease) {
        if lease.epoch <= self.applied_epoch {
            self.adopt(lease);
        } else if self.pending.is_none_or(|p| {
            lease.epoch < p.epoch || (lease.epoch == p.epoch && ends_later(&lease, &p))
        }) {
            self.pending = Some(lease);
        }
    }

    /// Records that the allocation of `epoch` is now what the region enforces.
    pub fn on_applied(&mut self, epoch: u64) {
        self.applied_epoch = self.applied_epoch.max(epoch);
        if let Some(p) = self.pending.filter(|p| p.epoch <= self.applied_epoch) {
            self.pending = None;
            self.adopt(p);
        }
    }

    fn adopt(&mut self, lease: RegionLease) {
        if !self.usable.as_ref().is_some_and(|u| ends_later(u, &lease)) {
            self.usable = Some(lease);
        }
    }

    /// What the region enforces now for a grant read at its applied epoch.
    pub fn enforced_share(&self, grant: &RegionShare, local_now_ms: u64, margin_ms: u64) -> u32 {
        enforced_share(grant, self.usable.as_ref(), local_now_ms, margin_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRANT: RegionShare = RegionShare {
        share_ppm: 400_000,
        floor_ppm: 50_000,
    };

    #[test]
    fn share_until_lease_end_minus_margin_then_floor() {
        let lease = RegionLease {
            epoch: 3,
            start_local_ms: 1_000,
            lease_ms: 30_000,
        };
        assert_eq!(enforced_share(&GRANT, Some(&lease), 28_999, 2_000), 400_000);
        assert_eq!(enforced_share(&GRANT, Some(&lease), 29_000, 2_000), 50_000);
        assert_eq!(enforced_share(&GRANT, None, 0, 2_000), 50_000);
        let tiny = RegionShare {
            share_ppm: 10,
            floor_ppm: 50_000,
        };
        assert_eq!(enforced_share(&tiny, None, 0, 2_000), 10);
    }

    #[test]
    fn leases_come_only_from_renewals() {
        let r = Response::LeaseRenewed {
            region: 0,
            epoch: 9,
            lease_ms: 30_000,
            expires_at_ms: 1,
        };
        assert_eq!(
            RegionLease::from_response(&r, 5),
            Some(RegionLease {
                epoch: 9,
                start_local_ms: 5,
                lease_ms: 30_000
            })
        );
        assert_eq!(
            RegionLease::from_response(&Response::UnknownPolicy, 5),
            None
        );
    }

    #[test]
    fn renewal_from_a_later_epoch_waits_until_applied() {
        let mut v = RegionView::new();
        v.on_applied(4);
        v.on_renewal(RegionLease {
            epoch: 4,
            start_local_ms: 0,
            lease_ms: 30_000,
        });
        // Renewed at epoch 6, but only epoch 4 applied: the old lease still governs.
        v.on_renewal(RegionLease {
            epoch: 6,
            start_local_ms: 20_000,
            lease_ms: 30_000,
        });
        assert_eq!(v.lease().unwrap().start_local_ms, 0);
        assert_eq!(v.enforced_share(&GRANT, 29_000, 1_000), 50_000);
        v.on_applied(6);
        assert_eq!(v.lease().unwrap().start_local_ms, 20_000);
        assert_eq!(v.enforced_share(&GRANT, 29_000, 1_000), 400_000);
        assert_eq!(v.applied_epoch(), 6);
    }

    /// Epochs committed every 400 ms, renewals every 200 ms, each epoch applied 500 ms after it
    /// committed: every renewal's epoch is ahead of the applied one, yet the region always
    /// holds a lease that started within a second.
    #[test]
    fn renewals_keep_the_lease_while_epochs_outrun_the_applies() {
        let mut v = RegionView::new();
        v.on_applied(1);
        v.on_renewal(RegionLease {
            epoch: 1,
            start_local_ms: 0,
            lease_ms: 3_000,
        });
        for now in (100..20_000).step_by(100) {
            let committed = 2 + now / 400;
            if now % 200 == 0 {
                v.on_renewal(RegionLease {
                    epoch: committed,
                    start_local_ms: now,
                    lease_ms: 3_000,
                });
            }
            if now >= 500 {
                v.on_applied(2 + (now - 500) / 400);
            }
            assert!(v.applied_epoch() < committed, "the applies lag at {now}");
            let start = v.lease().unwrap().start_local_ms;
            assert!(now - start <= 1_000, "at {now} the lease is from {start}");
            assert_eq!(v.enforced_share(&GRANT, now, 300), GRANT.share_ppm);
        }
    }
}
