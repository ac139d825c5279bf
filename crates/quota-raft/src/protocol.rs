//! The peer protocol shared by [`crate::network`] (client) and [`crate::peer_api`] (server):
//! routes, message types and the snapshot framing.
//!
//! Every body is [`crate::codec`]-encoded. A request carries `Authorization: Bearer <secret>`.
//! Raft RPC answers are `Result<openraft response, openraft error>`, so a remote Raft error
//! travels as a value and only transport failures are HTTP errors.

use quota_core::coordinator::Command;
use serde::{Deserialize, Serialize};

use crate::codec::{decode, encode, CodecError};
use crate::types::alias::{SnapshotMeta, Vote};
use crate::types::{NodeId, Reply};

/// AppendEntries (and heartbeats).
pub const PATH_APPEND: &str = "/raft/v1/append";
/// RequestVote.
pub const PATH_VOTE: &str = "/raft/v1/vote";
/// A whole snapshot in one message.
pub const PATH_SNAPSHOT: &str = "/raft/v1/snapshot";
/// The election guard's pre-vote question ([`crate::election`]).
pub const PATH_PRE_VOTE: &str = "/raft/v1/pre-vote";
/// A client write forwarded by a follower to the leader.
pub const PATH_FORWARD: &str = "/raft/v1/forward";

/// A write forwarded to the leader. The leader applies it locally or refuses; it never forwards
/// again, so a stale view of leadership costs a retry, not a loop.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForwardRequest {
    pub command: Command,
    /// What is left of the caller's deadline; the leader gives up after it.
    pub timeout_ms: u64,
}

/// The leader's answer to a [`ForwardRequest`].
pub type ForwardReply = Result<Reply, ForwardRefusal>;

/// Why a forwarded write was not committed by the node it reached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ForwardRefusal {
    #[error("not the leader (leader: {leader_id:?})")]
    NotLeader { leader_id: Option<NodeId> },
    #[error("not committed within {timeout_ms} ms")]
    Timeout { timeout_ms: u64 },
    #[error("raft stopped: {message}")]
    Fatal { message: String },
    #[error("rejected: {message}")]
    Rejected { message: String },
    #[error("command of {bytes} bytes exceeds the limit of {max_bytes}")]
    TooLarge { bytes: usize, max_bytes: usize },
}

/// What precedes the snapshot data in a snapshot message.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotHeader {
    pub vote: Vote,
    pub meta: SnapshotMeta,
}

/// Why a snapshot message could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("snapshot message shorter than its header length ({len} bytes)")]
    Truncated { len: usize },
    #[error("snapshot header: {source}")]
    Header {
        #[from]
        source: CodecError,
    },
}

/// Frames a snapshot as `[header length: u32 LE][encoded header][data]`, so the (already
/// encoded) data is not encoded a second time.
pub fn frame_snapshot(header: &SnapshotHeader, data: &[u8]) -> Result<Vec<u8>, CodecError> {
    let head = encode(header)?;
    let mut out = Vec::with_capacity(4 + head.len() + data.len());
    out.extend_from_slice(&(head.len() as u32).to_le_bytes());
    out.extend_from_slice(&head);
    out.extend_from_slice(data);
    Ok(out)
}

/// Splits a message framed by [`frame_snapshot`].
pub fn unframe_snapshot(body: &[u8]) -> Result<(SnapshotHeader, &[u8]), FrameError> {
    let truncated = FrameError::Truncated { len: body.len() };
    let (len, rest) = body.split_first_chunk::<4>().ok_or(truncated)?;
    let len = u32::from_le_bytes(*len) as usize;
    if rest.len() < len {
        return Err(FrameError::Truncated { len: body.len() });
    }
    let (head, data) = rest.split_at(len);
    Ok((decode(head)?, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_frame_round_trip_and_truncation() {
        let header = SnapshotHeader {
            vote: Vote::new(3, 1),
            meta: SnapshotMeta::default(),
        };
        let framed = frame_snapshot(&header, b"data").unwrap();
        let (h, d) = unframe_snapshot(&framed).unwrap();
        assert_eq!(h.vote, header.vote);
        assert_eq!(d, b"data");
        for cut in 0..framed.len() - 4 {
            assert!(unframe_snapshot(&framed[..cut]).is_err(), "cut at {cut}");
        }
    }
}
