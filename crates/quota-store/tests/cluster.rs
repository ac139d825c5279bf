//! Redis Cluster: three masters started by redis-harness. Decisions for tenants spread over all
//! nodes, parameters, NOSCRIPT after a flush on every node, usage collection through the
//! per-slot activity indexes (each in its bucket's slot, so the scripts never cross slots), and
//! holds (a record in its tenant's slot, beside the buckets it names).

mod common;

use std::time::Duration;

use common::{admin, first_decision, fresh_bucket, req, tokens};
use quota_core::keys::{self, StateKind};
use quota_core::PolicyName;
use quota_store::{
    BucketRef, Credentials, HoldLimit, HoldRequest, Limit, RedisStore, RedisStoreConfig,
    ReleaseRequest, SetParams, SettleRequest, Settled, SettledLimit, Store, StoreError,
};
use redis_harness::RedisCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_and_usage_on_a_three_master_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let cfg = RedisStoreConfig::cluster(cluster.urls()).with_timeout(Duration::from_secs(5));
    let s = RedisStore::connect(cfg).await.unwrap();
    // Enough tenants that every master owns some.
    let buckets: Vec<_> = (0..30).map(|_| fresh_bucket("cl")).collect();
    let mut slots: Vec<u16> = buckets
        .iter()
        .map(|b| keys::key_slot(&b.state_key(StateKind::Bucket)))
        .collect();
    slots.sort_unstable();
    assert!(
        slots.first() < Some(&5461) && slots.last() > Some(&10923),
        "{slots:?}"
    );
    let l = tokens(2, 0);
    // Stored parameters apply per bucket, wherever its slot lives: bucket 0 gets capacity 10.
    s.set_params(&SetParams::new(buckets[0].clone(), tokens(10, 0)))
        .await
        .unwrap();
    for b in &buckets {
        for _ in 0..3 {
            s.check(&req(b, l, 1, None)).await.unwrap();
        }
    }
    assert_eq!(
        s.check(&req(&buckets[0], l, 1, None))
            .await
            .unwrap()
            .remaining,
        6
    );
    // Scripts flushed on every node are reloaded where needed.
    for n in cluster.nodes() {
        assert_eq!(
            redis_harness::inline_command(n.port(), "SCRIPT FLUSH").unwrap(),
            "+OK"
        );
    }
    let w = Limit::SlidingWindow {
        limit: 1,
        window_ms: 60_000,
    };
    for b in &buckets {
        s.check(&req(b, w, 1, None)).await.unwrap();
    }
    let usage = s.collect_usage(usize::MAX).await.unwrap();
    // 30 buckets × (bucket state + window state). Buckets 1..30: 2 admitted, 1 denied; bucket
    // 0: 4 admitted; every window: 1 admitted.
    assert_eq!(usage.len(), 60);
    let total_admitted: u64 = usage.iter().map(|u| u.admitted).sum();
    let total_denied: u64 = usage.iter().map(|u| u.denied).sum();
    assert_eq!(total_admitted, 29 * 2 + 4 + 30);
    assert_eq!(total_denied, 29);
    assert!(s.collect_usage(usize::MAX).await.unwrap().is_empty());
    // `max` is honoured and nothing taken is dropped.
    for b in &buckets[..5] {
        s.check(&req(b, l, 1, Some(1))).await.unwrap();
    }
    let first = s.collect_usage(3).await.unwrap();
    assert!(first.len() <= 3);
    let rest = s.collect_usage(usize::MAX).await.unwrap();
    assert_eq!(first.len() + rest.len(), 5);

    // Holds on every master: a record shares its tenant's slot with the buckets it holds, and
    // settle.lua reads the buckets the record names there. Settled at 5 (3 more charged) or
    // released (2 back).
    for (i, b) in buckets.iter().enumerate() {
        let held = BucketRef {
            policy: PolicyName::new("held").unwrap(),
            ..b.clone()
        };
        let h = HoldRequest {
            id: format!("h{i}"),
            limits: vec![HoldLimit {
                bucket: held.clone(),
                limit: tokens(5, 0),
                debt_limit_ut: 0,
            }],
            cost: 2,
            ttl_ms: 60_000,
            now_ms: None,
        };
        let o = s.hold(&h).await.unwrap();
        assert!(o.held && o.decisions[0].remaining == 3, "{o:?}");
        let got = if i % 2 == 0 {
            let r = SettleRequest {
                tenant: b.tenant.clone(),
                id: h.id.clone(),
                cost: 5,
                now_ms: None,
            };
            s.settle(&r).await.unwrap()
        } else {
            let r = ReleaseRequest {
                tenant: b.tenant.clone(),
                id: h.id.clone(),
                now_ms: None,
            };
            s.release(&r).await.unwrap()
        };
        let (charged, refunded, remaining) = if i % 2 == 0 { (3, 0, 0) } else { (0, 2, 5) };
        assert_eq!(
            got,
            Settled::Done {
                limits: vec![SettledLimit {
                    bucket: held,
                    charged,
                    clamped: 0,
                    refunded,
                    remaining,
                    debt: 0
                }],
                replayed: false
            }
        );
    }
    // Settled ones used 5 each; released ones nothing.
    let usage = s.collect_usage(usize::MAX).await.unwrap();
    assert_eq!(usage.len(), 15, "{usage:?}");
    assert!(usage.iter().all(|u| u.admitted == 5 && u.denied == 0));

    // A concurrency limit of 1 slot per tenant: its slots, parameters and usage share the
    // record's slot. One taken, one denied, the first released.
    for b in &buckets {
        let slots = BucketRef {
            policy: PolicyName::new("slots").unwrap(),
            ..b.clone()
        };
        let take = |id: &str| HoldRequest {
            id: id.into(),
            limits: vec![HoldLimit {
                bucket: slots.clone(),
                limit: Limit::Concurrency { limit: 1 },
                debt_limit_ut: 0,
            }],
            cost: 1,
            ttl_ms: 60_000,
            now_ms: None,
        };
        assert!(s.hold(&take("a")).await.unwrap().held);
        assert!(!s.hold(&take("b")).await.unwrap().held);
        assert_eq!(s.in_flight(&slots, None).await.unwrap(), 1);
        let r = ReleaseRequest {
            tenant: b.tenant.clone(),
            id: "a".into(),
            now_ms: None,
        };
        assert!(matches!(
            s.release(&r).await.unwrap(),
            Settled::Done {
                replayed: false,
                ..
            }
        ));
    }
    let usage = s.collect_usage(usize::MAX).await.unwrap();
    assert_eq!(usage.len(), 30, "{usage:?}");
    assert!(usage.iter().all(|u| u.admitted == 1 && u.denied == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_instance_names_every_master() {
    let cluster = RedisCluster::start().unwrap();
    let cfg = RedisStoreConfig::cluster(cluster.urls()).with_timeout(Duration::from_secs(5));
    let s = RedisStore::connect(cfg).await.unwrap();
    let id = s.instance().await.unwrap();
    let ids: Vec<&str> = id.split(',').collect();
    assert_eq!(ids.len(), 3, "{id}");
    assert!(ids.iter().all(|i| i.len() == 40), "{id}");
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted, ids, "sorted and distinct");
    assert_eq!(s.instance().await.unwrap(), id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listed_params_come_from_every_master() {
    let cluster = RedisCluster::start().unwrap();
    let cfg = RedisStoreConfig::cluster(cluster.urls()).with_timeout(Duration::from_secs(5));
    let s = RedisStore::connect(cfg).await.unwrap();
    let written: std::collections::BTreeSet<_> =
        (0..1_200).map(|_| fresh_bucket("cl-list")).collect();
    for b in &written {
        s.set_params(&SetParams::new(b.clone(), tokens(3, 1)))
            .await
            .unwrap();
    }
    let slots: Vec<u16> = written
        .iter()
        .map(|b| keys::key_slot(&b.params_key()))
        .collect();
    assert!(
        slots.iter().any(|&s| s < 5461) && slots.iter().any(|&s| s > 10923),
        "every master holds some"
    );
    let listed = s.list_params().await.unwrap();
    assert_eq!(listed.len(), written.len(), "each held bucket once");
    assert_eq!(
        listed
            .into_iter()
            .collect::<std::collections::BTreeSet<_>>(),
        written
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_opened_while_its_seed_node_is_down_connects_on_a_later_call() {
    let mut cluster = RedisCluster::start().unwrap();
    let seed = cluster.urls().remove(0);
    cluster.nodes_mut()[0].stop();
    let cfg = RedisStoreConfig::cluster(vec![seed]).with_timeout(Duration::from_secs(2));
    let s = RedisStore::open(cfg).unwrap();
    let b = fresh_bucket("cl-lazy");
    let l = tokens(3, 0);
    let e = s.check(&req(&b, l, 1, None)).await.unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::Unavailable { .. } | StoreError::Timeout { .. }
        ),
        "{e}"
    );

    cluster.nodes_mut()[0].restart().unwrap();
    let first = first_decision(&s, &req(&b, l, 1, None), Duration::from_secs(10), |_| {}).await;
    let d = first.expect("a check succeeds once the seed node is back");
    assert!(d.allowed);
    s.reachable().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_protected_cluster_takes_the_credentials() {
    const PASSWORD: &str = "cl@ster/pass:w#rd% x";
    let cluster = RedisCluster::start_with_password(Some(PASSWORD)).unwrap();
    let cfg = RedisStoreConfig::cluster(cluster.urls()).with_timeout(Duration::from_secs(5));
    let e = RedisStore::connect(cfg.clone()).await.unwrap_err();
    assert!(matches!(e, StoreError::Refused { .. }), "{e}");
    let wrong = cfg.clone().with_credentials(Credentials {
        username: None,
        password: "wrong".into(),
    });
    let e = RedisStore::connect(wrong).await.unwrap_err();
    assert!(
        matches!(e, StoreError::Refused { .. }),
        "a wrong password: {e}"
    );

    let s = RedisStore::connect(cfg.with_credentials(Credentials {
        username: None,
        password: PASSWORD.into(),
    }))
    .await
    .unwrap();
    // Buckets on every master; the listing visits each.
    let buckets: Vec<_> = (0..30).map(|_| fresh_bucket("cl-auth")).collect();
    for b in &buckets {
        assert!(
            s.check(&req(b, tokens(2, 0), 1, None))
                .await
                .unwrap()
                .allowed
        );
        s.set_params(&SetParams::new(b.clone(), tokens(3, 1)))
            .await
            .unwrap();
    }
    assert_eq!(s.list_params().await.unwrap().len(), buckets.len());

    // A new password: refused until every master takes it, then taken; after the old
    // connections are dropped the store reconnects to each master with it.
    const NEW: &str = "n3w cl@ster pass";
    let rotated = Credentials {
        username: None,
        password: NEW.into(),
    };
    let e = s.use_credentials(rotated.clone()).await.unwrap_err();
    assert!(matches!(e, StoreError::Refused { .. }), "{e}");
    for node in cluster.nodes() {
        admin(node, PASSWORD, &["CONFIG", "SET", "requirepass", NEW]).await;
    }
    s.use_credentials(rotated).await.unwrap();
    for node in cluster.nodes() {
        admin(node, NEW, &["CLIENT", "KILL", "TYPE", "normal"]).await;
    }
    for b in &buckets {
        let d = first_decision(
            &s,
            &req(b, tokens(2, 0), 1, None),
            Duration::from_secs(10),
            |e| assert!(!matches!(e, StoreError::Refused { .. }), "{e}"),
        )
        .await
        .expect("decides over the new password");
        assert!(d.allowed && d.remaining == 0, "{d:?}");
    }
}

/// The store's clock on a Cluster is read from every master (`TIME` routed to all of them) and
/// is the earliest: between what the masters showed before the call and after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clock_of_a_cluster_is_read_from_its_masters() {
    let cluster = RedisCluster::start().unwrap();
    let cfg = RedisStoreConfig::cluster(cluster.urls()).with_timeout(Duration::from_secs(5));
    let s = RedisStore::connect(cfg).await.unwrap();
    let node_ms = |n: &redis_harness::RedisServer| -> u64 {
        let mut c = n.client().get_connection().unwrap();
        let (secs, us): (u64, u64) = redis::cmd("TIME").query(&mut c).unwrap();
        secs * 1000 + us / 1000
    };
    let before = cluster.nodes().iter().map(node_ms).min().unwrap();
    let clock = s.clock_ms().await.unwrap();
    let after = cluster.nodes().iter().map(node_ms).max().unwrap();
    assert!(
        (before..=after).contains(&clock),
        "{clock} not within {before}..={after}"
    );
}
