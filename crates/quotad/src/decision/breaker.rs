//! A circuit breaker around the regional store: after `failure_threshold` consecutive failures
//! (errors, or calls slower than `slow_call_ms`) it opens and decisions go to each policy's fail
//! mode without waiting on a sick Redis; after `open_ms` one probe call is let through, and a
//! success closes it again. Recovery is automatic.
//!
//! Fault: a request future dropped while its call is in flight (the client gone, an HTTP/2
//! stream reset, Envoy cancelling at its timeout) never reports an outcome. Every call holds a
//! [`Permit`] whose drop ends an unreported probe, so the next call probes at once instead of
//! the breaker staying half-open for ever.
//!
//! The state sits under a `std::sync::Mutex` touched for a few instructions per call and never
//! across an await.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::clock;
use crate::config::BreakerConfig;
use crate::telemetry;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// One probe is in flight; everyone else keeps using the fail mode.
    HalfOpen,
}

/// Leave to call the store once: report the outcome with [`Permit::record`]. Dropped without a
/// report (the caller went away mid-call), a probe's permit reopens the breaker with its wait
/// already over, so the next call probes.
#[derive(Debug)]
#[must_use = "a permit reports the call's outcome"]
pub struct Permit<'a> {
    breaker: &'a Breaker,
    /// The one call of the half-open state.
    probe: bool,
}

impl Permit<'_> {
    /// Reports the call's outcome: `ok` is false for an error; a slow success also counts
    /// against the store.
    pub fn record(self, ok: bool, took: Duration) {
        self.breaker.record(ok, took);
        std::mem::forget(self);
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.probe {
            self.breaker.update(|s| match s {
                State::HalfOpen => State::Open {
                    until: clock::monotonic(),
                },
                other => other,
            });
        }
    }
}

/// The breaker itself.
#[derive(Debug)]
pub struct Breaker {
    state: Mutex<State>,
    threshold: u32,
    slow: Duration,
    open_for: Duration,
    region: String,
    /// Whether it is open, for tasks that wait for the store to come back.
    open: watch::Sender<bool>,
}

impl Breaker {
    pub fn new(cfg: &BreakerConfig, region: &str) -> Self {
        // Exported from the start: a series that appears only when it turns 1 leaves
        // dashboards and `absent()`-style checks blind while all is well.
        metrics::gauge!(telemetry::DEGRADED, "region" => region.to_string()).set(0.0);
        Self {
            state: Mutex::new(State::Closed { failures: 0 }),
            threshold: cfg.failure_threshold.max(1),
            slow: Duration::from_millis(cfg.slow_call_ms),
            open_for: Duration::from_millis(cfg.open_ms),
            region: region.to_string(),
            open: watch::Sender::new(false),
        }
    }

