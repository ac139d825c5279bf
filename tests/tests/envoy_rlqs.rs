//! Envoy's rate limit quota service (RLQS) driven from outside the Rust stack: Python grpcio
//! clients (tests/python/envoy_rlqs_client.py) that report and enforce as Envoy's quota filter
//! does, against three regions of real quotad and redis-server processes.
//!
//! Clients A1 and A2 stream to region a's daemon and B1 to region b's, all on one global budget
//! (600 per 10 s, burst 60, floor 0.1: 60 tokens/s in all, 6 a region at its floor). The test
//! steers their offered loads on stdin, reads the regions' shares from the admin API every
//! 250 ms, and holds what the clients logged (every assignment and admission, on the host's
//! monotonic clock) to:
//! 1. a region's clients' tokens_per_fill (and max_tokens) in force summing, whenever one of
//!    them is assigned, to at most the region's share rate then, and at every instant to at
//!    most the highest share rate of the last TTL (a cut share stays held until the
//!    assignments made before it expire; the region acknowledges the cut only then);
//! 2. A1's assignment rising within two of its reports once its demand rises;
//! 3. A1's part going to A2 once A1 has disconnected and its last TTL has passed;
//! 4. b, cut off, holding at most its floor once its lease has ended;
//! 5. the clients' admissions, over every window, within the global bucket's bound plus the
//!    assignments' slack;
//! 6. bad input ending a stream with INVALID_ARGUMENT while the daemon serves on.
//!
//! `QUOTAD_RLQS_DUMP=<file>` keeps the clients' logs (admissions left out) and the shares read.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use quotad_system_tests::crates::{cargo_metadata, crate_dir};
use quotad_system_tests::{eventually, Cluster, Timings};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

const TENANT: &str = "acme";
const POLICY: &str = "global";
/// The bucket's entries as the client writes them (keys sorted).
const BUCKET: &str = "policy=global,tenant=acme";
const LIMIT: f64 = 600.0;
const WINDOW_S: f64 = 10.0;
const BURST: f64 = 60.0;
const FLOOR: f64 = 0.1;
/// The global bucket's refill, tokens a second.
const RATE: f64 = LIMIT / WINDOW_S;
/// Envoy's report timer, which the clients keep and quotad's `rlqs_report_ms` defaults to.
const REPORT_S: f64 = 5.0;
/// Lease: long enough that a TTL of two report periods ends before it; short enough for the
/// cut-off region to reach its floor quickly.
const LEASE_MS: u64 = 15_000;
/// How far a region's share may be read before or after the instant it applied to: the admin
/// API is polled every 250 ms and the clocks are tied through pipes.
const SHARE_SLACK_S: f64 = 1.0;

/// One assignment as a client received it.
#[derive(Debug, Clone, PartialEq)]
struct Assign {
    t: f64,
    strategy: String,
    tpf: f64,
    max_tokens: f64,
    ttl: f64,
    replaced: bool,
}

/// One usage report as a client sent it.
#[derive(Debug, Clone)]
struct Report {
    t: f64,
    allowed: f64,
    denied: f64,
    elapsed: f64,
}

impl Report {
    /// Requests a second, as quotad reads them; `None` for a first report.
    fn demand(&self) -> Option<f64> {
        (self.elapsed > 0.0).then(|| (self.allowed + self.denied) / self.elapsed)
    }
}

/// What a client logged, times on the host's monotonic clock (seconds).
#[derive(Debug, Default)]
struct Log {
    loads: Vec<(f64, f64)>,
    reports: Vec<Report>,
    assigns: Vec<Assign>,
    admits: Vec<f64>,
    quit: Option<f64>,
    /// Anything unexpected: stream ends, ignored or unsupported actions, failures.
    odd: Vec<String>,
}

