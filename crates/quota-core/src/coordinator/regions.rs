//! Region handlers: regions joining or draining, and a region's removal once nothing it may
//! enforce is left. Leases and the agent role are in [`super::agents`].

use std::collections::BTreeMap;

use super::{CoordinatorState, RegionState, Response, MAX_REGIONS};
use crate::ids::RegionId;

impl CoordinatorState {
    pub(super) fn put_region(
        &mut self,
        id: &RegionId,
        reserves_floor: bool,
        draining: bool,
    ) -> Response {
        if let Some(index) = self.region_index(id) {
            let Some(region) = self
                .regions
                .get_mut(usize::from(index))
                .and_then(Option::as_mut)
            else {
                return Response::UnknownRegion { region: id.clone() };
            };
            if region.reserves_floor != reserves_floor {
                return Response::RegionRulesImmutable { region: id.clone() };
            }
            region.draining = draining;
            return Response::RegionStored {
                index,
                membership: self.membership,
            };
        }
        let free = self.regions.iter().position(Option::is_none);
        if free.is_none() && self.regions.len() >= MAX_REGIONS {
            return Response::TooManyRegions {
                max: MAX_REGIONS as u32,
            };
        }
        if reserves_floor {
            let regions = self.floor_regions() + 1;
            let max_floor = self
                .entries
                .values()
                .map(|e| e.policy.floor_ppm)
                .max()
                .unwrap_or(0);
            if let Err(r) = self.check_floors(max_floor, regions) {
                return r;
            }
        }
        let region = RegionState {
            id: id.clone(),
            reserves_floor,
            draining,
            lease_expires_at_ms: 0,
            acked_epoch: self.epoch,
            daemons: BTreeMap::new(),
            agent: None,
        };
        let index = match free {
            Some(i) => {
                self.regions[i] = Some(region);
                i
            }
            None => {
                self.regions.push(Some(region));
                self.regions.len() - 1
            }
        };
        self.membership += 1;
        Response::RegionStored {
            index: index as u8,
            membership: self.membership,
        }
    }

    /// Whether the region in slot `index` may still enforce anything at `now_ms` (a share, a
    /// live revocation or a floor it has not acknowledged giving up) or is the home of a pin:
    /// [`Operation::RemoveRegion`] refuses it until this is false.
    ///
    /// [`Operation::RemoveRegion`]: super::Operation::RemoveRegion
    pub fn region_in_use(&self, index: u8, now_ms: u64) -> bool {
        let r = usize::from(index);
        // A tenant pin is in use even without policies: the slot may be reused by another
        // region, which the tenant's future policies must not be pinned to.
        self.tenant_pins.values().any(|&home| home == index)
            || self.entries.values().any(|e| {
                self.enforceable(e, r, now_ms) > 0 || e.pin.is_some_and(|p| p.home == index)
            })
            || self
                .promoted
                .values()
                .any(|p| self.enforceable(&p.entry, r, now_ms) > 0)
    }

    pub(super) fn remove_region(&mut self, id: &RegionId, now: u64) -> Response {
        let Some(index) = self.region_index(id) else {
            return Response::UnknownRegion { region: id.clone() };
        };
        if self.region_in_use(index, now) {
            return Response::RegionInUse { region: id.clone() };
        }
        let r = usize::from(index);
        self.regions[r] = None;
        let promoted = self.promoted.values_mut().map(|p| &mut p.entry);
        for entry in self.entries.values_mut().chain(promoted) {
            entry.revocations.retain(|v| usize::from(v.region) != r);
        }
        // Trailing empty slots go, so share vectors stay short.
        while self.regions.last().is_some_and(Option::is_none) {
            self.regions.pop();
        }
        let slots = self.regions.len();
        let promoted = self.promoted.values_mut().map(|p| &mut p.entry);
        for entry in self.entries.values_mut().chain(promoted) {
            entry.shares_ppm.truncate(slots);
        }
        self.membership += 1;
        Response::RegionRemoved {
            membership: self.membership,
        }
    }
}
