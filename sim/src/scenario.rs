//! Scenarios: a named world of tenants, traffic and faults. Each is built from the seed and the
//! run options only, so every strategy in a run meets the same one.

use std::fmt;

use quota_core::{FailMode, Policy, PolicySpec, Tier};
use rand::seq::IndexedRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::faults::{Fault, Faults, Stop};
use crate::traffic::{Cost, Shape, Source, Tenant};
use crate::world::RegionIx;

/// Every tenant's policy window (one minute, the common case).
pub const WINDOW_MS: u64 = 60_000;
/// Limits, per window, that tenants are drawn from.
const LIMITS: [u64; 5] = [600, 1_200, 3_000, 6_000, 12_000];
/// A `flapping` region is cut off for the first half of each period.
const FLAP_PERIOD_MS: u64 = 6_000;

/// Demand moves to the next region this often in `follow_the_sun`.
const SUN_PERIOD_MS: u64 = 120_000;

/// The region whose agent's holder stops in `agent_move` and `agent_crash` (the busy one, not
/// the leader's).
pub const AGENT_REGION: RegionIx = 1;
/// `agent_move` and `agent_crash` stop the agent's holder this often.
pub const AGENT_STOP_PERIOD_MS: u64 = 10_000;

/// The scenarios the simulator knows, in the order tables list them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum ScenarioKind {
    /// Demand spread evenly over the regions.
    Steady,
    /// 80% of every tenant's demand in one region.
    Skewed,
    /// The busy region moves every two minutes.
    FollowTheSun,
    /// One tenant sends ten times its limit, mostly in one region.
    HotTenant,
    /// Thousands of identities with tiny budgets, each active for two seconds.
    OneShot,
    /// Every tenant's clients fire during the first second of each minute, in every region.
    MinuteBursts,
    /// 2% of requests cost 50 tokens.
    HeavyCost,
    /// Over-limit clients ignore Retry-After and hammer at 20× their limit.
    RetryStorm,
    /// The last region is cut off from the others for 90 s; 40 s in, every tenant surges to
    /// 3× its limit in every region.
    Partition,
    /// The leader's daemon crashes for 30 s, and demand moves while it is down.
    LeaderCrash,
    /// Region 1's agent holder stops on SIGTERM every 10 s for 90 s (a rolling upgrade): it
    /// releases the role and its standby takes it over at its next look; demand moves 5 s in.
    AgentMove,
    /// Like `agent_move`, but the holder is killed: its standby takes over after three report
    /// intervals, and its lease record holds the region's acknowledgement until the new
    /// holder's first pass.
    AgentCrash,
    /// The leader's region (region 0) is cut off from the others for 90 s; 40 s in, every
    /// tenant surges to 3× its limit in every region.
    LeaderPartition,
    /// The last region is cut off for 3 s of every 6 s, for 90 s.
    Flapping,
    /// The last region is cut off for 180 s (at most 60% of the run), then heals.
    Heal,
    /// Region 1's Redis is unreachable for 30 s (fail mode per `--fail-mode`, default
    /// `local`).
    RedisOutage,
    /// Clocks run up to 0.2% fast or slow while demand is skewed.
    ClockDrift,
    /// Login-style budgets: 1–10 per 1–15 minutes, burst 1–5; demand in one region that moves
    /// now and then, or clients that alternate regions.
    SmallBudget,
    /// Budgets that refill in days: 10 a day, 100 a month, 1 a month.
    SlowBudget,
    /// 100 000 subjects of one plan, each held to its limit worldwide (runs in its own engine,
    /// [`crate::per_subject`]; not in [`ScenarioKind::ALL`]).
    PerSubject,
    /// Budgets of LLM tokens: each request's cost known only when it ends, seconds later;
    /// demand above the budgets, the last region cut off for 90 s (runs in its own engine,
    /// [`crate::llm_tokens`]; not in [`ScenarioKind::ALL`]).
    LlmTokens,
}

