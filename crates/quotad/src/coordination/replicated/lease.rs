//! This region's lease: counted by its own monotonic clock ([`clock::monotonic_ms`], so a wall
//! clock stepped backwards cannot lengthen it), renewed through the log with the acknowledged
//! epoch, and told truthfully: the log says "Lease ran out" once for every lapse and
//! `quotad_lease_remaining_ms` reads the time left when it is scraped.
//!
//! A lapse is noticed wherever it shows first: when something looks at the lease (the apply
//! loop wakes at the lease end; a scrape of `/metrics`), or when a renewal or an applied epoch
//! replaces a lease that had already ended (the apply loop may have been busy writing to a slow
//! store at the end). Both go through one [`LeaseWatch`], which sees the end before and after
//! every change, so no lapse is told twice or missed.

use std::time::Duration;

use quota_core::coordinator::{Operation, Response};
use quota_core::lease::LeaseConfig;
use quota_core::region::{RegionLease, RegionView};

use super::{unavailable, Replicated};
use crate::clock;
use crate::coordination::mutation::CoordError;
use crate::telemetry;

/// Whether this region held its lease at the last look: turns looks at the lease end into the
/// changes the log reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseWatch {
    held: bool,
}

/// A change in whether the region holds its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseChange {
    /// The lease ended at `end_ms` (local monotonic ms): the region enforces only its floors.
    Lapsed { end_ms: u64 },
    /// A lease holds until `end_ms`: the region enforces its shares.
    Granted { end_ms: u64 },
}

impl LeaseWatch {
    /// Looks at a lease ending at local time `end_ms` (0 without one) at `now_ms`: what changed
    /// since the last look. The lease holds while `now_ms < end_ms`, as the region enforces it.
    pub fn observe(&mut self, end_ms: u64, now_ms: u64) -> Option<LeaseChange> {
        let holds = now_ms < end_ms;
        let change = match (self.held, holds) {
            (true, false) => Some(LeaseChange::Lapsed { end_ms }),
            (false, true) => Some(LeaseChange::Granted { end_ms }),
            _ => None,
        };
        self.held = holds;
        change
    }
}

/// This region's lease clock and what was last told about it, under one lock.
#[derive(Debug, Default)]
pub(super) struct LeaseClock {
    view: RegionView,
    watch: LeaseWatch,
}

impl LeaseClock {
    /// The lease the region may enforce under.
    pub(super) fn lease(&self) -> Option<&RegionLease> {
        self.view.lease()
    }

    fn end_ms(&self, margin_ms: u64) -> u64 {
        self.view.lease().map_or(0, |l| l.end_local_ms(margin_ms))
    }

    /// Runs `change` at local time `now_ms`: whether the lease in force had run out before it
    /// (a lease replaced after its end lapsed, even if nothing looked in between), then whether
    /// the change grants one; with the lease end after the change (0 without a lease).
    fn change(
        &mut self,
        now_ms: u64,
        margin_ms: u64,
        change: impl FnOnce(&mut RegionView),
    ) -> ([Option<LeaseChange>; 2], u64) {
        let lapsed = self.watch.observe(self.end_ms(margin_ms), now_ms);
        change(&mut self.view);
        let after = self.end_ms(margin_ms);
        let granted = self.watch.observe(after, now_ms);
        ([lapsed, granted], after)
    }
}

impl Replicated {
    /// Local monotonic ms ([`clock::monotonic_ms`]) at which this region's lease (minus the
    /// margin) ends; 0 without one.
    pub fn lease_end_local_ms(&self) -> u64 {
        let lease = self.lease.lock().unwrap_or_else(|e| e.into_inner());
        lease.end_ms(self.lease_config.drift_margin_ms)
    }

    /// The drift margin this region counts its lease with.
    pub fn drift_margin_ms(&self) -> u64 {
        self.lease_config.drift_margin_ms
    }

    /// Looks at the lease now: logs a lapse or a grant not told yet and sets
    /// `quotad_lease_remaining_ms`. Returns the lease end (local monotonic ms, 0 without one).
    pub fn observe_lease(&self) -> u64 {
        self.change_lease(|_| ())
    }

