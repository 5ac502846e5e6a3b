//! The `statements` suite: what each of railguard's statements costs PostgreSQL, measured
//! alone, and what variants of them would cost instead (`RETURNING`, `updated_at`, prepared
//! array binds, batch size, the forwarder entry, designs of the keyed record not built).
//!
//! The wire suite measures PostgreSQL's CPU per request with everything else running on the
//! same two cores, and cannot say which statement it went to, nor what a statement that
//! railguard does not run would cost. Here one client runs one statement at a time — as
//! railguard's batchers do at `fencing.batch_concurrency = 1` — on sessions opened exactly as
//! railguard opens its own (`db::build_pool`, `build_look_pool`, `build_completion_pool`), with
//! the statement texts railguard runs (`ADVANCE_BATCH_SQL`, `BATCH_SQL`, `LAST_LOOK_SQL`,
//! `COMPLETE_SQL`); the
//! variants are derived from those texts by replacing one part, and a variant whose
//! replacement no longer matches stops the run instead of measuring the original twice.
//!
//! Each phase runs a batch size and a variant for a fixed time; phases are interleaved
//! round-robin and repeated, and the tables quote medians. CPU is read from `/proc` for the
//! statement's own backend (the session that ran it) and for the whole server (the WAL writer,
//! checkpointer and the rest), WAL bytes from `pg_current_wal_insert_lsn()`.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use railguard::db::{build_completion_pool, build_look_pool, build_pool};
use railguard::store::marks::{ADVANCE_BATCH_SQL, BATCH_SQL, LAST_LOOK_SQL};

/// [`ADVANCE_BATCH_SQL`] as one process runs it: its forwarder entry (process and sequence
/// number, `store::handover`) written in as constants, so that it takes the accounts and tokens
/// alone and the other designs' parameters follow them unchanged.
fn fence_sql() -> Result<String, String> {
    replace_once(
        ADVANCE_BATCH_SQL,
        "ARRAY[$3::bigint], ARRAY[$4::bigint]",
        "ARRAY[1::bigint], ARRAY[1::bigint]",
        "fence, one process",
    )
}

/// [`BATCH_SQL`] as one process runs it: its sequence number written in, as in [`fence_sql`].
fn batch_sql() -> Result<String, String> {
    replace_once(
        BATCH_SQL,
        "ARRAY[$9::bigint], ARRAY[$10::bigint]",
        "ARRAY[$9::bigint], ARRAY[1::bigint]",
        "keyed, one process",
    )
}
use railguard::store::records::COMPLETE_SQL;
use railguard_testkit::Pg;
use std::fmt::Write as _;

use crate::load::{SplitMix64, percentile};
use crate::report::median;
use crate::wire::procs::{Usage, ticks_of};

/// Accounts of the run are `stmt-1..=accounts`.
const PREFIX: &str = "stmt-";
/// Most accounts the suite seeds (one statement, before the first phase).
const MAX_ACCOUNTS: u64 = 1_000_000;
/// How long a statement may take before the run gives up on it.
const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub(crate) struct StatementOptions {
    pub duration: Duration,
    pub warmup: Duration,
    pub repeats: u32,
    pub accounts: u64,
    /// Rows per statement, one phase group each.
    pub rows: Vec<usize>,
    /// The statements measured, each at every size.
    pub variants: Vec<Variant>,
    pub pg_settings: Vec<(String, String)>,
}

/// What one phase runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Variant {
    /// The fence's compare-and-set as railguard runs a batch without keys.
    Fence,
    /// The same without `updated_at = now()`.
    FenceWithoutUpdatedAt,
    /// The same without `RETURNING` (railguard cannot do without it: it is the verdict).
    FenceWithoutReturning,
    /// The same without the calling process's forwarder entry (`store::handover`): what the
    /// cross-process order costs the statement of one process.
    FenceWithoutForwarders,
    /// The keyed batch's statement (`BATCH_SQL`) with no records: what a batch without keys
    /// would cost PostgreSQL if it ran that instead of `ADVANCE_BATCH_SQL`.
    RecordsStatementWithoutRecords,
    /// The fence statement with its rows written into the text as a `VALUES` list, sent
    /// unprepared: what prepared array binds save.
    FenceLiteral,
    /// The last look.
    Look,
    /// The fence statement creating a record for every row (a keyed request), then the
    /// completion of those records on the completion sessions: two statements, each measured.
    Keyed,
    /// A design railguard does not run: the keyed statement also completes the records the
    /// previous statement made, in its own durable commit — one statement and one commit per
    /// keyed request instead of two. Today's table and texts (`BATCH_SQL` with `COMPLETE_SQL`
    /// as a third part), on a durable session with one generic plan and no sequential scans.
    KeyedFolded,
    /// The same folded statement on the narrowest record C3 §3.1 needs ([`LEAN_TABLE`]): what
    /// PostgreSQL's share of a keyed request could come to with another schema.
    LeanFolded,
    /// The same on a record found by a 16-byte hash of its account and key, with retention's
    /// index a BRIN one ([`HASHED_TABLE`]): the cheapest indexes such a record could have.
    HashedFolded,
    /// The hashed record made with the compare-and-set, and completed by a statement of its
    /// own that does not wait for its WAL flush, as railguard completes today's: the creation
    /// is what a client must wait for, and a completion whose client need not wait for it could
    /// be batched without the connections' limit (run it at several `--batch-rows`).
    HashedSplit,
}

impl Variant {
    pub(crate) const ALL: [Variant; 12] = [
        Variant::Fence,
        Variant::FenceWithoutUpdatedAt,
        Variant::FenceWithoutReturning,
        Variant::FenceWithoutForwarders,
        Variant::RecordsStatementWithoutRecords,
        Variant::FenceLiteral,
        Variant::Look,
        Variant::Keyed,
        Variant::KeyedFolded,
        Variant::LeanFolded,
        Variant::HashedFolded,
        Variant::HashedSplit,
    ];

