//! The protocol as designed, both backends: no `always` property is violated in any reachable
//! state at the bounds below, and every `sometimes` property is reached (the model is not
//! vacuous). Each test prints its state count and time (`cargo test -- --nocapture`, or
//! nextest's output of a passing test with `--no-capture`).
//!
//! The same holds with a store that may go back once (PostgreSQL to an earlier copy; etcd to an
//! older snapshot), INV-02 included: a payment whose record went back is retried with its first
//! token (`a_retry_whose_record_went_back_goes_on_only_when_the_rail_has_none_on_both_backends`).
//!
//! The bounds larger than CI can afford are behind `#[ignore]`:
//! `cargo test --release -p railguard-model -- --ignored`.

use railguard_model::network::{Msg, Reply};
use railguard_model::properties::{
    HANDED_OVER, HELD_AFTER_STORE_CHANGE, LOST_ATTEMPT_NOT_ON_THE_RAIL, T_042,
};
use railguard_model::{Action, Backend, Bounds, FencingModel, run};
use stateright::Model;

/// Explores every state of the protocol as designed and fails on any violation (printing its
/// trace) or any `sometimes` never reached.
fn assert_safe(backend: Backend, bounds: Bounds) {
    let outcome = run(
        FencingModel::correct(backend, bounds).with_symmetry(),
        2,
        None,
    );
    println!("{}", outcome.summary());
    let violations = outcome.violations();
    if let Some(first) = violations.first() {
        // The symmetric run renames workers; show the violation again without that.
        let readable = run(FencingModel::correct(backend, bounds), 1, Some(*first));
        panic!(
            "{backend}: {violations:?} violated; shortest trace of {first}:\n{}",
            readable.trace(first).unwrap_or_default()
        );
    }
    assert_eq!(
        outcome.unreached(),
        Vec::<&str>::new(),
        "{backend}: the model is vacuous in these respects"
    );
}

#[test]
fn postgres_three_workers_contending_for_one_account_is_safe() {
    assert_safe(Backend::Postgres, Bounds::THREE_WORKERS);
}

#[test]
fn etcd_three_workers_contending_for_one_account_is_safe() {
    assert_safe(Backend::Etcd, Bounds::THREE_WORKERS);
}

#[test]
fn postgres_reacquiring_workers_is_safe() {
    assert_safe(Backend::Postgres, Bounds::REACQUIRE);
}

#[test]
fn etcd_reacquiring_workers_is_safe() {
    assert_safe(Backend::Etcd, Bounds::REACQUIRE);
}

#[test]
fn postgres_two_accounts_is_safe() {
    assert_safe(Backend::Postgres, Bounds::TWO_ACCOUNTS);
}

#[test]
fn etcd_two_accounts_is_safe() {
    assert_safe(Backend::Etcd, Bounds::TWO_ACCOUNTS);
}

/// Two proxy processes on one database, and a worker sends each submit (and its retry) to
/// either: the handover keeps the rail's arrivals in grant order, and the checker reaches a
/// request that waits for the other process's forward before its own.
#[test]
fn postgres_two_proxies_without_routing_is_safe() {
    assert_safe(Backend::Postgres, Bounds::TWO_PROXIES);
}

#[test]
fn etcd_two_proxies_without_routing_is_safe() {
    assert_safe(Backend::Etcd, Bounds::TWO_PROXIES);
}

/// SPEC.md's T-042, step by step, on the PostgreSQL backend: W1 takes account A and stalls
/// past its lease; W2 takes A over and reaches the rail; W1 wakes and submits with its old
/// token and is answered 409, and the rail saw only W2's request.
#[test]
fn t042_the_stalled_survivor_is_fenced_out() {
    let model = FencingModel::correct(Backend::Postgres, Bounds::VARIANTS);
    let mut state = model.init_states().remove(0);
    let step = |state: &mut _, action: Action| {
        let mut offered = Vec::new();
        model.actions(state, &mut offered);
        assert!(offered.contains(&action), "{action} is not possible here");
        println!("{action}");
        *state = model.next_state(state, action).expect("the step happens");
    };
    let (w1, w2) = (0, 1);
    step(&mut state, Action::Draw(w1));
    step(&mut state, Action::Lock(w1));
    step(
        &mut state,
        Action::Claim {
            worker: w1,
            payment: 0,
        },
    );
    // W1 stalls: it takes no step while its lease runs out.
    step(&mut state, Action::Expire(0));
    step(&mut state, Action::Draw(w2));
    step(&mut state, Action::Lock(w2));
    assert!(state.lock.grants[1].took_over, "W2 took the key over");
    let (old, new) = (state.lock.grants[0].token, state.lock.grants[1].token);
    assert!(old < new, "W2's token {new} is above W1's {old}");
    step(
        &mut state,
        Action::Claim {
            worker: w2,
            payment: 0,
        },
    );
    step(
        &mut state,
        Action::Submit {
            worker: w2,
            proxy: 0,
        },
    );
    let in_flight = |state: &railguard_model::ProtocolState| state.network.in_flight[0].clone();
    let submit = in_flight(&state);
    step(&mut state, Action::Deliver(submit));
    let task = state.fence.tasks[0].clone();
    step(&mut state, Action::Start(task));
    let forward = in_flight(&state);
    step(&mut state, Action::Deliver(forward));
    assert_eq!(
        state.fence.marks[0], new,
        "the high-water mark is W2's token"
    );
    // W1 wakes and submits with its own, old token.
    step(
        &mut state,
        Action::Submit {
            worker: w1,
            proxy: 0,
        },
    );
    let submit = state
        .network
        .in_flight
        .iter()
        .find(|m| matches!(m, Msg::Submit { worker: 0, .. }))
        .cloned()
        .expect("W1's submit is in flight");
    step(&mut state, Action::Deliver(submit));
    assert!(
        state.network.in_flight.contains(&Msg::Reply {
            worker: w1,
            grant: 0,
            payment: 0,
            reply: Reply::FencedOut,
        }),
        "W1 is answered 409 fenced_out"
    );
    assert_eq!(
        state.rail.arrivals.len(),
        1,
        "the rail saw only W2's request"
    );
    assert_eq!(state.rail.arrivals[0].grant, 1);
    assert!(state.seen.t042);
}

