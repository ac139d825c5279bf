//! Differential tests: the Lua scripts on a real redis-server (explicit now) against the
//! quota-core references, step by step, comparing every decision and the stored state.
//!
//! 250 cases × up to 100 steps per algorithm (≥ 10 000 checks each, asserted), including extremes: capacity
//! near MAX_CAPACITY_UT, tiny and huge rates, long idle gaps, time moving backwards, parameter
//! changes through set_params.lua (buckets; it also rewrites the copy inside the packed state) or
//! the stored-parameters hash (windows). `PROPTEST_CASES` scales it up.
//!
//! Then the embedded store against the Redis store through the `Store` trait: decisions, peeks
//! (cost 0) and usage, with parameters written with and without lease ends.

mod common;

use std::cell::{Cell, RefCell};

use proptest::prelude::*;
use proptest::test_runner::{RngSeed, TestRunner};
use quota_core::bucket::{self, MAX_CAPACITY_UT, MAX_FILL_RATIO, MAX_RATE_UT_PER_S, UT};
use quota_core::window::{
    self, EXACT_LOG_MAX, MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT,
};
use quota_core::{BucketParams, BucketState, Decision, WindowParams, WindowState};
use quota_store::script::{SET_PARAMS_LUA, SLIDING_WINDOW_LUA, TOKEN_BUCKET_LUA};
use quota_store::{EmbeddedStore, Limit, RedisStore, SetParams, Store, UsageRecord, MAX_COST};
use redis_harness::RedisServer;

struct Fixture {
    // Field order: the connection closes before the server stops.
    conn: redis::Connection,
    bucket_sha: String,
    window_sha: String,
    next: u64,
    _server: RedisServer,
}

thread_local! {
    static FIX: RefCell<Option<Fixture>> = const { RefCell::new(None) };
}

fn with_fixture<T>(f: impl FnOnce(&mut Fixture) -> T) -> T {
    FIX.with(|cell| {
        let mut slot = cell.borrow_mut();
        let fix = slot.get_or_insert_with(|| {
            let server = RedisServer::start().unwrap();
            let mut conn = common::sync_conn(&server);
            let bucket_sha = common::load(&mut conn, TOKEN_BUCKET_LUA);
            let window_sha = common::load(&mut conn, SLIDING_WINDOW_LUA);
            Fixture {
                conn,
                bucket_sha,
                window_sha,
                next: 0,
                _server: server,
            }
        });
        f(fix)
    })
}

/// Valid bucket parameters, biased towards the extremes.
fn bucket_params() -> impl Strategy<Value = BucketParams> {
    let cap = prop_oneof![
        3 => (0u64..=50).prop_map(|t| t * UT),
        3 => 0u64..=1_000_000_000,
        2 => (0u64..1_000_000).prop_map(|d| MAX_CAPACITY_UT - d),
        1 => Just(MAX_CAPACITY_UT),
        1 => any::<u64>().prop_map(|v| v % (MAX_CAPACITY_UT + 1)),
    ];
    let rate = prop_oneof![
        2 => Just(0u64),
        3 => 1u64..=10,
        3 => 1u64..=100_000_000,
        2 => (0u64..1000).prop_map(|d| MAX_RATE_UT_PER_S - d),
        1 => any::<u64>().prop_map(|v| v % (MAX_RATE_UT_PER_S + 1)),
    ];
    (cap, rate).prop_map(|(cap, rate)| {
        // Nudge the rate up (as for_share does) where the fill time would be out of bounds.
        let rate = if rate > 0 && cap / rate >= MAX_FILL_RATIO {
            cap / MAX_FILL_RATIO + 1
        } else {
            rate
        };
        BucketParams::new(cap, rate).unwrap()
    })
}

fn window_params() -> impl Strategy<Value = WindowParams> {
    let limit = prop_oneof![4 => 0u64..=10, 3 => 0u64..=200, 2 => 100u64..=100_000, 1 => Just(MAX_WINDOW_LIMIT)];
    let w = prop_oneof![4 => 1u64..=100, 3 => 1u64..=100_000, 1 => Just(MAX_WINDOW_MS)];
    (limit, w).prop_map(|(limit, w)| {
        let w = if limit * w > MAX_WINDOW_PRODUCT {
            MAX_WINDOW_PRODUCT / limit.max(1)
        } else {
            w
        };
        WindowParams::new(limit, w.max(1)).unwrap()
    })
}

