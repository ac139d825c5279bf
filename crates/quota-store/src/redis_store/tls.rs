//! TLS material for `rediss://` addresses, checked before redis-rs takes it.

use std::fmt;

use crate::StoreError;

/// TLS material for `rediss://`, PEM-encoded.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Tls {
    /// CA certificates to trust instead of the system's (e.g. a private CA).
    pub ca_pem: Option<Vec<u8>>,
    /// A client certificate chain and its key, for a Redis with `tls-auth-clients yes`.
    pub client: Option<ClientIdentity>,
}

/// A client certificate chain and its private key, PEM-encoded.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("ca_pem", &self.ca_pem.as_ref().map(|_| "<pem>"))
            .field("client", &self.client)
            .finish()
    }
}

impl fmt::Debug for ClientIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientIdentity")
            .field("cert_pem", &"<pem>")
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// One PEM of [`Tls`], to say which one is wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsPart {
    Ca,
    ClientCert,
    ClientKey,
}

impl TlsPart {
    fn name(self) -> &'static str {
        match self {
            Self::Ca => "TLS CA certificates",
            Self::ClientCert => "TLS client certificate",
            Self::ClientKey => "TLS client key",
        }
    }
}

impl Tls {
    /// The first PEM that does not hold what it should, and why: redis-rs would take a CA
    /// file without a certificate as an empty trust store.
    pub fn problem(&self) -> Option<(TlsPart, String)> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = |pem: &[u8]| match CertificateDer::pem_slice_iter(pem)
            .try_fold(0, |n, c| c.map(|_| n + 1))
        {
            Ok(0) => Some("no PEM certificate found".to_string()),
            Ok(_) => None,
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = self.ca_pem.as_deref().and_then(certs) {
            return Some((TlsPart::Ca, why));
        }
        let c = self.client.as_ref()?;
        if let Some(why) = certs(&c.cert_pem) {
            return Some((TlsPart::ClientCert, why));
        }
        // The key's own error would quote nothing of it, but say only that it is bad.
        PrivateKeyDer::from_pem_slice(&c.key_pem)
            .is_err()
            .then(|| (TlsPart::ClientKey, "no PEM private key found".to_string()))
    }

    /// [`problem`](Self::problem) as an error.
    pub fn check(&self) -> Result<(), StoreError> {
        match self.problem() {
            None => Ok(()),
            Some((part, why)) => Err(StoreError::Invalid {
                reason: format!("{}: {why}", part.name()),
            }),
        }
    }

    pub(super) fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self.client.as_ref().map(|c| redis::ClientTlsConfig {
                client_cert: c.cert_pem.clone(),
                client_key: c.key_pem.clone(),
            }),
            root_cert: self.ca_pem.clone(),
        }
    }
}

/// rustls needs one process-wide crypto provider; redis-rs asks for it when it builds a TLS
/// client. Installs ring's unless the process chose one.
pub(super) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race with another installer is fine: one is installed either way.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}
