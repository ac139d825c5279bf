//! Plans: `PUT/GET/DELETE /v1/plans/{plan}`, the paged `GET /v1/plans`, and a tenant's plan
//! (`PUT/DELETE /v1/tenants/{tenant}/plan`). A plan's policies apply to every tenant assigned
//! to it, and the plan named `default` to every subject with neither a plan nor an explicit
//! policy of the name, so identities need no admin call before their first check.

use std::collections::BTreeMap;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::Extension;
use quota_core::{
    Algorithm, FailMode, PlanName, Policy, PolicyMode, PolicyName, PolicySpec, Tier, PPM,
};
use serde::{Deserialize, Serialize};

use crate::api::auth::Versions;
use crate::api::cluster::page_query;
use crate::api::problem::{bad_request, ApiError, ApiJson, ApiPath, FieldProblem, Problem};
use crate::api::state::AppState;
use crate::api::tenants::{coord_error, refused_policies, tenant_id, PolicyBody};

/// The body of PUT /v1/plans/{plan}.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PlanBody {
    /// The plan's policies by name, each the body of a policy PUT (at least one).
    #[schema(value_type = BTreeMap<String, PolicyBody>)]
    pub policies: BTreeMap<String, PolicySpec>,
}

/// One policy of a plan, as stored.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PlanPolicyView {
    pub limit: u64,
    pub window_ms: u64,
    pub burst: u64,
    /// Its allocation class's version: a change gives every subject fresh buckets.
    pub version: u64,
    #[schema(value_type = String)]
    pub tier: Tier,
    #[schema(value_type = String)]
    pub fail_mode: FailMode,
    pub floor: f64,
    #[schema(value_type = String)]
    pub algorithm: Algorithm,
    /// `enforcing` or `shadow`.
    #[schema(value_type = String)]
    pub mode: PolicyMode,
    pub debt_limit: u64,
    pub after_the_fact: bool,
}

impl From<&Policy> for PlanPolicyView {
    fn from(p: &Policy) -> Self {
        Self {
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

/// A plan as stored.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PlanView {
    pub plan: String,
    pub policies: BTreeMap<String, PlanPolicyView>,
}

/// One page of plans.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PlanPage {
    pub plans: Vec<PlanView>,
    /// Pass as `after` for the next page; absent on the last page.
    pub next: Option<String>,
}

/// The body of PUT /v1/tenants/{tenant}/plan, and its GET answer.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AssignBody {
    /// The plan's name; it must exist.
    pub plan: String,
}

fn plan_name(s: &str) -> Result<PlanName, ApiError> {
    PlanName::new(s).map_err(|e| ApiError::field("plan", &e))
}

fn plan_view(state: &AppState, plan: &PlanName) -> Option<PlanView> {
    let view = state.coordinator.view();
    let policies: BTreeMap<String, PlanPolicyView> = view
        .plan_policies(plan)
        .map(|(n, e)| (n.as_str().to_string(), PlanPolicyView::from(&e.policy)))
        .collect();
    (!policies.is_empty()).then(|| PlanView {
        plan: plan.as_str().to_string(),
        policies,
    })
}

/// Creates or replaces a plan in one step: every tenant assigned to it (and, for `default`,
/// every subject it covers) is held to the new policies at once.
#[utoipa::path(
    put,
    path = "/v1/plans/{plan}",
    params(("plan" = String, Path)),
    request_body = PlanBody,
    responses(
        (status = 200, description = "Stored", body = PlanView),
        (status = 400, description = "Invalid plan: every field problem listed", body = Problem),
    ),
    security(("bearer" = ["admin"])),
    tag = "plans"
)]
pub async fn put_plan(
    State(state): State<AppState>,
    ApiPath(plan): ApiPath<String>,
    ApiJson(body): ApiJson<PlanBody>,
) -> Result<(Extension<Versions>, axum::Json<PlanView>), ApiError> {
    let plan = plan_name(&plan)?;
    if body.policies.is_empty() {
        return Err(ApiError::field(
            "policies",
            &"a plan holds at least one policy",
        ));
    }
    let mut errors = Vec::new();
    let mut policies = Vec::with_capacity(body.policies.len());
    for (name, spec) in &body.policies {
        let at = format!("policies.{name}");
        match (PolicyName::new(name.as_str()), spec.validate()) {
            (Ok(n), Ok(p)) => policies.push((n, p)),
            (n, p) => {
                if let Err(e) = n {
                    errors.push(FieldProblem {
                        field: at.clone(),
                        message: e.to_string(),
                    });
                }
                if let Err(e) = p {
                    errors.extend(e.0.iter().map(|f| FieldProblem {
                        field: format!("{at}.{}", f.field),
                        message: f.message.clone(),
                    }));
                }
            }
        }
    }
    if !errors.is_empty() {
        return Err(ApiError::InvalidPolicy { errors });
    }
    let names: Vec<String> = policies
        .iter()
        .map(|(n, _)| n.as_str().to_string())
        .collect();
    let stored = state
        .coordinator
        .put_plan(plan.clone(), policies)
        .await
        .map_err(|e| match e {
            crate::coordination::CoordError::InvalidPolicies { entries, total } => {
                refused_policies(&entries, total, |i| {
                    format!(
                        "policies.{}.",
                        names.get(i as usize).cloned().unwrap_or_default()
                    )
                })
            }
            other => coord_error(other),
        })?;
    tracing::info!(plan = %plan, policies = stored.len(), "Plan stored.");
    let versions = Versions {
        before: None,
        after: stored.iter().map(|p| p.version).max(),
    };
    let view = PlanView {
        plan: plan.as_str().to_string(),
        policies: names
            .into_iter()
            .zip(&stored)
            .map(|(n, p)| (n, PlanPolicyView::from(p)))
            .collect(),
    };
    Ok((Extension(versions), axum::Json(view)))
}

