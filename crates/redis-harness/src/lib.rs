//! redis-harness: real `redis-server` processes for tests and benchmarks.
//!
//! Tests that claim Redis behaviour run against a real server, never a mock and never the
//! shared Redis on port 6379. [`RedisServer::start`] picks a free loopback port, starts
//! `redis-server` with persistence off in its own temporary directory, waits until it answers
//! `PING`, and kills it when dropped. [`RedisServer::restart`] brings it back on the same port
//! (empty: nothing is persisted), which is how the NOSCRIPT-after-restart tests work.
//!
//! The binary is `$QUOTAD_REDIS_SERVER` or `redis-server` on `PATH`; when neither exists the
//! error names the Debian package to install.
//!
//! # Layout
//! - [`RedisServer`]: one standalone server.
//! - [`RedisCluster`]: three masters with `--cluster-enabled yes`, joined by `redis-cli`.

pub mod pki;
pub mod sentinel;

pub use sentinel::{RedisSentinel, SentinelOptions};

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to answer its first PING.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a server could not be started.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error(
        "redis-server not found (looked for {looked_for}); install the Debian package \
         `redis-server` (apt-get install redis-server) or set QUOTAD_REDIS_SERVER"
    )]
    NotInstalled { looked_for: String },
    #[error("could not {action}: {source}")]
    Io {
        action: &'static str,
        source: std::io::Error,
    },
    #[error("redis-server on port {port} did not answer PING within {waited_ms} ms")]
    NotReady { port: u16, waited_ms: u64 },
    #[error("`{command}` failed: {output}")]
    Command { command: String, output: String },
    #[error("could not generate test certificates: {0}")]
    Pki(#[from] rcgen::Error),
}

fn io(action: &'static str) -> impl FnOnce(std::io::Error) -> HarnessError {
    move |source| HarnessError::Io { action, source }
}

/// The `redis-server` binary to run: `$QUOTAD_REDIS_SERVER`, else `redis-server` on `PATH`.
pub fn redis_server_binary() -> Result<PathBuf, HarnessError> {
    if let Some(p) = std::env::var_os("QUOTAD_REDIS_SERVER") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(HarnessError::NotInstalled {
                looked_for: format!("{}", p.display()),
            })
        };
    }
    find_on_path("redis-server").ok_or_else(|| HarnessError::NotInstalled {
        looked_for: "redis-server on PATH".into(),
    })
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// A port nobody listens on right now (the OS picks it; a race with another process is
/// possible, and `start` retries on a different port when the server fails to bind).
fn free_port() -> Result<u16, HarnessError> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io("bind a free port"))?;
    Ok(l.local_addr().map_err(io("read the bound port"))?.port())
}

