//! Share handlers: the allocator's updates, each entry accepted or rejected on its own and
//! only if it keeps revoke-before-grant (`Σ enforceable ≤ PPM` after it, floors kept, whole
//! units), and the revocation bookkeeping every handler that lowers a share uses.

use super::{CoordinatorState, Entry, EntryRejection, HomeChange, Pin, PinSource, RegionState};
use super::{RejectedEntry, Response, ShareEntry, MAX_LISTED_REJECTIONS};
use crate::lease::Revocation;
use crate::mode::whole_share;
use crate::policy::PPM;

impl CoordinatorState {
    pub(super) fn set_shares(
        &mut self,
        membership: u64,
        entries: &[ShareEntry],
        now: u64,
    ) -> Response {
        if membership != self.membership {
            return Response::StaleMembership {
                planned: membership,
                current: self.membership,
            };
        }
        let epoch = self.epoch + 1;
        let mut accepted = 0u32;
        let mut rejected_total = 0u32;
        let mut rejected = Vec::new();
        for update in entries {
            match self.check_entry(update, epoch, now) {
                Ok(revocations) => {
                    let regions = &self.regions;
                    let Some(entry) = self.entries.get_mut(&update.key) else {
                        continue;
                    };
                    for rev in revocations {
                        add_revocation(entry, rev, acked_of(regions, rev.region.into()), now);
                    }
                    entry.shares_ppm.clone_from(&update.shares_ppm);
                    match update.home {
                        HomeChange::Keep => {}
                        HomeChange::Auto(home) => {
                            entry.pin = Some(Pin {
                                home,
                                source: PinSource::Auto,
                            });
                        }
                        HomeChange::ClearAuto => {
                            if entry.pin.is_some_and(|p| p.source == PinSource::Auto) {
                                entry.pin = None;
                            }
                        }
                    }
                    prune(entry, regions, now);
                    accepted += 1;
                }
                Err(reason) => {
                    rejected_total += 1;
                    if rejected.len() < MAX_LISTED_REJECTIONS {
                        rejected.push(RejectedEntry {
                            key: update.key.clone(),
                            reason,
                        });
                    }
                }
            }
        }
        if accepted > 0 {
            self.epoch = epoch;
        }
        Response::SharesSet {
            epoch: self.epoch,
            accepted,
            rejected_total,
            rejected,
        }
    }

    /// The checks of a share update that need no arithmetic: a live policy, one share per
    /// slot, and a home a critical policy may move to. Returns the policy's entry.
    fn check_entry_shape(&self, update: &ShareEntry) -> Result<&Entry, EntryRejection> {
        let entry = self
            .entries
            .get(&update.key)
            .ok_or(EntryRejection::UnknownPolicy)?;
        if entry.deleted {
            return Err(EntryRejection::Deleted);
        }
        let slots = self.regions.len();
        if update.shares_ppm.len() != slots {
            return Err(EntryRejection::WrongLength {
                expected: slots as u32,
                found: update.shares_ppm.len() as u32,
            });
        }
        match update.home {
            HomeChange::Auto(home) => {
                let operator = entry.pin.is_some_and(|p| p.source == PinSource::Operator);
                if operator || self.region(usize::from(home)).is_none() {
                    return Err(EntryRejection::BadHome { region: home });
                }
            }
            HomeChange::Keep | HomeChange::ClearAuto => {}
        }
        Ok(entry)
    }

    /// Validates one share update and returns the revocations it creates.
    fn check_entry(
        &self,
        update: &ShareEntry,
        epoch: u64,
        now: u64,
    ) -> Result<Vec<Revocation>, EntryRejection> {
        let entry = self.check_entry_shape(update)?;
        self.check_shares(entry, &update.shares_ppm, epoch, now)
    }

    /// Validates new shares for `entry` (one per slot, checked by the caller) and returns the
    /// revocations they create: whole units, floors kept, `Σ enforceable ≤ PPM` after.
    pub(crate) fn check_shares(
        &self,
        entry: &Entry,
        shares_ppm: &[u32],
        epoch: u64,
        now: u64,
    ) -> Result<Vec<Revocation>, EntryRejection> {
        let mut revocations = Vec::new();
        let mut total = 0u64;
        for (r, &new) in shares_ppm.iter().enumerate() {
            let Some(region) = self.region(r) else {
                if new > 0 {
                    return Err(EntryRejection::BadShare {
                        region: r as u8,
                        share_ppm: new,
                    });
                }
                continue;
            };
            if new > PPM {
                return Err(EntryRejection::BadShare {
                    region: r as u8,
                    share_ppm: new,
                });
            }
            if whole_share(&entry.policy, new) != new {
                return Err(EntryRejection::PartUnit {
                    region: r as u8,
                    share_ppm: new,
                });
            }
            let old = entry.share(r);
            let floor = self.floor_of(&entry.policy, r);
            let guaranteed = self.guaranteed_floor(&entry.policy, r);
            if new < old && new < guaranteed {
                return Err(EntryRejection::CutsFloor {
                    region: r as u8,
                    floor_ppm: guaranteed,
                });
            }
            let mut after = new.max(self.enforceable(entry, r, now));
            if new < old {
                let rev = Revocation {
                    region: r as u8,
                    share_ppm: old,
                    floor_ppm: floor.min(old),
                    epoch,
                    deadline_ms: region
                        .lease_expires_at_ms
                        .saturating_add(self.lease.drift_margin_ms),
                };
                let contribution = rev.contribution(region.acked_epoch, now);
                if contribution > new {
                    revocations.push(rev);
                }
                after = after.max(contribution);
            }
            total += u64::from(after);
        }
        if total > u64::from(PPM) {
            return Err(EntryRejection::BudgetExceeded {
                enforceable_ppm: total,
            });
        }
        Ok(revocations)
    }
}

/// Adds a revocation, merging with the region's existing one.
pub(crate) fn add_revocation(entry: &mut Entry, rev: Revocation, acked_epoch: u64, now_ms: u64) {
    match entry
        .revocations
        .iter_mut()
        .find(|v| v.region == rev.region)
    {
        Some(existing) => existing.merge(&rev, acked_epoch, now_ms),
        None => {
            entry.revocations.push(rev);
            entry.revocations.sort_by_key(|v| v.region);
        }
    }
}

/// The epoch a region slot acknowledged; an empty slot enforces nothing.
pub(crate) fn acked_of(regions: &[Option<RegionState>], region: usize) -> u64 {
    regions
        .get(region)
        .and_then(Option::as_ref)
        .map_or(u64::MAX, |r| r.acked_epoch)
}

/// Drops revocations that can never matter again.
pub(crate) fn prune(entry: &mut Entry, regions: &[Option<RegionState>], now: u64) {
    entry.revocations.retain(|v| {
        regions
            .get(usize::from(v.region))
            .and_then(Option::as_ref)
            .is_some_and(|r| !v.is_dead(r.acked_epoch, now))
    });
}