impl ScenarioKind {
    pub const ALL: [ScenarioKind; 19] = [
        Self::Steady,
        Self::Skewed,
        Self::FollowTheSun,
        Self::HotTenant,
        Self::OneShot,
        Self::MinuteBursts,
        Self::HeavyCost,
        Self::RetryStorm,
        Self::Partition,
        Self::LeaderCrash,
        Self::AgentMove,
        Self::AgentCrash,
        Self::LeaderPartition,
        Self::Flapping,
        Self::Heal,
        Self::RedisOutage,
        Self::ClockDrift,
        Self::SmallBudget,
        Self::SlowBudget,
    ];

    /// Whether the scenario cuts regions off, crashes daemons or stops an agent's holder.
    fn faulty(self) -> bool {
        matches!(
            self,
            Self::Partition
                | Self::LeaderCrash
                | Self::AgentMove
                | Self::AgentCrash
                | Self::LeaderPartition
                | Self::Flapping
                | Self::Heal
                | Self::RedisOutage
                | Self::LlmTokens
        )
    }

    /// The fewest regions the scenario makes sense with (a majority must survive a fault).
    pub fn min_regions(self) -> usize {
        if self.faulty() {
            3
        } else {
            1
        }
    }

    /// The shortest run the scenario fits in, in ms.
    pub fn min_duration_ms(self) -> u64 {
        if self.faulty() {
            20_000
        } else {
            1_000
        }
    }

    /// The snake_case name used on the command line and in output.
    pub fn name(self) -> &'static str {
        match self {
            Self::Steady => "steady",
            Self::Skewed => "skewed",
            Self::FollowTheSun => "follow_the_sun",
            Self::HotTenant => "hot_tenant",
            Self::OneShot => "one_shot",
            Self::MinuteBursts => "minute_bursts",
            Self::HeavyCost => "heavy_cost",
            Self::RetryStorm => "retry_storm",
            Self::Partition => "partition",
            Self::LeaderCrash => "leader_crash",
            Self::AgentMove => "agent_move",
            Self::AgentCrash => "agent_crash",
            Self::LeaderPartition => "leader_partition",
            Self::Flapping => "flapping",
            Self::Heal => "heal",
            Self::RedisOutage => "redis_outage",
            Self::ClockDrift => "clock_drift",
            Self::SmallBudget => "small_budget",
            Self::SlowBudget => "slow_budget",
            Self::PerSubject => "per_subject",
            Self::LlmTokens => "llm_tokens",
        }
    }
}

impl fmt::Display for ScenarioKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The knobs a scenario is built with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScenarioOptions {
    pub regions: usize,
    pub duration_ms: u64,
    pub tenants: usize,
    /// Fraction of each tenant's budget reserved per region.
    pub floor: f64,
    /// What every policy does while its regional Redis is down.
    pub fail_mode: FailMode,
}

/// A built scenario.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub kind: ScenarioKind,
    pub tenants: Vec<Tenant>,
    pub sources: Vec<Source>,
    pub faults: Faults,
    /// Times demand moved (or a fault healed): convergence is measured from each.
    pub shifts_ms: Vec<u64>,
    /// Clock drift per region overriding the world's, in ppm.
    pub drift_ppm: Option<Vec<i64>>,
    /// The window W overshoot(W) is measured over: the policy window, or the whole run for
    /// budgets whose window is longer than any run.
    pub overshoot_window_ms: u64,
}

/// Why a scenario cannot be built from the options.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScenarioError {
    #[error("{scenario} needs at least {min} regions (got {regions})")]
    TooFewRegions {
        scenario: ScenarioKind,
        min: usize,
        regions: usize,
    },
    #[error("{scenario} needs a duration of at least {min_ms} ms (got {duration_ms} ms)")]
    TooShort {
        scenario: ScenarioKind,
        min_ms: u64,
        duration_ms: u64,
    },
    #[error("invalid policy: {0}")]
    Policy(String),
    #[error("{scenario} runs in its own engine (sim::{scenario})")]
    OwnEngine { scenario: ScenarioKind },
}

fn policy(limit: u64, floor: f64, tier: Tier) -> Result<Policy, ScenarioError> {
    PolicySpec {
        limit: limit as f64,
        window_ms: WINDOW_MS as f64,
        floor: Some(floor),
        tier: Some(tier),
        ..PolicySpec::default()
    }
    .validate()
    .map_err(|e| ScenarioError::Policy(e.to_string()))
}

