//! The denial cache: a token bucket that will not admit a check of some cost for R ms answers
//! every check of at least that cost as a denial until R has passed, without a Redis call.
//!
//! Exact for a token bucket: tokens come back only at the refill rate, and anyone else's
//! spending (other daemons on the same Redis, gateways running the script) only delays them.
//! So if `cost` tokens are not there before R, no check of cost ≥ `cost` can succeed before R.
//! R comes from two answers of the store: a denial's retry time, and an admission that left
//! fewer than its cost ([`quota_core::bucket::next_admission_ms`]).
//!
//! A flood on such a bucket costs Redis one call per retry interval: when R is about to pass,
//! checks of that bucket wait for one probe (the first check at the expected time) instead of
//! each asking Redis, and take its answer, which is either the admission of the token that came
//! back (leaving another R) or a new denial.
//!
//! Clocks. R counts from Redis's now, which is its `TIME` cut to whole ms, so at most 1 ms
//! before the call reached Redis; the daemon measures from when the call was *sent* (before it
//! reached Redis) on its monotonic clock, and gives up [`RATE_MARGIN_PPM`] of R for clocks running
//! at slightly different rates. An entry therefore answers denials only until
//! `sent + (R − 1 ms)(1 − margin)`, which is never after Redis would admit; the probe goes at
//! `answered + R(1 + margin)`, which is never before (Redis's now was no later than the answer),
//! and checks that arrive in between wait for it, at most [`MAX_HOLD`].
//!
//! Two things could make R wrong, and both void the entry: the bucket's parameters change (an
//! entry is keyed by the limit the check passed, and any parameter write by this region's
//! agent drops every entry taken before it, [`Denials::forget_all`], since the stored
//! parameters decide over the passed limit), or a smaller cost (it is asked of Redis).
//!
//! A cached denial never reaches Redis, so the bucket's usage counters there do not see it.
//! It is demand all the same (a starved region under a flood must report the flood, not its
//! share), so its cost is counted here ([`Unreported`]) and drained with the usage report,
//! which adds it to the bucket's denied tokens.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quota_core::bucket::next_admission_ms;
use quota_core::Decision;
use quota_store::{BucketRef, Limit, UsageRecord};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Most buckets remembered at once: a flood over many buckets cannot grow the cache past this.
pub const MAX_ENTRIES: usize = 65_536;

/// Most buckets whose cached denials wait for a report at once. At the cap, denials of a
/// bucket not yet counted go unreported until the next report drains the counts (demand is
/// then under-reported, as if those checks had not come); buckets already counted keep
/// counting.
pub const MAX_UNREPORTED: usize = 65_536;

/// The part of R, in millionths, an entry gives up for clocks that run at slightly different
/// rates (NTP slews a wall clock by at most 500 ppm).
pub const RATE_MARGIN_PPM: u64 = 1_000;

/// Longest a check waits past the end of a standing denial for the probe. It covers the
/// whole-ms cut of Redis's time, a round trip and the rate margin of retry times up to about
/// two seconds; with longer ones the probe goes before the token is due, and its denial (a
/// short retry) leads to a second probe.
pub const MAX_HOLD: Duration = Duration::from_millis(5);

#[derive(Debug)]
struct Entry {
    limit: Limit,
    cost: u64,
    /// When the call that made the entry was sent: its times count down from here.
    sent: Instant,
    /// Checks are answered as denials before this.
    until: Instant,
    /// The probe goes at this time; checks that arrive between `until` and here wait for it.
    probe_at: Instant,
    /// When the bucket is expected to admit again, as Redis counts from the call's send: the
    /// retry time answered (the probe waits a little longer, for clocks).
    due: Instant,
    /// The store's answer: tokens left, and ms to full, at `sent`.
    remaining: u64,
    reset_ms: Option<u64>,
    /// A check is asking the store for this bucket; the others wait for `settled`.
    probing: bool,
    settled: Arc<Notify>,
}

