//! The packaging agrees with the daemon: every config the image, `deploy/compose.yaml` and the
//! Kubernetes ConfigMaps hand to quotad passes `quotad check-config` with the environment each
//! daemon gets, each daemon finds its own `[[regions]]` entry by its name (a Compose service's,
//! a StatefulSet pod's), every daemon is where those files put it, and the image's health
//! check follows `/readyz`.
//!
//! The Kubernetes daemons talk over mutual TLS with certificates from cert-manager. The test
//! stands in for cert-manager: from the manifests' CA Issuers and Certificates it makes the
//! Secrets each StatefulSet mounts (rcgen), so check-config reads real files, and checks that
//! each region's certificate names its identity and, as rustls' WebPKI verifier sees it, the
//! DNS name of each of its pods that the other daemons dial.
//!
//! The manifests are read as text, not through a YAML parser: each ConfigMap holds its TOML as
//! one literal block, and the few facts checked (mounts, variable names, addresses, a
//! Certificate's names and usages) sit on lines of their own. Kubernetes keeps plain manifests
//! (`kubectl apply -k` with no generator), so scripts/check-packaging.sh, run by `.ci/run`,
//! validates exactly what is applied.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read as _, Write as _};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use quotad_system_tests::{embedded_config, quotad_binary, Daemon};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The image's `ENV` settings (`KEY=value` pairs, continued over `\` lines).
fn image_env() -> Vec<(String, String)> {
    let text = read(&repo().join("Dockerfile")).replace("\\\n", " ");
    let env: Vec<_> = text
        .lines()
        .filter_map(|l| l.strip_prefix("ENV "))
        .flat_map(str::split_whitespace)
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert!(
        env.iter().any(|(k, _)| k == "QUOTAD_API_LISTEN"),
        "the image sets its API address: {env:?}"
    );
    env
}

/// A stand-in for a secret the deployment takes from elsewhere (16 bytes or more).
fn stand_in(name: &str) -> String {
    format!("{}-stand-in-0123456789", name.to_lowercase())
}

/// The secrets a Compose file interpolates (`QUOTAD_X: ${…}` lines), as stand-ins.
fn compose_secrets(text: &str) -> Vec<(String, String)> {
    let mut secrets: Vec<_> = text
        .lines()
        .filter_map(|l| l.trim().split_once(": "))
        .filter(|(k, v)| k.starts_with("QUOTAD_") && v.starts_with("${"))
        .map(|(k, _)| (k.to_string(), stand_in(k)))
        .collect();
    secrets.dedup();
    secrets
}

/// A quotad service of the Compose file (a key two spaces in under `services:`).
#[derive(Debug, Default)]
struct ComposeService {
    /// The config it mounts at /etc/quotad/quotad.toml.
    config: Option<PathBuf>,
    /// The `QUOTAD_…` variables it sets to literal values (`QUOTAD_X: value`).
    env: Vec<(String, String)>,
    /// Its other names on the network (`aliases: [...]`).
    aliases: Vec<String>,
}

fn compose_services(compose: &str, deploy: &Path) -> BTreeMap<String, ComposeService> {
    let mut services: BTreeMap<String, ComposeService> = BTreeMap::new();
    let mut current = None;
    for line in compose.lines() {
        let indent = line.len() - line.trim_start().len();
        if !line.trim().is_empty() && indent <= 2 {
            current = (indent == 2)
                .then(|| line.trim().strip_suffix(':'))
                .flatten()
                .filter(|name| name.starts_with("quotad-"))
                .map(str::to_string);
            continue;
        }
        let Some(service) = &current else { continue };
        let entry = services.entry(service.clone()).or_default();
        let line = line.trim();
        if let Some(mount) = line.strip_prefix("- ./") {
            if let Some(file) = mount.strip_suffix(":/etc/quotad/quotad.toml:ro") {
                entry.config = Some(deploy.join(file));
            }
        }
        if let Some((k, v)) = line.split_once(": ") {
            if k.starts_with("QUOTAD_") && !v.starts_with("${") {
                entry.env.push((k.to_string(), v.to_string()));
            }
        }
        if let Some(list) = line.strip_prefix("aliases: [") {
            let list = list.strip_suffix(']').expect("aliases: [a, b]");
            entry.aliases = list.split(',').map(|a| a.trim().to_string()).collect();
        }
    }
    services
}

