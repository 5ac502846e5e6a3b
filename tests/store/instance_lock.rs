//! The instance lock: the session whose advisory lock shows this railguard process running
//! (`store::instance`). A server that goes silent under it leaves the session open; the
//! connection's periodic check notices, and the lock is asked for again on a new connection.

use railguard_testkit as support;

use std::time::Duration;

use support::{Pg, Relay, eventually};

/// Here the path to the server holds the connection's check, so the new connection is on the same
/// server and waits for the old session's lock until that backend is ended.
#[tokio::test]
async fn the_instance_lock_leaves_a_session_whose_server_went_silent() {
    let pg = Pg::start().await;
    let path = Relay::start(format!("127.0.0.1:{}", pg.server.port()).parse().unwrap()).await;
    let instance = railguard::store::instance::InstanceId::generate();
    let (held, first_held) = tokio::sync::oneshot::channel();
    let holder = tokio::spawn(railguard::store::instance::hold_instance_lock(
        path.postgres_url(&pg.url()),
        Duration::from_millis(1000),
        instance,
        held,
    ));
    first_held.await.unwrap();
    let observer = pg.client().await;
    let rows = holders(&observer, instance).await;
    assert_eq!(rows.len(), 1, "one connection holds the lock");
    let (first, _) = rows[0];
    path.stall_first_containing(b"pg_is_in_recovery");
    eventually(
        Duration::from_secs(30),
        "a new connection asking for the instance's lock",
        || async {
            let rows = holders(&observer, instance).await;
            rows.iter().any(|&(pid, _)| pid != first).then_some(())
        },
    )
    .await;
    observer
        .execute("SELECT pg_terminate_backend($1)", &[&first])
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the new connection holding the lock",
        || async {
            let rows = holders(&observer, instance).await;
            rows.iter()
                .any(|&(pid, granted)| pid != first && granted)
                .then_some(())
        },
    )
    .await;
    holder.abort();
    path.release_stalled();
}

/// The instance lock is held on a server that takes writes, where forget looks for it: a
/// server that answers but is read only (a standby: PostgreSQL grants advisory locks there
/// too) is passed over, even when the URL names it first and says nothing of writes.
#[tokio::test]
async fn the_instance_lock_is_held_where_writes_go() {
    let read_only = Pg::start().await;
    let admin = read_only.client().await;
    for statement in [
        "ALTER SYSTEM SET default_transaction_read_only = on",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(statement).await.unwrap();
    }
    let primary = Pg::start().await;
    let url = read_only.url().replacen(
        &format!(":{}/", read_only.server.port()),
        &format!(
            ":{},127.0.0.1:{}/",
            read_only.server.port(),
            primary.server.port()
        ),
        1,
    );
    let instance = railguard::store::instance::InstanceId::generate();
    let (held, first_held) = tokio::sync::oneshot::channel();
    let holder = tokio::spawn(railguard::store::instance::hold_instance_lock(
        url,
        Duration::from_millis(2000),
        instance,
        held,
    ));
    first_held.await.unwrap();
    assert_eq!(holds(&primary, instance).await, 1, "held where writes go");
    assert_eq!(
        holds(&read_only, instance).await,
        0,
        "not on the read-only server"
    );
    holder.abort();
}

/// The backends holding or asking for `instance`'s advisory lock, and whether it is granted.
async fn holders(
    client: &tokio_postgres::Client,
    instance: railguard::store::instance::InstanceId,
) -> Vec<(i32, bool)> {
    // An advisory lock of one bigint key: classid is its high half, objid its low half.
    client
        .query(
            "SELECT pid, granted FROM pg_locks
             WHERE locktype = 'advisory' AND objsubid = 1
               AND ((classid::bigint << 32) | objid::bigint) = $1",
            &[&instance.get()],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// How many backends of `pg` hold `instance`'s advisory lock.
async fn holds(pg: &Pg, instance: railguard::store::instance::InstanceId) -> usize {
    let rows = holders(&pg.client().await, instance).await;
    rows.iter().filter(|&&(_, granted)| granted).count()
}
