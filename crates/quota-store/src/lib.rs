//! quota-store: where regional decisions are made.
//!
//! A [`Store`] decides one request atomically against a token bucket or a sliding window,
//! charges a token bucket for work already done (into bounded debt, [`ChargeRequest`]), holds
//! an estimate on token buckets and settles it later at the actual cost ([`HoldRequest`],
//! [`SettleRequest`]), takes and gives back the slots of a concurrency limit (a hold of one
//! slot, [`Limit::Concurrency`]), holds this region's parameters for each bucket (written by
//! the region agent), and hands out the usage (admitted and denied tokens, or slot
//! acquisitions, per bucket) recorded since the previous collection.
//!
//! Two implementations give the same decisions:
//!
//! - [`RedisStore`]: one EVALSHA of a script in `lua/` per call (`token_bucket.lua`,
//!   `sliding_window.lua`, `hold.lua`, …) on the region's Redis (standalone or Cluster), reloading scripts on NOSCRIPT,
//!   reconnecting on its own, with a timeout on every call.
//! - [`EmbeddedStore`]: the same arithmetic from `quota-core` in process, for running without
//!   Redis (one region, development, higher-layer tests); sharded, with idle buckets evicted.
//!
//! [`AnyStore`] is either, chosen at start-up from configuration.
//!
//! # Layout
//! - [`script`]: the Lua sources, their argument encoding and reply decoding.
//! - [`hold`]: the requests and answers of holds (reserve, then settle).
//! - [`embedded`]: the in-process store.
//! - [`redis_store`]: the Redis store.

pub mod embedded;
pub mod hold;
pub mod redis_store;
pub mod script;

use quota_core::bucket::{self, MAX_CAPACITY_UT, MAX_LIMITS_PER_CHECK, UT};
use quota_core::keys::{self, StateKind};
use quota_core::{BucketParams, ChargeOutcome, Decision, PolicyName, TenantId, WindowParams};

pub use embedded::EmbeddedStore;
pub use hold::{
    HoldLimit, HoldOutcome, HoldRequest, ReleaseRequest, SettleRequest, Settled, SettledLimit,
};
pub use redis_store::{
    check_url, ClientIdentity, Credentials, RedisStore, RedisStoreConfig, Tls, TlsPart, Topology,
};

/// The largest cost of one request in whole tokens: `cost · UT` stays exact in a double.
pub const MAX_COST: u64 = MAX_CAPACITY_UT / UT;

/// The default minimum idle lifetime of a bucket or window state, in ms (configurable per store:
/// [`RedisStoreConfig::with_min_idle_ttl`], [`EmbeddedStore::with_min_idle_ttl`]). Usage
/// counters live in the state, so a bucket that goes idle keeps them at least this long:
/// collect usage more often than this or the usage of buckets idle for longer is lost. Larger
/// means more memory for one-shot identities. The decision scripts in `lua/` use the same
/// default when their caller passes none.
pub const DEFAULT_MIN_IDLE_TTL_MS: u64 = 60_000;

/// Which bucket: a tenant's policy at a policy version (the version is part of the key).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketRef {
    pub tenant: TenantId,
    pub policy: PolicyName,
    pub version: u64,
}

impl BucketRef {
    /// The Redis key of this bucket's parameters.
    pub fn params_key(&self) -> String {
        keys::params_key(&self.tenant, &self.policy, self.version)
    }

    /// The Redis key of this bucket's state of the given kind.
    pub fn state_key(&self, kind: StateKind) -> String {
        keys::state_key(kind, &self.tenant, &self.policy, self.version)
    }
}

/// What limit a check enforces when the store holds no parameters of its own for the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    TokenBucket(BucketParams),
    /// At most `limit` tokens in any `window_ms`.
    SlidingWindow {
        limit: u64,
        window_ms: u64,
    },
    /// At most `limit` holds in flight at once (a concurrency limit's slots), 0 to
    /// [`quota_core::policy::MAX_CONCURRENCY`]. Taken only with holds ([`Store::hold`]): a
    /// check of it is refused.
    Concurrency {
        limit: u64,
    },
}

impl Limit {
    /// The kind of state this limit keeps.
    pub fn kind(&self) -> StateKind {
        match self {
            Self::TokenBucket(_) => StateKind::Bucket,
            Self::SlidingWindow { .. } => StateKind::Window,
            Self::Concurrency { .. } => StateKind::Slots,
        }
    }

