//! quotad against a Redis that requires authentication: the `default` user's password
//! (`requirepass`) or an ACL user limited to quotad's keys and the commands it runs. Passwords
//! come from the environment or a file only and may hold any character. Credentials Redis
//! refuses stop start-up with a message that names what to check, and never the password.

use std::time::Duration;

use quotad_system_tests::{
    client_with_password, decides_through_redis, eventually, free_port, metric_value,
    params_present, redis_config, Daemon, QUOTAD_ACL,
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

/// One check of `globex` admitted through Redis (not by a fail mode).
async fn normal(d: &Daemon) -> Option<()> {
    let r = d.check("globex", "writes", 1).await.ok()?;
    (r.status == 200 && r.body["mode"] == "normal").then_some(())
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

#[tokio::test]
async fn a_new_password_in_the_file_is_taken_once_redis_accepts_it_without_a_restart(
) -> anyhow::Result<()> {
    const ROTATED: &str = "r0tated/pass#word";
    let redis = secured_redis()?;
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("redis-password");
    std::fs::write(&file, format!("{QUOTAD_PASSWORD}\n"))?;
    let config = with_username(&redis, "quotad").replace(
        "[redis]\n",
        &format!(
            "[redis]\npassword_file = {:?}\npassword_check_ms = 100\n",
            file.display().to_string()
        ),
    );
    let d = Daemon::start(&config).await?;
    decides_through_redis(&d, "acme").await?;
    d.put_policy(
        "globex",
        "writes",
        json!({"limit": 1000, "window_ms": 60000}),
    )
    .await?;

    // The file changes before Redis does: the new password is refused, noted once, and
    // decisions go on over the current connection.
    std::fs::write(&file, format!("{ROTATED}\n"))?;
    let noted = eventually(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async {
            d.log_text()
                .contains("does not take the new password")
                .then_some(())
        },
    )
    .await;
    assert!(noted.is_some(), "{}", d.log_text());
    assert!(normal(&d).await.is_some(), "still deciding through Redis");

    // Redis learns the new password beside the old one: quotad switches to it.
    let admin = admin_client(&redis);
    let mut conn = admin.get_multiplexed_async_connection().await?;
    redis::cmd("ACL")
        .arg(&["SETUSER", "quotad", &format!(">{ROTATED}")])
        .query_async::<()>(&mut conn)
        .await?;
    let switched = eventually(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async {
            d.log_text()
                .contains("Switched to the new Redis password")
                .then_some(())
        },
    )
    .await;
    assert!(switched.is_some(), "{}", d.log_text());

    // The old password goes and every connection of the user is dropped: quotad reconnects
    // with the new one and never leaves normal decisions.
    redis::cmd("ACL")
        .arg(&["SETUSER", "quotad", &format!("<{QUOTAD_PASSWORD}")])
        .query_async::<()>(&mut conn)
        .await?;
    redis::cmd("CLIENT")
        .arg(&["KILL", "USER", "quotad"])
        .query_async::<i64>(&mut conn)
        .await?;
    for _ in 0..20 {
        assert!(normal(&d).await.is_some(), "{}", d.log_text());
    }
    let status = d.get("/v1/status").await?;
    assert_eq!(status.body["store"]["state"], "ok", "{}", status.body);

    let (_, metrics) = d.get_text("/metrics").await?;
    for (outcome, n) in [("refused", 1.0), ("taken", 1.0)] {
        assert_eq!(
            metric_value(
                &metrics,
                "quotad_redis_password_reloads_total",
                &[("outcome", outcome)]
            ),
            Some(n),
            "{outcome}"
        );
    }
    let log = d.log_text();
    assert_eq!(log.matches("does not take the new password").count(), 1);
    assert!(!log.contains(ROTATED) && !log.contains(QUOTAD_PASSWORD));
    Ok(())
}
