//! What a standby daemon counts without the store, handed to its region's agent: checks it
//! forwarded to another region and denials it answered from its denial cache. Redis counts
//! every daemon's decisions, so the agent's report covers those; these two only the daemon
//! that answered knows, and a region whose callers land on a standby must still report them as
//! its demand, or share would come back to it more slowly the more daemons it runs.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse as _, Response};
use quota_core::{PolicyName, RegionId, TenantId};
use quota_raft::peer_api::refuse_identity;
use quota_store::{BucketRef, UsageRecord};
use serde::{Deserialize, Serialize};

use super::{unavailable, Replicated};
use crate::coordination::mutation::CoordError;
use crate::telemetry;

/// The peer-port route where standbys hand their counts to their region's agent.
pub const PATH_STANDBY_USAGE: &str = "/quotad/v1/standby-usage";

/// The largest hand-over read.
const MAX_BYTES: usize = 2 << 20;

/// Most records the agent keeps from standbys between two reports: beyond, they are dropped
/// (and counted), so standbys that cannot reach the leader's agent report cannot grow it.
const MAX_KEPT: usize = 65_536;

/// One bucket's counts: `(tenant, policy, version, admitted, denied)`.
type Row = (TenantId, PolicyName, u64, u64, u64);

/// A standby's counts since its last hand-over.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StandbyUsage {
    pub region: RegionId,
    /// Checks it forwarded to another region, admitted and denied.
    pub forwarded: Vec<Row>,
    /// Denials it answered from its cache (admitted always 0).
    pub cached: Vec<Row>,
}

fn rows(records: &[UsageRecord]) -> Vec<Row> {
    records
        .iter()
        .map(|u| {
            (
                u.bucket.tenant.clone(),
                u.bucket.policy.clone(),
                u.bucket.version,
                u.admitted,
                u.denied,
            )
        })
        .collect()
}

fn records(rows: Vec<Row>) -> Vec<UsageRecord> {
    rows.into_iter()
        .map(|(tenant, policy, version, admitted, denied)| UsageRecord {
            bucket: BucketRef {
                tenant,
                policy,
                version,
            },
            admitted,
            denied,
        })
        .collect()
}

/// What the agent holds from standbys for its next report.
#[derive(Debug, Default)]
pub(super) struct Received {
    forwarded: Vec<UsageRecord>,
    cached: Vec<UsageRecord>,
}

impl Replicated {
    /// Hands a standby's counts to the region's agent. On an error nothing was taken: the
    /// caller puts its cached denials back for the next try.
    pub async fn hand_over_usage(
        &self,
        forwarded: &[UsageRecord],
        cached: &[UsageRecord],
    ) -> Result<(), CoordError> {
        if forwarded.is_empty() && cached.is_empty() {
            return Ok(());
        }
        let body = StandbyUsage {
            region: self.region.clone(),
            forwarded: rows(forwarded),
            cached: rows(cached),
        };
        let agent = self.raft.read(|s| {
            let i = s.region_index(&self.region)?;
            Some(s.region(usize::from(i))?.agent?.node)
        });
        let status = self.raft.status();
        let addr = agent
            .and_then(|n| status.members.get(&n))
            .map(|m| m.peer_addr.clone())
            .ok_or_else(|| unavailable("no agent known for this region"))?;
        let resp = self
            .http
            .client()
            .post(format!(
                "{}://{addr}{PATH_STANDBY_USAGE}",
                self.peer_scheme()
            ))
            .bearer_auth(self.peer_token.expose())
            .timeout(self.raft.config().forward_attempt_timeout())
            .json(&body)
            .send()
            .await
            .map_err(unavailable)?;
        let outcome = if resp.status().is_success() {
            "sent"
        } else {
            "refused"
        };
        metrics::counter!(telemetry::STANDBY_USAGE_TOTAL, "region" => self.region.as_str().to_string(), "outcome" => outcome)
            .increment((forwarded.len() + cached.len()) as u64);
        if resp.status().is_success() {
            Ok(())
        } else {
            Err(unavailable(format!("the agent answered {}", resp.status())))
        }
    }

    /// What standbys handed over since the last call: forwarded usage, cached denials.
    pub fn take_standby_usage(&self) -> (Vec<UsageRecord>, Vec<UsageRecord>) {
        let mut r = self.standby_usage.lock().unwrap_or_else(|e| e.into_inner());
        (
            std::mem::take(&mut r.forwarded),
            std::mem::take(&mut r.cached),
        )
    }

    fn keep_standby_usage(&self, usage: StandbyUsage) -> usize {
        let mut r = self.standby_usage.lock().unwrap_or_else(|e| e.into_inner());
        let room = MAX_KEPT.saturating_sub(r.forwarded.len() + r.cached.len());
        let offered = usage.forwarded.len() + usage.cached.len();
        let forwarded = records(usage.forwarded);
        let cached = records(usage.cached);
        let take_f = forwarded.len().min(room);
        r.forwarded.extend(forwarded.into_iter().take(take_f));
        r.cached
            .extend(cached.into_iter().take(room.saturating_sub(take_f)));
        offered.saturating_sub(room)
    }
}

/// POST /quotad/v1/standby-usage on a region's agent, authenticated with the peer token (and,
/// with peer TLS, a certificate of the same region).
pub(super) async fn receive(
    State(me): State<Arc<Replicated>>,
    req: axum::extract::Request,
) -> Response {
    let caller = match super::peer_auth::peer_caller(&me, &req) {
        Ok(c) => c,
        Err(code) => return code.into_response(),
    };
    let Ok(body) = axum::body::to_bytes(req.into_body(), MAX_BYTES).await else {
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    let Ok(usage) = serde_json::from_slice::<StandbyUsage>(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    if let Some(caller) = caller {
        if caller.as_deref() != Some(usage.region.as_str()) {
            return refuse_identity(PATH_STANDBY_USAGE, "standby usage for another region");
        }
    }
    // Only this region's agent reports them: anyone else sends the standby to the agent.
    if usage.region != me.region || me.agent_fence().is_none() {
        return StatusCode::MISDIRECTED_REQUEST.into_response();
    }
    let dropped = me.keep_standby_usage(usage);
    if dropped > 0 {
        metrics::counter!(telemetry::STANDBY_USAGE_TOTAL, "region" => me.region.as_str().to_string(), "outcome" => "dropped")
            .increment(dropped as u64);
    }
    StatusCode::NO_CONTENT.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_cross_the_wire_unchanged() {
        let r = UsageRecord {
            bucket: BucketRef {
                tenant: TenantId::new("acme").unwrap(),
                policy: PolicyName::new("writes").unwrap(),
                version: 7,
            },
            admitted: 3,
            denied: 11,
        };
        let body = StandbyUsage {
            region: RegionId::new("a").unwrap(),
            forwarded: rows(std::slice::from_ref(&r)),
            cached: Vec::new(),
        };
        let text = serde_json::to_string(&body).unwrap();
        let back: StandbyUsage = serde_json::from_str(&text).unwrap();
        assert_eq!(records(back.forwarded), [r]);
        assert!(serde_json::from_str::<StandbyUsage>(
            r#"{"region":"a","forwarded":[],"cached":[],"x":1}"#
        )
        .is_err());
    }
}
