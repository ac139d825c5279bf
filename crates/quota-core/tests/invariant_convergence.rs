//! Invariant: under stationary demand, rounds of plan → apply → acknowledge converge to the
//! max-min fair split (within the change threshold) in a bounded number of rounds, and then
//! stop emitting changes.
//!
//! Cases: `QUOTA_PROPTEST_CASES` (default 256).

mod common;

use common::{key, policy, Driver};
use proptest::prelude::*;
use quota_core::allocator::{plan, target_split, AllocatorConfig};
use quota_core::coordinator::{Operation, PinSource, RequestId};
use quota_core::demand::{DemandTracker, Usage};
use quota_core::policy::Tier;
use quota_core::PPM;

fn cases() -> u32 {
    std::env::var("QUOTA_PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256)
}

/// Budget of the test policy: 1000 tokens/s = 10^9 µt/s.
const RATE_UT_PER_S: u64 = 1_000_000_000;

/// One round: plan with the given demand, commit, every region renews and acknowledges.
/// Returns how many share entries the round emitted.
fn round(d: &mut Driver, demand: &DemandTracker, config: &AllocatorConfig) -> usize {
    d.now_ms += 1_000;
    let p = plan(&d.state, demand, config, d.now_ms);
    let emitted = p.entries.len();
    let mut id = d.next_id;
    for cmd in p.into_commands(d.now_ms, config.max_entries_per_command, || {
        id += 1;
        RequestId(id)
    }) {
        d.state.apply(&cmd);
        d.state.check_invariant().unwrap();
    }
    d.next_id = id;
    d.renew_all();
    emitted
}

/// Rounds enough for any move: one revoke and one grant round per step, plus slack.
fn round_bound(config: &AllocatorConfig) -> usize {
    2 * (PPM / config.max_step_ppm) as usize + 6
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn converges_to_the_max_min_fair_split(
        n in 2usize..=5,
        floor_ppm in prop_oneof![Just(0u32), 0u32..=100_000],
        demand_ppm in prop::collection::vec(0u64..=1_500_000, 5),
        max_step_ppm in 50_000u32..=PPM,
        change_threshold_ppm in 1_000u32..=20_000,
    ) {
        let config = AllocatorConfig { max_step_ppm, change_threshold_ppm, ..AllocatorConfig::default() };
        let mut d = Driver::with_regions(n);
        d.op(Operation::PutPolicy { key: key("a"), policy: policy(floor_ppm, Tier::Standard) });
        d.renew_all();
        let mut demand = DemandTracker::new(config.ewma_alpha_ppm);
        let rates: Vec<u64> = demand_ppm[..n].iter().map(|p| p * RATE_UT_PER_S / u64::from(PPM)).collect();
        demand.set(key("a"), rates);
        for _ in 0..round_bound(&config) {
            round(&mut d, &demand, &config);
        }
        let target = target_split(&vec![floor_ppm; n], &demand_ppm[..n], &vec![true; n]);
        let shares = &d.state.entries[&key("a")].shares_ppm;
        let off: u64 = shares.iter().zip(&target).map(|(s, t)| u64::from(s.abs_diff(*t))).sum();
        prop_assert!(
            off <= u64::from(change_threshold_ppm),
            "shares {:?} vs target {:?}: {} ppm off", shares, target, off
        );
        // Converged means quiet: no more log entries.
        prop_assert_eq!(round(&mut d, &demand, &config), 0);
    }
}

#[test]
fn demand_learned_from_reports_moves_share_to_where_it_is_used() {
    let config = AllocatorConfig::default();
    let mut d = Driver::with_regions(3);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(50_000, Tier::Standard),
    });
    d.renew_all();
    let mut demand = DemandTracker::new(config.ewma_alpha_ppm);
    // Region 2 sees 900 tokens/s (half of it denied), the others 20.
    for _ in 0..40 {
        for (r, admitted, denied) in [(0u8, 20, 0), (1, 20, 0), (2, 450, 450)] {
            demand.record(r, 1_000, &[(key("a"), Usage { admitted, denied })]);
        }
        round(&mut d, &demand, &config);
    }
    let shares = &d.state.entries[&key("a")].shares_ppm;
    // Demand 20k + 20k + 900k ppm of the budget: the two small ones sit at their 50k floors,
    // region 2 gets its 900k.
    let target = [50_000u32, 50_000, 900_000].map(|t| t as i64);
    for (s, t) in shares.iter().zip(target) {
        assert!((i64::from(*s) - t).abs() <= 10_000, "{shares:?}");
    }
    // And it is no longer churning.
    assert_eq!(round(&mut d, &demand, &config), 0);
}

#[test]
fn critical_tenants_are_pinned_home_with_hysteresis() {
    let config = AllocatorConfig::default();
    let mut d = Driver::with_regions(3);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(10_000, Tier::Critical),
    });
    d.renew_all();
    let mut demand = DemandTracker::new(config.ewma_alpha_ppm);
    let set = |demand: &mut DemandTracker, tokens_per_s: [u64; 3]| {
        demand.set(
            key("a"),
            tokens_per_s.iter().map(|t| t * 1_000_000).collect(),
        );
    };
    set(&mut demand, [100, 500, 200]);
    for _ in 0..round_bound(&config) {
        round(&mut d, &demand, &config);
    }
    let e = &d.state.entries[&key("a")];
    assert_eq!(
        e.pin.map(|p| (p.home, p.source)),
        Some((1, PinSource::Auto))
    );
    assert_eq!(e.shares_ppm, [10_000, 980_000, 10_000]);
    // Region 2 gets a little ahead: within the hysteresis, the home stays.
    set(&mut demand, [100, 500, 600]);
    round(&mut d, &demand, &config);
    assert_eq!(d.state.entries[&key("a")].pin.unwrap().home, 1);
    // Clearly ahead: the home moves, revoke before grant, and settles.
    set(&mut demand, [100, 500, 900]);
    for _ in 0..round_bound(&config) {
        round(&mut d, &demand, &config);
    }
    let e = &d.state.entries[&key("a")];
    assert_eq!(e.pin.unwrap().home, 2);
    assert_eq!(e.shares_ppm, [10_000, 10_000, 980_000]);
    // Not critical any more: the automatic pin goes.
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(10_000, Tier::Standard),
    });
    round(&mut d, &demand, &config);
    assert_eq!(d.state.entries[&key("a")].pin, None);
}

