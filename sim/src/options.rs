//! Command-line options, parsed by clap and then validated in one pass that reports every
//! problem at once.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use quota_core::{FailMode, PPM};

use crate::control::ControlConfig;
use crate::per_subject::coordinator::PromotionConfig;
use crate::per_subject::SubjectConfig;
use crate::scenario::ScenarioKind;
use crate::simulation::RunConfig;
use crate::strategy::StrategyKind;

/// The most regions a run may have (the coordinator's region slots).
pub const MAX_REGIONS: usize = 16;

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Table,
    Csv,
    Json,
}

/// What every policy does while its regional Redis is down (see `quota_core::FailMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FailModeArg {
    Local,
    Open,
    Closed,
}

impl From<FailModeArg> for FailMode {
    fn from(m: FailModeArg) -> Self {
        match m {
            FailModeArg::Local => FailMode::Local,
            FailModeArg::Open => FailMode::Open,
            FailModeArg::Closed => FailMode::Closed,
        }
    }
}

/// What `global_store` does when a region cannot reach the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GlobalFail {
    Open,
    Closed,
}

/// quotad's deterministic simulator: every strategy on the same seeded arrivals, measured
/// against an ideal global token bucket.
#[derive(Debug, Clone, Parser)]
#[command(name = "sim", version)]
pub struct Options {
    /// The one seed every random choice derives from.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Scenarios to run (repeatable); default: the whole suite.
    #[arg(long = "scenario", value_enum)]
    pub scenarios: Vec<ScenarioKind>,
    /// Strategies to compare (repeatable); default: all of them.
    #[arg(long = "strategy", value_enum)]
    pub strategies: Vec<StrategyKind>,
    /// Number of regions.
    #[arg(long, default_value_t = 3)]
    pub regions: usize,
    /// Simulated seconds per scenario.
    #[arg(long, default_value_t = 360.0)]
    pub duration: f64,
    /// Lease length in seconds.
    #[arg(long, default_value_t = 10.0)]
    pub lease: f64,
    /// Drift margin of leases in seconds.
    #[arg(long, default_value_t = 1.0)]
    pub drift_margin: f64,
    /// Fraction of each tenant's budget reserved for every region, in [0, 1/regions]. The
    /// default is the daemon's: no floor (a region with no share forwards what it cannot hold).
    #[arg(long, default_value_t = 0.0)]
    pub floor: f64,
    /// Seconds at the start not counted in goodput, false denials and latency (overshoot
    /// always counts); default: one policy window (60 s), at most a third of the duration.
    #[arg(long)]
    pub warmup: Option<f64>,
    /// Seconds between rebalance rounds.
    #[arg(long, default_value_t = 2.0)]
    pub rebalance_interval: f64,
    /// Seconds between usage reports (and hit broadcasts of `async_broadcast`).
    #[arg(long, default_value_t = 1.0)]
    pub report_interval: f64,
    /// Tenants per scenario (besides one-shot identities and the hot tenant).
    #[arg(long, default_value_t = 40)]
    pub tenants: usize,
    /// Subjects of the main class in `per_subject` (its login class has a fifth as many).
    #[arg(long, default_value_t = crate::per_subject::DEFAULT_SUBJECTS)]
    pub subjects: usize,
    /// `per_subject`: the most a promoted subject's share moves per rebalance round, as a
    /// fraction of its budget (1: undamped; tenants' policies move 0.1).
    #[arg(long, default_value_t = 1.0)]
    pub promotion_step: f64,
    /// `per_subject`: counters in each region's top-K of subjects denied at their class share.
    #[arg(long, default_value_t = 64)]
    pub top_k: usize,
    /// Milliseconds per arrival tick; must divide 1000.
    #[arg(long, default_value_t = 10)]
    pub tick_ms: u64,
    /// Every policy's fail mode while its regional Redis is down (`redis_outage`).
    #[arg(long, value_enum, default_value_t = FailModeArg::Local)]
    pub fail_mode: FailModeArg,
    /// `global_store` behaviour when cut off from the store.
    #[arg(long, value_enum, default_value_t = GlobalFail::Closed)]
    pub global_fail: GlobalFail,
    /// Output format on stdout. `table`: the suite's table, then per_subject's. `csv`: one
    /// table, the suite's (per_subject's when it runs alone; with both, per_subject's goes to
    /// --per-subject-csv or --out). `json`: one document, {"scenarios": [..], "per_subject": [..]}.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Also write per_subject's table as CSV to this file.
    #[arg(long, value_name = "PATH")]
    pub per_subject_csv: Option<PathBuf>,
    /// Also write results.csv, per_subject.csv, per-second series and SVG plots into this
    /// directory.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Worker threads (scenarios run in parallel; output does not depend on this).
    #[arg(long)]
    pub jobs: Option<usize>,
}

