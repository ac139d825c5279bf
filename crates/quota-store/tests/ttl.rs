//! TTL and memory: idle state expires once it would read as full (or empty) and the minimum
//! idle TTL has passed, never earlier; a hot key costs GET + SET PX (no PEXPIRE, no parameter
//! read); a fresh key behaves as a full bucket; new parameters keep the expiry safe.
//! Redis expiry is real time, so the expiry test (minimum idle TTL 1 ms) waits about 1.5 s.
//!
//! The one-million-identities memory run is opt-in:
//! `cargo test --release -p quota-store --test ttl -- --ignored --nocapture`.

mod common;

use std::time::Duration;

use common::{conn, fresh_bucket, req, tokens};
use quota_store::{Limit, RedisStore, RedisStoreConfig, SetParams, Store};
use redis::AsyncCommands;
use redis_harness::RedisServer;

/// A store whose buckets may expire as soon as they would read full.
async fn fast_expiry_store(server: &RedisServer) -> RedisStore {
    let cfg = RedisStoreConfig::standalone(server.url())
        .with_timeout(Duration::from_secs(5))
        .with_min_idle_ttl(Duration::from_millis(1));
    RedisStore::connect(cfg).await.unwrap()
}

#[tokio::test]
async fn an_idle_bucket_expires_after_its_ttl_and_returns_full() {
    let server = RedisServer::start().unwrap();
    let s = fast_expiry_store(&server).await;
    let mut c = conn(&server).await;
    let b = fresh_bucket("ttl");
    let l = tokens(1, 1); // refills fully in 1 s
    assert!(s.check(&req(&b, l, 1, None)).await.unwrap().allowed);
    let key = b.state_key(quota_core::keys::StateKind::Bucket);
    let pttl: i64 = c.pttl(&key).await.unwrap();
    // The time to refill fully (1000 ms).
    assert!((900..=1000).contains(&pttl), "pttl {pttl}");
    // Many other one-shot buckets that will expire while listed in the activity index.
    for _ in 0..250 {
        s.check(&req(&fresh_bucket("gone"), l, 1, None))
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1400)).await;
    let exists: bool = c.exists(&key).await.unwrap();
    assert!(!exists, "the idle bucket should have expired");
    let d = s.check(&req(&b, l, 1, None)).await.unwrap();
    assert_eq!((d.allowed, d.remaining), (true, 0));
    // Regression: batches made only of expired keys yield no records, and must not end the
    // collection early. Only the live bucket is reported (its usage since it came back), and
    // the index is drained.
    let usage = s.collect_usage(10).await.unwrap();
    assert_eq!(
        usage,
        vec![quota_store::UsageRecord {
            bucket: b,
            admitted: 1,
            denied: 0
        }]
    );
    let left: u64 = c.scard(quota_core::keys::ACTIVE_INDEX).await.unwrap();
    assert_eq!(left, 0);
}

#[tokio::test]
async fn ttl_covers_a_full_refill_and_a_dry_bucket_never_expires() {
    let server = RedisServer::start().unwrap();
    let s = fast_expiry_store(&server).await;
    let mut c = conn(&server).await;
    let slow = fresh_bucket("slow");
    s.check(&req(&slow, tokens(100, 1), 100, None))
        .await
        .unwrap();
    let pttl: i64 = c
        .pttl(slow.state_key(quota_core::keys::StateKind::Bucket))
        .await
        .unwrap();
    assert!((99_000..=100_000).contains(&pttl), "pttl {pttl}");
    let dry = fresh_bucket("dry");
    s.check(&req(&dry, tokens(5, 0), 1, None)).await.unwrap();
    let pttl: i64 = c
        .pttl(dry.state_key(quota_core::keys::StateKind::Bucket))
        .await
        .unwrap();
    assert_eq!(
        pttl, -1,
        "a bucket that never refills must not expire (it would come back full)"
    );
    let w = fresh_bucket("window");
    s.check(&req(
        &w,
        Limit::SlidingWindow {
            limit: 3,
            window_ms: 60_000,
        },
        1,
        None,
    ))
    .await
    .unwrap();
    let pttl: i64 = c
        .pttl(w.state_key(quota_core::keys::StateKind::Window))
        .await
        .unwrap();
    assert!((59_000..=75_000).contains(&pttl), "pttl {pttl}");
}

