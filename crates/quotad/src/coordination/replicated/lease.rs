//! This region's lease: counted by its own clock, renewed through the log with the acknowledged epoch.

use std::time::Duration;

use quota_core::coordinator::{Operation, Response};
use quota_core::lease::LeaseConfig;
use quota_core::region::RegionLease;

use super::{unavailable, Replicated};
use crate::clock;
use crate::coordination::mutation::CoordError;

impl Replicated {
    /// Local wall-clock ms at which this region's lease (minus the margin) ends; 0 without one.
    pub fn lease_end_local_ms(&self) -> u64 {
        let lease = self.lease.lock().unwrap_or_else(|e| e.into_inner());
        lease
            .lease()
            .map_or(0, |l| l.end_local_ms(self.lease_config.drift_margin_ms))
    }

    /// Records that this region's store now enforces the allocation of `epoch`.
    pub fn on_applied(&self, epoch: u64) {
        self.lease
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .on_applied(epoch);
        self.rebuild_view();
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

    /// Renews this region's lease through the log, acknowledging the applied epoch.
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
            .applied_epoch();
        let sent = clock::wall_ms();
        let op = Operation::RenewLease {
            region: self.region.clone(),
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
                self.lease
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .on_renewal(lease);
                self.rebuild_view();
                Ok(())
            }
            Response::UnknownRegion { region } => Err(CoordError::UnknownRegion { region }),
            other => Err(unavailable(format!("lease renewal answered {other:?}"))),
        }
    }
}
