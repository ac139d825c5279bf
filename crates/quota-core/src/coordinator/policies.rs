//! Policy handlers: put one policy or a batch (all or none), delete one (its shares tracked as
//! revocations until no region may enforce them), forget deleted ones no region enforces any
//! more. A new policy starts with floors and the rest split evenly, or whole in its home.

use super::shares::{acked_of, add_revocation, prune};
use super::{CoordinatorState, Entry, InvalidEntry, Pin, PinSource, PolicyKey, Response};
use super::{MAX_BATCH_POLICIES, MAX_LISTED_INVALID};
use crate::lease::Revocation;
use crate::mode::{whole_share, BudgetMode};
use crate::policy::{Policy, PolicySpec, PPM};
use crate::split::even_split;

impl CoordinatorState {
    pub(super) fn check_floors(&self, floor_ppm: u32, floor_regions: u32) -> Result<(), Response> {
        if u64::from(floor_ppm) * u64::from(floor_regions) > u64::from(PPM) {
            Err(Response::FloorsExceedBudget {
                floor_ppm,
                floor_regions,
            })
        } else {
            Ok(())
        }
    }

    pub(super) fn put_policy(&mut self, key: &PolicyKey, policy: &Policy, now: u64) -> Response {
        // The command may come from any client: hold it to the same rules as admin input, so
        // no later arithmetic (rates, shares) meets a zero window or an absurd floor.
        if let Err(errors) = policy_spec(policy).validate() {
            let fields = errors.0.iter().map(|e| e.field.to_string()).collect();
            return Response::InvalidPolicy { fields };
        }
        if let Err(r) = self.check_floors(policy.floor_ppm, self.floor_regions()) {
            return r;
        }
        let (version, epoch) = self.store_policy(key, policy, now);
        Response::PolicyStored { version, epoch }
    }

    /// Stores a policy already checked; returns its version and the epoch of the change. A
    /// policy equal to the live one (all but the version) changes nothing and keeps its
    /// version, so its buckets keep their tokens: re-sending a policy is idempotent.
    pub(crate) fn store_policy(
        &mut self,
        key: &PolicyKey,
        policy: &Policy,
        now: u64,
    ) -> (u64, u64) {
        let live = self.entries.get(key).filter(|e| !e.deleted);
        if let Some(entry) = live {
            if entry.policy.same_terms(policy) {
                return (entry.policy.version, self.epoch);
            }
        }
        let replaces = live.map(|e| e.policy.version);
        self.last_version += 1;
        self.epoch += 1;
        let version = self.last_version;
        let epoch = self.epoch;
        let mut policy = policy.clone();
        policy.version = version;
        policy.replaces = replaces;
        let tenant_pin = self.tenant_pins.get(&key.tenant).map(|&home| Pin {
            home,
            source: PinSource::Operator,
        });
        // A budget too small to split starts whole in one region, so its first check is
        // admitted wherever it lands (the others forward it there).
        let auto_home = (tenant_pin.is_none() && self.budget_mode(&policy) == BudgetMode::Home)
            .then(|| self.first_sharing_region())
            .flatten()
            .map(|home| Pin {
                home,
                source: PinSource::Auto,
            });
        let initial = initial_split(self, &policy, tenant_pin.or(auto_home).map(|p| p.home));
        let floor_regions = self.floor_flags();
        let regions = self.regions.clone();
        match self.entries.get_mut(key) {
            None => {
                self.entries.insert(
                    key.clone(),
                    Entry {
                        policy,
                        pin: tenant_pin.or(auto_home),
                        shares_ppm: initial,
                        revocations: Vec::new(),
                        deleted: false,
                    },
                );
            }
            Some(entry) => {
                // A lower floor may still be what a cut-off region falls back to: keep the old
                // one counted until each region acknowledges this epoch.
                if policy.whole_floor_ppm() < entry.policy.whole_floor_ppm() && !entry.deleted {
                    for (r, _) in floor_regions.iter().enumerate().filter(|(_, &f)| f) {
                        let floor = entry.policy.whole_floor_ppm().min(entry.share(r));
                        if floor > 0 {
                            let rev = Revocation {
                                region: r as u8,
                                share_ppm: 0,
                                floor_ppm: floor,
                                epoch,
                                deadline_ms: 0,
                            };
                            add_revocation(entry, rev, acked_of(&regions, r), now);
                        }
                    }
                }
                prune(entry, &regions, now);
                entry.policy = policy;
                entry.deleted = false;
                if tenant_pin.is_some() {
                    entry.pin = tenant_pin;
                } else if entry.pin.is_none() {
                    entry.pin = auto_home;
                }
                // A plan's subjects keep their promoted shares under the new terms.
                let policy = entry.policy.clone();
                self.sync_promoted_policy(key, &policy);
            }
        }
        (version, epoch)
    }

    /// Why `policy` cannot be stored, if it cannot: the fields at fault.
    pub(crate) fn policy_problem(&self, policy: &Policy) -> Option<Vec<String>> {
        if let Err(errors) = policy_spec(policy).validate() {
            return Some(errors.0.iter().map(|e| e.field.to_string()).collect());
        }
        self.check_floors(policy.floor_ppm, self.floor_regions())
            .err()
            .map(|_| vec!["floor".to_string()])
    }

