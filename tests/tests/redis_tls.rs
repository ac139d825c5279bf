//! quotad against a Redis that takes only TLS clients with a certificate (`rediss://`,
//! `tls-auth-clients yes`), with a private CA: decisions and the region agent's writes go over
//! TLS. A Redis whose certificate does not verify is treated as one that does not answer: the
//! daemon serves with its fail modes and says why.

use std::time::Duration;

use quotad_system_tests::{eventually, params_keys, redis_config, Daemon};
use redis_harness::pki::TestPki;
use redis_harness::RedisServer;
use serde_json::json;

/// The single-region test config on `rediss://127.0.0.1:<tls port>` with `pki`'s CA and client
/// certificate.
fn tls_config(redis: &RedisServer, pki: &TestPki) -> String {
    let url = format!("rediss://127.0.0.1:{}/", redis.tls_port().expect("TLS"));
    redis_config(&url).replace(
        "[redis]\n",
        &format!(
            "[redis]\ntls_ca_file = {:?}\ntls_cert_file = {:?}\ntls_key_file = {:?}\n",
            pki.ca_cert.display().to_string(),
            pki.client_cert.display().to_string(),
            pki.client_key.display().to_string(),
        ),
    )
}

#[tokio::test]
async fn decisions_go_over_mutual_tls_and_an_unverified_redis_is_an_outage() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let pki = TestPki::generate(dir.path(), "redis")?;
    let redis = RedisServer::start_tls(&pki.server_files(true))?;

    let d = Daemon::start(&tls_config(&redis, &pki)).await?;
    d.put_policy("acme", "writes", json!({"limit": 2, "window_ms": 60000}))
        .await?;
    for expected in [200, 200, 429] {
        let r = d.check("acme", "writes", 1).await?;
        assert_eq!(
            (r.status, r.body["mode"].as_str()),
            (expected, Some("normal")),
            "{}",
            r.body
        );
    }
    // The agent's writes went over TLS too (read back on the plain port).
    assert!(
        eventually(
            Duration::from_secs(5),
            Duration::from_millis(50),
            || async { (params_keys(&redis.client()).await == 1).then_some(()) }
        )
        .await
        .is_some(),
        "this region's parameters written"
    );
    drop(d);

    // Certificates from another CA: Redis's does not verify, so Redis is unreachable to quotad.
    let other_dir = tempfile::tempdir()?;
    let other = TestPki::generate(other_dir.path(), "other")?;
    let d = Daemon::start(&tls_config(&redis, &other)).await?;
    let log = d.log_text();
    assert!(log.contains("does not answer at start"), "{log}");
    assert!(log.to_lowercase().contains("certificate"), "{log}");
    let status = d.get("/v1/status").await?;
    assert_eq!(status.body["store"]["state"], "degraded", "{}", status.body);
    d.put_policy(
        "acme",
        "writes",
        json!({"limit": 2, "window_ms": 60000, "fail_mode": "closed"}),
    )
    .await?;
    assert_eq!(d.check("acme", "writes", 1).await?.status, 503);
    Ok(())
}
