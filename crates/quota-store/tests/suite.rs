//! One behavioural suite, two stores: every function here runs against the `EmbeddedStore` and
//! against the `RedisStore` on a real redis-server, and must pass on both unchanged.

mod common;

use common::{fresh_bucket, req, tokens};
use quota_core::bucket::{self, UT};
use quota_core::{BucketParams, Decision};
use quota_store::{Limit, SetParams, Store, StoreError, UsageRecord};

const T0: u64 = 1_700_000_000_000;

/// Runs `$name(&store)` as `$name::embedded` and `$name::redis`.
macro_rules! both_stores {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test]
            async fn embedded() {
                super::$name(&quota_store::EmbeddedStore::new()).await;
            }

            #[tokio::test]
            async fn redis() {
                let server = redis_harness::RedisServer::start().unwrap();
                super::$name(&super::common::store(&server).await).await;
            }
        }
    )*};
}

both_stores!(
    decisions_follow_the_reference,
    refill_uses_the_explicit_now,
    written_params_win_over_the_fallback,
    usage_is_counted_and_drained_once,
    sliding_window_counts_every_request,
    sliding_window_counters_for_large_limits,
    invalid_requests_are_rejected,
    cost_above_capacity_is_a_denial,
    a_peek_spends_and_counts_nothing,
    the_floor_takes_over_at_the_lease_end,
    a_lease_ends_at_the_earlier_of_its_time_and_latest_end,
    cleared_params_and_state_are_gone,
    listed_params_are_those_held,
    a_changed_policy_keeps_what_was_spent,
    a_moved_window_share_cuts_at_once_and_raises_after_a_window,
    a_window_without_state_holds_a_raise,
    a_fence_refuses_deposed_and_late_writes,
    a_charge_goes_into_debt_and_checks_wait_for_the_repayment,
    a_refund_repays_a_debt_first,
    a_replayed_charge_id_applies_once,
    bad_charges_are_refused_and_change_nothing,
    a_changed_policy_keeps_a_debt,
);

/// Token-bucket parameters in whole tokens and tokens per second, for a charge.
fn params(cap: u64, per_s: u64) -> BucketParams {
    BucketParams::new(cap * UT, per_s * UT).unwrap()
}

/// Issue 32: a charge for work already done is applied past the tokens left, into debt down
/// to its limit; beyond it the tokens are clamped and reported. Checks in debt are denied with
/// a retry that covers the repayment, and are admitted exactly then.
async fn a_charge_goes_into_debt_and_checks_wait_for_the_repayment<S: Store>(s: &S) {
    use quota_store::ChargeRequest;
    let b = fresh_bucket("debt");
    let p = params(10, 1);
    let charge = |cost, at| ChargeRequest::new(b.clone(), p, cost, 8 * UT).at(at);
    let o = s.charge(&charge(15, T0)).await.unwrap();
    assert_eq!((o.applied, o.clamped, o.remaining, o.debt), (15, 0, 0, 5));
    // One token 6 s away (5 owed first), full 15 s away.
    assert_eq!((o.retry_after_ms, o.reset_ms), (Some(6_000), Some(15_000)));
    // 3 of 5 fit above the limit of 8 owed; 2 are clamped, never taken.
    let o = s.charge(&charge(5, T0)).await.unwrap();
    assert_eq!((o.applied, o.clamped, o.debt), (3, 2, 8));
    let o = s.charge(&charge(4, T0)).await.unwrap();
    assert_eq!((o.applied, o.clamped, o.debt), (0, 4, 8));
    // A check of 1 needs the 8 owed and 1 more: 9 s.
    let l = Limit::TokenBucket(p);
    let d = s.check(&req(&b, l, 1, Some(T0))).await.unwrap();
    assert_eq!(
        d,
        Decision {
            allowed: false,
            remaining: 0,
            retry_after_ms: Some(9_000),
            reset_ms: Some(18_000),
        }
    );
    assert!(
        !s.check(&req(&b, l, 1, Some(T0 + 8_999)))
            .await
            .unwrap()
            .allowed
    );
    let d = s.check(&req(&b, l, 1, Some(T0 + 9_000))).await.unwrap();
    assert_eq!((d.allowed, d.remaining), (true, 0));
    // A peek in debt is allowed and spends nothing; a reservation is denied as a check.
    let o = s.charge(&charge(2, T0 + 9_000)).await.unwrap();
    assert_eq!((o.applied, o.debt), (2, 2));
    let d = s.check(&req(&b, l, 0, Some(T0 + 9_000))).await.unwrap();
    assert_eq!(
        (d.allowed, d.remaining, d.reset_ms),
        (true, 0, Some(12_000))
    );
    let (d, n) = s
        .reserve(&req(&b, l, 1, Some(T0 + 9_000)), 4)
        .await
        .unwrap();
    assert_eq!((d.allowed, n, d.retry_after_ms), (false, 0, Some(3_000)));
    // Applied tokens count as admitted, clamped ones as denied, with the checks'.
    let got = s.collect_usage(usize::MAX).await.unwrap();
    assert_eq!(
        got,
        vec![UsageRecord {
            bucket: b.clone(),
            admitted: 15 + 3 + 1 + 2,
            // Clamped 2 and 4; two checks and a reservation denied.
            denied: 2 + 4 + 1 + 1 + 1,
        }]
    );
    // All or nothing: a limit in debt denies a check of several, and the other spends nothing.
    let other = quota_store::BucketRef {
        policy: quota_core::PolicyName::new("other").unwrap(),
        ..b.clone()
    };
    let multi = quota_store::MultiCheckRequest {
        limits: [&b, &other]
            .into_iter()
            .map(|bucket| quota_store::LimitCheck {
                bucket: bucket.clone(),
                limit: l,
            })
            .collect(),
        cost: 1,
        now_ms: Some(T0 + 9_000),
    };
    let ds = s.check_all(&multi).await.unwrap();
    assert_eq!((ds[0].allowed, ds[0].retry_after_ms), (false, Some(3_000)));
    assert_eq!((ds[1].allowed, ds[1].remaining), (true, 10));
    let d = s.check(&req(&other, l, 0, Some(T0 + 9_000))).await.unwrap();
    assert_eq!(d.remaining, 10);
}

