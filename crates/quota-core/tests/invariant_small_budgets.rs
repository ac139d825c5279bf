//! Invariant: every policy validation accepts is enforced whole, however small or slow it is.
//!
//! Random policies (limit 1..10⁹, window 1 ms..31 days, burst, floor, either algorithm) over
//! 1–9 regions, driven by allocator rounds with demand that moves between regions, regions
//! that stop renewing and come back. After every command: the enforceable shares sum to at
//! most the budget, no region is granted more than nothing but less than one unit of the
//! policy (a token of burst, or of a sliding window's limit), and no floor is part of one unit.
//! After demand has stayed in one region long enough to converge, that region (or, for a budget
//! too small to split, its home, where the others forward) holds every cost the policy can
//! admit anywhere ([`mode::largest_cost`]), so no check the daemon accepts is answered "never".
//!
//! Seeded: `QUOTA_PROPTEST_SEED` (default 20) and `QUOTA_PROPTEST_CASES` (default 256).

mod common;

use common::{key, Driver};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use quota_core::allocator::{plan, AllocatorConfig};
use quota_core::coordinator::{Operation, RequestId, Response};
use quota_core::demand::DemandTracker;
use quota_core::mode::{self, BudgetMode};
use quota_core::policy::MAX_WINDOW_MS;
use quota_core::share::{limit_for_share, ShareLimit};
use quota_core::{Algorithm, Policy, PolicySpec, PPM};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: env("QUOTA_PROPTEST_CASES", 256) as u32,
        rng_seed: RngSeed::Fixed(env("QUOTA_PROPTEST_SEED", 20)),
        ..ProptestConfig::default()
    }
}

/// A policy spec anywhere in the accepted range, small budgets weighted up.
fn spec() -> impl Strategy<Value = PolicySpec> {
    let limit = prop_oneof![
        3 => 1u64..=10,
        2 => 1u64..=1_000,
        1 => 1u64..=1_000_000_000,
    ];
    let window = prop_oneof![
        1 => 1u64..=1_000,
        2 => 1_000u64..=3_600_000,
        2 => 3_600_000u64..=MAX_WINDOW_MS,
        1 => Just(MAX_WINDOW_MS),
    ];
    let burst = prop_oneof![
        Just(None),
        (1u64..=20).prop_map(Some),
        (1u64..=1_000_000).prop_map(Some)
    ];
    let floor = prop_oneof![
        Just(None),
        Just(Some(0.05)),
        (0u32..=200_000).prop_map(|f| Some(f64::from(f) / f64::from(PPM))),
    ];
    let algorithm = prop_oneof![
        3 => Just(Algorithm::TokenBucket),
        1 => Just(Algorithm::SlidingWindow),
        1 => Just(Algorithm::Concurrency)
    ];
    (limit, window, burst, floor, algorithm).prop_map(|(l, w, b, f, a)| PolicySpec {
        limit: l as f64,
        window_ms: w as f64,
        burst: b.map(|b| b as f64),
        floor: f,
        algorithm: Some(a),
        ..PolicySpec::default()
    })
}

/// Where demand is during a phase.
#[derive(Debug, Clone, Copy)]
enum Demand {
    /// Twice the budget, all in one region.
    Greedy(usize),
    /// Half the budget, spread evenly.
    Spread,
    None,
}

/// A stretch of rounds with the same demand; `silent` stops renewing (cut off) meanwhile.
#[derive(Debug, Clone)]
struct Phase {
    demand: Demand,
    rounds: usize,
    silent: Option<usize>,
}

fn phase() -> impl Strategy<Value = Phase> {
    let demand = prop_oneof![
        4 => (0usize..9).prop_map(Demand::Greedy),
        1 => Just(Demand::Spread),
        1 => Just(Demand::None),
    ];
    let silent = prop_oneof![3 => Just(None), 1 => (0usize..9).prop_map(Some)];
    (demand, 1usize..=30, silent).prop_map(|(demand, rounds, silent)| Phase {
        demand,
        rounds,
        silent,
    })
}

