//! A payment worker, run as its own OS process (`railguard-harness worker …`) so that a
//! SIGSTOP is a real process pause.
//!
//! It does what a real worker does, through the SDK: acquire an account's lock with a short
//! ttl and keep it alive → take the account's next payment → claim it in paydb with the fenced
//! UPDATE → submit it through the proxy with `Idempotency-Key` = the payment id → complete it
//! in paydb (fenced) → release. A payment whose outcome is unknown stays `submitting` and is
//! taken again, with the same id, by a later holder of the account. Every step goes to the
//! worker's history (see [`crate::history`]).
//!
//! With `--lock-only-keys`, some rounds lock a key that no payment goes with instead, as a
//! service that uses the lock service for mutual exclusion alone does: acquire, a moment's
//! work, release.
//!
//! SIGUSR1 asks for the T-042 pause: after the next claim and just before its submit, the
//! worker stops — keep-alive included, as a process stalled in a GC pause would — for
//! `pause_ms`, then carries on with its old grant. SIGUSR2 asks for `long_pause_ms`, past the
//! time after which others retry the payment. SIGHUP asks for a hold: at the same moment the
//! worker records it and stops itself (SIGSTOP), and carries on when the harness continues it
//! (SIGCONT), so that a fault decides exactly when the old grant's submit is sent.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use railguard_sdk::{LockClient, LockHandle, RailClient, SdkError};
use tokio::time::Instant;

use crate::history::{Event, HistoryWriter, Op, Phase, submit_path};
use crate::paydb::{self, Presented, WriteError};
use crate::reread::{Rereader, StalePost};
use crate::rng::Rng;

/// Which bug, if any, this worker has on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkerControl {
    None,
    /// Re-read "the current token" from the lock backend at write time (ADR-002 §A2.3).
    Reread,
}

#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    #[arg(long)]
    pub id: u32,
    /// Lock API base URLs (tried in turn when one fails).
    #[arg(long, value_delimiter = ',', required = true)]
    pub lock_urls: Vec<String>,
    /// Proxy base URLs; each submit goes to one chosen at random.
    #[arg(long, value_delimiter = ',', required = true)]
    pub proxy_urls: Vec<String>,
    #[arg(long)]
    pub paydb_url: String,
    #[arg(long)]
    pub accounts: usize,
    /// Keys locked besides the accounts, with no payment (see `lock_only_key`).
    #[arg(long, default_value_t = 0)]
    pub lock_only_keys: usize,
    /// Fence only at the proxy: claims and completions in paydb leave the account row alone.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub proxy_only: bool,
    #[arg(long)]
    pub ttl_ms: u64,
    #[arg(long)]
    pub duration_ms: u64,
    /// The T-042 pause on SIGUSR1 (SIGUSR2: `long_pause_ms`).
    #[arg(long)]
    pub pause_ms: u64,
    #[arg(long)]
    pub long_pause_ms: u64,
    /// An unresolved payment is taken again once its claim is this old.
    #[arg(long)]
    pub retry_after_ms: u64,
    #[arg(long)]
    pub seed: u64,
    #[arg(long)]
    pub history: PathBuf,
    #[arg(long, value_enum, default_value = "none")]
    pub control: WorkerControl,
    /// Send `Idempotency-Key` (the payment id) with every submit.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub idempotency_keys: bool,
    /// For `--control reread` on PostgreSQL: the lock database.
    #[arg(long)]
    pub lockdb_url: Option<String>,
    /// For `--control reread` on etcd: the endpoints and the lock key prefix.
    #[arg(long, value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    #[arg(long, default_value = "/railguard/locks/")]
    pub etcd_prefix: String,
}

/// Everything one worker holds for its whole run.
struct Worker {
    args: WorkerArgs,
    history: HistoryWriter,
    paydb: tokio_postgres::Client,
    locks: Vec<LockClient>,
    rails: Vec<RailClient>,
    stale: Option<(Rereader, StalePost)>,
    rng: Rng,
    /// The pause asked for (ms), 0 for none.
    pause: Arc<AtomicU64>,
    attempts: u64,
}

