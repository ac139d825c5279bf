//! Load benchmark: checks per second and p50/p99 latency through quotad's HTTP API, against a
//! bare axum endpoint doing the same single EVALSHA and against raw EVALSHA of the same
//! `lua/token_bucket.lua` on the same Redis, at the same concurrency, in the same run.
//!
//! ```text
//! cargo bench -p quotad --bench load                      # 5 s per scenario
//! QUOTAD_BENCH_SECS=10 QUOTAD_BENCH_CONCURRENCY=1,16,64 QUOTAD_BENCH_ROUNDS=2 \
//!     cargo bench -p quotad --bench load
//! ```
//!
//! Candidates, each driven by the same load generator:
//!
//! - `raw`: EVALSHA straight from the load generator on one multiplexed redis-rs connection,
//!   so concurrent calls are pipelined: the strongest baseline;
//! - `raw-c`: EVALSHA with one connection per worker and one call in flight on each, as
//!   `redis-benchmark -c N` drives Redis (and as gateways with a connection each would);
//! - `bare`: a minimal axum handler (JSON in, one EVALSHA through a redis-rs
//!   `ConnectionManager`, JSON out) on the server runtime: the cost of HTTP plus a Redis call
//!   with nothing else, i.e. the harness and machine;
//! - `quotad`: `POST /v1/check` through the whole production service (request ids, timeouts,
//!   body limits, metrics, tracing at the default level, RateLimit headers, breaker);
//! - `livez`: quotad's `/livez`, the HTTP floor with no decision at all;
//! - `batch`: `POST /v1/check/batch` with 16 checks (16 tenants) a request, on concurrency / 16
//!   connections, so as many checks are in flight as for the others (concurrency ≥ 16 only;
//!   its latency is a whole batch's);
//! - `hot`: `POST /v1/check` with every worker on one tenant: a hot bucket, decided from
//!   reservations (its row also reports Redis calls per decision, from `INFO commandstats`);
//! - `cold` and `cold-off`: `POST /v1/check` with each worker walking 10 000 tenants, so no
//!   bucket is hot, on quotad and on a second quotad on the same runtime with
//!   `redis.reservations = false`: what reservations cost where they do not apply;
//! - `denied`: every worker on one spent tenant (10 a second): Redis calls per retry interval,
//!   with the denial cache answering the rest.
//!
//! Then `paired`: `livez`, `hot`, `raw`, `echo`, `cold` and `cold-off` again in alternating
//! short slices (`QUOTAD_BENCH_PAIRS`, default 8, of `QUOTAD_BENCH_SLICE_MS`, default 500,
//! each), so whatever the host does between rounds falls on all of them alike; it reports the
//! median and range of the hot tenant's ratios, and of cold over cold-off, per set of slices. On a shared machine whose throughput swings
//! between rounds, these are the ratios to read. `echo` is a minimal axum handler on the server
//! runtime that takes the hot check's request (its JSON body parsed) and answers a body and
//! headers of the same shape, deciding nothing: the HTTP exchange a check is, with no
//! middleware, which `/livez` (a GET with no body) is not.
//!
//! Both servers share the runtime the binary builds (`quotad::server::build_runtime`: one
//! worker per core but one by default; `QUOTAD_WORKER_THREADS=2` to compare) with a real
//! `redis-server` from redis-harness. The load generator is deliberately light, since it shares
//! the cores: one keep-alive HTTP/1.1 connection per worker with a pre-rendered request, on a
//! runtime of its own (`QUOTAD_BENCH_CLIENT_THREADS`, default 1). Every request is admitted
//! (the budget is far above what the run can spend), so every candidate does the same script
//! work. Targets: ≥ 0.70× raw throughput at concurrency 64, ≤ 40 µs added p50 at 1.

// A benchmark measures real elapsed time; the daemon's one-clock-module rule is for the daemon.
#![allow(clippy::disallowed_methods)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use hdrhistogram::Histogram;
use quota_core::bucket::UT;
use quota_core::keys::{self, StateKind};
use quota_core::{BucketParams, PolicyName, TenantId};
use quota_store::script::TOKEN_BUCKET_LUA;
use quota_store::BucketRef;
use quotad::config::Config;
use redis::aio::ConnectionManager;
use redis_harness::RedisServer;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// The binary's allocator (`src/main.rs`), so the bench measures what production runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// redis-server's process id, for its CPU time.
static REDIS_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
const TOKEN: &str = "bench-token";
const TENANTS: usize = 64;
/// The `denied` tenant's limit per second (and burst): its retry interval is 1 s / this.
const DENIED_PER_S: u64 = 10;
/// Tenants the `cold` candidates walk through.
const COLD_TENANTS: usize = 10_000;
/// Checks per request of the `batch` candidate.
const BATCH: usize = 16;
/// Bucket capacity and refill in whole tokens: far above what a run can spend.
const BURST: u64 = 100_000_000;
const LIMIT_PER_S: u64 = 1_000_000;

/// One candidate's figures for one scenario.
struct Outcome {
    ops: u64,
    secs: f64,
    hist: Histogram<u64>,
    /// CPU time spent during the scenario, in ns.
    cpu: Cpu,
}

/// CPU time (ns) of the server runtime, the load generator and redis-server.
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    server: u64,
    client: u64,
    redis: u64,
}

