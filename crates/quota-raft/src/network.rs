//! The client side of the peer protocol: openraft's network over HTTP with one pooled client.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use openraft::error::{
    Fatal, NetworkError, RPCError, RaftError, RemoteError, ReplicationClosed, StreamingError,
    Timeout, Unreachable,
};
use openraft::network::{RPCOption, RPCTypes, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::OptionalSend;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::codec::{decode, encode, CodecError};
use crate::election::{PreVoteAnswer, PreVoteRequest, PreVoteTransport};
use crate::protocol::{
    frame_snapshot, ForwardReply, ForwardRequest, SnapshotHeader, PATH_APPEND, PATH_FORWARD,
    PATH_PRE_VOTE, PATH_SNAPSHOT, PATH_VOTE,
};
use crate::tls::{PeerHttp, PeerTls};
use crate::types::alias::{Snapshot, Vote};
use crate::types::{Member, NodeId, TypeConfig};

/// How long to wait for a TCP connection: peers are either up (fast) or not.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Why one peer request failed.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: String,
        source: reqwest::Error,
    },
    #[error("no answer from {addr} within {timeout:?}")]
    Timeout { addr: String, timeout: Duration },
    #[error("request to {addr} failed: {source}")]
    Http {
        addr: String,
        source: reqwest::Error,
    },
    #[error("{addr} answered HTTP {status}")]
    Status { addr: String, status: u16 },
    #[error("cannot encode or decode a peer message: {source}")]
    Codec {
        #[from]
        source: CodecError,
    },
}

/// openraft's network factory, and the forwarding client, over HTTP.
///
/// Cloning shares the connection pool: openraft asks for a client per replication stream.
#[derive(Clone)]
pub struct HttpNetwork {
    node_id: NodeId,
    /// Rebuilt after a certificate rotation (see [`PeerHttp`]).
    http: PeerHttp,
    authorization: Arc<str>,
}

impl std::fmt::Debug for HttpNetwork {
    // Hand-written so the cluster secret never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpNetwork")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

impl HttpNetwork {
    /// A network for node `node_id`, authenticating with `cluster_secret`.
    pub fn new(node_id: NodeId, cluster_secret: &str) -> Result<Self, reqwest::Error> {
        Self::with_tls(node_id, cluster_secret, None)
    }

    /// Like [`HttpNetwork::new`], over mutual TLS with `tls` when given: this node's
    /// certificate presented, each peer verified against the CA and the host name or IP
    /// address dialled (resolved per connection).
    pub fn with_tls(
        node_id: NodeId,
        cluster_secret: &str,
        tls: Option<&PeerTls>,
    ) -> Result<Self, reqwest::Error> {
        let http = PeerHttp::new(tls, |b| {
            b.connect_timeout(CONNECT_TIMEOUT)
                .tcp_nodelay(true)
                .pool_idle_timeout(Duration::from_secs(60))
        })?;
        Ok(Self {
            node_id,
            http,
            authorization: format!("Bearer {cluster_secret}").into(),
        })
    }

    /// POSTs an encoded body and returns the raw answer body of a 2xx response.
    async fn post_bytes(
        &self,
        addr: &str,
        path: &str,
        body: Vec<u8>,
        timeout: Duration,
    ) -> Result<Bytes, PeerError> {
        let url = format!("{}://{addr}{path}", self.http.scheme());
        let classify = |source: reqwest::Error| {
            if source.is_timeout() {
                PeerError::Timeout {
                    addr: addr.to_string(),
                    timeout,
                }
            } else if source.is_connect() {
                PeerError::Connect {
                    addr: addr.to_string(),
                    source,
                }
            } else {
                PeerError::Http {
                    addr: addr.to_string(),
                    source,
                }
            }
        };
        let resp = self
            .http
            .client()
            .post(url)
            .header(reqwest::header::AUTHORIZATION, &*self.authorization)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .timeout(timeout)
            .body(body)
            .send()
            .await
            .map_err(classify)?;
        let status = resp.status();
        if !status.is_success() {
            return Err(PeerError::Status {
                addr: addr.to_string(),
                status: status.as_u16(),
            });
        }
        resp.bytes().await.map_err(classify)
    }

    async fn post<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        req: &Req,
        timeout: Duration,
    ) -> Result<Resp, PeerError> {
        let body = encode(req)?;
        let bytes = self.post_bytes(addr, path, body, timeout).await?;
        Ok(decode(&bytes)?)
    }

