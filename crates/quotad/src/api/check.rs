//! POST /v1/check: one decision (batches are in `batch`).
//!
//! Responses carry the IETF httpapi ratelimit-headers fields (`RateLimit-Policy`, `RateLimit`),
//! `Retry-After` in whole seconds rounded up, and on 429 an RFC 9457 problem body with code
//! `RATE_LIMITED`. Nothing internal (key names, other tenants) appears in any of them.

use axum::extract::{FromRequest as _, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use quota_core::{PolicyName, TenantId};
use serde::{Deserialize, Serialize};

pub mod multi;

use crate::api::header_text::HeaderText;
use crate::api::problem::{problem_response, ApiError, ApiJson, Problem, QUOTA_EXCEEDED_TYPE};
use crate::api::state::AppState;
use crate::api::tenants::client_tenant;
use crate::decision::{CheckError, Mode, Verdict, FORWARDED_HEADER};

static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// One check request.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckBody {
    /// The tenant id (1–96 characters of `[A-Za-z0-9_-]`). Exactly one of `tenant` and
    /// `identity`.
    #[serde(default)]
    pub tenant: Option<String>,
    /// A raw identity (an API key, an IP address, an e-mail; any UTF-8 up to 1 KiB). The
    /// daemon hashes it with its identity key before it reaches any key, label, log line or
    /// response; it decides under the subject's plan or the `default` plan.
    #[serde(default)]
    pub identity: Option<String>,
    /// The policy name. Exactly one of `policy` and `policies`.
    #[serde(default)]
    pub policy: Option<String>,
    /// Several policies of the subject, decided at once, all or nothing: the cost is spent on
    /// every one when each admits it, and on none otherwise (token buckets only, decided in
    /// this region). Not in batches.
    #[serde(default)]
    pub policies: Option<Vec<String>>,
    /// Tokens to spend; a whole number ≥ 1, at most the policy's burst. Defaults to 1.
    #[serde(default)]
    #[schema(value_type = Option<u64>)]
    pub cost: Option<f64>,
}

/// A decision.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct CheckResponse {
    pub allowed: bool,
    /// Whole tokens left in this region's bucket.
    pub remaining: u64,
    /// Milliseconds until `cost` tokens are available (0 when allowed).
    pub retry_after_ms: u64,
    /// Milliseconds until the bucket is full.
    pub reset_ms: u64,
    /// The region that answered.
    pub region: String,
    /// The region whose bucket decided (the home region for a pinned tenant).
    pub decided_by: String,
    #[schema(value_type = String)]
    pub mode: Mode,
    /// Present and `true` when a shadow policy admitted a check it would have denied.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub shadow_denied: bool,
}

/// A denial: the problem body plus the decision fields.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RateLimitedProblem {
    #[serde(flatten)]
    pub problem: Problem,
    #[serde(flatten)]
    pub decision: CheckResponse,
}

/// Most tokens one check may ask for (`cost`), before the policy's burst is consulted: past
/// this an `f64` no longer holds every whole number.
pub const MAX_COST: u64 = 9_000_000_000_000_000;

/// The longest identity a check may name, in bytes.
pub const MAX_IDENTITY_BYTES: usize = 1024;

/// The subject of a check: its tenant (not a reserved id, unless a peer forwarded it: a
/// forwarded check names the subject the first region resolved), or the keyed hash of its
/// identity. The raw identity goes no further than this function.
pub(crate) fn subject(
    state: &AppState,
    tenant: Option<&str>,
    identity: Option<&str>,
    forwarded: bool,
) -> Result<TenantId, ApiError> {
    match (tenant, identity) {
        (Some(t), None) => {
            let t = TenantId::new(t).map_err(|e| ApiError::field("tenant", &e))?;
            if forwarded {
                Ok(t)
            } else {
                client_tenant(t)
            }
        }
        (None, Some(raw)) => {
            if raw.is_empty() || raw.len() > MAX_IDENTITY_BYTES {
                return Err(ApiError::field(
                    "identity",
                    &format!("must be 1 to {MAX_IDENTITY_BYTES} bytes of UTF-8"),
                ));
            }
            let key = state.identity_key.as_ref().ok_or_else(|| ApiError::NotConfigured {
                field: "identity".into(),
                message: "this daemon has no identity key (QUOTAD_IDENTITY_KEY or api.identity_key_file): name a `tenant` instead".into(),
            })?;
            Ok(quota_core::hashed_id(
                key.expose().as_bytes(),
                raw.as_bytes(),
            ))
        }
        (Some(_), Some(_)) => Err(ApiError::field(
            "identity",
            &"name either `tenant` or `identity`, not both",
        )),
        (None, None) => Err(ApiError::field(
            "tenant",
            &"name the subject: `tenant` or `identity`",
        )),
    }
}

