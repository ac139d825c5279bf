//! Envoy's global rate limit service (RLS v3, `envoy.service.ratelimit.v3.RateLimitService`)
//! on a gRPC listener of its own, so Envoy-based gateways (Envoy, Istio, Contour) call quotad
//! from their rate limit filter with no code of their own.
//!
//! Each descriptor is one check, decided exactly as `POST /v1/check` decides it (shares, pins
//! forwarded home, breaker, fail modes): the tenant is the value of the `envoy.tenant_key` entry,
//! the policy the value of the `envoy.policy_key` entry or else the request's domain, the cost
//! the descriptor's `hits_addend`, else the request's, else 1.
//!
//! - Envoy's convention for a descriptor with no limit configured holds: a descriptor without a
//!   tenant entry, or for a tenant without that policy, is `OK` with no `current_limit`, and is
//!   counted in `quotad_envoy_undecided_descriptors_total` so it is never silent.
//! - A policy failing `closed` (Redis down) answers `OVER_LIMIT`: a gRPC error would let Envoy's
//!   `failure_mode_deny` (off by default) admit, turning `closed` into `open`. A cost above the
//!   policy's burst, which no wait can admit, is `OVER_LIMIT` as well.
//! - Malformed descriptors (a bad tenant id, a refund, a limit override) fail the whole request
//!   with `INVALID_ARGUMENT` before any token is spent.
//! - The response carries the IETF `RateLimit-Policy` and `RateLimit` fields of every decided
//!   descriptor, and `Retry-After` when over the limit, for Envoy to add to its response.

use envoy_types::pb::envoy::config::core::v3::HeaderValue as EnvoyHeader;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    rate_limit::Unit, Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use quota_core::{PolicyName, TenantId};
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;

use crate::api::batch::MAX_BATCH;
use crate::api::check::{rate_limit_values, secs_ceil, CheckResponse};
use crate::api::AppState;
use crate::config::EnvoyConfig;
use crate::decision::CheckError;
use crate::telemetry;

/// The rate limit service over the daemon's decision path.
#[derive(Debug, Clone)]
pub struct EnvoyRateLimit {
    state: AppState,
    tenant_key: String,
    policy_key: String,
}

/// One descriptor, read: a check, or nothing for quotad to decide.
#[derive(Debug, PartialEq, Eq)]
enum Descriptor {
    Check {
        tenant: TenantId,
        policy: PolicyName,
        cost: u64,
    },
    NoTenant,
}

impl EnvoyRateLimit {
    pub fn new(state: AppState, cfg: &EnvoyConfig) -> Self {
        Self {
            state,
            tenant_key: cfg.tenant_key.clone(),
            policy_key: cfg.policy_key.clone(),
        }
    }