/// A refund repays a debt before it gives tokens, never above the capacity.
async fn a_refund_repays_a_debt_first<S: Store>(s: &S) {
    use quota_store::ChargeRequest;
    let b = fresh_bucket("repay");
    let p = params(10, 0);
    let o = s
        .charge(&ChargeRequest::new(b.clone(), p, 16, 10 * UT).at(T0))
        .await
        .unwrap();
    assert_eq!(
        (o.applied, o.debt, o.retry_after_ms, o.reset_ms),
        (16, 6, None, None)
    );
    assert_eq!(s.refund(&b, 4, Some(T0)).await.unwrap(), Some(0));
    let l = Limit::TokenBucket(p);
    let d = s.check(&req(&b, l, 1, Some(T0))).await.unwrap();
    assert_eq!((d.allowed, d.retry_after_ms), (false, None));
    assert_eq!(s.refund(&b, 5, Some(T0)).await.unwrap(), Some(3));
    assert!(s.check(&req(&b, l, 2, Some(T0))).await.unwrap().allowed);
    assert_eq!(s.refund(&b, 100, Some(T0)).await.unwrap(), Some(10));
}

/// A charge retried under its id (a client's retry of one request) applies once, and the
/// replay answers what the first applied with the bucket as it stands; another id charges.
async fn a_replayed_charge_id_applies_once<S: Store>(s: &S) {
    use quota_store::ChargeRequest;
    let b = fresh_bucket("once");
    let p = params(10, 1);
    let first = ChargeRequest::new(b.clone(), p, 12, 5 * UT)
        .at(T0)
        .with_id("req-7f3a");
    let o = s.charge(&first).await.unwrap();
    assert_eq!((o.applied, o.clamped, o.remaining, o.debt), (12, 0, 0, 2));
    let again = s.charge(&first).await.unwrap();
    assert_eq!(again, o);
    // Later: still a replay, and the refill shows.
    let later = ChargeRequest {
        now_ms: Some(T0 + 1_000),
        ..first.clone()
    };
    let o = s.charge(&later).await.unwrap();
    assert_eq!((o.applied, o.clamped, o.remaining, o.debt), (12, 0, 0, 1));
    // The id names one charge: another cost under it is refused and takes nothing.
    let other_cost = ChargeRequest {
        cost: 3,
        ..later.clone()
    };
    let r = s.charge(&other_cost).await;
    assert!(matches!(r, Err(StoreError::Rejected { .. })), "{r:?}");
    let o = s.charge(&other_cost.with_id("req-80b1")).await.unwrap();
    assert_eq!((o.applied, o.clamped, o.debt), (3, 0, 4));
    let usage = s.collect_usage(usize::MAX).await.unwrap();
    assert_eq!((usage[0].admitted, usage[0].denied), (15, 0));
}