/// The `QUOTAD_…` variables a container spec sets in pod `pod`: `- name: QUOTAD_X`, then
/// `value: v`, or `valueFrom:` with a Secret's key (given a stand-in) or the pod's name
/// (`fieldRef`, `fieldPath: metadata.name`).
fn kubernetes_env(doc: &str, pod: &str) -> Vec<(String, String)> {
    let lines: Vec<_> = doc.lines().map(str::trim).collect();
    let mut env = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = line
            .strip_prefix("- name: ")
            .filter(|n| n.starts_with("QUOTAD_"))
        else {
            continue;
        };
        let at = |k: usize| lines.get(i + k).copied().unwrap_or_default();
        let value = match (at(1).strip_prefix("value: "), at(2)) {
            (Some(v), _) => v.trim_matches('"').to_string(),
            (None, "secretKeyRef:") => stand_in(name),
            (None, "fieldRef:") => {
                assert_eq!(at(3), "fieldPath: metadata.name", "{name}");
                pod.to_string()
            }
            _ => panic!("{name}: a value, a Secret's key or the pod's name"),
        };
        env.push((name.to_string(), value));
    }
    env
}

/// The effective config `quotad check-config` prints for `file` under `env`; panics with its
/// report when the config is refused.
fn check_config(file: &Path, env: &[(String, String)]) -> String {
    let out = Command::new(quotad_binary().expect("the quotad binary"))
        .arg("check-config")
        .arg(file)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("running quotad check-config");
    assert!(
        out.status.success(),
        "{} does not pass check-config with {:?}:\n{}",
        file.display(),
        env.iter().map(|(k, _)| k).collect::<Vec<_>>(),
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    for (_, value) in env
        .iter()
        .filter(|(k, _)| k.contains("TOKEN") || k.contains("PASSWORD"))
    {
        assert!(!printed.contains(value.as_str()), "a secret printed");
    }
    printed
}

/// `key = "value"` of the effective config's top level.
fn top_level<'a>(printed: &'a str, key: &str) -> &'a str {
    printed
        .lines()
        .take_while(|l| !l.starts_with('['))
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(" = "))
        .map(|v| v.trim_matches('"'))
        .unwrap_or_else(|| panic!("no {key} in {printed}"))
}

/// One `[[regions]]` entry of the effective config: a daemon.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Member {
    id: String,
    node_id: u64,
    api: String,
    peer: String,
}

/// Every `[[regions]]` entry of the effective config.
fn regions(printed: &str) -> Vec<Member> {
    printed
        .split("[[regions]]")
        .skip(1)
        .map(|entry| {
            let field = |key: &str| {
                entry
                    .lines()
                    .find_map(|l| l.strip_prefix(key)?.strip_prefix(" = "))
                    .map(|v| v.trim_matches('"').to_string())
                    .unwrap_or_else(|| panic!("no {key} in [[regions]]{entry}"))
            };
            Member {
                id: field("id"),
                node_id: field("node_id").parse().expect("a node id"),
                api: field("api"),
                peer: field("peer"),
            }
        })
        .collect()
}

/// The daemon `check-config` says this config is: the entry of its `node_id`.
fn this_daemon(printed: &str) -> Member {
    let node: u64 = top_level(printed, "node_id").parse().expect("a node id");
    let me = regions(printed)
        .into_iter()
        .find(|m| m.node_id == node)
        .unwrap_or_else(|| panic!("no [[regions]] entry of node {node}"));
    assert_eq!(me.id, top_level(printed, "region"), "node {node}'s region");
    me
}

/// `(host, port)` of a `host:port` address.
fn host_port(addr: &str) -> (&str, &str) {
    addr.rsplit_once(':')
        .unwrap_or_else(|| panic!("{addr}: host:port"))
}

#[test]
fn the_images_own_config_passes_check_config() {
    let dockerfile = read(&repo().join("Dockerfile"));
    let copied = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("COPY "))
        .find_map(|l| l.strip_suffix(" /etc/quotad/quotad.toml"))
        .expect("the Dockerfile copies a default /etc/quotad/quotad.toml");
    let printed = check_config(&repo().join(copied), &image_env());
    // The image's addresses win over the file's loopback ones.
    assert!(printed.contains("listen = \"0.0.0.0:7450\""), "{printed}");
    assert!(
        printed.contains("data_dir = \"/var/lib/quotad\""),
        "{printed}"
    );
}

