//! A throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1 and localhost, and
//! a client certificate, written as PEM files into a directory the test owns.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

use crate::{HarnessError, TlsFiles};

/// The PEM files of one generated PKI.
#[derive(Debug, Clone)]
pub struct TestPki {
    pub ca_cert: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl TestPki {
    /// Generates a fresh CA (named `name`) with a server and a client certificate into `dir`.
    pub fn generate(dir: &Path, name: &str) -> Result<Self, HarnessError> {
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;

        let leaf = |sans: Vec<String>, usage: ExtendedKeyUsagePurpose, cn: &str| {
            let mut p = CertificateParams::new(sans)?;
            p.distinguished_name.push(DnType::CommonName, cn);
            p.extended_key_usages = vec![usage];
            let key = KeyPair::generate()?;
            let cert = p.signed_by(&key, &ca)?;
            Ok::<_, HarnessError>((cert.pem(), key.serialize_pem()))
        };
        let (server_cert, server_key) = leaf(
            vec!["127.0.0.1".into(), "localhost".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
            "redis-server",
        )?;
        let (client_cert, client_key) =
            leaf(Vec::new(), ExtendedKeyUsagePurpose::ClientAuth, "quotad")?;

        let write = |file: &str, pem: &str| {
            let path = dir.join(file);
            std::fs::write(&path, pem).map_err(crate::io("write a test certificate"))?;
            Ok::<_, HarnessError>(path)
        };
        Ok(Self {
            ca_cert: write("ca.pem", &ca.pem())?,
            server_cert: write("server.pem", &server_cert)?,
            server_key: write("server-key.pem", &server_key)?,
            client_cert: write("client.pem", &client_cert)?,
            client_key: write("client-key.pem", &client_key)?,
        })
    }

    /// `redis-server` arguments that make a server present the client certificate on its own
    /// outgoing connections (replication, the cluster bus, a sentinel's), where clients must
    /// present one (the server certificate is not meant for client authentication).
    pub fn client_cert_args(&self) -> Vec<String> {
        vec![
            "--tls-client-cert-file".into(),
            self.client_cert.display().to_string(),
            "--tls-client-key-file".into(),
            self.client_key.display().to_string(),
        ]
    }

    /// The server side of this PKI, for [`crate::RedisServer::start_tls`].
    pub fn server_files(&self, require_client_cert: bool) -> TlsFiles {
        TlsFiles {
            cert: self.server_cert.clone(),
            key: self.server_key.clone(),
            ca: self.ca_cert.clone(),
            require_client_cert,
        }
    }
}
