//! The heaviest keys of a stream in bounded memory: space-saving top-K (Metwally, Agrawal and
//! El Abbadi, "Efficient computation of frequent and top-k elements in data streams", 2005).
//!
//! A region's usage report names the few subjects of a class that were denied most at the
//! class's share, so the leader can give those their own share vector. The region cannot keep
//! a counter per subject (there may be millions), so it keeps `capacity` counters: a key already
//! counted adds its weight; a new key takes over the smallest counter and inherits its count
//! as its possible error. Each counter's `count` is at least the key's true weight and
//! `count − error` at most it; every key whose true weight exceeds `total / capacity` holds a
//! counter. With no more distinct keys than counters it is exact.
//!
//! Ties are broken by key order, so the same stream always gives the same counters.

use std::collections::{BTreeMap, BTreeSet};

/// One counted key: `count` over-estimates its weight by at most `error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heavy<K> {
    pub key: K,
    pub count: u64,
    pub error: u64,
}

impl<K> Heavy<K> {
    /// The weight the key certainly had: `count − error`.
    pub fn guaranteed(&self) -> u64 {
        self.count - self.error
    }
}

/// Space-saving counters over keys `K`.
#[derive(Debug, Clone)]
pub struct TopK<K: Ord + Clone> {
    capacity: usize,
    /// key → (count, error).
    counters: BTreeMap<K, (u64, u64)>,
    /// (count, key), to find the smallest counter.
    by_count: BTreeSet<(u64, K)>,
    total: u64,
}

impl<K: Ord + Clone> TopK<K> {
    /// Counters for at most `capacity` keys (0 counts nothing but the total).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            counters: BTreeMap::new(),
            by_count: BTreeSet::new(),
            total: 0,
        }
    }

    /// Adds `weight` to `key`.
    pub fn add(&mut self, key: K, weight: u64) {
        if weight == 0 {
            return;
        }
        self.total = self.total.saturating_add(weight);
        if let Some((count, _)) = self.counters.get_mut(&key) {
            self.by_count.remove(&(*count, key.clone()));
            *count = count.saturating_add(weight);
            self.by_count.insert((*count, key));
            return;
        }
        if self.capacity == 0 {
            return;
        }
        let (inherited, error) = if self.counters.len() < self.capacity {
            (0, 0)
        } else {
            let (min, victim) = self.by_count.pop_first().expect("full means non-empty");
            self.counters.remove(&victim);
            (min, min)
        };
        let count = inherited.saturating_add(weight);
        self.counters.insert(key.clone(), (count, error));
        self.by_count.insert((count, key));
    }

    /// The counted keys, heaviest first (equal counts in key order).
    pub fn heavy(&self) -> Vec<Heavy<K>> {
        let mut v: Vec<Heavy<K>> = self
            .counters
            .iter()
            .map(|(key, &(count, error))| Heavy {
                key: key.clone(),
                count,
                error,
            })
            .collect();
        v.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.key.cmp(&b.key)));
        v
    }

    /// The weight added since the last [`TopK::clear`], counted or not.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// How many keys hold a counter.
    pub fn len(&self) -> usize {
        self.counters.len()
    }

    /// True when no key holds a counter.
    pub fn is_empty(&self) -> bool {
        self.counters.is_empty()
    }

    /// The most keys it counts at once.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every counter (a report interval ended).
    pub fn clear(&mut self) {
        self.counters.clear();
        self.by_count.clear();
        self.total = 0;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn exact_while_the_keys_fit() {
        let mut t = TopK::new(3);
        for (k, w) in [("b", 2), ("a", 5), ("b", 4), ("c", 1)] {
            t.add(k, w);
        }
        let h = t.heavy();
        let got: Vec<_> = h.iter().map(|h| (h.key, h.count, h.error)).collect();
        assert_eq!(got, [("b", 6, 0), ("a", 5, 0), ("c", 1, 0)]);
        assert_eq!(t.total(), 12);
    }

    #[test]
    fn a_new_key_takes_the_smallest_counter_and_its_count_as_error() {
        let mut t = TopK::new(2);
        t.add(1u32, 5);
        t.add(2, 3);
        t.add(3, 1);
        let h = t.heavy();
        assert_eq!(
            h,
            [
                Heavy {
                    key: 1,
                    count: 5,
                    error: 0
                },
                Heavy {
                    key: 3,
                    count: 4,
                    error: 3
                }
            ]
        );
        assert_eq!(h[1].guaranteed(), 1);
    }

    #[test]
    fn equal_counts_come_in_key_order_and_zero_weights_are_ignored() {
        let mut t = TopK::new(4);
        for k in [4u32, 2, 3, 1] {
            t.add(k, 7);
        }
        t.add(9, 0);
        let keys: Vec<_> = t.heavy().iter().map(|h| h.key).collect();
        assert_eq!(keys, [1, 2, 3, 4]);
        assert_eq!(t.len(), 4);
        t.clear();
        assert!(t.is_empty() && t.total() == 0);
        let mut none = TopK::new(0);
        none.add(1u8, 3);
        assert!(none.is_empty() && none.total() == 3 && none.capacity() == 0);
    }

    proptest! {
        /// Space-saving's guarantees against exact counts: over- and under-estimates bounded
        /// by the error, every key heavier than total / capacity counted, and one order.
        #[test]
        fn guarantees_hold(
            stream in prop::collection::vec((0u8..40, 1u64..20), 0..400),
            capacity in 1usize..12,
        ) {
            let mut t = TopK::new(capacity);
            let mut exact: BTreeMap<u8, u64> = BTreeMap::new();
            for &(k, w) in &stream {
                t.add(k, w);
                *exact.entry(k).or_default() += w;
            }
            let total: u64 = exact.values().sum();
            prop_assert_eq!(t.total(), total);
            let h = t.heavy();
            prop_assert!(h.len() <= capacity);
            for x in &h {
                let truth = exact[&x.key];
                prop_assert!(x.count >= truth && x.guaranteed() <= truth, "{x:?} vs {truth}");
            }
            for (k, &w) in &exact {
                if w * capacity as u64 > total {
                    prop_assert!(h.iter().any(|x| x.key == *k), "{k} ({w} of {total}) lost");
                }
            }
            for pair in h.windows(2) {
                prop_assert!(
                    (pair[0].count, std::cmp::Reverse(pair[0].key))
                        > (pair[1].count, std::cmp::Reverse(pair[1].key))
                );
            }
        }
    }
}
