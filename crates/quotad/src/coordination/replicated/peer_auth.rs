//! Who sent a request to the peer usage routes: the peer token, and with peer TLS the region
//! its certificate names.

use axum::http::{header, StatusCode};
use quota_raft::peer_api::caller_region;

use super::Replicated;
use crate::secret::bearer;

/// A peer request's credentials: the peer token must be presented; with peer TLS, the region
/// the connection's certificate names (`Some(None)`: none), which the body must claim. `Err`
/// is the status to answer a request without the token with.
pub(super) fn peer_caller(
    me: &Replicated,
    req: &axum::extract::Request,
) -> Result<Option<Option<String>>, StatusCode> {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| bearer(v.as_bytes()));
    if !presented.is_some_and(|t| me.peer_token.matches(t)) {
        return Err(StatusCode::UNAUTHORIZED);
    }
    Ok(me
        .peer_tls
        .as_ref()
        .map(|s| caller_region(&s.identities, req).map(str::to_string)))
}
