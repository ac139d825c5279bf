//! Holds: `POST /v1/holds` reserves an estimate (or a concurrency slot) and answers like a
//! check plus a hold id; `POST /v1/holds/{id}/settle` applies the actual cost (refunding or
//! charging the difference); `DELETE /v1/holds/{id}` (or `POST /v1/holds/{id}/release`)
//! gives it back. docs/api.md is the reference.

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse as _, Response};
use quota_core::{PolicyName, TenantId};
use serde::{Deserialize, Serialize};

use crate::api::auth;
use crate::api::check::multi::{limit_response, LimitResponse};
use crate::api::check::{check_error, parse_cost, secs_ceil, subject};
use crate::api::problem::{problem_response, ApiError, ApiJson, Problem, QUOTA_EXCEEDED_TYPE};
use crate::api::state::AppState;
use crate::decision::holds::{Held, HoldAsk, HoldError, HoldId, HoldVerdict, Relayed, Settlement};
use quota_store::Settled;

/// A hold to make.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HoldBody {
    /// The tenant id. Exactly one of `tenant` and `identity`.
    #[serde(default)]
    pub tenant: Option<String>,
    /// A raw identity, hashed with the identity key as a check's.
    #[serde(default)]
    pub identity: Option<String>,
    /// The policy: a token budget or a concurrency limit. Exactly one of `policy` and
    /// `policies`.
    #[serde(default)]
    pub policy: Option<String>,
    /// Several token budgets of the subject, held at once, all or nothing.
    #[serde(default)]
    pub policies: Option<Vec<String>>,
    /// The estimate in whole tokens (default 1; a concurrency limit takes 1 slot).
    #[serde(default)]
    #[schema(value_type = Option<u64>)]
    pub cost: Option<f64>,
    /// How long the hold lives unsettled, in ms: default 60 000 (a concurrency limit's
    /// `window_ms`), at most 3 600 000 (the `window_ms`).
    #[serde(default)]
    #[schema(value_type = Option<u64>)]
    pub ttl_ms: Option<f64>,
    /// Names the hold, so a retry is the same hold (1 to 64 of `[A-Za-z0-9_-]`).
    #[serde(default)]
    pub id: Option<String>,
}

/// A hold's decision.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct HoldResponse {
    /// The id to settle or release the hold by (absent when denied).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold_id: Option<String>,
    /// True when every policy admitted the estimate (then it is held on each).
    pub allowed: bool,
    /// The fewest whole tokens (or free slots) left.
    pub remaining: u64,
    /// Milliseconds until every policy admits the estimate (0 when allowed).
    pub retry_after_ms: u64,
    /// Milliseconds until every bucket is full.
    pub reset_ms: u64,
    /// How long the hold lives unsettled, in ms.
    pub ttl_ms: u64,
    /// The same hold was made before under this `id`: nothing changed.
    pub replayed: bool,
    pub region: String,
    /// The region whose store holds it.
    pub decided_by: String,
    /// The policies that denied the hold (empty when allowed).
    pub violated_policies: Vec<String>,
    /// Each policy's decision, in the order named.
    pub limits: Vec<LimitResponse>,
}

/// A denied hold: the problem body plus the decision fields.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct HoldRateLimitedProblem {
    #[serde(flatten)]
    pub problem: Problem,
    #[serde(flatten)]
    pub decision: HoldResponse,
}

/// A settle's actual cost.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SettleBody {
    /// The actual cost in whole tokens, 0 or more (ignored for a concurrency slot).
    #[schema(value_type = u64)]
    pub cost: f64,
    /// Optional: the tenant the caller means; a hold id of another tenant is refused.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Optional: the same, as a raw identity.
    #[serde(default)]
    pub identity: Option<String>,
}

/// What a settle or release did to one policy.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SettledLimitResponse {
    pub policy: String,
    /// Tokens of the excess over the estimate taken, into debt.
    pub charged: u64,
    /// Tokens of the excess the debt limit held back.
    pub clamped: u64,
    /// Tokens given back (the estimate above the actual cost; the whole estimate on release).
    pub refunded: u64,
    /// Whole tokens (free slots) left.
    pub remaining: u64,
    /// Whole tokens owed.
    pub debt: u64,
}

