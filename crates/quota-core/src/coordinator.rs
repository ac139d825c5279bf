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

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::ids::{PlanName, PolicyName, RegionId, TenantId};
use crate::lease::{LeaseConfig, LeaseConfigError, Revocation};
use crate::mode::{budget_mode, whole_share, BudgetMode};
use crate::policy::{Policy, PolicySpec, Tier, PPM};
pub use crate::promotion::{Promoted, PromotedChange};
use crate::split::even_split;

pub use crate::split::MAX_REGIONS;

/// How many recent responses the state keeps to answer duplicated commands.
pub const DEDUP_WINDOW: usize = 1024;

/// How many per-entry rejections a [`Response::SharesSet`] lists (the count is always exact).
pub const MAX_LISTED_REJECTIONS: usize = 8;

/// Most policies one [`Operation::PutPolicies`] may carry: a Raft entry of a few hundred KiB.
pub const MAX_BATCH_POLICIES: usize = 1000;

/// Most assignments one [`Operation::AssignPlans`] may carry (a Raft entry of tens of KiB).
pub const MAX_BATCH_ASSIGNMENTS: usize = 1000;

/// Most invalid entries a refused batch names (the responses are kept for deduplication).
pub const MAX_LISTED_INVALID: usize = 100;

/// A client-chosen id that makes a command idempotent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestId(pub u128);

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
    /// The latest epoch the region says it has applied.
    pub acked_epoch: u64,
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

/// A pin change carried with a share update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HomeChange {
    Keep,
    /// Pin automatically to this region slot (a `critical` tenant's demand moved).
    Auto(u8),
    /// Drop an automatic pin.
    ClearAuto,
}

/// New shares for one policy, computed by the allocator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareEntry {
    pub key: PolicyKey,
    /// One share per region slot, in ppm.
    pub shares_ppm: Vec<u32>,
    pub home: HomeChange,
}

/// A replicated command, stamped by the leader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Command {
    /// Answers a duplicate with the original response: draw a fresh id per logical request
    /// (e.g. `RequestId(rng.random())`) and reuse it on retries.
    pub request: RequestId,
    /// The leader's clock when it proposed the command; clamped to be monotonic.
    pub now_ms: u64,
    pub op: Operation,
}

/// What a command does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Operation {
    /// Creates or replaces a policy; the state assigns its version from a counter that never
    /// repeats (so a Redis key of a deleted policy is never reused).
    PutPolicy { key: PolicyKey, policy: Policy },
    /// Deletes a policy: its shares drop to zero, tracked until no region may enforce them.
    DeletePolicy { key: PolicyKey },
    /// Pins one policy to a home region by operator decision. The daemon pins tenants
    /// ([`Operation::PinTenant`]); this is the per-policy building block.
    Pin { key: PolicyKey, home: RegionId },
    /// Removes one policy's operator pin (an automatic one stays the allocator's business).
    Unpin { key: PolicyKey },
    /// Sets shares computed by the allocator; each entry is accepted or rejected on its own.
    SetShares {
        /// The membership version the allocator planned against (slots must mean the same).
        membership: u64,
        entries: Vec<ShareEntry>,
    },
    /// Renews a region's lease and records the epoch it has applied.
    RenewLease { region: RegionId, acked_epoch: u64 },
    /// Adds a region, or changes whether it is draining. A draining region loses its floor
    /// guarantee, so the allocator can empty it and it can then be removed.
    PutRegion {
        region: RegionId,
        reserves_floor: bool,
        draining: bool,
    },
    /// Removes a region that holds no share any more.
    RemoveRegion { region: RegionId },
    /// Forgets deleted policies no region may enforce any more.
    Forget { keys: Vec<PolicyKey> },
    /// Changes lease timing for future renewals.
    SetLeaseConfig { config: LeaseConfig },
    /// Pins a tenant to a home region, in one step: every live policy of the tenant gets an
    /// operator pin, and so does every policy of the tenant put later, until `UnpinTenant`.
    PinTenant { tenant: TenantId, home: RegionId },
    /// Removes a tenant's pin and the operator pins of its policies (automatic pins stay the
    /// allocator's business).
    UnpinTenant { tenant: TenantId },
    /// Creates or replaces up to [`MAX_BATCH_POLICIES`] policies in one step, all or none: one
    /// invalid entry refuses the batch. Each entry is stored as `PutPolicy` would store it, in
    /// order, so versions are consecutive. One entry, one epoch and one view change per batch
    /// instead of per policy is what makes loading many policies fast.
    PutPolicies { entries: Vec<(PolicyKey, Policy)> },
    /// Creates or replaces a plan: a named set of policies, each one allocation class stored
    /// under the plan's reserved subject ([`TenantId::for_plan`]). All or none, like
    /// `PutPolicies`; a policy the plan no longer holds is deleted. A changed policy gets a
    /// new version, so no subject's bucket of the old terms is reused.
    PutPlan {
        plan: PlanName,
        policies: Vec<(PolicyName, Policy)>,
    },
    /// Deletes a plan and its policies. Tenants assigned to it keep the assignment and fall
    /// back to the `default` plan until a plan of that name is put again.
    DeletePlan { plan: PlanName },
    /// Assigns a tenant to an existing plan (replacing any earlier assignment).
    AssignPlan { tenant: TenantId, plan: PlanName },
    /// Removes a tenant's plan assignment.
    UnassignPlan { tenant: TenantId },
    /// Promotes, moves and evicts subjects of a plan's classes with entries of their own
    /// ([`crate::promotion`]); each change is accepted or rejected on its own, like
    /// `SetShares`.
    SetPromoted {
        /// The membership version the leader planned against.
        membership: u64,
        changes: Vec<PromotedChange>,
    },
    /// Assigns (`Some`) or unassigns (`None`) up to [`MAX_BATCH_ASSIGNMENTS`] tenants in one
    /// step, all or none: a reserved tenant or a plan that does not exist refuses the batch.
    /// Applied in order (a tenant named twice ends as its last entry says). One entry per
    /// batch instead of per tenant is what makes loading many assignments fast.
    AssignPlans {
        assignments: Vec<(TenantId, Option<PlanName>)>,
    },
}

