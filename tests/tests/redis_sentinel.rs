//! quotad on a Sentinel-managed Redis (`redis.mode = "sentinel"`): the daemon finds the master
//! through the sentinels and, when it fails over, goes on deciding through the promoted replica
//! with every bucket as the replica holds it.

use std::time::{Duration, Instant};

use quotad_system_tests::{
    decides_through_redis, eventually, params_present, redis_config, Daemon,
};
use redis_harness::RedisSentinel;

#[tokio::test]
async fn a_daemon_follows_its_redis_through_a_sentinel_failover() -> anyhow::Result<()> {
    let mut sentinel = RedisSentinel::start("quotad", 1000)?;
    let urls = sentinel.urls();
    let config = redis_config(&urls[0]).replace(
        "[redis]\n",
        &format!(
            "[redis]\nmode = \"sentinel\"\nmaster_name = \"{}\"\nseed_urls = {:?}\n",
            sentinel.name(),
            &urls[1..]
        ),
    );
    let d = Daemon::start(&config).await?;
    let tenants: Vec<String> = (0..6).map(|i| format!("tenant-{i}")).collect();
    let mut versions = Vec::new();
    for tenant in &tenants {
        // Three admitted, one denied: every bucket is empty.
        versions.push(decides_through_redis(&d, tenant).await?);
    }
    // Replication is asynchronous: let the replica catch up before its master goes.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let stopped = Instant::now();
    sentinel.master_mut().stop();
    let resumed = eventually(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            for tenant in &tenants {
                let r = d.check(tenant, "writes", 1).await.ok()?;
                if r.body["mode"] != "normal" {
                    return None;
                }
            }
            Some(stopped.elapsed())
        },
    )
    .await;
    let took = resumed.unwrap_or_else(|| panic!("no failover: {}", d.log_text()));
    eprintln!("normal decisions {took:?} after the master stopped");
    let replica = sentinel.replica().client();
    for (tenant, version) in tenants.iter().zip(&versions) {
        let r = d.check(tenant, "writes", 1).await?;
        assert_eq!(
            (r.status, r.body["mode"].as_str()),
            (429, Some("normal")),
            "{tenant}: the promoted replica holds the spent bucket: {}",
            r.body
        );
        assert!(params_present(&replica, tenant, "writes", *version).await);
    }
    let status = d.get("/v1/status").await?;
    assert_eq!(status.body["store"]["state"], "ok", "{}", status.body);
    Ok(())
}
