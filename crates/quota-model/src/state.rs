//! The model's state: the coordinator (quota-core's real state machine), each daemon, each
//! region's Redis (a primary and its replica), the messages in flight, the clocks, and what
//! the run has spent of its bounds.

use std::hash::{Hash, Hasher};
use std::ops::Deref;
use std::sync::Arc;

use quota_core::coordinator::RegionShare;
use quota_core::region::RegionView;
use quota_core::CoordinatorState;

use crate::world::{BASE_MS, DAEMONS};

/// The replicated coordinator state, as quota-core defines and `apply` changes it.
///
/// Hashed on the fields a lease, a share or a fence depends on; the rest (ids, the policy,
/// membership) never changes in a run, and the deduplication window is emptied after every
/// command (a duplicate that arrives is applied again, as one past the window would be).
/// `last_now_ms` is left out too: the leader's clock never goes back in the model, so the
/// clamp it feeds never acts.
///
/// Shared between states until a command changes it: most events leave it alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Coord(Arc<CoordinatorState>);

impl Coord {
    pub fn new(state: CoordinatorState) -> Self {
        Self(Arc::new(state))
    }

    /// The state to change, copied first if another model state shares it.
    pub fn make_mut(&mut self) -> &mut CoordinatorState {
        Arc::make_mut(&mut self.0)
    }
}

impl Deref for Coord {
    type Target = CoordinatorState;

    fn deref(&self) -> &CoordinatorState {
        &self.0
    }
}

impl Hash for Coord {
    fn hash<H: Hasher>(&self, h: &mut H) {
        let s: &CoordinatorState = &self.0;
        (s.epoch, s.last_fence).hash(h);
        for r in s.regions.iter().flatten() {
            (r.lease_expires_at_ms, r.acked_epoch).hash(h);
            for (node, d) in &r.daemons {
                (node, d.acked_epoch, d.lease_expires_at_ms, d.left).hash(h);
            }
            r.agent.map(|a| (a.node, a.fence)).hash(h);
        }
        for e in s.entries.values() {
            e.shares_ppm.hash(h);
            e.revocations.hash(h);
        }
    }
}

/// A clock the model can step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Clock {
    /// The clock that stamps commands: the leader's, so a step ahead is a leader change to
    /// a node whose clock is ahead.
    Leader,
    /// A daemon's monotonic clock.
    Daemon(u8),
    /// Region A's Redis server clock (`TIME`).
    Redis,
}

/// A clock step taken with a tick: the clock does not advance (slow) or advances two (fast).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Step {
    Slow(Clock),
    Fast(Clock),
}

/// A parameter write as the holder sends it to its Redis (`SetParams` with a lease end and a
/// fence).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Write {
    pub fence: u64,
    pub epoch: u64,
    pub share_ppm: u32,
    pub floor_ppm: u32,
    /// Time left on the writer's lease when it sent the write.
    pub remaining_ms: u64,
    /// The writer's lease end mapped onto Redis's clock (`LeaseEnd::not_after_ms`).
    pub not_after_ms: Option<u64>,
}

/// What one Redis node holds for the policy's bucket: the parameters with their lease end
/// and fence, as `set_params.lua` stores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stored {
    pub fence: u64,
    pub epoch: u64,
    pub share_ppm: u32,
    pub floor_ppm: u32,
    /// From this time on (Redis's clock) the scripts enforce the floor.
    pub until_ms: u64,
}

impl Stored {
    /// What a gateway deciding against this node enforces at `redis_now_ms`: the share before
    /// `until`, the floor (never above the share) from it on, as `token_bucket.lua` does.
    pub fn enforced(&self, redis_now_ms: u64) -> u32 {
        if redis_now_ms < self.until_ms {
            self.share_ppm
        } else {
            self.floor_ppm.min(self.share_ppm)
        }
    }
}

/// Region A's Redis: the primary gateways decide against, and a replica that a failover
/// promotes (losing what the primary had not yet replicated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Redis {
    pub off: i8,
    pub primary: Stored,
    pub replica: Stored,
}

/// A holder's write awaiting its reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Outstanding {
    pub fence: u64,
    pub epoch: u64,
    pub share_ppm: u32,
    /// The local end of the lease it was written under.
    pub until_ms: u64,
    /// The primary took it (a reply is on its way).
    pub landed: bool,
}

/// What the agent's ledger (quotad's `Written`) holds for the policy's bucket: what the
/// store was last told, as `record` keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Held {
    pub fence: u64,
    pub epoch: u64,
    /// The share the store may hold: after a write not (yet) answered, the larger of what it
    /// held and what was sent.
    pub share_ppm: u32,
    /// Until when, on the agent's clock: the local end of the lease the write was made
    /// under (after one not answered, the later of the two). 0 once it has run out, slack
    /// included.
    pub until_ms: u64,
    /// A write of this agent's was answered: what an earlier agent wrote is overwritten.
    pub confirmed: bool,
    /// The last write is not answered (yet): the store holds it or what it held before.
    pub dirty: bool,
}