/// Bad charges are refused as `Rejected`, by both stores alike, and change nothing: a cost out
/// of bounds, a debt limit too large for the fallback or for the capacity in force, a bad id,
/// a time out of bounds, parameters out of bounds.
async fn bad_charges_are_refused_and_change_nothing<S: Store>(s: &S) {
    use quota_store::{ChargeRequest, MAX_CHARGE_ID_LEN};
    let b = fresh_bucket("bad-charge");
    let p = params(10, 1);
    // Stored parameters of a larger capacity than the fallback.
    s.set_params(&SetParams::new(b.clone(), tokens(100, 1)).at(T0))
        .await
        .unwrap();
    let ok = ChargeRequest::new(b.clone(), p, 3, 0).at(T0);
    assert_eq!(s.charge(&ok).await.unwrap().remaining, 97);
    let huge = BucketParams {
        capacity_ut: 1 << 53,
        ..p
    };
    let bad = [
        ChargeRequest {
            cost: 0,
            ..ok.clone()
        },
        ChargeRequest {
            cost: quota_store::MAX_COST + 1,
            ..ok.clone()
        },
        ChargeRequest {
            debt_limit_ut: bucket::MAX_CAPACITY_UT - 10 * UT + 1,
            ..ok.clone()
        },
        // Within the fallback's bound, beyond the stored capacity's.
        ChargeRequest {
            debt_limit_ut: bucket::MAX_CAPACITY_UT - 10 * UT,
            ..ok.clone()
        },
        ChargeRequest {
            params: huge,
            ..ok.clone()
        },
        ChargeRequest {
            now_ms: Some(1 << 53),
            ..ok.clone()
        },
        ok.clone().with_id(""),
        ok.clone().with_id("has space"),
        ok.clone().with_id("é"),
        ok.clone().with_id("x".repeat(MAX_CHARGE_ID_LEN + 1)),
    ];
    for r in &bad {
        assert!(
            matches!(s.charge(r).await, Err(StoreError::Rejected { .. })),
            "{r:?}"
        );
    }
    let d = s
        .check(&req(&b, Limit::TokenBucket(p), 0, Some(T0)))
        .await
        .unwrap();
    assert_eq!(d.remaining, 97, "a refused charge took nothing");
    let usage = s.collect_usage(usize::MAX).await.unwrap();
    assert_eq!((usage[0].admitted, usage[0].denied), (3, 0));
    // The largest debt limit the stored capacity takes, and the longest id, are charged.
    let most = ChargeRequest {
        debt_limit_ut: bucket::MAX_CAPACITY_UT - 100 * UT,
        ..ok.clone()
    }
    .with_id("x".repeat(MAX_CHARGE_ID_LEN));
    assert_eq!(s.charge(&most).await.unwrap().remaining, 94);
}

/// A changed policy keeps what the old bucket owes: the new bucket starts in the same debt.
async fn a_changed_policy_keeps_a_debt<S: Store>(s: &S) {
    use quota_store::ChargeRequest;
    let v1 = fresh_bucket("owed");
    let v2 = quota_store::BucketRef {
        version: 2,
        ..v1.clone()
    };
    let p = params(10, 1);
    s.set_params(&SetParams::new(v1.clone(), Limit::TokenBucket(p)).at(T0))
        .await
        .unwrap();
    let o = s
        .charge(&ChargeRequest::new(v1.clone(), p, 15, 10 * UT).at(T0))
        .await
        .unwrap();
    assert_eq!(o.debt, 5);
    // Smaller terms: the debt stays as it was (not deepened by the smaller capacity).
    let small = tokens(3, 1);
    let w = SetParams::new(v2.clone(), small)
        .at(T0 + 1_000)
        .replacing(1);
    s.set_params(&w).await.unwrap();
    let d = s
        .check(&req(&v2, small, 1, Some(T0 + 1_000)))
        .await
        .unwrap();
    assert_eq!(
        (d.allowed, d.remaining, d.retry_after_ms),
        (false, 0, Some(5_000))
    );
}

/// Issue 31: parameters carry the writer's fence and epoch. A deposed agent (lower fence), an
/// older allocation landing late (lower epoch) and an unfenced writer are refused and change
/// nothing; the holder renews at its epoch, and a later holder takes over.
async fn a_fence_refuses_deposed_and_late_writes<S: Store>(s: &S) {
    use quota_store::Fence;
    let b = fresh_bucket("fenced");
    let share = |cap| tokens(cap, 1);
    let fence = |token, epoch| Fence { token, epoch };
    let write = |cap, f: Option<Fence>| {
        let p = SetParams::new(b.clone(), share(cap))
            .with_lease(10_000, share(1))
            .at(T0);
        match f {
            Some(f) => p.fenced(f),
            None => p,
        }
    };
    // Unfenced parameters may be fenced from then on.
    s.set_params(&write(50, None)).await.unwrap();
    s.set_params(&write(40, Some(fence(3, 7)))).await.unwrap();
    // A peek: the stored capacity wins over the one passed.
    let peek = req(&b, share(1000), 0, Some(T0 + 1));
    async fn remaining<S: Store>(s: &S, r: &quota_store::CheckRequest) -> u64 {
        s.check(r).await.unwrap().remaining
    }
    assert_eq!(remaining(s, &peek).await, 40);
    for (f, what) in [
        (Some(fence(2, 9)), "fence 2 is below the stored 3"),
        (Some(fence(3, 6)), "epoch 6 is below the stored 7"),
        (None, "this write has none"),
    ] {
        match s.set_params(&write(90, f)).await {
            Err(StoreError::Fenced { reason }) => assert!(reason.contains(what), "{reason}"),
            other => panic!("{f:?} answered {other:?}"),
        }
        assert_eq!(
            remaining(s, &peek).await,
            40,
            "a refused write changed nothing"
        );
    }
    // The same holder at the same epoch renews; a later holder at any later epoch takes over,
    // and the one it replaced can no longer write.
    s.set_params(&write(40, Some(fence(3, 7)))).await.unwrap();
    s.set_params(&write(30, Some(fence(5, 8)))).await.unwrap();
    assert_eq!(remaining(s, &peek).await, 30);
    assert!(matches!(
        s.set_params(&write(40, Some(fence(3, 9)))).await,
        Err(StoreError::Fenced { .. })
    ));
    // Cleared parameters (a deleted policy) keep no fence.
    s.clear_params(&b).await.unwrap();
    s.set_params(&write(20, None)).await.unwrap();
    assert_eq!(remaining(s, &peek).await, 20);
}

