//! Coordinators in one process talking real HTTP on loopback: forwarding, membership changes,
//! a single-node cluster, and bad peer input (401, 400, 413) leaving the cluster undisturbed.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::commands::{limit_of, put_policy, put_region, renew_lease, set_shares};
use quota_core::coordinator::Response;
use quota_raft::codec::FORMAT_VERSION;
use quota_raft::protocol::{PATH_APPEND, PATH_SNAPSHOT, PATH_VOTE};
use quota_raft::{
    Coordinator, LeaderClock, Member, MembershipError, NodeId, RaftConfig, ReadError, Role,
    WriteError,
};
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

const SECRET: &str = "http-cluster-secret-0123456789";

struct Node {
    coordinator: Coordinator,
    server: JoinHandle<()>,
}

async fn listeners(n: usize) -> Vec<TcpListener> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    out
}

fn member(id: NodeId, l: &TcpListener) -> Member {
    let addr = l.local_addr().unwrap().to_string();
    Member {
        region: format!("r{id}"),
        peer_addr: addr.clone(),
        admin_addr: addr,
    }
}

fn config(id: NodeId, members: &BTreeMap<NodeId, Member>, dir: &TempDir) -> RaftConfig {
    let mut c = RaftConfig::new(
        id,
        members.clone(),
        dir.path().join(format!("n{id}")),
        SECRET,
    )
    .with_loopback_timeouts();
    // Small limits, so oversized test bodies still fit in loopback socket buffers and the client
    // reads the 413 instead of a broken pipe.
    c.max_rpc_body_bytes = 4 * 1024;
    c.max_payload_entries = 4;
    c.max_snapshot_body_bytes = 16 * 1024;
    c
}

async fn serve(config: RaftConfig, listener: TcpListener) -> Node {
    serve_with_clock(config, listener, None).await
}

async fn serve_with_clock(
    config: RaftConfig,
    listener: TcpListener,
    clock: Option<LeaderClock>,
) -> Node {
    let coordinator = Coordinator::start_with_clock(config, clock).await.unwrap();
    let router = coordinator.peer_router();
    let server = tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    Node {
        coordinator,
        server,
    }
}

