//! Envoy's global rate limit service (RLS v3, `envoy.service.ratelimit.v3.RateLimitService`),
//! so Envoy-based gateways (Envoy, Istio, Contour) call quotad from their rate limit filter with
//! no code of their own. docs/envoy.md is the reference.
//!
//! Each descriptor is decided or refused on its own, and the request is `OVER_LIMIT` if any
//! descriptor is. No descriptor's content fails the whole request: Envoy's default
//! (`failure_mode_deny: false`) admits a request whose call errs, skipping every other limit
//! in it. Only a request with no domain or no descriptor is `INVALID_ARGUMENT`.
//!
//! - A check: the tenant is the value of the `envoy.tenant_key` entry, the policy the value of
//!   the `envoy.policy_key` entry or else the request's domain, the cost the descriptor's
//!   `hits_addend`, else the request's, else 1; decided exactly as `POST /v1/check` decides.
//!   A `hits_addend` of 0 reads the bucket without spending: `OK` while one hit would pass.
//! - With `envoy.identity_key`, a descriptor without the tenant entry but with that entry is
//!   decided for the identity it holds, hashed with the identity key as a check's `identity`.
//! - A `shadow` policy's would-be denial is `OK` (counted in `quotad_shadow_denials_total`).
//! - Undecided (Envoy's convention for a descriptor with no limit configured): no tenant
//!   entry, or no such policy for the tenant: `OK` without `current_limit`, counted in
//!   `quotad_envoy_undecided_descriptors_total`.
//! - Refused (malformed, or asking for what quotad does not do): `OVER_LIMIT` without
//!   `current_limit`, counted in `quotad_rejected_requests_total{code="ENVOY_INVALID_DESCRIPTOR"}`.
//!   A refusal is a denial, so a client cannot slip past its limit by malforming a header.
//! - A policy failing `closed`, and a cost above the burst, are `OVER_LIMIT` with the limit.
//! - `current_limit` states the policy's limit per the smallest unit at least as long as its
//!   window; the response carries the IETF `RateLimit-Policy` and `RateLimit` fields of every
//!   decided descriptor, and `Retry-After` when over.

use envoy_types::pb::envoy::config::core::v3::HeaderValue as EnvoyHeader;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    rate_limit::Unit, Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use quota_core::{Decision, FailMode, Policy, PolicyName, TenantId};
use quota_store::BucketRef;

use super::subject::SubjectKeys;
use crate::api::batch::MAX_BATCH;
use crate::api::check::{rate_limit_values, secs_ceil, CheckResponse};
use crate::api::AppState;
use crate::config::EnvoyConfig;
use crate::decision::{Charged, CheckError, Mode, Refunded, Verdict};
use crate::telemetry;

/// The rate limit service over the daemon's decision path.
#[derive(Debug, Clone)]
pub struct EnvoyRateLimit {
    pub(super) state: AppState,
    keys: SubjectKeys,
}

/// One descriptor, read.
#[derive(Debug, PartialEq, Eq)]
enum Descriptor {
    /// A check of `cost` tokens; cost 0 reads the bucket without spending.
    Check {
        tenant: TenantId,
        policy: PolicyName,
        cost: u64,
    },
    /// `is_negative_hits`: `tokens` given back to the bucket.
    Refund {
        tenant: TenantId,
        policy: PolicyName,
        tokens: u64,
    },
    /// No tenant entry: nothing for quotad to decide.
    NoTenant,
    /// Malformed, or asking for what quotad does not do; the reason is a metric-safe word.
    Refused(&'static str),
}

/// The header values gathered over a request's descriptors.
#[derive(Debug, Default)]
struct Fields {
    policies: Vec<String>,
    limits: Vec<String>,
    retry_after_s: u64,
}

impl EnvoyRateLimit {
    pub fn new(state: AppState, cfg: &EnvoyConfig) -> Self {
        Self {
            state,
            keys: SubjectKeys::new(cfg),
        }
    }

    /// Every descriptor of `req`, read; `Err` only for a request the proto calls invalid as a
    /// whole (no domain, no descriptor), which Envoy never sends. Descriptors past the
    /// first [`MAX_BATCH`] are refused, so one call's work stays bounded.
    fn parse(&self, req: &RateLimitRequest) -> Result<Vec<Descriptor>, &'static str> {
        if req.domain.is_empty() {
            return Err("the domain is empty");
        }
        if req.descriptors.is_empty() {
            return Err("the request carries no descriptor");
        }
        let request_cost = u64::from(req.hits_addend.max(1));
        Ok(req
            .descriptors
            .iter()
            .enumerate()
            .map(|(i, d)| {
                if i < MAX_BATCH {
                    self.descriptor(d, &req.domain, request_cost)
                } else {
                    Descriptor::Refused("too_many_descriptors")
                }
            })
            .collect())
    }

