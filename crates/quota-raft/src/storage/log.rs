//! The Raft log, vote and committed index.

use std::fmt::Debug;
use std::ops::RangeBounds;
use std::sync::Arc;

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{OptionalSend, RaftLogId, RaftLogReader, StorageIOError};
use redb::{Database, Durability, ReadableDatabase, ReadableTable};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{any, blocking, meta_key, LOG, META};
use crate::codec::{decode, encode};
use crate::types::alias::{Entry, LogId, StorageError, Vote};
use crate::types::TypeConfig;

/// The log half of the storage; cheap to clone (it is also its own log reader).
#[derive(Debug, Clone)]
pub struct LogStore {
    db: Arc<Database>,
}

impl LogStore {
    pub(super) fn new(db: Arc<Database>) -> Self {
        Self { db }
    }

    /// A handle that tells when every user of the database has let go of it.
    pub fn closed_signal(&self) -> std::sync::Weak<Database> {
        Arc::downgrade(&self.db)
    }

    fn read_meta<T: DeserializeOwned>(
        &self,
        key: &str,
        err: fn(anyerror::AnyError) -> StorageIOError<u64>,
    ) -> Result<Option<T>, StorageError> {
        let run = || -> Result<Option<T>, anyerror::AnyError> {
            let txn = self.db.begin_read().map_err(any)?;
            let table = match txn.open_table(META) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
                Err(e) => return Err(any(e)),
            };
            match table.get(key).map_err(any)? {
                Some(v) => Ok(Some(decode(v.value()).map_err(any)?)),
                None => Ok(None),
            }
        };
        blocking(run).map_err(|e| err(e).into())
    }

    fn write_meta<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        durability: Durability,
        err: fn(anyerror::AnyError) -> StorageIOError<u64>,
    ) -> Result<(), StorageError> {
        let run = || -> Result<(), anyerror::AnyError> {
            let bytes = encode(value).map_err(any)?;
            let mut txn = self.db.begin_write().map_err(any)?;
            txn.set_durability(durability).map_err(any)?;
            {
                let mut table = txn.open_table(META).map_err(any)?;
                table.insert(key, bytes.as_slice()).map_err(any)?;
            }
            txn.commit().map_err(any)
        };
        blocking(run).map_err(|e| err(e).into())
    }

    /// Runs `f` on the log and meta tables in one write transaction, committed durably.
    fn write_log(
        &self,
        f: impl FnOnce(
            &mut redb::Table<u64, &[u8]>,
            &mut redb::Table<&str, &[u8]>,
        ) -> Result<(), anyerror::AnyError>,
    ) -> Result<(), StorageError> {
        let run = || -> Result<(), anyerror::AnyError> {
            let mut txn = self.db.begin_write().map_err(any)?;
            txn.set_durability(Durability::Immediate).map_err(any)?;
            {
                let mut log = txn.open_table(LOG).map_err(any)?;
                let mut meta = txn.open_table(META).map_err(any)?;
                f(&mut log, &mut meta)?;
            }
            txn.commit().map_err(any)
        };
        blocking(run).map_err(|e| StorageIOError::write_logs(e).into())
    }

    fn last_entry_log_id(&self) -> Result<Option<LogId>, StorageError> {
        let run = || -> Result<Option<LogId>, anyerror::AnyError> {
            let txn = self.db.begin_read().map_err(any)?;
            let table = match txn.open_table(LOG) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
                Err(e) => return Err(any(e)),
            };
            let last = match table.last().map_err(any)? {
                Some((_, v)) => {
                    let entry: Entry = decode(v.value()).map_err(any)?;
                    Some(*entry.get_log_id())
                }
                None => None,
            };
            Ok(last)
        };
        blocking(run).map_err(|e| StorageIOError::read_logs(e).into())
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let run = || -> Result<Vec<Entry>, anyerror::AnyError> {
            let txn = self.db.begin_read().map_err(any)?;
            let table = match txn.open_table(LOG) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(any(e)),
            };
            let mut out = Vec::new();
            for item in table.range::<u64>(range).map_err(any)? {
                let (_, v) = item.map_err(any)?;
                out.push(decode(v.value()).map_err(any)?);
            }
            Ok(out)
        };
        blocking(run).map_err(|e| StorageIOError::read_logs(e).into())
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged_log_id: Option<LogId> =
            self.read_meta(meta_key::LAST_PURGED, StorageIOError::read_logs)?;
        let last_log_id = self.last_entry_log_id()?.or(last_purged_log_id);
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError> {
        // Durable before returning: a vote forgotten in a crash could be cast twice in a term.
        self.write_meta(
            meta_key::VOTE,
            vote,
            Durability::Immediate,
            StorageIOError::write_vote,
        )
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
        self.read_meta(meta_key::VOTE, StorageIOError::read_vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        // No fsync of its own: a committed index lost in a crash only means re-applying less at
        // start-up (the leader re-sends it), and the next log append's fsync persists it anyway.
        self.write_meta(
            meta_key::COMMITTED,
            &committed,
            Durability::None,
            StorageIOError::write,
        )
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        let stored: Option<Option<LogId>> =
            self.read_meta(meta_key::COMMITTED, StorageIOError::read)?;
        Ok(stored.flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        self.write_log(|log, _| {
            for entry in entries {
                let bytes = encode(&entry).map_err(any)?;
                log.insert(entry.get_log_id().index, bytes.as_slice())
                    .map_err(any)?;
            }
            Ok(())
        })?;
        // Acknowledge only now: the transaction above committed with an fsync.
        callback.log_io_completed(Ok(()));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.write_log(|log, _| {
            log.retain_in(log_id.index.., |_, _| false).map_err(any)?;
            Ok(())
        })
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        // One transaction: the purge marker and the deletion land together or not at all.
        self.write_log(|log, meta| {
            let bytes = encode(&log_id).map_err(any)?;
            meta.insert(meta_key::LAST_PURGED, bytes.as_slice())
                .map_err(any)?;
            log.retain_in(..=log_id.index, |_, _| false).map_err(any)?;
            Ok(())
        })
    }
}
