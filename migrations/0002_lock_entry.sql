-- The lock service's PostgreSQL backend (FR-11, C1 §1.3).
--
-- fencing_token_seq is the one global token source: every grant of every key takes its token
-- from it, inside the statement that creates or takes over the key's row. Sequences are not
-- transactional, so a value is never handed out twice, even across rollbacks and crashes.
CREATE SEQUENCE fencing_token_seq AS bigint MINVALUE 1 START WITH 1 NO CYCLE;

-- One row per key that was ever granted. A row is not deleted on release: it keeps the key's
-- last token, so that a grant whose nextval() was drawn before a later grant's can never take
-- the key with the smaller token (see src/lock/postgres.rs).
CREATE TABLE lock_entry (
    key          text        PRIMARY KEY,
    holder       text        NOT NULL,
    token        bigint      NOT NULL UNIQUE CHECK (token > 0),
    ttl_ms       bigint      NOT NULL CHECK (ttl_ms > 0),
    granted_at   timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    -- When the grant ended: by release (released = true), or by expiry as noticed by its
    -- holder's late renew or release (released = false). NULL while it runs, and for a grant
    -- that expired unnoticed.
    ended_at     timestamptz,
    released     boolean     NOT NULL DEFAULT false,
    -- This grant took the key from one that expired without being released (a takeover),
    -- and whether that expiry had gone unnoticed until then (for lock_expiries_total).
    took_over    boolean     NOT NULL DEFAULT false,
    expiry_noticed_at_grant boolean NOT NULL DEFAULT false
);