#[test]
fn compose_configs_pass_check_config_and_name_each_daemon_by_its_service() {
    let deploy = repo().join("deploy");
    let compose = read(&deploy.join("compose.yaml"));
    let secrets = compose_secrets(&compose);
    assert!(secrets.iter().any(|(k, _)| k == "QUOTAD_PEER_TOKEN"));
    let services = compose_services(&compose, &deploy);
    assert_eq!(
        services.len(),
        6,
        "three regions of two daemons: {services:?}"
    );

    // Each daemon: the region its config serves, and the entry it finds itself by.
    let mut region_of = BTreeMap::new();
    let mut lists = BTreeSet::new();
    for (service, s) in &services {
        let file = s
            .config
            .as_ref()
            .unwrap_or_else(|| panic!("{service} mounts no config"));
        let mut env = image_env();
        env.extend(secrets.iter().cloned());
        env.extend(s.env.iter().cloned());
        assert!(
            s.env
                .iter()
                .any(|(k, v)| k == "QUOTAD_NODE_NAME" && v == service),
            "{service} names itself by its service name: {:?}",
            s.env
        );
        let printed = check_config(file, &env);
        let region = top_level(&printed, "region").to_string();
        assert!(
            service
                .strip_prefix(&format!("quotad-{region}"))
                .is_some_and(|n| n.parse::<u32>().is_ok()),
            "{service} runs {}, region {region}'s config",
            file.display()
        );
        assert!(
            printed.contains(&format!("url = \"redis://redis-{region}:6379\""))
                && compose.contains(&format!("\n  redis-{region}:\n")),
            "{service} uses its region's Redis service"
        );
        assert_eq!(
            s.aliases,
            [format!("quotad-{region}")],
            "{service}: its region's name on the network, for gateways"
        );
        let me = this_daemon(&printed);
        assert_eq!(
            host_port(&me.peer).0,
            service,
            "{service} finds the entry of its own peer address"
        );
        region_of.insert(service.clone(), region);
        lists.insert(regions(&printed));
    }

    // One list of daemons in every config: each daemon once, at its service name.
    assert_eq!(lists.len(), 1, "every region lists the same daemons");
    let members = lists.into_iter().next().unwrap();
    let named: BTreeSet<_> = members
        .iter()
        .map(|m| host_port(&m.peer).0.to_string())
        .collect();
    assert_eq!(
        named,
        services.keys().cloned().collect::<BTreeSet<_>>(),
        "each daemon is one [[regions]] entry"
    );
    for m in &members {
        let (host, port) = host_port(&m.peer);
        assert_eq!(host_port(&m.api), (host, "7450"), "{m:?}");
        assert_eq!(port, "7451", "{m:?}");
        assert_eq!(region_of[host], m.id, "{host} serves region {}", m.id);
    }
    for r in ["a", "b", "c"] {
        assert_eq!(
            members.iter().filter(|m| m.id == r).count(),
            2,
            "region {r}"
        );
    }
}

/// The literal block under `key: |` in one YAML document, dedented.
fn literal_block(doc: &str, key: &str) -> Option<String> {
    let mut lines = doc.lines().skip_while(|l| l.trim() != format!("{key}: |"));
    let indent = lines.next()?.find(key)? + 2;
    let block: Vec<_> = lines
        .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() >= indent)
        .map(|l| l.get(indent..).unwrap_or(""))
        .collect();
    Some(block.join("\n") + "\n")
}

/// `name` of a document's metadata (the first `name:` at two spaces).
fn metadata_name(doc: &str) -> Option<&str> {
    doc.lines().find_map(|l| l.strip_prefix("  name: "))
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The lines nested under the first `key:` line of `doc` (more indented than it).
fn nested(doc: &str, key: &str) -> String {
    let mut lines = doc.lines().skip_while(|l| l.trim() != format!("{key}:"));
    let Some(head) = lines.next() else {
        return String::new();
    };
    let lines: Vec<_> = lines
        .take_while(|l| indent(l) > indent(head) || l.trim().starts_with("- "))
        .collect();
    lines.join("\n")
}

/// The value of the first `key: value` line of `doc`, unquoted.
fn value<'a>(doc: &'a str, key: &str) -> Option<&'a str> {
    doc.lines()
        .find_map(|l| l.trim().strip_prefix(key)?.strip_prefix(": "))
        .map(|v| v.trim_matches('"'))
}

