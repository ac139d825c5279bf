//! Mutual TLS between peers: this node's certificate, key and CA from PEM files, re-read on
//! change; the peer listener's accept loop; region identities from certificates.
//!
//! One [`PeerTls`] serves both sides: the listener presents this node's certificate and
//! requires a client certificate signed by the CA; outbound calls present the same
//! certificate and verify the server against the CA and the address they dialled (IP SANs
//! for IP addresses). The certificate, key and CA live behind one swapped `Arc`, read through
//! by the resolvers and verifiers rustls calls per handshake, so after [`PeerTls::reload`] new
//! connections use the new files and open ones carry on. A file that does not parse is
//! logged and the material in use kept.
//!
//! A peer's identity is the first URI SAN of its certificate (`quotad://region/<id>` by
//! default, or a SPIFFE id); the listener hands it to handlers as a [`PeerIdentity`]
//! extension.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::Router;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use tokio::net::TcpListener;

mod client;
mod listener;

pub use client::PeerHttp;
pub use listener::{check_server, ServerFiles, ServerTls, TlsIncoming};

/// The PEM files of one node's TLS material.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// This node's certificate chain (leaf first).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The CA certificates peers' certificates must chain to.
    pub ca: PathBuf,
}

/// Why TLS material could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("{path} holds no PEM certificate")]
    NoCertificate { path: PathBuf },
    #[error("{path}: the key does not fit the certificate or is not supported: {reason}")]
    Key { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    Ca { path: PathBuf, reason: String },
}

/// The default identity of region `id`: `quotad://region/<id>`.
pub fn region_identity(id: &str) -> String {
    format!("quotad://region/{id}")
}

/// The identity a peer's certificate names: its first URI SAN.
pub fn identity_of(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let san = parsed.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        x509_parser::extensions::GeneralName::URI(uri) => Some((*uri).to_string()),
        _ => None,
    })
}

/// The identity of the peer on a connection of the TLS peer listener (a request extension).
/// `None`: its certificate names no URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity(pub Option<Arc<str>>);

/// What the files held at the last good reading.
struct Material {
    key: Arc<CertifiedKey>,
    client_verifier: Arc<dyn ClientCertVerifier>,
    server_verifier: Arc<WebPkiServerVerifier>,
    /// This node's own identity (its certificate's URI SAN).
    identity: Option<String>,
    /// The files' contents, to tell a change from none.
    raw: Vec<u8>,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::Read {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// A certificate chain and its key, checked to fit; its identity; the files' contents.
fn certified(cert: &Path, key: &Path) -> Result<(CertifiedKey, Option<String>, Vec<u8>), TlsError> {
    let (cert_pem, key_pem) = (read(cert)?, read(key)?);
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|_| TlsError::NoCertificate {
            path: cert.to_path_buf(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: cert.to_path_buf(),
        });
    }
    let key_err = |reason: String| TlsError::Key {
        path: key.to_path_buf(),
        reason,
    };
    let der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| key_err(e.to_string()))?;
    let signing = provider()
        .key_provider
        .load_private_key(der)
        .map_err(|e| key_err(e.to_string()))?;
    let identity = identity_of(&certs[0]);
    let certified = CertifiedKey::new(certs, signing);
    certified.keys_match().map_err(|e| key_err(e.to_string()))?;
    Ok((certified, identity, [cert_pem, key_pem].concat()))
}

