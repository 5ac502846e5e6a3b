//! Schema migrations: plain SQL files in `migrations/`, compiled into the binary, applied in
//! order and recorded in `railguard_schema_migrations`.
//!
//! All pending migrations run in one transaction under an advisory lock, so two railguard
//! processes starting together cannot both apply one, and a migration that fails leaves the
//! database exactly as it was. A recorded migration whose SQL has since changed, or a database
//! at a version this binary does not know, stops start-up with a clear error: guessing would
//! be worse than not starting.

use sha2::{Digest, Sha256};
use tokio_postgres::GenericClient;

/// One migration file.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
}

/// Every migration, in order. `migrations_dir_matches_this_list` keeps it honest.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "rail_high_water",
        sql: include_str!("../../migrations/0001_rail_high_water.sql"),
    },
    Migration {
        version: 2,
        name: "lock_entry",
        sql: include_str!("../../migrations/0002_lock_entry.sql"),
    },
    Migration {
        version: 3,
        name: "idempotency_record",
        sql: include_str!("../../migrations/0003_idempotency_record.sql"),
    },
    Migration {
        version: 4,
        name: "grant_secrets_and_record_owners",
        sql: include_str!("../../migrations/0004_grant_secrets_and_record_owners.sql"),
    },
    Migration {
        version: 5,
        name: "operator_audit",
        sql: include_str!("../../migrations/0005_operator_audit.sql"),
    },
    Migration {
        version: 6,
        name: "completion_plan",
        sql: include_str!("../../migrations/0006_completion_plan.sql"),
    },
    Migration {
        version: 7,
        name: "store_epoch",
        sql: include_str!("../../migrations/0007_store_epoch.sql"),
    },
    Migration {
        version: 8,
        name: "forward_handover",
        sql: include_str!("../../migrations/0008_forward_handover.sql"),
    },
    Migration {
        version: 9,
        name: "hold_after_store_change",
        sql: include_str!("../../migrations/0009_hold_after_store_change.sql"),
    },
];

/// The schema version this binary expects.
pub fn latest_version() -> i32 {
    MIGRATIONS.last().map(|m| m.version).unwrap_or(0)
}

/// Arbitrary, fixed: the advisory lock that serialises migrators.
const MIGRATION_LOCK: i64 = 0x7261_696c_6775_6172; // "railguar"

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error(
        "migration {version:04} ({name}) failed and nothing was applied: {}",
        crate::db::causes(source)
    )]
    Failed {
        version: i32,
        name: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error(
        "migration {version:04} ({name}) was applied with different SQL than this binary has \
         (checksum {recorded}, now {current}); migrations must never change once released"
    )]
    Changed {
        version: i32,
        name: String,
        recorded: String,
        current: String,
    },
    #[error("the database is at schema version {found}, newer than this binary's {known}")]
    TooNew { found: i32, known: i32 },
    #[error("database error while migrating: {}", crate::db::causes(.0))]
    Database(#[from] tokio_postgres::Error),
}

fn checksum(sql: &str) -> String {
    Sha256::digest(sql.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Applies every pending migration. Returns how many were applied.
pub async fn migrate(client: &mut tokio_postgres::Client) -> Result<usize, MigrateError> {
    let tx = client.transaction().await?;
    // Migrations may take longer than a request's statement deadline, and may wait for
    // another migrator.
    tx.batch_execute("SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = '60s'")
        .await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS railguard_schema_migrations (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             checksum   text        NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         )",
    )
    .await?;
    let applied = tx
        .query(
            "SELECT version, name, checksum FROM railguard_schema_migrations ORDER BY version",
            &[],
        )
        .await?;
    let known = latest_version();
    let mut count = 0;
    for row in &applied {
        let (version, name, recorded): (i32, String, String) = (row.get(0), row.get(1), row.get(2));
        let Some(m) = MIGRATIONS.iter().find(|m| m.version == version) else {
            return Err(MigrateError::TooNew {
                found: version,
                known,
            });
        };
        let current = checksum(m.sql);
        if current != recorded {
            return Err(MigrateError::Changed {
                version,
                name,
                recorded,
                current,
            });
        }
    }
    for m in MIGRATIONS {
        if applied.iter().any(|row| row.get::<_, i32>(0) == m.version) {
            continue;
        }
        let fail = |source| MigrateError::Failed {
            version: m.version,
            name: m.name,
            source,
        };
        tx.batch_execute(m.sql).await.map_err(fail)?;
        tx.execute(
            "INSERT INTO railguard_schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
            &[&m.version, &m.name, &checksum(m.sql)],
        )
        .await
        .map_err(fail)?;
        tracing::info!(version = m.version, name = m.name, "applied migration");
        count += 1;
    }
    tx.commit().await?;
    Ok(count)
}

/// Where one migration stands in a database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigrationState {
    Applied {
        applied_at: String,
    },
    /// Applied with other SQL than this binary has: start-up refuses such a database.
    Changed {
        applied_at: String,
    },
    Pending,
    /// Recorded in the database, unknown to this binary (a newer railguard applied it).
    Unknown {
        name: String,
        applied_at: String,
    },
}