/// The items of the list under `key:`.
fn items(doc: &str, key: &str) -> Vec<String> {
    nested(doc, key)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- "))
        .map(|item| item.trim_matches('"').to_string())
        .collect()
}

/// `key = "value"` of `[section]` in a TOML text.
fn toml_value<'a>(toml: &'a str, section: &str, key: &str) -> Option<&'a str> {
    toml.lines()
        .skip_while(|l| l.trim() != format!("[{section}]"))
        .skip(1)
        .take_while(|l| !l.starts_with('['))
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(" = "))
        .map(|v| v.trim_matches('"'))
}

/// A Go duration in whole hours, as the manifests write cert-manager's (`2160h`).
fn hours(duration: &str) -> u64 {
    duration
        .strip_suffix('h')
        .and_then(|h| h.parse().ok())
        .unwrap_or_else(|| panic!("{duration:?} is not a duration in hours"))
}

/// The `Issuer` a `Certificate` names.
fn issuer_of(cert: &str) -> String {
    let issuer = nested(cert, "issuerRef");
    assert_eq!(value(&issuer, "kind"), Some("Issuer"), "{cert}");
    value(&issuer, "name").expect("issuerRef.name").to_string()
}

/// The resources `kubectl apply -k deploy/kubernetes` applies: `(kind, name, text)` of every
/// document of every file the kustomization lists, and the kustomization's namespace.
fn kubernetes_resources() -> (Vec<(String, String, String)>, String) {
    let dir = repo().join("deploy/kubernetes");
    let kustomization = read(&dir.join("kustomization.yaml"));
    let namespace = value(&kustomization, "namespace")
        .expect("the kustomization sets a namespace")
        .to_string();
    let files = items(&kustomization, "resources");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.starts_with("region-") || name == "pki.yaml" {
            assert!(files.contains(&name), "{name} is applied");
        }
    }
    let mut docs = Vec::new();
    for file in files {
        for doc in read(&dir.join(&file)).split("\n---\n") {
            let kind = value(doc, "kind").unwrap_or_else(|| panic!("{file}: a kind"));
            let name = metadata_name(doc).unwrap_or_else(|| panic!("{file}: a name"));
            docs.push((kind.to_string(), name.to_string(), doc.to_string()));
        }
    }
    (docs, namespace)
}

/// The `Certificate` of `docs` that makes Secret `secret`.
fn certificate_for<'a>(docs: &'a [(String, String, String)], secret: &str) -> &'a str {
    docs.iter()
        .find(|(k, _, d)| k == "Certificate" && value(d, "secretName") == Some(secret))
        .map(|(_, _, doc)| doc.as_str())
        .unwrap_or_else(|| panic!("no Certificate makes the Secret {secret}"))
}

/// Stands in for cert-manager: a CA per CA `Issuer` of the manifests (one whose `ca.secretName`
/// is a CA `Certificate` from a self-signed `Issuer`), and certificates made as a
/// `Certificate`'s spec asks (its DNS names, URIs and usages), as cert-manager writes them into
/// the Certificate's Secret.
struct CertManager<'a> {
    docs: &'a [(String, String, String)],
    cas: BTreeMap<String, CertifiedIssuer<'static, KeyPair>>,
}

impl<'a> CertManager<'a> {
    fn new(docs: &'a [(String, String, String)]) -> Self {
        let get = |kind: &str, name: &str| {
            docs.iter()
                .find(|(k, n, _)| k == kind && n == name)
                .map(|(_, _, doc)| doc.as_str())
                .unwrap_or_else(|| panic!("no {kind} {name}"))
        };
        let mut cas = BTreeMap::new();
        for (_, issuer, doc) in docs.iter().filter(|(k, _, _)| k == "Issuer") {
            if doc.contains("\n  selfSigned: {}") {
                continue;
            }
            let spec = nested(doc, "ca");
            let secret = value(&spec, "secretName")
                .unwrap_or_else(|| panic!("Issuer {issuer}: a self-signed or a CA issuer"));
            let ca = certificate_for(docs, secret);
            assert_eq!(value(ca, "isCA"), Some("true"), "{secret} is a CA");
            assert!(
                get("Issuer", &issuer_of(ca)).contains("\n  selfSigned: {}"),
                "{secret} bootstraps from a self-signed Issuer"
            );
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            p.distinguished_name
                .push(DnType::CommonName, value(ca, "commonName").unwrap());
            p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            let ca = CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap();
            cas.insert(issuer.clone(), ca);
        }
        Self { docs, cas }
    }

