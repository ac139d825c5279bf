//! `agent_move` and `agent_crash`: region 1's agent holder stops every 10 s for the fault span,
//! on SIGTERM (it releases the role and the standby claims at its next look) or killed (the
//! standby claims after three report intervals). A released holder's record holds region 1's
//! acknowledgement at its last pass until the new holder's `AgentPassed`, sent after its first
//! pass, commits; a killed holder's, deposed by the claim, until its lease and margin run out,
//! since the dead daemon may only be paused and still decide on its old view. quotad keeps its
//! overshoot bound either way; a graceful move costs the other regions next to nothing (healthy
//! goodput, regions 0 and 2 against the same strategy on the same arrivals without the stops,
//! ≥ 0.99), a crash more: region 1's share reaches region 2 only as its acknowledgement catches
//! up.

use clap::Parser;
use sim::control::AgentCounts;
use sim::metrics::Summary;
use sim::options::Options;
use sim::scenario::{ScenarioKind, AGENT_REGION, AGENT_STOP_PERIOD_MS};
use sim::simulation::run_scenario;
use sim::strategy::StrategyKind;

const DURATION_S: u64 = 240;
const REPORT_MS: u64 = 1_000;

fn options(kind: ScenarioKind) -> Options {
    let duration = DURATION_S.to_string();
    let args = [
        "sim",
        "--seed",
        "1",
        "--duration",
        &duration,
        "--warmup",
        "60",
        "--tenants",
        "12",
        "--scenario",
        kind.name(),
    ];
    Options::try_parse_from(args).expect("valid options")
}

/// quotad's summary of `kind`, with its overshoot bound checked.
fn run(kind: ScenarioKind) -> Summary {
    let opts = options(kind);
    let cfg = opts.run_config().unwrap();
    let run = run_scenario(kind, &[StrategyKind::Quotad], &cfg, &mut |_| {}).unwrap();
    let s = run.strategies.into_iter().next().unwrap().summary;
    let repro = opts.repro(kind, StrategyKind::Quotad);
    eprintln!(
        "{kind}: over(W) {:.3}, over(1s) {:.3}, good_ok {:?}, goodput {:?}, floor_s {:?}, {:?}",
        s.overshoot_window, s.overshoot_1s, s.goodput_healthy, s.goodput, s.floor_s, s.agents
    );
    assert!(
        s.overshoot_window <= 1.02 && s.overshoot_1s <= 1.02,
        "{kind}: overshoot {:.3} / {:.3}; reproduce: {repro}",
        s.overshoot_window,
        s.overshoot_1s
    );
    // Redis held the stopped holder's lease end until the next holder wrote its own.
    assert!(
        s.floor_s.iter().all(|&f| f == 0.0),
        "{kind}: {:?}",
        s.floor_s
    );
    s
}

/// The stops were injected: one every period of the fault span (30% of the run, at most
/// 90 s), in region 1 only, each followed by one takeover.
fn stops(kind: ScenarioKind, agents: &AgentCounts) -> u64 {
    let span_ms = (DURATION_S * 1000 * 3 / 10).min(90_000);
    let stops = span_ms.div_ceil(AGENT_STOP_PERIOD_MS);
    let mut want = vec![0; 3];
    want[AGENT_REGION] = stops;
    assert_eq!(agents.stops, want, "{kind}");
    assert_eq!(
        agents.takeovers_ms[AGENT_REGION].len() as u64,
        stops,
        "{kind}"
    );
    stops
}

/// Usage reports region 1 sent fewer than the fewest of the others.
fn reports_missed(agents: &AgentCounts) -> u64 {
    let r = &agents.usage_reports;
    r[0].min(r[2]).saturating_sub(r[AGENT_REGION])
}

#[test]
fn a_graceful_move_keeps_the_bound_and_costs_the_other_regions_nothing() {
    let kind = ScenarioKind::AgentMove;
    let s = run(kind);
    let good = s
        .goodput_healthy
        .expect("healthy regions admitted something");
    assert!(good >= 0.99, "healthy goodput {good:.4}");
    let agents = s.agents.expect("quotad runs region agents");
    let stops = stops(kind, &agents);
    // The standby claims at its next look, a report interval after the stop (the stops fall
    // on report ticks), and holds the role one commit later.
    let taken = &agents.takeovers_ms[AGENT_REGION];
    assert!(
        taken
            .iter()
            .all(|t| (REPORT_MS..REPORT_MS + 500).contains(t)),
        "{taken:?}"
    );
    assert!(
        reports_missed(&agents) <= stops,
        "{:?}",
        agents.usage_reports
    );
}

/// A crash costs more than a graceful move: the standby waits three report intervals before
/// it claims, and the dead daemon's record (it may only be paused) holds region 1's
/// acknowledgement until its lease and margin run out, about 10 s after each kill, so with a
/// kill every 10 s region 1's decreases stay unacknowledged for most of the fault and region 2
/// is raised late. Healthy goodput measured at seeds 1–8 (this run's options): 0.913–0.982,
/// against 0.999–1.000 for the graceful move; the floor leaves 0.01 below the lowest.
#[test]
fn a_crash_keeps_the_bound_and_costs_the_dead_holders_lease() {
    let kind = ScenarioKind::AgentCrash;
    let s = run(kind);
    let good = s
        .goodput_healthy
        .expect("healthy regions admitted something");
    assert!(good >= 0.90, "healthy goodput {good:.4}");
    let agents = s.agents.expect("quotad runs region agents");
    let stops = stops(kind, &agents);
    let taken = &agents.takeovers_ms[AGENT_REGION];
    assert!(
        taken
            .iter()
            .all(|t| (3 * REPORT_MS..3 * REPORT_MS + 500).contains(t)),
        "{taken:?}"
    );
    assert!(
        reports_missed(&agents) >= 3 * stops,
        "{:?}",
        agents.usage_reports
    );
    let graceful = run(ScenarioKind::AgentMove).goodput_healthy.unwrap();
    assert!(
        good < graceful - 0.01,
        "a crash ({good:.4}) costs little more than a graceful move ({graceful:.4})"
    );
}
