//! The parts of this region's shares that Envoys hold over RLQS (Envoy's rate limit quota
//! service): each Envoy enforces an assigned token bucket itself, so what it may admit is
//! decided here, once per report, and never asked for again until the next.
//!
//! ```text
//!  region's enforced share ──/ daemons of the region──> this daemon's part of a budget
//!  part ──split by reported demand──> one token bucket per stream reporting the budget
//!        (whole tokens a second; raised only from what no other stream holds)
//! ```
//!
//! Why the region stays within its share: an assignment is held, here, until its time to live
//! has passed, however the stream ended (Envoy keeps enforcing it until then), and a stream's
//! new assignment takes only what the others' held ones leave, so at every instant the
//! assignments in force sum to at most the part (rate and burst) they were made from. A time to
//! live never runs past the region's lease end, after which only the floor is assigned. The
//! region agent acknowledges an epoch only once what is held here fits that epoch's part
//! ([`EnvoyHoldings::fits`]): a cut share is given elsewhere only after the Envoys here stopped
//! holding it, as the store's parameters must be rewritten first. What this cannot bound: an
//! Envoy's bucket starts full when an assignment replaces it, so every replacement can admit
//! its `max_tokens` again, which docs/envoy.md states as the assignment slack; assignments
//! change only when they move by more than a tenth, to keep replacements rare.
//!
//! Memory is bounded by the streams and buckets Envoys report: a stream's entries go once it
//! ended and its assignments expired, a budget's once it holds none.

use std::collections::HashMap;
use std::sync::Mutex;

use quota_core::{Algorithm, Policy, PolicyName, RegionId, TenantId};
use quota_store::{BucketRef, UsageRecord};

use crate::coordination::ClusterView;

/// Most streams one budget keeps entries for: past it, a new stream is denied that budget.
pub const MAX_HOLDERS: usize = 4096;

/// How long a stream's reported rates count as demand without a new report: six of Envoy's
/// 5 s reports, so a bucket an Envoy stopped reporting stops being demand.
pub const RATES_KEPT_MS: u64 = 30_000;

/// Most budgets kept: past it, a budget no stream holds yet is denied.
pub const MAX_BUDGETS: usize = 65_536;

/// The key assignments are held under: a subject's policy by name, so a new version of the
/// policy counts what Envoys still hold under the old one.
pub type BudgetKey = (TenantId, PolicyName);

/// What this daemon may hand out for one budget: its part of the region's enforced share.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Part {
    /// Refill, whole tokens a second, summed over the streams.
    pub tokens_per_s: u64,
    /// Bucket sizes summed over the streams: the share's burst, at least one second of refill
    /// (an Envoy bucket smaller than its fill would refill less than assigned).
    pub max_tokens: u64,
    /// Milliseconds an assignment may live: until the lease end; `u64::MAX` for a floor or a
    /// region without a lease.
    pub lease_left_ms: u64,
}

impl Part {
    /// This daemon's part of `region`'s grant of `policy` in `view` at local monotonic
    /// `now_ms`, with `daemons` daemons in the region: the share while the lease holds, the
    /// floor after (and once less than a second of lease is left, since Envoy counts whole
    /// seconds). Sliding windows are assigned as the token bucket of their rate and limit;
    /// a concurrency limit has no rate to assign (`None`, as an unknown bucket).
    pub fn of(
        view: &ClusterView,
        region: &RegionId,
        subject: &TenantId,
        policy: &PolicyName,
        daemons: u64,
        now_ms: u64,
    ) -> Option<(Part, Policy)> {
        let entry = view.resolve(subject, policy)?.entry;
        if entry.policy.algorithm == Algorithm::Concurrency {
            return None;
        }
        let grant = entry.grants.get(region);
        let lease_left_ms = view.lease_end_local_ms.saturating_sub(now_ms);
        let (share_ppm, lease_left_ms) = match grant {
            Some(g) if lease_left_ms >= 1000 && view.lease_end_local_ms != u64::MAX => {
                (g.share_ppm, lease_left_ms)
            }
            Some(g) if view.lease_end_local_ms == u64::MAX => (g.share_ppm, u64::MAX),
            Some(g) => (g.floor_ppm.min(g.share_ppm), u64::MAX),
            None => (0, u64::MAX),
        };
        Some((
            Self::for_share(&entry.policy, share_ppm, daemons, lease_left_ms),
            entry.policy.clone(),
        ))
    }

