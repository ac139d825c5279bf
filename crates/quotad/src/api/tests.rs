//! Handler tests through `oneshot`: no socket, a one-node coordinator, the embedded store.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};

use http_body_util::BodyExt as _;
use quota_core::RegionId;
use serde_json::{json, Value};
use tower::{Layer as _, ServiceExt as _};

use super::{app, AppShared, AppState};
use crate::api::Api;
use crate::config::BreakerConfig;
use crate::coordination::{Coordinator, LocalCoordinator};
use crate::decision::breaker::Breaker;
use crate::decision::{Decider, DeciderParts};
use crate::secret::Secret;
use crate::tokens::{Scope, Tokens};

pub(crate) const TOKEN: &str = "test-token";
/// The identity key of the test daemons.
const TEST_IDENTITY_KEY: &str = "test-identity-key-0123456789";

fn state() -> AppState {
    state_on(
        quota_store::AnyStore::embedded(),
        Breaker::new(&BreakerConfig::default(), "eu"),
    )
}

/// Region `eu` alone, deciding through `store` behind `breaker` (other modules' tests too).
pub(crate) fn state_on(store: quota_store::AnyStore, breaker: Breaker) -> AppState {
    state_on_with_peer(store, breaker, None)
}

/// [`state_on`] taking requests other regions relay with `peer_token`.
pub(crate) fn state_on_with_peer(
    store: quota_store::AnyStore,
    breaker: Breaker,
    peer_token: Option<&str>,
) -> AppState {
    let region = RegionId::new("eu").unwrap();
    let coordinator = Arc::new(Coordinator::Local(LocalCoordinator::in_temp_dir(
        region.clone(),
    )));
    let decider = Decider::new(DeciderParts {
        region: region.clone(),
        store,
        breaker,
        view: coordinator.subscribe(),
        homes: HashMap::new(),
        forward_timeout: Duration::from_millis(100),
        peer_token: peer_token.map(Secret::new),
        reservations: false,
        store_timeout: Duration::from_millis(100),
        daemons: 1,
    });
    state_with(coordinator, decider)
}

/// The API state around `decider` and `coordinator`.
pub(crate) fn state_with(coordinator: Arc<Coordinator>, decider: Decider) -> AppState {
    state_with_tokens(
        coordinator,
        decider,
        Tokens::admin_only(&Secret::new(TOKEN)),
        true,
    )
}

/// Region `eu` alone with `tokens`, checks open or not.
fn scoped_state(tokens: Tokens, open_checks: bool) -> AppState {
    let st = state();
    state_with_tokens(
        st.coordinator.clone(),
        Decider::new(DeciderParts {
            region: RegionId::new("eu").unwrap(),
            store: quota_store::AnyStore::embedded(),
            breaker: Breaker::new(&BreakerConfig::default(), "eu"),
            view: st.coordinator.subscribe(),
            homes: HashMap::new(),
            forward_timeout: Duration::from_millis(100),
            peer_token: None,
            reservations: false,
            store_timeout: Duration::from_millis(100),
            daemons: 1,
        }),
        tokens,
        open_checks,
    )
}

fn state_with_tokens(
    coordinator: Arc<Coordinator>,
    decider: Decider,
    tokens: Tokens,
    open_checks: bool,
) -> AppState {
    Arc::new(AppShared {
        decider: Arc::new(decider),
        coordinator,
        tokens: Arc::new(tokens),
        open_checks,
        metrics: None,
        ready: Arc::new(AtomicBool::new(true)),
        drift_margin_ms: 1000,
        body_limit_bytes: 4096,
        request_timeout: Duration::from_secs(5),
        identity_key: Some(crate::secret::Secret::new(TEST_IDENTITY_KEY.to_string())),
    })
}

pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: axum::http::HeaderMap,
    pub(crate) body: Value,
}

