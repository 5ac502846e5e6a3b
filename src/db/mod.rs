//! PostgreSQL: where the database is, the connection pool, and the schema.
//!
//! [`Database::open`] turns `[database]` into a ready pool: it starts the embedded server when
//! asked to, applies migrations, and keeps the server handle so that shutdown can stop it
//! after the last request has drained.

pub(crate) mod hosts;
pub mod maintenance;
pub mod migrate;
pub mod notices;
pub mod server;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{
    ClientWrapper, Hook, HookError, Manager, ManagerConfig, Pool, PoolBuilder, RecyclingMethod,
    Runtime,
};

use crate::config::{DatabaseConfig, DatabaseUrl};
use crate::tls::postgres::{PgConnect, PgTls, SslMode};
pub use notices::Notices;
pub use server::{Access, PostgresServer, ServerError, ServerOptions};

/// Why a statement gave no answer: what every store built on the pool returns, so that no
/// store has to borrow another's error type. Whether a statement that timed out or lost its
/// connection committed is unknown; each store says what that means for its callers.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DbError {
    #[error("no database connection: {0}")]
    Pool(String),
    #[error("the database did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the statement failed: {0}")]
    Query(String),
    #[error("the database connection closed: {0}")]
    ConnectionClosed(String),
}

impl From<ConnectError> for DbError {
    fn from(e: ConnectError) -> Self {
        match e {
            ConnectError::Postgres(e) => e.into(),
            // No connection was made: nothing was asked of the database.
            ConnectError::Unanswered(_) | ConnectError::Servers(_) => DbError::Pool(e.to_string()),
        }
    }
}

impl From<tokio_postgres::Error> for DbError {
    fn from(e: tokio_postgres::Error) -> Self {
        if e.is_closed() {
            return DbError::ConnectionClosed(e.to_string());
        }
        match e.as_db_error() {
            Some(db) => DbError::Query(format!("{}: {}", db.code().code(), db.message())),
            None => DbError::Query(e.to_string()),
        }
    }
}

impl From<deadpool_postgres::PoolError> for DbError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        DbError::Pool(pool_error_text(&e))
    }
}

