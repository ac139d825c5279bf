//! Bad input: every invalid script argument gets a Redis error reply `ERR quotad: …` (never a
//! Lua runtime error, never a silent default), checked by calling EVAL directly; and invalid
//! requests are rejected in Rust before any Redis call.

mod common;

use common::{fresh_bucket, req, tokens};
use quota_core::BucketParams;
use quota_store::script::{
    CHARGE_LUA, COLLECT_USAGE_LUA, REFUND_LUA, SET_PARAMS_LUA, SLIDING_WINDOW_LUA,
    TOKEN_BUCKETS_LUA, TOKEN_BUCKET_LUA,
};
use quota_store::{ChargeRequest, Limit, SetParams, Store, StoreError};
use redis_harness::RedisServer;

const B: &str = "qd:v1:{bad}:x:1:b";
const P: &str = "qd:v1:{bad}:x:1:p";
const IX: &str = "qd:v1:active";

fn eval(
    conn: &mut redis::Connection,
    src: &str,
    keys: &[&str],
    args: &[&str],
) -> redis::RedisResult<redis::Value> {
    let mut c = redis::cmd("EVAL");
    c.arg(src).arg(keys.len());
    for k in keys {
        c.arg(*k);
    }
    for a in args {
        c.arg(*a);
    }
    c.query(conn)
}

/// Asserts that the call is answered with the script's own error reply.
fn assert_quotad_error(r: redis::RedisResult<redis::Value>, case: &str) {
    let e = match r {
        Err(e) => e,
        Ok(v) => panic!("{case}: expected an error reply, got {v:?}"),
    };
    assert_eq!(e.code(), Some("ERR"), "{case}: {e}");
    let detail = e.detail().unwrap_or_default();
    assert!(detail.starts_with("quotad: "), "{case}: {e}");
    // A Lua runtime error would mention the script and a line.
    assert!(!e.to_string().contains("user_script"), "{case}: {e}");
}

#[test]
fn token_bucket_rejects_every_bad_argument() {
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    let cases: &[(&str, &[&str])] = &[
        ("empty cost", &["", "1000000", "1000", ""]),
        ("negative cost", &["-1", "1000000", "1000", ""]),
        ("float cost", &["1.5", "1000000", "1000", ""]),
        ("exponent cost", &["1e3", "1000000", "1000", ""]),
        ("hex cost", &["0x10", "1000000", "1000", ""]),
        ("spaced cost", &[" 1", "1000000", "1000", ""]),
        ("cost above max", &["9007199255", "1000000", "1000", ""]),
        (
            "huge cost",
            &["99999999999999999999", "1000000", "1000", ""],
        ),
        ("float capacity", &["1", "1.5", "1000", ""]),
        ("negative capacity", &["1", "-1", "1000", ""]),
        (
            "capacity above 2^53",
            &["1", "9007199254740992", "1000", ""],
        ),
        ("float rate", &["1", "1000000", "0.5", ""]),
        ("rate above 2^53", &["1", "1000000", "9007199254740992", ""]),
        ("fill time too long", &["1", "9007199254740991", "1", ""]),
        // floor(cap / rate) * period = MAX_FILL exactly: just out of bounds.
        (
            "fill time at the bound",
            &["1", "9000000000000", "1000", ""],
        ),
        ("capacity without rate", &["1", "1000000", "", ""]),
        ("rate without capacity", &["1", "", "1000", ""]),
        ("no params at all", &["1", "", "", ""]),
        ("float now", &["1", "1000000", "1000", "1.5"]),
        ("negative now", &["1", "1000000", "1000", "-5"]),
        ("text now", &["1", "1000000", "1000", "soon"]),
        (
            "now above 2^53",
            &["1", "1000000", "1000", "9007199254740992"],
        ),
        ("zero min ttl", &["1", "1000000", "1000", "5", "0"]),
        ("float min ttl", &["1", "1000000", "1000", "5", "1.5"]),
        ("negative min ttl", &["1", "1000000", "1000", "5", "-1"]),
        ("text min ttl", &["1", "1000000", "1000", "5", "long"]),
        (
            "huge min ttl",
            &["1", "1000000", "1000", "5", "99999999999999999999"],
        ),
        ("too few arguments", &["1", "1000000"]),
        ("zero period", &["1", "1000000", "1000", "5", "", "0"]),
        ("float period", &["1", "1000000", "1000", "5", "", "1.5"]),
        (
            "period above 31 days",
            &["1", "1000000", "1000", "5", "", "2678400001"],
        ),
        ("period without fallback", &["1", "", "", "5", "", "1000"]),
        (
            "fill time at the bound over a day",
            &["1", "104167", "1", "5", "", "86400000"],
        ),
        (
            "too many arguments",
            &["1", "1000000", "1000", "5", "6", "7", "8", "9"],
        ),
        (
            "zero batch",
            &["1", "1000000", "1000", "5", "", "1000", "0"],
        ),
        (
            "empty batch",
            &["1", "1000000", "1000", "5", "", "1000", ""],
        ),
        (
            "float batch",
            &["1", "1000000", "1000", "5", "", "1000", "1.5"],
        ),
        (
            "negative batch",
            &["1", "1000000", "1000", "5", "", "1000", "-2"],
        ),
        (
            "cost times batch above max",
            &["3", "1000000", "1000", "5", "", "1000", "3002399752"],
        ),
    ];
    for (case, args) in cases {
        assert_quotad_error(eval(&mut c, TOKEN_BUCKET_LUA, &[B, P, IX], args), case);
    }
    assert_quotad_error(
        eval(&mut c, TOKEN_BUCKET_LUA, &[B, P], &["1", "1", "1", ""]),
        "two keys",
    );
    // Nothing was written by any rejected call.
    let n: u64 = redis::cmd("DBSIZE").query(&mut c).unwrap();
    assert_eq!(n, 0);
    // A state value that is not the 64-byte packed layout (written by something else) is an
    // error reply, not a Lua runtime error, and is left as it was.
    let _: () = redis::cmd("SET")
        .arg(B)
        .arg("garbage")
        .query(&mut c)
        .unwrap();
    assert_quotad_error(
        eval(
            &mut c,
            TOKEN_BUCKET_LUA,
            &[B, P, IX],
            &["1", "1000000", "1000", "5"],
        ),
        "malformed state",
    );
    let kept: String = redis::cmd("GET").arg(B).query(&mut c).unwrap();
    assert_eq!(kept, "garbage");
    let _: () = redis::cmd("DEL").arg(B).query(&mut c).unwrap();
    // Just inside the fill-time bound is accepted, as BucketParams::new accepts it.
    assert!(quota_core::BucketParams::new(8_999_999_999_999, 1000).is_ok());
    let ok = eval(
        &mut c,
        TOKEN_BUCKET_LUA,
        &[B, P, IX],
        &["1", "8999999999999", "1000", "5"],
    );
    assert!(ok.is_ok(), "{ok:?}");
    let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
    // A minimum idle TTL is accepted.
    let ok = eval(
        &mut c,
        TOKEN_BUCKET_LUA,
        &[B, P, IX],
        &["1", "8999999999999", "1000", "5", "1"],
    );
    assert!(ok.is_ok(), "{ok:?}");
    let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
    // Stored parameters are validated too (read when the bucket does not exist).
    for (cap, rate) in [
        ("abc", "1"),
        ("1", "1.5"),
        ("9007199254740992", "1"),
        ("", ""),
    ] {
        let _: () = redis::cmd("HSET")
            .arg(P)
            .arg("cap")
            .arg(cap)
            .arg("rate")
            .arg(rate)
            .query(&mut c)
            .unwrap();
        let r = eval(
            &mut c,
            TOKEN_BUCKET_LUA,
            &[B, P, IX],
            &["1", "1000000", "1000", ""],
        );
        assert_quotad_error(r, &format!("stored {cap:?}/{rate:?}"));
    }
}

