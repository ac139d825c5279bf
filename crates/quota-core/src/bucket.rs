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
//!
//! # Debt
//!
//! A charge for work already done ([`charge`]: LLM tokens known only once a response ends) is
//! applied even past the tokens left, down to a level of `−debt_limit`; what would go further
//! is not taken and is reported (`clamped`). The state then holds a debt (`debt_ut`) instead
//! of tokens, and everything works on the level `L = tokens − debt`:
//!
//! ```text
//! clip:    L = min(L, cap),  L = max(L, cap − MAX_CAP)    [cap − L stays below 2^53]
//! refill:  as above on L: the refill repays the debt first
//! check:   admitted iff cost ≤ L; denied in debt with retry = time_to(cost − L)
//! charge:  applied = min(cost, floor((L + D) / UT)), 0 when L + D ≤ 0;
//!          L −= applied · UT,  clamped = cost − applied
//! refund:  L = min(L + tokens, cap)
//! waits:   a time_to beyond MAX_WAIT_MS reads as never
//! ```
//!
//! A debt limit `D` is refused unless `cap + D ≤ MAX_CAP`, so a charge never needs the second
//! clip; that clip keeps the arithmetic exact after parameters change under a debt (a larger
//! capacity), by forgiving what no charge under those parameters could have owed. Waits are
//! bounded separately: `cap + D` µt at a slow refill can take longer than 2^53 ms to repay.

use serde::{Deserialize, Serialize};

use crate::bounds::PPM;
pub use crate::bounds::{
    DEFAULT_PERIOD_MS, MAX_BURST, MAX_CAPACITY_UT, MAX_FILL_BOUND_MS, MAX_LIMITS_PER_CHECK,
    MAX_PERIOD_MS, MAX_RATE_UT_PER_S, MAX_REFILL_UT, MAX_WAIT_MS, UT,
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
    /// Micro-tokens owed below empty, taken by a [`charge`] past the level; at most one of
    /// `tokens_ut` and `debt_ut` is nonzero. The scripts store `tokens − debt` in one field.
    #[serde(default)]
    pub debt_ut: u64,
    /// Micro-tokens not yet credited, in `1/period_ms` units (always < `period_ms`).
    pub carry: u64,
    /// The latest time this bucket has seen, in ms.
    pub ts_ms: u64,
    /// The period the carry is counted in: that of the parameters of the latest refill.
    pub period_ms: u64,
}

impl BucketState {
    /// The level in micro-tokens: the tokens, or minus the debt.
    pub fn level_ut(&self) -> i64 {
        self.tokens_ut as i64 - self.debt_ut as i64
    }

    /// Sets the level (tokens when positive, a debt when negative).
    fn set_level(&mut self, level_ut: i64) {
        self.tokens_ut = level_ut.max(0) as u64;
        self.debt_ut = level_ut.min(0).unsigned_abs();
    }

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
    /// Milliseconds until `cost` tokens are available (in debt: the repayment included): 0 when
    /// allowed; `None` when they never will be at the current parameters (cost above capacity,
    /// no refill, or a wait beyond [`MAX_WAIT_MS`]).
    pub retry_after_ms: Option<u64>,
    /// Milliseconds until the bucket is full again; `None` when it never refills (or not
    /// within [`MAX_WAIT_MS`]).
    pub reset_ms: Option<u64>,
}

/// `ceil((need_ut · P - carry) / R)`, the ms until `need_ut` more micro-tokens accrue, exact
/// whatever its size.
fn wait_exact(need_ut: u64, carry: u64, p: &BucketParams) -> u128 {
    debug_assert!(need_ut > 0 && carry < p.period_ms && p.refill_ut > 0);
    let num = u128::from(need_ut) * u128::from(p.period_ms) - u128::from(carry);
    num.div_ceil(u128::from(p.refill_ut))
}

/// [`wait_exact`] as a bucket reports it: `None` (never) beyond [`MAX_WAIT_MS`].
fn time_to(need_ut: u64, carry: u64, p: &BucketParams) -> Option<u64> {
    let t = wait_exact(need_ut, carry, p);
    (t <= u128::from(MAX_WAIT_MS)).then_some(t as u64)
}

/// The level of `s` clipped to `params`: at most the capacity (carry dropped), at least
/// `capacity − MAX_CAPACITY_UT` (see the module doc).
fn clipped(params: &BucketParams, s: &mut BucketState) {
    let cap = params.capacity_ut as i64;
    let level = s.level_ut();
    if level >= cap {
        s.set_level(cap);
        s.carry = 0;
    } else if level < cap - MAX_CAPACITY_UT as i64 {
        s.set_level(cap - MAX_CAPACITY_UT as i64);
    }
}

