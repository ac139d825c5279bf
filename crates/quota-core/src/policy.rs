//! Policies: what a tenant bought. A [`PolicySpec`] is untrusted input (from the admin API or a
//! config file); [`PolicySpec::validate`] turns it into a [`Policy`] or reports every problem at
//! once, so an operator fixes a request in one go.

use serde::{Deserialize, Serialize};

pub use crate::bounds::{MAX_BURST, MAX_FILL_MS, MAX_WINDOW_MS, PPM};
use crate::bounds::{MAX_RATE_UT_PER_S, MAX_WINDOW_LIMIT, MAX_WINDOW_PRODUCT, UT};

/// Service tier. `critical` tenants are pinned to the region carrying most of their demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    #[default]
    Standard,
    Critical,
}

/// What a region does when its Redis is unavailable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailMode {
    /// Decide in process with a bucket at this region's share (the default).
    #[default]
    Local,
    /// Admit everything, count it and alert.
    Open,
    /// Deny everything with 503.
    Closed,
}

/// The decision algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    #[default]
    TokenBucket,
    SlidingWindow,
    /// At most `limit` requests in flight at once, each holding a slot from its hold to its
    /// release, or for at most `window_ms` (a crashed holder's slot comes back then).
    Concurrency,
}

/// Whether a policy's denials deny.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyMode {
    /// Denials deny (the default).
    #[default]
    Enforcing,
    /// Decided and counted as usual but always admitted: a would-be denial is reported
    /// (`shadow_denied`) and counted, so a new limit can be rolled out safely.
    Shadow,
}

/// A validated policy: `limit` tokens per `window_ms`, bursting to `burst`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    pub limit: u64,
    pub window_ms: u64,
    /// Bucket capacity in whole tokens (default = limit).
    pub burst: u64,
    /// Bumped by the coordinator on every change; part of the Redis key.
    pub version: u64,
    pub tier: Tier,
    pub fail_mode: FailMode,
    /// The share reserved for each region even while it is cut off, in [`PPM`].
    pub floor_ppm: u32,
    pub algorithm: Algorithm,
    pub mode: PolicyMode,
    /// The version this one replaced (its terms changed), if any: the new bucket's first
    /// parameter write carries what the old bucket had spent. Replicated, so a daemon that
    /// restarts between the change and that write still carries it.
    pub replaces: Option<u64>,
    /// Tokens a charge for work already done may take the bucket below empty (costs known
    /// after the fact, such as LLM tokens); beyond it a charge is clamped. 0: never below empty.
    pub debt_limit: u64,
    /// Costs are known after the fact: an Envoy RLS descriptor with hits is a charge of work
    /// already done (Envoy AI Gateway's `apply_on_stream_done`), never denied, not a check.
    pub after_the_fact: bool,
}

/// Untrusted policy input. Numbers are `f64` so that negative, fractional, NaN and huge values
/// reach validation and get a precise message instead of a generic parse error.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    pub limit: f64,
    pub window_ms: f64,
    #[serde(default)]
    pub burst: Option<f64>,
    #[serde(default)]
    pub tier: Option<Tier>,
    #[serde(default)]
    pub fail_mode: Option<FailMode>,
    /// Fraction of the budget reserved for each region, in [0, 1] (default 0). It is kept in
    /// whole units: one below a token reserves nothing ([`Policy::whole_floor_ppm`]).
    #[serde(default)]
    pub floor: Option<f64>,
    #[serde(default)]
    pub algorithm: Option<Algorithm>,
    /// `enforcing` (default) or `shadow`.
    #[serde(default)]
    pub mode: Option<PolicyMode>,
    /// Tokens a charge may take the bucket below empty, 0 (default) to the burst.
    #[serde(default)]
    pub debt_limit: Option<f64>,
    /// Envoy RLS descriptors with hits are charges of work already done (default false).
    #[serde(default)]
    pub after_the_fact: Option<bool>,
}

/// One problem with a policy spec, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: &'static str,
    pub message: String,
}

/// Every problem found in a policy spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid policy: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct PolicyErrors(pub Vec<FieldError>);

