//! Reservations against a real Redis and real daemons: a hot bucket costs Redis a call per
//! batch, not one per check; daemons and gateways sharing one Redis bucket never admit more
//! than the bucket grants between them; tokens held at shutdown go back.

use std::time::{Duration, Instant};

use quotad_system_tests::{
    evalsha_calls, eventually, metric_value, redis_config, Daemon, RegionSet, Timings,
};
use redis_harness::RedisServer;
use serde_json::json;

const TOKEN_BUCKET_LUA: &str = include_str!("../../lua/token_bucket.lua");
const UT: u64 = 1_000_000;

/// `n` checks of cost 1 on `tenant`'s `w`, `conc` at a time: how many were admitted. Every
/// one must be decided through Redis (mode `normal`).
async fn flood(d: &Daemon, tenant: &str, n: usize, conc: usize) -> anyhow::Result<u64> {
    let mut admitted = 0;
    for _ in 0..n / conc {
        let batch = (0..conc).map(|_| d.check(tenant, "w", 1));
        for r in futures::future::join_all(batch).await {
            let r = r?;
            anyhow::ensure!(r.body["mode"] == "normal", "{}", r.body);
            match r.status {
                200 => admitted += 1,
                429 => {}
                s => anyhow::bail!("a check answered {s}"),
            }
        }
    }
    Ok(admitted)
}

/// [`redis_config`] with a store timeout no loaded test host reaches: a slow call would open
/// the breaker, and the fail mode would decide instead of Redis.
fn config(redis: &RedisServer) -> String {
    redis_config(&redis.url())
        .replace("timeout_ms = 100", "timeout_ms = 5000")
        .replace("slow_call_ms = 100", "slow_call_ms = 5000")
}

async fn counter(d: &Daemon, name: &str) -> anyhow::Result<f64> {
    let (_, text) = d.get_text("/metrics").await?;
    Ok(metric_value(&text, name, &[]).unwrap_or(0.0))
}

#[tokio::test]
async fn a_hot_bucket_costs_redis_a_call_per_batch() -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    let d = Daemon::start(&config(&redis)).await?;
    // 1 000 000 a minute, burst 100 000: 1 % of it (a batch at most) is 1 000 tokens.
    d.put_policy(
        "hot",
        "w",
        json!({"limit": 1_000_000, "window_ms": 60_000, "burst": 100_000}),
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(600)).await;
    // Demand is measured over 100 ms before batches start.
    flood(&d, "hot", 400, 8).await?;
    let mut conn = redis.client().get_multiplexed_async_connection().await?;
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut conn)
        .await?;
    let hits_before = counter(&d, "quotad_reservation_hits_total").await?;
    let started = Instant::now();
    let n = 3_000;
    let admitted = flood(&d, "hot", n, 8).await?;
    let secs = started.elapsed().as_secs_f64();
    let calls = evalsha_calls(&mut conn).await?;
    let hits = counter(&d, "quotad_reservation_hits_total").await? - hits_before;
    let per_decision = calls as f64 / n as f64;
    eprintln!(
        "{n} checks in {secs:.2} s ({:.0}/s): {admitted} admitted, {calls} EVALSHA calls \
         ({per_decision:.4} per decision), {hits} answered from reservations",
        n as f64 / secs
    );
    assert_eq!(
        admitted, n as u64,
        "within the budget every check is admitted"
    );
    assert!(
        per_decision <= 0.05,
        "{calls} calls for {n} checks: {per_decision}"
    );
    assert!(hits >= 0.9 * n as f64, "{hits} hits");
    Ok(())
}

/// A gateway running the script on the daemons' Redis, as gateways do.
async fn gateway_call(
    conn: &mut redis::aio::MultiplexedConnection,
    script: &redis::Script,
    bucket: &str,
    params: &str,
) -> anyhow::Result<bool> {
    let r: Vec<i64> = script
        .key(bucket)
        .key(params)
        .key("qd:v1:active")
        .arg(1)
        .arg("")
        .arg("")
        .invoke_async(conn)
        .await?;
    Ok(r[0] == 1)
}