/// Every migration this binary knows, and every one the database has recorded, with where
/// each stands — read only: nothing is applied or locked.
pub async fn status(
    client: &impl GenericClient,
) -> Result<Vec<(i32, String, MigrationState)>, tokio_postgres::Error> {
    let recorded: bool = client
        .query_one(
            "SELECT to_regclass('railguard_schema_migrations') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    let applied = if recorded {
        client
            .query(
                "SELECT version, name, checksum, applied_at::text FROM \
                 railguard_schema_migrations ORDER BY version",
                &[],
            )
            .await?
    } else {
        Vec::new()
    };
    let mut out = Vec::new();
    for m in MIGRATIONS {
        let state = match applied.iter().find(|r| r.get::<_, i32>(0) == m.version) {
            Some(r) if r.get::<_, String>(2) == checksum(m.sql) => MigrationState::Applied {
                applied_at: r.get(3),
            },
            Some(r) => MigrationState::Changed {
                applied_at: r.get(3),
            },
            None => MigrationState::Pending,
        };
        out.push((m.version, m.name.to_string(), state));
    }
    for r in &applied {
        let version: i32 = r.get(0);
        if !MIGRATIONS.iter().any(|m| m.version == version) {
            out.push((
                version,
                r.get(1),
                MigrationState::Unknown {
                    name: r.get(1),
                    applied_at: r.get(3),
                },
            ));
        }
    }
    Ok(out)
}

/// `railguard migrate`: applies pending migrations as [`super::Database::open`] does (starting
/// the embedded server for it if configured), then makes the index changes `serve` would make
/// in the background and waits for them ([`super::maintenance::wait_until_done`]), ahead of a
/// rollout on a large table. Those are not needed to serve: their failure is logged, not
/// returned.
pub async fn apply(config: &crate::config::DatabaseConfig) -> Result<(), super::DatabaseError> {
    let db = super::Database::open(config).await?;
    tracing::info!(version = latest_version(), "schema is current");
    match super::maintenance::wait_until_done(&db.url, config.timeout).await {
        Ok(()) => tracing::info!("indexes are current"),
        Err(e) => {
            tracing::warn!(error = %e, "could not bring the indexes up to date; `serve` retries")
        }
    }
    db.shutdown().await;
    Ok(())
}

/// Where a database's schema stands: every migration, by [`status`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaStatus {
    pub migrations: Vec<(i32, String, MigrationState)>,
}

impl SchemaStatus {
    /// Every migration applied as this binary has it, and none it does not know.
    pub fn is_current(&self) -> bool {
        self.migrations
            .iter()
            .all(|(_, _, state)| matches!(state, MigrationState::Applied { .. }))
    }
}