fn whole(
    errors: &mut Vec<FieldError>,
    field: &'static str,
    v: f64,
    min: u64,
    max: u64,
) -> Option<u64> {
    let msg = if v.is_nan() {
        "must be a number, not NaN".to_string()
    } else if v.fract() != 0.0 || v.is_infinite() {
        format!("must be a whole number (got {v})")
    } else if v < min as f64 {
        format!("must be at least {min} (got {v})")
    } else if v > max as f64 {
        format!("must be at most {max} (got {v})")
    } else {
        return Some(v as u64);
    };
    errors.push(FieldError {
        field,
        message: msg,
    });
    None
}

impl PolicySpec {
    /// Validates the spec, reporting every problem at once. The version starts at 0; the
    /// coordinator assigns the real one.
    pub fn validate(&self) -> Result<Policy, PolicyErrors> {
        let mut errors = Vec::new();
        let limit = whole(&mut errors, "limit", self.limit, 1, MAX_BURST);
        let window_ms = whole(&mut errors, "window_ms", self.window_ms, 1, MAX_WINDOW_MS);
        let burst = match self.burst {
            Some(b) => whole(&mut errors, "burst", b, 1, MAX_BURST),
            None => limit,
        };
        let floor_ppm = match self.floor {
            None => Some(0),
            Some(f) if f.is_nan() || !(0.0..=1.0).contains(&f) => {
                errors.push(FieldError {
                    field: "floor",
                    message: format!("must be a fraction between 0 and 1 (got {f})"),
                });
                None
            }
            Some(f) => Some((f * f64::from(PPM)).round() as u32),
        };
        if let (Some(limit), Some(window_ms)) = (limit, window_ms) {
            // Whole-budget refill in micro-tokens per second must stay exact in Lua.
            let rate = u128::from(limit) * u128::from(UT) * 1000 / u128::from(window_ms);
            if rate > u128::from(MAX_RATE_UT_PER_S) {
                errors.push(FieldError {
                    field: "limit",
                    message: format!(
                        "refills faster than {} tokens per second; use a larger unit",
                        MAX_RATE_UT_PER_S / UT
                    ),
                });
            }
            if let Some(burst) = burst {
                let fill = u128::from(burst) * u128::from(window_ms) / u128::from(limit);
                if fill > u128::from(MAX_FILL_MS) {
                    errors.push(FieldError {
                        field: "burst",
                        message: "an empty bucket would take more than 10 years to refill"
                            .to_string(),
                    });
                }
            }
        }
        if let (Some(limit), Some(window_ms), Some(Algorithm::SlidingWindow)) =
            (limit, window_ms, self.algorithm)
        {
            // The bounds sliding_window.lua computes exactly within (window.rs holds the same).
            let most = (MAX_WINDOW_PRODUCT / window_ms).min(MAX_WINDOW_LIMIT);
            if limit > most {
                errors.push(FieldError {
                    field: "limit",
                    message: format!(
                        "a sliding window of {window_ms} ms holds at most {most} tokens \
                         (limit × window_ms ≤ {MAX_WINDOW_PRODUCT}, limit ≤ {MAX_WINDOW_LIMIT}); \
                         use a token bucket or a shorter window"
                    ),
                });
            }
        }
        // At most the burst: a bucket is then never more than one burst below empty, which
        // keeps a debt's repayment within the fill time validation bounds (and the Lua
        // arithmetic exact).
        let debt_limit = match (self.debt_limit, burst) {
            (None, _) => Some(0),
            // The bucket's capacity and its debt together stay exact in a double.
            (Some(d), Some(burst)) => whole(
                &mut errors,
                "debt_limit",
                d,
                0,
                burst.min(MAX_BURST - burst),
            ),
            (Some(d), None) => whole(&mut errors, "debt_limit", d, 0, MAX_BURST),
        };
        let after_the_fact = self.after_the_fact.unwrap_or(false);
        if self.algorithm == Some(Algorithm::Concurrency) {
            concurrency_errors(self, limit, window_ms, &mut errors);
        }
        if matches!(
            self.algorithm,
            Some(Algorithm::SlidingWindow | Algorithm::Concurrency)
        ) {
            if debt_limit.is_some_and(|d| d > 0) {
                errors.push(FieldError {
                    field: "debt_limit",
                    message: "debt needs a token bucket (algorithm token_bucket)".to_string(),
                });
            }
            if after_the_fact {
                errors.push(FieldError {
                    field: "after_the_fact",
                    message: "charges after the fact need a token bucket (algorithm \
                              token_bucket)"
                        .to_string(),
                });
            }
        }
        match (limit, window_ms, burst, floor_ppm, debt_limit) {
            (Some(limit), Some(window_ms), Some(burst), Some(floor_ppm), Some(debt_limit))
                if errors.is_empty() =>
            {
                Ok(Policy {
                    limit,
                    window_ms,
                    burst,
                    version: 0,
                    tier: self.tier.unwrap_or_default(),
                    fail_mode: self.fail_mode.unwrap_or_default(),
                    floor_ppm,
                    algorithm: self.algorithm.unwrap_or_default(),
                    mode: self.mode.unwrap_or_default(),
                    replaces: None,
                    debt_limit,
                    after_the_fact,
                })
            }
            _ => Err(PolicyErrors(errors)),
        }
    }
}