/// A pool's error as an operator should read it: a session the settings check refused is said
/// in the check's own words.
fn pool_error_text(e: &deadpool_postgres::PoolError) -> String {
    match e {
        deadpool_postgres::PoolError::PostCreateHook(HookError::Message(refusal)) => {
            refusal.to_string()
        }
        other => causes(other),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DatabaseError {
    #[error("embedded PostgreSQL: {0}")]
    Server(#[from] ServerError),
    #[error("database.url: {0}")]
    Url(#[from] crate::tls::postgres::PgTlsError),
    #[error("cannot connect to PostgreSQL at {target}: {source}")]
    Connect {
        target: String,
        #[source]
        source: ConnectError,
    },
    #[error("{0}")]
    Migrate(#[from] migrate::MigrateError),
    #[error("cannot build the connection pool: {0}")]
    Pool(String),
    #[error(
        "the database role may not complete idempotency records: {0} (it needs SELECT and \
         UPDATE on idempotency_record)"
    )]
    Access(String),
    #[error("schema maintenance: {0}")]
    Maintenance(String),
    #[error("{what}: {cause}")]
    Sessions { what: &'static str, cause: String },
}

/// Opens one session of `pool` now, so that a session the settings check refuses (a pooler
/// that drops startup options, a role whose commits are not durable) stops the start, saying
/// which setting, instead of showing only in `/readyz` once requests fail. `what` names the
/// sessions in the error. Any other failure (a timeout, too many connections) may pass: it is
/// logged, and the pool tries again when a statement needs a session, as it always has.
pub async fn open_one(pool: &Pool, what: &'static str) -> Result<(), DatabaseError> {
    match pool.get().await {
        Ok(_session) => Ok(()),
        Err(deadpool_postgres::PoolError::PostCreateHook(HookError::Message(refusal)))
            if refusal.starts_with(REFUSAL) =>
        {
            Err(DatabaseError::Sessions {
                what,
                cause: refusal.to_string(),
            })
        }
        Err(e) => {
            tracing::warn!(sessions = what, error = %pool_error_text(&e),
                "could not open a database session at start; trying again when one is needed");
            Ok(())
        }
    }
}

/// Runs the completion of idempotency records
/// ([`COMPLETE_SQL`](crate::store::completions::COMPLETE_SQL)) for one record that cannot
/// exist (an empty account), so that its privileges are checked and nothing changes. A role
/// that may not (no UPDATE on the table, a read-only session) would otherwise start, report
/// ready, and fail every completion batch.
async fn check_completion_access(client: &tokio_postgres::Client) -> Result<(), DatabaseError> {
    let none: &[&str] = &[""];
    let probe = client
        .query(
            crate::store::completions::COMPLETE_SQL,
            &[
                &none,
                &none,
                &none,
                &[0i16].as_slice(),
                &["{}"].as_slice(),
                &[None::<&[u8]>].as_slice(),
                &[false].as_slice(),
            ],
        )
        .await;
    match probe {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => {
            Err(DatabaseError::Access(causes(&e)))
        }
        Err(e) => Err(DatabaseError::Migrate(migrate::MigrateError::Database(e))),
    }
}

/// An error and its causes, `a: b: c`: tokio-postgres's own message ("error performing TLS
/// handshake", "db error") leaves out the cause that says what went wrong.
pub(crate) fn causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string().trim_end().to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        let next = e.to_string().trim_end().to_string();
        // Wrappers that repeat their cause's text are not repeated.
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        cause = e.source();
    }
    text
}

/// A check every new session of a pool passes before it is used, installed once the checker
/// exists ([`SessionGate::install`]); until then sessions pass unchecked (start-up's own
/// reads). railguard's is the store epoch (`crate::store::epoch`): a session on a server
/// other than the one the database was acknowledged on is fenced before it is used.
#[derive(Clone, Default)]
pub struct SessionGate(Arc<std::sync::Mutex<Option<Arc<dyn SessionCheck>>>>);

/// What a [`SessionGate`] runs on each new session; an error refuses the session.
pub trait SessionCheck: Send + Sync {
    fn check<'a>(
        &'a self,
        client: &'a mut tokio_postgres::Client,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'a>>;
}

impl SessionGate {
    /// Every session opened from now on passes `check`.
    pub fn install(&self, check: Arc<dyn SessionCheck>) {
        *self.0.lock().expect("session gate") = Some(check);
    }

    /// Runs the installed check on `client` now (sessions opened before it was installed).
    pub async fn check(&self, client: &mut tokio_postgres::Client) -> Result<(), String> {
        let installed = self.0.lock().expect("session gate").clone();
        match installed {
            Some(check) => check.check(client).await,
            None => Ok(()),
        }
    }

    fn hook(&self) -> Hook {
        let gate = self.clone();
        Hook::async_fn(move |session: &mut ClientWrapper, _| {
            let gate = gate.clone();
            Box::pin(async move {
                let client: &mut tokio_postgres::Client = session;
                gate.check(client).await.map_err(HookError::message)
            })
        })
    }
}

/// The pool, and the embedded server when there is one.
pub struct Database {
    pub pool: Pool,
    /// The check the pool's sessions (and those of [`Database::look_pool`] and
    /// [`Database::completion_pool`]) pass.
    pub gate: SessionGate,
    /// The pool's commits reported as done but not replicated, per session ([`notices`]).
    pub notices: Notices,
    /// Where the database is, for connections outside the pool (LISTEN): `database.url`
    /// with `database.tls_ca_file` folded in as `sslrootcert` ([`url_of`]).
    pub url: String,
    pub server: Option<PostgresServer>,
}

impl Database {
    /// Starts the embedded server if configured, migrates, and builds the pool.
    pub async fn open(config: &DatabaseConfig) -> Result<Self, DatabaseError> {
        let (url, server) = match &config.url {
            DatabaseUrl::Postgres(_) => (url_of(config), None),
            DatabaseUrl::Embedded => {
                let options = ServerOptions {
                    data_dir: config.data_dir.clone(),
                    // The socket file is named after the port; no TCP port is opened.
                    port: 5432,
                    access: Access::Socket,
                    settings: Vec::new(),
                    initdb_args: Vec::new(),
                };
                let mut server = PostgresServer::init(options).await?;
                server.start().await?;
                tracing::info!(data_dir = %server.data_dir().display(),
                    "embedded PostgreSQL started (Unix socket in its data directory only)");
                (server.url(), Some(server))
            }
        };
        let timeout = config.timeout;
        if let Err(e) = migrate_url(&url, timeout).await {
            if let Some(mut server) = server {
                server.stop().await;
            }
            return Err(e);
        }
        let gate = SessionGate::default();
        let notices = Notices::default();
        let pool = pool_gated(&url, config.pool_size, timeout, Some(&gate), Some(&notices))?;
        Ok(Self {
            pool,
            gate,
            notices,
            url,
            server,
        })
    }

    /// Resolves if the embedded server exits on its own; pending forever otherwise.
    pub async fn embedded_exited(&mut self) -> String {
        match self.server.as_mut() {
            Some(server) => server.exited().await,
            None => std::future::pending().await,
        }
    }

    /// Stops the embedded server, if any. Call after the last request has finished.
    pub async fn shutdown(mut self) {
        self.pool.close();
        if let Some(server) = self.server.as_mut() {
            server.stop().await;
            tracing::info!("embedded PostgreSQL stopped");
        }
    }
}

/// The connection string of a `postgres://` `database.url`, with `database.tls_ca_file` as
/// its `sslrootcert` unless it names one itself (see `tls::postgres`).
pub fn url_of(config: &DatabaseConfig) -> String {
    crate::tls::postgres::with_root_cert(
        &config.url.to_string(),
        std::path::Path::new(&config.tls_ca_file),
    )
}

/// Settings and TLS connector for `url`, with railguard's timeouts (`sslmode` honoured; see
/// `tls::postgres`).
pub(crate) fn pg_config(url: &str, timeout: Duration) -> Result<PgConnect, DatabaseError> {
    let mut connect = crate::tls::postgres::connect_config(url)?;
    let config = &mut connect.config;
    // A statement that cannot finish in time is cancelled by the server rather than committed
    // after we stopped waiting; a peer that stops acknowledging is given up on as quickly.
    config
        .connect_timeout(timeout)
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(10))
        .keepalives_interval(Duration::from_secs(2))
        .keepalives_retries(3)
        .tcp_user_timeout(timeout * 2)
        .options(startup_options(&timeout_settings(timeout)))
        .application_name("railguard");
    Ok(connect)
}

/// Why a connection could not be established.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("{}", causes(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// The connection was not established within the limit: the TCP connection did not
    /// open, or the server — or something on the way to it — took it and did not complete the
    /// start-up (a stopped server whose kernel still accepts, say).
    #[error(
        "no connection within {} ms: the server, or something on the way to it, did not open \
         the connection or did not answer its start-up",
        .0.as_millis()
    )]
    Unanswered(Duration),
    /// Every server of a URL that names several failed, each as it says (`server`: `host:port`).
    #[error("{}", .0.iter().map(|(server, e)| format!("{server}: {e}")).collect::<Vec<_>>().join("; "))]
    Servers(Vec<(String, ConnectError)>),
}