/// One entry of a refused [`Operation::PutPolicies`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InvalidEntry {
    /// Its position in the batch.
    pub index: u32,
    /// The offending fields, as in [`Response::InvalidPolicy`].
    pub fields: Vec<String>,
}

/// Why one [`ShareEntry`] was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EntryRejection {
    UnknownPolicy,
    /// The share vector does not have one share per region slot.
    WrongLength {
        expected: u32,
        found: u32,
    },
    /// A share above PPM, or a share for an empty slot.
    BadShare {
        region: u8,
        share_ppm: u32,
    },
    /// The change would cut a region below its floor.
    CutsFloor {
        region: u8,
        floor_ppm: u32,
    },
    /// The change would let regions enforce more than the whole budget.
    BudgetExceeded {
        enforceable_ppm: u64,
    },
    /// An automatic home for a policy an operator pinned, or for an empty slot.
    BadHome {
        region: u8,
    },
    /// A deleted policy gets no share.
    Deleted,
    /// A share that would hold more than nothing but less than one unit of the policy (a
    /// token of burst, or of a sliding window's limit): it could admit nothing.
    PartUnit {
        region: u8,
        share_ppm: u32,
    },
}

/// A rejected share entry, named.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectedEntry {
    pub key: PolicyKey,
    pub reason: EntryRejection,
}

