//! The subjects of `per_subject`: two classes (plans' policies), each subject's demand and
//! where it comes from, and the arrivals they make.
//!
//! Demand is Zipf over each class's organic subjects: the subject of rank k asks, on average,
//! `ZIPF_TOP · k^−ZIPF_EXPONENT` of its limit. Organic subjects come in sessions (on for a
//! minute on average, then off for a minute: twice their mean rate while on), so heavy subjects
//! appear and go idle, which is what promotion and eviction must follow. 95% of subjects send
//! from one region each (regions unevenly loaded: region r holds weight N − r), 5% spread every
//! request over all regions. Attackers are always on, at 3–10× their limit, half in one region
//! and half spread.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use quota_core::{Policy, PolicySpec};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::world::RegionIx;

/// Mean demand of a class's busiest organic subject, as a fraction of its limit.
pub const ZIPF_TOP: f64 = 1.0;
/// The Zipf exponent of organic demand.
pub const ZIPF_EXPONENT: f64 = 0.6;
/// Fraction of subjects that spread their requests over every region.
pub const SPREAD_FRACTION: f64 = 0.05;
/// Mean length of an organic subject's session and of the pause after it.
pub const SESSION_MS: f64 = 60_000.0;
pub const PAUSE_MS: f64 = 60_000.0;

/// One class: a plan's policy, applied to every subject of the plan.
#[derive(Debug, Clone)]
pub struct Class {
    pub name: &'static str,
    pub policy: Policy,
    /// Subjects of the class, attackers included.
    pub subjects: usize,
}

/// Where a subject's requests come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Every request from one region.
    One(RegionIx),
    /// Each request from a region drawn uniformly.
    Spread,
}

/// One subject: its class, placement and demand.
#[derive(Debug, Clone, Copy)]
pub struct Subject {
    pub class: u8,
    pub placement: Placement,
    /// Requests per ms while on.
    pub rate_per_ms: f64,
    /// Attackers never pause.
    pub attacker: bool,
}

/// The whole population.
#[derive(Debug, Clone)]
pub struct Population {
    pub regions: usize,
    pub classes: Vec<Class>,
    pub subjects: Vec<Subject>,
}

fn policy(limit: u64, window_ms: u64, burst: u64) -> Policy {
    PolicySpec {
        limit: limit as f64,
        window_ms: window_ms as f64,
        burst: Some(burst as f64),
        ..PolicySpec::default()
    }
    .validate()
    .expect("the scenario's policies are valid")
}

/// Draws an exponential variate of mean `mean`.
pub fn exp(rng: &mut ChaCha8Rng, mean: f64) -> f64 {
    -(1.0 - rng.random::<f64>()).ln() * mean
}

impl Population {
    /// `api` (100 a minute, burst 20) for `subjects` subjects and `login` (5 per 15 minutes,
    /// burst 5) for a fifth as many, each with 4 (api) or 2 (login) attackers in one region and
    /// as many spread.
    pub fn build(regions: usize, subjects: usize, rng: &mut ChaCha8Rng) -> Self {
        let mut p = Self {
            regions,
            classes: Vec::new(),
            subjects: Vec::new(),
        };
        p.add_class("api", policy(100, 60_000, 20), subjects, 4, rng);
        p.add_class("login", policy(5, 900_000, 5), subjects / 5, 2, rng);
        p
    }

    fn region(&self, rng: &mut ChaCha8Rng) -> RegionIx {
        // Region r weighs N − r: mixed, and not evenly.
        let n = self.regions;
        let total = n * (n + 1) / 2;
        let mut x = rng.random_range(0..total);
        for r in 0..n {
            let w = n - r;
            if x < w {
                return r;
            }
            x -= w;
        }
        n - 1
    }

    fn add_class(
        &mut self,
        name: &'static str,
        policy: Policy,
        organic: usize,
        attackers_each: usize,
        rng: &mut ChaCha8Rng,
    ) {
        let class = self.classes.len() as u8;
        let limit_per_ms = policy.limit as f64 / policy.window_ms as f64;
        let duty = SESSION_MS / (SESSION_MS + PAUSE_MS);
        for k in 1..=organic {
            let mean = ZIPF_TOP * (k as f64).powf(-ZIPF_EXPONENT) * limit_per_ms;
            let placement = if rng.random::<f64>() < SPREAD_FRACTION {
                Placement::Spread
            } else {
                Placement::One(self.region(rng))
            };
            self.subjects.push(Subject {
                class,
                placement,
                rate_per_ms: mean / duty,
                attacker: false,
            });
        }
        for a in 0..2 * attackers_each {
            let times = rng.random_range(3.0..=10.0);
            let placement = if a < attackers_each {
                Placement::One(self.region(rng))
            } else {
                Placement::Spread
            };
            self.subjects.push(Subject {
                class,
                placement,
                rate_per_ms: times * limit_per_ms,
                attacker: true,
            });
        }
        self.classes.push(Class {
            name,
            policy,
            subjects: organic + 2 * attackers_each,
        });
    }

