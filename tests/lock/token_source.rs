//! The token source against the marks (C1 §1.7): a lockdb restored to an older
//! state, or a switch from the PostgreSQL backend to etcd, puts the token source below tokens
//! the proxy has already accepted. The guard must notice — the lock API grants nothing and
//! `/readyz` fails — until `railguard fast-forward` has moved the source past every mark; then
//! grants are above every mark and the proxy fences as before.

use railguard_testkit as support;
use support::World;
use support::until;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use http::StatusCode;

const FAST_GUARD: (&str, &str) = ("RAILGUARD__GUARD__INTERVAL_MS", "100");

fn railguard(args: &[&str], config: &Path, env: &[(&str, &str)]) -> Output {
    support::railguard_command(args, config, env)
}

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `POST /v1/locks/{key}/acquire` as a worker sends it, with a short lease and waiting up to
/// 5 s for an earlier one to run out; the raw reply.
async fn acquire(rg: &support::Railguard, key: &str) -> support::Reply {
    support::Http::new()
        .pay(
            &format!("{}/v1/locks/{key}/acquire", rg.lock_url()),
            &[("content-type", "application/json")],
            r#"{"holder":"worker","ttl_ms":1000,"wait_ms":5000}"#,
        )
        .await
}

fn token_of(reply: &support::Reply) -> i64 {
    reply.assert_status(StatusCode::OK);
    reply.json()["token"].as_i64().expect("a token")
}

async fn readyz(rg: &support::Railguard) -> (StatusCode, String) {
    support::Http::new()
        .get(&format!("http://{}/readyz", rg.admin))
        .await
        .expect("admin answers")
}

/// Polls until the guard has refused: /readyz 503 naming fast-forward, acquire 503
/// `token_source_behind` (nothing granted, no mark in the message), the gauge at 1.
async fn wait_until_refusing(rg: &support::Railguard, key: &str) {
    until(
        Duration::from_secs(10),
        "/readyz saying the token source is behind (fast-forward)",
        || async {
            let (status, body) = readyz(rg).await;
            status == StatusCode::SERVICE_UNAVAILABLE && body.contains("fast-forward")
        },
    )
    .await;
    let refused = acquire(rg, key).await;
    refused.assert_status(StatusCode::SERVICE_UNAVAILABLE);
    let body = refused.json();
    assert_eq!(body["error"], "token_source_behind", "{body}");
    assert_eq!(body["outcome"], "none", "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("railguard fast-forward")
    );
    assert!(body.get("token").is_none(), "{body}");
    let metrics = rg.metrics().await;
    assert_eq!(metrics.get("railguard_token_source_behind"), 1.0);
}

async fn wait_until_ready(rg: &support::Railguard) {
    until(Duration::from_secs(10), "/readyz ready again", || async {
        readyz(rg).await.0 == StatusCode::OK
    })
    .await
}

/// After fast-forward: a new grant is above every mark, pays, and fences the old grant out.
async fn fences_again(rg: &support::Railguard, account: &str, old: i64, mark: i64) {
    let new = token_of(&acquire(rg, account).await);
    assert!(new > mark, "a new grant ({new}) is above the mark ({mark})");
    let paid = rg.http().pay_with(rg, new, account).await;
    paid.assert_status(StatusCode::CREATED);
    let stale = rg.http().pay_with(rg, old, account).await;
    stale.assert_status(StatusCode::CONFLICT);
    assert_eq!(stale.json()["error"], "fenced_out");
}

