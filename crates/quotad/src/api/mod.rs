//! The admin and decision API (axum). `app(state)` builds the whole router, so tests drive it
//! with `oneshot` and no socket.
//!
//! Layout: [`edge`] (request id, body limit and timeout in front of every route), [`routes`]
//! (`POST /v1/check` past the router, the rest through it), [`check`] (decisions), [`holds`] (estimates held and settled), [`batch`]
//! (batches of them), [`forwarded`] (checks forwarded over the peer listener), [`tenants`]
//! (policies, pins, allowance), [`plans`] (plans and tenants' plans), [`policy_batch`] (many
//! policies in one step), [`assignment_batch`] (many tenants' plans in one step), [`cluster`] (status,
//! membership, listing, health, metrics), [`problem`] (the one `ApiError`), [`auth`] (scoped
//! bearer tokens on routes, the audit layer on mutations), [`state`] (what handlers share).

pub mod assignment_batch;
pub mod auth;
pub mod batch;
pub mod charges;
pub mod check;
pub mod cluster;
pub mod contract;
pub mod edge;
pub mod forwarded;
mod header_text;
pub mod holds;
pub mod plans;
pub mod policy_batch;
pub mod problem;
pub mod routes;
pub mod state;
pub mod tenants;

use axum::middleware;
use axum::routing::{delete, get, post, put, MethodRouter};
use axum::Router;
use tower::Layer as _;
use utoipa::OpenApi;

use crate::api::auth::BearerScheme;
use crate::api::contract::Contract;
pub use crate::api::state::{AppShared, AppState};
use crate::tokens::Scope;

/// The whole API as one service: the [`routes`] behind the [`edge`] layer.
pub type Api = edge::Edge<routes::Routes>;

/// The OpenAPI document, generated from the handlers' annotations.
#[derive(Debug, OpenApi)]
#[openapi(
    info(title = "quotad", description = "Multi-region quota coordinator: decisions, policies, pins and cluster state."),
    paths(
        check::check,
        batch::check_batch,
        charges::charge,
        holds::hold,
        holds::settle,
        holds::release,
        holds::release_by_post,
        tenants::put_policy,
        policy_batch::put_policies,
        tenants::get_policy,
        tenants::delete_policy,
        tenants::put_pin,
        tenants::delete_pin,
        tenants::allowance,
        plans::put_plan,
        plans::get_plan,
        plans::delete_plan,
        plans::list_plans,
        plans::put_tenant_plan,
        plans::get_tenant_plan,
        plans::delete_tenant_plan,
        assignment_batch::put_assignments,
        cluster::status,
        cluster::members,
        cluster::add_member,
        cluster::promote_member,
        cluster::remove_member,
        cluster::list_policies,
        cluster::livez,
        cluster::readyz,
        cluster::metrics,
    ),
    components(schemas(
        check::multi::MultiCheckResponse,
        check::multi::MultiRateLimitedProblem,
        check::multi::LimitResponse
    )),
    modifiers(&BearerScheme, &Contract)
)]
pub struct ApiDoc;

async fn openapi() -> axum::Json<utoipa::openapi::OpenApi> {
    axum::Json(ApiDoc::openapi())
}

/// The whole API: the router, its fast path for checks, and the edge layer.
pub fn app(state: AppState) -> Api {
    let edge = edge::EdgeLayer::new(state.body_limit_bytes, state.request_timeout);
    // One layer around the whole router, not `Router::layer`, which would wrap every route
    // separately and clone and box each wrapper per request.
    edge.layer(routes::Routes::new(router(state.clone()), state))
}

