//! The regional Redis of every region, as the strategies that decide locally see it: one
//! reference bucket per (tenant, region), plus what happens while a Redis is unreachable.
//!
//! During an outage each policy's fail mode decides: `local` switches to an in-process bucket
//! seeded with the daemon's last view of the Redis bucket and written back when Redis returns
//! (so the outage neither mints nor loses tokens), `open` admits everything, `closed` denies
//! everything. The seeding and write-back are what quotad's daemon must do for `local` to be
//! safe: a fallback bucket that started full would admit up to one extra share of burst.
//!
//! Every call that reaches a Redis (a decision, a reservation, a refund) is counted, so
//! strategies can be compared by the store calls they make per decision.

use quota_core::bucket::{
    charge, decide, next_admission_ms, refund, reserve, BucketParams, BucketState,
};
use quota_core::FailMode;
use serde::Serialize;

use crate::world::{RegionIx, World};

/// Calls that reached a Redis, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StoreCalls {
    /// Plain decisions, one check each.
    pub decisions: u64,
    /// Reservations that admitted: a batch of one or more checks.
    pub reserved: u64,
    /// Reservations that denied.
    pub reserve_denied: u64,
    /// Unused tokens given back.
    pub refunds: u64,
}

impl StoreCalls {
    /// Every call.
    pub fn total(&self) -> u64 {
        self.decisions + self.reserved + self.reserve_denied + self.refunds
    }
}

/// Bucket states of every (tenant, region), with per-region outage handling.
#[derive(Debug)]
pub struct RegionalStores {
    regions: usize,
    states: Vec<Option<BucketState>>,
    fallback: Vec<Option<BucketState>>,
    down: Vec<bool>,
    calls: StoreCalls,
    /// What the last call that reached a Redis bounds: ms before a check of its cost or more
    /// can be admitted again ([`next_admission_ms`]), for the daemon's denial cache.
    last_wait_ms: Option<u64>,
}

impl RegionalStores {
    pub fn new(regions: usize, tenants: usize) -> Self {
        Self {
            regions,
            states: vec![None; regions * tenants],
            fallback: vec![None; regions * tenants],
            down: vec![false; regions],
            calls: StoreCalls::default(),
            last_wait_ms: None,
        }
    }

    /// Whether `region`'s Redis answers (as of the last [`Self::advance`]).
    pub fn up(&self, region: RegionIx) -> bool {
        !self.down[region]
    }

    /// The calls that reached a Redis so far.
    pub fn calls(&self) -> StoreCalls {
        self.calls
    }

    /// Takes what the last call that reached a Redis bounds: the ms before a check of its
    /// cost or more can be admitted again, if its answer bounds it (a denial, or an admission
    /// that left fewer tokens than its cost); `None` too after a call that did not reach one.
    pub fn take_wait_ms(&mut self) -> Option<u64> {
        self.last_wait_ms.take()
    }

    /// Notices Redis outages starting or ending at `t_ms` (call once per tick).
    pub fn advance(&mut self, world: &World, t_ms: u64) {
        for r in 0..self.regions {
            let up = world.redis_up(r, t_ms);
            if up == self.down[r] {
                // A transition: copy the region's column one way or the other.
                let (from, to) = if up {
                    (&self.fallback, &mut self.states)
                } else {
                    (&self.states, &mut self.fallback)
                };
                for i in (r..from.len()).step_by(self.regions) {
                    to[i] = from[i];
                }
                self.down[r] = !up;
            }
        }
    }

