//! Concurrency limits: at most `limit` holds in flight at once, each holding one slot until it
//! is settled, released, or expires. The reference that `lua/hold.lua` and `lua/settle.lua`
//! compute on a sorted set of hold ids scored by their expiry (a differential test holds them
//! equal); holds themselves are [`crate::hold`]'s.
//!
//! ```text
//! acquire(now, limit, id, expires_at):
//!   drop the slots expired by now (score <= now); live = those left
//!   live < limit  → admitted: id takes a slot until expires_at
//!   else          → denied: retry when enough expire on their own for one more
//! release(id): the slot is free at once
//! ```
//!
//! A crashed holder's slot comes back at its expiry, at most [`crate::bounds::MAX_HOLD_TTL_MS`]
//! after it was taken. When the limit drops (a lease ends and the floor takes over), the
//! holders keep their slots; new ones wait until fewer than the new limit are live.

use std::collections::BTreeMap;

use crate::bucket::Decision;

/// The slots of one concurrency limit: each holder's id and when its slot expires (ms).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Slots {
    held: BTreeMap<String, u64>,
}

impl Slots {
    /// Every slot with its expiry, expired ones not yet dropped included.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u64)> {
        self.held.iter().map(|(k, &v)| (k.as_str(), v))
    }

    /// Whether no slot is kept, live or not.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// The slots live at `now_ms`: expiring after it.
    pub fn live(&self, now_ms: u64) -> u64 {
        self.held.values().filter(|&&e| e > now_ms).count() as u64
    }

    /// The latest expiry of a live slot; `None` when none is live.
    pub fn latest_expiry(&self, now_ms: u64) -> Option<u64> {
        self.held.values().copied().filter(|&e| e > now_ms).max()
    }

    /// Takes a slot for `id` until `expires_at_ms` if fewer than `limit` are live at `now_ms`,
    /// dropping the expired ones first (a slot already held by `id` is counted, and its expiry
    /// replaced). The decision: `remaining` is the slots free after; a denial's
    /// `retry_after_ms` is when enough live slots expire on their own for one more (a release
    /// can free one sooner), `None` for a limit of 0; `reset_ms` is when every live slot has
    /// expired.
    pub fn acquire(&mut self, now_ms: u64, limit: u64, id: &str, expires_at_ms: u64) -> Decision {
        self.held.retain(|_, &mut e| e > now_ms);
        let live = self.held.len() as u64;
        if live < limit {
            self.held.insert(id.to_string(), expires_at_ms);
            return Decision {
                allowed: true,
                remaining: limit - live - 1,
                retry_after_ms: Some(0),
                reset_ms: Some(self.reset_ms(now_ms)),
            };
        }
        let retry_after_ms = (limit > 0).then(|| {
            // The (live − limit + 1)-th earliest expiry frees the slot one more needs.
            let mut expiries: Vec<u64> = self.held.values().copied().collect();
            expiries.sort_unstable();
            expiries[(live - limit) as usize] - now_ms
        });
        Decision {
            allowed: false,
            remaining: 0,
            retry_after_ms,
            reset_ms: Some(self.reset_ms(now_ms)),
        }
    }

    /// The limit as it stands at `now_ms`, nothing taken (a replayed hold's answer).
    pub fn peek(&self, now_ms: u64, limit: u64) -> Decision {
        Decision {
            allowed: true,
            remaining: limit.saturating_sub(self.live(now_ms)),
            retry_after_ms: Some(0),
            reset_ms: Some(self.reset_ms(now_ms)),
        }
    }

    /// Frees `id`'s slot; whether it held one.
    pub fn release(&mut self, id: &str) -> bool {
        self.held.remove(id).is_some()
    }

    fn reset_ms(&self, now_ms: u64) -> u64 {
        self.latest_expiry(now_ms).map_or(0, |e| e - now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_taken_up_to_the_limit_and_come_back_at_expiry_or_release() {
        let mut s = Slots::default();
        let d = s.acquire(0, 2, "a", 1000);
        assert_eq!((d.allowed, d.remaining, d.reset_ms), (true, 1, Some(1000)));
        assert!(s.acquire(10, 2, "b", 500).allowed);
        // Full: the earliest expiry (b at 500) frees one.
        let d = s.acquire(20, 2, "c", 900);
        assert_eq!(
            (d.allowed, d.retry_after_ms, d.reset_ms),
            (false, Some(480), Some(980))
        );
        assert_eq!(s.live(20), 2);
        // b expired: c takes its slot.
        assert!(s.acquire(500, 2, "c", 900).allowed);
        assert_eq!(s.iter().map(|(k, _)| k).collect::<Vec<_>>(), ["a", "c"]);
        // Released: free at once.
        assert!(s.release("a") && !s.release("a"));
        assert_eq!(s.peek(600, 2).remaining, 1);
    }

    #[test]
    fn a_lower_limit_keeps_its_holders_and_waits_for_enough_to_expire() {
        let mut s = Slots::default();
        for (i, e) in [300, 100, 200, 400].into_iter().enumerate() {
            assert!(s.acquire(0, 4, &format!("h{i}"), e).allowed);
        }
        // Down to 2: four live, so three must expire first (at 100, 200, 300).
        let d = s.acquire(50, 2, "x", 1000);
        assert_eq!(
            (d.allowed, d.remaining, d.retry_after_ms),
            (false, 0, Some(250))
        );
        assert_eq!(s.live(50), 4, "the holders keep their slots");
        assert!(!s.acquire(299, 2, "x", 1000).allowed);
        assert!(s.acquire(300, 2, "x", 1000).allowed);
        // A limit of 0 never admits.
        let d = s.acquire(300, 0, "y", 1000);
        assert_eq!((d.allowed, d.retry_after_ms), (false, None));
        assert_eq!(s.peek(300, 0).remaining, 0);
    }
}
