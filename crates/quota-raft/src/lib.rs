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
//! - [`types`]: the openraft type configuration and [`Member`].
//! - [`storage`]: redb-backed log, vote and state machine with snapshots.
//! - [`codec`]: postcard behind a version byte, on disk and on the wire.
//! - [`network`]: the HTTP client side of the peer protocol (one pooled reqwest client).
//! - [`peer_api`]: the axum router serving the peer protocol, authenticated by a shared secret.
//! - [`runtime`]: a tokio runtime for openraft with a seedable RNG, for repeatable tests.
//! - [`telemetry`]: metric names and the exporter of Raft metrics to the `metrics` facade.

pub mod codec;
pub mod config;
pub mod coordinator;
pub mod network;
pub mod peer_api;
pub mod protocol;
pub mod runtime;
pub mod storage;
pub mod telemetry;
pub mod types;

pub use config::{ConfigError, ConfigErrors, RaftConfig};
pub use coordinator::{
    Coordinator, MembershipError, Role, StartError, Status, WriteError,
};
pub use storage::StateHandle;
pub use types::{Member, NodeId, Reply, TypeConfig};
