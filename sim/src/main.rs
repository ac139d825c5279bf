//! `sim`: runs the scenario suite and prints the table (see the crate docs of `sim`).

use std::io::IsTerminal;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sim::options::{Format, Options};
use sim::{per_subject, plot, report};

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
    let scenarios = opts.scenarios();
    let strategies = opts.strategies();
    let jobs = opts
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let per_subject = opts.per_subject();
    let total = (scenarios.len() as u64 + u64::from(per_subject)) * cfg.duration_ms / 1000;
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
    bar.finish_and_clear();

    if !runs.is_empty() {
        let out = match opts.format {
            Format::Table => report::table(&runs),
            Format::Csv => report::csv(&runs),
            Format::Json => report::json(&runs),
        };
        print!("{out}");
    }
    if let Some(run) = &subjects {
        let out = match opts.format {
            Format::Table => per_subject::table(run),
            Format::Csv => per_subject::csv(run),
            Format::Json => per_subject::json(run),
        };
        if !runs.is_empty() {
            println!();
        }
        print!("{out}");
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

    if let Some(dir) = &opts.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("results.csv");
        std::fs::write(&path, report::csv(&runs))
            .with_context(|| format!("writing {}", path.display()))?;
        for run in &runs {
            let path = dir.join(format!("{}_series.csv", run.scenario));
            std::fs::write(&path, report::series_csv(run))
                .with_context(|| format!("writing {}", path.display()))?;
            plot::plot_scenario(dir, run)?;
        }
        eprintln!(
            "wrote results.csv, per-scenario series and SVG plots to {}",
            dir.display()
        );
    }
    Ok(())
}