/// A small or slow budget with the run's floor and fail mode.
fn small_policy(
    limit: u64,
    window_ms: u64,
    burst: u64,
    opts: &ScenarioOptions,
) -> Result<Policy, ScenarioError> {
    PolicySpec {
        limit: limit as f64,
        window_ms: window_ms as f64,
        burst: Some(burst as f64),
        floor: Some(opts.floor),
        fail_mode: Some(opts.fail_mode),
        ..PolicySpec::default()
    }
    .validate()
    .map_err(|e| ScenarioError::Policy(e.to_string()))
}

/// Demand weights with `share` in `hot` and the rest spread evenly.
fn weights(regions: usize, hot: Option<RegionIx>, share: f64) -> Vec<f64> {
    match hot {
        Some(h) if regions > 1 => (0..regions)
            .map(|r| {
                if r == h {
                    share
                } else {
                    (1.0 - share) / (regions - 1) as f64
                }
            })
            .collect(),
        _ => vec![1.0 / regions as f64; regions],
    }
}

/// Adds one source per region for `tenant`, splitting `rate_per_s` by `w`.
#[allow(clippy::too_many_arguments)]
fn spread(
    out: &mut Vec<Source>,
    tenant: u32,
    rate_per_s: f64,
    w: &[f64],
    from_ms: u64,
    until_ms: u64,
    shape: Shape,
    cost: Cost,
) {
    for (region, &wr) in w.iter().enumerate() {
        if wr > 0.0 {
            out.push(Source {
                tenant,
                region,
                rate_per_s: rate_per_s * wr,
                from_ms,
                until_ms,
                shape,
                cost,
            });
        }
    }
}

/// The shape of one run that every part of a scenario is laid out against.
struct Span {
    kind: ScenarioKind,
    /// Regions.
    n: usize,
    /// The run's length.
    d: u64,
    /// Fault windows start at 30% of the run.
    fault_from: u64,
    /// How each tenant's steady demand is spread over the regions.
    base_weights: Vec<f64>,
}

impl Span {
    fn new(kind: ScenarioKind, opts: &ScenarioOptions) -> Result<Self, ScenarioError> {
        use ScenarioKind as K;
        let n = opts.regions;
        let d = opts.duration_ms;
        let min_regions = kind.min_regions();
        if n < min_regions {
            return Err(ScenarioError::TooFewRegions {
                scenario: kind,
                min: min_regions,
                regions: n,
            });
        }
        let min_ms = kind.min_duration_ms();
        if d < min_ms {
            return Err(ScenarioError::TooShort {
                scenario: kind,
                min_ms,
                duration_ms: d,
            });
        }
        let hot_region = (n > 1).then_some(1 % n);
        let base_weights = match kind {
            K::Skewed | K::ClockDrift => weights(n, hot_region, 0.8),
            K::LeaderCrash | K::AgentMove | K::AgentCrash => weights(n, hot_region, 0.8),
            _ => weights(n, None, 0.0),
        };
        Ok(Self {
            kind,
            n,
            d,
            fault_from: d * 3 / 10,
            base_weights,
        })
    }

    /// A fault lasts a minute (partition) or 30 s, or less in short runs.
    fn fault_len(&self, full: u64) -> u64 {
        full.min(self.d * 3 / 10)
    }
}

impl Scenario {
    /// Builds `kind` with `opts`, drawing every random choice from `rng`.
    pub fn build(
        kind: ScenarioKind,
        opts: &ScenarioOptions,
        rng: &mut ChaCha8Rng,
    ) -> Result<Self, ScenarioError> {
        if matches!(kind, ScenarioKind::PerSubject | ScenarioKind::LlmTokens) {
            return Err(ScenarioError::OwnEngine { scenario: kind });
        }
        let span = Span::new(kind, opts)?;
        let mut scenario = Self {
            kind,
            tenants: Vec::new(),
            sources: Vec::new(),
            faults: Faults::default(),
            shifts_ms: Vec::new(),
            drift_ppm: None,
            overshoot_window_ms: WINDOW_MS,
        };
        match kind {
            ScenarioKind::SmallBudget => scenario.add_small_budgets(&span, opts, rng)?,
            ScenarioKind::SlowBudget => {
                scenario.add_slow_budgets(&span, opts, rng)?;
                scenario.overshoot_window_ms = opts.duration_ms;
            }
            _ => {
                for k in 0..opts.tenants {
                    scenario.add_tenant(&span, k, opts, rng)?;
                }
            }
        }
        scenario.add_events(&span, opts, rng)?;
        Ok(scenario)
    }

