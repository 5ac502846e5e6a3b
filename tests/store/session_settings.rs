//! Every pooled database session is checked, when it opens, for the settings railguard asked
//! for at connect: the timeouts on every session, and the plan and commit settings of the last
//! look's and the completions' sessions (`db::settings_check`). A pooler between railguard and
//! PostgreSQL that drops startup options would otherwise take them away without a word. Here
//! that pooler is a relay that rewrites the startup message.

use railguard_testkit as support;

use std::time::Duration;

use deadpool_postgres::Pool;
use railguard::db::{build_completion_pool, build_look_pool, build_pool};

use support::relay::Relay;
use support::{Pg, init_tracing, without_startup_settings};

const TIMEOUT: Duration = Duration::from_secs(5);

/// A relay to `pg` that drops `names` from every session's startup options (all of them when
/// `names` is empty), and its `postgres://` URL.
async fn pooler(pg: &Pg, names: &'static [&'static str]) -> (Relay, String) {
    let relay = Relay::start(format!("127.0.0.1:{}", pg.server.port()).parse().unwrap()).await;
    relay.rewrite_towards_target(move |chunk| without_startup_settings(chunk, names));
    let url = relay.postgres_url(&pg.url());
    (relay, url)
}

/// The error of opening one session of `pool`, or `None` if it opened.
async fn refusal(pool: &Pool) -> Option<String> {
    match pool.get().await {
        Ok(_) => None,
        Err(e) => Some(railguard::db::DbError::from(e).to_string()),
    }
}

#[tokio::test]
async fn sessions_whose_startup_options_were_dropped_are_refused_naming_the_setting() {
    init_tracing();
    let pg = Pg::start().await;

    // Straight to PostgreSQL every kind of session opens.
    let direct = pg.url();
    for pool in [
        build_pool(&direct, 1, TIMEOUT).unwrap(),
        build_look_pool(&direct, 1, TIMEOUT).unwrap(),
        build_completion_pool(&direct, 1, TIMEOUT).unwrap(),
    ] {
        assert_eq!(refusal(&pool).await, None);
    }

    // Every option dropped: every pool refuses, naming the timeout it lost.
    let (_all, url) = pooler(&pg, &[]).await;
    for pool in [
        build_pool(&url, 1, TIMEOUT).unwrap(),
        build_look_pool(&url, 1, TIMEOUT).unwrap(),
        build_completion_pool(&url, 1, TIMEOUT).unwrap(),
    ] {
        let why = refusal(&pool).await.expect("refused");
        assert!(
            why.contains("statement_timeout is 0ms, not 5000ms")
                && why.contains("a pooler that drops startup options"),
            "{why}"
        );
    }

    // One plan setting dropped: the sessions that need it refuse; the others open.
    let (_some, url) = pooler(&pg, &["plan_cache_mode"]).await;
    assert_eq!(refusal(&build_pool(&url, 1, TIMEOUT).unwrap()).await, None);
    for pool in [
        build_look_pool(&url, 1, TIMEOUT).unwrap(),
        build_completion_pool(&url, 1, TIMEOUT).unwrap(),
    ] {
        let why = refusal(&pool).await.expect("refused");
        assert!(
            why.contains("plan_cache_mode is auto, not force_generic_plan"),
            "{why}"
        );
    }

    // Only the completions' asynchronous commit dropped: only their sessions refuse.
    let (_commit, url) = pooler(&pg, &["synchronous_commit"]).await;
    assert_eq!(
        refusal(&build_look_pool(&url, 1, TIMEOUT).unwrap()).await,
        None
    );
    let why = refusal(&build_completion_pool(&url, 1, TIMEOUT).unwrap())
        .await
        .expect("refused");
    assert!(why.contains("synchronous_commit is on, not off"), "{why}");
}