    /// The `Certificate` that makes Secret `secret`.
    fn certificate(&self, secret: &str) -> &'a str {
        certificate_for(self.docs, secret)
    }

    /// Writes `tls.crt`, `tls.key` and `ca.crt` of Secret `secret` into `dir`.
    fn write_secret(&self, secret: &str, dir: &Path) {
        let cert = self.certificate(secret);
        let issuer = issuer_of(cert);
        let ca = self
            .cas
            .get(&issuer)
            .unwrap_or_else(|| panic!("the Secret {secret} comes from {issuer}, not a CA Issuer"));
        let mut p = CertificateParams::new(items(cert, "dnsNames")).unwrap();
        for uri in items(cert, "uris") {
            p.subject_alt_names
                .push(SanType::URI(uri.as_str().try_into().unwrap()));
        }
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = items(cert, "usages")
            .iter()
            .filter_map(|u| match u.as_str() {
                "server auth" => Some(ExtendedKeyUsagePurpose::ServerAuth),
                "client auth" => Some(ExtendedKeyUsagePurpose::ClientAuth),
                _ => None,
            })
            .collect();
        let key = KeyPair::generate().unwrap();
        let signed = p.signed_by(&key, ca).unwrap();
        std::fs::create_dir_all(dir).unwrap();
        for (file, text) in [
            ("tls.crt", signed.pem()),
            ("tls.key", key.serialize_pem()),
            ("ca.crt", ca.pem()),
        ] {
            std::fs::write(dir.join(file), text).unwrap();
        }
    }
}

/// Whether a certificate's DNS name `pattern` covers `host`: the same name, or a wildcard
/// (`*.` and a suffix) standing for `host`'s first label.
fn dns_covers(pattern: &str, host: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => host
            .split_once('.')
            .is_some_and(|(label, rest)| !label.is_empty() && rest == suffix),
        None => pattern == host,
    }
}

