//! Leases and revocations: the bookkeeping behind revoke-before-grant.
//!
//! A region may enforce a share only under a lease. The coordinator counts a lease from the
//! commit of the renewal (`expires_at_ms = now + lease_ms`) and reuses share a region held only
//! once `now > expires_at_ms + drift_margin_ms` (or once the region acknowledged the decrease).
//! The region counts the same lease from when it sent (or received) the renewal and stops at
//! `start + lease_ms - drift_margin_ms` by its own clock (see [`crate::region`]). The two windows
//! are disjoint as long as `2 · drift_margin_ms` exceeds the clock-rate drift over one lease plus
//! the renewal's delivery delay plus the clock offset between successive leaders.
//!
//! When the coordinator lowers a region's share it keeps a [`Revocation`]: the larger share the
//! region may still be enforcing, live until the region acknowledges the decrease's epoch or the
//! lease in force at the decrease expires (plus the margin). Floors outlive leases (a cut-off
//! region falls back to its floor for ever), so a revocation also carries the floor the region
//! may still fall back to, which only an acknowledgement clears.

use serde::{Deserialize, Serialize};

/// The longest accepted lease: ten minutes. Longer leases make a cut-off region hold share for
/// too long.
pub const MAX_LEASE_MS: u64 = 10 * 60 * 1000;

/// Lease timing, replicated in the coordinator state so every replica computes the same expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LeaseConfig {
    /// How long a renewal lets a region enforce its share.
    pub lease_ms: u64,
    /// Subtracted by regions and added by the coordinator, so the two windows never overlap.
    pub drift_margin_ms: u64,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            lease_ms: 30_000,
            drift_margin_ms: 2_000,
        }
    }
}

/// Why a lease configuration is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum LeaseConfigError {
    #[error("lease_ms must be between 1 and {MAX_LEASE_MS} (got {lease_ms})")]
    LeaseOutOfRange { lease_ms: u64 },
    #[error(
        "drift_margin_ms ({drift_margin_ms}) must be less than half of lease_ms ({lease_ms}), \
         or regions would never enforce their share"
    )]
    MarginTooLarge { lease_ms: u64, drift_margin_ms: u64 },
}

impl LeaseConfig {
    /// Checks the bounds: a region must have a usable window after subtracting the margin.
    pub fn validate(&self) -> Result<(), LeaseConfigError> {
        if self.lease_ms == 0 || self.lease_ms > MAX_LEASE_MS {
            return Err(LeaseConfigError::LeaseOutOfRange {
                lease_ms: self.lease_ms,
            });
        }
        if self.drift_margin_ms.saturating_mul(2) >= self.lease_ms {
            return Err(LeaseConfigError::MarginTooLarge {
                lease_ms: self.lease_ms,
                drift_margin_ms: self.drift_margin_ms,
            });
        }
        Ok(())
    }
}

/// A larger share (and floor) one region may still enforce after a decrease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Revocation {
    /// The region's slot index.
    pub region: u8,
    /// The share the region may enforce until `deadline_ms`.
    pub share_ppm: u32,
    /// The floor the region may fall back to after its lease, until it acknowledges `epoch`.
    pub floor_ppm: u32,
    /// The epoch of the decrease: an acknowledgement of this epoch or later clears it.
    pub epoch: u64,
    /// Coordinator time after which the lease in force at the decrease has surely ended.
    pub deadline_ms: u64,
}

impl Revocation {
    /// What this revocation still lets the region enforce, given its acknowledged epoch.
    pub fn contribution(&self, acked_epoch: u64, now_ms: u64) -> u32 {
        if acked_epoch >= self.epoch {
            0
        } else if now_ms <= self.deadline_ms {
            self.share_ppm.max(self.floor_ppm)
        } else {
            self.floor_ppm
        }
    }

    /// True once it can never contribute again (time and acknowledgements only move forward).
    pub fn is_dead(&self, acked_epoch: u64, now_ms: u64) -> bool {
        acked_epoch >= self.epoch || (now_ms > self.deadline_ms && self.floor_ppm == 0)
    }

    /// Folds a newer revocation of the same region into this one, conservatively: the larger
    /// share and floor, the later epoch and deadline. Parts of `self` already dead at `now_ms`
    /// are dropped first, so the merge never revives a share whose lease ran out.
    pub fn merge(&mut self, newer: &Revocation, acked_epoch: u64, now_ms: u64) {
        debug_assert_eq!(self.region, newer.region);
        if self.is_dead(acked_epoch, now_ms) {
            *self = *newer;
            return;
        }
        if now_ms > self.deadline_ms {
            self.share_ppm = 0;
        }
        self.share_ppm = self.share_ppm.max(newer.share_ppm);
        self.floor_ppm = self.floor_ppm.max(newer.floor_ppm);
        self.epoch = self.epoch.max(newer.epoch);
        self.deadline_ms = self.deadline_ms.max(newer.deadline_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid_and_bad_ones_are_named() {
        assert_eq!(LeaseConfig::default().validate(), Ok(()));
        assert_eq!(
            LeaseConfig {
                lease_ms: 0,
                drift_margin_ms: 0
            }
            .validate(),
            Err(LeaseConfigError::LeaseOutOfRange { lease_ms: 0 })
        );
        assert_eq!(
            LeaseConfig {
                lease_ms: 1000,
                drift_margin_ms: 500
            }
            .validate(),
            Err(LeaseConfigError::MarginTooLarge {
                lease_ms: 1000,
                drift_margin_ms: 500
            })
        );
    }

    #[test]
    fn revocation_lives_until_ack_or_deadline_but_floor_until_ack() {
        let r = Revocation {
            region: 1,
            share_ppm: 500,
            floor_ppm: 100,
            epoch: 7,
            deadline_ms: 50,
        };
        assert_eq!(r.contribution(6, 50), 500);
        assert_eq!(r.contribution(6, 51), 100);
        assert_eq!(r.contribution(7, 10), 0);
        assert!(!r.is_dead(6, 1000));
        assert!(r.is_dead(7, 0));
        let no_floor = Revocation { floor_ppm: 0, ..r };
        assert!(!no_floor.is_dead(0, 50));
        assert!(no_floor.is_dead(0, 51));
    }

    #[test]
    fn merging_never_revives_an_expired_share() {
        let mut old = Revocation {
            region: 0,
            share_ppm: 900,
            floor_ppm: 10,
            epoch: 3,
            deadline_ms: 100,
        };
        let newer = Revocation {
            region: 0,
            share_ppm: 200,
            floor_ppm: 0,
            epoch: 5,
            deadline_ms: 500,
        };
        old.merge(&newer, 0, 200);
        assert_eq!(old.contribution(0, 200), 200);
        assert_eq!(old.contribution(0, 501), 10);
        assert_eq!(old.contribution(5, 0), 0);
    }
}
