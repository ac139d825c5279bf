//! quotad: the per-region quota daemon.
//!
//! One daemon runs in each region next to that region's Redis (or, with no Redis configured,
//! with an in-process store). It answers decision checks from the regional store at this
//! region's share of each tenant's budget, serves the admin API, runs the region agent that
//! applies shares and collects usage, and takes part in the coordinator.
//!
//! # Layout
//! - [`cli`]: the command line (`run`, `check-config`, `--version`).
//! - [`config`]: TOML config, `QUOTAD_…` overrides, one-pass validation, secrets.
//! - [`secret`]: secret values and the one constant-time token comparison.
//! - [`tokens`]: the API's named, scoped bearer tokens and their file, re-read on change.
//! - [`audit`]: the audit log of mutations and its counter.
//! - [`server`]: start-up, serving, graceful shutdown.
//! - [`api`]: the axum router (`app(state)`), handlers and the one `ApiError`.
//! - [`decision`]: the decision path: pins, shares, fail modes, and the circuit breaker
//!   around the regional store.
//! - [`coordination`]: the coordinator behind the daemon and its view snapshots: the
//!   single-region one on its redb file, and the Raft-backed one (quota-raft) with its usage
//!   reports, lease renewals and the leader's rebalancing.
//! - [`agent`]: the region agent (applies shares, collects usage) and its ledger of what the
//!   store was told.
//! - [`envoy`]: Envoy's rate limit service (gRPC) over the same decision path, and its rate
//!   limit quota service: Envoys enforce assigned parts of this region's shares themselves.
//! - [`eviction`]: whether the regional Redis may evict quotad's keys.
//! - [`redis_password`]: re-reading the Redis password file, for rotation without a restart.
//! - [`telemetry`]: metric names, the Prometheus exporter, log set-up.
//! - [`clock`]: the only place that reads real time.

pub mod agent;
pub mod api;
pub mod audit;
pub mod cli;
pub mod clock;
pub mod config;
pub mod coordination;
pub mod decision;
pub mod envoy;
pub mod eviction;
pub mod redis_password;
pub mod secret;
pub mod server;
pub mod store_owner;
pub mod telemetry;
pub mod tokens;
