//! The election guard: quota-raft decides *when* this node campaigns; openraft's vote rules still
//! decide *who* wins.
//!
//! openraft 0.9 has no Pre-Vote. A node cut off from the others keeps campaigning and raising its
//! term, and when it reconnects the healthy leader sees the higher term and steps down. And after
//! a lost vote openraft adds `smaller_log_timeout` (2 × `election_timeout_max`) to the next
//! timeout, which stretches failovers far past twice the election timeout.
//!
//! So openraft's own election timer is off (`Config::enable_elect = false`; that flag only gates
//! the tick-driven campaign: vote requests are still handled by openraft with its leader-lease
//! and log checks, whatever the term they carry) and this guard runs the timer instead:
//! 1. when no leader has been heard from for `quiet + random(0..=jitter)`, it asks every voter a
//!    pre-vote question ([`PreVoteRequest`]): "have you heard from a leader within `quiet`, and
//!    is my log at least as up to date as yours?" — without changing anyone's term;
//! 2. only when a majority (itself included) answers "no leader, your log is fine" does it call
//!    `raft.trigger().elect()`.
//!
//! An isolated node never reaches a majority, so it never raises its term and cannot unseat the
//! leader on heal. `quiet` is openraft's leader lease (`election_timeout_max`): a voter refuses a
//! real vote within it, so the guard asks no earlier than a vote could succeed, and a new leader
//! comes within `quiet + jitter` plus a round trip of the last heartbeat, about twice the election
//! timeout even after a lost or split vote.
//!
//! Why not openraft 0.10, which has `enable_pre_vote`: on the registry it is an alpha
//! (0.10.0-alpha.*) with breaking API changes (storage and network v2) and no stable release to
//! pin; a coordinator that must never become the outage stays on the pinned 0.9.25 release.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use openraft::ServerState;
use rand08::Rng;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::runtime::ThreadRng;
use crate::types::alias::{LogId, Raft};
use crate::types::{Member, NodeId};

/// The pre-vote question a node asks before campaigning. Answering it changes no state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreVoteRequest {
    pub candidate: NodeId,
    /// The candidate's last log id, so the voter can say whether it would grant a real vote.
    pub last_log_id: Option<LogId>,
}

/// A voter's answer to a [`PreVoteRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreVoteAnswer {
    /// The voter leads, or heard from a leader within the quiet period.
    pub leader_alive: bool,
    /// The candidate's log is at least as up to date as the voter's.
    pub log_ok: bool,
}

impl PreVoteAnswer {
    /// Whether this answer counts towards campaigning.
    pub fn granted(&self) -> bool {
        !self.leader_alive && self.log_ok
    }
}

/// The guard's timing, derived from the Raft timeouts ([`crate::RaftConfig::election_timings`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElectionTimings {
    /// How long without a leader before a node may ask: openraft's leader lease,
    /// `election_timeout_max`.
    pub quiet: Duration,
    /// Random extra wait, up to `election_timeout_max − election_timeout_min`, so that two
    /// survivors rarely ask at the same moment.
    pub jitter: Duration,
    /// How often the guard looks at the Raft state.
    pub tick: Duration,
    /// How long one pre-vote question may take.
    pub ask_timeout: Duration,
}

impl ElectionTimings {
    /// One randomized wait: `quiet + random(0..=jitter)`, from the (seedable) runtime RNG.
    pub fn draw(&self) -> Duration {
        let jitter_ms = self.jitter.as_millis() as u64;
        self.quiet + Duration::from_millis(ThreadRng.gen_range(0..=jitter_ms))
    }

    /// The longest a healthy majority goes without a leader after the last heartbeat: the
    /// longest wait, one tick of lateness, a pre-vote and a vote round.
    pub fn worst_case_failover(&self) -> Duration {
        self.quiet + self.jitter + self.tick + 2 * self.ask_timeout
    }
}

/// Answers a pre-vote question from this node's Raft state; `None` once Raft has stopped.
pub async fn answer(raft: &Raft, req: &PreVoteRequest, quiet: Duration) -> Option<PreVoteAnswer> {
    let candidate_log = req.last_log_id;
    let own_log = raft.data_metrics().borrow().last_log;
    raft.with_raft_state(move |st| {
        let heard = st
            .vote_last_modified()
            .is_some_and(|t| Instant::now().saturating_duration_since(t) < quiet);
        PreVoteAnswer {
            leader_alive: st.server_state == ServerState::Leader
                || (st.vote_ref().is_committed() && heard),
            log_ok: candidate_log >= own_log,
        }
    })
    .await
    .ok()
}

