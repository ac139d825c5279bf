//! The reference sliding window, "at most `limit` tokens in any `window_ms`": the exact
//! arithmetic `lua/sliding_window.lua` performs, for login attempts, password resets and other
//! small, abuse-sensitive limits.
//!
//! Two representations, chosen by the limit; neither ever admits more than the limit in any
//! window of `window_ms` while the limit stays put:
//!
//! - **exact log** (`limit ≤ EXACT_LOG_MAX`): the admitted requests of the last window as
//!   `(ts_ms, cost)` entries, merged when they share a millisecond. A request is admitted iff the
//!   costs of entries with `ts > now − window` plus its own cost fit in the limit. Each entry holds
//!   at least one token, so the log never exceeds `limit` entries: memory is bounded. The script
//!   keeps the log's sum beside it and reads only the entries that leave, so a call costs the
//!   same at any limit.
//! - **sub-window counters** (`limit > EXACT_LOG_MAX`): time cut into sub-windows of
//!   `sub_ms = ceil(window_ms / SUB_WINDOWS)` ms aligned to multiples of `sub_ms`, tokens counted
//!   per sub-window, and a request admitted iff the last `n = ceil((window_ms − 1) / sub_ms) + 1`
//!   sub-windows (the current one included) hold at most `limit − cost`. Any `window_ms` of time
//!   overlaps at most `n` sub-windows, and any `n` consecutive sub-windows hold at most `limit`
//!   (at the last admission among them, the check covered all of them), so **no window of
//!   `window_ms` ever holds more than `limit`**. The price is on the other side: a token counts
//!   from its admission for at least `window_ms` and at most `window_ms + 2·sub_ms − 2` ms, less
//!   than `window_ms / 64` more than the exact rule, and exactly `window_ms` when
//!   `window_ms ≤ SUB_WINDOWS` (one-ms sub-windows: the exact rule).
//!
//! **Limit changes.** A lower limit applies at once (the counted tokens stay counted). A higher
//! one is held back for one window: another region may have admitted, just before it gave up the
//! share, all it held, and those tokens count in every window up to `window_ms` later. The hold
//! is kept in two places, and the lower of the two limits applies:
//!
//! - with the **parameters** ([`HeldRaise`], fields `hlimit` / `huntil` of the parameters hash):
//!   new parameters above the ones they replace hold the replaced limit until `window_ms` after
//!   they were written ([`held_raise`]), whether or not the window has a state, so a region that
//!   has not decided within its state's idle lifetime still waits. These are the source of
//!   truth for every raise written as parameters: a window whose state enforced a lower limit
//!   takes the raise when the parameters' hold ends, not a window after it first sees it.
//! - in the **state** (`held_limit`, `raise_at_ms`) for the limits that change without new
//!   parameters (a fallback limit, a floor above the limit at a lease end, parameters stored
//!   without a hold): the window raises its limit only once a raise has stood for `window_ms`;
//!   a raise above a pending one restarts the wait, a limit at or below the held one cancels it.
//!
//! A window with neither takes the limit it is given.
//!
//! **Changed representation.** A switch between the two (the limit crossing `EXACT_LOG_MAX`),
//! a changed `window_ms` under counters, and the two-counter fields (`win_start_ms`, `cur`,
//! `prev`: a state of that layout, or what [`carry_over`] writes) are converted by counting
//! every token the old state still counts as admitted now: it errs toward denying, never toward
//! admitting more.
//!
//! Denied requests are not recorded: a client hammering a closed window does not extend it.
//! Time is whole milliseconds and, as for the bucket, a clock stepping back is clamped: the
//! request is judged at the latest time the window has seen.
//!
//! All values stay below 2^53 (`limit · window_ms ≤ MAX_WINDOW_PRODUCT`), so the script's
//! doubles are exact.

use serde::{Deserialize, Serialize};

pub use crate::bounds::{EXACT_LOG_MAX, MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT};
use crate::bucket::Decision;

/// The most sub-windows a window is cut into under counters (one more may be counted, see the
/// module doc): a token counts at most `2·ceil(window_ms / SUB_WINDOWS) − 2` ms longer than
/// the exact rule, under 1/64 of the window.
pub const SUB_WINDOWS: u64 = 128;

/// A sliding-window limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WindowParams {
    /// Tokens admitted in any window.
    pub limit: u64,
    /// Window length in ms (≥ 1).
    pub window_ms: u64,
}