    /// The `k`-th of the run's ordinary tenants and its traffic.
    fn add_tenant(
        &mut self,
        span: &Span,
        k: usize,
        opts: &ScenarioOptions,
        rng: &mut ChaCha8Rng,
    ) -> Result<(), ScenarioError> {
        use ScenarioKind as K;
        let limit = LIMITS[k % LIMITS.len()];
        // One tenant in eight is critical (half of them greedy): `quotad_pinned` pins it to
        // its busiest region.
        let critical = k % 8 == 6 || k % 16 == 7;
        let tier = if critical {
            Tier::Critical
        } else {
            Tier::Standard
        };
        let mut p = policy(limit, opts.floor, tier)?;
        p.fail_mode = opts.fail_mode;
        let greedy = k % 4 == 3;
        let per_s = limit as f64 * 1000.0 / WINDOW_MS as f64;
        let demand = match (span.kind, greedy) {
            (K::MinuteBursts, _) => 0.0,
            (K::Partition | K::LeaderPartition, _) => rng.random_range(0.3..0.8),
            (K::RetryStorm, true) => 20.0,
            (_, true) => 2.0,
            (_, false) => rng.random_range(0.3..0.8),
        };
        let tenant = self.tenants.len() as u32;
        let (cost, mean_cost) = match span.kind {
            K::HeavyCost => (
                Cost {
                    base: 1,
                    heavy: 50,
                    p_heavy: 0.02,
                },
                0.98 + 50.0 * 0.02,
            ),
            _ => (Cost::UNIT, 1.0),
        };
        let rate = demand * per_s / mean_cost;
        self.tenants.push(Tenant { policy: p });
        self.add_tenant_sources(span, tenant, limit, rate, cost);
        Ok(())
    }

    /// Where and when an ordinary tenant's demand arrives, by scenario.
    fn add_tenant_sources(&mut self, span: &Span, tenant: u32, limit: u64, rate: f64, cost: Cost) {
        use ScenarioKind as K;
        let (n, d) = (span.n, span.d);
        let sources = &mut self.sources;
        match span.kind {
            K::FollowTheSun => {
                let mut from = 0;
                let mut period = 0;
                while from < d {
                    let until = (from + SUN_PERIOD_MS).min(d);
                    let w = weights(n, Some(period % n), 0.8);
                    spread(
                        sources,
                        tenant,
                        rate,
                        &w,
                        from,
                        until,
                        Shape::Constant,
                        cost,
                    );
                    from = until;
                    period += 1;
                }
            }
            K::LeaderCrash | K::AgentMove | K::AgentCrash => {
                let shift = span.fault_from + 5_000;
                let later = weights(n, Some(2 % n), 0.8);
                let base = &span.base_weights;
                spread(sources, tenant, rate, base, 0, shift, Shape::Constant, cost);
                spread(
                    sources,
                    tenant,
                    rate,
                    &later,
                    shift,
                    d,
                    Shape::Constant,
                    cost,
                );
            }
            K::MinuteBursts => {
                // Each region's clients try 1.5× the whole burst within the first second.
                let burst = vec![1.5 * limit as f64; n];
                let shape = Shape::MinuteBurst { burst_ms: 1_000 };
                spread(sources, tenant, 1.0, &burst, 0, d, shape, cost);
            }
            _ => {
                let base = &span.base_weights;
                spread(sources, tenant, rate, base, 0, d, Shape::Constant, cost);
            }
        }
    }

