//! quotad against a Redis that requires authentication: the `default` user's password
//! (`requirepass`) or an ACL user limited to quotad's keys and the commands it runs. Passwords
//! come from the environment or a file only and may hold any character. Credentials Redis
//! refuses stop start-up with a message that names what to check, and never the password.

use std::time::Duration;

use quotad_system_tests::{
    client_with_password, eventually, free_port, params_present, redis_config, Daemon, QUOTAD_ACL,
};
use redis_harness::RedisServer;
use serde_json::json;

/// Characters a password spliced into a URL would need encoded.
const DEFAULT_PASSWORD: &str = "d3f@ult/pass:w#rd%?&= x";
const QUOTAD_PASSWORD: &str = "qu0tad@acl/pass:w#rd%";

fn secured_redis() -> anyhow::Result<RedisServer> {
    let pass = format!(">{QUOTAD_PASSWORD}");
    let mut args = vec!["--requirepass", DEFAULT_PASSWORD, "--user", "quotad", &pass];
    args.extend_from_slice(QUOTAD_ACL);
    Ok(RedisServer::start_with(&args)?)
}

/// The single-region test config with a `username` under `[redis]`.
fn with_username(redis: &RedisServer, username: &str) -> String {
    redis_config(&redis.url()).replace(
        "[redis]\n",
        &format!("[redis]\nusername = \"{username}\"\n"),
    )
}

/// Normal decisions through Redis; the policy's version.
async fn decides_through_redis(d: &Daemon, tenant: &str) -> anyhow::Result<u64> {
    let stored = d
        .put_policy(tenant, "writes", json!({"limit": 3, "window_ms": 60000}))
        .await?;
    for expected in [200, 200, 200, 429] {
        let r = d.check(tenant, "writes", 1).await?;
        assert_eq!(
            (r.status, r.body["mode"].as_str()),
            (expected, Some("normal")),
            "{}",
            r.body
        );
    }
    let status = d.get("/v1/status").await?;
    assert_eq!(status.body["store"]["state"], "ok", "{}", status.body);
    Ok(stored["version"].as_u64().expect("a version"))
}

/// A client of `redis` as the `default` user, to read back what quotad wrote.
fn admin_client(redis: &RedisServer) -> redis::Client {
    client_with_password(&redis.url(), DEFAULT_PASSWORD)
}

#[tokio::test]
async fn the_default_user_and_an_acl_user_authenticate_from_env_and_file() -> anyhow::Result<()> {
    let redis = secured_redis()?;

    let d = Daemon::start_with_env(
        &redis_config(&redis.url()),
        &[("QUOTAD_REDIS_PASSWORD", DEFAULT_PASSWORD)],
    )
    .await?;
    decides_through_redis(&d, "acme").await?;
    drop(d);

    // The ACL user, its password from a file.
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("redis-password");
    std::fs::write(&file, format!("{QUOTAD_PASSWORD}\n"))?;
    // At debug level the log shows every store call the agent could not make.
    let config = with_username(&redis, "quotad")
        .replace(
            "[redis]\n",
            &format!(
                "[redis]\npassword_file = {:?}\n",
                file.display().to_string()
            ),
        )
        .replace("log_level = \"info\"", "log_level = \"debug\"");
    let d = Daemon::start(&config).await?;
    let version = decides_through_redis(&d, "globex").await?;
    assert!(
        eventually(
            Duration::from_secs(5),
            Duration::from_millis(50),
            || async {
                params_present(&admin_client(&redis), "globex", "writes", version)
                    .await
                    .then_some(())
            }
        )
        .await
        .is_some(),
        "the ACL user's agent writes this region's parameters"
    );
    // Five report intervals: usage collection, lease renewal and parameter writes all ran.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let log = d.log_text();
    for failure in ["failed", "NOPERM", "refused", "not delivered"] {
        assert!(!log.contains(failure), "{failure}: {log}");
    }
    assert!(!log.contains(QUOTAD_PASSWORD) && !log.contains(DEFAULT_PASSWORD));
    Ok(())
}

/// Extra environment for a daemon.
type Env = Vec<(&'static str, &'static str)>;

#[tokio::test]
async fn refused_credentials_stop_start_up_by_name_without_the_password() -> anyhow::Result<()> {
    let redis = secured_redis()?;
    let cases: [(&str, String, Env); 3] = [
        ("no password", redis_config(&redis.url()), vec![]),
        (
            "a wrong password",
            redis_config(&redis.url()),
            vec![("QUOTAD_REDIS_PASSWORD", "wrong-password")],
        ),
        (
            "another user's password",
            with_username(&redis, "quotad"),
            vec![("QUOTAD_REDIS_PASSWORD", DEFAULT_PASSWORD)],
        ),
    ];
    for (what, config, env) in cases {
        let port = free_port()?;
        let config = config.replace("{api}", &format!("127.0.0.1:{port}"));
        let mut d = Daemon::spawn(&config, port, &env)?;
        let err = d
            .wait_ready(Duration::from_secs(20))
            .await
            .expect_err("quotad must not start on credentials Redis refuses");
        assert!(err.to_string().contains("exited"), "{what}: {err}");
        let log = d.log_text();
        assert!(log.contains("refused quotad"), "{what}: {log}");
        assert!(log.contains("redis.username"), "{what}: {log}");
        for (_, secret) in &env {
            assert!(!log.contains(secret), "{what}: the password is in the log");
        }
    }
    Ok(())
}
