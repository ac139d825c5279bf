//! Differential tests: the Lua scripts on a real redis-server (explicit now) against the
//! quota-core references, step by step, comparing every decision and the stored state.
//! Buckets are also charged into debt (`charge.lua`, `quota_core::bucket::charge`, with debt
//! limits up to the bound and past it) and refunded (`refund.lua`), so checks meet debts,
//! clipped debts and waits beyond `MAX_WAIT_MS`.
//!
//! 250 cases × up to 100 steps per algorithm (≥ 10 000 checks each, asserted), including extremes: capacity
//! near MAX_CAPACITY_UT, tiny and huge rates, long idle gaps, time moving backwards, parameter
//! changes through set_params.lua (buckets; it also rewrites the copy inside the packed state) or
//! the stored-parameters hash (windows). `PROPTEST_CASES` scales it up.
//!
//! Then the embedded store against the Redis store through the `Store` trait: decisions, peeks
//! (cost 0), reservations and refunds (`token_bucket.lua`'s batch, `refund.lua`, the embedded
//! store on `quota_core::bucket::reserve` and `refund`), charges into debt and replays of
//! charge ids (`charge.lua`, `bucket::charge`) and usage, with parameters written with
//! and without lease ends (and latest lease ends, `not_after`); and checks of
//! several limits at once (`token_buckets.lua`, the embedded store and
//! `quota_core::bucket::decide_all`), every limit's decision and stored state equal.

mod common;

use std::cell::{Cell, RefCell};

use proptest::prelude::*;
use proptest::test_runner::{RngSeed, TestRunner};
use quota_core::bucket::{
    self, DEFAULT_PERIOD_MS, MAX_CAPACITY_UT, MAX_FILL_BOUND_MS, MAX_PERIOD_MS, MAX_REFILL_UT,
    MAX_WAIT_MS, UT,
};
use quota_core::window::{
    self, HeldRaise, EXACT_LOG_MAX, MAX_WINDOW_LIMIT, MAX_WINDOW_MS, MAX_WINDOW_PRODUCT,
};
use quota_core::{BucketParams, BucketState, Decision, WindowParams, WindowState};
use quota_store::script::{
    CHARGE_LUA, REFUND_LUA, SET_PARAMS_LUA, SLIDING_WINDOW_LUA, TOKEN_BUCKET_LUA,
};
use quota_store::{
    ChargeRequest, EmbeddedStore, Limit, RedisStore, SetParams, Store, UsageRecord, MAX_COST,
};
use redis_harness::RedisServer;

struct Fixture {
    // Field order: the connection closes before the server stops.
    conn: redis::Connection,
    bucket_sha: String,
    window_sha: String,
    charge_sha: String,
    refund_sha: String,
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
            let charge_sha = common::load(&mut conn, CHARGE_LUA);
            let refund_sha = common::load(&mut conn, REFUND_LUA);
            Fixture {
                conn,
                bucket_sha,
                window_sha,
                charge_sha,
                refund_sha,
                next: 0,
                _server: server,
            }
        });
        f(fix)
    })
}

/// Valid bucket parameters, biased towards the extremes: refills per second (the 88-byte
/// layout's period), per ms, per day, per 31 days and odd periods.
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
        2 => (0u64..1000).prop_map(|d| MAX_REFILL_UT - d),
        1 => any::<u64>().prop_map(|v| v % (MAX_REFILL_UT + 1)),
    ];
    let period = prop_oneof![
        3 => Just(DEFAULT_PERIOD_MS),
        2 => 1u64..=100,
        2 => 1u64..=MAX_PERIOD_MS,
        1 => Just(86_400_000u64),
        1 => (0u64..1000).prop_map(|d| MAX_PERIOD_MS - d),
    ];
    (cap, rate, period).prop_map(|(cap, rate, per)| nudged(cap, rate, per))
}

/// `cap` refilling `rate` per `per` ms, the rate raised where the fill time would be out of
/// bounds.
fn nudged(cap: u64, rate: u64, per: u64) -> BucketParams {
    // floor(cap / rate) ≤ k keeps floor(cap / rate) · per below the bound.
    let k = (MAX_FILL_BOUND_MS - 1) / per;
    let rate = if rate > 0 && cap / rate > k {
        cap / (k + 1) + 1
    } else {
        rate
    };
    BucketParams::per_period(cap, rate, per).unwrap()
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
    /// The state is gone (idle past its lifetime): windows only.
    Forget,
    /// A charge into debt (buckets only).
    Charge {
        dt: i64,
        cost: u64,
        limit: DebtLimit,
    },
    /// Tokens given back (buckets only).
    Refund {
        dt: i64,
        tokens: u64,
    },
}

/// A charge's debt limit, some resolved against the parameters in force.
#[derive(Debug, Clone, Copy)]
enum DebtLimit {
    Ut(u64),
    /// The largest the capacity in force takes: `MAX_CAPACITY_UT − capacity`.
    Most,
    /// One more: refused.
    TooMuch,
}

impl DebtLimit {
    fn resolve(self, p: &BucketParams) -> u64 {
        match self {
            Self::Ut(v) => v,
            Self::Most => MAX_CAPACITY_UT - p.capacity_ut,
            Self::TooMuch => MAX_CAPACITY_UT - p.capacity_ut + 1,
        }
    }
}

fn debt_limit() -> impl Strategy<Value = DebtLimit> {
    prop_oneof![
        3 => (0u64..=50).prop_map(|t| DebtLimit::Ut(t * UT)),
        2 => (0u64..=1_000_000_000).prop_map(DebtLimit::Ut),
        2 => Just(DebtLimit::Most),
        1 => Just(DebtLimit::TooMuch),
        1 => any::<u64>().prop_map(|v| DebtLimit::Ut(v % (MAX_CAPACITY_UT + 1))),
    ]
}

fn steps<P: std::fmt::Debug + Clone + 'static>(
    p: impl Strategy<Value = P> + 'static,
    cost: impl Strategy<Value = u64> + 'static,
) -> impl Strategy<Value = Vec<Step<P>>> {
    let check = (dt(), cost).prop_map(|(dt, cost)| Step::Check { dt, cost });
    let params = (p, any::<bool>()).prop_map(|(p, stored)| Step::Params { p, stored });
    let charge_cost = prop_oneof![
        6 => 1u64..=5,
        3 => 1u64..=60,
        1 => 1u64..=MAX_COST,
        1 => Just(MAX_COST),
        1 => Just(0),
    ];
    let charge = (dt(), charge_cost, debt_limit()).prop_map(|(dt, cost, limit)| Step::Charge {
        dt,
        cost,
        limit,
    });
    let refund = (dt(), prop_oneof![1u64..=10, 1u64..=MAX_COST])
        .prop_map(|(dt, tokens)| Step::Refund { dt, tokens });
    proptest::collection::vec(
        prop_oneof![9 => check, 1 => params, 3 => charge, 1 => refund],
        1..100,
    )
}

/// [`steps`] with a window's state forgotten now and then, so raises meet windows with and
/// without a state.
fn window_steps() -> impl Strategy<Value = Vec<Step<WindowParams>>> {
    let check = (dt(), window_cost()).prop_map(|(dt, cost)| Step::Check { dt, cost });
    let params =
        (window_params(), any::<bool>()).prop_map(|(p, stored)| Step::Params { p, stored });
    let raise = (1u64..=20).prop_map(|limit| Step::Params {
        p: WindowParams::new(limit, 1_000).unwrap(),
        stored: true,
    });
    proptest::collection::vec(
        prop_oneof![18 => check, 2 => params, 1 => raise, 1 => Just(Step::Forget)],
        1..100,
    )
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

/// The fields t, c, ts and per of the packed token-bucket state: little-endian doubles, exact
/// integers (see lua/token_bucket.lua); t is the level, negative in debt.
fn packed_state(raw: &[u8]) -> BucketState {
    assert_eq!(raw.len(), 96, "packed state of {} bytes", raw.len());
    let g = |i: usize| {
        let v = f64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().unwrap());
        assert!(v.fract() == 0.0 && v.abs() < 9_007_199_254_740_992.0, "{v}");
        v as i64
    };
    let f = |i: usize| u64::try_from(g(i)).expect("a nonnegative field");
    let level = g(0);
    BucketState {
        tokens_ut: level.max(0) as u64,
        debt_ut: level.min(0).unsigned_abs(),
        carry: f(1),
        ts_ms: f(2),
        period_ms: f(11),
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
        // The parameters the state's copy holds (refund.lua reads them): the stored ones,
        // else the fallback of the latest write.
        let mut written = p0;
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
                        .arg(p.refill_ut)
                        .arg(&["", "", "", "", ""][..])
                        .arg(p.period_ms)
                        .query::<()>(&mut f.conn)
                        .unwrap();
                    stored = Some(p);
                    // set_params.lua counts the state's carry in the new period at once.
                    state = state.map(|s| s.in_period(p.period_ms));
                }
                Step::Params { p, stored: false } => fallback = p,
                Step::Forget => unreachable!("windows only"),
                Step::Charge { dt, cost, limit } => {
                    CHECKS.set(CHECKS.get() + 1);
                    now = now.saturating_add_signed(dt).min(MAX_CAPACITY_UT);
                    let p = stored.unwrap_or(fallback);
                    let limit = limit.resolve(&p);
                    let want = bucket::charge(now, &p, state.as_ref(), cost, limit);
                    let reply: redis::RedisResult<Vec<i64>> = redis::cmd("EVALSHA")
                        .arg(&f.charge_sha)
                        .arg(3)
                        .arg(&b)
                        .arg(&pk)
                        .arg(ix)
                        .arg(cost)
                        .arg(limit)
                        .arg(fallback.capacity_ut)
                        .arg(fallback.refill_ut)
                        .arg(now)
                        .arg("")
                        .arg(fallback.period_ms)
                        .query(&mut f.conn);
                    match (want, reply) {
                        (Ok((want, next)), Ok(reply)) => {
                            let got = quota_store::script::charge_from_reply(&reply, cost)
                                .map_err(|e| TestCaseError::fail(format!("step {i}: {e}")))?;
                            prop_assert_eq!(
                                got,
                                want,
                                "charge at step {} (now {}, {:?})",
                                i,
                                now,
                                p
                            );
                            if next.debt_ut > 0 {
                                DEBTS.set(DEBTS.get() + 1);
                            }
                            state = Some(next);
                            written = p;
                        }
                        (Err(_), Err(e)) => {
                            prop_assert!(e.to_string().contains("quotad:"), "step {}: {}", i, e)
                        }
                        (want, reply) => prop_assert!(
                            false,
                            "charge at step {}: reference {:?}, Lua {:?}",
                            i,
                            want,
                            reply
                        ),
                    }
                    let raw: Option<Vec<u8>> =
                        redis::cmd("GET").arg(&b).query(&mut f.conn).unwrap();
                    prop_assert_eq!(
                        raw.as_deref().map(packed_state),
                        state,
                        "state at step {}",
                        i
                    );
                }
                Step::Refund { dt, tokens } => {
                    now = now.saturating_add_signed(dt).min(MAX_CAPACITY_UT);
                    let p = stored.unwrap_or(written);
                    let next = bucket::refund(now, &p, state.as_ref(), tokens);
                    let left: i64 = redis::cmd("EVALSHA")
                        .arg(&f.refund_sha)
                        .arg(1)
                        .arg(&b)
                        .arg(tokens)
                        .arg(now)
                        .query(&mut f.conn)
                        .map_err(|e| TestCaseError::fail(format!("step {i}: {e}")))?;
                    let want = next.map_or(-1, |s| (s.tokens_ut / UT) as i64);
                    prop_assert_eq!(left, want, "refund at step {}", i);
                    if next.is_some() {
                        state = next;
                    }
                    let raw: Option<Vec<u8>> =
                        redis::cmd("GET").arg(&b).query(&mut f.conn).unwrap();
                    prop_assert_eq!(
                        raw.as_deref().map(packed_state),
                        state,
                        "state at step {}",
                        i
                    );
                }
                Step::Check { dt, cost } => {
                    CHECKS.set(CHECKS.get() + 1);
                    now = now.saturating_add_signed(dt).min(MAX_CAPACITY_UT);
                    let p = stored.unwrap_or(fallback);
                    let (want, next) = bucket::decide(now, &p, state.as_ref(), cost);
                    if state.is_some_and(|s| s.debt_ut > 0) {
                        IN_DEBT.set(IN_DEBT.get() + 1);
                    }
                    let reply: Vec<i64> = redis::cmd("EVALSHA")
                        .arg(&f.bucket_sha)
                        .arg(3)
                        .arg(&b)
                        .arg(&pk)
                        .arg(ix)
                        .arg(cost)
                        .arg(fallback.capacity_ut)
                        .arg(fallback.refill_ut)
                        .arg(now)
                        .arg("")
                        .arg(fallback.period_ms)
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
                        written = p;
                    }
                    // A peek leaves the state as it was (none at all on a new bucket).
                    prop_assert_eq!(got, state, "state at step {}", i);
                }
            }
        }
        Ok(())
    })
}

