-- The PostgreSQL server this database was last acknowledged on, and the fencing floor.
--
-- A store can go back: a failover to an asynchronous standby that missed the last commits, a
-- data directory put back to an earlier copy, a dump restored. Marks, idempotency records, lock rows and
-- fencing_token_seq then go back together, and nothing in them says so. What cannot go back
-- with them is where they live: a rewind or a failover always means a restart or another
-- server, and a restored dump means new storage for the tables, so the identity (system
-- identifier, timeline, postmaster start time, the tables' storage) no longer matches the one
-- written here — the row went back with the data and still names the old one. Every railguard session compares the two before it is used; on a mismatch the
-- token source is moved past anything issued before and `floor` is raised to it: a token below
-- the floor is refused by the fence's compare-and-set, so every grant from before the change
-- is fenced out once and its holder takes a new one. The floor never goes down.
CREATE TABLE railguard_store_epoch (
    id                boolean     PRIMARY KEY DEFAULT true CHECK (id),
    system_identifier bigint,
    timeline          bigint,
    postmaster_start  timestamptz,
    -- The storage of railguard's tables and sequence (pg_relation_filenode): a logical restore
    -- (pg_restore into the same running server) recreates them, and the server stays the same.
    relations         text,
    floor             bigint      NOT NULL DEFAULT 0 CHECK (floor >= 0),
    -- How many changes of server this database has been through.
    epoch             bigint      NOT NULL DEFAULT 0,
    changed_at        timestamptz NOT NULL DEFAULT now()
);
INSERT INTO railguard_store_epoch DEFAULT VALUES;

-- The highest token the etcd lock backend granted for each key, written before the grant is
-- handed out. etcd restored from an older snapshot hands out revisions again; a grant whose
-- token is not above its key's row here shows it.
CREATE TABLE lock_issued (
    key   text   PRIMARY KEY,
    token bigint NOT NULL
);