    /// Records that this region's store now enforces the allocation of `epoch`.
    pub fn on_applied(&self, epoch: u64) {
        self.change_lease(|v| v.on_applied(epoch));
        self.rebuild_view();
    }

    /// Runs `change` on the lease clock and tells what it did to the lease ([`LeaseClock::change`]).
    fn change_lease(&self, change: impl FnOnce(&mut RegionView)) -> u64 {
        let now = clock::monotonic_ms();
        let (told, after) = self.lease.lock().unwrap_or_else(|e| e.into_inner()).change(
            now,
            self.lease_config.drift_margin_ms,
            change,
        );
        for c in told.into_iter().flatten() {
            self.tell(c, now);
        }
        metrics::gauge!(telemetry::LEASE_REMAINING_MS, "region" => self.region.as_str().to_string())
            .set(after.saturating_sub(now) as f64);
        after
    }

    fn tell(&self, change: LeaseChange, now_ms: u64) {
        match change {
            LeaseChange::Lapsed { end_ms } => tracing::warn!(
                region = %self.region,
                ended_ms_ago = now_ms.saturating_sub(end_ms),
                "Lease ran out: enforcing floors."
            ),
            LeaseChange::Granted { end_ms } => tracing::info!(
                region = %self.region,
                remaining_ms = end_ms.saturating_sub(now_ms),
                "Lease granted: enforcing shares."
            ),
        }
    }

    /// How long one renewal may take, forwarding retries to a new leader included: half of
    /// what the region may use of a lease (`lease − margin`), at most the write timeout, so a
    /// renewal that fails still leaves time for the next before the lease runs out.
    pub fn renewal_timeout(&self) -> Duration {
        let usable = self
            .lease_config
            .lease_ms
            .saturating_sub(self.lease_config.drift_margin_ms);
        Duration::from_millis(usable / 2).min(self.raft.config().write_timeout())
    }