/// Refills `state` up to `now_ms` and clips it to the capacity. A missing state is a full
/// bucket; a clock stepping back refills nothing and does not move `ts_ms` backwards.
pub fn refill(now_ms: u64, params: &BucketParams, state: Option<&BucketState>) -> BucketState {
    let cap = params.capacity_ut;
    let rate = params.refill_ut;
    let Some(s) = state else {
        return BucketState {
            tokens_ut: cap,
            debt_ut: 0,
            carry: 0,
            ts_ms: now_ms,
            period_ms: params.period_ms,
        };
    };
    let mut s = s.in_period(params.period_ms);
    // Full, or the capacity shrank; or a debt deeper than these parameters keep exact.
    clipped(params, &mut s);
    if now_ms > s.ts_ms {
        let elapsed = now_ms - s.ts_ms;
        let level = s.level_ut();
        let need = (cap as i64 - level) as u64;
        if need > 0 && rate > 0 {
            if u128::from(elapsed) >= wait_exact(need, s.carry, params) {
                s.set_level(cap as i64);
                s.carry = 0;
            } else {
                // Below the fill time the sum cannot reach the capacity.
                let total = u128::from(elapsed) * u128::from(rate) + u128::from(s.carry);
                let period = u128::from(params.period_ms);
                s.set_level(level + (total / period) as i64);
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
    let (allowed, retry_after_ms) = if cost == 0 {
        // A peek spends nothing, in debt too.
        (true, Some(0))
    } else if s.debt_ut == 0 && cost_ut <= s.tokens_ut {
        granted = (s.tokens_ut / cost_ut).min(batch.max(1));
        s.tokens_ut -= granted * cost_ut;
        (true, Some(0))
    } else if cost_ut > cap || rate == 0 {
        (false, None)
    } else {
        // In debt, the wait covers the repayment: cost − level = cost + debt.
        let need = (cost_ut as i64 - s.level_ut()) as u64;
        (false, time_to(need, s.carry, params))
    };
    let decision = Decision {
        allowed,
        remaining: s.tokens_ut / UT,
        retry_after_ms,
        reset_ms: reset_ms(params, &s),
    };
    (decision, granted, s)
}

/// The ms until `s` (refilled, clipped) is full: `Some(0)` when it is, `None` when it never
/// refills or not within [`MAX_WAIT_MS`].
fn reset_ms(params: &BucketParams, s: &BucketState) -> Option<u64> {
    let need = params.capacity_ut as i64 - s.level_ut();
    if need <= 0 {
        Some(0)
    } else if params.refill_ut == 0 {
        None
    } else {
        time_to(need as u64, s.carry, params)
    }
}

/// Gives `tokens` whole tokens of a reservation back to a bucket at `now_ms`: refilled to now,
/// then up by `tokens` (repaying a debt first), never above the capacity (a bucket that filled
/// meanwhile keeps none of them, as it would not have had they never been taken). A missing
/// state is a full bucket, so there is nothing to store (`None`). Exactly what `lua/refund.lua`
/// computes.
pub fn refund(
    now_ms: u64,
    params: &BucketParams,
    state: Option<&BucketState>,
    tokens: u64,
) -> Option<BucketState> {
    let mut s = refill(now_ms, params, Some(state?));
    let room = params.capacity_ut as i64 - s.level_ut();
    let back = tokens.saturating_mul(UT).min(MAX_CAPACITY_UT) as i64;
    if back >= room {
        s.set_level(params.capacity_ut as i64);
        s.carry = 0;
    } else {
        s.set_level(s.level_ut() + back);
    }
    Some(s)
}

/// What a [`charge`] did and the bucket it left.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChargeOutcome {
    /// Whole tokens taken from the bucket.
    pub applied: u64,
    /// Whole tokens not taken because the debt limit was reached (`applied + clamped` is the
    /// cost): work done that this bucket did not pay for, for the caller to count.
    pub clamped: u64,
    /// Whole tokens left; 0 in debt.
    pub remaining: u64,
    /// Whole tokens owed, rounded up; 0 out of debt.
    pub debt: u64,
    /// Milliseconds until a check of one token is admitted (the repayment included): 0 when
    /// one would be now; `None` when never at these parameters (a capacity below one token, no
    /// refill, or a wait beyond [`MAX_WAIT_MS`]).
    pub retry_after_ms: Option<u64>,
    /// Milliseconds until the bucket is full again, as [`Decision::reset_ms`].
    pub reset_ms: Option<u64>,
}

/// Why a charge cannot be applied. Nothing is stored then.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChargeError {
    #[error("charge cost {cost} is outside 1..={MAX_BURST}")]
    Cost { cost: u64 },
    #[error(
        "debt limit {debt_limit_ut} µt on a capacity of {capacity_ut} µt exceeds \
         {MAX_CAPACITY_UT} µt together"
    )]
    DebtLimit {
        debt_limit_ut: u64,
        capacity_ut: u64,
    },
}

