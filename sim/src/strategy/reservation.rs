//! A daemon's reservations as `quotad_reserved` runs them: per (tenant, region) a
//! [`Sizer`] and at most one [`Pool`] of tokens spent in the regional bucket, keyed by the limit
//! it was taken at. One store call ([`RegionalStores::reserve`]) takes a batch; what is left
//! goes back ([`RegionalStores::refund`]) when the pool ages out, when the limit changes, and on
//! shutdown. While the Redis is down a held pool still answers; its refund then fails and the
//! tokens are lost, never minted.

use quota_core::bucket::BucketParams;
use quota_core::reservation::{Pool, Sizer};
use quota_core::FailMode;

use crate::regional_store::RegionalStores;
use crate::world::RegionIx;

/// A pool and the limit it was taken at: the key that sends it back when the limit changes.
#[derive(Debug, Clone, Copy)]
struct Held {
    params: BucketParams,
    pool: Pool,
}

/// Every daemon's reservations: a sizer and at most one pool per (tenant, region). A daemon
/// that crashes loses its pools (see [`Self::crash`]).
#[derive(Debug)]
pub struct Reservations {
    regions: usize,
    sizers: Vec<Sizer>,
    pools: Vec<Option<Held>>,
    /// The indices of `pools` that may hold one (each at most once, marked in `listed`): the
    /// sweep visits these, not every bucket.
    live: Vec<usize>,
    listed: Vec<bool>,
}

impl Reservations {
    pub fn new(regions: usize, tenants: usize) -> Self {
        Self {
            regions,
            sizers: vec![Sizer::new(0); regions * tenants],
            pools: vec![None; regions * tenants],
            live: Vec::new(),
            listed: vec![false; regions * tenants],
        }
    }

    /// The (region, tenant) of every pool held, and perhaps of some given back since. Hand
    /// the list back with [`Self::keep_live`].
    pub fn take_live(&mut self) -> Vec<(RegionIx, usize)> {
        let n = self.regions;
        self.live.drain(..).map(|i| (i % n, i / n)).collect()
    }

    /// Takes back the list of [`Self::take_live`], less the pools no longer held.
    pub fn keep_live(&mut self, live: Vec<(RegionIx, usize)>) {
        for (region, tenant) in live {
            let i = tenant * self.regions + region;
            if self.pools[i].is_some() {
                self.live.push(i);
            } else {
                self.listed[i] = false;
            }
        }
    }

    /// Decides `cost` for `tenant` in `region` at the region's `local_ms`, against the limit
    /// `params` the region enforces now: from the pool when it can, else one store call that
    /// reserves a batch (or the fail mode while the Redis is down).
    #[allow(clippy::too_many_arguments)]
    pub fn decide(
        &mut self,
        stores: &mut RegionalStores,
        region: RegionIx,
        tenant: u32,
        fail_mode: FailMode,
        local_ms: u64,
        params: &BucketParams,
        cost: u32,
    ) -> bool {
        let i = tenant as usize * self.regions + region;
        let cost_t = u64::from(cost);
        self.sizers[i].observe(local_ms, cost_t);
        self.sweep(stores, region, tenant as usize, local_ms, params);
        if let Some(h) = self.pools[i].as_mut() {
            if h.pool.take(local_ms, cost_t) {
                return true;
            }
        }
        if !stores.up(region) {
            return stores.decide(region, tenant, fail_mode, local_ms, params, cost);
        }
        let batch = self.sizers[i].batch(local_ms, cost_t, params.capacity_ut);
        let Some(granted) = stores.reserve(region, tenant, local_ms, params, cost_t, batch) else {
            return false;
        };
        let tokens =
            self.pools[i].map_or(0, |h| h.pool.tokens) + granted.saturating_sub(1) * cost_t;
        self.pools[i] = (tokens > 0).then_some(Held {
            params: *params,
            pool: Pool {
                tokens,
                taken_ms: local_ms,
            },
        });
        if tokens > 0 && !self.listed[i] {
            self.listed[i] = true;
            self.live.push(i);
        }
        true
    }

    /// Whole tokens of `tenant`'s pool in `region`.
    pub fn held(&self, region: RegionIx, tenant: usize) -> u64 {
        self.pools[tenant * self.regions + region].map_or(0, |h| h.pool.tokens)
    }

    /// Gives `tenant`'s pool in `region` back when it aged out or was taken at another limit
    /// than `params`, the limit the region enforces at `local_ms`.
    pub fn sweep(
        &mut self,
        stores: &mut RegionalStores,
        region: RegionIx,
        tenant: usize,
        local_ms: u64,
        params: &BucketParams,
    ) {
        let i = tenant * self.regions + region;
        if self.pools[i].is_some_and(|h| h.params != *params || h.pool.expired(local_ms)) {
            self.give_back(stores, region, tenant, local_ms, params);
        }
    }

    /// Drops every pool `region`'s daemon holds, as its crash does: those tokens are lost. The
    /// region's checks go on being decided, as in quotad, from fresh pools.
    pub fn crash(&mut self, region: RegionIx) {
        for h in self.pools.iter_mut().skip(region).step_by(self.regions) {
            *h = None;
        }
    }

    /// Gives `tenant`'s pool in `region` back to the store, into its bucket at `params` (the
    /// limit enforced now, so the refund is capped at the capacity the region holds now, not
    /// the one the pool was taken at); lost if the Redis is down.
    pub fn give_back(
        &mut self,
        stores: &mut RegionalStores,
        region: RegionIx,
        tenant: usize,
        local_ms: u64,
        params: &BucketParams,
    ) {
        let Some(h) = self.pools[tenant * self.regions + region].take() else {
            return;
        };
        if h.pool.tokens > 0 {
            // False while the Redis is down: the tokens are lost.
            stores.refund(region, tenant as u32, local_ms, params, h.pool.tokens);
        }
    }
}