/// Where a check stands against the cache, from [`Denials::look`].
#[derive(Debug)]
pub enum Look {
    /// Answered: a denial still stands.
    Denied(Decision),
    /// Look again at `until` (when the probe is due; `None`: when the probe settles), or when
    /// `settled` is notified, whichever comes first.
    Wait {
        until: Option<Instant>,
        settled: Arc<Notify>,
    },
    /// This check is the probe: ask the store, then [`Denials::remember`] the answer (or
    /// [`Denials::abandon`] the probe).
    Probe,
    /// Nothing stands for this check: ask the store.
    Ask,
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

impl Ticket {
    /// The same ticket for a call sent at `now`: a write since it was taken still counts.
    pub fn sent_at(self, now: Instant) -> Self {
        Self { sent: now, ..self }
    }
}

impl Denials {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<BucketRef, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where a check of `bucket` at `limit` and `cost` stands at `now`: a denial the store would
    /// answer too, a wait for the bucket's probe, the probe itself, or a call of its own.
    pub fn look(&self, bucket: &BucketRef, limit: &Limit, cost: u64, now: Instant) -> Look {
        let mut entries = self.lock();
        let Some(e) = entries.get_mut(bucket) else {
            return Look::Ask;
        };
        if e.limit != *limit {
            settle(&mut entries, bucket);
            return Look::Ask;
        }
        if cost < e.cost {
            return Look::Ask;
        }
        if now < e.until {
            let gone = now.saturating_duration_since(e.sent).as_millis() as u64;
            let left = e.due.saturating_duration_since(now);
            return Look::Denied(Decision {
                allowed: false,
                remaining: e.remaining,
                retry_after_ms: Some((left.as_micros().div_ceil(1000) as u64).max(1)),
                reset_ms: e.reset_ms.map(|r| r.saturating_sub(gone)),
            });
        }
        if e.probing {
            return Look::Wait {
                until: None,
                settled: e.settled.clone(),
            };
        }
        if now >= e.probe_at {
            e.probing = true;
            return Look::Probe;
        }
        Look::Wait {
            until: Some(e.probe_at),
            settled: e.settled.clone(),
        }
    }

    /// A ticket for a store call about to be sent.
    pub fn ticket(&self, now: Instant) -> Ticket {
        Ticket {
            sent: now,
            generation: self.generation.load(Ordering::Acquire),
        }
    }

    /// Remembers the store's answer `d`, received at `answered`, to a token-bucket check of
    /// `cost` sent with `ticket`: a denial with a retry time, or with `admissions` an admission
    /// that left less than the cost, stands until the bucket could admit that cost again (and
    /// replaces the bucket's entry, settling its probe). Returns false for any other answer
    /// (taking no lock) and for one to a call sent before a parameter write. `admissions` is
    /// false where tokens may be held in the daemon (a reservation pool), which the store's
    /// answer does not count.
    #[allow(clippy::too_many_arguments)]
    pub fn remember(
        &self,
        ticket: Ticket,
        bucket: &BucketRef,
        limit: &Limit,
        cost: u64,
        d: &Decision,
        answered: Instant,
        admissions: bool,
    ) -> bool {
        let wait_ms = match limit {
            Limit::TokenBucket(p) if !d.allowed || admissions => next_admission_ms(p, cost, d),
            _ => None,
        };
        let Some(wait_ms) = wait_ms.filter(|&w| w > 0) else {
            return false;
        };
        let mut entries = self.lock();
        // Checked under the lock that `forget_all` takes too: a write after this point drops
        // the entry, one before it is seen here.
        if self.generation.load(Ordering::Acquire) != ticket.generation {
            return false;
        }
        if entries.len() >= MAX_ENTRIES && !entries.contains_key(bucket) {
            entries.retain(|_, e| e.probing || e.until > answered);
            if entries.len() >= MAX_ENTRIES {
                return false;
            }
        }
        let until = ticket.sent + with_margin(wait_ms - 1, false);
        let probe_at = answered.max(ticket.sent) + with_margin(wait_ms, true);
        let entry = Entry {
            limit: *limit,
            cost,
            sent: ticket.sent,
            until,
            probe_at: probe_at.min(until + MAX_HOLD),
            due: ticket.sent + Duration::from_millis(wait_ms),
            remaining: d.remaining,
            reset_ms: d.reset_ms,
            probing: false,
            settled: Arc::new(Notify::new()),
        };
        if let Some(old) = entries.insert(bucket.clone(), entry) {
            old.settled.notify_waiters();
        }
        true
    }

    /// Ends a probe whose answer left no entry, or that got none (the store out, an error, the
    /// check dropped): the bucket's entry goes, and the checks waiting for the probe ask the
    /// store themselves.
    pub fn abandon(&self, bucket: &BucketRef) {
        let mut entries = self.lock();
        if entries.get(bucket).is_some_and(|e| e.probing) {
            settle(&mut entries, bucket);
        }
    }

