-- Operator actions taken through the admin listener (issue 11): what was asked, why, and what
-- it did. A row is written before the action (its intent) and completed after it, so that no
-- action happens unrecorded; a row left without an outcome is an action that was interrupted.
CREATE TABLE railguard_audit (
    id          bigserial   PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    action      text        NOT NULL,
    account_id  text,
    reason      text        NOT NULL,
    -- What the action found and did, filled in when it ends.
    outcome     jsonb,
    finished_at timestamptz
);
CREATE INDEX railguard_audit_account ON railguard_audit (account_id, at);
