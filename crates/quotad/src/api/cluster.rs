//! Cluster-wide endpoints: status, membership, the policy listing, health and metrics.

use std::sync::atomic::Ordering;

use axum::extract::{Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use quota_core::{PolicyName, RegionId, TenantId};
use serde::{Deserialize, Serialize};

use crate::api::problem::{bad_request, ApiError, ApiJson, ApiPath, Problem};
use crate::api::state::AppState;
use crate::api::tenants::{coord_error, PolicyView};
use crate::clock;
use crate::config::validate::check_authority;
use crate::coordination::{MemberStatus, Removal};

/// Raft state as seen by this node.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RaftView {
    pub role: String,
    /// The leader's region.
    pub leader: Option<String>,
    /// The leader's node id: a region may run several daemons.
    pub leader_node: Option<u64>,
    /// This daemon's node id.
    pub node_id: u64,
    pub term: u64,
    pub applied_index: u64,
    pub peers: Vec<MemberView>,
}

/// A cluster member.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct MemberView {
    pub region: String,
    pub node_id: u64,
    pub voter: bool,
    /// Whether this member holds its region's agent role: it writes the region's store and
    /// reports its usage; the region's other daemons stand by to take it over.
    pub agent: bool,
}

impl From<&MemberStatus> for MemberView {
    fn from(m: &MemberStatus) -> Self {
        Self {
            region: m.region.as_str().to_string(),
            node_id: m.node_id,
            voter: m.voter,
            agent: m.agent,
        }
    }
}

/// The regional store's state.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct StoreView {
    /// `embedded` or `redis`.
    pub kind: String,
    /// How Redis is deployed: `standalone`, `cluster` or `sentinel` (`embedded` without Redis).
    pub topology: String,
    /// `ok` or `degraded` (circuit breaker open: fail modes decide).
    pub state: String,
}

/// This region's lease, as the region counts it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct LeaseView {
    /// Grants this region holds.
    pub grants: usize,
    /// Wall-clock ms at which the region stops enforcing more than its floors (lease end minus
    /// the drift margin), for display: this answer's wall time plus what is left of the lease,
    /// which the region counts on its monotonic clock; `null` when the lease never ends
    /// (single region), 0 before any lease.
    pub ends_at_ms: Option<u64>,
    /// Milliseconds left; 0 when the region holds no lease (it enforces its floors).
    pub remaining_ms: Option<u64>,
}

/// GET /v1/status.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct StatusView {
    pub region: String,
    pub version: String,
    /// Whether `/readyz` answers 200.
    pub ready: bool,
    /// What the daemon waits for before it is ready, one line each (empty once it was ready,
    /// and while it starts serving or drains for shutdown).
    pub waiting_for: Vec<String>,
    pub raft: RaftView,
    pub store: StoreView,
    pub lease: LeaseView,
    pub policies: usize,
    /// Policies decided at a home region: those of pinned tenants and `critical` policies the
    /// allocator pinned.
    pub pins: usize,
    /// Tenants an operator pinned (a pin covers the tenant's later policies too).
    pub pinned_tenants: usize,
}

/// The daemon's state: region, Raft role and progress, store health, leases.
#[utoipa::path(get, path = "/v1/status", responses((status = 200, body = StatusView)), security(("bearer" = ["read"])), tag = "cluster")]
pub async fn status(State(state): State<AppState>) -> axum::Json<StatusView> {
    let s = state.coordinator.status();
    let view = state.coordinator.view();
    let region = state.decider.region();
    let grants = view
        .policies
        .values()
        .filter(|e| e.grants.contains_key(region))
        .count();
    // The lease end is on the monotonic clock; shown on the wall clock as of this answer.
    let end = (view.lease_end_local_ms != u64::MAX).then_some(view.lease_end_local_ms);
    let (now, wall) = (clock::monotonic_ms(), clock::wall_ms());
    axum::Json(StatusView {
        region: region.as_str().to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        ready: state.ready.load(Ordering::Relaxed),
        waiting_for: state
            .coordinator
            .readiness()
            .iter()
            .map(ToString::to_string)
            .collect(),
        raft: RaftView {
            role: s.role.to_string(),
            leader: s.leader.map(|r| r.as_str().to_string()),
            leader_node: s.leader_node,
            node_id: s.node_id,
            term: s.term,
            applied_index: s.applied_index,
            peers: s.members.iter().map(MemberView::from).collect(),
        },
        store: StoreView {
            kind: if crate::decision::is_embedded(state.decider.store()) {
                "embedded"
            } else {
                "redis"
            }
            .to_string(),
            topology: match state.decider.store() {
                quota_store::AnyStore::Embedded(_) => "embedded",
                quota_store::AnyStore::Redis(r) => r.topology_name(),
            }
            .to_string(),
            state: if state.decider.store_degraded() {
                "degraded"
            } else {
                "ok"
            }
            .to_string(),
        },
        lease: LeaseView {
            grants,
            ends_at_ms: end.map(|e| {
                if e == 0 {
                    0
                } else {
                    (wall + e).saturating_sub(now)
                }
            }),
            remaining_ms: end.map(|e| e.saturating_sub(now)),
        },
        policies: view.policies.len(),
        pins: view.policies.values().filter(|e| e.home.is_some()).count(),
        pinned_tenants: view.tenant_pins.len(),
    })
}

