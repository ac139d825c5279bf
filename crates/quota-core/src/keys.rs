//! The Redis key schema. Versioned (`qd:v1:`) so a future layout can live beside this one, and
//! hash-tagged by tenant (`{tenant}`) so all of a tenant's keys share one Redis Cluster slot and
//! one script can touch them atomically.
//!
//! ```text
//! qd:v1:{<tenant>}:<policy>:<version>:b   bucket state (hash), expires when idle
//! qd:v1:{<tenant>}:<policy>:<version>:p   this region's bucket parameters (hash), no TTL
//! ```

use crate::ids::{PolicyName, TenantId};

/// The schema version in every key.
pub const PREFIX: &str = "qd:v1:";

fn key(tenant: &TenantId, policy: &PolicyName, version: u64, kind: &str) -> String {
    format!("{PREFIX}{{{}}}:{}:{version}:{kind}", tenant.as_str(), policy.as_str())
}

/// The bucket-state key of a tenant's policy.
pub fn bucket_key(tenant: &TenantId, policy: &PolicyName, version: u64) -> String {
    key(tenant, policy, version, "b")
}

/// The bucket-parameters key of a tenant's policy, beside its bucket.
pub fn params_key(tenant: &TenantId, policy: &PolicyName, version: u64) -> String {
    key(tenant, policy, version, "p")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_versioned_and_hash_tagged() {
        let t = TenantId::new("acme").unwrap();
        let p = PolicyName::new("writes").unwrap();
        assert_eq!(bucket_key(&t, &p, 3), "qd:v1:{acme}:writes:3:b");
        assert_eq!(params_key(&t, &p, 3), "qd:v1:{acme}:writes:3:p");
    }
}
