//! The allocator: demand estimates + current shares + floors → the share changes to commit.
//!
//! One round, per policy:
//! 1. **Target**: floors first; then a max-min fair (water-filling) split of the rest of the
//!    budget over each region's demand; budget left once every demand is met is spread evenly
//!    (again water-filled), so an idle policy ends at an even split. A pinned policy's home gets
//!    everything but the other regions' floors. `critical` policies are pinned automatically to
//!    the region with most demand, with hysteresis, unless an operator pinned them.
//! 2. **Damping**: each share moves at most `max_step_ppm` towards its target per round.
//! 3. **Revoke before grant**: decreases are emitted at once; increases only fit into the room
//!    left by what regions may still enforce ([`CoordinatorState::enforceable`]), so share taken
//!    from A reaches B a round after A acknowledged the decrease (or its lease ran out).
//!    Regions below their floor are served first.
//! 4. **Lapsed regions**: a region whose lease ended more than the drift margin ago (it stopped
//!    renewing: cut off or down) enforces only its floors, so its demand stops counting, it takes
//!    no spare budget, and its share drops to the floor at once; the others take what it held
//!    in the next round (while a region is lapsed, neither move is damped: `apply` still counts
//!    the old share in the round of the decrease). The floor stays reserved, and a renewal makes
//!    the region count again at the next round.
//! 5. **Threshold**: a policy is emitted only if its shares are at least
//!    `change_threshold_ppm` (Σ |target − share| over regions) from the target (or a floor is
//!    repaired, or its home changes), so the log grows with real changes, not with noise.
//!
//! Driving loop (leader): collect usage reports into a [`DemandTracker`], call [`plan`] with
//! the applied state and the time the leader will stamp, turn the plan into commands with
//! [`Plan::into_commands`], propose them, and repeat every rebalance interval. `apply` checks
//! every entry again, so a plan made on a slightly stale state is still safe.

use serde::{Deserialize, Serialize};

use crate::coordinator::{
    Command, CoordinatorState, Entry, HomeChange, Operation, PinSource, PolicyKey, RegionState,
    RequestId, ShareEntry,
};
use crate::demand::DemandTracker;
use crate::lease::Revocation;
use crate::mode::BudgetMode;
use crate::policy::PPM;
pub use crate::split::{even_split, target_split, water_fill};
use crate::split::{target_into, MAX_REGIONS};

/// Allocator tuning. Units are last in every name.
///
/// Lease timing is not here: it is replicated in the state ([`crate::lease::LeaseConfig`],
/// set with `Operation::SetLeaseConfig`) because `apply` needs it on every replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocatorConfig {
    /// Weight of a new demand sample in the moving average, in ppm (1..=PPM).
    pub ewma_alpha_ppm: u32,
    /// The most one region's share moves in one round, in ppm.
    pub max_step_ppm: u32,
    /// The least distance from the target (Σ |target − share| over regions) worth a log entry.
    pub change_threshold_ppm: u32,
    /// How much more demand (relative, in ppm) a region needs to take a critical tenant's home.
    pub pin_hysteresis_ppm: u32,
    /// The most share entries in one `SetShares` command, so log entries stay bounded.
    pub max_entries_per_command: u32,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        Self {
            ewma_alpha_ppm: 300_000,
            max_step_ppm: 100_000,
            change_threshold_ppm: 10_000,
            pin_hysteresis_ppm: 250_000,
            max_entries_per_command: 4096,
        }
    }
}

/// Why an allocator configuration is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocatorConfigError {
    #[error("{field} must be between {min} and {max} (got {value})")]
    OutOfRange {
        field: &'static str,
        value: u64,
        min: u64,
        max: u64,
    },
}

