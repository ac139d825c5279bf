//! The decision path: policy lookup, cost check, pin forwarding, this region's enforced share,
//! one store call behind the circuit breaker, and the policy's fail mode when the store is down.
//!
//! Nothing here holds a lock across an await: the view is an `Arc` snapshot, the breaker and
//! the in-process buckets use short synchronous critical sections.

pub mod breaker;
pub mod denials;
pub mod multi;
pub mod reservations;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{Counter, Histogram};
use quota_core::mode;
use quota_core::policy::CostError;
use quota_core::share::limit_for_share;
use quota_core::{Decision, FailMode, Policy, PolicyMode, PolicyName, RegionId, TenantId};
use quota_store::{
    AnyStore, BucketRef, CheckRequest, EmbeddedStore, Limit, Store, StoreError, UsageRecord,
};
use serde::{Deserialize, Serialize};
use tokio::sync::futures::OwnedNotified;
use tokio::sync::watch;

use crate::clock;
use crate::coordination::{ClusterView, PolicyEntry};
use crate::decision::breaker::Breaker;
use crate::decision::denials::{Denials, Look, Ticket};
use crate::decision::reservations::{Refund, Reservations, Step};
use crate::secret::Secret;
use crate::telemetry::{self, DecisionMetrics, Outcome};
use quota_raft::tls::PeerHttp;

/// Header marking a check forwarded from another region, so it is never forwarded again. Its
/// value is the peer token: a client cannot use it to skip a pinned tenant's home.
/// A `HeaderName`, not a `&str`: looking a `&str` up parses it on every request.
pub const FORWARDED_HEADER: axum::http::HeaderName =
    axum::http::HeaderName::from_static("x-quotad-forwarded");

/// Header naming the region a check is forwarded from, on the peer listener's forward routes:
/// it must be the region the connection's client certificate authenticates.
pub const FORWARDED_FROM_HEADER: axum::http::HeaderName =
    axum::http::HeaderName::from_static("x-quotad-forwarded-from");

/// With peer TLS, checks are forwarded to the home's peer listener at this prefix plus the
/// API path (`/quotad/v1/check`, `/quotad/v1/check/batch`).
pub const PEER_FORWARD_PREFIX: &str = "/quotad";

/// True when the store decides in process (no Redis: nothing to break).
pub fn is_embedded(store: &AnyStore) -> bool {
    matches!(store, AnyStore::Embedded(_))
}

/// How a decision was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// By this region's store at its enforced share.
    Normal,
    /// By the in-process bucket: the regional store is down and the policy fails local.
    DegradedLocal,
    /// Admitted unchecked: the regional store is down and the policy fails open.
    DegradedOpen,
    /// By the pinned tenant's home region.
    Forwarded,
    /// Home region unreachable: decided here at this region's floor.
    HomeUnreachableFloor,
}

impl Mode {
    /// The name it serializes to.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Normal => "normal",
            Mode::DegradedLocal => "degraded_local",
            Mode::DegradedOpen => "degraded_open",
            Mode::Forwarded => "forwarded",
            Mode::HomeUnreachableFloor => "home_unreachable_floor",
        }
    }
}

/// A decision with what a response needs to describe it.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub decision: Decision,
    pub policy: Policy,
    pub mode: Mode,
    /// The region whose bucket decided.
    pub decided_by: RegionId,
    /// A shadow policy's denial, admitted: the decision says allowed, this says it would
    /// have been denied.
    pub shadow_denied: bool,
}

impl Verdict {
    /// Applies a shadow policy's rule: a denial is admitted and marked.
    fn shadowed(mut self) -> Self {
        if self.policy.mode == PolicyMode::Shadow && !self.decision.allowed {
            self.decision.allowed = true;
            self.decision.retry_after_ms = Some(0);
            self.shadow_denied = true;
        }
        self
    }
}

/// Why no decision was made. A denial is a [`Verdict`], not one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    #[error("no such policy for this tenant")]
    UnknownPolicy,
    #[error(transparent)]
    Cost(#[from] CostError),
    /// The store is down and the policy fails closed, or the home region is unreachable and
    /// the policy allows no local decision.
    #[error("temporarily reduced capacity: {reason}")]
    ReducedCapacity {
        policy: PolicyName,
        reason: &'static str,
    },
}

/// The answer a home region sends back to a forwarded check.
#[derive(Debug, Deserialize)]
struct ForwardedAnswer {
    allowed: bool,
    remaining: u64,
    retry_after_ms: Option<u64>,
    reset_ms: Option<u64>,
    #[serde(default)]
    shadow_denied: bool,
}

impl ForwardedAnswer {
    fn verdict(self, policy: Policy, home: &RegionId) -> Verdict {
        Verdict {
            decision: Decision {
                allowed: self.allowed,
                remaining: self.remaining,
                retry_after_ms: self.retry_after_ms,
                reset_ms: self.reset_ms,
            },
            policy,
            mode: Mode::Forwarded,
            decided_by: home.clone(),
            shadow_denied: self.shadow_denied,
        }
    }
}

/// The answer a home region sends back to a forwarded batch (`api::batch::BatchResponse`).
#[derive(Debug, Deserialize)]
struct ForwardedBatch {
    results: Vec<ForwardedItem>,
}

#[derive(Debug, Deserialize)]
struct ForwardedItem {
    status: u16,
    decision: Option<ForwardedAnswer>,
}

/// A check of `bucket` as the API takes it, for its home region.
fn check_body(bucket: &BucketRef, cost: u64) -> serde_json::Value {
    serde_json::json!({
        "tenant": bucket.tenant.as_str(),
        "policy": bucket.policy.as_str(),
        "cost": cost,
    })
}

/// Whether a bucket at `limit` can ever admit `cost`.
fn holds(limit: &Limit, cost: u64) -> bool {
    match *limit {
        Limit::TokenBucket(p) => p.capacity_ut >= cost.saturating_mul(quota_core::bucket::UT),
        Limit::SlidingWindow { limit, .. } => limit >= cost,
    }
}

