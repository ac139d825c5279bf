//! Start-up and shutdown: builds the store, coordinator, decider and agent from validated
//! settings, serves the API, and on shutdown turns /readyz to 503, drains in-flight requests,
//! then stops the background tasks.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use metrics_exporter_prometheus::PrometheusHandle;
use quota_store::{AnyStore, RedisStoreConfig};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::agent;
use crate::api::{self, AppState};
use crate::breaker::Breaker;
use crate::config::{Secret, Settings};
use crate::coordination::{Coordinator, LocalCoordinator};
use crate::decision::{Decider, DeciderParts};

/// Resolves once SIGTERM or Ctrl-C arrives.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// The admin token: the configured one, or a fresh random one printed once on stderr.
fn admin_token(settings: &Settings) -> Secret {
    if let Some(t) = &settings.secrets.admin_token {
        return t.clone();
    }
    let bytes: [u8; 24] = rand::random();
    let token = hex::encode(bytes);
    eprintln!("quotad: no admin token configured; generated one for this run: {token}");
    Secret::new(token)
}

/// The Redis URL with the password (from the environment or a file) spliced in.
fn redis_url(url: &str, password: Option<&Secret>) -> String {
    match (password, url.strip_prefix("redis://")) {
        (Some(p), Some(rest)) => format!("redis://:{}@{rest}", p.expose()),
        _ => url.to_string(),
    }
}

/// The regional store: Redis when configured, else the embedded one.
async fn build_store(settings: &Settings) -> anyhow::Result<AnyStore> {
    let Some(redis) = &settings.config.redis else {
        return Ok(AnyStore::embedded());
    };
    let url = redis_url(&redis.url, settings.secrets.redis_password.as_ref());
    let cfg =
        RedisStoreConfig::standalone(url).with_timeout(Duration::from_millis(redis.timeout_ms));
    // Connecting once at start-up catches a wrong address early; once running, the store
    // reconnects on its own and the breaker covers outages.
    AnyStore::redis(cfg)
        .await
        .with_context(|| format!("connecting to the regional Redis at {}", redis.url))
}

/// Everything the API serves from, built from settings.
pub async fn build_state(
    settings: &Settings,
    metrics: Option<PrometheusHandle>,
) -> anyhow::Result<AppState> {
    let cfg = &settings.config;
    if !settings.is_single_region() {
        bail!("multi-region clusters need the Raft coordinator, which this build does not integrate yet; list at most one region");
    }
    let store = build_store(settings).await?;
    let coordinator = Arc::new(Coordinator::Local(LocalCoordinator::new(
        settings.region.clone(),
    )));
    let homes: HashMap<_, _> = settings
        .regions
        .iter()
        .map(|r| (r.id.clone(), r.api))
        .collect();
    let decider = Arc::new(Decider::new(DeciderParts {
        region: settings.region.clone(),
        store,
        breaker: Breaker::new(&cfg.breaker, settings.region.as_str()),
        view: coordinator.subscribe(),
        drift_margin_ms: cfg.coordination.drift_margin_ms,
        store_timeout: Duration::from_millis(cfg.redis.as_ref().map_or(50, |r| r.timeout_ms)),
        homes,
        forward_timeout: Duration::from_millis(cfg.api.forward_timeout_ms),
    }));
    Ok(AppState {
        decider,
        coordinator,
        admin_token: Arc::new(admin_token(settings)),
        metrics,
        ready: Arc::new(AtomicBool::new(false)),
        drift_margin_ms: cfg.coordination.drift_margin_ms,
        body_limit_bytes: cfg.api.body_limit_bytes,
        request_timeout: Duration::from_millis(cfg.api.request_timeout_ms),
    })
}

/// Runs the daemon until `shutdown` resolves, then drains and stops.
pub async fn run(
    settings: Settings,
    metrics: Option<PrometheusHandle>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(settings.api_listen)
        .await
        .with_context(|| format!("binding the API listener on {}", settings.api_listen))?;
    serve(settings, listener, metrics, shutdown).await
}

/// Like [`run`] on an already bound API listener (benchmarks and tests bind port 0).
pub async fn serve(
    settings: Settings,
    listener: TcpListener,
    metrics: Option<PrometheusHandle>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let state = build_state(&settings, metrics).await?;
    let cfg = &settings.config;
    let (stop_tx, stop_rx) = watch::channel(false);
    let agent = tokio::spawn(agent::run(
        state.decider.clone(),
        state.coordinator.subscribe(),
        Duration::from_millis(cfg.coordination.report_interval_ms),
        cfg.coordination.drift_margin_ms,
        stop_rx,
    ));
    let ready = state.ready.clone();
    let router = api::app(state);
    ready.store(true, Ordering::Relaxed);
    let local = listener
        .local_addr()
        .context("reading the API listener address")?;
    tracing::info!(region = %settings.region, api = %local, "quotad serving.");

    let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<()>();
    let drain_ready = ready.clone();
    let graceful = async move {
        shutdown.await;
        drain_ready.store(false, Ordering::Relaxed);
        tracing::info!("Shutdown requested: draining in-flight requests.");
        let _ = drain_tx.send(());
    };
    let server = axum::serve(listener, router).with_graceful_shutdown(graceful);
    let drain_timeout = Duration::from_millis(cfg.api.drain_timeout_ms);
    let served = tokio::select! {
        r = server => r.context("serving the API"),
        () = async {
            let _ = drain_rx.await;
            tokio::time::sleep(drain_timeout).await;
        } => {
            tracing::warn!("Drain timeout reached; closing remaining connections.");
            Ok(())
        }
    };
    let _ = stop_tx.send(true);
    let _ = agent.await;
    tracing::info!("quotad stopped.");
    served
}
