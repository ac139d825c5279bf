//! Readable traces: a counterexample path told one event a line, with what every region
//! enforces after it.

use std::fmt::Write as _;

use quota_core::coordinator::DaemonLease;
use quota_core::lease::Revocation;
use quota_store::Fence;
use stateright::Model as _;

use crate::model::{Action, LeaseModel};
use crate::properties::{gateway, in_process, region_enforced, total};
use crate::state::{Clock, Msg, State, Step};
use crate::world::{node_of, units, Guard, A, DAEMON_NAMES, REGION_NAMES};

/// Tells a path from the initial state, one line per event.
pub fn narrate(m: &LeaseModel, path: &[(State, Option<Action>)]) -> String {
    let mut out = String::new();
    if let Some((first, _)) = path.first() {
        let _ = writeln!(out, "start: {}", enforced(m, first));
    }
    for pair in path.windows(2) {
        let (before, Some(action)) = &pair[0] else {
            continue;
        };
        let after = &pair[1].0;
        let _ = writeln!(
            out,
            "t={} {}\n      {}",
            before.t,
            event(m, before, *action, after),
            enforced(m, after)
        );
    }
    out
}

/// Tells a path given as actions from the initial state.
pub fn narrate_actions(m: &LeaseModel, actions: &[Action]) -> String {
    let m = &m.exact();
    let mut s = m.init_states().remove(0);
    let mut path = Vec::new();
    for &a in actions {
        let next = m.next_state(&s, a).expect("the action is enabled");
        path.push((s, Some(a)));
        s = next;
    }
    path.push((s, None));
    narrate(m, &path)
}

/// Σ enforced now, per region, A with its parts.
fn enforced(m: &LeaseModel, s: &State) -> String {
    let mut parts = vec![format!("redis {}", units(gateway(s)))];
    for (d, name) in DAEMON_NAMES.iter().enumerate() {
        parts.push(format!("{name} {}", units(in_process(m, s, d))));
    }
    format!(
        "enforced: A {} ({}) + B {} = {}",
        units(region_enforced(m, s, A)),
        parts.join(", "),
        units(region_enforced(m, s, crate::world::B)),
        units(total(m, s) as u32)
    )
}

fn clock_name(c: Clock) -> String {
    match c {
        Clock::Leader => "the leader's clock".into(),
        Clock::Daemon(d) => format!("{}'s clock", DAEMON_NAMES[usize::from(d)]),
        Clock::Redis => "Redis A's clock".into(),
    }
}

fn revocation(r: &Revocation) -> String {
    format!(
        "{} may still enforce {} until it acks epoch {} or coordinator time passes {}",
        REGION_NAMES[usize::from(r.region)],
        units(r.share_ppm),
        r.epoch,
        r.deadline_ms
    )
}

