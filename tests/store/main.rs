//! The PostgreSQL store: the store going back (epoch), failover on Patroni, replication that
//! can lose a compare-and-set, several railguard processes on one database, the hold after a
//! change of server, the instance lock's session, a compare-and-set whose answer is lost, a
//! URL naming several servers of which the first does not answer, the session settings,
//! stalled statements, statement plans, online schema maintenance, and the PostgreSQL test
//! harness they stand on.
//!
//! One test binary: each file is a module, named for the behaviour it covers.

mod cross_process;
mod epoch;
mod failover;
mod hold;
mod instance_lock;
mod lost_answers;
mod many_servers;
mod pg_harness;
mod replication;
mod schema_maintenance;
mod serve;
mod session_settings;
mod stalled_statements;
mod statement_plans;

use railguard_testkit as support;

/// Two railguard processes on one PostgreSQL, after the database went back under A's forward:
/// see [`rewound_under_a_forward`]. A test binds every field: A and its path must live while
/// A's forward is on its way.
struct Rewound {
    pg: support::Pg,
    rail: support::Rail,
    /// A's path to the rail, holding its forward.
    _slow_path: support::Relay,
    /// A, kept running while its forward is on its way.
    _a: support::Railguard,
    b: support::Railguard,
    /// A's payment of token 5.
    older: tokio::task::JoinHandle<support::Reply>,
}

/// Railguard A and B as processes on one PostgreSQL with `env`, A's path to the rail holding
/// each chunk 8 s. Token 5 on `account` goes through A; once its mark is at 5 and its forward
/// has reached A's path to the rail, the database goes back to a copy taken before that
/// compare-and-set (a rewind), with A's forward on its way.
async fn rewound_under_a_forward(account: &str, env: &[(&str, &str)]) -> Rewound {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;
    let mut pg = support::Pg::start().await;
    let rail = support::Rail::start().await;
    let slow_path = support::Relay::start(rail.addr).await;
    let a = support::Railguard::start_process(&pg.url(), &slow_path.url(), env).await;
    let b = support::Railguard::start_process(&pg.url(), &rail.url(), env).await;
    let copy = pg.copy_data().await.expect("copy of the data directory");
    slow_path.set_delay(Duration::from_millis(8000));
    // The path sees the forward's bytes as it reads them, before it holds them: until then A's
    // request may still be at its last look, which a rewind would refuse (503, nothing sent).
    let on_its_way = Arc::new(AtomicBool::new(false));
    slow_path.rewrite_towards_target({
        let (on_its_way, account) = (on_its_way.clone(), account.as_bytes().to_vec());
        move |chunk| {
            if chunk
                .windows(account.len())
                .any(|w| w == account.as_slice())
            {
                on_its_way.store(true, Ordering::SeqCst);
            }
            chunk.to_vec()
        }
    });
    let older = a.pay_in_background(5, account);
    support::eventually(
        Duration::from_secs(5),
        format!("{account}'s mark at 5 and A's forward on its way"),
        || async {
            (pg.mark(account).await == Some(5) && on_its_way.load(Ordering::SeqCst)).then_some(())
        },
    )
    .await;
    pg.rewind_to(&copy).await.expect("rewind");
    Rewound {
        pg,
        rail,
        _slow_path: slow_path,
        _a: a,
        b,
        older,
    }
}

/// B pays `token` on `account`, which must be paid (201); then A's older payment, which must
/// have been answered 201 or 502 (A closed its connection to the rail: it may have received
/// the request).
async fn newer_then_older(
    b: &support::Railguard,
    account: &str,
    token: i64,
    older: tokio::task::JoinHandle<support::Reply>,
) {
    use http::StatusCode;
    let newer = b.http().pay_with(b, token, account).await;
    newer.assert_status(StatusCode::CREATED);
    let older = older.await.unwrap();
    assert!(
        [StatusCode::CREATED, StatusCode::BAD_GATEWAY].contains(&older.status),
        "{}",
        older.body
    );
}
