//! The operator's commands, run as an operator runs them (the real binary):
//! - `railguard check-config`, the `nginx -t` habit: a good file gets exit 0 and one line that
//!   says what railguard would do; a bad one gets exit 2 naming the key and the file (or the
//!   environment variable). Nothing is started either way. `check-config --print`, the
//!   `nginx -T` habit, also prints every key's value and where it came from, passwords redacted.
//! - `railguard inspect KEY`: who holds a key, from the running railguard — never a token.
//! - `railguard migrate --status`: where the schema stands, read only.
//! - `railguard marks ACCOUNT`: one account's mark, through the admin listener only.

use railguard_testkit as support;
use support::World;

use std::path::Path;
use std::process::Output;

/// `railguard ARGS --config CONFIG` with `env`, as an operator runs it.
fn railguard(args: &[&str], config: &Path, env: &[(&str, &str)]) -> Output {
    support::railguard_command(args, config, env)
}

fn check(config: &Path, env: &[(&str, &str)]) -> (i32, String, String) {
    let out = railguard(&["check-config"], config, env);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_shipped_config_checks_ok_in_one_line() {
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/railguard.toml");
    let (code, stdout, stderr) = check(&shipped, &[]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    crate::assert_says(
        &stdout,
        &[
            "railguard.toml: ok",
            "proxy 127.0.0.1:8080",
            "postgres backend",
            "fencing enforced",
        ],
    );
    assert!(stderr.is_empty(), "no warnings: {stderr}");
    // A pool with no room for stalled statements is fine, but said.
    let (code, stdout, stderr) = check(&shipped, &[("RAILGUARD__DATABASE__POOL_SIZE", "2")]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stderr.contains("warning") && stderr.contains("database.pool_size: 2"),
        "{stderr}"
    );
    // An override is checked too, and shows.
    let (code, stdout, _) = check(&shipped, &[("RAILGUARD__FENCING__ENFORCE", "false")]);
    assert_eq!(code, 0);
    assert!(stdout.contains("fencing OFF"), "{stdout}");
    // tokio's own thread-count variable is not read (a value it cannot parse made every
    // command panic): runtime.worker_threads alone decides.
    let (code, stdout, stderr) = check(&shipped, &[("TOKIO_WORKER_THREADS", "lots")]);
    assert_eq!(code, 0, "{stdout}{stderr}");
}

#[test]
fn check_config_print_shows_each_keys_value_and_source_and_no_password() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("rg.toml");
    std::fs::write(
        &config,
        "[proxy]\nupstream = \"http://10.1.2.3:9090\"\nlisten = \"127.0.0.1:1\"\n\
         [database]\nurl = \"postgres://rg:s3cret-pw@db.internal:5432/railguard?sslmode=disable\"\n",
    )
    .unwrap();
    let file = config.display().to_string();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_railguard"))
        .args(["check-config", "--print", "--config", &file])
        .env_clear()
        .env("RAILGUARD__PROXY__LISTEN", "127.0.0.1:18080")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(!stdout.contains("s3cret-pw"), "{stdout}");
    assert!(!stderr.contains("s3cret-pw"), "{stderr}");

    // The line of `section.key`, found by its section header.
    let line = |section: &str, key: &str| -> String {
        let mut current = "";
        for line in stdout.lines() {
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                current = name;
            } else if current == section && line.starts_with(&format!("{key} = ")) {
                return line.to_string();
            }
        }
        panic!("no {section}.{key} in:\n{stdout}")
    };
    // The environment wins over the file, and says so.
    assert_eq!(
        line("proxy", "listen"),
        "listen = \"127.0.0.1:18080\"  # environment variable RAILGUARD__PROXY__LISTEN"
    );
    assert_eq!(
        line("proxy", "upstream"),
        format!("upstream = \"http://10.1.2.3:9090\"  # {file}: proxy.upstream")
    );
    assert_eq!(
        line("database", "url"),
        format!(
            "url = \"postgres://rg:<redacted>@db.internal:5432/railguard?sslmode=disable\"  \
             # {file}: database.url (password redacted)"
        )
    );
    assert_eq!(
        line("admin", "listen"),
        "listen = \"127.0.0.1:9100\"  # default"
    );
    assert_eq!(
        line("lock", "max_connections"),
        "max_connections = 10000  # default"
    );
    // The summary follows, as a comment.
    let last = stdout.lines().last().unwrap();
    assert!(last.starts_with(&format!("# {file}: ok")), "{last}");

    // It is TOML, and reads back as the configuration checked (the password aside).
    let printed =
        railguard::config::Config::parse(&stdout, "printed.toml", &Default::default()).unwrap();
    let env = [(
        "RAILGUARD__PROXY__LISTEN".to_string(),
        "127.0.0.1:18080".to_string(),
    )];
    let mut loaded = railguard::config::Config::load(&config, &env.into_iter().collect()).unwrap();
    loaded.database.url = railguard::config::DatabaseUrl::Postgres(
        "postgres://rg:<redacted>@db.internal:5432/railguard?sslmode=disable".into(),
    );
    assert_eq!(printed, loaded);

    // Without --print, the one line only.
    let (code, stdout, _) = check(&config, &[]);
    assert_eq!(code, 0);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
}

