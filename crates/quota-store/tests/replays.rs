//! Scripts that must apply exactly once (`refund.lua`, `charge.lua`, `collect_usage.lua`)
//! against a connection that breaks after Redis ran the script but before its reply arrived: the
//! store's retry (and a Cluster client's own) sends the same call again, which must change
//! nothing more.
//!
//! A proxy between the store and a real `redis-server` drops the first reply after it is armed
//! and closes that connection, as a network cut or a restarted load balancer would.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::{fresh_bucket, req, tokens};
use quota_core::bucket::UT;
use quota_core::BucketParams;
use quota_store::{ChargeRequest, RedisStore, RedisStoreConfig, Store, UsageRecord};
use redis_harness::RedisServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A TCP proxy to a Redis that, once armed, swallows the next reply and cuts its connection.
struct ReplyCutter {
    port: u16,
    armed: Arc<AtomicBool>,
}

impl ReplyCutter {
    async fn start(redis_port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed = Arc::new(AtomicBool::new(false));
        let a = armed.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = TcpStream::connect(("127.0.0.1", redis_port)).await.unwrap();
                tokio::spawn(relay(client, server, a.clone()));
            }
        });
        Self { port, armed }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    fn fired(&self) -> bool {
        !self.armed.load(Ordering::SeqCst)
    }
}

async fn relay(client: TcpStream, server: TcpStream, armed: Arc<AtomicBool>) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let up = tokio::spawn(async move { tokio::io::copy(&mut cr, &mut sw).await });
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match sr.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if armed.swap(false, Ordering::SeqCst) {
            // Redis ran the call; its reply is lost with the connection.
            break;
        }
        if cw.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    up.abort();
    let _ = cw.shutdown().await;
}

async fn store_through(proxy: &ReplyCutter) -> RedisStore {
    let cfg =
        RedisStoreConfig::standalone(proxy.url()).with_timeout(std::time::Duration::from_secs(5));
    RedisStore::connect(cfg).await.unwrap()
}

const NOW: u64 = 1_700_000_000_000;

/// Regression: the store retried `refund.lua` on a dropped connection, and a refund whose
/// first run had happened credited its tokens twice, more than the reservation had spent.
#[tokio::test]
async fn a_refund_whose_reply_was_lost_credits_its_tokens_once() {
    let server = RedisServer::start().unwrap();
    let proxy = ReplyCutter::start(server.port()).await;
    let store = store_through(&proxy).await;
    let limit = tokens(10, 0);
    let b = fresh_bucket("refund-once");
    let d = store.check(&req(&b, limit, 6, Some(NOW))).await.unwrap();
    assert_eq!((d.allowed, d.remaining), (true, 4));
    // refund.lua loaded, so the armed cut meets the refund's own reply.
    let other = fresh_bucket("refund-once-load");
    assert_eq!(store.refund(&other, 1, Some(NOW)).await.unwrap(), None);

    proxy.arm();
    let left = store.refund(&b, 3, Some(NOW)).await.unwrap();
    assert!(proxy.fired(), "the refund's first reply was cut");
    assert_eq!(left, Some(7), "the retry answers the level the refund left");

    let direct = common::store(&server).await;
    let peek = direct.check(&req(&b, limit, 0, Some(NOW))).await.unwrap();
    assert_eq!(peek.remaining, 7, "3 tokens credited once, not twice");
    // A new refund is a new call: it credits.
    assert_eq!(store.refund(&b, 2, Some(NOW)).await.unwrap(), Some(9));
}

/// A charge whose reply was lost: the store's retry finds the charge's marker, takes nothing
/// more and answers what the first run applied.
#[tokio::test]
async fn a_charge_whose_reply_was_lost_applies_once() {
    let server = RedisServer::start().unwrap();
    let proxy = ReplyCutter::start(server.port()).await;
    let store = store_through(&proxy).await;
    let p = BucketParams::new(10 * UT, 0).unwrap();
    // charge.lua loaded, so the armed cut meets the charge's own reply.
    let other = fresh_bucket("charge-once-load");
    store
        .charge(&ChargeRequest::new(other, p, 1, 0).at(NOW))
        .await
        .unwrap();
    let b = fresh_bucket("charge-once");
    proxy.arm();
    let o = store
        .charge(&ChargeRequest::new(b.clone(), p, 14, 10 * UT).at(NOW))
        .await
        .unwrap();
    assert!(proxy.fired(), "the charge's first reply was cut");
    assert_eq!((o.applied, o.clamped, o.debt), (14, 0, 4));
    // Charged once: 4 owed, so 5 back leave 1 (twice: 10 owed, none left).
    let direct = common::store(&server).await;
    assert_eq!(direct.refund(&b, 5, Some(NOW)).await.unwrap(), Some(1));
    let usage: Vec<UsageRecord> = direct
        .collect_usage(100)
        .await
        .unwrap()
        .into_iter()
        .filter(|u| u.bucket == b)
        .collect();
    assert_eq!((usage[0].admitted, usage[0].denied), (14 - 5, 0));
}

/// Regression: the store retried `collect_usage.lua` on a dropped connection; the first run
/// had already taken the keys and reset their counters, so the retry drained nothing (or the
/// next keys) and the first run's usage was lost.
#[tokio::test]
async fn a_collection_whose_reply_was_lost_loses_no_usage() {
    let server = RedisServer::start().unwrap();
    let proxy = ReplyCutter::start(server.port()).await;
    let store = store_through(&proxy).await;
    let limit = tokens(10, 0);
    // collect_usage.lua loaded, and the index empty.
    assert!(store.collect_usage(100).await.unwrap().is_empty());
    let buckets: Vec<_> = (0..3).map(|_| fresh_bucket("collect-once")).collect();
    for (i, b) in buckets.iter().enumerate() {
        let cost = i as u64 + 1;
        assert!(
            store
                .check(&req(b, limit, cost, Some(NOW)))
                .await
                .unwrap()
                .allowed
        );
    }

    proxy.arm();
    let mut usage = store.collect_usage(100).await.unwrap();
    assert!(proxy.fired(), "the collection's first reply was cut");
    usage.sort_by_key(|u| u.admitted);
    let got: Vec<_> = usage
        .iter()
        .map(|u| (u.bucket.clone(), u.admitted))
        .collect();
    let want: Vec<_> = buckets
        .iter()
        .enumerate()
        .map(|(i, b)| (b.clone(), i as u64 + 1))
        .collect();
    assert_eq!(got, want, "every bucket's usage, once");
    assert!(
        store.collect_usage(100).await.unwrap().is_empty(),
        "and nothing twice"
    );
}
