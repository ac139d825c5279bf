//! `QUOTAD_…` environment overrides, applied over the file before validation.

use std::path::PathBuf;

use crate::config::problem::{problem, ConfigProblem};
use crate::config::schema::{Config, LogFormat, RedisConfig, RedisMode};

/// Environment overrides: variable name → what it sets.
pub const ENV_OVERRIDES: &[(&str, &str)] = &[
    ("QUOTAD_REGION", "region"),
    ("QUOTAD_NODE_ID", "node_id"),
    (
        "QUOTAD_NODE_NAME",
        "node_id: the [[regions]] entry of this region whose peer host's first label it is",
    ),
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
                "QUOTAD_NODE_ID" => match value.parse() {
                    Ok(n) => self.node_id = Some(n),
                    Err(_) => problems.push(problem(
                        *var,
                        format!("must be a node id, a whole number (got {value:?})"),
                    )),
                },
                // A StatefulSet's pod name or a Compose service's host name names the entry,
                // so one config serves every daemon of a region.
                "QUOTAD_NODE_NAME" if self.node_id.is_none() => {
                    let host = |peer: &str| {
                        peer.rsplit_once(':')
                            .map_or(peer, |(h, _)| h)
                            .split('.')
                            .next()
                            .unwrap_or_default()
                            .to_string()
                    };
                    let region = env("QUOTAD_REGION").unwrap_or_else(|| self.region.clone());
                    match self
                        .regions
                        .iter()
                        .find(|r| r.id == region && host(&r.peer) == value)
                    {
                        Some(r) => self.node_id = Some(r.node_id),
                        None => problems.push(problem(
                            *var,
                            format!(
                                "{value:?} is the first label of no [[regions]] entry's peer host in region {region:?}"
                            ),
                        )),
                    }
                }
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

    /// Issue 31: one config for every daemon of a region; each finds its entry by its host
    /// name (a StatefulSet pod's, a Compose service's), or is given its node id.
    #[test]
    fn a_daemon_finds_its_entry_by_its_host_name() {
        let text = "region = \"a\"\n\
            [[regions]]\nid = \"a\"\nnode_id = 1\napi = \"quotad-a-0.quotad-a:7450\"\npeer = \"quotad-a-0.quotad-a:7451\"\n\
            [[regions]]\nid = \"a\"\nnode_id = 2\napi = \"quotad-a-1.quotad-a:7450\"\npeer = \"quotad-a-1.quotad-a:7451\"\n\
            [[regions]]\nid = \"b\"\nnode_id = 3\napi = \"quotad-b-0.quotad-b:7450\"\npeer = \"quotad-b-0.quotad-b:7451\"\n";
        let load = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .chain([("QUOTAD_PEER_TOKEN".to_string(), "x".repeat(32))])
                .collect();
            let mut c = Config::from_toml(text).unwrap();
            let mut problems = Vec::new();
            let env = |k: &str| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
            c.apply_env(&env, &mut problems);
            c.resolve(&env, problems)
        };
        assert_eq!(
            load(&[("QUOTAD_NODE_NAME", "quotad-a-1")]).unwrap().node_id,
            Some(2)
        );
        assert_eq!(load(&[("QUOTAD_NODE_ID", "1")]).unwrap().node_id, Some(1));
        for (var, value) in [
            ("QUOTAD_NODE_NAME", "quotad-b-0"),
            ("QUOTAD_NODE_NAME", "quotad-a-7"),
            ("QUOTAD_NODE_ID", "one"),
        ] {
            let e = load(&[(var, value)]).unwrap_err();
            assert!(e.0.iter().any(|p| p.field == var), "{var}={value}: {e}");
        }
    }

    #[test]
    fn a_bad_environment_value_is_reported() {
        let env = |k: &str| (k == "QUOTAD_LOG_FORMAT").then(|| "xml".to_string());
        let errs = Config::load(None, &env).unwrap_err();
        assert_eq!(errs.0[0].field, "QUOTAD_LOG_FORMAT");
    }
}
