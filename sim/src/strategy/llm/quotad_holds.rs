//! `quotad_holds`: quotad with holds and debt. The start is a check of the estimate, quotad's
//! own ([`Quotad::decide_routed`]: leased shares, the denial cache, forwarding), which spends
//! it in the bucket that decided: a hold. The end settles the hold there against the actual
//! cost ([`Quotad::settle`]): the difference goes back, or the excess is charged into debt down
//! to the policy's `debt_limit` below empty; while a bucket is in debt its checks are denied.
//! The excess charged is demand in the usage reports, so shares follow the actual costs.

use super::super::quotad::Quotad;
use super::super::{Setup, Strategy as _};
use super::{Hold, LlmRequest, LlmStrategy};
use crate::world::World;

#[derive(Debug)]
pub struct QuotadHolds {
    quotad: Quotad,
}

impl QuotadHolds {
    pub fn new(setup: &Setup<'_>) -> Self {
        Self {
            quotad: Quotad::new(setup),
        }
    }
}

impl LlmStrategy for QuotadHolds {
    fn advance(&mut self, world: &World, t_ms: u64) {
        self.quotad.advance(world, t_ms);
    }

    fn start(&mut self, world: &World, t_ms: u64, req: &LlmRequest) -> Option<Hold> {
        let (v, region) = self
            .quotad
            .decide_routed(world, t_ms, &req.check(req.estimate));
        v.allowed.then_some(Hold {
            region,
            tokens: u64::from(req.estimate),
        })
    }

    fn end(&mut self, world: &World, t_ms: u64, req: &LlmRequest, hold: Hold) -> u64 {
        self.quotad.settle(
            world,
            t_ms,
            hold.region,
            &req.check(req.actual),
            hold.tokens,
        )
    }
}
