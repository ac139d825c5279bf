//! Fixed shares, never rebalanced: every region enforces the same fraction of each tenant's
//! budget in its own Redis, with local decisions and no coordination.
//!
//! - `independent` (the whole budget in every region): up to N× the budget admitted worldwide.
//! - `static_split` (budget / N for ever): never overshoots (beyond clock drift), but a region
//!   holding most of the demand gets only 1/N of the budget.

use quota_core::{BucketParams, PPM};

use super::{Setup, Strategy, Verdict};
use crate::regional_store::RegionalStores;
use crate::traffic::{Request, Tenant};
use crate::world::{World, LOCAL_DECISION_US};

#[derive(Debug)]
pub struct FixedShare {
    tenants: Vec<Tenant>,
    params: Vec<BucketParams>,
    stores: RegionalStores,
}

impl FixedShare {
    /// Every region enforces the whole budget (`independent`).
    pub fn independent(setup: &Setup<'_>) -> Self {
        Self::new(setup, PPM)
    }

    /// Every region enforces budget / N (`static_split`).
    pub fn static_split(setup: &Setup<'_>) -> Self {
        Self::new(setup, PPM / setup.world.regions as u32)
    }

    fn new(setup: &Setup<'_>, share_ppm: u32) -> Self {
        Self {
            tenants: setup.tenants.to_vec(),
            params: setup
                .tenants
                .iter()
                .map(|t| BucketParams::for_share(&t.policy, share_ppm))
                .collect(),
            stores: RegionalStores::new(setup.world.regions, setup.tenants.len()),
        }
    }
}

impl Strategy for FixedShare {
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
        Verdict::against(allowed, &self.params[i], req.cost, LOCAL_DECISION_US)
    }
}
