//! Checks decided in another region: a pinned tenant's home, or the region granted the most
//! when this one's share cannot hold a check. One check at a time, or all of a batch's checks
//! for one home in one request; over plain HTTP to the API or the peer mutual-TLS channel.
//! A home that does not answer leaves the check to this region's floor, in process.
//!
//! The usage of forwarded checks is counted here: it is demand where the callers are, which is
//! what brings share back to a region that forwards because its share ran out.

use quota_core::share::limit_for_share;
use quota_core::{Decision, FailMode, Policy, PolicyName, RegionId, TenantId};
use quota_store::{BucketRef, CheckRequest, UsageRecord};
use serde::Deserialize;

use super::verdict::outcome_of;
use super::{CheckError, Decider, Mode, Verdict};
use crate::clock;
use quota_core::mode;

/// Header marking a check forwarded from another region, so it is never forwarded again. Its
/// value is the peer token: a client cannot use it to skip a pinned tenant's home.
/// A `HeaderName`, not a `&str`: looking a `&str` up parses it on every request.
pub const FORWARDED_HEADER: axum::http::HeaderName =
    axum::http::HeaderName::from_static("x-quotad-forwarded");

/// Header naming the region a check is forwarded from, on the peer listener's forward routes:
/// it must be the region the connection's client certificate authenticates.
pub const FORWARDED_FROM_HEADER: axum::http::HeaderName =
    axum::http::HeaderName::from_static("x-quotad-forwarded-from");

/// With peer TLS, checks are forwarded to the home's peer listener at this prefix plus the
/// API path (`/quotad/v1/check`, `/quotad/v1/check/batch`).
pub const PEER_FORWARD_PREFIX: &str = "/quotad";

/// The answer a home region sends back to a forwarded check.
#[derive(Debug, Deserialize)]
struct ForwardedAnswer {
    allowed: bool,
    remaining: u64,
    retry_after_ms: Option<u64>,
    reset_ms: Option<u64>,
    #[serde(default)]
    shadow_denied: bool,
}

impl ForwardedAnswer {
    fn verdict(self, policy: Policy, home: &RegionId) -> Verdict {
        Verdict {
            decision: Decision {
                allowed: self.allowed,
                remaining: self.remaining,
                retry_after_ms: self.retry_after_ms,
                reset_ms: self.reset_ms,
            },
            policy,
            mode: Mode::Forwarded,
            decided_by: home.clone(),
            shadow_denied: self.shadow_denied,
        }
    }
}

/// The answer a home region sends back to a forwarded batch (`api::batch::BatchResponse`).
#[derive(Debug, Deserialize)]
struct ForwardedBatch {
    results: Vec<ForwardedItem>,
}

#[derive(Debug, Deserialize)]
struct ForwardedItem {
    status: u16,
    decision: Option<ForwardedAnswer>,
}

/// A check of `bucket` as the API takes it, for its home region.
fn check_body(bucket: &BucketRef, cost: u64) -> serde_json::Value {
    serde_json::json!({
        "tenant": bucket.tenant.as_str(),
        "policy": bucket.policy.as_str(),
        "cost": cost,
    })
}

