//! Scenario tests of `CoordinatorState::apply`: each names the rule it holds.

mod common;

use common::{key, policy, region, Driver};
use quota_core::coordinator::{
    EntryRejection, HomeChange, InvalidEntry, Operation, Pin, PinSource, RegionShare, Response,
    ShareEntry, MAX_BATCH_POLICIES, MAX_LISTED_INVALID,
};
use quota_core::lease::{LeaseConfig, LeaseConfigError};
use quota_core::mode::BudgetMode;
use quota_core::policy::{Policy, Tier};
use quota_core::PPM;

fn set(d: &mut Driver, t: &str, shares: &[u32]) -> Response {
    let membership = d.state.membership;
    d.op(Operation::SetShares {
        membership,
        entries: vec![ShareEntry {
            key: key(t),
            shares_ppm: shares.to_vec(),
            home: HomeChange::Keep,
        }],
    })
}

fn accepted(r: &Response) -> u32 {
    match r {
        Response::SharesSet { accepted, .. } => *accepted,
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn new_policy_starts_with_an_even_split_and_versions_never_repeat() {
    let mut d = Driver::with_regions(3);
    let r = d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(0, Tier::Standard),
    });
    assert!(matches!(r, Response::PolicyStored { version: 1, .. }));
    assert_eq!(
        d.state.entries[&key("a")].shares_ppm,
        [333_334, 333_333, 333_333]
    );
    d.op(Operation::DeletePolicy { key: key("a") });
    let r = d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(0, Tier::Standard),
    });
    assert!(matches!(r, Response::PolicyStored { version: 2, .. }));
    assert_eq!(d.state.entries[&key("a")].policy.replaces, None);
}

#[test]
fn an_identical_put_keeps_the_version_and_changes_nothing() {
    let mut d = Driver::with_regions(3);
    let put = |p| Operation::PutPolicy {
        key: key("a"),
        policy: p,
    };
    let r = d.op(put(policy(0, Tier::Standard)));
    assert!(
        matches!(r, Response::PolicyStored { version: 1, .. }),
        "{r:?}"
    );
    let mut before = d.state.clone();
    // The version a client sends is not part of what it asks for.
    let mut same = policy(0, Tier::Standard);
    same.version = 77;
    let r = d.op(put(same));
    assert_eq!(
        r,
        Response::PolicyStored {
            version: 1,
            epoch: before.epoch
        }
    );
    before.recent = d.state.recent.clone();
    before.last_now_ms = d.state.last_now_ms;
    assert_eq!(d.state, before, "an identical put changes no state");

    // A changed policy gets a new version and records the one it replaced (a re-put after a
    // delete replaces nothing: the old bucket is gone); a batch keeps the unchanged entries'
    // versions.
    assert_eq!(d.state.entries[&key("a")].policy.replaces, None);
    let r = d.op(put(policy(0, Tier::Critical)));
    assert!(
        matches!(r, Response::PolicyStored { version: 2, .. }),
        "{r:?}"
    );
    assert_eq!(d.state.entries[&key("a")].policy.replaces, Some(1));
    let r = d.op(Operation::PutPolicies {
        entries: vec![
            (key("b"), policy(0, Tier::Standard)),
            (key("a"), policy(0, Tier::Critical)),
            (key("c"), policy(0, Tier::Standard)),
        ],
    });
    let Response::PoliciesStored { versions, .. } = r else {
        panic!("unexpected {r:?}");
    };
    assert_eq!(versions, [3, 2, 4]);
    // After a delete the same policy is new again: a fresh version, never a reused one.
    d.op(Operation::DeletePolicy { key: key("a") });
    let r = d.op(put(policy(0, Tier::Critical)));
    assert!(
        matches!(r, Response::PolicyStored { version: 5, .. }),
        "{r:?}"
    );
}

#[test]
fn floors_times_regions_above_the_budget_are_rejected() {
    let mut d = Driver::with_regions(3);
    let r = d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(400_000, Tier::Standard),
    });
    assert_eq!(
        r,
        Response::FloorsExceedBudget {
            floor_ppm: 400_000,
            floor_regions: 3
        }
    );
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(300_000, Tier::Standard),
    });
    // A fourth floor region would need 4 × 300k.
    let r = d.op(Operation::PutRegion {
        region: region(9),
        reserves_floor: true,
        draining: false,
    });
    assert_eq!(
        r,
        Response::FloorsExceedBudget {
            floor_ppm: 300_000,
            floor_regions: 4
        }
    );
    // Without a floor it may join.
    let r = d.op(Operation::PutRegion {
        region: region(9),
        reserves_floor: false,
        draining: false,
    });
    assert!(matches!(r, Response::RegionStored { index: 3, .. }));
}