/// Issue 36: share of a sliding window moves between two regions (each a store of its own, as
/// each region has its own Redis). The losing region's cut applies at once; the gaining
/// region's raise only once it has stood a window, so the two never admit more than the
/// budget in one window, though the loser spent its whole share just before the move.
async fn a_moved_window_share_cuts_at_once_and_raises_after_a_window<S: Store>(s: &S) {
    let (a, b) = (fresh_bucket("moved-a"), fresh_bucket("moved-b"));
    let w = |limit| Limit::SlidingWindow {
        limit,
        window_ms: 60_000,
    };
    let set = |bucket: &quota_store::BucketRef, limit, now| {
        SetParams::new(bucket.clone(), w(limit)).at(now)
    };
    // A budget of 10: 5 each. Region a spends its 5 at T0, region b one of its 5.
    s.set_params(&set(&a, 5, T0)).await.unwrap();
    s.set_params(&set(&b, 5, T0)).await.unwrap();
    assert!(s.check(&req(&a, w(5), 5, Some(T0))).await.unwrap().allowed);
    assert!(s.check(&req(&b, w(5), 1, Some(T0))).await.unwrap().allowed);
    // At T0 + 1 s region a gives 4 to region b: a is cut to 1, b raised to 9.
    let moved = T0 + 1000;
    s.set_params(&set(&a, 1, moved)).await.unwrap();
    s.set_params(&set(&b, 9, moved)).await.unwrap();
    let d = s.check(&req(&a, w(1), 1, Some(moved))).await.unwrap();
    assert_eq!((d.allowed, d.remaining), (false, 0));
    // b decides on its old 5 until the raise has stood a window: 4 more now, not 8.
    let d = s.check(&req(&b, w(9), 5, Some(moved))).await.unwrap();
    assert_eq!((d.allowed, d.remaining), (false, 4));
    assert_eq!(
        d.retry_after_ms,
        Some(59_000),
        "b's first token leaves at T0 + 60 s"
    );
    let d = s.check(&req(&b, w(9), 4, Some(moved))).await.unwrap();
    assert_eq!((d.allowed, d.remaining), (true, 0));
    // T0 + 60 s: a's 5 and b's first leave the window; b is still held at 5 (4 counted).
    let d = s.check(&req(&b, w(9), 2, Some(T0 + 60_000))).await.unwrap();
    assert_eq!((d.allowed, d.remaining), (false, 1));
    assert_eq!(
        d.retry_after_ms,
        Some(1000),
        "the raise applies at T0 + 61 s"
    );
    // T0 + 61 s: the raise applies as b's 4 of T0 + 1 s leave: all 9 fit.
    let d = s
        .check(&req(&b, w(9), 9, Some(moved + 60_000)))
        .await
        .unwrap();
    assert_eq!((d.allowed, d.remaining), (true, 0));
}

/// Issue 36, the gaining region with no window state (no decision within the state's idle
/// lifetime): the parameters hold the raise, so it still decides on its old share until the
/// raise has stood a window, while the losing region's tokens of just before the move count.
async fn a_window_without_state_holds_a_raise<S: Store>(s: &S) {
    let (a, b) = (fresh_bucket("held-a"), fresh_bucket("held-b"));
    let w = |limit| Limit::SlidingWindow {
        limit,
        window_ms: 60_000,
    };
    let set = |bucket: &quota_store::BucketRef, limit, now| {
        SetParams::new(bucket.clone(), w(limit)).at(now)
    };
    // A budget of 10: 5 each. Region a spends its 5 at T0; region b decides nothing.
    s.set_params(&set(&a, 5, T0)).await.unwrap();
    s.set_params(&set(&b, 5, T0)).await.unwrap();
    assert!(s.check(&req(&a, w(5), 5, Some(T0))).await.unwrap().allowed);
    // At T0 + 1 s region a gives 4 to region b, whose window has no state.
    let moved = T0 + 1000;
    s.set_params(&set(&a, 1, moved)).await.unwrap();
    s.set_params(&set(&b, 9, moved)).await.unwrap();
    let d = s.check(&req(&b, w(9), 6, Some(moved))).await.unwrap();
    assert_eq!((d.allowed, d.remaining), (false, 5), "held at the old 5");
    assert_eq!(
        d.retry_after_ms,
        Some(60_000),
        "the raise applies at moved + W"
    );
    let d = s.check(&req(&b, w(9), 5, Some(moved + 10))).await.unwrap();
    assert_eq!((d.allowed, d.remaining), (true, 0));
    // Within the window of the move a and b admitted 10, the budget: nothing more.
    let d = s
        .check(&req(&b, w(9), 1, Some(moved + 59_999)))
        .await
        .unwrap();
    assert_eq!((d.allowed, d.remaining), (false, 0));
    assert_eq!(
        d.retry_after_ms,
        Some(1),
        "the raise applies at moved + 60 s"
    );
    // A window after the move: up to the new 9 (b's 5 of moved + 10 still count).
    let d = s
        .check(&req(&b, w(9), 5, Some(moved + 60_000)))
        .await
        .unwrap();
    assert_eq!((d.allowed, d.remaining), (false, 4));
    let d = s
        .check(&req(&b, w(9), 4, Some(moved + 60_000)))
        .await
        .unwrap();
    assert_eq!((d.allowed, d.remaining), (true, 0));
    let d = s
        .check(&req(&b, w(9), 5, Some(moved + 60_010)))
        .await
        .unwrap();
    assert_eq!((d.allowed, d.remaining), (true, 0));
}

