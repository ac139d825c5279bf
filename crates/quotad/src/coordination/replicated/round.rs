//! The leader's round: register missing regions and the lease timing, finish removing
//! drained regions, then rebalance.

use quota_core::allocator;
use quota_core::coordinator::{Command, Operation, Response};
use quota_core::RegionId;

use super::Replicated;
use crate::{clock, telemetry};

impl Replicated {
    /// One leader round: register missing regions and the lease timing, then rebalance.
    /// A no-op on followers.
    pub async fn leader_round(&self) {
        if !self.raft.is_leader() {
            return;
        }
        let started = clock::monotonic();
        if !self.register_regions_and_lease().await {
            return;
        }
        self.finish_removals(clock::wall_ms()).await;
        self.rebalance(clock::wall_ms()).await;
        metrics::histogram!(telemetry::REBALANCE_DURATION_SECONDS, "region" => self.region.as_str().to_string())
            .record(started.elapsed().as_secs_f64());
    }

    /// Registers the configured regions the state does not hold yet (those still in the Raft
    /// group: a removed member's region stays out), and this region's lease timing if the
    /// state's differs; false once a write failed.
    async fn register_regions_and_lease(&self) -> bool {
        let members = self.raft.status().members;
        let (missing, lease) = self.raft.read(|s| {
            let missing: Vec<RegionId> = self
                .regions
                .iter()
                .filter(|r| s.region_index(r).is_none())
                .filter(|r| members.values().any(|m| m.region == r.as_str()))
                .cloned()
                .collect();
            (missing, s.lease)
        });
        for region in missing {
            let op = Operation::PutRegion {
                region,
                reserves_floor: true,
                draining: false,
            };
            if let Err(e) = self.write(op).await {
                tracing::warn!(error = %e, "Registering a region failed.");
                return false;
            }
        }
        if lease != self.lease_config {
            if let Err(e) = self
                .write(Operation::SetLeaseConfig {
                    config: self.lease_config,
                })
                .await
            {
                tracing::warn!(error = %e, "Setting the lease timing failed.");
                return false;
            }
        }
        true
    }

    /// Removes every draining region that enforces nothing any more (it acknowledged giving up
    /// its shares and floors, or their revocations ended): first its Raft node, so no round
    /// registers it again, then the region, which releases its slot. A region that cannot
    /// acknowledge (down, cut off) keeps its floors reserved until it does: only it knows it
    /// stopped enforcing them.
    pub(super) async fn finish_removals(&self, now: u64) {
        let done: Vec<RegionId> = self.raft.read(|s| {
            s.regions
                .iter()
                .enumerate()
                .filter_map(|(i, r)| r.as_ref().map(|r| (i, r)))
                .filter(|(i, r)| r.draining && !s.region_in_use(*i as u8, now))
                .map(|(_, r)| r.id.clone())
                .collect()
        });
        for region in done {
            let node = self
                .raft
                .status()
                .members
                .into_iter()
                .find(|(_, m)| m.region == region.as_str())
                .map(|(id, _)| id);
            if let Some(node) = node {
                if let Err(e) = self.raft.remove(node).await {
                    tracing::warn!(%region, node, error = %e, "Removing a drained region's node failed.");
                    continue;
                }
            }
            match self
                .write(Operation::RemoveRegion {
                    region: region.clone(),
                })
                .await
            {
                Ok(Response::RegionRemoved { membership }) => {
                    tracing::info!(%region, membership, "Region removed: the others hold the whole budget.");
                    self.rebuild_view();
                }
                Ok(other) => tracing::debug!(%region, ?other, "Region not removed."),
                Err(e) => tracing::warn!(%region, error = %e, "Removing a drained region failed."),
            }
        }
    }

    /// The slots of regions whose lease ran out at `now` (coordinator time).
    fn silent_regions(&self, now: u64) -> Vec<u8> {
        self.raft.read(|s| {
            s.regions
                .iter()
                .enumerate()
                .filter_map(|(i, r)| r.as_ref().map(|r| (i, r)))
                .filter(|(_, r)| {
                    now > r
                        .lease_expires_at_ms
                        .saturating_add(s.lease.drift_margin_ms)
                })
                .map(|(i, _)| i as u8)
                .collect()
        })
    }

    /// Plans shares from the demand estimates and commits them, stopping at the first failed
    /// write.
    async fn rebalance(&self, now: u64) {
        // A region whose lease ran out cannot report (it is cut off or down): count it as
        // having no demand, so the allocator hands its non-floor share to regions that do.
        let silent = self.silent_regions(now);
        let plan = {
            let mut demand = self.demand.lock().unwrap_or_else(|e| e.into_inner());
            for slot in silent {
                demand.record(slot, self.rebalance_interval_ms, &[]);
            }
            self.raft
                .read(|s| allocator::plan(s, &demand, &self.allocator, now))
        };
        let commands = plan.into_commands(now, self.allocator.max_entries_per_command, || {
            self.request_id()
        });
        for cmd in commands {
            match self.raft.write(cmd).await {
                Ok(Response::SharesSet {
                    epoch,
                    accepted,
                    rejected_total,
                    ..
                }) => {
                    tracing::debug!(epoch, accepted, rejected_total, "Shares committed.");
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "Committing shares failed.");
                    return;
                }
            }
        }
        self.promote(now).await;
    }

    /// Promotes, moves and evicts subjects of plans' classes ([`quota_core::promotion`]),
    /// against the state the class shares just committed to.
    async fn promote(&self, now: u64) {
        let (membership, changes) = {
            let mut demand = self.demand.lock().unwrap_or_else(|e| e.into_inner());
            let mut tracker = self.promotion.lock().unwrap_or_else(|e| e.into_inner());
            self.raft.read(|s| {
                let changes = tracker.plan(s, &mut demand, &self.allocator, now);
                (s.membership, changes)
            })
        };
        let chunk = (self.allocator.max_entries_per_command as usize).max(1);
        for changes in changes.chunks(chunk) {
            let cmd = Command {
                request: self.request_id(),
                now_ms: now,
                op: Operation::SetPromoted {
                    membership,
                    changes: changes.to_vec(),
                },
            };
            match self.raft.write(cmd).await {
                Ok(Response::PromotedSet {
                    epoch,
                    accepted,
                    rejected,
                }) => {
                    tracing::debug!(epoch, accepted, rejected, "Promoted subjects committed.");
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "Committing promoted subjects failed.");
                    return;
                }
            }
        }
    }
}
