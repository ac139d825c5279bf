//! Holds: an estimated cost reserved now, settled later with the actual cost (LLM tokens known
//! when a response ends), or released. A hold of a concurrency limit is one slot, given back
//! by its release or at its TTL.
//!
//! A hold lives in the store of the region that made it, under its tenant's keys: the id
//! names that region and tenant ([`HoldId`]), so any daemon can route a settle or a release
//! there. Holds of a budget that lives in a home region are made there (the whole request is
//! relayed, and its answer passed back as the home gave it).
//!
//! Faults: the store applies a hold, a settle and a release once however often it runs them
//! (a retried call, the caller's retry of a lost answer). A hold retried with the caller's
//! `id` is the same hold; without one a retry is a second hold, whose estimate stays spent
//! until settled or released. A store that does not answer applies nothing here and says so;
//! a hold is never decided in process, since a settle must find it.

use quota_core::bucket::{MAX_LIMITS_PER_CHECK, UT};
use quota_core::policy::{Algorithm, PolicyMode, MAX_HOLD_TTL_MS};
use quota_core::{PolicyName, RegionId, TenantId};
use quota_store::{
    BucketRef, HoldLimit, HoldOutcome, HoldRequest, ReleaseRequest, SettleRequest, Settled, Store,
    StoreError,
};

use super::multi::LimitVerdict;
use super::{is_embedded, CheckError, Decider, Mode};
use crate::clock;
use crate::telemetry;

/// The route holds are made on (relayed ones too).
pub const HOLDS_PATH: &str = "/v1/holds";

/// How long a hold of a token budget lives unsettled when the request names no `ttl_ms`.
pub const DEFAULT_HOLD_TTL_MS: u64 = 60_000;

/// The longest key a caller may name a hold by (`[A-Za-z0-9_-]`).
pub const MAX_HOLD_KEY_LEN: usize = 64;

/// Which hold: the region whose store holds it, its tenant, and its key there.
/// Written `<region>.<tenant>.<key>`: none of the three contains a dot.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HoldId {
    pub region: RegionId,
    pub tenant: TenantId,
    pub key: String,
}

impl HoldId {
    /// Reads an id as [`HoldId`]'s `Display` writes it; the error says what is wrong.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut parts = s.splitn(3, '.');
        let (Some(region), Some(tenant), Some(key)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err("is not a hold id (<region>.<tenant>.<key>)".into());
        };
        let region = RegionId::new(region).map_err(|e| format!("names no region: {e}"))?;
        let tenant = TenantId::new(tenant).map_err(|e| format!("names no tenant: {e}"))?;
        check_key(key)?;
        Ok(Self {
            region,
            tenant,
            key: key.to_string(),
        })
    }
}

/// The id as the caller sends it. It names the tenant: answer it to the caller, never log it
/// (a `TenantId` logs redacted).
impl std::fmt::Display for HoldId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}.{}.{}",
            self.region.as_str(),
            self.tenant.as_str(),
            self.key
        )
    }
}

/// A caller's key for a hold: 1 to [`MAX_HOLD_KEY_LEN`] of `[A-Za-z0-9_-]`.
pub fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty()
        || key.len() > MAX_HOLD_KEY_LEN
        || !key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(format!(
            "a hold key is 1 to {MAX_HOLD_KEY_LEN} characters of [A-Za-z0-9_-]"
        ));
    }
    Ok(())
}

/// A hold to make.
#[derive(Debug, Clone)]
pub struct HoldAsk {
    pub tenant: TenantId,
    /// 1 to [`MAX_LIMITS_PER_CHECK`] token budgets of the tenant, held all or nothing; or one
    /// concurrency limit.
    pub policies: Vec<PolicyName>,
    /// The estimate in whole tokens (1 for a concurrency limit).
    pub cost: u64,
    /// `None`: [`DEFAULT_HOLD_TTL_MS`], or a concurrency limit's `window_ms`.
    pub ttl_ms: Option<u64>,
    /// The caller's key, so a retry is the same hold; `None`: a random one.
    pub key: Option<String>,
}

/// A hold decided in this region.
#[derive(Debug, Clone)]
pub struct HoldVerdict {
    pub id: HoldId,
    /// Every limit admitted the estimate and the hold stands.
    pub held: bool,
    pub ttl_ms: u64,
    /// Each limit's decision, in the order named.
    pub limits: Vec<LimitVerdict>,
    /// The same hold was made before under this key: nothing changed.
    pub replayed: bool,
}