impl Log {
    fn parse(lines: &[(f64, String)]) -> Self {
        let mut log = Log::default();
        for (_, line) in lines {
            let w: Vec<&str> = line.split(' ').collect();
            let t = || {
                w.get(1)
                    .and_then(|t| t.parse::<f64>().ok())
                    .unwrap_or(f64::NAN)
            };
            let num = |i: usize| {
                w.get(i)
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or(f64::NAN)
            };
            match w[0] {
                "start" => {}
                "load" => log.loads.push((t(), num(3))),
                "report" if w.get(2) == Some(&BUCKET) => log.reports.push(Report {
                    t: t(),
                    allowed: num(3),
                    denied: num(4),
                    elapsed: num(5),
                }),
                "assign" if w.get(2) == Some(&BUCKET) => log.assigns.push(Assign {
                    t: t(),
                    strategy: w.get(3).unwrap_or(&"").to_string(),
                    tpf: num(4),
                    max_tokens: num(5),
                    ttl: num(6),
                    replaced: w.get(7) == Some(&"1"),
                }),
                "admit" => log.admits.push(t()),
                // Expiries follow from the assignments' TTLs.
                "expire" => {}
                "quit" => log.quit = Some(t()),
                _ => log.odd.push(line.clone()),
            }
        }
        log
    }

    /// The assignment in force at `t`: the latest received by then, until its TTL.
    fn in_force(&self, t: f64) -> Option<&Assign> {
        let a = self.assigns.iter().rev().find(|a| a.t <= t)?;
        (t < a.t + a.ttl).then_some(a)
    }

    /// tokens_per_fill and max_tokens in force at `t` (a blanket ALLOW_ALL is unbounded).
    fn part(&self, t: f64) -> (f64, f64) {
        match self.in_force(t) {
            Some(a) if a.strategy == "token_bucket" => (a.tpf, a.max_tokens),
            Some(a) if a.strategy == "allow_all" => (f64::INFINITY, f64::INFINITY),
            _ => (0.0, 0.0),
        }
    }

    /// The first assignment received at or after `t`.
    fn answer_after(&self, t: f64) -> Option<&Assign> {
        self.assigns.iter().find(|a| a.t >= t)
    }
}

/// A client process: one Envoy's quota client on one stream.
struct Client {
    name: &'static str,
    region: &'static str,
    child: Child,
    stdin: Option<ChildStdin>,
    /// Lines as read, with the time they were read (seconds since the test's epoch).
    lines: Arc<Mutex<Vec<(f64, String)>>>,
    stderr: tempfile::NamedTempFile,
}

impl Client {
    async fn spawn(
        py: &Python,
        name: &'static str,
        region: &'static str,
        target: &str,
        epoch: Instant,
    ) -> anyhow::Result<Self> {
        let stderr = tempfile::NamedTempFile::new()?;
        let mut child = Command::new("python3")
            .arg(&py.script)
            .args(["run", "--target", target, "--stubs"])
            .arg(py.stubs.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr.reopen()?)
            .kill_on_drop(true)
            .spawn()
            .context("starting python3 (grpcio: tests/python/requirements.txt)")?;
        let stdin = child.stdin.take();
        let mut out = BufReader::new(child.stdout.take().context("no stdout")?).lines();
        let lines: Arc<Mutex<Vec<(f64, String)>>> = Arc::default();
        let sink = lines.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = out.next_line().await {
                let read = epoch.elapsed().as_secs_f64();
                sink.lock().unwrap().push((read, line));
            }
        });
        Ok(Self {
            name,
            region,
            child,
            stdin,
            lines,
            stderr,
        })
    }

    async fn send(&mut self, command: &str) -> anyhow::Result<()> {
        let stdin = self.stdin.as_mut().context("stdin closed")?;
        stdin.write_all(format!("{command}\n").as_bytes()).await?;
        stdin.flush().await?;
        Ok(())
    }

    async fn load(&mut self, rate: u32) -> anyhow::Result<()> {
        self.send(&format!("load {rate} {BUCKET}")).await
    }

    fn log(&self) -> Log {
        Log::parse(&self.lines.lock().unwrap())
    }

    /// Its stderr and the last of its output, for a failure message.
    fn tail(&self) -> String {
        let lines = self.lines.lock().unwrap();
        let last: Vec<&str> = lines
            .iter()
            .map(|(_, l)| l.as_str())
            .filter(|l| !l.starts_with("admit "))
            .rev()
            .take(20)
            .collect();
        let stderr = std::fs::read_to_string(self.stderr.path()).unwrap_or_default();
        format!("{}: {last:#?}\nstderr: {stderr}", self.name)
    }
}

