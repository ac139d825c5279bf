//! quotad's control plane for classes of subjects: one share vector per class, learned from
//! the class's aggregate regional demand, plus *promotion* of the few subjects denied at
//! their class share to entries of their own, evicted once their demand fits the class again.
//!
//! ```text
//!  region r, every report interval: usage per class + per promoted subject, the top-K of
//!                                   subjects denied at their class share, acked epoch ──▶ leader
//!  leader, every rebalance interval: class targets from aggregate demand (normalised),
//!                                   promoted targets from the subject's own demand, promotions,
//!                                   evictions ─▶ one command (an epoch) ──▶ every region
//!  region: a subject is decided at its promoted share if its region knows one, else at its
//!          class share, in its own bucket (the bucket stays when only its share changes)
//! ```
//!
//! Every share move uses quota-core's allocator steps (`target_split`, `step_towards`: damped,
//! revoke before grant): a decrease counts at its old value until the region acknowledges the
//! epoch that made it, and increases fit only into the room that leaves. A promoted entry
//! starts at its class's shares, still counting what the class may be enforcing, so a region
//! that has not yet applied the promotion stays within the class's bound; it is evicted only
//! once every region's promoted share is at most the class's share there. So for every subject
//! the shares regions enforce sum to at most the whole budget at every instant, which
//! [`Coordinator::violations`] checks on every applied command.
//!
//! Replication is modelled as in `control`: a command is decided at the leader (region 0; the
//! scenario has no faults), commits one quorum round trip later and reaches each region a
//! one-way delay after that. Leases are not modelled here (they always renew without faults;
//! the suite measures them).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};

use quota_core::allocator::{step_towards, target_split, AllocatorConfig};
use quota_core::bucket::UT;
use quota_core::demand::{DemandTracker, Usage};
use quota_core::heavy::TopK;
use quota_core::mode::{budget_mode, BudgetMode};
use quota_core::{Policy, PolicyKey, PolicyName, TenantId, PPM};

use super::population::Population;
use crate::world::{RegionIx, World};

/// How promotion works.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromotionConfig {
    /// Off: every subject stays at its class's shares (`class_shares`).
    pub enabled: bool,
    /// Counters in each region's top-K of denied subjects per report.
    pub top_k: usize,
    /// Denials a subject must certainly have had in one report to be promoted.
    pub min_denied: u64,
    /// A promoted subject whose demand stays below `evict_below_ppm` of its class's share in
    /// every region for this long is evicted.
    pub idle_ms: u64,
    pub evict_below_ppm: u32,
    /// Coordinator entries (classes and promoted subjects) at most this fraction of subjects.
    pub max_entries_ppm: u32,
    /// The most a promoted entry's share moves in one round.
    pub max_step_ppm: u32,
}

impl Default for PromotionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            top_k: 64,
            min_denied: 1,
            idle_ms: 60_000,
            evict_below_ppm: 250_000,
            max_entries_ppm: 10_000,
            max_step_ppm: PPM,
        }
    }
}

/// One share vector with the revocations still outstanding.
#[derive(Debug, Clone)]
struct Entry {
    shares: Vec<u32>,
    /// Per region: (epoch of the decrease, the share it may still enforce until it acks it).
    revocations: Vec<Vec<(u64, u32)>>,
}

impl Entry {
    fn new(shares: Vec<u32>) -> Self {
        let n = shares.len();
        Self {
            shares,
            revocations: vec![Vec::new(); n],
        }
    }

    fn enforceable(&self, r: RegionIx) -> u32 {
        self.revocations[r]
            .iter()
            .map(|&(_, s)| s)
            .fold(self.shares[r], u32::max)
    }

    fn ack(&mut self, r: RegionIx, epoch: u64) {
        self.revocations[r].retain(|&(e, _)| e > epoch);
    }

