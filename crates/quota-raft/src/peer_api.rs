//! The server side of the peer protocol: an axum router for the peer listener (never the admin
//! listener), authenticated by the shared cluster secret.
//!
//! Requests without the secret get 401 before their body is read; bodies over the limit get 413;
//! bodies that do not decode get 400. None of these reach Raft.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest as _, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use openraft::raft::{AppendEntriesRequest, VoteRequest};

use crate::codec::{decode, encode, CodecError};
use crate::election::{self, PreVoteRequest};
use crate::proposal::{local_write, LeaderClock};
use crate::protocol::{
    unframe_snapshot, ForwardRequest, FrameError, PATH_APPEND, PATH_FORWARD, PATH_PRE_VOTE,
    PATH_SNAPSHOT, PATH_VOTE,
};
use crate::secret::{bearer, Secret};
use crate::telemetry::names;
use crate::tls::PeerIdentity;
use crate::types::alias::{Raft, Snapshot};
use crate::types::{NodeId, TypeConfig};
use quota_core::coordinator::Operation;

/// Limits and secrets of the peer API.
#[derive(Clone)]
pub struct PeerApiConfig {
    /// Shared by all members.
    pub cluster_secret: String,
    pub max_rpc_body_bytes: usize,
    pub max_snapshot_body_bytes: usize,
    /// The largest encoded command accepted into the log.
    pub max_command_bytes: usize,
    /// Upper bound on how long a forwarded write may wait for its commit.
    pub write_timeout: Duration,
    /// Stamps forwarded commands on the leader (see [`LeaderClock`]).
    pub leader_clock: Option<LeaderClock>,
    /// How recently a leader must have been heard for a pre-vote to be refused
    /// ([`crate::election::ElectionTimings::quiet`]).
    pub election_quiet: Duration,
    /// With peer TLS: certificate identity → region. Requests from a connection whose
    /// certificate names no member get 403, and so does a forwarded lease renewal for another
    /// region than the connection's.
    pub identities: Option<Arc<HashMap<String, String>>>,
}

impl std::fmt::Debug for PeerApiConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerApiConfig")
            .field("cluster_secret", &"<redacted>")
            .field("max_rpc_body_bytes", &self.max_rpc_body_bytes)
            .field("max_snapshot_body_bytes", &self.max_snapshot_body_bytes)
            .field("max_command_bytes", &self.max_command_bytes)
            .field("write_timeout", &self.write_timeout)
            .field("election_quiet", &self.election_quiet)
            .field("identities", &self.identities)
            .finish()
    }
}

#[derive(Clone)]
struct PeerState {
    raft: Raft,
    secret: Arc<Secret>,
    write_timeout: Duration,
    max_command_bytes: usize,
    leader_clock: Option<LeaderClock>,
    election_quiet: Duration,
    identities: Option<Arc<HashMap<String, String>>>,
}

/// A peer request that was refused before reaching Raft.
#[derive(Debug, thiserror::Error)]
enum PeerApiError {
    #[error("malformed body: {source}")]
    BadBody { source: CodecError },
    #[error("malformed snapshot: {source}")]
    BadSnapshot { source: FrameError },
    #[error("cannot encode the answer: {source}")]
    Encode { source: CodecError },
}

impl IntoResponse for PeerApiError {
    fn into_response(self) -> Response {
        match self {
            PeerApiError::BadBody { .. } | PeerApiError::BadSnapshot { .. } => {
                (StatusCode::BAD_REQUEST, self.to_string()).into_response()
            }
            PeerApiError::Encode { .. } => {
                tracing::error!(error = %self, "Peer answer not encodable.");
                StatusCode::INTERNAL_SERVER_ERROR.into_response()
            }
        }
    }
}

type PeerResult = Result<Vec<u8>, PeerApiError>;

fn answer<T: serde::Serialize>(value: &T) -> PeerResult {
    encode(value).map_err(|source| PeerApiError::Encode { source })
}

fn body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, PeerApiError> {
    decode(bytes).map_err(|source| PeerApiError::BadBody { source })
}

