//! Reservations: a hot bucket's tokens taken from the regional store in batches (one script
//! call spends `k · cost`, [`crate::bucket::reserve`]) and handed out in process, so a bucket
//! with sustained demand costs the store a call per batch instead of one per decision.
//!
//! What keeps it safe: tokens are spent in the store before they are handed out, so a region
//! never admits more than its store granted; what is left over goes back
//! ([`crate::bucket::refund`]). The only change is *when* tokens are spent: a batch spends up to
//! [`MAX_BATCH_PPM`] of the capacity ahead of its checks, so over any window a region admits at
//! most what its bucket grants in that window plus one batch held at the window's start.
//! Cold and small buckets get batches of 1: one store call per decision, as without
//! reservations.
//!
//! Pure: the caller passes the time (ms on any monotonic clock).

use crate::bucket::UT;

/// How much observed demand one batch covers: short, so a batch is used up quickly and little
/// sits in a daemon that other daemons on the same store cannot spend.
pub const HORIZON_MS: u64 = 50;

/// The most of a bucket's capacity one batch may take, in parts per million (1 %).
pub const MAX_BATCH_PPM: u64 = 10_000;

/// Demand is counted over intervals of this length; the rate is the last full interval's, or
/// the interval so far once it is [`MIN_OBSERVED_MS`] long, holds [`MIN_OBSERVED_CHECKS`]
/// checks and shows more.
pub const INTERVAL_MS: u64 = 100;

/// The shortest part of an interval whose demand sizes a batch: a bucket that turns hot gets
/// batches after this long, not after a whole interval of one store call per decision.
pub const MIN_OBSERVED_MS: u64 = 10;

/// The fewest checks of an interval so far whose rate sizes a batch: one check a few ms into
/// an interval says little, and a cold bucket must not take batches it then gives back.
pub const MIN_OBSERVED_CHECKS: u64 = 4;

/// A pool older than this goes back to the store unused: demand stopped, or slowed below what
/// the batch was sized for.
pub const MAX_AGE_MS: u64 = 200;

/// Sizes batches from the demand a bucket sees in this daemon.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sizer {
    /// Start of the interval being counted.
    started_ms: u64,
    /// Tokens asked for in it.
    counting: u64,
    /// Tokens asked for in the last full interval (0 when it is older than one interval).
    last: u64,
}

impl Sizer {
    /// A sizer that starts counting at `now_ms`.
    pub fn new(now_ms: u64) -> Self {
        Self {
            started_ms: now_ms,
            counting: 0,
            last: 0,
        }
    }

    /// Counts a check of `cost` tokens at `now_ms`.
    pub fn observe(&mut self, now_ms: u64, cost: u64) {
        self.roll(now_ms);
        self.counting = self.counting.saturating_add(cost);
    }

    fn roll(&mut self, now_ms: u64) {
        let gone = now_ms.saturating_sub(self.started_ms);
        if gone < INTERVAL_MS {
            return;
        }
        // One full interval just ended: it is the rate; more than one: nothing came since.
        self.last = if gone < 2 * INTERVAL_MS {
            self.counting
        } else {
            0
        };
        self.counting = 0;
        self.started_ms = now_ms - gone % INTERVAL_MS;
    }

    /// Tokens a second this bucket was asked for in the last full interval, at `now_ms`.
    pub fn rate_per_s(&mut self, now_ms: u64) -> u64 {
        self.roll(now_ms);
        self.last.saturating_mul(1000) / INTERVAL_MS
    }

    /// How many multiples of `cost` one store call should take for a bucket of `capacity_ut`
    /// at `now_ms`: [`HORIZON_MS`] of the observed demand, at most [`MAX_BATCH_PPM`] of the
    /// capacity, and 1 (a plain decision) when that is less than 2. The demand is the last
    /// full interval's or, when more, the current interval's so far (once it spans
    /// [`MIN_OBSERVED_MS`] and holds [`MIN_OBSERVED_CHECKS`] checks of `cost`): its checks came
    /// in the whole milliseconds from its start to `now_ms`, both counted.
    pub fn batch(&mut self, now_ms: u64, cost: u64, capacity_ut: u64) -> u64 {
        if cost == 0 {
            return 1;
        }
        self.roll(now_ms);
        let mut demand = self.last.saturating_mul(HORIZON_MS) / INTERVAL_MS;
        let observed_ms = now_ms.saturating_sub(self.started_ms) + 1;
        if observed_ms >= MIN_OBSERVED_MS
            && self.counting >= MIN_OBSERVED_CHECKS.saturating_mul(cost)
        {
            demand = demand.max(self.counting.saturating_mul(HORIZON_MS) / observed_ms);
        }
        let demand = demand / cost;
        let cap_ut = u128::from(capacity_ut) * u128::from(MAX_BATCH_PPM) / 1_000_000;
        let most = (cap_ut / (u128::from(cost) * u128::from(UT))) as u64;
        let k = demand.min(most);
        if k < 2 {
            1
        } else {
            k
        }
    }
}