#[test]
fn a_decrease_frees_share_only_after_ack_or_lease_expiry() {
    let mut d = Driver::with_regions(2);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(0, Tier::Standard),
    });
    d.renew_all();
    // Move 100k from r0 to r1 in one go: the increase cannot be granted yet.
    let r = set(&mut d, "a", &[400_000, 600_000]);
    assert!(matches!(
        r,
        Response::SharesSet { accepted: 0, rejected_total: 1, ref rejected, .. }
            if rejected[0].reason == EntryRejection::BudgetExceeded { enforceable_ppm: 1_100_000 }
    ));
    // Revoke first.
    assert_eq!(accepted(&set(&mut d, "a", &[400_000, 500_000])), 1);
    // Not acknowledged, lease live: still refused.
    assert_eq!(accepted(&set(&mut d, "a", &[400_000, 600_000])), 0);
    // r0 acknowledges: granted.
    let epoch = d.state.epoch;
    d.op(Operation::RenewLease {
        region: region(0),
        acked_epoch: epoch,
    });
    assert_eq!(accepted(&set(&mut d, "a", &[400_000, 600_000])), 1);

    // Again without an ack, but r0's lease runs out (30 s + 2 s margin).
    assert_eq!(accepted(&set(&mut d, "a", &[300_000, 600_000])), 1);
    d.now_ms += 32_000;
    assert_eq!(
        accepted(&set(&mut d, "a", &[300_000, 700_000])),
        0,
        "margin not yet over"
    );
    d.now_ms += 1;
    assert_eq!(accepted(&set(&mut d, "a", &[300_000, 700_000])), 1);
}

#[test]
fn floors_are_never_given_away_and_outlive_leases() {
    let mut d = Driver::with_regions(2);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(200_000, Tier::Standard),
    });
    d.renew_all();
    let r = set(&mut d, "a", &[100_000, 500_000]);
    assert!(matches!(
        r,
        Response::SharesSet { ref rejected, .. }
            if rejected[0].reason == EntryRejection::CutsFloor { region: 0, floor_ppm: 200_000 }
    ));
    // Lower the floor to 0: r0 may still fall back to 200k until it acknowledges, even long
    // after its lease.
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(0, Tier::Standard),
    });
    assert_eq!(accepted(&set(&mut d, "a", &[100_000, 500_000])), 1);
    d.now_ms += 10 * 60_000;
    assert_eq!(accepted(&set(&mut d, "a", &[100_000, 900_000])), 0);
    assert_eq!(accepted(&set(&mut d, "a", &[100_000, 800_000])), 1);
    d.renew_all();
    assert_eq!(accepted(&set(&mut d, "a", &[100_000, 900_000])), 1);
    assert_eq!(
        d.state.region_share(&key("a"), 0),
        Some(RegionShare {
            share_ppm: 100_000,
            floor_ppm: 0
        })
    );
}

#[test]
fn duplicates_get_the_original_response_and_change_nothing() {
    let mut d = Driver::with_regions(2);
    let cmd = d.command(Operation::PutPolicy {
        key: key("a"),
        policy: policy(0, Tier::Standard),
    });
    let first = d.state.apply(&cmd);
    let snapshot = d.state.clone();
    assert_eq!(d.state.apply(&cmd), first);
    assert_eq!(d.state, snapshot);
}

