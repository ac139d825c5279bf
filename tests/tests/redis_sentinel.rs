//! quotad on a Sentinel-managed Redis (`redis.mode = "sentinel"`): the daemon finds the master
//! through the sentinels and, when it fails over, goes on deciding through the promoted replica
//! with every bucket as the replica holds it; once with password-protected sentinels, once with
//! sentinels and servers taking only TLS clients with a certificate.

use std::time::Duration;

use quotad_system_tests::{
    all_still_spent, decides_through_redis, params_present, redis_config, until_all_normal, Daemon,
};
use redis_harness::pki::TestPki;
use redis_harness::{RedisSentinel, SentinelOptions};

#[tokio::test]
async fn a_daemon_follows_its_redis_through_a_sentinel_failover() -> anyhow::Result<()> {
    // The sentinels require a password of their own, from the environment.
    let mut sentinel = RedisSentinel::start_with_password("quotad", 1000, Some("s3ntinel pw"))?;
    let urls = sentinel.urls();
    let config = redis_config(&urls[0]).replace(
        "[redis]\n",
        &format!(
            "[redis]\nmode = \"sentinel\"\nmaster_name = \"{}\"\nseed_urls = {:?}\n",
            sentinel.name(),
            &urls[1..]
        ),
    );
    let d = Daemon::start_with_env(
        &config,
        &[("QUOTAD_REDIS_SENTINEL_PASSWORD", "s3ntinel pw")],
    )
    .await?;
    let tenants: Vec<String> = (0..6).map(|i| format!("tenant-{i}")).collect();
    let mut versions = Vec::new();
    for tenant in &tenants {
        // Three admitted, one denied: every bucket is empty.
        versions.push(decides_through_redis(&d, tenant).await?);
    }
    // Replication is asynchronous: let the replica catch up before its master goes.
    tokio::time::sleep(Duration::from_millis(300)).await;

    sentinel.master_mut().stop();
    let took = until_all_normal(&d, &tenants, Duration::from_secs(30))
        .await
        .unwrap_or_else(|| panic!("no failover: {}", d.log_text()));
    eprintln!("normal decisions {took:?} after the master stopped");
    // The promoted replica holds the spent buckets and their parameters.
    all_still_spent(&d, &tenants).await?;
    let replica = sentinel.replica().client();
    for (tenant, version) in tenants.iter().zip(&versions) {
        assert!(params_present(&replica, tenant, "writes", *version).await);
    }
    let status = d.get("/v1/status").await?;
    assert_eq!(status.body["store"]["state"], "ok", "{}", status.body);
    assert_eq!(status.body["store"]["topology"], "sentinel");
    Ok(())
}

#[tokio::test]
async fn a_daemon_follows_its_redis_through_a_failover_over_mutual_tls() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let pki = TestPki::generate(dir.path(), "sentinel")?;
    let (cert, key, ca) = (
        pki.client_cert.display().to_string(),
        pki.client_key.display().to_string(),
        pki.ca_cert.display().to_string(),
    );
    // Replication and the sentinels' own connections present the client certificate too.
    let client_cert = pki.client_cert_args();
    let extra: Vec<&str> = client_cert.iter().map(String::as_str).collect();
    let files = pki.server_files(true);
    let mut sentinel = RedisSentinel::start_opts(
        "quotad-tls",
        1000,
        &SentinelOptions {
            tls: Some(&files),
            extra: &extra,
            ..SentinelOptions::default()
        },
    )?;
    let urls = sentinel.tls_urls();
    let config = redis_config(&urls[0]).replace(
        "[redis]\n",
        &format!(
            "[redis]\nmode = \"sentinel\"\nmaster_name = \"{}\"\nseed_urls = {:?}\n\
             tls_ca_file = {ca:?}\ntls_cert_file = {cert:?}\ntls_key_file = {key:?}\n",
            sentinel.name(),
            &urls[1..]
        ),
    );
    let d = Daemon::start(&config).await?;
    let tenants: Vec<String> = (0..4).map(|i| format!("tls-tenant-{i}")).collect();
    for tenant in &tenants {
        decides_through_redis(&d, tenant).await?;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    sentinel.master_mut().stop();
    let took = until_all_normal(&d, &tenants, Duration::from_secs(30))
        .await
        .unwrap_or_else(|| panic!("no failover: {}", d.log_text()));
    eprintln!("normal decisions {took:?} after the master stopped (TLS)");
    all_still_spent(&d, &tenants).await?;
    let status = d.get("/v1/status").await?;
    assert_eq!(status.body["store"]["state"], "ok", "{}", status.body);
    assert_eq!(status.body["store"]["topology"], "sentinel");
    Ok(())
}
