//! What this region could admit beyond a policy's budget if things went wrong now: the
//! allowance's `worst_case_overshoot_tokens` for one policy, and its totals over every policy
//! for the metrics an operator graphs per region.
//!
//! A cut-off region enforces its share until its lease ends (drift margin early by its clock)
//! and the coordinator reuses the non-floor part only after the lease ends (drift margin late
//! by its clock), so by design no token is granted twice. What can still be spent twice is the
//! refill of the non-floor share over the two drift margins if clocks drift beyond the bound,
//! plus tokens the cut-off bucket holds at that moment: `(share − floor) · (C + r · 2 ·
//! margin)`. Plus what an outage of this region's Redis can add under the policy's `local` fail
//! mode ([`outage::overshoot_tokens`]). An embedded store has no outage, and a lease that never
//! ends (a single region) is never reused elsewhere. A policy with a debt limit adds it: charges
//! of work already done may take this region's bucket that far below empty, whatever the share.

use quota_core::bucket::UT;
use quota_core::{Algorithm, FailMode, Policy, PPM};
use quota_store::Limit;

use crate::clock;
use crate::decision::{is_embedded, outage, Decider};
use crate::telemetry;

/// The worst case of one policy at `enforced_ppm` of its budget here, in tokens. `leased`:
/// this region holds a grant under a lease that can end.
pub fn worst_case_overshoot_tokens(
    p: &Policy,
    enforced_ppm: u32,
    limit: &Limit,
    leased: bool,
    margin_ms: u64,
    embedded: bool,
) -> f64 {
    let non_floor = f64::from(enforced_ppm.saturating_sub(p.whole_floor_ppm())) / f64::from(PPM);
    if p.algorithm == Algorithm::Concurrency {
        // Slots held above the floor stay held past a cut-off, until released or at most the
        // policy's window_ms; holds are never decided in process.
        return if leased {
            (non_floor * p.limit as f64).floor()
        } else {
            0.0
        };
    }
    let rate_tokens_per_s = p.rate_ut_per_s() as f64 / UT as f64;
    let cut_off = if leased {
        non_floor * (p.burst as f64 + rate_tokens_per_s * 2.0 * margin_ms as f64 / 1000.0)
    } else {
        0.0
    };
    let redis_out = if p.fail_mode == FailMode::Local && !embedded {
        outage::overshoot_tokens(limit)
    } else {
        0.0
    };
    // Charges after the fact (`POST /v1/charges`) take the bucket down to `-debt_limit`, in
    // every region, cut off or not.
    cut_off + redis_out + p.debt_limit as f64
}

/// This region's exposure over every policy in its view.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Totals {
    /// Policies (tenants' and plan classes') in the view.
    pub policies: usize,
    /// The mean of this region's enforced share over them, 0 to 1: summed over regions, at
    /// most 1.
    pub mean_share: f64,
    /// The sum of their worst cases, in tokens.
    pub overshoot_tokens: f64,
}

impl Decider {
    /// [`Totals`] of the current view; O(policies), for a periodic metric.
    pub fn exposure(&self, margin_ms: u64) -> Totals {
        let view = self.view();
        let region = self.region();
        let leased = view
            .region_leases
            .get(region)
            .is_some_and(|&exp| exp != u64::MAX);
        let embedded = is_embedded(self.store());
        let now = clock::monotonic_ms();
        let mut t = Totals::default();
        let mut share_sum = 0.0;
        for entry in view.policies.values() {
            let grant = entry.grants.get(region);
            let enforced = view.enforced_share_ppm(grant, now);
            let limit: Limit = quota_core::share::limit_for_share(&entry.policy, enforced).into();
            t.policies += 1;
            share_sum += f64::from(enforced) / f64::from(PPM);
            t.overshoot_tokens += worst_case_overshoot_tokens(
                &entry.policy,
                enforced,
                &limit,
                leased && grant.is_some(),
                margin_ms,
                embedded,
            );
        }
        if t.policies > 0 {
            t.mean_share = share_sum / t.policies as f64;
        }
        t
    }
}