/// `token_bucket.lua` compares the values a daemon sends on most calls (cost and batch `1`,
/// the default minimum TTL `60000`, the period `1000`) as strings before parsing: the same
/// numbers spelled otherwise (leading zeros) must decide, write and expire alike.
#[test]
fn common_argument_values_decide_as_their_other_spellings() {
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    let (b2, p2) = ("qd:v1:{bad}:y:1:b", "qd:v1:{bad}:y:1:p");
    // Cost 1 then 3 (denied), batches of 1 and 5, across refills that leave a carry.
    let calls: &[(&str, &str, &str)] = &[
        ("1000", "1", "1"),
        ("1001", "1", "5"),
        ("1003", "3", "1"),
        ("1010", "1", "1"),
        ("1500", "1", "5"),
    ];
    for (now, cost, batch) in calls {
        let zero = |s: &str| format!("0{s}");
        let usual = eval(
            &mut c,
            TOKEN_BUCKET_LUA,
            &[B, P, IX],
            &[cost, "5000000", "1234567", now, "60000", "1000", batch],
        )
        .unwrap();
        let (cost0, batch0) = (zero(cost), zero(batch));
        let other = eval(
            &mut c,
            TOKEN_BUCKET_LUA,
            &[b2, p2, IX],
            &[
                &cost0, "5000000", "1234567", now, "060000", "01000", &batch0,
            ],
        )
        .unwrap();
        assert_eq!(usual, other, "now {now}, cost {cost}, batch {batch}");
        let states: Vec<Vec<u8>> = [B, b2]
            .iter()
            .map(|k| redis::cmd("GET").arg(*k).query(&mut c).unwrap())
            .collect();
        assert_eq!(states[0], states[1], "state after now {now}");
        for k in [B, b2] {
            let pttl: i64 = redis::cmd("PTTL").arg(k).query(&mut c).unwrap();
            assert!((59_000..=60_000).contains(&pttl), "{k}: pttl {pttl}");
        }
    }
    // The period 1000 is the default: given or not, the same state.
    let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
    for (key, per) in [(B, Some("1000")), (b2, None)] {
        let mut args = vec!["2", "5000000", "1234567", "77", "60000"];
        args.extend(per);
        eval(&mut c, TOKEN_BUCKET_LUA, &[key, P, IX], &args).unwrap();
    }
    let a: Vec<u8> = redis::cmd("GET").arg(B).query(&mut c).unwrap();
    let b: Vec<u8> = redis::cmd("GET").arg(b2).query(&mut c).unwrap();
    assert_eq!(a, b);
}

/// `token_buckets.lua` compares keys pairwise up to 4 limits and through a set beyond: at every
/// number of limits, any repeated key is refused and nothing is written.
#[test]
fn token_buckets_refuses_a_repeated_key_at_every_number_of_limits() {
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    for n in 1..=16usize {
        let mut keys: Vec<String> = (0..n)
            .flat_map(|i| {
                [
                    format!("qd:v1:{{rep}}:l{i}:1:b"),
                    format!("qd:v1:{{rep}}:l{i}:1:p"),
                ]
            })
            .collect();
        keys.push("qd:v1:{rep}:ix".into());
        let mut args = vec!["1".to_string(), "77".into(), "".into()];
        for _ in 0..n {
            args.extend(["5000000".into(), "1000".into(), "".into()]);
        }
        let call = |c: &mut redis::Connection, keys: &[String]| {
            let k: Vec<&str> = keys.iter().map(String::as_str).collect();
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            eval(c, TOKEN_BUCKETS_LUA, &k, &a)
        };
        // Every pair of positions, the index included.
        for i in 0..keys.len() {
            for j in i + 1..keys.len() {
                let mut bad = keys.clone();
                bad[j] = bad[i].clone();
                assert_quotad_error(
                    call(&mut c, &bad),
                    &format!("{n} limits, key {j} = key {i}"),
                );
            }
        }
        let size: u64 = redis::cmd("DBSIZE").query(&mut c).unwrap();
        assert_eq!(size, 0, "{n} limits: a refused call wrote");
        match call(&mut c, &keys).unwrap() {
            redis::Value::Array(v) => assert_eq!(v.len(), 4 * n),
            v => panic!("{n} limits: {v:?}"),
        }
        let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
    }
}

#[test]
fn sliding_window_rejects_every_bad_argument() {
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    let w = "qd:v1:{bad}:x:1:w";
    let cases: &[(&str, &[&str])] = &[
        ("float cost", &["2.0", "5", "1000", ""]),
        ("float limit", &["1", "5.5", "1000", ""]),
        ("limit above max", &["1", "1000000001", "1000", ""]),
        ("zero window", &["1", "5", "0", ""]),
        ("window above max", &["1", "5", "2678400001", ""]),
        ("product too large", &["1", "1000000000", "604800000", ""]),
        ("limit without window", &["1", "5", "", ""]),
        ("no params", &["1", "", "", ""]),
        ("float now", &["1", "5", "1000", "1e3"]),
        ("zero min ttl", &["1", "5", "1000", "1", "0"]),
        ("float min ttl", &["1", "5", "1000", "1", "2.5"]),
        ("too many", &["1", "5", "1000", "1", "2", "3"]),
    ];
    for (case, args) in cases {
        assert_quotad_error(eval(&mut c, SLIDING_WINDOW_LUA, &[w, P, IX], args), case);
    }
    let _: () = redis::cmd("HSET")
        .arg(P)
        .arg("limit")
        .arg("-3")
        .arg("window")
        .arg("10")
        .query(&mut c)
        .unwrap();
    let r = eval(
        &mut c,
        SLIDING_WINDOW_LUA,
        &[w, P, IX],
        &["1", "5", "1000", ""],
    );
    assert_quotad_error(r, "stored negative limit");
}

#[test]
fn set_params_rejects_bad_arguments() {
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    let cases: &[(&str, &[&str])] = &[
        ("unknown fields", &["cap", "1", "window", "1"]),
        ("float cap", &["cap", "1.5", "rate", "1"]),
        ("empty rate", &["cap", "1", "rate", ""]),
        ("cap above 2^53", &["cap", "9007199254740992", "rate", "1"]),
        (
            "fill time too long",
            &["cap", "9007199254740991", "rate", "1"],
        ),
        ("bad min ttl", &["cap", "1", "rate", "1", "0"]),
        ("too few", &["cap", "1", "rate"]),
        (
            "lease without floor",
            &["cap", "1", "rate", "1", "", "1000"],
        ),
        (
            "floor without lease",
            &["cap", "1", "rate", "1", "", "", "1", "1"],
        ),
        (
            "negative lease",
            &["cap", "1", "rate", "1", "", "-5", "1", "1"],
        ),
        (
            "floor out of bounds",
            &["cap", "1", "rate", "1", "", "1000", "9007199254740992", "1"],
        ),
        (
            "float now",
            &["cap", "1", "rate", "1", "", "", "", "", "1.5"],
        ),
        (
            "lease ends beyond 2^53",
            &[
                "cap",
                "1",
                "rate",
                "1",
                "",
                "9007199254740991",
                "1",
                "1",
                "5",
            ],
        ),
        (
            "zero period",
            &["cap", "1", "rate", "1", "", "", "", "", "", "0"],
        ),
        (
            "period above 31 days",
            &["cap", "1", "rate", "1", "", "", "", "", "", "2678400001"],
        ),
        (
            "period of a window",
            &["limit", "1", "window", "1", "", "", "", "", "", "1000"],
        ),
        (
            "latest lease end without a lease",
            &["cap", "1", "rate", "1", "", "", "", "", "", "", "5000"],
        ),
        (
            "float latest lease end",
            &["cap", "1", "rate", "1", "", "1000", "1", "1", "", "", "5.5"],
        ),
        (
            "negative latest lease end",
            &["cap", "1", "rate", "1", "", "1000", "1", "1", "", "", "-1"],
        ),
        (
            "latest lease end above 2^53",
            &[
                "cap",
                "1",
                "rate",
                "1",
                "",
                "1000",
                "1",
                "1",
                "",
                "",
                "9007199254740992",
            ],
        ),
        (
            "latest lease end in hex",
            &[
                "cap", "1", "rate", "1", "", "1000", "1", "1", "", "", "0x10",
            ],
        ),
        (
            "too many",
            &["cap", "1", "rate", "1", "", "", "", "", "", "1000", "", "x"],
        ),
    ];
    for (case, args) in cases {
        assert_quotad_error(eval(&mut c, SET_PARAMS_LUA, &[P, B], args), case);
    }
    let n: u64 = redis::cmd("DBSIZE").query(&mut c).unwrap();
    assert_eq!(n, 0);
}

