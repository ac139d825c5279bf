//! A denied bucket flooded at full speed costs Redis one call per retry interval, not one per
//! check: a token-bucket denial with retry time R answers later checks of that cost or more in
//! the daemon until R has passed. The answers are the ones Redis would give: once R has
//! passed, the next check goes to Redis and is admitted.

use std::time::Duration;

use quotad_system_tests::{evalsha_calls, metric_value, redis_config, Daemon};
use redis_harness::RedisServer;
use serde_json::json;

#[tokio::test]
async fn a_flood_on_a_denied_bucket_costs_redis_one_call_per_retry_interval() -> anyhow::Result<()>
{
    let redis = RedisServer::start()?;
    let d = Daemon::start(&redis_config(&redis.url())).await?;
    // 5 a second, burst 5: a drained bucket has its next token in 200 ms.
    d.put_policy("flood", "w", json!({"limit": 5, "window_ms": 1000}))
        .await?;
    // Let the agent write the bucket's parameters (a write drops remembered denials).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let mut conn = redis.client().get_multiplexed_async_connection().await?;
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut conn)
        .await?;

    let started = std::time::Instant::now();
    let (mut admitted, mut denied) = (0u64, 0u64);
    for _ in 0..150 {
        let r = d.check("flood", "w", 1).await?;
        match r.status {
            200 => admitted += 1,
            429 => denied += 1,
            s => anyhow::bail!("check answered {s}: {}", r.body),
        }
    }
    let elapsed_ms = started.elapsed().as_millis() as u64;
    let calls = evalsha_calls(&mut conn).await?;
    let (_, metrics) = d.get_text("/metrics").await?;
    let hits = metric_value(&metrics, "quotad_denial_cache_hits_total", &[]).unwrap_or(0.0);
    // A token every 200 ms: that many retry intervals passed during the flood.
    let intervals = elapsed_ms / 200 + 1;
    eprintln!(
        "flood of 150 checks in {elapsed_ms} ms: {admitted} admitted, {denied} denied, {calls} \
         EVALSHA calls, {hits} cache hits ({intervals} retry intervals)"
    );
    assert!(
        admitted >= 5 && admitted <= 5 + intervals,
        "{admitted} admitted"
    );
    // Each admission is a call; each retry interval adds at most one denial that asks Redis
    // (the one that finds the token not there yet), plus a parameter write or two and a
    // denial whose retry time is too short to remember.
    assert!(
        calls <= admitted + intervals + 5,
        "{calls} EVALSHA calls for {admitted} admissions and {denied} denials in {intervals} \
         retry intervals"
    );
    assert!(hits as u64 + calls >= denied, "hits {hits}, calls {calls}");

    // Once the retry time has passed, the check goes to Redis and is admitted.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let r = d.check("flood", "w", 1).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    Ok(())
}

/// A larger cost is refused from the cache too; a smaller one is asked of Redis, which may
/// admit it.
#[tokio::test]
async fn a_denial_covers_its_cost_and_more_not_less() -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    let d = Daemon::start(&redis_config(&redis.url())).await?;
    // 1 a second, burst 10: a token every 1 000 ms.
    d.put_policy(
        "c",
        "w",
        json!({"limit": 1, "window_ms": 1000, "burst": 10}),
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(d.check("c", "w", 8).await?.status, 200);
    // 2 left: cost 5 is denied (3 s to go), and remembered.
    assert_eq!(d.check("c", "w", 5).await?.status, 429);
    let mut conn = redis.client().get_multiplexed_async_connection().await?;
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut conn)
        .await?;
    assert_eq!(d.check("c", "w", 5).await?.status, 429);
    assert_eq!(d.check("c", "w", 7).await?.status, 429);
    assert_eq!(
        evalsha_calls(&mut conn).await?,
        0,
        "answered from the cache"
    );
    // Cost 2 fits what is left: Redis decides it.
    assert_eq!(d.check("c", "w", 2).await?.status, 200);
    assert_eq!(evalsha_calls(&mut conn).await?, 1);
    Ok(())
}