/// Issue 22: a changed policy (a new version, a new bucket) keeps what the old bucket had
/// spent: drained stays drained, a raised limit gives only the difference, and a repeated write
/// takes nothing twice.
async fn a_changed_policy_keeps_what_was_spent<S: Store>(s: &S) {
    let v1 = fresh_bucket("changed");
    let v2 = quota_store::BucketRef {
        version: 2,
        ..v1.clone()
    };
    let v3 = quota_store::BucketRef {
        version: 3,
        ..v1.clone()
    };
    let old = tokens(10, 1);
    s.set_params(&SetParams::new(v1.clone(), old).at(T0))
        .await
        .unwrap();
    for _ in 0..10 {
        assert!(s.check(&req(&v1, old, 1, Some(T0))).await.unwrap().allowed);
    }
    // New terms, same capacity, refill per minute: still drained (1 s of the old refill
    // accrued before the change).
    let same = Limit::TokenBucket(BucketParams::per_period(10 * UT, 60 * UT, 60_000).unwrap());
    let w = SetParams::new(v2.clone(), same).at(T0 + 1000).replacing(1);
    s.set_params(&w).await.unwrap();
    s.set_params(&w).await.unwrap(); // a retried write takes nothing twice
    let d = s.check(&req(&v2, same, 0, Some(T0 + 1000))).await.unwrap();
    assert_eq!(d.remaining, 1);
    assert!(
        s.check(&req(&v2, same, 1, Some(T0 + 1000)))
            .await
            .unwrap()
            .allowed
    );
    assert!(
        !s.check(&req(&v2, same, 1, Some(T0 + 1000)))
            .await
            .unwrap()
            .allowed
    );
    // A raised burst (10 → 25) gives only the difference; checks decided on the new version
    // before its parameters were written count too.
    let raised = tokens(25, 1);
    for _ in 0..3 {
        assert!(
            s.check(&req(&v3, raised, 1, Some(T0 + 1000)))
                .await
                .unwrap()
                .allowed
        );
    }
    let w = SetParams::new(v3.clone(), raised)
        .at(T0 + 1000)
        .replacing(2);
    s.set_params(&w).await.unwrap();
    let d = s
        .check(&req(&v3, raised, 0, Some(T0 + 1000)))
        .await
        .unwrap();
    assert_eq!(d.remaining, 25 - 10 - 3);
    // Without a replaced version, a new bucket starts full, as before.
    let fresh = quota_store::BucketRef {
        version: 9,
        ..v1.clone()
    };
    s.set_params(&SetParams::new(fresh.clone(), raised).at(T0 + 1000))
        .await
        .unwrap();
    let d = s
        .check(&req(&fresh, raised, 0, Some(T0 + 1000)))
        .await
        .unwrap();
    assert_eq!(d.remaining, 25);
}

async fn a_peek_spends_and_counts_nothing<S: Store>(s: &S) {
    let b = fresh_bucket("peek");
    let l = tokens(10, 1);
    // A bucket never decided reads as full, and a peek does not create it.
    let d = s.check(&req(&b, l, 0, Some(T0))).await.unwrap();
    assert_eq!((d.allowed, d.remaining, d.reset_ms), (true, 10, Some(0)));
    for _ in 0..4 {
        assert!(s.check(&req(&b, l, 1, Some(T0))).await.unwrap().allowed);
    }
    for _ in 0..3 {
        let d = s.check(&req(&b, l, 0, Some(T0 + 500))).await.unwrap();
        assert_eq!((d.remaining, d.reset_ms), (6, Some(3500)));
    }
    // Refill shows in the peek; the peeks spent nothing and are not usage.
    let d = s.check(&req(&b, l, 0, Some(T0 + 2000))).await.unwrap();
    assert_eq!(d.remaining, 8);
    let usage = s.collect_usage(usize::MAX).await.unwrap();
    let mine: Vec<_> = usage.into_iter().filter(|u| u.bucket == b).collect();
    assert_eq!(mine.len(), 1);
    assert_eq!((mine[0].admitted, mine[0].denied), (4, 0));
    // A window peek likewise.
    let w = Limit::SlidingWindow {
        limit: 5,
        window_ms: 1000,
    };
    let bw = fresh_bucket("peek-window");
    s.check(&req(&bw, w, 2, Some(T0))).await.unwrap();
    let d = s.check(&req(&bw, w, 0, Some(T0 + 10))).await.unwrap();
    assert_eq!((d.allowed, d.remaining, d.reset_ms), (true, 3, Some(990)));
    let d = s.check(&req(&bw, w, 3, Some(T0 + 20))).await.unwrap();
    assert!(d.allowed);
}

