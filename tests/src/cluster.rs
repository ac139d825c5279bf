//! Several regions on loopback: a redis-server, a quotad and a fault proxy per region, and
//! the cuts between them.

use std::time::Duration;

use anyhow::Context as _;

use crate::fault_proxy::FaultProxy;
use crate::{eventually, free_port, Daemon};

/// The peer token every test cluster shares.
pub const PEER_TOKEN: &str = "system-test-peer-token-0123456789";

/// Three (or more) regions on loopback: one redis-server, one quotad and one fault proxy in
/// front of each daemon's peer listener.
#[derive(Debug)]
pub struct Cluster {
    /// Held while the cluster lives: clusters of different test processes run one at a time,
    /// so nine daemons never compete for two cores.
    _serial: std::fs::File,
    pub names: Vec<String>,
    pub daemons: Vec<Daemon>,
    pub redis: Vec<redis_harness::RedisServer>,
    pub proxies: Vec<FaultProxy>,
    /// Each daemon's Envoy listener port, in region order; empty unless started with
    /// [`Cluster::start_with_envoy`].
    pub envoy_ports: Vec<u16>,
}

/// A daemon started to join a [`Cluster`] ([`Cluster::start_joining`]), with its Redis and the
/// addresses its `[[regions]]` entry gives.
#[derive(Debug)]
pub struct Joining {
    pub daemon: Daemon,
    pub redis: redis_harness::RedisServer,
    /// `host:port` of its API.
    pub api: String,
    /// `host:port` of its peer listener.
    pub peer: String,
}

/// Timings of test clusters: short so rounds are quick, long enough for 2 cores in debug.
#[derive(Debug)]
pub struct Timings {
    pub report_interval_ms: u64,
    pub rebalance_interval_ms: u64,
    pub lease_ms: u64,
    pub drift_margin_ms: u64,
    /// Raft's heartbeat, also the timeout of each AppendEntries and pre-vote call.
    pub heartbeat_interval_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// The daemons' `redis.denial_cache` (not a timing: the one daemon switch a test turns).
    pub denial_cache: bool,
}

impl Default for Timings {
    fn default() -> Self {
        Self {
            report_interval_ms: 200,
            rebalance_interval_ms: 400,
            lease_ms: 3_000,
            drift_margin_ms: 300,
            heartbeat_interval_ms: 100,
            election_timeout_min_ms: 400,
            election_timeout_max_ms: 800,
            denial_cache: true,
        }
    }
}

impl Cluster {
    /// Starts regions `names` and returns as soon as every daemon is ready (`/readyz` 200): its
    /// region and every other one registered, and holding its first lease, so a pin to any
    /// region commits and a policy put then is decided in every region from its first check.
    pub async fn start(names: &[&str], t: &Timings) -> anyhow::Result<Self> {
        Self::start_with_env(names, t, &[]).await
    }

    /// [`Cluster::start`] with extra environment for some regions' daemons: `(region, [(name,
    /// value)])`, e.g. a faked wall clock for one region.
    pub async fn start_with_env(
        names: &[&str],
        t: &Timings,
        env: &[(&str, &[(&str, &str)])],
    ) -> anyhow::Result<Self> {
        Self::start_inner(names, t, env, None).await
    }

    /// [`Cluster::start`] with Envoy's gRPC listener on in every daemon, on a loopback port of
    /// its own ([`Cluster::envoy_target`]); `envoy` holds further lines of the `[envoy]` section
    /// (empty for the defaults).
    pub async fn start_with_envoy(
        names: &[&str],
        t: &Timings,
        envoy: &str,
    ) -> anyhow::Result<Self> {
        Self::start_inner(names, t, &[], Some(envoy)).await
    }

    async fn start_inner(
        names: &[&str],
        t: &Timings,
        env: &[(&str, &[(&str, &str)])],
        envoy: Option<&str>,
    ) -> anyhow::Result<Self> {
        let serial = serial_lock().await?;
        let mut redis = Vec::new();
        for _ in names {
            redis.push(redis_harness::RedisServer::start()?);
        }
        // Ports are picked free and then bound by the daemons: another process can take one in
        // between, and that daemon exits at once. Such a start is retried on fresh ports.
        let mut attempt = 0;
        let (daemons, proxies, envoy_ports) = loop {
            attempt += 1;
            match Self::spawn_regions(names, t, &redis, env, envoy).await {
                Ok(started) => break started,
                Err(e) if attempt < 3 && format!("{e:#}").contains("exited during start-up") => {
                    eprintln!("cluster start attempt {attempt} failed, retrying: {e:#}");
                }
                Err(e) => return Err(e),
            }
        };
        Ok(Self {
            _serial: serial,
            names: names.iter().map(|s| s.to_string()).collect(),
            daemons,
            redis,
            proxies,
            envoy_ports,
        })
    }

