//! The one middleware in front of every route: request id, body size limit, request timeout.
//!
//! One layer instead of five (tower-http's `SetRequestId`, `PropagateRequestId` and `Timeout`,
//! an axum `from_fn` for oversized bodies and `DefaultBodyLimit`): each of those costs its own
//! service clone, boxed future, extension or header pass per request. Measured on the load bench
//! at concurrency 64, they took ~3 µs of server CPU per check, about a sixth of the whole path.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderName, HeaderValue};
use axum::response::{IntoResponse as _, Response};
use http_body_util::Limited;
use tower::{Layer, Service};

use crate::api::header_text::HeaderText;
use crate::api::problem::ApiError;

/// The request id header: echoed when the client sent one, generated otherwise.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Oversized bodies read and discarded before answering 413, up to this many bytes: a client
/// still sending when the server closes would see a reset instead of the problem response.
const DRAIN_MAX_BYTES: u64 = 1 << 20;
/// How long an oversized body may take to drain before the 413 goes out anyway.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Request ids: a random per-process prefix and a counter, so ids from different processes (or
/// restarts) differ with high probability and no UUID work is spent per request.
#[derive(Debug, Clone)]
struct RequestIds {
    prefix: u32,
    next: Arc<AtomicU64>,
}

impl RequestIds {
    fn next(&self) -> Option<HeaderValue> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        HeaderText::new()
            .hex(self.prefix.into(), 8)
            .str("-")
            .hex(n, 1)
            .value()
    }
}

/// Wraps a service in [`Edge`].
#[derive(Debug, Clone)]
pub struct EdgeLayer {
    ids: RequestIds,
    body_limit: usize,
    timeout: Duration,
}

impl EdgeLayer {
    /// Bodies over `body_limit` bytes get 413 (declared ones before the handler runs); requests
    /// taking longer than `timeout` get a 503 problem.
    pub fn new(body_limit: usize, timeout: Duration) -> Self {
        Self {
            ids: RequestIds {
                prefix: rand::random(),
                next: Arc::new(AtomicU64::new(1)),
            },
            body_limit,
            timeout,
        }
    }
}

impl<S> Layer<S> for EdgeLayer {
    type Service = Edge<S>;

    fn layer(&self, inner: S) -> Edge<S> {
        Edge {
            inner,
            layer: self.clone(),
        }
    }
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct Edge<S> {
    inner: S,
    layer: EdgeLayer,
}

impl<S> Service<Request> for Edge<S>
where
    S: Service<Request, Response = Response, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        let mut req = req;
        let id = match req.headers().get(&REQUEST_ID) {
            Some(id) => Some(id.clone()),
            None => {
                // On the request too, so the audit log names the id the response carries.
                let id = self.layer.ids.next();
                if let Some(id) = &id {
                    req.headers_mut().insert(REQUEST_ID, id.clone());
                }
                id
            }
        };
        // With a Transfer-Encoding the body's length is not the declared one (RFC 9112 §6.3).
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .filter(|_| !req.headers().contains_key(header::TRANSFER_ENCODING))
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let limit = self.layer.body_limit;
        let req = match declared {
            // hyper reads exactly the declared length, so a declared size within the limit
            // needs no further counting.
            Some(n) if n <= limit as u64 => req,
            Some(_) => {
                return Box::pin(async move {
                    if declared.is_some_and(|n| n <= DRAIN_MAX_BYTES) {
                        let drain = axum::body::to_bytes(req.into_body(), DRAIN_MAX_BYTES as usize);
                        let _ = tokio::time::timeout(DRAIN_TIMEOUT, drain).await;
                    }
                    Ok(with_id(ApiError::TooLarge.into_response(), id))
                });
            }
            // A chunked body is counted as it is read; the JSON extractor answers 413 past it.
            None => req.map(|b| Body::new(Limited::new(b, limit))),
        };
        let timeout = self.layer.timeout;
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = match tokio::time::timeout(timeout, fut).await {
                Ok(Ok(resp)) => resp,
                Ok(Err(never)) => match never {},
                Err(_) => ApiError::Timeout {
                    after_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                }
                .into_response(),
            };
            Ok(with_id(resp, id))
        })
    }
}

fn with_id(mut resp: Response, id: Option<HeaderValue>) -> Response {
    if let Some(id) = id {
        resp.headers_mut().insert(REQUEST_ID, id);
    }
    resp
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;
    use axum::routing::{get, post};
    use axum::Router;
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    use super::*;

    /// A router with a quick route, an echo of the body and a route that takes a minute.
    fn service() -> Edge<Router> {
        let router = Router::new()
            .route("/quick", get(|| async { "ok" }))
            .route("/echo", post(|body: String| async move { body }))
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    "late"
                }),
            );
        EdgeLayer::new(64, Duration::from_secs(5)).layer(router)
    }

    async fn problem_code(resp: Response) -> String {
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        v["code"].as_str().unwrap().to_string()
    }

    #[tokio::test]
    async fn ids_are_generated_unique_and_client_ids_echoed() {
        let svc = service();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..3 {
            let req = Request::get("/quick").body(Body::empty()).unwrap();
            let resp = svc.clone().oneshot(req).await.unwrap();
            assert_eq!(resp.status(), StatusCode::OK);
            let id = resp.headers()[&REQUEST_ID].to_str().unwrap().to_string();
            assert!(seen.insert(id), "a generated id repeated");
        }
        let req = Request::get("/quick")
            .header(&REQUEST_ID, "client-chosen-7")
            .body(Body::empty())
            .unwrap();
        let resp = svc.oneshot(req).await.unwrap();
        assert_eq!(resp.headers()[&REQUEST_ID], "client-chosen-7");
    }

    /// A POST to /echo declaring `length`.
    fn post_echo(length: &str, body: Vec<u8>) -> Request<Body> {
        Request::post("/echo")
            .header(header::CONTENT_LENGTH, length)
            .body(Body::from(body))
            .unwrap()
    }

    #[tokio::test]
    async fn a_body_declared_over_the_limit_is_413_before_the_handler() {
        let req = post_echo("65", vec![b'x'; 65]);
        let resp = service().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert!(resp.headers().contains_key(&REQUEST_ID));
        assert_eq!(problem_code(resp).await, "PAYLOAD_TOO_LARGE");

        // Sent without a length, or with a length beside a Transfer-Encoding, the body is
        // counted as it is read.
        for declared in [Some("10"), None] {
            let mut req = Request::post("/echo");
            if let Some(length) = declared {
                req = req
                    .header(header::CONTENT_LENGTH, length)
                    .header(header::TRANSFER_ENCODING, "chunked");
            }
            let chunks = (0..5).map(|_| Ok::<_, Infallible>(vec![b'z'; 20]));
            let req = req
                .body(Body::from_stream(futures::stream::iter(chunks)))
                .unwrap();
            let resp = service().oneshot(req).await.unwrap();
            assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE, "{declared:?}");
        }

        // At the limit, the handler runs.
        let req = post_echo("64", vec![b'y'; 64]);
        let resp = service().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body.len(), 64);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_over_the_timeout_is_a_503_problem() {
        let req = Request::get("/slow").body(Body::empty()).unwrap();
        let started = tokio::time::Instant::now();
        let resp = service().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert!(resp.headers().contains_key(&REQUEST_ID));
        assert_eq!(
            resp.headers()[header::CONTENT_TYPE],
            crate::api::problem::PROBLEM_JSON
        );
        assert_eq!(problem_code(resp).await, "REQUEST_TIMEOUT");
    }
}
