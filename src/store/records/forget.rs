//! Forgetting a record in doubt, and completing one from the rail's answer: the checks that
//! a forget rests on (the owner's stop, the time nothing it sent can still arrive), and their
//! audit records.

use std::time::Duration;

use super::*;

/// Takes the owner's instance lock, shared, for the rest of forget's transaction, if the owner
/// does not hold it: false while the owning process holds it (it is running), and an owner that
/// reconnects meanwhile waits until forget has committed, so a check and its delete see the
/// same owner. Shared, so that concurrent forgets of one owner's records do not refuse each
/// other.
pub(super) const OWNER_LOCK_FREE_SQL: &str = "SELECT pg_try_advisory_xact_lock_shared($1)";

/// Whether the owning process said, as it stopped, that it had nothing left to send
/// ([`super::instance::record_clean_stop`]): from when nothing it sent can reach the rail
/// (`quiet_after`; NULL when it recorded no clean stop), and its `proxy.rail_transit_ms`. A
/// clean stop recorded by an older binary says no `quiet_after`: it is taken as the stop's
/// time plus this process's `rail_transit_ms` (`$2`).
pub(super) const OWNER_STOPPED_CLEANLY_SQL: &str = "\
SELECT max(COALESCE((outcome->>'quiet_after')::timestamptz,
                    COALESCE(finished_at, at) + $2::bigint * interval '1 millisecond')),
       max((outcome->>'rail_transit_ms')::bigint)
FROM railguard_audit
WHERE action = 'instance_stopped' AND (outcome->>'instance')::bigint = $1";

/// When a record's request can no longer reach the rail, and whether that time has passed (by
/// the database's clock): its in-doubt deadline (`$1`) plus the transit time (`$2`, ms) — no
/// forward of it is written past its deadline by an owner that has stopped, except one whose end
/// its clean stop covers — and not before the owner's `quiet_after` (`$3`, if it stopped
/// cleanly). Also the wait left, in whole seconds.
pub(super) const QUIET_SQL: &str = "\
SELECT now() > t, to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US\"Z\"'),
       GREATEST(ceil(extract(epoch FROM t - now())), 0)::bigint
FROM (SELECT GREATEST($1::timestamptz + $2::bigint * interval '1 millisecond',
                      $3::timestamptz) AS t) AS q";

/// Completes a record in doubt — declared so by its owner, or past its owner's deadline —
/// with the rail's answer to a lookup of its key; its owner instance, for the audit record.
pub(super) const COMPLETE_FROM_THE_RAIL_SQL: &str = "\
UPDATE idempotency_record
SET state = 'done', status = $3, headers = $4::text::jsonb, body = $5, body_stored = $6,
    completed_at = now()
WHERE account_id = $1 AND idempotency_key = $2
  AND (state = 'in_doubt' OR (state = 'in_flight' AND now() > COALESCE(in_doubt_at, created_at)))
RETURNING owner_instance";

/// The audit record of a record completed from the rail's lookup, in its transaction.
pub(super) const AUDIT_RESOLVE_SQL: &str = "\
INSERT INTO railguard_audit (action, account_id, reason, outcome, finished_at)
VALUES ('idempotency_resolve', $1, $2, $3::text::jsonb, now())";

/// `outcome->>'result'` of the audit record of a retry let through after the store went back
/// ([`IdempotencyStore::audit_first_request_after_store_change`]).
pub const FIRST_REQUEST_AFTER_STORE_CHANGE: &str = "first_request_after_store_change";

/// The audit record of a forget, written in its transaction: no delete without it.
pub(super) const AUDIT_FORGET_SQL: &str = "\
INSERT INTO railguard_audit (action, account_id, reason, outcome, finished_at)
VALUES ('idempotency_forget', $1, $2, $3::text::jsonb, now())";

