//! Reservations: a hot token bucket's tokens taken from the regional Redis in batches and
//! handed out here, so a bucket with sustained demand costs Redis a call per batch, not one
//! per decision ([`quota_core::reservation`] sizes the batches and holds the pools).
//!
//! Why it keeps the guarantees: every token handed out was spent in Redis first, by the same
//! script every daemon and gateway on that Redis runs, so a region never admits more than its
//! Redis bucket grants, however many daemons share it. What changes is when tokens are spent:
//! up to one batch (at most 1 % of the bucket's capacity) ahead of its checks. What is not
//! handed out goes back ([`Store::refund`], never above the capacity) when the pool ages out,
//! when the limit checks pass changes (a new share, the lease lapsing to the floor), when the
//! agent writes new parameters, and on shutdown. A pool whose refund fails (Redis down) is lost:
//! those tokens stay spent, which admits less, never more.
//!
//! One batch per bucket is in flight at a time: checks that find the pool empty while a batch
//! is being taken wait for it (bounded by the store's timeout) rather than each calling Redis.

use std::collections::HashMap;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use quota_core::reservation::{Pool, Sizer};
use quota_core::Decision;
use quota_store::{BucketRef, Limit};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::{timeout, Instant};

/// Most buckets tracked at once; a bucket idle for [`IDLE_MS`] is forgotten by the sweep.
pub const MAX_SLOTS: usize = 65_536;

/// A bucket seen no check for this long is forgotten (its pool, if any, given back first).
const IDLE_MS: u64 = 2_000;

/// Rounds of waiting for another check's batch before a check asks the store itself.
const MAX_WAITS: usize = 3;

#[derive(Debug)]
struct Slot {
    /// The limit the pool was taken at and checks were counted for.
    limit: Limit,
    sizer: Sizer,
    pool: Option<Pool>,
    /// The store's answer to the call that filled the pool, for the responses it answers.
    at_take: Decision,
    /// A batch is being taken: waiters are woken through `filled`.
    in_flight: bool,
    filled: Arc<Notify>,
    seen_ms: u64,
}

/// Tokens to give back to a bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refund {
    pub bucket: BucketRef,
    pub tokens: u64,
}

/// What a check should do, from [`Reservations::begin`].
#[derive(Debug)]
pub enum Step {
    /// Answered from the pool.
    Answered(Decision),
    /// Take a batch of this many multiples of the cost (the caller then calls
    /// [`Reservations::filled`]).
    Take(u64),
    /// Decide it as a single check (cold or small bucket, or no batch came in time).
    Single,
}

/// Every bucket's pool and demand, in this daemon.
#[derive(Debug)]
pub struct Reservations {
    slots: Mutex<HashMap<BucketRef, Slot>>,
    /// Bumped by parameter writes: a batch taken before one goes back instead of into a pool.
    generation: AtomicU64,
    base: Instant,
}

impl Default for Reservations {
    fn default() -> Self {
        Self {
            slots: Mutex::default(),
            generation: AtomicU64::new(0),
            base: Instant::now(),
        }
    }
}

/// A batch being taken, from [`Step::Take`].
#[derive(Debug, Clone, Copy)]
pub struct Taking {
    generation: u64,
    ms: u64,
}

