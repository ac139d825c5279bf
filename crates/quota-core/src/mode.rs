//! Whether a policy's budget is split over regions or lives whole in one home region.
//!
//! A share is only worth holding if it holds at least one cost unit: a bucket of 0.67 tokens
//! denies every check of cost 1 for ever. And moving share only moves *rate*: the tokens a
//! region already spent come back at its refill rate, so a budget that takes longer to refill
//! than demand takes to move cannot follow demand by moving share. So a policy whose even share
//! would hold fewer than [`HOME_MODE_UNITS`] whole units (tokens of burst for a token bucket,
//! tokens per window for a sliding window), or that takes longer than [`HOME_MODE_FILL_MS`] to
//! refill from empty, is not split: its budget lives whole in its *home* region, and the
//! other regions forward its checks there. The home is where the budget starts (the lowest
//! sharing region, or the tenant's pinned home) and moves only when it can no longer hold the
//! budget (cut off, draining, removed), to the region with the most demand: a move loses the
//! old home's tokens, which a slow budget would not get back for hours. An operator pin puts
//! it anywhere. The other regions keep their floors in whole units (a floor below one unit is
//! none). Every other policy is split, and no share of either kind
//! is ever strictly between 0 and one unit ([`Policy::min_share_ppm`]).

use crate::policy::{CostError, Policy, PPM};

/// A policy whose even share over the regions holds fewer whole units than this lives in one
/// home region. Chosen with the simulator (`small_budget`, `slow_budget` and the default
/// suite at 3, 5 and 9 regions): see docs/decisions/home-mode.md.
pub const HOME_MODE_UNITS: u64 = 3;

/// A policy that takes longer than this to refill from empty (burst · window / limit; a
/// sliding window's window) lives in one home region. Chosen with the simulator's
/// `slow_budget` scenario: see docs/decisions/home-mode.md.
pub const HOME_MODE_FILL_MS: u64 = 10 * 60 * 1000;

/// How a policy's budget is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BudgetMode {
    /// Shares in every region, moved towards demand.
    Split,
    /// Whole in one home region; the others keep only their floors and forward checks home.
    Home,
}

impl BudgetMode {
    /// The name the API shows.
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetMode::Split => "split",
            BudgetMode::Home => "home",
        }
    }
}

/// The mode of `policy` over `regions` regions that may take share: split when its even share
/// holds at least [`HOME_MODE_UNITS`] whole units and it refills within
/// [`HOME_MODE_FILL_MS`], else home. One region holds everything either way, so it counts as
/// split.
pub fn budget_mode(policy: &Policy, regions: usize) -> BudgetMode {
    if regions <= 1 {
        return BudgetMode::Split;
    }
    let units = u128::from(policy.units());
    if units < u128::from(HOME_MODE_UNITS) * regions as u128
        || policy.fill_ms() > u128::from(HOME_MODE_FILL_MS)
    {
        BudgetMode::Home
    } else {
        BudgetMode::Split
    }
}

/// `share_ppm` made whole: a share that would hold more than nothing but less than one unit
/// holds nothing.
pub fn whole_share(policy: &Policy, share_ppm: u32) -> u32 {
    if share_ppm < policy.min_share_ppm() {
        0
    } else {
        share_ppm
    }
}

/// The largest cost any region can ever admit for `policy` when `floor_regions` regions
/// reserve its floor: what one region holds with the whole budget but the other regions'
/// floors, in whole units (never above the burst). A cost above it could never succeed
/// anywhere, as a cost above the burst could not.
pub fn largest_cost(policy: &Policy, floor_regions: usize) -> u64 {
    let others = floor_regions.saturating_sub(1) as u64 * u64::from(policy.whole_floor_ppm());
    let share = u64::from(PPM).saturating_sub(others);
    let units = (u128::from(policy.units()) * u128::from(share) / u128::from(PPM)) as u64;
    units.min(policy.burst)
}

