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
-- The statement lives here so that its plan can be pinned: within this function, sequential
-- scans, hash joins and merge joins are off, so the only plan left is the one that is right at
-- any size — the batch, sorted by key, driving a nested loop over the primary key — and that
-- plan is made once per connection and kept (`force_generic_plan`). That also makes the lock
-- order (key order, as the fence's batch meets records) a property of the plan rather than a
-- likelihood. The settings revert when the function returns.
--
-- The commit that follows does not wait for its WAL flush (`synchronous_commit` off for the
-- rest of the calling transaction): a completion lost to a crash leaves its record in flight,
-- then in doubt, and a retry is refused, never forwarded twice (see the proxy's
-- `idempotency::outcomes`).
CREATE FUNCTION railguard_complete_records(
    accounts      text[],
    keys          text[],
    owners        text[],
    statuses      smallint[],
    headers       text[],
    bodies        bytea[],
    bodies_stored boolean[]
) RETURNS TABLE (completed_account text, completed_key text)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET plan_cache_mode = force_generic_plan
AS $function$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY
    UPDATE idempotency_record r
    SET state = 'done', status = u.status, headers = u.headers::jsonb, body = u.body,
        body_stored = u.body_stored, completed_at = now()
    FROM (
        SELECT *
        FROM unnest(accounts, keys, owners, statuses, headers, bodies, bodies_stored)
            AS u(account_id, key, owner, status, headers, body, body_stored)
        ORDER BY u.account_id, u.key
    ) AS u
    WHERE r.account_id = u.account_id AND r.idempotency_key = u.key AND r.owner = u.owner
      AND r.state = 'in_flight'
    RETURNING r.account_id, r.idempotency_key;
END
$function$;
