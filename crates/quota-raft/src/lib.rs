//! quota-raft: the Raft-replicated coordinator of quotad.
//!
//! It replicates quota-core's `CoordinatorState` with openraft 0.9: every
//! [`Command`](quota_core::coordinator::Command) is committed to a majority, then applied with
//! quota-core's pure `apply`. Business rejections come back as quota-core `Response`s; only a
//! storage failure is an error, and it stops Raft for good (see [`Coordinator::wait_fatal`]).
//!
//! # Layout
//! - [`config`]: [`RaftConfig`], static members, timeouts, `validate()`.
//! - [`coordinator`]: [`Coordinator`], the API the daemon uses: start, write, read, status,
//!   membership, shutdown.
//! - [`election`]: the election guard (a pre-vote on openraft 0.9): when to campaign.
//! - [`types`]: the openraft type configuration and [`Member`].
//! - [`storage`]: redb-backed log, vote and state machine with snapshots.
//! - [`codec`]: postcard behind a version byte, on disk and on the wire.
//! - [`network`]: the HTTP client side of the peer protocol (one pooled reqwest client).
//! - [`peer_api`]: the axum router serving the peer protocol, authenticated by a shared secret.
//! - [`secret`]: [`secret::Secret`] and the one constant-time token comparison.
//! - [`runtime`]: a tokio runtime for openraft with a seedable RNG, for repeatable tests.
//! - [`tls`]: peer mutual TLS: reloadable certificate, key and CA, the TLS accept loop,
//!   region identities from URI SANs.
//! - [`telemetry`]: metric names and the exporter of Raft metrics to the `metrics` facade.
//! - [`proposal`]: [`LeaderClock`] and proposing a command on this node's Raft, shared by the
//!   coordinator's writes and the peer API's forwarded ones.
//! - [`protocol`]: peer routes, forwarded-write messages and snapshot framing.
//! - `src/bin/quota-raft-node.rs`: a minimal node (peer API + tiny client API) for the
//!   multi-process test.
//!
//! # Using it (the daemon)
//! ```text
//! let c = Coordinator::start(config).await?;          // opens redb, bootstraps if fresh
//! axum::serve(peer_listener, c.peer_router());        // peer listener, not the admin one
//! c.write(command).await?;                            // forwarded to the leader, bounded
//! c.read(|state| ...); c.subscribe_applied();         // applied state, change notification
//! tokio::select! { m = c.wait_fatal() => exit(1), _ = shutdown_signal() => c.shutdown().await? }
//! ```
//!
//! # Tests
//! - `tests/storage_suite.rs`: openraft's storage conformance suite on redb.
//! - `tests/cluster.rs`: in-process clusters, fault-injecting network, paused clock, one seed.
//! - `tests/http_cluster.rs`: coordinators over real loopback HTTP; forwarding, membership,
//!   bad peer input.
//! - `tests/kill_leader.rs`: three processes, `kill -9` of the leader under writes; 5 rounds by
//!   default, `QUOTA_RAFT_KILL_ROUNDS=100 cargo test -p quota-raft --test kill_leader --
//!   --nocapture` for the full run.
//! - `benches/raft.rs`: `cargo bench -p quota-raft --bench raft` (commit latency, snapshots).

pub mod codec;
pub mod config;
pub mod coordinator;
pub mod election;
pub mod network;
pub mod peer_api;
pub mod proposal;
pub mod protocol;
pub mod runtime;
pub mod secret;
pub mod storage;
pub mod telemetry;
pub mod tls;
pub mod types;

pub use config::{ConfigError, ConfigErrors, RaftConfig};
pub use coordinator::{
    Coordinator, LeaderClock, MembershipError, ReadError, Role, ShutdownError, StartError, Status,
    WriteError,
};
pub use storage::{Changes, StateHandle};
pub use types::{Member, NodeId, Reply, TypeConfig};
