//! Metrics and logs. Every metric name is a constant here so dashboards and alerts have one
//! place to look. Labels are policy name, region and outcome only: never a tenant (unbounded
//! cardinality, and identifiers must not leak).

use std::collections::HashMap;
use std::sync::{OnceLock, RwLock};
use std::time::Duration;

use anyhow::Context as _;
use metrics::{Counter, Gauge, Histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use quota_core::{PolicyName, RegionId};
use tokio::sync::watch;

use crate::config::{LogFormat, TelemetryConfig};

/// Decisions made, by policy, region and outcome (`degraded_*` outcomes count degraded mode).
pub const DECISIONS_TOTAL: &str = "quotad_decisions_total";
/// Latency of one regional store call, in seconds.
pub const STORE_LATENCY_SECONDS: &str = "quotad_store_latency_seconds";
/// Store calls that failed (errors, timeouts, script errors), by kind.
pub const STORE_ERRORS_TOTAL: &str = "quotad_store_errors_total";
/// 1 while the circuit breaker around the regional store is open (degraded mode).
pub const DEGRADED: &str = "quotad_degraded";
/// Checks of a shadow policy that would have been denied (admitted), by policy and region.
pub const SHADOW_DENIALS_TOTAL: &str = "quotad_shadow_denials_total";
/// Retry-After handed out on denials, in seconds.
pub const RETRY_AFTER_SECONDS: &str = "quotad_retry_after_seconds";
/// Milliseconds left on this region's lease.
pub const LEASE_REMAINING_MS: &str = "quotad_lease_remaining_ms";
/// Time one rebalance round took, in seconds.
pub const REBALANCE_DURATION_SECONDS: &str = "quotad_rebalance_duration_seconds";
/// Checks forwarded to a pinned tenant's home region, by outcome.
pub const FORWARDED_TOTAL: &str = "quotad_forwarded_checks_total";
/// Checks answered by a denial still standing, without a store call.
pub const DENIAL_CACHE_HITS_TOTAL: &str = "quotad_denial_cache_hits_total";
/// Checks that asked the store for a bucket whose standing denial ran out, while the other
/// checks of that bucket waited for their answer.
pub const DENIAL_CACHE_PROBES_TOTAL: &str = "quotad_denial_cache_probes_total";
/// Checks admitted from a reservation, without a store call.
pub const RESERVATION_HITS_TOTAL: &str = "quotad_reservation_hits_total";
/// Store calls that took a batch of tokens for a reservation.
pub const RESERVATION_BATCHES_TOTAL: &str = "quotad_reservation_batches_total";
/// Requests answered with a problem (HTTP) or refused as malformed (Envoy), by `code`: the
/// problem code, `ENVOY_INVALID_ARGUMENT` (a request) or `ENVOY_INVALID_DESCRIPTOR` (one descriptor).
pub const REJECTED_REQUESTS_TOTAL: &str = "quotad_rejected_requests_total";
/// Re-readings of `redis.password_file` that found a new password, by outcome (`taken`,
/// `refused`, `unreachable`) and unreadable files (`unreadable`).
pub const REDIS_PASSWORD_RELOADS_TOTAL: &str = "quotad_redis_password_reloads_total";
/// Envoy rate limit descriptors answered `OK` without a decision, by reason (`no_tenant`: no
/// tenant entry; `unknown_policy`: no such policy for the tenant; `concurrency_limit`: a
/// concurrency limit, taken with holds; for a reading, `hits_addend`
/// 0: `pinned_elsewhere`, `store_unavailable`), as Envoy's convention asks.
pub const ENVOY_UNDECIDED_DESCRIPTORS_TOTAL: &str = "quotad_envoy_undecided_descriptors_total";
/// Charges of work already done (`POST /v1/charges`, Envoy descriptors of a policy charged
/// after the fact), by `outcome` (`applied`, `clamped`: the debt limit held part of it back,
/// `home_unreachable`: the budget lives in another region, which did not answer, `refused`: a
/// sliding window, `unavailable`: the store did not answer). Nothing is applied but for the
/// first two.
pub const CHARGES_TOTAL: &str = "quotad_charges_total";
/// Tokens of charges the debt limit held back (work done that the bucket did not pay for).
pub const CHARGE_CLAMPED_TOKENS_TOTAL: &str = "quotad_charge_clamped_tokens_total";
/// Refunds (tokens given back to a bucket, Envoy's `is_negative_hits`), by `outcome`
/// (`applied`, `full`: nothing to give back to, `elsewhere`: the budget lives in another
/// region, `unavailable`: the store did not answer).
pub const REFUNDS_TOTAL: &str = "quotad_refunds_total";
/// Holds asked of this daemon, by `outcome` (`held`, `denied`, `relayed`: made in the home
/// region the budget lives in, `refused`: the key names another hold, `home_unreachable`,
/// `unavailable`: the store did not answer). Nothing is held but for `held` (and `relayed`
/// ones the home held).
pub const HOLDS_TOTAL: &str = "quotad_holds_total";
/// Settles and releases of holds, by `outcome` (`settled`, `released`, `replayed`: the same
/// settle or release again, `expired`, `unknown`, `conflict`, `relayed`: to the hold's region,
/// `region_unreachable`, `unavailable`). Only the first two change anything.
pub const HOLD_SETTLEMENTS_TOTAL: &str = "quotad_hold_settlements_total";
/// Envoy RLQS streams open on this daemon.
pub const RLQS_STREAMS: &str = "quotad_rlqs_streams";
/// Entries this daemon keeps for RLQS: a stream's bucket of a budget, held until its assignment
/// expires after the stream ended.
pub const RLQS_BUCKETS: &str = "quotad_rlqs_buckets";
/// RLQS assignments sent, by `strategy` (`token_bucket`, `allow_all`, `deny_all`).
pub const RLQS_ASSIGNMENTS_TOTAL: &str = "quotad_rlqs_assignments_total";
/// RLQS reports refused, by `reason` (`no_buckets`, `empty_bucket_id`, `too_many_buckets`; the
/// stream ended with `INVALID_ARGUMENT`), and bucket ids denied as malformed (`bad_tenant`,
/// `bad_policy`, `repeated_key`, `bad_identity`, `no_identity_key`).
pub const RLQS_REJECTED_REPORTS_TOTAL: &str = "quotad_rlqs_rejected_reports_total";
/// The coordinator epoch this region has seen committed.
pub const COMMITTED_EPOCH: &str = "quotad_committed_epoch";
/// The last epoch this region's store enforces (or is bounded by, while unreachable); it
/// trails `quotad_committed_epoch` for one agent pass after each change.
pub const APPLIED_EPOCH: &str = "quotad_applied_epoch";
/// Bucket parameter writes to the regional store by the agent, by outcome (`ok`, `failed`).
pub const SHARE_WRITES_TOTAL: &str = "quotad_share_writes_total";
/// Usage reports by outcome (`delivered`, `undelivered`: the leader was not reached,
/// `uncollected`: the store did not answer). Multi-region only.
pub const USAGE_REPORTS_TOTAL: &str = "quotad_usage_reports_total";
/// Lease renewals through the log by outcome (`ok`, `failed`). Multi-region only.
pub const LEASE_RENEWALS_TOTAL: &str = "quotad_lease_renewals_total";
/// 1 while this daemon holds its region's agent role (it writes the region's store and
/// reports its usage), 0 while it stands by. Multi-region only.
pub const AGENT_HOLDER: &str = "quotad_agent_holder";
/// Times this daemon took its region's agent role (at start, or from a holder that stopped or
/// went quiet). Multi-region only.
pub const AGENT_TAKEOVERS_TOTAL: &str = "quotad_agent_takeovers_total";
/// Parameter writes the store refused by their fence: this daemon had been deposed, or an
/// older allocation's write landed late. Nothing was written.
pub const FENCED_WRITES_TOTAL: &str = "quotad_fenced_writes_total";
/// Usage records standbys handed to their region's agent (`sent`, `refused` on the standby;
/// `dropped` on an agent holding too many): checks they forwarded and denials from their
/// cache, which only they know. Multi-region only.
pub const STANDBY_USAGE_TOTAL: &str = "quotad_standby_usage_records_total";
/// Audited requests (mutations and token reloads), by `action` (e.g. `policy.put`,
/// `tokens.reload`) and `outcome` (`ok`, `rejected`, `unauthorized`, `forbidden`, `failed`,
/// `kept`: a tokens file that did not parse).
pub const ADMIN_REQUESTS_TOTAL: &str = "quotad_admin_requests_total";
/// Time to decide one check in the HTTP handler, in seconds.
pub const CHECK_DURATION_SECONDS: &str = "quotad_check_duration_seconds";
/// 1 while the regional Redis may evict keys (a `maxmemory-policy` other than `noeviction`
/// under a memory limit), else 0; absent until read, and for the embedded store.
pub const REDIS_MAY_EVICT: &str = "quotad_redis_may_evict";
/// Keys the regional Redis evicted since it started (`INFO stats` `evicted_keys`; summed over
/// a Cluster's masters).
pub const REDIS_EVICTED_KEYS_TOTAL: &str = "quotad_redis_evicted_keys_total";
/// This region's enforced share averaged over every policy it holds, 0 to 1 (summed over
/// regions, at most 1), every [`METRICS_UPKEEP_INTERVAL`].
pub const SHARE_MEAN: &str = "quotad_share_mean";
/// The allowance's `worst_case_overshoot_tokens` summed over every policy: what this region
/// could admit beyond the budgets if it were cut off, or lost its Redis, now.
pub const WORST_CASE_OVERSHOOT_TOKENS: &str = "quotad_worst_case_overshoot_tokens";

/// Latency buckets in seconds, set explicitly so Prometheus gets histograms, not summaries.
const LATENCY_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5,
];
const RETRY_AFTER_BUCKETS: &[f64] = &[0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0];

