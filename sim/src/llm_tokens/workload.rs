//! The `llm_tokens` world: tenants with budgets of LLM tokens per minute, their requests, and
//! the partition. Every random choice comes from the run's seed.
//!
//! - Budgets of 50 000 to 1 000 000 tokens a minute (burst = limit), each with a debt limit of
//!   a tenth of its burst for charges of work already done.
//! - A tenant's requests cost on average 150, 300 or 600 tokens (its mean), lognormal with
//!   σ = 1.5 (median a third of the mean, one in a thousand above 15–60× it), at most
//!   [`MAX_COST`]. The client sends the mean as its estimate; the cost is known at the end.
//! - A request lasts 1 s plus its cost at 30–100 tokens a second, at most 30 s.
//! - Demand is 2–4× every budget, in tokens: half the tenants spread evenly over the regions,
//!   half with 60% in one region.
//! - The last region is cut off from the others from 30% of the run for 90 s (at most 30% of
//!   the run), as in `partition`.

use quota_core::{PolicySpec, Tier};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::faults::{Fault, Faults};
use crate::scenario::{ScenarioError, ScenarioKind, ScenarioOptions, WINDOW_MS};
use crate::traffic::{Cost, Shape, Source, Tenant};

/// Budgets, in tokens a minute, that tenants are given in turn.
const LIMITS: [u64; 5] = [50_000, 100_000, 250_000, 500_000, 1_000_000];
/// Mean costs of a request, in tokens, that tenants are given in turn.
const MEAN_COSTS: [u32; 3] = [150, 300, 600];
/// σ of the lognormal cost.
const COST_SIGMA: f64 = 1.5;
/// The largest cost of one request (a model's largest output).
pub const MAX_COST: u32 = 32_000;
/// A request's duration: 1 s, plus its cost at 30–100 tokens a second, at most 30 s.
const MIN_DURATION_MS: u64 = 1_000;
const MAX_DURATION_MS: u64 = 30_000;
const TOKENS_PER_S: std::ops::Range<f64> = 30.0..100.0;
/// The debt limit is this fraction of the burst.
const DEBT_FRACTION: u64 = 10;

/// Tenants, their estimates, their sources and the fault schedule.
#[derive(Debug, Clone)]
pub struct Workload {
    pub tenants: Vec<Tenant>,
    /// Per tenant: the mean cost of its requests, which its clients send as the estimate.
    pub estimates: Vec<u32>,
    pub sources: Vec<Source>,
    pub faults: Faults,
}

impl Workload {
    /// Builds the scenario with `opts`, drawing every random choice from `rng`.
    pub fn build(opts: &ScenarioOptions, rng: &mut ChaCha8Rng) -> Result<Self, ScenarioError> {
        let kind = ScenarioKind::LlmTokens;
        let (n, d) = (opts.regions, opts.duration_ms);
        if n < kind.min_regions() {
            return Err(ScenarioError::TooFewRegions {
                scenario: kind,
                min: kind.min_regions(),
                regions: n,
            });
        }
        if d < kind.min_duration_ms() {
            return Err(ScenarioError::TooShort {
                scenario: kind,
                min_ms: kind.min_duration_ms(),
                duration_ms: d,
            });
        }
        let mut w = Self {
            tenants: Vec::new(),
            estimates: Vec::new(),
            sources: Vec::new(),
            faults: Faults::default(),
        };
        for k in 0..opts.tenants {
            let limit = LIMITS[k % LIMITS.len()];
            let mean = MEAN_COSTS[k % MEAN_COSTS.len()];
            let policy = PolicySpec {
                limit: limit as f64,
                window_ms: WINDOW_MS as f64,
                floor: Some(opts.floor),
                tier: Some(Tier::Standard),
                fail_mode: Some(opts.fail_mode),
                debt_limit: Some((limit / DEBT_FRACTION) as f64),
                after_the_fact: Some(true),
                ..PolicySpec::default()
            }
            .validate()
            .map_err(|e| ScenarioError::Policy(e.to_string()))?;
            let demand: f64 = rng.random_range(2.0..4.0);
            let per_s = demand * limit as f64 * 1000.0 / WINDOW_MS as f64 / f64::from(mean);
            let hot = (k % 2 == 1).then(|| rng.random_range(0..n));
            for region in 0..n {
                let weight = match hot {
                    None => 1.0 / n as f64,
                    Some(h) if h == region => 0.6,
                    Some(_) => 0.4 / (n - 1) as f64,
                };
                w.sources.push(Source {
                    tenant: k as u32,
                    region,
                    rate_per_s: per_s * weight,
                    from_ms: 0,
                    until_ms: d,
                    shape: Shape::Constant,
                    cost: Cost::UNIT,
                });
            }
            w.tenants.push(Tenant { policy });
            w.estimates.push(mean);
        }
        let from_ms = d * 3 / 10;
        w.faults.list.push(Fault::Isolate {
            region: n - 1,
            from_ms,
            until_ms: from_ms + (d * 3 / 10).min(90_000),
        });
        Ok(w)
    }
}