/// The script and its generated stubs.
struct Python {
    script: PathBuf,
    stubs: tempfile::TempDir,
}

impl Python {
    async fn generate() -> anyhow::Result<Self> {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let metadata = cargo_metadata(&workspace).await?;
        let envoy_proto = crate_dir(&metadata, "envoy-types")?.join("proto");
        let script = workspace.join("tests/python/envoy_rlqs_client.py");
        let stubs = tempfile::tempdir()?;
        let out = Command::new("python3")
            .arg(&script)
            .args(["generate", "--envoy-proto"])
            .arg(&envoy_proto)
            .arg("--stubs")
            .arg(stubs.path())
            .output()
            .await
            .context("starting python3 (grpcio-tools: tests/python/requirements.txt)")?;
        if !out.status.success() {
            bail!(
                "generating the stubs: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(Self { script, stubs })
    }
}

/// A share as a region's admin API reported it.
#[derive(Debug, Clone, Copy)]
struct ShareSample {
    /// Seconds since the test's epoch.
    read: f64,
    enforced: f64,
}

/// The cluster, the clients, and the shares read while they run.
struct World {
    cluster: Cluster,
    epoch: Instant,
    clients: Vec<Client>,
    shares: Vec<(&'static str, ShareSample)>,
}

impl World {
    fn client(&mut self, name: &str) -> &mut Client {
        self.clients
            .iter_mut()
            .find(|c| c.name == name)
            .expect("a client of that name")
    }

    fn log(&self, name: &str) -> Log {
        self.clients
            .iter()
            .find(|c| c.name == name)
            .expect("a client of that name")
            .log()
    }

    /// Host monotonic clock minus the test's clock: every line's own time is at most its
    /// time of reading, so the largest difference seen is the closest estimate.
    fn offset(&self) -> f64 {
        let mut offset = f64::NEG_INFINITY;
        for c in &self.clients {
            for (read, line) in c.lines.lock().unwrap().iter() {
                if let Some(t) = line.split(' ').nth(1).and_then(|t| t.parse::<f64>().ok()) {
                    offset = offset.max(t - read);
                }
            }
        }
        offset
    }

    /// Now, on the clients' clock.
    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() + self.offset()
    }

    async fn poll_shares(&mut self) {
        for region in ["a", "b"] {
            if let Some((_, enforced)) = self.cluster.share(region, TENANT).await {
                let read = self.epoch.elapsed().as_secs_f64();
                self.shares.push((region, ShareSample { read, enforced }));
            }
        }
    }

    /// Region `region`'s share rates (tokens/s) read from `from` to `to` (clients' clock);
    /// the nearest reading on each side when none was.
    fn rates_between(&self, region: &str, from: f64, to: f64) -> Vec<f64> {
        let offset = self.offset();
        let samples: Vec<(f64, f64)> = self
            .shares
            .iter()
            .filter(|(r, _)| *r == region)
            .map(|(_, s)| (s.read + offset, s.enforced * RATE))
            .collect();
        let within: Vec<f64> = samples
            .iter()
            .filter(|(at, _)| (from..=to).contains(at))
            .map(|(_, r)| *r)
            .collect();
        if !within.is_empty() {
            return within;
        }
        let before = samples.iter().rev().find(|(at, _)| *at < from);
        let after = samples.iter().find(|(at, _)| *at > to);
        before.into_iter().chain(after).map(|(_, r)| *r).collect()
    }

    /// Polls the shares every 250 ms until `done` holds; fails after `within` or when a
    /// client exits.
    async fn wait_until(
        &mut self,
        what: &str,
        within: Duration,
        mut done: impl FnMut(&World) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            self.poll_shares().await;
            if done(self) {
                return Ok(());
            }
            for c in &mut self.clients {
                if c.stdin.is_some() {
                    if let Some(status) = c.child.try_wait()? {
                        bail!(
                            "{} exited with {status} while waiting for {what}: {}",
                            c.name,
                            c.tail()
                        );
                    }
                }
            }
            if Instant::now() > deadline {
                let tails: Vec<String> = self.clients.iter().map(Client::tail).collect();
                bail!("no {what} within {within:?}:\n{}", tails.join("\n"));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn quit(&mut self, name: &str) -> anyhow::Result<()> {
        let c = self.client(name);
        c.send("quit").await?;
        c.stdin = None;
        let status = tokio::time::timeout(Duration::from_secs(10), c.child.wait())
            .await
            .with_context(|| format!("{name} did not exit: {}", c.tail()))??;
        if !status.success() {
            bail!("{name} exited with {status}: {}", c.tail());
        }
        Ok(())
    }

    async fn metrics(&self, region: &str) -> anyhow::Result<String> {
        let (status, text) = self.cluster.daemon(region).get_text("/metrics").await?;
        if status != 200 {
            bail!("/metrics answered {status}");
        }
        Ok(text)
    }
}

/// The sum of every sample of metric `name`, whatever its labels; `None` without one.
fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = match rest.strip_prefix('{') {
                Some(r) => r.split_once('}')?.1,
                None => rest.strip_prefix(' ')?,
            };
            value.trim().parse().ok()
        })
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// Point 1, for each region: at every instant one of its clients receives an assignment, the
/// tokens_per_fill (and max_tokens) in force over its clients sum to at most the region's share
/// rate (burst and rate × 1 s are the same figure here) as read then; at every other instant
/// (every share reading too), to at most the highest share rate of the last TTL: a share cut
/// is held by the assignments made before it until they expire, and the region acknowledges
/// the cut (so it is granted elsewhere) only then. The worst figures, per region.
fn check_region_sums(w: &World, logs: &[(&str, &str, Log)], until: f64) -> Vec<String> {
    let offset = w.offset();
    let ttl = logs
        .iter()
        .flat_map(|(_, _, l)| l.assigns.iter().map(|a| a.ttl))
        .fold(0.0, f64::max);
    let mut figures = Vec::new();
    for region in ["a", "b"] {
        let mine: Vec<&Log> = logs
            .iter()
            .filter(|(_, r, _)| *r == region)
            .map(|(_, _, l)| l)
            .collect();
        let sums = |t: f64| {
            mine.iter()
                .map(|l| l.part(t))
                .fold((0.0, 0.0), |(a, b), (c, d)| (a + c, b + d))
        };
        let highest = |from: f64, to: f64| {
            w.rates_between(region, from, to)
                .into_iter()
                .fold(0.0, f64::max)
        };
        let in_force = |t: f64| mine.iter().map(|l| l.in_force(t)).collect::<Vec<_>>();
        let assigned: Vec<f64> = mine
            .iter()
            .flat_map(|l| l.assigns.iter().map(|a| a.t))
            .filter(|t| *t <= until)
            .collect();
        let mut worst_assigned = (0.0, 0.0, 0.0);
        for &t in &assigned {
            let (tpf, max_tokens) = sums(t);
            let rate = highest(t - SHARE_SLACK_S, t + SHARE_SLACK_S);
            assert!(
                tpf <= rate && max_tokens <= rate.max(rate / RATE * BURST),
                "region {region}, an assignment at {t:.3}: tokens_per_fill {tpf}, max_tokens \
                 {max_tokens} in force over its share rate {rate:.2}/s: {:?}",
                in_force(t)
            );
            if rate > 0.0 && tpf / rate > worst_assigned.0 {
                worst_assigned = (tpf / rate, tpf, rate);
            }
        }
        let mut instants = assigned;
        instants.extend(
            w.shares
                .iter()
                .filter(|(r, s)| *r == region && s.read + offset <= until)
                .map(|(_, s)| s.read + offset),
        );
        let mut worst_held = (f64::NEG_INFINITY, 0.0, 0.0);
        for t in instants {
            let (tpf, max_tokens) = sums(t);
            let rate = highest(t - ttl - SHARE_SLACK_S, t + SHARE_SLACK_S);
            assert!(
                tpf <= rate && max_tokens <= rate.max(rate / RATE * BURST),
                "region {region} at {t:.3}: tokens_per_fill {tpf}, max_tokens {max_tokens} in \
                 force over the highest share rate of the last TTL, {rate:.2}/s: {:?}",
                in_force(t)
            );
            let now = highest(t - SHARE_SLACK_S, t + SHARE_SLACK_S);
            if tpf - now > worst_held.0 {
                worst_held = (tpf - now, tpf, now);
            }
        }
        figures.push(format!(
            "region {region}: at assignments, at most {} tokens/s of a share rate {:.2}/s \
             ({:.0} %); held over the share rate read then by {} tokens/s at most ({} of {:.2})",
            worst_assigned.1,
            worst_assigned.2,
            worst_assigned.0 * 100.0,
            worst_held.0.max(0.0),
            worst_held.1,
            worst_held.2,
        ));
    }
    figures
}

/// Point 5: admissions over every window of `w_s` seconds (starting at each admission) against
/// the global bucket's bound, 1.02 × (burst + rate × w), plus the assignments' slack: the
/// max_tokens in force at the window's start and those of assignments that replaced a bucket
/// within it. Returns the tightest window's figures.
fn check_windows(logs: &[&Log], w_s: f64) -> String {
    let mut admits: Vec<f64> = logs.iter().flat_map(|l| l.admits.iter().copied()).collect();
    admits.sort_by(f64::total_cmp);
    let bound = 1.02 * (BURST + RATE * w_s);
    let mut tightest = (f64::NEG_INFINITY, 0usize, 0.0, 0.0);
    let mut end = 0;
    for (i, &s) in admits.iter().enumerate() {
        while end < admits.len() && admits[end] < s + w_s {
            end += 1;
        }
        let count = end - i;
        let slack: f64 = logs
            .iter()
            .map(|l| {
                let at_start = match l.in_force(s) {
                    Some(a) if a.strategy == "token_bucket" => a.max_tokens,
                    Some(a) if a.strategy == "allow_all" => f64::INFINITY,
                    _ => 0.0,
                };
                let replacing: f64 = l
                    .assigns
                    .iter()
                    .filter(|a| a.replaced && a.strategy == "token_bucket")
                    .filter(|a| a.t >= s && a.t < s + w_s)
                    .map(|a| a.max_tokens)
                    .sum();
                at_start + replacing
            })
            .sum();
        let allowed = bound + slack;
        assert!(
            count as f64 <= allowed,
            "{count} admitted in the {w_s} s from {s:.3}: above 1.02 × the global bound \
             ({bound:.1}) plus the slack ({slack})"
        );
        let margin = count as f64 - allowed;
        if margin > tightest.0 {
            tightest = (margin, count, slack, s);
        }
    }
    format!(
        "{w_s:>4} s windows: at most {} admitted; bound 1.02 × ({BURST} + {RATE} × {w_s}) = \
         {bound:.1} plus slack {} at the tightest",
        tightest.1, tightest.2
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_envoy_quota_clients_share_one_global_budget_across_three_regions(
) -> anyhow::Result<()> {
    let py = Python::generate().await?;
    let timings = Timings {
        lease_ms: LEASE_MS,
        ..Timings::default()
    };
    let cluster = Cluster::start_with_envoy(&["a", "b", "c"], &timings, "").await?;
    let policy = json!({
        "limit": LIMIT as u64, "window_ms": (WINDOW_S * 1000.0) as u64,
        "burst": BURST as u64, "floor": FLOOR,
    });
    cluster
        .daemon("a")
        .put_policy(TENANT, POLICY, policy)
        .await?;
    for region in ["a", "b"] {
        cluster
            .leased_share(region, TENANT, 0.0)
            .await
            .with_context(|| format!("region {region} never held a share"))?;
    }

    let epoch = Instant::now();
    let mut clients = Vec::new();
    for (name, region) in [("A1", "a"), ("A2", "a"), ("B1", "b")] {
        let target = cluster.envoy_target(region);
        clients.push(Client::spawn(&py, name, region, &target, epoch).await?);
    }
    let mut w = World {
        cluster,
        epoch,
        clients,
        shares: Vec::new(),
    };

    // Phase 1: loads above the budget, A1's small. a's part is split by demand: A2 (40/s)
    // comes to hold at least what A1 (5/s) does.
    for (name, rate) in [("A1", 5), ("A2", 40), ("B1", 40)] {
        w.client(name).load(rate).await?;
    }
    w.wait_until(
        "three assignments for every client, A2's at least A1's",
        Duration::from_secs(40),
        |w| {
            let now = w.now();
            ["A1", "A2", "B1"]
                .iter()
                .all(|n| w.log(n).assigns.len() >= 3)
                && w.log("A2").part(now).0 >= w.log("A1").part(now).0
        },
    )
    .await?;
    let streams_a = metric_sum(&w.metrics("a").await?, "quotad_rlqs_streams");
    let streams_b = metric_sum(&w.metrics("b").await?, "quotad_rlqs_streams");
    let buckets_a = metric_sum(&w.metrics("a").await?, "quotad_rlqs_buckets");
    let assigned_a = metric_sum(&w.metrics("a").await?, "quotad_rlqs_assignments_total");
    assert_eq!(
        (streams_a, streams_b, buckets_a),
        (Some(2.0), Some(1.0), Some(2.0)),
        "quotad_rlqs_streams of a and b, quotad_rlqs_buckets of a (a stream's bucket each)"
    );
    assert!(
        assigned_a.unwrap_or(0.0) >= 6.0,
        "quotad_rlqs_assignments_total: {assigned_a:?}"
    );

    // Phase 2 (point 2): A1's load rises from 5/s to 60/s.
    w.client("A1").load(60).await?;
    let risen = |l: &Log| -> Option<(f64, Report, Report, (Assign, Assign))> {
        let since = l.loads.last().map_or(f64::INFINITY, |(t, _)| *t);
        let reports: Vec<&Report> = l
            .reports
            .iter()
            .filter(|r| r.t > since && r.demand().is_some_and(|d| d >= 32.5))
            .collect();
        let first = reports.first()?;
        let next = l.reports.iter().find(|r| r.t > first.t)?;
        let answers = (
            l.answer_after(first.t)?.clone(),
            l.answer_after(next.t)?.clone(),
        );
        Some((since, (*first).clone(), next.clone(), answers))
    };
    w.wait_until(
        "A1's two reports after its rise, answered",
        Duration::from_secs(30),
        |w| risen(&w.log("A1")).is_some(),
    )
    .await?;
    let a1 = w.log("A1");
    let (rise_at, first, next, (ans1, ans2)) = risen(&a1).expect("waited for");
    let before = a1.part(rise_at).0;
    let a2_before = w.log("A2").part(rise_at).0;
    let after = ans1.tpf.max(ans2.tpf);
    assert!(
        after > before,
        "A1's assignment after two reports of its risen demand ({:?}, {:?}): {ans1:?}, {ans2:?}; \
         {before} before",
        first.demand(),
        next.demand()
    );
    let point2 = format!(
        "A1 5/s → 60/s: tokens_per_fill {before} (A2 {a2_before}), then {} and {} answering \
         its reports of {:.1}/s and {:.1}/s",
        ans1.tpf,
        ans2.tpf,
        first.demand().unwrap_or_default(),
        next.demand().unwrap_or_default()
    );

    // Phase 3 (point 3): A1 disconnects; its part is A2's once its last TTL has passed.
    w.quit("A1").await?;
    let a1 = w.log("A1");
    let quit_at = a1.quit.context("A1 logged no quit")?;
    let last = a1.assigns.last().context("A1 had no assignment")?.clone();
    let freed_at = last.t + last.ttl;
    w.wait_until(
        "A2's answer after A1's last TTL",
        Duration::from_secs(40),
        |w| w.log("A2").answer_after(freed_at + 0.5).is_some(),
    )
    .await?;
    let a2 = w.log("A2");
    let taken = a2.answer_after(freed_at + 0.5).expect("waited for").clone();
    let a2_held = a2.part(quit_at).0;
    let rate_a = w
        .rates_between("a", taken.t - SHARE_SLACK_S, taken.t + SHARE_SLACK_S)
        .into_iter()
        .fold(f64::INFINITY, f64::min);
    assert!(
        taken.tpf >= rate_a.floor() - 1.0,
        "A2 alone in a after A1's TTL: {taken:?} of a share rate {rate_a:.2}/s"
    );
    let point3 = format!(
        "A1 quit holding {} tokens/s for {} s; A2 {a2_held} before, {} at {:.1} s after the TTL \
         (a's share rate {rate_a:.2}/s)",
        last.tpf,
        last.ttl,
        taken.tpf,
        taken.t - freed_at
    );
    let one_stream = eventually(
        Duration::from_secs(10),
        Duration::from_millis(200),
        || async {
            let streams = metric_sum(&w.metrics("a").await.ok()?, "quotad_rlqs_streams");
            (streams == Some(1.0)).then_some(())
        },
    )
    .await;
    assert!(
        one_stream.is_some(),
        "quotad_rlqs_streams of a once A1 left"
    );

    // Phase 4 (points 4 and 6): b is cut off; meanwhile bad input on a's listener.
    let mut probe = Command::new("python3")
        .arg(&py.script)
        .args(["probe", "--target", &w.cluster.envoy_target("a"), "--stubs"])
        .arg(py.stubs.path())
        .args(["--known", BUCKET, "--unknown", "policy=nosuch,tenant=acme"])
        .args(["--unknown", "path=/"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let probe_out = probe.stdout.take().context("no stdout")?;
    let probe_err = probe.stderr.take().context("no stderr")?;
    let probe = tokio::spawn(async move {
        let mut out = String::new();
        let mut err = String::new();
        let mut o = BufReader::new(probe_out);
        let mut e = BufReader::new(probe_err);
        let (r1, r2) = tokio::join!(o.read_to_string(&mut out), e.read_to_string(&mut err));
        r1?;
        r2?;
        let status = probe.wait().await?;
        anyhow::Ok((status, out, err))
    });
    let isolated_at = w.now();
    w.cluster.isolate("b");
    let floored = |w: &World| {
        w.shares
            .iter()
            .rev()
            .find(|(r, _)| *r == "b")
            .is_some_and(|(_, s)| s.enforced <= FLOOR + 1e-6)
    };
    w.wait_until(
        "b at its floor",
        Duration::from_millis(LEASE_MS + 15_000),
        floored,
    )
    .await?;
    let floor_at = w.now();
    w.wait_until(
        "B1's answer after b's lease end",
        Duration::from_secs(20),
        |w| w.log("B1").answer_after(floor_at).is_some() && w.now() > floor_at + 1.5,
    )
    .await?;
    let b1 = w.log("B1");
    let floor_rate = FLOOR * RATE;
    let mut after_floor = vec![floor_at + SHARE_SLACK_S];
    after_floor.extend(
        b1.assigns
            .iter()
            .map(|a| a.t)
            .filter(|t| *t > floor_at + SHARE_SLACK_S),
    );
    for t in &after_floor {
        let (tpf, max_tokens) = b1.part(*t);
        assert!(
            tpf <= floor_rate && max_tokens <= floor_rate.max(FLOOR * BURST),
            "b cut off, past its lease: B1 holds {tpf} tokens/s, max {max_tokens} at {t:.3} \
             (floor {floor_rate}/s; lease over by {floor_at:.3}): {:?}",
            b1.assigns
        );
    }
    let floor_answers: Vec<&Assign> = b1.assigns.iter().filter(|a| a.t >= floor_at).collect();
    let point4 = format!(
        "b cut off at {:.1}; at its floor {:.1} s later; B1 then assigned {:?} tokens/s \
         (floor {floor_rate}/s)",
        isolated_at,
        floor_at - isolated_at,
        floor_answers.iter().map(|a| a.tpf).collect::<Vec<_>>()
    );

    let (status, out, err) = tokio::time::timeout(Duration::from_secs(30), probe)
        .await
        .context("the probe did not finish")???;
    assert!(status.success(), "probe {status}: {out}\n{err}");
    let said: Vec<&str> = out
        .lines()
        .filter_map(|l| l.strip_prefix("ok "))
        .filter_map(|l| l.split(':').next())
        .collect();
    assert_eq!(said, ["bad_input", "unknown_buckets"], "{out}\n{err}");
    let probed_at = w.now();
    w.wait_until(
        "an answer to A2 after the probe",
        Duration::from_secs(15),
        |w| w.log("A2").answer_after(probed_at).is_some(),
    )
    .await?;
    let rejected = metric_sum(&w.metrics("a").await?, "quotad_rlqs_rejected_reports_total");
    assert!(
        rejected.unwrap_or(0.0) >= 2.0,
        "quotad_rlqs_rejected_reports_total of a: {rejected:?}"
    );

    let end = w.now();
    w.quit("A2").await?;
    w.quit("B1").await?;

    // The whole run: no stream ended, every TTL whole and long, every sum within its share.
    let logs: Vec<(&str, &str, Log)> = w
        .clients
        .iter()
        .map(|c| (c.name, c.region, c.log()))
        .collect();
    for (name, region, log) in &logs {
        assert!(log.odd.is_empty(), "{name}: {:#?}", log.odd);
        for a in &log.assigns {
            assert!(
                a.strategy == "token_bucket" || a.strategy == "deny_all",
                "{name}: {a:?}"
            );
            assert!(a.ttl >= 1.0, "{name}: a TTL under 1 s: {a:?}");
            // Two report periods at least while every lease is renewed in time (the cut may
            // move the Raft leader, which delays a's renewals too).
            let live = a.t < isolated_at;
            assert!(
                !live || a.ttl >= 2.0 * REPORT_S,
                "{name} in {region}: a short TTL: {a:?}"
            );
        }
    }
    if let Ok(path) = std::env::var("QUOTAD_RLQS_DUMP") {
        let mut dump = String::new();
        for c in &w.clients {
            for (read, line) in c.lines.lock().unwrap().iter() {
                if !line.starts_with("admit") {
                    dump.push_str(&format!("{} {read:.3} {line}\n", c.name));
                }
            }
        }
        for (r, s) in &w.shares {
            dump.push_str(&format!(
                "share {r} {:.3} {}\n",
                s.read + w.offset(),
                s.enforced
            ));
        }
        dump.push_str(&format!(
            "isolated {isolated_at:.3} floor {floor_at:.3} end {end:.3}\n"
        ));
        std::fs::write(path, dump)?;
    }
    let sums = check_region_sums(&w, &logs, end);
    let all: Vec<&Log> = logs.iter().map(|(_, _, l)| l).collect();
    let windows: Vec<String> = [WINDOW_S, 5.0, 2.0, 1.0]
        .into_iter()
        .map(|s| check_windows(&all, s))
        .collect();
    let admitted: usize = all.iter().map(|l| l.admits.len()).sum();

    let mean_share = |region: &str| {
        let before: Vec<f64> = w
            .shares
            .iter()
            .filter(|(r, s)| *r == region && s.read + w.offset() < isolated_at)
            .map(|(_, s)| s.enforced)
            .collect();
        before.iter().sum::<f64>() / before.len().max(1) as f64
    };
    println!(
        "1. {}; mean shares before the cut: a {:.3}, b {:.3}",
        sums.join("; "),
        mean_share("a"),
        mean_share("b")
    );
    println!("2. {point2}");
    println!("3. {point3}");
    println!("4. {point4}");
    println!("5. {admitted} admitted in {:.0} s:", end - w.offset());
    for line in &windows {
        println!("   {line}");
    }
    println!("6. {}", out.lines().collect::<Vec<_>>().join("; "));
    Ok(())
}
