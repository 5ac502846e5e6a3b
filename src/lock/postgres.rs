//! The PostgreSQL lock backend (FR-11, C1 §1.3).
//!
//! **Acquire** is one statement: it inserts the key's row, or takes over a row whose lease has
//! expired (in the database's clock), and takes the token from `nextval('fencing_token_seq')`
//! in that same statement. The token is never read again: renew and release only compare it.
//!
//! **Why tokens of a key strictly increase (INV-04).** `nextval` hands out increasing values,
//! but the value is drawn *before* the row is locked: a backend that draws 10 and then stalls
//! could, after another acquirer drew 11 and its lease ran out, take the key with 10. So a
//! takeover also requires `e.token < EXCLUDED.token`, and rows are never deleted (release marks
//! them ended), so the guard always has the key's last token to compare with. A stale draw
//! finds the key "held", and the attempt is repeated with a fresh value.
//!
//! Expiry is decided by `clock_timestamp()` of the database, never by a client's clock, and
//! only ever costs liveness: the token decides safety (INV-07).
//!
//! **Renew and release** match on `(key, token, sha256(secret))`: only the acquirer knows the
//! secret (C2 §2.3). A miss is answered `Lost` whatever the reason, and classified afterwards
//! for the operator only: a secret that does not match the key's current grant is a probe
//! (`lock_rejected_secrets_total`). A release repeated after an answer was lost finds its own
//! grant already released and answers as the first would have.
//!
//! **An acquire whose answer is lost** (the database slower than `database.timeout_ms`, the
//! connection dropped after the commit, the caller gone) must not leave a grant nobody
//! received holding the key for its ttl. The attempt runs in a task of its own; unless its
//! grant is handed to the caller, an `Undelivered` guard revokes whatever it may have
//! committed, by the attempt's secret — which only that attempt's row can carry — once the
//! statement has finished (however long a paused server takes), and once more after the
//! server's `statement_timeout` would have ended it.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;

use super::service::LockMetrics;
use super::{
    Attempt, Grant, Inspection, LeaseSecret, LockBackend, LockError, LockKey, Released, Renewed,
};
use crate::token::FencingToken;

/// NOTIFY channel on which releases are announced, with the key as payload.
pub const RELEASE_CHANNEL: &str = "railguard_lock_released";

pub const ACQUIRE_SQL: &str = "\
INSERT INTO lock_entry AS e (key, holder, token, ttl_ms, granted_at, expires_at, secret_sha256)
VALUES ($1, $2, nextval('fencing_token_seq'), $3::bigint,
        clock_timestamp(), clock_timestamp() + $3::bigint * interval '1 millisecond', $4)
ON CONFLICT (key) DO UPDATE SET
    holder = EXCLUDED.holder,
    token = EXCLUDED.token,
    secret_sha256 = EXCLUDED.secret_sha256,
    ttl_ms = EXCLUDED.ttl_ms,
    granted_at = clock_timestamp(),
    expires_at = clock_timestamp() + EXCLUDED.ttl_ms * interval '1 millisecond',
    ended_at = NULL,
    released = false,
    took_over = NOT e.released,
    expiry_noticed_at_grant = NOT e.released AND e.ended_at IS NULL
WHERE e.expires_at <= clock_timestamp() AND e.token < EXCLUDED.token
RETURNING token,
          (extract(epoch FROM granted_at) * 1000000)::bigint,
          (extract(epoch FROM expires_at) * 1000000)::bigint,
          took_over,
          expiry_noticed_at_grant";

const HELD_SQL: &str = "\
SELECT ended_at IS NULL AND expires_at > clock_timestamp(),
       GREATEST(0, extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint
FROM lock_entry WHERE key = $1";

const RENEW_SQL: &str = "\
UPDATE lock_entry SET expires_at = clock_timestamp() + ttl_ms * interval '1 millisecond'
WHERE key = $1 AND token = $2 AND secret_sha256 = $3 AND ($4::text IS NULL OR holder = $4)
  AND ended_at IS NULL AND expires_at > clock_timestamp()
RETURNING (extract(epoch FROM expires_at) * 1000000)::bigint, ttl_ms";

pub const RELEASE_SQL: &str = "\
WITH ended AS (
    UPDATE lock_entry
    SET ended_at = clock_timestamp(), expires_at = clock_timestamp(), released = true
    WHERE key = $1 AND token = $2 AND secret_sha256 = $3 AND ($4::text IS NULL OR holder = $4)
      AND ended_at IS NULL AND expires_at > clock_timestamp()
    RETURNING key, ended_at)
