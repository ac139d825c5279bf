//! Reservations (`quotad_reserved`) against quotad in every scenario of the default suite, on
//! short runs at a fixed seed (debug builds stay quick): overshoot at most 1.02 over W and over
//! 1 s, goodput within half a percentage point of quotad's, and no more store calls per
//! decision. A failure prints the command that reproduces it. Debug builds leave out
//! `one_shot`: its 2 000 identities make it most of the test's time there, and their 10-token
//! budgets never batch (1 % of a share's capacity is less than 2 tokens) while the rest of its
//! traffic is `steady`'s; `cargo test --release` includes it, and so does the suite in
//! sim/README.md.

use clap::Parser;
use sim::options::Options;
use sim::scenario::ScenarioKind;
use sim::strategy::StrategyKind;

const BOUND: f64 = 1.02;
/// Goodput may differ from quotad's by at most this (half a percentage point).
const GOODPUT_GAP: f64 = 0.005;
const SEEDS: [u64; 1] = [1];
const STRATEGIES: [StrategyKind; 2] = [StrategyKind::Quotad, StrategyKind::QuotadReserved];

fn options(seed: u64) -> Options {
    Options::try_parse_from([
        "sim",
        "--seed",
        &seed.to_string(),
        "--duration",
        "120",
        "--warmup",
        "60",
        "--tenants",
        "8",
    ])
    .expect("valid options")
}

#[test]
fn reservations_keep_the_bound_and_goodput_at_fewer_store_calls() {
    let mut failures = Vec::new();
    for seed in SEEDS {
        let opts = options(seed);
        let cfg = opts.run_config().unwrap();
        let scenarios: Vec<ScenarioKind> = opts
            .scenarios()
            .into_iter()
            .filter(|&k| !(cfg!(debug_assertions) && k == ScenarioKind::OneShot))
            .collect();
        let jobs = std::thread::available_parallelism().map_or(1, |n| n.get());
        for run in sim::run_suite(&scenarios, &STRATEGIES, &cfg, jobs, &|_| {}).unwrap() {
            let kind = run.scenario;
            let (plain, reserved) = (&run.strategies[0].summary, &run.strategies[1].summary);
            let repro = opts.repro(kind, StrategyKind::QuotadReserved);
            if reserved.overshoot_window > BOUND || reserved.overshoot_1s > BOUND {
                failures.push(format!(
                    "{kind}, seed {seed}: overshoot(W) {:.4}, overshoot(1s) {:.4} > {BOUND}\n  \
                     reproduce: {repro}",
                    reserved.overshoot_window, reserved.overshoot_1s
                ));
            }
            let (g0, g1) = (plain.goodput.unwrap(), reserved.goodput.unwrap());
            if (g1 - g0).abs() > GOODPUT_GAP {
                failures.push(format!(
                    "{kind}, seed {seed}: goodput {g1:.4} against quotad's {g0:.4}\n  \
                     reproduce: {repro}"
                ));
            }
            let (c0, c1) = (
                plain.store_calls_per_decision().unwrap(),
                reserved.store_calls_per_decision().unwrap(),
            );
            // The batches are real: where demand is spread evenly (`steady`) and where one
            // tenant sends far over its limit (`hot_tenant`), markedly fewer calls than
            // quotad's one a decision.
            let most = match kind {
                ScenarioKind::Steady => 0.9,
                ScenarioKind::HotTenant => 0.95,
                _ => c0,
            };
            eprintln!("{kind}: store calls per decision {c0:.3} -> {c1:.3}");
            if c1 > most {
                failures.push(format!(
                    "{kind}, seed {seed}: {c1:.3} store calls per decision, quotad {c0:.3}, \
                     at most {most:.3}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
