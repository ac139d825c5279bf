//! What the checker holds the model to, and what each region enforces at an instant.
//!
//! Region A enforces, at true time t, the larger of what a gateway deciding against its
//! Redis primary gets (the stored share before the stored lease end on Redis's clock, the
//! floor after) and what each of its daemons enforces in process (quota-core's
//! `RegionView::enforced_share` on the daemon's own clock). The two decide the same callers
//! (the daemon's buckets stand in for Redis while it is out), so A counts the larger, not the
//! sum. Region B enforces everything the coordinator counts for it at that instant
//! (`CoordinatorState::enforceable`): more than any correct region could, so a property that
//! holds against it holds against every B that keeps the per-region property A is held to.

pub use crate::model::{
    all, enforceable, gateway, in_process, region_enforced, total, BUDGET, COORDINATOR, DEPOSED,
    ENFORCEABLE, FLOORS, LAPSED_AND_BACK, LEASE_BACK, LOST_WRITE, MOVED, PASSED, TAKEOVER,
};
