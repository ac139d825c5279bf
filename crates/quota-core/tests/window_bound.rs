//! The sliding window's stated bound (`quota_core::window`): for random arrivals at several
//! limits, in both representations, no window of `window_ms` (anywhere, not only at decisions)
//! holds more than the limit, and a token never counts longer than `window_ms + 2·sub_ms − 2`.
//! Then two regions moving share back and forth: together they never admit more than the
//! budget in any window.

use proptest::prelude::*;
use proptest::test_runner::{RngSeed, TestRunner};
use quota_core::window::{self, WindowParams, WindowState};

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        rng_seed: RngSeed::Fixed(0x5EED_0036),
        source_file: Some(file!()),
        ..ProptestConfig::default()
    }
}

/// The most tokens of `admitted` (time, cost; in time order) in any `[t, t + w)`.
fn max_in_any_window(admitted: &[(u64, u64)], w: u64) -> u64 {
    let (mut lo, mut sum, mut max) = (0, 0, 0);
    for &(t, c) in admitted {
        sum += c;
        while admitted[lo].0 + w <= t {
            sum -= admitted[lo].1;
            lo += 1;
        }
        max = max.max(sum);
    }
    max
}

/// (limit, window) pairs: the exact log, just above it, a large limit, 5 per 15 minutes, and
/// windows of one ms and of a few ms (exact sub-windows).
fn params() -> impl Strategy<Value = WindowParams> {
    prop_oneof![
        Just((5, 900_000)),
        Just((100, 1000)),
        Just((128, 10_000)),
        Just((129, 10_000)),
        (129u64..=5000, 1u64..=200),
        (129u64..=100_000, 1000u64..=3_600_000),
        Just((1_000_000, 60_000)),
    ]
    .prop_map(|(l, w)| WindowParams::new(l, w).unwrap())
}

#[test]
fn no_window_holds_more_than_the_limit() {
    let mut runner = TestRunner::new(config(200));
    let strategy = (params(), any::<u64>(), 1u64..=4);
    let result = runner.run(&strategy, |(p, seed, burst)| {
        // Arrivals about `burst` times the limit's rate, in clumps, with costs up to a tenth of
        // the limit: busy enough that the limit binds.
        let mut rng = seed;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let max_cost = (p.limit / 10).max(1);
        let calls = 3000u64;
        let span = p.window_ms * 6;
        let mut times: Vec<u64> = (0..calls).map(|_| next() % span).collect();
        times.sort_unstable();
        let mut state: Option<WindowState> = None;
        let mut admitted = Vec::new();
        let mut offered = 0;
        for t in times {
            let cost = 1 + next() % max_cost * burst / 4;
            let (d, s) = window::decide(t, &p, state.as_ref(), cost);
            offered += cost;
            if d.allowed {
                admitted.push((t, cost));
            }
            state = Some(s);
        }
        let max = max_in_any_window(&admitted, p.window_ms);
        prop_assert!(max <= p.limit, "{max} in a window of {p:?}");
        // Never stricter than the exact rule over the longest a token may count.
        let (sub_ms, _) = window::sub_windows(p.window_ms);
        let longest = if p.is_exact() {
            p.window_ms
        } else {
            p.window_ms + 2 * sub_ms - 2
        };
        let spent: u64 = admitted.iter().map(|&(_, c)| c).sum();
        prop_assert!(spent > 0 || offered == 0);
        prop_assert!(
            spent * longest >= (span.saturating_sub(longest) * p.limit).min(offered * longest) / 2
                || offered * longest < span * p.limit,
            "admitted {spent} of {offered}"
        );
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Two regions share a budget; at random times share moves from one to the other (the loser's
/// limit falls, the gainer's rises, at the same instant). Both admit greedily. Together they
/// never hold more than the budget in any window: the raise waits one window.
#[test]
fn moving_share_never_admits_a_window_twice() {
    let mut runner = TestRunner::new(config(200));
    let strategy = (
        prop_oneof![
            Just((10u64, 1000u64)),
            Just((1000, 1000)),
            Just((6, 900_000))
        ],
        any::<u64>(),
    );
    let result = runner.run(&strategy, |((budget, w), seed)| {
        let mut rng = seed;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut share = budget / 2;
        let mut states: [Option<WindowState>; 2] = [None, None];
        let mut admitted = Vec::new();
        let step = (w / 50).max(1);
        for k in 0..2000u64 {
            let t = k * step;
            if next() % 40 == 0 {
                share = next() % (budget + 1);
            }
            for (r, state) in states.iter_mut().enumerate() {
                let limit = if r == 0 { share } else { budget - share };
                let p = WindowParams::new(limit, w).unwrap();
                let cost = 1 + next() % (budget / 20).max(1);
                let (d, s) = window::decide(t, &p, state.as_ref(), cost);
                if d.allowed {
                    admitted.push((t, cost));
                }
                *state = Some(s);
            }
        }
        let max = max_in_any_window(&admitted, w);
        prop_assert!(max <= budget, "{max} of {budget} in a window of {w} ms");
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// The other side of the hold: without it (each window given its new limit afresh), the same
/// moves admit more than the budget, so the test above can fail.
#[test]
fn without_the_hold_a_move_admits_a_window_twice() {
    let w = 1000;
    let p = |limit| WindowParams::new(limit, w).unwrap();
    // Region A spends its 5 at 900, then hands them to B at 950.
    let (a, _) = window::decide(900, &p(5), None, 5);
    assert!(a.allowed);
    let (_, b) = window::decide(0, &p(5), None, 5);
    // B with a fresh state (no memory of its limit) takes all 10 at once...
    let fresh = WindowState {
        held_limit: None,
        ..b.clone()
    };
    let (d, _) = window::decide(1000, &p(10), Some(&fresh), 10);
    assert!(
        d.allowed,
        "a window without a held limit takes the limit given"
    );
    // ...while the held limit admits only B's old 5 until the raise has stood a window.
    let (d, s) = window::decide(1000, &p(10), Some(&b), 10);
    assert!(!d.allowed);
    assert_eq!(d.retry_after_ms, Some(1000));
    let (d, _) = window::decide(1000, &p(10), Some(&s), 5);
    assert!(d.allowed);
}