    /// Checks the bounds that keep the scripts' arithmetic exact (the fields are public, so a
    /// caller can build an out-of-range value).
    pub fn validate(&self) -> Result<(), StoreError> {
        match *self {
            Self::TokenBucket(p) => {
                BucketParams::per_period(p.capacity_ut, p.refill_ut, p.period_ms)
                    .map(|_| ())
                    .map_err(|e| StoreError::Rejected {
                        reason: e.to_string(),
                    })
            }
            Self::SlidingWindow { limit, window_ms } => WindowParams::new(limit, window_ms)
                .map(|_| ())
                .map_err(|e| StoreError::Rejected {
                    reason: e.to_string(),
                }),
            Self::Concurrency { limit } if limit > quota_core::policy::MAX_CONCURRENCY => {
                Err(StoreError::Rejected {
                    reason: format!(
                        "a concurrency limit of {limit} is above {}",
                        quota_core::policy::MAX_CONCURRENCY
                    ),
                })
            }
            Self::Concurrency { .. } => Ok(()),
        }
    }
}

impl From<quota_core::share::ShareLimit> for Limit {
    fn from(l: quota_core::share::ShareLimit) -> Self {
        use quota_core::share::ShareLimit as S;
        match l {
            S::TokenBucket(p) => Self::TokenBucket(p),
            S::SlidingWindow { limit, window_ms } => Self::SlidingWindow { limit, window_ms },
            S::Concurrency { limit } => Self::Concurrency { limit },
        }
    }
}

/// One decision request.
#[derive(Debug, Clone)]
pub struct CheckRequest {
    pub bucket: BucketRef,
    /// Fallback parameters, used when the store has none written for this bucket.
    pub limit: Limit,
    /// Whole tokens. 0 is a peek: the decision describes the state now (allowed, with the
    /// tokens left), nothing is spent, stored or counted.
    pub cost: u64,
    /// Explicit time for tests and the simulator; `None` uses the store's clock (Redis `TIME`).
    pub now_ms: Option<u64>,
}

impl CheckRequest {
    /// A peek at `bucket` (cost 0) on the store's clock.
    pub fn peek(bucket: BucketRef, limit: Limit) -> Self {
        Self {
            bucket,
            limit,
            cost: 0,
            now_ms: None,
        }
    }

    /// Rejects what the scripts would reject, before any I/O.
    pub fn validate(&self) -> Result<(), StoreError> {
        if matches!(self.limit, Limit::Concurrency { .. }) {
            return Err(StoreError::Rejected {
                reason: CONCURRENCY_BY_HOLDS.into(),
            });
        }
        if self.cost > MAX_COST {
            return Err(StoreError::Rejected {
                reason: format!("cost {} is outside 0..={MAX_COST}", self.cost),
            });
        }
        validate_now(self.now_ms)?;
        self.limit.validate()
    }
}

/// One limit of a [`MultiCheckRequest`]: a bucket and its fallback parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitCheck {
    pub bucket: BucketRef,
    /// Fallback parameters, used when the store has none written for this bucket.
    pub limit: Limit,
}

/// A check of several limits of one tenant at once, all or nothing
/// ([`quota_core::bucket::decide_all`]): the cost is spent on every bucket when every one admits
/// it, and on none otherwise. Token buckets only; one EVALSHA of `lua/token_buckets.lua` on
/// Redis (the tenant's keys share one hash slot).
#[derive(Debug, Clone)]
pub struct MultiCheckRequest {
    /// 1 to [`MAX_LIMITS_PER_CHECK`] limits of one tenant, each bucket once.
    pub limits: Vec<LimitCheck>,
    /// Whole tokens, spent on every limit; 0 is a peek of each.
    pub cost: u64,
    /// Explicit time for tests and the simulator; `None` uses the store's clock.
    pub now_ms: Option<u64>,
}

impl MultiCheckRequest {
    /// Rejects what `lua/token_buckets.lua` would reject, and limits of several tenants (their
    /// keys would not share a hash slot), before any I/O.
    pub fn validate(&self) -> Result<(), StoreError> {
        let rejected = |reason: String| Err(StoreError::Rejected { reason });
        let n = self.limits.len();
        if n == 0 || n as u64 > MAX_LIMITS_PER_CHECK {
            return rejected(format!(
                "{n} limits; a check decides 1..={MAX_LIMITS_PER_CHECK} at once"
            ));
        }
        if self.cost > MAX_COST {
            return rejected(format!("cost {} is outside 0..={MAX_COST}", self.cost));
        }
        validate_now(self.now_ms)?;
        let first = &self.limits[0].bucket.tenant;
        for (i, l) in self.limits.iter().enumerate() {
            if l.bucket.tenant != *first {
                return rejected("the limits of one check belong to one tenant".into());
            }
            match l.limit {
                Limit::TokenBucket(_) => {}
                Limit::SlidingWindow { .. } => {
                    return rejected(format!(
                        "limit {} is a sliding window; several limits at once are token buckets",
                        i + 1
                    ))
                }
                Limit::Concurrency { .. } => return rejected(CONCURRENCY_BY_HOLDS.into()),
            }
            l.limit.validate()?;
            if self.limits[..i].iter().any(|o| o.bucket == l.bucket) {
                return rejected(format!("limit {} repeats a bucket", i + 1));
            }
        }
        Ok(())
    }
}