/// The most slots a concurrency limit holds: each live slot is a member of a sorted set in
/// Redis, which a hold trims and counts.
pub const MAX_CONCURRENCY: u64 = 1_000_000;

/// The longest a holder keeps a slot of a concurrency limit (its `window_ms`): also the
/// longest a hold of any budget lives unsettled.
pub const MAX_HOLD_TTL_MS: u64 = crate::bounds::MAX_HOLD_TTL_MS;

/// What only a concurrency limit refuses: more slots than a sorted set should hold, a slot
/// lease past the longest hold, and a burst (slots do not refill).
fn concurrency_errors(
    spec: &PolicySpec,
    limit: Option<u64>,
    window_ms: Option<u64>,
    errors: &mut Vec<FieldError>,
) {
    if limit.is_some_and(|l| l > MAX_CONCURRENCY) {
        errors.push(FieldError {
            field: "limit",
            message: format!("a concurrency limit holds at most {MAX_CONCURRENCY} slots"),
        });
    }
    if window_ms.is_some_and(|w| w > MAX_HOLD_TTL_MS) {
        errors.push(FieldError {
            field: "window_ms",
            message: format!(
                "a concurrency limit's window_ms is how long a holder may keep a slot: at most \
                 {MAX_HOLD_TTL_MS} ms"
            ),
        });
    }
    if spec
        .burst
        .is_some_and(|b| Some(b as u64) != limit || b.fract() != 0.0)
    {
        errors.push(FieldError {
            field: "burst",
            message: "a concurrency limit has no burst: its slots do not refill".to_string(),
        });
    }
}

/// Why a check is refused before any bucket is touched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CostError {
    #[error("cost must be at least 1")]
    Zero,
    #[error("cost {cost} exceeds the policy's burst of {burst}: it can never succeed")]
    ExceedsBurst { cost: u64, burst: u64 },
    /// The other regions' floors leave no region able to hold the cost.
    #[error(
        "cost {cost} can never succeed: with the other regions' floors reserved, no region \
         holds more than {largest}"
    )]
    BeyondFloors { cost: u64, largest: u64 },
}

impl Policy {
    /// Checks a request's cost against the policy. A cost above the burst could never be admitted
    /// and is refused outright rather than left waiting for ever.
    pub fn check_cost(&self, cost: u64) -> Result<(), CostError> {
        if cost == 0 {
            Err(CostError::Zero)
        } else if cost > self.burst {
            Err(CostError::ExceedsBurst {
                cost,
                burst: self.burst,
            })
        } else {
            Ok(())
        }
    }

    /// True when `other` asks for the same as `self`, whatever either's version: storing it
    /// again changes nothing.
    pub fn same_terms(&self, other: &Policy) -> bool {
        *self
            == Policy {
                version: self.version,
                replaces: self.replaces,
                ..other.clone()
            }
    }

