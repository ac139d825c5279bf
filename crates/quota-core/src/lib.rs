//! quota-core: the pure model of quotad.
//!
//! Everything here is deterministic: no I/O, no clock, no async, no global randomness. Time
//! (`now_ms`) and random sources come in as arguments, so the daemon, the Raft state machine and
//! the simulator all run this same code and a seed replays any run.
//!
//! # Layout
//! - [`bounds`]: the numeric bounds shared by validation, the reference code and the scripts.
//! - [`ids`]: validated tenant, policy and region ids; one-way hashing of raw identities.
//! - [`plan`]: plans (named sets of policies for classes of subjects) and their resolution.
//! - [`promotion`]: subjects of a plan denied at their class's share, with shares of their own.
//! - [`policy`]: policies and their validation (every problem reported at once).
//! - [`bucket`]: the reference token bucket, bit-exact with `lua/token_bucket.lua`.
//! - [`window`]: the reference sliding window, exact with `lua/sliding_window.lua`.
//! - [`hold`]: holds, an estimate reserved now and settled later with the actual cost.
//! - [`slots`]: concurrency limits, at most so many holds in flight at once.
//! - [`keys`]: the Redis key schema.
//! - [`coordinator`]: the replicated state machine `apply(state, command)` and its safety rules.
//! - [`allocator`]: one rebalance round: demand → max-min fair, damped, revoke-before-grant shares.
//! - [`mode`]: whether a policy's budget is split over regions or lives whole in its home.
//! - [`split`]: water filling, the target split and the even split of a policy's budget.
//! - [`demand`]: the leader's smoothed demand estimates (soft state, never replicated).
//! - [`heavy`]: space-saving top-K, the heaviest subjects of a usage report in bounded memory.
//! - [`lease`]: lease timing and revocations (what a region may still enforce).
//! - [`region`]: what a region enforces given its grant, its lease and its own clock.
//! - [`share`]: the limit a region enforces at a share of a policy's budget.

pub mod allocator;
pub mod bounds;
pub mod bucket;
pub mod coordinator;
pub mod demand;
pub mod heavy;
pub mod hold;
pub mod ids;
pub mod keys;
pub mod lease;
pub mod mode;
pub mod plan;
pub mod policy;
pub mod promotion;
pub mod region;
pub mod reservation;
pub mod share;
pub mod slots;
pub mod split;
pub mod window;

pub use bucket::{BucketParams, BucketState, ChargeOutcome, Decision};
pub use coordinator::{Command, CoordinatorState, Operation, PolicyKey, RequestId, Response};
pub use ids::{hashed_id, IdError, PlanName, PolicyName, RegionId, TenantId};
pub use policy::{Algorithm, FailMode, Policy, PolicyMode, PolicySpec, Tier, PPM};
pub use window::{WindowParams, WindowState};
