//! A concurrency limit of 3 slots over two regions of real daemons, each on its own
//! redis-server: clients in both regions acquire a slot (`POST /v1/holds`), work for a seeded
//! random time and release it (`DELETE /v1/holds/{id}`), while a holder in another OS process
//! (tests/python/hold_client.py) is killed with SIGKILL holding its slot.
//!
//! 3 slots over 2 regions is under 3 a region, so the limit lives in one home region (a) and b
//! relays its holds there: docs/architecture.md's bound, `limit + slots regions gave up within
//! the last window_ms`, is then 3 + 0, and the test holds every instant to at most 3.
//!
//! 12 slots over 2 regions are split instead (6 a region evenly, a floor of 1): load in a alone,
//! then in b alone, moves the slots with it, and every instant holds to 12 plus the slots the
//! allowances showed a region give up within the last window_ms.
//!
//! # Measuring slots in flight
//!
//! A slot is counted from the arrival of the answer that admitted it to the sending of its
//! release (or, at the latest, its acquire's sending plus the TTL less the clock skew). The
//! store admitted it before the answer arrived, and released it after the release was sent (or
//! at its TTL, counted from a store time no earlier than the acquire's sending), so each counted
//! interval lies inside the interval the store held the slot. The count at any instant is then
//! at most what the store held: the assertion cannot fail on a correct store however slow the
//! host (an overcount would make it flaky). It can miss an excess only by the few milliseconds
//! of latency trimmed off each end, against work times of 100 to 600 ms; a killed holder's slot
//! handed out early would show for up to seconds. A retried call counts from its first sending
//! (release) or last answer (acquire), which keeps the interval inside too. The killed holder's
//! slot counts from the moment the test read its id to the earliest instant it may expire: the
//! holder's wall-clock time just before it sent the acquire, plus the TTL, less the skew
//! between the test's monotonic clock and the wall clock Redis's TIME reads.

use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _};
use quotad_system_tests::{eventually, Cluster, Daemon, Timings, TOKEN};
use rand::{Rng as _, SeedableRng as _};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt as _, BufReader};

/// Every random choice derives from this seed; change it to replay another run.
const SEED: u64 = 47;
const REGIONS: [&str; 2] = ["a", "b"];
const TENANT: &str = "crowd";
const POLICY: &str = "slots";
const LIMIT: usize = 3;
/// The longest a holder keeps a slot: the default (and largest) TTL of a hold.
const WINDOW_MS: f64 = 4_000.0;
/// Load clients per region.
const CLIENTS_PER_REGION: u64 = 3;
/// How long the load clients keep acquiring at least; and at least this long past the TTL of
/// the holder killed among them, to see its slot come back.
const LOAD_MS: f64 = 14_000.0;
const AFTER_TTL_MS: f64 = 5_000.0;
/// Seeded ranges: work while holding a slot, and the pause after a denial.
const WORK_MS: std::ops::RangeInclusive<u64> = 100..=600;
const BACKOFF_MS: std::ops::RangeInclusive<u64> = 20..=80;
/// Between the test's monotonic clock and the wall clock (Redis TIME, Python's time.time):
/// the same host, so only their drift over the test and a step of the wall clock.
const SKEW_MS: f64 = 50.0;
/// A waiting acquirer polls every 50 ms: it is admitted within this of the killed slot's TTL.
const LATE_MS: f64 = 1_000.0;

/// A concurrency limit the clients hold slots of.
#[derive(Debug, Clone, Copy)]
struct Limit {
    tenant: &'static str,
    policy: &'static str,
    /// The longest a holder keeps a slot: the default (and largest) TTL of a hold.
    window_ms: f64,
}

/// The limit of 3 that lives in a.
const HOME_LIMIT: Limit = Limit {
    tenant: TENANT,
    policy: POLICY,
    window_ms: WINDOW_MS,
};

/// The test's time line: monotonic ms since the start, and the wall clock then.
#[derive(Debug, Clone, Copy)]
struct Clock {
    start: Instant,
    start_wall_ms: f64,
}

impl Clock {
    fn new() -> Self {
        let start = Instant::now();
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Self {
            start,
            start_wall_ms: wall.as_secs_f64() * 1000.0,
        }
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1000.0
    }

    /// A wall-clock time on the time line.
    fn of_wall(&self, wall_ms: f64) -> f64 {
        wall_ms - self.start_wall_ms
    }
}

/// One slot as the test saw it held, on the time line: `[from, to)`.
#[derive(Debug, Clone)]
struct Slot {
    who: String,
    from: f64,
    to: f64,
    killed: bool,
}