/// How the guard reaches its peers: HTTP in production, the in-memory router in tests.
pub trait PreVoteTransport: Send + Sync + 'static {
    /// Asks `target` the pre-vote question; `None` if it did not answer within `timeout`.
    fn pre_vote(
        &self,
        target: NodeId,
        member: &Member,
        req: &PreVoteRequest,
        timeout: Duration,
    ) -> impl Future<Output = Option<PreVoteAnswer>> + Send;
}

/// What the guard needs from the Raft state on each tick.
struct View {
    /// This node leads, or is not a voter: it never campaigns.
    exempt: bool,
    /// Time since the vote last changed or a leader last confirmed it.
    since_heard: Duration,
    voters: BTreeMap<NodeId, Member>,
}

async fn view(raft: &Raft, id: NodeId) -> Option<View> {
    raft.with_raft_state(move |st| {
        let effective = st.membership_state.effective();
        let voters = effective
            .voter_ids()
            .filter_map(|v| effective.get_node(&v).map(|m| (v, m.clone())))
            .collect::<BTreeMap<_, _>>();
        View {
            exempt: st.server_state == ServerState::Leader || !voters.contains_key(&id),
            since_heard: st.vote_last_modified().map_or(Duration::MAX, |t| {
                Instant::now().saturating_duration_since(t)
            }),
            voters,
        }
    })
    .await
    .ok()
}

/// Asks every other voter at once; returns how many granted, this node included.
async fn count_grants<T: PreVoteTransport>(
    transport: &T,
    id: NodeId,
    voters: &BTreeMap<NodeId, Member>,
    req: &PreVoteRequest,
    timeout: Duration,
) -> usize {
    let asks = voters
        .iter()
        .filter(|(v, _)| **v != id)
        .map(|(v, m)| transport.pre_vote(*v, m, req, timeout));
    let answers = futures::future::join_all(asks).await;
    1 + answers
        .into_iter()
        .filter(|a| a.is_some_and(|a| a.granted()))
        .count()
}

/// Runs the guard for node `id` until Raft stops. The Raft must run with `enable_elect = false`.
pub fn spawn_guard<T: PreVoteTransport>(
    raft: Raft,
    id: NodeId,
    transport: T,
    timings: ElectionTimings,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut wait = timings.draw();
        let mut last_attempt: Option<Instant> = None;
        loop {
            tokio::time::sleep(timings.tick).await;
            let Some(v) = view(&raft, id).await else {
                return; // Raft stopped.
            };
            let since_attempt = last_attempt.map_or(Duration::MAX, |t| t.elapsed());
            if v.exempt || v.since_heard < wait || since_attempt < wait {
                continue;
            }
            last_attempt = Some(Instant::now());
            wait = timings.draw();
            let req = PreVoteRequest {
                candidate: id,
                last_log_id: raft.data_metrics().borrow().last_log,
            };
            let grants = count_grants(&transport, id, &v.voters, &req, timings.ask_timeout).await;
            if grants * 2 > v.voters.len() {
                tracing::info!(node = id, grants, "Pre-vote won; campaigning.");
                if raft.trigger().elect().await.is_err() {
                    return;
                }
            } else {
                tracing::debug!(node = id, grants, "Pre-vote lost; not campaigning.");
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::seed_thread_rng;

    fn timings() -> ElectionTimings {
        ElectionTimings {
            quiet: Duration::from_millis(300),
            jitter: Duration::from_millis(150),
            tick: Duration::from_millis(25),
            ask_timeout: Duration::from_millis(50),
        }
    }

    #[test]
    fn draws_stay_within_quiet_and_jitter_and_repeat_under_a_seed() {
        seed_thread_rng(9);
        let a: Vec<Duration> = (0..50).map(|_| timings().draw()).collect();
        seed_thread_rng(9);
        let b: Vec<Duration> = (0..50).map(|_| timings().draw()).collect();
        assert_eq!(a, b);
        assert!(a
            .iter()
            .all(|d| (Duration::from_millis(300)..=Duration::from_millis(450)).contains(d)));
        assert!(a.iter().any(|d| *d != a[0]), "the wait is randomized");
    }

    #[test]
    fn only_no_leader_and_a_good_log_grant() {
        let a = |leader_alive, log_ok| PreVoteAnswer {
            leader_alive,
            log_ok,
        };
        assert!(a(false, true).granted());
        assert!(!a(true, true).granted());
        assert!(!a(false, false).granted());
        assert!(!a(true, false).granted());
    }

    #[test]
    fn worst_case_adds_every_part() {
        assert_eq!(timings().worst_case_failover(), Duration::from_millis(575));
    }
}