/// The checker finds T-042 on its own, on both backends, and prints the shortest way there.
#[test]
fn the_checker_reaches_t042_on_both_backends() {
    for backend in [Backend::Postgres, Backend::Etcd] {
        let outcome = run(
            FencingModel::correct(backend, Bounds::VARIANTS),
            1,
            Some(T_042),
        );
        let trace = outcome.trace(T_042).expect("T-042 is reachable");
        println!("{backend}: {T_042}\n{trace}");
    }
}

/// PostgreSQL goes back to a copy taken at any moment before (a failover to a standby that
/// missed commits, a rewound data directory): the sequence, rows, marks and records go back
/// together, and the floor fences every grant from before.
#[test]
fn postgres_going_back_is_fenced() {
    assert_safe(Backend::Postgres, Bounds::GOING_BACK);
}

/// On the etcd backend either store may go back: PostgreSQL (marks and records, not etcd), or
/// etcd restored from a snapshot (revision and keys, not PostgreSQL's marks).
#[test]
fn etcd_going_back_is_fenced() {
    assert_safe(Backend::Etcd, Bounds::GOING_BACK);
}

/// The same with workers that acquire again once their old grant is fenced out.
#[test]
fn postgres_going_back_with_reacquiring_workers_is_fenced() {
    assert_safe(Backend::Postgres, Bounds::GOING_BACK_REACQUIRE);
}

#[test]
fn etcd_going_back_with_reacquiring_workers_is_fenced() {
    assert_safe(Backend::Etcd, Bounds::GOING_BACK_REACQUIRE);
}

/// etcd restored from a snapshot, step by step: W1's grant is forgotten with the keys; the
/// revision W2 is given is one W1 was given, so `lock_issued` withdraws it, raises the floor
/// above it and moves the revision up; W2's next grant is above the floor, and W1's old token
/// is refused below it.
#[test]
fn etcd_restored_is_caught_by_lock_issued() {
    let model = FencingModel::correct(
        Backend::Etcd,
        Bounds {
            postgres_goes_back: false,
            ..Bounds::GOING_BACK
        },
    );
    let mut state = model.init_states().remove(0);
    let step = |state: &mut _, action: Action| {
        let mut offered = Vec::new();
        model.actions(state, &mut offered);
        assert!(offered.contains(&action), "{action} is not possible here");
        println!("{action}");
        *state = model.next_state(state, action).expect("the step happens");
    };
    let (w1, w2) = (0, 1);
    step(&mut state, Action::CopyStores);
    step(&mut state, Action::Acquire(w1));
    let old = state.lock.grants[0].token;
    step(
        &mut state,
        Action::Claim {
            worker: w1,
            payment: 0,
        },
    );
    step(&mut state, Action::EtcdRestored);
    assert!(!state.lock.is_live(0), "etcd forgot W1's grant");
    step(&mut state, Action::Acquire(w2));
    assert_eq!(
        state.lock.grants.len(),
        1,
        "W2's repeated token was withdrawn"
    );
    assert!(
        state.epoch.floor > old,
        "the floor is above every issued token"
    );
    step(&mut state, Action::Acquire(w2));
    let new = state.lock.grants[1].token;
    assert!(
        new >= state.epoch.floor,
        "W2's new grant ({new}) is not below the floor"
    );
    step(
        &mut state,
        Action::Submit {
            worker: w1,
            proxy: 0,
        },
    );
    let submit = state.network.in_flight[0].clone();
    step(&mut state, Action::Deliver(submit));
    assert!(
        state.network.in_flight.contains(&Msg::Reply {
            worker: w1,
            grant: 0,
            payment: 0,
            reply: Reply::FencedOut,
        }),
        "W1 is answered 409: its token {old} is below the floor"
    );
    assert!(state.rail.arrivals.is_empty());
    assert!(state.seen.fenced_by_floor && state.seen.withdrawn);
}