/// The answer to a command. Business rejections are responses, never errors or panics.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    PolicyStored {
        version: u64,
        epoch: u64,
    },
    PolicyDeleted {
        epoch: u64,
    },
    Pinned {
        home: u8,
    },
    Unpinned,
    SharesSet {
        /// The epoch of this allocation (unchanged when nothing was accepted).
        epoch: u64,
        accepted: u32,
        rejected_total: u32,
        /// The first few rejections.
        rejected: Vec<RejectedEntry>,
    },
    LeaseRenewed {
        region: u8,
        /// The lease is usable only for an allocation of this epoch or later.
        epoch: u64,
        /// How long the region may count the lease, from when it sent the renewal.
        lease_ms: u64,
        /// Coordinator time the lease ends (for display; regions count `lease_ms` locally).
        expires_at_ms: u64,
    },
    RegionStored {
        index: u8,
        membership: u64,
    },
    RegionRemoved {
        membership: u64,
    },
    Forgotten {
        count: u32,
    },
    LeaseConfigSet,
    UnknownPolicy,
    /// The policy breaks the rules of `PolicySpec::validate`; the offending fields are named.
    InvalidPolicy {
        fields: Vec<String>,
    },
    UnknownRegion {
        region: RegionId,
    },
    /// Floors of every floor-reserving region would exceed the budget.
    FloorsExceedBudget {
        floor_ppm: u32,
        floor_regions: u32,
    },
    TooManyRegions {
        max: u32,
    },
    /// Floor reservation is fixed for an existing region.
    RegionRulesImmutable {
        region: RegionId,
    },
    /// The region still holds (or may still enforce) share, or is some policy's or tenant's
    /// home.
    RegionInUse {
        region: RegionId,
    },
    /// The allocator planned against another membership.
    StaleMembership {
        planned: u64,
        current: u64,
    },
    /// A region acknowledged an epoch that does not exist yet.
    AckFromFuture {
        acked_epoch: u64,
        epoch: u64,
    },
    InvalidLeaseConfig {
        error: LeaseConfigError,
    },
    TenantPinned {
        home: u8,
        /// How many live policies the pin covers now.
        policies: u32,
    },
    TenantUnpinned {
        /// How many live policies lost their operator pin.
        policies: u32,
    },
    /// `UnpinTenant` of a tenant without a pin.
    TenantNotPinned,
    /// A batch stored: each entry's version, in batch order (an entry equal to the live
    /// policy keeps its version; the changed ones get consecutive new versions).
    PoliciesStored {
        versions: Vec<u64>,
        epoch: u64,
    },
    /// A batch refused as a whole, nothing changed; the first [`MAX_LISTED_INVALID`] invalid
    /// entries are named, out of `total`.
    InvalidPolicies {
        entries: Vec<InvalidEntry>,
        total: u32,
    },
    /// A batch of more than `max` policies, refused.
    BatchTooLarge {
        max: u32,
    },
    /// A plan stored: each policy's version, in command order.
    PlanStored {
        versions: Vec<u64>,
        epoch: u64,
    },
    PlanDeleted {
        epoch: u64,
    },
    /// No plan of that name (a plan exists while it holds a policy).
    UnknownPlan,
    PlanAssigned,
    PlanUnassigned,
    /// `UnassignPlan` of a tenant without a plan.
    TenantHasNoPlan,
    /// A plan command naming no policy, or a reserved tenant id.
    InvalidPlan {
        field: String,
    },
    /// The outcome of a `SetPromoted`.
    PromotedSet {
        /// The epoch of the change (unchanged when nothing was accepted).
        epoch: u64,
        accepted: u32,
        rejected: u32,
    },
    /// An [`Operation::AssignPlans`] batch applied whole.
    PlansAssigned,
    /// An [`Operation::AssignPlans`] batch refused as a whole, nothing changed: the first
    /// [`MAX_LISTED_INVALID`] entries naming a reserved tenant (`tenant`) or no live plan
    /// (`plan`), out of `total`.
    InvalidAssignments {
        entries: Vec<InvalidEntry>,
        total: u32,
    },
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
            } => self.renew_lease(region, *acked_epoch, now),
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

    fn check_floors(&self, floor_ppm: u32, floor_regions: u32) -> Result<(), Response> {
        if u64::from(floor_ppm) * u64::from(floor_regions) > u64::from(PPM) {
            Err(Response::FloorsExceedBudget {
                floor_ppm,
                floor_regions,
            })
        } else {
            Ok(())
        }
    }

    fn put_policy(&mut self, key: &PolicyKey, policy: &Policy, now: u64) -> Response {
        // The command may come from any client: hold it to the same rules as admin input, so
        // no later arithmetic (rates, shares) meets a zero window or an absurd floor.
        if let Err(errors) = policy_spec(policy).validate() {
            let fields = errors.0.iter().map(|e| e.field.to_string()).collect();
            return Response::InvalidPolicy { fields };
        }
        if let Err(r) = self.check_floors(policy.floor_ppm, self.floor_regions()) {
            return r;
        }
        let (version, epoch) = self.store_policy(key, policy, now);
        Response::PolicyStored { version, epoch }
    }

    /// Stores a policy already checked; returns its version and the epoch of the change. A
    /// policy equal to the live one (all but the version) changes nothing and keeps its
    /// version, so its buckets keep their tokens: re-sending a policy is idempotent.
    pub(crate) fn store_policy(
        &mut self,
        key: &PolicyKey,
        policy: &Policy,
        now: u64,
    ) -> (u64, u64) {
        let live = self.entries.get(key).filter(|e| !e.deleted);
        if let Some(entry) = live {
            if entry.policy.same_terms(policy) {
                return (entry.policy.version, self.epoch);
            }
        }
        let replaces = live.map(|e| e.policy.version);
        self.last_version += 1;
        self.epoch += 1;
        let version = self.last_version;
        let epoch = self.epoch;
        let mut policy = policy.clone();
        policy.version = version;
        policy.replaces = replaces;
        let tenant_pin = self.tenant_pins.get(&key.tenant).map(|&home| Pin {
            home,
            source: PinSource::Operator,
        });
        // A budget too small to split starts whole in one region, so its first check is
        // admitted wherever it lands (the others forward it there).
        let auto_home = (tenant_pin.is_none() && self.budget_mode(&policy) == BudgetMode::Home)
            .then(|| self.first_sharing_region())
            .flatten()
            .map(|home| Pin {
                home,
                source: PinSource::Auto,
            });
        let initial = initial_split(self, &policy, tenant_pin.or(auto_home).map(|p| p.home));
        let floor_regions = self.floor_flags();
        let regions = self.regions.clone();
        match self.entries.get_mut(key) {
            None => {
                self.entries.insert(
                    key.clone(),
                    Entry {
                        policy,
                        pin: tenant_pin.or(auto_home),
                        shares_ppm: initial,
                        revocations: Vec::new(),
                        deleted: false,
                    },
                );
            }
            Some(entry) => {
                // A lower floor may still be what a cut-off region falls back to: keep the old
                // one counted until each region acknowledges this epoch.
                if policy.whole_floor_ppm() < entry.policy.whole_floor_ppm() && !entry.deleted {
                    for (r, _) in floor_regions.iter().enumerate().filter(|(_, &f)| f) {
                        let floor = entry.policy.whole_floor_ppm().min(entry.share(r));
                        if floor > 0 {
                            let rev = Revocation {
                                region: r as u8,
                                share_ppm: 0,
                                floor_ppm: floor,
                                epoch,
                                deadline_ms: 0,
                            };
                            add_revocation(entry, rev, acked_of(&regions, r), now);
                        }
                    }
                }
                prune(entry, &regions, now);
                entry.policy = policy;
                entry.deleted = false;
                if tenant_pin.is_some() {
                    entry.pin = tenant_pin;
                } else if entry.pin.is_none() {
                    entry.pin = auto_home;
                }
                // A plan's subjects keep their promoted shares under the new terms.
                let policy = entry.policy.clone();
                self.sync_promoted_policy(key, &policy);
            }
        }
        (version, epoch)
    }

    /// Why `policy` cannot be stored, if it cannot: the fields at fault.
    pub(crate) fn policy_problem(&self, policy: &Policy) -> Option<Vec<String>> {
        if let Err(errors) = policy_spec(policy).validate() {
            return Some(errors.0.iter().map(|e| e.field.to_string()).collect());
        }
        self.check_floors(policy.floor_ppm, self.floor_regions())
            .err()
            .map(|_| vec!["floor".to_string()])
    }

    fn put_policies(&mut self, entries: &[(PolicyKey, Policy)], now: u64) -> Response {
        if entries.len() > MAX_BATCH_POLICIES {
            return Response::BatchTooLarge {
                max: MAX_BATCH_POLICIES as u32,
            };
        }
        // Every entry is checked before any is stored, so a refused batch changes nothing.
        let mut invalid = entries
            .iter()
            .enumerate()
            .filter_map(|(index, (_, policy))| {
                self.policy_problem(policy).map(|fields| InvalidEntry {
                    index: index as u32,
                    fields,
                })
            })
            .peekable();
        if invalid.peek().is_some() {
            let listed: Vec<_> = invalid.by_ref().take(MAX_LISTED_INVALID).collect();
            let total = (listed.len() + invalid.count()) as u32;
            return Response::InvalidPolicies {
                entries: listed,
                total,
            };
        }
        let versions = entries
            .iter()
            .map(|(key, policy)| self.store_policy(key, policy, now).0)
            .collect();
        Response::PoliciesStored {
            versions,
            epoch: self.epoch,
        }
    }

    /// The lowest live slot that may take share (a fresh home-mode policy's first home).
    fn first_sharing_region(&self) -> Option<u8> {
        let slot = self
            .regions
            .iter()
            .position(|r| r.as_ref().is_some_and(|r| !r.draining))
            .or_else(|| self.regions.iter().position(Option::is_some))?;
        Some(slot as u8)
    }

    fn floor_flags(&self) -> Vec<bool> {
        self.regions
            .iter()
            .map(|r| r.as_ref().is_some_and(|r| r.reserves_floor))
            .collect()
    }

    pub(crate) fn delete_policy(&mut self, key: &PolicyKey, now: u64) -> Response {
        let floor_flags = self.floor_flags();
        let regions = self.regions.clone();
        let margin = self.lease.drift_margin_ms;
        let Some(entry) = self.entries.get_mut(key) else {
            return Response::UnknownPolicy;
        };
        if entry.deleted {
            return Response::UnknownPolicy;
        }
        self.epoch += 1;
        let epoch = self.epoch;
        for (r, region) in regions.iter().enumerate() {
            let share = entry.share(r);
            let Some(region) = region else { continue };
            if share == 0 {
                continue;
            }
            let floor = if floor_flags[r] {
                entry.policy.whole_floor_ppm().min(share)
            } else {
                0
            };
            add_revocation(
                entry,
                Revocation {
                    region: r as u8,
                    share_ppm: share,
                    floor_ppm: floor,
                    epoch,
                    deadline_ms: region.lease_expires_at_ms.saturating_add(margin),
                },
                region.acked_epoch,
                now,
            );
        }
        entry.shares_ppm.iter_mut().for_each(|s| *s = 0);
        entry.pin = None;
        entry.deleted = true;
        prune(entry, &regions, now);
        self.drop_promoted_of(key);
        Response::PolicyDeleted { epoch }
    }

    fn pin(&mut self, key: &PolicyKey, home: &RegionId) -> Response {
        let Some(index) = self.region_index(home) else {
            return Response::UnknownRegion {
                region: home.clone(),
            };
        };
        match self.entries.get_mut(key) {
            Some(entry) if !entry.deleted => {
                entry.pin = Some(Pin {
                    home: index,
                    source: PinSource::Operator,
                });
                Response::Pinned { home: index }
            }
            _ => Response::UnknownPolicy,
        }
    }

    fn unpin(&mut self, key: &PolicyKey) -> Response {
        match self.entries.get_mut(key) {
            Some(entry) if !entry.deleted => {
                if entry.pin.is_some_and(|p| p.source == PinSource::Operator) {
                    entry.pin = None;
                }
                Response::Unpinned
            }
            _ => Response::UnknownPolicy,
        }
    }

    fn pin_tenant(&mut self, tenant: &TenantId, home: &RegionId) -> Response {
        let Some(index) = self.region_index(home) else {
            return Response::UnknownRegion {
                region: home.clone(),
            };
        };
        self.tenant_pins.insert(tenant.clone(), index);
        let mut policies = 0u32;
        for entry in self.tenant_entries_mut(tenant) {
            entry.pin = Some(Pin {
                home: index,
                source: PinSource::Operator,
            });
            policies += 1;
        }
        Response::TenantPinned {
            home: index,
            policies,
        }
    }

    fn unpin_tenant(&mut self, tenant: &TenantId) -> Response {
        if self.tenant_pins.remove(tenant).is_none() {
            return Response::TenantNotPinned;
        }
        let mut policies = 0u32;
        for entry in self.tenant_entries_mut(tenant) {
            if entry.pin.is_some_and(|p| p.source == PinSource::Operator) {
                entry.pin = None;
                policies += 1;
            }
        }
        Response::TenantUnpinned { policies }
    }

    /// The live policies of one tenant.
    fn tenant_entries_mut<'a>(
        &'a mut self,
        tenant: &'a TenantId,
    ) -> impl Iterator<Item = &'a mut Entry> + 'a {
        self.entries
            .iter_mut()
            .filter(move |(k, e)| &k.tenant == tenant && !e.deleted)
            .map(|(_, e)| e)
    }

    fn set_shares(&mut self, membership: u64, entries: &[ShareEntry], now: u64) -> Response {
        if membership != self.membership {
            return Response::StaleMembership {
                planned: membership,
                current: self.membership,
            };
        }
        let epoch = self.epoch + 1;
        let mut accepted = 0u32;
        let mut rejected_total = 0u32;
        let mut rejected = Vec::new();
        for update in entries {
            match self.check_entry(update, epoch, now) {
                Ok(revocations) => {
                    let regions = &self.regions;
                    let Some(entry) = self.entries.get_mut(&update.key) else {
                        continue;
                    };
                    for rev in revocations {
                        add_revocation(entry, rev, acked_of(regions, rev.region.into()), now);
                    }
                    entry.shares_ppm.clone_from(&update.shares_ppm);
                    match update.home {
                        HomeChange::Keep => {}
                        HomeChange::Auto(home) => {
                            entry.pin = Some(Pin {
                                home,
                                source: PinSource::Auto,
                            });
                        }
                        HomeChange::ClearAuto => {
                            if entry.pin.is_some_and(|p| p.source == PinSource::Auto) {
                                entry.pin = None;
                            }
                        }
                    }
                    prune(entry, regions, now);
                    accepted += 1;
                }
                Err(reason) => {
                    rejected_total += 1;
                    if rejected.len() < MAX_LISTED_REJECTIONS {
                        rejected.push(RejectedEntry {
                            key: update.key.clone(),
                            reason,
                        });
                    }
                }
            }
        }
        if accepted > 0 {
            self.epoch = epoch;
        }
        Response::SharesSet {
            epoch: self.epoch,
            accepted,
            rejected_total,
            rejected,
        }
    }

    /// The checks of a share update that need no arithmetic: a live policy, one share per
    /// slot, and a home a critical policy may move to. Returns the policy's entry.
    fn check_entry_shape(&self, update: &ShareEntry) -> Result<&Entry, EntryRejection> {
        let entry = self
            .entries
            .get(&update.key)
            .ok_or(EntryRejection::UnknownPolicy)?;
        if entry.deleted {
            return Err(EntryRejection::Deleted);
        }
        let slots = self.regions.len();
        if update.shares_ppm.len() != slots {
            return Err(EntryRejection::WrongLength {
                expected: slots as u32,
                found: update.shares_ppm.len() as u32,
            });
        }
        match update.home {
            HomeChange::Auto(home) => {
                let operator = entry.pin.is_some_and(|p| p.source == PinSource::Operator);
                if operator || self.region(usize::from(home)).is_none() {
                    return Err(EntryRejection::BadHome { region: home });
                }
            }
            HomeChange::Keep | HomeChange::ClearAuto => {}
        }
        Ok(entry)
    }

    /// Validates one share update and returns the revocations it creates.
    fn check_entry(
        &self,
        update: &ShareEntry,
        epoch: u64,
        now: u64,
    ) -> Result<Vec<Revocation>, EntryRejection> {
        let entry = self.check_entry_shape(update)?;
        self.check_shares(entry, &update.shares_ppm, epoch, now)
    }

    /// Validates new shares for `entry` (one per slot, checked by the caller) and returns the
    /// revocations they create: whole units, floors kept, `Σ enforceable ≤ PPM` after.
    pub(crate) fn check_shares(
        &self,
        entry: &Entry,
        shares_ppm: &[u32],
        epoch: u64,
        now: u64,
    ) -> Result<Vec<Revocation>, EntryRejection> {
        let mut revocations = Vec::new();
        let mut total = 0u64;
        for (r, &new) in shares_ppm.iter().enumerate() {
            let Some(region) = self.region(r) else {
                if new > 0 {
                    return Err(EntryRejection::BadShare {
                        region: r as u8,
                        share_ppm: new,
                    });
                }
                continue;
            };
            if new > PPM {
                return Err(EntryRejection::BadShare {
                    region: r as u8,
                    share_ppm: new,
                });
            }
            if whole_share(&entry.policy, new) != new {
                return Err(EntryRejection::PartUnit {
                    region: r as u8,
                    share_ppm: new,
                });
            }
            let old = entry.share(r);
            let floor = self.floor_of(&entry.policy, r);
            let guaranteed = self.guaranteed_floor(&entry.policy, r);
            if new < old && new < guaranteed {
                return Err(EntryRejection::CutsFloor {
                    region: r as u8,
                    floor_ppm: guaranteed,
                });
            }
            let mut after = new.max(self.enforceable(entry, r, now));
            if new < old {
                let rev = Revocation {
                    region: r as u8,
                    share_ppm: old,
                    floor_ppm: floor.min(old),
                    epoch,
                    deadline_ms: region
                        .lease_expires_at_ms
                        .saturating_add(self.lease.drift_margin_ms),
                };
                let contribution = rev.contribution(region.acked_epoch, now);
                if contribution > new {
                    revocations.push(rev);
                }
                after = after.max(contribution);
            }
            total += u64::from(after);
        }
        if total > u64::from(PPM) {
            return Err(EntryRejection::BudgetExceeded {
                enforceable_ppm: total,
            });
        }
        Ok(revocations)
    }

    fn renew_lease(&mut self, id: &RegionId, acked_epoch: u64, now: u64) -> Response {
        let Some(index) = self.region_index(id) else {
            return Response::UnknownRegion { region: id.clone() };
        };
        if acked_epoch > self.epoch {
            return Response::AckFromFuture {
                acked_epoch,
                epoch: self.epoch,
            };
        }
        let lease_ms = self.lease.lease_ms;
        let epoch = self.epoch;
        let Some(region) = self
            .regions
            .get_mut(usize::from(index))
            .and_then(Option::as_mut)
        else {
            return Response::UnknownRegion { region: id.clone() };
        };
        region.acked_epoch = region.acked_epoch.max(acked_epoch);
        region.lease_expires_at_ms = region.lease_expires_at_ms.max(now.saturating_add(lease_ms));
        Response::LeaseRenewed {
            region: index,
            epoch,
            lease_ms,
            expires_at_ms: region.lease_expires_at_ms,
        }
    }

    fn put_region(&mut self, id: &RegionId, reserves_floor: bool, draining: bool) -> Response {
        if let Some(index) = self.region_index(id) {
            let Some(region) = self
                .regions
                .get_mut(usize::from(index))
                .and_then(Option::as_mut)
            else {
                return Response::UnknownRegion { region: id.clone() };
            };
            if region.reserves_floor != reserves_floor {
                return Response::RegionRulesImmutable { region: id.clone() };
            }
            region.draining = draining;
            return Response::RegionStored {
                index,
                membership: self.membership,
            };
        }
        let free = self.regions.iter().position(Option::is_none);
        if free.is_none() && self.regions.len() >= MAX_REGIONS {
            return Response::TooManyRegions {
                max: MAX_REGIONS as u32,
            };
        }
        if reserves_floor {
            let regions = self.floor_regions() + 1;
            let max_floor = self
                .entries
                .values()
                .map(|e| e.policy.floor_ppm)
                .max()
                .unwrap_or(0);
            if let Err(r) = self.check_floors(max_floor, regions) {
                return r;
            }
        }
        let region = RegionState {
            id: id.clone(),
            reserves_floor,
            draining,
            lease_expires_at_ms: 0,
            acked_epoch: self.epoch,
        };
        let index = match free {
            Some(i) => {
                self.regions[i] = Some(region);
                i
            }
            None => {
                self.regions.push(Some(region));
                self.regions.len() - 1
            }
        };
        self.membership += 1;
        Response::RegionStored {
            index: index as u8,
            membership: self.membership,
        }
    }

    /// Whether the region in slot `index` may still enforce anything at `now_ms` (a share, a
    /// live revocation or a floor it has not acknowledged giving up) or is the home of a pin:
    /// [`Operation::RemoveRegion`] refuses it until this is false.
    pub fn region_in_use(&self, index: u8, now_ms: u64) -> bool {
        let r = usize::from(index);
        // A tenant pin is in use even without policies: the slot may be reused by another
        // region, which the tenant's future policies must not be pinned to.
        self.tenant_pins.values().any(|&home| home == index)
            || self.entries.values().any(|e| {
                self.enforceable(e, r, now_ms) > 0 || e.pin.is_some_and(|p| p.home == index)
            })
            || self
                .promoted
                .values()
                .any(|p| self.enforceable(&p.entry, r, now_ms) > 0)
    }

    fn remove_region(&mut self, id: &RegionId, now: u64) -> Response {
        let Some(index) = self.region_index(id) else {
            return Response::UnknownRegion { region: id.clone() };
        };
        if self.region_in_use(index, now) {
            return Response::RegionInUse { region: id.clone() };
        }
        let r = usize::from(index);
        self.regions[r] = None;
        let promoted = self.promoted.values_mut().map(|p| &mut p.entry);
        for entry in self.entries.values_mut().chain(promoted) {
            entry.revocations.retain(|v| usize::from(v.region) != r);
        }
        // Trailing empty slots go, so share vectors stay short.
        while self.regions.last().is_some_and(Option::is_none) {
            self.regions.pop();
        }
        let slots = self.regions.len();
        let promoted = self.promoted.values_mut().map(|p| &mut p.entry);
        for entry in self.entries.values_mut().chain(promoted) {
            entry.shares_ppm.truncate(slots);
        }
        self.membership += 1;
        Response::RegionRemoved {
            membership: self.membership,
        }
    }

    fn forget(&mut self, keys: &[PolicyKey], now: u64) -> Response {
        let mut count = 0u32;
        for key in keys {
            let forgettable = self.entries.get(key).is_some_and(|e| {
                e.deleted && (0..self.regions.len()).all(|r| self.enforceable(e, r, now) == 0)
            });
            if forgettable {
                self.entries.remove(key);
                count += 1;
            }
        }
        Response::Forgotten { count }
    }
}