/// Time steps: mostly small, some backwards, some idle gaps of days or years.
fn dt() -> impl Strategy<Value = i64> {
    prop_oneof![
        6 => 0i64..=50,
        3 => 0i64..=5_000,
        2 => -5_000i64..=0,
        1 => 0i64..=400_000_000_000,
        1 => Just(0i64),
    ]
}

#[derive(Debug, Clone)]
enum Step<P> {
    Check {
        dt: i64,
        cost: u64,
    },
    /// New parameters: written to the params hash (`stored`) or passed as the fallback.
    Params {
        p: P,
        stored: bool,
    },
}

fn steps<P: std::fmt::Debug + Clone + 'static>(
    p: impl Strategy<Value = P> + 'static,
    cost: impl Strategy<Value = u64> + 'static,
) -> impl Strategy<Value = Vec<Step<P>>> {
    let check = (dt(), cost).prop_map(|(dt, cost)| Step::Check { dt, cost });
    let params = (p, any::<bool>()).prop_map(|(p, stored)| Step::Params { p, stored });
    proptest::collection::vec(prop_oneof![9 => check, 1 => params], 1..100)
}

/// Costs, with 0 (a peek) among them.
fn bucket_cost() -> impl Strategy<Value = u64> {
    prop_oneof![6 => 1u64..=5, 2 => 1u64..=60, 1 => 1u64..=MAX_COST, 1 => Just(MAX_COST), 1 => Just(0)]
}

fn window_cost() -> impl Strategy<Value = u64> {
    prop_oneof![6 => 1u64..=3, 2 => 1u64..=300, 1 => 1u64..=MAX_COST, 1 => Just(0)]
}

fn decision(reply: &[i64]) -> Decision {
    quota_store::script::decision_from_reply(reply).unwrap()
}

fn field(v: &Option<String>) -> u64 {
    v.as_deref().map_or(0, |s| s.parse().unwrap())
}

/// The first three fields (t, c, ts) of the packed token-bucket state: little-endian doubles,
/// exact integers (see lua/token_bucket.lua).
fn packed_state(raw: &[u8]) -> BucketState {
    assert_eq!(raw.len(), 88, "packed state of {} bytes", raw.len());
    let f = |i: usize| {
        let v = f64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().unwrap());
        assert!(
            v >= 0.0 && v.fract() == 0.0 && v < 9_007_199_254_740_992.0,
            "{v}"
        );
        v as u64
    };
    BucketState {
        tokens_ut: f(0),
        carry: f(1),
        ts_ms: f(2),
    }
}

fn run_bucket(
    start: u64,
    p0: BucketParams,
    steps: &[Step<BucketParams>],
) -> Result<(), TestCaseError> {
    with_fixture(|f| {
        f.next += 1;
        let (b, pk, ix) = (
            format!("qd:v1:{{d{}}}:x:1:b", f.next),
            format!("qd:v1:{{d{}}}:x:1:p", f.next),
            "qd:v1:active",
        );
        let (mut fallback, mut stored) = (p0, None::<BucketParams>);
        let mut now = start;
        let mut state: Option<BucketState> = None;
        for (i, step) in steps.iter().enumerate() {
            match *step {
                Step::Params { p, stored: true } => {
                    // Through set_params.lua, which also rewrites the copy in the state.
                    redis::cmd("EVAL")
                        .arg(SET_PARAMS_LUA)
                        .arg(2)
                        .arg(&pk)
                        .arg(&b)
                        .arg("cap")
                        .arg(p.capacity_ut)
                        .arg("rate")
                        .arg(p.rate_ut_per_s)
                        .query::<()>(&mut f.conn)
                        .unwrap();
                    stored = Some(p);
                }
                Step::Params { p, stored: false } => fallback = p,
                Step::Check { dt, cost } => {
                    CHECKS.set(CHECKS.get() + 1);
                    now = now.saturating_add_signed(dt).min(MAX_CAPACITY_UT);
                    let p = stored.unwrap_or(fallback);
                    let (want, next) = bucket::decide(now, &p, state.as_ref(), cost);
                    let reply: Vec<i64> = redis::cmd("EVALSHA")
                        .arg(&f.bucket_sha)
                        .arg(3)
                        .arg(&b)
                        .arg(&pk)
                        .arg(ix)
                        .arg(cost)
                        .arg(fallback.capacity_ut)
                        .arg(fallback.rate_ut_per_s)
                        .arg(now)
                        .query(&mut f.conn)
                        .map_err(|e| TestCaseError::fail(format!("step {i}: {e}")))?;
                    prop_assert_eq!(
                        decision(&reply),
                        want,
                        "decision at step {} (now {}, params {:?})",
                        i,
                        now,
                        p
                    );
                    let raw: Option<Vec<u8>> =
                        redis::cmd("GET").arg(&b).query(&mut f.conn).unwrap();
                    let got = raw.as_deref().map(packed_state);
                    if cost > 0 {
                        state = Some(next);
                    }
                    // A peek leaves the state as it was (none at all on a new bucket).
                    prop_assert_eq!(got, state, "state at step {}", i);
                }
            }
        }
        Ok(())
    })
}

