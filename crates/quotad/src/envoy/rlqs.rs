//! Envoy's rate limit quota service (RLQS, `envoy.service.rate_limit_quota.v3`) on the Envoy
//! listener: each Envoy reports its buckets' usage on a stream and enforces, itself, the token
//! bucket quotad assigns in answer, so no request waits on quotad. docs/envoy.md is the
//! reference.
//!
//! - A bucket id names a subject and policy as an RLS descriptor does ([`SubjectKeys`]); the
//!   report's `domain` is the policy when no entry names one.
//! - Each report is answered with an assignment for every bucket it lists: this daemon's part
//!   of the region's share, split by reported demand
//!   ([`crate::decision::envoy_holdings`]), as a token bucket filling every second, living two
//!   report periods and a second and never past the region's lease end. A bucket naming no
//!   tenant or an unknown policy gets `[envoy] rlqs_unknown_bucket`; a budget pinned to another
//!   region `rlqs_elsewhere`; a malformed one `DENY_ALL` (a refusal is a denial, as in RLS).
//! - Reported requests, allowed and denied, are the region's demand: they go with its usage
//!   reports, so shares follow the Envoys' traffic.
//! - Envoy's client as it is (a code reading, docs/envoy.md): it reports every 5 s whatever it
//!   is configured with, `time_elapsed` 0 on a bucket's first report, every bucket every time
//!   (zero usage included), `domain` in every report; TTLs in whole seconds; an unset TTL
//!   expires at once, so every answer carries one.
//! - A report without buckets, a bucket without an id or an empty one, and a report of more
//!   than [`MAX_BUCKETS_PER_REPORT`] end the stream with `INVALID_ARGUMENT`.
//!
//! Faults: a stream that ends however it ends (the Envoy went away, the connection broke, the
//! daemon is stopping, the response stream was dropped) marks its entries ended when its state
//! is dropped; what it was told stays held until it expires, since the Envoy may enforce it
//! until then.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::{Duration as ProtoDuration, UInt32Value};
use futures::stream::BoxStream;
use futures::StreamExt as _;
use metrics::Gauge;
use tokio::sync::watch;
use tonic::{Request, Response, Status, Streaming};

use super::subject::SubjectKeys;
use crate::api::AppState;
use crate::clock;
use crate::config::{Blanket, EnvoyConfig};
use crate::decision::envoy_holdings::{Assignment, BudgetKey, Part};
use crate::telemetry;

/// Most buckets one report may list (Envoy lists every bucket it caches).
pub const MAX_BUCKETS_PER_REPORT: usize = 10_000;

/// The rate limit quota service over this daemon's share of each budget.
#[derive(Debug, Clone)]
pub struct EnvoyQuota {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: AppState,
    keys: SubjectKeys,
    unknown: Blanket,
    elsewhere: Blanket,
    /// How long an assignment lives: two report periods and a second.
    ttl_ms: u64,
    next_stream: AtomicU64,
    streams: Gauge,
    buckets: Gauge,
    /// Turns true when the listener stops: every stream ends.
    stop: watch::Receiver<bool>,
}

/// One open stream: the budgets it reported, marked ended when it is dropped.
struct Session {
    inner: Arc<Inner>,
    id: u64,
    budgets: HashSet<BudgetKey>,
}

impl Drop for Session {
    fn drop(&mut self) {
        let budgets: Vec<BudgetKey> = self.budgets.drain().collect();
        let decider = &self.inner.state.decider;
        decider.envoy_holdings().end_stream(self.id, &budgets);
        self.inner.streams.decrement(1.0);
        self.inner
            .buckets
            .set(decider.envoy_holdings().counts().1 as f64);
    }
}

/// Why a report ends its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    NoBuckets,
    EmptyBucketId,
    TooManyBuckets,
}

impl Refusal {
    fn reason(self) -> &'static str {
        match self {
            Self::NoBuckets => "no_buckets",
            Self::EmptyBucketId => "empty_bucket_id",
            Self::TooManyBuckets => "too_many_buckets",
        }
    }

    fn status(self) -> Status {
        Status::invalid_argument(match self {
            Self::NoBuckets => "a usage report lists at least one bucket",
            Self::EmptyBucketId => "every bucket id has at least one entry",
            Self::TooManyBuckets => "a usage report lists at most 10000 buckets",
        })
    }
}

fn blanket(rule: Blanket) -> BlanketRule {
    match rule {
        Blanket::AllowAll => BlanketRule::AllowAll,
        Blanket::DenyAll => BlanketRule::DenyAll,
    }
}

