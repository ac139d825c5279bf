//! `check_then_charge`: quotad's leased, rebalanced shares used as a client of today's check
//! API would: a reading of the estimate when the request starts (refused while the region's
//! share bucket does not hold it; nothing spent), and the actual cost checked when it ends. A
//! check above the tokens left is denied and spends nothing, so the tokens of that request,
//! already used, are never counted: the bug of issue #32. The end's check is quotad's own
//! ([`Quotad::decide_routed`]: the denial cache, forwarding a cost the share cannot hold).

use super::super::quotad::Quotad;
use super::super::{Setup, Strategy as _};
use super::{Hold, LlmRequest, LlmStrategy};
use crate::world::World;

#[derive(Debug)]
pub struct CheckThenCharge {
    quotad: Quotad,
}

impl CheckThenCharge {
    pub fn new(setup: &Setup<'_>) -> Self {
        Self {
            quotad: Quotad::new(setup),
        }
    }
}

impl LlmStrategy for CheckThenCharge {
    fn advance(&mut self, world: &World, t_ms: u64) {
        self.quotad.advance(world, t_ms);
    }

    fn start(&mut self, world: &World, t_ms: u64, req: &LlmRequest) -> Option<Hold> {
        self.quotad
            .peek(world, t_ms, &req.check(req.estimate))
            .then_some(Hold {
                region: req.region,
                tokens: 0,
            })
    }

    fn end(&mut self, world: &World, t_ms: u64, req: &LlmRequest, _hold: Hold) -> u64 {
        let (v, _) = self
            .quotad
            .decide_routed(world, t_ms, &req.check(req.actual));
        if v.allowed {
            0
        } else {
            u64::from(req.actual)
        }
    }
}
