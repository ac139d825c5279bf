//! Failovers cost the healthy regions nothing: three regions on loopback (three redis-server
//! and three quotad processes, Raft through fault-injecting proxies), one region cut off at a
//! time while every region offers more than the budget.
//!
//! - The leader's region cut off: the other two never fall to their floors, their admissions
//!   never pause, and together the regions stay within 1.02 of the global bucket.
//! - A follower cut off for three election timeouts, then healed: the leader keeps its term,
//!   and no region's admissions pause.
//! - A follower cut off past its lease: the majority holds its share (all but its floor)
//!   within two rebalance rounds of the lease's end; the cut-off region says "Lease ran out"
//!   once and its `quotad_lease_remaining_ms` reads 0, then a lease again after the heal.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quotad_system_tests::{eventually, metric_value, Cluster, Timings};
use serde_json::json;

/// The budget every test shares: 50 tokens a second, burst 50, floor 10% per region.
const LIMIT_PER_S: f64 = 50.0;
const FLOOR: f64 = 0.1;

/// Admission times per region, since the start of the run.
type Log = Arc<Mutex<BTreeMap<String, Vec<Duration>>>>;

/// Sends `rate` checks a second through `region` until `until`, logging admissions.
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
                    let at = start.elapsed();
                    log.lock()
                        .unwrap()
                        .entry(region.clone())
                        .or_default()
                        .push(at);
                }
            }
        }
    })
}

/// Offers 40 checks a second in every region (2.4× the budget) from `start` until `until`.
fn drive_all(
    cluster: &Arc<Cluster>,
    start: Instant,
    until: Instant,
    log: &Log,
) -> Vec<tokio::task::JoinHandle<()>> {
    cluster
        .names
        .clone()
        .iter()
        .map(|n| drive(cluster, n, 40, start, until, log.clone()))
        .collect()
}

/// The longest stretch without an admission in `times` between `from` and `to`.
fn longest_pause(times: &[Duration], from: Duration, to: Duration) -> Duration {
    let mut t: Vec<Duration> = times
        .iter()
        .copied()
        .filter(|t| *t >= from && *t <= to)
        .collect();
    t.sort();
    let mut edges = vec![from];
    edges.extend(t);
    edges.push(to);
    edges
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or(to - from)
}

/// The largest ratio, over windows of `w`, of tokens admitted in all regions together to what
/// the global bucket allows in `w` (burst + rate · w).
fn overshoot(log: &Log, w: Duration) -> f64 {
    let mut times: Vec<Duration> = log.lock().unwrap().values().flatten().copied().collect();
    times.sort();
    let mut best = 0;
    let mut lo = 0;
    for hi in 0..times.len() {
        while times[hi] - times[lo] >= w {
            lo += 1;
        }
        best = best.max(hi - lo + 1);
    }
    best as f64 / (LIMIT_PER_S + LIMIT_PER_S * w.as_secs_f64())
}

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Puts the shared policy and waits until every region enforces a share above its floor
/// under a lease.
async fn policy_everywhere(cluster: &Cluster) -> anyhow::Result<()> {
    cluster
        .daemon("a")
        .put_policy(
            "acme",
            "writes",
            json!({"limit": 50, "window_ms": 1000, "floor": FLOOR}),
        )
        .await?;
    for n in &cluster.names {
        let held = eventually(
            Duration::from_secs(15),
            Duration::from_millis(100),
            || async {
                let (share, enforced) = cluster.share(n, "acme").await?;
                (share > FLOOR && enforced == share).then_some(())
            },
        )
        .await;
        anyhow::ensure!(held.is_some(), "{n} never enforced a share under a lease");
    }
    Ok(())
}

/// The region the cluster's leader is in and its term, as `from` sees them.
async fn leader(cluster: &Cluster, from: &str) -> Option<(String, u64)> {
    let s = cluster.daemon(from).get("/v1/status").await.ok()?;
    let leader = s.body["raft"]["leader"].as_str()?.to_string();
    Some((leader, s.body["raft"]["term"].as_u64()?))
}

/// What one region says about its lease and share at one moment.
#[derive(Debug, Clone, Copy)]
struct Look {
    at: Duration,
    lease_remaining_ms: u64,
    share: f64,
    enforced: f64,
}