    /// `share_ppm` of `policy`, divided among `daemons`, rounded down to whole tokens.
    pub fn for_share(policy: &Policy, share_ppm: u32, daemons: u64, lease_left_ms: u64) -> Self {
        let share = u128::from(share_ppm.min(1_000_000));
        let n = u128::from(daemons.max(1));
        let per_s = u128::from(policy.limit) * share * 1000
            / (u128::from(policy.window_ms.max(1)) * 1_000_000 * n);
        let size = match policy.algorithm {
            Algorithm::TokenBucket => policy.burst,
            Algorithm::SlidingWindow | Algorithm::Concurrency => policy.limit,
        };
        let burst = u128::from(size) * share / (1_000_000 * n);
        let cap = |x: u128| u64::try_from(x).unwrap_or(u64::MAX);
        Self {
            tokens_per_s: cap(per_s),
            max_tokens: cap(burst.max(per_s)),
            lease_left_ms,
        }
    }
}

/// What one stream is told for one budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assignment {
    /// Envoy's token bucket: `tokens_per_fill` every second, at most `max_tokens`.
    Bucket {
        tokens_per_fill: u32,
        max_tokens: u32,
        ttl_s: u32,
    },
    /// Deny everything (a part below one token a second, or every token held elsewhere).
    Deny { ttl_s: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    tokens_per_s: u64,
    max_tokens: u64,
    /// Local monotonic ms at which the Envoy stops enforcing it.
    until_ms: u64,
}

#[derive(Debug, Clone, Default)]
struct Holder {
    /// Requests a second the stream last reported (allowed and denied).
    demand_per_s: f64,
    /// The same, allowed and denied apart, for the region's usage reports.
    allowed_per_s: f64,
    denied_per_s: f64,
    /// The stream is still open.
    live: bool,
    /// When the stream last reported this budget.
    reported_ms: u64,
    held: Option<Held>,
}

impl Holder {
    fn held_at(&self, now_ms: u64) -> Option<Held> {
        self.held.filter(|h| h.until_ms > now_ms)
    }
}

#[derive(Debug, Default)]
struct Holdings {
    budgets: HashMap<BudgetKey, HashMap<u64, Holder>>,
    /// Each budget's policy version (its bucket in usage reports) and the fractions of
    /// requests not yet reported (allowed, denied).
    spread: HashMap<BudgetKey, (u64, f64, f64)>,
}

/// Every budget's assignments to this daemon's RLQS streams.
#[derive(Debug, Default)]
pub struct EnvoyHoldings {
    inner: Mutex<Holdings>,
}

/// Shares of `part` for `demands` (requests a second): max-min fair up to each demand, and
/// what no one asks for spread evenly, so an Envoy that reported no traffic still gets some.
fn targets(part: f64, demands: &[f64]) -> Vec<f64> {
    let k = demands.len() as f64;
    let total: f64 = demands.iter().sum();
    if total <= part {
        let spare = (part - total) / k;
        return demands.iter().map(|d| d + spare).collect();
    }
    // Water-filling: the level λ with Σ min(dᵢ, λ) = part.
    let mut sorted = demands.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mut left = part;
    let mut level = 0.0;
    for (i, d) in sorted.iter().enumerate() {
        let rest = (sorted.len() - i) as f64;
        if d * rest >= left {
            level = left / rest;
            break;
        }
        left -= d;
        level = *d;
    }
    demands.iter().map(|d| d.min(level)).collect()
}