    /// What a scenario adds once its ordinary tenants exist: extra tenants, faults, shifts.
    fn add_events(
        &mut self,
        span: &Span,
        opts: &ScenarioOptions,
        rng: &mut ChaCha8Rng,
    ) -> Result<(), ScenarioError> {
        use ScenarioKind as K;
        let (n, d, fault_from) = (span.n, span.d, span.fault_from);
        match span.kind {
            K::FollowTheSun => {
                self.shifts_ms = (SUN_PERIOD_MS..d).step_by(SUN_PERIOD_MS as usize).collect();
            }
            K::HotTenant => self.add_hot_tenant(span, opts)?,
            K::OneShot => self.add_one_shot_tenants(span, opts, rng)?,
            K::Partition => self.add_partition(span, n - 1),
            K::LeaderPartition => self.add_partition(span, 0),
            K::Flapping => {
                let until_ms = fault_from + span.fault_len(90_000);
                for from_ms in (fault_from..until_ms).step_by(FLAP_PERIOD_MS as usize) {
                    self.faults.list.push(Fault::Isolate {
                        region: n - 1,
                        from_ms,
                        until_ms: (from_ms + FLAP_PERIOD_MS / 2).min(until_ms),
                    });
                }
                self.shifts_ms.push(until_ms);
            }
            K::Heal => {
                let until_ms = fault_from + (180_000u64).min(d * 6 / 10);
                self.faults.list.push(Fault::Isolate {
                    region: n - 1,
                    from_ms: fault_from,
                    until_ms,
                });
                self.shifts_ms.push(until_ms);
            }
            K::LeaderCrash => {
                let until_ms = fault_from + span.fault_len(30_000);
                self.faults.list.push(Fault::Crash {
                    region: 0,
                    from_ms: fault_from,
                    until_ms,
                });
                self.shifts_ms.push(fault_from + 5_000);
            }
            K::AgentMove | K::AgentCrash => {
                let how = if span.kind == K::AgentMove {
                    Stop::Graceful
                } else {
                    Stop::Killed
                };
                let until_ms = fault_from + span.fault_len(90_000);
                for at_ms in (fault_from..until_ms).step_by(AGENT_STOP_PERIOD_MS as usize) {
                    self.faults.list.push(Fault::AgentStop {
                        region: AGENT_REGION,
                        at_ms,
                        how,
                    });
                }
                self.shifts_ms.push(fault_from + 5_000);
            }
            K::RedisOutage => {
                let until_ms = fault_from + span.fault_len(30_000);
                self.faults.list.push(Fault::RedisOutage {
                    region: 1,
                    from_ms: fault_from,
                    until_ms,
                });
            }
            K::ClockDrift => {
                self.drift_ppm = Some((0..n).map(|r| [2_000, -2_000, 1_000][r % 3]).collect());
            }
            _ => {}
        }
        Ok(())
    }

    /// `hot_tenant`: one more tenant sending ten times its limit, mostly in region 0.
    fn add_hot_tenant(&mut self, span: &Span, opts: &ScenarioOptions) -> Result<(), ScenarioError> {
        let tenant = self.tenants.len() as u32;
        let limit = 60_000;
        self.tenants.push(Tenant {
            policy: policy(limit, opts.floor, Tier::Standard)?,
        });
        let w = weights(span.n, Some(0), 0.6);
        let rate = 10.0 * limit as f64 * 1000.0 / WINDOW_MS as f64;
        let (shape, cost) = (Shape::Constant, Cost::UNIT);
        spread(&mut self.sources, tenant, rate, &w, 0, span.d, shape, cost);
        Ok(())
    }

