//! The admin and decision API (axum). `app(state)` builds the whole router, so tests drive it
//! with `oneshot` and no socket.
//!
//! Layout: [`edge`] (request id, body limit and timeout in front of every route), [`routes`]
//! (`POST /v1/check` past the router, the rest through it), [`check`] (decisions), [`batch`]
//! (batches of them), [`tenants`] (policies, pins, allowance), [`policy_batch`] (many
//! policies in one step), [`cluster`] (status,
//! membership, listing, health, metrics), [`problem`] (the one `ApiError`), [`auth`] (bearer
//! token on mutations), [`state`] (what handlers share).

pub mod auth;
pub mod batch;
pub mod check;
pub mod cluster;
pub mod edge;
mod header_text;
pub mod policy_batch;
pub mod problem;
pub mod routes;
pub mod state;
pub mod tenants;

use axum::middleware;
use axum::routing::{delete, get, post, put};
use axum::Router;
use tower::Layer as _;
use utoipa::OpenApi;

use crate::api::auth::BearerScheme;
pub use crate::api::state::{AppShared, AppState};

/// The whole API as one service: the [`routes`] behind the [`edge`] layer.
pub type Api = edge::Edge<routes::Routes>;

/// The OpenAPI document, generated from the handlers' annotations.
#[derive(Debug, OpenApi)]
#[openapi(
    info(title = "quotad", description = "Multi-region quota coordinator: decisions, policies, pins and cluster state."),
    paths(
        check::check,
        batch::check_batch,
        tenants::put_policy,
        policy_batch::put_policies,
        tenants::get_policy,
        tenants::delete_policy,
        tenants::put_pin,
        tenants::delete_pin,
        tenants::allowance,
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
    modifiers(&BearerScheme)
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

/// Every route, with auth on mutations.
pub(crate) fn router(state: AppState) -> Router {
    let guarded = Router::new()
        .route(
            "/v1/tenants/{tenant}/policies/{policy}",
            put(tenants::put_policy).delete(tenants::delete_policy),
        )
        .route(
            "/v1/tenants/{tenant}/pin",
            put(tenants::put_pin).delete(tenants::delete_pin),
        )
        .route("/v1/policies", get(cluster::list_policies))
        .route("/v1/policies/batch", post(policy_batch::put_policies))
        .route("/v1/cluster/members", post(cluster::add_member))
        .route(
            "/v1/cluster/members/{node_id}/promote",
            post(cluster::promote_member),
        )
        .route(
            "/v1/cluster/members/{node_id}",
            delete(cluster::remove_member),
        )
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ));
    let open = Router::new()
        .route(routes::CHECK_PATH, post(check::check))
        .route("/v1/check/batch", post(batch::check_batch))
        .route(
            "/v1/tenants/{tenant}/policies/{policy}",
            get(tenants::get_policy),
        )
        .route("/v1/tenants/{tenant}/allowance", get(tenants::allowance))
        .route("/v1/status", get(cluster::status))
        .route("/v1/cluster/members", get(cluster::members))
        .route("/livez", get(cluster::livez))
        .route("/readyz", get(cluster::readyz))
        .route("/metrics", get(cluster::metrics))
        .route("/openapi.json", get(openapi));
    open.merge(guarded)
        .fallback(|| async { problem::ApiError::NotFound { what: "route" } })
        .with_state(state)
}

#[cfg(test)]
pub(crate) mod tests;
