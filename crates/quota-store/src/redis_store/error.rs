//! Redis errors as [`StoreError`]s: the request's or its data's fault ([`StoreError::Rejected`])
//! apart from the store's (everything [`StoreError::is_outage`] counts).

use redis::RedisError;

use crate::StoreError;

fn unavailable(e: &RedisError) -> StoreError {
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

/// The prefix of every error reply the scripts give for arguments or stored data they refuse.
const SCRIPT_REJECTION: &str = "quotad: ";

/// The prefix of `set_params.lua`'s refusal of a write its stored fence forbids.
const FENCED: &str = "quotad: fenced: ";

/// Maps a Redis error: the scripts' refusals and wrong-type keys (the request's or the data's
/// fault) vs. other server replies vs. transport problems.
pub(super) fn from_redis(e: &RedisError) -> StoreError {
    if refused(e) {
        return StoreError::Refused {
            reason: e.to_string(),
        };
    }
    match e.kind() {
        redis::ErrorKind::Server(_) | redis::ErrorKind::Extension => {
            match (e.code(), e.detail()) {
                (Some("ERR"), Some(detail)) if detail.starts_with(FENCED) => StoreError::Fenced {
                    reason: detail[SCRIPT_REJECTION.len()..].to_string(),
                },
                (Some("ERR"), Some(detail)) if detail.starts_with(SCRIPT_REJECTION) => {
                    StoreError::Rejected {
                        reason: detail[SCRIPT_REJECTION.len()..].to_string(),
                    }
                }
                // Redis's text names the script and a line, never the key.
                (Some("WRONGTYPE"), _) => StoreError::Rejected {
                    reason: "a key of this bucket holds a value of another type".into(),
                },
                (Some(code), Some(detail)) => StoreError::Script {
                    message: format!("{code} {detail}"),
                },
                _ => StoreError::Script {
                    message: e.to_string(),
                },
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The error a server reply of `wire` (RESP, e.g. `-ERR …\r\n`) gives the client.
    fn reply(wire: &str) -> RedisError {
        redis::parse_redis_value(wire.as_bytes())
            .expect("a RESP error")
            .extract_error()
            .expect_err("an error reply")
    }

    #[test]
    fn a_scripts_refusal_is_rejected_and_no_outage() {
        let e = from_redis(&reply(
            "-ERR quotad: cost must be an integer in 0..9007\r\n",
        ));
        assert!(
            matches!(&e, StoreError::Rejected { reason } if reason == "cost must be an integer in 0..9007"),
            "{e:?}"
        );
        assert!(!e.is_outage());
    }

    #[test]
    fn a_wrong_type_key_is_rejected_without_quoting_redis() {
        let e = from_redis(&reply(
            "-WRONGTYPE Operation against a key holding the wrong kind of value script: abc, on @user_script:75.\r\n",
        ));
        assert!(matches!(&e, StoreError::Rejected { .. }), "{e:?}");
        assert!(!e.to_string().contains("user_script"), "{e}");
        assert!(!e.is_outage());
    }

    #[test]
    fn other_server_errors_and_refusals_are_outages() {
        let script = |e: &StoreError| matches!(e, StoreError::Script { .. });
        let refused = |e: &StoreError| matches!(e, StoreError::Refused { .. });
        type Class = fn(&StoreError) -> bool;
        let cases: [(&str, Class); 7] = [
            (
                "-OOM command not allowed when used memory > 'maxmemory'.\r\n",
                script,
            ),
            ("-BUSY Redis is busy running a script.\r\n", script),
            (
                "-ERR user_script:1: Script attempted to access nonexistent global variable\r\n",
                script,
            ),
            (
                "-LOADING Redis is loading the dataset in memory\r\n",
                script,
            ),
            ("-NOAUTH Authentication required.\r\n", refused),
            (
                "-WRONGPASS invalid username-password pair or user is disabled.\r\n",
                refused,
            ),
            (
                "-NOPERM this user has no permissions to run the 'evalsha' command\r\n",
                refused,
            ),
        ];
        for (wire, class) in cases {
            let e = from_redis(&reply(wire));
            assert!(class(&e), "{wire}: {e:?}");
            assert!(e.is_outage(), "{wire}");
        }
    }

    #[test]
    fn a_dropped_connection_is_unavailable() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let e = from_redis(&RedisError::from(io));
        assert!(matches!(&e, StoreError::Unavailable { .. }), "{e:?}");
        assert!(e.is_outage());
    }
}