    /// Drops every entry, and every answer still in flight: a bucket's stored parameters
    /// changed.
    pub fn forget_all(&self) {
        let mut entries = self.lock();
        self.generation.fetch_add(1, Ordering::AcqRel);
        for (_, e) in entries.drain() {
            e.settled.notify_waiters();
        }
    }

    /// Drops `bucket`'s entry: tokens came back to it (a refund), so its standing denial may
    /// no longer stand. A denial in flight may still be remembered after this: it stands until
    /// its retry time, a false denial at worst, never an admission.
    pub fn forget(&self, bucket: &BucketRef) {
        if let Some(e) = self.lock().remove(bucket) {
            e.settled.notify_waiters();
        }
    }

    /// How many entries are held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Tokens of checks the cache denied that no usage report has carried yet, by bucket: the
/// denied tokens Redis did not count. Keyed by the bucket as Redis keys its counters, so no
/// identity is kept that the store does not already hold (subjects arrive hashed).
#[derive(Debug, Default)]
pub struct Unreported {
    denied: Mutex<HashMap<BucketRef, u64>>,
}

impl Unreported {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<BucketRef, u64>> {
        self.denied.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a check of `cost` the cache denied. False when the map is full and `bucket` is
    /// not in it: that denial goes unreported.
    pub fn count(&self, bucket: &BucketRef, cost: u64) -> bool {
        let mut denied = self.lock();
        // Looked up before it is inserted: a flooded bucket's checks copy no key.
        if let Some(tokens) = denied.get_mut(bucket) {
            *tokens = tokens.saturating_add(cost);
            return true;
        }
        if denied.len() >= MAX_UNREPORTED {
            return false;
        }
        denied.insert(bucket.clone(), cost);
        true
    }

    /// Every count so far, as usage records of denied tokens, leaving none: each denial is
    /// handed to one report.
    pub fn take(&self) -> Vec<UsageRecord> {
        std::mem::take(&mut *self.lock())
            .into_iter()
            .map(|(bucket, denied)| UsageRecord {
                bucket,
                admitted: 0,
                denied,
            })
            .collect()
    }

    /// Puts back what [`Unreported::take`] handed to a report that was not delivered, added to
    /// what was counted since (within the cap, as [`Unreported::count`]).
    pub fn restore(&self, records: Vec<UsageRecord>) {
        for r in records.into_iter().filter(|r| r.denied > 0) {
            self.count(&r.bucket, r.denied);
        }
    }
}

/// Drops `bucket`'s entry and wakes the checks waiting on it.
fn settle(entries: &mut HashMap<BucketRef, Entry>, bucket: &BucketRef) {
    if let Some(e) = entries.remove(bucket) {
        e.settled.notify_waiters();
    }
}

/// `ms` less (or with `more`, plus) the rate margin, rounded to the microsecond towards the
/// safe side: earlier for the end of denials, later for the probe.
fn with_margin(ms: u64, more: bool) -> Duration {
    let us = ms.saturating_mul(1_000);
    let margin = us.saturating_mul(RATE_MARGIN_PPM).div_ceil(1_000_000);
    Duration::from_micros(if more {
        us.saturating_add(margin)
    } else {
        us - margin
    })
}

#[cfg(test)]
mod tests {
    use std::pin::pin;

    use quota_core::bucket::{BucketParams, UT};
    use quota_core::{PolicyName, TenantId};

    use super::*;

    fn bucket() -> BucketRef {
        BucketRef {
            tenant: TenantId::new("t").unwrap(),
            policy: PolicyName::new("p").unwrap(),
            version: 1,
        }
    }

