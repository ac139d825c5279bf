//! Rebalance-round benchmark: one `allocator::plan` over 100 000 and 1 000 000 policies × 5
//! regions, how many share changes (log entries' worth) a round emits under steady and shifting
//! demand, how long `apply` takes for them, and the snapshot size per policy.
//!
//! Run: `cargo bench -p quota-core --bench allocator` (release). Sizes: `QUOTA_BENCH_SIZES`,
//! comma-separated (default `100000,1000000`). Every random choice comes from one seed.

use std::time::{Duration, Instant};

use quota_core::allocator::{plan, AllocatorConfig};
use quota_core::coordinator::{Command, CoordinatorState, Operation, PolicyKey, RequestId};
use quota_core::demand::DemandTracker;
use quota_core::policy::{Algorithm, FailMode, Policy, Tier};
use quota_core::{PolicyName, RegionId, TenantId, PPM};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const REGIONS: usize = 5;
const SEED: u64 = 0x5eed_a110c;
/// 1000 tokens/s: 10^9 µt/s.
const RATE_UT_PER_S: u64 = 1_000_000_000;

/// The one place this benchmark reads a clock (quota-core itself never does).
#[allow(clippy::disallowed_methods)]
fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed())
}

struct Bench {
    state: CoordinatorState,
    demand: DemandTracker,
    keys: Vec<PolicyKey>,
    config: AllocatorConfig,
    now_ms: u64,
    next_id: u128,
}

impl Bench {
    fn new(tenants: usize) -> Self {
        let mut b = Bench {
            state: CoordinatorState::default(),
            demand: DemandTracker::new(300_000),
            keys: Vec::with_capacity(tenants),
            config: AllocatorConfig::default(),
            now_ms: 1_000,
            next_id: 0,
        };
        for r in 0..REGIONS {
            let region = RegionId::new(format!("region-{r}")).unwrap();
            b.apply(Operation::PutRegion {
                region,
                reserves_floor: true,
                draining: false,
            });
        }
        let writes = PolicyName::new("writes").unwrap();
        for i in 0..tenants {
            let key = PolicyKey::new(
                TenantId::new(format!("tenant-{i:07}")).unwrap(),
                writes.clone(),
            );
            let policy = Policy {
                limit: 60_000,
                window_ms: 60_000,
                burst: 60_000,
                version: 0,
                tier: if i % 100 == 0 {
                    Tier::Critical
                } else {
                    Tier::Standard
                },
                fail_mode: FailMode::Local,
                floor_ppm: 20_000,
                algorithm: Algorithm::TokenBucket,
                mode: quota_core::PolicyMode::Enforcing,
                replaces: None,
                debt_limit: 0,
                after_the_fact: false,
            };
            b.apply(Operation::PutPolicy {
                key: key.clone(),
                policy,
            });
            b.keys.push(key);
        }
        b.renew_all();
        b
    }

    fn apply(&mut self, op: Operation) {
        self.next_id += 1;
        let cmd = Command {
            request: RequestId(self.next_id),
            now_ms: self.now_ms,
            op,
        };
        self.state.apply(&cmd);
    }

    fn renew_all(&mut self) {
        let epoch = self.state.epoch;
        for r in 0..REGIONS {
            let region = RegionId::new(format!("region-{r}")).unwrap();
            self.apply(Operation::RenewLease {
                region,
                acked_epoch: epoch,
            });
        }
    }

    /// Skewed demand: each tenant has a main region carrying most of its traffic.
    fn set_demand(&mut self, rng: &mut ChaCha8Rng, which: impl Fn(usize) -> bool, shift: usize) {
        for (i, key) in self.keys.iter().enumerate() {
            if !which(i) {
                continue;
            }
            let main = (i + shift) % REGIONS;
            let total = rng.random_range(RATE_UT_PER_S / 10..RATE_UT_PER_S * 2);
            let rates = (0..REGIONS)
                .map(|r| {
                    if r == main {
                        total * 6 / 10
                    } else {
                        total / 10
                    }
                })
                .collect();
            self.demand.set(key.clone(), rates);
        }
    }

    /// One round: plan, commit, every region acknowledges. Returns (entries, commands, plan
    /// time, apply time).
    fn round(&mut self) -> (usize, usize, Duration, Duration) {
        self.now_ms += 1_000;
        let (p, plan_time) = timed(|| plan(&self.state, &self.demand, &self.config, self.now_ms));
        let entries = p.entries.len();
        let mut id = self.next_id;
        let cmds = p.into_commands(self.now_ms, self.config.max_entries_per_command, || {
            id += 1;
            RequestId(id)
        });
        self.next_id = id;
        let n = cmds.len();
        let ((), apply_time) = timed(|| {
            for cmd in &cmds {
                self.state.apply(cmd);
            }
        });
        self.renew_all();
        (entries, n, plan_time, apply_time)
    }
}

fn run(tenants: usize) {
    println!("== {tenants} policies × {REGIONS} regions ==");
    let mut rng = ChaCha8Rng::seed_from_u64(SEED);
    let (mut b, build) = timed(|| Bench::new(tenants));
    println!("build state: {:.2?}", build);
    let bytes = postcard::to_stdvec(&b.state).unwrap();
    println!(
        "snapshot (postcard): {} bytes, {:.1} bytes/policy",
        bytes.len(),
        bytes.len() as f64 / tenants as f64
    );

    b.set_demand(&mut rng, |_| true, 0);
    let mut settle = 0;
    loop {
        let (entries, cmds, plan_time, apply_time) = b.round();
        settle += 1;
        if settle <= 3 || entries == 0 || settle % 5 == 0 {
            println!(
                "settling round {settle:>2}: plan {plan_time:>9.2?}, {entries:>8} share changes \
                 in {cmds} commands, apply {apply_time:.2?}"
            );
        }
        if entries == 0 || settle >= 60 {
            break;
        }
    }
    let (entries, _, plan_time, _) = b.round();
    println!(
        "steady round:        plan {plan_time:>9.2?}, {entries:>8} share changes ({:.3}% of policies)",
        100.0 * entries as f64 / tenants as f64
    );

    // Shifting: every round 5% of tenants move their main region.
    let mut total_entries = 0;
    let rounds = 5;
    let mut worst = Duration::ZERO;
    for s in 0..rounds {
        let band = s;
        b.set_demand(&mut rng, |i| i % 20 == band, 1 + s);
        let (entries, _, plan_time, _) = b.round();
        worst = worst.max(plan_time);
        total_entries += entries;
        println!("shifting round {s}:    plan {plan_time:>9.2?}, {entries:>8} share changes");
    }
    println!(
        "shifting: {:.0} share changes per round on average ({:.2}% of policies), worst plan {worst:.2?}",
        total_entries as f64 / rounds as f64,
        100.0 * total_entries as f64 / rounds as f64 / tenants as f64,
    );
    let bytes = postcard::to_stdvec(&b.state).unwrap();
    println!(
        "snapshot after rebalancing: {:.1} bytes/policy; Σ check: {}",
        bytes.len() as f64 / tenants as f64,
        if b.state.check_invariant().is_ok() {
            "ok"
        } else {
            "VIOLATED"
        }
    );
    let sum_ok = b
        .state
        .entries
        .values()
        .all(|e| e.shares_ppm.iter().sum::<u32>() <= PPM);
    assert!(sum_ok);
}

fn main() {
    let sizes: Vec<usize> = std::env::var("QUOTA_BENCH_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![100_000, 1_000_000]);
    for n in sizes {
        run(n);
    }
}
