//! The Prometheus rules shipped in `deploy/prometheus/`: `promtool` checks them and runs their
//! unit tests, and a real Prometheus scrapes a real three-region cluster with them loaded:
//!
//! - every `quotad_…` metric the rules name is one the daemons export (a misspelt name would
//!   make its alert silently never fire);
//! - every rule evaluates without error against the real series (vector matching is checked
//!   only at evaluation) and, while all is well, no alert is pending or firing;
//! - every exported metric is in the table of `docs/metrics.md`;
//! - one label set per metric and daemon (two exporters of one name would double every sum);
//! - with region b's Redis killed, `QuotadStoreDegraded` and `QuotadDegradedDecisions` go
//!   pending for b, and with region c cut off, `QuotadOnFloors` goes pending for c once its
//!   lease has run out, each naming only that region; no other alert names another region.
//!
//! `promtool` and `prometheus` come from Debian's `prometheus` package (`.ci/run` unpacks them
//! into `target/prometheus`); `QUOTAD_PROMETHEUS_DIR` names another directory holding them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context as _};
use quotad_system_tests::{eventually, free_port, Cluster, Timings};
use serde_json::{json, Value};

fn rules_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus")
}

/// A Prometheus tool: from `QUOTAD_PROMETHEUS_DIR`, `target/prometheus` or `PATH`.
fn tool(name: &str) -> anyhow::Result<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("QUOTAD_PROMETHEUS_DIR")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/prometheus"));
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    dirs.into_iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "{name} not found in QUOTAD_PROMETHEUS_DIR, target/prometheus or PATH: .ci/run \
                 unpacks it from Debian's prometheus package (see docs/metrics.md)"
            )
        })
}

fn promtool(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(tool("promtool")?)
        .args(args)
        .current_dir(rules_dir())
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!("promtool {args:?} failed:\n{text}");
    }
    Ok(text)
}

#[test]
fn the_rules_pass_promtool_and_their_unit_tests() -> anyhow::Result<()> {
    let checked = promtool(&["check", "rules", "quotad-rules.yml"])?;
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = promtool(&["test", "rules", "quotad-rules.test.yml"])?;
    assert!(tested.contains("SUCCESS"), "{tested}");
    Ok(())
}

