//! Migrations that run outside a transaction (migration 0007's index, built concurrently), and
//! what that index is for: completions of idempotency records that are heap-only updates.
//!
//! Each test has a throwaway cluster of its own. A database "at version 6" is made by
//! migrating fully and then putting back what 0007 changed: its record, its index, and the
//! index it removes.

use std::time::Duration;

use railguard_testkit as support;

use railguard::db::migrate;
use railguard::proxy::fence::Batching;
use railguard::proxy::idempotency::{COMPLETE_SQL, IdempotencyStore, OutcomeMetrics};
use support::Pg;
use tokio_postgres::Client;
use tokio_postgres::types::ToSql;

/// The retention index of migrations 0003 to 0006, which made every completion a non-HOT update.
const OLD_RETENTION_INDEX: &str = "CREATE INDEX idempotency_record_completed_at \
     ON idempotency_record (completed_at) WHERE state = 'done'";

async fn migrated() -> (Pg, Client) {
    let pg = Pg::start().await;
    let mut client = pg.client().await;
    let applied = migrate::migrate(&mut client).await.unwrap();
    assert_eq!(applied as i32, migrate::latest_version());
    (pg, client)
}

/// Back to how migration 6 left the schema.
async fn back_to_version_6(client: &Client) {
    client
        .batch_execute(&format!(
            "DELETE FROM railguard_schema_migrations WHERE version = 7;
             DROP INDEX idempotency_record_created_at;
             {OLD_RETENTION_INDEX};"
        ))
        .await
        .unwrap();
}

async fn insert_in_flight(client: &Client, from: i64, to: i64) {
    client
        .execute(
            "INSERT INTO idempotency_record
                 (account_id, idempotency_key, fingerprint, token, owner, state)
             SELECT 'acct-' || g, 'key-' || g, 'fp', g, 'owner-' || g, 'in_flight'
             FROM generate_series($1::bigint, $2::bigint) g",
            &[&from, &to],
        )
        .await
        .unwrap();
}

