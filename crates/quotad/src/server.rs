//! Start-up and shutdown: builds the store, coordinator, decider and agent from validated
//! settings, serves the API, turns /readyz to 200 once the daemon can decide for its region
//! ([`crate::coordination::readiness`]), and on shutdown turns it to 503, drains in-flight
//! requests, then stops the background tasks.

use std::collections::HashMap;
use std::future::{Future, IntoFuture as _};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use metrics_exporter_prometheus::PrometheusHandle;
use quota_store::{AnyStore, Credentials, RedisStore, RedisStoreConfig, StoreError};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::api::{self, AppShared, AppState};
use crate::config::{Config, RuntimeConfig, SecretSource, Settings, ENV_REDIS_PASSWORD};
use crate::coordination::{readiness, Coordinator, LocalCoordinator, Replicated};
use crate::decision::breaker::Breaker;
use crate::decision::{Decider, DeciderParts};
use crate::secret::Secret;
use crate::tokens::Tokens;
use crate::{agent, decision, envoy, eviction, redis_password, telemetry};
use quota_raft::tls::{PeerHttp, ServerTls};

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

/// The regional store: Redis when configured, else the embedded one, and whether it answered
/// at start. Only a malformed address or credentials Redis refuses stop start-up: a daemon
/// that refused to start while its Redis is down would make a Redis outage a limiter outage
/// (e.g. a region's daemons restarted during one). It serves with each policy's fail mode
/// until Redis answers, and connects on its own once it does.
async fn build_store(settings: &Settings) -> anyhow::Result<(AnyStore, bool)> {
    let Some(redis) = &settings.config.redis else {
        return Ok((AnyStore::embedded(), true));
    };
    let mut cfg = RedisStoreConfig::new(redis.topology())
        .with_timeout(Duration::from_millis(redis.timeout_ms));
    if let Some(password) = &settings.secrets.redis_password {
        cfg = cfg.with_credentials(Credentials {
            username: redis.username.clone(),
            password: password.expose().to_string(),
        });
    }
    if let Some(tls) = &settings.redis_tls {
        cfg = cfg.with_tls(tls.clone());
    }
    if let Some(password) = &settings.secrets.redis_sentinel_password {
        cfg = cfg.with_sentinel_credentials(Credentials {
            username: None,
            password: password.expose().to_string(),
        });
    }
    let store = RedisStore::open(cfg)
        .with_context(|| format!("the regional Redis address {}", redis.url))?;
    let reachable = match store.reachable().await {
        Ok(()) => true,
        // Redis answers but will not serve this daemon: a configuration mistake, which
        // waiting will not mend (unlike an outage).
        Err(e @ StoreError::Refused { .. }) => {
            return Err(anyhow::Error::new(e).context(format!(
                "the regional Redis at {} refused quotad: check redis.username and the password ({ENV_REDIS_PASSWORD} or redis.password_file), and that the ACL user may run what quotad needs (docs/operations.md, Authentication)",
                redis.url
            )));
        }
        Err(e) => {
            tracing::warn!(
                redis = %redis.url,
                error = %e,
                "The regional Redis does not answer at start: serving with each policy's fail mode until it does."
            );
            false
        }
    };
    Ok((AnyStore::Redis(store), reachable))
}

/// The coordinator, and the replicated member itself when there is one (its loops and the
/// peer listener need it, not the API).
async fn build_coordinator(
    settings: &Settings,
) -> anyhow::Result<(Arc<Coordinator>, Option<Arc<Replicated>>)> {
    if settings.is_single_region() {
        let local = LocalCoordinator::open(settings.region.clone(), &settings.config.data_dir)
            .context("opening the single-region coordinator's state")?;
        return Ok((Arc::new(Coordinator::Local(local)), None));
    }
    let replicated = Arc::new(Replicated::start(settings).await?);
    Ok((
        Arc::new(Coordinator::Replicated(replicated.clone())),
        Some(replicated),
    ))
}

