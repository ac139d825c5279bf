//! Adding a region: `POST /v1/cluster/members` adds a daemon started to join, addressed by host
//! name, as a learner, and `POST /v1/cluster/members/{id}/promote` makes it a voter; its region
//! then takes a share of each policy and decides from its own Redis.
//!
//! Removing a region: `DELETE /v1/cluster/members/{id}` drains its region (shares and floors
//! move to the others, revoke before grant), then takes it out of the coordinator's state and
//! the Raft group, so the budget is whole again in the regions that remain.

use std::time::Duration;

use quotad_system_tests::{eventually, params_present, Cluster, Daemon, Timings, TOKEN};
use serde_json::{json, Value};

/// The grants in the allowance `from` serves: region name and share.
async fn grants(cluster: &Cluster, from: &str) -> Option<Vec<(String, f64)>> {
    let r = cluster
        .daemon(from)
        .get("/v1/tenants/acme/allowance")
        .await
        .ok()?;
    r.body["policies"][0]["regions"]
        .as_array()?
        .iter()
        .map(|g| Some((g["region"].as_str()?.to_string(), g["share"].as_f64()?)))
        .collect()
}

fn this_region(allowance: &Value) -> &Value {
    &allowance["policies"][0]["this_region"]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_region_leaves_the_whole_budget_to_the_others() -> anyhow::Result<()> {
    let cluster = Cluster::start(&["a", "b", "c"], &Timings::default()).await?;
    cluster
        .daemon("a")
        .put_policy(
            "acme",
            "writes",
            json!({"limit": 60, "window_ms": 1000, "floor": 0.1}),
        )
        .await?;
    let status = cluster.daemon("a").get("/v1/status").await?;
    let lead = status.body["raft"]["leader"]
        .as_str()
        .expect("a leader")
        .to_string();
    let gone = ["c", "b", "a"].into_iter().find(|n| *n != lead).unwrap();
    let kept: Vec<&str> = ["a", "b", "c"].into_iter().filter(|n| *n != gone).collect();
    let node_id = cluster.index(gone) + 1;
    let held = eventually(
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async {
            let g = grants(&cluster, &lead).await?;
            (g.len() == 3 && g.iter().all(|(_, s)| *s > 0.1)).then_some(g)
        },
    )
    .await;
    eprintln!("before: {held:?}");
    assert!(held.is_some(), "every region holds a share");

    // Only the leader changes membership; a follower says who leads.
    let follower = kept.iter().find(|n| **n != lead).unwrap();
    let path = format!("/v1/cluster/members/{node_id}");
    let r = cluster
        .daemon(follower)
        .request("DELETE", &path, Some(TOKEN), None)
        .await?;
    assert_eq!(r.status, 409, "{}", r.body);
    let r = cluster
        .daemon(&lead)
        .request("DELETE", &path, Some(TOKEN), None)
        .await?;
    assert_eq!(r.status, 202, "the region drains: {}", r.body);

    // While it drains, the granted shares never sum above the budget; then the region is gone
    // and the two left hold all of it.
    let samples = std::sync::Mutex::new(Vec::new());
    let done = eventually(
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async {
            let g = grants(&cluster, &lead).await?;
            samples.lock().unwrap().push(g.clone());
            let sum: f64 = g.iter().map(|(_, s)| s).sum();
            (g.len() == 2 && (sum - 1.0).abs() < 1e-6).then_some(g)
        },
    )
    .await;
    let samples = samples.into_inner().unwrap();
    eprintln!("after: {done:?} ({} samples)", samples.len());
    for g in &samples {
        let sum: f64 = g.iter().map(|(_, s)| s).sum();
        assert!(
            sum <= 1.0 + 1e-6,
            "shares above the budget while draining: {g:?}"
        );
    }
    assert!(
        done.is_some(),
        "{gone} leaves and the others hold the whole budget: {:?}\n{}",
        samples.last(),
        cluster.daemon(&lead).log_text()
    );
    let members = cluster.daemon(&lead).get("/v1/cluster/members").await?;
    let regions: Vec<&str> = members.body["members"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["region"].as_str())
        .collect();
    assert_eq!(regions, kept, "{gone}'s Raft node is gone too");

    // Each region left enforces its share under a lease: together the whole burst, 60.
    let whole = eventually(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let mut capacity = 0.0;
            for n in &kept {
                let a = cluster
                    .daemon(n)
                    .get("/v1/tenants/acme/allowance")
                    .await
                    .ok()?;
                let t = this_region(&a.body);
                if t["enforced_share"] != t["share"] {
                    return None;
                }
                capacity += t["capacity"].as_f64()?;
            }
            ((capacity - 60.0).abs() < 1e-3).then_some(capacity)
        },
    )
    .await;
    assert!(
        whole.is_some(),
        "the regions left enforce the whole burst between them"
    );

    // The node is no member any more: a second removal finds nothing.
    let r = cluster
        .daemon(&lead)
        .request("DELETE", &path, Some(TOKEN), None)
        .await?;
    assert_eq!(r.status, 404, "{}", r.body);
    Ok(())
}

