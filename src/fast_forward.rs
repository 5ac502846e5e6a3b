//! `railguard fast-forward` (C1 §1.7): moves the configured backend's token source past every
//! token a fence has recorded, before traffic resumes after a restore of lockdb or a switch of
//! `lock.backend`.
//!
//! The target is `max(rail_high_water.highest_token)` in railguard's database and, when
//! given, `max(<column>)` of a paydb table (the fenced UPDATE's `account.fence`, C1 §1.6).
//! The source is raised to at least the target ([`TokenSource::advance_to`]: PostgreSQL by
//! `setval`, etcd by writes, with progress), then **a fresh draw must come out above the
//! target** before success is reported. Running it again is always safe: it never moves the
//! source back, and an interrupted etcd run continues from where the cluster is.
//!
//! It may run while railguard serves: the guard of every running railguard refuses grants
//! until its next check finds the source ahead (`guard.interval_ms`).

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use crate::lock::guard::highest_mark;
use crate::lock::source::{Progress, SourceError, TokenSource};

/// A paydb column whose maximum the source must pass too.
#[derive(Debug, Clone)]
pub struct PaydbFence {
    pub url: String,
    /// `table` or `schema.table`.
    pub table: String,
    pub column: String,
}

/// What was found, and what was (or would be) done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FastForward {
    /// The source was already above every mark: nothing written.
    NothingToDo { position: i64, target: i64 },
    /// `--dry-run`: the source is at `position` and would be moved past `target`.
    WouldMove { position: i64, target: i64 },
    /// Moved from `from` to at least the target, and a fresh draw came out at `drawn`.
    Done { from: i64, target: i64, drawn: i64 },
}

#[derive(Debug, thiserror::Error)]
pub enum FastForwardError {
    #[error("{0}")]
    Source(#[from] SourceError),
    #[error("paydb ({which}): {message}")]
    Paydb { which: String, message: String },
    #[error(
        "a fresh draw came out at {drawn}, not above the target {target}: the token source is \
         NOT safe; do not resume traffic (another process may be moving it back)"
    )]
    NotAbove { drawn: i64, target: i64 },
    #[error("{0}")]
    Usage(String),
}

/// A table or column name: letters, digits and `_`, not starting with a digit; a table may be
/// `schema.table`. Quoted when used, so that nothing else can reach the SQL.
pub fn parse_identifier(text: &str, what: &str, dotted: bool) -> Result<String, String> {
    let parts: Vec<&str> = text.split('.').collect();
    let ok = (parts.len() == 1 || (dotted && parts.len() == 2))
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.len() <= 63
                && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !p.starts_with(|c: char| c.is_ascii_digit())
        });
    if ok {
        Ok(text.to_string())
    } else {
        Err(format!(
            "{what} {text:?} must be an identifier (letters, digits, _){}",
            if dotted { ", or schema.table" } else { "" }
        ))
    }
}

fn quoted(identifier: &str) -> String {
    identifier
        .split('.')
        .map(|p| format!("\"{p}\""))
        .collect::<Vec<_>>()
        .join(".")
}

/// `max(column)` of the paydb table, 0 when it is empty.
pub async fn paydb_highest(paydb: &PaydbFence, timeout: Duration) -> Result<i64, FastForwardError> {
    let which = format!("{}.{}", paydb.table, paydb.column);
    let error = |message: String| FastForwardError::Paydb {
        which: which.clone(),
        message,
    };
    let sql = format!(
        "SELECT COALESCE(max({})::bigint, 0) FROM {}",
        quoted(&paydb.column),
        quoted(&paydb.table)
    );
    let read = async {
        // TLS as the paydb URL asks (`sslmode`, `sslrootcert`: see `tls::postgres`).
        let (client, connection) = crate::db::connect(&paydb.url, timeout)
            .await
            .map_err(|e| e.to_string())?;
        let row = client.query_one(&sql, &[]).await.map_err(|e| e.to_string());
        connection.abort();
        Ok::<i64, String>(row?.get(0))
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(error(e)),
        Err(_) => Err(error(format!("no answer within {timeout:?}"))),
    }
}