fn action(region: &str, bucket_id: BucketId, strategy: Strategy, ttl_s: u32) -> BucketAction {
    let name = match strategy {
        Strategy::TokenBucket(_) => "token_bucket",
        Strategy::BlanketRule(r) if r == BlanketRule::AllowAll as i32 => "allow_all",
        _ => "deny_all",
    };
    metrics::counter!(telemetry::RLQS_ASSIGNMENTS_TOTAL, "strategy" => name, "region" => region.to_string())
        .increment(1);
    BucketAction {
        bucket_id: Some(bucket_id),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(ProtoDuration {
                seconds: i64::from(ttl_s),
                nanos: 0,
            }),
            rate_limit_strategy: Some(RateLimitStrategy {
                strategy: Some(strategy),
            }),
        })),
    }
}

impl EnvoyQuota {
    pub fn new(state: AppState, cfg: &EnvoyConfig) -> Self {
        let region = state.decider.region().as_str().to_string();
        // Exported (and graphed) at 0 before the first assignment.
        for strategy in ["token_bucket", "allow_all", "deny_all"] {
            metrics::counter!(telemetry::RLQS_ASSIGNMENTS_TOTAL, "strategy" => strategy, "region" => region.clone())
                .increment(0);
        }
        Self {
            inner: Arc::new(Inner {
                state,
                keys: SubjectKeys::new(cfg),
                unknown: cfg.rlqs_unknown_bucket,
                elsewhere: cfg.rlqs_elsewhere,
                ttl_ms: 2 * cfg.rlqs_report_ms + 1000,
                next_stream: AtomicU64::new(1),
                streams: metrics::gauge!(telemetry::RLQS_STREAMS, "region" => region.clone()),
                buckets: metrics::gauge!(telemetry::RLQS_BUCKETS, "region" => region),
                stop: watch::channel(false).1,
            }),
        }
    }

    /// The same service, ending every stream once `stop` turns true.
    pub fn ending_on(self, stop: watch::Receiver<bool>) -> Self {
        let i = &self.inner;
        Self {
            inner: Arc::new(Inner {
                state: i.state.clone(),
                keys: i.keys.clone(),
                unknown: i.unknown,
                elsewhere: i.elsewhere,
                ttl_ms: i.ttl_ms,
                next_stream: AtomicU64::new(i.next_stream.load(Ordering::Relaxed)),
                streams: i.streams.clone(),
                buckets: i.buckets.clone(),
                stop,
            }),
        }
    }
}

impl Inner {
    fn region(&self) -> &str {
        self.state.decider.region().as_str()
    }

    fn blanket_ttl_s(&self) -> u32 {
        (self.ttl_ms / 1000) as u32
    }

    /// The answer to one report, or the refusal that ends the stream (nothing assigned then).
    fn answer(
        &self,
        session: &mut Session,
        report: RateLimitQuotaUsageReports,
    ) -> Result<RateLimitQuotaResponse, Refusal> {
        let usages = report.bucket_quota_usages;
        if usages.is_empty() {
            return Err(Refusal::NoBuckets);
        }
        if usages.len() > MAX_BUCKETS_PER_REPORT {
            return Err(Refusal::TooManyBuckets);
        }
        if usages
            .iter()
            .any(|u| u.bucket_id.as_ref().is_none_or(|b| b.bucket.is_empty()))
        {
            return Err(Refusal::EmptyBucketId);
        }
        let view = self.state.decider.view();
        let now_ms = clock::monotonic_ms();
        let bucket_action = usages
            .into_iter()
            .map(|u| self.assign(session, &view, &report.domain, u, now_ms))
            .collect();
        self.buckets
            .set(self.state.decider.envoy_holdings().counts().1 as f64);
        Ok(RateLimitQuotaResponse { bucket_action })
    }