/// Issue 36: the store keeps the earlier of `now + remaining` and the latest end it is given
/// (`not_after`, the region's lease end on the store's clock), so a write that runs late
/// cannot carry the lease past the region's.
async fn a_lease_ends_at_the_earlier_of_its_time_and_latest_end<S: Store>(s: &S) {
    let fallback = tokens(100, 100);
    // Written at T0 with 5 s left: (latest end from T0, when the floor takes over).
    let cases: [(Option<i64>, u64); 5] = [
        (None, T0 + 5_000),
        (Some(3_000), T0 + 3_000),
        (Some(5_000), T0 + 5_000),
        (Some(9_000), T0 + 5_000),
        // Already past: the floor from the write on.
        (Some(-1), T0),
    ];
    for (i, (not_after, end)) in cases.into_iter().enumerate() {
        let b = fresh_bucket(&format!("latest-end-{i}"));
        let mut p = SetParams::new(b.clone(), tokens(10, 10)).with_lease(5_000, tokens(2, 1));
        if let Some(d) = not_after {
            p = p.not_after(T0.saturating_add_signed(d));
        }
        s.set_params(&p.at(T0)).await.unwrap();
        let left = |at: u64| {
            let b = b.clone();
            async move { s.check(&req(&b, fallback, 0, Some(at))).await.unwrap() }
        };
        if end > T0 {
            assert_eq!(
                left(end - 1).await.remaining,
                10,
                "{not_after:?}: share held"
            );
        }
        assert_eq!(
            left(end).await.remaining,
            2,
            "{not_after:?}: floor at {end}"
        );
    }
}

async fn the_floor_takes_over_at_the_lease_end<S: Store>(s: &S) {
    let b = fresh_bucket("lease");
    let fallback = tokens(100, 100);
    // Share: 10 tokens refilling at 10/s, for 2 s; then the floor, 2 tokens at 1/s.
    let p = SetParams::new(b.clone(), tokens(10, 10))
        .with_lease(2000, tokens(2, 1))
        .at(T0);
    s.set_params(&p).await.unwrap();
    let admitted = |from: u64, n: u64| {
        let b = b.clone();
        async move {
            let mut a = 0;
            for i in 0..n {
                a += u64::from(
                    s.check(&req(&b, fallback, 1, Some(from + i)))
                        .await
                        .unwrap()
                        .allowed,
                );
            }
            a
        }
    };
    assert_eq!(admitted(T0, 20).await, 10);
    // Just before the end the share still refills; from the end on, the floor caps the bucket.
    assert_eq!(admitted(T0 + 1999, 1).await, 1);
    assert_eq!(admitted(T0 + 2000, 20).await, 2);
    let d = s
        .check(&req(&b, fallback, 0, Some(T0 + 60_000)))
        .await
        .unwrap();
    assert_eq!(
        d.remaining, 2,
        "a floor bucket never refills above the floor"
    );
    // Renewing (as the agent does on every report) brings the share back, for a new lease.
    s.set_params(&p.clone().at(T0 + 60_000)).await.unwrap();
    assert_eq!(admitted(T0 + 60_500, 20).await, 10);
    assert_eq!(
        admitted(T0 + 65_000, 20).await,
        2,
        "the renewed lease ended at +62 s"
    );
    // A bucket first decided after the end starts full at the floor, not at the share.
    let b2 = fresh_bucket("lease-cold");
    s.set_params(
        &SetParams::new(b2.clone(), tokens(10, 10))
            .with_lease(0, tokens(3, 0))
            .at(T0),
    )
    .await
    .unwrap();
    let d = s.check(&req(&b2, fallback, 0, Some(T0))).await.unwrap();
    assert_eq!(d.remaining, 3);
    // Windows too: 10 per second, then 2.
    let bw = fresh_bucket("lease-window");
    let w = |limit| Limit::SlidingWindow {
        limit,
        window_ms: 1000,
    };
    s.set_params(
        &SetParams::new(bw.clone(), w(10))
            .with_lease(5000, w(2))
            .at(T0),
    )
    .await
    .unwrap();
    let d = s.check(&req(&bw, w(50), 0, Some(T0 + 4999))).await.unwrap();
    assert_eq!(d.remaining, 10);
    let d = s.check(&req(&bw, w(50), 0, Some(T0 + 5000))).await.unwrap();
    assert_eq!(d.remaining, 2);
}

async fn decisions_follow_the_reference<S: Store>(s: &S) {
    let b = fresh_bucket("ref");
    let p = BucketParams::new(10 * UT, 2 * UT).unwrap();
    let mut state = None;
    let steps = [
        (0, 3),
        (0, 7),
        (0, 1),
        (250, 1),
        (750, 1),
        (3750, 10),
        (3751, 2),
    ];
    for (i, &(at, cost)) in steps.iter().enumerate() {
        let now = T0 + at;
        let (want, next) = bucket::decide(now, &p, state.as_ref(), cost);
        state = Some(next);
        let got = s
            .check(&req(&b, Limit::TokenBucket(p), cost, Some(now)))
            .await
            .unwrap();
        assert_eq!(got, want, "step {i}");
    }
}