/// Updates of idempotency_record by completing records `from..=to` in one transaction, and how
/// many of them were heap-only.
async fn complete(client: &mut Client, from: i64, to: i64) -> (i64, i64) {
    let ids: Vec<i64> = (from..=to).collect();
    let accounts: Vec<String> = ids.iter().map(|i| format!("acct-{i}")).collect();
    let keys: Vec<String> = ids.iter().map(|i| format!("key-{i}")).collect();
    let owners: Vec<String> = ids.iter().map(|i| format!("owner-{i}")).collect();
    let statuses: Vec<i16> = ids.iter().map(|_| 201).collect();
    let headers: Vec<String> = ids
        .iter()
        .map(|_| r#"{"content-type":"application/json"}"#.to_string())
        .collect();
    let bodies: Vec<Vec<u8>> = ids
        .iter()
        .map(|i| format!(r#"{{"payment":{i},"status":"accepted"}}"#).into_bytes())
        .collect();
    let stored: Vec<bool> = ids.iter().map(|_| true).collect();
    let params: [&(dyn ToSql + Sync); 7] = [
        &accounts, &keys, &owners, &statuses, &headers, &bodies, &stored,
    ];
    // The backend's own counters, not yet reported: read before and after, in one transaction.
    let counters = "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables
                    WHERE relname = 'idempotency_record'";
    let tx = client.transaction().await.unwrap();
    let before = tx.query_one(counters, &[]).await.unwrap();
    let completed = tx.query(COMPLETE_SQL, &params).await.unwrap().len();
    assert_eq!(completed, ids.len());
    let after = tx.query_one(counters, &[]).await.unwrap();
    tx.commit().await.unwrap();
    (
        after.get::<_, i64>(0) - before.get::<_, i64>(0),
        after.get::<_, i64>(1) - before.get::<_, i64>(1),
    )
}

/// The index's definition and whether it is valid, if it exists.
async fn index(client: &Client, name: &str) -> Option<(String, bool)> {
    client
        .query_opt(
            "SELECT pg_get_indexdef(i.indexrelid), i.indisvalid
             FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = $1",
            &[&name],
        )
        .await
        .unwrap()
        .map(|row| (row.get(0), row.get(1)))
}

async fn version_7_recorded(client: &Client) -> bool {
    client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM railguard_schema_migrations WHERE version = 7)",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn completing_a_record_is_a_heap_only_update() {
    let (_pg, mut client) = migrated().await;
    insert_in_flight(&client, 1, 40).await;
    let (updates, hot) = complete(&mut client, 1, 20).await;
    assert_eq!(updates, 20);
    assert_eq!(
        hot, 20,
        "every completion stays on its page without new index entries"
    );

    // Negative control: with the retention index of migrations 3 to 6, none is.
    client.batch_execute(OLD_RETENTION_INDEX).await.unwrap();
    let (updates, hot) = complete(&mut client, 21, 40).await;
    assert_eq!((updates, hot), (20, 0));
}

#[tokio::test]
async fn the_sweep_removes_records_completed_before_the_retention_only() {
    let (pg, client) = migrated().await;
    // Completed long ago, completed just now, created long ago but still in flight.
    client
        .batch_execute(
            "INSERT INTO idempotency_record
                 (account_id, idempotency_key, fingerprint, token, owner, state, created_at,
                  completed_at)
             VALUES ('a', 'old-done', 'fp', 1, 'o', 'done', now() - interval '2 hours',
                     now() - interval '2 hours'),
                    ('a', 'new-done', 'fp', 1, 'o', 'done', now() - interval '2 hours', now()),
                    ('a', 'old-in-flight', 'fp', 1, 'o', 'in_flight',
                     now() - interval '2 hours', NULL)",
        )
        .await
        .unwrap();
    let pool = railguard::db::build_pool(&pg.url(), 2, Duration::from_secs(10)).unwrap();
    let store = IdempotencyStore::new(
        pool,
        Duration::from_secs(10),
        Batching::default(),
        OutcomeMetrics {
            pending: prometheus::IntGauge::new("pending", "pending").unwrap(),
            lost: prometheus::IntCounter::new("lost", "lost").unwrap(),
            batch_sizes: prometheus::Histogram::with_opts(prometheus::HistogramOpts::new(
                "batch", "batch",
            ))
            .unwrap(),
        },
    );
    assert_eq!(store.sweep(Duration::from_secs(3600)).await.unwrap(), 1);
    let left: Vec<String> = client
        .query(
            "SELECT idempotency_key FROM idempotency_record ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(left, ["new-done", "old-in-flight"]);
}

#[tokio::test]
async fn an_index_build_left_invalid_is_built_again() {
    let (pg, client) = migrated().await;
    back_to_version_6(&client).await;
    // An interrupted build: a concurrent build that failed leaves its index behind, invalid.
    // (Two records created by one statement share created_at, so a unique build fails.)
    insert_in_flight(&client, 1, 2).await;
    let err = client
        .batch_execute(
            "CREATE UNIQUE INDEX CONCURRENTLY idempotency_record_created_at \
             ON idempotency_record (created_at)",
        )
        .await
        .expect_err("the unique build fails");
    assert!(err.to_string().contains("duplicate") || format!("{err:?}").contains("23505"));
    let (_, valid) = index(&client, "idempotency_record_created_at")
        .await
        .expect("the failed build left its index");
    assert!(!valid);

    // Migrated over a session as railguard opens it, with its statement deadline.
    let (mut session, _driver) = railguard::db::connect(&pg.url(), Duration::from_secs(7))
        .await
        .unwrap();
    assert_eq!(migrate::migrate(&mut session).await.unwrap(), 1);
    let (definition, valid) = index(&client, "idempotency_record_created_at")
        .await
        .unwrap();
    assert!(valid, "built again: {definition}");
    assert!(
        !definition.contains("UNIQUE"),
        "the migration's index, not the leftover: {definition}"
    );
    assert_eq!(
        index(&client, "idempotency_record_completed_at").await,
        None
    );
    assert!(version_7_recorded(&client).await);
    // The session is back to its own deadlines, and holds no lock.
    let row = session
        .query_one(
            "SELECT current_setting('statement_timeout'), current_setting('lock_timeout'),
                    (SELECT count(*) FROM pg_locks
                     WHERE locktype = 'advisory' AND pid = pg_backend_pid())",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "7s");
    assert_eq!(row.get::<_, String>(1), "7s");
    assert_eq!(row.get::<_, i64>(2), 0, "the migration lock is given back");
}

/// The index is built while another transaction writes records, and a second migrator
/// starting meanwhile neither deadlocks with the build nor applies anything twice.
#[tokio::test]
async fn records_are_written_while_the_index_is_built() {
    let (pg, client) = migrated().await;
    back_to_version_6(&client).await;
    insert_in_flight(&client, 1, 1_000).await;

    // A payment's transaction, open when the migration starts: the concurrent build waits
    // for it to end.
    let mut open = pg.client().await;
    let open_tx = open.transaction().await.unwrap();
    insert_in_flight_tx(&open_tx, 2_000).await;

    let first = {
        let url = pg.url();
        tokio::spawn(async move { railguard::db::migrate_url(&url, Duration::from_secs(10)).await })
    };
    // Wait until the build is waiting for the open transaction.
    let mut waiting = false;
    for _ in 0..200 {
        waiting = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                     WHERE query LIKE 'CREATE INDEX CONCURRENTLY%' AND wait_event_type = 'Lock')",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if waiting {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(waiting, "the build waits for the open transaction");

    // Meanwhile a second migrator starts (a second railguard), and records are still written:
    // a build inside a transaction would hold a lock that queues every insert behind it.
    let second = {
        let url = pg.url();
        tokio::spawn(async move { railguard::db::migrate_url(&url, Duration::from_secs(10)).await })
    };
    let writer = pg.client().await;
    writer
        .batch_execute("SET statement_timeout = '5s'")
        .await
        .unwrap();
    insert_in_flight(&writer, 3_000, 3_099).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!first.is_finished() && !second.is_finished());

    open_tx.commit().await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .expect("the first migrator finishes once the transaction ended")
        .unwrap();
    let second = tokio::time::timeout(Duration::from_secs(30), second)
        .await
        .expect("the second migrator finishes too")
        .unwrap();
    assert_eq!(first.unwrap(), 1, "the first applied migration 7");
    assert_eq!(second.unwrap(), 0, "the second found it applied");
    let (definition, valid) = index(&client, "idempotency_record_created_at")
        .await
        .unwrap();
    assert!(valid, "{definition}");
    let records: i64 = client
        .query_one("SELECT count(*) FROM idempotency_record", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(records, 1_000 + 1 + 100);
}

async fn insert_in_flight_tx(tx: &tokio_postgres::Transaction<'_>, id: i64) {
    tx.execute(
        "INSERT INTO idempotency_record
             (account_id, idempotency_key, fingerprint, token, owner, state)
         VALUES ('acct-' || $1::bigint, 'key-' || $1::bigint, 'fp', $1::bigint, 'o', 'in_flight')",
        &[&id],
    )
    .await
    .unwrap();
}