    /// One damped, revoke-before-grant step towards `target` in the command of `epoch`;
    /// a share left below one unit (`min_share`) on a decrease goes to 0. Whether it moved.
    fn step(&mut self, target: &[u32], max_step_ppm: u32, min_share: u32, epoch: u64) -> bool {
        let n = self.shares.len();
        let enforceable: Vec<u32> = (0..n).map(|r| self.enforceable(r)).collect();
        let mut next = step_towards(
            &self.shares,
            target,
            &vec![0; n],
            &enforceable,
            max_step_ppm,
        );
        for (r, s) in next.iter_mut().enumerate() {
            if *s > 0 && *s < min_share {
                *s = if *s < self.shares[r] {
                    0
                } else {
                    self.shares[r]
                };
            }
        }
        if next == self.shares {
            return false;
        }
        for (r, (&new, &old)) in next.iter().zip(&self.shares).enumerate() {
            if new < old {
                self.revocations[r].push((epoch, old));
            }
        }
        self.shares = next;
        true
    }

    fn distance(&self, target: &[u32]) -> u64 {
        self.shares
            .iter()
            .zip(target)
            .map(|(&a, &b)| u64::from(a.abs_diff(b)))
            .sum()
    }
}

#[derive(Debug)]
struct ClassEntry {
    key: PolicyKey,
    policy: Policy,
    home: bool,
    entry: Entry,
}

#[derive(Debug)]
struct Promoted {
    class: u8,
    key: PolicyKey,
    entry: Entry,
    calm_since_ms: Option<u64>,
    evicting: bool,
}

/// One change in a command.
#[derive(Debug, Clone)]
enum Change {
    Class { class: u8, shares: Vec<u32> },
    Promote { subject: u32, shares: Vec<u32> },
    Shares { subject: u32, shares: Vec<u32> },
    Evict { subject: u32 },
}

#[derive(Debug)]
enum Event {
    Report {
        from: RegionIx,
        acked_epoch: u64,
        usage: Vec<(PolicyKey, Usage)>,
        denied: Vec<(u32, u64)>,
    },
    Apply {
        region: RegionIx,
        epoch: u64,
        changes: Vec<Change>,
    },
}

#[derive(Debug)]
struct Timed(u64, u64, Event);
impl PartialEq for Timed {
    fn eq(&self, o: &Self) -> bool {
        (self.0, self.1) == (o.0, o.1)
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.0, self.1).cmp(&(o.0, o.1))
    }
}

/// What a region has applied: class shares and the subjects it knows as promoted.
#[derive(Debug, Clone)]
pub struct View {
    applied_epoch: u64,
    class_shares: Vec<Vec<u32>>,
    promoted: HashMap<u32, Vec<u32>>,
}

impl View {
    /// The share vector region decisions use for `subject` of `class`.
    pub fn shares(&self, class: u8, subject: u32) -> (&[u32], bool) {
        match self.promoted.get(&subject) {
            Some(s) => (s, true),
            None => (&self.class_shares[usize::from(class)], false),
        }
    }
}

#[derive(Debug)]
struct RegionUsage {
    class: Vec<Usage>,
    promoted: BTreeMap<u32, Usage>,
    denied: TopK<u32>,
}

/// The coordinator and the regions' views of it.
#[derive(Debug)]
pub struct Coordinator {
    cfg: PromotionConfig,
    alloc: AllocatorConfig,
    n: usize,
    report_ms: u64,
    rebalance_ms: u64,
    classes: Vec<ClassEntry>,
    promoted: BTreeMap<u32, Promoted>,
    /// Subjects reported denied at their class share since the last round: per region, the
    /// denials certainly counted.
    candidates: BTreeMap<u32, Vec<u64>>,
    demand: DemandTracker,
    epoch: u64,
    events: BinaryHeap<Reverse<Timed>>,
    seq: u64,
    pub views: Vec<View>,
    usage: Vec<RegionUsage>,
    next_report_ms: u64,
    next_rebalance_ms: u64,
    commit_ms: u64,
    owd_ms: Vec<u64>,
    max_entries: usize,
    subject_class: Vec<u8>,
    /// The most entries (classes + promoted) at once.
    pub peak_entries: usize,
    pub promotions: u64,
    pub evictions: u64,
    /// Applied states in which some subject's enforced shares summed above the budget.
    pub violations: u64,
    /// The most (policy, usage) pairs plus denied subjects in one report.
    pub peak_report_len: usize,
}

fn class_key(name: &str) -> PolicyKey {
    PolicyKey::new(
        TenantId::new("class").expect("valid"),
        PolicyName::new(name).expect("valid"),
    )
}