/// The other region granted the largest share of `entry` (the first by id on a tie), if its
/// share can hold `cost`.
fn richest_elsewhere(entry: &PolicyEntry, here: &RegionId, cost: u64) -> Option<RegionId> {
    let (region, grant) = entry
        .grants
        .iter()
        .filter(|(r, _)| *r != here)
        .max_by_key(|(r, g)| (g.share_ppm, std::cmp::Reverse(*r)))?;
    let limit: Limit = limit_for_share(&entry.policy, grant.share_ppm).into();
    holds(&limit, cost).then(|| region.clone())
}

/// What a check's result counts as in the decision metrics.
fn outcome_of(result: &Result<Verdict, CheckError>) -> Outcome {
    match result {
        Ok(v) if v.mode == Mode::Forwarded => Outcome::Forwarded,
        Ok(v) if v.mode == Mode::DegradedOpen => Outcome::DegradedOpen,
        Ok(v) if v.mode == Mode::DegradedLocal => Outcome::DegradedLocal,
        Ok(v) if v.decision.allowed => Outcome::Allowed,
        Ok(_) => Outcome::Denied,
        Err(_) => Outcome::DegradedClosed,
    }
}

/// Decides checks for this region.
#[derive(Debug)]
pub struct Decider {
    region: RegionId,
    store: AnyStore,
    fallback: EmbeddedStore,
    breaker: Breaker,
    view: watch::Receiver<Arc<ClusterView>>,
    /// Where each region takes forwarded checks: its API address, or its peer address when
    /// `over_peer`.
    homes: HashMap<RegionId, String>,
    /// Plain HTTP to the API, or the peer mutual-TLS client (rebuilt on rotation).
    http: PeerHttp,
    /// Forwarded checks go over the peer TLS channel ([`PEER_FORWARD_PREFIX`]).
    over_peer: bool,
    forward_timeout: Duration,
    peer_token: Option<Secret>,
    pub metrics: DecisionMetrics,
    store_latency: Histogram,
    store_errors: Counter,
    forward_failures: Counter,
    /// Tokens of checks this region sent elsewhere since the last report, by bucket: they are
    /// demand here (where the callers are), which is what lets share come back to a region
    /// that forwards because its share ran to 0.
    forwarded_usage: Mutex<HashMap<BucketRef, (u64, u64)>>,
    /// Token-bucket denials still standing: further checks of those buckets at that cost or
    /// more are answered without Redis until their retry time has passed.
    denials: Denials,
    denial_cache_hits: Counter,
    denial_cache_probes: Counter,
    /// Hot token buckets' tokens taken from Redis in batches and handed out here; `None`
    /// when turned off (`redis.reservations = false`) or on the embedded store.
    reservations: Option<Reservations>,
    /// How long a check waits for another check's batch: the store's timeout.
    store_timeout: Duration,
    reservation_hits: Counter,
    reservation_batches: Counter,
}

/// What a [`Decider`] is built from.
#[derive(Debug)]
pub struct DeciderParts {
    pub region: RegionId,
    pub store: AnyStore,
    pub breaker: Breaker,
    pub view: watch::Receiver<Arc<ClusterView>>,
    /// Every region's API address (`host:port`), for forwarding pinned tenants; its peer
    /// address with [`Decider::forwarding_over_peer`].
    pub homes: HashMap<RegionId, String>,
    pub forward_timeout: Duration,
    /// The peer token forwarded checks carry (multi-region only).
    pub peer_token: Option<Secret>,
    /// Take hot token buckets' tokens from Redis in batches (Redis store only).
    pub reservations: bool,
    /// The store's call timeout.
    pub store_timeout: Duration,
}

impl Decider {
    pub fn new(p: DeciderParts) -> Self {
        let region = p.region.as_str().to_string();
        Self {
            metrics: DecisionMetrics::new(&region),
            store_latency: metrics::histogram!(telemetry::STORE_LATENCY_SECONDS, "region" => region.clone()),
            store_errors: metrics::counter!(telemetry::STORE_ERRORS_TOTAL, "region" => region.clone()),
            forward_failures: metrics::counter!(telemetry::FORWARDED_TOTAL, "region" => region.clone(), "outcome" => "unreachable"),
            denial_cache_hits: metrics::counter!(telemetry::DENIAL_CACHE_HITS_TOTAL, "region" => region.clone()),
            denial_cache_probes: metrics::counter!(telemetry::DENIAL_CACHE_PROBES_TOTAL, "region" => region.clone()),
            reservation_hits: metrics::counter!(telemetry::RESERVATION_HITS_TOTAL, "region" => region.clone()),
            reservation_batches: metrics::counter!(telemetry::RESERVATION_BATCHES_TOTAL, "region" => region),
            reservations: (p.reservations && !is_embedded(&p.store)).then(Reservations::default),
            store_timeout: p.store_timeout,
            region: p.region,
            store: p.store,
            fallback: EmbeddedStore::new(),
            breaker: p.breaker,
            view: p.view,
            homes: p.homes,
            http: PeerHttp::new(None, |b| b)
                .expect("a plain HTTP client builds without TLS configuration"),
            over_peer: false,
            forward_timeout: p.forward_timeout,
            peer_token: p.peer_token,
            forwarded_usage: Mutex::default(),
            denials: Denials::default(),
        }
    }

    /// Drops every remembered denial: this region's agent wrote bucket parameters, which the
    /// store applies over the limits checks pass.
    pub fn forget_denials(&self) {
        self.denials.forget_all();
        // Reserved tokens were taken under the old parameters: they go back now.
        if let Some(r) = &self.reservations {
            self.give_back(r.take_all());
        }
    }

    /// Gives reserved tokens back to the store, in the background.
    fn give_back(&self, refunds: Vec<Refund>) {
        if refunds.is_empty() {
            return;
        }
        let store = self.store.clone();
        tokio::spawn(async move { give_back_now(&store, refunds).await });
    }

    /// Gives back pools that aged out and forgets idle buckets (run every few tens of ms).
    pub fn sweep_reservations(&self) {
        if let Some(r) = &self.reservations {
            self.give_back(r.sweep(clock::monotonic()));
        }
    }

