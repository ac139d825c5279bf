//! Fuzzes every Lua script against a real redis-server: random KEYS counts (repeated keys
//! included), adversarial ARGV strings (negatives, floats, exponents, hex, spaces, inf, nan,
//! 20-digit numbers, unicode, empty) and pre-existing keys of every type (string, list, set,
//! zset, hash, stream, valid and corrupt states, states in debt, charge markers, concurrency
//! slots and their parameters and usage, hold records: made by a real hold.lua call, maybe
//! settled or released by settle.lua, maybe corrupted after, or crafted with a flaw). Every
//! reply must be valid by the script's contract, or an error starting with `ERR quotad:`; a call
//! answered with an error, or with a reply its script documents as writing nothing (a hold or a
//! settle answered again; a settle of a hold unknown, expired or ended otherwise), must change no
//! key: its PTTL may only run down, and its content stays (compared by digests of every key
//! after every call, see `SNAPSHOT_LUA`). Every script must answer both errors and successes,
//! and hold.lua and settle.lua every kind of reply their contracts name.
//!
//! Seeded: `QUOTAD_LUA_FUZZ_SEED=<u64>` replays a run (the seed is printed);
//! `QUOTAD_LUA_FUZZ_CALLS=<n>` sets the calls per script (default 20 000).

use std::collections::{HashMap, HashSet};