/// Checks a debt limit against the parameters in force: `capacity + debt_limit` must stay at or
/// below [`MAX_CAPACITY_UT`], so every level a charge leaves keeps the arithmetic exact.
pub fn check_debt_limit(params: &BucketParams, debt_limit_ut: u64) -> Result<(), ChargeError> {
    if debt_limit_ut > MAX_CAPACITY_UT - params.capacity_ut.min(MAX_CAPACITY_UT) {
        return Err(ChargeError::DebtLimit {
            debt_limit_ut,
            capacity_ut: params.capacity_ut,
        });
    }
    Ok(())
}

/// Charges `cost` whole tokens of work already done at `now_ms`: refilled to now, the bucket
/// gives what it holds and goes into debt for the rest, down to `−debt_limit_ut`; the tokens
/// that would take it further are not taken (`clamped`). A bucket already deeper in debt than
/// the limit (a lower limit since) takes nothing. Returns the outcome and the state to store.
/// Exactly what `lua/charge.lua` computes.
pub fn charge(
    now_ms: u64,
    params: &BucketParams,
    state: Option<&BucketState>,
    cost: u64,
    debt_limit_ut: u64,
) -> Result<(ChargeOutcome, BucketState), ChargeError> {
    if cost == 0 || cost > MAX_BURST {
        return Err(ChargeError::Cost { cost });
    }
    check_debt_limit(params, debt_limit_ut)?;
    let mut s = refill(now_ms, params, state);
    let room = s.level_ut() + debt_limit_ut as i64;
    let applied = if room <= 0 {
        0
    } else {
        cost.min(room as u64 / UT)
    };
    s.set_level(s.level_ut() - (applied * UT) as i64);
    Ok((charge_outcome(params, &s, applied, cost - applied), s))
}

/// The answer to a charge whose first run applied `applied` and clamped `clamped` (a replay of
/// the same charge): those, and the bucket as it stands at `now_ms`, refilled, nothing stored.
pub fn charge_replayed(
    now_ms: u64,
    params: &BucketParams,
    state: Option<&BucketState>,
    applied: u64,
    clamped: u64,
) -> ChargeOutcome {
    let s = refill(now_ms, params, state);
    charge_outcome(params, &s, applied, clamped)
}