/// The spec a policy would have come from, to validate it with the admin API's rules.
fn policy_spec(policy: &Policy) -> PolicySpec {
    PolicySpec {
        limit: policy.limit as f64,
        window_ms: policy.window_ms as f64,
        burst: Some(policy.burst as f64),
        tier: Some(policy.tier),
        fail_mode: Some(policy.fail_mode),
        floor: Some(f64::from(policy.floor_ppm) / f64::from(PPM)),
        algorithm: Some(policy.algorithm),
        mode: Some(policy.mode),
    }
}

/// A new policy's first split: floors, then the rest evenly (water-filled with no demand);
/// with a `home`, the rest all there. No share holds part of one unit.
fn initial_split(state: &CoordinatorState, policy: &Policy, home: Option<u8>) -> Vec<u32> {
    let slots = state.regions.len();
    let floors: Vec<u32> = (0..slots)
        .map(|r| state.guaranteed_floor(policy, r))
        .collect();
    let live: Vec<bool> = (0..slots).map(|r| state.region(r).is_some()).collect();
    let mut split = match home.map(usize::from).filter(|&h| h < slots && live[h]) {
        Some(h) => {
            let others: u32 = (0..slots).filter(|&r| r != h).map(|r| floors[r]).sum();
            let mut split = floors;
            split[h] = PPM - others.min(PPM);
            split
        }
        None => even_split(&floors, &live),
    };
    for s in &mut split {
        *s = whole_share(policy, *s);
    }
    split
}

