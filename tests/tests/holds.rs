//! Holds of a token budget on two regions of real daemons, each on its own redis-server: an
//! estimate held, then settled below or above it, released, settled twice, left to expire,
//! settled after its daemon was killed, held over two budgets at once, settled through the other
//! region, and refused on bad input, each with exact figures.
//!
//! The budget is split (its fill time is exactly the 10 minutes home mode starts above) with a
//! floor of one half in each of the two regions: the floors leave the allocator nothing to move,
//! so each region's bucket keeps capacity 500 and refills 0.83 tokens a second whatever its
//! demand, and a region whose lease lapses (its daemon killed) keeps the same bucket. A reading
//! may then only differ from the figure a step predicts by the refill over the time it took,
//! which [`refill_within`] bounds.
//!
//! Levels are read with the allowance (`tokens_left` less `debt`, read without spending) and
//! the hold and settle answers; every hold names an `id`, so a call the daemon answers 503 (its
//! Redis or the other region slow on a loaded host: nothing changed) is retried as is.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use quotad_system_tests::{eventually, Cluster, Daemon, Reply, Timings, PEER_TOKEN, TOKEN};
use serde_json::{json, Value};

const REGIONS: [&str; 2] = ["a", "b"];
const POLICY: &str = "llm";
/// The budget: whole burst 1 000, refilled in 10 minutes; a charge may take a region's bucket
/// 100 below empty.
const LIMIT: u64 = 1_000;
const WINDOW_MS: u64 = 600_000;
const DEBT_LIMIT: i64 = 100;
/// Each region's bucket: half the budget.
const CAPACITY: i64 = 500;
const REFILL_PER_S: f64 = 0.5 * LIMIT as f64 / (WINDOW_MS as f64 / 1000.0);
const IDENTITY_KEY: (&str, &str) = ("QUOTAD_IDENTITY_KEY", "system-test-identity-key-0123");

fn budget() -> Value {
    json!({"limit": LIMIT, "window_ms": WINDOW_MS, "burst": LIMIT, "debt_limit": DEBT_LIMIT,
           "floor": 0.5})
}

/// Whole tokens a region's bucket may gain by refill within `d`: the refill, plus one for the
/// fraction of a token a whole-token reading hides.
fn refill_within(d: Duration) -> i64 {
    (REFILL_PER_S * d.as_secs_f64()).floor() as i64 + 1
}

/// A bucket's level in whole tokens (negative in debt), and when the reading was asked for.
#[derive(Debug, Clone, Copy)]
struct Reading {
    level: i64,
    sent: Instant,
}

/// The level of `tenant`'s `policy` in `d`'s region, read without spending.
async fn read(d: &Daemon, tenant: &str, policy: &str) -> anyhow::Result<Reading> {
    let sent = Instant::now();
    let r = d.get(&format!("/v1/tenants/{tenant}/allowance")).await?;
    anyhow::ensure!(r.status == 200, "allowance: {} {}", r.status, r.body);
    let p = r.body["policies"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["policy"] == policy))
        .with_context(|| format!("no {policy} in {}", r.body))?;
    let here = &p["this_region"];
    let left = here["tokens_left"].as_i64().context("tokens_left unread")?;
    let debt = here["debt"].as_i64().context("debt unread")?;
    Ok(Reading {
        level: left - debt,
        sent,
    })
}

/// Asserts that the level moved by `change` since `before`, give or take the refill since then.
async fn assert_moved(
    d: &Daemon,
    tenant: &str,
    before: Reading,
    change: i64,
    what: &str,
) -> anyhow::Result<Reading> {
    let now = read(d, tenant, POLICY).await?;
    let slack = refill_within(before.sent.elapsed());
    let moved = now.level - before.level;
    assert!(
        (change..=change + slack).contains(&moved),
        "{what}: {tenant}'s level went {} → {} ({moved:+}), expected {change:+} (+ up to \
         {slack} of refill)",
        before.level,
        now.level
    );
    Ok(now)
}

