//! `agent_move`: region 1's agent role moves to another of its daemons every 10 s, each move
//! leaving the region without usage reports and parameter writes for the takeover while its
//! lease is still renewed. quotad keeps its overshoot bound and costs the other regions
//! nothing: healthy goodput (regions 0 and 2, each matched against the same strategy on the same
//! arrivals without the moves) stays ≥ 0.99.

use clap::Parser;
use sim::metrics::Summary;
use sim::options::Options;
use sim::scenario::{ScenarioKind, AGENT_MOVE_PERIOD_MS, AGENT_MOVE_REGION};
use sim::simulation::{default_takeover_ms, run_scenario};
use sim::strategy::StrategyKind;

const DURATION_S: u64 = 240;

fn options(extra: &[&str]) -> Options {
    let duration = DURATION_S.to_string();
    let mut args = vec![
        "sim",
        "--seed",
        "1",
        "--duration",
        &duration,
        "--warmup",
        "60",
        "--tenants",
        "12",
    ];
    args.extend_from_slice(extra);
    Options::try_parse_from(args).expect("valid options")
}

fn run(opts: &Options) -> Summary {
    let cfg = opts.run_config().unwrap();
    let run = run_scenario(
        ScenarioKind::AgentMove,
        &[StrategyKind::Quotad],
        &cfg,
        &mut |_| {},
    )
    .unwrap();
    run.strategies.into_iter().next().unwrap().summary
}

#[test]
fn quotad_keeps_its_bound_and_its_healthy_regions_through_agent_moves() {
    let opts = options(&[]);
    let cfg = opts.run_config().unwrap();
    let takeover_ms = default_takeover_ms(&cfg);
    // Three report intervals to notice, one commit round trip (100–300 ms) to claim.
    assert!((3_100..=3_300).contains(&takeover_ms), "{takeover_ms} ms");
    let s = run(&opts);
    let repro = opts.repro(ScenarioKind::AgentMove, StrategyKind::Quotad);
    eprintln!(
        "agent_move: over(W) {:.3}, over(1s) {:.3}, good_ok {:?}, goodput {:?}, floor_s {:?}, \
         {:?}",
        s.overshoot_window, s.overshoot_1s, s.goodput_healthy, s.goodput, s.floor_s, s.agents
    );
    assert!(
        s.overshoot_window <= 1.02 && s.overshoot_1s <= 1.02,
        "overshoot {:.3} / {:.3}; reproduce: {repro}",
        s.overshoot_window,
        s.overshoot_1s
    );
    let good = s
        .goodput_healthy
        .expect("healthy regions admitted something");
    assert!(
        good >= 0.99,
        "healthy goodput {good:.4}; reproduce: {repro}"
    );

    // The fault was injected: the role moved every 10 s over the fault span (30% of the run,
    // at most 90 s), in region 1 only, and each takeover cost region 1 at least three reports.
    let agents = s.agents.expect("quotad runs region agents");
    let span_ms = (DURATION_S * 1000 * 3 / 10).min(90_000);
    let moves = span_ms.div_ceil(AGENT_MOVE_PERIOD_MS);
    let mut want = vec![0; 3];
    want[AGENT_MOVE_REGION] = moves;
    assert_eq!(agents.moves, want);
    let reports = &agents.usage_reports;
    let (r0, r1, r2) = (reports[0], reports[1], reports[2]);
    assert!(
        r1 + 3 * moves <= r0.min(r2),
        "region 1 sent {r1} reports against {r0} and {r2}"
    );
    // Renewals went on: no region's lease lapsed.
    assert!(s.floor_s.iter().all(|&f| f == 0.0), "{:?}", s.floor_s);
}

/// What Redis holds stays as the last holder wrote it, lease end included: a takeover longer
/// than that lease end puts region 1 on its floors, though its lease is renewed throughout.
#[test]
fn a_takeover_past_the_stored_lease_end_puts_the_region_on_its_floors() {
    let s = run(&options(&["--agent-takeover", "9.5"]));
    eprintln!("agent_move, 9.5 s takeovers: floor_s {:?}", s.floor_s);
    assert!(s.floor_s[AGENT_MOVE_REGION] > 0.0, "{:?}", s.floor_s);
    assert_eq!(s.floor_s[0] + s.floor_s[2], 0.0, "{:?}", s.floor_s);
}