    /// `one_shot`: 2 000 tiny tenants, each active for two seconds, half of them in one region.
    fn add_one_shot_tenants(
        &mut self,
        span: &Span,
        opts: &ScenarioOptions,
        rng: &mut ChaCha8Rng,
    ) -> Result<(), ScenarioError> {
        let (n, d) = (span.n, span.d);
        let mut p = policy(10, opts.floor, Tier::Standard)?;
        p.fail_mode = opts.fail_mode;
        let regions: Vec<RegionIx> = (0..n).collect();
        for k in 0..2_000u32 {
            let tenant = self.tenants.len() as u32;
            self.tenants.push(Tenant { policy: p.clone() });
            let from = rng.random_range(0..d.saturating_sub(2_000).max(1));
            let until = from + 2_000;
            let w = if k % 2 == 0 {
                let region = *regions.choose(rng).expect("at least one region");
                let mut w = vec![0.0; n];
                w[region] = 1.0;
                w
            } else {
                weights(n, None, 0.0)
            };
            let (shape, cost) = (Shape::Constant, Cost::UNIT);
            spread(&mut self.sources, tenant, 5.0, &w, from, until, shape, cost);
        }
        Ok(())
    }

    /// Adds tenant `tenant`'s sources at `rate_per_s` requests a second, placed by `k % 4`:
    /// two in four in one region that moves to another every 60–180 s, one in four in clients
    /// that alternate regions (spread evenly), one in four in one region for the whole run.
    fn add_placed_sources(
        &mut self,
        span: &Span,
        tenant: u32,
        k: usize,
        rate_per_s: f64,
        rng: &mut ChaCha8Rng,
    ) {
        let (n, d) = (span.n, span.d);
        let (shape, cost) = (Shape::Constant, Cost::UNIT);
        let one = |region: RegionIx| {
            let mut w = vec![0.0; n];
            w[region] = 1.0;
            w
        };
        match k % 4 {
            0 | 1 => {
                let mut from = 0;
                while from < d {
                    let until = (from + rng.random_range(60_000..=180_000)).min(d);
                    let w = one(rng.random_range(0..n));
                    spread(
                        &mut self.sources,
                        tenant,
                        rate_per_s,
                        &w,
                        from,
                        until,
                        shape,
                        cost,
                    );
                    from = until;
                }
            }
            2 => {
                let w = weights(n, None, 0.0);
                spread(&mut self.sources, tenant, rate_per_s, &w, 0, d, shape, cost);
            }
            _ => {
                let w = one(rng.random_range(0..n));
                spread(&mut self.sources, tenant, rate_per_s, &w, 0, d, shape, cost);
            }
        }
    }

    /// `small_budget`: ten times the run's tenants with login-style budgets, each asking for
    /// 0.5–3× its limit.
    fn add_small_budgets(
        &mut self,
        span: &Span,
        opts: &ScenarioOptions,
        rng: &mut ChaCha8Rng,
    ) -> Result<(), ScenarioError> {
        for k in 0..opts.tenants * 10 {
            let limit = rng.random_range(1..=10u64);
            let window_ms = *[60_000, 60_000, 300_000, 900_000]
                .choose(rng)
                .expect("windows");
            let burst = rng.random_range(1..=5u64);
            let p = small_policy(limit, window_ms, burst, opts)?;
            let rate = rng.random_range(0.5..3.0) * limit as f64 * 1000.0 / window_ms as f64;
            let tenant = self.tenants.len() as u32;
            self.tenants.push(Tenant { policy: p });
            self.add_placed_sources(span, tenant, k, rate, rng);
        }
        Ok(())
    }

    /// `slow_budget`: fifteen times the run's tenants with 10 a day, 100 a month or 1 a month
    /// (burst = limit), each asking for 0.5–3× its burst over the run.
    fn add_slow_budgets(
        &mut self,
        span: &Span,
        opts: &ScenarioOptions,
        rng: &mut ChaCha8Rng,
    ) -> Result<(), ScenarioError> {
        const DAY_MS: u64 = 86_400_000;
        const BUDGETS: [(u64, u64); 3] = [(10, DAY_MS), (100, 30 * DAY_MS), (1, 30 * DAY_MS)];
        for k in 0..opts.tenants * 15 {
            let (limit, window_ms) = BUDGETS[k % BUDGETS.len()];
            let p = small_policy(limit, window_ms, limit, opts)?;
            let rate = rng.random_range(0.5..3.0) * limit as f64 * 1000.0 / span.d as f64;
            let tenant = self.tenants.len() as u32;
            self.tenants.push(Tenant { policy: p });
            self.add_placed_sources(span, tenant, k / BUDGETS.len(), rate, rng);
        }
        Ok(())
    }

