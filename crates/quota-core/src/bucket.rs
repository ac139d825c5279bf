//! The reference token bucket: the exact arithmetic `lua/token_bucket.lua` performs.
//!
//! Everything is an integer so the Lua script (whose numbers are doubles, exact below 2^53) and
//! this code agree bit for bit, which the differential test checks:
//!
//! - tokens are held in micro-tokens (`UT` per token), plus a `carry` of thousandths of a
//!   micro-token, so refilling by small steps loses nothing;
//! - the refill rate is micro-tokens per second; `elapsed_ms * rate` is in thousandths of a
//!   micro-token, hence the carry;
//! - time is whole milliseconds, and a clock stepping back refills nothing.
//!
//! ```text
//! refill:  tokens += (elapsed * rate + carry) / 1000,  carry = (elapsed * rate + carry) % 1000
//! full:    once elapsed >= time_to(cap - tokens): tokens = cap, carry = 0
//! time_to(need) = ceil((need * 1000 - carry) / rate)   [ms]
//! ```

use serde::{Deserialize, Serialize};

use crate::bounds::PPM;
pub use crate::bounds::{MAX_CAPACITY_UT, MAX_FILL_RATIO, MAX_RATE_UT_PER_S, UT};
use crate::policy::Policy;

/// The parameters a region enforces for one tenant's policy: its share of the global bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BucketParams {
    /// Capacity in micro-tokens.
    pub capacity_ut: u64,
    /// Refill in micro-tokens per second.
    pub rate_ut_per_s: u64,
}

/// Why bucket parameters are unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamsError {
    #[error("capacity {capacity_ut} µt exceeds the maximum {MAX_CAPACITY_UT}")]
    Capacity { capacity_ut: u64 },
    #[error("refill rate {rate_ut_per_s} µt/s exceeds the maximum {MAX_RATE_UT_PER_S}")]
    Rate { rate_ut_per_s: u64 },
    #[error("capacity {capacity_ut} µt at {rate_ut_per_s} µt/s takes too long to fill")]
    FillTime {
        capacity_ut: u64,
        rate_ut_per_s: u64,
    },
}

impl BucketParams {
    /// Checked constructor: the bounds that keep the arithmetic exact in Lua.
    pub fn new(capacity_ut: u64, rate_ut_per_s: u64) -> Result<Self, ParamsError> {
        if capacity_ut > MAX_CAPACITY_UT {
            return Err(ParamsError::Capacity { capacity_ut });
        }
        if rate_ut_per_s > MAX_RATE_UT_PER_S {
            return Err(ParamsError::Rate { rate_ut_per_s });
        }
        if rate_ut_per_s > 0 && capacity_ut / rate_ut_per_s >= MAX_FILL_RATIO {
            return Err(ParamsError::FillTime {
                capacity_ut,
                rate_ut_per_s,
            });
        }
        Ok(Self {
            capacity_ut,
            rate_ut_per_s,
        })
    }

    /// The bucket for `share_ppm` of a policy's global budget (capacity `s·C`, refill `s·r`).
    pub fn for_share(policy: &Policy, share_ppm: u32) -> Self {
        let share = u64::from(share_ppm.min(PPM));
        // burst ≤ MAX_BURST so burst · share ≤ MAX_CAPACITY_UT.
        let capacity_ut = policy.burst * share;
        let rate =
            (u128::from(policy.rate_ut_per_s()) * u128::from(share) / u128::from(PPM)) as u64;
        // Rounding a tiny share's rate down can make the fill time absurd; nudge it up instead.
        let rate_ut_per_s = if rate > 0 && capacity_ut / rate >= MAX_FILL_RATIO {
            capacity_ut / MAX_FILL_RATIO + 1
        } else {
            rate
        };
        Self {
            capacity_ut,
            rate_ut_per_s,
        }
    }

    /// The whole-budget bucket of a policy (the global bucket of docs/architecture.md).
    pub fn global(policy: &Policy) -> Self {
        Self::for_share(policy, PPM)
    }
}