#[test]
fn refund_rejects_bad_arguments_and_writes_nothing() {
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    // A live state to refund into: one decision.
    let _: redis::Value = eval(
        &mut c,
        TOKEN_BUCKET_LUA,
        &[B, P, IX],
        &["1", "5000000", "1000000", "5"],
    )
    .unwrap();
    let before = dumps(&mut c, &[B]);
    let cases: &[(&str, &[&str])] = &[
        ("no arguments", &[]),
        ("zero tokens", &["0"]),
        ("negative tokens", &["-1"]),
        ("float tokens", &["1.5"]),
        ("tokens above max", &["9007199255"]),
        ("bad now", &["1", "soon"]),
        ("too many arguments", &["1", "5", "6"]),
    ];
    for (case, args) in cases {
        assert_quotad_error(eval(&mut c, REFUND_LUA, &[B], args), case);
    }
    assert_quotad_error(
        eval(&mut c, REFUND_LUA, &[B, "qd:v1:{t}:x:1:b:r:1", P], &["1"]),
        "three keys",
    );
    let _: () = redis::cmd("HSET")
        .arg("qd:v1:{bad}:y:1:b")
        .arg("f")
        .arg("v")
        .query(&mut c)
        .unwrap();
    assert_quotad_error(
        eval(&mut c, REFUND_LUA, &["qd:v1:{bad}:y:1:b"], &["1"]),
        "a hash",
    );
    let _: () = redis::cmd("SET")
        .arg(P)
        .arg("garbage")
        .query(&mut c)
        .unwrap();
    assert_quotad_error(eval(&mut c, REFUND_LUA, &[P], &["1"]), "not a state");
    assert_eq!(
        dumps(&mut c, &[B]),
        before,
        "a rejected refund wrote nothing"
    );
    // A missing state is a full bucket: nothing to do.
    let none: i64 = redis::cmd("EVAL")
        .arg(REFUND_LUA)
        .arg(1)
        .arg("qd:v1:{bad}:z:1:b")
        .arg(1)
        .query(&mut c)
        .unwrap();
    assert_eq!(none, -1);
}

#[test]
fn charge_rejects_bad_arguments_and_writes_nothing() {
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    let m = "qd:v1:{bad}:x:1:b:g:1";
    let all = [B, P, IX, m];
    // A bucket of 5 charged 2 (the fallback's copy in its state).
    let fallback = ["5000000", "1000000"];
    let args = |cost: &'static str, limit: &'static str| -> Vec<&'static str> {
        vec![cost, limit, fallback[0], fallback[1]]
    };
    let at = |mut a: Vec<&'static str>| {
        a.push("1700000000000");
        a
    };
    let r = eval(&mut c, CHARGE_LUA, &[B, P, IX], &at(args("2", "0"))).unwrap();
    assert_eq!(
        r,
        redis::Value::Array([2, 0, 3, 0, 0, 2000].map(redis::Value::Int).to_vec())
    );
    let before = dumps(&mut c, &all);
    let cases: &[(&str, Vec<&str>)] = &[
        ("no arguments", vec![]),
        ("three arguments", vec!["1", "0", "5000000"]),
        (
            "eight arguments",
            vec!["1", "0", "5000000", "1000000", "", "", "", ""],
        ),
        ("zero cost", args("0", "0")),
        ("negative cost", args("-1", "0")),
        ("float cost", args("1.5", "0")),
        ("cost above max", args("9007199255", "0")),
        ("empty limit", args("1", "")),
        ("negative limit", args("1", "-1")),
        ("float limit", args("1", "0.5")),
        ("exponent limit", args("1", "1e3")),
        ("limit above 2^53", args("1", "9007199254740992")),
        // 2^53 - 1 - 5 000 000 + 1: one past what a capacity of 5 tokens takes.
        (
            "limit too large for the capacity",
            args("1", "9007199249740992"),
        ),
        ("bad now", vec!["1", "0", fallback[0], fallback[1], "soon"]),
        (
            "zero minimum TTL",
            vec!["1", "0", fallback[0], fallback[1], "", "0"],
        ),
        (
            "zero period",
            vec!["1", "0", fallback[0], fallback[1], "", "", "0"],
        ),
        (
            "fallback out of bounds",
            vec!["1", "0", "9007199254740992", "1"],
        ),
    ];
    for (case, a) in cases {
        assert_quotad_error(eval(&mut c, CHARGE_LUA, &[B, P, IX], a), case);
    }
    for keys in [
        &[B, P][..],
        &[B, P, IX, m, "qd:v1:{bad}:x:1:b:g:2"][..],
        &[B, B, IX][..],
        &[B, P, B][..],
        &[B, P, IX, B][..],
        &[B, P, IX, IX][..],
    ] {
        assert_quotad_error(
            eval(&mut c, CHARGE_LUA, keys, &args("1", "0")),
            &format!("keys {keys:?}"),
        );
    }
    // A marker of another type, of other content, or of another cost.
    let cmd = |c: &mut redis::Connection, args: &[&str]| {
        let mut q = redis::cmd(args[0]);
        for a in &args[1..] {
            q.arg(*a);
        }
        let _: redis::Value = q.query(c).unwrap();
    };
    for (case, seed) in [
        ("a hash marker", &["HSET", m, "f", "v"][..]),
        ("a marker of other content", &["SET", m, "x"][..]),
        ("a marker of another cost", &["SET", m, "1:2"][..]),
    ] {
        cmd(&mut c, &["DEL", m]);
        cmd(&mut c, seed);
        let seeded = dumps(&mut c, &all);
        assert_quotad_error(
            eval(&mut c, CHARGE_LUA, &[B, P, IX, m], &args("4", "0")),
            case,
        );
        assert_eq!(dumps(&mut c, &all), seeded, "{case}");
    }
    cmd(&mut c, &["DEL", m]);
    assert_eq!(
        dumps(&mut c, &all),
        before,
        "a rejected charge wrote nothing"
    );
    // A replay answers the first run and writes nothing either.
    cmd(&mut c, &["SET", m, "3:1"]);
    let seeded = dumps(&mut c, &all);
    let r = eval(&mut c, CHARGE_LUA, &[B, P, IX, m], &at(args("4", "0"))).unwrap();
    assert_eq!(
        r,
        redis::Value::Array([3, 1, 3, 0, 0, 2000].map(redis::Value::Int).to_vec())
    );
    assert_eq!(dumps(&mut c, &all), seeded, "a replay wrote nothing");

    // A new bucket: no parameters and no fallback, invalid stored parameters, a state or an
    // index of another type, a debt limit too large for the stored capacity.
    let (b2, p2) = ("qd:v1:{bad}:y:1:b", "qd:v1:{bad}:y:1:p");
    let fresh = [b2, p2, IX];
    assert_quotad_error(
        eval(&mut c, CHARGE_LUA, &fresh, &["1", "0", "", ""]),
        "no parameters",
    );
    assert_quotad_error(
        eval(
            &mut c,
            CHARGE_LUA,
            &fresh,
            &["1", "0", "", "", "", "", "1000"],
        ),
        "a period without a fallback",
    );
    cmd(&mut c, &["HSET", p2, "cap", "garbage", "rate", "1"]);
    assert_quotad_error(
        eval(&mut c, CHARGE_LUA, &fresh, &args("1", "0")),
        "invalid stored parameters",
    );
    cmd(&mut c, &["HSET", p2, "cap", "100000000", "rate", "1"]);
    // Within the fallback's bound (5 tokens), past the stored capacity's (100).
    assert_quotad_error(
        eval(&mut c, CHARGE_LUA, &fresh, &args("1", "9007199249740991")),
        "limit too large for the stored capacity",
    );
    cmd(&mut c, &["RPUSH", b2, "x"]);
    assert_quotad_error(
        eval(&mut c, CHARGE_LUA, &fresh, &args("1", "0")),
        "a list state",
    );
    cmd(&mut c, &["DEL", b2, IX]);
    cmd(&mut c, &["RPUSH", IX, "x"]);
    assert_quotad_error(
        eval(&mut c, CHARGE_LUA, &fresh, &args("1", "0")),
        "a list index",
    );
    let exists: bool = redis::cmd("EXISTS").arg(b2).query(&mut c).unwrap();
    assert!(!exists, "a refused charge made no state");
}

