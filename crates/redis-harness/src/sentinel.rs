//! A Sentinel-managed Redis on loopback: a master, one replica and three sentinels
//! (`redis-server --sentinel`) with quorum 2, for failover tests.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{
    free_port, info_text, io, redis_server_binary, wait_ready, HarnessError, RedisServer, TlsFiles,
    START_TIMEOUT,
};

/// One sentinel process; killed (and waited for) on drop.
#[derive(Debug)]
struct SentinelProcess {
    child: Child,
    port: u16,
    tls_port: Option<u16>,
    _dir: tempfile::TempDir,
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How a [`RedisSentinel`] is built.
#[derive(Debug, Clone, Copy, Default)]
pub struct SentinelOptions<'a> {
    /// `requirepass` on the sentinels, and `sentinel sentinel-pass` among them.
    pub password: Option<&'a str>,
    /// TLS everywhere but the harness's own plain ports: the servers replicate over TLS, the
    /// sentinels watch the servers' TLS ports over TLS and serve clients on
    /// [`tls_urls`](RedisSentinel::tls_urls).
    pub tls: Option<&'a TlsFiles>,
    /// More arguments for the servers and the sentinels (e.g. `--tls-client-cert-file …`).
    pub extra: &'a [&'a str],
}

/// A master, its replica and three sentinels watching them under one service name.
#[derive(Debug)]
pub struct RedisSentinel {
    /// Dropped first: sentinels that outlive their servers would try to fail them over.
    sentinels: Vec<SentinelProcess>,
    master: RedisServer,
    replica: RedisServer,
    name: String,
}

impl RedisSentinel {
    /// Starts the servers and sentinels; returns once every sentinel knows the replica and the
    /// other two sentinels, so a failover can happen. A master unreachable for
    /// `down_after_ms` is failed over to the replica.
    pub fn start(name: &str, down_after_ms: u64) -> Result<Self, HarnessError> {
        Self::start_with_password(name, down_after_ms, None)
    }

    /// Like [`start`](Self::start), the sentinels requiring `password` (`requirepass`, and
    /// `sentinel sentinel-pass` among themselves).
    pub fn start_with_password(
        name: &str,
        down_after_ms: u64,
        password: Option<&str>,
    ) -> Result<Self, HarnessError> {
        Self::start_opts(
            name,
            down_after_ms,
            &SentinelOptions {
                password,
                ..SentinelOptions::default()
            },
        )
    }

    /// Like [`start`](Self::start), built as `opts` says.
    pub fn start_opts(
        name: &str,
        down_after_ms: u64,
        opts: &SentinelOptions<'_>,
    ) -> Result<Self, HarnessError> {
        let password = opts.password;
        const TLS_REPLICATION: [&str; 2] = ["--tls-replication", "yes"];
        let master = match opts.tls {
            Some(files) => {
                let args: Vec<&str> = TLS_REPLICATION.iter().chain(opts.extra).copied().collect();
                RedisServer::start_tls_with(files, &args)?
            }
            None => RedisServer::start_with(opts.extra)?,
        };
        // The port replicas and sentinels reach the master on: its TLS port under TLS.
        let mport = master.tls_port().unwrap_or(master.port()).to_string();
        let replica = match opts.tls {
            Some(files) => {
                let mut args: Vec<&str> = vec![TLS_REPLICATION[0], TLS_REPLICATION[1]];
                args.extend(["--replicaof", "127.0.0.1", &mport]);
                args.extend(opts.extra);
                RedisServer::start_tls_with(files, &args)?
            }
            None => {
                let mut args: Vec<&str> = vec!["--replicaof", "127.0.0.1", &mport];
                args.extend(opts.extra);
                RedisServer::start_with(&args)?
            }
        };
        let bin = redis_server_binary()?;
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            let dir = tempfile::tempdir().map_err(io("create a sentinel dir"))?;
            let conf: PathBuf = dir.path().join("sentinel.conf");
            let mut text = format!(
                "sentinel monitor {name} 127.0.0.1 {mport} 2\n\
                 sentinel down-after-milliseconds {name} {down_after_ms}\n\
                 sentinel failover-timeout {name} {}\n\
                 sentinel parallel-syncs {name} 1\n",
                (down_after_ms * 3).max(3000)
            );
            if let Some(pw) = password {
                text.push_str(&format!(
                    "requirepass \"{pw}\"\nsentinel sentinel-pass \"{pw}\"\n"
                ));
            }
            std::fs::write(&conf, text).map_err(io("write sentinel.conf"))?;
            let port = free_port()?;
            let tls_port = opts.tls.map(|_| free_port()).transpose()?;
            let tls_args: Vec<String> = match (opts.tls, tls_port) {
                (Some(files), Some(tls_port)) => {
                    let mut args = files.server_args(tls_port);
                    args.extend(TLS_REPLICATION.map(String::from));
                    args
                }
                _ => Vec::new(),
            };
            let mut child = Command::new(&bin)
                .arg(&conf)
                .arg("--sentinel")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(&tls_args)
                .args(opts.extra)
                .args(["--protected-mode", "no", "--daemonize", "no"])
                .args(["--loglevel", "warning"])
                .arg("--dir")
                .arg(dir.path())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(io("spawn redis-server --sentinel"))?;
            if let Err(e) = wait_ready(port, &mut child) {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
            sentinels.push(SentinelProcess {
                child,
                port,
                tls_port,
                _dir: dir,
            });
        }
        let started = Instant::now();
        loop {
            let ready = sentinels.iter().all(|s| {
                info_text(s.port, password, "INFO sentinel")
                    .is_ok_and(|i| i.contains("status=ok") && i.contains("slaves=1,sentinels=3"))
            }) && info_text(replica.port(), None, "INFO replication")
                .is_ok_and(|i| i.contains("master_link_status:up"));
            if ready {
                return Ok(Self {
                    sentinels,
                    master,
                    replica,
                    name: name.to_string(),
                });
            }
            if started.elapsed() > START_TIMEOUT {
                return Err(HarnessError::NotReady {
                    port: sentinels[0].port,
                    waited_ms: started.elapsed().as_millis() as u64,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The sentinels' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("redis://127.0.0.1:{}", s.port))
            .collect()
    }

    /// The sentinels' TLS URLs (`rediss://127.0.0.1:<tls port>`), for a set started with TLS.
    pub fn tls_urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .filter_map(|s| s.tls_port)
            .map(|p| format!("rediss://127.0.0.1:{p}"))
            .collect()
    }

    /// The service (master) name the sentinels watch.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server that was master at start.
    pub fn master(&self) -> &RedisServer {
        &self.master
    }

    /// The master at start, to stop it.
    pub fn master_mut(&mut self) -> &mut RedisServer {
        &mut self.master
    }

    /// The server that was the replica at start.
    pub fn replica(&self) -> &RedisServer {
        &self.replica
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sentinels_fail_the_master_over_to_the_replica() {
        let mut s = RedisSentinel::start("harness", 1000).unwrap();
        assert_eq!(s.urls().len(), 3);
        let replica = s.replica().port();
        assert!(info_text(replica, None, "INFO replication")
            .unwrap()
            .contains("role:slave"));
        s.master_mut().stop();
        let started = Instant::now();
        while !info_text(replica, None, "INFO replication").is_ok_and(|i| i.contains("role:master"))
        {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "no failover within 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
