//! The `local` fail mode's in-process token buckets: while this region's Redis is out, each
//! bucket is continued from what Redis last answered for it, and what it admits is charged to
//! Redis before Redis decides that bucket again.
//!
//! ```text
//!  Redis answers (checks, batches, charges) ──> seen: tokens left, when
//!  store out: in-process bucket = seen, refilled at the share's rate since, less what is owed
//!             (never seen: empty at the first check in process, refilling from then)
//!             admitted ──> owed
//!  store back: before a check of the bucket reaches Redis (and once the breaker closes, for
//!             every bucket owed): one charge of what is owed, then the check
//! ```
//!
//! Why this keeps the bucket's bound: a Redis answer's `remaining` is rounded down and is
//! remembered at the time the answer arrived (after Redis's now), so the in-process bucket
//! starts at or below the level Redis held, and refills at the same rate. A charge spends what
//! is owed, as much as the Redis bucket holds (`token_bucket.lua` with a batch: cost 1, batch =
//! the tokens owed). What it cannot charge (the bucket holds less) is refill that Redis also
//! credited while it was out: a bucket left empty by the charge is never above the one the
//! in-process bucket continued, so admissions before, during and after an outage stay within
//! one bucket's `C + r·t`. Not seen by the daemon, and so not covered: tokens gateways spend on
//! Redis directly since its last answer, and checks whose Redis answer was still on the way
//! when the first check was decided here (the next check here starts again from that answer,
//! less what is owed).
//!
//! Memory is bounded: at most [`MAX_BUCKETS`] buckets are remembered. A bucket forgotten, or
//! never answered for, starts empty. A bucket that owes tokens is never forgotten; with the
//! map full of those, a check of another bucket is reduced capacity rather than an admission
//! that could not be charged.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use quota_core::bucket::{self, BucketParams, BucketState, UT};
use quota_core::{ChargeOutcome, Decision};
use quota_store::{
    AnyStore, BucketRef, ChargeRequest, CheckRequest, EmbeddedStore, HoldOutcome, HoldRequest,
    Limit, MultiCheckRequest, ReleaseRequest, SetParams, SettleRequest, Settled, Store, StoreError,
    UsageRecord, MAX_COST,
};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::breaker::Breaker;
use crate::clock;

/// Most buckets remembered at once.
pub const MAX_BUCKETS: usize = 65_536;

/// How long the settling task waits before trying again what is still owed.
const SETTLE_AGAIN: std::time::Duration = std::time::Duration::from_millis(100);

#[derive(Debug, Default)]
struct Entry {
    /// Redis's latest answer: whole tokens left (in µt) at the time it arrived, and its number.
    seen: Option<(BucketState, u64)>,
    /// The in-process bucket, and the number of the answer it continues (0: none).
    local: Option<(BucketState, u64)>,
    /// Tokens admitted in process and not yet charged, at the parameters of the latest.
    owed: u64,
    params: Option<BucketParams>,
    /// A charge is in flight; checks of the bucket wait for it.
    charging: Option<Arc<Notify>>,
    /// The latest charge failed (`true`: the store was out, `false`: it refused the bucket's
    /// data): the checks that waited for it fail the same way.
    failed: Option<bool>,
}

impl Entry {
    fn idle(&self) -> bool {
        self.owed == 0 && self.charging.is_none()
    }
}

#[derive(Debug, Default)]
struct Buckets {
    entries: HashMap<BucketRef, Entry>,
    /// Numbers Redis's answers.
    answers: u64,
    /// Entries that owe tokens.
    owing: usize,
}

/// Remembers Redis's answer for `bucket` at `params`: `remaining` whole tokens at `now`, later
/// than Redis's own now, so the level it stands for is never above what Redis held.
fn see(b: &mut Buckets, bucket: &BucketRef, params: &BucketParams, remaining: u64, now: u64) {
    let state = BucketState {
        tokens_ut: remaining.saturating_mul(UT).min(params.capacity_ut),
        debt_ut: 0,
        carry: 0,
        ts_ms: now,
        period_ms: params.period_ms,
    };
    b.answers += 1;
    let n = b.answers;
    if let Some(e) = b.entry(bucket) {
        e.seen = Some((state, n));
    }
}

