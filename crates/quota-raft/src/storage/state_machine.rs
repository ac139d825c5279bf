//! The replicated state machine: quota-core's `CoordinatorState` in memory, its snapshots in redb.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use openraft::storage::RaftStateMachine;
use openraft::{EntryPayload, OptionalSend, RaftLogId, RaftSnapshotBuilder, StorageIOError};
use quota_core::coordinator::{CoordinatorState, Operation};
use redb::{Database, Durability, ReadableDatabase};
use tokio::sync::watch;

use super::changes::{Changes, Journal};
use super::{any, blocking, snapshot_key, OpenError, SNAPSHOT};
use crate::codec::{decode, encode};
use crate::types::alias::{Entry, LogId, Snapshot, SnapshotMeta, StorageError, StoredMembership};
use crate::types::{Reply, TypeConfig};

/// The applied state and the log position it reflects, always updated together.
#[derive(Debug, Default)]
struct Applied {
    state: CoordinatorState,
    last_applied: Option<LogId>,
    membership: StoredMembership,
    /// Bumped by every change other than a lease renewal (see [`StateHandle::read_revised`]).
    revision: u64,
    /// What each recent revision touched (see [`StateHandle::read_changes`]).
    journal: Journal,
}

#[derive(Debug)]
struct Shared {
    applied: RwLock<Applied>,
    /// The index of the last applied entry, for waiters.
    applied_tx: watch::Sender<Option<u64>>,
    snapshot_seq: AtomicU64,
}

impl Shared {
    // A poisoned lock means a panic while applying; the state is still the last fully written
    // one (apply mutates only through quota-core's apply), so reading on is sound.
    fn read(&self) -> RwLockReadGuard<'_, Applied> {
        self.applied.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Applied> {
        self.applied.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// A cheap, cloneable read handle on the applied state.
#[derive(Debug, Clone)]
pub struct StateHandle {
    shared: Arc<Shared>,
}

impl StateHandle {
    /// Runs `f` on the applied state under a read lock; keep `f` short, it delays applies.
    pub fn read<R>(&self, f: impl FnOnce(&CoordinatorState) -> R) -> R {
        f(&self.shared.read().state)
    }

    /// Runs `f` on the applied state and its revision: a number, in this process only, that
    /// changes with every applied command except `RenewLease` (and with every membership change
    /// and snapshot install). Renewals are the steady stream (each region, every report
    /// interval) and touch only regions' leases, so a reader deriving something from policies,
    /// shares and pins can keep it while the revision stays the same.
    pub fn read_revised<R>(&self, f: impl FnOnce(&CoordinatorState, u64) -> R) -> R {
        let applied = self.shared.read();
        f(&applied.state, applied.revision)
    }

    /// Runs `f` on the applied state, its revision, and what changed since revision `since`
    /// (`None`: everything): a reader that derives something per policy updates only the
    /// policies a command touched, so one admin write costs it O(what changed).
    pub fn read_changes<R>(
        &self,
        since: Option<u64>,
        f: impl FnOnce(&CoordinatorState, u64, Changes) -> R,
    ) -> R {
        let applied = self.shared.read();
        let changes = match since {
            Some(since) => applied.journal.since(since, applied.revision),
            None => Changes::everything(),
        };
        f(&applied.state, applied.revision, changes)
    }

    /// The log id of the last applied entry.
    pub fn last_applied(&self) -> Option<LogId> {
        self.shared.read().last_applied
    }

    /// A receiver that changes whenever the applied index does.
    pub fn subscribe(&self) -> watch::Receiver<Option<u64>> {
        self.shared.applied_tx.subscribe()
    }
}

/// The state machine half of the storage.
#[derive(Debug, Clone)]
pub struct StateMachineStore {
    db: Arc<Database>,
    shared: Arc<Shared>,
}

impl StateMachineStore {
    /// Loads the latest stored snapshot, if any, as the starting state.
    pub(super) fn open(db: Arc<Database>) -> Result<Self, OpenError> {
        let applied =
            match read_snapshot(&db).map_err(|e| OpenError::Snapshot { source: e.into() })? {
                Some((meta, data)) => Applied {
                    state: decode(&data).map_err(|source| OpenError::Codec { source })?,
                    last_applied: meta.last_log_id,
                    membership: meta.last_membership,
                    revision: 0,
                    journal: Journal::default(),
                },
                None => Applied::default(),
            };
        let (applied_tx, _) = watch::channel(applied.last_applied.map(|l| l.index));
        let shared = Arc::new(Shared {
            applied: RwLock::new(applied),
            applied_tx,
            snapshot_seq: AtomicU64::new(0),
        });
        Ok(Self { db, shared })
    }

    /// A read handle on the applied state.
    pub fn handle(&self) -> StateHandle {
        StateHandle {
            shared: self.shared.clone(),
        }
    }
}

fn read_snapshot(db: &Database) -> Result<Option<(SnapshotMeta, Vec<u8>)>, anyerror::AnyError> {
    let txn = db.begin_read().map_err(any)?;
    let table = match txn.open_table(SNAPSHOT) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
        Err(e) => return Err(any(e)),
    };
    let meta = table.get(snapshot_key::META).map_err(any)?;
    let data = table.get(snapshot_key::DATA).map_err(any)?;
    match (meta, data) {
        (Some(meta), Some(data)) => {
            let meta: SnapshotMeta = decode(meta.value()).map_err(any)?;
            Ok(Some((meta, data.value().to_vec())))
        }
        _ => Ok(None),
    }
}

/// Stores a snapshot durably, replacing the previous one in the same transaction.
fn write_snapshot(db: &Database, meta: &SnapshotMeta, data: &[u8]) -> Result<(), StorageError> {
    let run = || -> Result<(), anyerror::AnyError> {
        let meta_bytes = encode(meta).map_err(any)?;
        let mut txn = db.begin_write().map_err(any)?;
        txn.set_durability(Durability::Immediate).map_err(any)?;
        {
            let mut table = txn.open_table(SNAPSHOT).map_err(any)?;
            table
                .insert(snapshot_key::META, meta_bytes.as_slice())
                .map_err(any)?;
            table.insert(snapshot_key::DATA, data).map_err(any)?;
        }
        txn.commit().map_err(any)
    };
    blocking(run).map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), e).into())
}

