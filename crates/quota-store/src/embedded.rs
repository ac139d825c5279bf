//! The embedded store: the decisions of `quota-core`'s reference bucket and window, in process.
//!
//! A product feature for running without Redis (one region, development, higher-layer tests),
//! not a mock: it gives exactly the decisions the Lua scripts give, keeps the same usage
//! counters, and bounds its memory the same way — a bucket idle past its TTL (time to refill
//! fully, at least the minimum idle TTL: [`DEFAULT_MIN_IDLE_TTL_MS`] unless configured) reads as missing, i.e. full, and is evicted by an amortised
//! sweep. State is split over shards, each behind its own `std::sync::Mutex`: critical sections
//! are short and never await, so a blocking mutex is cheaper than an async one and contention
//! is spread by bucket hash.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use quota_core::bounds::ONCE_KEY_MS;
use quota_core::hold::{self, Create, Finish, HoldRecord, Verdict};
use quota_core::keys::StateKind;
use quota_core::slots::Slots;
use quota_core::window::HeldRaise;
use quota_core::{
    bucket, window, BucketParams, BucketState, ChargeOutcome, Decision, TenantId, WindowParams,
    WindowState,
};

use crate::{
    BucketRef, ChargeRequest, CheckRequest, Fence, HoldLimit, HoldOutcome, HoldRequest, Limit,
    MultiCheckRequest, ReleaseRequest, SetParams, SettleRequest, Settled, SettledLimit, Store,
    StoreError, UsageRecord, DEFAULT_MIN_IDLE_TTL_MS,
};

/// Shards by default: a power of two well above the core count.
const DEFAULT_SHARDS: usize = 64;

/// A source of "now" in ms since the epoch.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The system clock in ms since the epoch (0 if the clock is before 1970).
pub fn system_clock() -> Clock {
    Arc::new(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    })
}

#[derive(Debug, Clone)]
enum State {
    Bucket(BucketState),
    Window(WindowState),
    /// A concurrency limit's slots (its usage counters are the entry's).
    Slots(Slots),
}

#[derive(Debug)]
struct Entry {
    state: State,
    /// When the entry may be forgotten (ms); `None`: never (a dry bucket that is not full).
    expires_at_ms: Option<u64>,
    admitted: u64,
    denied: u64,
    /// Listed in the shard's activity list since the last collection.
    listed: bool,
    /// The limit of the latest decision (the scripts keep the same copy in the state).
    limit: Limit,
}

impl Entry {
    fn live_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_none_or(|t| now_ms < t)
    }
}

type StateKey = (BucketRef, StateKind);

#[derive(Debug, Default)]
struct Shard {
    states: HashMap<StateKey, Entry>,
    /// Each bucket's parameters with their lease end (store clock, ms) and floor.
    params: HashMap<BucketRef, (Limit, Option<(u64, Limit)>)>,
    /// The raise held with a bucket's sliding-window parameters (`hlimit` / `huntil` of the
    /// parameters hash), see [`window::held_raise`].
    holds: HashMap<BucketRef, HeldRaise>,
    /// The fence stored with a bucket's parameters (`fence` / `ep` beside them in Redis).
    fences: HashMap<BucketRef, Fence>,
    /// Charges made under an id: what each applied and clamped, until when (ms) a charge of
    /// the same id is a replay (`charge.lua`'s marker).
    charges: HashMap<(BucketRef, String), (u64, u64, u64)>,
    /// Hold records by tenant and id (`hold.lua`'s `qd:v1:{tenant}:~h:<id>`), until
    /// forgotten.
    hold_records: HashMap<(TenantId, String), HoldRecord<HoldLimit>>,
    /// State keys decided since the last collection (each at most once while it lives).
    active: Vec<StateKey>,
    /// Decisions since the last sweep; a sweep runs once this exceeds the map's size right
    /// after the previous sweep (at least 1024), so its cost is amortised O(1) per decision.
    since_sweep: usize,
    /// Entries left by the previous sweep.
    len_after_sweep: usize,
    /// The latest time a decision in this shard used.
    latest_ms: u64,
}

impl Shard {
    fn sweep(&mut self) {
        let now = self.latest_ms;
        self.states.retain(|_, e| e.live_at(now));
        self.charges.retain(|_, &mut (_, _, until)| now < until);
        self.hold_records.retain(|_, r| r.live_at(now));
        let states = &self.states;
        self.active
            .retain(|k| states.get(k).is_some_and(|e| e.listed));
        self.since_sweep = 0;
        self.len_after_sweep = self.states.len();
    }

    /// Keeps a decision's new state and counts its tokens, listing the bucket as active.
    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        key: StateKey,
        now: u64,
        state: State,
        limit: Limit,
        expires_at_ms: Option<u64>,
        admitted: u64,
        denied: u64,
    ) {
        match self.states.get_mut(&key).filter(|e| e.live_at(now)) {
            Some(e) => {
                e.state = state;
                e.limit = limit;
                e.expires_at_ms = expires_at_ms;
                e.admitted += admitted;
                e.denied += denied;
                if !e.listed {
                    e.listed = true;
                    self.active.push(key);
                }
            }
            None => {
                let e = Entry {
                    state,
                    expires_at_ms,
                    admitted,
                    denied,
                    listed: true,
                    limit,
                };
                self.states.insert(key.clone(), e);
                self.active.push(key);
            }
        }
    }
}

impl Shard {
    /// Counts a call towards the next sweep, running it when due (amortised O(1)).
    fn tick(&mut self, now: u64) {
        self.latest_ms = self.latest_ms.max(now);
        self.since_sweep += 1;
        if self.since_sweep > self.len_after_sweep.max(1024) {
            self.sweep();
        }
    }

