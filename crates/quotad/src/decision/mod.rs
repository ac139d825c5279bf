//! The decision path: policy lookup, cost check, pin forwarding, this region's enforced share,
//! one store call behind the circuit breaker, and the policy's fail mode when the store is down.
//!
//! Nothing here holds a lock across an await: the view is an `Arc` snapshot, the breaker and
//! the in-process buckets use short synchronous critical sections.
//!
//! ```text
//!  check: resolve the policy, check the cost, then
//!    ├─> pinned elsewhere ─> forward to the home ──(no answer)─> this region's floor, in process
//!    ├─> share here too small ─> forward to the region granted the most
//!    └─> here: denial cache, reservations, store through the breaker ──(store out)─> fail mode
//! ```
//!
//! # Layout
//! - `mod.rs` (this file): [`Decider`], what it is built from ([`DeciderParts`]) and what it
//!   lets callers read (its region, store, view, a policy's limit here).
//! - `verdict`: what a decision answers ([`Verdict`], [`Mode`], [`CheckError`]) and how it is
//!   counted.
//! - `check`: [`Decider::check`], one check routed to its home, to the region granted the
//!   most, or decided here.
//! - `local`: deciding here: the store through the breaker, the denial cache and the reserved
//!   tokens, and reading a bucket without spending.
//! - `forward`: checks decided in another region, one at a time or a home's batch in one
//!   request, and the floor here when the home does not answer.
//! - `fail_mode`: the policy's fail mode while this region's store is out.
//! - `charge`: charges of work already done, into the policy's debt limit.
//! - `refund`: tokens given back to a bucket (Envoy's `is_negative_hits`).
//! - [`holds`]: estimates held now and settled with the actual cost later, and concurrency
//!   slots.
//! - [`outage`]: the `local` fail mode's in-process buckets, continued from Redis's last
//!   answers and charged back to it; the store as decisions see it ([`outage::Regional`]).
//! - [`breaker`], [`denials`], [`reservations`]: the state the local path keeps; [`multi`]:
//!   checks of several limits at once.
//! - [`envoy_holdings`]: the parts of this region's shares Envoys hold over RLQS.
//! - [`exposure`]: what this region could admit beyond a budget if cut off or without Redis.

pub mod breaker;
mod charge;
mod check;
pub mod denials;
pub mod envoy_holdings;
pub mod exposure;
mod fail_mode;
mod forward;
pub mod holds;
mod local;
pub mod multi;
pub mod outage;
mod refund;
pub mod reservations;
#[cfg(test)]
pub(crate) mod tests;
mod verdict;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{Counter, Histogram};
use quota_core::share::limit_for_share;
use quota_core::{Policy, PolicyName, RegionId, TenantId};
use quota_store::{AnyStore, BucketRef, EmbeddedStore, Limit};
use tokio::sync::watch;

use crate::clock;
use crate::coordination::{ClusterView, PolicyEntry};
use crate::decision::breaker::Breaker;
use crate::decision::denials::{Denials, Unreported};
use crate::decision::envoy_holdings::EnvoyHoldings;
use crate::decision::outage::{InProcess, Outage, Regional};
use crate::decision::reservations::Reservations;
use crate::secret::Secret;
use crate::telemetry::{self, DecisionMetrics};
use quota_raft::tls::PeerHttp;

pub use charge::{Charged, CHARGES_PATH};
pub use forward::{FORWARDED_FROM_HEADER, FORWARDED_HEADER, PEER_FORWARD_PREFIX};
pub use refund::Refunded;
pub use verdict::{CheckError, Mode, Verdict};

/// True when the store decides in process (no Redis: nothing to break).
pub fn is_embedded(store: &AnyStore) -> bool {
    matches!(store, AnyStore::Embedded(_))
}

