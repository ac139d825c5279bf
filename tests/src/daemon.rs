//! A `quotad` process on loopback ports: started from a config, waited on until ready,
//! stopped with SIGTERM or SIGKILL; its log and data directory kept in a temp dir.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

/// The admin token every test daemon runs with.
pub const TOKEN: &str = "system-test-token";

/// The `quotad` binary built beside this test executable.
pub fn quotad_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the test executable")?;
    // target/<profile>/deps/<test> → target/<profile>/quotad
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("the test executable has no target/<profile> directory")?;
    let bin = profile_dir.join(format!("quotad{}", std::env::consts::EXE_SUFFIX));
    if !bin.exists() {
        bail!(
            "{} is missing: build it first with `cargo build -p quotad` (cargo nextest run --workspace builds it)",
            bin.display()
        );
    }
    Ok(bin)
}

/// A free loopback port (bound, read, released).
pub fn free_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding an ephemeral port")?;
    Ok(l.local_addr()?.port())
}

/// A running `quotad` process; killed on drop.
#[derive(Debug)]
pub struct Daemon {
    child: Option<Child>,
    pub api_port: u16,
    pub dir: tempfile::TempDir,
    log: PathBuf,
    pub(crate) http: reqwest::Client,
}

impl Daemon {
    /// Starts quotad with `config` as is (ports fixed by the caller) and extra environment,
    /// without waiting for readiness.
    pub fn spawn(config: &str, api_port: u16, env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir().context("creating a temp dir")?;
        let path = dir.path().join("quotad.toml");
        std::fs::write(&path, config).context("writing the config")?;
        let log = dir.path().join("quotad.log");
        let logfile = std::fs::File::create(&log).context("creating the log file")?;
        let child = Command::new(quotad_binary()?)
            .arg("run")
            .arg("--config")
            .arg(&path)
            .env("QUOTAD_ADMIN_TOKEN", TOKEN)
            .env("QUOTAD_DATA_DIR", dir.path().join("data"))
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(logfile)
            .spawn()
            .context("spawning quotad")?;
        Ok(Daemon {
            child: Some(child),
            api_port,
            dir,
            log,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
        })
    }

    /// Starts the process again on the same config, data directory, port and log (after a
    /// SIGTERM or a kill), with extra environment; does not wait for readiness.
    pub fn respawn(&mut self, env: &[(&str, &str)]) -> anyhow::Result<()> {
        self.kill();
        let logfile = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.log)
            .context("opening the log file")?;
        let child = Command::new(quotad_binary()?)
            .arg("run")
            .arg("--config")
            .arg(self.dir.path().join("quotad.toml"))
            .env("QUOTAD_ADMIN_TOKEN", TOKEN)
            .env("QUOTAD_DATA_DIR", self.data_dir())
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(logfile)
            .spawn()
            .context("spawning quotad")?;
        self.child = Some(child);
        Ok(())
    }

    /// Sends `signal` (e.g. `STOP`, `CONT`) to the process.
    pub fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let pid = self.pid().context("not running")?.to_string();
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .context("running kill")?;
        if !status.success() {
            bail!("kill -{signal} {pid} failed");
        }
        Ok(())
    }

    /// The process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts quotad with `config` (TOML; `{api}` is replaced by a free API port) and waits
    /// until /readyz answers 200.
    pub async fn start(config: &str) -> anyhow::Result<Self> {
        Self::start_with_env(config, &[]).await
    }

    /// Like [`Daemon::start`], with extra environment (e.g. `QUOTAD_DATA_DIR` of an earlier
    /// daemon, to restart on its state).
    pub async fn start_with_env(config: &str, env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let mut last = None;
        for _ in 0..3 {
            let api_port = free_port()?;
            let text = config.replace("{api}", &format!("127.0.0.1:{api_port}"));
            let mut d = Daemon::spawn(&text, api_port, env)?;
            match d.wait_ready(Duration::from_secs(20)).await {
                Ok(()) => return Ok(d),
                Err(e) => {
                    last = Some(e.context(d.log_text()));
                    d.kill();
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("quotad did not start")))
    }

    /// The data directory the daemon was started with by default (`<dir>/data`).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Polls /readyz until 200 or the deadline; fails early if the process exits.
    pub async fn wait_ready(&mut self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    bail!("quotad exited during start-up with {status}");
                }
            }
            if let Ok(r) = self.get("/readyz").await {
                if r.status == 200 {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!("quotad not ready within {within:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The daemon's stderr so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Sends SIGTERM and waits for the exit status.
    pub async fn terminate(&mut self, within: Duration) -> anyhow::Result<ExitStatus> {
        let Some(child) = self.child.as_mut() else {
            bail!("not running")
        };
        let pid = child.id().to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .context("running kill")?;
        if !status.success() {
            bail!("kill -TERM {pid} failed");
        }
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = child.try_wait()? {
                self.child = None;
                return Ok(s);
            }
            if Instant::now() > deadline {
                bail!("quotad did not exit within {within:?} of SIGTERM");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the process at once (SIGKILL).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}
