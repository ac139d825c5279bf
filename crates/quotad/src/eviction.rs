//! Whether the regional Redis may evict quotad's keys. The scripts read a missing bucket state
//! as a full bucket, which is safe for expiry (the idle TTL covers a full refill) but not for
//! eviction: under memory pressure a Redis with an evicting `maxmemory-policy` (`allkeys-*`, or
//! `volatile-*`, since every bucket state has a TTL) drops spent buckets, which then admit their
//! burst again, and an evicted parameters key drops this region to the fallback limit. quotad
//! needs `noeviction`.
//!
//! Every report interval this reads `INFO memory` and `INFO stats`, exports
//! [`telemetry::REDIS_MAY_EVICT`] and [`telemetry::REDIS_EVICTED_KEYS_TOTAL`] (alert rules
//! `QuotadRedisMayEvict`, `QuotadRedisEvictedKeys`) and logs a warning whenever the policy read
//! changes to one that may evict. Decisions go on either way: a limiter that refused to serve
//! over a Redis setting would be the outage. A managed Redis that refuses `INFO` is logged once,
//! and then the operator must check the setting by hand (docs/operations.md).

use std::time::Duration;

use quota_store::AnyStore;
use tokio::sync::watch;

use crate::telemetry;

/// Watches `store` every `every` until `shutdown`; nothing for the embedded store.
pub async fn run(
    store: AnyStore,
    every: Duration,
    region: String,
    mut shutdown: watch::Receiver<bool>,
) {
    let may_evict = metrics::gauge!(telemetry::REDIS_MAY_EVICT, "region" => region.clone());
    let evicted =
        metrics::counter!(telemetry::REDIS_EVICTED_KEYS_TOTAL, "region" => region.clone());
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The last policy logged (None: not read yet or unreadable), so each is logged once.
    let mut logged: Option<(String, bool)> = None;
    let mut unreadable_logged = false;
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tick.tick() => {}
        }
        let e = match store.eviction().await {
            None => return,
            Some(Ok(e)) => e,
            Some(Err(err)) => {
                if err.is_outage() {
                    continue; // Redis down: the breaker and its metrics say so.
                }
                if !unreadable_logged {
                    unreadable_logged = true;
                    tracing::warn!(region = %region, error = %err,
                        "Cannot read Redis's maxmemory-policy (INFO refused): make sure it is noeviction, or evicted buckets come back full.");
                }
                continue;
            }
        };
        unreadable_logged = false;
        may_evict.set(if e.may_evict() { 1.0 } else { 0.0 });
        // `evicted_keys` is the server's own counter: a restarted server starts again from 0,
        // as a Prometheus counter may.
        evicted.absolute(e.evicted_keys);
        let now = (e.policy.clone(), e.may_evict());
        if logged.as_ref() != Some(&now) {
            if e.may_evict() {
                tracing::warn!(region = %region, policy = %e.policy, maxmemory_bytes = e.maxmemory_bytes,
                    "Redis may evict quotad's keys: an evicted bucket comes back full and admits its burst again. Set maxmemory-policy noeviction.");
            } else {
                tracing::info!(region = %region, policy = %e.policy, maxmemory_bytes = e.maxmemory_bytes,
                    "Redis does not evict keys.");
            }
            logged = Some(now);
        }
    }
}
