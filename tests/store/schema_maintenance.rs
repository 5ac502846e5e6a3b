//! Online schema maintenance (`db::maintenance`): the retention index of idempotency records
//! built concurrently while records are written, picked up again after an interruption, and
//! what it is for: completions of idempotency records that are heap-only updates.
//!
//! Each test has a throwaway cluster of its own, migrated as railguard migrates it; until
//! maintenance runs, the table has migration 0003's retention index.

use std::time::Duration;

use railguard_testkit as support;

use railguard::db::maintenance::{Maintenance, run_once};
use railguard::db::migrate;
use railguard::store::records::COMPLETE_SQL;
use support::records::{Completions, idempotency_store, insert_in_flight};
use support::{Pg, until};
use tokio_postgres::Client;

const TIMEOUT: Duration = Duration::from_secs(10);

async fn migrated() -> (Pg, Client) {
    let pg = Pg::start().await;
    let mut client = pg.client().await;
    let applied = migrate::migrate(&mut client).await.unwrap();
    assert_eq!(applied as i32, migrate::latest_version());
    (pg, client)
}

/// Updates of idempotency_record by completing records `from..=to` in one transaction, and how
/// many of them were heap-only.
async fn complete(client: &mut Client, from: i64, to: i64) -> (i64, i64) {
    let ids: Vec<i64> = (from..=to).collect();
    let batch = Completions::of(&ids);
    // The backend's own counters, not yet reported: read before and after, in one transaction.
    let counters = "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables
                    WHERE relname = 'idempotency_record'";
    let tx = client.transaction().await.unwrap();
    let before = tx.query_one(counters, &[]).await.unwrap();
    let completed = tx.query(COMPLETE_SQL, &batch.params()).await.unwrap().len();
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

/// Both retention indexes' definitions, as (created_at's, completed_at's), each with whether
/// it is valid.
async fn retention_indexes(client: &Client) -> (Option<(String, bool)>, Option<(String, bool)>) {
    (
        index(client, "idempotency_record_created_at").await,
        index(client, "idempotency_record_completed_at").await,
    )
}

async fn index_oid(client: &Client) -> u32 {
    client
        .query_one("SELECT 'idempotency_record_created_at'::regclass::oid", &[])
        .await
        .unwrap()
        .get(0)
}

async fn maintain(pg: &Pg) -> Maintenance {
    run_once(&pg.url(), TIMEOUT).await.unwrap()
}

#[tokio::test]
async fn completing_a_record_is_a_heap_only_update() {
    let (pg, mut client) = migrated().await;
    assert_eq!(maintain(&pg).await, Maintenance::Done { changed: true });
    insert_in_flight(&client, 1, 40).await;
    let (updates, hot) = complete(&mut client, 1, 20).await;
    assert_eq!(updates, 20);
    assert_eq!(
        hot, 20,
        "every completion stays on its page without new index entries"
    );
    // Nothing left to do, and nothing done again.
    assert_eq!(maintain(&pg).await, Maintenance::Done { changed: false });

    // Negative control: with migration 0003's retention index back, no completion is.
    client
        .batch_execute(
            "CREATE INDEX idempotency_record_completed_at ON idempotency_record (completed_at)
             WHERE state = 'done'",
        )
        .await
        .unwrap();
    let (updates, hot) = complete(&mut client, 21, 40).await;
    assert_eq!((updates, hot), (20, 0));
}

/// Retention means the same with either index: a binary of either kind sweeps right in a
/// database of either state.
#[tokio::test]
async fn the_sweep_removes_records_completed_before_the_retention_only() {
    let (pg, client) = migrated().await;
    let pool = railguard::db::build_pool(&pg.url(), 2, TIMEOUT).unwrap();
    let store = idempotency_store(&pg.url(), pool, TIMEOUT);
    for maintained in [false, true] {
        if maintained {
            assert_eq!(maintain(&pg).await, Maintenance::Done { changed: true });
        }
        // Completed long ago, completed just now, created long ago but still in flight.
        client
            .batch_execute(
                "DELETE FROM idempotency_record;
                 INSERT INTO idempotency_record
                     (account_id, idempotency_key, fingerprint, token, owner, state, created_at,
                      completed_at)
                 VALUES ('a', 'old-done', 'fp', 1, 'o', 'done', now() - interval '2 hours',
                         now() - interval '2 hours'),
                        ('a', 'new-done', 'fp', 1, 'o', 'done', now() - interval '2 hours',
                         now()),
                        ('a', 'old-in-flight', 'fp', 1, 'o', 'in_flight',
                         now() - interval '2 hours', NULL)",
            )
            .await
            .unwrap();
        assert_eq!(store.sweep(Duration::from_secs(3600)).await.unwrap(), 1);
        let left: Vec<String> = support::sql::column(
            &client,
            "SELECT idempotency_key FROM idempotency_record ORDER BY 1",
            &[],
        )
        .await;
        assert_eq!(
            left,
            ["new-done", "old-in-flight"],
            "maintained: {maintained}"
        );
    }
}

#[tokio::test]
async fn an_index_build_left_invalid_is_built_again() {
    let (pg, client) = migrated().await;
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
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION),
        "{err}"
    );
    let (_, valid) = index(&client, "idempotency_record_created_at")
        .await
        .expect("the failed build left its index");
    assert!(!valid);

    assert_eq!(maintain(&pg).await, Maintenance::Done { changed: true });
    let (created, completed) = retention_indexes(&client).await;
    let (definition, valid) = created.unwrap();
    assert!(valid, "built again: {definition}");
    assert!(
        !definition.contains("UNIQUE"),
        "maintenance's index, not the leftover: {definition}"
    );
    assert_eq!(completed, None, "the old index is gone");
}

