//! The only module of the daemon that reads real time (clippy.toml bans the clock elsewhere).
//!
//! Wall-clock milliseconds stamp coordinator commands and lease expiries, which are compared
//! across machines; monotonic time (tokio's, so tests can pause it) measures intervals and
//! latencies on one machine. Keeping both here makes the distinction visible.

use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock milliseconds since the Unix epoch.
#[allow(clippy::disallowed_methods)]
pub fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A monotonic instant from tokio's clock (paused and advanced in tests).
pub fn monotonic() -> tokio::time::Instant {
    tokio::time::Instant::now()
}
