//! Charges for work already done (costs known after the fact, such as LLM tokens): applied
//! even past the tokens left, into the policy's `debt_limit` below empty, never denied. Beyond
//! the debt limit a charge is clamped, and what was clamped is answered and counted, never
//! dropped silently. While the bucket is in debt its checks are denied, with a retry time that
//! covers the repayment.
//!
//! Faults: a retried charge (the caller's retry after a lost answer, a broken connection) is
//! applied once when it names itself with an id (the store keeps a marker per id for
//! [`quota_core::bounds::ONCE_KEY_MS`]); the store unreachable applies nothing and says so,
//! for the caller to retry with the same id. No charge is decided in process: a charge the
//! store never saw must not be assumed spent or lost.

use quota_core::bucket::{ChargeOutcome, UT};
use quota_core::{Algorithm, PolicyName, RegionId, TenantId};
use quota_store::{BucketRef, ChargeRequest, Store as _, StoreError};

use super::{CheckError, Decider};
use crate::clock;
use crate::telemetry;

/// What became of a charge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Charged {
    /// Applied by region `by` (the clamped part included in the outcome).
    Applied {
        outcome: ChargeOutcome,
        by: RegionId,
    },
    /// The budget lives in another region (the tenant is pinned there), which did not
    /// answer: nothing applied.
    HomeUnreachable(RegionId),
    /// A sliding window: it records admissions, it has no level to charge.
    NotTokenBucket,
    /// The id names an earlier charge of another cost: nothing applied.
    IdReused,
    /// The store did not answer (or the breaker is open): nothing applied.
    Unavailable,
}

/// A home region's answer to a forwarded charge (the API's charge response).
#[derive(Debug, serde::Deserialize)]
struct ForwardedCharge {
    applied: u64,
    clamped: u64,
    remaining: u64,
    debt: u64,
    retry_after_ms: u64,
    reset_ms: u64,
}

impl Decider {
    /// Charges `cost` whole tokens of work already done to `tenant`'s `policy` bucket, down to
    /// the policy's debt limit below empty: in this region, or in its home when the tenant is
    /// pinned elsewhere (unless `forwarded` here). `id` makes a retry apply once.
    pub async fn charge(
        &self,
        tenant: &TenantId,
        policy: &PolicyName,
        cost: u64,
        id: Option<String>,
        forwarded: bool,
    ) -> Result<Charged, CheckError> {
        if cost == 0 {
            return Err(CheckError::Cost(quota_core::policy::CostError::Zero));
        }
        if let Some(home) = self.home_elsewhere(tenant, policy, forwarded) {
            let out = self.charge_at_home(&home, tenant, policy, cost, id).await;
            count(&self.region, &out);
            return Ok(out);
        }
        let (p, share, _) = self
            .params_for(&self.view(), tenant, policy)
            .ok_or(CheckError::UnknownPolicy)?;
        if p.algorithm != Algorithm::TokenBucket {
            return Ok(Charged::NotTokenBucket);
        }
        let bucket = BucketRef {
            tenant: tenant.clone(),
            policy: policy.clone(),
            version: p.version,
        };
        let req = ChargeRequest {
            bucket,
            params: quota_core::bucket::BucketParams::for_share(&p, share),
            cost: cost.min(quota_store::MAX_COST),
            debt_limit_ut: p.debt_limit.saturating_mul(UT),
            now_ms: None,
            id,
        };
        let t0 = clock::monotonic();
        let out = match self.call_store(t0, self.store().charge(&req)).await {
            Ok(Some(outcome)) => Charged::Applied {
                outcome,
                by: self.region.clone(),
            },
            Ok(None) => Charged::Unavailable,
            Err(StoreError::Rejected { reason }) if reason.contains("charge id") => {
                Charged::IdReused
            }
            Err(e) => {
                tracing::warn!(region = %self.region, policy = %policy, error = %e,
                    "The store refused a charge of this bucket.");
                Charged::Unavailable
            }
        };
        count(&self.region, &out);
        Ok(out)
    }
}

impl Decider {
    /// The charge sent to `home`'s daemons (one request, tried at each in turn); the id goes
    /// with it, so a retry there applies once too.
    async fn charge_at_home(
        &self,
        home: &RegionId,
        tenant: &TenantId,
        policy: &PolicyName,
        cost: u64,
        id: Option<String>,
    ) -> Charged {
        let mut body = serde_json::json!({
            "tenant": tenant.as_str(),
            "policy": policy.as_str(),
            "cost": cost,
        });
        if let Some(id) = id {
            body["id"] = serde_json::Value::String(id);
        }
        let answer = self.relay(home, CHARGES_PATH, &body).await;
        match answer.as_ref().map(|r| r.status) {
            // The home refused it (an id of another cost, a window): so does this region.
            Some(409) => {
                return match answer.and_then(|r| r.body["detail"].as_str().map(str::to_string)) {
                    Some(d) if d.contains("sliding window") => Charged::NotTokenBucket,
                    _ => Charged::IdReused,
                }
            }
            Some(200) => {}
            _ => {
                self.forward_failures.increment(1);
                return Charged::HomeUnreachable(home.clone());
            }
        }
        match answer.and_then(|r| serde_json::from_value::<ForwardedCharge>(r.body).ok()) {
            Some(a) => Charged::Applied {
                outcome: ChargeOutcome {
                    applied: a.applied,
                    clamped: a.clamped,
                    remaining: a.remaining,
                    debt: a.debt,
                    retry_after_ms: Some(a.retry_after_ms),
                    reset_ms: Some(a.reset_ms),
                },
                by: home.clone(),
            },
            None => {
                self.forward_failures.increment(1);
                Charged::HomeUnreachable(home.clone())
            }
        }
    }
}

/// The route charges are taken on (forwarded ones too).
pub const CHARGES_PATH: &str = "/v1/charges";

/// Registers the charge and refund series of `region` at 0, so they are exported (and graphed)
/// before the first charge.
pub fn register_metrics(region: &RegionId) {
    let region = region.as_str().to_string();
    metrics::counter!(telemetry::CHARGES_TOTAL, "outcome" => "applied", "region" => region.clone())
        .increment(0);
    metrics::counter!(telemetry::REFUNDS_TOTAL, "outcome" => "applied", "region" => region.clone())
        .increment(0);
    metrics::counter!(telemetry::CHARGE_CLAMPED_TOKENS_TOTAL, "region" => region).increment(0);
}

/// Counts a charge's outcome, and the tokens its debt limit held back.
fn count(region: &RegionId, out: &Charged) {
    let outcome = match out {
        Charged::Applied { outcome, .. } if outcome.clamped > 0 => "clamped",
        Charged::Applied { .. } => "applied",
        Charged::HomeUnreachable(_) => "home_unreachable",
        Charged::NotTokenBucket | Charged::IdReused => "refused",
        Charged::Unavailable => "unavailable",
    };
    let region = region.as_str().to_string();
    metrics::counter!(telemetry::CHARGES_TOTAL, "outcome" => outcome, "region" => region.clone())
        .increment(1);
    if let Charged::Applied { outcome, .. } = out {
        if outcome.clamped > 0 {
            metrics::counter!(telemetry::CHARGE_CLAMPED_TOKENS_TOTAL, "region" => region)
                .increment(outcome.clamped);
        }
    }
}