#[test]
fn business_rejections_are_responses() {
    let mut d = Driver::with_regions(2);
    assert_eq!(
        d.op(Operation::DeletePolicy { key: key("x") }),
        Response::UnknownPolicy
    );
    assert_eq!(
        d.op(Operation::RenewLease {
            region: region(7),
            acked_epoch: 0
        }),
        Response::UnknownRegion { region: region(7) }
    );
    let epoch = d.state.epoch;
    assert_eq!(
        d.op(Operation::RenewLease {
            region: region(0),
            acked_epoch: epoch + 5
        }),
        Response::AckFromFuture {
            acked_epoch: epoch + 5,
            epoch
        }
    );
    assert_eq!(
        d.op(Operation::SetShares {
            membership: 99,
            entries: vec![]
        }),
        Response::StaleMembership {
            planned: 99,
            current: 2
        }
    );
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(0, Tier::Standard),
    });
    for (shares, reason) in [
        (
            vec![1],
            EntryRejection::WrongLength {
                expected: 2,
                found: 1,
            },
        ),
        (
            vec![PPM + 1, 0],
            EntryRejection::BadShare {
                region: 0,
                share_ppm: PPM + 1,
            },
        ),
    ] {
        let r = set(&mut d, "a", &shares);
        assert!(
            matches!(&r, Response::SharesSet { rejected, .. } if rejected[0].reason == reason),
            "{r:?}"
        );
    }
    assert_eq!(
        d.op(Operation::SetLeaseConfig {
            config: LeaseConfig {
                lease_ms: 1000,
                drift_margin_ms: 600
            }
        }),
        Response::InvalidLeaseConfig {
            error: LeaseConfigError::MarginTooLarge {
                lease_ms: 1000,
                drift_margin_ms: 600
            }
        }
    );
    assert_eq!(
        d.op(Operation::PutRegion {
            region: region(0),
            reserves_floor: false,
            draining: false
        }),
        Response::RegionRulesImmutable { region: region(0) }
    );
}

#[test]
fn policies_that_would_break_the_arithmetic_are_refused() {
    let mut d = Driver::with_regions(2);
    let mut bad = policy(0, Tier::Standard);
    bad.window_ms = 0;
    bad.floor_ppm = PPM + 1;
    let r = d.op(Operation::PutPolicy {
        key: key("a"),
        policy: bad,
    });
    assert_eq!(
        r,
        Response::InvalidPolicy {
            fields: vec!["window_ms".into(), "floor".into()]
        }
    );
    assert!(d.state.entries.is_empty());
}

#[test]
fn clock_is_clamped_monotonic() {
    let mut d = Driver::with_regions(1);
    d.now_ms = 50_000;
    d.renew_all();
    d.now_ms = 10_000;
    let r = d.op(Operation::RenewLease {
        region: region(0),
        acked_epoch: 0,
    });
    assert!(
        matches!(
            r,
            Response::LeaseRenewed {
                expires_at_ms: 80_000,
                ..
            }
        ),
        "{r:?}"
    );
    assert_eq!(d.state.last_now_ms, 50_000);
}

#[test]
fn deleted_policies_are_forgotten_only_once_no_region_may_enforce_them() {
    let mut d = Driver::with_regions(2);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(100_000, Tier::Standard),
    });
    d.renew_all();
    d.op(Operation::DeletePolicy { key: key("a") });
    assert_eq!(
        d.op(Operation::Forget {
            keys: vec![key("a")]
        }),
        Response::Forgotten { count: 0 }
    );
    // A re-put while revocations are live starts from zero shares, not an even split.
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(100_000, Tier::Standard),
    });
    assert_eq!(d.state.entries[&key("a")].shares_ppm, [0, 0]);
    d.op(Operation::DeletePolicy { key: key("a") });
    d.renew_all();
    assert_eq!(
        d.op(Operation::Forget {
            keys: vec![key("a")]
        }),
        Response::Forgotten { count: 1 }
    );
    assert!(d.state.entries.is_empty());
}

#[test]
fn regions_leave_only_when_they_hold_nothing() {
    let mut d = Driver::with_regions(3);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(0, Tier::Standard),
    });
    d.renew_all();
    assert_eq!(
        d.op(Operation::RemoveRegion { region: region(2) }),
        Response::RegionInUse { region: region(2) }
    );
    assert_eq!(accepted(&set(&mut d, "a", &[333_334, 333_333, 0])), 1);
    d.renew_all();
    assert_eq!(accepted(&set(&mut d, "a", &[500_000, 500_000, 0])), 1);
    let r = d.op(Operation::RemoveRegion { region: region(2) });
    assert!(matches!(r, Response::RegionRemoved { .. }), "{r:?}");
    assert_eq!(d.state.regions.len(), 2);
    assert_eq!(d.state.entries[&key("a")].shares_ppm, [500_000, 500_000]);
}

