//! Metrics: the shadow ideal global bucket and what each strategy is measured by.
//!
//! The shadow bucket is the ideal of docs/architecture.md: one reference bucket per tenant with
//! capacity C = burst and refill r = limit / window, seeing every request in the world at its
//! true time.
//! A [`Recorder`] per strategy compares that strategy's verdict on each request with the
//! shadow's:
//!
//! - overshoot(W) = max over windows `[t, t+W)` of tokens the strategy admitted for one tenant
//!   ÷ (C + r·W), maximised over tenants too, for W = the policy window and W = 1 s. Windows are
//!   kept as sliding sums of bins (a tick for 1 s, W/600 for the policy window), so a window is
//!   between W − one bin and W long: the figure can read low by at most one bin's admissions;
//! - goodput = tokens both admitted ÷ tokens the shadow admitted;
//! - healthy goodput: what a fault costs the regions it does not touch. In a run with a cut or
//!   crashed region, the tokens the regions no fault touches admitted, matched per tenant and
//!   bin against what the same strategy admitted there in the same run without those faults
//!   (its baseline, at most what the shadow admitted in the bin):
//!   Σ min(faulted, baseline) ÷ Σ baseline ([`Recorder::against_baseline`]). Matching against
//!   the shadow region by region instead would count, under saturation, the shadow's
//!   arrival-order apportioning of the budget between regions as a loss: a static split, which
//!   no fault affects, read 0.94 in `flapping` that way. Without a cut or crashed region, the
//!   regions' tokens together are matched against the shadow (the goodput);
//! - floor time: seconds after warm-up each region spent enforcing only its floors (its lease
//!   ran out), for the strategies that have leases;
//! - false denial rate = requests the shadow admits but the strategy denies ÷ requests the
//!   shadow admits.
//!
//!   Both are matched per tenant and [`MATCH_S`]-second bin rather than per request: in each
//!   (tenant, bin) "both admitted" is min(shadow tokens, strategy tokens) and the false denials
//!   are max(0, shadow-admitted requests − strategy-admitted requests), booked to the bin's
//!   first second. Under saturation *which*
//!   request meets a free token is an accident of arrival order (a global store sees requests
//!   up to half a round trip later than the shadow does), and matching request by request
//!   would count that accident as a denial;
//! - decision latency, modelled per request, as a histogram of 0.1 ms bins;
//! - convergence after each demand shift: the seconds until every later [`SETTLED_S`]-second
//!   window (up to the next shift) has a false denial rate at or below [`CONVERGED_FD`];
//!   "never" when the last window before the next shift is still above.
//!
//! Overshoot is measured over the whole run (the bound must always hold). Goodput, false
//! denials and latency are measured after a warm-up (one policy window by default), since
//! every bucket starts full and the ideal's whole-budget burst takes that long to drain.

use quota_core::bucket::{decide, BucketParams, BucketState};
use serde::Serialize;

use crate::control::AgentCounts;
use crate::regional_store::StoreCalls;
use crate::traffic::{Request, Tenant};

/// The false denial rate over a [`SETTLED_S`]-second window at or below which a strategy counts
/// as converged (twice the 1% target, so that noise in one window does not read as a relapse).
pub const CONVERGED_FD: f64 = 0.02;
/// Consecutive seconds the rate must hold to count as converged.
pub const SETTLED_S: usize = 5;
/// Seconds over which a tenant's admissions are matched against the shadow's. Longer than a
/// second, so tokens a split bucket carries from one second into the next are not counted as
/// a denial in the first and forgotten in the second.
pub const MATCH_S: u64 = 5;
/// Latency histogram bin, in microseconds.
const LATENCY_BIN_US: u64 = 100;
/// Latencies beyond this land in the last bin.
const LATENCY_MAX_US: u64 = 2_000_000;

/// The ideal global bucket per tenant.
#[derive(Debug)]
pub struct Shadow {
    params: Vec<BucketParams>,
    states: Vec<Option<BucketState>>,
}

impl Shadow {
    pub fn new(tenants: &[Tenant]) -> Self {
        Self {
            params: tenants
                .iter()
                .map(|t| BucketParams::global(&t.policy))
                .collect(),
            states: vec![None; tenants.len()],
        }
    }

