//! Deciding here: one store call behind the circuit breaker (the embedded store has none),
//! answered without the store while a denial stands ([`super::denials`]) or from tokens this
//! region reserved in a batch ([`super::reservations`]); reading a bucket without spending;
//! and giving reserved tokens back.
//!
//! A refusal of one bucket's data is that bucket's fault, not an outage: it never counts
//! against the breaker. The store out leaves the check to the policy's fail mode.

use std::pin::Pin;

use quota_core::{Decision, Policy};
use quota_store::{AnyStore, BucketRef, CheckRequest, Limit, Store, StoreError, UsageRecord};
use tokio::sync::futures::OwnedNotified;

use super::denials::{Denials, Look, Ticket};
use super::reservations::{Refund, Reservations, Step};
use super::{is_embedded, CheckError, Decider, Mode, Verdict};
use crate::clock;

impl Decider {
    /// Drops every remembered denial: this region's agent wrote bucket parameters, which the
    /// store applies over the limits checks pass.
    pub fn forget_denials(&self) {
        self.denials.forget_all();
        // Reserved tokens were taken under the old parameters: they go back now.
        if let Some(r) = &self.reservations {
            self.give_back(r.take_all());
        }
    }

    /// The denied tokens of checks the denial cache answered since the last call, by bucket,
    /// for the usage report to add to what Redis counted.
    pub fn take_cached_denials(&self) -> Vec<UsageRecord> {
        self.cached_denied.take()
    }

    /// Puts back cached denials taken for a report that was not delivered, for the next one.
    pub fn restore_cached_denials(&self, records: Vec<UsageRecord>) {
        self.cached_denied.restore(records);
    }

    /// Gives reserved tokens back to the store, in the background.
    fn give_back(&self, refunds: Vec<Refund>) {
        if refunds.is_empty() {
            return;
        }
        let store = self.store.clone();
        tokio::spawn(async move { give_back_now(&store, refunds).await });
    }

    /// Gives back pools that aged out and forgets idle buckets (run every few tens of ms).
    pub fn sweep_reservations(&self) {
        if let Some(r) = &self.reservations {
            self.give_back(r.sweep(clock::monotonic()));
        }
    }

    /// Gives every reserved token back, waiting for the store (on shutdown).
    pub async fn return_reservations(&self) {
        if let Some(r) = &self.reservations {
            give_back_now(&self.store, r.take_all()).await;
        }
    }

    /// Whole tokens left in a bucket of this region, read without spending from the store
    /// that decides now (the in-process bucket while the breaker is open); `None` if the
    /// store cannot answer.
    pub async fn tokens_left(&self, bucket: BucketRef, limit: Limit) -> Option<u64> {
        self.peek(bucket, limit).await.map(|d| d.remaining)
    }

    /// A bucket of this region as a check of cost 0 sees it, spending nothing, read as
    /// [`Decider::tokens_left`] reads it; `None` if the store cannot answer.
    pub async fn peek(&self, bucket: BucketRef, limit: Limit) -> Option<Decision> {
        if let Limit::Concurrency { limit } = limit {
            // A concurrency limit's level is its free slots: only the store knows its holds.
            let held = self.store.in_flight(&bucket, None).await.ok()?;
            return Some(Decision {
                allowed: held < limit,
                remaining: limit.saturating_sub(held),
                retry_after_ms: None,
                reset_ms: None,
            });
        }
        let req = CheckRequest::peek(bucket, limit);
        // The store bounds every call with its own timeout.
        let r = if self.breaker.is_open() {
            self.fallback.check(&req).await
        } else {
            self.store.check(&req).await
        };
        // Tokens reserved here are this region's too, not yet handed out.
        let held = self
            .reservations
            .as_ref()
            .map_or(0, |r| r.held(&req.bucket));
        r.ok().map(|d| Decision {
            remaining: d.remaining.saturating_add(held),
            ..d
        })
    }

