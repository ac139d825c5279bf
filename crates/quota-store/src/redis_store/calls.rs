//! Calls to Redis: every one bounded by the store's timeout, scripts by SHA with a reload on
//! NOSCRIPT, and the decoding of the replies that are not decisions.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use quota_core::keys;
use redis::aio::ConnectionManager;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::{FromRedisValue, Script, ServerErrorKind, Value};

use super::error::{from_redis, protocol};
use super::sentinel::failover_sign;
use super::source::{Conn, Source};
use super::{RedisStore, CONNECT_WAIT};
use crate::script::{Arg, COLLECT_BATCH_MAX};
use crate::{BucketRef, Eviction, StoreError, UsageRecord};

/// Keys one `SCAN` step looks at: large enough that a sweep of a big keyspace takes few round
/// trips, small enough that no step holds Redis for long.
const SCAN_COUNT: usize = 1000;

/// A key in `base`'s hash slot that names one call of a script that must not apply twice
/// (`<base>:<kind>:<id>`): the script marks it on its first run, and a replay of the same call
/// (the same keys) finds it. Ids are a per-process random prefix and a counter, so calls of
/// every daemon on one Redis differ.
pub(super) fn once_key(base: &str, kind: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::AtomicU64;
    use std::sync::OnceLock;
    static PROCESS: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // RandomState is seeded from the OS's randomness once per process.
    let process = *PROCESS.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(u64::from(std::process::id()));
        h.finish()
    });
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{base}:{kind}:{process:016x}{n:x}")
}

impl RedisStore {
    /// PINGs Redis through `source`, as [`reachable`](Self::reachable) describes.
    pub(super) async fn ping(&self, source: &Source) -> Result<(), StoreError> {
        let wait = self.timeout.max(CONNECT_WAIT);
        let ping = async {
            match source {
                Source::Single(s) => {
                    let used = s.current.load_full();
                    let r = redis::cmd("PING")
                        .query_async::<Value>(&mut (*used).clone())
                        .await;
                    if r.as_ref()
                        .is_err_and(|e| e.kind() == redis::ErrorKind::AuthenticationFailed)
                    {
                        s.replace(&used);
                    }
                    r
                }
                Source::Cluster(c) => {
                    let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                    c.route(redis::cmd("PING"), all).await
                }
                Source::Sentinel(s) => {
                    let r = match s.manager().await {
                        Ok(mut m) => redis::cmd("PING").query_async::<Value>(&mut m).await,
                        Err(e) => Err(e),
                    };
                    if r.as_ref().is_err_and(failover_sign) {
                        s.stale.store(true, Ordering::Relaxed);
                    }
                    r
                }
            }
        };
        match tokio::time::timeout(wait, ping).await {
            Ok(r) => r.map(drop).map_err(|e| from_redis(&e)),
            Err(_) => Err(StoreError::Timeout {
                ms: wait.as_millis() as u64,
            }),
        }
    }

    /// A connection for one call, and the standalone manager it came from.
    pub(super) fn connection(&self) -> (Conn, Option<Arc<ConnectionManager>>) {
        match &**self.source.load() {
            Source::Single(s) => {
                let m = s.current.load_full();
                (Conn::Single((*m).clone()), Some(m))
            }
            Source::Cluster(c) => (Conn::Cluster(c.clone()), None),
            Source::Sentinel(s) => (Conn::Sentinel(s.clone()), None),
        }
    }

    /// Passes a call's result on, replacing the standalone manager `used` when Redis refused
    /// its credentials (see [`Standalone`]), and having the sentinels asked again after a sign
    /// of failover (see [`SentinelMaster`]).
    pub(super) fn after<T>(
        &self,
        r: redis::RedisResult<T>,
        used: Option<&Arc<ConnectionManager>>,
    ) -> redis::RedisResult<T> {
        if let Err(e) = &r {
            match (&**self.source.load(), used) {
                (Source::Single(s), Some(used))
                    if e.kind() == redis::ErrorKind::AuthenticationFailed =>
                {
                    s.replace(used)
                }
                (Source::Sentinel(s), _) if failover_sign(e) => {
                    s.stale.store(true, Ordering::Relaxed)
                }
                _ => {}
            }
        }
        r
    }

