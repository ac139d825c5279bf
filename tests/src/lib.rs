//! Harness for quotad's system tests: real `quotad` processes (and real `redis-server`s through
//! `redis-harness`) on loopback ports, with helpers to call their HTTP API and poll with
//! deadlines instead of sleeping.
//!
//! The `quotad` binary is found next to the test executable (`target/<profile>/quotad`);
//! `cargo nextest run --workspace` and `cargo test --workspace` build it. Run
//! `cargo build -p quotad` first when testing this package alone.

pub mod fault_proxy;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::Value;

/// The admin token every test daemon runs with.
pub const TOKEN: &str = "system-test-token";

/// The least an ACL user needs (after `on` and its password): quotad's keys only (`qd:v1:`),
/// scripts, and what the scripts and the region agent call. Documented in the README.
pub const QUOTAD_ACL: &[&str] = &[
    "on",
    "~qd:v1:*",
    "resetchannels",
    "-@all",
    "+@read",
    "+@write",
    "+@scripting",
    "-@dangerous",
    "+info",
    "+ping",
    "+time",
];

/// A client of the Redis at `url` authenticating as the `default` user with `password`.
pub fn client_with_password(url: &str, password: &str) -> redis::Client {
    let info = redis::IntoConnectionInfo::into_connection_info(url).expect("a loopback URL");
    let settings = info.redis_settings().clone().set_password(password);
    redis::Client::open(info.set_redis_settings(settings)).expect("a client")
}

/// The `quotad` binary built beside this test executable.
pub fn quotad_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the test executable")?;
    // target/<profile>/deps/<test> → target/<profile>/quotad
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("the test executable has no target/<profile> directory")?;
    let bin = profile_dir.join(format!("quotad{}", std::env::consts::EXE_SUFFIX));
    if !bin.exists() {
        bail!(
            "{} is missing: build it first with `cargo build -p quotad` (cargo nextest run --workspace builds it)",
            bin.display()
        );
    }
    Ok(bin)
}

/// A free loopback port (bound, read, released).
pub fn free_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding an ephemeral port")?;
    Ok(l.local_addr()?.port())
}

/// The path of the repository's `config/` directory.
pub fn config_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../config")
}

/// A running `quotad` process; killed on drop.
#[derive(Debug)]
pub struct Daemon {
    child: Option<Child>,
    pub api_port: u16,
    pub dir: tempfile::TempDir,
    log: PathBuf,
    http: reqwest::Client,
}

/// A response: status and JSON body (`Null` when the body is not JSON).
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl Reply {
    /// Reads status, headers and a JSON body (`Null` when the body is not JSON).
    async fn read(resp: reqwest::Response) -> anyhow::Result<Self> {
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp.bytes().await?;
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Ok(Self {
            status,
            headers,
            body,
        })
    }
}

impl Daemon {
    /// Starts quotad with `config` as is (ports fixed by the caller) and extra environment,
    /// without waiting for readiness.
    pub fn spawn(config: &str, api_port: u16, env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir().context("creating a temp dir")?;
        let path = dir.path().join("quotad.toml");
        std::fs::write(&path, config).context("writing the config")?;
        let log = dir.path().join("quotad.log");
        let logfile = std::fs::File::create(&log).context("creating the log file")?;
        let child = Command::new(quotad_binary()?)
            .arg("run")
            .arg("--config")
            .arg(&path)
            .env("QUOTAD_ADMIN_TOKEN", TOKEN)
            .env("QUOTAD_DATA_DIR", dir.path().join("data"))
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(logfile)
            .spawn()
            .context("spawning quotad")?;
        Ok(Daemon {
            child: Some(child),
            api_port,
            dir,
            log,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
        })
    }

    /// The process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts quotad with `config` (TOML; `{api}` is replaced by a free API port) and waits
    /// until /readyz answers 200.
    pub async fn start(config: &str) -> anyhow::Result<Self> {
        Self::start_with_env(config, &[]).await
    }

