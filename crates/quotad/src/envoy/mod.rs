//! Envoy's services on the `[envoy] listen` gRPC listener: the global rate limit service
//! ([`rls`], a decision per request) and the rate limit quota service ([`rlqs`], each Envoy
//! enforcing its assigned part of the region's share), with gRPC health. docs/envoy.md is the
//! reference.
//!
//! gRPC health answers for "", `ratelimit` and the full RLS service name, mirrors `/readyz`,
//! and turns `NOT_SERVING` as soon as shutdown begins.
//!
//! # Layout
//! - `mod.rs` (this file): the listener, its drain and gRPC health.
//! - [`rls`]: RLS v3 over the daemon's decision path.
//! - [`rlqs`]: RLQS, assignments from this region's share.
//! - [`subject`]: a limit's subject and policy, from descriptor entries and bucket ids.

pub mod rlqs;
pub mod rls;
pub mod subject;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use futures::stream::BoxStream;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

pub use rlqs::EnvoyQuota;
pub use rls::EnvoyRateLimit;

/// The names gRPC health answers for: the server as a whole, the name envoyproxy/ratelimit
/// registers, and the full service name.
pub const HEALTH_SERVICE_NAMES: [&str; 3] = [
    "",
    "ratelimit",
    "envoy.service.ratelimit.v3.RateLimitService",
];

/// How often gRPC health re-reads readiness (the flag `/readyz` answers from).
const READINESS_POLL: Duration = Duration::from_millis(50);

/// gRPC health (`grpc.health.v1`) for [`HEALTH_SERVICE_NAMES`]: `Check` answers the status
/// (`NOT_FOUND` for another name), `Watch` streams it (`SERVICE_UNKNOWN` for another name,
/// as the spec asks, without ending the call). Every stream ends when `stop` turns true, so
/// no open watch holds shutdown up.
#[derive(Debug, Clone)]
struct HealthService {
    status: watch::Receiver<ServingStatus>,
    stop: watch::Receiver<bool>,
}

fn health_response(status: ServingStatus) -> HealthCheckResponse {
    HealthCheckResponse {
        status: status as i32,
    }
}

#[tonic::async_trait]
impl Health for HealthService {
    async fn check(
        &self,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<HealthCheckResponse>, tonic::Status> {
        if !HEALTH_SERVICE_NAMES.contains(&request.get_ref().service.as_str()) {
            return Err(tonic::Status::not_found("unknown service"));
        }
        Ok(tonic::Response::new(health_response(*self.status.borrow())))
    }

    type WatchStream = BoxStream<'static, Result<HealthCheckResponse, tonic::Status>>;

    async fn watch(
        &self,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
        let known = HEALTH_SERVICE_NAMES.contains(&request.get_ref().service.as_str());
        let (mut status, stop) = (self.status.clone(), self.stop.clone());
        let first = if known {
            *status.borrow_and_update()
        } else {
            ServingStatus::ServiceUnknown
        };
        // A stop already sent ends the stream after the current status.
        let later =
            futures::stream::unfold((status, stop), move |(mut status, mut stop)| async move {
                let changed = tokio::select! {
                    // A change sent before the stop is streamed before the stream ends.
                    biased;
                    changed = status.changed(), if known => changed.is_ok(),
                    _ = stop.wait_for(|stopped| *stopped) => false,
                };
                let now = changed.then(|| *status.borrow_and_update())?;
                Some((Ok(health_response(now)), (status, stop)))
            });
        let stream = futures::StreamExt::chain(
            futures::stream::once(async move { Ok(health_response(first)) }),
            later,
        );
        Ok(tonic::Response::new(Box::pin(stream)))
    }
}

fn serving_status(ready: &AtomicBool) -> ServingStatus {
    if ready.load(Ordering::Relaxed) {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

/// Serves the rate limit service, the rate limit quota service and gRPC health on `listener` until `stop` turns true, then
/// lets in-flight calls finish for at most `drain` (an Envoy keeps its HTTP/2 connection open;
/// shutdown must not wait on it). Health mirrors readiness: `NOT_SERVING` while starting and
/// from the moment shutdown begins (readiness turns false before the API drains), then, on
/// `stop`, every watch stream ends.
pub async fn serve(
    service: EnvoyRateLimit,
    quota: EnvoyQuota,
    listener: tokio::net::TcpListener,
    stop: watch::Receiver<bool>,
    drain: Duration,
) -> Result<(), tonic::transport::Error> {
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    serve_incoming(service, quota, incoming, stop, drain).await
}

/// Like [`serve`], over TLS: connections handshaken by `incoming` (`[envoy] tls_*`).
pub async fn serve_tls(
    service: EnvoyRateLimit,
    quota: EnvoyQuota,
    incoming: quota_raft::tls::TlsIncoming,
    stop: watch::Receiver<bool>,
    drain: Duration,
) -> Result<(), tonic::transport::Error> {
    let incoming = futures::stream::unfold(incoming, |mut incoming| async move {
        let (tls, _remote) = incoming.next().await?;
        Some((Ok::<_, std::io::Error>(tls), incoming))
    });
    serve_incoming(service, quota, incoming, stop, drain).await
}

async fn serve_incoming<I, IO, IE>(
    service: EnvoyRateLimit,
    quota: EnvoyQuota,
    incoming: I,
    stop: watch::Receiver<bool>,
    drain: Duration,
) -> Result<(), tonic::transport::Error>
where
    I: futures::Stream<Item = Result<IO, IE>>,
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
    IO::ConnectInfo: Clone + Send + Sync + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let ready: Arc<AtomicBool> = service.state.ready.clone();
    let (status_tx, status) = watch::channel(serving_status(&ready));
    let (streams_tx, streams_stop) = watch::channel(false);
    let health = HealthService {
        status,
        stop: streams_stop.clone(),
    };
    let (mut graceful, mut deadline) = (stop.clone(), stop);
    let server = tonic::transport::Server::builder()
        .add_service(HealthServer::new(health))
        .add_service(RateLimitServiceServer::new(service))
        .add_service(RateLimitQuotaServiceServer::new(
            quota.ending_on(streams_stop),
        ))
        .serve_with_incoming_shutdown(incoming, async move {
            let mut poll = tokio::time::interval(READINESS_POLL);
            loop {
                tokio::select! {
                    _ = graceful.wait_for(|stopped| *stopped) => break,
                    _ = poll.tick() => {
                        let now = serving_status(&ready);
                        status_tx.send_if_modified(|s| std::mem::replace(s, now) != now);
                    }
                }
            }
            let not_serving = ServingStatus::NotServing;
            status_tx.send_if_modified(|s| std::mem::replace(s, not_serving) != not_serving);
            streams_tx.send_replace(true);
        });
    tokio::select! {
        served = server => served,
        () = async {
            let _ = deadline.wait_for(|stopped| *stopped).await;
            tokio::time::sleep(drain).await;
        } => Ok(()),
    }
}