    /// The activity index a state key is listed in.
    pub(super) fn index_key(&self, state_key: &str) -> String {
        match &self.slot_tags {
            None => keys::ACTIVE_INDEX.to_string(),
            Some(tags) => {
                keys::slot_index_key_for_tag(&tags[usize::from(keys::key_slot(state_key))])
            }
        }
    }

    /// Awaits a Redis call within the configured timeout, mapping its errors.
    pub(super) async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(r) => r.map_err(|e| from_redis(&e)),
            Err(_) => {
                // A master that stopped answering without closing its connections.
                if let Source::Sentinel(s) = &**self.source.load() {
                    s.stale.store(true, Ordering::Relaxed);
                }
                Err(StoreError::Timeout {
                    ms: self.timeout.as_millis() as u64,
                })
            }
        }
    }

    /// Runs `script` with EVALSHA (loading it on NOSCRIPT) within the timeout.
    ///
    /// The command is built straight into one `Cmd` (a `ScriptInvocation` would first copy every
    /// key and argument into a vector of its own): this is the decision hot path.
    pub(super) async fn invoke<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[Arg<'_>],
    ) -> Result<T, StoreError> {
        let hash = script.get_hash();
        let len = keys.iter().map(|k| k.len()).sum::<usize>()
            + args.iter().map(Arg::max_len).sum::<usize>()
            + hash.len()
            + 16;
        let mut cmd = redis::Cmd::with_capacity(3 + keys.len() + args.len(), len);
        cmd.arg("EVALSHA")
            .arg(hash)
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        let call = async {
            let once = || async {
                let (mut conn, used) = self.connection();
                let r = match cmd.query_async(&mut conn).await {
                    Err(e) if e.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript) => {
                        match script.prepare_invoke().load_async(&mut conn).await {
                            Ok(_) => cmd.query_async(&mut conn).await,
                            Err(e) => Err(e),
                        }
                    }
                    r => r,
                };
                self.after(r, used.as_ref())
            };
            match once().await {
                // A connection found dead (e.g. Redis restarted) is replaced by the manager;
                // one retry on the new connection hides that from the caller. The script may
                // have run before the connection broke (so may a Cluster client's own retries),
                // so every script is safe to run twice: a decision or a batch spends twice,
                // which errs towards denying; set_params.lua writes the same parameters again;
                // refund.lua, charge.lua and collect_usage.lua are exactly once through a key
                // unique to the call (`once_key`, or a charge's id), which a replay finds;
                // hold.lua and settle.lua through the hold's record (its id, its phase).
                Err(e)
                    if e.is_connection_dropped()
                        || e.is_connection_refusal()
                        || e.is_io_error() =>
                {
                    once().await
                }
                r => r,
            }
        };
        self.bounded(call).await
    }

    /// Runs one plain command within the timeout.
    pub(super) async fn command<T: FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
    ) -> Result<T, StoreError> {
        let (mut conn, used) = self.connection();
        let call = async { self.after(cmd.query_async(&mut conn).await, used.as_ref()) };
        self.bounded(call).await
    }

    /// Takes up to `max` keys from one activity index; returns how many were taken and the
    /// usage of those still alive.
    pub(super) async fn collect_index(
        &self,
        index: &str,
        max: usize,
    ) -> Result<(usize, Vec<UsageRecord>), StoreError> {
        let n = Arg::Num(max.clamp(1, COLLECT_BATCH_MAX) as u64);
        let reply_key = once_key(index, "c");
        let reply: Vec<Value> = self
            .invoke(&self.scripts.collect_usage, &[index, &reply_key], &[n])
            .await?;
        parse_usage(reply)
    }

    /// The run ids of the servers behind this store, sorted and joined (every master of a
    /// Cluster). A restarted or failed-over server has a new one.
    pub(super) async fn run_ids(&self) -> Result<String, StoreError> {
        let reply = self.info_of_masters("server").await?;
        let mut ids = Vec::new();
        info_values(&reply, "run_id", &mut ids);
        if ids.is_empty() {
            return Err(StoreError::Protocol {
                reason: "INFO server reported no run_id".into(),
            });
        }
        ids.sort_unstable();
        Ok(ids.join(","))
    }

    /// `TIME` of the server, or the earliest of every master of a Cluster, in whole ms
    /// (rounded down).
    pub(super) async fn time_of_masters(&self) -> Result<u64, StoreError> {
        let time = redis::cmd("TIME");
        let reply = match &*self.source.load_full() {
            Source::Single(_) | Source::Sentinel(_) => self.command(&time).await?,
            Source::Cluster(c) => {
                let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                self.bounded(c.route(time, all)).await?
            }
        };
        let mut readings = Vec::new();
        time_values(&reply, &mut readings);
        readings
            .into_iter()
            .min()
            .ok_or_else(|| StoreError::Protocol {
                reason: format!("TIME answered {reply:?}"),
            })
    }

    /// `INFO <section>` of the server, or of every master of a Cluster.
    async fn info_of_masters(&self, section: &str) -> Result<Value, StoreError> {
        let mut info = redis::cmd("INFO");
        info.arg(section);
        match &*self.source.load_full() {
            Source::Single(_) | Source::Sentinel(_) => self.command(&info).await,
            Source::Cluster(c) => {
                let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                self.bounded(c.route(info, all)).await
            }
        }
    }

    /// Marks this Redis as written by `me` for `ttl_ms` unless another writer's mark is live;
    /// `me`'s own mark is renewed. The mark in force after the call.
    pub async fn claim_owner(&self, me: &str, ttl_ms: u64) -> Result<String, StoreError> {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(OWNER_LUA)
            .arg(1)
            .arg(OWNER_KEY)
            .arg(me)
            .arg(ttl_ms.max(1));
        self.command(&cmd).await
    }

    /// Removes `me`'s mark, if the mark is `me`'s.
    pub async fn release_owner(&self, me: &str) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(RELEASE_OWNER_LUA).arg(1).arg(OWNER_KEY).arg(me);
        self.command::<Value>(&cmd).await.map(drop)
    }

    /// Whether the writes this store sent so far are on a replica of every master that has
    /// one ([`crate::AnyStore::durable`]): `INFO replication`, then `WAIT 1` for at most
    /// [`WAIT_MS`] where a master has connected replicas.
    pub async fn durable(&self) -> Result<bool, StoreError> {
        let info = self.info_of_masters("replication").await?;
        let mut replicas = Vec::new();
        info_values(&info, "connected_slaves", &mut replicas);
        if replicas.is_empty() {
            return Err(StoreError::Protocol {
                reason: "INFO replication reported no connected_slaves".into(),
            });
        }
        if replicas.iter().all(|r| r == "0") {
            return Ok(true);
        }
        // WAIT holds the connection the decisions share for as long as it waits: a short wait,
        // and writes a replica has not confirmed by then are confirmed by a later call (WAIT
        // covers every earlier write of the connection).
        let mut wait = redis::cmd("WAIT");
        wait.arg(1).arg(WAIT_MS);
        // The call's bound: the store's timeout past the wait.
        let call = async {
            match &*self.source.load_full() {
                Source::Single(s) => {
                    let used = s.current.load_full();
                    wait.query_async::<Value>(&mut (*used).clone()).await
                }
                Source::Sentinel(s) => match s.manager().await {
                    Ok(mut m) => wait.query_async::<Value>(&mut m).await,
                    Err(e) => Err(e),
                },
                Source::Cluster(c) => {
                    let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                    c.route(wait, all).await
                }
            }
        };
        let bound = self.timeout + std::time::Duration::from_millis(WAIT_MS);
        let reply = match tokio::time::timeout(bound, call).await {
            Ok(r) => r.map_err(|e| from_redis(&e))?,
            Err(_) => {
                return Err(StoreError::Timeout {
                    ms: bound.as_millis() as u64,
                })
            }
        };
        Ok(acked_by_replicas(&info, &reply))
    }

    /// Whether this Redis may evict keys under memory pressure, from `INFO memory` and
    /// `INFO stats` (every master of a Cluster: the first that may evict, evictions summed).
    pub async fn eviction(&self) -> Result<Eviction, StoreError> {
        let memory = self.info_of_masters("memory").await?;
        let stats = self.info_of_masters("stats").await?;
        let (mut policies, mut limits, mut evicted) = (Vec::new(), Vec::new(), Vec::new());
        info_values(&memory, "maxmemory_policy", &mut policies);
        info_values(&memory, "maxmemory", &mut limits);
        info_values(&stats, "evicted_keys", &mut evicted);
        if policies.is_empty() || policies.len() != limits.len() {
            return Err(StoreError::Protocol {
                reason: "INFO memory reported no maxmemory_policy".into(),
            });
        }
        let number = |v: &String| {
            v.parse::<u64>().map_err(|_| StoreError::Protocol {
                reason: format!("INFO reported a count that is not one: {v}"),
            })
        };
        let nodes = policies
            .into_iter()
            .zip(limits.iter().map(number).collect::<Result<Vec<_>, _>>()?)
            .map(|(policy, maxmemory)| Eviction {
                policy,
                maxmemory_bytes: maxmemory,
                evicted_keys: 0,
            });
        let mut worst = nodes
            .reduce(|a, b| {
                if !a.may_evict() && b.may_evict() {
                    b
                } else {
                    a
                }
            })
            .expect("one node at least");
        worst.evicted_keys = evicted.iter().map(number).sum::<Result<u64, _>>()?;
        Ok(worst)
    }

    /// Every bucket whose parameters this Redis holds, on every master of a Cluster, by `SCAN`:
    /// O(keys in the database), for the agent's sweeps (per store instance and hourly).
    pub(super) async fn params_held(&self) -> Result<Vec<BucketRef>, StoreError> {
        let mut out = Vec::new();
        match &*self.source.load_full() {
            Source::Single(_) | Source::Sentinel(_) => self.scan_params(None, &mut out).await?,
            Source::Cluster(c) => {
                // A command without a reply policy sent to every master answers with a map
                // keyed by each node's address.
                let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                let reply: Value = self.bounded(c.route(redis::cmd("PING"), all)).await?;
                let Value::Map(nodes) = reply else {
                    return Err(StoreError::Protocol {
                        reason: "PING to every master gave no map of nodes".into(),
                    });
                };
                for (addr, _) in nodes {
                    let addr: String = redis::from_redis_value(addr).map_err(|e| protocol(&e))?;
                    let node = addr
                        .rsplit_once(':')
                        .and_then(|(host, port)| Some((host.to_string(), port.parse().ok()?)))
                        .ok_or_else(|| StoreError::Protocol {
                            reason: format!("node address {addr:?}"),
                        })?;
                    self.scan_params(Some(node), &mut out).await?;
                }
            }
        }
        Ok(out)
    }

    /// SCANs one server (a Cluster node by address) for parameters keys into `out`.
    async fn scan_params(
        &self,
        node: Option<(String, u16)>,
        out: &mut Vec<BucketRef>,
    ) -> Result<(), StoreError> {
        let mut cursor: u64 = 0;
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(keys::PARAMS_KEY_PATTERN)
                .arg("COUNT")
                .arg(SCAN_COUNT);
            let reply: Value = match (&*self.source.load_full(), &node) {
                (Source::Cluster(c), Some((host, port))) => {
                    let at = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.clone(),
                        port: *port,
                    });
                    self.bounded(c.route(scan, at)).await?
                }
                _ => self.command(&scan).await?,
            };
            let (next, found): (u64, Vec<String>) =
                redis::from_redis_value(reply).map_err(|e| protocol(&e))?;
            out.extend(found.iter().filter_map(|k| {
                let (tenant, policy, version) = keys::parse_params_key(k)?;
                Some(BucketRef {
                    tenant,
                    policy,
                    version,
                })
            }));
            if next == 0 {
                return Ok(());
            }
            cursor = next;
        }
    }

    /// Reads one field of `INFO` (e.g. `used_memory`) from a standalone server.
    pub async fn info_field(
        &self,
        section: &str,
        field: &str,
    ) -> Result<Option<String>, StoreError> {
        let info: Value = self.command(redis::cmd("INFO").arg(section)).await?;
        let mut values = Vec::new();
        info_values(&info, field, &mut values);
        Ok(values.into_iter().next())
    }
}

