//! Each guard switched off in turn: the checker must find a run in which the regions
//! together enforce more than the budget, printed as a trace. (With the guard on, the same
//! scenario holds: tests/safety.rs.)

use std::io::Write as _;

use quota_model::properties::{BUDGET, DEPOSED};
use quota_model::scenario::{self, Scenario};
use quota_model::{search, shrink, trace, Guard, LeaseModel};

/// Searches the mutant's scenario until `property` breaks; returns the shortened trace.
fn counterexample(guard: Guard, property: &'static str) -> String {
    counterexample_in(scenario::for_mutant(guard), guard, property)
}

fn counterexample_in(scenario: Scenario, guard: Guard, property: &'static str) -> String {
    let m = LeaseModel::new(scenario.bounds, Some(guard));
    let outcome = search(&m, Some(property));
    let path = outcome.discoveries.get(property).unwrap_or_else(|| {
        panic!(
            "with {guard:?} off, \"{property}\" held in all {} states of {}",
            outcome.unique_states, scenario.name
        )
    });
    let actions = shrink(&m, property, path);
    let told = trace::narrate_actions(&m, &actions);
    let _ = writeln!(
        std::io::stderr(),
        "{guard:?} off, {}: \"{property}\" broken after {} events ({} states explored in \
         {:.2} s; bounds: {})\n{told}",
        scenario.name,
        actions.len(),
        outcome.unique_states,
        outcome.elapsed.as_secs_f64(),
        m.bounds
    );
    told
}

/// The last line of a trace: what the regions enforce at the end.
fn last_line(trace: &str) -> &str {
    trace.lines().last().unwrap_or_default().trim()
}

#[test]
fn without_revoke_before_grant_a_cut_region_still_enforces_what_another_was_given() {
    let t = counterexample(Guard::RevokeBeforeGrant, BUDGET);
    assert!(t.contains("leader raises B"), "{t}");
}

#[test]
fn without_the_drift_margin_a_leader_ahead_reuses_a_share_still_enforced() {
    let t = counterexample(Guard::DriftMargin, BUDGET);
    assert!(
        t.contains("fast") || t.contains("slow"),
        "a clock step: {t}"
    );
}

#[test]
fn without_the_fence_check_an_older_write_lands_over_a_newer_one() {
    let t = counterexample(Guard::FenceCheck, BUDGET);
    assert!(t.contains("Redis A takes"), "{t}");
}

#[test]
fn without_the_fence_check_a_deposed_agent_raises_a_share() {
    let m = quota_model::scenario::INSTANT;
    assert_eq!(m.bounds.claims, 1, "the agent role moves in this scenario");
    let t = counterexample_in(m, Guard::FenceCheck, DEPOSED);
    assert!(t.contains("claims A's agent role"), "{t}");
}

#[test]
fn acknowledging_an_epoch_not_yet_written_frees_a_share_redis_still_holds() {
    let t = counterexample(Guard::AckApplied, BUDGET);
    assert!(last_line(&t).ends_with("= 11"), "{t}");
}

#[test]
fn without_the_least_live_acknowledgement_a_lagging_daemon_is_overlooked() {
    let t = counterexample(Guard::LeastLiveAck, BUDGET);
    assert!(t.contains("a2 renews") || t.contains("a1 renews"), "{t}");
}

#[test]
fn acknowledging_before_wait_lets_a_failover_restore_the_cut_share() {
    let t = counterexample(Guard::WaitBeforeAck, BUDGET);
    assert!(t.contains("fails over"), "{t}");
}

#[test]
fn without_not_after_a_late_write_stores_an_end_past_the_lease() {
    let t = counterexample(Guard::NotAfter, BUDGET);
    assert!(t.contains("Redis A takes a1's write"), "{t}");
}

#[test]
fn a_lease_used_before_its_epoch_is_applied_outlives_the_revocation() {
    let t = counterexample(Guard::LeaseAfterApply, BUDGET);
    assert!(t.contains("hears its lease"), "{t}");
}

#[test]
fn a_claim_that_leaves_the_replaced_agents_record_live_frees_a_share_its_write_still_holds() {
    let t = counterexample(Guard::ClaimMarksLeft, BUDGET);
    assert!(t.contains("a2 claims A's agent role"), "{t}");
    assert!(last_line(&t).ends_with("= 11"), "{t}");
}

#[test]
fn agent_passed_before_the_first_pass_frees_a_share_the_stopped_agents_write_still_holds() {
    let t = counterexample(Guard::PassedAfterFirstPass, BUDGET);
    assert!(t.contains("a1 stops"), "{t}");
    assert!(t.contains("commits AgentPassed at once"), "{t}");
}

#[test]
fn acknowledging_one_margin_past_the_stored_end_misses_a_redis_clock_running_slow() {
    let t = counterexample(Guard::WriteRunOut, BUDGET);
    assert!(t.contains("Redis A's clock does not advance"), "{t}");
}

/// quotad as it is: with its writes not all answered, the agent counts a write the primary
/// answered as the store's before `WAIT` confirmed it.
#[test]
fn bounding_the_store_by_a_write_no_replica_has_lets_a_failover_restore_the_cut() {
    let t = counterexample(Guard::BoundedAfterWait, BUDGET);
    assert!(t.contains("WAIT 1 finds the replica without it"), "{t}");
    assert!(t.contains("fails over"), "{t}");
}

/// quotad as it is: a deposed agent's renewal leaves its record as it was but answers with a
/// whole lease, which the agent uses on its old view after the record has run out.
#[test]
fn a_lease_granted_to_a_deposed_agent_outlives_its_record() {
    let t = counterexample(Guard::RecordCoversLease, BUDGET);
    assert!(t.contains("its record is deposed"), "{t}");
    assert!(t.contains("a1 hears its lease"), "{t}");
}