#[tokio::test]
async fn a_restored_lockdb_grants_nothing_until_fast_forward_then_fences_correctly() {
    let (pg, rail, rg) = World::postgres_process(support::Rail::start().await, &[FAST_GUARD])
        .await
        .parts();

    // Normal traffic: grants, payments, marks.
    let first = token_of(&acquire(&rg, "acct-r1").await);
    assert_eq!(
        rg.http().pay_with(&rg, first, "acct-r1").await.status,
        StatusCode::CREATED
    );
    let mark = token_of(&acquire(&rg, "acct-r2").await);
    assert_eq!(
        rg.http().pay_with(&rg, mark, "acct-r2").await.status,
        StatusCode::CREATED
    );
    let ledger_before = rail.ledger().len();

    // "Restore last night's backup": the sequence goes back to before those grants.
    pg.client()
        .await
        .execute("SELECT setval('fencing_token_seq', 1, false)", &[])
        .await
        .unwrap();
    wait_until_refusing(&rg, "acct-r3").await;
    // Nothing was granted meanwhile: the sequence did not move past where it was put... by
    // more than the refused attempts' draws, and none of them holds a key.
    let held: i64 = pg
        .client()
        .await
        .query_one(
            "SELECT count(*) FROM lock_entry WHERE key = 'acct-r3' AND ended_at IS NULL \
             AND expires_at > clock_timestamp()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(held, 0, "a refused acquire holds nothing");

    let dry = railguard(&["fast-forward", "--dry-run"], &rg.config_path(), &[]);
    assert_eq!(dry.status.code(), Some(0), "{}", text(&dry));
    assert!(text(&dry).contains("would move"), "{}", text(&dry));
    assert_eq!(
        readyz(&rg).await.0,
        StatusCode::SERVICE_UNAVAILABLE,
        "a dry run changes nothing"
    );

    let done = railguard(&["fast-forward"], &rg.config_path(), &[]);
    assert_eq!(done.status.code(), Some(0), "{}", text(&done));
    assert!(text(&done).contains("done:"), "{}", text(&done));
    let again = railguard(&["fast-forward"], &rg.config_path(), &[]);
    assert_eq!(
        again.status.code(),
        Some(3),
        "nothing to do: {}",
        text(&again)
    );

    wait_until_ready(&rg).await;
    assert_eq!(rg.metrics().await.get("railguard_token_source_behind"), 0.0);
    fences_again(&rg, "acct-r2", mark, mark).await;
    fences_again(&rg, "acct-r1", first, mark).await;
    rail.assert_paid(ledger_before + 2, "only the new grants paid");
}

/// A railguard that starts on a source already behind (restored while it was down) is not
/// ready and grants nothing from its first request.
#[tokio::test]
async fn a_railguard_started_on_a_restored_lockdb_is_never_ready_until_fast_forward() {
    let (pg, _rail, mut rg) = World::postgres_process(support::Rail::start().await, &[FAST_GUARD])
        .await
        .parts();
    let mark = token_of(&acquire(&rg, "acct-s1").await);
    assert_eq!(
        rg.http().pay_with(&rg, mark, "acct-s1").await.status,
        StatusCode::CREATED
    );
    rg.stop().await;
    pg.client()
        .await
        .execute("SELECT setval('fencing_token_seq', 1, false)", &[])
        .await
        .unwrap();
    rg.start_again_unready().await;
    wait_until_refusing(&rg, "acct-s1").await;
    let done = railguard(&["fast-forward"], &rg.config_path(), &[]);
    assert_eq!(done.status.code(), Some(0), "{}", text(&done));
    wait_until_ready(&rg).await;
    fences_again(&rg, "acct-s1", mark, mark).await;
}

/// Switching `lock.backend` from postgres to etcd: etcd's revisions start far below the
/// sequence's tokens. The guard refuses until fast-forward has written etcd's revision past
/// every mark (and paydb's fence column, when given).
#[tokio::test]
async fn a_switch_from_postgres_to_etcd_grants_nothing_until_fast_forward() {
    support::init_tracing();
    let pg = support::Pg::start().await;
    let paydb = support::Pg::start().await;
    let etcd = support::EtcdCluster::single().await;
    let rail = support::Rail::start().await;
    let mut rg = support::Railguard::start_process(&pg.url(), &rail.url(), &[FAST_GUARD]).await;
    // A lockdb that has issued a few hundred tokens.
    pg.client()
        .await
        .execute("SELECT setval('fencing_token_seq', 300)", &[])
        .await
        .unwrap();
    let old = token_of(&acquire(&rg, "acct-e1").await);
    assert_eq!(
        rg.http().pay_with(&rg, old, "acct-e1").await.status,
        StatusCode::CREATED
    );
    // paydb's fenced UPDATE recorded a higher token than the proxy did (another account).
    let paydb_fence = old + 150;
    paydb
        .client()
        .await
        .batch_execute(&format!(
            "CREATE TABLE account (id text PRIMARY KEY, fence bigint NOT NULL);
             INSERT INTO account VALUES ('acct-e1', {old}), ('acct-e2', {paydb_fence});"
        ))
        .await
        .unwrap();
    assert!(
        etcd.revision().await < old,
        "a new etcd is behind the sequence"
    );

    rg.stop().await;
    rg.set_env("RAILGUARD__LOCK__BACKEND", "etcd");
    rg.set_env("RAILGUARD__ETCD__ENDPOINTS", &etcd.endpoints_csv());
    rg.start_again_unready().await;
    wait_until_refusing(&rg, "acct-e1").await;

    let env = [
        ("RAILGUARD__LOCK__BACKEND", "etcd"),
        ("RAILGUARD__ETCD__ENDPOINTS", &etcd.endpoints_csv()),
    ];
    let done = railguard(
        &[
            "fast-forward",
            "--paydb-url",
            &paydb.url(),
            "--paydb-table",
            "account",
        ],
        &rg.config_path(),
        &env,
    );
    assert_eq!(done.status.code(), Some(0), "{}", text(&done));
    assert!(
        etcd.revision().await > paydb_fence,
        "past paydb's fence too"
    );
    wait_until_ready(&rg).await;
    fences_again(&rg, "acct-e1", old, paydb_fence).await;
}

/// Bad flags and unreachable sources fail clearly and change nothing.
#[tokio::test]
async fn fast_forward_refuses_bad_input_with_a_clear_error() {
    support::init_tracing();
    let pg = support::Pg::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ff.toml");
    std::fs::write(&config, format!("[database]\nurl = \"{}\"\n", pg.url())).unwrap();
    let bad_table = railguard(
        &[
            "fast-forward",
            "--paydb-url",
            &pg.url(),
            "--paydb-table",
            "account; drop",
        ],
        &config,
        &[],
    );
    assert_eq!(bad_table.status.code(), Some(2), "{}", text(&bad_table));
    assert!(
        text(&bad_table).contains("--paydb-table"),
        "{}",
        text(&bad_table)
    );

    let missing = railguard(
        &[
            "fast-forward",
            "--paydb-url",
            &pg.url(),
            "--paydb-table",
            "no_such_table",
        ],
        &config,
        &[],
    );
    assert_eq!(missing.status.code(), Some(1), "{}", text(&missing));
    assert!(
        text(&missing).contains("no_such_table"),
        "{}",
        text(&missing)
    );

    // Nothing recorded yet, nothing to do.
    let nothing = railguard(&["fast-forward"], &config, &[]);
    assert_eq!(nothing.status.code(), Some(3), "{}", text(&nothing));

    let dead = [
        ("RAILGUARD__LOCK__BACKEND", "etcd"),
        ("RAILGUARD__ETCD__ENDPOINTS", "http://127.0.0.1:1"),
    ];
    let unreachable = railguard(&["fast-forward"], &config, &dead);
    assert_eq!(unreachable.status.code(), Some(1), "{}", text(&unreachable));
    assert!(
        text(&unreachable).contains("etcd"),
        "{}",
        text(&unreachable)
    );
}

/// etcd over a gap of more than 100,000 revisions: progress is shown, a SIGINT stops it
/// part-way (exit 1, nothing lost: the revision is the progress), a rerun continues from
/// there and verifies with a fresh draw.
#[tokio::test]
async fn etcd_fast_forward_over_a_large_gap_shows_progress_survives_interruption_and_verifies() {
    support::init_tracing();
    let pg = support::Pg::start().await;
    let etcd = support::EtcdCluster::single().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ff.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"{}\"\n[lock]\nbackend = \"etcd\"\n[etcd]\nendpoints = [\"{}\"]\n",
            pg.url(),
            etcd.endpoint(0)
        ),
    )
    .unwrap();
    let migrated = railguard(&["migrate"], &config, &[]);
    assert!(migrated.status.success(), "{}", text(&migrated));
    let start = etcd.revision().await;
    let target = start + 120_000;
    pg.client()
        .await
        .execute(
            "INSERT INTO rail_high_water (account_id, highest_token) VALUES ('acct-big', $1)",
            &[&target],
        )
        .await
        .unwrap();

    let dry = railguard(&["fast-forward", "--dry-run"], &config, &[]);
    assert_eq!(dry.status.code(), Some(0), "{}", text(&dry));
    assert!(
        text(&dry).contains("writes to the scratch key"),
        "{}",
        text(&dry)
    );
    assert_eq!(etcd.revision().await, start, "a dry run writes nothing");

    // Interrupted part-way.
    let child = tokio::process::Command::new(support::railguard_binary())
        .args(["fast-forward", "--config"])
        .arg(&config)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    until(
        Duration::from_secs(15),
        "fast-forward writing to etcd",
        || async { etcd.revision().await > start + 5_000 },
    )
    .await;
    let pid = child.id().unwrap().to_string();
    Command::new("kill").args(["-INT", &pid]).status().unwrap();
    let interrupted = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("an interrupted fast-forward exits")
        .unwrap();
    let reached = etcd.revision().await;
    assert!(
        reached < target,
        "interrupted before the end ({reached} of {target}); {}",
        text(&interrupted)
    );
    assert_eq!(interrupted.status.code(), Some(1), "{}", text(&interrupted));
    assert!(
        text(&interrupted).contains("interrupted"),
        "{}",
        text(&interrupted)
    );

    // Run again: continues from the cluster's revision, shows progress, verifies.
    let done = railguard(&["fast-forward"], &config, &[]);
    let out = text(&done);
    assert_eq!(done.status.code(), Some(0), "{out}");
    assert!(out.contains("/s  ETA"), "progress with rate and ETA: {out}");
    assert!(out.contains("done:"), "{out}");
    assert!(etcd.revision().await > target);
    // The lock prefix saw none of it.
    assert!(etcd.get("/railguard/locks/acct-big").await.is_none());
    let again = railguard(&["fast-forward"], &config, &[]);
    assert_eq!(again.status.code(), Some(3), "{}", text(&again));
}

