//! Budgets too small or too slow to split, and clusters of 5 and 9 regions, on short runs with
//! a fixed seed (debug builds stay quick): quotad keeps its overshoot bound, answers no check
//! "never" in `small_budget` and `slow_budget`, and its false denials stay at most 1% there.
//! At 5 and 9 regions the scenarios that move demand keep the bound and goodput. A failure
//! prints the command that reproduces it.

use clap::Parser;
use sim::options::Options;
use sim::scenario::ScenarioKind;
use sim::simulation::run_scenario;
use sim::strategy::StrategyKind;

const BOUND: f64 = 1.02;

fn options(regions: usize, duration_s: u64, warmup_s: u64, tenants: usize) -> Options {
    let (regions, duration, warmup, tenants) = (
        regions.to_string(),
        duration_s.to_string(),
        warmup_s.to_string(),
        tenants.to_string(),
    );
    Options::try_parse_from([
        "sim",
        "--seed",
        "1",
        "--regions",
        &regions,
        "--duration",
        &duration,
        "--warmup",
        &warmup,
        "--tenants",
        &tenants,
    ])
    .expect("valid options")
}

#[test]
fn small_and_slow_budgets_are_enforced_whole() {
    let mut failures = Vec::new();
    for regions in [3, 5] {
        let opts = options(regions, 120, 10, 4);
        let cfg = opts.run_config().unwrap();
        for kind in [ScenarioKind::SmallBudget, ScenarioKind::SlowBudget] {
            let run = run_scenario(kind, &[StrategyKind::Quotad], &cfg, &mut |_| {}).unwrap();
            let s = &run.strategies[0].summary;
            let fd = s.false_denial_rate.unwrap_or(0.0);
            if s.overshoot_window > BOUND || s.overshoot_1s > BOUND || s.never > 0 || fd > 0.01 {
                failures.push(format!(
                    "{kind} at {regions} regions: overshoot(W) {:.4}, overshoot(1s) {:.4}, \
                     {} never, false denials {:.2}%\n  reproduce: {}",
                    s.overshoot_window,
                    s.overshoot_1s,
                    s.never,
                    100.0 * fd,
                    opts.repro(kind, StrategyKind::Quotad)
                ));
            }
            // Most checks of a budget that lives in one region are decided there.
            assert!(
                s.forwarded.unwrap_or(0.0) > 0.2,
                "{kind}: {:?}",
                s.forwarded
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn five_and_nine_regions_keep_the_bound_and_the_goodput() {
    let mut failures = Vec::new();
    // After the warm-up of one window: every bucket starts full, which no split matches.
    for (regions, kinds) in [
        (5, [ScenarioKind::OneShot, ScenarioKind::Skewed]),
        (9, [ScenarioKind::Skewed, ScenarioKind::ClockDrift]),
    ] {
        let opts = options(regions, 130, 60, 6);
        let cfg = opts.run_config().unwrap();
        for kind in kinds {
            let run = run_scenario(kind, &[StrategyKind::Quotad], &cfg, &mut |_| {}).unwrap();
            let s = &run.strategies[0].summary;
            let fd = s.false_denial_converged.unwrap_or(0.0);
            let goodput = s.goodput.unwrap_or(1.0);
            if s.overshoot_window > BOUND || fd > 0.01 || goodput < 0.97 {
                failures.push(format!(
                    "{kind} at {regions} regions: overshoot(W) {:.4}, converged false denials \
                     {:.2}%, goodput {goodput:.3}\n  reproduce: {}",
                    s.overshoot_window,
                    100.0 * fd,
                    opts.repro(kind, StrategyKind::Quotad)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// At 9 regions a region cut off past its lease (a follower, the leader's, one that heals)
/// costs the others nothing and answers no check "never": with no floor, what it cannot hold
/// and cannot send to the region granted the most is reduced capacity (a 503 to retry). Its
/// own callers' denials are the price of the bound, as in `partition`.
#[test]
fn nine_regions_cut_off_one_without_never_answers() {
    let mut failures = Vec::new();
    let opts = options(9, 200, 60, 6);
    let cfg = opts.run_config().unwrap();
    for kind in [
        ScenarioKind::Partition,
        ScenarioKind::LeaderPartition,
        ScenarioKind::Heal,
    ] {
        let run = run_scenario(kind, &[StrategyKind::Quotad], &cfg, &mut |_| {}).unwrap();
        let s = &run.strategies[0].summary;
        let healthy = s.goodput_healthy.unwrap_or(0.0);
        if s.overshoot_window > BOUND || s.never > 0 || healthy < 0.99 {
            failures.push(format!(
                "{kind} at 9 regions: overshoot(W) {:.4}, {} never, healthy goodput \
                 {healthy:.3}\n  reproduce: {}",
                s.overshoot_window,
                s.never,
                opts.repro(kind, StrategyKind::Quotad)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
