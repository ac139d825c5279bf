//! Proposing a command on this node's Raft: the part of a write that the coordinator (local
//! writes) and the peer API (writes forwarded from followers) share.
//!
//! A leaf below both, so neither imports the other for it.

use std::sync::Arc;
use std::time::Duration;

use openraft::error::{ClientWriteError, RaftError};
use quota_core::coordinator::Command;

use crate::codec::encode;
use crate::protocol::{ForwardRefusal, ForwardReply};
use crate::types::alias::Raft;

/// The leader's clock in ms since the epoch. When set, the leader stamps every command it appends
/// with it (local and forwarded alike), so lease arithmetic in `apply` runs on one clock: a
/// follower whose clock is ahead cannot push the replicated time forward and make another
/// region's lease look expired early.
pub type LeaderClock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// Proposes `command` on this node's Raft, bounded by `timeout`; never forwards. Commands over
/// `max_bytes` are refused: followers could never receive them.
pub(crate) async fn local_write(
    raft: &Raft,
    mut command: Command,
    timeout: Duration,
    max_bytes: usize,
    clock: Option<&LeaderClock>,
) -> ForwardReply {
    // Only a leader appends; on a follower client_write refuses and the stamp is discarded.
    if let Some(clock) = clock {
        command.now_ms = clock();
    }
    let bytes = encode(&command)
        .map_err(|e| ForwardRefusal::Rejected {
            message: e.to_string(),
        })?
        .len();
    if bytes > max_bytes {
        return Err(ForwardRefusal::TooLarge { bytes, max_bytes });
    }
    let timeout_ms = timeout.as_millis() as u64;
    match tokio::time::timeout(timeout, raft.client_write(command)).await {
        Err(_) => Err(ForwardRefusal::Timeout { timeout_ms }),
        Ok(Ok(resp)) => Ok(resp.data),
        Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
            Err(ForwardRefusal::NotLeader {
                leader_id: f.leader_id,
            })
        }
        Ok(Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(e)))) => {
            Err(ForwardRefusal::Rejected {
                message: e.to_string(),
            })
        }
        Ok(Err(RaftError::Fatal(f))) => Err(ForwardRefusal::Fatal {
            message: f.to_string(),
        }),
    }
}
