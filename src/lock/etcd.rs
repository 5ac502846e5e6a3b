//! The etcd lock backend (FR-10): the token is the lock key's ModRevision in the response of
//! the winning compare-and-set transaction. No counters, no extra keys.
//!
//! Layout: one key per lock, `<key_prefix><key>`, attached to one lease per grant, holding a
//! small JSON value (holder, ttl, grant time) for diagnosis.
//!
//! **Leases come from the acquire's session** ([`EtcdSession`]), as in etcd's `concurrency`
//! package: one lease per acquire, granted by its first attempt, reused by every retry while
//! it waits and kept alive meanwhile, then handed over to the grant or revoked once if the
//! acquire ends without one. Each attempt keeps the lease alive just before its transaction,
//! so the grant's lease starts its whole ttl no earlier than the `expires_at` it reports
//! assumes, however long the wait was; a lease found gone by then is replaced.
//!
//! **Acquire** is one transaction: if the key does not exist (`create_revision == 0`), put it
//! with the session's lease. The response header's revision is the key's new ModRevision:
//! the token. If the key exists, it is held — unless the lease it is attached to no longer
//! exists. etcd deletes a key when its lease expires, so normally an expired grant's key is
//! simply gone; a key *without a live lease* (written without one, or left by a restore) can
//! never be renewed by anyone (renewal is the lease's keep-alive), so it holds nobody. Such an
//! entry is taken over **in place** by a second transaction that compares the key's
//! ModRevision with the one just read (nobody changed it meanwhile) and puts the new grant
//! with its own lease. The key keeps its CreateRevision; its ModRevision — the token — grows.
//! That is exactly why CreateRevision cannot be the token (ADR-002 §A2.5).
//!
//! **Renew** is one keep-alive of the grant's lease; it never writes the key, so the token
//! (ModRevision) cannot change. It first checks that the key's ModRevision is still the
//! caller's token and that the caller's lease secret hashes to the one stored with the grant
//! (C2 §2.3): the token alone authorises nothing. **Release** checks the same, then deletes
//! the key in a transaction comparing the ModRevision with the token (so the check and the
//! delete are about one grant), then revokes the lease. A wrong secret for the current grant
//! is answered exactly like a grant that ended, and counted in `lock_rejected_secrets_total`.
//!
//! When etcd is unreachable or has no leader (`require_leader`), every call is `Unavailable`
//! (503): no grant is made and no token is invented.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, Identity, PutOptions,
    TlsOptions, Txn, TxnOp, TxnOpResponse, WatchFilterType, WatchOptions,
};
use serde::{Deserialize, Serialize};
use tokio::sync::OnceCell;

use super::service::LockMetrics;
use super::{
    Attempt, Grant, Inspection, LeaseSecret, LockBackend, LockError, LockKey, Released, Renewed,
};
use crate::token::FencingToken;
use std::sync::Arc;

/// How to reach etcd.
#[derive(Debug, Clone)]
pub struct EtcdSettings {
    pub endpoints: Vec<String>,
    pub dial_timeout: Duration,
    pub request_timeout: Duration,
    pub key_prefix: String,
    /// PEM files; all empty for plain HTTP.
    pub tls_ca_file: String,
    pub tls_cert_file: String,
    pub tls_key_file: String,
}

/// The value stored under a lock key: diagnosis only, never read for a decision except the
/// holder's name for `inspect`.
#[derive(Debug, Serialize, Deserialize)]
struct Entry {
    holder: String,
    ttl_ms: u64,
    granted_unix_ms: u64,
    /// Hex SHA-256 of the grant's lease secret: renew and release must present the secret.
    /// Entries written before secrets existed have none and can be renewed by nobody.
    #[serde(default)]
    secret_sha256: String,
}

pub struct EtcdLocks {
    settings: EtcdSettings,
    client: OnceCell<Client>,
    metrics: Option<Arc<LockMetrics>>,
}

