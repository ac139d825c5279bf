//! How a limit's subject and policy are read from Envoy's entries: an RLS descriptor's and an
//! RLQS bucket id's alike.

use quota_core::{PolicyName, TenantId};

use crate::api::AppState;
use crate::config::EnvoyConfig;

/// The entry keys that name a limit's subject and policy, in RLS descriptors and RLQS bucket
/// ids alike.
#[derive(Debug, Clone)]
pub struct SubjectKeys {
    tenant_key: String,
    policy_key: String,
    identity_key: Option<String>,
}

impl SubjectKeys {
    pub fn new(cfg: &EnvoyConfig) -> Self {
        Self {
            tenant_key: cfg.tenant_key.clone(),
            policy_key: cfg.policy_key.clone(),
            identity_key: cfg.identity_key.clone(),
        }
    }

    /// The subject and policy named by entries `with_key` finds (`Err` for a key given twice):
    /// the tenant entry, else the identity entry hashed with the identity key; the policy
    /// entry, else `domain`. `Ok(None)` when neither names a subject; `Err` with a metric-safe
    /// word for what is malformed.
    pub fn subject<'a>(
        &self,
        state: &AppState,
        with_key: impl Fn(&str) -> Result<Option<&'a str>, ()>,
        domain: &'a str,
    ) -> Result<Option<(TenantId, PolicyName)>, &'static str> {
        let (Ok(tenant), Ok(policy)) = (with_key(&self.tenant_key), with_key(&self.policy_key))
        else {
            return Err("repeated_key");
        };
        let identity = match self.identity_key.as_deref().map(&with_key) {
            Some(Err(())) => return Err("repeated_key"),
            Some(Ok(v)) => v,
            None => None,
        };
        let tenant = match (tenant, identity) {
            (Some(t), _) => match TenantId::new(t) {
                Ok(t) if t.reserved().is_none() => t,
                _ => return Err("bad_tenant"),
            },
            // The raw value goes no further than the hash.
            (None, Some(raw)) => match &state.identity_key {
                Some(_) if raw.is_empty() || raw.len() > crate::api::check::MAX_IDENTITY_BYTES => {
                    return Err("bad_identity")
                }
                Some(key) => quota_core::hashed_id(key.expose().as_bytes(), raw.as_bytes()),
                None => return Err("no_identity_key"),
            },
            (None, None) => return Ok(None),
        };
        let Ok(policy) = PolicyName::new(policy.unwrap_or(domain)) else {
            return Err("bad_policy");
        };
        Ok(Some((tenant, policy)))
    }
}
