//! The decision path: policy lookup, cost check, pin forwarding, this region's enforced share,
//! one store call behind the circuit breaker, and the policy's fail mode when the store is down.
//!
//! Nothing here holds a lock across an await: the view is an `Arc` snapshot, the breaker and
//! the in-process buckets use short synchronous critical sections.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use metrics::{Counter, Histogram};
use quota_core::policy::CostError;
use quota_core::{
    Algorithm, BucketParams, Decision, FailMode, Policy, PolicyName, RegionId, TenantId, PPM,
};
use quota_store::{AnyStore, BucketRef, CheckRequest, EmbeddedStore, Limit, Store};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::breaker::{Admission, Breaker};
use crate::clock;
use crate::config::Secret;
use crate::coordination::{ClusterView, PolicyEntry};
use crate::telemetry::{self, DecisionMetrics, Outcome};

/// Header marking a check forwarded from another region, so it is never forwarded again. Its
/// value is the peer token: a client cannot use it to skip a pinned tenant's home.
/// A `HeaderName`, not a `&str`: looking a `&str` up parses it on every request.
pub const FORWARDED_HEADER: axum::http::HeaderName =
    axum::http::HeaderName::from_static("x-quotad-forwarded");

/// The limit this region enforces for a policy at a share: a bucket of `s·C` refilling at
/// `s·r`, or for a sliding window `s·limit` per window.
pub fn limit_for_share(policy: &Policy, share_ppm: u32) -> Limit {
    match policy.algorithm {
        Algorithm::TokenBucket => Limit::TokenBucket(BucketParams::for_share(policy, share_ppm)),
        Algorithm::SlidingWindow => Limit::SlidingWindow {
            limit: (u128::from(policy.limit) * u128::from(share_ppm.min(PPM)) / u128::from(PPM))
                as u64,
            window_ms: policy.window_ms,
        },
    }
}

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
}

/// Decides checks for this region.
#[derive(Debug)]
pub struct Decider {
    region: RegionId,
    store: AnyStore,
    fallback: EmbeddedStore,
    breaker: Breaker,
    view: watch::Receiver<Arc<ClusterView>>,
    homes: HashMap<RegionId, SocketAddr>,
    http: reqwest::Client,
    forward_timeout: Duration,
    peer_token: Option<Secret>,
    pub metrics: DecisionMetrics,
    store_latency: Histogram,
    store_errors: Counter,
    forward_failures: Counter,
}

/// What a [`Decider`] is built from.
#[derive(Debug)]
pub struct DeciderParts {
    pub region: RegionId,
    pub store: AnyStore,
    pub breaker: Breaker,
    pub view: watch::Receiver<Arc<ClusterView>>,
    /// Every region's API address, for forwarding pinned tenants.
    pub homes: HashMap<RegionId, SocketAddr>,
    pub forward_timeout: Duration,
    /// The peer token forwarded checks carry (multi-region only).
    pub peer_token: Option<Secret>,
}

impl Decider {
    pub fn new(p: DeciderParts) -> Self {
        let region = p.region.as_str().to_string();
        Self {
            metrics: DecisionMetrics::new(&region),
            store_latency: metrics::histogram!(telemetry::STORE_LATENCY_SECONDS, "region" => region.clone()),
            store_errors: metrics::counter!(telemetry::STORE_ERRORS_TOTAL, "region" => region.clone()),
            forward_failures: metrics::counter!(telemetry::FORWARDED_TOTAL, "region" => region, "outcome" => "unreachable"),
            region: p.region,
            store: p.store,
            fallback: EmbeddedStore::new(),
            breaker: p.breaker,
            view: p.view,
            homes: p.homes,
            http: reqwest::Client::new(),
            forward_timeout: p.forward_timeout,
            peer_token: p.peer_token,
        }
    }