    /// Like [`Daemon::start`], with extra environment (e.g. `QUOTAD_DATA_DIR` of an earlier
    /// daemon, to restart on its state).
    pub async fn start_with_env(config: &str, env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let mut last = None;
        for _ in 0..3 {
            let api_port = free_port()?;
            let text = config.replace("{api}", &format!("127.0.0.1:{api_port}"));
            let mut d = Daemon::spawn(&text, api_port, env)?;
            match d.wait_ready(Duration::from_secs(20)).await {
                Ok(()) => return Ok(d),
                Err(e) => {
                    last = Some(e.context(d.log_text()));
                    d.kill();
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("quotad did not start")))
    }

    /// The data directory the daemon was started with by default (`<dir>/data`).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Polls /readyz until 200 or the deadline; fails early if the process exits.
    pub async fn wait_ready(&mut self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    bail!("quotad exited during start-up with {status}");
                }
            }
            if let Ok(r) = self.get("/readyz").await {
                if r.status == 200 {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!("quotad not ready within {within:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The daemon's stderr so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `http://127.0.0.1:<port>`.
    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.api_port)
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Sends a request; `body` is sent as-is with `Content-Type: application/json`.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<String>,
    ) -> anyhow::Result<Reply> {
        let method = reqwest::Method::from_bytes(method.as_bytes())?;
        let mut req = self.http.request(method, format!("{}{path}", self.base()));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.header("content-type", "application/json").body(b);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("calling {path}"))?;
        Reply::read(resp).await
    }

    /// POSTs `body` to `path` on a fresh connection that is not reused afterwards: for requests
    /// the daemon may answer by closing the connection (oversized bodies).
    pub async fn post_once(&self, path: &str, body: String) -> anyhow::Result<Reply> {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(Duration::from_secs(10))
            .build()?;
        let resp = client
            .post(format!("{}{path}", self.base()))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .with_context(|| format!("calling {path}"))?;
        Reply::read(resp).await
    }

    /// GETs `path` and returns the status and the body as text (for /metrics).
    pub async fn get_text(&self, path: &str) -> anyhow::Result<(u16, String)> {
        let resp = self
            .http
            .get(format!("{}{path}", self.base()))
            .send()
            .await
            .with_context(|| format!("calling {path}"))?;
        let status = resp.status().as_u16();
        Ok((status, resp.text().await?))
    }

    pub async fn get(&self, path: &str) -> anyhow::Result<Reply> {
        self.request("GET", path, None, None).await
    }

    /// Creates or replaces a policy with the admin token; fails unless 200.
    pub async fn put_policy(
        &self,
        tenant: &str,
        policy: &str,
        spec: Value,
    ) -> anyhow::Result<Value> {
        let r = self
            .request(
                "PUT",
                &format!("/v1/tenants/{tenant}/policies/{policy}"),
                Some(TOKEN),
                Some(spec.to_string()),
            )
            .await?;
        if r.status != 200 {
            bail!("PUT policy answered {}: {}", r.status, r.body);
        }
        Ok(r.body)
    }

    /// One check.
    pub async fn check(&self, tenant: &str, policy: &str, cost: u64) -> anyhow::Result<Reply> {
        let body = serde_json::json!({"tenant": tenant, "policy": policy, "cost": cost});
        self.request("POST", "/v1/check", None, Some(body.to_string()))
            .await
    }

    /// Sends SIGTERM and waits for the exit status.
    pub async fn terminate(&mut self, within: Duration) -> anyhow::Result<ExitStatus> {
        let Some(child) = self.child.as_mut() else {
            bail!("not running")
        };
        let pid = child.id().to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .context("running kill")?;
        if !status.success() {
            bail!("kill -TERM {pid} failed");
        }
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = child.try_wait()? {
                self.child = None;
                return Ok(s);
            }
            if Instant::now() > deadline {
                bail!("quotad did not exit within {within:?} of SIGTERM");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the process at once (SIGKILL).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `f` until it returns `Some` or `within` passes.
pub async fn eventually<T, F, Fut>(within: Duration, every: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(every).await;
    }
}

/// The value of one sample in Prometheus text exposition: the line of metric `name` carrying
/// every `label="value"` pair in `labels` (in any order). `None` when no such sample exists.
pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let (label_set, value) = match rest.strip_prefix('{') {
            Some(r) => r.split_once('}')?,
            None => ("", rest),
        };
        let pairs: Vec<&str> = label_set.split(',').collect();
        let all = labels
            .iter()
            .all(|(k, v)| pairs.contains(&format!("{k}=\"{v}\"").as_str()));
        all.then(|| value.trim().parse().ok()).flatten()
    })
}