    /// The global bucket's verdict on `req` at true time `t_ms`.
    pub fn decide(&mut self, t_ms: u64, req: &Request) -> bool {
        let i = req.tenant as usize;
        let (d, s) = decide(
            t_ms,
            &self.params[i],
            self.states[i].as_ref(),
            u64::from(req.cost),
        );
        self.states[i] = Some(s);
        d.allowed
    }
}

/// Per-tenant sliding sums over the last `len` bins, advanced lazily (idle tenants cost
/// nothing). The current bin lives in the tenant's [`Head`], so an admission touches one
/// cache line; past bins are written to the ring only when the tenant moves to a new bin.
#[derive(Debug)]
struct Ring {
    bin_ms: u64,
    len: usize,
    heads: Vec<Head>,
    /// Tokens per past bin; u32 halves the memory.
    bins: Vec<u32>,
}

/// A tenant's current bin, its tokens so far, and the sum over the window.
#[derive(Debug, Clone, Copy, Default)]
struct Head {
    bin: u64,
    current: u32,
    sum: u64,
}

impl Ring {
    fn new(tenants: usize, bin_ms: u64, len: usize) -> Self {
        Self {
            bin_ms,
            len,
            heads: vec![Head::default(); tenants],
            bins: vec![0; tenants * len],
        }
    }

    /// The bin of `t_ms`.
    fn locate(&self, t_ms: u64) -> u64 {
        t_ms / self.bin_ms
    }

    /// Adds `tokens` in `bin` (see [`Ring::locate`]; never decreasing per tenant) and returns
    /// the tenant's sum over the last `len` bins.
    fn add(&mut self, tenant: usize, bin: u64, tokens: u64) -> u64 {
        let h = &mut self.heads[tenant];
        if bin > h.bin {
            let base = tenant * self.len;
            let len = self.len as u64;
            // Close the old current bin, then expire every slot the window moved over.
            self.bins[base + (h.bin % len) as usize] = h.current;
            if bin - h.bin >= len {
                self.bins[base..base + self.len].fill(0);
                h.sum = 0;
            } else {
                for b in h.bin + 1..=bin {
                    let old = &mut self.bins[base + (b % len) as usize];
                    h.sum -= u64::from(*old);
                    *old = 0;
                }
            }
            h.bin = bin;
            h.current = 0;
        }
        // Current bin and sum move by the same amount even in the (unreachable) case of a bin
        // holding more than u32::MAX tokens.
        let new = h
            .current
            .saturating_add(u32::try_from(tokens).unwrap_or(u32::MAX));
        h.sum += u64::from(new - h.current);
        h.current = new;
        h.sum
    }
}

/// Everything measured about one strategy in one run.
#[derive(Debug)]
pub struct Recorder {
    ring_w: Ring,
    ring_1s: Ring,
    /// Per tenant: 1 / (C + r·W) and 1 / (C + r·1 s).
    inv_bound_w: Vec<f64>,
    inv_bound_1s: Vec<f64>,
    /// The time the cached bins below belong to.
    cached_t_ms: u64,
    cached_w: u64,
    cached_1s: u64,
    max_w: f64,
    max_1s: f64,
    /// Per tenant: its overshoot(W) so far.
    max_w_tenant: Vec<f64>,
    latency: Vec<u64>,
    /// Latency counts from here on.
    warmup_ms: u64,
    decisions: u64,
    /// Per tenant: the matching bin being accumulated (by its first second) and its counts.
    open: Vec<TenantSecond>,
    /// Per second of the run.
    secs: Vec<Second>,
    /// Which regions no fault touches.
    healthy: Vec<bool>,
    /// Per region: ms after warm-up on floors only.
    floor_ms: Vec<u64>,
    /// Every closed matching bin's tokens in healthy regions, for [`Recorder::against_baseline`].
    healthy_bins: Vec<HealthyBin>,
    /// Seconds per matching bin ([`MATCH_S`] unless [`Recorder::matching_over`] says).
    match_s: usize,
    /// Decisions made in another region than the caller's, over the whole run.
    forwarded: u64,
    /// Denials with no retry time (the deciding bucket can never hold the cost), over the
    /// whole run.
    never: u64,
}

/// One tenant's matching bin as it closed: healthy regions' tokens and the shadow's (all
/// regions).
#[derive(Debug, Clone, Copy)]
struct HealthyBin {
    tenant: usize,
    sec: usize,
    healthy_tokens: u64,
    shadow_tokens: u64,
}

