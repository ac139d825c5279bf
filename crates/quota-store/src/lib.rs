//! quota-store: where regional decisions are made.
//!
//! SKELETON written by the lead to fix the public API; the store work fills it in.
//! The names below are a contract other crates (quotad) code against:
//! `BucketRef`, `Limit`, `CheckRequest`, `UsageRecord`, `StoreError`, the `Store` trait,
//! `EmbeddedStore`, `RedisStore`, `AnyStore`.

use quota_core::{BucketParams, Decision, PolicyName, TenantId};

/// Which bucket: a tenant's policy at a policy version (the version is part of the key).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketRef {
    pub tenant: TenantId,
    pub policy: PolicyName,
    pub version: u64,
}

/// What limit a check enforces when the store holds no parameters of its own for the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    TokenBucket(BucketParams),
    /// At most `limit` tokens in any `window_ms`.
    SlidingWindow { limit: u64, window_ms: u64 },
}

/// One decision request.
#[derive(Debug, Clone)]
pub struct CheckRequest {
    pub bucket: BucketRef,
    /// Fallback parameters, used when the store has none written for this bucket.
    pub limit: Limit,
    pub cost: u64,
    /// Explicit time for tests and the simulator; `None` uses the store's clock (Redis `TIME`).
    pub now_ms: Option<u64>,
}

/// Tokens admitted and denied for one bucket since the previous collection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRecord {
    pub bucket: BucketRef,
    pub admitted: u64,
    pub denied: u64,
}

/// Store failures. A denial is a `Decision`, never an error.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("invalid request: {reason}")]
    Invalid { reason: String },
    #[error("store call timed out after {ms} ms")]
    Timeout { ms: u64 },
    #[error("store unavailable: {reason}")]
    Unavailable { reason: String },
}

/// A decision store. Implemented by the embedded store and the Redis store alike.
pub trait Store: Send + Sync {
    /// Decides one request atomically.
    fn check(
        &self,
        req: &CheckRequest,
    ) -> impl std::future::Future<Output = Result<Decision, StoreError>> + Send;
    /// Writes this region's parameters for a bucket (the region agent does this on allocation).
    fn set_params(
        &self,
        bucket: &BucketRef,
        limit: Limit,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send;
    /// Drains usage recorded since the last call: O(buckets active since then).
    fn collect_usage(
        &self,
        max: usize,
    ) -> impl std::future::Future<Output = Result<Vec<UsageRecord>, StoreError>> + Send;
}