/// Why a check of a concurrency limit is refused: its slots are taken and given back with
/// holds ([`Store::hold`], [`Store::release`]).
pub const CONCURRENCY_BY_HOLDS: &str = "a concurrency limit is taken with holds";

/// The longest id of a [`ChargeRequest`], in bytes.
pub const MAX_CHARGE_ID_LEN: usize = 128;

/// A charge for work already done (LLM tokens counted once a response ends), applied to a
/// token bucket even past the tokens left, down to `debt_limit_ut` below empty
/// ([`quota_core::bucket::charge`]; `lua/charge.lua` on Redis). While the bucket is in debt
/// every check of it is denied, with a retry time that covers the repayment; the refill and
/// refunds repay the debt first. What the limit keeps the bucket from taking is reported
/// (`clamped`), not dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargeRequest {
    pub bucket: BucketRef,
    /// Fallback parameters, used when the store has none written for this bucket.
    pub params: BucketParams,
    /// Whole tokens, 1 to [`MAX_COST`].
    pub cost: u64,
    /// How far below empty the charge may take the bucket, in micro-tokens. The capacity in
    /// force (stored, else `params`) plus this must be at most [`MAX_CAPACITY_UT`]; the store
    /// refuses a larger one and changes nothing.
    pub debt_limit_ut: u64,
    /// Explicit time for tests and the simulator; `None` uses the store's clock.
    pub now_ms: Option<u64>,
    /// Names this charge, so that a caller's retry applies it once: a charge of the same bucket
    /// with the same id within [`quota_core::bounds::ONCE_KEY_MS`] of the first changes
    /// nothing and answers what the first applied and clamped, with the bucket as it stands
    /// (one of another cost is refused: an id names one charge).
    /// 1 to [`MAX_CHARGE_ID_LEN`] printable ASCII characters, no space. Without one, the
    /// store's own retries still apply once.
    pub id: Option<String>,
}

impl ChargeRequest {
    /// A charge of `cost` on `bucket` (fallback `params`) down to `debt_limit_ut` below empty,
    /// on the store's clock, without an id.
    pub fn new(bucket: BucketRef, params: BucketParams, cost: u64, debt_limit_ut: u64) -> Self {
        Self {
            bucket,
            params,
            cost,
            debt_limit_ut,
            now_ms: None,
            id: None,
        }
    }

    /// The same at an explicit time.
    pub fn at(mut self, now_ms: u64) -> Self {
        self.now_ms = Some(now_ms);
        self
    }