    pub(super) async fn decide_here(
        &self,
        bucket: BucketRef,
        limit: Limit,
        cost: u64,
        policy: Policy,
        ticket: Ticket,
    ) -> Result<Verdict, CheckError> {
        let req = CheckRequest {
            bucket,
            limit,
            cost,
            now_ms: None,
        };
        match self.ask_store(&req, ticket).await {
            Ok(Some(decision)) => Ok(self.verdict_here(decision, policy, Mode::Normal)),
            Ok(None) => self.fail_over(req, policy).await,
            Err(e) => {
                tracing::warn!(
                    region = %self.region,
                    policy = %req.bucket.policy,
                    error = %e,
                    "The store refused this bucket's data; other buckets are unaffected."
                );
                Err(CheckError::ReducedCapacity {
                    policy: req.bucket.policy,
                    reason: "the regional store refuses this policy's stored bucket",
                })
            }
        }
    }

    /// The store's decision, through the breaker (the embedded store has none): `Ok(None)`
    /// when the breaker is open or the store is out (the fail mode decides), `Err` when the
    /// store answered but refused this request or its bucket's data. A refusal is one bucket's
    /// fault, not an outage: it never counts against the breaker, so one tenant's bad data
    /// cannot degrade the region for the others.
    /// `ticket` was taken before the limit was read (see [`Decider::check`]).
    async fn ask_store(
        &self,
        req: &CheckRequest,
        ticket: Ticket,
    ) -> Result<Option<Decision>, StoreError> {
        if is_embedded(&self.store) {
            return match self.store.check(req).await {
                Ok(d) => Ok(Some(d)),
                Err(e) if !e.is_outage() => Err(e),
                Err(_) => Ok(None),
            };
        }
        let probe = match self.standing_denial(req).await {
            Ok(d) => {
                self.denial_cache_hits.increment(1);
                // Redis does not count this denial: the usage report adds it.
                self.cached_denied.count(&req.bucket, req.cost);
                return Ok(Some(d));
            }
            Err(probe) => probe,
        };
        let t0 = clock::monotonic();
        if let Some(r) = self.reservations.as_ref().filter(|_| req.cost > 0) {
            let mut refunds = Vec::new();
            let (step, taking) = r
                .begin(
                    &req.bucket,
                    &req.limit,
                    req.cost,
                    t0,
                    self.store_timeout,
                    &mut refunds,
                )
                .await;
            self.give_back(refunds);
            match step {
                Step::Answered(d) => {
                    self.reservation_hits.increment(1);
                    return Ok(Some(d));
                }
                Step::Take(batch) => {
                    // Ends the batch if this check goes no further (the store out, an error,
                    // or the request dropped while waiting).
                    let pending = Pending {
                        reservations: r,
                        bucket: &req.bucket,
                    };
                    let ticket = ticket.sent_at(t0);
                    let Some(answer) = self.call_store(t0, self.store.reserve(req, batch)).await?
                    else {
                        return Ok(None);
                    };
                    std::mem::forget(pending);
                    self.reservation_batches.increment(1);
                    let mut refunds = Vec::new();
                    let d = r.filled(
                        &req.bucket,
                        &req.limit,
                        req.cost,
                        taking,
                        answer,
                        &mut refunds,
                    );
                    self.give_back(refunds);
                    // A pool counts in `d`: an admission that leaves less than the cost here
                    // and in Redis holds no tokens in the pool either.
                    self.remember(req, ticket, &d, true, probe);
                    return Ok(Some(d));
                }
                Step::Single => {}
            }
        }
        let ticket = ticket.sent_at(t0);
        let d = self.call_store(t0, self.store.check(req)).await?;
        if let Some(d) = &d {
            // An admission that leaves less than the cost stands only while no tokens of the
            // bucket are held here (this single check may have given up waiting for a batch):
            // Redis's level does not count them.
            let admissions = d.remaining >= req.cost
                || self
                    .reservations
                    .as_ref()
                    .is_none_or(|r| r.idle(&req.bucket));
            self.remember(req, ticket, d, admissions, probe);
        }
        Ok(d)
    }