    /// `capacity` tokens, refilling `capacity` a second.
    fn limit(capacity: u64) -> Limit {
        let ut = capacity * UT;
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

    fn us(t0: Instant, us: u64) -> Instant {
        t0 + Duration::from_micros(us)
    }

    fn denied(l: Look) -> Decision {
        match l {
            Look::Denied(d) => d,
            other => panic!("expected a denial, got {other:?}"),
        }
    }

    #[test]
    fn a_denial_stands_until_redis_could_admit_then_one_check_probes() {
        let d = Denials::default();
        let t0 = Instant::now();
        let (b, l) = (bucket(), limit(10));
        // Sent at t0, answered 1 ms later: retry 1 000 ms.
        d.remember(d.ticket(t0), &b, &l, 2, &denial(1_000), us(t0, 1_000), true);
        let a = denied(d.look(&b, &l, 2, us(t0, 400_000)));
        // Retry-After counts R from the send, as Redis would answer then.
        assert_eq!(a.retry_after_ms, Some(600));
        assert_eq!(a.reset_ms, Some(4_600));
        assert!(
            matches!(d.look(&b, &l, 5, us(t0, 400_000)), Look::Denied(_)),
            "a larger cost"
        );
        assert!(
            matches!(d.look(&b, &l, 1, us(t0, 400_000)), Look::Ask),
            "a smaller cost"
        );
        // Redis's now may be up to 1 ms before the call was sent: (R − 1 ms) less 0.1 %.
        denied(d.look(&b, &l, 2, us(t0, 998_000)));
        // Then the checks wait for the probe, due 1 ms + R + 0.1 % after the send.
        match d.look(&b, &l, 2, us(t0, 998_100)) {
            Look::Wait { until, .. } => assert_eq!(until, Some(us(t0, 1_002_000))),
            other => panic!("{other:?}"),
        }
        assert!(matches!(d.look(&b, &l, 2, us(t0, 1_002_000)), Look::Probe));
        assert!(
            matches!(
                d.look(&b, &l, 2, us(t0, 1_002_000)),
                Look::Wait { until: None, .. }
            ),
            "one probe at a time"
        );
    }

    /// A bucket denied for 100 ms at `t0`, at its probe's time: one check probes, a second
    /// waits on the returned notify.
    fn probing(d: &Denials, b: &BucketRef, l: &Limit, t0: Instant) -> (Instant, Arc<Notify>) {
        d.remember(d.ticket(t0), b, l, 1, &denial(100), t0, true);
        let probe_at = us(t0, 100_100);
        assert!(matches!(d.look(b, l, 1, probe_at), Look::Probe));
        let Look::Wait { settled, .. } = d.look(b, l, 1, probe_at) else {
            panic!("a second check waits");
        };
        (probe_at, settled)
    }

    #[tokio::test]
    async fn the_probes_answer_wakes_the_waiting_checks() {
        let d = Denials::default();
        let (b, l) = (bucket(), limit(10));
        let (probe_at, settled) = probing(&d, &b, &l, Instant::now());
        let mut woken = pin!(settled.notified());
        woken.as_mut().enable();
        // The probe is admitted and leaves nothing: 10 a second, the next token in 100 ms.
        let admitted = Decision {
            allowed: true,
            remaining: 0,
            retry_after_ms: Some(0),
            reset_ms: Some(1_000),
        };
        d.remember(d.ticket(probe_at), &b, &l, 1, &admitted, probe_at, true);
        assert!(tokio::time::timeout(Duration::ZERO, woken).await.is_ok());
        let a = denied(d.look(&b, &l, 1, probe_at + Duration::from_millis(50)));
        assert_eq!(a.remaining, 0);
        assert_eq!(a.retry_after_ms, Some(50), "due 100 ms after the probe");
    }

    #[tokio::test]
    async fn an_abandoned_probe_leaves_the_others_to_ask() {
        let d = Denials::default();
        let (b, l) = (bucket(), limit(10));
        let (probe_at, settled) = probing(&d, &b, &l, Instant::now());
        let mut woken = pin!(settled.notified());
        woken.as_mut().enable();
        d.abandon(&b);
        assert!(tokio::time::timeout(Duration::ZERO, woken).await.is_ok());
        assert!(matches!(d.look(&b, &l, 1, probe_at), Look::Ask));
    }

    #[test]
    fn an_admission_that_leaves_less_than_its_cost_stands_as_a_denial() {
        let d = Denials::default();
        let t0 = Instant::now();
        let (b, l) = (bucket(), limit(10));
        // 10 tokens, 10 a second, 3 left (700 ms to full): 5 are 200 ms away at the least.
        let admitted = Decision {
            allowed: true,
            remaining: 3,
            retry_after_ms: Some(0),
            reset_ms: Some(700),
        };
        d.remember(d.ticket(t0), &b, &l, 5, &admitted, t0, true);
        let a = denied(d.look(&b, &l, 5, us(t0, 100_000)));
        assert_eq!((a.remaining, a.reset_ms), (3, Some(600)));
        assert!(matches!(d.look(&b, &l, 3, us(t0, 100_000)), Look::Ask));
        // Not where the daemon may hold tokens of its own; not when enough is left.
        let d = Denials::default();
        assert!(!d.remember(d.ticket(t0), &b, &l, 5, &admitted, t0, false));
        assert!(!d.remember(d.ticket(t0), &b, &l, 3, &admitted, t0, true));
        assert!(d.is_empty());
    }

    #[test]
    fn other_parameters_or_a_parameter_write_void_a_denial() {
        let d = Denials::default();
        let t0 = Instant::now();
        let b = bucket();
        d.remember(d.ticket(t0), &b, &limit(10), 1, &denial(1_000), t0, true);
        assert!(
            matches!(d.look(&b, &limit(20), 1, t0), Look::Ask),
            "a new share"
        );
        assert!(d.is_empty());
        d.remember(d.ticket(t0), &b, &limit(10), 1, &denial(1_000), t0, true);
        d.forget_all();
        assert!(matches!(d.look(&b, &limit(10), 1, t0), Look::Ask));
        // An answer to a call sent before a write is not remembered.
        let ticket = d.ticket(t0);
        d.forget_all();
        assert!(!d.remember(ticket, &b, &limit(10), 1, &denial(1_000), t0, true));
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
        d.remember(d.ticket(t0), &b, &window, 1, &denial(500), t0, true);
        let never = Decision {
            retry_after_ms: None,
            ..denial(0)
        };
        d.remember(d.ticket(t0), &b, &limit(10), 1, &never, t0, true);
        assert!(d.is_empty());
        // A 1 ms retry answers no denial but holds the checks for its probe.
        d.remember(d.ticket(t0), &b, &limit(10), 1, &denial(1), t0, true);
        assert!(matches!(
            d.look(&b, &limit(10), 1, t0),
            Look::Wait { until: Some(_), .. }
        ));
    }

    fn drained(records: Vec<UsageRecord>) -> Vec<(u64, u64)> {
        let mut v: Vec<_> = records
            .into_iter()
            .map(|r| {
                assert_eq!(r.admitted, 0, "cached answers are denials");
                (r.bucket.version, r.denied)
            })
            .collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn cached_denials_are_drained_once() {
        let u = Unreported::default();
        let b2 = BucketRef {
            version: 2,
            ..bucket()
        };
        assert!(u.count(&bucket(), 3));
        assert!(u.count(&bucket(), 4));
        assert!(u.count(&b2, 1));
        assert_eq!(drained(u.take()), [(1, 7), (2, 1)]);
        assert!(u.take().is_empty(), "a second report carries nothing again");
        u.count(&bucket(), 5);
        assert_eq!(drained(u.take()), [(1, 5)], "only what came since");
    }

    #[test]
    fn an_undelivered_report_puts_its_denials_back() {
        let u = Unreported::default();
        u.count(&bucket(), 7);
        let taken = u.take();
        // Denied while the report was on its way.
        u.count(&bucket(), 2);
        u.restore(taken);
        assert_eq!(drained(u.take()), [(1, 9)], "nothing lost, nothing twice");
    }

    #[test]
    fn unreported_denials_stay_bounded() {
        let u = Unreported::default();
        let nth = |i: u64| BucketRef {
            version: i,
            ..bucket()
        };
        for i in 0..MAX_UNREPORTED as u64 {
            assert!(u.count(&nth(i), 1));
        }
        assert!(
            !u.count(&nth(MAX_UNREPORTED as u64), 1),
            "a new bucket at the cap"
        );
        assert!(u.count(&nth(0), 1), "a counted bucket keeps counting");
        let taken = u.take();
        assert_eq!(taken.len(), MAX_UNREPORTED);
        assert_eq!(
            taken.iter().map(|r| r.denied).sum::<u64>(),
            MAX_UNREPORTED as u64 + 1
        );
        // Drained, the map takes new buckets again; a restore stays within the cap.
        assert!(u.count(&nth(MAX_UNREPORTED as u64), 1));
        u.restore(taken);
        assert_eq!(u.lock().len(), MAX_UNREPORTED);
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
            d.remember(d.ticket(t0), &b, &limit(10), 1, &denial(60_000), t0, true);
        }
        assert_eq!(d.len(), MAX_ENTRIES);
    }
}
