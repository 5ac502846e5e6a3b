-- Idempotency keys at the proxy (C3 §3.1). A record is created in the same statement, and so
-- the same transaction, as the fence compare-and-set that lets its request through; it is
-- completed with the rail's response, which is then replayed to repeats.
CREATE TABLE idempotency_record (
    account_id      text        NOT NULL,
    idempotency_key text        NOT NULL,
    -- sha256 of method, path and query, and body: the same key with another request is a 422.
    fingerprint     text        NOT NULL,
    -- The token of the request that created the record (for diagnosis).
    token           bigint      NOT NULL,
    -- A random id of the one request that owns the record: only it completes the record, and
    -- only its own paths remove it again (when it is known never to have reached the rail).
    owner           text        NOT NULL,
    state           text        NOT NULL CHECK (state IN ('in_flight', 'done')),
    status          smallint,
    headers         jsonb,
    body            bytea,
    -- false when the response body was larger than idempotency.max_response_bytes.
    body_stored     boolean,
    created_at      timestamptz NOT NULL DEFAULT now(),
    completed_at    timestamptz,
    PRIMARY KEY (account_id, idempotency_key)
);
-- Retention removes completed records; in-flight ones wait for an operator.
CREATE INDEX idempotency_record_completed_at ON idempotency_record (completed_at) WHERE state = 'done';
