//! The Redis store: one EVALSHA per decision on the region's Redis.
//!
//! Scripts are compiled in (`include_str!`) and invoked by SHA; a NOSCRIPT reply (after
//! `SCRIPT FLUSH`, a restart or a failover) is answered by loading the script and retrying once,
//! so callers never see it. Standalone Redis goes through a `ConnectionManager`, which reconnects
//! on its own; Redis Cluster through the cluster client, which routes each call by its first key.
//! Every call is bounded by a timeout.
//!
//! Usage collection drains activity indexes (see `quota_core::keys`): one set on standalone
//! Redis; on Cluster one per slot, so a full collection walks all 16 384 slot indexes: 16 384
//! small script calls (issued [`CLUSTER_COLLECT_CONCURRENCY`] at a time) plus O(active
//! buckets) — a fixed cost per report interval, independent of the number of tenants.
//!
//! # Layout
//! - [`config`]: where Redis is and how to reach it ([`RedisStoreConfig`], [`Credentials`]).
//! - [`tls`]: the certificates for `rediss://`.
//! - `source`: the connections calls take, one kind per topology (`sentinel`: the master the
//!   sentinels name).
//! - `calls`: bounded script and command calls, and their replies.
//! - `error`: Redis errors as [`StoreError`]s: the request's fault or the store's.

mod calls;
pub mod config;
mod error;
mod sentinel;
mod source;
pub mod tls;

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use quota_core::keys::{self, StateKind};
use quota_core::{ChargeOutcome, Decision};
use redis::Script;

pub use config::{
    check_url, Credentials, RedisStoreConfig, Topology, CONNECT_WAIT, DEFAULT_MIN_IDLE_TTL,
    DEFAULT_TIMEOUT,
};
pub use tls::{ClientIdentity, Tls, TlsPart};

use crate::script::{self, Arg};
use crate::{
    BucketRef, ChargeRequest, CheckRequest, HoldOutcome, HoldRequest, Limit, MultiCheckRequest,
    ReleaseRequest, SetParams, SettleRequest, Settled, Store, StoreError, UsageRecord,
};
use source::{build_source, Source};

/// Slot indexes drained at once during a cluster usage collection.
pub const CLUSTER_COLLECT_CONCURRENCY: usize = 64;

/// Most keys one `collect_usage.lua` call takes. A script holds Redis while it runs, and a key
/// costs it about 4.6 µs (10 000 keys held it 46 ms, close to the store's 50 ms timeout, so the
/// checks queued behind a drain timed out and opened the breaker); 256 keys hold it about
/// 1.2 ms, and checks go between the calls.
pub const COLLECT_CALL_KEYS: usize = 256;

#[derive(Debug)]
struct Scripts {
    token_bucket: Script,
    token_buckets: Script,
    sliding_window: Script,
    collect_usage: Script,
    set_params: Script,
    refund: Script,
    charge: Script,
    hold: Script,
    settle: Script,
}