/// How long `WAIT` may hold the shared connection for a replica's confirmation (ms).
const WAIT_MS: u64 = 10;

/// The key naming who writes this Redis's parameters (a region's daemons, or one daemon of a
/// single region): a daemon refuses to start on a Redis another writer holds.
const OWNER_KEY: &str = "qd:v1:owner";

/// Sets the owner mark if it is absent or the caller's, with its TTL; returns the mark.
const OWNER_LUA: &str = "local v = redis.call('GET', KEYS[1]) \
if not v or v == ARGV[1] then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return ARGV[1] end \
return v";

/// Deletes the owner mark if it is the caller's.
const RELEASE_OWNER_LUA: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

/// Whether `WAIT`'s `reply` (a count, or a map of counts by master address) shows a replica
/// of every master that `info` (`INFO replication`, one text or a map by address) says has
/// one.
fn acked_by_replicas(info: &Value, reply: &Value) -> bool {
    let count = |v: &Value| redis::from_redis_value::<i64>(v.clone()).ok();
    match (info, reply) {
        (Value::Map(infos), Value::Map(acks)) => infos.iter().all(|(addr, i)| {
            let mut r = Vec::new();
            info_values(i, "connected_slaves", &mut r);
            r.iter().all(|n| n == "0")
                || acks
                    .iter()
                    .any(|(a, n)| a == addr && count(n).is_some_and(|n| n >= 1))
        }),
        (_, v) => count(v).is_some_and(|n| n >= 1),
    }
}

