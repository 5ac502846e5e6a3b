//! Replication and durability settings under which PostgreSQL can lose a compare-and-set it
//! acknowledged: found at start and every `guard.interval_ms`, said loudly, exported as
//! `railguard_db_replication_risk{risk}`, and refused with `database.replication_risk =
//! "refuse"`.
//!
//! **What is lost, and what it costs.** A commit that never reached the server that takes
//! over is gone after a failover, acknowledged or not: an accepted mark, the idempotency record
//! made with it, a grant. The store epoch (`super::epoch`) notices the new server and raises
//! the fencing floor, so nothing pays twice; but every grant from before is fenced out, and
//! every holder loses its grant at once. With `fsync` or `full_page_writes` off a crash of
//! the server itself can leave the database corrupt, which no floor repairs.
//!
//! **What is checked**, on a session of the main pool (the one whose commits accept tokens):
//! - `async_standby`: the server streams to physical standbys and none of them is
//!   synchronous (`sync_state` `sync` or `quorum`; a role without `pg_read_all_stats` or
//!   `pg_monitor` sees no `sync_state`, and then an empty `synchronous_standby_names` is what
//!   says so). A failover to an asynchronous standby loses what it had not received.
//!   Logical replication and base backups are not standbys.
//! - `no_sync_commit`: the connection's own `synchronous_commit` is `local` or `remote_write`: its
//!   commits do not wait for a synchronous standby to flush them (`off` is refused for these
//!   sessions by the settings check, `crate::db`).
//! - `fsync_off`, `full_page_writes_off`: the server's own durability.

use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use deadpool_postgres::Pool;
use prometheus::{IntGaugeVec, Opts, Registry};
use tokio_postgres::Client;

/// What the check reads: physical standbys streaming (not base backups, not logical
/// replication, which connects to a database), those that are synchronous, those whose state
/// this role may not see, and the settings of the connection and the server.
pub const REPLICATION_SQL: &str = "\
SELECT (SELECT count(*) FROM pg_catalog.pg_stat_replication r
          JOIN pg_catalog.pg_stat_activity a ON a.pid = r.pid
        WHERE a.datid IS NULL AND r.state IS DISTINCT FROM 'backup')::bigint,
       (SELECT count(*) FROM pg_catalog.pg_stat_replication
        WHERE sync_state IN ('sync', 'quorum'))::bigint,
       (SELECT count(*) FROM pg_catalog.pg_stat_replication WHERE sync_state IS NULL)::bigint,
       current_setting('synchronous_standby_names'),
       current_setting('synchronous_commit'),
       current_setting('fsync'),
       current_setting('full_page_writes')";

/// One way an acknowledged commit can be lost: the `risk` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Risk {
    AsyncStandby,
    NoSyncCommit,
    FsyncOff,
    FullPageWritesOff,
}

impl Risk {
    pub const ALL: [Risk; 4] = [
        Risk::AsyncStandby,
        Risk::NoSyncCommit,
        Risk::FsyncOff,
        Risk::FullPageWritesOff,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Risk::AsyncStandby => "async_standby",
            Risk::NoSyncCommit => "no_sync_commit",
            Risk::FsyncOff => "fsync_off",
            Risk::FullPageWritesOff => "full_page_writes_off",
        }
    }

    /// What it risks, for the log line and the refusal.
    fn risks(self) -> &'static str {
        match self {
            Risk::AsyncStandby | Risk::NoSyncCommit => {
                "a compare-and-set railguard accepted can be lost at a failover; railguard then \
                 fences every grant from before (nothing pays twice), but every holder loses its \
                 grant"
            }
            Risk::FsyncOff | Risk::FullPageWritesOff => {
                "a crash of the server can lose acknowledged commits or corrupt the database; \
                 railguard fences every grant from before a restart, but cannot repair a \
                 corrupt database"
            }
        }
    }
}

