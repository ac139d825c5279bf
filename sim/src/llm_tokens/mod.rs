//! The `llm_tokens` scenario: budgets of LLM tokens, whose cost is known only when a request
//! ends, seconds after it was admitted on the client's estimate.
//!
//! It runs in its own engine because a request is decided twice: when it starts
//! ([`LlmStrategy::start`], on the estimate) and when it ends ([`LlmStrategy::end`], with the
//! actual cost). Tick by tick the engine ends the requests due (in time order), then starts
//! the tick's arrivals, for every strategy on the same requests. What a strategy admitted is
//! recorded, with its actual cost, when it ends: the tokens spent then, whether or not a bucket
//! counted them. The ideal (`Ideal`) is the policy enforced by one global bucket with holds;
//! its verdicts are recorded beside each strategy's at the request's end by the suite's
//! [`Recorder`], so overshoot, goodput, false denials and healthy goodput are measured as in
//! the other scenarios.
//!
//! # Layout
//! - [`workload`]: tenants, costs and durations, the partition.
//! - this file: the engine, the rows and their table and CSV.
//!
//! The strategies are [`crate::strategy::llm`].

pub mod workload;

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt::Write as _;
use std::time::Instant;

use quota_core::bucket::{charge, decide, refund, BucketParams, BucketState, UT};
use serde::Serialize;

use crate::faults::Faults;
use crate::metrics::Recorder;
use crate::scenario::{ScenarioError, ScenarioOptions, WINDOW_MS};
use crate::simulation::{rng_for, RunConfig};
use crate::strategy::llm::{self, Hold, LlmRequest, LlmStrategy, LlmStrategyKind};
use crate::strategy::Setup;
use crate::traffic::{Arrivals, Request};
use crate::world::{World, WorldSpec, LOCAL_DECISION_US};
use workload::{Costs, Workload};

/// Seconds over which a tenant's admissions are matched against the ideal's: one policy
/// window. A request's tokens land at its end, up to 30 s after it was admitted, and a debt
/// takes seconds to repay, so the suite's 5 s bins would count when a lump landed as denials.
pub const MATCH_S: u64 = WINDOW_MS / 1000;

/// The CSV header; the table's columns are a subset.
pub const CSV_HEADER: &str = "strategy,overshoot_window,overshoot_1s,overshoot_over_bound,goodput,\
goodput_healthy,false_denial_rate,requests,admitted_tokens,ideal_tokens,uncounted_tokens";

/// One tenant's figures under one strategy: what its overshoot is held to.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TenantFigures {
    /// Most tokens admitted in one window ÷ (C + r·W).
    pub overshoot_window: f64,
    /// C + r·W: the global bucket's bound over one window, in tokens.
    pub window_budget: f64,
    /// The most tokens the tenant's requests in flight (admitted, not ended) held at once:
    /// under `quotad_holds`, their estimates.
    pub in_flight_peak: u64,
    /// The policy's debt limit times the regions.
    pub debt_limits: u64,
    /// Tokens of the tenant's requests that no bucket or counter took.
    pub uncounted: u64,
}

impl TenantFigures {
    /// quotad's bound for this tenant as a ratio to C + r·W (sim/README.md derives it): the
    /// global bucket's bound, plus what was held in flight when a window began, plus the debt
    /// every region's bucket may end it in, plus what no bucket took.
    pub fn bound(&self) -> f64 {
        (self.window_budget
            + self.in_flight_peak as f64
            + self.debt_limits as f64
            + self.uncounted as f64)
            / self.window_budget
    }
}

/// One strategy's row.
#[derive(Debug, Clone, Serialize)]
pub struct LlmRow {
    pub strategy: LlmStrategyKind,
    pub overshoot_window: f64,
    pub overshoot_1s: f64,
    /// `quotad_holds`: the most any tenant's overshoot(W) reaches of its bound
    /// ([`TenantFigures::bound`]); at most 1 when every tenant is within it. The bound is
    /// quotad's; the other strategies have none.
    pub overshoot_over_bound: Option<f64>,
    pub goodput: Option<f64>,
    pub goodput_healthy: Option<f64>,
    pub false_denial_rate: Option<f64>,
    /// Requests that ended within the run.
    pub requests: u64,
    /// Actual tokens of the admitted requests that ended within the run.
    pub admitted_tokens: u64,
    pub ideal_tokens: u64,
    /// Tokens of admitted requests that no bucket or counter took: end charges refused
    /// (`check_then_charge`), clamped at the debt limit (`quotad_holds`).
    pub uncounted_tokens: u64,
    #[serde(skip)]
    pub tenants: Vec<TenantFigures>,
}

