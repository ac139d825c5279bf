//! The HTTP client of outbound peer calls, rebuilt when the TLS material changes.
//!
//! A pooled connection keeps the certificate of its handshake for as long as it lives, and a
//! busy peer connection (Raft heartbeats) never idles out of the pool. So each time
//! [`PeerTls::reload`] takes new files, the next call builds a fresh client: its connections
//! handshake with the new certificate, and the old client's pool closes once the calls still
//! running on it end. A peer sees the new certificate within the reload period
//! (`peer.tls_check_ms`) plus the longest peer request timeout.

use std::sync::Arc;

use arc_swap::ArcSwap;

use super::PeerTls;

/// Sets up a client builder (timeouts, pool limits) for [`PeerHttp`].
type Configure = dyn Fn(reqwest::ClientBuilder) -> reqwest::ClientBuilder + Send + Sync;

/// A client for peer calls: `https://` with this node's certificate when peer TLS is on
/// (rebuilt on rotation, see the module documentation), plain `http://` otherwise.
#[derive(Clone)]
pub struct PeerHttp {
    tls: Option<PeerTls>,
    configure: Arc<Configure>,
    /// The client, and the TLS generation it was built for.
    current: Arc<ArcSwap<(u64, reqwest::Client)>>,
}

impl std::fmt::Debug for PeerHttp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerHttp")
            .field("tls", &self.tls)
            .field("generation", &self.current.load().0)
            .finish_non_exhaustive()
    }
}

impl PeerHttp {
    /// A client over `tls` when given, each build set up by `configure`.
    pub fn new(
        tls: Option<&PeerTls>,
        configure: impl Fn(reqwest::ClientBuilder) -> reqwest::ClientBuilder + Send + Sync + 'static,
    ) -> Result<Self, reqwest::Error> {
        let configure: Arc<Configure> = Arc::new(configure);
        let tls = tls.cloned();
        let generation = tls.as_ref().map_or(0, PeerTls::generation);
        let client = build(tls.as_ref(), &*configure)?;
        Ok(Self {
            tls,
            configure,
            current: Arc::new(ArcSwap::from_pointee((generation, client))),
        })
    }

    /// `https` with peer TLS, else `http`.
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// The client for the next call: a new one after a rotation.
    pub fn client(&self) -> reqwest::Client {
        let current = self.current.load();
        let Some(tls) = &self.tls else {
            return current.1.clone();
        };
        let generation = tls.generation();
        if current.0 == generation {
            return current.1.clone();
        }
        match build(Some(tls), &*self.configure) {
            Ok(client) => {
                tracing::debug!(generation, "Peer client rebuilt for new TLS material.");
                self.current.store(Arc::new((generation, client.clone())));
                client
            }
            Err(e) => {
                tracing::warn!(error = %e, "Peer client not rebuilt: keeping the one in use.");
                current.1.clone()
            }
        }
    }
}

fn build(tls: Option<&PeerTls>, configure: &Configure) -> Result<reqwest::Client, reqwest::Error> {
    let builder = tls.map_or_else(reqwest::Client::builder, PeerTls::client_builder);
    configure(builder).build()
}
