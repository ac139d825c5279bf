//! Plans and identities on a real daemon: a default plan limits subjects no admin call ever
//! named, an identity never appears raw in Redis, the log or the metrics, and a shadow
//! policy admits what it would deny while counting it.

use std::time::Duration;

use quotad_system_tests::{embedded_config, metric_value, redis_config, Daemon, TOKEN};
use redis_harness::RedisServer;
use serde_json::{json, Value};

const IDENTITY: &str = "203.0.113.7";
const KEY: (&str, &str) = ("QUOTAD_IDENTITY_KEY", "system-test-identity-key-0123");

/// Puts the default plan: `login` at 5 per 15 minutes.
async fn put_default_plan(d: &Daemon) -> anyhow::Result<()> {
    let body = json!({"policies": {"login": {"limit": 5, "window_ms": 900_000}}});
    let r = d
        .request(
            "PUT",
            "/v1/plans/default",
            Some(TOKEN),
            Some(body.to_string()),
        )
        .await?;
    anyhow::ensure!(r.status == 200, "PUT plan: {} {}", r.status, r.body);
    Ok(())
}

/// Six checks of the identity's `login`: their statuses, every body checked for the raw value.
async fn six_logins(d: &Daemon) -> anyhow::Result<Vec<u16>> {
    let body = json!({"identity": IDENTITY, "policy": "login"}).to_string();
    let mut statuses = Vec::new();
    for _ in 0..6 {
        let r = d
            .request("POST", "/v1/check", None, Some(body.clone()))
            .await?;
        assert!(!r.body.to_string().contains(IDENTITY), "{}", r.body);
        statuses.push(r.status);
    }
    Ok(statuses)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_plan_limits_an_identity_on_the_embedded_store() -> anyhow::Result<()> {
    let d = Daemon::start_with_env(&embedded_config(), &[KEY]).await?;
    put_default_plan(&d).await?;
    assert_eq!(six_logins(&d).await?, [200, 200, 200, 200, 200, 429]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_appears_raw_in_no_redis_key_log_line_or_metric() -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    let config =
        redis_config(&redis.url()).replace("log_level = \"info\"", "log_level = \"debug\"");
    let d = Daemon::start_with_env(&config, &[KEY]).await?;
    put_default_plan(&d).await?;
    assert_eq!(six_logins(&d).await?, [200, 200, 200, 200, 200, 429]);
    // A batch carries identities too.
    let batch = json!({"checks": [{"identity": IDENTITY, "policy": "login"}]}).to_string();
    let r = d
        .request("POST", "/v1/check/batch", None, Some(batch))
        .await?;
    assert_eq!(r.body["results"][0]["status"], 429, "{}", r.body);

    let mut con = redis.client().get_multiplexed_async_connection().await?;
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut con).await?;
    assert!(
        keys.iter()
            .any(|k| k.contains("{h-") && k.contains(":login:")),
        "the subject's bucket is in Redis under its hash: {keys:?}"
    );
    assert!(keys.iter().all(|k| !k.contains(IDENTITY)), "{keys:?}");
    // Let the agent run a few report intervals, so its log lines are in too.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (_, metrics) = d.get_text("/metrics").await?;
    assert!(!metrics.contains(IDENTITY), "{metrics}");
    let log = d.log_text();
    assert!(!log.is_empty());
    assert!(!log.contains(IDENTITY), "{log}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_policy_admits_ten_and_marks_five() -> anyhow::Result<()> {
    let d = Daemon::start(&embedded_config()).await?;
    d.put_policy(
        "acme",
        "exports",
        json!({"limit": 5, "window_ms": 3_600_000, "mode": "shadow"}),
    )
    .await?;
    let mut marked = 0;
    for _ in 0..10 {
        let r = d.check("acme", "exports", 1).await?;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.body["allowed"], Value::Bool(true));
        if r.body["shadow_denied"] == Value::Bool(true) {
            marked += 1;
        }
    }
    assert_eq!(marked, 5);
    let (_, metrics) = d.get_text("/metrics").await?;
    assert_eq!(
        metric_value(
            &metrics,
            "quotad_shadow_denials_total",
            &[("policy", "exports")]
        ),
        Some(5.0),
        "{metrics}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_on_a_daemon_without_a_key_is_refused_by_name() -> anyhow::Result<()> {
    let d = Daemon::start(&embedded_config()).await?;
    put_default_plan(&d).await?;
    let body = json!({"identity": IDENTITY, "policy": "login"}).to_string();
    let r = d.request("POST", "/v1/check", None, Some(body)).await?;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.body["code"], "NOT_CONFIGURED");
    assert_eq!(r.body["errors"][0]["field"], "identity");
    Ok(())
}

/// A single-region daemon reports usage to no one, yet drains the activity index in Redis
/// (every `agent::DRAIN_INTERVAL`, 10 s), so one-shot identities leave no entry behind once
/// their buckets expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_region_drains_the_activity_index() -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    let d = Daemon::start_with_env(&redis_config(&redis.url()), &[KEY]).await?;
    put_default_plan(&d).await?;
    for i in 0..50 {
        let body = json!({"identity": format!("one-shot-{i}"), "policy": "login"});
        let r = d
            .request("POST", "/v1/check", None, Some(body.to_string()))
            .await?;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let mut con = redis.client().get_multiplexed_async_connection().await?;
    let listed = || {
        let mut con = con.clone();
        async move {
            let n: u64 = redis::cmd("SCARD")
                .arg(quota_core::keys::ACTIVE_INDEX)
                .query_async(&mut con)
                .await
                .ok()?;
            (n == 0).then_some(())
        }
    };
    let drained = quotad_system_tests::eventually(
        Duration::from_secs(15),
        Duration::from_millis(100),
        listed,
    )
    .await;
    assert!(drained.is_some(), "the activity index was never drained");
    // The buckets themselves stay until their TTLs pass.
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut con).await?;
    assert!(keys.len() > 50, "{} keys", keys.len());
    Ok(())
}
