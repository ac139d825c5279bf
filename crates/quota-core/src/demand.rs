//! Demand estimates: the leader's soft state, fed by region usage reports.
//!
//! Demand is admitted plus denied tokens (a denial is unmet demand), as a rate in micro-tokens
//! per second, smoothed with an exponential moving average so one noisy interval does not move
//! shares. None of this is replicated: a new leader relearns it within a few report intervals
//! while the allocation in force stays safe. A policy a region stops reporting decays towards
//! zero and is dropped once every region's estimate is zero, so memory stays bounded by the
//! policies with traffic.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::bucket::UT;
use crate::coordinator::{CoordinatorState, PolicyKey};
use crate::policy::PPM;
use crate::split::MAX_REGIONS;

/// One region's usage of one policy over a report interval, in whole tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Usage {
    pub admitted: u64,
    pub denied: u64,
}

/// Smoothed demand per policy and region slot, in micro-tokens per second.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemandTracker {
    alpha_ppm: u32,
    estimates: BTreeMap<PolicyKey, Vec<u64>>,
}

impl DemandTracker {
    /// A tracker whose moving average weighs a new sample by `alpha_ppm` (clamped to 1..=PPM).
    pub fn new(alpha_ppm: u32) -> Self {
        Self {
            alpha_ppm: alpha_ppm.clamp(1, PPM),
            estimates: BTreeMap::new(),
        }
    }

    /// Folds in one region's report for an interval. Policies the report leaves out count as
    /// zero demand from that region. Reports from slots beyond [`MAX_REGIONS`] or with a zero
    /// interval are ignored.
    pub fn record(&mut self, region: u8, interval_ms: u64, report: &[(PolicyKey, Usage)]) {
        let r = usize::from(region);
        if r >= MAX_REGIONS || interval_ms == 0 {
            return;
        }
        let mut sorted: Vec<(&PolicyKey, u64)> = report
            .iter()
            .map(|(k, u)| {
                let tokens = u128::from(u.admitted) + u128::from(u.denied);
                let rate = tokens * u128::from(UT) * 1000 / u128::from(interval_ms);
                (k, rate.min(u128::from(u64::MAX)) as u64)
            })
            .collect();
        sorted.sort_by(|a, b| a.0.cmp(b.0));
        sorted.dedup_by(|b, a| {
            if a.0 == b.0 {
                a.1 = a.1.saturating_add(b.1);
                true
            } else {
                false
            }
        });
        let alpha = u128::from(self.alpha_ppm);
        let mut fresh = Vec::new();
        let mut samples = sorted.into_iter().peekable();
        for (key, rates) in self.estimates.iter_mut() {
            while let Some((k, s)) = samples.next_if(|(k, _)| *k < key) {
                fresh.push((k, s));
            }
            let sample = samples.next_if(|(k, _)| *k == key).map_or(0, |(_, s)| s);
            if rates.len() <= r {
                rates.resize(r + 1, 0);
                rates[r] = sample;
                continue;
            }
            let old = rates[r];
            rates[r] = if sample >= old {
                old + ((u128::from(sample - old) * alpha).div_ceil(u128::from(PPM))) as u64
            } else {
                old - ((u128::from(old - sample) * alpha).div_ceil(u128::from(PPM))) as u64
            };
        }
        fresh.extend(samples);
        for (key, sample) in fresh {
            if sample > 0 {
                let mut rates = vec![0; r + 1];
                rates[r] = sample;
                self.estimates.insert(key.clone(), rates);
            }
        }
        self.estimates
            .retain(|_, rates| rates.iter().any(|&d| d > 0));
    }

    /// Drops estimates of policies the state no longer has.
    pub fn retain_known(&mut self, state: &CoordinatorState) {
        self.estimates
            .retain(|k, _| state.entries.get(k).is_some_and(|e| !e.deleted));
    }

    /// The estimate for one policy: micro-tokens per second per region slot.
    pub fn get(&self, key: &PolicyKey) -> Option<&[u64]> {
        self.estimates.get(key).map(Vec::as_slice)
    }

    /// Every estimate, in key order (the allocator merge-joins this with the state).
    pub fn iter(&self) -> impl Iterator<Item = (&PolicyKey, &[u64])> {
        self.estimates.iter().map(|(k, v)| (k, v.as_slice()))
    }

    /// How many policies have a non-zero estimate.
    pub fn len(&self) -> usize {
        self.estimates.len()
    }

    /// True when no policy has demand.
    pub fn is_empty(&self) -> bool {
        self.estimates.is_empty()
    }

    /// Sets an estimate directly (tests, benchmarks, a simulator's oracle).
    pub fn set(&mut self, key: PolicyKey, rates_ut_per_s: Vec<u64>) {
        self.estimates.insert(key, rates_ut_per_s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{PolicyName, TenantId};

    fn key(t: &str) -> PolicyKey {
        PolicyKey::new(TenantId::new(t).unwrap(), PolicyName::new("w").unwrap())
    }

    #[test]
    fn first_sample_is_taken_then_smoothed_and_missing_decays() {
        let mut d = DemandTracker::new(500_000);
        // 10 tokens in 1 s = 10 tokens/s.
        d.record(
            1,
            1000,
            &[(
                key("a"),
                Usage {
                    admitted: 6,
                    denied: 4,
                },
            )],
        );
        assert_eq!(d.get(&key("a")), Some(&[0, 10 * UT][..]));
        d.record(
            1,
            1000,
            &[(
                key("a"),
                Usage {
                    admitted: 20,
                    denied: 10,
                },
            )],
        );
        assert_eq!(d.get(&key("a")).unwrap()[1], 20 * UT);
        // Absent from the next reports: halves each time and is finally dropped.
        d.record(1, 1000, &[]);
        assert_eq!(d.get(&key("a")).unwrap()[1], 10 * UT);
        for _ in 0..60 {
            d.record(
                1,
                1000,
                &[(
                    key("b"),
                    Usage {
                        admitted: 1,
                        denied: 0,
                    },
                )],
            );
        }
        assert_eq!(d.get(&key("a")), None);
        assert_eq!(d.len(), 1);
    }

    #[test]
    fn regions_are_independent_and_bad_reports_ignored() {
        let mut d = DemandTracker::new(PPM);
        d.record(
            0,
            1000,
            &[(
                key("a"),
                Usage {
                    admitted: 1,
                    denied: 0,
                },
            )],
        );
        d.record(
            2,
            500,
            &[(
                key("a"),
                Usage {
                    admitted: 1,
                    denied: 0,
                },
            )],
        );
        assert_eq!(d.get(&key("a")), Some(&[UT, 0, 2 * UT][..]));
        d.record(
            200,
            1000,
            &[(
                key("a"),
                Usage {
                    admitted: 1,
                    denied: 0,
                },
            )],
        );
        d.record(
            0,
            0,
            &[(
                key("a"),
                Usage {
                    admitted: 1,
                    denied: 0,
                },
            )],
        );
        assert_eq!(d.get(&key("a")), Some(&[UT, 0, 2 * UT][..]));
    }
}