#[test]
fn operator_pins_win_over_automatic_ones() {
    let mut d = Driver::with_regions(2);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(0, Tier::Critical),
    });
    let r = d.op(Operation::Pin {
        key: key("a"),
        home: region(1),
    });
    assert_eq!(r, Response::Pinned { home: 1 });
    let membership = d.state.membership;
    let r = d.op(Operation::SetShares {
        membership,
        entries: vec![ShareEntry {
            key: key("a"),
            shares_ppm: vec![500_000, 500_000],
            home: HomeChange::Auto(0),
        }],
    });
    assert!(matches!(
        &r,
        Response::SharesSet { rejected, .. } if rejected[0].reason == EntryRejection::BadHome { region: 0 }
    ));
    assert_eq!(
        d.state.entries[&key("a")].pin.unwrap().source,
        PinSource::Operator
    );
    d.op(Operation::Unpin { key: key("a") });
    assert_eq!(d.state.entries[&key("a")].pin, None);
}

#[test]
fn a_tenant_pin_covers_its_policies_present_and_future() {
    let mut d = Driver::with_regions(3);
    let acme = key("acme").tenant;
    let pin = |d: &mut Driver, home| {
        d.op(Operation::PinTenant {
            tenant: key("acme").tenant,
            home,
        })
    };
    let operator = |home| {
        Some(Pin {
            home,
            source: PinSource::Operator,
        })
    };
    assert_eq!(
        pin(&mut d, region(7)),
        Response::UnknownRegion { region: region(7) }
    );
    assert!(d.state.tenant_pins.is_empty());
    // No policy yet: the pin is remembered, and the next policy put is pinned.
    assert_eq!(
        pin(&mut d, region(2)),
        Response::TenantPinned {
            home: 2,
            policies: 0
        }
    );
    assert_eq!(d.state.tenant_pins[&acme], 2);
    d.op(Operation::PutPolicy {
        key: key("acme"),
        policy: policy(0, Tier::Standard),
    });
    d.op(Operation::PutPolicy {
        key: key("other"),
        policy: policy(0, Tier::Standard),
    });
    assert_eq!(d.state.entries[&key("acme")].pin, operator(2));
    assert_eq!(d.state.entries[&key("other")].pin, None);
    // Re-pinning moves every policy in one command.
    assert_eq!(
        pin(&mut d, region(1)),
        Response::TenantPinned {
            home: 1,
            policies: 1
        }
    );
    assert_eq!(d.state.entries[&key("acme")].pin, operator(1));
    // A deleted and re-put policy is pinned again.
    d.op(Operation::DeletePolicy { key: key("acme") });
    assert_eq!(d.state.entries[&key("acme")].pin, None);
    d.op(Operation::PutPolicy {
        key: key("acme"),
        policy: policy(0, Tier::Standard),
    });
    assert_eq!(d.state.entries[&key("acme")].pin, operator(1));
    // The allocator may not move it.
    let membership = d.state.membership;
    let r = d.op(Operation::SetShares {
        membership,
        entries: vec![ShareEntry {
            key: key("acme"),
            shares_ppm: vec![333_334, 333_333, 333_333],
            home: HomeChange::Auto(0),
        }],
    });
    assert!(
        matches!(&r, Response::SharesSet { rejected, .. } if rejected[0].reason == EntryRejection::BadHome { region: 0 }),
        "{r:?}"
    );
    let unpin = |d: &mut Driver| {
        d.op(Operation::UnpinTenant {
            tenant: key("acme").tenant,
        })
    };
    assert_eq!(unpin(&mut d), Response::TenantUnpinned { policies: 1 });
    assert_eq!(d.state.entries[&key("acme")].pin, None);
    assert_eq!(unpin(&mut d), Response::TenantNotPinned);
    d.op(Operation::PutPolicy {
        key: key("acme"),
        policy: policy(0, Tier::Standard),
    });
    assert_eq!(d.state.entries[&key("acme")].pin, None, "unpinned for good");
}