fn charge_outcome(
    params: &BucketParams,
    s: &BucketState,
    applied: u64,
    clamped: u64,
) -> ChargeOutcome {
    let retry_after_ms = if s.tokens_ut >= UT {
        Some(0)
    } else if params.capacity_ut < UT || params.refill_ut == 0 {
        None
    } else {
        time_to((UT as i64 - s.level_ut()) as u64, s.carry, params)
    };
    ChargeOutcome {
        applied,
        clamped,
        remaining: s.tokens_ut / UT,
        debt: s.debt_ut.div_ceil(UT),
        retry_after_ms,
        reset_ms: reset_ms(params, s),
    }
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
/// no state yet) less `old capacity − old level` (more than the capacity in debt), at least 0,
/// or the old level when that is a debt (a debt is kept, never deepened by a smaller capacity),
/// and at least `new capacity − MAX_CAPACITY_UT`. So a drained bucket stays drained across a
/// change of terms, a raised limit gives only the difference, and a debt is still owed.
/// `lua/set_params.lua` computes exactly this.
pub fn carry_over(
    now_ms: u64,
    old: &BucketParams,
    old_state: &BucketState,
    new: &BucketParams,
    new_state: Option<&BucketState>,
) -> BucketState {
    let old_level = refill(now_ms, old, Some(old_state)).level_ut();
    let spent = old.capacity_ut as i64 - old_level;
    let mut s = refill(now_ms, new, new_state);
    let floor = old_level
        .min(0)
        .max(new.capacity_ut as i64 - MAX_CAPACITY_UT as i64);
    s.set_level((s.level_ut() - spent).max(floor));
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

/// Idle time after which a bucket may be forgotten: at least the time to refill completely
/// (from a debt too), so an expired bucket (read as full) never grants more than the live one
/// would. `u64::MAX` (never) when it does not refill, or not within [`MAX_WAIT_MS`].
pub fn idle_ttl_ms(params: &BucketParams, state: &BucketState) -> u64 {
    let mut s = state.in_period(params.period_ms);
    clipped(params, &mut s);
    reset_ms(params, &s).unwrap_or(u64::MAX)
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
                debt_ut: 0,
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

    #[test]
    fn a_charge_goes_into_debt_and_is_clamped_at_the_limit() {
        let p = params(10, 1);
        // 15 on a full 10 with room for 8 owed: all applied, 5 owed.
        let (o, s) = charge(0, &p, None, 15, 8 * UT).unwrap();
        assert_eq!((o.applied, o.clamped, o.remaining, o.debt), (15, 0, 0, 5));
        assert_eq!(
            (s.tokens_ut, s.debt_ut, s.level_ut()),
            (0, 5 * UT, -5 * UT as i64)
        );
        // One token is 6 s away (5 repaid first), full 15 s away.
        assert_eq!((o.retry_after_ms, o.reset_ms), (Some(6000), Some(15_000)));
        // 5 more: 3 fit above the limit, 2 are clamped, never taken.
        let (o, s) = charge(0, &p, Some(&s), 5, 8 * UT).unwrap();
        assert_eq!((o.applied, o.clamped, o.debt), (3, 2, 8));
        assert_eq!(s.level_ut(), -8 * UT as i64);
        // At the limit, everything is clamped and the level stays.
        let (o, s2) = charge(0, &p, Some(&s), 4, 8 * UT).unwrap();
        assert_eq!((o.applied, o.clamped), (0, 4));
        assert_eq!(s2, s);
        // A lower limit since: deeper than it, nothing is taken.
        let (o, _) = charge(0, &p, Some(&s), 1, 2 * UT).unwrap();
        assert_eq!((o.applied, o.clamped), (0, 1));
        // Without a debt limit a charge takes only what the bucket holds.
        let (o, s) = charge(0, &p, None, 12, 0).unwrap();
        assert_eq!((o.applied, o.clamped, o.remaining, o.debt), (10, 2, 0, 0));
        assert_eq!(s.level_ut(), 0);
    }

    #[test]
    fn a_check_in_debt_waits_for_the_repayment() {
        let p = params(10, 2);
        let (_, s) = charge(0, &p, None, 14, 10 * UT).unwrap();
        // Level −4: a cost of 2 needs 6 tokens, 3 s.
        let (d, after) = decide(0, &p, Some(&s), 2);
        assert_eq!(
            d,
            Decision {
                allowed: false,
                remaining: 0,
                retry_after_ms: Some(3000),
                reset_ms: Some(7000),
            }
        );
        assert_eq!(after.level_ut(), -4 * UT as i64);
        assert!(!decide(2999, &p, Some(&after), 2).0.allowed);
        let (d, s) = decide(3000, &p, Some(&after), 2);
        assert!(d.allowed && d.remaining == 0);
        assert_eq!(s.level_ut(), 0);
        // A reservation in debt is denied as the check, a peek allowed, and the refill
        // repays the debt first: 1 s later, level −2.
        let (d, granted, _) = reserve(1000, &p, Some(&after), 1, 5);
        assert_eq!(
            (d.allowed, granted, d.retry_after_ms),
            (false, 0, Some(1500))
        );
        let (d, peeked) = decide(1000, &p, Some(&after), 0);
        assert_eq!((d.allowed, d.remaining, d.reset_ms), (true, 0, Some(6000)));
        assert_eq!(peeked.level_ut(), -2 * UT as i64);
        // All or nothing: a limit in debt denies the check.
        let out = decide_all(1000, &[(p, Some(after)), (p, None)], 1);
        assert!(!out[0].decision.allowed && out[1].decision.allowed);
        assert!(out[1].state.is_none());
    }

    #[test]
    fn a_fractional_debt_is_owed_whole() {
        let p = BucketParams::new(10 * UT, UT / 2).unwrap();
        let (_, s) = charge(0, &p, None, 10, 5 * UT).unwrap();
        // 3 s at half a token a second: 1.5 tokens, then 3 more taken: −1.5.
        let (o, s) = charge(3000, &p, Some(&s), 3, 5 * UT).unwrap();
        assert_eq!(s.level_ut(), -(3 * UT as i64) / 2);
        assert_eq!((o.remaining, o.debt, o.retry_after_ms), (0, 2, Some(5000)));
        assert_eq!(idle_ttl_ms(&p, &s), 23_000);
    }

    #[test]
    fn a_refund_repays_the_debt_first_and_stops_at_capacity() {
        let p = params(10, 0);
        let (_, s) = charge(0, &p, None, 16, 10 * UT).unwrap();
        let s = refund(0, &p, Some(&s), 4).unwrap();
        assert_eq!((s.tokens_ut, s.debt_ut), (0, 2 * UT));
        let s = refund(0, &p, Some(&s), 5).unwrap();
        assert_eq!((s.tokens_ut, s.debt_ut), (3 * UT, 0));
        let s = refund(0, &p, Some(&s), 100).unwrap();
        assert_eq!(s.level_ut(), 10 * UT as i64);
    }

    #[test]
    fn charges_out_of_bounds_are_refused() {
        let p = params(10, 1);
        assert_eq!(
            charge(0, &p, None, 0, 0),
            Err(ChargeError::Cost { cost: 0 })
        );
        assert!(charge(0, &p, None, MAX_BURST + 1, 0).is_err());
        assert!(charge(0, &p, None, MAX_BURST, 0).is_ok());
        let most = MAX_CAPACITY_UT - p.capacity_ut;
        assert!(charge(0, &p, None, 1, most).is_ok());
        assert_eq!(
            charge(0, &p, None, 1, most + 1),
            Err(ChargeError::DebtLimit {
                debt_limit_ut: most + 1,
                capacity_ut: p.capacity_ut
            })
        );
    }

    #[test]
    fn a_changed_policy_keeps_a_debt() {
        let old = params(10, 1);
        let (_, owing) = charge(0, &old, None, 15, 10 * UT).unwrap();
        // The same terms: still owing 5.
        let s = carry_over(0, &old, &owing, &old, None);
        assert_eq!(s.level_ut(), -5 * UT as i64);
        // A bucket of 20 less the 15 spent: 5 left.
        let s = carry_over(0, &old, &owing, &params(20, 1), None);
        assert_eq!(s.level_ut(), 5 * UT as i64);
        // A lowered capacity keeps the debt as it was, no deeper.
        let s = carry_over(0, &old, &owing, &params(3, 1), None);
        assert_eq!(s.level_ut(), -5 * UT as i64);
        // What accrued meanwhile repays it first.
        let s = carry_over(2000, &old, &owing, &old, None);
        assert_eq!(s.level_ut(), -3 * UT as i64);
    }

    #[test]
    fn a_debt_beyond_what_the_parameters_keep_exact_is_clipped() {
        // A debt a tiny bucket allowed, under a bucket of the largest capacity.
        let small = params(1, 1);
        let (_, s) = charge(0, &small, None, MAX_BURST, MAX_CAPACITY_UT - UT).unwrap();
        assert_eq!(s.level_ut(), UT as i64 - (MAX_BURST * UT) as i64);
        let huge = BucketParams::new(MAX_CAPACITY_UT, MAX_RATE_UT_PER_S).unwrap();
        let r = refill(0, &huge, Some(&s));
        assert_eq!(r.level_ut(), 0);
        let half = BucketParams::new(MAX_CAPACITY_UT / 2, MAX_RATE_UT_PER_S).unwrap();
        let r = refill(0, &half, Some(&s));
        assert_eq!(
            r.level_ut(),
            (MAX_CAPACITY_UT / 2) as i64 - MAX_CAPACITY_UT as i64
        );
    }

    #[test]
    fn waits_beyond_the_bound_read_as_never() {
        // One token at 1 µt a ms: 2^51 ms to full from exactly 2^51 − 1 tokens' worth below it.
        let p = BucketParams::per_period(UT, 1, 1).unwrap();
        let at = |debt_ut: u64| BucketState {
            tokens_ut: 0,
            debt_ut,
            carry: 0,
            ts_ms: 0,
            period_ms: 1,
        };
        let edge = at(MAX_WAIT_MS - UT);
        assert_eq!(idle_ttl_ms(&p, &edge), MAX_WAIT_MS);
        assert_eq!(decide(0, &p, Some(&edge), 1).0.reset_ms, Some(MAX_WAIT_MS));
        let past = at(MAX_WAIT_MS - UT + 1);
        assert_eq!(idle_ttl_ms(&p, &past), u64::MAX);
        let (d, _) = decide(0, &p, Some(&past), 1);
        assert_eq!(
            (d.allowed, d.retry_after_ms, d.reset_ms),
            (false, None, None)
        );
        // The refill itself is exact however far: it repays at 1 µt a ms.
        assert_eq!(
            refill(MAX_WAIT_MS, &p, Some(&past)).level_ut(),
            UT as i64 - 1
        );
    }

    /// An operation of the debt proptest.
    #[derive(Debug, Clone)]
    enum Op {
        Charge { cost: u64, limit_tokens: u64 },
        Check { cost: u64 },
        Refund { tokens: u64 },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = (u64, Op)> {
        use proptest::prelude::*;
        let op = prop_oneof![
            3 => (1u64..=40, 0u64..=30)
                .prop_map(|(cost, limit_tokens)| Op::Charge { cost, limit_tokens }),
            3 => (0u64..=12).prop_map(|cost| Op::Check { cost }),
            1 => (1u64..=20).prop_map(|tokens| Op::Refund { tokens }),
        ];
        (prop_oneof![0u64..=50, 0u64..=20_000], op)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 512,
            ..Default::default()
        })]

        /// Charges never take the level below the debt limit (nor deeper than it already
        /// was), apply plus clamp to the cost and clamp only at the limit; a check in debt is
        /// denied and admitted exactly at its retry time; the level never exceeds the capacity
        /// and a state holds tokens or a debt, never both.
        #[test]
        fn charges_keep_debt_bounded_and_checks_wait_for_repayment(
            cap_tokens in 0u64..=20,
            refill_ut in 0u64..=3_000_000,
            period_ms in proptest::prop_oneof![proptest::strategy::Just(1000u64), 1u64..=7_000],
            ops in proptest::collection::vec(op(), 1..60),
        ) {
            use proptest::prop_assert;
            let Ok(p) = BucketParams::per_period(cap_tokens * UT, refill_ut, period_ms) else {
                return Ok(());
            };
            let mut now = 0;
            let mut s: Option<BucketState> = None;
            for (dt, op) in ops {
                now += dt;
                let before = refill(now, &p, s.as_ref()).level_ut();
                match op {
                    Op::Charge { cost, limit_tokens } => {
                        let limit = limit_tokens * UT;
                        let (o, next) = charge(now, &p, s.as_ref(), cost, limit).unwrap();
                        let after = next.level_ut();
                        prop_assert!(o.applied + o.clamped == cost);
                        prop_assert!(before - after == (o.applied * UT) as i64);
                        prop_assert!(after >= before.min(-(limit as i64)));
                        if o.clamped > 0 {
                            prop_assert!(after < UT as i64 - limit as i64);
                        }
                        prop_assert!(o.debt == next.debt_ut.div_ceil(UT));
                        prop_assert!(o.remaining == next.tokens_ut / UT);
                        if let Some(r) = o.retry_after_ms.filter(|&r| r > 0) {
                            prop_assert!(!decide(now + r - 1, &p, Some(&next), 1).0.allowed);
                            prop_assert!(decide(now + r, &p, Some(&next), 1).0.allowed);
                        }
                        s = Some(next);
                    }
                    Op::Check { cost } => {
                        let (d, next) = decide(now, &p, s.as_ref(), cost);
                        if before < 0 && cost > 0 {
                            prop_assert!(!d.allowed && d.remaining == 0);
                        }
                        if let Some(r) = d.retry_after_ms.filter(|&r| r > 0) {
                            prop_assert!(!decide(now + r - 1, &p, Some(&next), cost).0.allowed);
                            prop_assert!(decide(now + r, &p, Some(&next), cost).0.allowed);
                        }
                        if cost > 0 {
                            s = Some(next);
                        }
                    }
                    Op::Refund { tokens } => {
                        if let Some(next) = refund(now, &p, s.as_ref(), tokens) {
                            let want = (before + (tokens * UT) as i64).min(p.capacity_ut as i64);
                            prop_assert!(next.level_ut() == want);
                            s = Some(next);
                        }
                    }
                }
                if let Some(st) = s {
                    prop_assert!(st.tokens_ut == 0 || st.debt_ut == 0);
                    prop_assert!(st.level_ut() <= p.capacity_ut as i64);
                    prop_assert!(st.level_ut() >= -30 * UT as i64);
                }
            }
        }
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
                debt_ut: 0,
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