    /// One descriptor by the documented rule: the proto's own constraints first, then what
    /// quotad does not do, then the entries it reads.
    fn descriptor(&self, d: &RateLimitDescriptor, domain: &str, request_cost: u64) -> Descriptor {
        if d.entries.is_empty() {
            return Descriptor::Refused("no_entries");
        }
        if d.entries.iter().any(|e| e.key.is_empty()) {
            return Descriptor::Refused("empty_key");
        }
        if d.limit.is_some() {
            return Descriptor::Refused("limit_override");
        }
        let with_key = |key: &str| {
            let mut found = d.entries.iter().filter(move |e| e.key == key);
            match (found.next(), found.next()) {
                (_, Some(_)) => Err(()),
                (one, None) => Ok(one.map(|e| e.value.as_str())),
            }
        };
        let (tenant, policy) = match self.keys.subject(&self.state, with_key, domain) {
            Ok(Some(s)) => s,
            Ok(None) => return Descriptor::NoTenant,
            Err(reason) => return Descriptor::Refused(reason),
        };
        let cost = d.hits_addend.as_ref().map_or(request_cost, |h| h.value);
        if d.is_negative_hits && cost > 0 {
            return Descriptor::Refund {
                tenant,
                policy,
                tokens: cost,
            };
        }
        // A refund of nothing reads the bucket, as a check of nothing does.
        let cost = if d.is_negative_hits { 0 } else { cost };
        Descriptor::Check {
            tenant,
            policy,
            cost,
        }
    }

    /// Decides `descriptors` in order; the response Envoy gets.
    async fn decide(&self, descriptors: Vec<Descriptor>) -> RateLimitResponse {
        let mut out = RateLimitResponse {
            overall_code: Code::Ok as i32,
            ..RateLimitResponse::default()
        };
        let mut fields = Fields::default();
        for d in descriptors {
            let status = match d {
                Descriptor::Check {
                    tenant,
                    policy,
                    cost: 0,
                } => self.read(tenant, policy, &mut fields).await,
                Descriptor::Check {
                    tenant,
                    policy,
                    cost,
                } => self.check(tenant, policy, cost, &mut fields).await,
                Descriptor::Refund {
                    tenant,
                    policy,
                    tokens,
                } => self.refund(tenant, policy, tokens).await,
                Descriptor::NoTenant => undecided("no_tenant"),
                Descriptor::Refused(reason) => {
                    metrics::counter!(telemetry::REJECTED_REQUESTS_TOTAL, "code" => "ENVOY_INVALID_DESCRIPTOR")
                        .increment(1);
                    tracing::debug!(reason, "Envoy descriptor refused.");
                    status(Code::OverLimit, None, 0, 0)
                }
            };
            if status.code == Code::OverLimit as i32 {
                out.overall_code = Code::OverLimit as i32;
            }
            out.statuses.push(status);
        }
        for (key, values) in [
            ("ratelimit-policy", fields.policies),
            ("ratelimit", fields.limits),
        ] {
            if !values.is_empty() {
                out.response_headers_to_add
                    .push(header(key, values.join(", ")));
            }
        }
        if fields.retry_after_s > 0 {
            out.response_headers_to_add
                .push(header("retry-after", fields.retry_after_s.to_string()));
        }
        out
    }

    /// A check that spends `cost`; for a policy charged after the fact, a charge.
    async fn check(
        &self,
        tenant: TenantId,
        policy: PolicyName,
        cost: u64,
        fields: &mut Fields,
    ) -> DescriptorStatus {
        let decider = &self.state.decider;
        if let Some((p, _, _)) = self
            .bucket_of(&tenant, &policy)
            .filter(|(p, _, _)| p.after_the_fact)
        {
            return self.charge(tenant, policy, p, cost).await;
        }
        match decider
            .check(tenant.clone(), policy.clone(), cost, false)
            .await
        {
            Ok(v) => self.decided(&policy, &v, fields),
            Err(CheckError::UnknownPolicy) => undecided("unknown_policy"),
            // Envoy cannot give a slot back: a concurrency limit is not Envoy's to decide.
            Err(CheckError::TakenWithHolds) => undecided("concurrency_limit"),
            // Never admissible: denied with the bucket's level, as it stands, in the fields.
            Err(CheckError::Cost(_)) => {
                let Some((p, bucket, limit)) = self.bucket_of(&tenant, &policy) else {
                    return undecided("unknown_policy");
                };
                let level = decider.peek(bucket, limit).await;
                let v = self.denied(p, level.map_or(0, |d| d.remaining), None);
                self.decided(&policy, &v, fields)
            }
            // The policy fails closed: denied for a window, nothing known of the bucket.
            Err(CheckError::ReducedCapacity { .. }) => match self.bucket_of(&tenant, &policy) {
                Some((p, _, _)) => self.decided(&policy, &self.denied(p, 0, None), fields),
                None => status(Code::OverLimit, None, 0, 0),
            },
        }
    }