/// Whether `client`'s Redis holds this region's parameters for a tenant's policy version.
pub async fn params_present(
    client: &redis::Client,
    tenant: &str,
    policy: &str,
    version: u64,
) -> bool {
    let key = quota_core::keys::params_key(
        &quota_core::TenantId::new(tenant).expect("a tenant id"),
        &quota_core::PolicyName::new(policy).expect("a policy name"),
        version,
    );
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return false;
    };
    redis::cmd("EXISTS")
        .arg(&key)
        .query_async::<i64>(&mut conn)
        .await
        .unwrap_or(0)
        == 1
}

/// How many parameter hashes `client`'s Redis holds (every tenant, policy and version).
pub async fn params_keys(client: &redis::Client) -> usize {
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return 0;
    };
    redis::cmd("KEYS")
        .arg(quota_core::keys::PARAMS_KEY_PATTERN)
        .query_async::<Vec<String>>(&mut conn)
        .await
        .map_or(0, |k| k.len())
}

/// Puts `tenant`'s policy `writes` of 3 a minute and checks it four times: three admitted and
/// one denied, all decided through Redis, with the store reported ok. Returns the version.
pub async fn decides_through_redis(d: &Daemon, tenant: &str) -> anyhow::Result<u64> {
    let stored = d
        .put_policy(
            tenant,
            "writes",
            serde_json::json!({"limit": 3, "window_ms": 60000}),
        )
        .await?;
    for expected in [200, 200, 200, 429] {
        let r = d.check(tenant, "writes", 1).await?;
        if (r.status, r.body["mode"].as_str()) != (expected, Some("normal")) {
            bail!(
                "{tenant}: expected {expected} through Redis, got {}: {}",
                r.status,
                r.body
            );
        }
    }
    let status = d.get("/v1/status").await?;
    if status.body["store"]["state"] != "ok" {
        bail!("the store is not ok: {}", status.body);
    }
    stored["version"].as_u64().context("a version")
}

/// Waits up to `within` until one check of each tenant's `writes` policy is decided through
/// Redis (mode `normal`, not a fail mode); how long that took, or `None`.
pub async fn until_all_normal(
    d: &Daemon,
    tenants: &[String],
    within: Duration,
) -> Option<Duration> {
    let started = Instant::now();
    eventually(within, Duration::from_millis(100), || async {
        for tenant in tenants {
            let r = d.check(tenant, "writes", 1).await.ok()?;
            if r.body["mode"] != "normal" {
                return None;
            }
        }
        Some(started.elapsed())
    })
    .await
}

/// One check of each tenant's `writes` policy is denied through Redis: its bucket is still as
/// spent as [`decides_through_redis`] left it.
pub async fn all_still_spent(d: &Daemon, tenants: &[String]) -> anyhow::Result<()> {
    for tenant in tenants {
        let r = d.check(tenant, "writes", 1).await?;
        if (r.status, r.body["mode"].as_str()) != (429, Some("normal")) {
            bail!(
                "{tenant}: expected a denial through Redis, got {}: {}",
                r.status,
                r.body
            );
        }
    }
    Ok(())
}

/// A single-region config on the embedded store.
pub fn embedded_config() -> String {
    r#"
region = "solo"
[api]
listen = "{api}"
body_limit_bytes = 16384
[telemetry]
log_level = "info"
"#
    .to_string()
}

/// A single-region config on a Redis at `redis_url`, with short breaker and agent intervals.
pub fn redis_config(redis_url: &str) -> String {
    format!(
        r#"
region = "b"
[api]
listen = "{{api}}"
[redis]
url = "{redis_url}"
timeout_ms = 100
[breaker]
failure_threshold = 2
slow_call_ms = 100
open_ms = 200
[coordination]
report_interval_ms = 200
rebalance_interval_ms = 1000
lease_ms = 5000
drift_margin_ms = 200
[telemetry]
log_level = "info"
"#
    )
}

/// The peer token every test cluster shares.
pub const PEER_TOKEN: &str = "system-test-peer-token-0123456789";