/// `config.connect(tls)`, the URL's servers tried in turn and the first to connect used
/// (`db::hosts`), all of it within the configuration's connect timeout (`database.timeout_ms`,
/// set by `pg_config`; 10 s where none is set). tokio-postgres bounds only each TCP connect,
/// and a server — or a stopped process whose kernel still accepts — that takes the connection
/// and never answers the start-up (TLS, the startup message, authentication, the read-write
/// check) would hold the caller for ever, and keep it from the servers named after it. What
/// comes after the start-up is bounded by whoever sends it. Every connection railguard opens
/// outside its pools is made here; a pool's go through `hosts::for_a_pool` (`pool_builder`).
pub async fn establish<T>(
    config: &tokio_postgres::Config,
    tls: T,
) -> Result<
    (
        tokio_postgres::Client,
        tokio_postgres::Connection<tokio_postgres::Socket, T::Stream>,
    ),
    ConnectError,
>
where
    T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket> + Clone,
{
    hosts::alone(config, tls).await.map_err(|mut failed| {
        if failed.len() == 1 {
            let (_, failure) = failed.remove(0);
            return ConnectError::from(failure);
        }
        ConnectError::Servers(
            failed
                .into_iter()
                .map(|(server, failure)| (server, failure.into()))
                .collect(),
        )
    })
}