#[test]
fn a_joining_region_is_raised_to_its_floor_first() {
    let config = AllocatorConfig::default();
    let mut d = Driver::with_regions(2);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(100_000, Tier::Standard),
    });
    d.renew_all();
    d.op(Operation::PutRegion {
        region: common::region(2),
        reserves_floor: true,
        draining: false,
    });
    d.renew_all();
    let demand = DemandTracker::new(config.ewma_alpha_ppm);
    for _ in 0..round_bound(&config) {
        round(&mut d, &demand, &config);
    }
    let shares = &d.state.entries[&key("a")].shares_ppm;
    assert_eq!(shares.iter().sum::<u32>(), PPM);
    assert!(
        shares.iter().all(|s| s.abs_diff(PPM / 3) <= 10_000),
        "{shares:?}"
    );
}

#[test]
fn a_cut_off_region_loses_share_once_its_lease_runs_out() {
    let config = AllocatorConfig::default();
    let mut d = Driver::with_regions(3);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(50_000, Tier::Standard),
    });
    d.renew_all();
    let mut demand = DemandTracker::new(config.ewma_alpha_ppm);
    demand.set(key("a"), vec![0, RATE_UT_PER_S, RATE_UT_PER_S]);
    // Region 0 is cut off: it neither renews nor acknowledges from now on.
    let mut rounds_to_settle = None;
    for n in 0..120 {
        d.now_ms += 1_000;
        let p = plan(&d.state, &demand, &config, d.now_ms);
        let mut id = d.next_id;
        for cmd in p.into_commands(d.now_ms, 100, || {
            id += 1;
            RequestId(id)
        }) {
            d.state.apply(&cmd);
            d.state.check_invariant().unwrap();
        }
        d.next_id = id;
        let epoch = d.state.epoch;
        for r in 1..3 {
            d.op(Operation::RenewLease {
                region: common::region(r),
                acked_epoch: epoch,
            });
        }
        let shares = &d.state.entries[&key("a")].shares_ppm;
        if shares[0] == 50_000 && shares[1] + shares[2] == PPM - 50_000 {
            rounds_to_settle.get_or_insert(n);
        }
    }
    let lease = d.state.lease;
    let settled = rounds_to_settle.expect("the cut-off region's share was never reused");
    // Nothing can be reused before its lease (30 s) plus the margin (2 s) ran out.
    assert!(
        settled as u64 * 1_000 >= lease.lease_ms + lease.drift_margin_ms,
        "settled after {settled} rounds"
    );
    assert_eq!(
        d.state.entries[&key("a")].shares_ppm,
        [50_000, 475_000, 475_000]
    );
}

/// A region cut off while its demand is high: its last estimate stays in the tracker (it cannot
/// report), yet once its lease plus the margin has passed, the majority holds everything but
/// its floor within two rounds, never above the budget.
#[test]
fn a_cut_off_regions_demand_stops_counting_once_its_lease_lapsed() {
    let config = AllocatorConfig::default();
    let mut d = Driver::with_regions(3);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(50_000, Tier::Standard),
    });
    let mut demand = DemandTracker::new(config.ewma_alpha_ppm);
    demand.set(key("a"), vec![RATE_UT_PER_S; 3]);
    for _ in 0..round_bound(&config) {
        round(&mut d, &demand, &config);
    }
    let even = d.state.entries[&key("a")].shares_ppm.clone();
    assert!(
        even.iter().all(|&s| s > 300_000),
        "even split first: {even:?}"
    );
    // Region 0 is cut off from now on; its lease runs from its last renewal.
    let lapse_ms =
        d.state.regions[0].as_ref().unwrap().lease_expires_at_ms + d.state.lease.drift_margin_ms;
    let mut lapsed_rounds = 0;
    for _ in 0..60 {
        d.now_ms += 1_000;
        let p = plan(&d.state, &demand, &config, d.now_ms);
        let mut id = d.next_id;
        for cmd in p.into_commands(d.now_ms, 100, || {
            id += 1;
            RequestId(id)
        }) {
            d.state.apply(&cmd);
            d.state.check_invariant().unwrap();
        }
        d.next_id = id;
        let epoch = d.state.epoch;
        for r in 1..3 {
            d.op(Operation::RenewLease {
                region: common::region(r),
                acked_epoch: epoch,
            });
        }
        let shares = d.state.entries[&key("a")].shares_ppm.clone();
        if d.now_ms <= lapse_ms {
            assert_eq!(
                shares, even,
                "nothing moves while the lease may be in force"
            );
            continue;
        }
        lapsed_rounds += 1;
        assert!(shares[0] >= 50_000, "the floor stays reserved");
        if lapsed_rounds >= 2 {
            assert_eq!(
                shares,
                [50_000, 475_000, 475_000],
                "two rounds after the lapse"
            );
        }
    }
    assert!(lapsed_rounds > 10);
    // Back again: it renews and its demand counts once more.
    d.renew_all();
    for _ in 0..round_bound(&config) {
        round(&mut d, &demand, &config);
    }
    assert!(d.state.entries[&key("a")].shares_ppm[0] > 300_000);
}
