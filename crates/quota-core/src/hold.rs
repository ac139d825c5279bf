//! Holds: an estimated cost reserved now on token buckets and settled later with the actual
//! cost (LLM tokens, known only once a response ends). The reference that `lua/hold.lua`,
//! `lua/settle.lua` and the embedded store compute; a differential test holds them equal.
//!
//! ```text
//! create(id, limits, estimate, ttl)
//!   a live record of id:  the same request → answered again (replayed), nothing changes;
//!                         another request  → refused (an id names one hold)
//!   else decide_all(estimate): admitted → spent on every bucket, record open until now + ttl
//!                              denied   → no record; the denial counted as a check's
//! settle(actual) | release (give the whole estimate back)
//!   no live record                  → unknown
//!   open, now < expires_at          → each bucket: actual > estimate charges the excess
//!                                     (bucket::charge, into debt); actual < estimate refunds
//!                                     the difference (bucket::refund); the record ends
//!   open, now ≥ expires_at          → expired: the estimate stays spent, nothing changes
//!   settled / released              → the same call again: its results (replayed);
//!                                     any other: conflict
//! a record is forgotten HOLD_MEMORY_MS after its hold ended (its expiry while open)
//! ```
//!
//! An expired estimate stays spent because the work it covered may have been done; the
//! holder's retry, a late settle, within [`HOLD_MEMORY_MS`] is told so rather than "unknown".

use crate::bounds::{HOLD_MEMORY_MS, MAX_BURST, MAX_CAPACITY_UT, MAX_HOLD_ID_LEN};
use crate::bucket::{self, BucketParams, BucketState};

/// Whether `id` can name a hold: 1 to [`MAX_HOLD_ID_LEN`] of `A-Z a-z 0-9 _ -` (it is part of
/// the record's Redis key).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_HOLD_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Where a hold is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Made; until its expiry it can be settled or released.
    Open,
    /// Settled at `actual` tokens.
    Settled { actual: u64 },
    /// Given back whole.
    Released,
}

/// What ending a hold did to one of its token buckets, in whole tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BucketResult {
    /// Of the excess over the estimate, what the bucket took (into debt if need be).
    pub charged: u64,
    /// Of the excess, what the debt limit kept the bucket from taking (counted as denied).
    pub clamped: u64,
    /// Given back: the estimate less the actual cost (a bucket that filled meanwhile keeps
    /// none of it above its capacity, as a refund).
    pub refunded: u64,
    /// Tokens left after (0 in debt).
    pub remaining: u64,
    /// Tokens owed after, rounded up.
    pub debt: u64,
}

impl BucketResult {
    /// A concurrency hold's result: its slot given back (`refunded` 1), `remaining` slots free
    /// after.
    pub fn slot_freed(remaining: u64) -> Self {
        Self {
            refunded: 1,
            remaining,
            ..Self::default()
        }
    }
}

/// A hold's record: its request (limits `L`, estimate, TTL), its phase and, once ended, what
/// it did to each bucket (answered again to a repeated settle or release).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldRecord<L> {
    pub limits: Vec<L>,
    /// The estimate, whole tokens.
    pub cost: u64,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
    /// From this time on the record is gone: `expires_at + HOLD_MEMORY_MS` while open,
    /// `HOLD_MEMORY_MS` after it ended otherwise.
    pub forget_at_ms: u64,
    pub phase: Phase,
    /// One per limit once ended; empty while open.
    pub results: Vec<BucketResult>,
}

impl<L> HoldRecord<L> {
    /// The record of a hold made at `now_ms`.
    pub fn open(now_ms: u64, limits: Vec<L>, cost: u64, ttl_ms: u64) -> Self {
        let expires_at_ms = now_ms.saturating_add(ttl_ms);
        Self {
            limits,
            cost,
            ttl_ms,
            expires_at_ms,
            forget_at_ms: expires_at_ms.saturating_add(HOLD_MEMORY_MS),
            phase: Phase::Open,
            results: Vec::new(),
        }
    }

    /// Whether the record is still kept at `now_ms`.
    pub fn live_at(&self, now_ms: u64) -> bool {
        now_ms < self.forget_at_ms
    }

    /// The record after `what` applied at `now_ms` with `results`, kept [`HOLD_MEMORY_MS`].
    pub fn ended(self, now_ms: u64, what: Finish, results: Vec<BucketResult>) -> Self {
        Self {
            phase: match what {
                Finish::Settle { actual } => Phase::Settled { actual },
                Finish::Release => Phase::Released,
            },
            results,
            forget_at_ms: now_ms.saturating_add(HOLD_MEMORY_MS),
            ..self
        }
    }
}

/// What a create meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Create {
    /// No live record of the id: decide it.
    Fresh,
    /// The same request made it before: answer it again, change nothing.
    Replay { expires_at_ms: u64 },
    /// The id names a hold of another request.
    Refused,
}

/// Why a create is refused ([`Create::Refused`]): the stores answer this.
pub const HOLD_ID_TAKEN: &str = "this hold id names a hold of another request";