#[test]
fn collect_usage_rejects_bad_max() {
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    for max in ["", "0", "-1", "1.5", "100001", "abc"] {
        assert_quotad_error(eval(&mut c, COLLECT_USAGE_LUA, &[IX], &[max]), max);
    }
    assert_quotad_error(eval(&mut c, COLLECT_USAGE_LUA, &[IX], &[]), "no max");
    let reply = "qd:v1:active:c:1";
    assert_quotad_error(
        eval(&mut c, COLLECT_USAGE_LUA, &[IX, reply, B], &["10"]),
        "three keys",
    );
    // A reply key of another type is refused before anything is taken.
    let _: () = redis::cmd("HSET")
        .arg(reply)
        .arg("f")
        .arg("v")
        .query(&mut c)
        .unwrap();
    assert_quotad_error(
        eval(&mut c, COLLECT_USAGE_LUA, &[IX, reply], &["10"]),
        "a hash as the reply key",
    );
}

#[tokio::test]
async fn invalid_requests_never_reach_redis() {
    let mut server = RedisServer::start().unwrap();
    let store = common::store(&server).await;
    // With the server gone, anything that reached Redis would fail as Unavailable.
    server.stop();
    let b = fresh_bucket("never");
    let out_of_range = BucketParams {
        capacity_ut: 1 << 53,
        ..BucketParams::EMPTY
    };
    let bad = [
        req(&b, tokens(1, 1), u64::MAX, None),
        req(&b, tokens(1, 1), 1, Some(u64::MAX)),
        req(&b, Limit::TokenBucket(out_of_range), 1, None),
        req(
            &b,
            Limit::SlidingWindow {
                limit: 10,
                window_ms: 0,
            },
            1,
            None,
        ),
    ];
    for r in &bad {
        assert!(
            matches!(store.check(r).await, Err(StoreError::Rejected { .. })),
            "{r:?}"
        );
    }
    let window = Limit::SlidingWindow {
        limit: 10,
        window_ms: 1000,
    };
    let bad_params = [
        SetParams::new(b.clone(), Limit::TokenBucket(out_of_range)),
        SetParams::new(b.clone(), tokens(1, 1)).with_lease(1000, Limit::TokenBucket(out_of_range)),
        SetParams::new(b.clone(), tokens(1, 1)).with_lease(1000, window),
        SetParams::new(b.clone(), tokens(1, 1)).with_lease(u64::MAX, tokens(0, 0)),
        SetParams::new(b.clone(), tokens(1, 1))
            .with_lease(1000, tokens(0, 0))
            .not_after(u64::MAX),
        SetParams::new(b.clone(), tokens(1, 1)).at(u64::MAX),
    ];
    for p in &bad_params {
        let r = store.set_params(p).await;
        assert!(
            matches!(r, Err(StoreError::Rejected { .. })),
            "{p:?}: {r:?}"
        );
    }
    let p = BucketParams::new(5 * quota_core::bucket::UT, 1).unwrap();
    let ok = ChargeRequest::new(b.clone(), p, 1, 0);
    let bad_charges = [
        ChargeRequest {
            cost: 0,
            ..ok.clone()
        },
        ChargeRequest {
            cost: quota_store::MAX_COST + 1,
            ..ok.clone()
        },
        ChargeRequest {
            debt_limit_ut: (1 << 53) - 5_000_000,
            ..ok.clone()
        },
        ChargeRequest {
            params: out_of_range,
            ..ok.clone()
        },
        ok.clone().at(u64::MAX),
        ok.clone().with_id("a b"),
        ok.clone().with_id(""),
    ];
    for r in &bad_charges {
        let got = store.charge(r).await;
        assert!(
            matches!(got, Err(StoreError::Rejected { .. })),
            "{r:?}: {got:?}"
        );
    }
    let r = store.charge(&ok).await;
    assert!(
        matches!(
            r,
            Err(StoreError::Unavailable { .. } | StoreError::Timeout { .. })
        ),
        "{r:?}"
    );
    // And a valid one does reach it, and fails as unavailable, not as invalid.
    let r = store.check(&req(&b, tokens(1, 1), 1, None)).await;
    assert!(
        matches!(
            r,
            Err(StoreError::Unavailable { .. } | StoreError::Timeout { .. })
        ),
        "{r:?}"
    );
}

/// The value of every key in `keys` (DUMP), to show a failing call changed none.
fn dumps(c: &mut redis::Connection, keys: &[&str]) -> Vec<redis::Value> {
    keys.iter()
        .map(|k| redis::cmd("DUMP").arg(*k).query(c).unwrap())
        .collect()
}

