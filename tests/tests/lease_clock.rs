//! A region counts its lease on its monotonic clock (issue #36): a wall clock stepped back on
//! its host does not lengthen it. Region c's daemon runs under libfaketime with its monotonic
//! clock left real (`FAKETIME_DONT_FAKE_MONOTONIC=1`) and its wall-clock offset read from a file
//! this test rewrites while it runs; c is cut off from the others (no more renewals) and its
//! wall clock stepped back ten minutes, far more than a lease. Its lease still ends, and its
//! floor takes over, when they would have without the step: `lease_ms − drift_margin_ms`
//! after the last renewal it sent, before the cut.

use std::time::{Duration, Instant};

use quotad_system_tests::{eventually, Cluster, Timings};
use serde_json::json;

/// libfaketime's preload library for multi-threaded programs (Debian package `libfaketime`,
/// installed by scripts/install-test-deps.sh): `$QUOTAD_LIBFAKETIME`, else Debian's path for
/// any architecture (`/usr/lib/<multiarch>/faketime/`).
fn libfaketime() -> anyhow::Result<String> {
    if let Ok(path) = std::env::var("QUOTAD_LIBFAKETIME") {
        return Ok(path);
    }
    std::fs::read_dir("/usr/lib")?
        .filter_map(Result::ok)
        .map(|d| d.path().join("faketime/libfaketimeMT.so.1"))
        .find(|p| p.exists())
        .map(|p| p.to_string_lossy().into_owned())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "libfaketimeMT.so.1 not found under /usr/lib/*/faketime: run \
                 scripts/install-test-deps.sh (Debian package libfaketime) or set \
                 QUOTAD_LIBFAKETIME"
            )
        })
}

/// How far c's wall clock is stepped back: ten minutes, 200 leases.
const STEP_BACK_S: u64 = 600;

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wall_clock_stepped_back_does_not_lengthen_the_lease() -> anyhow::Result<()> {
    let preload = libfaketime()?;
    let dir = tempfile::tempdir()?;
    let offset = dir.path().join("faketime-offset");
    std::fs::write(&offset, "+0\n")?;
    let offset_path = offset.to_string_lossy().to_string();
    let faked: &[(&str, &str)] = &[
        ("LD_PRELOAD", &preload),
        ("FAKETIME_TIMESTAMP_FILE", &offset_path),
        // The offset file is read again at most a second after it changes.
        ("FAKETIME_CACHE_DURATION", "1"),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
    ];
    let t = Timings::default();
    let usable_ms = t.lease_ms - t.drift_margin_ms;
    let cluster = Cluster::start_with_env(&["a", "b", "c"], &t, &[("c", faked)]).await?;
    cluster
        .daemon("a")
        .put_policy(
            "acme",
            "writes",
            json!({"limit": 50, "window_ms": 1000, "floor": 0.1}),
        )
        .await?;
    let settled = cluster.leased_share("c", "acme", 0.2).await;
    assert!(settled.is_some(), "c enforces its share under a lease");

    // Cut off, c renews nothing more: the last renewal it sent went out before this instant,
    // so its lease ends at most `lease − margin` from here.
    let cut = Instant::now();
    cluster.isolate("c");
    std::fs::write(&offset, format!("-{STEP_BACK_S}\n"))?;
    let c = cluster.daemon("c");
    let status = || async {
        let s = c.get("/v1/status").await.ok()?;
        let lease = &s.body["lease"];
        Some((
            lease["ends_at_ms"].as_u64()?,
            lease["remaining_ms"].as_u64()?,
        ))
    };

    // The step is in force once c shows its lease end on a wall clock minutes behind this
    // one (or once its lease has grown by the step).
    let after_step = eventually(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async {
            let (ends_at, remaining) = status().await?;
            (ends_at + STEP_BACK_S * 1000 / 2 < wall_ms() || remaining > t.lease_ms)
                .then_some(remaining)
        },
    )
    .await
    .expect("c's wall clock stepped back");
    assert!(
        after_step <= usable_ms,
        "{after_step} ms of lease left after the step: more than the {usable_ms} ms a lease gives"
    );

    // The floor takes over when it would have without the step.
    let floor_after = eventually(
        Duration::from_millis(usable_ms + 5_000),
        Duration::from_millis(50),
        || async {
            let (_, remaining) = status().await?;
            let (_, enforced) = cluster.share("c", "acme").await?;
            (remaining == 0 && (enforced - 0.1).abs() < 1e-6).then(|| cut.elapsed())
        },
    )
    .await;
    let Some(floor_after) = floor_after else {
        panic!(
            "c still enforces its share {} ms after the cut: status {:?}, allowance {:?}",
            cut.elapsed().as_millis(),
            c.get("/v1/status").await.map(|r| r.body),
            c.get("/v1/tenants/acme/allowance").await.map(|r| r.body),
        );
    };
    // Polling on 2 busy cores: up to a second and a half late.
    assert!(
        floor_after <= Duration::from_millis(usable_ms + 1_500),
        "c fell to its floor {floor_after:?} after the cut; its lease gives {usable_ms} ms"
    );
    Ok(())
}