impl Reservations {
    fn ms(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.base).as_millis() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<BucketRef, Slot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where a token-bucket check of `cost` on `bucket` at `limit` stands: answered from the
    /// pool, a batch to take, or a single check. Pushes onto `refunds` a pool that can no
    /// longer be used (its limit changed, or it aged out). Waits while another check takes a
    /// batch for this bucket.
    pub async fn begin(
        &self,
        bucket: &BucketRef,
        limit: &Limit,
        cost: u64,
        now: Instant,
        wait_at_most: Duration,
        refunds: &mut Vec<Refund>,
    ) -> (Step, Taking) {
        let Limit::TokenBucket(params) = *limit else {
            return (Step::Single, self.taking(now));
        };
        for _ in 0..MAX_WAITS {
            let notify = {
                let ms = self.ms(Instant::now().max(now));
                let mut slots = self.lock();
                // Looked up before it is inserted: a hot bucket's checks copy no key.
                if !slots.contains_key(bucket) {
                    if slots.len() >= MAX_SLOTS {
                        return (Step::Single, self.taking(now));
                    }
                    slots.insert(
                        bucket.clone(),
                        Slot {
                            limit: *limit,
                            sizer: Sizer::new(ms),
                            pool: None,
                            at_take: Decision {
                                allowed: true,
                                remaining: 0,
                                retry_after_ms: Some(0),
                                reset_ms: Some(0),
                            },
                            in_flight: false,
                            filled: Arc::new(Notify::new()),
                            seen_ms: ms,
                        },
                    );
                }
                let Some(slot) = slots.get_mut(bucket) else {
                    return (Step::Single, self.taking(now));
                };
                slot.seen_ms = ms;
                if slot.limit != *limit {
                    give_back(bucket, slot.pool.take(), refunds);
                    slot.limit = *limit;
                }
                if let Some(pool) = slot.pool.as_mut() {
                    if pool.take(ms, cost) {
                        slot.sizer.observe(ms, cost);
                        let d = answer(&slot.at_take, pool.tokens);
                        return (Step::Answered(d), self.taking(now));
                    }
                    if pool.expired(ms) {
                        give_back(bucket, slot.pool.take(), refunds);
                    }
                }
                if slot.in_flight {
                    slot.filled.clone()
                } else {
                    slot.sizer.observe(ms, cost);
                    let k = slot.sizer.batch(ms, cost, params.capacity_ut);
                    if k < 2 {
                        return (Step::Single, self.taking(now));
                    }
                    slot.in_flight = true;
                    return (Step::Take(k), self.taking(now));
                }
            };
            // Enabled, then the flag read again: a batch that ends in between is seen by the
            // read, one that ends after wakes the waiter.
            let mut wait = pin!(notify.notified());
            wait.as_mut().enable();
            if self.in_flight(bucket) && timeout(wait_at_most, wait).await.is_err() {
                break;
            }
        }
        (Step::Single, self.taking(now))
    }

    fn in_flight(&self, bucket: &BucketRef) -> bool {
        self.lock().get(bucket).is_some_and(|s| s.in_flight)
    }

    fn taking(&self, now: Instant) -> Taking {
        Taking {
            generation: self.generation.load(Ordering::Acquire),
            ms: self.ms(now),
        }
    }

    /// Ends a batch taken with `taking`: the store answered `d` and spent `granted` multiples
    /// of `cost`, one of them for this check (0 when it denied). The rest goes into the pool,
    /// or onto `refunds` when the limit changed or parameters were written meanwhile. Returns
    /// the decision for this check, counting the pool in what is left.
    pub fn filled(
        &self,
        bucket: &BucketRef,
        limit: &Limit,
        cost: u64,
        taking: Taking,
        (d, granted): (Decision, u64),
        refunds: &mut Vec<Refund>,
    ) -> Decision {
        let surplus = granted.saturating_sub(1).saturating_mul(cost);
        let current = self.generation.load(Ordering::Acquire) == taking.generation;
        let mut slots = self.lock();
        let Some(slot) = slots.get_mut(bucket) else {
            give_back(bucket, Some(pool(surplus, taking.ms)), refunds);
            return d;
        };
        slot.in_flight = false;
        slot.filled.notify_waiters();
        if slot.limit != *limit || !current {
            give_back(bucket, Some(pool(surplus, taking.ms)), refunds);
            return d;
        }
        if !d.allowed {
            return d;
        }
        if surplus > 0 {
            let held = slot.pool.map_or(0, |p| p.tokens);
            slot.pool = Some(pool(held + surplus, taking.ms));
            slot.at_take = d;
        }
        answer(&d, slot.pool.map_or(0, |p| p.tokens))
    }

    /// Ends a batch that was not taken (the store failed or the call was not made).
    pub fn abandon(&self, bucket: &BucketRef) {
        if let Some(slot) = self.lock().get_mut(bucket) {
            slot.in_flight = false;
            slot.filled.notify_waiters();
        }
    }

    /// Whether no tokens of `bucket` are held here or being taken: the store's level is all
    /// there is.
    pub fn idle(&self, bucket: &BucketRef) -> bool {
        self.lock()
            .get(bucket)
            .is_none_or(|s| !s.in_flight && s.pool.is_none_or(|p| p.tokens == 0))
    }

    /// Whole tokens of `bucket` held here, for reads of its level.
    pub fn held(&self, bucket: &BucketRef) -> u64 {
        self.lock()
            .get(bucket)
            .and_then(|s| s.pool)
            .map_or(0, |p| p.tokens)
    }

