//! Store benchmark: decisions per second and latency through the `Store` API (embedded and
//! Redis side by side, concurrency 1 and 64, hot key and random keys), and Redis server CPU per
//! decision for `token_bucket.lua` (one packed string: GET + SET PX) against the previous
//! hash-based script (`benches/lua/token_bucket_hash.lua`: HMGET params, HMGET + HSET state), a
//! seed-article-style baseline script, the bare TIME+GET+SET PX floor and the floor of the
//! decision script's contract (its commands, state and reply without its checks or arithmetic),
//! interleaved in one run with ratios.
//!
//! Then a check of two limits at once (`token_buckets.lua`, one EVALSHA) against the same two
//! limits checked one after the other (two EVALSHAs), random keys.
//!
//! `cargo bench -p quota-store --bench store` (release; starts its own redis-server through
//! redis-harness; ~1 min). `QUOTAD_BENCH_SCALE=0.2` shortens it.
//!
//! Server CPU comes from `INFO commandstats` (`cmdstat_evalsha` `usec_per_call`) after
//! `CONFIG RESETSTAT`: time Redis spent inside the script, excluding network and client work.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use quota_core::bucket::UT;
use quota_core::{BucketParams, PolicyName, TenantId};
use quota_store::script::Arg;
use quota_store::{
    BucketRef, CheckRequest, EmbeddedStore, Limit, LimitCheck, MultiCheckRequest, RedisStore,
    RedisStoreConfig, Store,
};
use rand::{Rng, SeedableRng};
use redis_harness::RedisServer;

/// Interleaved rounds of the server-CPU runs (the minimum is reported: it is the least
/// disturbed by other load on the machine).
const ROUNDS: usize = 5;

/// Tenants in the random-keys runs.
const KEYSPACE: u64 = 100_000;

/// Shaped like the seed articles' token bucket: HMGET, refill in floats, HSET, EXPIRE, float
/// arguments (capacity, tokens per second, now in seconds, cost). No usage counters, no
/// validation, no retry-after or reset.
const SEED_BASELINE_LUA: &str = include_str!("lua/seed_baseline.lua");

/// A rejected design (state and parameters in hashes), kept only for comparison.
const HASH_TOKEN_BUCKET_LUA: &str = include_str!("lua/token_bucket_hash.lua");

/// The floor of `token_bucket.lua`'s contract (what it needs from Redis, no checks and no
/// arithmetic).
const CONTRACT_FLOOR_LUA: &str = include_str!("lua/contract_floor.lua");

/// The floor: read Redis time, read a key, write it with an expiry.
const BARE_LUA: &str = include_str!("lua/bare.lua");

fn scale() -> f64 {
    std::env::var("QUOTAD_BENCH_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0)
}

fn scaled(n: usize) -> usize {
    ((n as f64 * scale()) as usize).max(100)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Keys {
    Hot,
    Random,
}

impl Keys {
    fn name(self) -> &'static str {
        match self {
            Self::Hot => "hot key",
            Self::Random => "random keys",
        }
    }
}

fn bucket(tenant: u64) -> BucketRef {
    BucketRef {
        tenant: TenantId::new(format!("bench-{tenant}")).unwrap(),
        policy: PolicyName::new("writes").unwrap(),
        version: 1,
    }
}

/// Mostly admitted: capacity 1000 tokens refilling at 100 000 per second.
fn limit() -> Limit {
    Limit::TokenBucket(BucketParams::new(1000 * UT, 100_000 * UT).unwrap())
}

struct Outcome {
    per_s: f64,
    hist: Histogram<u64>,
}

/// Runs `total` calls of `op(i)` from `concurrency` tasks; latency per call in µs.
async fn load<F, Fut>(concurrency: usize, total: usize, op: F) -> Outcome
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..concurrency {
        let op = op.clone();
        tasks.spawn(async move {
            let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
            let mut i = w;
            while i < total {
                let t = Instant::now();
                op(i).await;
                h.saturating_record(t.elapsed().as_micros() as u64);
                i += concurrency;
            }
            h
        });
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
    while let Some(h) = tasks.join_next().await {
        hist.add(h.unwrap()).unwrap();
    }
    Outcome {
        per_s: total as f64 / started.elapsed().as_secs_f64(),
        hist,
    }
}

/// Key index for call `i`: one hot tenant, or a seeded pseudo-random one.
fn key_of(keys: Keys, i: usize) -> u64 {
    match keys {
        Keys::Hot => 0,
        Keys::Random => {
            let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(i as u64);
            r.random_range(0..KEYSPACE)
        }
    }
}

async fn store_run<S: Store + Clone + 'static>(
    s: &S,
    concurrency: usize,
    total: usize,
    keys: Keys,
) -> Outcome {
    let s = s.clone();
    let hot = bucket(0);
    load(concurrency, total, move |i| {
        let s = s.clone();
        let b = if keys == Keys::Hot {
            hot.clone()
        } else {
            bucket(key_of(keys, i))
        };
        async move {
            let r = CheckRequest {
                bucket: b,
                limit: limit(),
                cost: 1,
                now_ms: None,
            };
            s.check(&r).await.unwrap();
        }
    })
    .await
}

