//! `async_broadcast`: each region admits against a full-budget bucket of its own and, every
//! report interval, broadcasts the tokens it admitted since the last broadcast; a region
//! receiving hits charges them to its bucket (carrying what it cannot charge as debt). Local
//! latency, but until the hits arrive every region spends the same tokens: bursts overshoot by
//! up to N×, steady overload by the sync lag. Hits to an unreachable region wait and are sent
//! once the link returns.

use std::collections::VecDeque;

use quota_core::bucket::UT;
use quota_core::BucketParams;

use super::{Setup, Strategy, Verdict};
use crate::regional_store::RegionalStores;
use crate::traffic::{Request, Tenant};
use crate::world::{RegionIx, World, LOCAL_DECISION_US};

/// Hits in flight from one region to another.
#[derive(Debug)]
struct Batch {
    deliver_at_ms: u64,
    to: RegionIx,
    hits: Vec<(u32, u64)>,
}

#[derive(Debug)]
pub struct AsyncBroadcast {
    regions: usize,
    tenants: Vec<Tenant>,
    params: Vec<BucketParams>,
    stores: RegionalStores,
    /// Per (tenant, region): micro-tokens still owed to the bucket.
    debt_ut: Vec<u64>,
    /// Per (from, to, tenant): hits admitted at `from` not yet sent to `to`.
    pending_ut: Vec<u64>,
    interval_ms: u64,
    next_sync_ms: u64,
    in_flight: VecDeque<Batch>,
}

impl AsyncBroadcast {
    pub fn new(setup: &Setup<'_>) -> Self {
        let n = setup.world.regions;
        let t = setup.tenants.len();
        Self {
            regions: n,
            tenants: setup.tenants.to_vec(),
            params: setup
                .tenants
                .iter()
                .map(|t| BucketParams::global(&t.policy))
                .collect(),
            stores: RegionalStores::new(n, t),
            debt_ut: vec![0; n * t],
            pending_ut: vec![0; n * n * t],
            interval_ms: setup.control.report_ms,
            next_sync_ms: setup.control.report_ms,
            in_flight: VecDeque::new(),
        }
    }

    fn deliver(&mut self, world: &World, batch: Batch) {
        let now = world.local_ms(batch.to, batch.deliver_at_ms);
        for (tenant, ut) in batch.hits {
            let i = tenant as usize * self.regions + batch.to;
            let owed = self.debt_ut[i] + ut;
            self.debt_ut[i] =
                self.stores
                    .charge(batch.to, tenant, now, &self.params[tenant as usize], owed);
        }
    }
}

impl Strategy for AsyncBroadcast {
    fn advance(&mut self, world: &World, t_ms: u64) {
        self.stores.advance(world, t_ms);
        while self.next_sync_ms <= t_ms {
            let at = self.next_sync_ms;
            let t = self.tenants.len();
            for from in 0..self.regions {
                for to in 0..self.regions {
                    if from == to || !world.link_up(from, to, at) || !world.daemon_up(from, at) {
                        continue;
                    }
                    let base = (from * self.regions + to) * t;
                    let hits: Vec<(u32, u64)> = self.pending_ut[base..base + t]
                        .iter_mut()
                        .enumerate()
                        .filter(|(_, ut)| **ut > 0)
                        .map(|(k, ut)| (k as u32, std::mem::take(ut)))
                        .collect();
                    if !hits.is_empty() {
                        let deliver_at_ms = at + world.owd_ms(from, to);
                        self.in_flight.push_back(Batch {
                            deliver_at_ms,
                            to,
                            hits,
                        });
                    }
                }
            }
            self.next_sync_ms += self.interval_ms;
        }
        // Batches are queued in send order; delivery times differ per link, so scan.
        let mut k = 0;
        while k < self.in_flight.len() {
            if self.in_flight[k].deliver_at_ms <= t_ms {
                let batch = self.in_flight.remove(k).expect("index checked");
                self.deliver(world, batch);
            } else {
                k += 1;
            }
        }
    }

    fn decide(&mut self, world: &World, t_ms: u64, req: &Request) -> Verdict {
        let i = req.tenant as usize;
        let local = world.local_ms(req.region, t_ms);
        let slot = i * self.regions + req.region;
        if self.debt_ut[slot] > 0 {
            let owed = self.debt_ut[slot];
            self.debt_ut[slot] =
                self.stores
                    .charge(req.region, req.tenant, local, &self.params[i], owed);
        }
        let allowed = self.stores.decide(
            req.region,
            req.tenant,
            self.tenants[i].policy.fail_mode,
            local,
            &self.params[i],
            req.cost,
        );
        if allowed {
            let t = self.tenants.len();
            for to in 0..self.regions {
                if to != req.region {
                    self.pending_ut[(req.region * self.regions + to) * t + i] +=
                        u64::from(req.cost) * UT;
                }
            }
        }
        Verdict::against(allowed, &self.params[i], req.cost, LOCAL_DECISION_US)
    }
}
