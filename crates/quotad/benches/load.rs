//! Load benchmark: checks per second and p50/p99 latency through quotad's HTTP API versus raw
//! EVALSHA of the same `lua/token_bucket.lua` on the same Redis, at the same concurrency, in
//! the same run.
//!
//! ```text
//! cargo bench -p quotad --bench load                      # 5 s per scenario
//! QUOTAD_BENCH_SECS=10 QUOTAD_BENCH_CONCURRENCY=1,16,64 cargo bench -p quotad --bench load
//! ```
//!
//! quotad runs in process on its own 2-worker runtime (as the binary would) with a real
//! `redis-server` from redis-harness; the load generator runs on another runtime. Every request
//! is admitted (the budget is far above what the run can spend), so both paths do the same
//! script work. Targets: ≥ 0.70× raw throughput at concurrency 64, ≤ 40 µs added p50 at 1.

// A benchmark measures real elapsed time; the daemon's one-clock-module rule is for the daemon.
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use quota_core::bucket::UT;
use quota_core::keys::{self, StateKind};
use quota_core::{BucketParams, PolicyName, TenantId};
use quota_store::script::TOKEN_BUCKET_LUA;
use quota_store::BucketRef;
use quotad::config::Config;
use redis_harness::RedisServer;

const TOKEN: &str = "bench-token";
const TENANTS: usize = 64;

struct Result_ {
    ops: u64,
    secs: f64,
    hist: Histogram<u64>,
}

impl Result_ {
    fn rate(&self) -> f64 {
        self.ops as f64 / self.secs
    }
    fn p(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }
}

fn tenant(i: usize) -> String {
    format!("bench-tenant-{i}")
}

/// Runs `conc` workers calling `op(worker)` for `secs`, recording latency in ns.
async fn drive<F, Fut>(conc: usize, secs: f64, op: F) -> Result_
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for w in 0..conc {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
            let mut ops = 0u64;
            while Instant::now() < end {
                let t0 = Instant::now();
                assert!(op(w).await, "a benchmark request failed");
                h.record(t0.elapsed().as_nanos() as u64).unwrap();
                ops += 1;
            }
            (ops, h)
        }));
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    let mut ops = 0;
    for t in tasks {
        let (n, h) = t.await.unwrap();
        ops += n;
        hist.add(h).unwrap();
    }
    Result_ {
        ops,
        secs: start.elapsed().as_secs_f64(),
        hist,
    }
}

