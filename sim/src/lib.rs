//! sim: quotad's deterministic simulator.
//!
//! A virtual world of regions, WAN latencies, drifting clocks and faults; seeded traffic from
//! many tenants; and several strategies for multi-region rate limiting deciding the very same
//! requests, side by side with a shadow ideal global bucket that measures them. The quotad
//! strategies run `quota-core` itself — its allocator, coordinator state machine, leases and
//! reference token bucket — not a copy. One seed drives every random choice and time is
//! virtual, so the same seed and options print the same bytes.
//!
//! # Layout
//! - [`region`]: the region index the world and the faults share.
//! - [`world`]: regions, latency matrix, clocks with drift, fault queries.
//! - [`faults`]: the fault schedule (partitions, crashes, Redis outages, agent holder stops).
//! - [`traffic`]: tenants, sources and the arrivals of each tick.
//! - [`scenario`]: the named scenarios of the suite.
//! - [`control`]: control-plane timing shared by the rebalancing strategies.
//! - [`regional_store`]: each region's Redis as a set of reference buckets, with fail modes
//!   and a count of the calls that reach it.
//! - [`strategy`]: the strategies, one file each, behind the [`strategy::Strategy`] trait.
//! - [`metrics`]: the shadow bucket, overshoot, goodput, false denials, latency, convergence.
//! - [`simulation`]: the engine that runs a scenario.
//! - [`per_subject`]: the `per_subject` scenario: 100 000 subjects of one plan, in an engine of
//!   its own.
//! - [`llm_tokens`]: budgets of LLM tokens, each request's cost known only when it ends, in an
//!   engine of its own; its strategies are [`strategy::llm`].
//! - [`sliding_window`]: "at most N in any W" policies split over the regions, decided by
//!   `quota_core::window`, in a small engine of their own.
//! - [`report`], [`plot`]: table, CSV and JSON output; SVG plots.
//! - [`options`]: the command line.

pub mod control;
pub mod faults;
pub mod llm_tokens;
pub mod metrics;
pub mod options;
pub mod per_subject;
pub mod plot;
pub mod region;
pub mod regional_store;
pub mod report;
pub mod scenario;
pub mod simulation;
pub mod sliding_window;
pub mod strategy;
pub mod traffic;
pub mod world;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use scenario::{ScenarioError, ScenarioKind};
use simulation::{RunConfig, ScenarioRun};
use strategy::StrategyKind;

/// Runs every scenario with every strategy on up to `jobs` threads; results come back in
/// `scenarios` order whatever the thread count. `progress` is told each simulated second.
pub fn run_suite(
    scenarios: &[ScenarioKind],
    strategies: &[StrategyKind],
    cfg: &RunConfig,
    jobs: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Vec<ScenarioRun>, ScenarioError> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<ScenarioRun, ScenarioError>>>> =
        Mutex::new(scenarios.iter().map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..jobs.clamp(1, scenarios.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&kind) = scenarios.get(i) else { break };
                let r = simulation::run_scenario(kind, strategies, cfg, &mut |n| progress(n));
                results
                    .lock()
                    .expect("no worker panics while holding the lock")[i] = Some(r);
            });
        }
    });
    results
        .into_inner()
        .expect("workers finished")
        .into_iter()
        .map(|r| r.expect("every scenario ran"))
        .collect()
}
