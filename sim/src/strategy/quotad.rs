//! `quotad`: leased regional shares, rebalanced by quota-core's allocator through its
//! coordinator state machine, enforced per region with quota-core's lease logic on the
//! region's own drifted clock and the reference bucket at that share.
//!
//! The same machinery, configured differently, is `rebalance_no_lease` (no leases, no
//! revoke-before-grant) and `quotad_pinned` (critical tenants pinned, other regions forward
//! their checks to the home region); with [`Reservations`] it is `quotad_reserved`. The
//! `llm_tokens` strategies read a bucket ([`Quotad::peek`]) and settle holds against costs
//! known only at the end ([`Quotad::settle`]) through it.
//!
//! Every variant runs the daemon's denial cache ([`Denials`]): a Redis answer that bounds the
//! next admission (a denial's retry time R, or an admission that left fewer tokens than its
//! cost) answers the region's later checks of that bucket, at that cost or more, as denials
//! for R less 1 ms and the daemon's 0.1 % rate margin, without a store call, as long as the
//! region enforces the same parameters. A cached denial counts as demand like any other
//! denial. What it can get wrong, a refund raising the level while a denial stands, is what
//! the daemon gets wrong.

use quota_core::bucket::UT;
use quota_core::{BucketParams, Tier};

use super::reservation::Reservations;
use super::{Setup, Strategy, Verdict};
use crate::control::{AgentCounts, Control, LeaseMode};
use crate::faults::Stop;
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
    /// Per region: whether the daemon holding its in-process state (denial cache, pools) was
    /// up at the last tick.
    daemon_up: Vec<bool>,
    /// Per (tenant, region): the denial standing in the region's daemon.
    denials: Denials,
}

/// The daemon's denial cache: per (tenant, region) at most one standing denial.
#[derive(Debug)]
struct Denials {
    regions: usize,
    standing: Vec<Option<Standing>>,
}

/// A denial standing for checks of `cost` or more at `params`, until local time `until_ms`.
#[derive(Debug, Clone, Copy)]
struct Standing {
    params: BucketParams,
    cost: u32,
    until_ms: u64,
}

/// The part of R, in millionths, an entry gives up for clock rates (the daemon's
/// `RATE_MARGIN_PPM`).
const RATE_MARGIN_PPM: u64 = 1_000;

impl Denials {
    fn new(regions: usize, tenants: usize) -> Self {
        Self {
            regions,
            standing: vec![None; regions * tenants],
        }
    }

    /// Whether a denial stands for a check of `cost` at `params` in `region` at `local_ms`.
    fn stands(
        &self,
        region: RegionIx,
        tenant: usize,
        params: &BucketParams,
        cost: u32,
        local_ms: u64,
    ) -> bool {
        self.standing[tenant * self.regions + region]
            .is_some_and(|s| s.params == *params && cost >= s.cost && local_ms < s.until_ms)
    }

    /// Remembers a store answer sent at `local_ms` that bounds the next admission of `cost` by
    /// `wait_ms` (or forgets the entry when it does not).
    fn remember(
        &mut self,
        region: RegionIx,
        tenant: usize,
        params: &BucketParams,
        cost: u32,
        local_ms: u64,
        wait_ms: Option<u64>,
    ) {
        let slot = &mut self.standing[tenant * self.regions + region];
        *slot = wait_ms.filter(|&w| w > 1).map(|w| {
            let hold_us = (w - 1) * 1_000;
            let hold_us = hold_us - (hold_us * RATE_MARGIN_PPM).div_ceil(1_000_000);
            Standing {
                params: *params,
                cost,
                // Whole ms: a check at local_ms + hold_us / 1000 comes after the hold ends
                // when the hold is not whole, so it asks the store.
                until_ms: local_ms + hold_us.div_ceil(1_000),
            }
        });
    }

    /// Forgets `tenant`'s denial in `region`: tokens came back to its bucket (a client's
    /// refund), so the denial may no longer stand, as the daemon's refund forgets it.
    fn forget(&mut self, region: RegionIx, tenant: usize) {
        self.standing[tenant * self.regions + region] = None;
    }