/// Three (or more) regions on loopback: one redis-server, one quotad and one fault proxy in
/// front of each daemon's peer listener.
#[derive(Debug)]
pub struct Cluster {
    /// Held while the cluster lives: clusters of different test processes run one at a time,
    /// so nine daemons never compete for two cores.
    _serial: std::fs::File,
    pub names: Vec<String>,
    pub daemons: Vec<Daemon>,
    pub redis: Vec<redis_harness::RedisServer>,
    pub proxies: Vec<fault_proxy::FaultProxy>,
}

/// Timings of test clusters: short so rounds are quick, long enough for 2 cores in debug.
#[derive(Debug)]
pub struct Timings {
    pub report_interval_ms: u64,
    pub rebalance_interval_ms: u64,
    pub lease_ms: u64,
    pub drift_margin_ms: u64,
}

impl Default for Timings {
    fn default() -> Self {
        Self {
            report_interval_ms: 200,
            rebalance_interval_ms: 400,
            lease_ms: 3_000,
            drift_margin_ms: 300,
        }
    }
}

impl Cluster {
    /// Starts regions `names` and waits until every daemon is ready and a leader exists.
    pub async fn start(names: &[&str], t: &Timings) -> anyhow::Result<Self> {
        let lock_path = std::env::temp_dir().join("quotad-system-tests-cluster.lock");
        let serial = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .with_context(|| format!("opening {}", lock_path.display()))?;
        let serial = tokio::task::spawn_blocking(move || serial.lock().map(|()| serial))
            .await?
            .context("locking the cluster lock file")?;
        let mut redis = Vec::new();
        for _ in names {
            redis.push(redis_harness::RedisServer::start()?);
        }
        // Ports are picked free and then bound by the daemons: another process can take one in
        // between, and that daemon exits at once. Such a start is retried on fresh ports.
        let mut attempt = 0;
        let (daemons, proxies) = loop {
            attempt += 1;
            match Self::spawn_regions(names, t, &redis).await {
                Ok(started) => break started,
                Err(e) if attempt < 3 && format!("{e:#}").contains("exited during start-up") => {
                    eprintln!("cluster start attempt {attempt} failed, retrying: {e:#}");
                }
                Err(e) => return Err(e),
            }
        };
        let cluster = Self {
            _serial: serial,
            names: names.iter().map(|s| s.to_string()).collect(),
            daemons,
            redis,
            proxies,
        };
        let leader = eventually(
            Duration::from_secs(20),
            Duration::from_millis(100),
            || async {
                let s = cluster.daemons[0].get("/v1/status").await.ok()?;
                s.body["raft"]["leader"].as_str().map(str::to_string)
            },
        )
        .await;
        anyhow::ensure!(
            leader.is_some(),
            "no Raft leader elected: {}",
            cluster.daemons[0].log_text()
        );
        // Every region registered and holding a lease: the cluster is ready for policies.
        for d in &cluster.daemons {
            let leased = eventually(
                Duration::from_secs(20),
                Duration::from_millis(100),
                || async {
                    let s = d.get("/v1/status").await.ok()?;
                    (s.body["lease"]["remaining_ms"].as_u64()? > 0).then_some(())
                },
            )
            .await;
            anyhow::ensure!(
                leased.is_some(),
                "a region never got a lease: {}",
                d.log_text()
            );
        }
        Ok(cluster)
    }

