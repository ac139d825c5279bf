//! POST /v1/plans/assignments/batch: many tenants' plans set in one step, all or none.
//!
//! Assigning a large tenant set one PUT at a time costs a durable write (an fsync, and
//! multi-region a Raft round) per tenant. A batch is one replicated command (one transaction
//! single-region), so that cost is paid once per batch.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use axum::extract::State;
use serde::{Deserialize, Deserializer, Serialize};

use quota_core::coordinator::{InvalidEntry, MAX_BATCH_ASSIGNMENTS};
use quota_core::{PlanName, TenantId};

use crate::api::problem::{ApiError, ApiJson, FieldProblem, Problem};
use crate::api::state::AppState;
use crate::api::tenants::{client_tenant, coord_error};
use crate::coordination::{CoordError, PlanAssignment};

/// Tenants' plans to set.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AssignmentBatchBody {
    /// 1 to 1000 entries such as `{"tenant": "acme", "plan": "pro"}`; `"plan": null` removes
    /// the tenant's assignment.
    #[schema(min_items = 1, max_items = 1000)]
    pub assignments: Vec<AssignmentItem>,
}

/// One tenant and its plan.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AssignmentItem {
    pub tenant: String,
    /// The plan's name (it must exist), or `null` for no plan. Required: an entry that
    /// forgot its plan is not taken as an unassignment.
    #[serde(deserialize_with = "present")]
    #[schema(required = true)]
    pub plan: Option<String>,
}

/// An `Option` the body must name, as a value or `null` (serde takes a missing field with a
/// `deserialize_with` as missing, not as `None`).
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Option::deserialize(d)
}

/// What the batch did, by kind of entry.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct AssignmentBatchResponse {
    /// Entries that assigned a plan.
    pub assigned: usize,
    /// Entries that removed an assignment (whether or not the tenant had one).
    pub unassigned: usize,
}

/// Sets up to 1000 tenants' plans in one step: all change, or none.
#[utoipa::path(
    post,
    path = "/v1/plans/assignments/batch",
    request_body = AssignmentBatchBody,
    responses(
        (status = 200, description = "Every assignment made", body = AssignmentBatchResponse),
        (status = 400, description = "Nothing changed: every problem listed by its place (`assignments[3].plan`), a plan that does not exist included", body = Problem),
    ),
    security(("bearer" = ["admin"])),
    tag = "plans"
)]
pub async fn put_assignments(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<AssignmentBatchBody>,
) -> Result<axum::Json<AssignmentBatchResponse>, ApiError> {
    let batch = parse(body)?;
    let assigned = batch.iter().filter(|(_, p)| p.is_some()).count();
    let unassigned = batch.len() - assigned;
    state
        .coordinator
        .assign_plans(batch)
        .await
        .map_err(|e| match e {
            CoordError::InvalidAssignments { entries, total } => refused(&entries, total),
            other => coord_error(other),
        })?;
    tracing::info!(assigned, unassigned, "Plan assignments stored.");
    Ok(axum::Json(AssignmentBatchResponse {
        assigned,
        unassigned,
    }))
}

/// Every entry checked as the single-tenant routes check it; every problem named by its place.
fn parse(body: AssignmentBatchBody) -> Result<Vec<PlanAssignment>, ApiError> {
    if body.assignments.is_empty() || body.assignments.len() > MAX_BATCH_ASSIGNMENTS {
        return Err(ApiError::field(
            "assignments",
            &format!("must hold 1 to {MAX_BATCH_ASSIGNMENTS} assignments"),
        ));
    }
    let mut errors = Vec::new();
    let mut batch = Vec::with_capacity(body.assignments.len());
    let mut seen: HashMap<TenantId, usize> = HashMap::new();
    for (i, item) in body.assignments.into_iter().enumerate() {
        let mut problem = |field: &str, message: String| {
            errors.push(FieldProblem {
                field: format!("assignments[{i}].{field}"),
                message,
            })
        };
        let tenant = match TenantId::new(item.tenant)
            .map_err(|e| ApiError::field("tenant", &e))
            .and_then(client_tenant)
        {
            Ok(t) => Some(t),
            Err(ApiError::BadField { message, .. }) => {
                problem("tenant", message);
                None
            }
            Err(other) => {
                problem("tenant", other.to_string());
                None
            }
        };
        let plan = match item.plan.map(PlanName::new).transpose() {
            Ok(p) => Some(p),
            Err(e) => {
                problem("plan", e.to_string());
                None
            }
        };
        if let Some(t) = &tenant {
            match seen.entry(t.clone()) {
                Entry::Occupied(first) => problem(
                    "tenant",
                    format!("names the same tenant as assignments[{}]", first.get()),
                ),
                Entry::Vacant(slot) => {
                    slot.insert(i);
                }
            }
        }
        if let (Some(tenant), Some(plan)) = (tenant, plan) {
            batch.push((tenant, plan));
        }
    }
    if errors.is_empty() {
        Ok(batch)
    } else {
        Err(ApiError::BadRequest {
            detail: "no assignment was made".into(),
            errors,
        })
    }
}

/// Entries the coordinator refused, as field problems; those past the listed ones counted.
fn refused(entries: &[InvalidEntry], total: u32) -> ApiError {
    let mut errors: Vec<FieldProblem> = entries
        .iter()
        .flat_map(|e| {
            e.fields.iter().map(move |field| FieldProblem {
                field: format!("assignments[{}].{field}", e.index),
                message: match field.as_str() {
                    "plan" => "no such plan".into(),
                    _ => "refused by the coordinator".into(),
                },
            })
        })
        .collect();
    if total as usize > entries.len() {
        errors.push(FieldProblem {
            field: "assignments".into(),
            message: format!(
                "{} more entries are refused (the first {} are listed)",
                total as usize - entries.len(),
                entries.len()
            ),
        });
    }
    ApiError::BadRequest {
        detail: "no assignment was made".into(),
        errors,
    }
}