/// A whole run.
#[derive(Debug, Clone)]
pub struct LlmRun {
    pub regions: usize,
    pub tenants: usize,
    pub rows: Vec<LlmRow>,
    pub decisions: u64,
    pub wall_s: f64,
}

impl LlmRun {
    /// The row of `kind`.
    pub fn row(&self, kind: LlmStrategyKind) -> &LlmRow {
        self.rows
            .iter()
            .find(|r| r.strategy == kind)
            .expect("every strategy has a row")
    }
}

/// The ideal for costs known at the end: the policy enforced by one global bucket that sees
/// every request where and when it starts, with no WAN. It knows what the clients tell it: it
/// holds the estimate at the start (a check that spends it) and settles to the actual cost at
/// the end, a refund or a charge into the policy's debt limit, as quotad's regions do with
/// their shares. Told each cost at the start instead, an ideal would pick the small requests
/// that fit and admit far more requests than any limiter can, which read as false denials.
#[derive(Debug)]
struct Ideal {
    params: Vec<BucketParams>,
    debt_limits_ut: Vec<u64>,
    states: Vec<Option<BucketState>>,
}

impl Ideal {
    fn new(w: &Workload) -> Self {
        Self {
            params: w
                .tenants
                .iter()
                .map(|t| BucketParams::global(&t.policy))
                .collect(),
            debt_limits_ut: w
                .tenants
                .iter()
                .map(|t| t.policy.debt_limit.saturating_mul(UT))
                .collect(),
            states: vec![None; w.tenants.len()],
        }
    }

    /// Whether `req` starts at `t_ms`: its estimate held.
    fn start(&mut self, t_ms: u64, req: &LlmRequest) -> bool {
        let i = req.tenant as usize;
        let (d, s) = decide(
            t_ms,
            &self.params[i],
            self.states[i].as_ref(),
            u64::from(req.estimate),
        );
        self.states[i] = Some(s);
        d.allowed
    }

    /// Settles a request admitted at its start, ending at `t_ms`.
    fn end(&mut self, t_ms: u64, req: &LlmRequest) {
        let i = req.tenant as usize;
        let (held, actual) = (u64::from(req.estimate), u64::from(req.actual));
        let state = self.states[i].as_ref();
        if actual < held {
            if let Some(s) = refund(t_ms, &self.params[i], state, held - actual) {
                self.states[i] = Some(s);
            }
        } else if actual > held {
            let (_, s) = charge(
                t_ms,
                &self.params[i],
                state,
                actual - held,
                self.debt_limits_ut[i],
            )
            .expect("a cost of 1..=MAX_COST and the policy's debt limit");
            self.states[i] = Some(s);
        }
    }
}

/// A request in flight, waiting for its end.
#[derive(Debug)]
struct InFlight {
    req: LlmRequest,
    shadow_ok: bool,
    /// Per strategy: what it holds, `None` where it refused the request.
    holds: Vec<Option<Hold>>,
}

impl PartialEq for InFlight {
    fn eq(&self, other: &Self) -> bool {
        self.req.id == other.req.id
    }
}
impl Eq for InFlight {}
impl PartialOrd for InFlight {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for InFlight {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.req.end_ms, self.req.id).cmp(&(other.req.end_ms, other.req.id))
    }
}

/// What one pass over the run measured, per strategy.
struct Pass {
    recorders: Vec<Recorder>,
    /// Per strategy, per tenant: tokens held in flight now, and at most.
    in_flight: Vec<Vec<u64>>,
    in_flight_peak: Vec<Vec<u64>>,
    uncounted: Vec<Vec<u64>>,
    requests: u64,
    decisions: u64,
}