#[tokio::test]
async fn the_default_minimum_idle_ttl_keeps_usage_for_a_minute() {
    let server = RedisServer::start().unwrap();
    let s = common::store(&server).await;
    let mut c = conn(&server).await;
    let b = fresh_bucket("default-ttl");
    s.check(&req(&b, tokens(1, 1), 1, None)).await.unwrap();
    let pttl: i64 = c
        .pttl(b.state_key(quota_core::keys::StateKind::Bucket))
        .await
        .unwrap();
    assert!((59_000..=60_000).contains(&pttl), "pttl {pttl}");
}

#[tokio::test]
async fn new_parameters_rewrite_the_live_bucket_and_keep_its_expiry_safe() {
    let server = RedisServer::start().unwrap();
    let s = fast_expiry_store(&server).await;
    let mut c = conn(&server).await;
    let b = fresh_bucket("params");
    let key = b.state_key(quota_core::keys::StateKind::Bucket);
    let now = Some(1_700_000_000_000);
    // Fallback 10 tokens at 10/s: 5 taken, 500 ms to refill.
    let d = s.check(&req(&b, tokens(10, 10), 5, now)).await.unwrap();
    assert_eq!(d.remaining, 5);
    let pttl: i64 = c.pttl(&key).await.unwrap();
    assert!((400..=500).contains(&pttl), "pttl {pttl}");
    // Stored 20 at 1/s: the live bucket takes them (same ts: 5 left of 20), and its expiry
    // grows to the new time to refill, 15 s.
    s.set_params(&SetParams::new(b.clone(), tokens(20, 1)))
        .await
        .unwrap();
    let pttl: i64 = c.pttl(&key).await.unwrap();
    assert!((14_000..=15_000).contains(&pttl), "pttl {pttl}");
    let d = s.check(&req(&b, tokens(10, 10), 1, now)).await.unwrap();
    assert_eq!((d.remaining, d.reset_ms), (4, Some(16_000)));
    // No refill any more: the key must stay.
    s.set_params(&SetParams::new(b.clone(), tokens(20, 0)))
        .await
        .unwrap();
    let pttl: i64 = c.pttl(&key).await.unwrap();
    assert_eq!(pttl, -1);
    let d = s.check(&req(&b, tokens(10, 10), 1, now)).await.unwrap();
    assert_eq!((d.remaining, d.reset_ms), (3, None));
    // Usage counted across the parameter changes.
    let usage = s.collect_usage(10).await.unwrap();
    assert_eq!(usage.len(), 1);
    assert_eq!((usage[0].admitted, usage[0].denied), (7, 0));
    // Collection keeps the expiry (KEEPTTL) and the state.
    let pttl: i64 = c.pttl(&key).await.unwrap();
    assert_eq!(pttl, -1);
    let d = s.check(&req(&b, tokens(10, 10), 1, now)).await.unwrap();
    assert_eq!(d.remaining, 2);
}

/// A bucket in debt expires only once it would be full again (an expired bucket reads as
/// full), and never while that is beyond `MAX_WAIT_MS`; new parameters lengthen its expiry to
/// the new time to full from the debt.
#[tokio::test]
async fn a_bucket_in_debt_expires_only_once_full() {
    use quota_core::bucket::{MAX_CAPACITY_UT, MAX_WAIT_MS, UT};
    use quota_core::BucketParams;
    use quota_store::ChargeRequest;
    let server = RedisServer::start().unwrap();
    let s = fast_expiry_store(&server).await;
    let mut c = conn(&server).await;
    let b = fresh_bucket("owing");
    let key = b.state_key(quota_core::keys::StateKind::Bucket);
    let p = BucketParams::new(10 * UT, UT).unwrap();
    let o = s
        .charge(&ChargeRequest::new(b.clone(), p, 15, 10 * UT))
        .await
        .unwrap();
    assert_eq!(o.debt, 5);
    // 5 owed and 10 to fill at 1 a second.
    let pttl: i64 = c.pttl(&key).await.unwrap();
    assert!((14_000..=15_000).contains(&pttl), "pttl {pttl}");
    // A denied check keeps the expiry covering the repayment.
    let d = s
        .check(&req(&b, Limit::TokenBucket(p), 1, None))
        .await
        .unwrap();
    assert!(!d.allowed);
    let pttl: i64 = c.pttl(&key).await.unwrap();
    assert!((14_000..=15_000).contains(&pttl), "pttl {pttl}");
    // Half the refill: twice as long from the same debt.
    let slow = Limit::TokenBucket(BucketParams::new(10 * UT, UT / 2).unwrap());
    s.set_params(&SetParams::new(b.clone(), slow))
        .await
        .unwrap();
    let pttl: i64 = c.pttl(&key).await.unwrap();
    assert!((29_000..=30_000).contains(&pttl), "pttl {pttl}");

    // A debt repaid only beyond MAX_WAIT_MS (1 µt a ms): the key stays.
    let deep = fresh_bucket("deep");
    let key = deep.state_key(quota_core::keys::StateKind::Bucket);
    let p = BucketParams::per_period(UT, 1, 1).unwrap();
    let t0 = 1_700_000_000_000;
    let cost = MAX_WAIT_MS / UT + 1;
    let o = s
        .charge(&ChargeRequest::new(deep.clone(), p, cost, MAX_CAPACITY_UT - UT).at(t0))
        .await
        .unwrap();
    assert_eq!(
        (o.applied, o.retry_after_ms, o.reset_ms),
        (cost, None, None)
    );
    let pttl: i64 = c.pttl(&key).await.unwrap();
    assert_eq!(pttl, -1);
    // Once the time to full is within the bound, it expires then.
    let later = t0 + (cost * UT - MAX_WAIT_MS);
    let d = s
        .check(&req(&deep, Limit::TokenBucket(p), 0, Some(later)))
        .await
        .unwrap();
    assert_eq!(d.reset_ms, Some(MAX_WAIT_MS));
    s.check(&req(&deep, Limit::TokenBucket(p), 1, Some(later)))
        .await
        .unwrap();
    let pttl: i64 = c.pttl(&key).await.unwrap();
    assert!(pttl > (MAX_WAIT_MS - 60_000) as i64, "pttl {pttl}");
}