/// What a create of `limits`, `cost` and `ttl_ms` under an id meets at `now_ms`, given the
/// id's record.
pub fn create<L: PartialEq>(
    now_ms: u64,
    record: Option<&HoldRecord<L>>,
    limits: &[L],
    cost: u64,
    ttl_ms: u64,
) -> Create {
    match record.filter(|r| r.live_at(now_ms)) {
        None => Create::Fresh,
        Some(r) if r.cost == cost && r.ttl_ms == ttl_ms && r.limits == limits => Create::Replay {
            expires_at_ms: r.expires_at_ms,
        },
        Some(_) => Create::Refused,
    }
}

/// How a hold ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// At the actual cost, whole tokens (at most [`MAX_BURST`]).
    Settle { actual: u64 },
    /// Nothing used: the whole estimate goes back.
    Release,
}

impl Finish {
    /// The actual cost it settles at (a release: 0).
    pub fn actual(self) -> u64 {
        match self {
            Self::Settle { actual } => actual,
            Self::Release => 0,
        }
    }
}

/// What a settle or release meets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Open and live: apply it to every bucket ([`settle_bucket`]), then [`HoldRecord::ended`].
    Apply,
    /// The same call ended it before: these results, nothing changes.
    Replay(Vec<BucketResult>),
    /// No such hold (never made, or forgotten).
    Unknown,
    /// Open past its expiry: the estimate stays spent, nothing changes.
    Expired { expired_at_ms: u64 },
    /// Ended otherwise before; nothing changes.
    Conflict(String),
}

/// What `what` meets at `now_ms`, given the hold's record.
pub fn finish<L>(now_ms: u64, record: Option<&HoldRecord<L>>, what: Finish) -> Verdict {
    let Some(r) = record.filter(|r| r.live_at(now_ms)) else {
        return Verdict::Unknown;
    };
    match (r.phase, what) {
        (Phase::Open, _) if now_ms >= r.expires_at_ms => Verdict::Expired {
            expired_at_ms: r.expires_at_ms,
        },
        (Phase::Open, _) => Verdict::Apply,
        (Phase::Settled { actual: a }, Finish::Settle { actual }) if a == actual => {
            Verdict::Replay(r.results.clone())
        }
        (Phase::Settled { actual: a }, Finish::Settle { actual }) => {
            Verdict::Conflict(format!("settled at {a} tokens, not {actual}"))
        }
        (Phase::Settled { actual: a }, Finish::Release) => Verdict::Conflict(format!(
            "settled at {a} tokens: a settled hold is not released"
        )),
        (Phase::Released, Finish::Release) => Verdict::Replay(r.results.clone()),
        (Phase::Released, Finish::Settle { .. }) => {
            Verdict::Conflict("released: a released hold is not settled".into())
        }
    }
}

/// What settling one bucket did: the result, the state to store (`None`: leave it), and the
/// usage counters' change (tokens charged count as admitted, clamped as denied; refunded ones
/// come off the admitted count, not below 0, as `refund.lua` takes them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketSettle {
    pub result: BucketResult,
    pub state: Option<BucketState>,
    pub admitted: u64,
    pub denied: u64,
    pub unadmitted: u64,
}