/// One tenant's counts in its current matching bin, compared with the shadow when it closes.
#[derive(Debug, Clone, Copy, Default)]
struct TenantSecond {
    sec: usize,
    shadow_tokens: u64,
    shadow_requests: u64,
    /// Shadow and strategy tokens in healthy regions.
    healthy_shadow_tokens: u64,
    healthy_tokens: u64,
    tokens: u64,
    requests: u64,
}

/// What happened in one second of a run.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Second {
    pub admitted_tokens: u64,
    pub shadow_tokens: u64,
    pub both_tokens: u64,
    pub shadow_requests: u64,
    pub false_denials: u64,
    pub healthy_shadow_tokens: u64,
    pub healthy_both_tokens: u64,
    /// The largest overshoot(W) of any window ending in this second.
    pub overshoot_w: f64,
}

impl Recorder {
    /// A recorder for `tenants`, all sharing the policy window `window_ms`, with ticks of
    /// `tick_ms` over `duration_ms`; latency counts from `warmup_ms` on.
    pub fn new(
        tenants: &[Tenant],
        window_ms: u64,
        tick_ms: u64,
        duration_ms: u64,
        warmup_ms: u64,
        healthy: Vec<bool>,
    ) -> Self {
        let bin_w = (window_ms / 600).max(tick_ms).div_ceil(tick_ms) * tick_ms;
        let len_w = window_ms.div_ceil(bin_w) as usize;
        let bin_1s = tick_ms.min(1000);
        let len_1s = 1000u64.div_ceil(bin_1s) as usize;
        let inv_bound = |w_ms: u64| -> Vec<f64> {
            tenants
                .iter()
                .map(|t| {
                    let p = &t.policy;
                    1.0 / (p.burst as f64 + p.limit as f64 * w_ms as f64 / p.window_ms as f64)
                })
                .collect()
        };
        Self {
            ring_w: Ring::new(tenants.len(), bin_w, len_w),
            ring_1s: Ring::new(tenants.len(), bin_1s, len_1s),
            inv_bound_w: inv_bound(window_ms),
            inv_bound_1s: inv_bound(1000),
            cached_t_ms: 0,
            cached_w: 0,
            cached_1s: 0,
            max_w: 0.0,
            max_1s: 0.0,
            max_w_tenant: vec![0.0; tenants.len()],
            latency: vec![0; (LATENCY_MAX_US / LATENCY_BIN_US) as usize + 1],
            warmup_ms,
            decisions: 0,
            open: vec![TenantSecond::default(); tenants.len()],
            secs: vec![Second::default(); duration_ms.div_ceil(1000) as usize],
            floor_ms: vec![0; healthy.len()],
            match_s: MATCH_S as usize,
            forwarded: 0,
            never: 0,
            healthy,
            healthy_bins: Vec::new(),
        }
    }

    /// The same recorder matching admissions against the shadow's per `match_s`-second bin
    /// instead of [`MATCH_S`]: for costs that land in lumps (a request's tokens at its end), a
    /// short bin would count *when* a lump lands as denials.
    pub fn matching_over(self, match_s: u64) -> Self {
        assert!(match_s > 0, "a matching bin lasts at least a second");
        Self {
            match_s: match_s as usize,
            ..self
        }
    }

    /// Counts `dt_ms` at true time `t_ms` during which `region` enforced only its floors.
    pub fn record_floor(&mut self, t_ms: u64, region: usize, dt_ms: u64) {
        if t_ms >= self.warmup_ms {
            if let Some(f) = self.floor_ms.get_mut(region) {
                *f += dt_ms;
            }
        }
    }

    /// Records where one request was decided and whether it was a denial with no retry time.
    pub fn record_route(&mut self, forwarded: bool, never: bool) {
        self.forwarded += u64::from(forwarded);
        self.never += u64::from(never);
    }

