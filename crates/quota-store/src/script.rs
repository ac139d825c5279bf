//! The Lua scripts (compiled in with `include_str!`), the arguments they take and the replies
//! they give. Each script opens with its KEYS / ARGV / return contract.

use quota_core::keys;
use quota_core::{ChargeOutcome, Decision};

use crate::{
    BucketRef, ChargeRequest, CheckRequest, HoldOutcome, HoldRequest, Limit, MultiCheckRequest,
    SetParams, Settled, SettledLimit, StoreError,
};

/// One token-bucket decision (`lua/token_bucket.lua`).
pub const TOKEN_BUCKET_LUA: &str = include_str!("../../../lua/token_bucket.lua");

/// One sliding-window decision (`lua/sliding_window.lua`).
pub const SLIDING_WINDOW_LUA: &str = include_str!("../../../lua/sliding_window.lua");

/// One atomic decision of several token buckets, all or nothing (`lua/token_buckets.lua`).
pub const TOKEN_BUCKETS_LUA: &str = include_str!("../../../lua/token_buckets.lua");

/// Writes a bucket's parameters and the copy inside its token-bucket state
/// (`lua/set_params.lua`).
pub const SET_PARAMS_LUA: &str = include_str!("../../../lua/set_params.lua");

/// Gives tokens of a reservation back to a token bucket (`lua/refund.lua`).
pub const REFUND_LUA: &str = include_str!("../../../lua/refund.lua");

/// Charges a token bucket for work already done, into bounded debt (`lua/charge.lua`).
pub const CHARGE_LUA: &str = include_str!("../../../lua/charge.lua");

/// Makes a hold: an estimate spent on token buckets, all or nothing, and its record
/// (`lua/hold.lua`).
pub const HOLD_LUA: &str = include_str!("../../../lua/hold.lua");

/// Settles or releases a hold (`lua/settle.lua`).
pub const SETTLE_LUA: &str = include_str!("../../../lua/settle.lua");

/// Drains an activity index (`lua/collect_usage.lua`).
pub const COLLECT_USAGE_LUA: &str = include_str!("../../../lua/collect_usage.lua");

/// The largest `max` `collect_usage.lua` accepts in one call.
pub const COLLECT_BATCH_MAX: usize = 100_000;

/// One script argument as Redis receives it; numbers are written without a `String` each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arg<'a> {
    Str(&'a str),
    Num(u64),
}

impl Arg<'_> {
    /// An upper bound of the bytes it writes, to size the command once.
    pub fn max_len(&self) -> usize {
        match self {
            Arg::Str(s) => s.len(),
            Arg::Num(_) => 20,
        }
    }
}

impl redis::ToRedisArgs for Arg<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        match self {
            Arg::Str(s) => out.write_arg(s.as_bytes()),
            Arg::Num(n) => n.write_redis_args(out),
        }
    }
}

/// The ARGV of a decision script for `req`: cost, fallback pair, explicit now (or `""`),
/// minimum idle TTL, and for a token bucket its refill period: the arguments and how many of
/// them to pass (no allocation on the hot path).
pub fn decision_args<'a>(req: &CheckRequest, min_idle_ttl_ms: &'a str) -> ([Arg<'a>; 6], usize) {
    let (a, b, n, per) = match req.limit {
        Limit::TokenBucket(p) => (p.capacity_ut, p.refill_ut, 6, p.period_ms),
        Limit::SlidingWindow { limit, window_ms } => (limit, window_ms, 5, 0),
        // Refused by CheckRequest::validate: a concurrency limit is taken with holds.
        Limit::Concurrency { limit } => (limit, 0, 5, 0),
    };
    let args = [
        Arg::Num(req.cost),
        Arg::Num(a),
        Arg::Num(b),
        req.now_ms.map_or(Arg::Str(""), Arg::Num),
        Arg::Str(min_idle_ttl_ms),
        Arg::Num(per),
    ];
    (args, n)
}

/// The ARGV of `token_buckets.lua` for `req`: cost, explicit now (or `""`), minimum idle TTL,
/// then each limit's fallback capacity, refill and period.
pub fn multi_args<'a>(req: &MultiCheckRequest, min_idle_ttl_ms: &'a str) -> Vec<Arg<'a>> {
    let mut args = Vec::with_capacity(3 + 3 * req.limits.len());
    args.extend([
        Arg::Num(req.cost),
        req.now_ms.map_or(Arg::Str(""), Arg::Num),
        Arg::Str(min_idle_ttl_ms),
    ]);
    for l in &req.limits {
        match l.limit {
            Limit::TokenBucket(p) => args.extend([
                Arg::Num(p.capacity_ut),
                Arg::Num(p.refill_ut),
                Arg::Num(p.period_ms),
            ]),
            // Refused by MultiCheckRequest::validate; the script answers "no fallback".
            Limit::SlidingWindow { .. } | Limit::Concurrency { .. } => {
                args.extend([Arg::Str(""); 3])
            }
        }
    }
    args
}

