//! `charge_at_end`: envoyproxy/ratelimit as Envoy AI Gateway uses it. Every region counts each
//! tenant's tokens in its own fixed-window counter (the policy's window on the region's
//! clock) and enforces the whole budget there, without coordination. The start is a check of
//! 0 hits (admitted while the counter is below the limit, nothing added); the end adds the
//! actual cost (`INCRBY`), past the limit if it must. Nothing bounds one request's cost, and
//! each of N regions admits the whole budget: up to N× worldwide.

use super::super::Setup;
use super::{Hold, LlmRequest, LlmStrategy};
use crate::world::World;

/// One region's counter of one tenant: tokens counted in window number `window`.
#[derive(Debug, Clone, Copy, Default)]
struct Counter {
    window: u64,
    tokens: u64,
}

#[derive(Debug)]
pub struct ChargeAtEnd {
    regions: usize,
    /// Per tenant: (limit, window in ms).
    limits: Vec<(u64, u64)>,
    /// Per (tenant, region).
    counters: Vec<Counter>,
}

impl ChargeAtEnd {
    pub fn new(setup: &Setup<'_>) -> Self {
        let regions = setup.world.regions;
        Self {
            regions,
            limits: setup
                .tenants
                .iter()
                .map(|t| (t.policy.limit, t.policy.window_ms))
                .collect(),
            counters: vec![Counter::default(); regions * setup.tenants.len()],
        }
    }

    /// The counter of `tenant` in `region` for the window holding the region's time `local_ms`
    /// (a new window starts at 0).
    fn counter(&mut self, tenant: u32, region: usize, local_ms: u64) -> &mut u64 {
        let window_ms = self.limits[tenant as usize].1;
        let c = &mut self.counters[tenant as usize * self.regions + region];
        let window = local_ms / window_ms;
        if c.window != window {
            *c = Counter { window, tokens: 0 };
        }
        &mut c.tokens
    }
}

impl LlmStrategy for ChargeAtEnd {
    fn advance(&mut self, _world: &World, _t_ms: u64) {}

    fn start(&mut self, world: &World, t_ms: u64, req: &LlmRequest) -> Option<Hold> {
        let limit = self.limits[req.tenant as usize].0;
        let counted = *self.counter(req.tenant, req.region, world.local_ms(req.region, t_ms));
        (counted < limit).then_some(Hold {
            region: req.region,
            tokens: 0,
        })
    }

    fn end(&mut self, world: &World, t_ms: u64, req: &LlmRequest, hold: Hold) -> u64 {
        let local = world.local_ms(hold.region, t_ms);
        *self.counter(req.tenant, hold.region, local) += u64::from(req.actual);
        0
    }
}