/// Every route with the scope it needs; mutations audited. The token is checked per method,
/// after the router chose one, so a method a path does not serve is a 405 with or without a
/// token. Open: `/livez`, `/readyz`, `/metrics`, `/openapi.json`, and the checks with
/// `api.open_checks`.
pub(crate) fn router(state: AppState) -> Router {
    let scoped = |scope: Scope, m: MethodRouter<AppState>| {
        m.route_layer(middleware::from_fn_with_state(
            (state.clone(), scope),
            auth::require,
        ))
    };
    let read = |m| scoped(Scope::Read, m);
    let admin = |action: &'static str, m| {
        scoped(Scope::Admin, m).route_layer(middleware::from_fn(
            move |req: axum::extract::Request, next: middleware::Next| {
                auth::audited(action, req, next)
            },
        ))
    };
    let checks = |m: MethodRouter<AppState>| {
        if state.open_checks {
            m
        } else {
            scoped(Scope::Check, m)
        }
    };
    Router::new()
        .route(routes::CHECK_PATH, checks(post(check::check)))
        .route("/v1/check/batch", checks(post(batch::check_batch)))
        // Never open: a charge spends what no check admitted.
        .route(
            crate::decision::CHARGES_PATH,
            scoped(Scope::Check, post(charges::charge)),
        )
        // Never open either: a settle charges, a release gives back.
        .route(
            crate::decision::holds::HOLDS_PATH,
            scoped(Scope::Check, post(holds::hold)),
        )
        .route(
            "/v1/holds/{id}/settle",
            scoped(Scope::Check, post(holds::settle)),
        )
        .route(
            "/v1/holds/{id}/release",
            scoped(Scope::Check, post(holds::release_by_post)),
        )
        .route(
            "/v1/holds/{id}",
            scoped(Scope::Check, delete(holds::release)),
        )
        .route(
            "/v1/tenants/{tenant}/policies/{policy}",
            read(get(tenants::get_policy))
                .merge(admin("policy.put", put(tenants::put_policy)))
                .merge(admin("policy.delete", delete(tenants::delete_policy))),
        )
        .route(
            "/v1/tenants/{tenant}/pin",
            admin("pin.put", put(tenants::put_pin))
                .merge(admin("pin.delete", delete(tenants::delete_pin))),
        )
        .route(
            "/v1/tenants/{tenant}/allowance",
            read(get(tenants::allowance)),
        )
        .route(
            "/v1/tenants/{tenant}/plan",
            read(get(plans::get_tenant_plan))
                .merge(admin("plan.assign", put(plans::put_tenant_plan)))
                .merge(admin("plan.unassign", delete(plans::delete_tenant_plan))),
        )
        .route("/v1/plans", read(get(plans::list_plans)))
        .route(
            "/v1/plans/assignments/batch",
            admin("assignments.batch", post(assignment_batch::put_assignments)),
        )
        .route(
            "/v1/plans/{plan}",
            read(get(plans::get_plan))
                .merge(admin("plan.put", put(plans::put_plan)))
                .merge(admin("plan.delete", delete(plans::delete_plan))),
        )
        .route("/v1/policies", read(get(cluster::list_policies)))
        .route(
            "/v1/policies/batch",
            admin("policies.batch", post(policy_batch::put_policies)),
        )
        .route("/v1/status", read(get(cluster::status)))
        .route(
            "/v1/cluster/members",
            read(get(cluster::members)).merge(admin("member.add", post(cluster::add_member))),
        )
        .route(
            "/v1/cluster/members/{node_id}/promote",
            admin("member.promote", post(cluster::promote_member)),
        )
        .route(
            "/v1/cluster/members/{node_id}",
            admin("member.remove", delete(cluster::remove_member)),
        )
        .route("/livez", get(cluster::livez))
        .route("/readyz", get(cluster::readyz))
        .route("/metrics", get(cluster::metrics))
        .route("/openapi.json", get(openapi))
        .fallback(|| async { problem::ApiError::NotFound { what: "route" } })
        .method_not_allowed_fallback(|| async { problem::ApiError::MethodNotAllowed })
        .with_state(state)
}

#[cfg(test)]
pub(crate) mod tests;