impl EnvoyHoldings {
    fn lock(&self) -> std::sync::MutexGuard<'_, Holdings> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The assignment for `stream`'s report of `budget`: `demand_per_s` requests a second, at
    /// local monotonic `now_ms`, from `part`, living `ttl_ms` at most (rounded down to whole
    /// seconds, never past the part's lease). Held until it expires.
    pub fn assign(
        &self,
        budget: &BudgetKey,
        stream: u64,
        demand_per_s: f64,
        part: Part,
        ttl_ms: u64,
        now_ms: u64,
    ) -> Assignment {
        let ttl_s = (ttl_ms.min(part.lease_left_ms) / 1000).min(u64::from(u32::MAX)) as u32;
        if ttl_s == 0 {
            // Envoy counts whole seconds: nothing shorter can be assigned without outliving
            // the lease. A denial holds nothing.
            return Assignment::Deny { ttl_s: 1 };
        }
        let mut all = self.lock();
        if !all.budgets.contains_key(budget) && all.budgets.len() >= MAX_BUDGETS {
            return Assignment::Deny { ttl_s };
        }
        let holders = all.budgets.entry(budget.clone()).or_default();
        // Forget streams that ended, or stopped reporting this budget, once nothing they were
        // told is in force.
        holders.retain(|id, h| {
            *id == stream
                || h.held_at(now_ms).is_some()
                || (h.live && now_ms.saturating_sub(h.reported_ms) <= 3 * ttl_ms)
        });
        if !holders.contains_key(&stream) && holders.len() >= MAX_HOLDERS {
            return Assignment::Deny { ttl_s };
        }
        let me = holders.entry(stream).or_default();
        me.demand_per_s = if demand_per_s.is_finite() {
            demand_per_s.max(0.0)
        } else {
            0.0
        };
        me.live = true;
        me.reported_ms = now_ms;
        let current = me.held_at(now_ms);
        // What the others hold now, and the live streams' fair targets (an ended stream asks
        // for nothing more, but what it holds is not free until it expires).
        let (mut others_rate, mut others_size) = (0u64, 0u64);
        let mut demands = Vec::with_capacity(holders.len());
        let mut mine = 0;
        for (id, h) in holders.iter() {
            if *id == stream {
                mine = demands.len();
            } else if let Some(held) = h.held_at(now_ms) {
                others_rate = others_rate.saturating_add(held.tokens_per_s);
                others_size = others_size.saturating_add(held.max_tokens);
            }
            if h.live {
                demands.push(h.demand_per_s);
            }
        }
        let target = targets(part.tokens_per_s as f64, &demands)[mine];
        let free_rate = part.tokens_per_s.saturating_sub(others_rate);
        let free_size = part.max_tokens.saturating_sub(others_size);
        let mut rate = (target.floor() as u64).min(free_rate);
        // Keep the current assignment while it fits and the new one is within a tenth of it:
        // every replacement hands the Envoy a full bucket again.
        if let Some(c) = current {
            if c.tokens_per_s <= free_rate
                && c.max_tokens <= free_size
                && rate.abs_diff(c.tokens_per_s) <= c.tokens_per_s / 10
            {
                rate = c.tokens_per_s;
            }
        }
        let size = if current.is_some_and(|c| c.tokens_per_s == rate && c.max_tokens <= free_size) {
            current.map_or(0, |c| c.max_tokens)
        } else if part.tokens_per_s == 0 {
            0
        } else {
            let proportional =
                u128::from(part.max_tokens) * u128::from(rate) / u128::from(part.tokens_per_s);
            (proportional as u64).max(rate).min(free_size)
        };
        let rate = rate.min(size).min(u64::from(u32::MAX));
        let size = size.min(u64::from(u32::MAX));
        let until_ms = now_ms.saturating_add(u64::from(ttl_s) * 1000);
        let me = holders.get_mut(&stream).expect("entered above");
        if rate == 0 {
            me.held = None;
            return Assignment::Deny { ttl_s };
        }
        me.held = Some(Held {
            tokens_per_s: rate,
            max_tokens: size,
            until_ms,
        });
        Assignment::Bucket {
            tokens_per_fill: rate as u32,
            max_tokens: size as u32,
            ttl_s,
        }
    }

    /// Records what `stream` reported for `budget` (policy `version`): requests a second,
    /// allowed and denied. They go into the region's usage reports spread over time
    /// ([`EnvoyHoldings::take_usage`]): an Envoy reports 5 s of requests at once, which added
    /// to one usage report would read as a burst of demand and then none.
    pub fn record_rates(
        &self,
        budget: &BudgetKey,
        stream: u64,
        version: u64,
        allowed_per_s: f64,
        denied_per_s: f64,
    ) {
        let finite = |x: f64| if x.is_finite() { x.max(0.0) } else { 0.0 };
        let mut all = self.lock();
        let Some(h) = all
            .budgets
            .get_mut(budget)
            .and_then(|holders| holders.get_mut(&stream))
        else {
            return;
        };
        h.allowed_per_s = finite(allowed_per_s);
        h.denied_per_s = finite(denied_per_s);
        let spread = all.spread.entry(budget.clone()).or_default();
        if spread.0 != version {
            *spread = (version, 0.0, 0.0);
        }
    }

