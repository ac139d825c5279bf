//! The numeric bounds of quotad, defined once: policy validation (`policy`), the reference
//! bucket and window (`bucket`, `window`) and the Lua scripts (a
//! test in quota-store holds the scripts' copies equal to these) all use them, so nothing a
//! policy `PUT` accepts can fail when it is decided. A leaf: it imports nothing from the crate.
//!
//! Lua numbers are doubles, exact for integers below 2^53; every bound keeps the scripts'
//! intermediates there.

/// Micro-tokens per token.
pub const UT: u64 = 1_000_000;

/// Parts per million: shares and floors are fractions of a budget in these units, so every
/// replica and the Lua script compute with integers.
pub const PPM: u32 = 1_000_000;

/// The largest capacity in micro-tokens: 2^53 − 1, the last integer a double holds exactly.
/// Also the bound of every time and TTL in ms the scripts take.
pub const MAX_CAPACITY_UT: u64 = (1 << 53) - 1;

/// The largest whole-budget refill rate of a policy in micro-tokens per second (policy
/// validation): 9 · 10^6 tokens a second.
pub const MAX_RATE_UT_PER_S: u64 = MAX_CAPACITY_UT / 1000;

/// The largest refill amount of a bucket in micro-tokens per period: a bucket refills
/// `refill_ut` every `period_ms` (a policy's share refills `share · limit` µt per window).
pub const MAX_REFILL_UT: u64 = MAX_CAPACITY_UT;

/// The longest refill period of a bucket, in ms: the longest window. Below 2^32, so the
/// scripts multiply two numbers below the period exactly by splitting one at 2^16.
pub const MAX_PERIOD_MS: u64 = MAX_WINDOW_MS;

/// The refill period of parameters given as micro-tokens per second (and of every state and
/// parameter hash written without a period).
pub const DEFAULT_PERIOD_MS: u64 = 1000;

/// Bounds the fill time of a bucket: `floor(capacity / refill) · period` stays below this, so
/// filling an empty bucket takes under `MAX_FILL_BOUND_MS + MAX_PERIOD_MS` < 2^44 ms and every
/// wait a script computes is exact (its first estimate in doubles is off by less than 1 ms).
pub const MAX_FILL_BOUND_MS: u64 = 9_000_000_000_000;

/// The longest wait a bucket reports, in ms (2^51, about 71 000 years): a wait beyond it (only
/// a deep debt at a slow refill comes near) reads as never. Half of 2^52 and more, so the
/// scripts' first estimate of a longer wait in doubles (off by less than 1 ms up to here) tells
/// it apart exactly.
pub const MAX_WAIT_MS: u64 = 1 << 51;

/// The largest burst, and the largest cost of one request, in whole tokens: its capacity in
/// micro-tokens must stay exact in a double.
pub const MAX_BURST: u64 = MAX_CAPACITY_UT / UT;

/// The most limits one check may decide together (one token bucket each, all in one hash
/// slot): each adds two keys and three arguments to one script call.
pub const MAX_LIMITS_PER_CHECK: u64 = 16;

/// The longest window of either algorithm: 31 days.
pub const MAX_WINDOW_MS: u64 = 31 * 24 * 3_600_000;

/// The longest an empty bucket may take to fill: beyond this a policy is a typo.
pub const MAX_FILL_MS: u64 = 10 * 365 * 24 * 3600 * 1000;

/// The largest sliding-window limit, in tokens.
pub const MAX_WINDOW_LIMIT: u64 = 1_000_000_000;

/// The largest sliding-window `limit · window_ms`: the script sums three such terms (the
/// previous window's weight, the current count with the cost), which stays below 2^53. A
/// 31-day window holds up to 840 725 tokens.
pub const MAX_WINDOW_PRODUCT: u64 = 1 << 51;

/// The largest sliding-window limit kept as an exact log; above it sub-window counters apply.
pub const EXACT_LOG_MAX: u64 = 128;

// The bounds keep the scripts' arithmetic below 2^53; checked when the crate compiles.
const _: () = {
    assert!(MAX_BURST * UT <= MAX_CAPACITY_UT);
    assert!(MAX_BURST * PPM as u64 <= MAX_CAPACITY_UT);
    assert!(MAX_RATE_UT_PER_S * 1000 <= MAX_CAPACITY_UT);
    // A policy's share refills share · limit µt per window.
    assert!(MAX_BURST * PPM as u64 <= MAX_REFILL_UT);
    assert!(MAX_PERIOD_MS < 1 << 32);
    assert!(MAX_FILL_BOUND_MS + MAX_PERIOD_MS < 1 << 44);
    // Every wait of a bucket out of debt is reported: filling takes under 2^44 ms.
    assert!(1 << 44 < MAX_WAIT_MS && MAX_WAIT_MS + 4 < 1 << 52);
    // Every policy's fill time is within the bucket bound.
    assert!(MAX_FILL_MS < MAX_FILL_BOUND_MS);
    // prev·(w − off) + (cur + cost)·w with prev, cur, cost ≤ limit.
    assert!(3 * MAX_WINDOW_PRODUCT < 1 << 53);
    assert!(MAX_WINDOW_PRODUCT / MAX_WINDOW_MS == 840_725);
};

/// How long `refund.lua`, `charge.lua` and `collect_usage.lua` keep the key that makes one call
/// apply once (a refund's or a charge's marker, a collection's reply), in ms: a retry of the call (the store's own, or a
/// Cluster client's) comes within the store's timeout, which configuration keeps below this.
pub const ONCE_KEY_MS: u64 = 10_000;

/// The longest a hold lives unsettled, in ms (1 h): also the longest a holder keeps a slot of
/// a concurrency limit, so a crashed holder's slot always comes back within it.
pub const MAX_HOLD_TTL_MS: u64 = 3_600_000;

/// How long a hold's record is kept after the hold ended (settled, released, or expired
/// unsettled), in ms (10 min): a retried or late settle within it gets a clear answer (the
/// same result, a conflict, or "expired"), and "unknown" only after it.
pub const HOLD_MEMORY_MS: u64 = 600_000;

/// The longest hold id, in characters (`[A-Za-z0-9_-]`): it is part of the record's key.
pub const MAX_HOLD_ID_LEN: usize = 64;
