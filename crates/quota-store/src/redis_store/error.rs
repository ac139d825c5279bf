//! Redis errors as [`StoreError`]s.

use redis::RedisError;

use crate::StoreError;

pub(super) fn unavailable(e: &RedisError) -> StoreError {
    StoreError::Unavailable {
        reason: e.to_string(),
    }
}

/// Whether Redis refused this client's credentials or permissions. redis-rs's Cluster client
/// reports a refusal met while making its first connections only as text inside an I/O error.
fn refused(e: &RedisError) -> bool {
    const REFUSALS: [&str; 4] = ["AuthenticationFailed", "NOAUTH", "WRONGPASS", "NOPERM"];
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || e.code().is_some_and(|code| REFUSALS.contains(&code))
        || (e.kind() == redis::ErrorKind::Io
            && e.detail()
                .is_some_and(|d| REFUSALS.iter().any(|r| d.contains(r))))
}

/// Maps a Redis error: server replies (script errors) vs. transport problems.
pub(super) fn from_redis(e: &RedisError) -> StoreError {
    if refused(e) {
        return StoreError::Refused {
            reason: e.to_string(),
        };
    }
    match e.kind() {
        redis::ErrorKind::Server(_) | redis::ErrorKind::Extension => StoreError::Script {
            message: match (e.code(), e.detail()) {
                (Some(code), Some(detail)) => format!("{code} {detail}"),
                _ => e.to_string(),
            },
        },
        redis::ErrorKind::Parse | redis::ErrorKind::UnexpectedReturnType => StoreError::Protocol {
            reason: e.to_string(),
        },
        _ => unavailable(e),
    }
}

/// A reply of an unexpected shape.
pub(super) fn protocol(e: &redis::ParsingError) -> StoreError {
    StoreError::Protocol {
        reason: e.to_string(),
    }
}
