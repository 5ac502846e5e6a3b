-- Safety holes found under faults (issue 8).
--
-- Renew and release are authorised by a per-grant secret that only the acquirer received; the
-- row keeps its SHA-256, never the secret. Rows granted before this migration have none and
-- can no longer be renewed or released: their leases simply run out.
ALTER TABLE lock_entry ADD COLUMN secret_sha256 bytea;

-- Keys shared by every railguard process on this database. `grant_proof` signs (lock key,
-- token) pairs so that the proxy can check, without a round trip, that a token was granted
-- for the account's lock key (C2 §2.3). Written once, by the first process that starts.
CREATE TABLE railguard_secret (
    name       text        PRIMARY KEY,
    value      bytea       NOT NULL CHECK (length(value) >= 32),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- An idempotency record knows its owner's own deadline (not a reader's configuration) and
-- which railguard process owns it, so that "in doubt" and "forget" are decided from the
-- owner's facts. `in_doubt` is set by the owner itself when its forward ended without an
-- answer from the rail.
ALTER TABLE idempotency_record
    ADD COLUMN in_doubt_at    timestamptz,
    ADD COLUMN owner_instance bigint;
ALTER TABLE idempotency_record DROP CONSTRAINT idempotency_record_state_check;
ALTER TABLE idempotency_record ADD CONSTRAINT idempotency_record_state_check
    CHECK (state IN ('in_flight', 'in_doubt', 'done'));
-- Records left by older binaries: in doubt ten minutes after they were made.
UPDATE idempotency_record SET in_doubt_at = created_at + interval '10 minutes'
WHERE in_doubt_at IS NULL;
