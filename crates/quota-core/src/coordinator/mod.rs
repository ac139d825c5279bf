//! The replicated coordinator state machine: `apply(state, command) -> response`.
//!
//! Only decisions are replicated: policies, pins (per tenant, applied to each of its policies),
//! region membership, the shares the allocator
//! computed with their epochs, and per-region leases with the epoch each region acknowledged.
//! Usage reports are soft state on the leader ([`crate::demand`]), so the log grows with share
//! changes, not with traffic.
//!
//! ```text
//!  leader, every round:  reports ─> DemandTracker ─> allocator::plan(state, demand) ─> Command
//!                        Command ─> Raft log ─> CoordinatorState::apply (every replica) ─> Response
//!  region, every round:  Command::RenewLease { acked_epoch } ─> LeaseRenewed ─> region::RegionLease
//! ```
//!
//! # Safety argument (revoke before grant)
//! For every policy and every region the state knows the region's *enforceable* share: the
//! larger of its granted share and any live [`Revocation`] (a larger share granted earlier that
//! the region may still enforce because it neither acknowledged the decrease's epoch nor saw the
//! lease in force at the decrease run out, plus the drift margin; and a larger floor, which only
//! an acknowledgement clears). `apply` accepts a share change only if, after it, the sum of
//! enforceable shares is at most [`PPM`], and it never lowers a share below the policy floor.
//! Every other command only lowers enforceable shares (renewals, acknowledgements) or leaves them
//! alone, and a new policy starts with a split that sums to `PPM`. Hence
//! `Σ enforceable ≤ PPM` holds in every reachable state ([`CoordinatorState::check_invariant`]).
//! A region enforces at most its granted share under a lease it may use (see [`crate::region`]),
//! and a lease renewed at epoch `E` is usable only for shares of epoch `≥ E`, so what any region
//! actually enforces is bounded by its enforceable share as long as the drift margin covers
//! clock drift and delivery delay ([`crate::lease`]).
//!
//! `apply` never reads a clock: commands carry the leader's `now_ms` and the state clamps it to
//! be monotonic. Duplicated commands (same [`RequestId`]) get the original response.
//!
//! # Limits
//! - Whether a region reserves floors is fixed when it joins; a region leaves by draining
//!   (`PutRegion { draining: true }` drops its floor guarantee, the allocator empties it), then
//!   `RemoveRegion` once it acknowledged and nothing it may enforce is left.
//! - A deleted policy stays as a tombstone until no region may enforce it; a re-put in the
//!   meantime starts from zero shares and the allocator raises them as revocations clear.
//! - The margin must cover clock-rate drift over one lease, the delay between a region sending
//!   its renewal and the commit, and the clock offset between successive leaders.
//!
//! # Layout
//! - `mod.rs` (this file): the state ([`CoordinatorState`] and what it holds), `apply` handing
//!   each operation to its handler and keeping the deduplication window, the read-side queries
//!   the handlers and the allocator share, and the invariant checks.
//! - `command`: what a command carries ([`Command`], [`Operation`] and their payloads) and the
//!   batch limits.
//! - `response`: what `apply` answers ([`Response`]), a refused share entry's reason included.
//! - `policies`: putting (one or a batch), deleting and forgetting policies; a new policy's
//!   first split.
//! - `pins`: operator pins of one policy or of a whole tenant.
//! - `shares`: the allocator's share updates, each checked revoke-before-grant, and the
//!   revocation bookkeeping every handler shares.
//! - `regions`: region membership (join, drain, remove) and lease renewals.
//!
//! Plans and promoted subjects are applied next to the rest of their model, in
//! [`crate::plan`] and [`crate::promotion`]: both add handlers to [`CoordinatorState`].

mod agents;
mod command;
mod pins;
mod policies;
mod regions;
mod response;
mod shares;

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::ids::{PlanName, PolicyName, RegionId, TenantId};
use crate::lease::{LeaseConfig, Revocation};
use crate::mode::{budget_mode, BudgetMode};
use crate::policy::{Policy, PPM};
pub use crate::promotion::Promoted;

pub use crate::split::MAX_REGIONS;
pub use agents::SOLE_DAEMON;
pub use command::{
    Command, HomeChange, Operation, PromotedChange, RequestId, ShareEntry, MAX_BATCH_ASSIGNMENTS,
    MAX_BATCH_POLICIES,
};
pub use pins::auto_pins;
pub use response::{
    EntryRejection, InvalidEntry, RejectedEntry, Response, MAX_LISTED_INVALID,
    MAX_LISTED_REJECTIONS,
};
pub(crate) use shares::{acked_of, add_revocation, prune};

/// How many recent responses the state keeps to answer duplicated commands.
pub const DEDUP_WINDOW: usize = 1024;