/// Installs the global Prometheus recorder and returns the handle `/metrics` renders.
pub fn install_metrics() -> anyhow::Result<PrometheusHandle> {
    let handle = metrics_builder()?
        .install_recorder()
        .context("installing the Prometheus metrics recorder")?;
    // Alerting rules watch these codes: from 0, so the first one shows in `increase()`.
    for code in ["UNAUTHORIZED", "FORBIDDEN", "INTERNAL"] {
        metrics::counter!(REJECTED_REQUESTS_TOTAL, "code" => code).absolute(0);
    }
    Ok(handle)
}

/// The exporter configuration: explicit buckets for every histogram.
pub fn metrics_builder() -> anyhow::Result<PrometheusBuilder> {
    let b = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(STORE_LATENCY_SECONDS.into()), LATENCY_BUCKETS)?
        .set_buckets_for_metric(
            Matcher::Full(CHECK_DURATION_SECONDS.into()),
            LATENCY_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full(REBALANCE_DURATION_SECONDS.into()),
            LATENCY_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full(RETRY_AFTER_SECONDS.into()),
            RETRY_AFTER_BUCKETS,
        )?;
    Ok(b)
}

/// How often histogram samples are folded into their buckets. The recorder queues every sample
/// until then; without this, nothing but a scrape of /metrics would, and an unscraped daemon's
/// queues would grow without bound.
pub const METRICS_UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Runs the recorder's upkeep every [`METRICS_UPKEEP_INTERVAL`] until `shutdown` fires.
pub async fn run_metrics_upkeep(handle: PrometheusHandle, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(METRICS_UPKEEP_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            _ = tick.tick() => handle.run_upkeep(),
        }
    }
}