/// Whether rustls' WebPKI verifier, as a daemon dialling `host` runs it, accepts the
/// certificate of the Secret written to `dir` (`tls.crt` against `ca.crt`).
fn webpki_verifies(dir: &Path, host: &str) -> Result<(), String> {
    use rustls::client::danger::ServerCertVerifier as _;
    let pem = |file: &str| -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_file_iter(dir.join(file))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    };
    let mut roots = rustls::RootCertStore::empty();
    for ca in pem("ca.crt") {
        roots.add(ca).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier =
        rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .unwrap();
    let chain = pem("tls.crt");
    let name = ServerName::try_from(host.to_string()).map_err(|e| e.to_string())?;
    verifier
        .verify_server_cert(&chain[0], &chain[1..], &name, &[], UnixTime::now())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[test]
fn kubernetes_configmaps_pass_check_config_and_name_each_pod_over_mutual_tls() {
    let (docs, namespace) = kubernetes_resources();
    let of_kind = |k: &'static str| docs.iter().filter(move |(kind, _, _)| kind == k);
    // Every Service's ports by name, and whether it is headless (each pod a DNS name of its
    // own, not ready ones included). The daemons find each other by DNS name, not a fixed IP.
    let mut services = BTreeMap::new();
    for (_, name, doc) in of_kind("Service") {
        let headless = doc.contains("\n  clusterIP: None\n");
        assert!(
            headless || !doc.contains("clusterIP:"),
            "Service {name}: no fixed IP"
        );
        let lines: Vec<_> = doc.lines().map(str::trim).collect();
        let ports: BTreeMap<_, _> = lines
            .windows(2)
            .filter_map(|w| Some((w[0].strip_prefix("- name: ")?, w[1].strip_prefix("port: ")?)))
            .map(|(n, p)| (n.to_string(), p.to_string()))
            .collect();
        let all_pods = doc.contains("\n  publishNotReadyAddresses: true\n");
        services.insert(name.clone(), (ports, headless, all_pods));
    }
    let cert_manager = CertManager::new(&docs);
    let tmp = tempfile::tempdir().unwrap();
    let mut regions_seen = Vec::new();
    let mut pods_seen = BTreeMap::new();
    let mut lists = BTreeSet::new();
    let mut peer_secrets = Vec::new();
    let mut peer_issuers = BTreeSet::new();
    for (_, name, sts) in of_kind("StatefulSet") {
        assert!(
            sts.contains("\"/etc/quotad/quotad.toml\""),
            "{name} runs the mounted config"
        );
        // Volume mounts (name to path) and the Secrets of secret volumes (name to Secret).
        let (mut mounts, mut secrets) = (BTreeMap::new(), BTreeMap::new());
        let mut item = "";
        for line in sts.lines().map(str::trim) {
            if let Some(n) = line.strip_prefix("- name: ") {
                item = n;
            } else if let Some(path) = line.strip_prefix("mountPath: ") {
                mounts.insert(item, path);
            } else if let Some(secret) = line.strip_prefix("secretName: ") {
                secrets.insert(item, secret);
            }
        }
        let paths: BTreeSet<_> = mounts.values().copied().collect();
        assert!(
            paths.contains("/etc/quotad") && paths.contains("/var/lib/quotad"),
            "{name} mounts its ConfigMap and keeps its data on a volume: {mounts:?}"
        );
        let configmap = sts
            .lines()
            .skip_while(|l| l.trim() != "configMap:")
            .nth(1)
            .and_then(|l| l.trim().strip_prefix("name: "))
            .unwrap_or_else(|| panic!("{name} mounts no ConfigMap"));
        let toml = of_kind("ConfigMap")
            .filter(|(_, n, _)| n == configmap)
            .find_map(|(_, _, d)| literal_block(d, "quotad.toml"))
            .unwrap_or_else(|| panic!("no ConfigMap {configmap} with a quotad.toml"));

        // Each mounted Secret as cert-manager fills it, in a directory of its own: the config's
        // paths under the mount point move there.
        let mut local = toml.clone();
        let mut secret_dirs = BTreeMap::new();
        for (volume, secret) in &secrets {
            let mount = mounts[volume];
            let dir = tmp.path().join(name).join(mount.trim_start_matches('/'));
            cert_manager.write_secret(secret, &dir);
            local = local.replace(&format!("\"{mount}/"), &format!("\"{}/", dir.display()));
            secret_dirs.insert(*volume, dir);
        }
        let file = tmp.path().join(format!("{configmap}.toml"));
        std::fs::write(&file, local).unwrap();

        // The certificate behind a section's TLS files (its Secret's directory): it names
        // every host given, WebPKI accepts it for each, it has the usages each end of a
        // connection checks, and it is renewed before it runs out.
        let certificate = |section: &str, usages: &[&str], hosts: &[&str]| {
            let path = toml_value(&toml, section, "tls_cert_file")
                .unwrap_or_else(|| panic!("{name}: [{section}] serves TLS"));
            let dir = Path::new(path).parent().unwrap().to_str().unwrap();
            let (volume, _) = mounts
                .iter()
                .find(|(_, m)| **m == dir)
                .unwrap_or_else(|| panic!("{name}: nothing mounted at {dir}"));
            let cert = cert_manager.certificate(secrets[volume]);
            let dns = items(cert, "dnsNames");
            for host in hosts {
                assert!(
                    dns.iter().any(|d| dns_covers(d, host)),
                    "{name}: {host} in {dns:?}"
                );
                if let Err(e) = webpki_verifies(&secret_dirs[volume], host) {
                    panic!("{name}: [{section}]'s certificate for {host}: {e}");
                }
            }
            for usage in usages {
                assert!(
                    items(cert, "usages").iter().any(|u| u == usage),
                    "{name}: {usage}"
                );
            }
            let (duration, renew) = (value(cert, "duration"), value(cert, "renewBefore"));
            assert!(
                hours(renew.unwrap()) < hours(duration.unwrap()),
                "{name}: renewed before it runs out"
            );
            (cert, secret_dirs[volume].clone())
        };

        // The governing Service gives each pod its name: headless, not ready pods included
        // (a starting or draining daemon still votes), with the API and peer ports.
        let governing = value(sts, "serviceName").unwrap_or_else(|| panic!("{name}: serviceName"));
        let (ports, headless, all_pods) = services
            .get(governing)
            .unwrap_or_else(|| panic!("{name}: no Service {governing}"));
        assert!(
            *headless && *all_pods,
            "{name}: {governing} is headless and publishes not ready pods"
        );
        let replicas: usize = value(sts, "replicas")
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("{name}: replicas"));
        let mut region = String::new();
        for ordinal in 0..replicas {
            // Each pod runs the same config; its name picks its entry.
            let pod = format!("{name}-{ordinal}");
            let mut env = image_env();
            env.extend(kubernetes_env(sts, &pod));
            assert!(
                env.iter().any(|(k, _)| k == "QUOTAD_PEER_TOKEN"),
                "{name} gives QUOTAD_PEER_TOKEN"
            );
            // check-config reads the TLS files: the peer certificate must name this region.
            let printed = check_config(&file, &env);
            region = top_level(&printed, "region").to_string();
            assert_eq!(format!("quotad-{region}"), *name);
            let me = this_daemon(&printed);
            // `<pod>.<governing Service>.<namespace>.svc.<cluster domain>:<port>`.
            let mut domain = "";
            for (addr, port) in [(&me.api, "api"), (&me.peer, "peer")] {
                let (host, at) = host_port(addr);
                domain = host
                    .strip_prefix(&format!("{pod}.{governing}.{namespace}.svc."))
                    .filter(|d| !d.is_empty())
                    .unwrap_or_else(|| {
                        panic!("{pod}: its {port} address {addr} is its name under {governing}")
                    });
                assert_eq!(
                    Some(at),
                    ports.get(port).map(String::as_str),
                    "{pod}: {addr}"
                );
            }
            // Clients and gateways reach the region's ready pods at its other Service.
            let client = format!("quotad-{region}");
            let (client_ports, client_headless, _) = &services[&client];
            assert!(
                !client_headless
                    && client_ports.contains_key("api")
                    && client_ports.contains_key("envoy"),
                "{client}: the API and Envoy ports of the region's ready pods"
            );
            let client_host = format!("{client}.{namespace}.svc.{domain}");
            let peer_host = host_port(&me.peer).0;
            let api_host = host_port(&me.api).0;
            let (peer_cert, peer_dir) =
                certificate("peer", &["server auth", "client auth"], &[peer_host]);
            peer_issuers.insert(issuer_of(peer_cert));
            if ordinal == 0 {
                peer_secrets.push((region.clone(), peer_dir));
            }
            certificate("api", &["server auth"], &[api_host, &client_host]);
            certificate("envoy", &["server auth"], &[api_host, &client_host]);
            pods_seen.insert(peer_host.to_string(), region.clone());
            lists.insert(regions(&printed));
        }
        regions_seen.push(region);
    }
    regions_seen.sort();
    assert_eq!(regions_seen, ["a", "b", "c"]);
    assert_eq!(
        peer_issuers.len(),
        1,
        "one CA for every region's peer certificate"
    );

    // One list of daemons in every ConfigMap, each pod of each StatefulSet once, under the
    // region its pod serves.
    assert_eq!(lists.len(), 1, "every region lists the same daemons");
    let members = lists.into_iter().next().unwrap();
    let listed: BTreeMap<_, _> = members
        .iter()
        .map(|m| (host_port(&m.peer).0.to_string(), m.id.clone()))
        .collect();
    assert_eq!(members.len(), listed.len(), "each daemon once: {members:?}");
    assert_eq!(listed, pods_seen, "[[regions]] lists every pod");

    // A region's peer certificate passes for its own pods only: the wildcard covers one
    // label under its own headless Service.
    for (region, dir) in &peer_secrets {
        for (pod, of) in &pods_seen {
            assert_eq!(
                webpki_verifies(dir, pod).is_ok(),
                of == region,
                "region {region}'s peer certificate for {pod}"
            );
        }
        let deeper = format!("x.{}", pods_seen.keys().next().unwrap());
        assert!(webpki_verifies(dir, &deeper).is_err(), "{deeper}");
    }
}

