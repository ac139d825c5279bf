//! One check, end to end: resolve the subject's policy, check the cost, then route it: to the
//! tenant's home when it is pinned elsewhere, to the region granted the most when this
//! region's share cannot hold the cost, else decided here. Counted in the decision metrics.

use quota_core::mode;
use quota_core::share::limit_for_share;
use quota_core::{Algorithm, PolicyName, RegionId, TenantId};
use quota_store::{BucketRef, Limit};

use super::verdict::outcome_of;
use super::{CheckError, Decider, Verdict};
use crate::clock;
use crate::coordination::PolicyEntry;

/// Whether a bucket at `limit` can ever admit `cost`.
pub(super) fn holds(limit: &Limit, cost: u64) -> bool {
    match *limit {
        Limit::TokenBucket(p) => p.capacity_ut >= cost.saturating_mul(quota_core::bucket::UT),
        Limit::SlidingWindow { limit, .. } | Limit::Concurrency { limit } => limit >= cost,
    }
}

/// The other region granted the largest share of `entry` (the first by id on a tie), if its
/// share can hold `cost`.
fn richest_elsewhere(entry: &PolicyEntry, here: &RegionId, cost: u64) -> Option<RegionId> {
    let (region, grant) = entry
        .grants
        .iter()
        .filter(|(r, _)| *r != here)
        .max_by_key(|(r, g)| (g.share_ppm, std::cmp::Reverse(*r)))?;
    let limit: Limit = limit_for_share(&entry.policy, grant.share_ppm).into();
    holds(&limit, cost).then(|| region.clone())
}

impl Decider {
    /// Decides one check. `forwarded` is true when another region sent it here.
    pub async fn check(
        &self,
        tenant: TenantId,
        policy_name: PolicyName,
        cost: u64,
        forwarded: bool,
    ) -> Result<Verdict, CheckError> {
        let started = clock::monotonic();
        // Taken before the view is read: a parameter write after this point (of a share newer
        // than the limit read here) keeps this check's answer out of the denial cache.
        let ticket = self.denials.ticket(started);
        let view = self.view();
        // The subject's own policy, else its plan's: either way its own bucket, at the
        // version and share of the entry it resolved to.
        let entry = view
            .resolve(&tenant, &policy_name)
            .ok_or(CheckError::UnknownPolicy)?
            .entry;
        let (policy, _share, limit) = self.params_of(&view, entry);
        if policy.algorithm == Algorithm::Concurrency {
            return Err(CheckError::TakenWithHolds);
        }
        mode::check_cost(&policy, cost, entry.grants.len())?;
        // While a home is still being granted its share (it holds less than the cost), the
        // region granted the most decides.
        let home =
            entry
                .home
                .as_ref()
                .filter(|h| **h != self.region)
                .map(|h| match entry.grants.get(h) {
                    Some(g) if holds(&limit_for_share(&entry.policy, g.share_ppm).into(), cost) => {
                        h.clone()
                    }
                    _ => richest_elsewhere(entry, &self.region, cost).unwrap_or_else(|| h.clone()),
                });
        // A share here that cannot hold the cost at all (none, or less than the cost) would
        // answer "never": the region granted the most decides instead. Not while this
        // region's store is out: then the policy's fail mode decides, as the operator chose.
        let richer = match (&home, forwarded) {
            (None, false) if !holds(&limit, cost) && !self.breaker.is_open() => {
                richest_elsewhere(entry, &self.region, cost)
            }
            _ => None,
        };
        drop(view);
        let bucket = BucketRef {
            tenant,
            policy: policy_name.clone(),
            version: policy.version,
        };
        let result = match (home, richer) {
            (Some(home), _) if !forwarded => self.forward(&home, bucket, cost, policy).await,
            (_, Some(there)) => self.forward_richer(&there, bucket, cost, policy).await,
            // No region that could hold the cost is there to ask (this one's lease ran out
            // with no floor, or it was sent a check it cannot hold): a bucket here would
            // answer "never", yet the cost fits the policy, so this is reduced capacity for
            // now. With the store out, the policy's fail mode decides as usual.
            _ if !holds(&limit, cost) && !self.breaker.is_open() => {
                Err(CheckError::ReducedCapacity {
                    policy: bucket.policy,
                    reason: "this region holds too little of the policy's budget for now",
                })
            }
            _ => self.decide_here(bucket, limit, cost, policy, ticket).await,
        }
        .map(|v| self.count_shadow(&policy_name, v));
        self.metrics.record(
            &policy_name,
            outcome_of(&result),
            started.elapsed().as_secs_f64(),
        );
        result
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use quota_core::policy::CostError;
    use serde_json::json;

    use super::*;
    use crate::decision::tests::{decider_of, entry, ids};

    /// A cost the other regions' floors leave no region able to hold is refused up front, not
    /// answered "never": floors of 0.3 in three regions leave at most 4 of a burst of 10.
    #[tokio::test]
    async fn a_cost_beyond_what_floors_leave_is_refused() {
        let grants = [
            ("a", 400_000, 300_000),
            ("b", 300_000, 300_000),
            ("c", 300_000, 300_000),
        ];
        let policy = json!({"limit": 10, "window_ms": 1000, "floor": 0.3});
        let d = decider_of(entry(policy, &grants, None), u64::MAX, HashMap::new());
        let (t, w) = ids("t", "w");
        let refused = d.check(t.clone(), w.clone(), 5, false).await;
        assert_eq!(
            refused.unwrap_err(),
            CheckError::Cost(CostError::BeyondFloors {
                cost: 5,
                largest: 4
            })
        );
        let admitted = d.check(t, w, 4, false).await.unwrap();
        assert!(admitted.decision.allowed, "{admitted:?}");
    }

    /// A region whose lease ran out with no floor holds nothing, and no other region holds
    /// the budget (the home is this region): a check gets reduced capacity, not "never".
    #[tokio::test]
    async fn a_lapsed_region_without_a_floor_answers_reduced_capacity() {
        let grants = [("a", 1_000_000, 0), ("b", 0, 0)];
        let policy = json!({"limit": 10, "window_ms": 1000});
        let d = decider_of(entry(policy, &grants, Some("a")), 0, HashMap::new());
        let (t, w) = ids("t", "w");
        let r = d.check(t, w, 1, false).await;
        assert!(
            matches!(r, Err(CheckError::ReducedCapacity { .. })),
            "{r:?}"
        );
    }
}
