//! The PostgreSQL backend's release listener: a session that `LISTEN`s for releases, so that
//! waiters wake as soon as a lock is released. A server that goes silent under it (a paused
//! process, a path holding its packets) leaves the session open and hears nothing; the
//! listener's periodic check notices, moves to a session that answers, and hears releases
//! there.

use railguard_testkit as support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::{Pg, Relay, eventually};

#[tokio::test]
async fn a_listener_whose_server_goes_silent_moves_to_one_that_answers() {
    support::init_tracing();
    let pg = Pg::start().await;
    let path = Relay::start(format!("127.0.0.1:{}", pg.server.port()).parse().unwrap()).await;
    let url = path.postgres_url(&pg.url());
    let heard = Arc::new(Mutex::new(Vec::<String>::new()));
    let sessions = Arc::new(Mutex::new(0usize));
    let listener = tokio::spawn(railguard::lock::postgres::listen_for_releases(
        url,
        Duration::from_millis(1000),
        {
            let heard = heard.clone();
            move |key: &str| heard.lock().unwrap().push(key.to_string())
        },
        {
            let sessions = sessions.clone();
            move || *sessions.lock().unwrap() += 1
        },
    ));
    let count = |sessions: &Arc<Mutex<usize>>| *sessions.lock().unwrap();
    eventually(
        Duration::from_secs(20),
        "the listener listening",
        || async { (count(&sessions) >= 1).then_some(()) },
    )
    .await;
    // The listener's session goes silent at its next check, and stays open.
    path.stall_first_containing(b"pg_is_in_recovery");
    eventually(
        Duration::from_secs(30),
        "the listener to leave its silent session for a new one",
        || async { (count(&sessions) >= 2).then_some(()) },
    )
    .await;
    let notify = pg.client().await;
    eventually(
        Duration::from_secs(20),
        "a release announced now to be heard on the new connection",
        || async {
            notify
                .batch_execute(&format!(
                    "NOTIFY {}, 'acct-1'",
                    railguard::lock::postgres::RELEASE_CHANNEL
                ))
                .await
                .unwrap();
            heard
                .lock()
                .unwrap()
                .iter()
                .any(|key| key == "acct-1")
                .then_some(())
        },
    )
    .await;
    listener.abort();
    path.release_stalled();
}