async fn leader_of(nodes: &[&Coordinator]) -> NodeId {
    for _ in 0..800 {
        let leaders: Vec<_> = nodes.iter().map(|c| c.status().leader_id).collect();
        if let Some(Some(l)) = leaders.first() {
            if leaders.iter().all(|x| *x == Some(*l)) {
                return *l;
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no leader");
}

async fn eventually(mut f: impl FnMut() -> bool) {
    for _ in 0..800 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("condition not reached");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_cluster_writes_and_recovers() {
    let dir = TempDir::new().unwrap();
    let [l] = <[TcpListener; 1]>::try_from(listeners(1).await).unwrap();
    let members = BTreeMap::from([(1, member(1, &l))]);
    let cfg = config(1, &members, &dir);
    let node = serve(cfg.clone(), l).await;
    let c = &node.coordinator;
    eventually(|| c.is_leader()).await;
    let r = c.write(put_policy(1, 7, 8)).await.unwrap();
    assert!(matches!(r, Response::PolicyStored { .. }));
    // The same request id again: quota-core answers with the original response.
    assert_eq!(c.write(put_policy(1, 7, 8)).await.unwrap(), r);
    assert_eq!(c.read(|s| limit_of(s, 7)), Some(8));
    let status = c.status();
    assert_eq!((status.role, status.leader_id), (Role::Leader, Some(1)));

    let Node {
        coordinator,
        server,
    } = node;
    server.abort();
    let _ = server.await;
    coordinator.shutdown().await.unwrap();
    drop(coordinator);

    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let node = serve(cfg, l).await;
    eventually(|| node.coordinator.is_leader()).await;
    assert_eq!(
        node.coordinator.read(|s| limit_of(s, 7)),
        Some(8),
        "state survives a restart"
    );
    node.coordinator.write(put_policy(2, 9, 10)).await.unwrap();

    // Raft stopping underneath the daemon is what wait_fatal reports.
    let watcher = {
        let c = node.coordinator.clone();
        tokio::spawn(async move { c.wait_fatal().await })
    };
    node.coordinator.raft().shutdown().await.unwrap();
    let message = tokio::time::timeout(Duration::from_secs(10), watcher)
        .await
        .unwrap()
        .unwrap();
    assert!(!message.is_empty());
    assert!(matches!(
        node.coordinator.write(put_policy(3, 11, 12)).await,
        Err(WriteError::Fatal { .. })
    ));
}

/// The revision readers key derived data on: lease renewals (the steady stream) leave it
/// alone; every other change moves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_renewals_leave_the_revision_alone() {
    let dir = TempDir::new().unwrap();
    let [l] = <[TcpListener; 1]>::try_from(listeners(1).await).unwrap();
    let members = BTreeMap::from([(1, member(1, &l))]);
    let node = serve(config(1, &members, &dir), l).await;
    let c = &node.coordinator;
    eventually(|| c.is_leader()).await;
    let revision = || c.read_revised(|_, r| r);
    c.write(put_region(1, "eu")).await.unwrap();
    let r1 = revision();
    for i in 0..5 {
        let r = c.write(renew_lease(10 + i, "eu", 0)).await.unwrap();
        assert!(matches!(r, Response::LeaseRenewed { .. }), "{r:?}");
    }
    assert_eq!(revision(), r1, "renewals keep the revision");
    assert!(c.read(|s| s
        .regions
        .iter()
        .flatten()
        .all(|r| r.lease_expires_at_ms > 0)));
    c.write(put_policy(20, 7, 8)).await.unwrap();
    let r2 = revision();
    assert_ne!(r2, r1, "a policy change moves it");
    c.write(set_shares(21, 0, 7, 8, &[1_000_000]))
        .await
        .unwrap();
    assert_ne!(revision(), r2, "a share change moves it");
    node.server.abort();
}

async fn three_nodes(dir: &TempDir) -> (BTreeMap<NodeId, Member>, Vec<Node>) {
    let ls = listeners(3).await;
    let members: BTreeMap<NodeId, Member> = ls
        .iter()
        .enumerate()
        .map(|(i, l)| (i as u64 + 1, member(i as u64 + 1, l)))
        .collect();
    let mut nodes = Vec::new();
    for (i, l) in ls.into_iter().enumerate() {
        nodes.push(serve(config(i as u64 + 1, &members, dir), l).await);
    }
    (members, nodes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_writes_are_forwarded_and_bad_peer_input_is_refused() {
    let dir = TempDir::new().unwrap();
    let (members, nodes) = three_nodes(&dir).await;
    let cs: Vec<&Coordinator> = nodes.iter().map(|n| &n.coordinator).collect();
    let leader = leader_of(&cs).await;
    let follower = cs.iter().find(|c| c.status().node_id != leader).unwrap();
    let r = follower.write(put_policy(1, 1, 2)).await.unwrap();
    assert!(matches!(r, Response::PolicyStored { .. }));
    let leader_c = cs.iter().find(|c| c.status().node_id == leader).unwrap();
    assert_eq!(
        leader_c
            .read_linearizable(|s| limit_of(s, 1))
            .await
            .unwrap(),
        Some(2)
    );
    assert_eq!(
        follower.read_linearizable(|_| ()).await,
        Err(ReadError::NotLeader {
            leader_id: Some(leader)
        })
    );
    for c in &cs {
        eventually(|| c.read(|s| limit_of(s, 1)) == Some(2)).await;
    }
    let term = cs[0].status().term;

    // A command too large for an AppendEntries batch never enters the log.
    let huge = set_shares(99, 0, 0, 1_000, &[200_000; 5]);
    for c in &cs {
        assert!(matches!(
            c.write(huge.clone()).await,
            Err(WriteError::TooLarge { .. })
        ));
    }

    let http = reqwest::Client::new();
    for target in members.values() {
        let url = |path: &str| format!("http://{}{path}", target.peer_addr);
        let send = |path: &str, auth: Option<&str>, body: Vec<u8>| {
            let mut req = http.post(url(path)).body(body);
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            req.send()
        };
        let good = format!("Bearer {SECRET}");
        let status = |r: reqwest::Response| r.status().as_u16();
        assert_eq!(
            status(send(PATH_APPEND, None, vec![1, 2, 3]).await.unwrap()),
            401
        );
        assert_eq!(
            status(
                send(PATH_VOTE, Some("Bearer wrong"), vec![1])
                    .await
                    .unwrap()
            ),
            401
        );
        assert_eq!(
            status(send(PATH_APPEND, None, vec![0; 8 * 1024]).await.unwrap()),
            401
        );
        assert_eq!(
            status(
                send(PATH_APPEND, Some(&good), vec![FORMAT_VERSION, 0xff, 0xff])
                    .await
                    .unwrap()
            ),
            400
        );
        assert_eq!(
            status(send(PATH_VOTE, Some(&good), vec![]).await.unwrap()),
            400
        );
        assert_eq!(
            status(send(PATH_VOTE, Some(&good), vec![9, 9, 9]).await.unwrap()),
            400
        );
        assert_eq!(
            status(
                send(PATH_SNAPSHOT, Some(&good), vec![FORMAT_VERSION, 2])
                    .await
                    .unwrap()
            ),
            400
        );
        assert_eq!(
            status(
                send(PATH_APPEND, Some(&good), vec![1; 8 * 1024])
                    .await
                    .unwrap()
            ),
            413
        );
        assert_eq!(
            status(
                send(PATH_SNAPSHOT, Some(&good), vec![1; 32 * 1024])
                    .await
                    .unwrap()
            ),
            413
        );
    }
    // Undisturbed: same leader, same term, writes from any node still commit.
    assert_eq!(leader_of(&cs).await, leader);
    assert_eq!(cs[0].status().term, term);
    for (i, c) in cs.iter().enumerate() {
        let n = 10 + i as u64;
        c.write(put_policy(10 + i as u128, n, n + 1)).await.unwrap();
    }
    for c in &cs {
        eventually(|| c.read(|s| (10..13).all(|n| limit_of(s, n) == Some(n + 1)))).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learner_is_added_promoted_and_removed() {
    let dir = TempDir::new().unwrap();
    let (mut members, nodes) = three_nodes(&dir).await;
    let cs: Vec<&Coordinator> = nodes.iter().map(|n| &n.coordinator).collect();
    let leader_id = leader_of(&cs).await;
    let leader = cs.iter().find(|c| c.status().node_id == leader_id).unwrap();
    let follower = cs.iter().find(|c| c.status().node_id != leader_id).unwrap();
    leader.write(put_policy(1, 1, 2)).await.unwrap();

    let [l4] = <[TcpListener; 1]>::try_from(listeners(1).await).unwrap();
    let m4 = member(4, &l4);
    members.insert(4, m4.clone());
    let n4 = serve(config(4, &members, &dir), l4).await;

    assert!(matches!(
        follower.add_learner(4, m4.clone()).await,
        Err(MembershipError::NotLeader { leader_id: Some(l) }) if l == leader_id
    ));
    leader.add_learner(4, m4).await.unwrap();
    eventually(|| n4.coordinator.read(|s| limit_of(s, 1)) == Some(2)).await;
    assert!(!leader.status().voters.contains(&4));
    leader.promote(4).await.unwrap();
    assert!(leader.status().voters.contains(&4));
    leader.write(put_policy(2, 2, 3)).await.unwrap();
    eventually(|| n4.coordinator.read(|s| limit_of(s, 2)) == Some(3)).await;
    leader.remove(4).await.unwrap();
    let status = leader.status();
    assert!(!status.voters.contains(&4) && !status.members.contains_key(&4));
    assert_eq!(
        leader.remove(99).await,
        Err(MembershipError::UnknownNode { node_id: 99 })
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_rpcs_and_snapshots_honour_their_deadline() {
    use openraft::error::{RPCError, ReplicationClosed, StreamingError};
    use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
    use openraft::raft::VoteRequest;
    use quota_raft::network::HttpNetwork;
    use quota_raft::types::alias::{Snapshot, SnapshotMeta, Vote};

    // A peer that accepts connections and never answers.
    let [l] = <[TcpListener; 1]>::try_from(listeners(1).await).unwrap();
    let target = member(2, &l);
    let _hold = tokio::spawn(async move {
        let mut open = Vec::new();
        loop {
            let (socket, _) = l.accept().await.unwrap();
            open.push(socket);
        }
    });
    let mut client = HttpNetwork::new(1, SECRET)
        .unwrap()
        .new_client(2, &target)
        .await;
    let deadline = Duration::from_millis(300);
    let started = tokio::time::Instant::now();
    let vote = client
        .vote(
            VoteRequest::new(Vote::new(1, 1), None),
            RPCOption::new(deadline),
        )
        .await;
    assert!(matches!(vote, Err(RPCError::Timeout(_))), "{vote:?}");
    let snapshot = Snapshot {
        meta: SnapshotMeta::default(),
        snapshot: Box::new(vec![0; 1024]),
    };
    let sent = client
        .full_snapshot(
            Vote::new_committed(1, 1),
            snapshot,
            futures::future::pending::<ReplicationClosed>(),
            RPCOption::new(deadline),
        )
        .await;
    assert!(matches!(sent, Err(StreamingError::Timeout(_))), "{sent:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "both calls gave up at their deadline"
    );
}

/// Lease arithmetic must run on one clock: the leader stamps what it appends, whatever time the
/// issuer put in the command (here a follower whose clock is far ahead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_stamps_commands_with_its_own_clock() {
    let dir = TempDir::new().unwrap();
    let ls = listeners(3).await;
    let members: BTreeMap<_, _> = ls
        .iter()
        .enumerate()
        .map(|(i, l)| (i as NodeId + 1, member(i as NodeId + 1, l)))
        .collect();
    let mut nodes = Vec::new();
    for (i, l) in ls.into_iter().enumerate() {
        let id = i as NodeId + 1;
        // Distinct fixed clocks, so the stamp tells which node appended the entry.
        let clock: LeaderClock = std::sync::Arc::new(move || 5_000_000 + id);
        nodes.push(serve_with_clock(config(id, &members, &dir), l, Some(clock)).await);
    }
    let coords: Vec<&Coordinator> = nodes.iter().map(|n| &n.coordinator).collect();
    let leader = leader_of(&coords).await;
    let follower = coords
        .iter()
        .find(|c| c.status().node_id != leader)
        .unwrap();

    let mut cmd = put_policy(1, 7, 8);
    cmd.now_ms = 9_000_000_000_000; // a follower clock far in the future
    follower.write(cmd).await.unwrap();
    for c in &coords {
        eventually(|| c.read(|s| limit_of(s, 7)) == Some(8)).await;
        assert_eq!(
            c.read(|s| s.last_now_ms),
            5_000_000 + leader,
            "replicated time is the leader's, not the issuer's"
        );
    }
}

/// The leader stops answering without closing connections (a black hole, as when its region is
/// cut off): a write issued on a follower that still believes in the old leader gives up on it
/// after one forwarding attempt and commits on the new leader, well inside its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_fails_over_from_a_leader_that_stopped_answering() {
    let dir = TempDir::new().unwrap();
    let (members, nodes) = three_nodes(&dir).await;
    let cs: Vec<&Coordinator> = nodes.iter().map(|n| &n.coordinator).collect();
    let leader = leader_of(&cs).await;
    let old = nodes
        .iter()
        .find(|n| n.coordinator.status().node_id == leader)
        .unwrap();
    old.server.abort();
    old.coordinator.shutdown().await.unwrap();
    // Accept every connection on the old leader's address and never answer.
    let hole = TcpListener::bind(&members[&leader].peer_addr)
        .await
        .unwrap();
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = hole.accept().await {
            held.push(socket);
        }
    });
    let follower = cs.iter().find(|c| c.status().node_id != leader).unwrap();
    assert_eq!(follower.status().leader_id, Some(leader), "still believed");
    let deadline = Duration::from_secs(3);
    let started = tokio::time::Instant::now();
    let r = follower
        .write_within(put_policy(7, 7, 8), deadline)
        .await
        .unwrap();
    let took = started.elapsed();
    assert!(matches!(r, Response::PolicyStored { .. }));
    let cfg = follower.config();
    let bound = cfg.failover_worst_case() + cfg.forward_attempt_timeout() * 2;
    println!("write failed over in {took:?} (bound {bound:?})");
    assert!(took <= bound, "took {took:?}, bound {bound:?}");
    // The write committed on the new leader; this follower may hear of it a heartbeat later.
    eventually(|| follower.status().leader_id.is_some_and(|new| new != leader)).await;
    held.abort();
    for n in &nodes {
        n.server.abort();
    }
}