    /// Spawns one daemon per region (with a fault proxy in front of each peer port, and an
    /// Envoy listener when `envoy` is set) and waits until all are ready. A daemon that fails
    /// is killed when its `Daemon` drops.
    async fn spawn_regions(
        names: &[&str],
        t: &Timings,
        redis: &[redis_harness::RedisServer],
        env: &[(&str, &[(&str, &str)])],
        envoy: Option<&str>,
    ) -> anyhow::Result<(Vec<Daemon>, Vec<FaultProxy>, Vec<u16>)> {
        let api: Vec<u16> = names
            .iter()
            .map(|_| free_port())
            .collect::<anyhow::Result<_>>()?;
        let peer: Vec<u16> = names
            .iter()
            .map(|_| free_port())
            .collect::<anyhow::Result<_>>()?;
        let envoy_ports: Vec<u16> = match envoy {
            Some(_) => names
                .iter()
                .map(|_| free_port())
                .collect::<anyhow::Result<_>>()?,
            None => Vec::new(),
        };
        let mut proxies = Vec::new();
        for p in &peer {
            proxies.push(FaultProxy::start(([127, 0, 0, 1], *p).into()).await?);
        }
        let mut members = String::new();
        for (i, n) in names.iter().enumerate() {
            members.push_str(&region_entry(
                n,
                i as u64 + 1,
                &format!("127.0.0.1:{}", api[i]),
                &proxies[i].addr.to_string(),
            ));
        }
        let mut daemons = Vec::new();
        for (i, n) in names.iter().enumerate() {
            let mut config = daemon_config(n, api[i], peer[i], &redis[i].url(), t, &members);
            if let Some(extra) = envoy {
                config.push_str(&format!(
                    "[envoy]\nlisten = \"127.0.0.1:{}\"\n{extra}\n",
                    envoy_ports[i]
                ));
            }
            let mut vars = vec![("QUOTAD_PEER_TOKEN", PEER_TOKEN)];
            for (_, extra) in env.iter().filter(|(region, _)| region == n) {
                vars.extend_from_slice(extra);
            }
            daemons.push(Daemon::spawn(&config, api[i], &vars)?);
        }
        let pids: Vec<u32> = daemons.iter().filter_map(Daemon::pid).collect();
        for p in &proxies {
            p.set_candidates(&pids);
        }
        for d in &mut daemons {
            if let Err(e) = d.wait_ready(Duration::from_secs(30)).await {
                return Err(e.context(d.log_text()));
            }
        }
        Ok((daemons, proxies, envoy_ports))
    }

