//! A minimal coordinator node for multi-process tests and benchmarks: the peer API plus a tiny
//! client API on one loopback listener.
//!
//! ```text
//! QUOTA_RAFT_SECRET=... quota-raft-node --id 1 --data-dir /tmp/n1 \
//!     --members 1=127.0.0.1:7001,2=127.0.0.1:7002,3=127.0.0.1:7003 [--loopback-timeouts]
//!     [--election-timeout-max-ms N]
//! ```
//! `--election-timeout-max-ms` (after `--loopback-timeouts`) sets the election timeout to
//! N/2..N and the heartbeat to N/8.
//! Client routes (unauthenticated; loopback test tool only): `POST /client/write` (body: an
//! encoded `Command`, answer: encoded `Result<Response, String>`), `GET /client/state` (encoded
//! `CoordinatorState`), `GET /client/status` (JSON).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use quota_core::coordinator::{Command, Response};
use quota_raft::codec::{decode, encode};
use quota_raft::{Coordinator, Member, RaftConfig, Status};

struct Args {
    id: u64,
    data_dir: PathBuf,
    members: BTreeMap<u64, Member>,
    loopback_timeouts: bool,
    election_timeout_max_ms: Option<u64>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut id = None;
    let mut data_dir = None;
    let mut members = BTreeMap::new();
    let mut loopback_timeouts = false;
    let mut election_timeout_max_ms = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--id" => id = Some(args.next().context("--id needs a value")?.parse()?),
            "--data-dir" => {
                data_dir = Some(PathBuf::from(
                    args.next().context("--data-dir needs a value")?,
                ))
            }
            "--members" => {
                for part in args.next().context("--members needs a value")?.split(',') {
                    let (id, addr) = part
                        .split_once('=')
                        .context("member must be id=host:port")?;
                    let id: u64 = id.parse().context("member id")?;
                    members.insert(
                        id,
                        Member {
                            region: format!("r{id}"),
                            peer_addr: addr.to_string(),
                            admin_addr: addr.to_string(),
                        },
                    );
                }
            }
            "--loopback-timeouts" => loopback_timeouts = true,
            "--election-timeout-max-ms" => {
                let v = args
                    .next()
                    .context("--election-timeout-max-ms needs a value")?;
                election_timeout_max_ms = Some(v.parse()?);
            }
            other => bail!("unknown argument {other:?}"),
        }
    }
    Ok(Args {
        id: id.context("--id is required")?,
        data_dir: data_dir.context("--data-dir is required")?,
        members,
        loopback_timeouts,
        election_timeout_max_ms,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let secret = std::env::var("QUOTA_RAFT_SECRET").context("QUOTA_RAFT_SECRET must be set")?;
    let listen = args
        .members
        .get(&args.id)
        .context("--id must be one of --members")?
        .peer_addr
        .clone();
    let mut config = RaftConfig::new(args.id, args.members, args.data_dir, secret);
    if args.loopback_timeouts {
        config = config.with_loopback_timeouts();
        config.snapshot_every_entries = 500;
        config.log_entries_kept = 100;
    }
    if let Some(max) = args.election_timeout_max_ms {
        config.election_timeout_max_ms = max;
        config.election_timeout_min_ms = max / 2;
        config.heartbeat_interval_ms = (max / 8).max(1);
    }
    let coordinator = Coordinator::start(config)
        .await
        .context("starting the coordinator")?;
    let app = client_routes(coordinator.clone()).merge(coordinator.peer_router());
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    println!("ready {listen}");
    let fatal = {
        let c = coordinator.clone();
        async move { c.wait_fatal().await }
    };
    tokio::select! {
        r = axum::serve(listener, app) => r.context("serving")?,
        message = fatal => bail!("raft stopped: {message}"),
    }
    Ok(())
}

fn client_routes(coordinator: Coordinator) -> Router {
    Router::new()
        .route("/client/write", post(write))
        .route("/client/state", get(state))
        .route("/client/status", get(status))
        .with_state(coordinator)
}

async fn write(State(c): State<Coordinator>, body: Bytes) -> Result<Vec<u8>, (StatusCode, String)> {
    let cmd: Command = decode(&body).map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))?;
    let result: Result<Response, String> = c.write(cmd).await.map_err(|e| e.to_string());
    encode(&result).map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

async fn state(State(c): State<Coordinator>) -> Result<Vec<u8>, (StatusCode, String)> {
    c.read(encode)
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

async fn status(State(c): State<Coordinator>) -> Json<Status> {
    Json(c.status())
}
