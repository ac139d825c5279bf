//! A region's subject buckets, created on a subject's first check and forgotten once idle for
//! their TTL (at least the time to refill completely, as the script's keys expire), so memory
//! follows the active subjects, not all of them.

use std::collections::HashMap;

use quota_core::{bucket, BucketParams, BucketState};

#[derive(Debug, Clone, Copy)]
struct Live {
    state: BucketState,
    expires_at_ms: u64,
}

/// One region's buckets, keyed by subject.
#[derive(Debug, Default)]
pub struct Buckets {
    live: HashMap<u32, Live>,
    /// The most buckets alive at once, sampled at each [`Buckets::expire`].
    pub peak: usize,
}

impl Buckets {
    /// Decides one token for `subject` at `t_ms` against `params`. A missing bucket is full,
    /// at whatever parameters it is now read with.
    pub fn decide(&mut self, t_ms: u64, subject: u32, params: &BucketParams) -> bool {
        let state = self.live.get(&subject).map(|l| &l.state);
        let (d, s) = bucket::decide(t_ms, params, state, 1);
        let ttl = bucket::idle_ttl_ms(params, &s);
        self.live.insert(
            subject,
            Live {
                state: s,
                expires_at_ms: t_ms.saturating_add(ttl),
            },
        );
        d.allowed
    }

    /// Forgets the buckets idle past their TTL and returns how many are left.
    pub fn expire(&mut self, t_ms: u64) -> usize {
        self.live.retain(|_, l| l.expires_at_ms > t_ms);
        self.peak = self.peak.max(self.live.len());
        self.live.len()
    }
}

#[cfg(test)]
mod tests {
    use quota_core::PolicySpec;

    use super::*;

    #[test]
    fn a_bucket_lives_until_it_would_be_full_again() {
        let policy = PolicySpec {
            limit: 60.0,
            window_ms: 60_000.0,
            burst: Some(10.0),
            ..Default::default()
        }
        .validate()
        .unwrap();
        let p = BucketParams::global(&policy);
        let mut b = Buckets::default();
        assert!(b.decide(0, 7, &p));
        assert_eq!(b.expire(999), 1);
        // One token back after a second: full again, so forgotten.
        assert_eq!(b.expire(1_000), 0);
        assert_eq!(b.peak, 1);
    }
}
