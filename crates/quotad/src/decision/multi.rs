//! Checks of several limits of one tenant at once: every named policy is decided in one store
//! call (one EVALSHA on Redis: the tenant's keys share one hash slot), and the cost is spent on
//! none of them unless every one admits it.
//!
//! Token buckets only, decided in this region at its enforced shares: a sliding-window policy,
//! or one whose checks this region forwards to a home region, is refused ([`MultiError`]), so
//! an all-or-nothing answer is never split over two stores. With the store out, the strictest
//! fail mode decides: one `closed` policy fails the check closed; otherwise the `local`
//! policies are decided together in process and the `open` ones admit unchecked.

use quota_core::bucket::{MAX_LIMITS_PER_CHECK, UT};
use quota_core::{Decision, FailMode, Policy, PolicyName, RegionId, TenantId};
use quota_store::{Limit, LimitCheck, MultiCheckRequest, Store, StoreError};

use crate::clock;
use crate::decision::{is_embedded, CheckError, Decider, Mode};
use crate::telemetry::Outcome;

/// One limit of a check of several: its policy and this limit's decision.
#[derive(Debug, Clone)]
pub struct LimitVerdict {
    pub name: PolicyName,
    pub policy: Policy,
    pub decision: Decision,
}

/// The decision of a check of several limits.
#[derive(Debug, Clone)]
pub struct MultiVerdict {
    /// The check's decision: [`Decision::all`] of the limits'.
    pub decision: Decision,
    /// Each limit, in the order the check named them.
    pub limits: Vec<LimitVerdict>,
    pub mode: Mode,
    pub decided_by: RegionId,
}

impl MultiVerdict {
    /// The policies that denied the check (none when it was admitted).
    pub fn violated(&self) -> impl Iterator<Item = &LimitVerdict> {
        self.limits.iter().filter(|l| !l.decision.allowed)
    }
}

/// Why a check of several limits was not decided.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MultiError {
    #[error(transparent)]
    Check(#[from] CheckError),
    /// The named policies cannot be decided together (the caller's request is at fault).
    #[error("{0}")]
    Unsupported(String),
}

impl Decider {
    /// Decides `cost` against every one of `names` of `tenant` at once, all or nothing.
    pub async fn check_all(
        &self,
        tenant: TenantId,
        names: Vec<PolicyName>,
        cost: u64,
    ) -> Result<MultiVerdict, MultiError> {
        let started = clock::monotonic();
        if names.is_empty() || names.len() as u64 > MAX_LIMITS_PER_CHECK {
            return Err(MultiError::Unsupported(format!(
                "name 1 to {MAX_LIMITS_PER_CHECK} policies"
            )));
        }
        let mut limits = Vec::with_capacity(names.len());
        let mut policies = Vec::with_capacity(names.len());
        {
            let view = self.view();
            for (i, name) in names.iter().enumerate() {
                if names[..i].contains(name) {
                    return Err(MultiError::Unsupported(format!(
                        "policy {:?} is named twice",
                        name.as_str()
                    )));
                }
                // The subject's own policy, else its plan's, as for one policy.
                let entry = view
                    .resolve(&tenant, name)
                    .ok_or(CheckError::UnknownPolicy)?
                    .entry;
                let (policy, _share, limit) = self.params_of(&view, entry);
                quota_core::mode::check_cost(&policy, cost, entry.grants.len())
                    .map_err(CheckError::from)?;
                if entry.home.as_ref().is_some_and(|h| *h != self.region) {
                    return Err(MultiError::Unsupported(format!(
                        "policy {:?} of this tenant is decided in its home region; check it alone",
                        name.as_str()
                    )));
                }
                if policy.mode == quota_core::policy::PolicyMode::Shadow {
                    return Err(MultiError::Unsupported(format!(
                        "policy {:?} is in shadow mode; check it alone",
                        name.as_str()
                    )));
                }
                match limit {
                    Limit::TokenBucket(_) => {}
                    Limit::SlidingWindow { .. } => {
                        return Err(MultiError::Unsupported(format!(
                            "policy {:?} is a sliding window; several policies at once are \
                             token buckets",
                            name.as_str()
                        )))
                    }
                    Limit::Concurrency { .. } => return Err(CheckError::TakenWithHolds.into()),
                }
                // As for one policy: a share here that cannot hold the cost at all is reduced
                // capacity for now, not a denial that could never end.
                if !super::check::holds(&limit, cost) && !self.breaker.is_open() {
                    return Err(MultiError::Check(CheckError::ReducedCapacity {
                        policy: name.clone(),
                        reason: "this region holds too little of the policy's budget for now",
                    }));
                }
                limits.push(LimitCheck {
                    bucket: quota_store::BucketRef {
                        tenant: tenant.clone(),
                        policy: name.clone(),
                        version: policy.version,
                    },
                    limit,
                });
                policies.push(policy);
            }
        }
        let req = MultiCheckRequest {
            limits,
            cost,
            now_ms: None,
        };
        let result = match self.ask_store_all(&req).await {
            Ok(Some(ds)) => Ok(self.multi_verdict(&names, policies, ds, Mode::Normal)),
            Ok(None) => self.fail_over_all(req, &names, policies).await,
            Err(e) => {
                tracing::warn!(
                    region = %self.region,
                    error = %e,
                    "The store refused a check of several policies; other buckets are unaffected."
                );
                Err(MultiError::Check(CheckError::ReducedCapacity {
                    policy: names[0].clone(),
                    reason: "the regional store refuses this policy's stored bucket",
                }))
            }
        };
        let outcome = match &result {
            Ok(v) if v.mode == Mode::DegradedOpen => Outcome::DegradedOpen,
            Ok(v) if v.mode == Mode::DegradedLocal => Outcome::DegradedLocal,
            Ok(v) if v.decision.allowed => Outcome::Allowed,
            Ok(_) => Outcome::Denied,
            Err(_) => Outcome::DegradedClosed,
        };
        let secs = started.elapsed().as_secs_f64();
        for name in &names {
            self.metrics.record(name, outcome, secs);
        }
        result
    }

