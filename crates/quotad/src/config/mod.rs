//! The daemon's configuration: a TOML file (unknown fields rejected), then `QUOTAD_…`
//! environment overrides, then one validation pass that reports every problem at once.
//!
//! Secrets (the admin token, the peer token, the Redis password) never live in the file itself:
//! they come from the environment or from a file the config names, so a config can be printed,
//! committed and diffed without leaking anything.
//!
//! One file per job: [`schema`] (the file's fields and defaults), [`env`] (the overrides),
//! [`secrets`], [`validate`] (the one pass), [`settings`] (its result), [`problem`].

pub mod env;
pub mod problem;
pub mod schema;
pub mod secrets;
pub mod settings;
pub mod validate;

use std::path::Path;

pub use env::ENV_OVERRIDES;
pub use problem::{ConfigErrors, ConfigProblem};
pub use schema::{
    ApiConfig, Blanket, BreakerConfig, Config, CoordinationConfig, EnvoyConfig, LogFormat,
    PeerConfig, RaftTimings, RedisConfig, RedisMode, RegionConfig, RuntimeConfig, TelemetryConfig,
};
pub use secrets::{
    SecretSource, Secrets, ENV_ADMIN_TOKEN, ENV_PEER_TOKEN, ENV_REDIS_PASSWORD,
    ENV_REDIS_SENTINEL_PASSWORD,
};
pub use settings::{RegionSettings, Settings};

use problem::problem;

impl Config {
    /// Parses TOML text (unknown fields are errors).
    pub fn from_toml(text: &str) -> Result<Self, ConfigErrors> {
        toml::from_str(text).map_err(|e| ConfigErrors(vec![problem("(file)", e.to_string())]))
    }

    /// Reads and parses a config file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigErrors> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigErrors(vec![problem(
                "(file)",
                format!("cannot read {}: {e}", path.display()),
            )])
        })?;
        Self::from_toml(&text)
    }

    /// Loads a config file (or the built-in default), applies the environment and validates.
    pub fn load(
        path: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Settings, ConfigErrors> {
        let mut config = match path {
            Some(path) => Self::from_file(path)?,
            None => Self::default(),
        };
        let mut problems = Vec::new();
        config.apply_env(env, &mut problems);
        config.resolve(env, problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn the_default_config_is_valid_and_single_region() {
        let s = Config::load(None, &no_env).unwrap();
        assert_eq!(s.api_listen.to_string(), "127.0.0.1:7450");
        assert_eq!(s.peer_listen.to_string(), "127.0.0.1:7451");
        assert!(s.is_single_region());
        assert!(s.config.redis.is_none());
        assert_eq!(s.secrets.admin_token_source, SecretSource::Unset);
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let e = Config::from_toml("region = \"a\"\n[api]\nlisten = \"127.0.0.1:1\"\nbogus = 1\n")
            .unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
    }

    /// Loads an example with peer TLS, its certificate files swapped for generated ones that
    /// name this region's address and identity.
    fn load_with_generated_tls(
        path: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Settings, ConfigErrors> {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, SanType};
        let mut config = Config::from_file(path)?;
        let dir = tempfile::tempdir().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
        let me = config
            .regions
            .iter()
            .find(|r| r.id == config.region)
            .unwrap();
        let host = me.peer.rsplit_once(':').unwrap().0.to_string();
        let identity = me
            .identity
            .clone()
            .unwrap_or_else(|| quota_raft::tls::region_identity(&config.region));
        let mut leaf = CertificateParams::new(vec![host]).unwrap();
        leaf.subject_alt_names
            .push(SanType::URI(identity.try_into().unwrap()));
        let key = KeyPair::generate().unwrap();
        let cert = leaf.signed_by(&key, &ca).unwrap();
        let write = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            Some(p)
        };
        config.peer.tls_cert_file = write("cert.pem", &cert.pem());
        config.peer.tls_key_file = write("key.pem", &key.serialize_pem());
        config.peer.tls_ca_file = write("ca.pem", &ca.pem());
        // The example's API certificate: any valid pair does for parsing.
        if config.api.tls_cert_file.is_some() {
            config.api.tls_cert_file = config.peer.tls_cert_file.clone();
            config.api.tls_key_file = config.peer.tls_key_file.clone();
        }
        let mut problems = Vec::new();
        config.apply_env(env, &mut problems);
        config.resolve(env, problems)
    }

    #[test]
    fn every_example_config_parses_and_validates() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config");
        let env = |k: &str| (k == ENV_PEER_TOKEN).then(|| "peer-secret".to_string());
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let result = if Config::from_file(&path)
                    .unwrap()
                    .peer
                    .tls_cert_file
                    .is_some()
                {
                    load_with_generated_tls(&path, &env)
                } else {
                    Config::load(Some(&path), &env)
                };
                assert!(
                    result.is_ok(),
                    "{}: {}",
                    path.display(),
                    result.unwrap_err()
                );
                seen += 1;
            }
        }
        assert!(
            seen >= 4,
            "expected the example configs in {}",
            dir.display()
        );
    }
}
