//! The workload's own database: accounts, the payments to make, and a write log.
//!
//! `account(id, balance, fence)` is fenced with the SDK's [`FencedUpdate`] (C1 §1.6).
//! `payment(id, account, amount, state)` rows are created up front; a worker *claims* one
//! (`pending`/`submitting` → `submitting`, fenced by the account row) before sending it and
//! *completes* it (`done`, balance moved, fenced) after the rail answered. A trigger appends
//! every UPDATE of an account row to `account_write`; the row lock orders those appends, so
//! the log is the order in which paydb accepted writes — the checker's view of INV-05 here.

use railguard_sdk::LockHandle;
use railguard_sdk::paydb::{FencedUpdate, PayDbError};
use tokio_postgres::{Client, NoTls};

use crate::check::{AccountWrite, PaymentRow};

const SCHEMA: &str = "
CREATE TABLE account (
    id           text   PRIMARY KEY,
    balance      bigint NOT NULL,
    fence        bigint NOT NULL DEFAULT 0,
    -- The writer's own grant and submit, declared by the harness worker for the checker.
    last_grant   bigint,
    last_attempt text
);
CREATE TABLE payment (
    id       text    PRIMARY KEY,
    account  text    NOT NULL REFERENCES account,
    amount   bigint  NOT NULL,
    state    text    NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'submitting', 'done')),
    attempts integer NOT NULL DEFAULT 0,
    claimed_at timestamptz,
    -- The grant's token of the payment's first claim: its retries send it as
    -- Idempotency-First-Token.
    first_token bigint
);
CREATE INDEX payment_todo ON payment (account, state, id) WHERE state <> 'done';
CREATE TABLE account_write (
    seq         bigserial PRIMARY KEY,
    account     text   NOT NULL,
    fence       bigint NOT NULL,
    grant_token bigint,
    attempt     text
);
CREATE FUNCTION log_account_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO account_write (account, fence, grant_token, attempt)
    VALUES (NEW.id, NEW.fence, NEW.last_grant, NEW.last_attempt);
    RETURN NEW;
END $$;
CREATE TRIGGER account_write AFTER UPDATE ON account FOR EACH ROW EXECUTE FUNCTION log_account_write();
";

pub const INITIAL_BALANCE: i64 = 1_000_000;

pub fn account_id(i: usize) -> String {
    format!("acct-{i}")
}

pub async fn connect(url: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// Creates the schema and `payments` payments spread over `accounts` accounts.
pub async fn create(client: &Client, accounts: usize, payments: usize) -> Result<(), String> {
    client
        .batch_execute(SCHEMA)
        .await
        .map_err(|e| format!("paydb schema: {e}"))?;
    let ids: Vec<String> = (0..accounts).map(account_id).collect();
    client
        .execute(
            "INSERT INTO account (id, balance) SELECT unnest($1::text[]), $2",
            &[&ids, &INITIAL_BALANCE],
        )
        .await
        .map_err(|e| format!("paydb accounts: {e}"))?;
    let (mut pay_ids, mut pay_accounts, mut amounts) = (Vec::new(), Vec::new(), Vec::new());
    for p in 0..payments {
        let account = p % accounts.max(1);
        pay_ids.push(format!("p-{account}-{p}"));
        pay_accounts.push(account_id(account));
        amounts.push(1 + (p as i64 % 97));
    }
    client
        .execute(
            "INSERT INTO payment (id, account, amount) \
             SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])",
            &[&pay_ids, &pay_accounts, &amounts],
        )
        .await
        .map_err(|e| format!("paydb payments: {e}"))?;
    Ok(())
}

/// A payment to work on: a fresh one, or an unresolved one (claimed by a grant that never
/// completed it) once its claim is older than `retry_after` — as a job queue's visibility
/// timeout gives a possibly running attempt time to finish. Unresolved ones come first when
/// `retry_first`. A stale holder that wakes within `retry_after` finds newer grants' payments
/// at the rail (the fence answers); one that wakes later finds its own payment retried
/// (idempotency keys answer) — both are the T-042 moment.
pub async fn next_payment(
    client: &Client,
    account: &str,
    retry_first: bool,
    retry_after: std::time::Duration,
) -> Result<Option<(String, i64)>, tokio_postgres::Error> {
    let retry_after_ms = retry_after.as_millis() as f64;
    let row = client
        .query_opt(
            "SELECT id, amount FROM payment WHERE account = $1 AND (state = 'pending' \
               OR (state = 'submitting' \
                   AND claimed_at < clock_timestamp() - $3 * interval '1 millisecond')) \
             ORDER BY (state = 'submitting') = $2 DESC, id LIMIT 1",
            &[&account, &retry_first, &retry_after_ms],
        )
        .await?;
    Ok(row.map(|r| (r.get(0), r.get(1))))
}

pub async fn remaining(client: &Client) -> Result<i64, tokio_postgres::Error> {
    Ok(client
        .query_one("SELECT count(*) FROM payment WHERE state <> 'done'", &[])
        .await?
        .get(0))
}

/// The token a paydb write presents: the grant's own (always, but for the `reread` control).
#[derive(Debug, Clone, Copy)]
pub enum Presented<'a> {
    Grant(&'a LockHandle),
    /// The §A2.3 bug: a token re-read from the lock backend at write time.
    Reread(i64),
}

/// Why a paydb write did not happen.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("fenced out")]
    FencedOut,
    #[error("the payment is already done")]
    AlreadyDone,
    #[error("{0}")]
    Database(String),
}