/// Why window parameters are unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowParamsError {
    #[error("limit {limit} exceeds the maximum {MAX_WINDOW_LIMIT}")]
    Limit { limit: u64 },
    #[error("window {window_ms} ms is outside 1..={MAX_WINDOW_MS}")]
    Window { window_ms: u64 },
    #[error("limit {limit} over {window_ms} ms is too large to compute exactly")]
    Product { limit: u64, window_ms: u64 },
}

impl WindowParams {
    /// Checked constructor: the bounds `lua/sliding_window.lua` enforces too.
    pub fn new(limit: u64, window_ms: u64) -> Result<Self, WindowParamsError> {
        if limit > MAX_WINDOW_LIMIT {
            return Err(WindowParamsError::Limit { limit });
        }
        if window_ms == 0 || window_ms > MAX_WINDOW_MS {
            return Err(WindowParamsError::Window { window_ms });
        }
        if limit * window_ms > MAX_WINDOW_PRODUCT {
            return Err(WindowParamsError::Product { limit, window_ms });
        }
        Ok(Self { limit, window_ms })
    }

    /// Whether this limit uses the exact log.
    pub fn is_exact(&self) -> bool {
        self.limit <= EXACT_LOG_MAX
    }
}

/// A raise held with the parameters: `limit` applies instead of any higher one until
/// `until_ms` (the parameters' clock), whatever the window's state. A kept record whose
/// `until_ms` has passed still dates the raise, for a state that enforced a lower limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HeldRaise {
    /// The limit held (tokens).
    pub limit: u64,
    /// When the hold ends, in ms.
    pub until_ms: u64,
}

/// The hold to store with new parameters written at `now_ms` whose highest limit is
/// `new_limit` (the limit, or a lease's floor above it) over `window_ms`, replacing parameters
/// whose limit in force at `now_ms` is `old.0` with the hold `old.1` (`None`: nothing
/// replaced, no hold). A raise holds the replaced limit for `window_ms` (the lower held limit
/// when a hold is running, and the wait restarts); a limit at or below the held one cancels
/// the hold, any other keeps it. `lua/set_params.lua` computes exactly this.
pub fn held_raise(
    now_ms: u64,
    old: Option<(u64, Option<HeldRaise>)>,
    new_limit: u64,
    window_ms: u64,
) -> Option<HeldRaise> {
    let (old_limit, record) = old?;
    if new_limit > old_limit {
        let running = record.filter(|r| now_ms < r.until_ms);
        return Some(HeldRaise {
            limit: running.map_or(old_limit, |r| r.limit.min(old_limit)),
            until_ms: (now_ms + window_ms).min(crate::bounds::MAX_CAPACITY_UT),
        });
    }
    record.filter(|r| new_limit > r.limit)
}

/// The sub-windows of a window of `window_ms` under counters: their length in ms and how many
/// are counted, `(ceil(w / SUB_WINDOWS), ceil((w − 1) / sub_ms) + 1)` — the most sub-windows
/// any `w` ms of time overlaps (at most `SUB_WINDOWS + 1`).
pub fn sub_windows(window_ms: u64) -> (u64, u64) {
    let w = window_ms.max(1);
    let sub_ms = w.div_ceil(SUB_WINDOWS);
    (sub_ms, (w - 1).div_ceil(sub_ms) + 1)
}

/// The stored state of one window. A missing window is an empty one. Only the fields of one
/// representation are in use.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WindowState {
    /// Exact log: admitted `(ts_ms, cost)`, oldest first, distinct timestamps.
    pub log: Vec<(u64, u64)>,
    /// Counters: tokens per sub-window, sub-window `j` at `j % n` (empty: no counters).
    pub counts: Vec<u64>,
    /// Counters: the window length the sub-windows were cut for.
    pub counts_window_ms: u64,
    /// Counters: the newest sub-window (`ms / sub_ms`) the counts have been advanced to.
    pub sub: u64,
    /// Counters: the sum of `counts`.
    pub sum: u64,
    /// Counters: the sub-window of the latest admission.
    pub last_sub: u64,
    /// Two-counter layout, read only to convert it: start of its current fixed window.
    pub win_start_ms: u64,
    /// Two-counter layout: tokens in its current fixed window.
    pub cur: u64,
    /// Two-counter layout: tokens in its previous fixed window.
    pub prev: u64,
    /// The limit the window enforces (`None`: no decision yet; the limit given applies).
    pub held_limit: Option<u64>,
    /// A raise above `held_limit` waiting for `raise_at_ms` (0: none).
    pub raise_to: u64,
    /// When the pending raise applies (0: none).
    pub raise_at_ms: u64,
    /// The latest time this window has seen, in ms.
    pub ts_ms: u64,
}