/// The ARGV of `charge.lua` for `req`: cost, debt limit, fallback capacity and refill,
/// explicit now (or `""`), minimum idle TTL and fallback period.
pub fn charge_args<'a>(req: &ChargeRequest, min_idle_ttl_ms: &'a str) -> [Arg<'a>; 7] {
    let p = req.params;
    [
        Arg::Num(req.cost),
        Arg::Num(req.debt_limit_ut),
        Arg::Num(p.capacity_ut),
        Arg::Num(p.refill_ut),
        req.now_ms.map_or(Arg::Str(""), Arg::Num),
        Arg::Str(min_idle_ttl_ms),
        Arg::Num(p.period_ms),
    ]
}

/// Decodes `{applied, clamped, remaining, debt, retry_after_ms, reset_ms}` from `charge.lua`
/// for a charge of `cost`; `-1` means "never".
pub fn charge_from_reply(reply: &[i64], cost: u64) -> Result<ChargeOutcome, StoreError> {
    let &[applied, clamped, remaining, debt, retry, reset] = reply else {
        return Err(StoreError::Protocol {
            reason: format!("a charge has 6 fields, got {}", reply.len()),
        });
    };
    let whole = |v: i64| u64::try_from(v).ok();
    let never = |v: i64| if v < 0 { None } else { Some(v as u64) };
    match (
        whole(applied),
        whole(clamped),
        whole(remaining),
        whole(debt),
    ) {
        (Some(a), Some(c), Some(remaining), Some(debt))
            if a.checked_add(c) == Some(cost) && (remaining == 0 || debt == 0) =>
        {
            Ok(ChargeOutcome {
                applied: a,
                clamped: c,
                remaining,
                debt,
                retry_after_ms: never(retry),
                reset_ms: never(reset),
            })
        }
        _ => Err(StoreError::Protocol {
            reason: format!("bad charge fields {reply:?} for a cost of {cost}"),
        }),
    }
}

/// The ARGV of `hold.lua` for `req`: estimate, ttl, explicit now (or `""`), minimum idle TTL,
/// then each limit's fallback capacity, refill, period and debt limit (a concurrency limit:
/// `slots`, its fallback limit, `""` and the debt limit).
pub fn hold_args<'a>(req: &HoldRequest, min_idle_ttl_ms: &'a str) -> Vec<Arg<'a>> {
    let mut args = Vec::with_capacity(4 + 4 * req.limits.len());
    args.extend([
        Arg::Num(req.cost),
        Arg::Num(req.ttl_ms),
        req.now_ms.map_or(Arg::Str(""), Arg::Num),
        Arg::Str(min_idle_ttl_ms),
    ]);
    for l in &req.limits {
        match l.limit {
            Limit::TokenBucket(p) => args.extend([
                Arg::Num(p.capacity_ut),
                Arg::Num(p.refill_ut),
                Arg::Num(p.period_ms),
            ]),
            Limit::Concurrency { limit } => {
                args.extend([Arg::Str("slots"), Arg::Num(limit), Arg::Str("")])
            }
            // Refused by HoldRequest::validate; the script refuses an empty fallback.
            Limit::SlidingWindow { .. } => args.extend([Arg::Str(""); 3]),
        }
        args.push(Arg::Num(l.debt_limit_ut));
    }
    args
}

/// Decodes `{held, expires_at_ms, replayed, 4 fields per limit}` from `hold.lua` for `n`
/// limits.
pub fn hold_from_reply(reply: &[i64], n: usize) -> Result<HoldOutcome, StoreError> {
    let [held, expires, replayed, fields @ ..] = reply else {
        return Err(StoreError::Protocol {
            reason: format!("a hold reply has 3 fields and more, got {}", reply.len()),
        });
    };
    let flag = |v: i64| match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(StoreError::Protocol {
            reason: format!("bad hold flag {v}"),
        }),
    };
    let decisions = decisions_from_reply(fields, n)?;
    let held = flag(*held)?;
    if held && !decisions.iter().all(|d| d.allowed) {
        return Err(StoreError::Protocol {
            reason: "a hold held on a limit that denied".into(),
        });
    }
    Ok(HoldOutcome {
        decisions,
        held,
        expires_at_ms: u64::try_from(*expires).map_err(|_| StoreError::Protocol {
            reason: format!("bad hold expiry {expires}"),
        })?,
        replayed: flag(*replayed)?,
    })
}

