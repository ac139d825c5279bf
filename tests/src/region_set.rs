//! Regions of several daemons each on loopback: one redis-server per region shared by its
//! daemons, every daemon a Raft voter.

use std::time::Duration;

use crate::cluster::{daemon_config, region_entry, serial_lock};
use crate::{eventually, free_port, Daemon, Timings, PEER_TOKEN};

/// `names.len()` regions × `per_region` daemons. Daemon `i` serves region `i / per_region`
/// and is Raft node `i + 1`.
#[derive(Debug)]
pub struct RegionSet {
    _serial: std::fs::File,
    pub names: Vec<String>,
    pub per_region: usize,
    pub daemons: Vec<Daemon>,
    pub redis: Vec<redis_harness::RedisServer>,
}

impl RegionSet {
    /// Starts every daemon and returns once all are ready.
    pub async fn start(names: &[&str], per_region: usize, t: &Timings) -> anyhow::Result<Self> {
        let serial = serial_lock().await?;
        let mut redis = Vec::new();
        for _ in names {
            redis.push(redis_harness::RedisServer::start()?);
        }
        let mut attempt = 0;
        let daemons = loop {
            attempt += 1;
            match Self::spawn(names, per_region, t, &redis).await {
                Ok(d) => break d,
                Err(e) if attempt < 3 && format!("{e:#}").contains("exited during start-up") => {
                    eprintln!("region set start attempt {attempt} failed, retrying: {e:#}");
                }
                Err(e) => return Err(e),
            }
        };
        Ok(Self {
            _serial: serial,
            names: names.iter().map(|s| s.to_string()).collect(),
            per_region,
            daemons,
            redis,
        })
    }

    async fn spawn(
        names: &[&str],
        per_region: usize,
        t: &Timings,
        redis: &[redis_harness::RedisServer],
    ) -> anyhow::Result<Vec<Daemon>> {
        let n = names.len() * per_region;
        let api: Vec<u16> = (0..n).map(|_| free_port()).collect::<anyhow::Result<_>>()?;
        let peer: Vec<u16> = (0..n).map(|_| free_port()).collect::<anyhow::Result<_>>()?;
        let mut members = String::new();
        for i in 0..n {
            members.push_str(&region_entry(
                names[i / per_region],
                i as u64 + 1,
                &format!("127.0.0.1:{}", api[i]),
                &format!("127.0.0.1:{}", peer[i]),
            ));
        }
        let mut daemons = Vec::new();
        for i in 0..n {
            let r = i / per_region;
            let config = format!(
                "node_id = {}\n{}",
                i + 1,
                daemon_config(names[r], api[i], peer[i], &redis[r].url(), t, &members)
            );
            daemons.push(Daemon::spawn(
                &config,
                api[i],
                &[("QUOTAD_PEER_TOKEN", PEER_TOKEN)],
            )?);
        }
        for d in &mut daemons {
            if let Err(e) = d.wait_ready(Duration::from_secs(40)).await {
                return Err(e.context(d.log_text()));
            }
        }
        Ok(daemons)
    }

    /// The daemons of region `name`, by index.
    pub fn of(&self, name: &str) -> std::ops::Range<usize> {
        let r = self
            .names
            .iter()
            .position(|n| n == name)
            .unwrap_or_else(|| panic!("no region {name}"));
        r * self.per_region..(r + 1) * self.per_region
    }

    /// The region of daemon `i`.
    pub fn region_of(&self, i: usize) -> &str {
        &self.names[i / self.per_region]
    }

    /// `/v1/status` of daemon `i`, if it answers.
    pub async fn status(&self, i: usize) -> Option<serde_json::Value> {
        let r = self.daemons[i].get("/v1/status").await.ok()?;
        (r.status == 200).then_some(r.body)
    }

    /// Which daemon holds region `name`'s agent role, as daemon `asked` sees it.
    pub async fn agent_seen_by(&self, asked: usize, name: &str) -> Option<usize> {
        let s = self.status(asked).await?;
        let peers = s["raft"]["peers"].as_array()?;
        peers
            .iter()
            .find(|p| p["region"] == name && p["agent"] == true)
            .and_then(|p| p["node_id"].as_u64())
            .map(|n| n as usize - 1)
    }

    /// The Raft leader's daemon, as daemon `asked` sees it.
    pub async fn leader_seen_by(&self, asked: usize) -> Option<usize> {
        let s = self.status(asked).await?;
        s["raft"]["leader_node"].as_u64().map(|n| n as usize - 1)
    }

    /// Waits (`within`) until daemon `asked` sees region `name`'s role held by a daemon other
    /// than `not`; that daemon.
    pub async fn agent_moved(
        &self,
        asked: usize,
        name: &str,
        not: usize,
        within: Duration,
    ) -> Option<usize> {
        eventually(within, Duration::from_millis(20), || async {
            self.agent_seen_by(asked, name).await.filter(|&a| a != not)
        })
        .await
    }
}