/// The CA certificates of `path`; the file's contents.
fn roots(path: &Path) -> Result<(Arc<RootCertStore>, Vec<u8>), TlsError> {
    let ca_pem = read(path)?;
    let ca_err = |reason: String| TlsError::Ca {
        path: path.to_path_buf(),
        reason,
    };
    let mut roots = RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(&ca_pem) {
        let ca = ca.map_err(|e| ca_err(e.to_string()))?;
        roots.add(ca).map_err(|e| ca_err(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(ca_err("holds no PEM certificate".into()));
    }
    Ok((Arc::new(roots), ca_pem))
}

/// A verifier requiring client certificates that chain to `roots`.
fn client_verifier(
    roots: Arc<RootCertStore>,
    ca: &Path,
) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    WebPkiClientVerifier::builder_with_provider(roots, provider())
        .build()
        .map_err(|e| TlsError::Ca {
            path: ca.to_path_buf(),
            reason: e.to_string(),
        })
}

fn load(files: &TlsFiles) -> Result<Material, TlsError> {
    let (certified, identity, mut raw) = certified(&files.cert, &files.key)?;
    let (roots, ca_pem) = roots(&files.ca)?;
    raw.extend_from_slice(&ca_pem);
    let client_verifier = client_verifier(roots.clone(), &files.ca)?;
    let server_verifier = WebPkiServerVerifier::builder_with_provider(roots, provider())
        .build()
        .map_err(|e| TlsError::Ca {
            path: files.ca.clone(),
            reason: e.to_string(),
        })?;
    Ok(Material {
        key: Arc::new(certified),
        client_verifier,
        server_verifier,
        identity,
        raw,
    })
}

/// Checks that `files` hold a usable certificate, key and CA; the certificate's identity.
pub fn check(files: &TlsFiles) -> Result<Option<String>, TlsError> {
    load(files).map(|m| m.identity)
}

/// One node's TLS material, re-readable (see the module documentation).
#[derive(Clone)]
pub struct PeerTls {
    files: TlsFiles,
    current: Arc<ArcSwap<Material>>,
    /// Counts the reloads that took new material ([`PeerHttp`] rebuilds on a change).
    generation: Arc<AtomicU64>,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

/// What [`PeerTls::reload`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Reload {
    Unchanged,
    /// New material, used by new connections.
    Changed,
    /// The files cannot be used; the material in use is kept.
    Kept(String),
}

impl PeerTls {
    /// Reads `files`.
    pub fn load(files: TlsFiles) -> Result<Self, TlsError> {
        let m = load(&files)?;
        Ok(Self {
            files,
            current: Arc::new(ArcSwap::from_pointee(m)),
            generation: Arc::new(AtomicU64::new(0)),
        })
    }

    /// How many reloads took new material.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// This node's identity, from its certificate.
    pub fn identity(&self) -> Option<String> {
        self.current.load().identity.clone()
    }

    /// Reads the files again; new material is used by new connections from now on.
    pub fn reload(&self) -> Reload {
        let next = match load(&self.files) {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(error = %e, "Peer TLS files cannot be used: keeping those in use.");
                return Reload::Kept(e.to_string());
            }
        };
        if next.raw == self.current.load().raw {
            return Reload::Unchanged;
        }
        tracing::info!(identity = ?next.identity, "Peer TLS files reloaded.");
        self.current.store(Arc::new(next));
        self.generation.fetch_add(1, Ordering::Release);
        Reload::Changed
    }

    /// Reloads every `every` until `stop` resolves.
    pub async fn watch(self, every: std::time::Duration, stop: impl Future<Output = ()>) {
        every_until(every, stop, || {
            self.reload();
        })
        .await;
    }
}

/// Runs `f` every `every` (the first time one period from now) until `stop` resolves.
async fn every_until(every: std::time::Duration, stop: impl Future<Output = ()>, f: impl Fn()) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => return,
            _ = tick.tick() => {}
        }
        f();
    }
}

impl PeerTls {
    /// The listener's configuration: this node's certificate, client certificates required.
    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        let dynamic = Arc::new(Dynamic(self.current.clone()));
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("the ring provider supports the default protocol versions")
            .with_client_cert_verifier(dynamic.clone())
            .with_cert_resolver(dynamic);
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(cfg)
    }

    /// Outbound calls' configuration: this node's certificate, servers verified by the CA.
    pub fn client_config(&self) -> rustls::ClientConfig {
        let dynamic = Arc::new(Dynamic(self.current.clone()));
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("the ring provider supports the default protocol versions")
            .dangerous()
            .with_custom_certificate_verifier(dynamic.clone())
            .with_client_cert_resolver(dynamic)
    }

    /// A reqwest client builder set up for this node's outbound peer calls (`https://`).
    pub fn client_builder(&self) -> reqwest::ClientBuilder {
        reqwest::Client::builder()
            .use_preconfigured_tls(self.client_config())
            .https_only(true)
    }
}

/// The current material, read per handshake by rustls.
struct Dynamic(Arc<ArcSwap<Material>>);