impl Cpu {
    /// Reads the per-thread run time from /proc (zero where unavailable).
    fn now(redis_pid: u32) -> Self {
        Self {
            server: threads_cpu_ns("self", Some(SERVER_THREADS)),
            client: threads_cpu_ns("self", Some(CLIENT_THREAD)),
            redis: threads_cpu_ns(&redis_pid.to_string(), None),
        }
    }

    fn since(self, before: Self) -> Self {
        Self {
            server: self.server.saturating_sub(before.server),
            client: self.client.saturating_sub(before.client),
            redis: self.redis.saturating_sub(before.redis),
        }
    }
}

/// Thread name of the server runtime's threads (quotad and the bare endpoint).
/// The daemon runtime's thread name (`quotad::server::build_runtime`).
const SERVER_THREADS: &str = "quotad-worker";
/// Thread name of the load generator.
const CLIENT_THREAD: &str = "bench-client";

/// Sums the time on CPU of a process's threads whose name starts with `prefix`.
fn threads_cpu_ns(pid: &str, prefix: Option<&str>) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter(|t| {
            prefix.is_none_or(|p| {
                std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with(p))
            })
        })
        .filter_map(|t| {
            let s = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
            s.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum()
}

impl Outcome {
    fn rate(&self) -> f64 {
        self.ops as f64 / self.secs
    }
    /// A latency quantile in µs.
    fn p(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }
    /// CPU µs per operation.
    fn per_op(&self, ns: u64) -> f64 {
        ns as f64 / 1000.0 / self.ops.max(1) as f64
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap()
}

fn tenant(i: usize) -> String {
    format!("bench-tenant-{i}")
}

/// The three keys quota-store passes to the script for a tenant's `bench` policy.
fn script_keys(tenant: &str) -> [String; 3] {
    let b = BucketRef {
        tenant: TenantId::new(tenant).unwrap(),
        policy: PolicyName::new("bench").unwrap(),
        version: 1,
    };
    [
        b.state_key(StateKind::Bucket),
        b.params_key(),
        keys::ACTIVE_INDEX.to_string(),
    ]
}

/// Runs `conc` workers for `secs`; each is built by `worker(index, deadline)` and returns its
/// operation count and latency histogram (ns).
async fn drive<F, Fut>(conc: usize, secs: f64, worker: F) -> Outcome
where
    F: Fn(usize, Instant) -> Fut,
    Fut: std::future::Future<Output = (u64, Histogram<u64>)> + Send + 'static,
{
    let redis_pid = REDIS_PID.load(std::sync::atomic::Ordering::Relaxed);
    let cpu = Cpu::now(redis_pid);
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    let tasks: Vec<_> = (0..conc).map(|w| tokio::spawn(worker(w, end))).collect();
    let mut hist = histogram();
    let mut ops = 0;
    for t in tasks {
        let (n, h) = t.await.unwrap();
        ops += n;
        hist.add(h).unwrap();
    }
    Outcome {
        ops,
        secs: start.elapsed().as_secs_f64(),
        hist,
        cpu: Cpu::now(redis_pid).since(cpu),
    }
}

/// A minimal HTTP/1.1 keep-alive client: one connection, one request in flight, pre-rendered
/// requests, responses parsed with httparse and read to their Content-Length. Nothing is
/// spawned, so a request costs the worker's own task no extra hop.
struct HttpConn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl HttpConn {
    async fn connect(addr: SocketAddr) -> std::io::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream,
            buf: Vec::with_capacity(4096),
        })
    }

    /// Sends one request and returns the response status once its body has been read.
    async fn send(&mut self, request: &[u8]) -> std::io::Result<u16> {
        self.stream.write_all(request).await?;
        self.buf.clear();
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut resp = httparse::Response::new(&mut headers);
            if let httparse::Status::Complete(head) = resp
                .parse(&self.buf)
                .map_err(|e| std::io::Error::other(e.to_string()))?
            {
                let length = resp
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                    .and_then(|h| std::str::from_utf8(h.value).ok()?.parse::<usize>().ok())
                    .ok_or_else(|| std::io::Error::other("response without Content-Length"))?;
                let status = resp.code.unwrap_or(0);
                while self.buf.len() < head + length {
                    self.read_more().await?;
                }
                assert_eq!(self.buf.len(), head + length, "one request in flight");
                return Ok(status);
            }
            self.read_more().await?;
        }
    }

    async fn read_more(&mut self) -> std::io::Result<()> {
        if self.buf.capacity() == self.buf.len() {
            self.buf.reserve(4096);
        }
        if self.stream.read_buf(&mut self.buf).await? == 0 {
            return Err(std::io::Error::other("connection closed"));
        }
        Ok(())
    }
}