#[cfg(test)]
mod tests {
    use quota_core::bucket::UT;
    use quota_core::reservation::MAX_AGE_MS;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::faults::{Fault, Faults};
    use crate::world::{World, WorldSpec};

    fn world(faults: Vec<Fault>) -> World {
        World::new(
            &WorldSpec::default(),
            Faults { list: faults },
            &mut ChaCha8Rng::seed_from_u64(0),
        )
    }

    /// 100 000 tokens, no refill: 1 % is a batch of up to 1 000.
    fn params() -> BucketParams {
        BucketParams::new(100_000 * UT, 0).unwrap()
    }

    /// Checks of cost 1, `per_ms` a millisecond from `from_ms` to `until_ms`; returns the
    /// admitted tokens.
    fn run(
        r: &mut Reservations,
        st: &mut RegionalStores,
        world: &World,
        p: &BucketParams,
        (from_ms, until_ms, per_ms): (u64, u64, u64),
    ) -> u64 {
        let mut admitted = 0;
        for t in from_ms..until_ms {
            st.advance(world, t);
            for _ in 0..per_ms {
                admitted += u64::from(r.decide(st, 0, 0, FailMode::Closed, t, p, 1));
            }
        }
        admitted
    }

    #[test]
    fn a_hot_bucket_makes_a_call_per_batch_and_gives_the_rest_back() {
        let w = world(vec![]);
        let p = params();
        let (mut r, mut st) = (Reservations::new(3, 1), RegionalStores::new(3, 1));
        // 10 checks a millisecond: a call each while cold (until the interval so far spans
        // 10 ms), then batches of 50 ms of demand: 455 tokens at 9 ms (91 checks in 10 ms),
        // about 500 from then on.
        let cold = run(&mut r, &mut st, &w, &p, (0, 9, 10));
        assert_eq!((cold, st.calls().reserved), (90, 90));
        // 21 batches by 1 020 ms, the last taken at 1 004 ms with 341 tokens left.
        let admitted = run(&mut r, &mut st, &w, &p, (9, 1_020, 10));
        assert_eq!(admitted, 10_110);
        assert_eq!(st.calls().total(), 90 + 21);
        assert_eq!(
            r.pools[0].map(|h| h.pool),
            Some(Pool {
                tokens: 341,
                taken_ms: 1_004
            })
        );
        // The sweep's list names the pool once, and forgets it once given back.
        let live = r.take_live();
        assert_eq!(live, [(0, 0)]);
        r.keep_live(live);
        r.give_back(&mut st, 0, 0, 1_020, &p);
        assert!(r.pools[0].is_none());
        assert_eq!(st.calls().refunds, 1);
        let live = r.take_live();
        assert_eq!(live, [(0, 0)]);
        r.keep_live(live);
        assert!(r.take_live().is_empty());
        // Everything not handed out went back: the bucket holds what a plain one would.
        assert!(st.decide(0, 0, FailMode::Closed, 1_020, &p, 100_000 - 10_200));
        assert!(!st.decide(0, 0, FailMode::Closed, 1_020, &p, 1));
    }

    #[test]
    fn a_pool_taken_at_another_limit_goes_back_first() {
        let w = world(vec![]);
        let p = params();
        let (mut r, mut st) = (Reservations::new(3, 1), RegionalStores::new(3, 1));
        run(&mut r, &mut st, &w, &p, (0, 200, 10));
        assert!(r.pools[0].is_some());
        // A smaller share: the pool goes back (capped at the new capacity), then a check at
        // the new limit reserves from the bucket afresh.
        let small = BucketParams::new(10 * UT, 0).unwrap();
        r.sweep(&mut st, 0, 0, 200, &small);
        assert!(r.pools[0].is_none());
        let admitted = run(&mut r, &mut st, &w, &small, (200, 210, 10));
        assert_eq!(admitted, 10, "no more than the new capacity");
    }

    #[test]
    fn while_redis_is_down_the_pool_answers_until_it_ages_out_and_is_then_lost() {
        let w = world(vec![Fault::RedisOutage {
            region: 0,
            from_ms: 200,
            until_ms: 2_000,
        }]);
        let p = params();
        let (mut r, mut st) = (Reservations::new(3, 1), RegionalStores::new(3, 1));
        // The last batch, taken at 154 ms, holds 91 tokens at 195 ms.
        let before = run(&mut r, &mut st, &w, &p, (0, 195, 10));
        assert_eq!(
            r.pools[0].map(|h| h.pool),
            Some(Pool {
                tokens: 91,
                taken_ms: 154
            })
        );
        let calls = st.calls().total();
        // Down: the pool answers (fail mode closed would deny everything) and no call is made.
        let during = run(&mut r, &mut st, &w, &p, (200, 210, 1));
        assert_eq!(during, 10);
        assert_eq!(st.calls().total(), calls);
        // Once it ages out it cannot go back: the rest is lost, the fail mode decides.
        let aged = 200 + MAX_AGE_MS;
        st.advance(&w, aged);
        r.sweep(&mut st, 0, 0, aged, &p);
        assert!(r.pools[0].is_none());
        assert_eq!(st.calls().total(), calls, "no refund reached the Redis");
        assert!(!r.decide(&mut st, 0, 0, FailMode::Closed, aged, &p, 1));
        // Back up: the bucket holds what was never reserved; the 81 tokens left in the pool
        // are lost.
        st.advance(&w, 2_000);
        let left = 100_000 - before - during - 81;
        assert!(st.decide(0, 0, FailMode::Closed, 2_000, &p, left as u32));
        assert!(!st.decide(0, 0, FailMode::Closed, 2_000, &p, 1));
    }
}
