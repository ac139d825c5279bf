//! Tokens given back to a bucket of this region: a refund of work that turned out cheaper, or
//! not done (Envoy's `is_negative_hits`). Never above the capacity in force, so a refund can
//! make a bucket full again but never hold more than its share.
//!
//! Faults: the store call behind the breaker; the Redis store makes each refund exactly once
//! (a marker per call, `refund.lua`), so a retried connection never credits twice. A refund
//! the store could not take is lost (reported, not retried): giving back less is safe.

use quota_core::{Algorithm, PolicyName, TenantId};
use quota_store::{BucketRef, Store as _};

use super::{CheckError, Decider};
use crate::clock;

/// What became of a refund.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refunded {
    /// Given back: whole tokens the bucket holds now.
    Applied { remaining: u64 },
    /// The bucket has no state: it is full, there is nothing to give back to.
    Full,
    /// The tenant's budget lives in another region: nothing given back here.
    Elsewhere,
    /// The store did not answer (or the breaker is open): nothing given back.
    Unavailable,
}

impl Refunded {
    /// The metric label of the outcome.
    pub fn label(self) -> &'static str {
        match self {
            Self::Applied { .. } => "applied",
            Self::Full => "full",
            Self::Elsewhere => "elsewhere",
            Self::Unavailable => "unavailable",
        }
    }
}

impl Decider {
    /// Gives `tokens` back to `tenant`'s `policy` bucket in this region. A sliding window has
    /// nothing to give back to (its log records what was admitted): refused like an unknown
    /// policy's cost.
    pub async fn refund(
        &self,
        tenant: &TenantId,
        policy: &PolicyName,
        tokens: u64,
    ) -> Result<Refunded, CheckError> {
        let out = self.refund_here(tenant, policy, tokens).await;
        if let Ok(r) = &out {
            let region = self.region.as_str().to_string();
            metrics::counter!(crate::telemetry::REFUNDS_TOTAL, "outcome" => r.label(), "region" => region)
                .increment(1);
        }
        out
    }

    async fn refund_here(
        &self,
        tenant: &TenantId,
        policy: &PolicyName,
        tokens: u64,
    ) -> Result<Refunded, CheckError> {
        if tokens == 0 {
            return Err(CheckError::Cost(quota_core::policy::CostError::Zero));
        }
        if self.home_elsewhere(tenant, policy, false).is_some() {
            return Ok(Refunded::Elsewhere);
        }
        let p = {
            let view = self.view();
            let entry = view
                .resolve(tenant, policy)
                .ok_or(CheckError::UnknownPolicy)?
                .entry;
            entry.policy.clone()
        };
        if p.algorithm != Algorithm::TokenBucket {
            return Err(CheckError::UnknownPolicy);
        }
        let bucket = BucketRef {
            tenant: tenant.clone(),
            policy: policy.clone(),
            version: p.version,
        };
        // At most the burst: more could only fill the bucket, and a refund's size is not
        // otherwise bounded by anything the caller was admitted.
        let tokens = tokens.min(p.burst);
        let t0 = clock::monotonic();
        let answer = self
            .call_store(t0, self.store().refund(&bucket, tokens, None))
            .await;
        let out = match answer {
            Ok(Some(Some(remaining))) => Refunded::Applied { remaining },
            Ok(Some(None)) => Refunded::Full,
            Ok(None) => Refunded::Unavailable,
            Err(e) => {
                tracing::warn!(region = %self.region, policy = %policy, error = %e,
                    "The store refused a refund of this bucket.");
                Refunded::Unavailable
            }
        };
        if matches!(out, Refunded::Applied { .. }) {
            self.denials.forget(&bucket);
        }
        Ok(out)
    }
}
