//! Bad input against a real daemon: every malformed request gets a 4xx problem response, the
//! daemon keeps running, and nothing changes.

use quotad_system_tests::{embedded_config, Daemon, TOKEN};
use serde_json::json;

#[tokio::test]
async fn bad_requests_are_4xx_problems_and_change_nothing() -> anyhow::Result<()> {
    let mut d = Daemon::start(&embedded_config()).await?;
    let before = d
        .put_policy("acme", "writes", json!({"limit": 10, "window_ms": 60000}))
        .await?;

    let check_cases: Vec<(String, u16, &str)> = vec![
        ("{not json".into(), 400, "malformed JSON"),
        (
            r#"{"tenant":"acme","policy":"writes","cost":1,"x":1}"#.into(),
            400,
            "unknown field",
        ),
        (
            r#"{"tenant":"ac me","policy":"writes"}"#.into(),
            400,
            "invalid tenant id",
        ),
        (
            r#"{"tenant":"acme","policy":"w/rites"}"#.into(),
            400,
            "invalid policy name",
        ),
        (
            r#"{"tenant":"acme","policy":"writes","cost":0}"#.into(),
            400,
            "cost 0",
        ),
        (
            r#"{"tenant":"acme","policy":"writes","cost":-5}"#.into(),
            400,
            "negative cost",
        ),
        (
            r#"{"tenant":"acme","policy":"writes","cost":11}"#.into(),
            400,
            "cost above burst",
        ),
        (
            r#"{"tenant":"acme","policy":"writes","cost":1e308}"#.into(),
            400,
            "absurd cost",
        ),
        (
            format!(
                r#"{{"tenant":"{}","policy":"writes"}}"#,
                "a".repeat(1 << 20)
            ),
            413,
            "huge body",
        ),
        (
            r#"{"tenant":"acme","policy":"nope"}"#.into(),
            404,
            "unknown policy",
        ),
    ];
    for (body, status, what) in check_cases {
        let r = if status == 413 {
            d.post_once("/v1/check", body).await?
        } else {
            d.request("POST", "/v1/check", None, Some(body)).await?
        };
        assert_eq!(r.status, status, "{what}: {}", r.body);
        assert_eq!(
            r.headers.get("content-type").and_then(|v| v.to_str().ok()),
            Some("application/problem+json"),
            "{what}"
        );
        assert!(r.body["code"].is_string(), "{what}: {}", r.body);
    }

    // Far beyond the limit the daemon may close the connection before the client finished
    // sending; either way it answers no 2xx and keeps running.
    let giant = format!(
        r#"{{"tenant":"{}","policy":"writes"}}"#,
        "a".repeat(4 << 20)
    );
    if let Ok(r) = d.post_once("/v1/check", giant).await {
        assert_eq!(r.status, 413);
    }

    let spec = json!({"limit": 1, "window_ms": 1}).to_string();
    let path = "/v1/tenants/acme/policies/writes";
    for (token, what) in [(None, "missing token"), (Some("wrong"), "wrong token")] {
        for method in ["PUT", "DELETE"] {
            let r = d.request(method, path, token, Some(spec.clone())).await?;
            assert_eq!(r.status, 401, "{method} with {what}");
        }
        let r = d
            .request(
                "PUT",
                "/v1/tenants/acme/pin",
                token,
                Some(r#"{"region":"solo"}"#.into()),
            )
            .await?;
        assert_eq!(r.status, 401, "pin with {what}");
    }
    let bad_policy = json!({"limit": 0, "window_ms": -1, "burst": 0.5, "bogus": true}).to_string();
    let r = d
        .request("PUT", path, Some(TOKEN), Some(bad_policy))
        .await?;
    assert_eq!(r.status, 400);
    let bad_policy = json!({"limit": 0, "window_ms": -1, "burst": 0.5}).to_string();
    let r = d
        .request("PUT", path, Some(TOKEN), Some(bad_policy))
        .await?;
    assert_eq!(r.status, 400);
    assert_eq!(
        r.body["errors"].as_array().map(Vec::len),
        Some(3),
        "{}",
        r.body
    );

    assert!(d.is_running(), "the daemon must survive bad input");
    let after = d.get(path).await?;
    assert_eq!(after.body, before, "no state changed");
    // No token was spent by any rejected request: the whole burst is still there.
    let r = d.check("acme", "writes", 10).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    // Checks are answered past the router (api::routes): the length still goes on the wire.
    // Re-serialising the body reorders its keys but keeps its length.
    let length = r
        .headers
        .get("content-length")
        .and_then(|v| v.to_str().ok());
    assert_eq!(
        length,
        Some(r.body.to_string().len().to_string()).as_deref()
    );
    let text = d.log_text();
    assert!(!text.contains("acme"), "tenant ids never appear in logs");
    Ok(())
}
