//! Reading a value or a column straight from PostgreSQL, for a test's assertions: a failed
//! query fails the test, naming the statement.

use tokio_postgres::Client;
use tokio_postgres::types::{FromSqlOwned, ToSql};

/// The first column of the one row `sql` returns.
pub async fn one<T: FromSqlOwned>(client: &Client, sql: &str, params: &[&(dyn ToSql + Sync)]) -> T {
    client
        .query_one(sql, params)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

/// The first column of every row `sql` returns, in their order.
pub async fn column<T: FromSqlOwned>(
    client: &Client,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Vec<T> {
    client
        .query(sql, params)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .iter()
        .map(|row| row.get(0))
        .collect()
}
