//! The binary's command line and lifecycle: --version, check-config over every example config
//! and a broken one, and graceful shutdown on SIGTERM.

use std::process::Command;
use std::time::Duration;

use quotad_system_tests::{config_dir, embedded_config, quotad_binary, Daemon};

#[test]
fn version_and_check_config() -> anyhow::Result<()> {
    let bin = quotad_binary()?;
    let out = Command::new(&bin).arg("--version").output()?;
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("quotad "));

    for entry in std::fs::read_dir(config_dir())? {
        let path = entry?.path();
        // An example with peer TLS names certificate files under /etc; the config unit test
        // `every_example_config_parses_and_validates` checks it with generated ones.
        let tls = std::fs::read_to_string(&path)?.contains("\ntls_cert_file");
        if path.extension().is_some_and(|e| e == "toml") && !tls {
            let out = Command::new(&bin)
                .arg("check-config")
                .arg(&path)
                .env("QUOTAD_PEER_TOKEN", "peer-secret-value")
                .env("QUOTAD_ADMIN_TOKEN", "admin-secret-value")
                .output()?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                !stdout.contains("secret-value"),
                "secrets are redacted: {stdout}"
            );
            assert!(stdout.contains("admin_token = <redacted>"));
        }
    }

    let dir = tempfile::tempdir()?;
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "region = \"no spaces allowed\"\n[api]\nlisten = \"nowhere\"\n[coordination]\nlease_ms = 0\n")?;
    let out = Command::new(&bin).arg("check-config").arg(&bad).output()?;
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for field in ["region", "api.listen", "coordination.lease_ms"] {
        assert!(stderr.contains(field), "{field} not reported: {stderr}");
    }
    let unknown = dir.path().join("unknown.toml");
    std::fs::write(&unknown, "region = \"a\"\ncolour = \"red\"\n")?;
    let out = Command::new(&bin)
        .arg("check-config")
        .arg(&unknown)
        .output()?;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("colour"));
    Ok(())
}

#[tokio::test]
async fn sigterm_drains_and_exits_cleanly() -> anyhow::Result<()> {
    let mut d = Daemon::start(&embedded_config()).await?;
    assert_eq!(d.get("/livez").await?.status, 200);
    let status = d.terminate(Duration::from_secs(15)).await?;
    assert!(status.success(), "exit status {status}: {}", d.log_text());
    let log = d.log_text();
    assert!(log.contains("draining"), "{log}");
    assert!(log.contains("quotad stopped"), "{log}");
    Ok(())
}

#[tokio::test]
async fn a_generated_admin_token_is_printed_once() -> anyhow::Result<()> {
    let bin = quotad_binary()?;
    let dir = tempfile::tempdir()?;
    let port = quotad_system_tests::free_port()?;
    let cfg = dir.path().join("q.toml");
    std::fs::write(
        &cfg,
        format!("region = \"solo\"\n[api]\nlisten = \"127.0.0.1:{port}\"\n"),
    )?;
    let log = dir.path().join("err.log");
    let mut child = Command::new(bin)
        .args(["run", "--config"])
        .arg(&cfg)
        .env_remove("QUOTAD_ADMIN_TOKEN")
        .env("QUOTAD_DATA_DIR", dir.path().join("data"))
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let found = quotad_system_tests::eventually(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            text.contains("quotad serving").then_some(text)
        },
    )
    .await;
    let _ = child.kill();
    let _ = child.wait();
    let text = found.expect("quotad started");
    assert_eq!(
        text.matches("generated one for this run").count(),
        1,
        "{text}"
    );
    Ok(())
}
