//! The command line.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// quotad: the per-region quota daemon.
#[derive(Debug, Parser)]
#[command(name = "quotad", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// What to do; no subcommand runs with the built-in default config.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon.
    Run {
        /// The TOML config file; without one the built-in defaults apply.
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Validate a config file, report every problem, print the effective config (secrets
    /// redacted).
    CheckConfig {
        /// The TOML config file.
        file: PathBuf,
    },
}
