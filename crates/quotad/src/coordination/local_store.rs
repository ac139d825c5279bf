//! The single-region coordinator's durable state: one redb file, `<data_dir>/local.redb`.
//!
//! ```text
//!  local_policies_v1   (tenant, policy) -> Policy      (with its version)
//!  local_pins_v1       tenant           -> RegionId    (tenant-level pin)
//!  local_meta_v1       "last_version"   -> u64         (never reused, even across delete + put)
//!  local_plan_assignments_v1  tenant    -> PlanName    (a plan's policies are policies of its
//!                                                       reserved subject, `--plan--<plan>`)
//! ```
//!
//! Values are quota-raft's codec (postcard behind a format version byte), the same encoding as
//! the Raft storage. Every write is one transaction committed with `Durability::Immediate`
//! (fsync) before it returns, so the caller changes its in-memory view only after the change is
//! on disk. Loading refuses anything it cannot read completely (a file that is not redb, an
//! unknown format version, an invalid id): starting empty would silently forget policies.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use quota_core::{PlanName, Policy, PolicyName, RegionId, TenantId};
use quota_raft::codec::{decode_versions, encode, CodecError};

/// Format versions whose values here have the shape of the current one (version 4 changed only
/// the replicated state), so a store written by them is read as it is.
const READABLE_VERSIONS: &[u8] = &[3];

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    decode_versions(bytes, READABLE_VERSIONS)
}
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};

/// Policies by (tenant, policy name).
const POLICIES: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("local_policies_v1");
/// Tenant pins by tenant; the value is the home `RegionId`.
const PINS: TableDefinition<&str, &[u8]> = TableDefinition::new("local_pins_v1");
/// Plan assignments by tenant; the value is the `PlanName`.
const ASSIGNMENTS: TableDefinition<&str, &[u8]> = TableDefinition::new("local_plan_assignments_v1");
/// Single records, one type per key.
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("local_meta_v1");
/// `u64`: the last policy version issued.
const LAST_VERSION: &str = "last_version";

/// The file name inside the data directory.
pub const DB_FILE: &str = "local.redb";

/// Why the local store could not be opened, read or written. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum LocalStoreError {
    #[error("cannot create data directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        source: redb::DatabaseError,
    },
    #[error("{path}: {source}")]
    Storage { path: PathBuf, source: redb::Error },
    #[error("{path} is corrupt or from another version: {what}: {source}")]
    Decode {
        path: PathBuf,
        what: String,
        source: CodecError,
    },
    #[error("{path} is corrupt: {what}")]
    Invalid { path: PathBuf, what: String },
}

/// Everything the store holds, as loaded at start.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Loaded {
    pub policies: BTreeMap<(TenantId, PolicyName), Policy>,
    pub pins: BTreeMap<TenantId, RegionId>,
    pub assignments: BTreeMap<TenantId, PlanName>,
    pub last_version: u64,
}

/// The open redb file.
#[derive(Debug)]
pub struct LocalStore {
    db: Database,
    path: PathBuf,
}

impl LocalStore {
    /// Opens (or creates) `data_dir/local.redb`, creating `data_dir` if missing, and loads it.
    pub fn open(data_dir: &Path) -> Result<(Self, Loaded), LocalStoreError> {
        std::fs::create_dir_all(data_dir).map_err(|source| LocalStoreError::CreateDir {
            path: data_dir.to_path_buf(),
            source,
        })?;
        let path = data_dir.join(DB_FILE);
        let db = Database::create(&path).map_err(|source| LocalStoreError::Open {
            path: path.clone(),
            source,
        })?;
        let store = Self { db, path };
        // Create the tables up front, so reads never meet a missing one (and a read-only
        // directory fails here, at start, not on the first PUT).
        store.write(|_, _, _| Ok(()))?;
        let loaded = store.load()?;
        Ok((store, loaded))
    }

    /// The file's path, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stores a policy (with its new version) and the last version issued, in one transaction.
    pub fn put_policy(
        &self,
        tenant: &TenantId,
        name: &PolicyName,
        policy: &Policy,
        last_version: u64,
    ) -> Result<(), LocalStoreError> {
        self.put_policies(&[(tenant, name, policy)], last_version)
    }

