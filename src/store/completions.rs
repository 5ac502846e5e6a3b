//! The statement that stores the rail's answers to keyed requests, a batch at a time: plain
//! SQL over plain values (accounts, keys, owners, statuses, headers, bodies). The batcher that
//! runs it is `store::records`' `outcomes`, under the one batcher (`store::batch`); the session settings of the
//! connections that run it are `db`'s.

/// Completes the in-flight records of a batch; returns the ones it completed.
///
/// One set-based statement, run on sessions of its own (`db::build_completion_pool`) whose
/// settings give it exactly one plan and make its commit not wait for the WAL flush:
///
/// - **The plan cannot degrade.** The batch, sorted by key, drives a nested loop; for each row
///   a sub-select finds the record by the whole primary key, and the `UPDATE` fetches it by
///   that row's position (`ctid`). The join's one condition is the position, which no index
///   serves; the owner and state are compared with `IS NOT DISTINCT FROM`, which no index
///   serves either. Keep it so: a plain `=` on `state` let an operator's index on it drive a
///   join over every in-flight record, in that index's order (measured: 57 ms per 20-row
///   batch, and deadlocks with the fence's batches even with every planner switch below
///   set). With sequential scans off (and hash and merge joins, as a second line),
///   the only way to `idempotency_record`'s rows is the position the sub-select found, for one
///   batch row at a time. The sessions' settings are checked when each opens
///   (`db::sessions_with`). A prepared join by key (`UPDATE … FROM unnest(…) WHERE
///   r.account_id = u.account_id …`) gets a generic plan costed for the table as it was at
///   its sixth execution: on a new deployment a sequential scan kept while the table grows,
///   or, after an `ANALYZE` of the empty table, a walk over the whole index with the batch
///   inside (measured: 2,860 such scans in a minute of load, and 8.9 s for a 500-row
///   batch). Migration 0006's `railguard_complete_records` avoided that with one `UPDATE` per
///   record in a loop, at an executor start per record. `tests/store/statement_plans.rs` checks the
///   one plan on a new table, on an analyzed empty one and with indexes an operator might add,
///   against a join by key as the negative control.
/// - **Key order.** Records are updated, and so locked, in key order, as the fence's batch
///   locks the records it meets: the nested loop updates each batch row as the sorted batch
///   hands it over (the sort sits in a sub-select of its own, `OFFSET 0`, which PostgreSQL
///   does not merge into the join).
/// - **Concurrent changes.** The sub-select reads the record as the statement's snapshot saw
///   it. If another transaction holds the row, the `UPDATE` waits for it. A row it only locked
///   is completed after; one it changed or removed is passed over (PostgreSQL 15.20 does not
///   take a row whose position changed; earlier minor versions may re-check the newer row
///   instead). Either way the owner and state conditions are on the `UPDATE` itself, so only
///   the record's owner completes it, and only while it is in flight; they must stay there. A
///   passed-over record still in flight for its owner is completed by its key
///   (`settle`).
///
/// Its commit does not wait for the WAL flush (`synchronous_commit` off on these sessions):
/// the rows are visible to every reader at once, and a PostgreSQL crash within
/// `wal_writer_delay` (×3 at worst) of the commit can lose them — as can a failover to a
/// standby, which an asynchronous commit does not wait for either. What that loses is the
/// replay, never safety: the record itself was created durably with the fence's
/// compare-and-set, so a lost completion leaves it `in_flight`, then in doubt once its owner's
/// deadline passes — a retry is refused (`409 in_doubt`), never forwarded twice. What it saves
/// is a second durable commit on every keyed request's path (the added latency at one
/// connection is one commit, not two). No explicit `FOR UPDATE` first: it writes a lock to each
/// row before updating it (it doubled PostgreSQL's CPU per row when tried).
pub const COMPLETE_SQL: &str = "\
UPDATE idempotency_record r
SET state = 'done', status = b.status, headers = b.headers::jsonb, body = b.body,
    body_stored = b.body_stored, completed_at = now()
FROM (
    SELECT u.*,
           (SELECT t.ctid FROM idempotency_record t
            WHERE t.account_id = u.account_id AND t.idempotency_key = u.key) AS position
    FROM (
        SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int2[], $5::text[],
                             $6::bytea[], $7::bool[])
            AS u(account_id, key, owner, status, headers, body, body_stored)
        ORDER BY account_id, key
        OFFSET 0
    ) AS u
) AS b
WHERE r.ctid = b.position
  AND r.owner IS NOT DISTINCT FROM b.owner AND r.state IS NOT DISTINCT FROM 'in_flight'
RETURNING r.account_id, r.idempotency_key";
