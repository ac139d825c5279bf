//! The only module of the daemon that reads real time (clippy.toml bans the clock elsewhere).
//!
//! Wall-clock milliseconds stamp coordinator commands and the coordinator's lease expiries,
//! which are compared across machines; monotonic time (tokio's, so tests can pause it)
//! measures intervals and latencies on one machine, and counts this region's own lease: a
//! wall clock stepped backwards must not lengthen it. Keeping both here makes the distinction
//! visible.

use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

/// How far before the first reading [`monotonic_ms`] counts from: far enough that every
/// reading in the process, paused test clocks included, lies after it and is above 0 (0 means
/// "no lease").
const ORIGIN_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);

/// Whole milliseconds of the monotonic clock ([`monotonic`]) since a fixed origin of this
/// process, rounded down: the scale this region's lease end is kept on
/// ([`crate::coordination::ClusterView::lease_end_local_ms`]). Never goes back, whatever the
/// wall clock does; meaningless outside this process.
pub fn monotonic_ms() -> u64 {
    static ORIGIN: OnceLock<tokio::time::Instant> = OnceLock::new();
    let now = monotonic();
    let origin = *ORIGIN.get_or_init(|| now.checked_sub(ORIGIN_BEFORE).unwrap_or(now));
    now.saturating_duration_since(origin).as_millis() as u64
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The lease scale runs on tokio's clock: a paused test moves it, and only by what it
    /// advances.
    #[tokio::test(start_paused = true)]
    async fn monotonic_ms_follows_the_tokio_clock() {
        let start = monotonic_ms();
        assert!(start > 0, "0 means no lease");
        tokio::time::advance(Duration::from_millis(1_500)).await;
        assert_eq!(monotonic_ms() - start, 1_500);
    }
}
