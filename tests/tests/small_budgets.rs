//! Budgets too small (or too slow) to split, on three regions: each lives whole in one home
//! region, the others forward their checks there, so the first checks of a fresh policy are
//! admitted wherever they land.

use std::time::Duration;

use quotad_system_tests::{eventually, Cluster, Timings};
use serde_json::{json, Value};

const REGIONS: [&str; 3] = ["a", "b", "c"];

/// Puts `spec` as `tenant`'s policy `p` through region b and waits until every region shows it
/// in home mode; returns its home.
async fn put_home_policy(cluster: &Cluster, tenant: &str, spec: Value) -> anyhow::Result<String> {
    cluster.daemon("b").put_policy(tenant, "p", spec).await?;
    let mut home = None;
    for name in REGIONS {
        let seen = eventually(
            Duration::from_secs(10),
            Duration::from_millis(50),
            || async {
                let r = cluster
                    .daemon(name)
                    .get(&format!("/v1/tenants/{tenant}/allowance"))
                    .await
                    .ok()?;
                let p = &r.body["policies"][0];
                (p["mode"] == "home").then(|| p["home"].as_str().map(str::to_string))?
            },
        )
        .await;
        let seen = seen.unwrap_or_else(|| panic!("region {name} never showed {tenant} at home"));
        assert_eq!(
            *home.get_or_insert_with(|| seen.clone()),
            seen,
            "regions disagree on the home"
        );
    }
    Ok(home.expect("three regions"))
}