    /// The requests open streams report, over `interval_ms` to local monotonic `now_ms`: each
    /// budget's rates (their sum over its open streams that reported it in the last
    /// [`RATES_KEPT_MS`]) times the interval, in whole requests, the fractions kept for the
    /// next call. The region's demand, as its usage reports carry it.
    pub fn take_usage(&self, interval_ms: u64, now_ms: u64) -> Vec<UsageRecord> {
        let mut all = self.lock();
        let Holdings { budgets, spread } = &mut *all;
        spread.retain(|k, _| budgets.contains_key(k));
        let secs = interval_ms as f64 / 1000.0;
        let mut out = Vec::new();
        for (key, (version, carry_a, carry_d)) in spread.iter_mut() {
            let Some(holders) = budgets.get(key) else {
                continue;
            };
            let (a, d) = holders
                .values()
                .filter(|h| h.live && now_ms.saturating_sub(h.reported_ms) <= RATES_KEPT_MS)
                .fold((0.0, 0.0), |(a, d), h| {
                    (a + h.allowed_per_s, d + h.denied_per_s)
                });
            let (a, d) = (a * secs + *carry_a, d * secs + *carry_d);
            let (admitted, denied) = (a.floor(), d.floor());
            (*carry_a, *carry_d) = (a - admitted, d - denied);
            if admitted >= 1.0 || denied >= 1.0 {
                out.push(UsageRecord {
                    bucket: BucketRef {
                        tenant: key.0.clone(),
                        policy: key.1.clone(),
                        version: *version,
                    },
                    admitted: admitted as u64,
                    denied: denied as u64,
                });
            }
        }
        out
    }

    /// `stream` ended: it asks for nothing more; what it was told stays held until it expires.
    pub fn end_stream(&self, stream: u64, budgets: &[BudgetKey]) {
        let mut all = self.lock();
        for b in budgets {
            if let Some(holders) = all.budgets.get_mut(b) {
                if let Some(h) = holders.get_mut(&stream) {
                    h.live = false;
                    h.demand_per_s = 0.0;
                    h.allowed_per_s = 0.0;
                    h.denied_per_s = 0.0;
                }
            }
        }
    }

    /// Whether every assignment still in force at `now_ms` fits this daemon's part of `view`'s
    /// grants (`daemons` in the region): the region may acknowledge `view`'s epoch only then.
    pub fn fits(&self, view: &ClusterView, region: &RegionId, daemons: u64, now_ms: u64) -> bool {
        let mut all = self.lock();
        all.budgets.retain(|_, holders| {
            holders.retain(|_, h| h.live || h.held_at(now_ms).is_some());
            !holders.is_empty()
        });
        all.budgets.iter().all(|((subject, policy), holders)| {
            let (rate, size) = holders.values().filter_map(|h| h.held_at(now_ms)).fold(
                (0u64, 0u64),
                |(r, s), h| {
                    (
                        r.saturating_add(h.tokens_per_s),
                        s.saturating_add(h.max_tokens),
                    )
                },
            );
            if rate == 0 {
                return true;
            }
            // A budget the view no longer has: nothing is granted for it any more.
            Part::of(view, region, subject, policy, daemons, now_ms)
                .is_some_and(|(p, _)| rate <= p.tokens_per_s && size <= p.max_tokens)
        })
    }

    /// Streams still open that reported `budget`.
    pub fn live_streams(&self, budget: &BudgetKey) -> usize {
        self.lock()
            .budgets
            .get(budget)
            .map_or(0, |h| h.values().filter(|h| h.live).count())
    }

