//! `QUOTAD_…` environment overrides, applied over the file before validation.

use std::path::PathBuf;

use crate::config::problem::{problem, ConfigProblem};
use crate::config::schema::{Config, LogFormat, RedisConfig, RedisMode};

/// Environment overrides: variable name → what it sets.
pub const ENV_OVERRIDES: &[(&str, &str)] = &[
    ("QUOTAD_REGION", "region"),
    ("QUOTAD_DATA_DIR", "data_dir"),
    ("QUOTAD_API_LISTEN", "api.listen"),
    ("QUOTAD_PEER_LISTEN", "peer.listen"),
    ("QUOTAD_ENVOY_LISTEN", "envoy.listen"),
    ("QUOTAD_REDIS_URL", "redis.url"),
    ("QUOTAD_REDIS_MODE", "redis.mode"),
    ("QUOTAD_REDIS_USERNAME", "redis.username"),
    ("QUOTAD_LOG_FORMAT", "telemetry.log_format"),
    ("QUOTAD_LOG_LEVEL", "telemetry.log_level"),
    ("QUOTAD_WORKER_THREADS", "runtime.worker_threads"),
];

impl Config {
    /// Applies `QUOTAD_…` overrides from `env`, noting values that do not parse.
    pub fn apply_env(
        &mut self,
        env: &dyn Fn(&str) -> Option<String>,
        problems: &mut Vec<ConfigProblem>,
    ) {
        for (var, _) in ENV_OVERRIDES {
            let Some(value) = env(var) else { continue };
            match *var {
                "QUOTAD_REGION" => self.region = value,
                "QUOTAD_DATA_DIR" => self.data_dir = PathBuf::from(value),
                "QUOTAD_API_LISTEN" => self.api.listen = value,
                "QUOTAD_PEER_LISTEN" => self.peer.listen = value,
                "QUOTAD_ENVOY_LISTEN" => self.envoy.listen = Some(value),
                "QUOTAD_REDIS_URL" => {
                    self.redis.get_or_insert_with(RedisConfig::default).url = value;
                }
                // Not a way to turn Redis on: it names whom to connect as, not where.
                "QUOTAD_REDIS_USERNAME" => match self.redis.as_mut() {
                    Some(redis) => redis.username = Some(value),
                    None => problems.push(problem(
                        *var,
                        "is set but no Redis is configured (redis.url or QUOTAD_REDIS_URL)",
                    )),
                },
                "QUOTAD_REDIS_MODE" => match (self.redis.as_mut(), value.as_str()) {
                    (None, _) => problems.push(problem(
                        *var,
                        "is set but no Redis is configured (redis.url or QUOTAD_REDIS_URL)",
                    )),
                    (Some(redis), "standalone") => redis.mode = RedisMode::Standalone,
                    (Some(redis), "cluster") => redis.mode = RedisMode::Cluster,
                    (Some(redis), "sentinel") => redis.mode = RedisMode::Sentinel,
                    (Some(_), other) => problems.push(problem(
                        *var,
                        format!(
                            "must be \"standalone\", \"cluster\" or \"sentinel\" (got {other:?})"
                        ),
                    )),
                },
                "QUOTAD_LOG_FORMAT" => match value.as_str() {
                    "text" => self.telemetry.log_format = LogFormat::Text,
                    "json" => self.telemetry.log_format = LogFormat::Json,
                    other => problems.push(problem(
                        *var,
                        format!("must be \"text\" or \"json\" (got {other:?})"),
                    )),
                },
                "QUOTAD_LOG_LEVEL" => self.telemetry.log_level = value,
                "QUOTAD_WORKER_THREADS" => match value.parse() {
                    Ok(n) => self.runtime.worker_threads = n,
                    Err(_) => problems.push(problem(
                        *var,
                        format!("must be a whole number of threads (got {value:?})"),
                    )),
                },
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::secrets::ENV_ADMIN_TOKEN;

    #[test]
    fn environment_overrides_and_secrets() {
        let env = |k: &str| match k {
            "QUOTAD_API_LISTEN" => Some("127.0.0.1:9000".to_string()),
            "QUOTAD_LOG_FORMAT" => Some("json".to_string()),
            "QUOTAD_REDIS_URL" => Some("redis://127.0.0.1:7000".to_string()),
            ENV_ADMIN_TOKEN => Some("s3cret-token".to_string()),
            _ => None,
        };
        let s = Config::load(None, &env).unwrap();
        assert_eq!(s.api_listen.port(), 9000);
        assert_eq!(s.config.telemetry.log_format, LogFormat::Json);
        assert_eq!(
            s.config.redis.as_ref().unwrap().url,
            "redis://127.0.0.1:7000"
        );
        assert_eq!(
            s.secrets.admin_token.as_ref().unwrap().expose(),
            "s3cret-token"
        );
        let printed = s.redacted();
        assert!(!printed.contains("s3cret-token"));
        assert!(printed.contains("admin_token = <redacted> (from the environment)"));
        assert!(!format!("{s:?}").contains("s3cret-token"));
    }

    #[test]
    fn a_bad_environment_value_is_reported() {
        let env = |k: &str| (k == "QUOTAD_LOG_FORMAT").then(|| "xml".to_string());
        let errs = Config::load(None, &env).unwrap_err();
        assert_eq!(errs.0[0].field, "QUOTAD_LOG_FORMAT");
    }
}