/// Decides checks for this region.
#[derive(Debug)]
pub struct Decider {
    region: RegionId,
    /// The regional store, remembering its answers for the `local` fail mode.
    store: Regional,
    /// The `local` fail mode's buckets, continued from the store's answers.
    fallback: InProcess,
    /// A pinned tenant's floor while its home does not answer.
    home_floor: EmbeddedStore,
    outage: Arc<Outage>,
    breaker: Arc<Breaker>,
    view: watch::Receiver<Arc<ClusterView>>,
    /// Where each region takes forwarded checks: its daemons' API addresses, or their peer
    /// addresses when `over_peer`.
    homes: HashMap<RegionId, Vec<String>>,
    /// Which of a home's daemons the next forwarded check tries first.
    next_home: std::sync::atomic::AtomicUsize,
    /// Plain HTTP to the API, or the peer mutual-TLS client (rebuilt on rotation).
    http: PeerHttp,
    /// Forwarded checks go over the peer TLS channel ([`PEER_FORWARD_PREFIX`]).
    over_peer: bool,
    forward_timeout: Duration,
    peer_token: Option<Secret>,
    pub metrics: DecisionMetrics,
    store_latency: Histogram,
    store_errors: Counter,
    forward_failures: Counter,
    /// Tokens of checks this region sent elsewhere since the last report, by bucket: they are
    /// demand here (where the callers are), which is what lets share come back to a region
    /// that forwards because its share ran to 0.
    forwarded_usage: Mutex<HashMap<BucketRef, (u64, u64)>>,
    /// Token-bucket denials still standing: further checks of those buckets at that cost or
    /// more are answered without Redis until their retry time has passed.
    denials: Denials,
    /// Answer standing denials from `denials` (`redis.denial_cache`).
    denial_cache: bool,
    /// Tokens of checks the denial cache answered since the last report, by bucket: Redis
    /// never saw them, and they are demand all the same.
    cached_denied: Unreported,
    denial_cache_hits: Counter,
    denial_cache_probes: Counter,
    /// Hot token buckets' tokens taken from Redis in batches and handed out here; `None`
    /// when turned off (`redis.reservations = false`) or on the embedded store.
    reservations: Option<Reservations>,
    /// How long a check waits for another check's batch: the store's timeout.
    store_timeout: Duration,
    reservation_hits: Counter,
    reservation_batches: Counter,
    /// What Envoys enforcing assignments of this daemon (RLQS) hold of the region's shares.
    envoy_holdings: EnvoyHoldings,
}

/// What a [`Decider`] is built from.
#[derive(Debug)]
pub struct DeciderParts {
    pub region: RegionId,
    pub store: AnyStore,
    pub breaker: Breaker,
    pub view: watch::Receiver<Arc<ClusterView>>,
    /// Every region's daemons' API addresses (`host:port`), for forwarding pinned tenants;
    /// their peer addresses with [`Decider::forwarding_over_peer`].
    pub homes: HashMap<RegionId, Vec<String>>,
    pub forward_timeout: Duration,
    /// The peer token forwarded checks carry (multi-region only).
    pub peer_token: Option<Secret>,
    /// Take hot token buckets' tokens from Redis in batches (Redis store only).
    pub reservations: bool,
    /// The store's call timeout.
    pub store_timeout: Duration,
    /// The daemons of this region (its `[[regions]]` entries; 1 for a single region): what
    /// each decides in process (the `local` fail mode, a home's floor) is its part of the
    /// region's, so together they stay within the region's.
    pub daemons: u32,
}

