//! `rediss://`: the store verifies Redis against a given CA (or the system's roots), presents
//! a client certificate when Redis requires one, and refuses what does not verify.

mod common;

use std::time::Duration;

use common::{fresh_bucket, req, tls, tokens};
use quota_store::{RedisStore, RedisStoreConfig, SetParams, Store, StoreError, Tls};
use redis_harness::pki::TestPki;
use redis_harness::{ClusterOptions, RedisCluster, RedisServer};

fn tls_url(server: &RedisServer, host: &str) -> String {
    format!(
        "rediss://{host}:{}/",
        server.tls_port().expect("a TLS server")
    )
}

fn cfg(url: String) -> RedisStoreConfig {
    RedisStoreConfig::standalone(url).with_timeout(Duration::from_secs(2))
}

#[tokio::test]
async fn decisions_over_mutual_tls_and_what_does_not_verify_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path(), "redis").unwrap();
    let other_dir = tempfile::tempdir().unwrap();
    let other = TestPki::generate(other_dir.path(), "other").unwrap();
    let redis = RedisServer::start_tls(&pki.server_files(true)).unwrap();

    for host in ["127.0.0.1", "localhost"] {
        let s = RedisStore::connect(cfg(tls_url(&redis, host)).with_tls(tls(&pki, true)))
            .await
            .unwrap_or_else(|e| panic!("{host}: {e}"));
        let b = fresh_bucket("tls");
        let d = s.check(&req(&b, tokens(2, 0), 1, None)).await.unwrap();
        assert!(d.allowed && d.remaining == 1, "{host}: {d:?}");
    }

    let down = |e: &StoreError| matches!(e, StoreError::Unavailable { .. });
    for (what, config) in [
        (
            "no client certificate",
            cfg(tls_url(&redis, "127.0.0.1")).with_tls(tls(&pki, false)),
        ),
        (
            "a server certificate from another CA",
            cfg(tls_url(&redis, "127.0.0.1")).with_tls(tls(&other, true)),
        ),
        ("the system's roots only", cfg(tls_url(&redis, "127.0.0.1"))),
    ] {
        let e = RedisStore::connect(config).await.unwrap_err();
        assert!(down(&e), "{what}: {e}");
    }
    // Plain text to the TLS port gets no answer a client could take for Redis's.
    let e = RedisStore::connect(cfg(format!(
        "redis://127.0.0.1:{}/",
        redis.tls_port().unwrap()
    )))
    .await
    .unwrap_err();
    assert!(!matches!(e, StoreError::Refused { .. }), "{e}");
}

#[tokio::test]
async fn certificates_need_a_tls_address_and_must_parse() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path(), "redis").unwrap();
    let e = RedisStore::open(cfg("redis://127.0.0.1:6379/".into()).with_tls(tls(&pki, true)))
        .unwrap_err();
    assert!(matches!(e, StoreError::Invalid { .. }), "{e}");
    let good = tls(&pki, true);
    let key = std::fs::read(&pki.client_key).unwrap();
    let mut no_ca = good.clone();
    no_ca.ca_pem = Some(b"not a certificate".to_vec());
    let mut key_for_cert = good.clone();
    key_for_cert.client.as_mut().unwrap().cert_pem = key.clone();
    let mut cert_for_key = good.clone();
    cert_for_key.client.as_mut().unwrap().key_pem = std::fs::read(&pki.client_cert).unwrap();
    for (what, bad, named) in [
        ("CA", no_ca, "CA"),
        ("cert", key_for_cert, "client certificate"),
        ("key", cert_for_key, "client key"),
    ] {
        let e = RedisStore::open(cfg("rediss://127.0.0.1:6379/".into()).with_tls(bad)).unwrap_err();
        assert!(matches!(e, StoreError::Invalid { .. }), "{what}: {e}");
        assert!(e.to_string().contains(named), "{what}: {e}");
        assert!(
            !e.to_string()
                .contains(&String::from_utf8_lossy(&key)[40..80]),
            "{what}: the key is quoted"
        );
    }
    RedisStore::open(cfg("rediss://127.0.0.1:6379/".into()).with_tls(good)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_over_mutual_tls_decides_on_every_master() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path(), "cluster").unwrap();
    // The nodes' bus connections present the client certificate too (client auth required).
    let client_cert = pki.client_cert_args();
    let extra: Vec<&str> = client_cert.iter().map(String::as_str).collect();
    let files = pki.server_files(true);
    let cluster = RedisCluster::start_opts(&ClusterOptions {
        tls: Some(&files),
        extra: &extra,
        ..ClusterOptions::default()
    })
    .unwrap();
    let config = |tls: Tls| {
        RedisStoreConfig::cluster(cluster.tls_urls("127.0.0.1"))
            .with_timeout(Duration::from_secs(5))
            .with_tls(tls)
    };
    let s = RedisStore::connect(config(tls(&pki, true))).await.unwrap();
    // Buckets on every master; the listing visits each over TLS.
    let buckets: Vec<_> = (0..30).map(|_| fresh_bucket("cl-tls")).collect();
    for b in &buckets {
        let d = s.check(&req(b, tokens(2, 0), 1, None)).await.unwrap();
        assert!(d.allowed && d.remaining == 1, "{d:?}");
        s.set_params(&SetParams::new(b.clone(), tokens(3, 1)))
            .await
            .unwrap();
    }
    assert_eq!(s.list_params().await.unwrap().len(), buckets.len());

    let other_dir = tempfile::tempdir().unwrap();
    let other = TestPki::generate(other_dir.path(), "other").unwrap();
    for (what, tls) in [
        ("no client certificate", tls(&pki, false)),
        ("a CA that did not sign the nodes", tls(&other, true)),
    ] {
        let e = RedisStore::connect(config(tls)).await.unwrap_err();
        assert!(matches!(e, StoreError::Unavailable { .. }), "{what}: {e}");
    }
}