    /// Stores policies (each with its new version) and the last version issued, in one
    /// transaction: all or none, one fsync.
    pub fn put_policies(
        &self,
        entries: &[(&TenantId, &PolicyName, &Policy)],
        last_version: u64,
    ) -> Result<(), LocalStoreError> {
        let values = entries
            .iter()
            .map(|(_, _, policy)| self.encode(policy, "policy"))
            .collect::<Result<Vec<_>, _>>()?;
        let version = self.encode(&last_version, LAST_VERSION)?;
        self.write(|policies, _, meta| {
            for ((tenant, name, _), value) in entries.iter().zip(&values) {
                policies.insert((tenant.as_str(), name.as_str()), value.as_slice())?;
            }
            meta.insert(LAST_VERSION, version.as_slice())?;
            Ok(())
        })
    }

    /// Stores `puts` (each with its new version) and removes `deletes`, with the last version
    /// issued, in one transaction: a plan change is all or none.
    pub fn replace_policies(
        &self,
        puts: &[(&TenantId, &PolicyName, &Policy)],
        deletes: &[(TenantId, PolicyName)],
        last_version: u64,
    ) -> Result<(), LocalStoreError> {
        let values = puts
            .iter()
            .map(|(_, _, policy)| self.encode(policy, "policy"))
            .collect::<Result<Vec<_>, _>>()?;
        let version = self.encode(&last_version, LAST_VERSION)?;
        self.write(|policies, _, meta| {
            for (tenant, name) in deletes {
                policies.remove((tenant.as_str(), name.as_str()))?;
            }
            for ((tenant, name, _), value) in puts.iter().zip(&values) {
                policies.insert((tenant.as_str(), name.as_str()), value.as_slice())?;
            }
            meta.insert(LAST_VERSION, version.as_slice())?;
            Ok(())
        })
    }

    /// Assigns a tenant to a plan (`None`: removes its assignment).
    pub fn put_assignment(
        &self,
        tenant: &TenantId,
        plan: Option<&PlanName>,
    ) -> Result<(), LocalStoreError> {
        self.put_assignments(&[(tenant, plan)])
    }

    /// Assigns or unassigns several tenants in one transaction: all or none, one fsync.
    pub fn put_assignments(
        &self,
        entries: &[(&TenantId, Option<&PlanName>)],
    ) -> Result<(), LocalStoreError> {
        let values = entries
            .iter()
            .map(|(_, plan)| plan.map(|p| self.encode(p, "plan")).transpose())
            .collect::<Result<Vec<_>, _>>()?;
        let run = || -> Result<(), redb::Error> {
            let mut txn = self.db.begin_write()?;
            txn.set_durability(Durability::Immediate)?;
            {
                let mut table = txn.open_table(ASSIGNMENTS)?;
                for ((tenant, _), value) in entries.iter().zip(&values) {
                    match value {
                        Some(v) => {
                            table.insert(tenant.as_str(), v.as_slice())?;
                        }
                        None => {
                            table.remove(tenant.as_str())?;
                        }
                    }
                }
            }
            txn.commit()?;
            Ok(())
        };
        blocking(run).map_err(|source| LocalStoreError::Storage {
            path: self.path.clone(),
            source,
        })
    }

    /// Removes a policy.
    pub fn delete_policy(
        &self,
        tenant: &TenantId,
        name: &PolicyName,
    ) -> Result<(), LocalStoreError> {
        self.write(|policies, _, _| {
            policies.remove((tenant.as_str(), name.as_str()))?;
            Ok(())
        })
    }

    /// Pins a tenant to `home`.
    pub fn put_pin(&self, tenant: &TenantId, home: &RegionId) -> Result<(), LocalStoreError> {
        let value = self.encode(home, "pin")?;
        self.write(|_, pins, _| {
            pins.insert(tenant.as_str(), value.as_slice())?;
            Ok(())
        })
    }

    /// Removes a tenant's pin.
    pub fn delete_pin(&self, tenant: &TenantId) -> Result<(), LocalStoreError> {
        self.write(|_, pins, _| {
            pins.remove(tenant.as_str())?;
            Ok(())
        })
    }

