//! Per-tenant endpoints: policies, pins and the allowance (where a tenant's budget is and what
//! this region may spend of it).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use quota_core::bucket::UT;
use quota_core::{
    Algorithm, FailMode, Policy, PolicyName, PolicySpec, RegionId, TenantId, Tier, PPM,
};
use serde::{Deserialize, Serialize};

use crate::api::auth::Versions;
use crate::api::problem::{ApiError, ApiJson, ApiPath, FieldProblem, Problem};
use crate::api::state::AppState;
use quota_store::{BucketRef, Limit};

use crate::clock;
use crate::coordination::{tenant_policies, CoordError};
use crate::decision::{exposure, is_embedded};

/// A tenant id as a client may name it: valid, and not reserved (an identity's hash or an
/// internal subject), so a crafted tenant id can never alias an identity or a plan.
pub(crate) fn tenant_id(s: &str) -> Result<TenantId, ApiError> {
    client_tenant(TenantId::new(s).map_err(|e| ApiError::field("tenant", &e))?)
}

/// Refuses a reserved tenant id.
pub(crate) fn client_tenant(t: TenantId) -> Result<TenantId, ApiError> {
    match t.reserved() {
        None => Ok(t),
        Some(quota_core::ids::Reserved::Identity) => Err(ApiError::field(
            "tenant",
            &"ids of the form h-<32 hex digits> are reserved for identities: send the raw value as `identity`",
        )),
        Some(quota_core::ids::Reserved::Internal) => Err(ApiError::field(
            "tenant",
            &"ids starting with \"--\" are reserved",
        )),
    }
}

pub(crate) fn policy_name(s: &str) -> Result<PolicyName, ApiError> {
    PolicyName::new(s).map_err(|e| ApiError::field("policy", &e))
}

pub(crate) fn coord_error(e: CoordError) -> ApiError {
    match e {
        CoordError::InvalidPolicies { entries, total } => {
            refused_policies(&entries, total, |_| String::new())
        }
        CoordError::InvalidAssignments { .. } => ApiError::field("plan", &e),
        CoordError::UnknownRegion { .. } => ApiError::field("region", &e),
        CoordError::UnknownPlan => ApiError::UnknownField {
            field: "plan".into(),
            message: "no such plan".into(),
        },
        CoordError::InvalidPlan { field } => ApiError::field(field, &"refused by the coordinator"),
        CoordError::Unavailable { reason } => ApiError::CoordinatorUnavailable { reason },
        CoordError::UnknownNode { .. } => ApiError::NotFound { what: "member" },
        CoordError::NotClustered | CoordError::NotLeader { .. } | CoordError::Rejected { .. } => {
            ApiError::Conflict {
                detail: e.to_string(),
            }
        }
    }
}

/// Policies the coordinator refused, as field problems; `prefix` names an entry's place
/// (e.g. `policies[3].`) by its index. Entries past those listed are counted in one more.
pub(crate) fn refused_policies(
    entries: &[quota_core::coordinator::InvalidEntry],
    total: u32,
    prefix: impl Fn(u32) -> String,
) -> ApiError {
    let mut errors: Vec<FieldProblem> = entries
        .iter()
        .flat_map(|e| {
            let at = prefix(e.index);
            e.fields.iter().map(move |field| FieldProblem {
                field: format!("{at}{field}"),
                message: match field.as_str() {
                    "floor" => "every floor-reserving region reserves this floor: together they would exceed the whole budget".into(),
                    _ => "refused by the coordinator".into(),
                },
            })
        })
        .collect();
    if total as usize > entries.len() {
        errors.push(FieldProblem {
            field: "policies".into(),
            message: format!(
                "{} more entries are refused (the first {} are listed)",
                total as usize - entries.len(),
                entries.len()
            ),
        });
    }
    ApiError::InvalidPolicy { errors }
}

/// The policy body of PUT (documentation mirror of `quota_core::PolicySpec`).
#[derive(Debug, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct PolicyBody {
    /// Tokens per window.
    limit: u64,
    window_ms: u64,
    /// Bucket capacity; defaults to `limit`.
    burst: Option<u64>,
    /// `standard` or `critical`.
    tier: Option<String>,
    /// `local` (default), `open` or `closed`.
    fail_mode: Option<String>,
    /// Fraction of the budget reserved for each region even when it is cut off.
    floor: Option<f64>,
    /// `token_bucket` (default) or `sliding_window`.
    algorithm: Option<String>,
    /// `enforcing` (default) or `shadow`: a shadow policy is decided and counted but always
    /// admits, marking a would-be denial `shadow_denied`.
    mode: Option<String>,
    /// Tokens a charge for work already done may take the bucket below empty, 0 (default) to
    /// the burst; beyond it a charge is clamped (and counted).
    debt_limit: Option<u64>,
    /// Costs are known after the fact: an Envoy RLS descriptor with hits is a charge (default
    /// false).
    after_the_fact: Option<bool>,
}

