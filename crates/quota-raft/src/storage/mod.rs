//! Durable Raft storage on one redb file: the log, the vote, the committed index, and the state
//! machine's latest snapshot.
//!
//! Every write commits with `Durability::Immediate` (fsync) before it is acknowledged. The state
//! machine itself lives in memory; it is made durable by snapshots, and on restart openraft
//! re-applies the committed log after the last snapshot (it only purges logs a snapshot covers).
//!
//! Storage calls are synchronous redb transactions. On a multi-thread runtime they run under
//! `block_in_place`, so an fsync does not stall the other tasks of that worker; on a
//! current-thread runtime (paused-clock tests) they run inline, which keeps those tests
//! deterministic.

// openraft's storage traits fix the error type (`StorageError`, ~224 bytes); our helpers return
// what the traits return rather than boxing and unboxing at every call.
#![allow(clippy::result_large_err)]

use std::path::Path;
use std::sync::Arc;

use redb::{Database, TableDefinition};

use crate::codec::CodecError;

mod changes;
mod log;
mod state_machine;

pub use changes::Changes;
pub use log::LogStore;
pub use state_machine::{SnapshotBuilder, StateHandle, StateMachineStore};

/// Log entries by index; values are encoded `Entry`s.
const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_log_v1");
/// Small typed records of the log store, one type per key (see [`meta_key`]).
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta_v1");
/// The state machine's latest snapshot: its metadata and its data under separate keys.
const SNAPSHOT: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshot_v1");

/// Keys of [`META`]; each holds exactly one type.
mod meta_key {
    /// `Vote`
    pub const VOTE: &str = "vote";
    /// `Option<LogId>`
    pub const COMMITTED: &str = "committed";
    /// `LogId`
    pub const LAST_PURGED: &str = "last_purged";
}

/// Keys of [`SNAPSHOT`].
mod snapshot_key {
    /// `SnapshotMeta`
    pub const META: &str = "meta";
    /// The encoded `CoordinatorState` (already versioned by the codec).
    pub const DATA: &str = "data";
}

/// Why the storage could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot create data directory {path}: {source}")]
    CreateDir {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot open redb database {path}: {source}")]
    Database {
        path: String,
        source: redb::DatabaseError,
    },
    #[error("cannot read the stored snapshot: {source}")]
    Snapshot {
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("stored snapshot is corrupt: {source}")]
    Codec { source: CodecError },
}

/// The file name of the Raft database inside the data directory.
pub const DB_FILE: &str = "raft.redb";

/// Opens (or creates) `data_dir/raft.redb` and returns the two openraft storage halves.
pub fn open(data_dir: &Path) -> Result<(LogStore, StateMachineStore), OpenError> {
    std::fs::create_dir_all(data_dir).map_err(|source| OpenError::CreateDir {
        path: data_dir.display().to_string(),
        source,
    })?;
    let path = data_dir.join(DB_FILE);
    let db = Database::create(&path).map_err(|source| OpenError::Database {
        path: path.display().to_string(),
        source,
    })?;
    let db = Arc::new(db);
    let log = LogStore::new(db.clone());
    let sm = StateMachineStore::open(db)?;
    Ok((log, sm))
}

/// Whether no `Database` (in this or another process) holds `data_dir`'s file open.
pub fn is_closed(data_dir: &Path) -> bool {
    !matches!(
        Database::create(data_dir.join(DB_FILE)),
        Err(redb::DatabaseError::DatabaseAlreadyOpen)
    )
}

/// Runs blocking storage work without starving the runtime (see the module doc).
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Wraps any error as openraft's opaque source type.
fn any(e: impl std::error::Error + 'static) -> anyerror::AnyError {
    anyerror::AnyError::new(&e)
}