fn parse_log(s: &str) -> Vec<(u64, u64)> {
    s.split(',')
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (t, c) = e.split_once(':').unwrap();
            (t.parse().unwrap(), c.parse().unwrap())
        })
        .collect()
}

fn run_window(
    start: u64,
    p0: WindowParams,
    steps: &[Step<WindowParams>],
) -> Result<(), TestCaseError> {
    with_fixture(|f| {
        f.next += 1;
        let (k, pk, ix) = (
            format!("qd:v1:{{w{}}}:x:1:w", f.next),
            format!("qd:v1:{{w{}}}:x:1:p", f.next),
            "qd:v1:active",
        );
        let (mut fallback, mut stored) = (p0, None::<WindowParams>);
        let mut now = start;
        let mut state: Option<WindowState> = None;
        for (i, step) in steps.iter().enumerate() {
            match *step {
                Step::Params { p, stored: true } => {
                    redis::cmd("HSET")
                        .arg(&pk)
                        .arg("limit")
                        .arg(p.limit)
                        .arg("window")
                        .arg(p.window_ms)
                        .query::<()>(&mut f.conn)
                        .unwrap();
                    stored = Some(p);
                }
                Step::Params { p, stored: false } => fallback = p,
                Step::Check { dt, cost } => {
                    CHECKS.set(CHECKS.get() + 1);
                    now = now
                        .saturating_add_signed(dt)
                        .min(MAX_CAPACITY_UT - 2 * MAX_WINDOW_MS);
                    let p = stored.unwrap_or(fallback);
                    let (want, next) = window::decide(now, &p, state.as_ref(), cost);
                    let reply: Vec<i64> = redis::cmd("EVALSHA")
                        .arg(&f.window_sha)
                        .arg(3)
                        .arg(&k)
                        .arg(&pk)
                        .arg(ix)
                        .arg(cost)
                        .arg(fallback.limit)
                        .arg(fallback.window_ms)
                        .arg(now)
                        .query(&mut f.conn)
                        .map_err(|e| TestCaseError::fail(format!("step {i}: {e}")))?;
                    prop_assert_eq!(
                        decision(&reply),
                        want,
                        "decision at step {} (now {}, params {:?})",
                        i,
                        now,
                        p
                    );
                    let got: Vec<Option<String>> = redis::cmd("HMGET")
                        .arg(&k)
                        .arg(&["l", "ws", "cu", "pv", "ts"][..])
                        .query(&mut f.conn)
                        .unwrap();
                    let got = WindowState {
                        log: parse_log(got[0].as_deref().unwrap_or("")),
                        win_start_ms: field(&got[1]),
                        cur: field(&got[2]),
                        prev: field(&got[3]),
                        ts_ms: field(&got[4]),
                    };
                    if cost > 0 {
                        state = Some(next);
                    }
                    // A peek leaves the state as it was (an empty one on a new window).
                    prop_assert_eq!(
                        &got,
                        &state.clone().unwrap_or_default(),
                        "state at step {}",
                        i
                    );
                }
            }
        }
        Ok(())
    })
}

thread_local! {
    /// Checks performed by the proptest runs on this test's thread.
    static CHECKS: Cell<u64> = const { Cell::new(0) };
}

fn config() -> ProptestConfig {
    // 250 cases of ~45 checks ≈ 11 000 checks per algorithm. `PROPTEST_CASES` scales it;
    // `PROPTEST_RNG_SEED` changes the (otherwise fixed) seed.
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(250);
    let seed = std::env::var("PROPTEST_RNG_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5EED);
    ProptestConfig {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        source_file: Some(file!()),
        ..ProptestConfig::default()
    }
}

fn start_ms() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..=10_000,
        1_600_000_000_000u64..=1_900_000_000_000,
        (MAX_CAPACITY_UT - 1_000_000)..=MAX_CAPACITY_UT,
    ]
}

fn report(name: &str, before: u64, cfg: &ProptestConfig) {
    let checks = CHECKS.get() - before;
    println!(
        "{name}: {checks} checks over {} cases, seed {:?}",
        cfg.cases, cfg.rng_seed
    );
    if cfg.cases >= 250 {
        assert!(checks >= 10_000, "only {checks} checks");
    }
}

