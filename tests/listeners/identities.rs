//! The identities the listener tests authenticate as, a railguard that knows them (a
//! credentials file it reloads every 100 ms), and raw requests with a bearer secret.

use railguard_testkit as support;

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use railguard::auth::secret;

/// Workers: eu and eu2 on `acct-eu-*`, us on `acct-us-*`, slow on `acct-slow-*` at two lock
/// requests a second.
pub(crate) const EU: &str =
    "rgs_eu_0000000000000000000000000000000000000000000000000000000000000001";
pub(crate) const EU2: &str =
    "rgs_eu2_000000000000000000000000000000000000000000000000000000000000002";
pub(crate) const US: &str =
    "rgs_us_0000000000000000000000000000000000000000000000000000000000000003";
pub(crate) const SLOW: &str =
    "rgs_slow_000000000000000000000000000000000000000000000000000000000006";
/// Operators: reader may read, oncall may read and write.
pub(crate) const READER: &str =
    "rgs_reader_0000000000000000000000000000000000000000000000000000000004";
pub(crate) const ONCALL: &str =
    "rgs_oncall_0000000000000000000000000000000000000000000000000000000005";

pub(crate) const JSON: [(&str, &str); 1] = [("content-type", "application/json")];

/// The credentials file naming every identity above, then `extra`.
pub(crate) fn credentials(extra: &str) -> String {
    let d = secret::digest_text;
    format!(
        "[[worker]]\nname = \"eu\"\nsecrets = [\"{}\"]\naccounts = [\"acct-eu-*\"]\n\
         [[worker]]\nname = \"eu2\"\nsecrets = [\"{}\"]\naccounts = [\"acct-eu-*\"]\n\
         [[worker]]\nname = \"us\"\nsecrets = [\"{}\"]\naccounts = [\"acct-us-*\"]\n\
         [[worker]]\nname = \"slow\"\nsecrets = [\"{}\"]\naccounts = [\"acct-slow-*\"]\n\
         lock_requests_per_s = 2\n\
         [[operator]]\nname = \"reader\"\nsecrets = [\"{}\"]\nmay = [\"read\"]\n\
         [[operator]]\nname = \"oncall\"\nsecrets = [\"{}\"]\nmay = [\"read\", \"write\"]\n{extra}",
        d(EU),
        d(EU2),
        d(US),
        d(SLOW),
        d(READER),
        d(ONCALL)
    )
}

/// PostgreSQL, the rail, and a railguard that authenticates the identities above.
pub(crate) struct Setup {
    pub(crate) pg: support::Pg,
    pub(crate) rail: support::Rail,
    pub(crate) rg: support::Railguard,
    _dir: tempfile::TempDir,
    /// The credentials file railguard reloads.
    pub(crate) file: PathBuf,
}

/// A temp dir holding `credentials.toml` with the test identities ([`credentials`] with none
/// added), and that file's path.
pub(crate) fn credentials_file() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("credentials.toml");
    std::fs::write(&file, credentials("")).unwrap();
    (dir, file)
}

/// A [`Setup`] with more `RAILGUARD__…` overrides, its railguard in this process or, with
/// `process`, a child process.
pub(crate) async fn setup(env: &[(&str, &str)], process: bool) -> Setup {
    support::init_tracing();
    let pg = support::Pg::start().await;
    let rail = support::Rail::start().await;
    let (dir, file) = credentials_file();
    let mut all = vec![
        ("RAILGUARD__AUTH__CREDENTIALS_FILE", file.to_str().unwrap()),
        ("RAILGUARD__AUTH__RELOAD_INTERVAL_MS", "100"),
    ];
    all.extend_from_slice(env);
    let rg = if process {
        support::Railguard::start_process(&pg.url(), &rail.url(), &all).await
    } else {
        support::Railguard::start(&pg.url(), &rail.url(), &all).await
    };
    Setup {
        pg,
        rail,
        rg,
        _dir: dir,
        file,
    }
}

/// A raw request to one of railguard's listeners, with an optional bearer secret; answered
/// within 10 s.
pub(crate) async fn call(
    method: Method,
    url: &str,
    secret: Option<&str>,
    headers: &[(&str, &str)],
    body: &str,
) -> support::Reply {
    let mut request = Request::builder().method(method).uri(url);
    if let Some(secret) = secret {
        request = request.header("authorization", format!("Bearer {secret}"));
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), support::Http::new().send(request))
        .await
        .expect("answered within 10 s")
        .expect("railguard answers")
}

/// `account`'s mark as the reader sees it on the admin listener (0: none).
pub(crate) async fn mark(rg: &support::Railguard, account: &str) -> i64 {
    let reply = call(
        Method::POST,
        &format!("http://{}/marks", rg.admin),
        Some(READER),
        &JSON,
        &format!("{{\"account\":\"{account}\"}}"),
    )
    .await;
    reply.assert_status(StatusCode::OK);
    reply.json()["mark"].as_i64().unwrap_or(0)
}