fn subject_key(subject: u32, class: &str) -> PolicyKey {
    PolicyKey::new(
        TenantId::new(format!("s{subject}")).expect("valid"),
        PolicyName::new(class).expect("valid"),
    )
}

impl Coordinator {
    /// Every class starts at an even split (or whole in region 0, its home, when its budget
    /// is too small to split), every region having applied it.
    pub fn new(
        world: &World,
        pop: &Population,
        cfg: PromotionConfig,
        report_ms: u64,
        rebalance_ms: u64,
    ) -> Self {
        let n = world.regions;
        let classes: Vec<ClassEntry> = pop
            .classes
            .iter()
            .map(|c| {
                let home = budget_mode(&c.policy, n) == BudgetMode::Home;
                let shares = if home {
                    (0..n).map(|r| if r == 0 { PPM } else { 0 }).collect()
                } else {
                    target_split(&vec![0; n], &vec![0; n], &vec![true; n])
                };
                ClassEntry {
                    key: class_key(c.name),
                    policy: c.policy.clone(),
                    home,
                    entry: Entry::new(shares),
                }
            })
            .collect();
        let view = View {
            applied_epoch: 0,
            class_shares: classes.iter().map(|c| c.entry.shares.clone()).collect(),
            promoted: HashMap::new(),
        };
        let mut rtts: Vec<u64> = (1..n).map(|p| world.rtt_ms(0, p)).collect();
        rtts.sort_unstable();
        let commit_ms = if n / 2 == 0 { 0 } else { rtts[n / 2 - 1] };
        let alloc = AllocatorConfig::default();
        let max_entries =
            (pop.subjects.len() as u64 * u64::from(cfg.max_entries_ppm) / u64::from(PPM)) as usize;
        Self {
            cfg,
            alloc,
            n,
            report_ms,
            rebalance_ms,
            usage: (0..n)
                .map(|_| RegionUsage {
                    class: vec![Usage::default(); classes.len()],
                    promoted: BTreeMap::new(),
                    denied: TopK::new(cfg.top_k),
                })
                .collect(),
            peak_entries: classes.len(),
            classes,
            promoted: BTreeMap::new(),
            candidates: BTreeMap::new(),
            demand: DemandTracker::new(alloc.ewma_alpha_ppm),
            epoch: 0,
            events: BinaryHeap::new(),
            seq: 0,
            views: vec![view; n],
            next_report_ms: report_ms,
            next_rebalance_ms: rebalance_ms,
            commit_ms,
            owd_ms: (0..n).map(|r| world.owd_ms(0, r)).collect(),
            max_entries: max_entries.max(pop.classes.len()),
            subject_class: pop.subjects.iter().map(|s| s.class).collect(),
            promotions: 0,
            evictions: 0,
            violations: 0,
            peak_report_len: 0,
        }
    }

    /// Whether class `c` lives whole in its home region (region 0).
    pub fn home_class(&self, c: u8) -> bool {
        self.classes[usize::from(c)].home
    }

    /// Coordinator entries now: classes and promoted subjects.
    pub fn entries(&self) -> usize {
        self.classes.len() + self.promoted.len()
    }

    fn push(&mut self, at_ms: u64, event: Event) {
        self.seq += 1;
        self.events.push(Reverse(Timed(at_ms, self.seq, event)));
    }

    /// Counts one decision made for a caller in `region` in its next report.
    pub fn count(&mut self, region: RegionIx, subject: u32, promoted: bool, allowed: bool) {
        let u = &mut self.usage[region];
        let class = usize::from(self.subject_class[subject as usize]);
        let slot = if promoted {
            u.promoted.entry(subject).or_default()
        } else {
            if !allowed {
                u.denied.add(subject, 1);
            }
            &mut u.class[class]
        };
        if allowed {
            slot.admitted += 1;
        } else {
            slot.denied += 1;
        }
    }