/// Sends a request with the admin token, again while it answers 503 (nothing changed: the
/// store or the other region did not answer), for 20 s at most. The reply and the 503s before it.
async fn call(
    d: &Daemon,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> anyhow::Result<(Reply, u32)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut retries = 0;
    loop {
        let r = d
            .request(method, path, Some(TOKEN), body.map(Value::to_string))
            .await?;
        if r.status != 503 || Instant::now() > deadline {
            if retries > 0 {
                eprintln!("{method} {path}: answered after {retries} × 503");
            }
            return Ok((r, retries));
        }
        retries += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A hold that must be admitted: its answer.
async fn hold(d: &Daemon, body: Value) -> anyhow::Result<Value> {
    let (r, retries) = call(d, "POST", "/v1/holds", Some(&body)).await?;
    anyhow::ensure!(r.status == 200, "hold {body}: {} {}", r.status, r.body);
    anyhow::ensure!(r.body["allowed"] == true, "{}", r.body);
    // A 503 may have come after the store held it: the retry is then the same hold.
    anyhow::ensure!(
        retries > 0 || r.body["replayed"] == false,
        "a first hold is no replay: {}",
        r.body
    );
    Ok(r.body)
}

/// A settle (`cost`) or release (`None`) sent to `d`, with its reply.
async fn settle(d: &Daemon, id: &str, cost: Option<u64>) -> anyhow::Result<(Reply, u32)> {
    match cost {
        Some(c) => {
            let body = json!({ "cost": c });
            call(d, "POST", &format!("/v1/holds/{id}/settle"), Some(&body)).await
        }
        None => call(d, "DELETE", &format!("/v1/holds/{id}"), None).await,
    }
}

/// The answer's one limit (or the named one).
fn limit<'a>(answer: &'a Value, policy: &str) -> &'a Value {
    answer["limits"]
        .as_array()
        .and_then(|ls| ls.iter().find(|l| l["policy"] == policy))
        .unwrap_or(&Value::Null)
}

fn figures(l: &Value) -> [i64; 5] {
    ["charged", "clamped", "refunded", "remaining", "debt"].map(|f| l[f].as_i64().unwrap_or(-1))
}

/// The problem's first field.
fn field(r: &Reply) -> &str {
    r.body["errors"][0]["field"].as_str().unwrap_or("")
}