/// Another region's answer, passed on as it gave it.
#[derive(Debug, Clone)]
pub struct Relayed {
    pub status: u16,
    pub body: serde_json::Value,
}

/// What became of a hold request.
#[derive(Debug, Clone)]
pub enum Held {
    Decided(HoldVerdict),
    Relayed(Relayed),
    /// The budget lives in another region, which did not answer: nothing held.
    HomeUnreachable(RegionId),
    /// The store did not answer (or the breaker is open): nothing held.
    Unavailable,
}

/// Why a hold, settle or release was refused before anything changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HoldError {
    #[error(transparent)]
    Check(#[from] CheckError),
    /// A field of the request is at fault.
    #[error("{field}: {message}")]
    Field {
        field: &'static str,
        message: String,
    },
    /// The request is well formed but cannot be held (a sliding window, limits of several
    /// regions, a key naming another hold).
    #[error("{0}")]
    Conflict(String),
}

fn field(field: &'static str, message: impl Into<String>) -> HoldError {
    HoldError::Field {
        field,
        message: message.into(),
    }
}

/// What became of a settle or a release.
#[derive(Debug, Clone)]
pub enum Settlement {
    /// The store's answer, here.
    Here(Settled),
    Relayed(Relayed),
    /// The hold's region did not answer: nothing changed.
    RegionUnreachable(RegionId),
    /// The store did not answer: nothing changed; retrying is safe.
    Unavailable,
}

impl Decider {
    /// Holds `ask.cost` on every named policy of the tenant at once, all or nothing: here, or
    /// in the home region the budgets live in (unless `forwarded` here).
    pub async fn hold(&self, ask: HoldAsk, forwarded: bool) -> Result<Held, HoldError> {
        let n = ask.policies.len();
        if n == 0 || n as u64 > MAX_LIMITS_PER_CHECK {
            return Err(field(
                "policies",
                format!("name 1 to {MAX_LIMITS_PER_CHECK} policies"),
            ));
        }
        if let Some(key) = &ask.key {
            check_key(key).map_err(|e| field("id", e))?;
        }
        let mut limits = Vec::with_capacity(n);
        let mut policies = Vec::with_capacity(n);
        let mut homes = Vec::new();
        let mut default_ttl = DEFAULT_HOLD_TTL_MS;
        let mut longest_ttl = MAX_HOLD_TTL_MS;
        {
            let view = self.view();
            for (i, name) in ask.policies.iter().enumerate() {
                if ask.policies[..i].contains(name) {
                    return Err(field(
                        "policies",
                        format!("policy {:?} is named twice", name.as_str()),
                    ));
                }
                let entry = view
                    .resolve(&ask.tenant, name)
                    .ok_or(CheckError::UnknownPolicy)?
                    .entry;
                let (policy, _share, limit) = self.params_of(&view, entry);
                match policy.algorithm {
                    Algorithm::TokenBucket => {}
                    Algorithm::SlidingWindow => {
                        return Err(HoldError::Conflict(format!(
                            "policy {:?} is a sliding window, which keeps no level to hold: \
                             holds are for token budgets and concurrency limits",
                            name.as_str()
                        )))
                    }
                    Algorithm::Concurrency => {
                        if n > 1 {
                            return Err(HoldError::Conflict(format!(
                                "policy {:?} is a concurrency limit: hold it alone",
                                name.as_str()
                            )));
                        }
                        if ask.cost != 1 {
                            return Err(field(
                                "cost",
                                "a hold of a concurrency limit takes one slot: cost 1",
                            ));
                        }
                        default_ttl = policy.window_ms;
                        longest_ttl = policy.window_ms;
                    }
                }
                if policy.mode == PolicyMode::Shadow {
                    return Err(HoldError::Conflict(format!(
                        "policy {:?} is in shadow mode: check it instead",
                        name.as_str()
                    )));
                }
                quota_core::mode::check_cost(&policy, ask.cost, entry.grants.len())
                    .map_err(CheckError::from)?;
                if let Some(home) = entry.home.as_ref().filter(|h| **h != self.region) {
                    homes.push(home.clone());
                }
                // As a check: a share here that cannot hold the estimate at all is reduced
                // capacity for now, not a denial that could never end.
                if homes.is_empty() && !super::check::holds(&limit, ask.cost) {
                    return Err(CheckError::ReducedCapacity {
                        policy: name.clone(),
                        reason: "this region holds too little of the policy's budget for now",
                    }
                    .into());
                }
                limits.push(HoldLimit {
                    bucket: BucketRef {
                        tenant: ask.tenant.clone(),
                        policy: name.clone(),
                        version: policy.version,
                    },
                    limit,
                    debt_limit_ut: policy.debt_limit.saturating_mul(UT),
                });
                policies.push(policy);
            }
        }
        let ttl_ms = ask.ttl_ms.unwrap_or(default_ttl);
        if ttl_ms == 0 || ttl_ms > longest_ttl {
            return Err(field(
                "ttl_ms",
                format!("must be 1 to {longest_ttl} ms (got {ttl_ms})"),
            ));
        }
        if !homes.is_empty() && !forwarded {
            return self.hold_at_home(homes, n, &ask, ttl_ms).await;
        }
        let id = HoldId {
            region: self.region.clone(),
            tenant: ask.tenant.clone(),
            key: ask.key.clone().unwrap_or_else(random_key),
        };
        let req = HoldRequest {
            id: id.key.clone(),
            limits,
            cost: ask.cost,
            ttl_ms,
            now_ms: None,
        };
        let out = match self.hold_store(self.store.hold(&req)).await {
            Ok(Some(HoldOutcome {
                decisions,
                held,
                replayed,
                ..
            })) => {
                let v = self.multi_verdict(&ask.policies, policies, decisions, Mode::Normal);
                Held::Decided(HoldVerdict {
                    id,
                    held,
                    ttl_ms,
                    limits: v.limits,
                    replayed,
                })
            }
            Ok(None) => Held::Unavailable,
            Err(StoreError::Rejected { reason }) if reason.contains("hold id") => {
                count_hold(&self.region, "refused");
                return Err(HoldError::Conflict(
                    "this id names an earlier hold of another request".into(),
                ));
            }
            Err(e) => {
                tracing::warn!(region = %self.region, error = %e,
                    "The store refused a hold; other buckets are unaffected.");
                Held::Unavailable
            }
        };
        count_hold(
            &self.region,
            match &out {
                Held::Decided(v) if v.held => "held",
                Held::Decided(_) => "denied",
                _ => "unavailable",
            },
        );
        Ok(out)
    }