/// Runs every `llm_tokens` strategy on the same requests; `progress` is told each simulated
/// second.
pub fn run(cfg: &RunConfig, progress: &mut dyn FnMut(u64)) -> Result<LlmRun, ScenarioError> {
    let started = Instant::now();
    let opts = ScenarioOptions {
        regions: cfg.regions,
        duration_ms: cfg.duration_ms,
        tenants: cfg.tenants,
        floor: cfg.floor,
        fail_mode: cfg.fail_mode,
    };
    let w = Workload::build(&opts, &mut rng_for(cfg.seed, "llm_tokens"))?;
    let healthy: Vec<bool> = (0..cfg.regions).map(|r| w.faults.healthy(r)).collect();
    let mut pass = run_pass(cfg, &w, &w.faults, &healthy, progress);
    let mut decisions = pass.decisions;
    // Healthy goodput: the same requests again without the cut, as the suite measures it.
    let mut calm = run_pass(cfg, &w, &w.faults.without_cuts(), &healthy, &mut |_| {});
    decisions += calm.decisions;
    for (rec, base) in pass.recorders.iter_mut().zip(&mut calm.recorders) {
        rec.finish();
        base.finish();
        rec.against_baseline(base);
    }
    let n = cfg.regions as u64;
    let rows = LlmStrategyKind::ALL
        .iter()
        .enumerate()
        .map(|(k, &kind)| {
            let rec = &pass.recorders[k];
            let s = rec.summary("llm_tokens", kind.name(), &[], cfg.warmup_ms);
            let tenants: Vec<TenantFigures> = w
                .tenants
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let p = &t.policy;
                    TenantFigures {
                        overshoot_window: rec.overshoot_window_by_tenant()[i],
                        window_budget: p.burst as f64
                            + p.limit as f64 * WINDOW_MS as f64 / p.window_ms as f64,
                        in_flight_peak: pass.in_flight_peak[k][i],
                        debt_limits: n * p.debt_limit,
                        uncounted: pass.uncounted[k][i],
                    }
                })
                .collect();
            LlmRow {
                strategy: kind,
                overshoot_window: s.overshoot_window,
                overshoot_1s: s.overshoot_1s,
                overshoot_over_bound: (kind == LlmStrategyKind::QuotadHolds).then(|| {
                    tenants
                        .iter()
                        .map(|t| t.overshoot_window / t.bound())
                        .fold(0.0, f64::max)
                }),
                goodput: s.goodput,
                goodput_healthy: s.goodput_healthy,
                false_denial_rate: s.false_denial_rate,
                requests: pass.requests,
                admitted_tokens: s.admitted_tokens,
                ideal_tokens: s.ideal_tokens,
                uncounted_tokens: pass.uncounted[k].iter().sum(),
                tenants,
            }
        })
        .collect();
    Ok(LlmRun {
        regions: cfg.regions,
        tenants: w.tenants.len(),
        rows,
        decisions,
        wall_s: started.elapsed().as_secs_f64(),
    })
}

/// One pass of every strategy over the run, with `faults`; regions are judged by `healthy`.
fn run_pass(
    cfg: &RunConfig,
    w: &Workload,
    faults: &Faults,
    healthy: &[bool],
    progress: &mut dyn FnMut(u64),
) -> Pass {
    let spec = WorldSpec {
        regions: cfg.regions,
        ..WorldSpec::default()
    };
    let world = World::new(&spec, faults.clone(), &mut rng_for(cfg.seed, "world"));
    let setup = Setup {
        tenants: &w.tenants,
        world: &world,
        control: &cfg.control,
        global_fail_open: cfg.global_fail_open,
    };
    let mut strats: Vec<Box<dyn LlmStrategy>> = LlmStrategyKind::ALL
        .iter()
        .map(|&k| llm::build(k, &setup))
        .collect();
    let per_tenant = || vec![vec![0u64; w.tenants.len()]; strats.len()];
    let mut pass = Pass {
        recorders: strats
            .iter()
            .map(|_| {
                Recorder::new(
                    &w.tenants,
                    WINDOW_MS,
                    cfg.tick_ms,
                    cfg.duration_ms,
                    cfg.warmup_ms,
                    healthy.to_vec(),
                )
                .matching_over(MATCH_S)
            })
            .collect(),
        in_flight: per_tenant(),
        in_flight_peak: per_tenant(),
        uncounted: per_tenant(),
        requests: 0,
        decisions: 0,
    };
    let mut ideal = Ideal::new(w);
    let mut arrivals = Arrivals::new(w.sources.clone(), rng_for(cfg.seed, "llm_tokens arrivals"));
    let mut costs = Costs::new(rng_for(cfg.seed, "llm_tokens costs"));
    let mut pending: BinaryHeap<Reverse<InFlight>> = BinaryHeap::new();
    let mut arrived = Vec::new();
    let mut next_id = 0u64;
    let mut t = 0;
    while t < cfg.duration_ms {
        for s in &mut strats {
            s.advance(&world, t);
        }
        // Ends first: what they give back is there for the tick's starts.
        while pending.peek().is_some_and(|p| p.0.req.end_ms <= t) {
            let Reverse(f) = pending.pop().expect("peeked");
            if f.shadow_ok {
                ideal.end(t, &f.req);
            }
            pass.end(&mut strats, &world, t, &f);
        }
        arrivals.tick(t, cfg.tick_ms, &mut arrived);
        for r in &arrived {
            let (actual, duration_ms) = costs.draw(w.estimates[r.tenant as usize], cfg.tick_ms);
            let req = LlmRequest {
                id: next_id,
                tenant: r.tenant,
                region: r.region,
                estimate: w.estimates[r.tenant as usize],
                actual,
                start_ms: t,
                end_ms: t + duration_ms,
            };
            next_id += 1;
            let shadow_ok = ideal.start(t, &req);
            let holds = pass.start(&mut strats, &world, t, &req);
            pending.push(Reverse(InFlight {
                req,
                shadow_ok,
                holds,
            }));
        }
        t += cfg.tick_ms;
        if t % 1000 < cfg.tick_ms {
            progress(1);
        }
    }
    pass
}