/// Two daemons of one region (a region set: one policy version, one agent) and a gateway on
/// the region's Redis, each daemon taking tokens in batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemons_and_a_gateway_on_one_redis_admit_no_more_than_the_bucket() -> anyhow::Result<()> {
    let set = RegionSet::start(&["r"], 2, &Timings::default()).await?;
    let (a, b) = (&set.daemons[0], &set.daemons[1]);
    // Burst 2 000, 200 a second: a batch is at most 20 tokens.
    let spec = json!({"limit": 200, "window_ms": 1000, "burst": 2000});
    let v = a.put_policy("shared", "w", spec).await?;
    let version = v["version"].as_u64().expect("a version");
    // The other daemon decides the same policy version: one bucket in Redis.
    let seen = eventually(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async {
            let r = b.get("/v1/tenants/shared/policies/w").await.ok()?;
            (r.body["version"].as_u64() == Some(version)).then_some(())
        },
    )
    .await;
    assert!(seen.is_some(), "both daemons name one bucket");
    let bucket = format!("qd:v1:{{shared}}:w:{version}:b");
    let params = format!("qd:v1:{{shared}}:w:{version}:p");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let script = redis::Script::new(TOKEN_BUCKET_LUA);
    let mut conn = set.redis[0]
        .client()
        .get_multiplexed_async_connection()
        .await?;

    let started = Instant::now();
    let (mut gw, mut offered) = (0u64, 0u64);
    let (mut from_a, mut from_b) = (0u64, 0u64);
    // Offered above the refill until the burst is spent and the callers have been denied
    // for a while.
    while offered < from_a + from_b + gw + 600 && started.elapsed() < Duration::from_secs(20) {
        let (ra, rb) = tokio::join!(flood(a, "shared", 40, 8), flood(b, "shared", 40, 8));
        from_a += ra?;
        from_b += rb?;
        for _ in 0..10 {
            gw += u64::from(gateway_call(&mut conn, &script, &bucket, &params).await?);
        }
        offered += 90;
    }
    let secs = started.elapsed().as_secs_f64();
    let hits_a = counter(a, "quotad_reservation_hits_total").await?;
    let hits_b = counter(b, "quotad_reservation_hits_total").await?;
    let total = from_a + from_b + gw;
    // The bucket started full: its burst plus its refill over the run (plus a token for the
    // millisecond rounding of the run's ends).
    let bound = 2_000.0 + 200.0 * secs + 1.0;
    eprintln!(
        "{secs:.2} s, {offered} offered: a {from_a} ({hits_a} from reservations), b {from_b} \
         ({hits_b}), gateway {gw}; {total} admitted against a bound of {bound:.0}"
    );
    assert!(total as f64 <= bound, "{total} > {bound}");
    // Everyone got tokens, and both daemons used reservations.
    assert!(from_a > 0 && from_b > 0 && gw > 0);
    assert!(hits_a > 0.0 && hits_b > 0.0, "{hits_a} / {hits_b}");
    // The bucket was spent and the callers denied, yet all but what the last batches hold
    // went to them.
    assert!(offered >= total + 600, "{offered} offered");
    assert!(
        total as f64 >= 2_000.0 + 200.0 * secs - 2.0 * 20.0 - 200.0,
        "{total}"
    );
    Ok(())
}

#[tokio::test]
async fn tokens_held_at_shutdown_go_back_to_redis() -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    let mut d = Daemon::start(&config(&redis)).await?;
    // 10 000 an hour, burst 10 000: a batch is at most 100 tokens, and the refill (2.8 a
    // second) is small against what a batch holds.
    let v = d
        .put_policy(
            "keep",
            "w",
            json!({"limit": 10_000, "window_ms": 3_600_000}),
        )
        .await?;
    let version = v["version"].as_u64().expect("a version");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let admitted = flood(&d, "keep", 1_203, 3).await?;
    assert_eq!(admitted, 1_203);
    let held_hits = counter(&d, "quotad_reservation_hits_total").await?;
    assert!(held_hits > 0.0);
    d.terminate(Duration::from_secs(10)).await?;
    // A peek at the bucket: the stored parameters decide; nothing held anywhere now.
    let script = redis::Script::new(TOKEN_BUCKET_LUA);
    let mut conn = redis.client().get_multiplexed_async_connection().await?;
    let r: Vec<i64> = script
        .key(format!("qd:v1:{{keep}}:w:{version}:b"))
        .key(format!("qd:v1:{{keep}}:w:{version}:p"))
        .key("qd:v1:active")
        .arg(0)
        .arg(10_000 * UT)
        .arg(10_000 * UT)
        .invoke_async(&mut conn)
        .await?;
    let left = r[1] as u64;
    eprintln!("{admitted} admitted, {left} left in Redis after the shutdown");
    // Every token not handed out is back: the bucket holds what it started with less what
    // was admitted, plus its refill (a few tokens in the test's few seconds).
    assert!(left >= 10_000 - admitted, "{left} left");
    assert!(left <= 10_000 - admitted + 30, "{left} left");
    Ok(())
}