    fn folded(self) -> bool {
        matches!(
            self,
            Variant::KeyedFolded | Variant::LeanFolded | Variant::HashedFolded
        )
    }

    fn label(self) -> &'static str {
        match self {
            Variant::Fence => "fence statement, no keys (`ADVANCE_BATCH_SQL`)",
            Variant::FenceWithoutUpdatedAt => "… without `updated_at = now()`",
            Variant::FenceWithoutReturning => "… without `RETURNING`",
            Variant::FenceWithoutForwarders => "… without the forwarder entry (`store::handover`)",
            Variant::RecordsStatementWithoutRecords => {
                "the keyed statement (`BATCH_SQL`) with no records"
            }
            Variant::FenceLiteral => "… rows as a literal `VALUES` list, unprepared",
            Variant::Look => "last look",
            Variant::Keyed => "fence statement with a record per row (keys, `BATCH_SQL`)",
            Variant::KeyedFolded => {
                "not built: `BATCH_SQL` also completing the previous statement's records, durable"
            }
            Variant::LeanFolded => "not built: the same on the narrowest record (`LEAN_TABLE`)",
            Variant::HashedFolded => {
                "not built: the same found by a 16-byte hash, BRIN for retention (`HASHED_TABLE`)"
            }
            Variant::HashedSplit => "not built: that record made with the compare-and-set",
        }
    }
}

/// The narrowest idempotency record C3 §3.1 needs, for [`Variant::LeanFolded`]: the key, the
/// request's fingerprint as its 32 bytes, the owner as one number (railguard's owner id and
/// instance together), the deadline after which a record in flight is in doubt, and the
/// stored answer as one value (status, headers and body encoded by railguard; NULL while in
/// flight). `created_at` and its index are retention's, as `railguard serve` keeps them.
const LEAN_TABLE: &str = "\
CREATE TABLE lean_record (
    account_id      text        NOT NULL,
    idempotency_key text        NOT NULL,
    fingerprint     bytea       NOT NULL,
    owner           bigint      NOT NULL,
    in_doubt_at     timestamptz NOT NULL,
    response        bytea,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, idempotency_key)
);
CREATE INDEX lean_record_created_at ON lean_record (created_at)";

/// [`LEAN_TABLE`] with the cheapest indexes it could have, for [`Variant::HashedFolded`]: the
/// primary key a 16-byte hash of account and key (railguard would compute it; the account and
/// key are kept, unindexed, to check a match), and retention's index a BRIN one, which a
/// table filled in `created_at` order keeps at almost no cost per row.
const HASHED_TABLE: &str = "\
CREATE TABLE hashed_record (
    record_id       bytea       PRIMARY KEY,
    account_id      text        NOT NULL,
    idempotency_key text        NOT NULL,
    fingerprint     bytea       NOT NULL,
    owner           bigint      NOT NULL,
    in_doubt_at     timestamptz NOT NULL,
    response        bytea,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX hashed_record_created_at ON hashed_record USING brin (created_at)";

/// The lean record's creation: the part of a keyed batch's statement after the fence's
/// compare-and-set (`fenced`), whose accepted requests' records it makes.
const LEAN_RECORDED: &str = "\
    INSERT INTO lean_record AS r (account_id, idempotency_key, fingerprint, owner, in_doubt_at)
    SELECT i.account_id, i.key, i.fingerprint, i.owner, now() + interval '31 s'
    FROM unnest($3::text[], $4::text[], $5::bytea[], $6::bigint[])
        AS i(account_id, key, fingerprint, owner)
    WHERE i.account_id IN (SELECT account_id FROM fenced)
    ORDER BY i.account_id, i.key
    ON CONFLICT (account_id, idempotency_key) DO UPDATE SET owner = EXCLUDED.owner
        WHERE r.owner = EXCLUDED.owner
    RETURNING account_id, idempotency_key";

/// The lean record's completion. A join by key, which the folded session's settings (no
/// sequential scans, one generic plan) keep to one primary-key lookup per row.
const LEAN_COMPLETED: &str = "\
    UPDATE lean_record r SET response = c.response
    FROM (
        SELECT * FROM unnest($7::text[], $8::text[], $9::bigint[], $10::bytea[])
            AS c(account_id, key, owner, response)
        ORDER BY account_id, key
        OFFSET 0
    ) AS c
    WHERE r.account_id = c.account_id AND r.idempotency_key = c.key AND r.owner = c.owner
      AND r.response IS NULL
    RETURNING r.account_id, r.idempotency_key";

/// The hashed record's creation, as [`LEAN_RECORDED`].
const HASHED_RECORDED: &str = "\
    INSERT INTO hashed_record AS r
        (record_id, account_id, idempotency_key, fingerprint, owner, in_doubt_at)
    SELECT i.id, i.account_id, i.key, i.fingerprint, i.owner, now() + interval '31 s'
    FROM unnest($3::bytea[], $4::text[], $5::text[], $6::bytea[], $7::bigint[])
        AS i(id, account_id, key, fingerprint, owner)
    WHERE i.account_id IN (SELECT account_id FROM fenced)
    ORDER BY i.id
    ON CONFLICT (record_id) DO UPDATE SET owner = EXCLUDED.owner
        WHERE r.owner = EXCLUDED.owner
    RETURNING account_id, idempotency_key";

/// The hashed record's completion as a statement of its own ([`Variant::HashedSplit`], on the
/// completion sessions: its commit does not wait for the WAL flush).
const HASHED_COMPLETE_SQL: &str = "\
    UPDATE hashed_record r SET response = c.response
    FROM (
        SELECT * FROM unnest($1::bytea[], $2::bigint[], $3::bytea[]) AS c(id, owner, response)
        ORDER BY id
        OFFSET 0
    ) AS c
    WHERE r.record_id = c.id AND r.owner = c.owner AND r.response IS NULL
    RETURNING r.account_id, r.idempotency_key";