/// One acquire's lease, like the session of etcd's own `concurrency` package: the first
/// attempt grants it, every later attempt of the same acquire reuses it, and a keeper task
/// keeps it alive in between, since a wait may last longer than the ttl. Without it a waiting
/// acquirer would grant and revoke a lease on every retry.
///
/// The attempt that wins puts the key with this lease and hands it over to the grant
/// (`hand_over`). Dropped while it still holds a lease — the wait ran out,
/// an error, the request dropped — the session revokes it, once: a lease whose grant nobody
/// received must not hold the key until it expires, and revoking also deletes the key if an
/// attempt's put landed but its answer was lost.
#[derive(Default)]
pub struct EtcdSession {
    /// Boxed: an etcd client is large, and a session without a lease should be small.
    lease: Option<Box<SessionLease>>,
}

struct SessionLease {
    client: Client,
    id: i64,
    /// The ttl asked for, in etcd's whole seconds: a later attempt asking for another one
    /// (not what the service does) gets a lease of its own.
    asked_secs: i64,
    /// The ttl etcd granted, which may be above the one asked for (its minimum TTL).
    granted: Duration,
    /// Keeps the lease alive between attempts; stopped when the lease leaves the session.
    keeper: tokio::task::JoinHandle<()>,
}

impl EtcdSession {
    /// The lease is a grant's now, the grant's holder renews it: stop keeping it alive, and
    /// never revoke it. A keep-alive the keeper still has in flight can only lengthen it.
    fn hand_over(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.keeper.abort();
        }
    }

    /// Stops using the lease and revokes it in the background (harmless if it is gone).
    fn give_back(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.keeper.abort();
            revoke_in_background(lease.client, lease.id);
        }
    }
}

impl Drop for EtcdSession {
    fn drop(&mut self) {
        self.give_back();
    }
}

fn revoke_in_background(mut client: Client, lease: i64) {
    // Dropped outside a runtime (a process tearing down): the lease simply expires.
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        if let Err(e) = client.lease_revoke(lease).await {
            tracing::debug!(error = %e, lease, "could not revoke an unused lease; it will expire");
        }
    });
}

/// A session's keeper: one keep-alive every third of the ttl (etcd's own client's cadence),
/// until aborted. Failures are only logged and retried at the next tick: the attempt before
/// a put checks the lease for itself, so the keeper's only job is to keep it from running
/// out while the acquire sleeps.
async fn keep_alive_while_waiting(mut client: Client, lease: i64, ttl: Duration, limit: Duration) {
    let every = (ttl / 3).max(Duration::from_millis(100));
    loop {
        tokio::time::sleep(every).await;
        match tokio::time::timeout(limit, client.lease_keep_alive(lease)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::debug!(error = %e, lease, "keep-alive of a waiting acquire's lease failed")
            }
            Err(_) => tracing::debug!(lease, "keep-alive of a waiting acquire's lease unanswered"),
        }
    }
}