/// An 88-byte token-bucket state whose carry (field 2) is NaN.
fn nan_carry_state() -> Vec<u8> {
    let mut f = [0f64; 11];
    f[0] = 1e6;
    f[1] = f64::NAN;
    f[2] = 1_700_000_000_000.0;
    f[5] = 1e7;
    f[6] = 1e6;
    f[8] = -1.0;
    f.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn wrong_types_repeated_keys_and_corrupt_state_are_errors_that_write_nothing() {
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    let w = "qd:v1:{bad}:x:1:w";
    let all = [B, P, IX, w];
    let cmd = |c: &mut redis::Connection, args: &[&str]| {
        let mut q = redis::cmd(args[0]);
        for a in &args[1..] {
            q.arg(*a);
        }
        let _: redis::Value = q.query(c).unwrap();
    };
    let tb_args: &[&str] = &["1", "1000000", "1000", ""];
    let sw_args: &[&str] = &["1", "5", "1000", ""];
    // A list where the state, the parameters or the index should be.
    for (i, key) in [B, P, IX].into_iter().enumerate() {
        cmd(&mut c, &["FLUSHALL"]);
        cmd(&mut c, &["RPUSH", key, "x"]);
        let before = dumps(&mut c, &all);
        assert_quotad_error(
            eval(&mut c, TOKEN_BUCKET_LUA, &[B, P, IX], tb_args),
            &format!("token bucket, list at key {i}"),
        );
        assert_eq!(dumps(&mut c, &all), before, "token bucket, list at key {i}");
        let sw_keys = [w, P, IX];
        let key_w = if key == B { w } else { key };
        cmd(&mut c, &["FLUSHALL"]);
        cmd(&mut c, &["RPUSH", key_w, "x"]);
        let before_w = dumps(&mut c, &all);
        assert_quotad_error(
            eval(&mut c, SLIDING_WINDOW_LUA, &sw_keys, sw_args),
            &format!("sliding window, list at key {i}"),
        );
        assert_eq!(
            dumps(&mut c, &all),
            before_w,
            "sliding window, list at key {i}"
        );
    }
    cmd(&mut c, &["FLUSHALL"]);
    cmd(&mut c, &["RPUSH", B, "x"]);
    assert_quotad_error(
        eval(
            &mut c,
            SET_PARAMS_LUA,
            &[P, B],
            &["cap", "1000000", "rate", "1"],
        ),
        "set_params on a list state",
    );
    // The replaced version's state (KEYS[3]): another type, or not a state, is an error that
    // writes nothing; so is naming it twice.
    let old = "qd:v1:{bad}:x:0:b";
    for (case, seed) in [("a list", "RPUSH"), ("not a state", "SET")] {
        cmd(&mut c, &["FLUSHALL"]);
        cmd(&mut c, &[seed, old, "x"]);
        let before = dumps(&mut c, &[P, B, old]);
        assert_quotad_error(
            eval(
                &mut c,
                SET_PARAMS_LUA,
                &[P, B, old],
                &["cap", "1000000", "rate", "1"],
            ),
            &format!("set_params replacing {case}"),
        );
        assert_eq!(dumps(&mut c, &[P, B, old]), before, "{case}");
    }
    assert_quotad_error(
        eval(
            &mut c,
            SET_PARAMS_LUA,
            &[P, B, B],
            &["cap", "1", "rate", "1"],
        ),
        "set_params replacing its own state",
    );
    cmd(&mut c, &["FLUSHALL"]);
    cmd(&mut c, &["RPUSH", B, "x"]);
    assert_quotad_error(
        eval(&mut c, COLLECT_USAGE_LUA, &[B], &["10"]),
        "collect_usage on a list index",
    );
    let list: Vec<String> = redis::cmd("LRANGE")
        .arg(B)
        .arg(0)
        .arg(-1)
        .query(&mut c)
        .unwrap();
    assert_eq!(list, ["x"]);
    cmd(&mut c, &["DEL", B]);

    // The same key twice: refused, and the state key does not become a set.
    for keys in [[w, w, IX], [w, P, w], [w, P, P]] {
        assert_quotad_error(
            eval(&mut c, SLIDING_WINDOW_LUA, &keys, sw_args),
            "repeated key",
        );
    }
    for keys in [[B, B, IX], [B, P, B]] {
        assert_quotad_error(
            eval(&mut c, TOKEN_BUCKET_LUA, &keys, tb_args),
            "repeated key",
        );
    }
    assert_quotad_error(
        eval(&mut c, SET_PARAMS_LUA, &[P, P], &["cap", "1", "rate", "1"]),
        "repeated key",
    );
    let n: u64 = redis::cmd("DBSIZE").query(&mut c).unwrap();
    assert_eq!(n, 0, "a refused call wrote a key");

    // A NaN carry fails before the key is listed in the index, and set_params fails before
    // replacing the parameters.
    let _: () = redis::cmd("SET")
        .arg(B)
        .arg(nan_carry_state())
        .query(&mut c)
        .unwrap();
    cmd(&mut c, &["HSET", P, "cap", "7000000", "rate", "10"]);
    let before = dumps(&mut c, &all);
    assert_quotad_error(
        eval(&mut c, TOKEN_BUCKET_LUA, &[B, P, IX], tb_args),
        "NaN carry",
    );
    assert_quotad_error(
        eval(
            &mut c,
            SET_PARAMS_LUA,
            &[P, B],
            &["cap", "1000000", "rate", "1"],
        ),
        "set_params over a NaN carry",
    );
    assert_eq!(dumps(&mut c, &all), before);

    // A listed state with corrupt counters is skipped, never reported as -2^63.
    cmd(&mut c, &["SADD", IX, B, w]);
    cmd(&mut c, &["HSET", w, "ad", "nan", "dn", "1"]);
    let r: Vec<redis::Value> = redis::cmd("EVAL")
        .arg(COLLECT_USAGE_LUA)
        .arg(1)
        .arg(IX)
        .arg(10)
        .query(&mut c)
        .unwrap();
    assert_eq!(
        r,
        vec![redis::Value::Int(2)],
        "both taken, neither reported"
    );

    // set_params refuses sliding-window settings sliding_window.lua would refuse.
    cmd(&mut c, &["FLUSHALL"]);
    for (case, args) in [
        ("product", &["limit", "1000000000", "window", "2678400000"]),
        ("limit", &["limit", "1000000001", "window", "1"]),
        ("window", &["limit", "1", "window", "2678400001"]),
        ("zero window", &["limit", "1", "window", "0"]),
    ] {
        assert_quotad_error(eval(&mut c, SET_PARAMS_LUA, &[P, B], args), case);
    }
    assert_quotad_error(
        eval(
            &mut c,
            SET_PARAMS_LUA,
            &[P, B],
            &["limit", "5", "window", "1000", "", "1000", "5", "0"],
        ),
        "window floor",
    );
    let n: u64 = redis::cmd("DBSIZE").query(&mut c).unwrap();
    assert_eq!(n, 0);
}

/// Fields to write into a hash.
type Fields = Vec<(&'static str, Vec<u8>)>;

/// A hash's fields and values sorted by field (DUMP's order of a large hash moves with its
/// table's rehashing, even on reads).
fn hash_fields(c: &mut redis::Connection, key: &str) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = redis::cmd("HGETALL").arg(key).query(c).unwrap();
    v.sort();
    v
}

#[test]
fn corrupt_window_states_are_errors_that_write_nothing() {
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    let w = "qd:v1:{bad}:x:1:w";
    // c: window, newest sub-window, sum, latest admission's sub-window, then 126 counts.
    let counters_of = |head: [f64; 4], slot1: f64| -> Vec<u8> {
        let mut v: Vec<u8> = head.iter().flat_map(|x| x.to_le_bytes()).collect();
        v.extend(std::iter::repeat_n(0u8, 8 * 126));
        v[40..48].copy_from_slice(&slot1.to_le_bytes());
        v
    };
    // 200 per 1000 ms (sub-window counters: 8 ms, 126 of them) at now 8, or 5 per 1000 ms
    // (the exact log) at now 10 000.
    let counters: &[&str] = &["1", "200", "1000", "8"];
    let log: &[&str] = &["1", "5", "1000", "10000"];
    let cf = |v: Vec<u8>| vec![("c", v)];
    let cases: Vec<(&str, Fields, &[&str])> = vec![
        (
            "garbage log",
            vec![("l", b"x:1".to_vec()), ("u", b"1".to_vec())],
            log,
        ),
        ("log without sum", vec![("l", b"5:1,x".to_vec())], log),
        (
            "sum above the log",
            vec![("l", b"5:1".to_vec()), ("u", b"3".to_vec())],
            log,
        ),
        ("sum without a log", vec![("u", b"2".to_vec())], log),
        (
            "log entry in the future",
            vec![("l", b"20000:1".to_vec()), ("u", b"1".to_vec())],
            log,
        ),
        ("counters too short", cf(b"short".to_vec()), counters),
        (
            "counters of another length",
            cf(counters_of([300.0, 0.0, 0.0, 0.0], 0.0)),
            counters,
        ),
        (
            "counters of no window",
            cf(counters_of([0.0, 0.0, 0.0, 0.0], 0.0)),
            counters,
        ),
        (
            "negative sum",
            cf(counters_of([1000.0, 0.0, -1.0, 0.0], 0.0)),
            counters,
        ),
        (
            "latest admission after the newest",
            cf(counters_of([1000.0, 0.0, 0.0, 1.0], 0.0)),
            counters,
        ),
        (
            "NaN counter",
            cf(counters_of([1000.0, 0.0, 5.0, 0.0], f64::NAN)),
            counters,
        ),
        (
            "fractional counter",
            cf(counters_of([1000.0, 0.0, 5.0, 0.0], 1.5)),
            counters,
        ),
        (
            "counter above the sum",
            cf(counters_of([1000.0, 0.0, 5.0, 0.0], 9.0)),
            counters,
        ),
        (
            "NaN header",
            cf(counters_of([1000.0, f64::NAN, 5.0, 0.0], 0.0)),
            counters,
        ),
        ("fractional held limit", vec![("h", b"1.5".to_vec())], log),
        (
            "raise below the held limit",
            vec![("h", b"5:3:100".to_vec())],
            log,
        ),
        ("raise without a time", vec![("h", b"1:5:0".to_vec())], log),
        (
            "held limit above the bound",
            vec![("h", b"1000000001".to_vec())],
            log,
        ),
    ];
    for (case, fields, args) in cases {
        let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
        let mut q = redis::cmd("HSET");
        q.arg(w);
        for (f, v) in &fields {
            q.arg(*f).arg(v.as_slice());
        }
        let _: () = q.query(&mut c).unwrap();
        let before = hash_fields(&mut c, w);
        assert_quotad_error(eval(&mut c, SLIDING_WINDOW_LUA, &[w, P, IX], args), case);
        assert_eq!(hash_fields(&mut c, w), before, "{case}");
        let size: u64 = redis::cmd("DBSIZE").query(&mut c).unwrap();
        assert_eq!(size, 1, "{case}: a refused call wrote");
    }
}

/// Issue 36's hold in the parameters: malformed hlimit / huntil are refused by the decision
/// (nothing written); set_params.lua replacing malformed window parameters holds the new limit
/// at 0 for a window (a documented deny, never an over-admission) and repairs them.
#[test]
fn malformed_held_raises_are_refused_or_deny() {
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    let w = "qd:v1:{bad}:x:1:w";
    let good: &[(&str, &str)] = &[("limit", "5"), ("window", "1000")];
    let cases: Vec<(&str, Vec<(&str, &str)>)> = vec![
        ("held limit without its end", vec![("hlimit", "2")]),
        ("hold end without its limit", vec![("huntil", "20000")]),
        (
            "fractional held limit",
            vec![("hlimit", "1.5"), ("huntil", "20000")],
        ),
        ("signed hold end", vec![("hlimit", "2"), ("huntil", "-1")]),
        (
            "held limit above the bound",
            vec![("hlimit", "1000000001"), ("huntil", "20000")],
        ),
        (
            "hold end past 2^53",
            vec![("hlimit", "2"), ("huntil", "9007199254740992")],
        ),
    ];
    for (case, hold) in &cases {
        for with_params in [true, false] {
            let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
            let mut q = redis::cmd("HSET");
            q.arg(P);
            for (f, v) in hold.iter().chain(if with_params { good } else { &[] }) {
                q.arg(*f).arg(*v);
            }
            let _: () = q.query(&mut c).unwrap();
            let before = hash_fields(&mut c, P);
            let r = eval(
                &mut c,
                SLIDING_WINDOW_LUA,
                &[w, P, IX],
                &["1", "5", "1000", "10000"],
            );
            assert_quotad_error(r, case);
            assert_eq!(hash_fields(&mut c, P), before, "{case}");
            let size: u64 = redis::cmd("DBSIZE").query(&mut c).unwrap();
            assert_eq!(size, 1, "{case}: a refused call wrote");
        }
        // set_params.lua over them: the new limit 5 is held at 0 until 10 000 + 1000.
        let r = eval(
            &mut c,
            SET_PARAMS_LUA,
            &[P, B],
            &["limit", "5", "window", "1000", "", "", "", "", "10000"],
        );
        assert!(r.is_ok(), "{case}: {r:?}");
        let held: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(P)
            .arg(&["hlimit", "huntil"][..])
            .query(&mut c)
            .unwrap();
        assert_eq!(held, [Some("0".into()), Some("11000".into())], "{case}");
        for (now, allowed) in [("10500", 0), ("10999", 0), ("11000", 1)] {
            let d: Vec<i64> = redis::cmd("EVAL")
                .arg(SLIDING_WINDOW_LUA)
                .arg(3)
                .arg(&[w, P, IX][..])
                .arg(&["1", "", "", now][..])
                .query(&mut c)
                .unwrap();
            assert_eq!(d[0], allowed, "{case} at {now}: {d:?}");
        }
    }
}

/// Window states in the two-counter layout, or a log without its sum, are read, not refused:
/// every token they may still count is counted as admitted now, which errs toward denying.
#[test]
fn window_states_of_the_two_counter_layout_err_toward_denying() {
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    let w = "qd:v1:{old}:x:1:w";
    let p = "qd:v1:{old}:x:1:p";
    let ix = "qd:v1:{old}:active";
    let call = |c: &mut redis::Connection, args: &[&str]| -> Vec<i64> {
        let v = eval(c, SLIDING_WINDOW_LUA, &[w, p, ix], args).unwrap();
        redis::from_redis_value(v).unwrap()
    };
    // 150 in [1000, 2000) and 100 before: the two-counter estimate at 2500 was 150 (the
    // current window over), but both counters count until 3000 here.
    let _: () = redis::cmd("HSET")
        .arg(w)
        .arg(&["ws", "1000", "cu", "150", "pv", "100", "ts", "1900"][..])
        .query(&mut c)
        .unwrap();
    assert_eq!(call(&mut c, &["0", "300", "1000", "2500"])[1], 50);
    let d = call(&mut c, &["51", "300", "1000", "2500"]);
    assert_eq!(d[0], 0, "{d:?}");
    let old: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(w)
        .arg(&["ws", "cu", "pv"][..])
        .query(&mut c)
        .unwrap();
    assert_eq!(old, [None, None, None]);
    // The counters' sum (their third double) holds all 250.
    let counters: Vec<u8> = redis::cmd("HGET").arg(w).arg("c").query(&mut c).unwrap();
    assert_eq!(
        f64::from_le_bytes(counters[16..24].try_into().unwrap()),
        250.0
    );
    // Past 2 windows after its start nothing of it counts.
    let _: () = redis::cmd("DEL").arg(w).query(&mut c).unwrap();
    let _: () = redis::cmd("HSET")
        .arg(w)
        .arg(&["ws", "1000", "cu", "150", "pv", "100", "ts", "1900"][..])
        .query(&mut c)
        .unwrap();
    assert_eq!(call(&mut c, &["0", "300", "1000", "3000"])[1], 300);
    // A log without its sum is summed once, then kept with it.
    let _: () = redis::cmd("DEL").arg(w).query(&mut c).unwrap();
    let _: () = redis::cmd("HSET")
        .arg(w)
        .arg(&["l", "100:3,900:2", "ts", "900"][..])
        .query(&mut c)
        .unwrap();
    assert_eq!(call(&mut c, &["1", "5", "1000", "1000"])[..2], [0, 0]);
    let d = call(&mut c, &["3", "5", "1000", "1100"]);
    assert_eq!(d[..2], [1, 0]);
    let log: Vec<String> = redis::cmd("HMGET")
        .arg(w)
        .arg(&["l", "u"][..])
        .query(&mut c)
        .unwrap();
    assert_eq!(log, ["900:2,1100:3", "5"]);
}

/// `hold.lua` refuses every bad argument, a record key not of its form, keys of other tenants
/// or types, a debt limit past the capacity in force and an id of another request, and writes
/// nothing then; a replay writes nothing either.
#[test]
fn hold_rejects_bad_arguments_and_writes_nothing() {
    use quota_store::script::HOLD_LUA;
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    let h = "qd:v1:{bad}:~h:h1";
    let (b2, p2) = ("qd:v1:{bad}:y:1:b", "qd:v1:{bad}:y:1:p");
    let keys = [h, IX, B, P];
    let all = [h, IX, B, P, b2, p2];
    // A hold of 2 of a bucket of 5 (fallback), debt limit 1 token.
    let args = |cost: &'static str, ttl: &'static str| -> Vec<&'static str> {
        vec![
            cost,
            ttl,
            "1700000000000",
            "",
            "5000000",
            "1000000",
            "",
            "1000000",
        ]
    };
    let r = eval(&mut c, HOLD_LUA, &keys, &args("2", "1000")).unwrap();
    assert_eq!(
        r,
        redis::Value::Array(
            [1, 1_700_000_001_000, 0, 1, 3, 0, 2000]
                .map(redis::Value::Int)
                .to_vec()
        )
    );
    let before = dumps(&mut c, &all);
    let with = |i: usize, v: &'static str| {
        let mut a = args("2", "1000");
        a[i] = v;
        a
    };
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("no arguments", vec![]),
        ("one argument short", args("2", "1000")[..7].to_vec()),
        ("zero estimate", args("0", "1000")),
        ("float estimate", args("1.5", "1000")),
        ("estimate above max", args("9007199255", "1000")),
        ("zero ttl", args("2", "0")),
        ("ttl above an hour", args("2", "3600001")),
        ("bad now", with(2, "soon")),
        ("now too late for the record", with(2, "9007199254740991")),
        ("zero minimum TTL", with(3, "0")),
        ("no fallback", with(4, "")),
        ("fallback out of bounds", with(4, "9007199254740992")),
        ("zero period", with(6, "0")),
        ("negative debt limit", with(7, "-1")),
        ("debt limit past the capacity", with(7, "9007199249740992")),
        // The same id, another request.
        ("another estimate", args("3", "1000")),
        ("another ttl", args("2", "999")),
        ("another debt limit", with(7, "0")),
    ];
    for (case, a) in &cases {
        assert_quotad_error(eval(&mut c, HOLD_LUA, &keys, a), case);
    }
    for (case, keys) in [
        ("three keys", &[h, IX, B][..]),
        ("repeated keys", &[h, IX, B, B][..]),
        (
            "a record key of another form",
            &["qd:v1:{bad}:h:h1", IX, B, P][..],
        ),
        ("an id with a colon", &["qd:v1:{bad}:~h:h:1", IX, B, P][..]),
        (
            "an id too long",
            &[
                "qd:v1:{bad}:~h:xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
                IX,
                B,
                P,
            ][..],
        ),
        (
            "a bucket of another tenant",
            &[h, IX, "qd:v1:{other}:x:1:b", P][..],
        ),
    ] {
        assert_quotad_error(eval(&mut c, HOLD_LUA, keys, &args("2", "1000")), case);
    }
    assert_eq!(dumps(&mut c, &all), before, "a refused hold wrote nothing");
    // Answered again: a replay writes nothing.
    let r = eval(&mut c, HOLD_LUA, &keys, &args("2", "1000")).unwrap();
    assert_eq!(
        r,
        redis::Value::Array(
            [1, 1_700_000_001_000, 1, 1, 3, 0, 2000]
                .map(redis::Value::Int)
                .to_vec()
        )
    );
    assert_eq!(dumps(&mut c, &all), before, "a replay wrote nothing");
    // Keys of another type, a corrupt record, invalid stored parameters: refused, nothing
    // written.
    let cmd = |c: &mut redis::Connection, args: &[&str]| {
        let mut q = redis::cmd(args[0]);
        for a in &args[1..] {
            q.arg(*a);
        }
        let _: redis::Value = q.query(c).unwrap();
    };
    let h2 = "qd:v1:{bad}:~h:h2";
    let fresh = [h2, IX, b2, p2];
    for (case, seed, undo) in [
        (
            "a record of another type",
            &["SET", h2, "x"][..],
            &["DEL", h2][..],
        ),
        (
            "a corrupt record",
            &["HSET", h2, "s", "o", "c", "x"][..],
            &["DEL", h2][..],
        ),
        (
            "a state of another type",
            &["RPUSH", b2, "x"][..],
            &["DEL", b2][..],
        ),
        (
            "parameters of another type",
            &["SET", p2, "x"][..],
            &["DEL", p2][..],
        ),
        (
            "invalid stored parameters",
            &["HSET", p2, "cap", "x", "rate", "1"][..],
            &["DEL", p2][..],
        ),
        (
            "an index of another type",
            &["SET", "qd:v1:ix2", "x"][..],
            &["DEL", "qd:v1:ix2"][..],
        ),
    ] {
        cmd(&mut c, seed);
        let seeded = dumps(&mut c, &all);
        let keys = if case.contains("index") {
            [h2, "qd:v1:ix2", b2, p2]
        } else {
            fresh
        };
        assert_quotad_error(eval(&mut c, HOLD_LUA, &keys, &args("2", "1000")), case);
        assert_eq!(dumps(&mut c, &all), seeded, "{case}");
        cmd(&mut c, undo);
    }
    // Stored parameters of capacity 100 make a debt limit within the fallback's bound too large.
    cmd(&mut c, &["HSET", p2, "cap", "100000000", "rate", "1"]);
    assert_quotad_error(
        eval(&mut c, HOLD_LUA, &fresh, &with(7, "9007199249740991")),
        "a debt limit past the stored capacity",
    );
    let exists: bool = redis::cmd("EXISTS").arg(h2).arg(b2).query(&mut c).unwrap();
    assert!(!exists, "a refused hold made no record and no state");
}