pub async fn run(args: WorkerArgs) -> Result<(), String> {
    let history = HistoryWriter::create(&args.history)
        .map_err(|e| format!("cannot write {}: {e}", args.history.display()))?;
    let paydb = connect_paydb(&args.paydb_url).await?;
    let call_timeout = Duration::from_millis(args.ttl_ms.max(500));
    let locks = args
        .lock_urls
        .iter()
        .map(|u| LockClient::new(u.as_str()).with_timeout(call_timeout))
        .collect();
    let rails = args
        .proxy_urls
        .iter()
        .map(|u| RailClient::new(u.as_str()))
        .collect();
    let stale = match args.control {
        WorkerControl::None => None,
        WorkerControl::Reread => Some((
            Rereader::connect(
                args.lockdb_url.as_deref(),
                &args.etcd_endpoints,
                &args.etcd_prefix,
            )
            .await?,
            StalePost::default(),
        )),
    };
    let pause = Arc::new(AtomicU64::new(0));
    listen_for_pause(pause.clone(), args.pause_ms, args.long_pause_ms)?;
    let mut worker = Worker {
        rng: Rng::new(args.seed ^ (u64::from(args.id) << 32)),
        args,
        history,
        paydb,
        locks,
        rails,
        stale,
        pause,
        attempts: 0,
    };
    worker.run().await;
    Ok(())
}

/// The `i`th key workers lock without paying anything under it.
pub fn lock_only_key(i: usize) -> String {
    format!("lock-only-{i}")
}

async fn connect_paydb(url: &str) -> Result<tokio_postgres::Client, String> {
    paydb::connect(url)
        .await
        .map_err(|e| format!("cannot connect to paydb: {e}"))
}

/// The pause value that asks for a hold until continued, rather than a pause of so many ms.
const HOLD: u64 = u64::MAX;

/// What a held worker writes (as an `info` of its submit) just before it stops itself.
pub const HOLDING: &str = "holding before the submit until continued";

fn listen_for_pause(pause: Arc<AtomicU64>, short: u64, long: u64) -> Result<(), String> {
    use tokio::signal::unix::{SignalKind, signal};
    for (kind, ms) in [
        (SignalKind::user_defined1(), short),
        (SignalKind::user_defined2(), long),
        (SignalKind::hangup(), HOLD),
    ] {
        let mut signals = signal(kind).map_err(|e| format!("pause signal: {e}"))?;
        let pause = pause.clone();
        tokio::spawn(async move {
            while signals.recv().await.is_some() {
                pause.store(ms, Ordering::Release);
            }
        });
    }
    Ok(())
}

/// SIGSTOP to this process: it runs on when the harness sends SIGCONT.
async fn stop_self() {
    let _ = tokio::process::Command::new("kill")
        .arg("-STOP")
        .arg(std::process::id().to_string())
        .status()
        .await;
}

impl Worker {
    fn ttl(&self) -> Duration {
        Duration::from_millis(self.args.ttl_ms)
    }

    async fn run(&mut self) {
        let deadline = Instant::now() + Duration::from_millis(self.args.duration_ms);
        let mut rounds = 0u64;
        while Instant::now() < deadline {
            rounds += 1;
            if rounds.is_multiple_of(16) && self.all_done().await {
                break;
            }
            let keys = self.args.accounts + self.args.lock_only_keys;
            let pick = self.rng.below(keys as u64) as usize;
            let lock = self.rng.below(self.locks.len() as u64) as usize;
            if pick >= self.args.accounts {
                self.lock_only(lock, &lock_only_key(pick - self.args.accounts))
                    .await;
                continue;
            }
            let account = paydb::account_id(pick);
            let Some(handle) = self.acquire(lock, &account).await else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            self.hold(lock, &account, &handle).await;
            self.release(lock, &account, handle).await;
        }
    }

