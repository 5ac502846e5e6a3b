//! The lock-service load: `clients` closed loops, each acquiring and releasing its own key
//! as fast as it can. One *cycle* is an acquire (`wait_ms = 0`, 10 s lease) followed by the
//! release of the token it returned; its latency is the time of both.
//!
//! Each client owns one key (`bench-lock-<client>`) and releases it before acquiring it again,
//! so no cycle ever waits for another client: the load measures the cost of granting and ending
//! a lease, not contention. The same keys, the same lease and the same number of round trips
//! to the backend are used by the baselines it is compared with:
//!
//! - on PostgreSQL, pgbench runs `lock::postgres::ACQUIRE_SQL` then `RELEASE_SQL` on
//!   `'bench-lock-' || :client_id` (see [`pgbench_script`]);
//! - on etcd, [`run_etcd_native`] drives etcd's own `Lock`/`Unlock` RPC with the `etcd-client`
//!   crate the etcd backend uses: lease grant, lock, unlock, lease revoke — four requests, like
//!   the backend's lease grant + create transaction, and release transaction + lease revoke.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use etcd_client::{Client, ConnectOptions, LockOptions};
use http::StatusCode;
use tokio::time::Instant;

use crate::load::{self, Connection, LoadResult, REQUEST_TIMEOUT};
use railguard::lock::postgres::{ACQUIRE_SQL, RELEASE_SQL};
use railguard_sdk::wire::{GrantResponse, TokenRequest};

/// The lease every cycle asks for. Longer than any cycle, so a grant never expires under its
/// holder; a cycle that fails after acquiring leaves its key held at most this long.
pub(crate) const LEASE_MS: u64 = 10_000;
/// Prefix of the keys; client `c` uses `{KEY_PREFIX}{c}`, counting from 0 like pgbench's
/// `:client_id`.
pub(crate) const KEY_PREFIX: &str = "bench-lock-";
const HOLDER: &str = "railguard-bench";

/// One run of cycles.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CycleLoad {
    pub clients: usize,
    pub duration: Duration,
    /// Cycles across all clients; a run stops at whichever of this and `duration` comes first.
    pub max_cycles: u64,
}

/// Cycles through the lock API at `target`. An answered cycle counts under the status of
/// its release (200), or under the acquire's status when the acquire was refused.
pub(crate) async fn run_api(target: SocketAddr, load: CycleLoad) -> LoadResult {
    let started = Instant::now();
    let deadline = started + load.duration;
    let clients = load.clients.max(1);
    let workers = (0..clients)
        .map(|client| {
            let budget = load::share(load.max_cycles, clients, client);
            tokio::spawn(async move {
                let mut connection = Connection::new(target);
                let mut result = LoadResult::default();
                let key = format!("{KEY_PREFIX}{client}");
                let mut sent = 0;
                while sent < budget && Instant::now() < deadline {
                    sent += 1;
                    let started = Instant::now();
                    let outcome = api_cycle(&mut connection, &key).await;
                    result.record(started, outcome).await;
                }
                result
            })
        })
        .collect();
    load::collect(started, workers).await
}

/// One acquire and release of `key` through the HTTP API.
pub(crate) async fn api_cycle(
    connection: &mut Connection,
    key: &str,
) -> Result<StatusCode, String> {
    let acquire = Bytes::from(format!(
        r#"{{"holder":"{HOLDER}","ttl_ms":{LEASE_MS},"wait_ms":0}}"#
    ));
    let (status, body) = connection
        .request(&format!("/v1/locks/{key}/acquire"), Some(acquire))
        .await
        .map_err(|e| format!("acquire: {e}"))?;
    if status != StatusCode::OK {
        return Ok(status);
    }
    let grant: GrantResponse =
        serde_json::from_slice(&body).map_err(|e| format!("acquire answer: {e}"))?;
    // Release is authorised by the grant's lease secret, as a worker's is.
    let release = TokenRequest {
        token: grant.token,
        lease_secret: Some(grant.lease_secret),
    };
    let release = serde_json::to_vec(&release).map_err(|e| format!("release request: {e}"))?;
    let release = Bytes::from(release);
    let (status, _) = connection
        .request(&format!("/v1/locks/{key}/release"), Some(release))
        .await
        .map_err(|e| format!("release: {e}"))?;
    Ok(status)
}

