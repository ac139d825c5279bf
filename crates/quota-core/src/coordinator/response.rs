//! What `apply` answers: [`Response`], one variant per outcome. A business rejection is a
//! response, never an error or a panic, so every replica answers a duplicate alike; a refused
//! share entry names its reason ([`EntryRejection`]).

use serde::{Deserialize, Serialize};

use super::PolicyKey;
use crate::ids::RegionId;
use crate::lease::LeaseConfigError;

/// How many per-entry rejections a [`Response::SharesSet`] lists (the count is always exact).
pub const MAX_LISTED_REJECTIONS: usize = 8;

/// Most invalid entries a refused batch names (the responses are kept for deduplication).
pub const MAX_LISTED_INVALID: usize = 100;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InvalidEntry {
    /// Its position in the batch.
    pub index: u32,
    /// The offending fields, as in [`Response::InvalidPolicy`].
    pub fields: Vec<String>,
}

/// Why one [`ShareEntry`](super::ShareEntry) was refused.
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
    /// The claim won: this node holds the region's agent role with `fence`.
    AgentClaimed {
        fence: u64,
    },
    /// The claim lost, or a release named a role not held: who holds the role now (fence 0:
    /// nobody).
    AgentHeld {
        node: u64,
        fence: u64,
    },
    AgentReleased,
    /// The records of agents that left before this one were dropped.
    AgentPassed,
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
    ///
    /// [`Operation::AssignPlans`]: super::Operation::AssignPlans
    PlansAssigned,
    /// An [`Operation::AssignPlans`] batch refused as a whole, nothing changed: the first
    /// [`MAX_LISTED_INVALID`] entries naming a reserved tenant (`tenant`) or no live plan
    /// (`plan`), out of `total`.
    ///
    /// [`Operation::AssignPlans`]: super::Operation::AssignPlans
    InvalidAssignments {
        entries: Vec<InvalidEntry>,
        total: u32,
    },
}