#[test]
fn token_bucket_lua_matches_the_reference() {
    let cfg = config();
    let before = CHECKS.get();
    let mut runner = TestRunner::new(cfg.clone());
    let strategy = (
        start_ms(),
        bucket_params(),
        steps(bucket_params(), bucket_cost()),
    );
    let result = runner.run(&strategy, |(start, p0, steps)| {
        run_bucket(start, p0, &steps)
    });
    if let Err(e) = result {
        panic!(
            "{e}\nreproduce: PROPTEST_RNG_SEED={:?} cargo test -p quota-store --test differential",
            cfg.rng_seed
        );
    }
    report("token bucket", before, &cfg);
}

#[test]
fn sliding_window_lua_matches_the_reference() {
    let cfg = config();
    let before = CHECKS.get();
    let mut runner = TestRunner::new(cfg.clone());
    let strategy = (
        start_ms(),
        window_params(),
        steps(window_params(), window_cost()),
    );
    let result = runner.run(&strategy, |(start, p0, steps)| {
        run_window(start, p0, &steps)
    });
    if let Err(e) = result {
        panic!(
            "{e}\nreproduce: PROPTEST_RNG_SEED={:?} cargo test -p quota-store --test differential",
            cfg.rng_seed
        );
    }
    report("sliding window", before, &cfg);
}

/// Pinned extremes, so they run on every build whatever proptest draws.
#[test]
fn extremes_match_the_reference() {
    let huge = BucketParams::new(MAX_CAPACITY_UT, MAX_RATE_UT_PER_S).unwrap();
    let slow = BucketParams::new(MAX_CAPACITY_UT, MAX_CAPACITY_UT / MAX_FILL_RATIO + 1).unwrap();
    let tiny = BucketParams::new(UT, 1).unwrap();
    for p in [huge, slow, tiny] {
        let steps: Vec<Step<BucketParams>> = [
            (0, MAX_COST),
            (0, 1),
            (1, 1),
            (999, 3),
            (1001, MAX_COST),
            (-10_000, 1),
            (86_400_000, 1),
            (400_000_000_000, 2),
            (1, MAX_COST),
        ]
        .into_iter()
        .map(|(dt, cost)| Step::Check { dt, cost })
        .collect();
        run_bucket(1_700_000_000_000, p, &steps).unwrap();
    }
    let w = WindowParams::new(MAX_WINDOW_PRODUCT / MAX_WINDOW_MS, MAX_WINDOW_MS).unwrap();
    let steps: Vec<Step<WindowParams>> = [
        (0, 1),
        (0, w.limit),
        (MAX_WINDOW_MS as i64 - 1, 5),
        (1, 5),
        (MAX_WINDOW_MS as i64, 1),
    ]
    .into_iter()
    .map(|(dt, cost)| Step::Check { dt, cost })
    .collect();
    run_window(1_700_000_000_000, w, &steps).unwrap();
    // 31-day windows in both modes: the exact log at its largest limit, and the approximation
    // just above it, across two window boundaries.
    for limit in [EXACT_LOG_MAX, EXACT_LOG_MAX + 1] {
        let w = WindowParams::new(limit, MAX_WINDOW_MS).unwrap();
        let day = 86_400_000;
        let steps: Vec<Step<WindowParams>> = [
            (0, limit - 1),
            (day, 1),
            (day, 1),
            (MAX_WINDOW_MS as i64 - 2 * day, 1),
            (day - 1, limit),
            (1, 2),
            (MAX_WINDOW_MS as i64, 3),
            (-day, 1),
            (2 * MAX_WINDOW_MS as i64, limit),
        ]
        .into_iter()
        .map(|(dt, cost)| Step::Check { dt, cost })
        .collect();
        run_window(1_700_000_000_000, w, &steps).unwrap();
    }
}

/// One step of the store-level comparison.
#[derive(Debug, Clone)]
enum StoreStep {
    Check {
        dt: i64,
        cost: u64,
    },
    /// New stored parameters, optionally with a lease of `lease.0` ms and floor `lease.1`.
    Set {
        limit: Limit,
        lease: Option<(u64, Limit)>,
    },
    Collect,
}

fn small_bucket() -> impl Strategy<Value = Limit> + Clone {
    (0u64..=40, 0u64..=20)
        .prop_map(|(c, r)| Limit::TokenBucket(BucketParams::new(c * UT, r * UT / 4).unwrap()))
}

