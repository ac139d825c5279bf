//! POST /v1/policies/batch: many policies stored in one step, all or none.
//!
//! Loading a large tenant set one PUT at a time costs each daemon a view update and a region
//! agent pass per policy (and, multi-region, a Raft round per policy). A batch is one
//! replicated command (one transaction single-region), so those costs are paid once per batch.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use axum::extract::State;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use quota_core::coordinator::MAX_BATCH_POLICIES;
use quota_core::{PolicyName, PolicySpec, TenantId};

use crate::api::problem::{data_problem, ApiError, ApiJson, FieldProblem, Problem};
use crate::api::state::AppState;
use crate::api::tenants::{coord_error, refused_policies, PolicyView};
use crate::coordination::{CoordError, PolicyPut};

/// Policies to create or replace: each one is a PUT body plus `tenant` and `policy`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PolicyBatchBody {
    /// 1 to 1000 objects such as `{"tenant": "acme", "policy": "writes", "limit": 100,
    /// "window_ms": 60000}`, with the optional fields of a PUT body.
    #[schema(value_type = Vec<Object>, min_items = 1, max_items = 1000)]
    pub policies: Vec<Map<String, Value>>,
}

/// The stored policies with their new versions, in request order.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PolicyBatchResponse {
    pub policies: Vec<PolicyView>,
}

/// Creates or replaces up to 1000 policies in one step: all are stored, or none.
#[utoipa::path(
    post,
    path = "/v1/policies/batch",
    request_body = PolicyBatchBody,
    responses(
        (status = 200, description = "Every policy stored, in request order", body = PolicyBatchResponse),
        (status = 400, description = "Nothing stored: every problem listed by its place (`policies[3].limit`)", body = Problem),
    ),
    security(("bearer" = ["admin"])),
    tag = "policies"
)]
pub async fn put_policies(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<PolicyBatchBody>,
) -> Result<axum::Json<PolicyBatchResponse>, ApiError> {
    let batch = parse(body)?;
    let count = batch.len();
    let names: Vec<_> = batch
        .iter()
        .map(|(t, n, _)| (t.clone(), n.clone()))
        .collect();
    let stored = state
        .coordinator
        .put_policies(batch)
        .await
        .map_err(|e| match e {
            CoordError::InvalidPolicies { entries, total } => {
                refused_policies(&entries, total, |i| format!("policies[{i}]."))
            }
            other => coord_error(other),
        })?;
    tracing::info!(
        count,
        first_version = stored.first().map(|p| p.version),
        "Policies stored."
    );
    let policies = names
        .iter()
        .zip(&stored)
        .map(|((tenant, name), p)| PolicyView::new(tenant, name, p))
        .collect();
    Ok(axum::Json(PolicyBatchResponse { policies }))
}

/// Every entry checked as a PUT would check it; every problem named by its place.
fn parse(body: PolicyBatchBody) -> Result<Vec<PolicyPut>, ApiError> {
    if body.policies.is_empty() || body.policies.len() > MAX_BATCH_POLICIES {
        return Err(ApiError::field(
            "policies",
            &format!("must hold 1 to {MAX_BATCH_POLICIES} policies"),
        ));
    }
    let mut errors = Vec::new();
    let mut batch = Vec::with_capacity(body.policies.len());
    let mut seen: HashMap<(TenantId, PolicyName), usize> = HashMap::new();
    for (i, mut item) in body.policies.into_iter().enumerate() {
        let mut problem = |field: &str, message: String| {
            errors.push(FieldProblem {
                field: format!("policies[{i}].{field}"),
                message,
            })
        };
        let tenant = id(item.remove("tenant"), TenantId::new).map_err(|m| problem("tenant", m));
        let name = id(item.remove("policy"), PolicyName::new).map_err(|m| problem("policy", m));
        let policy = match serde_path_to_error::deserialize::<_, PolicySpec>(Value::Object(item)) {
            Ok(spec) => spec.validate().map_err(|e| {
                for f in &e.0 {
                    problem(f.field, f.message.clone());
                }
            }),
            Err(e) => {
                let path = e.path().to_string();
                let p = data_problem(&path, &e.into_inner().to_string());
                let field = match p.field.as_str() {
                    "body" => format!("policies[{i}]"),
                    f => format!("policies[{i}].{f}"),
                };
                errors.push(FieldProblem { field, ..p });
                Err(())
            }
        };
        if let (Ok(tenant), Ok(name), Ok(policy)) = (tenant, name, policy) {
            match seen.entry((tenant.clone(), name.clone())) {
                Entry::Occupied(first) => errors.push(FieldProblem {
                    field: format!("policies[{i}]"),
                    message: format!(
                        "names the same tenant and policy as policies[{}]",
                        first.get()
                    ),
                }),
                Entry::Vacant(slot) => {
                    slot.insert(i);
                }
            }
            batch.push((tenant, name, policy));
        }
    }
    if errors.is_empty() {
        Ok(batch)
    } else {
        Err(ApiError::InvalidPolicy { errors })
    }
}

/// A tenant or policy id from an entry's field.
fn id<T, E: ToString>(
    value: Option<Value>,
    new: impl FnOnce(String) -> Result<T, E>,
) -> Result<T, String> {
    match value {
        Some(Value::String(s)) => new(s).map_err(|e| e.to_string()),
        Some(_) => Err("must be a string".into()),
        None => Err("is required".into()),
    }
}