/// Cluster members.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct MembersView {
    pub members: Vec<MemberView>,
    pub leader: Option<String>,
}

/// The cluster's members and its leader.
#[utoipa::path(get, path = "/v1/cluster/members", responses((status = 200, body = MembersView)), security(("bearer" = ["read"])), tag = "cluster")]
pub async fn members(State(state): State<AppState>) -> axum::Json<MembersView> {
    let s = state.coordinator.status();
    axum::Json(MembersView {
        members: s.members.iter().map(MemberView::from).collect(),
        leader: s.leader.map(|r| r.as_str().to_string()),
    })
}

/// A node to add to the cluster.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewMember {
    pub node_id: u64,
    pub region: String,
    /// `host:port` of its peer (Raft) listener: a DNS name (resolved at each new connection)
    /// or an IP address (IPv6 in brackets), as in `[[regions]]`.
    pub peer: String,
    /// `host:port` of its admin API, in the same form.
    pub api: String,
}

/// Adds a node as a learner (on the leader); promote it once it caught up.
#[utoipa::path(
    post,
    path = "/v1/cluster/members",
    request_body = NewMember,
    responses(
        (status = 204, description = "Added as a learner"),
        (status = 400, body = Problem),
        (status = 409, description = "Not the leader, or a single-region daemon", body = Problem),
    ),
    security(("bearer" = ["admin"])),
    tag = "cluster"
)]
pub async fn add_member(
    State(state): State<AppState>,
    ApiJson(m): ApiJson<NewMember>,
) -> Result<StatusCode, ApiError> {
    if m.node_id == 0 {
        return Err(ApiError::field("node_id", &"must be at least 1"));
    }
    RegionId::new(m.region.as_str()).map_err(|e| ApiError::field("region", &e))?;
    // The form `[[regions]]` takes; the Raft transport resolves a host name per connection.
    for (field, addr) in [("peer", &m.peer), ("api", &m.api)] {
        check_authority(addr).map_err(|why| ApiError::field(field, &why))?;
    }
    let member = quota_raft::Member {
        region: m.region,
        peer_addr: m.peer,
        admin_addr: m.api,
    };
    state
        .coordinator
        .add_member(m.node_id, member)
        .await
        .map_err(coord_error)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Makes a learner a voter (on the leader).
#[utoipa::path(
    post,
    path = "/v1/cluster/members/{node_id}/promote",
    params(("node_id" = u64, Path)),
    responses((status = 204), (status = 404, body = Problem), (status = 409, body = Problem)),
    security(("bearer" = ["admin"])),
    tag = "cluster"
)]
pub async fn promote_member(
    State(state): State<AppState>,
    ApiPath(node_id): ApiPath<u64>,
) -> Result<StatusCode, ApiError> {
    state
        .coordinator
        .promote_member(node_id)
        .await
        .map_err(coord_error)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Removes a member (on the leader): its region drains (its shares and floors go to the other
/// regions, revoke before grant), then leaves the coordinator's state and the Raft group.
#[utoipa::path(
    delete,
    path = "/v1/cluster/members/{node_id}",
    params(("node_id" = u64, Path)),
    responses(
        (status = 202, description = "The region drains; the leader removes it once it enforces nothing"),
        (status = 204, description = "Removed (its region had left already)"),
        (status = 404, body = Problem),
        (status = 409, description = "Not the leader, a single-region daemon, or tenants pinned to the region", body = Problem),
    ),
    security(("bearer" = ["admin"])),
    tag = "cluster"
)]
pub async fn remove_member(
    State(state): State<AppState>,
    ApiPath(node_id): ApiPath<u64>,
) -> Result<StatusCode, ApiError> {
    match state
        .coordinator
        .remove_member(node_id)
        .await
        .map_err(coord_error)?
    {
        Removal::Draining => Ok(StatusCode::ACCEPTED),
        Removal::Removed => Ok(StatusCode::NO_CONTENT),
    }
}

/// Paging of GET /v1/policies.
#[derive(Debug, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub struct PageQuery {
    /// Page size, 1–1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<u32>,
    /// The `next` cursor of the previous page (`tenant:policy`).
    after: Option<String>,
}

