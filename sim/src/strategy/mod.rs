//! Strategies: the ways a multi-region limiter can decide, each fed the same arrivals.
//!
//! Every tick the engine first calls [`Strategy::advance`] (the strategy's control plane: its
//! messages, rebalances and leases up to that instant), then [`Strategy::decide`] for each
//! request of the tick in a fixed order. A strategy sees the world (latencies, clocks, faults)
//! but never the shadow bucket.
//!
//! [`llm`] holds the `llm_tokens` scenario's strategies, for costs known only when a request
//! ends; they decide a request twice (at its start and at its end) and run in that scenario's
//! engine.

mod async_broadcast;
mod fixed_share;
mod global_store;
pub mod llm;
mod quotad;
mod quotad_pinned;
mod quotad_reserved;
mod rebalance_no_lease;
mod reservation;

use std::fmt;

use quota_core::bucket::UT;
use quota_core::BucketParams;
use serde::Serialize;

use crate::control::{AgentCounts, ControlConfig};
use crate::regional_store::StoreCalls;
use crate::traffic::{Request, Tenant};
use crate::world::{RegionIx, World};

/// A strategy's answer to one request and how long the caller waited for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub allowed: bool,
    pub latency_us: u64,
    /// Decided in another region than the caller's.
    pub forwarded: bool,
    /// A denial with no retry time: the bucket that decided can never hold the cost.
    pub never: bool,
}

impl Verdict {
    /// A decision against a bucket of `params` for a request of `cost`.
    pub fn against(allowed: bool, params: &BucketParams, cost: u32, latency_us: u64) -> Self {
        Self {
            allowed,
            latency_us,
            forwarded: false,
            never: !allowed && params.capacity_ut < u64::from(cost) * UT,
        }
    }
}

/// A way of deciding requests across regions.
pub trait Strategy {
    /// Runs the control plane up to true time `t_ms`. Called once per tick before decisions.
    fn advance(&mut self, world: &World, t_ms: u64);
    /// Decides one request arriving at true time `t_ms` in `req.region`.
    fn decide(&mut self, world: &World, t_ms: u64, req: &Request) -> Verdict;
    /// Whether `region` enforces only its floors at true time `t_ms` (its lease ran out).
    /// Strategies without leases never do.
    fn on_floor(&self, _world: &World, _t_ms: u64, _region: RegionIx) -> bool {
        false
    }
    /// Ends the run at true time `t_ms` (after the last tick): what a daemon does on shutdown.
    fn finish(&mut self, _world: &World, _t_ms: u64) {}
    /// The calls that reached a regional Redis, for the strategies that count them.
    fn store_calls(&self) -> Option<StoreCalls> {
        None
    }
    /// What the region agents did, for the strategies that run them.
    fn agent_counts(&self) -> Option<AgentCounts> {
        None
    }
}

/// The strategies the simulator knows, in the order tables list them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum StrategyKind {
    /// Every region enforces the full budget.
    Independent,
    /// Every region enforces budget / N, for ever.
    StaticSplit,
    /// One bucket in region 0; every decision crosses the WAN.
    GlobalStore,
    /// Regions admit against a full local bucket and broadcast hits every report interval.
    AsyncBroadcast,
    /// quotad's allocator, but regions keep their last grant for ever and nothing is revoked.
    RebalanceNoLease,
    /// quotad: leased shares, rebalanced, revoke before grant.
    Quotad,
    /// quotad deciding hot buckets from reserved batches of the regional bucket.
    QuotadReserved,
    /// quotad with critical tenants pinned to their home region.
    QuotadPinned,
}

impl StrategyKind {
    pub const ALL: [StrategyKind; 8] = [
        Self::Independent,
        Self::StaticSplit,
        Self::GlobalStore,
        Self::AsyncBroadcast,
        Self::RebalanceNoLease,
        Self::Quotad,
        Self::QuotadReserved,
        Self::QuotadPinned,
    ];

    /// The snake_case name used on the command line and in output.
    pub fn name(self) -> &'static str {
        match self {
            Self::Independent => "independent",
            Self::StaticSplit => "static_split",
            Self::GlobalStore => "global_store",
            Self::AsyncBroadcast => "async_broadcast",
            Self::RebalanceNoLease => "rebalance_no_lease",
            Self::Quotad => "quotad",
            Self::QuotadReserved => "quotad_reserved",
            Self::QuotadPinned => "quotad_pinned",
        }
    }
}

impl fmt::Display for StrategyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What every strategy is built from.
#[derive(Debug, Clone, Copy)]
pub struct Setup<'a> {
    pub tenants: &'a [Tenant],
    pub world: &'a World,
    pub control: &'a ControlConfig,
    /// `global_store`: admit (true) or deny (false) when the store is unreachable.
    pub global_fail_open: bool,
}

/// Builds a strategy.
pub fn build(kind: StrategyKind, setup: &Setup<'_>) -> Box<dyn Strategy> {
    match kind {
        StrategyKind::Independent => Box::new(fixed_share::FixedShare::independent(setup)),
        StrategyKind::StaticSplit => Box::new(fixed_share::FixedShare::static_split(setup)),
        StrategyKind::GlobalStore => Box::new(global_store::GlobalStore::new(setup)),
        StrategyKind::AsyncBroadcast => Box::new(async_broadcast::AsyncBroadcast::new(setup)),
        StrategyKind::RebalanceNoLease => Box::new(rebalance_no_lease::new(setup)),
        StrategyKind::Quotad => Box::new(quotad::Quotad::new(setup)),
        StrategyKind::QuotadReserved => Box::new(quotad_reserved::new(setup)),
        StrategyKind::QuotadPinned => Box::new(quotad_pinned::new(setup)),
    }
}
