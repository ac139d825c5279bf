//! What a command carries: the [`Command`] envelope the leader stamps, the [`Operation`] it
//! applies, and the payloads of the operations the allocator and the promotion tracker propose.
//!
//! Kept apart from the handlers so the replicated log's vocabulary reads in one place: every
//! variant here is one arm of `CoordinatorState::apply`.

use serde::{Deserialize, Serialize};

use super::PolicyKey;
use crate::ids::{PlanName, PolicyName, RegionId, TenantId};
use crate::lease::LeaseConfig;
use crate::policy::Policy;

/// Most policies one [`Operation::PutPolicies`] may carry: a Raft entry of a few hundred KiB.
pub const MAX_BATCH_POLICIES: usize = 1000;

/// Most assignments one [`Operation::AssignPlans`] may carry (a Raft entry of tens of KiB).
pub const MAX_BATCH_ASSIGNMENTS: usize = 1000;

/// A client-chosen id that makes a command idempotent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestId(pub u128);

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
    /// Renews the lease of a region run by one daemon ([`SOLE_DAEMON`]) and records the epoch
    /// it has applied: [`Operation::RenewDaemonLease`] for that daemon.
    ///
    /// [`SOLE_DAEMON`]: super::SOLE_DAEMON
    RenewLease { region: RegionId, acked_epoch: u64 },
    /// Renews one daemon's lease in its region and records the epoch it enforces (its view's,
    /// or, as the agent, the one its store holds): the region's acknowledgement is the least
    /// of its daemons' that may still enforce anything.
    RenewDaemonLease {
        region: RegionId,
        node: u64,
        acked_epoch: u64,
    },
    /// Takes a region's agent role for `node` if nobody holds it or the fence in force is still
    /// `fence_seen`: a compare-and-set, so of two daemons claiming after one holder only one
    /// wins. The winner's writes carry a new fence, above every fence drawn before.
    ClaimAgent {
        region: RegionId,
        node: u64,
        fence_seen: u64,
    },
    /// A daemon stopping, once it decides and writes nothing more. A standby's lease record
    /// goes (the region's acknowledgement stops waiting for it). The agent's (`fence` the
    /// role's) frees the role, so the next claim need not wait for it to go quiet, and its
    /// record stays until the next agent's first complete pass ([`Operation::AgentPassed`]),
    /// since the store holds what it wrote until then. A daemon killed instead counts until
    /// its lease and the margin are over: it may only be paused.
    ReleaseAgent {
        region: RegionId,
        node: u64,
        fence: u64,
    },
    /// The region's agent (`fence` the role's) completed its first pass: every parameter of
    /// its view is in the store under its fence, so the records of agents that left before
    /// it no longer hold the region's acknowledgement back.
    AgentPassed {
        region: RegionId,
        node: u64,
        fence: u64,
    },
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

/// One change of an [`Operation::SetPromoted`] ([`crate::promotion`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PromotedChange {
    /// Gives `key` (a subject and a policy name) an entry of its own under `class`, started at
    /// the class's shares and then moved to `shares_ppm` if that is safe (else it stays at the
    /// class's shares).
    Promote {
        key: PolicyKey,
        class: TenantId,
        shares_ppm: Vec<u32>,
    },
    /// Moves a promoted entry's shares.
    Shares {
        key: PolicyKey,
        shares_ppm: Vec<u32>,
    },
    /// Drops a promoted entry: accepted once it enforces at most the class's share in every
    /// region, or at once when the subject no longer decides under its class.
    Evict { key: PolicyKey },
}