    /// A concurrency limit as `hold.lua` reads it at `now`: the stored one (its floor from the
    /// lease end on), else `fallback`.
    fn slots_limit(&self, b: &BucketRef, fallback: u64, now: u64) -> u64 {
        match self.params.get(b) {
            Some(&(Limit::Concurrency { .. }, Some((end, Limit::Concurrency { limit }))))
                if now >= end =>
            {
                limit
            }
            Some(&(Limit::Concurrency { limit }, _)) => limit,
            _ => fallback,
        }
    }

    /// The slots of a concurrency limit kept at `now`, if any.
    fn slots(&self, b: &BucketRef, now: u64) -> Option<&Slots> {
        match self
            .states
            .get(&(b.clone(), StateKind::Slots))
            .filter(|e| e.live_at(now))
            .map(|e| &e.state)
        {
            Some(State::Slots(s)) => Some(s),
            _ => None,
        }
    }

    /// The slots of a concurrency limit taken out of their entry to change them (empty when
    /// none are kept); [`Shard::record`] puts them back.
    fn take_slots(&mut self, b: &BucketRef, now: u64) -> Slots {
        match self
            .states
            .get_mut(&(b.clone(), StateKind::Slots))
            .filter(|e| e.live_at(now))
            .map(|e| &mut e.state)
        {
            Some(State::Slots(s)) => std::mem::take(s),
            _ => Slots::default(),
        }
    }

    /// A token bucket as the scripts read it at `now`: the stored token-bucket parameters
    /// (their floor from the lease end on), else `fallback`; and its live state.
    fn bucket_at(
        &self,
        b: &BucketRef,
        fallback: BucketParams,
        now: u64,
    ) -> (BucketParams, Option<BucketState>) {
        let p = match self.params.get(b) {
            Some(&(Limit::TokenBucket(_), Some((end, Limit::TokenBucket(floor)))))
                if now >= end =>
            {
                floor
            }
            Some(&(Limit::TokenBucket(p), _)) => p,
            _ => fallback,
        };
        let state = self
            .states
            .get(&(b.clone(), StateKind::Bucket))
            .filter(|e| e.live_at(now))
            .and_then(|e| match &e.state {
                State::Bucket(s) => Some(*s),
                State::Window(_) | State::Slots(_) => None,
            });
        (p, state)
    }
}

/// The in-process store. Cheap to clone (the state is shared).
#[derive(Clone)]
pub struct EmbeddedStore {
    shards: Arc<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Clock,
    /// Minimum idle lifetime of a state (ms).
    min_idle_ttl_ms: u64,
}

impl fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmbeddedStore")
            .field("shards", &self.shards.len())
            .finish()
    }
}

impl Default for EmbeddedStore {
    fn default() -> Self {
        Self::new()
    }
}

impl EmbeddedStore {
    /// A store on the system clock with the default number of shards.
    pub fn new() -> Self {
        Self::with_clock(system_clock())
    }

    /// A store whose "now" (when a request has no explicit `now_ms`) comes from `clock`, so
    /// tests and the simulator control time.
    pub fn with_clock(clock: Clock) -> Self {
        Self::with_shards(clock, DEFAULT_SHARDS)
    }

    /// A store with `shards` independent locks (at least one).
    pub fn with_shards(clock: Clock, shards: usize) -> Self {
        let shards: Vec<Mutex<Shard>> = (0..shards.max(1)).map(|_| Mutex::default()).collect();
        Self {
            shards: shards.into(),
            hasher: RandomState::new(),
            clock,
            min_idle_ttl_ms: DEFAULT_MIN_IDLE_TTL_MS,
        }
    }

    /// The same with another minimum idle lifetime of state (at least 1 ms), as
    /// `RedisStoreConfig::with_min_idle_ttl`.
    pub fn with_min_idle_ttl(mut self, ms: u64) -> Self {
        self.min_idle_ttl_ms = ms.max(1);
        self
    }