    /// Every descriptor of `req`, checked before any is decided; the first problem, named by
    /// its place, fails the whole request.
    fn parse(&self, req: &RateLimitRequest) -> Result<Vec<Descriptor>, String> {
        if req.descriptors.is_empty() || req.descriptors.len() > MAX_BATCH {
            return Err(format!(
                "a request carries 1 to {MAX_BATCH} descriptors (got {})",
                req.descriptors.len()
            ));
        }
        let request_cost = u64::from(req.hits_addend.max(1));
        req.descriptors
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let at = |what: String| format!("descriptors[{i}]: {what}");
                if d.is_negative_hits {
                    return Err(at("negative hits (refunds) are not supported".into()));
                }
                if d.limit.is_some() {
                    return Err(at(
                        "limit overrides are not supported: set the policy in quotad".into(),
                    ));
                }
                let entry = |key: &str| d.entries.iter().find(|e| e.key == key);
                let Some(tenant) = entry(&self.tenant_key) else {
                    return Ok(Descriptor::NoTenant);
                };
                let tenant = TenantId::new(tenant.value.as_str())
                    .map_err(|e| at(format!("entry {:?}: {e}", self.tenant_key)))?;
                let policy = match entry(&self.policy_key) {
                    Some(p) => PolicyName::new(p.value.as_str())
                        .map_err(|e| at(format!("entry {:?}: {e}", self.policy_key)))?,
                    None => PolicyName::new(req.domain.as_str()).map_err(|e| {
                        at(format!(
                            "no {:?} entry, and the domain is no policy name: {e}",
                            self.policy_key
                        ))
                    })?,
                };
                let cost = match &d.hits_addend {
                    None => request_cost,
                    Some(h) if h.value >= 1 => h.value,
                    Some(_) => {
                        return Err(at(
                            "hits_addend 0 (a query that spends nothing) is not supported".into(),
                        ))
                    }
                };
                Ok(Descriptor::Check {
                    tenant,
                    policy,
                    cost,
                })
            })
            .collect()
    }

    /// Decides `descriptors` in order; the response Envoy gets.
    async fn decide(&self, descriptors: Vec<Descriptor>) -> RateLimitResponse {
        let region = self.state.decider.region().as_str();
        let mut out = RateLimitResponse {
            overall_code: Code::Ok as i32,
            ..RateLimitResponse::default()
        };
        let (mut policies, mut limits, mut retry_after_s) = (Vec::new(), Vec::new(), 0);
        for d in descriptors {
            let Descriptor::Check {
                tenant,
                policy,
                cost,
            } = d
            else {
                undecided("no_tenant");
                out.statuses.push(status(Code::Ok, None, 0, 0));
                continue;
            };
            let status = match self
                .state
                .decider
                .check(tenant, policy.clone(), cost, false)
                .await
            {
                Ok(v) => {
                    let r = CheckResponse::from_verdict(&v, region);
                    let (p, l) = rate_limit_values(&policy, &v, &r);
                    policies.extend(p.and_then(|p| p.to_str().ok().map(str::to_string)));
                    limits.extend(l.and_then(|l| l.to_str().ok().map(str::to_string)));
                    let limit = current_limit(&policy, v.policy.limit, v.policy.window_ms);
                    if r.allowed {
                        status(Code::Ok, Some(limit), r.remaining, r.reset_ms)
                    } else {
                        retry_after_s = retry_after_s.max(secs_ceil(r.retry_after_ms).max(1));
                        self.state
                            .decider
                            .metrics
                            .record_retry_after(&policy, r.retry_after_ms as f64 / 1000.0);
                        status(Code::OverLimit, Some(limit), r.remaining, r.retry_after_ms)
                    }
                }
                Err(CheckError::UnknownPolicy) => {
                    undecided("unknown_policy");
                    status(Code::Ok, None, 0, 0)
                }
                // Never admissible (cost above burst), or the policy fails closed.
                Err(CheckError::Cost(_) | CheckError::ReducedCapacity { .. }) => {
                    status(Code::OverLimit, None, 0, 0)
                }
            };
            if status.code == Code::OverLimit as i32 {
                out.overall_code = Code::OverLimit as i32;
            }
            out.statuses.push(status);
        }
        for (key, values) in [("ratelimit-policy", policies), ("ratelimit", limits)] {
            if !values.is_empty() {
                out.response_headers_to_add
                    .push(header(key, values.join(", ")));
            }
        }
        if retry_after_s > 0 {
            out.response_headers_to_add
                .push(header("retry-after", retry_after_s.to_string()));
        }
        out
    }
}

#[tonic::async_trait]
impl RateLimitService for EnvoyRateLimit {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let req = request.into_inner();
        let descriptors = self.parse(&req).map_err(|why| {
            metrics::counter!(telemetry::REJECTED_REQUESTS_TOTAL, "code" => "ENVOY_INVALID_ARGUMENT")
                .increment(1);
            tonic::Status::invalid_argument(why)
        })?;
        Ok(tonic::Response::new(self.decide(descriptors).await))
    }
}