    /// Every pool, to give back: parameters were written (or the daemon stops). Batches in
    /// flight go back when they arrive.
    pub fn take_all(&self) -> Vec<Refund> {
        let mut slots = self.lock();
        self.generation.fetch_add(1, Ordering::AcqRel);
        let mut out = Vec::new();
        for (bucket, slot) in slots.iter_mut() {
            give_back(bucket, slot.pool.take(), &mut out);
        }
        out
    }

    /// Pools that aged out, to give back, and buckets idle for long forgotten.
    pub fn sweep(&self, now: Instant) -> Vec<Refund> {
        let ms = self.ms(now);
        let mut out = Vec::new();
        self.lock().retain(|bucket, slot| {
            if slot.pool.is_some_and(|p| p.expired(ms)) {
                give_back(bucket, slot.pool.take(), &mut out);
            }
            slot.in_flight || slot.pool.is_some() || ms.saturating_sub(slot.seen_ms) < IDLE_MS
        });
        out
    }

    /// Buckets tracked, for tests.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when no bucket is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn pool(tokens: u64, taken_ms: u64) -> Pool {
    Pool { tokens, taken_ms }
}

fn give_back(bucket: &BucketRef, pool: Option<Pool>, out: &mut Vec<Refund>) {
    if let Some(p) = pool.filter(|p| p.tokens > 0) {
        out.push(Refund {
            bucket: bucket.clone(),
            tokens: p.tokens,
        });
    }
}

/// An admission from the pool: what the store kept at the batch plus what is held here.
fn answer(at_take: &Decision, held: u64) -> Decision {
    Decision {
        allowed: true,
        remaining: at_take.remaining.saturating_add(held),
        retry_after_ms: Some(0),
        reset_ms: at_take.reset_ms,
    }
}