async fn refill_uses_the_explicit_now<S: Store>(s: &S) {
    let b = fresh_bucket("refill");
    let l = tokens(5, 1);
    for _ in 0..5 {
        assert!(s.check(&req(&b, l, 1, Some(T0))).await.unwrap().allowed);
    }
    let d = s.check(&req(&b, l, 1, Some(T0))).await.unwrap();
    assert_eq!(
        d,
        Decision {
            allowed: false,
            remaining: 0,
            retry_after_ms: Some(1000),
            reset_ms: Some(5000)
        }
    );
    // A clock stepping back refills nothing.
    assert!(
        !s.check(&req(&b, l, 1, Some(T0 - 60_000)))
            .await
            .unwrap()
            .allowed
    );
    let d = s.check(&req(&b, l, 2, Some(T0 + 2000))).await.unwrap();
    assert!(d.allowed);
    assert_eq!(d.remaining, 0);
}

async fn written_params_win_over_the_fallback<S: Store>(s: &S) {
    let b = fresh_bucket("params");
    s.set_params(&SetParams::new(b.clone(), tokens(3, 0)))
        .await
        .unwrap();
    let fallback = tokens(100, 100);
    let mut admitted = 0;
    for _ in 0..10 {
        admitted += u32::from(
            s.check(&req(&b, fallback, 1, Some(T0)))
                .await
                .unwrap()
                .allowed,
        );
    }
    assert_eq!(admitted, 3);
    let d = s
        .check(&req(&b, fallback, 1, Some(T0 + 1_000_000)))
        .await
        .unwrap();
    assert_eq!(
        (d.allowed, d.retry_after_ms, d.reset_ms),
        (false, None, None)
    );
    // New parameters apply to the same bucket state: capacity 5 refilling at 1/s.
    s.set_params(&SetParams::new(b.clone(), tokens(5, 1)))
        .await
        .unwrap();
    let d = s
        .check(&req(&b, fallback, 1, Some(T0 + 1_001_000)))
        .await
        .unwrap();
    assert!(d.allowed);
    // Window parameters do not apply to a token-bucket check: the fallback does.
    let b2 = fresh_bucket("params");
    s.set_params(&SetParams::new(
        b2.clone(),
        Limit::SlidingWindow {
            limit: 1,
            window_ms: 1000,
        },
    ))
    .await
    .unwrap();
    let d = s.check(&req(&b2, tokens(4, 0), 1, Some(T0))).await.unwrap();
    assert_eq!(d.remaining, 3);
}

/// `clear_params` drops a bucket's parameters and state: the next check starts a full bucket
/// at its fallback; other buckets keep theirs.
async fn cleared_params_and_state_are_gone<S: Store>(s: &S) {
    let (b, other) = (fresh_bucket("clear"), fresh_bucket("clear"));
    for x in [&b, &other] {
        s.set_params(&SetParams::new(x.clone(), tokens(3, 0)))
            .await
            .unwrap();
        for _ in 0..3 {
            assert!(
                s.check(&req(x, tokens(100, 0), 1, Some(T0)))
                    .await
                    .unwrap()
                    .allowed
            );
        }
    }
    s.clear_params(&b).await.unwrap();
    // Clearing twice (or a bucket never written) is not an error.
    s.clear_params(&b).await.unwrap();
    let fallback = tokens(100, 0);
    let d = s.check(&req(&b, fallback, 1, Some(T0))).await.unwrap();
    assert_eq!(
        (d.allowed, d.remaining),
        (true, 99),
        "a new bucket at the fallback"
    );
    let d = s.check(&req(&other, fallback, 1, Some(T0))).await.unwrap();
    assert_eq!(
        (d.allowed, d.remaining),
        (false, 0),
        "the other bucket keeps its state"
    );
}

async fn listed_params_are_those_held<S: Store>(s: &S) {
    // More than one SCAN step's worth, of both kinds, so the cursor is followed to the end.
    let mut written = std::collections::BTreeSet::new();
    for i in 0..2_500 {
        let b = fresh_bucket("list");
        let limit = if i % 5 == 0 {
            Limit::SlidingWindow {
                limit: 10,
                window_ms: 1000,
            }
        } else {
            tokens(3, 1)
        };
        s.set_params(&SetParams::new(b.clone(), limit))
            .await
            .unwrap();
        written.insert(b);
    }
    let cleared = written.pop_first().unwrap();
    s.clear_params(&cleared).await.unwrap();
    // A bucket decided at the fallback has state but no parameters: not listed.
    let state_only = fresh_bucket("list-state");
    s.check(&req(&state_only, tokens(5, 1), 1, Some(T0)))
        .await
        .unwrap();
    let listed: std::collections::BTreeSet<_> =
        s.list_params().await.unwrap().into_iter().collect();
    assert_eq!(listed.len(), written.len(), "each held bucket once");
    assert_eq!(listed, written);
}

fn sorted(mut v: Vec<UsageRecord>) -> Vec<UsageRecord> {
    v.sort_by(|a, b| a.bucket.cmp(&b.bucket));
    v
}

