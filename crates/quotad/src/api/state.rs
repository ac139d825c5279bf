//! What every handler shares. A leaf of the API: handlers import it, and it imports none of
//! them.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::coordination::Coordinator;
use crate::decision::Decider;
use crate::tokens::Tokens;

/// Everything handlers share, behind one `Arc`: axum clones the state for every request, and
/// one reference count costs less than one per field.
pub type AppState = Arc<AppShared>;

/// The fields of [`AppState`].
#[derive(Debug)]
pub struct AppShared {
    pub decider: Arc<Decider>,
    pub coordinator: Arc<Coordinator>,
    /// The bearer tokens in use (the admin token and `api.tokens_file`'s).
    pub tokens: Arc<Tokens>,
    /// Decisions without a token (`api.open_checks`).
    pub open_checks: bool,
    pub metrics: Option<PrometheusHandle>,
    /// False while starting and once shutdown began: /readyz answers 503.
    pub ready: Arc<AtomicBool>,
    pub drift_margin_ms: u64,
    pub body_limit_bytes: usize,
    pub request_timeout: Duration,
    /// The key checks' identities are hashed with (`QUOTAD_IDENTITY_KEY`); `None` refuses them.
    pub identity_key: Option<crate::secret::Secret>,
}