    /// The hold relayed to the one home region its budgets live in.
    async fn hold_at_home(
        &self,
        homes: Vec<RegionId>,
        n: usize,
        ask: &HoldAsk,
        ttl_ms: u64,
    ) -> Result<Held, HoldError> {
        let home = homes[0].clone();
        if homes.len() < n || homes.iter().any(|h| *h != home) {
            return Err(HoldError::Conflict(
                "these policies are decided in different regions: hold them one request each"
                    .into(),
            ));
        }
        let mut body = serde_json::json!({
            "tenant": ask.tenant.as_str(),
            "policies": ask.policies.iter().map(PolicyName::as_str).collect::<Vec<_>>(),
            "cost": ask.cost,
            "ttl_ms": ttl_ms,
        });
        if let Some(key) = &ask.key {
            body["id"] = serde_json::Value::String(key.clone());
        }
        let out = match self.relay(&home, HOLDS_PATH, &body).await {
            Some(r) => Held::Relayed(r),
            None => {
                self.forward_failures.increment(1);
                Held::HomeUnreachable(home)
            }
        };
        count_hold(
            &self.region,
            match &out {
                Held::Relayed(_) => "relayed",
                _ => "home_unreachable",
            },
        );
        Ok(out)
    }

    /// Settles hold `id` at `cost` actual tokens, or releases it (`cost` `None`): here when it
    /// is this region's, else in its region (unless `forwarded` here).
    pub async fn settle(
        &self,
        id: &HoldId,
        cost: Option<u64>,
        forwarded: bool,
    ) -> Result<Settlement, HoldError> {
        if let Some(c) = cost {
            if c > quota_store::MAX_COST {
                return Err(field(
                    "cost",
                    format!("must be at most {} (got {c})", quota_store::MAX_COST),
                ));
            }
        }
        let out = if id.region != self.region {
            if forwarded || !self.homes.contains_key(&id.region) {
                return Err(field(
                    "id",
                    format!(
                        "names a hold of region {:?}, which does not take holds from here",
                        id.region.as_str()
                    ),
                ));
            }
            let (path, body) = match cost {
                Some(c) => (
                    format!("{HOLDS_PATH}/{id}/settle"),
                    serde_json::json!({ "cost": c }),
                ),
                None => (format!("{HOLDS_PATH}/{id}/release"), serde_json::json!({})),
            };
            match self.relay(&id.region, &path, &body).await {
                Some(r) => Settlement::Relayed(r),
                None => {
                    self.forward_failures.increment(1);
                    Settlement::RegionUnreachable(id.region.clone())
                }
            }
        } else {
            let answer = match cost {
                Some(cost) => {
                    let req = SettleRequest {
                        tenant: id.tenant.clone(),
                        id: id.key.clone(),
                        cost,
                        now_ms: None,
                    };
                    self.hold_store(self.store().settle(&req)).await
                }
                None => {
                    let req = ReleaseRequest {
                        tenant: id.tenant.clone(),
                        id: id.key.clone(),
                        now_ms: None,
                    };
                    self.hold_store(self.store().release(&req)).await
                }
            };
            match answer {
                Ok(Some(s)) => {
                    // Tokens given back, or a debt repaid, may admit what a cached denial
                    // of these buckets still refuses (as a refund does).
                    if let Settled::Done { limits, .. } = &s {
                        for l in limits.iter().filter(|l| l.refunded > 0) {
                            self.denials.forget(&l.bucket);
                        }
                    }
                    Settlement::Here(s)
                }
                Ok(None) => Settlement::Unavailable,
                Err(e) => {
                    tracing::warn!(region = %self.region, error = %e,
                        "The store refused to settle a hold.");
                    Settlement::Unavailable
                }
            }
        };
        count_settlement(&self.region, cost.is_none(), &out);
        Ok(out)
    }