/// A settled or released hold.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SettleResponse {
    pub hold_id: String,
    /// `settled` or `released`.
    pub state: &'static str,
    /// The same settle or release was applied before: nothing changed.
    pub replayed: bool,
    pub limits: Vec<SettledLimitResponse>,
    pub region: String,
    /// The region whose store held it.
    pub settled_by: String,
}

fn parse_ttl(ttl: Option<f64>) -> Result<Option<u64>, ApiError> {
    match ttl {
        None => Ok(None),
        Some(t) if t.fract() == 0.0 && (1.0..=9.0e15).contains(&t) => Ok(Some(t as u64)),
        Some(t) => Err(ApiError::field(
            "ttl_ms",
            &format!("must be a whole number of ms, at least 1 (got {t})"),
        )),
    }
}

fn hold_error(e: HoldError) -> ApiError {
    match e {
        HoldError::Check(e) => check_error(e),
        HoldError::Field { field, message } => ApiError::field(field, &message),
        HoldError::Conflict(detail) => ApiError::Conflict { detail },
    }
}

/// Holds an estimate (or a concurrency slot) on a subject's policies, all or nothing.
#[utoipa::path(
    post,
    path = "/v1/holds",
    request_body = HoldBody,
    responses(
        (status = 200, description = "Held", body = HoldResponse),
        (status = 429, description = "Denied: nothing held", body = HoldRateLimitedProblem),
        (status = 400, description = "Invalid hold: nothing held", body = Problem),
        (status = 404, description = "No such policy for the subject", body = Problem),
        (status = 409, description = "Not holdable (a sliding window, shadow mode, policies of several regions) or the id names another hold: nothing held", body = Problem),
        (status = 503, description = "The store or the home region did not answer: retry with the same id", body = Problem),
    ),
    security(("bearer" = ["check"])),
    tag = "decisions"
)]
pub async fn hold(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<HoldBody>,
) -> Result<Response, ApiError> {
    let forwarded = auth::is_forwarded(&state, &headers);
    let tenant = subject(
        &state,
        body.tenant.as_deref(),
        body.identity.as_deref(),
        forwarded,
    )?;
    let names = match (body.policy, body.policies) {
        (Some(p), None) => vec![p],
        (None, Some(ps)) => ps,
        (Some(_), Some(_)) => {
            return Err(ApiError::field(
                "policies",
                &"name either `policy` or `policies`, not both",
            ))
        }
        (None, None) => return Err(ApiError::field("policy", &"required: the policy to hold")),
    };
    let policies = names
        .into_iter()
        .map(|n| PolicyName::new(n).map_err(|e| ApiError::field("policy", &e)))
        .collect::<Result<Vec<_>, _>>()?;
    let cost = parse_cost(body.cost)?;
    if cost > quota_store::MAX_COST {
        return Err(ApiError::field(
            "cost",
            &format!("must be at most {} (got {cost})", quota_store::MAX_COST),
        ));
    }
    if let Some(id) = &body.id {
        crate::decision::holds::check_key(id).map_err(|e| ApiError::field("id", &e))?;
    }
    let ask = HoldAsk {
        tenant,
        policies,
        cost,
        ttl_ms: parse_ttl(body.ttl_ms)?,
        key: body.id,
    };
    let region = state.decider.region().as_str().to_string();
    match state
        .decider
        .hold(ask, forwarded)
        .await
        .map_err(hold_error)?
    {
        Held::Decided(v) => Ok(decided(&v, region)),
        Held::Relayed(r) => Ok(relayed(r)),
        Held::HomeUnreachable(_) => Err(ApiError::Unavailable {
            reason: "the home region of this budget did not take the hold: nothing held; retry \
                     with the same id"
                .into(),
        }),
        Held::Unavailable => Err(ApiError::Unavailable {
            reason: "the regional store did not take the hold: retry with the same id".into(),
        }),
    }
}