/// The values of every `field:` line in an `INFO` reply: one text, or a map or array of them
/// (one per node of a Cluster).
fn info_values(v: &Value, field: &str, out: &mut Vec<String>) {
    let mut from_text = |text: &str| {
        out.extend(text.lines().filter_map(|l| {
            l.strip_prefix(field)
                .and_then(|rest| rest.strip_prefix(':'))
                .map(|v| v.trim().to_string())
        }));
    };
    match v {
        Value::BulkString(b) => from_text(&String::from_utf8_lossy(b)),
        Value::VerbatimString { text, .. } => from_text(text),
        Value::Array(items) | Value::Set(items) => {
            items.iter().for_each(|i| info_values(i, field, out));
        }
        Value::Map(pairs) => pairs.iter().for_each(|(_, i)| info_values(i, field, out)),
        _ => {}
    }
}

/// Collects the ms of every `TIME` reply (`[seconds, microseconds]`) in `v`: one for a server,
/// one per master of a Cluster (an array or map of replies).
fn time_values(v: &Value, out: &mut Vec<u64>) {
    let number = |v: &Value| match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse::<u64>().ok(),
        Value::Int(n) => u64::try_from(*n).ok(),
        _ => None,
    };
    match v {
        Value::Array(items) => match items.as_slice() {
            [s, us] if number(s).is_some() && number(us).is_some() => {
                let ms = |s: u64, us: u64| s.saturating_mul(1000).saturating_add(us / 1000);
                out.extend(number(s).zip(number(us)).map(|(s, us)| ms(s, us)));
            }
            // Per master: an array of replies, or of `[address, reply]` pairs.
            _ => items.iter().for_each(|i| time_values(i, out)),
        },
        Value::Map(pairs) => pairs.iter().for_each(|(_, i)| time_values(i, out)),
        _ => {}
    }
}

