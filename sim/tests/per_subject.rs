//! `per_subject` at a fixed seed: quotad's class shares with promotion hold every subject to
//! its limit worldwide (worst subject ≤ 1.02 of its window budget), deny at most 1% of what
//! ideal per-subject global buckets admit, and keep coordinator entries ≤ 1% of subjects; the
//! naive strategies miss the way the design says they must. Debug builds run 20 000 subjects
//! (the README's figures are 100 000, from a release run).

use sim::per_subject::coordinator::PromotionConfig;
use sim::per_subject::strategies::SubjectStrategyKind as K;
use sim::per_subject::{self, SubjectConfig, SubjectRow, SubjectRun};

fn config(regions: usize, subjects: usize) -> SubjectConfig {
    SubjectConfig {
        seed: 1,
        regions,
        subjects,
        duration_ms: 360_000,
        warmup_ms: 60_000,
        report_ms: 1_000,
        rebalance_ms: 2_000,
        promotion: PromotionConfig::default(),
    }
}

fn row<'a>(run: &'a SubjectRun, class: &str, strategy: K) -> &'a SubjectRow {
    run.rows
        .iter()
        .find(|r| r.class == class && r.strategy == strategy)
        .expect("every class runs under every strategy")
}

fn repro(cfg: &SubjectConfig) -> String {
    format!(
        "cargo run --release -p sim -- --scenario per_subject --seed {} --regions {} \
         --subjects {} --duration {}",
        cfg.seed,
        cfg.regions,
        cfg.subjects,
        cfg.duration_ms / 1000
    )
}

fn assert_targets(run: &SubjectRun, cfg: &SubjectConfig) {
    let table = per_subject::table(run);
    let cmd = repro(cfg);
    for class in ["api", "login"] {
        let q = row(run, class, K::Quotad);
        assert!(
            q.overshoot_window <= 1.02,
            "{class}: worst subject at {:.3}× its budget\n{table}\n{cmd}",
            q.overshoot_window
        );
        assert!(
            q.false_denial_rate <= 0.01,
            "{class}: {:.2}% false denials\n{table}\n{cmd}",
            100.0 * q.false_denial_rate
        );
        assert!(
            q.entries_fraction <= 0.01,
            "{} entries\n{table}\n{cmd}",
            q.entries_peak
        );
        assert_eq!(q.bound_violations, 0, "Σ shares > 1\n{table}\n{cmd}");
    }
}

#[test]
fn quotad_meets_the_targets_at_three_regions_and_the_others_miss() {
    let cfg = config(3, 20_000);
    let run = per_subject::run(&cfg, &mut |_| {});
    assert_targets(&run, &cfg);
    let table = per_subject::table(&run);
    // Promotion is what meets the false-denial target: class shares alone miss it.
    let class = row(&run, "api", K::ClassShares);
    assert!(class.false_denial_rate > 0.02, "{table}");
    assert_eq!(class.bound_violations, 0, "{table}");
    let q = row(&run, "api", K::Quotad);
    assert!(q.promotions > 0 && q.evictions > 0, "{table}");
    // No coordination: subjects spread over every region get up to N× their limit.
    assert!(row(&run, "api", K::Local).overshoot_window > 2.5, "{table}");
    // A static 1/N split holds the bound but starves subjects that stay in one region.
    let even = row(&run, "api", K::Even);
    assert!(
        even.overshoot_window <= 1.0 && even.false_denial_rate > 0.02,
        "{table}"
    );
    // The login class is too small to split: it lives whole in one home region.
    assert_eq!(row(&run, "login", K::Quotad).mode, "home");
    assert!(
        row(&run, "login", K::Even).false_denial_rate > 0.05,
        "{table}"
    );
}

#[test]
fn quotad_meets_the_targets_at_five_regions() {
    // At 20 000 subjects the same few heavy subjects are 1% of them: the entry cap binds.
    let cfg = SubjectConfig {
        duration_ms: 240_000,
        ..config(5, 100_000)
    };
    let run = per_subject::run(&cfg, &mut |_| {});
    assert_targets(&run, &cfg);
}

#[test]
fn a_seed_replays_exactly() {
    let cfg = SubjectConfig {
        duration_ms: 120_000,
        ..config(3, 3_000)
    };
    let a = per_subject::csv(&per_subject::run(&cfg, &mut |_| {}));
    let b = per_subject::csv(&per_subject::run(&cfg, &mut |_| {}));
    assert_eq!(a, b);
    let other = SubjectConfig { seed: 2, ..cfg };
    assert_ne!(a, per_subject::csv(&per_subject::run(&other, &mut |_| {})));
}