impl IdempotencyStore {
    /// The operator's way out of `in_doubt`: deletes the record only if nothing railguard
    /// does can still send it, and nothing it sent can still reach the rail; writes the audit
    /// record in the same transaction. See the module docs for what this cannot see.
    ///
    /// Its forward must be over: the owner declared it in doubt, or the owner's own deadline
    /// passed. The owner must be known to have stopped: the owning process recorded a clean
    /// stop, or the operator says it has stopped (`owner_stopped`, naming the record's owner).
    /// A missing instance lock alone proves nothing — a paused process whose database session
    /// was lost (a backend crash, a terminated session, a failover) holds none, and may still
    /// send once it runs again. An owner that holds its lock is running, and is refused
    /// whatever anyone says. And the request must be past the time it could still arrive: its
    /// in-doubt deadline plus `proxy.rail_transit_ms` (the larger of this process's and the
    /// owner's, when its clean stop says it), and, for an owner that stopped cleanly, its
    /// `quiet_after` ([`Forgot::MayStillArrive`] until then).
    ///
    /// `dry_run`: decides, and changes nothing — a record that would be forgotten is
    /// [`Forgot::WouldForget`], and kept (the procedure's "is it time to ask the rail yet").
    pub async fn forget_in_doubt(
        &self,
        account: &AccountId,
        key: &str,
        owner_stopped: Option<OwnerStopped>,
        dry_run: bool,
    ) -> Result<Forgot, DbError> {
        self.forget(account, key, owner_stopped, dry_run, Asked::Operator)
            .await
    }

    /// The rail's lookup found no payment with the record's key (`resolve`): forgets the
    /// record exactly when [`forget_in_doubt`](Self::forget_in_doubt) would without an
    /// operator's word — its forward is over, its owner recorded a clean stop and holds no
    /// instance lock, and nothing it sent can still reach the rail — audited as the rail's
    /// answer. Otherwise the record stays in doubt, and the verdict says why.
    pub async fn forget_not_on_the_rail(
        &self,
        account: &AccountId,
        key: &str,
        dry_run: bool,
    ) -> Result<Forgot, DbError> {
        self.forget(account, key, None, dry_run, Asked::RailLookup)
            .await
    }