/// A keyed batch's statement: the fence's compare-and-set (`ADVANCE_BATCH_SQL`, parameters 1
/// and 2), the records of its accepted requests, and (folded designs) the completions of the
/// previous statement's records, in one durable commit.
fn keyed_statement(fence: &str, recorded: &str, completed: Option<&str>) -> String {
    let mut text = format!("WITH fenced AS (\n{fence}\n), recorded AS (\n{recorded}\n)");
    if let Some(completed) = completed {
        let _ = write!(text, ", completed AS (\n{completed}\n)");
    }
    text.push_str(
        "\nSELECT account_id, NULL::text FROM fenced\n\
         UNION ALL\nSELECT account_id, idempotency_key FROM recorded",
    );
    if completed.is_some() {
        text.push_str("\nUNION ALL\nSELECT account_id, idempotency_key FROM completed");
    }
    text
}

/// The planner settings of the folded session: one generic plan without sequential scans, as
/// on the completion sessions (`db`'s `COMPLETION_SESSION_SETTINGS`), with commits left
/// durable. Hash and merge joins stay allowed: the records' creation filters on the accepted
/// accounts with a semi-join, which without a hash join is a nested loop over every pair (a
/// first run with them off measured the folded statements at 512 rows dearer per row than at
/// 64). The completions' joins still go by primary key (`EXPLAIN` of the generic plans: an
/// index scan per batch row for the join by key, the position's TID scan for
/// `COMPLETE_SQL`'s).
const FOLDED_SESSION_SETTINGS: &str = "SET plan_cache_mode = force_generic_plan; \
     SET enable_seqscan = off; SET jit = off; SET synchronous_commit = on";

/// The statement texts of a run, derived once (a derivation that does not match is an error).
struct Texts {
    /// [`fence_sql`] and [`batch_sql`].
    fence: String,
    with_records: String,
    fence_without_updated_at: String,
    fence_without_returning: String,
    fence_without_forwarders: String,
    /// [`Variant::KeyedFolded`]: `BATCH_SQL` with `COMPLETE_SQL` as a third part, its
    /// parameters renumbered after the keyed statement's nine.
    keyed_folded: String,
    lean_folded: String,
    hashed_folded: String,
    hashed_create: String,
}

/// `text` with `from` replaced by `to`, which must occur exactly once.
fn replace_once(text: &str, from: &str, to: &str, what: &str) -> Result<String, String> {
    match text.matches(from).count() {
        1 => Ok(text.replacen(from, to, 1)),
        n => Err(format!(
            "deriving the variant \"{what}\": {from:?} occurs {n} times in the statement, not once"
        )),
    }
}

impl Texts {
    fn derive() -> Result<Self, String> {
        let fence = fence_sql()?;
        let with_records = batch_sql()?;
        let returning = fence
            .find("\nRETURNING ")
            .ok_or("deriving the variant \"without RETURNING\": no RETURNING")?;
        Ok(Self {
            fence_without_updated_at: replace_once(
                &fence,
                ", updated_at = now()",
                "",
                "without updated_at",
            )?,
            fence_without_returning: fence[..returning].to_string(),
            fence_without_forwarders: Self::without_forwarders(&fence, returning)?,
            keyed_folded: Self::keyed_folded(&with_records)?,
            lean_folded: keyed_statement(&fence, LEAN_RECORDED, Some(LEAN_COMPLETED)),
            hashed_folded: keyed_statement(
                &fence,
                HASHED_RECORDED,
                Some(&Self::hashed_completed()?),
            ),
            hashed_create: keyed_statement(&fence, HASHED_RECORDED, None),
            fence,
            with_records,
        })
    }

    /// `fence` without the forwarder entry: its columns, their update, and their answer.
    fn without_forwarders(fence: &str, returning: usize) -> Result<String, String> {
        let what = "without the forwarder entry";
        let text = replace_once(
            &fence[..returning],
            "(account_id, highest_token, forwarders, forward_seqs)\nSELECT account_id, token, \
             ARRAY[1::bigint], ARRAY[1::bigint]",
            "(account_id, highest_token)\nSELECT account_id, token",
            what,
        )?;
        let (Some(from), Some(to)) = (
            text.find(",\n        forwarders = CASE"),
            text.find("\n    WHERE h.highest_token"),
        ) else {
            return Err(format!(
                "deriving the variant \"{what}\": no forwarders' update"
            ));
        };
        Ok(format!(
            "{}{}\nRETURNING account_id",
            &text[..from],
            &text[to..]
        ))
    }

    /// [`HASHED_COMPLETE_SQL`] with its parameters after the creation's seven.
    fn hashed_completed() -> Result<String, String> {
        let mut text = HASHED_COMPLETE_SQL.to_string();
        for n in (1..=3).rev() {
            text = replace_once(
                &text,
                &format!("${n}::"),
                &format!("${}::", n + 7),
                "hashed",
            )?;
        }
        Ok(text)
    }

    fn keyed_folded(with_records: &str) -> Result<String, String> {
        let what = "keyed, folded";
        let mut complete = COMPLETE_SQL.to_string();
        // Downwards, so that `$1::` is never read as the start of `$10::`.
        for n in (1..=7).rev() {
            complete = replace_once(
                &complete,
                &format!("${n}::"),
                &format!("${}::", n + 9),
                what,
            )?;
        }
        let text = replace_once(
            with_records,
            "\n)\nSELECT account_id, NULL::text, others, other_seqs FROM fenced",
            &format!(
                "\n), completed AS (\n{complete}\n)\nSELECT account_id, NULL::text, others, \
                 other_seqs FROM fenced"
            ),
            what,
        )?;
        Ok(format!(
            "{text}\nUNION ALL\nSELECT account_id, idempotency_key, NULL, NULL FROM completed"
        ))
    }