/// This daemon's mark on its Redis ([`crate::store_owner`]).
fn owner_mark(settings: &Settings) -> anyhow::Result<String> {
    crate::store_owner::mark(
        &settings.region,
        !settings.is_single_region(),
        &settings.config.data_dir,
    )
}

/// How long the mark outlives its last renewal.
fn owner_ttl(settings: &Settings) -> Duration {
    crate::store_owner::mark_ttl(Duration::from_millis(
        settings.config.coordination.report_interval_ms,
    ))
}

/// Everything the API serves from, built from settings, with the replicated member of a
/// multi-region cluster.
pub async fn build_state(
    settings: &Settings,
    metrics: Option<PrometheusHandle>,
) -> anyhow::Result<(AppState, Option<Arc<Replicated>>)> {
    let cfg = &settings.config;
    let (store, reachable) = build_store(settings).await?;
    if reachable {
        // Before anything is written: one region's daemons, or one single daemon, per Redis.
        let mine = owner_mark(settings)?;
        crate::store_owner::claim_at_start(&store, &mine, owner_ttl(settings)).await?;
    }
    let breaker = Breaker::new(&cfg.breaker, settings.region.as_str());
    if !reachable {
        breaker.trip();
    }
    let (coordinator, replicated) = build_coordinator(settings).await?;
    // With peer TLS, checks are forwarded to the home's peer listener over mutual TLS;
    // without, to its API.
    let peer_tls = replicated.as_ref().and_then(|r| r.peer_tls());
    let mut homes: HashMap<_, Vec<String>> = HashMap::new();
    for r in &settings.regions {
        let addr = if peer_tls.is_some() { &r.peer } else { &r.api };
        homes.entry(r.id.clone()).or_default().push(addr.clone());
    }
    let decider = Decider::new(DeciderParts {
        region: settings.region.clone(),
        store,
        breaker,
        view: coordinator.subscribe(),
        homes,
        forward_timeout: Duration::from_millis(cfg.api.forward_timeout_ms),
        peer_token: settings.secrets.peer_token.clone(),
        reservations: cfg.redis.as_ref().is_some_and(|r| r.reservations),
        store_timeout: Duration::from_millis(cfg.redis.as_ref().map_or(0, |r| r.timeout_ms)),
        daemons: settings
            .regions
            .iter()
            .filter(|r| r.id == settings.region)
            .count()
            .max(1) as u32,
    });
    let decider = if cfg.redis.as_ref().is_some_and(|r| !r.denial_cache) {
        decider.without_denial_cache()
    } else {
        decider
    };
    let decider = Arc::new(match peer_tls {
        Some(tls) => decider.forwarding_over_peer(
            PeerHttp::new(Some(tls), |b| b.tcp_nodelay(true))
                .context("building the forwarding client")?,
        ),
        None => decider,
    });
    let state = Arc::new(AppShared {
        decider,
        coordinator,
        tokens: Arc::new(Tokens::new(
            Some(&admin_token(settings)),
            cfg.api.tokens_file.clone(),
            settings.secrets.api_tokens.clone(),
        )),
        open_checks: cfg.api.open_checks,
        metrics,
        ready: Arc::new(AtomicBool::new(false)),
        drift_margin_ms: cfg.coordination.drift_margin_ms,
        body_limit_bytes: cfg.api.body_limit_bytes,
        request_timeout: Duration::from_millis(cfg.api.request_timeout_ms),
        identity_key: settings.secrets.identity_key.clone(),
    });
    Ok((state, replicated))
}

/// The tokio runtime the daemon runs on, sized by `runtime.worker_threads`.
pub fn build_runtime(cfg: &RuntimeConfig) -> std::io::Result<tokio::runtime::Runtime> {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.workers(cores))
        .thread_name("quotad-worker")
        .enable_all()
        .build()
}

