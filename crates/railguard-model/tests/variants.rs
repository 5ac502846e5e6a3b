//! Every alternative ADR-002 rejected, and every guard of the real code removed, is caught:
//! the checker finds a counterexample to the property the variant breaks, and prints it. The
//! same bounds without the variant hold that property in every reachable state, so each
//! failure is the variant's doing, not the bounds'.

use railguard_model::{Bounds, FencingModel, Variant, run};

/// Explores `variant` completely at the variants' bounds: the property it breaks, and each it
/// also breaks, must have a counterexample (printed, shortest first: breadth-first, one
/// thread). Then the protocol as designed at the same bounds must hold those properties.
fn assert_caught(variant: Variant) {
    assert_caught_at(variant, Bounds::VARIANTS);
}

/// [`assert_caught`] at other bounds.
fn assert_caught_at(variant: Variant, bounds: Bounds) {
    let broken = variant.breaks();
    let model = FencingModel::with_variant(variant, bounds);
    let bounds = model.bounds;
    let outcome = run(model, 1, None);
    println!("{}", outcome.summary());
    let trace = outcome.trace(broken).unwrap_or_else(|| {
        panic!("variant `{variant}` was not caught: no counterexample to {broken}")
    });
    println!("shortest counterexample to {broken}:\n{trace}");
    for also in variant.also_breaks() {
        assert!(
            outcome.discoveries.contains_key(also),
            "variant `{variant}` was not caught breaking {also}"
        );
    }
    for other in outcome.violations().into_iter().filter(|p| *p != broken) {
        let trace = outcome.trace(other).expect("a violation has a trace");
        println!("also breaks {other}; shortest counterexample:\n{trace}");
    }

    let baseline = run(FencingModel::correct(variant.backend(), bounds), 1, None);
    for property in std::iter::once(&broken).chain(variant.also_breaks()) {
        assert!(
            !baseline.discoveries.contains_key(property),
            "without the variant, {property} must hold at the same bounds ({})",
            baseline.summary()
        );
    }
}

#[test]
fn reread_token_at_write_breaks_equal_token_same_grant() {
    assert_caught(Variant::RereadTokenAtWrite);
}

#[test]
fn create_revision_token_breaks_equal_token_same_grant() {
    assert_caught(Variant::CreateRevisionToken);
}

#[test]
fn per_row_version_token_breaks_inv04() {
    assert_caught(Variant::PerRowVersionToken);
}

#[test]
fn lease_id_token_breaks_inv04() {
    assert_caught(Variant::LeaseIdToken);
}

#[test]
fn wall_clock_token_breaks_inv04() {
    assert_caught(Variant::WallClockToken);
}

#[test]
fn takeover_without_token_guard_breaks_inv04() {
    assert_caught(Variant::NoTakeoverTokenGuard);
}

#[test]
fn proxy_without_forward_order_breaks_inv05() {
    assert_caught(Variant::NoForwardOrder);
}

#[test]
fn turn_released_on_send_breaks_inv05() {
    assert_caught(Variant::TurnReleasedOnSend);
}

#[test]
fn turn_released_on_upstream_timeout_breaks_inv05() {
    assert_caught(Variant::TurnReleasedOnUpstreamTimeout);
}

/// Two proxy processes, no routing, no handover: a forward of P1 still in the network when P2
/// accepts and forwards a newer grant's request reaches the rail after it.
#[test]
fn no_cross_process_order_breaks_inv05() {
    assert_caught(Variant::NoCrossProcessOrder);
}

/// One proxy process, no handover: it dies with a forward in the network, and the instance
/// that starts after it forwards a newer grant's request, which reaches the rail first.
#[test]
fn no_cross_process_order_breaks_inv05_across_a_restart() {
    assert_caught_at(Variant::NoCrossProcessOrder, Bounds::RESTART);
}

#[test]
fn entry_settled_on_send_breaks_inv05() {
    assert_caught(Variant::EntrySettledOnSend);
}

#[test]
fn entry_replacing_other_processes_entries_breaks_inv05() {
    assert_caught(Variant::EntryReplacesOthers);
}

#[test]
fn no_idempotency_keys_breaks_inv02() {
    assert_caught(Variant::NoIdempotencyKeys);
}

/// PostgreSQL goes back unnoticed: its sequence went back with the data and hands a new grant
/// a token already granted.
#[test]
fn no_store_epoch_check_breaks_inv04() {
    assert_caught(Variant::NoStoreEpochCheck);
}

/// On etcd, unnoticed: etcd restored hands out a revision again (INV-04); PostgreSQL gone back
/// forgets a payment's mark and record, and its grant's retry reaches the rail again (INV-02).
#[test]
fn no_store_epoch_check_on_etcd_breaks_inv04_and_inv02() {
    assert_caught(Variant::NoStoreEpochCheckOnEtcd);
}

/// PostgreSQL goes back with two proxy processes and nothing holds the forwards after it: P1's
/// forward of g1 is on its way when the mark row, with P1's entry, goes back; g2, granted above
/// the floor, is accepted by P2, whose compare-and-set finds no entry to wait for, and its
/// forward reaches the rail first.
#[test]
fn no_hold_after_store_change_breaks_inv05() {
    assert_caught_at(
        Variant::NoHoldAfterStoreChange,
        Bounds {
            retries: 0,
            ..Bounds::VARIANTS
        },
    );
}

/// One proxy process that restarts across PostgreSQL going back, no hold: the instance after
/// the restart forwards a newer grant's request while the instance before it left a forward in
/// the network.
#[test]
fn no_hold_after_store_change_breaks_inv05_across_a_restart() {
    assert_caught_at(
        Variant::NoHoldAfterStoreChange,
        Bounds {
            retries: 0,
            ..Bounds::RESTART
        },
    );
}

/// The rail's lookup forgets a record in doubt without waiting for the transit time: the proxy
/// restarts with its forward still in the network, the lookup finds no payment and forgets the
/// record, the retry is forwarded, and the first forward arrives too — the payment twice.
#[test]
fn lookup_before_transit_breaks_inv02() {
    assert_caught(Variant::LookupBeforeTransit);
}

/// Exploring up to a renaming of workers (as the protocol-as-designed tests do) hides no
/// violation: every variant is still caught with symmetry on.
#[test]
fn symmetry_hides_no_violation() {
    for variant in Variant::ALL {
        let model = FencingModel::with_variant(variant, Bounds::VARIANTS).with_symmetry();
        let outcome = run(model, 1, Some(variant.breaks()));
        assert!(
            outcome.discoveries.contains_key(variant.breaks()),
            "with symmetry, `{variant}` is not caught"
        );
    }
}

/// Retries without `Idempotency-First-Token`: W1's payment reaches the rail, PostgreSQL goes
/// back with its record, and W2's retry, finding no record, is taken as a new payment — the
/// payment twice.
#[test]
fn no_first_token_breaks_inv02() {
    assert_caught(Variant::NoFirstToken);
}

/// The rail's lookup for a retry whose record went back asked at once: W1's forward is still
/// in the network when PostgreSQL goes back with its record; W2's retry asks the rail, which
/// has no such payment yet, and goes on; both reach the rail.
#[test]
fn lost_lookup_before_the_hold_breaks_inv02() {
    assert_caught(Variant::LostLookupBeforeHold);
}