/// The main pool's sessions run the fence's compare-and-sets, which must commit durably: a
/// database (or role, or server) whose default turns `synchronous_commit` off or `local` is
/// refused; `remote_apply` is durable and accepted, and the completions' own sessions, which
/// ask for it off, are not affected. The check reads PostgreSQL's own `pg_settings`, not a
/// view of that name earlier in the search path.
#[tokio::test]
async fn sessions_whose_commits_would_not_be_durable_are_refused() {
    init_tracing();
    let pg = Pg::start().await;
    let admin = pg.client().await;
    let url = pg.url();
    for (value, refused) in [("off", true), ("local", false), ("remote_apply", false)] {
        admin
            .batch_execute(&format!(
                "ALTER DATABASE postgres SET synchronous_commit = {value}"
            ))
            .await
            .unwrap();
        let why = refusal(&build_pool(&url, 1, TIMEOUT).unwrap()).await;
        if refused {
            let why = why.expect("refused");
            assert!(
                why.contains(&format!("synchronous_commit is {value} (from: database)"))
                    && why.contains("must commit durably"),
                "{why}"
            );
        } else {
            assert_eq!(why, None, "{value}");
        }
        assert_eq!(
            refusal(&build_completion_pool(&url, 1, TIMEOUT).unwrap()).await,
            None
        );
    }
    admin
        .batch_execute(
            "ALTER DATABASE postgres RESET synchronous_commit;
             CREATE SCHEMA shadow;
             CREATE VIEW shadow.pg_settings AS
                 SELECT name, 'nonsense'::text AS setting, unit FROM pg_catalog.pg_settings;
             ALTER DATABASE postgres SET search_path = shadow, pg_catalog, public",
        )
        .await
        .unwrap();
    for pool in [
        build_pool(&url, 1, TIMEOUT).unwrap(),
        build_look_pool(&url, 1, TIMEOUT).unwrap(),
        build_completion_pool(&url, 1, TIMEOUT).unwrap(),
    ] {
        assert_eq!(refusal(&pool).await, None);
    }
}

/// A checked session keeps the durable commits it was checked for: a later change of the
/// server's configuration, reloaded, does not reach it (it does reach a session that did not
/// pin the value: the control).
#[tokio::test]
async fn a_reload_does_not_make_a_checked_session_non_durable() {
    init_tracing();
    let pg = Pg::start().await;
    let admin = pg.client().await;
    let pool = build_pool(&pg.url(), 1, TIMEOUT).unwrap();
    let checked = pool.get().await.unwrap();
    let unpinned = pg.client().await;
    for statement in [
        "ALTER SYSTEM SET synchronous_commit = off",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(statement).await.unwrap();
    }
    let setting = |row: tokio_postgres::Row| row.get::<_, String>(0);
    let reached = "the reload reaching an ordinary session";
    support::until(Duration::from_secs(5), reached, || async {
        let sql = "SELECT current_setting('synchronous_commit')";
        setting(unpinned.query_one(sql, &[]).await.unwrap()) == "off"
    })
    .await;
    let value = setting(
        checked
            .query_one("SELECT current_setting('synchronous_commit')", &[])
            .await
            .unwrap(),
    );
    assert_eq!(value, "on", "the checked session kept its durable commits");
    drop(checked);
    for statement in [
        "ALTER SYSTEM RESET synchronous_commit",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(statement).await.unwrap();
    }
}

/// Only a refusal stops the start: a settings check that gets no answer in time (a path that
/// stalls one connection) is logged, and serve starts on the sessions that do answer.
#[tokio::test]
async fn a_settings_check_without_an_answer_does_not_stop_the_start() {
    init_tracing();
    let pg = Pg::start().await;
    let relay = Relay::start(format!("127.0.0.1:{}", pg.server.port()).parse().unwrap()).await;
    relay.stall_first(|chunk| chunk.windows(11).any(|w| w == b"pg_settings"));
    // Serves for 8 s, then shuts down: a start that was stopped ends at once, with an error.
    let ran = crate::serve::serve(
        &relay.postgres_url(&pg.url()),
        "",
        tokio::time::sleep(Duration::from_secs(8)),
    )
    .await;
    assert!(relay.has_stalled(), "a settings check was stalled");
    assert!(ran.is_ok(), "{ran:?}");
    relay.release_stalled();
}

/// `serve` through such a pooler does not start: the error says which sessions and which
/// setting, instead of a server that reports itself up and fails its requests.
#[tokio::test]
async fn serve_does_not_start_through_a_pooler_that_drops_a_setting() {
    init_tracing();
    let pg = Pg::start().await;
    for (dropped, sessions) in [
        (&["lock_timeout"][..], "the database pool's sessions"),
        (
            &["enable_seqscan"][..],
            "the fence's last-look database sessions",
        ),
        (
            &["enable_hashjoin"][..],
            "the idempotency completions' database sessions",
        ),
    ] {
        let relay = Relay::start(format!("127.0.0.1:{}", pg.server.port()).parse().unwrap()).await;
        relay.rewrite_towards_target(move |chunk| without_startup_settings(chunk, dropped));
        let started =
            crate::serve::serve(&relay.postgres_url(&pg.url()), "", std::future::pending()).await;
        let why = started.expect_err("serve must not start").to_string();
        assert!(
            why.starts_with(sessions) && why.contains(&format!("the session's {}", dropped[0])),
            "{why}"
        );
    }
}