/// Waits until both regions enforce half of every budget named, under a lease, and read it.
async fn until_split(cluster: &Cluster, budgets: &[(&str, &str)]) -> anyhow::Result<()> {
    for d in &cluster.daemons {
        for (tenant, policy) in budgets {
            let ok = eventually(
                Duration::from_secs(20),
                Duration::from_millis(100),
                || async {
                    let r = d
                        .get(&format!("/v1/tenants/{tenant}/allowance"))
                        .await
                        .ok()?;
                    let p = r.body["policies"]
                        .as_array()?
                        .iter()
                        .find(|p| p["policy"] == *policy)?
                        .clone();
                    let here = &p["this_region"];
                    (p["mode"] == "split"
                        && here["enforced_share"] == 0.5
                        && here["capacity"] == CAPACITY as f64
                        && here["tokens_left"].is_u64())
                    .then_some(())
                },
            )
            .await;
            ok.with_context(|| format!("{tenant}/{policy} never enforced half in each region"))?;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_settle_release_expire_and_relay_with_exact_figures() -> anyhow::Result<()> {
    let env: [(&str, &[(&str, &str)]); 2] = [("a", &[IDENTITY_KEY]), ("b", &[IDENTITY_KEY])];
    let mut cluster = Cluster::start_with_env(&REGIONS, &Timings::default(), &env).await?;
    let tenants = [
        "below", "above", "released", "twice", "expired", "restart", "multi", "relay", "bad",
    ];
    let a = cluster.daemon("a");
    for t in tenants {
        a.put_policy(t, POLICY, budget()).await?;
    }
    a.put_policy("multi", "daily", budget()).await?;
    let plan = json!({"policies": {"plan_llm": budget()}});
    let r = a
        .request(
            "PUT",
            "/v1/plans/default",
            Some(TOKEN),
            Some(plan.to_string()),
        )
        .await?;
    anyhow::ensure!(r.status == 200, "PUT plan: {} {}", r.status, r.body);
    let mut budgets: Vec<(&str, &str)> = tenants.iter().map(|t| (*t, POLICY)).collect();
    budgets.push(("multi", "daily"));
    until_split(&cluster, &budgets).await?;

    below(&cluster).await?;
    above(&cluster).await?;
    released(&cluster).await?;
    twice(&cluster).await?;
    expired(&cluster).await?;
    restart(&mut cluster).await?;
    all_or_nothing(&cluster).await?;
    plan_subject(&cluster).await?;
    relayed(&cluster).await?;
    bad_input(&cluster).await?;
    Ok(())
}

/// Held 100, settled at 40: 60 come back.
async fn below(cluster: &Cluster) -> anyhow::Result<()> {
    let a = cluster.daemon("a");
    let start = read(a, "below", POLICY).await?;
    let h = hold(
        a,
        json!({"tenant": "below", "policy": POLICY, "cost": 100, "id": "h1"}),
    )
    .await?;
    assert_eq!(h["hold_id"], "a.below.h1");
    assert_eq!(
        (&h["ttl_ms"], &h["decided_by"]),
        (&json!(60_000), &json!("a"))
    );
    let held = assert_moved(a, "below", start, -100, "held 100").await?;
    let (r, _) = settle(a, "a.below.h1", Some(40)).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        (&r.body["state"], &r.body["settled_by"]),
        (&json!("settled"), &json!("a"))
    );
    let l = limit(&r.body, POLICY);
    assert_eq!(
        figures(l)[..3],
        [0, 0, 60],
        "charged, clamped, refunded: {l}"
    );
    let after = assert_moved(a, "below", held, 60, "settled 100 at 40").await?;
    eprintln!(
        "below: level {} → held 100 → {} → settled at 40, refunded 60 → {}",
        start.level, held.level, after.level
    );
    Ok(())
}

/// Held 100 with 100 left, settled at 250: the 150 over the estimate go 100 into debt (the
/// debt limit) and 50 are clamped; checks are denied until a refund repays the debt.
async fn above(cluster: &Cluster) -> anyhow::Result<()> {
    let a = cluster.daemon("a");
    let t = "above";
    // A spare hold, released at the end to repay the debt.
    hold(
        a,
        json!({"tenant": t, "policy": POLICY, "cost": 150, "id": "spare"}),
    )
    .await?;
    let left = read(a, t, POLICY).await?.level;
    // Holds spend exactly (a check may reserve a batch): leave 100 tokens and a fraction.
    hold(
        a,
        json!({"tenant": t, "policy": POLICY, "cost": left - 100, "id": "drain"}),
    )
    .await?;
    let h = hold(
        a,
        json!({"tenant": t, "policy": POLICY, "cost": 100, "id": "big"}),
    )
    .await?;
    let before = read(a, t, POLICY).await?;
    // What is left is the fraction of a token the drain left, and the refill since.
    assert!(h["remaining"] == 0 || h["remaining"] == 1, "{h}");
    assert!((0..=1).contains(&before.level), "{before:?}");
    let settled_at = Instant::now();
    let (r, _) = settle(a, "a.above.big", Some(250)).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    let l = limit(&r.body, POLICY);
    let [charged, clamped, refunded, remaining, debt] = figures(l);
    // The level was 0 to 2 tokens (`before`, and the refill since): the 150 over the estimate
    // take it to the debt limit in whole tokens (100 or 101 charged), and the rest is clamped.
    assert_eq!((refunded, remaining, debt), (0, 0, DEBT_LIMIT), "{l}");
    assert!(
        (100..=101).contains(&charged) && charged + clamped == 150,
        "charged {charged}, clamped {clamped}: {l}"
    );
    let in_debt = read(a, t, POLICY).await?;
    let slack = refill_within(settled_at.elapsed());
    assert!(
        (-DEBT_LIMIT..=-DEBT_LIMIT + slack).contains(&in_debt.level),
        "{in_debt:?}"
    );
    // In debt a check of one token is denied, for as long as the refill takes to repay it.
    let check = json!({"tenant": t, "policy": POLICY, "cost": 1});
    let (c, _) = call(a, "POST", "/v1/check", Some(&check)).await?;
    assert_eq!(c.status, 429, "{}", c.body);
    let wait = c.body["retry_after_ms"].as_f64().unwrap_or(0.0);
    let repay_ms = DEBT_LIMIT as f64 / REFILL_PER_S * 1000.0;
    assert!(
        wait >= repay_ms - 1_500.0,
        "retry after {wait} ms, the debt takes {repay_ms} ms to repay"
    );
    // A hold of one token too (holds always ask the store, checks may be answered by the
    // daemon's denial cache until the wait above has passed).
    let one = |id: &str| json!({"tenant": t, "policy": POLICY, "cost": 1, "id": id});
    let (h, _) = call(a, "POST", "/v1/holds", Some(&one("probe1"))).await?;
    assert_eq!(h.status, 429, "{}", h.body);
    // Released, the spare hold's 150 repay the debt first: 50 are left and a hold passes.
    let (r, _) = settle(a, "a.above.spare", None).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    let l = limit(&r.body, POLICY);
    let [_, _, refunded, remaining, debt_after] = figures(l);
    assert_eq!((refunded, debt_after), (150, 0), "{l}");
    let slack = refill_within(in_debt.sent.elapsed());
    assert!(
        (in_debt.level + 150..=in_debt.level + 150 + slack).contains(&remaining),
        "{in_debt:?}, then {l}"
    );
    assert_moved(a, t, in_debt, 150, "released 150 in debt").await?;
    hold(a, one("probe2")).await?;
    eprintln!(
        "above: held 100 at level {}, settled at 250: charged {charged} into debt {debt}, \
         clamped {clamped}; a check in debt waits {wait} ms; a release of 150 repaid it, \
         leaving 50",
        before.level
    );
    Ok(())
}

/// Released: the whole estimate comes back, once; a settle afterwards is refused.
async fn released(cluster: &Cluster) -> anyhow::Result<()> {
    let a = cluster.daemon("a");
    let t = "released";
    let id = "a.released.r1";
    // Below full, so the refund is not capped by the capacity.
    hold(
        a,
        json!({"tenant": t, "policy": POLICY, "cost": 50, "id": "keep"}),
    )
    .await?;
    let start = read(a, t, POLICY).await?;
    hold(
        a,
        json!({"tenant": t, "policy": POLICY, "cost": 100, "id": "r1"}),
    )
    .await?;
    let held = assert_moved(a, t, start, -100, "held 100").await?;
    let (r, _) = settle(a, id, None).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        (&r.body["state"], &r.body["replayed"]),
        (&json!("released"), &json!(false))
    );
    let l = limit(&r.body, POLICY);
    assert_eq!(figures(l)[..3], [0, 0, 100], "{l}");
    let back = assert_moved(a, t, held, 100, "released 100").await?;
    // Again, by DELETE and by POST: the first answer, nothing given back twice.
    let (again, _) = settle(a, id, None).await?;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.body["replayed"], true, "{}", again.body);
    assert_eq!(limit(&again.body, POLICY)["refunded"], 100);
    let (post, _) = call(
        a,
        "POST",
        &format!("/v1/holds/{id}/release"),
        Some(&json!({})),
    )
    .await?;
    assert_eq!(
        (post.status, &post.body["replayed"]),
        (200, &json!(true)),
        "{}",
        post.body
    );
    let back = assert_moved(a, t, back, 0, "released twice more").await?;
    let (s, _) = settle(a, id, Some(10)).await?;
    assert_eq!(s.status, 409, "a settle after the release: {}", s.body);
    assert_eq!(s.body["code"], "CONFLICT", "{}", s.body);
    assert_moved(a, t, back, 0, "a settle after the release").await?;
    eprintln!("released: 100 back once; two more releases replayed, a settle 409");
    Ok(())
}

