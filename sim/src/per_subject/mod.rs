//! The `per_subject` scenario: one policy for a whole class of subjects (API keys, users, IP
//! addresses), each subject held to the policy's limit worldwide, at 100 000 subjects.
//!
//! Every subject has its own bucket in each region it sends from, created on its first check
//! and forgotten once idle for its TTL. What differs between strategies is the share of its
//! limit each region's bucket holds: the whole limit (`local`), 1/N (`even`), its class's
//! share vector learned from the class's aggregate demand (`class_shares`), or that plus
//! promotion of the subjects denied at their class share to share vectors of their own
//! (`quotad`, see [`coordinator`]). Each is measured against the subject's ideal global
//! bucket ([`measure`]). It runs in its own engine, driven by arrivals rather than ticks, so
//! it costs O(requests) and O(active subjects), not O(subjects) per tick.
//!
//! # Layout
//! - [`population`]: the classes, the subjects' Zipf demand and placement, the arrivals.
//! - [`buckets`]: a region's lazily created subject buckets.
//! - [`coordinator`]: class shares, promotion and eviction (quotad's control plane).
//! - [`strategies`]: local, even, class_shares, quotad.
//! - [`measure`]: the ideal buckets, worst-subject overshoot, false denials.

pub mod buckets;
pub mod coordinator;
pub mod measure;
pub mod population;
pub mod strategies;

use std::fmt::Write as _;
use std::time::Instant;

use serde::Serialize;

use crate::faults::Faults;
use crate::simulation::rng_for;
use crate::world::{World, WorldSpec};
use coordinator::PromotionConfig;
use measure::{window_budget, Ideal, Recorder};
use population::{Arrivals, Population};
use strategies::{SubjectStrategy, SubjectStrategyKind};

/// Subjects of the main class by default (the login class has a fifth as many).
pub const DEFAULT_SUBJECTS: usize = 100_000;

/// Everything a `per_subject` run depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubjectConfig {
    pub seed: u64,
    pub regions: usize,
    pub subjects: usize,
    pub duration_ms: u64,
    pub warmup_ms: u64,
    pub report_ms: u64,
    pub rebalance_ms: u64,
    pub promotion: PromotionConfig,
}

/// One row: a class under a strategy.
#[derive(Debug, Clone, Serialize)]
pub struct SubjectRow {
    pub class: &'static str,
    pub strategy: SubjectStrategyKind,
    /// Subjects of the class.
    pub subjects: usize,
    /// Budget mode of the class under quotad's variants (`split` or `home`; `-` without a
    /// coordinator).
    pub mode: &'static str,
    pub requests: u64,
    /// Worst subject: most tokens admitted in one window ÷ (C + r·W); W is the policy window,
    /// or the whole run when that is shorter.
    pub overshoot_window: f64,
    /// Requests the ideal admitted but the strategy did not, ÷ what the ideal admitted.
    pub false_denial_rate: f64,
    pub ideal_admitted: u64,
    pub admitted: u64,
    pub forwarded_fraction: f64,
    /// Coordinator entries at their peak (classes + promoted subjects), and as a fraction
    /// of all subjects: the same on every class row of a strategy.
    pub entries_peak: usize,
    pub entries_fraction: f64,
    /// Buckets alive at once over all regions at their peak, and as a fraction of subjects.
    pub live_buckets_peak: usize,
    pub live_buckets_fraction: f64,
    pub promotions: u64,
    pub evictions: u64,
    /// Applied states in which some subject's enforced shares summed above its budget.
    pub bound_violations: u64,
    /// The longest usage report (entries and denied subjects).
    pub report_len_peak: usize,
}

/// A whole run.
#[derive(Debug, Clone)]
pub struct SubjectRun {
    pub regions: usize,
    pub subjects: usize,
    pub rows: Vec<SubjectRow>,
    pub decisions: u64,
    pub wall_s: f64,
}

