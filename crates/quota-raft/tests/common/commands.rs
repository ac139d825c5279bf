//! Commands for tests and benchmarks, built through quota-core's public API.

#![allow(dead_code)]

use quota_core::coordinator::{Command, HomeChange, Operation, PolicyKey, RequestId, ShareEntry};
use quota_core::{CoordinatorState, PolicyName, PolicySpec, RegionId, TenantId};

/// The tenant named by `n`.
pub fn tenant(n: u64) -> TenantId {
    TenantId::new(format!("t{n}")).unwrap()
}

/// The policy key of tenant `n`.
pub fn key(n: u64) -> PolicyKey {
    PolicyKey::new(tenant(n), PolicyName::new("api").unwrap())
}

/// `PutPolicy` for tenant `n` with `limit` per minute; `request` makes it idempotent.
pub fn put_policy(request: u128, n: u64, limit: u64) -> Command {
    let policy = PolicySpec {
        limit: limit as f64,
        window_ms: 60_000.0,
        ..Default::default()
    }
    .validate()
    .unwrap();
    Command {
        request: RequestId(request),
        now_ms: 1_000 + request as u64,
        op: Operation::PutPolicy {
            key: key(n),
            policy,
        },
    }
}

/// `PutRegion` adding region `name`.
pub fn put_region(request: u128, name: &str) -> Command {
    Command {
        request: RequestId(request),
        now_ms: 1_000,
        op: Operation::PutRegion {
            region: RegionId::new(name).unwrap(),
            reserves_floor: true,
            draining: false,
        },
    }
}

/// `RenewLease` for region `name`, acknowledging epoch `acked_epoch`.
pub fn renew_lease(request: u128, name: &str, acked_epoch: u64) -> Command {
    Command {
        request: RequestId(request),
        now_ms: 1_000 + request as u64,
        op: Operation::RenewLease {
            region: RegionId::new(name).unwrap(),
            acked_epoch,
        },
    }
}

/// The limit stored for tenant `n`, if any.
pub fn limit_of(state: &CoordinatorState, n: u64) -> Option<u64> {
    state.entries.get(&key(n)).map(|e| e.policy.limit)
}

/// `SetShares` for tenants `from..to`, giving each of `regions` slots the given shares.
pub fn set_shares(request: u128, membership: u64, from: u64, to: u64, shares: &[u32]) -> Command {
    let entries = (from..to)
        .map(|n| ShareEntry {
            key: key(n),
            shares_ppm: shares.to_vec(),
            home: HomeChange::Keep,
        })
        .collect();
    Command {
        request: RequestId(request),
        now_ms: 2_000 + request as u64,
        op: Operation::SetShares {
            membership,
            entries,
        },
    }
}
