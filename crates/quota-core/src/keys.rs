//! The Redis key schema. Versioned (`qd:v1:`) so a future layout can live beside this one, and
//! hash-tagged by tenant (`{tenant}`) so all of a tenant's keys share one Redis Cluster slot and
//! one script can touch them atomically.
//!
//! ```text
//! qd:v1:{<tenant>}:<policy>:<version>:b   token-bucket state (packed string), expires when idle
//! qd:v1:{<tenant>}:<policy>:<version>:w   sliding-window state (hash), expires when idle
//! qd:v1:{<tenant>}:<policy>:<version>:c   a concurrency limit's slots (sorted set of hold ids
//!                                         scored by their expiry), expires with the last
//! qd:v1:{<tenant>}:<policy>:<version>:cu  its usage (hash: ad, dn acquisitions admitted and
//!                                         denied), listed in the activity index
//! qd:v1:{<tenant>}:<policy>:<version>:p   this region's parameters (hash), no TTL; written by
//!                                         lua/set_params.lua, which updates the bucket's copy
//! qd:v1:active                            activity index (set of state keys), standalone Redis
//! qd:v1:{<slot tag>}:active               activity index of one cluster slot
//! ```
//!
//! The activity index lists the state keys that decided anything since the last usage
//! collection, so a collection costs O(active buckets). On Redis Cluster a script may only touch
//! keys of one slot, so there is one index per slot, named with a short tag hashing to that slot
//! ([`slot_tag`]).

use crate::ids::{PolicyName, TenantId};

/// The schema version in every key.
pub const PREFIX: &str = "qd:v1:";

/// The activity index on a standalone Redis.
pub const ACTIVE_INDEX: &str = "qd:v1:active";

/// Number of Redis Cluster hash slots.
pub const SLOTS: u16 = 16384;

/// What a state key holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StateKind {
    /// A token bucket (`:b`).
    Bucket,
    /// A sliding window (`:w`).
    Window,
    /// A concurrency limit's slots (`:c`): the holds in flight, scored by their expiry. Its
    /// usage counters sit beside them ([`slots_usage_key`]).
    Slots,
}

impl StateKind {
    fn suffix(self) -> &'static str {
        match self {
            Self::Bucket => "b",
            Self::Window => "w",
            Self::Slots => "c",
        }
    }
}

fn key(tenant: &TenantId, policy: &PolicyName, version: u64, kind: &str) -> String {
    // Built in one allocation of the right size, without `core::fmt`: two keys are built for
    // every decision, and `format!` grows its string as it goes.
    let (t, p) = (tenant.as_str(), policy.as_str());
    let mut k = String::with_capacity(PREFIX.len() + t.len() + p.len() + kind.len() + 25);
    k.push_str(PREFIX);
    k.push('{');
    k.push_str(t);
    k.push_str("}:");
    k.push_str(p);
    k.push(':');
    k.push_str(itoa::Buffer::new().format(version));
    k.push(':');
    k.push_str(kind);
    k
}

/// The bucket-state key of a tenant's policy.
pub fn bucket_key(tenant: &TenantId, policy: &PolicyName, version: u64) -> String {
    key(tenant, policy, version, "b")
}

/// The sliding-window state key of a tenant's policy.
pub fn window_key(tenant: &TenantId, policy: &PolicyName, version: u64) -> String {
    key(tenant, policy, version, "w")
}

/// The state key of either kind.
pub fn state_key(kind: StateKind, tenant: &TenantId, policy: &PolicyName, version: u64) -> String {
    key(tenant, policy, version, kind.suffix())
}

/// The usage counters of a concurrency limit, beside its slots: a sorted set cannot also hold
/// them.
pub fn slots_usage_key(tenant: &TenantId, policy: &PolicyName, version: u64) -> String {
    key(tenant, policy, version, "cu")
}

/// The bucket-parameters key of a tenant's policy, beside its bucket.
pub fn params_key(tenant: &TenantId, policy: &PolicyName, version: u64) -> String {
    key(tenant, policy, version, "p")
}

/// The part of a hold record's key where a bucket key has its policy: `~` is in no policy
/// name, so [`parse_state_key`] and [`parse_params_key`] never read a record as a bucket's key,
/// and with one `:` fewer than a bucket key it never matches [`PARAMS_KEY_PATTERN`].
pub const HOLD_MARK: &str = "~h";

/// The key of a tenant's hold record, in the tenant's hash slot beside its buckets. `id` is a
/// hold id (`[A-Za-z0-9_-]`, see `hold::valid_id`).
pub fn hold_key(tenant: &TenantId, id: &str) -> String {
    format!("{PREFIX}{{{}}}:{HOLD_MARK}:{id}", tenant.as_str())
}

