//! The client side of TLS, over real sockets: railguard forwarding to an
//! `https://` rail whose certificate is from a private CA (and refusing one from another CA,
//! saying truthfully that nothing was sent), presenting a client certificate to a rail that
//! requires one, and reaching PostgreSQL over TLS as the URL's `sslmode` asks.

use railguard_testkit as support;

use std::path::Path;
use std::time::Duration;

use http::StatusCode;
use railguard::config::{DatabaseConfig, DatabaseUrl};
use railguard::db::Database;
use support::{Pg, Pki, Rail, Railguard, TlsFront, init_tracing};

fn path(p: &Path) -> &str {
    p.to_str().expect("temp paths are UTF-8")
}

#[tokio::test]
async fn the_proxy_forwards_to_an_https_rail_with_a_private_ca() {
    init_tracing();
    let pki = Pki::new();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let front = TlsFront::start(rail.addr, &pki.server("rail"), None).await;
    let rg = Railguard::start(
        &pg.url(),
        &front.url(),
        &[("RAILGUARD__PROXY__UPSTREAM_CA_FILE", path(&pki.ca))],
    )
    .await;
    for token in [42, 43] {
        let reply = rg.http().pay_with(&rg, token, "acct-tls").await;
        reply.assert_status(StatusCode::CREATED);
    }
    rail.assert_paid(2, "both payments reached the rail");
    assert_eq!(front.failed_handshakes(), 0);
    assert_eq!(pg.mark("acct-tls").await, Some(43));
}

#[tokio::test]
async fn a_rail_with_a_certificate_from_another_ca_is_refused_and_nothing_is_sent() {
    init_tracing();
    let (pki, other) = (Pki::new(), Pki::new());
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let impostor = TlsFront::start(rail.addr, &other.server("rail"), None).await;
    let rg = Railguard::start(
        &pg.url(),
        &impostor.url(),
        &[("RAILGUARD__PROXY__UPSTREAM_CA_FILE", path(&pki.ca))],
    )
    .await;
    let reply = rg.http().pay_with(&rg, 7, "acct-impostor").await;
    reply.assert_status(StatusCode::BAD_GATEWAY);
    let body = reply.json();
    assert_eq!(body["error"], "upstream_unavailable");
    assert_eq!(body["origin"], "upstream");
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("the request was not sent") && message.contains("certificate"),
        "{message}"
    );
    assert!(impostor.failed_handshakes() >= 1);
    assert!(rail.ledger().is_empty(), "nothing reached the rail");
}

#[tokio::test]
async fn a_client_certificate_is_presented_to_a_rail_that_requires_one() {
    init_tracing();
    let pki = Pki::new();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let front = TlsFront::start(rail.addr, &pki.server("rail"), Some(&pki.ca)).await;
    let ours = pki.client("railguard");
    let rg = Railguard::start(
        &pg.url(),
        &front.url(),
        &[
            ("RAILGUARD__PROXY__UPSTREAM_CA_FILE", path(&pki.ca)),
            ("RAILGUARD__PROXY__UPSTREAM_CERT_FILE", path(&ours.cert)),
            ("RAILGUARD__PROXY__UPSTREAM_KEY_FILE", path(&ours.key)),
        ],
    )
    .await;
    let reply = rg.http().pay_with(&rg, 5, "acct-mtls").await;
    reply.assert_status(StatusCode::CREATED);
    assert_eq!(front.client_certs(), [ours.fingerprint_sha256()]);
    rail.assert_paid(1, "payments at the rail");

    // Without a certificate the rail refuses the connection: no payment reaches it.
    let anonymous = Railguard::start(
        &pg.url(),
        &front.url(),
        &[("RAILGUARD__PROXY__UPSTREAM_CA_FILE", path(&pki.ca))],
    )
    .await;
    let reply = anonymous.http().pay_with(&anonymous, 6, "acct-mtls").await;
    reply.assert_status(StatusCode::BAD_GATEWAY);
    assert_eq!(reply.json()["error"], "upstream_unavailable");
    rail.assert_paid(1, "the anonymous request never reached the rail");
    assert!(front.failed_handshakes() >= 1);
}