    /// Renews this daemon's lease through the log, acknowledging the epoch it enforces: the
    /// agent's applied epoch, a standby's view's.
    ///
    /// Only under this region's configured lease timing: until the leader has committed it, a
    /// renewal would carry the state machine's default (30 s) and delay the reuse of this
    /// region's share by that much if it were then cut off.
    pub async fn renew_lease(&self) -> Result<(), CoordError> {
        let cluster = self.raft.read(|s| s.lease);
        if cluster != self.lease_config {
            if cluster != LeaseConfig::default() {
                tracing::warn!(
                    configured_ms = self.lease_config.lease_ms,
                    cluster_ms = cluster.lease_ms,
                    "The cluster's lease timing differs from this region's configuration: not \
                     renewing. Configure the same [coordination] lease on every region."
                );
            }
            return Err(unavailable(
                "the configured lease timing is not committed yet",
            ));
        }
        let acked_epoch = self
            .lease
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .view
            .applied_epoch();
        // On the monotonic clock: the lease runs out `lease_ms - margin` after this, whatever
        // the wall clock does meanwhile (only the leader's clock stamps the commit).
        let sent = clock::monotonic_ms();
        let op = Operation::RenewDaemonLease {
            region: self.region.clone(),
            node: self.node_id(),
            acked_epoch,
        };
        match self.write_within(op, self.renewal_timeout()).await? {
            Response::LeaseRenewed {
                epoch, lease_ms, ..
            } => {
                let lease = RegionLease {
                    epoch,
                    start_local_ms: sent,
                    lease_ms,
                };
                self.change_lease(|v| v.on_renewal(lease));
                self.agent
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .renewed();
                self.rebuild_view();
                Ok(())
            }
            Response::UnknownRegion { region } => Err(CoordError::UnknownRegion { region }),
            other => Err(unavailable(format!("lease renewal answered {other:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MARGIN: u64 = 300;

    fn lease(epoch: u64, start: u64) -> RegionLease {
        RegionLease {
            epoch,
            start_local_ms: start,
            lease_ms: 3_000,
        }
    }

    /// A lease clock driven with injected time.
    struct Driven {
        clock: LeaseClock,
        told: Vec<(u64, LeaseChange)>,
    }

    impl Driven {
        fn new() -> Self {
            Self {
                clock: LeaseClock::default(),
                told: Vec::new(),
            }
        }

        /// Like `change_lease`: returns what `quotad_lease_remaining_ms` is set to.
        fn change(&mut self, now: u64, change: impl FnOnce(&mut RegionView)) -> u64 {
            let (told, after) = self.clock.change(now, MARGIN, change);
            self.told
                .extend(told.into_iter().flatten().map(|c| (now, c)));
            after.saturating_sub(now)
        }

        fn look(&mut self, now: u64) -> u64 {
            self.change(now, |_| ())
        }
    }

    #[test]
    fn every_lapse_is_told_once_however_it_is_noticed() {
        let mut d = Driven::new();
        d.change(0, |v| v.on_applied(1));
        assert_eq!(d.change(100, |v| v.on_renewal(lease(1, 100))), 2_700);
        assert_eq!(d.told, [(100, LeaseChange::Granted { end_ms: 2_800 })]);
        // Looking while the lease holds tells nothing; the remaining time counts down.
        assert_eq!(d.look(2_000), 800);
        assert_eq!(d.look(2_799), 1);
        assert_eq!(d.told.len(), 1);

        // 1. Noticed by a look at the end (the apply loop's timer, a scrape): told once.
        assert_eq!(d.look(2_800), 0);
        assert_eq!(d.look(3_500), 0);
        assert_eq!(d.told[1], (2_800, LeaseChange::Lapsed { end_ms: 2_800 }));
        assert_eq!(d.told.len(), 2);
        d.change(4_000, |v| v.on_renewal(lease(1, 3_900)));
        assert_eq!(d.told[2], (4_000, LeaseChange::Granted { end_ms: 6_600 }));

        // 2. Nobody looked at the end (6 600): the renewal that replaces the lease tells the
        //    lapse first, then the grant.
        assert_eq!(d.change(7_000, |v| v.on_renewal(lease(1, 6_900))), 2_600);
        assert_eq!(
            d.told[3..],
            [
                (7_000, LeaseChange::Lapsed { end_ms: 6_600 }),
                (7_000, LeaseChange::Granted { end_ms: 9_600 }),
            ]
        );

        // 3. A renewal of a later epoch waits for the epoch to be applied: the lease in force
        //    runs out meanwhile, and the applied epoch brings the new one.
        d.change(9_000, |v| v.on_renewal(lease(2, 8_900)));
        assert_eq!(d.told.len(), 5, "a pending renewal changes nothing yet");
        assert_eq!(d.change(9_700, |v| v.on_applied(2)), 1_900);
        assert_eq!(
            d.told[5..],
            [
                (9_700, LeaseChange::Lapsed { end_ms: 9_600 }),
                (9_700, LeaseChange::Granted { end_ms: 11_600 }),
            ]
        );

        // 4. Renewed in time: no lapse, nothing told.
        d.change(11_000, |v| v.on_renewal(lease(2, 10_900)));
        assert_eq!(d.look(13_000), 600);
        assert_eq!(d.told.len(), 7);
        // Three lapses, three warnings.
        let lapses = d
            .told
            .iter()
            .filter(|(_, c)| matches!(c, LeaseChange::Lapsed { .. }))
            .count();
        assert_eq!(lapses, 3);
    }

    #[test]
    fn without_a_lease_nothing_is_held_and_nothing_lapses() {
        let mut w = LeaseWatch::default();
        assert_eq!(w.observe(0, 5), None);
        assert_eq!(w.observe(10, 10), None, "a lease ending now does not hold");
        assert_eq!(w.observe(11, 10), Some(LeaseChange::Granted { end_ms: 11 }));
        assert_eq!(w.observe(11, 11), Some(LeaseChange::Lapsed { end_ms: 11 }));
    }
}
