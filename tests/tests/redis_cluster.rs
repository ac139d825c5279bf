//! quotad on a Redis Cluster (`redis.mode = "cluster"`): three password-protected masters on
//! loopback, found through `redis.url` and `redis.seed_urls`, quotad connecting as the
//! least-privilege ACL user of docs/operations.md. Decisions, the agent's parameter writes and usage
//! collection spread over the masters; a master that restarts empty gets its shares back, and
//! one that fails over to its replica keeps its buckets.

use std::time::Duration;

use quotad_system_tests::{
    all_still_spent, client_with_password, decides_through_redis, eventually, params_keys,
    redis_config, until_all_normal, Daemon, QUOTAD_ACL,
};
use redis_harness::{ClusterOptions, RedisCluster};

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
    let resumed = until_all_normal(&d, &tenants, Duration::from_secs(15)).await;
    assert!(resumed.is_some(), "{}", d.log_text());
    Ok(())
}

#[tokio::test]
async fn a_master_that_fails_over_to_its_replica_keeps_its_buckets() -> anyhow::Result<()> {
    let mut cluster = RedisCluster::start_opts(&ClusterOptions {
        replicas: 1,
        node_timeout_ms: 1000,
        ..ClusterOptions::default()
    })?;
    let urls = cluster.urls();
    let config = redis_config(&urls[0]).replace(
        "[redis]\n",
        &format!(
            "[redis]\nmode = \"cluster\"\nseed_urls = {:?}\n",
            &urls[1..]
        ),
    );
    let d = Daemon::start(&config).await?;
    let tenants: Vec<String> = (0..TENANTS).map(|i| format!("tenant-{i}")).collect();
    for tenant in &tenants {
        // Three admitted, one denied: every bucket is empty.
        decides_through_redis(&d, tenant).await?;
    }
    // Replication is asynchronous: let the replicas catch up before their master goes.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Node 0 is a master; find its replica.
    assert_eq!(role(&cluster.nodes()[0]).await, "master");
    let port = cluster.nodes()[0].port();
    let mut replica = None;
    for (i, node) in cluster.nodes().iter().enumerate().skip(3) {
        let mut conn = node.client().get_multiplexed_async_connection().await?;
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut conn)
            .await?;
        if info.contains(&format!("master_port:{port}\r\n")) {
            replica = Some(i);
        }
    }
    let replica = replica.expect("node 0 has a replica");

    cluster.nodes_mut()[0].stop();
    // Checks of the buckets it held go to the fail modes (all checks, if the breaker opens)
    // until the replica is promoted and the cluster client has the new slot map; then every
    // tenant decides through Redis again, its bucket as empty as before: the replica held it.
    let took = until_all_normal(&d, &tenants, Duration::from_secs(30))
        .await
        .unwrap_or_else(|| panic!("no failover: {}", d.log_text()));
    eprintln!("normal decisions {took:?} after the master stopped");
    // The promoted replica holds the spent buckets.
    all_still_spent(&d, &tenants).await?;
    assert_eq!(
        role(&cluster.nodes()[replica]).await,
        "master",
        "the replica took over"
    );
    let status = d.get("/v1/status").await?;
    assert_eq!(status.body["store"]["state"], "ok", "{}", status.body);
    assert_eq!(status.body["store"]["topology"], "cluster");
    Ok(())
}

/// A node's `ROLE`: `master` or `slave`.
async fn role(node: &redis_harness::RedisServer) -> String {
    let Ok(mut conn) = node.client().get_multiplexed_async_connection().await else {
        return "unreachable".into();
    };
    redis::cmd("ROLE")
        .query_async::<Vec<redis::Value>>(&mut conn)
        .await
        .ok()
        .and_then(|v| v.into_iter().next())
        .and_then(|v| redis::from_redis_value::<String>(v).ok())
        .unwrap_or_default()
}