    /// The fence statement with `rows` written in, for the simple protocol.
    fn literal(&self, rows: &[(String, i64)]) -> Result<String, String> {
        let values: Vec<String> = rows
            .iter()
            .map(|(account, token)| format!("('{account}', {token}::bigint)"))
            .collect();
        replace_once(
            &self.fence,
            "unnest($1::text[], $2::bigint[])",
            &format!("(VALUES {})", values.join(", ")),
            "literal VALUES",
        )
    }
}

/// One repetition of one phase.
#[derive(Debug, Clone, Default)]
struct Sample {
    statements: u64,
    rows: u64,
    seconds: f64,
    /// CPU seconds of the backend that ran the (first) statement.
    backend_cpu: f64,
    /// The completion's backend (keyed phases).
    completion_cpu: f64,
    /// Records completed by folded statements (the previous statement's).
    completed: u64,
    /// All of PostgreSQL.
    server_cpu: f64,
    wal_bytes: f64,
    /// Latency of each statement (the first of a keyed pair), µs, sorted.
    latencies_us: Vec<u32>,
    completion_latencies_us: Vec<u32>,
}

impl Sample {
    /// One statement (a keyed pair: two) of `rows` rows done.
    fn done(&mut self, rows: usize) {
        self.statements += 1;
        self.rows += rows as u64;
    }
}

/// µs since `at`, as the latency lists hold them.
fn micros_since(at: Instant) -> u32 {
    at.elapsed().as_micros() as u32
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Phase {
    variant: Variant,
    rows: usize,
}

pub(crate) struct StatementReport {
    options: StatementOptions,
    date: String,
    postgres: String,
    samples: Vec<(Phase, Vec<Sample>)>,
}

/// The sessions of a run: one of each kind railguard opens, and their backends.
struct Sessions {
    main: deadpool_postgres::Pool,
    look: deadpool_postgres::Pool,
    completion: deadpool_postgres::Pool,
    /// A durable session with one generic plan and no sequential scans, for the folded
    /// statements railguard does not run.
    folded: tokio_postgres::Client,
    main_pid: u32,
    look_pid: u32,
    completion_pid: u32,
    folded_pid: u32,
}

pub(crate) async fn run(options: StatementOptions) -> Result<StatementReport, String> {
    if options.rows.is_empty() || options.rows.contains(&0) {
        return Err("--batch-rows needs one or more sizes above 0".into());
    }
    // Rows of one statement are distinct accounts; the report names the size asked for.
    if let Some(rows) = options.rows.iter().find(|&&r| r as u64 > options.accounts) {
        return Err(format!(
            "--batch-rows {rows} is more than --accounts {}: a statement's rows are distinct \
             accounts",
            options.accounts
        ));
    }
    if options.accounts > MAX_ACCOUNTS {
        return Err(format!(
            "--accounts {} is more than this suite seeds ({MAX_ACCOUNTS})",
            options.accounts
        ));
    }
    let texts = Texts::derive()?;
    eprintln!("statements: starting PostgreSQL (durable) under /var/tmp");
    let mut builder = Pg::builder().durable(true).temp_dir_in("/var/tmp");
    for (name, value) in &options.pg_settings {
        builder = builder.setting(name, value);
    }
    let mut postgres = builder.start().await.map_err(|e| e.to_string())?;
    let result = with_postgres(&options, &texts, &postgres).await;
    let version = postgres.version().await;
    postgres.server.stop().await;
    let samples = result?;
    Ok(StatementReport {
        date: crate::bench::utc_now(),
        postgres: version,
        options,
        samples,
    })
}

async fn with_postgres(
    o: &StatementOptions,
    texts: &Texts,
    pg: &Pg,
) -> Result<Vec<(Phase, Vec<Sample>)>, String> {
    let url = pg.url();
    railguard::db::migrate_url(&url, TIMEOUT)
        .await
        .map_err(|e| format!("migrating: {e}"))?;
    // The indexes `railguard serve` brings the tables to (the retention index a completion
    // leaves alone, so that completions can be HOT updates), not the numbered migrations' alone.
    match railguard::db::maintenance::run_once(&url, TIMEOUT).await {
        Ok(railguard::db::maintenance::Maintenance::Done { .. }) => {}
        Ok(busy) => return Err(format!("schema maintenance did not run: {busy:?}")),
        Err(e) => return Err(format!("schema maintenance: {e}")),
    }
    let monitor = pg.client_with(&url).await?;
    monitor
        .execute(
            "INSERT INTO rail_high_water (account_id, highest_token)
             SELECT $1 || g, 1 FROM generate_series(1, $2::bigint) g",
            &[&PREFIX, &(o.accounts as i64)],
        )
        .await
        .map_err(|e| format!("seeding accounts: {e}"))?;
    monitor
        .batch_execute("VACUUM ANALYZE rail_high_water")
        .await
        .map_err(|e| format!("vacuum: {e}"))?;
    monitor
        .batch_execute(&format!("{LEAN_TABLE}; {HASHED_TABLE}"))
        .await
        .map_err(|e| format!("creating the lean record's table: {e}"))?;
    let sessions = open_sessions(pg, &url).await?;
    let mut phases: Vec<(Phase, Vec<Sample>)> = o
        .rows
        .iter()
        .flat_map(|&rows| {
            o.variants
                .iter()
                .map(move |&variant| (Phase { variant, rows }, Vec::new()))
        })
        .collect();
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    let mut state = State {
        rng: SplitMix64::new(seed),
        token: 1_000,
        key: 0,
    };
    for round in 1..=o.repeats {
        for (phase, samples) in &mut phases {
            eprintln!(
                "statements: round {round}/{}: {}, {} rows",
                o.repeats,
                phase.variant.label(),
                phase.rows
            );
            let _ = measure(
                o, texts, &sessions, &monitor, pg, *phase, o.warmup, &mut state,
            )
            .await?;
            let sample = measure(
                o, texts, &sessions, &monitor, pg, *phase, o.duration, &mut state,
            )
            .await?;
            samples.push(sample);
        }
    }
    Ok(phases)
}

async fn open_sessions(pg: &Pg, url: &str) -> Result<Sessions, String> {
    let main = build_pool(url, 1, TIMEOUT).map_err(|e| e.to_string())?;
    let look = build_look_pool(url, 1, TIMEOUT).map_err(|e| e.to_string())?;
    let completion = build_completion_pool(url, 1, TIMEOUT).map_err(|e| e.to_string())?;
    let pid = |pool: deadpool_postgres::Pool| async move {
        let client = pool.get().await.map_err(|e| e.to_string())?;
        let row = client
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .map_err(|e| e.to_string())?;
        Ok::<u32, String>(row.get::<_, i32>(0) as u32)
    };
    let folded = pg.client_with(url).await?;
    folded
        .batch_execute(FOLDED_SESSION_SETTINGS)
        .await
        .map_err(|e| format!("the folded session's settings: {e}"))?;
    let folded_pid = folded
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .map_err(|e| e.to_string())?
        .get::<_, i32>(0) as u32;
    Ok(Sessions {
        folded,
        folded_pid,
        main_pid: pid(main.clone()).await?,
        look_pid: pid(look.clone()).await?,
        completion_pid: pid(completion.clone()).await?,
        main,
        look,
        completion,
    })
}

/// What the run's statements draw from.
struct State {
    rng: SplitMix64,
    /// Every row of every statement carries a new, higher token: every compare-and-set is
    /// accepted and moves its row, as a request's does.
    token: i64,
    key: u64,
}

impl State {
    /// A new record for each of `rows`' accounts: key and owner numbered by the run.
    fn records(&mut self, rows: &[(String, i64)]) -> Vec<Made> {
        rows.iter()
            .map(|(account, _)| {
                self.key += 1;
                Made {
                    account: account.clone(),
                    key: format!("key-{}", self.key),
                    owner: self.key as i64,
                }
            })
            .collect()
    }

    /// `n` distinct accounts (at most `accounts`), each with a new token.
    fn rows(&mut self, n: usize, accounts: u64) -> Vec<(String, i64)> {
        let n = n.min(accounts as usize);
        let mut picked = std::collections::BTreeSet::new();
        while picked.len() < n {
            picked.insert(self.rng.below(accounts) + 1);
        }
        picked
            .into_iter()
            .map(|a| {
                self.token += 1;
                (format!("{PREFIX}{a}"), self.token)
            })
            .collect()
    }
}

/// A statement that answered `got` rows where `want` were due measured something else.
fn expect_rows(what: &str, got: usize, want: usize) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: {got} rows answered where {want} were due"))
    }
}