#[test]
fn unpinning_a_tenant_leaves_automatic_pins_to_the_allocator() {
    let mut d = Driver::with_regions(2);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(0, Tier::Critical),
    });
    let membership = d.state.membership;
    d.op(Operation::SetShares {
        membership,
        entries: vec![ShareEntry {
            key: key("a"),
            shares_ppm: vec![500_000, 500_000],
            home: HomeChange::Auto(1),
        }],
    });
    let auto = Some(Pin {
        home: 1,
        source: PinSource::Auto,
    });
    assert_eq!(d.state.entries[&key("a")].pin, auto);
    // A tenant pin overrides it; unpinning the tenant then leaves the policy unpinned, and the
    // allocator pins it again if it wants.
    let tenant = key("a").tenant;
    d.op(Operation::PinTenant {
        tenant: tenant.clone(),
        home: region(0),
    });
    assert_eq!(
        d.state.entries[&key("a")].pin.unwrap().source,
        PinSource::Operator
    );
    d.op(Operation::UnpinTenant { tenant });
    assert_eq!(d.state.entries[&key("a")].pin, None);
}

#[test]
fn a_region_a_tenant_is_pinned_to_cannot_be_removed() {
    // Slots are reused: removing the home would pin the tenant's future policies elsewhere.
    let mut d = Driver::with_regions(3);
    let tenant = key("acme").tenant;
    d.op(Operation::PutRegion {
        region: region(2),
        reserves_floor: true,
        draining: true,
    });
    d.op(Operation::PinTenant {
        tenant: tenant.clone(),
        home: region(2),
    });
    assert_eq!(
        d.op(Operation::RemoveRegion { region: region(2) }),
        Response::RegionInUse { region: region(2) }
    );
    d.op(Operation::UnpinTenant { tenant });
    let r = d.op(Operation::RemoveRegion { region: region(2) });
    assert!(matches!(r, Response::RegionRemoved { .. }), "{r:?}");
}

#[test]
fn state_round_trips_through_postcard() {
    let mut d = Driver::with_regions(3);
    for t in ["a", "b", "c"] {
        d.op(Operation::PutPolicy {
            key: key(t),
            policy: policy(10_000, Tier::Standard),
        });
    }
    d.renew_all();
    set(&mut d, "b", &[300_000, 300_000, 333_333]);
    d.op(Operation::PinTenant {
        tenant: key("c").tenant,
        home: region(1),
    });
    let bytes = postcard::to_stdvec(&d.state).unwrap();
    let back: quota_core::CoordinatorState = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(back, d.state);
    let cmd = d.command(Operation::Unpin { key: key("a") });
    let bytes = postcard::to_stdvec(&cmd).unwrap();
    assert_eq!(
        postcard::from_bytes::<quota_core::Command>(&bytes).unwrap(),
        cmd
    );
}

#[test]
fn a_draining_region_loses_its_floor_is_emptied_and_can_leave() {
    use quota_core::allocator::{plan, AllocatorConfig};
    use quota_core::demand::DemandTracker;
    let mut d = Driver::with_regions(3);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(100_000, Tier::Standard),
    });
    d.renew_all();
    d.op(Operation::PutRegion {
        region: region(2),
        reserves_floor: true,
        draining: true,
    });
    let config = AllocatorConfig::default();
    let demand = DemandTracker::new(config.ewma_alpha_ppm);
    for _ in 0..30 {
        d.now_ms += 1_000;
        let p = plan(&d.state, &demand, &config, d.now_ms);
        for e in p.entries {
            let membership = d.state.membership;
            d.op(Operation::SetShares {
                membership,
                entries: vec![e],
            });
        }
        d.renew_all();
    }
    assert_eq!(d.state.entries[&key("a")].shares_ppm, [500_000, 500_000, 0]);
    let grants: Vec<_> = d.state.grants_for_region(2).map(|(_, _, g)| g).collect();
    assert_eq!(
        grants,
        [RegionShare {
            share_ppm: 0,
            floor_ppm: 0
        }]
    );
    let r = d.op(Operation::RemoveRegion { region: region(2) });
    assert!(matches!(r, Response::RegionRemoved { .. }), "{r:?}");
}

