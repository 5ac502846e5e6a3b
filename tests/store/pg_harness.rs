//! Proves the PostgreSQL test harness's rewind: a cluster put back to a copy of its data
//! directory taken while it served has lost every commit made after the copy — rows and
//! sequences together — and serves again on the same port.

use railguard_testkit as support;

use support::Pg;

#[tokio::test]
async fn a_cluster_rewound_to_a_copy_loses_what_was_committed_after_it() {
    support::init_tracing();
    let mut pg = Pg::start().await;
    let url = pg.url();
    let client = pg.client().await;
    client
        .batch_execute(
            "CREATE SEQUENCE s; CREATE TABLE t (v bigint); \
             INSERT INTO t SELECT nextval('s') FROM generate_series(1, 3);",
        )
        .await
        .unwrap();

    let copy = pg.copy_data().await.unwrap();
    assert!(!copy.lsn.is_empty());
    client
        .batch_execute("INSERT INTO t SELECT nextval('s') FROM generate_series(1, 100)")
        .await
        .unwrap();

    pg.rewind_to(&copy).await.unwrap();
    assert_eq!(pg.url(), url, "same port");
    assert!(client.is_closed() || client.simple_query("SELECT 1").await.is_err());
    let client = pg.client().await;
    let count: i64 = support::sql::one(&client, "SELECT count(*) FROM t", &[]).await;
    assert_eq!(count, 3, "the rows inserted after the copy are gone");
    let next: i64 = support::sql::one(&client, "SELECT nextval('s')", &[]).await;
    // A sequence is WAL-logged 32 values ahead: it comes back within that of the copy's.
    assert!(next <= 3 + 33, "the sequence went back: next is {next}");

    // The copy is kept: the cluster can be put back to it again.
    pg.rewind_to(&copy).await.unwrap();
    let count: i64 = pg
        .client()
        .await
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(count, 3);
}
