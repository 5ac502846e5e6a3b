//! railguard's own PostgreSQL (marks, idempotency records, the PostgreSQL lock backend), in
//! the shape a run asks for: one throwaway cluster, or a Patroni cluster whose primary the
//! `pg-failover` fault kills or switches over while railguard follows it through a multi-host
//! URL (`target_session_attrs=read-write`).

use std::time::Duration;

use railguard_testkit::{PatroniCluster, Pg};

pub enum LockDb {
    Single(Box<Pg>),
    Patroni {
        cluster: Box<PatroniCluster>,
        /// Patroni's `synchronous_mode`.
        synchronous: bool,
        /// Failovers made so far: their forms take turns.
        failovers: usize,
    },
}

impl LockDb {
    /// What railguard and the tools connect to: the cluster, or every Patroni member.
    pub fn url(&self) -> String {
        match self {
            LockDb::Single(pg) => pg.url(),
            LockDb::Patroni { cluster, .. } => cluster.url(),
        }
    }

    pub fn single(&mut self) -> Option<&mut Pg> {
        match self {
            LockDb::Single(pg) => Some(pg),
            LockDb::Patroni { .. } => None,
        }
    }

    /// `fencing_token_seq`'s last value, for a fault's record; `?` when it cannot be read.
    pub async fn token_position(&self) -> String {
        let url = self.url();
        let read = async {
            let connect = railguard::tls::postgres::connect_config(&url).ok()?;
            let (client, conn) = connect.config.connect(connect.tls).await.ok()?;
            tokio::spawn(conn);
            client
                .query_one("SELECT last_value FROM fencing_token_seq", &[])
                .await
                .ok()
                .map(|row| row.get::<_, i64>(0).to_string())
        };
        tokio::time::timeout(Duration::from_secs(2), read)
            .await
            .ok()
            .flatten()
            .unwrap_or_else(|| "?".into())
    }
}