fn http_request(method: &str, path: &str, body: &str, token: Option<&str>) -> Vec<u8> {
    let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
    format!(
        "{method} {path} HTTP/1.1\r\nhost: bench\r\n{auth}content-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Drives HTTP requests at `addr`: worker `w` sends `requests[w % len]` over its own connection;
/// each request counts as `per_request` operations (the checks in a batch).
/// How an HTTP candidate's workers send their requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// Worker `w` sends `requests[w]` (modulo their number) over and over; all admitted.
    Same,
    /// Worker `w` starts at `requests[w]` and goes `conc` further after each; all admitted.
    Walk,
    /// As `Same`, on a spent bucket: answered 429, or 200 when a token has come back.
    Denied,
}

/// Drives HTTP requests, as `how` says.
async fn drive_http(
    conc: usize,
    secs: f64,
    addr: SocketAddr,
    requests: Arc<Vec<Vec<u8>>>,
    per_request: u64,
    how: How,
) -> Outcome {
    drive(conc, secs, |w, end| {
        let requests = requests.clone();
        async move {
            let mut conn = HttpConn::connect(addr).await.expect("connecting");
            let mut i = w % requests.len();
            let (mut ops, mut h) = (0, histogram());
            while Instant::now() < end {
                let t0 = Instant::now();
                let request = &requests[i];
                if how == How::Walk {
                    i = (i + conc.max(1)) % requests.len();
                }
                let status = conn.send(request).await.expect("an HTTP request failed");
                assert!(
                    status == 200 || (how == How::Denied && status == 429),
                    "a benchmark request was answered {status}"
                );
                h.record(t0.elapsed().as_nanos() as u64).unwrap();
                ops += per_request;
            }
            (ops, h)
        }
    })
    .await
}

/// Drives raw EVALSHA calls: worker `w` calls on `conns[w]` for its tenant's keys.
async fn drive_raw(
    conc: usize,
    secs: f64,
    script: &Arc<redis::Script>,
    keys: &Arc<Vec<[String; 3]>>,
    conns: Vec<redis::aio::MultiplexedConnection>,
    params: BucketParams,
) -> Outcome {
    let conns = Arc::new(conns);
    drive(conc, secs, |w, end| {
        let (s, k, mut conn) = (script.clone(), keys.clone(), conns[w].clone());
        async move {
            let keys = &k[w % TENANTS];
            let (mut ops, mut h) = (0, histogram());
            while Instant::now() < end {
                let t0 = Instant::now();
                let r: Vec<i64> = s
                    .key(&keys[0])
                    .key(&keys[1])
                    .key(&keys[2])
                    .arg(1)
                    .arg(params.capacity_ut)
                    .arg(params.refill_ut)
                    .arg("")
                    .invoke_async(&mut conn)
                    .await
                    .expect("EVALSHA failed");
                assert_eq!(r.first(), Some(&1), "a raw call was not admitted");
                h.record(t0.elapsed().as_nanos() as u64).unwrap();
                ops += 1;
            }
            (ops, h)
        }
    })
    .await
}

/// The bare candidate's state: the script and one shared connection manager.
#[derive(Clone)]
struct Bare {
    conn: ConnectionManager,
    script: Arc<redis::Script>,
    params: BucketParams,
}

#[derive(serde::Deserialize)]
struct BareBody {
    tenant: String,
    policy: String,
    cost: u64,
}

#[derive(serde::Serialize)]
struct BareAnswer {
    allowed: bool,
    remaining: i64,
}

/// The answer `echo` gives: the fields and sizes of quotad's.
#[derive(serde::Serialize)]
struct EchoAnswer {
    allowed: bool,
    remaining: u64,
    retry_after_ms: u64,
    reset_ms: u64,
    region: &'static str,
    decided_by: &'static str,
    mode: &'static str,
}

/// `echo`: the hot check's exchange (its body parsed, an answer of the same shape and headers)
/// with no decision and no middleware.
async fn echo_check(Json(b): Json<BareBody>) -> axum::response::Response {
    use axum::response::IntoResponse;
    let remaining = BURST - b.cost;
    let headers = [
        (
            "ratelimit-policy",
            format!("\"{}\";q={LIMIT_PER_S};w=1", b.policy),
        ),
        ("ratelimit", format!("\"{}\";r={remaining};t=1", b.policy)),
    ];
    let answer = EchoAnswer {
        allowed: !b.tenant.is_empty(),
        remaining,
        retry_after_ms: 0,
        reset_ms: 1,
        region: "local",
        decided_by: "local",
        mode: "normal",
    };
    (headers, Json(answer)).into_response()
}

/// The bare handler: one EVALSHA of the same script, nothing else.
async fn bare_check(
    State(s): State<Bare>,
    Json(b): Json<BareBody>,
) -> Result<Json<BareAnswer>, axum::http::StatusCode> {
    debug_assert_eq!(b.policy, "bench");
    let [state, params, index] = script_keys(&format!("bare-{}", b.tenant));
    let mut conn = s.conn.clone();
    let reply: Vec<i64> = s
        .script
        .key(state)
        .key(params)
        .key(index)
        .arg(b.cost)
        .arg(s.params.capacity_ut)
        .arg(s.params.refill_ut)
        .arg("")
        .invoke_async(&mut conn)
        .await
        .map_err(|_| axum::http::StatusCode::SERVICE_UNAVAILABLE)?;
    Ok(Json(BareAnswer {
        allowed: reply.first() == Some(&1),
        remaining: reply.get(1).copied().unwrap_or(0),
    }))
}

/// `redis-benchmark`'s own figures for EVALSHA of the same script at `conc` connections:
/// `(op/s, p50 µs, p99 µs)`, or `None` when the tool is missing or fails. A cross-check of the
/// `raw-c` candidate with a load generator written in C.
async fn redis_benchmark(
    port: u16,
    conc: usize,
    requests: u64,
    sha: &str,
) -> Option<(f64, f64, f64)> {
    // `__rand_int__` spreads the calls over `TENANTS` buckets, as the other candidates do.
    let keys = script_keys("rbench-__rand_int__");
    let capacity = (BURST * UT).to_string();
    let rate = (LIMIT_PER_S * UT).to_string();
    let out = tokio::process::Command::new("redis-benchmark")
        .args(["-p", &port.to_string(), "-c", &conc.to_string()])
        .args([
            "-n",
            &requests.to_string(),
            "-r",
            &TENANTS.to_string(),
            "--csv",
        ])
        .args([
            "EVALSHA", sha, "3", &keys[0], &keys[1], &keys[2], "1", &capacity, &rate, "",
        ])
        .output()
        .await
        .ok()?;
    let csv = String::from_utf8(out.stdout).ok()?;
    // "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms",...
    let row = csv.lines().nth(1)?;
    let fields: Vec<f64> = row
        .rsplit("\",\"")
        .filter_map(|f| f.trim_matches('"').parse().ok())
        .collect();
    // Fields from the right: max, p99, p95, p50, min, avg, rps.
    match fields.as_slice() {
        [_, p99, _, p50, _, _, rps, ..] => Some((*rps, p50 * 1000.0, p99 * 1000.0)),
        _ => None,
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// What a run measures, from `QUOTAD_BENCH_…`.
struct Plan {
    secs: f64,
    /// Slice trios of the paired comparison, and each slice's length.
    pairs: usize,
    slice_secs: f64,
    rounds: usize,
    client_threads: usize,
    concs: Vec<usize>,
    /// For profiling one candidate alone: QUOTAD_BENCH_ONLY=quotad (ratios are then NaN).
    only: Option<String>,
}

impl Plan {
    fn from_env() -> Self {
        Self {
            secs: env_or("QUOTAD_BENCH_SECS", 5.0),
            pairs: env_or("QUOTAD_BENCH_PAIRS", 8),
            slice_secs: env_or("QUOTAD_BENCH_SLICE_MS", 500.0) / 1000.0,
            rounds: env_or("QUOTAD_BENCH_ROUNDS", 1),
            client_threads: env_or("QUOTAD_BENCH_CLIENT_THREADS", 1),
            concs: std::env::var("QUOTAD_BENCH_CONCURRENCY")
                .ok()
                .map(|s| s.split(',').filter_map(|c| c.trim().parse().ok()).collect())
                .unwrap_or_else(|| vec![1, 64]),
            only: std::env::var("QUOTAD_BENCH_ONLY").ok(),
        }
    }

    fn wanted(&self, name: &str) -> bool {
        self.only.as_deref().is_none_or(|o| o == name)
    }

    fn secs_of(&self, name: &str) -> f64 {
        if self.wanted(name) {
            self.secs
        } else {
            0.0
        }
    }
}

/// Where the load generator sends its calls.
#[derive(Clone, Copy)]
struct Targets {
    quotad: SocketAddr,
    /// The same daemon with `redis.reservations = false`.
    quotad_off: SocketAddr,
    bare: SocketAddr,
    params: BucketParams,
}

fn main() -> anyhow::Result<()> {
    let plan = Plan::from_env();
    let redis = RedisServer::start()?;
    REDIS_PID.store(redis.pid(), std::sync::atomic::Ordering::Relaxed);
    let params = BucketParams::new(BURST * UT, LIMIT_PER_S * UT)?;

    // quotad and the bare endpoint on one server runtime, as the binary runs on 2 cores.
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let bare_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    bare_listener.set_nonblocking(true)?;
    let off_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    off_listener.set_nonblocking(true)?;
    let targets = Targets {
        quotad: listener.local_addr()?,
        quotad_off: off_listener.local_addr()?,
        bare: bare_listener.local_addr()?,
        params,
    };
    // The single-region coordinator keeps its policies on disk: a throwaway directory each.
    let (data_dir, off_dir) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let settings_in = |dir: &tempfile::TempDir| {
        let redis_url = redis.url();
        let data_path = dir.path().display().to_string();
        let env = move |k: &str| match k {
            "QUOTAD_ADMIN_TOKEN" => Some(TOKEN.to_string()),
            "QUOTAD_REDIS_URL" => Some(redis_url.clone()),
            "QUOTAD_DATA_DIR" => Some(data_path.clone()),
            "QUOTAD_WORKER_THREADS" => std::env::var(k).ok(),
            _ => None,
        };
        Config::load(None, &env).map_err(anyhow::Error::new)
    };
    let settings = settings_in(&data_dir)?;
    let mut off = settings_in(&off_dir)?;
    if let Some(r) = off.config.redis.as_mut() {
        r.reservations = false;
    }
    // Logs as the binary writes them, at the default level.
    quotad::telemetry::init_tracing(&settings.config.telemetry)?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let bare = (bare_listener, redis.client(), params);
    let server = spawn_server((settings, listener), (off, off_listener), bare, stop_rx)?;

    // The load generator on a thread of its own, named so its CPU time can be read.
    let client = std::thread::Builder::new()
        .name(CLIENT_THREAD.into())
        .spawn(move || -> anyhow::Result<()> {
            let rt = client_runtime(plan.client_threads)?;
            rt.block_on(run_client(&plan, &redis, targets))
        })?;
    let ran = client
        .join()
        .map_err(|_| anyhow::anyhow!("the load generator panicked"));
    let _ = stop_tx.send(());
    server
        .join()
        .map_err(|_| anyhow::anyhow!("the quotad thread panicked"))??;
    ran??;
    Ok(())
}

/// quotad and the bare endpoint on the runtime the binary builds (worker threads from the
/// config's default), on a thread named like the runtime's workers: a current-thread runtime
/// runs on this thread.
fn spawn_server(
    (settings, listener): (quotad::config::Settings, std::net::TcpListener),
    (off, off_listener): (quotad::config::Settings, std::net::TcpListener),
    (bare_listener, bare_client, params): (std::net::TcpListener, redis::Client, BucketParams),
    stop_rx: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<std::thread::JoinHandle<anyhow::Result<()>>> {
    let runtime = settings.config.runtime.clone();
    std::thread::Builder::new()
        .name(SERVER_THREADS.into())
        .spawn(move || -> anyhow::Result<()> {
            let rt = quotad::server::build_runtime(&runtime)?;
            rt.block_on(async move {
                let bare = Bare {
                    conn: bare_client.get_connection_manager().await?,
                    script: Arc::new(redis::Script::new(TOKEN_BUCKET_LUA)),
                    params,
                };
                let router = Router::new()
                    .route("/check", post(bare_check))
                    .with_state(bare)
                    .route("/echo", post(echo_check));
                let bare_listener = tokio::net::TcpListener::from_std(bare_listener)?;
                tokio::spawn(async move { axum::serve(bare_listener, router).await });
                let listener = tokio::net::TcpListener::from_std(listener)?;
                let off_listener = tokio::net::TcpListener::from_std(off_listener)?;
                // The exporter the binary installs, so metrics cost what they cost in production
                // (both daemons record into it).
                let metrics = quotad::telemetry::install_metrics()?;
                let (stop_off_tx, stop_off_rx) = tokio::sync::oneshot::channel::<()>();
                let off = tokio::spawn(quotad::server::serve(
                    off,
                    off_listener,
                    Some(metrics.clone()),
                    async move {
                        let _ = stop_off_rx.await;
                    },
                ));
                let served = quotad::server::serve(settings, listener, Some(metrics), async move {
                    let _ = stop_rx.await;
                })
                .await;
                let _ = stop_off_tx.send(());
                off.await??;
                served
            })
        })
}

fn client_runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    if threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(CLIENT_THREAD)
            .enable_all()
            .build()
    }
}

/// Waits for readiness, then creates one policy per tenant with a budget no run can spend.
async fn set_up_quotad(addr: SocketAddr) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut conn = loop {
        match HttpConn::connect(addr).await {
            Ok(mut c) => {
                if let Ok(200) = c.send(&http_request("GET", "/readyz", "", None)).await {
                    break c;
                }
            }
            Err(_) => anyhow::ensure!(Instant::now() < deadline, "quotad did not start"),
        }
        anyhow::ensure!(Instant::now() < deadline, "quotad did not become ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let spec =
        serde_json::json!({"limit": LIMIT_PER_S, "window_ms": 1000, "burst": BURST}).to_string();
    for i in 0..TENANTS {
        let path = format!("/v1/tenants/{}/policies/bench", tenant(i));
        let status = conn
            .send(&http_request("PUT", &path, &spec, Some(TOKEN)))
            .await?;
        anyhow::ensure!((200..300).contains(&status), "PUT policy: {status}");
    }
    let status = conn
        .send(&http_request(
            "PUT",
            "/v1/tenants/hot/policies/bench",
            &spec,
            Some(TOKEN),
        ))
        .await?;
    anyhow::ensure!((200..300).contains(&status), "PUT policy: {status}");
    // 10 a second, burst 10: flooded, a token comes back every 100 ms.
    let denied = serde_json::json!({"limit": DENIED_PER_S, "window_ms": 1000}).to_string();
    let status = conn
        .send(&http_request(
            "PUT",
            "/v1/tenants/denied/policies/bench",
            &denied,
            Some(TOKEN),
        ))
        .await?;
    anyhow::ensure!((200..300).contains(&status), "PUT policy: {status}");
    put_cold(&mut conn).await
}

/// The `cold` candidates' policies, in batches.
async fn put_cold(conn: &mut HttpConn) -> anyhow::Result<()> {
    for chunk in (0..COLD_TENANTS).collect::<Vec<_>>().chunks(200) {
        let policies: Vec<_> = chunk
            .iter()
            .map(|i| {
                serde_json::json!({"tenant": cold_tenant(*i), "policy": "bench",
                    "limit": LIMIT_PER_S, "window_ms": 1000, "burst": BURST})
            })
            .collect();
        let body = serde_json::json!({ "policies": policies }).to_string();
        let status = conn
            .send(&http_request(
                "POST",
                "/v1/policies/batch",
                &body,
                Some(TOKEN),
            ))
            .await?;
        anyhow::ensure!(status == 200, "POST /v1/policies/batch: {status}");
    }
    Ok(())
}

/// Waits for the second daemon and stores the cold tenants' policies there.
async fn set_up_quotad_off(addr: SocketAddr) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut conn = loop {
        if let Ok(mut c) = HttpConn::connect(addr).await {
            if let Ok(200) = c.send(&http_request("GET", "/readyz", "", None)).await {
                break c;
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "the second quotad did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    put_cold(&mut conn).await
}

fn cold_tenant(i: usize) -> String {
    format!("cold-{i}")
}

/// The pre-rendered HTTP requests of each HTTP candidate.
struct Requests {
    quotad: Arc<Vec<Vec<u8>>>,
    batch: Arc<Vec<Vec<u8>>>,
    bare: Arc<Vec<Vec<u8>>>,
    livez: Arc<Vec<Vec<u8>>>,
    hot: Arc<Vec<Vec<u8>>>,
    /// The hot check's request, sent to `echo`.
    echo: Arc<Vec<Vec<u8>>>,
    denied: Arc<Vec<Vec<u8>>>,
    cold: Arc<Vec<Vec<u8>>>,
}

impl Requests {
    fn new() -> Self {
        let check = |prefix: &str| -> Arc<Vec<Vec<u8>>> {
            Arc::new(
                (0..TENANTS)
                    .map(|i| {
                        let body =
                            serde_json::json!({"tenant": tenant(i), "policy": "bench", "cost": 1});
                        http_request("POST", prefix, &body.to_string(), None)
                    })
                    .collect(),
            )
        };
        // Batches of BATCH checks, each for a different tenant.
        let batch = Arc::new(
            (0..TENANTS)
                .map(|w| {
                    let checks: Vec<_> = (0..BATCH)
                        .map(|j| serde_json::json!({"tenant": tenant((w * BATCH + j) % TENANTS), "policy": "bench"}))
                        .collect();
                    http_request("POST", "/v1/check/batch", &serde_json::json!({"checks": checks}).to_string(), None)
                })
                .collect::<Vec<_>>(),
        );
        let to = |path: &str, t: &str| {
            let body = serde_json::json!({"tenant": t, "policy": "bench", "cost": 1});
            http_request("POST", path, &body.to_string(), None)
        };
        let one = |t: &str| to("/v1/check", t);
        Self {
            quotad: check("/v1/check"),
            batch,
            bare: check("/check"),
            livez: Arc::new(vec![b"GET /livez HTTP/1.1\r\nhost: bench\r\n\r\n".to_vec()]),
            hot: Arc::new(vec![one("hot")]),
            echo: Arc::new(vec![to("/echo", "hot")]),
            denied: Arc::new(vec![one("denied")]),
            cold: Arc::new((0..COLD_TENANTS).map(|i| one(&cold_tenant(i))).collect()),
        }
    }
}

/// Raw EVALSHA: the same script and the same keys and arguments quota-store sends.
struct Raw {
    conn: redis::aio::MultiplexedConnection,
    script: Arc<redis::Script>,
    keys: Arc<Vec<[String; 3]>>,
}

impl Raw {
    async fn new(redis: &RedisServer) -> anyhow::Result<Self> {
        let conn = redis.client().get_multiplexed_async_connection().await?;
        let script = Arc::new(redis::Script::new(TOKEN_BUCKET_LUA));
        // Loaded up front: redis-benchmark sends EVALSHA only.
        let _: String = script
            .prepare_invoke()
            .load_async(&mut conn.clone())
            .await?;
        let keys = Arc::new(
            (0..TENANTS)
                .map(|i| script_keys(&format!("raw-{}", tenant(i))))
                .collect(),
        );
        Ok(Self { conn, script, keys })
    }
}

async fn run_client(plan: &Plan, redis: &RedisServer, targets: Targets) -> anyhow::Result<()> {
    set_up_quotad(targets.quotad).await?;
    set_up_quotad_off(targets.quotad_off).await?;
    let requests = Requests::new();
    let raw = Raw::new(redis).await?;
    println!(
        "quotad load benchmark: {} s per scenario, {TENANTS} tenants, {} round(s), \
         load generator on {} thread(s), redis-server {}",
        plan.secs,
        plan.rounds,
        plan.client_threads,
        redis.port()
    );
    println!(
        "{:>5} {:>7} | {:>10} {:>9} {:>9} | {:>6} {:>7} {:>9} | {:>8} {:>8} {:>8}",
        "conc",
        "what",
        "op/s",
        "p50 µs",
        "p99 µs",
        "×raw",
        "×bare",
        "+p50 µs",
        "srv cpu",
        "gen cpu",
        "redis"
    );
    println!("{:>73} (CPU µs per operation)", "");
    for round in 0..plan.rounds {
        for &conc in &plan.concs {
            run_scenario(plan, redis, targets, &requests, &raw, conc, round).await?;
        }
    }
    Ok(())
}

/// The outcomes of one concurrency's candidates.
struct Scenario {
    raw: Outcome,
    raw_c: Outcome,
    bare: Outcome,
    quotad: Outcome,
    livez: Outcome,
    batch: Outcome,
    hot: Outcome,
    /// EVALSHA calls per decision of `hot`.
    hot_calls: f64,
    cold: Outcome,
    cold_off: Outcome,
    denied: Outcome,
    /// EVALSHA calls of `denied` per retry interval of its bucket.
    denied_calls: f64,
}

async fn run_scenario(
    plan: &Plan,
    redis: &RedisServer,
    targets: Targets,
    requests: &Requests,
    raw: &Raw,
    conc: usize,
    round: usize,
) -> anyhow::Result<()> {
    let s = drive_all(plan, redis, targets, requests, raw, conc).await?;
    for (name, o) in [
        ("raw", &s.raw),
        ("raw-c", &s.raw_c),
        ("bare", &s.bare),
        ("quotad", &s.quotad),
        ("livez", &s.livez),
        ("batch", &s.batch),
        ("hot", &s.hot),
        ("cold", &s.cold),
        ("cold-off", &s.cold_off),
        ("denied", &s.denied),
    ] {
        if !plan.wanted(name) || (name == "batch" && conc < BATCH) {
            continue;
        }
        print_row(plan, conc, name, o, &s);
    }
    // redis-benchmark as many calls as raw-c made, so it runs about as long.
    let rbench = if plan.wanted("rbench") {
        let n = s.raw_c.ops.max((plan.secs * 20_000.0) as u64);
        redis_benchmark(redis.port(), conc, n, raw.script.get_hash()).await
    } else {
        None
    };
    if let Some((rps, p50, p99)) = rbench {
        println!(
            "{:>5} {:>7} | {:>10.0} {:>9.1} {:>9.1} | {:>6.2} {:>7.2} {:>+9.1} |  (a process of its own)",
            conc,
            "rbench",
            rps,
            p50,
            p99,
            rps / s.raw.rate(),
            rps / s.bare.rate(),
            p50 - s.raw.p(0.5),
        );
    }
    print_summary(plan, conc, round, &s, rbench.map(|(rps, _, _)| rps));
    if plan.only.is_none() && plan.pairs > 0 {
        paired(plan, targets, requests, raw, conc).await;
    }
    if plan.wanted("hot") || plan.wanted("cold") {
        println!(
            "{:>5} summary | hot tenant {:.2}× raw, {:.2}× livez, p50 {:+.1} µs over livez, \
             {:.4} Redis calls per decision; cold tenants with reservations {:.2}× without; \
             a denied tenant flooding: {:.2} Redis calls per retry interval (round {})",
            conc,
            s.hot.rate() / s.raw.rate(),
            s.hot.rate() / s.livez.rate(),
            s.hot.p(0.5) - s.livez.p(0.5),
            s.hot_calls,
            s.cold.rate() / s.cold_off.rate(),
            s.denied_calls,
            round + 1,
        );
    }
    Ok(())
}

/// The median and the range of `v`.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (median, v[0], v[n - 1])
}

/// The hot tenant against `/livez`, raw EVALSHA pipelined and `echo`, and cold tenants with
/// reservations against without, in alternating short slices (the order reversed every other
/// set), so the host's drift falls on all of them alike.
async fn paired(plan: &Plan, targets: Targets, requests: &Requests, raw: &Raw, conc: usize) {
    let (mut vs_livez, mut vs_raw, mut over) = (Vec::new(), Vec::new(), Vec::new());
    let (mut vs_echo, mut echo_livez, mut vs_cold_off) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..plan.pairs {
        let http = |addr, requests: &Arc<Vec<Vec<u8>>>, how| {
            drive_http(conc, plan.slice_secs, addr, requests.clone(), 1, how)
        };
        let livez = || http(targets.quotad, &requests.livez, How::Same);
        let hot = || http(targets.quotad, &requests.hot, How::Same);
        let echo = || http(targets.bare, &requests.echo, How::Same);
        let cold = || http(targets.quotad, &requests.cold, How::Walk);
        let cold_off = || http(targets.quotad_off, &requests.cold, How::Walk);
        let raw_o = || {
            drive_raw(
                conc,
                plan.slice_secs,
                &raw.script,
                &raw.keys,
                vec![raw.conn.clone(); conc],
                targets.params,
            )
        };
        let (l, h, r, e, c, co) = if i % 2 == 0 {
            let l = livez().await;
            let h = hot().await;
            let r = raw_o().await;
            let e = echo().await;
            let c = cold().await;
            (l, h, r, e, c, cold_off().await)
        } else {
            let co = cold_off().await;
            let c = cold().await;
            let e = echo().await;
            let r = raw_o().await;
            let h = hot().await;
            (livez().await, h, r, e, c, co)
        };
        vs_cold_off.push(c.rate() / co.rate());
        vs_livez.push(h.rate() / l.rate());
        vs_raw.push(h.rate() / r.rate());
        vs_echo.push(h.rate() / e.rate());
        echo_livez.push(e.rate() / l.rate());
        over.push(h.p(0.5) - l.p(0.5));
    }
    let (l, l_lo, l_hi) = spread(vs_livez);
    let (r, r_lo, r_hi) = spread(vs_raw);
    let (e, e_lo, e_hi) = spread(vs_echo);
    let (el, el_lo, el_hi) = spread(echo_livez);
    let (o, o_lo, o_hi) = spread(over);
    let (c, c_lo, c_hi) = spread(vs_cold_off);
    println!(
        "{conc:>5}  paired | hot tenant over {} slice sets of {:.0} ms: {l:.2}× livez \
         ({l_lo:.2}–{l_hi:.2}), {r:.2}× raw ({r_lo:.2}–{r_hi:.2}), {e:.2}× echo \
         ({e_lo:.2}–{e_hi:.2}), p50 {o:+.1} µs over livez ({o_lo:+.1} to {o_hi:+.1}); \
         echo {el:.2}× livez ({el_lo:.2}–{el_hi:.2}); cold tenants with reservations \
         {c:.2}× without ({c_lo:.2}–{c_hi:.2}); medians (ranges)",
        plan.pairs,
        plan.slice_secs * 1000.0,
    );
}

/// Drives every candidate in turn at `conc`.
async fn drive_all(
    plan: &Plan,
    redis: &RedisServer,
    targets: Targets,
    requests: &Requests,
    raw: &Raw,
    conc: usize,
) -> anyhow::Result<Scenario> {
    let params = targets.params;
    // Every worker on the one multiplexed connection: calls are pipelined.
    let shared = vec![raw.conn.clone(); conc];
    let raw_o = drive_raw(
        conc,
        plan.secs_of("raw"),
        &raw.script,
        &raw.keys,
        shared,
        params,
    )
    .await;
    // As redis-benchmark -c drives Redis: a connection per worker.
    let mut own = Vec::with_capacity(conc);
    for _ in 0..conc {
        own.push(redis.client().get_multiplexed_async_connection().await?);
    }
    let raw_c = drive_raw(
        conc,
        plan.secs_of("raw-c"),
        &raw.script,
        &raw.keys,
        own,
        params,
    )
    .await;
    let bare = drive_http(
        conc,
        plan.secs_of("bare"),
        targets.bare,
        requests.bare.clone(),
        1,
        How::Same,
    )
    .await;
    let quotad = drive_http(
        conc,
        plan.secs_of("quotad"),
        targets.quotad,
        requests.quotad.clone(),
        1,
        How::Same,
    )
    .await;
    let livez = drive_http(
        conc,
        plan.secs_of("livez"),
        targets.quotad,
        requests.livez.clone(),
        1,
        How::Same,
    )
    .await;
    // The same number of checks in flight, BATCH to a request.
    let batch_secs = if conc >= BATCH {
        plan.secs_of("batch")
    } else {
        0.0
    };
    let batch = drive_http(
        conc / BATCH,
        batch_secs,
        targets.quotad,
        requests.batch.clone(),
        BATCH as u64,
        How::Same,
    )
    .await;
    let mut conn = raw.conn.clone();
    let before = redis_harness::evalsha_calls(&mut conn).await?;
    let hot = drive_http(
        conc,
        plan.secs_of("hot"),
        targets.quotad,
        requests.hot.clone(),
        1,
        How::Same,
    )
    .await;
    let hot_calls =
        (redis_harness::evalsha_calls(&mut conn).await? - before) as f64 / hot.ops.max(1) as f64;
    let cold = drive_http(
        conc,
        plan.secs_of("cold"),
        targets.quotad,
        requests.cold.clone(),
        1,
        How::Walk,
    )
    .await;
    let cold_off = drive_http(
        conc,
        plan.secs_of("cold-off"),
        targets.quotad_off,
        requests.cold.clone(),
        1,
        How::Walk,
    )
    .await;
    // The flood is on a spent bucket: its burst goes first, uncounted.
    let mut spend = HttpConn::connect(targets.quotad).await?;
    while spend.send(&requests.denied[0]).await? == 200 {}
    let before = redis_harness::evalsha_calls(&mut conn).await?;
    let started = Instant::now();
    let denied = drive_http(
        conc,
        plan.secs_of("denied"),
        targets.quotad,
        requests.denied.clone(),
        1,
        How::Denied,
    )
    .await;
    let intervals = started.elapsed().as_secs_f64() * DENIED_PER_S as f64;
    let denied_calls =
        (redis_harness::evalsha_calls(&mut conn).await? - before) as f64 / intervals.max(1.0);
    Ok(Scenario {
        raw: raw_o,
        raw_c,
        bare,
        quotad,
        livez,
        batch,
        hot,
        hot_calls,
        cold,
        cold_off,
        denied,
        denied_calls,
    })
}

fn print_row(plan: &Plan, conc: usize, name: &str, o: &Outcome, s: &Scenario) {
    if plan.only.is_some() {
        // For scripts/instructions.sh: the exact count, not rate × seconds.
        println!("{conc:>5} {name:>7} | ops {}", o.ops);
    }
    println!(
        "{:>5} {:>7} | {:>10.0} {:>9.1} {:>9.1} | {:>6.2} {:>7.2} {:>+9.1} | {:>8.1} {:>8.1} {:>8.1}",
        conc,
        name,
        o.rate(),
        o.p(0.5),
        o.p(0.99),
        o.rate() / s.raw.rate(),
        o.rate() / s.bare.rate(),
        o.p(0.5) - s.raw.p(0.5),
        o.per_op(o.cpu.server),
        o.per_op(o.cpu.client),
        o.per_op(o.cpu.redis),
    );
}

fn print_summary(plan: &Plan, conc: usize, round: usize, s: &Scenario, rbench_rps: Option<f64>) {
    let (quotad, raw, raw_c, bare, batch) = (&s.quotad, &s.raw, &s.raw_c, &s.bare, &s.batch);
    println!(
        "{:>5} summary | quotad {:.2}× raw, {:.2}× raw-c, {:.2}× redis-benchmark, {:.2}× bare; \
         added p50 vs raw: quotad {:+.1} µs, bare {:+.1} µs{} (round {})",
        conc,
        quotad.rate() / raw.rate(),
        quotad.rate() / raw_c.rate(),
        rbench_rps.map_or(f64::NAN, |rps| quotad.rate() / rps),
        quotad.rate() / bare.rate(),
        quotad.p(0.5) - raw.p(0.5),
        bare.p(0.5) - raw.p(0.5),
        if conc >= BATCH && plan.wanted("batch") {
            format!(
                "; batches of {BATCH}: {:.2}× raw, {:.2}× raw-c",
                batch.rate() / raw.rate(),
                batch.rate() / raw_c.rate()
            )
        } else {
            String::new()
        },
        round + 1,
    );
}
