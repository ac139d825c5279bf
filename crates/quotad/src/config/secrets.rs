//! Secrets (the admin token, the peer token, the Redis passwords): from the environment or a
//! file the config names, never from the config itself.

use std::path::Path;

use serde::Serialize;

use crate::config::problem::{problem, ConfigProblem};
use crate::config::schema::{Config, RedisMode};
use crate::secret::Secret;
use crate::tokens::{self, TokenSet};

/// Environment variable holding the admin bearer token.
pub const ENV_ADMIN_TOKEN: &str = "QUOTAD_ADMIN_TOKEN";
/// Environment variable holding the token peers present to each other.
pub const ENV_PEER_TOKEN: &str = "QUOTAD_PEER_TOKEN";
/// Environment variable holding the key identities are hashed with (the same in every region).
pub const ENV_IDENTITY_KEY: &str = "QUOTAD_IDENTITY_KEY";
/// The shortest identity key accepted: a short key makes the hash of a small input space (IPv4
/// addresses) easy to reverse.
pub const MIN_IDENTITY_KEY_LEN: usize = 16;
/// Environment variable holding the Redis password.
pub const ENV_REDIS_PASSWORD: &str = "QUOTAD_REDIS_PASSWORD";
/// The sentinels' own password (`requirepass` on the sentinels), Sentinel mode only.
pub const ENV_REDIS_SENTINEL_PASSWORD: &str = "QUOTAD_REDIS_SENTINEL_PASSWORD";

/// Where a secret came from, for the effective-config printout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SecretSource {
    Environment,
    File,
    Generated,
    Unset,
}

/// The secrets, resolved from the environment or files.
#[derive(Debug, Clone)]
pub struct Secrets {
    /// `None` means "generate one at start-up".
    pub admin_token: Option<Secret>,
    pub admin_token_source: SecretSource,
    pub peer_token: Option<Secret>,
    pub peer_token_source: SecretSource,
    pub redis_password: Option<Secret>,
    pub redis_password_source: SecretSource,
    pub redis_sentinel_password: Option<Secret>,
    pub redis_sentinel_password_source: SecretSource,
    /// The tokens of `api.tokens_file` as read at start (empty without one).
    pub api_tokens: TokenSet,
    /// The key identities are hashed with; `None`: checks naming an `identity` are refused.
    pub identity_key: Option<Secret>,
    pub identity_key_source: SecretSource,
}

