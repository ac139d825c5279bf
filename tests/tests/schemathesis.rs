//! The OpenAPI document is the contract: schemathesis (every check, every phase, the stateful
//! one included) runs against a real daemon on the embedded store and on Redis, with the admin
//! token and without it, and the test fails on any failure it reports.
//!
//! schemathesis is a Python tool (PyPI); `scripts/install-test-deps.sh` installs the pinned
//! version when it is missing. Without it this test fails, naming the install step.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};
use quotad_system_tests::{embedded_config, redis_config, Daemon, TOKEN};
use redis_harness::RedisServer;

/// The version `scripts/install-test-deps.sh` installs.
const SCHEMATHESIS_VERSION: &str = "4.32.5";
/// Examples per operation and phase: with 22 operations and four phases, over 3 000 cases
/// per run (120 gave ~4 500 with the token, at twice the time).
const MAX_EXAMPLES: u32 = 90;
/// The fewest cases one run may report.
const MIN_CASES: u64 = 2000;
/// Fixed, so a failure reproduces.
const SEED: u32 = 22;

fn config_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("schemathesis/schemathesis.toml")
}

/// The `st` executable (or `schemathesis`), or an error naming the install step.
fn schemathesis() -> anyhow::Result<PathBuf> {
    for name in ["st", "schemathesis"] {
        if let Ok(out) = Command::new(name).arg("--version").output() {
            if out.status.success() {
                return Ok(PathBuf::from(name));
            }
        }
    }
    bail!(
        "schemathesis is not installed: run `pip install -r tests/python/requirements.txt` (schemathesis=={SCHEMATHESIS_VERSION}) \
         (scripts/install-test-deps.sh installs it when missing)"
    )
}

/// The number after `label` in schemathesis' summary, e.g. `2345` in "2345 generated".
fn count_before(text: &str, label: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let words: Vec<&str> = line
            .split(|c: char| c.is_whitespace() || c == ',')
            .collect();
        words
            .windows(2)
            .find(|w| w[1] == label)
            .and_then(|w| w[0].parse().ok())
    })
}

/// Runs schemathesis against `d`, with the token or without, and returns its figures.
fn run(d: &Daemon, store: &str, with_token: bool) -> anyhow::Result<u64> {
    let st = schemathesis()?;
    let dir = tempfile::tempdir()?;
    let mut cmd = Command::new(st);
    cmd.current_dir(dir.path())
        .arg("--config-file")
        .arg(config_file())
        .arg("run")
        .arg(format!("{}/openapi.json", d.base()))
        .args(["--checks", "all"])
        .args(["--phases", "examples,coverage,fuzzing,stateful"])
        .args(["--max-examples", &MAX_EXAMPLES.to_string()])
        .args(["--seed", &SEED.to_string()])
        // One worker: hypothesis describes strategies by parsing their source with `ast`, and
        // CPython's AST constructor can fail spuriously with several threads at once ("AST
        // constructor recursion depth mismatch", python/cpython#106905): a runtime error of the
        // tool, reported as an error of whichever operation it hit.
        .args(["--workers", "1"])
        .args(["--request-timeout", "10"])
        .arg("--continue-on-failure")
        .args(["--suppress-health-check", "all"])
        .args(["--warnings", "off"])
        .env("NO_COLOR", "1")
        .env("SCHEMATHESIS_HOOKS", "");
    if with_token {
        cmd.args(["--header", &format!("Authorization: Bearer {TOKEN}")]);
    }
    let out = cmd.output().context("running schemathesis")?;
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let cases = count_before(&text, "generated").unwrap_or(0);
    let failures = count_before(&text, "failures").or_else(|| count_before(&text, "failure"));
    println!(
        "schemathesis on {store}, {}: {cases} cases, {} failures, exit {:?}",
        if with_token {
            "with the token"
        } else {
            "without a token"
        },
        failures.unwrap_or(0),
        out.status.code()
    );
    if !out.status.success() {
        bail!("schemathesis reported failures on {store} (token: {with_token}):\n{text}");
    }
    if cases < MIN_CASES {
        bail!("schemathesis ran {cases} cases on {store}, fewer than {MIN_CASES}:\n{text}");
    }
    Ok(cases)
}

/// The daemons take identities, so checks naming one are decided (and fuzzed) too.
const IDENTITY_KEY: &[(&str, &str)] = &[("QUOTAD_IDENTITY_KEY", "schemathesis-identity-key")];

#[tokio::test(flavor = "multi_thread")]
async fn schemathesis_finds_no_failure_on_the_embedded_store() -> anyhow::Result<()> {
    let d = Daemon::start_with_env(&embedded_config(), IDENTITY_KEY).await?;
    let mut total = 0;
    for with_token in [true, false] {
        total += tokio::task::block_in_place(|| run(&d, "embedded", with_token))?;
    }
    println!("schemathesis on embedded: {total} cases in all, 0 failures");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn schemathesis_finds_no_failure_on_redis() -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    let d = Daemon::start_with_env(&redis_config(&redis.url()), IDENTITY_KEY).await?;
    let mut total = 0;
    for with_token in [true, false] {
        total += tokio::task::block_in_place(|| run(&d, "redis", with_token))?;
    }
    println!("schemathesis on redis: {total} cases in all, 0 failures");
    Ok(())
}
