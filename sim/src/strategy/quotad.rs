//! `quotad`: leased regional shares, rebalanced by quota-core's allocator through its
//! coordinator state machine, enforced per region with quota-core's lease logic on the
//! region's own drifted clock and the reference bucket at that share.
//!
//! The same machinery, configured differently, is `rebalance_no_lease` (no leases, no
//! revoke-before-grant) and `quotad_pinned` (critical tenants pinned, other regions forward
//! their checks to the home region); with [`Reservations`] it is `quotad_reserved`.

use quota_core::bucket::UT;
use quota_core::{BucketParams, Tier};

use super::reservation::Reservations;
use super::{Setup, Strategy, Verdict};
use crate::control::{Control, LeaseMode};
use crate::regional_store::{RegionalStores, StoreCalls};
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
    /// `quotad_reserved`: checks decided from reserved batches of the regional buckets.
    reservations: Option<Reservations>,
    /// Per region: whether its daemon was up at the last tick.
    daemon_up: Vec<bool>,
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
            reservations: None,
            daemon_up: vec![true; n],
        }
    }

    /// The same strategy deciding through `reservations`.
    pub fn reserving(self, reservations: Reservations) -> Self {
        Self {
            reservations: Some(reservations),
            ..self
        }
    }

    /// The bucket parameters `region` enforces for tenant `i` at its local time `local_ms`.
    fn params(&mut self, region: RegionIx, i: usize, local_ms: u64) -> BucketParams {
        let share = self.control.enforced_ppm(region, i, local_ms);
        let slot = &mut self.cache[i * self.regions + region];
        if slot.0 != share {
            *slot = (
                share,
                BucketParams::for_share(&self.tenants[i].policy, share),
            );
        }
        slot.1
    }

    /// Gives back the pools that aged out or whose limit changed, and drops those of a daemon
    /// that crashed.
    fn sweep_pools(&mut self, world: &World, t_ms: u64) {
        let Some(res) = self.reservations.as_mut() else {
            return;
        };
        for r in 0..self.regions {
            let up = world.daemon_up(r, t_ms);
            if !up && self.daemon_up[r] {
                res.crash(r);
            }
            self.daemon_up[r] = up;
        }
        let live = res.take_live();
        for &(r, i) in &live {
            let local = world.local_ms(r, t_ms);
            let params = self.params(r, i, local);
            if let Some(res) = self.reservations.as_mut() {
                res.sweep(&mut self.stores, r, i, local, &params);
            }
        }
        if let Some(res) = self.reservations.as_mut() {
            res.keep_live(live);
        }
    }
}

impl Strategy for Quotad {
    fn advance(&mut self, world: &World, t_ms: u64) {
        self.stores.advance(world, t_ms);
        self.control.advance(world, t_ms);
        self.sweep_pools(world, t_ms);
    }

    fn finish(&mut self, world: &World, t_ms: u64) {
        // Shutdown gives every pool back.
        let Some(live) = self.reservations.as_mut().map(Reservations::take_live) else {
            return;
        };
        for &(r, i) in &live {
            let local = world.local_ms(r, t_ms);
            let params = self.params(r, i, local);
            if let Some(res) = self.reservations.as_mut() {
                res.give_back(&mut self.stores, r, i, local, &params);
            }
        }
        if let Some(res) = self.reservations.as_mut() {
            res.keep_live(live);
        }
    }

    fn store_calls(&self) -> Option<StoreCalls> {
        Some(self.stores.calls())
    }

    fn on_floor(&self, world: &World, t_ms: u64, region: RegionIx) -> bool {
        self.control.on_floor(region, world.local_ms(region, t_ms))
    }

    fn decide(&mut self, world: &World, t_ms: u64, req: &Request) -> Verdict {
        let target = self.forward_target(world, t_ms, req);
        let mut v = self.decide_in(world, req.region, t_ms, req);
        if let (false, Forward::To(there, at_ms, latency_us)) = (v.allowed, target) {
            v = Verdict {
                latency_us,
                forwarded: true,
                ..self.decide_in(world, there, at_ms, req)
            };
        }
        // A check no reachable bucket can hold gets 503 from the daemon (reduced capacity,
        // retry), not a denial that never ends: not admitted, but no "never" either. With
        // the caller's Redis out, the fail mode decides in process, as the daemon does.
        if v.never && world.redis_up(req.region, t_ms) {
            v.never = false;
        }
        // Demand counts where the caller is, wherever it was decided: that is what moves a
        // home to its callers.
        self.control
            .count(req.region, req.tenant as usize, req.cost, v.allowed);
        v
    }
}

impl Quotad {
    /// Decides `req` against `region`'s bucket at true time `at_ms`.
    fn decide_in(&mut self, world: &World, region: RegionIx, at_ms: u64, req: &Request) -> Verdict {
        let i = req.tenant as usize;
        let local = world.local_ms(region, at_ms);
        let params = self.params(region, i, local);
        let fail_mode = self.tenants[i].policy.fail_mode;
        let allowed = match self.reservations.as_mut() {
            Some(res) => res.decide(
                &mut self.stores,
                region,
                req.tenant,
                fail_mode,
                local,
                &params,
                req.cost,
            ),
            None => self
                .stores
                .decide(region, req.tenant, fail_mode, local, &params, req.cost),
        };
        Verdict::against(allowed, &params, req.cost, LOCAL_DECISION_US)
    }

    /// Where a request denied here goes next: `(region, true time it is decided there, the
    /// caller's total latency in µs)`. A policy pinned elsewhere (an operator's or automatic
    /// pin: a critical tenant in `quotad_pinned`, a budget too small to split in every
    /// variant) goes to its home (or, while the home holds less than the cost, to the region
    /// granted the most); a check this region's share cannot hold at all goes to the region
    /// granted the most, unless this region's Redis is out.
    fn forward_target(&self, world: &World, t_ms: u64, req: &Request) -> Forward {
        let here = req.region;
        let i = req.tenant as usize;
        let agent = &self.control.agents[here];
        let policy = &self.tenants[i].policy;
        let holds = |share: u32| {
            BucketParams::for_share(policy, share).capacity_ut >= u64::from(req.cost) * UT
        };
        let to = match agent.homes[i] {
            // While a home is still being granted its share, the region granted the most
            // decides.
            Some(home) if holds(self.control.granted_ppm(here, i, home)) => Some(home),
            Some(_) => agent.richest[i],
            // While this region's Redis is out, the policy's fail mode decides.
            None if !world.redis_up(here, t_ms) => return Forward::No,
            None => {
                let share = self
                    .control
                    .enforced_ppm(here, i, world.local_ms(here, t_ms));
                if holds(share) {
                    return Forward::No;
                }
                agent.richest[i]
            }
        };
        let Some(to) = to.filter(|&to| to != here) else {
            return Forward::No;
        };
        if !world.link_up(here, to, t_ms) || !world.daemon_up(to, t_ms) {
            return Forward::No;
        }
        let rtt = world.rtt_ms(here, to);
        Forward::To(to, t_ms + rtt / 2, rtt * 1000 + 2 * LOCAL_DECISION_US)
    }
}

/// Where a request denied here goes next.
enum Forward {
    /// Decided here: there is no region to send it to, or that region is unreachable.
    No,
    /// To `region`, decided there at true time `at_ms`; the caller waits `latency_us` in all.
    To(RegionIx, u64, u64),
}