/// Keeps a timer pending that ends sooner than any request's timeouts. tokio wakes its I/O
/// driver (an eventfd write and one more epoll round) whenever a timer is registered with a
/// deadline earlier than every pending one (tokio-rs/tokio#5207); every check registers two
/// (the request and the store call), so on an otherwise idle runtime each check paid that wake
/// twice over. With this timer always earlier, registering theirs wakes nothing; it costs
/// `1 / period` wake-ups a second when idle.
/// Half the shortest timeout a request arms (at most 100 ms, at least 1 ms).
fn pending_timer_period(cfg: &Config) -> Duration {
    let shortest_ms = cfg
        .api
        .request_timeout_ms
        .min(cfg.api.forward_timeout_ms)
        .min(cfg.redis.as_ref().map_or(u64::MAX, |r| r.timeout_ms));
    Duration::from_millis((shortest_ms / 2).clamp(1, 100))
}

/// Gives back reservations that aged out, every [`RESERVATION_SWEEP`].
async fn sweep_reservations(decider: Arc<Decider>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(RESERVATION_SWEEP);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => decider.sweep_reservations(),
            _ = shutdown.changed() => break,
        }
    }
}

/// How often reservations are swept: a quarter of their age limit, so a pool goes back within
/// 1.25 times it.
const RESERVATION_SWEEP: Duration = Duration::from_millis(quota_core::reservation::MAX_AGE_MS / 4);

async fn keep_a_timer_pending(period: Duration, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            _ = tick.tick() => {}
        }
    }
}

/// The task re-reading `redis.password_file`, when the password comes from that file and
/// `redis.password_check_ms` is not 0.
fn password_watch(
    settings: &Settings,
    store: &AnyStore,
    stop: &watch::Receiver<bool>,
) -> Option<impl Future<Output = ()> + Send + 'static> {
    let (AnyStore::Redis(store), Some(redis), Some(password)) = (
        store,
        settings.config.redis.as_ref(),
        settings.secrets.redis_password.as_ref(),
    ) else {
        return None;
    };
    let path = redis.password_file.clone()?;
    if settings.secrets.redis_password_source != SecretSource::File || redis.password_check_ms == 0
    {
        return None;
    }
    Some(redis_password::run(
        store.clone(),
        path,
        redis.username.clone(),
        password.expose().to_string(),
        Duration::from_millis(redis.password_check_ms),
        settings.region.to_string(),
        stop.clone(),
    ))
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
    let (state, replicated) = build_state(&settings, metrics).await?;
    let decider = state.decider.clone();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = background_tasks(&settings, &state, replicated.as_ref(), &stop_rx);
    if let Some(r) = &replicated {
        tasks.extend(replicated_tasks(&settings, &state, r, &stop_rx).await?);
    }
    tasks.extend(envoy_task(&settings, &state, &stop_rx).await?);
    let api_tls = listener_tls("api", settings.api_tls.as_ref())?;
    if let Some(tls) = &api_tls {
        tasks.extend(tls_watch(tls, settings.config.api.tls_check_ms, &stop_rx));
    }
    let served = serve_api(
        &settings,
        listener,
        api_tls,
        state,
        replicated.clone(),
        shutdown,
    )
    .await;
    // Reserved tokens not handed out go back before the daemon stops.
    decider.return_reservations().await;
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    // Nothing writes any more: a replacement may start at once.
    if let Ok(mine) = owner_mark(&settings) {
        crate::store_owner::release(decider.store(), &mine).await;
    }
    if let Some(r) = &replicated {
        // Once the apply loop has stopped writing: a standby takes the role at its next look.
        r.release_agent_role().await;
        r.shutdown().await;
    }
    tracing::info!("quotad stopped.");
    served
}