    /// The rail's lookup found the payment of a record in doubt (`resolve`): the record is
    /// completed with the rail's answer, and the audit record says so, in one transaction.
    /// Whoever sent it, the rail has the payment: a retry gets this answer, never a new
    /// forward. `false` when the record is not in doubt (any more): completed meanwhile (by
    /// its owner's late answer), forgotten, or still within its owner's deadline.
    pub async fn complete_from_the_rail(
        &self,
        account: &AccountId,
        key: &str,
        response: &StoredResponse,
    ) -> Result<bool, DbError> {
        self.bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let row = tx
                .query_opt(
                    COMPLETE_FROM_THE_RAIL_SQL,
                    &[
                        &account.as_str(),
                        &key,
                        &outcomes::status_column(response.status),
                        &outcomes::headers_column(response),
                        &response.body.as_deref(),
                        &response.body.is_some(),
                    ],
                )
                .await?;
            let Some(row) = row else {
                return Ok(false);
            };
            let owner: Option<i64> = row.get(0);
            let outcome = serde_json::json!({
                "idempotency_key": key,
                "result": "completed_from_the_rail",
                "status": response.status,
                "owner_instance": owner,
            });
            tx.execute(
                AUDIT_RESOLVE_SQL,
                &[
                    &account.as_str(),
                    &"the rail's lookup by idempotency key found the payment (rail_lookup.path)",
                    &outcome.to_string(),
                ],
            )
            .await?;
            tx.commit().await?;
            Ok(true)
        })
        .await
    }

    /// The audit record of a retry whose first attempt's record went back with the store, let
    /// through as the key's first request because the rail's lookup, asked once nothing sent
    /// before the change could still reach it, found no payment under the key.
    pub async fn audit_first_request_after_store_change(
        &self,
        account: &AccountId,
        key: &str,
    ) -> Result<(), DbError> {
        let outcome = serde_json::json!({
            "idempotency_key": key,
            "result": FIRST_REQUEST_AFTER_STORE_CHANGE,
        });
        self.bounded(async {
            self.client()
                .await?
                .execute(
                    AUDIT_RESOLVE_SQL,
                    &[
                        &account.as_str(),
                        &"the key's first attempt predates the store going back and its record \
                          did not survive; the rail's lookup (rail_lookup.path), asked once \
                          nothing sent before the change could still reach the rail, found no \
                          payment under the key: the retry was let through to the fence as the \
                          key's first request (its compare-and-set and forward follow, or it is \
                          refused there)",
                        &outcome.to_string(),
                    ],
                )
                .await?;
            Ok(())
        })
        .await
    }

    pub(super) async fn forget(
        &self,
        account: &AccountId,
        key: &str,
        owner_stopped: Option<OwnerStopped>,
        dry_run: bool,
        asked: Asked,
    ) -> Result<Forgot, DbError> {
        let transit_ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        let own_transit = transit_ms(self.rail_transit);
        self.bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let row = tx
                .query_opt(
                    "SELECT state, now() > COALESCE(in_doubt_at, created_at), owner_instance,
                            to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US\"Z\"'),
                            COALESCE(in_doubt_at, created_at)
                     FROM idempotency_record WHERE account_id = $1 AND idempotency_key = $2
                     FOR UPDATE",
                    &[&account.as_str(), &key],
                )
                .await?;
            let Some(row) = row else {
                return Ok(Forgot::NotFound);
            };
            let (state, past_deadline, owner, created): (String, bool, Option<i64>, String) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            let in_doubt_at: std::time::SystemTime = row.get(4);
            // The owner's clean stop, if it recorded one: (quiet_after, its rail_transit_ms).
            let mut clean_stop: Option<(std::time::SystemTime, Option<i64>)> = None;
            // Even a forward its owner declared in doubt may still be on its way out of the
            // owner's own connection (a large body written slowly to a slow rail): only an
            // owner that has stopped sends nothing more.
            let verdict = match (state.as_str(), owner.map(InstanceId::from_stored)) {
                ("done", _) => Forgot::Completed,
                ("in_flight", _) if !past_deadline => Forgot::StillInFlight,
                // Made before owners were recorded (migration 0004): no lock and no clean stop
                // can speak for the process that made it, so only the operator's word can.
                (_, None) if owner_stopped == Some(OwnerStopped::Unrecorded) => {
                    Forgot::Forgotten(Because::NoOwner)
                }
                (_, None) => Forgot::OwnerUnrecorded {
                    created: created.clone(),
                },
                (_, Some(owner)) => {
                    let lock_free: bool = tx
                        .query_one(OWNER_LOCK_FREE_SQL, &[&owner.get()])
                        .await?
                        .get(0);
                    if !lock_free {
                        Forgot::OwnerMayStillSend {
                            owner,
                            named: owner_stopped,
                        }
                    } else {
                        let stopped = tx
                            .query_one(OWNER_STOPPED_CLEANLY_SQL, &[&owner.get(), &own_transit])
                            .await?;
                        let quiet_after: Option<std::time::SystemTime> = stopped.get(0);
                        clean_stop = quiet_after.map(|at| (at, stopped.get(1)));
                        if clean_stop.is_some() {
                            Forgot::Forgotten(Because::OwnerStoppedCleanly(owner))
                        } else if owner_stopped == Some(OwnerStopped::Instance(owner)) {
                            Forgot::Forgotten(Because::OperatorSawOwnerStop(owner))
                        } else {
                            Forgot::OwnerNotSeenStopping {
                                owner,
                                created: created.clone(),
                                named: owner_stopped,
                            }
                        }
                    }
                }
            };
            // Stopped, or taken as stopped: what it sent may still be on its way to the rail.
            let verdict = match verdict {
                Forgot::Forgotten(because) => {
                    let transit = clean_stop
                        .and_then(|(_, owners)| owners)
                        .map_or(own_transit, |owners| owners.max(own_transit));
                    let quiet_after = clean_stop.map(|(at, _)| at);
                    let quiet = tx
                        .query_one(QUIET_SQL, &[&in_doubt_at, &transit, &quiet_after])
                        .await?;
                    if quiet.get(0) {
                        Forgot::Forgotten(because)
                    } else {
                        Forgot::MayStillArrive {
                            because,
                            after: quiet.get(1),
                            in_secs: quiet.get(2),
                            transit_ms: transit,
                        }
                    }
                }
                other => other,
            };
            let verdict = match verdict {
                Forgot::Forgotten(because) if dry_run => Forgot::WouldForget(because),
                other => other,
            };
            if let Forgot::Forgotten(because) = verdict {
                tx.execute(
                    "DELETE FROM idempotency_record WHERE account_id = $1 AND idempotency_key = $2",
                    &[&account.as_str(), &key],
                )
                .await?;
                let owner = because.owner().map(InstanceId::get);
                let outcome = serde_json::json!({
                    "idempotency_key": key,
                    "result": "forgotten",
                    "owner_instance": owner,
                    "owner_stopped": because.as_str(),
                    // What "running when the record was made" refers to (UTC).
                    "record_created": created,
                });
                tx.execute(
                    AUDIT_FORGET_SQL,
                    &[
                        &account.as_str(),
                        &because.reason(asked),
                        &outcome.to_string(),
                    ],
                )
                .await?;
            }
            tx.commit().await?;
            Ok(verdict)
        })
        .await
    }
}

