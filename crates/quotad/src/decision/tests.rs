//! Fixtures the decision path's unit tests share, and the API's tests borrow: ids, and a
//! region's decider whose tenants are pinned to a home that records what it is sent.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::HeaderMap;
use axum::routing::post;
use quota_core::{PolicyName, PolicySpec, RegionId, TenantId};
use quota_store::AnyStore;
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::config::BreakerConfig;
use crate::coordination::{ClusterView, Grant, PolicyEntry};
use crate::decision::breaker::Breaker;
use crate::decision::{Decider, DeciderParts, FORWARDED_HEADER};
use crate::secret::Secret;

/// Policy `t`/`w` of `spec` (a JSON policy body) with `grants` (region, share ppm, floor ppm),
/// split, or whole in `home`.
pub(crate) fn entry(spec: Value, grants: &[(&str, u32, u32)], home: Option<&str>) -> PolicyEntry {
    let spec: PolicySpec = serde_json::from_value(spec).unwrap();
    PolicyEntry {
        policy: spec.validate().unwrap(),
        grants: grants
            .iter()
            .map(|&(r, share_ppm, floor_ppm)| {
                let grant = Grant {
                    share_ppm,
                    floor_ppm,
                };
                (RegionId::new(r).unwrap(), grant)
            })
            .collect(),
        home: home.map(|h| RegionId::new(h).unwrap()),
        mode: if home.is_some() {
            quota_core::mode::BudgetMode::Home
        } else {
            quota_core::mode::BudgetMode::Split
        },
    }
}

/// Region a's decider on the embedded store, its view holding `entry` as `t`/`w` and its lease
/// ending at `lease_end_local_ms`; `homes` maps regions to the API addresses checks are
/// forwarded to.
pub(crate) fn decider_of(
    entry: PolicyEntry,
    lease_end_local_ms: u64,
    homes: HashMap<RegionId, Vec<String>>,
) -> Decider {
    let view = ClusterView {
        policies: [(ids("t", "w"), entry)].into_iter().collect(),
        lease_end_local_ms,
        ..ClusterView::default()
    };
    // The sender may go: the receiver keeps the last view.
    let (_tx, rx) = watch::channel(Arc::new(view));
    Decider::new(DeciderParts {
        region: RegionId::new("a").unwrap(),
        store: AnyStore::embedded(),
        breaker: Breaker::new(&BreakerConfig::default(), "a"),
        view: rx,
        homes,
        forward_timeout: Duration::from_secs(5),
        peer_token: None,
        reservations: false,
        store_timeout: Duration::from_millis(100),
        daemons: 1,
    })
}

/// What the home region received: path, forwarded header, body.
pub(crate) type Seen = Arc<Mutex<Vec<(String, Option<String>, Value)>>>;

/// A tenant id and a policy name, both valid.
pub(crate) fn ids(tenant: &str, policy: &str) -> (TenantId, PolicyName) {
    (
        TenantId::new(tenant).unwrap(),
        PolicyName::new(policy).unwrap(),
    )
}

/// A policy of `tenant` pinned to region a, as region b sees it.
fn pinned(tenant: &str, fail_mode: &str) -> ((TenantId, PolicyName), PolicyEntry) {
    let spec: PolicySpec = serde_json::from_value(
        json!({"limit": 10, "window_ms": 1000, "floor": 0.5, "fail_mode": fail_mode}),
    )
    .unwrap();
    let grant = Grant {
        share_ppm: 500_000,
        floor_ppm: 500_000,
    };
    let entry = PolicyEntry {
        policy: spec.validate().unwrap(),
        grants: BTreeMap::from([(RegionId::new("b").unwrap(), grant)]),
        home: Some(RegionId::new("a").unwrap()),
        mode: quota_core::mode::BudgetMode::Split,
    };
    (ids(tenant, "w"), entry)
}

/// Region b's decider with two tenants pinned to a, whose API is a server that records
/// every request and answers batches with `status` (each check allowed, 7 left).
pub(crate) async fn decider_with_home(status: u16) -> (Decider, Seen) {
    let seen: Seen = Arc::default();
    let record = seen.clone();
    let home = axum::Router::new().route(
        "/v1/check/batch",
        post(move |headers: HeaderMap, body: axum::Json<Value>| {
            let record = record.clone();
            async move {
                let forwarded = headers
                    .get(&FORWARDED_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                let n = body["checks"].as_array().map_or(0, Vec::len);
                record
                    .lock()
                    .unwrap()
                    .push(("/v1/check/batch".into(), forwarded, body.0));
                let item = json!({"status": 200, "decision": {"allowed": true, "remaining": 7,
                    "retry_after_ms": 0, "reset_ms": 300, "region": "a", "decided_by": "a",
                    "mode": "normal"}});
                let status = axum::http::StatusCode::from_u16(status).unwrap();
                (status, axum::Json(json!({"results": vec![item; n]})))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, home).await });
    let view = ClusterView {
        policies: [pinned("vip", "local"), pinned("strict", "closed")]
            .into_iter()
            .collect(),
        lease_end_local_ms: u64::MAX,
        ..ClusterView::default()
    };
    let (_tx, rx) = watch::channel(Arc::new(view));
    // The sender may go: the receiver keeps the last view.
    let region = RegionId::new("b").unwrap();
    let decider = Decider::new(DeciderParts {
        region: region.clone(),
        store: AnyStore::embedded(),
        breaker: Breaker::new(&BreakerConfig::default(), "b"),
        view: rx,
        homes: HashMap::from([(RegionId::new("a").unwrap(), vec![addr.to_string()])]),
        forward_timeout: Duration::from_secs(5),
        peer_token: Some(Secret::new("peer-token")),
        reservations: false,
        store_timeout: Duration::from_millis(100),
        daemons: 1,
    });
    (decider, seen)
}