#[tokio::test]
async fn a_hot_key_costs_get_and_set_only() {
    let server = RedisServer::start().unwrap();
    let s = common::store(&server).await;
    let mut c = conn(&server).await;
    let b = fresh_bucket("hot");
    let l = tokens(1000, 1000);
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut c)
        .await
        .unwrap();
    // 2000 decisions over 2 s of explicit time.
    for i in 0..2000 {
        s.check(&req(&b, l, 1, Some(1_700_000_000_000 + i)))
            .await
            .unwrap();
    }
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut c)
        .await
        .unwrap();
    let calls = |cmd: &str| -> u64 {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    // 2000 decisions (the first EVALSHA may meet NOSCRIPT and be repeated after SCRIPT LOAD).
    assert!(
        (2000..=2001).contains(&calls("evalsha")),
        "{}",
        calls("evalsha")
    );
    assert_eq!(calls("pexpire"), 0);
    // The parameters are read once, when the bucket is created.
    assert_eq!(calls("hgetall"), 1);
    assert_eq!(calls("hmget"), 0);
    assert!((2000..=2001).contains(&calls("get")), "{}", calls("get"));
    assert!((2000..=2001).contains(&calls("set")), "{}", calls("set"));
    assert_eq!(calls("sadd"), 1, "one SADD per bucket per report interval");
}