/// `settle.lua` refuses every bad argument and a corrupt record, and writes nothing then.
#[test]
fn settle_rejects_bad_arguments_and_writes_nothing() {
    use quota_store::script::{HOLD_LUA, SETTLE_LUA};
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    let h = "qd:v1:{bad}:~h:h1";
    let now = "1700000000000";
    let hold = ["2", "1000", now, "", "5000000", "1000000", "", "1000000"];
    eval(&mut c, HOLD_LUA, &[h, IX, B, P], &hold).unwrap();
    let all = [h, IX, B, P];
    let before = dumps(&mut c, &all);
    let cases: &[(&str, &[&str])] = &[
        ("no arguments", &[]),
        ("three arguments", &["settle", "1", now]),
        ("neither settle nor release", &["close", "1", now, ""]),
        ("a settle without a cost", &["settle", "", now, ""]),
        ("a negative cost", &["settle", "-1", now, ""]),
        ("a cost above max", &["settle", "9007199255", now, ""]),
        ("a release with a cost", &["release", "1", now, ""]),
        ("bad now", &["settle", "1", "soon", ""]),
        (
            "now too late for the record",
            &["settle", "1", "9007199254740991", ""],
        ),
        ("zero minimum TTL", &["settle", "1", now, "0"]),
    ];
    for (case, a) in cases {
        assert_quotad_error(eval(&mut c, SETTLE_LUA, &[h, IX], a), case);
    }
    for (case, keys) in [
        ("one key", &[h][..]),
        ("the same key twice", &[h, h][..]),
        (
            "a record key of another form",
            &["qd:v1:{bad}:x:1:b", IX][..],
        ),
    ] {
        assert_quotad_error(
            eval(&mut c, SETTLE_LUA, keys, &["settle", "1", now, ""]),
            case,
        );
    }
    assert_eq!(
        dumps(&mut c, &all),
        before,
        "a refused settle wrote nothing"
    );
    // A record whose limits name another tenant's keys, or are not MessagePack.
    let cmd = |c: &mut redis::Connection, args: &[&str]| {
        let mut q = redis::cmd(args[0]);
        for a in &args[1..] {
            q.arg(*a);
        }
        let _: redis::Value = q.query(c).unwrap();
    };
    let theirs: Vec<u8> = {
        // MessagePack of {{"qd:v1:{other}:x:1:b", "qd:v1:{other}:x:1:p", 5e6, 1e6, 1000, 0}}.
        let mut v = vec![0x91, 0x96];
        for k in ["qd:v1:{other}:x:1:b", "qd:v1:{other}:x:1:p"] {
            v.push(0xa0 | k.len() as u8);
            v.extend(k.as_bytes());
        }
        v.push(0xce);
        v.extend(5_000_000u32.to_be_bytes());
        v.push(0xce);
        v.extend(1_000_000u32.to_be_bytes());
        v.push(0xcd);
        v.extend(1000u16.to_be_bytes());
        v.push(0);
        v
    };
    for (case, l) in [
        ("another tenant's keys", theirs),
        ("not MessagePack", b"\xc1".to_vec()),
    ] {
        let _: () = redis::cmd("HSET")
            .arg(h)
            .arg("l")
            .arg(l)
            .query(&mut c)
            .unwrap();
        let seeded = dumps(&mut c, &all);
        assert_quotad_error(
            eval(&mut c, SETTLE_LUA, &[h, IX], &["settle", "1", now, ""]),
            case,
        );
        assert_eq!(dumps(&mut c, &all), seeded, "{case}");
    }
    cmd(&mut c, &["HSET", h, "s", "x"]);
    assert_quotad_error(
        eval(&mut c, SETTLE_LUA, &[h, IX], &["release", "", now, ""]),
        "an unknown phase",
    );
}

