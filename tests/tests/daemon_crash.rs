//! A region's daemon killed (`kill -9`) while gateways keep calling its Redis directly with the
//! Lua script: the parameters the region agent wrote carry the lease end and the floor, so that
//! Redis drops to the floor by itself when the lease ends, while the coordinator hands the rest
//! of the region's share to the survivors. Without this the dead region's Redis would keep its
//! share forever and the survivors would get it too: overshoot with no bound.

use std::time::Duration;

use quotad_system_tests::{eventually, Cluster, Timings};
use serde_json::json;

const TOKEN_BUCKET_LUA: &str = include_str!("../../lua/token_bucket.lua");
const UT: f64 = 1_000_000.0;

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The one tenant's bucket and parameter keys in a region's Redis.
async fn keys(conn: &mut redis::aio::MultiplexedConnection) -> Option<(String, String)> {
    let found: Vec<String> = redis::cmd("KEYS")
        .arg("qd:v1:{acme}:writes:*:p")
        .query_async(conn)
        .await
        .ok()?;
    let p = found.into_iter().next()?;
    let b = format!("{}b", p.strip_suffix('p')?);
    Some((b, p))
}

/// A gateway calling a region's Redis directly, passing the whole budget as its fallback (the
/// stored parameters must win over it).
struct Gateway {
    script: redis::Script,
    conn: redis::aio::MultiplexedConnection,
    bucket: String,
    params: String,
}

impl Gateway {
    /// One decision; cost 0 is a peek at the level under the parameters in force.
    async fn call(&self, cost: u64) -> anyhow::Result<(bool, u64)> {
        let r: Vec<i64> = self
            .script
            .key(&self.bucket)
            .key(&self.params)
            .key("qd:v1:active")
            .arg(cost)
            .arg(6000 * UT as u64)
            .arg(100 * UT as u64)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok((r[0] == 1, r[1] as u64))
    }