    /// A descriptor of a policy charged after the fact (Envoy AI Gateway's tokens at stream
    /// end, `apply_on_stream_done`): the work is done, so it is charged, into the policy's
    /// debt limit, and answered `OK` with what the bucket holds after. Not applied (the store
    /// or the home region did not answer): `OK` undecided, counted in `quotad_charges_total`.
    async fn charge(
        &self,
        tenant: TenantId,
        policy: PolicyName,
        p: Policy,
        cost: u64,
    ) -> DescriptorStatus {
        let limit = current_limit(&policy, p.limit, p.window_ms);
        match self
            .state
            .decider
            .charge(&tenant, &policy, cost, None, false)
            .await
        {
            Ok(Charged::Applied { outcome, .. }) => {
                status(Code::Ok, Some(limit), outcome.remaining, 0)
            }
            Ok(Charged::HomeUnreachable(_)) => undecided("home_unreachable"),
            Ok(_) => undecided("store_unavailable"),
            Err(_) => undecided("unknown_policy"),
        }
    }

    /// An `is_negative_hits` descriptor: `tokens` given back to the bucket (never above its
    /// capacity), `OK` with what it holds after. Given back nowhere (the budget lives in
    /// another region, the store is out): `OK`, undecided.
    async fn refund(&self, tenant: TenantId, policy: PolicyName, tokens: u64) -> DescriptorStatus {
        let decider = &self.state.decider;
        let Some((p, _, _)) = self.bucket_of(&tenant, &policy) else {
            return undecided("unknown_policy");
        };
        let limit = current_limit(&policy, p.limit, p.window_ms);
        match decider.refund(&tenant, &policy, tokens).await {
            Ok(Refunded::Applied { remaining }) => status(Code::Ok, Some(limit), remaining, 0),
            Ok(Refunded::Full) => status(Code::Ok, Some(limit), p.burst, 0),
            Ok(Refunded::Elsewhere) => undecided("pinned_elsewhere"),
            Ok(Refunded::Unavailable) => undecided("store_unavailable"),
            Err(_) => undecided("unknown_policy"),
        }
    }

    /// A `hits_addend` 0 descriptor: the bucket read without spending, `OK` while a hit of 1
    /// would be admitted now. A tenant pinned to another region has its bucket there, which
    /// no read here can see: undecided.
    async fn read(
        &self,
        tenant: TenantId,
        policy: PolicyName,
        fields: &mut Fields,
    ) -> DescriptorStatus {
        let decider = &self.state.decider;
        if decider.home_elsewhere(&tenant, &policy, false).is_some() {
            return undecided("pinned_elsewhere");
        }
        let Some((p, bucket, limit)) = self.bucket_of(&tenant, &policy) else {
            return undecided("unknown_policy");
        };
        let v = match decider.peek(bucket, limit).await {
            Some(d) if d.remaining >= 1 => Verdict {
                decision: d,
                policy: p,
                mode: Mode::Normal,
                decided_by: decider.region().clone(),
                shadow_denied: false,
            },
            // Empty: certainly one hit again once full.
            Some(d) => self.denied(p, 0, d.reset_ms),
            None if p.fail_mode == FailMode::Closed => self.denied(p, 0, None),
            None => return undecided("store_unavailable"),
        };
        self.decided(&policy, &v, fields)
    }

    /// The policy, bucket and this region's limit of `tenant`'s `policy`.
    fn bucket_of(
        &self,
        tenant: &TenantId,
        policy: &PolicyName,
    ) -> Option<(Policy, BucketRef, quota_store::Limit)> {
        let decider = &self.state.decider;
        let (p, _share, limit) = decider.params_for(&decider.view(), tenant, policy)?;
        let bucket = BucketRef {
            tenant: tenant.clone(),
            policy: policy.clone(),
            version: p.version,
        };
        Some((p, bucket, limit))
    }

    /// A denial decided here without a store call; `retry_after_ms` `None` is one window.
    fn denied(&self, policy: Policy, remaining: u64, retry_after_ms: Option<u64>) -> Verdict {
        Verdict {
            decision: Decision {
                allowed: false,
                remaining,
                retry_after_ms,
                reset_ms: retry_after_ms,
            },
            policy,
            mode: Mode::Normal,
            decided_by: self.state.decider.region().clone(),
            shadow_denied: false,
        }
    }