use quota_core::bounds::{
    HOLD_MEMORY_MS, MAX_BURST, MAX_CAPACITY_UT, MAX_HOLD_ID_LEN, MAX_HOLD_TTL_MS,
    MAX_LIMITS_PER_CHECK, MAX_PERIOD_MS, MAX_WAIT_MS, MAX_WINDOW_LIMIT,
};
use quota_core::policy::MAX_CONCURRENCY;
use quota_store::script::{
    CHARGE_LUA, COLLECT_USAGE_LUA, HOLD_LUA, REFUND_LUA, SETTLE_LUA, SET_PARAMS_LUA,
    SLIDING_WINDOW_LUA, TOKEN_BUCKETS_LUA, TOKEN_BUCKET_LUA,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use redis::Value;
use redis_harness::RedisServer;

/// Policy a of tenant f: its token-bucket state, parameters and sliding-window state.
const A: [&str; 3] = ["qd:v1:{f}:a:1:b", "qd:v1:{f}:a:1:p", "qd:v1:{f}:a:1:w"];
/// Policy b of tenant f, as `A`.
const B: [&str; 3] = ["qd:v1:{f}:b:1:b", "qd:v1:{f}:b:1:p", "qd:v1:{f}:b:1:w"];
/// The activity index of a standalone Redis.
const IX: &str = "qd:v1:active";
/// The activity index of the holds and settles that seed records, emptied with the others.
const SEED_IX: &str = "qd:v1:{f}:active";
/// A charge's marker (charge.lua's KEYS[4]).
const MARK: &str = "qd:v1:{f}:a:1:b:g:c1";
/// Concurrency limit c of tenant f: its slots, parameters and usage.
const C: [&str; 3] = ["qd:v1:{f}:c:1:c", "qd:v1:{f}:c:1:p", "qd:v1:{f}:c:1:cu"];
/// Hold records of tenant f, the second's id of the longest length.
const H1: &str = "qd:v1:{f}:~h:h1";
const H2: &str = "qd:v1:{f}:~h:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-";
/// A record of tenant f seeded rarely: made and ended by the fuzzed calls.
const H3: &str = "qd:v1:{f}:~h:h3";
/// A record of another tenant than every other key's.
const H_G: &str = "qd:v1:{g}:~h:h1";
/// Not a record's key: its id is one character too long.
const H_LONG: &str =
    "qd:v1:{f}:~h:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-x";

/// The key universe: every call's keys and every pre-existing key come from here; the records
/// come last, seeded after the keys a hold reads.
const KEYS: [&str; 16] = [
    A[0], A[1], A[2], IX, B[0], B[1], B[2], MARK, C[0], C[1], C[2], H1, H2, H3, H_G, H_LONG,
];
/// Calls between two re-seedings of the keys (one pipeline).
const BATCH: usize = 50;
const NOW: u64 = 1_700_000_000_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Script {
    TokenBucket,
    TokenBuckets,
    SlidingWindow,
    SetParams,
    CollectUsage,
    Refund,
    Charge,
    Hold,
    Settle,
}

const SCRIPTS: [Script; 9] = [
    Script::TokenBucket,
    Script::TokenBuckets,
    Script::SlidingWindow,
    Script::SetParams,
    Script::CollectUsage,
    Script::Refund,
    Script::Charge,
    Script::Hold,
    Script::Settle,
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
        "slots",
        "settle",
        "release",
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

/// A stored lease end within the fuzzed times with probability `p`, else garbage.
fn end_or_garbage(rng: &mut ChaCha8Rng, p: f64) -> String {
    if rng.random_bool(p) {
        (NOW + rng.random_range(0..100_000u64)).to_string()
    } else {
        garbage(rng)
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

/// For every key of KEYS a line: its remaining time to live (PTTL), a space and a digest of
/// its content that changes only when the content does: the SHA1 of its DUMP, or of a hash's
/// fields and values sorted by field (the order DUMP gives a large hash moves with its table's
/// rehashing, even on reads); nothing for a missing key. One string for all keys, made after
/// every fuzzed call: parsing contents, or many replies, took the test longer than Redis takes
/// to run the scripts.
const SNAPSHOT_LUA: &str = "
local out = {}
for i, key in ipairs(KEYS) do
  local kind = redis.call('TYPE', key)['ok']
  local content
  if kind == 'none' then
    out[i] = '-2 '
  else
    if kind ~= 'hash' then
      content = redis.call('DUMP', key)
    else
      local h = redis.call('HGETALL', key)
      local at = {}
      for j = 1, #h, 2 do
        at[h[j]] = j
      end
      local fields = {}
      for j = 1, #h, 2 do
        fields[#fields + 1] = h[j]
      end
      table.sort(fields)
      local parts = {}
      for j, f in ipairs(fields) do
        local v = h[at[f] + 1]
        parts[j] = #f .. ':' .. f .. #v .. ':' .. v
      end
      content = table.concat(parts)
    end
    out[i] = string.format('%d ', redis.call('PTTL', key)) .. redis.sha1hex(content)
  end
end
return table.concat(out, '\\n')
";

/// The SHA1s of the scripts, in `SCRIPTS` order, and of the test's own.
struct Shas {
    scripts: Vec<String>,
    snapshot: String,
    record: String,
}

impl Shas {
    fn of(&self, script: Script) -> &str {
        &self.scripts[SCRIPTS.iter().position(|&s| s == script).unwrap()]
    }
}

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
        // A hold of two limits (`hold_call` makes the arguments of both).
        Script::Hold => (6, 12..=12),
        Script::Settle => (2, 4..=4),
    }
}

/// The keys a well-formed call names, by role.
fn role_keys(script: Script, rng: &mut ChaCha8Rng) -> Vec<&'static str> {
    let (mine, other) = if rng.random_bool(0.5) { (A, B) } else { (B, A) };
    match script {
        Script::TokenBucket => vec![mine[0], mine[1], IX],
        Script::SlidingWindow => vec![mine[2], mine[1], IX],
        Script::TokenBuckets => {
            // One limit or both, in either order, the index last.
            let mut keys = vec![mine[0], mine[1]];
            if rng.random_bool(0.7) {
                keys.extend([other[0], other[1]]);
            }
            keys.push(IX);
            keys
        }
        Script::SetParams => {
            let mut keys = vec![mine[1], mine[0]];
            if rng.random_bool(0.3) {
                // The replaced version's state: the other bucket.
                keys.push(other[0]);
            } else if rng.random_bool(0.3) {
                // A replaced sliding window: its state and parameters, and the new window.
                keys.extend([other[2], other[1], mine[2]]);
            }
            keys
        }
        Script::CollectUsage => vec![IX],
        Script::Refund => vec![mine[0]],
        Script::Charge => {
            // With a marker (the spare key) or without.
            let mut keys = vec![mine[0], mine[1], IX];
            if rng.random_bool(0.5) {
                keys.push(MARK);
            }
            keys
        }
        Script::Hold | Script::Settle => unreachable!("made by hold_call"),
    }
}

/// One random call: keys and args.
fn call(rng: &mut ChaCha8Rng, script: Script, requests: &mut Requests) -> Call {
    if matches!(script, Script::Hold | Script::Settle) {
        return hold_call(rng, script, requests);
    }
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
/// more often a random type and content. Not for hold records: `seed_record`.
fn seed_key(rng: &mut ChaCha8Rng, key: &str, pipe: &mut redis::Pipeline) {
    if C.contains(&key) && rng.random_bool(0.5) {
        // Mostly valid: a hold reads all three.
        seed_concurrency(rng, key, pipe);
        return;
    }
    if rng.random_bool(0.5) {
        if (key == A[0] || key == B[0]) && rng.random_bool(0.5) {
            let f = valid_state(rng);
            pipe.cmd("SET").arg(key).arg(state(f)).ignore();
        } else if key == MARK && rng.random_bool(0.5) {
            // A charge's marker: what its first run applied and clamped.
            let (a, c) = (rng.random_range(0..=20u64), rng.random_range(0..=20u64));
            pipe.cmd("SET").arg(key).arg(format!("{a}:{c}")).ignore();
        } else if (key == A[1] || key == B[1]) && rng.random_bool(0.5) {
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
        } else if C.contains(&key) {
            seed_concurrency(rng, key, pipe);
        }
        return;
    }
    seed_any(rng, key, pipe);
}

/// Commands that give a concurrency limit's key the content hold.lua gives it: slots scored by
/// expiry, parameters (a limit, a lease end and a floor) or usage counters, a value now and
/// then out of bounds.
fn seed_concurrency(rng: &mut ChaCha8Rng, key: &str, pipe: &mut redis::Pipeline) {
    let count = |rng: &mut ChaCha8Rng| match rng.random_range(0..10) {
        0 => garbage(rng),
        1 => MAX_CONCURRENCY.to_string(),
        _ => rng.random_range(0..=5u64).to_string(),
    };
    if key == C[0] {
        // Holds' ids, live or expired at the calls' times.
        let c = pipe.cmd("ZADD").arg(key);
        for _ in 0..rng.random_range(1..=6) {
            let id = ["h1", &H2[13..], "x", "y", "z"][rng.random_range(0..5)];
            c.arg(NOW - 100_000 + rng.random_range(0..400_000u64))
                .arg(id);
        }
        c.ignore();
    } else if key == C[1] {
        let c = pipe.cmd("HSET").arg(key);
        if rng.random_bool(0.85) {
            c.arg("slots").arg(count(rng));
        } else {
            c.arg("x").arg("1");
        }
        if rng.random_bool(0.4) {
            // A lease end and the floor from it on, or one of them.
            if rng.random_bool(0.9) {
                let end = end_or_garbage(rng, 0.8);
                c.arg("until").arg(end);
            }
            if rng.random_bool(0.9) {
                c.arg("fslots").arg(count(rng));
            }
        }
        c.ignore();
    } else {
        let c = pipe.cmd("HSET").arg(key);
        for f in ["ad", "dn"] {
            let v = match rng.random_range(0..10) {
                0 => garbage(rng),
                1 => MAX_CAPACITY_UT.to_string(),
                _ => rng.random_range(0..=100u64).to_string(),
            };
            c.arg(f).arg(v);
        }
        c.ignore();
    }
}

/// A call's keys and arguments.
type Call = (Vec<&'static str>, Vec<String>);

/// The well-formed hold.lua and settle.lua calls of each record in a batch, seeding it or
/// fuzzed (before mutation): later calls repeat them (retries, answered again) or differ
/// (refusals).
#[derive(Default)]
struct Requests {
    holds: HashMap<&'static str, Vec<Call>>,
    settles: HashMap<&'static str, Vec<Call>>,
}

/// Now for a hold or a settle: mostly explicit, near `NOW`; for a settle also past any
/// record's memory (HOLD_MEMORY_MS after its hold's longest TTL).
fn hold_now(rng: &mut ChaCha8Rng, settle: bool) -> String {
    match rng.random_range(0..10) {
        0 => String::new(),
        1 if settle => (NOW + rng.random_range(600_000..=4_400_000u64)).to_string(),
        _ => (NOW + rng.random_range(0..200_000u64)).to_string(),
    }
}

/// A minimum idle TTL: empty (the default) or up to 100 s (0 is invalid).
fn min_ttl(rng: &mut ChaCha8Rng) -> String {
    if rng.random_bool(0.5) {
        String::new()
    } else {
        rng.random_range(0..=100_000u64).to_string()
    }
}

/// A well-formed hold.lua call making the hold `record`: on one or both buckets, in either
/// order, or on a slot of the concurrency limit.
fn hold_request(rng: &mut ChaCha8Rng, record: &'static str) -> Call {
    let ttl = match rng.random_range(0..4) {
        0 => rng.random_range(1..=5_000u64),
        1 | 2 => rng.random_range(1..=200_000u64),
        _ => MAX_HOLD_TTL_MS,
    };
    let mut keys = vec![record, IX];
    let mut args = vec![
        rng.random_range(1..=6u64).to_string(),
        ttl.to_string(),
        hold_now(rng, false),
        min_ttl(rng),
    ];
    if rng.random_bool(0.3) {
        keys.extend(C);
        if rng.random_bool(0.9) {
            args[0] = "1".to_string();
        }
        let limit = match rng.random_range(0..10) {
            0 => MAX_CONCURRENCY,
            _ => rng.random_range(0..=5u64),
        };
        let debt = rng.random_range(0..=30u64) * 1_000_000;
        args.extend(["slots".to_string(), limit.to_string(), String::new()]);
        args.push(debt.to_string());
        return (keys, args);
    }
    let (mine, other) = if rng.random_bool(0.5) { (A, B) } else { (B, A) };
    let n = if rng.random_bool(0.6) { 2 } else { 1 };
    for p in [mine, other].iter().take(n) {
        keys.extend([p[0], p[1]]);
        let cap = rng.random_range(0..=20u64) * 1_000_000;
        // The debt limit: none, some, or at (or past) what the fallback capacity leaves.
        let debt = match rng.random_range(0..6) {
            0 => 0,
            1 => MAX_CAPACITY_UT - cap,
            2 => MAX_CAPACITY_UT - cap + 1,
            _ => rng.random_range(0..=30u64) * 1_000_000,
        };
        args.extend([
            cap.to_string(),
            rng.random_range(0..=5_000_000u64).to_string(),
            period(rng),
            debt.to_string(),
        ]);
    }
    (keys, args)
}

/// A well-formed settle.lua call ending the hold `record`: a settle at 0 to 8 tokens (below,
/// at and above the estimates of `hold_request`) or a release.
fn settle_request(rng: &mut ChaCha8Rng, record: &'static str) -> Call {
    let (action, cost) = if rng.random_bool(0.4) {
        ("release", String::new())
    } else {
        ("settle", rng.random_range(0..=8u64).to_string())
    };
    let args = vec![action.to_string(), cost, hold_now(rng, true), min_ttl(rng)];
    (vec![record, IX], args)
}

/// A random hold.lua or settle.lua call: mostly of a record of tenant f, a new well-formed one
/// or an earlier one of the batch again (now maybe later), then mutated as `call` mutates its
/// calls.
fn hold_call(rng: &mut ChaCha8Rng, script: Script, requests: &mut Requests) -> Call {
    let record = match rng.random_range(0..20) {
        0 => H_G,
        1 => H_LONG,
        2..=7 => H1,
        8..=13 => H2,
        _ => H3,
    };
    let hold = script == Script::Hold;
    let earlier = if hold {
        requests.holds.entry(record).or_default()
    } else {
        requests.settles.entry(record).or_default()
    };
    let (mut keys, mut args) = if !earlier.is_empty() && rng.random_bool(0.3) {
        let mut c = earlier[rng.random_range(0..earlier.len())].clone();
        if rng.random_bool(0.5) {
            c.1[2] = hold_now(rng, !hold);
        }
        c
    } else {
        let c = if hold {
            hold_request(rng, record)
        } else {
            settle_request(rng, record)
        };
        // Later calls of the batch repeat it as a retry would.
        earlier.push(c.clone());
        c
    };
    if rng.random_bool(0.1) {
        // Past the most keys (16 limits) too.
        let n = if hold && rng.random_bool(0.2) {
            rng.random_range(33..=36)
        } else {
            rng.random_range(0..=arity(script).0 + 1)
        };
        keys = (0..n)
            .map(|_| KEYS[rng.random_range(0..KEYS.len())])
            .collect();
    } else if rng.random_bool(0.1) {
        let i = rng.random_range(0..keys.len());
        keys[i] = KEYS[rng.random_range(0..KEYS.len())];
    }
    if rng.random_bool(0.1) {
        let n = rng.random_range(0..=args.len() + 2);
        args.truncate(n);
        while args.len() < n {
            args.push(garbage(rng));
        }
    }
    if rng.random_bool(0.4) {
        for a in &mut args {
            if rng.random_bool(0.3) {
                *a = garbage(rng);
            }
        }
    }
    (keys, args)
}

/// Adds an EVALSHA of `sha` making `call` to `pipe`, its reply ignored.
fn eval_ignored(pipe: &mut redis::Pipeline, sha: &str, (keys, args): &Call) {
    let c = pipe.cmd("EVALSHA").arg(sha).arg(keys.len());
    for k in keys {
        c.arg(*k);
    }
    for a in args {
        c.arg(a.as_bytes());
    }
    c.ignore();
}

/// A value for a record's field that hold.lua and settle.lua never write there (or rarely one
/// they do: a state of another field, a number).
fn record_garbage(rng: &mut ChaCha8Rng) -> String {
    const FIXED: &[&str] = &[
        "",
        "x",
        "o",
        "s",
        "r",
        "slots",
        "-1",
        "1.5",
        "0",
        "1",
        "9007199254740992",
        "\u{c1}",
    ];
    if rng.random_bool(0.5) {
        garbage(rng)
    } else {
        FIXED[rng.random_range(0..FIXED.len())].to_string()
    }
}

/// Record fields either script writes.
const RECORD_FIELDS: [&str; 9] = ["s", "k", "c", "t", "e", "f", "l", "a", "r"];

/// Commands that give a hold record key its content: nothing or a random type; a record made
/// by hold.lua, then maybe settled or released by settle.lua, then maybe corrupted (a field
/// deleted or overwritten); or a record crafted with a flaw (`crafted_record`).
fn seed_record(
    rng: &mut ChaCha8Rng,
    key: &'static str,
    pipe: &mut redis::Pipeline,
    shas: &Shas,
    requests: &mut Requests,
) {
    match rng.random_range(0..10) {
        0 => {}
        1 => seed_any(rng, key, pipe),
        2 => {
            let c = pipe.cmd("EVALSHA").arg(&shas.record).arg(1).arg(key);
            for a in crafted_record(rng) {
                c.arg(a.as_bytes());
            }
            c.ignore();
        }
        _ => {
            // Another request when the first was denied or refused (else refused itself). The
            // seeding's own activity index, as the fuzzed one is often of another type.
            for _ in 0..3 {
                let hold = hold_request(rng, key);
                let mut seeding = hold.clone();
                seeding.0[1] = SEED_IX;
                eval_ignored(pipe, shas.of(Script::Hold), &seeding);
                requests.holds.entry(key).or_default().push(hold);
            }
            if rng.random_bool(0.5) {
                let settle = settle_request(rng, key);
                let mut seeding = settle.clone();
                seeding.0[1] = SEED_IX;
                eval_ignored(pipe, shas.of(Script::Settle), &seeding);
                requests.settles.entry(key).or_default().push(settle);
            }
            if rng.random_bool(0.15) {
                let field = RECORD_FIELDS[rng.random_range(0..RECORD_FIELDS.len())];
                if rng.random_bool(0.4) {
                    pipe.cmd("HDEL").arg(key).arg(field).ignore();
                } else {
                    let v = record_garbage(rng);
                    pipe.cmd("HSET")
                        .arg(key)
                        .arg(field)
                        .arg(v.as_bytes())
                        .ignore();
                }
            }
        }
    }
}

/// Stores a record's fields: KEYS[1] the record, ARGV field and value pairs; a value `mp:<json>`
/// is stored as the MessagePack of the JSON (as hold.lua and settle.lua pack their tables).
const RECORD_LUA: &str = "
local args = {}
for i = 1, #ARGV, 2 do
  local v = ARGV[i + 1]
  if string.sub(v, 1, 3) == 'mp:' then
    v = cmsgpack.pack(cjson.decode(string.sub(v, 4)))
  end
  args[i], args[i + 1] = ARGV[i], v
end
return redis.call('HSET', KEYS[1], unpack(args))
";

/// A JSON array of the JSON values `items`.
fn json(items: &[String]) -> String {
    format!("[{}]", items.join(","))
}

/// A key as a JSON string.
fn quoted(key: &str) -> String {
    format!("\"{key}\"")
}

/// Field and value pairs of a hold record (for `RECORD_LUA`) as the scripts write one: open,
/// settled (its results consistent with its costs) or released, of one or two buckets or of a
/// concurrency slot; then mostly with one flaw: a field missing or of a bad value; the limits
/// or results not MessagePack, not a table, of too many limits, of a field too many or too few,
/// a field out of bounds or of another type, a key twice or of another tenant; the limits of
/// the other kind.
fn crafted_record(rng: &mut ChaCha8Rng) -> Vec<String> {
    let slots = rng.random_bool(0.3);
    let phase = ["o", "s", "r"][rng.random_range(0..3)];
    let cost: u64 = if slots { 1 } else { rng.random_range(1..=6) };
    let ttl = rng.random_range(1..=200_000u64);
    let e = NOW + rng.random_range(0..100_000u64) + ttl;
    // Ended by a settle before e, or open: forgotten HOLD_MEMORY_MS after.
    let f = if phase == "o" {
        e
    } else {
        e - rng.random_range(1..=ttl)
    } + HOLD_MEMORY_MS;
    let actual = rng.random_range(0..=8u64);
    let mut limits: Vec<Vec<String>> = if slots {
        let limit = rng.random_range(0..=5u64);
        vec![vec![
            quoted(C[0]),
            quoted(C[1]),
            quoted(C[2]),
            limit.to_string(),
            "0".to_string(),
        ]]
    } else {
        let (mine, other) = if rng.random_bool(0.5) { (A, B) } else { (B, A) };
        let n = rng.random_range(1..=2);
        [mine, other][..n]
            .iter()
            .map(|p| {
                let cap = rng.random_range(0..=20u64) * 1_000_000;
                let rate = rng.random_range(0..=5_000_000u64);
                let per = [1000, 1, 86_400_000][rng.random_range(0..3)];
                let debt = rng.random_range(0..=30u64) * 1_000_000;
                [quoted(p[0]), quoted(p[1])]
                    .into_iter()
                    .chain([cap, rate, per, debt].map(|x| x.to_string()))
                    .collect()
            })
            .collect()
    };
    // The results: {charged, clamped, refunded, remaining, debt} per limit.
    let mut results: Vec<Vec<String>> = (0..limits.len())
        .map(|_| {
            let (charged, clamped, refunded) = if slots {
                (0, 0, 1)
            } else if phase == "s" && actual > cost {
                let charged = rng.random_range(0..=actual - cost);
                (charged, actual - cost - charged, 0)
            } else if phase == "s" {
                (0, 0, cost - actual)
            } else {
                (0, 0, cost)
            };
            let level = rng.random_range(0..=20u64);
            let (left, owed) = if rng.random_bool(0.7) {
                (level, 0)
            } else {
                (0, level)
            };
            [
                charged,
                clamped,
                refunded,
                left,
                if slots { 0 } else { owed },
            ]
            .map(|x| x.to_string())
            .to_vec()
        })
        .collect();
    let bad_values = [
        "-1",
        "1.5",
        "9007199254740992",
        "\"x\"",
        "[]",
        "true",
        "\"qd:v1:{g}:a:1:b\"",
    ];
    let bad = |rng: &mut ChaCha8Rng| bad_values[rng.random_range(0..bad_values.len())].to_string();
    let mut l = None;
    let mut r = None;
    let mut k = slots.then(|| "slots".to_string());
    let flaw = rng.random_range(0..10);
    match flaw {
        // A flaw in the limits.
        2..=5 => {
            let i = rng.random_range(0..limits.len());
            let width = limits[i].len();
            match rng.random_range(0..9) {
                0 => l = Some(["", "x", "\u{c1}", "\u{91}"][rng.random_range(0..4)].to_string()),
                1 => {
                    l = Some(format!(
                        "mp:{}",
                        ["\"x\"", "[]", "[1]", "7"][rng.random_range(0..4)]
                    ))
                }
                2 => limits = vec![limits[0].clone(); MAX_LIMITS_PER_CHECK as usize + 1],
                3 | 4 => limits[i][rng.random_range(0..width)] = bad(rng),
                5 => limits[i].push("0".to_string()),
                6 => {
                    limits[i].pop();
                }
                7 => limits[i][1] = limits[i][0].clone(),
                _ => {
                    k = if slots {
                        None
                    } else {
                        Some("slots".to_string())
                    }
                }
            }
        }
        // A flaw in the results of an ended hold.
        6 | 7 if phase != "o" => {
            let i = rng.random_range(0..results.len());
            match rng.random_range(0..6) {
                0 => r = Some(["", "x", "\u{c1}"][rng.random_range(0..3)].to_string()),
                1 => results.push(results[0].clone()),
                2 => results.clear(),
                3 => {
                    results[i].pop();
                }
                _ => results[i][rng.random_range(0..5)] = bad(rng),
            }
        }
        _ => {}
    }
    let mut fields: Vec<(&str, String)> = vec![
        ("s", phase.to_string()),
        ("c", cost.to_string()),
        ("t", ttl.to_string()),
        ("e", e.to_string()),
        ("f", f.to_string()),
        (
            "l",
            l.unwrap_or_else(|| {
                format!(
                    "mp:{}",
                    json(&limits.iter().map(|x| json(x)).collect::<Vec<_>>())
                )
            }),
        ),
    ];
    if let Some(k) = k {
        fields.push(("k", k));
    }
    if phase == "s" {
        fields.push(("a", actual.to_string()));
    }
    if phase != "o" {
        let packed = format!(
            "mp:{}",
            json(&results.iter().map(|x| json(x)).collect::<Vec<_>>())
        );
        fields.push(("r", r.unwrap_or(packed)));
    }
    match flaw {
        // A field missing, or of a bad value.
        8 => {
            fields.remove(rng.random_range(0..fields.len()));
        }
        9 => {
            let i = rng.random_range(0..fields.len());
            fields[i].1 = record_garbage(rng);
        }
        _ => {}
    }
    fields
        .into_iter()
        .flat_map(|(f, v)| [f.to_string(), v])
        .collect()
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
                    let end = end_or_garbage(rng, 0.7);
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

/// Checks a successful reply against the script's contract; `Err` says what is wrong. For
/// hold.lua and settle.lua, the kind of reply (`HOLD_REPLIES`, `SETTLE_REPLIES`).
fn check_reply(
    script: Script,
    keys: &[&str],
    args: &[String],
    v: &Value,
) -> Result<Option<&'static str>, String> {
    match script {
        Script::Hold => check_hold(keys, args, v).map(Some),
        Script::Settle => check_settle(keys, args, v).map(Some),
        _ => check_decision(script, args, v).map(|()| None),
    }
}

/// The kinds of hold.lua's replies.
const HOLD_REPLIES: [&str; 6] = [
    "held",
    "denied",
    "replayed",
    "slot held",
    "slot denied",
    "slot replayed",
];

/// The kinds of settle.lua's replies.
const SETTLE_REPLIES: [&str; 6] = [
    "no hold", "settled", "released", "replayed", "expired", "refused",
];

/// The kinds of reply their scripts document as writing nothing: a hold or a settle answered
/// again, a settle of no hold (never made or forgotten), of an expired one, or refused.
const WRITING_NOTHING: [&str; 5] = ["replayed", "slot replayed", "no hold", "expired", "refused"];

/// A decimal integer argument as the scripts take one: 1 to 16 digits and nothing else.
fn dec(s: &str) -> Option<u64> {
    let ok = (1..=16).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_digit());
    ok.then(|| s.parse().unwrap())
}

/// An optional now ('': Redis TIME, `Some(None)`), if valid at most `max`.
fn opt_now(s: &str, max: u64) -> Option<Option<u64>> {
    if s.is_empty() {
        Some(None)
    } else {
        dec(s).filter(|&n| n <= max).map(Some)
    }
}

/// Whether a minimum idle TTL argument is valid: empty, or 1..2^53-1.
fn min_ttl_ok(s: &str) -> bool {
    s.is_empty() || dec(s).is_some_and(|n| (1..=MAX_CAPACITY_UT).contains(&n))
}

/// The prefix every other key of a hold shares (`qd:v1:{tenant}:`), when `record` is the key
/// of a hold record: `qd:v1:{tenant}:~h:<id>`, the id 1 to 64 of `A-Za-z0-9_-`.
fn record_prefix(record: &str) -> Option<&str> {
    let rest = record.strip_prefix("qd:v1:{")?;
    let close = rest.find('}')?;
    let id = rest[close + 1..].strip_prefix(":~h:")?;
    let id_ok = (1..=MAX_HOLD_ID_LEN).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    (close > 0 && id_ok).then(|| &record[.."qd:v1:{".len() + close + 2])
}

/// Whether no key comes twice.
fn distinct(keys: &[&str]) -> bool {
    keys.iter().collect::<HashSet<_>>().len() == keys.len()
}

/// Whether hold.lua may accept these keys and arguments by its header (the fallbacks' bounds
/// on each other aside): its slots form, and the number of limits, when so.
fn hold_accepts(keys: &[&str], args: &[String]) -> Result<(bool, usize), String> {
    let refuse = |what: &str| Err(format!("accepted {what}"));
    let slots = args.get(4).is_some_and(|a| a == "slots");
    let n = if slots {
        1
    } else {
        keys.len().saturating_sub(2) / 2
    };
    let count_ok = if slots {
        keys.len() == 5
    } else {
        keys.len() >= 4 && keys.len().is_multiple_of(2) && n <= MAX_LIMITS_PER_CHECK as usize
    };
    if !count_ok || !distinct(keys) {
        return refuse("its keys");
    }
    let Some(prefix) = record_prefix(keys[0]) else {
        return refuse("a record key not of its form");
    };
    if keys[2..].iter().any(|k| !k.starts_with(prefix)) {
        return refuse("a key of another tenant");
    }
    if args.len() != 4 + 4 * n {
        return refuse("a wrong argument count");
    }
    let estimate = dec(&args[0]).filter(|&c| (1..=MAX_CAPACITY_UT / 1_000_000).contains(&c));
    let ttl = dec(&args[1]).filter(|&t| (1..=MAX_HOLD_TTL_MS).contains(&t));
    let (Some(estimate), Some(ttl)) = (estimate, ttl) else {
        return refuse("its estimate or ttl");
    };
    let late = MAX_CAPACITY_UT - ttl - HOLD_MEMORY_MS;
    if (slots && estimate != 1) || opt_now(&args[2], late).is_none() || !min_ttl_ok(&args[3]) {
        return refuse("its estimate, now or minimum TTL");
    }
    let limits_ok = if slots {
        dec(&args[5]).is_some_and(|l| l <= MAX_CONCURRENCY)
            && args[6].is_empty()
            && dec(&args[7]).is_some_and(|d| d <= MAX_CAPACITY_UT)
    } else {
        args[4..].chunks(4).all(|l| {
            let per_ok =
                l[2].is_empty() || dec(&l[2]).is_some_and(|p| (1..=MAX_PERIOD_MS).contains(&p));
            [&l[0], &l[1], &l[3]]
                .iter()
                .all(|x| dec(x).is_some_and(|x| x <= MAX_CAPACITY_UT))
                && per_ok
        })
    };
    if !limits_ok {
        return refuse("a limit's arguments");
    }
    Ok((slots, n))
}

/// hold.lua's reply: {held, expires_at_ms, replayed, then allowed, remaining, retry_after_ms,
/// reset_ms per limit}.
fn check_hold(keys: &[&str], args: &[String], v: &Value) -> Result<&'static str, String> {
    let bad = || Err(format!("{v:?}"));
    let (slots, n) = hold_accepts(keys, args)?;
    let Value::Array(a) = v else { return bad() };
    let f: Vec<i64> = a.iter().filter_map(int).collect();
    if f.len() != a.len() || f.len() != 3 + 4 * n {
        return bad();
    }
    let (held, expires, replayed) = (f[0] == 1, f[1], f[2] == 1);
    let ttl = dec(&args[1]).unwrap() as i64;
    let now = opt_now(&args[2], MAX_CAPACITY_UT).unwrap();
    let expires_ok = if replayed {
        (0..=MAX_CAPACITY_UT as i64).contains(&expires)
    } else {
        // Redis TIME is past NOW.
        now.map_or(expires >= NOW as i64 + ttl, |now| {
            expires == now as i64 + ttl
        })
    };
    let max_remaining = if slots { MAX_CONCURRENCY } else { MAX_BURST } as i64;
    let wait = -1..=MAX_WAIT_MS as i64;
    let limits_ok = f[3..].chunks(4).all(|l| {
        let &[allowed, remaining, retry, reset] = l else {
            return false;
        };
        (allowed == 0 || allowed == 1)
            && (0..=max_remaining).contains(&remaining)
            && wait.contains(&retry)
            && wait.contains(&reset)
            && (allowed == 0 || retry == 0)
            && (allowed == 1 || retry == -1 || retry >= 1)
            && (!held || allowed == 1)
            && (!slots || (reset >= 0 && (allowed == 1 || remaining == 0)))
            // A slot taken lives ttl ms; a bucket spent on is below its capacity.
            && (!held || replayed || if slots { reset >= ttl } else { reset != 0 })
    });
    let ok = (f[0] == 0 || held)
        && (f[2] == 0 || replayed)
        && (held || !replayed)
        && expires_ok
        && limits_ok
        && (held || f[3..].chunks(4).any(|l| l[0] == 0));
    if !ok {
        return bad();
    }
    Ok(match (slots, held, replayed) {
        (false, true, false) => "held",
        (false, false, _) => "denied",
        (false, true, true) => "replayed",
        (true, true, false) => "slot held",
        (true, false, _) => "slot denied",
        (true, true, true) => "slot replayed",
    })
}

/// Whether a refusal's reason is the one settle.lua gives for this call: a release of a
/// settled hold, or a settle of a released one or of one settled at another cost.
fn refusal_ok(why: &[u8], release: bool, actual: u64) -> bool {
    let Ok(why) = std::str::from_utf8(why) else {
        return false;
    };
    if why == "released: a released hold is not settled" {
        return !release;
    }
    let Some((a, tail)) = why
        .strip_prefix("settled at ")
        .and_then(|r| r.split_once(" tokens"))
    else {
        return false;
    };
    let Some(a) = dec(a).filter(|&a| a <= MAX_CAPACITY_UT / 1_000_000) else {
        return false;
    };
    if release {
        tail == ": a settled hold is not released"
    } else {
        a != actual && tail == format!(", not {actual}")
    }
}

/// settle.lua's reply: {0}; {1, replayed, then state key, charged, clamped, refunded, remaining,
/// debt per limit}; {2, expired_at_ms}; {3, why}.
fn check_settle(keys: &[&str], args: &[String], v: &Value) -> Result<&'static str, String> {
    let bad = || Err(format!("{v:?}"));
    let prefix = record_prefix(keys.first().unwrap_or(&""))
        .filter(|_| keys.len() == 2 && distinct(keys))
        .ok_or("accepted its keys")?;
    let max_cost = MAX_CAPACITY_UT / 1_000_000;
    let [action, cost, now, min_ttl] = args else {
        return Err("accepted an argument count".to_string());
    };
    let release = action == "release";
    let actual = match action.as_str() {
        "release" if cost.is_empty() => 0,
        "settle" => dec(cost)
            .filter(|&c| c <= max_cost)
            .ok_or("accepted a cost")?,
        _ => return Err("accepted its action".to_string()),
    };
    let now = opt_now(now, MAX_CAPACITY_UT - HOLD_MEMORY_MS)
        .filter(|_| min_ttl_ok(min_ttl))
        .ok_or("accepted its now or minimum TTL")?;
    let Value::Array(a) = v else { return bad() };
    match a.as_slice() {
        [Value::Int(0)] => Ok("no hold"),
        [Value::Int(2), Value::Int(e)]
            if (0..=MAX_CAPACITY_UT as i64).contains(e) && now.is_none_or(|n| *e <= n as i64) =>
        {
            Ok("expired")
        }
        [Value::Int(3), Value::BulkString(why)] if refusal_ok(why, release, actual) => {
            Ok("refused")
        }
        [Value::Int(1), Value::Int(replayed @ 0..=1), rest @ ..] => {
            let n = rest.len() / 6;
            if n < 1 || n > MAX_LIMITS_PER_CHECK as usize || rest.len() % 6 != 0 {
                return bad();
            }
            let whole = 0..=(MAX_BURST + 1) as i64;
            let cost = 0..=max_cost as i64;
            let mut limits = Vec::with_capacity(n);
            for l in rest.chunks(6) {
                let [Value::BulkString(key), x @ ..] = l else {
                    return bad();
                };
                let x: Vec<i64> = x.iter().filter_map(int).collect();
                let &[charged, clamped, refunded, remaining, debt] = x.as_slice() else {
                    return bad();
                };
                let ok = key.starts_with(prefix.as_bytes())
                    && cost.contains(&charged)
                    && cost.contains(&clamped)
                    && cost.contains(&refunded)
                    && whole.contains(&remaining)
                    && whole.contains(&debt)
                    && (remaining == 0 || debt == 0)
                    && (charged + clamped == 0 || refunded == 0);
                if !ok {
                    return bad();
                }
                limits.push((charged + clamped, refunded));
            }
            // The same excess, or the same difference, on every limit.
            let (excess, refunded) = limits[0];
            if limits.iter().any(|&l| l != (excess, refunded)) {
                return bad();
            }
            if *replayed == 1 {
                // The results of an earlier call, as the record keeps them.
                return Ok("replayed");
            }
            if release {
                if excess != 0 || refunded < 1 {
                    return bad();
                }
                return Ok("released");
            }
            // Above an estimate of at least 1.
            if excess > 0 && excess >= actual as i64 {
                return bad();
            }
            Ok("settled")
        }
        _ => bad(),
    }
}

/// Checks a successful reply of the other scripts.
fn check_decision(script: Script, args: &[String], v: &Value) -> Result<(), String> {
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
        Script::Hold | Script::Settle => unreachable!("check_hold, check_settle"),
    }
}