    /// Gives every reserved token back, waiting for the store (on shutdown).
    pub async fn return_reservations(&self) {
        if let Some(r) = &self.reservations {
            give_back_now(&self.store, r.take_all()).await;
        }
    }

    /// Forwards checks over the peer mutual-TLS channel with `http`, to the home's peer
    /// listener: `homes` must then hold peer addresses.
    pub fn forwarding_over_peer(mut self, http: PeerHttp) -> Self {
        self.http = http;
        self.over_peer = true;
        self
    }

    /// The usage of checks this region forwarded since the last call, for its usage report.
    pub fn take_forwarded_usage(&self) -> Vec<UsageRecord> {
        let taken = std::mem::take(
            &mut *self
                .forwarded_usage
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        taken
            .into_iter()
            .map(|(bucket, (admitted, denied))| UsageRecord {
                bucket,
                admitted,
                denied,
            })
            .collect()
    }

    /// Counts a check another region decided for this one's caller.
    fn count_forwarded(&self, bucket: &BucketRef, cost: u64, allowed: bool) {
        let mut usage = self
            .forwarded_usage
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // Bounded by the policies in the view: one entry per bucket.
        let slot = usage.entry(bucket.clone()).or_default();
        if allowed {
            slot.0 = slot.0.saturating_add(cost);
        } else {
            slot.1 = slot.1.saturating_add(cost);
        }
    }

    /// Applies a shadow policy's rule to a verdict and counts a shadow denial.
    fn count_shadow(&self, policy: &PolicyName, v: Verdict) -> Verdict {
        let v = v.shadowed();
        if v.shadow_denied && v.mode != Mode::Forwarded {
            // The home region that decided a forwarded check counted it.
            self.metrics.record_shadow_denial(policy);
        }
        v
    }

    /// True when a request's forwarded-header value proves it came from a peer daemon.
    pub fn is_peer_forward(&self, value: Option<&str>) -> bool {
        match (&self.peer_token, value) {
            (Some(t), Some(v)) => t.matches(v),
            _ => false,
        }
    }

    /// This daemon's region.
    pub fn region(&self) -> &RegionId {
        &self.region
    }

    /// The store decisions go to.
    pub fn store(&self) -> &AnyStore {
        &self.store
    }

    /// The in-process bucket used when the store is down.
    pub fn fallback(&self) -> &EmbeddedStore {
        &self.fallback
    }

    /// Decides in process, at this region's share, when the regional store or the tenant's home
    /// region cannot; a failure there is reduced capacity (503), never an allow.
    /// A verdict this region decided.
    fn verdict_here(&self, decision: Decision, policy: Policy, mode: Mode) -> Verdict {
        Verdict {
            decision,
            policy,
            mode,
            decided_by: self.region.clone(),
            shadow_denied: false,
        }
    }

    async fn decide_in_process(
        &self,
        req: &CheckRequest,
        reason: &'static str,
    ) -> Result<Decision, CheckError> {
        self.fallback
            .check(req)
            .await
            .map_err(|_| CheckError::ReducedCapacity {
                policy: req.bucket.policy.clone(),
                reason,
            })
    }

    /// The breaker's state, for /v1/status.
    pub fn store_degraded(&self) -> bool {
        self.breaker.is_open()
    }

    /// The current coordinator view.
    pub fn view(&self) -> Arc<ClusterView> {
        self.view.borrow().clone()
    }

    /// This region's limit for a policy right now (lease or floor), with the enforced share.
    pub fn params_for(
        &self,
        view: &ClusterView,
        tenant: &TenantId,
        policy: &PolicyName,
    ) -> Option<(Policy, u32, Limit)> {
        Some(self.params_of(view, view.resolve(tenant, policy)?.entry))
    }

    fn params_of(&self, view: &ClusterView, entry: &PolicyEntry) -> (Policy, u32, Limit) {
        let share = view.enforced_share_ppm(entry.grants.get(&self.region), clock::wall_ms());
        (
            entry.policy.clone(),
            share,
            limit_for_share(&entry.policy, share).into(),
        )
    }

    /// Whole tokens left in a bucket of this region, read without spending from the store
    /// that decides now (the in-process bucket while the breaker is open); `None` if the
    /// store cannot answer.
    pub async fn tokens_left(&self, bucket: BucketRef, limit: Limit) -> Option<u64> {
        self.peek(bucket, limit).await.map(|d| d.remaining)
    }

    /// A bucket of this region as a check of cost 0 sees it, spending nothing, read as
    /// [`Decider::tokens_left`] reads it; `None` if the store cannot answer.
    pub async fn peek(&self, bucket: BucketRef, limit: Limit) -> Option<Decision> {
        let req = CheckRequest::peek(bucket, limit);
        // The store bounds every call with its own timeout.
        let r = if self.breaker.is_open() {
            self.fallback.check(&req).await
        } else {
            self.store.check(&req).await
        };
        // Tokens reserved here are this region's too, not yet handed out.
        let held = self
            .reservations
            .as_ref()
            .map_or(0, |r| r.held(&req.bucket));
        r.ok().map(|d| Decision {
            remaining: d.remaining.saturating_add(held),
            ..d
        })
    }

    /// Decides one check. `forwarded` is true when another region sent it here.
    pub async fn check(
        &self,
        tenant: TenantId,
        policy_name: PolicyName,
        cost: u64,
        forwarded: bool,
    ) -> Result<Verdict, CheckError> {
        let started = clock::monotonic();
        // Taken before the view is read: a parameter write after this point (of a share newer
        // than the limit read here) keeps this check's answer out of the denial cache.
        let ticket = self.denials.ticket(started);
        let view = self.view();
        // The subject's own policy, else its plan's: either way its own bucket, at the
        // version and share of the entry it resolved to.
        let entry = view
            .resolve(&tenant, &policy_name)
            .ok_or(CheckError::UnknownPolicy)?
            .entry;
        let (policy, _share, limit) = self.params_of(&view, entry);
        mode::check_cost(&policy, cost, entry.grants.len())?;
        // While a home is still being granted its share (it holds less than the cost), the
        // region granted the most decides.
        let home =
            entry
                .home
                .as_ref()
                .filter(|h| **h != self.region)
                .map(|h| match entry.grants.get(h) {
                    Some(g) if holds(&limit_for_share(&entry.policy, g.share_ppm).into(), cost) => {
                        h.clone()
                    }
                    _ => richest_elsewhere(entry, &self.region, cost).unwrap_or_else(|| h.clone()),
                });
        // A share here that cannot hold the cost at all (none, or less than the cost) would
        // answer "never": the region granted the most decides instead. Not while this
        // region's store is out: then the policy's fail mode decides, as the operator chose.
        let richer = match (&home, forwarded) {
            (None, false) if !holds(&limit, cost) && !self.breaker.is_open() => {
                richest_elsewhere(entry, &self.region, cost)
            }
            _ => None,
        };
        drop(view);
        let bucket = BucketRef {
            tenant,
            policy: policy_name.clone(),
            version: policy.version,
        };
        let result = match (home, richer) {
            (Some(home), _) if !forwarded => self.forward(&home, bucket, cost, policy).await,
            (_, Some(there)) => self.forward_richer(&there, bucket, cost, policy).await,
            // No region that could hold the cost is there to ask (this one's lease ran out
            // with no floor, or it was sent a check it cannot hold): a bucket here would
            // answer "never", yet the cost fits the policy, so this is reduced capacity for
            // now. With the store out, the policy's fail mode decides as usual.
            _ if !holds(&limit, cost) && !self.breaker.is_open() => {
                Err(CheckError::ReducedCapacity {
                    policy: bucket.policy,
                    reason: "this region holds too little of the policy's budget for now",
                })
            }
            _ => self.decide_here(bucket, limit, cost, policy, ticket).await,
        }
        .map(|v| self.count_shadow(&policy_name, v));
        self.metrics.record(
            &policy_name,
            outcome_of(&result),
            started.elapsed().as_secs_f64(),
        );
        result
    }

    /// The region a check of `tenant`'s `policy` is decided in when that is not this one (the
    /// tenant is pinned elsewhere), unless the check was itself forwarded here.
    pub fn home_elsewhere(
        &self,
        tenant: &TenantId,
        policy: &PolicyName,
        forwarded: bool,
    ) -> Option<RegionId> {
        if forwarded {
            return None;
        }
        let view = self.view();
        let home = view.resolve(tenant, policy)?.entry.home.as_ref()?;
        (*home != self.region).then(|| home.clone())
    }

    /// Decides checks pinned to `home` with one request there, in order, so a batch pays one
    /// round trip to a home region however many of its checks go there. Each check is first
    /// validated here, as [`Decider::check`] does; a check the home cannot answer (or all of
    /// them, when it is unreachable) falls back as a single forwarded check would.
    pub async fn check_at_home(
        &self,
        home: &RegionId,
        checks: Vec<(TenantId, PolicyName, u64)>,
    ) -> Vec<Result<Verdict, CheckError>> {
        let started = clock::monotonic();
        let prepared: Vec<Result<(BucketRef, u64, Policy), CheckError>> = {
            let view = self.view();
            checks
                .into_iter()
                .map(|(tenant, policy_name, cost)| {
                    let entry = view
                        .resolve(&tenant, &policy_name)
                        .ok_or(CheckError::UnknownPolicy)?
                        .entry;
                    let (policy, _share, _limit) = self.params_of(&view, entry);
                    mode::check_cost(&policy, cost, entry.grants.len())?;
                    let bucket = BucketRef {
                        tenant,
                        policy: policy_name,
                        version: policy.version,
                    };
                    Ok((bucket, cost, policy))
                })
                .collect()
        };
        let sent: Vec<_> = prepared
            .iter()
            .filter_map(|p| p.as_ref().ok())
            .map(|(b, cost, _)| check_body(b, *cost))
            .collect();
        let mut answers = if sent.is_empty() {
            Vec::new()
        } else {
            self.send_home(
                home,
                "/v1/check/batch",
                &serde_json::json!({ "checks": sent }),
            )
            .await
            .and_then(|b: ForwardedBatch| (b.results.len() == sent.len()).then_some(b.results))
            .unwrap_or_default()
        }
        .into_iter();
        let mut results = Vec::with_capacity(prepared.len());
        for p in prepared {
            let result = match p {
                // Refused before deciding, as a single check is: not counted as a decision.
                Err(e) => Err(e),
                Ok((bucket, cost, policy)) => {
                    let name = bucket.policy.clone();
                    let r = match answers.next() {
                        Some(ForwardedItem {
                            status: 200 | 429,
                            decision: Some(a),
                        }) => {
                            self.count_forwarded(&bucket, cost, a.allowed);
                            Ok(a.verdict(policy, home))
                        }
                        _ => self.home_unreachable(home, bucket, cost, policy).await,
                    }
                    .map(|v| self.count_shadow(&name, v));
                    self.metrics
                        .record(&name, outcome_of(&r), started.elapsed().as_secs_f64());
                    r
                }
            };
            results.push(result);
        }
        results
    }

    async fn decide_here(
        &self,
        bucket: BucketRef,
        limit: Limit,
        cost: u64,
        policy: Policy,
        ticket: Ticket,
    ) -> Result<Verdict, CheckError> {
        let req = CheckRequest {
            bucket,
            limit,
            cost,
            now_ms: None,
        };
        match self.ask_store(&req, ticket).await {
            Ok(Some(decision)) => Ok(self.verdict_here(decision, policy, Mode::Normal)),
            Ok(None) => self.fail_over(req, policy).await,
            Err(e) => {
                tracing::warn!(
                    region = %self.region,
                    policy = %req.bucket.policy,
                    error = %e,
                    "The store refused this bucket's data; other buckets are unaffected."
                );
                Err(CheckError::ReducedCapacity {
                    policy: req.bucket.policy,
                    reason: "the regional store refuses this policy's stored bucket",
                })
            }
        }
    }

    /// The store's decision, through the breaker (the embedded store has none): `Ok(None)`
    /// when the breaker is open or the store is out (the fail mode decides), `Err` when the
    /// store answered but refused this request or its bucket's data. A refusal is one bucket's
    /// fault, not an outage: it never counts against the breaker, so one tenant's bad data
    /// cannot degrade the region for the others.
    /// `ticket` was taken before the limit was read (see [`Decider::check`]).
    async fn ask_store(
        &self,
        req: &CheckRequest,
        ticket: Ticket,
    ) -> Result<Option<Decision>, StoreError> {
        if is_embedded(&self.store) {
            return match self.store.check(req).await {
                Ok(d) => Ok(Some(d)),
                Err(e) if !e.is_outage() => Err(e),
                Err(_) => Ok(None),
            };
        }
        let probe = match self.standing_denial(req).await {
            Ok(d) => {
                self.denial_cache_hits.increment(1);
                return Ok(Some(d));
            }
            Err(probe) => probe,
        };
        let t0 = clock::monotonic();
        if let Some(r) = self.reservations.as_ref().filter(|_| req.cost > 0) {
            let mut refunds = Vec::new();
            let (step, taking) = r
                .begin(
                    &req.bucket,
                    &req.limit,
                    req.cost,
                    t0,
                    self.store_timeout,
                    &mut refunds,
                )
                .await;
            self.give_back(refunds);
            match step {
                Step::Answered(d) => {
                    self.reservation_hits.increment(1);
                    return Ok(Some(d));
                }
                Step::Take(batch) => {
                    // Ends the batch if this check goes no further (the store out, an error,
                    // or the request dropped while waiting).
                    let pending = Pending {
                        reservations: r,
                        bucket: &req.bucket,
                    };
                    let ticket = ticket.sent_at(t0);
                    let Some(answer) = self.call_store(t0, self.store.reserve(req, batch)).await?
                    else {
                        return Ok(None);
                    };
                    std::mem::forget(pending);
                    self.reservation_batches.increment(1);
                    let mut refunds = Vec::new();
                    let d = r.filled(
                        &req.bucket,
                        &req.limit,
                        req.cost,
                        taking,
                        answer,
                        &mut refunds,
                    );
                    self.give_back(refunds);
                    // A pool counts in `d`: an admission that leaves less than the cost here
                    // and in Redis holds no tokens in the pool either.
                    self.remember(req, ticket, &d, true, probe);
                    return Ok(Some(d));
                }
                Step::Single => {}
            }
        }
        let ticket = ticket.sent_at(t0);
        let d = self.call_store(t0, self.store.check(req)).await?;
        if let Some(d) = &d {
            // An admission that leaves less than the cost stands only while no tokens of the
            // bucket are held here (this single check may have given up waiting for a batch):
            // Redis's level does not count them.
            let admissions = d.remaining >= req.cost
                || self
                    .reservations
                    .as_ref()
                    .is_none_or(|r| r.idle(&req.bucket));
            self.remember(req, ticket, d, admissions, probe);
        }
        Ok(d)
    }

    /// Remembers a store answer in the denial cache. If this check was its bucket's probe, the
    /// new entry settles it; an answer that leaves none ends the probe (the guard's drop), so
    /// the checks waiting for it ask the store themselves.
    fn remember(
        &self,
        req: &CheckRequest,
        ticket: Ticket,
        d: &Decision,
        admissions: bool,
        probe: Option<Probe<'_>>,
    ) {
        let stands = self.denials.remember(
            ticket,
            &req.bucket,
            &req.limit,
            req.cost,
            d,
            clock::monotonic(),
            admissions,
        );
        if stands {
            std::mem::forget(probe);
        }
    }

    /// A denial still standing for this check (answered without the store), or else whether
    /// this check is its bucket's probe. Waits, at most the store's timeout, while another
    /// check probes the bucket or the probe is not yet due.
    async fn standing_denial<'a>(
        &'a self,
        req: &'a CheckRequest,
    ) -> Result<Decision, Option<Probe<'a>>> {
        let deadline = clock::monotonic() + self.store_timeout;
        let mut armed: Option<Pin<Box<OwnedNotified>>> = None;
        loop {
            let now = clock::monotonic();
            match self.denials.look(&req.bucket, &req.limit, req.cost, now) {
                Look::Denied(d) => return Ok(d),
                Look::Ask => return Err(None),
                Look::Probe => {
                    self.denial_cache_probes.increment(1);
                    return Err(Some(Probe {
                        denials: &self.denials,
                        bucket: &req.bucket,
                    }));
                }
                Look::Wait { .. } if now >= deadline => return Err(None),
                Look::Wait { until, settled } => match armed.take() {
                    // Armed first, then looked at again: a probe settling in between is seen
                    // by the look, one settling after it wakes the wait.
                    None => {
                        let mut woken = Box::pin(settled.notified_owned());
                        woken.as_mut().enable();
                        armed = Some(woken);
                    }
                    Some(woken) => {
                        let at = until.map_or(deadline, |u| u.min(deadline));
                        let _ = tokio::time::timeout_at(at, woken).await;
                    }
                },
            }
        }
    }

    /// One store call through the breaker: `Ok(None)` when the breaker is open or the store is
    /// out, `Err` when the store refused the request or its bucket's data.
    async fn call_store<T>(
        &self,
        t0: tokio::time::Instant,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<Option<T>, StoreError> {
        let Some(permit) = self.breaker.admit() else {
            return Ok(None);
        };
        // The Redis store bounds every call with its configured timeout (a timeout is a
        // `StoreError`), so no second timer is armed here. Dropped here, the permit ends a
        // probe that can no longer report.
        let r = call.await;
        let took = t0.elapsed();
        self.store_latency.record(took.as_secs_f64());
        match r {
            Ok(d) => {
                permit.record(true, took);
                Ok(Some(d))
            }
            Err(e) if !e.is_outage() => {
                permit.record(true, took);
                Err(e)
            }
            Err(e) => {
                self.store_errors.increment(1);
                permit.record(false, took);
                tracing::debug!(region = %self.region, error = %e, "Store call failed.");
                Ok(None)
            }
        }
    }

    /// The policy's fail mode, with the store unavailable.
    async fn fail_over(&self, req: CheckRequest, policy: Policy) -> Result<Verdict, CheckError> {
        match policy.fail_mode {
            FailMode::Local => {
                let decision = self
                    .decide_in_process(&req, "the regional store is unavailable")
                    .await?;
                Ok(self.verdict_here(decision, policy, Mode::DegradedLocal))
            }
            FailMode::Open => {
                let decision = Decision {
                    allowed: true,
                    remaining: match req.limit {
                        Limit::TokenBucket(p) => p.capacity_ut / quota_core::bucket::UT,
                        Limit::SlidingWindow { limit, .. } => limit,
                    },
                    retry_after_ms: Some(0),
                    reset_ms: Some(0),
                };
                Ok(self.verdict_here(decision, policy, Mode::DegradedOpen))
            }
            FailMode::Closed => Err(CheckError::ReducedCapacity {
                policy: req.bucket.policy,
                reason: "the regional store is unavailable and this policy fails closed",
            }),
        }
    }

    async fn forward(
        &self,
        home: &RegionId,
        bucket: BucketRef,
        cost: u64,
        policy: Policy,
    ) -> Result<Verdict, CheckError> {
        match self.ask(home, &bucket, cost, &policy).await {
            Some(v) => Ok(v),
            None => self.home_unreachable(home, bucket, cost, policy).await,
        }
    }

    /// `there`'s decision of the check, counted as forwarded; `None` if it did not answer.
    async fn ask(
        &self,
        there: &RegionId,
        bucket: &BucketRef,
        cost: u64,
        policy: &Policy,
    ) -> Option<Verdict> {
        let body = check_body(bucket, cost);
        let a = self
            .send_home::<ForwardedAnswer>(there, "/v1/check", &body)
            .await?;
        self.count_forwarded(bucket, cost, a.allowed);
        Some(a.verdict(policy.clone(), there))
    }

    /// Decides a check this region's share cannot hold in `there`, the region granted the
    /// most. If it does not answer, nothing here can hold the check either: that is reduced
    /// capacity for as long as the cut lasts (a 503 the caller retries), not a denial with no
    /// time after which it could succeed.
    async fn forward_richer(
        &self,
        there: &RegionId,
        bucket: BucketRef,
        cost: u64,
        policy: Policy,
    ) -> Result<Verdict, CheckError> {
        match self.ask(there, &bucket, cost, &policy).await {
            Some(v) => Ok(v),
            None => {
                self.forward_failures.increment(1);
                Err(CheckError::ReducedCapacity {
                    policy: bucket.policy,
                    reason: "the region holding this policy's budget is unreachable",
                })
            }
        }
    }

    /// POSTs `body` to `path` on `home`'s API as a forwarding peer (over the peer TLS
    /// channel, naming this region, when `over_peer`); the answer of a 200 or 429, or `None`
    /// when the home is unknown, unreachable, slow or answers anything else.
    async fn send_home<T: serde::de::DeserializeOwned>(
        &self,
        home: &RegionId,
        path: &str,
        body: &serde_json::Value,
    ) -> Option<T> {
        let addr = self.homes.get(home)?;
        let prefix = if self.over_peer {
            PEER_FORWARD_PREFIX
        } else {
            ""
        };
        let mut req = self
            .http
            .client()
            .post(format!("{}://{addr}{prefix}{path}", self.http.scheme()))
            .header(
                FORWARDED_HEADER.as_str(),
                self.peer_token.as_ref().map_or("", |t| t.expose()),
            );
        if self.over_peer {
            req = req.header(FORWARDED_FROM_HEADER.as_str(), self.region.as_str());
        }
        let resp = req
            .timeout(self.forward_timeout)
            .json(body)
            .send()
            .await
            .ok()?;
        if !matches!(resp.status().as_u16(), 200 | 429) {
            return None;
        }
        resp.json::<T>().await.ok()
    }

    /// A check whose home region could not decide it: this region's floor, in process, or a
    /// denial when the policy fails closed or has no floor.
    async fn home_unreachable(
        &self,
        home: &RegionId,
        bucket: BucketRef,
        cost: u64,
        policy: Policy,
    ) -> Result<Verdict, CheckError> {
        self.forward_failures.increment(1);
        tracing::debug!(tenant = %bucket.tenant, home = %home, "Home region unreachable.");
        // The floor in whole units: one that holds less than a unit is none.
        let floor_ppm = policy.whole_floor_ppm();
        if policy.fail_mode == FailMode::Closed || floor_ppm == 0 {
            return Err(CheckError::ReducedCapacity {
                policy: bucket.policy,
                reason: "the tenant's home region is unreachable",
            });
        }
        // Decide at this region's floor, in process, so a down home cannot be bypassed at more.
        let limit = limit_for_share(&policy, floor_ppm).into();
        let req = CheckRequest {
            bucket,
            limit,
            cost,
            now_ms: None,
        };
        let decision = self
            .decide_in_process(&req, "the tenant's home region is unreachable")
            .await?;
        Ok(self.verdict_here(decision, policy, Mode::HomeUnreachableFloor))
    }
}

