//! The ways `per_subject` decides a subject's check, side by side on the same arrivals.

use std::fmt;

use quota_core::bucket::UT;
use quota_core::{BucketParams, PPM};
use serde::Serialize;

use super::buckets::Buckets;
use super::coordinator::{Coordinator, PromotionConfig};
use super::population::{Population, Request};
use crate::world::{RegionIx, World};

/// The strategies, in table order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SubjectStrategyKind {
    /// Every region enforces the whole per-subject limit: no coordination, up to N×.
    Local,
    /// Every region enforces 1/N of it.
    Even,
    /// quotad's class shares alone: one share vector per class from aggregate demand.
    ClassShares,
    /// quotad: class shares plus promotion of subjects denied at their class share.
    Quotad,
}

impl SubjectStrategyKind {
    pub const ALL: [Self; 4] = [Self::Local, Self::Even, Self::ClassShares, Self::Quotad];

    pub fn name(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Even => "even",
            Self::ClassShares => "class_shares",
            Self::Quotad => "quotad",
        }
    }
}

impl fmt::Display for SubjectStrategyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A decision and whether another region made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub allowed: bool,
    pub forwarded: bool,
}

/// One strategy: each region's buckets, and for quotad's variants the coordinator.
#[derive(Debug)]
pub struct SubjectStrategy {
    pub kind: SubjectStrategyKind,
    buckets: Vec<Buckets>,
    pub coordinator: Option<Coordinator>,
    /// Live buckets over all regions, sampled every second: the most seen.
    pub peak_live: usize,
}

impl SubjectStrategy {
    pub fn new(
        kind: SubjectStrategyKind,
        world: &World,
        pop: &Population,
        promotion: PromotionConfig,
        report_ms: u64,
        rebalance_ms: u64,
    ) -> Self {
        let coordinator = match kind {
            SubjectStrategyKind::Local | SubjectStrategyKind::Even => None,
            SubjectStrategyKind::ClassShares => Some(PromotionConfig {
                enabled: false,
                ..promotion
            }),
            SubjectStrategyKind::Quotad => Some(promotion),
        }
        .map(|cfg| Coordinator::new(world, pop, cfg, report_ms, rebalance_ms));
        Self {
            kind,
            buckets: (0..world.regions).map(|_| Buckets::default()).collect(),
            coordinator,
            peak_live: 0,
        }
    }

    /// Runs the control plane up to `t_ms`.
    pub fn advance(&mut self, t_ms: u64) {
        if let Some(c) = &mut self.coordinator {
            c.advance(t_ms);
        }
    }

    /// Forgets idle buckets at `t_ms` and samples how many are live.
    pub fn expire(&mut self, t_ms: u64) {
        let live: usize = self.buckets.iter_mut().map(|b| b.expire(t_ms)).sum();
        self.peak_live = self.peak_live.max(live);
    }

    /// Decides `req`.
    pub fn decide(&mut self, world: &World, pop: &Population, req: &Request) -> Verdict {
        let subject = &pop.subjects[req.subject as usize];
        let policy = &pop.classes[usize::from(subject.class)].policy;
        let n = world.regions;
        let (t, here, s) = (req.t_ms, req.region, req.subject);
        let Some(coord) = &mut self.coordinator else {
            let share = match self.kind {
                SubjectStrategyKind::Local => PPM,
                _ => PPM / n as u32,
            };
            let params = BucketParams::for_share(policy, share);
            return Verdict {
                allowed: self.buckets[here].decide(t, s, &params),
                forwarded: false,
            };
        };
        let (shares, promoted) = coord.views[here].shares(subject.class, s);
        let holds = |share: u32| BucketParams::for_share(policy, share).capacity_ut >= UT;
        // A region whose share cannot hold one check forwards it to the region granted the
        // most (a home region, for a class too small to split).
        let at: RegionIx = if holds(shares[here]) {
            here
        } else {
            (0..n)
                .filter(|&r| r != here && holds(shares[r]))
                .max_by_key(|&r| (shares[r], std::cmp::Reverse(r)))
                .unwrap_or(here)
        };
        // The region that decides uses its own view of its share.
        let share = if at == here {
            shares[here]
        } else {
            coord.views[at].shares(subject.class, s).0[at]
        };
        let params = BucketParams::for_share(policy, share);
        let when = t + world.owd_ms(here, at);
        let allowed = self.buckets[at].decide(when, s, &params);
        coord.count(here, s, promoted, allowed);
        Verdict {
            allowed,
            forwarded: at != here,
        }
    }
}