/// One check of cost 1 of `tenant`'s policy in `region`: its status.
async fn check(cluster: &Cluster, region: &str, tenant: &str) -> anyhow::Result<(u16, Value)> {
    let r = cluster.daemon(region).check(tenant, "p", 1).await?;
    Ok((r.status, r.body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_budgets_admit_their_first_checks_wherever_they_land() -> anyhow::Result<()> {
    let cluster = Cluster::start(&REGIONS, &Timings::default()).await?;

    // Two a minute, burst two: 2/3 of a token per region if it were split.
    let home = put_home_policy(
        &cluster,
        "login",
        json!({"limit": 2, "window_ms": 60000, "burst": 2}),
    )
    .await?;
    let elsewhere: Vec<&str> = REGIONS.iter().copied().filter(|r| *r != home).collect();
    // The first check lands away from home, the second in the other region, the third at home.
    let order = [elsewhere[0], elsewhere[1], home.as_str()];
    let mut seen = Vec::new();
    for region in order {
        seen.push(check(&cluster, region, "login").await?);
    }
    assert_eq!(seen[0].0, 200, "first check in {}: {:?}", order[0], seen[0]);
    assert_eq!(
        seen[1].0, 200,
        "second check in {}: {:?}",
        order[1], seen[1]
    );
    assert_eq!(seen[2].0, 429, "third check at home: {:?}", seen[2]);
    // Denied with a time to retry, not "never": the bucket holds a token in 30 s.
    let retry = seen[2].1["retry_after_ms"].as_u64();
    assert!(
        retry.is_some_and(|ms| ms > 0 && ms <= 30_000),
        "{:?}",
        seen[2]
    );

    // A sliding window of two a minute: the same, split it would be 0 per region.
    let home = put_home_policy(
        &cluster,
        "reset",
        json!({"limit": 2, "window_ms": 60000, "algorithm": "sliding_window"}),
    )
    .await?;
    let elsewhere: Vec<&str> = REGIONS.iter().copied().filter(|r| *r != home).collect();
    let order = [elsewhere[1], home.as_str(), elsewhere[0]];
    let mut statuses = Vec::new();
    for region in order {
        statuses.push(check(&cluster, region, "reset").await?.0);
    }
    assert_eq!(statuses, [200, 200, 429], "sliding window in {order:?}");

    // One a month: admitted once, in any region, then denied everywhere.
    put_home_policy(
        &cluster,
        "export",
        json!({"limit": 1, "window_ms": 2_592_000_000u64}),
    )
    .await?;
    let mut statuses = Vec::new();
    for region in ["c", "a", "b"] {
        statuses.push(check(&cluster, region, "export").await?.0);
    }
    assert_eq!(statuses, [200, 429, 429], "one a month in c, a, b");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_small_budgets_are_refused_and_change_nothing() -> anyhow::Result<()> {
    let cluster = Cluster::start(&REGIONS, &Timings::default()).await?;
    put_home_policy(
        &cluster,
        "login",
        json!({"limit": 2, "window_ms": 60000, "burst": 2}),
    )
    .await?;
    let before = cluster
        .daemon("a")
        .get("/v1/tenants/login/allowance")
        .await?;
    for (spec, field) in [
        (
            json!({"limit": 2, "window_ms": 60000, "floor": 1.5}),
            "floor",
        ),
        (
            json!({"limit": 2, "window_ms": 60000, "floor": -0.01}),
            "floor",
        ),
        (json!({"limit": 0.5, "window_ms": 60000}), "limit"),
        (json!({"limit": 2, "window_ms": 60000, "burst": 0}), "burst"),
    ] {
        let r = cluster
            .daemon("b")
            .request(
                "PUT",
                "/v1/tenants/login/policies/p",
                Some(quotad_system_tests::TOKEN),
                Some(spec.to_string()),
            )
            .await?;
        assert_eq!(r.status, 400, "{spec}: {}", r.body);
        assert!(r.body.to_string().contains(field), "{spec}: {}", r.body);
    }
    // A cost above the burst could never be admitted: refused, nothing spent.
    let r = cluster.daemon("c").check("login", "p", 3).await?;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.to_string().contains("cost"), "{}", r.body);
    let after = cluster
        .daemon("a")
        .get("/v1/tenants/login/allowance")
        .await?;
    let policy = |v: &Value| v["policies"][0].clone();
    assert_eq!(policy(&after.body)["limit"], policy(&before.body)["limit"]);
    assert_eq!(
        policy(&after.body)["this_region"]["tokens_left"],
        policy(&before.body)["this_region"]["tokens_left"]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_a_month_refills_at_the_policys_rate() -> anyhow::Result<()> {
    let cluster = Cluster::start(&REGIONS, &Timings::default()).await?;
    let home = put_home_policy(
        &cluster,
        "exports",
        json!({"limit": 10, "window_ms": 2_592_000_000u64}),
    )
    .await?;
    let r = cluster
        .daemon(&home)
        .get("/v1/tenants/exports/allowance")
        .await?;
    let refill = r.body["policies"][0]["this_region"]["refill_per_s"]
        .as_f64()
        .expect("a refill rate");
    // The home holds the whole budget: 10 tokens per 30 days.
    let exact = 10.0 / 2_592_000.0;
    assert!(
        ((refill - exact) / exact).abs() <= 1e-6,
        "refill {refill} tokens/s, policy {exact}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_with_no_share_forwards_and_gets_share_back() -> anyhow::Result<()> {
    let cluster = Cluster::start(&REGIONS, &Timings::default()).await?;
    // Split (200 tokens of burst a region), no floor: demand only in b empties a and c.
    cluster
        .daemon("b")
        .put_policy("moving", "p", json!({"limit": 600, "window_ms": 60000}))
        .await?;
    let emptied = eventually(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            for _ in 0..5 {
                let _ = cluster.daemon("b").check("moving", "p", 1).await;
            }
            let (share, _) = cluster.share("c", "moving").await?;
            (share == 0.0).then_some(())
        },
    )
    .await;
    assert!(emptied.is_some(), "c's share never went to 0");
    // b's clients stop (b's bucket refills 10 tokens a second) and the tenant's traffic moves
    // to c: its very first check is admitted, by b, not denied.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, body) = check(&cluster, "c", "moving").await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["mode"], "forwarded", "{body}");
    // Share comes back to c (it reports what it forwarded as its own demand).
    let back = eventually(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            let _ = cluster.daemon("c").check("moving", "p", 1).await;
            let (share, _) = cluster.share("c", "moving").await?;
            (share > 0.0).then_some(share)
        },
    )
    .await;
    assert!(back.is_some(), "c never got share back");
    Ok(())
}