/// A batch being taken for a bucket: dropped without being forgotten (the check went no
/// further), it ends the batch so checks waiting for it go on.
struct Pending<'a> {
    reservations: &'a Reservations,
    bucket: &'a BucketRef,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.reservations.abandon(self.bucket);
    }
}

/// A check probing a bucket whose denial is ending: dropped without an answer remembered (the
/// store out, an error, the request dropped), it ends the probe so checks waiting for it go on.
struct Probe<'a> {
    denials: &'a Denials,
    bucket: &'a BucketRef,
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        self.denials.abandon(self.bucket);
    }
}

/// Gives reserved tokens back to the store; a refund that fails leaves them spent (fewer
/// admissions, never more).
async fn give_back_now(store: &AnyStore, refunds: Vec<Refund>) {
    for r in refunds {
        if let Err(e) = store.refund(&r.bucket, r.tokens, None).await {
            tracing::debug!(error = %e, "A reservation's refund failed; its tokens stay spent.");
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use axum::http::HeaderMap;
    use axum::routing::post;
    use quota_core::PolicySpec;
    use serde_json::{json, Value};

    use super::*;
    use crate::config::BreakerConfig;
    use crate::coordination::Grant;

    /// What the home region received: path, forwarded header, body.
    pub(crate) type Seen = Arc<Mutex<Vec<(String, Option<String>, Value)>>>;

    fn ids(tenant: &str, policy: &str) -> (TenantId, PolicyName) {
        (
            TenantId::new(tenant).unwrap(),
            PolicyName::new(policy).unwrap(),
        )
    }

    /// A policy of `tenant` pinned to region a, as region b sees it.
    fn pinned(tenant: &str, fail_mode: &str) -> ((TenantId, PolicyName), PolicyEntry) {
        let spec: PolicySpec = serde_json::from_value(
            json!({"limit": 10, "window_ms": 1000, "floor": 0.5, "fail_mode": fail_mode}),
        )
        .unwrap();
        let grant = Grant {
            share_ppm: 500_000,
            floor_ppm: 500_000,
        };
        let entry = PolicyEntry {
            policy: spec.validate().unwrap(),
            grants: BTreeMap::from([(RegionId::new("b").unwrap(), grant)]),
            home: Some(RegionId::new("a").unwrap()),
            mode: quota_core::mode::BudgetMode::Split,
        };
        (ids(tenant, "w"), entry)
    }

    /// Region b's decider with two tenants pinned to a, whose API is a server that records
    /// every request and answers batches with `status` (each check allowed, 7 left).
    pub(crate) async fn decider_with_home(status: u16) -> (Decider, Seen) {
        let seen: Seen = Arc::default();
        let record = seen.clone();
        let home = axum::Router::new().route(
            "/v1/check/batch",
            post(move |headers: HeaderMap, body: axum::Json<Value>| {
                let record = record.clone();
                async move {
                    let forwarded = headers
                        .get(&FORWARDED_HEADER)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string);
                    let n = body["checks"].as_array().map_or(0, Vec::len);
                    record
                        .lock()
                        .unwrap()
                        .push(("/v1/check/batch".into(), forwarded, body.0));
                    let item = json!({"status": 200, "decision": {"allowed": true, "remaining": 7,
                        "retry_after_ms": 0, "reset_ms": 300, "region": "a", "decided_by": "a",
                        "mode": "normal"}});
                    let status = axum::http::StatusCode::from_u16(status).unwrap();
                    (status, axum::Json(json!({"results": vec![item; n]})))
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, home).await });
        let view = ClusterView {
            policies: [pinned("vip", "local"), pinned("strict", "closed")]
                .into_iter()
                .collect(),
            lease_end_local_ms: u64::MAX,
            ..ClusterView::default()
        };
        let (_tx, rx) = watch::channel(Arc::new(view));
        // The sender may go: the receiver keeps the last view.
        let region = RegionId::new("b").unwrap();
        let decider = Decider::new(DeciderParts {
            region: region.clone(),
            store: AnyStore::embedded(),
            breaker: Breaker::new(&BreakerConfig::default(), "b"),
            view: rx,
            homes: HashMap::from([(RegionId::new("a").unwrap(), addr.to_string())]),
            forward_timeout: Duration::from_secs(5),
            peer_token: Some(Secret::new("peer-token")),
            reservations: false,
            store_timeout: Duration::from_millis(100),
        });
        (decider, seen)
    }

    fn checks(list: &[(&str, &str, u64)]) -> Vec<(TenantId, PolicyName, u64)> {
        list.iter()
            .map(|(t, p, c)| {
                let (t, p) = ids(t, p);
                (t, p, *c)
            })
            .collect()
    }

    #[tokio::test]
    async fn a_homes_checks_go_there_in_one_request_in_order() {
        let (d, seen) = decider_with_home(200).await;
        let (vip, w) = ids("vip", "w");
        assert_eq!(
            d.home_elsewhere(&vip, &w, false).map(|r| r.to_string()),
            Some("a".into())
        );
        assert_eq!(
            d.home_elsewhere(&vip, &w, true),
            None,
            "a forwarded check stays"
        );
        let list = [
            ("vip", "w", 1),
            ("strict", "w", 2),
            ("vip", "nope", 1),
            ("vip", "w", 11),
            ("vip", "w", 3),
        ];
        let home = RegionId::new("a").unwrap();
        let results = d.check_at_home(&home, checks(&list)).await;
        // Unknown policies and costs above the burst are refused here, not sent.
        assert!(matches!(results[2], Err(CheckError::UnknownPolicy)));
        assert!(matches!(results[3], Err(CheckError::Cost(_))));
        for i in [0, 1, 4] {
            let v = results[i].as_ref().unwrap();
            assert_eq!((v.mode, v.decided_by.as_str()), (Mode::Forwarded, "a"));
            assert_eq!((v.decision.allowed, v.decision.remaining), (true, 7));
        }
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 1, "one request for the home's checks: {seen:?}");
        let (path, forwarded, body) = &seen[0];
        assert_eq!(path, "/v1/check/batch");
        assert_eq!(forwarded.as_deref(), Some("peer-token"));
        let sent: Vec<_> = body["checks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["tenant"].clone(), c["cost"].clone()))
            .collect();
        assert_eq!(
            sent,
            [
                (json!("vip"), json!(1)),
                (json!("strict"), json!(2)),
                (json!("vip"), json!(3))
            ]
        );
    }

    #[tokio::test]
    async fn a_home_that_cannot_answer_leaves_each_check_to_its_policy() {
        let (d, seen) = decider_with_home(503).await;
        let home = RegionId::new("a").unwrap();
        let results = d
            .check_at_home(&home, checks(&[("vip", "w", 1), ("strict", "w", 1)]))
            .await;
        let v = results[0].as_ref().unwrap();
        assert_eq!(
            (v.mode, v.decided_by.as_str()),
            (Mode::HomeUnreachableFloor, "b")
        );
        assert!(v.decision.allowed);
        assert!(matches!(
            results[1],
            Err(CheckError::ReducedCapacity { .. })
        ));
        assert_eq!(seen.lock().unwrap().len(), 1);
        // A home with no known address is unreachable as well, with nothing sent.
        let nowhere = RegionId::new("c").unwrap();
        let results = d.check_at_home(&nowhere, checks(&[("vip", "w", 1)])).await;
        assert_eq!(
            results[0].as_ref().unwrap().mode,
            Mode::HomeUnreachableFloor
        );
        assert_eq!(seen.lock().unwrap().len(), 1);
    }

    /// A cost the other regions' floors leave no region able to hold is refused up front, not
    /// answered "never": floors of 0.3 in three regions leave at most 4 of a burst of 10.
    #[tokio::test]
    async fn a_cost_beyond_what_floors_leave_is_refused() {
        let spec: PolicySpec =
            serde_json::from_value(json!({"limit": 10, "window_ms": 1000, "floor": 0.3})).unwrap();
        let grant = |share_ppm| Grant {
            share_ppm,
            floor_ppm: 300_000,
        };
        let entry = PolicyEntry {
            policy: spec.validate().unwrap(),
            grants: ["a", "b", "c"]
                .into_iter()
                .zip([400_000, 300_000, 300_000])
                .map(|(r, s)| (RegionId::new(r).unwrap(), grant(s)))
                .collect(),
            home: None,
            mode: quota_core::mode::BudgetMode::Split,
        };
        let view = ClusterView {
            policies: [(ids("t", "w"), entry)].into_iter().collect(),
            lease_end_local_ms: u64::MAX,
            ..ClusterView::default()
        };
        let (_tx, rx) = watch::channel(Arc::new(view));
        let region = RegionId::new("a").unwrap();
        let d = Decider::new(DeciderParts {
            region: region.clone(),
            store: AnyStore::embedded(),
            breaker: Breaker::new(&BreakerConfig::default(), "a"),
            view: rx,
            homes: HashMap::new(),
            forward_timeout: Duration::from_secs(5),
            peer_token: None,
            reservations: false,
            store_timeout: Duration::from_millis(100),
        });
        let (t, w) = ids("t", "w");
        let refused = d.check(t.clone(), w.clone(), 5, false).await;
        assert_eq!(
            refused.unwrap_err(),
            CheckError::Cost(CostError::BeyondFloors {
                cost: 5,
                largest: 4
            })
        );
        let admitted = d.check(t, w, 4, false).await.unwrap();
        assert!(admitted.decision.allowed, "{admitted:?}");
    }

    /// A region whose share cannot hold a check sends it to the region granted the most; if
    /// that one does not answer, the check gets reduced capacity (a 503), not a denial that
    /// could never end, since no bucket here could admit it.
    #[tokio::test]
    async fn a_zero_share_region_cut_off_from_the_richest_answers_reduced_capacity() {
        let spec: PolicySpec =
            serde_json::from_value(json!({"limit": 10, "window_ms": 1000})).unwrap();
        let grant = |share_ppm| Grant {
            share_ppm,
            floor_ppm: 0,
        };
        let entry = PolicyEntry {
            policy: spec.validate().unwrap(),
            grants: [("a", 0), ("b", 1_000_000)]
                .into_iter()
                .map(|(r, s)| (RegionId::new(r).unwrap(), grant(s)))
                .collect(),
            home: None,
            mode: quota_core::mode::BudgetMode::Split,
        };
        let view = ClusterView {
            policies: [(ids("t", "w"), entry)].into_iter().collect(),
            lease_end_local_ms: u64::MAX,
            ..ClusterView::default()
        };
        let (_tx, rx) = watch::channel(Arc::new(view));
        // A port nothing listens on: the connection is refused at once.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = closed.local_addr().unwrap();
        drop(closed);
        let d = Decider::new(DeciderParts {
            region: RegionId::new("a").unwrap(),
            store: AnyStore::embedded(),
            breaker: Breaker::new(&BreakerConfig::default(), "a"),
            view: rx,
            homes: HashMap::from([(RegionId::new("b").unwrap(), addr.to_string())]),
            forward_timeout: Duration::from_secs(5),
            peer_token: None,
            reservations: false,
            store_timeout: Duration::from_millis(100),
        });
        let (t, w) = ids("t", "w");
        let r = d.check(t, w, 1, false).await;
        assert!(
            matches!(r, Err(CheckError::ReducedCapacity { .. })),
            "{r:?}"
        );
    }

    /// A region whose lease ran out with no floor holds nothing, and no other region holds
    /// the budget (the home is this region): a check gets reduced capacity, not "never".
    #[tokio::test]
    async fn a_lapsed_region_without_a_floor_answers_reduced_capacity() {
        let spec: PolicySpec =
            serde_json::from_value(json!({"limit": 10, "window_ms": 1000})).unwrap();
        let entry = PolicyEntry {
            policy: spec.validate().unwrap(),
            grants: [("a", 1_000_000), ("b", 0)]
                .into_iter()
                .map(|(r, share_ppm)| {
                    let g = Grant {
                        share_ppm,
                        floor_ppm: 0,
                    };
                    (RegionId::new(r).unwrap(), g)
                })
                .collect(),
            home: Some(RegionId::new("a").unwrap()),
            mode: quota_core::mode::BudgetMode::Home,
        };
        let view = ClusterView {
            policies: [(ids("t", "w"), entry)].into_iter().collect(),
            lease_end_local_ms: 0,
            ..ClusterView::default()
        };
        let (_tx, rx) = watch::channel(Arc::new(view));
        let d = Decider::new(DeciderParts {
            region: RegionId::new("a").unwrap(),
            store: AnyStore::embedded(),
            breaker: Breaker::new(&BreakerConfig::default(), "a"),
            view: rx,
            homes: HashMap::new(),
            forward_timeout: Duration::from_secs(5),
            peer_token: None,
            reservations: false,
            store_timeout: Duration::from_millis(100),
        });
        let (t, w) = ids("t", "w");
        let r = d.check(t, w, 1, false).await;
        assert!(
            matches!(r, Err(CheckError::ReducedCapacity { .. })),
            "{r:?}"
        );
    }
}