/// The highest token any fence has recorded: railguard's marks and, if given, paydb's.
pub async fn target(
    marks: &deadpool_postgres::Pool,
    timeout: Duration,
    paydb: Option<&PaydbFence>,
) -> Result<i64, FastForwardError> {
    let mut target = highest_mark(marks, timeout).await?;
    if let Some(paydb) = paydb {
        target = target.max(paydb_highest(paydb, timeout).await?);
    }
    Ok(target)
}

/// Moves `source` past `target` (unless `dry_run`) and verifies it with a fresh draw.
pub async fn fast_forward(
    source: &TokenSource,
    target: i64,
    dry_run: bool,
    progress: &(dyn Fn(Progress) + Sync),
    stop: &AtomicBool,
) -> Result<FastForward, FastForwardError> {
    let position = source.position().await?;
    // At the target is enough: the next draw is above it.
    if position >= target {
        return Ok(FastForward::NothingToDo { position, target });
    }
    if dry_run {
        return Ok(FastForward::WouldMove { position, target });
    }
    // Past the target, not onto it: position > target means every later draw is at least
    // target + 2, and the draw below is checked against it.
    let goal = target.checked_add(1).ok_or_else(|| {
        FastForwardError::Usage(format!(
            "the target {target} is the largest token there is; no source can pass it \
             (a poisoned mark: see docs/operations.md)"
        ))
    })?;
    source.advance_to(goal, progress, stop).await?;
    let drawn = source.draw().await?;
    if drawn <= target {
        return Err(FastForwardError::NotAbove { drawn, target });
    }
    Ok(FastForward::Done {
        from: position,
        target,
        drawn,
    })
}

/// What [`run`] found before moving anything, said before a long etcd run starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// `"postgres"` or `"etcd"` ([`TokenSource::name`]).
    pub source: &'static str,
    /// The highest token any fence has recorded.
    pub target: i64,
    /// Whether the target includes the paydb column's maximum.
    pub with_paydb: bool,
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "token source: {} ({}); highest fencing mark{}: {}",
            self.source,
            if self.source == "etcd" {
                "cluster revision"
            } else {
                "fencing_token_seq"
            },
            if self.with_paydb {
                " (railguard and paydb)"
            } else {
                ""
            },
            self.target
        )
    }
}

/// What [`run`] did, and how the source is (or would be) moved, for the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ran {
    pub outcome: FastForward,
    /// The etcd scratch key the writes go to; `None` for PostgreSQL (`setval`).
    pub scratch_key: Option<String>,
}