    /// One bucket's assignment, its usage counted as the region's demand.
    fn assign(
        &self,
        session: &mut Session,
        view: &crate::coordination::ClusterView,
        domain: &str,
        usage: BucketQuotaUsage,
        now_ms: u64,
    ) -> BucketAction {
        let id = usage.bucket_id.unwrap_or_default();
        let with_key = |key: &str| Ok(id.bucket.get(key).map(String::as_str));
        let subject = self.keys.subject(&self.state, with_key, domain);
        let (tenant, policy) = match subject {
            Ok(Some(s)) => s,
            Ok(None) => {
                let rule = blanket(self.unknown) as i32;
                return action(
                    self.region(),
                    id,
                    Strategy::BlanketRule(rule),
                    self.blanket_ttl_s(),
                );
            }
            Err(reason) => {
                metrics::counter!(telemetry::RLQS_REJECTED_REPORTS_TOTAL, "reason" => reason, "region" => self.region().to_string())
                    .increment(1);
                let rule = BlanketRule::DenyAll as i32;
                return action(
                    self.region(),
                    id,
                    Strategy::BlanketRule(rule),
                    self.blanket_ttl_s(),
                );
            }
        };
        let decider = &self.state.decider;
        let region = decider.region();
        let Some((part, p)) = Part::of(view, region, &tenant, &policy, decider.daemons(), now_ms)
        else {
            let rule = blanket(self.unknown) as i32;
            return action(
                self.region(),
                id,
                Strategy::BlanketRule(rule),
                self.blanket_ttl_s(),
            );
        };
        let allowed = usage.num_requests_allowed;
        let denied = usage.num_requests_denied;
        let home = view
            .resolve(&tenant, &policy)
            .and_then(|r| r.entry.home.as_ref());
        if home.is_some_and(|h| h != region) {
            let rule = blanket(self.elsewhere) as i32;
            return action(
                self.region(),
                id,
                Strategy::BlanketRule(rule),
                self.blanket_ttl_s(),
            );
        }
        // Envoy's `time_elapsed` is whole seconds and 0 on a bucket's first report.
        let elapsed_s = usage
            .time_elapsed
            .map_or(0, |d| d.seconds.max(0) as u64)
            .max(1);
        let demand_per_s = allowed.saturating_add(denied) as f64 / elapsed_s as f64;
        let key: BudgetKey = (tenant, policy);
        let holdings = decider.envoy_holdings();
        let assignment =
            if session.budgets.len() >= MAX_BUCKETS_PER_REPORT && !session.budgets.contains(&key) {
                Assignment::Deny {
                    ttl_s: self.blanket_ttl_s(),
                }
            } else {
                session.budgets.insert(key.clone());
                let a = holdings.assign(&key, session.id, demand_per_s, part, self.ttl_ms, now_ms);
                // The reported requests are the region's demand, spread over its usage reports.
                let per_s = |n: u64| n as f64 / elapsed_s as f64;
                holdings.record_rates(&key, session.id, p.version, per_s(allowed), per_s(denied));
                a
            };
        match assignment {
            Assignment::Bucket {
                tokens_per_fill,
                max_tokens,
                ttl_s,
            } => action(
                self.region(),
                id,
                Strategy::TokenBucket(TokenBucket {
                    max_tokens,
                    tokens_per_fill: Some(UInt32Value {
                        value: tokens_per_fill,
                    }),
                    fill_interval: Some(ProtoDuration {
                        seconds: 1,
                        nanos: 0,
                    }),
                }),
                ttl_s,
            ),
            Assignment::Deny { ttl_s } => action(
                self.region(),
                id,
                Strategy::BlanketRule(BlanketRule::DenyAll as i32),
                ttl_s,
            ),
        }
    }
}

/// Returns once `stop` turns true; never if it cannot (its sender is gone without stopping).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    if stop.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

#[tonic::async_trait]
impl RateLimitQuotaService for EnvoyQuota {
    type StreamRateLimitQuotasStream = BoxStream<'static, Result<RateLimitQuotaResponse, Status>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let inner = self.inner.clone();
        let id = inner.next_stream.fetch_add(1, Ordering::Relaxed);
        inner.streams.increment(1.0);
        let session = Session {
            inner: inner.clone(),
            id,
            budgets: HashSet::new(),
        };
        let reports = request.into_inner();
        let stop = inner.stop.clone();
        // The state lives as long as the response stream: dropping it, however the stream
        // ends, drops the session.
        let out = futures::stream::unfold(Some((session, reports, stop)), |state| async move {
            let (mut session, mut reports, mut stop) = state?;
            let next = tokio::select! {
                next = reports.next() => next,
                () = stopped(&mut stop) => None,
            };
            let report = match next? {
                Ok(r) => r,
                Err(status) => {
                    tracing::debug!(error = %status, "RLQS stream failed.");
                    return None;
                }
            };
            let inner = session.inner.clone();
            match inner.answer(&mut session, report) {
                Ok(resp) => Some((Ok(resp), Some((session, reports, stop)))),
                Err(refusal) => {
                    metrics::counter!(telemetry::RLQS_REJECTED_REPORTS_TOTAL, "reason" => refusal.reason(), "region" => inner.region().to_string())
                            .increment(1);
                    // The error ends the stream; the session goes with the state.
                    Some((Err(refusal.status()), None))
                }
            }
        });
        Ok(Response::new(out.boxed()))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
    use futures::channel::mpsc;
    use futures::SinkExt as _;
    use quota_core::{PolicyName, PolicySpec, TenantId};
    use tonic::transport::Channel;