async fn usage_is_counted_and_drained_once<S: Store>(s: &S) {
    s.collect_usage(usize::MAX).await.unwrap();
    let (a, b) = (fresh_bucket("usage"), fresh_bucket("usage"));
    let l = tokens(5, 0);
    for _ in 0..4 {
        s.check(&req(&a, l, 2, Some(T0))).await.unwrap(); // 2 admitted, then 2 denied
    }
    s.check(&req(&b, l, 5, Some(T0))).await.unwrap();
    let got = sorted(s.collect_usage(usize::MAX).await.unwrap());
    let want = sorted(vec![
        UsageRecord {
            bucket: a.clone(),
            admitted: 4,
            denied: 4,
        },
        UsageRecord {
            bucket: b.clone(),
            admitted: 5,
            denied: 0,
        },
    ]);
    assert_eq!(got, want);
    assert_eq!(s.collect_usage(usize::MAX).await.unwrap(), vec![]);
    // A decision after a collection is reported again, counted from zero.
    s.check(&req(&a, l, 1, Some(T0))).await.unwrap();
    let got = s.collect_usage(usize::MAX).await.unwrap();
    assert_eq!(
        got,
        vec![UsageRecord {
            bucket: a.clone(),
            admitted: 1,
            denied: 0
        }]
    );
    // `max` bounds one collection; the rest waits for the next.
    for _ in 0..3 {
        let c = fresh_bucket("usage");
        s.check(&req(&c, l, 1, Some(T0))).await.unwrap();
    }
    assert_eq!(s.collect_usage(2).await.unwrap().len(), 2);
    assert_eq!(s.collect_usage(2).await.unwrap().len(), 1);
}

async fn sliding_window_counts_every_request<S: Store>(s: &S) {
    let b = fresh_bucket("window");
    let l = Limit::SlidingWindow {
        limit: 3,
        window_ms: 1000,
    };
    // Three in the same millisecond all count (no member collisions), the fourth is denied.
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(s.check(&req(&b, l, 1, Some(T0))).await.unwrap());
    }
    assert_eq!(
        got.iter().map(|d| d.allowed).collect::<Vec<_>>(),
        [true, true, true, false]
    );
    assert_eq!(got[3].retry_after_ms, Some(1000));
    assert_eq!(got[2].remaining, 0);
    assert!(
        !s.check(&req(&b, l, 1, Some(T0 + 999)))
            .await
            .unwrap()
            .allowed
    );
    let d = s.check(&req(&b, l, 2, Some(T0 + 1000))).await.unwrap();
    assert_eq!((d.allowed, d.remaining, d.reset_ms), (true, 1, Some(1000)));
    let usage = s.collect_usage(usize::MAX).await.unwrap();
    let mine: Vec<_> = usage.into_iter().filter(|u| u.bucket == b).collect();
    assert_eq!(
        mine,
        vec![UsageRecord {
            bucket: b,
            admitted: 5,
            denied: 2
        }]
    );
}

async fn sliding_window_counters_for_large_limits<S: Store>(s: &S) {
    // 1000 per second: sub-windows of 8 ms, 126 counted. 1000 spent 3 ms into a second count
    // until 1008 ms into it: never less than the window, at most 2·8 − 2 ms more.
    let b = fresh_bucket("counters");
    let l = Limit::SlidingWindow {
        limit: 1000,
        window_ms: 1000,
    };
    let start = T0 - T0 % 1000;
    assert!(
        s.check(&req(&b, l, 1000, Some(start + 3)))
            .await
            .unwrap()
            .allowed
    );
    let d = s.check(&req(&b, l, 1, Some(start + 1003))).await.unwrap();
    assert_eq!((d.allowed, d.retry_after_ms), (false, Some(5)));
    let d = s
        .check(&req(&b, l, 1000, Some(start + 1008)))
        .await
        .unwrap();
    assert_eq!((d.allowed, d.remaining), (true, 0));
}

async fn invalid_requests_are_rejected<S: Store>(s: &S) {
    let b = fresh_bucket("invalid");
    let bad = [
        req(&b, tokens(1, 1), quota_store::MAX_COST + 1, None),
        req(&b, tokens(1, 1), 1, Some(1 << 53)),
        req(
            &b,
            Limit::TokenBucket(BucketParams {
                capacity_ut: 1 << 53,
                ..BucketParams::per_period(0, 1, 1000).unwrap()
            }),
            1,
            None,
        ),
        req(
            &b,
            Limit::TokenBucket(BucketParams {
                capacity_ut: 1 << 40,
                ..BucketParams::per_period(0, 1, 1000).unwrap()
            }),
            1,
            None,
        ),
        req(
            &b,
            Limit::SlidingWindow {
                limit: 1,
                window_ms: 0,
            },
            1,
            None,
        ),
    ];
    for r in &bad {
        assert!(
            matches!(s.check(r).await, Err(StoreError::Rejected { .. })),
            "{r:?}"
        );
    }
    let r = s
        .set_params(&SetParams::new(
            b.clone(),
            Limit::SlidingWindow {
                limit: u64::MAX,
                window_ms: 1,
            },
        ))
        .await;
    assert!(matches!(r, Err(StoreError::Rejected { .. })));
}

async fn cost_above_capacity_is_a_denial<S: Store>(s: &S) {
    let b = fresh_bucket("big");
    let d = s.check(&req(&b, tokens(5, 1), 6, Some(T0))).await.unwrap();
    assert_eq!(
        d,
        Decision {
            allowed: false,
            remaining: 5,
            retry_after_ms: None,
            reset_ms: Some(0)
        }
    );
}
