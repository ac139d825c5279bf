//! Opening a store does not wait for Redis: a store opened while its Redis is down fails each
//! call as unavailable and connects by itself once Redis answers, without being reopened.

mod common;

use std::time::{Duration, Instant};

use common::{admin, first_decision, fresh_bucket, req, tokens};
use quota_store::{Credentials, RedisStore, RedisStoreConfig, Store, StoreError};
use redis_harness::RedisServer;

fn down(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Unavailable { .. } | StoreError::Timeout { .. }
    )
}

#[tokio::test]
async fn a_store_opened_while_redis_is_down_connects_once_it_answers() {
    let mut redis = RedisServer::start().unwrap();
    redis.stop();
    let cfg = RedisStoreConfig::standalone(redis.url()).with_timeout(Duration::from_secs(2));

    let e = RedisStore::connect(cfg.clone()).await.unwrap_err();
    assert!(down(&e), "connect waits for Redis: {e}");

    let s = RedisStore::open(cfg).unwrap();
    let e = s.reachable().await.unwrap_err();
    assert!(down(&e), "{e}");
    let b = fresh_bucket("lazy");
    let l = tokens(3, 0);
    let e = s.check(&req(&b, l, 1, None)).await.unwrap_err();
    assert!(down(&e), "{e}");

    redis.restart().unwrap();
    // The same store, never reopened: the next calls connect.
    let first = first_decision(&s, &req(&b, l, 1, None), Duration::from_secs(5), |e| {
        assert!(down(e), "{e}")
    })
    .await;
    let d = first.expect("a check succeeds within 5 s of Redis answering");
    assert!(d.allowed);
    assert_eq!(d.remaining, 2, "the failed calls spent nothing");
    s.reachable().await.unwrap();
}

#[test]
fn a_malformed_address_is_refused_at_open() {
    for url in ["http://127.0.0.1:6379/", "redis://127.0.0.1:notaport/", ""] {
        let e = RedisStore::open(RedisStoreConfig::standalone(url)).unwrap_err();
        assert!(matches!(e, StoreError::Invalid { .. }), "{url:?}: {e}");
    }
    let e = RedisStore::open(RedisStoreConfig::cluster(vec!["bogus".into()])).unwrap_err();
    assert!(matches!(e, StoreError::Invalid { .. }), "{e}");
}

/// A password with every character a URL would need encoded, for `requirepass` and an ACL user.
const PASSWORD: &str = "p@ss/w:rd#%?&= x";

fn with(server: &RedisServer, username: Option<&str>, password: &str) -> RedisStoreConfig {
    RedisStoreConfig::standalone(server.url())
        .with_timeout(Duration::from_secs(2))
        .with_credentials(Credentials {
            username: username.map(str::to_string),
            password: password.to_string(),
        })
}

#[tokio::test]
async fn credentials_authenticate_as_given_and_a_refusal_is_named() {
    let redis = RedisServer::start_with(&[
        "--requirepass",
        PASSWORD,
        "--user",
        "quotad",
        "on",
        &format!(">{PASSWORD}"),
        "~*",
        "&*",
        "+@all",
        "--user",
        "reader",
        "on",
        ">reader-pw",
        "~*",
        "+@read",
        "+ping",
    ])
    .unwrap();
    let b = fresh_bucket("auth");
    let l = tokens(3, 0);
    for user in [None, Some("quotad")] {
        let s = RedisStore::connect(with(&redis, user, PASSWORD))
            .await
            .unwrap_or_else(|e| panic!("{user:?}: {e}"));
        let d = s.check(&req(&b, l, 1, None)).await.unwrap();
        assert!(d.allowed, "{user:?}");
    }

    let refused = |e: &StoreError| matches!(e, StoreError::Refused { .. });
    // No password, a wrong one, an unknown user: refused, and the password is never echoed.
    let none = RedisStoreConfig::standalone(redis.url()).with_timeout(Duration::from_secs(2));
    for (what, cfg) in [
        ("none", none),
        ("wrong", with(&redis, None, "wrong")),
        ("unknown user", with(&redis, Some("nobody"), PASSWORD)),
    ] {
        let e = RedisStore::connect(cfg).await.unwrap_err();
        assert!(refused(&e), "{what}: {e}");
        assert!(!e.to_string().contains(PASSWORD), "{what}: {e}");
    }
    // A user that may not run scripts connects, and its decisions are refused.
    let s = RedisStore::connect(with(&redis, Some("reader"), "reader-pw"))
        .await
        .unwrap();
    let e = s.check(&req(&b, l, 1, None)).await.unwrap_err();
    assert!(refused(&e), "{e}");
}