fn decided(v: &HoldVerdict, region: String) -> Response {
    let limits: Vec<LimitResponse> = v.limits.iter().map(limit_response).collect();
    let violated: Vec<String> = limits
        .iter()
        .filter(|l| !l.allowed)
        .map(|l| l.policy.clone())
        .collect();
    let r = HoldResponse {
        hold_id: v.held.then(|| v.id.to_string()),
        allowed: v.held,
        remaining: limits.iter().map(|l| l.remaining).min().unwrap_or(0),
        retry_after_ms: limits.iter().map(|l| l.retry_after_ms).max().unwrap_or(0),
        reset_ms: limits.iter().map(|l| l.reset_ms).max().unwrap_or(0),
        ttl_ms: v.ttl_ms,
        replayed: v.replayed,
        region,
        decided_by: v.id.region.as_str().to_string(),
        violated_policies: violated.clone(),
        limits,
    };
    if r.allowed {
        return axum::Json(r).into_response();
    }
    let retry = r.retry_after_ms;
    let problem = HoldRateLimitedProblem {
        problem: Problem {
            type_: QUOTA_EXCEEDED_TYPE.to_string(),
            title: "Quota exceeded".to_string(),
            status: 429,
            detail: format!(
                "{} cannot hold this estimate now: nothing held",
                violated.join(", ")
            ),
            code: "RATE_LIMITED".to_string(),
            errors: Vec::new(),
            violated_policies: violated,
        },
        decision: r,
    };
    let mut resp = problem_response(StatusCode::TOO_MANY_REQUESTS, &problem);
    resp.headers_mut().insert(
        header::RETRY_AFTER,
        HeaderValue::from(secs_ceil(retry).max(1)),
    );
    resp
}

/// Another region's answer as it gave it (a 429 with its Retry-After).
fn relayed(r: Relayed) -> Response {
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_GATEWAY);
    if status == StatusCode::OK {
        return axum::Json(r.body).into_response();
    }
    let mut resp = problem_response(status, &r.body);
    if status == StatusCode::TOO_MANY_REQUESTS {
        let retry = r.body["retry_after_ms"].as_u64().unwrap_or(1000);
        resp.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(secs_ceil(retry).max(1)),
        );
    }
    resp
}

fn parse_hold_id(id: &str) -> Result<HoldId, ApiError> {
    HoldId::parse(id).map_err(|e| ApiError::field("id", &e))
}

/// Settles a hold at its actual cost: the estimate above it is given back, the excess is
/// charged into the policy's debt limit.
#[utoipa::path(
    post,
    path = "/v1/holds/{id}/settle",
    params(("id" = String, Path, description = "The hold id")),
    request_body = SettleBody,
    responses(
        (status = 200, description = "Settled (or settled before at this cost: `replayed`)", body = SettleResponse),
        (status = 400, description = "Invalid settle (a hold id of another tenant, a cost out of range): nothing changed", body = Problem),
        (status = 404, description = "No such hold: never made, or ended over 10 minutes ago", body = Problem),
        (status = 409, description = "Expired, released, or settled at another cost: nothing changed", body = Problem),
        (status = 503, description = "The store or the hold's region did not answer: nothing changed; retry", body = Problem),
    ),
    security(("bearer" = ["check"])),
    tag = "decisions"
)]
pub async fn settle(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<SettleBody>,
) -> Result<Response, ApiError> {
    let forwarded = auth::is_forwarded(&state, &headers);
    let id = parse_hold_id(&id)?;
    if body.tenant.is_some() || body.identity.is_some() {
        let tenant = subject(
            &state,
            body.tenant.as_deref(),
            body.identity.as_deref(),
            forwarded,
        )?;
        same_tenant(&id, &tenant)?;
    }
    let cost = match body.cost {
        c if c.fract() == 0.0 && (0.0..=quota_store::MAX_COST as f64).contains(&c) => c as u64,
        c => {
            return Err(ApiError::field(
                "cost",
                &format!(
                    "must be a whole number from 0 to {} (got {c})",
                    quota_store::MAX_COST
                ),
            ))
        }
    };
    settled(&state, &id, Some(cost), forwarded).await
}

