//! The admin and decision API (axum). `app(state)` builds the whole router, so tests drive it
//! with `oneshot` and no socket.
//!
//! Layout: [`edge`] (request id, body limit and timeout in front of every route), [`routes`]
//! (`POST /v1/check` past the router, the rest through it), [`check`] (decisions), [`batch`]
//! (batches of them), [`tenants`] (policies, pins, allowance), [`policy_batch`] (many
//! policies in one step), [`cluster`] (status,
//! membership, listing, health, metrics), [`problem`] (the one `ApiError`), [`auth`] (bearer
//! token on mutations).

pub mod auth;
pub mod batch;
pub mod check;
pub mod cluster;
pub mod contract;
pub mod edge;
pub mod policy_batch;
pub mod problem;
pub mod routes;
pub mod tenants;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderValue;
use axum::middleware;
use axum::routing::{delete, get, post, put, MethodRouter};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tower::Layer as _;
use utoipa::OpenApi;

use crate::api::auth::BearerScheme;
use crate::api::contract::Contract;
use crate::config::Secret;
use crate::coordination::Coordinator;
use crate::decision::Decider;

/// The whole API as one service: the [`routes`] behind the [`edge`] layer.
pub type Api = edge::Edge<routes::Routes>;

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

/// A header value built in a stack buffer, so the value's own bytes are the only allocation.
/// Decision responses build three per check; `core::fmt` took ~1 900 instructions for each,
/// this takes a few hundred.
#[derive(Debug)]
pub(crate) struct HeaderText {
    buf: [u8; 128],
    len: usize,
    /// Set when the text outgrew `buf`; `spill` then holds all of it.
    spill: Option<Vec<u8>>,
}

impl HeaderText {
    pub(crate) fn new() -> Self {
        Self {
            buf: [0; 128],
            len: 0,
            spill: None,
        }
    }

    #[inline]
    pub(crate) fn push(&mut self, bytes: &[u8]) -> &mut Self {
        if let Some(v) = &mut self.spill {
            v.extend_from_slice(bytes);
        } else if let Some(dst) = self.buf.get_mut(self.len..self.len + bytes.len()) {
            dst.copy_from_slice(bytes);
            self.len += bytes.len();
        } else {
            let mut v = self.buf[..self.len].to_vec();
            v.extend_from_slice(bytes);
            self.spill = Some(v);
        }
        self
    }

    pub(crate) fn str(&mut self, s: &str) -> &mut Self {
        self.push(s.as_bytes())
    }

    /// `n` in decimal.
    pub(crate) fn num(&mut self, n: u64) -> &mut Self {
        let mut b = itoa::Buffer::new();
        self.push(b.format(n).as_bytes())
    }

    /// `n` in lower-case hex, zero-padded to at least `width` digits (at most 16).
    pub(crate) fn hex(&mut self, n: u64, width: usize) -> &mut Self {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut b = [0u8; 16];
        let digits = (16 - n.leading_zeros() as usize / 4).max(width.min(16));
        for (i, d) in b[16 - digits..].iter_mut().enumerate() {
            *d = DIGITS[(n >> (4 * (digits - 1 - i))) as usize & 0xf];
        }
        self.push(&b[16 - digits..])
    }

    /// The value, or `None` if it holds a byte a header value may not.
    pub(crate) fn value(&self) -> Option<HeaderValue> {
        match &self.spill {
            Some(v) => HeaderValue::from_bytes(v).ok(),
            None => HeaderValue::from_bytes(&self.buf[..self.len]).ok(),
        }
    }
}

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

/// Every route, with auth on mutations. The token is checked per method, after the router
/// chose one, so a method a path does not serve is a 405 with or without a token.
pub(crate) fn router(state: AppState) -> Router {
    let auth = || middleware::from_fn_with_state(state.clone(), auth::require_token);
    let guarded = |m: MethodRouter<AppState>| m.route_layer(auth());
    Router::new()
        .route(routes::CHECK_PATH, post(check::check))
        .route("/v1/check/batch", post(batch::check_batch))
        .route(
            "/v1/tenants/{tenant}/policies/{policy}",
            get(tenants::get_policy).merge(guarded(
                put(tenants::put_policy).delete(tenants::delete_policy),
            )),
        )
        .route(
            "/v1/tenants/{tenant}/pin",
            guarded(put(tenants::put_pin).delete(tenants::delete_pin)),
        )
        .route("/v1/tenants/{tenant}/allowance", get(tenants::allowance))
        .route("/v1/policies", guarded(get(cluster::list_policies)))
        .route(
            "/v1/policies/batch",
            guarded(post(policy_batch::put_policies)),
        )
        .route("/v1/status", get(cluster::status))
        .route(
            "/v1/cluster/members",
            get(cluster::members).merge(guarded(post(cluster::add_member))),
        )
        .route(
            "/v1/cluster/members/{node_id}/promote",
            guarded(post(cluster::promote_member)),
        )
        .route(
            "/v1/cluster/members/{node_id}",
            guarded(delete(cluster::remove_member)),
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