    /// The same named `id` (see [`ChargeRequest::id`]).
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Rejects what `charge.lua` would reject, before any I/O (the debt limit against the
    /// fallback; the store checks it against the capacity in force too).
    pub fn validate(&self) -> Result<(), StoreError> {
        let rejected = |reason: String| Err(StoreError::Rejected { reason });
        if self.cost == 0 || self.cost > MAX_COST {
            return rejected(format!(
                "charge cost {} is outside 1..={MAX_COST}",
                self.cost
            ));
        }
        validate_now(self.now_ms)?;
        Limit::TokenBucket(self.params).validate()?;
        if let Err(e) = bucket::check_debt_limit(&self.params, self.debt_limit_ut) {
            return rejected(e.to_string());
        }
        if let Some(id) = &self.id {
            if id.is_empty()
                || id.len() > MAX_CHARGE_ID_LEN
                || !id.bytes().all(|b| b.is_ascii_graphic())
            {
                return rejected(format!(
                    "a charge id is 1..={MAX_CHARGE_ID_LEN} printable ASCII characters"
                ));
            }
        }
        Ok(())
    }
}

/// A reservation's batch within `token_bucket.lua`'s bounds: 1 or more, `cost · batch` at most
/// the largest cost, and a token bucket (1 is any check).
fn validate_batch(req: &CheckRequest, batch: u64) -> Result<(), StoreError> {
    let max = MAX_COST;
    if batch == 1 {
        return Ok(());
    }
    if batch == 0 || req.cost.saturating_mul(batch) > max {
        return Err(StoreError::Rejected {
            reason: format!("batch must be 1 or more with cost * batch at most {max}"),
        });
    }
    if !matches!(req.limit, Limit::TokenBucket(_)) {
        return Err(StoreError::Rejected {
            reason: "only token buckets take a batch".into(),
        });
    }
    Ok(())
}

/// A refund within `refund.lua`'s bounds.
fn validate_refund(tokens: u64, now_ms: Option<u64>) -> Result<(), StoreError> {
    let max = MAX_COST;
    if tokens == 0 || tokens > max {
        return Err(StoreError::Rejected {
            reason: format!("tokens must be in 1..={max}"),
        });
    }
    validate_now(now_ms)
}

fn validate_now(now_ms: Option<u64>) -> Result<(), StoreError> {
    match now_ms {
        Some(now) if now > MAX_CAPACITY_UT => Err(StoreError::Rejected {
            reason: format!("now {now} ms is too large"),
        }),
        _ => Ok(()),
    }
}

/// The end of the lease a region's parameters hold under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseEnd {
    /// How long from the store's now the parameters hold (ms).
    pub remaining_ms: u64,
    /// The limit in force from the lease end on (the region's floor); the same kind.
    pub floor: Limit,
    /// The latest end the store may keep, on its own clock (ms since the epoch): it keeps
    /// `min(now + remaining_ms, not_after_ms)`, so a write that runs late (queued behind a
    /// long pass, or sent before Redis stalled) still ends no later than the region's lease.
    /// `None`: `now + remaining_ms`.
    pub not_after_ms: Option<u64>,
}

impl LeaseEnd {
    /// Where a write the store runs at `now_ms` puts the lease end: `now_ms + remaining_ms`, or
    /// the latest end if that is earlier (at or before `now_ms`: the floor is in force at once).
    pub fn end_at(&self, now_ms: u64) -> u64 {
        let end = now_ms.saturating_add(self.remaining_ms);
        self.not_after_ms.map_or(end, |n| end.min(n))
    }
}

/// Parameters for one bucket, as the region agent writes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetParams {
    pub bucket: BucketRef,
    /// In force while the lease holds (always, without one).
    pub limit: Limit,
    /// `None`: no end (a single region's share is never given elsewhere). With a lease the
    /// store drops to the floor at its end by itself, so a region whose daemon died does not
    /// keep share the coordinator has given to other regions.
    pub lease: Option<LeaseEnd>,
    /// Explicit time for tests and the simulator; `None` uses the store's clock.
    pub now_ms: Option<u64>,
    /// The version of the same tenant's policy this bucket replaces (its terms changed): for a
    /// token bucket, what the old bucket had spent stays spent
    /// ([`quota_core::bucket::carry_over`]), while the new bucket has no state yet or was only
    /// decided on the fallback; for a sliding window, what the old window (with stored
    /// parameters) still counts stays counted ([`quota_core::window::carry_over`]), while the
    /// new window has no state yet.
    pub replaces: Option<u64>,
    /// The writer's fence and the allocation epoch written; `None` for a region agent that
    /// no other can replace (a single daemon). See [`Fence`].
    pub fence: Option<Fence>,
}

/// What a region agent's write is fenced by. Stored with the parameters: the store refuses
/// ([`StoreError::Fenced`]) a later write whose token is lower (its agent was deposed since),
/// whose epoch is lower (an older allocation landing late: a replaced connection, a write
/// timed out and run later), or that carries no fence where one is stored, and changes
/// nothing then.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fence {
    /// The agent role's fence, from the coordinator: higher for every later holder.
    pub token: u64,
    /// The allocation epoch the write carries.
    pub epoch: u64,
}

impl Fence {
    /// Why a write fenced by `write` may not replace parameters stored with `stored`, if it
    /// may not: the rule `set_params.lua` applies.
    pub fn refuses(stored: Option<Fence>, write: Option<Fence>) -> Option<String> {
        let stored = stored?;
        let Some(w) = write else {
            return Some(format!(
                "fenced: written by an agent with fence {}; this write has none",
                stored.token
            ));
        };
        if w.token < stored.token {
            return Some(format!(
                "fenced: fence {} is below the stored {}",
                w.token, stored.token
            ));
        }
        if w.epoch < stored.epoch {
            return Some(format!(
                "fenced: epoch {} is below the stored {}",
                w.epoch, stored.epoch
            ));
        }
        None
    }
}

