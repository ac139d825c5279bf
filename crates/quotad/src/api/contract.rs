//! What the OpenAPI document promises beyond the handlers' annotations: the bounds, patterns
//! and enums the server enforces (taken from the constants that enforce them), and the
//! statuses every route can answer through the shared layers (the body extractor, the auth
//! middleware, the edge's timeout), so the document is the contract a fuzzer can hold the
//! server to.

use quota_core::bucket::MAX_LIMITS_PER_CHECK;
use quota_core::policy::{MAX_BURST, MAX_HOLD_TTL_MS, MAX_WINDOW_MS};
use quota_core::{PolicyName, RegionId, TenantId};
use serde_json::Value;
use utoipa::openapi::path::{Operation, Parameter};
use utoipa::openapi::schema::{Object, ObjectBuilder, Schema, SchemaType, Type};
use utoipa::openapi::{Content, RefOr, ResponseBuilder};
use utoipa::Number;

use crate::api::check::MAX_COST;
use crate::api::cluster::MAX_PAGE;
use crate::api::problem::PROBLEM_JSON;

/// Every id (tenant, policy, region) is made of these characters.
pub const ID_PATTERN: &str = "^[A-Za-z0-9_-]+$";

/// `host:port` of an IPv4 listener, as membership bodies take it.
const SOCKET_PATTERN: &str = r"^((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9]):([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])$";

/// The document's named schemas.
type Schemas = std::collections::BTreeMap<String, RefOr<Schema>>;

/// Adds the bounds and the shared statuses to the generated document.
#[derive(Debug)]
pub struct Contract;

fn id(max_len: usize) -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(ID_PATTERN))
        .min_length(Some(1))
        .max_length(Some(max_len))
        .build()
}

/// An id the body may also leave out or give as `null` (one of two alternatives).
fn id_or_null(max_len: usize) -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
        .pattern(Some(ID_PATTERN))
        .min_length(Some(1))
        .max_length(Some(max_len))
        .build()
}

/// A raw identity: any UTF-8 of 1 to `MAX_IDENTITY_BYTES`, or null.
fn identity() -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
        .min_length(Some(1))
        .max_length(Some(crate::api::check::MAX_IDENTITY_BYTES))
        .build()
}

fn whole(min: u64, max: u64, nullable: bool) -> Object {
    let ty = if nullable {
        SchemaType::from_iter([Type::Integer, Type::Null])
    } else {
        SchemaType::new(Type::Integer)
    };
    ObjectBuilder::new()
        .schema_type(ty)
        .minimum(Some(Number::UInt(min as usize)))
        .maximum(Some(Number::UInt(max as usize)))
        .build()
}

/// A nullable string enum (the field may be left out or be `null`: both mean the default).
fn one_of(values: &[&str]) -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
        .enum_values(Some(
            values.iter().map(|v| Value::from(*v)).chain([Value::Null]),
        ))
        .build()
}

fn set(schemas: &mut Schemas, name: &str, field: &str, to: Object) {
    if let Some(RefOr::T(Schema::Object(o))) = schemas.get_mut(name) {
        o.properties
            .insert(field.to_string(), RefOr::T(Schema::Object(to)));
    }
}

fn problem(description: &str) -> RefOr<utoipa::openapi::Response> {
    RefOr::T(
        ResponseBuilder::new()
            .description(description)
            .content(
                PROBLEM_JSON,
                Content::new(Some(RefOr::Ref(utoipa::openapi::Ref::from_schema_name(
                    "Problem",
                )))),
            )
            .build(),
    )
}

/// Problem bodies are `application/problem+json`, so a handler names only `body = Problem`.
fn problem_content_type(op: &mut Operation) {
    let is_problem = |c: &Content| {
        matches!(&c.schema, Some(RefOr::Ref(r)) if ["Problem", "RateLimitedProblem", "MultiRateLimitedProblem", "HoldRateLimitedProblem"]
            .iter()
            .any(|name| r.ref_location == format!("#/components/schemas/{name}")))
    };
    for response in op.responses.responses.values_mut() {
        let RefOr::T(response) = response else {
            continue;
        };
        if response
            .content
            .get("application/json")
            .is_some_and(is_problem)
        {
            if let Some(c) = response.content.shift_remove("application/json") {
                response.content.insert(PROBLEM_JSON.to_string(), c);
            }
        }
    }
}

fn add(op: &mut Operation, status: u16, description: &str) {
    op.responses
        .responses
        .entry(status.to_string())
        .or_insert_with(|| problem(description));
}