/// Sets up `tracing` with text or JSON lines on stderr.
pub fn init_tracing(cfg: &TelemetryConfig) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(&cfg.log_level)
        .with_context(|| format!("parsing log level {:?}", cfg.log_level))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match cfg.log_format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.try_init(),
    };
    result.map_err(|e| anyhow::anyhow!("installing the log subscriber: {e}"))
}

/// How a decision came out, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Allowed,
    Denied,
    /// Admitted without a store because the policy fails open.
    DegradedOpen,
    /// Decided by the in-process bucket because the regional store is down.
    DegradedLocal,
    /// Refused with 503 because the policy fails closed.
    DegradedClosed,
    Forwarded,
}

impl Outcome {
    const ALL: [Outcome; 6] = [
        Outcome::Allowed,
        Outcome::Denied,
        Outcome::DegradedOpen,
        Outcome::DegradedLocal,
        Outcome::DegradedClosed,
        Outcome::Forwarded,
    ];

    fn label(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Denied => "denied",
            Outcome::DegradedOpen => "degraded_open",
            Outcome::DegradedLocal => "degraded_local",
            Outcome::DegradedClosed => "degraded_closed",
            Outcome::Forwarded => "forwarded",
        }
    }

    fn index(self) -> usize {
        Outcome::ALL.iter().position(|o| *o == self).unwrap_or(0)
    }
}