/// The stored state of one bucket. A missing bucket is a full one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BucketState {
    pub tokens_ut: u64,
    /// Thousandths of a micro-token not yet credited (always < 1000).
    pub carry: u64,
    /// The latest time this bucket has seen, in ms.
    pub ts_ms: u64,
}

/// The answer to "may this cost be spent now?". A denial is a value, not an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Decision {
    pub allowed: bool,
    /// Whole tokens left after this decision.
    pub remaining: u64,
    /// Milliseconds until `cost` tokens are available: 0 when allowed; `None` when they never
    /// will be at the current parameters (cost above capacity, or no refill).
    pub retry_after_ms: Option<u64>,
    /// Milliseconds until the bucket is full again; `None` when it never refills.
    pub reset_ms: Option<u64>,
}

/// `ceil((need_ut * 1000 - carry) / rate)`, the ms until `need_ut` more micro-tokens accrue.
fn time_to(need_ut: u64, carry: u64, rate: u64) -> u64 {
    debug_assert!(need_ut > 0 && carry < 1000 && rate > 0);
    let num = u128::from(need_ut) * 1000 - u128::from(carry);
    num.div_ceil(u128::from(rate)) as u64
}

/// Refills `state` up to `now_ms` and clips it to the capacity. A missing state is a full
/// bucket; a clock stepping back refills nothing and does not move `ts_ms` backwards.
pub fn refill(now_ms: u64, params: &BucketParams, state: Option<&BucketState>) -> BucketState {
    let cap = params.capacity_ut;
    let rate = params.rate_ut_per_s;
    let Some(s) = state else {
        return BucketState {
            tokens_ut: cap,
            carry: 0,
            ts_ms: now_ms,
        };
    };
    let mut s = *s;
    if s.tokens_ut >= cap {
        // Full, or the capacity shrank: clip.
        s.tokens_ut = cap;
        s.carry = 0;
    }
    if now_ms > s.ts_ms {
        let elapsed = now_ms - s.ts_ms;
        if s.tokens_ut < cap && rate > 0 {
            if elapsed >= time_to(cap - s.tokens_ut, s.carry, rate) {
                s.tokens_ut = cap;
                s.carry = 0;
            } else {
                // Below the fill time the sum cannot reach the capacity.
                let total = u128::from(elapsed) * u128::from(rate) + u128::from(s.carry);
                s.tokens_ut += (total / 1000) as u64;
                s.carry = (total % 1000) as u64;
            }
        }
        s.ts_ms = now_ms;
    }
    s
}

/// Decides whether `cost` whole tokens may be spent at `now_ms`, returning the decision and the
/// state to store. Exactly what `lua/token_bucket.lua` computes. A `cost` of 0 is a peek: the
/// decision describes the bucket now and is always allowed (the caller stores nothing).
pub fn decide(
    now_ms: u64,
    params: &BucketParams,
    state: Option<&BucketState>,
    cost: u64,
) -> (Decision, BucketState) {
    let cap = params.capacity_ut;
    let rate = params.rate_ut_per_s;
    let mut s = refill(now_ms, params, state);
    let cost_ut = cost.saturating_mul(UT);
    let (allowed, retry_after_ms) = if cost_ut <= s.tokens_ut {
        s.tokens_ut -= cost_ut;
        (true, Some(0))
    } else if cost_ut > cap || rate == 0 {
        (false, None)
    } else {
        (false, Some(time_to(cost_ut - s.tokens_ut, s.carry, rate)))
    };
    let reset_ms = if s.tokens_ut >= cap {
        Some(0)
    } else if rate == 0 {
        None
    } else {
        Some(time_to(cap - s.tokens_ut, s.carry, rate))
    };
    let decision = Decision {
        allowed,
        remaining: s.tokens_ut / UT,
        retry_after_ms,
        reset_ms,
    };
    (decision, s)
}