/// Splits a bucket key into tenant, policy, version and suffix; `None` for anything this
/// schema did not write.
fn parse_key(k: &str) -> Option<(TenantId, PolicyName, u64, &str)> {
    let rest = k.strip_prefix(PREFIX)?.strip_prefix('{')?;
    let (tenant, rest) = rest.split_once("}:")?;
    let (policy, rest) = rest.split_once(':')?;
    let (version, suffix) = rest.split_once(':')?;
    // Reject leading zeros or signs so parsing is the exact inverse of formatting.
    let version_num: u64 = version.parse().ok()?;
    if version_num.to_string() != version {
        return None;
    }
    Some((
        TenantId::new(tenant).ok()?,
        PolicyName::new(policy).ok()?,
        version_num,
        suffix,
    ))
}

/// Parses a state key back into its parts; `None` for anything this schema did not write.
pub fn parse_state_key(k: &str) -> Option<(StateKind, TenantId, PolicyName, u64)> {
    let (tenant, policy, version, suffix) = parse_key(k)?;
    let kind = match suffix {
        "b" => StateKind::Bucket,
        "w" => StateKind::Window,
        "c" => StateKind::Slots,
        _ => return None,
    };
    Some((kind, tenant, policy, version))
}

/// Parses a key the activity index lists (a token-bucket or window state, a concurrency
/// limit's usage counters) back into its kind, tenant, policy and version; `None` for
/// anything else.
pub fn parse_usage_key(k: &str) -> Option<(StateKind, TenantId, PolicyName, u64)> {
    let (tenant, policy, version, suffix) = parse_key(k)?;
    let kind = match suffix {
        "b" => StateKind::Bucket,
        "w" => StateKind::Window,
        "cu" => StateKind::Slots,
        _ => return None,
    };
    Some((kind, tenant, policy, version))
}

/// The glob matching every parameters key (for `SCAN … MATCH`); [`parse_params_key`] tells
/// the real ones from look-alikes.
pub const PARAMS_KEY_PATTERN: &str = "qd:v1:{*}:*:*:p";

/// Parses a parameters key back into tenant, policy and version; `None` for anything else.
pub fn parse_params_key(k: &str) -> Option<(TenantId, PolicyName, u64)> {
    match parse_key(k)? {
        (tenant, policy, version, "p") => Some((tenant, policy, version)),
        _ => None,
    }
}

/// The Redis Cluster slot of a key (CRC16/XMODEM of its hash tag, modulo 16384).
pub fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        let close = bytes[open + 1..].iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &bytes[open + 1..open + 1 + close])
    });
    crc16_xmodem(tagged.unwrap_or(bytes)) % SLOTS
}

/// A short hash tag whose slot is `slot`: the first of `0, 1, 2, …` (in base 36) that lands
/// there. Every slot has one within a few hundred thousand candidates.
pub fn slot_tag(slot: u16) -> String {
    let slot = slot % SLOTS;
    let mut n: u64 = 0;
    loop {
        let tag = base36(n);
        if crc16_xmodem(tag.as_bytes()) % SLOTS == slot {
            return tag;
        }
        n += 1;
    }
}

/// The tags of every slot at once (index = slot), in one pass over the candidates.
pub fn slot_tags() -> Vec<String> {
    let mut tags = vec![String::new(); usize::from(SLOTS)];
    let mut missing = usize::from(SLOTS);
    let mut n: u64 = 0;
    while missing > 0 {
        let tag = base36(n);
        let slot = usize::from(crc16_xmodem(tag.as_bytes()) % SLOTS);
        if tags[slot].is_empty() {
            tags[slot] = tag;
            missing -= 1;
        }
        n += 1;
    }
    tags
}

/// The activity index of one cluster slot, given its tag from [`slot_tag`] or [`slot_tags`].
pub fn slot_index_key_for_tag(tag: &str) -> String {
    format!("{PREFIX}{{{tag}}}:active")
}

/// The activity index of one cluster slot.
pub fn slot_index_key(slot: u16) -> String {
    slot_index_key_for_tag(&slot_tag(slot))
}

fn base36(mut n: u64) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).unwrap_or_default()
}

