//! A region reconnected gets a lease back: searched over every cut, reconnection, clock
//! step and share change within the bounds, with the daemons renewing every tick and the
//! network delivering promptly once connected.

use std::io::Write as _;

use quota_model::properties::{LAPSED_AND_BACK, LEASE_BACK};
use quota_model::{scenario, search, shrink, trace, LeaseModel};

#[test]
fn a_region_reconnected_for_a_tick_holds_a_lease_again() {
    let m = LeaseModel::liveness(scenario::LIVENESS.bounds);
    let outcome = search(&m, None);
    let _ = writeln!(
        std::io::stderr(),
        "{}",
        outcome.report(&m, scenario::LIVENESS.name)
    );
    if let Some(&broken) = outcome.failures(&m).first() {
        let actions = shrink(&m, broken, &outcome.discoveries[broken]);
        panic!("{broken} broken:\n{}", trace::narrate_actions(&m, &actions));
    }
    assert!(
        outcome.discoveries.contains_key(LAPSED_AND_BACK),
        "no run lets A's leases run out in a cut and reconnects it: {LEASE_BACK} is vacuous"
    );
}