/// A poisoned account (its mark above anything the token source issued) is made payable again
/// by `railguard recover-account`, through the admin listener, audited — and no mark is ever
/// lowered.
#[tokio::test]
async fn a_poisoned_account_is_recovered_without_lowering_any_mark() {
    let (pg, _rail, rg) = World::postgres_process(support::Rail::start().await, &[FAST_GUARD])
        .await
        .parts();
    let healthy = token_of(&acquire(&rg, "acct-ok").await);
    assert_eq!(
        rg.http().pay_with(&rg, healthy, "acct-ok").await.status,
        StatusCode::CREATED
    );
    let before = token_of(&acquire(&rg, "acct-p").await);
    assert_eq!(
        rg.http().pay_with(&rg, before, "acct-p").await.status,
        StatusCode::CREATED
    );
    // Poisoned: a mark far above the source (a token from before grant proofs, say).
    let poison = 1_000_000_i64;
    pg.client()
        .await
        .execute(
            "UPDATE rail_high_water SET highest_token = $1 WHERE account_id = 'acct-p'",
            &[&poison],
        )
        .await
        .unwrap();
    wait_until_refusing(&rg, "acct-p").await;

    let recover = |account: &str, reason: &str, json: bool| {
        let mut args = vec!["recover-account", account, "--reason", reason];
        if json {
            args.push("--json");
        }
        railguard(&args, &rg.config_path(), &[])
    };
    let empty = recover("acct-p", "  ", false);
    assert_eq!(empty.status.code(), Some(1), "{}", text(&empty));
    assert!(text(&empty).contains("reason"), "{}", text(&empty));

    // For scripts, the admin listener's answer as JSON.
    let done = recover("acct-p", "INC-7: mark from a pre-proof worker", true);
    assert_eq!(done.status.code(), Some(0), "{}", text(&done));
    let answer: serde_json::Value =
        serde_json::from_slice(&done.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&done)));
    assert_eq!(answer["outcome"], "recovered", "{answer}");
    assert_eq!(answer["mark"], poison);
    assert!(answer["drawn"].as_i64().unwrap() > poison, "{answer}");

    // Grants resume at once; no mark went down; the account pays again and fences.
    wait_until_ready(&rg).await;
    let marks: Vec<(String, i64)> = pg
        .client()
        .await
        .query(
            "SELECT account_id, highest_token FROM rail_high_water ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        marks,
        [
            ("acct-ok".to_string(), healthy),
            ("acct-p".to_string(), poison)
        ]
    );
    fences_again(&rg, "acct-p", before, poison).await;
    // The healthy account never noticed.
    fences_again(&rg, "acct-ok", healthy, healthy).await;

    // Audited: intent and outcome, with the reason.
    let audit = pg
        .client()
        .await
        .query_one(
            "SELECT action, reason, outcome->>'result', finished_at IS NOT NULL \
             FROM railguard_audit WHERE account_id = 'acct-p'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(audit.get::<_, String>(0), "recover_account");
    assert_eq!(
        audit.get::<_, String>(1),
        "INC-7: mark from a pre-proof worker"
    );
    assert_eq!(audit.get::<_, String>(2), "recovered");
    assert!(audit.get::<_, bool>(3));

    // A healthy account needs nothing, and says so, in a sentence as `marks` does.
    let nothing = recover("acct-ok", "checking", false);
    assert_eq!(nothing.status.code(), Some(0), "{}", text(&nothing));
    let said = String::from_utf8_lossy(&nothing.stdout);
    assert!(
        said.starts_with("acct-ok: nothing to do: the token source is at "),
        "{said}"
    );
    assert!(
        said.contains(&format!("the mark {healthy}")) && said.contains("Audit record "),
        "{said}"
    );
    assert!(
        serde_json::from_str::<serde_json::Value>(&said).is_err(),
        "{said}"
    );
    // Only the admin listener offers it.
    let http = support::Http::new();
    for url in [
        rg.proxy_url("/recover"),
        format!("{}/recover", rg.lock_url()),
    ] {
        let reply = http
            .pay(
                &url,
                &[("content-type", "application/json")],
                r#"{"account":"acct-p","reason":"x"}"#,
            )
            .await;
        assert_ne!(reply.status, StatusCode::OK, "{url}: {}", reply.body);
    }
}