    /// Number of live state entries (for memory checks and metrics).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).states.len()).sum()
    }

    /// Whether no state is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every entry idle past its TTL as of `now_ms` (normally done incrementally).
    pub fn evict_expired(&self, now_ms: u64) {
        for s in self.shards.iter() {
            let mut s = lock(s);
            s.latest_ms = s.latest_ms.max(now_ms);
            s.sweep();
        }
    }

    /// The shard of a bucket: by tenant, so every bucket of a tenant shares one (a changed
    /// policy's new bucket reads the old one, and a check of several limits decides them all,
    /// under one lock), as a tenant's Redis keys share one hash slot.
    fn shard(&self, b: &BucketRef) -> MutexGuard<'_, Shard> {
        self.tenant_shard(&b.tenant)
    }

    /// The shard of every bucket and hold of `tenant`.
    fn tenant_shard(&self, tenant: &TenantId) -> MutexGuard<'_, Shard> {
        let i = self.hasher.hash_one(tenant) as usize % self.shards.len();
        lock(&self.shards[i])
    }

    /// The expiry of a token-bucket state written at its `ts_ms`, as the scripts' PX: its time
    /// to full, at least the minimum idle TTL; `None` (never) when it does not refill.
    fn bucket_expiry(&self, p: &BucketParams, s: &BucketState) -> Option<u64> {
        let ttl = bucket::idle_ttl_ms(p, s);
        (ttl != u64::MAX).then(|| s.ts_ms.saturating_add(ttl.max(self.min_idle_ttl_ms)))
    }

    /// A hold on token buckets, as `hold.lua`: a live record of the id answers the same
    /// request again (peeks) and refuses another; else all or nothing as
    /// [`decide_all`](Self::decide_all), and a record when held.
    fn make_hold(&self, req: &HoldRequest) -> Result<HoldOutcome, StoreError> {
        req.validate()?;
        let now = req.now_ms.unwrap_or_else(|| (self.clock)());
        let tenant = &req.limits[0].bucket.tenant;
        let mut shard = self.tenant_shard(tenant);
        let shard = &mut *shard;
        shard.tick(now);
        let key = (tenant.clone(), req.id.clone());
        let found = shard.hold_records.get(&key);
        let create = hold::create(now, found, &req.limits, req.cost, req.ttl_ms);
        if create == Create::Refused {
            return Err(StoreError::Rejected {
                reason: hold::HOLD_ID_TAKEN.into(),
            });
        }
        if let Limit::Concurrency { limit } = req.limits[0].limit {
            return Ok(self.take_slot(shard, req, limit, now, create));
        }
        let mut inputs = Vec::with_capacity(req.limits.len());
        for l in &req.limits {
            let Limit::TokenBucket(fallback) = l.limit else {
                return Err(StoreError::Rejected {
                    reason: "a hold's limits are token buckets or one concurrency limit".into(),
                });
            };
            inputs.push(shard.bucket_at(&l.bucket, fallback, now));
        }
        match create {
            Create::Refused => {
                return Err(StoreError::Rejected {
                    reason: hold::HOLD_ID_TAKEN.into(),
                })
            }
            Create::Replay { expires_at_ms } => {
                return Ok(HoldOutcome {
                    decisions: inputs
                        .iter()
                        .map(|(p, s)| bucket::decide(now, p, s.as_ref(), 0).0)
                        .collect(),
                    held: true,
                    expires_at_ms,
                    replayed: true,
                })
            }
            Create::Fresh => {}
        }
        for (i, ((p, _), l)) in inputs.iter().zip(&req.limits).enumerate() {
            if let Err(e) = bucket::check_debt_limit(p, l.debt_limit_ut) {
                return Err(StoreError::Rejected {
                    reason: format!("limit {}: {e}", i + 1),
                });
            }
        }
        let outcomes = bucket::decide_all(now, &inputs, req.cost);
        let held = outcomes.iter().all(|o| o.decision.allowed);
        for ((o, (p, _)), l) in outcomes.iter().zip(&inputs).zip(&req.limits) {
            let Some(s) = o.state else { continue };
            let (ad, dn) = if held { (req.cost, 0) } else { (0, req.cost) };
            let expires = self.bucket_expiry(p, &s);
            let k = (l.bucket.clone(), StateKind::Bucket);
            shard.record(
                k,
                now,
                State::Bucket(s),
                Limit::TokenBucket(*p),
                expires,
                ad,
                dn,
            );
        }
        if held {
            let r = HoldRecord::open(now, req.limits.clone(), req.cost, req.ttl_ms);
            shard.hold_records.insert(key, r);
        }
        Ok(HoldOutcome {
            decisions: outcomes.into_iter().map(|o| o.decision).collect(),
            held,
            expires_at_ms: now.saturating_add(req.ttl_ms),
            replayed: false,
        })
    }

    /// A concurrency hold, as `hold.lua`: one slot while fewer than the limit in force are live
    /// (the acquisition counted admitted or denied), or the replay's peek.
    fn take_slot(
        &self,
        shard: &mut Shard,
        req: &HoldRequest,
        fallback: u64,
        now: u64,
        create: Create,
    ) -> HoldOutcome {
        let l = &req.limits[0];
        let limit = shard.slots_limit(&l.bucket, fallback, now);
        if let Create::Replay { expires_at_ms } = create {
            let slots = shard.slots(&l.bucket, now);
            return HoldOutcome {
                decisions: vec![
                    slots.map_or(Slots::default().peek(now, limit), |s| s.peek(now, limit))
                ],
                held: true,
                expires_at_ms,
                replayed: true,
            };
        }
        let mut slots = shard.take_slots(&l.bucket, now);
        let expires_at_ms = now.saturating_add(req.ttl_ms);
        let d = slots.acquire(now, limit, &req.id, expires_at_ms);
        // Kept while a slot lives, and the usage at least the minimum idle TTL.
        let kept = slots
            .latest_expiry(now)
            .unwrap_or(0)
            .max(now.saturating_add(self.min_idle_ttl_ms));
        let k = (l.bucket.clone(), StateKind::Slots);
        let (ad, dn) = if d.allowed { (1, 0) } else { (0, 1) };
        shard.record(k, now, State::Slots(slots), l.limit, Some(kept), ad, dn);
        if d.allowed {
            let r = HoldRecord::open(now, req.limits.clone(), req.cost, req.ttl_ms);
            shard
                .hold_records
                .insert((l.bucket.tenant.clone(), req.id.clone()), r);
        }
        HoldOutcome {
            decisions: vec![d],
            held: d.allowed,
            expires_at_ms,
            replayed: false,
        }
    }

    /// Settles or releases a hold, as `settle.lua`: on each bucket the excess charged (usage
    /// as a charge's) or the difference refunded (taken off the admitted count).
    fn end_hold(
        &self,
        tenant: &TenantId,
        id: &str,
        what: Finish,
        now_ms: Option<u64>,
    ) -> Result<Settled, StoreError> {
        let now = now_ms.unwrap_or_else(|| (self.clock)());
        let mut shard = self.tenant_shard(tenant);
        let shard = &mut *shard;
        shard.tick(now);
        let key = (tenant.clone(), id.to_string());
        let found = shard.hold_records.get(&key);
        let limits_of = |r: &HoldRecord<HoldLimit>, results: Vec<hold::BucketResult>| {
            r.limits
                .iter()
                .zip(results)
                .map(|(l, x)| SettledLimit::of(l.bucket.clone(), x))
                .collect()
        };
        let record = match hold::finish(now, found, what) {
            Verdict::Unknown => return Ok(Settled::Unknown),
            Verdict::Expired { expired_at_ms } => return Ok(Settled::Expired { expired_at_ms }),
            Verdict::Conflict(why) => return Ok(Settled::Conflict(why)),
            Verdict::Replay(results) => {
                let limits = found.map_or_else(Vec::new, |r| limits_of(r, results));
                return Ok(Settled::Done {
                    limits,
                    replayed: true,
                });
            }
            Verdict::Apply => match shard.hold_records.remove(&key) {
                Some(r) => r,
                None => return Ok(Settled::Unknown),
            },
        };
        let actual = what.actual();
        let mut results = Vec::with_capacity(record.limits.len());
        for l in &record.limits {
            if let Limit::Concurrency { limit } = l.limit {
                // The slot freed, whatever the actual cost.
                let limit = shard.slots_limit(&l.bucket, limit, now);
                let k = (l.bucket.clone(), StateKind::Slots);
                let live = match shard.states.get_mut(&k).filter(|e| e.live_at(now)) {
                    Some(Entry {
                        state: State::Slots(s),
                        ..
                    }) => {
                        s.release(id);
                        s.live(now)
                    }
                    _ => 0,
                };
                results.push(hold::BucketResult::slot_freed(limit.saturating_sub(live)));
                continue;
            }
            let Limit::TokenBucket(fallback) = l.limit else {
                continue;
            };
            let (p, state) = shard.bucket_at(&l.bucket, fallback, now);
            let done = hold::settle_bucket(
                now,
                &p,
                state.as_ref(),
                l.debt_limit_ut,
                record.cost,
                actual,
            );
            results.push(done.result);
            let Some(s) = done.state else { continue };
            let k = (l.bucket.clone(), StateKind::Bucket);
            if actual > record.cost {
                let expires = self.bucket_expiry(&p, &s);
                let limit = Limit::TokenBucket(p);
                shard.record(
                    k,
                    now,
                    State::Bucket(s),
                    limit,
                    expires,
                    done.admitted,
                    done.denied,
                );
            } else if let Some(e) = shard.states.get_mut(&k).filter(|e| e.live_at(now)) {
                // A refund keeps the expiry, as refund.lua's KEEPTTL.
                e.state = State::Bucket(s);
                e.limit = Limit::TokenBucket(p);
                e.admitted = e.admitted.saturating_sub(done.unadmitted);
            }
        }
        let limits = limits_of(&record, results.clone());
        shard
            .hold_records
            .insert(key, record.ended(now, what, results));
        Ok(Settled::Done {
            limits,
            replayed: false,
        })
    }

    /// A changed policy: the new bucket (no state yet, or decided only on the fallback) keeps
    /// what the bucket it replaces had spent, as `set_params.lua` does.
    fn carry_over(&self, shard: &mut Shard, req: &SetParams, now: u64) {
        if let (Some(old), Limit::SlidingWindow { .. }) = (req.replaced(), req.limit) {
            return self.carry_over_window(shard, req, &old, now);
        }
        let (Some(old), Limit::TokenBucket(new_share)) = (req.replaced(), req.limit) else {
            return;
        };
        let new_key = (req.bucket.clone(), StateKind::Bucket);
        let stored =
            matches!(shard.params.get(&req.bucket), Some((p, _)) if p.kind() == StateKind::Bucket);
        let new_entry = shard.states.get(&new_key).filter(|e| e.live_at(now));
        if new_entry.is_some() && stored {
            return;
        }
        let Some(old_entry) = shard
            .states
            .get(&(old.clone(), StateKind::Bucket))
            .filter(|e| e.live_at(now))
        else {
            return;
        };
        // The old bucket's parameters in force now: stored ones (the floor from their lease
        // end on), else its latest decision's.
        let old_limit = match shard.params.get(&old) {
            Some(&(p, Some((end, floor)))) if p.kind() == StateKind::Bucket && now >= end => floor,
            Some(&(p, _)) if p.kind() == StateKind::Bucket => p,
            _ => old_entry.limit,
        };
        let (Limit::TokenBucket(old_p), State::Bucket(old_s)) = (old_limit, &old_entry.state)
        else {
            return;
        };
        let new_p = match req.lease {
            Some(l) if l.end_at(now) <= now => match l.floor {
                Limit::TokenBucket(f) => f,
                Limit::SlidingWindow { .. } | Limit::Concurrency { .. } => return,
            },
            _ => new_share,
        };
        // As set_params.lua: nothing spent, or a new bucket of capacity 0 with nothing owed,
        // needs no state.
        let old_level = bucket::refill(now, &old_p, Some(old_s)).level_ut();
        let spent = old_p.capacity_ut as i64 - old_level;
        if spent <= 0 || (new_entry.is_none() && new_p.capacity_ut == 0 && old_level >= 0) {
            return;
        }
        let prev = new_entry.and_then(|e| match &e.state {
            State::Bucket(s) => Some(*s),
            State::Window(_) | State::Slots(_) => None,
        });
        let s = bucket::carry_over(now, &old_p, old_s, &new_p, prev.as_ref());
        let ttl = bucket::idle_ttl_ms(&new_p, &s);
        let expires =
            (ttl != u64::MAX).then(|| s.ts_ms.saturating_add(ttl.max(self.min_idle_ttl_ms)));
        match shard.states.get_mut(&new_key).filter(|e| e.live_at(now)) {
            Some(e) => {
                e.state = State::Bucket(s);
                // Never shortened, as set_params.lua lengthens only.
                e.expires_at_ms = match (e.expires_at_ms, expires) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    _ => None,
                };
            }
            None => {
                let e = Entry {
                    state: State::Bucket(s),
                    expires_at_ms: expires,
                    admitted: 0,
                    denied: 0,
                    listed: false,
                    limit: Limit::TokenBucket(new_p),
                };
                shard.states.insert(new_key, e);
            }
        }
    }

    /// A changed sliding-window policy: a new window without state keeps what the old one
    /// (with stored parameters) still counts, as `set_params.lua` does.
    fn carry_over_window(&self, shard: &mut Shard, req: &SetParams, old: &BucketRef, now: u64) {
        let new_key = (req.bucket.clone(), StateKind::Window);
        if shard.states.get(&new_key).is_some_and(|e| e.live_at(now)) {
            return;
        }
        let old_limit = match shard.params.get(old) {
            Some(&(p, Some((end, floor)))) if p.kind() == StateKind::Window && now >= end => floor,
            Some(&(p, _)) if p.kind() == StateKind::Window => p,
            _ => return,
        };
        let Some(State::Window(old_s)) = shard
            .states
            .get(&(old.clone(), StateKind::Window))
            .filter(|e| e.live_at(now))
            .map(|e| &e.state)
        else {
            return;
        };
        let new_limit = match req.lease {
            Some(l) if l.end_at(now) <= now => l.floor,
            _ => req.limit,
        };
        let (
            Limit::SlidingWindow {
                limit: ol,
                window_ms: ow,
            },
            Limit::SlidingWindow {
                limit: nl,
                window_ms: nw,
            },
        ) = (old_limit, new_limit)
        else {
            return;
        };
        let (old_p, new_p) = (
            WindowParams {
                limit: ol,
                window_ms: ow,
            },
            WindowParams {
                limit: nl,
                window_ms: nw,
            },
        );
        let Some(s) = window::carry_over(now, &old_p, old_s, &new_p) else {
            return;
        };
        let ttl = window::idle_ttl_ms(&new_p, &s).max(self.min_idle_ttl_ms);
        let e = Entry {
            expires_at_ms: Some(s.ts_ms.saturating_add(ttl)),
            state: State::Window(s),
            admitted: 0,
            denied: 0,
            listed: false,
            limit: new_limit,
        };
        shard.states.insert(new_key, e);
    }

    /// New sliding-window parameters above the ones they replace (this bucket's, else those of
    /// the version a changed policy replaces) hold the replaced limit for a window, as
    /// `set_params.lua` records it with the parameters.
    fn hold_raise(&self, shard: &mut Shard, req: &SetParams, now: u64) {
        let Limit::SlidingWindow { limit, window_ms } = req.limit else {
            shard.holds.remove(&req.bucket);
            return;
        };
        let (mut top, mut hold_ms) = (limit, window_ms);
        if let Some(Limit::SlidingWindow { limit, window_ms }) = req.lease.map(|l| l.floor) {
            top = top.max(limit);
            hold_ms = hold_ms.max(window_ms);
        }
        let in_force = |b: &BucketRef| match shard.params.get(b) {
            Some(&(p, lease)) if p.kind() == StateKind::Window => {
                let p = match lease {
                    Some((end, floor)) if now >= end => floor,
                    _ => p,
                };
                let Limit::SlidingWindow { limit, .. } = p else {
                    return None;
                };
                Some((limit, shard.holds.get(b).copied()))
            }
            _ => None,
        };
        let old = in_force(&req.bucket).or_else(|| req.replaced().and_then(|o| in_force(&o)));
        match window::held_raise(now, old, top, hold_ms) {
            Some(h) => shard.holds.insert(req.bucket.clone(), h),
            None => shard.holds.remove(&req.bucket),
        };
    }

    fn decide(&self, req: &CheckRequest) -> Result<Decision, StoreError> {
        self.decide_batch(req, 1).map(|(d, _)| d)
    }

    /// A decision that spends up to `batch` multiples of the cost (a token bucket's
    /// reservation, as `token_bucket.lua` with its batch argument): the decision and the
    /// multiples spent.
    fn decide_batch(&self, req: &CheckRequest, batch: u64) -> Result<(Decision, u64), StoreError> {
        req.validate()?;
        crate::validate_batch(req, batch)?;
        let now = req.now_ms.unwrap_or_else(|| (self.clock)());
        let kind = req.limit.kind();
        let mut shard = self.shard(&req.bucket);
        let shard = &mut *shard;
        // Stored parameters of the same kind win over the fallback, as in the scripts; from
        // their lease end on, their floor does.
        let limit = match shard.params.get(&req.bucket) {
            Some(&(p, Some((end, floor)))) if p.kind() == kind && now >= end => floor,
            Some(&(p, _)) if p.kind() == kind => p,
            _ => req.limit,
        };
        let held = match shard.params.get(&req.bucket) {
            Some((p, _)) if p.kind() == kind => shard.holds.get(&req.bucket).copied(),
            _ => None,
        };
        shard.latest_ms = shard.latest_ms.max(now);
        shard.since_sweep += 1;
        if shard.since_sweep > shard.len_after_sweep.max(1024) {
            shard.sweep();
        }
        let key = (req.bucket.clone(), kind);
        let entry = shard.states.get(&key).filter(|e| e.live_at(now));
        let (decision, granted, state, ttl) =
            self.step(now, (limit, held), entry.map(|e| &e.state), req.cost, batch);
        if req.cost == 0 {
            // A peek: describe the state, keep nothing.
            return Ok((decision, 0));
        }
        // Idle time counts from the latest time the state has seen: a request with a clock
        // stepping back must not bring the expiry forward.
        let latest = match &state {
            State::Bucket(s) => s.ts_ms,
            State::Window(s) => s.ts_ms,
            State::Slots(_) => now,
        };
        let expires_at_ms = ttl.map(|t| latest.saturating_add(t));
        let (admitted, denied) = if decision.allowed {
            (granted * req.cost, 0)
        } else {
            (0, req.cost)
        };
        shard.record(key, now, state, limit, expires_at_ms, admitted, denied);
        Ok((decision, granted))
    }

    /// A charge into bounded debt, as `charge.lua`: refused when the capacity in force plus
    /// the debt limit is out of bounds; a replay of an id answers the first charge's applied
    /// and clamped tokens with the bucket as it stands, and stores nothing (refused when its
    /// cost differs: an id names one charge).
    fn charge_bucket(&self, req: &ChargeRequest) -> Result<ChargeOutcome, StoreError> {
        req.validate()?;
        let now = req.now_ms.unwrap_or_else(|| (self.clock)());
        let mut shard = self.shard(&req.bucket);
        let shard = &mut *shard;
        let p = match shard.params.get(&req.bucket) {
            Some(&(Limit::TokenBucket(_), Some((end, Limit::TokenBucket(floor)))))
                if now >= end =>
            {
                floor
            }
            Some(&(Limit::TokenBucket(p), _)) => p,
            _ => req.params,
        };
        let rejected = |e: bucket::ChargeError| StoreError::Rejected {
            reason: e.to_string(),
        };
        bucket::check_debt_limit(&p, req.debt_limit_ut).map_err(rejected)?;
        shard.latest_ms = shard.latest_ms.max(now);
        shard.since_sweep += 1;
        if shard.since_sweep > shard.len_after_sweep.max(1024) {
            shard.sweep();
        }
        let key = (req.bucket.clone(), StateKind::Bucket);
        let prev = shard
            .states
            .get(&key)
            .filter(|e| e.live_at(now))
            .and_then(|e| match &e.state {
                State::Bucket(s) => Some(*s),
                State::Window(_) | State::Slots(_) => None,
            });
        let once = req.id.as_ref().map(|id| (req.bucket.clone(), id.clone()));
        if let Some(&(applied, clamped, _)) = once
            .as_ref()
            .and_then(|k| shard.charges.get(k))
            .filter(|&&(_, _, until)| now < until)
        {
            if applied + clamped != req.cost {
                return Err(StoreError::Rejected {
                    reason: "the charge id was used for a charge of another cost".into(),
                });
            }
            return Ok(bucket::charge_replayed(
                now,
                &p,
                prev.as_ref(),
                applied,
                clamped,
            ));
        }
        let (o, s) = bucket::charge(now, &p, prev.as_ref(), req.cost, req.debt_limit_ut)
            .map_err(rejected)?;
        let ttl = bucket::idle_ttl_ms(&p, &s);
        let expires_at_ms =
            (ttl != u64::MAX).then(|| s.ts_ms.saturating_add(ttl.max(self.min_idle_ttl_ms)));
        let limit = Limit::TokenBucket(p);
        shard.record(
            key,
            now,
            State::Bucket(s),
            limit,
            expires_at_ms,
            o.applied,
            o.clamped,
        );
        if let Some(k) = once {
            shard
                .charges
                .insert(k, (o.applied, o.clamped, now.saturating_add(ONCE_KEY_MS)));
        }
        Ok(o)
    }

    /// Gives `tokens` of a reservation back to a token bucket, as `refund.lua`: the bucket's
    /// remaining whole tokens after, `None` when it has no state (it is full).
    fn give_back(
        &self,
        bucket: &BucketRef,
        tokens: u64,
        now_ms: Option<u64>,
    ) -> Result<Option<u64>, StoreError> {
        crate::validate_refund(tokens, now_ms)?;
        let now = now_ms.unwrap_or_else(|| (self.clock)());
        let mut shard = self.shard(bucket);
        let key = (bucket.clone(), StateKind::Bucket);
        let stored = shard.params.get(bucket).copied();
        let Some(e) = shard.states.get_mut(&key).filter(|e| e.live_at(now)) else {
            return Ok(None);
        };
        let State::Bucket(prev) = e.state else {
            return Ok(None);
        };
        // Stored parameters win (the scripts keep their copy in the state), from their lease
        // end on their floor; else those of the latest decision.
        let limit = match stored {
            Some((p, Some((end, floor)))) if p.kind() == StateKind::Bucket && now >= end => floor,
            Some((p, _)) if p.kind() == StateKind::Bucket => p,
            _ => e.limit,
        };
        let Limit::TokenBucket(p) = limit else {
            return Ok(None);
        };
        let Some(next) = bucket::refund(now, &p, Some(&prev), tokens) else {
            return Ok(None);
        };
        e.state = State::Bucket(next);
        e.admitted = e.admitted.saturating_sub(tokens);
        // 0 still in debt.
        Ok(Some(next.tokens_ut / bucket::UT))
    }

    /// Several token buckets of one tenant at once, all or nothing, as `token_buckets.lua`.
    fn decide_all(&self, req: &MultiCheckRequest) -> Result<Vec<Decision>, StoreError> {
        req.validate()?;
        let now = req.now_ms.unwrap_or_else(|| (self.clock)());
        // One tenant: one shard holds every bucket.
        let mut shard = self.shard(&req.limits[0].bucket);
        let shard = &mut *shard;
        shard.latest_ms = shard.latest_ms.max(now);
        shard.since_sweep += 1;
        if shard.since_sweep > shard.len_after_sweep.max(1024) {
            shard.sweep();
        }
        let mut inputs = Vec::with_capacity(req.limits.len());
        for l in &req.limits {
            let limit = match shard.params.get(&l.bucket) {
                Some(&(p, Some((end, floor)))) if p.kind() == StateKind::Bucket && now >= end => {
                    floor
                }
                Some(&(p, _)) if p.kind() == StateKind::Bucket => p,
                _ => l.limit,
            };
            let Limit::TokenBucket(p) = limit else {
                return Err(StoreError::Rejected {
                    reason: "several limits at once are token buckets".into(),
                });
            };
            let state = shard
                .states
                .get(&(l.bucket.clone(), StateKind::Bucket))
                .filter(|e| e.live_at(now))
                .and_then(|e| match &e.state {
                    State::Bucket(s) => Some(*s),
                    State::Window(_) | State::Slots(_) => None,
                });
            inputs.push((p, state));
        }
        let outcomes = bucket::decide_all(now, &inputs, req.cost);
        let admitted = outcomes.iter().all(|o| o.decision.allowed);
        for ((o, (p, _)), l) in outcomes.iter().zip(&inputs).zip(&req.limits) {
            let Some(s) = o.state else { continue };
            let ttl = bucket::idle_ttl_ms(p, &s);
            let expires_at_ms =
                (ttl != u64::MAX).then(|| s.ts_ms.saturating_add(ttl.max(self.min_idle_ttl_ms)));
            let (ad, dn) = if admitted {
                (req.cost, 0)
            } else {
                (0, req.cost)
            };
            let key = (l.bucket.clone(), StateKind::Bucket);
            let limit = Limit::TokenBucket(*p);
            shard.record(key, now, State::Bucket(s), limit, expires_at_ms, ad, dn);
        }
        Ok(outcomes.into_iter().map(|o| o.decision).collect())
    }

    /// One decision on `prev` (a state of the other kind counts as none) under `limit` and the
    /// raise its parameters hold: the decision, the new state and its idle TTL (`None`: it must
    /// not expire).
    fn step(
        &self,
        now: u64,
        (limit, held): (Limit, Option<HeldRaise>),
        prev: Option<&State>,
        cost: u64,
        batch: u64,
    ) -> (Decision, u64, State, Option<u64>) {
        match limit {
            Limit::TokenBucket(p) => {
                let prev = match prev {
                    Some(State::Bucket(s)) => Some(s),
                    _ => None,
                };
                let (d, granted, s) = bucket::reserve(now, &p, prev, cost, batch);
                let ttl = bucket::idle_ttl_ms(&p, &s);
                let ttl = (ttl != u64::MAX).then_some(ttl.max(self.min_idle_ttl_ms));
                (d, granted, State::Bucket(s), ttl)
            }
            Limit::SlidingWindow { limit, window_ms } => {
                let prev = match prev {
                    Some(State::Window(s)) => Some(s),
                    _ => None,
                };
                let p = WindowParams { limit, window_ms };
                let (d, s) = window::decide_held(now, &p, held.as_ref(), prev, cost);
                let ttl = window::idle_ttl_ms(&p, &s);
                let granted = u64::from(d.allowed && cost > 0);
                (
                    d,
                    granted,
                    State::Window(s),
                    Some(ttl.max(self.min_idle_ttl_ms)),
                )
            }
            Limit::Concurrency { .. } => {
                unreachable!("CheckRequest::validate refuses a check of a concurrency limit")
            }
        }
    }
}

fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding a shard cannot leave it half-updated (each update is a few plain
    // assignments), so a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Store for EmbeddedStore {
    async fn check(&self, req: &CheckRequest) -> Result<Decision, StoreError> {
        self.decide(req)
    }

    async fn check_all(&self, req: &MultiCheckRequest) -> Result<Vec<Decision>, StoreError> {
        self.decide_all(req)
    }

    async fn reserve(&self, req: &CheckRequest, batch: u64) -> Result<(Decision, u64), StoreError> {
        self.decide_batch(req, batch)
    }

    async fn charge(&self, req: &ChargeRequest) -> Result<ChargeOutcome, StoreError> {
        self.charge_bucket(req)
    }

    async fn refund(
        &self,
        bucket: &BucketRef,
        tokens: u64,
        now_ms: Option<u64>,
    ) -> Result<Option<u64>, StoreError> {
        self.give_back(bucket, tokens, now_ms)
    }

    async fn hold(&self, req: &HoldRequest) -> Result<HoldOutcome, StoreError> {
        self.make_hold(req)
    }

    async fn settle(&self, req: &SettleRequest) -> Result<Settled, StoreError> {
        req.validate()?;
        let what = Finish::Settle { actual: req.cost };
        self.end_hold(&req.tenant, &req.id, what, req.now_ms)
    }

    async fn release(&self, req: &ReleaseRequest) -> Result<Settled, StoreError> {
        req.validate()?;
        self.end_hold(&req.tenant, &req.id, Finish::Release, req.now_ms)
    }

    async fn in_flight(&self, bucket: &BucketRef, now_ms: Option<u64>) -> Result<u64, StoreError> {
        crate::validate_now(now_ms)?;
        let now = now_ms.unwrap_or_else(|| (self.clock)());
        Ok(self
            .shard(bucket)
            .slots(bucket, now)
            .map_or(0, |s| s.live(now)))
    }

    async fn set_params(&self, req: &SetParams) -> Result<(), StoreError> {
        req.validate()?;
        let now = req.now_ms.unwrap_or_else(|| (self.clock)());
        // The end as set_params.lua stores it: never past the latest end the caller allows.
        let lease = req.lease.map(|l| (l.end_at(now), l.floor));
        let mut shard = self.shard(&req.bucket);
        if let Some(reason) = Fence::refuses(shard.fences.get(&req.bucket).copied(), req.fence) {
            return Err(StoreError::Fenced { reason });
        }
        self.carry_over(&mut shard, req, now);
        self.hold_raise(&mut shard, req, now);
        if let Limit::TokenBucket(p) = req.limit {
            // A carry counted in another period is dropped now, as set_params.lua does when it
            // rewrites the state's copy of the parameters.
            let key = (req.bucket.clone(), StateKind::Bucket);
            if let Some(e) = shard.states.get_mut(&key).filter(|e| e.live_at(now)) {
                if let State::Bucket(s) = &mut e.state {
                    *s = s.in_period(p.period_ms);
                }
            }
        }
        shard.params.insert(req.bucket.clone(), (req.limit, lease));
        match req.fence {
            Some(f) => shard.fences.insert(req.bucket.clone(), f),
            None => shard.fences.remove(&req.bucket),
        };
        Ok(())
    }

    async fn clear_params(&self, bucket: &BucketRef) -> Result<(), StoreError> {
        let mut s = self.shard(bucket);
        s.params.remove(bucket);
        s.fences.remove(bucket);
        s.holds.remove(bucket);
        for kind in [StateKind::Bucket, StateKind::Window, StateKind::Slots] {
            // The activity list drops keys without a state at the next collection or sweep.
            s.states.remove(&(bucket.clone(), kind));
        }
        Ok(())
    }

    /// In process: what was written stays for the life of the store.
    async fn instance(&self) -> Result<String, StoreError> {
        Ok("embedded".to_string())
    }

    async fn clock_ms(&self) -> Result<u64, StoreError> {
        Ok((self.clock)())
    }

    async fn list_params(&self) -> Result<Vec<BucketRef>, StoreError> {
        Ok(self
            .shards
            .iter()
            .flat_map(|s| lock(s).params.keys().cloned().collect::<Vec<_>>())
            .collect())
    }

    async fn collect_usage(&self, max: usize) -> Result<Vec<UsageRecord>, StoreError> {
        let mut out = Vec::new();
        for s in self.shards.iter() {
            if out.len() >= max {
                break;
            }
            let mut s = lock(s);
            let s = &mut *s;
            let take = (max - out.len()).min(s.active.len());
            let keys: Vec<StateKey> = s.active.drain(..take).collect();
            for key in keys {
                if let Some(e) = s.states.get_mut(&key) {
                    // A refund can take the counters back to 0: nothing to report then.
                    let used = e.admitted.saturating_add(e.denied) > 0;
                    if e.listed && used && e.live_at(s.latest_ms) {
                        out.push(UsageRecord {
                            bucket: key.0.clone(),
                            admitted: e.admitted,
                            denied: e.denied,
                        });
                    }
                    e.admitted = 0;
                    e.denied = 0;
                    e.listed = false;
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use quota_core::bucket::UT;
    use quota_core::{BucketParams, PolicyName, TenantId};

    use super::*;

    fn bucket(t: &str) -> BucketRef {
        BucketRef {
            tenant: TenantId::new(t).unwrap(),
            policy: PolicyName::new("writes").unwrap(),
            version: 1,
        }
    }

    fn req(b: &BucketRef, cap: u64, rate: u64, now: Option<u64>) -> CheckRequest {
        CheckRequest {
            bucket: b.clone(),
            limit: Limit::TokenBucket(BucketParams::new(cap * UT, rate * UT).unwrap()),
            cost: 1,
            now_ms: now,
        }
    }

    #[tokio::test]
    async fn idle_buckets_are_evicted_and_come_back_full() {
        let now = Arc::new(AtomicU64::new(0));
        let n = now.clone();
        let s = EmbeddedStore::with_shards(Arc::new(move || n.load(Ordering::SeqCst)), 4)
            .with_min_idle_ttl(1000);
        for i in 0..5000 {
            let d = s
                .check(&req(&bucket(&format!("t{i}")), 2, 1, None))
                .await
                .unwrap();
            assert!(d.allowed);
        }
        assert_eq!(s.len(), 5000);
        // Time to refill one token is 1 s; with the 1 s minimum TTL all are gone after it.
        now.store(1000, Ordering::SeqCst);
        s.evict_expired(1000);
        assert_eq!(s.len(), 0);
        let d = s.check(&req(&bucket("t1"), 2, 1, None)).await.unwrap();
        assert_eq!(d.remaining, 1);
    }

    #[tokio::test]
    async fn sweeps_keep_memory_bounded_without_explicit_eviction() {
        let s = EmbeddedStore::with_shards(system_clock(), 1).with_min_idle_ttl(1000);
        for i in 0..20_000u64 {
            // Each one-shot identity arrives 1 s after the previous: all earlier ones expired.
            s.check(&req(&bucket(&format!("t{i}")), 1, 1, Some(i * 1000)))
                .await
                .unwrap();
        }
        assert!(s.len() <= 2 * 1024 + 1, "{}", s.len());
        let usage = s.collect_usage(usize::MAX).await.unwrap();
        assert!(usage.len() <= s.len());
    }

    #[tokio::test]
    async fn a_bucket_in_debt_is_evicted_only_once_full() {
        let s = EmbeddedStore::with_shards(system_clock(), 1).with_min_idle_ttl(1000);
        let b = bucket("owing");
        let p = BucketParams::new(10 * UT, UT).unwrap();
        let o = s
            .charge(&ChargeRequest::new(b.clone(), p, 15, 10 * UT).at(0))
            .await
            .unwrap();
        assert_eq!(o.debt, 5);
        // 5 owed and 10 to fill at 1 a second: 15 s.
        s.evict_expired(14_999);
        assert_eq!(s.len(), 1);
        s.evict_expired(15_000);
        assert_eq!(s.len(), 0);
    }

    #[tokio::test]
    async fn a_dry_bucket_is_never_evicted() {
        let s = EmbeddedStore::with_shards(system_clock(), 1);
        let b = bucket("dry");
        s.check(&req(&b, 1, 0, Some(0))).await.unwrap();
        s.evict_expired(u64::MAX / 2);
        let d = s.check(&req(&b, 1, 0, Some(u64::MAX / 4))).await;
        assert!(d.is_err()); // now beyond 2^53 is invalid
        let d = s.check(&req(&b, 1, 0, Some(1 << 52))).await.unwrap();
        assert!(!d.allowed);
    }
}
