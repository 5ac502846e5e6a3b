//! The fenced UPDATE for a worker's own database (C1 §1.6, FR-15).
//!
//! ```sql
//! UPDATE account SET balance = balance - $3, fence = $1 WHERE id = $2 AND fence <= $1
//! ```
//!
//! The row remembers the highest token that wrote it; a write with a lower token matches no row
//! and is reported as fenced out. Equal tokens are the same grant and are accepted — the same
//! rule as the proxy's. The table needs a `bigint NOT NULL` fence column (default 0).
//!
//! The kill switch (C5 §5.2) is [`Fencing::Off`]: it drops the `fence <= token` condition so
//! that a stale writer's UPDATE goes through. It exists only to demonstrate that corruption;
//! using it logs a loud warning every time.

use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use super::LockHandle;

/// Whether the fence condition is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fencing {
    Enforced,
    /// The kill switch: demonstration only.
    Off,
}

#[derive(Debug, thiserror::Error)]
pub enum PayDbError {
    #[error("fenced out: row {id} was written by a newer grant than token {token}")]
    FencedOut { id: String, token: i64 },
    #[error("no row {id} in {table}")]
    NotFound { table: String, id: String },
    #[error("identifier {0:?} is not a plain SQL identifier")]
    BadIdentifier(String),
    #[error("database error: {0}")]
    Database(#[from] tokio_postgres::Error),
}

/// A fenced UPDATE of one row of one table.
#[derive(Debug, Clone)]
pub struct FencedUpdate {
    table: String,
    id_column: String,
    fence_column: String,
    fencing: Fencing,
}

fn identifier(name: &str) -> Result<String, PayDbError> {
    let plain = !name.is_empty()
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if plain {
        Ok(name.to_string())
    } else {
        Err(PayDbError::BadIdentifier(name.to_string()))
    }
}

impl FencedUpdate {
    /// Updates rows of `table` by `id`, fenced by the `fence` column.
    pub fn new(table: &str) -> Result<Self, PayDbError> {
        Ok(Self {
            table: identifier(table)?,
            id_column: "id".into(),
            fence_column: "fence".into(),
            fencing: Fencing::Enforced,
        })
    }

    pub fn columns(mut self, id_column: &str, fence_column: &str) -> Result<Self, PayDbError> {
        self.id_column = identifier(id_column)?;
        self.fence_column = identifier(fence_column)?;
        Ok(self)
    }

    pub fn fencing(mut self, fencing: Fencing) -> Self {
        self.fencing = fencing;
        self
    }

    /// The statement for `set` (for example `"balance = balance - $3"`; `$1` is the token,
    /// `$2` the id, the caller's parameters start at `$3`).
    pub fn sql(&self, set: &str) -> String {
        let (table, id, fence) = (&self.table, &self.id_column, &self.fence_column);
        match self.fencing {
            Fencing::Enforced => {
                format!("UPDATE {table} SET {set}, {fence} = $1 WHERE {id} = $2 AND {fence} <= $1")
            }
            Fencing::Off => format!(
                "UPDATE {table} SET {set}, {fence} = GREATEST({fence}, $1::bigint) WHERE {id} = $2"
            ),
        }
    }

    /// Runs the fenced UPDATE of row `id` under `grant`'s token. `FencedOut` when a newer grant
    /// has written the row; `NotFound` when there is no such row.
    pub async fn execute(
        &self,
        client: &impl GenericClient,
        grant: &LockHandle,
        id: &(dyn ToSql + Sync),
        set: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<(), PayDbError> {
        if self.fencing == Fencing::Off {
            tracing::warn!(table = %self.table, lock.token = grant.token().get(),
                "PAYDB FENCING IS OFF: this UPDATE is not fenced and a stale writer can overwrite newer data");
        }
        let token = grant.token().get();
        let mut all: Vec<&(dyn ToSql + Sync)> = vec![&token, id];
        all.extend_from_slice(params);
        let updated = client.execute(&self.sql(set), &all).await?;
        if updated > 0 {
            return Ok(());
        }
        let exists_sql = format!("SELECT 1 FROM {} WHERE {} = $1", self.table, self.id_column);
        let id_text = format!("{id:?}");
        if client.query_opt(&exists_sql, &[id]).await?.is_none() {
            return Err(PayDbError::NotFound {
                table: self.table.clone(),
                id: id_text,
            });
        }
        Err(PayDbError::FencedOut { id: id_text, token })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_the_c1_6_statement() {
        let update = FencedUpdate::new("account").unwrap();
        assert_eq!(
            update.sql("balance = balance - $3"),
            "UPDATE account SET balance = balance - $3, fence = $1 WHERE id = $2 AND fence <= $1"
        );
    }

    #[test]
    fn refuses_identifiers_that_are_not_plain() {
        assert!(FencedUpdate::new("account; DROP TABLE x").is_err());
        assert!(FencedUpdate::new("Account").is_err());
        assert!(FencedUpdate::new("").is_err());
        assert!(
            FencedUpdate::new("account")
                .unwrap()
                .columns("id", "fence\"")
                .is_err()
        );
    }
}
