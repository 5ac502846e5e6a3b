//! `bare-proxy --fence-database`, the wire suite's floor of a fenced forward, does the work it
//! stands for on a real PostgreSQL and a real rail simulator: a grant proof checked, the mark
//! raised by railguard's compare-and-set, a keyed request's record made and its answer stored,
//! a lower token refused with nothing forwarded. A floor that skipped any of it would measure
//! less than a fenced forward costs.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use railguard::proof::ProofKey;
use railguard::token::FencingToken;
use railguard_testkit::{Http, Pg, Rail, free_loopback_port, until};

/// The grant-proof key the floor reads from its database.
const PROOF_KEY: [u8; 32] = [7; 32];

#[tokio::test(flavor = "multi_thread")]
async fn the_floor_fences_and_records_as_railguard_does() {
    let pg = Pg::start().await;
    let mut client = pg.client().await;
    railguard::db::migrate::migrate(&mut client)
        .await
        .expect("migrate the floor's database");
    client
        .execute(
            "INSERT INTO railguard_secret (name, value) VALUES ('grant_proof', $1)",
            &[&PROOF_KEY.as_slice()],
        )
        .await
        .expect("store the grant-proof key");
    let rail = Rail::start().await;
    let port = free_loopback_port();
    let _floor = tokio::process::Command::new(env!("CARGO_BIN_EXE_bare-proxy"))
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--upstream")
        .arg(rail.url())
        .arg("--fence-database")
        .arg(pg.url())
        .arg("--last-look")
        .kill_on_drop(true)
        .spawn()
        .expect("start bare-proxy");
    let url = format!("http://127.0.0.1:{port}/payments");
    let proofs = Arc::new(ProofKey::from_bytes(&PROOF_KEY));
    let http = Http::new().with_proofs(Some(proofs.clone()));
    until(Duration::from_secs(30), "bare-proxy listening", || {
        let (http, url) = (http.clone(), url.clone());
        async move { http.get(&url).await.is_ok() }
    })
    .await;

    // A keyed payment: forwarded once, the mark raised to its token, its answer stored in the
    // record its compare-and-set made.
    let paid = http
        .pay(
            &url,
            &[
                ("Fencing-Token", "5"),
                ("Fencing-Account", "acct-1"),
                ("Idempotency-Key", "key-1"),
            ],
            r#"{"amount": 1}"#,
        )
        .await;
    assert!(paid.status.is_success(), "{paid:?}");
    assert_eq!(rail.times_paid("key-1"), 1);
    assert_eq!(pg.mark("acct-1").await, Some(5));
    let stored: i16 = pg
        .one(
            "SELECT status FROM idempotency_record
             WHERE account_id = 'acct-1' AND idempotency_key = 'key-1' AND state = 'done'",
            &[],
        )
        .await;
    assert_eq!(stored, i16::try_from(paid.status.as_u16()).unwrap());

    // A lower token: refused, nothing forwarded, the mark where it was.
    let stale = http
        .pay(
            &url,
            &[("Fencing-Token", "4"), ("Fencing-Account", "acct-1")],
            "{}",
        )
        .await;
    assert_eq!(stale.status, StatusCode::CONFLICT);
    // A token with another account's proof: refused before the database.
    let proof = proofs.sign("acct-2", FencingToken::new(6).unwrap());
    let misproved = http
        .pay(
            &url,
            &[
                ("Fencing-Token", "6"),
                ("Fencing-Account", "acct-1"),
                ("Fencing-Proof", &proof),
            ],
            "{}",
        )
        .await;
    assert_eq!(misproved.status, StatusCode::BAD_REQUEST);
    rail.assert_paid(1, "only the first payment reaches the rail");
    assert_eq!(pg.mark("acct-1").await, Some(5));

    // An unkeyed payment under a higher token goes through the statement without records.
    let unkeyed = http
        .pay(
            &url,
            &[("Fencing-Token", "6"), ("Fencing-Account", "acct-1")],
            "{}",
        )
        .await;
    assert!(unkeyed.status.is_success(), "{unkeyed:?}");
    rail.assert_paid(2, "the unkeyed payment reaches the rail");
    assert_eq!(pg.mark("acct-1").await, Some(6));
}