/// Idle time after which a bucket may be forgotten: at least the time to refill completely, so
/// an expired bucket (read as full) never grants more than the live one would.
pub fn idle_ttl_ms(params: &BucketParams, state: &BucketState) -> u64 {
    if state.tokens_ut >= params.capacity_ut {
        0
    } else if params.rate_ut_per_s == 0 {
        u64::MAX
    } else {
        time_to(
            params.capacity_ut - state.tokens_ut,
            state.carry,
            params.rate_ut_per_s,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicySpec;

    fn params(cap_tokens: u64, tokens_per_s: u64) -> BucketParams {
        BucketParams::new(cap_tokens * UT, tokens_per_s * UT).unwrap()
    }

    #[test]
    fn a_new_bucket_is_full_and_spends() {
        let p = params(10, 1);
        let (d, s) = decide(1000, &p, None, 3);
        assert!(d.allowed);
        assert_eq!(d.remaining, 7);
        assert_eq!(d.retry_after_ms, Some(0));
        assert_eq!(d.reset_ms, Some(3000));
        assert_eq!(
            s,
            BucketState {
                tokens_ut: 7 * UT,
                carry: 0,
                ts_ms: 1000
            }
        );
    }

    #[test]
    fn denial_reports_when_enough_tokens_accrue() {
        let p = params(10, 2);
        let (_, s) = decide(0, &p, None, 10);
        let (d, _) = decide(0, &p, Some(&s), 3);
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, Some(1500));
        let (d, _) = decide(1500, &p, Some(&s), 3);
        assert!(d.allowed);
    }

    #[test]
    fn small_steps_lose_nothing() {
        // 1 token per hour: a thousand 1 ms steps must add up exactly like one 1 s step.
        let p = BucketParams::new(UT, UT / 3600).unwrap();
        let (_, empty) = decide(0, &p, None, 1);
        let mut s = empty;
        for t in 1..=1000 {
            s = refill(t, &p, Some(&s));
        }
        assert_eq!(s, refill(1000, &p, Some(&empty)));
    }

    #[test]
    fn clock_stepping_back_refills_nothing() {
        let p = params(10, 1);
        let (_, s) = decide(10_000, &p, None, 10);
        let back = refill(5_000, &p, Some(&s));
        assert_eq!(back, s);
        // And time already seen is not refilled twice.
        let again = refill(10_500, &p, Some(&back));
        assert_eq!(again.tokens_ut, UT / 2);
    }

    #[test]
    fn tokens_never_exceed_capacity_and_shrinking_clips() {
        let p = params(10, 1000);
        let (_, s) = decide(0, &p, None, 1);
        assert_eq!(refill(1_000_000, &p, Some(&s)).tokens_ut, 10 * UT);
        let small = params(4, 1000);
        let (d, s2) = decide(1, &small, Some(&s), 1);
        assert_eq!((d.remaining, s2.tokens_ut), (3, 3 * UT));
    }

    #[test]
    fn cost_above_capacity_or_without_refill_never_succeeds() {
        let p = params(5, 1);
        let (d, _) = decide(0, &p, None, 6);
        assert_eq!((d.allowed, d.retry_after_ms), (false, None));
        let dry = params(5, 0);
        let (_, s) = decide(0, &dry, None, 5);
        let (d, _) = decide(1_000_000, &dry, Some(&s), 1);
        assert_eq!(
            (d.allowed, d.retry_after_ms, d.reset_ms),
            (false, None, None)
        );
    }

    #[test]
    fn shares_scale_capacity_and_rate() {
        let policy = PolicySpec {
            limit: 600.0,
            window_ms: 60_000.0,
            ..Default::default()
        }
        .validate()
        .unwrap();
        let g = BucketParams::global(&policy);
        assert_eq!(
            g,
            BucketParams {
                capacity_ut: 600 * UT,
                rate_ut_per_s: 10 * UT
            }
        );
        let third = BucketParams::for_share(&policy, PPM / 4);
        assert_eq!(
            third,
            BucketParams {
                capacity_ut: 150 * UT,
                rate_ut_per_s: 10 * UT / 4
            }
        );
        assert!(BucketParams::new(third.capacity_ut, third.rate_ut_per_s).is_ok());
    }

    #[test]
    fn idle_ttl_covers_a_full_refill() {
        let p = params(10, 2);
        let (_, s) = decide(0, &p, None, 10);
        assert_eq!(idle_ttl_ms(&p, &s), 5000);
        assert_eq!(refill(5000, &p, Some(&s)).tokens_ut, p.capacity_ut);
    }
}