/// Every kind of bad value — unknown key, wrong type, out of range, malformed address, URL,
/// header name, template, a rule across sections — gets exit 2 naming the key and the file.
#[test]
fn each_kind_of_bad_value_names_its_key_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("kinds.toml");
    let cases: &[(&str, &str)] = &[
        ("[proxy]\nlisen = \"127.0.0.1:1\"\n", "lisen"),
        ("[nosuchsection]\nx = 1\n", "nosuchsection"),
        (
            "[proxy]\nrequest_timeout_ms = \"soon\"\n",
            "proxy.request_timeout_ms",
        ),
        ("[proxy]\nlisten = \"localhost\"\n", "proxy.listen"),
        ("[proxy]\nupstream = \"ftp://rail\"\n", "proxy.upstream"),
        (
            "[proxy]\ntoken_header = \"bad header\"\n",
            "proxy.token_header",
        ),
        (
            "[proxy]\nrequest_timeout_ms = 0\n",
            "proxy.request_timeout_ms",
        ),
        ("[lock]\nbackend = \"zookeeper\"\n", "lock.backend"),
        ("[lock]\nmax_ttl_ms = 1\n", "lock.max_ttl_ms"),
        ("[guard]\ninterval_ms = 0\n", "guard.interval_ms"),
        (
            "[guard]\nfast_forward_concurrency = 0\n",
            "guard.fast_forward_concurrency",
        ),
        ("[database]\npool_size = 0\n", "database.pool_size"),
        (
            "[fencing]\nlock_key_template = \"no-placeholder\"\n",
            "fencing.lock_key_template",
        ),
        (
            "[fencing]\nbatch_concurrency = 64\n[database]\npool_size = 4\n",
            "fencing.batch_concurrency",
        ),
        ("[log]\nformat = \"xml\"\n", "log.format"),
        (
            "[admin]\nlisten = \"127.0.0.1:7000\"\n[lock]\nlisten = \"127.0.0.1:7000\"\n",
            "lock.listen",
        ),
    ];
    for (text, key) in cases {
        std::fs::write(&file, text).unwrap();
        let (code, stdout, stderr) = check(&file, &[]);
        assert_eq!(code, 2, "{text}: {stdout}{stderr}");
        assert!(stderr.contains(key), "{text}: the key {key} in {stderr}");
        assert!(
            stderr.contains("kinds.toml"),
            "{text}: the file in {stderr}"
        );
        assert!(stdout.is_empty(), "{text}: nothing on stdout: {stdout}");
    }
}