/// Rounds of the allocator with no demand, each committed entry by entry; the regions in
/// `renewing` renew their leases (acknowledging the epoch) after every round. The invariant
/// holds after every command.
fn drain_rounds(d: &mut Driver, rounds: usize, renewing: &[usize]) {
    use quota_core::allocator::{plan, AllocatorConfig};
    use quota_core::demand::DemandTracker;
    let config = AllocatorConfig::default();
    let demand = DemandTracker::new(config.ewma_alpha_ppm);
    for _ in 0..rounds {
        d.now_ms += 1_000;
        let p = plan(&d.state, &demand, &config, d.now_ms);
        for e in p.entries {
            let membership = d.state.membership;
            d.op(Operation::SetShares {
                membership,
                entries: vec![e],
            });
            d.state.check_invariant().unwrap();
        }
        let epoch = d.state.epoch;
        for &i in renewing {
            d.op(Operation::RenewLease {
                region: region(i),
                acked_epoch: epoch,
            });
        }
        d.state.check_invariant().unwrap();
    }
}

#[test]
fn a_removed_region_leaves_the_whole_budget_and_its_floor_to_the_others() {
    let mut d = Driver::with_regions(3);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(100_000, Tier::Standard),
    });
    d.renew_all();
    // Three regions cannot all reserve half the budget.
    assert!(matches!(
        d.op(Operation::PutPolicy {
            key: key("half"),
            policy: policy(500_000, Tier::Standard),
        }),
        Response::FloorsExceedBudget { .. }
    ));
    d.op(Operation::PutRegion {
        region: region(2),
        reserves_floor: true,
        draining: true,
    });
    assert!(
        d.state.region_in_use(2, d.now_ms),
        "it still holds its share"
    );
    drain_rounds(&mut d, 30, &[0, 1, 2]);
    assert!(
        !d.state.region_in_use(2, d.now_ms),
        "emptied and acknowledged"
    );
    let r = d.op(Operation::RemoveRegion { region: region(2) });
    assert!(matches!(r, Response::RegionRemoved { .. }), "{r:?}");

    // The budget is whole in the two regions left, and the floor of the third is free.
    let entry = &d.state.entries[&key("a")];
    assert_eq!(entry.shares_ppm.iter().sum::<u32>(), 1_000_000);
    assert_eq!(d.state.enforceable_total(entry, d.now_ms), 1_000_000);
    assert_eq!(d.state.floor_regions(), 2);
    assert!(matches!(
        d.op(Operation::PutPolicy {
            key: key("half"),
            policy: policy(500_000, Tier::Standard),
        }),
        Response::PolicyStored { .. }
    ));
    assert_eq!(d.state.entries[&key("half")].shares_ppm, [500_000, 500_000]);
    d.state.check_invariant().unwrap();
}

#[test]
fn a_draining_region_that_never_acknowledges_keeps_its_floor_reserved() {
    // Down or cut off, it may still fall back to its floor: only its acknowledgement says it
    // stopped. Its share above the floor goes to the others once its lease has run out.
    let mut d = Driver::with_regions(3);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(100_000, Tier::Standard),
    });
    d.renew_all();
    d.op(Operation::PutRegion {
        region: region(2),
        reserves_floor: true,
        draining: true,
    });
    drain_rounds(&mut d, 60, &[0, 1]);
    let entry = &d.state.entries[&key("a")];
    let others = entry.share(0) + entry.share(1);
    assert!((899_990..=900_000).contains(&others), "{others}");
    assert_eq!(d.state.enforceable(entry, 2, d.now_ms), 100_000);
    assert!(d.state.region_in_use(2, d.now_ms));
    assert_eq!(
        d.op(Operation::RemoveRegion { region: region(2) }),
        Response::RegionInUse { region: region(2) }
    );
}

