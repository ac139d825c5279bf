//! POST /v1/check/batch: up to [`MAX_BATCH`] checks in one request.
//!
//! Checks of one bucket (tenant and policy) are decided one after another in request order, so
//! a batch spends a bucket's tokens as the same checks sent one by one would. Checks of
//! different buckets are independent and are decided concurrently: their Redis calls go out
//! together on the pipelined connection. Checks of tenants pinned to another region go to that
//! region together, as one batch (which it decides by the same rule), so a batch pays at most
//! one round trip to each home region.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;

use axum::extract::State;
use axum::http::HeaderMap;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use quota_core::{PolicyName, RegionId};

use crate::api::check::{
    check_error, decide, parse, rate_limited_problem, subject, CheckBody, CheckResponse,
};
use crate::api::problem::{data_problem, ApiError, ApiJson, Problem};
use crate::api::state::AppState;
use crate::decision::{Verdict, FORWARDED_HEADER};

/// Most checks in one batch: bounds the work one request can ask for.
pub const MAX_BATCH: usize = 100;

/// A batch of checks, decided independently (not atomically); a bucket's checks in order.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchBody {
    /// Each one a JSON object (serde would read a check from an array of its fields too).
    #[schema(value_type = Vec<CheckBody>, min_items = 1, max_items = 100)]
    pub checks: Vec<Map<String, Value>>,
}

/// The checks of a batch, each read as a check body; every unreadable one named by its place.
fn check_bodies(checks: Vec<Map<String, Value>>) -> Result<Vec<CheckBody>, ApiError> {
    let mut errors = Vec::new();
    let mut bodies = Vec::with_capacity(checks.len());
    for (i, check) in checks.into_iter().enumerate() {
        match serde_path_to_error::deserialize::<_, CheckBody>(Value::Object(check)) {
            Ok(body) => bodies.push(body),
            Err(e) => {
                let path = e.path().to_string();
                let mut problem = data_problem(&path, &e.into_inner().to_string());
                problem.field = match problem.field.as_str() {
                    "body" => format!("checks[{i}]"),
                    f => format!("checks[{i}].{f}"),
                };
                errors.push(problem);
            }
        }
    }
    if errors.is_empty() {
        Ok(bodies)
    } else {
        Err(ApiError::BadRequest {
            detail: format!("{} checks cannot be read", errors.len()),
            errors,
        })
    }
}

/// One batch result: a decision with its HTTP status, or a problem.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct BatchItem {
    pub status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision: Option<CheckResponse>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<Problem>,
}

/// Batch results, in request order.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct BatchResponse {
    pub results: Vec<BatchItem>,
}

/// Decides up to 100 checks: a bucket's checks in request order, different buckets concurrently.
#[utoipa::path(
    post,
    path = "/v1/check/batch",
    request_body = BatchBody,
    responses(
        (status = 200, description = "One result per check, in request order", body = BatchResponse),
        (status = 400, description = "Invalid request", body = Problem),
    ),
    security((), ("bearer" = ["check"])),
    tag = "decisions"
)]
pub async fn check_batch(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<BatchBody>,
) -> Result<axum::Json<BatchResponse>, ApiError> {
    if body.checks.is_empty() || body.checks.len() > MAX_BATCH {
        return Err(ApiError::field(
            "checks",
            &format!("must hold 1 to {MAX_BATCH} checks"),
        ));
    }
    let checks = check_bodies(body.checks)?;
    let forwarded = state
        .decider
        .is_peer_forward(headers.get(&FORWARDED_HEADER).and_then(|v| v.to_str().ok()));
    let state = &state;
    let results = in_groups(
        checks,
        |c| route(state, c, forwarded),
        |route, group| async move {
            match route {
                Route::Here(..) => {
                    let mut out = Vec::with_capacity(group.len());
                    for (i, c) in group {
                        out.push((i, item(state, i, decide(state, c, forwarded).await)));
                    }
                    out
                }
                Route::Home(home) => at_home(state, &home, group).await,
            }
        },
    )
    .await;
    Ok(axum::Json(BatchResponse { results }))
}

/// Where a check is decided: here, one bucket at a time, or at its tenant's home region.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Route {
    Here(String, String),
    Home(RegionId),
}

fn route(state: &AppState, c: &CheckBody, forwarded: bool) -> Route {
    let subject = subject(state, c.tenant.as_deref(), c.identity.as_deref(), forwarded).ok();
    let home = subject
        .clone()
        .zip(c.policy.as_deref().and_then(|p| PolicyName::new(p).ok()))
        .and_then(|(t, p)| state.decider.home_elsewhere(&t, &p, forwarded));
    match home {
        Some(home) => Route::Home(home),
        // Grouped by subject (never the raw identity), so a subject's checks stay in order.
        None => Route::Here(
            subject.map(|s| s.as_str().to_string()).unwrap_or_default(),
            c.policy.clone().unwrap_or_default(),
        ),
    }
}

/// Decides a home region's checks with one request there.
async fn at_home(
    state: &AppState,
    home: &RegionId,
    group: Vec<(usize, CheckBody)>,
) -> Vec<(usize, BatchItem)> {
    let mut out = Vec::with_capacity(group.len());
    let mut valid = Vec::with_capacity(group.len());
    for (i, c) in group {
        // Only checks not forwarded here go on to a home region.
        match parse(state, c, false) {
            Ok(check) => valid.push((i, check)),
            Err(e) => out.push((i, item(state, i, Err(e)))),
        }
    }
    let (index, checks): (Vec<usize>, Vec<_>) = valid.into_iter().unzip();
    let names: Vec<PolicyName> = checks.iter().map(|(_, p, _)| p.clone()).collect();
    let verdicts = state.decider.check_at_home(home, checks).await;
    for ((i, name), v) in index.into_iter().zip(names).zip(verdicts) {
        out.push((i, item(state, i, v.map(|v| (v, name)).map_err(check_error))));
    }
    out
}

