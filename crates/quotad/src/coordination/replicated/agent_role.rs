//! The region agent role among a region's daemons: one holds it (applies shares to the store,
//! collects usage), the others stand by and take it over when the holder goes quiet.
//!
//! The role lives in the coordinator state ([`quota_core::coordinator::AgentRole`]), so a
//! takeover is ordered after everything the old holder acknowledged, and the fence it draws is
//! durable and above every earlier one: the store refuses the old holder's writes wherever the
//! new one has written (`set_params.lua`). A standby claims once the holder's lease renewals
//! have stopped moving for the takeover time (several report intervals: a renewal missed
//! during a leader election does not depose a live holder), or at once when nobody holds the
//! role (a fresh cluster, a holder that stopped and released it).

use quota_core::coordinator::{AgentRole, Operation, Response};

use super::{unavailable, Replicated};
use crate::clock;
use crate::coordination::mutation::CoordError;

/// Renewals of its own a standby must see succeed while the holder's stay silent before it
/// claims the role.
pub const RENEWALS_BEFORE_CLAIM: u32 = 2;

/// What a daemon does about the role at a look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// It holds the role with this fence: it writes the store.
    Hold(u64),
    /// It claims the role, compare-and-set on the fence it saw.
    Claim { fence_seen: u64 },
    /// Another daemon holds the role and is renewing.
    Stand,
}

/// A standby's watch on the holder: what it last saw of the holder, and since when.
#[derive(Debug, Default)]
pub struct Watch {
    /// The fence and lease end of the holder at the last change seen.
    seen: Option<(u64, u64)>,
    since_ms: u64,
    /// The fence this process drew with its last won claim.
    mine: Option<u64>,
    /// Set by a won claim: when the replaced holder was last seen renewing.
    took_over_since: Option<u64>,
    /// This daemon's own renewals that succeeded since the holder was last seen renewing: a
    /// holder silent while this daemon renews is gone; both silent is the coordinator (a
    /// leader election), which must not depose a live holder.
    renewed_since: u32,
}

impl Watch {
    /// What to do, given the role in the state, the holder's lease end in the state, this
    /// daemon's node id and the local time.
    pub fn act(
        &mut self,
        me: u64,
        role: Option<AgentRole>,
        holder_lease_end: u64,
        now_ms: u64,
        takeover_ms: u64,
    ) -> Act {
        let Some(role) = role else {
            return Act::Claim { fence_seen: 0 };
        };
        if role.node == me {
            if self.mine == Some(role.fence) {
                return Act::Hold(role.fence);
            }
            // The role of this node from an earlier process: taken anew, so writes that
            // process left in flight are fenced off too.
            return Act::Claim {
                fence_seen: role.fence,
            };
        }
        let seen = (role.fence, holder_lease_end);
        if self.seen != Some(seen) {
            self.seen = Some(seen);
            self.since_ms = now_ms;
            self.renewed_since = 0;
            return Act::Stand;
        }
        if now_ms.saturating_sub(self.since_ms) >= takeover_ms
            && self.renewed_since >= RENEWALS_BEFORE_CLAIM
        {
            Act::Claim {
                fence_seen: role.fence,
            }
        } else {
            Act::Stand
        }
    }

    /// Records one of this daemon's own renewals that succeeded.
    pub fn renewed(&mut self) {
        self.renewed_since = self.renewed_since.saturating_add(1);
    }

    /// Records a won claim at `now_ms`.
    pub fn won(&mut self, fence: u64, now_ms: u64) {
        self.mine = Some(fence);
        self.took_over_since = Some(if self.seen.is_some() {
            self.since_ms
        } else {
            now_ms
        });
    }
}

impl Replicated {
    /// The agent role of this region in the applied state, and its holder's lease end.
    fn agent_role(&self) -> (Option<AgentRole>, u64) {
        self.raft.read(|s| {
            let Some(r) = s
                .region_index(&self.region)
                .and_then(|i| s.region(usize::from(i)))
            else {
                return (None, 0);
            };
            let end = r
                .agent
                .and_then(|a| r.daemons.get(&a.node))
                .map_or(0, |d| d.lease_expires_at_ms);
            (r.agent, end)
        })
    }