/// A policy as stored.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PolicyView {
    pub tenant: String,
    pub policy: String,
    pub limit: u64,
    pub window_ms: u64,
    pub burst: u64,
    pub version: u64,
    #[schema(value_type = String)]
    pub tier: Tier,
    #[schema(value_type = String)]
    pub fail_mode: FailMode,
    pub floor: f64,
    #[schema(value_type = String)]
    pub algorithm: Algorithm,
    #[schema(value_type = String)]
    pub mode: quota_core::PolicyMode,
    pub debt_limit: u64,
    pub after_the_fact: bool,
}

impl PolicyView {
    pub fn new(tenant: &TenantId, name: &PolicyName, p: &Policy) -> Self {
        Self {
            tenant: tenant.as_str().to_string(),
            policy: name.as_str().to_string(),
            limit: p.limit,
            window_ms: p.window_ms,
            burst: p.burst,
            version: p.version,
            tier: p.tier,
            fail_mode: p.fail_mode,
            floor: f64::from(p.floor_ppm) / f64::from(PPM),
            algorithm: p.algorithm,
            mode: p.mode,
            debt_limit: p.debt_limit,
            after_the_fact: p.after_the_fact,
        }
    }
}

/// Creates or replaces a tenant's policy.
#[utoipa::path(
    put,
    path = "/v1/tenants/{tenant}/policies/{policy}",
    params(("tenant" = String, Path), ("policy" = String, Path)),
    request_body = PolicyBody,
    responses(
        (status = 200, description = "Stored", body = PolicyView),
        (status = 400, description = "Invalid policy: every field problem listed", body = Problem),
    ),
    security(("bearer" = ["admin"])),
    tag = "policies"
)]
pub async fn put_policy(
    State(state): State<AppState>,
    ApiPath((tenant, policy)): ApiPath<(String, String)>,
    ApiJson(spec): ApiJson<PolicySpec>,
) -> Result<(Extension<Versions>, axum::Json<PolicyView>), ApiError> {
    let tenant = tenant_id(&tenant)?;
    let name = policy_name(&policy)?;
    let p = spec.validate().map_err(|e| ApiError::InvalidPolicy {
        errors: e.0.iter().map(FieldProblem::from).collect(),
    })?;
    let before = state
        .coordinator
        .view()
        .policy(&tenant, &name)
        .map(|e| e.policy.version);
    let stored = state
        .coordinator
        .put_policy(tenant.clone(), name.clone(), p)
        .await
        .map_err(coord_error)?;
    tracing::info!(tenant = %tenant, policy = %name, version = stored.version, "Policy stored.");
    let versions = Versions {
        before,
        after: Some(stored.version),
    };
    Ok((
        Extension(versions),
        axum::Json(PolicyView::new(&tenant, &name, &stored)),
    ))
}

/// Reads a tenant's policy.
#[utoipa::path(
    get,
    path = "/v1/tenants/{tenant}/policies/{policy}",
    params(("tenant" = String, Path), ("policy" = String, Path)),
    responses(
        (status = 200, description = "The policy", body = PolicyView),
        (status = 404, description = "No such policy", body = Problem),
    ),
    security(("bearer" = ["read"])),
    tag = "policies"
)]
pub async fn get_policy(
    State(state): State<AppState>,
    ApiPath((tenant, policy)): ApiPath<(String, String)>,
) -> Result<axum::Json<PolicyView>, ApiError> {
    let tenant = tenant_id(&tenant)?;
    let name = policy_name(&policy)?;
    let view = state.coordinator.view();
    let entry = view
        .policy(&tenant, &name)
        .ok_or(ApiError::NotFound { what: "policy" })?;
    Ok(axum::Json(PolicyView::new(&tenant, &name, &entry.policy)))
}

/// Deletes a tenant's policy.
#[utoipa::path(
    delete,
    path = "/v1/tenants/{tenant}/policies/{policy}",
    params(("tenant" = String, Path), ("policy" = String, Path)),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such policy", body = Problem),
    ),
    security(("bearer" = ["admin"])),
    tag = "policies"
)]
pub async fn delete_policy(
    State(state): State<AppState>,
    ApiPath((tenant, policy)): ApiPath<(String, String)>,
) -> Result<(Extension<Versions>, StatusCode), ApiError> {
    let tenant = tenant_id(&tenant)?;
    let name = policy_name(&policy)?;
    let before = state
        .coordinator
        .view()
        .policy(&tenant, &name)
        .map(|e| e.policy.version);
    if state
        .coordinator
        .delete_policy(tenant.clone(), name.clone())
        .await
        .map_err(coord_error)?
    {
        tracing::info!(tenant = %tenant, policy = %name, "Policy deleted.");
        let versions = Versions {
            before,
            after: None,
        };
        Ok((Extension(versions), StatusCode::NO_CONTENT))
    } else {
        Err(ApiError::NotFound { what: "policy" })
    }
}

