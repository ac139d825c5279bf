//! Holds through the API on the embedded store: reserve, settle above and below, release,
//! replays, expiry, several limits, concurrency slots, and bad input that changes nothing.

use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::api::tests::{is_problem, send, with_policy, Reply, TOKEN};
use crate::api::Api;

async fn post(router: &Api, uri: &str, body: Value) -> Reply {
    send(router, "POST", uri, Some(TOKEN), Some(&body.to_string())).await
}

async fn hold(router: &Api, body: Value) -> Reply {
    post(router, "/v1/holds", body).await
}

/// Tokens left in acme's `writes`, read without spending.
async fn left(router: &Api) -> u64 {
    let r = send(
        router,
        "GET",
        "/v1/tenants/acme/allowance",
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let policies = r.body["policies"].as_array().unwrap();
    let writes = policies.iter().find(|p| p["policy"] == "writes").unwrap();
    writes["this_region"]["tokens_left"].as_u64().unwrap()
}

/// A budget that refills one token a day: what a test reads is what holds did.
fn slow(burst: u64, debt: u64) -> Value {
    json!({"limit": 1, "window_ms": 86_400_000, "burst": burst, "debt_limit": debt})
}

#[tokio::test]
async fn a_hold_settled_below_its_estimate_gives_the_rest_back_once() {
    let router = with_policy(slow(1000, 0)).await;
    let r = hold(
        &router,
        json!({"tenant": "acme", "policy": "writes", "cost": 100, "id": "h1"}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["hold_id"], "eu.acme.h1");
    assert_eq!(
        (&r.body["allowed"], &r.body["remaining"], &r.body["ttl_ms"]),
        (&json!(true), &json!(900), &json!(60_000))
    );
    assert_eq!(left(&router).await, 900);
    // The same hold retried under its id: the same hold, nothing spent twice.
    let again = hold(
        &router,
        json!({"tenant": "acme", "policy": "writes", "cost": 100, "id": "h1"}),
    )
    .await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.body);
    assert_eq!(again.body["replayed"], true);
    assert_eq!(left(&router).await, 900);
    // Another request under the same id is refused.
    let other = hold(
        &router,
        json!({"tenant": "acme", "policy": "writes", "cost": 5, "id": "h1"}),
    )
    .await;
    assert_eq!(other.status, StatusCode::CONFLICT, "{}", other.body);

    let settle = |cost: u64| {
        post(
            &router,
            "/v1/holds/eu.acme.h1/settle",
            json!({"cost": cost}),
        )
    };
    let r = settle(40).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["state"], "settled");
    assert_eq!(r.body["replayed"], false);
    let l = &r.body["limits"][0];
    assert_eq!(
        (&l["policy"], &l["refunded"], &l["charged"], &l["remaining"]),
        (&json!("writes"), &json!(60), &json!(0), &json!(960))
    );
    assert_eq!(left(&router).await, 960);
    // Settled twice at the same cost: the first answer, nothing changed.
    let twice = settle(40).await;
    assert_eq!(twice.status, StatusCode::OK);
    assert_eq!(twice.body["replayed"], true);
    assert_eq!(twice.body["limits"][0]["refunded"], 60);
    assert_eq!(left(&router).await, 960);
    // At another cost, or released after: refused, nothing changed.
    assert_eq!(settle(41).await.status, StatusCode::CONFLICT);
    let r = send(&router, "DELETE", "/v1/holds/eu.acme.h1", Some(TOKEN), None).await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.body);
    assert!(is_problem(&r));
    assert_eq!(left(&router).await, 960);
}