#[tokio::test]
async fn invalid_holds_never_reach_redis() {
    use quota_store::{HoldLimit, HoldRequest, ReleaseRequest, SettleRequest};
    let mut server = RedisServer::start().unwrap();
    let store = common::store(&server).await;
    server.stop();
    let b = fresh_bucket("never-held");
    let other = fresh_bucket("never-held-other");
    let b2 = quota_store::BucketRef {
        policy: quota_core::PolicyName::new("other").unwrap(),
        ..b.clone()
    };
    let limit = |b: &quota_store::BucketRef| HoldLimit {
        bucket: b.clone(),
        limit: tokens(5, 1),
        debt_limit_ut: 0,
    };
    let ok = HoldRequest {
        id: "h".into(),
        limits: vec![limit(&b)],
        cost: 1,
        ttl_ms: 1000,
        now_ms: None,
    };
    let window = Limit::SlidingWindow {
        limit: 1,
        window_ms: 1000,
    };
    let bad = [
        HoldRequest {
            id: "".into(),
            ..ok.clone()
        },
        HoldRequest {
            id: "a:b".into(),
            ..ok.clone()
        },
        HoldRequest {
            id: "x".repeat(65),
            ..ok.clone()
        },
        HoldRequest {
            limits: vec![],
            ..ok.clone()
        },
        HoldRequest {
            limits: vec![limit(&b); 2],
            ..ok.clone()
        },
        HoldRequest {
            limits: vec![limit(&b), limit(&other)],
            ..ok.clone()
        },
        HoldRequest {
            limits: vec![HoldLimit {
                limit: window,
                ..limit(&b)
            }],
            ..ok.clone()
        },
        HoldRequest {
            limits: vec![HoldLimit {
                debt_limit_ut: (1 << 53) - 5_000_000,
                ..limit(&b)
            }],
            ..ok.clone()
        },
        HoldRequest {
            cost: 0,
            ..ok.clone()
        },
        HoldRequest {
            cost: quota_store::MAX_COST + 1,
            ..ok.clone()
        },
        HoldRequest {
            ttl_ms: 0,
            ..ok.clone()
        },
        HoldRequest {
            ttl_ms: quota_core::bounds::MAX_HOLD_TTL_MS + 1,
            ..ok.clone()
        },
        HoldRequest {
            now_ms: Some((1 << 53) - 1000),
            ..ok.clone()
        },
        // A concurrency limit: held alone, one slot, within MAX_CONCURRENCY.
        HoldRequest {
            limits: vec![HoldLimit {
                limit: Limit::Concurrency { limit: 2 },
                ..limit(&b)
            }],
            cost: 2,
            ..ok.clone()
        },
        HoldRequest {
            limits: vec![
                limit(&b),
                HoldLimit {
                    limit: Limit::Concurrency { limit: 2 },
                    ..limit(&b2)
                },
            ],
            ..ok.clone()
        },
        HoldRequest {
            limits: vec![
                HoldLimit {
                    limit: Limit::Concurrency { limit: 2 },
                    ..limit(&b)
                },
                limit(&b2),
            ],
            ..ok.clone()
        },
        HoldRequest {
            limits: vec![HoldLimit {
                limit: Limit::Concurrency {
                    limit: quota_core::policy::MAX_CONCURRENCY + 1,
                },
                ..limit(&b)
            }],
            ..ok.clone()
        },
    ];
    for r in &bad {
        let got = store.hold(r).await;
        assert!(
            matches!(got, Err(StoreError::Rejected { .. })),
            "{r:?}: {got:?}"
        );
    }
    let settle = SettleRequest {
        tenant: b.tenant.clone(),
        id: "h".into(),
        cost: 1,
        now_ms: None,
    };
    for r in [
        SettleRequest {
            id: "a b".into(),
            ..settle.clone()
        },
        SettleRequest {
            cost: quota_store::MAX_COST + 1,
            ..settle.clone()
        },
        SettleRequest {
            now_ms: Some(u64::MAX),
            ..settle.clone()
        },
    ] {
        let got = store.settle(&r).await;
        assert!(
            matches!(got, Err(StoreError::Rejected { .. })),
            "{r:?}: {got:?}"
        );
    }
    let release = ReleaseRequest {
        tenant: b.tenant.clone(),
        id: "".into(),
        now_ms: None,
    };
    let got = store.release(&release).await;
    assert!(matches!(got, Err(StoreError::Rejected { .. })), "{got:?}");
    // A valid one reaches Redis, and fails as unavailable.
    let got = store.hold(&ok).await;
    assert!(
        matches!(
            got,
            Err(StoreError::Unavailable { .. } | StoreError::Timeout { .. })
        ),
        "{got:?}"
    );
}

