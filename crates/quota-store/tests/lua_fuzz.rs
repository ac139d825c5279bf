//! Fuzzes every Lua script against a real redis-server: random KEYS counts (repeated keys
//! included), adversarial ARGV strings (negatives, floats, exponents, hex, spaces, inf, nan,
//! 20-digit numbers, unicode, empty) and pre-existing keys of every type (string, list, set,
//! zset, hash, stream, valid and corrupt states, states in debt, charge markers). Every reply
//! must be valid by the script's contract, or an error starting with `ERR quotad:`; a call
//! answered with an error must change no key (DUMP of every key before and after; a hash's fields and values sorted instead, as
//! the order DUMP gives a large hash moves with its table's rehashing, even on reads).
//!
//! Seeded: `QUOTAD_LUA_FUZZ_SEED=<u64>` replays a run (the seed is printed);
//! `QUOTAD_LUA_FUZZ_CALLS=<n>` sets the calls per script (default 20 000).

use quota_core::bounds::{MAX_BURST, MAX_CAPACITY_UT, MAX_WAIT_MS, MAX_WINDOW_LIMIT};
use quota_store::script::{
    CHARGE_LUA, COLLECT_USAGE_LUA, REFUND_LUA, SET_PARAMS_LUA, SLIDING_WINDOW_LUA,
    TOKEN_BUCKETS_LUA, TOKEN_BUCKET_LUA,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use redis::Value;
use redis_harness::RedisServer;

/// The key universe: every call's keys and every pre-existing key come from here.
const KEYS: [&str; 8] = [
    "fz:{f}:a:b",
    "fz:{f}:a:p",
    "fz:{f}:a:w",
    "fz:{f}:ix",
    "fz:{f}:b:b",
    "fz:{f}:b:p",
    "fz:{f}:b:w",
    "fz:{f}:x",
];
/// Calls between two re-seedings of the keys (one pipeline).
const BATCH: usize = 50;
const NOW: u64 = 1_700_000_000_000;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Script {
    TokenBucket,
    TokenBuckets,
    SlidingWindow,
    SetParams,
    CollectUsage,
    Refund,
    Charge,
}

const SCRIPTS: [Script; 7] = [
    Script::TokenBucket,
    Script::TokenBuckets,
    Script::SlidingWindow,
    Script::SetParams,
    Script::CollectUsage,
    Script::Refund,
    Script::Charge,
];

/// An adversarial argument string.
fn garbage(rng: &mut ChaCha8Rng) -> String {
    const FIXED: &[&str] = &[
        "",
        "-1",
        "-0",
        "0",
        "1",
        "1.5",
        "1.0",
        "1e3",
        "1E3",
        "0x10",
        "0X1f",
        " 1",
        "1 ",
        "\t2",
        "inf",
        "-inf",
        "Infinity",
        "nan",
        "NaN",
        "+5",
        "99999999999999999999",
        "18446744073709551616",
        "9007199254740991",
        "9007199254740992",
        "9007199254740",
        "9007199254741",
        "9007199254",
        "9007199255",
        "1000000000",
        "1000000001",
        "2678400000",
        "2678400001",
        "2251799813685248",
        "100000",
        "100001",
        "١٢٣",
        "５",
        "é",
        "1\u{0}2",
        "cap",
        "rate",
        "limit",
        "window",
        "0000000000000001",
        "00000000000000001",
    ];
    match rng.random_range(0..4) {
        0 => rng.random_range(0..1_000_000u64).to_string(),
        1 => rng.random::<u64>().to_string(),
        _ => FIXED[rng.random_range(0..FIXED.len())].to_string(),
    }
}

/// A plausible value for argument `i` of `script` (so calls also reach the decision paths).
fn plausible(rng: &mut ChaCha8Rng, script: Script, i: usize) -> String {
    let n = |rng: &mut ChaCha8Rng, hi: u64| rng.random_range(0..=hi).to_string();
    let now = |rng: &mut ChaCha8Rng| {
        if rng.random_bool(0.2) {
            String::new()
        } else {
            (NOW + rng.random_range(0..100_000u64)).to_string()
        }
    };
    match (script, i) {
        (Script::TokenBucket | Script::SlidingWindow, 0) => n(rng, 12),
        (Script::TokenBucket, 1) => (rng.random_range(0..=20u64) * 1_000_000).to_string(),
        (Script::TokenBucket, 2) => n(rng, 5_000_000),
        (Script::SlidingWindow, 1) => n(rng, 300),
        (Script::SlidingWindow, 2) => rng.random_range(1..=5_000u64).to_string(),
        (Script::TokenBucket | Script::SlidingWindow, 3) => now(rng),
        (Script::TokenBucket | Script::SlidingWindow, 4) => n(rng, 100_000),
        (Script::TokenBucket, 5) | (Script::SetParams, 9) => period(rng),
        (Script::TokenBucket, 6) => rng.random_range(1..=100u64).to_string(),
        (Script::Refund, 0) => rng.random_range(1..=50u64).to_string(),
        (Script::Refund, 1) => now(rng),
        // Cost, debt limit, fallback capacity and refill, now, minimum TTL, period.
        (Script::Charge, 0) => n(rng, 40),
        (Script::Charge, 1) => match rng.random_range(0..4) {
            0 => "0".to_string(),
            1 => (MAX_CAPACITY_UT - rng.random_range(0..=20u64) * 1_000_000).to_string(),
            _ => (rng.random_range(0..=30u64) * 1_000_000).to_string(),
        },
        (Script::Charge, 2) => (rng.random_range(0..=20u64) * 1_000_000).to_string(),
        (Script::Charge, 3) => n(rng, 5_000_000),
        (Script::Charge, 4) => now(rng),
        (Script::Charge, 5) => n(rng, 100_000),
        (Script::Charge, 6) => period(rng),
        (Script::SetParams, 0) => ["cap", "limit"][rng.random_range(0..2)].to_string(),
        (Script::SetParams, 2) => ["rate", "window"][rng.random_range(0..2)].to_string(),
        (Script::SetParams, 1 | 6) => n(rng, 20_000_000),
        (Script::SetParams, 3 | 7) => rng.random_range(0..=5_000u64).to_string(),
        (Script::SetParams, 4) => n(rng, 100_000),
        (Script::SetParams, 5) => {
            if rng.random_bool(0.5) {
                String::new()
            } else {
                n(rng, 100_000)
            }
        }
        (Script::SetParams, 8) => now(rng),
        (Script::CollectUsage, _) => rng.random_range(1..=10u64).to_string(),
        // Cost, now, minimum TTL, then each limit's capacity, refill and period.
        (Script::TokenBuckets, 0) => n(rng, 12),
        (Script::TokenBuckets, 1) => now(rng),
        (Script::TokenBuckets, 2) => n(rng, 100_000),
        (Script::TokenBuckets, i) => match (i - 3) % 3 {
            0 => (rng.random_range(0..=20u64) * 1_000_000).to_string(),
            1 => n(rng, 5_000_000),
            _ => period(rng),
        },
        _ => String::new(),
    }
}

/// A refill period: empty (per second), small, a day, or the longest.
fn period(rng: &mut ChaCha8Rng) -> String {
    match rng.random_range(0..4) {
        0 => String::new(),
        1 => rng.random_range(1..=5_000u64).to_string(),
        2 => "86400000".to_string(),
        _ => "2678400000".to_string(),
    }
}

/// A key's remaining time to live (PTTL), then its content in a form that changes only when the
/// content does: DUMP, or a hash's fields and values sorted by field.
const SNAPSHOT_LUA: &str = "
local ttl = redis.call('PTTL', KEYS[1])
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then
  return {ttl, redis.call('DUMP', KEYS[1])}
end
local h = redis.call('HGETALL', KEYS[1])
local fields = {}
for i = 1, #h, 2 do
  fields[#fields + 1] = h[i]
end
table.sort(fields)
local out = {ttl}
for _, f in ipairs(fields) do
  out[#out + 1] = f
  out[#out + 1] = redis.call('HGET', KEYS[1], f)
end
return out
";

fn arity(script: Script) -> (usize, std::ops::RangeInclusive<usize>) {
    match script {
        Script::TokenBucket => (3, 3..=7),
        // Two limits; `call` fits the arguments to the keys it names.
        Script::TokenBuckets => (5, 9..=9),
        Script::SlidingWindow => (3, 3..=5),
        Script::SetParams => (5, 4..=10),
        Script::CollectUsage => (1, 1..=1),
        Script::Refund => (1, 1..=2),
        Script::Charge => (4, 4..=7),
    }
}

/// The keys a well-formed call names, by role.
fn role_keys(script: Script, rng: &mut ChaCha8Rng) -> Vec<&'static str> {
    let t = if rng.random_bool(0.5) { "a" } else { "b" };
    let k = |s: &str| -> &'static str { KEYS.iter().find(|k| k.ends_with(s)).unwrap() };
    match script {
        Script::TokenBucket => vec![k(&format!("{t}:b")), k(&format!("{t}:p")), k(":ix")],
        Script::SlidingWindow => vec![k(&format!("{t}:w")), k(&format!("{t}:p")), k(":ix")],
        Script::TokenBuckets => {
            // One limit or both, in either order, the index last.
            let mut keys = vec![k(&format!("{t}:b")), k(&format!("{t}:p"))];
            if rng.random_bool(0.7) {
                let o = if t == "a" { "b" } else { "a" };
                keys.extend([k(&format!("{o}:b")), k(&format!("{o}:p"))]);
            }
            keys.push(k(":ix"));
            keys
        }
        Script::SetParams => {
            let mut keys = vec![k(&format!("{t}:p")), k(&format!("{t}:b"))];
            let o = if t == "a" { "b" } else { "a" };
            if rng.random_bool(0.3) {
                // The replaced version's state: the other bucket.
                keys.push(k(&format!("{o}:b")));
            } else if rng.random_bool(0.3) {
                // A replaced sliding window: its state and parameters, and the new window.
                keys.extend([
                    k(&format!("{o}:w")),
                    k(&format!("{o}:p")),
                    k(&format!("{t}:w")),
                ]);
            }
            keys
        }
        Script::CollectUsage => vec![k(":ix")],
        Script::Refund => vec![k(&format!("{t}:b"))],
        Script::Charge => {
            // With a marker (the spare key) or without.
            let mut keys = vec![k(&format!("{t}:b")), k(&format!("{t}:p")), k(":ix")];
            if rng.random_bool(0.5) {
                keys.push(k(":x"));
            }
            keys
        }
    }
}

/// One random call: keys and args.
fn call(rng: &mut ChaCha8Rng, script: Script) -> (Vec<&'static str>, Vec<String>) {
    let (n_keys, mut n_args) = arity(script);
    let mut keys = role_keys(script, rng);
    if script == Script::TokenBuckets {
        let n = 3 + 3 * (keys.len() - 1) / 2;
        n_args = n..=n;
    }
    if rng.random_bool(0.1) {
        let n = rng.random_range(0..=n_keys + 1);
        keys = (0..n)
            .map(|_| KEYS[rng.random_range(0..KEYS.len())])
            .collect();
    } else if rng.random_bool(0.1) {
        let i = rng.random_range(0..keys.len());
        keys[i] = KEYS[rng.random_range(0..KEYS.len())];
    }
    let count = if rng.random_bool(0.1) {
        rng.random_range(0..=n_args.end() + 2)
    } else {
        rng.random_range(n_args)
    };
    let mutate = if rng.random_bool(0.6) { 0.0 } else { 0.3 };
    let args = (0..count)
        .map(|i| {
            if rng.random_bool(mutate) {
                garbage(rng)
            } else {
                plausible(rng, script, i)
            }
        })
        .collect::<Vec<String>>();
    let mut args = args;
    if script == Script::SetParams && mutate == 0.0 && args.len() >= 4 {
        // Mostly a consistent pair, and a floor only with a lease.
        args[2] = if args[0] == "cap" { "rate" } else { "window" }.to_string();
        if args.get(5).is_none_or(|l| l.is_empty()) {
            for a in args.iter_mut().skip(6).take(2) {
                a.clear();
            }
        }
    }
    (keys, args)
}

/// A token-bucket state of 12 doubles (96 bytes), or of the first 11 (the 88-byte layout
/// without the period) when the period is 1000.
fn state(fields: [f64; 12]) -> Vec<u8> {
    let n = if fields[11] == 1000.0 { 11 } else { 12 };
    fields[..n].iter().flat_map(|f| f.to_le_bytes()).collect()
}

fn valid_state(rng: &mut ChaCha8Rng) -> [f64; 12] {
    let cap = rng.random_range(0..=20u64) as f64 * 1e6;
    let tokens = match rng.random_range(0..5) {
        // In debt (charge.lua), at most the deepest a state may hold.
        0 => -(rng.random_range(0..=30_000_000u64) as f64),
        1 => -(rng.random_range(0..=MAX_CAPACITY_UT) as f64),
        _ => (rng.random_range(0.0..=1.0) * cap).floor(),
    };
    let rate = rng.random_range(0..=5_000_000u64) as f64;
    let leased = rng.random_bool(0.5);
    let per = match rng.random_range(0..3) {
        0 => 1000u64,
        1 => rng.random_range(1..=5_000u64),
        _ => 86_400_000,
    };
    [
        tokens,
        rng.random_range(0..per) as f64,
        (NOW + rng.random_range(0..100_000u64)) as f64,
        rng.random_range(0..3u64) as f64,
        rng.random_range(0..3u64) as f64,
        cap,
        rate,
        rng.random_range(0..2u64) as f64,
        if leased {
            (NOW + rng.random_range(0..100_000u64)) as f64
        } else {
            -1.0
        },
        if leased { cap / 2.0 } else { 0.0 },
        if leased { (rate / 2.0).floor() } else { 0.0 },
        per as f64,
    ]
}

/// Commands that give `key` the content its role expects (so calls reach the decisions), or
/// more often a random type and content.
fn seed_key(rng: &mut ChaCha8Rng, key: &str, pipe: &mut redis::Pipeline) {
    if rng.random_bool(0.5) {
        if key.ends_with(":b") && rng.random_bool(0.5) {
            let f = valid_state(rng);
            pipe.cmd("SET").arg(key).arg(state(f)).ignore();
        } else if key.ends_with(":x") && rng.random_bool(0.5) {
            // A charge's marker: what its first run applied and clamped.
            let (a, c) = (rng.random_range(0..=20u64), rng.random_range(0..=20u64));
            pipe.cmd("SET").arg(key).arg(format!("{a}:{c}")).ignore();
        } else if key.ends_with(":p") && rng.random_bool(0.5) {
            let (f1, f2, v1, v2) = if rng.random_bool(0.5) {
                ("cap", "rate", rng.random_range(0..=20u64) * 1_000_000, 1000)
            } else {
                ("limit", "window", rng.random_range(0..=300u64), 1000)
            };
            pipe.cmd("HSET")
                .arg(key)
                .arg(f1)
                .arg(v1)
                .arg(f2)
                .arg(v2)
                .ignore();
        }
        return;
    }
    seed_any(rng, key, pipe);
}

/// Commands that give `key` a random type and content.
fn seed_any(rng: &mut ChaCha8Rng, key: &str, pipe: &mut redis::Pipeline) {
    let bad_num = [
        f64::NAN,
        f64::INFINITY,
        -1.0,
        1.5,
        1e300,
        -(2f64.powi(63)),
        2f64.powi(53),
    ];
    let hash_val = |rng: &mut ChaCha8Rng| {
        if rng.random_bool(0.6) {
            let i = rng.random_range(0..3);
            plausible(rng, Script::SlidingWindow, i)
        } else {
            garbage(rng)
        }
    };
    match rng.random_range(0..14) {
        0..=2 => {}
        3 => {
            let len = rng.random_range(0..100);
            let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            pipe.cmd("SET").arg(key).arg(bytes).ignore();
        }
        4 | 5 => {
            let mut f = valid_state(rng);
            if rng.random_bool(0.5) {
                f[rng.random_range(0..12)] = bad_num[rng.random_range(0..bad_num.len())];
            }
            pipe.cmd("SET").arg(key).arg(state(f)).ignore();
        }
        6 => {
            pipe.cmd("RPUSH").arg(key).arg("x").ignore();
        }
        7 => {
            pipe.cmd("SADD")
                .arg(key)
                .arg(KEYS[rng.random_range(0..KEYS.len())])
                .ignore();
        }
        8 => {
            pipe.cmd("ZADD").arg(key).arg(1).arg("x").ignore();
        }
        9 => {
            pipe.cmd("XADD")
                .arg(key)
                .arg("*")
                .arg("f")
                .arg("v")
                .ignore();
        }
        10 => {
            // Parameters, valid or not.
            let (f1, f2) = if rng.random_bool(0.5) {
                ("cap", "rate")
            } else {
                ("limit", "window")
            };
            let c = pipe.cmd("HSET").arg(key);
            c.arg(f1).arg(hash_val(rng)).arg(f2).arg(hash_val(rng));
            if f1 == "cap" && rng.random_bool(0.5) {
                let per = if rng.random_bool(0.7) {
                    period(rng)
                } else {
                    garbage(rng)
                };
                c.arg("per").arg(per);
            }
            if rng.random_bool(0.4) {
                let (g1, g2) = if f1 == "cap" {
                    ("fcap", "frate")
                } else {
                    ("flimit", "fwindow")
                };
                c.arg("until")
                    .arg((NOW + rng.random_range(0..100_000u64)).to_string());
                c.arg(g1).arg(hash_val(rng)).arg(g2).arg(hash_val(rng));
            }
            if f1 == "limit" && rng.random_bool(0.3) {
                // A raise held with the parameters, one field of it or both.
                if rng.random_bool(0.9) {
                    c.arg("hlimit").arg(hash_val(rng));
                }
                if rng.random_bool(0.9) {
                    let end = if rng.random_bool(0.7) {
                        (NOW + rng.random_range(0..100_000u64)).to_string()
                    } else {
                        garbage(rng)
                    };
                    c.arg("huntil").arg(end);
                }
            }
            c.ignore();
        }
        11 | 12 => {
            // A window state, valid or not.
            let c = pipe.cmd("HSET").arg(key);
            let t = NOW + rng.random_range(0..50_000u64);
            let log = (0..rng.random_range(0..5))
                .map(|i| format!("{}:{}", t + i * 10, rng.random_range(1..4)))
                .collect::<Vec<_>>()
                .join(",");
            c.arg("l").arg(if rng.random_bool(0.8) {
                log
            } else {
                garbage(rng)
            });
            c.arg("ts").arg(t + 100);
            for f in ["ws", "cu", "pv", "ad", "dn", "x"] {
                if rng.random_bool(0.5) {
                    let v = if rng.random_bool(0.8) {
                        rng.random_range(0..200u64).to_string()
                    } else {
                        garbage(rng)
                    };
                    c.arg(f).arg(v);
                }
            }
            c.ignore();
        }
        _ => {
            pipe.cmd("HSET")
                .arg(key)
                .arg("ad")
                .arg(garbage(rng))
                .ignore();
        }
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(n) => Some(*n),
        _ => None,
    }
}

/// Checks a successful reply against the script's contract; `Err` says what is wrong.
fn check_reply(script: Script, args: &[String], v: &Value) -> Result<(), String> {
    let bad = || Err(format!("{v:?}"));
    match script {
        Script::TokenBucket | Script::SlidingWindow => {
            let Value::Array(a) = v else { return bad() };
            let mut f: Vec<i64> = a.iter().filter_map(int).collect();
            // With a batch (a 7th argument) a fifth field: the multiples spent, at most the
            // batch, none when denied or a peek.
            let batched = script == Script::TokenBucket && args.len() == 7;
            if batched {
                let batch: i64 = args[6]
                    .parse()
                    .map_err(|_| format!("accepted batch {:?}", args[6]))?;
                let granted = f
                    .pop()
                    .filter(|_| a.len() == 5)
                    .ok_or_else(|| format!("{v:?}"))?;
                let allowed = f.first().copied().unwrap_or(0);
                let spent = args[0] != "0" && allowed == 1;
                if !(0..=batch).contains(&granted) || (granted > 0) != spent {
                    return bad();
                }
            }
            let &[allowed, remaining, retry, reset] = f.as_slice() else {
                return bad();
            };
            let max_remaining = if script == Script::TokenBucket {
                MAX_BURST
            } else {
                MAX_WINDOW_LIMIT
            } as i64;
            let min_reset = if script == Script::TokenBucket { -1 } else { 0 };
            let ok = a.len() == 4 + usize::from(batched)
                && (allowed == 0 || allowed == 1)
                && (0..=max_remaining).contains(&remaining)
                && (-1..=MAX_CAPACITY_UT as i64).contains(&retry)
                && (min_reset..=MAX_CAPACITY_UT as i64).contains(&reset)
                && (allowed == 0 || retry == 0)
                && (allowed == 1 || retry == -1 || retry >= 1)
                && (args[0] != "0" || (allowed == 1 && retry == 0));
            if ok {
                Ok(())
            } else {
                bad()
            }
        }
        Script::TokenBuckets => {
            let Value::Array(a) = v else { return bad() };
            let f: Vec<i64> = a.iter().filter_map(int).collect();
            let ok = !f.is_empty()
                && f.len() == a.len()
                && f.len().is_multiple_of(4)
                && f.chunks(4).all(|c| {
                    let &[allowed, remaining, retry, reset] = c else {
                        return false;
                    };
                    (allowed == 0 || allowed == 1)
                        && (0..=MAX_BURST as i64).contains(&remaining)
                        && (-1..=MAX_CAPACITY_UT as i64).contains(&retry)
                        && (-1..=MAX_CAPACITY_UT as i64).contains(&reset)
                        && (allowed == 0 || retry == 0)
                        && (allowed == 1 || retry == -1 || retry >= 1)
                        && (args[0] != "0" || (allowed == 1 && retry == 0))
                });
            if ok {
                Ok(())
            } else {
                bad()
            }
        }
        Script::SetParams => match v {
            Value::Int(1) => Ok(()),
            _ => bad(),
        },
        Script::Refund => match v {
            Value::Int(n) if (-1..=MAX_BURST as i64).contains(n) => Ok(()),
            _ => bad(),
        },
        Script::Charge => {
            let Value::Array(a) = v else { return bad() };
            let f: Vec<i64> = a.iter().filter_map(int).collect();
            let &[applied, clamped, remaining, debt, retry, reset] = f.as_slice() else {
                return bad();
            };
            let cost: i64 = args[0]
                .parse()
                .map_err(|_| format!("accepted cost {:?}", args[0]))?;
            let whole = 0..=(MAX_CAPACITY_UT / 1_000_000 + 1) as i64;
            let wait = -1..=MAX_WAIT_MS as i64;
            let ok = a.len() == 6
                && applied >= 0
                && clamped >= 0
                && applied + clamped == cost
                && whole.contains(&remaining)
                && whole.contains(&debt)
                && (remaining == 0 || debt == 0)
                && wait.contains(&retry)
                && wait.contains(&reset)
                && (retry == 0) == (remaining > 0)
                && (reset != 0 || debt == 0);
            if ok {
                Ok(())
            } else {
                bad()
            }
        }
        Script::CollectUsage => {
            let Value::Array(a) = v else { return bad() };
            let max: i64 = args[0]
                .parse()
                .map_err(|_| format!("accepted max {:?}", args[0]))?;
            let taken = a.first().and_then(int).ok_or_else(|| format!("{v:?}"))?;
            let triples_ok = a[1..].chunks(3).all(|t| {
                matches!(t, [Value::BulkString(_), Value::Int(ad), Value::Int(dn)]
                    if *ad >= 0 && *dn >= 0 && ad + dn > 0)
            });
            if (0..=max).contains(&taken) && (a.len() - 1) % 3 == 0 && triples_ok {
                Ok(())
            } else {
                bad()
            }
        }
    }
}

/// Whether a key's content differs between two snapshots, other than by expiring: a key that
/// had at most a second to live and is gone did not change (the pipeline runs on wall-clock
/// time, and the scripts give keys TTLs of a few ms). A missing key's snapshot is `{-2}`, or
/// `{-2, nil}` when DUMP answered it.
fn changed(before: &Value, after: &Value) -> bool {
    let (Value::Array(b), Value::Array(a)) = (before, after) else {
        return before != after;
    };
    match (b.first(), a.as_slice()) {
        (Some(Value::Int(ttl)), [Value::Int(-2), ..]) if (0..=1000).contains(ttl) => false,
        _ => b.get(1..) != a.get(1..),
    }
}

#[test]
fn scripts_answer_valid_replies_or_quotad_errors_and_errors_change_nothing() {
    let seed: u64 = std::env::var("QUOTAD_LUA_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_2201);
    let per_script: usize = std::env::var("QUOTAD_LUA_FUZZ_CALLS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    println!("lua fuzz seed {seed} ({per_script} calls per script)");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);

    let server = RedisServer::start().unwrap();
    let mut conn = server.client().get_connection().unwrap();
    let shas: Vec<String> = [
        TOKEN_BUCKET_LUA,
        TOKEN_BUCKETS_LUA,
        SLIDING_WINDOW_LUA,
        SET_PARAMS_LUA,
        COLLECT_USAGE_LUA,
        REFUND_LUA,
        CHARGE_LUA,
    ]
    .iter()
    .map(|src| {
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(*src)
            .query(&mut conn)
            .unwrap()
    })
    .collect();

    let snapshot: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(SNAPSHOT_LUA)
        .query(&mut conn)
        .unwrap();
    let mut calls = [0usize; SCRIPTS.len()];
    let mut errors = [0usize; SCRIPTS.len()];
    let mut failures: Vec<String> = Vec::new();
    while calls.iter().any(|&c| c < per_script) && failures.len() < 10 {
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        pipe.cmd("DEL").arg(&KEYS[..]).ignore();
        for k in KEYS {
            seed_key(&mut rng, k, &mut pipe);
        }
        for k in KEYS {
            pipe.cmd("EVALSHA").arg(&snapshot).arg(1).arg(k);
        }
        let mut batch = Vec::with_capacity(BATCH);
        for _ in 0..BATCH {
            let si = rng.random_range(0..SCRIPTS.len());
            let script = SCRIPTS[si];
            let (keys, args) = call(&mut rng, script);
            let c = pipe.cmd("EVALSHA").arg(&shas[si]).arg(keys.len());
            for k in &keys {
                c.arg(*k);
            }
            for a in &args {
                c.arg(a.as_bytes());
            }
            for k in KEYS {
                pipe.cmd("EVALSHA").arg(&snapshot).arg(1).arg(k);
            }
            batch.push((si, keys, args));
        }
        let replies: Vec<Value> = pipe.query(&mut conn).unwrap();
        let step = KEYS.len() + 1;
        assert_eq!(replies.len(), KEYS.len() + BATCH * step);
        for (i, (si, keys, args)) in batch.into_iter().enumerate() {
            let before = &replies[i * step..i * step + KEYS.len()];
            let reply = &replies[i * step + KEYS.len()];
            let after = &replies[(i + 1) * step..(i + 1) * step + KEYS.len()];
            let script = SCRIPTS[si];
            calls[si] += 1;
            let case = format!("{script:?} keys {keys:?} args {args:?}");
            match reply {
                Value::ServerError(e) => {
                    errors[si] += 1;
                    if e.code() != "ERR" || !e.details().unwrap_or("").starts_with("quotad:") {
                        failures.push(format!("{case}: error {e:?}"));
                    }
                    for (k, (b, a)) in KEYS.iter().zip(before.iter().zip(after)) {
                        if changed(b, a) {
                            failures
                                .push(format!("{case}: error {e:?} changed {k}: {b:?} -> {a:?}"));
                        }
                    }
                }
                v => {
                    if let Err(what) = check_reply(script, &args, v) {
                        failures.push(format!("{case}: reply {what}"));
                    }
                }
            }
        }
    }
    println!("calls per script {calls:?}, error replies {errors:?}");
    assert!(
        failures.is_empty(),
        "seed {seed}: {} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The fuzz reached both outcomes for every script.
    for si in 0..SCRIPTS.len() {
        assert!(calls[si] >= per_script, "{:?}", SCRIPTS[si]);
        assert!(
            errors[si] > 0 && errors[si] < calls[si],
            "{:?}: {} errors of {} calls",
            SCRIPTS[si],
            errors[si],
            calls[si]
        );
    }
}