/// The region agent's loops and the daemon's upkeep: the timer kept pending, the password
/// and tokens file watches, the metrics upkeep.
fn background_tasks(
    settings: &Settings,
    state: &AppState,
    replicated: Option<&Arc<Replicated>>,
    stop_rx: &watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    let cfg = &settings.config;
    let report_interval = Duration::from_millis(cfg.coordination.report_interval_ms);
    let owner = owner_mark(settings)
        .map(|m| (m, owner_ttl(settings)))
        .map_err(|e| tracing::warn!(error = %e, "This daemon's mark on Redis is unknown."))
        .ok();
    let mut tasks = vec![tokio::spawn(agent::run_apply(
        state.decider.clone(),
        state.coordinator.clone(),
        replicated.cloned(),
        owner,
        report_interval,
        // The longest lease an earlier run may have written (renewals carry only the
        // configured lease).
        cfg.coordination.lease_ms,
        stop_rx.clone(),
    ))];
    if let Some(r) = replicated {
        tasks.push(tokio::spawn(agent::run_report(
            state.decider.clone(),
            r.clone(),
            report_interval,
            stop_rx.clone(),
        )));
    } else {
        tasks.push(tokio::spawn(agent::run_drain(
            state.decider.clone(),
            report_interval,
            stop_rx.clone(),
        )));
    }
    tasks.push(tokio::spawn(keep_a_timer_pending(
        pending_timer_period(cfg),
        stop_rx.clone(),
    )));
    tasks.push(tokio::spawn(sweep_reservations(
        state.decider.clone(),
        stop_rx.clone(),
    )));
    tasks.push(tokio::spawn(decision::exposure::run_metrics(
        state.decider.clone(),
        cfg.coordination.drift_margin_ms,
        stop_rx.clone(),
    )));
    tasks.push(tokio::spawn(eviction::run(
        state.decider.store().clone(),
        report_interval,
        settings.region.to_string(),
        stop_rx.clone(),
    )));
    if let Some(watch) = password_watch(settings, state.decider.store(), stop_rx) {
        tasks.push(tokio::spawn(watch));
    }
    if cfg.api.tokens_file.is_some() && cfg.api.tokens_check_ms > 0 {
        tasks.push(tokio::spawn(state.tokens.clone().watch(
            Duration::from_millis(cfg.api.tokens_check_ms),
            stop_rx.clone(),
        )));
    }
    if let Some(metrics) = state.metrics.clone() {
        tasks.push(tokio::spawn(telemetry::run_metrics_upkeep(
            metrics,
            stop_rx.clone(),
        )));
    }
    tasks
}

/// The replicated member's loops and its peer listener (Raft and usage reports), over mutual
/// TLS with `[peer] tls_*`, whose files are then re-read every `peer.tls_check_ms`.
async fn replicated_tasks(
    settings: &Settings,
    state: &AppState,
    r: &Arc<Replicated>,
    stop_rx: &watch::Receiver<bool>,
) -> anyhow::Result<Vec<JoinHandle<()>>> {
    let peer = TcpListener::bind(settings.peer_listen)
        .await
        .with_context(|| format!("binding the peer listener on {}", settings.peer_listen))?;
    let loops = tokio::spawn(replicated_loops(
        r.clone(),
        Duration::from_millis(settings.config.coordination.rebalance_interval_ms),
        stop_rx.clone(),
    ));
    let stopped = |mut stop: watch::Receiver<bool>| async move {
        let _ = stop.changed().await;
    };
    // Raft, usage reports, and checks forwarded from other regions.
    let router = r.peer_router().merge(api::forwarded::peer_router(
        state.clone(),
        r.peer_identities(),
    ));
    let mut tasks = vec![loops];
    if let Some(tls) = r.peer_tls() {
        // TLS only: a client certificate from the CA on every connection.
        tasks.push(tokio::spawn(quota_raft::tls::serve(
            peer,
            router,
            tls.clone(),
            stopped(stop_rx.clone()),
        )));
        let every = settings.config.peer.tls_check_ms;
        if every > 0 {
            tasks.push(tokio::spawn(
                tls.clone()
                    .watch(Duration::from_millis(every), stopped(stop_rx.clone())),
            ));
        }
    } else {
        let stop = stop_rx.clone();
        tasks.push(tokio::spawn(async move {
            let served = axum::serve(peer, router)
                .with_graceful_shutdown(stopped(stop))
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "The peer listener failed.");
            }
        }));
    }
    Ok(tasks)
}

/// The task re-reading a listener's TLS files every `every_ms` (none when 0).
fn tls_watch(
    tls: &ServerTls,
    every_ms: u64,
    stop_rx: &watch::Receiver<bool>,
) -> Option<JoinHandle<()>> {
    let mut stop = stop_rx.clone();
    (every_ms > 0).then(|| {
        tokio::spawn(
            tls.clone()
                .watch(Duration::from_millis(every_ms), async move {
                    let _ = stop.changed().await;
                }),
        )
    })
}

