//! `reserve_settle_regional`: LiteLLM's and Limitador's way, per region. Every region keeps a
//! bucket of the whole budget for each tenant, without coordination. The start reserves the
//! estimate (a check that spends it); the end settles the reservation to the actual cost: the
//! difference goes back ([`quota_core::bucket::refund`]) or the excess is charged past empty
//! with no limit ([`quota_core::bucket::charge`] with a debt limit as large as the arithmetic
//! allows). A reservation expires [`RESERVATION_TTL_MS`] after it was taken: its tokens go
//! back, and a request still running then has its whole cost charged when it ends. Each of N
//! regions admits the whole budget, and nothing bounds one request's excess.

use std::collections::{HashSet, VecDeque};

use quota_core::bucket::{BucketParams, MAX_CAPACITY_UT};
use quota_core::FailMode;

use super::super::Setup;
use super::{Hold, LlmRequest, LlmStrategy};
use crate::regional_store::RegionalStores;
use crate::world::World;

/// How long a reservation lives: a request running longer is uncounted from then until it
/// ends.
pub const RESERVATION_TTL_MS: u64 = 10_000;

/// A reservation's expiry: at true time `at_ms`, `tokens` of request `id` go back to
/// `region`'s bucket of `tenant` unless the request ended.
#[derive(Debug, Clone, Copy)]
struct Expiry {
    at_ms: u64,
    id: u64,
    region: usize,
    tenant: u32,
    tokens: u64,
}

#[derive(Debug)]
pub struct ReserveSettle {
    fail_modes: Vec<FailMode>,
    /// Per tenant: the whole budget.
    params: Vec<BucketParams>,
    stores: RegionalStores,
    /// In the order taken, hence of expiry (one TTL for all).
    expiries: VecDeque<Expiry>,
    /// Reservations neither settled nor expired.
    live: HashSet<u64>,
    /// Requests whose reservation expired before they ended.
    expired: HashSet<u64>,
}

impl ReserveSettle {
    pub fn new(setup: &Setup<'_>) -> Self {
        Self {
            fail_modes: setup.tenants.iter().map(|t| t.policy.fail_mode).collect(),
            params: setup
                .tenants
                .iter()
                .map(|t| BucketParams::global(&t.policy))
                .collect(),
            stores: RegionalStores::new(setup.world.regions, setup.tenants.len()),
            expiries: VecDeque::new(),
            live: HashSet::new(),
            expired: HashSet::new(),
        }
    }

    /// Charges `cost` tokens past empty, as far as the arithmetic allows; returns what could
    /// not be charged.
    fn charge(&mut self, world: &World, t_ms: u64, region: usize, tenant: u32, cost: u64) -> u64 {
        if cost == 0 {
            return 0;
        }
        let params = self.params[tenant as usize];
        let unlimited = MAX_CAPACITY_UT - params.capacity_ut;
        let local = world.local_ms(region, t_ms);
        self.stores
            .charge_into_debt(region, tenant, local, &params, cost, unlimited)
            .unwrap_or(cost)
    }
}

impl LlmStrategy for ReserveSettle {
    fn advance(&mut self, world: &World, t_ms: u64) {
        self.stores.advance(world, t_ms);
        while let Some(e) = self.expiries.front().copied().filter(|e| e.at_ms <= t_ms) {
            self.expiries.pop_front();
            if self.live.remove(&e.id) {
                let local = world.local_ms(e.region, t_ms);
                let params = self.params[e.tenant as usize];
                self.stores
                    .refund(e.region, e.tenant, local, &params, e.tokens);
                self.expired.insert(e.id);
            }
        }
    }

    fn start(&mut self, world: &World, t_ms: u64, req: &LlmRequest) -> Option<Hold> {
        let i = req.tenant as usize;
        let local = world.local_ms(req.region, t_ms);
        let allowed = self.stores.decide(
            req.region,
            req.tenant,
            self.fail_modes[i],
            local,
            &self.params[i],
            req.estimate,
        );
        if !allowed {
            return None;
        }
        let tokens = u64::from(req.estimate);
        self.live.insert(req.id);
        self.expiries.push_back(Expiry {
            at_ms: t_ms + RESERVATION_TTL_MS,
            id: req.id,
            region: req.region,
            tenant: req.tenant,
            tokens,
        });
        Some(Hold {
            region: req.region,
            tokens,
        })
    }

    fn end(&mut self, world: &World, t_ms: u64, req: &LlmRequest, hold: Hold) -> u64 {
        let actual = u64::from(req.actual);
        if self.expired.remove(&req.id) {
            return self.charge(world, t_ms, hold.region, req.tenant, actual);
        }
        self.live.remove(&req.id);
        if actual < hold.tokens {
            let local = world.local_ms(hold.region, t_ms);
            let params = self.params[req.tenant as usize];
            self.stores.refund(
                hold.region,
                req.tenant,
                local,
                &params,
                hold.tokens - actual,
            );
            return 0;
        }
        self.charge(world, t_ms, hold.region, req.tenant, actual - hold.tokens)
    }
}