#[test]
fn kubernetes_keeps_a_regions_daemons_apart_and_drains_one_daemon_at_a_time() {
    let (docs, _) = kubernetes_resources();
    let sets: Vec<_> = docs
        .iter()
        .filter(|(k, _, _)| k == "StatefulSet")
        .map(|(_, name, doc)| (name, doc))
        .collect();
    assert_eq!(sets.len(), 3, "a StatefulSet per region");
    let budgets: Vec<_> = docs
        .iter()
        .filter(|(k, _, _)| k == "PodDisruptionBudget")
        .map(|(_, name, doc)| (name, doc))
        .collect();
    // One budget over every daemon: per-region budgets would let a drain take a daemon of
    // each region at once, three of the six voters, one short of a majority.
    assert_eq!(budgets.len(), 1, "one PodDisruptionBudget: {budgets:?}");
    let (budget, pdb) = budgets[0];
    assert_eq!(value(pdb, "maxUnavailable"), Some("1"), "{budget}");
    assert_eq!(value(pdb, "minAvailable"), None, "{budget}");
    assert_eq!(
        value(pdb, "unhealthyPodEvictionPolicy"),
        Some("AlwaysAllow"),
        "{budget}: a daemon that is not ready does not hold a drain up"
    );
    let selector = nested(pdb, "matchLabels");
    assert!(!selector.trim().is_empty(), "{budget}: a selector");
    for (name, sts) in sets {
        let replicas: usize = value(sts, "replicas").unwrap().parse().unwrap();
        assert!(replicas >= 2, "{name}: {replicas} daemons");
        // A daemon is ready once a majority runs: the pods start together.
        assert_eq!(
            value(sts, "podManagementPolicy"),
            Some("Parallel"),
            "{name}"
        );
        let apart = nested(sts, "requiredDuringSchedulingIgnoredDuringExecution");
        assert!(
            apart.contains(&format!("app.kubernetes.io/instance: {name}"))
                && apart.contains("topologyKey: kubernetes.io/hostname"),
            "{name}: its pods on different nodes:\n{apart}"
        );
        let labels = nested(&nested(sts, "template"), "labels");
        for label in selector.lines().map(str::trim) {
            assert!(
                labels.lines().any(|l| l.trim() == label),
                "{budget} covers {name}'s pods ({label})"
            );
        }
    }
}

