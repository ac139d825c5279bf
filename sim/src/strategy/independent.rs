//! `independent`: every region enforces the tenant's whole budget in its own Redis. Local
//! decisions, no coordination, and up to N× the budget admitted worldwide.

use quota_core::BucketParams;

use super::{Setup, Strategy, Verdict};
use crate::regional_store::RegionalStores;
use crate::traffic::{Request, Tenant};
use crate::world::{World, LOCAL_DECISION_US};

#[derive(Debug)]
pub struct Independent {
    tenants: Vec<Tenant>,
    params: Vec<BucketParams>,
    stores: RegionalStores,
}

impl Independent {
    pub fn new(setup: &Setup<'_>) -> Self {
        Self {
            tenants: setup.tenants.to_vec(),
            params: setup
                .tenants
                .iter()
                .map(|t| BucketParams::global(&t.policy))
                .collect(),
            stores: RegionalStores::new(setup.world.regions, setup.tenants.len()),
        }
    }
}

impl Strategy for Independent {
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