/// Reads a plan.
#[utoipa::path(
    get,
    path = "/v1/plans/{plan}",
    params(("plan" = String, Path)),
    responses(
        (status = 200, description = "The plan", body = PlanView),
        (status = 400, description = "Invalid plan name", body = Problem),
        (status = 404, description = "No such plan", body = Problem),
    ),
    security(("bearer" = ["read"])),
    tag = "plans"
)]
pub async fn get_plan(
    State(state): State<AppState>,
    ApiPath(plan): ApiPath<String>,
) -> Result<axum::Json<PlanView>, ApiError> {
    let plan = plan_name(&plan)?;
    plan_view(&state, &plan)
        .map(axum::Json)
        .ok_or(ApiError::NotFound { what: "plan" })
}

/// Deletes a plan and its policies. Tenants assigned to it keep the assignment and fall back
/// to the `default` plan until a plan of that name is put again.
#[utoipa::path(
    delete,
    path = "/v1/plans/{plan}",
    params(("plan" = String, Path)),
    responses(
        (status = 204, description = "Deleted"),
        (status = 400, description = "Invalid plan name", body = Problem),
        (status = 404, description = "No such plan", body = Problem),
    ),
    security(("bearer" = ["admin"])),
    tag = "plans"
)]
pub async fn delete_plan(
    State(state): State<AppState>,
    ApiPath(plan): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    let plan = plan_name(&plan)?;
    if state
        .coordinator
        .delete_plan(plan.clone())
        .await
        .map_err(coord_error)?
    {
        tracing::info!(plan = %plan, "Plan deleted.");
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound { what: "plan" })
    }
}

/// Every plan, paged in name order.
#[utoipa::path(
    get,
    path = "/v1/plans",
    params(crate::api::cluster::PageQuery),
    responses(
        (status = 200, body = PlanPage),
        (status = 400, body = Problem),
    ),
    security(("bearer" = ["read"])),
    tag = "plans"
)]
pub async fn list_plans(
    State(state): State<AppState>,
    query: Result<Query<Vec<(String, String)>>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::Json<PlanPage>, ApiError> {
    let Query(pairs) = query.map_err(|_| bad_request("query", "is not a valid query string"))?;
    let (limit, after) = page_query(pairs)?;
    let after = after
        .map(|a| PlanName::new(a).map_err(|_| ApiError::field("after", &"not a cursor")))
        .transpose()?;
    let names = state.coordinator.view().plans_after(after.as_ref());
    let more = names.len() > limit;
    let plans: Vec<PlanView> = names
        .iter()
        .take(limit)
        .filter_map(|p| plan_view(&state, p))
        .collect();
    let next = more.then(|| plans.last().map(|p| p.plan.clone())).flatten();
    Ok(axum::Json(PlanPage { plans, next }))
}

/// Assigns a tenant to a plan: its checks of a policy it has no explicit policy of decide
/// under the plan's.
#[utoipa::path(
    put,
    path = "/v1/tenants/{tenant}/plan",
    params(("tenant" = String, Path)),
    request_body = AssignBody,
    responses(
        (status = 204, description = "Assigned"),
        (status = 400, description = "Invalid tenant or plan name", body = Problem),
        (status = 404, description = "No such plan (names `plan`)", body = Problem),
    ),
    security(("bearer" = ["admin"])),
    tag = "plans"
)]
pub async fn put_tenant_plan(
    State(state): State<AppState>,
    ApiPath(tenant): ApiPath<String>,
    ApiJson(body): ApiJson<AssignBody>,
) -> Result<StatusCode, ApiError> {
    let tenant = tenant_id(&tenant)?;
    let plan = plan_name(&body.plan)?;
    state
        .coordinator
        .assign_plan(tenant.clone(), plan.clone())
        .await
        .map_err(coord_error)?;
    tracing::info!(tenant = %tenant, plan = %plan, "Tenant assigned to a plan.");
    Ok(StatusCode::NO_CONTENT)
}

/// Reads a tenant's plan.
#[utoipa::path(
    get,
    path = "/v1/tenants/{tenant}/plan",
    params(("tenant" = String, Path)),
    responses(
        (status = 200, description = "The tenant's plan", body = AssignBody),
        (status = 400, description = "Invalid tenant", body = Problem),
        (status = 404, description = "No plan assigned", body = Problem),
    ),
    security(("bearer" = ["read"])),
    tag = "plans"
)]
pub async fn get_tenant_plan(
    State(state): State<AppState>,
    ApiPath(tenant): ApiPath<String>,
) -> Result<axum::Json<AssignBody>, ApiError> {
    let tenant = tenant_id(&tenant)?;
    let view = state.coordinator.view();
    let plan = view
        .plan_assignments
        .get(&tenant)
        .ok_or(ApiError::NotFound { what: "plan" })?;
    Ok(axum::Json(AssignBody {
        plan: plan.as_str().to_string(),
    }))
}

/// Removes a tenant's plan assignment.
#[utoipa::path(
    delete,
    path = "/v1/tenants/{tenant}/plan",
    params(("tenant" = String, Path)),
    responses(
        (status = 204, description = "Unassigned"),
        (status = 400, description = "Invalid tenant", body = Problem),
        (status = 404, description = "No plan assigned", body = Problem),
    ),
    security(("bearer" = ["admin"])),
    tag = "plans"
)]
pub async fn delete_tenant_plan(
    State(state): State<AppState>,
    ApiPath(tenant): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    let tenant = tenant_id(&tenant)?;
    if state
        .coordinator
        .unassign_plan(tenant)
        .await
        .map_err(coord_error)?
    {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound { what: "plan" })
    }
}
