//! Proves the etcd test harness: real etcd members start, serve the JSON gateway, elect a
//! leader, and survive being stopped and restarted.

use railguard_testkit as support;

use std::time::Duration;

use support::etcd::{EtcdCluster, LeaseCounts, MemberState, base64_decode, base64_encode};
use tokio::time::Instant;

#[test]
fn base64_round_trips() {
    for (plain, encoded) in [
        ("", ""),
        ("f", "Zg=="),
        ("fo", "Zm8="),
        ("foo", "Zm9v"),
        ("foob", "Zm9vYg=="),
        ("fooba", "Zm9vYmE="),
        ("foobar", "Zm9vYmFy"),
    ] {
        assert_eq!(base64_encode(plain.as_bytes()), encoded);
        assert_eq!(base64_decode(encoded).unwrap(), plain.as_bytes());
    }
    let all: Vec<u8> = (0..=255).collect();
    assert_eq!(base64_decode(&base64_encode(&all)).unwrap(), all);
    assert_eq!(base64_decode("Zm9v!"), None);
}

#[tokio::test]
async fn single_member_serves_reads_and_writes_with_increasing_revisions() {
    support::init_tracing();
    let etcd = EtcdCluster::single().await;
    assert_eq!(etcd.endpoints().len(), 1);
    assert_eq!(etcd.endpoints_csv(), etcd.endpoint(0));
    assert_eq!(etcd.leader().await, 0);

    let start = etcd.revision().await;
    assert_eq!(etcd.get("accounts/a").await, None);

    let first = etcd.put_raw("accounts/a", "one").await;
    assert!(first > start, "a write moves the revision past {start}");
    assert_eq!(
        etcd.get("accounts/a").await,
        Some((first, first, "one".to_string(), 0))
    );

    let second = etcd.put_raw("accounts/a", "two").await;
    assert!(second > first);
    assert_eq!(
        etcd.get("accounts/a").await,
        Some((first, second, "two".to_string(), 0)),
        "an overwrite keeps create_revision and moves mod_revision"
    );
    assert_eq!(etcd.revision().await, second);
}

#[tokio::test]
async fn three_members_elect_a_new_leader_when_the_leader_stops_and_it_rejoins() {
    support::init_tracing();
    let mut etcd = EtcdCluster::three().await;
    assert_eq!(etcd.endpoints().len(), 3);
    assert_eq!(etcd.endpoints_csv().split(',').count(), 3);

    let old = etcd.leader().await;
    let written = etcd.put_raw("k", "before").await;

    let began = Instant::now();
    etcd.stop(old).await;
    assert_eq!(etcd.state(old), MemberState::Stopped);
    let new = etcd.leader().await;
    assert_ne!(new, old, "a stopped member cannot stay leader");
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "new leader took {:?}",
        began.elapsed()
    );
    assert_eq!(
        etcd.get("k").await.map(|(_, m, v, _)| (m, v)),
        Some((written, "before".to_string())),
        "the surviving quorum still has the write"
    );
    let during = etcd.put_raw("k", "during").await;

    etcd.start(old).await;
    assert!(etcd.healthy(old).await, "restarted member is healthy");
    assert_eq!(etcd.state(old), MemberState::Running);
    let leader = etcd.leader().await;
    assert!(leader < 3);
    // The restarted member serves the write it missed.
    assert_eq!(
        etcd.get_from(old, "k").await.map(|(_, m, v, _)| (m, v)),
        Some((during, "during".to_string()))
    );
}

#[tokio::test]
async fn killed_and_paused_members_are_handled() {
    support::init_tracing();
    let mut etcd = EtcdCluster::three().await;
    let leader = etcd.leader().await;
    let follower = (leader + 1) % 3;

    etcd.pause(follower).await;
    assert_eq!(etcd.state(follower), MemberState::Paused);
    assert_eq!(
        etcd.leader().await,
        leader,
        "losing a follower keeps the leader"
    );
    etcd.put_raw("k", "v").await;
    etcd.resume(follower).await;

    etcd.kill(leader).await;
    let new = etcd.leader().await;
    assert_ne!(new, leader);
    etcd.start(leader).await;
    assert!(etcd.healthy(leader).await);
    assert_eq!(
        etcd.get("k").await.map(|(_, _, v, _)| v).as_deref(),
        Some("v")
    );
}

#[tokio::test]
async fn leases_are_listed_timed_revoked_and_counted() {
    support::init_tracing();
    let etcd = EtcdCluster::single().await;
    assert!(
        etcd.leases().await.is_empty(),
        "a fresh cluster has no lease"
    );
    let fresh = etcd.lease_counts(0).await;
    assert_eq!(
        fresh,
        LeaseCounts {
            granted: 0,
            revoked: 0,
            renewed: 0
        }
    );

    let a = etcd.grant_lease(30).await;
    let b = etcd.grant_lease(30).await;
    let mut both = vec![a, b];
    both.sort_unstable();
    assert_eq!(etcd.leases().await, both);
    let (remaining, granted) = etcd.lease_ttl(a).await.expect("lease a exists");
    assert_eq!(granted, 30);
    assert!((28..=30).contains(&remaining), "{remaining}");

    assert!(etcd.revoke_lease(a).await);
    assert!(!etcd.revoke_lease(a).await, "a revoked lease is gone");
    assert_eq!(etcd.lease_ttl(a).await, None);
    assert_eq!(etcd.leases().await, [b]);
    assert_eq!(
        etcd.lease_counts(0).await,
        LeaseCounts {
            granted: 2,
            revoked: 1,
            renewed: 0
        }
    );
}

/// A restore puts the whole cluster back at the snapshot: later writes are gone and the
/// revision is back where it was, so the next write repeats a revision already seen. Members
/// keep their ids and ports, so clients reconnect to the same endpoints.
#[tokio::test]
async fn a_cluster_restored_from_a_snapshot_forgets_later_writes_and_repeats_revisions() {
    support::init_tracing();
    for members in [1, 3] {
        let mut etcd = EtcdCluster::builder()
            .members(members)
            .start()
            .await
            .unwrap();
        let kept = etcd.put_raw("k", "kept").await;
        let snapshot = etcd.snapshot().await.unwrap();
        assert_eq!(snapshot.revision, kept, "{members} members");
        let mut later = 0;
        for i in 0..5 {
            later = etcd.put_raw("k", &format!("later {i}")).await;
        }
        let ids: Vec<_> = member_ids(&etcd).await;

        etcd.restore(&snapshot).await.unwrap();
        assert_eq!(
            etcd.get("k").await.map(|(_, m, v, _)| (m, v)),
            Some((kept, "kept".to_string())),
            "{members} members: the writes after the snapshot are gone"
        );
        assert_eq!(etcd.revision().await, kept);
        let again = etcd.put_raw("k", "again").await;
        assert!(
            again <= later,
            "{members} members: revision {again} was already used"
        );
        assert_eq!(member_ids(&etcd).await, ids, "same member ids");
        etcd.leader().await;
    }
}

async fn member_ids(etcd: &EtcdCluster) -> Vec<u64> {
    let mut ids = Vec::new();
    for i in 0..etcd.size() {
        ids.push(etcd.status(i).await.expect("member answers").0);
    }
    ids
}