/// Draws each request's actual cost and duration.
#[derive(Debug)]
pub struct Costs {
    rng: ChaCha8Rng,
}

impl Costs {
    pub fn new(rng: ChaCha8Rng) -> Self {
        Self { rng }
    }

    /// A cost of mean about `mean` (lognormal, at most [`MAX_COST`]) and its duration in
    /// whole ticks of `tick_ms`.
    pub fn draw(&mut self, mean: u32, tick_ms: u64) -> (u32, u64) {
        let mu = f64::from(mean).ln() - COST_SIGMA * COST_SIGMA / 2.0;
        // Box–Muller.
        let u1: f64 = self.rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = self.rng.random();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        let cost = (mu + COST_SIGMA * z)
            .exp()
            .round()
            .clamp(1.0, f64::from(MAX_COST)) as u32;
        let speed = self.rng.random_range(TOKENS_PER_S);
        let ms = MIN_DURATION_MS as f64 + f64::from(cost) * 1000.0 / speed;
        let ms = (ms as u64).min(MAX_DURATION_MS).div_ceil(tick_ms) * tick_ms;
        (cost, ms)
    }
}

#[cfg(test)]
mod tests {
    use quota_core::FailMode;
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn costs_are_heavy_tailed_around_the_mean_and_durations_bounded() {
        let mut c = Costs::new(ChaCha8Rng::seed_from_u64(1));
        let n = 200_000;
        let draws: Vec<(u32, u64)> = (0..n).map(|_| c.draw(300, 10)).collect();
        let mean = draws.iter().map(|d| f64::from(d.0)).sum::<f64>() / f64::from(n);
        assert!((mean - 300.0).abs() < 15.0, "mean {mean}");
        let mut costs: Vec<u32> = draws.iter().map(|d| d.0).collect();
        costs.sort_unstable();
        let median = costs[costs.len() / 2];
        assert!((80..=120).contains(&median), "median {median}");
        assert!(costs[costs.len() - 1] > 10_000, "no tail");
        assert!(costs[costs.len() - 1] <= MAX_COST);
        assert!(draws
            .iter()
            .all(|d| (MIN_DURATION_MS..=MAX_DURATION_MS).contains(&d.1) && d.1 % 10 == 0));
        assert!(draws.iter().any(|d| d.1 == MAX_DURATION_MS));
    }

    #[test]
    fn demand_is_above_every_budget_and_one_region_is_cut_off() {
        let opts = ScenarioOptions {
            regions: 3,
            duration_ms: 360_000,
            tenants: 10,
            floor: 0.0,
            fail_mode: FailMode::Local,
        };
        let w = Workload::build(&opts, &mut ChaCha8Rng::seed_from_u64(1)).unwrap();
        assert_eq!((w.tenants.len(), w.estimates.len()), (10, 10));
        for (i, t) in w.tenants.iter().enumerate() {
            let tokens_per_s: f64 = w
                .sources
                .iter()
                .filter(|s| s.tenant as usize == i)
                .map(|s| s.rate_per_s * f64::from(w.estimates[i]))
                .sum();
            let budget_per_s = t.policy.limit as f64 / 60.0;
            assert!(tokens_per_s >= 2.0 * budget_per_s, "tenant {i}");
            assert_eq!(t.policy.debt_limit, t.policy.burst / 10);
        }
        assert_eq!(
            w.faults.list,
            [Fault::Isolate {
                region: 2,
                from_ms: 108_000,
                until_ms: 198_000
            }]
        );
        let short = ScenarioOptions { regions: 2, ..opts };
        assert!(Workload::build(&short, &mut ChaCha8Rng::seed_from_u64(1)).is_err());
    }
}
