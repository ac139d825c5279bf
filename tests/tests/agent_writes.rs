//! The region agent writes a bucket's parameters to Redis when they change, not every report
//! interval: an idle daemon with many policies sends Redis no parameter writes, a changed policy
//! costs one, an old version's or a deleted policy's parameters are cleared, and a restarted
//! (empty) Redis gets every bucket back.

use std::time::Duration;

use quotad_system_tests::{command_calls, eventually, params_keys, redis_config, Daemon};
use redis::aio::MultiplexedConnection;
use redis_harness::RedisServer;
use serde_json::json;

const POLICIES: usize = 200;

/// Parameter writes since the last `CONFIG RESETSTAT`: HSETs of parameter hashes.
async fn param_writes(conn: &mut MultiplexedConnection) -> anyhow::Result<u64> {
    Ok(command_calls(conn, "hset").await?)
}

/// Deletes `tenant`'s `writes` policy.
async fn delete_policy(d: &Daemon, tenant: &str) -> anyhow::Result<()> {
    let path = format!("/v1/tenants/{tenant}/policies/writes");
    let r = d
        .request("DELETE", &path, Some(quotad_system_tests::TOKEN), None)
        .await?;
    anyhow::ensure!(r.status < 300, "DELETE answered {}", r.status);
    Ok(())
}

async fn all_params_within(redis: &RedisServer, n: usize, within: Duration) -> bool {
    eventually(within, Duration::from_millis(50), || async {
        (params_keys(&redis.client()).await == n).then_some(())
    })
    .await
    .is_some()
}

#[tokio::test]
async fn parameters_are_written_on_change_and_after_a_restart_only() -> anyhow::Result<()> {
    let mut redis = RedisServer::start()?;
    // Report interval 200 ms: ten passes of the agent in the 2 s watched below.
    let d = Daemon::start(&redis_config(&redis.url())).await?;
    let spec = json!({"limit": 100, "window_ms": 60000});
    for i in 0..POLICIES {
        d.put_policy(&format!("t{i}"), "writes", spec.clone())
            .await?;
    }
    assert!(
        all_params_within(&redis, POLICIES, Duration::from_secs(5)).await,
        "every policy's parameters reach Redis"
    );

    let mut conn = redis.client().get_multiplexed_async_connection().await?;
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut conn)
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Every parameter write is one HSET of the parameters hash (set_params.lua); the usage
    // collection each interval is an EVALSHA too, but writes no hash for token buckets.
    let idle = param_writes(&mut conn).await?;
    eprintln!("parameter writes in 2 s idle with {POLICIES} policies: {idle}");
    // Nothing changed, so nothing is written: 0, or a few retries of writes that timed out on
    // a loaded machine (writing every bucket every pass would be 10 × 200 = 2 000).
    assert!(idle <= 5, "{idle} writes with nothing changed");

    // A new limit is a new policy version: one bucket to write.
    let v = d
        .put_policy("t7", "writes", json!({"limit": 50, "window_ms": 60000}))
        .await?;
    let version = v["version"].as_u64().expect("a version");
    let key = format!("qd:v1:{{t7}}:writes:{version}:p");
    let written = eventually(Duration::from_secs(3), Duration::from_millis(50), || {
        let mut conn = conn.clone();
        let key = key.clone();
        async move { exists(&mut conn, &key).await.ok()?.then_some(()) }
    })
    .await;
    assert!(
        written.is_some(),
        "the new version's parameters are written"
    );
    // The old version's parameters (and state) go: no stale share for a gateway still using it.
    assert!(
        all_params_within(&redis, POLICIES, Duration::from_secs(3)).await,
        "the old version's parameters are cleared"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    let after_change = param_writes(&mut conn).await?;
    eprintln!("parameter writes for one changed policy: {after_change}");
    assert!(
        (1..=5).contains(&after_change),
        "one changed policy, one write (and a few retries at most): {after_change}"
    );
    // A deleted policy's parameters go too.
    delete_policy(&d, "t8").await?;
    assert!(
        all_params_within(&redis, POLICIES - 1, Duration::from_secs(3)).await,
        "the deleted policy's parameters are cleared"
    );

    // A restarted Redis is empty and has a new run id: every bucket is written again.
    redis.restart()?;
    let back = std::time::Instant::now();
    assert!(
        all_params_within(&redis, POLICIES - 1, Duration::from_secs(3)).await,
        "every policy's parameters are back after the restart"
    );
    eprintln!(
        "{} buckets re-applied {:?} after the restart",
        POLICIES - 1,
        back.elapsed()
    );
    Ok(())
}

async fn exists(conn: &mut MultiplexedConnection, key: &str) -> anyhow::Result<bool> {
    let n: i64 = redis::cmd("EXISTS").arg(key).query_async(conn).await?;
    Ok(n == 1)
}

/// A policy deleted while its parameters could not be cleared (Redis refusing writes, then the
/// daemon killed) leaves them in Redis; the next daemon on the same data directory sweeps them
/// out once it has applied its view, and leaves alone what it has no word on yet.
#[tokio::test]
async fn what_a_killed_daemon_left_behind_is_swept_at_start() -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    let mut first = Daemon::start(&redis_config(&redis.url())).await?;
    let spec = json!({"limit": 100, "window_ms": 60000});
    let kept = first.put_policy("t0", "writes", spec.clone()).await?;
    let gone = first.put_policy("t1", "writes", spec).await?;
    let key = |tenant: &str, version: &serde_json::Value| {
        format!("qd:v1:{{{tenant}}}:writes:{version}:p")
    };
    let (kept_key, gone_key) = (key("t0", &kept["version"]), key("t1", &gone["version"]));
    assert!(
        all_params_within(&redis, 2, Duration::from_secs(5)).await,
        "both policies' parameters reach Redis"
    );
    let mut conn = redis.client().get_multiplexed_async_connection().await?;
    // A version above any this cluster has issued: written by a change the next daemon's view
    // has not caught up with, as far as it can tell. It must stay.
    let future_key = key("t0", &json!(1000));
    redis::cmd("COPY")
        .arg(&kept_key)
        .arg(&future_key)
        .query_async::<()>(&mut conn)
        .await?;

    // Writes refused: the DELETE is stored, but the agent cannot clear the parameters.
    redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(10_000)
        .arg("WRITE")
        .query_async::<()>(&mut conn)
        .await?;
    delete_policy(&first, "t1").await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    first.kill();
    redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query_async::<()>(&mut conn)
        .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        exists(&mut conn, &gone_key).await?,
        "the killed daemon's clear never ran, so there is something to sweep"
    );

    let data = first.data_dir();
    let data = data.to_str().expect("a UTF-8 temp path");
    let second =
        Daemon::start_with_env(&redis_config(&redis.url()), &[("QUOTAD_DATA_DIR", data)]).await?;
    let swept = eventually(Duration::from_secs(5), Duration::from_millis(50), || {
        let mut conn = conn.clone();
        let gone_key = gone_key.clone();
        async move { (!exists(&mut conn, &gone_key).await.ok()?).then_some(()) }
    })
    .await;
    assert!(
        swept.is_some(),
        "the deleted policy's parameters are swept: {}",
        second.log_text()
    );
    assert!(
        exists(&mut conn, &kept_key).await?,
        "the live policy's stay"
    );
    assert!(
        exists(&mut conn, &future_key).await?,
        "a version newer than the view stays"
    );
    assert_eq!(second.check("t0", "writes", 1).await?.status, 200);
    Ok(())
}