    /// The units a share of this policy is counted in: tokens of burst for a token bucket,
    /// tokens per window for a sliding window, slots for a concurrency limit.
    pub fn units(&self) -> u64 {
        match self.algorithm {
            Algorithm::TokenBucket => self.burst,
            Algorithm::SlidingWindow | Algorithm::Concurrency => self.limit,
        }
    }

    /// The least non-zero share worth holding: one whole unit (rounded up, so a bucket at this
    /// share holds the unit whole). Above [`PPM`] when even the whole budget is less than a
    /// unit, which validation never accepts.
    pub fn min_share_ppm(&self) -> u32 {
        u64::from(PPM).div_ceil(self.units().max(1)) as u32
    }

    /// The floor each region reserves: the policy's floor, or nothing when it would hold less
    /// than one unit (a floor of 5% of a burst of 2 is a tenth of a token, which admits
    /// nothing and would only take budget from the region that can use it).
    pub fn whole_floor_ppm(&self) -> u32 {
        if self.floor_ppm < self.min_share_ppm() {
            0
        } else {
            self.floor_ppm
        }
    }

    /// How long an empty bucket takes to refill (burst · window / limit), in ms; a sliding
    /// window's window; a concurrency limit's slot lease (slots in use come back within it).
    pub fn fill_ms(&self) -> u128 {
        match self.algorithm {
            Algorithm::TokenBucket => {
                u128::from(self.burst) * u128::from(self.window_ms) / u128::from(self.limit.max(1))
            }
            Algorithm::SlidingWindow | Algorithm::Concurrency => u128::from(self.window_ms),
        }
    }