/// With grant proofs off (migrating workers), a made-up token above anything the source has
/// issued is refused (400 implausible_token): never forwarded, no mark moved, so it cannot
/// poison the account. A token the source did issue still passes without a proof.
#[tokio::test]
async fn without_proofs_a_token_the_source_never_issued_is_refused() {
    let World { pg, rail, rg, .. } = World::postgres_process(
        support::Rail::start().await,
        &[("RAILGUARD__FENCING__REQUIRE_PROOF", "false")],
    )
    .await;
    let issued = token_of(&acquire(&rg, "acct-u").await);
    let unproven = |token: i64| {
        let token = token.to_string();
        let url = rg.proxy_url("/payments");
        async move {
            support::Http::new()
                .pay(
                    &url,
                    &[("Fencing-Token", &token), ("Fencing-Account", "acct-u")],
                    "{}",
                )
                .await
        }
    };
    let made_up = unproven(issued + 1_000).await;
    made_up.assert_status(StatusCode::BAD_REQUEST);
    assert_eq!(made_up.json()["error"], "implausible_token");
    let keys: Vec<String> = made_up
        .json()
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert_eq!(
        keys,
        ["error", "message", "origin", "request_id"],
        "no hint of the source"
    );
    rail.assert_paid(0, "never forwarded");
    let huge = unproven(i64::MAX).await;
    huge.assert_status(StatusCode::BAD_REQUEST);
    let marks: i64 = pg.one("SELECT count(*) FROM rail_high_water", &[]).await;
    assert_eq!(marks, 0, "no mark moved");
    assert_eq!(
        rg.metrics().await.get("railguard_implausible_tokens_total"),
        2.0
    );

    let paid = unproven(issued).await;
    paid.assert_status(StatusCode::CREATED);
    // A fresh grant drawn after the proxy last looked passes too (the proxy re-reads).
    let next = token_of(&acquire(&rg, "acct-u2").await);
    let url = rg.proxy_url("/payments");
    let token = next.to_string();
    let fresh = support::Http::new()
        .pay(
            &url,
            &[("Fencing-Token", &token), ("Fencing-Account", "acct-u2")],
            "{}",
        )
        .await;
    fresh.assert_status(StatusCode::CREATED);
}