impl Buckets {
    /// The bucket's entry, made room for: `None` when every entry owes tokens. The key is
    /// cloned only for a new entry (this runs on every answer from Redis).
    fn entry(&mut self, bucket: &BucketRef) -> Option<&mut Entry> {
        if !self.entries.contains_key(bucket) {
            if self.entries.len() >= MAX_BUCKETS {
                self.entries.retain(|_, e| !e.idle());
                if self.entries.len() >= MAX_BUCKETS {
                    return None;
                }
            }
            self.entries.insert(bucket.clone(), Entry::default());
        }
        self.entries.get_mut(bucket)
    }

    /// Adds `cost` admitted in process at `params` to what `bucket` owes.
    fn owe(&mut self, bucket: &BucketRef, params: &BucketParams, cost: u64) {
        let e = self.entries.get_mut(bucket).expect("decided with an entry");
        if e.owed == 0 {
            self.owing += 1;
        }
        e.owed = e.owed.saturating_add(cost);
        e.params = Some(*params);
    }

    /// Takes `tokens` charged to Redis off what `bucket` owes.
    fn paid(&mut self, bucket: &BucketRef, tokens: u64) {
        if let Some(e) = self.entries.get_mut(bucket).filter(|e| e.owed > 0) {
            e.owed = e.owed.saturating_sub(tokens);
            if e.owed == 0 {
                self.owing -= 1;
            }
        }
    }
}

/// What the region knows of its buckets' levels and owes to Redis.
#[derive(Debug)]
pub struct Outage {
    buckets: Mutex<Buckets>,
    /// Any bucket owes tokens: checks look in the map only then.
    owing: AtomicBool,
    /// A task settles what is owed once the breaker closes.
    settling: AtomicBool,
    /// Where this process's in-process time starts.
    origin: Instant,
    /// Charges sent, for tests.
    charges: AtomicU64,
    /// The region's daemons: each decides in process at its part of the share
    /// ([`Outage::share_among`]).
    daemons: AtomicU64,
}

impl Default for Outage {
    fn default() -> Self {
        Self {
            buckets: Mutex::default(),
            owing: AtomicBool::new(false),
            settling: AtomicBool::new(false),
            origin: clock::monotonic(),
            charges: AtomicU64::new(0),
            daemons: AtomicU64::new(1),
        }
    }
}

impl Outage {
    /// The region runs `daemons` daemons on one Redis: while Redis is out each decides in
    /// process, so each continues from its part of Redis's last level at its part of the
    /// share, and together they stay within one bucket of the share.
    pub fn share_among(&self, daemons: u64) {
        self.daemons.store(daemons.max(1), Ordering::Relaxed);
    }

