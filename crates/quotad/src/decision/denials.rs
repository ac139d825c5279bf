//! The denial cache: a token bucket that denied a check with retry time R denies every check of
//! at least that cost until R has passed, so those are answered here without a Redis call.
//!
//! Exact for a token bucket: tokens come back only at the refill rate, and anyone else's
//! spending (other daemons on the same Redis, gateways running the script) only delays them.
//! So if `cost` tokens are not there before R, no check of cost ≥ `cost` can succeed before R.
//! Two things could make R wrong, and both void the entry:
//!
//! - the bucket's parameters change: an entry is keyed by the limit the check passed, and any
//!   parameter write by this region's agent drops every entry taken before it
//!   ([`Denials::forget_all`]), since the stored parameters decide over the passed limit;
//! - clocks: R is counted from Redis's `TIME`, the entry's end from this daemon's monotonic
//!   clock, started when the call was *sent* (at or before Redis's now) and cut by
//!   [`RATE_MARGIN`], so the entry ends no later than Redis would start admitting.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use quota_core::Decision;
use quota_store::{BucketRef, Limit};
use tokio::time::Instant;

/// Most buckets remembered at once: a flood over many buckets cannot grow the cache past this.
pub const MAX_ENTRIES: usize = 65_536;

/// The fraction of R an entry gives up, for clocks that run at slightly different rates (NTP
/// slews a wall clock by at most 500 ppm).
pub const RATE_MARGIN: f64 = 0.001;

/// Shortest retry time worth remembering: below it the next check would as well ask Redis.
const MIN_RETRY_MS: u64 = 2;

#[derive(Debug, Clone)]
struct Entry {
    limit: Limit,
    cost: u64,
    /// When the denial was sent for, and until when it stands.
    sent: Instant,
    until: Instant,
    decision: Decision,
}

/// Denials still standing, by bucket.
#[derive(Debug, Default)]
pub struct Denials {
    entries: Mutex<HashMap<BucketRef, Entry>>,
    /// Bumped by every parameter write: an answer to a call sent before it is not remembered.
    generation: AtomicU64,
}

/// What to remember a store call by: taken before the call is sent.
#[derive(Debug, Clone, Copy)]
pub struct Ticket {
    sent: Instant,
    generation: u64,
}