/// The ARGV of `settle.lua`: `settle` and the actual cost, or `release` and `""`; the
/// explicit now (or `""`); the minimum idle TTL.
pub fn settle_args<'a>(
    cost: Option<u64>,
    now_ms: Option<u64>,
    min_idle_ttl_ms: &'a str,
) -> [Arg<'a>; 4] {
    [
        Arg::Str(if cost.is_some() { "settle" } else { "release" }),
        cost.map_or(Arg::Str(""), Arg::Num),
        now_ms.map_or(Arg::Str(""), Arg::Num),
        Arg::Str(min_idle_ttl_ms),
    ]
}

/// Decodes `settle.lua`'s reply: `{0}` unknown; `{1, replayed, 6 fields per limit}` done;
/// `{2, expired_at_ms}` expired; `{3, why}` a conflict.
pub fn settled_from_reply(reply: &[redis::Value]) -> Result<Settled, StoreError> {
    let bad = |what: &str| StoreError::Protocol {
        reason: format!("a settle reply {what}"),
    };
    let int = |v: &redis::Value| match v {
        redis::Value::Int(n) => u64::try_from(*n).ok(),
        _ => None,
    };
    match reply {
        [redis::Value::Int(0)] => Ok(Settled::Unknown),
        [redis::Value::Int(2), at] => Ok(Settled::Expired {
            expired_at_ms: int(at).ok_or_else(|| bad("with a bad expiry"))?,
        }),
        [redis::Value::Int(3), why] => match why {
            redis::Value::BulkString(b) => {
                Ok(Settled::Conflict(String::from_utf8_lossy(b).into_owned()))
            }
            _ => Err(bad("with a conflict that is not text")),
        },
        [redis::Value::Int(1), replayed, rest @ ..] if !rest.is_empty() && rest.len() % 6 == 0 => {
            let replayed = match int(replayed) {
                Some(0) => false,
                Some(1) => true,
                _ => return Err(bad("with a bad replay flag")),
            };
            let mut limits = Vec::with_capacity(rest.len() / 6);
            for f in rest.chunks_exact(6) {
                let redis::Value::BulkString(k) = &f[0] else {
                    return Err(bad("without a state key"));
                };
                let key = std::str::from_utf8(k).map_err(|_| bad("with a key not UTF-8"))?;
                let (_, tenant, policy, version) =
                    keys::parse_state_key(key).ok_or_else(|| bad("with a foreign key"))?;
                let n: Vec<u64> = f[1..]
                    .iter()
                    .map(int)
                    .collect::<Option<_>>()
                    .ok_or_else(|| bad("with a bad count"))?;
                limits.push(SettledLimit {
                    bucket: BucketRef {
                        tenant,
                        policy,
                        version,
                    },
                    charged: n[0],
                    clamped: n[1],
                    refunded: n[2],
                    remaining: n[3],
                    debt: n[4],
                });
            }
            Ok(Settled::Done { limits, replayed })
        }
        _ => Err(bad(&format!("of {} fields", reply.len()))),
    }
}

/// Decodes the 4 fields of each of `n` limits from `token_buckets.lua`.
pub fn decisions_from_reply(reply: &[i64], n: usize) -> Result<Vec<Decision>, StoreError> {
    if reply.len() != 4 * n {
        return Err(StoreError::Protocol {
            reason: format!("{n} limits give {} fields, got {}", 4 * n, reply.len()),
        });
    }
    reply.chunks_exact(4).map(decision_from_reply).collect()
}