/// One line per migration, then whether the schema is current.
impl std::fmt::Display for SchemaStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (version, name, state) in &self.migrations {
            let what = match state {
                MigrationState::Applied { applied_at } => format!("applied {applied_at}"),
                MigrationState::Changed { applied_at } => {
                    format!("CHANGED since it was applied {applied_at}: railguard will not start")
                }
                MigrationState::Pending => {
                    "pending (railguard migrate, or serve, applies it)".to_string()
                }
                MigrationState::Unknown { applied_at, .. } => {
                    format!("applied {applied_at} by a newer railguard: this binary will not start")
                }
            };
            writeln!(f, "{version:04} {name:<36} {what}")?;
        }
        if self.is_current() {
            writeln!(f, "schema is current (version {})", latest_version())?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error(
        "migrate --status needs database.url = \"postgres://…\": the embedded database is \
         private to `railguard serve`; its /readyz says whether the schema is current"
    )]
    Embedded,
    #[error("database.url: {0}")]
    Connect(#[from] super::DatabaseError),
    #[error("database.url: the database did not answer the reading of its migrations within {0:?}")]
    NoAnswer(std::time::Duration),
    #[error("cannot read the schema's migrations: {0}")]
    Read(#[from] tokio_postgres::Error),
}

/// `railguard migrate --status`: where the schema of a `postgres://` database stands, read
/// over a session of its own. Read only: nothing is applied or locked.
pub async fn read_status(
    config: &crate::config::DatabaseConfig,
) -> Result<SchemaStatus, StatusError> {
    let crate::config::DatabaseUrl::Postgres(_) = &config.url else {
        return Err(StatusError::Embedded);
    };
    let timeout = config.timeout.max(std::time::Duration::from_secs(2));
    let url = super::url_of(config);
    // The connection bounds itself, and says which servers did not answer; the reading of
    // the migrations is bounded here.
    let (client, connection) = super::connect(&url, timeout).await?;
    let migrations = tokio::time::timeout(timeout, status(&client))
        .await
        .map_err(|_| StatusError::NoAnswer(timeout))?;
    drop(client);
    connection.abort();
    Ok(SchemaStatus {
        migrations: migrations?,
    })
}

/// The highest applied version, or `None` before the first migration.
pub async fn current_version(
    client: &impl GenericClient,
) -> Result<Option<i32>, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT CASE WHEN to_regclass('railguard_schema_migrations') IS NULL THEN NULL
                    ELSE (SELECT max(version) FROM railguard_schema_migrations) END",
            &[],
        )
        .await?;
    Ok(row.get(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_lists_each_migration_and_says_whether_the_schema_is_current() {
        let applied = |m: &Migration| {
            (
                m.version,
                m.name.to_string(),
                MigrationState::Applied {
                    applied_at: "2026-01-02".into(),
                },
            )
        };
        let current = SchemaStatus {
            migrations: MIGRATIONS.iter().map(applied).collect(),
        };
        assert!(current.is_current());
        let text = current.to_string();
        assert!(text.starts_with("0001 rail_high_water "), "{text}");
        assert!(
            text.ends_with(&format!(
                "schema is current (version {})\n",
                latest_version()
            )),
            "{text}"
        );
        let mut behind = current.clone();
        behind.migrations.last_mut().unwrap().2 = MigrationState::Pending;
        assert!(!behind.is_current());
        let text = behind.to_string();
        assert!(text.contains("pending (railguard migrate"), "{text}");
        assert!(!text.contains("schema is current"), "{text}");
        let mut newer = current;
        newer.migrations.push((
            99,
            "from_the_future".into(),
            MigrationState::Unknown {
                name: "from_the_future".into(),
                applied_at: "2027-01-01".into(),
            },
        ));
        assert!(!newer.is_current());
        assert!(newer.to_string().contains("by a newer railguard"));
    }

    #[test]
    fn migrations_dir_matches_this_list() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        files.sort();
        assert_eq!(
            files.len(),
            MIGRATIONS.len(),
            "every file in migrations/ is listed"
        );
        for (file, m) in files.iter().zip(MIGRATIONS) {
            assert_eq!(file, &format!("{:04}_{}.sql", m.version, m.name));
            let text = std::fs::read_to_string(format!("{dir}/{file}")).unwrap();
            assert_eq!(text, m.sql);
        }
        for pair in MIGRATIONS.windows(2) {
            assert_eq!(
                pair[1].version,
                pair[0].version + 1,
                "versions are consecutive"
            );
        }
    }
}
