//! This region's lease end on the store's clock: every parameter write carries it as the latest
//! end the store may keep (`SetParams::not_after`), so what Redis holds never outlasts the
//! region's lease, however large the pass or late the write.

use quota_store::{AnyStore, Store as _, StoreError};

use crate::clock;

/// This region's lease end `lease_end_ms` (local monotonic ms) on the store's clock, rounded
/// down. The store's reading R was taken somewhere before the local reading that follows it, so
/// R is at most what the store's clock showed then, and the store's clock at the lease end is
/// at least `R + (lease_end − that reading)`. The round trip only moves the result earlier;
/// clock rates drifting apart over the lease are left to the drift margin.
pub(super) async fn lease_end_on_store(
    store: &AnyStore,
    lease_end_ms: u64,
) -> Result<u64, StoreError> {
    let on_store = store.clock_ms().await?;
    // Rounded up: the reading was taken before this.
    let after = clock::monotonic_ms().saturating_add(1);
    Ok(on_store.saturating_add(lease_end_ms.saturating_sub(after)))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::process::Command;
    use std::time::Duration;

    use quota_core::share::limit_for_share;
    use quota_core::{PolicyName, PolicySpec, RegionId, TenantId};
    use quota_store::{BucketRef, Limit, RedisStore, RedisStoreConfig, SetParams};
    use redis_harness::RedisServer;

    use super::*;
    use crate::agent::{apply_shares, Pacing, Written};
    use crate::api::tests::state_on;
    use crate::config::BreakerConfig;
    use crate::coordination::view::{Grant, PolicyEntry};
    use crate::coordination::ClusterView;
    use crate::decision::breaker::Breaker;

    /// Buckets of the full rewrite: 100 000 take about 20 s in a debug build on 2 busy cores.
    const BUCKETS: usize = 100_000;
    const LEASE_MS: u64 = 30_000;

    async fn redis_store(server: &RedisServer) -> AnyStore {
        let cfg = RedisStoreConfig::standalone(server.url()).with_timeout(Duration::from_secs(30));
        AnyStore::Redis(RedisStore::connect(cfg).await.unwrap())
    }

    /// Redis `TIME` in ms, rounded down.
    async fn redis_ms(c: &mut redis::aio::MultiplexedConnection) -> u64 {
        let (s, us): (u64, u64) = redis::cmd("TIME").query_async(c).await.unwrap();
        s * 1000 + us / 1000
    }

    /// At least what Redis's clock shows when the local monotonic clock reaches `end_ms`: its
    /// reading R was taken after the local reading before it (rates drift too little to count
    /// over a test).
    async fn latest_redis_ms_at(c: &mut redis::aio::MultiplexedConnection, end_ms: u64) -> u64 {
        let before = clock::monotonic_ms();
        let r = redis_ms(c).await;
        // + 1: both readings are rounded down.
        r + 1 + end_ms.saturating_sub(before)
    }

    /// Every stored lease end (`until` of each parameters hash).
    async fn stored_ends(c: &mut redis::aio::MultiplexedConnection) -> Vec<u64> {
        let mut keys: Vec<String> = Vec::new();
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg("qd:v1:*:p")
                .arg("COUNT")
                .arg(10_000)
                .query_async(c)
                .await
                .unwrap();
            keys.extend(batch);
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        let mut ends = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(1000) {
            let mut pipe = redis::pipe();
            for k in chunk {
                pipe.hget(k, "until");
            }
            let got: Vec<Option<u64>> = pipe.query_async(c).await.unwrap();
            ends.extend(got.into_iter().map(|e| e.expect("a lease end")));
        }
        ends
    }

    fn entry(share_ppm: u32, floor_ppm: u32) -> PolicyEntry {
        let mut policy = PolicySpec {
            limit: 100.0,
            window_ms: 1000.0,
            ..PolicySpec::default()
        }
        .validate()
        .unwrap();
        policy.version = 1;
        PolicyEntry {
            policy,
            grants: BTreeMap::from([(
                RegionId::new("eu").unwrap(),
                Grant {
                    share_ppm,
                    floor_ppm,
                },
            )]),
            home: None,
            mode: quota_core::mode::BudgetMode::Split,
        }
    }

    /// Issue 36: the agent planned a pass at one instant and each write stored Redis `TIME`
    /// plus the lease left at that instant, so a long pass stored ends later than the region's
    /// lease by the time from planning to each write (seconds on a full rewrite). Every write
    /// now also carries the lease end on Redis's clock, and Redis keeps the earlier.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_rewrite_stores_no_lease_end_past_the_regions() {
        let server = RedisServer::start().unwrap();
        let state = state_on(
            redis_store(&server).await,
            Breaker::new(&BreakerConfig::default(), "eu"),
        );
        let mut conn = server
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let lease_end = clock::monotonic_ms() + LEASE_MS;
        let view = ClusterView {
            policies: (0..BUCKETS)
                .map(|i| {
                    let key = (
                        TenantId::new(format!("t{i}")).unwrap(),
                        PolicyName::new("writes").unwrap(),
                    );
                    (key, entry(500_000, 100_000))
                })
                .collect(),
            epoch: 1,
            lease_end_local_ms: lease_end,
            ..ClusterView::default()
        };
        let mut written = Written::new(clock::monotonic_ms(), LEASE_MS);
        let pacing = Pacing {
            report_interval_ms: 1_000,
            lease_ms: LEASE_MS,
        };
        let started = clock::monotonic();
        let (all, outcomes) = apply_shares(&state.decider, &view, &mut written, pacing, None).await;
        let took = started.elapsed();
        assert!(all, "every write succeeded: {outcomes:?}");
        assert_eq!(outcomes.ok, BUCKETS as u64);
        let latest = latest_redis_ms_at(&mut conn, lease_end).await;
        let ends = stored_ends(&mut conn).await;
        assert_eq!(ends.len(), BUCKETS);
        let (first, last) = (*ends.iter().min().unwrap(), *ends.iter().max().unwrap());
        eprintln!(
            "{BUCKETS} buckets written in {took:?}; stored ends from {} to {} ms before the \
             region's lease end on Redis's clock",
            latest as i64 - first as i64,
            latest as i64 - last as i64,
        );
        assert!(
            last <= latest,
            "a stored end {} ms past the region's lease end",
            last - latest
        );
    }

    fn signal(pid: u32, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {pid}");
    }

    /// A write sent with 1 s of lease left that Redis runs only 2 s later (stopped with
    /// SIGSTOP meanwhile, as a stalled or failing-over Redis would): `TIME` + the time sent
    /// would end 2 s past the region's lease; the stored end is the lease end on Redis's clock.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_that_runs_late_ends_no_later_than_the_lease() {
        let server = RedisServer::start().unwrap();
        let store = redis_store(&server).await;
        let mut conn = server
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let remaining_ms = 1_000;
        let lease_end = clock::monotonic_ms() + remaining_ms;
        let not_after = lease_end_on_store(&store, lease_end).await.unwrap();
        let bucket = BucketRef {
            tenant: TenantId::new("late").unwrap(),
            policy: PolicyName::new("writes").unwrap(),
            version: 1,
        };
        let policy = entry(500_000, 100_000).policy;
        let limit: Limit = limit_for_share(&policy, 500_000).into();
        let floor: Limit = limit_for_share(&policy, 100_000).into();
        let req = SetParams::new(bucket.clone(), limit)
            .with_lease(remaining_ms, floor)
            .not_after(not_after);

        signal(server.pid(), "-STOP");
        let write = tokio::spawn({
            let store = store.clone();
            async move { store.set_params(&req).await }
        });
        // The scenario, not a wait for a condition: Redis stays stopped for twice the lease
        // left, so the write runs after the lease has ended.
        tokio::time::sleep(Duration::from_millis(2 * remaining_ms)).await;
        signal(server.pid(), "-CONT");
        write.await.unwrap().unwrap();

        let ran_at = redis_ms(&mut conn).await;
        let stored: u64 = redis::cmd("HGET")
            .arg(bucket.params_key())
            .arg("until")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(
            ran_at >= not_after + remaining_ms,
            "the write ran late: at {ran_at}, the lease ended at {not_after}"
        );
        assert_eq!(
            stored,
            not_after,
            "stored {} ms past the lease end on Redis's clock",
            stored as i64 - not_after as i64
        );
    }
}