/// What `forget_in_doubt` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forgot {
    Forgotten(Because),
    /// Asked as a dry run: it would have been forgotten now; nothing was changed.
    WouldForget(Because),
    /// The record is complete: the rail answered; nothing to forget.
    Completed,
    /// In flight and within its owner's own deadline: its forward may still be running.
    StillInFlight,
    /// The owning railguard process holds its instance lock: it is running (it may be paused
    /// mid-send, or still writing the request to a slow rail), whatever the operator said
    /// (`named`, not heard).
    OwnerMayStillSend {
        owner: InstanceId,
        named: Option<OwnerStopped>,
    },
    /// The owning process does not hold its lock, but nothing shows it has stopped: it may have
    /// crashed, or be paused with its database session lost. `created` is when the record was
    /// made (UTC); `named` what the operator said had stopped, if not the owner.
    OwnerNotSeenStopping {
        owner: InstanceId,
        created: String,
        named: Option<OwnerStopped>,
    },
    /// The record names no owner: a binary older than migration 0004 made it (at `created`,
    /// UTC) and recorded none, so nothing in the database shows whether the process that made
    /// it has stopped, and the operator did not say so.
    OwnerUnrecorded {
        created: String,
    },
    /// The owner is known to have stopped (`because`), but the request may still be on its way
    /// to the rail until `after` (UTC, the database's clock; `in_secs` from now): the record's
    /// in-doubt deadline plus `transit_ms` (`proxy.rail_transit_ms`), and not before a clean
    /// stop's `quiet_after`. The rail is to be asked only after that.
    MayStillArrive {
        because: Because,
        after: String,
        in_secs: i64,
        transit_ms: i64,
    },
    NotFound,
}

/// What the operator says has stopped, asking to forget a record in doubt
/// (`--owner-stopped`, `owner_stopped`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnerStopped {
    /// The railguard process of this instance: a record's owner, named in forget's answer and
    /// logged by that process when it started.
    Instance(InstanceId),
    /// Every railguard that was running when the record was made: for a record that names no
    /// owner (made by a binary older than migration 0004, which recorded none).
    Unrecorded,
}

impl std::str::FromStr for OwnerStopped {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        if text == "unrecorded" {
            return Ok(Self::Unrecorded);
        }
        text.parse::<i64>()
            .map(|n| Self::Instance(InstanceId::from_stored(n)))
            .map_err(|_| format!("{text:?} is neither an instance number nor \"unrecorded\""))
    }
}

impl std::fmt::Display for OwnerStopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Instance(instance) => write!(f, "{instance}"),
            Self::Unrecorded => f.write_str("unrecorded"),
        }
    }
}

/// Why a record could be forgotten: what shows its owner sends nothing more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Because {
    /// The record names no owner (made before owners were recorded), and the operator said
    /// every railguard running when it was made has stopped (`--owner-stopped unrecorded`).
    NoOwner,
    /// The owner recorded a clean stop, with nothing left to send.
    OwnerStoppedCleanly(InstanceId),
    /// The operator said the owner has stopped (`--owner-stopped`).
    OperatorSawOwnerStop(InstanceId),
}

impl Because {
    pub fn owner(self) -> Option<InstanceId> {
        match self {
            Self::NoOwner => None,
            Self::OwnerStoppedCleanly(owner) | Self::OperatorSawOwnerStop(owner) => Some(owner),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoOwner => "no_owner",
            Self::OwnerStoppedCleanly(_) => "stopped_cleanly",
            Self::OperatorSawOwnerStop(_) => "on_the_operators_word",
        }
    }

    /// The audit record's reason.
    fn reason(self, asked: Asked) -> &'static str {
        match (self, asked) {
            (_, Asked::RailLookup) => {
                "the rail's lookup by idempotency key found no payment (rail_lookup.path), \
                 and the owning railguard recorded a clean stop"
            }
            (Self::OwnerStoppedCleanly(_), Asked::Operator) => {
                "checked the rail's own records (railguard idempotency-forget)"
            }
            (Self::NoOwner, Asked::Operator) => {
                "checked the rail's own records, and saw every railguard running when the \
                 record was made stop (railguard idempotency-forget --owner-stopped unrecorded)"
            }
            (Self::OperatorSawOwnerStop(_), Asked::Operator) => {
                "checked the rail's own records, and saw the owning railguard process stop \
                 (railguard idempotency-forget --owner-stopped)"
            }
        }
    }
}

/// Who asked to forget a record: what its audit record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Asked {
    /// `railguard idempotency-forget`, after checking the rail.
    Operator,
    /// railguard itself, when the rail's lookup found no payment with the key (`resolve`).
    RailLookup,
}
