//! A real Prometheus server scraping daemons, and the `promtool`/`prometheus` binaries it needs.
//!
//! They come from Debian's `prometheus` package: `scripts/fetch-prometheus.sh` (run by
//! `.ci/run`) unpacks them into `target/prometheus`; `QUOTAD_PROMETHEUS_DIR` names another
//! directory holding them, and `PATH` is searched last.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde_json::Value;

use crate::{eventually, free_port};

/// `deploy/prometheus`: the rules file and its unit tests.
pub fn rules_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus")
}

/// A Prometheus tool: from `QUOTAD_PROMETHEUS_DIR`, `target/prometheus` or `PATH`.
pub fn tool(name: &str) -> anyhow::Result<PathBuf> {
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
                "{name} not found in QUOTAD_PROMETHEUS_DIR, target/prometheus or PATH: \
                 scripts/fetch-prometheus.sh unpacks it from Debian's prometheus package \
                 (see docs/metrics.md)"
            )
        })
}

/// The `quotad_…` metric names a text (rules, a query) mentions: whole words only, so neither
/// a recording rule's `quotad:…` nor the tail of a longer name counts.
pub fn metric_names(text: &str) -> Vec<String> {
    let mut names: Vec<String> = text
        .match_indices("quotad_")
        .filter(|(i, _)| {
            // Not the tail of a longer word.
            !text[..*i]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        })
        .map(|(i, _)| {
            text[i..]
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
#[derive(Debug)]
pub struct Prometheus {
    child: Child,
    base: String,
    http: reqwest::Client,
    dir: tempfile::TempDir,
}

impl Prometheus {
    /// Scrapes `targets` (`host:port`) as job `quotad` every second and evaluates the rules of
    /// `deploy/prometheus/quotad-rules.yml` every second.
    pub async fn start(targets: &[String]) -> anyhow::Result<Self> {
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

    /// The server's log (warnings and errors).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// The `data` of an API answer; an error when Prometheus answers with an error.
    pub async fn api(&self, path: &str, query: &[(&str, &str)]) -> anyhow::Result<Value> {
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
    pub async fn query(&self, q: &str) -> anyhow::Result<Vec<Value>> {
        let data = self.api("query", &[("query", q)]).await?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// Every metric name Prometheus has a series of.
    pub async fn metric_names(&self) -> anyhow::Result<Vec<String>> {
        let names = self.api("label/__name__/values", &[]).await?;
        Ok(names
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect())
    }

    /// Pending and firing alerts as (name, region, state).
    pub async fn alerts(&self) -> anyhow::Result<Vec<(String, String, String)>> {
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
    pub async fn evaluated_rules(&self) -> anyhow::Result<Vec<(String, String, String)>> {
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

#[cfg(test)]
mod tests {
    use super::metric_names;

    #[test]
    fn metric_names_are_read_whole_and_only_as_words() {
        let text = "expr: rate(quotad_store_errors_total[5m]) / x_quotad_no\n\
                    record: quotad:decisions:rate5m\n  quotad_degraded == 1";
        assert_eq!(
            metric_names(text),
            ["quotad_degraded", "quotad_store_errors_total"]
        );
    }
}