/// Validates a check body into typed ids (taking its strings, not copying them) and a cost.
pub(crate) fn parse(
    state: &AppState,
    body: CheckBody,
    forwarded: bool,
) -> Result<(TenantId, PolicyName, u64), ApiError> {
    let tenant = subject(
        state,
        body.tenant.as_deref(),
        body.identity.as_deref(),
        forwarded,
    )?;
    if body.policies.is_some() {
        return Err(ApiError::field(
            "policies",
            &"several policies at once are checked one request each, on POST /v1/check",
        ));
    }
    let Some(policy) = body.policy else {
        return Err(ApiError::field(
            "policy",
            &"required: the policy to check (or several in policies)",
        ));
    };
    let policy = PolicyName::new(policy).map_err(|e| ApiError::field("policy", &e))?;
    Ok((tenant, policy, parse_cost(body.cost)?))
}

/// A check's cost: 1 when absent, else a whole number in 1..=MAX_COST.
pub(crate) fn parse_cost(cost: Option<f64>) -> Result<u64, ApiError> {
    match cost {
        None => Ok(1),
        Some(c) if c.fract() == 0.0 && (1.0..=MAX_COST as f64).contains(&c) => Ok(c as u64),
        Some(c) => Err(ApiError::field(
            "cost",
            &format!("must be a whole number of at least 1 (got {c})"),
        )),
    }
}

pub(crate) fn check_error(e: CheckError) -> ApiError {
    match e {
        CheckError::UnknownPolicy => ApiError::NotFound {
            what: "policy for this tenant",
        },
        CheckError::Cost(e) => ApiError::field("cost", &e),
        CheckError::TakenWithHolds => ApiError::Conflict {
            detail: CheckError::TakenWithHolds.to_string(),
        },
        CheckError::ReducedCapacity { policy, reason } => ApiError::ReducedCapacity {
            policy: policy.as_str().to_string(),
            reason: reason.to_string(),
        },
    }
}