#[tokio::test]
async fn rail_tls_files_that_cannot_be_read_stop_the_start_naming_the_key_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("rg.toml");
    let port = support::free_loopback_port;
    std::fs::write(
        &config,
        format!(
            "[proxy]\nlisten = \"127.0.0.1:{}\"\nupstream = \"https://127.0.0.1:{}\"\n\
             [admin]\nlisten = \"127.0.0.1:{}\"\n[lock]\nlisten = \"127.0.0.1:{}\"\n\
             [database]\nurl = \"postgres://rg@127.0.0.1:{}/x\"\n",
            port(),
            port(),
            port(),
            port(),
            port()
        ),
    )
    .unwrap();
    let missing = dir.path().join("no-such-ca.pem");
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_railguard"))
            .args(["serve", "--config"])
            .arg(&config)
            .env("RAILGUARD__PROXY__UPSTREAM_CA_FILE", &missing)
            .output(),
    )
    .await
    .expect("railguard exits")
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("proxy.upstream_ca_file {}", missing.display())),
        "{stderr}"
    );

    // Without the CA at all, the configuration itself is refused.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_railguard"))
        .args(["serve", "--config"])
        .arg(&config)
        .output()
        .await
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("proxy.upstream_ca_file"), "{stderr}");
}

/// `Database::open`, as `railguard serve` runs it, for `url`.
async fn open(url: &str, tls_ca_file: &str) -> Result<Database, String> {
    let config = DatabaseConfig {
        url: DatabaseUrl::Postgres(url.to_string()),
        timeout: Duration::from_secs(5),
        tls_ca_file: tls_ca_file.to_string(),
        ..DatabaseConfig::default()
    };
    Database::open(&config).await.map_err(|e| e.to_string())
}