/// The result of check `i` of a batch.
fn item(state: &AppState, i: usize, decided: Result<(Verdict, PolicyName), ApiError>) -> BatchItem {
    match decided {
        Ok((v, policy)) => {
            let r = CheckResponse::from_verdict(&v, state.decider.region().as_str());
            if r.allowed {
                BatchItem {
                    status: 200,
                    decision: Some(r),
                    problem: None,
                }
            } else {
                let p = rate_limited_problem(&policy, r);
                BatchItem {
                    status: 429,
                    decision: Some(p.decision),
                    problem: Some(p.problem),
                }
            }
        }
        Err(e) => {
            let mut problem = e.problem();
            for f in &mut problem.errors {
                f.field = format!("checks[{i}].{}", f.field);
            }
            BatchItem {
                status: problem.status,
                decision: None,
                problem: Some(problem),
            }
        }
    }
}

/// Groups items by `key` and runs `run(key, group)` on every group concurrently; a group gets
/// its items in their order, with their indices, and answers for each. The results come back
/// in item order.
async fn in_groups<T, K, R, Fut>(
    items: Vec<T>,
    key: impl Fn(&T) -> K,
    run: impl Fn(K, Vec<(usize, T)>) -> Fut,
) -> Vec<R>
where
    K: Eq + Hash + Clone,
    Fut: Future<Output = Vec<(usize, R)>>,
{
    let n = items.len();
    let mut groups: Vec<(K, Vec<(usize, T)>)> = Vec::new();
    let mut group_of: HashMap<K, usize> = HashMap::new();
    for (i, item) in items.into_iter().enumerate() {
        let k = key(&item);
        let g = match group_of.get(&k) {
            Some(&g) => g,
            None => {
                group_of.insert(k.clone(), groups.len());
                groups.push((k, Vec::new()));
                groups.len() - 1
            }
        };
        groups[g].1.push((i, item));
    }
    let run = &run;
    let done = futures::future::join_all(groups.into_iter().map(|(k, g)| run(k, g))).await;
    let mut results: Vec<(usize, R)> = Vec::with_capacity(n);
    results.extend(done.into_iter().flatten());
    results.sort_unstable_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tokio::sync::Barrier;

    use super::*;

    /// `in_groups` running each group's items one after another, as the handler does here.
    async fn in_key_order<T, K, R, Fut>(
        items: Vec<T>,
        key: impl Fn(&T) -> K,
        f: impl Fn(usize, T) -> Fut,
    ) -> Vec<R>
    where
        K: Eq + Hash + Clone,
        Fut: Future<Output = R>,
    {
        let f = &f;
        in_groups(items, key, |_, group| async move {
            let mut out = Vec::with_capacity(group.len());
            for (i, item) in group {
                out.push((i, f(i, item).await));
            }
            out
        })
        .await
    }

    /// Different keys run at once: the first item of each of three keys waits on a barrier of
    /// three, which only opens if all three are in flight together. Equal keys run in order:
    /// each item starts after the one before it with its key has ended.
    #[tokio::test(start_paused = true)]
    async fn keys_run_concurrently_and_each_key_in_order() {
        let keys = ["a", "b", "a", "c", "b", "a", "c"];
        let barrier = Arc::new(Barrier::new(3));
        let log = Arc::new(Mutex::new(Vec::new()));
        let run = in_key_order(
            keys.to_vec(),
            |k| *k,
            |i, k| {
                let (barrier, log) = (barrier.clone(), log.clone());
                async move {
                    log.lock().unwrap().push(format!("start {i} {k}"));
                    if keys.iter().position(|x| *x == k) == Some(i) {
                        barrier.wait().await;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    log.lock().unwrap().push(format!("end {i} {k}"));
                    i * 10
                }
            },
        );
        let results = tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("the groups did not run concurrently");
        assert_eq!(results, [0, 10, 20, 30, 40, 50, 60]);
        let log = log.lock().unwrap().clone();
        let at = |what: &str| log.iter().position(|l| l == what).unwrap();
        for (i, k) in keys.iter().enumerate() {
            if let Some(j) = (i + 1..keys.len()).find(|&j| keys[j] == *k) {
                assert!(
                    at(&format!("end {i} {k}")) < at(&format!("start {j} {k}")),
                    "{log:?}"
                );
            }
        }
        // All three keys started before any item ended.
        let first_end = log.iter().position(|l| l.starts_with("end")).unwrap();
        for k in ["a", "b", "c"] {
            assert!(
                at(&format!(
                    "start {} {k}",
                    keys.iter().position(|x| *x == k).unwrap()
                )) < first_end
            );
        }
    }

    #[tokio::test]
    async fn one_item_and_one_key() {
        let r = in_key_order(vec![5], |_| 0, |i, x| async move { (i, x) }).await;
        assert_eq!(r, [(0, 5)]);
        let r = in_key_order(vec![1, 2, 3], |_| (), |i, x| async move { i + x }).await;
        assert_eq!(r, [1, 3, 5]);
    }
}
