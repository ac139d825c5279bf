//! Rotating the Redis password without a restart. `redis.password_file` is read again every
//! `redis.password_check_ms`; a password that differs from the one in use is handed to the
//! store, which switches to it once Redis accepts it (`RedisStore::use_credentials`). Until then
//! decisions go on over the current connections, so the file may change before or after Redis
//! does. The password itself never reaches a log line or a metric.

use std::path::{Path, PathBuf};
use std::time::Duration;

use quota_store::{Credentials, RedisStore, StoreError};
use tokio::sync::watch;

use crate::telemetry;

/// What one reading of the password file calls for.
#[derive(Debug, PartialEq, Eq)]
pub enum Reading {
    /// The file holds the password in use (or nothing yet): nothing to do.
    Unchanged,
    /// The file holds another password: try it.
    Changed(String),
    /// The file cannot be read; the reason, without its contents.
    Unreadable(String),
}

/// Reads `path` and compares it, trimmed as at start-up, with the password `active`.
pub fn read(path: &Path, active: &str) -> Reading {
    match std::fs::read_to_string(path) {
        // An empty file is a secret being rewritten (truncate, then write): wait for it.
        Ok(text) if text.trim().is_empty() || text.trim() == active => Reading::Unchanged,
        Ok(text) => Reading::Changed(text.trim().to_string()),
        Err(e) => Reading::Unreadable(e.to_string()),
    }
}

/// The last refusal or read error seen, so each is logged once (held in memory only, as the
/// password in use is).
#[derive(Debug, Default)]
struct Noted(Option<String>);

impl Noted {
    /// True the first time `what` is seen in a row.
    fn first(&mut self, what: &str) -> bool {
        if self.0.as_deref() == Some(what) {
            return false;
        }
        self.0 = Some(what.to_string());
        true
    }
}

/// Watches `path` until `shutdown`, switching `store` to each new password Redis accepts.
pub async fn run(
    store: RedisStore,
    path: PathBuf,
    username: Option<String>,
    mut active: String,
    every: Duration,
    region: String,
    mut shutdown: watch::Receiver<bool>,
) {
    let counter = |outcome: &'static str| {
        metrics::counter!(telemetry::REDIS_PASSWORD_RELOADS_TOTAL,
            "region" => region.clone(), "outcome" => outcome)
    };
    // Every outcome from 0, so the first refusal shows in `increase()`.
    for outcome in ["taken", "refused", "unreachable", "unreadable"] {
        counter(outcome).absolute(0);
    }
    let count = |outcome: &'static str| counter(outcome).increment(1);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let (mut refused, mut unreadable) = (Noted::default(), Noted::default());
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tick.tick() => {}
        }
        let password = match read(&path, &active) {
            Reading::Unchanged => continue,
            Reading::Unreadable(why) => {
                if unreadable.first(&why) {
                    count("unreadable");
                    tracing::warn!(file = %path.display(), error = %why,
                        "Cannot read the Redis password file; keeping the password in use.");
                }
                continue;
            }
            Reading::Changed(password) => password,
        };
        unreadable = Noted::default();
        let credentials = Credentials {
            username: username.clone(),
            password: password.clone(),
        };
        match store.use_credentials(credentials).await {
            Ok(()) => {
                active = password;
                refused = Noted::default();
                count("taken");
                tracing::info!(file = %path.display(),
                    "Switched to the new Redis password from the password file.");
            }
            // Logged once per password; tried again each interval, as Redis may take it later.
            Err(e) if refused.first(&password) => {
                count(outcome(&e));
                tracing::warn!(file = %path.display(), error = %e,
                    "Redis does not take the new password in the password file yet; keeping the one in use and trying again.");
            }
            Err(_) => {}
        }
    }
}

/// The metric outcome of a password not taken.
fn outcome(e: &StoreError) -> &'static str {
    match e {
        StoreError::Refused { .. } => "refused",
        _ => "unreachable",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reading_names_a_changed_password_and_ignores_the_same_or_an_empty_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pw");
        assert!(matches!(read(&path, "old"), Reading::Unreadable(_)));
        std::fs::write(&path, "old\n").unwrap();
        assert_eq!(read(&path, "old"), Reading::Unchanged);
        std::fs::write(&path, "").unwrap();
        assert_eq!(read(&path, "old"), Reading::Unchanged);
        std::fs::write(&path, "  new pass \n").unwrap();
        assert_eq!(read(&path, "old"), Reading::Changed("new pass".into()));
        let Reading::Unreadable(why) = read(dir.path(), "old") else {
            panic!("a directory is not a password file");
        };
        assert!(!why.contains("new pass"), "{why}");
    }

    #[test]
    fn each_refusal_is_noted_once_in_a_row() {
        let mut n = Noted::default();
        assert!(n.first("a"));
        assert!(!n.first("a"));
        assert!(n.first("b"));
        assert!(n.first("a"));
    }
}
