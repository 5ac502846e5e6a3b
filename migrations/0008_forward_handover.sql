-- Several railguard processes on one database: which forwards may still be on their way to the
-- rail (`store::handover`).
--
-- An account's row names, beside its mark, the processes that forwarded for it and the
-- sequence number of each one's latest compare-and-set there. The compare-and-set replaces the
-- calling process's entry and keeps the others', and answers them: a process whose
-- compare-and-set finds another's entry waits, before it forwards, until that process says the
-- forward can no longer reach the rail.
ALTER TABLE rail_high_water
    ADD COLUMN forwarders   bigint[] NOT NULL DEFAULT '{}',
    ADD COLUMN forward_seqs bigint[] NOT NULL DEFAULT '{}';

-- What each process says of its forwards, rewritten every few milliseconds while it runs: every
-- sequence number below `horizon` is settled — its forward answered, never sent, or long enough
-- past its last byte that nothing of it can still arrive — except the pending ones listed, each
-- with its account's 64-bit FNV-1a hash (a collision only makes another account wait). A process that stopped writing here is taken as settled once `quiet_ms`
-- have passed since `published_at`: it starts no forward more than `alive_ms` after its last
-- write, and what it sent arrives within the rail transit time it states.
CREATE TABLE railguard_forwarder (
    instance         bigint      PRIMARY KEY,
    horizon          bigint      NOT NULL,
    pending_seqs     bigint[]    NOT NULL,
    pending_accounts bigint[]    NOT NULL,
    quiet_ms         bigint      NOT NULL CHECK (quiet_ms >= 0),
    published_at     timestamptz NOT NULL DEFAULT now()
);