fn event(m: &LeaseModel, b: &State, action: Action, a: &State) -> String {
    let name = |d: u8| DAEMON_NAMES[usize::from(d)];
    match action {
        Action::Tick(step) => {
            let drift = match step {
                None => String::new(),
                Some(Step::Slow(c)) => format!(", {} does not advance (slow)", clock_name(c)),
                Some(Step::Fast(c)) => format!(", {} advances two (fast)", clock_name(c)),
            };
            format!("time passes to t={}{drift}", a.t)
        }
        Action::Reshare { region, up } => {
            let r = usize::from(region);
            let key = &m.key;
            let (old, new) = (b.coord.entries[key].share(r), a.coord.entries[key].share(r));
            let revs: Vec<String> = a.coord.entries[key]
                .revocations
                .iter()
                .map(revocation)
                .collect();
            format!(
                "leader {} {} {} -> {} at coordinator time {}: epoch {}{}",
                if up { "raises" } else { "cuts" },
                REGION_NAMES[r],
                units(old),
                units(new),
                a.coord.last_now_ms,
                a.coord.epoch,
                if revs.is_empty() {
                    String::new()
                } else {
                    format!("; {}", revs.join("; "))
                }
            )
        }
        Action::CatchUp(d) => {
            let x = &a.daemons[usize::from(d)];
            let deposed = b.daemons[usize::from(d)].fence.is_some() && x.fence.is_none();
            format!(
                "{} applies the log: epoch {}, grant {} (floor {}), holder fence {}{}",
                name(d),
                x.view.applied_epoch(),
                units(x.grant.share_ppm),
                units(x.grant.floor_ppm),
                x.view_fence,
                if deposed {
                    " - deposed, stops writing"
                } else {
                    ""
                }
            )
        }
        Action::Renew(d) => {
            let (ack_b, ack_a) = (acked(b), acked(a));
            let note = match record(a, usize::from(d)) {
                Some(r) if r.deposed => " (its record is deposed: unchanged)",
                Some(r) if r.left => " (its record is left: its ack stays)",
                _ => "",
            };
            format!(
                "{} renews, acking epoch {} (local {}); committed at coordinator time {}{}: \
                 A acked {}{}",
                name(d),
                m.ack_of(b, usize::from(d)),
                b.local_ms(usize::from(d)),
                a.coord.last_now_ms,
                note,
                ack_a,
                if ack_a != ack_b {
                    format!(" (was {ack_b})")
                } else {
                    String::new()
                }
            )
        }
        Action::Claim(d) => {
            let won = a.daemons[usize::from(d)].fence;
            let left: Vec<&str> = DAEMON_NAMES
                .iter()
                .enumerate()
                .filter(|&(o, _)| {
                    record(a, o).is_some_and(|r| r.left) && !record(b, o).is_some_and(|r| r.left)
                })
                .map(|(_, n)| *n)
                .collect();
            format!(
                "{} claims A's agent role (fence seen {}): {}{}{}",
                name(d),
                b.daemons[usize::from(d)].view_fence,
                won.map_or("refused".to_string(), |f| format!(
                    "holds it with fence {f}"
                )),
                if left.is_empty() {
                    String::new()
                } else {
                    format!("; {}'s record is deposed (frozen)", left.join(", "))
                },
                if won.is_some() && a.daemons[usize::from(d)].passed {
                    format!("; {} commits AgentPassed at once", name(d))
                } else {
                    String::new()
                }
            )
        }
        Action::Write(d) => {
            let w = a
                .net
                .iter()
                .find_map(|msg| match msg {
                    Msg::Write { daemon, write } if *daemon == d && !b.net.contains(msg) => {
                        Some(*write)
                    }
                    _ => None,
                })
                .expect("the write is in flight");
            format!(
                "{} sends a write: share {}, epoch {}, fence {}, {} left, not after {}",
                name(d),
                units(w.share_ppm),
                w.epoch,
                w.fence,
                w.remaining_ms,
                w.not_after_ms.map_or("-".into(), |n| n.to_string())
            )
        }
        Action::WriteOk(d) => {
            let o = b.daemons[usize::from(d)]
                .outstanding
                .expect("a write answered");
            let held = a.daemons[usize::from(d)]
                .held
                .filter(|h| h.fence == o.fence && h.epoch == o.epoch && !h.dirty);
            let outcome = match held {
                None => ", but it no longer holds the role".to_string(),
                Some(h) if !m.replicated(a, &h) => {
                    ", but WAIT 1 finds the replica without it: not acknowledged".to_string()
                }
                Some(_) if m.guarded(Guard::WaitBeforeAck) => {
                    ", and WAIT 1 finds the replica has it: its pass is complete".to_string()
                }
                Some(_) => ": its pass is complete (no WAIT)".to_string(),
            };
            format!(
                "{} hears its write of epoch {} answered by the primary{outcome}",
                name(d),
                o.epoch
            )
        }
        Action::Passed(d) => {
            let gone: Vec<&str> = DAEMON_NAMES
                .iter()
                .enumerate()
                .filter(|&(o, _)| record(b, o).is_some_and(|r| r.left) && record(a, o).is_none())
                .map(|(_, n)| *n)
                .collect();
            format!(
                "{} commits AgentPassed (fence {}): {}; A acked {}",
                name(d),
                a.daemons[usize::from(d)].fence.unwrap_or(0),
                if gone.is_empty() {
                    "no record was left".to_string()
                } else {
                    format!("{}'s left record goes", gone.join(", "))
                },
                acked(a)
            )
        }
        Action::Deliver(msg) => delivered(m, b, msg, a),
        Action::Duplicate(msg) => format!("(a duplicate) {}", delivered(m, b, msg, a)),
        Action::Replicate => format!(
            "Redis A's replica takes the primary's state (epoch {}, fence {})",
            a.redis.replica.epoch, a.redis.replica.fence
        ),
        Action::Failover => {
            let x = a.redis.primary;
            format!(
                "Redis A fails over, losing the primary's last write: it holds share {}, \
                 epoch {}, fence {}, until {}",
                units(x.share_ppm),
                x.epoch,
                x.fence,
                x.until_ms
            )
        }
        Action::Stop(d) => {
            let x = usize::from(d);
            let outcome = match (record(b, x), record(a, x)) {
                (Some(_), Some(r)) if r.left && r.deposed => {
                    "its record is deposed: unchanged".to_string()
                }
                (Some(_), Some(r)) if r.left => format!(
                    "gives up the role; its record is left (ack {} frozen)",
                    r.acked_epoch
                ),
                (Some(_), None) => "its record goes".to_string(),
                _ => "no record".to_string(),
            };
            format!(
                "{} stops (SIGTERM), deciding and writing nothing more: {outcome}; A acked {}",
                name(d),
                acked(a)
            )
        }
        Action::Kill(d) => format!(
            "{} is killed (SIGKILL): it decides and writes nothing more, and says nothing",
            name(d)
        ),
        Action::Cut => "region A is cut off from the coordinator".into(),
        Action::Heal => "region A is reconnected".into(),
    }
}