/// The two limits of tenant `t`: a per-second and a per-day bucket, both mostly admitting.
fn two_limits(t: u64) -> [LimitCheck; 2] {
    let day = BucketParams::per_period(1_000_000 * UT, 100_000_000 * UT, 86_400_000).unwrap();
    [
        LimitCheck {
            bucket: bucket(t),
            limit: limit(),
        },
        LimitCheck {
            bucket: BucketRef {
                policy: PolicyName::new("writes_per_day").unwrap(),
                ..bucket(t)
            },
            limit: Limit::TokenBucket(day),
        },
    ]
}

/// Two limits per call, random keys: at once (`multi`) or as two single checks.
async fn two_limit_run<S: Store + Clone + 'static>(
    s: &S,
    concurrency: usize,
    total: usize,
    multi: bool,
) -> Outcome {
    let s = s.clone();
    load(concurrency, total, move |i| {
        let s = s.clone();
        let limits = two_limits(key_of(Keys::Random, i));
        async move {
            if multi {
                let r = MultiCheckRequest {
                    limits: limits.to_vec(),
                    cost: 1,
                    now_ms: None,
                };
                s.check_all(&r).await.unwrap();
            } else {
                for l in limits {
                    let r = CheckRequest {
                        bucket: l.bucket,
                        limit: l.limit,
                        cost: 1,
                        now_ms: None,
                    };
                    s.check(&r).await.unwrap();
                }
            }
        }
    })
    .await
}

async fn reset_stats(c: &mut redis::aio::MultiplexedConnection) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(c)
        .await
        .unwrap();
}