/// The Redis-backed store. Cheap to clone; clones share connections.
#[derive(Clone)]
pub struct RedisStore {
    /// Replaced as a whole when new credentials are taken ([`RedisStore::use_credentials`]).
    source: Arc<ArcSwap<Source>>,
    /// What built `source`, to build it again with other credentials.
    config: Arc<RedisStoreConfig>,
    scripts: Arc<Scripts>,
    timeout: Duration,
    /// The minimum idle TTL argument of the decision scripts (ms, decimal).
    min_idle_ttl_ms: Arc<str>,
    /// Cluster only: the hash tag of every slot, for the per-slot activity indexes.
    slot_tags: Option<Arc<Vec<String>>>,
    /// Cluster only: the slot the next collection starts at, so a small `max` cannot starve
    /// the high slots.
    next_slot: Arc<AtomicUsize>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("topology", &self.topology_name())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl RedisStore {
    /// Prepares the store without waiting for Redis: the first call connects, and one made
    /// while Redis is unreachable fails as [`StoreError::Unavailable`] (or `Timeout`) and
    /// leaves the next call to try again. A process can therefore start while its Redis is
    /// down. Fails only on a malformed address or TLS material. Scripts are loaded lazily
    /// too: the first EVALSHA that meets NOSCRIPT loads its script. Call it within a Tokio
    /// runtime (the standalone connection manager spawns a task).
    pub fn open(config: RedisStoreConfig) -> Result<Self, StoreError> {
        let source = build_source(&config)?;
        let slot_tags = match config.topology {
            Topology::Standalone { .. } | Topology::Sentinel { .. } => None,
            Topology::Cluster { .. } => Some(Arc::new(keys::slot_tags())),
        };
        let scripts = Arc::new(Scripts {
            token_bucket: Script::new(script::TOKEN_BUCKET_LUA),
            token_buckets: Script::new(script::TOKEN_BUCKETS_LUA),
            sliding_window: Script::new(script::SLIDING_WINDOW_LUA),
            collect_usage: Script::new(script::COLLECT_USAGE_LUA),
            set_params: Script::new(script::SET_PARAMS_LUA),
            refund: Script::new(script::REFUND_LUA),
            charge: Script::new(script::CHARGE_LUA),
            hold: Script::new(script::HOLD_LUA),
            settle: Script::new(script::SETTLE_LUA),
        });
        let min_idle_ttl_ms = (config.min_idle_ttl.as_millis() as u64)
            .clamp(1, quota_core::bucket::MAX_CAPACITY_UT)
            .to_string()
            .into();
        Ok(Self {
            source: Arc::new(ArcSwap::from_pointee(source)),
            timeout: config.timeout,
            config: Arc::new(config),
            scripts,
            min_idle_ttl_ms,
            slot_tags,
            next_slot: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// `standalone`, `cluster` or `sentinel`, for status pages.
    pub fn topology_name(&self) -> &'static str {
        match **self.source.load() {
            Source::Single(_) => "standalone",
            Source::Cluster(_) => "cluster",
            Source::Sentinel(_) => "sentinel",
        }
    }

    /// [`open`](Self::open), then waits for Redis to answer (see [`reachable`](Self::reachable)):
    /// for callers that cannot go on without it.
    pub async fn connect(config: RedisStoreConfig) -> Result<Self, StoreError> {
        let store = Self::open(config)?;
        store.reachable().await?;
        Ok(store)
    }

    /// Whether Redis answers a `PING` (every master of a Cluster), connecting first if need be,
    /// within the call timeout but at least [`CONNECT_WAIT`]: a first connection may take
    /// longer than a call.
    pub async fn reachable(&self) -> Result<(), StoreError> {
        self.ping(&self.source.load_full()).await
    }

    /// Switches to `credentials` once Redis takes them: a connection made with them must
    /// answer a `PING` (every master of a Cluster) first, so a password Redis does not yet
    /// accept never replaces one it does. Until then, and when Redis refuses them, calls go on
    /// over the current connection; the error says why they were not taken.
    pub async fn use_credentials(&self, credentials: Credentials) -> Result<(), StoreError> {
        let mut config = (*self.config).clone();
        config.credentials = Some(credentials);
        let candidate = build_source(&config)?;
        self.ping(&candidate).await?;
        self.source.store(Arc::new(candidate));
        Ok(())
    }
}

impl RedisStore {
    /// Settles (`cost`) or releases the hold recorded at `record` with one `settle.lua`: a
    /// retry of the call finds the record ended by the first run and answers its results.
    async fn end_hold(
        &self,
        record: &str,
        cost: Option<u64>,
        now_ms: Option<u64>,
    ) -> Result<Settled, StoreError> {
        let index = self.index_key(record);
        let args = script::settle_args(cost, now_ms, &self.min_idle_ttl_ms);
        let reply: Vec<redis::Value> = self
            .invoke(&self.scripts.settle, &[record, &index], &args)
            .await?;
        script::settled_from_reply(&reply)
    }
}

impl Store for RedisStore {
    async fn check(&self, req: &CheckRequest) -> Result<Decision, StoreError> {
        req.validate()?;
        let kind = req.limit.kind();
        let state = req.bucket.state_key(kind);
        let params = req.bucket.params_key();
        let index = self.index_key(&state);
        let (args, n) = script::decision_args(req, &self.min_idle_ttl_ms);
        let args = &args[..n];
        let s = match kind {
            StateKind::Bucket => &self.scripts.token_bucket,
            StateKind::Window => &self.scripts.sliding_window,
            // Refused by CheckRequest::validate.
            StateKind::Slots => {
                return Err(StoreError::Rejected {
                    reason: crate::CONCURRENCY_BY_HOLDS.into(),
                })
            }
        };
        let reply: Vec<i64> = self.invoke(s, &[&state, &params, &index], args).await?;
        script::decision_from_reply(&reply)
    }

    async fn reserve(&self, req: &CheckRequest, batch: u64) -> Result<(Decision, u64), StoreError> {
        req.validate()?;
        crate::validate_batch(req, batch)?;
        let state = req.bucket.state_key(StateKind::Bucket);
        let params = req.bucket.params_key();
        let index = self.index_key(&state);
        let (args, n) = script::decision_args(req, &self.min_idle_ttl_ms);
        let mut all = [Arg::Num(0); 7];
        all[..n].copy_from_slice(&args[..n]);
        all[6] = Arg::Num(batch);
        let s = match req.limit.kind() {
            StateKind::Bucket => &self.scripts.token_bucket,
            StateKind::Window | StateKind::Slots => {
                return Err(StoreError::Rejected {
                    reason: "only token buckets take a batch".into(),
                })
            }
        };
        let reply: Vec<i64> = self.invoke(s, &[&state, &params, &index], &all).await?;
        script::reservation_from_reply(&reply)
    }

    async fn refund(
        &self,
        bucket: &BucketRef,
        tokens: u64,
        now_ms: Option<u64>,
    ) -> Result<Option<u64>, StoreError> {
        crate::validate_refund(tokens, now_ms)?;
        let state = bucket.state_key(StateKind::Bucket);
        let marker = calls::once_key(&state, "r");
        let args = [Arg::Num(tokens), now_ms.map_or(Arg::Str(""), Arg::Num)];
        let left: i64 = self
            .invoke(&self.scripts.refund, &[&state, &marker], &args)
            .await?;
        Ok(u64::try_from(left).ok())
    }

    async fn charge(&self, req: &ChargeRequest) -> Result<ChargeOutcome, StoreError> {
        req.validate()?;
        let state = req.bucket.state_key(StateKind::Bucket);
        let params = req.bucket.params_key();
        let index = self.index_key(&state);
        // Always a marker: the caller's id names the charge across its own retries; without
        // one, a key unique to this call makes the store's retry (and a Cluster client's) a
        // replay. Generated ids are hex, so they never meet an `id:` one.
        let marker = match &req.id {
            Some(id) => format!("{state}:g:id:{id}"),
            None => calls::once_key(&state, "g"),
        };
        let args = script::charge_args(req, &self.min_idle_ttl_ms);
        let reply: Vec<i64> = self
            .invoke(
                &self.scripts.charge,
                &[&state, &params, &index, &marker],
                &args,
            )
            .await?;
        script::charge_from_reply(&reply, req.cost)
    }

    async fn check_all(&self, req: &MultiCheckRequest) -> Result<Vec<Decision>, StoreError> {
        req.validate()?;
        let mut keys = Vec::with_capacity(2 * req.limits.len() + 1);
        for l in &req.limits {
            keys.push(l.bucket.state_key(StateKind::Bucket));
            keys.push(l.bucket.params_key());
        }
        // The tenant's keys share one hash slot, so one index for all.
        keys.push(self.index_key(&keys[0]));
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let args = script::multi_args(req, &self.min_idle_ttl_ms);
        let reply: Vec<i64> = self
            .invoke(&self.scripts.token_buckets, &keys, &args)
            .await?;
        script::decisions_from_reply(&reply, req.limits.len())
    }

    async fn hold(&self, req: &HoldRequest) -> Result<HoldOutcome, StoreError> {
        req.validate()?;
        let tenant = &req.limits[0].bucket.tenant;
        let record = keys::hold_key(tenant, &req.id);
        let mut keys = Vec::with_capacity(2 + 2 * req.limits.len());
        // The record and the buckets share the tenant's hash slot, so one index for all.
        keys.push(self.index_key(&record));
        for l in &req.limits {
            keys.push(l.bucket.state_key(l.limit.kind()));
            keys.push(l.bucket.params_key());
            if let Limit::Concurrency { .. } = l.limit {
                let b = &l.bucket;
                keys.push(keys::slots_usage_key(&b.tenant, &b.policy, b.version));
            }
        }
        let keys: Vec<&str> = std::iter::once(record.as_str())
            .chain(keys.iter().map(String::as_str))
            .collect();
        let args = script::hold_args(req, &self.min_idle_ttl_ms);
        // A retry of this call (the store's own, or a Cluster client's) meets the record the
        // first run wrote and is answered as a replay: the estimate is spent once.
        let reply: Vec<i64> = self.invoke(&self.scripts.hold, &keys, &args).await?;
        script::hold_from_reply(&reply, req.limits.len())
    }

    async fn settle(&self, req: &SettleRequest) -> Result<Settled, StoreError> {
        req.validate()?;
        self.end_hold(&req.record_key(), Some(req.cost), req.now_ms)
            .await
    }

    async fn release(&self, req: &ReleaseRequest) -> Result<Settled, StoreError> {
        req.validate()?;
        self.end_hold(&req.record_key(), None, req.now_ms).await
    }

    async fn in_flight(&self, bucket: &BucketRef, now_ms: Option<u64>) -> Result<u64, StoreError> {
        crate::validate_now(now_ms)?;
        let now = match now_ms {
            Some(n) => n,
            None => self.clock_ms().await?,
        };
        let mut count = redis::cmd("ZCOUNT");
        count
            .arg(bucket.state_key(StateKind::Slots))
            .arg(format!("({now}"))
            .arg("+inf");
        self.command(&count).await
    }

    async fn set_params(&self, req: &SetParams) -> Result<(), StoreError> {
        req.validate()?;
        // One script: the params hash and the copy inside the token-bucket state change
        // together (both keys share the tenant's hash tag, so one slot).
        let key = req.bucket.params_key();
        let state = req.bucket.state_key(StateKind::Bucket);
        let args = script::set_params_args(req, &self.min_idle_ttl_ms);
        let args: Vec<Arg> = args.iter().map(|a| Arg::Str(a)).collect();
        // A changed policy: the old version's state, whose spent tokens stay spent; for a
        // window also the old parameters and the new window's state.
        let old: Vec<String> = match (req.replaced(), req.limit) {
            (Some(b), Limit::TokenBucket(_)) => vec![b.state_key(StateKind::Bucket)],
            (Some(b), Limit::SlidingWindow { .. }) => vec![
                b.state_key(StateKind::Window),
                b.params_key(),
                req.bucket.state_key(StateKind::Window),
            ],
            // A concurrency limit carries nothing over (set_params.lua).
            (None, _) | (Some(_), Limit::Concurrency { .. }) => Vec::new(),
        };
        let keys: Vec<&str> = [key.as_str(), state.as_str()]
            .into_iter()
            .chain(old.iter().map(String::as_str))
            .collect();
        let _: i64 = self.invoke(&self.scripts.set_params, &keys, &args).await?;
        Ok(())
    }

    async fn clear_params(&self, bucket: &BucketRef) -> Result<(), StoreError> {
        // One DEL: the keys share the tenant's hash tag, so one Cluster slot.
        let mut del = redis::cmd("DEL");
        del.arg(bucket.params_key())
            .arg(bucket.state_key(StateKind::Bucket))
            .arg(bucket.state_key(StateKind::Window))
            .arg(bucket.state_key(StateKind::Slots))
            .arg(keys::slots_usage_key(
                &bucket.tenant,
                &bucket.policy,
                bucket.version,
            ));
        let _: i64 = self.command(&del).await?;
        Ok(())
    }

    async fn instance(&self) -> Result<String, StoreError> {
        self.run_ids().await
    }

    async fn clock_ms(&self) -> Result<u64, StoreError> {
        self.time_of_masters().await
    }

    async fn list_params(&self) -> Result<Vec<BucketRef>, StoreError> {
        self.params_held().await
    }

    async fn collect_usage(&self, max: usize) -> Result<Vec<UsageRecord>, StoreError> {
        match &self.slot_tags {
            None => {
                let mut out = Vec::new();
                // Go on while batches come back full: expired keys leave the index without a
                // record, so a batch may hold fewer records than keys taken.
                while out.len() < max {
                    let want = (max - out.len()).min(COLLECT_CALL_KEYS);
                    let (taken, batch) = self.collect_index(keys::ACTIVE_INDEX, want).await?;
                    out.extend(batch);
                    if taken < want {
                        break;
                    }
                }
                Ok(out)
            }
            Some(tags) => {
                // Slots are drained in chunks, starting where the previous collection stopped;
                // the asks of a chunk never add up to more than what is still wanted, so
                // nothing is taken out of Redis and then dropped.
                let start = self.next_slot.load(Ordering::Relaxed) % tags.len();
                let mut out = Vec::new();
                let mut done = 0;
                while done < tags.len() && out.len() < max {
                    let remaining = max - out.len();
                    let chunk = CLUSTER_COLLECT_CONCURRENCY
                        .min(remaining)
                        .min(tags.len() - done);
                    let ask = (remaining / chunk).min(COLLECT_CALL_KEYS);
                    let calls = (done..done + chunk).map(|i| {
                        let index = keys::slot_index_key_for_tag(&tags[(start + i) % tags.len()]);
                        async move { self.collect_index(&index, ask).await }
                    });
                    let batches = futures::future::try_join_all(calls).await?;
                    out.extend(batches.into_iter().flat_map(|(_, records)| records));
                    done += chunk;
                }
                self.next_slot
                    .store((start + done) % tags.len(), Ordering::Relaxed);
                Ok(out)
            }
        }
    }
}
