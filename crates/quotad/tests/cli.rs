//! The binary's command line, run as a process. (Having an integration test also makes
//! `cargo test`/`cargo nextest run` build `target/<profile>/quotad`, which the system tests in
//! the `quotad-system-tests` package start.)

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_quotad");

#[test]
fn version_prints_the_package_version() {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("quotad {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn check_config_accepts_the_example_and_rejects_nonsense() {
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../config/single-region.toml"
    );
    let out = Command::new(BIN)
        .args(["check-config", example])
        .env_remove("QUOTAD_ADMIN_TOKEN")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("listen = \"127.0.0.1:7450\""));
    let out = Command::new(BIN)
        .args(["check-config", "/nonexistent/quotad.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
}

#[test]
fn check_config_of_a_cluster_region_names_the_peer_token_it_needs() {
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../config/three-regions-a.toml"
    );
    let out = Command::new(BIN)
        .args(["check-config", example])
        .env_remove("QUOTAD_PEER_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("QUOTAD_PEER_TOKEN") && stderr.contains("the same on every region"),
        "{stderr}"
    );
    let out = Command::new(BIN)
        .args(["check-config", example])
        .env("QUOTAD_PEER_TOKEN", "peer-secret")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("peer-secret"));
}