/// Tokens of one bucket taken from the store and not yet handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool {
    /// Whole tokens left.
    pub tokens: u64,
    /// When they were taken.
    pub taken_ms: u64,
}

impl Pool {
    /// Hands out `cost` tokens if the pool holds them and is not past [`MAX_AGE_MS`].
    pub fn take(&mut self, now_ms: u64, cost: u64) -> bool {
        if self.expired(now_ms) || self.tokens < cost {
            return false;
        }
        self.tokens -= cost;
        true
    }

    /// True once what is left should go back to the store.
    pub fn expired(&self, now_ms: u64) -> bool {
        now_ms.saturating_sub(self.taken_ms) >= MAX_AGE_MS
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{decide, refund, reserve, BucketParams, BucketState};

    #[test]
    fn cold_and_small_buckets_get_batches_of_one() {
        let mut s = Sizer::new(0);
        // 10 checks a second: 0.5 of a check in 50 ms.
        for t in (0..300).step_by(100) {
            s.observe(t, 1);
        }
        assert_eq!(s.batch(300, 1, 1_000_000 * UT), 1);
        // Hot, but 1 % of a capacity of 100 tokens is 1 token.
        let mut hot = Sizer::new(0);
        for t in 0..200 {
            hot.observe(t, 1);
        }
        assert_eq!(hot.rate_per_s(200), 1000);
        assert_eq!(hot.batch(200, 1, 100 * UT), 1);
    }

    #[test]
    fn a_hot_bucket_batches_its_demand_up_to_a_share_of_its_capacity() {
        let mut s = Sizer::new(0);
        // 2 000 tokens a second, cost 2.
        for t in 0..100 {
            s.observe(t, 2);
            s.observe(t, 2);
        }
        s.observe(100, 2);
        // 50 ms of 4 000 tokens a second is 200 tokens: 100 checks of cost 2.
        assert_eq!(s.rate_per_s(100), 4_000);
        assert_eq!(s.batch(100, 2, 1_000_000 * UT), 100);
        // 1 % of 5 000 tokens is 50 tokens: 25 checks.
        assert_eq!(s.batch(100, 2, 5_000 * UT), 25);
        // Demand that stops ages out: after two quiet intervals the rate is 0.
        assert_eq!(s.batch(350, 2, 1_000_000 * UT), 1);
    }

    #[test]
    fn a_bucket_that_turns_hot_gets_batches_within_the_first_interval() {
        let mut s = Sizer::new(0);
        // 3 checks a ms from a cold start: too short a span to size from before 10 ms.
        for t in 0..MIN_OBSERVED_MS - 1 {
            for _ in 0..3 {
                s.observe(t, 1);
            }
            assert_eq!(s.batch(t, 1, 1_000_000 * UT), 1, "at {t} ms");
        }
        // 30 checks in the 10 ms 0..=9: 50 ms of it is 150.
        s.observe(MIN_OBSERVED_MS - 1, 1);
        s.observe(MIN_OBSERVED_MS - 1, 1);
        s.observe(MIN_OBSERVED_MS - 1, 1);
        assert_eq!(s.batch(MIN_OBSERVED_MS - 1, 1, 1_000_000 * UT), 150);
        // Still at most 1 % of the capacity.
        assert_eq!(s.batch(MIN_OBSERVED_MS - 1, 1, 10_000 * UT), 100);
        // A cold bucket whose checks happen to come early in an interval: 3 checks in its first
        // 10 ms (300 a second, were they the rate) are too few to size from; a fourth is not.
        let mut cold = Sizer::new(0);
        for t in [0, 4, 9] {
            cold.observe(t, 1);
            assert_eq!(cold.batch(t, 1, 1_000_000 * UT), 1, "at {t} ms");
        }
        cold.observe(11, 1);
        assert_eq!(cold.batch(11, 1, 1_000_000 * UT), 16);
        // A full interval that showed more than the interval so far still counts.
        let mut busy = Sizer::new(0);
        for t in 0..INTERVAL_MS {
            busy.observe(t, 1);
            busy.observe(t, 1);
        }
        for t in INTERVAL_MS..INTERVAL_MS + 20 {
            busy.observe(t, 1);
        }
        assert_eq!(busy.batch(INTERVAL_MS + 19, 1, 1_000_000 * UT), 100);
    }

    #[test]
    fn a_pool_hands_out_what_it_holds_until_it_ages_out() {
        let mut p = Pool {
            tokens: 5,
            taken_ms: 1_000,
        };
        assert!(p.take(1_000, 3));
        assert!(!p.take(1_001, 3));
        assert!(p.take(1_001, 2));
        assert!(!p.take(1_002, 1));
        let mut q = Pool {
            tokens: 5,
            taken_ms: 1_000,
        };
        assert!(!q.take(1_000 + MAX_AGE_MS, 1));
        assert!(q.expired(1_000 + MAX_AGE_MS));
    }

    /// A simulation of one daemon's reservations against the reference bucket it draws from.
    struct Reserved {
        params: BucketParams,
        state: Option<BucketState>,
        sizer: Sizer,
        pool: Option<Pool>,
        admitted: u64,
        spent: u64,
        refunded: u64,
        calls: u64,
    }

    impl Reserved {
        fn new(params: BucketParams) -> Self {
            Self {
                params,
                state: None,
                sizer: Sizer::new(0),
                pool: None,
                admitted: 0,
                spent: 0,
                refunded: 0,
                calls: 0,
            }
        }

        fn give_back(&mut self, now: u64) {
            if let Some(p) = self.pool.take() {
                if p.tokens > 0 {
                    self.calls += 1;
                    self.refunded += p.tokens;
                    if let Some(s) = refund(now, &self.params, self.state.as_ref(), p.tokens) {
                        self.state = Some(s);
                    }
                }
            }
        }

        fn check(&mut self, now: u64, cost: u64) -> bool {
            self.sizer.observe(now, cost);
            if let Some(p) = self.pool.as_mut() {
                if p.take(now, cost) {
                    self.admitted += cost;
                    return true;
                }
            }
            if self.pool.is_some_and(|p| p.expired(now)) {
                self.give_back(now);
            }
            let k = self.sizer.batch(now, cost, self.params.capacity_ut);
            let (d, granted, s) = reserve(now, &self.params, self.state.as_ref(), cost, k);
            self.calls += 1;
            self.state = Some(s);
            if !d.allowed {
                return false;
            }
            self.spent += granted * cost;
            self.admitted += cost;
            let left = (granted - 1) * cost;
            let held = self.pool.map_or(0, |p| p.tokens);
            self.pool = Some(Pool {
                tokens: held + left,
                taken_ms: now,
            });
            true
        }
    }

    /// Arrivals from a seeded generator: (ms, cost), a hot phase, a quiet one, a burst.
    fn arrivals(seed: u64) -> Vec<(u64, u64)> {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut out = Vec::new();
        for t in 0..6_000u64 {
            let per_ms = match t {
                0..=1_999 => 3,
                2_000..=2_999 => (next() % 2) as usize,
                3_000..=3_099 => 20,
                _ => 2,
            };
            for _ in 0..per_ms {
                out.push((t, 1 + next() % 3));
            }
        }
        out
    }

    #[test]
    fn reservations_admit_within_the_bucket_and_cost_little_goodput() {
        // 4 000 tokens of burst, 8 000 a second: demand runs at about 6 000 a second, with a
        // burst of 4 000 over 100 ms that the bucket cannot all hold.
        let params = BucketParams::new(4_000 * UT, 8_000 * UT).unwrap();
        for seed in 1..=8 {
            let arrivals = arrivals(seed);
            let mut plain_state = None;
            let mut plain = 0;
            let mut r = Reserved::new(params);
            // Tokens admitted in each 1 s window, by both.
            let mut windows = [0u64; 6];
            for &(t, cost) in &arrivals {
                let (d, s) = decide(t, &params, plain_state.as_ref(), cost);
                plain_state = Some(s);
                if d.allowed {
                    plain += cost;
                }
                if r.check(t, cost) {
                    windows[(t / 1000) as usize] += cost;
                }
            }
            r.give_back(6_000);
            // Every token handed out was spent in the bucket first, and what was not handed
            // out went back.
            assert_eq!(r.admitted + r.refunded, r.spent, "seed {seed}");
            // The bucket's bound: its burst plus its refill, plus one batch held (1 %).
            let batch = params.capacity_ut / UT * MAX_BATCH_PPM / 1_000_000;
            let total: u64 = windows.iter().sum();
            assert!(total <= 4_000 + 48_000 + batch, "seed {seed}: {total}");
            for (i, w) in windows.iter().enumerate() {
                assert!(*w <= 4_000 + 8_000 + batch, "seed {seed} window {i}: {w}");
            }
            // Goodput close to the plain bucket's, at a fraction of the calls.
            let ratio = r.admitted as f64 / plain as f64;
            assert!((0.99..=1.01).contains(&ratio), "seed {seed}: {ratio}");
            assert!(
                (r.calls as f64) < 0.2 * arrivals.len() as f64,
                "seed {seed}: {} calls for {} checks",
                r.calls,
                arrivals.len()
            );
        }
    }
}
