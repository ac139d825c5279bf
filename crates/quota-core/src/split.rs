//! How one policy's budget (in ppm) is split over regions: max-min fair water filling, the
//! allocator's target split and a new policy's even split.
//!
//! A leaf: the coordinator (a new policy's first split) and the allocator (each round's target)
//! both call it, and it needs nothing from either.

use crate::policy::PPM;

/// The most region slots a cluster may have; slots are addressed by `u8`, and a policy's shares
/// are one entry per slot.
pub const MAX_REGIONS: usize = 32;

/// Max-min fair fill: `a_r = max(lower_r, min(cap_r, L))` with the largest level `L` such that
/// `Σ a ≤ budget`; the few ppm of rounding left go to the regions still below their cap, lowest
/// slot first. If `Σ max(lower, cap) ≤ budget` every region simply gets that. Requires
/// `Σ lower ≤ budget` (a smaller budget returns `lower` unchanged). Slices are cut to the
/// shorter one.
pub fn water_fill(lower: &[u32], cap: &[u64], budget: u32) -> Vec<u32> {
    let n = lower.len().min(cap.len());
    let mut out = vec![0; n];
    water_fill_into(&lower[..n], &cap[..n], budget, &mut out);
    out
}

fn fill_at(lower: &[u32], cap: &[u64], level: u64) -> u64 {
    lower
        .iter()
        .zip(cap)
        .map(|(&lo, &c)| u64::from(lo).max(c.min(level)))
        .sum()
}

fn water_fill_into(lower: &[u32], cap: &[u64], budget: u32, out: &mut [u32]) {
    debug_assert_eq!(lower.len(), cap.len());
    let budget64 = u64::from(budget);
    // A cap above the budget is as good as infinite; clamping keeps the sums from overflowing.
    let full: u64 = lower
        .iter()
        .zip(cap)
        .map(|(&lo, &c)| u64::from(lo).max(c.min(budget64)))
        .sum();
    if full <= budget64 || lower.iter().map(|&l| u64::from(l)).sum::<u64>() >= budget64 {
        for (o, (&lo, &c)) in out.iter_mut().zip(lower.iter().zip(cap)) {
            *o = if full <= budget64 {
                u64::from(lo).max(c.min(budget64)) as u32
            } else {
                lo
            };
        }
        return;
    }
    // fill_at(0) = Σ lower < budget < full = fill_at(budget): find the largest level that fits.
    let (mut lo_level, mut hi_level) = (0u64, budget64);
    while lo_level < hi_level {
        let mid = (lo_level + hi_level).div_ceil(2);
        if fill_at(lower, cap, mid) <= budget64 {
            lo_level = mid;
        } else {
            hi_level = mid - 1;
        }
    }
    let level = lo_level;
    let mut left = budget64 - fill_at(lower, cap, level);
    for (o, (&lo, &c)) in out.iter_mut().zip(lower.iter().zip(cap)) {
        let mut a = u64::from(lo).max(c.min(level));
        if left > 0 && c > level && u64::from(lo) <= level {
            a += 1;
            left -= 1;
        }
        *o = a as u32;
    }
}

/// The target split of one policy: floors, then demand water-filled, then the rest evenly over
/// `eligible` regions. `demand_ppm` is each region's demand in ppm of the budget.
/// Slices are cut to the shortest of them (and [`MAX_REGIONS`]).
pub fn target_split(floors: &[u32], demand_ppm: &[u64], eligible: &[bool]) -> Vec<u32> {
    let n = floors
        .len()
        .min(demand_ppm.len())
        .min(eligible.len())
        .min(MAX_REGIONS);
    let mut out = vec![0; n];
    target_into(&floors[..n], &demand_ppm[..n], &eligible[..n], &mut out);
    out
}

