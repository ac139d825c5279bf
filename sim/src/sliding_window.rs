//! The `sliding_window` table: "at most N in any W" policies split over the regions while
//! demand moves, decided by `quota_core::window` itself.
//!
//! Each policy's demand (cost 1, twice its limit per window on average) comes 80 % from one
//! busy region that moves every minute and 20 % spread over the others. The strategies differ
//! in the limit each region's window enforces: the whole N everywhere (`independent`), N split
//! evenly for ever (`static_split`), or shares of N that follow the demand of the last 30 s,
//! applied to each region's window at once when they change (`shares_at_once`) or as quotad's
//! window applies them, a raise only once it has stood for a window from when it was written
//! (`quotad`: the hold `set_params.lua` keeps with the parameters, `window::held_raise`). Share changes
//! reach every region at the same instant, which flatters `shares_at_once`: a real control
//! plane only adds delay. The measures: overshoot(W), the most tokens admitted worldwide in any
//! `[t, t + W)` divided by N (arbitrary windows, not only those ending at a request); goodput,
//! what was admitted divided by what one exact global window of N would have admitted.

use std::collections::VecDeque;
use std::fmt::Write as _;

use quota_core::window::{self, HeldRaise, WindowParams, WindowState};
use rand::Rng;
use serde::Serialize;

use crate::simulation::rng_for;

/// The policies: (limit, window ms, instances: subjects each held to the policy on their own).
/// Exact logs (5 per 15 minutes, 100 per second) and sub-window counters (1 000 per minute,
/// 5 000 per 10 s).
pub const POLICIES: [(u64, u64, usize); 4] = [
    (5, 900_000, 200),
    (100, 1000, 1),
    (1000, 60_000, 1),
    (5000, 10_000, 1),
];

/// How often the busy region moves, in ms.
const MOVE_MS: u64 = 60_000;

/// How often shares follow demand, in ms.
const REBALANCE_MS: u64 = 30_000;

/// The strategies, in table order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WindowStrategy {
    Independent,
    StaticSplit,
    SharesAtOnce,
    Quotad,
}

impl WindowStrategy {
    pub const ALL: [Self; 4] = [
        Self::Independent,
        Self::StaticSplit,
        Self::SharesAtOnce,
        Self::Quotad,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Independent => "independent",
            Self::StaticSplit => "static_split",
            Self::SharesAtOnce => "shares_at_once",
            Self::Quotad => "quotad",
        }
    }
}

/// One row: a policy under a strategy.
#[derive(Debug, Clone, Serialize)]
pub struct WindowRow {
    pub limit: u64,
    pub window_ms: u64,
    pub instances: usize,
    pub strategy: WindowStrategy,
    pub requests: u64,
    /// The most admitted in any window of `window_ms`, ÷ `limit` (the worst instance).
    pub overshoot_window: f64,
    /// Admitted ÷ what one exact global window admitted.
    pub goodput: f64,
}

/// Runs every policy under every strategy on the same arrivals.
pub fn run(seed: u64, regions: usize, duration_ms: u64) -> Vec<WindowRow> {
    let mut rows = Vec::new();
    for (i, &(limit, window_ms, instances)) in POLICIES.iter().enumerate() {
        let mut requests = 0;
        let mut ideal = 0;
        let mut admitted = [0u64; 4];
        let mut worst = [0u64; 4];
        for k in 0..instances {
            let label = format!("sliding_window {i} {k}");
            let arrivals = arrivals(seed, &label, regions, limit, window_ms, duration_ms);
            requests += arrivals.len() as u64;
            ideal += ideal_admitted(&arrivals, limit, window_ms);
            for (j, strategy) in WindowStrategy::ALL.into_iter().enumerate() {
                let times = decide(strategy, &arrivals, regions, limit, window_ms);
                admitted[j] += times.len() as u64;
                worst[j] = worst[j].max(max_in_any_window(&times, window_ms));
            }
        }
        for (j, strategy) in WindowStrategy::ALL.into_iter().enumerate() {
            rows.push(WindowRow {
                limit,
                window_ms,
                instances,
                strategy,
                requests,
                overshoot_window: worst[j] as f64 / limit as f64,
                goodput: admitted[j] as f64 / ideal.max(1) as f64,
            });
        }
    }
    rows
}

/// Arrival times (ms) and regions, in time order: twice the limit per window on average,
/// 80 % from the busy region.
fn arrivals(
    seed: u64,
    label: &str,
    regions: usize,
    limit: u64,
    window_ms: u64,
    duration_ms: u64,
) -> Vec<(u64, usize)> {
    let mut rng = rng_for(seed, label);
    let per_ms = 2.0 * limit as f64 / window_ms as f64;
    let mut out = Vec::new();
    let mut t = 0.0f64;
    loop {
        let u: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
        t += -u.ln() / per_ms;
        let ms = t as u64;
        if ms >= duration_ms {
            return out;
        }
        let busy = (ms / MOVE_MS) as usize % regions;
        let region = if regions == 1 || rng.random_bool(0.8) {
            busy
        } else {
            (busy + rng.random_range(1..regions)) % regions
        };
        out.push((ms, region));
    }
}