/// A record a keyed statement makes (a folded one's, for the next one to complete).
struct Made {
    account: String,
    key: String,
    owner: i64,
}

impl Made {
    /// A stand-in for the 16-byte hash railguard would compute over account and key: unique
    /// per record, and spread over the index as a hash is.
    fn id(&self) -> [u8; 16] {
        let mut rng = SplitMix64::new(self.owner as u64);
        let (a, b) = (rng.next(), rng.next());
        let mut id = [0; 16];
        id[..8].copy_from_slice(&a.to_be_bytes());
        id[8..].copy_from_slice(&b.to_be_bytes());
        id
    }

    /// The owner as today's table holds it (text).
    fn owner_text(&self) -> String {
        format!("owner-{}", self.owner)
    }
}

/// The stored answer as one value for [`LEAN_TABLE`]: the status, then the headers' and the
/// body's lengths and bytes (the same headers and body the other keyed phases store).
fn lean_response(headers: &str, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(10 + headers.len() + body.len());
    out.extend_from_slice(&201_u16.to_be_bytes());
    for part in [headers.as_bytes(), body] {
        out.extend_from_slice(&(part.len() as u32).to_be_bytes());
        out.extend_from_slice(part);
    }
    out
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    o: &StatementOptions,
    texts: &Texts,
    s: &Sessions,
    monitor: &tokio_postgres::Client,
    pg: &Pg,
    phase: Phase,
    duration: Duration,
    state: &mut State,
) -> Result<Sample, String> {
    let main = s.main.get().await.map_err(|e| e.to_string())?;
    let look = s.look.get().await.map_err(|e| e.to_string())?;
    let completion = s.completion.get().await.map_err(|e| e.to_string())?;
    let prepared = |text: &str| {
        let text = text.to_string();
        let main = &main;
        async move { main.prepare_cached(&text).await.map_err(|e| e.to_string()) }
    };
    let fence = prepared(&texts.fence).await?;
    let fence_without_updated_at = prepared(&texts.fence_without_updated_at).await?;
    let fence_without_returning = prepared(&texts.fence_without_returning).await?;
    let fence_without_forwarders = prepared(&texts.fence_without_forwarders).await?;
    let with_records = prepared(&texts.with_records).await?;
    let last_look = look
        .prepare_cached(LAST_LOOK_SQL)
        .await
        .map_err(|e| e.to_string())?;
    let complete = completion
        .prepare_cached(COMPLETE_SQL)
        .await
        .map_err(|e| e.to_string())?;
    let on_folded = |text: &str, what: &'static str| {
        let (folded, text) = (&s.folded, text.to_string());
        async move {
            folded
                .prepare(&text)
                .await
                .map_err(|e| format!("preparing {what}: {e}"))
        }
    };
    let keyed_folded = on_folded(&texts.keyed_folded, "the folded keyed statement").await?;
    let lean_folded = on_folded(&texts.lean_folded, "the folded lean statement").await?;
    let hashed_folded = on_folded(&texts.hashed_folded, "the folded hashed statement").await?;
    let hashed_create = on_folded(&texts.hashed_create, "the hashed creation").await?;
    let hashed_complete = completion
        .prepare_cached(HASHED_COMPLETE_SQL)
        .await
        .map_err(|e| format!("preparing the hashed completion: {e}"))?;
    // The records the previous folded statement made: the next one completes them.
    let mut previous: Vec<Made> = Vec::new();
    let instance: i64 = 42;
    let fingerprint = "f".repeat(64);
    let headers = r#"[["content-type","application/json"],["content-length","27"]]"#.to_string();
    let body: &[u8] = br#"{"id":"pay-0001","ok":true}"#;

    let wal_before: String = monitor
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    let server_before = Usage::of(pg.pid());
    let backend_pid = match phase.variant {
        Variant::Look => s.look_pid,
        v if v.folded() || v == Variant::HashedSplit => s.folded_pid,
        _ => s.main_pid,
    };
    let backend_before = ticks_of(backend_pid);
    let completion_before = ticks_of(s.completion_pid);
    let mut sample = Sample::default();
    let started = Instant::now();
    while started.elapsed() < duration {
        let rows = state.rows(phase.rows, o.accounts);
        let accounts: Vec<&str> = rows.iter().map(|(a, _)| a.as_str()).collect();
        let tokens: Vec<i64> = rows.iter().map(|(_, t)| *t).collect();
        let empty_text: Vec<&str> = Vec::new();
        let empty_int: Vec<i64> = Vec::new();
        let at = Instant::now();
        let returned = match phase.variant {
            Variant::Fence => main
                .query(&fence, &[&accounts, &tokens])
                .await
                .map(|r| r.len()),
            Variant::FenceWithoutUpdatedAt => main
                .query(&fence_without_updated_at, &[&accounts, &tokens])
                .await
                .map(|r| r.len()),
            Variant::FenceWithoutReturning => main
                .execute(&fence_without_returning, &[&accounts, &tokens])
                .await
                .map(|n| n as usize),
            Variant::FenceWithoutForwarders => main
                .query(&fence_without_forwarders, &[&accounts, &tokens])
                .await
                .map(|r| r.len()),
            Variant::RecordsStatementWithoutRecords => main
                .query(
                    &with_records,
                    &[
                        &accounts,
                        &tokens,
                        &empty_text,
                        &empty_text,
                        &empty_text,
                        &empty_int,
                        &empty_text,
                        &empty_int,
                        &instance,
                    ],
                )
                .await
                .map(|r| r.len()),
            Variant::FenceLiteral => {
                let text = texts.literal(&rows)?;
                main.simple_query(&text).await.map(|messages| {
                    messages
                        .iter()
                        .filter(|m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(_)))
                        .count()
                })
            }
            Variant::Look => look.query(&last_look, &[&accounts]).await.map(|r| r.len()),
            Variant::KeyedFolded | Variant::LeanFolded | Variant::HashedFolded => {
                let made = state.records(&rows);
                let answered = if phase.variant == Variant::KeyedFolded {
                    let text = |f: &dyn Fn(&Made) -> String| made.iter().map(f).collect::<Vec<_>>();
                    let (keys, owners) = (text(&|m| m.key.clone()), text(&|m| m.owner_text()));
                    let done =
                        |f: &dyn Fn(&Made) -> String| previous.iter().map(f).collect::<Vec<_>>();
                    let (done_accounts, done_keys, done_owners) = (
                        done(&|m| m.account.clone()),
                        done(&|m| m.key.clone()),
                        done(&|m| m.owner_text()),
                    );
                    let n = previous.len();
                    s.folded
                        .query(
                            &keyed_folded,
                            &[
                                &accounts,
                                &tokens,
                                &accounts,
                                &keys,
                                &vec![fingerprint.as_str(); rows.len()],
                                &tokens,
                                &owners,
                                &vec![31_000_i64; rows.len()],
                                &instance,
                                &done_accounts,
                                &done_keys,
                                &done_owners,
                                &vec![201_i16; n],
                                &vec![headers.as_str(); n],
                                &vec![Some(body); n],
                                &vec![true; n],
                            ],
                        )
                        .await
                } else if phase.variant == Variant::HashedFolded {
                    let ids: Vec<[u8; 16]> = made.iter().map(Made::id).collect();
                    let ids: Vec<&[u8]> = ids.iter().map(|id| id.as_slice()).collect();
                    let done_ids: Vec<[u8; 16]> = previous.iter().map(Made::id).collect();
                    let done_ids: Vec<&[u8]> = done_ids.iter().map(|id| id.as_slice()).collect();
                    let keys: Vec<&str> = made.iter().map(|m| m.key.as_str()).collect();
                    let owners: Vec<i64> = made.iter().map(|m| m.owner).collect();
                    let response = lean_response(&headers, body);
                    s.folded
                        .query(
                            &hashed_folded,
                            &[
                                &accounts,
                                &tokens,
                                &ids,
                                &accounts,
                                &keys,
                                &vec![[0xf5_u8; 32].as_slice(); rows.len()],
                                &owners,
                                &done_ids,
                                &previous.iter().map(|m| m.owner).collect::<Vec<_>>(),
                                &vec![response.as_slice(); previous.len()],
                            ],
                        )
                        .await
                } else {
                    let keys: Vec<&str> = made.iter().map(|m| m.key.as_str()).collect();
                    let owners: Vec<i64> = made.iter().map(|m| m.owner).collect();
                    let fingerprints = vec![[0xf5_u8; 32].as_slice(); rows.len()];
                    let response = lean_response(&headers, body);
                    s.folded
                        .query(
                            &lean_folded,
                            &[
                                &accounts,
                                &tokens,
                                &accounts,
                                &keys,
                                &fingerprints,
                                &owners,
                                &previous
                                    .iter()
                                    .map(|m| m.account.as_str())
                                    .collect::<Vec<_>>(),
                                &previous.iter().map(|m| m.key.as_str()).collect::<Vec<_>>(),
                                &previous.iter().map(|m| m.owner).collect::<Vec<_>>(),
                                &vec![response.as_slice(); previous.len()],
                            ],
                        )
                        .await
                }
                .map_err(|e| format!("{}: {e}", phase.variant.label()))?;
                // Every row accepted, every record made, every earlier record completed.
                expect_rows(
                    phase.variant.label(),
                    answered.len(),
                    2 * rows.len() + previous.len(),
                )?;
                sample.latencies_us.push(micros_since(at));
                sample.completed += previous.len() as u64;
                previous = made;
                sample.done(rows.len());
                continue;
            }
            Variant::HashedSplit => {
                let made = state.records(&rows);
                let ids: Vec<[u8; 16]> = made.iter().map(Made::id).collect();
                let ids: Vec<&[u8]> = ids.iter().map(|id| id.as_slice()).collect();
                let keys: Vec<&str> = made.iter().map(|m| m.key.as_str()).collect();
                let owners: Vec<i64> = made.iter().map(|m| m.owner).collect();
                let created = s
                    .folded
                    .query(
                        &hashed_create,
                        &[
                            &accounts,
                            &tokens,
                            &ids,
                            &accounts,
                            &keys,
                            &vec![[0xf5_u8; 32].as_slice(); rows.len()],
                            &owners,
                        ],
                    )
                    .await
                    .map_err(|e| format!("{}: {e}", phase.variant.label()))?;
                expect_rows(phase.variant.label(), created.len(), 2 * rows.len())?;
                sample.latencies_us.push(micros_since(at));
                let completed_at = Instant::now();
                let response = lean_response(&headers, body);
                let done = completion
                    .query(
                        &hashed_complete,
                        &[&ids, &owners, &vec![response.as_slice(); rows.len()]],
                    )
                    .await
                    .map_err(|e| format!("the hashed completion: {e}"))?;
                expect_rows("the hashed completion", done.len(), rows.len())?;
                sample
                    .completion_latencies_us
                    .push(micros_since(completed_at));
                sample.done(rows.len());
                continue;
            }
            Variant::Keyed => {
                let made = state.records(&rows);
                let keys: Vec<&str> = made.iter().map(|m| m.key.as_str()).collect();
                let owners: Vec<String> = made.iter().map(Made::owner_text).collect();
                let owners: Vec<&str> = owners.iter().map(String::as_str).collect();
                let fingerprints = vec![fingerprint.as_str(); rows.len()];
                let in_doubt_after_ms = vec![31_000_i64; rows.len()];
                let created = main
                    .query(
                        &with_records,
                        &[
                            &accounts,
                            &tokens,
                            &accounts,
                            &keys,
                            &fingerprints,
                            &tokens,
                            &owners,
                            &in_doubt_after_ms,
                            &instance,
                        ],
                    )
                    .await
                    .map_err(|e| format!("{}: {e}", phase.variant.label()))?;
                expect_rows("the keyed fence statement", created.len(), 2 * rows.len())?;
                sample.latencies_us.push(micros_since(at));
                let completed_at = Instant::now();
                let statuses = vec![201_i16; rows.len()];
                let headers = vec![headers.as_str(); rows.len()];
                let bodies = vec![Some(body); rows.len()];
                let stored = vec![true; rows.len()];
                let done = completion
                    .query(
                        &complete,
                        &[
                            &accounts, &keys, &owners, &statuses, &headers, &bodies, &stored,
                        ],
                    )
                    .await
                    .map_err(|e| format!("the completion: {e}"))?;
                expect_rows("the completion", done.len(), rows.len())?;
                sample
                    .completion_latencies_us
                    .push(micros_since(completed_at));
                sample.done(rows.len());
                continue;
            }
        }
        .map_err(|e| format!("{}: {e}", phase.variant.label()))?;
        sample.latencies_us.push(micros_since(at));
        // Every row is accepted (the look reads them all).
        expect_rows(phase.variant.label(), returned, rows.len())?;
        sample.done(rows.len());
    }
    sample.seconds = started.elapsed().as_secs_f64();
    sample.backend_cpu = ticks_of(backend_pid).saturating_sub(backend_before) as f64 / 100.0;
    sample.completion_cpu =
        ticks_of(s.completion_pid).saturating_sub(completion_before) as f64 / 100.0;
    sample.server_cpu = server_before.until(&Usage::of(pg.pid())).0;
    sample.wal_bytes = monitor
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::text::pg_lsn)::float8",
            &[&wal_before],
        )
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    sample.latencies_us.sort_unstable();
    sample.completion_latencies_us.sort_unstable();
    Ok(sample)
}