/// The body of PUT /v1/tenants/{tenant}/pin.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PinBody {
    /// The home region.
    pub region: String,
}

/// Pins a tenant to a home region: other regions forward its checks there. The pin covers the
/// tenant's policies present and future, so a tenant may be pinned before it has any.
#[utoipa::path(
    put,
    path = "/v1/tenants/{tenant}/pin",
    params(("tenant" = String, Path)),
    request_body = PinBody,
    responses(
        (status = 204, description = "Pinned"),
        (status = 400, description = "Invalid or unknown region", body = Problem),
    ),
    security(("bearer" = ["admin"])),
    tag = "pins"
)]
pub async fn put_pin(
    State(state): State<AppState>,
    ApiPath(tenant): ApiPath<String>,
    ApiJson(body): ApiJson<PinBody>,
) -> Result<StatusCode, ApiError> {
    let tenant = tenant_id(&tenant)?;
    let region = RegionId::new(body.region).map_err(|e| ApiError::field("region", &e))?;
    state
        .coordinator
        .pin(tenant.clone(), region.clone())
        .await
        .map_err(coord_error)?;
    tracing::info!(tenant = %tenant, home = %region, "Tenant pinned.");
    Ok(StatusCode::NO_CONTENT)
}

/// Removes a tenant's pin.
#[utoipa::path(
    delete,
    path = "/v1/tenants/{tenant}/pin",
    params(("tenant" = String, Path)),
    responses(
        (status = 204, description = "Unpinned"),
        (status = 404, description = "Not pinned", body = Problem),
    ),
    security(("bearer" = ["admin"])),
    tag = "pins"
)]
pub async fn delete_pin(
    State(state): State<AppState>,
    ApiPath(tenant): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    let tenant = tenant_id(&tenant)?;
    if state.coordinator.unpin(tenant).await.map_err(coord_error)? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound { what: "pin" })
    }
}

/// One region's grant.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RegionShareView {
    pub region: String,
    pub share: f64,
    /// Wall-clock ms; `null` for a lease that never expires (single region).
    pub lease_expires_ms: Option<u64>,
}

/// What this region enforces for a policy.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ThisRegionView {
    pub region: String,
    /// The granted share.
    pub share: f64,
    /// The share enforced now: the granted one under a live lease, the floor after.
    pub enforced_share: f64,
    pub capacity: f64,
    pub refill_per_s: f64,
    /// Whole tokens left in this region's bucket now (read without spending, from the store
    /// deciding now: Redis, or the in-process bucket while Redis is down); `null` if it could
    /// not be read.
    pub tokens_left: Option<u64>,
    /// Whole tokens owed below empty by charges of work already done (`debt_limit`): checks
    /// are denied until the refill has repaid them. Read from the time the bucket needs to be
    /// full, so exact within one millisecond of refill; `null` when not read.
    pub debt: Option<u64>,
    pub lease_remaining_ms: Option<u64>,
}

/// Whole tokens a bucket read as `d` owes below empty: what its time to full refills beyond
/// its capacity, less one millisecond of refill (the time is a ceiling, so an empty bucket
/// refills up to that much past its capacity), rounded up.
fn debt_of(limit: &Limit, d: &quota_core::Decision) -> u64 {
    let (Limit::TokenBucket(b), Some(ms)) = (limit, d.reset_ms) else {
        return 0;
    };
    if d.remaining > 0 || b.refill_ut == 0 {
        return 0;
    }
    let (rate, period) = (u128::from(b.refill_ut), u128::from(b.period_ms));
    let refilled = u128::from(ms) * rate / period;
    let one_ms = rate.div_ceil(period);
    let owed = refilled.saturating_sub(u128::from(b.capacity_ut) + one_ms);
    u64::try_from(owed.div_ceil(u128::from(UT))).unwrap_or(u64::MAX)
}

