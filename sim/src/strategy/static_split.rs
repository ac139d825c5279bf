//! `static_split`: every region enforces budget / N for ever. Never overshoots (beyond clock
//! drift), but a region holding most of the demand gets only 1/N of the budget.

use quota_core::{BucketParams, PPM};

use super::{Setup, Strategy, Verdict};
use crate::regional_store::RegionalStores;
use crate::traffic::{Request, Tenant};
use crate::world::{World, LOCAL_DECISION_US};

#[derive(Debug)]
pub struct StaticSplit {
    tenants: Vec<Tenant>,
    params: Vec<BucketParams>,
    stores: RegionalStores,
}

impl StaticSplit {
    pub fn new(setup: &Setup<'_>) -> Self {
        let share = PPM / setup.world.regions as u32;
        Self {
            tenants: setup.tenants.to_vec(),
            params: setup
                .tenants
                .iter()
                .map(|t| BucketParams::for_share(&t.policy, share))
                .collect(),
            stores: RegionalStores::new(setup.world.regions, setup.tenants.len()),
        }
    }
}

impl Strategy for StaticSplit {
    fn advance(&mut self, world: &World, t_ms: u64) {
        self.stores.advance(world, t_ms);
    }

    fn decide(&mut self, world: &World, t_ms: u64, req: &Request) -> Verdict {
        let i = req.tenant as usize;
        let allowed = self.stores.decide(
            req.region,
            req.tenant,
            self.tenants[i].policy.fail_mode,
            world.local_ms(req.region, t_ms),
            &self.params[i],
            req.cost,
        );
        Verdict {
            allowed,
            latency_us: LOCAL_DECISION_US,
        }
    }
}
