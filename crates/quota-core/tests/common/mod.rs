//! Shared fixtures for the coordinator tests: ids, policies, a command builder.

#![allow(dead_code)]

use quota_core::coordinator::{
    Command, CoordinatorState, Operation, PolicyKey, RequestId, Response,
};
use quota_core::policy::{Algorithm, FailMode, Policy, Tier};
use quota_core::{PolicyName, RegionId, TenantId};

/// The policy key of tenant `t`, policy `writes`.
pub fn key(t: &str) -> PolicyKey {
    PolicyKey::new(
        TenantId::new(t).unwrap(),
        PolicyName::new("writes").unwrap(),
    )
}

/// Region id `r<i>`.
pub fn region(i: usize) -> RegionId {
    RegionId::new(format!("r{i}")).unwrap()
}

/// 1000 tokens per second, floor as given.
pub fn policy(floor_ppm: u32, tier: Tier) -> Policy {
    Policy {
        limit: 60_000,
        window_ms: 60_000,
        burst: 60_000,
        version: 0,
        tier,
        fail_mode: FailMode::Local,
        floor_ppm,
        algorithm: Algorithm::TokenBucket,
        mode: quota_core::PolicyMode::Enforcing,
        replaces: None,
        debt_limit: 0,
        after_the_fact: false,
    }
}

/// Builds commands with fresh request ids and a caller-driven clock.
#[derive(Debug, Default)]
pub struct Driver {
    pub state: CoordinatorState,
    pub next_id: u128,
    pub now_ms: u64,
}

impl Driver {
    /// A coordinator with `n` floor-reserving regions.
    pub fn with_regions(n: usize) -> Self {
        let mut d = Self::default();
        for i in 0..n {
            let r = d.op(Operation::PutRegion {
                region: region(i),
                reserves_floor: true,
                draining: false,
            });
            assert!(matches!(r, Response::RegionStored { .. }), "{r:?}");
        }
        d
    }

    /// A command with the next request id at the driver's time.
    pub fn command(&mut self, op: Operation) -> Command {
        self.next_id += 1;
        Command {
            request: RequestId(self.next_id),
            now_ms: self.now_ms,
            op,
        }
    }

    /// Applies an operation and checks the safety invariant afterwards.
    pub fn op(&mut self, op: Operation) -> Response {
        let cmd = self.command(op);
        let r = self.state.apply(&cmd);
        self.state.check_invariant().unwrap();
        r
    }

    /// Every region renews its lease, acknowledging the current epoch.
    pub fn renew_all(&mut self) {
        let epoch = self.state.epoch;
        let ids: Vec<RegionId> = self
            .state
            .regions
            .iter()
            .flatten()
            .map(|r| r.id.clone())
            .collect();
        for id in ids {
            let r = self.op(Operation::RenewLease {
                region: id,
                acked_epoch: epoch,
            });
            assert!(matches!(r, Response::LeaseRenewed { .. }), "{r:?}");
        }
    }
}
