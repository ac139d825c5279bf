//! The `local` fail mode across an outage of the regional Redis: the in-process bucket goes on
//! from what Redis last answered (not from a full bucket), what it admits is charged to Redis
//! when Redis returns, and so admissions before, during and after the outage stay within the
//! one bucket's bound, `burst + rate · t` over the test's whole run.

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use quotad_system_tests::fault_proxy::FaultProxy;
use quotad_system_tests::{eventually, redis_config, Daemon};
use redis_harness::RedisServer;
use serde_json::json;

/// The policy's limit and burst; its window is each test's.
const BURST: u64 = 20;

fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()?
        .success();
    anyhow::ensure!(ok, "kill {sig} {pid} failed");
    Ok(())
}

/// Admissions counted over the whole test.
#[derive(Default)]
struct Tally {
    admitted: AtomicU64,
}

impl Tally {
    /// One check of cost 1: its mode; an admission counted. Anything but 200 or 429 fails.
    async fn check(&self, d: &Daemon) -> anyhow::Result<String> {
        let r = d.check("acme", "writes", 1).await?;
        match r.status {
            200 => {
                self.admitted.fetch_add(1, Ordering::Relaxed);
            }
            429 => {}
            s => anyhow::bail!("check answered {s}: {}", r.body),
        }
        Ok(r.body["mode"].as_str().unwrap_or_default().to_string())
    }

    /// Checks until one is decided in `mode` (within 10 s), each counted.
    async fn until_mode(&self, d: &Daemon, mode: &str) -> bool {
        eventually(
            Duration::from_secs(10),
            Duration::from_millis(20),
            || async {
                let m = self.check(d).await.ok()?;
                (m == mode).then_some(())
            },
        )
        .await
        .is_some()
    }

    fn admitted(&self) -> u64 {
        self.admitted.load(Ordering::Relaxed)
    }
}

/// Regression: the in-process bucket started full whatever Redis had spent, and nothing was
/// charged back, so an outage admitted up to a whole burst more than the bucket allows: here
/// 12 spent before it, 20 more during it, and after it what Redis had left.
///
/// Redis stopped (SIGSTOP): the calls the daemon gave up on run when it resumes, spending for
/// no one.
#[tokio::test]
async fn a_stopped_redis_admits_no_more_than_the_bucket_allows() -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    // Redis timeout 100 ms, failure_threshold 2, open_ms 200 (`redis_config`).
    let d = Daemon::start(&redis_config(&redis.url())).await?;
    let pid = redis.pid();
    within_the_bound_across(
        &d,
        (60_000, Duration::ZERO),
        || signal(pid, "-STOP"),
        || signal(pid, "-CONT"),
    )
    .await
}

/// Redis out of the daemon's reach (a proxy refusing its connections): no call it gave up on
/// runs later, so the checks after the outage stay within the bound only if what was admitted
/// in process is charged to Redis.
#[tokio::test]
async fn tokens_admitted_in_process_are_charged_when_redis_returns() -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port()).parse()?).await?;
    let d = Daemon::start(&redis_config(&format!("redis://{}", proxy.addr))).await?;
    let pid = d.pid().context("the daemon's pid")?;
    proxy.set_candidates(&[pid]);
    within_the_bound_across(
        &d,
        (60_000, Duration::ZERO),
        || {
            proxy.block(&[pid]);
            Ok(())
        },
        || {
            proxy.heal();
            Ok(())
        },
    )
    .await
}

/// An outage long enough for the in-process bucket to refill more than a burst, on a bucket
/// that refills in 2 s: it goes on refilling at the share's rate, and the charge takes the Redis
/// bucket (full again by then) as low as it goes; the refill both credited is not charged, and
/// the bound still holds.
#[tokio::test]
async fn a_long_outage_refills_in_process_and_charges_what_redis_holds() -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", redis.port()).parse()?).await?;
    let d = Daemon::start(&redis_config(&format!("redis://{}", proxy.addr))).await?;
    let pid = d.pid().context("the daemon's pid")?;
    proxy.set_candidates(&[pid]);
    within_the_bound_across(
        &d,
        (2_000, Duration::from_millis(2_500)),
        || {
            proxy.block(&[pid]);
            Ok(())
        },
        || {
            proxy.heal();
            Ok(())
        },
    )
    .await
}