/// The members `daemon` lists: (node id, region, voter).
async fn members(daemon: &Daemon) -> Option<Vec<(u64, String, bool)>> {
    let r = daemon.get("/v1/cluster/members").await.ok()?;
    r.body["members"]
        .as_array()?
        .iter()
        .map(|m| {
            Some((
                m["node_id"].as_u64()?,
                m["region"].as_str()?.to_string(),
                m["voter"].as_bool()?,
            ))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_added_by_host_name_votes_and_decides_from_its_redis() -> anyhow::Result<()> {
    let t = Timings::default();
    let cluster = Cluster::start(&["a", "b", "c"], &t).await?;
    let started = std::time::Instant::now();
    let d = cluster.start_joining("d", 4, "localhost", &t).await?;
    assert!(d.peer.starts_with("localhost:"), "{}", d.peer);
    let status = cluster.daemon("a").get("/v1/status").await?;
    let lead = status.body["raft"]["leader"]
        .as_str()
        .expect("a leader")
        .to_string();
    let leader = cluster.daemon(&lead);
    let three = members(leader).await.expect("the members");
    assert_eq!(three.len(), 3, "{three:?}");

    // A peer without a port is refused by name, on the leader of a real cluster, and changes
    // nothing.
    let bad = json!({"node_id": 4, "region": "d", "peer": "localhost", "api": d.api});
    let r = leader
        .request(
            "POST",
            "/v1/cluster/members",
            Some(TOKEN),
            Some(bad.to_string()),
        )
        .await?;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.body["errors"][0]["field"], "peer", "{}", r.body);
    assert_eq!(
        members(leader).await,
        Some(three),
        "a refused member changes nothing"
    );

    let add = json!({"node_id": 4, "region": "d", "peer": d.peer, "api": d.api});
    let r = leader
        .request(
            "POST",
            "/v1/cluster/members",
            Some(TOKEN),
            Some(add.to_string()),
        )
        .await?;
    assert_eq!(
        r.status,
        204,
        "added as a learner: {}\n{}",
        r.body,
        leader.log_text()
    );
    // The same call again (as after a 503 that left the node a learner) finishes, and changes
    // nothing more.
    let r = leader
        .request(
            "POST",
            "/v1/cluster/members",
            Some(TOKEN),
            Some(add.to_string()),
        )
        .await?;
    assert_eq!(r.status, 204, "added again: {}", r.body);
    let learner = members(leader).await.unwrap_or_default();
    assert_eq!(
        learner
            .iter()
            .filter(|(_, _, voter)| !voter)
            .collect::<Vec<_>>(),
        [&(4, "d".to_string(), false)],
        "d's node is a learner, once: {learner:?}"
    );
    assert_eq!(learner.len(), 4, "{learner:?}");
    let r = leader
        .request("POST", "/v1/cluster/members/4/promote", Some(TOKEN), None)
        .await?;
    assert_eq!(r.status, 204, "promoted: {}\n{}", r.body, leader.log_text());

    // Every region, the new one too, lists d's node as a voter.
    let expected: Vec<(u64, String, bool)> = ["a", "b", "c", "d"]
        .iter()
        .enumerate()
        .map(|(i, n)| (i as u64 + 1, n.to_string(), true))
        .collect();
    let all = cluster.daemons.iter().chain(std::iter::once(&d.daemon));
    for daemon in all {
        let seen = eventually(
            Duration::from_secs(15),
            Duration::from_millis(100),
            || async { members(daemon).await.filter(|m| *m == expected) },
        )
        .await;
        assert!(
            seen.is_some(),
            "every member a voter, as {} sees it: {:?}\n{}",
            daemon.base(),
            members(daemon).await,
            d.daemon.log_text()
        );
    }
    eprintln!(
        "d a voter everywhere {:?} after it started",
        started.elapsed()
    );

    // A policy put afterwards gets a share in d, enforced under d's lease.
    let stored = leader
        .put_policy(
            "acme",
            "writes",
            json!({"limit": 60, "window_ms": 1000, "floor": 0.1}),
        )
        .await?;
    let version = stored["version"].as_u64().expect("a version");
    let share = eventually(
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async {
            let a = d.daemon.get("/v1/tenants/acme/allowance").await.ok()?;
            let t = this_region(&a.body);
            let share = t["share"].as_f64()?;
            (share >= 0.1 && t["enforced_share"] == t["share"]).then_some(share)
        },
    )
    .await;
    assert!(
        share.is_some(),
        "d holds and enforces a share: {:?}\n{}",
        grants(&cluster, &lead).await,
        d.daemon.log_text()
    );
    let regions = grants(&cluster, &lead).await.unwrap_or_default();
    eprintln!(
        "shares {:?} after d started: {regions:?}",
        started.elapsed()
    );
    assert!(
        regions.len() == 4 && regions.iter().any(|(r, s)| r == "d" && *s >= 0.1),
        "the leader grants four regions, d among them: {regions:?}"
    );

    // d decides from its own Redis: this region's parameters are written there, and its checks
    // are admitted through Redis.
    let client = d.redis.client();
    let written = eventually(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            params_present(&client, "acme", "writes", version)
                .await
                .then_some(())
        },
    )
    .await;
    assert!(written.is_some(), "d's parameters are in d's Redis");
    for _ in 0..3 {
        let r = d.daemon.check("acme", "writes", 1).await?;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.body["mode"], "normal",
            "decided through Redis: {}",
            r.body
        );
    }
    Ok(())
}
