//! The routes as one service: `POST /v1/check` goes straight to its handler, everything else
//! through the axum router.
//!
//! A check is the one request a gateway makes per API call, so it skips what the router does
//! per request and the check never uses: the route lookup, the `MatchedPath` extension (a
//! hash map allocated and dropped per request) and two boxed futures. On the load bench that
//! was ~3 000 instructions of ~43 000 per check. The router still holds the route, so other
//! methods on the path get its 405 and the OpenAPI document is unchanged; a test holds the
//! two paths' answers equal.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::extract::{Request, State};
use axum::http::Method;
use axum::response::{IntoResponse as _, Response};
use axum::Router;
use tower::Service;

use crate::api::state::AppState;
use crate::api::{auth, check};
use crate::tokens::Scope;

/// The path the fast path serves (with `POST`).
pub const CHECK_PATH: &str = "/v1/check";

/// Boxed on both paths: the edge layer holds this future in its own (boxed) one, and an
/// unboxed router future would make that box, and the copy into it, several times larger.
type RoutesFuture = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

/// See the module documentation.
#[derive(Clone)]
pub struct Routes {
    router: Router,
    state: AppState,
}

impl Routes {
    /// `router` must serve [`CHECK_PATH`] with [`check::check`] on `state`, behind the same token
    /// check as here (`api.open_checks`), as `api::app` builds it.
    pub fn new(router: Router, state: AppState) -> Self {
        Self { router, state }
    }
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes").finish_non_exhaustive()
    }
}

impl Service<Request> for Routes {
    type Response = Response;
    type Error = Infallible;
    type Future = RoutesFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Service::<Request>::poll_ready(&mut self.router, cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        // The router matches on the path alone (a query string does not change the route).
        if req.method() == Method::POST && req.uri().path() == CHECK_PATH {
            let state = self.state.clone();
            if !state.open_checks && !auth::is_forwarded(&state, req.headers()) {
                if let Err(e) = auth::authorize(&state, req.headers(), Scope::Check) {
                    return Box::pin(async move { Ok(e.into_response()) });
                }
            }
            Box::pin(async move { Ok(check::check(State(state), req).await.into_response()) })
        } else {
            Box::pin(self.router.call(req))
        }
    }
}
