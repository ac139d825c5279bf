//! What a decision answers: a [`Verdict`] (a denial is one, not an error), the [`Mode`] it was
//! reached in, or a [`CheckError`] when no decision was made; and how a verdict is counted
//! (a shadow policy's denial admitted, the outcome the decision metrics record).

use quota_core::policy::CostError;
use quota_core::{Decision, Policy, PolicyMode, PolicyName, RegionId};
use serde::{Deserialize, Serialize};

use super::Decider;
use crate::telemetry::Outcome;

/// How a decision was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// By this region's store at its enforced share.
    Normal,
    /// By the in-process bucket: the regional store is down and the policy fails local.
    DegradedLocal,
    /// Admitted unchecked: the regional store is down and the policy fails open.
    DegradedOpen,
    /// By the pinned tenant's home region.
    Forwarded,
    /// Home region unreachable: decided here at this region's floor.
    HomeUnreachableFloor,
}

impl Mode {
    /// The name it serializes to.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Normal => "normal",
            Mode::DegradedLocal => "degraded_local",
            Mode::DegradedOpen => "degraded_open",
            Mode::Forwarded => "forwarded",
            Mode::HomeUnreachableFloor => "home_unreachable_floor",
        }
    }
}

/// A decision with what a response needs to describe it.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub decision: Decision,
    pub policy: Policy,
    pub mode: Mode,
    /// The region whose bucket decided.
    pub decided_by: RegionId,
    /// A shadow policy's denial, admitted: the decision says allowed, this says it would
    /// have been denied.
    pub shadow_denied: bool,
}

impl Verdict {
    /// Applies a shadow policy's rule: a denial is admitted and marked.
    fn shadowed(mut self) -> Self {
        if self.policy.mode == PolicyMode::Shadow && !self.decision.allowed {
            self.decision.allowed = true;
            self.decision.retry_after_ms = Some(0);
            self.shadow_denied = true;
        }
        self
    }
}

/// Why no decision was made. A denial is a [`Verdict`], not one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    #[error("no such policy for this tenant")]
    UnknownPolicy,
    #[error(transparent)]
    Cost(#[from] CostError),
    /// The store is down and the policy fails closed, or the home region is unreachable and
    /// the policy allows no local decision.
    #[error("temporarily reduced capacity: {reason}")]
    ReducedCapacity {
        policy: PolicyName,
        reason: &'static str,
    },
    /// A concurrency limit counts holds in flight: a slot is taken with a hold and given back
    /// by its release, never checked.
    #[error(
        "a concurrency limit is taken with a hold (POST /v1/holds) and given back by its release"
    )]
    TakenWithHolds,
}

/// What a check's result counts as in the decision metrics.
pub(super) fn outcome_of(result: &Result<Verdict, CheckError>) -> Outcome {
    match result {
        Ok(v) if v.mode == Mode::Forwarded => Outcome::Forwarded,
        Ok(v) if v.mode == Mode::DegradedOpen => Outcome::DegradedOpen,
        Ok(v) if v.mode == Mode::DegradedLocal => Outcome::DegradedLocal,
        Ok(v) if v.decision.allowed => Outcome::Allowed,
        Ok(_) => Outcome::Denied,
        Err(_) => Outcome::DegradedClosed,
    }
}

impl Decider {
    /// A verdict this region decided.
    pub(super) fn verdict_here(&self, decision: Decision, policy: Policy, mode: Mode) -> Verdict {
        Verdict {
            decision,
            policy,
            mode,
            decided_by: self.region.clone(),
            shadow_denied: false,
        }
    }

    /// Applies a shadow policy's rule to a verdict and counts a shadow denial.
    pub(super) fn count_shadow(&self, policy: &PolicyName, v: Verdict) -> Verdict {
        let v = v.shadowed();
        if v.shadow_denied && v.mode != Mode::Forwarded {
            // The home region that decided a forwarded check counted it.
            self.metrics.record_shadow_denial(policy);
        }
        v
    }
}