impl From<hosts::Failure> for ConnectError {
    fn from(failure: hosts::Failure) -> Self {
        match failure {
            hosts::Failure::Refused(e) => ConnectError::Postgres(e),
            hosts::Failure::Unanswered(limit) => ConnectError::Unanswered(limit),
        }
    }
}

/// How often a long-lived session of railguard's own (the instance lock, the lock backend's
/// release listener) asks its server whether it still answers and still takes writes
/// ([`still_primary`]).
pub(crate) const SESSION_CHECK: Duration = Duration::from_secs(5);

/// Whether the server of a long-lived session of its own still answers and still takes
/// writes. A paused server, or a path that holds its packets, leaves such a session open and
/// silent: the kernel still acknowledges keepalives, and an idle session leaves nothing
/// unacknowledged for `tcp_user_timeout`. Only asking shows it. One round trip (a simple
/// query), given `timeout` or [`SESSION_CHECK`], whichever is longer: a server that leaves a
/// trivial query unanswered that long is gone for this connection's purposes, while a spell of
/// slow round trips — which the statements on the pools' sessions ride out — does not end a
/// session that is hard to open again over that same slow path.
pub(crate) async fn still_primary(
    client: &tokio_postgres::Client,
    timeout: Duration,
) -> Result<(), String> {
    let limit = timeout.max(SESSION_CHECK);
    let asked = client.simple_query("SELECT pg_is_in_recovery()");
    let answer = match tokio::time::timeout(limit, asked).await {
        Ok(Ok(messages)) => messages.into_iter().find_map(|message| match message {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        }),
        Ok(Err(e)) => return Err(format!("its server failed the check: {}", causes(&e))),
        Err(_) => return Err(format!("its server did not answer within {limit:?}")),
    };
    match answer.as_deref() {
        Some("f") => Ok(()),
        Some("t") => Err("its server no longer takes writes".into()),
        other => Err(format!("its server answered the check with {other:?}")),
    }
}

/// One connection outside the pool, TLS as `url` asks: for commands that need a single
/// session. The connection's driver runs on a task of its own.
pub async fn connect(
    url: &str,
    timeout: Duration,
) -> Result<(tokio_postgres::Client, tokio::task::JoinHandle<()>), DatabaseError> {
    open(pg_config(url, timeout)?, url).await
}

/// [`connect`] with settings of the caller's (`url` names the server in errors).
pub(crate) async fn open(
    connect: PgConnect,
    url: &str,
) -> Result<(tokio_postgres::Client, tokio::task::JoinHandle<()>), DatabaseError> {
    let PgConnect { config, tls, .. } = connect;
    let target = redact(url);
    let (client, conn) = establish(&config, tls)
        .await
        .map_err(|source| DatabaseError::Connect { target, source })?;
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok((client, conn))
}

/// Applies pending migrations over a connection of its own, then checks that this role may
/// run the completion of idempotency records.
pub async fn migrate_url(url: &str, timeout: Duration) -> Result<usize, DatabaseError> {
    let (mut client, conn) = connect(url, timeout).await?;
    let applied = migrate::migrate(&mut client).await?;
    check_completion_access(&client).await?;
    drop(client);
    let _ = conn.await;
    Ok(applied)
}

/// A pool whose connections are opened lazily and checked for closure when reused.
pub fn build_pool(url: &str, size: usize, timeout: Duration) -> Result<Pool, DatabaseError> {
    pool_gated(url, size, timeout, None, None)
}

