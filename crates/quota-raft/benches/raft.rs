//! Raft benchmarks, printed as plain numbers (release build):
//! `cargo bench -p quota-raft --bench raft`
//!
//! 1. Commit latency: three coordinators in this process, talking real HTTP on loopback,
//!    each with its own redb file (fsync per commit); sequential writes on the leader, then on a
//!    follower (forwarded).
//! 2. Snapshots of 100 000 and 1 000 000 tenants × 5 regions, built through quota-core commands:
//!    size, build time (encode + durable write), install time in a state machine (decode +
//!    durable write), and the leader's path: one POST to a fresh follower's peer API, installed
//!    there.
//!
//! `QUOTA_RAFT_BENCH_TENANTS=100000` limits the snapshot sizes (comma-separated list).

#[path = "../tests/common/commands.rs"]
mod commands;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use commands::{put_policy, put_region, set_shares};
use hdrhistogram::Histogram;
use openraft::error::ReplicationClosed;
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::storage::RaftStateMachine;
use openraft::{
    CommittedLeaderId, Entry, EntryPayload, LogId, RaftSnapshotBuilder, Snapshot, Vote,
};
use quota_core::coordinator::{Command, Operation, RequestId, Response};
use quota_core::RegionId;
use quota_raft::network::HttpNetwork;
use quota_raft::storage;
use quota_raft::{Coordinator, Member, RaftConfig, TypeConfig};
use tempfile::TempDir;
use tokio::net::TcpListener;

const REGIONS: [&str; 5] = ["eu", "us", "ap", "sa", "af"];

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(commit_latency());
    let sizes: Vec<u64> = std::env::var("QUOTA_RAFT_BENCH_TENANTS")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![100_000, 1_000_000]);
    for tenants in sizes {
        rt.block_on(snapshot(tenants));
    }
}

async fn commit_latency() {
    let dir = TempDir::new().unwrap();
    let mut listeners = Vec::new();
    for _ in 0..3 {
        listeners.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let members: BTreeMap<u64, Member> = listeners
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let addr = l.local_addr().unwrap().to_string();
            (
                i as u64 + 1,
                Member {
                    region: REGIONS[i].into(),
                    peer_addr: addr.clone(),
                    admin_addr: addr,
                },
            )
        })
        .collect();
    let mut nodes = Vec::new();
    for (i, l) in listeners.into_iter().enumerate() {
        let id = i as u64 + 1;
        let cfg = RaftConfig::new(
            id,
            members.clone(),
            dir.path().join(format!("n{id}")),
            "bench-secret-0123456789",
        )
        .with_loopback_timeouts();
        let c = Coordinator::start(cfg).await.unwrap();
        let router = c.peer_router();
        tokio::spawn(async move { axum::serve(l, router).await.unwrap() });
        nodes.push(c);
    }
    let leader = loop {
        if let Some(c) = nodes.iter().find(|c| c.is_leader()) {
            break c.clone();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let follower = nodes.iter().find(|c| !c.is_leader()).unwrap().clone();
    let mut request = 1u128;
    for (label, node, writes) in [
        ("leader", &leader, 2_000u64),
        ("follower (forwarded)", &follower, 1_000),
    ] {
        let mut h = Histogram::<u64>::new(3).unwrap();
        let start = Instant::now();
        for n in 0..writes {
            let cmd = put_policy(request, n, n + 1);
            request += 1;
            let t = Instant::now();
            node.write(cmd).await.unwrap();
            h.record(t.elapsed().as_micros() as u64).unwrap();
        }
        let secs = start.elapsed().as_secs_f64();
        println!(
            "commit latency via {label}, 3 nodes over loopback HTTP, fsync per commit: n={writes} p50={:.2} ms p99={:.2} ms max={:.2} ms ({:.0} writes/s sequential)",
            h.value_at_quantile(0.5) as f64 / 1000.0,
            h.value_at_quantile(0.99) as f64 / 1000.0,
            h.max() as f64 / 1000.0,
            writes as f64 / secs,
        );
    }
    for c in &nodes {
        c.shutdown().await.unwrap();
    }
}

fn entry(index: u64, cmd: Command) -> Entry<TypeConfig> {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(cmd),
    }
}