    /// `partition`: the last region cut off, and a surge everywhere once the majority has had
    /// time to reassign the silent region's share.
    /// Cuts `region` off for 90 s with a surge 40 s in.
    fn add_partition(&mut self, span: &Span, region: RegionIx) {
        let (n, fault_from) = (span.n, span.fault_from);
        let len = span.fault_len(90_000);
        let until_ms = fault_from + len;
        self.faults.list.push(Fault::Isolate {
            region,
            from_ms: fault_from,
            until_ms,
        });
        // The surge comes with every bucket refilled: what the cut-off region still enforces
        // then is spent twice unless it stopped at its lease.
        let surge_from = fault_from + len * 4 / 9;
        let w = weights(n, None, 0.0);
        for (tenant, t) in self.tenants.iter().enumerate() {
            let rate = 3.0 * t.policy.limit as f64 * 1000.0 / WINDOW_MS as f64;
            let (shape, cost) = (Shape::Constant, Cost::UNIT);
            let (sources, tenant) = (&mut self.sources, tenant as u32);
            spread(sources, tenant, rate, &w, surge_from, until_ms, shape, cost);
        }
        self.shifts_ms.push(until_ms);
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    fn opts() -> ScenarioOptions {
        ScenarioOptions {
            regions: 3,
            duration_ms: 60_000,
            tenants: 8,
            floor: 0.05,
            fail_mode: FailMode::Local,
        }
    }

    #[test]
    fn every_scenario_builds_and_shares_one_window() {
        for kind in ScenarioKind::ALL {
            let s = Scenario::build(kind, &opts(), &mut ChaCha8Rng::seed_from_u64(1)).unwrap();
            assert!(!s.sources.is_empty(), "{kind}");
            let small = matches!(kind, ScenarioKind::SmallBudget | ScenarioKind::SlowBudget);
            assert!(small || s.tenants.iter().all(|t| t.policy.window_ms == WINDOW_MS));
            assert!(s
                .sources
                .iter()
                .all(|src| (src.tenant as usize) < s.tenants.len()));
            assert!(s
                .sources
                .iter()
                .all(|src| src.region < 3 && src.until_ms <= 60_000));
        }
    }

    #[test]
    fn skewed_demand_lands_mostly_in_one_region() {
        let s = Scenario::build(
            ScenarioKind::Skewed,
            &opts(),
            &mut ChaCha8Rng::seed_from_u64(1),
        )
        .unwrap();
        let rate = |r| {
            s.sources
                .iter()
                .filter(|x| x.region == r)
                .map(|x| x.rate_per_s)
                .sum::<f64>()
        };
        let total: f64 = (0..3).map(rate).sum();
        assert!((rate(1) / total - 0.8).abs() < 1e-9);
    }

    #[test]
    fn an_agent_holder_stops_every_period_in_one_region() {
        let o = ScenarioOptions {
            duration_ms: 360_000,
            ..opts()
        };
        for (kind, how) in [
            (ScenarioKind::AgentMove, Stop::Graceful),
            (ScenarioKind::AgentCrash, Stop::Killed),
        ] {
            let s = Scenario::build(kind, &o, &mut ChaCha8Rng::seed_from_u64(1)).unwrap();
            // From 30% of the run (108 s) for 90 s, one every 10 s.
            let want: Vec<_> = (0..9)
                .map(|k| Fault::AgentStop {
                    region: 1,
                    at_ms: 108_000 + k * 10_000,
                    how,
                })
                .collect();
            assert_eq!(s.faults.list, want, "{kind}");
            assert_eq!(s.shifts_ms, vec![113_000]);
        }
    }

    #[test]
    fn fault_scenarios_refuse_too_few_regions() {
        let o = ScenarioOptions {
            regions: 2,
            ..opts()
        };
        let e = Scenario::build(
            ScenarioKind::Partition,
            &o,
            &mut ChaCha8Rng::seed_from_u64(1),
        );
        assert!(matches!(
            e,
            Err(ScenarioError::TooFewRegions { min: 3, .. })
        ));
    }
}