    /// Budgets with entries, and entries (a stream's budget) over all of them: for the gauges.
    pub fn counts(&self) -> (usize, usize) {
        let all = self.lock();
        (
            all.budgets.len(),
            all.budgets.values().map(HashMap::len).sum(),
        )
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;
    use crate::decision::tests::{entry, ids};

    const TTL_MS: u64 = 11_000;

    fn part(tokens_per_s: u64, max_tokens: u64) -> Part {
        Part {
            tokens_per_s,
            max_tokens,
            lease_left_ms: u64::MAX,
        }
    }

    fn bucket(a: Assignment) -> (u32, u32) {
        match a {
            Assignment::Bucket {
                tokens_per_fill,
                max_tokens,
                ..
            } => (tokens_per_fill, max_tokens),
            Assignment::Deny { .. } => (0, 0),
        }
    }

    #[test]
    fn targets_fill_demand_fairly_and_spread_what_is_left() {
        assert_eq!(targets(100.0, &[10.0, 30.0]), vec![40.0, 60.0]);
        assert_eq!(
            targets(100.0, &[10.0, 200.0, 300.0]),
            vec![10.0, 45.0, 45.0]
        );
        assert_eq!(targets(90.0, &[0.0, 0.0, 0.0]), vec![30.0, 30.0, 30.0]);
        let t = targets(7.0, &[100.0, 1.0]);
        assert_eq!(t, vec![6.0, 1.0]);
    }

    #[test]
    fn a_stream_gets_more_only_as_the_others_give_it_back() {
        let h = EnvoyHoldings::default();
        let b = ids("t", "w");
        let p = part(100, 100);
        // Alone, with no traffic yet: the whole part.
        assert_eq!(bucket(h.assign(&b, 1, 0.0, p, TTL_MS, 0)), (100, 100));
        // A second stream: nothing is free until the first gives some back.
        assert_eq!(bucket(h.assign(&b, 2, 80.0, p, TTL_MS, 100)), (0, 0));
        // The first reports little traffic: it keeps about its demand and half the rest.
        let (r1, s1) = bucket(h.assign(&b, 1, 10.0, p, TTL_MS, 5_000));
        assert_eq!(r1, 15);
        assert_eq!(s1, 15);
        // Now the second takes its target from what is free.
        let (r2, s2) = bucket(h.assign(&b, 2, 80.0, p, TTL_MS, 5_100));
        assert_eq!((r2, s2), (85, 85));
        assert!(r1 + r2 <= 100 && s1 + s2 <= 100);
    }

    #[test]
    fn an_ended_stream_holds_its_part_until_its_assignment_expires() {
        let h = EnvoyHoldings::default();
        let b = ids("t", "w");
        let p = part(60, 60);
        assert_eq!(bucket(h.assign(&b, 1, 30.0, p, TTL_MS, 0)), (60, 60));
        h.end_stream(1, std::slice::from_ref(&b));
        // Before the TTL: the ended stream's 60 are not free.
        assert_eq!(bucket(h.assign(&b, 2, 30.0, p, TTL_MS, 10_999)), (0, 0));
        // After it: all of it.
        assert_eq!(bucket(h.assign(&b, 2, 30.0, p, TTL_MS, 11_000)), (60, 60));
        assert_eq!(h.counts(), (1, 1));
    }

    #[test]
    fn small_moves_keep_the_assignment_and_large_ones_replace_it() {
        let h = EnvoyHoldings::default();
        let b = ids("t", "w");
        assert_eq!(
            bucket(h.assign(&b, 1, 5.0, part(100, 200), TTL_MS, 0)),
            (100, 200)
        );
        // The part grows by 5%: the Envoy keeps its bucket (no full bucket handed out again).
        assert_eq!(
            bucket(h.assign(&b, 1, 5.0, part(105, 210), TTL_MS, 5_000)),
            (100, 200)
        );
        // By half: replaced.
        assert_eq!(
            bucket(h.assign(&b, 1, 5.0, part(150, 300), TTL_MS, 10_000)),
            (150, 300)
        );
        // Shrunk below what it holds: replaced at once, whatever the step.
        assert_eq!(
            bucket(h.assign(&b, 1, 5.0, part(149, 298), TTL_MS, 15_000)),
            (149, 298)
        );
    }

    #[test]
    fn lifetimes_are_whole_seconds_within_the_lease() {
        let h = EnvoyHoldings::default();
        let b = ids("t", "w");
        let leased = Part {
            lease_left_ms: 4_999,
            ..part(10, 10)
        };
        assert_eq!(
            h.assign(&b, 1, 1.0, leased, TTL_MS, 0),
            Assignment::Bucket {
                tokens_per_fill: 10,
                max_tokens: 10,
                ttl_s: 4
            }
        );
        // Under a second of lease: nothing can be assigned that would not outlive it.
        let ending = Part {
            lease_left_ms: 999,
            ..part(10, 10)
        };
        assert_eq!(
            h.assign(&b, 2, 1.0, ending, TTL_MS, 0),
            Assignment::Deny { ttl_s: 1 }
        );
        // A part below a token a second is a denial.
        assert_eq!(
            h.assign(&ids("t", "x"), 1, 1.0, part(0, 0), TTL_MS, 0),
            Assignment::Deny { ttl_s: 11 }
        );
    }

    #[test]
    fn the_part_follows_the_lease_then_the_floor() {
        // 600 a minute (10 a second), burst 1200; region a has half, floor a tenth.
        let e = entry(
            json!({"limit": 600, "window_ms": 60000, "burst": 1200}),
            &[("a", 500_000, 100_000), ("b", 500_000, 100_000)],
            None,
        );
        let (t, w) = ids("t", "w");
        let view = ClusterView {
            policies: [((t.clone(), w.clone()), e)].into_iter().collect(),
            lease_end_local_ms: 10_000,
            ..ClusterView::default()
        };
        let a = RegionId::new("a").unwrap();
        let (p, _) = Part::of(&view, &a, &t, &w, 1, 0).unwrap();
        assert_eq!(
            p,
            Part {
                tokens_per_s: 5,
                max_tokens: 600,
                lease_left_ms: 10_000
            }
        );
        // Two daemons: half each.
        let (p, _) = Part::of(&view, &a, &t, &w, 2, 0).unwrap();
        assert_eq!((p.tokens_per_s, p.max_tokens), (2, 300));
        // Less than a second of lease left, and after it: the floor, with no lease to outlive.
        for now in [9_001, 10_000, 50_000] {
            let (p, _) = Part::of(&view, &a, &t, &w, 1, now).unwrap();
            assert_eq!(
                p,
                Part {
                    tokens_per_s: 1,
                    max_tokens: 120,
                    lease_left_ms: u64::MAX
                }
            );
        }
        // A budget this region has no grant of, and one the view lacks.
        let c = RegionId::new("c").unwrap();
        assert_eq!(Part::of(&view, &c, &t, &w, 1, 0).unwrap().0.tokens_per_s, 0);
        assert!(Part::of(&view, &a, &t, &PolicyName::new("nope").unwrap(), 1, 0).is_none());
    }

    #[test]
    fn a_cut_share_fits_once_every_stream_was_told_or_expired() {
        let e = |share| {
            entry(
                json!({"limit": 100, "window_ms": 1000}),
                &[("a", share, 0)],
                None,
            )
        };
        let (t, w) = ids("t", "w");
        let view_of = |share| ClusterView {
            policies: [((t.clone(), w.clone()), e(share))].into_iter().collect(),
            lease_end_local_ms: u64::MAX,
            ..ClusterView::default()
        };
        let a = RegionId::new("a").unwrap();
        let (full, quarter) = (view_of(1_000_000), view_of(250_000));
        let h = EnvoyHoldings::default();
        let b = (t.clone(), w.clone());
        let p = |v: &ClusterView, now| Part::of(v, &a, &t, &w, 1, now).unwrap().0;
        // Stream 1 alone takes all; once stream 2 is known, each takes half.
        assert_eq!(
            bucket(h.assign(&b, 1, 50.0, p(&full, 0), TTL_MS, 0)),
            (100, 100)
        );
        assert_eq!(
            bucket(h.assign(&b, 2, 50.0, p(&full, 0), TTL_MS, 0)),
            (0, 0)
        );
        assert_eq!(
            bucket(h.assign(&b, 1, 50.0, p(&full, 1), TTL_MS, 1)),
            (50, 50)
        );
        assert_eq!(
            bucket(h.assign(&b, 2, 50.0, p(&full, 2), TTL_MS, 2)),
            (50, 50)
        );
        assert!(h.fits(&full, &a, 1, 3));
        assert!(!h.fits(&quarter, &a, 1, 3));
        // The share is cut to a quarter. Stream 2 went away without being told; stream 1 is
        // told, and gets nothing while stream 2's 50 are in force.
        h.end_stream(2, std::slice::from_ref(&b));
        assert_eq!(
            bucket(h.assign(&b, 1, 50.0, p(&quarter, 5_000), TTL_MS, 5_000)),
            (0, 0)
        );
        assert!(!h.fits(&quarter, &a, 1, 5_001));
        // Stream 2's assignment expires 11 s after it was given: now it fits.
        assert!(!h.fits(&quarter, &a, 1, 11_001));
        assert!(h.fits(&quarter, &a, 1, 11_002));
        assert_eq!(
            bucket(h.assign(&b, 1, 50.0, p(&quarter, 11_002), TTL_MS, 11_002)),
            (25, 25)
        );
    }

    #[test]
    fn reported_rates_are_spread_over_usage_reports() {
        let h = EnvoyHoldings::default();
        let b = ids("t", "w");
        h.assign(&b, 1, 0.0, part(10, 10), TTL_MS, 0);
        h.assign(&b, 2, 0.0, part(10, 10), TTL_MS, 0);
        // 5 s of traffic reported at once: 2.5 allowed and 0.5 denied a second, and 1 a
        // second from the other stream.
        h.record_rates(&b, 1, 7, 2.5, 0.5);
        h.record_rates(&b, 2, 7, 1.0, 0.0);
        // Five 200 ms usage reports carry one second of it, fractions carried over.
        let mut total = (0, 0);
        for k in 1..=5 {
            for u in h.take_usage(200, k * 200) {
                assert_eq!((u.bucket.tenant.as_str(), u.bucket.version), ("t", 7));
                total = (total.0 + u.admitted, total.1 + u.denied);
            }
        }
        assert_eq!(total, (3, 0));
        let more: Vec<_> = h.take_usage(1000, 2000);
        // The next second: 3.5 and the half carried over.
        assert_eq!((more[0].admitted, more[0].denied), (4, 1));
        // An ended stream is no demand; one that stopped reporting neither, after a while.
        h.end_stream(1, std::slice::from_ref(&b));
        assert_eq!(h.take_usage(1000, 3000)[0].admitted, 1);
        assert!(h.take_usage(1000, RATES_KEPT_MS + 1).is_empty());
    }

    proptest! {
        /// Whatever streams report, end, and whenever: the assignments in force never sum
        /// above the part, in rate or in size.
        #[test]
        fn assignments_in_force_never_exceed_the_part(
            steps in proptest::collection::vec((0u64..6, 0.0f64..500.0, 0u64..4_000, any::<bool>()), 1..120),
            rate in 0u64..400,
            extra in 0u64..400,
        ) {
            let h = EnvoyHoldings::default();
            let b = ids("t", "w");
            let p = part(rate, rate + extra);
            let mut now = 0;
            let mut held: HashMap<u64, (u64, u64, u64)> = HashMap::new();
            for (stream, demand, dt, end) in steps {
                now += dt;
                if end {
                    h.end_stream(stream, std::slice::from_ref(&b));
                    continue;
                }
                let a = h.assign(&b, stream, demand, p, TTL_MS, now);
                let (r, s) = bucket(a);
                let ttl = match a {
                    Assignment::Bucket { ttl_s, .. } | Assignment::Deny { ttl_s } => ttl_s,
                };
                held.insert(stream, (u64::from(r), u64::from(s), now + u64::from(ttl) * 1000));
                prop_assert!(r <= s || r == 0);
                let live = held.values().filter(|(_, _, until)| *until > now);
                let (sr, ss) = live.fold((0, 0), |(a, b), (r, s, _)| (a + r, b + s));
                prop_assert!(sr <= p.tokens_per_s, "rate {} > {}", sr, p.tokens_per_s);
                prop_assert!(ss <= p.max_tokens, "size {} > {}", ss, p.max_tokens);
            }
        }
    }
}