impl SetParams {
    /// `limit` for `bucket` with no lease end, on the store's clock.
    pub fn new(bucket: BucketRef, limit: Limit) -> Self {
        Self {
            bucket,
            limit,
            lease: None,
            now_ms: None,
            replaces: None,
            fence: None,
        }
    }

    /// The same, fenced by `fence` (see [`Fence`]).
    pub fn fenced(mut self, fence: Fence) -> Self {
        self.fence = Some(fence);
        self
    }

    /// The same, replacing the bucket of `version` (see [`SetParams::replaces`]).
    pub fn replacing(mut self, version: u64) -> Self {
        self.replaces = Some(version);
        self
    }

    /// The bucket this one replaces, if any, and not itself.
    pub fn replaced(&self) -> Option<BucketRef> {
        self.replaces
            .filter(|&v| v != self.bucket.version)
            .map(|version| BucketRef {
                version,
                ..self.bucket.clone()
            })
    }

    /// The same, holding for `remaining_ms` and then falling back to `floor`.
    pub fn with_lease(mut self, remaining_ms: u64, floor: Limit) -> Self {
        self.lease = Some(LeaseEnd {
            remaining_ms,
            floor,
            not_after_ms: None,
        });
        self
    }

    /// The same, its lease ending no later than `not_after_ms` on the store's clock (see
    /// [`LeaseEnd::not_after_ms`]). Without a lease, nothing changes.
    pub fn not_after(mut self, not_after_ms: u64) -> Self {
        if let Some(l) = &mut self.lease {
            l.not_after_ms = Some(not_after_ms);
        }
        self
    }

    /// The same at an explicit time.
    pub fn at(mut self, now_ms: u64) -> Self {
        self.now_ms = Some(now_ms);
        self
    }

    /// Rejects what `set_params.lua` would reject, before any I/O.
    pub fn validate(&self) -> Result<(), StoreError> {
        self.limit.validate()?;
        validate_now(self.now_ms)?;
        if let Some(lease) = &self.lease {
            lease.floor.validate()?;
            if lease.floor.kind() != self.limit.kind() {
                return Err(StoreError::Rejected {
                    reason: "the floor is not the same kind of limit".into(),
                });
            }
            if let (Limit::TokenBucket(p), Limit::TokenBucket(f)) = (self.limit, lease.floor) {
                if p.period_ms != f.period_ms {
                    return Err(StoreError::Rejected {
                        reason: "the floor refills over another period".into(),
                    });
                }
            }
            // The end is computed by the store from its own clock; it must stay exact.
            if lease.remaining_ms > MAX_CAPACITY_UT / 2 {
                return Err(StoreError::Rejected {
                    reason: format!("a lease of {} ms is too long", lease.remaining_ms),
                });
            }
            if lease.not_after_ms.is_some_and(|n| n > MAX_CAPACITY_UT) {
                return Err(StoreError::Rejected {
                    reason: "the latest lease end is too large".into(),
                });
            }
        }
        if self
            .fence
            .is_some_and(|f| f.token > MAX_CAPACITY_UT || f.epoch > MAX_CAPACITY_UT)
        {
            return Err(StoreError::Rejected {
                reason: "a fence or epoch is too large".into(),
            });
        }
        Ok(())
    }
}

/// Tokens admitted and denied for one bucket since the previous collection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRecord {
    pub bucket: BucketRef,
    pub admitted: u64,
    pub denied: u64,
}

/// Store failures. A denial is a `Decision`, never an error.
///
/// Two classes, told apart by [`is_outage`](Self::is_outage): the request, its bucket's data or
/// the configuration is at fault ([`Invalid`](Self::Invalid), [`Rejected`](Self::Rejected)),
/// and the store is healthy; or the store itself failed (the other variants), which is what a
/// circuit breaker counts.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store's configuration is malformed (an address, TLS material): found before any
    /// I/O, when the store is opened.
    #[error("invalid configuration: {reason}")]
    Invalid { reason: String },
    /// This request, or the data stored under its bucket's keys, is at fault, not the store:
    /// the request is outside the scripts' bounds (refused before any I/O, by every store
    /// alike), a script answered `ERR quotad: …`, or a key holds a value of another type
    /// (`WRONGTYPE`). Retrying the same request gets the same answer.
    #[error("rejected: {reason}")]
    Rejected { reason: String },
    #[error("store call timed out after {ms} ms")]
    Timeout { ms: u64 },
    #[error("store unavailable: {reason}")]
    Unavailable { reason: String },
    /// Redis answered but refused this client: wrong or missing credentials, or an ACL user
    /// without the commands or keys it needs. Configuration, not an outage of Redis, but this
    /// store cannot decide anything until it is put right.
    #[error("Redis refused this client: {reason}")]
    Refused { reason: String },
    /// Redis answered with an error that is not the request's fault (out of memory, a script
    /// killed or busy, a cluster slot down).
    #[error("script error: {message}")]
    Script { message: String },
    /// A parameter write refused by the fence stored with the parameters ([`Fence`]): a later
    /// agent, or a later epoch, wrote them. Nothing was changed.
    #[error("{reason}")]
    Fenced { reason: String },
    /// Redis answered something the scripts never return.
    #[error("unexpected reply: {reason}")]
    Protocol { reason: String },
}

