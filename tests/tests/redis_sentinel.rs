//! quotad on a Sentinel-managed Redis (`redis.mode = "sentinel"`, the sentinels password-
//! protected): the daemon finds the master through the sentinels and, when it fails over, goes on deciding through the promoted replica
//! with every bucket as the replica holds it.

use std::time::Duration;

use quotad_system_tests::{
    all_still_spent, decides_through_redis, params_present, redis_config, until_all_normal, Daemon,
};
use redis_harness::RedisSentinel;

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
