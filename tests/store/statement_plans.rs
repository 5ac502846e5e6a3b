//! The plans PostgreSQL keeps for railguard's batched statements.
//!
//! A statement prepared once per pooled connection is planned generically from its sixth
//! execution on, for the table as it was then. A plan made while a table is small must still
//! be right when the table is large, or a new deployment's first minutes of load scan whole
//! tables until autovacuum analyzes them. Autovacuum is off here, so nothing replans behind
//! the test's back; `pg_stat_statements` counts how often each statement was planned.

use railguard_testkit as support;

use std::time::Duration;

use railguard::store::marks::LAST_LOOK_SQL;
use railguard::store::records::COMPLETE_SQL;
use support::Pg;
use support::records::{Completions, idempotency_store, insert_in_flight, record_states};
use tokio_postgres::{Client, GenericClient, Transaction};

/// The batched completion as a join by key, as it was prepared before migration 0006: the
/// negative control, showing that this PostgreSQL does cache a sequential scan for it.
const UNPINNED_COMPLETE_SQL: &str = "\
UPDATE idempotency_record r
SET state = 'done', status = u.status, headers = u.headers::jsonb, body = u.body,
    body_stored = u.body_stored, completed_at = now()
FROM (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int2[], $5::text[],
                         $6::bytea[], $7::bool[])
        AS u(account_id, key, owner, status, headers, body, body_stored)
    ORDER BY account_id, key
) AS u
WHERE r.account_id = u.account_id AND r.idempotency_key = u.key AND r.owner = u.owner
  AND r.state = 'in_flight'
RETURNING r.account_id, r.idempotency_key";

/// Completes records `ids` with `statement`; how many it completed.
async fn complete(
    client: &impl GenericClient,
    statement: &tokio_postgres::Statement,
    ids: &[i64],
) -> usize {
    let batch = Completions::of(ids);
    client
        .query(statement, &batch.params())
        .await
        .unwrap()
        .len()
}

