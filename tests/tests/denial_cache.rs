//! A denied bucket flooded at full speed costs Redis one call per retry interval, not one per
//! check: a token-bucket denial with retry time R, or an admission that leaves less than its
//! cost, answers later checks of that cost or more in the daemon until R has passed; then one
//! check probes Redis while the others wait for its answer. The answers are the ones Redis
//! would give: every token that comes back is admitted, and no more.

use std::sync::Arc;
use std::time::{Duration, Instant};

use quotad_system_tests::{evalsha_calls, metric_value, redis_config, Daemon};
use redis_harness::RedisServer;
use serde_json::json;

#[tokio::test]
async fn a_flood_on_a_denied_bucket_costs_redis_one_call_per_retry_interval() -> anyhow::Result<()>
{
    let redis = RedisServer::start()?;
    let d = Arc::new(Daemon::start(&redis_config(&redis.url())).await?);
    // 10 a second, burst 10: a drained bucket has its next token in 100 ms.
    d.put_policy("flood", "w", json!({"limit": 10, "window_ms": 1000}))
        .await?;
    // Let the agent write the bucket's parameters (a write drops remembered denials).
    tokio::time::sleep(Duration::from_millis(600)).await;
    // Spend the burst: the flood is on a drained bucket.
    while d.check("flood", "w", 1).await?.status == 200 {}
    let mut conn = redis.client().get_multiplexed_async_connection().await?;
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut conn)
        .await?;

    // 8 callers at full speed for 1.5 s.
    let started = Instant::now();
    let end = started + Duration::from_millis(1_500);
    let mut callers = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let d = d.clone();
        callers.spawn(async move {
            let (mut admitted, mut denied) = (0u64, 0u64);
            while Instant::now() < end {
                match d.check("flood", "w", 1).await?.status {
                    200 => admitted += 1,
                    429 => denied += 1,
                    s => anyhow::bail!("a check answered {s}"),
                }
            }
            Ok((admitted, denied))
        });
    }
    let (mut admitted, mut denied) = (0u64, 0u64);
    while let Some(r) = callers.join_next().await {
        let (a, n) = r??;
        admitted += a;
        denied += n;
    }
    let elapsed_ms = started.elapsed().as_millis() as u64;
    let calls = evalsha_calls(&mut conn).await?;
    let (_, metrics) = d.get_text("/metrics").await?;
    let hits = metric_value(&metrics, "quotad_denial_cache_hits_total", &[]).unwrap_or(0.0);
    let probes = metric_value(&metrics, "quotad_denial_cache_probes_total", &[]).unwrap_or(0.0);
    let intervals = elapsed_ms / 100;
    eprintln!(
        "flood of {} checks from 8 callers in {elapsed_ms} ms: {admitted} admitted, {denied} \
         denied, {calls} EVALSHA calls, {hits} cache hits, {probes} probes ({intervals} retry \
         intervals)",
        admitted + denied
    );
    // Exact: the tokens that came back, no more; and every one of them, though the checks
    // arriving as a token is due wait for one probe.
    assert!(admitted <= intervals + 1, "{admitted} admitted");
    assert!(admitted + 2 >= intervals, "{admitted} admitted");
    // One call per token: each probe admits the token that came back, and that admission
    // (which leaves nothing) stands as a denial until the next. One more for a usage drain.
    assert!(
        calls <= intervals + 2,
        "{calls} EVALSHA calls for {admitted} admissions and {denied} denials in {intervals} \
         retry intervals"
    );
    // Every token after the first was found by a probe the other callers waited for.
    assert!(
        probes as u64 + 2 >= intervals && probes as u64 <= calls,
        "{probes} probes, {calls} calls in {intervals} intervals"
    );
    assert!(
        denied >= 10 * intervals,
        "a flood: {denied} denials in {intervals} intervals"
    );

    // Once the retry time has passed, the check goes to Redis and is admitted.
    tokio::time::sleep(Duration::from_millis(150)).await;
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