/// Runs every strategy on the same arrivals; `progress` is told each simulated second.
pub fn run(cfg: &SubjectConfig, progress: &mut dyn FnMut(u64)) -> SubjectRun {
    let started = Instant::now();
    let spec = WorldSpec {
        regions: cfg.regions,
        ..WorldSpec::default()
    };
    let world = World::new(&spec, Faults::default(), &mut rng_for(cfg.seed, "world"));
    let pop = Population::build(
        cfg.regions,
        cfg.subjects,
        &mut rng_for(cfg.seed, "per_subject"),
    );
    let mut arrivals = Arrivals::new(
        &pop,
        cfg.duration_ms,
        rng_for(cfg.seed, "per_subject arrivals"),
    );
    let mut strats: Vec<SubjectStrategy> = SubjectStrategyKind::ALL
        .iter()
        .map(|&k| {
            SubjectStrategy::new(
                k,
                &world,
                &pop,
                cfg.promotion,
                cfg.report_ms,
                cfg.rebalance_ms,
            )
        })
        .collect();
    let mut recorders: Vec<Recorder> = strats
        .iter()
        .map(|_| Recorder::new(&pop, cfg.warmup_ms, cfg.duration_ms))
        .collect();
    let mut ideal = Ideal::default();
    let mut next_second_ms = 1_000;
    let mut decisions = 0u64;
    while let Some(req) = arrivals.next_request() {
        while req.t_ms >= next_second_ms {
            for s in &mut strats {
                s.expire(next_second_ms);
            }
            next_second_ms += 1_000;
            progress(1);
        }
        let ok = ideal.decide(&pop, req.t_ms, req.subject);
        for (s, rec) in strats.iter_mut().zip(&mut recorders) {
            s.advance(req.t_ms);
            let v = s.decide(&world, &pop, &req);
            rec.record(&pop, req.t_ms, req.subject, ok, v.allowed, v.forwarded);
        }
        decisions += 1 + strats.len() as u64;
    }
    let total_subjects = pop.subjects.len();
    let mut rows = Vec::new();
    for (s, rec) in strats.iter().zip(&mut recorders) {
        rec.finish(&pop);
        let c = s.coordinator.as_ref();
        for (ci, (class, t)) in pop.classes.iter().zip(&rec.classes).enumerate() {
            let entries_peak = c.map_or(0, |c| c.peak_entries);
            let home = c.is_some_and(|c| c.home_class(ci as u8));
            rows.push(SubjectRow {
                class: class.name,
                strategy: s.kind,
                subjects: class.subjects,
                mode: match c {
                    None => "-",
                    Some(_) if home => "home",
                    Some(_) => "split",
                },
                requests: t.requests,
                overshoot_window: t.worst_window_tokens as f64
                    / window_budget(&pop, ci, cfg.duration_ms),
                false_denial_rate: t.false_denials as f64 / t.ideal_admitted.max(1) as f64,
                ideal_admitted: t.ideal_admitted,
                admitted: t.admitted,
                forwarded_fraction: t.forwarded as f64 / t.requests.max(1) as f64,
                entries_peak,
                entries_fraction: entries_peak as f64 / total_subjects as f64,
                live_buckets_peak: s.peak_live,
                live_buckets_fraction: s.peak_live as f64 / total_subjects as f64,
                promotions: c.map_or(0, |c| c.promotions),
                evictions: c.map_or(0, |c| c.evictions),
                bound_violations: c.map_or(0, |c| c.violations),
                report_len_peak: c.map_or(0, |c| c.peak_report_len),
            });
        }
    }
    SubjectRun {
        regions: cfg.regions,
        subjects: total_subjects,
        rows,
        decisions,
        wall_s: started.elapsed().as_secs_f64(),
    }
}

/// The CSV header, also the table's column order.
pub const CSV_HEADER: &str = "class,strategy,subjects,mode,requests,overshoot_window,\
false_denial_rate,ideal_admitted,admitted,forwarded_fraction,entries_peak,entries_fraction,\
live_buckets_peak,live_buckets_fraction,promotions,evictions,bound_violations,report_len_peak";

/// A fixed-width table, one row per (class, strategy).
pub fn table(run: &SubjectRun) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "per_subject: {} subjects, {} regions",
        run.subjects, run.regions
    );
    let _ = writeln!(
        out,
        "{:<6} {:<13} {:>7} {:>5} {:>8} {:>8} {:>8} {:>6} {:>8} {:>8} {:>7} {:>7} {:>6} {:>6}",
        "class",
        "strategy",
        "subjects",
        "mode",
        "over(W)",
        "false_dn",
        "fwd",
        "entries",
        "entries%",
        "live_bkts",
        "live%",
        "promo",
        "evict",
        "sum>1"
    );
    for r in &run.rows {
        let coordinated = r.strategy >= SubjectStrategyKind::ClassShares;
        let dash = |s: String| if coordinated { s } else { "-".to_string() };
        let _ = writeln!(
            out,
            "{:<6} {:<13} {:>7} {:>5} {:>8.3} {:>7.2}% {:>7.1}% {:>6} {:>7}% {:>9} {:>6.1}% {:>7} {:>6} {:>6}",
            r.class,
            r.strategy.name(),
            r.subjects,
            r.mode,
            r.overshoot_window,
            100.0 * r.false_denial_rate,
            100.0 * r.forwarded_fraction,
            dash(r.entries_peak.to_string()),
            dash(format!("{:.3}", 100.0 * r.entries_fraction)),
            r.live_buckets_peak,
            100.0 * r.live_buckets_fraction,
            dash(r.promotions.to_string()),
            dash(r.evictions.to_string()),
            dash(r.bound_violations.to_string()),
        );
    }
    out
}

/// One CSV line per row, after [`CSV_HEADER`].
pub fn csv(run: &SubjectRun) -> String {
    let mut out = format!("{CSV_HEADER}\n");
    for r in &run.rows {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{:.4},{:.6},{},{},{:.6},{},{:.6},{},{:.6},{},{},{},{}",
            r.class,
            r.strategy.name(),
            r.subjects,
            r.mode,
            r.requests,
            r.overshoot_window,
            r.false_denial_rate,
            r.ideal_admitted,
            r.admitted,
            r.forwarded_fraction,
            r.entries_peak,
            r.entries_fraction,
            r.live_buckets_peak,
            r.live_buckets_fraction,
            r.promotions,
            r.evictions,
            r.bound_violations,
            r.report_len_peak
        );
    }
    out
}