/// Looks at every region in `regions` every 100 ms until `until`.
async fn watch(
    cluster: &Cluster,
    regions: &[&str],
    start: Instant,
    until: Instant,
) -> BTreeMap<String, Vec<Look>> {
    let mut looks: BTreeMap<String, Vec<Look>> = BTreeMap::new();
    while Instant::now() < until {
        for &n in regions {
            let d = cluster.daemon(n);
            let Ok(status) = d.get("/v1/status").await else {
                continue;
            };
            let Some((share, enforced)) = cluster.share(n, "acme").await else {
                continue;
            };
            looks.entry(n.to_string()).or_default().push(Look {
                at: start.elapsed(),
                lease_remaining_ms: status.body["lease"]["remaining_ms"].as_u64().unwrap_or(0),
                share,
                enforced,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    looks
}

/// Asserts that none of `looks` shows a region on its floors (no lease, or a share enforced
/// below the one granted).
fn never_on_floors(looks: &BTreeMap<String, Vec<Look>>, cluster: &Cluster) {
    for (n, ls) in looks {
        assert!(ls.len() >= 8, "{n} was looked at {} times", ls.len());
        let min_lease = ls.iter().map(|l| l.lease_remaining_ms).min().unwrap_or(0);
        eprintln!(
            "{n}: {} looks, least lease remaining {min_lease} ms",
            ls.len()
        );
        for l in ls {
            assert!(
                l.lease_remaining_ms > 0 && l.enforced == l.share && l.enforced > FLOOR,
                "{n} fell to its floors at {:?}: {l:?}\n{}",
                l.at,
                cluster.daemon(n).log_text()
            );
        }
    }
}

/// The lease the measurements used (6 s), with Raft timings that tolerate a loaded
/// debug build on two cores (a 200 ms heartbeat is also the timeout of each AppendEntries and
/// pre-vote call). A failover takes at most `1.2 + 0.6 + 0.1 + 2 × 0.2` = 2.3 s, so a renewal
/// needs `0.2 + 2.3 + 1.2` = 3.7 s of the 5.7 s the lease leaves (the `check-config` rule).
fn slow_raft() -> Timings {
    Timings {
        lease_ms: 6_000,
        heartbeat_interval_ms: 200,
        election_timeout_min_ms: 600,
        election_timeout_max_ms: 1_200,
        ..Timings::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutting_off_the_leaders_region_costs_the_others_nothing() -> anyhow::Result<()> {
    let t = slow_raft();
    let cluster = Arc::new(Cluster::start(&["a", "b", "c"], &t).await?);
    policy_everywhere(&cluster).await?;
    let (old, term) = leader(&cluster, "a").await.expect("a leader");
    let healthy: Vec<&str> = ["a", "b", "c"].into_iter().filter(|n| *n != old).collect();

    let start = Instant::now();
    let until = start + Duration::from_secs(12);
    let log: Log = Arc::default();
    let tasks = drive_all(&cluster, start, until, &log);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cut_at = start.elapsed();
    cluster.isolate(&old);
    let looks = watch(
        &cluster,
        &healthy,
        start,
        until - Duration::from_millis(500),
    )
    .await;
    for task in tasks {
        task.await?;
    }
    let (new, new_term) = leader(&cluster, healthy[0]).await.expect("a new leader");
    eprintln!(
        "leader {old} (term {term}) cut off at {cut_at:?}; new leader {new} (term {new_term})"
    );
    assert_ne!(
        new,
        old,
        "the majority elected a leader of its own:\n{}",
        cluster.daemon(healthy[0]).log_text()
    );

    never_on_floors(&looks, &cluster);
    let log_map = log.lock().unwrap().clone();
    for n in &healthy {
        let pause = longest_pause(&log_map[*n], cut_at - Duration::from_secs(1), until - start);
        eprintln!("{n}: longest pause in admissions {pause:?}");
        assert!(
            pause < Duration::from_millis(1_000),
            "{n}'s admissions paused for {pause:?}"
        );
    }
    for w in [Duration::from_secs(1), Duration::from_secs(5)] {
        let o = overshoot(&log, w);
        eprintln!("overshoot over {w:?} windows: {o:.3}");
        assert!(o <= 1.02, "overshoot {o:.3} over {w:?} windows");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_cut_off_and_healed_unseats_no_leader() -> anyhow::Result<()> {
    // The cut-off follower keeps its lease through a cut of three election timeouts (at most
    // 1.2 s each): every region must keep admitting, before and after.
    let t = slow_raft();
    let cluster = Arc::new(Cluster::start(&["a", "b", "c"], &t).await?);
    policy_everywhere(&cluster).await?;
    let (lead, term) = leader(&cluster, "a").await.expect("a leader");
    let follower = ["a", "b", "c"].into_iter().find(|n| *n != lead).unwrap();

    let start = Instant::now();
    let until = start + Duration::from_secs(11);
    let log: Log = Arc::default();
    let tasks = drive_all(&cluster, start, until, &log);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cut_at = start.elapsed();
    cluster.isolate(follower);
    tokio::time::sleep(Duration::from_millis(3_600)).await;
    cluster.heal();
    let healed_at = start.elapsed();
    let looks = watch(
        &cluster,
        &["a", "b", "c"],
        start,
        until - Duration::from_millis(500),
    )
    .await;
    for task in tasks {
        task.await?;
    }
    eprintln!("{follower} cut off from {cut_at:?} to {healed_at:?}; leader {lead} at term {term}");
    for n in ["a", "b", "c"] {
        let seen = leader(&cluster, n).await;
        assert_eq!(
            seen,
            Some((lead.clone(), term)),
            "{n} sees the same leader at the same term after the heal\n{}",
            cluster.daemon(n).log_text()
        );
    }
    never_on_floors(&looks, &cluster);
    let log_map = log.lock().unwrap().clone();
    for n in ["a", "b", "c"] {
        let pause = longest_pause(&log_map[n], cut_at - Duration::from_secs(1), until - start);
        eprintln!("{n}: longest pause in admissions {pause:?}");
        assert!(
            pause < Duration::from_millis(1_000),
            "{n}'s admissions paused for {pause:?}"
        );
    }
    let o = overshoot(&log, Duration::from_secs(5));
    eprintln!("overshoot over 5 s windows: {o:.3}");
    assert!(o <= 1.02, "overshoot {o:.3}");
    Ok(())
}

/// The shares of a and b together and c's, with c's lease end (coordinator time), as the
/// leader's region `from` reads them.
async fn shares(cluster: &Cluster, from: &str, cut: &str) -> Option<(f64, f64, u64)> {
    let r = cluster
        .daemon(from)
        .get("/v1/tenants/acme/allowance")
        .await
        .ok()?;
    let regions = r.body["policies"][0]["regions"].as_array()?.clone();
    let mut majority = 0.0;
    let mut cut_share = None;
    let mut expires = 0;
    for g in &regions {
        let share = g["share"].as_f64()?;
        if g["region"] == cut {
            cut_share = Some(share);
            expires = g["lease_expires_ms"].as_u64().unwrap_or(0);
        } else {
            majority += share;
        }
    }
    Some((majority, cut_share?, expires))
}

/// Rebalance rounds the leader has finished.
async fn rounds_done(cluster: &Cluster, lead: &str) -> Option<f64> {
    let (_, text) = cluster.daemon(lead).get_text("/metrics").await.ok()?;
    metric_value(
        &text,
        "quotad_rebalance_duration_seconds_count",
        &[("region", lead)],
    )
}

async fn lease_remaining_metric(cluster: &Cluster, n: &str) -> Option<f64> {
    let (_, text) = cluster.daemon(n).get_text("/metrics").await.ok()?;
    metric_value(&text, "quotad_lease_remaining_ms", &[("region", n)])
}

fn lapse_warnings(cluster: &Cluster, n: &str) -> usize {
    cluster
        .daemon(n)
        .log_text()
        .matches("Lease ran out: enforcing floors.")
        .count()
}

fn grants_logged(cluster: &Cluster, n: &str) -> usize {
    cluster
        .daemon(n)
        .log_text()
        .matches("Lease granted: enforcing shares.")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_majority_holds_a_cut_off_regions_share_within_two_rounds() -> anyhow::Result<()> {
    let t = Timings::default();
    let cluster = Arc::new(Cluster::start(&["a", "b", "c"], &t).await?);
    policy_everywhere(&cluster).await?;
    let (lead, _) = leader(&cluster, "a").await.expect("a leader");
    let cut = ["a", "b", "c"]
        .into_iter()
        .rev()
        .find(|n| *n != lead)
        .unwrap();
    assert_eq!(lapse_warnings(&cluster, cut), 0, "no lease has run out yet");

    let start = Instant::now();
    let until = start + Duration::from_secs(10);
    let log: Log = Arc::default();
    let tasks = drive_all(&cluster, start, until, &log);
    tokio::time::sleep(Duration::from_secs(1)).await;
    cluster.isolate(cut);
    let cut_at = wall_ms();
    let granted_before = grants_logged(&cluster, cut);
    let mut samples = Vec::new();
    let mut rounds = Vec::new();
    let mut cut_metric = Vec::new();
    while Instant::now() < until - Duration::from_secs(1) {
        // Rounds the leader finished, read before the shares: a round counted here finished
        // before the shares were read.
        if let Some(n) = rounds_done(&cluster, &lead).await {
            if let Some(s) = shares(&cluster, &lead, cut).await {
                rounds.push(n);
                samples.push((wall_ms(), s));
            }
        }
        if let Some(v) = lease_remaining_metric(&cluster, cut).await {
            cut_metric.push((wall_ms(), v));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for task in tasks {
        task.await?;
    }
    let expires = samples.iter().map(|(_, s)| s.2).max().unwrap_or(0);
    let free_at = expires + t.drift_margin_ms;
    let whole = 1.0 - FLOOR - 1e-6;
    let held = samples.iter().position(|(_, s)| s.0 >= whole);
    let held_at = held.map(|i| samples[i].0);
    // Rounds the leader finished after c's lease ended, by the first look that saw the share
    // held (a round in progress at the end, which could not see it, may be among them).
    let before = samples
        .iter()
        .zip(&rounds)
        .filter(|((at, _), _)| *at <= free_at)
        .map(|(_, n)| *n)
        .fold(0.0, f64::max);
    let rounds_taken = held.map(|i| rounds[i] - before);
    eprintln!(
        "{cut}'s lease ends (plus margin) at {free_at}; the majority holds all but its floor at \
         {held_at:?} ({:?} ms and {rounds_taken:?} finished rounds later)",
        held_at.map(|h| h as i64 - free_at as i64)
    );
    for (at, s) in &samples {
        assert!(
            s.0 <= whole + 2e-6 && s.1 >= FLOOR - 1e-6,
            "the majority took {cut}'s floor at {at}: {s:?}"
        );
        assert!(
            s.0 <= 1.0 - s.1 + 1e-6,
            "shares sum above the budget at {at}: {s:?}"
        );
    }
    let held_at = held_at.expect("the majority holds the cut-off region's share");
    assert!(
        held_at > free_at,
        "{cut}'s share was reused at {held_at}, before its lease ended at {free_at}"
    );
    let rounds_taken = rounds_taken.unwrap_or(f64::MAX);
    assert!(
        rounds_taken <= 3.0,
        "the majority held {cut}'s share {rounds_taken} rounds after its lease ended (two \
         rounds, and the one in progress at the end)"
    );

    // The cut-off region told the truth about its lease: once "Lease ran out", its remaining
    // time counting down to 0 and staying there.
    assert_eq!(
        lapse_warnings(&cluster, cut),
        1,
        "one lapse, one warning:\n{}",
        cluster.daemon(cut).log_text()
    );
    let last = cut_metric.last().map(|m| m.1);
    assert_eq!(
        last,
        Some(0.0),
        "{cut}'s lease_remaining_ms at the end of the cut"
    );
    // (A renewal in flight at the cut may still land in the first moments.)
    let settled: Vec<_> = cut_metric.iter().filter(|m| m.0 > cut_at + 500).collect();
    assert!(
        settled.windows(2).all(|w| w[1].1 <= w[0].1),
        "{cut}'s lease_remaining_ms only counts down while it is cut off: {settled:?}"
    );

    cluster.heal();
    let back = eventually(
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async { (lease_remaining_metric(&cluster, cut).await? > 0.0).then_some(()) },
    )
    .await;
    assert!(back.is_some(), "{cut} holds a lease again after the heal");
    assert_eq!(
        lapse_warnings(&cluster, cut),
        1,
        "a regained lease is no lapse"
    );
    assert_eq!(
        grants_logged(&cluster, cut),
        granted_before + 1,
        "the lease regained after the heal is told once"
    );
    Ok(())
}
