//! Faults inside the daemon's process that must not break its promise: each test reproduces
//! one with real `redis-server` and `quotad` processes and asserts what an operator is owed.
//!
//! - A check dropped by its client while it is the breaker's probe leaves the breaker able to
//!   recover: once Redis answers again, decisions go through it.
//! - A Redis that may evict keys (an evicted bucket comes back full) is reported: a warning, a
//!   metric for the alert rule, and the count of keys it evicted.

use std::process::Command;
use std::time::{Duration, Instant};

use quotad_system_tests::{eventually, metric_value, redis_config, Daemon};
use redis_harness::RedisServer;
use serde_json::json;

fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()?
        .success();
    anyhow::ensure!(ok, "kill {sig} {pid} failed");
    Ok(())
}

/// Regression: `Breaker::admit` moved Open → HalfOpen and only the probe's outcome left it, so a
/// probe whose request future was dropped (the client hung up; Envoy cancels every call at its
/// timeout) left the breaker half-open: every check then answered from the fail mode until a
/// restart, here 503 for a `closed` policy, with Redis long back.
#[tokio::test]
async fn a_probe_dropped_by_its_client_does_not_wedge_the_breaker() -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    // failure_threshold 2, open_ms 200, Redis timeout 100 ms (`redis_config`).
    let d = Daemon::start(&redis_config(&redis.url())).await?;
    // Burst 100: 1 % of it is one check, too few to reserve, so every check asks Redis.
    d.put_policy(
        "acme",
        "writes",
        json!({"limit": 100, "window_ms": 60000, "fail_mode": "closed"}),
    )
    .await?;
    let r = d.check("acme", "writes", 1).await?;
    assert_eq!(
        (r.status, r.body["mode"].as_str()),
        (200, Some("normal")),
        "{}",
        r.body
    );

    signal(redis.pid(), "-STOP")?;
    let result = async {
        let opened = eventually(
            Duration::from_secs(10),
            Duration::from_millis(20),
            || async {
                // Each check waits out the Redis timeout until the breaker opens.
                d.check("acme", "writes", 1).await.ok()?;
                let status = d.get("/v1/status").await.ok()?;
                (status.body["store"]["state"] == "degraded").then_some(())
            },
        )
        .await;
        assert!(opened.is_some(), "the breaker opens while Redis is stopped");

        // Checks that give up after 30 ms: answered from the fail mode they return at once;
        // the one the breaker lets through as its probe waits on the stopped Redis and is
        // dropped by its client mid-call.
        let impatient = reqwest::Client::builder()
            .timeout(Duration::from_millis(30))
            .pool_max_idle_per_host(0)
            .build()?;
        let body = json!({"tenant": "acme", "policy": "writes", "cost": 1}).to_string();
        let probe_dropped = eventually(Duration::from_secs(10), Duration::from_millis(10), || {
            let req = impatient
                .post(format!("{}/v1/check", d.base()))
                .header("content-type", "application/json")
                .body(body.clone());
            async move {
                req.send()
                    .await
                    .err()
                    .filter(|e| e.is_timeout())
                    .map(|_| ())
            }
        })
        .await;
        assert!(
            probe_dropped.is_some(),
            "a probe went to the stopped Redis and was dropped"
        );
        anyhow::Ok(())
    }
    .await;
    signal(redis.pid(), "-CONT")?;
    result?;

    let back = Instant::now();
    let normal = eventually(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            let r = d.check("acme", "writes", 1).await.ok()?;
            (r.status == 200 && r.body["mode"] == "normal").then_some(())
        },
    )
    .await;
    assert!(
        normal.is_some(),
        "decisions go through Redis again once it answers; status: {}",
        d.get("/v1/status").await?.body
    );
    eprintln!(
        "decisions through Redis {:?} after it resumed",
        back.elapsed()
    );
    assert_eq!(d.get("/v1/status").await?.body["store"]["state"], "ok");
    Ok(())
}

async fn metric(d: &Daemon, name: &str) -> Option<f64> {
    let (_, text) = d.get_text("/metrics").await.ok()?;
    metric_value(&text, name, &[("region", "b")])
}

/// Nothing read `maxmemory-policy`: a Redis under memory pressure with `allkeys-lru` evicted
/// spent buckets, which came back full, and nothing said so.
#[tokio::test]
async fn a_redis_that_may_evict_keys_is_reported_with_its_evictions() -> anyhow::Result<()> {
    let redis =
        RedisServer::start_with(&["--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru"])?;
    let d = Daemon::start(&redis_config(&redis.url())).await?;
    let flagged = eventually(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { (metric(&d, "quotad_redis_may_evict").await == Some(1.0)).then_some(()) },
    )
    .await;
    assert!(flagged.is_some(), "quotad_redis_may_evict is 1");
    assert!(
        d.log_text().contains("Redis may evict quotad's keys"),
        "a warning names the problem:\n{}",
        d.log_text()
    );
    assert_eq!(
        metric(&d, "quotad_redis_evicted_keys_total").await,
        Some(0.0)
    );

    // Fill Redis past its limit: it evicts, and the daemon counts it.
    let mut c = redis.client().get_multiplexed_async_connection().await?;
    let blob = vec![b'x'; 64 * 1024];
    for i in 0..400 {
        let _: () = redis::cmd("SET")
            .arg(format!("filler:{i}"))
            .arg(&blob)
            .query_async(&mut c)
            .await?;
    }
    let counted = eventually(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async {
            metric(&d, "quotad_redis_evicted_keys_total")
                .await
                .filter(|n| *n > 0.0)
        },
    )
    .await;
    assert!(counted.is_some(), "evictions are counted");
    Ok(())
}

#[tokio::test]
async fn a_redis_that_never_evicts_is_reported_as_such() -> anyhow::Result<()> {
    // Redis's default: maxmemory-policy noeviction.
    let redis = RedisServer::start()?;
    let d = Daemon::start(&redis_config(&redis.url())).await?;
    let read = eventually(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { metric(&d, "quotad_redis_may_evict").await },
    )
    .await;
    assert_eq!(read, Some(0.0));
    assert!(!d.log_text().contains("Redis may evict"));
    Ok(())
}