    /// Records one request's verdicts at true time `t_ms` (which never decreases).
    pub fn record(&mut self, t_ms: u64, req: &Request, shadow_ok: bool, ok: bool, latency_us: u64) {
        let cost = u64::from(req.cost);
        let tenant = req.tenant as usize;
        self.decisions += 1;
        if t_ms >= self.warmup_ms {
            self.latency[(latency_us.min(LATENCY_MAX_US) / LATENCY_BIN_US) as usize] += 1;
        }
        let now_sec = (t_ms / 1000) as usize;
        let bin_sec = now_sec - now_sec % self.match_s;
        if self.open[tenant].sec != bin_sec {
            self.close(tenant);
            self.open[tenant].sec = bin_sec;
        }
        let healthy = self.healthy.get(req.region).copied().unwrap_or(false);
        let open = &mut self.open[tenant];
        if shadow_ok {
            open.shadow_tokens += cost;
            open.shadow_requests += 1;
            if healthy {
                open.healthy_shadow_tokens += cost;
            }
        }
        if ok {
            open.tokens += cost;
            if healthy {
                open.healthy_tokens += cost;
            }
            open.requests += 1;
            let sec = &mut self.secs[now_sec];
            sec.admitted_tokens += cost;
            if t_ms != self.cached_t_ms {
                self.cached_t_ms = t_ms;
                self.cached_w = self.ring_w.locate(t_ms);
                self.cached_1s = self.ring_1s.locate(t_ms);
            }
            let w = self.ring_w.add(tenant, self.cached_w, cost) as f64 * self.inv_bound_w[tenant];
            let s =
                self.ring_1s.add(tenant, self.cached_1s, cost) as f64 * self.inv_bound_1s[tenant];
            sec.overshoot_w = sec.overshoot_w.max(w);
            self.max_w = self.max_w.max(w);
            self.max_w_tenant[tenant] = self.max_w_tenant[tenant].max(w);
            self.max_1s = self.max_1s.max(s);
        }
    }

    /// Matches a tenant's open bin against the shadow and adds it to the run's seconds.
    fn close(&mut self, tenant: usize) {
        let o = std::mem::take(&mut self.open[tenant]);
        if o.shadow_requests > 0 || o.requests > 0 || o.healthy_tokens > 0 {
            self.healthy_bins.push(HealthyBin {
                tenant,
                sec: o.sec,
                healthy_tokens: o.healthy_tokens,
                shadow_tokens: o.shadow_tokens,
            });
        }
        if let Some(sec) = self.secs.get_mut(o.sec) {
            sec.shadow_tokens += o.shadow_tokens;
            sec.shadow_requests += o.shadow_requests;
            sec.both_tokens += o.shadow_tokens.min(o.tokens);
            sec.false_denials += o.shadow_requests.saturating_sub(o.requests);
            sec.healthy_shadow_tokens += o.healthy_shadow_tokens;
            sec.healthy_both_tokens += o.healthy_shadow_tokens.min(o.healthy_tokens);
        }
    }

    /// Closes every tenant's open bin; call once after the last tick.
    pub fn finish(&mut self) {
        for tenant in 0..self.open.len() {
            self.close(tenant);
        }
    }

    /// Measures healthy goodput against `baseline`: the same strategy on the same arrivals in
    /// the same run without the faults that make a region unhealthy (both recorders finished).
    /// In each tenant's bin the baseline counts at most what the shadow admitted.
    pub fn against_baseline(&mut self, baseline: &Recorder) {
        let mine: std::collections::HashMap<(usize, usize), u64> = self
            .healthy_bins
            .iter()
            .map(|b| ((b.tenant, b.sec), b.healthy_tokens))
            .collect();
        for sec in &mut self.secs {
            sec.healthy_shadow_tokens = 0;
            sec.healthy_both_tokens = 0;
        }
        for b in &baseline.healthy_bins {
            let base = b.healthy_tokens.min(b.shadow_tokens);
            let got = mine.get(&(b.tenant, b.sec)).copied().unwrap_or(0);
            if let Some(sec) = self.secs.get_mut(b.sec) {
                sec.healthy_shadow_tokens += base;
                sec.healthy_both_tokens += got.min(base);
            }
        }
    }

    /// Each tenant's overshoot(W) so far, in tenant order (the run's is their largest).
    pub fn overshoot_window_by_tenant(&self) -> &[f64] {
        &self.max_w_tenant
    }

    /// The decisions recorded so far.
    pub fn decisions(&self) -> u64 {
        self.decisions
    }

    /// The per-second record of the run.
    pub fn seconds(&self) -> &[Second] {
        &self.secs
    }