/// Decodes `{taken, key, admitted, denied, …}`; keys this schema did not write are skipped.
fn parse_usage(reply: Vec<Value>) -> Result<(usize, Vec<UsageRecord>), StoreError> {
    let parse = |e: redis::ParsingError| protocol(&e);
    let mut it = reply.into_iter();
    let taken: usize = match it.next() {
        Some(v) => redis::from_redis_value(v).map_err(parse)?,
        None => {
            return Err(StoreError::Protocol {
                reason: "empty usage reply".into(),
            })
        }
    };
    let reply: Vec<Value> = it.collect();
    if !reply.len().is_multiple_of(3) {
        return Err(StoreError::Protocol {
            reason: format!("usage reply of {} items", reply.len()),
        });
    }
    let mut out = Vec::with_capacity(reply.len() / 3);
    let mut it = reply.into_iter();
    while let (Some(k), Some(a), Some(d)) = (it.next(), it.next(), it.next()) {
        let key: String = redis::from_redis_value(k).map_err(parse)?;
        let admitted: u64 = redis::from_redis_value(a).map_err(parse)?;
        let denied: u64 = redis::from_redis_value(d).map_err(parse)?;
        match keys::parse_usage_key(&key) {
            Some((_, tenant, policy, version)) => {
                out.push(UsageRecord {
                    bucket: BucketRef {
                        tenant,
                        policy,
                        version,
                    },
                    admitted,
                    denied,
                });
            }
            None => tracing::warn!("Skipped a foreign key in the activity index."),
        }
    }
    Ok((taken, out))
}
