-- Idempotency completions with a plan that cannot degrade (issue 13).
--
-- Completions are group-committed: one statement joins a batch of (account, key, owner)
-- arrays to idempotency_record. Prepared once per connection, that statement gets a generic
-- plan on its sixth execution, costed for the table as it is at that moment. On a new
-- deployment the table is small then, and the generic plan is a sequential scan with a hash
-- or nested-loop join; it stays cached while the table grows, until autovacuum's next ANALYZE
-- invalidates it. One run counted 2,860 sequential scans reading 41.8 million rows within a
-- minute of load; at 200,000 rows each batch took 214 ms instead of a fraction of one.
--
-- The opposite happens too: with the batch's arrays known, a custom plan for a batch of fewer
-- than ten rows always looks cheaper than the generic one (which assumes ten), so PostgreSQL
-- planned the statement afresh on every execution — about 130 µs of a 6-row batch's 380.
--
-- The statement lives here so that its plan can be pinned. Each record of the batch, in key
-- order, is completed by a one-row UPDATE whose WHERE names the whole primary key; with
-- sequential scans off within this function, the only plan for it is the primary key's index
-- with both columns as its condition, whatever the statistics say and however the table has
-- grown since (a single statement joining the batch to the table could still be planned as a
-- walk over the whole index, with the batch as the inner side, after an ANALYZE of an empty
-- table). That plan is made once per connection and kept (`force_generic_plan`). The loop
-- also makes the lock order — key order, as the fence's batch meets records — a property of
-- the code rather than of a plan. The settings revert when the function returns.
--
-- The commit that follows does not wait for its WAL flush (`synchronous_commit` off for the
-- rest of the calling transaction): a completion lost to a crash leaves its record in flight,
-- then in doubt, and a retry is refused, never forwarded twice (see the proxy's
-- `idempotency::outcomes`).
CREATE FUNCTION railguard_complete_records(
    p_accounts      text[],
    p_keys          text[],
    p_owners        text[],
    p_statuses      smallint[],
    p_headers       text[],
    p_bodies        bytea[],
    p_bodies_stored boolean[]
) RETURNS TABLE (completed_account text, completed_key text)
LANGUAGE plpgsql
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $function$
DECLARE
    c record;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    FOR c IN
        SELECT *
        FROM unnest(p_accounts, p_keys, p_owners, p_statuses, p_headers, p_bodies,
                    p_bodies_stored)
            AS u(account_id, idempotency_key, owner, status, headers, body, body_stored)
        ORDER BY 1, 2
    LOOP
        UPDATE idempotency_record r
        SET state = 'done', status = c.status, headers = c.headers::jsonb, body = c.body,
            body_stored = c.body_stored, completed_at = now()
        WHERE r.account_id = c.account_id AND r.idempotency_key = c.idempotency_key
          AND r.owner = c.owner AND r.state = 'in_flight';
        IF FOUND THEN
            completed_account := c.account_id;
            completed_key := c.idempotency_key;
            RETURN NEXT;
        END IF;
    END LOOP;
END
$function$;

-- Whoever may update idempotency_record may call it (it runs with the caller's rights): a site
-- whose default privileges withhold EXECUTE from PUBLIC, with railguard migrated by one role and
-- run by another, would otherwise refuse every completion once this migration has committed.
GRANT EXECUTE ON FUNCTION railguard_complete_records(text[], text[], text[], smallint[], text[],
    bytea[], boolean[]) TO PUBLIC;