pub(crate) fn target_into(floors: &[u32], demand_ppm: &[u64], eligible: &[bool], out: &mut [u32]) {
    let n = floors.len();
    let mut cap = [0u64; MAX_REGIONS];
    for r in 0..n {
        cap[r] = if eligible[r] { demand_ppm[r] } else { 0 };
    }
    water_fill_into(floors, &cap[..n], PPM, out);
    // Every demand is met: the spare budget is slack, split evenly so each region gets the
    // same headroom above its demand.
    let sum: u64 = out.iter().map(|&a| u64::from(a)).sum();
    let takers = eligible.iter().filter(|&&e| e).count() as u64;
    if sum < u64::from(PPM) && takers > 0 {
        let spare = u64::from(PPM) - sum;
        let (each, mut extra) = (spare / takers, spare % takers);
        for (o, _) in out.iter_mut().zip(eligible).filter(|(_, &e)| e) {
            *o += each as u32 + u32::from(extra > 0);
            extra = extra.saturating_sub(1);
        }
    }
}

/// A new policy's split with no demand known: floors, the rest evenly over live regions.
pub fn even_split(floors: &[u32], live: &[bool]) -> Vec<u32> {
    target_split(floors, &vec![0; floors.len()], live)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (lower, cap, budget, expected).
    type FillCase<'a> = (&'a [u32], &'a [u64], u32, &'a [u32]);
    /// (floors, demand, eligible, expected).
    type TargetCase<'a> = (&'a [u32], &'a [u64], &'a [bool], &'a [u32]);

    #[test]
    fn water_fill_table() {
        let cases: &[FillCase] = &[
            // Everyone fits: each gets its demand.
            (&[0, 0, 0], &[100, 200, 300], 1000, &[100, 200, 300]),
            // Max-min: the small demand is met, the rest split evenly.
            (&[0, 0, 0], &[100, 1000, 1000], 1000, &[100, 450, 450]),
            // Floors are kept even without demand.
            (&[100, 100, 100], &[0, 1000, 1000], 1000, &[100, 450, 450]),
            // Floor above the level stays at the floor.
            (&[300, 0, 0], &[0, 1000, 1000], 1000, &[300, 350, 350]),
            // Rounding remainder goes to the lowest slots still below their cap.
            (&[0, 0, 0], &[1000, 1000, 1000], 1000, &[334, 333, 333]),
            // Budget smaller than the floors: floors come back unchanged.
            (&[600, 600], &[0, 0], 1000, &[600, 600]),
            // A single region takes all it asks for, bounded by the budget.
            (&[0], &[5000], 1000, &[1000]),
            (&[], &[], 1000, &[]),
            // Mismatched lengths are cut, not a panic.
            (&[0, 0], &[10], 1000, &[10]),
        ];
        for (i, &(lower, cap, budget, expected)) in cases.iter().enumerate() {
            assert_eq!(water_fill(lower, cap, budget), expected, "case {i}");
        }
    }

    #[test]
    fn target_split_table() {
        let p = PPM;
        let cases: &[TargetCase] = &[
            // No demand: even split.
            (&[0, 0], &[0, 0], &[true, true], &[p / 2, p / 2]),
            // Demand 3:1 with spare budget: demand met, spare split evenly.
            (
                &[0, 0],
                &[300_000, 100_000],
                &[true, true],
                &[600_000, 400_000],
            ),
            // Over-subscribed: max-min fair.
            (
                &[0, 0, 0],
                &[100_000, p as u64, p as u64],
                &[true; 3],
                &[100_000, 450_000, 450_000],
            ),
            // Floors of 10% and one region holding all demand.
            (
                &[100_000; 3],
                &[0, 0, 2 * p as u64],
                &[true; 3],
                &[100_000, 100_000, 800_000],
            ),
            // A draining region keeps only its floor.
            (
                &[50_000, 50_000],
                &[p as u64, p as u64],
                &[false, true],
                &[50_000, 950_000],
            ),
        ];
        for (i, &(floors, demand, eligible, expected)) in cases.iter().enumerate() {
            assert_eq!(target_split(floors, demand, eligible), expected, "case {i}");
        }
    }
}