impl WindowState {
    /// The tokens the counters still count at `now` (0 without counters).
    fn counted_by_counters(&self, now: u64) -> u64 {
        if self.counts.is_empty() || self.sum == 0 {
            return 0;
        }
        let (sub_ms, n) = sub_windows(self.counts_window_ms);
        let i = now / sub_ms;
        if i <= self.sub {
            return self.sum;
        }
        let expired: u64 = (self.sub + 1..=i.min(self.sub + n))
            .map(|j| self.counts[(j % n) as usize])
            .sum();
        self.sum - expired
    }

    /// The tokens the two-counter layout still counts at `now`, all of both counters while
    /// either may (an upper bound of its estimate).
    fn counted_by_two_counters(&self, now: u64, window_ms: u64) -> u64 {
        if now < self.win_start_ms + 2 * window_ms {
            self.cur + self.prev
        } else {
            0
        }
    }

    fn clear_counters(&mut self) {
        self.counts.clear();
        self.counts_window_ms = 0;
        self.sub = 0;
        self.sum = 0;
        self.last_sub = 0;
    }
}

/// The limit in force at `now` for a window whose parameters say `p.limit` with the hold
/// `held`, and when `p.limit` applies if it does not yet (0: it does), updating the state's
/// held limit and pending raise (see the module doc). A raise the parameters hold is dated by
/// them: the state's wait for it ends with their hold.
fn hold(now: u64, p: &WindowParams, held: Option<&HeldRaise>, s: &mut WindowState) -> (u64, u64) {
    let l = p.limit;
    let (cap, cap_until) = match held {
        Some(h) if now < h.until_ms && h.limit < l => (h.limit, h.until_ms),
        _ => (l, 0),
    };
    let (lim, raise_at) = match s.held_limit {
        Some(h) if l > h => {
            if s.raise_at_ms == 0 || l > s.raise_to {
                s.raise_at_ms = held.map_or(now + p.window_ms, |h| h.until_ms);
            }
            if now >= s.raise_at_ms {
                s.held_limit = Some(l);
                s.raise_to = 0;
                s.raise_at_ms = 0;
                (l, 0)
            } else {
                s.raise_to = l;
                (h, s.raise_at_ms)
            }
        }
        _ => {
            s.held_limit = Some(l);
            s.raise_to = 0;
            s.raise_at_ms = 0;
            (l, 0)
        }
    };
    (lim.min(cap), raise_at.max(cap_until))
}

/// Decides whether `cost` tokens may be spent at `now_ms`; returns the decision and the state to
/// store. Exactly what `lua/sliding_window.lua` computes. A `cost` of 0 is a peek: the decision
/// describes the window now and is always allowed (the caller stores nothing).
pub fn decide(
    now_ms: u64,
    params: &WindowParams,
    state: Option<&WindowState>,
    cost: u64,
) -> (Decision, WindowState) {
    decide_held(now_ms, params, None, state, cost)
}

/// [`decide`] for parameters stored with a hold ([`held_raise`]): `params.limit` applies no
/// higher than `held.limit` until `held.until_ms`.
pub fn decide_held(
    now_ms: u64,
    params: &WindowParams,
    held: Option<&HeldRaise>,
    state: Option<&WindowState>,
    cost: u64,
) -> (Decision, WindowState) {
    let now = state.map_or(now_ms, |s| now_ms.max(s.ts_ms));
    let mut s = state.cloned().unwrap_or_default();
    s.ts_ms = now;
    let w = params.window_ms;
    let (limit, raise_at) = hold(now, params, held, &mut s);
    // Tokens an old representation still counts, counted again as admitted now.
    let mut moved = s.counted_by_two_counters(now, w);
    s.win_start_ms = 0;
    s.cur = 0;
    s.prev = 0;
    if params.is_exact() {
        moved += s.counted_by_counters(now);
        s.clear_counters();
        s.log.retain(|&(ts, _)| ts + w > now);
        if moved > 0 {
            s.log.push((now, moved));
            merge_last(&mut s.log);
        }
        decide_exact(now, params, (limit, raise_at), s, cost)
    } else {
        moved += s
            .log
            .iter()
            .filter(|&&(ts, _)| ts + w > now)
            .map(|&(_, c)| c)
            .sum::<u64>();
        s.log.clear();
        if !s.counts.is_empty() && s.counts_window_ms != w {
            moved += s.counted_by_counters(now);
            s.clear_counters();
        }
        decide_counters(now, params, (limit, raise_at), s, cost, moved)
    }
}

/// A decision and the state to store.
type Outcome = (Decision, WindowState);