    /// True when a request's forwarded-header value proves it came from a peer daemon.
    pub fn is_peer_forward(&self, value: Option<&str>) -> bool {
        match (&self.peer_token, value) {
            (Some(t), Some(v)) => crate::api::auth::token_matches(t.expose(), v),
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
        Some(self.params_of(view, view.policy(tenant, policy)?))
    }

    fn params_of(&self, view: &ClusterView, entry: &PolicyEntry) -> (Policy, u32, Limit) {
        let share = view.enforced_share_ppm(entry.grants.get(&self.region), clock::wall_ms());
        (
            entry.policy.clone(),
            share,
            limit_for_share(&entry.policy, share),
        )
    }

    /// Whole tokens left in a bucket of this region, read without spending from the store
    /// that decides now (the in-process bucket while the breaker is open); `None` if the
    /// store cannot answer.
    pub async fn tokens_left(&self, bucket: BucketRef, limit: Limit) -> Option<u64> {
        let req = CheckRequest::peek(bucket, limit);
        // The store bounds every call with its own timeout.
        let r = if self.breaker.is_open() {
            self.fallback.check(&req).await
        } else {
            self.store.check(&req).await
        };
        r.ok().map(|d| d.remaining)
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
        let view = self.view();
        // One lookup: building the map key clones both ids.
        let entry = view
            .policy(&tenant, &policy_name)
            .ok_or(CheckError::UnknownPolicy)?;
        let (policy, _share, limit) = self.params_of(&view, entry);
        policy.check_cost(cost)?;
        let home = entry.home.as_ref().filter(|h| **h != self.region).cloned();
        drop(view);
        let bucket = BucketRef {
            tenant,
            policy: policy_name.clone(),
            version: policy.version,
        };
        let result = match home {
            Some(home) if !forwarded => self.forward(&home, bucket, cost, policy).await,
            _ => self.decide_here(bucket, limit, cost, policy).await,
        };
        let outcome = match &result {
            Ok(v) if v.mode == Mode::Forwarded => Outcome::Forwarded,
            Ok(v) if v.mode == Mode::DegradedOpen => Outcome::DegradedOpen,
            Ok(v) if v.mode == Mode::DegradedLocal => Outcome::DegradedLocal,
            Ok(v) if v.decision.allowed => Outcome::Allowed,
            Ok(_) => Outcome::Denied,
            Err(_) => Outcome::DegradedClosed,
        };
        self.metrics
            .record(&policy_name, outcome, started.elapsed().as_secs_f64());
        result
    }

    async fn decide_here(
        &self,
        bucket: BucketRef,
        limit: Limit,
        cost: u64,
        policy: Policy,
    ) -> Result<Verdict, CheckError> {
        let req = CheckRequest {
            bucket,
            limit,
            cost,
            now_ms: None,
        };
        let from_store = if is_embedded(&self.store) {
            self.store.check(&req).await.ok()
        } else if self.breaker.admit() == Admission::Call {
            let t0 = clock::monotonic();
            // The Redis store bounds every call with its configured timeout (a timeout is a
            // `StoreError`), so no second timer is armed here.
            let r = self.store.check(&req).await;
            let took = t0.elapsed();
            self.store_latency.record(took.as_secs_f64());
            let ok = r.is_ok();
            if !ok {
                self.store_errors.increment(1);
            }
            self.breaker.record(ok, took);
            match r {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::debug!(region = %self.region, error = %e, "Store call failed.");
                    None
                }
            }
        } else {
            None
        };
        let region = self.region.clone();
        if let Some(decision) = from_store {
            return Ok(Verdict {
                decision,
                policy,
                mode: Mode::Normal,
                decided_by: region,
            });
        }
        match policy.fail_mode {
            FailMode::Local => {
                let decision = self
                    .decide_in_process(&req, "the regional store is unavailable")
                    .await?;
                Ok(Verdict {
                    decision,
                    policy,
                    mode: Mode::DegradedLocal,
                    decided_by: region,
                })
            }
            FailMode::Open => {
                let decision = Decision {
                    allowed: true,
                    remaining: match limit {
                        Limit::TokenBucket(p) => p.capacity_ut / quota_core::bucket::UT,
                        Limit::SlidingWindow { limit, .. } => limit,
                    },
                    retry_after_ms: Some(0),
                    reset_ms: Some(0),
                };
                Ok(Verdict {
                    decision,
                    policy,
                    mode: Mode::DegradedOpen,
                    decided_by: region,
                })
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
        if let Some(addr) = self.homes.get(home) {
            let body = serde_json::json!({
                "tenant": bucket.tenant.as_str(),
                "policy": bucket.policy.as_str(),
                "cost": cost,
            });
            let sent = self
                .http
                .post(format!("http://{addr}/v1/check"))
                .header(
                    FORWARDED_HEADER.as_str(),
                    self.peer_token.as_ref().map_or("", |t| t.expose()),
                )
                .timeout(self.forward_timeout)
                .json(&body)
                .send()
                .await;
            if let Ok(resp) = sent {
                let status = resp.status().as_u16();
                if status == 200 || status == 429 {
                    if let Ok(a) = resp.json::<ForwardedAnswer>().await {
                        let decision = Decision {
                            allowed: a.allowed,
                            remaining: a.remaining,
                            retry_after_ms: a.retry_after_ms,
                            reset_ms: a.reset_ms,
                        };
                        return Ok(Verdict {
                            decision,
                            policy,
                            mode: Mode::Forwarded,
                            decided_by: home.clone(),
                        });
                    }
                }
            }
        }
        self.forward_failures.increment(1);
        tracing::debug!(tenant = %bucket.tenant, home = %home, "Home region unreachable.");
        if policy.fail_mode == FailMode::Closed || policy.floor_ppm == 0 {
            return Err(CheckError::ReducedCapacity {
                policy: bucket.policy,
                reason: "the tenant's home region is unreachable",
            });
        }
        // Decide at this region's floor, in process, so a down home cannot be bypassed at more.
        let limit = limit_for_share(&policy, policy.floor_ppm);
        let req = CheckRequest {
            bucket,
            limit,
            cost,
            now_ms: None,
        };
        let decision = self
            .decide_in_process(&req, "the tenant's home region is unreachable")
            .await?;
        Ok(Verdict {
            decision,
            policy,
            mode: Mode::HomeUnreachableFloor,
            decided_by: self.region.clone(),
        })
    }
}