pub(crate) async fn send<S>(
    router: &S,
    method: &str,
    uri: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> Reply
where
    S: tower::Service<
            Request<Body>,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        > + Clone,
{
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    if body.is_some() {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    let req = req
        .body(Body::from(body.unwrap_or("").to_string()))
        .unwrap();
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Reply {
        status,
        headers,
        body,
    }
}

pub(crate) async fn with_policy(spec: Value) -> Api {
    let router = app(state());
    let r = send(
        &router,
        "PUT",
        "/v1/tenants/acme/policies/writes",
        Some(TOKEN),
        Some(&spec.to_string()),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    router
}

pub(crate) fn is_problem(r: &Reply) -> bool {
    r.headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v == "application/problem+json")
}

#[tokio::test]
async fn allowed_and_denied_checks_carry_ratelimit_fields() {
    let router = with_policy(json!({"limit": 3, "window_ms": 60000})).await;
    let check = json!({"tenant": "acme", "policy": "writes", "cost": 2}).to_string();
    let r = send(&router, "POST", "/v1/check", None, Some(&check)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body["allowed"], true);
    assert_eq!(r.body["remaining"], 1);
    assert_eq!(r.body["region"], "eu");
    assert_eq!(r.headers["ratelimit-policy"], "\"writes\";q=3;w=60");
    assert_eq!(r.headers["ratelimit"], "\"writes\";r=1;t=40");
    assert!(r.headers.get(header::RETRY_AFTER).is_none());
    assert!(r.headers.contains_key("x-request-id"));

    let r = send(&router, "POST", "/v1/check", None, Some(&check)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(is_problem(&r));
    assert_eq!(r.body["code"], "RATE_LIMITED");
    assert_eq!(r.body["allowed"], false);
    assert_eq!(r.body["violated-policies"], json!(["writes"]));
    // One token short at 3 tokens a minute: 20 s, less the few ms the wall clock moved.
    let ms = r.body["retry_after_ms"].as_u64().unwrap();
    assert!((19_000..=20_000).contains(&ms), "{ms}");
    assert_eq!(r.headers[header::RETRY_AFTER], "20");
    assert_eq!(r.headers["ratelimit"], "\"writes\";r=1;t=20");
    let text = r.body.to_string();
    assert!(!text.contains("qd:v1"), "no key names in responses: {text}");
}

#[tokio::test]
async fn retry_after_rounds_up_to_whole_seconds() {
    // 7 tokens per 10 s: one token every 1428.57 ms.
    let router = with_policy(json!({"limit": 7, "window_ms": 10000})).await;
    let check = json!({"tenant": "acme", "policy": "writes", "cost": 7}).to_string();
    assert_eq!(
        send(&router, "POST", "/v1/check", None, Some(&check))
            .await
            .status,
        StatusCode::OK
    );
    let one = json!({"tenant": "acme", "policy": "writes"}).to_string();
    let r = send(&router, "POST", "/v1/check", None, Some(&one)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    let ms = r.body["retry_after_ms"].as_u64().unwrap();
    assert!((1400..=1429).contains(&ms), "{ms}");
    assert_eq!(r.headers[header::RETRY_AFTER], "2");
}

#[tokio::test]
async fn unknown_policy_is_a_404_problem_not_an_allow() {
    let router = app(state());
    let check = json!({"tenant": "acme", "policy": "writes"}).to_string();
    let r = send(&router, "POST", "/v1/check", None, Some(&check)).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert!(is_problem(&r));
    assert_eq!(r.body["code"], "NOT_FOUND");
}

#[tokio::test]
async fn bad_checks_are_400_problems_naming_the_field() {
    let router = with_policy(json!({"limit": 10, "window_ms": 1000})).await;
    let cases = [
        (
            json!({"tenant": "ac me", "policy": "writes"}).to_string(),
            "tenant",
        ),
        (
            json!({"tenant": "acme", "policy": "wr{ites"}).to_string(),
            "policy",
        ),
        (
            json!({"tenant": "acme", "policy": "writes", "cost": 0}).to_string(),
            "cost",
        ),
        (
            json!({"tenant": "acme", "policy": "writes", "cost": -3}).to_string(),
            "cost",
        ),
        (
            json!({"tenant": "acme", "policy": "writes", "cost": 1.5}).to_string(),
            "cost",
        ),
        (
            json!({"tenant": "acme", "policy": "writes", "cost": 11}).to_string(),
            "cost",
        ),
    ];
    for (body, field) in cases {
        let r = send(&router, "POST", "/v1/check", None, Some(&body)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
        assert!(is_problem(&r));
        assert_eq!(r.body["errors"][0]["field"], field, "{body}: {}", r.body);
    }
    for body in [
        "{not json",
        r#"{"tenant": "acme", "policy": "writes", "extra": 1}"#,
        r#"{"tenant": 5, "policy": "writes"}"#,
        "[]",
    ] {
        let r = send(&router, "POST", "/v1/check", None, Some(body)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(r.body["code"], "INVALID_REQUEST");
    }
    // None of these spent a token.
    let full = json!({"tenant": "acme", "policy": "writes", "cost": 10}).to_string();
    assert_eq!(
        send(&router, "POST", "/v1/check", None, Some(&full))
            .await
            .status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn huge_bodies_and_wrong_media_types_are_refused() {
    let router = app(state());
    let huge = format!(
        r#"{{"tenant": "{}", "policy": "writes"}}"#,
        "a".repeat(10_000)
    );
    let r = send(&router, "POST", "/v1/check", None, Some(&huge)).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(is_problem(&r));
    let req = Request::post("/v1/check").body(Body::from("{}")).unwrap();
    let resp = router.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
}

#[tokio::test]
async fn mutations_need_the_token_and_change_nothing_without_it() {
    let router = app(state());
    let spec = json!({"limit": 10, "window_ms": 1000}).to_string();
    for token in [None, Some("wrong"), Some("")] {
        let r = send(
            &router,
            "PUT",
            "/v1/tenants/acme/policies/writes",
            token,
            Some(&spec),
        )
        .await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
        assert_eq!(r.headers[header::WWW_AUTHENTICATE], "Bearer");
        assert!(is_problem(&r));
    }
    let r = send(
        &router,
        "GET",
        "/v1/tenants/acme/policies/writes",
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = send(
        &router,
        "DELETE",
        "/v1/tenants/acme/pin",
        Some("nope"),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = send(&router, "GET", "/v1/policies", None, None).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn invalid_policies_list_every_problem() {
    let router = app(state());
    let spec = json!({"limit": -1, "window_ms": 0, "floor": 2}).to_string();
    let r = send(
        &router,
        "PUT",
        "/v1/tenants/acme/policies/writes",
        Some(TOKEN),
        Some(&spec),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.body["code"], "INVALID_POLICY");
    let fields: Vec<_> = r.body["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["field"].clone())
        .collect();
    assert_eq!(fields, [json!("limit"), json!("window_ms"), json!("floor")]);
    let unknown = json!({"limit": 1, "window_ms": 1, "colour": "red"}).to_string();
    let r = send(
        &router,
        "PUT",
        "/v1/tenants/acme/policies/writes",
        Some(TOKEN),
        Some(&unknown),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.body["detail"].as_str().unwrap().contains("colour"));
    let r = send(
        &router,
        "PUT",
        "/v1/tenants/ac%20me/policies/writes",
        Some(TOKEN),
        Some(&spec),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.body["errors"][0]["field"], "tenant");
}

#[tokio::test]
async fn policy_crud_pin_and_listing() {
    let router = with_policy(json!({"limit": 100, "window_ms": 60000, "burst": 150, "fail_mode": "closed", "floor": 0.1})).await;
    let r = send(
        &router,
        "GET",
        "/v1/tenants/acme/policies/writes",
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(r.body["burst"], 150);
    assert_eq!(r.body["fail_mode"], "closed");
    assert_eq!(r.body["version"], 1);
    for i in 0..5 {
        let spec = json!({"limit": 1, "window_ms": 1000}).to_string();
        let r = send(
            &router,
            "PUT",
            &format!("/v1/tenants/t{i}/policies/p"),
            Some(TOKEN),
            Some(&spec),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let page = send(&router, "GET", "/v1/policies?limit=4", Some(TOKEN), None).await;
    assert_eq!(page.body["policies"].as_array().unwrap().len(), 4);
    let next = page.body["next"].as_str().unwrap().to_string();
    let page2 = send(
        &router,
        "GET",
        &format!("/v1/policies?limit=4&after={next}"),
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(page2.body["policies"].as_array().unwrap().len(), 2);
    assert!(page2.body["next"].is_null());
    let bad = send(&router, "GET", "/v1/policies?limit=0", Some(TOKEN), None).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);

    let r = send(
        &router,
        "PUT",
        "/v1/tenants/acme/pin",
        Some(TOKEN),
        Some(r#"{"region": "us"}"#),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "unknown region");
    let r = send(
        &router,
        "PUT",
        "/v1/tenants/acme/pin",
        Some(TOKEN),
        Some(r#"{"region": "eu"}"#),
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    // Spend 40 of the 150: the allowance reads the bucket without spending, twice alike.
    let check = r#"{"tenant": "acme", "policy": "writes", "cost": 40}"#;
    let r = send(&router, "POST", "/v1/check", None, Some(check)).await;
    assert_eq!(r.status, StatusCode::OK);
    for _ in 0..2 {
        let r = send(
            &router,
            "GET",
            "/v1/tenants/acme/allowance",
            Some(TOKEN),
            None,
        )
        .await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.body["pin"], "eu");
        let p = &r.body["policies"][0];
        assert_eq!(p["limit"], 100);
        assert_eq!(p["this_region"]["share"], 1.0);
        assert_eq!(p["this_region"]["capacity"], 150.0);
        // One region: its lease never ends, so nothing can be spent twice.
        assert_eq!(p["worst_case_overshoot_tokens"], 0.0);
        // 110 left, plus whatever refilled since (100 per minute): well under one token.
        let left = p["this_region"]["tokens_left"].as_u64().unwrap();
        assert!((110..=111).contains(&left), "{left}");
        assert_eq!(p["regions"][0]["region"], "eu");
    }
    let r = send(&router, "DELETE", "/v1/tenants/acme/pin", Some(TOKEN), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    // Deleting twice finds nothing the second time.
    for want in [StatusCode::NO_CONTENT, StatusCode::NOT_FOUND] {
        let path = "/v1/tenants/acme/policies/writes";
        let r = send(&router, "DELETE", path, Some(TOKEN), None).await;
        assert_eq!(r.status, want);
    }
    let r = send(
        &router,
        "GET",
        "/v1/tenants/acme/allowance",
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_tenant_is_pinned_before_its_policies_exist() {
    let router = app(state());
    let pin = |router: &Api| {
        let router = router.clone();
        async move {
            send(
                &router,
                "PUT",
                "/v1/tenants/newco/pin",
                Some(TOKEN),
                Some(r#"{"region": "eu"}"#),
            )
            .await
        }
    };
    assert_eq!(pin(&router).await.status, StatusCode::NO_CONTENT);
    let spec = json!({"limit": 10, "window_ms": 1000}).to_string();
    let r = send(
        &router,
        "PUT",
        "/v1/tenants/newco/policies/writes",
        Some(TOKEN),
        Some(&spec),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = send(
        &router,
        "GET",
        "/v1/tenants/newco/allowance",
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(r.body["pin"], "eu", "{}", r.body);
    let r = send(&router, "GET", "/v1/status", Some(TOKEN), None).await;
    assert_eq!(
        (r.body["pins"].as_u64(), r.body["pinned_tenants"].as_u64()),
        (Some(1), Some(1))
    );
    // Pinning again is idempotent; unpinning twice finds no pin the second time.
    assert_eq!(pin(&router).await.status, StatusCode::NO_CONTENT);
    for want in [StatusCode::NO_CONTENT, StatusCode::NOT_FOUND] {
        let r = send(
            &router,
            "DELETE",
            "/v1/tenants/newco/pin",
            Some(TOKEN),
            None,
        )
        .await;
        assert_eq!(r.status, want);
        assert_eq!(is_problem(&r), want == StatusCode::NOT_FOUND);
    }
    let r = send(
        &router,
        "GET",
        "/v1/tenants/newco/allowance",
        Some(TOKEN),
        None,
    )
    .await;
    assert!(r.body["pin"].is_null(), "{}", r.body);
}

#[tokio::test]
async fn batch_decides_each_check_in_order() {
    let router = with_policy(json!({"limit": 2, "window_ms": 60000})).await;
    let body = json!({"checks": [
        {"tenant": "acme", "policy": "writes"},
        {"tenant": "acme", "policy": "writes"},
        {"tenant": "acme", "policy": "writes"},
        {"tenant": "acme", "policy": "nope"},
        {"tenant": "acme", "policy": "writes", "cost": 0},
    ]})
    .to_string();
    let r = send(&router, "POST", "/v1/check/batch", None, Some(&body)).await;
    assert_eq!(r.status, StatusCode::OK);
    let statuses: Vec<_> = r.body["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["status"].as_u64().unwrap())
        .collect();
    assert_eq!(statuses, [200, 200, 429, 404, 400]);
    assert_eq!(
        r.body["results"][4]["problem"]["errors"][0]["field"],
        "checks[4].cost"
    );
    let empty = send(
        &router,
        "POST",
        "/v1/check/batch",
        None,
        Some(r#"{"checks": []}"#),
    )
    .await;
    assert_eq!(empty.status, StatusCode::BAD_REQUEST);
}

/// Checks of two buckets interleaved: each bucket spends its tokens in request order (the
/// buckets are decided concurrently), and the results come back in request order.
#[tokio::test]
async fn batch_keeps_each_buckets_order_and_the_request_order() {
    let router = with_policy(json!({"limit": 2, "window_ms": 60000})).await;
    let spec = json!({"limit": 1, "window_ms": 60000}).to_string();
    let put = "/v1/tenants/beta/policies/writes";
    assert_eq!(
        send(&router, "PUT", put, Some(TOKEN), Some(&spec))
            .await
            .status,
        StatusCode::OK
    );
    let (a, b) = (
        json!({"tenant": "acme", "policy": "writes"}),
        json!({"tenant": "beta", "policy": "writes"}),
    );
    let body = json!({"checks": [a, b, a, b, a, b]}).to_string();
    let r = send(&router, "POST", "/v1/check/batch", None, Some(&body)).await;
    assert_eq!(r.status, StatusCode::OK);
    let results = r.body["results"].as_array().unwrap();
    let got: Vec<_> = results
        .iter()
        .map(|i| {
            (
                i["status"].as_u64().unwrap(),
                i["decision"]["remaining"].as_u64(),
            )
        })
        .collect();
    let want = [(200, 1), (200, 0), (200, 0), (429, 0), (429, 0), (429, 0)];
    assert_eq!(got, want.map(|(s, r)| (s, Some(r))));
}

/// A batch's checks for tenants pinned elsewhere go to their home in one request (here a
/// server standing in for region a that records what it gets); the results keep request order.
#[tokio::test]
async fn a_batchs_pinned_checks_go_home_in_one_request() {
    let (decider, seen) = crate::decision::tests::decider_with_home(200).await;
    let region = RegionId::new("b").unwrap();
    let coordinator = Arc::new(Coordinator::Local(LocalCoordinator::in_temp_dir(region)));
    let router = app(state_with(coordinator, decider));
    let body = json!({"checks": [
        {"tenant": "vip", "policy": "w"},
        {"tenant": "strict", "policy": "w", "cost": 2},
        {"tenant": "vip", "policy": "w", "cost": 0},
        {"tenant": "vip", "policy": "w", "cost": 3},
    ]})
    .to_string();
    let r = send(&router, "POST", "/v1/check/batch", None, Some(&body)).await;
    assert_eq!(r.status, StatusCode::OK);
    let got: Vec<_> = r.body["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            (
                i["status"].as_u64().unwrap(),
                i["decision"]["mode"].as_str(),
            )
        })
        .collect();
    let home = (200, Some("forwarded"));
    assert_eq!(got, [home, home, (400, None), home], "{}", r.body);
    assert_eq!(
        r.body["results"][2]["problem"]["errors"][0]["field"],
        "checks[2].cost"
    );
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1, "{seen:?}");
    let costs: Vec<_> = seen[0].2["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["cost"].as_u64().unwrap())
        .collect();
    assert_eq!(costs, [1, 2, 3]);
}

#[tokio::test]
async fn status_health_and_openapi() {
    let st = state();
    let ready = st.ready.clone();
    let router = app(st);
    let r = send(&router, "GET", "/v1/status", Some(TOKEN), None).await;
    assert_eq!(r.body["region"], "eu");
    assert_eq!(r.body["raft"]["role"], "single");
    assert_eq!(r.body["store"]["kind"], "embedded");
    assert_eq!(r.body["store"]["topology"], "embedded");
    assert_eq!(
        send(&router, "GET", "/livez", None, None).await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(&router, "GET", "/readyz", None, None).await.status,
        StatusCode::OK
    );
    ready.store(false, Ordering::Relaxed);
    assert_eq!(
        send(&router, "GET", "/readyz", None, None).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let doc = send(&router, "GET", "/openapi.json", None, None).await;
    let paths = doc.body["paths"].as_object().unwrap();
    for p in [
        "/v1/check",
        "/v1/check/batch",
        "/v1/tenants/{tenant}/policies/{policy}",
        "/v1/tenants/{tenant}/allowance",
        "/v1/status",
        "/v1/policies",
        "/v1/policies/batch",
    ] {
        assert!(
            paths.contains_key(p),
            "{p} missing from the OpenAPI document"
        );
    }
    let add = json!({"node_id": 4, "region": "ap", "peer": "127.0.0.1:1", "api": "127.0.0.1:2"})
        .to_string();
    let r = send(&router, "POST", "/v1/cluster/members", None, Some(&add)).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = send(
        &router,
        "POST",
        "/v1/cluster/members",
        Some(TOKEN),
        Some(&add),
    )
    .await;
    assert_eq!(
        r.status,
        StatusCode::CONFLICT,
        "a single region has no membership: {}",
        r.body
    );
    let bad = json!({"node_id": 0, "region": "ap", "peer": "x", "api": "127.0.0.1:2"}).to_string();
    let r = send(
        &router,
        "POST",
        "/v1/cluster/members",
        Some(TOKEN),
        Some(&bad),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = send(&router, "GET", "/no/such/route", None, None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert!(is_problem(&r));
}

#[test]
fn header_text_builds_what_format_would() {
    use super::header_text::HeaderText;
    let v = HeaderText::new()
        .str("\"writes\";q=")
        .num(10_000)
        .str(";w=")
        .num(u64::MAX)
        .value()
        .unwrap();
    assert_eq!(v, format!("\"writes\";q=10000;w={}", u64::MAX).as_str());
    for (n, width) in [
        (0u64, 1),
        (0, 8),
        (0xabc, 8),
        (0x1234_5678_9abc, 1),
        (u64::MAX, 8),
    ] {
        let v = HeaderText::new().hex(n, width).value().unwrap();
        assert_eq!(
            v,
            format!("{n:0width$x}").as_str(),
            "{n:x} at width {width}"
        );
    }
    // Past the stack buffer the text spills to the heap, whole.
    let long = "x".repeat(300);
    let v = HeaderText::new()
        .str(&long[..100])
        .str(&long[100..])
        .num(7)
        .value()
        .unwrap();
    assert_eq!(v, format!("{long}7").as_str());
    // A byte no header value may hold gives None, not a panic.
    assert!(HeaderText::new().str("a\r\nb").value().is_none());
}

#[test]
fn check_bodies_written_directly_are_what_serde_writes() {
    use crate::api::check::CheckResponse;
    use crate::decision::Mode;
    let modes = [
        Mode::Normal,
        Mode::DegradedLocal,
        Mode::DegradedOpen,
        Mode::Forwarded,
        Mode::HomeUnreachableFloor,
    ];
    for (i, mode) in modes.into_iter().enumerate() {
        let r = CheckResponse {
            allowed: i % 2 == 0,
            remaining: [0, 1, 99, u64::MAX, 12_345][i],
            retry_after_ms: [0, 7, u64::MAX, 1000, 3][i],
            reset_ms: [60_000, 0, 1, u64::MAX, 42][i],
            region: ["eu", "us-east_1", "ap", "x", "Z9"][i].to_string(),
            // Not a valid id: the fallback must still write valid, equal JSON.
            decided_by: ["eu", "us-east_1", "quote\"back\\slash", "ü", "\n"][i].to_string(),
            mode,
            shadow_denied: i % 3 == 1,
        };
        let direct = String::from_utf8(r.to_json()).unwrap();
        assert_eq!(direct, serde_json::to_string(&r).unwrap());
        assert_eq!(serde_json::to_value(mode).unwrap(), mode.as_str());
    }
}

/// The check fast path (`api::routes`) answers as the router's route does: two daemons with
/// the same policy, one served whole and one with every request through the router, get the
/// same requests and give the same answers.
#[tokio::test]
async fn checks_past_the_router_are_answered_as_through_it() {
    let fast = app(state());
    let routed_state = state();
    let routed =
        super::edge::EdgeLayer::new(routed_state.body_limit_bytes, routed_state.request_timeout)
            .layer(super::router(routed_state));
    let spec = json!({"limit": 3, "window_ms": 60000}).to_string();
    let put = "/v1/tenants/acme/policies/writes";
    assert_eq!(
        send(&fast, "PUT", put, Some(TOKEN), Some(&spec))
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        send(&routed, "PUT", put, Some(TOKEN), Some(&spec))
            .await
            .status,
        StatusCode::OK
    );
    let check = |cost: u64| json!({"tenant": "acme", "policy": "writes", "cost": cost}).to_string();
    let unknown = json!({"tenant": "acme", "policy": "reads"}).to_string();
    let extra = json!({"tenant": "acme", "policy": "writes", "colour": "red"}).to_string();
    let (c, bad) = ("/v1/check", "{\"tenant\": ".to_string());
    let cases: Vec<(&str, &str, Option<String>, u16)> = vec![
        ("POST", c, Some(check(2)), 200),
        ("POST", "/v1/check?trace=1", Some(check(1)), 200),
        ("POST", c, Some(check(1)), 429),
        ("POST", c, Some(check(0)), 400),
        ("POST", c, Some(check(4)), 400),
        ("POST", c, Some(unknown), 404),
        ("POST", c, Some(extra), 400),
        ("POST", c, Some(bad), 400),
        ("POST", c, Some("x".repeat(5000)), 413),
        ("POST", c, None, 415),
        ("GET", c, None, 405),
        ("PUT", c, Some(check(1)), 405),
        ("POST", "/v1/check/", Some(check(1)), 404),
        ("POST", "/V1/check", Some(check(1)), 404),
    ];
    for (method, uri, body, status) in cases {
        let a = send(&fast, method, uri, None, body.as_deref()).await;
        let b = send(&routed, method, uri, None, body.as_deref()).await;
        let what = format!("{method} {uri} {body:?}");
        assert_eq!(a.status.as_u16(), status, "{what}: {}", a.body);
        assert_eq!(b.status.as_u16(), status, "{what}: {}", b.body);
        // The wall clock moves between the two: the waits in ms may differ by a millisecond
        // (the RateLimit fields round them up to whole seconds, and are compared).
        let (mut ab, mut bb) = (a.body.clone(), b.body.clone());
        for v in [&mut ab, &mut bb] {
            if let Some(o) = v.as_object_mut() {
                o.remove("retry_after_ms");
                o.remove("reset_ms");
            }
        }
        assert_eq!(ab, bb, "{what}");
        // The router sets Content-Length from the body's exact size; past it, hyper writes the
        // same from the same size on the wire (system test `bad_input` reads it there).
        let names = |h: &axum::http::HeaderMap| {
            let mut n: Vec<String> = h
                .keys()
                .filter(|k| *k != header::CONTENT_LENGTH)
                .map(|k| k.to_string())
                .collect();
            n.sort();
            n
        };
        assert_eq!(names(&a.headers), names(&b.headers), "{what}");
        for (name, value) in &a.headers {
            if name != "x-request-id" && name != header::CONTENT_LENGTH {
                assert_eq!(Some(value), b.headers.get(name), "{what}: {name}");
            }
        }
    }
}

/// `POST /v1/policies/batch` with the admin token.
async fn put_batch(router: &Api, body: &str) -> Reply {
    send(
        router,
        "POST",
        "/v1/policies/batch",
        Some(TOKEN),
        Some(body),
    )
    .await
}

/// The `field`s of a problem's `errors`, in order.
fn problem_fields(r: &Reply) -> Vec<String> {
    r.body["errors"]
        .as_array()
        .map(|e| {
            e.iter()
                .map(|e| e["field"].as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn a_policy_batch_is_stored_whole_with_consecutive_versions() {
    let router = app(state());
    let body = json!({"policies": [
        {"tenant": "acme", "policy": "writes", "limit": 10, "window_ms": 1000},
        {"tenant": "acme", "policy": "reads", "limit": 50, "window_ms": 1000, "fail_mode": "closed"},
        {"tenant": "globex", "policy": "writes", "limit": 5, "window_ms": 60000, "burst": 8},
    ]})
    .to_string();
    let r = put_batch(&router, &body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let stored = r.body["policies"].as_array().unwrap();
    let summary: Vec<_> = stored
        .iter()
        .map(|p| {
            (
                p["tenant"].clone(),
                p["policy"].clone(),
                p["version"].clone(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (json!("acme"), json!("writes"), json!(1)),
            (json!("acme"), json!("reads"), json!(2)),
            (json!("globex"), json!("writes"), json!(3)),
        ]
    );
    assert_eq!(stored[1]["fail_mode"], "closed");
    let r = send(
        &router,
        "GET",
        "/v1/tenants/globex/policies/writes",
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(
        (r.body["burst"].clone(), r.body["version"].clone()),
        (json!(8), json!(3))
    );
    // Stored policies decide at once, and a later batch replaces one with a new version.
    let check = json!({"tenant": "acme", "policy": "writes"}).to_string();
    let r = send(&router, "POST", "/v1/check", None, Some(&check)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let again = json!({"policies": [{"tenant": "acme", "policy": "writes", "limit": 20, "window_ms": 1000}]}).to_string();
    let r = put_batch(&router, &again).await;
    assert_eq!(r.body["policies"][0]["version"], 4, "{}", r.body);

    // Without the token: 401, nothing stored.
    let other = json!({"policies": [{"tenant": "initech", "policy": "writes", "limit": 1, "window_ms": 1}]}).to_string();
    let r = send(&router, "POST", "/v1/policies/batch", None, Some(&other)).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = send(
        &router,
        "GET",
        "/v1/tenants/initech/policies/writes",
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_bad_policy_batch_names_every_problem_by_place_and_stores_nothing() {
    let router = app(state());
    let body = json!({"policies": [
        {"tenant": "acme", "policy": "writes", "limit": 10, "window_ms": 1000},
        {"policy": "writes", "limit": 10, "window_ms": 1000},
        {"tenant": "ac me", "policy": 7, "limit": 10, "window_ms": 1000},
        {"tenant": "acme", "policy": "reads", "limit": -1, "window_ms": 0},
        {"tenant": "acme", "policy": "deletes", "limit": 1, "window_ms": 1, "colour": "red"},
        {"tenant": "acme", "policy": "writes", "limit": 20, "window_ms": 1000},
    ]})
    .to_string();
    let r = put_batch(&router, &body).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert!(is_problem(&r));
    assert_eq!(r.body["code"], "INVALID_POLICY");
    assert_eq!(
        problem_fields(&r),
        [
            "policies[1].tenant",
            "policies[2].tenant",
            "policies[2].policy",
            "policies[3].limit",
            "policies[3].window_ms",
            "policies[4].colour",
            "policies[5]",
        ]
    );
    let text = r.body.to_string();
    assert!(
        text.contains("colour") && text.contains("policies[0]"),
        "{text}"
    );
    for (tenant, policy) in [("acme", "writes"), ("acme", "reads")] {
        let r = send(
            &router,
            "GET",
            &format!("/v1/tenants/{tenant}/policies/{policy}"),
            Some(TOKEN),
            None,
        )
        .await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "nothing stored");
    }

    for (body, field) in [
        (json!({"policies": []}), "policies"),
        (json!({"policies": [], "extra": 1}), ""),
        (json!({"checks": []}), ""),
    ] {
        let r = put_batch(&router, &body.to_string()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
        assert!(is_problem(&r));
        if !field.is_empty() {
            assert_eq!(problem_fields(&r), [field]);
        }
    }
}

#[tokio::test]
async fn a_policy_batch_holds_at_most_the_coordinators_limit() {
    let mut state = state();
    Arc::get_mut(&mut state).unwrap().body_limit_bytes = 2 << 20;
    let router = app(state);
    let batch = |n: usize| {
        let policies: Vec<_> = (0..n)
            .map(|i| json!({"tenant": format!("t{i}"), "policy": "p", "limit": 1, "window_ms": 1000}))
            .collect();
        json!({ "policies": policies }).to_string()
    };
    let max = quota_core::coordinator::MAX_BATCH_POLICIES;
    let r = put_batch(&router, &batch(max + 1)).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert_eq!(problem_fields(&r), ["policies"]);
    let r = put_batch(&router, &batch(max)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["policies"].as_array().unwrap().len(), max);
    assert_eq!(r.body["policies"][max - 1]["version"], max as u64);
}

/// The operation of `method` at `template` in the OpenAPI document.
fn documented_statuses(doc: &Value, method: &str, template: &str) -> Vec<String> {
    let op = &doc["paths"][template][method.to_ascii_lowercase()];
    assert!(op.is_object(), "{method} {template} is not in the document");
    op["responses"]
        .as_object()
        .map(|r| r.keys().cloned().collect())
        .unwrap_or_default()
}

/// Every status a route answers, gathered by sending it good and bad requests, is one the
/// OpenAPI document lists for that route.
#[tokio::test]
async fn every_status_a_route_answers_is_in_the_document() {
    let router = with_policy(json!({"limit": 1, "window_ms": 60000})).await;
    let doc = send(&router, "GET", "/openapi.json", None, None).await.body;
    let big = format!(r#"{{"x":"{}"}}"#, "y".repeat(5000));
    let policy = r#"{"limit":5,"window_ms":1000}"#;
    let check = r#"{"tenant":"acme","policy":"writes"}"#;
    let member = r#"{"node_id":2,"region":"us","peer":"127.0.0.1:1","api":"127.0.0.1:2"}"#;
    // (method, template, uri, token, body); a body of None is sent without a content type.
    let t = Some(TOKEN);
    type Case<'a> = (&'a str, &'a str, String, Option<&'a str>, Option<&'a str>);
    let charge = r#"{"tenant":"acme","policy":"writes","cost":3,"id":"c-1"}"#;
    let hold = r#"{"tenant":"acme","policy":"writes","id":"h-1"}"#;
    let cases: Vec<Case> = vec![
        ("POST", "/v1/check", "/v1/check".into(), None, Some(check)),
        ("POST", "/v1/check", "/v1/check".into(), None, Some(check)),
        ("POST", "/v1/check", "/v1/check".into(), None, Some("[1]")),
        ("POST", "/v1/check", "/v1/check".into(), None, None),
        ("POST", "/v1/check", "/v1/check".into(), None, Some(&big)),
        (
            "POST",
            "/v1/check",
            "/v1/check".into(),
            None,
            Some(r#"{"tenant":"x","policy":"y"}"#),
        ),
        (
            "POST",
            "/v1/check/batch",
            "/v1/check/batch".into(),
            None,
            Some(r#"{"checks":[{"tenant":"acme","policy":"writes"}]}"#),
        ),
        (
            "POST",
            "/v1/check/batch",
            "/v1/check/batch".into(),
            None,
            Some(r#"{"checks":[["acme","writes"]]}"#),
        ),
        (
            "POST",
            "/v1/check/batch",
            "/v1/check/batch".into(),
            None,
            None,
        ),
        (
            "POST",
            "/v1/check/batch",
            "/v1/check/batch".into(),
            None,
            Some(&big),
        ),
        (
            "PUT",
            "/v1/tenants/{tenant}/policies/{policy}",
            "/v1/tenants/acme/policies/p2".into(),
            t,
            Some(policy),
        ),
        (
            "PUT",
            "/v1/tenants/{tenant}/policies/{policy}",
            "/v1/tenants/acme/policies/p2".into(),
            t,
            Some(r#"{"limit":"x","window_ms":1}"#),
        ),
        (
            "PUT",
            "/v1/tenants/{tenant}/policies/{policy}",
            "/v1/tenants/%C0%AE/policies/p2".into(),
            t,
            Some(policy),
        ),
        (
            "PUT",
            "/v1/tenants/{tenant}/policies/{policy}",
            "/v1/tenants/acme/policies/p2".into(),
            None,
            Some(policy),
        ),
        (
            "PUT",
            "/v1/tenants/{tenant}/policies/{policy}",
            "/v1/tenants/acme/policies/p2".into(),
            t,
            None,
        ),
        (
            "PUT",
            "/v1/tenants/{tenant}/policies/{policy}",
            "/v1/tenants/acme/policies/p2".into(),
            t,
            Some(&big),
        ),
        (
            "GET",
            "/v1/tenants/{tenant}/policies/{policy}",
            "/v1/tenants/acme/policies/writes".into(),
            None,
            None,
        ),
        (
            "GET",
            "/v1/tenants/{tenant}/policies/{policy}",
            "/v1/tenants/acme/policies/none".into(),
            None,
            None,
        ),
        (
            "GET",
            "/v1/tenants/{tenant}/policies/{policy}",
            "/v1/tenants/a.b/policies/none".into(),
            None,
            None,
        ),
        (
            "DELETE",
            "/v1/tenants/{tenant}/policies/{policy}",
            "/v1/tenants/acme/policies/p2".into(),
            t,
            None,
        ),
        (
            "DELETE",
            "/v1/tenants/{tenant}/policies/{policy}",
            "/v1/tenants/acme/policies/p2".into(),
            t,
            None,
        ),
        (
            "DELETE",
            "/v1/tenants/{tenant}/policies/{policy}",
            "/v1/tenants/a.b/policies/p2".into(),
            t,
            None,
        ),
        (
            "DELETE",
            "/v1/tenants/{tenant}/policies/{policy}",
            "/v1/tenants/acme/policies/p2".into(),
            None,
            None,
        ),
        (
            "PUT",
            "/v1/tenants/{tenant}/pin",
            "/v1/tenants/acme/pin".into(),
            t,
            Some(r#"{"region":"eu"}"#),
        ),
        (
            "PUT",
            "/v1/tenants/{tenant}/pin",
            "/v1/tenants/acme/pin".into(),
            t,
            Some(r#"{"region":"us"}"#),
        ),
        (
            "PUT",
            "/v1/tenants/{tenant}/pin",
            "/v1/tenants/acme/pin".into(),
            None,
            Some(r#"{"region":"eu"}"#),
        ),
        (
            "PUT",
            "/v1/tenants/{tenant}/pin",
            "/v1/tenants/acme/pin".into(),
            t,
            None,
        ),
        (
            "PUT",
            "/v1/tenants/{tenant}/pin",
            "/v1/tenants/acme/pin".into(),
            t,
            Some(&big),
        ),
        (
            "DELETE",
            "/v1/tenants/{tenant}/pin",
            "/v1/tenants/acme/pin".into(),
            t,
            None,
        ),
        (
            "DELETE",
            "/v1/tenants/{tenant}/pin",
            "/v1/tenants/acme/pin".into(),
            t,
            None,
        ),
        (
            "DELETE",
            "/v1/tenants/{tenant}/pin",
            "/v1/tenants/acme/pin".into(),
            None,
            None,
        ),
        (
            "DELETE",
            "/v1/tenants/{tenant}/pin",
            "/v1/tenants/a.b/pin".into(),
            t,
            None,
        ),
        (
            "GET",
            "/v1/tenants/{tenant}/allowance",
            "/v1/tenants/acme/allowance".into(),
            None,
            None,
        ),
        (
            "GET",
            "/v1/tenants/{tenant}/allowance",
            "/v1/tenants/nobody/allowance".into(),
            None,
            None,
        ),
        (
            "GET",
            "/v1/tenants/{tenant}/allowance",
            "/v1/tenants/%C0%AE/allowance".into(),
            None,
            None,
        ),
        (
            "GET",
            "/v1/policies",
            "/v1/policies?limit=1".into(),
            t,
            None,
        ),
        (
            "GET",
            "/v1/policies",
            "/v1/policies?limit=0".into(),
            t,
            None,
        ),
        (
            "GET",
            "/v1/policies",
            "/v1/policies?limit=x".into(),
            t,
            None,
        ),
        ("GET", "/v1/policies", "/v1/policies".into(), None, None),
        (
            "POST",
            "/v1/policies/batch",
            "/v1/policies/batch".into(),
            t,
            Some(r#"{"policies":[{"tenant":"b","policy":"p","limit":1,"window_ms":1000}]}"#),
        ),
        (
            "POST",
            "/v1/policies/batch",
            "/v1/policies/batch".into(),
            t,
            Some(r#"{"policies":[{"tenant":"b","policy":"p","limit":1.5,"window_ms":1000}]}"#),
        ),
        (
            "POST",
            "/v1/policies/batch",
            "/v1/policies/batch".into(),
            None,
            Some(r#"{"policies":[]}"#),
        ),
        (
            "POST",
            "/v1/policies/batch",
            "/v1/policies/batch".into(),
            t,
            None,
        ),
        (
            "POST",
            "/v1/policies/batch",
            "/v1/policies/batch".into(),
            t,
            Some(&big),
        ),
        ("GET", "/v1/status", "/v1/status".into(), None, None),
        (
            "GET",
            "/v1/cluster/members",
            "/v1/cluster/members".into(),
            None,
            None,
        ),
        (
            "POST",
            "/v1/cluster/members",
            "/v1/cluster/members".into(),
            t,
            Some(member),
        ),
        (
            "POST",
            "/v1/cluster/members",
            "/v1/cluster/members".into(),
            t,
            Some(r#"{"node_id":-1}"#),
        ),
        (
            "POST",
            "/v1/cluster/members",
            "/v1/cluster/members".into(),
            None,
            Some(member),
        ),
        (
            "POST",
            "/v1/cluster/members",
            "/v1/cluster/members".into(),
            t,
            None,
        ),
        (
            "POST",
            "/v1/cluster/members",
            "/v1/cluster/members".into(),
            t,
            Some(&big),
        ),
        (
            "POST",
            "/v1/cluster/members/{node_id}/promote",
            "/v1/cluster/members/2/promote".into(),
            t,
            None,
        ),
        (
            "POST",
            "/v1/cluster/members/{node_id}/promote",
            "/v1/cluster/members/-1/promote".into(),
            t,
            None,
        ),
        (
            "POST",
            "/v1/cluster/members/{node_id}/promote",
            "/v1/cluster/members/2/promote".into(),
            None,
            None,
        ),
        (
            "DELETE",
            "/v1/cluster/members/{node_id}",
            "/v1/cluster/members/2".into(),
            t,
            None,
        ),
        (
            "DELETE",
            "/v1/cluster/members/{node_id}",
            "/v1/cluster/members/-1".into(),
            t,
            None,
        ),
        (
            "DELETE",
            "/v1/cluster/members/{node_id}",
            "/v1/cluster/members/2".into(),
            None,
            None,
        ),
        (
            "PUT",
            "/v1/plans/{plan}",
            "/v1/plans/pro".into(),
            t,
            Some(r#"{"policies":{"login":{"limit":5,"window_ms":900000}}}"#),
        ),
        (
            "PUT",
            "/v1/plans/{plan}",
            "/v1/plans/pro".into(),
            t,
            Some(r#"{"policies":{}}"#),
        ),
        (
            "PUT",
            "/v1/plans/{plan}",
            "/v1/plans/pro".into(),
            None,
            Some(r#"{"policies":{"login":{"limit":5,"window_ms":900000}}}"#),
        ),
        ("GET", "/v1/plans/{plan}", "/v1/plans/pro".into(), t, None),
        ("GET", "/v1/plans/{plan}", "/v1/plans/a.b".into(), t, None),
        ("GET", "/v1/plans/{plan}", "/v1/plans/nope".into(), t, None),
        ("GET", "/v1/plans", "/v1/plans".into(), t, None),
        ("GET", "/v1/plans", "/v1/plans?limit=0".into(), t, None),
        (
            "PUT",
            "/v1/tenants/{tenant}/plan",
            "/v1/tenants/acme/plan".into(),
            t,
            Some(r#"{"plan":"pro"}"#),
        ),
        (
            "PUT",
            "/v1/tenants/{tenant}/plan",
            "/v1/tenants/acme/plan".into(),
            t,
            Some(r#"{"plan":"nope"}"#),
        ),
        (
            "PUT",
            "/v1/tenants/{tenant}/plan",
            "/v1/tenants/a.b/plan".into(),
            t,
            Some(r#"{"plan":"pro"}"#),
        ),
        (
            "GET",
            "/v1/tenants/{tenant}/plan",
            "/v1/tenants/acme/plan".into(),
            t,
            None,
        ),
        (
            "GET",
            "/v1/tenants/{tenant}/plan",
            "/v1/tenants/a.b/plan".into(),
            t,
            None,
        ),
        (
            "DELETE",
            "/v1/tenants/{tenant}/plan",
            "/v1/tenants/acme/plan".into(),
            t,
            None,
        ),
        (
            "DELETE",
            "/v1/tenants/{tenant}/plan",
            "/v1/tenants/acme/plan".into(),
            t,
            None,
        ),
        (
            "GET",
            "/v1/tenants/{tenant}/plan",
            "/v1/tenants/acme/plan".into(),
            t,
            None,
        ),
        (
            "DELETE",
            "/v1/tenants/{tenant}/plan",
            "/v1/tenants/a.b/plan".into(),
            t,
            None,
        ),
        (
            "POST",
            "/v1/plans/assignments/batch",
            "/v1/plans/assignments/batch".into(),
            t,
            Some(r#"{"assignments":[{"tenant":"acme","plan":"pro"},{"tenant":"b","plan":null}]}"#),
        ),
        (
            "POST",
            "/v1/plans/assignments/batch",
            "/v1/plans/assignments/batch".into(),
            t,
            Some(r#"{"assignments":[{"tenant":"acme","plan":"nope"}]}"#),
        ),
        (
            "POST",
            "/v1/plans/assignments/batch",
            "/v1/plans/assignments/batch".into(),
            t,
            Some(r#"{"assignments":[]}"#),
        ),
        (
            "POST",
            "/v1/plans/assignments/batch",
            "/v1/plans/assignments/batch".into(),
            t,
            Some(r#"{"assignments":[{"tenant":"acme"}]}"#),
        ),
        (
            "POST",
            "/v1/plans/assignments/batch",
            "/v1/plans/assignments/batch".into(),
            None,
            Some(r#"{"assignments":[{"tenant":"acme","plan":"pro"}]}"#),
        ),
        (
            "POST",
            "/v1/plans/assignments/batch",
            "/v1/plans/assignments/batch".into(),
            t,
            Some(&big),
        ),
        (
            "DELETE",
            "/v1/plans/{plan}",
            "/v1/plans/pro".into(),
            t,
            None,
        ),
        (
            "DELETE",
            "/v1/plans/{plan}",
            "/v1/plans/pro".into(),
            t,
            None,
        ),
        (
            "DELETE",
            "/v1/plans/{plan}",
            "/v1/plans/a.b".into(),
            t,
            None,
        ),
        // After the checks: a charge spends what they would have.
        ("POST", "/v1/charges", "/v1/charges".into(), t, Some(charge)),
        (
            "POST",
            "/v1/charges",
            "/v1/charges".into(),
            t,
            Some(r#"{"tenant":"acme","policy":"writes","cost":4,"id":"c-1"}"#),
        ),
        (
            "POST",
            "/v1/charges",
            "/v1/charges".into(),
            t,
            Some(r#"{"tenant":"acme","policy":"writes","cost":-4}"#),
        ),
        (
            "POST",
            "/v1/charges",
            "/v1/charges".into(),
            t,
            Some(r#"{"tenant":"acme","policy":"nope","cost":4}"#),
        ),
        (
            "POST",
            "/v1/charges",
            "/v1/charges".into(),
            None,
            Some(charge),
        ),
        // Holds (the budget is spent by now: the first is denied, then a small one held).
        ("POST", "/v1/holds", "/v1/holds".into(), t, Some(hold)),
        (
            "POST",
            "/v1/holds",
            "/v1/holds".into(),
            t,
            Some(r#"{"tenant":"acme","policy":"writes","ttl_ms":0}"#),
        ),
        (
            "POST",
            "/v1/holds",
            "/v1/holds".into(),
            t,
            Some(r#"{"tenant":"acme","policy":"nope"}"#),
        ),
        (
            "POST",
            "/v1/holds",
            "/v1/holds".into(),
            t,
            Some(r#"{"tenant":"acme","policies":["writes","writes"]}"#),
        ),
        ("POST", "/v1/holds", "/v1/holds".into(), None, Some(hold)),
        (
            "POST",
            "/v1/holds/{id}/settle",
            "/v1/holds/eu.acme.h-1/settle".into(),
            t,
            Some(r#"{"cost":1}"#),
        ),
        (
            "POST",
            "/v1/holds/{id}/settle",
            "/v1/holds/eu.acme/settle".into(),
            t,
            Some(r#"{"cost":1}"#),
        ),
        (
            "DELETE",
            "/v1/holds/{id}",
            "/v1/holds/eu.acme.h-1".into(),
            t,
            None,
        ),
        ("DELETE", "/v1/holds/{id}", "/v1/holds/nope".into(), t, None),
        (
            "POST",
            "/v1/holds/{id}/release",
            "/v1/holds/eu.acme.h-1/release".into(),
            t,
            None,
        ),
        ("GET", "/livez", "/livez".into(), None, None),
        ("GET", "/readyz", "/readyz".into(), None, None),
        ("GET", "/metrics", "/metrics".into(), None, None),
    ];
    let mut seen = std::collections::BTreeMap::<(&str, &str), Vec<u16>>::new();
    for (method, template, uri, token, body) in &cases {
        let r = send(&router, method, uri, *token, *body).await;
        let status = r.status.as_u16();
        let documented = documented_statuses(&doc, method, template);
        assert!(
            documented.contains(&status.to_string()),
            "{method} {uri} answered {status}, which the document does not list for {template} ({documented:?}): {}",
            r.body
        );
        if status >= 400 {
            assert!(is_problem(&r), "{method} {uri} {status} is not a problem");
            assert!(
                r.body["errors"].is_array() || ![400].contains(&status),
                "{method} {uri} 400 without errors[]: {}",
                r.body
            );
        }
        seen.entry((method, template)).or_default().push(status);
    }
    // Every documented operation was exercised, and with more than one outcome.
    for (template, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            let m = method.to_ascii_uppercase();
            let statuses = seen.get(&(m.as_str(), template.as_str()));
            assert!(statuses.is_some(), "{m} {template} was not exercised");
        }
    }
    let charges = &seen[&("POST", "/v1/charges")];
    for s in [200, 409, 400, 404, 401] {
        assert!(
            charges.contains(&s),
            "a charge never answered {s}: {charges:?}"
        );
    }
    let holds = &seen[&("POST", "/v1/holds")];
    for s in [429, 400, 404, 401] {
        assert!(holds.contains(&s), "a hold never answered {s}: {holds:?}");
    }
    let check = &seen[&("POST", "/v1/check")];
    for s in [200, 429, 400, 415, 413, 404] {
        assert!(check.contains(&s), "check never answered {s}: {check:?}");
    }
}

/// A method a path does not serve is a 405 problem with the `Allow` header, token or not:
/// the method is checked before the token.
#[tokio::test]
async fn unserved_methods_are_405_problems_before_auth() {
    let router = app(state());
    for (method, uri, allow) in [
        ("TRACE", "/v1/tenants/acme/pin", "PUT,DELETE"),
        (
            "PATCH",
            "/v1/tenants/acme/policies/p",
            "GET,HEAD,PUT,DELETE",
        ),
        ("GET", "/v1/check", "POST"),
        ("POST", "/v1/status", "GET,HEAD"),
        ("TRACE", "/v1/cluster/members/3", "DELETE"),
    ] {
        for token in [None, Some(TOKEN)] {
            let r = send(&router, method, uri, token, None).await;
            assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {uri}");
            assert!(is_problem(&r), "{method} {uri}");
            assert_eq!(r.body["code"], "METHOD_NOT_ALLOWED");
            let mut got: Vec<_> = r.headers[header::ALLOW]
                .to_str()
                .unwrap()
                .split(',')
                .map(|m| m.trim().to_string())
                .collect();
            let mut want: Vec<_> = allow.split(',').map(str::to_string).collect();
            got.sort();
            want.sort();
            assert_eq!(got, want, "{method} {uri}");
        }
    }
}

/// Arrays in place of objects are refused, and every 4xx names its fields in `errors` in
/// JSON's terms, never a Rust type's.
#[tokio::test]
async fn bodies_are_objects_and_problems_name_fields_in_json_terms() {
    let router = with_policy(json!({"limit": 5, "window_ms": 1000})).await;
    let cases = [
        (
            "PUT",
            "/v1/tenants/acme/policies/p",
            r#"[5,1000,7,"critical","closed",0.5,"sliding_window"]"#,
            "body",
        ),
        ("POST", "/v1/check", r#"["acme","writes",2]"#, "body"),
        ("POST", "/v1/check", r#"  "acme""#, "body"),
        (
            "POST",
            "/v1/check/batch",
            r#"{"checks":[["acme","writes",2]]}"#,
            "checks[0]",
        ),
        (
            "PUT",
            "/v1/tenants/acme/policies/p",
            r#"{"limit":"x","window_ms":1000}"#,
            "limit",
        ),
        (
            "PUT",
            "/v1/tenants/acme/policies/p",
            r#"{"limit":5}"#,
            "window_ms",
        ),
        (
            "PUT",
            "/v1/tenants/acme/policies/p",
            r#"{"limit":5,"window_ms":1000,"tier":"gold"}"#,
            "tier",
        ),
        (
            "PUT",
            "/v1/tenants/acme/policies/p",
            r#"{"limit":5,"window_ms":1000,"limt":1}"#,
            "limt",
        ),
        (
            "PUT",
            "/v1/tenants/acme/policies/p",
            r#"{"limit":5,"window_ms":{}}"#,
            "window_ms",
        ),
        (
            "POST",
            "/v1/check",
            r#"{"tenant":5,"policy":"writes"}"#,
            "tenant",
        ),
        (
            "POST",
            "/v1/check",
            r#"{"tenant":"acme","policy":"writes","cost":"2"}"#,
            "cost",
        ),
        (
            "POST",
            "/v1/check/batch",
            r#"{"checks":[{"tenant":"acme","policy":"writes","cost":[]}]}"#,
            "checks[0].cost",
        ),
        (
            "POST",
            "/v1/policies/batch",
            r#"{"policies":[{"tenant":"a","policy":"b","limit":"x","window_ms":1}]}"#,
            "policies[0].limit",
        ),
        (
            "POST",
            "/v1/cluster/members",
            r#"{"node_id":-1,"region":"x","peer":"a","api":"b"}"#,
            "node_id",
        ),
        (
            "PUT",
            "/v1/tenants/acme/pin",
            r#"{"region":null}"#,
            "region",
        ),
        ("POST", "/v1/check", "{not json", "body"),
        ("POST", "/v1/check", "", "body"),
    ];
    for (method, uri, body, field) in cases {
        let r = send(&router, method, uri, Some(TOKEN), Some(body)).await;
        assert_eq!(
            r.status,
            StatusCode::BAD_REQUEST,
            "{method} {uri} {body}: {}",
            r.body
        );
        assert!(is_problem(&r));
        let fields: Vec<_> = r.body["errors"]
            .as_array()
            .unwrap_or_else(|| panic!("no errors[] for {body}: {}", r.body))
            .iter()
            .map(|e| e["field"].as_str().unwrap().to_string())
            .collect();
        assert!(fields.contains(&field.to_string()), "{body}: {fields:?}");
        let text = r.body.to_string();
        for rust in [
            "f64",
            "u64",
            "usize",
            "struct ",
            "enum ",
            "PolicySpec",
            "CheckBody",
            "sequence",
        ] {
            assert!(!text.contains(rust), "{body}: {rust:?} in {text}");
        }
    }
    // Path parameters that do not parse are problems naming the parameter.
    for (method, uri, field) in [
        ("DELETE", "/v1/cluster/members/-1", "node_id"),
        ("POST", "/v1/cluster/members/1.5/promote", "node_id"),
        ("GET", "/v1/tenants/%C0%AE/policies/p", "tenant"),
        ("GET", "/v1/tenants/acme/policies/%FF", "policy"),
    ] {
        let r = send(&router, method, uri, Some(TOKEN), None).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{uri}: {}", r.body);
        assert!(is_problem(&r), "{uri}");
        assert_eq!(r.body["errors"][0]["field"], field, "{uri}: {}", r.body);
        assert!(!r.body.to_string().contains("u64"), "{}", r.body);
    }
    // Nothing refused was stored.
    let r = send(
        &router,
        "GET",
        "/v1/tenants/acme/policies/p",
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

/// Re-sending a policy unchanged keeps its version and its bucket's level; a changed one
/// gets a new version (with no region agent running here, its bucket starts full; the agent's
/// tests show the level carried over).
#[tokio::test]
async fn an_identical_put_keeps_the_version_and_the_tokens() {
    let router = with_policy(json!({"limit": 2, "window_ms": 3_600_000})).await;
    let check = r#"{"tenant":"acme","policy":"writes","cost":2}"#;
    let r = send(&router, "POST", "/v1/check", None, Some(check)).await;
    assert_eq!(r.status, StatusCode::OK);
    let put = |body: &'static str| {
        let router = router.clone();
        async move {
            send(
                &router,
                "PUT",
                "/v1/tenants/acme/policies/writes",
                Some(TOKEN),
                Some(body),
            )
            .await
        }
    };
    // The same policy, spelled with its defaults.
    let again =
        put(r#"{"limit":2,"window_ms":3600000,"burst":2,"tier":"standard","floor":0}"#).await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.body["version"], 1, "{}", again.body);
    let r = send(&router, "POST", "/v1/check", None, Some(check)).await;
    assert_eq!(
        r.status,
        StatusCode::TOO_MANY_REQUESTS,
        "the re-put refilled the bucket"
    );

    let changed = put(r#"{"limit":3,"window_ms":3600000}"#).await;
    assert_eq!(changed.body["version"], 2, "{}", changed.body);
    let r = send(&router, "POST", "/v1/check", None, Some(check)).await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "a new version's bucket, no agent to carry over"
    );

    // A batch keeps an unchanged entry's version and versions the changed one anew.
    let r = send(
        &router,
        "POST",
        "/v1/policies/batch",
        Some(TOKEN),
        Some(r#"{"policies":[{"tenant":"acme","policy":"writes","limit":3,"window_ms":3600000},{"tenant":"acme","policy":"other","limit":1,"window_ms":1000}]}"#),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["policies"][0]["version"], 2);
    assert_eq!(r.body["policies"][1]["version"], 3);
}

/// One token per scope: `admin` (QUOTAD_ADMIN_TOKEN), and from a tokens file `gateway`
/// (check) and `dashboard` (read).
fn one_token_per_scope() -> Tokens {
    let entry = |name: &str, scope: &str, token: &str| {
        format!(
            "[[tokens]]\nname = \"{name}\"\nscope = \"{scope}\"\ntoken_sha256 = \"{}\"\n",
            hex::encode(crate::secret::digest(token))
        )
    };
    let text = entry("gateway", "check", "check-token-0123")
        + &entry("dashboard", "read", "read-token-0123");
    let set = crate::tokens::parse(&text, std::path::Path::new(".")).unwrap();
    Tokens::new(Some(&Secret::new(TOKEN)), None, set)
}

fn token_of(scope: Scope) -> &'static str {
    match scope {
        Scope::Check => "check-token-0123",
        Scope::Read => "read-token-0123",
        Scope::Admin => TOKEN,
    }
}

/// A body the operation accepts (the state is seeded with `acme/writes`).
fn accepted_body(method: &str, template: &str) -> Option<&'static str> {
    match (method, template) {
        ("post", "/v1/check") => Some(r#"{"tenant":"acme","policy":"writes"}"#),
        ("post", "/v1/check/batch") => Some(r#"{"checks":[{"tenant":"acme","policy":"writes"}]}"#),
        ("put", "/v1/tenants/{tenant}/policies/{policy}") => {
            Some(r#"{"limit":10,"window_ms":1000}"#)
        }
        ("put", "/v1/tenants/{tenant}/pin") => Some(r#"{"region":"eu"}"#),
        ("put", "/v1/plans/{plan}") => {
            Some(r#"{"policies":{"login":{"limit":5,"window_ms":900000}}}"#)
        }
        ("put", "/v1/tenants/{tenant}/plan") => Some(r#"{"plan":"default"}"#),
        ("post", "/v1/plans/assignments/batch") => Some(
            r#"{"assignments":[{"tenant":"acme","plan":"default"},{"tenant":"b","plan":null}]}"#,
        ),
        ("post", "/v1/policies/batch") => {
            Some(r#"{"policies":[{"tenant":"acme","policy":"reads","limit":1,"window_ms":1000}]}"#)
        }
        // Membership needs a multi-region cluster: past auth, the coordinator refuses it.
        ("post", "/v1/cluster/members") => {
            Some(r#"{"node_id":4,"region":"ap","peer":"127.0.0.1:1","api":"127.0.0.1:2"}"#)
        }
        _ => None,
    }
}

/// The scope an operation of the document needs, from its `security` requirement; `None`
/// for an open one.
fn documented_scope(op: &Value) -> Option<Scope> {
    let reqs = op["security"].as_array()?;
    let scopes: Vec<&str> = reqs
        .iter()
        .filter_map(|r| r["bearer"].as_array())
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    assert!(scopes.len() <= 1, "one scope per operation: {op}");
    scopes.first().map(|s| match *s {
        "check" => Scope::Check,
        "read" => Scope::Read,
        "admin" => Scope::Admin,
        other => panic!("unknown scope {other}"),
    })
}

/// Every operation of the OpenAPI document (the router's routes: another test holds them
/// equal) against every scope: 401 without a token or with an unknown one, 403 with a token
/// of another scope, past auth with its own scope or `admin`. An operation the document
/// leaves open must be one of the few meant to be.
#[tokio::test]
async fn every_route_needs_its_scope() {
    use utoipa::OpenApi as _;
    const OPEN: &[(&str, &str)] = &[("get", "/livez"), ("get", "/readyz"), ("get", "/metrics")];
    let doc = serde_json::to_value(super::ApiDoc::openapi()).unwrap();
    let mut seen = 0;
    for (template, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let uri = template
                .replace("{tenant}", "acme")
                .replace("{policy}", "writes")
                .replace("{node_id}", "1")
                .replace("{plan}", "default");
            let m = method.to_uppercase();
            let body = accepted_body(method, template);
            // A fresh daemon per operation, seeded, so one operation's effect (a delete)
            // cannot change another's answer.
            let router = app(scoped_state(one_token_per_scope(), false));
            let seed = send(
                &router,
                "PUT",
                "/v1/tenants/acme/policies/writes",
                Some(TOKEN),
                Some(r#"{"limit":10,"window_ms":1000}"#),
            )
            .await;
            assert_eq!(seed.status, StatusCode::OK);
            let seed = send(
                &router,
                "PUT",
                "/v1/plans/default",
                Some(TOKEN),
                Some(r#"{"policies":{"login":{"limit":5,"window_ms":900000}}}"#),
            )
            .await;
            assert_eq!(seed.status, StatusCode::OK, "{}", seed.body);
            let seed = send(
                &router,
                "PUT",
                "/v1/tenants/acme/plan",
                Some(TOKEN),
                Some(r#"{"plan":"default"}"#),
            )
            .await;
            assert_eq!(seed.status, StatusCode::NO_CONTENT, "{}", seed.body);
            let Some(needed) = documented_scope(op) else {
                assert!(
                    OPEN.contains(&(method.as_str(), template.as_str())),
                    "{m} {template} is open"
                );
                let r = send(&router, &m, &uri, None, body).await;
                assert!(r.status.is_success(), "{m} {template}: {}", r.status);
                continue;
            };
            seen += 1;
            for token in [None, Some("not-a-token-at-all")] {
                let r = send(&router, &m, &uri, token, body).await;
                assert_eq!(
                    r.status,
                    StatusCode::UNAUTHORIZED,
                    "{m} {template} with {token:?}"
                );
                assert!(is_problem(&r));
            }
            for scope in Scope::ALL {
                let r = send(&router, &m, &uri, Some(token_of(scope)), body).await;
                if scope.grants(needed) {
                    assert!(
                        r.status != StatusCode::UNAUTHORIZED && r.status != StatusCode::FORBIDDEN,
                        "{m} {template} with {scope:?}: {} {}",
                        r.status,
                        r.body
                    );
                    let done = r.status.is_success();
                    let must =
                        method == "get" || body.is_some() && !template.starts_with("/v1/cluster");
                    assert!(
                        done || !must,
                        "{m} {template} with {scope:?}: {} {}",
                        r.status,
                        r.body
                    );
                } else {
                    assert_eq!(
                        r.status,
                        StatusCode::FORBIDDEN,
                        "{m} {template} with {scope:?}"
                    );
                    assert!(is_problem(&r));
                    assert_eq!(r.body["code"], "FORBIDDEN");
                    assert!(
                        r.body["detail"].as_str().unwrap().contains(needed.as_str()),
                        "{}",
                        r.body
                    );
                }
            }
        }
    }
    assert!(seen >= 15, "{seen} guarded operations");
}

#[tokio::test]
async fn open_checks_need_no_token_and_reads_still_do() {
    let router = app(scoped_state(one_token_per_scope(), true));
    let seed = send(
        &router,
        "PUT",
        "/v1/tenants/acme/policies/writes",
        Some(TOKEN),
        Some(r#"{"limit":10,"window_ms":1000}"#),
    )
    .await;
    assert_eq!(seed.status, StatusCode::OK);
    let check = r#"{"tenant":"acme","policy":"writes"}"#;
    assert_eq!(
        send(&router, "POST", "/v1/check", None, Some(check))
            .await
            .status,
        StatusCode::OK
    );
    let batch = r#"{"checks":[{"tenant":"acme","policy":"writes"}]}"#;
    assert_eq!(
        send(&router, "POST", "/v1/check/batch", None, Some(batch))
            .await
            .status,
        StatusCode::OK
    );
    let r = send(&router, "GET", "/v1/tenants/acme/allowance", None, None).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = send(
        &router,
        "GET",
        "/v1/tenants/acme/allowance",
        Some(token_of(Scope::Check)),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
}

/// A writer the test reads back: what a JSON log subscriber wrote.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn audit_events(&self) -> Vec<Value> {
        let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|v| v["target"] == "audit")
            .collect()
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_mutation_writes_one_audit_event_naming_the_token_not_its_value() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .json()
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .finish();
    let _log = tracing::subscriber::set_default(subscriber);
    let recorder = crate::telemetry::metrics_builder()
        .unwrap()
        .build_recorder();
    let metrics = recorder.handle();
    let _metrics = metrics::set_default_local_recorder(&recorder);

    let deployer = "deployer-secret-value-42";
    let text = format!(
        "[[tokens]]\nname = \"deployer\"\nscope = \"admin\"\ntoken_sha256 = \"{}\"\n",
        hex::encode(crate::secret::digest(deployer))
    ) + &format!(
        "[[tokens]]\nname = \"dashboard\"\nscope = \"read\"\ntoken_sha256 = \"{}\"\n",
        hex::encode(crate::secret::digest("read-token-0123"))
    );
    let tokens = Tokens::new(
        None,
        None,
        crate::tokens::parse(&text, std::path::Path::new(".")).unwrap(),
    );
    let router = app(scoped_state(tokens, true));
    let put = |token: &'static str, limit: u64| {
        let router = router.clone();
        async move {
            let mut req = Request::builder()
                .method("PUT")
                .uri("/v1/tenants/acme/policies/writes")
                .header(header::AUTHORIZATION, format!("Bearer {token}"))
                .header(header::CONTENT_TYPE, "application/json");
            req = req.header("x-request-id", format!("req-{limit}"));
            let body = json!({"limit": limit, "window_ms": 1000}).to_string();
            router
                .oneshot(req.body(Body::from(body)).unwrap())
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(put(deployer, 10).await, StatusCode::OK);
    let events = captured.audit_events();
    assert_eq!(events.len(), 1, "{events:?}");
    let f = &events[0]["fields"];
    assert_eq!(f["token"], "deployer");
    assert_eq!(f["action"], "policy.put");
    assert_eq!(f["tenant_hash"], crate::audit::tenant_hash("acme"));
    assert_eq!(f["policy"], "writes");
    assert_eq!(f["version_before"], Value::Null);
    assert_eq!(f["version_after"], 1);
    assert_eq!(f["request_id"], "req-10");
    assert_eq!(f["outcome"], "ok");

    assert_eq!(put(deployer, 20).await, StatusCode::OK);
    assert_eq!(put("read-token-0123", 30).await, StatusCode::FORBIDDEN);
    let events = captured.audit_events();
    assert_eq!(events.len(), 3, "{events:?}");
    assert_eq!(events[1]["fields"]["version_before"], 1);
    assert_eq!(events[1]["fields"]["version_after"], 2);
    assert_eq!(events[2]["fields"]["token"], "dashboard");
    assert_eq!(events[2]["fields"]["outcome"], "forbidden");

    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(!log.contains(deployer), "the token's value reached the log");
    assert!(!log.contains("read-token-0123"));
    let rendered = metrics.render();
    assert!(
        rendered.contains(r#"quotad_admin_requests_total{action="policy.put",outcome="ok"} 2"#),
        "{rendered}"
    );
    assert!(
        rendered
            .contains(r#"quotad_admin_requests_total{action="policy.put",outcome="forbidden"} 1"#),
        "{rendered}"
    );
}

mod plans {
    use super::*;

    const LOGIN_5_PER_15_MIN: &str = r#"{"policies":{"login":{"limit":5,"window_ms":900000}}}"#;

    async fn put(router: &Api, uri: &str, body: &str) -> Reply {
        send(router, "PUT", uri, Some(TOKEN), Some(body)).await
    }

    async fn check(router: &Api, body: &str) -> Reply {
        send(router, "POST", "/v1/check", None, Some(body)).await
    }

    async fn assign_batch(router: &Api, body: &Value) -> Reply {
        send(
            router,
            "POST",
            "/v1/plans/assignments/batch",
            Some(TOKEN),
            Some(&body.to_string()),
        )
        .await
    }

    async fn plan_of(router: &Api, tenant: &str) -> Option<String> {
        let uri = format!("/v1/tenants/{tenant}/plan");
        let r = send(router, "GET", &uri, Some(TOKEN), None).await;
        r.body["plan"].as_str().map(str::to_string)
    }

    #[tokio::test]
    async fn an_assignment_batch_sets_every_plan_or_none() {
        let mut st = state();
        Arc::get_mut(&mut st).unwrap().body_limit_bytes = 2 << 20;
        let router = app(st);
        let r = put(&router, "/v1/plans/pro", LOGIN_5_PER_15_MIN).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        let r = put(&router, "/v1/tenants/old/plan", r#"{"plan":"pro"}"#).await;
        assert_eq!(r.status, StatusCode::NO_CONTENT, "{}", r.body);
        let r = assign_batch(
            &router,
            &json!({"assignments": [
                {"tenant": "acme", "plan": "pro"},
                {"tenant": "globex", "plan": "pro"},
                {"tenant": "old", "plan": null},
                {"tenant": "never", "plan": null},
            ]}),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(r.body, json!({"assigned": 2, "unassigned": 2}));
        assert_eq!(plan_of(&router, "acme").await.as_deref(), Some("pro"));
        assert_eq!(plan_of(&router, "globex").await.as_deref(), Some("pro"));
        assert_eq!(plan_of(&router, "old").await, None);
        // An assigned tenant decides under the plan's policy at once.
        let r = check(&router, r#"{"tenant":"acme","policy":"login"}"#).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(r.body["remaining"], 4, "{}", r.body);

        // Every problem by its place; nothing changes, not even the valid entries.
        let r = assign_batch(
            &router,
            &json!({"assignments": [
                {"tenant": "acme", "plan": null},
                {"tenant": "a.b", "plan": "pro"},
                {"tenant": "acme", "plan": "pro"},
                {"tenant": "--plan--pro", "plan": "pro"},
                {"tenant": "initech", "plan": "not a plan"},
                {"tenant": "hooli"},
            ]}),
        )
        .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
        assert!(is_problem(&r));
        assert_eq!(
            problem_fields(&r),
            ["assignments[5].plan"],
            "a missing plan is refused by the body's shape first: {}",
            r.body
        );
        let r = assign_batch(
            &router,
            &json!({"assignments": [
                {"tenant": "acme", "plan": null},
                {"tenant": "a.b", "plan": "pro"},
                {"tenant": "acme", "plan": "pro"},
                {"tenant": "--plan--pro", "plan": "pro"},
                {"tenant": "initech", "plan": "not a plan"},
            ]}),
        )
        .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
        assert_eq!(
            problem_fields(&r),
            [
                "assignments[1].tenant",
                "assignments[2].tenant",
                "assignments[3].tenant",
                "assignments[4].plan",
            ],
            "{}",
            r.body
        );
        assert_eq!(plan_of(&router, "acme").await.as_deref(), Some("pro"));
        // A plan that does not exist is the coordinator's refusal, named the same way.
        let r = assign_batch(
            &router,
            &json!({"assignments": [
                {"tenant": "acme", "plan": null},
                {"tenant": "initech", "plan": "enterprise"},
            ]}),
        )
        .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
        assert_eq!(problem_fields(&r), ["assignments[1].plan"], "{}", r.body);
        assert_eq!(r.body["errors"][0]["message"], "no such plan");
        assert_eq!(plan_of(&router, "acme").await.as_deref(), Some("pro"));
        assert_eq!(plan_of(&router, "initech").await, None);
        // The size bounds: 1 to the coordinator's most.
        let max = quota_core::coordinator::MAX_BATCH_ASSIGNMENTS;
        let entries = |n: usize| {
            let entries: Vec<_> = (0..n)
                .map(|i| json!({"tenant": format!("t{i}"), "plan": "pro"}))
                .collect();
            json!({ "assignments": entries })
        };
        for n in [0, max + 1] {
            let r = assign_batch(&router, &entries(n)).await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{n}: {}", r.body);
            assert_eq!(problem_fields(&r), ["assignments"], "{n}");
        }
        let r = assign_batch(&router, &entries(max)).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(r.body["assigned"], max);
        let last = format!("t{}", max - 1);
        assert_eq!(plan_of(&router, &last).await.as_deref(), Some("pro"));
    }

    #[tokio::test]
    async fn a_default_plan_limits_identities_with_no_admin_call_naming_them() {
        let router = app(state());
        let r = put(&router, "/v1/plans/default", LOGIN_5_PER_15_MIN).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        let body = r#"{"identity":"203.0.113.7","policy":"login"}"#;
        let mut statuses = Vec::new();
        for _ in 0..6 {
            let r = check(&router, body).await;
            assert!(!r.body.to_string().contains("203.0.113.7"), "{}", r.body);
            statuses.push(r.status.as_u16());
        }
        assert_eq!(statuses, [200, 200, 200, 200, 200, 429]);
        // Another identity has its own bucket.
        let r = check(&router, r#"{"identity":"203.0.113.8","policy":"login"}"#).await;
        assert_eq!(r.status, StatusCode::OK);
    }

    #[tokio::test]
    async fn explicit_policy_then_assigned_plan_then_default() {
        let router = app(state());
        put(&router, "/v1/plans/default", LOGIN_5_PER_15_MIN).await;
        let r = put(
            &router,
            "/v1/plans/pro",
            r#"{"policies":{"login":{"limit":50,"window_ms":900000}}}"#,
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        let r = put(&router, "/v1/tenants/acme/plan", r#"{"plan":"pro"}"#).await;
        assert_eq!(r.status, StatusCode::NO_CONTENT, "{}", r.body);
        let c = check(&router, r#"{"tenant":"acme","policy":"login"}"#).await;
        assert_eq!(c.headers["ratelimit-policy"], "\"login\";q=50;w=900");
        let c = check(&router, r#"{"tenant":"globex","policy":"login"}"#).await;
        assert_eq!(c.headers["ratelimit-policy"], "\"login\";q=5;w=900");
        put(
            &router,
            "/v1/tenants/acme/policies/login",
            r#"{"limit":7,"window_ms":1000}"#,
        )
        .await;
        let c = check(&router, r#"{"tenant":"acme","policy":"login"}"#).await;
        assert_eq!(c.headers["ratelimit-policy"], "\"login\";q=7;w=1");
        let r = send(&router, "GET", "/v1/tenants/acme/plan", Some(TOKEN), None).await;
        assert_eq!(r.body["plan"], "pro");
        // Plans are listed by name; their policies are not a tenant's.
        let r = send(&router, "GET", "/v1/plans?limit=1", Some(TOKEN), None).await;
        assert_eq!(r.body["plans"][0]["plan"], "default");
        assert_eq!(r.body["next"], "default");
        let r = send(&router, "GET", "/v1/plans?after=default", Some(TOKEN), None).await;
        assert_eq!(r.body["plans"][0]["plan"], "pro");
        assert_eq!(r.body["plans"][0]["policies"]["login"]["limit"], 50);
        assert!(r.body["next"].is_null());
        let r = send(&router, "GET", "/v1/policies", Some(TOKEN), None).await;
        assert_eq!(
            r.body["policies"].as_array().unwrap().len(),
            1,
            "{}",
            r.body
        );
        // Unassigned, then the plan deleted: the default plan decides.
        let r = send(
            &router,
            "DELETE",
            "/v1/tenants/acme/plan",
            Some(TOKEN),
            None,
        )
        .await;
        assert_eq!(r.status, StatusCode::NO_CONTENT);
        let r = send(
            &router,
            "DELETE",
            "/v1/tenants/acme/plan",
            Some(TOKEN),
            None,
        )
        .await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        let r = send(&router, "DELETE", "/v1/plans/pro", Some(TOKEN), None).await;
        assert_eq!(r.status, StatusCode::NO_CONTENT);
        let r = send(&router, "GET", "/v1/plans/pro", Some(TOKEN), None).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn a_plan_change_reaches_every_assigned_tenant_in_one_command() {
        let router = app(state());
        put(
            &router,
            "/v1/plans/pro",
            r#"{"policies":{"calls":{"limit":3,"window_ms":60000}}}"#,
        )
        .await;
        for i in 0..200 {
            let r = put(
                &router,
                &format!("/v1/tenants/t{i}/plan"),
                r#"{"plan":"pro"}"#,
            )
            .await;
            assert_eq!(r.status, StatusCode::NO_CONTENT);
        }
        let before = send(&router, "GET", "/v1/plans/pro", Some(TOKEN), None).await;
        let r = put(
            &router,
            "/v1/plans/pro",
            r#"{"policies":{"calls":{"limit":1,"window_ms":60000}}}"#,
        )
        .await;
        assert_eq!(r.status, StatusCode::OK);
        assert!(
            r.body["policies"]["calls"]["version"].as_u64()
                > before.body["policies"]["calls"]["version"].as_u64()
        );
        for i in 0..200 {
            let body = format!(r#"{{"tenant":"t{i}","policy":"calls"}}"#);
            assert_eq!(check(&router, &body).await.status, StatusCode::OK);
            assert_eq!(
                check(&router, &body).await.status,
                StatusCode::TOO_MANY_REQUESTS,
                "tenant t{i}"
            );
        }
    }

    #[tokio::test]
    async fn bad_plan_input_is_refused_by_field_and_changes_nothing() {
        let router = app(state());
        let cases: &[(&str, &str, &str, StatusCode, &str)] = &[
            (
                "PUT",
                "/v1/plans/pro",
                r#"{"policies":{}}"#,
                StatusCode::BAD_REQUEST,
                "policies",
            ),
            (
                "PUT",
                "/v1/plans/pro",
                r#"{"policies":[]}"#,
                StatusCode::BAD_REQUEST,
                "policies",
            ),
            ("PUT", "/v1/plans/pro", r#"[]"#, StatusCode::BAD_REQUEST, ""),
            (
                "PUT",
                "/v1/plans/pro",
                r#"{"policies":{"login":{"limit":0,"window_ms":1000}}}"#,
                StatusCode::BAD_REQUEST,
                "policies.login.limit",
            ),
            (
                "PUT",
                "/v1/plans/pro",
                r#"{"policies":{"no such":{"limit":1,"window_ms":1000}}}"#,
                StatusCode::BAD_REQUEST,
                "policies.no such",
            ),
            (
                "PUT",
                "/v1/plans/pro",
                r#"{"policies":{"a":{"limit":1,"window_ms":1000}},"extra":1}"#,
                StatusCode::BAD_REQUEST,
                "",
            ),
            (
                "PUT",
                "/v1/plans/a.b",
                LOGIN_5_PER_15_MIN,
                StatusCode::BAD_REQUEST,
                "plan",
            ),
            (
                "PUT",
                "/v1/tenants/acme/plan",
                r#"{"plan":"nope"}"#,
                StatusCode::NOT_FOUND,
                "plan",
            ),
            (
                "PUT",
                "/v1/tenants/acme/plan",
                r#"{"plan":["pro"]}"#,
                StatusCode::BAD_REQUEST,
                "",
            ),
            (
                "PUT",
                "/v1/tenants/--plan--pro/plan",
                r#"{"plan":"pro"}"#,
                StatusCode::BAD_REQUEST,
                "tenant",
            ),
        ];
        for (method, uri, body, status, field) in cases {
            let r = send(&router, method, uri, Some(TOKEN), Some(body)).await;
            assert_eq!(r.status, *status, "{method} {uri} {body}: {}", r.body);
            assert!(is_problem(&r));
            if !field.is_empty() {
                assert_eq!(r.body["errors"][0]["field"], *field, "{body}: {}", r.body);
            }
        }
        let r = send(&router, "GET", "/v1/plans", Some(TOKEN), None).await;
        assert_eq!(r.body["plans"], serde_json::json!([]));
    }

    #[tokio::test]
    async fn checks_name_exactly_one_subject_and_never_a_reserved_id() {
        let router = app(state());
        put(&router, "/v1/plans/default", LOGIN_5_PER_15_MIN).await;
        let hashed = quota_core::hashed_id(TEST_IDENTITY_KEY.as_bytes(), b"203.0.113.7");
        let long = "x".repeat(1025);
        let cases = [
            (r#"{"policy":"login"}"#.to_string(), "tenant"),
            (
                r#"{"tenant":"acme","identity":"a","policy":"login"}"#.to_string(),
                "identity",
            ),
            (
                format!(r#"{{"identity":"{long}","policy":"login"}}"#),
                "identity",
            ),
            (
                r#"{"identity":"","policy":"login"}"#.to_string(),
                "identity",
            ),
            (
                format!(r#"{{"tenant":"{}","policy":"login"}}"#, hashed.as_str()),
                "tenant",
            ),
            (
                r#"{"tenant":"--plan--default","policy":"login"}"#.to_string(),
                "tenant",
            ),
        ];
        for (body, field) in cases {
            let r = check(&router, &body).await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.body);
            assert_eq!(r.body["errors"][0]["field"], field, "{body}");
        }
        let r = send(
            &router,
            "POST",
            "/v1/check/batch",
            None,
            Some(r#"{"checks":[{"identity":"203.0.113.7","policy":"login"},{"tenant":"acme","policy":"login"}]}"#),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(r.body["results"][0]["status"], 200);
        assert!(!r.body.to_string().contains("203.0.113.7"));
    }

    #[tokio::test]
    async fn an_identity_without_a_key_is_a_problem_naming_identity() {
        let st = state();
        let st = Arc::new(AppShared {
            decider: st.decider.clone(),
            coordinator: st.coordinator.clone(),
            tokens: st.tokens.clone(),
            open_checks: true,
            metrics: None,
            ready: st.ready.clone(),
            drift_margin_ms: 1000,
            body_limit_bytes: 4096,
            request_timeout: Duration::from_secs(5),
            identity_key: None,
        });
        let router = app(st);
        let r = check(&router, r#"{"identity":"203.0.113.7","policy":"login"}"#).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
        assert_eq!(r.body["code"], "NOT_CONFIGURED");
        assert_eq!(r.body["errors"][0]["field"], "identity");
        assert!(!r.body.to_string().contains("203.0.113.7"));
    }

    #[tokio::test]
    async fn a_shadow_policy_admits_and_marks_what_it_would_deny() {
        let router = app(state());
        let r = put(
            &router,
            "/v1/tenants/acme/policies/new-limit",
            r#"{"limit":5,"window_ms":60000,"mode":"shadow"}"#,
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(r.body["mode"], "shadow");
        let mut shadowed = 0;
        for _ in 0..10 {
            let r = check(&router, r#"{"tenant":"acme","policy":"new-limit"}"#).await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.body);
            assert_eq!(r.body["allowed"], true);
            if r.body["shadow_denied"] == true {
                shadowed += 1;
            }
        }
        assert_eq!(shadowed, 5);
    }
}

/// `POST /v1/cluster/members` takes `peer` and `api` in the form `[[regions]]` takes: a DNS
/// name or an IP address (IPv6 in brackets) and a port 1–65535. Anything else is a 400 naming
/// the field, before the coordinator is asked.
#[tokio::test]
async fn a_new_member_is_addressed_by_host_name_or_ip() {
    let router = app(state());
    let add = |peer: &str, api: &str| {
        json!({"node_id": 4, "region": "d", "peer": peer, "api": api}).to_string()
    };
    let before = send(&router, "GET", "/v1/cluster/members", Some(TOKEN), None).await;
    assert_eq!(before.status, StatusCode::OK, "{}", before.body);
    let bad = [
        ("", "127.0.0.1:7450", "peer", "not empty"),
        ("localhost", "127.0.0.1:7450", "peer", "no port"),
        ("[::1]", "127.0.0.1:7450", "peer", "no port"),
        ("localhost:0", "127.0.0.1:7450", "peer", "1 to 65535"),
        ("127.0.0.1:0", "127.0.0.1:7450", "peer", "1 to 65535"),
        ("[::1]:0", "127.0.0.1:7450", "peer", "1 to 65535"),
        ("localhost:65536", "127.0.0.1:7450", "peer", "1 to 65535"),
        ("localhost:http", "127.0.0.1:7450", "peer", "1 to 65535"),
        ("::1:7451", "127.0.0.1:7450", "peer", "IPv6 in brackets"),
        ("a_b.example:7451", "127.0.0.1:7450", "peer", "DNS name"),
        ("no such host:7451", "127.0.0.1:7450", "peer", "DNS name"),
        ("-d.example:7451", "127.0.0.1:7450", "peer", "DNS name"),
        ("localhost:7451", "quotad-d", "api", "no port"),
        ("localhost:7451", "quotad-d:0", "api", "1 to 65535"),
    ];
    for (peer, api, field, says) in bad {
        let r = send(
            &router,
            "POST",
            "/v1/cluster/members",
            Some(TOKEN),
            Some(&add(peer, api)),
        )
        .await;
        assert_eq!(
            r.status,
            StatusCode::BAD_REQUEST,
            "{peer:?} {api:?}: {}",
            r.body
        );
        assert!(is_problem(&r), "{peer:?} {api:?}");
        assert_eq!(r.body["code"], "INVALID_REQUEST");
        assert_eq!(r.body["errors"][0]["field"], field, "{peer:?} {api:?}");
        let message = r.body["errors"][0]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{peer:?} {api:?}: {message}");
    }
    let after = send(&router, "GET", "/v1/cluster/members", Some(TOKEN), None).await;
    assert_eq!(after.body, before.body, "a refused member changes nothing");

    // Accepted addresses reach the coordinator, which a single-region daemon answers with 409
    // (tests/tests/membership.rs adds a region by host name to a cluster).
    for (peer, api) in [
        ("localhost:7451", "localhost:7450"),
        (
            "quotad-d-0.quotad-d.quotad.svc.cluster.local:7451",
            "quotad-d.quotad:7450",
        ),
        ("10.0.4.10:7451", "10.0.4.10:7450"),
        ("[::1]:7451", "[2001:db8::4]:7450"),
    ] {
        let r = send(
            &router,
            "POST",
            "/v1/cluster/members",
            Some(TOKEN),
            Some(&add(peer, api)),
        )
        .await;
        assert_eq!(
            r.status,
            StatusCode::CONFLICT,
            "{peer:?} {api:?}: {}",
            r.body
        );
        assert!(
            r.body["detail"]
                .as_str()
                .is_some_and(|d| d.contains("single-region")),
            "{peer:?} {api:?}: {}",
            r.body
        );
    }
}

#[tokio::test]
async fn a_charge_goes_into_debt_to_its_limit_and_denies_checks_until_repaid() {
    // 60 a minute (one a second), burst 10, debt to 5.
    let router =
        with_policy(json!({"limit": 60, "window_ms": 60000, "burst": 10, "debt_limit": 5})).await;
    let charge = |cost: u64, id: &str| {
        json!({"tenant": "acme", "policy": "writes", "cost": cost, "id": id}).to_string()
    };
    // 12 tokens of work done against 10 left: 2 into debt.
    let r = send(
        &router,
        "POST",
        "/v1/charges",
        Some(TOKEN),
        Some(&charge(12, "c1")),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        (
            &r.body["applied"],
            &r.body["clamped"],
            &r.body["remaining"],
            &r.body["debt"]
        ),
        (&json!(12), &json!(0), &json!(0), &json!(2))
    );
    assert_eq!(
        (r.body["region"].as_str(), r.body["charged_by"].as_str()),
        (Some("eu"), Some("eu"))
    );
    // The repayment and one more token: about 3 s.
    let ms = r.body["retry_after_ms"].as_u64().unwrap();
    assert!((2_000..=3_000).contains(&ms), "{ms}");
    // The same charge retried: applied once.
    let again = send(
        &router,
        "POST",
        "/v1/charges",
        Some(TOKEN),
        Some(&charge(12, "c1")),
    )
    .await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.body["debt"], 2, "{}", again.body);
    // The id of another cost: refused, nothing applied.
    let reused = send(
        &router,
        "POST",
        "/v1/charges",
        Some(TOKEN),
        Some(&charge(3, "c1")),
    )
    .await;
    assert_eq!(reused.status, StatusCode::CONFLICT, "{}", reused.body);
    // Beyond the debt limit: clamped, and said so.
    let r = send(
        &router,
        "POST",
        "/v1/charges",
        Some(TOKEN),
        Some(&charge(9, "c2")),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        (&r.body["applied"], &r.body["clamped"], &r.body["debt"]),
        (&json!(3), &json!(6), &json!(5))
    );
    // In debt, a check is denied with a wait that covers the repayment.
    let check = json!({"tenant": "acme", "policy": "writes"}).to_string();
    let r = send(&router, "POST", "/v1/check", None, Some(&check)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    let ms = r.body["retry_after_ms"].as_u64().unwrap();
    assert!((5_000..=6_000).contains(&ms), "{ms}");
    // The allowance shows the debt (the refill may have repaid one token since).
    let allowance = |router: &Api| {
        let router = router.clone();
        async move {
            let r = send(
                &router,
                "GET",
                "/v1/tenants/acme/allowance",
                Some(TOKEN),
                None,
            )
            .await;
            assert_eq!(r.status, StatusCode::OK);
            r.body["policies"][0]["this_region"].clone()
        }
    };
    let here = allowance(&router).await;
    assert_eq!(here["tokens_left"], 0);
    let debt = here["debt"].as_u64().unwrap();
    assert!((4..=5).contains(&debt), "{here}");
    // An empty bucket owes nothing.
    let empty = with_policy(json!({"limit": 60, "window_ms": 60000, "burst": 10})).await;
    let all = json!({"tenant": "acme", "policy": "writes", "cost": 10}).to_string();
    let r = send(&empty, "POST", "/v1/check", None, Some(&all)).await;
    assert_eq!(r.status, StatusCode::OK);
    let here = allowance(&empty).await;
    assert_eq!(
        (&here["tokens_left"], &here["debt"]),
        (&json!(0), &json!(0)),
        "{here}"
    );
}

#[tokio::test]
async fn bad_charges_are_refused_by_field_and_change_nothing() {
    let router = with_policy(json!({"limit": 10, "window_ms": 60000})).await;
    let post = |body: Value| {
        let router = router.clone();
        async move {
            send(
                &router,
                "POST",
                "/v1/charges",
                Some(TOKEN),
                Some(&body.to_string()),
            )
            .await
        }
    };
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
            json!({"tenant": "acme", "policy": "writes", "cost": 0}),
            "cost",
        ),
        (
            json!({"tenant": "acme", "policy": "writes", "cost": 1e12}),
            "cost",
        ),
        (
            json!({"tenant": "acme", "policy": "writes", "cost": 1, "id": ""}),
            "id",
        ),
        (
            json!({"tenant": "acme", "policy": "writes", "cost": 1, "id": "a b"}),
            "id",
        ),
        (
            json!({"tenant": "acme", "policy": "writes", "cost": 1, "id": "x".repeat(129)}),
            "id",
        ),
        (
            json!({"tenant": "ac.me", "policy": "writes", "cost": 1}),
            "tenant",
        ),
        (
            json!({"tenant": "acme", "policy": "no such", "cost": 1}),
            "policy",
        ),
    ] {
        let r = post(body.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.body);
        assert!(is_problem(&r));
        assert_eq!(r.body["errors"][0]["field"], field, "{body}: {}", r.body);
    }
    let r = post(json!({"tenant": "acme", "policy": "writes"})).await;
    assert_eq!(
        r.status,
        StatusCode::BAD_REQUEST,
        "a charge names its cost: {}",
        r.body
    );
    let r = post(json!({"tenant": "acme", "policy": "reads", "cost": 1})).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    // A token is needed, whatever open checks allow.
    let body = json!({"tenant": "acme", "policy": "writes", "cost": 1}).to_string();
    let r = send(&router, "POST", "/v1/charges", None, Some(&body)).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    // Nothing was spent by any of them.
    let check = json!({"tenant": "acme", "policy": "writes", "cost": 10}).to_string();
    let r = send(&router, "POST", "/v1/check", None, Some(&check)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
}

#[tokio::test]
async fn a_sliding_window_has_nothing_to_charge() {
    let router =
        with_policy(json!({"limit": 10, "window_ms": 60000, "algorithm": "sliding_window"})).await;
    let body = json!({"tenant": "acme", "policy": "writes", "cost": 1}).to_string();
    let r = send(&router, "POST", "/v1/charges", Some(TOKEN), Some(&body)).await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.body);
}
