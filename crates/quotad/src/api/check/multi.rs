//! POST /v1/check with `policies`: several limits of one tenant decided at once, all or nothing
//! (`decision::multi`). The answer is a single check's, plus each limit's decision and the
//! policies that denied it; a 429 is the same problem body a single check gets, naming every
//! violated policy.

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use quota_core::bucket::MAX_LIMITS_PER_CHECK;
use quota_core::{PolicyName, TenantId};
use serde::Serialize;

use crate::api::check::{check_error, parse_cost, secs_ceil, subject, CheckBody};
use crate::api::problem::{problem_response, ApiError, Problem, QUOTA_EXCEEDED_TYPE};
use crate::api::state::AppState;
use crate::decision::multi::{LimitVerdict, MultiError, MultiVerdict};
use crate::decision::Mode;

/// One limit's part of a check of several.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct LimitResponse {
    pub policy: String,
    /// Whether this limit admits the cost (when the check is denied by another, nothing was
    /// spent here).
    pub allowed: bool,
    /// Whole tokens left in this region's bucket of this policy.
    pub remaining: u64,
    /// Milliseconds until `cost` tokens are available in this bucket (0 when it admits).
    pub retry_after_ms: u64,
    /// Milliseconds until this bucket is full.
    pub reset_ms: u64,
}

/// The decision of a check of several policies.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct MultiCheckResponse {
    /// True when every policy admitted the cost (then it was spent on each).
    pub allowed: bool,
    /// The fewest whole tokens left of the policies' buckets.
    pub remaining: u64,
    /// Milliseconds until every policy admits the cost (0 when allowed).
    pub retry_after_ms: u64,
    /// Milliseconds until every bucket is full.
    pub reset_ms: u64,
    pub region: String,
    pub decided_by: String,
    #[schema(value_type = String)]
    pub mode: Mode,
    /// The policies that denied the check, in the order named (empty when allowed).
    pub violated_policies: Vec<String>,
    /// Each policy's decision, in the order named.
    pub limits: Vec<LimitResponse>,
}

/// A denial of a check of several policies: the problem body plus the decision fields.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct MultiRateLimitedProblem {
    #[serde(flatten)]
    pub problem: Problem,
    #[serde(flatten)]
    pub decision: MultiCheckResponse,
}

pub(crate) fn limit_response(l: &LimitVerdict) -> LimitResponse {
    // "Never" is reported as one window, as for a single check.
    let never = l.policy.window_ms;
    let d = &l.decision;
    LimitResponse {
        policy: l.name.as_str().to_string(),
        allowed: d.allowed,
        remaining: d.remaining,
        retry_after_ms: if d.allowed {
            0
        } else {
            d.retry_after_ms.unwrap_or(never)
        },
        reset_ms: d.reset_ms.unwrap_or(never),
    }
}

fn response(v: &MultiVerdict, region: &str) -> MultiCheckResponse {
    let limits: Vec<LimitResponse> = v.limits.iter().map(limit_response).collect();
    let d = &v.decision;
    let violated: Vec<&LimitResponse> = limits.iter().filter(|l| !l.allowed).collect();
    MultiCheckResponse {
        allowed: d.allowed,
        remaining: d.remaining,
        retry_after_ms: violated.iter().map(|l| l.retry_after_ms).max().unwrap_or(0),
        reset_ms: limits.iter().map(|l| l.reset_ms).max().unwrap_or(0),
        region: region.to_string(),
        decided_by: v.decided_by.as_str().to_string(),
        mode: v.mode,
        violated_policies: violated.iter().map(|l| l.policy.clone()).collect(),
        limits,
    }
}

/// RateLimit-Policy and RateLimit list every policy (IETF httpapi ratelimit-headers allow a
/// list); Retry-After on denial.
fn headers(headers: &mut HeaderMap, v: &MultiVerdict, r: &MultiCheckResponse) {
    let mut policy = String::new();
    let mut limit = String::new();
    for (l, lr) in v.limits.iter().zip(&r.limits) {
        if !policy.is_empty() {
            policy.push_str(", ");
            limit.push_str(", ");
        }
        // Policy names are validated to [A-Za-z0-9_-]: valid sf-strings as they are.
        let name = l.name.as_str();
        let window_s = secs_ceil(l.policy.window_ms).max(1);
        policy.push_str(&format!("\"{name}\";q={};w={window_s}", l.policy.limit));
        let t = if lr.allowed {
            secs_ceil(lr.reset_ms)
        } else {
            secs_ceil(lr.retry_after_ms)
        };
        limit.push_str(&format!("\"{name}\";r={};t={t}", lr.remaining));
    }
    if let Ok(p) = HeaderValue::from_str(&policy) {
        headers.insert("ratelimit-policy", p);
    }
    if let Ok(l) = HeaderValue::from_str(&limit) {
        headers.insert("ratelimit", l);
    }
    if !r.allowed {
        headers.insert(
            header::RETRY_AFTER,
            HeaderValue::from(secs_ceil(r.retry_after_ms).max(1)),
        );
    }
}