    /// Starts a daemon for a new region `name` with its own redis-server, configured to join
    /// this cluster as node `node_id`: its `[[regions]]` lists the cluster's regions and itself
    /// at `host:<port>` (so it never initializes a cluster of its own). It serves at once (this
    /// returns once `/livez` answers) but takes part, and is ready, only once the leader adds
    /// it (`POST /v1/cluster/members`).
    pub async fn start_joining(
        &self,
        name: &str,
        node_id: u64,
        host: &str,
        t: &Timings,
    ) -> anyhow::Result<Joining> {
        let redis = redis_harness::RedisServer::start()?;
        let mut last = None;
        // As in `start`: a port taken between picking and binding is retried on fresh ones.
        for _ in 0..3 {
            let (api, peer) = (free_port()?, free_port()?);
            let mut members = String::new();
            for (i, n) in self.names.iter().enumerate() {
                members.push_str(&region_entry(
                    n,
                    i as u64 + 1,
                    &format!("127.0.0.1:{}", self.daemons[i].api_port),
                    &self.proxies[i].addr.to_string(),
                ));
            }
            let (api_addr, peer_addr) = (format!("{host}:{api}"), format!("{host}:{peer}"));
            members.push_str(&region_entry(name, node_id, &api_addr, &peer_addr));
            let config = daemon_config(name, api, peer, &redis.url(), t, &members);
            let mut daemon = Daemon::spawn(&config, api, &[("QUOTAD_PEER_TOKEN", PEER_TOKEN)])?;
            // Not ready until it is a member: it serves (`/livez`) and waits to be added.
            let live = eventually(
                Duration::from_secs(30),
                Duration::from_millis(50),
                || async { (daemon.get_text("/livez").await.ok()?.0 == 200).then_some(()) },
            )
            .await;
            if live.is_some() && daemon.is_running() {
                return Ok(Joining {
                    daemon,
                    redis,
                    api: api_addr,
                    peer: peer_addr,
                });
            }
            last = Some(anyhow::anyhow!(
                "the joining daemon did not serve: {}",
                daemon.log_text()
            ));
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("the joining daemon did not start")))
    }

    /// Index of a region by name.
    pub fn index(&self, name: &str) -> usize {
        self.names
            .iter()
            .position(|n| n == name)
            .unwrap_or_else(|| panic!("no region {name}"))
    }

    /// The daemon of a region.
    pub fn daemon(&self, name: &str) -> &Daemon {
        &self.daemons[self.index(name)]
    }

    /// `host:port` of region `name`'s Envoy listener (started with [`Cluster::start_with_envoy`]).
    pub fn envoy_target(&self, name: &str) -> String {
        let port = self
            .envoy_ports
            .get(self.index(name))
            .unwrap_or_else(|| panic!("the cluster runs no Envoy listener"));
        format!("127.0.0.1:{port}")
    }

    /// Cuts region `name` off from every other region, both ways.
    pub fn isolate(&self, name: &str) {
        let i = self.index(name);
        let me: Vec<u32> = self.daemons[i].pid().into_iter().collect();
        let others: Vec<u32> = self
            .daemons
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .filter_map(|(_, d)| d.pid())
            .collect();
        self.proxies[i].block(&others);
        for (j, p) in self.proxies.iter().enumerate() {
            if j != i {
                p.block(&me);
            }
        }
    }

    /// Heals every cut.
    pub fn heal(&self) {
        for p in &self.proxies {
            p.heal();
        }
    }

    /// Region `name`'s share of a tenant's policy, as `name` itself reports it.
    pub async fn share(&self, name: &str, tenant: &str) -> Option<(f64, f64)> {
        let r = self
            .daemon(name)
            .get(&format!("/v1/tenants/{tenant}/allowance"))
            .await
            .ok()?;
        let p = &r.body["policies"][0]["this_region"];
        Some((p["share"].as_f64()?, p["enforced_share"].as_f64()?))
    }

    /// Waits (15 s at most) until region `name` enforces a share of the tenant's policy above
    /// `above`, under a lease (its enforced share is its granted one); that share.
    pub async fn leased_share(&self, name: &str, tenant: &str, above: f64) -> Option<f64> {
        eventually(
            Duration::from_secs(15),
            Duration::from_millis(100),
            || async {
                let (share, enforced) = self.share(name, tenant).await?;
                (share > above && enforced == share).then_some(share)
            },
        )
        .await
    }
}

/// Holds the lock that runs clusters of different test processes one at a time.
pub(crate) async fn serial_lock() -> anyhow::Result<std::fs::File> {
    let lock_path = std::env::temp_dir().join("quotad-system-tests-cluster.lock");
    let serial = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("opening {}", lock_path.display()))?;
    tokio::task::spawn_blocking(move || serial.lock().map(|()| serial))
        .await?
        .context("locking the cluster lock file")
}

/// One `[[regions]]` entry.
pub(crate) fn region_entry(id: &str, node_id: u64, api: &str, peer: &str) -> String {
    format!(
        "[[regions]]\nid = \"{id}\"\nnode_id = {node_id}\napi = \"{api}\"\npeer = \"{peer}\"\n\n"
    )
}

/// The config of region `name`'s daemon: API and peer listeners on loopback `api` and `peer`,
/// its Redis at `redis`, timings `t`, and the `[[regions]]` entries `members`.
pub(crate) fn daemon_config(
    name: &str,
    api: u16,
    peer: u16,
    redis: &str,
    t: &Timings,
    members: &str,
) -> String {
    format!(
        r#"region = "{name}"
[api]
listen = "127.0.0.1:{api}"
forward_timeout_ms = 300
[peer]
listen = "127.0.0.1:{peer}"
[redis]
url = "{redis}"
timeout_ms = 200
denial_cache = {denial_cache}
[breaker]
failure_threshold = 3
slow_call_ms = 200
open_ms = 300
[coordination]
report_interval_ms = {ri}
rebalance_interval_ms = {rb}
lease_ms = {lease}
drift_margin_ms = {margin}
[raft]
heartbeat_interval_ms = {hb}
election_timeout_min_ms = {el_min}
election_timeout_max_ms = {el_max}
write_timeout_ms = 1500
[telemetry]
log_level = "info"

{members}"#,
        ri = t.report_interval_ms,
        rb = t.rebalance_interval_ms,
        lease = t.lease_ms,
        margin = t.drift_margin_ms,
        hb = t.heartbeat_interval_ms,
        el_min = t.election_timeout_min_ms,
        el_max = t.election_timeout_max_ms,
        denial_cache = t.denial_cache,
    )
}
