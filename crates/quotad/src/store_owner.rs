//! Who writes a region's Redis: the daemons of one region (their writes fenced by the agent
//! role), or one daemon of a single region (unfenced). A mark in Redis says which; a daemon
//! that would write beside another writer refuses to start, since an unfenced writer and a
//! region's agent, two single daemons, or two regions on one Redis would overwrite each
//! other's parameters and sweep each other's keys.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use quota_core::RegionId;
use quota_store::AnyStore;

/// How long a mark outlives its last renewal: a replacement daemon waits at most this long
/// after the writer it replaces is gone.
pub fn mark_ttl(report_interval: Duration) -> Duration {
    (report_interval * 10).max(Duration::from_secs(5))
}

/// This daemon's mark: `fenced <region>` for any daemon of a region set (`[[regions]]`),
/// `single <region> <id>` for a single-region daemon, `id` being its data directory's.
pub fn mark(region: &RegionId, fenced: bool, data_dir: &Path) -> anyhow::Result<String> {
    if fenced {
        return Ok(format!("fenced {region}"));
    }
    Ok(format!("single {region} {}", daemon_id(data_dir)?))
}

/// A random id kept in the data directory: the same daemon across restarts.
fn daemon_id(data_dir: &Path) -> anyhow::Result<String> {
    let path = data_dir.join("daemon-id");
    if let Ok(id) = std::fs::read_to_string(&path) {
        let id = id.trim();
        if id.len() == 16 && id.chars().all(|c| c.is_ascii_hexdigit()) {
            return Ok(id.to_string());
        }
    }
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating {}", data_dir.display()))?;
    let id = format!("{:016x}", rand::random::<u64>());
    std::fs::write(&path, &id).with_context(|| format!("writing {}", path.display()))?;
    Ok(id)
}

/// Why `mine` may not write where `theirs` does, in words an operator can act on.
pub fn conflict(mine: &str, theirs: &str) -> Option<String> {
    if mine == theirs {
        return None;
    }
    let words = |m: &str| m.split(' ').map(str::to_string).collect::<Vec<_>>();
    let (me, them) = (words(mine), words(theirs));
    let region = them.get(1).cloned().unwrap_or_default();
    Some(match (me[0].as_str(), them.first().map(String::as_str)) {
        ("fenced", Some("fenced")) => format!(
            "this Redis holds region {region:?}'s parameters, and this daemon serves region {:?}: check redis.url",
            me[1]
        ),
        ("fenced", _) => format!(
            "this Redis is written by a single-region quotad of region {region:?} without a fence; stop it before a region's daemons write here"
        ),
        (_, Some("fenced")) => format!(
            "this Redis is written by region {region:?}'s daemons, whose writes are fenced; a daemon without [[regions]] cannot write beside them (list it in [[regions]] to join them)"
        ),
        _ => format!(
            "this Redis is written by another single-region quotad of region {region:?} (a daemon without [[regions]]); several daemons on one Redis must be listed in [[regions]] as a region's set (docs/deployment.md)"
        ),
    })
}

/// At start: claims the store for `mine`. Another writer's mark is waited out for `ttl` (a
/// writer killed and replaced leaves one behind); still held then, it is renewed by a live
/// writer, and this daemon refuses to start, saying why.
pub async fn claim_at_start(store: &AnyStore, mine: &str, ttl: Duration) -> anyhow::Result<()> {
    let until = tokio::time::Instant::now() + ttl + Duration::from_millis(500);
    let mut told = false;
    loop {
        let held = store
            .claim_owner(mine, ttl.as_millis() as u64)
            .await
            .context("reading who writes this Redis")?;
        let Some(why) = conflict(mine, &held) else {
            return Ok(());
        };
        if tokio::time::Instant::now() >= until {
            anyhow::bail!("{why} (its mark was renewed for {} s)", ttl.as_secs());
        }
        if !told {
            tracing::warn!(%why, wait_s = ttl.as_secs(), "Another writer's mark is on this Redis: waiting to see whether it is renewed.");
            told = true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// On a clean stop: a single-region daemon's mark goes, so a daemon replacing it starts at
/// once (a region's daemons share theirs, which stays).
pub async fn release(store: &AnyStore, mine: &str) {
    if mine.starts_with("single ") {
        if let Err(e) = store.release_owner(mine).await {
            tracing::debug!(error = %e, "Removing this daemon's mark on Redis failed.");
        }
    }
}

/// While writing: renews the mark; a conflict found now (the mark expired while this daemon
/// could not renew it and another writer took it) is logged, once per renewal.
pub async fn renew(store: &AnyStore, mine: &str, ttl: Duration) {
    match store.claim_owner(mine, ttl.as_millis() as u64).await {
        Ok(held) => {
            if let Some(why) = conflict(mine, &held) {
                tracing::error!(%why, "Another writer holds this Redis.");
            }
        }
        Err(e) => tracing::debug!(error = %e, "Renewing this daemon's mark on Redis failed."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pair_of_writers_that_would_collide_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let a = RegionId::new("a").unwrap();
        let single = mark(&a, false, dir.path()).unwrap();
        assert_eq!(
            single,
            mark(&a, false, dir.path()).unwrap(),
            "kept across restarts"
        );
        let other_dir = tempfile::tempdir().unwrap();
        let other_single = mark(&a, false, other_dir.path()).unwrap();
        let fenced_a = mark(&a, true, dir.path()).unwrap();
        let fenced_b = mark(&RegionId::new("b").unwrap(), true, dir.path()).unwrap();
        assert_eq!(conflict(&single, &single), None);
        assert_eq!(
            conflict(&fenced_a, &fenced_a),
            None,
            "a region's daemons share it"
        );
        for (mine, theirs, says) in [
            (&single, &other_single, "another single-region quotad"),
            (&single, &fenced_a, "fenced"),
            (&fenced_a, &single, "without a fence"),
            (&fenced_a, &fenced_b, "region \"b\"'s parameters"),
        ] {
            let why = conflict(mine, theirs).expect("a conflict");
            assert!(why.contains(says), "{mine} vs {theirs}: {why}");
        }
    }
}
