//! Readiness of a multi-region cluster (issue #36): `/readyz` answers 200 only once a daemon
//! can decide for its region. From the moment every region of a fresh cluster is ready, a pin
//! to each region commits at once, a policy put then is admitted on its first check in every
//! region, and a budget too small to split admits its tokens with none lost. A daemon that is
//! not a member yet says what it waits for, and becomes ready once it is added.

use std::time::Duration;

use quotad_system_tests::{eventually, Cluster, Daemon, Timings, TOKEN};
use serde_json::{json, Value};

const REGIONS: [&str; 3] = ["a", "b", "c"];

/// Polls `daemon` until its view holds `tenant`'s policy `policy` at `version`: the policy's
/// replication to that region, not its decision (nothing is checked meanwhile).
async fn holds_version(daemon: &Daemon, tenant: &str, policy: &str, version: u64) {
    let path = format!("/v1/tenants/{tenant}/policies/{policy}");
    let seen = eventually(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            let r = daemon.get(&path).await.ok()?;
            (r.body["version"].as_u64()? == version).then_some(())
        },
    )
    .await;
    assert!(
        seen.is_some(),
        "{} never held {tenant}/{policy} v{version}",
        daemon.base()
    );
}

/// The version a put answered with.
fn version_of(stored: &Value) -> u64 {
    stored["version"]
        .as_u64()
        .expect("a stored policy has a version")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ready_cluster_takes_pins_and_decides_new_policies_at_once() -> anyhow::Result<()> {
    // Returns as soon as every daemon's /readyz answers 200, and waits for nothing else.
    let cluster = Cluster::start(&REGIONS, &Timings::default()).await?;
    // A pin to each region, all through b, commits at once.
    for name in REGIONS {
        let r = cluster
            .daemon("b")
            .request(
                "PUT",
                &format!("/v1/tenants/pinned-{name}/pin"),
                Some(TOKEN),
                Some(json!({ "region": name }).to_string()),
            )
            .await?;
        assert_eq!(r.status, 204, "pin to {name}: {}", r.body);
    }

    // Split in three (200 tokens of burst a region): every region decides its first check
    // from its own share, here.
    let stored = cluster
        .daemon("b")
        .put_policy("acme", "writes", json!({"limit": 600, "window_ms": 60000}))
        .await?;
    let version = version_of(&stored);
    for name in REGIONS {
        let d = cluster.daemon(name);
        holds_version(d, "acme", "writes", version).await;
        let r = d.check("acme", "writes", 1).await?;
        assert_eq!(r.status, 200, "first check in {name}: {}", r.body);
        assert_eq!(
            r.body["mode"], "normal",
            "first check in {name}: {}",
            r.body
        );
        assert_eq!(r.body["decided_by"], name, "{}", r.body);
    }

    // Two a minute, burst two: too small to split, it lives whole in one home. Its two tokens
    // are admitted, one from each other region (forwarded home), and the home then denies:
    // no token was spent without an admission.
    let stored = cluster
        .daemon("c")
        .put_policy(
            "login",
            "p",
            json!({"limit": 2, "window_ms": 60000, "burst": 2}),
        )
        .await?;
    let version = version_of(&stored);
    for name in REGIONS {
        holds_version(cluster.daemon(name), "login", "p", version).await;
    }
    let allowance = cluster
        .daemon("a")
        .get("/v1/tenants/login/allowance")
        .await?;
    let policy = &allowance.body["policies"][0];
    assert_eq!(policy["mode"], "home", "{}", allowance.body);
    let home = policy["home"].as_str().expect("a home").to_string();
    let elsewhere: Vec<&str> = REGIONS.iter().copied().filter(|r| *r != home).collect();
    let mut answers = Vec::new();
    for name in [elsewhere[0], elsewhere[1], home.as_str()] {
        let r = cluster.daemon(name).check("login", "p", 1).await?;
        answers.push((name, r.status, r.body["remaining"].clone(), r.body));
    }
    let seen: Vec<(u16, Value)> = answers
        .iter()
        .map(|(_, s, left, _)| (*s, left.clone()))
        .collect();
    assert_eq!(
        seen,
        [(200, json!(1)), (200, json!(0)), (429, json!(0))],
        "checks in {elsewhere:?} then at home {home}: {answers:?}"
    );
    for (name, _, _, body) in &answers[..2] {
        assert_eq!(body["decided_by"], home.as_str(), "{name}: {body}");
    }

    for name in REGIONS {
        let d = cluster.daemon(name);
        assert_eq!(d.get_text("/readyz").await?, (200, "ready\n".to_string()));
        let s = d.get("/v1/status").await?;
        assert_eq!(s.body["ready"], true, "{name}: {}", s.body);
        assert_eq!(s.body["waiting_for"], json!([]), "{name}: {}", s.body);
    }

    // A daemon of a region not in the cluster serves, is not ready, and says why.
    let t = Timings::default();
    let d = cluster.start_joining("d", 4, "127.0.0.1", &t).await?;
    let (status, body) = d.daemon.get_text("/readyz").await?;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.starts_with("not ready: waiting for region d to be registered"),
        "{body}"
    );
    assert!(body.contains("a first lease"), "{body}");
    assert_eq!(d.daemon.get_text("/livez").await?.0, 200);
    let s = d.daemon.get("/v1/status").await?;
    assert_eq!(s.body["ready"], false, "{}", s.body);
    let waiting: Vec<&str> = s.body["waiting_for"]
        .as_array()
        .map(|w| w.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    assert!(
        waiting
            .first()
            .is_some_and(|w| w.starts_with("region d to be registered"))
            && waiting
                .last()
                .is_some_and(|w| w.starts_with("a first lease")),
        "{}",
        s.body
    );

    // Added to the cluster, it becomes ready.
    let lead = cluster.daemon("a").get("/v1/status").await?.body["raft"]["leader"]
        .as_str()
        .expect("a leader")
        .to_string();
    let add = json!({"node_id": 4, "region": "d", "peer": d.peer, "api": d.api});
    let r = cluster
        .daemon(&lead)
        .request(
            "POST",
            "/v1/cluster/members",
            Some(TOKEN),
            Some(add.to_string()),
        )
        .await?;
    assert_eq!(r.status, 204, "{}", r.body);
    let ready = eventually(
        Duration::from_secs(15),
        Duration::from_millis(50),
        || async { (d.daemon.get_text("/readyz").await.ok()?.0 == 200).then_some(()) },
    )
    .await;
    assert!(
        ready.is_some(),
        "d never ready: {:?}\n{}",
        d.daemon.get_text("/readyz").await,
        d.daemon.log_text()
    );
    Ok(())
}