    /// Remembers a store answer in the denial cache. If this check was its bucket's probe, the
    /// new entry settles it; an answer that leaves none ends the probe (the guard's drop), so
    /// the checks waiting for it ask the store themselves.
    fn remember(
        &self,
        req: &CheckRequest,
        ticket: Ticket,
        d: &Decision,
        admissions: bool,
        probe: Option<Probe<'_>>,
    ) {
        if !self.denial_cache {
            return;
        }
        let stands = self.denials.remember(
            ticket,
            &req.bucket,
            &req.limit,
            req.cost,
            d,
            clock::monotonic(),
            admissions,
        );
        if stands {
            std::mem::forget(probe);
        }
    }

    /// A denial still standing for this check (answered without the store), or else whether
    /// this check is its bucket's probe. Waits, at most the store's timeout, while another
    /// check probes the bucket or the probe is not yet due.
    async fn standing_denial<'a>(
        &'a self,
        req: &'a CheckRequest,
    ) -> Result<Decision, Option<Probe<'a>>> {
        if !self.denial_cache {
            return Err(None);
        }
        let deadline = clock::monotonic() + self.store_timeout;
        let mut armed: Option<Pin<Box<OwnedNotified>>> = None;
        loop {
            let now = clock::monotonic();
            match self.denials.look(&req.bucket, &req.limit, req.cost, now) {
                Look::Denied(d) => return Ok(d),
                Look::Ask => return Err(None),
                Look::Probe => {
                    self.denial_cache_probes.increment(1);
                    return Err(Some(Probe {
                        denials: &self.denials,
                        bucket: &req.bucket,
                    }));
                }
                Look::Wait { .. } if now >= deadline => return Err(None),
                Look::Wait { until, settled } => match armed.take() {
                    // Armed first, then looked at again: a probe settling in between is seen
                    // by the look, one settling after it wakes the wait.
                    None => {
                        let mut woken = Box::pin(settled.notified_owned());
                        woken.as_mut().enable();
                        armed = Some(woken);
                    }
                    Some(woken) => {
                        let at = until.map_or(deadline, |u| u.min(deadline));
                        let _ = tokio::time::timeout_at(at, woken).await;
                    }
                },
            }
        }
    }

    /// One store call through the breaker: `Ok(None)` when the breaker is open or the store is
    /// out, `Err` when the store refused the request or its bucket's data.
    pub(super) async fn call_store<T>(
        &self,
        t0: tokio::time::Instant,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<Option<T>, StoreError> {
        let Some(permit) = self.breaker.admit() else {
            return Ok(None);
        };
        // The Redis store bounds every call with its configured timeout (a timeout is a
        // `StoreError`), so no second timer is armed here. Dropped here, the permit ends a
        // probe that can no longer report.
        let r = call.await;
        let took = t0.elapsed();
        self.store_latency.record(took.as_secs_f64());
        match r {
            Ok(d) => {
                permit.record(true, took);
                Ok(Some(d))
            }
            Err(e) if !e.is_outage() => {
                permit.record(true, took);
                Err(e)
            }
            Err(e) => {
                self.store_errors.increment(1);
                permit.record(false, took);
                tracing::debug!(region = %self.region, error = %e, "Store call failed.");
                Ok(None)
            }
        }
    }
}

/// A batch being taken for a bucket: dropped without being forgotten (the check went no
/// further), it ends the batch so checks waiting for it go on.
struct Pending<'a> {
    reservations: &'a Reservations,
    bucket: &'a BucketRef,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.reservations.abandon(self.bucket);
    }
}

/// A check probing a bucket whose denial is ending: dropped without an answer remembered (the
/// store out, an error, the request dropped), it ends the probe so checks waiting for it go on.
struct Probe<'a> {
    denials: &'a Denials,
    bucket: &'a BucketRef,
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        self.denials.abandon(self.bucket);
    }
}

/// Gives reserved tokens back to the store; a refund that fails leaves them spent (fewer
/// admissions, never more).
async fn give_back_now(store: &AnyStore, refunds: Vec<Refund>) {
    for r in refunds {
        if let Err(e) = store.refund(&r.bucket, r.tokens, None).await {
            tracing::debug!(error = %e, "A reservation's refund failed; its tokens stay spent.");
        }
    }
}
