//! Daemon configs for single-region tests, and where the repository's examples are.

use std::path::{Path, PathBuf};

/// The path of the repository's `config/` directory.
pub fn config_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../config")
}

/// A single-region config on the embedded store.
pub fn embedded_config() -> String {
    r#"
region = "solo"
[api]
listen = "{api}"
body_limit_bytes = 16384
[telemetry]
log_level = "info"
"#
    .to_string()
}

/// A single-region config on a Redis at `redis_url`, with short breaker and agent intervals.
pub fn redis_config(redis_url: &str) -> String {
    format!(
        r#"
region = "b"
[api]
listen = "{{api}}"
[redis]
url = "{redis_url}"
timeout_ms = 100
[breaker]
failure_threshold = 2
slow_call_ms = 100
open_ms = 200
[coordination]
report_interval_ms = 200
rebalance_interval_ms = 1000
lease_ms = 5000
drift_margin_ms = 200
[telemetry]
log_level = "info"
"#
    )
}

/// [`redis_config`] with Envoy's rate limit service listening on `envoy_port`. Its Redis calls
/// may take a second before they count against the store: the Envoy tests assert decisions
/// made through Redis, which a loaded test host must not turn into the fail mode.
pub fn redis_config_with_envoy(redis_url: &str, envoy_port: u16) -> String {
    format!(
        "{}[envoy]\nlisten = \"127.0.0.1:{envoy_port}\"\n",
        redis_config(redis_url)
            .replace("timeout_ms = 100", "timeout_ms = 1000")
            .replace("slow_call_ms = 100", "slow_call_ms = 1000")
    )
}
