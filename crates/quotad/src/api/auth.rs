//! Bearer tokens and scopes on routes, and the audit layer on mutations.
//!
//! [`require`] admits a request whose token ([`crate::tokens::Tokens`]) has the route's scope:
//! 401 for a missing or unknown token, 403 for one without the scope. [`audited`] wraps a
//! mutation and writes one audit event ([`crate::audit`]) for it, whatever its outcome, with
//! the caller [`require`] found and the versions the handler reports through [`Versions`].

use axum::extract::{FromRequestParts as _, RawPathParams, Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};

use crate::api::edge::REQUEST_ID;
use crate::api::problem::ApiError;
use crate::api::state::AppState;
use crate::audit;
use crate::secret::bearer;
use crate::tokens::{Caller, Scope};

/// The caller of `headers`' token, if its scope grants `needed`.
pub fn authorize(state: &AppState, headers: &HeaderMap, needed: Scope) -> Result<Caller, ApiError> {
    let caller = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| bearer(v.as_bytes()))
        .and_then(|t| state.tokens.lookup(t))
        .ok_or(ApiError::Unauthorized)?;
    if caller.scope.grants(needed) {
        Ok(caller)
    } else {
        Err(ApiError::Forbidden {
            token: caller.name.to_string(),
            has: caller.scope.as_str(),
            needs: needed.as_str(),
        })
    }
}

/// Whether the request carries the peer token in the forwarded header.
pub fn is_forwarded(state: &AppState, headers: &HeaderMap) -> bool {
    state.decider.is_peer_forward(
        headers
            .get(&crate::decision::FORWARDED_HEADER)
            .and_then(|v| v.to_str().ok()),
    )
}

/// Middleware admitting requests whose token has `scope` (see the module documentation).
/// The caller goes into the request's extensions for the handler, and into the response's
/// for [`audited`].
pub async fn require(
    State((state, scope)): State<(AppState, Scope)>,
    mut req: Request,
    next: Next,
) -> Response {
    // A decision another region forwarded here (a pinned tenant's charge, a hold of a budget
    // whose home is here, a settle of a hold made here) carries the peer token instead of an
    // API token: the sending region took the caller's token.
    if scope == Scope::Check && is_forwarded(&state, req.headers()) {
        return next.run(req).await;
    }
    match authorize(&state, req.headers(), scope) {
        Ok(caller) => {
            req.extensions_mut().insert(caller.clone());
            let mut resp = next.run(req).await;
            resp.extensions_mut().insert(caller);
            resp
        }
        Err(e) => {
            let caller = match &e {
                ApiError::Forbidden { .. } => req
                    .headers()
                    .get(header::AUTHORIZATION)
                    .and_then(|v| bearer(v.as_bytes()))
                    .and_then(|t| state.tokens.lookup(t)),
                _ => None,
            };
            let mut resp = e.into_response();
            if let Some(c) = caller {
                resp.extensions_mut().insert(c);
            }
            resp
        }
    }
}

/// What a mutation changed, for its audit event: a handler adds it to its response's
/// extensions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Versions {
    pub before: Option<u64>,
    pub after: Option<u64>,
}

/// Middleware writing one audit event for the mutation `action` (outside [`require`], so
/// refused attempts are audited too).
pub async fn audited(action: &'static str, req: Request, next: Next) -> Response {
    let (mut parts, body) = req.into_parts();
    let request_id = parts
        .headers
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let params: Vec<(String, String)> = RawPathParams::from_request_parts(&mut parts, &())
        .await
        .map(|p| {
            p.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .unwrap_or_default();
    let mut resp = next.run(Request::from_parts(parts, body)).await;
    let caller = resp.extensions_mut().remove::<Caller>();
    let versions = resp
        .extensions_mut()
        .remove::<Versions>()
        .unwrap_or_default();
    let param = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let status = resp.status();
    let outcome = match status.as_u16() {
        200..=299 => "ok",
        401 => "unauthorized",
        403 => "forbidden",
        400..=499 => "rejected",
        _ => "failed",
    };
    audit::record(&audit::Event {
        token: caller.as_ref().map(|c| &*c.name),
        action,
        tenant: param("tenant"),
        policy: param("policy"),
        plan: param("plan"),
        node_id: param("node_id"),
        version_before: versions.before,
        version_after: versions.after,
        request_id: request_id.as_deref(),
        outcome,
        status: status.as_u16(),
    });
    resp
}

/// Declares the bearer scheme in the OpenAPI document. Each guarded operation lists the scope
/// it needs (`check`, `read` or `admin`) in its `security` requirement; an `admin` token may
/// make every request.
#[derive(Debug)]
pub struct BearerScheme;

impl utoipa::Modify for BearerScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A token from QUOTAD_ADMIN_TOKEN (scope admin) or api.tokens_file. Each operation names the scope it needs; admin grants all.",
                    ))
                    .build(),
            ),
        );
    }
}