/// The window state stored at `k`, every field of either representation (a missing field is
/// 0); `u`, the log's sum, checked against the log.
fn window_state(conn: &mut redis::Connection, k: &str) -> Result<WindowState, String> {
    let got: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(k)
        .arg(&["l", "u", "h", "ws", "cu", "pv", "ts"][..])
        .query(conn)
        .unwrap();
    let counts: Option<Vec<u8>> = redis::cmd("HGET").arg(k).arg("c").query(conn).unwrap();
    let log = parse_log(got[0].as_deref().unwrap_or(""));
    let sum: u64 = log.iter().map(|&(_, c)| c).sum();
    if got[0].is_some() && field(&got[1]) != sum {
        return Err(format!("u {:?} is not the log's sum {sum}", got[1]));
    }
    // c: window, newest sub-window, sum, latest admission's sub-window, then the counts.
    let c: Vec<u64> = counts
        .unwrap_or_default()
        .chunks(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as u64)
        .collect();
    let (head, counts) = c.split_at(c.len().min(4));
    let at = |i: usize| head.get(i).copied().unwrap_or(0);
    // h: the held limit, or held:raise:at.
    let h: Vec<u64> = got[2]
        .as_deref()
        .map(|h| h.split(':').map(|v| v.parse().unwrap()).collect())
        .unwrap_or_default();
    Ok(WindowState {
        log,
        counts: counts.to_vec(),
        counts_window_ms: at(0),
        sub: at(1),
        sum: at(2),
        last_sub: at(3),
        win_start_ms: field(&got[3]),
        cur: field(&got[4]),
        prev: field(&got[5]),
        held_limit: h.first().copied(),
        raise_to: h.get(1).copied().unwrap_or(0),
        raise_at_ms: h.get(2).copied().unwrap_or(0),
        ts_ms: field(&got[6]),
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
        let mut held: Option<HeldRaise> = None;
        let mut now = start;
        let mut state: Option<WindowState> = None;
        for (i, step) in steps.iter().enumerate() {
            match *step {
                Step::Params { p, stored: true } => {
                    // Through set_params.lua at the time of the next check, which holds a raise
                    // with the parameters.
                    redis::cmd("EVAL")
                        .arg(SET_PARAMS_LUA)
                        .arg(2)
                        .arg(&pk)
                        .arg(format!("{pk}:b"))
                        .arg("limit")
                        .arg(p.limit)
                        .arg("window")
                        .arg(p.window_ms)
                        .arg(&["", "", "", ""][..])
                        .arg(now)
                        .query::<()>(&mut f.conn)
                        .map_err(|e| TestCaseError::fail(format!("step {i}: {e}")))?;
                    held = window::held_raise(
                        now,
                        stored.map(|s| (s.limit, held)),
                        p.limit,
                        p.window_ms,
                    );
                    stored = Some(p);
                    let got: Vec<Option<u64>> = redis::cmd("HMGET")
                        .arg(&pk)
                        .arg(&["hlimit", "huntil"][..])
                        .query(&mut f.conn)
                        .unwrap();
                    let got = got[0]
                        .zip(got[1])
                        .map(|(limit, until_ms)| HeldRaise { limit, until_ms });
                    prop_assert_eq!(got, held, "held raise at step {}", i);
                }
                Step::Params { p, stored: false } => fallback = p,
                Step::Charge { .. } | Step::Refund { .. } => unreachable!("buckets only"),
                Step::Forget => {
                    redis::cmd("DEL").arg(&k).query::<()>(&mut f.conn).unwrap();
                    state = None;
                }
                Step::Check { dt, cost } => {
                    CHECKS.set(CHECKS.get() + 1);
                    now = now
                        .saturating_add_signed(dt)
                        .min(MAX_CAPACITY_UT - 2 * MAX_WINDOW_MS);
                    let p = stored.unwrap_or(fallback);
                    let held = held.filter(|_| stored.is_some());
                    if held.is_some_and(|h| now < h.until_ms && h.limit < p.limit) {
                        let (none, some) = HELD_CHECKS.get();
                        HELD_CHECKS.set(match state {
                            None => (none + 1, some),
                            Some(_) => (none, some + 1),
                        });
                    }
                    let (want, next) =
                        window::decide_held(now, &p, held.as_ref(), state.as_ref(), cost);
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
                    let got = window_state(&mut f.conn, &k)
                        .map_err(|e| TestCaseError::fail(format!("step {i}: {e}")))?;
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
    /// Reservations among them.
    static RESERVATIONS: Cell<u64> = const { Cell::new(0) };
    /// Lease writes whose latest end came before the lease's own end (the earlier one holds).
    static CUT_LEASES: Cell<u64> = const { Cell::new(0) };
    /// Window checks under a raise the parameters hold: (without a state, with one).
    static HELD_CHECKS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    /// Charges that left a bucket in debt, and checks of a bucket in debt.
    static DEBTS: Cell<u64> = const { Cell::new(0) };
    static IN_DEBT: Cell<u64> = const { Cell::new(0) };
    /// Charge ids replayed, and charges both stores refused.
    static REPLAYS: Cell<u64> = const { Cell::new(0) };
    static REFUSED_CHARGES: Cell<u64> = const { Cell::new(0) };
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
    let (debts, in_debt) = (DEBTS.get(), IN_DEBT.get());
    println!("{debts} charges into debt, {in_debt} checks in debt");
    if cfg.cases >= 250 {
        assert!(
            debts >= 500 && in_debt >= 500,
            "{debts} debts, {in_debt} in debt"
        );
    }
}

#[test]
fn sliding_window_lua_matches_the_reference() {
    let cfg = config();
    let before = CHECKS.get();
    let mut runner = TestRunner::new(cfg.clone());
    let strategy = (start_ms(), window_params(), window_steps());
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
    let (none, some) = HELD_CHECKS.get();
    println!("held raises: {none} checks without a state, {some} with one");
    if cfg.cases >= 250 {
        assert!(
            none >= 50 && some >= 50,
            "held raises: {none} without, {some} with a state"
        );
    }
}

/// Pinned extremes, so they run on every build whatever proptest draws.
#[test]
fn extremes_match_the_reference() {
    let huge = BucketParams::per_period(MAX_CAPACITY_UT, MAX_REFILL_UT, 1).unwrap();
    let huge_month =
        BucketParams::per_period(MAX_CAPACITY_UT, MAX_REFILL_UT, MAX_PERIOD_MS).unwrap();
    let slow = nudged(MAX_CAPACITY_UT, 1, DEFAULT_PERIOD_MS);
    let slow_month = nudged(MAX_CAPACITY_UT, 1, MAX_PERIOD_MS);
    let tiny = BucketParams::new(UT, 1).unwrap();
    let tiny_month = nudged(UT, 1, MAX_PERIOD_MS);
    // A prime period and a refill just below it: every carry of the split products.
    let odd = BucketParams::per_period(5 * UT, 2_147_483_646, 2_147_483_647).unwrap();
    for p in [huge, huge_month, slow, slow_month, tiny, tiny_month, odd] {
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

/// Debts whose time to full is about `MAX_WAIT_MS`: the last ms a wait reads as never and the
/// first it is reported, in Lua as in the reference, through the direct and the estimated
/// waits; and debts deeper than new parameters keep exact, clipped alike.
#[test]
fn debts_at_the_bounds_match_the_reference() {
    let t0 = 1_700_000_000_000;
    let cost = MAX_WAIT_MS / UT + 1;
    for (rate, per) in [
        (1, 1),
        (1000, 1000),
        (3, 7),
        (MAX_PERIOD_MS, MAX_PERIOD_MS),
        (2_147_483_646, 2_147_483_647),
    ] {
        let p = BucketParams::per_period(UT, rate, per).unwrap();
        let (_, s) = bucket::charge(t0, &p, None, cost, MAX_CAPACITY_UT - UT).unwrap();
        // The first ms the time to full is reported (it only shrinks as the debt is repaid).
        let reported = |t: u64| bucket::decide(t, &p, Some(&s), 0).0.reset_ms.is_some();
        assert!(!reported(t0) && reported(MAX_CAPACITY_UT));
        let (mut lo, mut hi) = (t0, MAX_CAPACITY_UT);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if reported(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        // At 1 µt a ms the wait steps down 1 ms a ms: exactly the bound.
        let first = bucket::decide(hi, &p, Some(&s), 0).0.reset_ms.unwrap();
        assert!(first <= MAX_WAIT_MS && (rate != per || first == MAX_WAIT_MS));
        let steps = [
            Step::Charge {
                dt: 0,
                cost,
                limit: DebtLimit::Most,
            },
            // Past the bound: denied, never at these parameters.
            Step::Check { dt: 0, cost: 1 },
            Step::Check {
                dt: (hi - t0 - 1) as i64,
                cost: 0,
            },
            Step::Check { dt: 1, cost: 0 },
            Step::Check { dt: 0, cost: 1 },
            Step::Check { dt: 1, cost: 0 },
            Step::Check { dt: 0, cost: 2 },
        ];
        run_bucket(t0, p, &steps).unwrap();
    }
    // The deepest debt of a one-token bucket, under parameters of the largest capacity and of
    // half of it, then refunded and checked.
    let tiny = BucketParams::new(UT, UT).unwrap();
    let huge = BucketParams::new(MAX_CAPACITY_UT, MAX_CAPACITY_UT / 1000).unwrap();
    let half = BucketParams::new(MAX_CAPACITY_UT / 2, MAX_CAPACITY_UT / 1000).unwrap();
    let steps = [
        Step::Charge {
            dt: 0,
            cost: MAX_COST,
            limit: DebtLimit::Most,
        },
        Step::Check { dt: 0, cost: 1 },
        Step::Params {
            p: half,
            stored: true,
        },
        Step::Check { dt: 0, cost: 1 },
        Step::Charge {
            dt: 0,
            cost: MAX_COST,
            limit: DebtLimit::TooMuch,
        },
        Step::Params {
            p: huge,
            stored: true,
        },
        Step::Refund {
            dt: 0,
            tokens: MAX_COST,
        },
        Step::Check {
            dt: 1,
            cost: MAX_COST,
        },
        Step::Params {
            p: tiny,
            stored: true,
        },
        Step::Charge {
            dt: 0,
            cost: MAX_COST,
            limit: DebtLimit::Most,
        },
        Step::Check { dt: 1000, cost: 1 },
    ];
    run_bucket(t0, tiny, &steps).unwrap();
}

/// The packed state of `b` after a decision of `cost` at `now` on `p` (as the fallback).
fn lua_step(
    f: &mut Fixture,
    b: &str,
    p: &BucketParams,
    now: u64,
    cost: u64,
) -> (Decision, BucketState) {
    let reply: Vec<i64> = redis::cmd("EVALSHA")
        .arg(&f.bucket_sha)
        .arg(3)
        .arg(b)
        .arg(format!("{b}:p"))
        .arg("qd:v1:active")
        .arg(cost)
        .arg(p.capacity_ut)
        .arg(p.refill_ut)
        .arg(now)
        .arg("")
        .arg(p.period_ms)
        .query(&mut f.conn)
        .unwrap();
    let raw: Vec<u8> = redis::cmd("GET").arg(b).query(&mut f.conn).unwrap();
    (decision(&reply), packed_state(&raw))
}

fn policy(limit: u64, window_ms: u64, burst: u64) -> quota_core::Policy {
    quota_core::PolicySpec {
        limit: limit as f64,
        window_ms: window_ms as f64,
        burst: Some(burst as f64),
        ..Default::default()
    }
    .validate()
    .unwrap()
}

/// Issue 20: one token in 31 days at a 1% share (limit 100 a month) refills exactly, in Lua as
/// in the reference, and its key expires.
#[test]
fn one_token_in_31_days_at_a_one_percent_share() {
    let p = BucketParams::for_share(&policy(100, MAX_WINDOW_MS, 100), 10_000);
    assert_eq!(
        (p.capacity_ut, p.refill_ut, p.period_ms),
        (UT, UT, MAX_WINDOW_MS)
    );
    with_fixture(|f| {
        let b = "qd:v1:{month}:x:1:b";
        let t0 = 1_700_000_000_000;
        let (d, _) = lua_step(f, b, &p, t0, 1);
        assert!(d.allowed);
        let (d, s) = lua_step(f, b, &p, t0, 1);
        assert_eq!((d.allowed, d.retry_after_ms), (false, Some(MAX_WINDOW_MS)));
        assert_eq!(s.tokens_ut, 0);
        let ttl: i64 = redis::cmd("PTTL").arg(b).query(&mut f.conn).unwrap();
        assert!(ttl > 0 && ttl as u64 <= MAX_WINDOW_MS, "{ttl}");
        // A third of the way: a third of a token, to the micro-token.
        let (d, s) = lua_step(f, b, &p, t0 + MAX_WINDOW_MS / 3, 1);
        assert!(!d.allowed);
        assert_eq!(s.tokens_ut, UT / 3);
        let (d, _) = lua_step(f, b, &p, t0 + MAX_WINDOW_MS - 1, 1);
        assert!(!d.allowed);
        let (d, _) = lua_step(f, b, &p, t0 + MAX_WINDOW_MS, 1);
        assert!(d.allowed);
        // The reference agrees step by step.
        let (_, r) = bucket::decide(t0, &p, None, 1);
        let r = bucket::refill(t0 + MAX_WINDOW_MS / 3, &p, Some(&r));
        assert_eq!(r.tokens_ut, UT / 3);
    });
}

/// A state in the 88-byte layout (no period field) and a parameter hash without `per` are what
/// they always meant: refills per second, the carry in thousandths of a micro-token.
#[test]
fn the_layout_without_a_period_reads_as_per_second() {
    let p = BucketParams::new(10 * UT, 3 * UT / 7).unwrap();
    let old = BucketState {
        tokens_ut: 2 * UT + 17,
        debt_ut: 0,
        carry: 999,
        ts_ms: 1_700_000_000_000,
        period_ms: 1000,
    };
    let fields = [
        old.tokens_ut as f64,
        old.carry as f64,
        old.ts_ms as f64,
        0.0,
        0.0,
        p.capacity_ut as f64,
        p.refill_ut as f64,
        1.0,
        -1.0,
        0.0,
        0.0,
    ];
    let raw: Vec<u8> = fields.iter().flat_map(|f| f.to_le_bytes()).collect();
    with_fixture(|f| {
        let (b, pk) = ("qd:v1:{old}:x:1:b", "qd:v1:{old}:x:1:p");
        let _: () = redis::cmd("SET")
            .arg(b)
            .arg(raw)
            .query(&mut f.conn)
            .unwrap();
        let _: () = redis::cmd("HSET")
            .arg(pk)
            .arg(&["cap", "10000000", "rate", "428571"][..])
            .query(&mut f.conn)
            .unwrap();
        for (dt, cost) in [(1234, 1), (0, 5), (77_777, 3)] {
            let now = old.ts_ms + dt;
            let (want, next) = bucket::decide(now, &p, Some(&old), cost);
            // No fallback: the stored parameters (hash without per) or the state's copy apply.
            let reply: Vec<i64> = redis::cmd("EVALSHA")
                .arg(&f.bucket_sha)
                .arg(3)
                .arg(b)
                .arg(pk)
                .arg("qd:v1:active")
                .arg(cost)
                .arg("")
                .arg("")
                .arg(now)
                .query(&mut f.conn)
                .unwrap();
            assert_eq!(decision(&reply), want);
            let raw: Vec<u8> = redis::cmd("GET").arg(b).query(&mut f.conn).unwrap();
            assert_eq!(packed_state(&raw), next);
            let _: () = redis::cmd("DEL").arg(b).query(&mut f.conn).unwrap();
            // From the hash alone (the state expired): a full bucket per second.
            let (want, _) = bucket::decide(now, &p, None, cost);
            let reply: Vec<i64> = redis::cmd("EVALSHA")
                .arg(&f.bucket_sha)
                .arg(3)
                .arg(b)
                .arg(pk)
                .arg("qd:v1:active")
                .arg(cost)
                .arg("")
                .arg("")
                .arg(now)
                .query(&mut f.conn)
                .unwrap();
            assert_eq!(decision(&reply), want);
            let fields_now: Vec<u8> = fields.iter().flat_map(|f| f.to_le_bytes()).collect();
            let _: () = redis::cmd("SET")
                .arg(b)
                .arg(fields_now)
                .query(&mut f.conn)
                .unwrap();
        }
    });
}

/// Issue 20's precision: for random policies (limit 1..10^9, window 1 ms..31 days, burst) and
/// shares down to 1% with share · limit ≥ 1 token, the refill the script enforces is within
/// 10^-6 of share · limit / window, relative, and never 0.
#[test]
fn enforced_refill_matches_the_policy_to_a_millionth() {
    let cfg = config();
    let mut runner = TestRunner::new(ProptestConfig {
        cases: cfg.cases.min(500),
        ..cfg.clone()
    });
    let limit = prop_oneof![1u64..=10, 1u64..=100_000, 1u64..=1_000_000_000];
    let window = prop_oneof![1u64..=1000, 1u64..=MAX_WINDOW_MS, Just(MAX_WINDOW_MS)];
    let share = prop_oneof![Just(10_000u32), 10_000u32..=1_000_000, Just(333_333)];
    let burst_factor = prop_oneof![Just(1u64), 1u64..=10];
    let strategy = (
        limit,
        window,
        share,
        burst_factor,
        1_600_000_000_000u64..=1_900_000_000_000,
    );
    let n = Cell::new(0u64);
    let result = runner.run(&strategy, |(limit, window, share, k, t0)| {
        let burst = (limit * k).min(quota_core::bounds::MAX_BURST);
        let spec = quota_core::PolicySpec {
            limit: limit as f64,
            window_ms: window as f64,
            burst: Some(burst as f64),
            ..Default::default()
        };
        let Ok(pol) = spec.validate() else {
            return Ok(());
        };
        let exact = limit as f64 * f64::from(share) / 1e6 / window as f64; // tokens per ms
        if limit as f64 * f64::from(share) / 1e6 < 1.0 {
            return Ok(());
        }
        let p = BucketParams::for_share(&pol, share);
        prop_assert!(p.refill_ut > 0);
        prop_assert!(
            (p.refill_tokens_per_s() / 1000.0 - exact).abs() <= exact * 1e-12,
            "{p:?}"
        );
        // Drain it, wait a span that accrues at most what fits, and read what accrued.
        let room = p.capacity_ut - p.capacity_ut % UT - 1;
        let span = (room as f64 / (exact * UT as f64)).floor() as u64;
        let span = span.clamp(1, window.max(1));
        with_fixture(|f| {
            f.next += 1;
            n.set(n.get() + 1);
            let b = format!("qd:v1:{{prec{}}}:x:1:b", f.next);
            let (_, s0) = lua_step(f, &b, &p, t0, p.capacity_ut / UT);
            let (_, s1) = lua_step(f, &b, &p, t0 + span, MAX_COST);
            let got = (s1.tokens_ut - s0.tokens_ut) as f64;
            let want = exact * UT as f64 * span as f64;
            prop_assert!(
                (got - want).abs() <= (want * 1e-6).max(1.0),
                "{p:?}: {got} µt accrued in {span} ms, policy {want}"
            );
            prop_assert!(got > 0.0 || want < 1.0);
            Ok(())
        })
    });
    if let Err(e) = result {
        panic!(
            "{e}\nreproduce: PROPTEST_RNG_SEED={:?} cargo test -p quota-store --test differential",
            cfg.rng_seed
        );
    }
    assert!(
        n.get() >= cfg.cases.min(500) as u64 / 4,
        "only {} cases ran",
        n.get()
    );
}

/// One step of the store-level comparison.
#[derive(Debug, Clone)]
enum StoreStep {
    Check {
        dt: i64,
        cost: u64,
    },
    /// New stored parameters, optionally with a lease of `lease.0` ms and floor `lease.1`,
    /// ending no later than `lease.2` ms from now if given (before or after the lease's own
    /// end, or before now).
    Set {
        limit: Limit,
        lease: Option<(u64, Limit, Option<i64>)>,
    },
    /// The same, for the policy's next version, replacing the current one (a changed policy).
    Replace {
        limit: Limit,
        lease: Option<(u64, Limit, Option<i64>)>,
    },
    Collect,
    /// A reservation: up to `batch` multiples of `cost` (token buckets only).
    Reserve {
        dt: i64,
        cost: u64,
        batch: u64,
    },
    /// Tokens of a reservation given back (token buckets only).
    Refund {
        dt: i64,
        tokens: u64,
    },
    /// A charge into debt down to `limit` (resolved against the fallback), under an id or
    /// not (token buckets only).
    Charge {
        dt: i64,
        cost: u64,
        limit: DebtLimit,
        id: bool,
    },
    /// The latest charge under an id again, while the stores keep its id (a client's retry).
    Replay {
        dt: i64,
    },
}

fn small_bucket() -> impl Strategy<Value = Limit> + Clone {
    // A period that is not a second, so the fallback and stored periods are exercised.
    (0u64..=40, 0u64..=20).prop_map(|(c, r)| {
        Limit::TokenBucket(BucketParams::per_period(c * UT, r * UT * 3 / 8, 1500).unwrap())
    })
}

fn small_window() -> impl Strategy<Value = Limit> + Clone {
    // Limits either side of the exact-log threshold (128).
    (prop_oneof![1u64..=20, 120u64..=200], 1u64..=3_000)
        .prop_map(|(limit, window_ms)| Limit::SlidingWindow { limit, window_ms })
}

fn store_steps(
    limit: impl Strategy<Value = Limit> + Clone + 'static,
    reservations: bool,
) -> impl Strategy<Value = Vec<StoreStep>> {
    // Steps and leases on a 50 ms grid too, so checks land exactly on lease ends.
    let dt = prop_oneof![
        5 => 0i64..=400,
        4 => (0i64..=8).prop_map(|k| k * 50),
        1 => 0i64..=10_000,
        1 => -500i64..=0,
    ];
    let cost = prop_oneof![6 => 1u64..=4, 1 => Just(0u64), 1 => 1u64..=60];
    let check = (dt.clone(), cost.clone()).prop_map(|(dt, cost)| StoreStep::Check { dt, cost });
    let reserve = (dt.clone(), cost, prop_oneof![1u64..=3, 1u64..=50])
        .prop_map(|(dt, cost, batch)| StoreStep::Reserve { dt, cost, batch });
    let refund = (dt.clone(), prop_oneof![1u64..=5, 1u64..=100])
        .prop_map(|(dt, tokens)| StoreStep::Refund { dt, tokens });
    let limit_pick = prop_oneof![
        6 => (0u64..=50).prop_map(|t| DebtLimit::Ut(t * UT)),
        1 => Just(DebtLimit::Most),
        1 => Just(DebtLimit::TooMuch),
    ];
    let charge =
        (dt.clone(), 1u64..=60, limit_pick, any::<bool>()).prop_map(|(dt, cost, limit, id)| {
            StoreStep::Charge {
                dt,
                cost,
                limit,
                id,
            }
        });
    let replay = (0i64..=3_000).prop_map(|dt| StoreStep::Replay { dt });
    let (w_reserve, w_refund, w_charge, w_replay) = if reservations {
        (4, 2, 4, 1)
    } else {
        (0, 0, 0, 0)
    };
    let ms = prop_oneof![0u64..=5_000, (0u64..=40).prop_map(|k| k * 50)];
    let not_after = proptest::option::of(prop_oneof![
        -500i64..=6_000,
        (-2i64..=40).prop_map(|k| k * 50)
    ]);
    let lease = proptest::option::of((ms, limit.clone(), not_after));
    let set =
        (limit.clone(), lease.clone()).prop_map(|(limit, lease)| StoreStep::Set { limit, lease });
    let replace = (limit, lease).prop_map(|(limit, lease)| StoreStep::Replace { limit, lease });
    proptest::collection::vec(
        prop_oneof![
            12 => check,
            2 => set,
            1 => replace,
            1 => Just(StoreStep::Collect),
            w_reserve => reserve,
            w_refund => refund,
            w_charge => charge,
            w_replay => replay,
        ],
        1..120,
    )
}

/// `p` with the lease of a [`StoreStep`] written at `now`, if any.
fn with_lease(p: SetParams, lease: &Option<(u64, Limit, Option<i64>)>, now: u64) -> SetParams {
    match lease {
        Some((ms, floor, not_after)) => {
            let p = p.with_lease(*ms, *floor);
            match not_after {
                Some(d) => {
                    let not_after = now.saturating_add_signed(*d);
                    if not_after < now + ms {
                        CUT_LEASES.set(CUT_LEASES.get() + 1);
                    }
                    p.not_after(not_after)
                }
                None => p,
            }
        }
        None => p,
    }
}

/// The embedded store (the no-Redis default) against the Redis store, through the `Store`
/// trait with explicit time: every decision, peek and usage report equal, with parameters
/// written with and without lease ends (the floor takes over at the end by itself, the
/// earlier of the lease and its latest end), and across changed policies (a new version
/// replacing the bucket, keeping what it had spent).
fn run_stores(
    rt: &tokio::runtime::Runtime,
    redis: &RedisStore,
    p0: Limit,
    start: u64,
    steps: &[StoreStep],
) -> Result<(), TestCaseError> {
    rt.block_on(async {
        let embedded = EmbeddedStore::new();
        let mut b = common::fresh_bucket("emb");
        let mut now = start;
        // The latest charge made under an id, and when.
        let mut last: Option<(ChargeRequest, u64)> = None;
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
                    let p = with_lease(SetParams::new(b.clone(), *limit).at(now), lease, now);
                    embedded.set_params(&p).await.unwrap();
                    redis.set_params(&p).await.unwrap();
                }
                StoreStep::Replace { limit, lease } => {
                    let old = b.version;
                    b.version += 1;
                    let p = SetParams::new(b.clone(), *limit).at(now).replacing(old);
                    let p = with_lease(p, lease, now);
                    embedded.set_params(&p).await.unwrap();
                    redis.set_params(&p).await.unwrap();
                }
                StoreStep::Reserve { dt, cost, batch } => {
                    CHECKS.set(CHECKS.get() + 1);
                    RESERVATIONS.set(RESERVATIONS.get() + 1);
                    now = now.saturating_add_signed(*dt);
                    let r = common::req(&b, p0, *cost, Some(now));
                    let want = embedded.reserve(&r, *batch).await.unwrap();
                    let got = redis
                        .reserve(&r, *batch)
                        .await
                        .map_err(|e| TestCaseError::fail(format!("step {i}: {e}")))?;
                    prop_assert_eq!(got, want, "reservation at step {} at {}", i, now);
                    prop_assert!(got.1 <= *batch && (got.1 > 0) == (got.0.allowed && *cost > 0));
                }
                StoreStep::Refund { dt, tokens } => {
                    now = now.saturating_add_signed(*dt);
                    let want = embedded.refund(&b, *tokens, Some(now)).await.unwrap();
                    let got = redis
                        .refund(&b, *tokens, Some(now))
                        .await
                        .map_err(|e| TestCaseError::fail(format!("step {i}: {e}")))?;
                    prop_assert_eq!(got, want, "refund at step {} at {}", i, now);
                }
                StoreStep::Charge {
                    dt,
                    cost,
                    limit,
                    id,
                } => {
                    CHECKS.set(CHECKS.get() + 1);
                    now = now.saturating_add_signed(*dt);
                    let Limit::TokenBucket(p) = p0 else {
                        unreachable!("token buckets only")
                    };
                    let mut r = ChargeRequest::new(b.clone(), p, *cost, limit.resolve(&p)).at(now);
                    if *id {
                        r = r.with_id(format!("c{i}"));
                        last = Some((r.clone(), now));
                    }
                    same_charge(&embedded, redis, &r, i).await?;
                }
                StoreStep::Replay { dt } => {
                    now = now.saturating_add_signed(*dt);
                    // Redis keeps the id ONCE_KEY_MS of real time, the embedded store of the
                    // store's time: replay only well within both.
                    let Some((r, at)) = &last else { continue };
                    if now >= at + quota_core::bounds::ONCE_KEY_MS {
                        continue;
                    }
                    REPLAYS.set(REPLAYS.get() + 1);
                    let r = ChargeRequest {
                        now_ms: Some(now),
                        ..r.clone()
                    };
                    same_charge(&embedded, redis, &r, i).await?;
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

/// Charges `r` on both stores: the same outcome, or both refused.
async fn same_charge(
    embedded: &EmbeddedStore,
    redis: &RedisStore,
    r: &ChargeRequest,
    i: usize,
) -> Result<(), TestCaseError> {
    use quota_store::StoreError::Rejected;
    let want = embedded.charge(r).await;
    let got = redis.charge(r).await;
    match (&got, &want) {
        (Ok(g), Ok(w)) => {
            prop_assert_eq!(g, w, "charge at step {}", i);
            prop_assert_eq!(g.applied + g.clamped, r.cost);
        }
        (Err(Rejected { .. }), Err(Rejected { .. })) => {
            REFUSED_CHARGES.set(REFUSED_CHARGES.get() + 1)
        }
        _ => prop_assert!(
            false,
            "charge at step {}: embedded {:?}, Redis {:?}",
            i,
            want,
            got
        ),
    }
    Ok(())
}

fn stores_agree(
    limit: impl Strategy<Value = Limit> + Clone + 'static,
    reservations: bool,
    name: &str,
) {
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
        store_steps(limit, reservations),
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
    stores_agree(small_bucket(), true, "stores, token bucket");
    assert!(
        RESERVATIONS.get() >= 1_000,
        "{} reservations",
        RESERVATIONS.get()
    );
    let (replays, refused) = (REPLAYS.get(), REFUSED_CHARGES.get());
    println!("{replays} charge ids replayed, {refused} charges refused by both");
    assert!(
        replays >= 100 && refused >= 100,
        "{replays} replays, {refused} refused"
    );
    assert!(CUT_LEASES.get() >= 100, "{} cut leases", CUT_LEASES.get());
}

#[test]
fn embedded_and_redis_stores_agree_on_windows_with_leases() {
    stores_agree(small_window(), false, "stores, sliding window");
    assert!(CUT_LEASES.get() >= 100, "{} cut leases", CUT_LEASES.get());
}

/// A step of a check of several limits at once.
#[derive(Debug, Clone)]
enum MultiStep {
    /// All the limits at once.
    All {
        dt: i64,
        cost: u64,
    },
    /// One limit alone (token_bucket.lua), so the levels drift apart.
    One {
        dt: i64,
        limit: usize,
        cost: u64,
    },
    /// New parameters stored for one limit (set_params.lua).
    Set {
        limit: usize,
        p: BucketParams,
    },
    /// One limit charged into debt (charge.lua), so checks of all meet a limit in debt.
    Charge {
        dt: i64,
        limit: usize,
        cost: u64,
        debt_tokens: u64,
    },
    Collect,
}

/// Token buckets of a few tokens with refills per second, per minute and odd periods, so
/// limits of one check run dry at different times (10 per second beside 50 per minute).
fn multi_bucket() -> impl Strategy<Value = BucketParams> + Clone {
    let period = prop_oneof![
        Just(1000u64),
        Just(60_000u64),
        1u64..=5_000,
        Just(86_400_000u64)
    ];
    (0u64..=60, 0u64..=60, period).prop_map(|(c, r, per)| nudged(c * UT, r * UT / 2, per))
}

fn multi_steps(n: usize) -> impl Strategy<Value = Vec<MultiStep>> {
    let dt = prop_oneof![
        5 => 0i64..=300,
        2 => 0i64..=70_000,
        1 => -500i64..=0,
    ];
    let cost = prop_oneof![6 => 1u64..=6, 1 => Just(0u64), 1 => 1u64..=70];
    let all = (dt.clone(), cost.clone()).prop_map(|(dt, cost)| MultiStep::All { dt, cost });
    let one =
        (dt.clone(), 0..n, cost).prop_map(|(dt, limit, cost)| MultiStep::One { dt, limit, cost });
    let set = (0..n, multi_bucket()).prop_map(|(limit, p)| MultiStep::Set { limit, p });
    let charge = (dt, 0..n, 1u64..=80, 0u64..=40).prop_map(|(dt, limit, cost, debt_tokens)| {
        MultiStep::Charge {
            dt,
            limit,
            cost,
            debt_tokens,
        }
    });
    proptest::collection::vec(
        prop_oneof![12 => all, 3 => one, 1 => set, 2 => charge, 1 => Just(MultiStep::Collect)],
        1..120,
    )
}

/// `lua/token_buckets.lua` (through the Redis store) and the embedded store against
/// `quota_core::bucket::decide_all`: every limit's decision and stored state, and the usage
/// collected, equal.
fn run_multi(
    rt: &tokio::runtime::Runtime,
    redis: &RedisStore,
    conn: &mut redis::Connection,
    start: u64,
    fallbacks: &[BucketParams],
    steps: &[MultiStep],
) -> Result<(), TestCaseError> {
    use quota_core::PolicyName;
    use quota_store::{BucketRef, LimitCheck, MultiCheckRequest};
    rt.block_on(async {
        // Idle states outlive every case on either store (Redis expires on its own clock, not
        // the explicit now).
        let embedded = EmbeddedStore::new().with_min_idle_ttl(MULTI_IDLE_TTL_MS);
        let tenant = common::fresh_bucket("multi").tenant;
        let buckets: Vec<BucketRef> = (0..fallbacks.len())
            .map(|i| BucketRef {
                tenant: tenant.clone(),
                policy: PolicyName::new(format!("p{i}")).unwrap(),
                version: 1,
            })
            .collect();
        let mut params: Vec<BucketParams> = fallbacks.to_vec();
        let mut states: Vec<Option<BucketState>> = vec![None; fallbacks.len()];
        let mut now = start;
        let multi = |cost: u64, now: u64| MultiCheckRequest {
            limits: buckets
                .iter()
                .zip(fallbacks)
                .map(|(b, p)| LimitCheck {
                    bucket: b.clone(),
                    limit: Limit::TokenBucket(*p),
                })
                .collect(),
            cost,
            now_ms: Some(now),
        };
        for (i, step) in steps.iter().enumerate() {
            match *step {
                MultiStep::All { dt, cost } => {
                    CHECKS.set(CHECKS.get() + 1);
                    now = now.saturating_add_signed(dt);
                    let inputs: Vec<_> = params.iter().copied().zip(states.clone()).collect();
                    let outcomes = bucket::decide_all(now, &inputs, cost);
                    let want: Vec<Decision> = outcomes.iter().map(|o| o.decision).collect();
                    for (s, o) in states.iter_mut().zip(&outcomes) {
                        if let Some(next) = o.state {
                            *s = Some(next);
                        }
                    }
                    let r = multi(cost, now);
                    let got = redis
                        .check_all(&r)
                        .await
                        .map_err(|e| TestCaseError::fail(format!("step {i}: {e}")))?;
                    prop_assert_eq!(&got, &want, "Lua, step {} at {}", i, now);
                    let emb = embedded.check_all(&r).await.unwrap();
                    prop_assert_eq!(&emb, &want, "embedded, step {} at {}", i, now);
                }
                MultiStep::One { dt, limit, cost } => {
                    CHECKS.set(CHECKS.get() + 1);
                    now = now.saturating_add_signed(dt);
                    let (want, next) =
                        bucket::decide(now, &params[limit], states[limit].as_ref(), cost);
                    if cost > 0 {
                        states[limit] = Some(next);
                    }
                    let r = common::req(
                        &buckets[limit],
                        Limit::TokenBucket(fallbacks[limit]),
                        cost,
                        Some(now),
                    );
                    prop_assert_eq!(redis.check(&r).await.unwrap(), want, "step {}", i);
                    prop_assert_eq!(embedded.check(&r).await.unwrap(), want, "step {}", i);
                }
                MultiStep::Charge {
                    dt,
                    limit,
                    cost,
                    debt_tokens,
                } => {
                    now = now.saturating_add_signed(dt);
                    let (want, next) = bucket::charge(
                        now,
                        &params[limit],
                        states[limit].as_ref(),
                        cost,
                        debt_tokens * UT,
                    )
                    .unwrap();
                    states[limit] = Some(next);
                    let r = ChargeRequest::new(
                        buckets[limit].clone(),
                        fallbacks[limit],
                        cost,
                        debt_tokens * UT,
                    )
                    .at(now);
                    prop_assert_eq!(redis.charge(&r).await.unwrap(), want, "step {}", i);
                    prop_assert_eq!(embedded.charge(&r).await.unwrap(), want, "step {}", i);
                }
                MultiStep::Set { limit, p } => {
                    let s = SetParams::new(buckets[limit].clone(), Limit::TokenBucket(p)).at(now);
                    redis.set_params(&s).await.unwrap();
                    embedded.set_params(&s).await.unwrap();
                    params[limit] = p;
                    states[limit] = states[limit].map(|s| s.in_period(p.period_ms));
                }
                MultiStep::Collect => {
                    let mine = |v: Vec<UsageRecord>| -> Vec<UsageRecord> {
                        let mut v: Vec<_> = v
                            .into_iter()
                            .filter(|u| u.bucket.tenant == tenant)
                            .collect();
                        v.sort_by(|a, b| a.bucket.cmp(&b.bucket));
                        v
                    };
                    let want = mine(embedded.collect_usage(usize::MAX).await.unwrap());
                    let got = mine(redis.collect_usage(usize::MAX).await.unwrap());
                    prop_assert_eq!(got, want, "usage at step {}", i);
                }
            }
            // Every limit's stored state is the reference's: a limit that would have
            // admitted a denied check is untouched.
            for (k, b) in buckets.iter().enumerate() {
                let raw: Option<Vec<u8>> = redis::cmd("GET")
                    .arg(b.state_key(quota_core::keys::StateKind::Bucket))
                    .query(conn)
                    .unwrap();
                prop_assert_eq!(
                    raw.as_deref().map(packed_state),
                    states[k],
                    "limit {} state at step {}",
                    k,
                    i
                );
            }
        }
        Ok(())
    })
}

/// The minimum idle TTL of the stores of the several-limits test: ten days.
const MULTI_IDLE_TTL_MS: u64 = 864_000_000;

#[test]
fn several_limits_at_once_match_the_reference_in_lua_and_embedded() {
    let cfg = config();
    let before = CHECKS.get();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let server = RedisServer::start().unwrap();
    let cfg_redis = quota_store::RedisStoreConfig::standalone(server.url())
        .with_timeout(std::time::Duration::from_secs(5))
        .with_min_idle_ttl(std::time::Duration::from_millis(MULTI_IDLE_TTL_MS));
    let redis = rt.block_on(RedisStore::connect(cfg_redis)).unwrap();
    let conn = RefCell::new(common::sync_conn(&server));
    let mut runner = TestRunner::new(cfg.clone());
    let strategy = (1usize..=4).prop_flat_map(|n| {
        (
            1_600_000_000_000u64..=1_900_000_000_000,
            proptest::collection::vec(multi_bucket(), n),
            multi_steps(n),
        )
    });
    let result = runner.run(&strategy, |(start, fallbacks, steps)| {
        run_multi(
            &rt,
            &redis,
            &mut conn.borrow_mut(),
            start,
            &fallbacks,
            &steps,
        )
    });
    if let Err(e) = result {
        panic!(
            "{e}\nreproduce: PROPTEST_RNG_SEED={:?} cargo test -p quota-store --test differential",
            cfg.rng_seed
        );
    }
    report("several limits at once", before, &cfg);
}

/// The issue's example: 10 per second and 50 per minute on one subject. A burst of 10 admits
/// all 10 (each limit spends 10); the 11th is denied by the per-second limit alone and spends
/// nothing on the per-minute one. Second by second, the per-minute limit runs out after 54 (50
/// and the 4 it refilled in 5 s), and from then on a denial spends nothing on the per-second
/// limit either.
#[test]
fn ten_per_second_and_fifty_per_minute_all_or_nothing() {
    use quota_core::PolicyName;
    use quota_store::{BucketRef, LimitCheck, MultiCheckRequest};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let server = RedisServer::start().unwrap();
    let redis = rt.block_on(common::store(&server));
    let embedded = EmbeddedStore::new();
    let tenant = common::fresh_bucket("ten-fifty").tenant;
    let per_s = BucketParams::per_period(10 * UT, 10 * UT, 1000).unwrap();
    let per_min = BucketParams::per_period(50 * UT, 50 * UT, 60_000).unwrap();
    let limits: Vec<LimitCheck> = [("per_s", per_s), ("per_min", per_min)]
        .into_iter()
        .map(|(name, p)| LimitCheck {
            bucket: BucketRef {
                tenant: tenant.clone(),
                policy: PolicyName::new(name).unwrap(),
                version: 1,
            },
            limit: Limit::TokenBucket(p),
        })
        .collect();
    let t0 = 1_700_000_000_000u64;
    let mut states = [None, None];
    let mut admitted = 0;
    // 15 requests at each of the first 6 seconds.
    for sec in 0..6u64 {
        for k in 0..15u64 {
            let now = t0 + sec * 1000 + k;
            let req = MultiCheckRequest {
                limits: limits.clone(),
                cost: 1,
                now_ms: Some(now),
            };
            let got = rt.block_on(redis.check_all(&req)).unwrap();
            let emb = rt.block_on(embedded.check_all(&req)).unwrap();
            let inputs = [(per_s, states[0]), (per_min, states[1])];
            let outcomes = bucket::decide_all(now, &inputs, 1);
            let want: Vec<Decision> = outcomes.iter().map(|o| o.decision).collect();
            assert_eq!(got, want, "Lua at second {sec}, request {k}");
            assert_eq!(emb, want, "embedded at second {sec}, request {k}");
            for (s, o) in states.iter_mut().zip(&outcomes) {
                if let Some(n) = o.state {
                    *s = Some(n);
                }
            }
            let all = Decision::all(got.iter().copied()).unwrap();
            if all.allowed {
                admitted += 1;
            }
            match (sec, k) {
                (0..=4, 0..=9) => assert!(all.allowed, "second {sec}, request {k}"),
                (0..=4, _) => {
                    // Denied by the per-second limit alone: the per-minute one spent nothing.
                    assert_eq!((got[0].allowed, got[1].allowed), (false, true));
                    assert_eq!(
                        got[1].remaining,
                        50 - 10 * (sec + 1) + sec * 50 * 1000 / 60_000
                    );
                }
                (5, 0..=3) => assert!(all.allowed, "second {sec}, request {k}"),
                (5, _) => {
                    // The per-minute limit is spent (50 plus the 4 it refilled): denied by it
                    // alone, and the per-second limit keeps its 6 unspent.
                    assert!(!all.allowed);
                    assert!(got[0].allowed && !got[1].allowed);
                    assert_eq!(got[0].remaining, 6, "the per-second limit spent nothing");
                }
                _ => {}
            }
        }
    }
    // 50 in the first five seconds plus what the per-minute limit refilled by then (4 tokens).
    assert_eq!(admitted, 54);
}

/// Spends 3 on a window of `old` at `t0`, replaces it by `new` and peeks: the tokens left.
async fn left_after_change<S: Store>(store: &S, old: Limit, new: Limit, t0: u64) -> u64 {
    let b = common::fresh_bucket("wcarry");
    store
        .set_params(&SetParams::new(b.clone(), old).at(t0))
        .await
        .unwrap();
    for k in 0..3 {
        let d = store.check(&common::req(&b, old, 1, Some(t0 + k))).await;
        assert!(d.unwrap().allowed);
    }
    let next = quota_store::BucketRef {
        version: b.version + 1,
        ..b.clone()
    };
    let p = SetParams::new(next.clone(), new)
        .at(t0 + 10)
        .replacing(b.version);
    store.set_params(&p).await.unwrap();
    let d = store
        .check(&common::req(&next, new, 0, Some(t0 + 20)))
        .await;
    d.unwrap().remaining
}

/// A changed sliding-window policy keeps what its window counts, on both stores alike: exact
/// to exact keeps the entries, exact to approximate and back count them as admitted now; a
/// higher limit is held at the replaced one for a window.
#[test]
fn a_changed_window_keeps_what_it_counts_in_both_stores() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let server = RedisServer::start().unwrap();
    let redis = rt.block_on(common::store(&server));
    let embedded = EmbeddedStore::new();
    let window = |limit, window_ms| Limit::SlidingWindow { limit, window_ms };
    let t0 = 1_700_000_000_000u64;
    // (old limit, new limit, tokens left in the new window after 3 spent in the old)
    for (old, new, left) in [
        (window(5, 10_000), window(6, 20_000), 2),
        (window(5, 10_000), window(200, 10_000), 2),
        (window(200, 10_000), window(10, 10_000), 7),
        (window(200, 10_000), window(300, 5_000), 197),
    ] {
        let e = rt.block_on(left_after_change(&embedded, old, new, t0));
        let r = rt.block_on(left_after_change(&redis, old, new, t0));
        assert_eq!((e, r), (left, left), "{old:?} -> {new:?}");
    }
}

/// Issue 31: `set_params.lua` and the embedded store apply one fence rule. Random sequences of
/// writes (fenced by random tokens and epochs, or not at all) and clears on one bucket, run on
/// both: each write accepted or refused alike, the parameters in force after each step alike,
/// and a refused write never changing them — checked against [`quota_store::Fence::refuses`]
/// on the fence the model says is stored.
#[test]
fn fences_refuse_alike_in_both_stores() {
    use quota_store::{Fence, StoreError};
    #[derive(Debug, Clone)]
    enum Step {
        Write(u64, Option<Fence>),
        Clear,
    }
    let step = prop_oneof![
        8 => (1u64..=60, proptest::option::weighted(0.85, (0u64..5, 0u64..5)))
            .prop_map(|(cap, f)| Step::Write(cap, f.map(|(token, epoch)| Fence { token, epoch }))),
        1 => Just(Step::Clear),
    ];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let server = RedisServer::start().unwrap();
    let redis = rt.block_on(common::store(&server));
    let embedded = EmbeddedStore::new();
    let t0 = 1_700_000_000_000u64;
    let mut runner = TestRunner::new_with_rng(
        ProptestConfig {
            cases: 64,
            ..ProptestConfig::default()
        },
        proptest::test_runner::TestRng::from_seed(
            proptest::test_runner::RngAlgorithm::ChaCha,
            &[31; 32],
        ),
    );
    let case = Cell::new(0u64);
    let (refused, accepted) = (Cell::new(0u32), Cell::new(0u32));
    runner
        .run(&proptest::collection::vec(step, 1..24), |steps| {
            case.set(case.get() + 1);
            let b = common::fresh_bucket(&format!("fence-{}", case.get()));
            let peek = common::req(&b, common::tokens(1_000, 1), 0, Some(t0 + 1));
            let mut stored: Option<Fence> = None;
            let mut in_force: Option<u64> = None;
            for s in &steps {
                match s {
                    Step::Clear => {
                        rt.block_on(redis.clear_params(&b)).unwrap();
                        rt.block_on(embedded.clear_params(&b)).unwrap();
                        (stored, in_force) = (None, None);
                    }
                    Step::Write(cap, f) => {
                        let mut p = SetParams::new(b.clone(), common::tokens(*cap, 1))
                            .with_lease(60_000, common::tokens(1, 1))
                            .at(t0);
                        p.fence = *f;
                        let r = rt.block_on(redis.set_params(&p));
                        let e = rt.block_on(embedded.set_params(&p));
                        let want_refused = Fence::refuses(stored, *f).is_some();
                        for got in [&r, &e] {
                            match got {
                                Ok(()) => prop_assert!(!want_refused, "{s:?} after {stored:?}"),
                                Err(StoreError::Fenced { .. }) => {
                                    prop_assert!(want_refused, "{s:?} after {stored:?}")
                                }
                                Err(other) => prop_assert!(false, "{s:?}: {other}"),
                            }
                        }
                        if want_refused {
                            refused.set(refused.get() + 1);
                        } else {
                            accepted.set(accepted.get() + 1);
                            (stored, in_force) = (*f, Some(*cap));
                        }
                    }
                }
                // The bucket is full at every step (nothing spends): a peek shows the
                // capacity in force, or the one passed when nothing is stored.
                let want = in_force.unwrap_or(1_000);
                let r = rt.block_on(redis.check(&peek)).unwrap().remaining;
                let e = rt.block_on(embedded.check(&peek)).unwrap().remaining;
                prop_assert_eq!((r, e), (want, want), "after {:?}", s);
            }
            Ok(())
        })
        .unwrap();
    assert!(
        refused.get() > 100 && accepted.get() > 100,
        "{refused:?} {accepted:?}"
    );
}

/// A step of the holds comparison. Ids are named by how recently they were first asked for
/// (`back` 0: the latest), so settles meet live holds and new holds meet taken ids.
#[derive(Debug, Clone)]
enum HoldStep {
    /// A hold of the limits in `mask` (bits of the case's buckets), under a new id or (`reuse`)
    /// one asked for before.
    Hold {
        dt: i64,
        reuse: Option<usize>,
        mask: u8,
        cost: u64,
        ttl_ms: u64,
        debt_tokens: u64,
    },
    /// The latest hold asked under an id, asked again as it was (a caller's retry).
    Retry {
        dt: i64,
        back: usize,
    },
    Settle {
        dt: i64,
        back: usize,
        cost: u64,
    },
    Release {
        dt: i64,
        back: usize,
    },
    /// One limit checked alone (token_bucket.lua).
    Check {
        dt: i64,
        limit: usize,
        cost: u64,
    },
    /// One limit charged into debt (charge.lua).
    Charge {
        dt: i64,
        limit: usize,
        cost: u64,
        debt_tokens: u64,
    },
    /// New parameters stored for one limit (set_params.lua).
    Set {
        limit: usize,
        p: BucketParams,
    },
    Collect,
}

fn hold_steps(n: usize) -> impl Strategy<Value = Vec<HoldStep>> {
    // Mostly within a hold's life; some past its expiry, some past its record's memory.
    let dt = prop_oneof![
        8 => 0i64..=2_000,
        3 => 0i64..=70_000,
        1 => 590_000i64..=700_000,
        1 => -500i64..=0,
    ];
    let back = 0usize..3;
    let ttl = prop_oneof![
        3 => 1_000u64..=300_000,
        1 => 1u64..=5_000,
        1 => Just(quota_core::bounds::MAX_HOLD_TTL_MS),
    ];
    let hold = (
        dt.clone(),
        prop_oneof![3 => Just(None), 1 => back.clone().prop_map(Some)],
        1u8..(1 << n),
        prop_oneof![4 => 1u64..=8, 1 => 1u64..=70],
        ttl,
        0u64..=20,
    )
        .prop_map(
            |(dt, reuse, mask, cost, ttl_ms, debt_tokens)| HoldStep::Hold {
                dt,
                reuse,
                mask,
                cost,
                ttl_ms,
                debt_tokens,
            },
        );
    let retry = (dt.clone(), back.clone()).prop_map(|(dt, back)| HoldStep::Retry { dt, back });
    let settle = (dt.clone(), back.clone(), prop_oneof![0u64..=10, 0u64..=40])
        .prop_map(|(dt, back, cost)| HoldStep::Settle { dt, back, cost });
    let release = (dt.clone(), back).prop_map(|(dt, back)| HoldStep::Release { dt, back });
    let check = (dt.clone(), 0..n, 0u64..=6).prop_map(|(dt, limit, cost)| HoldStep::Check {
        dt,
        limit,
        cost,
    });
    let charge = (dt, 0..n, 1u64..=30, 0u64..=20).prop_map(|(dt, limit, cost, debt_tokens)| {
        HoldStep::Charge {
            dt,
            limit,
            cost,
            debt_tokens,
        }
    });
    let set = (0..n, multi_bucket()).prop_map(|(limit, p)| HoldStep::Set { limit, p });
    proptest::collection::vec(
        prop_oneof![
            6 => hold,
            2 => retry,
            5 => settle,
            2 => release,
            3 => check,
            1 => charge,
            1 => set,
            1 => Just(HoldStep::Collect),
        ],
        1..80,
    )
}

/// A limit of a hold in the reference's record: the bucket's index, its fallback, its debt
/// limit (as the stores' records keep bucket, fallback and debt limit).
type RefLimit = (usize, BucketParams, u64);

/// `lua/hold.lua` and `lua/settle.lua` (through the Redis store) and the embedded store against
/// `quota_core::hold` over `quota_core::bucket`: every hold's outcome, settle's and release's
/// answer, every bucket's stored state and the usage collected, equal.
fn run_holds(
    rt: &tokio::runtime::Runtime,
    redis: &RedisStore,
    conn: &mut redis::Connection,
    start: u64,
    fallbacks: &[BucketParams],
    steps: &[HoldStep],
) -> Result<(), TestCaseError> {
    use quota_core::hold::{self, Create, Finish, HoldRecord, Verdict};
    use quota_core::PolicyName;
    use quota_store::{
        BucketRef, HoldLimit, HoldOutcome, HoldRequest, ReleaseRequest, SettleRequest, Settled,
        SettledLimit, StoreError,
    };
    use std::collections::HashMap;
    rt.block_on(async {
        let embedded = EmbeddedStore::new().with_min_idle_ttl(MULTI_IDLE_TTL_MS);
        let tenant = common::fresh_bucket("holds").tenant;
        let buckets: Vec<BucketRef> = (0..fallbacks.len())
            .map(|i| BucketRef {
                tenant: tenant.clone(),
                policy: PolicyName::new(format!("p{i}")).unwrap(),
                version: 1,
            })
            .collect();
        let mut params: Vec<BucketParams> = fallbacks.to_vec();
        let mut states: Vec<Option<BucketState>> = vec![None; fallbacks.len()];
        let mut usage: Vec<(u64, u64)> = vec![(0, 0); fallbacks.len()];
        let mut records: HashMap<String, HoldRecord<RefLimit>> = HashMap::new();
        let mut asked: HashMap<String, HoldRequest> = HashMap::new();
        // Ids in the order first asked for.
        let mut ids: Vec<String> = Vec::new();
        let id_back = |ids: &[String], back: usize| -> String {
            ids.len()
                .checked_sub(back + 1)
                .map_or_else(|| "never".to_string(), |k| ids[k].clone())
        };
        let mut now = start;
        for (i, step) in steps.iter().enumerate() {
            match step {
                HoldStep::Hold { dt, .. } | HoldStep::Retry { dt, .. } => {
                    now = now.saturating_add_signed(*dt);
                    let key = match *step {
                        HoldStep::Hold { reuse: None, .. } => {
                            ids.push(format!("h{}", ids.len()));
                            id_back(&ids, 0)
                        }
                        HoldStep::Hold {
                            reuse: Some(back), ..
                        }
                        | HoldStep::Retry { back, .. } => id_back(&ids, back),
                        _ => unreachable!(),
                    };
                    let req = match *step {
                        HoldStep::Hold {
                            mask,
                            cost,
                            ttl_ms,
                            debt_tokens,
                            ..
                        } => HoldRequest {
                            id: key.clone(),
                            limits: (0..buckets.len())
                                .filter(|k| mask & (1 << k) != 0)
                                .map(|k| HoldLimit {
                                    bucket: buckets[k].clone(),
                                    limit: Limit::TokenBucket(fallbacks[k]),
                                    debt_limit_ut: debt_tokens * UT,
                                })
                                .collect(),
                            cost,
                            ttl_ms,
                            now_ms: Some(now),
                        },
                        _ => match asked.get(&key) {
                            Some(r) => HoldRequest {
                                now_ms: Some(now),
                                ..r.clone()
                            },
                            None => continue,
                        },
                    };
                    asked.insert(key.clone(), req.clone());
                    let idx: Vec<usize> = req
                        .limits
                        .iter()
                        .map(|l| buckets.iter().position(|b| *b == l.bucket).unwrap())
                        .collect();
                    let mine: Vec<RefLimit> = idx
                        .iter()
                        .zip(&req.limits)
                        .map(|(&k, l)| (k, fallbacks[k], l.debt_limit_ut))
                        .collect();
                    let inputs: Vec<(BucketParams, Option<BucketState>)> =
                        idx.iter().map(|&k| (params[k], states[k])).collect();
                    let want = match hold::create(now, records.get(&key), &mine, req.cost, req.ttl_ms)
                    {
                        Create::Refused => None,
                        Create::Replay { expires_at_ms } => {
                            REPLAYED_HOLDS.set(REPLAYED_HOLDS.get() + 1);
                            Some(HoldOutcome {
                                decisions: inputs
                                    .iter()
                                    .map(|(p, s)| bucket::decide(now, p, s.as_ref(), 0).0)
                                    .collect(),
                                held: true,
                                expires_at_ms,
                                replayed: true,
                            })
                        }
                        Create::Fresh => {
                            let outcomes = bucket::decide_all(now, &inputs, req.cost);
                            let held = outcomes.iter().all(|o| o.decision.allowed);
                            for (&k, o) in idx.iter().zip(&outcomes) {
                                if let Some(s) = o.state {
                                    states[k] = Some(s);
                                    if held {
                                        usage[k].0 += req.cost;
                                    } else {
                                        usage[k].1 += req.cost;
                                    }
                                }
                            }
                            if held {
                                HELD.set(HELD.get() + 1);
                                let r = HoldRecord::open(now, mine, req.cost, req.ttl_ms);
                                records.insert(key.clone(), r);
                            }
                            Some(HoldOutcome {
                                decisions: outcomes.iter().map(|o| o.decision).collect(),
                                held,
                                expires_at_ms: now + req.ttl_ms,
                                replayed: false,
                            })
                        }
                    };
                    let got = redis.hold(&req).await;
                    let emb = embedded.hold(&req).await;
                    match want {
                        Some(w) => {
                            prop_assert_eq!(got.as_ref().ok(), Some(&w), "Lua, step {}", i);
                            prop_assert_eq!(emb.as_ref().ok(), Some(&w), "embedded, step {}", i);
                        }
                        None => {
                            REFUSED_HOLDS.set(REFUSED_HOLDS.get() + 1);
                            for r in [&got, &emb] {
                                prop_assert!(
                                    matches!(r, Err(StoreError::Rejected { reason }) if reason.contains("hold id")),
                                    "step {}: {:?}",
                                    i,
                                    r
                                );
                            }
                        }
                    }
                }
                HoldStep::Settle { dt, back, .. } | HoldStep::Release { dt, back } => {
                    now = now.saturating_add_signed(*dt);
                    let key = id_back(&ids, *back);
                    let what = match *step {
                        HoldStep::Settle { cost, .. } => Finish::Settle { actual: cost },
                        _ => Finish::Release,
                    };
                    let want = match hold::finish(now, records.get(&key), what) {
                        Verdict::Unknown => Settled::Unknown,
                        Verdict::Expired { expired_at_ms } => Settled::Expired { expired_at_ms },
                        Verdict::Conflict(why) => Settled::Conflict(why),
                        Verdict::Replay(results) => Settled::Done {
                            limits: records[&key]
                                .limits
                                .iter()
                                .zip(results)
                                .map(|(l, r)| SettledLimit::of(buckets[l.0].clone(), r))
                                .collect(),
                            replayed: true,
                        },
                        Verdict::Apply => {
                            let r = records.remove(&key).unwrap();
                            let mut results = Vec::new();
                            for &(k, _, debt) in &r.limits {
                                let s = hold::settle_bucket(
                                    now,
                                    &params[k],
                                    states[k].as_ref(),
                                    debt,
                                    r.cost,
                                    what.actual(),
                                );
                                if let Some(next) = s.state {
                                    states[k] = Some(next);
                                }
                                usage[k].0 = (usage[k].0 + s.admitted).saturating_sub(s.unadmitted);
                                usage[k].1 += s.denied;
                                results.push(s.result);
                            }
                            let limits = r
                                .limits
                                .iter()
                                .zip(&results)
                                .map(|(l, x)| SettledLimit::of(buckets[l.0].clone(), *x))
                                .collect();
                            records.insert(key.clone(), r.ended(now, what, results));
                            Settled::Done {
                                limits,
                                replayed: false,
                            }
                        }
                    };
                    let (got, emb) = match what {
                        Finish::Settle { actual } => {
                            let r = SettleRequest {
                                tenant: tenant.clone(),
                                id: key.clone(),
                                cost: actual,
                                now_ms: Some(now),
                            };
                            (redis.settle(&r).await, embedded.settle(&r).await)
                        }
                        Finish::Release => {
                            let r = ReleaseRequest {
                                tenant: tenant.clone(),
                                id: key.clone(),
                                now_ms: Some(now),
                            };
                            (redis.release(&r).await, embedded.release(&r).await)
                        }
                    };
                    let seen = SETTLED.get();
                    SETTLED.set(match &want {
                        Settled::Done { replayed: false, .. } => (seen.0 + 1, seen.1),
                        Settled::Expired { .. } => (seen.0, seen.1 + 1),
                        _ => seen,
                    });
                    prop_assert_eq!(got.as_ref().ok(), Some(&want), "Lua, step {}: {:?}", i, got);
                    prop_assert_eq!(emb.as_ref().ok(), Some(&want), "embedded, step {}", i);
                }
                HoldStep::Check { dt, limit, cost } => {
                    let (limit, cost) = (*limit, *cost);
                    now = now.saturating_add_signed(*dt);
                    let (want, next) =
                        bucket::decide(now, &params[limit], states[limit].as_ref(), cost);
                    if cost > 0 {
                        states[limit] = Some(next);
                        if want.allowed {
                            usage[limit].0 += cost;
                        } else {
                            usage[limit].1 += cost;
                        }
                    }
                    let r = common::req(
                        &buckets[limit],
                        Limit::TokenBucket(fallbacks[limit]),
                        cost,
                        Some(now),
                    );
                    prop_assert_eq!(redis.check(&r).await.unwrap(), want, "step {}", i);
                    prop_assert_eq!(embedded.check(&r).await.unwrap(), want, "step {}", i);
                }
                HoldStep::Charge {
                    dt,
                    limit,
                    cost,
                    debt_tokens,
                } => {
                    let limit = *limit;
                    now = now.saturating_add_signed(*dt);
                    let (want, next) = bucket::charge(
                        now,
                        &params[limit],
                        states[limit].as_ref(),
                        *cost,
                        debt_tokens * UT,
                    )
                    .unwrap();
                    states[limit] = Some(next);
                    usage[limit].0 += want.applied;
                    usage[limit].1 += want.clamped;
                    let r = ChargeRequest::new(
                        buckets[limit].clone(),
                        fallbacks[limit],
                        *cost,
                        debt_tokens * UT,
                    )
                    .at(now);
                    prop_assert_eq!(redis.charge(&r).await.unwrap(), want, "step {}", i);
                    prop_assert_eq!(embedded.charge(&r).await.unwrap(), want, "step {}", i);
                }
                HoldStep::Set { limit, p } => {
                    let s = SetParams::new(buckets[*limit].clone(), Limit::TokenBucket(*p)).at(now);
                    redis.set_params(&s).await.unwrap();
                    embedded.set_params(&s).await.unwrap();
                    params[*limit] = *p;
                    states[*limit] = states[*limit].map(|s| s.in_period(p.period_ms));
                }
                HoldStep::Collect => {
                    let mine = |v: Vec<UsageRecord>| -> Vec<UsageRecord> {
                        let mut v: Vec<_> = v
                            .into_iter()
                            .filter(|u| u.bucket.tenant == tenant)
                            .collect();
                        v.sort_by(|a, b| a.bucket.cmp(&b.bucket));
                        v
                    };
                    let want: Vec<UsageRecord> = buckets
                        .iter()
                        .zip(&mut usage)
                        .filter_map(|(b, u)| {
                            let (admitted, denied) = std::mem::take(u);
                            (admitted + denied > 0).then(|| UsageRecord {
                                bucket: b.clone(),
                                admitted,
                                denied,
                            })
                        })
                        .collect();
                    let emb = mine(embedded.collect_usage(usize::MAX).await.unwrap());
                    let got = mine(redis.collect_usage(usize::MAX).await.unwrap());
                    prop_assert_eq!(&got, &want, "Lua usage at step {}", i);
                    prop_assert_eq!(&emb, &want, "embedded usage at step {}", i);
                }
            }
            for (k, b) in buckets.iter().enumerate() {
                let raw: Option<Vec<u8>> = redis::cmd("GET")
                    .arg(b.state_key(quota_core::keys::StateKind::Bucket))
                    .query(conn)
                    .unwrap();
                prop_assert_eq!(
                    raw.as_deref().map(packed_state),
                    states[k],
                    "limit {} state at step {}",
                    k,
                    i
                );
            }
        }
        Ok(())
    })
}

thread_local! {
    /// Holds made, answered again, and refused (an id of another request), by the holds
    /// comparison on this thread.
    static HELD: Cell<u64> = const { Cell::new(0) };
    static REPLAYED_HOLDS: Cell<u64> = const { Cell::new(0) };
    static REFUSED_HOLDS: Cell<u64> = const { Cell::new(0) };
    /// Holds ended (settled or released) and found expired.
    static SETTLED: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// Holds (reserve, then settle) over a few token buckets of one tenant, mixed with checks,
/// charges into debt, new parameters and usage collections, with time stepping within a
/// hold's life, past its expiry and past its record's memory: Lua and the embedded store
/// against the reference, step by step.
#[test]
fn holds_match_the_reference_in_lua_and_embedded() {
    let mut cfg = config();
    cfg.cases = cfg.cases.div_ceil(2);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let server = RedisServer::start().unwrap();
    let cfg_redis = quota_store::RedisStoreConfig::standalone(server.url())
        .with_timeout(std::time::Duration::from_secs(5))
        .with_min_idle_ttl(std::time::Duration::from_millis(MULTI_IDLE_TTL_MS));
    let redis = rt.block_on(RedisStore::connect(cfg_redis)).unwrap();
    let conn = RefCell::new(common::sync_conn(&server));
    let mut runner = TestRunner::new(cfg.clone());
    let strategy = (1usize..=3).prop_flat_map(|n| {
        (
            1_600_000_000_000u64..=1_900_000_000_000,
            proptest::collection::vec(multi_bucket(), n),
            hold_steps(n),
        )
    });
    let result = runner.run(&strategy, |(start, fallbacks, steps)| {
        run_holds(
            &rt,
            &redis,
            &mut conn.borrow_mut(),
            start,
            &fallbacks,
            &steps,
        )
    });
    if let Err(e) = result {
        panic!(
            "{e}\nreproduce: PROPTEST_RNG_SEED={:?} cargo test -p quota-store --test differential",
            cfg.rng_seed
        );
    }
    let (ended, expired) = SETTLED.get();
    println!(
        "holds: {} held, {} replayed, {} refused, {ended} ended, {expired} expired over {} cases",
        HELD.get(),
        REPLAYED_HOLDS.get(),
        REFUSED_HOLDS.get(),
        cfg.cases
    );
    if cfg.cases >= 100 {
        assert!(HELD.get() > 500 && ended > 300, "too few holds reached");
        assert!(REPLAYED_HOLDS.get() > 20 && REFUSED_HOLDS.get() > 20 && expired > 20);
    }
}

/// A step of the concurrency comparison (ids named as in [`HoldStep`]).
#[derive(Debug, Clone)]
enum SlotStep {
    /// A hold of one slot of limit `limit`, under a new id or (`reuse`) one asked for before.
    Take {
        dt: i64,
        limit: usize,
        reuse: Option<usize>,
        ttl_ms: u64,
    },
    Retry {
        dt: i64,
        back: usize,
    },
    Settle {
        dt: i64,
        back: usize,
        cost: u64,
    },
    Release {
        dt: i64,
        back: usize,
    },
    /// New parameters (a lease of `ms` falling to `floor` slots, or none) for one limit.
    Set {
        limit: usize,
        slots: u64,
        lease: Option<(u64, u64)>,
    },
    /// One limit's parameters and slots removed (clear_params).
    Clear {
        limit: usize,
    },
    InFlight {
        dt: i64,
        limit: usize,
    },
    Collect,
}

fn slot_steps(n: usize) -> impl Strategy<Value = Vec<SlotStep>> {
    let dt = prop_oneof![
        8 => 0i64..=3_000,
        2 => 0i64..=40_000,
        1 => 590_000i64..=700_000,
        1 => -500i64..=0,
    ];
    let back = 0usize..4;
    let take = (
        dt.clone(),
        0..n,
        prop_oneof![4 => Just(None), 1 => back.clone().prop_map(Some)],
        prop_oneof![3 => 1u64..=30_000, 1 => 1u64..=600_000],
    )
        .prop_map(|(dt, limit, reuse, ttl_ms)| SlotStep::Take {
            dt,
            limit,
            reuse,
            ttl_ms,
        });
    let retry = (dt.clone(), back.clone()).prop_map(|(dt, back)| SlotStep::Retry { dt, back });
    let settle = (dt.clone(), back.clone(), 0u64..=50)
        .prop_map(|(dt, back, cost)| SlotStep::Settle { dt, back, cost });
    let release = (dt.clone(), back).prop_map(|(dt, back)| SlotStep::Release { dt, back });
    let set = (
        0..n,
        0u64..=6,
        proptest::option::of((1u64..=20_000, 0u64..=3)),
    )
        .prop_map(|(limit, slots, lease)| SlotStep::Set {
            limit,
            slots,
            lease,
        });
    let in_flight = (dt, 0..n).prop_map(|(dt, limit)| SlotStep::InFlight { dt, limit });
    proptest::collection::vec(
        prop_oneof![
            8 => take,
            2 => retry,
            3 => settle,
            3 => release,
            2 => set,
            1 => (0..n).prop_map(|limit| SlotStep::Clear { limit }),
            1 => in_flight,
            1 => Just(SlotStep::Collect),
        ],
        1..80,
    )
}

/// A stored concurrency limit with its lease end and floor, if any.
type StoredSlots = (u64, Option<(u64, u64)>);

/// Concurrency limits taken with holds: `lua/hold.lua` and `lua/settle.lua` on a sorted set of
/// slots (through the Redis store) and the embedded store against `quota_core::slots` and
/// `quota_core::hold`: every decision, answer, slot set (ids and expiries), count in flight and
/// usage, equal; with parameters written with and without lease ends (the floor takes over at
/// the end while the holders keep their slots) and cleared.
fn run_slots(
    rt: &tokio::runtime::Runtime,
    redis: &RedisStore,
    conn: &mut redis::Connection,
    start: u64,
    fallbacks: &[u64],
    steps: &[SlotStep],
) -> Result<(), TestCaseError> {
    use quota_core::hold::{self, BucketResult, Create, Finish, HoldRecord, Verdict};
    use quota_core::slots::Slots;
    use quota_core::PolicyName;
    use quota_store::{
        BucketRef, HoldLimit, HoldOutcome, HoldRequest, ReleaseRequest, SettleRequest, Settled,
        SettledLimit, StoreError,
    };
    use std::collections::HashMap;
    rt.block_on(async {
        let embedded = EmbeddedStore::new().with_min_idle_ttl(MULTI_IDLE_TTL_MS);
        let tenant = common::fresh_bucket("slots").tenant;
        let limits: Vec<BucketRef> = (0..fallbacks.len())
            .map(|i| BucketRef {
                tenant: tenant.clone(),
                policy: PolicyName::new(format!("c{i}")).unwrap(),
                version: 1,
            })
            .collect();
        let mut stored: Vec<Option<StoredSlots>> = vec![None; fallbacks.len()];
        let in_force = |stored: &Option<StoredSlots>, k: usize, now: u64| match *stored
        {
            Some((_, Some((end, floor)))) if now >= end => floor,
            Some((l, _)) => l,
            None => fallbacks[k],
        };
        let mut slots: Vec<Slots> = vec![Slots::default(); fallbacks.len()];
        let mut usage: Vec<(u64, u64)> = vec![(0, 0); fallbacks.len()];
        let mut records: HashMap<String, HoldRecord<usize>> = HashMap::new();
        let mut asked: HashMap<String, HoldRequest> = HashMap::new();
        let mut ids: Vec<String> = Vec::new();
        let id_back = |ids: &[String], back: usize| -> String {
            ids.len()
                .checked_sub(back + 1)
                .map_or_else(|| "never".to_string(), |k| ids[k].clone())
        };
        let mut now = start;
        for (i, step) in steps.iter().enumerate() {
            match *step {
                SlotStep::Take { dt, .. } | SlotStep::Retry { dt, .. } => {
                    now = now.saturating_add_signed(dt);
                    let req = match *step {
                        SlotStep::Take {
                            limit,
                            reuse,
                            ttl_ms,
                            ..
                        } => {
                            let id = match reuse {
                                None => {
                                    ids.push(format!("s{}", ids.len()));
                                    id_back(&ids, 0)
                                }
                                Some(back) => id_back(&ids, back),
                            };
                            HoldRequest {
                                id,
                                limits: vec![HoldLimit {
                                    bucket: limits[limit].clone(),
                                    limit: Limit::Concurrency {
                                        limit: fallbacks[limit],
                                    },
                                    debt_limit_ut: 0,
                                }],
                                cost: 1,
                                ttl_ms,
                                now_ms: Some(now),
                            }
                        }
                        SlotStep::Retry { back, .. } => match asked.get(&id_back(&ids, back)) {
                            Some(r) => HoldRequest {
                                now_ms: Some(now),
                                ..r.clone()
                            },
                            None => continue,
                        },
                        _ => unreachable!(),
                    };
                    asked.insert(req.id.clone(), req.clone());
                    let k = limits.iter().position(|b| *b == req.limits[0].bucket).unwrap();
                    let limit = in_force(&stored[k], k, now);
                    let want = match hold::create(now, records.get(&req.id), &[k], 1, req.ttl_ms)
                    {
                        Create::Refused => None,
                        Create::Replay { expires_at_ms } => {
                            REPLAYED_SLOTS.set(REPLAYED_SLOTS.get() + 1);
                            Some(HoldOutcome {
                                decisions: vec![slots[k].peek(now, limit)],
                                held: true,
                                expires_at_ms,
                                replayed: true,
                            })
                        }
                        Create::Fresh => {
                            let expires = now + req.ttl_ms;
                            let d = slots[k].acquire(now, limit, &req.id, expires);
                            if d.allowed {
                                usage[k].0 += 1;
                                TAKEN.set(TAKEN.get() + 1);
                                records.insert(
                                    req.id.clone(),
                                    HoldRecord::open(now, vec![k], 1, req.ttl_ms),
                                );
                            } else {
                                usage[k].1 += 1;
                                let (full, floor) = FULL.get();
                                let below = stored[k].is_some_and(|(l, _)| limit < l);
                                FULL.set((full + 1, floor + u64::from(below)));
                            }
                            Some(HoldOutcome {
                                decisions: vec![d],
                                held: d.allowed,
                                expires_at_ms: expires,
                                replayed: false,
                            })
                        }
                    };
                    let got = redis.hold(&req).await;
                    let emb = embedded.hold(&req).await;
                    match want {
                        Some(w) => {
                            prop_assert_eq!(got.as_ref().ok(), Some(&w), "Lua, step {}: {:?}", i, got);
                            prop_assert_eq!(emb.as_ref().ok(), Some(&w), "embedded, step {}", i);
                        }
                        None => {
                            for r in [&got, &emb] {
                                prop_assert!(
                                    matches!(r, Err(StoreError::Rejected { reason }) if reason.contains("hold id")),
                                    "step {}: {:?}",
                                    i,
                                    r
                                );
                            }
                        }
                    }
                }
                SlotStep::Settle { dt, back, .. } | SlotStep::Release { dt, back } => {
                    now = now.saturating_add_signed(dt);
                    let key = id_back(&ids, back);
                    let what = match *step {
                        SlotStep::Settle { cost, .. } => Finish::Settle { actual: cost },
                        _ => Finish::Release,
                    };
                    let want = match hold::finish(now, records.get(&key), what) {
                        Verdict::Unknown => Settled::Unknown,
                        Verdict::Expired { expired_at_ms } => Settled::Expired { expired_at_ms },
                        Verdict::Conflict(why) => Settled::Conflict(why),
                        Verdict::Replay(results) => Settled::Done {
                            limits: vec![SettledLimit::of(
                                limits[records[&key].limits[0]].clone(),
                                results[0],
                            )],
                            replayed: true,
                        },
                        Verdict::Apply => {
                            let r = records.remove(&key).unwrap();
                            let k = r.limits[0];
                            slots[k].release(&key);
                            let free = in_force(&stored[k], k, now).saturating_sub(slots[k].live(now));
                            let result = BucketResult::slot_freed(free);
                            records.insert(key.clone(), r.ended(now, what, vec![result]));
                            FREED.set(FREED.get() + 1);
                            Settled::Done {
                                limits: vec![SettledLimit::of(limits[k].clone(), result)],
                                replayed: false,
                            }
                        }
                    };
                    let (got, emb) = match what {
                        Finish::Settle { actual } => {
                            let r = SettleRequest {
                                tenant: tenant.clone(),
                                id: key.clone(),
                                cost: actual,
                                now_ms: Some(now),
                            };
                            (redis.settle(&r).await, embedded.settle(&r).await)
                        }
                        Finish::Release => {
                            let r = ReleaseRequest {
                                tenant: tenant.clone(),
                                id: key.clone(),
                                now_ms: Some(now),
                            };
                            (redis.release(&r).await, embedded.release(&r).await)
                        }
                    };
                    prop_assert_eq!(got.as_ref().ok(), Some(&want), "Lua, step {}: {:?}", i, got);
                    prop_assert_eq!(emb.as_ref().ok(), Some(&want), "embedded, step {}", i);
                }
                SlotStep::Set {
                    limit: k,
                    slots: l,
                    lease,
                } => {
                    let mut s = SetParams::new(limits[k].clone(), Limit::Concurrency { limit: l })
                        .at(now);
                    if let Some((ms, floor)) = lease {
                        s = s.with_lease(ms, Limit::Concurrency { limit: floor });
                    }
                    redis.set_params(&s).await.unwrap();
                    embedded.set_params(&s).await.unwrap();
                    stored[k] = Some((l, lease.map(|(ms, floor)| (now + ms, floor))));
                }
                SlotStep::Clear { limit: k } => {
                    redis.clear_params(&limits[k]).await.unwrap();
                    embedded.clear_params(&limits[k]).await.unwrap();
                    stored[k] = None;
                    slots[k] = Slots::default();
                    usage[k] = (0, 0);
                }
                SlotStep::InFlight { dt, limit: k } => {
                    now = now.saturating_add_signed(dt);
                    let want = slots[k].live(now);
                    prop_assert_eq!(redis.in_flight(&limits[k], Some(now)).await.unwrap(), want);
                    prop_assert_eq!(embedded.in_flight(&limits[k], Some(now)).await.unwrap(), want);
                }
                SlotStep::Collect => {
                    let mine = |v: Vec<UsageRecord>| -> Vec<UsageRecord> {
                        let mut v: Vec<_> = v
                            .into_iter()
                            .filter(|u| u.bucket.tenant == tenant)
                            .collect();
                        v.sort_by(|a, b| a.bucket.cmp(&b.bucket));
                        v
                    };
                    let want: Vec<UsageRecord> = limits
                        .iter()
                        .zip(&mut usage)
                        .filter_map(|(b, u)| {
                            let (admitted, denied) = std::mem::take(u);
                            (admitted + denied > 0).then(|| UsageRecord {
                                bucket: b.clone(),
                                admitted,
                                denied,
                            })
                        })
                        .collect();
                    let emb = mine(embedded.collect_usage(usize::MAX).await.unwrap());
                    let got = mine(redis.collect_usage(usize::MAX).await.unwrap());
                    prop_assert_eq!(&got, &want, "Lua usage at step {}", i);
                    prop_assert_eq!(&emb, &want, "embedded usage at step {}", i);
                }
            }
            // Every limit's slot set (ids and expiries) is the reference's.
            for (k, b) in limits.iter().enumerate() {
                let got: Vec<(String, u64)> = redis::cmd("ZRANGE")
                    .arg(b.state_key(quota_core::keys::StateKind::Slots))
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query(conn)
                    .unwrap();
                let mut want: Vec<(String, u64)> =
                    slots[k].iter().map(|(id, e)| (id.to_string(), e)).collect();
                want.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
                prop_assert_eq!(got, want, "limit {} slots at step {}", k, i);
            }
        }
        Ok(())
    })
}

thread_local! {
    /// Slots taken, acquisitions denied (of them under a floor below the stored limit), holds
    /// answered again, and slots freed by a settle or release, by the concurrency comparison.
    static TAKEN: Cell<u64> = const { Cell::new(0) };
    static FULL: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    static REPLAYED_SLOTS: Cell<u64> = const { Cell::new(0) };
    static FREED: Cell<u64> = const { Cell::new(0) };
}

#[test]
fn concurrency_limits_match_the_reference_in_lua_and_embedded() {
    let mut cfg = config();
    cfg.cases = cfg.cases.div_ceil(2);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let server = RedisServer::start().unwrap();
    let cfg_redis = quota_store::RedisStoreConfig::standalone(server.url())
        .with_timeout(std::time::Duration::from_secs(5))
        .with_min_idle_ttl(std::time::Duration::from_millis(MULTI_IDLE_TTL_MS));
    let redis = rt.block_on(RedisStore::connect(cfg_redis)).unwrap();
    let conn = RefCell::new(common::sync_conn(&server));
    let mut runner = TestRunner::new(cfg.clone());
    let strategy = (1usize..=2).prop_flat_map(|n| {
        (
            1_600_000_000_000u64..=1_900_000_000_000,
            proptest::collection::vec(0u64..=5, n),
            slot_steps(n),
        )
    });
    let result = runner.run(&strategy, |(start, fallbacks, steps)| {
        run_slots(
            &rt,
            &redis,
            &mut conn.borrow_mut(),
            start,
            &fallbacks,
            &steps,
        )
    });
    if let Err(e) = result {
        panic!(
            "{e}\nreproduce: PROPTEST_RNG_SEED={:?} cargo test -p quota-store --test differential",
            cfg.rng_seed
        );
    }
    let (full, under_floor) = FULL.get();
    println!(
        "slots: {} taken, {full} denied ({under_floor} under a floor), {} replayed, {} freed \
         over {} cases",
        TAKEN.get(),
        REPLAYED_SLOTS.get(),
        FREED.get(),
        cfg.cases
    );
    if cfg.cases >= 100 {
        assert!(TAKEN.get() > 500 && full > 200 && under_floor > 20 && FREED.get() > 200);
        assert!(REPLAYED_SLOTS.get() > 20);
    }
}

/// The floor of a concurrency limit after its lease end, on both stores: 3 slots taken under a
/// limit of 3; from the lease end on the floor of 1 is in force, the three holders keep their
/// slots, and a new one waits until fewer than 1 are live: two expiries or releases are not
/// enough, the third is.
#[test]
fn a_lease_end_drops_a_concurrency_limit_to_its_floor_and_holders_keep_their_slots() {
    use quota_store::{HoldLimit, HoldRequest, ReleaseRequest, Settled};
    async fn run<S: Store>(s: &S) {
        let b = common::fresh_bucket("floor");
        let t0 = 1_700_000_000_000;
        let p = SetParams::new(b.clone(), Limit::Concurrency { limit: 3 })
            .with_lease(10_000, Limit::Concurrency { limit: 1 })
            .at(t0);
        s.set_params(&p).await.unwrap();
        let take = |id: &str, ttl_ms: u64, now: u64| HoldRequest {
            id: id.into(),
            limits: vec![HoldLimit {
                bucket: b.clone(),
                limit: Limit::Concurrency { limit: 9 },
                debt_limit_ut: 0,
            }],
            cost: 1,
            ttl_ms,
            now_ms: Some(now),
        };
        for (i, ttl) in [(0, 20_000), (1, 30_000), (2, 40_000)] {
            let o = s.hold(&take(&format!("h{i}"), ttl, t0)).await.unwrap();
            assert!(o.held, "{o:?}");
            assert_eq!(o.decisions[0].remaining, 2 - i);
        }
        let full = s.hold(&take("x", 1000, t0 + 1)).await.unwrap();
        assert!(!full.held);
        // From the lease end: still 3 in flight; one more needs all three gone (h2 at 40 s).
        let at_end = t0 + 10_000;
        assert_eq!(s.in_flight(&b, Some(at_end)).await.unwrap(), 3);
        let d = s.hold(&take("x", 1000, at_end)).await.unwrap().decisions[0];
        assert_eq!(
            (d.allowed, d.remaining, d.retry_after_ms, d.reset_ms),
            (false, 0, Some(30_000), Some(30_000))
        );
        // h0 expires at 20 s, h1 is released: h2 still holds the floor's one slot.
        let released = s
            .release(&ReleaseRequest {
                tenant: b.tenant.clone(),
                id: "h1".into(),
                now_ms: Some(t0 + 21_000),
            })
            .await
            .unwrap();
        let Settled::Done { limits, .. } = released else {
            panic!("{released:?}")
        };
        assert_eq!((limits[0].refunded, limits[0].remaining), (1, 0));
        assert!(!s.hold(&take("x", 1000, t0 + 21_000)).await.unwrap().held);
        assert_eq!(s.in_flight(&b, Some(t0 + 21_000)).await.unwrap(), 1);
        // h2 expires at 40 s: the slot comes back by itself.
        let o = s.hold(&take("x", 1000, t0 + 40_000)).await.unwrap();
        assert!(o.held && o.decisions[0].remaining == 0, "{o:?}");
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let server = RedisServer::start().unwrap();
    rt.block_on(async {
        run(&common::store(&server).await).await;
        run(&EmbeddedStore::new()).await;
    });
}

/// Concurrency parameters are written as the others: fenced (a lower fence refused, nothing
/// changed), listed, and cleared with the slots they count; both stores alike.
#[test]
fn concurrency_parameters_are_fenced_listed_and_cleared_alike() {
    use quota_store::{Fence, HoldLimit, HoldRequest, StoreError};
    async fn run<S: Store>(s: &S) {
        let b = common::fresh_bucket("fenced-slots");
        let now = 1_700_000_000_000;
        let limit = |l| Limit::Concurrency { limit: l };
        let fence = |token, epoch| Fence { token, epoch };
        s.set_params(
            &SetParams::new(b.clone(), limit(2))
                .fenced(fence(5, 3))
                .at(now),
        )
        .await
        .unwrap();
        for f in [fence(4, 9), fence(5, 2)] {
            let e = s
                .set_params(&SetParams::new(b.clone(), limit(1)).fenced(f).at(now))
                .await
                .unwrap_err();
            assert!(matches!(e, StoreError::Fenced { .. }), "{e}");
        }
        let e = s
            .set_params(&SetParams::new(b.clone(), limit(1)).at(now))
            .await
            .unwrap_err();
        assert!(matches!(e, StoreError::Fenced { .. }), "{e}");
        assert!(s.list_params().await.unwrap().contains(&b));
        // The stored 2, not the fallback 9, nor a refused 1.
        let take = |id: &str| HoldRequest {
            id: id.into(),
            limits: vec![HoldLimit {
                bucket: b.clone(),
                limit: limit(9),
                debt_limit_ut: 0,
            }],
            cost: 1,
            ttl_ms: 60_000,
            now_ms: Some(now),
        };
        assert!(s.hold(&take("a")).await.unwrap().held);
        assert!(s.hold(&take("b")).await.unwrap().held);
        assert!(!s.hold(&take("c")).await.unwrap().held);
        // Cleared: no parameters, no slots; the fallback's 9 in force again.
        s.clear_params(&b).await.unwrap();
        assert!(!s.list_params().await.unwrap().contains(&b));
        assert_eq!(s.in_flight(&b, Some(now)).await.unwrap(), 0);
        let o = s.hold(&take("c")).await.unwrap();
        assert!(o.held && o.decisions[0].remaining == 8, "{o:?}");
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let server = RedisServer::start().unwrap();
    rt.block_on(async {
        run(&common::store(&server).await).await;
        run(&EmbeddedStore::new()).await;
    });
}