/// The wait until `cost` fits: the first time enough tokens have left for the limit in force
/// or, while a raise is pending, for the raised limit once it applies. `free_in(k)` is the
/// wait until `k` counted tokens have left (0 for k = 0). `None`: never.
fn retry_after(
    p: &WindowParams,
    (limit, raise_at): (u64, u64),
    now: u64,
    used: u64,
    cost: u64,
    free_in: impl Fn(u64) -> u64,
) -> Option<u64> {
    if cost > p.limit {
        return None;
    }
    let at_limit = (cost <= limit).then(|| free_in((used + cost).saturating_sub(limit)));
    let at_raise = (limit < p.limit && raise_at > 0)
        .then(|| (raise_at - now).max(free_in((used + cost).saturating_sub(p.limit))));
    match (at_limit, at_raise) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn decide_exact(
    now: u64,
    p: &WindowParams,
    (limit, raise_at): (u64, u64),
    mut s: WindowState,
    cost: u64,
) -> Outcome {
    let w = p.window_ms;
    let used: u64 = s.log.iter().map(|&(_, c)| c).sum();
    let allowed = cost == 0 || (cost <= limit && used + cost <= limit);
    let retry_after_ms = if allowed {
        if cost > 0 {
            s.log.push((now, cost));
            merge_last(&mut s.log);
        }
        Some(0)
    } else {
        let log = &s.log;
        let free_in = |need: u64| {
            if need == 0 {
                return 0;
            }
            let mut freed = 0;
            log.iter()
                .find_map(|&(ts, c)| {
                    freed += c;
                    (freed >= need).then(|| ts + w - now)
                })
                .unwrap_or(0)
        };
        retry_after(p, (limit, raise_at), now, used, cost, free_in)
    };
    let used_after: u64 = s.log.iter().map(|&(_, c)| c).sum();
    let reset_ms = s.log.last().map_or(0, |&(ts, _)| ts + w - now);
    let d = Decision {
        allowed,
        remaining: limit.saturating_sub(used_after),
        retry_after_ms,
        reset_ms: Some(reset_ms),
    };
    (d, s)
}

/// Merges the last two entries when they share a millisecond.
fn merge_last(log: &mut Vec<(u64, u64)>) {
    if log.len() >= 2 && log[log.len() - 2].0 == log[log.len() - 1].0 {
        let (_, c) = log.pop().unwrap_or_default();
        if let Some(last) = log.last_mut() {
            last.1 += c;
        }
    }
}

fn decide_counters(
    now: u64,
    p: &WindowParams,
    (limit, raise_at): (u64, u64),
    mut s: WindowState,
    cost: u64,
    moved: u64,
) -> Outcome {
    let (sub_ms, n) = sub_windows(p.window_ms);
    let i = now / sub_ms;
    if s.counts.is_empty() {
        s.counts = vec![0; n as usize];
        s.counts_window_ms = p.window_ms;
        s.sub = i;
    }
    // Advance to sub-window i: the sub-windows that leave the count are emptied.
    for j in s.sub + 1..=i.min(s.sub + n) {
        let k = (j % n) as usize;
        s.sum -= s.counts[k];
        s.counts[k] = 0;
    }
    s.sub = s.sub.max(i);
    let cur = (i % n) as usize;
    if moved > 0 {
        s.counts[cur] += moved;
        s.sum += moved;
        s.last_sub = i;
    }
    let used = s.sum;
    let allowed = cost == 0 || (cost <= limit && used + cost <= limit);
    let retry_after_ms = if allowed {
        if cost > 0 {
            s.counts[cur] += cost;
            s.sum += cost;
            s.last_sub = i;
        }
        Some(0)
    } else {
        let counts = &s.counts;
        let free_in = |need: u64| {
            if need == 0 {
                return 0;
            }
            let mut freed = 0;
            (i.saturating_sub(n - 1)..=i)
                .find_map(|j| {
                    freed += counts[(j % n) as usize];
                    (freed >= need).then(|| (j + n) * sub_ms - now)
                })
                .unwrap_or(0)
        };
        retry_after(p, (limit, raise_at), now, used, cost, free_in)
    };
    let reset_ms = if s.sum > 0 {
        (s.last_sub + n) * sub_ms - now
    } else {
        0
    };
    let d = Decision {
        allowed,
        remaining: limit.saturating_sub(s.sum),
        retry_after_ms,
        reset_ms: Some(reset_ms),
    };
    (d, s)
}

/// The state of a window of `new` parameters that replaces a window of `old` ones (a changed
/// policy, whose new version has a window of its own) at `now_ms`, when the new window has no
/// state yet: what the old window still counts stays counted, so a changed policy hands out no
/// fresh window. Two exact logs: the old log's entries the old window still counts and the new
/// one covers, as they are (and what sub-window counters count, as one entry now). Otherwise
/// the tokens the old window counts now (the log's sum at most the old limit, or the
/// two-counter estimate rounded up at most the old limit, plus all the counters count) are
/// recorded as admitted now: one log entry, or a two-counter state that the first decision
/// converts. `None` when nothing is counted. `lua/set_params.lua` computes exactly this.
pub fn carry_over(
    now_ms: u64,
    old: &WindowParams,
    old_state: &WindowState,
    new: &WindowParams,
) -> Option<WindowState> {
    let now = now_ms.max(old_state.ts_ms);
    let counted = old_state.counted_by_counters(now);
    if old.is_exact() && new.is_exact() {
        let mut log: Vec<(u64, u64)> = old_state
            .log
            .iter()
            .copied()
            .filter(|&(ts, _)| ts + old.window_ms > now && ts + new.window_ms > now)
            .collect();
        if counted > 0 {
            log.push((now, counted));
            merge_last(&mut log);
        }
        return (!log.is_empty()).then(|| WindowState {
            log,
            ts_ms: now,
            ..WindowState::default()
        });
    }
    let used = if old.is_exact() {
        let sum: u64 = old_state
            .log
            .iter()
            .filter(|&&(ts, _)| ts + old.window_ms > now)
            .map(|&(_, c)| c)
            .sum();
        sum.min(old.limit) + counted
    } else {
        two_counter_estimate(now, old, old_state) + counted
    };
    if used == 0 {
        return None;
    }
    Some(if new.is_exact() {
        WindowState {
            log: vec![(now, used)],
            ts_ms: now,
            ..WindowState::default()
        }
    } else {
        WindowState {
            win_start_ms: now - now % new.window_ms,
            cur: used,
            ts_ms: now,
            ..WindowState::default()
        }
    })
}

/// The two-counter layout's count at `now`: `prev·(w − offset)/w + cur` rounded up, at most
/// the limit.
fn two_counter_estimate(now: u64, p: &WindowParams, s: &WindowState) -> u64 {
    let w = p.window_ms;
    let start = now - now % w;
    let (cur, prev) = if s.win_start_ms == start {
        (s.cur, s.prev)
    } else if s.win_start_ms + w == start {
        (0, s.cur)
    } else {
        (0, 0)
    };
    let est = prev * (w - (now - start)) + cur * w;
    let cap = p.limit * w;
    p.limit - cap.saturating_sub(est) / w
}

/// Idle time after which a window may be forgotten: when it would be empty by then (the same
/// as `reset_ms` of its last decision) and no raise is pending.
pub fn idle_ttl_ms(params: &WindowParams, state: &WindowState) -> u64 {
    let now = state.ts_ms;
    let empty_in = if let Some(&(ts, _)) = state.log.last() {
        (ts + params.window_ms).saturating_sub(now)
    } else if state.sum > 0 {
        let (sub_ms, n) = sub_windows(state.counts_window_ms);
        ((state.last_sub + n) * sub_ms).saturating_sub(now)
    } else {
        0
    };
    empty_in.max(state.raise_at_ms.saturating_sub(now))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_window_keeps_what_it_counts() {
        let p = |limit, window_ms| WindowParams::new(limit, window_ms).unwrap();
        let mut s = None;
        for t in [0, 100, 200] {
            s = Some(decide(t, &p(5, 1000), s.as_ref(), 1).1);
        }
        let s = s.unwrap();
        // Exact to exact: the entries both windows cover, as they are.
        let c = carry_over(1050, &p(5, 1000), &s, &p(10, 900)).unwrap();
        assert_eq!(c.log, vec![(200, 1)]);
        let (d, _) = decide(1050, &p(10, 900), Some(&c), 0);
        assert_eq!(d.remaining, 9);
        // Exact to approximate: the 3 counted, in the current fixed window.
        let c = carry_over(500, &p(5, 1000), &s, &p(200, 1000)).unwrap();
        assert_eq!((c.win_start_ms, c.cur, c.prev), (0, 3, 0));
        // Counters to exact: what they count, one entry now.
        let big = p(200, 1000);
        let (_, a) = decide(900, &big, None, 150);
        let c = carry_over(1500, &big, &a, &p(100, 1000)).unwrap();
        assert_eq!(c.log, vec![(1500, 150)]);
        // The two-counter layout to exact: its estimate rounded up, at most its limit.
        let two = WindowState {
            win_start_ms: 1000,
            cur: 150,
            ts_ms: 1200,
            ..WindowState::default()
        };
        let c = carry_over(2500, &big, &two, &p(100, 1000)).unwrap();
        assert_eq!(c.log, vec![(2500, 75)]);
        // Nothing counted: nothing carried.
        assert_eq!(carry_over(5000, &p(5, 1000), &s, &p(5, 1000)), None);
    }

    fn run(p: &WindowParams, steps: &[(u64, u64)]) -> Vec<Decision> {
        let mut s: Option<WindowState> = None;
        steps
            .iter()
            .map(|&(now, cost)| {
                let (d, next) = decide(now, p, s.as_ref(), cost);
                s = Some(next);
                d
            })
            .collect()
    }

    #[test]
    fn exact_log_allows_n_in_any_window() {
        let p = WindowParams::new(3, 1000).unwrap();
        let d = run(
            &p,
            &[
                (0, 1),
                (0, 1),
                (500, 1),
                (999, 1),
                (1000, 1),
                (1001, 1),
                (1500, 1),
            ],
        );
        let allowed: Vec<bool> = d.iter().map(|d| d.allowed).collect();
        // Two at 0 leave the window at 1000; the one at 500 at 1500.
        assert_eq!(allowed, [true, true, true, false, true, true, true]);
        assert_eq!(d[3].retry_after_ms, Some(1));
        assert_eq!(d[3].remaining, 0);
        assert_eq!(d[2].reset_ms, Some(1000));
    }

    #[test]
    fn same_millisecond_requests_do_not_collide() {
        // Regression for the seed script that used the ms timestamp as the sorted-set member:
        // five requests in one millisecond must count five times.
        let p = WindowParams::new(5, 60_000).unwrap();
        let d = run(&p, &[(7, 1), (7, 1), (7, 1), (7, 1), (7, 1), (7, 1)]);
        assert_eq!(d.iter().filter(|d| d.allowed).count(), 5);
        let (_, s) = decide(7, &p, None, 2);
        let (_, s) = decide(7, &p, Some(&s), 2);
        assert_eq!(s.log, vec![(7, 4)]);
    }

    #[test]
    fn denied_flag_is_not_inverted_and_denials_are_not_recorded() {
        // Regression for the seed script that returned inverted flags.
        let p = WindowParams::new(1, 1000).unwrap();
        let d = run(&p, &[(0, 1), (10, 1), (20, 1), (1000, 1)]);
        assert_eq!(
            d.iter().map(|d| d.allowed).collect::<Vec<_>>(),
            [true, false, false, true]
        );
        assert_eq!(d[2].retry_after_ms, Some(980));
    }

    #[test]
    fn weighted_costs_free_enough_entries() {
        let p = WindowParams::new(10, 100).unwrap();
        let d = run(&p, &[(0, 4), (10, 4), (20, 2), (30, 7)]);
        assert!(!d[3].allowed);
        // Needs 7 with 0 free: the first two entries (8 tokens) must leave, at 110.
        assert_eq!(d[3].retry_after_ms, Some(80));
        assert_eq!(run(&p, &[(0, 11)])[0].retry_after_ms, None);
    }

    #[test]
    fn clock_stepping_back_is_clamped() {
        let p = WindowParams::new(1, 1000).unwrap();
        let (_, s) = decide(5000, &p, None, 1);
        let (d, s2) = decide(100, &p, Some(&s), 1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, Some(1000));
        assert_eq!(s2.ts_ms, 5000);
    }

    #[test]
    fn log_memory_is_bounded_by_the_limit() {
        let p = WindowParams::new(EXACT_LOG_MAX, 1_000_000).unwrap();
        let mut s = None;
        for t in 0..10_000 {
            let (_, next) = decide(t, &p, s.as_ref(), 1);
            assert!(next.log.len() as u64 <= EXACT_LOG_MAX);
            s = Some(next);
        }
    }

    #[test]
    fn sub_windows_cover_any_window() {
        // (window, sub-window length, sub-windows counted)
        for (w, sub_ms, n) in [
            (1, 1, 1),
            (128, 1, 128),
            (129, 2, 65),
            (1000, 8, 126),
            (900_000, 7032, 129),
            (MAX_WINDOW_MS, 20_925_000, 129),
        ] {
            assert_eq!(sub_windows(w), (sub_ms, n), "window {w}");
        }
    }

    #[test]
    fn counters_hold_a_token_between_one_window_and_a_sixty_fourth_more() {
        // 1000 per second: sub-windows of 8 ms, 126 counted. A token admitted at 1003 (sub-window
        // 125) counts until sub-window 251 begins, 2008: between 1000 and 1000 + 2·8 − 2 ms.
        let p = WindowParams::new(1000, 1000).unwrap();
        let d = run(&p, &[(1003, 1000), (2007, 1), (2008, 1)]);
        assert_eq!(
            d.iter().map(|d| d.allowed).collect::<Vec<_>>(),
            [true, false, true]
        );
        assert_eq!(d[1].retry_after_ms, Some(1));
        assert_eq!(d[0].reset_ms, Some(1005));
        assert_eq!(d[2].remaining, 999);
    }

    #[test]
    fn counters_never_exceed_the_limit_in_any_window() {
        let p = WindowParams::new(500, 1000).unwrap();
        let mut s = None;
        let mut admitted = Vec::new();
        for t in (0..20_000).step_by(7) {
            let (d, next) = decide(t, &p, s.as_ref(), 5);
            if d.allowed {
                admitted.push(t);
            }
            s = Some(next);
        }
        for &t in &admitted {
            let n = admitted.iter().filter(|&&u| u >= t && u < t + 1000).count() as u64 * 5;
            assert!(n <= p.limit, "{n} at {t}");
        }
        // Offered 5 every 7 ms, above the limit: it admits at least limit per w + 2·sub − 2.
        let total = admitted.len() as u64 * 5;
        assert!(total >= 20_000 * 500 / 1014 - 500, "{total}");
    }

    #[test]
    fn a_raise_waits_one_window_and_a_cut_applies_at_once() {
        let p = |limit| WindowParams::new(limit, 1000).unwrap();
        let (_, s) = decide(0, &p(2), None, 2);
        // Raised to 4 at 100: held at 2 until 1100, and the window is full until 1000.
        let (d, s) = decide(100, &p(4), Some(&s), 1);
        assert!(!d.allowed);
        assert_eq!((d.remaining, d.retry_after_ms), (0, Some(900)));
        assert_eq!(
            (s.held_limit, s.raise_to, s.raise_at_ms),
            (Some(2), 4, 1100)
        );
        let (d, s) = decide(1000, &p(4), Some(&s), 2);
        assert!(d.allowed);
        let (d, s) = decide(1050, &p(4), Some(&s), 1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, Some(50));
        let (d, s) = decide(1100, &p(4), Some(&s), 2);
        assert!(d.allowed);
        assert_eq!(s.held_limit, Some(4));
        // A cut applies at once: 4 counted, limit 3, nothing fits until two leave.
        let (d, s) = decide(1200, &p(3), Some(&s), 1);
        assert!(!d.allowed);
        assert_eq!((s.held_limit, s.raise_at_ms), (Some(3), 0));
        assert_eq!(d.retry_after_ms, Some(800));
    }

    #[test]
    fn a_higher_raise_restarts_the_wait() {
        let p = |limit| WindowParams::new(limit, 1000).unwrap();
        let (_, s) = decide(0, &p(1), None, 0);
        let (_, s) = decide(0, &p(2), Some(&s), 0);
        let (_, s) = decide(500, &p(3), Some(&s), 0);
        assert_eq!((s.raise_to, s.raise_at_ms), (3, 1500));
        // A lower pending raise keeps the wait.
        let (_, s) = decide(600, &p(2), Some(&s), 0);
        assert_eq!((s.raise_to, s.raise_at_ms), (2, 1500));
        let (d, s) = decide(1500, &p(2), Some(&s), 0);
        assert_eq!((d.remaining, s.held_limit), (2, Some(2)));
        assert_eq!(idle_ttl_ms(&p(2), &s), 0);
    }

    #[test]
    fn held_raise_holds_the_replaced_limit_for_a_window() {
        let h = |limit, until_ms| Some(HeldRaise { limit, until_ms });
        // (now, replaced limit and hold, new highest limit, window) -> hold stored
        for (now, old, new, w, want) in [
            (100, None, 9, 1000, None),
            (100, Some((2, None)), 4, 1000, h(2, 1100)),
            (100, Some((4, None)), 4, 1000, None),
            (100, Some((4, None)), 3, 1000, None),
            // A further raise during a hold restarts it, keeping the lower held limit.
            (500, Some((4, h(2, 1100))), 6, 1000, h(2, 1500)),
            // After the hold: the limit then in force is held.
            (1200, Some((4, h(2, 1100))), 6, 1000, h(4, 2200)),
            // A limit above the held one keeps the hold (also a passed one: it dates the
            // raise); at or below it cancels it.
            (600, Some((4, h(2, 1100))), 3, 1000, h(2, 1100)),
            (1600, Some((4, h(2, 1100))), 4, 1000, h(2, 1100)),
            (600, Some((4, h(2, 1100))), 2, 1000, None),
            // Malformed replaced parameters count as limit 0.
            (100, Some((0, None)), 5, 1000, h(0, 1100)),
            (
                crate::bounds::MAX_CAPACITY_UT - 5,
                Some((1, None)),
                2,
                1000,
                h(1, crate::bounds::MAX_CAPACITY_UT),
            ),
        ] {
            assert_eq!(held_raise(now, old, new, w), want, "{now} {old:?} {new}");
        }
    }

    #[test]
    fn a_held_raise_needs_no_state() {
        // Issue #36: a region without a window state gains share at 100 (2 -> 4). Another
        // region may have admitted its 2 just before: at most 2 until 1100, then 4.
        let p = WindowParams::new(4, 1000).unwrap();
        let held = HeldRaise {
            limit: 2,
            until_ms: 1100,
        };
        let (d, s) = decide_held(150, &p, Some(&held), None, 2);
        assert!(d.allowed);
        assert_eq!(d.remaining, 0);
        let (d, s) = decide_held(1000, &p, Some(&held), Some(&s), 1);
        assert!(!d.allowed);
        // The 2 at 150 leave at 1150; the raise to 4 applies at 1100 and then fits.
        assert_eq!(d.retry_after_ms, Some(100));
        let (d, _) = decide_held(1100, &p, Some(&held), Some(&s), 2);
        assert!(d.allowed);
        assert_eq!(d.remaining, 0);
        // A state that enforced 2 takes the raise when the parameters' hold ends, not a
        // window after it first sees it.
        let (_, s) = decide(50, &WindowParams::new(2, 1000).unwrap(), None, 1);
        let (d, s) = decide_held(600, &p, Some(&held), Some(&s), 1);
        assert_eq!((d.remaining, s.raise_at_ms), (0, 1100));
        let (d, s) = decide_held(1100, &p, Some(&held), Some(&s), 0);
        assert_eq!((d.remaining, s.held_limit), (3, Some(4)));
    }

    #[test]
    fn a_changed_representation_counts_everything_as_admitted_now() {
        let p = |limit| WindowParams::new(limit, 1000).unwrap();
        // Log to counters: 100 counted, recorded at 600 (never freed before 1600).
        let (_, s) = decide(0, &p(120), None, 100);
        let (d, s) = decide(600, &p(150), Some(&s), 60);
        assert!(!d.allowed);
        assert_eq!((s.sum, d.remaining), (100, 20));
        assert!(s.log.is_empty());
        // Counters to a log: one entry now.
        let (d, s) = decide(700, &p(120), Some(&s), 1);
        assert!(d.allowed);
        assert_eq!(s.log, vec![(700, 101)]);
        assert!(s.counts.is_empty());
        // The two-counter layout: both counters while either may count.
        let two = WindowState {
            win_start_ms: 1000,
            cur: 3,
            prev: 200,
            ts_ms: 1500,
            ..WindowState::default()
        };
        let (d, _) = decide(2999, &p(300), Some(&two), 0);
        assert_eq!(d.remaining, 97);
        let (d, _) = decide(3000, &p(300), Some(&two), 0);
        assert_eq!(d.remaining, 300);
        // Counters of another window length: counted now.
        let (_, s) = decide(0, &p(200), None, 50);
        let q = WindowParams::new(200, 500).unwrap();
        let (d, s) = decide(900, &q, Some(&s), 0);
        assert_eq!((d.remaining, s.counts_window_ms), (150, 500));
    }

    #[test]
    fn params_are_validated() {
        assert!(WindowParams::new(0, 1).is_ok());
        assert!(WindowParams::new(5, 0).is_err());
        assert!(WindowParams::new(5, MAX_WINDOW_MS + 1).is_err());
        assert!(WindowParams::new(MAX_WINDOW_LIMIT + 1, 1).is_err());
        assert!(WindowParams::new(MAX_WINDOW_LIMIT, MAX_WINDOW_MS).is_err());
    }

    #[test]
    fn idle_ttl_matches_reset() {
        let p = WindowParams::new(2, 1000).unwrap();
        let (d, s) = decide(300, &p, None, 1);
        assert_eq!(Some(idle_ttl_ms(&p, &s)), d.reset_ms);
        let q = WindowParams::new(200, 1000).unwrap();
        let (d, s) = decide(300, &q, None, 1);
        assert_eq!(Some(idle_ttl_ms(&q, &s)), d.reset_ms);
        let (d, s) = decide(300, &q, Some(&s), 0);
        assert_eq!(Some(idle_ttl_ms(&q, &s)), d.reset_ms);
    }
}