/// Every problem with the options.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid options:\n  {}", .0.join("\n  "))]
pub struct OptionsError(pub Vec<String>);

fn seconds_to_ms(errors: &mut Vec<String>, name: &str, s: f64, min_ms: u64, max_ms: u64) -> u64 {
    let ms = s * 1000.0;
    if !ms.is_finite() || ms < min_ms as f64 || ms > max_ms as f64 {
        errors.push(format!(
            "--{name} must be between {} and {} seconds (got {s})",
            min_ms as f64 / 1000.0,
            max_ms as f64 / 1000.0
        ));
        return min_ms;
    }
    ms.round() as u64
}

impl Options {
    /// The suite's scenarios to run, in suite order (`per_subject` and `llm_tokens` run apart:
    /// [`Options::per_subject`], [`Options::llm_tokens`]).
    pub fn scenarios(&self) -> Vec<ScenarioKind> {
        let mut v = if self.scenarios.is_empty() {
            ScenarioKind::ALL.to_vec()
        } else {
            self.scenarios.clone()
        };
        v.retain(|&k| !matches!(k, ScenarioKind::PerSubject | ScenarioKind::LlmTokens));
        v.sort();
        v.dedup();
        v
    }

    /// Whether to run `per_subject`: by default, or when named.
    pub fn per_subject(&self) -> bool {
        self.per_subject_asked() && !self.per_subject_skipped()
    }

    fn per_subject_asked(&self) -> bool {
        self.scenarios.is_empty() || self.scenarios.contains(&ScenarioKind::PerSubject)
    }

    /// `--format csv` prints one table, the suite's: without a file for `per_subject`'s table
    /// (`--per-subject-csv`, `--out`) that scenario is not run, and `main` says so on stderr.
    pub fn per_subject_skipped(&self) -> bool {
        self.format == Format::Csv
            && self.per_subject_asked()
            && !self.scenarios().is_empty()
            && self.per_subject_csv.is_none()
            && self.out.is_none()
    }

    /// Whether to run `llm_tokens`: by default, or when named.
    pub fn llm_tokens(&self) -> bool {
        self.llm_tokens_asked() && !self.llm_tokens_skipped()
    }

    fn llm_tokens_asked(&self) -> bool {
        self.scenarios.is_empty() || self.scenarios.contains(&ScenarioKind::LlmTokens)
    }

    /// `--format csv` prints one table: when another takes stdout and there is no `--out` for
    /// `llm_tokens.csv`, that scenario is not run, and `main` says so on stderr.
    pub fn llm_tokens_skipped(&self) -> bool {
        self.format == Format::Csv
            && self.llm_tokens_asked()
            && (!self.scenarios().is_empty() || self.per_subject())
            && self.out.is_none()
    }

    /// The `per_subject` run's configuration (valid once [`Options::run_config`] is).
    pub fn subject_config(&self, cfg: &RunConfig) -> SubjectConfig {
        SubjectConfig {
            seed: cfg.seed,
            regions: cfg.regions,
            subjects: self.subjects,
            duration_ms: cfg.duration_ms,
            warmup_ms: cfg.warmup_ms,
            report_ms: cfg.control.report_ms,
            rebalance_ms: cfg.control.rebalance_ms,
            promotion: PromotionConfig {
                max_step_ppm: (self.promotion_step * f64::from(PPM)).round() as u32,
                top_k: self.top_k,
                ..PromotionConfig::default()
            },
        }
    }

    /// The strategies to run, in table order.
    pub fn strategies(&self) -> Vec<StrategyKind> {
        let mut v = if self.strategies.is_empty() {
            StrategyKind::ALL.to_vec()
        } else {
            self.strategies.clone()
        };
        v.sort();
        v.dedup();
        v
    }

    /// The warm-up in seconds, the default resolved.
    pub fn warmup_s(&self) -> f64 {
        self.warmup
            .unwrap_or_else(|| (self.duration / 3.0).floor().clamp(0.0, 60.0))
    }