    fn encode<T: serde::Serialize>(
        &self,
        value: &T,
        what: &str,
    ) -> Result<Vec<u8>, LocalStoreError> {
        encode(value).map_err(|source| LocalStoreError::Decode {
            path: self.path.clone(),
            what: format!("encoding {what}"),
            source,
        })
    }

    /// Runs `f` on the three tables in one write transaction and commits it durably.
    fn write(
        &self,
        f: impl FnOnce(
            &mut redb::Table<'_, (&'static str, &'static str), &'static [u8]>,
            &mut redb::Table<'_, &'static str, &'static [u8]>,
            &mut redb::Table<'_, &'static str, &'static [u8]>,
        ) -> Result<(), redb::Error>,
    ) -> Result<(), LocalStoreError> {
        let run = || -> Result<(), redb::Error> {
            let mut txn = self.db.begin_write()?;
            txn.set_durability(Durability::Immediate)?;
            {
                let mut policies = txn.open_table(POLICIES)?;
                let mut pins = txn.open_table(PINS)?;
                let mut meta = txn.open_table(META)?;
                txn.open_table(ASSIGNMENTS)?;
                f(&mut policies, &mut pins, &mut meta)?;
            }
            txn.commit()?;
            Ok(())
        };
        blocking(run).map_err(|source| LocalStoreError::Storage {
            path: self.path.clone(),
            source,
        })
    }

    fn load(&self) -> Result<Loaded, LocalStoreError> {
        let storage = |source: redb::Error| LocalStoreError::Storage {
            path: self.path.clone(),
            source,
        };
        let invalid = |what: String| LocalStoreError::Invalid {
            path: self.path.clone(),
            what,
        };
        let decoded = |what: String, source| LocalStoreError::Decode {
            path: self.path.clone(),
            what,
            source,
        };
        let txn = self.db.begin_read().map_err(|e| storage(e.into()))?;
        let mut loaded = Loaded::default();

        let meta = txn.open_table(META).map_err(|e| storage(e.into()))?;
        if let Some(v) = meta.get(LAST_VERSION).map_err(|e| storage(e.into()))? {
            loaded.last_version =
                decode(v.value()).map_err(|e| decoded(LAST_VERSION.to_string(), e))?;
        }

        let policies = txn.open_table(POLICIES).map_err(|e| storage(e.into()))?;
        for row in policies.iter().map_err(|e| storage(e.into()))? {
            let (k, v) = row.map_err(|e| storage(e.into()))?;
            let (t, p) = k.value();
            let what = format!("policy {t}/{p}");
            let tenant = TenantId::new(t).map_err(|e| invalid(format!("{what}: {e}")))?;
            let name = PolicyName::new(p).map_err(|e| invalid(format!("{what}: {e}")))?;
            let policy: Policy = decode(v.value()).map_err(|e| decoded(what.clone(), e))?;
            if policy.version == 0 || policy.version > loaded.last_version {
                return Err(invalid(format!(
                    "{what} has version {}, but the last version issued is {}",
                    policy.version, loaded.last_version
                )));
            }
            loaded.policies.insert((tenant, name), policy);
        }

        let pins = txn.open_table(PINS).map_err(|e| storage(e.into()))?;
        for row in pins.iter().map_err(|e| storage(e.into()))? {
            let (k, v) = row.map_err(|e| storage(e.into()))?;
            let t = k.value();
            let what = format!("pin of tenant {t}");
            let tenant = TenantId::new(t).map_err(|e| invalid(format!("{what}: {e}")))?;
            let home: RegionId = decode(v.value()).map_err(|e| decoded(what, e))?;
            loaded.pins.insert(tenant, home);
        }

        let assignments = txn.open_table(ASSIGNMENTS).map_err(|e| storage(e.into()))?;
        for row in assignments.iter().map_err(|e| storage(e.into()))? {
            let (k, v) = row.map_err(|e| storage(e.into()))?;
            let t = k.value();
            let what = format!("plan of tenant {t}");
            let tenant = TenantId::new(t).map_err(|e| invalid(format!("{what}: {e}")))?;
            let plan: PlanName = decode(v.value()).map_err(|e| decoded(what, e))?;
            loaded.assignments.insert(tenant, plan);
        }
        Ok(loaded)
    }
}

