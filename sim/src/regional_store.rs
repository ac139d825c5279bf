//! The regional Redis of every region, as the strategies that decide locally see it: one
//! reference bucket per (tenant, region), plus what happens while a Redis is unreachable.
//!
//! During an outage each policy's fail mode decides: `local` switches to an in-process bucket
//! seeded with the daemon's last view of the Redis bucket and written back when Redis returns
//! (so the outage neither mints nor loses tokens), `open` admits everything, `closed` denies
//! everything. The seeding and write-back are what quotad's daemon must do for `local` to be
//! safe: a fallback bucket that started full would admit up to one extra share of burst.

use quota_core::bucket::{decide, BucketParams, BucketState};
use quota_core::FailMode;

use crate::world::{RegionIx, World};

/// Bucket states of every (tenant, region), with per-region outage handling.
#[derive(Debug)]
pub struct RegionalStores {
    regions: usize,
    states: Vec<Option<BucketState>>,
    fallback: Vec<Option<BucketState>>,
    down: Vec<bool>,
}

impl RegionalStores {
    pub fn new(regions: usize, tenants: usize) -> Self {
        Self {
            regions,
            states: vec![None; regions * tenants],
            fallback: vec![None; regions * tenants],
            down: vec![false; regions],
        }
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
        let slot = if self.down[region] {
            match fail_mode {
                FailMode::Open => return true,
                FailMode::Closed => return false,
                FailMode::Local => &mut self.fallback[i],
            }
        } else {
            &mut self.states[i]
        };
        let (d, s) = decide(local_ms, params, slot.as_ref(), u64::from(cost));
        *slot = Some(s);
        d.allowed
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
}