SELECT pg_notify('railguard_lock_released', key)::text,
       (extract(epoch FROM ended_at) * 1000000)::bigint
FROM ended";

/// After a renew or release matched nothing: notes the expiry of the caller's own grant if
/// it ran out and was not yet taken over (once, so that the takeover does not count it
/// again); says whether the secret failed to match the key's current grant (a probe); and
/// finds the caller's own grant already released (a repeated release); and whether the
/// token and secret matched a grant whose holder is another identity than the caller `$4`.
const MISSED_SQL: &str = "\
WITH noticed AS (
    UPDATE lock_entry SET ended_at = expires_at
    WHERE key = $1 AND token = $2 AND secret_sha256 = $3 AND ($4::text IS NULL OR holder = $4)
      AND ended_at IS NULL AND expires_at <= clock_timestamp()
    RETURNING 1)
SELECT (SELECT count(*) FROM noticed),
       COALESCE((SELECT token = $2 AND secret_sha256 IS DISTINCT FROM $3
                 FROM lock_entry WHERE key = $1), false),
       (SELECT (extract(epoch FROM ended_at) * 1000000)::bigint FROM lock_entry
        WHERE key = $1 AND token = $2 AND secret_sha256 = $3 AND released
          AND ($4::text IS NULL OR holder = $4)),
       COALESCE((SELECT $4::text IS NOT NULL AND holder IS DISTINCT FROM $4
                 FROM lock_entry WHERE key = $1 AND token = $2 AND secret_sha256 = $3), false)";

/// Ends whatever live grant an acquire attempt with this secret made (see [`Undelivered`]).
const REVOKE_SQL: &str = "\
WITH ended AS (
    UPDATE lock_entry
    SET ended_at = clock_timestamp(), expires_at = clock_timestamp(), released = true
    WHERE key = $1 AND secret_sha256 = $2 AND ended_at IS NULL
    RETURNING key)
SELECT pg_notify('railguard_lock_released', key)::text FROM ended";

