-- Forwards on their way when the store goes back (`store::handover`, "When the store goes back").
--
-- The entries the compare-and-set writes into the mark rows go back with the data; what each
-- process has on its way does not: it is in the process, which writes it here again on the
-- new server. Each pending entry now states its token, so that a forward of a token above the
-- new floor can wait until no forward of a token below it, of any process, can still arrive.
-- An entry written by a process that does not state its token counts as below any floor.
ALTER TABLE railguard_forwarder
    ADD COLUMN pending_tokens bigint[] NOT NULL DEFAULT '{}';

-- When the PostgreSQL server last changed under railguard (a failover, a rewind, a restart: see
-- 0007): forwards of newer grants wait, after it, until nothing sent before it can still reach
-- the rail. NULL: the database was never seen to change.
ALTER TABLE railguard_store_epoch
    ADD COLUMN went_back_at timestamptz;