#[cfg(test)]
mod tests {
    use quota_core::bucket::{BucketParams, UT};
    use quota_core::reservation::{MAX_AGE_MS, MIN_OBSERVED_MS};
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
        Limit::TokenBucket(BucketParams::new(capacity * UT, capacity * UT).unwrap())
    }

    fn admitted(remaining: u64) -> Decision {
        Decision {
            allowed: true,
            remaining,
            retry_after_ms: Some(0),
            reset_ms: Some(10),
        }
    }

    const WAIT: Duration = Duration::from_millis(100);

    /// Checks of cost 1 at 1 per ms, each decided singly, until the next one shows the
    /// demand a bucket must show before it gets batches.
    async fn warm_up(r: &Reservations, l: &Limit) {
        let mut refunds = Vec::new();
        for _ in 0..MIN_OBSERVED_MS - 1 {
            let (step, _) = r
                .begin(&bucket(), l, 1, Instant::now(), WAIT, &mut refunds)
                .await;
            assert!(matches!(step, Step::Single), "{step:?}");
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        assert!(refunds.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_hot_bucket_is_answered_from_its_batch_and_gives_back_the_rest() {
        let r = Reservations::default();
        let l = limit(100_000);
        warm_up(&r, &l).await;
        let mut refunds = Vec::new();
        // 1 000 a second: 50 ms of it is a batch of 50.
        let (step, taking) = r
            .begin(&bucket(), &l, 1, Instant::now(), WAIT, &mut refunds)
            .await;
        let Step::Take(k) = step else {
            panic!("{step:?}")
        };
        assert_eq!(k, 50);
        let d = r.filled(&bucket(), &l, 1, taking, (admitted(900), k), &mut refunds);
        assert_eq!((d.allowed, d.remaining), (true, 900 + 49));
        assert_eq!(r.held(&bucket()), 49);
        for i in 0..49 {
            let (step, _) = r
                .begin(&bucket(), &l, 1, Instant::now(), WAIT, &mut refunds)
                .await;
            let Step::Answered(d) = step else {
                panic!("{i}: {step:?}")
            };
            assert_eq!(d.remaining, 900 + 48 - i);
        }
        assert_eq!(r.held(&bucket()), 0);
        // A new share: what is held goes back before anything else.
        let (step, taking) = r
            .begin(&bucket(), &l, 1, Instant::now(), WAIT, &mut refunds)
            .await;
        assert!(matches!(step, Step::Take(_)));
        r.filled(&bucket(), &l, 1, taking, (admitted(800), 10), &mut refunds);
        let smaller = limit(50_000);
        let (_, _) = r
            .begin(&bucket(), &smaller, 1, Instant::now(), WAIT, &mut refunds)
            .await;
        assert_eq!(
            refunds,
            vec![Refund {
                bucket: bucket(),
                tokens: 9
            }]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn pools_age_out_and_parameter_writes_take_them_back() {
        let r = Reservations::default();
        let l = limit(100_000);
        warm_up(&r, &l).await;
        let mut refunds = Vec::new();
        let (_, taking) = r
            .begin(&bucket(), &l, 2, Instant::now(), WAIT, &mut refunds)
            .await;
        r.filled(&bucket(), &l, 2, taking, (admitted(500), 20), &mut refunds);
        assert_eq!(r.held(&bucket()), 38);
        assert!(r.sweep(Instant::now()).is_empty());
        tokio::time::advance(Duration::from_millis(MAX_AGE_MS)).await;
        assert_eq!(
            r.sweep(Instant::now()),
            vec![Refund {
                bucket: bucket(),
                tokens: 38
            }]
        );
        // Demand stopped, so batches start again only once it is back. A batch that comes
        // back after a parameter write goes back whole, past the pool.
        let taking = loop {
            let (step, taking) = r
                .begin(&bucket(), &l, 2, Instant::now(), WAIT, &mut refunds)
                .await;
            if let Step::Take(_) = step {
                break taking;
            }
            tokio::time::advance(Duration::from_millis(1)).await;
        };
        assert!(r.take_all().is_empty());
        let d = r.filled(&bucket(), &l, 2, taking, (admitted(500), 5), &mut refunds);
        assert!(d.allowed);
        assert_eq!(r.held(&bucket()), 0);
        assert_eq!(
            refunds,
            vec![Refund {
                bucket: bucket(),
                tokens: 8
            }]
        );
        // Idle buckets are forgotten.
        tokio::time::advance(Duration::from_millis(IDLE_MS)).await;
        assert!(r.sweep(Instant::now()).is_empty());
        assert!(r.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn checks_wait_for_the_batch_in_flight_and_go_on_when_it_is_abandoned() {
        let r = Arc::new(Reservations::default());
        let l = limit(100_000);
        warm_up(&r, &l).await;
        let mut refunds = Vec::new();
        let (step, taking) = r
            .begin(&bucket(), &l, 1, Instant::now(), WAIT, &mut refunds)
            .await;
        assert!(matches!(step, Step::Take(_)));
        let waiter = {
            let r = r.clone();
            tokio::spawn(async move {
                let mut refunds = Vec::new();
                r.begin(&bucket(), &l, 1, Instant::now(), WAIT, &mut refunds)
                    .await
                    .0
            })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        r.filled(&bucket(), &l, 1, taking, (admitted(10), 4), &mut refunds);
        let got = waiter.await.unwrap();
        assert!(matches!(got, Step::Answered(_)), "{got:?}");
        // Abandoned: the waiter takes the batch itself.
        let mut refunds = Vec::new();
        for _ in 0..2 {
            r.begin(&bucket(), &l, 1, Instant::now(), WAIT, &mut refunds)
                .await;
        }
        let (step, _) = r
            .begin(&bucket(), &l, 1, Instant::now(), WAIT, &mut refunds)
            .await;
        assert!(matches!(step, Step::Take(_)), "{step:?}");
        let waiter = {
            let r = r.clone();
            tokio::spawn(async move {
                let mut refunds = Vec::new();
                r.begin(&bucket(), &l, 1, Instant::now(), WAIT, &mut refunds)
                    .await
                    .0
            })
        };
        tokio::task::yield_now().await;
        r.abandon(&bucket());
        let got = waiter.await.unwrap();
        assert!(matches!(got, Step::Take(_)), "{got:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_denied_batch_keeps_no_pool_and_small_buckets_stay_single() {
        let r = Reservations::default();
        let l = limit(100_000);
        warm_up(&r, &l).await;
        let mut refunds = Vec::new();
        let (_, taking) = r
            .begin(&bucket(), &l, 1, Instant::now(), WAIT, &mut refunds)
            .await;
        let denied = Decision {
            allowed: false,
            remaining: 0,
            retry_after_ms: Some(7),
            reset_ms: Some(100),
        };
        assert_eq!(
            r.filled(&bucket(), &l, 1, taking, (denied, 0), &mut refunds),
            denied
        );
        assert_eq!(r.held(&bucket()), 0);
        // 1 % of a burst of 100 is one token: no batches, however hot.
        let small = Reservations::default();
        let l = limit(100);
        warm_up(&small, &l).await;
        let (step, _) = small
            .begin(&bucket(), &l, 1, Instant::now(), WAIT, &mut refunds)
            .await;
        assert!(matches!(step, Step::Single));
        assert!(refunds.is_empty());
    }
}
