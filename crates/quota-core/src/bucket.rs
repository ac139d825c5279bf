//! The reference token bucket: the exact arithmetic `lua/token_bucket.lua` performs.
//!
//! Everything is an integer so the Lua script (whose numbers are doubles, exact below 2^53) and
//! this code agree bit for bit, which the differential test checks:
//!
//! - tokens are held in micro-tokens (`UT` per token);
//! - the refill is a rational rate, `refill_ut` micro-tokens every `period_ms` (a policy's
//!   share refills `share · limit` µt per window: exact, whatever the window), so
//!   `elapsed_ms · refill_ut` is in `1/period_ms` micro-tokens, and the part not yet credited is
//!   kept as a `carry` in those units;
//! - time is whole milliseconds, and a clock stepping back refills nothing.
//!
//! ```text
//! refill:  tokens += (elapsed · R + carry) / P,  carry = (elapsed · R + carry) % P
//! full:    once elapsed >= time_to(cap - tokens): tokens = cap, carry = 0
//! time_to(need) = ceil((need · P - carry) / R)   [ms]
//! ```
//!
//! A carry is counted in the period of the parameters that made it: refilling under parameters
//! with another period first drops it (less than one micro-token).

use serde::{Deserialize, Serialize};

use crate::bounds::PPM;
pub use crate::bounds::{
    DEFAULT_PERIOD_MS, MAX_CAPACITY_UT, MAX_FILL_BOUND_MS, MAX_LIMITS_PER_CHECK, MAX_PERIOD_MS,
    MAX_RATE_UT_PER_S, MAX_REFILL_UT, UT,
};
use crate::policy::Policy;

/// The parameters a region enforces for one tenant's policy: its share of the global bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BucketParams {
    /// Capacity in micro-tokens.
    pub capacity_ut: u64,
    /// Refill: `refill_ut` micro-tokens every `period_ms`.
    pub refill_ut: u64,
    /// The refill period in ms (≥ 1).
    pub period_ms: u64,
}

/// Why bucket parameters are unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamsError {
    #[error("capacity {capacity_ut} µt exceeds the maximum {MAX_CAPACITY_UT}")]
    Capacity { capacity_ut: u64 },
    #[error("refill {refill_ut} µt per period exceeds the maximum {MAX_REFILL_UT}")]
    Refill { refill_ut: u64 },
    #[error("refill period {period_ms} ms is outside 1..={MAX_PERIOD_MS}")]
    Period { period_ms: u64 },
    #[error(
        "capacity {capacity_ut} µt at {refill_ut} µt per {period_ms} ms takes too long to fill"
    )]
    FillTime {
        capacity_ut: u64,
        refill_ut: u64,
        period_ms: u64,
    },
}

impl BucketParams {
    /// No capacity, no refill (a region without a share).
    pub const EMPTY: Self = Self {
        capacity_ut: 0,
        refill_ut: 0,
        period_ms: DEFAULT_PERIOD_MS,
    };

    /// Checked constructor for a refill in micro-tokens per second.
    pub fn new(capacity_ut: u64, rate_ut_per_s: u64) -> Result<Self, ParamsError> {
        Self::per_period(capacity_ut, rate_ut_per_s, DEFAULT_PERIOD_MS)
    }

    /// Checked constructor: `refill_ut` micro-tokens every `period_ms`, within the bounds that
    /// keep the arithmetic exact in Lua.
    pub fn per_period(
        capacity_ut: u64,
        refill_ut: u64,
        period_ms: u64,
    ) -> Result<Self, ParamsError> {
        if capacity_ut > MAX_CAPACITY_UT {
            return Err(ParamsError::Capacity { capacity_ut });
        }
        if refill_ut > MAX_REFILL_UT {
            return Err(ParamsError::Refill { refill_ut });
        }
        if period_ms == 0 || period_ms > MAX_PERIOD_MS {
            return Err(ParamsError::Period { period_ms });
        }
        if refill_ut > 0
            && u128::from(capacity_ut / refill_ut) * u128::from(period_ms)
                >= u128::from(MAX_FILL_BOUND_MS)
        {
            return Err(ParamsError::FillTime {
                capacity_ut,
                refill_ut,
                period_ms,
            });
        }
        Ok(Self {
            capacity_ut,
            refill_ut,
            period_ms,
        })
    }