    /// Runs the control plane up to `t_ms`, everything in time order.
    pub fn advance(&mut self, t_ms: u64) {
        loop {
            let event_at = self.events.peek().map_or(u64::MAX, |e| e.0 .0);
            let next = event_at
                .min(self.next_report_ms)
                .min(self.next_rebalance_ms);
            if next > t_ms {
                return;
            }
            if next == self.next_report_ms {
                self.send_reports(next);
                self.next_report_ms += self.report_ms;
            } else if next == self.next_rebalance_ms {
                self.rebalance(next);
                self.next_rebalance_ms += self.rebalance_ms;
            } else {
                let Reverse(Timed(at, _, event)) = self.events.pop().expect("peeked");
                self.on_event(at, event);
            }
        }
    }

    fn send_reports(&mut self, at_ms: u64) {
        for r in 0..self.n {
            let u = &mut self.usage[r];
            let mut usage: Vec<(PolicyKey, Usage)> = Vec::new();
            for (c, class) in self.classes.iter().enumerate() {
                let x = std::mem::take(&mut u.class[c]);
                if !class.home && x.admitted + x.denied > 0 {
                    usage.push((class.key.clone(), x));
                }
            }
            for (subject, x) in std::mem::take(&mut u.promoted) {
                if let Some(p) = self.promoted.get(&subject) {
                    usage.push((p.key.clone(), x));
                }
            }
            let denied: Vec<(u32, u64)> = u
                .denied
                .heavy()
                .into_iter()
                .filter(|h| h.guaranteed() >= self.cfg.min_denied)
                .map(|h| (h.key, h.guaranteed()))
                .collect();
            u.denied.clear();
            self.peak_report_len = self.peak_report_len.max(usage.len() + denied.len());
            let acked_epoch = self.views[r].applied_epoch;
            self.push(
                at_ms + self.owd_ms[r],
                Event::Report {
                    from: r,
                    acked_epoch,
                    usage,
                    denied,
                },
            );
        }
    }

    fn on_event(&mut self, _at_ms: u64, event: Event) {
        match event {
            Event::Report {
                from,
                acked_epoch,
                usage,
                denied,
            } => {
                self.demand.record(from as u8, self.report_ms, &usage);
                for c in &mut self.classes {
                    c.entry.ack(from, acked_epoch);
                }
                for p in self.promoted.values_mut() {
                    p.entry.ack(from, acked_epoch);
                }
                if self.cfg.enabled {
                    for (subject, count) in denied {
                        let home =
                            self.classes[usize::from(self.subject_class[subject as usize])].home;
                        if !home && !self.promoted.contains_key(&subject) {
                            self.candidates
                                .entry(subject)
                                .or_insert_with(|| vec![0; self.n])[from] += count;
                        }
                    }
                }
            }
            Event::Apply {
                region,
                epoch,
                changes,
            } => {
                let v = &mut self.views[region];
                for ch in changes {
                    match ch {
                        Change::Class { class, shares } => {
                            v.class_shares[usize::from(class)] = shares;
                        }
                        Change::Promote { subject, shares }
                        | Change::Shares { subject, shares } => {
                            v.promoted.insert(subject, shares);
                        }
                        Change::Evict { subject } => {
                            v.promoted.remove(&subject);
                        }
                    }
                }
                v.applied_epoch = epoch;
                self.check_bound();
            }
        }
    }

    /// Counts a violation when some subject's enforced shares, across what each region has
    /// applied, sum above the budget.
    fn check_bound(&mut self) {
        let n = self.n;
        for c in 0..self.classes.len() {
            let sum: u64 = (0..n)
                .map(|r| u64::from(self.views[r].class_shares[c][r]))
                .sum();
            if sum > u64::from(PPM) {
                self.violations += 1;
            }
        }
        let known: BTreeSet<u32> = self
            .views
            .iter()
            .flat_map(|v| v.promoted.keys().copied())
            .collect();
        for s in known {
            let class = self.subject_class[s as usize];
            let sum: u64 = (0..n)
                .map(|r| u64::from(self.views[r].shares(class, s).0[r]))
                .sum();
            if sum > u64::from(PPM) {
                self.violations += 1;
            }
        }
    }

    fn demand_ppm(&self, key: &PolicyKey, rate_ut_per_s: u64) -> Vec<u64> {
        let rates = self.demand.get(key).unwrap_or(&[]);
        (0..self.n)
            .map(|r| {
                let d = rates.get(r).copied().unwrap_or(0);
                (u128::from(d) * u128::from(PPM) / u128::from(rate_ut_per_s.max(1))) as u64
            })
            .collect()
    }

