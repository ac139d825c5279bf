//! `sim`: runs the scenario suite and prints the table (see the crate docs of `sim`).

use std::fs::File;
use std::io::{IsTerminal, Write as _};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sim::llm_tokens::LlmRun;
use sim::options::{Format, Options};
use sim::per_subject::SubjectRun;
use sim::simulation::ScenarioRun;
use sim::{llm_tokens, per_subject, plot, report, sliding_window};

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let opts = Options::parse();
    let cfg = match opts.run_config() {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    // Every file is created before the run, so a path that cannot be written fails at once
    // rather than after minutes of simulation.
    let per_subject_file = opts.per_subject_csv.as_deref().map(create).transpose()?;
    let out_dir = opts.out.as_deref().map(OutDir::create).transpose()?;

    if opts.per_subject_skipped() {
        eprintln!(
            "note: --format csv prints one table, the suite's; per_subject did not run (name a \
             file for its table with --per-subject-csv PATH or --out DIR)"
        );
    }
    if opts.llm_tokens_skipped() {
        eprintln!(
            "note: --format csv prints one table; llm_tokens did not run (its table goes to \
             DIR/llm_tokens.csv with --out DIR, or to stdout with --scenario llm_tokens alone)"
        );
    }
    let scenarios = opts.scenarios();
    let strategies = opts.strategies();
    let jobs = opts
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let per_subject = opts.per_subject();
    let llm = opts.llm_tokens();
    let total =
        (scenarios.len() as u64 + u64::from(per_subject) + u64::from(llm)) * cfg.duration_ms / 1000;
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if !std::io::stderr().is_terminal() {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} simulated s ({eta})")
            .expect("static template"),
    );
    let started = Instant::now();
    let runs = sim::run_suite(&scenarios, &strategies, &cfg, jobs, &|n| bar.inc(n))?;
    let wall_s = started.elapsed().as_secs_f64();
    let subjects =
        per_subject.then(|| per_subject::run(&opts.subject_config(&cfg), &mut |n| bar.inc(n)));
    let llm_run = llm
        .then(|| llm_tokens::run(&cfg, &mut |n| bar.inc(n)))
        .transpose()?;
    bar.finish_and_clear();

    // The default suite ends with sliding-window policies (a small engine of their own), in the
    // table and the JSON document; the CSV table is the suite's alone.
    let windows = if opts.scenarios.is_empty() && opts.format != Format::Csv {
        sliding_window::run(cfg.seed, cfg.regions, cfg.duration_ms)
    } else {
        Vec::new()
    };
    if opts.scenarios.is_empty() && opts.format == Format::Csv {
        eprintln!(
            "note: the sliding-window policies' table is in --format table and json, not csv"
        );
    }
    let stdout = report::render(
        opts.format,
        &runs,
        subjects.as_ref(),
        &windows,
        llm_run.as_ref(),
    );
    std::io::stdout()
        .lock()
        .write_all(stdout.as_bytes())
        .context("writing to stdout")?;

    if let Some(run) = &subjects {
        eprintln!(
            "per_subject: {} simulated decisions in {:.2} s wall on 1 thread",
            run.decisions, run.wall_s
        );
    }
    let decisions: u64 = runs.iter().map(|r| r.decisions).sum();
    let busy_s: f64 = runs.iter().map(|r| r.wall_s).sum();
    if !runs.is_empty() {
        eprintln!(
            "speed: {decisions} simulated decisions in {wall_s:.2} s wall on {jobs} thread(s): \
         {:.2} M decisions/s overall, {:.2} M decisions/s per busy core",
            decisions as f64 / wall_s.max(1e-9) / 1e6,
            decisions as f64 / busy_s.max(1e-9) / 1e6
        );
    }

    if let (Some((path, mut file)), Some(run)) = (per_subject_file, &subjects) {
        file.write_all(per_subject::csv(run).as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(run) = &llm_run {
        eprintln!(
            "llm_tokens: {} simulated decisions in {:.2} s wall on 1 thread",
            run.decisions, run.wall_s
        );
    }
    if let Some(out) = out_dir {
        out.write(&runs, subjects.as_ref(), llm_run.as_ref())?;
    }
    Ok(())
}

/// Creates (or truncates) a file for writing.
fn create(path: &Path) -> anyhow::Result<(PathBuf, File)> {
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    Ok((path.to_path_buf(), file))
}

/// The `--out` directory, with `results.csv` created up front.
struct OutDir {
    dir: PathBuf,
    results: (PathBuf, File),
}

impl OutDir {
    fn create(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let results = create(&dir.join("results.csv"))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            results,
        })
    }

    /// Writes `results.csv`, `per_subject.csv` and `llm_tokens.csv` when they ran, and per
    /// scenario its series and plots.
    fn write(
        self,
        runs: &[ScenarioRun],
        subjects: Option<&SubjectRun>,
        llm: Option<&LlmRun>,
    ) -> anyhow::Result<()> {
        let (path, mut file) = self.results;
        file.write_all(report::csv(runs).as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
        if let Some(run) = subjects {
            let path = self.dir.join("per_subject.csv");
            std::fs::write(&path, per_subject::csv(run))
                .with_context(|| format!("writing {}", path.display()))?;
        }
        if let Some(run) = llm {
            let path = self.dir.join("llm_tokens.csv");
            std::fs::write(&path, llm_tokens::csv(run))
                .with_context(|| format!("writing {}", path.display()))?;
        }
        for run in runs {
            let path = self.dir.join(format!("{}_series.csv", run.scenario));
            std::fs::write(&path, report::series_csv(run))
                .with_context(|| format!("writing {}", path.display()))?;
            plot::plot_scenario(&self.dir, run)?;
        }
        eprintln!(
            "wrote results.csv, per-scenario series and SVG plots to {}",
            self.dir.display()
        );
        Ok(())
    }
}