/// Exports [`Totals`] as [`telemetry::SHARE_MEAN`] and [`telemetry::WORST_CASE_OVERSHOOT_TOKENS`]
/// every [`telemetry::METRICS_UPKEEP_INTERVAL`] until `shutdown`.
pub async fn run_metrics(
    decider: std::sync::Arc<Decider>,
    margin_ms: u64,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let region = decider.region().to_string();
    let share = metrics::gauge!(telemetry::SHARE_MEAN, "region" => region.clone());
    let overshoot = metrics::gauge!(telemetry::WORST_CASE_OVERSHOOT_TOKENS, "region" => region);
    let mut tick = tokio::time::interval(telemetry::METRICS_UPKEEP_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tick.tick() => {}
        }
        let t = decider.exposure(margin_ms);
        share.set(t.mean_share);
        overshoot.set(t.overshoot_tokens);
    }
}

#[cfg(test)]
mod tests {
    use quota_core::PolicySpec;

    use super::*;

    fn policy(fail_mode: &str, floor: f64) -> Policy {
        let spec: PolicySpec = serde_json::from_value(serde_json::json!({
            "limit": 600, "window_ms": 60000, "burst": 100, "fail_mode": fail_mode, "floor": floor
        }))
        .unwrap();
        spec.validate().unwrap()
    }

    #[test]
    fn a_leased_share_above_its_floor_is_exposed_for_its_burst_and_two_margins_of_refill() {
        let p = policy("closed", 0.0);
        let limit: Limit = quota_core::share::limit_for_share(&p, 500_000).into();
        // Half of (100 + 10/s · 2 · 0.5 s).
        let w = worst_case_overshoot_tokens(&p, 500_000, &limit, true, 500, false);
        assert!((w - 55.0).abs() < 1e-9, "{w}");
        assert_eq!(
            worst_case_overshoot_tokens(&p, 500_000, &limit, false, 500, false),
            0.0
        );
    }

    #[test]
    fn a_concurrency_limit_exposes_the_slots_held_above_its_floor() {
        let spec: PolicySpec = serde_json::from_value(serde_json::json!({
            "limit": 10, "window_ms": 30000, "algorithm": "concurrency", "floor": 0.2,
            "fail_mode": "local"
        }))
        .unwrap();
        let p = spec.validate().unwrap();
        let limit: Limit = quota_core::share::limit_for_share(&p, 550_000).into();
        // 5.5 slots of share, 2 of floor: 3 whole slots kept past a cut-off; no outage adds.
        assert_eq!(
            worst_case_overshoot_tokens(&p, 550_000, &limit, true, 500, false),
            3.0
        );
        assert_eq!(
            worst_case_overshoot_tokens(&p, 550_000, &limit, false, 500, false),
            0.0
        );
    }

    #[test]
    fn a_debt_limit_is_exposed_in_every_region_whatever_its_share() {
        let mut p = policy("closed", 0.0);
        p.debt_limit = 40;
        let limit: Limit = quota_core::share::limit_for_share(&p, 0).into();
        assert_eq!(
            worst_case_overshoot_tokens(&p, 0, &limit, false, 500, false),
            40.0
        );
        let limit: Limit = quota_core::share::limit_for_share(&p, 500_000).into();
        let w = worst_case_overshoot_tokens(&p, 500_000, &limit, true, 500, false);
        assert!((w - 95.0).abs() < 1e-9, "{w}");
    }

    #[test]
    fn the_floor_is_never_exposed_and_a_sliding_window_adds_its_limit_without_redis() {
        let p = policy("closed", 0.5);
        let limit: Limit = quota_core::share::limit_for_share(&p, 500_000).into();
        assert_eq!(
            worst_case_overshoot_tokens(&p, 500_000, &limit, true, 500, false),
            0.0
        );
        let window = Limit::SlidingWindow {
            limit: 7,
            window_ms: 1000,
        };
        let local = policy("local", 0.0);
        assert_eq!(
            worst_case_overshoot_tokens(&local, 0, &window, false, 0, false),
            7.0
        );
        assert_eq!(
            worst_case_overshoot_tokens(&local, 0, &window, false, 0, true),
            0.0
        );
    }
}
