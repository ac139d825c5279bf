//! Pin handlers: an operator pins one policy, or a whole tenant (its policies present and
//! future), to a home region. Automatic pins are the allocator's, set with its share updates.

use super::{CoordinatorState, Entry, Pin, PinSource, PolicyKey, Response};
use crate::ids::{RegionId, TenantId};
use crate::policy::Tier;

impl CoordinatorState {
    pub(super) fn pin(&mut self, key: &PolicyKey, home: &RegionId) -> Response {
        let Some(index) = self.region_index(home) else {
            return Response::UnknownRegion {
                region: home.clone(),
            };
        };
        match self.entries.get_mut(key) {
            Some(entry) if !entry.deleted => {
                entry.pin = Some(Pin {
                    home: index,
                    source: PinSource::Operator,
                });
                Response::Pinned { home: index }
            }
            _ => Response::UnknownPolicy,
        }
    }

    pub(super) fn unpin(&mut self, key: &PolicyKey) -> Response {
        match self.entries.get_mut(key) {
            Some(entry) if !entry.deleted => {
                if entry.pin.is_some_and(|p| p.source == PinSource::Operator) {
                    entry.pin = None;
                }
                Response::Unpinned
            }
            _ => Response::UnknownPolicy,
        }
    }

    pub(super) fn pin_tenant(&mut self, tenant: &TenantId, home: &RegionId) -> Response {
        let Some(index) = self.region_index(home) else {
            return Response::UnknownRegion {
                region: home.clone(),
            };
        };
        self.tenant_pins.insert(tenant.clone(), index);
        let mut policies = 0u32;
        for entry in self.tenant_entries_mut(tenant) {
            entry.pin = Some(Pin {
                home: index,
                source: PinSource::Operator,
            });
            policies += 1;
        }
        Response::TenantPinned {
            home: index,
            policies,
        }
    }

    pub(super) fn unpin_tenant(&mut self, tenant: &TenantId) -> Response {
        if self.tenant_pins.remove(tenant).is_none() {
            return Response::TenantNotPinned;
        }
        let mut policies = 0u32;
        for entry in self.tenant_entries_mut(tenant) {
            if entry.pin.is_some_and(|p| p.source == PinSource::Operator) {
                entry.pin = None;
                policies += 1;
            }
        }
        Response::TenantUnpinned { policies }
    }

    /// The live policies of one tenant.
    fn tenant_entries_mut<'a>(
        &'a mut self,
        tenant: &'a TenantId,
    ) -> impl Iterator<Item = &'a mut Entry> + 'a {
        self.entries
            .iter_mut()
            .filter(move |(k, e)| &k.tenant == tenant && !e.deleted)
            .map(|(_, e)| e)
    }
}

/// Whether a tier is pinned automatically.
pub fn auto_pins(tier: Tier) -> bool {
    tier == Tier::Critical
}