#[test]
fn a_bad_key_or_value_names_the_key_and_where_it_came_from() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "[proxy]\nrequest_timout_ms = 5\n").unwrap();
    let (code, stdout, stderr) = check(&file, &[]);
    assert_eq!(code, 2, "{stdout}{stderr}");
    assert!(stderr.contains("request_timout_ms"), "{stderr}");
    assert!(stderr.contains("bad.toml"), "{stderr}");

    std::fs::write(&file, "[proxy]\nrequest_timeout_ms = 5000\n").unwrap();
    let (code, _, stderr) = check(&file, &[("RAILGUARD__PROXY__MAX_BODY_BYTES", "lots")]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("RAILGUARD__PROXY__MAX_BODY_BYTES"),
        "{stderr}"
    );

    let (code, _, stderr) = check(&dir.path().join("missing.toml"), &[]);
    assert_eq!(code, 2);
    assert!(stderr.contains("missing.toml"), "{stderr}");
}

/// `railguard inspect KEY` asks the running railguard's lock API who holds a key: holder and
/// lease, never the token (FR-07).
#[tokio::test]
async fn inspect_shows_the_holder_and_never_the_token() {
    let (_pg, _rail, rg) = World::postgres_process(support::Rail::start().await, &[])
        .await
        .parts();
    let inspect = |key: &str| railguard(&["inspect", key], &rg.config_path(), &[]);
    let free = inspect("acct-inspect");
    assert!(free.status.success(), "{free:?}");
    assert_eq!(
        String::from_utf8_lossy(&free.stdout).trim(),
        "acct-inspect: free"
    );

    let grant = rg
        .lock_client()
        .acquire(
            "acct-inspect",
            "worker-7",
            std::time::Duration::from_secs(30),
            std::time::Duration::ZERO,
        )
        .await
        .unwrap();
    let held = inspect("acct-inspect");
    let text = String::from_utf8_lossy(&held.stdout);
    assert!(held.status.success(), "{held:?}");
    assert!(
        text.starts_with("acct-inspect: held by worker-7, lease "),
        "{text}"
    );
    assert!(
        !text.contains(&format!(" {} ", grant.token().get())) && !text.contains("token"),
        "no token in {text}"
    );

    let bad = inspect("not a key");
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("inspect not a key"));
}

/// `railguard migrate --status` reads where the schema stands and applies nothing: every
/// migration pending on a new database (exit 1), all applied after `migrate` (exit 0).
#[tokio::test]
async fn migrate_status_lists_pending_then_applied_and_changes_nothing() {
    support::init_tracing();
    let pg = support::Pg::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("db.toml");
    std::fs::write(&config, format!("[database]\nurl = \"{}\"\n", pg.url())).unwrap();
    let run = |args: &[&str]| railguard(args, &config, &[]);
    let before = run(&["migrate", "--status"]);
    let text = String::from_utf8_lossy(&before.stdout);
    assert_eq!(before.status.code(), Some(1), "{text}");
    assert!(
        text.contains("0001 rail_high_water") && text.contains("pending"),
        "{text}"
    );
    // Nothing was applied by looking.
    let tables: i64 = pg
        .client()
        .await
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE tablename = 'rail_high_water'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 0);

    assert!(run(&["migrate"]).status.success());
    // And the index changes `serve` makes in the background are made, and waited for.
    let indexes: Vec<String> = pg
        .column(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'idempotency_record'
             ORDER BY 1",
            &[],
        )
        .await;
    assert_eq!(
        indexes,
        ["idempotency_record_created_at", "idempotency_record_pkey"]
    );
    let after = run(&["migrate", "--status"]);
    let text = String::from_utf8_lossy(&after.stdout);
    assert_eq!(after.status.code(), Some(0), "{text}");
    assert!(text.contains("schema is current"), "{text}");
    assert!(!text.contains("pending"), "{text}");

    // The embedded database is private to `serve`: said so, not started.
    std::fs::write(
        &config,
        "[database]\nurl = \"embedded\"\ndata_dir = \"/nonexistent/pg\"\n",
    )
    .unwrap();
    let embedded = run(&["migrate", "--status"]);
    assert_eq!(embedded.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&embedded.stderr).contains("postgres://"));
}