/// A concurrency hold (`hold.lua` with `slots`) and concurrency parameters (`set_params.lua`
/// with `slots`) refuse every bad argument and key, and write nothing then.
#[test]
fn concurrency_holds_and_parameters_reject_bad_input_and_write_nothing() {
    use quota_store::script::HOLD_LUA;
    let server = RedisServer::start().unwrap();
    let mut c = common::sync_conn(&server);
    let (h, z, p, u) = (
        "qd:v1:{bad}:~h:s1",
        "qd:v1:{bad}:c:1:c",
        "qd:v1:{bad}:c:1:p",
        "qd:v1:{bad}:c:1:cu",
    );
    let keys = [h, IX, z, p, u];
    let all = [h, IX, z, p, u];
    let now = "1700000000000";
    let args = |cost: &'static str, limit: &'static str| -> Vec<&'static str> {
        vec![cost, "1000", now, "", "slots", limit, "", "0"]
    };
    let r = eval(&mut c, HOLD_LUA, &keys, &args("1", "2")).unwrap();
    assert_eq!(
        r,
        redis::Value::Array(
            [1, 1_700_000_001_000, 0, 1, 1, 0, 1000]
                .map(redis::Value::Int)
                .to_vec()
        )
    );
    let before = dumps(&mut c, &all);
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("an estimate of 2", args("2", "2")),
        ("a limit above MAX_SLOTS", args("1", "1000001")),
        ("a negative limit", args("1", "-1")),
        ("a second value", {
            let mut a = args("1", "2");
            a[6] = "1";
            a
        }),
        ("no debt limit", {
            let mut a = args("1", "2");
            a[7] = "";
            a
        }),
        ("nine arguments", {
            let mut a = args("1", "2");
            a.push("");
            a
        }),
    ];
    for (case, a) in &cases {
        assert_quotad_error(eval(&mut c, HOLD_LUA, &keys, a), case);
    }
    assert_quotad_error(
        eval(&mut c, HOLD_LUA, &[h, IX, z, p], &args("1", "2")),
        "four keys",
    );
    assert_eq!(dumps(&mut c, &all), before, "a refused hold wrote nothing");
    let cmd = |c: &mut redis::Connection, args: &[&str]| {
        let mut q = redis::cmd(args[0]);
        for a in &args[1..] {
            q.arg(*a);
        }
        let _: redis::Value = q.query(c).unwrap();
    };
    let (h2, z2, p2, u2) = (
        "qd:v1:{bad}:~h:s2",
        "qd:v1:{bad}:d:1:c",
        "qd:v1:{bad}:d:1:p",
        "qd:v1:{bad}:d:1:cu",
    );
    let fresh = [h2, IX, z2, p2, u2];
    for (case, seed) in [
        ("slots of another type", &["SET", z2, "x"][..]),
        ("usage of another type", &["SET", u2, "x"][..]),
        (
            "usage counters out of bounds",
            &["HSET", u2, "ad", "-1"][..],
        ),
        ("parameters of another type", &["SET", p2, "x"][..]),
        ("invalid stored parameters", &["HSET", p2, "slots", "x"][..]),
        (
            "a lease end without a floor",
            &["HSET", p2, "slots", "1", "until", "5"][..],
        ),
    ] {
        cmd(&mut c, seed);
        let seeded = dumps(&mut c, &fresh);
        assert_quotad_error(eval(&mut c, HOLD_LUA, &fresh, &args("1", "2")), case);
        assert_eq!(dumps(&mut c, &fresh), seeded, "{case}");
        cmd(&mut c, &["DEL", z2, u2, p2]);
    }
    // Concurrency parameters: one value, a floor of the same kind, no period, 2 keys.
    let b = "qd:v1:{bad}:c:1:b";
    let before = dumps(&mut c, &[p, b]);
    let bad: &[(&str, &[&str])] = &[
        ("above MAX_SLOTS", &["slots", "1000001", "", ""]),
        ("a second value", &["slots", "1", "", "1"]),
        ("a second field", &["slots", "1", "rate", ""]),
        (
            "a floor above MAX_SLOTS",
            &["slots", "1", "", "", "", "1000", "1000001", ""],
        ),
        (
            "a floor of two values",
            &["slots", "1", "", "", "", "1000", "1", "1"],
        ),
        (
            "a period",
            &["slots", "1", "", "", "", "", "", "", "", "1000"],
        ),
    ];
    for (case, a) in bad {
        assert_quotad_error(eval(&mut c, SET_PARAMS_LUA, &[p, b], a), case);
    }
    assert_quotad_error(
        eval(
            &mut c,
            SET_PARAMS_LUA,
            &[p, b, "qd:v1:{bad}:c:0:b"],
            &["slots", "1", "", ""],
        ),
        "a replaced version",
    );
    assert_eq!(
        dumps(&mut c, &[p, b]),
        before,
        "refused parameters wrote nothing"
    );
}

/// A check, a check of several limits or a reservation of a concurrency limit is refused by
/// both stores before anything is decided: its slots are taken with holds.
#[tokio::test]
async fn a_concurrency_limit_is_never_checked() {
    use quota_store::{EmbeddedStore, LimitCheck, MultiCheckRequest};
    let server = RedisServer::start().unwrap();
    let redis = common::store(&server).await;
    let embedded = EmbeddedStore::new();
    let b = fresh_bucket("never-checked");
    let slots = Limit::Concurrency { limit: 3 };
    let multi = MultiCheckRequest {
        limits: vec![
            LimitCheck {
                bucket: quota_store::BucketRef {
                    policy: quota_core::PolicyName::new("tokens").unwrap(),
                    ..b.clone()
                },
                limit: tokens(5, 1),
            },
            LimitCheck {
                bucket: b.clone(),
                limit: slots,
            },
        ],
        cost: 1,
        now_ms: None,
    };
    let refused = |r: Result<(), StoreError>| {
        assert!(
            matches!(&r, Err(StoreError::Rejected { reason }) if reason == quota_store::CONCURRENCY_BY_HOLDS),
            "{r:?}"
        );
    };
    refused(redis.check(&req(&b, slots, 1, None)).await.map(drop));
    refused(embedded.check(&req(&b, slots, 1, None)).await.map(drop));
    refused(redis.reserve(&req(&b, slots, 1, None), 3).await.map(drop));
    refused(
        embedded
            .reserve(&req(&b, slots, 1, None), 3)
            .await
            .map(drop),
    );
    refused(redis.check_all(&multi).await.map(drop));
    refused(embedded.check_all(&multi).await.map(drop));
    let mut conn = common::sync_conn(&server);
    let n: u64 = redis::cmd("DBSIZE").query(&mut conn).unwrap();
    assert_eq!(n, 0, "nothing written");
    assert!(embedded.is_empty());
    assert_eq!(redis.in_flight(&b, None).await.unwrap(), 0);
}
