//! openraft's storage conformance suite on the redb store, plus restart durability.

use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::testing::{StoreBuilder, Suite};
use quota_raft::storage::{self, LogStore, StateMachineStore};
use quota_raft::TypeConfig;
use tempfile::TempDir;

struct RedbBuilder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for RedbBuilder {
    async fn build(
        &self,
    ) -> Result<(TempDir, LogStore, StateMachineStore), openraft::StorageError<u64>> {
        let dir = TempDir::new().unwrap();
        let (log, sm) = storage::open(dir.path()).unwrap();
        Ok((dir, log, sm))
    }
}

#[test]
fn openraft_storage_suite_passes() {
    Suite::test_all(RedbBuilder).unwrap();
}

#[tokio::test]
async fn vote_committed_and_purge_survive_reopen() {
    use openraft::{CommittedLeaderId, LogId, Vote};
    let dir = TempDir::new().unwrap();
    let log_id = |i| LogId::new(CommittedLeaderId::new(1, 1), i);
    {
        let (mut log, _sm) = storage::open(dir.path()).unwrap();
        log.save_vote(&Vote::new(3, 2)).await.unwrap();
        log.purge(log_id(2)).await.unwrap();
        log.save_committed(Some(log_id(2))).await.unwrap();
    }
    let (mut log, mut sm) = storage::open(dir.path()).unwrap();
    assert_eq!(log.read_vote().await.unwrap(), Some(Vote::new(3, 2)));
    assert_eq!(log.read_committed().await.unwrap(), Some(log_id(2)));
    let state = log.get_log_state().await.unwrap();
    assert_eq!(state.last_purged_log_id, Some(log_id(2)));
    assert_eq!(
        state.last_log_id,
        Some(log_id(2)),
        "an empty log reports the purge point"
    );
    let (applied, _) = sm.applied_state().await.unwrap();
    assert_eq!(
        applied, None,
        "the state machine is durable only through snapshots"
    );
}