/// The subject, the policies (each named by its place when invalid) and the cost.
fn parse(state: &AppState, body: CheckBody) -> Result<(TenantId, Vec<PolicyName>, u64), ApiError> {
    // Never forwarded: a check of several policies is decided where it arrives.
    let tenant = subject(
        state,
        body.tenant.as_deref(),
        body.identity.as_deref(),
        false,
    )?;
    if body.policy.is_some() {
        return Err(ApiError::field(
            "policies",
            &"name either policy or policies, not both",
        ));
    }
    let names = body.policies.unwrap_or_default();
    if names.is_empty() || names.len() as u64 > MAX_LIMITS_PER_CHECK {
        return Err(ApiError::field(
            "policies",
            &format!("name 1 to {MAX_LIMITS_PER_CHECK} policies"),
        ));
    }
    let mut policies = Vec::with_capacity(names.len());
    for (i, n) in names.into_iter().enumerate() {
        policies
            .push(PolicyName::new(n).map_err(|e| ApiError::field(format!("policies[{i}]"), &e))?);
    }
    Ok((tenant, policies, parse_cost(body.cost)?))
}

/// Decides a check body that names `policies`.
pub(crate) async fn check_all(state: &AppState, body: CheckBody) -> Result<Response, ApiError> {
    let (tenant, policies, cost) = parse(state, body)?;
    let v = state
        .decider
        .check_all(tenant, policies, cost)
        .await
        .map_err(|e| match e {
            MultiError::Check(e) => check_error(e),
            MultiError::Unsupported(why) => ApiError::field("policies", &why),
        })?;
    let r = response(&v, state.decider.region().as_str());
    for l in v.violated() {
        state
            .decider
            .metrics
            .record_retry_after(&l.name, r.retry_after_ms as f64 / 1000.0);
    }
    let mut resp = if r.allowed {
        let mut resp = Response::new(axum::body::Body::from(
            serde_json::to_vec(&r).unwrap_or_default(),
        ));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp
    } else {
        let names: Vec<String> = r.violated_policies.clone();
        let problem = MultiRateLimitedProblem {
            problem: Problem {
                type_: QUOTA_EXCEEDED_TYPE.to_string(),
                title: "Quota exceeded".to_string(),
                status: 429,
                detail: format!(
                    "{} of the {} policies have no tokens left for this request; nothing was spent",
                    names.len(),
                    r.limits.len()
                ),
                code: "RATE_LIMITED".to_string(),
                errors: Vec::new(),
                violated_policies: names,
            },
            decision: r.clone(),
        };
        problem_response(StatusCode::TOO_MANY_REQUESTS, &problem)
    };
    headers(resp.headers_mut(), &v, &r);
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{header, Request, StatusCode};
    use http_body_util::BodyExt as _;
    use serde_json::{json, Value};
    use tower::ServiceExt as _;

    use crate::api::app;
    use crate::api::tests::state_on;
    use crate::config::BreakerConfig;
    use crate::decision::breaker::Breaker;

    /// The admin token of `state_on`'s state.
    const TOKEN: &str = "test-token";

    async fn send(
        router: &crate::api::Api,
        method: &str,
        uri: &str,
        body: &str,
    ) -> (StatusCode, axum::http::HeaderMap, Value) {
        let req = Request::builder()
            .method(method)
            .uri(uri)
            .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        let resp = router.clone().oneshot(req).await.unwrap();
        let (status, headers) = (resp.status(), resp.headers().clone());
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            headers,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// Region `eu` on the embedded store with the policies of tenant `acme`.
    async fn with_policies(policies: &[(&str, Value)]) -> crate::api::Api {
        let router = app(state_on(
            quota_store::AnyStore::embedded(),
            Breaker::new(&BreakerConfig::default(), "eu"),
        ));
        for (name, spec) in policies {
            let uri = format!("/v1/tenants/acme/policies/{name}");
            let (status, _, body) = send(&router, "PUT", &uri, &spec.to_string()).await;
            assert_eq!(status, StatusCode::OK, "{body}");
        }
        router
    }

    #[tokio::test]
    async fn several_policies_spend_all_or_nothing() {
        // 2 an hour and 10 an hour: refills far slower than the test runs.
        let router = with_policies(&[
            ("tiny", json!({"limit": 2, "window_ms": 3_600_000})),
            ("big", json!({"limit": 10, "window_ms": 3_600_000})),
        ])
        .await;
        let both = json!({"tenant": "acme", "policies": ["tiny", "big"]}).to_string();
        for left in [1, 0] {
            let (status, headers, body) = send(&router, "POST", "/v1/check", &both).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            assert_eq!(body["allowed"], true);
            assert_eq!(body["remaining"], left);
            assert_eq!(body["violated_policies"], json!([]));
            assert_eq!(body["limits"][0]["policy"], "tiny");
            assert_eq!(body["limits"][1]["remaining"], 8 + left);
            assert_eq!(
                headers["ratelimit-policy"],
                "\"tiny\";q=2;w=3600, \"big\";q=10;w=3600"
            );
        }
        // Denied by tiny alone: big keeps its 8.
        for _ in 0..3 {
            let (status, headers, body) = send(&router, "POST", "/v1/check", &both).await;
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
            assert_eq!(headers[header::CONTENT_TYPE], "application/problem+json");
            assert_eq!(body["code"], "RATE_LIMITED");
            assert_eq!(body["violated-policies"], json!(["tiny"]));
            assert_eq!(body["violated_policies"], json!(["tiny"]));
            assert_eq!(body["limits"][1]["allowed"], true);
            assert_eq!(body["limits"][1]["remaining"], 8);
            let retry = body["retry_after_ms"].as_u64().unwrap();
            assert!((1_790_000..=1_800_000).contains(&retry), "{retry}");
            assert!(headers.contains_key(header::RETRY_AFTER));
        }
        // The single check sees the same bucket.
        let one = json!({"tenant": "acme", "policy": "big"}).to_string();
        let (status, _, body) = send(&router, "POST", "/v1/check", &one).await;
        assert_eq!(
            (status, body["remaining"].clone()),
            (StatusCode::OK, json!(7))
        );
    }

    #[tokio::test]
    async fn checks_of_several_policies_are_refused_naming_policies() {
        let router = with_policies(&[
            ("a", json!({"limit": 5, "window_ms": 1000})),
            ("b", json!({"limit": 50, "window_ms": 60000})),
            (
                "w",
                json!({"limit": 5, "window_ms": 1000, "algorithm": "sliding_window"}),
            ),
        ])
        .await;
        let too_many: Vec<String> = (0..17).map(|i| format!("p{i}")).collect();
        for (body, field) in [
            (
                json!({"tenant": "acme", "policy": "a", "policies": ["b"]}),
                "policies",
            ),
            (json!({"tenant": "acme", "policies": []}), "policies"),
            (json!({"tenant": "acme", "policies": too_many}), "policies"),
            (
                json!({"tenant": "acme", "policies": ["a", "a"]}),
                "policies",
            ),
            (
                json!({"tenant": "acme", "policies": ["a", "w"]}),
                "policies",
            ),
            (
                json!({"tenant": "acme", "policies": ["a", "no.pe"]}),
                "policies[1]",
            ),
            (json!({"tenant": "acme", "policies": "a"}), "policies"),
            (json!({"tenant": "ac.me", "policies": ["a"]}), "tenant"),
            (
                json!({"tenant": "acme", "policies": ["a", "b"], "cost": 6}),
                "cost",
            ),
            (json!({"tenant": "acme"}), "policy"),
        ] {
            let (status, _, reply) = send(&router, "POST", "/v1/check", &body.to_string()).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {reply}");
            assert_eq!(reply["errors"][0]["field"], field, "{body}: {reply}");
        }
        let unknown = json!({"tenant": "acme", "policies": ["a", "zzz"]}).to_string();
        let (status, _, _) = send(&router, "POST", "/v1/check", &unknown).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        // Refused checks spent nothing.
        let (_, _, body) = send(
            &router,
            "POST",
            "/v1/check",
            &json!({"tenant": "acme", "policies": ["a", "b"]}).to_string(),
        )
        .await;
        assert_eq!(body["limits"][0]["remaining"], 4, "{body}");
        // Batches take one policy per check.
        let batch = json!({"checks": [{"tenant": "acme", "policies": ["a", "b"]}]}).to_string();
        let (status, _, body) = send(&router, "POST", "/v1/check/batch", &batch).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["results"][0]["status"], 400, "{body}");
    }

    #[tokio::test]
    async fn the_document_describes_several_policies() {
        let router = with_policies(&[]).await;
        let (_, _, doc) = send(&router, "GET", "/openapi.json", "").await;
        let s = &doc["components"]["schemas"];
        let p = &s["CheckBody"]["properties"]["policies"];
        assert_eq!(p["maxItems"], 16, "{p}");
        assert_eq!(p["items"]["pattern"], crate::api::contract::ID_PATTERN);
        assert!(s["BatchCheck"]["properties"].get("policies").is_none());
        for name in [
            "MultiCheckResponse",
            "MultiRateLimitedProblem",
            "LimitResponse",
        ] {
            assert!(s.get(name).is_some(), "{name}");
        }
    }
}