fn undecided(reason: &'static str) {
    metrics::counter!(telemetry::ENVOY_UNDECIDED_DESCRIPTORS_TOTAL, "reason" => reason)
        .increment(1);
}

fn status(code: Code, limit: Option<RateLimit>, remaining: u64, reset_ms: u64) -> DescriptorStatus {
    DescriptorStatus {
        code: code as i32,
        current_limit: limit,
        limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
        duration_until_reset: (reset_ms > 0).then(|| ProtoDuration {
            seconds: (reset_ms / 1000) as i64,
            nanos: ((reset_ms % 1000) * 1_000_000) as i32,
        }),
        ..DescriptorStatus::default()
    }
}

/// The policy as Envoy's `RateLimit`: per the largest unit the window is a whole number of,
/// else per second, rounded up (Envoy only shows it, e.g. in `x-ratelimit-limit`).
fn current_limit(policy: &PolicyName, limit: u64, window_ms: u64) -> RateLimit {
    const UNITS: [(Unit, u64); 4] = [
        (Unit::Day, 86_400_000),
        (Unit::Hour, 3_600_000),
        (Unit::Minute, 60_000),
        (Unit::Second, 1_000),
    ];
    let window_ms = window_ms.max(1);
    let (unit, per_unit) = UNITS
        .into_iter()
        .find(|&(_, ms)| window_ms.is_multiple_of(ms))
        .map_or_else(
            || (Unit::Second, limit.saturating_mul(1000).div_ceil(window_ms)),
            |(unit, ms)| (unit, limit.div_ceil(window_ms / ms)),
        );
    RateLimit {
        name: policy.as_str().to_string(),
        requests_per_unit: u32::try_from(per_unit).unwrap_or(u32::MAX),
        unit: unit as i32,
    }
}

fn header(key: &str, value: String) -> EnvoyHeader {
    EnvoyHeader {
        key: key.to_string(),
        value,
        ..EnvoyHeader::default()
    }
}