fn pool_gated(
    url: &str,
    size: usize,
    timeout: Duration,
    gate: Option<&SessionGate>,
    notices: Option<&Notices>,
) -> Result<Pool, DatabaseError> {
    let connect = pg_config(url, timeout)?;
    // Asked for TLS, yet nothing to authenticate the server with (libpq's `require` without a
    // root certificate): said once. The default `prefer` is not worth a warning at every start.
    if connect.mode == SslMode::Require && !connect.tls.authenticates_server() {
        tracing::warn!(sslmode = ?connect.mode,
            "sslmode=require without a CA (sslrootcert or database.tls_ca_file): sessions are \
             encrypted, but the server is not authenticated");
    }
    pool_of(connect, size, timeout, gate, notices)
}

/// Session settings of the connections that take the fence's last look, which run one
/// statement: `SELECT … WHERE account_id = ANY($1)`. Left to itself, PostgreSQL plans it
/// afresh on most executions (a custom plan for a known small array always looks cheaper than
/// the generic one), and planning is most of its cost. A generic plan is made once, for the
/// table as it is then; without sequential scans it is the primary key's whatever the
/// statistics said (a plan made while the table was small would otherwise scan it whole until
/// something replans).
const LOOK_SESSION_SETTINGS: &[(&str, &str)] = &[
    ("plan_cache_mode", "force_generic_plan"),
    ("enable_seqscan", "off"),
    // A plan costed above `jit_above_cost` (a site's hostile cost settings) would be compiled
    // afresh at every execution.
    ("jit", "off"),
];

/// Session settings of the connections that store idempotency completions
/// ([`COMPLETE_SQL`](crate::store::completions::COMPLETE_SQL), and nothing else). One generic
/// plan, as the look's; the planner may reach `idempotency_record` only by a primary-key
/// lookup inside the statement and a nested loop fetching each row by the position it found
/// (sequential scans, hash and merge joins off; nested loops, TID and index scans on, whatever
/// the site's defaults say): see the statement's docs. And commits that do not wait for their
/// WAL flush: a completion lost to a crash leaves its record in flight, then in doubt — a retry
/// is refused, never forwarded twice (`store::records`' `outcomes`). Everything else, the
/// record's creation with the fence's compare-and-set above all, commits durably on the main
/// pool.
const COMPLETION_SESSION_SETTINGS: &[(&str, &str)] = &[
    ("plan_cache_mode", "force_generic_plan"),
    ("enable_seqscan", "off"),
    ("enable_hashjoin", "off"),
    ("enable_mergejoin", "off"),
    ("enable_nestloop", "on"),
    ("enable_tidscan", "on"),
    ("enable_indexscan", "on"),
    ("jit", "off"),
    ("synchronous_commit", "off"),
];

/// The pool of the fence's last look: `size` sessions with `LOOK_SESSION_SETTINGS` on top
/// of railguard's timeouts, each on a server that takes writes. The look must read what the
/// compare-and-sets wrote: with several hosts in `database.url` and the default
/// `target_session_attrs=any`, a session of its own could land on a standby (a primary that
/// did not answer in time when it connected) and read marks that lag, while the
/// compare-and-sets, which fail on a standby, stay on the primary.
pub fn build_look_pool(url: &str, size: usize, timeout: Duration) -> Result<Pool, DatabaseError> {
    sessions_with(url, size, timeout, LOOK_SESSION_SETTINGS, None)
}

/// The pool of the idempotency completions: `size` sessions with
/// `COMPLETION_SESSION_SETTINGS` on top of railguard's timeouts, each on a server that takes
/// writes (a session on a standby would fail every batch).
pub fn build_completion_pool(
    url: &str,
    size: usize,
    timeout: Duration,
) -> Result<Pool, DatabaseError> {
    sessions_with(url, size, timeout, COMPLETION_SESSION_SETTINGS, None)
}

impl Database {
    /// The last look's sessions ([`build_look_pool`]), each passing this database's gate.
    pub fn look_pool(&self, size: usize, timeout: Duration) -> Result<Pool, DatabaseError> {
        sessions_with(
            &self.url,
            size,
            timeout,
            LOOK_SESSION_SETTINGS,
            Some(&self.gate),
        )
    }

    /// The completions' sessions ([`build_completion_pool`]), each passing this database's
    /// gate.
    pub fn completion_pool(&self, size: usize, timeout: Duration) -> Result<Pool, DatabaseError> {
        sessions_with(
            &self.url,
            size,
            timeout,
            COMPLETION_SESSION_SETTINGS,
            Some(&self.gate),
        )
    }
}