impl StoreError {
    /// Whether the store failed, rather than the request or its data: true for timeouts,
    /// unreachable or refusing Redis, server errors and unexpected replies; false for
    /// [`Invalid`](Self::Invalid), [`Rejected`](Self::Rejected) and
    /// [`Fenced`](Self::Fenced), which another store would answer the same way.
    pub fn is_outage(&self) -> bool {
        match self {
            Self::Invalid { .. } | Self::Rejected { .. } | Self::Fenced { .. } => false,
            Self::Timeout { .. }
            | Self::Unavailable { .. }
            | Self::Refused { .. }
            | Self::Script { .. }
            | Self::Protocol { .. } => true,
        }
    }
}

/// A decision store. Implemented by the embedded store and the Redis store alike. A store that
/// does I/O bounds every call itself (a timeout is a [`StoreError::Timeout`]), so callers arm no
/// timer of their own.
pub trait Store: Send + Sync {
    /// Decides one request atomically.
    fn check(
        &self,
        req: &CheckRequest,
    ) -> impl std::future::Future<Output = Result<Decision, StoreError>> + Send;
    /// Decides several token buckets of one tenant atomically, all or nothing (see
    /// [`MultiCheckRequest`]): each limit's decision, in the request's order; the check's is
    /// [`Decision::all`] of them.
    fn check_all(
        &self,
        req: &MultiCheckRequest,
    ) -> impl std::future::Future<Output = Result<Vec<Decision>, StoreError>> + Send;
    /// Decides a token-bucket check that spends up to `batch` multiples of its cost at once, as
    /// many as the bucket holds and at least one (a reservation the caller hands out itself):
    /// the decision (`remaining` is what the bucket keeps) and the multiples spent, 0 when
    /// denied. `batch` 1 is [`check`](Self::check). Sliding windows are refused.
    fn reserve(
        &self,
        req: &CheckRequest,
        batch: u64,
    ) -> impl std::future::Future<Output = Result<(Decision, u64), StoreError>> + Send;
    /// Charges a token bucket for work already done, into debt down to the request's limit
    /// ([`ChargeRequest`]): what was applied and clamped, and the bucket it left. Applied once
    /// whatever retries it takes (the store's own, or the caller's under one id).
    fn charge(
        &self,
        req: &ChargeRequest,
    ) -> impl std::future::Future<Output = Result<ChargeOutcome, StoreError>> + Send;
    /// Gives `tokens` whole tokens of a reservation back to a token bucket (repaying a debt
    /// first), never above its capacity: its remaining whole tokens after (0 still in debt),
    /// `None` when it has no state (a full bucket, nothing to give back to).
    fn refund(
        &self,
        bucket: &BucketRef,
        tokens: u64,
        now_ms: Option<u64>,
    ) -> impl std::future::Future<Output = Result<Option<u64>, StoreError>> + Send;
    /// Holds an estimate on one tenant's token buckets, all or nothing ([`HoldRequest`]): spent
    /// now and recorded under the request's id until settled, released or expired. Applied
    /// once whatever retries it takes: a create under a live id answers the first.
    fn hold(
        &self,
        req: &HoldRequest,
    ) -> impl std::future::Future<Output = Result<HoldOutcome, StoreError>> + Send;
    /// Settles a hold at its actual cost: the excess over the estimate charged into debt (as
    /// [`charge`](Self::charge)), the rest given back (as [`refund`](Self::refund)). Applied
    /// once: the same settle again answers the first ([`Settled::Done`] `replayed`).
    fn settle(
        &self,
        req: &SettleRequest,
    ) -> impl std::future::Future<Output = Result<Settled, StoreError>> + Send;
    /// Releases a hold: its whole estimate given back (a concurrency hold's slot freed).
    /// Applied once, as a settle.
    fn release(
        &self,
        req: &ReleaseRequest,
    ) -> impl std::future::Future<Output = Result<Settled, StoreError>> + Send;
    /// The slots of a concurrency limit live at `now_ms` (the store's clock when `None`):
    /// holds in flight, for observability. O(log slots).
    fn in_flight(
        &self,
        bucket: &BucketRef,
        now_ms: Option<u64>,
    ) -> impl std::future::Future<Output = Result<u64, StoreError>> + Send;
    /// Writes this region's parameters for a bucket (the region agent does this on allocation
    /// and renews them with its lease). They replace any written before and take precedence
    /// over a check's fallback.
    fn set_params(
        &self,
        req: &SetParams,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send;
    /// Removes a bucket's parameters and state (its policy was deleted or replaced by a new
    /// version): a gateway still calling the script for it gets the "no parameters" error, not
    /// the old share. Usage not yet collected from it is dropped with it.
    fn clear_params(
        &self,
        bucket: &BucketRef,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send;
    /// Names the data this store holds: the same while what was written is still there, a new
    /// value once it may be gone (a restarted or failed-over Redis has a new run id). The region
    /// agent rewrites every bucket's parameters when it changes.
    fn instance(&self) -> impl std::future::Future<Output = Result<String, StoreError>> + Send;
    /// The store's clock, ms since the epoch rounded down: what `set_params` counts a lease
    /// from. A Redis Cluster answers with the earliest of its masters' clocks, so an end
    /// mapped from it onto any master's clock is never later than meant. The region agent
    /// brackets it with its own clock to send [`LeaseEnd::not_after_ms`].
    fn clock_ms(&self) -> impl std::future::Future<Output = Result<u64, StoreError>> + Send;
    /// Every bucket whose parameters the store holds, whoever wrote them: the region agent
    /// clears those its view no longer has (a policy deleted, or replaced by a new version,
    /// while this daemon was down). O(keys stored): the agent asks once per store instance and
    /// hourly.
    fn list_params(
        &self,
    ) -> impl std::future::Future<Output = Result<Vec<BucketRef>, StoreError>> + Send;
    /// Drains usage recorded since the last call: O(buckets active since then). Returns at
    /// most `max` records; the rest stay for the next call.
    fn collect_usage(
        &self,
        max: usize,
    ) -> impl std::future::Future<Output = Result<Vec<UsageRecord>, StoreError>> + Send;
}

/// Either store, chosen from configuration at start-up.
#[derive(Debug, Clone)]
pub enum AnyStore {
    Embedded(EmbeddedStore),
    Redis(RedisStore),
}

impl AnyStore {
    /// An embedded store on the system clock (no Redis configured).
    pub fn embedded() -> Self {
        Self::Embedded(EmbeddedStore::new())
    }

    /// Whether what this store's connection wrote so far survives a failover: true without
    /// replicas (nothing to fail over to) and for the embedded store; with replicas, once
    /// `WAIT` saw a replica of every master that has one take it. The region agent
    /// acknowledges an epoch only then, so a failover that loses the last writes cannot bring
    /// back a share the coordinator already gave away.
    pub async fn durable(&self) -> Result<bool, StoreError> {
        match self {
            Self::Embedded(_) => Ok(true),
            Self::Redis(r) => r.durable().await,
        }
    }

    /// Marks the store as written by `me` for `ttl_ms` unless another writer's mark is live
    /// (`me`'s own is renewed): the mark in force after the call. The embedded store has
    /// one writer, always `me`.
    pub async fn claim_owner(&self, me: &str, ttl_ms: u64) -> Result<String, StoreError> {
        match self {
            Self::Embedded(_) => Ok(me.to_string()),
            Self::Redis(r) => r.claim_owner(me, ttl_ms).await,
        }
    }

    /// Removes `me`'s mark ([`Self::claim_owner`]), if it is `me`'s.
    pub async fn release_owner(&self, me: &str) -> Result<(), StoreError> {
        match self {
            Self::Embedded(_) => Ok(()),
            Self::Redis(r) => r.release_owner(me).await,
        }
    }

    /// What Redis says of evicting keys; `None` for the embedded store, which never evicts.
    pub async fn eviction(&self) -> Option<Result<Eviction, StoreError>> {
        match self {
            Self::Embedded(_) => None,
            Self::Redis(s) => Some(s.eviction().await),
        }
    }
}

/// Redis's eviction settings and count. An evicted bucket state comes back full (the scripts
/// read a missing state as a full bucket, which is safe only for expiry) and an evicted
/// parameters key drops the region to the fallback limit, so quotad needs `noeviction`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eviction {
    /// `maxmemory-policy` (of a Cluster master that may evict, if any).
    pub policy: String,
    /// `maxmemory` of that server; 0 is no limit, under which nothing is evicted.
    pub maxmemory_bytes: u64,
    /// `evicted_keys` since the server started (summed over a Cluster's masters).
    pub evicted_keys: u64,
}

impl Eviction {
    /// True when the server may evict keys: a policy other than `noeviction` under a memory
    /// limit. `volatile-*` policies count too: every bucket state has a TTL.
    pub fn may_evict(&self) -> bool {
        self.policy != "noeviction" && self.maxmemory_bytes > 0
    }
}

impl Store for AnyStore {
    async fn check(&self, req: &CheckRequest) -> Result<Decision, StoreError> {
        match self {
            Self::Embedded(s) => s.check(req).await,
            Self::Redis(s) => s.check(req).await,
        }
    }

