//! quotad's entry point: parse the command line, load the config, run until SIGTERM.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser as _;
use quotad::cli::{Cli, Command};
use quotad::config::Config;
use quotad::{server, telemetry};

/// mimalloc instead of the system allocator: a check allocates a few dozen small objects across
/// hyper, axum, serde and redis-rs, and glibc's malloc/free took ~16 % of the server's CPU on the
/// load bench; mimalloc cut server CPU per check by ~2.5–3 µs (docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::CheckConfig { file }) => match Config::load(Some(&file), &env) {
            Ok(settings) => {
                println!("{}", settings.redacted());
                eprintln!("{}: OK", file.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{}: {e}", file.display());
                ExitCode::from(2)
            }
        },
        Some(Command::Run { config }) => report(run(config.as_deref())),
        None => report(run(None)),
    }
}

fn report(r: anyhow::Result<()>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("quotad: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(config: Option<&std::path::Path>) -> anyhow::Result<()> {
    let settings = Config::load(config, &env).map_err(anyhow::Error::new)?;
    telemetry::init_tracing(&settings.config.telemetry)?;
    let runtime =
        server::build_runtime(&settings.config.runtime).context("starting the tokio runtime")?;
    runtime.block_on(async {
        let metrics = telemetry::install_metrics()?;
        server::run(settings, Some(metrics), server::shutdown_signal()).await
    })
}