    /// One store call through the breaker (the embedded store has none to trip); a refusal
    /// of the request never counts against it.
    async fn hold_store<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<Option<T>, StoreError> {
        if is_embedded(self.store()) {
            return match call.await {
                Ok(t) => Ok(Some(t)),
                Err(e) if !e.is_outage() => Err(e),
                Err(_) => Ok(None),
            };
        }
        self.call_store(clock::monotonic(), call).await
    }
}

/// A fresh hold key: 128 random bits in hex.
fn random_key() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Registers the hold series of `region` at 0, so they are exported before the first hold.
pub fn register_metrics(region: &RegionId) {
    let region = region.as_str().to_string();
    metrics::counter!(telemetry::HOLDS_TOTAL, "outcome" => "held", "region" => region.clone())
        .increment(0);
    metrics::counter!(telemetry::HOLD_SETTLEMENTS_TOTAL, "outcome" => "settled", "region" => region)
        .increment(0);
}

fn count_hold(region: &RegionId, outcome: &'static str) {
    metrics::counter!(telemetry::HOLDS_TOTAL, "outcome" => outcome,
        "region" => region.as_str().to_string())
    .increment(1);
}

fn count_settlement(region: &RegionId, release: bool, out: &Settlement) {
    let outcome = match out {
        Settlement::Here(Settled::Done { replayed: true, .. }) => "replayed",
        Settlement::Here(Settled::Done { .. }) if release => "released",
        Settlement::Here(Settled::Done { .. }) => "settled",
        Settlement::Here(Settled::Expired { .. }) => "expired",
        Settlement::Here(Settled::Unknown) => "unknown",
        Settlement::Here(Settled::Conflict(_)) => "conflict",
        Settlement::Relayed(_) => "relayed",
        Settlement::RegionUnreachable(_) => "region_unreachable",
        Settlement::Unavailable => "unavailable",
    };
    metrics::counter!(telemetry::HOLD_SETTLEMENTS_TOTAL, "outcome" => outcome,
        "region" => region.as_str().to_string())
    .increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_id_reads_back_as_written() {
        let id = HoldId {
            region: RegionId::new("eu-west").unwrap(),
            tenant: TenantId::new("acme_1").unwrap(),
            key: "req-42".into(),
        };
        assert_eq!(id.to_string(), "eu-west.acme_1.req-42");
        assert_eq!(HoldId::parse(&id.to_string()).unwrap(), id);
        let random = HoldId {
            key: random_key(),
            ..id
        };
        assert_eq!(random.key.len(), 32);
        assert_eq!(HoldId::parse(&random.to_string()).unwrap(), random);
    }

    #[test]
    fn malformed_hold_ids_say_what_is_wrong() {
        for (bad, says) in [
            ("eu.acme", "is not a hold id"),
            ("e u.acme.k", "names no region"),
            ("eu..k", "names no tenant"),
            ("eu.acme.", "hold key"),
            ("eu.acme.k.k", "hold key"),
            (&format!("eu.acme.{}", "k".repeat(65)), "hold key"),
        ] {
            let e = HoldId::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