/// For a policy of `BURST` tokens per `window_ms`: 12 checks before an outage (`cut` to
/// `heal`), during it 25 decided in process and more until it has lasted `at_least`, 20 after
/// decisions go through Redis again: every admission counted, their sum within
/// `burst + rate · t` for the time from before the first check to after the last.
async fn within_the_bound_across(
    d: &Daemon,
    (window_ms, at_least): (u64, Duration),
    cut: impl FnOnce() -> anyhow::Result<()>,
    heal: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let rate_per_s = BURST as f64 * 1000.0 / window_ms as f64;
    // One region: the whole budget here. Burst 20: 1 % of it is one check, too few to
    // reserve, so every check asks Redis.
    d.put_policy(
        "acme",
        "writes",
        json!({"limit": BURST, "window_ms": window_ms, "fail_mode": "local"}),
    )
    .await?;
    let t = Tally::default();
    // The bound counts from before the first check to after the last: generous.
    let started = Instant::now();

    for _ in 0..12 {
        assert_eq!(t.check(d).await?, "normal");
    }
    assert_eq!(t.admitted(), 12, "the bucket held its burst");

    cut()?;
    let cut_at = Instant::now();
    let during = async {
        // Errors, not panics, in here: Redis comes back whatever happens.
        anyhow::ensure!(
            t.until_mode(d, "degraded_local").await,
            "checks are decided in process while Redis is out"
        );
        let local_from = Instant::now();
        let mut n = 0;
        while n < 25 || cut_at.elapsed() < at_least {
            let mode = t.check(d).await?;
            anyhow::ensure!(
                mode == "degraded_local",
                "decided {mode} while Redis is out"
            );
            n += 1;
        }
        // What the in-process bucket refilled while the test watched it; half, to be generous.
        let refilled = (rate_per_s * local_from.elapsed().as_secs_f64() / 2.0).floor() as u64;
        anyhow::Ok((t.admitted() - 12, refilled))
    }
    .await;
    heal()?;
    let (during, refilled) = during?;
    let outage = started.elapsed();
    // Redis had 8 left: the in-process bucket goes on from there (a bucket starting empty
    // would admit none of them), and refills.
    assert!(
        during >= 8 + refilled,
        "{during} admitted in process; Redis had 8 left, and at least {refilled} refilled"
    );

    assert!(
        t.until_mode(d, "normal").await,
        "decisions go through Redis again once it answers"
    );
    for _ in 0..20 {
        t.check(d).await?;
    }
    let elapsed = started.elapsed();
    let admitted = t.admitted();
    let bound = BURST as f64 + rate_per_s * elapsed.as_secs_f64();
    eprintln!(
        "admitted {admitted} (12 before the outage, {during} during it) in {elapsed:?} \
         (outage over at {outage:?}); the bucket allows {bound:.2}"
    );
    assert!(
        admitted as f64 <= bound,
        "admitted {admitted} in {elapsed:?}: more than the bucket's {bound:.2}"
    );
    Ok(())
}

/// The allowance's worst case counts what a Redis outage can add under `local`: nothing for a
/// token bucket (one region: nothing from being cut off either), the share's limit for a
/// sliding window, whose in-process window starts unspent; `closed` adds nothing.
#[tokio::test]
async fn the_allowance_counts_what_an_outage_can_add() -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    let d = Daemon::start(&redis_config(&redis.url())).await?;
    for (policy, spec) in [
        ("bucket", json!({"limit": 20, "window_ms": 60000})),
        (
            "window",
            json!({"limit": 30, "window_ms": 60000, "algorithm": "sliding_window"}),
        ),
        (
            "window-closed",
            json!({"limit": 30, "window_ms": 60000, "algorithm": "sliding_window",
                   "fail_mode": "closed"}),
        ),
    ] {
        d.put_policy("acme", policy, spec).await?;
    }
    let r = d.get("/v1/tenants/acme/allowance").await?;
    assert_eq!(r.status, 200, "{}", r.body);
    let worst = |policy: &str| {
        r.body["policies"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["policy"] == policy))
            .map(|p| p["worst_case_overshoot_tokens"].clone())
    };
    assert_eq!(worst("bucket"), Some(json!(0.0)), "{}", r.body);
    assert_eq!(worst("window"), Some(json!(30.0)), "{}", r.body);
    assert_eq!(worst("window-closed"), Some(json!(0.0)), "{}", r.body);
    Ok(())
}