impl AllocatorConfig {
    /// Checks every field, reporting all problems at once.
    pub fn validate(&self) -> Result<(), Vec<AllocatorConfigError>> {
        let ppm = u64::from(PPM);
        let checks: [(&'static str, u64, u64, u64); 5] = [
            ("ewma_alpha_ppm", u64::from(self.ewma_alpha_ppm), 1, ppm),
            ("max_step_ppm", u64::from(self.max_step_ppm), 1, ppm),
            (
                "change_threshold_ppm",
                u64::from(self.change_threshold_ppm),
                0,
                ppm,
            ),
            (
                "pin_hysteresis_ppm",
                u64::from(self.pin_hysteresis_ppm),
                0,
                10 * ppm,
            ),
            (
                "max_entries_per_command",
                u64::from(self.max_entries_per_command),
                1,
                1 << 20,
            ),
        ];
        let errors: Vec<_> = checks
            .iter()
            .filter(|(_, v, min, max)| v < min || v > max)
            .map(
                |&(field, value, min, max)| AllocatorConfigError::OutOfRange {
                    field,
                    value,
                    min,
                    max,
                },
            )
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// What one round decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// The membership version the plan was made against.
    pub membership: u64,
    pub entries: Vec<ShareEntry>,
    /// Deleted policies no region may enforce any more.
    pub forget: Vec<PolicyKey>,
    /// Policies looked at.
    pub policies: u64,
}

impl Plan {
    /// Turns the plan into commands of bounded size, stamped with `now_ms`; `next_id` supplies
    /// request ids (e.g. from a seeded RNG or a counter).
    pub fn into_commands(
        self,
        now_ms: u64,
        max_entries_per_command: u32,
        mut next_id: impl FnMut() -> RequestId,
    ) -> Vec<Command> {
        let chunk = (max_entries_per_command as usize).max(1);
        let mut commands = Vec::new();
        let mut entries = self.entries;
        while !entries.is_empty() {
            let rest = entries.split_off(chunk.min(entries.len()));
            commands.push(Command {
                request: next_id(),
                now_ms,
                op: Operation::SetShares {
                    membership: self.membership,
                    entries,
                },
            });
            entries = rest;
        }
        if !self.forget.is_empty() {
            commands.push(Command {
                request: next_id(),
                now_ms,
                op: Operation::Forget { keys: self.forget },
            });
        }
        commands
    }
}

/// The region a `critical` policy should call home, keeping `current` unless another region's
/// demand beats it by the hysteresis. `None` when there is no demand to judge by.
pub fn choose_home(
    current: Option<u8>,
    demand_ppm: &[u64],
    eligible: &[bool],
    hysteresis_ppm: u32,
) -> Option<u8> {
    let n = demand_ppm.len().min(eligible.len());
    let best = (0..n)
        .filter(|&r| eligible[r] && demand_ppm[r] > 0)
        .max_by_key(|&r| (demand_ppm[r], std::cmp::Reverse(r)))?;
    let Some(home) = current.map(usize::from).filter(|&h| h < n && eligible[h]) else {
        return Some(best as u8);
    };
    let needed = u128::from(demand_ppm[home]) * u128::from(PPM + hysteresis_ppm);
    if best != home && u128::from(demand_ppm[best]) * u128::from(PPM) > needed {
        Some(best as u8)
    } else {
        Some(home as u8)
    }
}

/// Moves `current` towards `target` for one round: damped, floors kept, and increases limited
/// to the room left by what regions may still enforce after this round's decreases
/// (`enforceable_after_decrease[r]`, which is `≥ current[r]`). Returns the new shares; slices
/// are cut to the shortest of them (and [`MAX_REGIONS`]).
pub fn step_towards(
    current: &[u32],
    target: &[u32],
    floors: &[u32],
    enforceable_after_decrease: &[u32],
    max_step_ppm: u32,
) -> Vec<u32> {
    let n = current
        .len()
        .min(target.len())
        .min(floors.len())
        .min(enforceable_after_decrease.len())
        .min(MAX_REGIONS);
    let mut out = vec![0; n];
    step_into(
        &current[..n],
        &target[..n],
        &floors[..n],
        &enforceable_after_decrease[..n],
        &[false; MAX_REGIONS][..n],
        max_step_ppm,
        &mut out,
    );
    out
}

/// [`step_towards`]; a `lapsed` region's decrease is not damped (it enforces only its floor),
/// nor are the other regions' increases while one is lapsed.
fn step_into(
    current: &[u32],
    target: &[u32],
    floors: &[u32],
    enforceable: &[u32],
    lapsed: &[bool],
    max_step_ppm: u32,
    out: &mut [u32],
) {
    let n = current.len();
    let mut desired = [0u32; MAX_REGIONS];
    // What a lapsed region held goes to the others as soon as there is room for it.
    let up_step = if lapsed.iter().any(|&l| l) {
        PPM
    } else {
        max_step_ppm
    };
    for r in 0..n {
        let (c, t) = (current[r], target[r]);
        let down_step = if lapsed[r] { c } else { max_step_ppm };
        desired[r] = if t >= c {
            t.min(c.saturating_add(up_step))
        } else {
            t.max(c.saturating_sub(down_step)).max(floors[r].min(c))
        };
        out[r] = desired[r].min(c);
    }
    // Room: what is left after every region's enforceable share (decreases still count in full).
    let used: u64 = (0..n).map(|r| u64::from(enforceable[r].max(out[r]))).sum();
    let mut room = u64::from(PPM).saturating_sub(used);
    // Raising a region up to what it may already enforce is free.
    for r in 0..n {
        if desired[r] > current[r] {
            out[r] = desired[r].min(enforceable[r].max(current[r]));
        }
    }
    // Floors first, then the rest in proportion to what each region still wants.
    for r in 0..n {
        let floor_goal = desired[r].min(floors[r]);
        if out[r] < floor_goal {
            let add = u64::from(floor_goal - out[r]).min(room);
            out[r] += add as u32;
            room -= add;
        }
    }
    let want: u64 = (0..n)
        .map(|r| u64::from(desired[r] - out[r].min(desired[r])))
        .sum();
    if want == 0 || room == 0 {
        return;
    }
    for r in 0..n {
        let w = u64::from(desired[r] - out[r].min(desired[r]));
        let add = if want <= room { w } else { w * room / want };
        out[r] += add as u32;
    }
}

/// The share a region may enforce after this round lowers it from `old` to `new`, exactly as
/// `apply` will count it.
fn enforceable_after(
    state: &CoordinatorState,
    entry: &Entry,
    region: usize,
    old: u32,
    new: u32,
    now_ms: u64,
) -> u32 {
    let now_enforceable = state.enforceable(entry, region, now_ms);
    let Some(r) = state.region(region) else {
        return now_enforceable;
    };
    if new >= old {
        return now_enforceable;
    }
    let rev = Revocation {
        region: region as u8,
        share_ppm: old,
        floor_ppm: state.floor_of(&entry.policy, region).min(old),
        epoch: state.epoch + 1,
        deadline_ms: r
            .lease_expires_at_ms
            .saturating_add(state.lease.drift_margin_ms),
    };
    now_enforceable.max(rev.contribution(r.acked_epoch, now_ms))
}

/// The region slots of one round: how many, which hold a region, which may take share, whose
/// lease has lapsed.
pub(crate) struct Slots {
    pub(crate) n: usize,
    pub(crate) live: [bool; MAX_REGIONS],
    pub(crate) eligible: [bool; MAX_REGIONS],
    pub(crate) lapsed: [bool; MAX_REGIONS],
}

impl Slots {
    pub(crate) fn of(state: &CoordinatorState, now_ms: u64) -> Self {
        let n = state.regions.len().min(MAX_REGIONS);
        let mut live = [false; MAX_REGIONS];
        let mut eligible = [false; MAX_REGIONS];
        let mut lapsed = [false; MAX_REGIONS];
        for r in 0..n {
            if let Some(region) = state.region(r) {
                live[r] = true;
                lapsed[r] = lease_lapsed(state, region, now_ms);
                eligible[r] = !region.draining && !lapsed[r];
            }
        }
        Self {
            n,
            live,
            eligible,
            lapsed,
        }
    }
}

/// Whether `region` held a lease that ended more than the drift margin before `now_ms`: it
/// enforces only its floors until it renews, so its demand no longer counts.
pub fn lease_lapsed(state: &CoordinatorState, region: &RegionState, now_ms: u64) -> bool {
    region.lease_expires_at_ms > 0
        && now_ms
            > region
                .lease_expires_at_ms
                .saturating_add(state.lease.drift_margin_ms)
}

/// One rebalance round over every policy: the share changes worth committing.
///
/// `now_ms` is the time the leader will stamp on the resulting commands.
pub fn plan(
    state: &CoordinatorState,
    demand: &DemandTracker,
    config: &AllocatorConfig,
    now_ms: u64,
) -> Plan {
    let now = now_ms.max(state.last_now_ms);
    let slots = Slots::of(state, now);
    let n = slots.n;
    let mut plan = Plan {
        membership: state.membership,
        ..Plan::default()
    };
    let mut demand_iter = demand.iter().peekable();
    let zero = [0u64; MAX_REGIONS];
    for (key, entry) in &state.entries {
        plan.policies += 1;
        if entry.deleted {
            let gone = (0..n).all(|r| state.enforceable(entry, r, now) == 0);
            if gone {
                plan.forget.push(key.clone());
            }
            continue;
        }
        // Merge-join with the demand map: both are sorted by key.
        // One comparison per step: keys are strings and comparing them dominates.
        let rates = loop {
            match demand_iter.peek() {
                Some((k, rates)) => match (*k).cmp(key) {
                    std::cmp::Ordering::Less => {
                        demand_iter.next();
                    }
                    std::cmp::Ordering::Equal => break *rates,
                    std::cmp::Ordering::Greater => break &zero[..],
                },
                None => break &zero[..],
            }
        };
        if let Some(change) = plan_entry(state, &slots, key, entry, rates, config, now) {
            plan.entries.push(change);
        }
    }
    plan
}

/// A plan's class entry sums the demand of all its subjects, which exceeds one subject's
/// budget in every region, so a max-min fair split of it would be even whatever the regions'
/// loads: its demand is taken as shares of the whole instead (region r's `demand_r / Σ demand`
/// of the budget), so the class's shares follow where its subjects are.
fn as_shares_of_demand(demand_ppm: &mut [u64]) {
    let total: u128 = demand_ppm.iter().map(|&d| u128::from(d)).sum();
    if total == 0 {
        return;
    }
    for d in demand_ppm.iter_mut() {
        *d = (u128::from(*d) * u128::from(PPM) / total) as u64;
    }
}

/// One policy's share change this round, or `None` when it is not worth a log entry.
fn plan_entry(
    state: &CoordinatorState,
    slots: &Slots,
    key: &PolicyKey,
    entry: &Entry,
    rates: &[u64],
    config: &AllocatorConfig,
    now: u64,
) -> Option<ShareEntry> {
    let n = slots.n;
    let rate = entry.policy.rate_ut_per_s().max(1);
    let mut demand_ppm = [0u64; MAX_REGIONS];
    for ((slot, &d), &lapsed) in demand_ppm.iter_mut().zip(rates).zip(&slots.lapsed).take(n) {
        if !lapsed {
            *slot = (u128::from(d) * u128::from(PPM) / u128::from(rate))
                .min(u128::from(u64::MAX / 4)) as u64;
        }
    }
    if key.tenant.plan().is_some() {
        as_shares_of_demand(&mut demand_ppm[..n]);
    }
    let demand_ppm = &demand_ppm[..n];
    let mut floors = [0u32; MAX_REGIONS];
    let mut current = [0u32; MAX_REGIONS];
    for r in 0..n {
        floors[r] = state.guaranteed_floor(&entry.policy, r);
        current[r] = entry.share(r);
    }
    let (floors, current) = (&floors[..n], &current[..n]);

    let mode = state.budget_mode(&entry.policy);
    let (home, home_change) = plan_home(state, entry, demand_ppm, slots, config);
    let mut target = [0u32; MAX_REGIONS];
    match home {
        Some(h) => {
            let others: u32 = (0..n).filter(|&r| r != h).map(|r| floors[r]).sum();
            for r in 0..n {
                target[r] = if r == h {
                    PPM - others.min(PPM)
                } else {
                    floors[r]
                };
            }
        }
        None => target_into(floors, demand_ppm, &slots.eligible[..n], &mut target[..n]),
    }
    let target = &target[..n];
    // A budget too small to split moves whole: a damped step would leave both regions
    // holding less than a unit on the way.
    let max_step_ppm = if mode == BudgetMode::Home && home.is_some() {
        PPM
    } else {
        config.max_step_ppm
    };
    let round = Round {
        state,
        slots,
        max_step_ppm,
        now,
    };
    let new = step_revoking_first(&round, entry, current, target, floors);

    // Judge by the distance to the target, not by this round's move: a move that is only
    // the revoking half of a transfer is small but must still happen.
    let moved = (0..n).any(|r| current[r] != new[r]);
    let distance: u64 = (0..n)
        .map(|r| u64::from(current[r].abs_diff(target[r])))
        .sum();
    let floor_repair = (0..n).any(|r| new[r] > current[r] && current[r] < floors[r]);
    // When one unit of the policy is worth more than the threshold, a move short of the
    // threshold can still be a whole unit (a token of a burst of 30 is 33 334 ppm): judge by
    // units, so a region converges on every unit its target holds.
    let threshold = config.change_threshold_ppm.max(1);
    let units = u128::from(entry.policy.units());
    let whole = |share: u32| units * u128::from(share) / u128::from(PPM);
    let unit_gap = entry.policy.min_share_ppm() > threshold
        && (0..n).any(|r| whole(current[r]) != whole(target[r]));
    let wrong_length = entry.shares_ppm.len() != n;
    let worth = (moved && (distance >= u64::from(threshold) || floor_repair || unit_gap))
        || home_change != HomeChange::Keep
        || wrong_length;
    worth.then(|| ShareEntry {
        key: key.clone(),
        shares_ppm: new[..n].to_vec(),
        home: home_change,
    })
}

/// The policy's home this round (a live slot) and the change to record: operator pins stay;
/// critical policies and budgets too small to split follow their demand (a budget too small
/// to split with no demand yet and no home stays with the region holding most of it).
fn plan_home(
    state: &CoordinatorState,
    entry: &Entry,
    demand_ppm: &[u64],
    slots: &Slots,
    config: &AllocatorConfig,
) -> (Option<usize>, HomeChange) {
    let n = slots.n;
    let mut home_change = HomeChange::Keep;
    let home = match entry.pin {
        Some(p) if p.source == PinSource::Operator => Some(p.home),
        pin => {
            let auto = pin.map(|p| p.home);
            if state.auto_pinned(&entry.policy) {
                let eligible = &slots.eligible[..n];
                let home_mode = state.budget_mode(&entry.policy) == BudgetMode::Home;
                // Moving a whole budget moves its rate, not its tokens: the old home's bucket
                // is lost and the new one starts from its own level. So a budget too small to
                // split moves only when its home can no longer hold it (cut off, draining,
                // gone); its other regions forward to it meanwhile.
                let stays =
                    home_mode && auto.is_some_and(|h| eligible.get(usize::from(h)) == Some(&true));
                let chosen = if stays {
                    auto
                } else {
                    let kept = if home_mode {
                        // A home that cannot hold the budget is given up even without demand
                        // elsewhere: its callers forward to it in vain.
                        auto.filter(|&h| eligible.get(usize::from(h)) == Some(&true))
                    } else {
                        auto
                    };
                    choose_home(auto, demand_ppm, eligible, config.pin_hysteresis_ppm)
                        .or(kept)
                        .or_else(|| home_mode.then(|| largest_share(entry, eligible)).flatten())
                        .or(auto)
                };
                if chosen != auto {
                    if let Some(h) = chosen {
                        home_change = HomeChange::Auto(h);
                    }
                }
                chosen
            } else {
                if auto.is_some() {
                    home_change = HomeChange::ClearAuto;
                }
                None
            }
        }
    };
    let home = home.map(usize::from).filter(|&h| h < n && slots.live[h]);
    (home, home_change)
}

/// The eligible slot holding the largest share (the lowest on a tie), if any is eligible.
fn largest_share(entry: &Entry, eligible: &[bool]) -> Option<u8> {
    (0..eligible.len())
        .filter(|&r| eligible[r])
        .max_by_key(|&r| (entry.share(r), std::cmp::Reverse(r)))
        .map(|r| r as u8)
}

/// What one round's steps share: the state, its slots, the step and the time.
pub(crate) struct Round<'a> {
    pub(crate) state: &'a CoordinatorState,
    pub(crate) slots: &'a Slots,
    pub(crate) max_step_ppm: u32,
    pub(crate) now: u64,
}

/// Steps `current` towards `target` in two passes: the first decides the decreases, whose
/// revocations shape the room the second pass grants increases into. Then no share is left
/// holding part of one unit: a decrease below one unit goes to 0, an increase below one unit
/// becomes one unit if there is room for it, else 0.
pub(crate) fn step_revoking_first(
    round: &Round<'_>,
    entry: &Entry,
    current: &[u32],
    target: &[u32],
    floors: &[u32],
) -> [u32; MAX_REGIONS] {
    let n = current.len();
    let Round {
        state,
        slots,
        max_step_ppm,
        now,
    } = *round;
    let lapsed = &slots.lapsed[..n];
    let mut enforceable = [0u32; MAX_REGIONS];
    let mut new = [0u32; MAX_REGIONS];
    step_into(
        current,
        target,
        floors,
        current,
        lapsed,
        max_step_ppm,
        &mut new[..n],
    );
    for r in 0..n {
        enforceable[r] = enforceable_after(state, entry, r, current[r], new[r], now);
    }
    step_into(
        current,
        target,
        floors,
        &enforceable[..n],
        lapsed,
        max_step_ppm,
        &mut new[..n],
    );
    let min = entry.policy.min_share_ppm();
    let mut used: u64 = (0..n).map(|r| u64::from(enforceable[r].max(new[r]))).sum();
    for r in 0..n {
        if new[r] == 0 || new[r] >= min {
            continue;
        }
        let was = new[r];
        let raise = u64::from(min.saturating_sub(was.max(enforceable[r])));
        new[r] = if was > current[r] && used + raise <= u64::from(PPM) {
            used += raise;
            min
        } else {
            0
        };
    }
    new
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_is_damped_and_grants_only_into_room() {
        // Moving 300k from region 0 to region 1 with a step of 100k.
        let cur = [600_000, 400_000];
        let tgt = [300_000, 700_000];
        // Region 0 has not acknowledged: it may still enforce 600k, so nothing can be granted.
        let out = step_towards(&cur, &tgt, &[0, 0], &cur, 100_000);
        assert_eq!(out, [500_000, 400_000]);
        // Next round, once acknowledged, the freed 100k goes to region 1 (and 0 drops again).
        let cur = [500_000, 400_000];
        let out = step_towards(&cur, &tgt, &[0, 0], &[500_000, 400_000], 100_000);
        assert_eq!(out, [400_000, 500_000]);
    }

    #[test]
    fn step_serves_floors_first() {
        // Region 2 was added below its floor; only 50k of room.
        let cur = [500_000, 450_000, 0];
        let tgt = [400_000, 400_000, 200_000];
        let out = step_towards(&cur, &tgt, &[100_000; 3], &cur, 100_000);
        assert_eq!(out, [400_000, 400_000, 50_000]);
    }

    #[test]
    fn home_has_hysteresis() {
        let e = [true; 3];
        assert_eq!(choose_home(None, &[0, 0, 0], &e, 250_000), None);
        assert_eq!(choose_home(None, &[10, 30, 20], &e, 250_000), Some(1));
        // 30 vs 25: not enough to move from 2.
        assert_eq!(choose_home(Some(2), &[10, 30, 25], &e, 250_000), Some(2));
        // 40 > 25 · 1.25: moves.
        assert_eq!(choose_home(Some(2), &[10, 40, 25], &e, 250_000), Some(1));
        // A home that is no longer eligible is replaced.
        assert_eq!(
            choose_home(Some(2), &[10, 40, 25], &[true, true, false], 250_000),
            Some(1)
        );
    }

    #[test]
    fn a_class_splits_by_where_its_subjects_are() {
        // Ten and thirty times one subject's budget: taken as it is, every region wants more
        // than the whole, and the split is even.
        let eligible = [true; 2];
        let mut raw = [10 * u64::from(PPM), 30 * u64::from(PPM)];
        let mut even = [0u32; 2];
        target_into(&[0, 0], &raw, &eligible, &mut even);
        assert_eq!(even, [500_000, 500_000]);
        as_shares_of_demand(&mut raw);
        assert_eq!(raw, [250_000, 750_000]);
        let mut split = [0u32; 2];
        target_into(&[0, 0], &raw, &eligible, &mut split);
        assert_eq!(split, [250_000, 750_000]);
        // No demand stays no demand.
        let mut none = [0u64; 3];
        as_shares_of_demand(&mut none);
        assert_eq!(none, [0; 3]);
    }

    #[test]
    fn config_validation_reports_every_field() {
        assert_eq!(AllocatorConfig::default().validate(), Ok(()));
        let bad = AllocatorConfig {
            ewma_alpha_ppm: 0,
            max_step_ppm: 0,
            ..AllocatorConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().len(), 2);
    }
}
