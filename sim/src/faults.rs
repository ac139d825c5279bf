//! Faults: what breaks, where and when. A schedule is plain data fixed before a run starts, so
//! every strategy meets exactly the same failures at exactly the same virtual times.

use serde::Serialize;

use crate::region::RegionIx;

/// One fault over the half-open virtual interval `[from_ms, until_ms)`.
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
    /// The daemon of `region` is down (a crashed leader when `region` leads): no reports, no
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
    /// The daemon holding `region`'s agent role is killed at `from_ms` and another daemon of the
    /// region has taken the role over by `until_ms`. Until then the region sends no usage and
    /// writes no parameters (its Redis keeps the share and lease end last written), while its
    /// lease renewals go on and its checks are still decided.
    AgentMove {
        region: RegionIx,
        from_ms: u64,
        until_ms: u64,
    },
}

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
    /// Whether `region` is never cut off, crashed nor without its agent during the run: its
    /// goodput is the one a fault elsewhere must not cost anything.
    pub fn healthy(&self, region: RegionIx) -> bool {
        !self.list.iter().any(|f| match *f {
            Fault::Isolate { region: r, .. }
            | Fault::Crash { region: r, .. }
            | Fault::AgentMove { region: r, .. } => r == region,
            Fault::RedisOutage { .. } => false,
        })
    }

    /// The same schedule without the cuts, crashes and agent moves that make a region
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

    /// Whether the daemon of `region` is running at `t_ms`.
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

    /// Whether the agent role of `region` is between daemons at `t_ms` (no usage reports, no
    /// parameter writes).
    pub fn agent_paused(&self, region: RegionIx, t_ms: u64) -> bool {
        self.list.iter().any(|f| match *f {
            Fault::AgentMove {
                region: r,
                from_ms,
                until_ms,
            } => r == region && Fault::covers(from_ms, until_ms, t_ms),
            _ => false,
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
                Fault::AgentMove {
                    region: 1,
                    from_ms: 30,
                    until_ms: 40,
                },
            ],
        };
        assert!(!f.isolated(1, 99) && f.isolated(1, 100) && f.isolated(1, 199));
        assert!(!f.isolated(1, 200) && !f.isolated(0, 150));
        assert!(f.daemon_up(0, 49) && !f.daemon_up(0, 50) && f.daemon_up(0, 60));
        assert!(f.daemon_up(1, 55));
        assert!(!f.redis_up(2, 0) && f.redis_up(2, 10) && f.redis_up(1, 5));
        assert!(!f.agent_paused(1, 29) && f.agent_paused(1, 30) && !f.agent_paused(1, 40));
        assert!(!f.agent_paused(0, 35) && f.daemon_up(1, 35) && !f.isolated(1, 35));
    }

    #[test]
    fn an_agent_move_makes_its_region_unhealthy_and_leaves_the_baseline() {
        let f = Faults {
            list: vec![
                Fault::AgentMove {
                    region: 1,
                    from_ms: 30,
                    until_ms: 40,
                },
                Fault::RedisOutage {
                    region: 2,
                    from_ms: 0,
                    until_ms: 10,
                },
            ],
        };
        assert!(f.healthy(0) && !f.healthy(1) && f.healthy(2));
        let calm = f.without_cuts();
        assert_eq!(calm.list.len(), 1);
        assert!(!calm.agent_paused(1, 35) && !calm.redis_up(2, 5));
    }
}
