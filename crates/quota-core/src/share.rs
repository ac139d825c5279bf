//! What a region enforces of a policy at a share of its global budget.

use crate::bucket::BucketParams;
use crate::policy::{Algorithm, Policy, PPM};

/// The limit a region enforces at a share: the store's parameters for the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShareLimit {
    TokenBucket(BucketParams),
    /// At most `limit` tokens in any `window_ms`.
    SlidingWindow {
        limit: u64,
        window_ms: u64,
    },
    /// At most `limit` holds in flight at once (whole slots).
    Concurrency {
        limit: u64,
    },
}

/// The limit a region enforces for `policy` at `share_ppm`: a bucket of `s·C` refilling at
/// `s·r`, for a sliding window `s·limit` per window, for a concurrency limit `s·limit` slots
/// (both rounded down, so the regions' parts never sum above the limit). Shares above [`PPM`]
/// count as the whole budget.
pub fn limit_for_share(policy: &Policy, share_ppm: u32) -> ShareLimit {
    match policy.algorithm {
        Algorithm::TokenBucket => {
            ShareLimit::TokenBucket(BucketParams::for_share(policy, share_ppm))
        }
        Algorithm::SlidingWindow => ShareLimit::SlidingWindow {
            limit: part(policy.limit, share_ppm),
            window_ms: policy.window_ms,
        },
        Algorithm::Concurrency => ShareLimit::Concurrency {
            limit: part(policy.limit, share_ppm),
        },
    }
}

/// `share_ppm` of `whole` units, rounded down.
fn part(whole: u64, share_ppm: u32) -> u64 {
    (u128::from(whole) * u128::from(share_ppm.min(PPM)) / u128::from(PPM)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicySpec;

    fn policy(algorithm: Algorithm) -> Policy {
        PolicySpec {
            limit: 1000.0,
            window_ms: 60_000.0,
            algorithm: Some(algorithm),
            ..Default::default()
        }
        .validate()
        .unwrap()
    }

    #[test]
    fn a_token_bucket_share_is_the_share_of_the_global_bucket() {
        let p = policy(Algorithm::TokenBucket);
        assert_eq!(
            limit_for_share(&p, 250_000),
            ShareLimit::TokenBucket(BucketParams::for_share(&p, 250_000))
        );
        assert_eq!(
            limit_for_share(&p, PPM),
            ShareLimit::TokenBucket(BucketParams::global(&p))
        );
    }

    #[test]
    fn a_window_share_scales_the_limit_down_and_keeps_the_window() {
        let p = policy(Algorithm::SlidingWindow);
        let at = |share| limit_for_share(&p, share);
        assert_eq!(
            at(250_000),
            ShareLimit::SlidingWindow {
                limit: 250,
                window_ms: 60_000
            }
        );
        // 1000 · 0.0015 = 1.5 tokens: rounded down, never above the share.
        assert_eq!(
            at(1_500),
            ShareLimit::SlidingWindow {
                limit: 1,
                window_ms: 60_000
            }
        );
        assert_eq!(
            at(0),
            ShareLimit::SlidingWindow {
                limit: 0,
                window_ms: 60_000
            }
        );
    }

    #[test]
    fn a_concurrency_share_is_whole_slots_rounded_down() {
        let p = policy(Algorithm::Concurrency);
        assert_eq!(
            limit_for_share(&p, 333_333),
            ShareLimit::Concurrency { limit: 333 }
        );
        assert_eq!(
            limit_for_share(&p, 999),
            ShareLimit::Concurrency { limit: 0 }
        );
    }

    #[test]
    fn a_share_above_the_whole_counts_as_the_whole() {
        for algorithm in [
            Algorithm::TokenBucket,
            Algorithm::SlidingWindow,
            Algorithm::Concurrency,
        ] {
            let p = policy(algorithm);
            assert_eq!(limit_for_share(&p, PPM + 1), limit_for_share(&p, PPM));
            assert_eq!(limit_for_share(&p, u32::MAX), limit_for_share(&p, PPM));
        }
    }
}
