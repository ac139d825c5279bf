//! The audit log: one structured event per mutation, with `target = "audit"`, and the
//! `quotad_admin_requests_total{action,outcome}` counter. A leaf: the API's audit layer and the
//! tokens' reloads write through it.
//!
//! An event names the token by its name (never its value), the action, the tenant by a hash
//! (`tenant_hash`, the first 16 hex digits of the SHA-256 of its id, so the log does not carry
//! tenant ids), the policy, the versions before and after, the request id and the outcome.

use sha2::{Digest, Sha256};

use crate::telemetry::ADMIN_REQUESTS_TOTAL;

/// The tenant as the audit log names it: 16 hex digits of the SHA-256 of its id.
pub fn tenant_hash(tenant: &str) -> String {
    hex::encode(&Sha256::digest(tenant.as_bytes())[..8])
}

/// Counts one audited request.
pub fn count(action: &'static str, outcome: &'static str) {
    metrics::counter!(ADMIN_REQUESTS_TOTAL, "action" => action, "outcome" => outcome).increment(1);
}

/// One audited request, as the audit layer saw it.
#[derive(Debug, Default)]
pub struct Event<'a> {
    pub token: Option<&'a str>,
    pub action: &'static str,
    pub tenant: Option<&'a str>,
    pub policy: Option<&'a str>,
    /// The plan a plan mutation names (plan names are operator-chosen, not secrets).
    pub plan: Option<&'a str>,
    pub node_id: Option<&'a str>,
    pub version_before: Option<u64>,
    pub version_after: Option<u64>,
    pub request_id: Option<&'a str>,
    pub outcome: &'static str,
    pub status: u16,
}

/// Writes `e` as one event and counts it.
pub fn record(e: &Event<'_>) {
    let tenant_hash = e.tenant.map(tenant_hash);
    tracing::info!(
        target: "audit",
        token = e.token.unwrap_or("-"),
        action = e.action,
        tenant_hash = tenant_hash.as_deref(),
        policy = e.policy,
        plan = e.plan,
        node_id = e.node_id,
        version_before = e.version_before,
        version_after = e.version_after,
        request_id = e.request_id,
        outcome = e.outcome,
        status = e.status,
        "Audit."
    );
    count(e.action, e.outcome);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_hashes_are_short_stable_and_distinct() {
        assert_eq!(tenant_hash("acme").len(), 16);
        assert_eq!(tenant_hash("acme"), tenant_hash("acme"));
        assert_ne!(tenant_hash("acme"), tenant_hash("acme2"));
    }
}
