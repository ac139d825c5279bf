//! Checks, charges and holds (made, settled, released) other regions forward here over the peer listener (with peer TLS): the
//! same handlers as `/v1/check`, `/v1/check/batch` and `/v1/charges`, at [`PEER_FORWARD_PREFIX`] on the peer
//! port, so a pinned tenant's checks cross the WAN encrypted and authenticated by the
//! sending region's certificate rather than in clear to the API port.
//!
//! A forwarded check needs the peer token (in the forwarded header, which also keeps it from
//! being forwarded again), a client certificate naming a member, and a forwarded-from header
//! naming that member's region: a check claiming region X over a connection authenticated as
//! Y is refused with 403 and counted, as usage reports and lease renewals are.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse as _, Response};
use axum::routing::post;
use axum::Router;
use quota_raft::peer_api::{caller_region, refuse_identity};

use crate::api::state::AppState;
use crate::api::{batch, charges, check, holds, routes};
use crate::decision::holds::HOLDS_PATH;
use crate::decision::{CHARGES_PATH, FORWARDED_FROM_HEADER, FORWARDED_HEADER, PEER_FORWARD_PREFIX};

/// Certificate identity → region (see `quota_raft::coordinator::PeerSecurity`).
pub type Identities = Arc<HashMap<String, String>>;

/// The forward routes for the peer listener; `identities` with peer TLS.
pub fn peer_router(state: AppState, identities: Option<Identities>) -> Router {
    let check_path = format!("{PEER_FORWARD_PREFIX}{}", routes::CHECK_PATH);
    let batch_path = format!("{PEER_FORWARD_PREFIX}/v1/check/batch");
    let charges_path = format!("{PEER_FORWARD_PREFIX}{CHARGES_PATH}");
    let holds_path = format!("{PEER_FORWARD_PREFIX}{HOLDS_PATH}");
    Router::new()
        .route(&check_path, post(check::check))
        .route(&batch_path, post(batch::check_batch))
        .route(&charges_path, post(charges::charge))
        .route(&holds_path, post(holds::hold))
        .route(&format!("{holds_path}/{{id}}/settle"), post(holds::settle))
        .route(
            &format!("{holds_path}/{{id}}/release"),
            post(holds::release_by_post),
        )
        .layer(DefaultBodyLimit::max(state.body_limit_bytes))
        .layer(middleware::from_fn_with_state(
            (state.clone(), identities),
            admit,
        ))
        .with_state(state)
}

/// 401 without the peer token; with peer TLS, 403 (counted) for a certificate naming no
/// member or a forwarded-from region other than the certificate's.
async fn admit(
    State((state, identities)): State<(AppState, Option<Identities>)>,
    req: Request,
    next: Next,
) -> Response {
    let headers = req.headers();
    let token = headers.get(&FORWARDED_HEADER).and_then(|v| v.to_str().ok());
    if !state.decider.is_peer_forward(token) {
        return (StatusCode::UNAUTHORIZED, "missing or wrong peer token").into_response();
    }
    if let Some(ids) = &identities {
        let route = req.uri().path().to_string();
        let Some(caller) = caller_region(ids, &req) else {
            return refuse_identity(&route, "the client certificate names no member");
        };
        let claimed = headers
            .get(&FORWARDED_FROM_HEADER)
            .and_then(|v| v.to_str().ok());
        if claimed != Some(caller) {
            return refuse_identity(&route, "a forwarded check for another region");
        }
    }
    next.run(req).await
}
