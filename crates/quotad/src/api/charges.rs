//! POST /v1/charges: a charge for work already done (costs known after the fact, such as the
//! tokens an LLM produced), applied even past the tokens left, into the policy's
//! `debt_limit` below empty, never denied. docs/api.md is the reference.

use axum::extract::State;
use axum::http::HeaderMap;
use quota_core::PolicyName;
use serde::{Deserialize, Serialize};

use crate::api::check::{check_error, parse_cost, subject};
use crate::api::problem::{ApiError, ApiJson, Problem};
use crate::api::state::AppState;
use crate::decision::{Charged, FORWARDED_HEADER};

/// One charge.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChargeBody {
    /// The tenant id. Exactly one of `tenant` and `identity`.
    #[serde(default)]
    pub tenant: Option<String>,
    /// A raw identity, hashed with the identity key as a check's.
    #[serde(default)]
    pub identity: Option<String>,
    /// The policy name (a token bucket).
    pub policy: String,
    /// Tokens the work cost: a whole number ≥ 1. Beyond the tokens left and the debt limit,
    /// the rest is clamped and reported.
    #[schema(value_type = u64)]
    pub cost: f64,
    /// Names the charge, so a retry applies it once (1 to 128 printable ASCII characters, no
    /// space; kept for 10 s): retry with the same id after a lost answer or a 503.
    #[serde(default)]
    pub id: Option<String>,
}

/// What a charge did.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ChargeResponse {
    /// Tokens taken from the bucket.
    pub applied: u64,
    /// Tokens the debt limit held back (`applied + clamped` is the cost).
    pub clamped: u64,
    /// Whole tokens left; 0 in debt.
    pub remaining: u64,
    /// Whole tokens owed; while above 0, checks are denied.
    pub debt: u64,
    /// Milliseconds until a check of one token is admitted, the repayment included.
    pub retry_after_ms: u64,
    /// Milliseconds until the bucket is full.
    pub reset_ms: u64,
    /// The region that answered.
    pub region: String,
    /// The region whose bucket was charged (the home region for a pinned tenant).
    pub charged_by: String,
}

/// Most bytes of a charge id.
const MAX_ID_LEN: usize = quota_store::MAX_CHARGE_ID_LEN;

fn parse_id(id: Option<String>) -> Result<Option<String>, ApiError> {
    match id {
        Some(id)
            if id.is_empty()
                || id.len() > MAX_ID_LEN
                || !id.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            Err(ApiError::field(
                "id",
                &format!("must be 1 to {MAX_ID_LEN} printable ASCII characters, no space"),
            ))
        }
        id => Ok(id),
    }
}

/// Charges work already done to a subject's token bucket, into its policy's debt limit.
#[utoipa::path(
    post,
    path = "/v1/charges",
    request_body = ChargeBody,
    responses(
        (status = 200, description = "Applied (what the debt limit held back in `clamped`)", body = ChargeResponse),
        (status = 400, description = "Invalid charge: nothing applied", body = Problem),
        (status = 404, description = "No such policy for the subject", body = Problem),
        (status = 409, description = "The id names a charge of another cost, or the policy is a sliding window: nothing applied", body = Problem),
        (status = 503, description = "The store or the home region did not answer: nothing applied; retry with the same id", body = Problem),
    ),
    security(("bearer" = ["check"])),
    tag = "decisions"
)]
pub async fn charge(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<ChargeBody>,
) -> Result<axum::Json<ChargeResponse>, ApiError> {
    let forwarded = state
        .decider
        .is_peer_forward(headers.get(&FORWARDED_HEADER).and_then(|v| v.to_str().ok()));
    let tenant = subject(
        &state,
        body.tenant.as_deref(),
        body.identity.as_deref(),
        forwarded,
    )?;
    let policy = PolicyName::new(body.policy).map_err(|e| ApiError::field("policy", &e))?;
    let cost = parse_cost(Some(body.cost))?;
    // The store's exact range: a larger cost could not be told apart from a clamped one.
    if cost > quota_store::MAX_COST {
        return Err(ApiError::field(
            "cost",
            &format!("must be at most {} (got {cost})", quota_store::MAX_COST),
        ));
    }
    let id = parse_id(body.id)?;
    let out = state
        .decider
        .charge(&tenant, &policy, cost, id, forwarded)
        .await
        .map_err(check_error)?;
    let region = state.decider.region().as_str().to_string();
    match out {
        Charged::Applied { outcome, by } => {
            // "Never" at these parameters is reported as one window, as a check's is.
            let window = state
                .decider
                .params_for(&state.decider.view(), &tenant, &policy)
                .map_or(0, |(p, _, _)| p.window_ms);
            Ok(axum::Json(ChargeResponse {
                applied: outcome.applied,
                clamped: outcome.clamped,
                remaining: outcome.remaining,
                debt: outcome.debt,
                retry_after_ms: outcome.retry_after_ms.unwrap_or(window),
                reset_ms: outcome.reset_ms.unwrap_or(window),
                region,
                charged_by: by.as_str().to_string(),
            }))
        }
        Charged::NotTokenBucket => Err(ApiError::Conflict {
            detail: "charges apply to token buckets; this policy is a sliding window".into(),
        }),
        Charged::IdReused => Err(ApiError::Conflict {
            detail: "this id names an earlier charge of another cost".into(),
        }),
        Charged::HomeUnreachable(_) => Err(ApiError::ReducedCapacity {
            policy: policy.as_str().to_string(),
            reason: "the home region of this budget did not take the charge: nothing applied; \
                     retry with the same id"
                .into(),
        }),
        Charged::Unavailable => Err(ApiError::ReducedCapacity {
            policy: policy.as_str().to_string(),
            reason: "the regional store did not take the charge: nothing applied; retry with \
                     the same id"
                .into(),
        }),
    }
}