/// Whole units a region holds at `share_ppm` of the policy.
fn units_at(policy: &Policy, share_ppm: u32) -> u64 {
    match limit_for_share(policy, share_ppm) {
        ShareLimit::TokenBucket(p) => p.capacity_ut / quota_core::bucket::UT,
        ShareLimit::SlidingWindow { limit, .. } | ShareLimit::Concurrency { limit } => limit,
    }
}

/// Checks the state after a command: the budget, whole shares and whole floors.
fn check(d: &Driver) -> Result<(), TestCaseError> {
    d.state
        .check_invariant()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    d.state
        .check_whole_shares()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    for entry in d.state.entries.values() {
        let min = entry.policy.min_share_ppm();
        for r in 0..d.state.regions.len() {
            let floor = d.state.floor_of(&entry.policy, r);
            prop_assert!(
                floor == 0 || floor >= min,
                "floor {floor} of {:?}",
                entry.policy
            );
            let share = entry.share(r);
            let units = units_at(&entry.policy, share);
            prop_assert!(
                share == 0 || units >= 1,
                "region {r} holds {share} ppm = {units} units"
            );
        }
    }
    Ok(())
}

/// One allocator round at `demand`, committed; every region but `silent` renews and
/// acknowledges. Time moves on a second.
fn round(
    d: &mut Driver,
    demand: &DemandTracker,
    silent: Option<usize>,
) -> Result<(), TestCaseError> {
    let config = AllocatorConfig::default();
    d.now_ms += 1_000;
    let p = plan(&d.state, demand, &config, d.now_ms);
    let mut id = d.next_id;
    let commands = p.into_commands(d.now_ms, config.max_entries_per_command, || {
        id += 1;
        RequestId(id)
    });
    d.next_id = id;
    for cmd in commands {
        d.state.apply(&cmd);
        check(d)?;
    }
    let epoch = d.state.epoch;
    let ids: Vec<_> = (0..d.state.regions.len())
        .filter(|&r| Some(r) != silent)
        .filter_map(|r| d.state.region(r).map(|s| s.id.clone()))
        .collect();
    for region in ids {
        d.op(Operation::RenewLease {
            region,
            acked_epoch: epoch,
        });
        check(d)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn every_accepted_policy_is_enforced_whole(
        n in 1usize..=9,
        spec in spec(),
        phases in prop::collection::vec(phase(), 1..6),
    ) {
        let Ok(policy) = spec.validate() else { return Ok(()); };
        let mut d = Driver::with_regions(n);
        d.state.lease.lease_ms = 6_000;
        d.state.lease.drift_margin_ms = 500;
        let k = key("small");
        let r = d.op(Operation::PutPolicy { key: k.clone(), policy: policy.clone() });
        if matches!(r, Response::FloorsExceedBudget { .. }) {
            return Ok(());
        }
        prop_assert!(matches!(r, Response::PolicyStored { .. }), "{r:?}");
        check(&d)?;
        let mode = mode::budget_mode(&policy, n);
        let rate = policy.rate_ut_per_s().max(1);
        // A fresh policy admits one unit at once in some region.
        let entry = &d.state.entries[&k];
        let best = (0..n).map(|r| units_at(&policy, entry.share(r))).max().unwrap();
        prop_assert!(best >= 1, "a fresh {mode:?} policy holds no unit anywhere: {entry:?}");
        if mode == BudgetMode::Home {
            prop_assert!(entry.pin.is_some(), "a fresh home-mode policy has no home");
        }
        let largest = mode::largest_cost(&policy, d.state.floor_regions() as usize);
        prop_assert!(largest >= 1);
        for ph in phases {
            let mut rates = vec![0u64; n];
            match ph.demand {
                Demand::Greedy(r) => rates[r % n] = rate.saturating_mul(2),
                Demand::Spread => rates.iter_mut().for_each(|x| *x = rate / (2 * n as u64)),
                Demand::None => {}
            }
            let mut demand = DemandTracker::new(PPM);
            demand.set(k.clone(), rates);
            let silent = ph.silent.map(|s| s % n);
            for _ in 0..ph.rounds {
                round(&mut d, &demand, silent)?;
            }
            // Converged on one busy region that renews: it (or, for a budget too small to
            // split, the home its checks are forwarded to) holds every cost the policy can
            // admit anywhere.
            if let Demand::Greedy(r) = ph.demand {
                let r = r % n;
                if silent != Some(r) {
                    // Let the silent region's lease lapse or come back, then settle.
                    for _ in 0..30 {
                        round(&mut d, &demand, None)?;
                    }
                    let entry = &d.state.entries[&k];
                    let holder = match mode {
                        BudgetMode::Home => {
                            let home = entry.pin.map(|p| usize::from(p.home));
                            prop_assert!(home.is_some(), "a home-mode policy lost its home");
                            home.unwrap_or(r)
                        }
                        BudgetMode::Split => r,
                    };
                    let units = units_at(&policy, entry.share(holder));
                    // Converged means within the change threshold, which is less than one
                    // unit of a small policy and a few units of a large one (plus one for
                    // rounding to whole units).
                    let slack = u128::from(policy.units())
                        * u128::from(AllocatorConfig::default().change_threshold_ppm)
                        / u128::from(PPM)
                        + 1;
                    prop_assert!(
                        u128::from(units) + slack >= u128::from(largest),
                        "{mode:?}: region {holder} holds {units} units < largest cost {largest}: {entry:?}"
                    );
                    if mode == BudgetMode::Home {
                        for o in (0..n).filter(|&o| o != holder) {
                            prop_assert_eq!(entry.share(o), d.state.floor_of(&policy, o));
                        }
                        prop_assert!(units >= largest, "home {holder} holds {units} < {largest}");
                    }
                }
            }
        }
    }
}

#[test]
fn the_policies_people_write_first_hold_a_whole_unit_from_the_start() {
    // 5 logins per 15 minutes, 2 password resets an hour, 1 export a month, a sliding window
    // of 2: each fresh policy in three regions is whole in one region, floors included.
    let specs = [
        (5.0, 900_000.0, Algorithm::TokenBucket),
        (2.0, 3_600_000.0, Algorithm::TokenBucket),
        (1.0, 2_678_400_000.0, Algorithm::TokenBucket),
        (2.0, 60_000.0, Algorithm::SlidingWindow),
    ];
    for (limit, window_ms, algorithm) in specs {
        let policy = PolicySpec {
            limit,
            window_ms,
            floor: Some(0.05),
            algorithm: Some(algorithm),
            ..PolicySpec::default()
        }
        .validate()
        .unwrap();
        let mut d = Driver::with_regions(3);
        d.op(Operation::PutPolicy {
            key: key("login"),
            policy: policy.clone(),
        });
        let entry = &d.state.entries[&key("login")];
        assert_eq!(entry.shares_ppm, [PPM, 0, 0], "{policy:?}");
        assert_eq!(entry.pin.map(|p| p.home), Some(0));
        assert_eq!(mode::largest_cost(&policy, 3), policy.units());
    }
}

#[test]
fn a_home_stays_put_until_it_can_no_longer_hold_the_budget() {
    let policy = PolicySpec {
        limit: 2.0,
        window_ms: 60_000.0,
        ..PolicySpec::default()
    }
    .validate()
    .unwrap();
    let mut d = Driver::with_regions(3);
    d.state.lease.lease_ms = 6_000;
    d.state.lease.drift_margin_ms = 500;
    d.op(Operation::PutPolicy {
        key: key("login"),
        policy: policy.clone(),
    });
    d.renew_all();
    let home = |d: &Driver| d.state.entries[&key("login")].pin.map(|p| p.home);
    assert_eq!(home(&d), Some(0));
    // All demand in region 2: the home stays (a move would leave its tokens behind).
    let mut demand = DemandTracker::new(PPM);
    demand.set(key("login"), vec![0, 0, 2 * policy.rate_ut_per_s()]);
    for _ in 0..10 {
        round(&mut d, &demand, None).unwrap();
    }
    assert_eq!(home(&d), Some(0));
    assert_eq!(d.state.entries[&key("login")].shares_ppm, [PPM, 0, 0]);
    // Region 0 stops renewing: once its lease lapsed the budget moves whole to region 2.
    for _ in 0..12 {
        round(&mut d, &demand, Some(0)).unwrap();
    }
    assert_eq!(home(&d), Some(2));
    assert_eq!(d.state.entries[&key("login")].shares_ppm, [0, 0, PPM]);
}