#[test]
fn a_policy_batch_is_stored_whole_in_order_or_not_at_all() {
    let mut d = Driver::with_regions(3);
    d.op(Operation::PutPolicy {
        key: key("a"),
        policy: policy(0, Tier::Standard),
    });
    let before = d.state.clone();

    // One invalid entry (a floor the three regions cannot all reserve, a zero window) refuses
    // the batch: every one is named by its index and nothing changes.
    let mut zero_window = policy(0, Tier::Standard);
    zero_window.window_ms = 0;
    let r = d.op(Operation::PutPolicies {
        entries: vec![
            (key("b"), policy(0, Tier::Standard)),
            (key("c"), policy(400_000, Tier::Standard)),
            (key("d"), zero_window),
        ],
    });
    assert_eq!(
        r,
        Response::InvalidPolicies {
            entries: vec![
                InvalidEntry {
                    index: 1,
                    fields: vec!["floor".into()]
                },
                InvalidEntry {
                    index: 2,
                    fields: vec!["window_ms".into()]
                },
            ],
            total: 2
        }
    );
    // Many invalid entries: the first ones are named, all are counted.
    let many = (0..MAX_LISTED_INVALID + 50)
        .map(|i| (key(&format!("f{i}")), policy(400_000, Tier::Standard)))
        .collect();
    let Response::InvalidPolicies { entries, total } =
        d.op(Operation::PutPolicies { entries: many })
    else {
        panic!("a refused batch");
    };
    assert_eq!(
        (entries.len(), entries[0].index, total),
        (MAX_LISTED_INVALID, 0, MAX_LISTED_INVALID as u32 + 50)
    );
    let mut unchanged = d.state.clone();
    unchanged.recent = before.recent.clone();
    unchanged.last_now_ms = before.last_now_ms;
    assert_eq!(unchanged, before, "a refused batch changes nothing");

    // A valid batch: consecutive versions in order, a replaced policy included, each entry
    // split and stored as a single put would.
    let epoch = d.state.epoch;
    let r = d.op(Operation::PutPolicies {
        entries: vec![
            (key("b"), policy(0, Tier::Standard)),
            (key("a"), policy(100_000, Tier::Critical)),
            (key("c"), policy(0, Tier::Standard)),
        ],
    });
    assert_eq!(
        r,
        Response::PoliciesStored {
            versions: vec![2, 3, 4],
            epoch: epoch + 3
        }
    );
    for (t, version) in [("b", 2), ("a", 3), ("c", 4)] {
        let e = &d.state.entries[&key(t)];
        assert_eq!(e.policy.version, version, "{t}");
        assert_eq!(e.shares_ppm.iter().sum::<u32>(), PPM, "{t}");
    }
    assert_eq!(d.state.entries[&key("a")].policy.floor_ppm, 100_000);
    assert!(d.state.check_invariant().is_ok());

    let too_many = (0..=MAX_BATCH_POLICIES)
        .map(|i| (key(&format!("t{i}")), policy(0, Tier::Standard)))
        .collect();
    let r = d.op(Operation::PutPolicies { entries: too_many });
    assert_eq!(
        r,
        Response::BatchTooLarge {
            max: MAX_BATCH_POLICIES as u32
        }
    );
}

#[test]
fn a_budget_too_small_to_split_starts_whole_at_home_and_no_share_holds_part_of_a_token() {
    let mut d = Driver::with_regions(3);
    // Two a minute, burst two, a 5% floor (a tenth of a token, so none).
    let small = Policy {
        limit: 2,
        window_ms: 60_000,
        burst: 2,
        floor_ppm: 50_000,
        ..policy(0, Tier::Standard)
    };
    let r = d.op(Operation::PutPolicy {
        key: key("a"),
        policy: small.clone(),
    });
    assert!(matches!(r, Response::PolicyStored { .. }), "{r:?}");
    let entry = &d.state.entries[&key("a")];
    assert_eq!(entry.shares_ppm, [PPM, 0, 0]);
    assert_eq!(
        entry.pin,
        Some(Pin {
            home: 0,
            source: PinSource::Auto
        })
    );
    assert_eq!(d.state.budget_mode(&small), BudgetMode::Home);
    assert_eq!(d.state.floor_of(&small, 1), 0);
    // 0.3 of a burst of 2 is 0.6 of a token: refused, nothing changed.
    let r = set(&mut d, "a", &[700_000, 300_000, 0]);
    assert!(
        matches!(&r, Response::SharesSet { rejected, .. }
            if rejected[0].reason == EntryRejection::PartUnit { region: 1, share_ppm: 300_000 }),
        "{r:?}"
    );
    assert_eq!(d.state.entries[&key("a")].shares_ppm, [PPM, 0, 0]);
    assert!(d.state.check_whole_shares().is_ok());
    // Half of it is one whole token: accepted.
    d.renew_all();
    assert_eq!(accepted(&set(&mut d, "a", &[500_000, 0, 0])), 1);
    d.renew_all();
    assert_eq!(accepted(&set(&mut d, "a", &[500_000, 500_000, 0])), 1);
}