/// A source that cannot be checked is never trusted: railguard started while etcd is down
/// grants nothing and is not ready, and becomes ready within about a second of etcd's return.
#[tokio::test]
async fn an_unchecked_source_grants_nothing_until_a_check_succeeds() {
    support::init_tracing();
    let pg = support::Pg::start().await;
    let mut etcd = support::EtcdCluster::single().await;
    let rail = support::Rail::start().await;
    let mut rg = support::Railguard::start_process(&pg.url(), &rail.url(), &[]).await;
    rg.stop().await;
    rg.set_env("RAILGUARD__LOCK__BACKEND", "etcd");
    rg.set_env("RAILGUARD__ETCD__ENDPOINTS", &etcd.endpoints_csv());
    etcd.stop(0).await;
    rg.start_again_unready().await;
    let refused = acquire(&rg, "acct-u").await;
    refused.assert_status(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused.json()["error"],
        "token_source_behind",
        "{}",
        refused.body
    );
    assert!(
        refused.body.contains("not yet been checked"),
        "{}",
        refused.body
    );
    let (status, body) = readyz(&rg).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(
        rg.metrics()
            .await
            .get("railguard_token_source_checks_total{outcome=\"failed\"}")
            >= 1.0
    );

    etcd.start(0).await;
    wait_until_ready(&rg).await;
    token_of(&acquire(&rg, "acct-u").await);
}