/// Settled twice at one cost: the first answer again; at another cost: refused.
async fn twice(cluster: &Cluster) -> anyhow::Result<()> {
    let a = cluster.daemon("a");
    let t = "twice";
    let id = "a.twice.t1";
    hold(
        a,
        json!({"tenant": t, "policy": POLICY, "cost": 100, "id": "t1"}),
    )
    .await?;
    let (first, _) = settle(a, id, Some(70)).await?;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(figures(limit(&first.body, POLICY))[..3], [0, 0, 30]);
    let settled = read(a, t, POLICY).await?;
    let (second, retries) = settle(a, id, Some(70)).await?;
    assert_eq!(second.status, 200, "{}", second.body);
    let mut expected = first.body.clone();
    expected["replayed"] = json!(true);
    if retries == 0 {
        assert_eq!(
            second.body, expected,
            "the same settle answers as the first did"
        );
    }
    let settled = assert_moved(a, t, settled, 0, "settled again at 70").await?;
    let (other, _) = settle(a, id, Some(71)).await?;
    assert_eq!(other.status, 409, "settled again at 71: {}", other.body);
    assert_moved(a, t, settled, 0, "settled again at 71").await?;
    eprintln!("twice: settled at 70 (refunded 30); again at 70 replayed, identical; at 71 409");
    Ok(())
}