/// Sends one inline command and returns the first reply line, e.g. `+PONG`.
pub fn inline_command(port: u16, command: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect((Ipv4Addr::LOCALHOST, port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(format!("{command}\r\n").as_bytes())?;
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n") {
        if s.read(&mut byte)? == 0 {
            break;
        }
        buf.push(byte[0]);
    }
    Ok(String::from_utf8_lossy(&buf).trim_end().to_string())
}

fn wait_ready(port: u16, child: &mut Child) -> Result<(), HarnessError> {
    let started = Instant::now();
    while started.elapsed() < START_TIMEOUT {
        if let Ok(reply) = inline_command(port, "PING") {
            // A server started with a password answers, but refuses an unauthenticated PING.
            if reply == "+PONG" || reply.starts_with("-NOAUTH") {
                return Ok(());
            }
        }
        if let Ok(Some(_)) = child.try_wait() {
            break; // exited: most likely the port was taken
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Err(HarnessError::NotReady {
        port,
        waited_ms: started.elapsed().as_millis() as u64,
    })
}

fn spawn(bin: &Path, dir: &Path, port: u16, extra: &[&str]) -> Result<Child, HarnessError> {
    let mut cmd = Command::new(bin);
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .args([
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--protected-mode",
            "no",
        ])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    cmd.spawn().map_err(io("spawn redis-server"))
}

/// A `redis-server` process owned by the test; killed (and waited for) on drop.
#[derive(Debug)]
pub struct RedisServer {
    child: Child,
    port: u16,
    /// The TLS port, when started with [`RedisServer::start_tls`].
    tls_port: Option<u16>,
    bin: PathBuf,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

/// PEM files for a TLS-enabled server ([`RedisServer::start_tls`]).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA that client certificates must chain to.
    pub ca: PathBuf,
    /// Whether clients must present a certificate (`tls-auth-clients`).
    pub require_client_cert: bool,
}

/// Calls of `command` (lower case, e.g. `evalsha`, or `hset`, which scripts' calls count in
/// too) Redis counted since its start or the last `CONFIG RESETSTAT`, from `INFO commandstats`.
pub async fn command_calls(
    conn: &mut redis::aio::MultiplexedConnection,
    command: &str,
) -> redis::RedisResult<u64> {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let prefix = format!("cmdstat_{command}:calls=");
    Ok(stats
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0))
}

/// EVALSHA calls (every quotad decision, parameter write, usage collection, reservation and
/// refund is one), as [`command_calls`] counts them.
pub async fn evalsha_calls(
    conn: &mut redis::aio::MultiplexedConnection,
) -> redis::RedisResult<u64> {
    command_calls(conn, "evalsha").await
}

impl TlsFiles {
    /// `redis-server` arguments serving TLS on `tls_port` with these files.
    pub fn server_args(&self, tls_port: u16) -> Vec<String> {
        let path = |p: &Path| p.display().to_string();
        let auth = if self.require_client_cert {
            "yes"
        } else {
            "no"
        };
        [
            "--tls-port",
            &tls_port.to_string(),
            "--tls-cert-file",
            &path(&self.cert),
            "--tls-key-file",
            &path(&self.key),
            "--tls-ca-cert-file",
            &path(&self.ca),
            "--tls-auth-clients",
            auth,
        ]
        .map(String::from)
        .to_vec()
    }
}

impl RedisServer {
    /// Starts a standalone server on a free loopback port and waits until it answers PING.
    pub fn start() -> Result<Self, HarnessError> {
        Self::start_with(&[])
    }

    /// Like [`start`](Self::start), with extra `redis-server` arguments.
    pub fn start_with(extra: &[&str]) -> Result<Self, HarnessError> {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        Self::start_on_free_ports(|_| extra.clone(), false)
    }

    /// A server that also takes TLS connections, on [`tls_port`](Self::tls_port) (the plain
    /// port stays open for the harness and for direct inspection).
    pub fn start_tls(files: &TlsFiles) -> Result<Self, HarnessError> {
        Self::start_tls_with(files, &[])
    }

    /// Like [`start_tls`](Self::start_tls), with extra `redis-server` arguments.
    pub fn start_tls_with(files: &TlsFiles, extra: &[&str]) -> Result<Self, HarnessError> {
        let args = |tls_port: Option<u16>| -> Vec<String> {
            let mut args = files.server_args(tls_port.unwrap_or_default());
            args.extend(extra.iter().map(|s| s.to_string()));
            args
        };
        Self::start_on_free_ports(args, true)
    }

    /// Starts on a free port (and a free TLS port when `tls`), retrying on others when the
    /// server fails to bind; `extra` gives the extra arguments for the TLS port chosen.
    fn start_on_free_ports(
        extra: impl Fn(Option<u16>) -> Vec<String>,
        tls: bool,
    ) -> Result<Self, HarnessError> {
        let bin = redis_server_binary()?;
        let dir = tempfile::tempdir().map_err(io("create a temp dir"))?;
        let mut last = None;
        for _ in 0..5 {
            let port = free_port()?;
            let tls_port = if tls { Some(free_port()?) } else { None };
            let extra = extra(tls_port);
            let mut child = spawn(&bin, dir.path(), port, &as_strs(&extra))?;
            match wait_ready(port, &mut child) {
                Ok(()) => {
                    return Ok(Self {
                        child,
                        port,
                        tls_port,
                        bin,
                        dir,
                        extra,
                    })
                }
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or(HarnessError::NotReady {
            port: 0,
            waited_ms: 0,
        }))
    }

    /// The TLS port, for a server started with [`start_tls`](Self::start_tls).
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// A client for this server.
    pub fn client(&self) -> redis::Client {
        // The URL is well-formed by construction.
        redis::Client::open(self.url()).expect("a loopback redis URL parses")
    }

    /// The OS process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the server and starts a new, empty one on the same port.
    pub fn restart(&mut self) -> Result<(), HarnessError> {
        self.stop();
        let started = Instant::now();
        // The old socket may linger for a moment; retry until the port is free again.
        loop {
            let mut child = spawn(&self.bin, self.dir.path(), self.port, &as_strs(&self.extra))?;
            match wait_ready(self.port, &mut child) {
                Ok(()) => {
                    self.child = child;
                    return Ok(());
                }
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    if started.elapsed() > START_TIMEOUT {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Kills the server now (it stays down until `restart`).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn as_strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// A three-master Redis Cluster on loopback (optionally with replicas), each node a
/// [`RedisServer`].
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

/// How a [`RedisCluster`] is built.
#[derive(Debug, Clone, Default)]
pub struct ClusterOptions<'a> {
    /// `requirepass` on every node, and `masterauth` among them.
    pub password: Option<&'a str>,
    /// More arguments for every node (e.g. `--user …`), kept across restarts.
    pub extra: &'a [&'a str],
    /// Replicas per master (nodes 3.. are the replicas).
    pub replicas: usize,
    /// `cluster-node-timeout`: how long a master may be unreachable before a replica takes
    /// over (5000 ms when 0).
    pub node_timeout_ms: u64,
    /// TLS for clients and for the cluster bus (`tls-cluster yes`); the plain ports stay open
    /// for the harness. The server certificate must also serve as the bus's client one.
    pub tls: Option<&'a TlsFiles>,
}

impl RedisCluster {
    /// Starts three masters with `--cluster-enabled yes` and joins them with
    /// `redis-cli --cluster create … --cluster-yes`, waiting until the cluster state is ok.
    pub fn start() -> Result<Self, HarnessError> {
        Self::start_with_password(None)
    }

    /// Like [`start`](Self::start), every node requiring `password` (`requirepass`, and
    /// `masterauth` for the nodes among themselves).
    pub fn start_with_password(password: Option<&str>) -> Result<Self, HarnessError> {
        Self::start_with(password, &[])
    }

    /// Like [`start_with_password`](Self::start_with_password), every node also taking
    /// `extra` arguments (e.g. `--user …` for an ACL user), kept across restarts.
    pub fn start_with(password: Option<&str>, extra: &[&str]) -> Result<Self, HarnessError> {
        Self::start_opts(&ClusterOptions {
            password,
            extra,
            ..ClusterOptions::default()
        })
    }

    /// Starts three masters and `opts.replicas` replicas of each, as `opts` says.
    pub fn start_opts(opts: &ClusterOptions<'_>) -> Result<Self, HarnessError> {
        let (password, extra) = (opts.password, opts.extra);
        let timeout = match opts.node_timeout_ms {
            0 => 5000,
            ms => ms,
        }
        .to_string();
        let mut args = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            &timeout,
        ];
        if let Some(pw) = password {
            args.extend(["--requirepass", pw, "--masterauth", pw]);
        }
        args.extend_from_slice(extra);
        let mut nodes = Vec::new();
        for _ in 0..3 * (1 + opts.replicas) {
            nodes.push(match opts.tls {
                None => RedisServer::start_with(&args)?,
                Some(files) => {
                    let mut tls_args = args.clone();
                    tls_args.extend(["--tls-cluster", "yes", "--tls-replication", "yes"]);
                    RedisServer::start_tls_with(files, &tls_args)?
                }
            });
        }
        let cli = find_on_path("redis-cli").ok_or_else(|| HarnessError::NotInstalled {
            looked_for: "redis-cli on PATH (Debian package `redis-tools`)".into(),
        })?;
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let mut create = Command::new(&cli);
        if let Some(pw) = password {
            create.args(["--no-auth-warning", "-a", pw]);
        }
        let out = create
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args([
                "--cluster-replicas",
                &opts.replicas.to_string(),
                "--cluster-yes",
            ])
            .output()
            .map_err(io("run redis-cli --cluster create"))?;
        if !out.status.success() {
            return Err(HarnessError::Command {
                command: "redis-cli --cluster create".into(),
                output: String::from_utf8_lossy(&out.stdout).into_owned(),
            });
        }
        let started = Instant::now();
        loop {
            // Replicas count once they have synchronised with their master.
            let ok = nodes.iter().enumerate().all(|(i, n)| {
                cluster_info(n.port(), password).is_ok_and(|info| info.contains("cluster_state:ok"))
                    && (i < 3
                        || info_text(n.port(), password, "INFO replication")
                            .is_ok_and(|info| info.contains("master_link_status:up")))
            });
            if ok {
                return Ok(Self { nodes });
            }
            if started.elapsed() > START_TIMEOUT {
                return Err(HarnessError::NotReady {
                    port: nodes[0].port(),
                    waited_ms: started.elapsed().as_millis() as u64,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The nodes' URLs, for `redis::cluster::ClusterClient`.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The nodes' TLS URLs (`rediss://host:tls-port`), for a cluster started with TLS.
    pub fn tls_urls(&self, host: &str) -> Vec<String> {
        self.nodes
            .iter()
            .filter_map(|n| Some(format!("rediss://{host}:{}", n.tls_port()?)))
            .collect()
    }

    /// The nodes.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The nodes, to stop or restart one. A restarted node keeps its cluster identity and slots
    /// (its `nodes.conf` stays in its directory) and rejoins.
    pub fn nodes_mut(&mut self) -> &mut [RedisServer] {
        &mut self.nodes
    }
}

/// The text of `CLUSTER INFO` (a bulk reply), read raw, after `AUTH` when a password is set.
fn cluster_info(port: u16, password: Option<&str>) -> std::io::Result<String> {
    info_text(port, password, "CLUSTER INFO")
}

/// The text of an inline command's bulk reply (`CLUSTER INFO`, `INFO replication`), read raw,
/// after `AUTH` when a password is set.
fn info_text(port: u16, password: Option<&str>, command: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect((Ipv4Addr::LOCALHOST, port))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    if let Some(pw) = password {
        // A RESP array, so the password may hold spaces.
        s.write_all(format!("*2\r\n$4\r\nAUTH\r\n${}\r\n{pw}\r\n", pw.len()).as_bytes())?;
        let mut reply = [0u8; 5];
        s.read_exact(&mut reply)?;
        if &reply != b"+OK\r\n" {
            return Err(std::io::Error::other("AUTH refused"));
        }
    }
    s.write_all(format!("{command}\r\n").as_bytes())?;
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_answers_restarts_and_stops() {
        let mut s = RedisServer::start().unwrap();
        let port = s.port();
        assert_ne!(port, 6379);
        assert_eq!(inline_command(port, "PING").unwrap(), "+PONG");
        assert_eq!(inline_command(port, "SET k v").unwrap(), "+OK");
        s.restart().unwrap();
        assert_eq!(s.port(), port);
        // Nothing persists across a restart.
        assert_eq!(inline_command(port, "GET k").unwrap(), "$-1");
        drop(s);
        assert!(inline_command(port, "PING").is_err());
    }

    #[test]
    fn missing_binary_names_the_package() {
        let e = HarnessError::NotInstalled {
            looked_for: "x".into(),
        };
        assert!(e.to_string().contains("redis-server"));
        assert!(e.to_string().contains("apt-get install redis-server"));
    }
}