/// A risk found, and the settings that make it, as the server reported them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub risk: Risk,
    /// E.g. `fsync is off`.
    pub setting: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.setting, self.risk.risks())
    }
}

/// What the server said, before it is judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Physical standbys streaming.
    pub standbys: i64,
    /// Those that are synchronous (`sync` or `quorum`).
    pub synchronous: i64,
    /// Walsenders whose state this role may not see.
    pub hidden: i64,
    pub synchronous_standby_names: String,
    pub synchronous_commit: String,
    pub fsync: String,
    pub full_page_writes: String,
}

impl Settings {
    /// Reads them on `client`.
    pub async fn read(client: &Client) -> Result<Self, tokio_postgres::Error> {
        let row = client.query_one(REPLICATION_SQL, &[]).await?;
        Ok(Self {
            standbys: row.get(0),
            synchronous: row.get(1),
            hidden: row.get(2),
            synchronous_standby_names: row.get(3),
            synchronous_commit: row.get(4),
            fsync: row.get(5),
            full_page_writes: row.get(6),
        })
    }

    /// The risks these settings make, in [`Risk::ALL`]'s order.
    pub fn findings(&self) -> Vec<Finding> {
        let mut found = Vec::new();
        let names = self.synchronous_standby_names.trim();
        // Without the right to see `sync_state`, an empty synchronous_standby_names is the
        // one sure sign that no standby is synchronous.
        let none_synchronous = names.is_empty() || (self.hidden == 0 && self.synchronous == 0);
        if self.standbys > 0 && none_synchronous {
            let why = if names.is_empty() {
                "synchronous_standby_names is empty".to_string()
            } else {
                format!("none of synchronous_standby_names ({names}) is connected")
            };
            found.push(Finding {
                risk: Risk::AsyncStandby,
                setting: format!(
                    "{} standby(s) stream from this server and none is synchronous ({why})",
                    self.standbys
                ),
            });
        }
        if ["local", "remote_write", "off"].contains(&self.synchronous_commit.as_str()) {
            found.push(Finding {
                risk: Risk::NoSyncCommit,
                setting: format!(
                    "synchronous_commit is {} for railguard's sessions (its commits do not wait \
                     for a synchronous standby to flush them; on or remote_apply do)",
                    self.synchronous_commit
                ),
            });
        }
        if self.fsync == "off" {
            found.push(Finding {
                risk: Risk::FsyncOff,
                setting: "fsync is off".into(),
            });
        }
        if self.full_page_writes == "off" {
            found.push(Finding {
                risk: Risk::FullPageWritesOff,
                setting: "full_page_writes is off".into(),
            });
        }
        found
    }
}

/// Why the check could not be made.
#[derive(Debug, Clone, thiserror::Error)]
#[error("replication check: {0}")]
pub struct ReplicationError(pub String);

/// The last check's result.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Unchecked,
    Checked(Vec<Finding>),
}

/// The check, its gauge, and the last findings; see the module docs.
pub struct ReplicationCheck {
    /// `database.replication_risk = "refuse"`.
    refuse: bool,
    timeout: Duration,
    gauge: IntGaugeVec,
    seen: Mutex<Seen>,
}

impl std::fmt::Debug for ReplicationCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationCheck")
            .field("refuse", &self.refuse)
            .field("seen", &self.seen.lock().expect("replication findings"))
            .finish_non_exhaustive()
    }
}

/// The key that decides between a warning and a refusal.
pub const KEY: &str = "database.replication_risk";

impl ReplicationCheck {
    /// `refuse`: a risk fails the start and `/readyz` (`database.replication_risk`).
    /// Statements are bounded by `timeout`.
    pub fn new(refuse: bool, timeout: Duration, registry: &Registry) -> Self {
        let gauge = IntGaugeVec::new(
            Opts::new(
                "railguard_db_replication_risk",
                "1 while PostgreSQL's replication or durability settings can lose a commit it \
                 acknowledged (risk: async_standby, no_sync_commit, fsync_off, \
                 full_page_writes_off), as last checked at start or every guard.interval_ms",
            ),
            &["risk"],
        )
        .expect("metric");
        for risk in Risk::ALL {
            gauge.with_label_values(&[risk.label()]).set(0);
        }
        let _ = registry.register(Box::new(gauge.clone()));
        Self {
            refuse,
            timeout,
            gauge,
            seen: Mutex::new(Seen::Unchecked),
        }
    }