/// How the native baseline connects: as the etcd backend does (`lock::etcd`), with its
/// default timeouts, one client (one gRPC channel) shared by every task.
pub(crate) async fn connect_etcd(endpoint: &str) -> Result<Client, String> {
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_timeout(Duration::from_secs(2))
        .with_require_leader(true)
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
    Client::connect([endpoint], Some(options))
        .await
        .map_err(|e| format!("cannot connect to etcd at {endpoint}: {e}"))
}

/// Cycles through etcd's own `Lock`/`Unlock` RPC; every completed cycle counts as a 200.
pub(crate) async fn run_etcd_native(client: &Client, load: CycleLoad) -> LoadResult {
    let started = Instant::now();
    let deadline = started + load.duration;
    let clients = load.clients.max(1);
    let workers = (0..clients)
        .map(|c| {
            let budget = load::share(load.max_cycles, clients, c);
            let mut client = client.clone();
            tokio::spawn(async move {
                let mut result = LoadResult::default();
                let name = format!("/bench-native/{KEY_PREFIX}{c}");
                let mut sent = 0;
                while sent < budget && Instant::now() < deadline {
                    sent += 1;
                    let started = Instant::now();
                    let outcome =
                        tokio::time::timeout(REQUEST_TIMEOUT, native_cycle(&mut client, &name))
                            .await
                            .unwrap_or_else(|_| {
                                Err(format!("no answer within {REQUEST_TIMEOUT:?}"))
                            });
                    result.record(started, outcome).await;
                }
                result
            })
        })
        .collect();
    load::collect(started, workers).await
}

async fn native_cycle(client: &mut Client, name: &str) -> Result<StatusCode, String> {
    let lease = client
        .lease_grant((LEASE_MS / 1000) as i64, None)
        .await
        .map_err(|e| format!("lease grant: {e}"))?
        .id();
    let locked = client
        .lock(name, Some(LockOptions::new().with_lease(lease)))
        .await
        .map_err(|e| format!("lock: {e}"))?;
    client
        .unlock(locked.key().to_vec())
        .await
        .map_err(|e| format!("unlock: {e}"))?;
    client
        .lease_revoke(lease)
        .await
        .map_err(|e| format!("lease revoke: {e}"))?;
    Ok(StatusCode::OK)
}

/// The pgbench script of one cycle: the backend's acquire statement, its token captured with
/// `\gset`, then the backend's release statement with that token. The parameters are written
/// in (acquire: `$1` the key, `$2` the holder, `$3` the lease, `$4` the secret's digest;
/// release: `$1` the key, `$2` the token, `$3` the digest, `$4` no caller identity), nothing
/// else is changed.
pub(crate) fn pgbench_script() -> String {
    let key = format!("'{KEY_PREFIX}' || :client_id");
    let acquire = ACQUIRE_SQL
        .replace("$1", &key)
        .replace("$2", &format!("'{HOLDER}'"))
        .replace("$3", &LEASE_MS.to_string())
        .replace("$4", BENCH_SECRET_DIGEST);
    let release = RELEASE_SQL
        .replace("$1", &key)
        .replace("$2", ":token")
        .replace("$3", BENCH_SECRET_DIGEST)
        // The caller's identity: none, as for the lock API with authentication off.
        .replace("$4", "NULL");
    format!("{acquire} \\gset\n{release};\n")
}

/// The lease-secret digest every pgbench client's grants carry: the script's release must
/// present its grant's digest, as the lock API's does.
const BENCH_SECRET_DIGEST: &str =
    "decode('0000000000000000000000000000000000000000000000000000000000000000', 'hex')";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pgbench_script_is_the_backends_acquire_then_release() {
        let script = pgbench_script();
        assert!(!script.contains('$'), "{script}");
        assert!(
            script.contains("VALUES ('bench-lock-' || :client_id, 'railguard-bench', nextval"),
            "{script}"
        );
        assert!(
            script.contains("expiry_noticed_at_grant \\gset\n"),
            "{script}"
        );
        assert!(
            script.contains("WHERE key = 'bench-lock-' || :client_id AND token = :token"),
            "{script}"
        );
        assert!(script.ends_with("FROM ended;\n"), "{script}");
    }
}