    /// A grant of a key no payment goes with: held for a moment, released. Nothing reaches
    /// the proxy, so no fencing mark ever records its tokens; they must still increase.
    async fn lock_only(&mut self, lock: usize, key: &str) {
        match self.acquire(lock, key).await {
            Some(handle) => {
                tokio::time::sleep(Duration::from_millis(5)).await;
                self.release(lock, key, handle).await;
            }
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }

    async fn all_done(&mut self) -> bool {
        match paydb::remaining(&self.paydb).await {
            Ok(n) => n == 0,
            Err(_) => {
                self.reconnect().await;
                false
            }
        }
    }

    async fn reconnect(&mut self) {
        if self.paydb.is_closed()
            && let Ok(client) = connect_paydb(&self.args.paydb_url).await
        {
            self.paydb = client;
        }
    }

    async fn acquire(&mut self, lock: usize, account: &str) -> Option<LockHandle> {
        let invoke = Event::new(self.args.id, Op::Acquire, Phase::Invoke, account);
        self.history.write(&invoke);
        let holder = format!("w{}", self.args.id);
        let ttl = self.ttl();
        match self.locks[lock].acquire(account, &holder, ttl, ttl).await {
            Ok(handle) => {
                let mut ok = invoke.outcome(Phase::Ok).token(handle.token().get());
                ok.granted_at_us = Some(handle.granted_at_us());
                ok.expires_at_us = Some(handle.expires_at_us());
                self.history.write(&ok);
                Some(handle)
            }
            Err(e @ (SdkError::Held | SdkError::TooManyWaiters | SdkError::BadRequest(_))) => {
                self.history
                    .write(&invoke.outcome(Phase::Fail).detail(e.to_string()));
                None
            }
            Err(e) => {
                // The grant may have been made and its answer lost: it will expire.
                self.history
                    .write(&invoke.outcome(Phase::Info).detail(e.to_string()));
                None
            }
        }
    }

    async fn release(&mut self, lock: usize, account: &str, handle: LockHandle) {
        let invoke = Event::new(self.args.id, Op::Release, Phase::Invoke, account)
            .token(handle.token().get());
        self.history.write(&invoke);
        let outcome = match self.locks[lock].release(handle).await {
            Ok(()) => invoke.outcome(Phase::Ok),
            Err(SdkError::Lost) => invoke.outcome(Phase::Fail).detail("lost"),
            Err(e) => invoke.outcome(Phase::Info).detail(e.to_string()),
        };
        self.history.write(&outcome);
    }

    /// One payment under one grant.
    async fn hold(&mut self, lock: usize, account: &str, handle: &LockHandle) {
        let own = handle.token().get();
        let mut keep_alive = Some(self.locks[lock].keep_alive(handle));
        // Half the holders retry an unresolved payment before fresh ones, half after: both
        // orders happen in a real fleet, and each meets a stale holder differently.
        let retry_first = self.rng.below(2) == 0;
        let retry_after = Duration::from_millis(self.args.retry_after_ms);
        let next = match paydb::next_payment(&self.paydb, account, retry_first, retry_after).await {
            Ok(next) => next,
            Err(_) => {
                self.reconnect().await;
                return;
            }
        };
        let Some((payment, amount)) = next else {
            return;
        };
        self.attempts += 1;
        let attempt = format!("w{}-{}", self.args.id, self.attempts);

        let presented = self.presented(handle, account).await;
        let claim = Event::new(self.args.id, Op::Claim, Phase::Invoke, account)
            .token(own)
            .payment(&payment)
            .attempt(&attempt);
        self.write_presented(claim.clone(), presented);
        let claimed = paydb::claim(
            &mut self.paydb,
            account,
            &payment,
            (!self.args.proxy_only).then_some(presented),
            own,
            &attempt,
        )
        .await;
        let first_token = claimed.as_ref().ok().copied();
        if !self.paydb_outcome(&claim, claimed.map(|_| ())).await {
            return;
        }

        // The T-042 moment: claimed in paydb, about to submit.
        let pause_ms = self.pause.swap(0, Ordering::AcqRel);
        if pause_ms == HOLD {
            keep_alive = None;
            self.history.write(
                &Event::new(self.args.id, Op::Submit, Phase::Info, account)
                    .token(own)
                    .payment(&payment)
                    .detail(HOLDING),
            );
            stop_self().await;
            // Connections pooled before the hold may lead to a railguard that has since gone
            // (a restart): the submit goes out on new ones, as the fault means it to.
            self.rails = self
                .args
                .proxy_urls
                .iter()
                .map(|u| RailClient::new(u.as_str()))
                .collect();
        } else if pause_ms > 0 {
            keep_alive = None;
            // Past the lease whatever the backend made of the ttl asked for.
            let pause =
                Duration::from_millis(pause_ms).max(handle.ttl() * 2 + Duration::from_millis(300));
            self.history.write(
                &Event::new(self.args.id, Op::Submit, Phase::Info, account)
                    .token(own)
                    .payment(&payment)
                    .detail(format!(
                        "pausing {} ms before the submit",
                        pause.as_millis()
                    )),
            );
            tokio::time::sleep(pause).await;
        }
        if let Some(reason) = keep_alive.as_ref().and_then(|k| k.lost_reason()) {
            self.history.write(
                &Event::new(self.args.id, Op::LeaseLost, Phase::Info, account)
                    .token(own)
                    .detail(format!("{reason:?}")),
            );
            return;
        }

        let presented = self.presented(handle, account).await;
        let submit = Event::new(self.args.id, Op::Submit, Phase::Invoke, account)
            .token(own)
            .payment(&payment)
            .attempt(&attempt);
        self.write_presented(submit.clone(), presented);
        if !self
            .submit(
                &submit,
                handle,
                presented,
                account,
                &payment,
                amount,
                &attempt,
                first_token,
            )
            .await
        {
            return;
        }

        let presented = self.presented(handle, account).await;
        let complete = Event::new(self.args.id, Op::Complete, Phase::Invoke, account)
            .token(own)
            .payment(&payment)
            .attempt(&attempt);
        self.write_presented(complete.clone(), presented);
        let completed = paydb::complete(
            &mut self.paydb,
            account,
            &payment,
            (!self.args.proxy_only).then_some(presented),
            own,
            &attempt,
        )
        .await;
        self.paydb_outcome(&complete, completed).await;
        drop(keep_alive);
    }

    /// The token this worker presents for a write: its grant's, unless it has the bug.
    async fn presented<'h>(&mut self, handle: &'h LockHandle, account: &str) -> Presented<'h> {
        match &mut self.stale {
            None => Presented::Grant(handle),
            Some((rereader, _)) => match rereader.current_token(account).await {
                Some(token) => Presented::Reread(token),
                None => Presented::Reread(handle.token().get()),
            },
        }
    }

    fn write_presented(&mut self, mut event: Event, presented: Presented<'_>) {
        if let Presented::Reread(token) = presented {
            event.presented = Some(token);
        }
        self.history.write(&event);
    }

    /// Writes a paydb step's outcome; `true` when it happened.
    async fn paydb_outcome(&mut self, invoke: &Event, result: Result<(), WriteError>) -> bool {
        let outcome = match &result {
            Ok(()) => invoke.outcome(Phase::Ok),
            Err(WriteError::FencedOut) => invoke.outcome(Phase::Fail).detail("fenced_out"),
            Err(WriteError::AlreadyDone) => invoke.outcome(Phase::Fail).detail("already_done"),
            // A commit whose answer was lost may have happened.
            Err(WriteError::Database(e)) => invoke.outcome(Phase::Info).detail(e.clone()),
        };
        self.history.write(&outcome);
        if matches!(result, Err(WriteError::Database(_))) {
            self.reconnect().await;
        }
        result.is_ok()
    }

    /// Sends the payment; `true` when the rail answered with success.
    #[allow(clippy::too_many_arguments)]
    async fn submit(
        &mut self,
        invoke: &Event,
        handle: &LockHandle,
        presented: Presented<'_>,
        account: &str,
        payment: &str,
        amount: i64,
        attempt: &str,
        first_token: Option<i64>,
    ) -> bool {
        let rail = self.rng.below(self.rails.len() as u64) as usize;
        let path = submit_path(payment, attempt);
        let body = Bytes::from(format!("{{\"payment\":\"{payment}\",\"amount\":{amount}}}"));
        let key = self.args.idempotency_keys.then_some(payment);
        let answer = match (presented, &self.stale) {
            (Presented::Reread(token), Some((_, post))) => {
                post.post(
                    &self.args.proxy_urls[rail],
                    token,
                    account,
                    &path,
                    body,
                    key,
                )
                .await
            }
            // A retry of a payment first claimed under an earlier grant says so: if that
            // grant predates a store that went back, the proxy answers in_doubt rather than
            // pay again what the rail may already have.
            _ => match (
                key,
                first_token.and_then(railguard_sdk::token::FencingToken::new),
            ) {
                (Some(key), Some(first)) if first != handle.token() => {
                    self.rails[rail]
                        .retry(handle, account, &path, body, key, first)
                        .await
                }
                _ => {
                    self.rails[rail]
                        .post(handle, account, &path, body, key)
                        .await
                }
            },
        };
        let outcome = match &answer {
            Ok(r) if r.status.is_success() => invoke.outcome(Phase::Ok).detail(r.status.as_str()),
            Err(SdkError::FencedOut { .. }) => invoke.outcome(Phase::Fail).detail("fenced_out"),
            Ok(r) => {
                let code = serde_json::from_slice::<serde_json::Value>(&r.body)
                    .ok()
                    .and_then(|v| v["error"].as_str().map(str::to_string))
                    .unwrap_or_default();
                let detail = format!("{} {code}", r.status.as_u16());
                // A 4xx other than an idempotency conflict is a refusal: nothing was sent.
                // Everything else (5xx, in_flight, in_doubt) leaves the outcome unknown.
                let unknown =
                    r.status.is_server_error() || matches!(code.as_str(), "in_flight" | "in_doubt");
                invoke
                    .outcome(if unknown { Phase::Info } else { Phase::Fail })
                    .detail(detail)
            }
            Err(e) => invoke.outcome(Phase::Info).detail(e.to_string()),
        };
        self.history.write(&outcome);
        matches!(answer, Ok(r) if r.status.is_success())
    }
}