/// A session setting railguard asks for at connect (`-c name=value` in the startup options),
/// and the value `pg_settings` must then show for it (with its unit, as `5000ms`).
type Setting = (&'static str, String);

/// How the settings check's refusals begin (and nothing else it says): what [`open_one`] stops
/// the start for.
const REFUSAL: &str = "the session's ";

/// A setting a session must not have, whatever asked for it (a role's, a database's or the
/// server's configuration: railguard does not ask for it at connect), and why.
type Forbidden = (&'static str, &'static [&'static str], &'static str);

/// The main pool's sessions run the fence's compare-and-sets, which create idempotency records
/// in the same commit, and the lock backend's grants: those commits must be durable. A mark
/// lost to a crash after its verdict was given would let an older token through again, and a
/// record lost so would let a retry reach the rail twice. Every other value (`local`, `on`,
/// `remote_write`, `remote_apply`) waits for the local WAL flush; what a synchronous standby
/// adds is about failover, which is the site's replication setup (docs/operations.md).
const DURABLE_COMMITS: &[Forbidden] = &[(
    "synchronous_commit",
    &["off"],
    "the fence's compare-and-sets, idempotency records and grants must commit durably: set it \
     to on (or local, remote_write, remote_apply) where it is set (ALTER ROLE … IN DATABASE, \
     ALTER ROLE, ALTER DATABASE, the server's configuration)",
)];

/// railguard's timeouts, asked of every pooled session (see [`pg_config`]).
fn timeout_settings(timeout: Duration) -> Vec<Setting> {
    let ms = format!("{}ms", timeout.as_millis().max(1));
    vec![("statement_timeout", ms.clone()), ("lock_timeout", ms)]
}

/// The startup options that ask for `settings`.
fn startup_options(settings: &[Setting]) -> String {
    settings
        .iter()
        .map(|(name, value)| format!("-c {name}={value}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Sessions for one statement, with `settings` on top of railguard's timeouts, on a server
/// that takes writes. Each new session is checked to have them ([`settings_check`]).
fn sessions_with(
    url: &str,
    size: usize,
    timeout: Duration,
    settings: &'static [(&'static str, &'static str)],
    gate: Option<&SessionGate>,
) -> Result<Pool, DatabaseError> {
    let mut wanted = timeout_settings(timeout);
    wanted.extend(
        settings
            .iter()
            .map(|(name, value)| (*name, value.to_string())),
    );
    let mut connect = pg_config(url, timeout)?;
    connect
        .config
        .options(startup_options(&wanted))
        .target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
    let PgConnect { config, tls, .. } = connect;
    pool_builder(config, tls, size, timeout, wanted, &[], gate, None)
        .build()
        .map_err(|e| DatabaseError::Pool(e.to_string()))
}

fn pool_of(
    connect: PgConnect,
    size: usize,
    timeout: Duration,
    gate: Option<&SessionGate>,
    notices: Option<&Notices>,
) -> Result<Pool, DatabaseError> {
    let PgConnect { config, tls, .. } = connect;
    pool_builder(
        config,
        tls,
        size,
        timeout,
        timeout_settings(timeout),
        DURABLE_COMMITS,
        gate,
        notices,
    )
    .build()
    .map_err(|e| DatabaseError::Pool(e.to_string()))
}

/// Checks each new session of a pool for the settings railguard asked for at connect. A pooler
/// in between that drops startup options would otherwise leave every statement without its
/// `statement_timeout` and `lock_timeout` (a statement stalled on a lock would then wait
/// forever instead of failing with nothing committed), and the look's and the completions'
/// statements to whatever plan the site's defaults give, with nothing said. Such a session is
/// not used, and the error names the setting. `forbidden`: values a session must not have at
/// all (the main pool's non-durable commits). One query per session opened, none per checkout.
fn settings_check(
    wanted: Vec<Setting>,
    forbidden: &'static [Forbidden],
    timeout: Duration,
) -> Hook {
    let wanted: Arc<[Setting]> = wanted.into();
    Hook::async_fn(move |session: &mut ClientWrapper, _| {
        let wanted = wanted.clone();
        Box::pin(async move {
            let names: Vec<&str> = wanted
                .iter()
                .map(|(name, _)| *name)
                .chain(forbidden.iter().map(|(name, _, _)| *name))
                .collect();
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&names];
            let query = session.query(
                "SELECT name, setting || coalesce(unit, ''), source FROM pg_catalog.pg_settings \
                 WHERE name = ANY($1)",
                &params,
            );
            let rows = answered(timeout, query).await?;
            let found: HashMap<String, String> =
                rows.iter().map(|row| (row.get(0), row.get(1))).collect();
            let sources: HashMap<String, String> =
                rows.iter().map(|row| (row.get(0), row.get(2))).collect();
            for (name, value) in wanted.iter() {
                match found.get(*name) {
                    Some(seen) if seen == value => {}
                    seen => {
                        return Err(HookError::message(format!(
                            "{REFUSAL}{name} is {}, not {value} as railguard asked at connect \
                             (a pooler that drops startup options?); not used",
                            seen.map_or("unknown", String::as_str)
                        )));
                    }
                }
            }
            let mut pinned: (Vec<&str>, Vec<&str>) = (Vec::new(), Vec::new());
            for (name, refused, why) in forbidden {
                let Some(seen) = found.get(*name) else {
                    continue;
                };
                if refused.contains(&seen.as_str()) {
                    let source = sources.get(*name).map_or("unknown", String::as_str);
                    return Err(HookError::message(format!(
                        "{REFUSAL}{name} is {seen} (from: {source}): {why}; not used"
                    )));
                }
                pinned.0.push(name);
                pinned.1.push(seen);
            }
            // What was checked stays so for the session's life: a value the session did not set
            // itself would follow a later change of the server's configuration on reload.
            if !pinned.0.is_empty() {
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
                    [&pinned.0, &pinned.1];
                let pin = session.query(
                    "SELECT set_config(n, v, false) FROM unnest($1::text[], $2::text[]) AS p(n, v)",
                    &params,
                );
                answered(timeout, pin).await?;
            }
            Ok(())
        })
    })
}

/// A statement of the settings check, bounded like the connect: deadpool's create timeout does
/// not cover the hook, and a path that stalls the query while acknowledging its bytes fires no
/// other timeout. Its failures are not refusals (they do not begin with [`REFUSAL`]).
async fn answered(
    timeout: Duration,
    statement: impl Future<Output = Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>>,
) -> Result<Vec<tokio_postgres::Row>, HookError> {
    tokio::time::timeout(timeout, statement)
        .await
        .map_err(|_| {
            HookError::message(format!(
                "no answer to the session's settings check within {timeout:?}"
            ))
        })?
        .map_err(HookError::Backend)
}

#[allow(clippy::too_many_arguments)]
fn pool_builder(
    config: tokio_postgres::Config,
    tls: PgTls,
    size: usize,
    timeout: Duration,
    wanted: Vec<Setting>,
    forbidden: &'static [Forbidden],
    gate: Option<&SessionGate>,
    notices: Option<&Notices>,
) -> PoolBuilder {
    let manager_config = ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let manager = match notices {
        Some(notices) => Manager::from_connect(config, notices.connect(tls), manager_config),
        None => Manager::from_connect(
            config,
            hosts::InTurn {
                tls,
                answered: hosts::LastAnswered::default(),
            },
            manager_config,
        ),
    };
    let builder = Pool::builder(manager)
        .max_size(size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(timeout))
        .create_timeout(Some(timeout))
        .recycle_timeout(Some(timeout))
        .post_create(settings_check(wanted, forbidden, timeout));
    let builder = match notices {
        Some(notices) => builder.post_create(notices.hook(timeout)),
        None => builder,
    };
    match gate {
        Some(gate) => builder.post_create(gate.hook()),
        None => builder,
    }
}

/// The URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}{user}@{}", &url[..scheme + 3], &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn redact_hides_passwords() {
        assert_eq!(
            super::redact("postgres://u:secret@h:5432/d"),
            "postgres://u@h:5432/d"
        );
        assert_eq!(super::redact("postgres://h/d"), "postgres://h/d");
    }
}
