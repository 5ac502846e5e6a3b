//! The protocol as designed, both backends: no `always` property is violated in any reachable
//! state at the bounds below, and every `sometimes` property is reached (the model is not
//! vacuous). Each test prints its state count and time (`cargo test -- --nocapture`, or
//! nextest's output of a passing test with `--no-capture`).
//!
//! The bounds larger than CI can afford are behind `#[ignore]`:
//! `cargo test --release -p railguard-model -- --ignored`.

use railguard_model::network::{Msg, Reply};
use railguard_model::properties::T_042;
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

/// Three workers that may each acquire twice: too slow for CI's debug build, run with
/// `cargo test --release -p railguard-model -- --ignored` (numbers in `docs/protocol.md`).
#[test]
#[ignore]
fn large_bounds_both_backends_are_safe() {
    for backend in [Backend::Postgres, Backend::Etcd] {
        assert_safe(backend, Bounds::LARGE);
    }
}