impl Pass {
    /// Starts `req` in every strategy; what each holds.
    fn start(
        &mut self,
        strats: &mut [Box<dyn LlmStrategy>],
        world: &World,
        t_ms: u64,
        req: &LlmRequest,
    ) -> Vec<Option<Hold>> {
        let i = req.tenant as usize;
        self.decisions += strats.len() as u64 + 1;
        strats
            .iter_mut()
            .enumerate()
            .map(|(k, s)| {
                let hold = s.start(world, t_ms, req);
                if let Some(h) = hold {
                    self.in_flight[k][i] += h.tokens;
                    self.in_flight_peak[k][i] = self.in_flight_peak[k][i].max(self.in_flight[k][i]);
                }
                hold
            })
            .collect()
    }

    /// Ends `f` at `t_ms` in every strategy that admitted it, and records every verdict with
    /// the request's actual cost.
    fn end(&mut self, strats: &mut [Box<dyn LlmStrategy>], world: &World, t_ms: u64, f: &InFlight) {
        let req = &f.req;
        let i = req.tenant as usize;
        let check: Request = req.check(req.actual);
        self.requests += 1;
        for (k, s) in strats.iter_mut().enumerate() {
            if let Some(h) = f.holds[k] {
                self.decisions += 1;
                self.uncounted[k][i] += s.end(world, t_ms, req, h);
                self.in_flight[k][i] -= h.tokens;
            }
            self.recorders[k].record(
                t_ms,
                &check,
                f.shadow_ok,
                f.holds[k].is_some(),
                LOCAL_DECISION_US,
            );
        }
    }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_string(), |x| format!("{x:.digits$}"))
}

/// The fixed-width table.
pub fn table(run: &LlmRun) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "llm_tokens: {} tenants, {} regions",
        run.tenants, run.regions
    );
    let _ = writeln!(
        out,
        "{:<23} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9}",
        "strategy",
        "over(W)",
        "over(1s)",
        "vs_bound",
        "goodput",
        "good_ok",
        "false_dn",
        "uncounted"
    );
    for r in &run.rows {
        let uncounted = (r.admitted_tokens > 0)
            .then(|| 100.0 * r.uncounted_tokens as f64 / r.admitted_tokens as f64);
        let _ = writeln!(
            out,
            "{:<23} {:>8.3} {:>8.3} {:>8} {:>8} {:>8} {:>8} {:>9}",
            r.strategy.name(),
            r.overshoot_window,
            r.overshoot_1s,
            opt(r.overshoot_over_bound, 3),
            opt(r.goodput, 3),
            opt(r.goodput_healthy, 3),
            opt(r.false_denial_rate.map(|x| 100.0 * x), 2) + "%",
            opt(uncounted, 2) + "%",
        );
    }
    out
}

/// CSV with [`CSV_HEADER`]; an empty cell means "not defined".
pub fn csv(run: &LlmRun) -> String {
    let o = |v: Option<f64>| v.map_or_else(String::new, |x| format!("{x:.6}"));
    let mut out = String::from(CSV_HEADER);
    out.push('\n');
    for r in &run.rows {
        let _ = writeln!(
            out,
            "{},{:.6},{:.6},{},{},{},{},{},{},{},{}",
            r.strategy.name(),
            r.overshoot_window,
            r.overshoot_1s,
            o(r.overshoot_over_bound),
            o(r.goodput),
            o(r.goodput_healthy),
            o(r.false_denial_rate),
            r.requests,
            r.admitted_tokens,
            r.ideal_tokens,
            r.uncounted_tokens
        );
    }
    out
}