    /// The bucket for `share_ppm` of a policy's global budget: capacity `s · burst`, refill
    /// `s · limit` per window, both exact in micro-tokens (`UT` = `PPM`), so the rate enforced
    /// is exactly the share of the policy's and a nonzero share always refills.
    pub fn for_share(policy: &Policy, share_ppm: u32) -> Self {
        let share = u64::from(share_ppm.min(PPM));
        debug_assert_eq!(UT, u64::from(PPM));
        // burst, limit ≤ MAX_BURST so both products are ≤ MAX_CAPACITY_UT; the fill time
        // floor(burst / limit) · window is the policy's, which validation bounds.
        Self {
            capacity_ut: policy.burst * share,
            refill_ut: policy.limit * share,
            period_ms: policy.window_ms,
        }
    }

    /// The whole-budget bucket of a policy (the global bucket of docs/architecture.md).
    pub fn global(policy: &Policy) -> Self {
        Self::for_share(policy, PPM)
    }

    /// The refill rate in tokens per second, unrounded (as exact as an `f64`), for display.
    pub fn refill_tokens_per_s(&self) -> f64 {
        self.refill_ut as f64 * 1000.0 / self.period_ms as f64 / UT as f64
    }
}

/// The stored state of one bucket. A missing bucket is a full one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BucketState {
    pub tokens_ut: u64,
    /// Micro-tokens not yet credited, in `1/period_ms` units (always < `period_ms`).
    pub carry: u64,
    /// The latest time this bucket has seen, in ms.
    pub ts_ms: u64,
    /// The period the carry is counted in: that of the parameters of the latest refill.
    pub period_ms: u64,
}

