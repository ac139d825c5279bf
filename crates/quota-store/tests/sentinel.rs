//! Redis behind Sentinel: the store asks the sentinels for the master, and after the master
//! fails over it finds the promoted replica by itself, its buckets as the replica holds them.

mod common;

use std::time::{Duration, Instant};

use common::{first_decision, fresh_bucket, req, tls, tokens};
use quota_store::{
    Credentials, RedisStore, RedisStoreConfig, SetParams, Store, StoreError, Tls, Topology,
};
use redis_harness::pki::TestPki;
use redis_harness::{RedisSentinel, SentinelOptions};

fn config(sentinel: &RedisSentinel) -> RedisStoreConfig {
    RedisStoreConfig::new(Topology::Sentinel {
        urls: sentinel.urls(),
        master_name: sentinel.name().to_string(),
    })
    .with_timeout(Duration::from_millis(500))
}

/// Stops the master and waits for `s` to decide through the promoted replica: on another
/// server (`before` was the master's instance id), with bucket `b` (spent at limit `l`) as
/// spent as before.
async fn spent_after_failover(
    sentinel: &mut RedisSentinel,
    s: &RedisStore,
    b: &quota_store::BucketRef,
    l: quota_store::Limit,
    before: String,
) {
    // Replication is asynchronous: the replica acknowledges every write (WAIT) before its
    // master goes.
    let mut master = sentinel.master_mut().client().get_connection().unwrap();
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(10_000)
        .query(&mut master)
        .unwrap();
    assert_eq!(
        acked, 1,
        "the replica acknowledges the writes before the failover"
    );
    sentinel.master_mut().stop();
    let stopped = Instant::now();
    let d = first_decision(s, &req(b, l, 1, None), Duration::from_secs(30), |e| {
        assert!(
            !matches!(e, StoreError::Script { .. } | StoreError::Refused { .. }),
            "only unavailability during a failover: {e}"
        )
    })
    .await
    .expect("decides through the promoted replica");
    eprintln!("decided {:?} after the master stopped", stopped.elapsed());
    assert!(!d.allowed && d.remaining == 0, "the bucket survived: {d:?}");
    assert_ne!(s.instance().await.unwrap(), before, "another server");
}

/// A master, a replica and three sentinels named `name`, all over mutual TLS with the
/// certificates of a PKI made in `dir` (replication and the sentinels' own connections present
/// the client certificate too).
fn tls_sentinel(dir: &std::path::Path, name: &str) -> (TestPki, RedisSentinel) {
    let pki = TestPki::generate(dir, name).unwrap();
    let client_cert = pki.client_cert_args();
    let extra: Vec<&str> = client_cert.iter().map(String::as_str).collect();
    let files = pki.server_files(true);
    let sentinel = RedisSentinel::start_opts(
        name,
        1000,
        &SentinelOptions {
            tls: Some(&files),
            extra: &extra,
            ..SentinelOptions::default()
        },
    )
    .unwrap();
    (pki, sentinel)
}

#[tokio::test]
async fn the_store_follows_a_failover_to_the_promoted_replica() {
    let mut sentinel = RedisSentinel::start("quotad", 1000).unwrap();
    let s = RedisStore::connect(config(&sentinel)).await.unwrap();
    let b = fresh_bucket("sentinel");
    let l = tokens(3, 0);
    for left in [2, 1, 0] {
        let d = s.check(&req(&b, l, 1, None)).await.unwrap();
        assert!(d.allowed && d.remaining == left, "{d:?}");
    }
    // The parameters gateways read; the same limit, so no refill either.
    s.set_params(&SetParams::new(b.clone(), l)).await.unwrap();
    let before = s.instance().await.unwrap();
    spent_after_failover(&mut sentinel, &s, &b, l, before).await;
    assert!(s.list_params().await.unwrap().contains(&b));
    // The promoted replica is the master now.
    let mut conn = sentinel
        .replica()
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(info.contains("role:master"), "{info}");
}

#[tokio::test]
async fn sentinel_settings_are_checked_at_open() {
    let sentinels = |urls: &[&str]| {
        RedisStoreConfig::new(Topology::Sentinel {
            urls: urls.iter().map(|u| u.to_string()).collect(),
            master_name: "m".into(),
        })
    };
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path(), "sentinel").unwrap();
    for (what, config) in [
        (
            "mixed schemes",
            sentinels(&["rediss://127.0.0.1:26379", "redis://127.0.0.1:26380"]),
        ),
        (
            "credentials in a sentinel url",
            sentinels(&["redis://:pw@127.0.0.1:26379"]),
        ),
        (
            "certificates without TLS",
            sentinels(&["redis://127.0.0.1:26379"]).with_tls(tls(&pki, true)),
        ),
    ] {
        let e = RedisStore::open(config).unwrap_err();
        assert!(matches!(e, StoreError::Invalid { .. }), "{what}: {e}");
    }
    RedisStore::open(sentinels(&["rediss://127.0.0.1:26379"]).with_tls(tls(&pki, true))).unwrap();
    // Opening does not wait for the sentinels; a call fails as unavailable while none answers.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let s = RedisStore::open(
        RedisStoreConfig::new(Topology::Sentinel {
            urls: vec![format!("redis://127.0.0.1:{port}")],
            master_name: "m".into(),
        })
        .with_timeout(Duration::from_millis(500)),
    )
    .unwrap();
    let e = s.reachable().await.unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::Unavailable { .. } | StoreError::Timeout { .. }
        ),
        "{e}"
    );
}