impl Config {
    /// Reads every secret (environment first, then the file the config names), noting files
    /// that cannot be read and secrets set where they do not apply.
    pub(crate) fn resolve_secrets(
        &self,
        p: &mut Vec<ConfigProblem>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Secrets {
        let (admin_token, admin_token_source) = secret(
            p,
            env,
            ENV_ADMIN_TOKEN,
            "api.admin_token_file",
            self.api.admin_token_file.as_deref(),
        );
        let (peer_token, peer_token_source) = secret(
            p,
            env,
            ENV_PEER_TOKEN,
            "peer.token_file",
            self.peer.token_file.as_deref(),
        );
        let (redis_password, redis_password_source) = secret(
            p,
            env,
            ENV_REDIS_PASSWORD,
            "redis.password_file",
            self.redis.as_ref().and_then(|r| r.password_file.as_deref()),
        );
        check_redis_username(
            p,
            self.redis.as_ref().and_then(|r| r.username.as_deref()),
            redis_password.is_some(),
        );
        let (redis_sentinel_password, redis_sentinel_password_source) = secret(
            p,
            env,
            ENV_REDIS_SENTINEL_PASSWORD,
            "redis.sentinel_password_file",
            self.redis
                .as_ref()
                .and_then(|r| r.sentinel_password_file.as_deref()),
        );
        let sentinel = self
            .redis
            .as_ref()
            .is_some_and(|r| r.mode == RedisMode::Sentinel);
        if redis_sentinel_password.is_some() && !sentinel {
            p.push(problem(
                "redis.sentinel_password_file",
                format!("the sentinels' password ({ENV_REDIS_SENTINEL_PASSWORD} or redis.sentinel_password_file) is for redis.mode = \"sentinel\""),
            ));
        }
        let (identity_key, identity_key_source) = secret(
            p,
            env,
            ENV_IDENTITY_KEY,
            "api.identity_key_file",
            self.api.identity_key_file.as_deref(),
        );
        if identity_key
            .as_ref()
            .is_some_and(|k| k.expose().len() < MIN_IDENTITY_KEY_LEN)
        {
            p.push(problem(
                "api.identity_key_file",
                format!("the identity key ({ENV_IDENTITY_KEY} or api.identity_key_file) must be at least {MIN_IDENTITY_KEY_LEN} bytes"),
            ));
        }
        if self.envoy.identity_key.is_some() && identity_key.is_none() {
            p.push(problem(
                "envoy.identity_key",
                format!("identities need an identity key: set {ENV_IDENTITY_KEY} or api.identity_key_file"),
            ));
        }
        if self.envoy.identity_key.as_ref().is_some_and(|k| {
            k.is_empty() || *k == self.envoy.tenant_key || *k == self.envoy.policy_key
        }) {
            p.push(problem(
                "envoy.identity_key",
                "must be a non-empty key other than envoy.tenant_key and envoy.policy_key",
            ));
        }
        let api_tokens = match self.api.tokens_file.as_deref().map(tokens::read_file) {
            None => TokenSet::default(),
            Some(Ok(set)) => set,
            Some(Err(e)) if e.field == "api.tokens_file" => {
                p.push(problem(e.field, e.message));
                TokenSet::default()
            }
            Some(Err(e)) => {
                p.push(problem("api.tokens_file", e.to_string()));
                TokenSet::default()
            }
        };
        Secrets {
            api_tokens,
            identity_key,
            identity_key_source,
            admin_token,
            admin_token_source,
            peer_token,
            peer_token_source,
            redis_password,
            redis_password_source,
            redis_sentinel_password,
            redis_sentinel_password_source,
        }
    }
}

/// An ACL user name as Redis takes it in `AUTH`: one word of printable characters.
fn check_redis_username(p: &mut Vec<ConfigProblem>, username: Option<&str>, password: bool) {
    let Some(name) = username else { return };
    if name.is_empty() || name.len() > 128 || !name.chars().all(|c| c.is_ascii_graphic()) {
        p.push(problem(
            "redis.username",
            "must be 1 to 128 printable ASCII characters without spaces",
        ));
    } else if !password {
        p.push(problem(
            "redis.username",
            format!("needs a password: set {ENV_REDIS_PASSWORD} or redis.password_file"),
        ));
    }
}

fn secret(
    p: &mut Vec<ConfigProblem>,
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    field: &str,
    file: Option<&Path>,
) -> (Option<Secret>, SecretSource) {
    if let Some(v) = env(var).filter(|v| !v.is_empty()) {
        return (Some(Secret::new(v)), SecretSource::Environment);
    }
    let Some(path) = file else {
        return (None, SecretSource::Unset);
    };
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => {
            (Some(Secret::new(s.trim().to_string())), SecretSource::File)
        }
        Ok(_) => {
            p.push(problem(field, format!("{} is empty", path.display())));
            (None, SecretSource::Unset)
        }
        Err(e) => {
            p.push(problem(
                field,
                format!("cannot read {}: {e}", path.display()),
            ));
            (None, SecretSource::Unset)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn secrets_come_from_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "from-file\n").unwrap();
        let mut c = Config::default();
        c.api.admin_token_file = Some(path);
        c.peer.token_file = Some(dir.path().join("missing"));
        let errs = c.clone().resolve(&no_env, Vec::new()).unwrap_err();
        assert_eq!(errs.0.len(), 1);
        assert_eq!(errs.0[0].field, "peer.token_file");
        c.peer.token_file = None;
        let s = c.resolve(&no_env, Vec::new()).unwrap();
        assert_eq!(s.secrets.admin_token.unwrap().expose(), "from-file");
    }

    #[test]
    fn a_tokens_file_is_read_and_its_faults_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.toml");
        let sha = hex::encode(crate::secret::digest("gateway-token-0123"));
        std::fs::write(
            &path,
            format!("[[tokens]]\nname = \"gw\"\nscope = \"check\"\ntoken_sha256 = \"{sha}\"\n"),
        )
        .unwrap();
        let mut c = Config::default();
        c.api.tokens_file = Some(path.clone());
        let s = c.clone().resolve(&no_env, Vec::new()).unwrap();
        assert_eq!(
            &*s.secrets
                .api_tokens
                .lookup("gateway-token-0123")
                .unwrap()
                .name,
            "gw"
        );
        std::fs::write(&path, "[[tokens]]\nname = \"gw\"\nscope = \"check\"\n").unwrap();
        let errs = c.resolve(&no_env, Vec::new()).unwrap_err();
        assert_eq!(errs.0.len(), 1);
        assert_eq!(errs.0[0].field, "api.tokens_file");
        assert!(
            errs.0[0].message.contains("tokens[0].token_sha256"),
            "{}",
            errs.0[0].message
        );
    }
}