    pub(super) fn put_policies(&mut self, entries: &[(PolicyKey, Policy)], now: u64) -> Response {
        if entries.len() > MAX_BATCH_POLICIES {
            return Response::BatchTooLarge {
                max: MAX_BATCH_POLICIES as u32,
            };
        }
        // Every entry is checked before any is stored, so a refused batch changes nothing.
        let mut invalid = entries
            .iter()
            .enumerate()
            .filter_map(|(index, (_, policy))| {
                self.policy_problem(policy).map(|fields| InvalidEntry {
                    index: index as u32,
                    fields,
                })
            })
            .peekable();
        if invalid.peek().is_some() {
            let listed: Vec<_> = invalid.by_ref().take(MAX_LISTED_INVALID).collect();
            let total = (listed.len() + invalid.count()) as u32;
            return Response::InvalidPolicies {
                entries: listed,
                total,
            };
        }
        let versions = entries
            .iter()
            .map(|(key, policy)| self.store_policy(key, policy, now).0)
            .collect();
        Response::PoliciesStored {
            versions,
            epoch: self.epoch,
        }
    }

    /// The lowest live slot that may take share (a fresh home-mode policy's first home).
    fn first_sharing_region(&self) -> Option<u8> {
        let slot = self
            .regions
            .iter()
            .position(|r| r.as_ref().is_some_and(|r| !r.draining))
            .or_else(|| self.regions.iter().position(Option::is_some))?;
        Some(slot as u8)
    }

    fn floor_flags(&self) -> Vec<bool> {
        self.regions
            .iter()
            .map(|r| r.as_ref().is_some_and(|r| r.reserves_floor))
            .collect()
    }

    pub(crate) fn delete_policy(&mut self, key: &PolicyKey, now: u64) -> Response {
        let floor_flags = self.floor_flags();
        let regions = self.regions.clone();
        let margin = self.lease.drift_margin_ms;
        let Some(entry) = self.entries.get_mut(key) else {
            return Response::UnknownPolicy;
        };
        if entry.deleted {
            return Response::UnknownPolicy;
        }
        self.epoch += 1;
        let epoch = self.epoch;
        for (r, region) in regions.iter().enumerate() {
            let share = entry.share(r);
            let Some(region) = region else { continue };
            if share == 0 {
                continue;
            }
            let floor = if floor_flags[r] {
                entry.policy.whole_floor_ppm().min(share)
            } else {
                0
            };
            add_revocation(
                entry,
                Revocation {
                    region: r as u8,
                    share_ppm: share,
                    floor_ppm: floor,
                    epoch,
                    deadline_ms: region.lease_expires_at_ms.saturating_add(margin),
                },
                region.acked_epoch,
                now,
            );
        }
        entry.shares_ppm.iter_mut().for_each(|s| *s = 0);
        entry.pin = None;
        entry.deleted = true;
        prune(entry, &regions, now);
        self.drop_promoted_of(key);
        Response::PolicyDeleted { epoch }
    }

    pub(super) fn forget(&mut self, keys: &[PolicyKey], now: u64) -> Response {
        let mut count = 0u32;
        for key in keys {
            let forgettable = self.entries.get(key).is_some_and(|e| {
                e.deleted && (0..self.regions.len()).all(|r| self.enforceable(e, r, now) == 0)
            });
            if forgettable {
                self.entries.remove(key);
                count += 1;
            }
        }
        Response::Forgotten { count }
    }
}

/// The spec a policy would have come from, to validate it with the admin API's rules.
fn policy_spec(policy: &Policy) -> PolicySpec {
    PolicySpec {
        limit: policy.limit as f64,
        window_ms: policy.window_ms as f64,
        burst: Some(policy.burst as f64),
        tier: Some(policy.tier),
        fail_mode: Some(policy.fail_mode),
        floor: Some(f64::from(policy.floor_ppm) / f64::from(PPM)),
        algorithm: Some(policy.algorithm),
        mode: Some(policy.mode),
        debt_limit: Some(policy.debt_limit as f64),
        after_the_fact: Some(policy.after_the_fact),
    }
}

/// A new policy's first split: floors, then the rest evenly (water-filled with no demand);
/// with a `home`, the rest all there. No share holds part of one unit.
fn initial_split(state: &CoordinatorState, policy: &Policy, home: Option<u8>) -> Vec<u32> {
    let slots = state.regions.len();
    let floors: Vec<u32> = (0..slots)
        .map(|r| state.guaranteed_floor(policy, r))
        .collect();
    let live: Vec<bool> = (0..slots).map(|r| state.region(r).is_some()).collect();
    let mut split = match home.map(usize::from).filter(|&h| h < slots && live[h]) {
        Some(h) => {
            let others: u32 = (0..slots).filter(|&r| r != h).map(|r| floors[r]).sum();
            let mut split = floors;
            split[h] = PPM - others.min(PPM);
            split
        }
        None => even_split(&floors, &live),
    };
    for s in &mut split {
        *s = whole_share(policy, *s);
    }
    split
}
