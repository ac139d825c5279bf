//! Three regions on loopback: three redis-server and three quotad processes, Raft between the
//! daemons through fault-injecting proxies.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quotad_system_tests::{eventually, Cluster, Timings};
use serde_json::json;

/// Admissions as (time since start, tokens).
type Log = Arc<Mutex<Vec<(Duration, u64)>>>;

/// Sends `rate` checks per second through `region` until `until`, logging admissions.
fn drive(
    cluster: &Arc<Cluster>,
    region: &str,
    rate: u32,
    start: Instant,
    until: Instant,
    log: Log,
) -> tokio::task::JoinHandle<()> {
    let cluster = cluster.clone();
    let region = region.to_string();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        while Instant::now() < until {
            tick.tick().await;
            if let Ok(r) = cluster.daemon(&region).check("acme", "writes", 1).await {
                if r.status == 200 {
                    log.lock().unwrap().push((start.elapsed(), 1));
                }
            }
        }
    })
}

/// The most tokens admitted in any window of `w` over the log.
fn max_in_window(log: &[(Duration, u64)], w: Duration) -> u64 {
    let mut times: Vec<Duration> = log.iter().map(|(t, _)| *t).collect();
    times.sort();
    let mut best = 0;
    let mut lo = 0;
    for hi in 0..times.len() {
        while times[hi] - times[lo] >= w {
            lo += 1;
        }
        best = best.max((hi - lo + 1) as u64);
    }
    best
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn share_follows_demand_and_the_global_bound_holds() -> anyhow::Result<()> {
    let cluster = Arc::new(Cluster::start(&["a", "b", "c"], &Timings::default()).await?);
    // 50 tokens/s, burst 50: the global bucket admits at most 50 + 50·W in any window W.
    cluster
        .daemon("b")
        .put_policy(
            "acme",
            "writes",
            json!({"limit": 50, "window_ms": 1000, "floor": 0.05}),
        )
        .await?;
    let initial = eventually(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async { cluster.share("a", "acme").await },
    )
    .await
    .expect("region a sees the policy");
    assert!(initial.0 < 0.4, "a starts near an even split: {initial:?}");

    // 80% of the traffic through a, at twice the budget in total.
    let start = Instant::now();
    let until = start + Duration::from_secs(12);
    let log: Log = Arc::default();
    let tasks = [
        drive(&cluster, "a", 80, start, until, log.clone()),
        drive(&cluster, "b", 10, start, until, log.clone()),
        drive(&cluster, "c", 10, start, until, log.clone()),
    ];
    let risen = eventually(
        Duration::from_secs(10),
        Duration::from_millis(200),
        || async {
            let (share, _) = cluster.share("a", "acme").await?;
            (share >= 0.5).then_some(share)
        },
    )
    .await;
    for t in tasks {
        t.await?;
    }
    let a = cluster.share("a", "acme").await;
    eprintln!(
        "a's share: {initial:?} at start, first seen at or above 0.5: {risen:?}, at the end: {a:?}"
    );
    assert!(
        risen.is_some(),
        "a's share rises toward its demand (now {a:?}):\n{}",
        cluster.daemon("a").log_text()
    );

    let log = log.lock().unwrap().clone();
    let epsilon = 0.1;
    for w_ms in [1000u64, 5000] {
        let bound = (50.0 + 50.0 * w_ms as f64 / 1000.0) * (1.0 + epsilon);
        let seen = max_in_window(&log, Duration::from_millis(w_ms));
        eprintln!("window {w_ms} ms: at most {seen} admitted (bound {bound:.0})");
        assert!(
            (seen as f64) <= bound,
            "{seen} admitted in a {w_ms} ms window, above {bound}"
        );
    }
    Ok(())
}

/// One sample of the leader-side picture during a partition.
#[derive(Debug, Clone, Copy)]
struct Sample {
    wall_ms: u64,
    ab_share: f64,
    c_share: f64,
}

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

async fn grants(cluster: &Cluster, from: &str) -> Option<(f64, f64, u64)> {
    let r = cluster
        .daemon(from)
        .get("/v1/tenants/acme/allowance")
        .await
        .ok()?;
    let regions = r.body["policies"][0]["regions"].as_array()?.clone();
    let get = |name: &str| regions.iter().find(|g| g["region"] == name).cloned();
    let (a, b, c) = (get("a")?, get("b")?, get("c")?);
    Some((
        a["share"].as_f64()? + b["share"].as_f64()?,
        c["share"].as_f64()?,
        c["lease_expires_ms"].as_u64().unwrap_or(0),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_region_keeps_its_lease_then_its_floor_and_rejoins() -> anyhow::Result<()> {
    let t = Timings::default();
    let cluster = Arc::new(Cluster::start(&["a", "b", "c"], &t).await?);
    cluster
        .daemon("a")
        .put_policy(
            "acme",
            "writes",
            json!({"limit": 50, "window_ms": 1000, "floor": 0.1}),
        )
        .await?;
    // Every region holds a lease on its share before the cut.
    let settled = cluster.leased_share("c", "acme", 0.2).await;
    let c_share = settled.expect("c enforces its share under a lease");

    let start = Instant::now();
    let until = start + Duration::from_secs(14);
    let log: Log = Arc::default();
    let tasks = [
        drive(&cluster, "a", 40, start, until, log.clone()),
        drive(&cluster, "b", 40, start, until, log.clone()),
        drive(&cluster, "c", 20, start, until, log.clone()),
    ];
    tokio::time::sleep(Duration::from_secs(1)).await;
    let cut_at = wall_ms();
    cluster.isolate("c");
    // What c holds at the cut: it cannot acknowledge anything after it, so it may enforce this
    // share until its lease ends (the allocator may have moved shares before the cut, with c's
    // acknowledgement, so the share settled earlier is not the reference).
    let (lease_at_cut, c_at_cut) = grants(&cluster, "a")
        .await
        .map_or((0, c_share), |g| (g.2, g.1));

    // C keeps its share while its lease runs, then falls to its floor. Each of c's samples
    // is stamped when its request was sent: c answered at or after that, so a sample sent past
    // the lease's end that still shows more than the floor is a fault, however long the
    // answers take on a loaded host.
    let lease_ms = t.lease_ms;
    let lease_over = cut_at + lease_ms + 1_000;
    let mut samples = Vec::new();
    let mut c_floor_at = None;
    let mut last_c_share = c_share;
    while Instant::now() < until - Duration::from_secs(3) || c_floor_at.is_none() {
        if Instant::now() > until + Duration::from_secs(20) {
            break;
        }
        if let Some((ab, c, _)) = grants(&cluster, "a").await {
            samples.push(Sample {
                wall_ms: wall_ms(),
                ab_share: ab,
                c_share: c,
            });
        }
        let sent = wall_ms();
        if let Some((share, enforced)) = cluster.share("c", "acme").await {
            last_c_share = share;
            let on_floor = (enforced - 0.1).abs() < 1e-6;
            if c_floor_at.is_none() && on_floor {
                c_floor_at = Some(sent);
            }
            assert!(
                on_floor || sent <= lease_over,
                "c enforced {enforced} (more than its floor) {} ms after the cut (lease {lease_ms} ms)",
                sent - cut_at
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if c_floor_at.is_none() {
        let status = cluster.daemon("c").get("/v1/status").await.map(|r| r.body);
        let allowance = cluster
            .daemon("c")
            .get("/v1/tenants/acme/allowance")
            .await
            .map(|r| r.body);
        let log = cluster.daemon("c").log_text();
        let tail: String = log.lines().rev().take(30).collect::<Vec<_>>().join("\n");
        panic!("c never fell back to its floor\nstatus: {status:?}\nallowance: {allowance:?}\nlog (newest first):\n{tail}");
    }
    assert!(
        last_c_share > 0.0,
        "c's last granted share is still visible to it"
    );
    // A and B reuse only C's non-floor share, and only after C's lease expired.
    let margin = t.drift_margin_ms;
    let mut reused = false;
    for s in &samples {
        assert!(s.ab_share <= 0.9 + 1e-6, "a and b took c's floor: {s:?}");
        if s.ab_share > 1.0 - c_at_cut + 0.001 {
            reused = true;
            assert!(
                s.wall_ms > lease_at_cut + margin,
                "c's share reused at {} before its lease ended at {lease_at_cut} (+{margin}): {s:?}",
                s.wall_ms
            );
        }
        assert!(s.c_share >= 0.1 - 1e-6, "c keeps at least its floor: {s:?}");
    }
    assert!(
        reused,
        "a and b reuse c's non-floor share once its lease is over: {samples:?}"
    );

    for task in tasks {
        task.await?;
    }
    let log = log.lock().unwrap().clone();
    for w_ms in [1000u64, 5000] {
        let bound = (50.0 + 50.0 * w_ms as f64 / 1000.0) * 1.1;
        let seen = max_in_window(&log, Duration::from_millis(w_ms));
        eprintln!("partition, window {w_ms} ms: at most {seen} admitted (bound {bound:.0})");
        assert!(
            (seen as f64) <= bound,
            "{seen} admitted in a {w_ms} ms window, above {bound}"
        );
    }

    cluster.heal();
    let rejoined = eventually(
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let s = cluster.daemon("c").get("/v1/status").await.ok()?;
            let (share, enforced) = cluster.share("c", "acme").await?;
            (s.body["raft"]["leader"].is_string()
                && enforced == share
                && s.body["lease"]["remaining_ms"].as_u64()? > 0)
                .then_some(share)
        },
    )
    .await;
    assert!(
        rejoined.is_some(),
        "c rejoins and holds a lease again:\n{}",
        cluster.daemon("c").log_text()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_tenant_is_decided_by_its_home() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(&["a", "b", "c"], &Timings::default()).await?;
    let b = cluster.daemon("b");
    // A floor of 5 tokens that refills one token every 12 s: the floor checks below count
    // exactly 5 however slowly a loaded host answers them.
    b.put_policy(
        "vip",
        "writes",
        json!({"limit": 500, "window_ms": 60000, "floor": 0.01}),
    )
    .await?;
    b.put_policy(
        "vip-strict",
        "writes",
        json!({"limit": 50, "window_ms": 1000, "fail_mode": "closed"}),
    )
    .await?;
    for tenant in ["vip", "vip-strict"] {
        let r = b
            .request(
                "PUT",
                &format!("/v1/tenants/{tenant}/pin"),
                Some(quotad_system_tests::TOKEN),
                Some(r#"{"region":"a"}"#.into()),
            )
            .await?;
        assert_eq!(r.status, 204, "{}", r.body);
    }
    let forwarded = eventually(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let r = cluster.daemon("b").check("vip", "writes", 1).await.ok()?;
            (r.body["decided_by"] == "a").then_some(r)
        },
    )
    .await
    .expect("checks in b are decided by a");
    assert_eq!(
        (forwarded.status, forwarded.body["mode"].as_str()),
        (200, Some("forwarded"))
    );
    assert_eq!(forwarded.body["region"], "b");
    // A client claiming to be a forwarding peer is forwarded all the same.
    let spoof = reqwest::Client::new()
        .post(format!("{}/v1/check", cluster.daemon("b").base()))
        .header("x-quotad-forwarded", "1")
        .json(&json!({"tenant": "vip", "policy": "writes"}))
        .send()
        .await?
        .json::<serde_json::Value>()
        .await?;
    assert_eq!(spoof["decided_by"], "a", "{spoof}");
    // The pin is the tenant's: a policy created after it is decided by the home as well.
    cluster
        .daemon("b")
        .put_policy("vip", "reads", json!({"limit": 50, "window_ms": 1000}))
        .await?;
    let later = eventually(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let r = cluster.daemon("b").check("vip", "reads", 1).await.ok()?;
            (r.body["decided_by"] == "a").then_some(r)
        },
    )
    .await
    .expect("checks of a policy created after the pin are decided by a");
    assert_eq!(later.body["mode"], "forwarded", "{}", later.body);

    // A batch in b mixing the pinned tenant's checks with a tenant decided in b: each is
    // decided where a single check would be, and the results come back in request order.
    b.put_policy("plain", "writes", json!({"limit": 50, "window_ms": 1000}))
        .await?;
    let (vip, plain, reads) = (
        json!({"tenant": "vip", "policy": "writes"}),
        json!({"tenant": "plain", "policy": "writes"}),
        json!({"tenant": "vip", "policy": "reads"}),
    );
    let batch = json!({"checks": [vip, plain, reads, vip, plain]}).to_string();
    let results = eventually(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let r = cluster
                .daemon("b")
                .request("POST", "/v1/check/batch", None, Some(batch.clone()))
                .await
                .ok()?;
            let items = r.body["results"].as_array()?.clone();
            items.iter().all(|i| i["status"] == 200).then_some(items)
        },
    )
    .await
    .expect("a batch in b is decided once b knows every policy");
    let by: Vec<_> = results
        .iter()
        .map(|i| {
            let d = &i["decision"];
            (d["decided_by"].as_str(), d["mode"].as_str())
        })
        .collect();
    let (home, here) = ((Some("a"), Some("forwarded")), (Some("b"), Some("normal")));
    assert_eq!(by, [home, here, home, home, here], "{results:?}");

    // Home unreachable: the policy decides (floor in b, or deny).
    let a = cluster.index("a");
    cluster.daemons[a].kill();
    let r = cluster.daemons[cluster.index("b")]
        .check("vip", "writes", 1)
        .await?;
    assert_eq!(
        (
            r.status,
            r.body["mode"].as_str(),
            r.body["decided_by"].as_str()
        ),
        (200, Some("home_unreachable_floor"), Some("b")),
        "{}",
        r.body
    );
    // At the floor (1 % of a 500-token burst) b admits 5 and then denies.
    let mut admitted = 1;
    for _ in 0..10 {
        if cluster.daemons[cluster.index("b")]
            .check("vip", "writes", 1)
            .await?
            .status
            == 200
        {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 5, "b decides at its floor while a is unreachable");
    let r = cluster.daemons[cluster.index("b")]
        .check("vip-strict", "writes", 1)
        .await?;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.body["code"], "TEMPORARY_REDUCED_CAPACITY");
    // In a batch, each check whose home is unreachable follows its own policy: vip's floor is
    // spent (429 from b), vip-strict fails closed (503).
    let batch = json!({"checks": [
        {"tenant": "vip", "policy": "writes"},
        {"tenant": "vip-strict", "policy": "writes"},
    ]})
    .to_string();
    let r = cluster.daemons[cluster.index("b")]
        .request("POST", "/v1/check/batch", None, Some(batch))
        .await?;
    let items = &r.body["results"];
    assert_eq!(
        (items[0]["status"].as_u64(), items[1]["status"].as_u64()),
        (Some(429), Some(503)),
        "{}",
        r.body
    );
    assert_eq!(
        items[0]["decision"]["mode"], "home_unreachable_floor",
        "{}",
        r.body
    );
    assert_eq!(
        items[1]["problem"]["code"], "TEMPORARY_REDUCED_CAPACITY",
        "{}",
        r.body
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_batch_is_one_replicated_step_and_a_floor_the_regions_cannot_hold_is_a_400(
) -> anyhow::Result<()> {
    use quotad_system_tests::TOKEN;
    const N: usize = 200;
    let cluster = Cluster::start(&["a", "b", "c"], &Timings::default()).await?;
    let policies: Vec<_> = (0..N)
        .map(|i| json!({"tenant": format!("bulk-{i}"), "policy": "writes", "limit": 10, "window_ms": 1000}))
        .collect();
    let r = cluster
        .daemon("c")
        .request(
            "POST",
            "/v1/policies/batch",
            Some(TOKEN),
            Some(json!({ "policies": policies }).to_string()),
        )
        .await?;
    assert_eq!(r.status, 200, "{}", r.body);
    let versions: Vec<u64> = r.body["policies"]
        .as_array()
        .expect("the stored policies")
        .iter()
        .map(|p| p["version"].as_u64().expect("a version"))
        .collect();
    assert_eq!(versions.len(), N);
    assert!(
        versions.windows(2).all(|w| w[1] == w[0] + 1),
        "consecutive versions in request order: {versions:?}"
    );
    // Every region applies the batch and decides its policies.
    for region in ["a", "b", "c"] {
        let d = cluster.daemon(region);
        let last = format!("/v1/tenants/bulk-{}/policies/writes", N - 1);
        let seen = eventually(
            Duration::from_secs(10),
            Duration::from_millis(100),
            || async {
                let r = d.get(&last).await.ok()?;
                (r.body["version"].as_u64() == versions.last().copied()).then_some(())
            },
        )
        .await;
        assert!(seen.is_some(), "{region} has the whole batch");
        let r = d.check("bulk-0", "writes", 1).await?;
        assert_eq!(r.status, 200, "{region}: {}", r.body);
    }

    // A floor the three regions cannot all reserve: a 400 naming the field, for a single PUT
    // and for a batch, whose valid entries are not stored either.
    let b = cluster.daemon("b");
    let r = b
        .request(
            "PUT",
            "/v1/tenants/greedy/policies/writes",
            Some(TOKEN),
            Some(json!({"limit": 10, "window_ms": 1000, "floor": 0.5}).to_string()),
        )
        .await?;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.body["code"], "INVALID_POLICY");
    assert_eq!(r.body["errors"][0]["field"], "floor", "{}", r.body);
    let batch = json!({"policies": [
        {"tenant": "fine", "policy": "writes", "limit": 10, "window_ms": 1000},
        {"tenant": "greedy", "policy": "writes", "limit": 10, "window_ms": 1000, "floor": 0.5},
    ]});
    let r = b
        .request(
            "POST",
            "/v1/policies/batch",
            Some(TOKEN),
            Some(batch.to_string()),
        )
        .await?;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        r.body["errors"][0]["field"], "policies[1].floor",
        "{}",
        r.body
    );
    // Many refused: the first hundred named, the rest counted.
    let greedy: Vec<_> = (0..150)
        .map(|i| json!({"tenant": format!("greedy-{i}"), "policy": "writes", "limit": 10, "window_ms": 1000, "floor": 0.5}))
        .collect();
    let r = b
        .request(
            "POST",
            "/v1/policies/batch",
            Some(TOKEN),
            Some(json!({ "policies": greedy }).to_string()),
        )
        .await?;
    let errors = r.body["errors"].as_array().expect("errors");
    assert_eq!((r.status, errors.len()), (400, 101), "{}", r.body);
    assert_eq!(errors[100]["field"], "policies");
    assert!(
        errors[100]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("50 more")),
        "{}",
        errors[100]
    );
    for region in ["a", "b", "c"] {
        for tenant in ["fine", "greedy"] {
            let r = cluster
                .daemon(region)
                .get(&format!("/v1/tenants/{tenant}/policies/writes"))
                .await?;
            assert_eq!(r.status, 404, "{region}: {tenant} was not stored");
        }
    }
    Ok(())
}