/// Settles one bucket of a hold of `estimate` at `actual` (both at most [`MAX_BURST`]) at
/// `now_ms`, under `params` in force: the excess charged as [`bucket::charge`] does, down to
/// `debt_limit_ut` below empty (at most what the capacity in force keeps exact: parameters
/// may have grown since the hold was made); a shortfall refunded as [`bucket::refund`] does;
/// equal leaves the bucket as it is. `remaining` and `debt` describe the bucket after, refilled
/// to now.
pub fn settle_bucket(
    now_ms: u64,
    params: &BucketParams,
    state: Option<&BucketState>,
    debt_limit_ut: u64,
    estimate: u64,
    actual: u64,
) -> BucketSettle {
    let described = |s: &BucketState| (s.tokens_ut / bucket::UT, s.debt_ut.div_ceil(bucket::UT));
    if actual > estimate {
        let excess = (actual - estimate).min(MAX_BURST);
        let room = MAX_CAPACITY_UT - params.capacity_ut.min(MAX_CAPACITY_UT);
        let (o, s) = bucket::charge(now_ms, params, state, excess, debt_limit_ut.min(room))
            .expect("an excess of 1..=MAX_BURST within the capacity's room is a valid charge");
        return BucketSettle {
            result: BucketResult {
                charged: o.applied,
                clamped: o.clamped,
                refunded: 0,
                remaining: o.remaining,
                debt: o.debt,
            },
            state: Some(s),
            admitted: o.applied,
            denied: o.clamped,
            unadmitted: 0,
        };
    }
    let back = estimate - actual;
    let refunded = if back > 0 {
        bucket::refund(now_ms, params, state, back)
    } else {
        None
    };
    let after = refunded.unwrap_or_else(|| bucket::refill(now_ms, params, state));
    let (remaining, debt) = described(&after);
    BucketSettle {
        result: BucketResult {
            charged: 0,
            clamped: 0,
            refunded: back,
            remaining,
            debt,
        },
        state: refunded,
        admitted: 0,
        denied: 0,
        unadmitted: if refunded.is_some() { back } else { 0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::UT;

    fn params(cap: u64, per_s: u64) -> BucketParams {
        BucketParams::new(cap * UT, per_s * UT).unwrap()
    }

    #[test]
    fn ids_are_key_safe() {
        assert!(valid_id("a") && valid_id("A-z_09") && valid_id(&"x".repeat(MAX_HOLD_ID_LEN)));
        for bad in [
            "",
            "a b",
            "a:b",
            "a{b}",
            "é",
            "a*",
            &"x".repeat(MAX_HOLD_ID_LEN + 1),
        ] {
            assert!(!valid_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_record_answers_each_way_of_ending_once() {
        let r = HoldRecord::open(1000, vec!['a', 'b'], 5, 100);
        assert_eq!(
            (r.expires_at_ms, r.forget_at_ms),
            (1100, 1100 + HOLD_MEMORY_MS)
        );
        // The same request replays; another is refused; a forgotten record is no record.
        assert_eq!(
            create(1050, Some(&r), &['a', 'b'], 5, 100),
            Create::Replay {
                expires_at_ms: 1100
            }
        );
        for (limits, cost, ttl) in [
            (&['a'][..], 5, 100),
            (&['a', 'b'][..], 6, 100),
            (&['a', 'b'][..], 5, 99),
        ] {
            assert_eq!(create(1050, Some(&r), limits, cost, ttl), Create::Refused);
        }
        assert_eq!(
            create(r.forget_at_ms, Some(&r), &['c'], 1, 1),
            Create::Fresh
        );
        // Open: applies until its expiry, then is expired until forgotten.
        let settle = Finish::Settle { actual: 7 };
        assert_eq!(finish(1099, Some(&r), settle), Verdict::Apply);
        assert_eq!(
            finish(1100, Some(&r), Finish::Release),
            Verdict::Expired {
                expired_at_ms: 1100
            }
        );
        assert_eq!(finish(r.forget_at_ms, Some(&r), settle), Verdict::Unknown);
        assert_eq!(finish::<char>(0, None, settle), Verdict::Unknown);
        // Settled at 7: 7 again replays, 8 or a release conflicts.
        let res = vec![BucketResult {
            charged: 2,
            ..Default::default()
        }];
        let s = r.clone().ended(1099, settle, res.clone());
        assert_eq!(s.forget_at_ms, 1099 + HOLD_MEMORY_MS);
        assert_eq!(finish(5000, Some(&s), settle), Verdict::Replay(res.clone()));
        assert_eq!(
            finish(5000, Some(&s), Finish::Settle { actual: 8 }),
            Verdict::Conflict("settled at 7 tokens, not 8".into())
        );
        assert!(matches!(
            finish(5000, Some(&s), Finish::Release),
            Verdict::Conflict(_)
        ));
        // Released: a release replays, a settle conflicts.
        let rel = r.ended(1099, Finish::Release, res.clone());
        assert_eq!(
            finish(5000, Some(&rel), Finish::Release),
            Verdict::Replay(res)
        );
        assert!(matches!(
            finish(5000, Some(&rel), settle),
            Verdict::Conflict(_)
        ));
    }

    #[test]
    fn settling_charges_the_excess_and_refunds_the_rest() {
        let p = params(10, 1);
        // A hold of 6 spent on a full bucket of 10: 4 left.
        let (_, held) = bucket::decide(0, &p, None, 6);
        // Actual 4: 2 back, 6 left.
        let s = settle_bucket(0, &p, Some(&held), 0, 6, 4);
        assert_eq!(
            (s.result.refunded, s.result.remaining, s.unadmitted),
            (2, 6, 2)
        );
        assert_eq!(s.state.unwrap().tokens_ut, 6 * UT);
        // Actual 15: 9 more into debt, limit 3 below empty: 7 charged, 2 clamped.
        let s = settle_bucket(0, &p, Some(&held), 3 * UT, 6, 15);
        assert_eq!(
            s.result,
            BucketResult {
                charged: 7,
                clamped: 2,
                refunded: 0,
                remaining: 0,
                debt: 3
            }
        );
        assert_eq!((s.admitted, s.denied), (7, 2));
        // Equal: nothing stored, the bucket described as it stands 2 s later.
        let s = settle_bucket(2000, &p, Some(&held), 0, 6, 6);
        assert_eq!((s.state, s.result.remaining), (None, 6));
        // A bucket that expired (full) keeps nothing of a refund; nothing is stored.
        let s = settle_bucket(0, &p, None, 0, 6, 0);
        assert_eq!(
            (s.state, s.result.refunded, s.result.remaining, s.unadmitted),
            (None, 6, 10, 0)
        );
        // A debt limit past what a grown capacity keeps exact is cut to it, never refused.
        let huge = BucketParams::new(MAX_CAPACITY_UT - UT, bucket::MAX_RATE_UT_PER_S).unwrap();
        let s = settle_bucket(0, &huge, None, MAX_CAPACITY_UT, 1, 3);
        assert_eq!((s.result.charged, s.result.clamped), (2, 0));
    }
}