/// Left past its TTL: a settle is refused and the estimate stays spent.
async fn expired(cluster: &Cluster) -> anyhow::Result<()> {
    let a = cluster.daemon("a");
    let t = "expired";
    hold(
        a,
        json!({"tenant": t, "policy": POLICY, "cost": 20, "id": "keep"}),
    )
    .await?;
    let start = read(a, t, POLICY).await?;
    let h = hold(
        a,
        json!({"tenant": t, "policy": POLICY, "cost": 100, "ttl_ms": 1500, "id": "e1"}),
    )
    .await?;
    assert_eq!(h["ttl_ms"], 1500);
    // The store's clock (Redis TIME) read after the answer is at or past the hold's start, so
    // once it passes that reading + 1 500 ms, the hold has expired.
    let conn = cluster.redis[cluster.index("a")]
        .client()
        .get_multiplexed_async_connection()
        .await?;
    let redis_ms = |mut conn: redis::aio::MultiplexedConnection| async move {
        let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.ok()?;
        Some(s * 1000 + us / 1000)
    };
    let held_by = redis_ms(conn.clone()).await.context("Redis TIME")?;
    let past = eventually(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { (redis_ms(conn.clone()).await? > held_by + 1500).then_some(()) },
    )
    .await;
    past.context("Redis's clock never passed the hold's TTL")?;
    let (r, _) = settle(a, "a.expired.e1", Some(10)).await?;
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(
        r.body["detail"].as_str().unwrap_or("").contains("expired"),
        "{}",
        r.body
    );
    let (r, _) = settle(a, "a.expired.e1", None).await?;
    assert_eq!(r.status, 409, "a release after expiry: {}", r.body);
    let after = assert_moved(a, t, start, -100, "expired unsettled").await?;
    eprintln!(
        "expired: held 100 for 1.5 s at level {}; past the TTL settle and release 409, level {}",
        start.level, after.level
    );
    Ok(())
}

/// Settled after the region's daemon was killed and started again: the hold is in Redis.
async fn restart(cluster: &mut Cluster) -> anyhow::Result<()> {
    let ai = cluster.index("a");
    let t = "restart";
    let start = read(&cluster.daemons[ai], t, POLICY).await?;
    hold(
        &cluster.daemons[ai],
        json!({"tenant": t, "policy": POLICY, "cost": 100, "id": "k1"}),
    )
    .await?;
    let killed_at = Instant::now();
    let pid = cluster.daemons[ai].pid();
    cluster.daemons[ai].kill();
    cluster.daemons[ai].respawn(&[("QUOTAD_PEER_TOKEN", PEER_TOKEN), IDENTITY_KEY])?;
    let d = &mut cluster.daemons[ai];
    if let Err(e) = d.wait_ready(Duration::from_secs(30)).await {
        return Err(e.context(d.log_text()));
    }
    let restarted_in = killed_at.elapsed();
    assert_ne!(pid, d.pid(), "a new process");
    let a = &cluster.daemons[ai];
    let (r, retries) = settle(a, "a.restart.k1", Some(30)).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(retries > 0 || r.body["replayed"] == false, "{}", r.body);
    let l = limit(&r.body, POLICY);
    assert_eq!(figures(l)[..3], [0, 0, 70], "{l}");
    let after = assert_moved(a, t, start, -30, "held 100, restarted, settled at 30").await?;
    eprintln!(
        "restart: held 100, daemon killed and ready again in {restarted_in:?}, settled at 30: \
         refunded 70, level {} → {}",
        start.level, after.level
    );
    Ok(())
}

