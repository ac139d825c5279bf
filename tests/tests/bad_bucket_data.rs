//! One bucket's bad data in Redis is that bucket's problem, not a Redis outage: the scripts
//! refuse it (`ERR quotad: …`, or a key of another type), the daemon answers that policy with a
//! per-policy problem, and the circuit breaker stays closed, so every other tenant keeps being
//! decided through Redis.

use std::time::Duration;

use quotad_system_tests::{eventually, metric_value, redis_config, Daemon};
use redis_harness::RedisServer;
use serde_json::json;

#[tokio::test]
async fn a_corrupt_bucket_fails_its_own_checks_and_never_opens_the_breaker() -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    let d = Daemon::start(&redis_config(&redis.url())).await?;
    let bad = d
        .put_policy(
            "mallory",
            "writes",
            json!({"limit": 100, "window_ms": 60000}),
        )
        .await?;
    d.put_policy("acme", "writes", json!({"limit": 100, "window_ms": 60000}))
        .await?;
    for tenant in ["mallory", "acme"] {
        let r = d.check(tenant, "writes", 1).await?;
        assert_eq!((r.status, r.body["mode"].as_str()), (200, Some("normal")));
    }

    // mallory's bucket state becomes a list: every script call on it is refused.
    let key = quota_core::keys::bucket_key(
        &quota_core::TenantId::new("mallory")?,
        &quota_core::PolicyName::new("writes")?,
        bad["version"].as_u64().expect("a version"),
    );
    let mut conn = redis.client().get_multiplexed_async_connection().await?;
    redis::cmd("DEL").arg(&key).exec_async(&mut conn).await?;
    redis::cmd("RPUSH")
        .arg(&key)
        .arg("x")
        .exec_async(&mut conn)
        .await?;

    // Far more refusals than the breaker's failure threshold, interleaved with healthy checks.
    for _ in 0..30 {
        let r = d.check("mallory", "writes", 1).await?;
        assert_eq!(r.status, 503, "{}", r.body);
        assert_eq!(r.body["code"], "TEMPORARY_REDUCED_CAPACITY", "{}", r.body);
        assert_eq!(r.body["violated-policies"], json!(["writes"]), "{}", r.body);
        assert!(
            !r.body.to_string().contains(&key),
            "no key name in the answer: {}",
            r.body
        );
        let ok = d.check("acme", "writes", 1).await?;
        assert_eq!(
            (ok.status, ok.body["mode"].as_str()),
            (200, Some("normal")),
            "another tenant stays decided through Redis: {}",
            ok.body
        );
    }
    let status = d.get("/v1/status").await?;
    assert_eq!(status.body["store"]["state"], "ok", "{}", status.body);
    let (_, metrics) = d.get_text("/metrics").await?;
    assert_eq!(
        metric_value(&metrics, "quotad_degraded", &[("region", "b")]),
        Some(0.0)
    );
    assert_eq!(
        metric_value(&metrics, "quotad_store_errors_total", &[("region", "b")]).unwrap_or(0.0),
        0.0,
        "a refusal is not a store error"
    );

    // Once the bad key is gone, the tenant is decided through Redis again.
    redis::cmd("DEL").arg(&key).exec_async(&mut conn).await?;
    let back = eventually(
        Duration::from_secs(2),
        Duration::from_millis(20),
        || async {
            let r = d.check("mallory", "writes", 1).await.ok()?;
            (r.status == 200 && r.body["mode"] == "normal").then_some(())
        },
    )
    .await;
    assert!(
        back.is_some(),
        "the tenant recovers when its key is repaired"
    );
    Ok(())
}
