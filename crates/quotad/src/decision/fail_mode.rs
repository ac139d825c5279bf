//! The policy's fail mode while this region's store is out: decide in process at this
//! region's share (`local`, continuing each bucket from Redis's last answer and charging what
//! it admits back to Redis, [`super::outage`]), admit unchecked (`open`) or refuse with reduced
//! capacity (`closed`). Deciding in process is also how a check whose home is unreachable gets
//! this region's floor.

use quota_core::{Decision, FailMode, Policy};
use quota_store::{CheckRequest, Limit, Store};

use super::{CheckError, Decider, Mode, Verdict};

impl Decider {
    /// Decides in process, at this region's floor, when the tenant's home region cannot; a
    /// failure there is reduced capacity (503), never an allow.
    pub(super) async fn decide_in_process(
        &self,
        req: &CheckRequest,
        reason: &'static str,
    ) -> Result<Decision, CheckError> {
        self.home_floor
            .check(req)
            .await
            .map_err(|_| CheckError::ReducedCapacity {
                policy: req.bucket.policy.clone(),
                reason,
            })
    }

    /// The policy's fail mode, with the store unavailable.
    pub(super) async fn fail_over(
        &self,
        req: CheckRequest,
        policy: Policy,
    ) -> Result<Verdict, CheckError> {
        match policy.fail_mode {
            FailMode::Local => {
                let decision =
                    self.fallback
                        .check(&req)
                        .await
                        .map_err(|_| CheckError::ReducedCapacity {
                            policy: req.bucket.policy.clone(),
                            reason: "the regional store is unavailable",
                        })?;
                if decision.allowed && req.cost > 0 {
                    // Owed to Redis: charged once the breaker closes, if no check of the
                    // bucket has charged it before.
                    self.outage.settle_when_closed(&self.store, &self.breaker);
                }
                Ok(self.verdict_here(decision, policy, Mode::DegradedLocal))
            }
            FailMode::Open => {
                let decision = Decision {
                    allowed: true,
                    remaining: match req.limit {
                        Limit::TokenBucket(p) => p.capacity_ut / quota_core::bucket::UT,
                        Limit::SlidingWindow { limit, .. } | Limit::Concurrency { limit } => limit,
                    },
                    retry_after_ms: Some(0),
                    reset_ms: Some(0),
                };
                Ok(self.verdict_here(decision, policy, Mode::DegradedOpen))
            }
            FailMode::Closed => Err(CheckError::ReducedCapacity {
                policy: req.bucket.policy,
                reason: "the regional store is unavailable and this policy fails closed",
            }),
        }
    }
}