pub(crate) fn secs_ceil(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

impl CheckResponse {
    pub(crate) fn from_verdict(v: &Verdict, region: &str) -> Self {
        let d = &v.decision;
        // "Never" (cost above this region's share, or no refill) is reported as one window:
        // a share change may make the request possible again.
        let never = v.policy.window_ms;
        Self {
            allowed: d.allowed,
            remaining: d.remaining,
            retry_after_ms: if d.allowed {
                0
            } else {
                d.retry_after_ms.unwrap_or(never)
            },
            reset_ms: d.reset_ms.unwrap_or(never),
            region: region.to_string(),
            decided_by: v.decided_by.as_str().to_string(),
            mode: v.mode,
            shadow_denied: v.shadow_denied,
        }
    }

    /// The JSON body, written field by field: what `serde_json` writes for it (a test holds
    /// them equal) without its escaping pass, which neither the keys nor the region ids
    /// (validated to `[A-Za-z0-9_-]`) need.
    pub(crate) fn to_json(&self) -> Vec<u8> {
        fn num(b: &mut Vec<u8>, n: u64) {
            b.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
        }
        fn text(b: &mut Vec<u8>, s: &str) {
            if s.bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
            {
                b.push(b'"');
                b.extend_from_slice(s.as_bytes());
                b.push(b'"');
            } else {
                // Not reachable with validated ids; serde_json escapes whatever else it is.
                let _ = serde_json::to_writer(&mut *b, s);
            }
        }
        let mut b = Vec::with_capacity(
            128 + self.region.len() + self.decided_by.len() + self.mode.as_str().len(),
        );
        b.extend_from_slice(br#"{"allowed":"#);
        b.extend_from_slice(if self.allowed { b"true" } else { b"false" });
        b.extend_from_slice(br#","remaining":"#);
        num(&mut b, self.remaining);
        b.extend_from_slice(br#","retry_after_ms":"#);
        num(&mut b, self.retry_after_ms);
        b.extend_from_slice(br#","reset_ms":"#);
        num(&mut b, self.reset_ms);
        b.extend_from_slice(br#","region":"#);
        text(&mut b, &self.region);
        b.extend_from_slice(br#","decided_by":"#);
        text(&mut b, &self.decided_by);
        b.extend_from_slice(br#","mode":"#);
        text(&mut b, self.mode.as_str());
        if self.shadow_denied {
            b.extend_from_slice(br#","shadow_denied":true"#);
        }
        b.push(b'}');
        b
    }

    /// A 200 response with this body, with room for the headers added after it.
    fn ok_response(&self) -> Response {
        let mut resp = Response::new(axum::body::Body::from(self.to_json()));
        *resp.headers_mut() = HeaderMap::with_capacity(8);
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp
    }
}

/// The RateLimit-Policy, RateLimit and (on denial) Retry-After fields.
fn rate_limit_headers(
    state: &AppState,
    headers: &mut HeaderMap,
    policy: &PolicyName,
    v: &Verdict,
    r: &CheckResponse,
) {
    let (p, l) = rate_limit_values(policy, v, r);
    if let Some(p) = p {
        headers.insert(RATELIMIT_POLICY.clone(), p);
    }
    if let Some(l) = l {
        headers.insert(RATELIMIT.clone(), l);
    }
    if !r.allowed {
        headers.insert(
            header::RETRY_AFTER,
            HeaderValue::from(secs_ceil(r.retry_after_ms).max(1)),
        );
        state
            .decider
            .metrics
            .record_retry_after(policy, r.retry_after_ms as f64 / 1000.0);
    }
}

/// The values of the RateLimit-Policy and RateLimit fields (IETF draft) for one decision.
pub(crate) fn rate_limit_values(
    policy: &PolicyName,
    v: &Verdict,
    r: &CheckResponse,
) -> (Option<HeaderValue>, Option<HeaderValue>) {
    let name = policy.as_str();
    let window_s = secs_ceil(v.policy.window_ms).max(1);
    // Policy names are validated to [A-Za-z0-9_-], so they are valid sf-strings as they are.
    let p = HeaderText::new()
        .str("\"")
        .str(name)
        .str("\";q=")
        .num(v.policy.limit)
        .str(";w=")
        .num(window_s)
        .value();
    let t = if r.allowed {
        secs_ceil(r.reset_ms)
    } else {
        secs_ceil(r.retry_after_ms)
    };
    let l = HeaderText::new()
        .str("\"")
        .str(name)
        .str("\";r=")
        .num(r.remaining)
        .str(";t=")
        .num(t)
        .value();
    (p, l)
}

pub(crate) fn rate_limited_problem(
    policy: &PolicyName,
    decision: CheckResponse,
) -> RateLimitedProblem {
    RateLimitedProblem {
        problem: Problem {
            type_: QUOTA_EXCEEDED_TYPE.to_string(),
            title: "Quota exceeded".to_string(),
            status: 429,
            detail: format!(
                "policy {:?} has no tokens left for this request",
                policy.as_str()
            ),
            code: "RATE_LIMITED".to_string(),
            errors: Vec::new(),
            violated_policies: vec![policy.as_str().to_string()],
        },
        decision,
    }
}

pub(crate) async fn decide(
    state: &AppState,
    body: CheckBody,
    forwarded: bool,
) -> Result<(Verdict, PolicyName), ApiError> {
    let (tenant, policy, cost) = parse(state, body, forwarded)?;
    let v = state
        .decider
        .check(tenant, policy.clone(), cost, forwarded)
        .await
        .map_err(check_error)?;
    Ok((v, policy))
}

/// Decides one check.
#[utoipa::path(
    post,
    path = "/v1/check",
    request_body = CheckBody,
    responses(
        (status = 200, description = "Allowed (a check of `policies` answers a MultiCheckResponse)", body = CheckResponse),
        (status = 429, description = "Quota exceeded (a check of `policies`: a MultiRateLimitedProblem)", body = RateLimitedProblem),
        (status = 400, description = "Invalid request", body = Problem),
        (status = 404, description = "Unknown tenant policy", body = Problem),
        (status = 503, description = "Temporarily reduced capacity", body = Problem),
    ),
    security((), ("bearer" = ["check"])),
    tag = "decisions"
)]
pub async fn check(State(state): State<AppState>, req: Request) -> Result<Response, ApiError> {
    // The header is read before the body extractor takes the request: a `HeaderMap` extractor
    // would clone every header of every check.
    let forwarded = state.decider.is_peer_forward(
        req.headers()
            .get(&FORWARDED_HEADER)
            .and_then(|v| v.to_str().ok()),
    );
    let ApiJson(body) = ApiJson::<CheckBody>::from_request(req, &state).await?;
    if body.policies.is_some() {
        return multi::check_all(&state, body).await;
    }
    let (v, policy) = decide(&state, body, forwarded).await?;
    let r = CheckResponse::from_verdict(&v, state.decider.region().as_str());
    let mut resp = if r.allowed {
        r.ok_response()
    } else {
        problem_response(
            StatusCode::TOO_MANY_REQUESTS,
            &rate_limited_problem(&policy, r.clone()),
        )
    };
    rate_limit_headers(&state, resp.headers_mut(), &policy, &v, &r);
    Ok(resp)
}