    use super::*;
    use crate::api::tests::state_on;
    use crate::config::BreakerConfig;
    use crate::decision::breaker::Breaker;
    use crate::envoy::{serve, EnvoyRateLimit};

    /// A running Envoy listener on a loopback port, a channel to it, and its stop.
    async fn start(state: AppState, cfg: EnvoyConfig) -> (Channel, watch::Sender<bool>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop) = watch::channel(false);
        let quota = EnvoyQuota::new(state.clone(), &cfg);
        let service = EnvoyRateLimit::new(state, &cfg);
        tokio::spawn(serve(
            service,
            quota,
            listener,
            stop,
            Duration::from_secs(1),
        ));
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        (channel, stop_tx)
    }

    fn embedded() -> AppState {
        state_on(
            quota_store::AnyStore::embedded(),
            Breaker::new(&BreakerConfig::default(), "eu"),
        )
    }

    async fn put(state: &AppState, tenant: &str, policy: &str, limit: u64, window_ms: u64) {
        let spec = PolicySpec {
            limit: limit as f64,
            window_ms: window_ms as f64,
            ..PolicySpec::default()
        };
        state
            .coordinator
            .put_policy(
                TenantId::new(tenant).unwrap(),
                PolicyName::new(policy).unwrap(),
                spec.validate().unwrap(),
            )
            .await
            .unwrap();
    }

    /// One stream, as Envoy opens it: reports go in, answers come out.
    struct Stream {
        tx: mpsc::UnboundedSender<RateLimitQuotaUsageReports>,
        rx: Streaming<RateLimitQuotaResponse>,
    }

    impl Stream {
        async fn open(channel: &Channel) -> Self {
            let (tx, out) = mpsc::unbounded();
            let mut client = RateLimitQuotaServiceClient::new(channel.clone());
            let rx = client
                .stream_rate_limit_quotas(out)
                .await
                .unwrap()
                .into_inner();
            Self { tx, rx }
        }

        async fn report(
            &mut self,
            usages: Vec<BucketQuotaUsage>,
        ) -> Result<RateLimitQuotaResponse, Status> {
            let report = RateLimitQuotaUsageReports {
                domain: "api".into(),
                bucket_quota_usages: usages,
            };
            self.tx.send(report).await.unwrap();
            match self.rx.message().await {
                Ok(Some(r)) => Ok(r),
                Ok(None) => Err(Status::cancelled("stream ended")),
                Err(s) => Err(s),
            }
        }
    }

    fn id(entries: &[(&str, &str)]) -> BucketId {
        BucketId {
            bucket: entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<_, _>>(),
        }
    }

    fn usage(bucket: BucketId, elapsed_s: i64, allowed: u64, denied: u64) -> BucketQuotaUsage {
        BucketQuotaUsage {
            bucket_id: Some(bucket),
            time_elapsed: Some(ProtoDuration {
                seconds: elapsed_s,
                nanos: 0,
            }),
            num_requests_allowed: allowed,
            num_requests_denied: denied,
        }
    }

    /// (tokens_per_fill, max_tokens, ttl_s) of a token bucket; a blanket rule as
    /// (0, rule, ttl_s).
    fn assigned(a: &BucketAction) -> (u32, u32, i64) {
        let Some(Action::QuotaAssignmentAction(q)) = &a.bucket_action else {
            panic!("not an assignment: {a:?}");
        };
        let ttl = q.assignment_time_to_live.unwrap();
        assert_eq!(ttl.nanos, 0);
        match q.rate_limit_strategy.unwrap().strategy.unwrap() {
            Strategy::TokenBucket(b) => {
                assert_eq!(
                    b.fill_interval,
                    Some(ProtoDuration {
                        seconds: 1,
                        nanos: 0
                    })
                );
                (b.tokens_per_fill.unwrap().value, b.max_tokens, ttl.seconds)
            }
            Strategy::BlanketRule(r) => (0, r as u32, ttl.seconds),
            other => panic!("unexpected strategy {other:?}"),
        }
    }

    const ALLOW: u32 = BlanketRule::AllowAll as u32;
    const DENY: u32 = BlanketRule::DenyAll as u32;

    #[tokio::test]
    async fn every_reported_bucket_gets_its_assignment() {
        let state = embedded();
        put(&state, "acme", "api", 100, 1000).await;
        let (channel, _stop) = start(state.clone(), EnvoyConfig::default()).await;
        let mut s = Stream::open(&channel).await;
        let acme = id(&[("tenant", "acme")]);
        // Envoy's first report: time_elapsed 0. Unknown tenant and no tenant entry: the
        // configured answer (allow_all); a malformed tenant: denied.
        let r = s
            .report(vec![
                usage(acme.clone(), 0, 1, 0),
                usage(id(&[("tenant", "nobody")]), 0, 1, 0),
                usage(id(&[("path", "/x")]), 0, 0, 0),
                usage(id(&[("tenant", "bad tenant!")]), 0, 0, 0),
            ])
            .await
            .unwrap();
        assert_eq!(r.bucket_action.len(), 4);
        assert_eq!(r.bucket_action[0].bucket_id.as_ref(), Some(&acme));
        assert_eq!(assigned(&r.bucket_action[0]), (100, 100, 11));
        assert_eq!(assigned(&r.bucket_action[1]), (0, ALLOW, 11));
        assert_eq!(assigned(&r.bucket_action[2]), (0, ALLOW, 11));
        assert_eq!(assigned(&r.bucket_action[3]), (0, DENY, 11));
        // The reported requests are this region's demand, for its usage reports: one a second
        // (a first report counts over one second), spread over them.
        let holdings = state.decider.envoy_holdings();
        let counted = holdings.take_usage(3_000, clock::monotonic_ms());
        assert_eq!(counted.len(), 1);
        assert_eq!(counted[0].bucket.tenant.as_str(), "acme");
        assert_eq!((counted[0].admitted, counted[0].denied), (3, 0));
        // The same bucket again, zero usage: the same assignment, so Envoy keeps its bucket,
        // and no more demand.
        let r = s.report(vec![usage(acme, 5, 0, 0)]).await.unwrap();
        assert_eq!(assigned(&r.bucket_action[0]), (100, 100, 11));
        assert!(holdings.take_usage(3_000, clock::monotonic_ms()).is_empty());
    }

    #[tokio::test]
    async fn unknown_buckets_get_the_configured_answer() {
        let state = embedded();
        let cfg = EnvoyConfig {
            rlqs_unknown_bucket: Blanket::DenyAll,
            rlqs_report_ms: 1000,
            ..EnvoyConfig::default()
        };
        let (channel, _stop) = start(state, cfg).await;
        let mut s = Stream::open(&channel).await;
        let r = s
            .report(vec![usage(id(&[("tenant", "nobody")]), 0, 0, 0)])
            .await
            .unwrap();
        assert_eq!(assigned(&r.bucket_action[0]), (0, DENY, 3));
    }

    #[tokio::test]
    async fn streams_share_the_part_by_demand_and_never_above_it() {
        let state = embedded();
        put(&state, "acme", "api", 100, 1000).await;
        let (channel, _stop) = start(state.clone(), EnvoyConfig::default()).await;
        let acme = id(&[("tenant", "acme")]);
        let (mut busy, mut quiet) = (Stream::open(&channel).await, Stream::open(&channel).await);
        let mut last = (0, 0);
        for round in 0..4 {
            let elapsed = if round == 0 { 0 } else { 5 };
            // The busy Envoy offers 80 a second, the quiet one 5.
            let b = busy
                .report(vec![usage(acme.clone(), elapsed, 400, 0)])
                .await
                .unwrap();
            let q = quiet
                .report(vec![usage(acme.clone(), elapsed, 25, 0)])
                .await
                .unwrap();
            let (b, q) = (assigned(&b.bucket_action[0]), assigned(&q.bucket_action[0]));
            // A denial holds nothing.
            let size = |a: (u32, u32, i64)| if a.0 == 0 { 0 } else { a.1 };
            assert!(
                b.0 + q.0 <= 100 && size(b) + size(q) <= 100,
                "round {round}: {b:?} + {q:?}"
            );
            last = (b.0, q.0);
        }
        // Each gets its demand, and what is left is split evenly.
        assert_eq!(last, (87, 12));
    }

    #[tokio::test]
    async fn malformed_reports_end_the_stream_with_invalid_argument() {
        let state = embedded();
        put(&state, "acme", "api", 100, 1000).await;
        let (channel, _stop) = start(state.clone(), EnvoyConfig::default()).await;
        for bad in [
            vec![],
            vec![usage(id(&[]), 0, 0, 0)],
            vec![BucketQuotaUsage::default()],
        ] {
            let mut s = Stream::open(&channel).await;
            let err = s.report(bad).await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        }
        // The listener still serves, and nothing was assigned or counted.
        let holdings = state.decider.envoy_holdings();
        assert!(holdings
            .take_usage(60_000, clock::monotonic_ms())
            .is_empty());
        let mut s = Stream::open(&channel).await;
        let r = s
            .report(vec![usage(id(&[("tenant", "acme")]), 0, 0, 0)])
            .await
            .unwrap();
        assert_eq!(assigned(&r.bucket_action[0]), (100, 100, 11));
    }

    #[tokio::test]
    async fn a_stream_that_ends_holds_its_part_until_its_assignment_expires() {
        let state = embedded();
        put(&state, "acme", "api", 100, 1000).await;
        let (channel, _stop) = start(state.clone(), EnvoyConfig::default()).await;
        let acme = id(&[("tenant", "acme")]);
        let mut first = Stream::open(&channel).await;
        let r = first
            .report(vec![usage(acme.clone(), 0, 1, 0)])
            .await
            .unwrap();
        assert_eq!(assigned(&r.bucket_action[0]).0, 100);
        drop(first);
        // The server sees the stream end (the session dropped with its response stream).
        let budget = (
            TenantId::new("acme").unwrap(),
            PolicyName::new("api").unwrap(),
        );
        let holdings = state.decider.envoy_holdings();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while holdings.live_streams(&budget) > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the stream never ended"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Its part is still held, as that Envoy may enforce it for 11 s more: a new Envoy
        // gets nothing of it yet.
        let mut second = Stream::open(&channel).await;
        let r = second.report(vec![usage(acme, 0, 1, 0)]).await.unwrap();
        assert_eq!(assigned(&r.bucket_action[0]), (0, DENY, 11));
    }

    #[tokio::test]
    async fn a_budget_pinned_elsewhere_gets_the_configured_answer() {
        use crate::coordination::{Coordinator, LocalCoordinator};
        use crate::decision::tests::{decider_of, entry};
        // Region a's view: t/w lives whole in region b.
        let pinned = entry(
            serde_json::json!({"limit": 100, "window_ms": 1000}),
            &[("a", 0, 0), ("b", 1_000_000, 0)],
            Some("b"),
        );
        let state = || {
            let region = quota_core::RegionId::new("a").unwrap();
            let coordinator =
                std::sync::Arc::new(Coordinator::Local(LocalCoordinator::in_temp_dir(region)));
            crate::api::tests::state_with(
                coordinator,
                decider_of(pinned.clone(), u64::MAX, HashMap::new()),
            )
        };
        let t = id(&[("tenant", "t"), ("policy", "w")]);
        for (rule, want) in [(None, DENY), (Some(Blanket::AllowAll), ALLOW)] {
            // The default, then the other answer configured.
            let cfg = match rule {
                None => EnvoyConfig::default(),
                Some(r) => EnvoyConfig {
                    rlqs_elsewhere: r,
                    ..EnvoyConfig::default()
                },
            };
            let state = state();
            let (channel, _stop) = start(state.clone(), cfg).await;
            let mut s = Stream::open(&channel).await;
            let r = s.report(vec![usage(t.clone(), 5, 10, 0)]).await.unwrap();
            assert_eq!(assigned(&r.bucket_action[0]), (0, want, 11));
            // Nothing is held here.
            assert_eq!(state.decider.envoy_holdings().counts(), (0, 0));
        }
    }

    #[tokio::test]
    async fn the_listener_stopping_ends_every_stream() {
        let state = embedded();
        put(&state, "acme", "api", 100, 1000).await;
        let (channel, stop) = start(state.clone(), EnvoyConfig::default()).await;
        let mut s = Stream::open(&channel).await;
        s.report(vec![usage(id(&[("tenant", "acme")]), 0, 1, 0)])
            .await
            .unwrap();
        stop.send_replace(true);
        let ended = tokio::time::timeout(Duration::from_secs(5), s.rx.message()).await;
        assert!(matches!(ended, Ok(Ok(None)) | Ok(Err(_))), "{ended:?}");
    }
}
