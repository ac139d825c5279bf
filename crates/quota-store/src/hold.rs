//! Holds: an estimated cost reserved now and settled later with the actual one (LLM tokens,
//! known only once a response ends). The requests and answers of [`Store::hold`],
//! [`Store::settle`] and [`Store::release`]; `quota_core::hold` is their reference.
//!
//! [`Store::hold`]: crate::Store::hold
//! [`Store::settle`]: crate::Store::settle
//! [`Store::release`]: crate::Store::release

use quota_core::bounds::{HOLD_MEMORY_MS, MAX_CAPACITY_UT, MAX_HOLD_ID_LEN, MAX_HOLD_TTL_MS};
use quota_core::bucket::{self, MAX_LIMITS_PER_CHECK};
use quota_core::{hold as reference, keys, Decision, TenantId};

use crate::{validate_now, BucketRef, Limit, StoreError, MAX_COST};

/// One limit of a [`HoldRequest`]: a bucket, its fallback and the debt a settle may take it
/// into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldLimit {
    pub bucket: BucketRef,
    /// Fallback parameters, used when the store has none written for this bucket (as
    /// [`crate::LimitCheck::limit`]); the hold's record keeps them for its settle.
    pub limit: Limit,
    /// How far below empty a settle above the estimate may take the bucket, in micro-tokens
    /// (as [`crate::ChargeRequest::debt_limit_ut`]): the capacity in force plus this must be
    /// at most [`MAX_CAPACITY_UT`] when the hold is made; a settle cuts it to that bound if the
    /// capacity grew since. A concurrency limit's is only recorded (part of the request a
    /// replay must repeat).
    pub debt_limit_ut: u64,
}

/// A hold: `cost` spent now on every limit when all of them admit it (as
/// [`crate::Store::check_all`]), recorded under `id` until it is settled, released or
/// expires. One EVALSHA of `lua/hold.lua` on Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldRequest {
    /// Names the hold within its tenant: 1 to [`MAX_HOLD_ID_LEN`] of `A-Z a-z 0-9 _ -`. The
    /// daemon makes it (random) or derives it from the caller's idempotency id. A second
    /// create under a live id with the same request changes nothing and answers again (held,
    /// `replayed`, each bucket as it stands); with another estimate, limits or TTL it is
    /// refused ([`StoreError::Rejected`], the reason names the "hold id").
    pub id: String,
    /// 1 to [`MAX_LIMITS_PER_CHECK`] token buckets of one tenant, each once; all or nothing.
    /// Or exactly one concurrency limit ([`Limit::Concurrency`]): the hold takes one of its
    /// slots (its debt limit is only recorded).
    pub limits: Vec<HoldLimit>,
    /// The estimate, whole tokens, 1 to [`MAX_COST`]; 1 (one slot) for a concurrency limit.
    pub cost: u64,
    /// 1 to [`MAX_HOLD_TTL_MS`]: when the hold expires unsettled. A token budget's estimate
    /// then stays spent (the work may have been done).
    pub ttl_ms: u64,
    /// Explicit time for tests and the simulator; `None` uses the store's clock.
    pub now_ms: Option<u64>,
}

impl HoldRequest {
    /// The tenant the hold belongs to (of its first limit).
    pub fn tenant(&self) -> Option<&TenantId> {
        self.limits.first().map(|l| &l.bucket.tenant)
    }

    /// Rejects what `lua/hold.lua` would reject, and limits of several tenants, before any
    /// I/O (the debt limits against the fallbacks; the store checks them against the
    /// capacities in force too).
    pub fn validate(&self) -> Result<(), StoreError> {
        let rejected = |reason: String| Err(StoreError::Rejected { reason });
        validate_id(&self.id)?;
        let n = self.limits.len();
        if n == 0 || n as u64 > MAX_LIMITS_PER_CHECK {
            return rejected(format!(
                "{n} limits; a hold takes 1..={MAX_LIMITS_PER_CHECK}"
            ));
        }
        if self.cost == 0 || self.cost > MAX_COST {
            return rejected(format!("estimate {} is outside 1..={MAX_COST}", self.cost));
        }
        if self.ttl_ms == 0 || self.ttl_ms > MAX_HOLD_TTL_MS {
            return rejected(format!(
                "a hold's ttl of {} ms is outside 1..={MAX_HOLD_TTL_MS}",
                self.ttl_ms
            ));
        }
        validate_now(self.now_ms)?;
        if self
            .now_ms
            .is_some_and(|now| now + self.ttl_ms + HOLD_MEMORY_MS > MAX_CAPACITY_UT)
        {
            return rejected("the hold would end too late".into());
        }
        if let Limit::Concurrency { .. } = self.limits[0].limit {
            if n > 1 {
                return rejected("a concurrency limit is held alone".into());
            }
            if self.cost != 1 {
                return rejected(format!(
                    "a hold of a concurrency limit takes one slot: estimate 1, not {}",
                    self.cost
                ));
            }
            return self.limits[0].limit.validate();
        }
        let first = &self.limits[0].bucket.tenant;
        for (i, l) in self.limits.iter().enumerate() {
            if l.bucket.tenant != *first {
                return rejected("the limits of one hold belong to one tenant".into());
            }
            let p = match l.limit {
                Limit::TokenBucket(p) => p,
                Limit::SlidingWindow { .. } => {
                    return rejected(format!(
                        "limit {} is a sliding window, which keeps no level to hold",
                        i + 1
                    ))
                }
                Limit::Concurrency { .. } => {
                    return rejected("a concurrency limit is held alone".into())
                }
            };
            l.limit.validate()?;
            if let Err(e) = bucket::check_debt_limit(&p, l.debt_limit_ut) {
                return rejected(format!("limit {}: {e}", i + 1));
            }
            if self.limits[..i].iter().any(|o| o.bucket == l.bucket) {
                return rejected(format!("limit {} repeats a bucket", i + 1));
            }
        }
        Ok(())
    }
}