async fn snapshot(tenants: u64) {
    let dir = TempDir::new().unwrap();
    let (_log, mut sm) = storage::open(&dir.path().join("source")).unwrap();
    let mut index = 0u64;
    let mut request = 1u128;
    let mut next = |cmd: Command| {
        index += 1;
        entry(index, cmd)
    };
    let t = Instant::now();
    let regions: Vec<_> = REGIONS
        .iter()
        .map(|r| {
            let e = next(put_region(request, r));
            request += 1;
            e
        })
        .collect();
    sm.apply(regions).await.unwrap();
    for chunk in (0..tenants).collect::<Vec<_>>().chunks(10_000) {
        let batch: Vec<_> = chunk
            .iter()
            .map(|&n| {
                let e = next(put_policy(request, n, 1_000 + n % 50_000));
                request += 1;
                e
            })
            .collect();
        sm.apply(batch).await.unwrap();
    }
    // Move share toward the first region the way the coordinator must: decrease, wait for every
    // region to acknowledge, then increase.
    let membership = sm.handle().read(|s| s.membership);
    let mut shares_accepted = 0u64;
    let mut epoch = 0;
    for (round, shares) in [
        [200_000, 150_000, 150_000, 150_000, 150_000],
        [400_000, 150_000, 150_000, 150_000, 150_000],
    ]
    .iter()
    .enumerate()
    {
        if round == 1 {
            let acks: Vec<_> = REGIONS
                .iter()
                .map(|r| {
                    let cmd = Command {
                        request: RequestId(request),
                        now_ms: 3_000_000,
                        op: Operation::RenewLease {
                            region: RegionId::new(*r).unwrap(),
                            acked_epoch: epoch,
                        },
                    };
                    request += 1;
                    next(cmd)
                })
                .collect();
            sm.apply(acks).await.unwrap();
        }
        let mut from = 0;
        while from < tenants {
            let to = (from + 10_000).min(tenants);
            let cmd = set_shares(request, membership, from, to, shares);
            request += 1;
            for reply in sm.apply([next(cmd)]).await.unwrap().into_iter().flatten() {
                if let Response::SharesSet {
                    accepted, epoch: e, ..
                } = reply
                {
                    shares_accepted += u64::from(accepted);
                    epoch = e;
                }
            }
            from = to;
        }
    }
    let fill = t.elapsed();

    let t = Instant::now();
    let snap = sm
        .get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .unwrap();
    let build = t.elapsed();
    let bytes = snap.snapshot.len();

    let copy = Snapshot {
        meta: snap.meta.clone(),
        snapshot: snap.snapshot.clone(),
    };
    let (_log2, mut target) = storage::open(&dir.path().join("target")).unwrap();
    let t = Instant::now();
    target
        .install_snapshot(&snap.meta, snap.snapshot)
        .await
        .unwrap();
    let install = t.elapsed();
    let same = target.handle().read(|a| sm.handle().read(|b| a == b));
    assert!(same, "installed state differs from the source");
    drop(target);
    let (follower, http_install) = install_over_http(&dir, copy).await;
    let same = follower.read(|a| sm.handle().read(|b| a == b));
    assert!(same, "state installed over HTTP differs from the source");
    follower.shutdown().await.unwrap();
    println!(
        "snapshot {tenants} tenants x {} regions: {bytes} bytes ({:.1} bytes/tenant), build {:.2} s, install {:.2} s in the state machine, {:.2} s sent over loopback HTTP and installed by a follower (state filled through {index} commands in {:.1} s, {shares_accepted} share updates accepted)",
        REGIONS.len(),
        bytes as f64 / tenants as f64,
        build.as_secs_f64(),
        install.as_secs_f64(),
        http_install.as_secs_f64(),
        fill.as_secs_f64(),
    );
}

/// Sends `snapshot` the way a leader does (one POST to the peer API) to a fresh follower;
/// returns the follower and how long sending plus installing took.
async fn install_over_http(
    dir: &TempDir,
    snapshot: Snapshot<TypeConfig>,
) -> (Coordinator, Duration) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let target = Member {
        region: "us".into(),
        peer_addr: addr.clone(),
        admin_addr: addr,
    };
    // Node 1 (the bootstrapper) never runs: node 2 stays uninitialized until the snapshot lands.
    let nowhere = "127.0.0.1:9".to_string();
    let members = BTreeMap::from([
        (
            1,
            Member {
                region: "eu".into(),
                peer_addr: nowhere.clone(),
                admin_addr: nowhere,
            },
        ),
        (2, target.clone()),
    ]);
    let secret = "bench-secret-0123456789";
    let cfg = RaftConfig::new(2, members, dir.path().join("http-target"), secret);
    let node = Coordinator::start(cfg).await.unwrap();
    let router = node.peer_router();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let mut client = HttpNetwork::new(1, secret)
        .unwrap()
        .new_client(2, &target)
        .await;
    let t = Instant::now();
    client
        .full_snapshot(
            Vote::new_committed(1, 1),
            snapshot,
            futures::future::pending::<ReplicationClosed>(),
            RPCOption::new(Duration::from_secs(120)),
        )
        .await
        .unwrap();
    (node, t.elapsed())
}