/// A payment whose idempotency record went back with the store: its retry carries the first
/// grant's token, and once nothing sent before the change can still reach the rail, the rail's
/// lookup finding no such payment lets it go on as the key's first request — INV-02 holding
/// throughout (the `NoFirstToken` and `LostLookupBeforeHold` variants show what each part
/// prevents). The checker reaches it on both backends; the shortest way there is printed.
#[test]
fn a_retry_whose_record_went_back_goes_on_only_when_the_rail_has_none_on_both_backends() {
    for backend in [Backend::Postgres, Backend::Etcd] {
        let bounds = Bounds {
            etcd_goes_back: false,
            ..Bounds::GOING_BACK
        };
        let outcome = run(
            FencingModel::correct(backend, bounds),
            1,
            Some(LOST_ATTEMPT_NOT_ON_THE_RAIL),
        );
        assert!(
            outcome.violations().is_empty(),
            "{:?}",
            outcome.violations()
        );
        let trace = outcome
            .trace(LOST_ATTEMPT_NOT_ON_THE_RAIL)
            .expect("a retry whose record went back goes on");
        println!("{backend}: {LOST_ATTEMPT_NOT_ON_THE_RAIL}\n{trace}");
    }
}

/// One proxy process that may die and start again as a new instance while its forwards are in
/// the network: the handover holds the new instance's forwards back until the old instance's
/// can no longer reach the rail.
#[test]
fn postgres_a_restarting_proxy_is_safe() {
    assert_safe(Backend::Postgres, Bounds::RESTART);
}

#[test]
fn etcd_a_restarting_proxy_is_safe() {
    assert_safe(Backend::Etcd, Bounds::RESTART);
}

/// The checker reaches the handover unaided: a request of a newer grant in one process waits
/// for the other process's forward of an older grant, and may go on once that forward reached
/// the rail. The shortest way there is printed.
#[test]
fn the_checker_reaches_a_wait_for_the_other_proxys_forward() {
    let outcome = run(
        FencingModel::correct(Backend::Postgres, Bounds::TWO_PROXIES),
        1,
        Some(HANDED_OVER),
    );
    let trace = outcome
        .trace(HANDED_OVER)
        .expect("the handover is reachable");
    println!("{HANDED_OVER}\n{trace}");
}

/// PostgreSQL goes back with two proxy processes: the handover entries go back with the mark
/// rows, the forwards on their way do not. The hold after the store change keeps a forward of a
/// grant made after it behind the other process's forward from before it, and the last look
/// refuses a request from before it not yet sent: the rail's arrivals stay in grant order, and
/// the checker reaches a request held until the other process's forward reached the rail.
#[test]
fn two_proxies_keep_the_rail_order_when_postgres_goes_back() {
    assert_safe(Backend::Postgres, Bounds::GOING_BACK_TWO_PROXIES);
}

/// The checker reaches the hold unaided: P1's forward of g1 is on its way when PostgreSQL goes
/// back with P1's entry; P2 accepts g2's request above the floor, finds no entry to wait for,
/// and is held until g1's forward has reached the rail. The shortest way there is printed.
#[test]
fn the_checker_reaches_a_hold_after_the_store_change() {
    let outcome = run(
        FencingModel::correct(Backend::Postgres, Bounds::GOING_BACK_TWO_PROXIES),
        1,
        Some(HELD_AFTER_STORE_CHANGE),
    );
    let trace = outcome
        .trace(HELD_AFTER_STORE_CHANGE)
        .expect("the hold is reachable");
    println!("{HELD_AFTER_STORE_CHANGE}\n{trace}");
}

/// The same with one proxy process that may restart: the instance after the restart holds a
/// newer grant's forward behind the one the instance before it left in the network, whether it
/// died before the store change (the quiet bound) or after it.
#[test]
fn a_restarting_proxy_keeps_the_rail_order_when_postgres_goes_back() {
    assert_safe(Backend::Postgres, Bounds::GOING_BACK_RESTART);
}

/// Three workers that may each acquire twice: too slow for CI's debug build, run with
/// `cargo test --release -p railguard-model -- --ignored` (numbers in `docs/protocol.md`).
#[test]
#[ignore]
fn large_bounds_both_backends_are_safe() {
    for backend in [Backend::Postgres, Backend::Etcd] {
        assert_safe(backend, Bounds::LARGE);
    }
}

/// A store that may go back with three grants, and with CI's reacquiring workers: millions of
/// states per backend (over ten million for the second), run with `--ignored` in a release
/// build.
#[test]
#[ignore]
fn large_bounds_going_back_both_backends_are_fenced() {
    for bounds in [Bounds::GOING_BACK_THREE_GRANTS, Bounds::GOING_BACK_LARGE] {
        for backend in [Backend::Postgres, Backend::Etcd] {
            assert_safe(backend, bounds);
        }
    }
}