    /// Whole-budget refill rate in micro-tokens per second.
    pub fn rate_ut_per_s(&self) -> u64 {
        (u128::from(self.limit) * u128::from(UT) * 1000 / u128::from(self.window_ms)) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(limit: f64, window_ms: f64) -> PolicySpec {
        PolicySpec {
            limit,
            window_ms,
            ..PolicySpec::default()
        }
    }

    #[test]
    fn defaults_burst_to_limit() {
        let p = spec(100.0, 60_000.0).validate().unwrap();
        assert_eq!((p.limit, p.window_ms, p.burst), (100, 60_000, 100));
        assert_eq!(p.tier, Tier::Standard);
        assert_eq!(p.fail_mode, FailMode::Local);
        assert_eq!(p.algorithm, Algorithm::TokenBucket);
    }

    #[test]
    fn reports_every_problem_at_once() {
        let s = PolicySpec {
            limit: -1.0,
            window_ms: 0.0,
            burst: Some(0.5),
            floor: Some(f64::NAN),
            ..PolicySpec::default()
        };
        let errs = s.validate().unwrap_err().0;
        let fields: Vec<_> = errs.iter().map(|e| e.field).collect();
        assert_eq!(fields, ["limit", "window_ms", "burst", "floor"]);
    }

    #[test]
    fn debt_is_bounded_by_the_burst_and_needs_a_token_bucket() {
        let with = |debt: f64, algorithm| PolicySpec {
            burst: Some(50.0),
            debt_limit: Some(debt),
            after_the_fact: Some(true),
            algorithm,
            ..spec(100.0, 60_000.0)
        };
        let p = with(50.0, None).validate().unwrap();
        assert_eq!((p.debt_limit, p.after_the_fact), (50, true));
        assert_eq!(spec(100.0, 60_000.0).validate().unwrap().debt_limit, 0);
        let huge = PolicySpec {
            limit: MAX_BURST as f64,
            window_ms: 1e9,
            burst: Some((MAX_BURST - 10) as f64),
            debt_limit: Some(11.0),
            ..PolicySpec::default()
        };
        assert_eq!(huge.validate().unwrap_err().0[0].field, "debt_limit");
        for bad in [51.0, -1.0, 2.5, f64::NAN] {
            let e = with(bad, None).validate().unwrap_err();
            assert_eq!(e.0.len(), 1, "{bad}: {e}");
            assert_eq!(e.0[0].field, "debt_limit");
        }
        let e = with(10.0, Some(Algorithm::SlidingWindow))
            .validate()
            .unwrap_err();
        let fields: Vec<_> = e.0.iter().map(|f| f.field).collect();
        assert_eq!(fields, ["debt_limit", "after_the_fact"]);
    }

    #[test]
    fn a_concurrency_limit_counts_slots_held_at_most_its_window() {
        let slots = |limit: f64, window_ms: f64| PolicySpec {
            algorithm: Some(Algorithm::Concurrency),
            ..spec(limit, window_ms)
        };
        let p = slots(3.0, 120_000.0).validate().unwrap();
        assert_eq!((p.units(), p.burst, p.fill_ms()), (3, 3, 120_000));
        assert_eq!(p.min_share_ppm(), 333_334);
        let field = |s: PolicySpec| {
            let e = s.validate().unwrap_err();
            e.0.iter().map(|f| f.field).collect::<Vec<_>>()
        };
        assert_eq!(
            field(slots((MAX_CONCURRENCY + 1) as f64, 1000.0)),
            ["limit"]
        );
        assert_eq!(
            field(slots(3.0, (MAX_HOLD_TTL_MS + 1) as f64)),
            ["window_ms"]
        );
        assert_eq!(
            field(PolicySpec {
                burst: Some(5.0),
                ..slots(3.0, 1000.0)
            }),
            ["burst"]
        );
        // A burst equal to the limit says nothing new.
        assert!(PolicySpec {
            burst: Some(3.0),
            ..slots(3.0, 1000.0)
        }
        .validate()
        .is_ok());
        assert_eq!(
            field(PolicySpec {
                debt_limit: Some(1.0),
                after_the_fact: Some(true),
                ..slots(3.0, 1000.0)
            }),
            ["debt_limit", "after_the_fact"]
        );
    }

    #[test]
    fn rejects_nan_infinite_and_overflowing_numbers() {
        for bad in [f64::NAN, f64::INFINITY, 1e300, 2.5, 0.0] {
            assert!(spec(bad, 1000.0).validate().is_err(), "limit {bad}");
            assert!(spec(10.0, bad).validate().is_err(), "window {bad}");
        }
        assert!(spec(10.0, (MAX_WINDOW_MS + 1) as f64).validate().is_err());
        assert!(spec((MAX_BURST + 1) as f64, 1e9).validate().is_err());
    }

    #[test]
    fn rejects_absurd_rates_and_fill_times() {
        // 10^7 tokens per ms is beyond exact Lua arithmetic.
        assert!(spec(1e9, 100.0).validate().is_err());
        // One token per 31 days with a burst of a billion: never refills in practice.
        let s = PolicySpec {
            burst: Some(1e9),
            ..spec(1.0, MAX_WINDOW_MS as f64)
        };
        assert_eq!(s.validate().unwrap_err().0[0].field, "burst");
    }

    #[test]
    fn sliding_windows_within_the_window_bounds_only() {
        let sw = |limit: f64, window_ms: f64| PolicySpec {
            algorithm: Some(Algorithm::SlidingWindow),
            ..spec(limit, window_ms)
        };
        // 31 days works for both algorithms.
        assert!(spec(1e9, MAX_WINDOW_MS as f64).validate().is_ok());
        assert!(sw(840_725.0, MAX_WINDOW_MS as f64).validate().is_ok());
        let e = sw(840_726.0, MAX_WINDOW_MS as f64)
            .validate()
            .unwrap_err()
            .0;
        assert_eq!(e[0].field, "limit");
        assert!(
            e[0].message.contains("at most 840725 tokens"),
            "{}",
            e[0].message
        );
        assert!(sw(1e9, 1e6).validate().is_ok());
        assert_eq!(
            sw(1e9 + 1.0, 1e6).validate().unwrap_err().0[0].field,
            "limit"
        );
    }

    #[test]
    fn cost_checks() {
        let p = spec(10.0, 1000.0).validate().unwrap();
        assert_eq!(p.check_cost(0), Err(CostError::Zero));
        assert_eq!(p.check_cost(10), Ok(()));
        assert_eq!(
            p.check_cost(11),
            Err(CostError::ExceedsBurst {
                cost: 11,
                burst: 10
            })
        );
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let r: Result<PolicySpec, _> =
            serde_json::from_str(r#"{"limit": 1, "window_ms": 1, "bogus": 2}"#);
        assert!(r.is_err());
    }
}