/// The `quotad_…` metric names a rules file mentions.
fn metric_names(rules: &str) -> Vec<String> {
    let mut names: Vec<String> = rules
        .match_indices("quotad_")
        .filter(|(i, _)| {
            // Not the tail of a longer word.
            !rules[..*i]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        })
        .map(|(i, _)| {
            rules[i..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect()
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// A Prometheus server, killed when dropped.
struct Prometheus {
    child: Child,
    base: String,
    http: reqwest::Client,
    dir: tempfile::TempDir,
}

impl Prometheus {
    /// Scrapes `targets` (`host:port`) as job `quotad` every second and evaluates the rules
    /// every second.
    async fn start(targets: &[String]) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let rules = rules_dir().join("quotad-rules.yml").canonicalize()?;
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules:?}\n\
             scrape_configs:\n  - job_name: quotad\n    static_configs:\n      - targets: {targets:?}\n",
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config)?;
        let port = free_port()?;
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let child = Command::new(tool("prometheus")?)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting prometheus")?;
        let p = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::new(),
            dir,
        };
        let ready = eventually(
            Duration::from_secs(20),
            Duration::from_millis(100),
            || async {
                let r = p
                    .http
                    .get(format!("{}/-/ready", p.base))
                    .send()
                    .await
                    .ok()?;
                r.status().is_success().then_some(())
            },
        )
        .await;
        if ready.is_none() {
            bail!("prometheus not ready:\n{}", p.log());
        }
        Ok(p)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// The `data` of an API answer.
    async fn api(&self, path: &str, query: &[(&str, &str)]) -> anyhow::Result<Value> {
        let body: Value = self
            .http
            .get(format!("{}/api/v1/{path}", self.base))
            .query(query)
            .send()
            .await?
            .json()
            .await?;
        if body["status"] != "success" {
            bail!("prometheus /api/v1/{path} answered {body}");
        }
        Ok(body["data"].clone())
    }

    /// The result vector of an instant query.
    async fn query(&self, q: &str) -> anyhow::Result<Vec<Value>> {
        let data = self.api("query", &[("query", q)]).await?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// Pending and firing alerts as (name, region, state).
    async fn alerts(&self) -> anyhow::Result<Vec<(String, String, String)>> {
        let data = self.api("alerts", &[]).await?;
        let alerts = data["alerts"].as_array().cloned().unwrap_or_default();
        Ok(alerts
            .iter()
            .map(|a| {
                let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
                (
                    s(&a["labels"]["alertname"]),
                    s(&a["labels"]["region"]),
                    s(&a["state"]),
                )
            })
            .collect())
    }

    /// Every rule, once each has been evaluated: (name, health, last error).
    async fn evaluated_rules(&self) -> anyhow::Result<Vec<(String, String, String)>> {
        let data = self.api("rules", &[]).await?;
        let mut out = Vec::new();
        for g in data["groups"].as_array().into_iter().flatten() {
            for r in g["rules"].as_array().into_iter().flatten() {
                let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
                out.push((s(&r["name"]), s(&r["health"]), s(&r["lastError"])));
            }
        }
        Ok(out)
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until alert `name` is pending or firing for `region`, and for no other region.
async fn until_alert(p: &Prometheus, name: &str, region: &str) -> anyhow::Result<()> {
    let seen = eventually(
        Duration::from_secs(30),
        Duration::from_millis(250),
        || async {
            let alerts = p.alerts().await.ok()?;
            let of_name: Vec<_> = alerts.iter().filter(|a| a.0 == name).collect();
            of_name
                .iter()
                .any(|a| a.1 == region)
                .then_some(of_name.len())
        },
    )
    .await;
    match seen {
        Some(1) => Ok(()),
        Some(_) => bail!(
            "{name} for more than region {region}: {:?}",
            p.alerts().await?
        ),
        None => bail!(
            "{name} never pending for region {region}: {:?}",
            p.alerts().await?
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_evaluates_the_rules_against_a_three_region_cluster() -> anyhow::Result<()>
{
    let mut cluster = Cluster::start(&["a", "b", "c"], &Timings::default()).await?;
    let targets: Vec<String> = cluster
        .daemons
        .iter()
        .map(|d| d.base().trim_start_matches("http://").to_string())
        .collect();
    let leader = cluster.daemon("a");
    leader
        .put_policy("acme", "writes", json!({"limit": 1000, "window_ms": 1000}))
        .await?;
    // Decisions through every region's Redis, so every per-policy series exists; and one
    // request with a wrong token.
    for d in &cluster.daemons {
        let seen = eventually(
            Duration::from_secs(10),
            Duration::from_millis(100),
            || async {
                let r = d.check("acme", "writes", 1).await.ok()?;
                (r.status == 200 && r.body["mode"] == "normal").then_some(())
            },
        )
        .await;
        assert!(seen.is_some(), "{} never decided normally", d.base());
    }
    let denied = leader
        .request(
            "DELETE",
            "/v1/tenants/acme/pin",
            Some("not-the-token"),
            None,
        )
        .await?;
    assert_eq!(denied.status, 401);

    let prometheus = Prometheus::start(&targets).await?;
    let all_up = eventually(
        Duration::from_secs(20),
        Duration::from_millis(250),
        || async {
            let up = prometheus.query(r#"up{job="quotad"} == 1"#).await.ok()?;
            (up.len() == 3).then_some(())
        },
    )
    .await;
    assert!(
        all_up.is_some(),
        "not every daemon scraped: {}",
        prometheus.log()
    );

    // Every metric the rules name is exported. The password reloads counter exists only with
    // `redis.password_file` set (tested in redis_auth).
    let rules_text = std::fs::read_to_string(rules_dir().join("quotad-rules.yml"))?;
    let names = metric_names(&rules_text);
    assert!(names.len() >= 15, "{names:?}");
    let exported = prometheus.api("label/__name__/values", &[]).await?;
    let exported: Vec<&str> = exported
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let missing: Vec<_> = names
        .iter()
        .filter(|n| *n != "quotad_redis_password_reloads_total")
        .filter(|n| !exported.contains(&n.as_str()))
        .collect();
    assert!(missing.is_empty(), "not exported: {missing:?}");
    // Every exported metric is documented in the table of docs/metrics.md.
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md"))?;
    // The first cell of each table row: the metric names it documents.
    let table: String = doc
        .lines()
        .filter_map(|l| l.strip_prefix('|'))
        .filter_map(|row| row.split('|').next())
        .collect();
    let undocumented: Vec<_> = exported
        .iter()
        .filter(|n| n.starts_with("quotad_"))
        .map(|n| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s))
                .unwrap_or(n)
        })
        .filter(|n| !table.contains(&format!("`{n}`")))
        .collect();
    assert!(
        undocumented.is_empty(),
        "not in docs/metrics.md: {undocumented:?}"
    );
    // One label set per metric and daemon: two exporters of one name with different labels
    // would make every sum over it count twice.
    let series = prometheus.query(r#"{__name__=~"quotad_.+"}"#).await?;
    let mut label_sets = std::collections::BTreeMap::new();
    for s in &series {
        let m = s["metric"].as_object().context("a series without labels")?;
        let keys: std::collections::BTreeSet<&str> = m.keys().map(String::as_str).collect();
        let key = (m["__name__"].to_string(), m["instance"].to_string());
        label_sets
            .entry(key)
            .or_insert_with(std::collections::BTreeSet::new)
            .insert(keys);
    }
    let mixed: Vec<_> = label_sets
        .iter()
        .filter(|(_, sets)| sets.len() > 1)
        .collect();
    assert!(
        mixed.is_empty(),
        "metrics exported with different labels: {mixed:?}"
    );

    // Every rule evaluated cleanly, and nothing is pending or firing while all is well.
    let rules = eventually(
        Duration::from_secs(20),
        Duration::from_millis(250),
        || async {
            let rules = prometheus.evaluated_rules().await.ok()?;
            rules.iter().all(|r| r.1 != "unknown").then_some(rules)
        },
    )
    .await
    .expect("rules never evaluated");
    assert!(rules.len() >= 19, "{rules:?}");
    let unhealthy: Vec<_> = rules.iter().filter(|r| r.1 != "ok").collect();
    assert!(unhealthy.is_empty(), "rules failing: {unhealthy:?}");
    // A few more evaluations with rates over several scrapes.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        prometheus.alerts().await?,
        Vec::new(),
        "alerts while healthy; leader series: {:?}",
        prometheus.query("quotad_raft_is_leader").await?
    );

    // Region b's Redis killed, checks still arriving there.
    let b = cluster.index("b");
    cluster.redis[b].stop();
    let traffic = {
        let base = cluster.daemons[b].base();
        tokio::spawn(async move {
            let http = reqwest::Client::new();
            loop {
                let _ = http
                    .post(format!("{base}/v1/check"))
                    .header("content-type", "application/json")
                    .body(r#"{"tenant":"acme","policy":"writes"}"#)
                    .send()
                    .await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    until_alert(&prometheus, "QuotadStoreDegraded", "b").await?;
    until_alert(&prometheus, "QuotadDegradedDecisions", "b").await?;
    traffic.abort();

    // Region c cut off: once its lease has run out it enforces floors.
    cluster.isolate("c");
    until_alert(&prometheus, "QuotadOnFloors", "c").await?;
    let unexpected: Vec<_> = prometheus
        .alerts()
        .await?
        .into_iter()
        .filter(|a| {
            !matches!(
                (a.0.as_str(), a.1.as_str()),
                (
                    "QuotadStoreDegraded"
                        | "QuotadDegradedDecisions"
                        | "QuotadStoreErrors"
                        | "QuotadStoreSlow",
                    "b"
                ) | ("QuotadOnFloors" | "QuotadLeaseRenewalsFailing", "c")
            )
        })
        .collect();
    assert!(unexpected.is_empty(), "unexpected alerts: {unexpected:?}");
    Ok(())
}

#[test]
fn metric_names_are_read_whole_and_only_as_words() {
    let text = "expr: rate(quotad_store_errors_total[5m]) / x_quotad_no\n\
                record: quotad:decisions:rate5m\n  quotad_degraded == 1";
    assert_eq!(
        metric_names(text),
        ["quotad_degraded", "quotad_store_errors_total"]
    );
}
