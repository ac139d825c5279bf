//! Subjects of a plan on three real regions: a subject spread over every region stays within
//! its global limit, and one whose demand is all in one region gets (nearly) its whole limit
//! there once the leader promotes it to shares of its own.
//!
//! The default plan's `calls` is 200 per 10 s (20 a second), burst 20. Both subjects are
//! offered three times their limit: `spread` 20 a second in each region, `solo` 60 a second in
//! region a only. Without promotion `solo` would decide at the class's share of region a, about
//! a third of its limit, since the class's demand is spread evenly by `spread`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quotad_system_tests::{eventually, Cluster, Timings, TOKEN};
use serde_json::json;

const REGIONS: [&str; 3] = ["a", "b", "c"];
/// Tokens per window, and the window.
const LIMIT: f64 = 200.0;
const WINDOW: Duration = Duration::from_secs(10);
/// Load before measuring: promotion, then the regions acknowledging it.
const WARM_UP: Duration = Duration::from_secs(8);

/// One answered check: who, when it was sent (since the load started), whether admitted.
#[derive(Debug, Clone, Copy)]
struct Answer {
    subject: &'static str,
    sent: Duration,
    admitted: bool,
}

/// Sends checks of `subject`'s `calls` to `base` at `per_s` a second until `until`, each on
/// its own task so a slow answer does not slow the offered rate.
fn offer(
    http: reqwest::Client,
    base: String,
    subject: &'static str,
    per_s: u64,
    start: Instant,
    until: Duration,
    answers: Arc<Mutex<Vec<Answer>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / per_s));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let body = json!({"tenant": subject, "policy": "calls", "cost": 1}).to_string();
        let mut inflight = tokio::task::JoinSet::new();
        while start.elapsed() < until {
            tick.tick().await;
            let sent = start.elapsed();
            let (http, url, body, answers) = (
                http.clone(),
                format!("{base}/v1/check"),
                body.clone(),
                answers.clone(),
            );
            inflight.spawn(async move {
                let status = http
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .map(|r| r.status().as_u16());
                answers.lock().unwrap().push(Answer {
                    subject,
                    sent,
                    admitted: status.is_ok_and(|s| s == 200),
                });
            });
        }
        while inflight.join_next().await.is_some() {}
    })
}

/// Admitted checks of `subject` sent in `[from, from + WINDOW)`.
fn admitted(answers: &[Answer], subject: &str, from: Duration) -> f64 {
    answers
        .iter()
        .filter(|a| a.subject == subject && a.admitted)
        .filter(|a| a.sent >= from && a.sent < from + WINDOW)
        .count() as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_subjects_keep_their_limit_and_a_one_region_subject_gets_it_there(
) -> anyhow::Result<()> {
    let cluster = Cluster::start(&REGIONS, &Timings::default()).await?;
    let plan = json!({"policies": {"calls": {"limit": LIMIT, "window_ms": 10_000, "burst": 20}}});
    let r = cluster
        .daemon("a")
        .request(
            "PUT",
            "/v1/plans/default",
            Some(TOKEN),
            Some(plan.to_string()),
        )
        .await?;
    anyhow::ensure!(r.status == 200, "PUT plan: {} {}", r.status, r.body);
    for name in REGIONS {
        let known = eventually(
            Duration::from_secs(10),
            Duration::from_millis(50),
            || async {
                let r = cluster.daemon(name).check("probe", "calls", 1).await.ok()?;
                (r.status == 200).then_some(())
            },
        )
        .await;
        anyhow::ensure!(known.is_some(), "region {name} never knew the plan");
    }

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .pool_max_idle_per_host(64)
        .build()?;
    let answers = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let until = WARM_UP + WINDOW;
    let mut load = Vec::new();
    for name in REGIONS {
        let base = cluster.daemon(name).base();
        load.push(offer(
            http.clone(),
            base.clone(),
            "spread",
            20,
            start,
            until,
            answers.clone(),
        ));
        if name == "a" {
            load.push(offer(
                http.clone(),
                base,
                "solo",
                60,
                start,
                until,
                answers.clone(),
            ));
        }
    }
    for l in load {
        l.await?;
    }
    let answers = answers.lock().unwrap().clone();
    let offered = |s: &str| {
        answers
            .iter()
            .filter(|a| a.subject == s && a.sent >= WARM_UP)
            .count() as f64
    };
    let (spread, solo) = (
        admitted(&answers, "spread", WARM_UP),
        admitted(&answers, "solo", WARM_UP),
    );
    // The first seconds, for the record: how fast promotion took effect.
    let per_2s: Vec<f64> = (0..until.as_secs() / 2)
        .map(|i| {
            answers
                .iter()
                .filter(|a| a.subject == "solo" && a.admitted)
                .filter(|a| a.sent.as_secs() / 2 == i)
                .count() as f64
                / 2.0
        })
        .collect();
    eprintln!(
        "over {WINDOW:?} after {WARM_UP:?}: spread admitted {spread} of {} offered, solo {solo} \
         of {} offered (limit {LIMIT}); solo admitted per second, by 2 s: {per_2s:?}",
        offered("spread"),
        offered("solo"),
    );
    // (a) Spread over every region: within its global limit, and not starved.
    assert!(spread <= 1.02 * LIMIT, "spread admitted {spread}");
    assert!(spread >= 0.8 * LIMIT, "spread admitted only {spread}");
    // (b) All in region a: nearly its whole limit there, and no more.
    assert!(solo >= 0.97 * LIMIT, "solo admitted only {solo}");
    assert!(solo <= 1.02 * LIMIT, "solo admitted {solo}");
    Ok(())
}