/// Two budgets held at once: all or nothing.
async fn all_or_nothing(cluster: &Cluster) -> anyhow::Result<()> {
    let a = cluster.daemon("a");
    let t = "multi";
    let daily_left = read(a, t, "daily").await?.level;
    hold(
        a,
        json!({"tenant": t, "policy": "daily", "cost": daily_left - 20, "id": "drain"}),
    )
    .await?;
    let llm0 = read(a, t, POLICY).await?;
    let daily0 = read(a, t, "daily").await?;
    let both = |cost: u64, id: &str| json!({"tenant": t, "policies": [POLICY, "daily"], "cost": cost, "id": id});
    let (r, _) = call(a, "POST", "/v1/holds", Some(&both(50, "m1"))).await?;
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.body.get("hold_id").is_none(), "{}", r.body);
    assert_eq!(r.body["violated_policies"], json!(["daily"]), "{}", r.body);
    assert_eq!(limit(&r.body, POLICY)["allowed"], true, "{}", r.body);
    assert_eq!(limit(&r.body, "daily")["allowed"], false, "{}", r.body);
    let llm1 = assert_moved(a, t, llm0, 0, "denied on daily: llm").await?;
    let daily1 = read(a, t, "daily").await?;
    let slack = refill_within(daily0.sent.elapsed());
    assert!(
        (0..=slack).contains(&(daily1.level - daily0.level)),
        "{daily0:?} {daily1:?}"
    );

    let h = hold(a, both(15, "m2")).await?;
    assert_eq!(h["hold_id"], "a.multi.m2");
    let llm2 = assert_moved(a, t, llm1, -15, "held 15 on both: llm").await?;
    let (r, _) = settle(a, "a.multi.m2", Some(5)).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        figures(limit(&r.body, POLICY))[..3],
        [0, 0, 10],
        "{}",
        r.body
    );
    assert_eq!(
        figures(limit(&r.body, "daily"))[..3],
        [0, 0, 10],
        "{}",
        r.body
    );
    assert_moved(a, t, llm2, 10, "settled 15 at 5: llm").await?;
    let daily3 = read(a, t, "daily").await?;
    let slack = refill_within(daily1.sent.elapsed());
    assert!(
        (-5..=-5 + slack).contains(&(daily3.level - daily1.level)),
        "daily {daily1:?} → {daily3:?}"
    );
    eprintln!(
        "all or nothing: 50 on llm ({}) and daily ({}) denied, nothing spent; 15 held on both \
         and settled at 5: 10 back on each",
        llm0.level, daily0.level
    );
    Ok(())
}

/// A subject of the default plan, named by identity, holds and settles.
async fn plan_subject(cluster: &Cluster) -> anyhow::Result<()> {
    let a = cluster.daemon("a");
    let body = json!({"identity": "user-7", "policy": "plan_llm", "cost": 100, "id": "p1"});
    // The plan reaches both regions' views through the log: retried until it resolves.
    let held = eventually(
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async {
            let (r, _) = call(a, "POST", "/v1/holds", Some(&body)).await.ok()?;
            (r.status == 200).then_some(r.body)
        },
    )
    .await
    .context("the plan subject's hold was never admitted")?;
    let id = held["hold_id"].as_str().context("no hold_id")?.to_string();
    assert!(
        id.starts_with("a.") && id.ends_with(".p1") && !id.contains("user-7"),
        "{id}"
    );
    let sent = Instant::now();
    let path = format!("/v1/holds/{id}/settle");
    let as_identity = json!({"cost": 40, "identity": "user-7"});
    let (r, _) = call(a, "POST", &path, Some(&as_identity)).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    let l = limit(&r.body, "plan_llm");
    assert_eq!(figures(l)[..3], [0, 0, 60], "{l}");
    let rise = l["remaining"].as_i64().unwrap_or(-1) - held["remaining"].as_i64().unwrap_or(0);
    assert!(
        (60..=60 + refill_within(sent.elapsed())).contains(&rise),
        "{held} then {l}"
    );
    // Another subject may not settle it.
    let (r, _) = call(
        a,
        "POST",
        &path,
        Some(&json!({"cost": 40, "identity": "user-8"})),
    )
    .await?;
    assert_eq!((r.status, field(&r)), (400, "id"), "{}", r.body);
    eprintln!("plan subject: held 100 as identity, settled at 40: 60 back; another identity 400");
    Ok(())
}