/// Runs a blocking redb transaction (it fsyncs) without stalling the other tasks of a
/// multi-thread runtime's worker; inline on a current-thread runtime (tests), where
/// `block_in_place` is not allowed.
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quota_core::PolicySpec;

    fn policy(version: u64) -> Policy {
        let mut p = PolicySpec {
            limit: 10.0,
            window_ms: 1000.0,
            ..Default::default()
        }
        .validate()
        .unwrap();
        p.version = version;
        p
    }

    /// Writes raw bytes into a table of a closed store, as a damaged or foreign file would.
    fn tamper(dir: &Path, f: impl FnOnce(&redb::WriteTransaction)) {
        let db = Database::create(dir.join(DB_FILE)).unwrap();
        let txn = db.begin_write().unwrap();
        f(&txn);
        txn.commit().unwrap();
    }

    /// The error opening a fresh store after `f` damaged it.
    fn open_damaged(f: impl FnOnce(&redb::WriteTransaction)) -> String {
        let dir = tempfile::tempdir().unwrap();
        drop(LocalStore::open(dir.path()).unwrap());
        tamper(dir.path(), f);
        LocalStore::open(dir.path()).unwrap_err().to_string()
    }

    #[test]
    fn round_trips_everything_it_stores() {
        let dir = tempfile::tempdir().unwrap();
        let t = TenantId::new("acme").unwrap();
        let p = PolicyName::new("writes").unwrap();
        let home = RegionId::new("eu").unwrap();
        {
            let (store, loaded) = LocalStore::open(dir.path()).unwrap();
            assert_eq!(loaded, Loaded::default());
            store.put_policy(&t, &p, &policy(7), 7).unwrap();
            store.put_pin(&t, &home).unwrap();
        }
        let (store, loaded) = LocalStore::open(dir.path()).unwrap();
        assert_eq!(loaded.last_version, 7);
        assert_eq!(loaded.policies[&(t.clone(), p.clone())], policy(7));
        assert_eq!(loaded.pins[&t], home);
        store.delete_policy(&t, &p).unwrap();
        store.delete_pin(&t).unwrap();
        drop(store);
        let (_, loaded) = LocalStore::open(dir.path()).unwrap();
        assert!(loaded.policies.is_empty() && loaded.pins.is_empty());
        assert_eq!(loaded.last_version, 7, "deleting never lowers the counter");
    }

    #[test]
    fn an_unknown_format_version_fails_by_name() {
        let mut bytes = encode(&policy(1)).unwrap();
        bytes[0] = 99;
        let err = open_damaged(|txn| {
            let mut meta = txn.open_table(META).unwrap();
            meta.insert(LAST_VERSION, encode(&1u64).unwrap().as_slice())
                .unwrap();
            let mut t = txn.open_table(POLICIES).unwrap();
            t.insert(("acme", "writes"), bytes.as_slice()).unwrap();
        });
        assert!(err.contains(DB_FILE), "{err}");
        assert!(err.contains("policy acme/writes"), "{err}");
        assert!(err.contains("unknown format version 99"), "{err}");
    }

    #[test]
    fn inconsistent_records_fail_by_name() {
        // A policy newer than the counter: re-issuing its version would reuse its Redis keys.
        let err = open_damaged(|txn| {
            let mut t = txn.open_table(POLICIES).unwrap();
            t.insert(("acme", "writes"), encode(&policy(5)).unwrap().as_slice())
                .unwrap();
        });
        assert!(err.contains("last version issued is 0"), "{err}");

        // An id the API would never accept.
        let err = open_damaged(|txn| {
            let mut t = txn.open_table(PINS).unwrap();
            t.insert(
                "no spaces",
                encode(&RegionId::new("eu").unwrap()).unwrap().as_slice(),
            )
            .unwrap();
        });
        assert!(err.contains("pin of tenant no spaces"), "{err}");

        // Truncated bytes.
        let err = open_damaged(|txn| {
            let mut t = txn.open_table(META).unwrap();
            t.insert(LAST_VERSION, [quota_raft::codec::FORMAT_VERSION].as_slice())
                .unwrap();
        });
        assert!(err.contains("last_version"), "{err}");
    }
}
