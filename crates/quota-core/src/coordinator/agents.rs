//! A region's daemons: each one's lease with the epoch it enforces, and the agent role one of
//! them holds.
//!
//! A region may run several daemons on one store. Each decides checks under a lease of its own
//! (counted from when it sent its renewal), so each is an enforcer: the region has applied an
//! epoch once every daemon that may still enforce anything has — the least acknowledgement
//! among daemons whose lease (plus the drift margin) has not run out. A daemon gone quiet stops
//! counting once its lease is over, when nothing it did can be enforced any more (its own
//! lease has ended and every end it wrote to the store is earlier). A daemon that renews with
//! no live record (new, or back after its lease ran out) starts at the region's
//! acknowledgement: its lease is usable only for an allocation of the renewal's epoch or later,
//! which is at least that, so the region's acknowledgement never goes down.
//!
//! One daemon holds the agent role (it writes the store); a claim is a compare-and-set on the
//! fence, and every claim draws a fence above all earlier ones. An agent that released the role
//! (stopping) may have writes in the store that only the next agent's first complete pass
//! replaces: its record is marked as left, its acknowledgement frozen, until that pass
//! ([`super::Operation::AgentPassed`]). The agent a claim replaces may be alive as well (paused
//! or cut off, deciding in process on an old view): its record holds, unchanged, until its
//! lease and the margin are over.

use super::{AgentRole, CoordinatorState, DaemonLease, Response};
use crate::ids::RegionId;

/// The node id [`super::Operation::RenewLease`] renews for: a region run by one daemon.
pub const SOLE_DAEMON: u64 = 0;

impl CoordinatorState {
    pub(super) fn renew_lease(
        &mut self,
        id: &RegionId,
        node: u64,
        acked_epoch: u64,
        now: u64,
    ) -> Response {
        let Some(index) = self.region_index(id) else {
            return Response::UnknownRegion { region: id.clone() };
        };
        if acked_epoch > self.epoch {
            return Response::AckFromFuture {
                acked_epoch,
                epoch: self.epoch,
            };
        }
        let lease_ms = self.lease.lease_ms;
        let margin = self.lease.drift_margin_ms;
        let epoch = self.epoch;
        let Some(region) = self
            .regions
            .get_mut(usize::from(index))
            .and_then(Option::as_mut)
        else {
            return Response::UnknownRegion { region: id.clone() };
        };
        let live = |d: &DaemonLease| d.lease_expires_at_ms.saturating_add(margin) >= now;
        let holder = region.agent.map(|a| a.node);
        // Records that can no longer enforce anything go (the holder's stays, for display).
        region.daemons.retain(|n, d| live(d) || Some(*n) == holder);
        let expires = now.saturating_add(lease_ms);
        // A deposed agent that has not noticed yet gets no new lease while its record holds:
        // its record covers the lease it had, not one granted now (found by the model
        // checker, mutant `RecordCoversLease`).
        if let Some(d) = region.daemons.get(&node).filter(|d| d.deposed && live(d)) {
            return Response::LeaseRenewed {
                region: index,
                epoch,
                lease_ms: 0,
                expires_at_ms: d.lease_expires_at_ms,
            };
        }
        let acked = region.acked_epoch;
        let d = region.daemons.entry(node).or_insert(DaemonLease {
            acked_epoch: acked,
            lease_expires_at_ms: 0,
            left: false,
            deposed: false,
        });
        // An agent that left and renews again (restarted under the same id) keeps the
        // acknowledgement of what it wrote until the next agent's first pass replaces it. A
        // deposed agent's record is not touched: it holds until its lease is over (the lease
        // this renewal grants counts in the region's, below, and the daemon uses it only for
        // an allocation at least as new as now).
        if !d.left {
            if !live(d) {
                d.acked_epoch = d.acked_epoch.max(acked);
            }
            d.acked_epoch = d.acked_epoch.max(acked_epoch);
        }
        if !d.deposed {
            d.lease_expires_at_ms = d.lease_expires_at_ms.max(expires);
        }
        raise_ack(region, margin, now);
        region.lease_expires_at_ms = region.lease_expires_at_ms.max(expires);
        Response::LeaseRenewed {
            region: index,
            epoch,
            lease_ms,
            expires_at_ms: region.lease_expires_at_ms,
        }
    }

