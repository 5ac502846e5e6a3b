//! The statements of the handover, over the table `railguard_forwarder` and the mark rows.

pub(super) const PUBLISH_SQL: &str = "\
INSERT INTO railguard_forwarder AS f
    (instance, horizon, pending_seqs, pending_accounts, pending_tokens, quiet_ms, published_at)
VALUES ($1, $2, $3, $4, $5, $6, now())
ON CONFLICT (instance) DO UPDATE
    SET horizon = EXCLUDED.horizon, pending_seqs = EXCLUDED.pending_seqs,
        pending_accounts = EXCLUDED.pending_accounts, pending_tokens = EXCLUDED.pending_tokens,
        quiet_ms = EXCLUDED.quiet_ms, published_at = EXCLUDED.published_at
    WHERE f.horizon <= EXCLUDED.horizon
RETURNING EXISTS (SELECT 1 FROM railguard_forwarder o
                  WHERE o.instance <> $1 AND now() <= o.published_at + interval '3 seconds')";

/// After the server changed: how long until (1) of [`Handover::wait_store_change`](super::Handover::wait_store_change) holds, and
/// whether a process other than `$1` has a pending entry below the floor for the account
/// (hash `$2`) and for any account. `$3`: this process's own quiet time, for processes the
/// database does not know of (or the longest of the processes that could still have been
/// running at the change, if longer). An entry without a token (a process that does not state it)
/// counts as below the floor. `$4`: the database is this process's own (the embedded server):
/// no process it does not know of can have forwarded, and (1) is not waited for.
pub(super) const HOLD_SQL: &str = "\
WITH e AS (SELECT floor, went_back_at, epoch FROM railguard_store_epoch),
pending AS (
    SELECT p.account
    FROM railguard_forwarder f, e,
         unnest(f.pending_accounts, f.pending_tokens) AS p(account, token)
    WHERE f.instance <> $1
      AND now() <= f.published_at + f.quiet_ms * interval '1 millisecond'
      AND (p.token IS NULL OR p.token < e.floor))
SELECT e.epoch,
       CASE WHEN $4 THEN 0 ELSE COALESCE(GREATEST(0, ceil(extract(epoch FROM
           e.went_back_at
           + GREATEST($3, (SELECT COALESCE(max(quiet_ms), 0) FROM railguard_forwarder
                           WHERE published_at + quiet_ms * interval '1 millisecond'
                                 >= e.went_back_at))
             * interval '1 millisecond'
           - now()) * 1000)), 0) END::bigint,
       EXISTS (SELECT 1 FROM pending WHERE account = $2),
       EXISTS (SELECT 1 FROM pending)
FROM e";

pub(super) const READ_SQL: &str = "\
SELECT instance, horizon, pending_seqs, pending_accounts,
       now() > published_at + quiet_ms * interval '1 millisecond'
FROM railguard_forwarder WHERE instance = ANY($1)";

/// Removes entries found settled from an account's row; an entry that has changed since (its
/// process forwarded for the account again) stays.
pub(super) const PRUNE_SQL: &str = "\
UPDATE rail_high_water AS h SET (forwarders, forward_seqs) = (
    SELECT coalesce(array_agg(u.f ORDER BY u.o), '{}'), coalesce(array_agg(u.s ORDER BY u.o), '{}')
    FROM unnest(h.forwarders, h.forward_seqs) WITH ORDINALITY AS u(f, s, o)
    WHERE NOT EXISTS (SELECT 1 FROM unnest($2::bigint[], $3::bigint[]) AS d(f, s)
                      WHERE d.f = u.f AND d.s = u.s))
WHERE account_id = $1 AND forwarders && $2::bigint[]";
