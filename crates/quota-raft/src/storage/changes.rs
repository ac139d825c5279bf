//! Which policies each applied command may have changed, so readers that derive something
//! per policy (the daemon's view) update what changed instead of walking every policy.

use std::collections::{BTreeSet, VecDeque};

use quota_core::coordinator::{Operation, PolicyKey};
use quota_core::TenantId;

/// Revisions the journal remembers; a reader further behind rebuilds whole.
const JOURNAL_REVISIONS: usize = 1024;
/// Policy keys and tenants the journal holds at most (batches name up to 1000 each).
const JOURNAL_KEYS: usize = 65_536;

/// What one command may have changed in the policies, their shares, floors and pins.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Touched {
    Nothing,
    Keys(Vec<PolicyKey>),
    /// Every policy of a tenant, and the tenant's pin and plan (a plan's policies are the
    /// policies of its reserved subject).
    Tenant(TenantId),
    /// As `Tenant`, for each of several tenants (a batch of plan assignments).
    Tenants(Vec<TenantId>),
    /// Anything: membership, region slots, a snapshot.
    All,
    /// Promoted subjects' shares only.
    Promoted,
}

/// What changed between two revisions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// Every policy may have changed: rebuild whole.
    pub all: bool,
    pub keys: BTreeSet<PolicyKey>,
    /// Tenants whose every policy and whose pin may have changed.
    pub tenants: BTreeSet<TenantId>,
    /// Promoted subjects may have changed: their shares, or their class (any change of a
    /// plan's policy). The set is small ([`quota_core::promotion::MAX_PROMOTED`]): rebuild it.
    pub promoted: bool,
}

impl Changes {
    /// A change set that asks for a whole rebuild.
    pub fn everything() -> Self {
        Self {
            all: true,
            ..Self::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        !self.all && self.keys.is_empty() && self.tenants.is_empty() && !self.promoted
    }

    /// What applying `op` may change.
    pub fn of(op: &Operation) -> Self {
        let mut c = Self::default();
        c.add(&touched(op));
        c
    }

    /// Adds what another change set names.
    pub fn merge(&mut self, other: Changes) {
        self.all |= other.all;
        self.keys.extend(other.keys);
        self.tenants.extend(other.tenants);
        self.promoted |= other.promoted;
    }

    fn add(&mut self, t: &Touched) {
        match t {
            Touched::Nothing => {}
            Touched::Keys(keys) => {
                self.promoted |= keys.iter().any(|k| k.tenant.plan().is_some());
                self.keys.extend(keys.iter().cloned());
            }
            Touched::Tenant(t) => {
                self.promoted |= t.plan().is_some();
                self.tenants.insert(t.clone());
            }
            Touched::Tenants(ts) => self.tenants.extend(ts.iter().cloned()),
            Touched::All => self.all = true,
            Touched::Promoted => self.promoted = true,
        }
    }
}

/// What `op` may change. No wildcard arm: a new operation must say what it touches.
fn touched(op: &Operation) -> Touched {
    match op {
        Operation::PutPolicy { key, .. }
        | Operation::DeletePolicy { key }
        | Operation::Pin { key, .. }
        | Operation::Unpin { key } => Touched::Keys(vec![key.clone()]),
        Operation::SetShares { entries, .. } => {
            Touched::Keys(entries.iter().map(|e| e.key.clone()).collect())
        }
        Operation::Forget { keys } => Touched::Keys(keys.clone()),
        Operation::PutPolicies { entries } => {
            Touched::Keys(entries.iter().map(|(k, _)| k.clone()).collect())
        }
        Operation::PinTenant { tenant, .. }
        | Operation::UnpinTenant { tenant }
        | Operation::AssignPlan { tenant, .. }
        | Operation::UnassignPlan { tenant } => Touched::Tenant(tenant.clone()),
        Operation::AssignPlans { assignments } => {
            Touched::Tenants(assignments.iter().map(|(t, _)| t.clone()).collect())
        }
        // A plan's policies live under its reserved subject: one range, however many tenants
        // the plan has.
        Operation::PutPlan { plan, .. } | Operation::DeletePlan { plan } => {
            Touched::Tenant(TenantId::for_plan(plan))
        }
        // Region slots and floors: every grant may change.
        Operation::PutRegion { .. } | Operation::RemoveRegion { .. } => Touched::All,
        Operation::RenewLease { .. }
        | Operation::RenewDaemonLease { .. }
        | Operation::ClaimAgent { .. }
        | Operation::ReleaseAgent { .. }
        | Operation::AgentPassed { .. }
        | Operation::SetLeaseConfig { .. } => Touched::Nothing,
        // Promoted subjects decide under their class's policy, not under a policy of theirs:
        // a reader rebuilds them whole whenever `promoted` is set.
        Operation::SetPromoted { .. } => Touched::Promoted,
    }
}

/// The last [`JOURNAL_REVISIONS`] revisions and what each touched.
#[derive(Debug, Default)]
pub(super) struct Journal {
    /// `(revision, touched)`, oldest first, consecutive revisions.
    entries: VecDeque<(u64, Touched)>,
    /// Policy keys and tenants held in `entries`.
    keys: usize,
}

fn key_count(t: &Touched) -> usize {
    match t {
        Touched::Keys(k) => k.len(),
        Touched::Tenants(t) => t.len(),
        _ => 0,
    }
}

impl Journal {
    /// Records revision `revision`, made by `op` (`None`: anything may have changed).
    pub(super) fn record(&mut self, revision: u64, op: Option<&Operation>) {
        let t = op.map_or(Touched::All, touched);
        self.keys += key_count(&t);
        self.entries.push_back((revision, t));
        while self.entries.len() > JOURNAL_REVISIONS || self.keys > JOURNAL_KEYS {
            let Some((_, old)) = self.entries.pop_front() else {
                break;
            };
            self.keys -= key_count(&old);
        }
    }

