//! `global_store`: one Redis in region 0 holds every tenant's whole bucket; every decision
//! from another region pays a WAN round trip. Exact while reachable; a region cut off from the
//! store fails open (admits, uncounted) or closed (denies).

use quota_core::bucket::{decide, BucketParams, BucketState};

use super::{Setup, Strategy, Verdict};
use crate::traffic::Request;
use crate::world::{World, LOCAL_DECISION_US};

/// The region holding the store.
const STORE: usize = 0;

#[derive(Debug)]
pub struct GlobalStore {
    params: Vec<BucketParams>,
    states: Vec<Option<BucketState>>,
    fail_open: bool,
}

impl GlobalStore {
    pub fn new(setup: &Setup<'_>) -> Self {
        Self {
            params: setup
                .tenants
                .iter()
                .map(|t| BucketParams::global(&t.policy))
                .collect(),
            states: vec![None; setup.tenants.len()],
            fail_open: setup.global_fail_open,
        }
    }
}

impl Strategy for GlobalStore {
    fn advance(&mut self, _world: &World, _t_ms: u64) {}

    fn decide(&mut self, world: &World, t_ms: u64, req: &Request) -> Verdict {
        let rtt_ms = world.rtt_ms(req.region, STORE);
        let at_store_ms = t_ms + rtt_ms / 2;
        if !world.link_up(req.region, STORE, t_ms) || !world.redis_up(STORE, at_store_ms) {
            // The caller waits out a timeout of about one round trip, then applies the mode.
            return Verdict {
                allowed: self.fail_open,
                latency_us: (2 * rtt_ms).max(1) * 1000,
                forwarded: false,
                never: false,
            };
        }
        let i = req.tenant as usize;
        let now = world.local_ms(STORE, at_store_ms);
        let (d, s) = decide(
            now,
            &self.params[i],
            self.states[i].as_ref(),
            u64::from(req.cost),
        );
        self.states[i] = Some(s);
        Verdict {
            forwarded: req.region != STORE,
            ..Verdict::against(
                d.allowed,
                &self.params[i],
                req.cost,
                rtt_ms * 1000 + LOCAL_DECISION_US,
            )
        }
    }
}