    /// Forwards a write to the leader at `member`.
    pub async fn forward(
        &self,
        member: &Member,
        req: &ForwardRequest,
        timeout: Duration,
    ) -> Result<ForwardReply, PeerError> {
        self.post(&member.peer_addr, PATH_FORWARD, req, timeout)
            .await
    }
}

impl PreVoteTransport for HttpNetwork {
    async fn pre_vote(
        &self,
        target: NodeId,
        member: &Member,
        req: &PreVoteRequest,
        timeout: Duration,
    ) -> Option<PreVoteAnswer> {
        let answer: Result<Option<PreVoteAnswer>, PeerError> = self
            .post(&member.peer_addr, PATH_PRE_VOTE, req, timeout)
            .await;
        answer
            .inspect_err(|e| tracing::debug!(target, error = %e, "Pre-vote unanswered."))
            .ok()
            .flatten()
    }
}

impl RaftNetworkFactory<TypeConfig> for HttpNetwork {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &Member) -> PeerClient {
        PeerClient {
            net: self.clone(),
            target,
            member: node.clone(),
        }
    }
}

/// The connection to one peer, as openraft sees it.
#[derive(Debug)]
pub struct PeerClient {
    net: HttpNetwork,
    target: NodeId,
    member: Member,
}

type RpcResult<T> = Result<T, RPCError<NodeId, Member, RaftError<NodeId>>>;

impl PeerClient {
    fn rpc_error(
        &self,
        action: RPCTypes,
        e: PeerError,
    ) -> RPCError<NodeId, Member, RaftError<NodeId>> {
        match e {
            PeerError::Connect { .. } => RPCError::Unreachable(Unreachable::new(&e)),
            PeerError::Timeout { timeout, .. } => RPCError::Timeout(Timeout {
                action,
                id: self.net.node_id,
                target: self.target,
                timeout,
            }),
            other => RPCError::Network(NetworkError::new(&other)),
        }
    }

    async fn call<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        action: RPCTypes,
        path: &str,
        req: &Req,
        option: &RPCOption,
    ) -> RpcResult<Resp> {
        let answer: Result<Resp, RaftError<NodeId>> = self
            .net
            .post(&self.member.peer_addr, path, req, option.hard_ttl())
            .await
            .map_err(|e| self.rpc_error(action, e))?;
        answer.map_err(|e| {
            RPCError::RemoteError(RemoteError::new_with_node(
                self.target,
                self.member.clone(),
                e,
            ))
        })
    }
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>> {
        self.call(RPCTypes::AppendEntries, PATH_APPEND, &rpc, &option)
            .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>> {
        self.call(RPCTypes::Vote, PATH_VOTE, &rpc, &option).await
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<NodeId>, StreamingError<TypeConfig, Fatal<NodeId>>> {
        let header = SnapshotHeader {
            vote,
            meta: snapshot.meta,
        };
        let body = frame_snapshot(&header, &snapshot.snapshot)
            .map_err(|e| StreamingError::Network(NetworkError::new(&e)))?;
        let timeout = option.hard_ttl();
        let send = self
            .net
            .post_bytes(&self.member.peer_addr, PATH_SNAPSHOT, body, timeout);
        let bytes = tokio::select! {
            closed = cancel => return Err(StreamingError::Closed(closed)),
            r = send => r,
        };
        let bytes = bytes.map_err(|e| match e {
            PeerError::Connect { .. } => StreamingError::Unreachable(Unreachable::new(&e)),
            PeerError::Timeout { timeout, .. } => StreamingError::Timeout(Timeout {
                action: RPCTypes::InstallSnapshot,
                id: self.net.node_id,
                target: self.target,
                timeout,
            }),
            other => StreamingError::Network(NetworkError::new(&other)),
        })?;
        let answer: Result<SnapshotResponse<NodeId>, Fatal<NodeId>> =
            decode(&bytes).map_err(|e| StreamingError::Network(NetworkError::new(&e)))?;
        answer.map_err(|e| {
            StreamingError::RemoteError(RemoteError::new_with_node(
                self.target,
                self.member.clone(),
                e,
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_the_secret() {
        let net = HttpNetwork::new(1, "very-secret-value-123").unwrap();
        assert!(!format!("{net:?}").contains("very-secret"));
    }
}