const INSPECT_SQL: &str = "\
SELECT holder,
       ended_at IS NULL AND expires_at > clock_timestamp(),
       GREATEST(0, extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint,
       (extract(epoch FROM clock_timestamp() - granted_at) * 1000)::bigint
FROM lock_entry WHERE key = $1";

/// How many fresh tokens one acquire may draw when its draw turned out stale.
const STALE_DRAW_RETRIES: usize = 3;

#[derive(Clone)]
pub struct PgLocks {
    pool: Pool,
    timeout: Duration,
    metrics: Arc<LockMetrics>,
}

impl PgLocks {
    pub fn new(pool: Pool, timeout: Duration, metrics: Arc<LockMetrics>) -> Self {
        Self {
            pool,
            timeout,
            metrics,
        }
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, LockError> {
        self.pool
            .get()
            .await
            .map_err(|e| LockError::Unavailable(e.to_string()))
    }

    /// Runs `work` within the backend timeout, mapping every database failure to
    /// `Unavailable`: the caller learns nothing was decided.
    async fn bounded<T>(
        &self,
        work: impl Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        tokio::time::timeout(self.timeout, work)
            .await
            .unwrap_or_else(|_| {
                Err(LockError::Unavailable(format!(
                    "no answer within {:?}",
                    self.timeout
                )))
            })
    }

    /// Classifies a renew or release that matched nothing; returns when the caller's own grant
    /// was released, if it was. The caller is told `Lost` either way.
    async fn missed(
        &self,
        client: &deadpool_postgres::Object,
        key: &LockKey,
        token: FencingToken,
        digest: &[u8],
        caller: Option<&str>,
    ) -> Result<Option<i64>, LockError> {
        let row = client
            .query_one(MISSED_SQL, &[&key.as_str(), &token.get(), &digest, &caller])
            .await
            .map_err(db)?;
        if row.get::<_, bool>(3) {
            tracing::warn!(lock.key = %key, caller,
                "a renew or release presented the grant of another identity");
            return Err(LockError::OtherHolder);
        }
        if row.get::<_, i64>(0) > 0 {
            self.metrics.expiries.inc();
        }
        if row.get::<_, bool>(1) {
            self.metrics.rejected_secrets.inc();
            tracing::warn!(lock.key = %key,
                "a renew or release named the key's current grant with the wrong lease secret");
        }
        Ok(row.get(2))
    }

    /// One acquire attempt, as its own task's work. The error says whether the statement may
    /// have committed before it failed.
    async fn attempt(
        &self,
        key: &LockKey,
        holder: &str,
        ttl: Duration,
        secret: LeaseSecret,
    ) -> Result<Attempt, (LockError, bool)> {
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        let digest = secret.digest();
        let client = self.client().await.map_err(|e| (e, false))?;
        let acquire = client
            .prepare_cached(ACQUIRE_SQL)
            .await
            .map_err(|e| (db(e), false))?;
        for _ in 0..STALE_DRAW_RETRIES {
            let rows = client
                .query(
                    &acquire,
                    &[&key.as_str(), &holder, &ttl_ms, &digest.as_slice()],
                )
                .await
                .map_err(|e| (db(e), true))?;
            if let Some(row) = rows.first() {
                let token = FencingToken::new(row.get(0))
                    .expect("fencing_token_seq yields positive values");
                let noticed: bool = row.get(4);
                if noticed {
                    self.metrics.expiries.inc();
                }
                return Ok(Attempt::Granted(Grant {
                    key: key.clone(),
                    holder: holder.to_string(),
                    token,
                    secret,
                    ttl,
                    granted_at_us: row.get(1),
                    expires_at_us: row.get(2),
                    took_over: row.get(3),
                }));
            }
            let held = client
                .query_opt(HELD_SQL, &[&key.as_str()])
                .await
                .map_err(|e| (db(e), false))?;
            match held {
                Some(row) if row.get::<_, bool>(0) => {
                    let remaining: i64 = row.get(1);
                    return Ok(Attempt::Held {
                        retry_in: Some(Duration::from_millis(remaining.max(0) as u64)),
                    });
                }
                // Free, yet not ours: our draw was older than the key's last token, or
                // the key was freed between the two statements. Draw again.
                _ => continue,
            }
        }
        Ok(Attempt::Held { retry_in: None })
    }

    /// Ends the grant an attempt with `digest` may have made; true if there was one.
    async fn revoke(&self, key: &LockKey, digest: &[u8]) -> Result<bool, LockError> {
        self.bounded(async {
            let client = self.client().await?;
            let rows = client
                .query(REVOKE_SQL, &[&key.as_str(), &digest])
                .await
                .map_err(db)?;
            Ok(!rows.is_empty())
        })
        .await
    }
}

/// The PostgreSQL backend's acquire session: empty. Nothing outlives an attempt here — each
/// attempt's possible grant is guarded by its own `Undelivered`, and there is no lease to
/// carry from one attempt to the next.
#[derive(Debug, Default)]
pub struct PgSession;

/// Revokes, when dropped armed, whatever grant one acquire attempt may have committed: its
/// answer did not reach the caller (timeout, error, or the caller gone), so nobody holds it.
struct Undelivered {
    locks: PgLocks,
    key: LockKey,
    digest: [u8; 32],
    /// The lease the attempt asked for: how long a late grant would hold the key.
    ttl: Duration,
    attempt: Option<tokio::task::JoinHandle<Result<Attempt, (LockError, bool)>>>,
    armed: bool,
}

impl Drop for Undelivered {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (locks, key, digest, ttl) =
            (self.locks.clone(), self.key.clone(), self.digest, self.ttl);
        let attempt = self.attempt.take();
        tokio::spawn(async move {
            // Whatever the statement commits, it commits before its task ends: a server that
            // is paused (not gone) keeps the connection open and may commit minutes later, so
            // there is no timeout here. Then revoke; and once more a statement_timeout later,
            // for a statement that was still on its way when the connection died. A grant
            // committed at the end of the task lasts `ttl` from then, so revoking is retried
            // for that long before it is moot.
            if let Some(attempt) = attempt {
                let _ = attempt.await;
            }
            let ended = tokio::time::Instant::now();
            for round in 0..2 {
                if round == 1 {
                    tokio::time::sleep(locks.timeout * 2).await;
                }
                let mut pause = Duration::from_millis(100);
                let outcome = loop {
                    match locks.revoke(&key, &digest).await {
                        Ok(revoked) => break Some(revoked),
                        Err(e) if ended.elapsed() > ttl + locks.timeout * 2 => {
                            tracing::error!(lock.key = %key, error = %e,
                                "could not revoke a grant nobody received before its lease ran out");
                            break None;
                        }
                        Err(_) => {
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(Duration::from_secs(2));
                        }
                    }
                };
                if outcome == Some(true) {
                    locks.metrics.revoked_undelivered.inc();
                    tracing::warn!(lock.key = %key,
                        "revoked a grant whose acquire answer never reached its caller");
                }
            }
        });
    }
}

fn db(e: tokio_postgres::Error) -> LockError {
    match e.as_db_error() {
        Some(db) => {
            tracing::error!(
                code = db.code().code(),
                message = db.message(),
                "lock statement failed"
            );
            LockError::Unavailable(format!(
                "database error {}: {}",
                db.code().code(),
                db.message()
            ))
        }
        None => LockError::Unavailable(e.to_string()),
    }
}

use std::future::Future;

impl LockBackend for PgLocks {
    type Session = PgSession;

    fn name(&self) -> &'static str {
        "postgres"
    }

    fn session(&self) -> PgSession {
        PgSession
    }

    async fn try_acquire(
        &self,
        _session: &mut PgSession,
        key: &LockKey,
        holder: &str,
        ttl: Duration,
    ) -> Result<Attempt, LockError> {
        let secret = LeaseSecret::generate();
        let digest = secret.digest();
        let attempt = {
            let (locks, key, holder) = (self.clone(), key.clone(), holder.to_string());
            tokio::spawn(async move { locks.attempt(&key, &holder, ttl, secret).await })
        };
        let mut guard = Undelivered {
            locks: self.clone(),
            key: key.clone(),
            digest,
            ttl,
            attempt: Some(attempt),
            armed: true,
        };
        let waiting = guard.attempt.as_mut().expect("just set");
        let answer = tokio::time::timeout(self.timeout, waiting).await;
        if answer.is_ok() {
            guard.attempt = None; // finished: a JoinHandle is awaited once
        }
        let outcome = match answer {
            Err(_) => Err(LockError::Unavailable(format!(
                "no answer within {:?}; nothing was granted (anything the late statement \
                 commits is revoked)",
                self.timeout
            ))),
            Ok(Err(panicked)) => Err(LockError::Unavailable(format!(
                "acquire attempt failed: {panicked}"
            ))),
            Ok(Ok(Err((error, maybe_committed)))) => {
                guard.armed = maybe_committed;
                Err(error)
            }
            Ok(Ok(Ok(attempt))) => {
                // Handed to the caller: from here the grant is the caller's to release.
                guard.armed = false;
                Ok(attempt)
            }
        };
        drop(guard);
        outcome
    }

    async fn renew(
        &self,
        key: &LockKey,
        token: FencingToken,
        secret: &LeaseSecret,
        caller: Option<&str>,
    ) -> Result<Renewed, LockError> {
        let digest = secret.digest();
        self.bounded(async {
            let client = self.client().await?;
            let renew = client.prepare_cached(RENEW_SQL).await.map_err(db)?;
            match client
                .query_opt(
                    &renew,
                    &[&key.as_str(), &token.get(), &digest.as_slice(), &caller],
                )
                .await
                .map_err(db)?
            {
                Some(row) => {
                    let ttl_ms: i64 = row.get(1);
                    Ok(Renewed {
                        expires_at_us: row.get(0),
                        ttl: Duration::from_millis(ttl_ms as u64),
                    })
                }
                None => {
                    self.missed(&client, key, token, &digest, caller).await?;
                    Err(LockError::Lost)
                }
            }
        })
        .await
    }

    async fn release(
        &self,
        key: &LockKey,
        token: FencingToken,
        secret: &LeaseSecret,
        caller: Option<&str>,
    ) -> Result<Released, LockError> {
        let digest = secret.digest();
        self.bounded(async {
            let client = self.client().await?;
            let release = client.prepare_cached(RELEASE_SQL).await.map_err(db)?;
            let rows = client
                .query(
                    &release,
                    &[&key.as_str(), &token.get(), &digest.as_slice(), &caller],
                )
                .await
                .map_err(db)?;
            match rows.first() {
                Some(row) => Ok(Released {
                    at_us: row.get(1),
                    revision: None,
                }),
                // Released already, by an earlier attempt of this same release whose answer
                // was lost: the outcome the caller asked for.
                None => match self.missed(&client, key, token, &digest, caller).await? {
                    Some(at_us) => Ok(Released {
                        at_us,
                        revision: None,
                    }),
                    None => Err(LockError::Lost),
                },
            }
        })
        .await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Inspection, LockError> {
        self.bounded(async {
            let client = self.client().await?;
            let row = client
                .query_opt(INSPECT_SQL, &[&key.as_str()])
                .await
                .map_err(db)?;
            Ok(match row {
                Some(row) if row.get::<_, bool>(1) => Inspection {
                    key: key.to_string(),
                    held: true,
                    holder: Some(row.get(0)),
                    lease_remaining_ms: Some(row.get(2)),
                    grant_age_ms: Some(row.get(3)),
                },
                _ => Inspection {
                    key: key.to_string(),
                    held: false,
                    holder: None,
                    lease_remaining_ms: None,
                    grant_age_ms: None,
                },
            })
        })
        .await
    }
}

/// Listens for release notifications and passes each released key to `on_release`. Runs
/// until the process ends, reconnecting with backoff; after every (re)connect it calls
/// `on_reconnect`, since releases announced while it was away were missed. Its session is on a
/// server that takes writes — the one releases are announced on — opened as every other
/// session is (`db::establish`, `timeout`: `database.timeout_ms`), and checked every 5 s
/// (`db::still_primary`): a paused server, or a path that holds its packets, leaves the
/// session open and silent, and releases unheard — waiters fall back on their own polls
/// (`lock.poll_interval_ms`) — until the check moves the listener to a server that answers.
/// `NOTIFY` is not replicated, so a session on a standby would hear nothing either.
pub async fn listen_for_releases(
    url: String,
    timeout: Duration,
    on_release: impl Fn(&str) + Send + 'static,
    on_reconnect: impl Fn() + Send + 'static,
) {
    use futures_util::StreamExt;
    let mut backoff = Duration::from_millis(100);
    loop {
        // TLS as the URL asks (`tls::postgres`); a URL that cannot be used is retried like
        // a failed connect, and logged.
        let connected = match crate::db::pg_config(&url, timeout) {
            Ok(mut c) => {
                c.config
                    .target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
                crate::db::establish(&c.config, c.tls)
                    .await
                    .map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
        };
        match connected {
            Ok((client, mut connection)) => {
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                let driver = tokio::spawn(async move {
                    let mut messages =
                        futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
                    while let Some(message) = messages.next().await {
                        match message {
                            Ok(tokio_postgres::AsyncMessage::Notification(n)) => {
                                let _ = tx.send(n.payload().to_string());
                            }
                            Ok(_) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, "lock release listener connection failed");
                                break;
                            }
                        }
                    }
                });
                let statement = format!("LISTEN {RELEASE_CHANNEL}");
                let listen = client.batch_execute(&statement);
                if let Ok(Ok(())) = tokio::time::timeout(timeout, listen).await {
                    backoff = Duration::from_millis(100);
                    on_reconnect();
                    let mut check = tokio::time::interval(crate::db::SESSION_CHECK);
                    check.tick().await;
                    loop {
                        tokio::select! {
                            key = rx.recv() => match key {
                                Some(key) => on_release(&key),
                                None => break,
                            },
                            _ = check.tick() => {
                                if let Err(why) = crate::db::still_primary(&client, timeout).await {
                                    tracing::warn!(
                                        "lock release listener: {why}; reconnecting (waiters \
                                         poll meanwhile)"
                                    );
                                    break;
                                }
                            }
                        }
                    }
                }
                driver.abort();
            }
            Err(e) => tracing::debug!(error = %e, "lock release listener cannot connect"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}