/// One million one-shot identities: Redis memory returns near its baseline once their TTLs
/// pass and usage has been collected. Prints used_memory before / peak / after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "opt-in memory run (~1 min in release): see the module doc"]
async fn one_million_identities_leave_no_trace() {
    let server = RedisServer::start().unwrap();
    let s = fast_expiry_store(&server).await;
    let used = || {
        let s = s.clone();
        async move {
            s.info_field("memory", "used_memory")
                .await
                .unwrap()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        }
    };
    let l = tokens(1, 1); // TTL ≈ 1 s
    let before = used().await;
    let n: usize = std::env::var("QUOTAD_IDENTITIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let started = std::time::Instant::now();
    let mut peak = 0;
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..64 {
        let s = s.clone();
        tasks.spawn(async move {
            let mut i = w;
            while i < n {
                let b = fresh_bucket("one-shot");
                s.check(&req(&b, l, 1, None)).await.unwrap();
                i += 64;
            }
        });
    }
    while !tasks.is_empty() {
        tokio::select! {
            r = tasks.join_next() => { if let Some(r) = r { r.unwrap(); } }
            _ = tokio::time::sleep(Duration::from_millis(200)) => { peak = peak.max(used().await); }
        }
    }
    peak = peak.max(used().await);
    let load_s = started.elapsed().as_secs_f64();
    // Let the TTLs pass, drain the activity index, then give active expiry time to finish.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut collected = 0;
    loop {
        let got = s.collect_usage(100_000).await.unwrap().len();
        collected += got;
        if got == 0 {
            break;
        }
    }
    let mut after = used().await;
    for _ in 0..60 {
        let keys: u64 = s
            .info_field("keyspace", "db0")
            .await
            .unwrap()
            .map_or(0, |v| {
                v.split(',')
                    .next()
                    .and_then(|k| k.strip_prefix("keys="))
                    .and_then(|k| k.parse().ok())
                    .unwrap_or(0)
            });
        after = used().await;
        if keys == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "{n} one-shot identities in {load_s:.1} s: used_memory before {before} B, peak {peak} B, \
         after {after} B ({collected} usage records collected while expiring)"
    );
    assert!(peak > before + 50 * n as u64, "the load did not register");
    assert!(
        after < before + (peak - before) / 20,
        "memory did not return near the baseline"
    );
}

/// A hold's record expires by itself: `ttl + HOLD_MEMORY_MS` after it was made while open,
/// `HOLD_MEMORY_MS` after it ended; once Redis dropped it, the hold is unknown and its id free.
#[tokio::test]
async fn a_hold_record_expires_its_memory_after_the_hold() {
    use quota_core::bounds::HOLD_MEMORY_MS;
    use quota_store::{HoldLimit, HoldRequest, SettleRequest, Settled};
    let server = RedisServer::start().unwrap();
    let s = common::store(&server).await;
    let mut c = conn(&server).await;
    let b = fresh_bucket("hold-ttl");
    let hold = HoldRequest {
        id: "h-1".into(),
        limits: vec![HoldLimit {
            bucket: b.clone(),
            limit: tokens(10, 1),
            debt_limit_ut: 0,
        }],
        cost: 4,
        ttl_ms: 30_000,
        now_ms: None,
    };
    assert!(s.hold(&hold).await.unwrap().held);
    let record = quota_core::keys::hold_key(&b.tenant, "h-1");
    let pttl: i64 = c.pttl(&record).await.unwrap();
    let open = (30_000 + HOLD_MEMORY_MS) as i64;
    assert!((open - 1000..=open).contains(&pttl), "open: pttl {pttl}");
    let settle = SettleRequest {
        tenant: b.tenant.clone(),
        id: "h-1".into(),
        cost: 4,
        now_ms: None,
    };
    assert!(matches!(
        s.settle(&settle).await.unwrap(),
        Settled::Done {
            replayed: false,
            ..
        }
    ));
    let pttl: i64 = c.pttl(&record).await.unwrap();
    let ended = HOLD_MEMORY_MS as i64;
    assert!((ended - 1000..=ended).contains(&pttl), "ended: pttl {pttl}");
    // Its memory over (shortened here, as the clock would end it): unknown, the id free.
    let _: bool = c.pexpire(&record, 1).await.unwrap();
    while c.exists::<_, bool>(&record).await.unwrap() {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(s.settle(&settle).await.unwrap(), Settled::Unknown);
    let again = s.hold(&hold).await.unwrap();
    assert!(again.held && !again.replayed);
}

/// A concurrency limit's slots expire with their last slot (a crashed holder's slot comes back
/// at its expiry, and an idle limit leaves no key); its usage counters live the minimum idle
/// TTL from the latest acquisition, as a window's.
#[tokio::test]
async fn a_concurrency_limits_slots_expire_with_the_last_one() {
    use quota_core::keys::{self, StateKind};
    use quota_store::{HoldLimit, HoldRequest};
    let server = RedisServer::start().unwrap();
    let s = common::store(&server).await;
    let mut c = conn(&server).await;
    let b = fresh_bucket("slots-ttl");
    let take = |id: &str, ttl_ms: u64| HoldRequest {
        id: id.into(),
        limits: vec![HoldLimit {
            bucket: b.clone(),
            limit: Limit::Concurrency { limit: 2 },
            debt_limit_ut: 0,
        }],
        cost: 1,
        ttl_ms,
        now_ms: None,
    };
    assert!(s.hold(&take("long", 30_000)).await.unwrap().held);
    assert!(s.hold(&take("short", 5_000)).await.unwrap().held);
    let slots = b.state_key(StateKind::Slots);
    let pttl: i64 = c.pttl(&slots).await.unwrap();
    assert!((29_000..=30_000).contains(&pttl), "slots: pttl {pttl}");
    let usage = keys::slots_usage_key(&b.tenant, &b.policy, b.version);
    let pttl: i64 = c.pttl(&usage).await.unwrap();
    let idle = quota_store::DEFAULT_MIN_IDLE_TTL_MS as i64;
    assert!((idle - 1000..=idle).contains(&pttl), "usage: pttl {pttl}");
    // A third is denied; the set keeps its expiry.
    assert!(!s.hold(&take("third", 60_000)).await.unwrap().held);
    let pttl: i64 = c.pttl(&slots).await.unwrap();
    assert!(
        (28_000..=30_000).contains(&pttl),
        "slots after a denial: pttl {pttl}"
    );
}
