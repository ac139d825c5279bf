//! The embedded single-region coordinator is durable: policies, their versions and tenant pins
//! survive a restart on the same data directory, and a store it cannot read stops start-up.

use std::time::Duration;

use quotad_system_tests::{embedded_config, Daemon, TOKEN};
use serde_json::json;

/// PUT /v1/tenants/{tenant}/pin to the one region, `solo`.
async fn pin(d: &Daemon, tenant: &str) -> anyhow::Result<quotad_system_tests::Reply> {
    let body = json!({"region": "solo"}).to_string();
    d.request(
        "PUT",
        &format!("/v1/tenants/{tenant}/pin"),
        Some(TOKEN),
        Some(body),
    )
    .await
}

#[tokio::test]
async fn policies_versions_and_pins_survive_a_restart() -> anyhow::Result<()> {
    let mut first = Daemon::start(&embedded_config()).await?;
    let spec = json!({"limit": 100, "window_ms": 60000, "floor": 0.1});
    let v1 = first.put_policy("acme", "writes", spec.clone()).await?;
    assert_eq!(v1["version"], 1);
    assert_eq!(pin(&first, "acme").await?.status, 204);
    // A tenant without policies can be pinned; the pin must survive too.
    assert_eq!(pin(&first, "newco").await?.status, 204);
    let status = first.terminate(Duration::from_secs(15)).await?;
    assert!(status.success(), "exit {status}: {}", first.log_text());

    let data = first.data_dir();
    let data = data.to_str().expect("a UTF-8 temp path");
    let second = Daemon::start_with_env(&embedded_config(), &[("QUOTAD_DATA_DIR", data)]).await?;
    let r = second
        .request("GET", "/v1/tenants/acme/policies/writes", Some(TOKEN), None)
        .await?;
    assert_eq!(
        (r.status, &r.body["version"]),
        (200, &json!(1)),
        "{}",
        r.body
    );
    let r = second.get("/v1/tenants/acme/allowance").await?;
    assert_eq!(r.body["pin"], "solo", "{}", r.body);
    assert_eq!(second.check("acme", "writes", 1).await?.status, 200);
    // The pin of newco covers its first policy, created after the restart.
    second.put_policy("newco", "writes", spec.clone()).await?;
    let r = second.get("/v1/tenants/newco/allowance").await?;
    assert_eq!(r.body["pin"], "solo", "{}", r.body);
    // Versions continue where they were (1: acme, 2: newco), never restart at 1; the same
    // policy again keeps its version.
    let v = second.put_policy("acme", "writes", spec.clone()).await?;
    assert_eq!(v["version"], 1, "{v}");
    let mut changed = spec;
    changed["limit"] = json!(200);
    let v = second.put_policy("acme", "writes", changed).await?;
    assert_eq!(v["version"], 3, "{v}");
    Ok(())
}

#[tokio::test]
async fn an_unreadable_store_stops_start_up_by_name() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data)?;
    let file = data.join("local.redb");
    std::fs::write(&file, b"not a redb file")?;
    let port = quotad_system_tests::free_port()?;
    let config = embedded_config().replace("{api}", &format!("127.0.0.1:{port}"));
    let mut d = Daemon::spawn(
        &config,
        port,
        &[("QUOTAD_DATA_DIR", data.to_str().expect("a UTF-8 temp path"))],
    )?;
    let err = d
        .wait_ready(Duration::from_secs(20))
        .await
        .expect_err("quotad must not start on a store it cannot read");
    assert!(err.to_string().contains("exited"), "{err}");
    let log = d.log_text();
    assert!(log.contains(&file.display().to_string()), "{log}");
    Ok(())
}
