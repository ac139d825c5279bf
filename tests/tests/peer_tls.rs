//! Three regions over peer mutual TLS, with a PKI generated per test (rcgen): the cluster
//! elects, rebalances and forwards a pinned tenant's checks over the peer channel; the peer
//! port refuses plain HTTP, certificates of another CA, expired ones and connections without
//! one; region b's certificate reporting usage, or forwarding a check, as c gets 403 and is
//! counted; rotated files are used by new connections, pooled outbound ones included, while
//! the cluster stays healthy.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use quotad_system_tests::{eventually, free_port, metric_value, Daemon, PEER_TOKEN, TOKEN};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::json;

const NAMES: [&str; 3] = ["a", "b", "c"];

struct Ca(CertifiedIssuer<'static, KeyPair>);

impl Ca {
    fn new(name: &str) -> Self {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(DnType::CommonName, format!("{name} CA"));
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        Self(CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap())
    }

    /// A region's certificate and key: IP SAN 127.0.0.1, URI SAN `quotad://region/<id>`, for
    /// both ends of a connection.
    fn region(&self, id: &str, expired: bool) -> (String, String) {
        let mut p = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        p.subject_alt_names.push(SanType::URI(
            format!("quotad://region/{id}").try_into().unwrap(),
        ));
        p.distinguished_name
            .push(DnType::CommonName, format!("quotad {id}"));
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        if expired {
            p.not_before = rcgen::date_time_ymd(2020, 1, 1);
            p.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.0).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn pem(&self) -> String {
        self.0.pem()
    }
}

/// Writes region `id`'s files into `dir`: `<id>.pem`, `<id>-key.pem`.
fn write_region(dir: &Path, id: &str, (cert, key): &(String, String)) -> (PathBuf, PathBuf) {
    let (c, k) = (
        dir.join(format!("{id}.pem")),
        dir.join(format!("{id}-key.pem")),
    );
    // Written to a temporary name and renamed, as cert-manager's atomic writer does.
    for (path, text) in [(&c, cert), (&k, key)] {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }
    (c, k)
}

struct TlsCluster {
    daemons: Vec<Daemon>,
    peers: Vec<SocketAddr>,
    pki: tempfile::TempDir,
    ca: Ca,
}

impl TlsCluster {
    async fn start() -> Self {
        let pki = tempfile::tempdir().unwrap();
        let ca = Ca::new("cluster");
        std::fs::write(pki.path().join("ca.pem"), ca.pem()).unwrap();
        let api: Vec<u16> = NAMES.iter().map(|_| free_port().unwrap()).collect();
        let peer: Vec<u16> = NAMES.iter().map(|_| free_port().unwrap()).collect();
        let mut members = String::new();
        for (i, n) in NAMES.iter().enumerate() {
            write_region(pki.path(), n, &ca.region(n, false));
            members.push_str(&format!(
                "[[regions]]\nid = \"{n}\"\nnode_id = {}\napi = \"127.0.0.1:{}\"\npeer = \"127.0.0.1:{}\"\n\n",
                i + 1,
                api[i],
                peer[i]
            ));
        }
        let mut daemons = Vec::new();
        for (i, n) in NAMES.iter().enumerate() {
            let dir = pki.path().display();
            let config = format!(
                r#"region = "{n}"
[api]
listen = "127.0.0.1:{api}"
forward_timeout_ms = 300
# Forwarded checks need no check token: they come over the peer listener, authenticated by
# the sending region's certificate (a forward to the API port would get 401).
open_checks = false
[peer]
listen = "127.0.0.1:{peer}"
tls_cert_file = "{dir}/{n}.pem"
tls_key_file = "{dir}/{n}-key.pem"
tls_ca_file = "{dir}/ca.pem"
tls_check_ms = 200
[coordination]
report_interval_ms = 200
rebalance_interval_ms = 400
lease_ms = 3000
drift_margin_ms = 300
[raft]
heartbeat_interval_ms = 100
election_timeout_min_ms = 400
election_timeout_max_ms = 800
write_timeout_ms = 1500

{members}"#,
                api = api[i],
                peer = peer[i],
            );
            daemons.push(
                Daemon::spawn(&config, api[i], &[("QUOTAD_PEER_TOKEN", PEER_TOKEN)]).unwrap(),
            );
        }
        for d in &mut daemons {
            d.wait_ready(Duration::from_secs(30))
                .await
                .unwrap_or_else(|e| panic!("{e:#}: {}", d.log_text()));
        }
        let c = Self {
            daemons,
            peers: peer
                .iter()
                .map(|p| SocketAddr::from(([127, 0, 0, 1], *p)))
                .collect(),
            pki,
            ca,
        };
        c.wait_healthy().await;
        c
    }

    /// A leader known to every region, and every region holding a lease.
    async fn wait_healthy(&self) {
        for d in &self.daemons {
            let ok = eventually(
                Duration::from_secs(20),
                Duration::from_millis(100),
                || async {
                    let s = d.get("/v1/status").await.ok()?;
                    s.body["raft"]["leader"].as_str()?;
                    (s.body["lease"]["remaining_ms"].as_u64()? > 0).then_some(())
                },
            )
            .await;
            assert!(ok.is_some(), "not healthy: {}", d.log_text());
        }
    }

    fn region_files(&self, id: &str) -> (PathBuf, PathBuf) {
        (
            self.pki.path().join(format!("{id}.pem")),
            self.pki.path().join(format!("{id}-key.pem")),
        )
    }
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

/// POSTs a usage report claiming `region` to `peer` over TLS with `cfg`; the status, or the
/// error when the connection is refused.
async fn report(cfg: rustls::ClientConfig, peer: SocketAddr, region: &str) -> Result<u16, String> {
    let client = reqwest::Client::builder()
        .use_preconfigured_tls(cfg)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let body = json!({"region": region, "interval_ms": 200, "usage": []});
    client
        .post(format!("https://{peer}/quotad/v1/usage"))
        .bearer_auth(PEER_TOKEN)
        .json(&body)
        .send()
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| format!("{e:?}"))
}

/// The certificate `peer` presents to a fresh connection.
async fn presented_cert(ca_pem: &str, client: &(String, String), peer: SocketAddr) -> Vec<u8> {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_config(ca_pem, Some(client))));
    let tcp = tokio::net::TcpStream::connect(peer).await.unwrap();
    let tls = connector
        .connect(ServerName::IpAddress(peer.ip().into()), tcp)
        .await
        .unwrap();
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

async fn metrics_of(d: &Daemon) -> String {
    d.get_text("/metrics").await.unwrap().1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_regions_over_mutual_tls() {
    let c = TlsCluster::start().await;

    // Rebalancing: a policy reaches every region, each enforcing a share of it.
    c.daemons[0]
        .put_policy("acme", "writes", json!({"limit": 600, "window_ms": 60000}))
        .await
        .unwrap();
    for d in &c.daemons {
        let share = eventually(
            Duration::from_secs(15),
            Duration::from_millis(100),
            || async {
                let r = d.get("/v1/tenants/acme/allowance").await.ok()?;
                let s = r.body["policies"][0]["this_region"]["share"].as_f64()?;
                (s > 0.0 && s < 1.0).then_some(s)
            },
        )
        .await;
        assert!(share.is_some(), "no share: {}", d.log_text());
    }

    // A pinned tenant's checks at a are forwarded to its home b.
    c.daemons[0]
        .put_policy(
            "pinned",
            "writes",
            json!({"limit": 100, "window_ms": 60000}),
        )
        .await
        .unwrap();
    let r = c.daemons[0]
        .request(
            "PUT",
            "/v1/tenants/pinned/pin",
            Some(TOKEN),
            Some(json!({"region": "b"}).to_string()),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    let check = json!({"tenant": "pinned", "policy": "writes", "cost": 1}).to_string();
    let forwarded = eventually(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let r = c.daemons[0]
                .request("POST", "/v1/check", Some(TOKEN), Some(check.clone()))
                .await
                .ok()?;
            if r.body["mode"] != "forwarded" {
                return None;
            }
            assert_eq!(r.body["decided_by"], "b", "{}", r.body);
            let m = metrics_of(&c.daemons[0]).await;
            metric_value(
                &m,
                "quotad_decisions_total",
                &[
                    ("policy", "writes"),
                    ("region", "a"),
                    ("outcome", "forwarded"),
                ],
            )
            .filter(|v| *v >= 1.0)
        },
    )
    .await;
    assert!(forwarded.is_some(), "{}", metrics_of(&c.daemons[0]).await);

    let ca_pem = c.ca.pem();
    let peer_b = c.peers[1];

    // Plain HTTP to the TLS peer port fails.
    let plain = reqwest::Client::new()
        .post(format!("http://{peer_b}/quotad/v1/usage"))
        .bearer_auth(PEER_TOKEN)
        .body("{}")
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.is_err(), "plain HTTP was answered: {plain:?}");

    // Another CA's certificate, an expired one, and none at all are refused at the handshake.
    let other = Ca::new("other").region("b", false);
    let expired = c.ca.region("b", true);
    for (what, client) in [
        ("another CA", Some(&other)),
        ("expired", Some(&expired)),
        ("none", None),
    ] {
        let r = report(client_config(&ca_pem, client), peer_b, "b").await;
        assert!(
            r.is_err(),
            "a client certificate ({what}) was accepted: {r:?}"
        );
    }

    // Region b's certificate is b: reporting as b passes, as c is refused and counted.
    let (b_cert, b_key) = c.region_files("b");
    let b = (
        std::fs::read_to_string(b_cert).unwrap(),
        std::fs::read_to_string(b_key).unwrap(),
    );
    let as_b = report(client_config(&ca_pem, Some(&b)), peer_b, "b")
        .await
        .unwrap();
    assert!(as_b == 204 || as_b == 421, "as b: {as_b}");
    let refused = |m: &str| {
        metric_value(
            m,
            "quotad_peer_identity_refused_total",
            &[("route", "/quotad/v1/usage")],
        )
        .unwrap_or(0.0)
    };
    // A certificate of the cluster's CA for a region that is no member: refused at every route.
    let stranger = c.ca.region("z", false);
    let as_z = report(client_config(&ca_pem, Some(&stranger)), peer_b, "z")
        .await
        .unwrap();
    assert_eq!(as_z, 403);
    let before = refused(&metrics_of(&c.daemons[1]).await);
    let as_c = report(client_config(&ca_pem, Some(&b)), peer_b, "c")
        .await
        .unwrap();
    assert_eq!(as_c, 403);
    assert_eq!(refused(&metrics_of(&c.daemons[1]).await), before + 1.0);

    // The forward route on b's peer port: a's certificate forwarding as a is decided in b;
    // as c it is refused and counted; without the peer token, 401; plain HTTP, no answer.
    let (a_cert, a_key) = c.region_files("a");
    let a = (
        std::fs::read_to_string(a_cert).unwrap(),
        std::fs::read_to_string(a_key).unwrap(),
    );
    let forward_refused = |m: &str| {
        metric_value(
            m,
            "quotad_peer_identity_refused_total",
            &[("route", "/quotad/v1/check")],
        )
        .unwrap_or(0.0)
    };
    let as_a = forward(client_config(&ca_pem, Some(&a)), peer_b, Some("a"), true)
        .await
        .unwrap();
    assert_eq!(as_a.0, 200, "{}", as_a.1);
    assert_eq!(as_a.1["decided_by"], "b", "{}", as_a.1);
    assert_eq!(
        as_a.1["mode"], "normal",
        "decided at home, not forwarded again"
    );
    let before = forward_refused(&metrics_of(&c.daemons[1]).await);
    let as_c = forward(client_config(&ca_pem, Some(&a)), peer_b, Some("c"), true)
        .await
        .unwrap();
    assert_eq!(as_c.0, 403);
    let unnamed = forward(client_config(&ca_pem, Some(&a)), peer_b, None, true)
        .await
        .unwrap();
    assert_eq!(unnamed.0, 403);
    assert_eq!(
        forward_refused(&metrics_of(&c.daemons[1]).await),
        before + 2.0
    );
    let no_token = forward(client_config(&ca_pem, Some(&a)), peer_b, Some("a"), false)
        .await
        .unwrap();
    assert_eq!(no_token.0, 401);
    let plain = reqwest::Client::new()
        .post(format!("http://{peer_b}/quotad/v1/check"))
        .header("x-quotad-forwarded", PEER_TOKEN)
        .body(check.clone())
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.is_err(), "plain HTTP was answered: {plain:?}");

    // Rotation: new files for a; new connections get the new certificate, the cluster stays
    // healthy. A file that does not parse is kept out.
    let peer_a = c.peers[0];
    let old = presented_cert(&ca_pem, &b, peer_a).await;
    let (a_cert, _) = c.region_files("a");
    std::fs::write(&a_cert, "not a certificate").unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        presented_cert(&ca_pem, &b, peer_a).await,
        old,
        "a broken file was taken"
    );
    let fresh = c.ca.region("a", false);
    write_region(c.pki.path(), "a", &fresh);
    let new_der = CertificateDer::pem_slice_iter(fresh.0.as_bytes())
        .next()
        .unwrap()
        .unwrap()
        .to_vec();
    let rotated = eventually(
        Duration::from_secs(5),
        Duration::from_millis(100),
        || async { (presented_cert(&ca_pem, &b, peer_a).await == new_der).then_some(()) },
    )
    .await;
    assert!(rotated.is_some(), "a still presents its old certificate");
    assert!(c.daemons[0]
        .log_text()
        .contains("Peer TLS files cannot be used"));
    c.daemons[1]
        .put_policy("acme", "reads", json!({"limit": 10, "window_ms": 1000}))
        .await
        .unwrap();
    c.wait_healthy().await;

    // a's outbound calls after a rotation: a's files now name no member, and the others must
    // see it (refusing a with 403) within tls_check_ms (200 ms) plus one peer request
    // timeout. (That a client from before the rotation keeps its pooled connection, and the
    // rebuilt one does not, is quota-raft's tls test
    // `after_a_rotation_new_calls_present_the_new_certificate`.)
    let refused_a = || async {
        let mut n = 0.0;
        for d in &c.daemons[1..] {
            n += total(&metrics_of(d).await, "quotad_peer_identity_refused_total");
        }
        n
    };
    let before = refused_a().await;
    let started = std::time::Instant::now();
    write_region(c.pki.path(), "a", &c.ca.region("not-a-member", false));
    let seen = eventually(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async { (refused_a().await > before).then_some(()) },
    )
    .await;
    assert!(
        seen.is_some(),
        "a's pooled connections kept the old certificate: {}",
        c.daemons[0].log_text()
    );
    eprintln!(
        "a's outbound connections presented the new certificate after {:?}",
        started.elapsed()
    );
    write_region(c.pki.path(), "a", &c.ca.region("a", false));
    c.wait_healthy().await;
}

/// The sum of every sample of `name`.
fn total(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// POSTs a check of the pinned tenant to `peer`'s forward route over TLS with `cfg`, naming
/// `from` as the forwarding region, with the peer token when `token`; the status and body.
async fn forward(
    cfg: rustls::ClientConfig,
    peer: SocketAddr,
    from: Option<&str>,
    token: bool,
) -> Result<(u16, serde_json::Value), String> {
    let client = reqwest::Client::builder()
        .use_preconfigured_tls(cfg)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut req = client
        .post(format!("https://{peer}/quotad/v1/check"))
        .json(&json!({"tenant": "pinned", "policy": "writes", "cost": 1}));
    if token {
        req = req.header("x-quotad-forwarded", PEER_TOKEN);
    }
    if let Some(from) = from {
        req = req.header("x-quotad-forwarded-from", from);
    }
    let r = req.send().await.map_err(|e| format!("{e:?}"))?;
    let status = r.status().as_u16();
    let body = r.json().await.unwrap_or(serde_json::Value::Null);
    Ok((status, body))
}