#[tokio::test]
async fn a_refusal_after_start_heals_once_redis_takes_the_credentials_again() {
    let redis = RedisServer::start_with(&["--requirepass", "first"]).unwrap();
    let s = RedisStore::connect(with(&redis, None, "first"))
        .await
        .unwrap();
    let b = fresh_bucket("heal");
    let l = tokens(100, 0);
    assert!(s.check(&req(&b, l, 1, None)).await.unwrap().allowed);

    // The password changes under the running store and its connection is dropped: the
    // reconnection is refused.
    admin(&redis, "first", &["CONFIG", "SET", "requirepass", "second"]).await;
    admin(&redis, "second", &["CLIENT", "KILL", "TYPE", "normal"]).await;
    let mut refused = false;
    for _ in 0..3 {
        match s.check(&req(&b, l, 1, None)).await {
            Err(StoreError::Refused { .. }) => refused = true,
            Err(e) => assert!(down(&e), "{e}"),
            Ok(d) => panic!("decided with a refused password: {d:?}"),
        }
    }
    assert!(refused, "the reconnection is refused");

    // Put back, the same store decides again without being reopened.
    admin(&redis, "second", &["CONFIG", "SET", "requirepass", "first"]).await;
    let back = Instant::now();
    let healed = first_decision(&s, &req(&b, l, 1, None), Duration::from_secs(5), |_| {}).await;
    let d = healed.expect("decisions resume once Redis takes the credentials again");
    assert!(d.allowed);
    eprintln!(
        "healed {:?} after the password was restored",
        back.elapsed()
    );
}

#[tokio::test]
async fn new_credentials_are_taken_only_once_redis_accepts_them() {
    let redis = RedisServer::start_with(&[
        "--requirepass",
        PASSWORD,
        "--user",
        "quotad",
        "on",
        ">old-password",
        "~*",
        "+@all",
    ])
    .unwrap();
    let s = RedisStore::connect(with(&redis, Some("quotad"), "old-password"))
        .await
        .unwrap();
    let b = fresh_bucket("rotate");
    let l = tokens(100, 0);
    assert!(s.check(&req(&b, l, 1, None)).await.unwrap().allowed);
    let new = Credentials {
        username: Some("quotad".into()),
        password: "new-password".into(),
    };

    // Redis does not know the new password yet: refused, and the store goes on deciding over
    // its current connection.
    let e = s.use_credentials(new.clone()).await.unwrap_err();
    assert!(matches!(e, StoreError::Refused { .. }), "{e}");
    assert!(s.check(&req(&b, l, 1, None)).await.unwrap().allowed);

    // The operator adds the new password beside the old one; the store takes it.
    admin(
        &redis,
        PASSWORD,
        &["ACL", "SETUSER", "quotad", ">new-password"],
    )
    .await;
    s.use_credentials(new).await.unwrap();
    // The old password is removed and every connection of the user dropped: the store
    // reconnects with the new password.
    admin(
        &redis,
        PASSWORD,
        &["ACL", "SETUSER", "quotad", "<old-password"],
    )
    .await;
    admin(&redis, PASSWORD, &["CLIENT", "KILL", "USER", "quotad"]).await;
    let d = first_decision(&s, &req(&b, l, 1, None), Duration::from_secs(5), |e| {
        assert!(down(e), "never refused: {e}")
    })
    .await
    .expect("decides over the new password");
    assert!(d.allowed);
    assert_eq!(d.remaining, 97, "one bucket throughout");
    // Only new-password connections exist now.
    s.reachable().await.unwrap();
}