impl From<tokio_postgres::Error> for WriteError {
    fn from(e: tokio_postgres::Error) -> Self {
        WriteError::Database(e.to_string())
    }
}

/// The fenced UPDATE of the account row, through the SDK for a grant's own token and by the
/// same statement for a re-read one.
async fn fence_account(
    tx: &tokio_postgres::Transaction<'_>,
    account: &str,
    presented: Presented<'_>,
    own: i64,
    attempt: &str,
    set: &str,
    extra: Option<i64>,
) -> Result<(), WriteError> {
    let update = FencedUpdate::new("account").expect("a plain table name");
    let set = format!("{set}last_grant = $3, last_attempt = $4");
    let amount = extra.unwrap_or(0);
    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = if extra.is_some() {
        vec![&own, &attempt, &amount]
    } else {
        vec![&own, &attempt]
    };
    match presented {
        Presented::Grant(handle) => {
            match update.execute(tx, handle, &account, &set, &params).await {
                Ok(()) => Ok(()),
                Err(PayDbError::FencedOut { .. }) => Err(WriteError::FencedOut),
                Err(e) => Err(WriteError::Database(e.to_string())),
            }
        }
        Presented::Reread(token) => {
            let mut all: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&token, &account];
            all.extend(params);
            let n = tx.execute(&update.sql(&set), &all).await?;
            if n == 0 {
                return Err(WriteError::FencedOut);
            }
            Ok(())
        }
    }
}

/// Claims `payment` for the grant: fenced by the account row (unless `presented` is `None`: a
/// worker that fences only at the proxy), in one transaction. Returns the token of the
/// payment's first claim (this one's, the first time).
pub async fn claim(
    client: &mut Client,
    account: &str,
    payment: &str,
    presented: Option<Presented<'_>>,
    own: i64,
    attempt: &str,
) -> Result<i64, WriteError> {
    let tx = client.transaction().await?;
    if let Some(presented) = presented {
        fence_account(&tx, account, presented, own, attempt, "", None).await?;
    }
    let Some(row) = tx
        .query_opt(
            "UPDATE payment SET state = 'submitting', attempts = attempts + 1, \
             claimed_at = clock_timestamp(), first_token = COALESCE(first_token, $2) \
             WHERE id = $1 AND state <> 'done' RETURNING first_token",
            &[&payment, &own],
        )
        .await?
    else {
        return Err(WriteError::AlreadyDone);
    };
    tx.commit().await?;
    Ok(row.get(0))
}

/// Records `payment` as done and moves the balance, fenced, in one transaction.
pub async fn complete(
    client: &mut Client,
    account: &str,
    payment: &str,
    presented: Option<Presented<'_>>,
    own: i64,
    attempt: &str,
) -> Result<(), WriteError> {
    let tx = client.transaction().await?;
    let Some(row) = tx
        .query_opt(
            "UPDATE payment SET state = 'done' WHERE id = $1 AND state <> 'done' RETURNING amount",
            &[&payment],
        )
        .await?
    else {
        return Err(WriteError::AlreadyDone);
    };
    let amount: i64 = row.get(0);
    if let Some(presented) = presented {
        fence_account(
            &tx,
            account,
            presented,
            own,
            attempt,
            "balance = balance - $5, ",
            Some(amount),
        )
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

pub async fn account_writes(client: &Client) -> Result<Vec<AccountWrite>, tokio_postgres::Error> {
    Ok(client
        .query(
            "SELECT seq, account, fence, grant_token, attempt FROM account_write ORDER BY seq",
            &[],
        )
        .await?
        .iter()
        .map(|r| AccountWrite {
            seq: r.get(0),
            account: r.get(1),
            fence: r.get(2),
            grant_token: r.get(3),
            attempt: r.get(4),
        })
        .collect())
}

pub async fn payments(client: &Client) -> Result<Vec<PaymentRow>, tokio_postgres::Error> {
    Ok(client
        .query(
            "SELECT id, account, state, attempts FROM payment ORDER BY id",
            &[],
        )
        .await?
        .iter()
        .map(|r| PaymentRow {
            id: r.get(0),
            account: r.get(1),
            state: r.get(2),
            attempts: r.get(3),
        })
        .collect())
}

/// Balance moved against the amounts of the payments marked done: equal in any run where
/// completion is fenced (each payment is completed once).
pub async fn balance_check(client: &Client) -> Result<(i64, i64), tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT (SELECT coalesce(sum($1 - balance), 0)::bigint FROM account), \
                    (SELECT coalesce(sum(amount), 0)::bigint FROM payment WHERE state = 'done')",
            &[&INITIAL_BALANCE],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}