fn main() -> anyhow::Result<()> {
    let secs: f64 = std::env::var("QUOTAD_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    let concs: Vec<usize> = std::env::var("QUOTAD_BENCH_CONCURRENCY")
        .ok()
        .map(|s| s.split(',').filter_map(|c| c.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 64]);
    let redis = RedisServer::start()?;

    // quotad on its own runtime.
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let redis_url = redis.url();
    let env = move |k: &str| match k {
        "QUOTAD_ADMIN_TOKEN" => Some(TOKEN.to_string()),
        "QUOTAD_REDIS_URL" => Some(redis_url.clone()),
        "QUOTAD_LOG_LEVEL" => Some("warn".to_string()),
        _ => None,
    };
    let settings = Config::load(None, &env).map_err(anyhow::Error::new)?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = std::thread::spawn(move || -> anyhow::Result<()> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            // The exporter the binary installs, so metrics cost what they cost in production.
            let metrics = quotad::telemetry::install_metrics()?;
            quotad::server::serve(settings, listener, Some(metrics), async move {
                let _ = stop_rx.await;
            })
            .await
        })
    });

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(256)
            .build()?;
        let base = format!("http://{addr}");
        // Wait for readiness, then create one policy per tenant with a budget no run can spend.
        let deadline = Instant::now() + Duration::from_secs(20);
        while http
            .get(format!("{base}/readyz"))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
            != 200
        {
            anyhow::ensure!(Instant::now() < deadline, "quotad did not become ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let spec = serde_json::json!({"limit": 1_000_000, "window_ms": 1000, "burst": 100_000_000});
        for i in 0..TENANTS {
            let r = http
                .put(format!("{base}/v1/tenants/{}/policies/bench", tenant(i)))
                .bearer_auth(TOKEN)
                .json(&spec)
                .send()
                .await?;
            anyhow::ensure!(r.status().is_success(), "PUT policy: {}", r.status());
        }
        let bodies: Arc<Vec<String>> = Arc::new(
            (0..TENANTS)
                .map(|i| {
                    serde_json::json!({"tenant": tenant(i), "policy": "bench", "cost": 1})
                        .to_string()
                })
                .collect(),
        );

        // Raw EVALSHA: the same script and the same keys and arguments quota-store sends.
        let client = redis.client();
        let conn = client.get_multiplexed_async_connection().await?;
        let script = Arc::new(redis::Script::new(TOKEN_BUCKET_LUA));
        let params = BucketParams::new(100_000_000 * UT, 1_000_000 * UT)?;
        let raw_keys: Arc<Vec<[String; 3]>> = Arc::new(
            (0..TENANTS)
                .map(|i| {
                    let b = BucketRef {
                        tenant: TenantId::new(format!("raw-{}", tenant(i))).unwrap(),
                        policy: PolicyName::new("bench").unwrap(),
                        version: 1,
                    };
                    [
                        b.state_key(StateKind::Bucket),
                        b.params_key(),
                        keys::ACTIVE_INDEX.to_string(),
                    ]
                })
                .collect(),
        );

        println!(
            "quotad load benchmark: {secs} s per scenario, {TENANTS} tenants, redis-server {}",
            redis.port()
        );
        println!(
            "{:>5} | {:>12} {:>9} {:>9} | {:>12} {:>9} {:>9} | {:>6} {:>12}",
            "conc",
            "quotad op/s",
            "p50 µs",
            "p99 µs",
            "raw op/s",
            "p50 µs",
            "p99 µs",
            "ratio",
            "added p50 µs"
        );
        for &conc in &concs {
            let (h, b) = (http.clone(), bodies.clone());
            let url = format!("{base}/v1/check");
            let q = drive(conc, secs, move |w| {
                let (h, b, url) = (h.clone(), b.clone(), url.clone());
                async move {
                    let r = h
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(b[w % TENANTS].clone())
                        .send()
                        .await;
                    match r {
                        Ok(r) => r.status().as_u16() == 200 && r.bytes().await.is_ok(),
                        Err(_) => false,
                    }
                }
            })
            .await;
            let (s, k) = (script.clone(), raw_keys.clone());
            let conn2 = conn.clone();
            let raw = drive(conc, secs, move |w| {
                let (s, k, mut conn) = (s.clone(), k.clone(), conn2.clone());
                async move {
                    let keys = &k[w % TENANTS];
                    let r: Result<Vec<i64>, _> = s
                        .key(&keys[0])
                        .key(&keys[1])
                        .key(&keys[2])
                        .arg(1)
                        .arg(params.capacity_ut)
                        .arg(params.rate_ut_per_s)
                        .arg("")
                        .invoke_async(&mut conn)
                        .await;
                    matches!(r, Ok(v) if v.first() == Some(&1))
                }
            })
            .await;
            // The HTTP floor: the same client and server answering /livez, no decision at all.
            let (h, url) = (http.clone(), format!("{base}/livez"));
            let floor = drive(conc, secs, move |_| {
                let (h, url) = (h.clone(), url.clone());
                async move {
                    match h.get(&url).send().await {
                        Ok(r) => r.status().as_u16() == 200 && r.bytes().await.is_ok(),
                        Err(_) => false,
                    }
                }
            })
            .await;
            println!(
                "{:>5} | {:>12.0} {:>9.1} {:>9.1} | {:>12.0} {:>9.1} {:>9.1} | {:>6.2} {:>12.1} | {:>14.0} {:>9.1}",
                conc,
                q.rate(),
                q.p(0.5),
                q.p(0.99),
                raw.rate(),
                raw.p(0.5),
                raw.p(0.99),
                q.rate() / raw.rate(),
                q.p(0.5) - raw.p(0.5),
                floor.rate(),
                floor.p(0.5),
            );
        }
        anyhow::Ok(())
    })?;
    let _ = stop_tx.send(());
    server
        .join()
        .map_err(|_| anyhow::anyhow!("the quotad thread panicked"))??;
    Ok(())
}
