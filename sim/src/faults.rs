//! Faults: what breaks, where and when. A schedule is plain data fixed before a run starts, so
//! every strategy meets exactly the same failures at exactly the same virtual times.

use serde::Serialize;

use crate::region::RegionIx;

/// One fault, over the half-open virtual interval `[from_ms, until_ms)` or, for an agent stop, at
/// one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// Every WAN link of `region` is down: it is cut off from the majority (its own Redis and
    /// clients still work).
    Isolate {
        region: RegionIx,
        from_ms: u64,
        until_ms: u64,
    },
    /// The daemons of `region` are down (a crashed leader when `region` leads): no reports, no
    /// grants, no votes. Its Redis keeps enforcing what was last written.
    Crash {
        region: RegionIx,
        from_ms: u64,
        until_ms: u64,
    },
    /// The regional Redis of `region` is unreachable; each policy's fail mode applies.
    RedisOutage {
        region: RegionIx,
        from_ms: u64,
        until_ms: u64,
    },
    /// The daemon holding `region`'s agent role stops at `at_ms` (nothing happens if no daemon
    /// holds it then). Another daemon of the region takes the role over, and one started in
    /// the stopped one's place joins as a standby [`RESTART_MS`] later.
    AgentStop {
        region: RegionIx,
        at_ms: u64,
        how: Stop,
    },
}

/// How a daemon holding its region's agent role stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    /// SIGTERM (a rolling upgrade, a node drain): once it has stopped deciding and writing it
    /// sends `ReleaseAgent`, so a standby claims the role at its next look; its lease record,
    /// its acknowledgement frozen, goes once the new holder's first pass is in Redis
    /// (`AgentPassed`).
    Graceful,
    /// kill -9: it goes quiet, like a paused daemon that may resume. A standby claims the role
    /// after three report intervals without its renewals; its lease record, its
    /// acknowledgement frozen, goes once the new holder's first pass is in Redis.
    Killed,
}

/// How long after an [`Fault::AgentStop`] a daemon started in the stopped one's place (as
/// Kubernetes restarts a pod) joins its region as a standby. It joins as a new node: nothing
/// renews a killed daemon's record.
pub const RESTART_MS: u64 = 5_000;

impl Fault {
    fn covers(from_ms: u64, until_ms: u64, t_ms: u64) -> bool {
        (from_ms..until_ms).contains(&t_ms)
    }
}

/// The fault schedule of one run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Faults {
    pub list: Vec<Fault>,
}

impl Faults {
    /// Whether `region` is never cut off, crashed nor loses its agent's holder during the run: its
    /// goodput is the one a fault elsewhere must not cost anything.
    pub fn healthy(&self, region: RegionIx) -> bool {
        !self.list.iter().any(|f| match *f {
            Fault::Isolate { region: r, .. }
            | Fault::Crash { region: r, .. }
            | Fault::AgentStop { region: r, .. } => r == region,
            Fault::RedisOutage { .. } => false,
        })
    }

    /// The same schedule without the cuts, crashes and agent stops that make a region
    /// unhealthy: the run a fault-free baseline of healthy goodput is measured in.
    pub fn without_cuts(&self) -> Faults {
        Faults {
            list: self
                .list
                .iter()
                .filter(|f| matches!(f, Fault::RedisOutage { .. }))
                .copied()
                .collect(),
        }
    }

    /// Whether `region` is cut off from every other region at `t_ms`.
    pub fn isolated(&self, region: RegionIx, t_ms: u64) -> bool {
        self.list.iter().any(|f| match *f {
            Fault::Isolate {
                region: r,
                from_ms,
                until_ms,
            } => r == region && Fault::covers(from_ms, until_ms, t_ms),
            _ => false,
        })
    }

    /// Whether the daemons of `region` are running at `t_ms`.
    pub fn daemon_up(&self, region: RegionIx, t_ms: u64) -> bool {
        !self.list.iter().any(|f| match *f {
            Fault::Crash {
                region: r,
                from_ms,
                until_ms,
            } => r == region && Fault::covers(from_ms, until_ms, t_ms),
            _ => false,
        })
    }

    /// How many daemons `region` runs: two where the agent's holder stops (the other stands
    /// by to take the role over), one elsewhere.
    pub fn daemons(&self, region: RegionIx) -> usize {
        let stops = self
            .list
            .iter()
            .any(|f| matches!(*f, Fault::AgentStop { region: r, .. } if r == region));
        if stops {
            2
        } else {
            1
        }
    }

    /// The agent stops in `region` at `from_ms..=until_ms`, in time order.
    pub fn agent_stops(
        &self,
        region: RegionIx,
        from_ms: u64,
        until_ms: u64,
    ) -> impl Iterator<Item = (u64, Stop)> + '_ {
        self.list.iter().filter_map(move |f| match *f {
            Fault::AgentStop {
                region: r,
                at_ms,
                how,
            } if r == region && (from_ms..=until_ms).contains(&at_ms) => Some((at_ms, how)),
            _ => None,
        })
    }

    /// Whether the Redis of `region` answers at `t_ms`.
    pub fn redis_up(&self, region: RegionIx, t_ms: u64) -> bool {
        !self.list.iter().any(|f| match *f {
            Fault::RedisOutage {
                region: r,
                from_ms,
                until_ms,
            } => r == region && Fault::covers(from_ms, until_ms, t_ms),
            _ => false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_are_half_open_and_per_region() {
        let f = Faults {
            list: vec![
                Fault::Isolate {
                    region: 1,
                    from_ms: 100,
                    until_ms: 200,
                },
                Fault::Crash {
                    region: 0,
                    from_ms: 50,
                    until_ms: 60,
                },
                Fault::RedisOutage {
                    region: 2,
                    from_ms: 0,
                    until_ms: 10,
                },
                Fault::AgentStop {
                    region: 1,
                    at_ms: 30,
                    how: Stop::Killed,
                },
            ],
        };
        assert!(!f.isolated(1, 99) && f.isolated(1, 100) && f.isolated(1, 199));
        assert!(!f.isolated(1, 200) && !f.isolated(0, 150));
        assert!(f.daemon_up(0, 49) && !f.daemon_up(0, 50) && f.daemon_up(0, 60));
        assert!(f.daemon_up(1, 55));
        assert!(!f.redis_up(2, 0) && f.redis_up(2, 10) && f.redis_up(1, 5));
        assert_eq!(f.agent_stops(1, 0, 29).count(), 0);
        assert_eq!(
            f.agent_stops(1, 30, 30).collect::<Vec<_>>(),
            [(30, Stop::Killed)]
        );
        assert_eq!(f.agent_stops(1, 31, 100).count(), 0);
        assert_eq!(f.agent_stops(0, 0, 100).count(), 0);
        assert!(f.daemon_up(1, 35) && !f.isolated(1, 35));
    }

    #[test]
    fn an_agent_stop_gives_its_region_a_standby_and_leaves_the_baseline() {
        let f = Faults {
            list: vec![
                Fault::AgentStop {
                    region: 1,
                    at_ms: 30,
                    how: Stop::Graceful,
                },
                Fault::RedisOutage {
                    region: 2,
                    from_ms: 0,
                    until_ms: 10,
                },
            ],
        };
        assert!(f.healthy(0) && !f.healthy(1) && f.healthy(2));
        assert_eq!((f.daemons(0), f.daemons(1), f.daemons(2)), (1, 2, 1));
        let calm = f.without_cuts();
        assert_eq!(calm.list.len(), 1);
        assert_eq!(calm.agent_stops(1, 0, 100).count(), 0);
        assert!(!calm.redis_up(2, 5));
    }
}