/// etcd restored from a backup while railguard serves, long before the next periodic check:
/// the first grant of a key whose token the restored revision would repeat is ended and
/// refused (503 token_source_behind) — it never hands out the token the old holder still
/// has — and railguard raises the fencing floor and moves etcd past it by itself.
#[tokio::test]
async fn an_etcd_restore_between_checks_is_caught_by_the_first_grant_it_would_repeat() {
    support::init_tracing();
    let parent = tempfile::tempdir().unwrap();
    let mut etcd = support::EtcdCluster::builder()
        .temp_dir_in(parent.path())
        .start()
        .await
        .unwrap();
    let pg = support::Pg::start().await;
    let rail = support::Rail::start().await;
    let endpoints = etcd.endpoints_csv();
    let rg = support::Railguard::start_process(
        &pg.url(),
        &rail.url(),
        &[
            ("RAILGUARD__LOCK__BACKEND", "etcd"),
            ("RAILGUARD__ETCD__ENDPOINTS", &endpoints),
            ("RAILGUARD__GUARD__INTERVAL_MS", "600000"),
        ],
    )
    .await;
    let data_dir = std::fs::read_dir(parent.path())
        .unwrap()
        .map(|e| e.unwrap().path().join("data"))
        .find(|p| p.is_dir())
        .expect("the member's data dir");
    let copy = |from: &Path, to: &Path| {
        assert!(
            Command::new("cp")
                .arg("-a")
                .arg(from)
                .arg(to)
                .status()
                .unwrap()
                .success()
        );
    };
    // The backup, then traffic after it: W1 pays on acct-x with t1 and keeps its lease.
    etcd.stop(0).await;
    let backup = parent.path().join("backup");
    copy(&data_dir, &backup);
    etcd.start(0).await;
    let w1 = support::Http::new()
        .pay(
            &format!("{}/v1/locks/acct-x/acquire", rg.lock_url()),
            &[("content-type", "application/json")],
            r#"{"holder":"w1","ttl_ms":600000}"#,
        )
        .await;
    let t1 = token_of(&w1);
    assert_eq!(
        rg.http().pay_with(&rg, t1, "acct-x").await.status,
        StatusCode::CREATED
    );

    // Restore: the revision goes back below t1; unrelated writes bring it to t1 - 1.
    etcd.stop(0).await;
    std::fs::remove_dir_all(&data_dir).unwrap();
    copy(&backup, &data_dir);
    etcd.start(0).await;
    assert!(etcd.revision().await < t1);
    // The client may still be reconnecting (503 unavailable) before the refusal.
    until(
        Duration::from_secs(10),
        "the grant that would repeat t1 refused",
        || async {
            while etcd.revision().await < t1 - 1 {
                etcd.put_raw("/other/app", "x").await;
            }
            let reply = acquire(&rg, "acct-x").await;
            assert_ne!(
                reply.status,
                StatusCode::OK,
                "a grant at or below the mark: {}",
                reply.body
            );
            reply.json()["error"] == "token_source_behind"
        },
    )
    .await;
    rail.assert_paid(1, "only W1 paid");

    // With no operator: the floor is raised above every token granted before the restore (each
    // was recorded in PostgreSQL before it was handed out), etcd's revision is moved past it,
    // and grants resume.
    until(
        Duration::from_secs(30),
        "railguard ready again after the restore",
        || async { readyz(&rg).await.0 == StatusCode::OK },
    )
    .await;
    let stale = rg.http().pay_with(&rg, t1, "acct-x").await;
    assert_eq!(
        stale.status,
        StatusCode::CONFLICT,
        "W1's grant is fenced once"
    );
    let t2 = token_of(&acquire(&rg, "acct-x").await);
    assert!(t2 > t1, "no token is handed out twice: {t2} after {t1}");
    assert_eq!(
        rg.http().pay_with(&rg, t2, "acct-x").await.status,
        StatusCode::CREATED
    );
    rail.assert_paid(2, "payments at the rail");
    let audit: i64 = pg
        .one(
            "SELECT count(*) FROM railguard_audit WHERE action = 'token_source_went_back'",
            &[],
        )
        .await;
    assert!(audit >= 1);
    assert!(rg.log().contains("THE TOKEN SOURCE WENT BACK"));
}
