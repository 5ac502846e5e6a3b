//! Commits that PostgreSQL reports as done but not replicated, seen by the session that made
//! them.
//!
//! When a commit's wait for its synchronous standby is cancelled (`pg_cancel_backend`, or the
//! backend terminated), PostgreSQL sends a WARNING notice — "canceling wait for synchronous
//! replication … The transaction has already committed locally, but might not have been
//! replicated to the standby" — and the statement **succeeds**. The commit may then be lost
//! at a failover, acknowledged as it was.
//!
//! tokio-postgres hands notices to whatever drives the connection, not to the statement, and
//! deadpool drives its connections itself (and only logs them). So the pools that need to know
//! open their connections here ([`Notices::connect`]): each connection's driver counts those
//! warnings, and a session reads its connection's count before and after a statement
//! ([`Notices::watch`]). PostgreSQL sends the warning before the statement's ReadyForQuery,
//! and tokio-postgres hands a notice out before it reads on, so the count read after the
//! statement returned includes it. A warning left over from a statement an earlier user of
//! the session gave up on can only make a later statement look unreplicated, never the
//! other way round.
//!
//! A session finds its connection's count by the connection's number, which the connection
//! carries as the placeholder setting `railguard.connection` (a startup option) and which the
//! session reads once when it opens ([`Notices::hook`]).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use deadpool_postgres::{ClientWrapper, Connect, Hook, HookError};
use tokio::task::JoinHandle;
use tokio_postgres::AsyncMessage;
use tokio_postgres::error::{DbError, Severity};

use crate::tls::postgres::PgTls;

/// The placeholder setting that numbers a connection.
const SETTING: &str = "railguard.connection";

/// The function of PostgreSQL's that sends the warning (its name is not translated, unlike
/// the message).
const SYNC_REP_ROUTINE: &str = "SyncRepWaitForLSN";

/// Per-connection counts of commits whose wait for a synchronous standby was cancelled; see
/// the module docs. Cheap to clone; the default counts nothing until a pool opens its
/// connections with it.
#[derive(Clone, Default)]
pub struct Notices(Arc<Registry>);

#[derive(Default)]
struct Registry {
    next: AtomicU64,
    /// Connections by number, until their session claims them. The driver holds the count.
    opened: Mutex<HashMap<u64, Weak<AtomicU64>>>,
    /// Sessions by the address of their statement cache, which each session has for its
    /// life.
    sessions: Mutex<HashMap<usize, Weak<AtomicU64>>>,
}

impl std::fmt::Debug for Notices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notices").finish_non_exhaustive()
    }
}

/// A session's count, as it was when the watch began.
#[derive(Debug)]
pub struct Watch {
    count: Arc<AtomicU64>,
    before: u64,
}

impl Watch {
    /// Commits of the session whose wait for a synchronous standby was cancelled since the
    /// watch began.
    pub fn unreplicated(&self) -> u64 {
        self.count.load(Ordering::Acquire).wrapping_sub(self.before)
    }
}

impl Notices {
    /// How a pool opens its connections so that they are counted.
    pub fn connect(&self, tls: PgTls) -> impl Connect + 'static {
        Counting {
            registry: self.0.clone(),
            tls,
            answered: super::hosts::LastAnswered::default(),
        }
    }

    /// Ties each new session to its connection's count (bounded by `timeout`, which the
    /// pool's create timeout does not cover). A session whose connection carries no number
    /// (a pooler that dropped its startup options) is not used.
    pub fn hook(&self, timeout: Duration) -> Hook {
        let registry = self.0.clone();
        Hook::async_fn(move |session: &mut ClientWrapper, _| {
            let registry = registry.clone();
            Box::pin(async move {
                let read =
                    session.query_one("SELECT current_setting('railguard.connection', true)", &[]);
                let row = tokio::time::timeout(timeout, read)
                    .await
                    .map_err(|_| {
                        HookError::message(format!(
                            "no answer to the session's {SETTING} within {timeout:?}"
                        ))
                    })?
                    .map_err(HookError::Backend)?;
                let number: Option<String> = row.get(0);
                let count = number
                    .as_deref()
                    .and_then(|n| n.parse().ok())
                    .and_then(|n| registry.claim(n))
                    .ok_or_else(|| {
                        HookError::message(format!(
                            "the session's {SETTING} is {number:?}, not a connection railguard \
                             opened (a pooler that drops startup options?); not used"
                        ))
                    })?;
                registry.bind(key(session), &count);
                Ok(())
            })
        })
    }

    /// Begins watching `session`'s count; `None` for a session of a pool that does not count.
    pub fn watch(&self, session: &ClientWrapper) -> Option<Watch> {
        let count = self
            .0
            .sessions
            .lock()
            .expect("notice registry")
            .get(&key(session))?
            .upgrade()?;
        let before = count.load(Ordering::Acquire);
        Some(Watch { count, before })
    }
}