impl std::fmt::Debug for Dynamic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerTlsMaterial")
    }
}

impl ResolvesServerCert for Dynamic {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load().key.clone())
    }
}

impl ResolvesClientCert for Dynamic {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load().key.clone())
    }

    fn has_certs(&self) -> bool {
        true
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
        // No hints: every peer presents its one certificate anyway.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.0
            .load()
            .client_verifier
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .load()
            .client_verifier
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .load()
            .client_verifier
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.load().client_verifier.supported_verify_schemes()
    }
}

impl ServerCertVerifier for Dynamic {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0.load().server_verifier.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .load()
            .server_verifier
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .load()
            .server_verifier
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.load().server_verifier.supported_verify_schemes()
    }
}

/// Serves `router` on `listener` over TLS only until `stop` resolves: each connection's
/// handshake must present a client certificate from the CA, and its requests carry the
/// peer's [`PeerIdentity`]. A failed handshake (plain HTTP, another CA, an expired or missing
/// certificate) closes that connection and is logged at debug level.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: PeerTls,
    stop: impl Future<Output = ()>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config());
    tokio::pin!(stop);
    loop {
        let (stream, remote) = tokio::select! {
            () = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "Peer listener accept failed.");
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let acceptor = acceptor.clone();
        let router = router.clone();
        tokio::spawn(async move {
            let stream = match acceptor.accept(stream).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(remote = %remote, error = %e, "Peer TLS handshake refused.");
                    metrics::counter!(crate::telemetry::names::PEER_TLS_HANDSHAKE_FAILURES_TOTAL)
                        .increment(1);
                    return;
                }
            };
            let identity = PeerIdentity(
                stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .and_then(identity_of)
                    .map(Arc::from),
            );
            let service =
                tower::service_fn(move |mut req: axum::http::Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(identity.clone());
                    let mut router = router.clone();
                    async move {
                        tower::Service::call(&mut router, req.map(axum::body::Body::new)).await
                    }
                });
            let served =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(
                        hyper_util::rt::TokioIo::new(stream),
                        hyper_util::service::TowerToHyperService::new(service),
                    )
                    .await;
            if let Err(e) = served {
                tracing::debug!(remote = %remote, error = %e, "Peer connection ended.");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, SanType};

    use super::*;

    fn ca() -> CertifiedIssuer<'static, KeyPair> {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap()
    }

    fn leaf(ca: &CertifiedIssuer<'static, KeyPair>, uri: Option<&str>) -> (String, String) {
        leaf_for(ca, "127.0.0.1", uri)
    }

    /// A certificate for host name or IP `host`.
    fn leaf_for(
        ca: &CertifiedIssuer<'static, KeyPair>,
        host: &str,
        uri: Option<&str>,
    ) -> (String, String) {
        let mut p = CertificateParams::new(vec![host.to_string()]).unwrap();
        if let Some(uri) = uri {
            p.subject_alt_names
                .push(SanType::URI(uri.to_string().try_into().unwrap()));
        }
        let key = KeyPair::generate().unwrap();
        (p.signed_by(&key, ca).unwrap().pem(), key.serialize_pem())
    }

    fn write(
        dir: &Path,
        ca: &CertifiedIssuer<'static, KeyPair>,
        (cert, key): &(String, String),
    ) -> TlsFiles {
        let files = TlsFiles {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
            ca: dir.join("ca.pem"),
        };
        std::fs::write(&files.cert, cert).unwrap();
        std::fs::write(&files.key, key).unwrap();
        std::fs::write(&files.ca, ca.pem()).unwrap();
        files
    }

    #[test]
    fn identities_are_the_first_uri_san() {
        let ca = ca();
        let dir = tempfile::tempdir().unwrap();
        let files = write(
            dir.path(),
            &ca,
            &leaf(&ca, Some("spiffe://example.org/quotad/eu")),
        );
        assert_eq!(
            check(&files).unwrap().as_deref(),
            Some("spiffe://example.org/quotad/eu")
        );
        let files = write(dir.path(), &ca, &leaf(&ca, None));
        assert_eq!(check(&files).unwrap(), None);
        assert_eq!(region_identity("eu"), "quotad://region/eu");
    }

    #[test]
    fn a_reload_takes_new_files_and_keeps_the_old_on_a_bad_one() {
        let ca = ca();
        let dir = tempfile::tempdir().unwrap();
        let files = write(dir.path(), &ca, &leaf(&ca, Some("quotad://region/a")));
        let tls = PeerTls::load(files.clone()).unwrap();
        assert_eq!(tls.reload(), Reload::Unchanged);
        std::fs::write(&files.key, "not a key").unwrap();
        assert!(matches!(tls.reload(), Reload::Kept(_)));
        assert_eq!(tls.identity().as_deref(), Some("quotad://region/a"));
        write(dir.path(), &ca, &leaf(&ca, Some("quotad://region/a2")));
        assert_eq!(tls.reload(), Reload::Changed);
        assert_eq!(tls.identity().as_deref(), Some("quotad://region/a2"));
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let ca = ca();
        let dir = tempfile::tempdir().unwrap();
        let (cert, _) = leaf(&ca, Some("quotad://region/a"));
        let (_, other_key) = leaf(&ca, Some("quotad://region/a"));
        let files = write(dir.path(), &ca, &(cert, other_key));
        assert!(matches!(check(&files), Err(TlsError::Key { .. })));
    }

    /// Serves, over peer TLS with `tls`, a route answering the caller's certificate identity.
    async fn identity_echo(tls: PeerTls) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route(
            "/who",
            axum::routing::get(
                |axum::Extension(PeerIdentity(id)): axum::Extension<PeerIdentity>| async move {
                    id.map(|i| i.to_string()).unwrap_or_default()
                },
            ),
        );
        tokio::spawn(serve(listener, router, tls, std::future::pending()));
        addr
    }

    async fn who(client: &reqwest::Client, url: &str) -> Result<String, reqwest::Error> {
        client
            .get(url)
            .send()
            .await?
            .error_for_status()?
            .text()
            .await
    }

    #[tokio::test]
    async fn after_a_rotation_new_calls_present_the_new_certificate() {
        let ca = ca();
        let (server_dir, client_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let server = PeerTls::load(write(
            server_dir.path(),
            &ca,
            &leaf(&ca, Some("quotad://region/b")),
        ))
        .unwrap();
        let addr = identity_echo(server).await;
        let files = write(
            client_dir.path(),
            &ca,
            &leaf(&ca, Some("quotad://region/a")),
        );
        let tls = PeerTls::load(files).unwrap();
        let http = PeerHttp::new(Some(&tls), |b| b).unwrap();
        let url = format!("https://{addr}/who");
        let before = http.client();
        assert_eq!(who(&before, &url).await.unwrap(), "quotad://region/a");

        write(
            client_dir.path(),
            &ca,
            &leaf(&ca, Some("quotad://region/a2")),
        );
        assert_eq!(tls.reload(), Reload::Changed);
        // The client in use before keeps its pooled connection, and the old certificate...
        assert_eq!(who(&before, &url).await.unwrap(), "quotad://region/a");
        // ...while the next call gets a new client, which handshakes with the new one.
        assert_eq!(
            who(&http.client(), &url).await.unwrap(),
            "quotad://region/a2"
        );
        assert_eq!(
            who(&http.client(), &url).await.unwrap(),
            "quotad://region/a2"
        );
    }

    #[tokio::test]
    async fn host_names_are_verified_against_dns_sans() {
        let ca = ca();
        let dir = tempfile::tempdir().unwrap();
        // One certificate for both ends, naming the host `localhost` and no IP address.
        let tls = PeerTls::load(write(
            dir.path(),
            &ca,
            &leaf_for(&ca, "localhost", Some("quotad://region/a")),
        ))
        .unwrap();
        let addr = identity_echo(tls.clone()).await;
        let http = PeerHttp::new(Some(&tls), |b| b).unwrap();
        let by_name = format!("https://localhost:{}/who", addr.port());
        assert_eq!(
            who(&http.client(), &by_name).await.unwrap(),
            "quotad://region/a"
        );
        // Dialled by IP address, the certificate (no IP SAN) does not name the server.
        let by_ip = format!("https://{addr}/who");
        let refused = who(&http.client(), &by_ip).await;
        assert!(refused.is_err(), "{refused:?}");
    }
}