/// Adds a revocation, merging with the region's existing one.
pub(crate) fn add_revocation(entry: &mut Entry, rev: Revocation, acked_epoch: u64, now_ms: u64) {
    match entry
        .revocations
        .iter_mut()
        .find(|v| v.region == rev.region)
    {
        Some(existing) => existing.merge(&rev, acked_epoch, now_ms),
        None => {
            entry.revocations.push(rev);
            entry.revocations.sort_by_key(|v| v.region);
        }
    }
}

/// The epoch a region slot acknowledged; an empty slot enforces nothing.
pub(crate) fn acked_of(regions: &[Option<RegionState>], region: usize) -> u64 {
    regions
        .get(region)
        .and_then(Option::as_ref)
        .map_or(u64::MAX, |r| r.acked_epoch)
}

/// Drops revocations that can never matter again.
pub(crate) fn prune(entry: &mut Entry, regions: &[Option<RegionState>], now: u64) {
    entry.revocations.retain(|v| {
        regions
            .get(usize::from(v.region))
            .and_then(Option::as_ref)
            .is_some_and(|r| !v.is_dead(r.acked_epoch, now))
    });
}

/// Whether a tier is pinned automatically.
pub fn auto_pins(tier: Tier) -> bool {
    tier == Tier::Critical
}