impl Decider {
    pub fn new(p: DeciderParts) -> Self {
        let region = p.region.as_str().to_string();
        let outage = Arc::new(Outage::default());
        outage.share_among(u64::from(p.daemons.max(1)));
        charge::register_metrics(&p.region);
        holds::register_metrics(&p.region);
        Self {
            metrics: DecisionMetrics::new(&region),
            store_latency: metrics::histogram!(telemetry::STORE_LATENCY_SECONDS, "region" => region.clone()),
            store_errors: metrics::counter!(telemetry::STORE_ERRORS_TOTAL, "region" => region.clone()),
            forward_failures: metrics::counter!(telemetry::FORWARDED_TOTAL, "region" => region.clone(), "outcome" => "unreachable"),
            denial_cache_hits: metrics::counter!(telemetry::DENIAL_CACHE_HITS_TOTAL, "region" => region.clone()),
            denial_cache_probes: metrics::counter!(telemetry::DENIAL_CACHE_PROBES_TOTAL, "region" => region.clone()),
            reservation_hits: metrics::counter!(telemetry::RESERVATION_HITS_TOTAL, "region" => region.clone()),
            reservation_batches: metrics::counter!(telemetry::RESERVATION_BATCHES_TOTAL, "region" => region),
            reservations: (p.reservations && !is_embedded(&p.store)).then(Reservations::default),
            store_timeout: p.store_timeout,
            region: p.region,
            store: Regional::new(p.store, outage.clone()),
            fallback: InProcess::new(outage.clone()),
            home_floor: EmbeddedStore::new(),
            outage,
            breaker: Arc::new(p.breaker),
            view: p.view,
            homes: p.homes,
            next_home: Default::default(),
            http: PeerHttp::new(None, |b| b)
                .expect("a plain HTTP client builds without TLS configuration"),
            over_peer: false,
            forward_timeout: p.forward_timeout,
            peer_token: p.peer_token,
            forwarded_usage: Mutex::default(),
            denials: Denials::default(),
            denial_cache: true,
            cached_denied: Unreported::default(),
            envoy_holdings: EnvoyHoldings::default(),
        }
    }

    /// Asks the store about every check, remembering no denial (`redis.denial_cache = false`).
    pub fn without_denial_cache(mut self) -> Self {
        self.denial_cache = false;
        self
    }

    /// Forwards checks over the peer mutual-TLS channel with `http`, to the home's peer
    /// listener: `homes` must then hold peer addresses.
    pub fn forwarding_over_peer(mut self, http: PeerHttp) -> Self {
        self.http = http;
        self.over_peer = true;
        self
    }

    /// This daemon's region.
    pub fn region(&self) -> &RegionId {
        &self.region
    }

    /// The store decisions go to.
    pub fn store(&self) -> &AnyStore {
        &self.store
    }

    /// The in-process buckets used when the store is down.
    pub fn fallback(&self) -> &InProcess {
        &self.fallback
    }

    /// What the region knows of its buckets' levels and owes to Redis after an outage.
    pub fn outage(&self) -> &Outage {
        &self.outage
    }

    /// The breaker's state, for /v1/status.
    pub fn store_degraded(&self) -> bool {
        self.breaker.is_open()
    }

    /// The current coordinator view.
    pub fn view(&self) -> Arc<ClusterView> {
        self.view.borrow().clone()
    }

    /// What Envoys hold of this region's shares through this daemon (RLQS).
    pub fn envoy_holdings(&self) -> &EnvoyHoldings {
        &self.envoy_holdings
    }

    /// The daemons of this region: each decides in process, and assigns to Envoys, its part.
    pub fn daemons(&self) -> u64 {
        self.outage.daemons()
    }

    /// Whether what Envoys hold through this daemon fits `view`'s grants now: the region
    /// acknowledges `view`'s epoch only then.
    pub fn envoys_fit(&self, view: &ClusterView) -> bool {
        self.envoy_holdings
            .fits(view, &self.region, self.daemons(), clock::monotonic_ms())
    }

    /// This region's limit for a policy right now (lease or floor), with the enforced share.
    pub fn params_for(
        &self,
        view: &ClusterView,
        tenant: &TenantId,
        policy: &PolicyName,
    ) -> Option<(Policy, u32, Limit)> {
        Some(self.params_of(view, view.resolve(tenant, policy)?.entry))
    }

    fn params_of(&self, view: &ClusterView, entry: &PolicyEntry) -> (Policy, u32, Limit) {
        let share = view.enforced_share_ppm(entry.grants.get(&self.region), clock::monotonic_ms());
        (
            entry.policy.clone(),
            share,
            limit_for_share(&entry.policy, share).into(),
        )
    }
}