    fn latency_quantile_ms(&self, q: f64) -> f64 {
        let total: u64 = self.latency.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let target = (q * total as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in self.latency.iter().enumerate() {
            seen += n;
            if seen >= target {
                return (i as u64 * LATENCY_BIN_US) as f64 / 1000.0;
            }
        }
        LATENCY_MAX_US as f64 / 1000.0
    }

    /// Summarises the run. Goodput, false denials and latency count from `warmup_ms` on;
    /// convergence is measured from each of `shifts_ms` (times demand moved).
    pub fn summary(
        &self,
        scenario: &str,
        strategy: &str,
        shifts_ms: &[u64],
        warmup_ms: u64,
    ) -> Summary {
        let secs = &self.secs;
        let n = secs.len();
        let from = ((warmup_ms / 1000) as usize).min(n);
        let ratio = |num: u64, den: u64| {
            if den == 0 {
                None
            } else {
                Some(num as f64 / den as f64)
            }
        };
        let total = |f: fn(&Second) -> u64, range: std::ops::Range<usize>| -> u64 {
            secs[range].iter().map(f).sum()
        };
        let mut starts: Vec<usize> = shifts_ms
            .iter()
            .map(|&t| (t / 1000) as usize)
            .filter(|&s| s >= from && s < n)
            .collect();
        starts.sort_unstable();
        starts.dedup();
        // Seconds counted as converged: all after warm-up but those settling after a shift.
        let mut settled = vec![true; n];
        settled[..from].fill(false);
        let mut convergence: Option<f64> = None;
        let mut never = false;
        for (k, &s0) in starts.iter().enumerate() {
            let end = starts.get(k + 1).copied().unwrap_or(n);
            match converged_at(&secs[s0..end]) {
                Some(c) => {
                    convergence = Some(convergence.unwrap_or(0.0).max(c as f64));
                    settled[s0..s0 + c].fill(false);
                }
                None => never = true,
            }
        }
        let masked = |f: fn(&Second) -> u64| -> u64 {
            secs.iter()
                .zip(&settled)
                .filter(|(_, &ok)| ok)
                .map(|(s, _)| f(s))
                .sum()
        };
        Summary {
            scenario: scenario.to_string(),
            strategy: strategy.to_string(),
            overshoot_window: self.max_w,
            overshoot_1s: self.max_1s,
            goodput: ratio(
                total(|s| s.both_tokens, from..n),
                total(|s| s.shadow_tokens, from..n),
            ),
            false_denial_rate: ratio(
                total(|s| s.false_denials, from..n),
                total(|s| s.shadow_requests, from..n),
            ),
            goodput_healthy: ratio(
                total(|s| s.healthy_both_tokens, from..n),
                total(|s| s.healthy_shadow_tokens, from..n),
            ),
            floor_s: self.floor_ms.iter().map(|&ms| ms as f64 / 1000.0).collect(),
            forwarded: ratio(self.forwarded, self.decisions),
            never: self.never,
            goodput_converged: ratio(masked(|s| s.both_tokens), masked(|s| s.shadow_tokens)),
            false_denial_converged: ratio(
                masked(|s| s.false_denials),
                masked(|s| s.shadow_requests),
            ),
            p50_decision_ms: self.latency_quantile_ms(0.50),
            p99_decision_ms: self.latency_quantile_ms(0.99),
            demand_shifts: starts.len(),
            convergence_s: if never { None } else { convergence },
            decisions: self.decisions,
            store_calls: None,
            agents: None,
            admitted_tokens: total(|s| s.admitted_tokens, 0..n),
            ideal_tokens: total(|s| s.shadow_tokens, 0..n),
        }
    }
}

/// Seconds from the start of `secs` until every later [`SETTLED_S`]-second window has a false
/// denial rate ≤ [`CONVERGED_FD`]; `None` if the last window is still above.
fn converged_at(secs: &[Second]) -> Option<usize> {
    if secs.is_empty() {
        return Some(0);
    }
    let bad = |i: usize| {
        let w = &secs[i..(i + SETTLED_S).min(secs.len())];
        let fd: u64 = w.iter().map(|s| s.false_denials).sum();
        let admitted: u64 = w.iter().map(|s| s.shadow_requests).sum();
        fd as f64 > CONVERGED_FD * admitted as f64
    };
    let last_start = secs.len().saturating_sub(SETTLED_S);
    if bad(last_start) {
        return None;
    }
    Some(
        (0..=last_start)
            .rev()
            .find(|&i| bad(i))
            .map_or(0, |i| i + 1),
    )
}

/// One row of the result table.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub scenario: String,
    pub strategy: String,
    pub overshoot_window: f64,
    pub overshoot_1s: f64,
    /// `None` when the ideal admitted nothing.
    pub goodput: Option<f64>,
    /// Goodput in the regions no fault touches; `None` when the ideal admitted nothing there.
    pub goodput_healthy: Option<f64>,
    /// Seconds after warm-up each region enforced only its floors.
    pub floor_s: Vec<f64>,
    /// Fraction of decisions made in another region than the caller's.
    pub forwarded: Option<f64>,
    /// Denials with no retry time: the deciding bucket could never hold the cost.
    pub never: u64,
    pub false_denial_rate: Option<f64>,
    /// Goodput counted only once converged after each shift.
    pub goodput_converged: Option<f64>,
    /// False denials counted only once converged after each shift.
    pub false_denial_converged: Option<f64>,
    pub p50_decision_ms: f64,
    pub p99_decision_ms: f64,
    /// Demand shifts after the warm-up that convergence was measured from.
    pub demand_shifts: usize,
    /// The slowest convergence over the shifts; `None` when a shift never settled or there
    /// was none.
    pub convergence_s: Option<f64>,
    pub decisions: u64,
    /// Calls that reached a regional Redis over the run, for the strategies that count them.
    pub store_calls: Option<StoreCalls>,
    /// Usage reports, agent holder stops and takeovers per region, for the strategies with
    /// region agents.
    pub agents: Option<AgentCounts>,
    pub admitted_tokens: u64,
    pub ideal_tokens: u64,
}

