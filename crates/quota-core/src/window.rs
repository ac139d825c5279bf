//! The reference sliding window, "at most `limit` tokens in any `window_ms`": the exact
//! arithmetic `lua/sliding_window.lua` performs, for login attempts, password resets and other
//! small, abuse-sensitive limits.
//!
//! Two modes, chosen by the limit:
//!
//! - **exact log** (`limit ≤ EXACT_LOG_MAX`): the admitted requests of the last window as
//!   `(ts_ms, cost)` entries, merged when they share a millisecond. A request is admitted iff the
//!   costs of entries with `ts > now − window` plus its own cost fit in the limit. Each entry holds
//!   at least one token, so the log never exceeds `limit` entries: memory is bounded.
//! - **counter approximation** (`limit > EXACT_LOG_MAX`): two fixed windows aligned to
//!   multiples of `window_ms`, the previous one weighted by how much of it still overlaps the
//!   sliding window: `estimate = prev·(W − offset)/W + cur`. Constant memory; it may admit a
//!   little more or less than the exact rule when traffic within a window is uneven (the
//!   estimate assumes the previous window's admissions were spread evenly).
//!
//! Denied requests are not recorded: a client hammering a closed window does not extend it.
//! Time is whole milliseconds and, as for the bucket, a clock stepping back is clamped: the
//! request is judged at the latest time the window has seen. Switching mode (a limit change
//! across `EXACT_LOG_MAX`) starts the new mode empty.
//!
//! All values stay below 2^53 (`limit · window_ms ≤ MAX_WINDOW_PRODUCT`), so the script's
//! doubles are exact.

use serde::{Deserialize, Serialize};

pub use crate::bounds::{EXACT_LOG_MAX, MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT};
use crate::bucket::Decision;

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

/// The stored state of one window. A missing window is an empty one. Only the fields of the
/// current mode are non-zero.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WindowState {
    /// Exact mode: admitted `(ts_ms, cost)`, oldest first, distinct timestamps.
    pub log: Vec<(u64, u64)>,
    /// Approximate mode: start of the current fixed window (a multiple of `window_ms`).
    pub win_start_ms: u64,
    /// Approximate mode: tokens admitted in the current fixed window.
    pub cur: u64,
    /// Approximate mode: tokens admitted in the previous fixed window.
    pub prev: u64,
    /// The latest time this window has seen, in ms.
    pub ts_ms: u64,
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
    let now = state.map_or(now_ms, |s| now_ms.max(s.ts_ms));
    let mut s = state.cloned().unwrap_or_default();
    s.ts_ms = now;
    if params.is_exact() {
        s.win_start_ms = 0;
        s.cur = 0;
        s.prev = 0;
        decide_exact(now, params, s, cost)
    } else {
        s.log.clear();
        decide_approx(now, params, s, cost)
    }
}

/// A decision and the state to store.
type Outcome = (Decision, WindowState);