fn small_window() -> impl Strategy<Value = Limit> + Clone {
    // Limits either side of the exact-log threshold (128).
    (prop_oneof![1u64..=20, 120u64..=200], 1u64..=3_000)
        .prop_map(|(limit, window_ms)| Limit::SlidingWindow { limit, window_ms })
}

fn store_steps(
    limit: impl Strategy<Value = Limit> + Clone + 'static,
) -> impl Strategy<Value = Vec<StoreStep>> {
    // Steps and leases on a 50 ms grid too, so checks land exactly on lease ends.
    let dt = prop_oneof![
        5 => 0i64..=400,
        4 => (0i64..=8).prop_map(|k| k * 50),
        1 => 0i64..=10_000,
        1 => -500i64..=0,
    ];
    let cost = prop_oneof![6 => 1u64..=4, 1 => Just(0u64), 1 => 1u64..=60];
    let check = (dt, cost).prop_map(|(dt, cost)| StoreStep::Check { dt, cost });
    let ms = prop_oneof![0u64..=5_000, (0u64..=40).prop_map(|k| k * 50)];
    let lease = proptest::option::of((ms, limit.clone()));
    let set = (limit, lease).prop_map(|(limit, lease)| StoreStep::Set { limit, lease });
    proptest::collection::vec(
        prop_oneof![12 => check, 2 => set, 1 => Just(StoreStep::Collect)],
        1..120,
    )
}

/// The embedded store (the no-Redis default) against the Redis store, through the `Store`
/// trait with explicit time: every decision, peek and usage report equal, with parameters
/// written with and without lease ends (the floor takes over at the end by itself).
fn run_stores(
    rt: &tokio::runtime::Runtime,
    redis: &RedisStore,
    p0: Limit,
    start: u64,
    steps: &[StoreStep],
) -> Result<(), TestCaseError> {
    rt.block_on(async {
        let embedded = EmbeddedStore::new();
        let b = common::fresh_bucket("emb");
        let mut now = start;
        for (i, step) in steps.iter().enumerate() {
            match step {
                StoreStep::Check { dt, cost } => {
                    CHECKS.set(CHECKS.get() + 1);
                    now = now.saturating_add_signed(*dt);
                    let r = common::req(&b, p0, *cost, Some(now));
                    let want = embedded.check(&r).await.unwrap();
                    let got = redis
                        .check(&r)
                        .await
                        .map_err(|e| TestCaseError::fail(format!("step {i}: {e}")))?;
                    prop_assert_eq!(got, want, "step {} at {}", i, now);
                }
                StoreStep::Set { limit, lease } => {
                    let mut p = SetParams::new(b.clone(), *limit).at(now);
                    if let Some((ms, floor)) = lease {
                        p = p.with_lease(*ms, *floor);
                    }
                    embedded.set_params(&p).await.unwrap();
                    redis.set_params(&p).await.unwrap();
                }
                StoreStep::Collect => {
                    // The Redis index is shared by every case: keep this case's bucket only.
                    let mine = |v: Vec<UsageRecord>| -> Vec<UsageRecord> {
                        v.into_iter().filter(|u| u.bucket == b).collect()
                    };
                    let want = mine(embedded.collect_usage(usize::MAX).await.unwrap());
                    let got = mine(redis.collect_usage(usize::MAX).await.unwrap());
                    prop_assert_eq!(got, want, "usage at step {}", i);
                }
            }
        }
        Ok(())
    })
}

fn stores_agree(limit: impl Strategy<Value = Limit> + Clone + 'static, name: &str) {
    let cfg = config();
    let before = CHECKS.get();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let server = RedisServer::start().unwrap();
    let redis = rt.block_on(common::store(&server));
    let mut runner = TestRunner::new(cfg.clone());
    let strategy = (
        limit.clone(),
        1_600_000_000_000u64..=1_900_000_000_000,
        store_steps(limit),
    );
    let result = runner.run(&strategy, |(p0, start, steps)| {
        run_stores(&rt, &redis, p0, start, &steps)
    });
    if let Err(e) = result {
        panic!(
            "{e}\nreproduce: PROPTEST_RNG_SEED={:?} cargo test -p quota-store --test differential",
            cfg.rng_seed
        );
    }
    report(name, before, &cfg);
}

#[test]
fn embedded_and_redis_stores_agree_on_buckets_with_leases() {
    stores_agree(small_bucket(), "stores, token bucket");
}

#[test]
fn embedded_and_redis_stores_agree_on_windows_with_leases() {
    stores_agree(small_window(), "stores, sliding window");
}