/// One daemon: its replica's view of the coordinator, its lease clock (quota-core's
/// `RegionView`), and, as the agent, what it wrote.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Daemon {
    /// Clock offset: the monotonic clock reads `BASE_MS + t + off`.
    pub off: i8,
    /// The epoch applied and the lease usable for it (quota-core).
    pub view: RegionView,
    /// The region's grant at the applied epoch.
    pub grant: RegionShare,
    /// The agent role's fence as the applied state shows it (0: none).
    pub view_fence: u64,
    /// The newest epoch a renewal answer named (what an `AckApplied` mutant acknowledges).
    pub heard_epoch: u64,
    /// The role this daemon believes it holds: the fence its claim drew.
    pub fence: Option<u64>,
    /// The epoch the agent last acknowledged (quotad's `on_applied`); 0 for a standby, which
    /// acknowledges its view.
    pub acked: u64,
    /// The agent's ledger, emptied by a claim (`Written::new`); `None` until its first write.
    pub held: Option<Held>,
    /// Until when (its clock) shares an earlier agent stored may hold, for all the agent
    /// knows: its claim plus a lease (`Written::new`). 0 once run out, slack included.
    pub unknown_until_ms: u64,
    /// Whether the coordinator has the agent's `AgentPassed` (or needs none).
    pub passed: bool,
    /// The last write the primary answered that `WAIT` has not yet found on the replica
    /// (fence, epoch): quotad's `unconfirmed`.
    pub unconfirmed: Option<(u64, u64)>,
    /// Stopped (SIGTERM): it decides, renews and writes nothing more.
    pub stopped: bool,
    pub outstanding: Option<Outstanding>,
    pub renewals: u8,
    pub writes: u8,
    /// Liveness runs: renewed in the current tick.
    pub renewed_this_tick: bool,
}

/// A message in flight. Anything in flight may be delivered at any later time, in any order,
/// twice (within the bound), or never (which is loss, for every safety property).
///
/// Requests to the coordinator are not messages: a renewal or a claim commits when sent, or
/// is lost. Committing one later would only count the coordinator's lease from later and
/// record an older acknowledgement (each daemon's is the largest it sent, the region's the
/// least over live daemons), both towards safety; a late claim fails its compare-and-set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    /// The `LeaseRenewed` answer to a daemon, as `RegionLease::from_response` read it.
    Lease {
        daemon: u8,
        epoch: u64,
        start_local_ms: u64,
        lease_ms: u64,
    },
    /// A parameter write on its way to region A's Redis primary.
    Write { daemon: u8, write: Write },
}

/// What a run has spent of its bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Spent {
    pub reshares: u8,
    pub claims: u8,
    pub stops: u8,
    pub duplicates: u8,
    pub failovers: u8,
    pub cuts: u8,
    pub drift_steps: u8,
}

/// The whole model state.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct State {
    /// True time, in ticks.
    pub t: u8,
    /// The command-stamping clock's offset.
    pub leader_off: i8,
    pub coord: Coord,
    pub daemons: [Daemon; DAEMONS],
    pub redis: Redis,
    /// In flight, sorted (a multiset: the order of sending is not state).
    pub net: Vec<Msg>,
    /// Region A cannot reach the coordinator (its daemons, its Redis and gateways carry on).
    pub cut: bool,
    /// The tick region A was last reconnected.
    pub healed_at: Option<u8>,
    pub spent: Spent,
    /// Ghost: a write of a deposed agent (fence below the stored one) landed and raised the
    /// stored share.
    pub deposed_raise: bool,
    /// Ghost: while A was cut off, none of its daemons held a lease in force.
    pub lapsed: bool,
}

fn reading(t: u8, off: i8) -> u64 {
    (BASE_MS as i64 + i64::from(t) + i64::from(off)) as u64
}

impl State {
    /// The leader's clock: what it stamps commands with.
    pub fn leader_now_ms(&self) -> u64 {
        reading(self.t, self.leader_off)
    }

    /// Daemon `d`'s monotonic clock.
    pub fn local_ms(&self, d: usize) -> u64 {
        reading(self.t, self.daemons[d].off)
    }

    /// Region A's Redis clock.
    pub fn redis_ms(&self) -> u64 {
        reading(self.t, self.redis.off)
    }

    /// Puts a message in flight, keeping the multiset sorted.
    pub fn send(&mut self, m: Msg) {
        let at = self.net.partition_point(|x| *x <= m);
        self.net.insert(at, m);
    }

    /// Takes one copy of a message out of flight; false if none is there.
    pub fn take(&mut self, m: &Msg) -> bool {
        match self.net.iter().position(|x| x == m) {
            Some(i) => {
                self.net.remove(i);
                true
            }
            None => false,
        }
    }
}