/// Metric handles cached per policy name, so the hot path does one read-locked lookup instead of
/// building label sets per request.
#[derive(Debug)]
pub struct DecisionMetrics {
    region: String,
    by_policy: RwLock<HashMap<PolicyName, PolicyHandles>>,
}

#[derive(Debug)]
struct PolicyHandles {
    decisions: [Counter; 6],
    check_duration: Histogram,
    /// Registered on the policy's first denial, so allow-only policies export no empty series.
    retry_after: OnceLock<Histogram>,
    /// Registered on the policy's first shadow denial.
    shadow_denials: OnceLock<Counter>,
}

impl DecisionMetrics {
    pub fn new(region: &str) -> Self {
        Self {
            region: region.to_string(),
            by_policy: RwLock::new(HashMap::new()),
        }
    }

    /// Counts one decision and its duration.
    pub fn record(&self, policy: &PolicyName, outcome: Outcome, seconds: f64) {
        self.with(policy, |h| {
            h.decisions[outcome.index()].increment(1);
            h.check_duration.record(seconds);
        });
    }

    /// Records the Retry-After handed out on a denial.
    pub fn record_retry_after(&self, policy: &PolicyName, seconds: f64) {
        self.with(policy, |h| {
            h.retry_after
                .get_or_init(|| {
                    metrics::histogram!(RETRY_AFTER_SECONDS, "policy" => policy.as_str().to_string())
                })
                .record(seconds);
        });
    }

    /// Counts a shadow policy's would-be denial.
    pub fn record_shadow_denial(&self, policy: &PolicyName) {
        let region = self.region.clone();
        self.with(policy, |h| {
            h.shadow_denials
                .get_or_init(|| {
                    metrics::counter!(SHADOW_DENIALS_TOTAL, "policy" => policy.as_str().to_string(), "region" => region)
                })
                .increment(1);
        });
    }

    /// Runs `f` on the policy's handles, registering them on first use.
    fn with(&self, policy: &PolicyName, f: impl FnOnce(&PolicyHandles)) {
        {
            let map = self.by_policy.read().unwrap_or_else(|e| e.into_inner());
            if let Some(h) = map.get(policy) {
                f(h);
                return;
            }
        }
        let name = policy.as_str().to_string();
        let region = &self.region;
        let h = PolicyHandles {
            decisions: Outcome::ALL.map(|o| {
                metrics::counter!(DECISIONS_TOTAL, "policy" => name.clone(), "region" => region.clone(), "outcome" => o.label())
            }),
            check_duration: metrics::histogram!(CHECK_DURATION_SECONDS, "policy" => name.clone(), "region" => region.clone()),
            retry_after: OnceLock::new(),
            shadow_denials: OnceLock::new(),
        };
        f(&h);
        self.by_policy
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(policy.clone(), h);
    }