#[tokio::test]
async fn a_valid_index_left_by_an_interrupted_run_is_kept() {
    // Killed after its build finished in the server (the session goes on without its client)
    // but before the old index was dropped: the next run only drops the old one.
    let (pg, client) = migrated().await;
    client
        .batch_execute(
            "CREATE INDEX CONCURRENTLY idempotency_record_created_at \
             ON idempotency_record (created_at)",
        )
        .await
        .unwrap();
    let before = index_oid(&client).await;
    assert_eq!(maintain(&pg).await, Maintenance::Done { changed: true });
    assert_eq!(index_oid(&client).await, before, "not built again");
    assert_eq!(retention_indexes(&client).await.1, None);
}

/// The index is built while records are written; a second railguard starting meanwhile skips
/// maintenance, and an older binary's migrator (which waits for its lock inside a transaction,
/// holding a snapshot the build must wait out) neither waits for the build nor deadlocks with it.
#[tokio::test]
async fn records_are_written_while_the_index_is_built() {
    let (pg, client) = migrated().await;
    insert_in_flight(&client, 1, 1_000).await;

    // A payment's transaction, open when maintenance starts: the concurrent build waits for
    // it to end.
    let mut open = pg.client().await;
    let open_tx = open.transaction().await.unwrap();
    insert_in_flight_tx(&open_tx, 2_000).await;

    let first = {
        let url = pg.url();
        tokio::spawn(async move { run_once(&url, TIMEOUT).await })
    };
    let waits = "the build waiting for the open transaction";
    until(Duration::from_secs(5), waits, || async {
        client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                     WHERE query LIKE 'CREATE INDEX CONCURRENTLY%' AND wait_event_type = 'Lock')",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    })
    .await;

    // A second railguard: skips.
    assert_eq!(maintain(&pg).await, Maintenance::Busy);
    // A railguard starting, of this binary or an older one: its migrator is not held up.
    let mut migrator = pg.client().await;
    let migrated = tokio::time::timeout(Duration::from_secs(5), migrate::migrate(&mut migrator))
        .await
        .expect("a migrator is not held up by the build");
    assert_eq!(migrated.unwrap(), 0);
    // Records are written: a build inside a transaction would queue every insert behind it.
    let writer = pg.client().await;
    writer
        .batch_execute("SET statement_timeout = '5s'")
        .await
        .unwrap();
    insert_in_flight(&writer, 3_000, 3_099).await;
    assert!(!first.is_finished());

    open_tx.commit().await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .expect("the build finishes once the transaction ended")
        .unwrap();
    assert_eq!(first.unwrap(), Maintenance::Done { changed: true });
    let (created, completed) = retention_indexes(&client).await;
    let (definition, valid) = created.unwrap();
    assert!(valid, "{definition}");
    assert_eq!(completed, None);
    let records: i64 = client
        .query_one("SELECT count(*) FROM idempotency_record", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(records, 1_000 + 1 + 100);
}

/// `railguard serve` makes the change in the background once it has migrated.
#[tokio::test]
async fn serve_brings_the_retention_index_up_to_date() {
    let (pg, client) = migrated().await;
    assert!(retention_indexes(&client).await.1.is_some());
    let rail = support::Rail::start().await;
    let _rg = support::Railguard::start(&pg.url(), &rail.url(), &[]).await;
    let (created, completed) =
        support::eventually(Duration::from_secs(10), "the old index dropped", || async {
            let indexes = retention_indexes(&client).await;
            indexes.1.is_none().then_some(indexes)
        })
        .await;
    assert!(created.expect("built").1, "valid");
    assert_eq!(completed, None, "the old index dropped");
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