#[tokio::test]
async fn sentinels_that_require_a_password_get_it() {
    let sentinel =
        RedisSentinel::start_with_password("guarded", 1000, Some("s3ntinel-pw")).unwrap();
    let e = RedisStore::connect(config(&sentinel)).await.unwrap_err();
    assert!(
        matches!(e, StoreError::Refused { .. }),
        "refused without the sentinels' password: {e}"
    );
    let s = RedisStore::connect(config(&sentinel).with_sentinel_credentials(Credentials {
        username: None,
        password: "s3ntinel-pw".into(),
    }))
    .await
    .unwrap();
    let d = s
        .check(&req(&fresh_bucket("guarded"), tokens(2, 0), 1, None))
        .await
        .unwrap();
    assert!(d.allowed && d.remaining == 1, "{d:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinels_and_servers_over_mutual_tls_through_a_failover() {
    let dir = tempfile::tempdir().unwrap();
    let (pki, mut sentinel) = tls_sentinel(dir.path(), "tls-master");
    let config = |tls: Tls| {
        RedisStoreConfig::new(Topology::Sentinel {
            urls: sentinel.tls_urls(),
            master_name: sentinel.name().to_string(),
        })
        // TLS handshakes to the sentinels and the master, in a debug build on a loaded CI
        // machine, can outlast half a second: the first connection gets two.
        .with_timeout(Duration::from_millis(2000))
        .with_tls(tls)
    };
    let s = RedisStore::connect(config(tls(&pki, true))).await.unwrap();
    let b = fresh_bucket("sentinel-tls");
    let l = tokens(2, 0);
    for left in [1, 0] {
        let d = s.check(&req(&b, l, 1, None)).await.unwrap();
        assert!(d.allowed && d.remaining == left, "{d:?}");
    }
    let before = s.instance().await.unwrap();

    let other_dir = tempfile::tempdir().unwrap();
    let other = TestPki::generate(other_dir.path(), "other").unwrap();
    for (what, tls) in [
        ("no client certificate", tls(&pki, false)),
        ("a CA that did not sign the sentinels", tls(&other, true)),
    ] {
        let e = RedisStore::connect(config(tls)).await.unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::Unavailable { .. } | StoreError::Timeout { .. }
            ),
            "{what}: {e}"
        );
    }

    spent_after_failover(&mut sentinel, &s, &b, l, before).await;
}

/// A sentinel lookup checks the master it is given over a connection of its own (a TLS
/// handshake here, slow in a debug build): with calls that time out long before a lookup can
/// end, the lookup still ends, and the store follows the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_is_followed_when_calls_time_out_before_a_lookup_ends() {
    let dir = tempfile::tempdir().unwrap();
    let (pki, mut sentinel) = tls_sentinel(dir.path(), "slow-lookup");
    let config = RedisStoreConfig::new(Topology::Sentinel {
        urls: sentinel.tls_urls(),
        master_name: sentinel.name().to_string(),
    })
    .with_timeout(Duration::from_millis(100))
    .with_tls(tls(&pki, true));
    // Not `connect`: under load the first lookup and handshake can outlast its wait too; the
    // first decision retries until they are done.
    let s = RedisStore::open(config).unwrap();
    let b = fresh_bucket("sentinel-slow");
    let l = tokens(1, 0);
    let failed = std::cell::Cell::new(0u32);
    let d = first_decision(&s, &req(&b, l, 1, None), Duration::from_secs(30), |_| {
        failed.set(failed.get() + 1)
    })
    .await
    .expect("decides through the first master");
    // A call that timed out may still have run on the master (the fault this test is about):
    // then the token is spent and the decision that follows is a denial.
    assert!(
        d.remaining == 0 && (d.allowed || failed.get() > 0),
        "{d:?} after {} failed calls",
        failed.get()
    );
    let mut master = sentinel.master_mut().client().get_connection().unwrap();
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(10_000)
        .query(&mut master)
        .unwrap();
    assert_eq!(acked, 1, "the replica has the spent bucket");
    sentinel.master_mut().stop();
    // The master is gone: a decision now comes from the promoted replica.
    let d = first_decision(&s, &req(&b, l, 1, None), Duration::from_secs(30), |e| {
        assert!(
            !matches!(e, StoreError::Script { .. } | StoreError::Refused { .. }),
            "only unavailability during a failover: {e}"
        )
    })
    .await
    .expect("decides through the promoted replica");
    assert!(!d.allowed && d.remaining == 0, "the bucket survived: {d:?}");
}