/// Held in a, settled and released through b: relayed, and applied once, in a.
async fn relayed(cluster: &Cluster) -> anyhow::Result<()> {
    let (a, b) = (cluster.daemon("a"), cluster.daemon("b"));
    let t = "relay";
    hold(
        a,
        json!({"tenant": t, "policy": POLICY, "cost": 50, "id": "keep"}),
    )
    .await?;
    let start = read(a, t, POLICY).await?;
    let b_start = read(b, t, POLICY).await?;
    hold(
        a,
        json!({"tenant": t, "policy": POLICY, "cost": 100, "id": "x1"}),
    )
    .await?;
    let (r, _) = settle(b, "a.relay.x1", Some(30)).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["settled_by"], "a", "{}", r.body);
    assert_eq!(
        figures(limit(&r.body, POLICY))[..3],
        [0, 0, 70],
        "{}",
        r.body
    );
    let settled = assert_moved(a, t, start, -30, "held 100 in a, settled at 30 through b").await?;
    // Again through b and in a: replayed, nothing given back twice.
    for d in [b, a] {
        let (again, _) = settle(d, "a.relay.x1", Some(30)).await?;
        assert_eq!(again.status, 200, "{}", again.body);
        assert_eq!(again.body["replayed"], true, "{}", again.body);
    }
    let settled = assert_moved(a, t, settled, 0, "settled again twice").await?;
    // A release through b.
    hold(
        a,
        json!({"tenant": t, "policy": POLICY, "cost": 40, "id": "x2"}),
    )
    .await?;
    let (r, _) = settle(b, "a.relay.x2", None).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        (&r.body["state"], &r.body["settled_by"]),
        (&json!("released"), &json!("a"))
    );
    assert_moved(a, t, settled, 0, "held 40 in a, released through b").await?;
    // b's own bucket was never touched.
    assert_moved(b, t, b_start, 0, "b's bucket").await?;
    eprintln!("relayed: held in a, settled at 30 through b (70 back in a, once), released via b");
    Ok(())
}

/// Bad input: refused by field, nothing changed.
async fn bad_input(cluster: &Cluster) -> anyhow::Result<()> {
    let (a, b) = (cluster.daemon("a"), cluster.daemon("b"));
    let t = "bad";
    hold(
        a,
        json!({"tenant": t, "policy": POLICY, "cost": 10, "id": "mine"}),
    )
    .await?;
    let start = read(a, t, POLICY).await?;
    let h = |extra: Value| {
        let mut body = json!({"tenant": t, "policy": POLICY, "cost": 5});
        if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
            b.extend(e);
        }
        body
    };
    for (body, want) in [
        (h(json!({"cost": -1})), "cost"),
        (h(json!({"cost": 2.5})), "cost"),
        (h(json!({"ttl_ms": 0})), "ttl_ms"),
        (h(json!({"ttl_ms": 3_600_001})), "ttl_ms"),
        (h(json!({"ttl_ms": 100.5})), "ttl_ms"),
        (h(json!({"id": "a.b"})), "id"),
        (h(json!({"id": "k".repeat(65)})), "id"),
        (h(json!({"id": ""})), "id"),
    ] {
        let (r, _) = call(a, "POST", "/v1/holds", Some(&body)).await?;
        assert_eq!((r.status, field(&r)), (400, want), "{body}: {}", r.body);
    }
    for (path, body, want) in [
        ("/v1/holds/a.bad.mine/settle", json!({"cost": -1}), "cost"),
        ("/v1/holds/a.bad.mine/settle", json!({"cost": 1.5}), "cost"),
        ("/v1/holds/not-a-hold-id/settle", json!({"cost": 1}), "id"),
        ("/v1/holds/a.bad./settle", json!({"cost": 1}), "id"),
        (
            "/v1/holds/a.bad.mine/settle",
            json!({"cost": 1, "tenant": "relay"}),
            "id",
        ),
        ("/v1/holds/mars.bad.mine/settle", json!({"cost": 1}), "id"),
    ] {
        for d in [a, b] {
            let (r, _) = call(d, "POST", path, Some(&body)).await?;
            assert_eq!(
                (r.status, field(&r)),
                (400, want),
                "{path} {body}: {}",
                r.body
            );
        }
    }
    let (r, _) = call(a, "DELETE", "/v1/holds/not.a.hold.id!", None).await?;
    assert_eq!((r.status, field(&r)), (400, "id"), "{}", r.body);
    let (r, _) = call(
        a,
        "POST",
        "/v1/holds/a.bad.never/settle",
        Some(&json!({"cost": 1})),
    )
    .await?;
    assert_eq!(r.status, 404, "{}", r.body);
    let unchanged = assert_moved(a, t, start, 0, "after bad input").await?;
    // The hold is still open, at its estimate: settled at it, nothing moves either way.
    let (r, _) = settle(a, "a.bad.mine", Some(10)).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        (
            &r.body["replayed"],
            figures(limit(&r.body, POLICY))[..3].to_vec()
        ),
        (&json!(false), vec![0, 0, 0]),
        "{}",
        r.body
    );
    assert_moved(a, t, unchanged, 0, "settled at the estimate").await?;
    eprintln!("bad input: 8 holds and 13 settles or releases refused by field; level unchanged");
    Ok(())
}