/// What an acquire came to.
#[derive(Debug)]
enum Acquired {
    /// Held: the hold id, when the acquire was first sent and when its answer arrived.
    Held {
        id: String,
        sent: f64,
        at: f64,
    },
    Denied {
        retry_after_ms: f64,
        at: f64,
    },
    /// No decided answer in 10 s (503s or failed calls): a slot may be held unseen, which only
    /// lowers the count.
    GaveUp,
}

/// Acquires a slot of `limit` through `d` under hold key `key`, again under the same key while
/// the daemon answers 503 or the call fails (the same hold if an earlier try was held).
async fn acquire(d: &Daemon, limit: &Limit, key: &str, clock: &Clock) -> anyhow::Result<Acquired> {
    let body = json!({"tenant": limit.tenant, "policy": limit.policy, "id": key}).to_string();
    let sent = clock.now();
    loop {
        if let Ok(r) = d
            .request("POST", "/v1/holds", Some(TOKEN), Some(body.clone()))
            .await
        {
            let at = clock.now();
            match r.status {
                200 => {
                    anyhow::ensure!(r.body["ttl_ms"] == limit.window_ms as u64, "{}", r.body);
                    let id = r.body["hold_id"].as_str().context("no hold_id")?;
                    return Ok(Acquired::Held {
                        id: id.to_string(),
                        sent,
                        at,
                    });
                }
                429 => {
                    let retry_after_ms = r.body["retry_after_ms"].as_f64().unwrap_or(-1.0);
                    return Ok(Acquired::Denied { retry_after_ms, at });
                }
                503 => {}
                s => bail!("an acquire through {} answered {s}: {}", d.api_port, r.body),
            }
        }
        if clock.now() > sent + 10_000.0 {
            return Ok(Acquired::GaveUp);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What a release came to.
#[derive(Debug, PartialEq)]
enum Released {
    Done,
    /// 409: the slot had expired (its holder held it past the TTL).
    Expired,
    GaveUp,
}

/// Releases hold `id` through `d`, again while 503 or failed; when it was first sent.
async fn release(d: &Daemon, id: &str, clock: &Clock) -> anyhow::Result<(f64, Released)> {
    let sent = clock.now();
    loop {
        if let Ok(r) = d
            .request("DELETE", &format!("/v1/holds/{id}"), Some(TOKEN), None)
            .await
        {
            match r.status {
                200 => {
                    anyhow::ensure!(r.body["state"] == "released", "{}", r.body);
                    return Ok((sent, Released::Done));
                }
                409 => return Ok((sent, Released::Expired)),
                503 => {}
                s => bail!("a release of {id} answered {s}: {}", r.body),
            }
        }
        if clock.now() > sent + 10_000.0 {
            return Ok((sent, Released::GaveUp));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A slot's counted end: its release's sending, and at the latest the earliest its TTL could
/// end (see the module's docs).
fn slot_end(limit: &Limit, acquire_sent: f64, release_sent: f64) -> f64 {
    release_sent.min(acquire_sent + limit.window_ms - SKEW_MS)
}

/// What a load client did.
#[derive(Debug, Default)]
struct ClientLog {
    slots: Vec<Slot>,
    denials: Vec<f64>,
    gave_up: usize,
    expired: usize,
}

/// A client of `limit` in `cluster`'s region `region`: acquires, works, releases until `until`
/// (ms on the time line, as `f64` bits; it may move), with its choices drawn from [`SEED`] and
/// `n`; each slot held for a time drawn from `work_ms`.
async fn client(
    cluster: Arc<Cluster>,
    limit: Limit,
    work_ms: std::ops::RangeInclusive<u64>,
    region: usize,
    n: u64,
    clock: Clock,
    until: Arc<AtomicU64>,
) -> anyhow::Result<ClientLog> {
    let d = &cluster.daemons[region];
    let who = format!("{}{n}", REGIONS[region]);
    let mut rng = ChaCha8Rng::seed_from_u64(SEED.wrapping_mul(1_000).wrapping_add(n));
    let mut log = ClientLog::default();
    for i in 0.. {
        if clock.now() >= f64::from_bits(until.load(Ordering::Relaxed)) {
            break;
        }
        match acquire(d, &limit, &format!("{who}-{i}"), &clock).await? {
            Acquired::Held { id, sent, at } => {
                let work = rng.random_range(work_ms.clone());
                tokio::time::sleep(Duration::from_millis(work)).await;
                let (release_sent, how) = release(d, &id, &clock).await?;
                match how {
                    Released::Done => {}
                    Released::Expired => log.expired += 1,
                    Released::GaveUp => log.gave_up += 1,
                }
                log.slots.push(Slot {
                    who: who.clone(),
                    from: at,
                    to: slot_end(&limit, sent, release_sent),
                    killed: false,
                });
            }
            Acquired::Denied { at, .. } => {
                log.denials.push(at);
                let pause = rng.random_range(BACKOFF_MS);
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            Acquired::GaveUp => log.gave_up += 1,
        }
    }
    Ok(log)
}

/// A holder killed holding its slot: the slot as counted, and the window its TTL ends in.
#[derive(Debug)]
struct Killed {
    slot: Slot,
    /// The earliest and latest instants the store may expire the slot (time line).
    expires: (f64, f64),
    denied_before: u64,
}

/// Starts tests/python/hold_client.py against `d`, reads the slot it acquired, and kills it
/// (SIGKILL) holding it.
async fn killed_holder(d: &Daemon, prefix: &str, clock: &Clock) -> anyhow::Result<Killed> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/hold_client.py");
    let mut child = tokio::process::Command::new("python3")
        .arg(&script)
        .args(["--base", &d.base(), "--token", TOKEN, "--tenant", TENANT])
        .args(["--policy", POLICY, "--id-prefix", prefix])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting python3")?;
    let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
    let line = tokio::time::timeout(Duration::from_secs(40), lines.next_line()).await;
    let read_at = clock.now();
    let line = match line {
        Ok(Ok(Some(line))) => line,
        other => {
            let _ = child.start_kill();
            let out = child.wait_with_output().await?;
            bail!(
                "the holder printed no slot ({other:?}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    };
    child.start_kill().context("killing the holder")?;
    let status = child.wait().await?;
    anyhow::ensure!(!status.success(), "the holder exited by itself: {status:?}");
    let said: Value = serde_json::from_str(&line).with_context(|| line.clone())?;
    anyhow::ensure!(said["ttl_ms"] == WINDOW_MS as u64, "{said}");
    let sent = clock.of_wall(said["sent_ms"].as_f64().context("no sent_ms")?);
    let expires = (sent + WINDOW_MS, read_at + WINDOW_MS);
    Ok(Killed {
        slot: Slot {
            who: format!("killed {}", said["hold_id"].as_str().unwrap_or("?")),
            from: read_at,
            to: expires.0 - SKEW_MS,
            killed: true,
        },
        expires,
        denied_before: said["denied"].as_u64().unwrap_or(0),
    })
}

/// The most slots counted at once within `[from, to)` among those `include` takes, and the
/// first instant it was reached.
fn most_at_once(
    slots: &[Slot],
    from: f64,
    to: f64,
    include: impl Fn(&Slot) -> bool,
) -> (usize, f64) {
    let taken: Vec<&Slot> = slots.iter().filter(|s| include(s)).collect();
    let mut instants: Vec<f64> = taken.iter().map(|s| s.from).collect();
    instants.push(from);
    instants.sort_by(f64::total_cmp);
    instants
        .into_iter()
        .filter(|t| (from..to).contains(t))
        .map(|t| (taken.iter().filter(|s| s.from <= t && t < s.to).count(), t))
        .fold((0, from), |best, x| if x.0 > best.0 { x } else { best })
}

/// How long, within `[from, to)`, at least `k` of the slots `include` takes were counted at once.
fn time_with(slots: &[Slot], from: f64, to: f64, k: usize, include: impl Fn(&Slot) -> bool) -> f64 {
    let mut edges: Vec<(f64, i32)> = slots
        .iter()
        .filter(|s| include(s) && s.from < s.to)
        .flat_map(|s| [(s.from, 1), (s.to, -1)])
        .collect();
    // Ends before starts at one instant: the intervals are half-open.
    edges.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
    let (mut count, mut since, mut total) = (0, from, 0.0);
    for (t, step) in edges {
        let t = t.clamp(from, to);
        if count >= k as i32 {
            total += t - since;
        }
        since = t;
        count += step;
    }
    if count >= k as i32 {
        total += to - since;
    }
    total
}

/// Waits until both regions can acquire and release a slot of `limit`.
async fn until_held_everywhere(
    cluster: &Cluster,
    limit: &Limit,
    clock: &Clock,
) -> anyhow::Result<()> {
    for (i, d) in cluster.daemons.iter().enumerate() {
        let mut n = 0;
        let held = eventually(Duration::from_secs(20), Duration::from_millis(100), || {
            n += 1;
            let key = format!("warm-{i}-{n}");
            async move {
                match acquire(d, limit, &key, clock).await.ok()? {
                    Acquired::Held { id, .. } => Some(id),
                    _ => None,
                }
            }
        })
        .await
        .with_context(|| format!("region {} never held a slot", REGIONS[i]))?;
        let (_, how) = release(d, &held, clock).await?;
        anyhow::ensure!(how == Released::Done, "{how:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_slots_over_two_regions_stay_three_with_a_holder_killed() -> anyhow::Result<()> {
    eprintln!("seed {SEED} (tests/tests/concurrency.rs SEED replays it)");
    let cluster = Arc::new(Cluster::start(&REGIONS, &Timings::default()).await?);
    let spec = json!({"algorithm": "concurrency", "limit": LIMIT, "window_ms": WINDOW_MS as u64});
    cluster.daemon("a").put_policy(TENANT, POLICY, spec).await?;
    for d in &cluster.daemons {
        let home = eventually(
            Duration::from_secs(15),
            Duration::from_millis(100),
            || async {
                let r = d
                    .get(&format!("/v1/tenants/{TENANT}/allowance"))
                    .await
                    .ok()?;
                let p = &r.body["policies"][0];
                (p["mode"] == "home" && p["home"] == "a").then_some(())
            },
        )
        .await;
        home.context("the limit never lived whole in a")?;
    }
    let clock = Clock::new();
    until_held_everywhere(&cluster, &HOME_LIMIT, &clock).await?;
    let (a, b) = (cluster.daemon("a"), cluster.daemon("b"));
    let mut slots = Vec::new();

    // 1. A holder (through b) killed holding its slot; two more slots taken 2 s later, so
    //    theirs expire well after its. A waiter is admitted only once its TTL has passed.
    let p1 = killed_holder(b, "p1", &clock).await?;
    slots.push(p1.slot.clone());
    // Not a timing assumption: it only keeps the other two slots' TTLs apart from the killed
    // one's, so the waiter's slot can only be the killed holder's.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let mut held = Vec::new();
    for (d, key) in [(a, "s1"), (b, "s2")] {
        match acquire(d, &HOME_LIMIT, key, &clock).await? {
            Acquired::Held { id, sent, at } => held.push((d, id, sent, at)),
            other => bail!("{key}: a second slot was not given: {other:?}"),
        }
    }
    let asked = clock.now();
    let Acquired::Denied { retry_after_ms, at } = acquire(a, &HOME_LIMIT, "full", &clock).await?
    else {
        bail!("a fourth slot was given");
    };
    // The store answers the time until the earliest slot, the killed one, expires.
    let (earliest, latest) = p1.expires;
    assert!(
        retry_after_ms >= earliest - at - SKEW_MS && retry_after_ms <= latest - asked + SKEW_MS,
        "retry after {retry_after_ms} ms at {asked:.0}..{at:.0} ms; the killed slot expires \
         between {earliest:.0} and {latest:.0} ms"
    );
    let mut waited = 0;
    let admitted = loop {
        match acquire(b, &HOME_LIMIT, &format!("w-{waited}"), &clock).await? {
            Acquired::Held { id, sent, at } => break (id, sent, at),
            Acquired::Denied { .. } => waited += 1,
            Acquired::GaveUp => {}
        }
        anyhow::ensure!(
            clock.now() < latest + 10_000.0,
            "the killed slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (w_id, w_sent, w_at) = admitted;
    assert!(
        w_at >= earliest - SKEW_MS,
        "the waiter was admitted at {w_at:.0} ms, before the killed slot's TTL ({earliest:.0} ms)"
    );
    assert!(
        w_at <= latest + LATE_MS,
        "the waiter was admitted at {w_at:.0} ms, {:.0} ms after the killed slot's TTL \
         ({latest:.0} ms at the latest)",
        w_at - latest
    );
    // Both other slots were still held when the waiter got one: it was the killed one's.
    for (d, id, sent, at) in held {
        let (release_sent, how) = release(d, &id, &clock).await?;
        assert_eq!(
            how,
            Released::Done,
            "{id} had expired before the waiter got a slot"
        );
        slots.push(Slot {
            who: id,
            from: at,
            to: slot_end(&HOME_LIMIT, sent, release_sent),
            killed: false,
        });
    }
    let (release_sent, how) = release(b, &w_id, &clock).await?;
    assert_eq!(how, Released::Done);
    slots.push(Slot {
        who: w_id,
        from: w_at,
        to: slot_end(&HOME_LIMIT, w_sent, release_sent),
        killed: false,
    });
    eprintln!(
        "killed holder through b: TTL ends in {earliest:.0}..{latest:.0} ms; a waiter through b \
         was denied {waited} times and admitted at {w_at:.0} ms ({:+.0} ms after the earliest \
         end); the store's retry_after {retry_after_ms} ms",
        w_at - earliest
    );

    // 2. Load: three clients a region, and a second holder (through a) killed in the middle.
    let load_from = clock.now();
    // Until the holder below has its slot and its TTL is known.
    let until = Arc::new(AtomicU64::new(f64::MAX.to_bits()));
    let clients: Vec<_> = (0..2 * CLIENTS_PER_REGION)
        .map(|n| {
            let (cluster, until) = (cluster.clone(), until.clone());
            tokio::spawn(client(
                cluster,
                HOME_LIMIT,
                WORK_MS,
                (n % 2) as usize,
                n,
                clock,
                until,
            ))
        })
        .collect();
    // Scenario, not timing: the holder joins once the load runs.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let p2 = killed_holder(a, "p2", &clock).await?;
    slots.push(p2.slot.clone());
    let end = (load_from + LOAD_MS).max(p2.expires.1 + AFTER_TTL_MS);
    until.store(end.to_bits(), Ordering::Relaxed);
    let mut logs = Vec::new();
    for c in clients {
        logs.push(c.await??);
    }
    let load_to = clock.now();
    let acquired: usize = logs.iter().map(|l| l.slots.len()).sum();
    let denied: Vec<f64> = logs.iter().flat_map(|l| l.denials.clone()).collect();
    let gave_up: usize = logs.iter().map(|l| l.gave_up).sum();
    let expired: usize = logs.iter().map(|l| l.expired).sum();
    for l in logs {
        slots.extend(l.slots);
    }

    let (most, when) = most_at_once(&slots, 0.0, f64::MAX, |_| true);
    let (e2, l2) = p2.expires;
    let (live_in_kill, _) = most_at_once(&slots, p2.slot.from, p2.slot.to, |s| !s.killed);
    let denied_in_kill = denied
        .iter()
        .filter(|t| (p2.slot.from..p2.slot.to).contains(*t))
        .count();
    let (live_after, after_at) = most_at_once(&slots, l2, load_to, |s| !s.killed);
    let full_after = time_with(&slots, l2, load_to, LIMIT, |s| !s.killed) / (load_to - l2);
    let by_region = |r: &str| {
        slots
            .iter()
            .filter(|s| !s.killed && s.who.starts_with(r) && s.from >= load_from)
            .count()
    };
    eprintln!(
        "load: {acquired} acquisitions ({} through a, {} through b), {} denials, {gave_up} \
         calls without a decided answer, {expired} slots expired before their release; {} \
         slots in all, at most {most} in flight (at {when:.0} ms)",
        by_region("a"),
        by_region("b"),
        denied.len(),
        slots.len(),
    );
    eprintln!(
        "killed holder through a (denied {} times first): counted {:.0}..{:.0} ms, TTL ends \
         {e2:.0}..{l2:.0} ms; live clients held at most {live_in_kill} meanwhile, denied \
         {denied_in_kill} times; after its TTL they held {live_after} at once (first at \
         {after_at:.0} ms; all {LIMIT} for {:.0} % of the {:.0} ms left)",
        p2.denied_before,
        p2.slot.from,
        p2.slot.to,
        full_after * 100.0,
        load_to - l2
    );
    assert!(
        most <= LIMIT,
        "{most} slots in flight at {when:.0} ms, above the limit of {LIMIT} (+ 0 in home mode): \
         {:?}",
        slots
            .iter()
            .filter(|s| s.from <= when && when < s.to)
            .collect::<Vec<_>>()
    );
    assert!(
        denied_in_kill > 0,
        "nobody asked for the killed holder's slot"
    );
    assert_eq!(
        live_after, LIMIT,
        "after the killed slot's TTL the live clients never held all {LIMIT} slots"
    );
    assert!(
        acquired >= 20 && !denied.is_empty(),
        "too little load to show anything"
    );
    Ok(())
}

/// 12 slots over two regions: 6 a region evenly, so the limit is split, not homed.
const SPLIT_LIMIT: Limit = Limit {
    tenant: "throng",
    policy: "slots",
    window_ms: 3_000.0,
};
const SPLIT_SLOTS: usize = 12;
/// Each region keeps `floor(0.1 · 12)` = 1 slot whatever the demand elsewhere.
const SPLIT_FLOOR: f64 = 0.1;
const FLOOR_SLOTS: f64 = 1.0;
const EVEN_SLOTS: f64 = 6.0;
/// Load clients in the loaded region: as many as the limit, more than a region can hold
/// (all but the other's floor), so they are denied too.
const SPLIT_CLIENTS: u64 = 12;
/// Work while holding a slot: up to most of `window_ms`, so a region's holders keep their slots
/// well after its capacity dropped, while the other region's grows: the bound's second term.
const SPLIT_WORK_MS: std::ops::RangeInclusive<u64> = 200..=2_500;
/// How long each phase may take to show the share moved, and how long its load goes on after.
const PHASE_MS: f64 = 10_000.0;
const SETTLE_MS: f64 = 2_000.0;
/// A cut is read from the daemon's view; its agent writes the lower limit to Redis within a
/// pass of that, and holders admitted until then keep their slots for up to `window_ms`.
const CUT_LAG_MS: f64 = 1_000.0;

/// One region's allowance of [`SPLIT_LIMIT`] as read between `sent` and `at` (time line).
#[derive(Debug, Clone)]
struct Reading {
    region: usize,
    sent: f64,
    at: f64,
    mode: String,
    share: f64,
    /// The region's slots.
    capacity: f64,
}

/// Reads region `region`'s allowance of `limit`; `None` while it has none to show.
async fn read_allowance(
    d: &Daemon,
    region: usize,
    limit: &Limit,
    clock: &Clock,
) -> Option<Reading> {
    let sent = clock.now();
    let r = d
        .get(&format!("/v1/tenants/{}/allowance", limit.tenant))
        .await
        .ok()?;
    let at = clock.now();
    let p = r.body["policies"]
        .as_array()?
        .iter()
        .find(|p| p["policy"] == limit.policy)?;
    let this = &p["this_region"];
    Some(Reading {
        region,
        sent,
        at,
        mode: p["mode"].as_str()?.to_string(),
        share: this["share"].as_f64()?,
        capacity: this["capacity"].as_f64()?,
    })
}

/// Reads both regions' allowances into `log`; the round as read (a's, then b's).
async fn read_both(cluster: &Cluster, clock: &Clock, log: &mut Vec<Reading>) -> Vec<Reading> {
    let mut round = Vec::new();
    for (i, d) in cluster.daemons.iter().enumerate() {
        if let Some(r) = read_allowance(d, i, &SPLIT_LIMIT, clock).await {
            log.push(r.clone());
            round.push(r);
        }
    }
    round
}

/// Slots a region gave up and the span they may still be held in: a drop of its capacity
/// between two readings, from the earlier reading's sending (it dropped after that) to the
/// later one's answer plus [`CUT_LAG_MS`] and `window_ms` (its holders kept their slots at
/// most that long after it).
#[derive(Debug, Clone)]
struct Cut {
    slots: f64,
    from: f64,
    to: f64,
}

fn cuts(readings: &[Reading], limit: &Limit) -> Vec<Cut> {
    let mut cuts = Vec::new();
    for region in 0..REGIONS.len() {
        let mine: Vec<&Reading> = readings.iter().filter(|r| r.region == region).collect();
        for pair in mine.windows(2) {
            let slots = pair[0].capacity - pair[1].capacity;
            if slots > 0.0 {
                cuts.push(Cut {
                    slots,
                    from: pair[0].sent,
                    to: pair[1].at + CUT_LAG_MS + limit.window_ms,
                });
            }
        }
    }
    cuts
}

/// The capacities `region` read between `from` and `to`: (least, most).
fn capacity_range(readings: &[Reading], region: usize, from: f64, to: f64) -> (f64, f64) {
    readings
        .iter()
        .filter(|r| r.region == region && (from..to).contains(&r.at))
        .fold((f64::MAX, f64::MIN), |(lo, hi), r| {
            (lo.min(r.capacity), hi.max(r.capacity))
        })
}

/// Reads both regions every 100 ms from `from` (test-clock ms) until `moved` holds of a round
/// (given each region's capacity in it), then for `SETTLE_MS` more: how long the move took.
/// Fails when it does not hold within `PHASE_MS`, naming the move `what`.
async fn until_moved(
    cluster: &Cluster,
    clock: &Clock,
    readings: &mut Vec<Reading>,
    from: f64,
    what: &str,
    moved: impl Fn(&dyn Fn(usize) -> Option<f64>) -> bool,
) -> anyhow::Result<f64> {
    let mut at: Option<f64> = None;
    loop {
        let round = read_both(cluster, clock, readings).await;
        let now = clock.now();
        let cap = |i: usize| round.iter().find(|r| r.region == i).map(|r| r.capacity);
        if at.is_none() && moved(&cap) {
            at = Some(now);
        }
        match at {
            Some(t) if now >= t + SETTLE_MS => return Ok(t - from),
            None if now > from + PHASE_MS => bail!(
                "the load never moved slots {what} in {PHASE_MS} ms: {}",
                capacity_changes(readings)
            ),
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The readings where a region's capacity changed, as `t ms: a=.. b=..` for the closing note.
fn capacity_changes(readings: &[Reading]) -> String {
    let mut last = [f64::NAN; 2];
    let mut out = Vec::new();
    for r in readings {
        if r.capacity != last[r.region] {
            last[r.region] = r.capacity;
            out.push(format!(
                "{:.0} ms {}={} (share {:.3})",
                r.at, REGIONS[r.region], r.capacity, r.share
            ));
        }
    }
    out.join(", ")
}

/// Spawns [`SPLIT_CLIENTS`] load clients in `region`, numbered from `first`, until `until`.
fn load(
    cluster: &Arc<Cluster>,
    region: usize,
    first: u64,
    clock: Clock,
    until: &Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<ClientLog>>> {
    (first..first + SPLIT_CLIENTS)
        .map(|n| {
            let (cluster, until) = (cluster.clone(), until.clone());
            tokio::spawn(client(
                cluster,
                SPLIT_LIMIT,
                SPLIT_WORK_MS,
                region,
                n,
                clock,
                until,
            ))
        })
        .collect()
}

/// 12 slots over two regions are split 6 and 6; load in a alone moves slots to a (b keeps its
/// floor of 1), then load in b alone moves them to b. The slots counted in flight (measured as
/// in the module's docs, so never above what the stores held) stay within the documented
/// bound, `limit + slots regions gave up within the last window_ms`: each drop of a region's
/// capacity the test read counts, from the reading before it to `window_ms` (plus the agent's
/// write of the cut, [`CUT_LAG_MS`]) after the reading that showed it. A drop read late only
/// widens that span, so the bound asserted is never tighter than the documented one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twelve_split_slots_follow_the_load_between_regions() -> anyhow::Result<()> {
    eprintln!("seed {SEED} (tests/tests/concurrency.rs SEED replays it)");
    let cluster = Arc::new(Cluster::start(&REGIONS, &Timings::default()).await?);
    let spec = json!({"algorithm": "concurrency", "limit": SPLIT_SLOTS,
        "window_ms": SPLIT_LIMIT.window_ms as u64, "floor": SPLIT_FLOOR});
    cluster
        .daemon("a")
        .put_policy(SPLIT_LIMIT.tenant, SPLIT_LIMIT.policy, spec)
        .await?;
    let clock = Clock::new();
    let mut readings = Vec::new();
    let first = eventually(Duration::from_secs(15), Duration::from_millis(100), || {
        let (cluster, clock) = (&cluster, &clock);
        async move {
            let mut log = Vec::new();
            let round = read_both(cluster, clock, &mut log).await;
            (round.len() == 2 && round.iter().all(|r| r.capacity > 0.0)).then_some(round)
        }
    })
    .await
    .context("the limit never had slots in both regions")?;
    for r in &first {
        anyhow::ensure!(
            r.mode == "split",
            "{} is not split: {r:?}",
            REGIONS[r.region]
        );
    }
    let sum: f64 = first.iter().map(|r| r.capacity).sum();
    anyhow::ensure!(
        sum <= SPLIT_SLOTS as f64,
        "the regions hold {sum} slots: {first:?}"
    );
    readings.extend(first);
    until_held_everywhere(&cluster, &SPLIT_LIMIT, &clock).await?;

    // Phase A: load in a alone.
    let a_from = clock.now();
    let until_a = Arc::new(AtomicU64::new(f64::MAX.to_bits()));
    let mut clients_a = load(&cluster, 0, 100, clock, &until_a);
    let a_moved = until_moved(&cluster, &clock, &mut readings, a_from, "to a", |cap| {
        cap(0).is_some_and(|c| c > EVEN_SLOTS)
    })
    .await?;

    // Phase B: the load moves to b.
    let b_from = clock.now();
    let until_b = Arc::new(AtomicU64::new(f64::MAX.to_bits()));
    let clients_b = load(&cluster, 1, 200, clock, &until_b);
    until_a.store(b_from.to_bits(), Ordering::Relaxed);
    let (_, a_most) = capacity_range(&readings, 0, a_from, b_from);
    let b_moved = until_moved(
        &cluster,
        &clock,
        &mut readings,
        b_from,
        "from a to b",
        |cap| cap(1).is_some_and(|c| c > EVEN_SLOTS) && cap(0).is_some_and(|c| c < a_most),
    )
    .await?;
    until_b.store(clock.now().to_bits(), Ordering::Relaxed);
    let mut logs = Vec::new();
    for c in clients_a.drain(..).chain(clients_b) {
        logs.push(c.await??);
    }
    let load_to = clock.now();
    read_both(&cluster, &clock, &mut readings).await;

    let mut slots = Vec::new();
    let (mut denied, mut gave_up, mut expired) = ([0; 2], 0, 0);
    let mut acquired = [0; 2];
    for l in logs {
        let region = usize::from(!l.slots.first().is_some_and(|s| s.who.starts_with('a')));
        acquired[region] += l.slots.len();
        denied[region] += l.denials.len();
        gave_up += l.gave_up;
        expired += l.expired;
        slots.extend(l.slots);
    }
    let cuts = cuts(&readings, &SPLIT_LIMIT);
    let given_up_at = |t: f64| -> f64 {
        cuts.iter()
            .filter(|c| (c.from..c.to).contains(&t))
            .fold(0.0, |sum, c| sum + c.slots)
    };
    let mut instants: Vec<f64> = slots.iter().map(|s| s.from).collect();
    instants.sort_by(f64::total_cmp);
    let in_flight = |t: f64| slots.iter().filter(|s| s.from <= t && t < s.to).count();
    let (most, when) = most_at_once(&slots, 0.0, f64::MAX, |_| true);
    // The instant the count came closest to (or above) its bound: its excess over the slots
    // given up then, at most the limit.
    let (worst, worst_at) = instants
        .iter()
        .map(|&t| (in_flight(t) as f64 - given_up_at(t), t))
        .fold(
            (f64::MIN, 0.0),
            |best, x| if x.0 > best.0 { x } else { best },
        );
    let (b_least_in_a, _) = capacity_range(&readings, 1, a_from, b_from);
    let (a_least_in_b, _) = capacity_range(&readings, 0, b_from, load_to);
    let (_, b_most) = capacity_range(&readings, 1, b_from, load_to);
    // The last capacity read of each region summed at each reading: in a round the two reads
    // are apart, so a move between them may show a sum above the limit.
    let mut last = [0.0; 2];
    let mut most_sum: f64 = 0.0;
    for r in &readings {
        last[r.region] = r.capacity;
        most_sum = most_sum.max(last[0] + last[1]);
    }
    let counted_over = |from: f64, to: f64| most_at_once(&slots, from, to, |_| true).0;
    eprintln!(
        "split: a's capacity above {EVEN_SLOTS} {a_moved:.0} ms into phase A (at most {a_most}, b \
         at least {b_least_in_a}); b's above {EVEN_SLOTS} and a's below {a_most} {b_moved:.0} ms \
         into phase B (b at most {b_most}, a at least {a_least_in_b}); capacities read: {}",
        capacity_changes(&readings)
    );
    eprintln!(
        "split load: {} acquisitions through a, {} through b; {} denials through a, {} through \
         b; {gave_up} calls without a decided answer, {expired} slots expired before their \
         release; at most {most} in flight (at {when:.0} ms; {} in phase A, {} in phase B), \
         closest to the bound at {worst_at:.0} ms: {} in flight against {SPLIT_SLOTS} + {} \
         given up; the capacities read summed to at most {most_sum} at once; {} cuts read \
         (slots in the span they count): {}",
        acquired[0],
        acquired[1],
        denied[0],
        denied[1],
        counted_over(a_from, b_from),
        counted_over(b_from, load_to),
        in_flight(worst_at),
        given_up_at(worst_at),
        cuts.len(),
        cuts.iter()
            .map(|c| format!("{} in {:.0}..{:.0} ms", c.slots, c.from, c.to))
            .collect::<Vec<_>>()
            .join(", "),
    );
    for r in &readings {
        anyhow::ensure!(
            r.mode == "split",
            "{} left split mode: {r:?}",
            REGIONS[r.region]
        );
    }
    assert!(
        b_least_in_a >= FLOOR_SLOTS,
        "b kept {b_least_in_a} slots under load in a alone, below its floor of {FLOOR_SLOTS}"
    );
    assert!(
        a_least_in_b >= FLOOR_SLOTS,
        "a kept {a_least_in_b} slots under load in b alone, below its floor of {FLOOR_SLOTS}"
    );
    assert!(
        worst <= SPLIT_SLOTS as f64,
        "{} slots in flight at {worst_at:.0} ms, above the limit of {SPLIT_SLOTS} + {} given up \
         within the last window_ms: {:?}",
        in_flight(worst_at),
        given_up_at(worst_at),
        slots
            .iter()
            .filter(|s| s.from <= worst_at && worst_at < s.to)
            .collect::<Vec<_>>()
    );
    assert!(
        acquired[0] >= 10 && acquired[1] >= 10 && denied[0] + denied[1] > 0,
        "too little load to show anything"
    );
    Ok(())
}
