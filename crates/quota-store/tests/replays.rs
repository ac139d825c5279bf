//! Scripts that must apply exactly once (`refund.lua`, `charge.lua`, `collect_usage.lua`,
//! `hold.lua`, `settle.lua`) against a connection that breaks after Redis ran the script but
//! before its reply arrived: the store's retry (and a Cluster client's own) sends the same call
//! again, which must change nothing more. And a hold's retries and late calls (the same create,
//! settle or release again; one after another; after the expiry; after the record is
//! forgotten), answered alike by both stores.
//!
//! A proxy between the store and a real `redis-server` drops the first reply after it is armed
//! and closes that connection, as a network cut or a restarted load balancer would.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::{fresh_bucket, req, tokens};
use quota_core::bucket::UT;
use quota_core::BucketParams;
use quota_store::{
    ChargeRequest, HoldLimit, HoldRequest, RedisStore, RedisStoreConfig, ReleaseRequest,
    SettleRequest, Settled, Store, StoreError, UsageRecord,
};
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

/// A hold of `cost` on `b` (fallback `p`, debt limit 5 tokens) under `id`, at `now`.
fn hold_req(b: &quota_store::BucketRef, id: &str, cost: u64, now: u64) -> HoldRequest {
    HoldRequest {
        id: id.into(),
        limits: vec![HoldLimit {
            bucket: b.clone(),
            limit: tokens(10, 0),
            debt_limit_ut: 5 * UT,
        }],
        cost,
        ttl_ms: 60_000,
        now_ms: Some(now),
    }
}

/// A hold whose reply was lost: the store's retry meets the record the first run wrote and is
/// answered as a replay, so the estimate is spent once.
#[tokio::test]
async fn a_hold_whose_reply_was_lost_spends_once() {
    let server = RedisServer::start().unwrap();
    let proxy = ReplyCutter::start(server.port()).await;
    let store = store_through(&proxy).await;
    // hold.lua loaded, so the armed cut meets the hold's own reply.
    let other = fresh_bucket("hold-once-load");
    assert!(
        store
            .hold(&hold_req(&other, "a", 1, NOW))
            .await
            .unwrap()
            .held
    );
    let b = fresh_bucket("hold-once");
    proxy.arm();
    let o = store.hold(&hold_req(&b, "h", 6, NOW)).await.unwrap();
    assert!(proxy.fired(), "the hold's first reply was cut");
    assert!(o.held && o.replayed, "{o:?}");
    assert_eq!(o.decisions[0].remaining, 4, "spent once: 10 less 6");
    let direct = common::store(&server).await;
    let peek = direct
        .check(&req(&b, tokens(10, 0), 0, Some(NOW)))
        .await
        .unwrap();
    assert_eq!(peek.remaining, 4);
}

/// A settle whose reply was lost: the retry finds the hold settled at that cost and answers the
/// first run's results; the excess is charged once.
#[tokio::test]
async fn a_settle_whose_reply_was_lost_charges_once() {
    let server = RedisServer::start().unwrap();
    let proxy = ReplyCutter::start(server.port()).await;
    let store = store_through(&proxy).await;
    let b = fresh_bucket("settle-once");
    assert!(store.hold(&hold_req(&b, "h", 6, NOW)).await.unwrap().held);
    // settle.lua loaded by an unknown hold.
    let unknown = SettleRequest {
        tenant: b.tenant.clone(),
        id: "nothing".into(),
        cost: 1,
        now_ms: Some(NOW),
    };
    assert_eq!(store.settle(&unknown).await.unwrap(), Settled::Unknown);
    proxy.arm();
    let s = SettleRequest {
        id: "h".into(),
        cost: 12,
        ..unknown
    };
    let got = store.settle(&s).await.unwrap();
    assert!(proxy.fired(), "the settle's first reply was cut");
    let Settled::Done { limits, replayed } = got else {
        panic!("{got:?}")
    };
    assert!(replayed);
    // 4 left, 6 more: 4 taken and 2 into debt, once.
    assert_eq!((limits[0].charged, limits[0].debt), (6, 2));
    let direct = common::store(&server).await;
    assert_eq!(direct.refund(&b, 3, Some(NOW)).await.unwrap(), Some(1));
}