/// One connection answered with `status_line`, on a loopback port.
fn answer_once(status_line: &'static str) -> (u16, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let served = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        // The whole request, as an HTTP server reads it before answering.
        let mut request = Vec::new();
        let mut buf = [0u8; 256];
        while !request.ends_with(b"\r\n\r\n") {
            match conn.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => request.extend_from_slice(&buf[..n]),
            }
        }
        assert!(request.starts_with(b"GET /readyz HTTP/1."), "{request:?}");
        let _ = conn.write_all(format!("{status_line}\r\ncontent-length: 0\r\n\r\n").as_bytes());
    });
    (port, served)
}

fn ready_script(listen: &str) -> bool {
    Command::new("bash")
        .arg(repo().join("scripts/quotad-ready.sh"))
        .env("QUOTAD_API_LISTEN", listen)
        .output()
        .expect("running bash")
        .status
        .success()
}

#[tokio::test]
async fn the_images_health_check_follows_readyz() -> anyhow::Result<()> {
    let mut daemon = Daemon::start(&embedded_config()).await?;
    let port = daemon.api_port;
    let script = |listen: String| tokio::task::spawn_blocking(move || ready_script(&listen));
    assert!(script(format!("127.0.0.1:{port}")).await?, "ready daemon");
    assert!(
        script(format!("0.0.0.0:{port}")).await?,
        "every interface is reached on loopback"
    );
    daemon.terminate(std::time::Duration::from_secs(20)).await?;
    assert!(
        !script(format!("127.0.0.1:{port}")).await?,
        "nothing listening"
    );

    let (port, served) = answer_once("HTTP/1.1 503 Service Unavailable");
    assert!(
        !script(format!("127.0.0.1:{port}")).await?,
        "draining answers 503"
    );
    served.join().unwrap();
    let (port, served) = answer_once("HTTP/1.1 200 OK");
    assert!(script(format!("127.0.0.1:{port}")).await?, "200 is ready");
    served.join().unwrap();
    Ok(())
}