impl Denials {
    /// A denial still standing for a check of `bucket` at `limit` and `cost`, as the store
    /// would answer it at `now`: not allowed, its retry time counted down.
    pub fn answer(
        &self,
        bucket: &BucketRef,
        limit: &Limit,
        cost: u64,
        now: Instant,
    ) -> Option<Decision> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let e = entries.get(bucket)?;
        if e.limit != *limit || now >= e.until {
            entries.remove(bucket);
            return None;
        }
        if cost < e.cost {
            return None;
        }
        let gone = now.saturating_duration_since(e.sent).as_millis() as u64;
        let left = e.until.saturating_duration_since(now).as_millis() as u64;
        Some(Decision {
            allowed: false,
            remaining: e.decision.remaining,
            retry_after_ms: Some(left.max(1)),
            reset_ms: e.decision.reset_ms.map(|r| r.saturating_sub(gone)),
        })
    }

    /// A ticket for a store call about to be sent.
    pub fn ticket(&self, now: Instant) -> Ticket {
        Ticket {
            sent: now,
            generation: self.generation.load(Ordering::Acquire),
        }
    }

    /// Remembers the store's answer to a token-bucket check sent with `ticket`, if it is a
    /// denial with a retry time and no parameter write came between.
    pub fn remember(
        &self,
        ticket: Ticket,
        bucket: &BucketRef,
        limit: &Limit,
        cost: u64,
        d: &Decision,
    ) {
        let (false, Limit::TokenBucket(_), Some(retry_ms)) = (d.allowed, limit, d.retry_after_ms)
        else {
            return;
        };
        let standing_ms = (retry_ms as f64 * (1.0 - RATE_MARGIN)) as u64;
        if standing_ms < MIN_RETRY_MS {
            return;
        }
        let until = ticket.sent + Duration::from_millis(standing_ms);
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        // Checked under the lock that `forget_all` takes too: a write after this point drops
        // the entry, one before it is seen here.
        if self.generation.load(Ordering::Acquire) != ticket.generation {
            return;
        }
        if entries.len() >= MAX_ENTRIES && !entries.contains_key(bucket) {
            let now = Instant::now();
            entries.retain(|_, e| e.until > now);
            if entries.len() >= MAX_ENTRIES {
                return;
            }
        }
        entries.insert(
            bucket.clone(),
            Entry {
                limit: *limit,
                cost,
                sent: ticket.sent,
                until,
                decision: *d,
            },
        );
    }

    /// Drops every entry, and every answer still in flight: a bucket's stored parameters
    /// changed.
    pub fn forget_all(&self) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::AcqRel);
        entries.clear();
    }

    /// How many entries are held.
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use quota_core::bucket::BucketParams;
    use quota_core::{PolicyName, TenantId};

    use super::*;

    fn bucket() -> BucketRef {
        BucketRef {
            tenant: TenantId::new("t").unwrap(),
            policy: PolicyName::new("p").unwrap(),
            version: 1,
        }
    }

    fn limit(capacity: u64) -> Limit {
        let ut = capacity * quota_core::bucket::UT;
        Limit::TokenBucket(BucketParams::new(ut, ut).unwrap())
    }

    fn denial(retry_ms: u64) -> Decision {
        Decision {
            allowed: false,
            remaining: 0,
            retry_after_ms: Some(retry_ms),
            reset_ms: Some(5_000),
        }
    }

    #[test]
    fn a_denial_stands_for_its_retry_time_at_that_cost_or_more() {
        let d = Denials::default();
        let t0 = Instant::now();
        let (b, l) = (bucket(), limit(10));
        d.remember(d.ticket(t0), &b, &l, 2, &denial(1_000));
        let at = |ms| t0 + Duration::from_millis(ms);
        let a = d.answer(&b, &l, 2, at(400)).unwrap();
        assert!(!a.allowed);
        assert_eq!(a.retry_after_ms, Some(599));
        assert_eq!(a.reset_ms, Some(4_600));
        assert!(d.answer(&b, &l, 5, at(400)).is_some(), "a larger cost");
        assert!(
            d.answer(&b, &l, 1, at(400)).is_none(),
            "a smaller cost asks"
        );
        // R less the rate margin: 999 ms.
        assert!(d.answer(&b, &l, 2, at(998)).is_some());
        assert!(d.answer(&b, &l, 2, at(999)).is_none());
        assert!(d.is_empty(), "an entry past its time is dropped");
    }

    #[test]
    fn other_parameters_or_a_parameter_write_void_a_denial() {
        let d = Denials::default();
        let t0 = Instant::now();
        let b = bucket();
        d.remember(d.ticket(t0), &b, &limit(10), 1, &denial(1_000));
        assert!(d.answer(&b, &limit(20), 1, t0).is_none(), "a new share");
        d.remember(d.ticket(t0), &b, &limit(10), 1, &denial(1_000));
        d.forget_all();
        assert!(d.answer(&b, &limit(10), 1, t0).is_none());
        // An answer to a call sent before a write is not remembered.
        let ticket = d.ticket(t0);
        d.forget_all();
        d.remember(ticket, &b, &limit(10), 1, &denial(1_000));
        assert!(d.is_empty());
    }

    #[test]
    fn only_token_bucket_denials_with_a_retry_time_are_remembered() {
        let d = Denials::default();
        let t0 = Instant::now();
        let b = bucket();
        let window = Limit::SlidingWindow {
            limit: 5,
            window_ms: 1_000,
        };
        d.remember(d.ticket(t0), &b, &window, 1, &denial(500));
        let never = Decision {
            retry_after_ms: None,
            ..denial(0)
        };
        d.remember(d.ticket(t0), &b, &limit(10), 1, &never);
        let allowed = Decision {
            allowed: true,
            ..denial(0)
        };
        d.remember(d.ticket(t0), &b, &limit(10), 1, &allowed);
        d.remember(d.ticket(t0), &b, &limit(10), 1, &denial(1));
        assert!(d.is_empty());
    }

    #[test]
    fn the_cache_stays_bounded() {
        let d = Denials::default();
        let t0 = Instant::now();
        for i in 0..MAX_ENTRIES as u64 + 10 {
            let b = BucketRef {
                version: i,
                ..bucket()
            };
            d.remember(d.ticket(t0), &b, &limit(10), 1, &denial(60_000));
        }
        assert_eq!(d.len(), MAX_ENTRIES);
    }
}