    /// Leave to call the store now, or `None` while it is considered down (use the fail mode).
    pub fn admit(&self) -> Option<Permit<'_>> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let probe = match *s {
            State::Closed { .. } => false,
            State::Open { until } if clock::monotonic() >= until => {
                *s = State::HalfOpen;
                true
            }
            State::Open { .. } | State::HalfOpen => return None,
        };
        Some(Permit {
            breaker: self,
            probe,
        })
    }

    fn record(&self, ok: bool, took: Duration) {
        let failed = !ok || took > self.slow;
        self.update(|s| match (s, failed) {
            (_, false) => State::Closed { failures: 0 },
            (State::Closed { failures }, true) if failures + 1 < self.threshold => State::Closed {
                failures: failures + 1,
            },
            (_, true) => State::Open {
                until: clock::monotonic() + self.open_for,
            },
        });
    }

    /// Opens the breaker now, as `failure_threshold` failures would: for a store known to be
    /// down before any decision has tried it (Redis unreachable at start), so the first checks
    /// go to their fail modes at once instead of each waiting out a call.
    pub fn trip(&self) {
        self.update(|_| State::Open {
            until: clock::monotonic() + self.open_for,
        });
    }

    /// Moves to the state `next` gives, telling metrics and logs when it opens or closes.
    fn update(&self, next: impl FnOnce(State) -> State) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let before_open = !matches!(*s, State::Closed { .. });
        *s = next(*s);
        let now_open = !matches!(*s, State::Closed { .. });
        if before_open != now_open {
            // Under the lock: watchers see the transitions in order.
            self.open.send_replace(now_open);
        }
        drop(s);
        if before_open != now_open {
            metrics::gauge!(telemetry::DEGRADED, "region" => self.region.clone())
                .set(if now_open { 1.0 } else { 0.0 });
            if now_open {
                tracing::warn!(region = %self.region, "Regional store failing: circuit breaker open, using fail modes.");
            } else {
                tracing::info!(region = %self.region, "Regional store recovered: circuit breaker closed.");
            }
        }
    }

    /// Follows whether it is open (true) or closed.
    pub fn watch_open(&self) -> watch::Receiver<bool> {
        self.open.subscribe()
    }

    /// True while decisions bypass the store.
    pub fn is_open(&self) -> bool {
        !matches!(
            *self.state.lock().unwrap_or_else(|e| e.into_inner()),
            State::Closed { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> Breaker {
        Breaker::new(
            &BreakerConfig {
                failure_threshold: 3,
                slow_call_ms: 10,
                open_ms: 100,
            },
            "eu",
        )
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_consecutive_failures_and_recovers_through_one_probe() {
        let b = breaker();
        let fast = Duration::from_millis(1);
        b.record(false, fast);
        b.record(false, fast);
        let permit = b.admit().expect("closed");
        permit.record(false, fast);
        assert!(b.is_open());
        assert!(b.admit().is_none());
        tokio::time::advance(Duration::from_millis(101)).await;
        let probe = b.admit().expect("one probe");
        assert!(b.admit().is_none(), "only one probe at a time");
        probe.record(true, fast);
        assert!(!b.is_open());
        assert!(b.admit().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn slow_calls_count_as_failures_and_a_failed_probe_reopens() {
        let b = breaker();
        let slow = Duration::from_millis(50);
        for _ in 0..3 {
            b.record(true, slow);
        }
        assert!(b.is_open());
        tokio::time::advance(Duration::from_millis(101)).await;
        b.admit().expect("a probe").record(false, Duration::ZERO);
        assert!(b.admit().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_success_resets_the_failure_count() {
        let b = breaker();
        b.record(false, Duration::ZERO);
        b.record(false, Duration::ZERO);
        b.record(true, Duration::ZERO);
        b.record(false, Duration::ZERO);
        b.record(false, Duration::ZERO);
        assert!(!b.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn a_tripped_breaker_is_open_at_once_and_recovers_through_a_probe() {
        let b = breaker();
        b.trip();
        assert!(b.is_open());
        assert!(b.admit().is_none());
        tokio::time::advance(Duration::from_millis(99)).await;
        assert!(b.admit().is_none(), "open for open_ms");
        tokio::time::advance(Duration::from_millis(2)).await;
        b.admit()
            .expect("then one probe")
            .record(true, Duration::ZERO);
        assert!(!b.is_open());
    }

    /// Regression: a probe whose request future was dropped mid-call (a client that hung up,
    /// Envoy cancelling at its timeout) left the breaker half-open, answering every later check
    /// from the fail mode until restart.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_probe_lets_the_next_call_probe_at_once() {
        let b = breaker();
        b.trip();
        tokio::time::advance(Duration::from_millis(101)).await;
        let probe = b.admit().expect("a probe");
        assert!(b.admit().is_none(), "one probe at a time");
        drop(probe);
        assert!(b.is_open(), "a dropped probe proves nothing");
        b.admit()
            .expect("the next call probes without waiting open_ms again")
            .record(true, Duration::ZERO);
        assert!(!b.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_call_while_closed_changes_nothing() {
        let b = breaker();
        b.record(false, Duration::ZERO);
        b.record(false, Duration::ZERO);
        drop(b.admit().expect("closed"));
        assert!(!b.is_open());
        b.admit().expect("closed").record(false, Duration::ZERO);
        assert!(
            b.is_open(),
            "the dropped call neither counted nor reset the failures"
        );
    }
}