    /// Decides `cost` for `tenant` in `region` with `params` at the region's local time.
    pub fn decide(
        &mut self,
        region: RegionIx,
        tenant: u32,
        fail_mode: FailMode,
        local_ms: u64,
        params: &BucketParams,
        cost: u32,
    ) -> bool {
        let i = tenant as usize * self.regions + region;
        self.last_wait_ms = None;
        let up = !self.down[region];
        let slot = if up {
            self.calls.decisions += 1;
            &mut self.states[i]
        } else {
            match fail_mode {
                FailMode::Open => return true,
                FailMode::Closed => return false,
                FailMode::Local => &mut self.fallback[i],
            }
        };
        let (d, s) = decide(local_ms, params, slot.as_ref(), u64::from(cost));
        *slot = Some(s);
        if up {
            self.last_wait_ms = next_admission_ms(params, u64::from(cost), &d);
        }
        d.allowed
    }

    /// Takes up to `batch` multiples of `cost` (at least one) from `region`'s Redis bucket for
    /// `tenant` with [`reserve`]; returns how many it took, 0 for a denial. The caller checks
    /// that the Redis is up ([`Self::up`]).
    pub fn reserve(
        &mut self,
        region: RegionIx,
        tenant: u32,
        local_ms: u64,
        params: &BucketParams,
        cost: u64,
        batch: u64,
    ) -> Option<u64> {
        assert!(
            !self.down[region],
            "no reservation from a Redis that is down"
        );
        let i = tenant as usize * self.regions + region;
        let (d, granted, s) = reserve(local_ms, params, self.states[i].as_ref(), cost, batch);
        self.states[i] = Some(s);
        // The level a batch leaves bounds the next admission only when nothing of it is held
        // (a batch of one): the caller's pool counts too.
        self.last_wait_ms = (granted <= 1)
            .then(|| next_admission_ms(params, cost, &d))
            .flatten();
        if d.allowed {
            self.calls.reserved += 1;
        } else {
            self.calls.reserve_denied += 1;
        }
        d.allowed.then_some(granted)
    }

    /// Gives `tokens` whole tokens back to `region`'s Redis bucket for `tenant` with
    /// [`refund`] (capped at the capacity of `params`). Returns false when the Redis is down:
    /// the tokens are lost, never minted.
    pub fn refund(
        &mut self,
        region: RegionIx,
        tenant: u32,
        local_ms: u64,
        params: &BucketParams,
        tokens: u64,
    ) -> bool {
        if self.down[region] {
            return false;
        }
        let i = tenant as usize * self.regions + region;
        self.calls.refunds += 1;
        if let Some(s) = refund(local_ms, params, self.states[i].as_ref(), tokens) {
            self.states[i] = Some(s);
        }
        true
    }

    /// Whether `region`'s bucket for `tenant` holds `cost` now, spending nothing (a reading);
    /// while the Redis is down the fail mode answers, `local` reading the in-process bucket.
    pub fn peek(
        &mut self,
        region: RegionIx,
        tenant: u32,
        fail_mode: FailMode,
        local_ms: u64,
        params: &BucketParams,
        cost: u64,
    ) -> bool {
        let i = tenant as usize * self.regions + region;
        let state = if self.down[region] {
            match fail_mode {
                FailMode::Open => return true,
                FailMode::Closed => return false,
                FailMode::Local => self.fallback[i],
            }
        } else {
            self.calls.decisions += 1;
            self.states[i]
        };
        decide(local_ms, params, state.as_ref(), cost).0.allowed
    }

    /// Charges `cost` whole tokens of work already done to `region`'s Redis bucket for `tenant`
    /// with [`charge`]: into debt down to `debt_limit_ut` below empty. Returns the tokens it
    /// clamped (did not take), or `None` while the Redis is down: nothing is applied, as the
    /// daemon decides no charge in process.
    pub fn charge_into_debt(
        &mut self,
        region: RegionIx,
        tenant: u32,
        local_ms: u64,
        params: &BucketParams,
        cost: u64,
        debt_limit_ut: u64,
    ) -> Option<u64> {
        if self.down[region] {
            return None;
        }
        let i = tenant as usize * self.regions + region;
        let (out, s) = charge(
            local_ms,
            params,
            self.states[i].as_ref(),
            cost,
            debt_limit_ut,
        )
        .expect("a cost of 1..=MAX_BURST and a debt limit within MAX_CAPACITY_UT");
        self.states[i] = Some(s);
        Some(out.clamped)
    }