/// What one exact global window of `limit` admits of `arrivals`.
fn ideal_admitted(arrivals: &[(u64, usize)], limit: u64, window_ms: u64) -> u64 {
    let mut log = VecDeque::new();
    let mut admitted = 0;
    for &(t, _) in arrivals {
        while log.front().is_some_and(|&a| a + window_ms <= t) {
            log.pop_front();
        }
        if (log.len() as u64) < limit {
            log.push_back(t);
            admitted += 1;
        }
    }
    admitted
}

/// The admission times under `strategy`.
fn decide(
    strategy: WindowStrategy,
    arrivals: &[(u64, usize)],
    regions: usize,
    limit: u64,
    window_ms: u64,
) -> Vec<u64> {
    let even = split(limit, &vec![1; regions]);
    let mut limits = match strategy {
        WindowStrategy::Independent => vec![limit; regions],
        _ => even,
    };
    let follows = matches!(
        strategy,
        WindowStrategy::SharesAtOnce | WindowStrategy::Quotad
    );
    let mut states: Vec<Option<WindowState>> = vec![None; regions];
    // quotad: the raise each region's parameters hold, written with the shares.
    let mut holds: Vec<Option<HeldRaise>> = vec![None; regions];
    let mut demand = vec![0u64; regions];
    let mut next_rebalance = REBALANCE_MS;
    let mut admitted = Vec::new();
    for &(t, r) in arrivals {
        while follows && t >= next_rebalance {
            if demand.iter().sum::<u64>() > 0 {
                let shares = split(limit, &demand);
                if strategy == WindowStrategy::SharesAtOnce {
                    // The new limit applies at once: the window forgets the one it enforced.
                    for (s, (new, old)) in states.iter_mut().zip(shares.iter().zip(&limits)) {
                        if let Some(s) = s.as_mut().filter(|_| new != old) {
                            s.held_limit = None;
                            s.raise_to = 0;
                            s.raise_at_ms = 0;
                        }
                    }
                }
                if strategy == WindowStrategy::Quotad {
                    for (h, (new, old)) in holds.iter_mut().zip(shares.iter().zip(&limits)) {
                        *h = window::held_raise(next_rebalance, Some((*old, *h)), *new, window_ms);
                    }
                }
                limits = shares;
            }
            demand.iter_mut().for_each(|d| *d = 0);
            next_rebalance += REBALANCE_MS;
        }
        demand[r] += 1;
        let p = WindowParams::new(limits[r], window_ms).expect("policies within the bounds");
        let (d, s) = window::decide_held(t, &p, holds[r].as_ref(), states[r].as_ref(), 1);
        states[r] = Some(s);
        if d.allowed {
            admitted.push(t);
        }
    }
    admitted
}

/// `total` split in proportion to `weights` (largest remainders; sums to `total`).
fn split(total: u64, weights: &[u64]) -> Vec<u64> {
    let sum: u64 = weights.iter().sum::<u64>().max(1);
    let mut out: Vec<u64> = weights.iter().map(|&w| total * w / sum).collect();
    let mut rest: Vec<(u64, usize)> = weights
        .iter()
        .enumerate()
        .map(|(i, &w)| (total * w % sum, i))
        .collect();
    rest.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let left = total - out.iter().sum::<u64>();
    for &(_, i) in rest.iter().take(left as usize) {
        out[i] += 1;
    }
    out
}

/// The most of `times` (in order) in any `[t, t + w)`.
fn max_in_any_window(times: &[u64], w: u64) -> u64 {
    let (mut lo, mut max) = (0, 0);
    for (hi, &t) in times.iter().enumerate() {
        while times[lo] + w <= t {
            lo += 1;
        }
        max = max.max((hi + 1 - lo) as u64);
    }
    max
}

/// The table, in sim/README.md's markdown.
pub fn table(rows: &[WindowRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| policy | subjects | strategy | requests | over(W) | goodput |\n|---|---|---|---|---|---|"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "| {} per {} | {} | {} | {} | {:.3} | {:.3} |",
            r.limit,
            duration(r.window_ms),
            r.instances,
            r.strategy.name(),
            r.requests,
            r.overshoot_window,
            r.goodput
        );
    }
    out
}

fn duration(ms: u64) -> String {
    match ms {
        ms if ms % 60_000 == 0 => format!("{} min", ms / 60_000),
        ms if ms % 1000 == 0 => format!("{} s", ms / 1000),
        ms => format!("{ms} ms"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_sums_to_the_total() {
        assert_eq!(split(5, &[1, 1, 1]), [2, 2, 1]);
        assert_eq!(split(100, &[8, 1, 1]), [80, 10, 10]);
        assert_eq!(split(7, &[0, 0, 3]), [0, 0, 7]);
    }

    #[test]
    fn any_window_counts_windows_between_requests() {
        assert_eq!(max_in_any_window(&[0, 5, 10, 15], 10), 2);
        assert_eq!(max_in_any_window(&[0, 5, 9, 15], 10), 3);
    }
}