    pub(super) fn claim_agent(&mut self, id: &RegionId, node: u64, fence_seen: u64) -> Response {
        let next = self.last_fence.saturating_add(1);
        let Some(region) = self.region_mut(id) else {
            return Response::UnknownRegion { region: id.clone() };
        };
        match region.agent {
            Some(a) if a.fence != fence_seen => Response::AgentHeld {
                node: a.node,
                fence: a.fence,
            },
            old => {
                // Fault: the replaced agent may be alive (paused, cut off, restarted) with its
                // last writes still in the store. Its acknowledgement stays where it was until
                // this claimant's first complete pass replaces what it wrote.
                if let Some(d) = old.and_then(|a| region.daemons.get_mut(&a.node)) {
                    d.left = true;
                    d.deposed = true;
                }
                region.agent = Some(AgentRole { node, fence: next });
                self.last_fence = next;
                Response::AgentClaimed { fence: next }
            }
        }
    }

    /// A daemon that has stopped deciding and writing (it is exiting) leaves: a standby's
    /// lease record goes, so the region's acknowledgement no longer waits for its lease to run
    /// out; the agent (`fence` the one in force) gives up the role and its record stays, marked
    /// as left, until the next agent's first complete pass replaces what it wrote.
    pub(super) fn release_agent(
        &mut self,
        id: &RegionId,
        node: u64,
        fence: u64,
        now: u64,
    ) -> Response {
        let margin = self.lease.drift_margin_ms;
        let Some(region) = self.region_mut(id) else {
            return Response::UnknownRegion { region: id.clone() };
        };
        let agent = region.agent;
        let released = agent.is_some_and(|a| a.node == node && a.fence == fence);
        let deposed = region.daemons.get(&node).is_some_and(|d| d.deposed);
        if released {
            region.agent = None;
            if let Some(d) = region.daemons.get_mut(&node) {
                d.left = true;
            }
        } else if !deposed {
            region.daemons.remove(&node);
            raise_ack(region, margin, now);
        }
        if released {
            Response::AgentReleased
        } else {
            held(agent)
        }
    }

    pub(super) fn agent_passed(
        &mut self,
        id: &RegionId,
        node: u64,
        fence: u64,
        now: u64,
    ) -> Response {
        let margin = self.lease.drift_margin_ms;
        let Some(region) = self.region_mut(id) else {
            return Response::UnknownRegion { region: id.clone() };
        };
        match region.agent {
            Some(a) if a.node == node && a.fence == fence => {
                // What agents that stopped wrote is replaced; one deposed may still decide
                // in process until its lease is over.
                region.daemons.retain(|_, d| !d.left || d.deposed);
                raise_ack(region, margin, now);
                Response::AgentPassed
            }
            a => held(a),
        }
    }

    fn region_mut(&mut self, id: &RegionId) -> Option<&mut super::RegionState> {
        let index = usize::from(self.region_index(id)?);
        self.regions.get_mut(index).and_then(Option::as_mut)
    }
}

/// Who holds the role, as a refused claim, release or pass is answered (0, 0: nobody).
fn held(agent: Option<AgentRole>) -> Response {
    Response::AgentHeld {
        node: agent.map_or(0, |a| a.node),
        fence: agent.map_or(0, |a| a.fence),
    }
}