/// Whether every client session of the cluster uses TLS, and how many there are.
async fn sessions_over_tls(client: &tokio_postgres::Client) -> (bool, i64) {
    let row = client
        .query_one(
            "SELECT coalesce(bool_and(s.ssl), false), count(*) FROM pg_stat_ssl s \
             JOIN pg_stat_activity a USING (pid) WHERE a.backend_type = 'client backend'",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test]
async fn postgresql_over_tls_when_the_url_asks_for_it() {
    init_tracing();
    let pki = Pki::new();
    let pg = Pg::builder()
        .tls(&pki.server("pg"))
        .start()
        .await
        .expect("a TLS-only cluster");
    let ca = path(&pki.ca).to_string();

    // The cluster takes TLS only: cleartext is refused, clearly.
    let e = open(&format!("{}?sslmode=disable", pg.url()), "")
        .await
        .err()
        .expect("cleartext is refused");
    assert!(
        e.contains("cannot connect to PostgreSQL") && e.contains("no encryption"),
        "{e}"
    );

    // verify-full, CA from the URL: railguard fences and forwards a payment.
    let url = format!("{}?sslmode=verify-full&sslrootcert={ca}", pg.url());
    let rail = Rail::start().await;
    let rg = Railguard::start(&url, &rail.url(), &[]).await;
    let reply = rg.http().pay_with(&rg, 42, "acct-pg-tls").await;
    reply.assert_status(StatusCode::CREATED);
    rail.assert_paid(1, "payments at the rail");
    let client = pg.client_with(&url).await.unwrap();
    let mine: bool = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(mine, "the test's own verify-full session is TLS");
    let (all_tls, sessions) = sessions_over_tls(&client).await;
    assert!(
        all_tls && sessions >= 2,
        "{sessions} sessions, all TLS: {all_tls}"
    );
    assert_eq!(pg.mark("acct-pg-tls").await, Some(42));

    // require, with the CA from database.tls_ca_file.
    let rg2 = Railguard::start(
        &format!("{}?sslmode=require", pg.url()),
        &rail.url(),
        &[("RAILGUARD__DATABASE__TLS_CA_FILE", &ca)],
    )
    .await;
    let reply = rg2.http().pay_with(&rg2, 43, "acct-pg-tls").await;
    reply.assert_status(StatusCode::CREATED);
    assert_eq!(pg.mark("acct-pg-tls").await, Some(43));
    let (all_tls, _) = sessions_over_tls(&client).await;
    assert!(all_tls);
}

#[tokio::test]
async fn postgresql_certificates_are_checked_as_sslmode_says() {
    init_tracing();
    let (pki, other) = (Pki::new(), Pki::new());
    let pg = Pg::builder()
        .tls(&pki.server("pg"))
        .start()
        .await
        .expect("a TLS-only cluster");
    let (ca, other_ca) = (path(&pki.ca), path(&other.ca));

    // A server certificate from another CA: verify-full refuses it, naming the problem.
    let e = open(
        &format!("{}?sslmode=verify-full&sslrootcert={other_ca}", pg.url()),
        "",
    )
    .await
    .err()
    .expect("another CA's certificate is refused");
    assert!(
        e.contains("cannot connect to PostgreSQL") && e.contains("invalid peer certificate"),
        "{e}"
    );
    // So does require once a CA is configured (libpq's rule: a root certificate is checked).
    let e = open(&format!("{}?sslmode=require", pg.url()), other_ca)
        .await
        .err()
        .expect("require checks a configured CA");
    assert!(e.contains("invalid peer certificate"), "{e}");
    // require without a CA encrypts, but does not authenticate the server (libpq's meaning).
    let db = open(&format!("{}?sslmode=require", pg.url()), "")
        .await
        .expect("require without a CA connects");
    db.shutdown().await;
    // verify-ca and verify-full need a CA.
    let e = open(&format!("{}?sslmode=verify-ca", pg.url()), "")
        .await
        .err()
        .expect("verify-ca needs a CA");
    assert!(e.contains("needs a CA"), "{e}");
    // The right CA passes.
    let db = open(&format!("{}?sslmode=verify-ca", pg.url()), ca)
        .await
        .expect("verify-ca with the right CA");
    db.shutdown().await;
}

#[tokio::test]
async fn verify_full_checks_the_host_name_and_verify_ca_does_not() {
    init_tracing();
    let pki = Pki::new();
    let pg = Pg::builder()
        .tls(&pki.server_for("pg", "db.elsewhere.test"))
        .start()
        .await
        .expect("a TLS-only cluster");
    let ca = path(&pki.ca);
    let e = open(&format!("{}?sslmode=verify-full", pg.url()), ca)
        .await
        .err()
        .expect("a certificate for another host is refused");
    assert!(
        e.contains("invalid peer certificate") && e.contains("not valid for name"),
        "{e}"
    );
    let db = open(&format!("{}?sslmode=verify-ca", pg.url()), ca)
        .await
        .expect("verify-ca checks the CA only");
    db.shutdown().await;
}

/// SCRAM over TLS binds the session to the server's certificate (`tls-server-end-point`):
/// with `channel_binding=require` the server checks the hash railguard computed, so a wrong
/// one would fail authentication.
#[tokio::test]
async fn scram_over_tls_uses_channel_binding() {
    init_tracing();
    let pki = Pki::new();
    let pg = Pg::builder()
        .tls(&pki.server("pg"))
        .start()
        .await
        .expect("a TLS-only cluster");
    let admin = pg.client().await;
    admin
        .batch_execute(
            "SET password_encryption = 'scram-sha-256'; ALTER ROLE railguard PASSWORD 'pw'",
        )
        .await
        .unwrap();
    std::fs::write(
        pg.server.data_dir().join("pg_hba.conf"),
        "hostssl all all 127.0.0.1/32 scram-sha-256\n",
    )
    .unwrap();
    admin
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
    let url = format!(
        "postgres://railguard:pw@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={}&channel_binding=require",
        pg.server.port(),
        path(&pki.ca)
    );
    // The reload is asynchronous: until it lands, trust still answers (and would not
    // bind the channel, which channel_binding=require refuses).
    let connected = support::within(Duration::from_secs(5), || async {
        let connected = pg.client_with(&url).await;
        if let Err(e) = &connected {
            tracing::debug!(error = %e, "waiting for the reload");
        }
        connected.ok()
    })
    .await;
    let client = match connected {
        Ok(client) => client,
        Err(_) => match pg.client_with(&url).await {
            Ok(client) => client,
            Err(e) => panic!("SCRAM with channel binding failed: {e}"),
        },
    };
    let ssl: bool = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ssl);
    let wrong = url.replace(":pw@", ":nope@");
    let e = pg
        .client_with(&wrong)
        .await
        .expect_err("a wrong password is refused");
    assert!(e.contains("password"), "{e}");
    let db = open(&url, "")
        .await
        .expect("railguard's pool authenticates with SCRAM-PLUS");
    db.shutdown().await;
}
