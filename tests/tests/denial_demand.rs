//! Checks answered from the denial cache are demand: a region flooded far above its share
//! reports the flood, not the few checks that reach Redis, so the allocator moves share to it
//! as fast as when Redis answers every denial.
//!
//! The same run twice on three regions, with `redis.denial_cache` off and on: b and c ask for
//! more than the budget, so a, idle, is left its floor; then a is flooded, and its share must
//! climb to its third as fast in both runs. With the cache on, a's Redis sees one or two calls
//! per token its floor refills, so were cached denials left out, a would report about twice
//! its share and climb only by that factor each round (3.6–5.3 s against 1.2 s, measured).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quotad_system_tests::{eventually, Cluster, Timings};
use serde_json::json;

/// 50 tokens a second over three regions, 2 % floors (1 token a second: a check of 1 fits);
/// b and c ask 40 a second each, a (once flooded) 200: every region asks more than a third,
/// so demand says a third each.
const LIMIT: u64 = 50;
const BUSY_PER_S: u32 = 40;
const FLOOD_PER_S: u32 = 200;

/// a's share while idle: its floor, give or take the allocator's threshold.
const STARVED: f64 = 0.06;

/// The share of a that the flood's demand brings: near its third.
const RISEN: f64 = 0.28;

/// Sends `per_s` checks a second of cost 1 through `region` from `callers` tasks, until
/// `until` or `stop`; each task answers its admissions and denials.
fn drive(
    cluster: &Arc<Cluster>,
    region: &str,
    per_s: u32,
    callers: u32,
    until: Instant,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<(u64, u64)>> {
    (0..callers)
        .map(|_| {
            let cluster = cluster.clone();
            let region = region.to_string();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(1) * callers / per_s);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                let (mut admitted, mut denied) = (0, 0);
                while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    match cluster.daemon(&region).check("acme", "writes", 1).await {
                        Ok(r) if r.status == 200 => admitted += 1,
                        Ok(r) if r.status == 429 => denied += 1,
                        _ => {}
                    }
                }
                (admitted, denied)
            })
        })
        .collect()
}

/// What one flood showed: how long a's share took to reach [`RISEN`] (`None`: not within the
/// flood), a's denials, and its denial-cache hits.
#[derive(Debug)]
struct Run {
    rose_after: Option<Duration>,
    denied: u64,
    cache_hits: f64,
}

async fn flood(denial_cache: bool) -> anyhow::Result<Run> {
    let t = Timings {
        denial_cache,
        ..Timings::default()
    };
    let cluster = Arc::new(Cluster::start(&["a", "b", "c"], &t).await?);
    cluster
        .daemon("b")
        .put_policy(
            "acme",
            "writes",
            json!({"limit": LIMIT, "window_ms": 1000, "floor": 0.02}),
        )
        .await?;
    // Every region enforces its even share before the flood.
    let even = cluster
        .leased_share("a", "acme", 0.2)
        .await
        .expect("a enforces its share of the policy");
    assert!(even < 0.4, "a starts near an even split: {even}");

    // b and c ask more than the whole budget: a, idle, is left its floor.
    let stop = Arc::new(AtomicBool::new(false));
    let end = Instant::now() + Duration::from_secs(40);
    let busy: Vec<_> = ["b", "c"]
        .into_iter()
        .flat_map(|r| drive(&cluster, r, BUSY_PER_S, 2, end, &stop))
        .collect();
    let starved = eventually(
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async {
            let (share, _) = cluster.share("a", "acme").await?;
            (share <= STARVED).then_some(share)
        },
    )
    .await;
    assert!(starved.is_some(), "a, idle, falls to its floor");
    // Then a is flooded.
    let start = Instant::now();
    let until = start + Duration::from_secs(20);
    let a = drive(&cluster, "a", FLOOD_PER_S, 4, until, &stop);
    let rose_after = eventually(
        until.saturating_duration_since(Instant::now()),
        Duration::from_millis(100),
        || async {
            let (share, _) = cluster.share("a", "acme").await?;
            (share >= RISEN).then(|| start.elapsed())
        },
    )
    .await;
    // The flood stops as soon as the share has risen (or its time is up).
    stop.store(true, Ordering::Relaxed);
    let mut denied = 0;
    for h in a {
        denied += h.await?.1;
    }
    for h in busy {
        h.await?;
    }
    let (_, metrics) = cluster.daemon("a").get_text("/metrics").await?;
    let cache_hits =
        quotad_system_tests::metric_value(&metrics, "quotad_denial_cache_hits_total", &[])
            .unwrap_or(0.0);
    Ok(Run {
        rose_after,
        denied,
        cache_hits,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_answered_from_the_denial_cache_moves_share_as_fast_as_one_redis_answers(
) -> anyhow::Result<()> {
    let uncached = flood(false).await?;
    eprintln!("denial cache off: {uncached:?}");
    let cached = flood(true).await?;
    eprintln!("denial cache on: {cached:?}");
    assert_eq!(uncached.cache_hits, 0.0, "the cache is off");
    assert!(
        cached.cache_hits > cached.denied as f64 / 2.0,
        "the flood was answered from the cache: {cached:?}"
    );
    let baseline = uncached
        .rose_after
        .expect("with Redis answering every denial, a's share follows the flood");
    let rose = cached.rose_after.unwrap_or_else(|| {
        panic!("with the denial cache, a's share never reached {RISEN}: {cached:?}")
    });
    // As fast, give or take two rebalance rounds (400 ms each) and the noise of a shared host.
    let allowed = baseline.mul_f64(1.5) + Duration::from_millis(800);
    assert!(
        rose <= allowed,
        "a's share reached {RISEN} after {rose:?} with the denial cache, {baseline:?} without"
    );
    Ok(())
}
