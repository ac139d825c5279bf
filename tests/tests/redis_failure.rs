//! The regional Redis killed under a running daemon, or down before it starts: each policy's
//! fail mode decides while it is down (`local`: in-process bucket at this region's share,
//! going on from what Redis last answered, `open`: admit, `closed`: 503
//! temporary-reduced-capacity), and when Redis returns normal decisions resume within 2 s and
//! the shares are applied to the new, empty Redis.

use std::time::{Duration, Instant};

use std::collections::HashMap;

use quotad_system_tests::{eventually, metric_value, params_present, redis_config, Daemon};
use redis_harness::RedisServer;
use serde_json::json;

/// One policy per fail mode, each 5 tokens a minute; their versions by policy.
async fn put_fail_mode_policies(d: &Daemon) -> anyhow::Result<HashMap<&'static str, u64>> {
    // Versions come from one counter across policies (never reused): read them, not assume 1.
    let mut versions = HashMap::new();
    for (policy, mode) in [
        ("p-local", "local"),
        ("p-open", "open"),
        ("p-closed", "closed"),
    ] {
        let stored = d
            .put_policy(
                "acme",
                policy,
                json!({"limit": 5, "window_ms": 60000, "fail_mode": mode}),
            )
            .await?;
        let version = stored["version"].as_u64().expect("a version");
        versions.insert(policy, version);
    }
    Ok(versions)
}

/// Each fail mode decides while Redis is down, and status and metrics say so. `left`: the
/// tokens of `p-local` Redis last answered were left (0 if it never answered for it).
async fn fail_modes_decide(d: &Daemon, left: u64) -> anyhow::Result<()> {
    // Until the breaker opens, a check may still wait for Redis to time out; after it opens the
    // fail modes answer immediately.
    let degraded = eventually(
        Duration::from_secs(5),
        Duration::from_millis(20),
        || async {
            let r = d.check("acme", "p-open", 1).await.ok()?;
            (r.body["mode"] == "degraded_open").then_some(r)
        },
    )
    .await;
    let r = degraded.expect("fail-open policy admits while Redis is down");
    assert_eq!(r.status, 200);

    let r = d.check("acme", "p-closed", 1).await?;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.body["code"], "TEMPORARY_REDUCED_CAPACITY");
    assert_eq!(
        r.body["type"],
        "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
    );

    // Fail local: an in-process bucket at this region's share (5 tokens) goes on from what Redis
    // last answered: it admits what was left (one more if a token refilled, 5 a minute), then
    // denies.
    let mut admitted = 0;
    for _ in 0..8 {
        let r = d.check("acme", "p-local", 1).await?;
        assert_eq!(r.body["mode"], "degraded_local", "{}", r.body);
        if r.status == 200 {
            admitted += 1;
        } else {
            assert_eq!(r.status, 429);
        }
    }
    assert!(
        (left..=left + 1).contains(&admitted),
        "the local bucket admitted {admitted}; Redis had {left} left"
    );
    let status = d.get("/v1/status").await?;
    assert_eq!(status.body["store"]["state"], "degraded");
    assert_eq!(status.body["store"]["topology"], "standalone");
    let (code, metrics) = d.get_text("/metrics").await?;
    assert_eq!(code, 200);
    assert_eq!(
        metric_value(&metrics, "quotad_degraded", &[("region", "b")]),
        Some(1.0)
    );
    Ok(())
}

/// Restarts Redis (empty) and requires normal decisions within 2 s and every share applied.
async fn recovers(
    d: &Daemon,
    redis: &mut RedisServer,
    versions: &HashMap<&str, u64>,
) -> anyhow::Result<()> {
    redis.restart()?;
    let back = Instant::now();
    let resumed = eventually(
        Duration::from_secs(2),
        Duration::from_millis(20),
        || async {
            let r = d.check("acme", "p-open", 1).await.ok()?;
            (r.body["mode"] == "normal").then_some(())
        },
    )
    .await;
    assert!(
        resumed.is_some(),
        "normal decisions resume within 2 s of Redis returning"
    );
    eprintln!(
        "normal decisions resumed {:?} after Redis returned",
        back.elapsed()
    );
    // The restarted Redis is empty: the agent applies every share.
    let reapplied = eventually(
        Duration::from_secs(3),
        Duration::from_millis(50),
        || async {
            let all = params_present(&redis.client(), "acme", "p-local", versions["p-local"]).await
                && params_present(&redis.client(), "acme", "p-closed", versions["p-closed"]).await;
            all.then_some(())
        },
    )
    .await;
    assert!(reapplied.is_some(), "shares applied after Redis returned");
    let r = d.check("acme", "p-closed", 1).await?;
    assert_eq!(
        (r.status, r.body["mode"].as_str()),
        (200, Some("normal")),
        "{}",
        r.body
    );
    assert_eq!(d.get("/v1/status").await?.body["store"]["state"], "ok");
    Ok(())
}

#[tokio::test]
async fn fail_modes_while_redis_is_down_and_recovery_after() -> anyhow::Result<()> {
    let mut redis = RedisServer::start()?;
    let d = Daemon::start(&redis_config(&redis.url())).await?;
    let versions = put_fail_mode_policies(&d).await?;
    for policy in ["p-local", "p-open", "p-closed"] {
        let r = d.check("acme", policy, 1).await?;
        assert_eq!(
            (r.status, r.body["mode"].as_str()),
            (200, Some("normal")),
            "{policy}: {}",
            r.body
        );
    }
    // The agent wrote this region's parameters next to the buckets.
    assert!(
        eventually(
            Duration::from_secs(5),
            Duration::from_millis(50),
            || async {
                params_present(&redis.client(), "acme", "p-local", versions["p-local"])
                    .await
                    .then_some(())
            }
        )
        .await
        .is_some(),
        "shares applied to Redis"
    );

    redis.stop();
    // 4 of p-local's 5 are left.
    fail_modes_decide(&d, 4).await?;
    recovers(&d, &mut redis, &versions).await
}

/// A daemon (re)started while its Redis is down serves — a Redis outage must not become a
/// limiter outage — with the breaker open from the start, and connects when Redis returns.
#[tokio::test]
async fn a_daemon_started_while_redis_is_down_serves_fail_modes_and_connects_later(
) -> anyhow::Result<()> {
    let mut redis = RedisServer::start()?;
    redis.stop();
    let d = Daemon::start(&redis_config(&redis.url())).await?;
    assert!(
        d.log_text().contains("does not answer at start"),
        "{}",
        d.log_text()
    );
    // Degraded before any decision has tried Redis.
    let status = d.get("/v1/status").await?;
    assert_eq!(status.body["store"]["state"], "degraded", "{}", status.body);
    let versions = put_fail_mode_policies(&d).await?;
    // Never answered for: what Redis holds is unknown, so the in-process bucket starts empty
    // (a restart during an outage must not hand out a fresh burst).
    fail_modes_decide(&d, 0).await?;
    recovers(&d, &mut redis, &versions).await
}
