//! A region is a set of daemons: three regions × two daemons on one Redis per region, every
//! daemon a Raft voter, one of each region's daemons its agent. Checks are spread over both
//! daemons of each region at a steady rate above the region's share, as a gateway balancing
//! over them would, while daemons are killed, stopped and restarted.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quotad_system_tests::{eventually, RegionSet, Timings};
use serde_json::json;

/// 50 tokens a second, burst 50: over any window W the global bucket admits at most
/// 50 + 50·W.
const LIMIT_PER_S: f64 = 50.0;
const BURST: f64 = 50.0;
/// Checks a second offered to each region: 2.4 times the budget in total.
const RATE_PER_REGION: u32 = 40;

/// What the gateways saw.
#[derive(Debug, Default)]
struct Seen {
    /// Admissions, by time since the start.
    admitted: Vec<Duration>,
    /// Checks that got no decision (transport error or 5xx), by daemon.
    failed: Vec<(usize, Duration, String)>,
}

/// Gateways: for each region, checks at `RATE_PER_REGION` a second, round robin over the
/// region's daemons that are not `down` (a load balancer's health check takes a daemon out).
struct Load {
    seen: Arc<Mutex<Seen>>,
    down: Arc<Mutex<HashSet<usize>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(set: &RegionSet) -> Self {
        let seen: Arc<Mutex<Seen>> = Arc::default();
        let down: Arc<Mutex<HashSet<usize>>> = Arc::default();
        let stop: Arc<std::sync::atomic::AtomicBool> = Arc::default();
        let start = Instant::now();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(3))
            .build()
            .unwrap();
        let mut tasks = Vec::new();
        for name in &set.names {
            let daemons: Vec<(usize, u16)> =
                set.of(name).map(|i| (i, set.daemons[i].api_port)).collect();
            let (seen, down, stop, http) = (seen.clone(), down.clone(), stop.clone(), http.clone());
            tasks.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(1) / RATE_PER_REGION);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                let mut next = 0usize;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    tick.tick().await;
                    let up: Vec<(usize, u16)> = {
                        let down = down.lock().unwrap();
                        daemons
                            .iter()
                            .filter(|(i, _)| !down.contains(i))
                            .copied()
                            .collect()
                    };
                    if up.is_empty() {
                        continue;
                    }
                    let (i, port) = up[next % up.len()];
                    next += 1;
                    let (seen, http) = (seen.clone(), http.clone());
                    // Each check on its own: one slow answer does not hold up the rate.
                    tokio::spawn(async move {
                        let at = start.elapsed();
                        let r = http
                            .post(format!("http://127.0.0.1:{port}/v1/check"))
                            .json(&json!({"tenant": "acme", "policy": "writes", "cost": 1}))
                            .send()
                            .await;
                        let mut seen = seen.lock().unwrap();
                        match r.map(|r| r.status().as_u16()) {
                            Ok(200) => seen.admitted.push(at),
                            Ok(429) => {}
                            Ok(code) => seen.failed.push((i, at, format!("status {code}"))),
                            Err(e) => seen.failed.push((i, at, e.to_string())),
                        }
                    });
                }
            }));
        }
        Self {
            seen,
            down,
            stop,
            tasks,
        }
    }

    fn take_down(&self, i: usize) {
        self.down.lock().unwrap().insert(i);
    }

    fn bring_up(&self, i: usize) {
        self.down.lock().unwrap().remove(&i);
    }

    async fn finish(self) -> Seen {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.tasks {
            let _ = t.await;
        }
        // Checks still in flight answer within the client's timeout.
        tokio::time::sleep(Duration::from_secs(3)).await;
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

/// The most admissions in any window of `w`.
fn max_in_window(admitted: &[Duration], w: Duration) -> u64 {
    let mut times = admitted.to_vec();
    times.sort();
    let (mut best, mut lo) = (0, 0);
    for hi in 0..times.len() {
        while times[hi] - times[lo] >= w {
            lo += 1;
        }
        best = best.max((hi - lo + 1) as u64);
    }
    best
}

/// Admissions over every 10 s window stay within 1.02 × the global bucket's bound.
fn assert_bound(seen: &Seen) {
    let w = Duration::from_secs(10);
    let bound = BURST + LIMIT_PER_S * w.as_secs_f64();
    let most = max_in_window(&seen.admitted, w);
    eprintln!(
        "{} admitted in all; at most {most} in a 10 s window (global bucket's bound {bound}, \
         ratio {:.3})",
        seen.admitted.len(),
        most as f64 / bound
    );
    assert!(
        most as f64 <= 1.02 * bound,
        "{most} admitted in a 10 s window, above 1.02 × {bound}"
    );
}

/// Test timings with a 10 s lease: a stored lease end trails the lease by at most half of it
/// less the margin (4.7 s), well above the time a takeover takes here, and a daemon's lease
/// outlasts a leader election on a host busy with other tests.
fn timings() -> Timings {
    Timings {
        lease_ms: 10_000,
        ..Timings::default()
    }
}

async fn start_set() -> anyhow::Result<RegionSet> {
    let set = RegionSet::start(&["a", "b", "c"], 2, &timings()).await?;
    set.daemons[0]
        .put_policy(
            "acme",
            "writes",
            json!({"limit": LIMIT_PER_S, "window_ms": 1000, "burst": BURST, "floor": 0.1}),
        )
        .await?;
    // Every daemon decides the policy under its lease before the load starts.
    for i in 0..set.daemons.len() {
        let leased = eventually(
            Duration::from_secs(15),
            Duration::from_millis(50),
            || async {
                let (share, enforced) = share_of(&set, i).await?;
                (share > 0.0 && enforced == share).then_some(())
            },
        )
        .await;
        anyhow::ensure!(leased.is_some(), "daemon {i} holds no lease");
    }
    Ok(set)
}

/// Daemon `i`'s granted and enforced share of the policy.
async fn share_of(set: &RegionSet, i: usize) -> Option<(f64, f64)> {
    let r = set.daemons[i]
        .get("/v1/tenants/acme/allowance")
        .await
        .ok()?;
    let p = &r.body["policies"][0]["this_region"];
    Some((p["share"].as_f64()?, p["enforced_share"].as_f64()?))
}

/// Samples every region's Redis every 100 ms until `stop`: how many samples, and those where
/// a parameter key's stored lease end had passed (the region's Redis enforcing its floor).
fn watch_stored_ends(
    urls: Vec<String>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<(usize, Vec<String>)> {
    tokio::spawn(async move {
        let mut conns = Vec::new();
        for u in &urls {
            let c = redis::Client::open(u.as_str()).unwrap();
            conns.push(c.get_multiplexed_async_connection().await.unwrap());
        }
        let (mut samples, mut lapsed) = (0, Vec::new());
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            for (r, conn) in conns.iter_mut().enumerate() {
                let keys: Vec<String> = redis::cmd("KEYS")
                    .arg("qd:v1:*:p")
                    .query_async(conn)
                    .await
                    .unwrap_or_default();
                let (secs, us): (u64, u64) =
                    redis::cmd("TIME").query_async(conn).await.unwrap_or((0, 0));
                let now = secs * 1000 + us / 1000;
                for k in keys {
                    let until: Option<u64> = redis::cmd("HGET")
                        .arg(&k)
                        .arg("until")
                        .query_async(conn)
                        .await
                        .unwrap_or(None);
                    samples += 1;
                    if until.is_some_and(|u| u <= now) {
                        lapsed.push(format!(
                            "region {r}: {k} ended {} ms ago",
                            now - until.unwrap()
                        ));
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        (samples, lapsed)
    })
}

/// Samples every daemon in `watch` every 100 ms until `stop`: the samples where it answered
/// and enforced less than its granted share (its lease had lapsed to the floor).
fn watch_leases(
    set: &Arc<Mutex<Option<RegionSet>>>,
    watch: &[usize],
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<(usize, Vec<String>)> {
    let ports: Vec<(usize, u16)> = {
        let g = set.lock().unwrap();
        let s = g.as_ref().unwrap();
        watch.iter().map(|&i| (i, s.daemons[i].api_port)).collect()
    };
    tokio::spawn(async move {
        let http = reqwest::Client::new();
        let (mut samples, mut lapsed) = (0, Vec::new());
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            for &(i, port) in &ports {
                let r = http
                    .get(format!("http://127.0.0.1:{port}/v1/tenants/acme/allowance"))
                    .bearer_auth(quotad_system_tests::TOKEN)
                    .timeout(Duration::from_secs(1))
                    .send()
                    .await;
                let Ok(r) = r else { continue };
                let Ok(body) = r.json::<serde_json::Value>().await else {
                    continue;
                };
                let p = &body["policies"][0]["this_region"];
                if let (Some(s), Some(e)) = (p["share"].as_f64(), p["enforced_share"].as_f64()) {
                    samples += 1;
                    if e < s {
                        lapsed.push(format!("daemon {i}: enforced {e} of share {s}"));
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        (samples, lapsed)
    })
}

/// kill -9 of the daemon holding a region's agent role, then of the Raft leader's daemon:
/// every region keeps its lease (no sample of an enforced share below the granted one), the
/// surviving daemons answer every check sent to them, the role moves within the stated time,
/// and admissions stay within the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_agent_or_the_leader_keeps_leases_and_the_bound() -> anyhow::Result<()> {
    let set = start_set().await?;
    let load = Load::start(&set);
    let set = Arc::new(Mutex::new(Some(set)));
    let snapshot = || set.lock().unwrap().take().unwrap();
    let put_back = |s: RegionSet| *set.lock().unwrap() = Some(s);

    let s = snapshot();
    let survivors: Vec<usize> = (0..s.daemons.len()).collect();
    put_back(s);
    tokio::time::sleep(Duration::from_secs(3)).await;

    // 1. The agent of region a.
    let s = snapshot();
    let agent = s
        .agent_seen_by(0, "a")
        .await
        .expect("region a has an agent");
    let other = s.of("a").find(|&i| i != agent).unwrap();
    put_back(s);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = watch_leases(
        &set,
        &survivors
            .iter()
            .copied()
            .filter(|&i| i != agent)
            .collect::<Vec<_>>(),
        stop.clone(),
    );
    let urls = set
        .lock()
        .unwrap()
        .as_ref()
        .unwrap()
        .redis
        .iter()
        .map(|r| r.url())
        .collect();
    let stored = watch_stored_ends(urls, stop.clone());
    let s = snapshot();
    let killed_at = Instant::now();
    s.daemons[agent].signal("KILL")?;
    load.take_down(agent);
    let moved = s
        .agent_moved(other, "a", agent, Duration::from_secs(10))
        .await;
    let took = killed_at.elapsed();
    eprintln!("region a's agent role moved from daemon {agent} to {moved:?} in {took:?}");
    assert_eq!(moved, Some(other), "the surviving daemon takes the role");
    assert!(
        took < Duration::from_secs(3),
        "the role moves within 3 report intervals plus a commit and a pass: {took:?}"
    );
    // Restarted on its data (its pod rescheduled), it stands by.
    let mut s = s;
    s.daemons[agent].respawn(&[("QUOTAD_PEER_TOKEN", quotad_system_tests::PEER_TOKEN)])?;
    s.daemons[agent].wait_ready(Duration::from_secs(30)).await?;
    load.bring_up(agent);
    // Once its state has caught up with the log, it sees the role where it moved.
    let seen_by = eventually(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async {
            let seen = (
                s.agent_seen_by(agent, "a").await,
                s.agent_seen_by(other, "a").await,
            );
            (seen == (Some(other), Some(other))).then_some(())
        },
    )
    .await;
    assert!(seen_by.is_some(), "{}", s.daemons[agent].log_text());
    put_back(s);
    tokio::time::sleep(Duration::from_secs(3)).await;

    // 2. The Raft leader's daemon (as the survivor of a sees it).
    let s = snapshot();
    let leader = s.leader_seen_by(other).await.expect("a leader");
    let region = s.region_of(leader).to_string();
    let leader_agent = s.agent_seen_by(other, &region).await;
    // Asked from then on: a daemon of another region than the leader's.
    let observer = (0..s.daemons.len())
        .find(|&i| s.region_of(i) != region)
        .unwrap();
    eprintln!(
        "killing the leader, daemon {leader} of region {region} (its agent: {leader_agent:?})"
    );
    s.daemons[leader].signal("KILL")?;
    load.take_down(leader);
    let new_leader = eventually(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { s.leader_seen_by(observer).await.filter(|&l| l != leader) },
    )
    .await;
    eprintln!("new leader: {new_leader:?}");
    assert!(new_leader.is_some(), "a new leader is elected");
    if leader_agent == Some(leader) {
        let partner = s.of(&region).find(|&i| i != leader);
        let moved = s
            .agent_moved(observer, &region, leader, Duration::from_secs(10))
            .await;
        assert_eq!(moved, partner, "region {region}'s survivor takes its role");
    }
    put_back(s);
    tokio::time::sleep(Duration::from_secs(6)).await;

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (samples, lapsed) = watcher.await?;
    let (stored_samples, stored_lapsed) = stored.await?;
    eprintln!("{stored_samples} stored lease ends sampled; passed: {stored_lapsed:?}");
    assert!(stored_samples > 100, "the stored ends were watched");
    assert!(
        stored_lapsed.is_empty(),
        "a region's Redis fell to its floor: {stored_lapsed:?}"
    );
    let seen = load.finish().await;
    eprintln!("{samples} lease samples; lapsed: {lapsed:?}");
    assert!(samples > 100, "the leases were watched: {samples} samples");
    let lapsed: Vec<&String> = lapsed
        .iter()
        .filter(|l| !l.starts_with(&format!("daemon {leader}:")))
        .collect();
    if !lapsed.is_empty() {
        // What the daemons that lapsed said about their leases and roles.
        let s = snapshot();
        for (i, d) in s.daemons.iter().enumerate() {
            if lapsed
                .iter()
                .any(|l| l.starts_with(&format!("daemon {i}:")))
            {
                for line in d.log_text().lines().filter(|l| {
                    ["Lease", "lease", "agent", "epoch"]
                        .iter()
                        .any(|w| l.contains(w))
                }) {
                    eprintln!("daemon {i}: {line}");
                }
            }
        }
        put_back(s);
    }
    assert!(lapsed.is_empty(), "leases lapsed: {lapsed:?}");
    // Checks sent to a killed daemon before the load balancer took it out fail; no other.
    let failed: Vec<_> = seen
        .failed
        .iter()
        .filter(|(i, _, _)| *i != agent && *i != leader)
        .collect();
    eprintln!(
        "checks failed at the killed daemons: {}",
        seen.failed.len() - failed.len()
    );
    assert!(
        failed.is_empty(),
        "surviving daemons failed checks: {failed:?}"
    );
    assert_bound(&seen);
    Ok(())
}

/// SIGTERM of every daemon in turn under load, each restarted on its data before the next (a
/// rolling upgrade): the load balancer takes a daemon out before it is stopped, and no check
/// fails at all (those in flight on the stopping daemon are drained); the bound holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_load_fails_no_check() -> anyhow::Result<()> {
    let mut set = start_set().await?;
    let load = Load::start(&set);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut roles = Vec::new();
    for i in 0..set.daemons.len() {
        let asked = (i + 1) % set.daemons.len();
        roles.push(set.agent_seen_by(asked, set.region_of(i)).await == Some(i));
        load.take_down(i);
        let status = set.daemons[i].terminate(Duration::from_secs(20)).await?;
        assert!(status.success(), "daemon {i} exited with {status}");
        set.daemons[i].respawn(&[("QUOTAD_PEER_TOKEN", quotad_system_tests::PEER_TOKEN)])?;
        set.daemons[i].wait_ready(Duration::from_secs(30)).await?;
        load.bring_up(i);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let seen = load.finish().await;
    eprintln!("agents stopped in turn: {roles:?}");
    assert!(
        roles.iter().any(|&r| r),
        "some stopped daemon held its region's role"
    );
    assert!(
        seen.failed.is_empty(),
        "checks failed during the rolling restart: {:?}",
        seen.failed
    );
    // Every region still has an agent, and every daemon is ready.
    for name in ["a", "b", "c"] {
        assert!(
            set.agent_seen_by(0, name).await.is_some(),
            "{name} has an agent"
        );
    }
    assert_bound(&seen);
    Ok(())
}

/// Every parameter hash of a region's Redis, field by field, sorted.
async fn params(
    conn: &mut redis::aio::MultiplexedConnection,
) -> Vec<(String, Vec<(String, String)>)> {
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg("qd:v1:*:p")
        .query_async(conn)
        .await
        .unwrap();
    keys.sort();
    let mut out = Vec::new();
    for k in keys {
        let mut fields: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(&k)
            .query_async(conn)
            .await
            .unwrap();
        fields.sort();
        out.push((k, fields));
    }
    out
}

/// A deposed agent writes nothing: region a's agent is stopped (SIGSTOP) until the other
/// daemon has taken the role and rewritten every parameter under its fence, then resumed
/// (SIGCONT). With leases long enough that the new agent renews nothing meanwhile, region a's
/// parameter keys are identical before and after the resumption, and the resumed daemon
/// stands by.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_agent_writes_nothing() -> anyhow::Result<()> {
    let t = Timings {
        lease_ms: 30_000,
        drift_margin_ms: 1_000,
        ..Timings::default()
    };
    let set = RegionSet::start(&["a", "b", "c"], 2, &t).await?;
    for p in ["writes", "reads", "deletes"] {
        set.daemons[0]
            .put_policy(
                "acme",
                p,
                json!({"limit": 100, "window_ms": 1000, "floor": 0.1}),
            )
            .await?;
    }
    let agent = set
        .agent_seen_by(0, "a")
        .await
        .expect("region a has an agent");
    let other = set.of("a").find(|&i| i != agent).unwrap();
    let client = redis::Client::open(set.redis[0].url())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let fence_of = |params: &[(String, Vec<(String, String)>)]| -> HashSet<String> {
        params
            .iter()
            .filter_map(|(_, f)| f.iter().find(|(k, _)| k == "fence").map(|(_, v)| v.clone()))
            .collect()
    };
    let before_stop = eventually(Duration::from_secs(10), Duration::from_millis(50), || {
        let mut conn = conn.clone();
        async move {
            let p = params(&mut conn).await;
            (p.len() >= 3 && fence_of(&p).len() == 1).then_some(p)
        }
    })
    .await
    .expect("region a's agent wrote every policy");
    let old_fence = fence_of(&before_stop);

    set.daemons[agent].signal("STOP")?;
    let moved = set
        .agent_moved(other, "a", agent, Duration::from_secs(10))
        .await;
    assert_eq!(moved, Some(other), "the other daemon takes the role");
    let rewritten = eventually(Duration::from_secs(10), Duration::from_millis(50), || {
        let mut conn = conn.clone();
        let old = old_fence.clone();
        async move {
            let p = params(&mut conn).await;
            let f = fence_of(&p);
            (p.len() >= 3 && f.len() == 1 && f != old).then_some(p)
        }
    })
    .await
    .expect("the new agent rewrites every parameter under its fence");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = params(&mut conn).await;
    assert_eq!(
        before, rewritten,
        "the new agent is quiet (nothing due for 15 s)"
    );

    set.daemons[agent].signal("CONT")?;
    // Several report intervals and apply passes of the resumed daemon.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = params(&mut conn).await;
    assert_eq!(
        before, after,
        "region a's parameters changed after the deposed agent resumed"
    );
    let agent_now = set.agent_seen_by(agent, "a").await;
    assert_eq!(
        agent_now,
        Some(other),
        "the resumed daemon sees the new agent"
    );
    let metrics = set.daemons[agent].get_text("/metrics").await?.1;
    eprintln!(
        "the resumed daemon: {}",
        metrics
            .lines()
            .filter(|l| l.starts_with("quotad_fenced_writes_total")
                || l.starts_with("quotad_agent_holder"))
            .collect::<Vec<_>>()
            .join("; ")
    );
    assert_eq!(
        quotad_system_tests::metric_value(&metrics, "quotad_agent_holder", &[("region", "a")]),
        Some(0.0),
        "the resumed daemon stands by"
    );
    Ok(())
}

/// Waits for `d` to exit during start-up; its log.
async fn refused(mut d: quotad_system_tests::Daemon) -> String {
    let exited = eventually(Duration::from_secs(20), Duration::from_millis(50), || {
        let running = d.is_running();
        async move { (!running).then_some(()) }
    })
    .await;
    assert!(
        exited.is_some(),
        "the daemon kept running:\n{}",
        d.log_text()
    );
    d.log_text()
}

/// Bad deployments are refused at start, before anything is written: a second single-region
/// daemon on a Redis another one writes (its writes unfenced: the two would overwrite each
/// other), a single-region daemon on a region set's Redis, and a daemon of region b started
/// with region a's Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writer_on_a_regions_redis_is_refused_at_start() -> anyhow::Result<()> {
    use quotad_system_tests::{free_port, redis_config, Daemon, PEER_TOKEN};
    let single_redis = redis_harness::RedisServer::start()?;
    let first = Daemon::start(&redis_config(&single_redis.url())).await?;
    let port = free_port()?;
    let second = Daemon::spawn(
        &redis_config(&single_redis.url()).replace("{api}", &format!("127.0.0.1:{port}")),
        port,
        &[],
    )?;
    let log = refused(second).await;
    assert!(log.contains("another single-region quotad"), "{log}");
    assert!(
        first.get("/readyz").await?.status == 200,
        "the first goes on"
    );

    // Region a's daemon (a member of a two-region cluster) marks its Redis at start.
    let a_redis = redis_harness::RedisServer::start()?;
    let cluster_config = |region: &str, redis: &str| -> anyhow::Result<(String, u16)> {
        let (api, peer) = (free_port()?, free_port()?);
        let me = if region == "a" { 1 } else { 2 };
        let text = format!(
            "region = \"{region}\"\nnode_id = {me}\n[api]\nlisten = \"127.0.0.1:{api}\"\n\
             [peer]\nlisten = \"127.0.0.1:{peer}\"\n[redis]\nurl = \"{redis}\"\n\
             [[regions]]\nid = \"{region}\"\nnode_id = {me}\napi = \"127.0.0.1:{api}\"\npeer = \"127.0.0.1:{peer}\"\n\
             [[regions]]\nid = \"z\"\nnode_id = 9\napi = \"127.0.0.1:1\"\npeer = \"127.0.0.1:2\"\n"
        );
        Ok((text, api))
    };
    let (text, api) = cluster_config("a", &a_redis.url())?;
    let _a = Daemon::spawn(&text, api, &[("QUOTAD_PEER_TOKEN", PEER_TOKEN)])?;
    let mut conn = a_redis.client().get_multiplexed_async_connection().await?;
    let marked = eventually(Duration::from_secs(20), Duration::from_millis(50), || {
        let mut conn = conn.clone();
        async move {
            let m: Option<String> = redis::cmd("GET")
                .arg("qd:v1:owner")
                .query_async(&mut conn)
                .await
                .ok()?;
            m.filter(|m| m == "fenced a")
        }
    })
    .await;
    assert!(marked.is_some(), "region a's daemon marks its Redis");

    let port = free_port()?;
    let single = Daemon::spawn(
        &redis_config(&a_redis.url()).replace("{api}", &format!("127.0.0.1:{port}")),
        port,
        &[],
    )?;
    let log = refused(single).await;
    assert!(log.contains("written by region \"a\"'s daemons"), "{log}");

    let (text, api) = cluster_config("b", &a_redis.url())?;
    let b = Daemon::spawn(&text, api, &[("QUOTAD_PEER_TOKEN", PEER_TOKEN)])?;
    let log = refused(b).await;
    assert!(log.contains("holds region \"a\"'s parameters"), "{log}");
    // Nothing of theirs was written.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("qd:v1:*")
        .query_async(&mut conn)
        .await?;
    assert_eq!(keys, ["qd:v1:owner"], "only region a's mark");
    Ok(())
}

/// Checks that land on a standby are its region's demand too: Redis counts the ones that
/// reach it, and the standby hands the denials it answered from its cache (and checks it
/// forwarded) to the agent for its report. A flood on region a's standby alone brings share
/// to region a.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_on_a_standby_brings_share_to_its_region() -> anyhow::Result<()> {
    let set = start_set().await?;
    let agent = set
        .agent_seen_by(0, "a")
        .await
        .expect("region a has an agent");
    let standby = set.of("a").find(|&i| i != agent).unwrap();
    let (before, _) = share_of(&set, standby).await.expect("a share");
    let port = set.daemons[standby].api_port;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let http = reqwest::Client::new();
            let mut tick = tokio::time::interval(Duration::from_millis(5));
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tick.tick().await;
                let _ = http
                    .post(format!("http://127.0.0.1:{port}/v1/check"))
                    .json(&json!({"tenant": "acme", "policy": "writes", "cost": 1}))
                    .send()
                    .await;
            }
        })
    };
    let risen = eventually(
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async {
            let (share, _) = share_of(&set, standby).await?;
            (share >= 0.6).then_some(share)
        },
    )
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    flood.await?;
    let metrics = set.daemons[standby].get_text("/metrics").await?.1;
    let sent = quotad_system_tests::metric_value(
        &metrics,
        "quotad_standby_usage_records_total",
        &[("region", "a"), ("outcome", "sent")],
    );
    let hits = quotad_system_tests::metric_value(&metrics, "quotad_denial_cache_hits_total", &[]);
    eprintln!("region a's share {before} -> {risen:?}; the standby handed over {sent:?} records ({hits:?} cache hits)");
    assert!(risen.is_some(), "region a's share rises toward the flood");
    assert!(
        sent.is_some_and(|n| n > 0.0),
        "the standby handed its counts over"
    );
    Ok(())
}