    async fn check_all(&self, req: &MultiCheckRequest) -> Result<Vec<Decision>, StoreError> {
        match self {
            Self::Embedded(s) => s.check_all(req).await,
            Self::Redis(s) => s.check_all(req).await,
        }
    }

    async fn reserve(&self, req: &CheckRequest, batch: u64) -> Result<(Decision, u64), StoreError> {
        match self {
            Self::Embedded(s) => s.reserve(req, batch).await,
            Self::Redis(s) => s.reserve(req, batch).await,
        }
    }

    async fn charge(&self, req: &ChargeRequest) -> Result<ChargeOutcome, StoreError> {
        match self {
            Self::Embedded(s) => s.charge(req).await,
            Self::Redis(s) => s.charge(req).await,
        }
    }

    async fn refund(
        &self,
        bucket: &BucketRef,
        tokens: u64,
        now_ms: Option<u64>,
    ) -> Result<Option<u64>, StoreError> {
        match self {
            Self::Embedded(s) => s.refund(bucket, tokens, now_ms).await,
            Self::Redis(s) => s.refund(bucket, tokens, now_ms).await,
        }
    }

    async fn hold(&self, req: &HoldRequest) -> Result<HoldOutcome, StoreError> {
        match self {
            Self::Embedded(s) => s.hold(req).await,
            Self::Redis(s) => s.hold(req).await,
        }
    }