    /// The status of a decided descriptor, its header values gathered into `fields`.
    fn decided(&self, policy: &PolicyName, v: &Verdict, fields: &mut Fields) -> DescriptorStatus {
        let r = CheckResponse::from_verdict(v, self.state.decider.region().as_str());
        let (p, l) = rate_limit_values(policy, v, &r);
        fields
            .policies
            .extend(p.and_then(|p| p.to_str().ok().map(str::to_string)));
        fields
            .limits
            .extend(l.and_then(|l| l.to_str().ok().map(str::to_string)));
        let limit = current_limit(policy, v.policy.limit, v.policy.window_ms);
        if r.allowed {
            status(Code::Ok, Some(limit), r.remaining, r.reset_ms)
        } else {
            fields.retry_after_s = fields.retry_after_s.max(secs_ceil(r.retry_after_ms).max(1));
            self.state
                .decider
                .metrics
                .record_retry_after(policy, r.retry_after_ms as f64 / 1000.0);
            // Envoy's convention: nothing remains for a request over the limit.
            status(Code::OverLimit, Some(limit), 0, r.retry_after_ms)
        }
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

/// `OK` without a limit, counted by `reason`.
fn undecided(reason: &'static str) -> DescriptorStatus {
    metrics::counter!(telemetry::ENVOY_UNDECIDED_DESCRIPTORS_TOTAL, "reason" => reason)
        .increment(1);
    status(Code::Ok, None, 0, 0)
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

/// Envoy's units with their lengths (a month of 30 days and a year of 365, as
/// envoyproxy/ratelimit counts them), shortest first.
const UNITS: [(Unit, u64); 7] = [
    (Unit::Second, 1_000),
    (Unit::Minute, 60_000),
    (Unit::Hour, 3_600_000),
    (Unit::Day, 86_400_000),
    (Unit::Week, 7 * 86_400_000),
    (Unit::Month, 30 * 86_400_000),
    (Unit::Year, 365 * 86_400_000),
];

/// The policy as Envoy's `RateLimit` (Envoy builds `X-RateLimit-Limit` from it): the limit
/// per the smallest unit at least as long as the window, scaled to that unit, e.g. 3 per
/// 10 s is 18 per minute. Exact when the unit is a whole number of windows, else rounded
/// down, so it never states more than the policy admits.
fn current_limit(policy: &PolicyName, limit: u64, window_ms: u64) -> RateLimit {
    let window_ms = window_ms.max(1);
    let (unit, unit_ms) = UNITS
        .into_iter()
        .find(|&(_, ms)| ms >= window_ms)
        .unwrap_or(UNITS[UNITS.len() - 1]);
    let per_unit = u128::from(limit) * u128::from(unit_ms) / u128::from(window_ms);
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
        Entry, RateLimitOverride,
    };
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::google::protobuf::UInt64Value;
    use futures::StreamExt;
    use quota_core::{FailMode, Policy, PolicySpec};
    use tonic::transport::Channel;
    use tonic_health::pb::health_client::HealthClient;

    use std::sync::atomic::Ordering;

    use tokio::sync::watch;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::HealthCheckRequest;

    use super::*;
    use crate::api::tests::state_on;
    use crate::config::BreakerConfig;
    use crate::decision::breaker::Breaker;
    use crate::envoy::{serve, EnvoyQuota, HEALTH_SERVICE_NAMES};

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
        let quota = EnvoyQuota::new(state.clone(), &EnvoyConfig::default());
        let service = EnvoyRateLimit::new(state, &EnvoyConfig::default());
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
        (
            RateLimitServiceClient::new(channel.clone()),
            channel,
            stop_tx,
        )
    }

    fn embedded() -> AppState {
        state_on(
            quota_store::AnyStore::embedded(),
            Breaker::new(&BreakerConfig::default(), "eu"),
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

    fn with_hits(mut d: RateLimitDescriptor, hits: u64) -> RateLimitDescriptor {
        d.hits_addend = Some(UInt64Value { value: hits });
        d
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

    fn header_value(r: &RateLimitResponse, key: &str) -> Option<String> {
        headers(r).into_iter().find(|(k, _)| k == key).map(|h| h.1)
    }

    const OK: i32 = Code::Ok as i32;
    const OVER: i32 = Code::OverLimit as i32;

    async fn call(
        client: &mut RateLimitServiceClient<Channel>,
        req: RateLimitRequest,
    ) -> RateLimitResponse {
        client.should_rate_limit(req).await.unwrap().into_inner()
    }

    #[tokio::test]
    async fn a_configured_descriptor_key_becomes_the_identity() {
        let state = embedded();
        let cfg = EnvoyConfig {
            identity_key: Some("remote_address".into()),
            ..EnvoyConfig::default()
        };
        let service = EnvoyRateLimit::new(state.clone(), &cfg);
        let d = service.descriptor(
            &descriptor(&[("remote_address", "203.0.113.7"), ("policy", "login")]),
            "api",
            1,
        );
        let key = state.identity_key.as_ref().unwrap().expose().as_bytes();
        let Descriptor::Check { tenant, .. } = d else {
            panic!("{d:?}")
        };
        assert_eq!(tenant, quota_core::hashed_id(key, b"203.0.113.7"));
        // A tenant entry wins; a reserved tenant id is refused.
        let d = service.descriptor(
            &descriptor(&[("tenant", "acme"), ("remote_address", "203.0.113.7")]),
            "api",
            1,
        );
        assert!(matches!(d, Descriptor::Check { ref tenant, .. } if tenant.as_str() == "acme"));
        let d = service.descriptor(&descriptor(&[("tenant", "--plan--default")]), "api", 1);
        assert_eq!(d, Descriptor::Refused("bad_tenant"));
    }

    #[tokio::test]
    async fn a_shadow_denial_is_ok_for_envoy() {
        let state = embedded();
        let shadow = PolicySpec {
            mode: Some(quota_core::PolicyMode::Shadow),
            ..spec(1, 60_000)
        };
        put(&state, "acme", "writes", shadow).await;
        let (mut client, _channel, _stop) = start(state.clone()).await;
        let d = descriptor(&[("tenant", "acme"), ("policy", "writes")]);
        for _ in 0..3 {
            let r = call(&mut client, request("api", vec![d.clone()])).await;
            assert_eq!(r.overall_code, OK);
        }
    }

    #[tokio::test]
    async fn descriptors_are_decided_as_checks_with_the_ietf_fields() {
        let state = embedded();
        put(&state, "acme", "writes", spec(3, 60_000)).await;
        put(&state, "acme", "api", spec(100, 1_000)).await;
        let (mut client, _channel, _stop) = start(state.clone()).await;

        let acme_writes = descriptor(&[("tenant", "acme"), ("policy", "writes")]);
        let mut codes = Vec::new();
        for _ in 0..4 {
            let r = call(&mut client, request("edge", vec![acme_writes.clone()])).await;
            let s = &r.statuses[0];
            let limit = s.current_limit.clone().unwrap();
            assert_eq!(
                (limit.requests_per_unit, limit.unit),
                (3, Unit::Minute as i32)
            );
            codes.push((r.overall_code, s.limit_remaining));
            if r.overall_code == OVER {
                assert_eq!(header_value(&r, "retry-after").as_deref(), Some("20"));
                assert_eq!(
                    header_value(&r, "ratelimit").as_deref(),
                    Some("\"writes\";r=0;t=20")
                );
                let until = s.duration_until_reset.as_ref().unwrap();
                let until_ms = until.seconds * 1000 + i64::from(until.nanos) / 1_000_000;
                assert!((19_000..=20_000).contains(&until_ms), "{until:?}");
            }
        }
        assert_eq!(codes, [(OK, 2), (OK, 1), (OK, 0), (OVER, 0)]);

        // The domain names the policy when no entry does; `hits_addend` is the cost; every
        // decided descriptor's fields are listed, and a descriptor over its limit makes the
        // whole request over.
        let by_domain = with_hits(descriptor(&[("tenant", "acme")]), 40);
        let r = call(
            &mut client,
            request("api", vec![by_domain, acme_writes.clone()]),
        )
        .await;
        assert_eq!(r.overall_code, OVER);
        assert_eq!(
            (r.statuses[0].code, r.statuses[0].limit_remaining),
            (OK, 60)
        );
        let limit = r.statuses[0].current_limit.clone().unwrap();
        assert_eq!(
            (limit.name.as_str(), limit.requests_per_unit, limit.unit),
            ("api", 100, Unit::Second as i32)
        );
        assert_eq!(
            (r.statuses[1].code, r.statuses[1].limit_remaining),
            (OVER, 0)
        );
        assert_eq!(
            header_value(&r, "ratelimit-policy").unwrap(),
            "\"api\";q=100;w=1, \"writes\";q=3;w=60"
        );

        // The request's hits_addend is the cost of a descriptor without its own.
        let mut req = request("api", vec![descriptor(&[("tenant", "acme")])]);
        req.hits_addend = 10;
        let r = call(&mut client, req).await;
        assert_eq!(r.statuses[0].limit_remaining, 50);

        // No tenant entry, or no such policy: OK without a limit, as Envoy expects of a
        // descriptor nothing is configured for.
        let r = call(
            &mut client,
            request(
                "edge",
                vec![
                    descriptor(&[("remote_address", "10.0.0.1")]),
                    descriptor(&[("tenant", "globex"), ("policy", "writes")]),
                ],
            ),
        )
        .await;
        assert_eq!(r.overall_code, OK);
        assert!(r
            .statuses
            .iter()
            .all(|s| s.code == OK && s.current_limit.is_none()));
    }

    #[tokio::test]
    async fn negative_hits_give_tokens_back_up_to_the_capacity() {
        let state = embedded();
        put(&state, "acme", "writes", spec(10, 3_600_000)).await;
        let (mut client, _, _stop) = start(state.clone()).await;
        let spend = with_hits(descriptor(&[("tenant", "acme"), ("policy", "writes")]), 6);
        let r = call(&mut client, request("edge", vec![spend])).await;
        assert_eq!(r.statuses[0].limit_remaining, 4);
        let mut back = with_hits(descriptor(&[("tenant", "acme"), ("policy", "writes")]), 3);
        back.is_negative_hits = true;
        let r = call(&mut client, request("edge", vec![back.clone()])).await;
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 7));
        // Never above the capacity.
        back.hits_addend = Some(UInt64Value { value: 1_000 });
        let r = call(&mut client, request("edge", vec![back.clone()])).await;
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 10));
        // A refund of an unknown policy is undecided, and of nothing a reading.
        let mut unknown = with_hits(descriptor(&[("tenant", "acme"), ("policy", "nope")]), 3);
        unknown.is_negative_hits = true;
        let r = call(&mut client, request("edge", vec![unknown])).await;
        assert_eq!(r.overall_code, OK);
        assert!(r.statuses[0].current_limit.is_none());
        back.hits_addend = Some(UInt64Value { value: 0 });
        let parsed = EnvoyRateLimit::new(state, &EnvoyConfig::default())
            .parse(&request("edge", vec![back]))
            .unwrap();
        assert!(matches!(parsed[0], Descriptor::Check { cost: 0, .. }));
    }