/// Checks a cost against the policy's burst and against [`largest_cost`]: a cost no region
/// could ever hold is refused outright instead of being answered "never".
pub fn check_cost(policy: &Policy, cost: u64, floor_regions: usize) -> Result<(), CostError> {
    policy.check_cost(cost)?;
    let largest = largest_cost(policy, floor_regions);
    if cost > largest {
        return Err(CostError::BeyondFloors { cost, largest });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Algorithm, PolicySpec};

    fn policy(limit: u64, burst: u64, algorithm: Algorithm) -> Policy {
        PolicySpec {
            limit: limit as f64,
            window_ms: 60_000.0,
            burst: Some(burst as f64),
            algorithm: Some(algorithm),
            ..PolicySpec::default()
        }
        .validate()
        .unwrap()
    }

    #[test]
    fn a_cost_beyond_the_others_floors_is_refused() {
        let mut p = policy(10, 10, Algorithm::TokenBucket);
        p.floor_ppm = 300_000;
        // Two other regions reserve 3 each: 4 is the most one region can ever hold.
        assert_eq!(largest_cost(&p, 3), 4);
        assert_eq!(check_cost(&p, 4, 3), Ok(()));
        assert_eq!(
            check_cost(&p, 5, 3),
            Err(CostError::BeyondFloors {
                cost: 5,
                largest: 4
            })
        );
        assert_eq!(check_cost(&p, 10, 1), Ok(()));
        assert!(matches!(
            check_cost(&p, 11, 1),
            Err(CostError::ExceedsBurst { .. })
        ));
    }

    #[test]
    fn small_budgets_live_in_one_region() {
        let tb = Algorithm::TokenBucket;
        let sw = Algorithm::SlidingWindow;
        let k = HOME_MODE_UNITS;
        // (limit, burst, algorithm, regions, mode): home below k whole units per region.
        let cases = [
            (2, 2, tb, 3, BudgetMode::Home),
            (2, 2, tb, 1, BudgetMode::Split),
            (600, 3 * k - 1, tb, 3, BudgetMode::Home),
            (600, 3 * k, tb, 3, BudgetMode::Split),
            (600, 9 * k - 1, tb, 9, BudgetMode::Home),
            (600, 9 * k, tb, 9, BudgetMode::Split),
            (2, 2, sw, 3, BudgetMode::Home),
            (5 * k, 5 * k, sw, 5, BudgetMode::Split),
            (5 * k - 1, 5 * k - 1, sw, 5, BudgetMode::Home),
        ];
        for (i, &(limit, burst, algorithm, regions, mode)) in cases.iter().enumerate() {
            let p = policy(limit, burst, algorithm);
            assert_eq!(budget_mode(&p, regions), mode, "case {i}");
        }
    }

    #[test]
    fn slow_budgets_live_in_one_region() {
        let at = |limit: f64, window_ms: f64, algorithm| {
            let p = PolicySpec {
                limit,
                window_ms,
                algorithm: Some(algorithm),
                ..PolicySpec::default()
            }
            .validate()
            .unwrap();
            budget_mode(&p, 3)
        };
        let tb = Algorithm::TokenBucket;
        // Refilled in ten minutes: split. In a day or a month: home.
        assert_eq!(at(6_000.0, 600_000.0, tb), BudgetMode::Split);
        assert_eq!(at(6_000.0, 600_001.0, tb), BudgetMode::Home);
        assert_eq!(at(1_000_000.0, 86_400_000.0, tb), BudgetMode::Home);
        assert_eq!(
            at(100.0, 2_592_000_000.0, Algorithm::SlidingWindow),
            BudgetMode::Home
        );
    }

    #[test]
    fn no_share_holds_part_of_one_unit() {
        let p = policy(600, 3, Algorithm::TokenBucket);
        // One token of a burst of 3 is 333 334 ppm (rounded up so the bucket holds it whole).
        assert_eq!(p.min_share_ppm(), 333_334);
        assert_eq!(whole_share(&p, 333_333), 0);
        assert_eq!(whole_share(&p, 333_334), 333_334);
        assert_eq!(whole_share(&p, 0), 0);
        let w = policy(7, 7, Algorithm::SlidingWindow);
        assert_eq!(w.min_share_ppm(), 142_858);
        assert_eq!(whole_share(&w, 142_857), 0);
    }
}