/// The peer router for `raft`.
pub fn router(raft: Raft, config: &PeerApiConfig) -> Router {
    let state = PeerState {
        raft,
        secret: Arc::new(Secret::new(config.cluster_secret.clone())),
        write_timeout: config.write_timeout,
        max_command_bytes: config.max_command_bytes,
        leader_clock: config.leader_clock.clone(),
        election_quiet: config.election_quiet,
        identities: config.identities.clone(),
    };
    let rpc = Router::new()
        .route(PATH_APPEND, post(append))
        .route(PATH_VOTE, post(vote))
        .route(PATH_PRE_VOTE, post(pre_vote))
        .route(PATH_FORWARD, post(forward))
        .layer(DefaultBodyLimit::max(config.max_rpc_body_bytes));
    let snapshot = Router::new()
        .route(PATH_SNAPSHOT, post(snapshot))
        .layer(DefaultBodyLimit::max(config.max_snapshot_body_bytes));
    rpc.merge(snapshot)
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .with_state(state)
}

/// Rejects requests without the cluster secret, compared by [`Secret::matches`].
async fn authenticate(State(state): State<PeerState>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| bearer(v.as_bytes()));
    if !presented.is_some_and(|t| state.secret.matches(t)) {
        return (StatusCode::UNAUTHORIZED, "missing or wrong cluster secret").into_response();
    }
    if let Some(ids) = &state.identities {
        if caller_region(ids, &req).is_none() {
            return refuse_identity(req.uri().path(), "the client certificate names no member");
        }
    }
    next.run(req).await
}

/// The region a TLS peer connection authenticates, if its certificate names a member.
pub fn caller_region<'a, B>(
    identities: &'a HashMap<String, String>,
    req: &axum::http::Request<B>,
) -> Option<&'a str> {
    let PeerIdentity(Some(id)) = req.extensions().get::<PeerIdentity>()? else {
        return None;
    };
    identities.get(&**id).map(String::as_str)
}

/// 403 for a peer whose certificate does not authenticate what it asks, counted by route.
pub fn refuse_identity(route: &str, why: &'static str) -> Response {
    metrics::counter!(names::PEER_IDENTITY_REFUSED_TOTAL, "route" => route.to_string())
        .increment(1);
    tracing::warn!(route, why, "Peer request refused: identity.");
    (StatusCode::FORBIDDEN, why).into_response()
}

async fn append(State(s): State<PeerState>, bytes: Bytes) -> PeerResult {
    let req: AppendEntriesRequest<TypeConfig> = body(&bytes)?;
    answer(&s.raft.append_entries(req).await)
}

async fn vote(State(s): State<PeerState>, bytes: Bytes) -> PeerResult {
    let req: VoteRequest<NodeId> = body(&bytes)?;
    answer(&s.raft.vote(req).await)
}

async fn pre_vote(State(s): State<PeerState>, bytes: Bytes) -> PeerResult {
    let req: PreVoteRequest = body(&bytes)?;
    answer(&election::answer(&s.raft, &req, s.election_quiet).await)
}

async fn snapshot(State(s): State<PeerState>, bytes: Bytes) -> PeerResult {
    let (header, data) =
        unframe_snapshot(&bytes).map_err(|source| PeerApiError::BadSnapshot { source })?;
    let snapshot = Snapshot {
        meta: header.meta,
        snapshot: Box::new(data.to_vec()),
    };
    answer(&s.raft.install_full_snapshot(header.vote, snapshot).await)
}

async fn forward(State(s): State<PeerState>, http: Request) -> Response {
    let region = s
        .identities
        .as_ref()
        .and_then(|ids| caller_region(ids, &http))
        .map(str::to_string);
    // The extractor, so the route's body limit holds.
    let bytes = match Bytes::from_request(http, &()).await {
        Ok(b) => b,
        Err(rejection) => return rejection.into_response(),
    };
    let req: ForwardRequest = match body(&bytes) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    // A region's certificate speaks for its own lease and agent role only.
    if let (
        Some(caller),
        Operation::RenewLease {
            region: claimed, ..
        }
        | Operation::RenewDaemonLease {
            region: claimed, ..
        }
        | Operation::ClaimAgent {
            region: claimed, ..
        }
        | Operation::ReleaseAgent {
            region: claimed, ..
        }
        | Operation::AgentPassed {
            region: claimed, ..
        },
    ) = (&region, &req.command.op)
    {
        if claimed.as_str() != caller {
            return refuse_identity(
                PATH_FORWARD,
                "a lease renewal or agent claim for another region",
            );
        }
    }
    forward_command(&s, req).await.into_response()
}

async fn forward_command(s: &PeerState, req: ForwardRequest) -> PeerResult {
    let timeout = Duration::from_millis(req.timeout_ms).min(s.write_timeout);
    answer(
        &local_write(
            &s.raft,
            req.command,
            timeout,
            s.max_command_bytes,
            s.leader_clock.as_ref(),
        )
        .await,
    )
}
