//! Nothing a policy `PUT` accepts fails at decision time: for every policy validation accepts
//! and every share, the region's bucket or window parameters are within the bounds the
//! reference code and the Lua scripts enforce, and its largest cost is one they take.

use proptest::prelude::*;
use quota_core::bounds::{MAX_BURST, MAX_HOLD_TTL_MS, MAX_WINDOW_MS, PPM};
use quota_core::policy::MAX_CONCURRENCY;
use quota_core::share::{limit_for_share, ShareLimit};
use quota_core::{window, Algorithm, BucketParams, PolicySpec, WindowParams};

fn spec() -> impl Strategy<Value = PolicySpec> {
    let limit = prop_oneof![
        1u64..=200,
        1u64..=2_000_000,
        1u64..=2_000_000_000,
        (MAX_BURST - 10)..=(MAX_BURST + 10),
    ];
    let window = prop_oneof![
        1u64..=1000,
        1u64..=MAX_WINDOW_MS + 10,
        (MAX_WINDOW_MS - 10)..=(MAX_WINDOW_MS + 10)
    ];
    let burst = prop_oneof![Just(None), (1u64..=MAX_BURST + 10).prop_map(Some)];
    let algorithm = prop_oneof![
        Just(Algorithm::TokenBucket),
        Just(Algorithm::SlidingWindow),
        Just(Algorithm::Concurrency)
    ];
    (limit, window, burst, algorithm).prop_map(|(l, w, b, a)| PolicySpec {
        limit: l as f64,
        window_ms: w as f64,
        burst: b.map(|b| b as f64),
        algorithm: Some(a),
        ..PolicySpec::default()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn every_accepted_policy_has_decidable_shares(s in spec(), share in 0u32..=PPM) {
        let Ok(policy) = s.validate() else { return Ok(()); };
        for share in [0, 1, 10_000, share, PPM] {
            match policy.algorithm {
                Algorithm::TokenBucket => {
                    let p = BucketParams::for_share(&policy, share);
                    prop_assert!(BucketParams::per_period(p.capacity_ut, p.refill_ut, p.period_ms).is_ok(), "{policy:?} at {share}: {p:?}");
                    // A nonzero share always refills, at exactly its part of the policy's rate.
                    prop_assert_eq!(p.refill_ut == 0, share == 0);
                    prop_assert_eq!(u128::from(p.refill_ut), u128::from(policy.limit) * u128::from(share));
                    prop_assert_eq!(p.period_ms, policy.window_ms);
                }
                Algorithm::SlidingWindow => {
                    let limit = policy.limit * u64::from(share) / u64::from(PPM);
                    let p = WindowParams::new(limit, policy.window_ms);
                    prop_assert!(p.is_ok(), "{policy:?} at {share}: {p:?}");
                    // The largest cost the policy allows is decided, not refused.
                    let (d, _) = window::decide(0, &p.unwrap(), None, policy.burst);
                    prop_assert!(d.retry_after_ms.is_none() || d.allowed || policy.burst <= limit);
                }
                Algorithm::Concurrency => {
                    // Whole slots, never above the limit, and a share's slots only.
                    let slots = match limit_for_share(&policy, share) {
                        ShareLimit::Concurrency { limit } => limit,
                        other => return Err(TestCaseError::fail(format!("{policy:?}: {other:?}"))),
                    };
                    prop_assert!(slots <= policy.limit && slots <= MAX_CONCURRENCY);
                    prop_assert_eq!(u128::from(slots), u128::from(policy.limit) * u128::from(share) / u128::from(PPM));
                    prop_assert!(policy.window_ms <= MAX_HOLD_TTL_MS && policy.burst == policy.limit);
                }
            }
            prop_assert!(policy.burst <= MAX_BURST);
        }
    }
}

#[test]
fn the_limits_users_write_first_are_accepted() {
    // One a month and 100 000 a month, in both algorithms.
    for algorithm in [Algorithm::TokenBucket, Algorithm::SlidingWindow] {
        for limit in [1.0, 100_000.0] {
            let s = PolicySpec {
                limit,
                window_ms: MAX_WINDOW_MS as f64,
                algorithm: Some(algorithm),
                ..PolicySpec::default()
            };
            assert!(s.validate().is_ok(), "{s:?}");
        }
    }
}
