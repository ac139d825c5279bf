//! The engine: builds a scenario's world, runs every strategy tick by tick on the same
//! arrivals beside the shadow global bucket, and collects the results.

use std::time::Instant;

use quota_core::FailMode;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::control::ControlConfig;
use crate::faults::Faults;
use crate::metrics::{Recorder, Second, Shadow, Summary};
use crate::scenario::{Scenario, ScenarioError, ScenarioKind, ScenarioOptions};
use crate::strategy::{self, Setup, Strategy, StrategyKind};
use crate::traffic::Arrivals;
use crate::world::{World, WorldSpec};

/// Everything a run depends on besides the scenario and strategy names.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunConfig {
    pub seed: u64,
    pub regions: usize,
    pub duration_ms: u64,
    pub tick_ms: u64,
    pub tenants: usize,
    pub floor: f64,
    pub fail_mode: FailMode,
    pub control: ControlConfig,
    pub global_fail_open: bool,
    /// Goodput, false denials and latency count from here on.
    pub warmup_ms: u64,
}

/// One strategy's results in one scenario.
#[derive(Debug, Clone, Serialize)]
pub struct StrategyRun {
    pub summary: Summary,
    #[serde(skip)]
    pub seconds: Vec<Second>,
}

/// One scenario's results.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioRun {
    pub scenario: ScenarioKind,
    pub strategies: Vec<StrategyRun>,
    /// Sum over tenants of limit / window, in tokens per second: the global budget's rate.
    pub budget_tokens_per_s: f64,
    /// What the shadow global bucket admitted, per second.
    #[serde(skip)]
    pub ideal_per_s: Vec<u64>,
    /// Decisions made (shadow included) and the wall time they took.
    #[serde(skip)]
    pub decisions: u64,
    #[serde(skip)]
    pub wall_s: f64,
}

/// A ChaCha stream for one purpose, derived from the run's one seed and a label.
pub fn rng_for(seed: u64, label: &str) -> ChaCha8Rng {
    // FNV-1a over the label keeps the streams of different purposes independent.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in label.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    ChaCha8Rng::seed_from_u64(seed ^ h)
}

/// Runs `strategies` on `kind`; `progress` is told each simulated second.
pub fn run_scenario(
    kind: ScenarioKind,
    strategies: &[StrategyKind],
    cfg: &RunConfig,
    progress: &mut dyn FnMut(u64),
) -> Result<ScenarioRun, ScenarioError> {
    let opts = ScenarioOptions {
        regions: cfg.regions,
        duration_ms: cfg.duration_ms,
        tenants: cfg.tenants,
        floor: cfg.floor,
        fail_mode: cfg.fail_mode,
    };
    let scenario = Scenario::build(kind, &opts, &mut rng_for(cfg.seed, kind.name()))?;
    let world = build_world(cfg, &scenario);
    let tenants = &scenario.tenants;
    let setup = Setup {
        tenants,
        world: &world,
        control: &cfg.control,
        global_fail_open: cfg.global_fail_open,
    };
    let mut strats: Vec<_> = strategies
        .iter()
        .map(|&k| strategy::build(k, &setup))
        .collect();
    let healthy: Vec<bool> = (0..world.regions)
        .map(|r| scenario.faults.healthy(r))
        .collect();
    // One recorder per strategy, each judging the same regions healthy.
    let recorders_for = || -> Vec<Recorder> {
        strategies
            .iter()
            .map(|_| {
                Recorder::new(
                    tenants,
                    scenario.overshoot_window_ms,
                    cfg.tick_ms,
                    cfg.duration_ms,
                    cfg.warmup_ms,
                    healthy.clone(),
                )
            })
            .collect()
    };
    let mut recorders = recorders_for();
    let started = Instant::now();
    let (ideal_per_s, mut decisions) = run_ticks(
        cfg,
        &scenario,
        &world,
        &mut strats,
        &mut recorders,
        progress,
    );
    if healthy.contains(&false) {
        // Healthy goodput is what the cut or crash costs the other regions: the same
        // strategies again on the same arrivals without it.
        let calm = Scenario {
            faults: scenario.faults.without_cuts(),
            ..scenario.clone()
        };
        let calm_world = build_world(cfg, &calm);
        let setup = Setup {
            world: &calm_world,
            ..setup
        };
        let mut calm_strats: Vec<_> = strategies
            .iter()
            .map(|&k| strategy::build(k, &setup))
            .collect();
        let mut baselines = recorders_for();
        let (_, calm_decisions) = run_ticks(
            cfg,
            &calm,
            &calm_world,
            &mut calm_strats,
            &mut baselines,
            &mut |_| {},
        );
        decisions += calm_decisions;
        for (rec, mut base) in recorders.iter_mut().zip(baselines) {
            rec.finish();
            base.finish();
            rec.against_baseline(&base);
        }
    }
    let wall_s = started.elapsed().as_secs_f64();
    let budget_tokens_per_s = tenants
        .iter()
        .map(|t| t.policy.limit as f64 * 1000.0 / t.policy.window_ms as f64)
        .sum();
    let strategies = strategies
        .iter()
        .zip(recorders)
        .zip(&strats)
        .map(|((k, mut rec), strat)| StrategyRun {
            summary: {
                rec.finish();
                let mut s = rec.summary(kind.name(), k.name(), &scenario.shifts_ms, cfg.warmup_ms);
                s.store_calls = strat.store_calls();
                s.agents = strat.agent_counts();
                s
            },
            seconds: rec.seconds().to_vec(),
        })
        .collect();
    Ok(ScenarioRun {
        scenario: kind,
        strategies,
        budget_tokens_per_s,
        ideal_per_s,
        decisions,
        wall_s,
    })
}