/// Builds snapshots of the applied state; holds a handle, not a copy.
#[derive(Debug)]
pub struct SnapshotBuilder {
    db: Arc<Database>,
    shared: Arc<Shared>,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot, StorageError> {
        // Encode under the read lock: applies wait, readers do not, and no full copy is made.
        let (meta, data) = {
            let applied = self.shared.read();
            let data =
                encode(&applied.state).map_err(|e| StorageIOError::write_snapshot(None, any(e)))?;
            let seq = self.shared.snapshot_seq.fetch_add(1, Ordering::Relaxed);
            let snapshot_id = match applied.last_applied {
                Some(l) => format!("{}-{}-{seq}", l.leader_id.term, l.index),
                None => format!("0-0-{seq}"),
            };
            let meta = SnapshotMeta {
                last_log_id: applied.last_applied,
                last_membership: applied.membership.clone(),
                snapshot_id,
            };
            (meta, data)
        };
        write_snapshot(&self.db, &meta, &data)?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(data),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let applied = self.shared.read();
        Ok((applied.last_applied, applied.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Reply>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut replies = Vec::new();
        let last = {
            let mut applied = self.shared.write();
            for entry in entries {
                applied.last_applied = Some(*entry.get_log_id());
                let reply = match entry.payload {
                    EntryPayload::Blank => None,
                    EntryPayload::Normal(ref cmd) => {
                        if !matches!(
                            cmd.op,
                            Operation::RenewLease { .. } | Operation::RenewDaemonLease { .. }
                        ) {
                            applied.revision += 1;
                            let revision = applied.revision;
                            applied.journal.record(revision, Some(&cmd.op));
                        }
                        Some(applied.state.apply(cmd))
                    }
                    EntryPayload::Membership(ref m) => {
                        applied.revision += 1;
                        let revision = applied.revision;
                        applied.journal.record(revision, None);
                        applied.membership =
                            StoredMembership::new(Some(*entry.get_log_id()), m.clone());
                        None
                    }
                };
                replies.push(reply);
            }
            applied.last_applied
        };
        self.shared.applied_tx.send_replace(last.map(|l| l.index));
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder {
            db: self.db.clone(),
            shared: self.shared.clone(),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Vec<u8>>, StorageError> {
        Ok(Box::default())
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<Vec<u8>>,
    ) -> Result<(), StorageError> {
        let state: CoordinatorState = decode(&snapshot)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), any(e)))?;
        write_snapshot(&self.db, meta, &snapshot)?;
        {
            let mut applied = self.shared.write();
            applied.state = state;
            applied.revision += 1;
            applied.journal.clear();
            applied.last_applied = meta.last_log_id;
            applied.membership = meta.last_membership.clone();
        }
        self.shared
            .applied_tx
            .send_replace(meta.last_log_id.map(|l| l.index));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, StorageError> {
        let stored = read_snapshot(&self.db).map_err(|e| StorageIOError::read_snapshot(None, e))?;
        Ok(stored.map(|(meta, data)| Snapshot {
            meta,
            snapshot: Box::new(data),
        }))
    }
}
