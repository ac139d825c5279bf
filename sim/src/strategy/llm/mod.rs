//! Strategies for budgets of LLM tokens (the `llm_tokens` scenario): a request's cost is known
//! only when it ends, seconds after it was admitted on the client's estimate.
//!
//! The engine calls [`LlmStrategy::start`] when a request arrives (the strategy admits it or
//! refuses it, and says what it holds for it) and [`LlmStrategy::end`] when an admitted one
//! ends with its actual cost, in time order, after [`LlmStrategy::advance`] each tick.
//!
//! - `check_then_charge`: quotad's shares, a reading of the estimate at the start, a plain
//!   check of the actual cost at the end that, when refused, counts nothing.
//! - `charge_at_end`: envoyproxy/ratelimit's fixed-window counters, the whole budget in every
//!   region, the actual cost added past the limit at the end.
//! - `reserve_settle`: the estimate reserved in a whole-budget bucket per region, settled to
//!   the actual cost at the end, the reservation dropped at a TTL.
//! - `quotad_holds`: quotad's shares, a hold of the estimate, settled at the end by a refund
//!   or a charge into bounded debt.

mod charge_at_end;
mod check_then_charge;
mod quotad_holds;
mod reserve_settle;

use std::fmt;

use serde::Serialize;

use super::Setup;
use crate::traffic::Request;
use crate::world::{RegionIx, World};

/// A request whose cost is known only at its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlmRequest {
    /// Unique in the run, in arrival order.
    pub id: u64,
    pub tenant: u32,
    pub region: RegionIx,
    /// The client's estimate, sent at the start (the tenant's mean cost).
    pub estimate: u32,
    /// The tokens it used, known at the end.
    pub actual: u32,
    pub start_ms: u64,
    pub end_ms: u64,
}

impl LlmRequest {
    /// The request as a check of `cost` by its caller.
    pub fn check(&self, cost: u32) -> Request {
        Request {
            tenant: self.tenant,
            region: self.region,
            cost,
        }
    }
}

/// What a strategy holds for an admitted request until it ends: `tokens` spent at the start in
/// `region`'s bucket (0 when nothing was spent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub region: RegionIx,
    pub tokens: u64,
}

/// A way of deciding requests whose cost is known only when they end.
pub trait LlmStrategy {
    /// Runs the control plane (and expiries) up to true time `t_ms`; once per tick.
    fn advance(&mut self, world: &World, t_ms: u64);
    /// Admits `req` at its start `t_ms` with what it holds, or refuses it (`None`).
    fn start(&mut self, world: &World, t_ms: u64, req: &LlmRequest) -> Option<Hold>;
    /// `req`, admitted with `hold`, ends at `t_ms` with its actual cost. Returns the tokens of
    /// it that no bucket or counter took: work done that the budget never counted.
    fn end(&mut self, world: &World, t_ms: u64, req: &LlmRequest, hold: Hold) -> u64;
}

/// The `llm_tokens` strategies, in the order its table lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LlmStrategyKind {
    /// quotad's shares: a reading of the estimate, a plain check of the actual at the end.
    CheckThenCharge,
    /// Per-region fixed-window counters, the actual cost added past the limit at the end.
    ChargeAtEnd,
    /// The estimate reserved per region, settled at the end, dropped at a TTL.
    ReserveSettleRegional,
    /// quotad's shares: a hold of the estimate, settled by a refund or a charge into debt.
    QuotadHolds,
}

impl LlmStrategyKind {
    pub const ALL: [LlmStrategyKind; 4] = [
        Self::CheckThenCharge,
        Self::ChargeAtEnd,
        Self::ReserveSettleRegional,
        Self::QuotadHolds,
    ];

    /// The snake_case name used in output.
    pub fn name(self) -> &'static str {
        match self {
            Self::CheckThenCharge => "check_then_charge",
            Self::ChargeAtEnd => "charge_at_end",
            Self::ReserveSettleRegional => "reserve_settle_regional",
            Self::QuotadHolds => "quotad_holds",
        }
    }
}

impl fmt::Display for LlmStrategyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Builds an `llm_tokens` strategy.
pub fn build(kind: LlmStrategyKind, setup: &Setup<'_>) -> Box<dyn LlmStrategy> {
    match kind {
        LlmStrategyKind::CheckThenCharge => {
            Box::new(check_then_charge::CheckThenCharge::new(setup))
        }
        LlmStrategyKind::ChargeAtEnd => Box::new(charge_at_end::ChargeAtEnd::new(setup)),
        LlmStrategyKind::ReserveSettleRegional => {
            Box::new(reserve_settle::ReserveSettle::new(setup))
        }
        LlmStrategyKind::QuotadHolds => Box::new(quotad_holds::QuotadHolds::new(setup)),
    }
}