    /// Drains the bucket, waits `ms`, and returns the refill in tokens per second over the
    /// measured time, with that time in seconds.
    async fn refill_rate(&self, ms: u64) -> anyhow::Result<(f64, f64)> {
        let (_, level) = self.call(0).await?;
        if level > 0 {
            let (ok, _) = self.call(level).await?;
            anyhow::ensure!(ok, "draining {level} tokens was refused");
        }
        let t0 = wall_ms();
        tokio::time::sleep(Duration::from_millis(ms)).await;
        let (_, level) = self.call(0).await?;
        let secs = (wall_ms() - t0) as f64 / 1000.0;
        Ok((level as f64 / secs, secs))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_daemons_redis_falls_to_its_floor_when_the_lease_ends() -> anyhow::Result<()> {
    let t = Timings::default();
    let mut cluster = Cluster::start(&["a", "b", "c"], &t).await?;
    // 6000 a minute = 100 tokens/s, burst 6000; floor 10 %.
    cluster
        .daemon("a")
        .put_policy(
            "acme",
            "writes",
            json!({"limit": 6000, "window_ms": 60000, "floor": 0.1}),
        )
        .await?;
    let c_share = cluster
        .leased_share("c", "acme", 0.2)
        .await
        .expect("c enforces its share under a lease");

    let ci = cluster.index("c");
    let mut conn = cluster.redis[ci]
        .client()
        .get_multiplexed_async_connection()
        .await?;
    // The agent's parameters in c's Redis: the share, the lease end, the floor.
    let (bkey, pkey) = eventually(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async { keys(&mut conn.clone()).await },
    )
    .await
    .expect("c's agent wrote parameters");
    let field = |h: &std::collections::HashMap<String, u64>, f: &str| {
        *h.get(f).unwrap_or_else(|| panic!("no field {f} in {h:?}"))
    };
    let h: std::collections::HashMap<String, u64> = redis::cmd("HGETALL")
        .arg(&pkey)
        .query_async(&mut conn)
        .await?;
    // The floor refills `frate` µt every `per` ms: 10 tokens a second.
    let (fcap, frate, per) = (field(&h, "fcap"), field(&h, "frate"), field(&h, "per"));
    assert_eq!(
        (fcap, frate * 1000 / per),
        (600 * UT as u64, 10 * UT as u64),
        "{h:?}"
    );
    let cap = field(&h, "cap") as f64 / UT;
    assert!(
        (cap - 6000.0 * c_share).abs() <= 6000.0 * 0.05,
        "c's capacity {cap} for share {c_share}"
    );
    let time: (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
    let redis_now = time.0 * 1000 + time.1 / 1000;
    let left = field(&h, "until").saturating_sub(redis_now);
    assert!(
        left > 0 && left <= t.lease_ms,
        "the stored lease end is {left} ms away (lease {} ms)",
        t.lease_ms
    );

    // c's own estimate of what it could overspend if cut off now: its non-floor share of the
    // burst plus two drift margins of refill, (1/3 − 0.1) · (6000 + 100 · 0.6) ≈ 1414.
    let r = cluster
        .daemon("c")
        .get("/v1/tenants/acme/allowance")
        .await?;
    let est = r.body["policies"][0]["worst_case_overshoot_tokens"]
        .as_f64()
        .unwrap_or(0.0);
    let want = (c_share - 0.1) * (6000.0 + 100.0 * 2.0 * t.drift_margin_ms as f64 / 1000.0);
    assert!(
        (est - want).abs() <= 60.0,
        "c estimates {est}, expected about {want}"
    );

    // Kill c's daemon; a gateway keeps calling c's Redis, passing the whole budget as its
    // fallback (the stored parameters must win over it).
    cluster.daemons[ci].kill();
    let killed_at = wall_ms();
    let h: std::collections::HashMap<String, u64> = redis::cmd("HGETALL")
        .arg(&pkey)
        .query_async(&mut conn)
        .await?;
    let lease_end = field(&h, "until");
    assert!(lease_end <= killed_at + t.lease_ms + 50);
    // The gateway's view of the bucket: a peek (cost 0) reports the level under the parameters
    // in force; a cost of the whole level drains it. Refill rates tell share from floor.
    let g = Gateway {
        script: redis::Script::new(TOKEN_BUCKET_LUA),
        conn: conn.clone(),
        bucket: bkey.clone(),
        params: pkey.clone(),
    };
    let call = |cost| g.call(cost);
    // Just after the kill the share still holds: a full bucket of the share's capacity.
    let (_, level) = call(0).await?;
    assert!(
        level as f64 > 600.0 && level as f64 <= cap + 1.0,
        "c's bucket holds {level} just after the kill (share capacity {cap}, floor 600)"
    );
    let share_rate = 100.0 * c_share;
    let room = lease_end
        .saturating_sub(wall_ms())
        .saturating_sub(300)
        .min(1_000);
    assert!(room >= 500, "only {room} ms of lease left after the kill");
    let (before, secs) = g.refill_rate(room).await?;
    assert!(
        (before - share_rate).abs() <= 2.0 / secs,
        "refill {before}/s over {secs} s before the lease end; the share's is {share_rate}/s"
    );
    // From the lease end on, the floor: 10 tokens/s, whatever the gateway passes.
    let wait = (lease_end + 50).saturating_sub(wall_ms());
    tokio::time::sleep(Duration::from_millis(wait)).await;
    let (after, secs) = g.refill_rate(2_000).await?;
    assert!(
        (after - 10.0).abs() <= 2.0 / secs,
        "refill {after}/s over {secs} s after the lease end; the floor's is 10/s"
    );
    println!(
        "c's Redis after its daemon died: share {c_share:.3}, refill {before:.1}/s before the \
         lease end ({} ms after the kill), {after:.1}/s after",
        lease_end - killed_at
    );

    // With demand in a and b, the survivors take the rest of c's share (only now that c's
    // lease is over), and never more than 1 − c's floor.
    let (ab, c) = eventually(
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async {
            for name in ["a", "b"] {
                for _ in 0..5 {
                    cluster
                        .daemon(name)
                        .check("acme", "writes", 20)
                        .await
                        .ok()?;
                }
            }
            let r = cluster
                .daemon("a")
                .get("/v1/tenants/acme/allowance")
                .await
                .ok()?;
            let regions = r.body["policies"][0]["regions"].as_array()?.clone();
            let share = |n: &str| {
                regions
                    .iter()
                    .find(|g| g["region"] == n)
                    .and_then(|g| g["share"].as_f64())
            };
            let (a, b, c) = (share("a")?, share("b")?, share("c")?);
            (a + b > 1.0 - c_share + 0.05).then_some((a + b, c))
        },
    )
    .await
    .expect("a and b take over c's non-floor share");
    assert!(
        ab <= 0.9 + 1e-6 && c >= 0.1 - 1e-6,
        "a + b = {ab}, c = {c}: the survivors hold more than 1 − c's floor"
    );
    Ok(())
}
