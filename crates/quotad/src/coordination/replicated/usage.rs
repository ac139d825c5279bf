//! Usage reports: soft state for the leader's demand estimates, sent over the peer listener
//! (never through the log), and the leader's handler for them.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse as _, Response};
use axum::routing::post;
use axum::Router;
use quota_core::coordinator::PolicyKey;
use quota_core::demand::Usage;
use quota_core::{PolicyName, RegionId, TenantId};
use quota_raft::peer_api::refuse_identity;
use quota_raft::Role;
use quota_store::UsageRecord;
use serde::{Deserialize, Serialize};

use super::{unavailable, Replicated};
use crate::coordination::mutation::CoordError;

/// The peer-port route where regions send usage reports to the leader.
pub const PATH_USAGE: &str = "/quotad/v1/usage";

/// The largest usage report read (axum's default body limit, as before reports were read
/// by hand).
const MAX_USAGE_REPORT_BYTES: usize = 2 << 20;

/// A usage report: soft state for the leader's demand estimates.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageReport {
    pub region: RegionId,
    pub interval_ms: u64,
    /// `(tenant, policy, admitted, denied)`.
    pub usage: Vec<(TenantId, PolicyName, u64, u64)>,
    /// `(subject, policy, admitted, denied)` of the subjects most denied at their class's
    /// share (a top-K; `denied` is what each certainly had), for promotion. Left out when
    /// empty, so a report without any reads as before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub denied: Vec<(TenantId, PolicyName, u64, u64)>,
}

impl Replicated {
    /// Sends this region's usage to the leader (or records it, on the leader).
    pub async fn report_usage(
        &self,
        usage: &[UsageRecord],
        denied: Vec<(TenantId, PolicyName, u64, u64)>,
        interval_ms: u64,
    ) -> Result<(), CoordError> {
        let report = UsageReport {
            denied,
            region: self.region.clone(),
            interval_ms,
            usage: usage
                .iter()
                .map(|u| {
                    (
                        u.bucket.tenant.clone(),
                        u.bucket.policy.clone(),
                        u.admitted,
                        u.denied,
                    )
                })
                .collect(),
        };
        let status = self.raft.status();
        if status.role == Role::Leader {
            self.record_report(&report);
            return Ok(());
        }
        let leader = status
            .leader_id
            .and_then(|id| status.members.get(&id).cloned())
            .ok_or_else(|| unavailable("no leader known"))?;
        let resp = self
            .http
            .client()
            .post(format!(
                "{}://{}{PATH_USAGE}",
                self.peer_scheme(),
                leader.peer_addr
            ))
            .bearer_auth(self.peer_token.expose())
            // A leader that stopped answering costs one attempt; the next report goes to the
            // leader known then.
            .timeout(self.raft.config().forward_attempt_timeout())
            .json(&report)
            .send()
            .await
            .map_err(unavailable)?;
        if resp.status().is_success() {
            Ok(())
        } else {
            Err(unavailable(format!(
                "the leader answered {}",
                resp.status()
            )))
        }
    }

    fn record_report(&self, report: &UsageReport) {
        let Some(slot) = self.raft.read(|s| s.region_index(&report.region)) else {
            return;
        };
        let usage: Vec<(PolicyKey, Usage)> = report
            .usage
            .iter()
            .map(|(t, p, admitted, denied)| {
                (
                    PolicyKey::new(t.clone(), p.clone()),
                    Usage {
                        admitted: *admitted,
                        denied: *denied,
                    },
                )
            })
            .collect();
        self.demand
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(slot, report.interval_ms, &usage);
        if report.denied.is_empty() {
            return;
        }
        let denied: Vec<(PolicyKey, Usage)> = report
            .denied
            .iter()
            .map(|(t, p, admitted, denied)| {
                (
                    PolicyKey::new(t.clone(), p.clone()),
                    Usage {
                        admitted: *admitted,
                        denied: *denied,
                    },
                )
            })
            .collect();
        self.promotion
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(slot, report.interval_ms, &denied);
    }

    /// How many subjects a report names as denied at their class's share.
    pub fn promotion_top_k(&self) -> usize {
        self.promotion
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .config()
            .top_k
    }

    /// The peer listener's router: Raft's protocol plus the usage endpoints (regions' reports
    /// to the leader, standbys' counts to their agent).
    pub fn peer_router(self: &Arc<Self>) -> Router {
        let usage = Router::new()
            .route(PATH_USAGE, post(receive_usage))
            .route(
                super::standby_usage::PATH_STANDBY_USAGE,
                post(super::standby_usage::receive),
            )
            .with_state(self.clone());
        self.raft.peer_router().merge(usage)
    }
}

/// POST /quotad/v1/usage on the leader, authenticated with the peer token.
async fn receive_usage(State(me): State<Arc<Replicated>>, req: axum::extract::Request) -> Response {
    // With peer TLS, the report must come over a connection authenticated as its region.
    let caller = match super::peer_auth::peer_caller(&me, &req) {
        Ok(c) => c,
        Err(code) => return code.into_response(),
    };
    let Ok(body) = axum::body::to_bytes(req.into_body(), MAX_USAGE_REPORT_BYTES).await else {
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    let Ok(report) = serde_json::from_slice::<UsageReport>(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    if let Some(caller) = caller {
        if caller.as_deref() != Some(report.region.as_str()) {
            return refuse_identity(PATH_USAGE, "a usage report for another region");
        }
    }
    if !me.raft.is_leader() {
        return StatusCode::MISDIRECTED_REQUEST.into_response();
    }
    me.record_report(&report);
    StatusCode::NO_CONTENT.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_names_denied_subjects_only_when_it_has_some() {
        let t = TenantId::new("s").unwrap();
        let p = PolicyName::new("calls").unwrap();
        let plain = UsageReport {
            region: RegionId::new("eu").unwrap(),
            interval_ms: 200,
            usage: vec![(t.clone(), p.clone(), 3, 1)],
            denied: vec![],
        };
        let json = serde_json::to_value(&plain).unwrap();
        assert!(json.get("denied").is_none(), "{json}");
        let back: UsageReport = serde_json::from_value(json).unwrap();
        assert!(back.denied.is_empty());
        let with = UsageReport {
            denied: vec![(t, p, 3, 1)],
            ..plain
        };
        let back: UsageReport =
            serde_json::from_value(serde_json::to_value(&with).unwrap()).unwrap();
        assert_eq!(back.denied, with.denied);
        // Unknown fields are still refused.
        let mut odd = serde_json::to_value(&with).unwrap();
        odd["extra"] = serde_json::json!(1);
        assert!(serde_json::from_value::<UsageReport>(odd).is_err());
    }
}
