//! Traffic: tenants, the sources that send their requests, and the arrivals of each tick.
//!
//! A [`Source`] is one stream of requests of one tenant in one region over a time span. Each
//! tick, every active source draws a Poisson count of requests; the requests of one tenant are
//! then interleaved round-robin across regions, so neither the shadow global bucket nor any
//! strategy favours a region merely by the order in which a tick is replayed. Every strategy
//! sees the very same list.

use quota_core::Policy;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::world::RegionIx;

/// A tenant (or a one-shot identity) and its policy. `critical` tenants are pinned to their
/// busiest region by `quotad_pinned`.
#[derive(Debug, Clone)]
pub struct Tenant {
    pub policy: Policy,
}

/// How a source's rate varies over time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Shape {
    Constant,
    /// Sends only during the first `burst_ms` of every minute (cron jobs on synchronised
    /// clocks), at its full rate.
    MinuteBurst {
        burst_ms: u64,
    },
}

/// The cost of each request: `base`, or `heavy` with probability `p_heavy`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    pub base: u32,
    pub heavy: u32,
    pub p_heavy: f64,
}

impl Cost {
    /// Every request costs one token.
    pub const UNIT: Cost = Cost {
        base: 1,
        heavy: 1,
        p_heavy: 0.0,
    };
}

/// One stream of requests: `rate_per_s` requests a second on average over `[from_ms, until_ms)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Source {
    pub tenant: u32,
    pub region: RegionIx,
    pub rate_per_s: f64,
    pub from_ms: u64,
    pub until_ms: u64,
    pub shape: Shape,
    pub cost: Cost,
}

/// One request: who, where, and how many tokens it costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub tenant: u32,
    pub region: RegionIx,
    pub cost: u32,
}

/// A Poisson draw: Knuth's product method for small means, a rounded normal above 30.
pub fn poisson(rng: &mut ChaCha8Rng, mean: f64) -> u32 {
    if mean <= 0.0 {
        0
    } else if mean < 30.0 {
        let limit = (-mean).exp();
        let mut k = 0;
        let mut p: f64 = rng.random();
        while p > limit {
            k += 1;
            p *= rng.random::<f64>();
        }
        k
    } else {
        // Box–Muller; accurate enough for arrival counts in the hundreds.
        let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = rng.random();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        (mean + mean.sqrt() * z).round().max(0.0) as u32
    }
}

/// Produces the arrivals of each tick from a fixed set of sources.
#[derive(Debug)]
pub struct Arrivals {
    /// Sorted by start time.
    sources: Vec<Source>,
    next: usize,
    /// Indices of the active sources, sorted by (tenant, region).
    active: Vec<usize>,
    counts: Vec<u32>,
    rng: ChaCha8Rng,
}

impl Arrivals {
    pub fn new(mut sources: Vec<Source>, rng: ChaCha8Rng) -> Self {
        sources.sort_by_key(|s| (s.from_ms, s.tenant, s.region));
        Self {
            sources,
            next: 0,
            active: Vec::new(),
            counts: Vec::new(),
            rng,
        }
    }

    /// Fills `out` with the requests arriving in the tick `[t_ms, t_ms + dt_ms)`.
    pub fn tick(&mut self, t_ms: u64, dt_ms: u64, out: &mut Vec<Request>) {
        out.clear();
        let mut changed = false;
        while self.next < self.sources.len() && self.sources[self.next].from_ms <= t_ms {
            self.active.push(self.next);
            self.next += 1;
            changed = true;
        }
        let before = self.active.len();
        let sources = &self.sources;
        self.active.retain(|&i| sources[i].until_ms > t_ms);
        if changed || self.active.len() != before {
            self.active
                .sort_by_key(|&i| (sources[i].tenant, sources[i].region));
        }
        self.counts.clear();
        for &i in &self.active {
            let s = &self.sources[i];
            let on = match s.shape {
                Shape::Constant => true,
                Shape::MinuteBurst { burst_ms } => t_ms % 60_000 < burst_ms,
            };
            let mean = if on {
                s.rate_per_s * dt_ms as f64 / 1000.0
            } else {
                0.0
            };
            self.counts.push(poisson(&mut self.rng, mean));
        }
        // Interleave each tenant's requests round-robin across its sources.
        let mut g = 0;
        while g < self.active.len() {
            let tenant = self.sources[self.active[g]].tenant;
            let mut end = g;
            while end < self.active.len() && self.sources[self.active[end]].tenant == tenant {
                end += 1;
            }
            loop {
                let mut any = false;
                for k in g..end {
                    if self.counts[k] == 0 {
                        continue;
                    }
                    self.counts[k] -= 1;
                    any = true;
                    let s = &self.sources[self.active[k]];
                    let cost = if s.cost.p_heavy > 0.0 && self.rng.random_bool(s.cost.p_heavy) {
                        s.cost.heavy
                    } else {
                        s.cost.base
                    };
                    out.push(Request {
                        tenant,
                        region: s.region,
                        cost,
                    });
                }
                if !any {
                    break;
                }
            }
            g = end;
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    fn source(tenant: u32, region: RegionIx, rate_per_s: f64) -> Source {
        Source {
            tenant,
            region,
            rate_per_s,
            from_ms: 0,
            until_ms: u64::MAX,
            shape: Shape::Constant,
            cost: Cost::UNIT,
        }
    }

    #[test]
    fn poisson_means_are_right() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for mean in [0.3, 4.0, 80.0] {
            let n = 20_000;
            let sum: u64 = (0..n).map(|_| u64::from(poisson(&mut rng, mean))).sum();
            let got = sum as f64 / f64::from(n);
            assert!((got - mean).abs() < 0.05 * mean, "mean {mean}: got {got}");
        }
    }

    #[test]
    fn a_tenants_requests_alternate_between_regions() {
        let mut a = Arrivals::new(
            vec![source(0, 0, 1000.0), source(0, 1, 1000.0)],
            ChaCha8Rng::seed_from_u64(1),
        );
        let mut out = Vec::new();
        a.tick(0, 10, &mut out);
        assert!(out.len() > 10);
        // The first requests alternate while both regions still have some.
        assert_eq!(out[0].region, 0);
        assert_eq!(out[1].region, 1);
        assert_eq!(out[2].region, 0);
    }

    #[test]
    fn sources_start_and_stop_and_bursts_follow_the_minute() {
        let mut s = source(1, 0, 10_000.0);
        s.from_ms = 100;
        s.until_ms = 200;
        let mut b = source(2, 0, 10_000.0);
        b.shape = Shape::MinuteBurst { burst_ms: 1000 };
        let mut a = Arrivals::new(vec![s, b], ChaCha8Rng::seed_from_u64(2));
        let mut out = Vec::new();
        a.tick(0, 10, &mut out);
        assert!(out.iter().all(|r| r.tenant == 2));
        a.tick(150, 10, &mut out);
        assert!(out.iter().any(|r| r.tenant == 1));
        a.tick(2000, 10, &mut out);
        assert!(
            out.is_empty(),
            "past the burst and the span nothing arrives"
        );
        a.tick(60_000, 10, &mut out);
        assert!(!out.is_empty() && out.iter().all(|r| r.tenant == 2));
    }
}
