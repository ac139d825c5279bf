//! Where the crates Cargo resolved for this workspace live: the outside clients (Python) build
//! their stubs from the `.proto` files that ship in the envoy-types and tonic-health crates.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde_json::Value;
use tokio::process::Command;

/// The source directory of `package` as Cargo resolved it for this workspace.
pub fn crate_dir(metadata: &Value, package: &str) -> anyhow::Result<PathBuf> {
    let manifest = metadata["packages"]
        .as_array()
        .context("cargo metadata has no packages")?
        .iter()
        .find(|p| p["name"] == package)
        .and_then(|p| p["manifest_path"].as_str())
        .with_context(|| format!("{package} is not in the dependency graph"))?;
    Ok(Path::new(manifest)
        .parent()
        .context("a manifest path without a parent")?
        .to_path_buf())
}

/// The crates this workspace builds for this host, offline (packages of other platforms are
/// never downloaded here, so they are filtered out).
pub async fn cargo_metadata(workspace: &Path) -> anyhow::Result<Value> {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc)
        .arg("-vV")
        .output()
        .await
        .context("running rustc -vV")?;
    let version = String::from_utf8(version.stdout)?;
    let host = version
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .context("rustc -vV names no host")?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--offline", "--locked"])
        .args(["--filter-platform", host])
        .current_dir(workspace)
        .output()
        .await
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!("cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}
