//! Readiness: what a daemon waits for before it takes traffic (`/readyz`, `/v1/status`).
//!
//! A single region is ready as soon as it serves. A member of a replicated cluster is ready
//! once it can decide for its region and accept pins to it: its region is a member of the
//! applied coordinator state (a pin to it commits), every region of the Raft group is too (a
//! policy put now is split over all of them, so each decides its first check from its own
//! share), and it holds its first usable lease (renewed through the log, with the epoch it
//! was renewed at applied to the regional store), so it enforces its shares rather than its
//! floors. Readiness is reached once and then kept until shutdown: a region cut off later
//! still decides (on its lease, then its floors), and taking it out of rotation would turn a
//! partition into an outage of the limiter.

use std::fmt;

use quota_core::RegionId;

/// Something a daemon waits for before `/readyz` answers 200.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Awaited {
    /// This region registered in the applied coordinator state: until then a pin to it is
    /// refused and no policy gives it a share. The leader registers the configured regions on
    /// its first round; a node added at run time is registered when it is added.
    Membership { region: RegionId },
    /// Other regions of the Raft group not registered yet: a policy put now would start
    /// split without them.
    Regions { regions: Vec<RegionId> },
    /// A first usable lease: until then the region enforces only its floors.
    Lease,
}

impl fmt::Display for Awaited {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Awaited::Membership { region } => {
                write!(f, "region {region} to be registered in the coordinator state")
            }
            Awaited::Regions { regions } => {
                let names: Vec<&str> = regions.iter().map(RegionId::as_str).collect();
                write!(
                    f,
                    "regions {} to be registered in the coordinator state",
                    names.join(", ")
                )
            }
            Awaited::Lease => f.write_str(
                "a first lease (renewed through the coordinator, its epoch applied to the regional store)",
            ),
        }
    }
}

/// What `awaited` waits for, as one line: "a; b".
pub fn describe(awaited: &[Awaited]) -> String {
    awaited
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// What a member waits for, from the regions registered in its applied state, the regions
/// of its Raft group, and whether it holds a usable lease.
pub(crate) fn awaited<'a>(
    me: &RegionId,
    registered: impl Fn(&RegionId) -> bool,
    group: impl IntoIterator<Item = &'a RegionId>,
    leased: bool,
) -> Vec<Awaited> {
    let mut awaited = Vec::new();
    if !registered(me) {
        awaited.push(Awaited::Membership { region: me.clone() });
    }
    let mut missing: Vec<RegionId> = group
        .into_iter()
        .filter(|r| *r != me && !registered(r))
        .cloned()
        .collect();
    missing.sort();
    missing.dedup();
    if !missing.is_empty() {
        awaited.push(Awaited::Regions { regions: missing });
    }
    if !leased {
        awaited.push(Awaited::Lease);
    }
    awaited
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(names: &[&str]) -> Vec<RegionId> {
        names.iter().map(|n| RegionId::new(*n).unwrap()).collect()
    }

    #[test]
    fn a_member_waits_for_its_registration_the_groups_and_a_lease() {
        let group = ids(&["a", "b", "c"]);
        let me = &group[0];
        let table: [(&[&str], bool, Vec<Awaited>); 4] = [
            (
                &[],
                false,
                vec![
                    Awaited::Membership { region: me.clone() },
                    Awaited::Regions {
                        regions: ids(&["b", "c"]),
                    },
                    Awaited::Lease,
                ],
            ),
            (
                &["a", "c"],
                false,
                vec![
                    Awaited::Regions {
                        regions: ids(&["b"]),
                    },
                    Awaited::Lease,
                ],
            ),
            (&["a", "b", "c"], false, vec![Awaited::Lease]),
            (&["a", "b", "c"], true, vec![]),
        ];
        for (registered, leased, want) in table {
            let registered = ids(registered);
            let got = awaited(me, |r| registered.contains(r), &group, leased);
            assert_eq!(got, want, "registered {registered:?}, leased {leased}");
        }
    }

    #[test]
    fn what_is_awaited_reads_as_one_line() {
        let line = describe(&[
            Awaited::Membership {
                region: RegionId::new("a").unwrap(),
            },
            Awaited::Regions {
                regions: ids(&["b", "c"]),
            },
        ]);
        assert_eq!(
            line,
            "region a to be registered in the coordinator state; regions b, c to be registered \
             in the coordinator state"
        );
    }
}