/// Sequential and index scans of `table` so far in this transaction (the backend's own
/// counters, not yet reported to the statistics system).
async fn scans(tx: &Transaction<'_>, table: &str) -> (i64, i64) {
    let row = tx
        .query_one(
            "SELECT coalesce(seq_scan, 0), coalesce(idx_scan, 0)
             FROM pg_stat_xact_user_tables WHERE relname = $1",
            &[&table],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// A throwaway cluster that counts plans per statement, with railguard's schema, and a
/// connection to it. Autovacuum is off, so nothing replans behind the test's back.
async fn cluster() -> (Pg, Client) {
    let pg = Pg::builder()
        .setting("autovacuum", "off")
        .setting("shared_preload_libraries", "pg_stat_statements")
        .setting("pg_stat_statements.track", "all")
        .setting("pg_stat_statements.track_planning", "on")
        .start()
        .await
        .unwrap_or_else(|e| panic!("throwaway PostgreSQL: {e}"));
    let mut client = pg.client().await;
    railguard::db::migrate::migrate(&mut client).await.unwrap();
    client
        .batch_execute("CREATE EXTENSION pg_stat_statements")
        .await
        .unwrap();
    (pg, client)
}

/// Sequential and index scans of idempotency_record that `ids`' completion took, counted
/// within one transaction.
async fn scans_of_one_completion(
    client: &mut Client,
    statement: &tokio_postgres::Statement,
    ids: &[i64],
) -> (i64, i64, usize, String) {
    let tx = client.transaction().await.unwrap();
    let before = scans(&tx, "idempotency_record").await;
    let completed = complete(&tx, statement, ids).await;
    let after = scans(&tx, "idempotency_record").await;
    let commit: String = tx
        .query_one("SELECT current_setting('synchronous_commit')", &[])
        .await
        .unwrap()
        .get(0);
    tx.commit().await.unwrap();
    (after.0 - before.0, after.1 - before.1, completed, commit)
}

#[tokio::test]
async fn the_completion_keeps_the_primary_key_plan_made_on_a_new_table() {
    completions_on_a_growing_table(false).await;
}

#[tokio::test]
async fn the_completion_keeps_the_primary_key_plan_made_after_analyzing_an_empty_table() {
    // `vacuumdb --analyze-in-stages` after a restore, an ANALYZE in a deploy script, or
    // autovacuum after retention emptied the table: statistics that say "empty".
    completions_on_a_growing_table(true).await;
}

/// [`cluster`], with `table` analyzed while it is still empty if `analyze` says so.
async fn cluster_analyzing(table: &str, analyze: bool) -> (Pg, Client) {
    let (pg, client) = cluster().await;
    if analyze {
        client
            .batch_execute(&format!("ANALYZE {table}"))
            .await
            .unwrap();
    }
    (pg, client)
}

/// A session of the completions' own (`db::build_completion_pool`), as railguard runs them.
async fn completion_session(pg: &Pg) -> deadpool_postgres::Object {
    let sessions =
        railguard::db::build_completion_pool(&pg.url(), 1, std::time::Duration::from_secs(10))
            .unwrap();
    sessions.get().await.unwrap()
}

/// The statements are prepared and run (more than five times, on one connection, as a pooled
/// connection runs them in the first seconds of load) while the table is small; then the table
/// grows and nothing replans.
async fn completions_on_a_growing_table(analyze_when_empty: bool) {
    let (pg, mut client) = cluster_analyzing("idempotency_record", analyze_when_empty).await;
    insert_in_flight(&client, 1, 200).await;
    let mut session = completion_session(&pg).await;
    let pinned = session.prepare_cached(COMPLETE_SQL).await.unwrap();
    let unpinned = client.prepare(UNPINNED_COMPLETE_SQL).await.unwrap();
    for i in 0..8 {
        assert_eq!(
            complete(&**session, &pinned, &[2 * i + 1, 2 * i + 2]).await,
            2
        );
        assert_eq!(
            complete(&client, &unpinned, &[100 + 2 * i + 1, 100 + 2 * i + 2]).await,
            2
        );
    }
    // Then the table grows, and nothing replans.
    insert_in_flight(&client, 1_000, 60_000).await;

    let (seq, idx, completed, _) =
        scans_of_one_completion(&mut client, &unpinned, &[50_001, 50_002]).await;
    assert_eq!(completed, 2);
    assert!(
        seq >= 1,
        "negative control: the join by key's cached plan scans the whole table on this \
         PostgreSQL (seq {seq}, idx {idx}); if this no longer holds, the completion's one plan \
         is harmless but no longer needed"
    );

    let (seq, idx, completed, commit) =
        scans_of_one_completion(&mut session, &pinned, &[50_011, 50_012, 50_013]).await;
    assert_eq!(completed, 3, "every record of the batch is completed");
    assert_eq!(
        commit, "off",
        "the completion's own commit does not wait for the flush"
    );
    assert_eq!(seq, 0, "the completion never scans the table");
    assert_eq!(
        idx, 3,
        "it finds each of its records by the primary key, one index lookup each"
    );

    // Planned once and kept: a custom plan per batch (what PostgreSQL picks for a batch of
    // fewer than ten rows when it may) costs more than the rest of the statement.
    assert_eq!(
        generic_and_custom(&**session, COMPLETE_SQL).await,
        (9, 0),
        "every completion ran the session's one generic plan"
    );

    // The settings are the completion sessions' alone: the pool's sessions, where records are
    // created with the fence's compare-and-set, commit durably and plan as PostgreSQL likes.
    let plain = railguard::db::build_pool(&pg.url(), 1, std::time::Duration::from_secs(10))
        .unwrap()
        .get()
        .await
        .unwrap();
    let row = plain
        .query_one(
            "SELECT current_setting('enable_seqscan'), current_setting('plan_cache_mode'),
                    current_setting('synchronous_commit')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "on");
    assert_eq!(row.get::<_, String>(1), "auto");
    assert_eq!(row.get::<_, String>(2), "on");
    let done: i64 = client
        .query_one(
            "SELECT count(*) FROM idempotency_record
             WHERE state = 'done' AND completed_at IS NOT NULL AND status = 201",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(done, 16 + 16 + 2 + 3);
}

#[tokio::test]
async fn a_role_that_may_not_complete_records_is_refused_at_start() {
    let (pg, client) = cluster().await;
    // Migrated by the owner; run by a role that may use the tables but not update records,
    // and, by the site's default privileges, not call the functions either (migration 0006's
    // completion function, which older binaries call, is not needed any more).
    client
        .batch_execute(
            "REVOKE EXECUTE ON FUNCTION railguard_complete_records FROM PUBLIC;
             CREATE ROLE rg_runtime LOGIN;
             GRANT ALL ON ALL TABLES IN SCHEMA public TO rg_runtime;
             GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO rg_runtime;
             GRANT CREATE ON SCHEMA public TO rg_runtime;
             REVOKE UPDATE ON idempotency_record FROM rg_runtime;",
        )
        .await
        .unwrap();
    let owner_url = pg.url();
    let (_, after_user) = owner_url
        .split_once("://")
        .and_then(|(_, rest)| rest.split_once('@'))
        .expect("a URL with a user");
    let runtime_url = format!("postgres://rg_runtime@{after_user}");
    let err = railguard::db::migrate_url(&runtime_url, std::time::Duration::from_secs(10))
        .await
        .expect_err("the start is refused");
    let text = err.to_string();
    assert!(
        text.contains("may not complete idempotency records")
            && text.contains("permission denied for table idempotency_record"),
        "the error names the cause: {text}"
    );
    // Granted, it starts, without EXECUTE on the old function.
    client
        .batch_execute("GRANT UPDATE ON idempotency_record TO rg_runtime")
        .await
        .unwrap();
    railguard::db::migrate_url(&runtime_url, std::time::Duration::from_secs(10))
        .await
        .expect("starts once granted");
    // And its completions work.
    let sessions =
        railguard::db::build_completion_pool(&runtime_url, 1, std::time::Duration::from_secs(10))
            .unwrap();
    let session = sessions.get().await.unwrap();
    insert_in_flight(&client, 1, 2).await;
    let statement = session.prepare_cached(COMPLETE_SQL).await.unwrap();
    assert_eq!(complete(&**session, &statement, &[1, 2]).await, 2);
}

#[tokio::test]
async fn a_batch_completes_its_records_in_key_order() {
    // The order rows are locked in, seen by a trigger that logs each update as it happens: the
    // fence's batch meets records in key order, and the completion must too.
    let (pg, client) = cluster().await;
    client
        .batch_execute(
            "CREATE TABLE update_order (n bigserial, idempotency_key text);
             CREATE FUNCTION log_update() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO update_order (idempotency_key) VALUES (NEW.idempotency_key);
                 RETURN NEW;
             END $$;
             CREATE TRIGGER log_update BEFORE UPDATE ON idempotency_record
                 FOR EACH ROW EXECUTE FUNCTION log_update();",
        )
        .await
        .unwrap();
    // Stored in another order than the keys' (a plan that went by the records' positions
    // would update 5, 7, 9, 1, 3).
    insert_in_flight(&client, 5, 9).await;
    insert_in_flight(&client, 1, 4).await;
    let session = completion_session(&pg).await;
    let pinned = session.prepare_cached(COMPLETE_SQL).await.unwrap();
    // Handed over in arrival order, not key order.
    assert_eq!(complete(&**session, &pinned, &[7, 3, 9, 1, 5]).await, 5);
    let order: Vec<String> = client
        .query("SELECT idempotency_key FROM update_order ORDER BY n", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(order, ["key-1", "key-3", "key-5", "key-7", "key-9"]);
}

/// Records 2, 4 and 5 changed by another transaction while a completion waits for them:
/// declared in doubt, removed, and changed but still in flight for its owner. Holds their rows
/// until the returned transaction commits.
async fn change_records_2_4_5(client: &mut Client) -> Transaction<'_> {
    let tx = client.transaction().await.unwrap();
    tx.batch_execute(
        "UPDATE idempotency_record SET state = 'in_doubt' WHERE idempotency_key = 'key-2';
         DELETE FROM idempotency_record WHERE idempotency_key = 'key-4';
         UPDATE idempotency_record SET in_doubt_at = now() + interval '1 hour'
             WHERE idempotency_key = 'key-5';",
    )
    .await
    .unwrap();
    tx
}

fn pairs(expected: &[(&str, &str)]) -> Vec<(String, String)> {
    expected
        .iter()
        .map(|(k, s)| (k.to_string(), s.to_string()))
        .collect()
}

/// Asserts the records left: key-1, key-3 and key-6 done, key-2 in doubt, key-5 `five`.
async fn assert_five_records(client: &Client, five: &str) {
    assert_eq!(
        record_states(client).await,
        pairs(&[
            ("key-1", "done"),
            ("key-2", "in_doubt"),
            ("key-3", "done"),
            ("key-5", five),
            ("key-6", "done"),
        ])
    );
}

/// The statement alone: a record another transaction declared in doubt or removed while the
/// statement waited for it is not completed. One changed otherwise, still in flight for its
/// owner, is passed over too (the statement goes by the record's position as its snapshot saw
/// it); the batcher completes that one by its key (the next test).
#[tokio::test]
async fn the_completion_statement_passes_over_records_changed_while_it_waits() {
    let (pg, mut client) = cluster().await;
    insert_in_flight(&client, 1, 6).await;
    let session = completion_session(&pg).await;
    let statement = session.prepare_cached(COMPLETE_SQL).await.unwrap();
    let tx = change_records_2_4_5(&mut client).await;
    let completing = tokio::spawn(async move {
        let batch = Completions::of(&[1, 2, 3, 4, 5, 6]);
        let rows = session.query(&statement, &batch.params()).await.unwrap();
        let mut keys: Vec<String> = rows.iter().map(|row| row.get(1)).collect();
        keys.sort();
        keys
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !completing.is_finished(),
        "the completion waits for the rows"
    );
    tx.commit().await.unwrap();
    let completed = completing.await.unwrap();
    // PostgreSQL 15.20 passes over a row whose position changed; earlier minor versions may
    // re-check the newer row instead, and complete it (its owner's, still in flight).
    let five = if completed.contains(&"key-5".to_string()) {
        assert_eq!(completed, ["key-1", "key-3", "key-5", "key-6"]);
        "done"
    } else {
        assert_eq!(completed, ["key-1", "key-3", "key-6"]);
        "in_flight"
    };
    assert_five_records(&client, five).await;
}

/// A record passed over by the statement whose settling fails (the main pool has no session
/// for it in time): not known to be stored, it is not reported stored, and it is retried until
/// it is.
#[tokio::test]
async fn a_passed_over_completion_that_cannot_be_settled_is_retried() {
    use railguard::store::records::{RecordId, Records, StoredResponse};
    use railguard::token::AccountId;
    use std::time::Duration;

    let (pg, mut client) = cluster().await;
    insert_in_flight(&client, 1, 3).await;
    // The main pool waits 1 s for a session; the caller up to 5 s for its batch.
    let pool = railguard::db::build_pool(&pg.url(), 1, Duration::from_secs(1)).unwrap();
    let store = idempotency_store(&pg.url(), pool.clone(), Duration::from_secs(5));
    let tx = client.transaction().await.unwrap();
    tx.batch_execute(
        "UPDATE idempotency_record SET in_doubt_at = now() + interval '1 hour'
         WHERE idempotency_key = 'key-2'",
    )
    .await
    .unwrap();
    let record = RecordId {
        account: AccountId::parse("acct-2", 64).unwrap(),
        key: "key-2".into(),
        owner: "owner-2".into(),
    };
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: Some(bytes::Bytes::from_static(b"{}")),
    };
    let completing = tokio::spawn(Records::complete(&store, record, response));
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The main pool's only session is busy when the statement passes the record over.
    let held = pool.get().await.unwrap();
    tx.commit().await.unwrap();
    completing.await.unwrap();
    drop(held);
    support::until(
        Duration::from_secs(10),
        "key-2's completion stored",
        || async {
            support::records::state_of(&client, "key-2")
                .await
                .as_deref()
                == Some("done")
        },
    )
    .await;
}

/// The completion's generic plan, as its sessions make it, for a batch of `rows` records.
async fn completion_plan(session: &Client, statement: &str, rows: usize) -> String {
    let name = format!("plan_{}", rows);
    session
        .batch_execute(&format!(
            "PREPARE {name}(text[], text[], text[], int2[], text[], bytea[], bool[]) AS {statement}"
        ))
        .await
        .unwrap();
    let list = |f: &dyn Fn(usize) -> String| {
        let items: Vec<String> = (1..=rows).map(f).collect();
        format!("'{{{}}}'", items.join(","))
    };
    let explain = format!(
        "EXPLAIN EXECUTE {name}({}, {}, {}, {}, {}, {}, {})",
        list(&|i| format!("acct-{i}")),
        list(&|i| format!("key-{i}")),
        list(&|i| format!("owner-{i}")),
        list(&|_| "201".into()),
        list(&|_| "\"{}\"".into()),
        list(&|_| "NULL".into()),
        list(&|_| "f".into()),
    );
    let lines: Vec<String> = session
        .query(&explain, &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    lines.join("\n")
}

/// Indexes an operator might add to watch records in flight, with statistics that say few
/// are: the completion still reaches the table only by the primary key and the position it
/// found, one batch row at a time, in key order. (With `=` on the state, such an index drove a
/// hash join over every in-flight record, in the index's order.)
#[tokio::test]
async fn indexes_on_the_state_do_not_change_the_completions_plan() {
    let (pg, client) = cluster().await;
    client
        .batch_execute(
            "CREATE INDEX watch_state ON idempotency_record (state);
             CREATE INDEX watch_in_flight ON idempotency_record (created_at)
                 WHERE state = 'in_flight';
             INSERT INTO idempotency_record
                 (account_id, idempotency_key, fingerprint, token, owner, state)
             SELECT 'acct-' || g, 'done-' || g, 'fp', g, 'owner-' || g, 'done'
             FROM generate_series(1, 50000) g;",
        )
        .await
        .unwrap();
    insert_in_flight(&client, 1, 20).await;
    client
        .batch_execute("ANALYZE idempotency_record")
        .await
        .unwrap();
    let one_plan = |plan: &str| {
        plan.contains("Nested Loop")
            && plan.contains("Tid Scan on idempotency_record r")
            && plan.contains("Index Scan using idempotency_record_pkey on idempotency_record t")
            && !plan.contains("watch_")
            && !plan.contains("Seq Scan on idempotency_record")
            && !plan.contains("Hash")
            && !plan.contains("Merge")
    };
    let session = completion_session(&pg).await;
    let plan = completion_plan(&session, COMPLETE_SQL, 20).await;
    assert!(one_plan(&plan), "{plan}");
    // What holds the plan is the statement's comparisons, not the sessions' join settings (`=`
    // on the state drives a nested loop from an index on it even with all of them, on a table
    // of 1M rows): on a session with only a generic plan and no sequential scans, the
    // statement keeps its plan…
    let weaker = pg.client().await;
    weaker
        .batch_execute("SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off")
        .await
        .unwrap();
    let plan = completion_plan(&weaker, COMPLETE_SQL, 20).await;
    assert!(one_plan(&plan), "{plan}");
    // …where the same statement comparing the state with `=` reads the table through the
    // operator's index: the negative control.
    let with_equals = COMPLETE_SQL.replace(
        "r.state IS NOT DISTINCT FROM 'in_flight'",
        "r.state = 'in_flight'",
    );
    assert_ne!(with_equals, COMPLETE_SQL);
    let plan = completion_plan(&weaker, &with_equals, 19).await;
    assert!(
        plan.contains("watch_"),
        "negative control: with `=`, an index on the state drives the plan: {plan}"
    );
    // And it completes the batch.
    let statement = session.prepare_cached(COMPLETE_SQL).await.unwrap();
    let ids: Vec<i64> = (1..=20).collect();
    assert_eq!(complete(&**session, &statement, &ids).await, 20);
}

/// Through the store, as a request's completion goes: the record changed but still in flight
/// for its owner is completed too, and the caller hears so only once it is.
#[tokio::test]
async fn a_completion_goes_by_what_a_concurrent_change_left() {
    use railguard::store::records::{RecordId, Records, StoredResponse};
    use railguard::token::AccountId;

    let (pg, mut client) = cluster().await;
    insert_in_flight(&client, 1, 6).await;
    let timeout = std::time::Duration::from_secs(10);
    let pool = railguard::db::build_pool(&pg.url(), 4, timeout).unwrap();
    let store = idempotency_store(&pg.url(), pool, timeout);
    let tx = change_records_2_4_5(&mut client).await;
    let completing: Vec<_> = (1..=6)
        .map(|n| {
            let record = RecordId {
                account: AccountId::parse(&format!("acct-{n}"), 64).unwrap(),
                key: format!("key-{n}"),
                owner: format!("owner-{n}"),
            };
            let response = StoredResponse {
                status: 201,
                headers: vec![("content-type".into(), "application/json".into())],
                body: Some(bytes::Bytes::from_static(b"{}")),
            };
            tokio::spawn(Records::complete(&store, record, response))
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        completing.iter().any(|c| !c.is_finished()),
        "completions wait for the rows"
    );
    tx.commit().await.unwrap();
    for c in completing {
        c.await.unwrap();
    }
    assert_five_records(&client, "done").await;
}

/// Marks of accounts `from..=to`, as the fence's compare-and-set leaves them.
async fn insert_marks(client: &Client, from: i64, to: i64) {
    client
        .execute(
            "INSERT INTO rail_high_water (account_id, highest_token)
             SELECT 'acct-' || g, g FROM generate_series($1::bigint, $2::bigint) g",
            &[&from, &to],
        )
        .await
        .unwrap();
}

/// Accounts `ids`' marks, read with `statement`.
async fn look(
    client: &impl GenericClient,
    statement: &tokio_postgres::Statement,
    ids: &[i64],
) -> usize {
    let accounts: Vec<String> = ids.iter().map(|i| format!("acct-{i}")).collect();
    client.query(statement, &[&accounts]).await.unwrap().len()
}

/// Executions of the session's prepared `statement` with its generic plan, and with a plan of
/// their own.
async fn generic_and_custom(client: &impl GenericClient, statement: &str) -> (i64, i64) {
    let row = client
        .query_one(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1",
            &[&statement],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test]
async fn the_last_look_keeps_one_primary_key_plan_made_on_a_new_table() {
    last_looks_on_a_growing_table(false).await;
}

#[tokio::test]
async fn the_last_look_keeps_one_primary_key_plan_made_after_analyzing_an_empty_table() {
    last_looks_on_a_growing_table(true).await;
}

/// The last look on its own sessions (`db::build_look_pool`), against sessions without its
/// settings: one that only forces generic plans, and one as PostgreSQL plans by default.
async fn last_looks_on_a_growing_table(analyze_when_empty: bool) {
    let (pg, client) = cluster_analyzing("rail_high_water", analyze_when_empty).await;
    insert_marks(&client, 1, 50).await;
    let looks =
        railguard::db::build_look_pool(&pg.url(), 1, std::time::Duration::from_secs(10)).unwrap();
    let mut pinned_session = looks.get().await.unwrap();
    let pinned = pinned_session.prepare_cached(LAST_LOOK_SQL).await.unwrap();
    let mut generic_session = pg.client().await;
    generic_session
        .batch_execute("SET plan_cache_mode = force_generic_plan")
        .await
        .unwrap();
    let generic = generic_session.prepare(LAST_LOOK_SQL).await.unwrap();
    for i in 0..8 {
        let batch = [3 * i + 1, 3 * i + 2, 3 * i + 3, 10_000 + i];
        assert_eq!(look(&**pinned_session, &pinned, &batch).await, 3);
        assert_eq!(look(&generic_session, &generic, &batch).await, 3);
    }
    // The table grows; nothing replans.
    insert_marks(&client, 1_000, 60_000).await;

    let batch = [50_001, 50_002, 7, 70_000];
    let tx = generic_session.transaction().await.unwrap();
    let before = scans(&tx, "rail_high_water").await;
    assert_eq!(look(&tx, &generic, &batch).await, 3);
    let after = scans(&tx, "rail_high_water").await;
    tx.commit().await.unwrap();
    if analyze_when_empty {
        assert!(
            after.0 > before.0,
            "negative control: a generic plan made while the table looked empty scans it whole \
             (seq {}); if this no longer holds, enable_seqscan = off is harmless but not needed",
            after.0 - before.0
        );
    }

    let tx = pinned_session.transaction().await.unwrap();
    let before = scans(&tx, "rail_high_water").await;
    assert_eq!(look(&*tx, &pinned, &batch).await, 3);
    let after = scans(&tx, "rail_high_water").await;
    tx.commit().await.unwrap();
    assert_eq!(after.0 - before.0, 0, "the last look never scans the table");
    assert!(after.1 > before.1, "it reads the marks by the primary key");

    assert_eq!(
        generic_and_custom(&**pinned_session, LAST_LOOK_SQL).await,
        (9, 0),
        "every look ran the session's one generic plan"
    );

    // Negative control, on the grown table once analyzed (as autovacuum would): by default
    // PostgreSQL plans every look afresh. The look's sessions still do not.
    client
        .batch_execute("ANALYZE rail_high_water")
        .await
        .unwrap();
    let fresh_session = pg.client().await;
    let fresh = fresh_session.prepare(LAST_LOOK_SQL).await.unwrap();
    for i in 0..8 {
        let batch = [5 * i + 1, 20_000 + i, 40_000 + i, 90_000 + i];
        assert_eq!(look(&fresh_session, &fresh, &batch).await, 3);
        assert_eq!(look(&**pinned_session, &pinned, &batch).await, 3);
    }
    assert_eq!(
        generic_and_custom(&fresh_session, LAST_LOOK_SQL).await,
        (0, 8),
        "negative control: by default each look is planned for its batch"
    );
    assert_eq!(
        generic_and_custom(&**pinned_session, LAST_LOOK_SQL).await,
        (17, 0)
    );
}

/// A standby answers reads with marks that lag the primary's: the last look's sessions are
/// only opened on a server that takes writes, whatever `target_session_attrs` the URL says.
/// (A server whose sessions start read-only says what a standby says when asked.)
#[tokio::test]
async fn the_last_look_never_reads_from_a_server_that_takes_no_writes() {
    let (pg, client) = cluster().await;
    let looks =
        railguard::db::build_look_pool(&pg.url(), 1, std::time::Duration::from_secs(10)).unwrap();
    drop(looks.get().await.expect("a primary is fine"));
    client
        .batch_execute("ALTER SYSTEM SET default_transaction_read_only = on")
        .await
        .unwrap();
    client
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
    // The reload reaches new sessions within moments.
    let refused = "a look session refused on a server that takes no writes";
    let refused = support::eventually(Duration::from_secs(5), refused, || async {
        let url = pg.url();
        let separator = if url.contains('?') { '&' } else { '?' };
        let fresh = railguard::db::build_look_pool(
            &format!("{url}{separator}target_session_attrs=any"),
            1,
            std::time::Duration::from_secs(10),
        )
        .unwrap();
        let opened = fresh.get().await;
        opened
            .err()
            .map(|e| railguard::db::DbError::from(e).to_string())
    })
    .await;
    assert!(refused.contains("does not allow writes"), "{refused}");
    // The main pool's statements would fail there on their own; a plain session still opens.
    let plain =
        railguard::db::build_pool(&pg.url(), 1, std::time::Duration::from_secs(10)).unwrap();
    drop(plain.get().await.expect("a plain session opens"));
}

/// Every fenced request takes a last look: `/readyz` (`HighWaterStore::ready`) says not ready
/// when the look's sessions cannot be opened, even with the pool's fine.
#[tokio::test]
async fn readiness_needs_the_last_look_sessions_too() {
    use railguard::store::{
        batch::Batching,
        marks::{HighWaterStore, ThisProcess},
    };
    use railguard::store::{instance::InstanceId, records::Records};
    use std::sync::Arc;
    use std::time::Duration;

    let (pg, _client) = cluster().await;
    let timeout = Duration::from_secs(3);
    let store = |looks_url: String| {
        let pool = railguard::db::build_pool(&pg.url(), 2, timeout).unwrap();
        let looks = railguard::db::build_look_pool(&looks_url, 1, timeout).unwrap();
        let records: Arc<dyn Records> =
            Arc::new(idempotency_store(&pg.url(), pool.clone(), timeout));
        HighWaterStore::new(
            pool,
            looks,
            timeout,
            Batching::default(),
            prometheus::Histogram::with_opts(prometheus::HistogramOpts::new("cas", "cas")).unwrap(),
            ThisProcess {
                instance: InstanceId::generate(),
                handover: None,
            },
            records,
        )
    };
    store(pg.url()).ready().await.expect("ready with both");
    let nowhere = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        support::free_loopback_port()
    );
    let err = store(nowhere)
        .ready()
        .await
        .expect_err("not ready without the look's sessions");
    assert!(err.contains("the last look's sessions"), "{err}");
}

/// Every keyed request's answer is stored on the completions' sessions: `/readyz`
/// (`IdempotencyStore::ready`) says not ready when they cannot be opened, with the pool fine.
#[tokio::test]
async fn readiness_needs_the_completion_sessions_too() {
    let (pg, _client) = cluster().await;
    let timeout = std::time::Duration::from_secs(3);
    let pool = railguard::db::build_pool(&pg.url(), 2, timeout).unwrap();
    idempotency_store(&pg.url(), pool.clone(), timeout)
        .ready()
        .await
        .expect("ready with both");
    let nowhere = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        support::free_loopback_port()
    );
    let err = idempotency_store(&nowhere, pool, timeout)
        .ready()
        .await
        .expect_err("not ready without the completions' sessions");
    assert!(
        err.contains("the idempotency completions' sessions"),
        "{err}"
    );
}
