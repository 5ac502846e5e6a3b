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

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;

use super::service::LockMetrics;
use super::{Attempt, Grant, Inspection, LockBackend, LockError, LockKey, Released, Renewed};
use crate::token::FencingToken;

/// NOTIFY channel on which releases are announced, with the key as payload.
pub const RELEASE_CHANNEL: &str = "railguard_lock_released";

pub const ACQUIRE_SQL: &str = "\
INSERT INTO lock_entry AS e (key, holder, token, ttl_ms, granted_at, expires_at)
VALUES ($1, $2, nextval('fencing_token_seq'), $3::bigint,
        clock_timestamp(), clock_timestamp() + $3::bigint * interval '1 millisecond')
ON CONFLICT (key) DO UPDATE SET
    holder = EXCLUDED.holder,
    token = EXCLUDED.token,
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
WHERE key = $1 AND token = $2 AND ended_at IS NULL AND expires_at > clock_timestamp()
RETURNING (extract(epoch FROM expires_at) * 1000000)::bigint, ttl_ms";

pub const RELEASE_SQL: &str = "\
WITH ended AS (
    UPDATE lock_entry
    SET ended_at = clock_timestamp(), expires_at = clock_timestamp(), released = true
    WHERE key = $1 AND token = $2 AND ended_at IS NULL AND expires_at > clock_timestamp()
    RETURNING key, ended_at)
SELECT pg_notify('railguard_lock_released', key)::text,
       (extract(epoch FROM ended_at) * 1000000)::bigint
FROM ended";

/// A late renew or release found its own grant expired and not yet taken over: note the
/// expiry now (once), so that the takeover that follows does not count it again.
const NOTICE_EXPIRY_SQL: &str = "\
UPDATE lock_entry SET ended_at = expires_at
WHERE key = $1 AND token = $2 AND ended_at IS NULL AND expires_at <= clock_timestamp()";

const INSPECT_SQL: &str = "\
SELECT holder,
       ended_at IS NULL AND expires_at > clock_timestamp(),
       GREATEST(0, extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint,
       (extract(epoch FROM clock_timestamp() - granted_at) * 1000)::bigint
FROM lock_entry WHERE key = $1";

/// How many fresh tokens one acquire may draw when its draw turned out stale.
const STALE_DRAW_RETRIES: usize = 3;

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

    async fn notice_expiry(
        &self,
        client: &deadpool_postgres::Object,
        key: &LockKey,
        token: FencingToken,
    ) {
        if let Ok(1) = client
            .execute(NOTICE_EXPIRY_SQL, &[&key.as_str(), &token.get()])
            .await
        {
            self.metrics.expiries.inc();
        }
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
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn try_acquire(
        &self,
        key: &LockKey,
        holder: &str,
        ttl: Duration,
    ) -> Result<Attempt, LockError> {
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        self.bounded(async {
            let client = self.client().await?;
            let acquire = client.prepare_cached(ACQUIRE_SQL).await.map_err(db)?;
            for _ in 0..STALE_DRAW_RETRIES {
                let rows = client
                    .query(&acquire, &[&key.as_str(), &holder, &ttl_ms])
                    .await
                    .map_err(db)?;
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
                        ttl,
                        granted_at_us: row.get(1),
                        expires_at_us: row.get(2),
                        took_over: row.get(3),
                    }));
                }
                let held = client
                    .query_opt(HELD_SQL, &[&key.as_str()])
                    .await
                    .map_err(db)?;
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
        })
        .await
    }

    async fn renew(&self, key: &LockKey, token: FencingToken) -> Result<Renewed, LockError> {
        self.bounded(async {
            let client = self.client().await?;
            let renew = client.prepare_cached(RENEW_SQL).await.map_err(db)?;
            match client
                .query_opt(&renew, &[&key.as_str(), &token.get()])
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
                    self.notice_expiry(&client, key, token).await;
                    Err(LockError::Lost)
                }
            }
        })
        .await
    }

    async fn release(&self, key: &LockKey, token: FencingToken) -> Result<Released, LockError> {
        self.bounded(async {
            let client = self.client().await?;
            let release = client.prepare_cached(RELEASE_SQL).await.map_err(db)?;
            let rows = client
                .query(&release, &[&key.as_str(), &token.get()])
                .await
                .map_err(db)?;
            match rows.first() {
                Some(row) => Ok(Released {
                    at_us: row.get(1),
                    revision: None,
                }),
                None => {
                    self.notice_expiry(&client, key, token).await;
                    Err(LockError::Lost)
                }
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
/// `on_reconnect`, since releases announced while it was away were missed.
pub async fn listen_for_releases(
    url: String,
    on_release: impl Fn(&str) + Send + 'static,
    on_reconnect: impl Fn() + Send + 'static,
) {
    use futures_util::StreamExt;
    let mut backoff = Duration::from_millis(100);
    loop {
        match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
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
                if client
                    .batch_execute(&format!("LISTEN {RELEASE_CHANNEL}"))
                    .await
                    .is_ok()
                {
                    backoff = Duration::from_millis(100);
                    on_reconnect();
                    while let Some(key) = rx.recv().await {
                        on_release(&key);
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
