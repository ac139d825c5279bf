//! TLS for the listeners clients dial (the daemon's API, Envoy's gRPC listener): a certificate
//! and key, and optionally a CA whose client certificates are then required; re-read on change
//! like the peer files. [`TlsIncoming`] accepts connections and runs their handshakes off the
//! accept loop, so one slow or silent client cannot hold up the others.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_rustls::server::TlsStream;

use super::{certified, client_verifier, every_until, provider, roots, Reload, TlsError};

/// How long a client has to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshaken connections waiting for the server to take them.
const ACCEPTED_QUEUE: usize = 64;

/// The PEM files of a listener's TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerFiles {
    /// The listener's certificate chain (leaf first).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// When set, clients must present a certificate that chains to these CAs.
    pub client_ca: Option<PathBuf>,
}

/// What the files held at the last good reading.
struct Material {
    key: Arc<CertifiedKey>,
    client_verifier: Option<Arc<dyn ClientCertVerifier>>,
    raw: Vec<u8>,
}

fn load(files: &ServerFiles) -> Result<Material, TlsError> {
    let (key, _, mut raw) = certified(&files.cert, &files.key)?;
    let client_verifier = match &files.client_ca {
        None => None,
        Some(ca) => {
            let (roots, ca_pem) = roots(ca)?;
            raw.extend_from_slice(&ca_pem);
            Some(client_verifier(roots, ca)?)
        }
    };
    Ok(Material {
        key: Arc::new(key),
        client_verifier,
        raw,
    })
}

/// Checks that `files` hold a usable certificate, key and (if named) client CA.
pub fn check_server(files: &ServerFiles) -> Result<(), TlsError> {
    load(files).map(|_| ())
}

/// A listener's TLS material, re-readable: after [`ServerTls::reload`] new connections get the
/// new certificate (and client CA); open ones carry on.
#[derive(Clone)]
pub struct ServerTls {
    files: ServerFiles,
    /// Names the listener in log lines (`api`, `envoy`).
    name: &'static str,
    current: Arc<ArcSwap<Material>>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("name", &self.name)
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Reads `files` for the listener `name`.
    pub fn load(name: &'static str, files: ServerFiles) -> Result<Self, TlsError> {
        let m = load(&files)?;
        Ok(Self {
            files,
            name,
            current: Arc::new(ArcSwap::from_pointee(m)),
        })
    }

    /// Reads the files again; new material is used by new connections from now on.
    pub fn reload(&self) -> Reload {
        let next = match load(&self.files) {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(listener = self.name, error = %e, "TLS files cannot be used: keeping those in use.");
                return Reload::Kept(e.to_string());
            }
        };
        if next.raw == self.current.load().raw {
            return Reload::Unchanged;
        }
        tracing::info!(listener = self.name, "TLS files reloaded.");
        self.current.store(Arc::new(next));
        Reload::Changed
    }

    /// Reloads every `every` until `stop` resolves.
    pub async fn watch(self, every: Duration, stop: impl Future<Output = ()>) {
        every_until(every, stop, || {
            self.reload();
        })
        .await;
    }

    /// The rustls configuration, offering `alpn` (e.g. `h2` for gRPC).
    pub fn server_config(&self, alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        let dynamic = Arc::new(Dynamic(self.current.clone()));
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("the ring provider supports the default protocol versions");
        let mut cfg = if self.files.client_ca.is_some() {
            builder
                .with_client_cert_verifier(dynamic.clone())
                .with_cert_resolver(dynamic)
        } else {
            builder.with_no_client_auth().with_cert_resolver(dynamic)
        };
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(cfg)
    }

    /// Accepts TLS connections on `listener` with this material (see [`TlsIncoming`]).
    pub fn incoming(&self, listener: TcpListener, alpn: &[&[u8]]) -> std::io::Result<TlsIncoming> {
        TlsIncoming::new(listener, self.server_config(alpn), self.name)
    }
}

/// The current material, read per handshake by rustls.
struct Dynamic(Arc<ArcSwap<Material>>);

impl std::fmt::Debug for Dynamic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerTlsMaterial")
    }
}

impl Dynamic {
    fn verifier(&self) -> Result<Arc<dyn ClientCertVerifier>, rustls::Error> {
        self.0
            .load()
            .client_verifier
            .clone()
            .ok_or_else(|| rustls::Error::General("no client CA configured".into()))
    }
}

impl ResolvesServerCert for Dynamic {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load().key.clone())
    }
}

impl ClientCertVerifier for Dynamic {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.verifier()?
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier()?.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier()?.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.verifier()
            .map(|v| v.supported_verify_schemes())
            .unwrap_or_default()
    }
}

/// TLS connections of one listener, handshaken: an [`axum::serve::Listener`], and a stream
/// for tonic through [`TlsIncoming::next`]. A failed handshake (plain HTTP, a missing or
/// foreign client certificate, a client that goes silent) closes that connection and is
/// logged at debug level. Dropping it stops accepting.
pub struct TlsIncoming {
    accepted: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accept_loop: JoinHandle<()>,
}

impl std::fmt::Debug for TlsIncoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsIncoming")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

impl TlsIncoming {
    /// Accepts on `listener`, handshaking with `config`; `name` labels log lines.
    pub fn new(
        listener: TcpListener,
        config: Arc<rustls::ServerConfig>,
        name: &'static str,
    ) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, accepted) = mpsc::channel(ACCEPTED_QUEUE);
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let accept_loop = tokio::spawn(async move {
            loop {
                let (stream, remote) = match listener.accept().await {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(listener = name, error = %e, "Accept failed.");
                        // Out of file descriptors, most likely: give some a chance to close.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, remote)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(listener = name, remote = %remote, error = %e, "TLS handshake refused.");
                        }
                        Err(_) => {
                            tracing::debug!(listener = name, remote = %remote, "TLS handshake timed out.");
                        }
                    }
                });
            }
        });
        Ok(Self {
            accepted,
            local,
            accept_loop,
        })
    }

    /// The next handshaken connection.
    pub async fn next(&mut self) -> Option<(TlsStream<TcpStream>, SocketAddr)> {
        self.accepted.recv().await
    }
}

impl axum::serve::Listener for TlsIncoming {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(a) => a,
            // The accept loop only ends when this is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}