/// One policy's allowance.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PolicyAllowance {
    pub policy: String,
    /// The global budget.
    pub limit: u64,
    pub window_ms: u64,
    pub burst: u64,
    pub floor: f64,
    /// `split`: shares in every region, moved towards demand. `home`: too small (or too slow
    /// to refill) to split, the budget lives whole in `home` and the other regions forward
    /// their checks there.
    #[schema(example = "split")]
    pub mode: &'static str,
    /// The region deciding this policy's checks when it is pinned (by an operator, as a
    /// critical tenant, or in `home` mode); `null` when every region decides its own.
    pub home: Option<String>,
    pub this_region: ThisRegionView,
    pub regions: Vec<RegionShareView>,
    /// If this region were cut off now, or its Redis went out: tokens it could admit beyond
    /// what the global bucket allows, in the worst case (see the handler's docs).
    pub worst_case_overshoot_tokens: f64,
}

/// A tenant's allowance over all its policies.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct AllowanceView {
    pub tenant: String,
    pub pin: Option<String>,
    pub policies: Vec<PolicyAllowance>,
}

/// A tenant's global budgets and where they are.
///
/// The worst-case overshoot if this region were cut off, or lost its Redis, now: see
/// `decision::exposure`.
#[utoipa::path(
    get,
    path = "/v1/tenants/{tenant}/allowance",
    params(("tenant" = String, Path)),
    responses(
        (status = 200, description = "The allowance", body = AllowanceView),
        (status = 404, description = "The tenant has no policies", body = Problem),
    ),
    security(("bearer" = ["read"])),
    tag = "policies"
)]
pub async fn allowance(
    State(state): State<AppState>,
    ApiPath(tenant): ApiPath<String>,
) -> Result<Response, ApiError> {
    let tenant = tenant_id(&tenant)?;
    let view = state.coordinator.view();
    let region = state.decider.region().clone();
    let now_ms = clock::wall_ms();
    let margin_ms = state.drift_margin_ms;
    // A region's lease end, `None` when it never ends (a single region) or is unknown.
    let lease_of = |r: &RegionId| {
        view.region_leases
            .get(r)
            .copied()
            .filter(|&exp| exp != u64::MAX)
    };
    let mut policies = Vec::new();
    for ((t, name), entry) in tenant_policies(&view.policies, &tenant) {
        let p = &entry.policy;
        let Some((_, enforced, limit)) = state.decider.params_for(&view, t, name) else {
            continue;
        };
        let bucket = BucketRef {
            tenant: t.clone(),
            policy: name.clone(),
            version: p.version,
        };
        let level = state.decider.peek(bucket, limit).await;
        let tokens_left = level.map(|d| d.remaining);
        let debt = level.map(|d| debt_of(&limit, &d));
        let grant = entry.grants.get(&region);
        let share = grant.map_or(0, |g| g.share_ppm);
        let frac = |ppm: u32| f64::from(ppm) / f64::from(PPM);
        let (capacity, refill_per_s) = match limit {
            Limit::TokenBucket(b) => (b.capacity_ut as f64 / UT as f64, b.refill_tokens_per_s()),
            Limit::SlidingWindow { limit, window_ms } => {
                (limit as f64, limit as f64 * 1000.0 / window_ms as f64)
            }
            // Slots do not refill: they come back with their holds.
            Limit::Concurrency { limit } => (limit as f64, 0.0),
        };
        // A lease that never ends (a single region) is never reused elsewhere: nothing to spend
        // twice.
        let leased = grant.is_some() && lease_of(&region).is_some();
        let overshoot = exposure::worst_case_overshoot_tokens(
            p,
            enforced,
            &limit,
            leased,
            margin_ms,
            is_embedded(state.decider.store()),
        );
        policies.push(PolicyAllowance {
            policy: name.as_str().to_string(),
            limit: p.limit,
            window_ms: p.window_ms,
            burst: p.burst,
            floor: frac(p.floor_ppm),
            mode: entry.mode.as_str(),
            home: entry.home.as_ref().map(|r| r.as_str().to_string()),
            this_region: ThisRegionView {
                region: region.as_str().to_string(),
                share: frac(share),
                enforced_share: frac(enforced),
                capacity,
                refill_per_s,
                tokens_left,
                debt,
                lease_remaining_ms: grant
                    .and(lease_of(&region))
                    .map(|exp| exp.saturating_sub(now_ms)),
            },
            regions: entry
                .grants
                .iter()
                .map(|(r, g)| RegionShareView {
                    region: r.as_str().to_string(),
                    share: frac(g.share_ppm),
                    lease_expires_ms: lease_of(r),
                })
                .collect(),
            worst_case_overshoot_tokens: overshoot,
        });
    }
    if policies.is_empty() {
        return Err(ApiError::NotFound { what: "tenant" });
    }
    let body = AllowanceView {
        tenant: tenant.as_str().to_string(),
        pin: view.tenant_home(&tenant).map(|r| r.as_str().to_string()),
        policies,
    };
    Ok(axum::Json(body).into_response())
}