/// `railguard marks ACCOUNT` reads one account's mark through the admin listener — and only
/// there: the proxy and the lock API never offer it (a worker that learned a mark could
/// present it, ADR-002 §A2.3).
#[tokio::test]
async fn marks_reads_a_mark_through_the_admin_listener_only() {
    let (_pg, _rail, rg) = World::postgres_process(support::Rail::start().await, &[])
        .await
        .parts();
    let marks = |account: &str| railguard(&["marks", account], &rg.config_path(), &[]);
    let none = marks("acct-m");
    assert!(none.status.success(), "{none:?}");
    assert!(String::from_utf8_lossy(&none.stdout).contains("acct-m: no mark"));
    let paid = rg.http().pay_with(&rg, 42, "acct-m").await;
    assert_eq!(paid.status, http::StatusCode::CREATED, "{}", paid.body);
    let one = marks("acct-m");
    assert_eq!(
        String::from_utf8_lossy(&one.stdout).trim(),
        "acct-m: mark 42"
    );
    let bad = marks("acct with spaces");
    assert_eq!(bad.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("400"),
        "{bad:?}"
    );
    // Neither the proxy nor the lock API has it.
    let http = support::Http::new();
    for url in [rg.proxy_url("/marks"), format!("{}/marks", rg.lock_url())] {
        let reply = http
            .pay(
                &url,
                &[("Content-Type", "application/json")],
                "{\"account\":\"acct-m\"}",
            )
            .await;
        // The request id is random and may hold "42" itself.
        let mut body = reply.body.clone();
        if let Ok(mut json) = serde_json::from_str::<serde_json::Value>(&body) {
            if let Some(fields) = json.as_object_mut() {
                fields.remove("request_id");
            }
            body = json.to_string();
        }
        assert!(!body.contains("42"), "{url}: {}", reply.body);
    }
}

/// Without `--config`, `$RAILGUARD_CONFIG` names the file; without either, the default path is
/// read relative to the working directory, and an error there says how to point at the file.
#[test]
fn the_config_file_comes_from_the_flag_then_railguard_config_then_the_default_path() {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/railguard.toml");
    let shipped = shipped.to_str().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let bad = elsewhere.path().join("bad.toml");
    std::fs::write(&bad, "[proxy]\nlisten = \"nowhere\"\n").unwrap();
    let bad = bad.to_str().unwrap();
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let out = std::process::Command::new(support::railguard_binary())
            .args(args)
            .current_dir(elsewhere.path())
            .env_remove("RAILGUARD_CONFIG")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    // Neither: there is no config/railguard.toml here. Both fail at once and say what to do.
    for command in ["serve", "check-config"] {
        let (code, stdout, stderr) = run(&[command], &[]);
        assert_eq!(code, 2, "{command}: {stdout}{stderr}");
        for part in [
            "config/railguard.toml: cannot read the file",
            "relative to the working directory",
            elsewhere.path().to_str().unwrap(),
            "pass --config PATH, or set RAILGUARD_CONFIG=PATH",
        ] {
            assert!(stderr.contains(part), "{command}: {part} in {stderr}");
        }
    }

    // The variable names the file, for every command that reads one.
    let (code, stdout, stderr) = run(&["check-config"], &[("RAILGUARD_CONFIG", shipped)]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.starts_with(&format!("{shipped}: ok")), "{stdout}");
    let (code, _, stderr) = run(&["serve"], &[("RAILGUARD_CONFIG", bad)]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains(bad) && stderr.contains("key `proxy.listen`"),
        "serve read the file the variable names: {stderr}"
    );
    let (code, _, stderr) = run(
        &["check-config"],
        &[("RAILGUARD_CONFIG", "/nonexistent/rg.toml")],
    );
    assert_eq!(code, 2);
    assert!(
        stderr.contains("/nonexistent/rg.toml: cannot read the file")
            && stderr.contains("came from $RAILGUARD_CONFIG"),
        "{stderr}"
    );

    // The flag wins over the variable.
    let (code, stdout, stderr) = run(
        &["check-config", "--config", shipped],
        &[("RAILGUARD_CONFIG", bad)],
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
}