impl Summary {
    /// Store calls per decision, for the strategies that count them.
    pub fn store_calls_per_decision(&self) -> Option<f64> {
        let calls = self.store_calls?.total();
        (self.decisions > 0).then(|| calls as f64 / self.decisions as f64)
    }
}

#[cfg(test)]
mod tests {
    use quota_core::PolicySpec;

    use super::*;

    fn tenant(limit: f64, window_ms: f64) -> Tenant {
        let policy = PolicySpec {
            limit,
            window_ms,
            ..PolicySpec::default()
        }
        .validate()
        .unwrap();
        Tenant { policy }
    }

    fn req(cost: u32) -> Request {
        Request {
            tenant: 0,
            region: 0,
            cost,
        }
    }

    #[test]
    fn ring_forgets_old_bins() {
        let mut r = Ring::new(1, 10, 100);
        let mut add = |t, n| {
            let bin = r.locate(t);
            r.add(0, bin, n)
        };
        assert_eq!(add(0, 5), 5);
        assert_eq!(add(990, 1), 6);
        assert_eq!(add(1000, 1), 2, "the bin at 0 left the window");
        assert_eq!(add(5000, 1), 1);
    }

    #[test]
    fn admitting_twice_the_budget_in_one_window_reads_two() {
        // C = 100, r = 100/s, W = 1 s: the bound over 1 s is 200.
        let tenants = [tenant(100.0, 1000.0)];
        let mut rec = Recorder::new(&tenants, 1000, 10, 2000, 0, vec![true; 3]);
        for i in 0..400 {
            rec.record(i, &req(1), i < 200, true, 500);
        }
        rec.finish();
        let s = rec.summary("x", "y", &[], 0);
        assert!((s.overshoot_window - 2.0).abs() < 1e-9);
        assert!((s.overshoot_1s - 2.0).abs() < 1e-9);
        assert_eq!(s.goodput, Some(1.0));
        assert_eq!(s.false_denial_rate, Some(0.0));
        assert_eq!(s.p50_decision_ms, 0.5);
    }

    #[test]
    fn healthy_goodput_counts_only_healthy_regions_and_floor_time_adds_up() {
        let tenants = [tenant(100.0, 1000.0)];
        let mut rec = Recorder::new(&tenants, 1000, 10, 2000, 500, vec![true, false]);
        // Region 0 (healthy) gets all it asks for; region 1 (faulted) is denied everything.
        for i in 0..10 {
            let region = (i % 2) as usize;
            let r = Request { region, ..req(1) };
            rec.record(i, &r, true, region == 0, 500);
        }
        for t in (0..2000).step_by(10) {
            rec.record_floor(t, 1, 10);
        }
        rec.finish();
        let s = rec.summary("x", "y", &[], 0);
        assert_eq!(s.goodput, Some(0.5));
        assert_eq!(s.goodput_healthy, Some(1.0));
        // Only the time after the 500 ms warm-up counts.
        assert_eq!(s.floor_s, vec![0.0, 1.5]);
    }

