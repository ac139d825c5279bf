//! Envoy's rate limit service driven from outside the Rust stack: a Python grpcio client
//! (tests/python/envoy_rls_client.py) with stubs generated at run time from the .proto files
//! that ship in the envoy-types and tonic-health crates, against a real quotad and Redis.
//! The script covers every point of the service's contract and prints `ok <point>` for each;
//! this test puts the policies it expects, sends SIGTERM when it asks (the drain) and holds
//! every point to have passed.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use quotad_system_tests::crates::{cargo_metadata, crate_dir};
use quotad_system_tests::{free_port, redis_config_with_envoy, Daemon};
use redis_harness::RedisServer;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// The points the script reports, in order.
const POINTS: [&str; 13] = [
    "five_then_over",
    "concurrent",
    "malformed_beside_spent_global",
    "malformed_each_on_its_own",
    "invalid_requests",
    "current_limit",
    "headers",
    "cost_above_burst",
    "hits_addend_zero",
    "refund",
    "latency",
    "health",
    "drain",
];

const HOUR_MS: u64 = 3_600_000;

#[tokio::test]
async fn a_python_grpcio_client_sees_every_point_of_the_envoy_contract() -> anyhow::Result<()> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let metadata = cargo_metadata(&workspace).await?;
    let envoy_proto = crate_dir(&metadata, "envoy-types")?.join("proto");
    let health_proto = crate_dir(&metadata, "tonic-health")?.join("proto");
    let script = workspace.join("tests/python/envoy_rls_client.py");
    let stubs = tempfile::tempdir()?;

    let redis = RedisServer::start()?;
    let envoy_port = free_port()?;
    let config = redis_config_with_envoy(&redis.url(), envoy_port);
    let mut d = Daemon::start(&config).await?;
    for (tenant, policy, limit, window_ms) in [
        ("acme", "five", 5, HOUR_MS),
        ("acme", "crowd", 20, HOUR_MS),
        ("all", "global", 1, HOUR_MS),
        ("acme", "tensec", 3, 10_000),
        ("acme", "weekly", 1, 7 * 24 * HOUR_MS),
        ("acme", "reads", 2, HOUR_MS),
        ("acme", "small", 5, HOUR_MS),
        ("acme", "refunds", 10, HOUR_MS),
    ] {
        d.put_policy(
            tenant,
            policy,
            json!({"limit": limit, "window_ms": window_ms}),
        )
        .await?;
    }

    let mut client = Command::new("python3")
        .arg(&script)
        .arg("--target")
        .arg(format!("127.0.0.1:{envoy_port}"))
        .arg("--envoy-proto")
        .arg(&envoy_proto)
        .arg("--health-proto")
        .arg(&health_proto)
        .arg("--stubs")
        .arg(stubs.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting python3 (grpcio and grpcio-tools: tests/python/requirements.txt)")?;
    let mut lines = BufReader::new(client.stdout.take().context("no stdout")?).lines();
    let mut said = Vec::new();
    let mut stopped_in = None;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(line) = tokio::time::timeout(left, lines.next_line()).await else {
            bail!("the client did not finish in time; it said: {said:#?}");
        };
        let Some(line) = line? else { break };
        if line == "awaiting shutdown" {
            let stopping = Instant::now();
            let status = d.terminate(Duration::from_secs(15)).await?;
            assert!(status.success(), "{status:?}: {}", d.log_text());
            stopped_in = Some(stopping.elapsed());
        }
        said.push(line);
    }
    let out = client.wait_with_output().await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{:?}: {said:#?}\n{stderr}",
        out.status
    );
    let reported: Vec<&str> = said
        .iter()
        .filter_map(|l| l.strip_prefix("ok "))
        .filter_map(|l| l.split(':').next())
        .collect();
    assert_eq!(reported, POINTS, "{said:#?}");
    for line in &said {
        println!("{line}");
    }
    let stopped_in = stopped_in.context("the client never asked for shutdown")?;
    assert!(
        stopped_in < Duration::from_secs(5),
        "stopped in {stopped_in:?}"
    );
    Ok(())
}
