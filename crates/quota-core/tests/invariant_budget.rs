//! Invariant: whatever commands arrive — nonsense shares, acknowledgements from the future,
//! clocks jumping both ways, duplicates, membership churn — `apply` never panics, never lets
//! the enforceable shares of a policy sum above `PPM`, answers duplicates with the original
//! response, and its state survives a postcard round trip (the Raft snapshot).
//!
//! Cases: `QUOTA_PROPTEST_CASES` (default 256).

mod common;

use common::{key, policy, region};
use proptest::prelude::*;
use quota_core::coordinator::{
    Command, CoordinatorState, HomeChange, Operation, RequestId, ShareEntry,
};
use quota_core::lease::LeaseConfig;
use quota_core::policy::Tier;
use quota_core::PPM;

fn cases() -> u32 {
    std::env::var("QUOTA_PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256)
}

fn home() -> impl Strategy<Value = HomeChange> {
    prop_oneof![
        4 => Just(HomeChange::Keep),
        1 => (0u8..6).prop_map(HomeChange::Auto),
        1 => Just(HomeChange::ClearAuto),
    ]
}

fn operation() -> impl Strategy<Value = Operation> {
    let k = (0usize..4).prop_map(|k| key(&format!("t{k}")));
    let r = (0usize..6).prop_map(region);
    prop_oneof![
        3 => (k.clone(), 0u32..=400_000, any::<bool>()).prop_map(|(key, floor, critical)| {
            let tier = if critical { Tier::Critical } else { Tier::Standard };
            Operation::PutPolicy { key, policy: policy(floor, tier) }
        }),
        1 => k.clone().prop_map(|key| Operation::DeletePolicy { key }),
        1 => (k.clone(), r.clone()).prop_map(|(key, home)| Operation::Pin { key, home }),
        1 => k.clone().prop_map(|key| Operation::Unpin { key }),
        1 => (k.clone(), r.clone()).prop_map(|(key, home)| Operation::PinTenant { tenant: key.tenant, home }),
        1 => k.clone().prop_map(|key| Operation::UnpinTenant { tenant: key.tenant }),
        6 => (
            0u64..4,
            prop::collection::vec(
                (k.clone(), prop::collection::vec(0u32..=PPM + 10, 0..6), home()),
                0..4,
            ),
        )
            .prop_map(|(membership, entries)| Operation::SetShares {
                membership,
                entries: entries
                    .into_iter()
                    .map(|(key, shares_ppm, home)| ShareEntry { key, shares_ppm, home })
                    .collect(),
            }),
        5 => (r.clone(), 0u64..30).prop_map(|(region, acked_epoch)| Operation::RenewLease { region, acked_epoch }),
        2 => (r.clone(), any::<bool>(), any::<bool>())
            .prop_map(|(region, reserves_floor, draining)| Operation::PutRegion { region, reserves_floor, draining }),
        1 => r.prop_map(|region| Operation::RemoveRegion { region }),
        1 => prop::collection::vec(k, 0..3).prop_map(|keys| Operation::Forget { keys }),
        1 => (0u64..100_000, 0u64..10_000).prop_map(|(lease_ms, drift_margin_ms)| {
            Operation::SetLeaseConfig { config: LeaseConfig { lease_ms, drift_margin_ms } }
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn enforceable_shares_never_exceed_the_budget(
        steps in prop::collection::vec((operation(), 0u64..60_000, any::<bool>(), 0u128..8), 1..120),
    ) {
        let mut state = CoordinatorState::default();
        let mut now = 0u64;
        for (n, (op, dt, back, id)) in steps.into_iter().enumerate() {
            // Time mostly moves on, sometimes a new leader's clock is behind.
            now = if back { now.saturating_sub(dt / 10) } else { now + dt };
            // Few distinct ids, so duplicates happen.
            let cmd = Command { request: RequestId(id * 1000 + (n as u128 % 3)), now_ms: now, op };
            let before = state.clone();
            let r = state.apply(&cmd);
            if let Err(e) = state.check_invariant() {
                return Err(TestCaseError::fail(format!("step {n}: {cmd:?} → {r:?}: {e}")));
            }
            if before.recent.iter().any(|(id, _)| *id == cmd.request) {
                prop_assert_eq!(&state, &before, "a duplicate changed the state");
            }
            let mut again = state.clone();
            prop_assert_eq!(again.apply(&cmd), r, "a duplicate got another response");
        }
        let bytes = postcard::to_stdvec(&state).unwrap();
        let back: CoordinatorState = postcard::from_bytes(&bytes).unwrap();
        prop_assert_eq!(back, state);
    }
}