    /// Subjects of class `c`.
    pub fn class_size(&self, c: u8) -> usize {
        self.classes[usize::from(c)].subjects
    }
}

/// One check: subject `subject` asks for one token in `region` at `t_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub t_ms: u64,
    pub subject: u32,
    pub region: RegionIx,
}

/// A subject's session clock.
#[derive(Debug, Clone, Copy)]
struct Sessions {
    /// The current or next session runs over `[on_from, on_until)`.
    on_from: f64,
    on_until: f64,
    /// The time of the subject's next request.
    next: f64,
}

/// Every subject's requests in time order, drawn lazily: a heap holds each subject's next one.
#[derive(Debug)]
pub struct Arrivals {
    subjects: Vec<Subject>,
    regions: usize,
    sessions: Vec<Sessions>,
    heap: BinaryHeap<Reverse<(u64, u32)>>,
    rng: ChaCha8Rng,
    until_ms: u64,
}

impl Arrivals {
    /// Arrivals over `[0, until_ms)`.
    pub fn new(pop: &Population, until_ms: u64, rng: ChaCha8Rng) -> Self {
        let mut a = Self {
            subjects: pop.subjects.clone(),
            regions: pop.regions,
            sessions: Vec::with_capacity(pop.subjects.len()),
            heap: BinaryHeap::new(),
            rng,
            until_ms,
        };
        let duty = SESSION_MS / (SESSION_MS + PAUSE_MS);
        for (i, s) in pop.subjects.iter().enumerate() {
            let (on_from, on_until) = if s.attacker {
                (0.0, f64::INFINITY)
            } else if a.rng.random::<f64>() < duty {
                (0.0, exp(&mut a.rng, SESSION_MS))
            } else {
                let from = exp(&mut a.rng, PAUSE_MS);
                (from, from + exp(&mut a.rng, SESSION_MS))
            };
            a.sessions.push(Sessions {
                on_from,
                on_until,
                next: 0.0,
            });
            a.schedule(i, on_from);
        }
        a
    }

    /// Draws subject `i`'s next request after `from` and queues it if it is in the run.
    fn schedule(&mut self, i: usize, from: f64) {
        let rate = self.subjects[i].rate_per_ms;
        if rate <= 0.0 {
            return;
        }
        let mut t = from;
        loop {
            let s = &mut self.sessions[i];
            if t < s.on_from {
                t = s.on_from;
            }
            let next = t + exp(&mut self.rng, 1.0 / rate);
            let s = &mut self.sessions[i];
            if next < s.on_until {
                t = next;
                break;
            }
            // The session ended first: the next one starts after a pause.
            t = s.on_until;
            s.on_from = t + exp(&mut self.rng, PAUSE_MS);
            s.on_until = s.on_from + exp(&mut self.rng, SESSION_MS);
            if s.on_from >= self.until_ms as f64 {
                return;
            }
        }
        if t < self.until_ms as f64 {
            self.sessions[i].next = t;
            self.heap.push(Reverse((t as u64, i as u32)));
        }
    }

    /// The next request, or `None` at the end of the run.
    pub fn next_request(&mut self) -> Option<Request> {
        let Reverse((t_ms, subject)) = self.heap.pop()?;
        let i = subject as usize;
        let region = match self.subjects[i].placement {
            Placement::One(r) => r,
            Placement::Spread => self.rng.random_range(0..self.regions),
        };
        let from = self.sessions[i].next;
        self.schedule(i, from);
        Some(Request {
            t_ms,
            subject,
            region,
        })
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn demand_is_zipf_and_placed_as_described() {
        let pop = Population::build(3, 20_000, &mut ChaCha8Rng::seed_from_u64(1));
        assert_eq!(pop.classes.len(), 2);
        assert_eq!(pop.class_size(0), 20_008);
        assert_eq!(pop.class_size(1), 4_004);
        let api = &pop.subjects[..20_000];
        assert!(api[0].rate_per_ms > 10.0 * api[999].rate_per_ms);
        let spread = api
            .iter()
            .filter(|s| s.placement == Placement::Spread)
            .count();
        assert!((800..1_200).contains(&spread), "{spread} spread");
        let in0 = api
            .iter()
            .filter(|s| s.placement == Placement::One(0))
            .count();
        let in2 = api
            .iter()
            .filter(|s| s.placement == Placement::One(2))
            .count();
        assert!(in0 > 2 * in2, "region 0: {in0}, region 2: {in2}");
    }

    #[test]
    fn arrivals_come_in_time_order_and_stop_at_the_end() {
        let pop = Population::build(3, 2_000, &mut ChaCha8Rng::seed_from_u64(2));
        let mut a = Arrivals::new(&pop, 60_000, ChaCha8Rng::seed_from_u64(3));
        let mut last = 0;
        let mut n = 0;
        while let Some(r) = a.next_request() {
            assert!(r.t_ms >= last && r.t_ms < 60_000 && r.region < 3);
            last = r.t_ms;
            n += 1;
        }
        assert!(n > 1_000, "{n} requests");
    }
}
