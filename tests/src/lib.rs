//! Harness for quotad's system tests: real `quotad` processes (and real `redis-server`s through
//! `redis-harness`) on loopback ports, with helpers to call their HTTP API and poll with
//! deadlines instead of sleeping.
//!
//! The `quotad` binary is found next to the test executable (`target/<profile>/quotad`);
//! `cargo nextest run --workspace` and `cargo test --workspace` build it. Run
//! `cargo build -p quotad` first when testing this package alone.
//!
//! # Layout
//! - [`daemon`]: a `quotad` process ([`Daemon`]): start, readiness, stop, log.
//! - [`http`]: calls to its API ([`Daemon::request`], [`Daemon::check`], …) and [`Reply`].
//! - [`redis_probe`]: what tests ask Redis, and the daemon about Redis.
//! - [`cluster`]: several regions with fault proxies between them ([`Cluster`]).
//! - [`region_set`]: regions of several daemons each on one Redis ([`RegionSet`]).
//! - [`config`]: configs for single-region tests.
//! - [`poll`]: [`eventually`], polling with a deadline.
//! - [`metrics`]: samples of the Prometheus text.
//! - [`fault_proxy`]: the TCP proxy that cuts regions apart.
//! - [`prometheus`]: a real Prometheus scraping daemons ([`Prometheus`]); its binaries.
//! - [`grafana`]: the Grafana dashboard's panels and queries.
//! - [`crates`]: where Cargo put the crates whose `.proto` files the Python clients compile.

pub mod cluster;
pub mod config;
pub mod crates;
pub mod daemon;
pub mod fault_proxy;
pub mod grafana;
pub mod http;
pub mod metrics;
pub mod poll;
pub mod prometheus;
pub mod redis_probe;
pub mod region_set;

pub use cluster::{Cluster, Timings, PEER_TOKEN};
pub use config::{config_dir, embedded_config, redis_config, redis_config_with_envoy};
pub use daemon::{free_port, quotad_binary, Daemon, TOKEN};
pub use http::Reply;
pub use metrics::metric_value;
pub use poll::eventually;
pub use prometheus::Prometheus;
pub use redis_probe::{
    all_still_spent, client_with_password, command_calls, decides_through_redis, evalsha_calls,
    params_keys, params_present, until_all_normal, QUOTAD_ACL,
};
pub use region_set::RegionSet;