    fn rebalance(&mut self, at_ms: u64) {
        let n = self.n;
        let epoch = self.epoch + 1;
        let zeros = vec![0u32; n];
        let all = vec![true; n];
        let mut changes = Vec::new();
        let (max_step, threshold) = (
            self.alloc.max_step_ppm,
            u64::from(self.alloc.change_threshold_ppm),
        );
        // Classes: the aggregate of many subjects exceeds one subject's budget in every region,
        // where max-min fairness would split evenly; its proportions are what matter.
        for c in 0..self.classes.len() {
            if self.classes[c].home {
                continue;
            }
            let rates = self
                .demand
                .get(&self.classes[c].key)
                .unwrap_or(&[])
                .to_vec();
            let total: u128 = rates.iter().map(|&d| u128::from(d)).sum();
            let demand_ppm: Vec<u64> = (0..n)
                .map(|r| {
                    let d = u128::from(rates.get(r).copied().unwrap_or(0));
                    (d * u128::from(PPM)).checked_div(total).unwrap_or(0) as u64
                })
                .collect();
            let target = target_split(&zeros, &demand_ppm, &all);
            let class = &mut self.classes[c];
            let min_share = class.policy.min_share_ppm();
            if class.entry.distance(&target) >= threshold
                && class.entry.step(&target, max_step, min_share, epoch)
            {
                changes.push(Change::Class {
                    class: c as u8,
                    shares: class.entry.shares.clone(),
                });
            }
        }
        // Promoted subjects: their own demand, as any tenant's; evicted once calm.
        let subjects: Vec<u32> = self.promoted.keys().copied().collect();
        for s in subjects {
            let p = &self.promoted[&s];
            let class = &self.classes[usize::from(p.class)];
            let demand_ppm = self.demand_ppm(&p.key, class.policy.rate_ut_per_s());
            let class_shares = class.entry.shares.clone();
            let min_share = class.policy.min_share_ppm();
            let calm = (0..n).all(|r| {
                u128::from(demand_ppm[r]) * u128::from(PPM)
                    <= u128::from(class_shares[r]) * u128::from(self.cfg.evict_below_ppm)
            });
            let p = self.promoted.get_mut(&s).expect("listed");
            if calm {
                let since = *p.calm_since_ms.get_or_insert(at_ms);
                p.evicting |= at_ms >= since + self.cfg.idle_ms;
            } else {
                p.calm_since_ms = None;
                p.evicting = false;
            }
            if p.evicting && (0..n).all(|r| p.entry.enforceable(r) <= class_shares[r]) {
                changes.push(Change::Evict { subject: s });
                self.promoted.remove(&s);
                self.evictions += 1;
                continue;
            }
            let target = if p.evicting {
                class_shares
            } else {
                target_split(&zeros, &demand_ppm, &all)
            };
            if (p.evicting || p.entry.distance(&target) >= threshold)
                && p.entry
                    .step(&target, self.cfg.max_step_ppm, min_share, epoch)
            {
                changes.push(Change::Shares {
                    subject: s,
                    shares: p.entry.shares.clone(),
                });
            }
        }
        // Promotions, most denied first, while entries stay within their bound.
        let mut candidates: Vec<(u32, Vec<u64>)> =
            std::mem::take(&mut self.candidates).into_iter().collect();
        candidates.sort_by_key(|(s, d)| (Reverse(d.iter().sum::<u64>()), *s));
        for (s, denied) in candidates {
            if self.entries() >= self.max_entries || self.promoted.contains_key(&s) {
                continue;
            }
            let c = self.subject_class[s as usize];
            let class = &self.classes[usize::from(c)];
            let mut entry = Entry::new(class.entry.shares.clone());
            for r in 0..n {
                // Until it applies the promotion, a region decides at the class's share.
                let enforceable = class.entry.enforceable(r);
                if enforceable > entry.shares[r] {
                    entry.revocations[r].push((epoch, enforceable));
                }
            }
            let key = subject_key(s, &pop_name(class));
            // Its demand so far: what it was denied (admitted checks were not counted apart).
            let rates: Vec<u64> = denied
                .iter()
                .map(|&d| d * UT * 1000 / self.report_ms)
                .collect();
            self.demand.set(key.clone(), rates);
            let demand_ppm = self.demand_ppm(&key, class.policy.rate_ut_per_s());
            let target = target_split(&zeros, &demand_ppm, &all);
            let min_share = class.policy.min_share_ppm();
            entry.step(&target, self.cfg.max_step_ppm, min_share, epoch);
            changes.push(Change::Promote {
                subject: s,
                shares: entry.shares.clone(),
            });
            self.promoted.insert(
                s,
                Promoted {
                    class: c,
                    key,
                    entry,
                    calm_since_ms: None,
                    evicting: false,
                },
            );
            self.promotions += 1;
        }
        self.peak_entries = self.peak_entries.max(self.entries());
        if changes.is_empty() {
            return;
        }
        self.epoch = epoch;
        for r in 0..n {
            let at = at_ms + self.commit_ms + self.owd_ms[r];
            self.push(
                at,
                Event::Apply {
                    region: r,
                    epoch,
                    changes: changes.clone(),
                },
            );
        }
    }
}

