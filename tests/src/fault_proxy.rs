//! A fault-injecting TCP proxy in front of one daemon's peer (Raft) listener.
//!
//! Membership addresses are shared by every node, so a proxy cannot be told apart by the
//! address a peer dials. Instead it identifies the *sending process* of each connection: on
//! Linux, `/proc/net/tcp` maps the connection's source port to a socket inode, and
//! `/proc/<pid>/fd` maps the inode to a process. Blocking a set of pids then cuts exactly the
//! links from those processes, and already open connections from them are aborted.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

#[derive(Debug, Default)]
struct Shared {
    blocked: HashSet<u32>,
    /// Open connections: (source port, relay task). The source process is looked up when a
    /// block needs it, so connections opened before the pids were known are cut too.
    conns: Vec<(u16, AbortHandle)>,
    /// Connections from blocked processes, held open and silent (like a dropped link, so
    /// clients wait for their timeouts instead of reconnecting in a tight loop).
    holes: Vec<AbortHandle>,
    candidates: Vec<u32>,
}

/// The proxy; stops when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    pub addr: SocketAddr,
    shared: Arc<Mutex<Shared>>,
    task: AbortHandle,
}

impl FaultProxy {
    /// Listens on a free loopback port and relays to `target`.
    pub async fn start(target: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the proxy")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Mutex::new(Shared::default()));
        let s = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((inbound, peer)) = listener.accept().await else {
                    continue;
                };
                let pid = {
                    let candidates = s.lock().unwrap().candidates.clone();
                    source_pid(peer.port(), addr.port(), &candidates)
                };
                let mut g = s.lock().unwrap();
                // While a cut is in force, a connection whose sender could not be told (the
                // read of /proc/net/tcp can miss a socket while others open and close) is
                // refused too: let through, it would slip past the cut for its lifetime. Its
                // sender reconnects and is identified then.
                let refused = match pid {
                    Some(p) => g.blocked.contains(&p),
                    None => !g.blocked.is_empty(),
                };
                if refused {
                    drop(inbound);
                    continue;
                }
                let relay = tokio::spawn(relay(inbound, target));
                g.conns.retain(|(_, h)| !h.is_finished());
                g.conns.push((peer.port(), relay.abort_handle()));
            }
        })
        .abort_handle();
        Ok(Self { addr, shared, task })
    }

    /// The processes whose connections may be told apart (the daemons' pids).
    pub fn set_candidates(&self, pids: &[u32]) {
        self.shared.lock().unwrap().candidates = pids.to_vec();
    }

    /// Cuts every link from `pids` (new and open ones).
    pub fn block(&self, pids: &[u32]) {
        let mut g = self.shared.lock().unwrap();
        g.blocked.extend(pids.iter().copied());
        let port = self.addr.port();
        g.conns.retain(|(_, h)| !h.is_finished());
        for (src, h) in &g.conns {
            // An open connection from a sender that cannot be told goes too (see `start`).
            let from = source_pid(*src, port, &g.candidates);
            if from.is_none_or(|p| pids.contains(&p)) {
                h.abort();
            }
        }
    }

    /// Lets everything through again; held connections are closed so clients reconnect.
    pub fn heal(&self) {
        let mut g = self.shared.lock().unwrap();
        g.blocked.clear();
        for h in g.holes.drain(..) {
            h.abort();
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        let g = self.shared.lock().unwrap();
        for (_, h) in &g.conns {
            h.abort();
        }
        for h in &g.holes {
            h.abort();
        }
    }
}

async fn relay(mut inbound: TcpStream, target: SocketAddr) {
    if let Ok(mut outbound) = TcpStream::connect(target).await {
        let _ = outbound.set_nodelay(true);
        let _ = inbound.set_nodelay(true);
        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
    }
}

/// The pid among `candidates` owning the loopback socket `src_port → dst_port`, looked up three
/// times: a read of `/proc/net/tcp` can miss a socket while others open and close.
fn source_pid(src_port: u16, dst_port: u16, candidates: &[u32]) -> Option<u32> {
    for attempt in 0..3 {
        if attempt > 0 {
            std::thread::sleep(std::time::Duration::from_millis(attempt));
        }
        if let Some(pid) = source_pid_once(src_port, dst_port, candidates) {
            return Some(pid);
        }
    }
    None
}

fn source_pid_once(src_port: u16, dst_port: u16, candidates: &[u32]) -> Option<u32> {
    let inode = socket_inode(src_port, dst_port)?;
    let needle = format!("socket:[{inode}]");
    candidates.iter().copied().find(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|dir| {
            dir.flatten()
                .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy() == needle))
        })
    })
}

fn socket_inode(src_port: u16, dst_port: u16) -> Option<String> {
    let text = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let local = format!(":{src_port:04X}");
    let remote = format!(":{dst_port:04X}");
    text.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        (f.len() > 9 && f[1].ends_with(&local) && f[2].ends_with(&remote)).then(|| f[9].to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    #[tokio::test]
    async fn blocks_connections_from_a_process_and_heals() {
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = echo.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = echo.accept().await else {
                    continue;
                };
                tokio::spawn(async move {
                    let mut buf = [0u8; 4];
                    if s.read_exact(&mut buf).await.is_ok() {
                        let _ = s.write_all(&buf).await;
                    }
                });
            }
        });
        let proxy = FaultProxy::start(target).await.unwrap();
        let me = std::process::id();
        proxy.set_candidates(&[me]);
        let roundtrip = || async {
            let mut s = TcpStream::connect(proxy.addr).await.ok()?;
            s.write_all(b"ping").await.ok()?;
            let mut buf = [0u8; 4];
            tokio::time::timeout(std::time::Duration::from_secs(2), s.read_exact(&mut buf))
                .await
                .ok()?
                .ok()?;
            Some(buf)
        };
        assert_eq!(roundtrip().await, Some(*b"ping"));
        proxy.block(&[me]);
        assert_eq!(roundtrip().await, None, "this process is cut off");
        proxy.heal();
        assert_eq!(roundtrip().await, Some(*b"ping"));
    }
}