/// Releases a hold: its estimate (or slot) is given back.
#[utoipa::path(
    delete,
    path = "/v1/holds/{id}",
    params(("id" = String, Path, description = "The hold id")),
    responses(
        (status = 200, description = "Released (or released before: `replayed`)", body = SettleResponse),
        (status = 400, description = "Not a hold id: nothing changed", body = Problem),
        (status = 404, description = "No such hold: never made, or ended over 10 minutes ago", body = Problem),
        (status = 409, description = "Expired or settled: nothing changed", body = Problem),
        (status = 503, description = "The store or the hold's region did not answer: nothing changed; retry", body = Problem),
    ),
    security(("bearer" = ["check"])),
    tag = "decisions"
)]
pub async fn release(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let forwarded = auth::is_forwarded(&state, &headers);
    let id = parse_hold_id(&id)?;
    settled(&state, &id, None, forwarded).await
}

/// Releases a hold, as `DELETE /v1/holds/{id}` does (for clients, and relays between
/// regions, that send only POST).
#[utoipa::path(
    post,
    path = "/v1/holds/{id}/release",
    params(("id" = String, Path, description = "The hold id")),
    responses(
        (status = 200, description = "Released (or released before: `replayed`)", body = SettleResponse),
        (status = 400, description = "Not a hold id: nothing changed", body = Problem),
        (status = 404, description = "No such hold: never made, or ended over 10 minutes ago", body = Problem),
        (status = 409, description = "Expired or settled: nothing changed", body = Problem),
        (status = 503, description = "The store or the hold's region did not answer: nothing changed; retry", body = Problem),
    ),
    security(("bearer" = ["check"])),
    tag = "decisions"
)]
pub async fn release_by_post(
    state: State<AppState>,
    headers: HeaderMap,
    id: Path<String>,
) -> Result<Response, ApiError> {
    release(state, headers, id).await
}

fn same_tenant(id: &HoldId, tenant: &TenantId) -> Result<(), ApiError> {
    if id.tenant != *tenant {
        return Err(ApiError::field(
            "id",
            &"names a hold of another tenant than the request's",
        ));
    }
    Ok(())
}

async fn settled(
    state: &AppState,
    id: &HoldId,
    cost: Option<u64>,
    forwarded: bool,
) -> Result<Response, ApiError> {
    let out = state
        .decider
        .settle(id, cost, forwarded)
        .await
        .map_err(hold_error)?;
    let what = if cost.is_some() {
        "settled"
    } else {
        "released"
    };
    match out {
        Settlement::Here(Settled::Done { limits, replayed }) => Ok(axum::Json(SettleResponse {
            hold_id: id.to_string(),
            state: what,
            replayed,
            limits: limits
                .into_iter()
                .map(|l| SettledLimitResponse {
                    policy: l.bucket.policy.as_str().to_string(),
                    charged: l.charged,
                    clamped: l.clamped,
                    refunded: l.refunded,
                    remaining: l.remaining,
                    debt: l.debt,
                })
                .collect(),
            region: state.decider.region().as_str().to_string(),
            settled_by: id.region.as_str().to_string(),
        })
        .into_response()),
        Settlement::Here(Settled::Unknown) => Err(ApiError::NotFound {
            what: "hold (never made, or ended over 10 minutes ago)",
        }),
        Settlement::Here(Settled::Expired { .. }) => Err(ApiError::Conflict {
            detail: "the hold expired unsettled: a token budget's estimate stayed spent, a \
                     concurrency slot came back; nothing changed"
                .into(),
        }),
        Settlement::Here(Settled::Conflict(detail)) => Err(ApiError::Conflict { detail }),
        Settlement::Relayed(r) => Ok(relayed(r)),
        Settlement::RegionUnreachable(_) => Err(ApiError::Unavailable {
            reason: format!("the hold's region did not answer: nothing {what}; retry"),
        }),
        Settlement::Unavailable => Err(ApiError::Unavailable {
            reason: format!("the regional store did not answer: nothing {what}; retry"),
        }),
    }
}

#[cfg(test)]
mod tests;
