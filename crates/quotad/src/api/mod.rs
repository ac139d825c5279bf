//! The admin and decision API (axum). `app(state)` builds the whole router, so tests drive it
//! with `oneshot` and no socket.
//!
//! Layout: [`edge`] (request id, body limit and timeout in front of every route), [`check`]
//! (decisions), [`tenants`] (policies, pins, allowance), [`cluster`] (status, membership,
//! listing, health, metrics), [`problem`] (the one `ApiError`), [`auth`] (bearer token on
//! mutations).

pub mod auth;
pub mod check;
pub mod cluster;
pub mod edge;
pub mod problem;
pub mod tenants;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderValue;
use axum::middleware;
use axum::routing::{delete, get, post, put};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tower::Layer as _;
use utoipa::OpenApi;

use crate::api::auth::BearerScheme;
use crate::config::Secret;
use crate::coordination::Coordinator;
use crate::decision::Decider;

/// The whole API as one service: the routes behind the [`edge`] layer.
pub type Api = edge::Edge<Router>;

/// Everything handlers share, behind one `Arc`: axum clones the state for every request, and
/// one reference count costs less than one per field.
pub type AppState = Arc<AppShared>;

/// The fields of [`AppState`].
#[derive(Debug)]
pub struct AppShared {
    pub decider: Arc<Decider>,
    pub coordinator: Arc<Coordinator>,
    pub admin_token: Arc<Secret>,
    pub metrics: Option<PrometheusHandle>,
    /// False while starting and once shutdown began: /readyz answers 503.
    pub ready: Arc<AtomicBool>,
    pub drift_margin_ms: u64,
    pub body_limit_bytes: usize,
    pub request_timeout: Duration,
}

/// A header value formatted in a stack buffer, so the value's own bytes are the only allocation
/// (formatting into a `String` and parsing it costs two); `None` if it is not a valid value.
pub(crate) fn header_value(args: std::fmt::Arguments<'_>) -> Option<HeaderValue> {
    use std::io::Write as _;
    let mut buf = [0u8; 128];
    let mut rest = &mut buf[..];
    if rest.write_fmt(args).is_ok() {
        let len = 128 - rest.len();
        return HeaderValue::from_bytes(&buf[..len]).ok();
    }
    // Longer than the buffer.
    HeaderValue::try_from(args.to_string()).ok()
}

/// The OpenAPI document, generated from the handlers' annotations.
#[derive(Debug, OpenApi)]
#[openapi(
    info(title = "quotad", description = "Multi-region quota coordinator: decisions, policies, pins and cluster state."),
    paths(
        check::check,
        check::check_batch,
        tenants::put_policy,
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

/// The router: routes, auth on mutations, and the edge layer.
pub fn app(state: AppState) -> Api {
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
        .route("/v1/check", post(check::check))
        .route("/v1/check/batch", post(check::check_batch))
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
    let edge = edge::EdgeLayer::new(state.body_limit_bytes, state.request_timeout);
    let routes = open
        .merge(guarded)
        .fallback(|| async { problem::ApiError::NotFound { what: "route" } })
        .with_state(state);
    // One layer around the whole router, not `Router::layer`, which would wrap every route
    // separately and clone and box each wrapper per request.
    edge.layer(routes)
}

#[cfg(test)]
mod tests;
