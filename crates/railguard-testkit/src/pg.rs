//! Throwaway PostgreSQL clusters: initialised into a temp dir, on a free loopback port, and
//! at a test's mercy — stop, kill, pause (SIGSTOP) and restart are the point.

use tempfile::TempDir;

use railguard::db::{Access, PostgresServer, ServerOptions};

use crate::free_loopback_port;

/// A throwaway PostgreSQL cluster.
pub struct Pg {
    pub server: PostgresServer,
    _dir: TempDir,
}

impl Pg {
    pub async fn start() -> Pg {
        let dir = tempfile::Builder::new()
            .prefix("railguard-pg-")
            .tempdir()
            .expect("temp dir");
        let options = ServerOptions {
            data_dir: dir.path().join("data"),
            port: free_loopback_port(),
            durable: false,
            access: Access::Loopback,
        };
        let mut server = PostgresServer::init(options).await.expect("initdb");
        server.start().await.expect("postgres starts");
        Pg { server, _dir: dir }
    }

    pub fn url(&self) -> String {
        self.server.url()
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        let (client, conn) = tokio_postgres::connect(&self.url(), tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(conn);
        client
    }

    /// The account's high-water mark, read straight from the table.
    pub async fn mark(&self, account: &str) -> Option<i64> {
        self.client()
            .await
            .query_opt(
                "SELECT highest_token FROM rail_high_water WHERE account_id = $1",
                &[&account],
            )
            .await
            .expect("query mark")
            .map(|row| row.get(0))
    }
}