/// What a store answers a hold's retries and late calls, in order, each checked on the
/// buckets: the same answers from both stores.
async fn retries_and_late_calls<S: Store>(store: &S, prefix: &str) {
    let b = fresh_bucket(prefix);
    let peek = |now| req(&b, tokens(10, 0), 0, Some(now));
    let settle = |id: &str, cost, now| SettleRequest {
        tenant: b.tenant.clone(),
        id: id.into(),
        cost,
        now_ms: Some(now),
    };
    let release = |id: &str, now| ReleaseRequest {
        tenant: b.tenant.clone(),
        id: id.into(),
        now_ms: Some(now),
    };
    // Made, retried: answered again, spent once.
    let first = store.hold(&hold_req(&b, "a", 3, NOW)).await.unwrap();
    assert!(first.held && !first.replayed);
    assert_eq!(first.expires_at_ms, NOW + 60_000);
    let again = store.hold(&hold_req(&b, "a", 3, NOW + 5)).await.unwrap();
    assert!(again.held && again.replayed && again.expires_at_ms == NOW + 60_000);
    assert_eq!(store.check(&peek(NOW + 5)).await.unwrap().remaining, 7);
    // The id with another estimate: refused, nothing spent.
    let e = store
        .hold(&hold_req(&b, "a", 4, NOW + 5))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, StoreError::Rejected { reason } if reason.contains("hold id")),
        "{e}"
    );
    assert_eq!(store.check(&peek(NOW + 5)).await.unwrap().remaining, 7);
    // Settled at 1: 2 back. Again at 1: the same, replayed. At 2, or released: conflicts.
    let done = store.settle(&settle("a", 1, NOW + 10)).await.unwrap();
    let Settled::Done { limits, replayed } = &done else {
        panic!("{done:?}")
    };
    assert!(!replayed);
    assert_eq!((limits[0].refunded, limits[0].remaining), (2, 9));
    let twice = store.settle(&settle("a", 1, NOW + 20)).await.unwrap();
    assert_eq!(
        twice,
        Settled::Done {
            limits: limits.clone(),
            replayed: true
        }
    );
    assert_eq!(store.check(&peek(NOW + 20)).await.unwrap().remaining, 9);
    assert_eq!(
        store.settle(&settle("a", 2, NOW + 20)).await.unwrap(),
        Settled::Conflict("settled at 1 tokens, not 2".into())
    );
    assert!(matches!(
        store.release(&release("a", NOW + 20)).await.unwrap(),
        Settled::Conflict(_)
    ));
    // Released, released again (replayed), then settled: a conflict.
    assert!(
        store
            .hold(&hold_req(&b, "r", 4, NOW + 30))
            .await
            .unwrap()
            .held
    );
    let gone = store.release(&release("r", NOW + 40)).await.unwrap();
    assert!(matches!(&gone, Settled::Done { replayed: false, limits } if limits[0].refunded == 4));
    assert!(matches!(
        store.release(&release("r", NOW + 50)).await.unwrap(),
        Settled::Done { replayed: true, .. }
    ));
    assert_eq!(
        store.settle(&settle("r", 4, NOW + 50)).await.unwrap(),
        Settled::Conflict("released: a released hold is not settled".into())
    );
    // Run past its expiry: expired, the estimate stays spent, until the record is forgotten.
    assert!(
        store
            .hold(&hold_req(&b, "x", 5, NOW + 60))
            .await
            .unwrap()
            .held
    );
    let end = NOW + 60 + 60_000;
    // The last ms of its life it is still settled.
    assert!(matches!(
        store.settle(&settle("x", 0, end - 1)).await.unwrap(),
        Settled::Done {
            replayed: false,
            ..
        }
    ));
    assert!(
        store
            .hold(&hold_req(&b, "y", 5, NOW + 60))
            .await
            .unwrap()
            .held
    );
    let expired = Settled::Expired { expired_at_ms: end };
    assert_eq!(store.settle(&settle("y", 0, end)).await.unwrap(), expired);
    assert_eq!(
        store.release(&release("y", end + 1)).await.unwrap(),
        expired
    );
    let memory = quota_core::bounds::HOLD_MEMORY_MS;
    assert_eq!(
        store
            .release(&release("y", end + memory - 1))
            .await
            .unwrap(),
        expired
    );
    assert_eq!(
        store.release(&release("y", end + memory)).await.unwrap(),
        Settled::Unknown
    );
    // Ended records are forgotten HOLD_MEMORY_MS after they ended; the id is free again.
    assert_eq!(
        store
            .settle(&settle("a", 1, NOW + 10 + memory))
            .await
            .unwrap(),
        Settled::Unknown
    );
    let fresh = store
        .hold(&hold_req(&b, "a", 4, NOW + 10 + memory))
        .await
        .unwrap();
    assert!(fresh.held && !fresh.replayed);
    // Never made: unknown.
    assert_eq!(
        store.settle(&settle("never", 1, NOW)).await.unwrap(),
        Settled::Unknown
    );
}

#[tokio::test]
async fn holds_answer_retries_and_late_calls_alike_on_both_stores() {
    let server = RedisServer::start().unwrap();
    retries_and_late_calls(&common::store(&server).await, "late-redis").await;
    retries_and_late_calls(&quota_store::EmbeddedStore::new(), "late-embedded").await;
}

/// A concurrency hold whose reply was lost: the retry is answered as a replay and the slot is
/// taken once (a limit of 1 still has the one holder, not a denial of its own retry).
#[tokio::test]
async fn a_slot_whose_reply_was_lost_is_taken_once() {
    let server = RedisServer::start().unwrap();
    let proxy = ReplyCutter::start(server.port()).await;
    let store = store_through(&proxy).await;
    let b = fresh_bucket("slot-once");
    let take = |id: &str| HoldRequest {
        id: id.into(),
        limits: vec![HoldLimit {
            bucket: b.clone(),
            limit: quota_store::Limit::Concurrency { limit: 1 },
            debt_limit_ut: 0,
        }],
        cost: 1,
        ttl_ms: 60_000,
        now_ms: Some(NOW),
    };
    // hold.lua loaded by a hold of another limit.
    let other = fresh_bucket("slot-once-load");
    assert!(
        store
            .hold(&hold_req(&other, "a", 1, NOW))
            .await
            .unwrap()
            .held
    );
    proxy.arm();
    let o = store.hold(&take("h")).await.unwrap();
    assert!(proxy.fired(), "the hold's first reply was cut");
    assert!(
        o.held && o.replayed && o.decisions[0].remaining == 0,
        "{o:?}"
    );
    assert_eq!(store.in_flight(&b, Some(NOW)).await.unwrap(), 1);
    assert!(!store.hold(&take("g")).await.unwrap().held);
}