    async fn settle(&self, req: &SettleRequest) -> Result<Settled, StoreError> {
        match self {
            Self::Embedded(s) => s.settle(req).await,
            Self::Redis(s) => s.settle(req).await,
        }
    }

    async fn release(&self, req: &ReleaseRequest) -> Result<Settled, StoreError> {
        match self {
            Self::Embedded(s) => s.release(req).await,
            Self::Redis(s) => s.release(req).await,
        }
    }

    async fn in_flight(&self, bucket: &BucketRef, now_ms: Option<u64>) -> Result<u64, StoreError> {
        match self {
            Self::Embedded(s) => s.in_flight(bucket, now_ms).await,
            Self::Redis(s) => s.in_flight(bucket, now_ms).await,
        }
    }

    async fn set_params(&self, req: &SetParams) -> Result<(), StoreError> {
        match self {
            Self::Embedded(s) => s.set_params(req).await,
            Self::Redis(s) => s.set_params(req).await,
        }
    }

    async fn clear_params(&self, bucket: &BucketRef) -> Result<(), StoreError> {
        match self {
            Self::Embedded(s) => s.clear_params(bucket).await,
            Self::Redis(s) => s.clear_params(bucket).await,
        }
    }

    async fn instance(&self) -> Result<String, StoreError> {
        match self {
            Self::Embedded(s) => s.instance().await,
            Self::Redis(s) => s.instance().await,
        }
    }

    async fn clock_ms(&self) -> Result<u64, StoreError> {
        match self {
            Self::Embedded(s) => s.clock_ms().await,
            Self::Redis(s) => s.clock_ms().await,
        }
    }

    async fn list_params(&self) -> Result<Vec<BucketRef>, StoreError> {
        match self {
            Self::Embedded(s) => s.list_params().await,
            Self::Redis(s) => s.list_params().await,
        }
    }

    async fn collect_usage(&self, max: usize) -> Result<Vec<UsageRecord>, StoreError> {
        match self {
            Self::Embedded(s) => s.collect_usage(max).await,
            Self::Redis(s) => s.collect_usage(max).await,
        }
    }
}