    /// Validates everything and builds the run configuration.
    pub fn run_config(&self) -> Result<RunConfig, OptionsError> {
        let mut e = Vec::new();
        if !(1..=MAX_REGIONS).contains(&self.regions) {
            e.push(format!(
                "--regions must be between 1 and {MAX_REGIONS} (got {})",
                self.regions
            ));
        }
        let duration_ms = seconds_to_ms(&mut e, "duration", self.duration, 1_000, 86_400_000);
        if !duration_ms.is_multiple_of(1000) {
            e.push(format!(
                "--duration must be whole seconds (got {})",
                self.duration
            ));
        }
        let warmup_ms = seconds_to_ms(&mut e, "warmup", self.warmup_s(), 0, 86_400_000);
        if warmup_ms >= duration_ms {
            e.push("--warmup must be shorter than --duration".to_string());
        }
        let lease_ms = seconds_to_ms(&mut e, "lease", self.lease, 100, 600_000);
        let drift_margin_ms = seconds_to_ms(&mut e, "drift-margin", self.drift_margin, 0, 300_000);
        if 2 * drift_margin_ms >= lease_ms {
            e.push("--drift-margin must be less than half of --lease".to_string());
        }
        let rebalance_ms = seconds_to_ms(
            &mut e,
            "rebalance-interval",
            self.rebalance_interval,
            10,
            3_600_000,
        );
        let report_ms = seconds_to_ms(
            &mut e,
            "report-interval",
            self.report_interval,
            10,
            3_600_000,
        );
        self.check_counts(&mut e);
        self.check_scenarios(duration_ms, &mut e);
        self.check_outputs(&mut e);
        if self.jobs == Some(0) {
            e.push("--jobs must be at least 1".to_string());
        }
        if !e.is_empty() {
            return Err(OptionsError(e));
        }
        Ok(RunConfig {
            seed: self.seed,
            regions: self.regions,
            duration_ms,
            tick_ms: self.tick_ms,
            tenants: self.tenants,
            floor: self.floor,
            fail_mode: self.fail_mode.into(),
            control: ControlConfig {
                report_ms,
                rebalance_ms,
                lease_ms,
                drift_margin_ms,
                ..ControlConfig::default()
            },
            global_fail_open: self.global_fail == GlobalFail::Open,
            warmup_ms,
        })
    }

    /// The tick, the floor and the tenant count, each problem pushed to `e`.
    fn check_counts(&self, e: &mut Vec<String>) {
        if !(1..=100).contains(&self.tick_ms) || !1000u64.is_multiple_of(self.tick_ms) {
            e.push(format!(
                "--tick-ms must divide 1000 and be at most 100 (got {})",
                self.tick_ms
            ));
        }
        if !self.floor.is_finite()
            || self.floor < 0.0
            || self.floor * self.regions.max(1) as f64 > 1.0
        {
            e.push(format!(
                "--floor must be between 0 and 1/regions = {:.4} (got {})",
                1.0 / self.regions.max(1) as f64,
                self.floor
            ));
        }
        if !(self.promotion_step > 0.0 && self.promotion_step <= 1.0) {
            e.push(format!(
                "--promotion-step must be in (0, 1] (got {})",
                self.promotion_step
            ));
        }
        if self.top_k > 100_000 {
            e.push(format!(
                "--top-k must be at most 100000 (got {})",
                self.top_k
            ));
        }
        if self.subjects == 0 || self.subjects > 10_000_000 {
            e.push(format!(
                "--subjects must be between 1 and 10000000 (got {})",
                self.subjects
            ));
        }
        if self.tenants == 0 || self.tenants > 100_000 {
            e.push(format!(
                "--tenants must be between 1 and 100000 (got {})",
                self.tenants
            ));
        }
    }

    /// Whether every chosen scenario fits the regions and the duration.
    fn check_scenarios(&self, duration_ms: u64, e: &mut Vec<String>) {
        let llm = self
            .llm_tokens()
            .then_some(ScenarioKind::LlmTokens)
            .into_iter();
        for kind in self.scenarios().into_iter().chain(llm) {
            if self.regions < kind.min_regions() {
                e.push(format!(
                    "--regions {} is too few for scenario {kind} (needs {}); choose others with \
                     --scenario",
                    self.regions,
                    kind.min_regions()
                ));
            }
            if duration_ms < kind.min_duration_ms() {
                e.push(format!(
                    "--duration {} is too short for scenario {kind} (needs {} s)",
                    self.duration,
                    kind.min_duration_ms() / 1000
                ));
            }
        }
    }

    /// Whether every table that runs has somewhere to go: CSV on stdout is one table.
    fn check_outputs(&self, e: &mut Vec<String>) {
        let per_subject = self.per_subject();
        if self.per_subject_csv.is_some() && !per_subject {
            e.push(
                "--per-subject-csv needs the per_subject scenario (run by default, or named with \
                 --scenario per_subject)"
                    .to_string(),
            );
        }
    }