impl Decider {
    /// The usage of checks this region forwarded since the last call, for its usage report.
    pub fn take_forwarded_usage(&self) -> Vec<UsageRecord> {
        let taken = std::mem::take(
            &mut *self
                .forwarded_usage
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        taken
            .into_iter()
            .map(|(bucket, (admitted, denied))| UsageRecord {
                bucket,
                admitted,
                denied,
            })
            .collect()
    }

    /// Counts a check another region decided for this one's caller.
    fn count_forwarded(&self, bucket: &BucketRef, cost: u64, allowed: bool) {
        let mut usage = self
            .forwarded_usage
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // Bounded by the policies in the view: one entry per bucket.
        let slot = usage.entry(bucket.clone()).or_default();
        if allowed {
            slot.0 = slot.0.saturating_add(cost);
        } else {
            slot.1 = slot.1.saturating_add(cost);
        }
    }

    /// True when a request's forwarded-header value proves it came from a peer daemon.
    pub fn is_peer_forward(&self, value: Option<&str>) -> bool {
        match (&self.peer_token, value) {
            (Some(t), Some(v)) => t.matches(v),
            _ => false,
        }
    }

    /// The region a check of `tenant`'s `policy` is decided in when that is not this one (the
    /// tenant is pinned elsewhere), unless the check was itself forwarded here.
    pub fn home_elsewhere(
        &self,
        tenant: &TenantId,
        policy: &PolicyName,
        forwarded: bool,
    ) -> Option<RegionId> {
        if forwarded {
            return None;
        }
        let view = self.view();
        let home = view.resolve(tenant, policy)?.entry.home.as_ref()?;
        (*home != self.region).then(|| home.clone())
    }

    /// Decides checks pinned to `home` with one request there, in order, so a batch pays one
    /// round trip to a home region however many of its checks go there. Each check is first
    /// validated here, as [`Decider::check`] does; a check the home cannot answer (or all of
    /// them, when it is unreachable) falls back as a single forwarded check would.
    pub async fn check_at_home(
        &self,
        home: &RegionId,
        checks: Vec<(TenantId, PolicyName, u64)>,
    ) -> Vec<Result<Verdict, CheckError>> {
        let started = clock::monotonic();
        let prepared: Vec<Result<(BucketRef, u64, Policy), CheckError>> = {
            let view = self.view();
            checks
                .into_iter()
                .map(|(tenant, policy_name, cost)| {
                    let entry = view
                        .resolve(&tenant, &policy_name)
                        .ok_or(CheckError::UnknownPolicy)?
                        .entry;
                    let (policy, _share, _limit) = self.params_of(&view, entry);
                    mode::check_cost(&policy, cost, entry.grants.len())?;
                    let bucket = BucketRef {
                        tenant,
                        policy: policy_name,
                        version: policy.version,
                    };
                    Ok((bucket, cost, policy))
                })
                .collect()
        };
        let sent: Vec<_> = prepared
            .iter()
            .filter_map(|p| p.as_ref().ok())
            .map(|(b, cost, _)| check_body(b, *cost))
            .collect();
        let mut answers = if sent.is_empty() {
            Vec::new()
        } else {
            self.send_home(
                home,
                "/v1/check/batch",
                &serde_json::json!({ "checks": sent }),
            )
            .await
            .and_then(|b: ForwardedBatch| (b.results.len() == sent.len()).then_some(b.results))
            .unwrap_or_default()
        }
        .into_iter();
        let mut results = Vec::with_capacity(prepared.len());
        for p in prepared {
            let result = match p {
                // Refused before deciding, as a single check is: not counted as a decision.
                Err(e) => Err(e),
                Ok((bucket, cost, policy)) => {
                    let name = bucket.policy.clone();
                    let r = match answers.next() {
                        Some(ForwardedItem {
                            status: 200 | 429,
                            decision: Some(a),
                        }) => {
                            self.count_forwarded(&bucket, cost, a.allowed);
                            Ok(a.verdict(policy, home))
                        }
                        _ => self.home_unreachable(home, bucket, cost, policy).await,
                    }
                    .map(|v| self.count_shadow(&name, v));
                    self.metrics
                        .record(&name, outcome_of(&r), started.elapsed().as_secs_f64());
                    r
                }
            };
            results.push(result);
        }
        results
    }

    pub(super) async fn forward(
        &self,
        home: &RegionId,
        bucket: BucketRef,
        cost: u64,
        policy: Policy,
    ) -> Result<Verdict, CheckError> {
        match self.ask(home, &bucket, cost, &policy).await {
            Some(v) => Ok(v),
            None => self.home_unreachable(home, bucket, cost, policy).await,
        }
    }

    /// `there`'s decision of the check, counted as forwarded; `None` if it did not answer.
    async fn ask(
        &self,
        there: &RegionId,
        bucket: &BucketRef,
        cost: u64,
        policy: &Policy,
    ) -> Option<Verdict> {
        let body = check_body(bucket, cost);
        let a = self
            .send_home::<ForwardedAnswer>(there, "/v1/check", &body)
            .await?;
        self.count_forwarded(bucket, cost, a.allowed);
        Some(a.verdict(policy.clone(), there))
    }

    /// Decides a check this region's share cannot hold in `there`, the region granted the
    /// most. If it does not answer, nothing here can hold the check either: that is reduced
    /// capacity for as long as the cut lasts (a 503 the caller retries), not a denial with no
    /// time after which it could succeed.
    pub(super) async fn forward_richer(
        &self,
        there: &RegionId,
        bucket: BucketRef,
        cost: u64,
        policy: Policy,
    ) -> Result<Verdict, CheckError> {
        match self.ask(there, &bucket, cost, &policy).await {
            Some(v) => Ok(v),
            None => {
                self.forward_failures.increment(1);
                Err(CheckError::ReducedCapacity {
                    policy: bucket.policy,
                    reason: "the region holding this policy's budget is unreachable",
                })
            }
        }
    }

    /// POSTs `body` to `path` on one of `home`'s daemons (see [`Self::relay`]); the answer of
    /// a 200 or 429, or `None` when the home is unknown, or none of its daemons answers that
    /// within the forward timeout.
    pub(super) async fn send_home<T: serde::de::DeserializeOwned>(
        &self,
        home: &RegionId,
        path: &str,
        body: &serde_json::Value,
    ) -> Option<T> {
        let r = self.relay(home, path, body).await?;
        if !matches!(r.status, 200 | 429) {
            return None;
        }
        serde_json::from_value(r.body).ok()
    }

    /// POSTs `body` to `path` on one of `region`'s daemons' API as a forwarding peer (over the
    /// peer TLS channel, naming this region, when `over_peer`), and passes its answer on as it
    /// gave it: a decision (200, 429) or a refusal of the request (400, 404, 409). `None` when
    /// the region is unknown, or no daemon gave one within the forward timeout. Successive
    /// calls start at successive daemons, so a region's daemons share the load, and a daemon
    /// that is down costs the next one's turn, not the call.
    pub(super) async fn relay(
        &self,
        region: &RegionId,
        path: &str,
        body: &serde_json::Value,
    ) -> Option<super::holds::Relayed> {
        let addrs = self.homes.get(region).filter(|a| !a.is_empty())?;
        let first = self
            .next_home
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let deadline = tokio::time::Instant::now() + self.forward_timeout;
        for i in 0..addrs.len() {
            let addr = &addrs[(first + i) % addrs.len()];
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            let Some(resp) = self.post_to(addr, path, body, left).await else {
                continue;
            };
            let status = resp.status().as_u16();
            if !matches!(status, 200 | 400 | 404 | 409 | 429) {
                continue;
            }
            if let Ok(body) = resp.json::<serde_json::Value>().await {
                return Some(super::holds::Relayed { status, body });
            }
        }
        None
    }

    /// POSTs `body` to `path` at `addr` as a forwarding peer; `None` when it did not answer.
    async fn post_to(
        &self,
        addr: &str,
        path: &str,
        body: &serde_json::Value,
        timeout: std::time::Duration,
    ) -> Option<reqwest::Response> {
        let prefix = if self.over_peer {
            PEER_FORWARD_PREFIX
        } else {
            ""
        };
        let mut req = self
            .http
            .client()
            .post(format!("{}://{addr}{prefix}{path}", self.http.scheme()))
            .header(
                FORWARDED_HEADER.as_str(),
                self.peer_token.as_ref().map_or("", |t| t.expose()),
            );
        if self.over_peer {
            req = req.header(FORWARDED_FROM_HEADER.as_str(), self.region.as_str());
        }
        req.timeout(timeout).json(body).send().await.ok()
    }

    /// A check whose home region could not decide it: this region's floor, in process, or a
    /// denial when the policy fails closed or has no floor.
    async fn home_unreachable(
        &self,
        home: &RegionId,
        bucket: BucketRef,
        cost: u64,
        policy: Policy,
    ) -> Result<Verdict, CheckError> {
        self.forward_failures.increment(1);
        tracing::debug!(tenant = %bucket.tenant, home = %home, "Home region unreachable.");
        // The floor in whole units: one that holds less than a unit is none.
        let floor_ppm = policy.whole_floor_ppm();
        if policy.fail_mode == FailMode::Closed || floor_ppm == 0 {
            return Err(CheckError::ReducedCapacity {
                policy: bucket.policy,
                reason: "the tenant's home region is unreachable",
            });
        }
        // Decide at this daemon's part of this region's floor, in process, so a down home
        // cannot be bypassed at more.
        let limit = match limit_for_share(&policy, floor_ppm).into() {
            quota_store::Limit::TokenBucket(p) => {
                quota_store::Limit::TokenBucket(super::outage::part(&p, self.outage.daemons()))
            }
            quota_store::Limit::SlidingWindow { limit, window_ms } => {
                quota_store::Limit::SlidingWindow {
                    limit: limit / self.outage.daemons(),
                    window_ms,
                }
            }
            // Refused before any check is forwarded: a slot is a hold.
            l @ quota_store::Limit::Concurrency { .. } => l,
        };
        let req = CheckRequest {
            bucket,
            limit,
            cost,
            now_ms: None,
        };
        let decision = self
            .decide_in_process(&req, "the tenant's home region is unreachable")
            .await?;
        Ok(self.verdict_here(decision, policy, Mode::HomeUnreachableFloor))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use serde_json::json;

    use super::*;
    use crate::decision::tests::{decider_of, decider_with_home, entry, ids};

    fn checks(list: &[(&str, &str, u64)]) -> Vec<(TenantId, PolicyName, u64)> {
        list.iter()
            .map(|(t, p, c)| {
                let (t, p) = ids(t, p);
                (t, p, *c)
            })
            .collect()
    }

    #[tokio::test]
    async fn a_homes_checks_go_there_in_one_request_in_order() {
        let (d, seen) = decider_with_home(200).await;
        let (vip, w) = ids("vip", "w");
        assert_eq!(
            d.home_elsewhere(&vip, &w, false).map(|r| r.to_string()),
            Some("a".into())
        );
        assert_eq!(
            d.home_elsewhere(&vip, &w, true),
            None,
            "a forwarded check stays"
        );
        let list = [
            ("vip", "w", 1),
            ("strict", "w", 2),
            ("vip", "nope", 1),
            ("vip", "w", 11),
            ("vip", "w", 3),
        ];
        let home = RegionId::new("a").unwrap();
        let results = d.check_at_home(&home, checks(&list)).await;
        // Unknown policies and costs above the burst are refused here, not sent.
        assert!(matches!(results[2], Err(CheckError::UnknownPolicy)));
        assert!(matches!(results[3], Err(CheckError::Cost(_))));
        for i in [0, 1, 4] {
            let v = results[i].as_ref().unwrap();
            assert_eq!((v.mode, v.decided_by.as_str()), (Mode::Forwarded, "a"));
            assert_eq!((v.decision.allowed, v.decision.remaining), (true, 7));
        }
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 1, "one request for the home's checks: {seen:?}");
        let (path, forwarded, body) = &seen[0];
        assert_eq!(path, "/v1/check/batch");
        assert_eq!(forwarded.as_deref(), Some("peer-token"));
        let sent: Vec<_> = body["checks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["tenant"].clone(), c["cost"].clone()))
            .collect();
        assert_eq!(
            sent,
            [
                (json!("vip"), json!(1)),
                (json!("strict"), json!(2)),
                (json!("vip"), json!(3))
            ]
        );
    }

    #[tokio::test]
    async fn a_home_that_cannot_answer_leaves_each_check_to_its_policy() {
        let (d, seen) = decider_with_home(503).await;
        let home = RegionId::new("a").unwrap();
        let results = d
            .check_at_home(&home, checks(&[("vip", "w", 1), ("strict", "w", 1)]))
            .await;
        let v = results[0].as_ref().unwrap();
        assert_eq!(
            (v.mode, v.decided_by.as_str()),
            (Mode::HomeUnreachableFloor, "b")
        );
        assert!(v.decision.allowed);
        assert!(matches!(
            results[1],
            Err(CheckError::ReducedCapacity { .. })
        ));
        assert_eq!(seen.lock().unwrap().len(), 1);
        // A home with no known address is unreachable as well, with nothing sent.
        let nowhere = RegionId::new("c").unwrap();
        let results = d.check_at_home(&nowhere, checks(&[("vip", "w", 1)])).await;
        assert_eq!(
            results[0].as_ref().unwrap().mode,
            Mode::HomeUnreachableFloor
        );
        assert_eq!(seen.lock().unwrap().len(), 1);
    }

    /// A region whose share cannot hold a check sends it to the region granted the most; if
    /// that one does not answer, the check gets reduced capacity (a 503), not a denial that
    /// could never end, since no bucket here could admit it.
    #[tokio::test]
    async fn a_zero_share_region_cut_off_from_the_richest_answers_reduced_capacity() {
        // A port nothing listens on: the connection is refused at once.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = closed.local_addr().unwrap();
        drop(closed);
        let policy = json!({"limit": 10, "window_ms": 1000});
        let grants = [("a", 0, 0), ("b", 1_000_000, 0)];
        let homes = HashMap::from([(RegionId::new("b").unwrap(), vec![addr.to_string()])]);
        let d = decider_of(entry(policy, &grants, None), u64::MAX, homes);
        let (t, w) = ids("t", "w");
        let r = d.check(t, w, 1, false).await;
        assert!(
            matches!(r, Err(CheckError::ReducedCapacity { .. })),
            "{r:?}"
        );
    }
}