    /// How many daemons share the region's buckets in process.
    pub fn daemons(&self) -> u64 {
        self.daemons.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Buckets> {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Milliseconds of the monotonic clock since this was made: in-process buckets' time.
    fn now_ms(&self) -> u64 {
        clock::monotonic()
            .saturating_duration_since(self.origin)
            .as_millis() as u64
    }

    /// Remembers Redis's answer for `bucket` at `params`: `remaining` whole tokens, now.
    pub fn seen(&self, bucket: &BucketRef, params: &BucketParams, remaining: u64) {
        let remaining = remaining / self.daemons();
        let now = self.now_ms();
        see(&mut self.lock(), bucket, params, remaining, now);
    }

    /// Tokens owed to Redis for `bucket`.
    pub fn owed(&self, bucket: &BucketRef) -> u64 {
        self.lock().entries.get(bucket).map_or(0, |e| e.owed)
    }

    /// Charges sent to Redis so far.
    pub fn charges(&self) -> u64 {
        self.charges.load(Ordering::Relaxed)
    }

    /// The in-process bucket of `bucket`, continued from Redis's latest answer if it is newer
    /// than the one the bucket continues.
    fn local_state(&self, e: &mut Entry, params: &BucketParams, now: u64) -> BucketState {
        let seen = e.seen.map_or(0, |(_, n)| n);
        match e.local {
            Some((s, from)) if from == seen => s,
            _ => {
                let mut s = match e.seen {
                    Some((s, _)) => bucket::refill(now, params, Some(&s)),
                    // Never answered for (or forgotten): empty, refilling from now.
                    None => BucketState {
                        tokens_ut: 0,
                        debt_ut: 0,
                        carry: 0,
                        ts_ms: now,
                        period_ms: params.period_ms,
                    },
                };
                // Admitted here and not yet charged: Redis's answer does not count it.
                s.tokens_ut = s.tokens_ut.saturating_sub(e.owed.saturating_mul(UT));
                e.local = Some((s, seen));
                s
            }
        }
    }

    /// Decides `cost` of `bucket` in process; `None` when no bucket more can be remembered.
    fn decide(&self, bucket: &BucketRef, params: &BucketParams, cost: u64) -> Option<Decision> {
        let now = self.now_ms();
        let mut b = self.lock();
        let e = b.entry(bucket)?;
        let s = self.local_state(e, params, now);
        let (d, s) = bucket::decide(now, params, Some(&s), cost);
        if cost > 0 {
            e.local = e.local.map(|(_, from)| (s, from));
        }
        if d.allowed && cost > 0 {
            b.owe(bucket, params, cost);
            self.owing.store(true, Ordering::Release);
        }
        Some(d)
    }

    /// Decides `cost` of every bucket in process, all or nothing; `None` as for one.
    fn decide_all(&self, limits: &[(BucketRef, BucketParams)], cost: u64) -> Option<Vec<Decision>> {
        let now = self.now_ms();
        let mut b = self.lock();
        let mut states = Vec::with_capacity(limits.len());
        for (bucket, params) in limits {
            let e = b.entry(bucket)?;
            states.push((*params, Some(self.local_state(e, params, now))));
        }
        // Making room for a later limit may have dropped an earlier one's (unspent) entry.
        if limits.iter().any(|(k, _)| !b.entries.contains_key(k)) {
            return None;
        }
        let outcomes = bucket::decide_all(now, &states, cost);
        let admitted = cost > 0 && outcomes.iter().all(|o| o.decision.allowed);
        for ((bucket, params), o) in limits.iter().zip(&outcomes) {
            let e = b.entries.get_mut(bucket).expect("looked at above");
            if let Some(s) = o.state {
                e.local = e.local.map(|(_, from)| (s, from));
            }
            if admitted {
                b.owe(bucket, params, cost);
            }
        }
        if admitted {
            self.owing.store(true, Ordering::Release);
        }
        Some(outcomes.into_iter().map(|o| o.decision).collect())
    }

    /// Charges what `bucket` owes to `store` before a check of it goes there; returns once
    /// nothing is owed, or with the error of a charge that failed (the check's call would
    /// fail too).
    pub async fn settle(
        self: &Arc<Self>,
        store: &AnyStore,
        bucket: &BucketRef,
    ) -> Result<(), StoreError> {
        if !self.owing.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut waited = false;
        loop {
            let notify = {
                let mut b = self.lock();
                let Some(e) = b.entries.get_mut(bucket) else {
                    return Ok(());
                };
                match &e.charging {
                    Some(n) => n.clone(),
                    None if e.owed == 0 => return Ok(()),
                    // A refusal stays one bucket's fault, never an outage (see `local`).
                    None if waited && e.failed.is_some() => {
                        let reason = "charging what was admitted in process failed".to_string();
                        return Err(if e.failed == Some(true) {
                            StoreError::Unavailable { reason }
                        } else {
                            StoreError::Rejected { reason }
                        });
                    }
                    None => {
                        let n = Arc::new(Notify::new());
                        e.charging = Some(n.clone());
                        e.failed = None;
                        let (tokens, params) = (e.owed, e.params.expect("set with owed"));
                        // The charge runs in a task of its own. Fault: a check's future dropped
                        // mid-charge (its client gone, Envoy cancelling at its timeout) would
                        // otherwise end the call with its outcome unknown: put back, the tokens
                        // could be charged twice; dropped, lost. The task always reports, and
                        // until it has, every other check of the bucket waits instead of sending
                        // the charge again.
                        tokio::spawn(charge(
                            self.clone(),
                            store.clone(),
                            bucket.clone(),
                            tokens,
                            params,
                        ));
                        n
                    }
                }
            };
            let woken = notify.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            // Looked at again under the lock: a charge that ended in between is seen here.
            if self
                .lock()
                .entries
                .get(bucket)
                .is_some_and(|e| e.charging.as_ref().is_some_and(|c| Arc::ptr_eq(c, &notify)))
            {
                woken.await;
            }
            waited = true;
        }
    }

    /// Every bucket that owes tokens.
    fn owing(&self) -> Vec<BucketRef> {
        let b = self.lock();
        b.entries
            .iter()
            .filter(|(_, e)| e.owed > 0)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Settles every bucket owed once the breaker closes, in a task started at most once at a
    /// time (by the first admission in process).
    pub fn settle_when_closed(self: &Arc<Self>, store: &AnyStore, breaker: &Arc<Breaker>) {
        if self.settling.swap(true, Ordering::AcqRel) {
            return;
        }
        let (outage, store, breaker) = (self.clone(), store.clone(), breaker.clone());
        tokio::spawn(async move {
            let mut open = breaker.watch_open();
            loop {
                if open.wait_for(|open| !open).await.is_err() {
                    return;
                }
                for bucket in outage.owing() {
                    let Some(permit) = breaker.admit() else {
                        break;
                    };
                    let t0 = clock::monotonic();
                    let r = outage.settle(&store, &bucket).await;
                    // A refusal of one bucket's data is no outage (see `local`).
                    let store_up = r.as_ref().map_or_else(|e| !e.is_outage(), |_| true);
                    permit.record(store_up, t0.elapsed());
                    if !store_up {
                        break;
                    }
                }
                if outage.owing().is_empty() {
                    outage.settling.store(false, Ordering::Release);
                    // An admission in between saw this task running and started none.
                    if outage.owing().is_empty() || outage.settling.swap(true, Ordering::AcqRel) {
                        return;
                    }
                }
                // Still owed: a charge failed or more was admitted meanwhile.
                tokio::time::sleep(SETTLE_AGAIN).await;
            }
        });
    }
}

/// One charge of `tokens` owed by `bucket`: as many as the Redis bucket holds, in one call.
async fn charge(
    outage: Arc<Outage>,
    store: AnyStore,
    bucket: BucketRef,
    tokens: u64,
    params: BucketParams,
) {
    let req = CheckRequest {
        bucket,
        limit: Limit::TokenBucket(params),
        cost: 1,
        now_ms: None,
    };
    outage.charges.fetch_add(1, Ordering::Relaxed);
    // More than one call can take (9 · 10⁹ tokens) stays owed for the next.
    let tokens = tokens.min(MAX_COST);
    let r = store.reserve(&req, tokens).await;
    let now = outage.now_ms();
    let mut b = outage.lock();
    if let Some(e) = b.entries.get_mut(&req.bucket) {
        if let Some(n) = e.charging.take() {
            n.notify_waiters();
        }
        if let Err(err) = &r {
            e.failed = Some(err.is_outage());
        }
    }
    match &r {
        Err(err) if err.is_outage() => {
            tracing::debug!(error = %err, "Charging tokens admitted in process failed; they stay owed.");
        }
        // Redis refuses this bucket's data: no charge can ever land, and its checks are
        // refused (reduced capacity) until the data is put right.
        Err(err) => {
            tracing::warn!(error = %err, owed = tokens, "Redis refuses a bucket that owes tokens admitted in process; they are dropped.");
            b.paid(&req.bucket, tokens);
        }
        Ok(_) => {}
    }
    if let Ok((d, taken)) = &r {
        // Charged once: what is owed beyond `tokens` was admitted after this charge was sent.
        // Paid with the answer remembered, under one lock: the next check here starts from
        // the answer less only what is still owed.
        b.paid(&req.bucket, tokens);
        see(
            &mut b,
            &req.bucket,
            &params,
            d.remaining / outage.daemons(),
            now,
        );
        if *taken < tokens {
            tracing::debug!(
                owed = tokens,
                charged = taken,
                "The bucket held less than was admitted in process: the rest is refill Redis \
                 credited while it was out."
            );
        }
    }
    if b.owing == 0 {
        outage.owing.store(false, Ordering::Release);
    }
}

/// This region's store as the decision path uses it: what Redis answers is remembered, and a
/// bucket that owes tokens decided in process is charged before Redis decides it again.
/// Everything else is the store itself.
#[derive(Debug, Clone)]
pub struct Regional {
    store: AnyStore,
    outage: Arc<Outage>,
    /// The embedded store decides everything itself: nothing to remember.
    remember: bool,
}

impl Deref for Regional {
    type Target = AnyStore;

    fn deref(&self) -> &AnyStore {
        &self.store
    }
}

impl Regional {
    pub fn new(store: AnyStore, outage: Arc<Outage>) -> Self {
        Self {
            remember: !matches!(store, AnyStore::Embedded(_)),
            store,
            outage,
        }
    }
}

impl Store for Regional {
    /// After charging what the bucket owes; the answer remembered.
    async fn check(&self, req: &CheckRequest) -> Result<Decision, StoreError> {
        if !self.remember {
            return self.store.check(req).await;
        }
        self.outage.settle(&self.store, &req.bucket).await?;
        let d = self.store.check(req).await?;
        if let Limit::TokenBucket(p) = &req.limit {
            self.outage.seen(&req.bucket, p, d.remaining);
        }
        Ok(d)
    }

    /// After charging what the buckets owe; the answers remembered.
    async fn check_all(&self, req: &MultiCheckRequest) -> Result<Vec<Decision>, StoreError> {
        if !self.remember {
            return self.store.check_all(req).await;
        }
        for l in &req.limits {
            self.outage.settle(&self.store, &l.bucket).await?;
        }
        let ds = self.store.check_all(req).await?;
        for (l, d) in req.limits.iter().zip(&ds) {
            if let Limit::TokenBucket(p) = &l.limit {
                self.outage.seen(&l.bucket, p, d.remaining);
            }
        }
        Ok(ds)
    }

    /// After charging what the bucket owes; the answer remembered.
    async fn reserve(&self, req: &CheckRequest, batch: u64) -> Result<(Decision, u64), StoreError> {
        if !self.remember {
            return self.store.reserve(req, batch).await;
        }
        self.outage.settle(&self.store, &req.bucket).await?;
        let (d, taken) = self.store.reserve(req, batch).await?;
        if let Limit::TokenBucket(p) = &req.limit {
            self.outage.seen(&req.bucket, p, d.remaining);
        }
        Ok((d, taken))
    }

    /// After charging what the buckets owe; the answers remembered, as a check's.
    async fn hold(&self, req: &HoldRequest) -> Result<HoldOutcome, StoreError> {
        if !self.remember {
            return self.store.hold(req).await;
        }
        for l in &req.limits {
            if let Limit::TokenBucket(_) = l.limit {
                self.outage.settle(&self.store, &l.bucket).await?;
            }
        }
        let out = self.store.hold(req).await?;
        for (l, d) in req.limits.iter().zip(&out.decisions) {
            if let Limit::TokenBucket(p) = &l.limit {
                self.outage.seen(&l.bucket, p, d.remaining);
            }
        }
        Ok(out)
    }

    /// Passed on as it is, as a charge or a refund is.
    async fn settle(&self, req: &SettleRequest) -> Result<Settled, StoreError> {
        self.store.settle(req).await
    }

    async fn release(&self, req: &ReleaseRequest) -> Result<Settled, StoreError> {
        self.store.release(req).await
    }

    async fn in_flight(&self, bucket: &BucketRef, now_ms: Option<u64>) -> Result<u64, StoreError> {
        self.store.in_flight(bucket, now_ms).await
    }

    /// Passed on as it is: the answer is not remembered for an outage.
    async fn charge(&self, req: &ChargeRequest) -> Result<ChargeOutcome, StoreError> {
        self.store.charge(req).await
    }

    async fn refund(
        &self,
        bucket: &BucketRef,
        tokens: u64,
        now_ms: Option<u64>,
    ) -> Result<Option<u64>, StoreError> {
        self.store.refund(bucket, tokens, now_ms).await
    }

    async fn set_params(&self, req: &SetParams) -> Result<(), StoreError> {
        self.store.set_params(req).await
    }

    async fn clear_params(&self, bucket: &BucketRef) -> Result<(), StoreError> {
        self.store.clear_params(bucket).await
    }

    async fn instance(&self) -> Result<String, StoreError> {
        self.store.instance().await
    }

    async fn clock_ms(&self) -> Result<u64, StoreError> {
        self.store.clock_ms().await
    }

    async fn list_params(&self) -> Result<Vec<BucketRef>, StoreError> {
        self.store.list_params().await
    }

    async fn collect_usage(&self, max: usize) -> Result<Vec<UsageRecord>, StoreError> {
        self.store.collect_usage(max).await
    }
}

/// The `local` fail mode's buckets: token buckets continued from Redis ([`Outage`]), sliding
/// windows in an embedded store of their own (a window starts unspent and is not charged back;
/// the allowance counts that).
#[derive(Debug)]
pub struct InProcess {
    outage: Arc<Outage>,
    windows: EmbeddedStore,
}

fn too_many() -> StoreError {
    StoreError::Unavailable {
        reason: "every bucket remembered owes tokens to Redis".into(),
    }
}

impl InProcess {
    pub fn new(outage: Arc<Outage>) -> Self {
        Self {
            outage,
            windows: EmbeddedStore::new(),
        }
    }

    /// Decides one check in process, at this daemon's part of the limit.
    pub async fn check(&self, req: &CheckRequest) -> Result<Decision, StoreError> {
        let n = self.outage.daemons();
        match &req.limit {
            Limit::TokenBucket(p) => self
                .outage
                .decide(&req.bucket, &part(p, n), req.cost)
                .ok_or_else(too_many),
            Limit::SlidingWindow { limit, window_ms } => {
                let mine = CheckRequest {
                    limit: Limit::SlidingWindow {
                        limit: limit / n,
                        window_ms: *window_ms,
                    },
                    ..req.clone()
                };
                self.windows.check(&mine).await
            }
            // Refused before any check reaches here: a slot is a hold, kept in the store.
            Limit::Concurrency { .. } => Err(StoreError::Rejected {
                reason: "a concurrency limit is taken with holds".into(),
            }),
        }
    }

    /// Decides a check of several token buckets in process, all or nothing.
    pub async fn check_all(&self, req: &MultiCheckRequest) -> Result<Vec<Decision>, StoreError> {
        let mut limits = Vec::with_capacity(req.limits.len());
        for l in &req.limits {
            let Limit::TokenBucket(p) = l.limit else {
                return Err(StoreError::Rejected {
                    reason: "several limits at once are token buckets".into(),
                });
            };
            limits.push((l.bucket.clone(), part(&p, self.outage.daemons())));
        }
        self.outage
            .decide_all(&limits, req.cost)
            .ok_or_else(too_many)
    }
}

/// One of `n` daemons' part of bucket parameters: the capacity and refill divided (rounded
/// down, so the parts never sum above the whole).
pub fn part(p: &BucketParams, n: u64) -> BucketParams {
    BucketParams {
        capacity_ut: p.capacity_ut / n,
        refill_ut: p.refill_ut / n,
        period_ms: p.period_ms,
    }
}

/// Tokens a Redis outage can still add beyond the bucket's bound for a policy failing `local`
/// at `limit`: none for a token bucket (continued and charged back, above); a sliding window's
/// in-process window starts unspent, so up to its limit.
pub fn overshoot_tokens(limit: &Limit) -> f64 {
    match limit {
        // Holds are never decided in process.
        Limit::TokenBucket(_) | Limit::Concurrency { .. } => 0.0,
        Limit::SlidingWindow { limit, .. } => *limit as f64,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use quota_core::{PolicyName, TenantId};

    use super::*;

    fn bucket() -> BucketRef {
        BucketRef {
            tenant: TenantId::new("t").unwrap(),
            policy: PolicyName::new("p").unwrap(),
            version: 1,
        }
    }

    /// `capacity` tokens refilling `per_s` a second.
    fn params(capacity: u64, per_s: u64) -> BucketParams {
        BucketParams::new(capacity * UT, per_s * UT).unwrap()
    }

    /// Admissions of cost 1 in process until the first denial.
    fn admitted(o: &Outage, p: &BucketParams) -> u64 {
        let mut n = 0;
        while o.decide(&bucket(), p, 1).unwrap().allowed {
            n += 1;
        }
        n
    }

    #[tokio::test(start_paused = true)]
    async fn the_in_process_bucket_continues_from_redis_last_answer() {
        let o = Outage::default();
        let p = params(10, 10);
        o.seen(&bucket(), &p, 3);
        // 200 ms later: the 3 left, and 2 refilled at the share's rate; not a full bucket.
        tokio::time::advance(Duration::from_millis(200)).await;
        assert_eq!(admitted(&o, &p), 5);
        assert_eq!(o.owed(&bucket()), 5);
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(admitted(&o, &p), 1, "then the share's rate");
        assert_eq!(o.owed(&bucket()), 6);
    }

    /// Issue 31: two daemons of a region on one Redis both decide in process while it is
    /// out. Each continues from its half of Redis's last level at half the share's rate, so
    /// together they admit what one daemon alone would, not twice that.
    #[tokio::test(start_paused = true)]
    async fn daemons_of_one_region_each_decide_their_part_in_process() {
        let (alone, a, b) = (Outage::default(), Outage::default(), Outage::default());
        a.share_among(2);
        b.share_among(2);
        let p = params(10, 10);
        for o in [&alone, &a, &b] {
            o.seen(&bucket(), &p, 6);
        }
        let in_process = InProcess::new(Arc::new(a));
        let other = InProcess::new(Arc::new(b));
        let single = InProcess::new(Arc::new(alone));
        let req = CheckRequest {
            bucket: bucket(),
            limit: Limit::TokenBucket(p),
            cost: 1,
            now_ms: None,
        };
        let admitted_by = |s: &InProcess| {
            let mut n = 0;
            while futures::executor::block_on(s.check(&req)).unwrap().allowed {
                n += 1;
            }
            n
        };
        assert_eq!(admitted_by(&single), 6);
        assert_eq!(admitted_by(&in_process) + admitted_by(&other), 6);
        // 1 s later: the share's 10 tokens of refill, 5 each.
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(admitted_by(&single), 10);
        assert_eq!((admitted_by(&in_process), admitted_by(&other)), (5, 5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_bucket_never_answered_for_starts_empty_and_refills() {
        let o = Outage::default();
        let p = params(10, 10);
        assert_eq!(admitted(&o, &p), 0);
        tokio::time::advance(Duration::from_millis(350)).await;
        assert_eq!(admitted(&o, &p), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_later_answer_restarts_the_bucket_less_what_is_owed() {
        let o = Outage::default();
        let p = params(10, 10);
        o.seen(&bucket(), &p, 4);
        assert_eq!(admitted(&o, &p), 4);
        // An answer to a call sent before those admissions arrives: it does not count them.
        o.seen(&bucket(), &p, 6);
        assert_eq!(admitted(&o, &p), 2, "6 less the 4 owed");
        assert_eq!(o.owed(&bucket()), 6);
    }

    /// The store standing in for Redis: `capacity` tokens, refilling 1 in 1 000 s.
    async fn redis_holding(left: u64, capacity: u64) -> (AnyStore, BucketParams) {
        let store = AnyStore::embedded();
        let p = BucketParams::per_period(capacity * UT, UT, 1_000_000).unwrap();
        let req = CheckRequest {
            bucket: bucket(),
            limit: Limit::TokenBucket(p),
            cost: 1,
            now_ms: None,
        };
        if left < capacity {
            store.reserve(&req, capacity - left).await.unwrap();
        }
        (store, p)
    }

    async fn left(store: &AnyStore, p: BucketParams) -> u64 {
        let req = CheckRequest::peek(bucket(), Limit::TokenBucket(p));
        store.check(&req).await.unwrap().remaining
    }

    #[tokio::test(start_paused = true)]
    async fn what_is_owed_is_charged_once_by_concurrent_checks() {
        let (store, p) = redis_holding(10, 10).await;
        let o = Arc::new(Outage::default());
        o.seen(&bucket(), &p, 10);
        for _ in 0..4 {
            assert!(o.decide(&bucket(), &p, 1).unwrap().allowed);
        }
        let b = bucket();
        let (one, two) = tokio::join!(o.settle(&store, &b), o.settle(&store, &b));
        one.unwrap();
        two.unwrap();
        assert_eq!(
            o.charges(),
            1,
            "the second check waited for the first one's charge"
        );
        assert_eq!(left(&store, p).await, 6);
        assert_eq!(o.owed(&bucket()), 0);
        o.settle(&store, &bucket()).await.unwrap();
        assert_eq!((o.charges(), left(&store, p).await), (1, 6), "nothing owed");
    }

    /// Regression for the fault `settle` names: a check dropped while its charge is in flight
    /// neither loses the charge nor lets the next check send it again.
    #[tokio::test(start_paused = true)]
    async fn a_check_dropped_mid_charge_neither_loses_nor_doubles_it() {
        let (store, p) = redis_holding(10, 10).await;
        let o = Arc::new(Outage::default());
        o.seen(&bucket(), &p, 10);
        for _ in 0..3 {
            assert!(o.decide(&bucket(), &p, 1).unwrap().allowed);
        }
        let b = bucket();
        {
            let settle = o.settle(&store, &b);
            tokio::pin!(settle);
            // Polled once: the charge is sent (its task spawned), then the check goes away.
            assert!(futures_poll_once(settle.as_mut()).await.is_none());
        }
        // A retry of the check arrives while the charge may still be in flight.
        o.settle(&store, &bucket()).await.unwrap();
        assert_eq!(o.charges(), 1);
        assert_eq!(left(&store, p).await, 7);
        assert_eq!(o.owed(&bucket()), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_charge_takes_the_bucket_as_low_as_it_can_and_no_further() {
        let (store, p) = redis_holding(2, 10).await;
        let o = Arc::new(Outage::default());
        o.seen(&bucket(), &p, 10);
        for _ in 0..5 {
            assert!(o.decide(&bucket(), &p, 1).unwrap().allowed);
        }
        o.settle(&store, &bucket()).await.unwrap();
        assert_eq!(left(&store, p).await, 0);
        assert_eq!(
            o.owed(&bucket()),
            0,
            "what the bucket did not hold is not owed on"
        );
        // The next outage starts from the charge's answer: empty.
        assert_eq!(admitted(&o, &p), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn what_is_owed_is_charged_once_the_breaker_closes() {
        let (store, p) = redis_holding(10, 10).await;
        let cfg = crate::config::BreakerConfig {
            failure_threshold: 1,
            slow_call_ms: 1_000,
            open_ms: 100,
        };
        let breaker = Arc::new(Breaker::new(&cfg, "eu"));
        breaker.trip();
        let o = Arc::new(Outage::default());
        o.seen(&bucket(), &p, 10);
        for _ in 0..3 {
            assert!(o.decide(&bucket(), &p, 1).unwrap().allowed);
        }
        o.settle_when_closed(&store, &breaker);
        o.settle_when_closed(&store, &breaker);
        tokio::time::advance(Duration::from_millis(150)).await;
        assert_eq!(o.charges(), 0, "nothing is sent while the breaker is open");
        // Another check's probe closes it.
        breaker
            .admit()
            .expect("a probe")
            .record(true, Duration::ZERO);
        for _ in 0..100 {
            if o.owed(&bucket()) == 0 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(o.owed(&bucket()), 0);
        assert_eq!((o.charges(), left(&store, p).await), (1, 7));
    }

    /// Polls `f` once: its output if it is ready.
    async fn futures_poll_once<F: std::future::Future + Unpin>(mut f: F) -> Option<F::Output> {
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
                std::task::Poll::Ready(v) => Some(v),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }
}
