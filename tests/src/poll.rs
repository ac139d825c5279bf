//! Waiting on a condition with a deadline instead of sleeping.

use std::time::{Duration, Instant};

/// Polls `f` until it returns `Some` or `within` passes.
pub async fn eventually<T, F, Fut>(within: Duration, every: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(every).await;
    }
}
