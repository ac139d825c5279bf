//! TLS on the API and Envoy listeners, with a PKI generated per test (rcgen): HTTPS answers and
//! plain HTTP to the TLS port does not; rotated files reach new connections and a broken file
//! is kept out; with a client CA, a missing or foreign client certificate is refused; Envoy's
//! gRPC services answer over TLS (tonic client), and an RLQS stream needs the client certificate.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use quotad_system_tests::{eventually, free_port, Daemon, TOKEN};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::json;

struct Ca(CertifiedIssuer<'static, KeyPair>);

impl Ca {
    fn new(name: &str) -> Self {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(DnType::CommonName, format!("{name} CA"));
        Self(CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap())
    }

    /// A certificate and key for `127.0.0.1`, for `purpose` (server or client auth).
    fn leaf(&self, purpose: ExtendedKeyUsagePurpose) -> (String, String) {
        let mut p = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        p.extended_key_usages = vec![purpose];
        let key = KeyPair::generate().unwrap();
        (
            p.signed_by(&key, &self.0).unwrap().pem(),
            key.serialize_pem(),
        )
    }
}

/// Writes `text` to `path` through a rename, as cert-manager's atomic writer does.
fn put(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A rustls client trusting `ca_pem`, presenting `client` (cert, key PEM) if given.
fn client_config(ca_pem: &str, client: Option<&(String, String)>) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let b = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    match client {
        None => b.with_no_client_auth(),
        Some((cert, key)) => {
            let certs = CertificateDer::pem_slice_iter(cert.as_bytes())
                .map(Result::unwrap)
                .collect();
            let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
            b.with_client_auth_cert(certs, key).unwrap()
        }
    }
}

fn https(cfg: rustls::ClientConfig) -> reqwest::Client {
    reqwest::Client::builder()
        .use_preconfigured_tls(cfg)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// The status of `GET /readyz` on `port` over HTTPS with `client`, or the error.
async fn readyz(client: &reqwest::Client, port: u16) -> Result<u16, String> {
    client
        .get(format!("https://127.0.0.1:{port}/readyz"))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| format!("{e:?}"))
}

/// Spawns quotad with `config` and waits until `/readyz` answers 200 over HTTPS.
async fn start(config: &str, port: u16, client: &reqwest::Client) -> Daemon {
    let d = Daemon::spawn(config, port, &[]).unwrap();
    let ready = eventually(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async { (readyz(client, port).await == Ok(200)).then_some(()) },
    )
    .await;
    assert!(ready.is_some(), "not ready over TLS: {}", d.log_text());
    d
}

/// The first certificate the listener on `port` presents to a fresh connection.
async fn presented_cert(ca_pem: &str, port: u16) -> Vec<u8> {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_config(ca_pem, None)));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let tls = connector
        .connect(
            ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()),
            tcp,
        )
        .await
        .unwrap();
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