/// Serves the rate limit service and gRPC health on `listener` until `stop` turns true, then
/// lets in-flight calls finish for at most `drain` (an Envoy keeps its HTTP/2 connection open;
/// shutdown must not wait on it).
pub async fn serve(
    service: EnvoyRateLimit,
    listener: tokio::net::TcpListener,
    stop: watch::Receiver<bool>,
    drain: std::time::Duration,
) -> Result<(), tonic::transport::Error> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<RateLimitServiceServer<EnvoyRateLimit>>()
        .await;
    let (mut graceful, mut deadline) = (stop.clone(), stop);
    let server = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(RateLimitServiceServer::new(service))
        .serve_with_incoming_shutdown(
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            async move {
                let _ = graceful.changed().await;
            },
        );
    tokio::select! {
        served = server => served,
        () = async {
            let _ = deadline.changed().await;
            tokio::time::sleep(drain).await;
        } => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
        Entry, RateLimitOverride,
    };
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::google::protobuf::UInt64Value;
    use quota_core::{FailMode, Policy, PolicySpec};
    use tonic::transport::Channel;

    use super::*;
    use crate::api::tests::state_on;
    use crate::config::BreakerConfig;
    use crate::decision::breaker::Breaker;

    /// A running service on a loopback port and a client of it; the sender stops it.
    async fn start(
        state: AppState,
    ) -> (
        RateLimitServiceClient<Channel>,
        Channel,
        watch::Sender<bool>,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop) = watch::channel(false);
        let service = EnvoyRateLimit::new(state, &EnvoyConfig::default());
        tokio::spawn(serve(service, listener, stop, Duration::from_secs(1)));
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        (
            RateLimitServiceClient::new(channel.clone()),
            channel,
            stop_tx,
        )
    }

    async fn put(state: &AppState, tenant: &str, policy: &str, spec: PolicySpec) -> Policy {
        state
            .coordinator
            .put_policy(
                TenantId::new(tenant).unwrap(),
                PolicyName::new(policy).unwrap(),
                spec.validate().unwrap(),
            )
            .await
            .unwrap()
    }

    fn spec(limit: u64, window_ms: u64) -> PolicySpec {
        PolicySpec {
            limit: limit as f64,
            window_ms: window_ms as f64,
            ..PolicySpec::default()
        }
    }

    fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: k.to_string(),
                    value: v.to_string(),
                })
                .collect(),
            ..RateLimitDescriptor::default()
        }
    }

    fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
        RateLimitRequest {
            domain: domain.into(),
            descriptors,
            hits_addend: 0,
        }
    }

    fn headers(r: &RateLimitResponse) -> Vec<(String, String)> {
        r.response_headers_to_add
            .iter()
            .map(|h| (h.key.clone(), h.value.clone()))
            .collect()
    }

    #[tokio::test]
    async fn descriptors_are_decided_as_checks_with_the_ietf_fields() {
        let state = state_on(
            quota_store::AnyStore::embedded(),
            Breaker::new(&BreakerConfig::default(), "eu"),
        );
        put(&state, "acme", "writes", spec(3, 60_000)).await;
        put(&state, "acme", "api", spec(100, 1_000)).await;
        let (mut client, channel, _stop) = start(state.clone()).await;

        let acme_writes = descriptor(&[("tenant", "acme"), ("policy", "writes")]);
        let mut codes = Vec::new();
        for _ in 0..4 {
            let r = client
                .should_rate_limit(request("edge", vec![acme_writes.clone()]))
                .await
                .unwrap()
                .into_inner();
            codes.push((r.overall_code, r.statuses[0].limit_remaining));
            if r.overall_code == Code::OverLimit as i32 {
                let h = headers(&r);
                assert!(h.contains(&("retry-after".into(), "20".into())), "{h:?}");
                assert!(
                    h.contains(&("ratelimit".into(), "\"writes\";r=0;t=20".into())),
                    "{h:?}"
                );
            }
        }
        let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
        assert_eq!(codes, [(ok, 2), (ok, 1), (ok, 0), (over, 0)]);

        // The domain names the policy when no entry does; `hits_addend` is the cost; every
        // decided descriptor's fields are listed, and a descriptor over its limit makes the
        // whole request over.
        let mut by_domain = descriptor(&[("tenant", "acme")]);
        by_domain.hits_addend = Some(UInt64Value { value: 40 });
        let r = client
            .should_rate_limit(request("api", vec![by_domain, acme_writes.clone()]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code, over);
        assert_eq!(
            (r.statuses[0].code, r.statuses[0].limit_remaining),
            (ok, 60)
        );
        let limit = r.statuses[0].current_limit.clone().unwrap();
        assert_eq!(
            (limit.name.as_str(), limit.requests_per_unit, limit.unit),
            ("api", 100, Unit::Second as i32)
        );
        assert_eq!(r.statuses[1].code, over);
        let policy_field = headers(&r)
            .into_iter()
            .find(|(k, _)| k == "ratelimit-policy")
            .unwrap()
            .1;
        assert_eq!(policy_field, "\"api\";q=100;w=1, \"writes\";q=3;w=60");

        // No tenant entry, or no such policy: OK without a limit, as Envoy expects of a
        // descriptor nothing is configured for.
        let r = client
            .should_rate_limit(request(
                "edge",
                vec![
                    descriptor(&[("remote_address", "10.0.0.1")]),
                    descriptor(&[("tenant", "globex"), ("policy", "writes")]),
                ],
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code, ok);
        assert!(r
            .statuses
            .iter()
            .all(|s| s.code == ok && s.current_limit.is_none()));

        // gRPC health reports the service serving.
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
        let served = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: "envoy.service.ratelimit.v3.RateLimitService".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            served.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    }

    #[tokio::test]
    async fn malformed_descriptors_fail_the_request_before_any_token_is_spent() {
        let state = state_on(
            quota_store::AnyStore::embedded(),
            Breaker::new(&BreakerConfig::default(), "eu"),
        );
        put(&state, "acme", "writes", spec(5, 60_000)).await;
        let (mut client, _channel, _stop) = start(state).await;
        let good = descriptor(&[("tenant", "acme"), ("policy", "writes")]);
        let mut refund = good.clone();
        refund.is_negative_hits = true;
        let mut zero = good.clone();
        zero.hits_addend = Some(UInt64Value { value: 0 });
        let mut overridden = good.clone();
        overridden.limit = Some(RateLimitOverride {
            requests_per_unit: 1,
            unit: 1,
        });
        for (what, req) in [
            ("no descriptors", request("edge", vec![])),
            (
                "too many descriptors",
                request("edge", vec![good.clone(); 101]),
            ),
            (
                "a bad tenant id",
                request(
                    "edge",
                    vec![
                        good.clone(),
                        descriptor(&[("tenant", "ac me"), ("policy", "writes")]),
                    ],
                ),
            ),
            (
                "a domain that is no policy name",
                request("not a name", vec![descriptor(&[("tenant", "acme")])]),
            ),
            ("a refund", request("edge", vec![good.clone(), refund])),
            ("hits_addend 0", request("edge", vec![good.clone(), zero])),
            (
                "a limit override",
                request("edge", vec![good.clone(), overridden]),
            ),
        ] {
            let e = client.should_rate_limit(req).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{what}: {e:?}");
            assert!(!e.message().is_empty(), "{what}");
        }
        // The valid descriptor sent beside each bad one spent nothing.
        let r = client
            .should_rate_limit(request("edge", vec![good]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.statuses[0].limit_remaining, 4);
    }

    #[tokio::test]
    async fn a_policy_that_fails_closed_is_over_the_limit_and_one_that_fails_local_decides() {
        // A Redis that is not there, and a breaker already open: every policy's fail mode decides.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let store = quota_store::RedisStore::open(quota_store::RedisStoreConfig::standalone(
            format!("redis://127.0.0.1:{port}"),
        ))
        .unwrap();
        let breaker = Breaker::new(&BreakerConfig::default(), "eu");
        breaker.trip();
        let state = state_on(quota_store::AnyStore::Redis(store), breaker);
        let mut closed = spec(5, 60_000);
        closed.fail_mode = Some(FailMode::Closed);
        put(&state, "acme", "strict", closed).await;
        put(&state, "acme", "lenient", spec(5, 60_000)).await;
        let (mut client, _channel, _stop) = start(state).await;
        let r = client
            .should_rate_limit(request(
                "edge",
                vec![descriptor(&[("tenant", "acme"), ("policy", "strict")])],
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.overall_code,
            Code::OverLimit as i32,
            "closed must deny, not error"
        );
        let r = client
            .should_rate_limit(request(
                "edge",
                vec![descriptor(&[("tenant", "acme"), ("policy", "lenient")])],
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (r.overall_code, r.statuses[0].limit_remaining),
            (Code::Ok as i32, 4)
        );
    }

    #[test]
    fn a_window_is_shown_in_the_largest_whole_unit() {
        let p = PolicyName::new("p").unwrap();
        let shown = |limit, window_ms| {
            let l = current_limit(&p, limit, window_ms);
            (l.requests_per_unit, l.unit)
        };
        assert_eq!(shown(10_000, 60_000), (10_000, Unit::Minute as i32));
        assert_eq!(shown(100, 120_000), (50, Unit::Minute as i32));
        assert_eq!(shown(7, 86_400_000), (7, Unit::Day as i32));
        assert_eq!(shown(5, 3_000), (2, Unit::Second as i32));
        assert_eq!(shown(3, 500), (6, Unit::Second as i32));
    }
}
