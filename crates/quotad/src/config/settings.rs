//! A configuration checked and resolved, as the daemon runs on it.

use std::net::SocketAddr;

use quota_core::RegionId;

use crate::config::schema::Config;
use crate::config::secrets::{SecretSource, Secrets};

/// A configuration checked and resolved: addresses parsed, ids validated, secrets loaded.
#[derive(Debug, Clone)]
pub struct Settings {
    pub config: Config,
    pub region: RegionId,
    /// This daemon's Raft node id: its `[[regions]]` entry (`None` for a single region).
    pub node_id: Option<u64>,
    pub api_listen: SocketAddr,
    pub peer_listen: SocketAddr,
    /// Envoy's rate limit service listener, if on.
    pub envoy_listen: Option<SocketAddr>,
    pub regions: Vec<RegionSettings>,
    pub secrets: Secrets,
    /// Peer mutual TLS files (`[peer] tls_*`), checked readable and matching.
    pub peer_tls: Option<quota_raft::tls::TlsFiles>,
    /// TLS material for a `rediss://` Redis, read from the files named in `[redis]`.
    pub redis_tls: Option<quota_store::Tls>,
    /// TLS files of the API listener (`[api] tls_*`), checked.
    pub api_tls: Option<quota_raft::tls::ServerFiles>,
    /// TLS files of Envoy's gRPC listener (`[envoy] tls_*`), checked.
    pub envoy_tls: Option<quota_raft::tls::ServerFiles>,
}

/// A cluster member, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSettings {
    pub id: RegionId,
    pub node_id: u64,
    /// `host:port` or `IP:port`.
    pub api: String,
    /// `host:port` or `IP:port`.
    pub peer: String,
    /// The URI SAN its peer certificate names (with peer TLS).
    pub identity: String,
}

impl Settings {
    /// This daemon's `[[regions]]` entry (`None` for a single region).
    pub fn me(&self) -> Option<&RegionSettings> {
        let n = self.node_id?;
        self.regions.iter().find(|r| r.node_id == n)
    }

    /// The regions of the cluster, each once, in the order they are first listed.
    pub fn region_ids(&self) -> Vec<RegionId> {
        let mut out: Vec<RegionId> = Vec::new();
        for r in &self.regions {
            if !out.contains(&r.id) {
                out.push(r.id.clone());
            }
        }
        out
    }

    /// The multi-region peers, or `None` for a single region run.
    pub fn is_single_region(&self) -> bool {
        self.regions.len() <= 1
    }

    /// The effective configuration as TOML plus where each secret came from; no secret values.
    pub fn redacted(&self) -> String {
        let mut out = toml::to_string_pretty(&self.config)
            .unwrap_or_else(|e| format!("# cannot render: {e}\n"));
        let s = &self.secrets;
        out.push_str("\n# secrets (values redacted)\n");
        for (name, source) in [
            ("admin_token", s.admin_token_source),
            ("peer_token", s.peer_token_source),
            ("redis_password", s.redis_password_source),
            ("redis_sentinel_password", s.redis_sentinel_password_source),
            ("identity_key", s.identity_key_source),
        ] {
            let source = match source {
                SecretSource::Environment => "from the environment",
                SecretSource::File => "from a file",
                SecretSource::Generated => "generated at start-up",
                SecretSource::Unset if name == "admin_token" => "unset: generated at start-up",
                SecretSource::Unset => "unset",
            };
            out.push_str(&format!("# {name} = <redacted> ({source})\n"));
        }
        out
    }
}
