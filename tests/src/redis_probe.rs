//! What a test asks Redis, and the daemon about Redis: the ACL quotad needs, whether
//! parameters are written, whether checks are decided through Redis.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::{eventually, Daemon};

/// The least an ACL user needs (after `on` and its password): quotad's keys only (`qd:v1:`),
/// scripts, and what the scripts and the region agent call. Documented in docs/operations.md
/// (Authentication).
pub const QUOTAD_ACL: &[&str] = &[
    "on",
    "~qd:v1:*",
    "resetchannels",
    "-@all",
    "+@read",
    "+@write",
    "+@scripting",
    "-@dangerous",
    "+info",
    "+ping",
    "+time",
];

/// A client of the Redis at `url` authenticating as the `default` user with `password`.
pub fn client_with_password(url: &str, password: &str) -> redis::Client {
    let info = redis::IntoConnectionInfo::into_connection_info(url).expect("a loopback URL");
    let settings = info.redis_settings().clone().set_password(password);
    redis::Client::open(info.set_redis_settings(settings)).expect("a client")
}

/// Whether `client`'s Redis holds this region's parameters for a tenant's policy version.
pub async fn params_present(
    client: &redis::Client,
    tenant: &str,
    policy: &str,
    version: u64,
) -> bool {
    let key = quota_core::keys::params_key(
        &quota_core::TenantId::new(tenant).expect("a tenant id"),
        &quota_core::PolicyName::new(policy).expect("a policy name"),
        version,
    );
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return false;
    };
    redis::cmd("EXISTS")
        .arg(&key)
        .query_async::<i64>(&mut conn)
        .await
        .unwrap_or(0)
        == 1
}

/// How many parameter hashes `client`'s Redis holds (every tenant, policy and version).
pub async fn params_keys(client: &redis::Client) -> usize {
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return 0;
    };
    redis::cmd("KEYS")
        .arg(quota_core::keys::PARAMS_KEY_PATTERN)
        .query_async::<Vec<String>>(&mut conn)
        .await
        .map_or(0, |k| k.len())
}

/// Puts `tenant`'s policy `writes` of 3 a minute and checks it four times: three admitted and
/// one denied, all decided through Redis, with the store reported ok. Returns the version.
pub async fn decides_through_redis(d: &Daemon, tenant: &str) -> anyhow::Result<u64> {
    let stored = d
        .put_policy(
            tenant,
            "writes",
            serde_json::json!({"limit": 3, "window_ms": 60000}),
        )
        .await?;
    for expected in [200, 200, 200, 429] {
        let r = d.check(tenant, "writes", 1).await?;
        if (r.status, r.body["mode"].as_str()) != (expected, Some("normal")) {
            bail!(
                "{tenant}: expected {expected} through Redis, got {}: {}",
                r.status,
                r.body
            );
        }
    }
    let status = d.get("/v1/status").await?;
    if status.body["store"]["state"] != "ok" {
        bail!("the store is not ok: {}", status.body);
    }
    stored["version"].as_u64().context("a version")
}

/// Waits up to `within` until one check of each tenant's `writes` policy is decided through
/// Redis (mode `normal`, not a fail mode); how long that took, or `None`.
pub async fn until_all_normal(
    d: &Daemon,
    tenants: &[String],
    within: Duration,
) -> Option<Duration> {
    let started = Instant::now();
    eventually(within, Duration::from_millis(100), || async {
        for tenant in tenants {
            let r = d.check(tenant, "writes", 1).await.ok()?;
            if r.body["mode"] != "normal" {
                return None;
            }
        }
        Some(started.elapsed())
    })
    .await
}

/// One check of each tenant's `writes` policy is denied through Redis: its bucket is still as
/// spent as [`decides_through_redis`] left it.
pub async fn all_still_spent(d: &Daemon, tenants: &[String]) -> anyhow::Result<()> {
    for tenant in tenants {
        let r = d.check(tenant, "writes", 1).await?;
        if (r.status, r.body["mode"].as_str()) != (429, Some("normal")) {
            bail!(
                "{tenant}: expected a denial through Redis, got {}: {}",
                r.status,
                r.body
            );
        }
    }
    Ok(())
}

/// Calls Redis counted since the last `CONFIG RESETSTAT`: EVALSHA, or any command by name.
pub use redis_harness::{command_calls, evalsha_calls};