/// Raises the region's acknowledgement to the least of its live daemons' (never lowers it).
fn raise_ack(region: &mut super::RegionState, margin: u64, now: u64) {
    if let Some(least) = region
        .daemons
        .values()
        .filter(|d| d.lease_expires_at_ms.saturating_add(margin) >= now)
        .map(|d| d.acked_epoch)
        .min()
    {
        region.acked_epoch = region.acked_epoch.max(least);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Command, Operation, RequestId};
    use super::*;
    use crate::lease::LeaseConfig;

    fn region() -> RegionId {
        RegionId::new("a").unwrap()
    }

    struct Cluster {
        s: CoordinatorState,
        next: u64,
    }

    impl Cluster {
        fn new() -> Self {
            let mut c = Self {
                s: CoordinatorState::default(),
                next: 1,
            };
            c.op(
                0,
                Operation::SetLeaseConfig {
                    config: LeaseConfig {
                        lease_ms: 3_000,
                        drift_margin_ms: 500,
                    },
                },
            );
            c.op(
                0,
                Operation::PutRegion {
                    region: region(),
                    reserves_floor: true,
                    draining: false,
                },
            );
            c
        }

        fn op(&mut self, now_ms: u64, op: Operation) -> Response {
            self.next += 1;
            self.s.apply(&Command {
                request: RequestId(u128::from(self.next)),
                now_ms,
                op,
            })
        }

        fn renew(&mut self, now_ms: u64, node: u64, acked_epoch: u64) -> Response {
            self.op(
                now_ms,
                Operation::RenewDaemonLease {
                    region: region(),
                    node,
                    acked_epoch,
                },
            )
        }

        fn acked(&self) -> u64 {
            self.s.region(0).unwrap().acked_epoch
        }

        fn claim(&mut self, node: u64, fence_seen: u64) -> Response {
            self.op(
                0,
                Operation::ClaimAgent {
                    region: region(),
                    node,
                    fence_seen,
                },
            )
        }
    }

    #[test]
    fn the_region_has_applied_what_its_slowest_live_daemon_has() {
        let mut c = Cluster::new();
        c.s.epoch = 10;
        c.renew(1_000, 1, 4);
        c.renew(1_000, 2, 7);
        assert_eq!(c.acked(), 4, "daemon 1 may still enforce epoch 4");
        c.renew(2_000, 1, 9);
        assert_eq!(c.acked(), 7);
        // Daemon 2 goes quiet: it counts until its lease (3 000 after 1 000) plus the margin.
        c.renew(4_500, 1, 10);
        assert_eq!(
            c.acked(),
            7,
            "daemon 2's lease and margin are not over at 4 500"
        );
        c.renew(4_501, 1, 10);
        assert_eq!(c.acked(), 10, "daemon 2 can enforce nothing after 4 500");
        assert!(!c.s.region(0).unwrap().daemons.contains_key(&2), "pruned");
        // Back after its lease ran out: it starts at the region's acknowledgement, not below.
        c.renew(5_000, 2, 3);
        assert_eq!(c.s.region(0).unwrap().daemons[&2].acked_epoch, 10);
        assert_eq!(c.acked(), 10);
        // An acknowledgement is never taken back by a later, lower one.
        c.renew(5_100, 1, 6);
        assert_eq!(c.s.region(0).unwrap().daemons[&1].acked_epoch, 10);
    }

    #[test]
    fn a_daemon_that_stops_no_longer_holds_the_acknowledgement_back() {
        let mut c = Cluster::new();
        c.s.epoch = 9;
        c.renew(1_000, 1, 4);
        c.renew(1_000, 2, 9);
        assert_eq!(c.acked(), 4);
        // Daemon 1 stops (SIGTERM): it decides nothing more, so its lease need not run out.
        let r = c.op(
            1_100,
            Operation::ReleaseAgent {
                region: region(),
                node: 1,
                fence: 0,
            },
        );
        assert_eq!(r, Response::AgentHeld { node: 0, fence: 0 });
        assert_eq!(c.acked(), 9);
    }

    /// The agent stops (SIGTERM) while its last pass is at epoch 4 and a standby's view is at
    /// 9: the store still holds epoch 4's shares until the next agent's first pass, so the
    /// region's acknowledgement stays at 4 until then, however the stopped one renews.
    #[test]
    fn a_stopped_agent_holds_the_acknowledgement_until_the_next_agent_has_passed() {
        let mut c = Cluster::new();
        c.s.epoch = 9;
        assert_eq!(c.claim(1, 0), Response::AgentClaimed { fence: 1 });
        c.renew(1_000, 1, 4);
        c.renew(1_000, 2, 9);
        let release = |c: &mut Cluster, node, fence| {
            c.op(
                1_100,
                Operation::ReleaseAgent {
                    region: region(),
                    node,
                    fence,
                },
            )
        };
        assert_eq!(release(&mut c, 1, 1), Response::AgentReleased);
        assert_eq!(c.acked(), 4);
        assert!(c.s.region(0).unwrap().daemons[&1].left);
        // Restarted under the same id, it renews as a standby: still 4.
        c.renew(1_200, 1, 9);
        assert_eq!(c.acked(), 4);
        assert_eq!(c.claim(2, 0), Response::AgentClaimed { fence: 2 });
        let passed = |c: &mut Cluster, node, fence| {
            c.op(
                1_300,
                Operation::AgentPassed {
                    region: region(),
                    node,
                    fence,
                },
            )
        };
        // Only the agent in force clears it.
        assert_eq!(
            passed(&mut c, 1, 1),
            Response::AgentHeld { node: 2, fence: 2 }
        );
        assert_eq!(c.acked(), 4);
        assert_eq!(passed(&mut c, 2, 2), Response::AgentPassed);
        assert_eq!(c.acked(), 9);
        assert!(!c.s.region(0).unwrap().daemons.contains_key(&1));
    }

    /// Found by the model checker (`quota-model`, mutant `ClaimMarksLeft`): an agent deposed by a
    /// claim while alive goes on renewing as a standby, acknowledging its view; its last
    /// write, of an older epoch, is still in the store, and it may still decide in process on
    /// an old view until its lease ends. Its record holds until then, whatever the claimant
    /// writes.
    #[test]
    fn a_deposed_agent_holds_the_acknowledgement_until_its_lease_is_over() {
        let mut c = Cluster::new();
        c.s.epoch = 9;
        assert_eq!(c.claim(1, 0), Response::AgentClaimed { fence: 1 });
        c.renew(1_000, 1, 4);
        c.renew(1_000, 2, 9);
        assert_eq!(c.claim(2, 1), Response::AgentClaimed { fence: 2 });
        // Its renewals neither raise its acknowledgement nor lengthen its record, and grant it
        // no lease.
        assert!(matches!(
            c.renew(1_100, 1, 9),
            Response::LeaseRenewed { lease_ms: 0, .. }
        ));
        c.renew(1_100, 2, 9);
        assert_eq!(c.acked(), 4, "the deposed agent may still enforce epoch 4");
        let r = c.op(
            1_200,
            Operation::AgentPassed {
                region: region(),
                node: 2,
                fence: 2,
            },
        );
        assert_eq!(r, Response::AgentPassed);
        assert_eq!(
            c.acked(),
            4,
            "the claimant's pass does not end a deposed agent's lease"
        );
        // Its lease (3 000 after 1 000) and the margin (500) are over at 4 501.
        c.renew(4_500, 2, 9);
        assert_eq!(c.acked(), 4);
        c.renew(4_501, 2, 9);
        assert_eq!(c.acked(), 9);
        // Back as a standby, it starts afresh at the region's acknowledgement.
        c.renew(4_600, 1, 9);
        assert_eq!(c.s.region(0).unwrap().daemons[&1].acked_epoch, 9);
        assert!(!c.s.region(0).unwrap().daemons[&1].deposed);
    }

    #[test]
    fn a_new_daemon_never_lowers_the_region_acknowledgement() {
        let mut c = Cluster::new();
        c.s.epoch = 8;
        c.renew(1_000, 1, 8);
        assert_eq!(c.acked(), 8);
        c.renew(1_100, 3, 0);
        assert_eq!(c.acked(), 8);
        assert_eq!(c.s.region(0).unwrap().daemons[&3].acked_epoch, 8);
        assert!(matches!(
            c.renew(1_200, 3, 9),
            Response::AckFromFuture { .. }
        ));
    }

    #[test]
    fn the_lease_of_a_sole_daemon_renews_as_before() {
        let mut c = Cluster::new();
        c.s.epoch = 5;
        let r = c.op(
            1_000,
            Operation::RenewLease {
                region: region(),
                acked_epoch: 3,
            },
        );
        assert!(matches!(
            r,
            Response::LeaseRenewed {
                epoch: 5,
                lease_ms: 3_000,
                expires_at_ms: 4_000,
                ..
            }
        ));
        assert_eq!(c.acked(), 3);
        assert!(c.s.region(0).unwrap().daemons.contains_key(&SOLE_DAEMON));
    }

    #[test]
    fn a_claim_is_a_compare_and_set_and_every_fence_is_new() {
        let mut c = Cluster::new();
        assert_eq!(c.claim(1, 0), Response::AgentClaimed { fence: 1 });
        // Two daemons saw fence 1 and claim at once: one wins.
        assert_eq!(c.claim(2, 1), Response::AgentClaimed { fence: 2 });
        assert_eq!(c.claim(3, 1), Response::AgentHeld { node: 2, fence: 2 });
        // A release by a deposed holder changes nothing.
        let stale = c.op(
            0,
            Operation::ReleaseAgent {
                region: region(),
                node: 1,
                fence: 1,
            },
        );
        assert_eq!(stale, Response::AgentHeld { node: 2, fence: 2 });
        let released = c.op(
            0,
            Operation::ReleaseAgent {
                region: region(),
                node: 2,
                fence: 2,
            },
        );
        assert_eq!(released, Response::AgentReleased);
        // Nobody holds it after a release: the first claim wins, with a fence above every
        // earlier one, and one racing it (it saw the released fence) loses.
        assert_eq!(c.claim(3, 2), Response::AgentClaimed { fence: 3 });
        assert_eq!(c.claim(1, 2), Response::AgentHeld { node: 3, fence: 3 });
        // The holder claiming again (a restart) gets a new fence too.
        assert_eq!(c.claim(3, 3), Response::AgentClaimed { fence: 4 });
        let unknown = c.op(
            0,
            Operation::ClaimAgent {
                region: RegionId::new("zz").unwrap(),
                node: 1,
                fence_seen: 0,
            },
        );
        assert!(matches!(unknown, Response::UnknownRegion { .. }));
    }
}