/// What a hold got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldOutcome {
    /// One per limit, in the request's order, as [`crate::Store::check_all`] answers them
    /// (a replay: each bucket as it stands, a peek).
    pub decisions: Vec<Decision>,
    /// Every limit admitted the estimate and the hold is recorded.
    pub held: bool,
    /// When it expires unsettled, on the store's clock (when denied: when it would have).
    pub expires_at_ms: u64,
    /// This id's hold was made before by the same request (a retry: the caller's, or the
    /// store's own after a lost reply), and nothing changed now.
    pub replayed: bool,
}

/// Settles a hold at the actual cost: the excess over the estimate charged (into debt), the
/// rest given back. One EVALSHA of `lua/settle.lua` on Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettleRequest {
    pub tenant: TenantId,
    pub id: String,
    /// The actual cost, whole tokens, 0 to [`MAX_COST`].
    pub cost: u64,
    /// Explicit time for tests and the simulator; `None` uses the store's clock.
    pub now_ms: Option<u64>,
}

impl SettleRequest {
    /// Rejects what `lua/settle.lua` would reject, before any I/O.
    pub fn validate(&self) -> Result<(), StoreError> {
        validate_id(&self.id)?;
        if self.cost > MAX_COST {
            return Err(StoreError::Rejected {
                reason: format!("actual cost {} is outside 0..={MAX_COST}", self.cost),
            });
        }
        validate_end_now(self.now_ms)
    }

    /// The key of the hold's record.
    pub fn record_key(&self) -> String {
        keys::hold_key(&self.tenant, &self.id)
    }
}

/// Releases a hold: the whole estimate given back (nothing was used). One EVALSHA of
/// `lua/settle.lua` on Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseRequest {
    pub tenant: TenantId,
    pub id: String,
    /// Explicit time for tests and the simulator; `None` uses the store's clock.
    pub now_ms: Option<u64>,
}

impl ReleaseRequest {
    /// Rejects what `lua/settle.lua` would reject, before any I/O.
    pub fn validate(&self) -> Result<(), StoreError> {
        validate_id(&self.id)?;
        validate_end_now(self.now_ms)
    }

    /// The key of the hold's record.
    pub fn record_key(&self) -> String {
        keys::hold_key(&self.tenant, &self.id)
    }
}

/// What ending a hold did to one of its buckets, in whole tokens. A concurrency limit's: 0
/// charged, clamped and owed, 1 refunded (its slot given back, whatever the actual cost), and
/// `remaining` the slots free after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettledLimit {
    pub bucket: BucketRef,
    /// Of the excess over the estimate, what the bucket took (into debt if need be).
    pub charged: u64,
    /// Of the excess, what the debt limit kept the bucket from taking: work done that this
    /// bucket did not pay for (counted as denied usage).
    pub clamped: u64,
    /// Given back: the estimate less the actual cost (a bucket keeps none above its capacity).
    pub refunded: u64,
    /// Tokens left after (0 in debt).
    pub remaining: u64,
    /// Tokens owed after, rounded up.
    pub debt: u64,
}

impl SettledLimit {
    /// `bucket`'s part of a reference result.
    pub fn of(bucket: BucketRef, r: reference::BucketResult) -> Self {
        Self {
            bucket,
            charged: r.charged,
            clamped: r.clamped,
            refunded: r.refunded,
            remaining: r.remaining,
            debt: r.debt,
        }
    }
}

/// What a settle or a release found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Ended, each bucket's result in the hold's order; `replayed`: by the same call before
    /// (the caller's retry, or the store's own after a lost reply), nothing changed now.
    Done {
        limits: Vec<SettledLimit>,
        replayed: bool,
    },
    /// No such hold: never made, or forgotten [`HOLD_MEMORY_MS`] after it ended.
    Unknown,
    /// Open past its expiry: the estimate stays spent; nothing changed.
    Expired { expired_at_ms: u64 },
    /// Ended otherwise before (settled at another cost; a settled hold released; a released
    /// one settled); nothing changed.
    Conflict(String),
}

fn validate_id(id: &str) -> Result<(), StoreError> {
    if reference::valid_id(id) {
        return Ok(());
    }
    Err(StoreError::Rejected {
        reason: format!("a hold id is 1..={MAX_HOLD_ID_LEN} characters of A-Z a-z 0-9 _ -"),
    })
}

/// An explicit now at which a record can still be kept [`HOLD_MEMORY_MS`].
fn validate_end_now(now_ms: Option<u64>) -> Result<(), StoreError> {
    validate_now(now_ms)?;
    if now_ms.is_some_and(|now| now + HOLD_MEMORY_MS > MAX_CAPACITY_UT) {
        return Err(StoreError::Rejected {
            reason: "now is too late to keep a hold's record".into(),
        });
    }
    Ok(())
}