/// The ARGV of `set_params.lua` for `req`: the limit's field pairs, the minimum idle TTL,
/// the lease (remaining ms and floor pair, or empty), the explicit now (or empty), for a
/// token bucket the refill period, the latest lease end (or empty), and the fence's token and
/// epoch (or empty).
pub fn set_params_args(req: &SetParams, min_idle_ttl_ms: &str) -> Vec<String> {
    // A concurrency limit has one value: its second is empty.
    let pair = |l: Limit| match l {
        Limit::TokenBucket(p) => (p.capacity_ut.to_string(), p.refill_ut.to_string()),
        Limit::SlidingWindow { limit, window_ms } => (limit.to_string(), window_ms.to_string()),
        Limit::Concurrency { limit } => (limit.to_string(), String::new()),
    };
    let (f1, f2) = match req.limit {
        Limit::TokenBucket(_) => ("cap", "rate"),
        Limit::SlidingWindow { .. } => ("limit", "window"),
        Limit::Concurrency { .. } => ("slots", ""),
    };
    let (v1, v2) = pair(req.limit);
    let (lease, g1, g2, not_after) = match req.lease {
        Some(l) => {
            let (g1, g2) = pair(l.floor);
            (
                l.remaining_ms.to_string(),
                g1,
                g2,
                l.not_after_ms.map(|n| n.to_string()).unwrap_or_default(),
            )
        }
        None => Default::default(),
    };
    vec![
        f1.to_string(),
        v1,
        f2.to_string(),
        v2,
        min_idle_ttl_ms.to_string(),
        lease,
        g1,
        g2,
        req.now_ms.map(|n| n.to_string()).unwrap_or_default(),
        match req.limit {
            Limit::TokenBucket(p) => p.period_ms.to_string(),
            Limit::SlidingWindow { .. } | Limit::Concurrency { .. } => String::new(),
        },
        not_after,
        req.fence.map(|f| f.token.to_string()).unwrap_or_default(),
        req.fence.map(|f| f.epoch.to_string()).unwrap_or_default(),
    ]
}

/// Decodes a reservation's reply: the 4 fields of a decision, then the multiples spent.
pub fn reservation_from_reply(reply: &[i64]) -> Result<(Decision, u64), StoreError> {
    let [fields @ .., granted] = reply else {
        return Err(StoreError::Protocol {
            reason: "an empty reservation reply".into(),
        });
    };
    let d = decision_from_reply(fields)?;
    match u64::try_from(*granted) {
        Ok(g) if (g > 0) == d.allowed || g == 0 => Ok((d, g)),
        _ => Err(StoreError::Protocol {
            reason: format!("bad reservation multiples {granted}"),
        }),
    }
}

/// Decodes `{allowed, remaining, retry_after_ms, reset_ms}`; `-1` means "never".
pub fn decision_from_reply(reply: &[i64]) -> Result<Decision, StoreError> {
    let &[allowed, remaining, retry, reset] = reply else {
        return Err(StoreError::Protocol {
            reason: format!("a decision has 4 fields, got {}", reply.len()),
        });
    };
    let never = |v: i64| if v < 0 { None } else { Some(v as u64) };
    if !(0..=1).contains(&allowed) || remaining < 0 {
        return Err(StoreError::Protocol {
            reason: format!("bad decision fields {allowed} / {remaining}"),
        });
    }
    Ok(Decision {
        allowed: allowed == 1,
        remaining: remaining as u64,
        retry_after_ms: never(retry),
        reset_ms: never(reset),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_decode_with_never_as_none() {
        let d = decision_from_reply(&[0, 3, -1, 250]).unwrap();
        assert_eq!(
            d,
            Decision {
                allowed: false,
                remaining: 3,
                retry_after_ms: None,
                reset_ms: Some(250)
            }
        );
        assert!(decision_from_reply(&[1, 2, 3]).is_err());
        assert!(decision_from_reply(&[2, 0, 0, 0]).is_err());
    }

    #[test]
    fn charge_replies_add_up_to_the_cost() {
        let o = charge_from_reply(&[3, 2, 0, 8, -1, 12_000], 5).unwrap();
        assert_eq!((o.applied, o.clamped, o.debt), (3, 2, 8));
        assert_eq!((o.retry_after_ms, o.reset_ms), (None, Some(12_000)));
        assert!(charge_from_reply(&[3, 2, 0, 8, -1, 0], 6).is_err());
        assert!(charge_from_reply(&[3, 2, 1, 8, 0, 0], 5).is_err());
        assert!(charge_from_reply(&[-1, 6, 0, 0, 0, 0], 5).is_err());
        assert!(charge_from_reply(&[5, 0, 0, 0, 0], 5).is_err());
    }

    #[test]
    fn every_script_states_its_contract() {
        for s in [
            TOKEN_BUCKET_LUA,
            TOKEN_BUCKETS_LUA,
            SLIDING_WINDOW_LUA,
            COLLECT_USAGE_LUA,
            SET_PARAMS_LUA,
            REFUND_LUA,
            CHARGE_LUA,
            HOLD_LUA,
            SETTLE_LUA,
        ] {
            assert!(s.contains("KEYS[1]") && s.contains("ARGV[1]") && s.contains("returns"));
        }
    }
}