    /// The verdict of `decisions` of the policies `names`, decided in this region.
    pub(super) fn multi_verdict(
        &self,
        names: &[PolicyName],
        policies: Vec<Policy>,
        decisions: Vec<Decision>,
        mode: Mode,
    ) -> MultiVerdict {
        let decision = Decision::all(decisions.iter().copied()).unwrap_or(Decision {
            allowed: true,
            remaining: 0,
            retry_after_ms: Some(0),
            reset_ms: Some(0),
        });
        MultiVerdict {
            decision,
            limits: names
                .iter()
                .zip(policies)
                .zip(decisions)
                .map(|((name, policy), decision)| LimitVerdict {
                    name: name.clone(),
                    policy,
                    decision,
                })
                .collect(),
            mode,
            decided_by: self.region.clone(),
        }
    }

    /// [`Decider::ask_store`] for several limits: through the breaker, a refusal of the
    /// request or its data never counted against it.
    async fn ask_store_all(
        &self,
        req: &MultiCheckRequest,
    ) -> Result<Option<Vec<Decision>>, StoreError> {
        if is_embedded(&self.store) {
            return match self.store.check_all(req).await {
                Ok(d) => Ok(Some(d)),
                Err(e) if !e.is_outage() => Err(e),
                Err(_) => Ok(None),
            };
        }
        self.call_store(clock::monotonic(), self.store.check_all(req))
            .await
    }

    /// The strictest fail mode of the policies, with the store unavailable.
    async fn fail_over_all(
        &self,
        req: MultiCheckRequest,
        names: &[PolicyName],
        policies: Vec<Policy>,
    ) -> Result<MultiVerdict, MultiError> {
        if let Some(i) = policies
            .iter()
            .position(|p| p.fail_mode == FailMode::Closed)
        {
            return Err(MultiError::Check(CheckError::ReducedCapacity {
                policy: names[i].clone(),
                reason: "the regional store is unavailable and this policy fails closed",
            }));
        }
        // The `local` limits together in process; the `open` ones admit unchecked.
        let local: Vec<LimitCheck> = req
            .limits
            .iter()
            .zip(&policies)
            .filter(|(_, p)| p.fail_mode == FailMode::Local)
            .map(|(l, _)| l.clone())
            .collect();
        let mode = if local.is_empty() {
            Mode::DegradedOpen
        } else {
            Mode::DegradedLocal
        };
        let mut local_decisions = if local.is_empty() {
            Vec::new()
        } else {
            let first = local[0].bucket.policy.clone();
            let in_process = MultiCheckRequest {
                limits: local,
                cost: req.cost,
                now_ms: None,
            };
            self.fallback
                .check_all(&in_process)
                .await
                .map_err(|_| CheckError::ReducedCapacity {
                    policy: first,
                    reason: "the regional store is unavailable",
                })?
        }
        .into_iter();
        let decisions: Vec<Decision> = req
            .limits
            .iter()
            .zip(&policies)
            .map(|(l, p)| match p.fail_mode {
                FailMode::Local => local_decisions.next().unwrap_or(Decision {
                    allowed: false,
                    remaining: 0,
                    retry_after_ms: None,
                    reset_ms: None,
                }),
                _ => Decision {
                    allowed: true,
                    remaining: match l.limit {
                        Limit::TokenBucket(p) => p.capacity_ut / UT,
                        Limit::SlidingWindow { limit, .. } | Limit::Concurrency { limit } => limit,
                    },
                    retry_after_ms: Some(0),
                    reset_ms: Some(0),
                },
            })
            .collect();
        Ok(self.multi_verdict(names, policies, decisions, mode))
    }
}