/// Reads a listener's TLS files, when it has them.
fn listener_tls(
    name: &'static str,
    files: Option<&quota_raft::tls::ServerFiles>,
) -> anyhow::Result<Option<ServerTls>> {
    files
        .map(|f| ServerTls::load(name, f.clone()))
        .transpose()
        .with_context(|| format!("reading the {name} listener's TLS files"))
}

/// Envoy's rate limit service, when `envoy.listen` is set (over TLS with `[envoy] tls_*`,
/// whose files are then re-read every `envoy.tls_check_ms`).
async fn envoy_task(
    settings: &Settings,
    state: &AppState,
    stop_rx: &watch::Receiver<bool>,
) -> anyhow::Result<Vec<JoinHandle<()>>> {
    let Some(addr) = settings.envoy_listen else {
        return Ok(Vec::new());
    };
    let cfg = &settings.config;
    let tls = listener_tls("envoy", settings.envoy_tls.as_ref())?;
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the Envoy rate limit listener on {addr}"))?;
    let service = envoy::EnvoyRateLimit::new(state.clone(), &cfg.envoy);
    let quota = envoy::EnvoyQuota::new(state.clone(), &cfg.envoy);
    let stop = stop_rx.clone();
    let drain = Duration::from_millis(cfg.api.drain_timeout_ms);
    tracing::info!(envoy = %addr, tls = tls.is_some(), "Envoy rate limit services (RLS v3, RLQS) serving.");
    let mut tasks = Vec::new();
    let served = match &tls {
        Some(tls) => {
            tasks.extend(tls_watch(tls, cfg.envoy.tls_check_ms, stop_rx));
            let incoming = tls
                .incoming(listener, &[b"h2"])
                .context("reading the Envoy listener address")?;
            tokio::spawn(async move {
                if let Err(e) = envoy::serve_tls(service, quota, incoming, stop, drain).await {
                    tracing::error!(error = %e, "The Envoy rate limit listener failed.");
                }
            })
        }
        None => tokio::spawn(async move {
            if let Err(e) = envoy::serve(service, quota, listener, stop, drain).await {
                tracing::error!(error = %e, "The Envoy rate limit listener failed.");
            }
        }),
    };
    tasks.push(served);
    Ok(tasks)
}

/// Serves the API until `shutdown` resolves (or Raft stops for good), with /readyz 200 from
/// when the coordinator waits for nothing more, then turns it to 503 and drains in-flight
/// requests for up to `api.drain_timeout_ms`.
async fn serve_api(
    settings: &Settings,
    listener: TcpListener,
    tls: Option<ServerTls>,
    state: AppState,
    replicated: Option<Arc<Replicated>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let ready = state.ready.clone();
    let coordinator = state.coordinator.clone();
    let router = api::app(state);
    // Draining wins over readiness: both are decided under this lock.
    let draining = Arc::new(std::sync::Mutex::new(false));
    // A single region is ready before it serves; a cluster member once it can decide for its
    // region and take pins to it.
    let readiness = if coordinator.readiness().is_empty() {
        ready.store(true, Ordering::Relaxed);
        None
    } else {
        Some(tokio::spawn(become_ready(
            coordinator,
            ready.clone(),
            draining.clone(),
        )))
    };
    let local = listener
        .local_addr()
        .context("reading the API listener address")?;
    tracing::info!(region = %settings.region, api = %local, tls = tls.is_some(), "quotad serving.");

    let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<()>();
    let drain_ready = ready.clone();
    // Raft stopping for good (storage failure) also shuts the daemon down, with an error, so
    // its supervisor restarts it from the durable state.
    let fatal = Arc::new(std::sync::Mutex::new(None::<String>));
    let fatal_seen = fatal.clone();
    let raft_stopped = async move {
        match replicated {
            Some(r) => r.wait_fatal().await,
            None => std::future::pending().await,
        }
    };
    let graceful = async move {
        tokio::select! {
            () = shutdown => {}
            message = raft_stopped => {
                tracing::error!(error = %message, "Raft stopped; shutting down.");
                *fatal_seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(message);
            }
        }
        {
            let mut draining = draining.lock().unwrap_or_else(|e| e.into_inner());
            *draining = true;
            drain_ready.store(false, Ordering::Relaxed);
        }
        tracing::info!("Shutdown requested: draining in-flight requests.");
        let _ = drain_tx.send(());
    };
    let make = axum::ServiceExt::into_make_service(router);
    // With `[api] tls_*`, TLS only (a client certificate too with `tls_client_ca_file`).
    let server: std::pin::Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>> = match tls {
        Some(tls) => {
            let incoming = tls
                .incoming(listener, &[b"http/1.1"])
                .context("reading the API listener address")?;
            Box::pin(
                axum::serve(incoming, make)
                    .with_graceful_shutdown(graceful)
                    .into_future(),
            )
        }
        None => Box::pin(
            axum::serve(listener, make)
                .with_graceful_shutdown(graceful)
                .into_future(),
        ),
    };
    let drain_timeout = Duration::from_millis(settings.config.api.drain_timeout_ms);
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
    if let Some(wait) = readiness {
        wait.abort();
    }
    if let Some(message) = fatal.lock().unwrap_or_else(|e| e.into_inner()).take() {
        // The background tasks stop, and Raft shuts down, in `serve` before this is seen.
        return Err(anyhow::anyhow!("the Raft coordinator stopped: {message}"));
    }
    served
}

