//! Envoy's rate limit service on a real daemon: descriptors are decided through the regional
//! Redis in the same buckets as `POST /v1/check`, and a daemon with an Envoy connection open
//! still stops promptly on SIGTERM.

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use quotad_system_tests::{free_port, redis_config_with_envoy, Daemon};
use redis_harness::RedisServer;
use serde_json::json;

fn request(tenant: &str, policy: &str) -> RateLimitRequest {
    let entry = |k: &str, v: &str| Entry {
        key: k.into(),
        value: v.into(),
    };
    RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![entry("tenant", tenant), entry("policy", policy)],
            ..RateLimitDescriptor::default()
        }],
        hits_addend: 0,
    }
}

#[tokio::test]
async fn envoy_descriptors_share_buckets_with_http_checks_and_sigterm_still_stops_the_daemon(
) -> anyhow::Result<()> {
    let redis = RedisServer::start()?;
    let envoy_port = free_port()?;
    let config = redis_config_with_envoy(&redis.url(), envoy_port);
    let mut d = Daemon::start(&config).await?;
    d.put_policy("acme", "writes", json!({"limit": 4, "window_ms": 60000}))
        .await?;
    let mut client =
        RateLimitServiceClient::connect(format!("http://127.0.0.1:{envoy_port}")).await?;

    // Two through Envoy's service, one over HTTP, then Envoy's again: one bucket of four.
    let mut codes = Vec::new();
    for _ in 0..2 {
        let r = client
            .should_rate_limit(request("acme", "writes"))
            .await?
            .into_inner();
        codes.push((r.overall_code, r.statuses[0].limit_remaining));
    }
    let http = d.check("acme", "writes", 1).await?;
    assert_eq!(
        (http.status, http.body["remaining"].as_u64()),
        (200, Some(1)),
        "{}",
        http.body
    );
    assert_eq!(http.body["mode"], "normal", "decided through Redis");
    for _ in 0..2 {
        let r = client
            .should_rate_limit(request("acme", "writes"))
            .await?
            .into_inner();
        codes.push((r.overall_code, r.statuses[0].limit_remaining));
    }
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    assert_eq!(codes, [(ok, 3), (ok, 2), (ok, 0), (over, 0)]);

    // The client's HTTP/2 connection stays open; shutdown does not wait on it.
    let stopping = Instant::now();
    let status = d.terminate(Duration::from_secs(15)).await?;
    assert!(status.success(), "{status:?}: {}", d.log_text());
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "stopped in {:?}",
        stopping.elapsed()
    );
    assert!(d
        .log_text()
        .contains("Envoy rate limit services (RLS v3, RLQS) serving"));
    Ok(())
}