    pub fn refuses(&self) -> bool {
        self.refuse
    }

    /// Checks on `client` (a session of the main pool) now: sets the gauge, and logs each risk
    /// when it first appears and when it is gone. Returns what was found.
    pub async fn check(&self, client: &Client) -> Result<Vec<Finding>, ReplicationError> {
        let settings = tokio::time::timeout(self.timeout, Settings::read(client))
            .await
            .map_err(|_| ReplicationError(format!("no answer within {:?}", self.timeout)))?
            .map_err(|e| ReplicationError(crate::db::causes(&e)))?;
        let found = settings.findings();
        self.record(&found);
        Ok(found)
    }

    fn record(&self, found: &[Finding]) {
        let mut seen = self.seen.lock().expect("replication findings");
        let before: Vec<Finding> = match &*seen {
            Seen::Checked(before) => before.clone(),
            Seen::Unchecked => Vec::new(),
        };
        for risk in Risk::ALL {
            let now = found.iter().find(|f| f.risk == risk);
            let was = before.iter().find(|f| f.risk == risk);
            self.gauge
                .with_label_values(&[risk.label()])
                .set(i64::from(now.is_some()));
            match (was, now) {
                (was, Some(finding)) if was != Some(finding) => {
                    let then = if self.refuse {
                        "railguard refuses to start, and /readyz fails, while it lasts"
                    } else {
                        "set database.replication_risk = \"refuse\" to refuse it"
                    };
                    tracing::warn!(
                        risk = risk.label(),
                        "!!! POSTGRESQL CAN LOSE AN ACCEPTED COMPARE-AND-SET !!! {finding}. \
                         {then} (docs/operations.md, \"Replication railguard accepts\")"
                    );
                }
                (Some(_), None) => tracing::info!(
                    risk = risk.label(),
                    "PostgreSQL's replication no longer shows this risk"
                ),
                _ => {}
            }
        }
        *seen = Seen::Checked(found.to_vec());
    }

    /// With `refuse`: why railguard must not start, naming the settings and the key.
    pub fn refusal(&self, found: &[Finding]) -> Option<String> {
        if !self.refuse || found.is_empty() {
            return None;
        }
        let list: Vec<String> = found.iter().map(Finding::to_string).collect();
        Some(format!(
            "PostgreSQL can lose a compare-and-set it acknowledged, and {KEY} is \"refuse\": {}. \
             Fix the setting, or set {KEY} = \"warn\" to run with the risk \
             (docs/operations.md, \"Replication railguard accepts\")",
            list.join("; ")
        ))
    }

    /// Ready unless `refuse` and the last check found a risk (or none has been made).
    pub fn ready(&self) -> Result<(), String> {
        if !self.refuse {
            return Ok(());
        }
        match &*self.seen.lock().expect("replication findings") {
            Seen::Unchecked => Err(format!(
                "PostgreSQL's replication has not been checked yet ({KEY} = \"refuse\")"
            )),
            Seen::Checked(found) if found.is_empty() => Ok(()),
            Seen::Checked(found) => {
                let names: Vec<&str> = found.iter().map(|f| f.risk.label()).collect();
                Err(format!(
                    "PostgreSQL can lose a compare-and-set it acknowledged ({}; the log line \
                     \"CAN LOSE AN ACCEPTED COMPARE-AND-SET\" names the setting) and {KEY} = \
                     \"refuse\"",
                    names.join(", ")
                ))
            }
        }
    }