fn bound_param(path: &str, p: &mut Parameter) {
    let schema = match p.name.as_str() {
        // The plan list pages by plan name, the policy list by `tenant:policy`.
        "after" if path == "/v1/plans" => id(quota_core::PlanName::MAX_LEN),
        "tenant" => id(TenantId::MAX_LEN),
        "policy" => id(PolicyName::MAX_LEN),
        "plan" => id(quota_core::PlanName::MAX_LEN),
        "node_id" => whole(0, u64::MAX, false),
        // A hold id: `<region>.<tenant>.<key>`.
        "id" if path.starts_with("/v1/holds/") => ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some(format!(
                "^[A-Za-z0-9_-]{{1,{}}}\\.[A-Za-z0-9_-]{{1,{}}}\\.[A-Za-z0-9_-]{{1,{}}}$",
                RegionId::MAX_LEN,
                TenantId::MAX_LEN,
                crate::decision::holds::MAX_HOLD_KEY_LEN
            )))
            .build(),
        "limit" => whole(1, MAX_PAGE as u64, false),
        "after" => ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some(format!(
                "^[A-Za-z0-9_-]{{1,{}}}:[A-Za-z0-9_-]{{1,{}}}$",
                TenantId::MAX_LEN,
                PolicyName::MAX_LEN
            )))
            .build(),
        _ => return,
    };
    p.schema = Some(RefOr::T(Schema::Object(schema)));
}

impl utoipa::Modify for Contract {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        if let Some(c) = doc.components.as_mut() {
            let s = &mut c.schemas;
            bound_bodies(s);
            batch_checks_one_by_one(s);
            close_bodies(s);
        }
        add_shared_statuses(doc);
    }
}

/// The server's bounds, patterns and enums on the bodies' fields.
fn bound_bodies(s: &mut Schemas) {
    set(s, "PolicyBody", "limit", whole(1, MAX_BURST, false));
    set(s, "PolicyBody", "window_ms", whole(1, MAX_WINDOW_MS, false));
    set(s, "PolicyBody", "burst", whole(1, MAX_BURST, true));
    set(s, "PolicyBody", "debt_limit", whole(0, MAX_BURST, true));
    set(s, "PolicyBody", "tier", one_of(&["standard", "critical"]));
    set(
        s,
        "PolicyBody",
        "fail_mode",
        one_of(&["local", "open", "closed"]),
    );
    set(
        s,
        "PolicyBody",
        "algorithm",
        one_of(&["token_bucket", "sliding_window", "concurrency"]),
    );
    set(
        s,
        "PolicyBody",
        "floor",
        ObjectBuilder::new()
            .schema_type(SchemaType::from_iter([Type::Number, Type::Null]))
            .minimum(Some(Number::Float(0.0)))
            .maximum(Some(Number::Float(1.0)))
            .build(),
    );
    set(s, "CheckBody", "tenant", id_or_null(TenantId::MAX_LEN));
    set(s, "CheckBody", "policy", id_or_null(PolicyName::MAX_LEN));
    set_policies(s, "CheckBody");
    set(s, "CheckBody", "cost", whole(1, MAX_COST, true));
    set(s, "PinBody", "region", id(RegionId::MAX_LEN));
    set(s, "AssignBody", "plan", id(quota_core::PlanName::MAX_LEN));
    set(s, "AssignmentItem", "tenant", id(TenantId::MAX_LEN));
    set(
        s,
        "AssignmentItem",
        "plan",
        id_or_null(quota_core::PlanName::MAX_LEN),
    );
    set(s, "PolicyBody", "mode", one_of(&["enforcing", "shadow"]));
    set(s, "CheckBody", "identity", identity());
    set(s, "ChargeBody", "tenant", id_or_null(TenantId::MAX_LEN));
    set(s, "ChargeBody", "policy", id(PolicyName::MAX_LEN));
    set(
        s,
        "ChargeBody",
        "cost",
        whole(1, quota_store::MAX_COST, false),
    );
    set(s, "ChargeBody", "identity", identity());
    set(
        s,
        "ChargeBody",
        "id",
        ObjectBuilder::new()
            .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
            .pattern(Some("^[!-~]+$"))
            .min_length(Some(1))
            .max_length(Some(quota_store::MAX_CHARGE_ID_LEN))
            .build(),
    );
    bound_holds(s);
    set(s, "NewMember", "node_id", whole(1, u64::MAX, false));
    set(s, "NewMember", "region", id(RegionId::MAX_LEN));
    for f in ["peer", "api"] {
        let addr = ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some(SOCKET_PATTERN))
            .build();
        set(s, "NewMember", f, addr);
    }
}

/// Several policies of one subject decided at once: 1 to 16 distinct names, or null.
fn set_policies(s: &mut Schemas, body: &str) {
    if let Some(RefOr::T(Schema::Object(o))) = s.get_mut(body) {
        o.properties.insert(
            "policies".to_string(),
            RefOr::T(Schema::Array(
                utoipa::openapi::schema::ArrayBuilder::new()
                    .schema_type(SchemaType::from_iter([Type::Array, Type::Null]))
                    .items(RefOr::T(Schema::Object(id(PolicyName::MAX_LEN))))
                    .min_items(Some(1))
                    .max_items(Some(MAX_LIMITS_PER_CHECK as usize))
                    .unique_items(true)
                    .build(),
            )),
        );
    }
}

