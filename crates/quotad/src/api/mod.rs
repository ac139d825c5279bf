//! The admin and decision API (axum). `app(state)` builds the whole router, so tests drive it
//! with `oneshot` and no socket.
//!
//! Layout: [`check`] (decisions), [`tenants`] (policies, pins, allowance), [`cluster`] (status,
//! membership, listing, health, metrics), [`problem`] (the one `ApiError`), [`auth`] (bearer
//! token on mutations).

pub mod auth;
pub mod check;
pub mod cluster;
pub mod problem;
pub mod tenants;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderName, HeaderValue, Request, StatusCode};
use axum::middleware;
use axum::routing::{delete, get, post, put};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tower::ServiceBuilder;
use tower_http::request_id::{
    MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer,
};
use tower_http::timeout::TimeoutLayer;
use utoipa::OpenApi;

use crate::api::auth::BearerScheme;
use crate::config::Secret;
use crate::coordination::Coordinator;
use crate::decision::Decider;

/// Everything handlers share. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
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

/// The request id header, set when the client sent none and echoed in the response.
pub const REQUEST_ID: &str = "x-request-id";

/// Request ids: a random per-process prefix and a counter; no allocation-heavy UUID work.
#[derive(Debug, Clone)]
struct RequestIds {
    prefix: u32,
    next: Arc<AtomicU64>,
}

impl MakeRequestId for RequestIds {
    fn make_request_id<B>(&mut self, _: &Request<B>) -> Option<RequestId> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        header_value(format_args!("{:08x}-{n:x}", self.prefix)).map(RequestId::new)
    }
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

/// Oversized bodies read and discarded before answering 413, up to this many bytes: a client
/// still sending when the server closes would see a reset instead of the problem response.
const DRAIN_MAX_BYTES: u64 = 1 << 20;

/// Answers a declared-oversized body with 413 after draining it (bounded), so the client reads
/// the problem response instead of a connection reset.
async fn reject_oversized(
    axum::extract::State(limit): axum::extract::State<usize>,
    req: axum::extract::Request,
    next: middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(n) if n > limit as u64 => {
            if n <= DRAIN_MAX_BYTES {
                let body = req.into_body();
                let drain = axum::body::to_bytes(body, DRAIN_MAX_BYTES as usize);
                let _ = tokio::time::timeout(Duration::from_secs(2), drain).await;
            }
            problem::ApiError::TooLarge.into_response()
        }
        _ => next.run(req).await,
    }
}

/// The router: routes, auth on mutations, body limit, timeout, request ids.
pub fn app(state: AppState) -> Router {
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
    let ids = RequestIds {
        prefix: rand::random(),
        next: Arc::new(AtomicU64::new(1)),
    };
    let header = HeaderName::from_static(REQUEST_ID);
    let body_limit = state.body_limit_bytes;
    let timeout = state.request_timeout;
    let routes = open
        .merge(guarded)
        .fallback(|| async { problem::ApiError::NotFound { what: "route" } })
        .with_state(state);
    // The layers wrap the router once, outermost first. `Router::layer` would wrap every route
    // in each layer separately, and each of those boxed services is cloned and its future boxed
    // on every request: five layers cost ~20 allocations per request that way.
    let layered = ServiceBuilder::new()
        .layer(SetRequestIdLayer::new(header.clone(), ids))
        .layer(PropagateRequestIdLayer::new(header))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            timeout,
        ))
        .layer(middleware::from_fn_with_state(body_limit, reject_oversized))
        .layer(DefaultBodyLimit::max(body_limit))
        .service(routes);
    Router::new().fallback_service(layered)
}

#[cfg(test)]
mod tests;