    /// Resolves when this daemon wins the agent role.
    pub async fn agent_won(&self) {
        self.agent_won.notified().await;
    }

    /// This daemon's Raft node id.
    pub fn node_id(&self) -> u64 {
        self.raft.config().node_id
    }

    /// The fence this daemon writes with, if it holds the agent role (as the applied state
    /// says: a deposed holder finds out when the claim that deposed it reaches it, and the
    /// store refuses its writes meanwhile).
    pub fn agent_fence(&self) -> Option<u64> {
        let (role, _) = self.agent_role();
        let mine = self.agent.lock().unwrap_or_else(|e| e.into_inner()).mine;
        role.filter(|r| r.node == self.node_id() && Some(r.fence) == mine)
            .map(|r| r.fence)
    }

    /// Looks at the role and claims it when it is free or its holder went quiet for
    /// `takeover_ms`: whether this daemon holds it afterwards.
    pub async fn keep_agent_role(&self, takeover_ms: u64) -> Result<bool, CoordError> {
        let (role, end) = self.agent_role();
        let act = self.agent.lock().unwrap_or_else(|e| e.into_inner()).act(
            self.node_id(),
            role,
            end,
            clock::monotonic_ms(),
            takeover_ms,
        );
        let fence_seen = match act {
            Act::Hold(_) => return Ok(true),
            Act::Stand => return Ok(false),
            Act::Claim { fence_seen } => fence_seen,
        };
        let op = Operation::ClaimAgent {
            region: self.region.clone(),
            node: self.node_id(),
            fence_seen,
        };
        match self.write(op).await? {
            Response::AgentClaimed { fence } => {
                self.agent
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .won(fence, clock::monotonic_ms());
                self.agent_won.notify_one();
                tracing::info!(
                    region = %self.region,
                    fence,
                    deposed = role.map_or(0, |r| r.node),
                    "Took the region agent role."
                );
                metrics::counter!(crate::telemetry::AGENT_TAKEOVERS_TOTAL, "region" => self.region.as_str().to_string())
                    .increment(1);
                Ok(true)
            }
            Response::AgentHeld { node, fence } => {
                tracing::debug!(holder = node, fence, "Another daemon holds the agent role.");
                Ok(false)
            }
            Response::UnknownRegion { region } => Err(CoordError::UnknownRegion { region }),
            other => Err(unavailable(format!("agent claim answered {other:?}"))),
        }
    }

    /// Tells the log this agent's first complete pass under `fence` is in the store: agents
    /// that left before it no longer hold the region's acknowledgement back. True once done
    /// (or moot: the role moved on).
    pub async fn agent_passed(&self, fence: u64) -> bool {
        let op = Operation::AgentPassed {
            region: self.region.clone(),
            node: self.node_id(),
            fence,
        };
        // Bounded as a renewal: the apply loop waits for this, and acknowledges no new epoch
        // meanwhile (its leases wait for that); a timed-out call is sent again after the next
        // pass, and a second commit of it changes nothing.
        match self.write_within(op, self.renewal_timeout()).await {
            Ok(Response::AgentPassed | Response::AgentHeld { .. }) => true,
            Ok(other) => {
                tracing::debug!(answer = ?other, "Reporting the agent's first pass.");
                false
            }
            Err(e) => {
                tracing::debug!(error = %e, "Reporting the agent's first pass failed.");
                false
            }
        }
    }

    /// When the agent this daemon replaced last renewed, as this daemon saw it (local
    /// monotonic ms), once per won claim: the usage the first report drains was counted since
    /// about then.
    pub fn take_takeover_since(&self) -> Option<u64> {
        self.agent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .took_over_since
            .take()
    }