fn decide_exact(now: u64, p: &WindowParams, mut s: WindowState, cost: u64) -> Outcome {
    let w = p.window_ms;
    s.log.retain(|&(ts, _)| ts + w > now);
    let used: u64 = s.log.iter().map(|&(_, c)| c).sum();
    let allowed = cost == 0 || (cost <= p.limit && used + cost <= p.limit);
    let retry_after_ms = if allowed {
        if cost > 0 {
            s.log.push((now, cost));
            merge_last(&mut s.log);
        }
        Some(0)
    } else if cost > p.limit {
        None
    } else {
        let need = used + cost - p.limit;
        let mut freed = 0;
        s.log.iter().find_map(|&(ts, c)| {
            freed += c;
            (freed >= need).then(|| ts + w - now)
        })
    };
    let used_after: u64 = s.log.iter().map(|&(_, c)| c).sum();
    let reset_ms = s.log.last().map_or(0, |&(ts, _)| ts + w - now);
    let d = Decision {
        allowed,
        remaining: p.limit.saturating_sub(used_after),
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

fn decide_approx(now: u64, p: &WindowParams, mut s: WindowState, cost: u64) -> Outcome {
    let w = p.window_ms;
    let start = now - now % w;
    if s.win_start_ms + w == start {
        s.prev = s.cur;
        s.cur = 0;
    } else if s.win_start_ms != start {
        s.prev = 0;
        s.cur = 0;
    }
    s.win_start_ms = start;
    let off = now - start;
    let cap = p.limit * w;
    let allowed = cost == 0 || (cost <= p.limit && s.prev * (w - off) + (s.cur + cost) * w <= cap);
    let retry_after_ms = if allowed {
        s.cur += cost;
        Some(0)
    } else if cost > p.limit {
        None
    } else if s.cur + cost <= p.limit {
        // Wait until the previous window's weight has shrunk enough (prev > 0 here).
        let k = (p.limit - s.cur - cost) * w;
        Some(w - k / s.prev - off)
    } else {
        // Wait for the next fixed window, then for `cur` (as its previous) to fade enough.
        let k = (p.limit - cost) * w;
        Some((w - off) + w.saturating_sub(k / s.cur))
    };
    let est = s.prev * (w - off) + s.cur * w;
    let reset_ms = if s.cur > 0 {
        (w - off) + w
    } else if s.prev > 0 {
        w - off
    } else {
        0
    };
    let d = Decision {
        allowed,
        remaining: cap.saturating_sub(est) / w,
        retry_after_ms,
        reset_ms: Some(reset_ms),
    };
    (d, s)
}

/// The state of a window of `new` parameters that replaces a window of `old` ones (a changed
/// policy, whose new version has a window of its own) at `now_ms`, when the new window has no
/// state yet: what the old window still counts stays counted, so a changed policy hands out no
/// fresh window. Two exact logs: the old log's entries the old window still counts and the new
/// one covers, as they are. Otherwise the tokens the old window counts now (`limit − remaining`
/// of a peek: the log's sum, or the counters' estimate rounded up, at most the old limit) are
/// recorded as admitted now: one log entry, or the new current fixed window's counter. `None`
/// when nothing is counted. `lua/set_params.lua` computes exactly this.
pub fn carry_over(
    now_ms: u64,
    old: &WindowParams,
    old_state: &WindowState,
    new: &WindowParams,
) -> Option<WindowState> {
    let now = now_ms.max(old_state.ts_ms);
    if old.is_exact() && new.is_exact() {
        let log: Vec<(u64, u64)> = old_state
            .log
            .iter()
            .copied()
            .filter(|&(ts, _)| ts + old.window_ms > now && ts + new.window_ms > now)
            .collect();
        return (!log.is_empty()).then(|| WindowState {
            log,
            ts_ms: now,
            ..WindowState::default()
        });
    }
    let (peek, _) = decide(now, old, Some(old_state), 0);
    let used = old.limit - peek.remaining.min(old.limit);
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

/// Idle time after which a window may be forgotten because it would be empty by then (the
/// same as `reset_ms` of its last decision).
pub fn idle_ttl_ms(params: &WindowParams, state: &WindowState) -> u64 {
    let w = params.window_ms;
    let now = state.ts_ms;
    if params.is_exact() {
        state
            .log
            .last()
            .map_or(0, |&(ts, _)| (ts + w).saturating_sub(now))
    } else if state.cur > 0 {
        (state.win_start_ms + 2 * w).saturating_sub(now)
    } else if state.prev > 0 {
        (state.win_start_ms + w).saturating_sub(now)
    } else {
        0
    }
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
        // Approximate to exact: the estimate rounded up, one entry now.
        let big = p(200, 1000);
        let (_, a) = decide(900, &big, None, 150);
        let c = carry_over(1500, &big, &a, &p(100, 1000)).unwrap();
        assert_eq!(c.log, vec![(1500, 75)]);
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
    fn approximation_weights_the_previous_window() {
        let p = WindowParams::new(1000, 1000).unwrap();
        // 1000 admitted in [0, 1000); at 1250 the estimate is 750 so 250 more fit.
        let d = run(&p, &[(0, 1000), (1250, 250), (1250, 1)]);
        assert_eq!(
            d.iter().map(|d| d.allowed).collect::<Vec<_>>(),
            [true, true, false]
        );
        // Waiting 1 ms frees one more (1000·(1000−251)/1000 + 250 = 999).
        assert_eq!(d[2].retry_after_ms, Some(1));
        assert_eq!(d[2].reset_ms, Some(750 + 1000));
    }

    #[test]
    fn approximation_never_exceeds_twice_the_limit_in_any_window() {
        let p = WindowParams::new(500, 1000).unwrap();
        let mut s = None;
        let mut admitted = Vec::new();
        for t in (0..20_000).step_by(7) {
            let (d, next) = decide(t, &p, s.as_ref(), 3);
            if d.allowed {
                admitted.push(t);
            }
            s = Some(next);
        }
        for &t in &admitted {
            let n = admitted.iter().filter(|&&u| u >= t && u < t + 1000).count() as u64 * 3;
            assert!(n <= 2 * p.limit, "{n} at {t}");
        }
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
    }
}