/// The bounds of a hold and of a settle.
fn bound_holds(s: &mut Schemas) {
    set(s, "HoldBody", "tenant", id_or_null(TenantId::MAX_LEN));
    set(s, "HoldBody", "identity", identity());
    set(s, "HoldBody", "policy", id_or_null(PolicyName::MAX_LEN));
    set_policies(s, "HoldBody");
    set(s, "HoldBody", "cost", whole(1, quota_store::MAX_COST, true));
    set(s, "HoldBody", "ttl_ms", whole(1, MAX_HOLD_TTL_MS, true));
    set(
        s,
        "HoldBody",
        "id",
        id_or_null(crate::decision::holds::MAX_HOLD_KEY_LEN),
    );
    set(
        s,
        "SettleBody",
        "cost",
        whole(0, quota_store::MAX_COST, false),
    );
    set(s, "SettleBody", "tenant", id_or_null(TenantId::MAX_LEN));
    set(s, "SettleBody", "identity", identity());
}

/// A batch's checks get their own schema, without the bounds a single check is held to.
fn batch_checks_one_by_one(s: &mut Schemas) {
    // A batch's checks are answered one by one: an id that is not valid gets its own
    // 400 in `results`, so the batch's schema does not hold ids and costs to the bounds.
    if let Some(RefOr::T(Schema::Object(check))) = s.get("CheckBody").cloned() {
        let mut item = check;
        // Several policies at once are not batched.
        item.properties.remove("policies");
        for f in ["tenant", "identity", "policy"] {
            let any = SchemaType::from_iter([Type::String, Type::Null]);
            item.properties.insert(
                f.to_string(),
                RefOr::T(Schema::Object(
                    ObjectBuilder::new().schema_type(any).build(),
                )),
            );
        }
        item.properties.insert(
            "cost".to_string(),
            RefOr::T(Schema::Object(
                ObjectBuilder::new()
                    .schema_type(SchemaType::from_iter([Type::Number, Type::Null]))
                    .build(),
            )),
        );
        s.insert("BatchCheck".to_string(), RefOr::T(Schema::Object(item)));
        if let Some(RefOr::T(Schema::Object(b))) = s.get_mut("BatchBody") {
            b.properties.insert(
                "checks".to_string(),
                RefOr::T(Schema::Array(
                    utoipa::openapi::schema::ArrayBuilder::new()
                        .items(RefOr::Ref(utoipa::openapi::Ref::from_schema_name(
                            "BatchCheck",
                        )))
                        .min_items(Some(1))
                        .max_items(Some(crate::api::batch::MAX_BATCH))
                        .build(),
                )),
            );
        }
    }
}

/// Bodies take no field beyond those documented.
fn close_bodies(s: &mut Schemas) {
    for name in [
        "PolicyBody",
        "CheckBody",
        "ChargeBody",
        "HoldBody",
        "SettleBody",
        "PinBody",
        "NewMember",
        "BatchBody",
        "PlanBody",
        "AssignBody",
        "AssignmentBatchBody",
        "AssignmentItem",
    ] {
        if let Some(RefOr::T(Schema::Object(o))) = s.get_mut(name) {
            o.additional_properties = Some(Box::new(
                utoipa::openapi::schema::AdditionalProperties::FreeForm(false),
            ));
        }
    }
}

/// The statuses every operation shares: the problems of the shared layers (body, path
/// parameters, auth, timeout), each with the problem content type.
fn add_shared_statuses(doc: &mut utoipa::openapi::OpenApi) {
    for (path, item) in doc.paths.paths.iter_mut() {
        for op in [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
        ]
        .into_iter()
        .flatten()
        {
            problem_content_type(op);
            let mut has_path_params = false;
            for p in op.parameters.iter_mut().flatten() {
                bound_param(path, p);
                has_path_params |=
                    matches!(p.parameter_in, utoipa::openapi::path::ParameterIn::Path);
            }
            if op.request_body.is_some() {
                add(op, 400, "The body is not a JSON object of the documented fields: every problem named in `errors`");
                add(op, 413, "The body is larger than the configured limit");
                add(op, 415, "The body is not declared as JSON");
            }
            if has_path_params {
                add(op, 400, "A path parameter is not valid: named in `errors`");
            }
            if op.security.as_ref().is_some_and(|s| !s.is_empty()) {
                add(op, 401, "Missing or unknown token");
                add(op, 403, "The token lacks the scope this operation needs");
            }
            add(
                op,
                503,
                "The request did not complete within the configured request timeout",
            );
        }
    }
}