    /// Spawns one daemon per region (with a fault proxy in front of each peer port) and waits
    /// until all are ready. A daemon that fails is killed when its `Daemon` drops.
    async fn spawn_regions(
        names: &[&str],
        t: &Timings,
        redis: &[redis_harness::RedisServer],
    ) -> anyhow::Result<(Vec<Daemon>, Vec<fault_proxy::FaultProxy>)> {
        let api: Vec<u16> = names
            .iter()
            .map(|_| free_port())
            .collect::<anyhow::Result<_>>()?;
        let peer: Vec<u16> = names
            .iter()
            .map(|_| free_port())
            .collect::<anyhow::Result<_>>()?;
        let mut proxies = Vec::new();
        for p in &peer {
            proxies.push(fault_proxy::FaultProxy::start(([127, 0, 0, 1], *p).into()).await?);
        }
        let mut members = String::new();
        for (i, n) in names.iter().enumerate() {
            members.push_str(&format!(
                "[[regions]]\nid = \"{n}\"\nnode_id = {}\napi = \"127.0.0.1:{}\"\npeer = \"{}\"\n\n",
                i + 1,
                api[i],
                proxies[i].addr
            ));
        }
        let mut daemons = Vec::new();
        for (i, n) in names.iter().enumerate() {
            let config = format!(
                r#"region = "{n}"
[api]
listen = "127.0.0.1:{api}"
forward_timeout_ms = 300
[peer]
listen = "127.0.0.1:{peer}"
[redis]
url = "{redis}"
timeout_ms = 200
[breaker]
failure_threshold = 3
slow_call_ms = 200
open_ms = 300
[coordination]
report_interval_ms = {ri}
rebalance_interval_ms = {rb}
lease_ms = {lease}
drift_margin_ms = {margin}
[raft]
heartbeat_interval_ms = 100
election_timeout_min_ms = 400
election_timeout_max_ms = 800
write_timeout_ms = 1500
[telemetry]
log_level = "info"

{members}"#,
                api = api[i],
                peer = peer[i],
                redis = redis[i].url(),
                ri = t.report_interval_ms,
                rb = t.rebalance_interval_ms,
                lease = t.lease_ms,
                margin = t.drift_margin_ms,
            );
            daemons.push(Daemon::spawn(
                &config,
                api[i],
                &[("QUOTAD_PEER_TOKEN", PEER_TOKEN)],
            )?);
        }
        let pids: Vec<u32> = daemons.iter().filter_map(Daemon::pid).collect();
        for p in &proxies {
            p.set_candidates(&pids);
        }
        for d in &mut daemons {
            if let Err(e) = d.wait_ready(Duration::from_secs(30)).await {
                return Err(e.context(d.log_text()));
            }
        }
        Ok((daemons, proxies))
    }

    /// Index of a region by name.
    pub fn index(&self, name: &str) -> usize {
        self.names
            .iter()
            .position(|n| n == name)
            .unwrap_or_else(|| panic!("no region {name}"))
    }

    /// The daemon of a region.
    pub fn daemon(&self, name: &str) -> &Daemon {
        &self.daemons[self.index(name)]
    }

    /// Cuts region `name` off from every other region, both ways.
    pub fn isolate(&self, name: &str) {
        let i = self.index(name);
        let me: Vec<u32> = self.daemons[i].pid().into_iter().collect();
        let others: Vec<u32> = self
            .daemons
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .filter_map(|(_, d)| d.pid())
            .collect();
        self.proxies[i].block(&others);
        for (j, p) in self.proxies.iter().enumerate() {
            if j != i {
                p.block(&me);
            }
        }
    }

    /// Heals every cut.
    pub fn heal(&self) {
        for p in &self.proxies {
            p.heal();
        }
    }

    /// Region `name`'s share of a tenant's policy, as `name` itself reports it.
    pub async fn share(&self, name: &str, tenant: &str) -> Option<(f64, f64)> {
        let r = self
            .daemon(name)
            .get(&format!("/v1/tenants/{tenant}/allowance"))
            .await
            .ok()?;
        let p = &r.body["policies"][0]["this_region"];
        Some((p["share"].as_f64()?, p["enforced_share"].as_f64()?))
    }
}

#[cfg(test)]
mod tests {
    use super::metric_value;

    #[test]
    fn metric_value_finds_a_sample_by_labels_in_any_order() {
        let text = "# TYPE quotad_decisions_total counter\n\
            quotad_decisions_total{policy=\"p\",region=\"b\",outcome=\"allowed\"} 3\n\
            quotad_decisions_total{policy=\"p\",region=\"b\",outcome=\"degraded_open\"} 17\n\
            quotad_degraded{region=\"b\"} 1\n";
        let open = [
            ("outcome", "degraded_open"),
            ("region", "b"),
            ("policy", "p"),
        ];
        assert_eq!(
            metric_value(text, "quotad_decisions_total", &open),
            Some(17.0)
        );
        assert_eq!(
            metric_value(text, "quotad_degraded", &[("region", "b")]),
            Some(1.0)
        );
        assert_eq!(
            metric_value(text, "quotad_degraded", &[("region", "a")]),
            None
        );
        assert_eq!(metric_value(text, "quotad_decisions", &open), None);
    }
}
