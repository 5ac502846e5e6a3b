-- The proxy's fencing point (FR-17): the highest token accepted per account.
-- A mark only grows; the compare-and-set that advances it is in src/high_water.rs.
CREATE TABLE rail_high_water (
    account_id    text        PRIMARY KEY,
    highest_token bigint      NOT NULL CHECK (highest_token > 0),
    updated_at    timestamptz NOT NULL DEFAULT now()
);