    /// Forgets every denial of `region`: its daemon stopped.
    fn forget_region(&mut self, region: RegionIx) {
        for s in self.standing.iter_mut().skip(region).step_by(self.regions) {
            *s = None;
        }
    }
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
            denials: Denials::new(n, setup.tenants.len()),
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
    /// that crashed or, holding the agent role, was killed; a holder stopping on SIGTERM gives
    /// its pools back first. The simulated region holds one daemon's denial cache and pools, so
    /// a stopped holder takes all of them.
    fn sweep_pools(&mut self, world: &World, t_ms: u64) {
        for (r, how) in self.control.take_stops() {
            self.denials.forget_region(r);
            match how {
                Stop::Graceful => self.give_back_pools(world, t_ms, Some(r)),
                Stop::Killed => {
                    if let Some(res) = self.reservations.as_mut() {
                        res.crash(r);
                    }
                }
            }
        }
        for r in 0..self.regions {
            let up = world.daemon_up(r, t_ms);
            if !up && self.daemon_up[r] {
                self.denials.forget_region(r);
                if let Some(res) = self.reservations.as_mut() {
                    res.crash(r);
                }
            }
            self.daemon_up[r] = up;
        }
        let Some(res) = self.reservations.as_mut() else {
            return;
        };
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

    /// Gives every pool back to its store (only `region`'s, if given), as a daemon stopping
    /// does.
    fn give_back_pools(&mut self, world: &World, t_ms: u64, region: Option<RegionIx>) {
        let Some(live) = self.reservations.as_mut().map(Reservations::take_live) else {
            return;
        };
        for &(r, i) in live.iter().filter(|(r, _)| region.is_none_or(|o| o == *r)) {
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
}

impl Strategy for Quotad {
    fn advance(&mut self, world: &World, t_ms: u64) {
        self.stores.advance(world, t_ms);
        self.control.advance(world, t_ms);
        self.sweep_pools(world, t_ms);
    }

    fn finish(&mut self, world: &World, t_ms: u64) {
        // Shutdown gives every pool back.
        self.give_back_pools(world, t_ms, None);
    }

    fn store_calls(&self) -> Option<StoreCalls> {
        Some(self.stores.calls())
    }

    fn agent_counts(&self) -> Option<AgentCounts> {
        Some(self.control.counts.clone())
    }

    fn on_floor(&self, world: &World, t_ms: u64, region: RegionIx) -> bool {
        self.control.on_floor(region, world.local_ms(region, t_ms))
    }

    fn decide(&mut self, world: &World, t_ms: u64, req: &Request) -> Verdict {
        self.decide_routed(world, t_ms, req).0
    }
}

impl Quotad {
    /// Decides `req` as [`Strategy::decide`] does, and says in which region it was decided
    /// (the caller's, or the one it was forwarded to).
    pub fn decide_routed(
        &mut self,
        world: &World,
        t_ms: u64,
        req: &Request,
    ) -> (Verdict, RegionIx) {
        let target = self.forward_target(world, t_ms, req);
        let mut v = self.decide_in(world, req.region, t_ms, req);
        let mut decided_in = req.region;
        if let (false, Forward::To(there, at_ms, latency_us)) = (v.allowed, target) {
            v = Verdict {
                latency_us,
                forwarded: true,
                ..self.decide_in(world, there, at_ms, req)
            };
            decided_in = there;
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
        (v, decided_in)
    }

    /// Reads whether the caller's regional bucket holds `req.cost` now, spending nothing (an
    /// Envoy reading, as a check that is charged later makes it). A refused reading counts
    /// as denied demand, so the allocator sees what the region turns away.
    pub fn peek(&mut self, world: &World, t_ms: u64, req: &Request) -> bool {
        let (region, i) = (req.region, req.tenant as usize);
        let local = world.local_ms(region, t_ms);
        let params = self.params(region, i, local);
        let fail_mode = self.tenants[i].policy.fail_mode;
        let ok = self.stores.peek(
            region,
            req.tenant,
            fail_mode,
            local,
            &params,
            u64::from(req.cost),
        );
        if !ok {
            self.control.count(region, i, req.cost, false);
        }
        ok
    }

    /// Settles a hold of `held` tokens that `req`'s caller took in `region` against the
    /// request's actual cost `req.cost`, at the parameters `region` enforces now: the
    /// difference goes back ([`quota_core::bucket::refund`], which drops the bucket's standing
    /// denial, as the daemon's refund does), or the excess is charged into debt down to the
    /// policy's `debt_limit` below empty ([`quota_core::bucket::charge`]). The excess charged
    /// counts as admitted demand where the caller is. Returns the tokens of the excess no
    /// bucket took: clamped at the debt limit, or all of it while the Redis is down.
    pub fn settle(
        &mut self,
        world: &World,
        t_ms: u64,
        region: RegionIx,
        req: &Request,
        held: u64,
    ) -> u64 {
        let i = req.tenant as usize;
        let local = world.local_ms(region, t_ms);
        let params = self.params(region, i, local);
        let actual = u64::from(req.cost);
        if actual <= held {
            if actual < held
                && self
                    .stores
                    .refund(region, req.tenant, local, &params, held - actual)
            {
                self.denials.forget(region, i);
            }
            return 0;
        }
        let excess = actual - held;
        let debt_limit_ut = self.tenants[i].policy.debt_limit.saturating_mul(UT);
        let clamped = self
            .stores
            .charge_into_debt(region, req.tenant, local, &params, excess, debt_limit_ut)
            .unwrap_or(excess);
        let charged =
            u32::try_from(excess - clamped).expect("a charge is at most a request's cost");
        self.control.count(req.region, i, charged, true);
        clamped
    }

    /// Decides `req` against `region`'s bucket at true time `at_ms`.
    fn decide_in(&mut self, world: &World, region: RegionIx, at_ms: u64, req: &Request) -> Verdict {
        let i = req.tenant as usize;
        let local = world.local_ms(region, at_ms);
        let params = self.params(region, i, local);
        let fail_mode = self.tenants[i].policy.fail_mode;
        if self.denials.stands(region, i, &params, req.cost, local) {
            return Verdict::against(false, &params, req.cost, LOCAL_DECISION_US);
        }
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
        // An admission stands as a denial only while no tokens of the bucket are held here:
        // Redis's level does not count them.
        let held = self
            .reservations
            .as_ref()
            .is_some_and(|r| r.held(region, i) > 0);
        let wait_ms = self.stores.take_wait_ms().filter(|_| !(allowed && held));
        self.denials
            .remember(region, i, &params, req.cost, local, wait_ms);
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
        let routes = &self.control.regions[here];
        let policy = &self.tenants[i].policy;
        let holds = |share: u32| {
            BucketParams::for_share(policy, share).capacity_ut >= u64::from(req.cost) * UT
        };
        let to = match routes.homes[i] {
            // While a home is still being granted its share, the region granted the most
            // decides.
            Some(home) if holds(self.control.granted_ppm(here, i, home)) => Some(home),
            Some(_) => routes.richest[i],
            // While this region's Redis is out, the policy's fail mode decides.
            None if !world.redis_up(here, t_ms) => return Forward::No,
            None => {
                let share = self
                    .control
                    .enforced_ppm(here, i, world.local_ms(here, t_ms));
                if holds(share) {
                    return Forward::No;
                }
                routes.richest[i]
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

#[cfg(test)]
mod tests {
    use super::*;

    fn params(tokens: u64) -> BucketParams {
        BucketParams::new(tokens * UT, tokens * UT).unwrap()
    }

    #[test]
    fn a_denial_stands_for_its_retry_time_less_the_margins() {
        let mut d = Denials::new(3, 2);
        let p = params(10);
        // Denied at 1 000 with 100 ms to wait: standing until 1 000 + 99 ms less 0.1 %.
        d.remember(1, 0, &p, 2, 1_000, Some(100));
        assert!(d.stands(1, 0, &p, 2, 1_000));
        assert!(d.stands(1, 0, &p, 5, 1_098), "a larger cost too");
        assert!(!d.stands(1, 0, &p, 2, 1_099), "98.9 ms is not 99");
        assert!(
            !d.stands(1, 0, &p, 1, 1_050),
            "a smaller cost asks the store"
        );
        assert!(!d.stands(1, 0, &params(20), 2, 1_050), "other parameters");
        assert!(!d.stands(0, 0, &p, 2, 1_050) && !d.stands(1, 1, &p, 2, 1_050));
        // An answer that bounds nothing (or by 1 ms, which the margin eats) forgets it.
        d.remember(1, 0, &p, 2, 1_010, Some(1));
        assert!(!d.stands(1, 0, &p, 2, 1_010));
        d.remember(1, 0, &p, 2, 1_010, Some(100));
        d.forget_region(1);
        assert!(
            !d.stands(1, 0, &p, 2, 1_010),
            "a crashed daemon keeps nothing"
        );
    }
}