fn unavailable(e: impl std::fmt::Display) -> LockError {
    LockError::Unavailable(format!("etcd: {e}"))
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

impl EtcdLocks {
    /// Connects lazily: railguard starts while etcd is down, and answers 503 until it is back.
    pub fn new(settings: EtcdSettings, metrics: Option<Arc<LockMetrics>>) -> Self {
        Self {
            settings,
            client: OnceCell::new(),
            metrics,
        }
    }

    /// A renewal or release found its grant gone: count it as an expiry noticed (etcd deletes
    /// expired keys itself, so this is where an expiry under a live holder shows).
    fn lost_noticed(&self) -> LockError {
        if let Some(metrics) = &self.metrics {
            metrics.expiries.inc();
        }
        LockError::Lost
    }

    /// Checks `secret` against the current grant of the key read as `kv`, which carries
    /// `token`. `Lost` when the grant is not the caller's, with the probe counted when the
    /// token named the current grant but the secret was wrong.
    fn authorise(
        &self,
        kv: Option<&etcd_client::KeyValue>,
        key: &LockKey,
        token: FencingToken,
        secret: &LeaseSecret,
        caller: Option<&str>,
    ) -> Result<i64, LockError> {
        let Some(kv) = kv else {
            return Err(self.lost_noticed());
        };
        if kv.mod_revision() != token.get() {
            return Err(self.lost_noticed());
        }
        let entry = serde_json::from_slice::<Entry>(kv.value()).ok();
        let stored = entry
            .as_ref()
            .map(|e| e.secret_sha256.as_str())
            .unwrap_or_default();
        if stored.is_empty() || stored != crate::proof::hex(&secret.digest()) {
            if let Some(metrics) = &self.metrics {
                metrics.rejected_secrets.inc();
            }
            tracing::warn!(lock.key = %key,
                "a renew or release named the key's current grant with the wrong lease secret");
            return Err(LockError::Lost);
        }
        // Only once the token and secret matched, so the answer confirms nothing new.
        if let Some(caller) = caller
            && entry.is_some_and(|e| e.holder != caller)
        {
            tracing::warn!(lock.key = %key, caller,
                "a renew or release presented the grant of another identity");
            return Err(LockError::OtherHolder);
        }
        Ok(kv.lease())
    }

    fn options(&self) -> Result<ConnectOptions, LockError> {
        let s = &self.settings;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(s.dial_timeout)
            .with_timeout(s.request_timeout)
            .with_require_leader(true)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        if !s.tls_ca_file.is_empty() || !s.tls_cert_file.is_empty() {
            let mut tls = TlsOptions::new();
            if !s.tls_ca_file.is_empty() {
                let ca = std::fs::read(&s.tls_ca_file)
                    .map_err(|e| unavailable(format!("etcd.tls_ca_file {}: {e}", s.tls_ca_file)))?;
                tls = tls.ca_certificate(Certificate::from_pem(ca));
            }
            if !s.tls_cert_file.is_empty() {
                let cert = std::fs::read(&s.tls_cert_file).map_err(|e| {
                    unavailable(format!("etcd.tls_cert_file {}: {e}", s.tls_cert_file))
                })?;
                let key = std::fs::read(&s.tls_key_file).map_err(|e| {
                    unavailable(format!("etcd.tls_key_file {}: {e}", s.tls_key_file))
                })?;
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            options = options.with_tls(tls);
        }
        Ok(options)
    }

    /// A client sharing the one connection. Calls take `&mut`, so each gets a cheap clone.
    pub(crate) async fn client(&self) -> Result<Client, LockError> {
        let client = self
            .client
            .get_or_try_init(|| async {
                let options = self.options()?;
                tokio::time::timeout(
                    self.settings.dial_timeout,
                    Client::connect(&self.settings.endpoints, Some(options)),
                )
                .await
                .map_err(|_| {
                    unavailable(format!(
                        "no endpoint answered within {:?}",
                        self.settings.dial_timeout
                    ))
                })?
                .map_err(unavailable)
            })
            .await?;
        Ok(client.clone())
    }

    /// Deadline for one request.
    pub fn request_timeout(&self) -> Duration {
        self.settings.request_timeout
    }

    /// The key `railguard fast-forward` writes to: beside the lock prefix, never under it, so
    /// the release watcher never sees it and no lock key can be it.
    pub fn scratch_key(&self) -> String {
        format!(
            "{}.fast-forward",
            self.settings.key_prefix.trim_end_matches('/')
        )
    }

    fn path(&self, key: &LockKey) -> String {
        format!("{}{}", self.settings.key_prefix, key.as_str())
    }

    /// Bounds a whole operation (several RPCs) by twice the request timeout.
    async fn bounded<T>(
        &self,
        work: impl Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        let limit = self.settings.request_timeout * 2;
        tokio::time::timeout(limit, work)
            .await
            .unwrap_or_else(|_| Err(unavailable(format!("no answer within {limit:?}"))))
    }

    /// The lease this attempt puts with, and the instant (µs since the Unix epoch) from which
    /// it has its whole ttl: taken just before the session's lease was kept alive, or before a
    /// new one was granted. So a grant's lease is never shorter than its ttl says, however
    /// long the acquire waited. A lease the keep-alive finds gone (expired while the acquire
    /// stalled) is replaced: no put ever carries a dead lease.
    async fn attempt_lease(
        &self,
        client: &mut Client,
        session: &mut EtcdSession,
        ttl_secs: i64,
    ) -> Result<(i64, Duration, i64), LockError> {
        if let Some(lease) = &session.lease {
            if lease.asked_secs == ttl_secs {
                let since_us = now_us();
                match client.lease_keep_alive(lease.id).await {
                    Ok(_) => return Ok((lease.id, lease.granted, since_us)),
                    // etcd answered TTL 0 (the lease is gone), or the keep-alive got no
                    // answer on its stream: either way not known to be alive. Replace it.
                    Err(etcd_client::Error::LeaseKeepAliveError(e)) => {
                        tracing::debug!(error = %e, lease = lease.id,
                            "a waiting acquire's lease is gone; granting a new one");
                    }
                    Err(e) => return Err(unavailable(e)),
                }
            }
            session.give_back();
        }
        let since_us = now_us();
        let granted = client
            .lease_grant(ttl_secs, None)
            .await
            .map_err(unavailable)?;
        let ttl = Duration::from_secs(granted.ttl().max(1) as u64);
        let keeper = tokio::spawn(keep_alive_while_waiting(
            client.clone(),
            granted.id(),
            ttl,
            self.settings.request_timeout,
        ));
        session.lease = Some(Box::new(SessionLease {
            client: client.clone(),
            id: granted.id(),
            asked_secs: ttl_secs,
            granted: ttl,
            keeper,
        }));
        Ok((granted.id(), ttl, since_us))
    }

    /// An upper bound of the time `lease` has left, or `None` when it does not exist (expired
    /// or revoked). etcd answers whole seconds, rounded down ("expires in under TTL+1
    /// seconds"), and -1 for a lease that is gone: 0 is a live lease in its last second.
    async fn lease_remaining(
        client: &mut Client,
        lease: i64,
    ) -> Result<Option<Duration>, LockError> {
        if lease == 0 {
            return Ok(None);
        }
        let ttl = client
            .lease_time_to_live(lease, None)
            .await
            .map_err(unavailable)?
            .ttl();
        Ok((ttl >= 0).then(|| Duration::from_secs(ttl as u64 + 1)))
    }

    /// Wakes `on_release` with each released key (deleted: released or expired) until the
    /// process ends; reconnects on failure and calls `on_reconnect` (events may be missed).
    pub async fn watch_releases(
        &self,
        on_release: impl Fn(&str) + Send + 'static,
        on_reconnect: impl Fn() + Send + 'static,
    ) {
        let mut backoff = Duration::from_millis(100);
        loop {
            if let Ok(mut client) = self.client().await {
                let options = WatchOptions::new()
                    .with_prefix()
                    .with_filters([WatchFilterType::NoPut]);
                if let Ok(mut stream) = client
                    .watch(self.settings.key_prefix.as_str(), Some(options))
                    .await
                {
                    backoff = Duration::from_millis(100);
                    while let Ok(Some(response)) = stream.message().await {
                        if response.created() {
                            // Watching from here on: releases before this may have been missed.
                            on_reconnect();
                        }
                        if response.canceled() {
                            tracing::warn!(
                                reason = response.cancel_reason(),
                                "etcd cancelled the release watch; re-watching"
                            );
                            break;
                        }
                        for event in response.events() {
                            if event.event_type() == EventType::Delete
                                && let Some(kv) = event.kv()
                                && let Ok(key) = kv.key_str()
                                && let Some(key) =
                                    key.strip_prefix(self.settings.key_prefix.as_str())
                            {
                                on_release(key);
                            }
                        }
                    }
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}

impl LockBackend for EtcdLocks {
    type Session = EtcdSession;

    fn name(&self) -> &'static str {
        "etcd"
    }

    fn session(&self) -> EtcdSession {
        EtcdSession::default()
    }

    async fn try_acquire(
        &self,
        session: &mut EtcdSession,
        key: &LockKey,
        holder: &str,
        ttl: Duration,
    ) -> Result<Attempt, LockError> {
        self.bounded(async {
            let mut client = self.client().await?;
            let path = self.path(key);
            // etcd leases are whole seconds: round up, never down.
            let ttl_secs = ttl.as_millis().div_ceil(1000).max(1) as i64;
            let (lease, granted_ttl, full_since_us) =
                self.attempt_lease(&mut client, session, ttl_secs).await?;
            let secret = LeaseSecret::generate();
            let value = serde_json::to_string(&Entry {
                holder: holder.to_string(),
                ttl_ms: granted_ttl.as_millis() as u64,
                granted_unix_ms: (full_since_us / 1000) as u64,
                secret_sha256: crate::proof::hex(&secret.digest()),
            })
            .map_err(|e| unavailable(format!("cannot encode the entry: {e}")))?;
            let put = TxnOp::put(
                path.as_str(),
                value.as_str(),
                Some(PutOptions::new().with_lease(lease)),
            );
            let create = Txn::new()
                .when([Compare::create_revision(path.as_str(), CompareOp::Equal, 0)])
                .and_then([put.clone()])
                .or_else([TxnOp::get(path.as_str(), None)]);
            let response = client.txn(create).await.map_err(unavailable)?;
            let grant = |revision: i64, took_over: bool| {
                let token = FencingToken::new(revision)
                    .ok_or_else(|| unavailable("non-positive revision"))?;
                Ok::<_, LockError>(Attempt::Granted(Grant {
                    key: key.clone(),
                    holder: holder.to_string(),
                    token,
                    secret: secret.clone(),
                    ttl: granted_ttl,
                    granted_at_us: now_us(),
                    // Not etcd's clock (it exposes none): a lower bound on when the lease can
                    // end, since it was granted or kept alive after this instant. Diagnosis
                    // only.
                    expires_at_us: full_since_us + granted_ttl.as_micros() as i64,
                    took_over,
                }))
            };
            if response.succeeded() {
                let revision = response
                    .header()
                    .map(|h| h.revision())
                    .ok_or_else(|| unavailable("no header"))?;
                let granted = grant(revision, false)?;
                session.hand_over();
                return Ok(granted);
            }
            let current = response
                .op_responses()
                .into_iter()
                .find_map(|op| match op {
                    TxnOpResponse::Get(get) => get
                        .kvs()
                        .first()
                        .map(|kv| (kv.mod_revision(), kv.lease())),
                    _ => None,
                });
            let Some((mod_revision, holder_lease)) = current else {
                // Deleted between the compare and the get: free now; the waiter tries again.
                return Ok(Attempt::Held {
                    retry_in: Some(Duration::ZERO),
                });
            };
            if holder_lease == lease {
                // This acquire's own put, by an earlier attempt whose answer was lost (it
                // failed or timed out after etcd applied it): a grant nobody received.
                // Revoking the lease deletes it; the next attempt starts over with a new
                // lease. If the revoke fails, the session still holds the lease, so the next
                // attempt or the session's end tries again.
                tracing::warn!(lock.key = %key,
                    "revoking a grant this acquire made but whose answer it never received");
                client.lease_revoke(lease).await.map_err(unavailable)?;
                if let Some(gone) = session.lease.take() {
                    gone.keeper.abort();
                }
                return Ok(Attempt::Held {
                    retry_in: Some(Duration::ZERO),
                });
            }
            if let Some(remaining) = Self::lease_remaining(&mut client, holder_lease).await? {
                return Ok(Attempt::Held {
                    retry_in: Some(remaining),
                });
            }
            let takeover = Txn::new()
                .when([Compare::mod_revision(
                    path.as_str(),
                    CompareOp::Equal,
                    mod_revision,
                )])
                .and_then([put]);
            let response = client.txn(takeover).await.map_err(unavailable)?;
            match (response.succeeded(), response.header()) {
                (true, Some(header)) => {
                    tracing::warn!(lock.key = %key, "took over an entry whose lease no longer exists");
                    let granted = grant(header.revision(), true)?;
                    session.hand_over();
                    Ok(granted)
                }
                _ => Ok(Attempt::Held {
                    retry_in: Some(Duration::ZERO),
                }),
            }
        })
        .await
    }

    async fn renew(
        &self,
        key: &LockKey,
        token: FencingToken,
        secret: &LeaseSecret,
        caller: Option<&str>,
    ) -> Result<Renewed, LockError> {
        self.bounded(async {
            let mut client = self.client().await?;
            let path = self.path(key);
            let found = client.get(path.as_str(), None).await.map_err(unavailable)?;
            let lease = self.authorise(found.kvs().first(), key, token, secret, caller)?;
            if lease == 0 {
                return Err(self.lost_noticed());
            }
            let ttl_ms = found
                .kvs()
                .first()
                .and_then(|kv| serde_json::from_slice::<Entry>(kv.value()).ok())
                .map(|e| e.ttl_ms)
                .unwrap_or(1000);
            let sent_us = now_us();
            // One keep-alive; etcd answers TTL 0 for a lease that is gone (expired, even if not
            // yet revoked, or revoked by a release), which the client reports as an error.
            match client.lease_keep_alive(lease).await {
                Ok(_) => {}
                Err(etcd_client::Error::LeaseKeepAliveError(_)) => return Err(self.lost_noticed()),
                Err(e) => return Err(unavailable(e)),
            }
            // The read and the keep-alive are two steps: confirm the key is still this grant's,
            // so a renewal never answers "yes" for a grant that was replaced meanwhile.
            let after = client.get(path.as_str(), None).await.map_err(unavailable)?;
            match after.kvs().first() {
                Some(kv) if kv.mod_revision() == token.get() && kv.lease() == lease => {
                    let ttl = Duration::from_millis(ttl_ms);
                    Ok(Renewed {
                        expires_at_us: sent_us + ttl.as_micros() as i64,
                        ttl,
                    })
                }
                _ => Err(self.lost_noticed()),
            }
        })
        .await
    }

    async fn release(
        &self,
        key: &LockKey,
        token: FencingToken,
        secret: &LeaseSecret,
        caller: Option<&str>,
    ) -> Result<Released, LockError> {
        self.bounded(async {
            let mut client = self.client().await?;
            let path = self.path(key);
            let found = client.get(path.as_str(), None).await.map_err(unavailable)?;
            self.authorise(found.kvs().first(), key, token, secret, caller)?;
            let before_us = now_us();
            let release = Txn::new()
                .when([Compare::mod_revision(
                    path.as_str(),
                    CompareOp::Equal,
                    token.get(),
                )])
                .and_then([
                    TxnOp::get(path.as_str(), None),
                    TxnOp::delete(path.as_str(), None),
                ]);
            let response = client.txn(release).await.map_err(unavailable)?;
            if !response.succeeded() {
                return Err(self.lost_noticed());
            }
            let revision = response.header().map(|h| h.revision());
            let lease = response.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.lease()),
                _ => None,
            });
            if let Some(lease) = lease.filter(|l| *l != 0)
                && let Err(e) = client.lease_revoke(lease).await
            {
                tracing::debug!(error = %e, "lease revoke after release failed; it will expire");
            }
            // A lower bound of the delete's time, and the revision that ended the grant: every
            // later grant of the key has a larger token.
            Ok(Released {
                at_us: before_us,
                revision,
            })
        })
        .await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Inspection, LockError> {
        self.bounded(async {
            let mut client = self.client().await?;
            let found = client
                .get(self.path(key), None)
                .await
                .map_err(unavailable)?;
            let free = Inspection {
                key: key.to_string(),
                held: false,
                holder: None,
                lease_remaining_ms: None,
                grant_age_ms: None,
            };
            let Some(kv) = found.kvs().first() else {
                return Ok(free);
            };
            let Some(remaining) = Self::lease_remaining(&mut client, kv.lease()).await? else {
                return Ok(free);
            };
            let entry: Option<Entry> = serde_json::from_slice(kv.value()).ok();
            Ok(Inspection {
                key: key.to_string(),
                held: true,
                holder: entry.as_ref().map(|e| e.holder.clone()),
                lease_remaining_ms: Some(remaining.as_millis() as i64),
                grant_age_ms: entry.map(|e| (now_us() / 1000 - e.granted_unix_ms as i64).max(0)),
            })
        })
        .await
    }
}