fn der(pem: &str) -> Vec<u8> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .unwrap()
        .unwrap()
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_and_envoy_serve_tls_and_take_rotated_certificates() {
    let pki = tempfile::tempdir().unwrap();
    let ca = Ca::new("api");
    let ca_pem = ca.0.pem();
    let (cert, key) = (pki.path().join("api.pem"), pki.path().join("api-key.pem"));
    let first = ca.leaf(ExtendedKeyUsagePurpose::ServerAuth);
    put(&cert, &first.0);
    put(&key, &first.1);
    let (api, envoy) = (free_port().unwrap(), free_port().unwrap());
    let (c, k) = (cert.display(), key.display());
    let config = format!(
        r#"region = "eu"
[api]
listen = "127.0.0.1:{api}"
tls_cert_file = "{c}"
tls_key_file = "{k}"
tls_check_ms = 200
[envoy]
listen = "127.0.0.1:{envoy}"
tls_cert_file = "{c}"
tls_key_file = "{k}"
"#
    );
    let client = https(client_config(&ca_pem, None));
    let d = start(&config, api, &client).await;

    // HTTPS: a policy written and checked.
    let r = client
        .put(format!(
            "https://127.0.0.1:{api}/v1/tenants/acme/policies/writes"
        ))
        .bearer_auth(TOKEN)
        .json(&json!({"limit": 5, "window_ms": 60000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let r = client
        .post(format!("https://127.0.0.1:{api}/v1/check"))
        .json(&json!({"tenant": "acme", "policy": "writes", "cost": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["remaining"], 4, "{body}");

    // Plain HTTP to the TLS port gets no answer.
    let plain = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{api}/readyz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.is_err(), "plain HTTP was answered: {plain:?}");

    // Envoy's gRPC service over TLS, in the same bucket.
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(&ca_pem))
        .domain_name("127.0.0.1");
    let channel = tonic::transport::Channel::from_shared(format!("https://127.0.0.1:{envoy}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let entry = |k: &str, v: &str| Entry {
        key: k.into(),
        value: v.into(),
    };
    let answer = RateLimitServiceClient::new(channel)
        .should_rate_limit(RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![entry("tenant", "acme"), entry("policy", "writes")],
                ..RateLimitDescriptor::default()
            }],
            hits_addend: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.overall_code, Code::Ok as i32);
    assert_eq!(answer.statuses[0].limit_remaining, 3);
    // A plain-text gRPC client is refused.
    let plain = RateLimitServiceClient::connect(format!("http://127.0.0.1:{envoy}")).await;
    let refused = match plain {
        Err(_) => true,
        Ok(mut c) => c
            .should_rate_limit(RateLimitRequest::default())
            .await
            .is_err(),
    };
    assert!(refused, "plain-text gRPC was answered");

    // Rotation: a broken file is kept out, a new certificate reaches new connections.
    assert_eq!(presented_cert(&ca_pem, api).await, der(&first.0));
    put(&cert, "not a certificate");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        presented_cert(&ca_pem, api).await,
        der(&first.0),
        "a broken file was taken"
    );
    let next = ca.leaf(ExtendedKeyUsagePurpose::ServerAuth);
    put(&key, &next.1);
    put(&cert, &next.0);
    let started = std::time::Instant::now();
    let rotated = eventually(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async { (presented_cert(&ca_pem, api).await == der(&next.0)).then_some(()) },
    )
    .await;
    assert!(
        rotated.is_some(),
        "the API still presents its old certificate"
    );
    eprintln!(
        "new API certificate presented after {:?}",
        started.elapsed()
    );
    assert_eq!(readyz(&client, api).await, Ok(200));
    assert!(d.log_text().contains("TLS files cannot be used"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_ca_refuses_missing_and_foreign_client_certificates() {
    let pki = tempfile::tempdir().unwrap();
    let (server_ca, client_ca, other_ca) = (Ca::new("api"), Ca::new("gateways"), Ca::new("other"));
    let server = server_ca.leaf(ExtendedKeyUsagePurpose::ServerAuth);
    let path = |name: &str| pki.path().join(name);
    put(&path("api.pem"), &server.0);
    put(&path("api-key.pem"), &server.1);
    put(&path("clients.pem"), &client_ca.0.pem());
    let api = free_port().unwrap();
    let config = format!(
        r#"region = "eu"
[api]
listen = "127.0.0.1:{api}"
tls_cert_file = "{}"
tls_key_file = "{}"
tls_client_ca_file = "{}"
"#,
        path("api.pem").display(),
        path("api-key.pem").display(),
        path("clients.pem").display(),
    );
    let ca_pem = server_ca.0.pem();
    let gateway = client_ca.leaf(ExtendedKeyUsagePurpose::ClientAuth);
    let client = https(client_config(&ca_pem, Some(&gateway)));
    let _d = start(&config, api, &client).await;
    assert_eq!(readyz(&client, api).await, Ok(200));

    let foreign = other_ca.leaf(ExtendedKeyUsagePurpose::ClientAuth);
    for (what, cert) in [("none", None), ("another CA", Some(&foreign))] {
        let r = readyz(&https(client_config(&ca_pem, cert)), api).await;
        assert!(
            r.is_err(),
            "a client certificate ({what}) was accepted: {r:?}"
        );
    }
}

/// Envoy's rate limit quota service behind a client CA: a stream from a client without a
/// certificate never opens; one with the gateways' certificate gets its assignment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rlqs_streams_need_a_client_certificate_when_the_envoy_listener_asks_for_one() {
    use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
        BucketId, RateLimitQuotaUsageReports,
    };

    let pki = tempfile::tempdir().unwrap();
    let (server_ca, client_ca) = (Ca::new("api"), Ca::new("gateways"));
    let server = server_ca.leaf(ExtendedKeyUsagePurpose::ServerAuth);
    let path = |name: &str| pki.path().join(name);
    put(&path("api.pem"), &server.0);
    put(&path("api-key.pem"), &server.1);
    put(&path("clients.pem"), &client_ca.0.pem());
    let (api, envoy) = (free_port().unwrap(), free_port().unwrap());
    let (c, k, ca) = (
        path("api.pem").display().to_string(),
        path("api-key.pem").display().to_string(),
        path("clients.pem").display().to_string(),
    );
    let config = format!(
        r#"region = "eu"
[api]
listen = "127.0.0.1:{api}"
tls_cert_file = "{c}"
tls_key_file = "{k}"
[envoy]
listen = "127.0.0.1:{envoy}"
tls_cert_file = "{c}"
tls_key_file = "{k}"
tls_client_ca_file = "{ca}"
"#
    );
    let ca_pem = server_ca.0.pem();
    let client = https(client_config(&ca_pem, None));
    let _d = start(&config, api, &client).await;
    let r = client
        .put(format!(
            "https://127.0.0.1:{api}/v1/tenants/acme/policies/writes"
        ))
        .bearer_auth(TOKEN)
        .json(&json!({"limit": 600, "window_ms": 60000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());

    let report = || RateLimitQuotaUsageReports {
        domain: "writes".into(),
        bucket_quota_usages: vec![BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: [("tenant".to_string(), "acme".to_string())].into(),
            }),
            time_elapsed: None,
            num_requests_allowed: 1,
            num_requests_denied: 0,
        }],
    };
    let stream = |identity: Option<(String, String)>| {
        let ca_pem = ca_pem.clone();
        async move {
            let mut tls = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(&ca_pem))
                .domain_name("127.0.0.1");
            if let Some((cert, key)) = identity {
                tls = tls.identity(tonic::transport::Identity::from_pem(cert, key));
            }
            let channel =
                tonic::transport::Channel::from_shared(format!("https://127.0.0.1:{envoy}"))
                    .unwrap()
                    .tls_config(tls)
                    .unwrap()
                    .connect_timeout(Duration::from_secs(5))
                    .connect()
                    .await
                    .map_err(|e| e.to_string())?;
            let mut answers = RateLimitQuotaServiceClient::new(channel)
                .stream_rate_limit_quotas(futures::StreamExt::chain(
                    futures::stream::iter([report()]),
                    futures::stream::pending(),
                ))
                .await
                .map_err(|e| e.to_string())?
                .into_inner();
            tokio::time::timeout(Duration::from_secs(5), answers.message())
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "no answer".to_string())
        }
    };
    let refused = stream(None).await;
    assert!(
        refused.is_err(),
        "a stream without a client certificate: {refused:?}"
    );
    let gateway = client_ca.leaf(ExtendedKeyUsagePurpose::ClientAuth);
    let answer = stream(Some(gateway)).await.unwrap();
    let Some(Action::QuotaAssignmentAction(a)) = &answer.bucket_action[0].bucket_action else {
        panic!("not an assignment: {answer:?}");
    };
    // 600 a minute is 10 a second, the whole budget in a single region.
    let Some(Strategy::TokenBucket(b)) = a.rate_limit_strategy.unwrap().strategy else {
        panic!("not a token bucket: {a:?}");
    };
    assert_eq!(b.tokens_per_fill.map(|t| t.value), Some(10));
}
