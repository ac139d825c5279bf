//! quotad on a Redis Cluster (`redis.mode = "cluster"`): three password-protected masters on
//! loopback, found through `redis.url` and `redis.seed_urls`, quotad connecting as the
//! least-privilege ACL user of the README. Decisions, the agent's parameter writes and usage
//! collection spread over the masters; a master that restarts empty gets its shares back.

use std::time::Duration;

use quotad_system_tests::{
    client_with_password, decides_through_redis, eventually, params_keys, redis_config, Daemon,
    QUOTAD_ACL,
};
use redis_harness::RedisCluster;

const TENANTS: usize = 12;
const DEFAULT_PASSWORD: &str = "cluster-d3fault#pw";
const QUOTAD_PASSWORD: &str = "cluster-qu0tad/pw";

/// Parameter hashes on each master, in node order.
async fn params_per_node(cluster: &RedisCluster) -> Vec<usize> {
    let mut counts = Vec::new();
    for node in cluster.nodes() {
        counts.push(params_keys(&client_with_password(&node.url(), DEFAULT_PASSWORD)).await);
    }
    counts
}

#[tokio::test]
async fn a_daemon_on_a_redis_cluster_decides_and_restores_a_master_that_restarts_empty(
) -> anyhow::Result<()> {
    let pass = format!(">{QUOTAD_PASSWORD}");
    let mut acl = vec!["--user", "quotad", &pass];
    acl.extend_from_slice(QUOTAD_ACL);
    // A Cluster client also reads the slot map and follows ASK redirects.
    acl.extend_from_slice(&["+cluster|slots", "+asking"]);
    let mut cluster = RedisCluster::start_with(Some(DEFAULT_PASSWORD), &acl)?;
    let urls = cluster.urls();
    let seeds = format!("{:?}", &urls[1..]);
    // At debug level the log shows every store call the agent could not make.
    let config = redis_config(&urls[0])
        .replace(
            "[redis]\n",
            &format!("[redis]\nmode = \"cluster\"\nseed_urls = {seeds}\nusername = \"quotad\"\n"),
        )
        .replace("log_level = \"info\"", "log_level = \"debug\"");
    let d = Daemon::start_with_env(&config, &[("QUOTAD_REDIS_PASSWORD", QUOTAD_PASSWORD)]).await?;

    let tenants: Vec<String> = (0..TENANTS).map(|i| format!("tenant-{i}")).collect();
    for tenant in &tenants {
        decides_through_redis(&d, tenant).await?;
    }

    // The agent writes every bucket's parameters, each on the master that owns its slot.
    let spread = eventually(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async {
            let counts = params_per_node(&cluster).await;
            (counts.iter().sum::<usize>() == TENANTS).then_some(counts)
        },
    )
    .await
    .expect("every tenant's parameters on the cluster");
    assert!(
        spread.iter().filter(|&&n| n > 0).count() >= 2,
        "{TENANTS} tenants' keys spread over more than one master: {spread:?}"
    );
    // Five report intervals: usage collection over every slot index and lease renewal ran
    // without a failed store call.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let log = d.log_text();
    for failure in ["failed", "refused", "not delivered", "CROSSSLOT", "MOVED"] {
        assert!(!log.contains(failure), "{failure}: {log}");
    }

    // The master holding the most parameters restarts empty (no persistence), keeping its
    // slots. Its new run id makes the agent write every share again.
    let (busiest, before) = spread
        .iter()
        .copied()
        .enumerate()
        .max_by_key(|&(_, n)| n)
        .expect("three masters");
    cluster.nodes_mut()[busiest].restart()?;
    assert_eq!(params_per_node(&cluster).await[busiest], 0);
    let restored = eventually(
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async {
            let counts = params_per_node(&cluster).await;
            (counts == spread).then_some(counts)
        },
    )
    .await;
    assert_eq!(
        restored.as_ref(),
        Some(&spread),
        "the restarted master's {before} parameter hashes are written again"
    );
    // And every tenant decides through Redis again.
    let resumed = eventually(
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async {
            for tenant in &tenants {
                let r = d.check(tenant, "writes", 1).await.ok()?;
                if r.body["mode"] != "normal" {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    assert!(resumed.is_some(), "{}", d.log_text());
    Ok(())
}