/// A tenant's policy: the unit that owns a budget and its shares.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PolicyKey {
    pub tenant: TenantId,
    pub policy: PolicyName,
}

impl PolicyKey {
    /// Pairs a tenant with one of its policies.
    pub fn new(tenant: TenantId, policy: PolicyName) -> Self {
        Self { tenant, policy }
    }
}

/// A member region, by slot. The slot index addresses it in every share vector.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionState {
    pub id: RegionId,
    /// Whether policies' floors are reserved for this region. Fixed once the region is added.
    pub reserves_floor: bool,
    /// The allocator moves everything above the floor away from a draining region.
    pub draining: bool,
    /// Coordinator time the region's lease ends (0: never renewed).
    pub lease_expires_at_ms: u64,
    /// The latest epoch every daemon of the region that may still enforce anything has
    /// applied: the least of `daemons`' live acknowledgements, never lowered.
    pub acked_epoch: u64,
    /// The daemons of the region that renewed a lease, by Raft node id: each enforces its
    /// region's shares under its own lease (in process, and through the agent's writes), so the
    /// region has applied an epoch only once every one of them that may still enforce has.
    pub daemons: BTreeMap<u64, DaemonLease>,
    /// The daemon holding the region agent role, if one claimed it: the only one whose writes
    /// the region's store accepts, by its fence.
    pub agent: Option<AgentRole>,
}

/// One daemon's lease within its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonLease {
    /// The least epoch this daemon may be enforcing anything of.
    pub acked_epoch: u64,
    /// Coordinator time this daemon's lease ends.
    pub lease_expires_at_ms: u64,
    /// The daemon stopped while it was the region's agent: it decides nothing more, but the
    /// store holds what it wrote until the next agent's first complete pass
    /// ([`super::Operation::AgentPassed`]) replaces it.
    #[serde(default)]
    pub left: bool,
    /// The daemon was the agent a claim replaced: it may be alive (paused, cut off) and
    /// decide in process on an old view until its lease ends, so its record holds the
    /// region's acknowledgement, unchanged by its renewals, until its lease and the margin
    /// are over, whatever the next agent writes.
    #[serde(default)]
    pub deposed: bool,
}

/// The holder of a region's agent role and the fence its writes carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentRole {
    /// Raft node id of the holder.
    pub node: u64,
    /// Drawn from [`CoordinatorState::last_fence`] at the claim: higher for every later claim,
    /// in every region, so a store that has seen a holder's write refuses every earlier one's.
    pub fence: u64,
}

/// Who pinned a policy to its home region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PinSource {
    /// An operator: the allocator never moves it.
    Operator,
    /// The allocator, for a `critical` tenant; moved with hysteresis.
    Auto,
}

/// A policy's home region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Pin {
    pub home: u8,
    pub source: PinSource,
}

/// One policy's replicated allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub policy: Policy,
    pub pin: Option<Pin>,
    /// Granted share per region slot, in ppm; a missing slot is 0.
    pub shares_ppm: Vec<u32>,
    /// Larger shares regions may still enforce; at most one per region.
    pub revocations: Vec<Revocation>,
    /// Deleted policies stay until no region may enforce them, so a re-put cannot overshoot.
    pub deleted: bool,
}

impl Entry {
    /// The granted share of a region slot.
    pub fn share(&self, region: usize) -> u32 {
        self.shares_ppm.get(region).copied().unwrap_or(0)
    }

    /// The live revocation of a region, if any.
    pub fn revocation(&self, region: usize) -> Option<&Revocation> {
        self.revocations
            .iter()
            .find(|r| usize::from(r.region) == region)
    }
}

/// A broken safety invariant, found by [`CoordinatorState::check_invariant`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("policy {key:?} has {enforceable_ppm} ppm enforceable, more than the whole budget")]
pub struct InvariantViolation {
    pub key: PolicyKey,
    pub enforceable_ppm: u64,
}

/// A share holding part of one unit, found by [`CoordinatorState::check_whole_shares`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("policy {key:?} grants region {region} {share_ppm} ppm, less than one unit")]
pub struct PartUnitShare {
    pub key: PolicyKey,
    pub region: u8,
    pub share_ppm: u32,
}

/// The grant one region enforces for one policy, as read from the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionShare {
    pub share_ppm: u32,
    /// What the region falls back to once its lease is over (never above the share).
    pub floor_ppm: u32,
}