/// The scenario's world: its regions and faults, with the scenario's clock drifts if any.
fn build_world(cfg: &RunConfig, scenario: &Scenario) -> World {
    let mut world = world_with(cfg, scenario.faults.clone());
    if let Some(drift) = &scenario.drift_ppm {
        for (clock, &ppm) in world.clocks.iter_mut().zip(drift) {
            clock.drift_ppm = ppm;
        }
    }
    world
}

/// The run's regions, latencies and clocks (the same for every scenario of a seed) with
/// `faults`.
fn world_with(cfg: &RunConfig, faults: Faults) -> World {
    let spec = WorldSpec {
        regions: cfg.regions,
        ..WorldSpec::default()
    };
    World::new(&spec, faults, &mut rng_for(cfg.seed, "world"))
}

/// Every tick: the arrivals, decided by the shadow bucket and then by each strategy, recorded
/// side by side. Returns what the shadow admitted per second and the decisions made.
fn run_ticks(
    cfg: &RunConfig,
    scenario: &Scenario,
    world: &World,
    strats: &mut [Box<dyn Strategy>],
    recorders: &mut [Recorder],
    progress: &mut dyn FnMut(u64),
) -> (Vec<u64>, u64) {
    let mut shadow = Shadow::new(&scenario.tenants);
    let mut arrivals = Arrivals::new(scenario.sources.clone(), rng_for(cfg.seed, "arrivals"));
    let mut ideal_per_s = vec![0u64; cfg.duration_ms.div_ceil(1000) as usize];
    let mut requests = Vec::new();
    let mut shadow_ok = Vec::new();
    let mut decisions = 0u64;
    let mut t = 0;
    while t < cfg.duration_ms {
        arrivals.tick(t, cfg.tick_ms, &mut requests);
        shadow_ok.clear();
        for r in &requests {
            let ok = shadow.decide(t, r);
            if ok {
                ideal_per_s[(t / 1000) as usize] += u64::from(r.cost);
            }
            shadow_ok.push(ok);
        }
        for (s, rec) in strats.iter_mut().zip(recorders.iter_mut()) {
            s.advance(world, t);
            for (r, &ok) in requests.iter().zip(&shadow_ok) {
                let v = s.decide(world, t, r);
                rec.record(t, r, ok, v.allowed, v.latency_us);
                rec.record_route(v.forwarded, v.never);
            }
            for region in 0..world.regions {
                if s.on_floor(world, t, region) {
                    rec.record_floor(t, region, cfg.tick_ms);
                }
            }
        }
        decisions += requests.len() as u64 * (strats.len() as u64 + 1);
        t += cfg.tick_ms;
        if t % 1000 < cfg.tick_ms {
            progress(1);
        }
    }
    for s in strats.iter_mut() {
        s.finish(world, t);
    }
    (ideal_per_s, decisions)
}