#[tokio::test]
async fn a_hold_settled_above_its_estimate_charges_the_excess_into_debt() {
    let router = with_policy(slow(100, 20)).await;
    let r = hold(
        &router,
        json!({"tenant": "acme", "policy": "writes", "cost": 90, "id": "h2"}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    // 10 left; 40 over the estimate: 10 spent, 20 into debt, 10 clamped.
    let r = post(&router, "/v1/holds/eu.acme.h2/settle", json!({"cost": 130})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let l = &r.body["limits"][0];
    assert_eq!(
        (&l["charged"], &l["clamped"], &l["refunded"], &l["debt"]),
        (&json!(30), &json!(10), &json!(0), &json!(20))
    );
    // In debt, checks are denied.
    let check = json!({"tenant": "acme", "policy": "writes"}).to_string();
    let r = send(&router, "POST", "/v1/check", None, Some(&check)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn a_released_hold_gives_the_whole_estimate_back_once() {
    let router = with_policy(slow(100, 0)).await;
    let r = hold(
        &router,
        json!({"tenant": "acme", "policy": "writes", "cost": 30}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let id = r.body["hold_id"].as_str().unwrap().to_string();
    assert!(id.starts_with("eu.acme."), "{id}");
    assert_eq!(left(&router).await, 70);
    let uri = format!("/v1/holds/{id}");
    let r = send(&router, "DELETE", &uri, Some(TOKEN), None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        (&r.body["state"], &r.body["limits"][0]["refunded"]),
        (&json!("released"), &json!(30))
    );
    assert_eq!(left(&router).await, 100);
    let r = post(&router, &format!("{uri}/release"), json!({})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["replayed"], true);
    assert_eq!(left(&router).await, 100);
    let r = post(&router, &format!("{uri}/settle"), json!({"cost": 3})).await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.body);
    assert_eq!(left(&router).await, 100);
}

#[tokio::test]
async fn a_hold_of_several_limits_is_all_or_nothing() {
    let router = with_policy(slow(100, 0)).await;
    let put = send(
        &router,
        "PUT",
        "/v1/tenants/acme/policies/daily",
        Some(TOKEN),
        Some(&json!({"limit": 1, "window_ms": 86_400_000, "burst": 20}).to_string()),
    )
    .await;
    assert_eq!(put.status, StatusCode::OK);
    let both = |cost: u64| json!({"tenant": "acme", "policies": ["writes", "daily"], "cost": cost});
    let first = hold(&router, both(15)).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    assert_eq!(left(&router).await, 85);
    // 5 left of `daily`: a hold of 10 is denied, and nothing is held on `writes` either.
    let r = hold(&router, both(10)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.body);
    assert!(r.body.get("hold_id").is_none(), "{}", r.body);
    assert_eq!(r.body["violated-policies"], json!(["daily"]));
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(left(&router).await, 85, "nothing held on either");
    let id = first.body["hold_id"].as_str().unwrap().to_string();
    let r = post(
        &router,
        &format!("/v1/holds/{id}/settle"),
        json!({"cost": 5}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let refunded: Vec<_> = r.body["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["policy"].clone(), l["refunded"].clone()))
        .collect();
    assert_eq!(
        refunded,
        [(json!("writes"), json!(10)), (json!("daily"), json!(10))]
    );
    assert_eq!(left(&router).await, 95);
}

#[tokio::test]
async fn an_expired_hold_keeps_its_estimate_spent_and_refuses_a_settle() {
    let router = with_policy(slow(100, 0)).await;
    let r = hold(
        &router,
        json!({"tenant": "acme", "policy": "writes", "cost": 10, "ttl_ms": 1, "id": "short"}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    // The store's clock (the embedded store's is the system clock) has passed 1 ms once
    // 5 ms have.
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let r = post(
        &router,
        "/v1/holds/eu.acme.short/settle",
        json!({"cost": 0}),
    )
    .await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.body);
    assert!(r.body["detail"].as_str().unwrap().contains("expired"));
    assert_eq!(left(&router).await, 90, "the estimate stays spent");
    // Never made: 404.
    let r = post(
        &router,
        "/v1/holds/eu.acme.never/settle",
        json!({"cost": 0}),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.body);
}

#[tokio::test]
async fn a_concurrency_limit_admits_its_slots_and_takes_released_ones_back() {
    let router =
        with_policy(json!({"limit": 2, "window_ms": 30_000, "algorithm": "concurrency"})).await;
    let acquire = || hold(&router, json!({"tenant": "acme", "policy": "writes"}));
    let a = acquire().await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(
        (&a.body["remaining"], &a.body["ttl_ms"]),
        (&json!(1), &json!(30_000))
    );
    let b = acquire().await;
    assert_eq!(b.status, StatusCode::OK, "{}", b.body);
    let c = acquire().await;
    assert_eq!(c.status, StatusCode::TOO_MANY_REQUESTS, "{}", c.body);
    let wait = c.body["retry_after_ms"].as_u64().unwrap();
    assert!((29_000..=30_000).contains(&wait), "{wait}");
    let id = a.body["hold_id"].as_str().unwrap();
    let r = send(
        &router,
        "DELETE",
        &format!("/v1/holds/{id}"),
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(acquire().await.status, StatusCode::OK);
    // A check, a slot of cost 2, a lease past the window, several limits: refused.
    let check = json!({"tenant": "acme", "policy": "writes"}).to_string();
    let r = send(&router, "POST", "/v1/check", None, Some(&check)).await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.body);
    let r = hold(
        &router,
        json!({"tenant": "acme", "policy": "writes", "cost": 2}),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert_eq!(r.body["errors"][0]["field"], "cost", "{}", r.body);
    let r = hold(
        &router,
        json!({"tenant": "acme", "policy": "writes", "ttl_ms": 30_001}),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert_eq!(r.body["errors"][0]["field"], "ttl_ms", "{}", r.body);
}

#[tokio::test]
async fn bad_holds_are_refused_by_field_and_change_nothing() {
    let router = with_policy(slow(100, 0)).await;
    let field_of = |r: &Reply| r.body["errors"][0]["field"].as_str().map(str::to_string);
    for (body, field) in [
        (
            json!({"tenant": "acme", "policy": "writes", "cost": -1}),
            "cost",
        ),
        (
            json!({"tenant": "acme", "policy": "writes", "cost": 2.5}),
            "cost",
        ),
        (
            json!({"tenant": "acme", "policy": "writes", "ttl_ms": 0}),
            "ttl_ms",
        ),
        (
            json!({"tenant": "acme", "policy": "writes", "ttl_ms": 3_600_001}),
            "ttl_ms",
        ),
        (
            json!({"tenant": "acme", "policy": "writes", "id": "a.b"}),
            "id",
        ),
        (json!({"tenant": "acme", "policies": []}), "policies"),
        (
            json!({"tenant": "acme", "policies": ["writes", "writes"]}),
            "policies",
        ),
    ] {
        let r = hold(&router, body.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.body);
        assert!(is_problem(&r));
        assert_eq!(field_of(&r).as_deref(), Some(field), "{body}: {}", r.body);
    }
    let r = hold(&router, json!({"tenant": "acme", "policy": "nope"})).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(left(&router).await, 100);

    let h = hold(
        &router,
        json!({"tenant": "acme", "policy": "writes", "cost": 10, "id": "mine"}),
    )
    .await;
    assert_eq!(h.status, StatusCode::OK);
    for (uri, body, field) in [
        ("/v1/holds/eu.acme.mine/settle", json!({"cost": -1}), "cost"),
        (
            "/v1/holds/eu.acme.mine/settle",
            json!({"cost": 1.5}),
            "cost",
        ),
        (
            "/v1/holds/eu.acme.mine/settle",
            json!({"cost": 9_007_199_255u64}),
            "cost",
        ),
        (
            "/v1/holds/eu.acme.mine/settle",
            json!({"cost": 1, "tenant": "other"}),
            "id",
        ),
        ("/v1/holds/not-an-id/settle", json!({"cost": 1}), "id"),
        // A region this cluster does not have.
        ("/v1/holds/mars.acme.mine/settle", json!({"cost": 1}), "id"),
    ] {
        let r = post(&router, uri, body.clone()).await;
        assert_eq!(
            r.status,
            StatusCode::BAD_REQUEST,
            "{uri} {body}: {}",
            r.body
        );
        assert_eq!(
            field_of(&r).as_deref(),
            Some(field),
            "{uri} {body}: {}",
            r.body
        );
    }
    assert_eq!(left(&router).await, 90);
    // A hold needs a token, even where checks are open.
    let r = send(
        &router,
        "POST",
        "/v1/holds",
        None,
        Some(&json!({"tenant": "acme", "policy": "writes"}).to_string()),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(left(&router).await, 90);
}

/// Another region relays a hold, a settle or a release with the peer token in place of an API
/// token (the sending region took the caller's): admitted with it, 401 with a wrong one.
#[tokio::test]
async fn a_relayed_hold_needs_the_peer_token_not_an_api_token() {
    use axum::body::Body;
    use axum::http::{header, Request};
    use tower::ServiceExt as _;

    use crate::config::BreakerConfig;
    use crate::decision::breaker::Breaker;
    use crate::decision::FORWARDED_HEADER;

    let router = crate::api::app(crate::api::tests::state_on_with_peer(
        quota_store::AnyStore::embedded(),
        Breaker::new(&BreakerConfig::default(), "eu"),
        Some("peer-token-0123456789"),
    ));
    let put = send(
        &router,
        "PUT",
        "/v1/tenants/acme/policies/writes",
        Some(TOKEN),
        Some(&slow(100, 0).to_string()),
    )
    .await;
    assert_eq!(put.status, StatusCode::OK);
    let relayed = |uri: &str, peer: &str, body: Value| {
        let router = router.clone();
        let req = Request::builder()
            .method("POST")
            .uri(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .header(FORWARDED_HEADER, peer)
            .body(Body::from(body.to_string()))
            .unwrap();
        async move { router.oneshot(req).await.unwrap().status() }
    };
    let body = json!({"tenant": "acme", "policy": "writes", "cost": 10, "id": "r1"});
    assert_eq!(
        relayed("/v1/holds", "wrong-token-0123456789", body.clone()).await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(left(&router).await, 100);
    assert_eq!(
        relayed("/v1/holds", "peer-token-0123456789", body).await,
        StatusCode::OK
    );
    assert_eq!(
        relayed(
            "/v1/holds/eu.acme.r1/settle",
            "peer-token-0123456789",
            json!({"cost": 4})
        )
        .await,
        StatusCode::OK
    );
    assert_eq!(left(&router).await, 96);
}

/// A release that repays a debt admits the next check at once, though a check denied in
/// debt was remembered by the denial cache (a settle or release drops it, as a refund does).
/// On a real redis-server: the cache remembers Redis's denials only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_repays_a_debt_clears_the_cached_denial() {
    use crate::config::BreakerConfig;
    use crate::decision::breaker::Breaker;

    let server = redis_harness::RedisServer::start().unwrap();
    let cfg = quota_store::RedisStoreConfig::standalone(server.url())
        .with_timeout(std::time::Duration::from_secs(30));
    let store = quota_store::AnyStore::Redis(quota_store::RedisStore::connect(cfg).await.unwrap());
    let router = crate::api::app(crate::api::tests::state_on(
        store,
        Breaker::new(&BreakerConfig::default(), "eu"),
    ));
    let put = send(
        &router,
        "PUT",
        "/v1/tenants/acme/policies/writes",
        Some(TOKEN),
        Some(&slow(100, 50).to_string()),
    )
    .await;
    assert_eq!(put.status, StatusCode::OK);
    let held = |id: &str| json!({"tenant": "acme", "policy": "writes", "cost": 50, "id": id});
    assert_eq!(hold(&router, held("a")).await.status, StatusCode::OK);
    assert_eq!(hold(&router, held("b")).await.status, StatusCode::OK);
    let r = post(&router, "/v1/holds/eu.acme.a/settle", json!({"cost": 60})).await;
    assert_eq!(r.body["limits"][0]["debt"], 10, "{}", r.body);
    let check = json!({"tenant": "acme", "policy": "writes"}).to_string();
    for _ in 0..2 {
        let r = send(&router, "POST", "/v1/check", None, Some(&check)).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.body);
    }
    let r = send(&router, "DELETE", "/v1/holds/eu.acme.b", Some(TOKEN), None).await;
    assert_eq!(r.body["limits"][0]["refunded"], 50, "{}", r.body);
    let r = send(&router, "POST", "/v1/check", None, Some(&check)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["remaining"], 39);
}