impl BucketState {
    /// The state counted in `period_ms`: the same, or with its carry dropped (less than one
    /// micro-token) when it was counted in another period. Refilling does this, and
    /// `set_params.lua` when it writes parameters of another period.
    pub fn in_period(&self, period_ms: u64) -> Self {
        if self.period_ms == period_ms {
            *self
        } else {
            Self {
                carry: 0,
                period_ms,
                ..*self
            }
        }
    }
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

/// `ceil((need_ut · P - carry) / R)`, the ms until `need_ut` more micro-tokens accrue.
fn time_to(need_ut: u64, carry: u64, p: &BucketParams) -> u64 {
    debug_assert!(need_ut > 0 && carry < p.period_ms && p.refill_ut > 0);
    let num = u128::from(need_ut) * u128::from(p.period_ms) - u128::from(carry);
    num.div_ceil(u128::from(p.refill_ut)) as u64
}

/// Refills `state` up to `now_ms` and clips it to the capacity. A missing state is a full
/// bucket; a clock stepping back refills nothing and does not move `ts_ms` backwards.
pub fn refill(now_ms: u64, params: &BucketParams, state: Option<&BucketState>) -> BucketState {
    let cap = params.capacity_ut;
    let rate = params.refill_ut;
    let Some(s) = state else {
        return BucketState {
            tokens_ut: cap,
            carry: 0,
            ts_ms: now_ms,
            period_ms: params.period_ms,
        };
    };
    let mut s = s.in_period(params.period_ms);
    if s.tokens_ut >= cap {
        // Full, or the capacity shrank: clip.
        s.tokens_ut = cap;
        s.carry = 0;
    }
    if now_ms > s.ts_ms {
        let elapsed = now_ms - s.ts_ms;
        if s.tokens_ut < cap && rate > 0 {
            if elapsed >= time_to(cap - s.tokens_ut, s.carry, params) {
                s.tokens_ut = cap;
                s.carry = 0;
            } else {
                // Below the fill time the sum cannot reach the capacity.
                let total = u128::from(elapsed) * u128::from(rate) + u128::from(s.carry);
                let period = u128::from(params.period_ms);
                s.tokens_ut += (total / period) as u64;
                s.carry = (total % period) as u64;
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
    let (d, _, s) = reserve(now_ms, params, state, cost, 1);
    (d, s)
}

/// Spends up to `batch` multiples of `cost` at once, as many as the bucket holds, at least one:
/// a reservation a daemon hands out in process. Returns the decision (allowed when at least one
/// multiple was spent; its `remaining` is what the bucket keeps), the multiples spent, and the
/// state to store. A denial is [`decide`]'s for `cost` alone. `batch` 1 is [`decide`]; a `cost`
/// of 0 is a peek whatever `batch` is. Exactly what `lua/token_bucket.lua` computes with its
/// batch argument.
pub fn reserve(
    now_ms: u64,
    params: &BucketParams,
    state: Option<&BucketState>,
    cost: u64,
    batch: u64,
) -> (Decision, u64, BucketState) {
    let cap = params.capacity_ut;
    let rate = params.refill_ut;
    let mut s = refill(now_ms, params, state);
    let cost_ut = cost.saturating_mul(UT);
    let mut granted = 0;
    let (allowed, retry_after_ms) = if cost_ut <= s.tokens_ut {
        // A peek (cost 0) spends nothing.
        granted = s
            .tokens_ut
            .checked_div(cost_ut)
            .map_or(0, |n| n.min(batch.max(1)));
        s.tokens_ut -= granted * cost_ut;
        (true, Some(0))
    } else if cost_ut > cap || rate == 0 {
        (false, None)
    } else {
        (false, Some(time_to(cost_ut - s.tokens_ut, s.carry, params)))
    };
    let reset_ms = if s.tokens_ut >= cap {
        Some(0)
    } else if rate == 0 {
        None
    } else {
        Some(time_to(cap - s.tokens_ut, s.carry, params))
    };
    let decision = Decision {
        allowed,
        remaining: s.tokens_ut / UT,
        retry_after_ms,
        reset_ms,
    };
    (decision, granted, s)
}

/// Gives `tokens` whole tokens of a reservation back to a bucket at `now_ms`: refilled to now,
/// then up by `tokens`, never above the capacity (a bucket that filled meanwhile keeps none of
/// them, as it would not have had they never been taken). A missing state is a full bucket, so
/// there is nothing to store (`None`). Exactly what `lua/refund.lua` computes.
pub fn refund(
    now_ms: u64,
    params: &BucketParams,
    state: Option<&BucketState>,
    tokens: u64,
) -> Option<BucketState> {
    let mut s = refill(now_ms, params, Some(state?));
    let room = params.capacity_ut - s.tokens_ut.min(params.capacity_ut);
    let back = tokens.saturating_mul(UT);
    if back >= room {
        s.tokens_ut = params.capacity_ut;
        s.carry = 0;
    } else {
        s.tokens_ut += back;
    }
    Some(s)
}

/// One limit's part of a check of several limits at once ([`decide_all`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitOutcome {
    /// This limit's decision. When the check as a whole is denied, a limit that would have
    /// admitted reports `allowed` with its level unspent.
    pub decision: Decision,
    /// The state to store, or `None` to leave the stored one as it is.
    pub state: Option<BucketState>,
}

/// Decides `cost` whole tokens against several buckets at once, all or nothing: the cost is
/// spent on every bucket when every one of them admits it, and on none otherwise. A denied
/// check stores the refilled state of each bucket that denied (its denial counted there, as
/// [`decide`] does) and leaves the others untouched, so a limit that would have admitted
/// spends nothing. A `cost` of 0 is a peek of each. Exactly what `lua/token_buckets.lua`
/// computes; the check's decision is [`Decision::all`] of the outcomes.
pub fn decide_all(
    now_ms: u64,
    limits: &[(BucketParams, Option<BucketState>)],
    cost: u64,
) -> Vec<LimitOutcome> {
    let each: Vec<(Decision, BucketState)> = limits
        .iter()
        .map(|(p, s)| decide(now_ms, p, s.as_ref(), cost))
        .collect();
    let admitted = each.iter().all(|(d, _)| d.allowed);
    each.into_iter()
        .zip(limits)
        .map(|((d, s), (p, prev))| {
            if cost == 0 {
                LimitOutcome {
                    decision: d,
                    state: None,
                }
            } else if admitted || !d.allowed {
                LimitOutcome {
                    decision: d,
                    state: Some(s),
                }
            } else {
                // Would have admitted: described as a peek, nothing stored.
                LimitOutcome {
                    decision: decide(now_ms, p, prev.as_ref(), 0).0,
                    state: None,
                }
            }
        })
        .collect()
}

impl Decision {
    /// The decision of a check of several limits from each limit's: allowed when every one
    /// allows; the fewest tokens left; the longest wait of those that deny (`None` when one
    /// of them never will admit); the longest time to full (`None` when one never refills).
    /// `None` for no limits.
    pub fn all(decisions: impl IntoIterator<Item = Decision>) -> Option<Decision> {
        let mut it = decisions.into_iter();
        let first = it.next()?;
        let wait = |d: &Decision| if d.allowed { Some(0) } else { d.retry_after_ms };
        let mut out = Decision {
            retry_after_ms: wait(&first),
            ..first
        };
        for d in it {
            out.allowed &= d.allowed;
            out.remaining = out.remaining.min(d.remaining);
            out.retry_after_ms = out.retry_after_ms.zip(wait(&d)).map(|(a, b)| a.max(b));
            out.reset_ms = out.reset_ms.zip(d.reset_ms).map(|(a, b)| a.max(b));
        }
        Some(out)
    }
}

/// The state of a bucket of `new` parameters that replaces a bucket of `old` ones (a changed
/// policy, whose new version has a bucket of its own) at `now_ms`: what the old bucket had spent
/// stays spent. Both refilled to now, the new level is the new bucket's level (full when it has
/// no state yet) less `old capacity − old level`, at least 0. So a drained bucket stays drained
/// across a change of terms, and a raised limit gives only the difference. `lua/set_params.lua`
/// computes exactly this.
pub fn carry_over(
    now_ms: u64,
    old: &BucketParams,
    old_state: &BucketState,
    new: &BucketParams,
    new_state: Option<&BucketState>,
) -> BucketState {
    let spent = old.capacity_ut - refill(now_ms, old, Some(old_state)).tokens_ut;
    let mut s = refill(now_ms, new, new_state);
    s.tokens_ut = s.tokens_ut.saturating_sub(spent);
    s
}

/// A lower bound on the ms after decision `d` (of a check of `cost` at `params`) before a check
/// of `cost` or more can be admitted again, or `None` when the decision does not bound it (an
/// admission that leaves `cost` or more, or a bucket that never refills).
///
/// A denial's bound is its retry time. An admission that leaves fewer than `cost` tokens is
/// bounded from its time to full: filling takes `reset` ms, and the last `capacity − cost` of
/// it at least `⌈(capacity − cost) · P / R⌉`, so `cost` tokens are at least `reset` less that
/// away, and at most 1 ms more (ceilings of a difference). Tokens come only from the refill,
/// so nobody else's spending can make either bound shorter.
pub fn next_admission_ms(params: &BucketParams, cost: u64, d: &Decision) -> Option<u64> {
    if !d.allowed {
        return d.retry_after_ms;
    }
    let cost_ut = cost.checked_mul(UT)?;
    if cost == 0 || d.remaining >= cost || cost_ut > params.capacity_ut || params.refill_ut == 0 {
        return None;
    }
    let reset = d.reset_ms?;
    let above = u128::from(params.capacity_ut - cost_ut) * u128::from(params.period_ms);
    let from_cost_to_full = above.div_ceil(u128::from(params.refill_ut));
    Some(reset.saturating_sub(u64::try_from(from_cost_to_full).unwrap_or(u64::MAX)))
}

/// Idle time after which a bucket may be forgotten: at least the time to refill completely, so
/// an expired bucket (read as full) never grants more than the live one would.
pub fn idle_ttl_ms(params: &BucketParams, state: &BucketState) -> u64 {
    if state.tokens_ut >= params.capacity_ut {
        0
    } else if params.refill_ut == 0 {
        u64::MAX
    } else {
        let s = state.in_period(params.period_ms);
        time_to(params.capacity_ut - s.tokens_ut, s.carry, params)
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
    fn several_limits_spend_all_or_nothing() {
        // 10 per second and 50 per minute.
        let per_s = params(10, 10);
        let per_min = BucketParams::per_period(50 * UT, 50 * UT, 60_000).unwrap();
        let mut states = [None, None];
        let mut admitted = 0;
        for k in 0..12 {
            let out = decide_all(k, &[(per_s, states[0]), (per_min, states[1])], 1);
            for (s, o) in states.iter_mut().zip(&out) {
                if let Some(n) = o.state {
                    *s = Some(n);
                }
            }
            let all = Decision::all(out.iter().map(|o| o.decision)).unwrap();
            if all.allowed {
                admitted += 1;
            } else {
                // Denied by the per-second limit alone: nothing stored for the other.
                assert!(!out[0].decision.allowed && out[1].decision.allowed);
                assert!(out[0].state.is_some() && out[1].state.is_none());
                assert_eq!(out[1].decision.remaining, 40);
                assert_eq!(all.retry_after_ms, out[0].decision.retry_after_ms);
                assert_eq!(all.remaining, 0);
            }
        }
        assert_eq!(admitted, 10);
        // A peek stores nothing and describes each.
        let out = decide_all(20, &[(per_s, states[0]), (per_min, states[1])], 0);
        assert!(out.iter().all(|o| o.state.is_none() && o.decision.allowed));
        assert_eq!(Decision::all([]), None);
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
                ts_ms: 1000,
                period_ms: 1000,
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
                refill_ut: 600 * UT,
                period_ms: 60_000,
            }
        );
        let quarter = BucketParams::for_share(&policy, PPM / 4);
        assert_eq!(
            quarter,
            BucketParams {
                capacity_ut: 150 * UT,
                refill_ut: 150 * UT,
                period_ms: 60_000,
            }
        );
        assert!(BucketParams::per_period(150 * UT, 150 * UT, 60_000).is_ok());
        assert_eq!(quarter.refill_tokens_per_s(), 2.5);
    }

    fn policy(limit: u64, window_ms: u64, burst: u64) -> Policy {
        PolicySpec {
            limit: limit as f64,
            window_ms: window_ms as f64,
            burst: Some(burst as f64),
            ..Default::default()
        }
        .validate()
        .unwrap()
    }

    // Issue 20: one a month at a third refilled at 0 µt/s, ten a month at a third 22% slow.
    #[test]
    fn a_share_refills_exactly_its_part_of_a_slow_policy() {
        let month = 2_592_000_000;
        for (limit, window_ms) in [(1, 2_678_400_000), (10, month), (100, 2_678_400_000)] {
            let p = policy(limit, window_ms, limit);
            let share = PPM / 3;
            let b = BucketParams::for_share(&p, share);
            assert!(b.refill_ut > 0);
            let want = limit as f64 * f64::from(share) / f64::from(PPM) * 1000.0 / window_ms as f64;
            assert!((b.refill_tokens_per_s() - want).abs() <= want * 1e-12);
            // Drained, the bucket is full again exactly one window later.
            let (_, s) = decide(0, &b, None, 0);
            let empty = BucketState { tokens_ut: 0, ..s };
            let (d, _) = decide(0, &b, Some(&empty), 0);
            assert_eq!(d.reset_ms, Some(window_ms));
            assert_eq!(
                refill(window_ms - 1, &b, Some(&empty)).tokens_ut,
                b.capacity_ut - 1
            );
            assert_eq!(
                refill(window_ms / 2, &b, Some(&empty)).tokens_ut,
                b.capacity_ut / 2
            );
        }
    }

    #[test]
    fn one_token_a_month_at_one_percent() {
        // limit 100 per 31 days at a 1% share: one token per 31 days.
        let window = 2_678_400_000;
        let b = BucketParams::for_share(&policy(100, window, 100), 10_000);
        assert_eq!((b.capacity_ut, b.refill_ut), (UT, UT));
        let (d, s) = decide(5, &b, None, 1);
        assert!(d.allowed);
        let (d, _) = decide(5, &b, Some(&s), 1);
        assert_eq!(d.retry_after_ms, Some(window));
        assert!(!decide(5 + window - 1, &b, Some(&s), 1).0.allowed);
        assert!(decide(5 + window, &b, Some(&s), 1).0.allowed);
        assert_eq!(idle_ttl_ms(&b, &s), window);
    }

    #[test]
    fn a_changed_period_drops_the_carry_only() {
        let a = BucketParams::per_period(10 * UT, 1, 3).unwrap();
        let (_, s) = decide(0, &a, None, 10);
        let s = refill(2, &a, Some(&s));
        assert_eq!((s.tokens_ut, s.carry), (0, 2));
        let b = BucketParams::per_period(10 * UT, 1, 7).unwrap();
        let t = refill(2, &b, Some(&s));
        assert_eq!((t.tokens_ut, t.carry, t.period_ms), (0, 0, 7));
    }

    #[test]
    fn parameters_out_of_bounds_are_refused() {
        assert!(BucketParams::per_period(1, 1, 0).is_err());
        assert!(BucketParams::per_period(1, 1, MAX_PERIOD_MS + 1).is_err());
        assert!(BucketParams::per_period(1, MAX_REFILL_UT + 1, 1).is_err());
        assert!(BucketParams::per_period(MAX_CAPACITY_UT + 1, 1, 1).is_err());
        // floor(cap / refill) · period at the bound: refused; just below: accepted.
        assert!(BucketParams::per_period(MAX_FILL_BOUND_MS / 1000, 1, 1000).is_err());
        assert!(BucketParams::per_period(MAX_FILL_BOUND_MS / 1000 - 1, 1, 1000).is_ok());
    }

    #[test]
    fn a_changed_policy_keeps_what_was_spent() {
        let old = params(10, 1);
        let (_, drained) = decide(0, &old, None, 10);
        // The same terms again: still drained; refilled by what accrued meanwhile.
        let s = carry_over(2000, &old, &drained, &old, None);
        assert_eq!(s.tokens_ut, 2 * UT);
        // A raised burst gives only the difference.
        let s = carry_over(0, &old, &drained, &params(15, 1), None);
        assert_eq!(s.tokens_ut, 5 * UT);
        // A lowered one cannot go below empty.
        let (_, half) = decide(0, &old, None, 5);
        let s = carry_over(0, &old, &half, &params(3, 1), None);
        assert_eq!(s.tokens_ut, 0);
        // A new bucket already spent from (decided before its parameters): both spendings count.
        let new = params(20, 1);
        let (_, spent_new) = decide(0, &new, None, 4);
        let s = carry_over(0, &old, &half, &new, Some(&spent_new));
        assert_eq!(s.tokens_ut, 11 * UT);
    }

    #[test]
    fn idle_ttl_covers_a_full_refill() {
        let p = params(10, 2);
        let (_, s) = decide(0, &p, None, 10);
        assert_eq!(idle_ttl_ms(&p, &s), 5000);
        assert_eq!(refill(5000, &p, Some(&s)).tokens_ut, p.capacity_ut);
    }

    #[test]
    fn an_admission_that_leaves_less_than_its_cost_bounds_the_next() {
        // 10 a second, burst 10: spending 10 leaves nothing; the next token is 100 ms away.
        let p = params(10, 10);
        let (d, s) = decide(0, &p, None, 10);
        assert_eq!(next_admission_ms(&p, 1, &d), Some(100));
        assert!(!decide(99, &p, Some(&s), 1).0.allowed);
        assert!(decide(100, &p, Some(&s), 1).0.allowed);
        // Leaving 5, a cost of 5 could come back at once: no bound.
        let (d, _) = decide(0, &p, None, 5);
        assert_eq!(next_admission_ms(&p, 5, &d), None);
        // A denial is bounded by its retry time; no refill never comes back.
        let (d, _) = decide(0, &p, Some(&s), 3);
        assert_eq!(next_admission_ms(&p, 3, &d), Some(300));
        let still = BucketParams::new(10 * UT, 0).unwrap();
        let (d, _) = decide(0, &still, None, 10);
        assert_eq!(next_admission_ms(&still, 1, &d), None);
    }

    proptest::proptest! {
        /// The bound is never later than the bucket's next admission of that cost, and at most
        /// 1 ms earlier, for any parameters, state and cost (rational refills included).
        #[test]
        fn the_next_admission_bound_is_safe_and_tight(
            cap_tokens in 1u64..2_000,
            refill_ut in 1u64..5_000_000_000,
            period_ms in 1u64..600_000,
            level in 0.0f64..=1.0,
            carry in 0u64..600_000,
            cost_pick in 0.0f64..=1.0,
            now in 0u64..1_000_000,
        ) {
            let Ok(p) = BucketParams::per_period(cap_tokens * UT, refill_ut, period_ms) else {
                return Ok(());
            };
            let prior = BucketState {
                tokens_ut: (p.capacity_ut as f64 * level) as u64,
                carry: carry % period_ms,
                ts_ms: now,
                period_ms,
            };
            let cost = 1 + ((cap_tokens - 1) as f64 * cost_pick) as u64;
            let (d, s) = decide(now, &p, Some(&prior), cost);
            let Some(b) = next_admission_ms(&p, cost, &d) else {
                proptest::prop_assert!(d.allowed && d.remaining >= cost);
                return Ok(());
            };
            if b > 0 {
                proptest::prop_assert!(!decide(now + b - 1, &p, Some(&s), cost).0.allowed);
            }
            proptest::prop_assert!(decide(now + b + 1, &p, Some(&s), cost).0.allowed);
        }
    }
}
