//! quota-model: quotad's lease, epoch and fence protocol as a model, checked exhaustively
//! within bounds by [stateright](https://docs.rs/stateright).
//!
//! The claim under check is docs/architecture.md's "Lease safety": at every instant, what the
//! regions enforce — through their Redis and in process — sums to at most the budget, no
//! region's floor is given to another, and a deposed agent never raises a share. The model
//! runs the product's own code wherever the product has it, so the two cannot drift apart:
//! `CoordinatorState::apply` for every coordinator command (share changes, daemon lease
//! renewals, agent claims, releases and `AgentPassed`) and its `enforceable`,
//! `check_invariant` and `region_share`; quota-core's `RegionView` and `RegionLease` for each
//! daemon's lease clock and what it enforces; quota-store's `Fence::refuses` (the rule
//! `set_params.lua` applies) and `LeaseEnd::end_at` (its stored lease end). What the model
//! writes itself is what only quotad's daemon loop and the Lua scripts hold: which epoch a
//! daemon acknowledges (a standby its view; the agent a complete pass, or its view once
//! `Written::bounded_by` holds), when the agent commits `AgentPassed`, how a write maps the
//! lease end onto Redis's clock (`agent/store_clock.rs`), and a gateway reading the floor
//! once the stored end has passed (`token_bucket.lua`).
//!
//! Every guard can be switched off ([`Guard`]); for each, a test asserts that the checker
//! finds a run breaking the budget and prints it as a trace. Two guards
//! ([`Guard::BoundedAfterWait`], [`Guard::RecordCoversLease`]) are rules quotad took from the
//! model after the checker found it over the budget without them.
//!
//! # Abstractions, and why they lose nothing the properties see
//! - Region A is modelled in full (two daemons contending for its agent role, its Redis
//!   primary and replica); region B enforces, at every instant, everything the coordinator
//!   counts for it. No correct region enforces more, and the per-region property holds A to
//!   exactly that, so A's side is what the search must explore.
//! - A renewal or a claim commits when sent, or is lost: committing it later would count the
//!   coordinator's lease from later and record an acknowledgement older than the daemon's
//!   newest, both towards safety. Answers and parameter writes are messages, delayed,
//!   reordered, duplicated and lost at will.
//! - A leader change is the one thing it changes for leases: the clock that stamps commands
//!   (a clock step ahead). The state machine is replicated, so the new leader's state is the
//!   old one's.
//! - Safety searches have no cut: a cut only disables events every run may leave undone
//!   ([`scenario`]). The liveness search has one.
//! - Each search switches on the faults that meet one part of the protocol ([`scenario`]):
//!   all of them at once make tens of millions of states within a few ticks.
//!
//! # Layout
//! - [`world`]: the cast, lease timing in ticks, [`Bounds`], and the [`Guard`]s.
//! - [`state`]: the state: the coordinator, the daemons, Redis, messages in flight, clocks.
//! - [`model`]: the initial state and every event ([`Action`]), as stateright's `Model`.
//! - [`properties`]: what each region enforces at an instant, and the properties.
//! - [`scenario`]: the searches the tests run, and which finds each mutant.
//! - [`check`]: running a search, its report, and shortening a counterexample.
//! - [`trace`]: a counterexample told one event a line.

pub mod check;
pub mod model;
pub mod properties;
pub mod scenario;
pub mod state;
pub mod trace;
pub mod world;

pub use check::{replay, search, shrink, Outcome};
pub use model::{Action, LeaseModel};
pub use world::{Bounds, Guard};