async fn usec_per_evalsha(c: &mut redis::aio::MultiplexedConnection) -> f64 {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(c)
        .await
        .unwrap();
    stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
        .and_then(|rest| {
            rest.split(',')
                .find_map(|kv| kv.strip_prefix("usec_per_call="))
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Writes the bench bucket's parameters with `set_params.lua` for every tenant `keys` touches,
/// as the region agent does: decisions then take the stored parameters (src = 1).
async fn store_params(admin: &mut redis::aio::MultiplexedConnection, keys: Keys) {
    let tenants = match keys {
        Keys::Hot => 0..1,
        Keys::Random => 0..KEYSPACE,
    };
    let set = redis::Script::new(quota_store::script::SET_PARAMS_LUA);
    let _: String = set.prepare_invoke().load_async(admin).await.unwrap();
    let (cap, rate) = ((1000 * UT).to_string(), (100_000 * UT).to_string());
    let mut pipe = redis::pipe();
    for t in tenants {
        let k = quotad_keys(t);
        pipe.cmd("EVALSHA")
            .arg(set.get_hash())
            .arg(2)
            .arg(&k[1])
            .arg(&k[0])
            .arg(&["cap", cap.as_str(), "rate", rate.as_str()][..])
            .ignore();
        if t % 1000 == 999 {
            let _: () = pipe.query_async(admin).await.unwrap();
            pipe = redis::pipe();
        }
    }
    if pipe.cmd_iter().next().is_some() {
        let _: () = pipe.query_async(admin).await.unwrap();
    }
}

/// Server µs per EVALSHA of `script` under `concurrency` callers on one multiplexed connection;
/// with `stored`, after writing every bucket's parameters ([`store_params`]).
async fn server_cpu(
    server: &RedisServer,
    script: &'static str,
    keys: Keys,
    total: usize,
    args: fn(usize) -> Vec<String>,
    key: fn(u64) -> Vec<String>,
    stored: bool,
) -> f64 {
    let client = server.client();
    let mut admin = client.get_multiplexed_async_connection().await.unwrap();
    let conn = client.get_multiplexed_async_connection().await.unwrap();
    let s = Arc::new(redis::Script::new(script));
    let _: String = s
        .prepare_invoke()
        .load_async(&mut admin.clone())
        .await
        .unwrap();
    let _: () = redis::cmd("FLUSHDB").query_async(&mut admin).await.unwrap();
    if stored {
        store_params(&mut admin, keys).await;
    }
    reset_stats(&mut admin).await;
    load(64, total, move |i| {
        let mut c = conn.clone();
        let s = s.clone();
        let k = key(key_of(keys, i));
        let a = args(i);
        async move {
            let mut inv = s.prepare_invoke();
            for k in &k {
                inv.key(k);
            }
            for a in &a {
                inv.arg(a);
            }
            let _: redis::Value = inv.invoke_async(&mut c).await.unwrap();
        }
    })
    .await;
    usec_per_evalsha(&mut admin).await
}

fn quotad_keys(t: u64) -> Vec<String> {
    let b = bucket(t);
    vec![
        b.state_key(quota_core::keys::StateKind::Bucket),
        b.params_key(),
        quota_core::keys::ACTIVE_INDEX.to_string(),
    ]
}

fn quotad_args(_: usize) -> Vec<String> {
    // What a daemon sends for a bucket without a reservation: cost 1, the fallback parameters,
    // Redis TIME, the default minimum idle TTL, the refill period and a batch of 1.
    let req = CheckRequest {
        bucket: bucket(0),
        limit: limit(),
        cost: 1,
        now_ms: None,
    };
    let ttl = quota_store::DEFAULT_MIN_IDLE_TTL_MS.to_string();
    let (args, n) = quota_store::script::decision_args(&req, &ttl);
    let mut out: Vec<String> = args[..n]
        .iter()
        .map(|a| match a {
            Arg::Str(s) => s.to_string(),
            Arg::Num(n) => n.to_string(),
        })
        .collect();
    out.push("1".into());
    out
}

/// The previous script takes cost, fallback pair and now only.
fn hash_args(i: usize) -> Vec<String> {
    quotad_args(i).into_iter().take(4).collect()
}

fn plain_key(t: u64) -> Vec<String> {
    vec![format!("seed:{{bench-{t}}}")]
}

fn seed_args(i: usize) -> Vec<String> {
    // The seed style passes floats: capacity, tokens per second, now in seconds, cost.
    let now = 1_700_000_000.0 + i as f64 * 0.000_013;
    vec![
        "1000.0".into(),
        "100000.5".into(),
        format!("{now:.6}"),
        "1".into(),
    ]
}

fn no_args(_: usize) -> Vec<String> {
    Vec::new()
}

fn row(name: &str, o: &Outcome) {
    println!(
        "  {name:<38} {:>10.0} /s   p50 {:>6} µs   p99 {:>6} µs",
        o.per_s,
        o.hist.value_at_quantile(0.50),
        o.hist.value_at_quantile(0.99)
    );
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    // `cargo bench` passes `--bench`; nothing else is accepted.
    let server = RedisServer::start().expect("redis-server for the benchmark");
    let cfg = RedisStoreConfig::standalone(server.url()).with_timeout(Duration::from_secs(5));
    let redis_store = RedisStore::connect(cfg).await.unwrap();
    let embedded = EmbeddedStore::new();

    println!("== decisions through the Store API (token bucket, cost 1, Redis TIME) ==");
    for keys in [Keys::Hot, Keys::Random] {
        for concurrency in [1, 64] {
            let n_redis = scaled(if concurrency == 1 { 10_000 } else { 100_000 });
            let n_embedded = scaled(if concurrency == 1 { 300_000 } else { 1_000_000 });
            let e = store_run(&embedded, concurrency, n_embedded, keys).await;
            let r = store_run(&redis_store, concurrency, n_redis, keys).await;
            println!("{}, concurrency {concurrency}:", keys.name());
            row("embedded", &e);
            row("redis (1 connection, pipelined)", &r);
        }
    }

    println!();
    println!("== two limits per check (random keys): at once vs two single checks ==");
    for concurrency in [1, 64] {
        let n_redis = scaled(if concurrency == 1 { 10_000 } else { 100_000 });
        let n_embedded = scaled(if concurrency == 1 { 300_000 } else { 1_000_000 });
        println!("concurrency {concurrency}:");
        row(
            "embedded, 2 limits at once",
            &two_limit_run(&embedded, concurrency, n_embedded, true).await,
        );
        row(
            "embedded, 2 single checks",
            &two_limit_run(&embedded, concurrency, n_embedded, false).await,
        );
        row(
            "redis, 2 limits at once (1 EVALSHA)",
            &two_limit_run(&redis_store, concurrency, n_redis, true).await,
        );
        row(
            "redis, 2 single checks (2 EVALSHAs)",
            &two_limit_run(&redis_store, concurrency, n_redis, false).await,
        );
    }

    println!();
    println!("== Redis server CPU per decision (cmdstat_evalsha usec_per_call, 64 callers) ==");
    println!(
        "   minimum of {ROUNDS} interleaved rounds of {} calls each",
        scaled(40_000)
    );
    let n = scaled(40_000);
    // QUOTAD_BENCH_COMPARE_LUA=<file>: another version of token_bucket.lua (e.g. from git),
    // measured in the same interleaved rounds, to show what a change costs.
    let compare = std::env::var("QUOTAD_BENCH_COMPARE_LUA")
        .ok()
        .map(|path| std::fs::read_to_string(&path).expect("QUOTAD_BENCH_COMPARE_LUA file"))
        .map(|src| &*Box::leak(src.into_boxed_str()));
    for keys in [Keys::Hot, Keys::Random] {
        let (mut ours, mut hash, mut seed, mut bare) = (f64::MAX, f64::MAX, f64::MAX, f64::MAX);
        let (mut stored, mut other, mut other_stored) = (f64::MAX, f64::MAX, f64::MAX);
        let (mut floor, mut floor_stored) = (f64::MAX, f64::MAX);
        let tb = quota_store::script::TOKEN_BUCKET_LUA;
        let run =
            |script, stored| server_cpu(&server, script, keys, n, quotad_args, quotad_keys, stored);
        for _ in 0..ROUNDS {
            ours = ours.min(run(tb, false).await);
            stored = stored.min(run(tb, true).await);
            if let Some(src) = compare {
                other = other.min(run(src, false).await);
                other_stored = other_stored.min(run(src, true).await);
            }
            floor = floor.min(run(CONTRACT_FLOOR_LUA, false).await);
            floor_stored = floor_stored.min(run(CONTRACT_FLOOR_LUA, true).await);
            hash = hash.min(
                server_cpu(
                    &server,
                    HASH_TOKEN_BUCKET_LUA,
                    keys,
                    n,
                    hash_args,
                    quotad_keys,
                    false,
                )
                .await,
            );
            seed = seed.min(
                server_cpu(
                    &server,
                    SEED_BASELINE_LUA,
                    keys,
                    n,
                    seed_args,
                    plain_key,
                    false,
                )
                .await,
            );
            bare =
                bare.min(server_cpu(&server, BARE_LUA, keys, n, no_args, plain_key, false).await);
        }
        println!("{}:", keys.name());
        println!("  token_bucket.lua, parameters stored      {stored:>6.2} µs");
        println!("  token_bucket.lua, fallback only          {ours:>6.2} µs");
        println!("  previous token_bucket (hashes)           {hash:>6.2} µs");
        println!("  seed-style baseline (HMGET/HSET/EXPIRE)  {seed:>6.2} µs");
        println!("  bare TIME+GET+SET PX                     {bare:>6.2} µs");
        println!("  contract floor, parameters stored        {floor_stored:>6.2} µs");
        println!("  contract floor, fallback only            {floor:>6.2} µs");
        println!(
            "  ratio stored / seed baseline             {:>6.2}",
            stored / seed
        );
        println!(
            "  ratio fallback only / seed baseline      {:>6.2}",
            ours / seed
        );
        println!(
            "  ratio token_bucket / previous            {:>6.2}",
            ours / hash
        );
        println!(
            "  ratio token_bucket / bare                {:>6.2}",
            ours / bare
        );
        println!(
            "  ratio floor stored · fallback / seed     {:>6.2} · {:.2}",
            floor_stored / seed,
            floor / seed
        );
        println!(
            "  ratio stored · fallback / their floor    {:>6.2} · {:.2}",
            stored / floor_stored,
            ours / floor
        );
        if compare.is_some() {
            println!("  compared script, parameters stored       {other_stored:>6.2} µs");
            println!("  compared script, fallback only           {other:>6.2} µs");
            println!(
                "  ratio stored / compared (stored)         {:>6.2}",
                stored / other_stored
            );
            println!(
                "  ratio fallback / compared (fallback)     {:>6.2}",
                ours / other
            );
        }
    }
}