fn key(session: &ClientWrapper) -> usize {
    Arc::as_ptr(&session.statement_cache) as usize
}

impl Registry {
    fn opened(&self, number: u64, count: &Arc<AtomicU64>) {
        let mut opened = self.opened.lock().expect("notice registry");
        // Connections refused before their session claimed them.
        opened.retain(|_, count| count.strong_count() > 0);
        opened.insert(number, Arc::downgrade(count));
    }

    fn claim(&self, number: u64) -> Option<Arc<AtomicU64>> {
        self.opened
            .lock()
            .expect("notice registry")
            .remove(&number)?
            .upgrade()
    }

    fn bind(&self, session: usize, count: &Arc<AtomicU64>) {
        let mut sessions = self.sessions.lock().expect("notice registry");
        sessions.retain(|_, count| count.strong_count() > 0);
        sessions.insert(session, Arc::downgrade(count));
    }
}

/// A connection opened with its number, driven by a task that counts the warnings.
struct Counting {
    registry: Arc<Registry>,
    tls: PgTls,
    answered: super::hosts::LastAnswered,
}

impl Connect for Counting {
    fn connect(
        &self,
        pg_config: &tokio_postgres::Config,
    ) -> Pin<
        Box<
            dyn Future<
                    Output = Result<
                        (tokio_postgres::Client, JoinHandle<()>),
                        tokio_postgres::Error,
                    >,
                > + Send
                + '_,
        >,
    > {
        let number = self.registry.next.fetch_add(1, Ordering::Relaxed);
        let mut config = pg_config.clone();
        let options = match config.get_options() {
            Some(options) if !options.is_empty() => format!("{options} -c {SETTING}={number}"),
            _ => format!("-c {SETTING}={number}"),
        };
        config.options(options);
        let tls = self.tls.clone();
        Box::pin(async move {
            let (client, mut connection) =
                super::hosts::for_a_pool(&config, tls, &self.answered).await?;
            let count = Arc::new(AtomicU64::new(0));
            self.registry.opened(number, &count);
            let driver = tokio::spawn(async move {
                loop {
                    match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                        Some(Ok(AsyncMessage::Notice(notice))) if unreplicated(&notice) => {
                            count.fetch_add(1, Ordering::AcqRel);
                            tracing::warn!(
                                notice = notice.message(),
                                "PostgreSQL committed a transaction locally whose wait for the \
                                 synchronous standby was cancelled: it may be lost at a failover"
                            );
                        }
                        Some(Ok(AsyncMessage::Notice(notice))) => {
                            tracing::info!("{}: {}", notice.severity(), notice.message());
                        }
                        Some(Ok(_)) => {}
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "database connection error");
                            break;
                        }
                        None => break,
                    }
                }
            });
            Ok((client, driver))
        })
    }
}

/// Is `notice` PostgreSQL's word that a commit's wait for its synchronous standby was cancelled?
fn unreplicated(notice: &DbError) -> bool {
    let warning =
        notice.parsed_severity() == Some(Severity::Warning) || notice.severity() == "WARNING";
    warning
        && (notice.routine() == Some(SYNC_REP_ROUTINE)
            || notice
                .message()
                .contains("wait for synchronous replication"))
}
