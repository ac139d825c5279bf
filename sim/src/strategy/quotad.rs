//! `quotad`: leased regional shares, rebalanced by quota-core's allocator through its
//! coordinator state machine, enforced per region with quota-core's lease logic on the
//! region's own drifted clock and the reference bucket at that share.
//!
//! The same machinery, configured differently, is `rebalance_no_lease` (no leases, no
//! revoke-before-grant) and `quotad_pinned` (critical tenants pinned, other regions forward
//! their checks to the home region).

use quota_core::{BucketParams, Tier};

use super::{Setup, Strategy, Verdict};
use crate::control::{Control, LeaseMode};
use crate::regional_store::RegionalStores;
use crate::traffic::{Request, Tenant};
use crate::world::{RegionIx, World, LOCAL_DECISION_US};

/// A rebalancing strategy: quotad's control plane plus each region's Redis.
#[derive(Debug)]
pub struct Quotad {
    tenants: Vec<Tenant>,
    control: Control,
    stores: RegionalStores,
    regions: usize,
    /// Per (tenant, region): the share the cached parameters were computed for.
    cache: Vec<(u32, BucketParams)>,
    /// Forward checks of pinned tenants to their home region.
    pinned: bool,
}

impl Quotad {
    /// quotad as designed: leases, revoke before grant, no pinning.
    pub fn new(setup: &Setup<'_>) -> Self {
        Self::with(setup, LeaseMode::Leased, false)
    }

    /// The machinery with a lease mode and pinning chosen by the caller.
    pub fn with(setup: &Setup<'_>, mode: LeaseMode, pinned: bool) -> Self {
        let register = |t: &Tenant| {
            let mut p = t.policy.clone();
            if !pinned {
                // Only `quotad_pinned` lets critical tenants be pinned.
                p.tier = Tier::Standard;
            }
            p
        };
        let control = Control::new(setup.world, setup.tenants, register, *setup.control, mode);
        let n = setup.world.regions;
        let params0 = BucketParams::EMPTY;
        Self {
            tenants: setup.tenants.to_vec(),
            control,
            stores: RegionalStores::new(n, setup.tenants.len()),
            regions: n,
            cache: vec![(u32::MAX, params0); n * setup.tenants.len()],
            pinned,
        }
    }
}

impl Strategy for Quotad {
    fn advance(&mut self, world: &World, t_ms: u64) {
        self.stores.advance(world, t_ms);
        self.control.advance(world, t_ms);
    }

    fn on_floor(&self, world: &World, t_ms: u64, region: RegionIx) -> bool {
        self.control.on_floor(region, world.local_ms(region, t_ms))
    }

    fn decide(&mut self, world: &World, t_ms: u64, req: &Request) -> Verdict {
        let local = self.decide_in(world, req.region, t_ms, req);
        if local || !self.pinned {
            return Verdict {
                allowed: local,
                latency_us: LOCAL_DECISION_US,
            };
        }
        match forward(&self.control, world, t_ms, req) {
            Some((home, at_ms, latency_us)) => Verdict {
                allowed: self.decide_in(world, home, at_ms, req),
                latency_us,
            },
            None => Verdict {
                allowed: false,
                latency_us: LOCAL_DECISION_US,
            },
        }
    }
}

impl Quotad {
    /// Decides `req` against `region`'s bucket at true time `at_ms`, counting it in that
    /// region's usage.
    fn decide_in(&mut self, world: &World, region: RegionIx, at_ms: u64, req: &Request) -> bool {
        let i = req.tenant as usize;
        let local = world.local_ms(region, at_ms);
        let share = self.control.enforced_ppm(region, i, local);
        let policy = &self.tenants[i].policy;
        let slot = &mut self.cache[i * self.regions + region];
        if slot.0 != share {
            *slot = (share, BucketParams::for_share(policy, share));
        }
        let params = slot.1;
        let allowed = self.stores.decide(
            region,
            req.tenant,
            policy.fail_mode,
            local,
            &params,
            req.cost,
        );
        // A check forwarded after a local denial counts as demand at the home only.
        let forwarded_later = !allowed && self.pinned && region == req.region && {
            let home = self.control.agents[region].homes[i];
            home.is_some_and(|h| h != region)
        };
        if !forwarded_later {
            self.control.count(region, i, req.cost, allowed);
        }
        allowed
    }
}

/// Where a request denied locally goes next: `(home, true time it is decided there, the
/// caller's total latency in µs)`, or `None` when it is not pinned elsewhere or the home is
/// unreachable.
fn forward(
    control: &Control,
    world: &World,
    t_ms: u64,
    req: &Request,
) -> Option<(RegionIx, u64, u64)> {
    let here = req.region;
    let home = control.agents[here].homes[req.tenant as usize]?;
    if home == here || !world.link_up(here, home, t_ms) || !world.daemon_up(home, t_ms) {
        return None;
    }
    let rtt = world.rtt_ms(here, home);
    Some((home, t_ms + rtt / 2, rtt * 1000 + 2 * LOCAL_DECISION_US))
}