    /// This daemon is stopping and decides and writes nothing more: its lease record goes, so
    /// its region's acknowledgement stops waiting for it, and it gives the role up if it holds
    /// it, so a standby takes it over at its next look instead of after the takeover time.
    pub async fn release_agent_role(&self) {
        let fence = self.agent_fence().unwrap_or(0);
        let op = Operation::ReleaseAgent {
            region: self.region.clone(),
            node: self.node_id(),
            fence,
        };
        match self.write_within(op, self.renewal_timeout()).await {
            Ok(Response::AgentReleased) => {
                tracing::info!(region = %self.region, fence, "Released the region agent role.")
            }
            Ok(_) => tracing::debug!(region = %self.region, "Left the region's daemons."),
            Err(e) => {
                tracing::warn!(error = %e, "Leaving the region's daemons failed; they count this one until its lease runs out.")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TAKEOVER: u64 = 600;

    fn role(node: u64, fence: u64) -> Option<AgentRole> {
        Some(AgentRole { node, fence })
    }

    #[test]
    fn a_free_role_is_claimed_at_once_and_held_once_won() {
        let mut w = Watch::default();
        assert_eq!(w.act(1, None, 0, 0, TAKEOVER), Act::Claim { fence_seen: 0 });
        w.won(4, 5);
        assert_eq!(w.act(1, role(1, 4), 9_000, 10, TAKEOVER), Act::Hold(4));
        // Deposed: another node holds a later fence; this one stands by.
        assert_eq!(w.act(1, role(2, 5), 9_000, 20, TAKEOVER), Act::Stand);
    }

    #[test]
    fn a_standby_claims_only_after_the_holder_stopped_renewing_for_the_takeover_time() {
        let mut w = Watch::default();
        // The holder renews every 200 ms: its lease end moves, the standby stands.
        for (i, now) in (0..20u64).map(|i| (i, i * 200)) {
            w.renewed();
            assert_eq!(
                w.act(2, role(1, 3), 5_000 + i * 200, now, TAKEOVER),
                Act::Stand
            );
        }
        // Renewals stop at 3 800: standing until 3 800 + 600 with two renewals of its own,
        // then a claim on fence 3.
        assert_eq!(w.act(2, role(1, 3), 8_800, 4_000, TAKEOVER), Act::Stand);
        w.renewed();
        w.renewed();
        assert_eq!(w.act(2, role(1, 3), 8_800, 4_399, TAKEOVER), Act::Stand);
        assert_eq!(
            w.act(2, role(1, 3), 8_800, 4_400, TAKEOVER),
            Act::Claim { fence_seen: 3 }
        );
        // Another standby won meanwhile: a new holder, a new wait.
        assert_eq!(w.act(2, role(3, 4), 9_000, 4_500, TAKEOVER), Act::Stand);
        assert_eq!(w.act(2, role(3, 4), 9_000, 5_000, TAKEOVER), Act::Stand);
    }

    /// A leader election: nobody's renewals commit for a while, the holder's no more than
    /// this daemon's. That is no reason to depose a live holder.
    #[test]
    fn a_standby_whose_own_renewals_fail_too_does_not_claim() {
        let mut w = Watch::default();
        assert_eq!(w.act(2, role(1, 3), 5_000, 0, TAKEOVER), Act::Stand);
        assert_eq!(w.act(2, role(1, 3), 5_000, 2_000, TAKEOVER), Act::Stand);
        w.renewed();
        assert_eq!(w.act(2, role(1, 3), 5_000, 2_200, TAKEOVER), Act::Stand);
        // The holder renews again after the election: the wait starts over.
        assert_eq!(w.act(2, role(1, 3), 7_200, 2_400, TAKEOVER), Act::Stand);
        w.renewed();
        w.renewed();
        assert_eq!(w.act(2, role(1, 3), 7_200, 2_500, TAKEOVER), Act::Stand);
    }

    #[test]
    fn a_restarted_holder_takes_its_role_anew() {
        let mut w = Watch::default();
        assert_eq!(
            w.act(1, role(1, 7), 9_000, 0, TAKEOVER),
            Act::Claim { fence_seen: 7 }
        );
    }
}
