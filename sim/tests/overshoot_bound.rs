//! quotad's overshoot bound, over a fixed set of seeds and the scenarios that stress it
//! (skew, shifting demand, bursts, partitions of a follower and of the leader, a flapping
//! link, a long partition that heals, a leader crash, an agent holder stopped and killed,
//! clock drift). Short runs, so the test stays fast in debug builds. A failure prints the command
//! that reproduces it.

use clap::Parser;
use sim::options::Options;
use sim::scenario::ScenarioKind;
use sim::simulation::run_scenario;
use sim::strategy::StrategyKind;

/// quotad's promise: at most 2% over the ideal in any window.
const BOUND: f64 = 1.02;
const SEEDS: [u64; 4] = [1, 2, 3, 4];
const SCENARIOS: [ScenarioKind; 11] = [
    ScenarioKind::Skewed,
    ScenarioKind::FollowTheSun,
    ScenarioKind::MinuteBursts,
    ScenarioKind::Partition,
    ScenarioKind::LeaderPartition,
    ScenarioKind::Flapping,
    ScenarioKind::Heal,
    ScenarioKind::LeaderCrash,
    ScenarioKind::AgentMove,
    ScenarioKind::AgentCrash,
    ScenarioKind::ClockDrift,
];

fn options(seed: u64, duration_s: u64) -> Options {
    let (seed, duration) = (seed.to_string(), duration_s.to_string());
    Options::try_parse_from([
        "sim",
        "--seed",
        &seed,
        "--duration",
        &duration,
        "--warmup",
        "10",
        "--tenants",
        "8",
    ])
    .expect("valid options")
}

#[test]
fn quotad_stays_within_its_overshoot_bound() {
    let strategies = [StrategyKind::Quotad, StrategyKind::QuotadPinned];
    let mut failures = Vec::new();
    for seed in SEEDS {
        let opts = options(seed, 150);
        let cfg = opts.run_config().unwrap();
        for kind in SCENARIOS {
            let run = run_scenario(kind, &strategies, &cfg, &mut |_| {}).unwrap();
            for (s, &strategy) in run.strategies.iter().zip(&strategies) {
                let sum = &s.summary;
                if sum.overshoot_window > BOUND || sum.overshoot_1s > BOUND {
                    failures.push(format!(
                        "{strategy} in {kind}, seed {seed}: overshoot(W) {:.4}, overshoot(1s) \
                         {:.4} > {BOUND}\n  reproduce: {}",
                        sum.overshoot_window,
                        sum.overshoot_1s,
                        opts.repro(kind, strategy)
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The check can fail: without leases the same allocator overshoots under a partition (long
/// enough for the majority's buckets to refill at their enlarged shares before the surge).
#[test]
fn without_leases_a_partition_overshoots() {
    let opts = options(1, 300);
    let cfg = opts.run_config().unwrap();
    let strategies = [StrategyKind::RebalanceNoLease, StrategyKind::Quotad];
    let run = run_scenario(ScenarioKind::Partition, &strategies, &cfg, &mut |_| {}).unwrap();
    let no_lease = &run.strategies[0].summary;
    let quotad = &run.strategies[1].summary;
    assert!(
        no_lease.overshoot_window > 1.05,
        "rebalance_no_lease stayed at {:.3}; reproduce: {}",
        no_lease.overshoot_window,
        opts.repro(ScenarioKind::Partition, StrategyKind::RebalanceNoLease)
    );
    assert!(quotad.overshoot_window <= BOUND);
}