    /// The command line that reproduces a run of one scenario and strategy with these options.
    pub fn repro(&self, scenario: ScenarioKind, strategy: StrategyKind) -> String {
        format!(
            "cargo run --release -p sim -- --seed {} --scenario {} --strategy {} --regions {} \
             --duration {} --warmup {} --lease {} --floor {} --rebalance-interval {} --tenants {} \
             --fail-mode {:?} --global-fail {:?}",
            self.seed,
            scenario,
            strategy,
            self.regions,
            self.duration,
            self.warmup_s(),
            self.lease,
            self.floor,
            self.rebalance_interval,
            self.tenants,
            self.fail_mode,
            self.global_fail
        )
        .to_lowercase()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        let o = Options::parse_from(["sim"]);
        let c = o.run_config().unwrap();
        assert_eq!(
            (c.regions, c.duration_ms, c.control.lease_ms),
            (3, 360_000, 10_000)
        );
        assert_eq!(o.scenarios().len(), ScenarioKind::ALL.len());
    }

    #[test]
    fn every_problem_is_reported() {
        let o = Options::try_parse_from([
            "sim",
            "--regions",
            "0",
            "--duration=-1",
            "--lease",
            "nan",
            "--tick-ms",
            "7",
            "--floor",
            "2",
        ])
        .unwrap();
        let e = o.run_config().unwrap_err().0;
        assert!(e.len() >= 5, "{e:?}");
        assert!(e.iter().any(|m| m.contains("--regions")));
        assert!(e.iter().any(|m| m.contains("--lease")));
        assert!(e.iter().any(|m| m.contains("--tick-ms")));
    }

    #[test]
    fn csv_prints_per_subject_only_to_a_file_of_its_own() {
        let err = |args: &[&str]| {
            let o = Options::try_parse_from(args).unwrap();
            o.run_config().err().map(|e| e.0.join("\n"))
        };
        assert_eq!(err(&["sim", "--format", "csv"]), None);
        let o = |args: &[&str]| Options::try_parse_from(args).unwrap();
        assert!(o(&["sim", "--format", "csv"]).per_subject_skipped());
        assert!(!o(&["sim", "--format", "csv"]).per_subject());
        assert!(!o(&["sim", "--format", "csv", "--out", "r"]).per_subject_skipped());
        assert!(!o(&["sim", "--format", "json"]).per_subject_skipped());
        assert_eq!(
            err(&["sim", "--format", "csv", "--per-subject-csv", "p.csv"]),
            None
        );
        assert_eq!(err(&["sim", "--format", "csv", "--out", "results"]), None);
        assert_eq!(
            err(&["sim", "--format", "csv", "--scenario", "per_subject"]),
            None
        );
        assert_eq!(
            err(&["sim", "--format", "csv", "--scenario", "steady"]),
            None
        );
        assert_eq!(err(&["sim", "--format", "json"]), None);
        let e = err(&["sim", "--scenario", "steady", "--per-subject-csv", "p.csv"])
            .expect("no per_subject table to write");
        assert!(
            e.contains("--per-subject-csv needs the per_subject scenario"),
            "{e}"
        );
    }

    #[test]
    fn llm_tokens_runs_by_default_or_when_named_and_needs_a_partition() {
        let o = |args: &[&str]| Options::try_parse_from(args).unwrap();
        assert!(o(&["sim"]).llm_tokens());
        assert!(o(&["sim", "--scenario", "llm_tokens"]).llm_tokens());
        assert!(o(&["sim", "--scenario", "llm_tokens"])
            .scenarios()
            .is_empty());
        assert!(!o(&["sim", "--scenario", "steady"]).llm_tokens());
        // CSV on stdout is one table: beside the suite's it needs --out.
        assert!(o(&["sim", "--format", "csv"]).llm_tokens_skipped());
        assert!(o(&["sim", "--format", "csv", "--out", "r"]).llm_tokens());
        assert!(o(&["sim", "--format", "csv", "--scenario", "llm_tokens"]).llm_tokens());
        let e = o(&["sim", "--scenario", "llm_tokens", "--regions", "2"])
            .run_config()
            .unwrap_err()
            .0;
        assert!(
            e.iter()
                .any(|m| m.contains("too few for scenario llm_tokens")),
            "{e:?}"
        );
    }

    #[test]
    fn unknown_names_are_refused_by_clap() {
        assert!(Options::try_parse_from(["sim", "--scenario", "nope"]).is_err());
        assert!(Options::try_parse_from(["sim", "--strategy", "quotad"]).is_ok());
    }
}