/// Largest page of GET /v1/policies.
pub const MAX_PAGE: usize = 1000;

/// The page size and cursor of a listing, each parameter checked by name.
pub(crate) fn page_query(
    pairs: Vec<(String, String)>,
) -> Result<(usize, Option<String>), ApiError> {
    let (mut limit, mut after) = (None, None);
    for (key, value) in pairs {
        match key.as_str() {
            "limit" if limit.is_none() => limit = Some(value),
            "after" if after.is_none() => after = Some(value),
            "limit" | "after" => return Err(bad_request(key, "is given twice")),
            _ => {
                return Err(bad_request(
                    key,
                    "is not a known parameter; expected `limit` or `after`",
                ))
            }
        }
    }
    let limit = match limit {
        None => 100,
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_PAGE).contains(n))
            .ok_or_else(|| {
                bad_request(
                    "limit",
                    format!("must be a whole number between 1 and {MAX_PAGE}"),
                )
            })?,
    };
    Ok((limit, after))
}

/// One page of policies.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PolicyPage {
    pub policies: Vec<PolicyView>,
    /// Pass as `after` for the next page; absent on the last page.
    pub next: Option<String>,
}

/// Every policy, paged in (tenant, policy) order.
#[utoipa::path(
    get,
    path = "/v1/policies",
    params(PageQuery),
    responses(
        (status = 200, body = PolicyPage),
        (status = 400, body = Problem),
    ),
    security(("bearer" = ["read"])),
    tag = "policies"
)]
pub async fn list_policies(
    State(state): State<AppState>,
    query: Result<Query<Vec<(String, String)>>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::Json<PolicyPage>, ApiError> {
    let Query(pairs) = query.map_err(|_| bad_request("query", "is not a valid query string"))?;
    let (limit, after) = page_query(pairs)?;
    let after = match &after {
        None => None,
        Some(c) => {
            let (t, p) = c
                .split_once(':')
                .ok_or_else(|| ApiError::field("after", &"not a cursor"))?;
            let t = TenantId::new(t).map_err(|_| ApiError::field("after", &"not a cursor"))?;
            let p = PolicyName::new(p).map_err(|_| ApiError::field("after", &"not a cursor"))?;
            Some((t, p))
        }
    };
    let view = state.coordinator.view();
    let iter: Box<dyn Iterator<Item = _>> = match &after {
        None => Box::new(view.policies.iter()),
        Some(k) => Box::new(view.policies.range((
            std::ops::Bound::Excluded(k.clone()),
            std::ops::Bound::Unbounded,
        ))),
    };
    let mut policies = Vec::new();
    let mut next = None;
    // A plan's policies are listed with their plan (GET /v1/plans), not as a tenant's.
    for ((t, p), e) in iter.filter(|((t, _), _)| t.reserved().is_none()) {
        if policies.len() == limit {
            next = policies
                .last()
                .map(|v: &PolicyView| format!("{}:{}", v.tenant, v.policy));
            break;
        }
        policies.push(PolicyView::new(t, p, &e.policy));
    }
    Ok(axum::Json(PolicyPage { policies, next }))
}

/// Liveness: the process answers.
#[utoipa::path(get, path = "/livez", responses((status = 200, body = String, content_type = "text/plain")), tag = "health")]
pub async fn livez() -> &'static str {
    "ok\n"
}

/// Readiness: 200 once the daemon can decide for its region (a cluster member: registered,
/// with every region of its group, and holding its first lease), 503 before and while
/// draining for shutdown; the body says what it waits for.
#[utoipa::path(get, path = "/readyz", responses((status = 200, body = String, content_type = "text/plain"), (status = 503, description = "Starting (the body says what it waits for) or draining", body = String, content_type = "text/plain")), tag = "health")]
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, String) {
    if state.ready.load(Ordering::Relaxed) {
        return (StatusCode::OK, "ready\n".to_string());
    }
    let awaited = state.coordinator.readiness();
    let body = if awaited.is_empty() {
        "not ready: starting to serve, or draining for shutdown\n".to_string()
    } else {
        format!(
            "not ready: waiting for {}\n",
            crate::coordination::readiness::describe(&awaited)
        )
    };
    (StatusCode::SERVICE_UNAVAILABLE, body)
}

/// Prometheus metrics.
#[utoipa::path(get, path = "/metrics", responses((status = 200, body = String, content_type = "text/plain")), tag = "health")]
pub async fn metrics(State(state): State<AppState>) -> Response {
    // The time left on the lease as of this scrape, not as of the agent's last look.
    state.coordinator.observe_lease();
    let body = state
        .metrics
        .as_ref()
        .map(|h| h.render())
        .unwrap_or_default();
    let mut resp = body.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}
