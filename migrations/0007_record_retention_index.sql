-- Completing an idempotency record becomes a HOT update (issue 13).
--
-- Retention found completed records through an index on completed_at, partial on
-- state = 'done'. The completion sets both columns, so no completion could be a heap-only
-- (HOT) update: each one wrote a new row version with new entries in both of the table's
-- indexes, and left the old entries for vacuum. Measured with pgbench on PostgreSQL 15 (insert
-- four in-flight records, then complete them with railguard_complete_records): with this
-- index, 0 of 447,000 completions were HOT. With an index on created_at instead, 98% were, the
-- completion statement took 17-20% less time and the pair 15-20% less WAL. A lower fillfactor
-- added nothing: a record is completed moments after its insert, while its page still has room.
--
-- Retention keeps its meaning: a record completed more than the retention ago was created
-- before that too (completed_at >= created_at), so the sweep adds `created_at < cutoff` to
-- its condition and walks this index.
--
-- This migration runs outside a transaction, one statement at a time (`concurrent` in
-- db::migrate): building an index on a large table in the migrations' transaction would block
-- every keyed payment's insert until it finished. Each statement is safe to run again: an
-- index left invalid by an interrupted build is dropped and built anew.
DROP INDEX CONCURRENTLY IF EXISTS idempotency_record_created_at;
CREATE INDEX CONCURRENTLY idempotency_record_created_at ON idempotency_record (created_at);
DROP INDEX CONCURRENTLY IF EXISTS idempotency_record_completed_at;