/// Replicated coordinator state. Its postcard encoding is the Raft snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordinatorState {
    /// The latest (clamped) command time.
    pub last_now_ms: u64,
    /// Bumped by every committed change regions must apply (shares, policies).
    pub epoch: u64,
    /// Bumped whenever the region slots change.
    pub membership: u64,
    /// Source of policy versions: never reused, even across delete and re-put.
    pub last_version: u64,
    /// Source of agent fences ([`AgentRole::fence`]): never reused.
    pub last_fence: u64,
    pub lease: LeaseConfig,
    /// Region slots; `None` is a removed region whose slot may be reused.
    pub regions: Vec<Option<RegionState>>,
    pub entries: BTreeMap<PolicyKey, Entry>,
    /// Pinned tenants and their home slot; their policies, present and future, carry an
    /// operator pin to it.
    pub tenant_pins: BTreeMap<TenantId, u8>,
    /// Tenants assigned to a plan; the plan's policies live in `entries` under its reserved
    /// subject, so the state holds O(plans + assignments + explicit policies).
    pub plan_assignments: BTreeMap<TenantId, PlanName>,
    /// Subjects of a plan's class with a share vector of their own, by (subject, policy
    /// name): at most [`crate::promotion::MAX_PROMOTED`], so the state stays O(plans +
    /// assignments + explicit policies + promoted entries).
    pub promoted: BTreeMap<PolicyKey, Promoted>,
    /// Recent responses, oldest first, for idempotency.
    pub recent: VecDeque<(RequestId, Response)>,
}

impl CoordinatorState {
    /// Applies one command. Pure: never reads a clock, never panics on bad input.
    pub fn apply(&mut self, cmd: &Command) -> Response {
        if let Some((_, response)) = self.recent.iter().find(|(id, _)| *id == cmd.request) {
            return response.clone();
        }
        self.last_now_ms = self.last_now_ms.max(cmd.now_ms);
        let now = self.last_now_ms;
        let response = match &cmd.op {
            Operation::PutPolicy { key, policy } => self.put_policy(key, policy, now),
            Operation::DeletePolicy { key } => self.delete_policy(key, now),
            Operation::Pin { key, home } => self.pin(key, home),
            Operation::Unpin { key } => self.unpin(key),
            Operation::SetShares {
                membership,
                entries,
            } => self.set_shares(*membership, entries, now),
            Operation::RenewLease {
                region,
                acked_epoch,
            } => self.renew_lease(region, SOLE_DAEMON, *acked_epoch, now),
            Operation::RenewDaemonLease {
                region,
                node,
                acked_epoch,
            } => self.renew_lease(region, *node, *acked_epoch, now),
            Operation::ClaimAgent {
                region,
                node,
                fence_seen,
            } => self.claim_agent(region, *node, *fence_seen),
            Operation::ReleaseAgent {
                region,
                node,
                fence,
            } => self.release_agent(region, *node, *fence, now),
            Operation::AgentPassed {
                region,
                node,
                fence,
            } => self.agent_passed(region, *node, *fence, now),
            Operation::PutRegion {
                region,
                reserves_floor,
                draining,
            } => self.put_region(region, *reserves_floor, *draining),
            Operation::RemoveRegion { region } => self.remove_region(region, now),
            Operation::Forget { keys } => self.forget(keys, now),
            Operation::SetLeaseConfig { config } => match config.validate() {
                Ok(()) => {
                    self.lease = *config;
                    Response::LeaseConfigSet
                }
                Err(error) => Response::InvalidLeaseConfig { error },
            },
            Operation::PinTenant { tenant, home } => self.pin_tenant(tenant, home),
            Operation::UnpinTenant { tenant } => self.unpin_tenant(tenant),
            Operation::PutPolicies { entries } => self.put_policies(entries, now),
            Operation::PutPlan { plan, policies } => self.put_plan(plan, policies, now),
            Operation::DeletePlan { plan } => self.delete_plan(plan, now),
            Operation::AssignPlan { tenant, plan } => self.assign_plan(tenant, plan),
            Operation::UnassignPlan { tenant } => self.unassign_plan(tenant),
            Operation::SetPromoted {
                membership,
                changes,
            } => self.set_promoted(*membership, changes, now),
            Operation::AssignPlans { assignments } => self.assign_plans(assignments),
        };
        if self.recent.len() >= DEDUP_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back((cmd.request, response.clone()));
        response
    }

    /// The slot index of a live region.
    pub fn region_index(&self, id: &RegionId) -> Option<u8> {
        self.regions
            .iter()
            .position(|r| r.as_ref().is_some_and(|r| &r.id == id))
            .map(|i| i as u8)
    }

    /// The live region in a slot.
    pub fn region(&self, index: usize) -> Option<&RegionState> {
        self.regions.get(index).and_then(Option::as_ref)
    }

    /// How many live regions reserve floors.
    pub fn floor_regions(&self) -> u32 {
        self.regions
            .iter()
            .flatten()
            .filter(|r| r.reserves_floor)
            .count() as u32
    }