/// How often readiness is looked at besides on every view change (the Raft group's members
/// are not part of the view).
const READINESS_POLL: Duration = Duration::from_millis(100);

/// Turns `ready` on once the coordinator waits for nothing more ([`Coordinator::readiness`]),
/// unless shutdown began first. Each change in what it waits for is logged.
async fn become_ready(
    coordinator: Arc<Coordinator>,
    ready: Arc<AtomicBool>,
    draining: Arc<std::sync::Mutex<bool>>,
) {
    let mut view = coordinator.subscribe();
    let mut told = String::new();
    loop {
        let awaited = coordinator.readiness();
        if awaited.is_empty() {
            let draining = draining.lock().unwrap_or_else(|e| e.into_inner());
            if !*draining {
                ready.store(true, Ordering::Relaxed);
            }
            return;
        }
        let waiting_for = readiness::describe(&awaited);
        if waiting_for != told {
            tracing::info!(waiting_for = %waiting_for, "Not ready yet.");
            told = waiting_for;
        }
        tokio::select! {
            changed = view.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = tokio::time::sleep(READINESS_POLL) => {}
        }
    }
}

/// Keeps the replicated view fresh (on every applied entry) and runs the leader's rounds.
async fn replicated_loops(
    r: Arc<Replicated>,
    rebalance_interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut applied = r.subscribe_applied();
    r.rebuild_view();
    let leader = {
        let r = r.clone();
        let mut shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(rebalance_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = shutdown.changed() => break,
                    _ = tick.tick() => r.leader_round().await,
                }
            }
        })
    };
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            changed = applied.changed() => {
                if changed.is_err() {
                    break;
                }
                r.rebuild_view();
            }
        }
    }
    let _ = leader.await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RedisConfig;

    #[test]
    fn the_pending_timer_ends_before_any_request_timeout() {
        let mut cfg = Config::default();
        // Embedded store: the forward timeout (500 ms) is the shortest; capped at 100 ms.
        assert_eq!(pending_timer_period(&cfg), Duration::from_millis(100));
        cfg.redis = Some(RedisConfig {
            url: "redis://127.0.0.1:1".into(),
            timeout_ms: 50,
            ..RedisConfig::default()
        });
        assert_eq!(pending_timer_period(&cfg), Duration::from_millis(25));
        cfg.api.request_timeout_ms = 1;
        assert_eq!(
            pending_timer_period(&cfg),
            Duration::from_millis(1),
            "never zero"
        );
    }
}