    /// Checks every `interval` on a session of `pool`, forever. A check that cannot be made
    /// keeps the last findings.
    pub async fn run(self: Arc<Self>, pool: Pool, interval: Duration) {
        loop {
            tokio::time::sleep(interval).await;
            let checked = async {
                let client = pool
                    .get()
                    .await
                    .map_err(|e| ReplicationError(crate::db::DbError::from(e).to_string()))?;
                self.check(&client).await
            };
            if let Err(e) = checked.await {
                tracing::warn!(error = %e, "could not check PostgreSQL's replication settings");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            standbys: 0,
            synchronous: 0,
            hidden: 0,
            synchronous_standby_names: String::new(),
            synchronous_commit: "on".into(),
            fsync: "on".into(),
            full_page_writes: "on".into(),
        }
    }

    fn risks(settings: &Settings) -> Vec<Risk> {
        settings.findings().iter().map(|f| f.risk).collect()
    }

    #[test]
    fn a_durable_server_without_standbys_is_no_risk() {
        assert_eq!(risks(&settings()), []);
        for value in ["on", "remote_apply"] {
            let s = Settings {
                synchronous_commit: value.into(),
                ..settings()
            };
            assert_eq!(risks(&s), [], "{value}");
        }
    }

    #[test]
    fn standbys_are_a_risk_unless_one_is_synchronous() {
        let async_only = Settings {
            standbys: 2,
            ..settings()
        };
        assert_eq!(risks(&async_only), [Risk::AsyncStandby]);
        let named_but_absent = Settings {
            standbys: 1,
            synchronous_standby_names: "b".into(),
            ..settings()
        };
        assert_eq!(risks(&named_but_absent), [Risk::AsyncStandby]);
        let synchronous = Settings {
            synchronous: 1,
            ..named_but_absent.clone()
        };
        assert_eq!(risks(&synchronous), []);
        // A role that may not see sync_state: a name in synchronous_standby_names is taken
        // at its word; an empty one says no standby is synchronous.
        let hidden = Settings {
            hidden: 1,
            ..named_but_absent
        };
        assert_eq!(risks(&hidden), []);
        let hidden_unnamed = Settings {
            hidden: 1,
            standbys: 1,
            ..settings()
        };
        assert_eq!(risks(&hidden_unnamed), [Risk::AsyncStandby]);
    }

    #[test]
    fn each_setting_is_its_own_risk() {
        let s = Settings {
            synchronous_commit: "remote_write".into(),
            fsync: "off".into(),
            full_page_writes: "off".into(),
            ..settings()
        };
        let found = s.findings();
        assert_eq!(
            found.iter().map(|f| f.risk).collect::<Vec<_>>(),
            [Risk::NoSyncCommit, Risk::FsyncOff, Risk::FullPageWritesOff]
        );
        assert!(
            found[0]
                .setting
                .contains("synchronous_commit is remote_write")
        );
        assert!(found[1].to_string().starts_with("fsync is off: "));
    }

    #[test]
    fn refuse_names_the_settings_and_the_key_and_warn_refuses_nothing() {
        let registry = Registry::new();
        let found = Settings {
            fsync: "off".into(),
            ..settings()
        }
        .findings();
        let warn = ReplicationCheck::new(false, Duration::from_secs(1), &registry);
        assert_eq!(warn.refusal(&found), None);
        assert_eq!(warn.ready(), Ok(()));
        let refuse = ReplicationCheck::new(true, Duration::from_secs(1), &Registry::new());
        let why = refuse.refusal(&found).expect("refused");
        assert!(why.contains("fsync is off") && why.contains(KEY), "{why}");
        assert!(refuse.ready().is_err(), "unchecked");
        refuse.record(&found);
        assert!(refuse.ready().unwrap_err().contains("fsync_off"));
        refuse.record(&[]);
        assert_eq!(refuse.ready(), Ok(()));
        assert_eq!(
            refuse
                .gauge
                .with_label_values(&[Risk::FsyncOff.label()])
                .get(),
            0
        );
    }
}