    /// The floor a region keeps even while draining is not: the share the allocator must not
    /// take from it. (What a cut-off region may fall back to is [`Self::floor_of`].)
    pub fn guaranteed_floor(&self, policy: &Policy, region: usize) -> u32 {
        match self.region(region) {
            Some(r) if r.reserves_floor && !r.draining => policy.whole_floor_ppm(),
            _ => 0,
        }
    }

    /// The floor a region slot reserves under a policy: what it falls back to once its lease
    /// ends (never above its share).
    pub fn floor_of(&self, policy: &Policy, region: usize) -> u32 {
        match self.region(region) {
            Some(r) if r.reserves_floor => policy.whole_floor_ppm(),
            _ => 0,
        }
    }

    /// How many live regions may take share (not draining); a policy's mode is judged by it.
    pub fn sharing_regions(&self) -> usize {
        self.regions
            .iter()
            .flatten()
            .filter(|r| !r.draining)
            .count()
    }

    /// Whether a policy's budget is split or lives whole in its home, with this membership.
    pub fn budget_mode(&self, policy: &Policy) -> BudgetMode {
        budget_mode(policy, self.sharing_regions())
    }

    /// Whether the allocator pins a policy to its busiest region: a `critical` tier, or a
    /// budget too small to split.
    pub fn auto_pinned(&self, policy: &Policy) -> bool {
        auto_pins(policy.tier) || self.budget_mode(policy) == BudgetMode::Home
    }

    /// Checks that no region's granted share of any live policy holds more than nothing but
    /// less than one unit of it ([`Policy::min_share_ppm`]).
    pub fn check_whole_shares(&self) -> Result<(), PartUnitShare> {
        for (key, entry) in self.entries.iter().filter(|(_, e)| !e.deleted) {
            let min = entry.policy.min_share_ppm();
            if let Some((r, &share_ppm)) = entry
                .shares_ppm
                .iter()
                .enumerate()
                .find(|(_, &s)| s > 0 && s < min)
            {
                return Err(PartUnitShare {
                    key: key.clone(),
                    region: r as u8,
                    share_ppm,
                });
            }
        }
        Ok(())
    }

    /// What a region enforces for a policy per the current state (its grant and floor).
    pub fn region_share(&self, key: &PolicyKey, region: usize) -> Option<RegionShare> {
        let entry = self.entries.get(key)?;
        if entry.deleted {
            return Some(RegionShare {
                share_ppm: 0,
                floor_ppm: 0,
            });
        }
        let share_ppm = entry.share(region);
        let floor_ppm = self.floor_of(&entry.policy, region).min(share_ppm);
        Some(RegionShare {
            share_ppm,
            floor_ppm,
        })
    }

    /// Every live policy's grant for one region slot, for a region agent writing its bucket
    /// parameters (`BucketParams::for_share(policy, grant.share_ppm)`).
    pub fn grants_for_region(
        &self,
        region: usize,
    ) -> impl Iterator<Item = (&PolicyKey, &Policy, RegionShare)> + '_ {
        self.entries
            .iter()
            .filter(|(_, e)| !e.deleted)
            .map(move |(k, e)| {
                let share_ppm = e.share(region);
                let floor_ppm = self.floor_of(&e.policy, region).min(share_ppm);
                (
                    k,
                    &e.policy,
                    RegionShare {
                        share_ppm,
                        floor_ppm,
                    },
                )
            })
    }

    /// The share a region may still be enforcing: its grant or a live revocation, whichever
    /// is larger.
    pub fn enforceable(&self, entry: &Entry, region: usize, now_ms: u64) -> u32 {
        let acked = self.region(region).map_or(u64::MAX, |r| r.acked_epoch);
        let revoked = entry
            .revocation(region)
            .map_or(0, |v| v.contribution(acked, now_ms));
        entry.share(region).max(revoked)
    }

    /// Σ enforceable over all regions for one policy.
    pub fn enforceable_total(&self, entry: &Entry, now_ms: u64) -> u64 {
        (0..self.regions.len())
            .map(|r| u64::from(self.enforceable(entry, r, now_ms)))
            .sum()
    }

    /// Checks `Σ enforceable ≤ PPM` for every policy at the state's own time.
    pub fn check_invariant(&self) -> Result<(), InvariantViolation> {
        let promoted = self.promoted.iter().map(|(k, p)| (k, &p.entry));
        for (key, entry) in self.entries.iter().chain(promoted) {
            let enforceable_ppm = self.enforceable_total(entry, self.last_now_ms);
            if enforceable_ppm > u64::from(PPM) {
                return Err(InvariantViolation {
                    key: key.clone(),
                    enforceable_ppm,
                });
            }
        }
        Ok(())
    }
}