    #[test]
    fn healthy_goodput_is_what_the_fault_costs_against_the_baseline() {
        let tenants = [tenant(100.0, 1000.0)];
        let healthy = vec![true, false];
        // The shadow admits the 6 requests of region 0 (healthy) and none of region 1 (the
        // faulted one); the strategy's split admits 4 in each. Matched against the shadow
        // region by region, region 0 would read 4/6; a strategy the fault does not touch
        // admits the same without it, so the fault cost region 0 nothing.
        let run = |ok_in_0: u64| {
            let mut rec = Recorder::new(&tenants, 1000, 10, 2000, 0, healthy.clone());
            for i in 0..6 {
                rec.record(
                    i,
                    &Request {
                        region: 0,
                        ..req(1)
                    },
                    true,
                    i < ok_in_0,
                    500,
                );
                rec.record(
                    i,
                    &Request {
                        region: 1,
                        ..req(1)
                    },
                    false,
                    i < 4,
                    500,
                );
            }
            rec.finish();
            rec
        };
        let baseline = run(4);
        let mut same = run(4);
        assert_eq!(
            same.summary("x", "y", &[], 0).goodput_healthy,
            Some(4.0 / 6.0),
            "the shadow's apportioning"
        );
        same.against_baseline(&baseline);
        assert_eq!(same.summary("x", "y", &[], 0).goodput_healthy, Some(1.0));
        // The fault costs region 0 half of what it admitted in the baseline.
        let mut worse = run(2);
        worse.against_baseline(&baseline);
        assert_eq!(worse.summary("x", "y", &[], 0).goodput_healthy, Some(0.5));
    }

    #[test]
    fn false_denials_and_goodput_compare_with_the_shadow() {
        let tenants = [tenant(100.0, 1000.0)];
        let mut rec = Recorder::new(&tenants, 1000, 10, 1000, 0, vec![true; 3]);
        // Shadow admits 4 requests of cost 2; the strategy denies one of them.
        for i in 0..4 {
            rec.record(i, &req(2), true, i != 0, 500);
        }
        rec.finish();
        let s = rec.summary("x", "y", &[], 0);
        assert_eq!(s.goodput, Some(0.75));
        assert_eq!(s.false_denial_rate, Some(0.25));
    }

    #[test]
    fn the_shadow_itself_never_overshoots() {
        let tenants = [tenant(600.0, 60_000.0)];
        let mut shadow = Shadow::new(&tenants);
        let mut rec = Recorder::new(&tenants, 60_000, 10, 180_000, 0, vec![true; 3]);
        for t in (0..180_000).step_by(10) {
            for _ in 0..3 {
                let ok = shadow.decide(t, &req(1));
                rec.record(t, &req(1), ok, ok, 500);
            }
        }
        rec.finish();
        let s = rec.summary("x", "shadow", &[], 0);
        assert!(
            s.overshoot_window <= 1.0 && s.overshoot_window > 0.95,
            "{s:?}"
        );
        assert!(s.overshoot_1s <= 1.0);
        assert_eq!(s.false_denial_rate, Some(0.0));
    }

    #[test]
    fn convergence_counts_seconds_until_denials_settle() {
        let mut secs = vec![
            Second {
                shadow_requests: 100,
                ..Second::default()
            };
            30
        ];
        for s in secs.iter_mut().take(7) {
            s.false_denials = 30;
        }
        assert_eq!(converged_at(&secs), Some(7));
        // A relapse later moves convergence past it.
        secs[15].false_denials = 20;
        assert_eq!(converged_at(&secs), Some(16));
        secs[29].false_denials = 50;
        assert_eq!(converged_at(&secs), None);
    }

    #[test]
    fn matching_per_second_ignores_which_request_got_the_token() {
        let tenants = [tenant(100.0, 1000.0)];
        let mut rec = Recorder::new(&tenants, 1000, 10, 1000, 0, vec![true; 3]);
        // Shadow admits the first two, the strategy the last two: same second, same count.
        for i in 0..4 {
            rec.record(i, &req(1), i < 2, i >= 2, 500);
        }
        rec.finish();
        let s = rec.summary("x", "y", &[], 0);
        assert_eq!((s.goodput, s.false_denial_rate), (Some(1.0), Some(0.0)));
    }
}