fn delivered(m: &LeaseModel, b: &State, msg: Msg, a: &State) -> String {
    let name = |d: u8| DAEMON_NAMES[usize::from(d)];
    match msg {
        Msg::Lease {
            daemon,
            epoch,
            start_local_ms,
            lease_ms,
        } => {
            let d = &a.daemons[usize::from(daemon)];
            let usable = d
                .view
                .lease()
                .is_some_and(|l| l.start_local_ms == start_local_ms && l.epoch <= epoch);
            format!(
                "{} hears its lease (epoch {epoch}, from local {start_local_ms}): {}",
                name(daemon),
                if usable {
                    format!(
                        "in force until local {}",
                        start_local_ms + lease_ms - m.margin_ms()
                    )
                } else {
                    "not usable yet".into()
                }
            )
        }
        Msg::Write { daemon, write } => {
            let before = b.redis.primary;
            let why = Fence::refuses(
                Some(Fence {
                    token: before.fence,
                    epoch: before.epoch,
                }),
                Some(Fence {
                    token: write.fence,
                    epoch: write.epoch,
                }),
            );
            if let Some(why) = why.filter(|_| m.guarded(Guard::FenceCheck)) {
                format!("Redis A refuses {}'s write: {why}", name(daemon))
            } else {
                let x = a.redis.primary;
                format!(
                    "Redis A takes {}'s write at its time {}: share {}, epoch {}, fence {}, \
                     until {}",
                    name(daemon),
                    a.redis_ms(),
                    units(x.share_ppm),
                    x.epoch,
                    x.fence,
                    x.until_ms
                )
            }
        }
    }
}

fn acked(s: &State) -> u64 {
    s.coord.region(A).map_or(0, |r| r.acked_epoch)
}

/// Daemon `d`'s lease record at the coordinator.
fn record(s: &State, d: usize) -> Option<DaemonLease> {
    s.coord
        .region(A)
        .and_then(|r| r.daemons.get(&node_of(d)).copied())
}