/// CRC16/XMODEM (poly 0x1021, init 0), the checksum Redis Cluster uses for slots.
fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_versioned_and_hash_tagged() {
        let t = TenantId::new("acme").unwrap();
        let p = PolicyName::new("writes").unwrap();
        assert_eq!(bucket_key(&t, &p, 3), "qd:v1:{acme}:writes:3:b");
        assert_eq!(window_key(&t, &p, 3), "qd:v1:{acme}:writes:3:w");
        assert_eq!(params_key(&t, &p, 3), "qd:v1:{acme}:writes:3:p");
    }

    #[test]
    fn state_keys_parse_back() {
        let t = TenantId::new("a-b_c").unwrap();
        let p = PolicyName::new("login").unwrap();
        for kind in [StateKind::Bucket, StateKind::Window, StateKind::Slots] {
            let k = state_key(kind, &t, &p, 42);
            assert_eq!(parse_state_key(&k), Some((kind, t.clone(), p.clone(), 42)));
        }
        // The activity index lists bucket and window states and a concurrency limit's usage.
        let u = slots_usage_key(&t, &p, 42);
        assert_eq!(u, "qd:v1:{a-b_c}:login:42:cu");
        assert_eq!(
            parse_usage_key(&u),
            Some((StateKind::Slots, t.clone(), p.clone(), 42))
        );
        assert_eq!(parse_state_key(&u), None);
        let b = bucket_key(&t, &p, 42);
        assert_eq!(parse_usage_key(&b), parse_state_key(&b));
        assert_eq!(
            parse_usage_key(&state_key(StateKind::Slots, &t, &p, 42)),
            None
        );
        for bad in [
            "qd:v1:{acme}:writes:3:p",
            "qd:v1:{acme}:writes:03:b",
            "qd:v1:{ac me}:writes:3:b",
            "qd:v2:{acme}:writes:3:b",
            "qd:v1:active",
            "",
        ] {
            assert_eq!(parse_state_key(bad), None, "{bad}");
        }
    }

    #[test]
    fn params_keys_parse_back() {
        let t = TenantId::new("a-b_c").unwrap();
        let p = PolicyName::new("login").unwrap();
        let k = params_key(&t, &p, 7);
        assert_eq!(parse_params_key(&k), Some((t.clone(), p.clone(), 7)));
        for bad in [
            bucket_key(&t, &p, 7).as_str(),
            "qd:v1:{acme}:writes:07:p",
            "qd:v1:{acme}:writes:-7:p",
            "qd:v1:{acme}:writes:7:p:x",
            "qd:v1:{acme}::7:p",
            "qd:v1:{acme:writes:7:p",
            "qd:v2:{acme}:writes:7:p",
            "qd:v1:active",
        ] {
            assert_eq!(parse_params_key(bad), None, "{bad}");
        }
        // The SCAN pattern is a glob over exactly these keys' shape.
        assert!(PARAMS_KEY_PATTERN.starts_with(PREFIX) && PARAMS_KEY_PATTERN.ends_with(":p"));
    }

    /// Redis `SCAN … MATCH` globbing for patterns of literals and `*` (all the schema uses).
    fn glob(pattern: &str, key: &str) -> bool {
        match pattern.split_once('*') {
            None => pattern == key,
            Some((head, rest)) => {
                let Some(key) = key.strip_prefix(head) else {
                    return false;
                };
                (0..=key.len())
                    .filter(|&i| key.is_char_boundary(i))
                    .any(|i| glob(rest, &key[i..]))
            }
        }
    }

    #[test]
    fn hold_records_are_never_read_as_buckets() {
        let t = TenantId::new("acme").unwrap();
        let p = PolicyName::new("p").unwrap();
        assert!(glob(PARAMS_KEY_PATTERN, &params_key(&t, &p, 1)));
        for id in ["p", "x", "a-b_c", "1", &"p".repeat(64)] {
            let k = hold_key(&t, id);
            assert_eq!(k, format!("qd:v1:{{acme}}:~h:{id}"));
            assert_eq!(parse_state_key(&k), None, "{k}");
            assert_eq!(parse_params_key(&k), None, "{k}");
            assert!(!glob(PARAMS_KEY_PATTERN, &k), "{k}");
            assert_eq!(key_slot(&k), key_slot(&bucket_key(&t, &p, 1)));
        }
        assert!(PolicyName::new(HOLD_MARK).is_err());
    }

    #[test]
    fn slots_match_redis_cluster() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16_xmodem(b"123456789"), 0x31C3);
        assert_eq!(key_slot("foo"), 12182);
        assert_eq!(key_slot("{user1000}.following"), key_slot("user1000"));
        assert_eq!(key_slot("foo{}{bar}"), key_slot("foo{}{bar}")); // empty tag: whole key
        assert_eq!(key_slot("foo{{bar}}zap"), key_slot("{bar"));
    }

    #[test]
    fn slot_tags_land_on_their_slot() {
        for slot in [0, 1, 5000, 12182, SLOTS - 1] {
            let k = slot_index_key(slot);
            assert_eq!(key_slot(&k), slot, "{k}");
        }
        let t = TenantId::new("acme").unwrap();
        let p = PolicyName::new("writes").unwrap();
        let b = bucket_key(&t, &p, 1);
        assert_eq!(key_slot(&slot_index_key(key_slot(&b))), key_slot(&b));
        let all = slot_tags();
        assert_eq!(all[5000], slot_tag(5000));
        assert!(all
            .iter()
            .enumerate()
            .all(|(i, t)| key_slot(&slot_index_key_for_tag(t)) as usize == i));
    }
}