impl std::fmt::Display for Ran {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.outcome {
            FastForward::NothingToDo { position, target } => write!(
                f,
                "nothing to do: the source is at {position}, above {target}"
            ),
            FastForward::WouldMove { position, target } => {
                write!(
                    f,
                    "dry run: would move the source from {position} past {target}: "
                )?;
                match &self.scratch_key {
                    Some(key) => write!(
                        f,
                        "about {} writes to the scratch key {key}",
                        target.saturating_add(1).saturating_sub(position)
                    ),
                    None => write!(
                        f,
                        "setval('fencing_token_seq', {})",
                        target.saturating_add(1)
                    ),
                }
            }
            FastForward::Done {
                from,
                target,
                drawn,
            } => write!(
                f,
                "done: moved the source from {from} past {target}; a fresh draw came out at \
                 {drawn}. Grants resume at each railguard's next guard check."
            ),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("{0}")]
    Database(#[from] crate::db::DatabaseError),
    #[error("fast-forward: {0}")]
    FastForward(#[from] FastForwardError),
}

/// `railguard fast-forward`: opens railguard's database (applying pending migrations, as
/// every command that opens it does) and the token source of `config`'s `lock.backend`,
/// finds the target (with `paydb`'s column when given) and tells `found`, then moves the
/// source past it ([`fast_forward`]), reporting to `progress`. `interrupted` resolving stops
/// the writes in flight: the run then fails, and running it again continues.
pub async fn run(
    config: &crate::config::Config,
    paydb: Option<&PaydbFence>,
    dry_run: bool,
    interrupted: impl std::future::Future<Output = ()> + Send + 'static,
    found: &(dyn Fn(&Plan) + Sync),
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<Ran, RunError> {
    let database = crate::db::Database::open(&config.database).await?;
    let timeout = config.database.timeout.max(Duration::from_secs(5));
    let lock_database = crate::lock::LockDatabase {
        pool: &database.pool,
        url: &database.url,
        timeout,
    };
    let source =
        crate::lock::token_source(&config.lock, &config.etcd, &config.guard, &lock_database);
    let outcome = async {
        let target = target(&database.pool, timeout, paydb).await?;
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let interrupt = {
            let stop = stop.clone();
            tokio::spawn(async move {
                interrupted.await;
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
            })
        };
        found(&Plan {
            source: source.name(),
            target,
            with_paydb: paydb.is_some(),
        });
        let result = fast_forward(&source, target, dry_run, progress, &stop).await;
        interrupt.abort();
        result
    }
    .await;
    database.shutdown().await;
    Ok(Ran {
        outcome: outcome?,
        scratch_key: match &source {
            TokenSource::Etcd { scratch_key, .. } => Some(scratch_key.clone()),
            TokenSource::Postgres { .. } => None,
        },
    })
}

/// A one-line progress report: where, how fast, how long to go.
pub struct ProgressLine {
    started: std::time::Instant,
    first: std::sync::Mutex<Option<i64>>,
}

impl Default for ProgressLine {
    fn default() -> Self {
        Self {
            started: std::time::Instant::now(),
            first: std::sync::Mutex::new(None),
        }
    }
}

impl ProgressLine {
    /// `position/target  NN.N%  rate/s  ETA`.
    pub fn render(&self, p: Progress) -> String {
        self.render_after(p, self.started.elapsed())
    }

    fn render_after(&self, p: Progress, elapsed: Duration) -> String {
        let first = *self
            .first
            .lock()
            .expect("progress")
            .get_or_insert(p.position);
        let elapsed = elapsed.as_secs_f64().max(1e-3);
        let done = (p.position - first).max(0) as f64;
        let total = (p.target - first).max(1) as f64;
        let rate = done / elapsed;
        let left = (p.target - p.position).max(0) as f64;
        let eta = if rate > 0.0 {
            format!("{:.0}s", left / rate)
        } else {
            "?".into()
        };
        format!(
            "{}/{}  {:5.1}%  {:.0}/s  ETA {eta}",
            p.position,
            p.target,
            (100.0 * done / total).min(100.0),
            rate
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_checked_and_quoted() {
        assert_eq!(parse_identifier("account", "t", true).unwrap(), "account");
        assert_eq!(quoted("pay.account"), "\"pay\".\"account\"");
        for bad in ["", "a;drop", "a b", "1a", "a.b.c", "a\"b", "a."] {
            assert!(parse_identifier(bad, "t", true).is_err(), "{bad:?}");
        }
        assert!(parse_identifier("a.b", "c", false).is_err());
    }

    #[test]
    fn the_plan_and_the_outcome_say_how_the_source_moves() {
        let plan = Plan {
            source: "etcd",
            target: 40,
            with_paydb: true,
        };
        assert_eq!(
            plan.to_string(),
            "token source: etcd (cluster revision); highest fencing mark (railguard and paydb): 40"
        );
        let would = |scratch_key: Option<&str>| {
            Ran {
                outcome: FastForward::WouldMove {
                    position: 10,
                    target: 40,
                },
                scratch_key: scratch_key.map(str::to_string),
            }
            .to_string()
        };
        assert_eq!(
            would(Some("/railguard.fast-forward")),
            "dry run: would move the source from 10 past 40: about 31 writes to the scratch key \
             /railguard.fast-forward"
        );
        assert_eq!(
            would(None),
            "dry run: would move the source from 10 past 40: setval('fencing_token_seq', 41)"
        );
        let nothing = Ran {
            outcome: FastForward::NothingToDo {
                position: 50,
                target: 40,
            },
            scratch_key: None,
        };
        assert_eq!(
            nothing.to_string(),
            "nothing to do: the source is at 50, above 40"
        );
    }

    #[test]
    fn progress_reports_rate_and_eta() {
        let line = ProgressLine::default();
        let at = |position, secs| {
            line.render_after(
                Progress {
                    position,
                    target: 110,
                },
                Duration::from_secs(secs),
            )
        };
        assert!(at(10, 0).starts_with("10/110"));
        let text = at(60, 10);
        assert_eq!(text, "60/110   50.0%  5/s  ETA 10s");
    }
}