    #[tokio::test]
    async fn a_policy_charged_after_the_fact_takes_every_hit_and_reads_deny_in_debt() {
        let state = embedded();
        let tokens = PolicySpec {
            burst: Some(100.0),
            debt_limit: Some(50.0),
            after_the_fact: Some(true),
            ..spec(100, 3_600_000)
        };
        put(&state, "acme", "tokens", tokens).await;
        let (mut client, _, _stop) = start(state.clone()).await;
        let d = |hits| {
            with_hits(
                descriptor(&[("tenant", "acme"), ("policy", "tokens")]),
                hits,
            )
        };
        // At the start of a request: a reading (hits 0), OK while one token is left.
        let r = call(&mut client, request("edge", vec![d(0)])).await;
        assert_eq!(r.overall_code, OK);
        // At stream end: the tokens the response took, 130 against 100 left, into debt.
        let r = call(&mut client, request("edge", vec![d(130)])).await;
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 0));
        // The next request's reading is over the limit while the debt stands.
        let r = call(&mut client, request("edge", vec![d(0)])).await;
        assert_eq!(r.overall_code, OVER);
        // A charge past the debt limit is clamped, never refused.
        let r = call(&mut client, request("edge", vec![d(1_000)])).await;
        assert_eq!(r.overall_code, OK);
    }

    #[test]
    fn each_malformed_descriptor_is_refused_by_its_own_rule() {
        let svc = EnvoyRateLimit::new(embedded(), &EnvoyConfig::default());
        let good = descriptor(&[("tenant", "acme"), ("policy", "writes")]);
        let mut overridden = good.clone();
        overridden.limit = Some(RateLimitOverride {
            requests_per_unit: 1,
            unit: 1,
        });
        let cases = [
            (descriptor(&[]), "no_entries"),
            (descriptor(&[("tenant", "acme"), ("", "x")]), "empty_key"),
            (overridden, "limit_override"),
            (
                descriptor(&[("tenant", "acme"), ("tenant", "globex")]),
                "repeated_key",
            ),
            (
                descriptor(&[("tenant", "acme"), ("policy", "a"), ("policy", "b")]),
                "repeated_key",
            ),
            (descriptor(&[("tenant", "ac.me")]), "bad_tenant"),
            (descriptor(&[("tenant", "")]), "bad_tenant"),
            (
                descriptor(&[("tenant", "acme"), ("policy", "no such")]),
                "bad_policy",
            ),
        ];
        for (d, reason) in cases {
            let what = format!("{d:?}");
            let parsed = svc.parse(&request("edge", vec![good.clone(), d])).unwrap();
            assert_eq!(parsed.len(), 2, "{what}");
            assert!(
                matches!(parsed[0], Descriptor::Check { cost: 1, .. }),
                "{what}"
            );
            assert_eq!(parsed[1], Descriptor::Refused(reason), "{what}");
        }
        // The domain stands in for a missing policy entry only when it is a policy name.
        let by_domain = descriptor(&[("tenant", "acme")]);
        assert_eq!(
            svc.parse(&request("not a name", vec![by_domain.clone()]))
                .unwrap(),
            [Descriptor::Refused("bad_policy")]
        );
        assert_eq!(
            svc.parse(&request("edge", vec![by_domain])).unwrap(),
            [Descriptor::Check {
                tenant: TenantId::new("acme").unwrap(),
                policy: PolicyName::new("edge").unwrap(),
                cost: 1
            }]
        );
        // Other keys may repeat; a descriptor without the tenant key is undecided.
        assert_eq!(
            svc.parse(&request(
                "edge",
                vec![descriptor(&[("path", "/a"), ("path", "/b")])]
            ))
            .unwrap(),
            [Descriptor::NoTenant]
        );
        // Only a request the proto calls invalid as a whole is an error.
        assert!(svc.parse(&request("", vec![good.clone()])).is_err());
        assert!(svc.parse(&request("edge", vec![])).is_err());
        let many = svc
            .parse(&request("edge", vec![good.clone(); MAX_BATCH + 2]))
            .unwrap();
        assert!(many[..MAX_BATCH]
            .iter()
            .all(|d| matches!(d, Descriptor::Check { .. })));
        assert_eq!(
            many[MAX_BATCH..],
            [
                Descriptor::Refused("too_many_descriptors"),
                Descriptor::Refused("too_many_descriptors")
            ]
        );
    }

    #[tokio::test]
    async fn a_malformed_descriptor_is_over_the_limit_and_the_others_are_still_decided() {
        let state = embedded();
        put(&state, "acme", "writes", spec(5, 60_000)).await;
        put(&state, "all", "global", spec(1, 60_000)).await;
        let (mut client, _channel, _stop) = start(state).await;
        let good = descriptor(&[("tenant", "acme"), ("policy", "writes")]);
        let global = descriptor(&[("tenant", "all"), ("policy", "global")]);
        let bad = descriptor(&[("tenant", "ac.me"), ("policy", "writes")]);
        // The global limit of one is spent.
        assert_eq!(
            call(&mut client, request("edge", vec![global.clone()]))
                .await
                .overall_code,
            OK
        );

        let r = call(
            &mut client,
            request("edge", vec![bad.clone(), global.clone(), good.clone()]),
        )
        .await;
        assert_eq!(r.overall_code, OVER);
        let s: Vec<_> = r
            .statuses
            .iter()
            .map(|s| (s.code, s.current_limit.is_some(), s.limit_remaining))
            .collect();
        assert_eq!(s, [(OVER, false, 0), (OVER, true, 0), (OK, true, 4)]);

        // A malformed descriptor alone is a denial too, not an error Envoy would admit.
        let r = call(&mut client, request("edge", vec![bad])).await;
        assert_eq!((r.overall_code, r.statuses.len()), (OVER, 1));

        // A request invalid as a whole is an error, and spends nothing.
        let e = client
            .should_rate_limit(request("", vec![good.clone()]))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let r = call(&mut client, request("edge", vec![good])).await;
        assert_eq!(r.statuses[0].limit_remaining, 3);
    }

    #[tokio::test]
    async fn hits_addend_zero_reads_the_bucket_without_spending() {
        let state = embedded();
        put(&state, "acme", "writes", spec(2, 60_000)).await;
        let (mut client, _channel, _stop) = start(state).await;
        let spend = descriptor(&[("tenant", "acme"), ("policy", "writes")]);
        let read = with_hits(spend.clone(), 0);
        for _ in 0..3 {
            let r = call(&mut client, request("edge", vec![read.clone()])).await;
            let s = &r.statuses[0];
            assert_eq!((r.overall_code, s.limit_remaining), (OK, 2));
            assert!(s.current_limit.is_some());
            assert!(header_value(&r, "ratelimit-policy").is_some());
        }
        call(&mut client, request("edge", vec![spend.clone()])).await;
        let r = call(&mut client, request("edge", vec![read.clone()])).await;
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 1));
        call(&mut client, request("edge", vec![spend.clone()])).await;
        // Empty: one hit would be refused, so the reading is over the limit.
        let r = call(&mut client, request("edge", vec![read])).await;
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OVER, 0));
        assert!(header_value(&r, "retry-after").is_some());
        // A request-level hits_addend of 0 is Envoy's "not set": one hit.
        let r = call(&mut client, request("edge", vec![spend])).await;
        assert_eq!(r.overall_code, OVER);
    }

    #[tokio::test]
    async fn a_cost_above_the_burst_is_over_the_limit_with_the_limit_and_fields() {
        let state = embedded();
        put(&state, "acme", "writes", spec(5, 60_000)).await;
        let (mut client, _channel, _stop) = start(state).await;
        let d = descriptor(&[("tenant", "acme"), ("policy", "writes")]);
        call(&mut client, request("edge", vec![d.clone()])).await;
        let r = call(&mut client, request("edge", vec![with_hits(d.clone(), 6)])).await;
        let s = &r.statuses[0];
        assert_eq!((r.overall_code, s.limit_remaining), (OVER, 0));
        let limit = s.current_limit.clone().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (5, Unit::Minute as i32)
        );
        assert_eq!(
            header_value(&r, "ratelimit-policy").as_deref(),
            Some("\"writes\";q=5;w=60")
        );
        // The field states the tokens the bucket holds; nothing was spent.
        assert_eq!(
            header_value(&r, "ratelimit").as_deref(),
            Some("\"writes\";r=4;t=60")
        );
        assert_eq!(header_value(&r, "retry-after").as_deref(), Some("60"));
        let r = call(&mut client, request("edge", vec![d])).await;
        assert_eq!(r.statuses[0].limit_remaining, 3);
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
        let strict = descriptor(&[("tenant", "acme"), ("policy", "strict")]);
        let r = call(&mut client, request("edge", vec![strict])).await;
        assert_eq!(r.overall_code, OVER, "closed must deny, not error");
        let s = &r.statuses[0];
        assert_eq!(s.limit_remaining, 0);
        assert_eq!(s.current_limit.as_ref().unwrap().requests_per_unit, 5);
        assert!(header_value(&r, "retry-after").is_some());
        let lenient = descriptor(&[("tenant", "acme"), ("policy", "lenient")]);
        let r = call(&mut client, request("edge", vec![lenient])).await;
        // Decided in process: a bucket Redis never answered for starts empty and refills at
        // the share's rate, 5 a minute, so the first token is 12 s away.
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OVER, 0));
        assert_eq!(header_value(&r, "retry-after").as_deref(), Some("12"));
    }

    #[test]
    fn the_limit_is_stated_per_the_smallest_unit_as_long_as_the_window() {
        let p = PolicyName::new("p").unwrap();
        let shown = |limit, window_ms| {
            let l = current_limit(&p, limit, window_ms);
            (l.requests_per_unit, Unit::try_from(l.unit).unwrap())
        };
        const DAY_MS: u64 = 86_400_000;
        let table = [
            ((3, 10_000), (18, Unit::Minute)),
            ((1, 7 * DAY_MS), (1, Unit::Week)),
            ((10_000, 60_000), (10_000, Unit::Minute)),
            ((100, 1_000), (100, Unit::Second)),
            ((3, 500), (6, Unit::Second)),
            ((5, 3_000), (100, Unit::Minute)),
            ((100, 120_000), (3_000, Unit::Hour)),
            ((7, DAY_MS), (7, Unit::Day)),
            ((2, 2 * DAY_MS), (7, Unit::Week)),
            ((10, 30 * DAY_MS), (10, Unit::Month)),
            // Not a whole number of windows per unit: rounded down.
            ((1, 7_000), (8, Unit::Minute)),
            ((1, 31 * DAY_MS), (11, Unit::Year)),
            // Beyond what the field holds: saturated.
            ((1_000_000_000, 1), (u32::MAX, Unit::Second)),
        ];
        for ((limit, window_ms), want) in table {
            assert_eq!(shown(limit, window_ms), want, "{limit} per {window_ms} ms");
        }
    }

    #[tokio::test]
    async fn health_answers_for_ratelimit_too_and_turns_not_serving_at_shutdown() {
        let state = embedded();
        let (_client, channel, stop) = start(state.clone()).await;
        let mut health = HealthClient::new(channel);
        let serving = ServingStatus::Serving as i32;
        for name in HEALTH_SERVICE_NAMES {
            let r = health
                .check(HealthCheckRequest {
                    service: name.into(),
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.status, serving, "{name:?}");
        }
        let e = health
            .check(HealthCheckRequest {
                service: "other".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound);

        // Watch on an unknown name streams SERVICE_UNKNOWN and keeps the call open.
        let mut unknown = health
            .watch(HealthCheckRequest {
                service: "other".into(),
            })
            .await
            .unwrap()
            .into_inner();
        let first = unknown.message().await.unwrap().unwrap();
        assert_eq!(first.status, ServingStatus::ServiceUnknown as i32);
        assert!(
            tokio::time::timeout(Duration::from_millis(200), unknown.message())
                .await
                .is_err(),
            "the call stays open"
        );

        let mut watch = health
            .watch(HealthCheckRequest {
                service: "ratelimit".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(watch.message().await.unwrap().unwrap().status, serving);
        // Shutdown begins: readiness turns false before the listener stops.
        state.ready.store(false, Ordering::Relaxed);
        let next = tokio::time::timeout(Duration::from_secs(2), watch.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(next.status, ServingStatus::NotServing as i32);
        let r = health
            .check(HealthCheckRequest {
                service: "ratelimit".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status, ServingStatus::NotServing as i32);
        // Then the listener stops, and every watch ends.
        stop.send_replace(true);
        for stream in [&mut watch, &mut unknown] {
            let end = tokio::time::timeout(Duration::from_secs(2), stream.message())
                .await
                .unwrap();
            assert!(!matches!(end, Ok(Some(_))), "{end:?}");
        }
    }

    #[tokio::test]
    async fn a_watch_sees_not_serving_even_when_the_stop_comes_at_once() {
        let state = embedded();
        let (_client, channel, stop) = start(state.clone()).await;
        let mut health = HealthClient::new(channel);
        let mut watch = health
            .watch(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            watch.message().await.unwrap().unwrap().status,
            ServingStatus::Serving as i32
        );
        state.ready.store(false, Ordering::Relaxed);
        stop.send_replace(true);
        let seen: Vec<i32> = tokio::time::timeout(
            Duration::from_secs(2),
            futures::stream::unfold(watch, |mut w| async move {
                Some((w.message().await.ok()??.status, w))
            })
            .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
        assert_eq!(seen, [ServingStatus::NotServing as i32]);
    }
}
