//! The world: regions, the WAN between them, their drifting clocks and the faults that strike
//! them. Virtual time only: `t_ms` is the true time of the simulation; each region reads its own
//! drifted clock through [`World::local_ms`].

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::faults::Faults;
pub use crate::region::RegionIx;

/// The one-way time of a local Redis round trip, in microseconds (a decision in-region).
pub const LOCAL_DECISION_US: u64 = 500;

/// A region's clock: `local = t + offset + t · drift_ppm / 10^6`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Clock {
    pub offset_ms: u64,
    /// Rate error in parts per million; positive runs fast.
    pub drift_ppm: i64,
}

impl Clock {
    /// The local reading at true time `t_ms`. Monotonic for |drift| < 10^6.
    pub fn local_ms(&self, t_ms: u64) -> u64 {
        let skew = i128::from(t_ms) * i128::from(self.drift_ppm) / 1_000_000;
        (i128::from(t_ms) + i128::from(self.offset_ms) + skew).max(0) as u64
    }
}

/// How the world is drawn from the seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct WorldSpec {
    pub regions: usize,
    pub rtt_min_ms: u64,
    pub rtt_max_ms: u64,
    /// Every clock drifts by at most this much (ordinary NTP-disciplined hosts).
    pub drift_ppm_max: i64,
}

impl Default for WorldSpec {
    fn default() -> Self {
        Self {
            regions: 3,
            rtt_min_ms: 50,
            rtt_max_ms: 150,
            drift_ppm_max: 100,
        }
    }
}

/// Regions, latencies, clocks and faults of one run.
#[derive(Debug, Clone, Serialize)]
pub struct World {
    pub regions: usize,
    rtt_ms: Vec<u64>,
    pub clocks: Vec<Clock>,
    pub faults: Faults,
}

impl World {
    /// Draws the latency matrix and the clocks from `rng`.
    pub fn new(spec: &WorldSpec, faults: Faults, rng: &mut ChaCha8Rng) -> Self {
        let n = spec.regions;
        let mut rtt_ms = vec![0; n * n];
        for a in 0..n {
            for b in a + 1..n {
                let rtt = rng.random_range(spec.rtt_min_ms..=spec.rtt_max_ms);
                rtt_ms[a * n + b] = rtt;
                rtt_ms[b * n + a] = rtt;
            }
        }
        let clocks = (0..n)
            .map(|_| Clock {
                offset_ms: rng.random_range(0..=200),
                drift_ppm: rng.random_range(-spec.drift_ppm_max..=spec.drift_ppm_max),
            })
            .collect();
        Self {
            regions: n,
            rtt_ms,
            clocks,
            faults,
        }
    }

    /// The WAN round trip between two regions (0 within one).
    pub fn rtt_ms(&self, a: RegionIx, b: RegionIx) -> u64 {
        self.rtt_ms[a * self.regions + b]
    }

    /// One-way delay between two regions.
    pub fn owd_ms(&self, a: RegionIx, b: RegionIx) -> u64 {
        self.rtt_ms(a, b) / 2
    }

    /// The clock of `region` read at true time `t_ms`.
    pub fn local_ms(&self, region: RegionIx, t_ms: u64) -> u64 {
        self.clocks[region].local_ms(t_ms)
    }

    /// Whether a message from `a` to `b` gets through at `t_ms`.
    pub fn link_up(&self, a: RegionIx, b: RegionIx, t_ms: u64) -> bool {
        a == b || !(self.faults.isolated(a, t_ms) || self.faults.isolated(b, t_ms))
    }

    /// Whether the daemons of `region` run at `t_ms`.
    pub fn daemon_up(&self, region: RegionIx, t_ms: u64) -> bool {
        self.faults.daemon_up(region, t_ms)
    }

    /// Whether the Redis of `region` answers at `t_ms`.
    pub fn redis_up(&self, region: RegionIx, t_ms: u64) -> bool {
        self.faults.redis_up(region, t_ms)
    }

    /// How many daemons `region` runs (see [`Faults::daemons`]).
    pub fn daemons(&self, region: RegionIx) -> usize {
        self.faults.daemons(region)
    }

    /// The round trip after which a proposal by `leader` at `t_ms` reaches a majority (the
    /// k-th fastest reachable follower), or `None` when the leader is down or reaches no
    /// majority.
    pub fn quorum_rtt_ms(&self, leader: RegionIx, t_ms: u64) -> Option<u64> {
        if !self.daemon_up(leader, t_ms) {
            return None;
        }
        let needed = self.regions / 2; // followers needed besides the leader
        if needed == 0 {
            return Some(0);
        }
        let mut rtts: Vec<u64> = (0..self.regions)
            .filter(|&p| p != leader && self.daemon_up(p, t_ms) && self.link_up(leader, p, t_ms))
            .map(|p| self.rtt_ms(leader, p))
            .collect();
        rtts.sort_unstable();
        rtts.get(needed - 1).copied()
    }

    /// The largest clock-rate error of any region, in ppm (what a lease margin must cover).
    pub fn max_drift_ppm(&self) -> u64 {
        self.clocks
            .iter()
            .map(|c| c.drift_ppm.unsigned_abs())
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;
    use crate::faults::Fault;

    #[test]
    fn latencies_are_symmetric_and_in_range() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let spec = WorldSpec {
            regions: 5,
            ..WorldSpec::default()
        };
        let w = World::new(&spec, Faults::default(), &mut rng);
        for a in 0..5 {
            assert_eq!(w.rtt_ms(a, a), 0);
            for b in 0..5 {
                assert_eq!(w.rtt_ms(a, b), w.rtt_ms(b, a));
                if a != b {
                    assert!((50..=150).contains(&w.rtt_ms(a, b)));
                }
            }
        }
    }

    #[test]
    fn drifting_clocks_run_fast_or_slow() {
        let fast = Clock {
            offset_ms: 0,
            drift_ppm: 10_000,
        };
        let slow = Clock {
            offset_ms: 5,
            drift_ppm: -10_000,
        };
        assert_eq!(fast.local_ms(100_000), 101_000);
        assert_eq!(slow.local_ms(100_000), 99_005);
    }

    #[test]
    fn isolation_cuts_every_link_of_the_region() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let faults = Faults {
            list: vec![Fault::Isolate {
                region: 2,
                from_ms: 10,
                until_ms: 20,
            }],
        };
        let w = World::new(&WorldSpec::default(), faults, &mut rng);
        assert!(w.link_up(0, 1, 15));
        assert!(!w.link_up(0, 2, 15) && !w.link_up(2, 1, 15));
        assert!(w.link_up(2, 2, 15) && w.link_up(0, 2, 20));
    }
}