    /// The region label value.
    pub fn region(&self) -> &str {
        &self.region
    }
}

/// The region agent's apply loop's metrics (labelled by region only).
#[derive(Debug, Clone)]
pub struct AgentMetrics {
    pub committed_epoch: Gauge,
    pub applied_epoch: Gauge,
    /// 1 while this daemon holds the agent role (multi-region).
    pub holder: Gauge,
    writes_ok: Counter,
    writes_failed: Counter,
    writes_fenced: Counter,
}

impl AgentMetrics {
    pub fn new(region: &RegionId) -> Self {
        let region = region.as_str().to_string();
        Self {
            committed_epoch: metrics::gauge!(COMMITTED_EPOCH, "region" => region.clone()),
            applied_epoch: metrics::gauge!(APPLIED_EPOCH, "region" => region.clone()),
            writes_ok: metrics::counter!(SHARE_WRITES_TOTAL, "region" => region.clone(), "outcome" => "ok"),
            writes_failed: metrics::counter!(SHARE_WRITES_TOTAL, "region" => region.clone(), "outcome" => "failed"),
            holder: metrics::gauge!(AGENT_HOLDER, "region" => region.clone()),
            writes_fenced: metrics::counter!(FENCED_WRITES_TOTAL, "region" => region),
        }
    }

    pub fn share_writes(&self, o: WriteOutcomes) {
        self.writes_ok.increment(o.ok);
        self.writes_failed.increment(o.failed);
        self.writes_fenced.increment(o.fenced);
    }
}

/// The report loop's metrics (multi-region only), every outcome registered at 0 from the start:
/// a counter that first appears at 1 hides that first event from `rate()` and `increase()`.
#[derive(Debug, Clone)]
pub struct ReportMetrics {
    reports: [Counter; 3],
    renewals_ok: Counter,
    renewals_failed: Counter,
}

/// How a usage report ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reported {
    Delivered,
    /// The leader was not reached.
    Undelivered,
    /// The store did not answer.
    Uncollected,
}

impl ReportMetrics {
    pub fn new(region: &RegionId) -> Self {
        let region = region.as_str().to_string();
        Self {
            reports: ["delivered", "undelivered", "uncollected"].map(|o| {
                metrics::counter!(USAGE_REPORTS_TOTAL, "region" => region.clone(), "outcome" => o)
            }),
            renewals_ok: metrics::counter!(LEASE_RENEWALS_TOTAL, "region" => region.clone(), "outcome" => "ok"),
            renewals_failed: metrics::counter!(LEASE_RENEWALS_TOTAL, "region" => region, "outcome" => "failed"),
        }
    }

    pub fn usage_report(&self, r: Reported) {
        self.reports[r as usize].increment(1);
    }

    pub fn lease_renewal(&self, ok: bool) {
        if ok {
            self.renewals_ok.increment(1);
        } else {
            self.renewals_failed.increment(1);
        }
    }
}

/// Parameter writes of one pass, by how they ended (those never started are in neither).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteOutcomes {
    pub ok: u64,
    /// Failed writes, the fenced ones included.
    pub failed: u64,
    /// Writes the store refused by their fence.
    pub fenced: u64,
    /// Successful writes that changed parameters (not only renewed a lease end).
    pub changed: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_render_as_histograms_without_tenants() {
        let recorder = metrics_builder().unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let m = DecisionMetrics::new("eu");
            let p = PolicyName::new("writes").unwrap();
            m.record(&p, Outcome::Allowed, 0.0002);
            m.record(&p, Outcome::Denied, 0.0003);
        });
        let text = handle.render();
        assert!(
            text.contains("quotad_check_duration_seconds_bucket"),
            "{text}"
        );
        assert!(text.contains(
            "quotad_decisions_total{policy=\"writes\",region=\"eu\",outcome=\"allowed\"} 1"
        ));
        assert!(!text.contains("quantile"), "{text}");
    }
}