    /// Charges `tokens` already spent elsewhere to a bucket, going no lower than empty; returns
    /// what could not be charged (the debt left over).
    pub fn charge(
        &mut self,
        region: RegionIx,
        tenant: u32,
        local_ms: u64,
        params: &BucketParams,
        tokens_ut: u64,
    ) -> u64 {
        let i = tenant as usize * self.regions + region;
        let slot = if self.down[region] {
            &mut self.fallback[i]
        } else {
            &mut self.states[i]
        };
        let mut s = quota_core::bucket::refill(local_ms, params, slot.as_ref());
        let paid = s.tokens_ut.min(tokens_ut);
        s.tokens_ut -= paid;
        *slot = Some(s);
        tokens_ut - paid
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::faults::{Fault, Faults};
    use crate::world::WorldSpec;

    #[test]
    fn local_fail_mode_carries_the_bucket_through_an_outage() {
        let faults = Faults {
            list: vec![Fault::RedisOutage {
                region: 0,
                from_ms: 100,
                until_ms: 200,
            }],
        };
        let world = World::new(
            &WorldSpec::default(),
            faults,
            &mut ChaCha8Rng::seed_from_u64(0),
        );
        let p = BucketParams::new(3 * quota_core::bucket::UT, 0).unwrap();
        let mut st = RegionalStores::new(3, 1);
        st.advance(&world, 0);
        assert!(st.decide(0, 0, FailMode::Local, 0, &p, 1));
        st.advance(&world, 100);
        assert!(st.decide(0, 0, FailMode::Local, 100, &p, 1));
        assert!(
            st.decide(0, 0, FailMode::Open, 100, &p, 100),
            "open admits anything"
        );
        assert!(!st.decide(0, 0, FailMode::Closed, 100, &p, 1));
        st.advance(&world, 200);
        assert!(st.decide(0, 0, FailMode::Local, 200, &p, 1));
        assert!(
            !st.decide(0, 0, FailMode::Local, 200, &p, 1),
            "three tokens in all, no more"
        );
    }

    #[test]
    fn charging_stops_at_empty_and_returns_the_debt() {
        let p = BucketParams::new(5 * quota_core::bucket::UT, 0).unwrap();
        let mut st = RegionalStores::new(1, 1);
        let ut = quota_core::bucket::UT;
        assert_eq!(st.charge(0, 0, 0, &p, 2 * ut), 0);
        assert_eq!(st.charge(0, 0, 0, &p, 4 * ut), ut);
        assert!(!st.decide(0, 0, FailMode::Local, 0, &p, 1));
    }

    #[test]
    fn a_charge_goes_into_debt_down_to_its_limit_and_a_reading_spends_nothing() {
        let ut = quota_core::bucket::UT;
        let p = BucketParams::new(5 * ut, 0).unwrap();
        let mut st = RegionalStores::new(1, 1);
        assert!(st.peek(0, 0, FailMode::Closed, 0, &p, 5));
        assert!(st.peek(0, 0, FailMode::Closed, 0, &p, 5), "nothing spent");
        assert!(!st.peek(0, 0, FailMode::Closed, 0, &p, 6));
        // 5 tokens and a debt limit of 3: a charge of 7 takes all, one of 4 more takes 1.
        assert_eq!(st.charge_into_debt(0, 0, 0, &p, 7, 3 * ut), Some(0));
        assert_eq!(st.charge_into_debt(0, 0, 0, &p, 4, 3 * ut), Some(3));
        assert!(!st.peek(0, 0, FailMode::Closed, 0, &p, 1), "in debt");
        assert!(!st.decide(0, 0, FailMode::Closed, 0, &p, 1));
    }
}