/// Whether a key differs between two snapshots (`PTTL digest`), other than by running down its
/// TTL or expiring: a key that had at most a second to live and is gone did not change (the
/// pipeline runs on wall-clock time, and the scripts give keys TTLs of a few ms). A TTL set on
/// a persistent key, removed, or raised by more than a second (a clock stepping back moves TTLs
/// a little) is a write.
fn changed(before: &str, after: &str) -> bool {
    fn split(s: &str) -> (i64, &str) {
        let (ttl, digest) = s.split_once(' ').expect("PTTL digest");
        (ttl.parse().expect("PTTL"), digest)
    }
    let ((tb, b), (ta, a)) = (split(before), split(after));
    if ta == -2 && (0..=1000).contains(&tb) {
        return false;
    }
    b != a || (tb == -1) != (ta == -1) || (tb >= 0 && ta > tb + 1000)
}

/// A snapshot's line of every key, in KEYS order.
fn per_key(snapshot: &Value) -> Vec<&str> {
    let lines: Vec<&str> = match snapshot {
        Value::BulkString(s) => std::str::from_utf8(s)
            .expect("snapshot")
            .split('\n')
            .collect(),
        v => panic!("snapshot {v:?}"),
    };
    assert_eq!(lines.len(), KEYS.len(), "snapshot {lines:?}");
    lines
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
    let mut load = |src: &str| -> String {
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(src)
            .query(&mut conn)
            .unwrap()
    };
    let shas = Shas {
        scripts: SCRIPTS
            .map(|s| match s {
                Script::TokenBucket => TOKEN_BUCKET_LUA,
                Script::TokenBuckets => TOKEN_BUCKETS_LUA,
                Script::SlidingWindow => SLIDING_WINDOW_LUA,
                Script::SetParams => SET_PARAMS_LUA,
                Script::CollectUsage => COLLECT_USAGE_LUA,
                Script::Refund => REFUND_LUA,
                Script::Charge => CHARGE_LUA,
                Script::Hold => HOLD_LUA,
                Script::Settle => SETTLE_LUA,
            })
            .map(&mut load)
            .to_vec(),
        snapshot: load(SNAPSHOT_LUA),
        record: load(RECORD_LUA),
    };

    let mut calls = [0usize; SCRIPTS.len()];
    let mut errors = [0usize; SCRIPTS.len()];
    let mut kinds: HashMap<(Script, &str), usize> = HashMap::new();
    let mut failures: Vec<String> = Vec::new();
    while calls.iter().any(|&c| c < per_script) && failures.len() < 10 {
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        pipe.cmd("DEL").arg(&KEYS[..]).arg(SEED_IX).ignore();
        let mut requests = Requests::default();
        for k in KEYS {
            if [H1, H2, H_G].contains(&k) {
                seed_record(&mut rng, k, &mut pipe, &shas, &mut requests);
            } else if k == H3 {
                if rng.random_bool(0.2) {
                    seed_any(&mut rng, k, &mut pipe);
                }
            } else {
                seed_key(&mut rng, k, &mut pipe);
            }
        }
        pipe.cmd("EVALSHA")
            .arg(&shas.snapshot)
            .arg(KEYS.len())
            .arg(&KEYS[..]);
        let mut batch = Vec::with_capacity(BATCH);
        for _ in 0..BATCH {
            let si = rng.random_range(0..SCRIPTS.len());
            let script = SCRIPTS[si];
            let (keys, args) = call(&mut rng, script, &mut requests);
            let c = pipe.cmd("EVALSHA").arg(&shas.scripts[si]).arg(keys.len());
            for k in &keys {
                c.arg(*k);
            }
            for a in &args {
                c.arg(a.as_bytes());
            }
            pipe.cmd("EVALSHA")
                .arg(&shas.snapshot)
                .arg(KEYS.len())
                .arg(&KEYS[..]);
            batch.push((si, keys, args));
        }
        let replies: Vec<Value> = pipe.query(&mut conn).unwrap();
        assert_eq!(replies.len(), 1 + 2 * BATCH);
        for (i, (si, keys, args)) in batch.into_iter().enumerate() {
            let before = per_key(&replies[2 * i]);
            let reply = &replies[2 * i + 1];
            let after = per_key(&replies[2 * i + 2]);
            let script = SCRIPTS[si];
            calls[si] += 1;
            let case = || format!("{script:?} keys {keys:?} args {args:?}");
            let mut unchanged = |what: &str| {
                for (k, (b, a)) in KEYS.iter().zip(before.iter().zip(&after)) {
                    if changed(b, a) {
                        failures.push(format!("{}: {what} changed {k}: {b:?} -> {a:?}", case()));
                    }
                }
            };
            match reply {
                Value::ServerError(e) => {
                    errors[si] += 1;
                    let what = format!("error {e:?}");
                    unchanged(&what);
                    if e.code() != "ERR" || !e.details().unwrap_or("").starts_with("quotad:") {
                        failures.push(format!("{}: {what}", case()));
                    }
                }
                v => match check_reply(script, &keys, &args, v) {
                    Err(what) => failures.push(format!("{}: reply {what}", case())),
                    Ok(Some(kind)) => {
                        *kinds.entry((script, kind)).or_default() += 1;
                        if WRITING_NOTHING.contains(&kind) {
                            unchanged(&format!("reply {kind} {v:?}"));
                        }
                    }
                    Ok(None) => {}
                },
            }
        }
    }
    println!("calls per script {calls:?}, error replies {errors:?}");
    let count = |script, names: &[&'static str]| -> Vec<(&'static str, usize)> {
        names
            .iter()
            .map(|&n| (n, kinds.get(&(script, n)).copied().unwrap_or(0)))
            .collect()
    };
    let hold_kinds = count(Script::Hold, &HOLD_REPLIES);
    let settle_kinds = count(Script::Settle, &SETTLE_REPLIES);
    println!("hold replies {hold_kinds:?}\nsettle replies {settle_kinds:?}");
    assert!(
        failures.is_empty(),
        "seed {seed}: {} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The fuzz reached both outcomes for every script, and every kind of reply of the holds.
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
    for (kind, n) in hold_kinds.iter().chain(&settle_kinds) {
        assert!(*n > 0, "no reply {kind}: {hold_kinds:?} {settle_kinds:?}");
    }
}