fn pop_name(class: &ClassEntry) -> String {
    class.key.policy.as_str().to_string()
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::faults::Faults;
    use crate::world::WorldSpec;

    fn setup() -> (World, Population) {
        let world = World::new(
            &WorldSpec::default(),
            Faults::default(),
            &mut ChaCha8Rng::seed_from_u64(4),
        );
        let pop = Population::build(3, 1_000, &mut ChaCha8Rng::seed_from_u64(5));
        (world, pop)
    }

    /// Every 100 ms from `from_ms` to `until_ms`: `per_tick` checks of the class's aggregate
    /// in each region (subjects 100..), and subject 0 checking in region 2 at `own` per tick,
    /// denied whenever region 2's share for it holds less than half the budget.
    fn drive(c: &mut Coordinator, from_ms: u64, until_ms: u64, weights: [u64; 3], own: u64) {
        for t in (from_ms..until_ms).step_by(100) {
            c.advance(t);
            for (r, &w) in weights.iter().enumerate() {
                for k in 0..w {
                    c.count(r, 100 + k as u32, false, true);
                }
            }
            let (shares, promoted) = c.views[2].shares(0, 0);
            let allowed = shares[2] >= PPM / 2;
            for _ in 0..own {
                c.count(2, 0, promoted, allowed);
            }
            assert_eq!(c.violations, 0, "Σ shares > 1 at {t} ms");
        }
    }

    #[test]
    fn a_denied_subject_is_promoted_then_evicted_once_calm() {
        let (world, pop) = setup();
        let mut c = Coordinator::new(&world, &pop, PromotionConfig::default(), 1_000, 2_000);
        assert!(!c.home_class(0) && c.home_class(1));
        drive(&mut c, 0, 30_000, [6, 3, 1], 1);
        // The class follows its aggregate (most of it in region 0); subject 0 has its own
        // vector, most of it where its demand is.
        let class = &c.views[2].class_shares[0];
        assert!(class[0] > class[2], "class shares {class:?}");
        let (own, promoted) = c.views[2].shares(0, 0);
        assert!(promoted && own[2] >= PPM / 2, "subject 0 at {own:?}");
        assert_eq!((c.promotions, c.entries()), (1, 3));
        // Idle: back to the class's shares, then evicted everywhere.
        drive(&mut c, 30_000, 120_000, [6, 3, 1], 0);
        assert_eq!((c.evictions, c.entries()), (1, 2));
        assert!(c.views.iter().all(|v| v.promoted.is_empty()));
    }

    #[test]
    fn entries_stay_within_their_cap() {
        let (world, pop) = setup();
        let cfg = PromotionConfig {
            max_entries_ppm: 3_000, // 3 of 1 008 subjects: the two classes and one subject
            ..PromotionConfig::default()
        };
        let mut c = Coordinator::new(&world, &pop, cfg, 1_000, 2_000);
        for t in (0..20_000).step_by(100) {
            c.advance(t);
            for s in 0..10 {
                c.count(2, s, false, false);
            }
        }
        assert_eq!(c.peak_entries, 3);
        assert_eq!(c.violations, 0);
    }
}