impl StatementReport {
    pub(crate) fn to_markdown(&self) -> String {
        let o = &self.options;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "#### railguard-bench --suite statements, {}\n",
            self.date
        );
        let _ = writeln!(
            out,
            "- PostgreSQL: {}, durable (fsync on, synchronous_commit on on the fence's \
             sessions, off on the completion's, as railguard sets them), throwaway cluster \
             under /var/tmp{}",
            self.postgres,
            crate::report::pg_settings_text(&o.pg_settings)
                .map(|text| format!("; settings: {text}"))
                .unwrap_or_default()
        );
        let _ = writeln!(
            out,
            "- The tables as `railguard serve` leaves them: migrations, then its index maintenance \
             (`db::maintenance`)\n\
             - One client, one statement at a time, on sessions opened as railguard opens its \
             own; {} accounts, every row a new higher token (every compare-and-set accepted); \
             {} s × {} repetitions per phase interleaved round-robin, {} s warm-up before each\n\
             - CPU from `/proc`: the backend that ran the statement, and all of PostgreSQL \
             (backends, WAL writer, checkpointer, …); per row = per statement ÷ rows\n\
             - \"not built\": designs railguard does not run, measured for what they would \
             cost — one durable statement per batch that creates this batch's records and \
             completes the previous batch's (each row one record made and one completed), on \
             today's table and on the narrowest record C3 §3.1 needs (key, 32-byte \
             fingerprint, numeric owner, in-doubt deadline, the answer as one `bytea`), and on \
             that record found by a 16-byte hash with a BRIN index for retention, on a \
             durable session with one generic plan and no sequential scans\n",
            o.accounts,
            o.duration.as_secs(),
            o.repeats,
            o.warmup.as_secs()
        );
        let _ = writeln!(
            out,
            "| statement | rows | statements/s | rows/s | p50 µs | backend CPU µs per \
             statement | per row | all of PostgreSQL µs per row | WAL bytes per row |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        for (phase, samples) in &self.samples {
            let m = |f: &dyn Fn(&Sample) -> f64| median(samples.iter().map(f));
            let per_statement = |cpu: f64, s: &Sample| 1e6 * cpu / (s.statements.max(1) as f64);
            let per_row = |cpu: f64, s: &Sample| 1e6 * cpu / (s.rows.max(1) as f64);
            let line = |label: &str,
                        cpu: &dyn Fn(&Sample) -> f64,
                        latencies: &dyn Fn(&Sample) -> &Vec<u32>,
                        all: bool,
                        out: &mut String| {
                let _ = writeln!(
                    out,
                    "| {label} | {} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {} | {} |",
                    phase.rows,
                    m(&|s| s.statements as f64 / s.seconds),
                    m(&|s| s.rows as f64 / s.seconds),
                    m(&|s| f64::from(percentile(latencies(s), 0.5))),
                    m(&|s| per_statement(cpu(s), s)),
                    m(&|s| per_row(cpu(s), s)),
                    if all {
                        format!("{:.1}", m(&|s| per_row(s.server_cpu, s)))
                    } else {
                        "(above)".to_string()
                    },
                    if all {
                        format!("{:.0}", m(&|s| s.wal_bytes / s.rows.max(1) as f64))
                    } else {
                        "(above)".to_string()
                    },
                );
            };
            line(
                phase.variant.label(),
                &|s| s.backend_cpu,
                &|s| &s.latencies_us,
                true,
                &mut out,
            );
            if matches!(phase.variant, Variant::Keyed | Variant::HashedSplit) {
                line(
                    "… then the completion of those records",
                    &|s| s.completion_cpu,
                    &|s| &s.completion_latencies_us,
                    false,
                    &mut out,
                );
            }
        }
        let _ = writeln!(out, "\nEvery repetition (statements/s):\n");
        for (phase, samples) in &self.samples {
            let rates: Vec<String> = samples
                .iter()
                .map(|s| format!("{:.0}", s.statements as f64 / s.seconds))
                .collect();
            let completed = if phase.variant.folded() {
                let (done, rows) = samples
                    .iter()
                    .fold((0, 0), |(d, r), s| (d + s.completed, r + s.rows));
                format!(
                    " (records completed: {:.1}% of the records made)",
                    100.0 * done as f64 / rows.max(1) as f64
                )
            } else {
                String::new()
            };
            let _ = writeln!(
                out,
                "- {}, {} rows: {}{completed}",
                phase.variant.label(),
                phase.rows,
                rates.join(", ")
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_is_derived_from_the_shipped_statement() {
        let t = Texts::derive().unwrap();
        assert!(!t.fence_without_updated_at.contains("updated_at"));
        assert!(!t.fence_without_returning.contains("RETURNING"));
        assert!(t.fence_without_returning.contains("updated_at"));
        assert!(!t.fence_without_forwarders.contains("forward"));
        assert!(
            t.fence_without_forwarders
                .ends_with("WHERE h.highest_token <= EXCLUDED.highest_token\nRETURNING account_id"),
            "{}",
            t.fence_without_forwarders
        );
        let literal = t
            .literal(&[("stmt-1".into(), 5), ("stmt-2".into(), 6)])
            .unwrap();
        assert!(!literal.contains('$'), "{literal}");
        assert!(literal.contains("(VALUES ('stmt-1', 5::bigint), ('stmt-2', 6::bigint))"));
        let folded = &t.keyed_folded;
        assert!(
            folded.contains("completed AS (\nUPDATE idempotency_record r"),
            "{folded}"
        );
        assert!(folded.ends_with("SELECT account_id, idempotency_key, NULL, NULL FROM completed"));
        for n in 1..=16 {
            // The process's id: the records' owner and the forwarders' entry.
            let uses = if n == 9 { 2 } else { 1 };
            assert_eq!(
                folded.matches(&format!("${n}::")).count(),
                uses,
                "${n} in {folded}"
            );
        }
        assert!(t.lean_folded.contains("$10::bytea[]"));
        assert!(
            t.hashed_folded
                .contains("unnest($8::bytea[], $9::bigint[], $10::bytea[])")
        );
        assert!(t.hashed_folded.ends_with("FROM completed"));
        assert!(!t.hashed_create.contains("completed"));
        assert!(
            t.hashed_create
                .starts_with(&format!("WITH fenced AS (\n{}", t.fence))
        );
    }

    #[test]
    fn the_lean_answer_holds_status_headers_and_body() {
        let r = lean_response("[]", b"ok");
        assert_eq!(r, [0, 201, 0, 0, 0, 2, b'[', b']', 0, 0, 0, 2, b'o', b'k']);
    }

    #[test]
    fn a_replacement_that_does_not_match_once_is_an_error() {
        assert!(replace_once("a b a", "a", "c", "x").is_err());
        assert!(replace_once("a b", "z", "c", "x").is_err());
        assert_eq!(replace_once("a b", "b", "c", "x").unwrap(), "a c");
    }

    #[test]
    fn rows_are_distinct_and_carry_rising_tokens() {
        let mut state = State {
            rng: SplitMix64::new(7),
            token: 10,
            key: 0,
        };
        let rows = state.rows(50, 60);
        assert_eq!(rows.len(), 50);
        let mut accounts: Vec<&String> = rows.iter().map(|(a, _)| a).collect();
        accounts.dedup();
        assert_eq!(accounts.len(), 50);
        assert!(rows.windows(2).all(|w| w[0].1 < w[1].1));
        assert_eq!(state.rows(10, 3).len(), 3);
    }
}