    /// Drops everything: after a snapshot install nothing before it can be diffed.
    pub(super) fn clear(&mut self) {
        self.entries.clear();
        self.keys = 0;
    }

    /// What changed after revision `since` up to `now` (the current revision).
    pub(super) fn since(&self, since: u64, now: u64) -> Changes {
        if since == now {
            return Changes::default();
        }
        let oldest = self.entries.front().map_or(u64::MAX, |(r, _)| *r);
        if since > now || since + 1 < oldest {
            return Changes::everything();
        }
        let mut changes = Changes::default();
        for (_, t) in self.entries.iter().filter(|(r, _)| *r > since) {
            if *t == Touched::All {
                return Changes::everything();
            }
            changes.add(t);
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quota_core::PolicyName;

    fn key(t: &str) -> PolicyKey {
        PolicyKey::new(TenantId::new(t).unwrap(), PolicyName::new("p").unwrap())
    }

    fn unpin(t: &str) -> Operation {
        Operation::Unpin { key: key(t) }
    }

    #[test]
    fn changes_since_a_revision_collect_the_keys_after_it() {
        let mut j = Journal::default();
        j.record(1, Some(&unpin("a")));
        j.record(2, Some(&unpin("b")));
        j.record(
            3,
            Some(&Operation::UnpinTenant {
                tenant: TenantId::new("c").unwrap(),
            }),
        );
        let c = j.since(1, 3);
        assert!(!c.all);
        assert_eq!(c.keys, BTreeSet::from([key("b")]));
        assert_eq!(c.tenants, BTreeSet::from([TenantId::new("c").unwrap()]));
        assert!(j.since(3, 3).is_empty());
        // A batch of assignments names each of its tenants.
        let (d, e) = (TenantId::new("d").unwrap(), TenantId::new("e").unwrap());
        j.record(
            4,
            Some(&Operation::AssignPlans {
                assignments: vec![(d.clone(), None), (e.clone(), None)],
            }),
        );
        assert_eq!(j.since(3, 4).tenants, BTreeSet::from([d, e]));
    }

    #[test]
    fn promotions_and_plan_changes_mark_the_promoted_subjects() {
        let mut j = Journal::default();
        j.record(1, Some(&unpin("a")));
        assert!(!j.since(0, 1).promoted);
        j.record(
            2,
            Some(&Operation::SetPromoted {
                membership: 1,
                changes: vec![],
            }),
        );
        let c = j.since(1, 2);
        assert!(c.promoted && !c.is_empty() && c.keys.is_empty());
        let plan = TenantId::for_plan(&quota_core::PlanName::new("pro").unwrap());
        j.record(
            3,
            Some(&Operation::Unpin {
                key: PolicyKey::new(plan, PolicyName::new("p").unwrap()),
            }),
        );
        assert!(j.since(2, 3).promoted);
    }

    #[test]
    fn a_region_change_or_a_reader_too_far_behind_rebuilds_whole() {
        let mut j = Journal::default();
        j.record(1, Some(&unpin("a")));
        j.record(
            2,
            Some(&Operation::RemoveRegion {
                region: quota_core::RegionId::new("x").unwrap(),
            }),
        );
        assert!(j.since(1, 2).all);
        assert!(!j.since(2, 2).all);
        let mut j = Journal::default();
        for r in 1..=(JOURNAL_REVISIONS as u64 + 10) {
            j.record(r, Some(&unpin("a")));
        }
        assert!(j.since(1, JOURNAL_REVISIONS as u64 + 10).all);
        assert!(!j.since(20, JOURNAL_REVISIONS as u64 + 10).all);
        // A membership entry or anything unknown (None) asks for everything.
        j.record(JOURNAL_REVISIONS as u64 + 11, None);
        assert!(
            j.since(JOURNAL_REVISIONS as u64 + 10, JOURNAL_REVISIONS as u64 + 11)
                .all
        );
        j.clear();
        assert!(j.since(5, JOURNAL_REVISIONS as u64 + 11).all);
    }
}
