//! Resolving a payment in doubt by asking the rail (`[rail_lookup]`).
//!
//! A retry whose record is in doubt (`409 in_doubt`) is, with a lookup configured, first
//! answered by the rail itself (a request under the same key that is not the same request asks
//! too — the rail's answer is about the key — and is still answered `422`): railguard asks it, by the record's account and idempotency key,
//! whether it has the payment, within the retry's own deadline and `rail_lookup.timeout_ms`,
//! at most `rail_lookup.max_concurrent` lookups at once. Then, and only then:
//!
//! - **the rail has it** (`200`): whoever sent it, the payment is made. The record is completed
//!   with the rail's answer, audited ([`IdempotencyStore::complete_from_the_rail`]), and the
//!   retry gets that answer replayed — never a new forward. Later retries get the stored answer.
//! - **the rail does not have it** (`404`): that is the operator's step 3 of the in-doubt
//!   procedure (`admin::IN_DOUBT_PROCEDURE`), and the record is forgotten only if
//!   `idempotency-forget` would forget it *without* an operator's word: its owner recorded a
//!   clean stop and holds no instance lock, and its in-doubt deadline plus
//!   `proxy.rail_transit_ms` (and the stop's `quiet_after`) has passed — the same code path,
//!   [`IdempotencyStore::forget_not_on_the_rail`]. Until then something the owner sent may
//!   still reach the rail, and the record stays in doubt. Forgotten, the retry is told so
//!   (`409 not_on_the_rail`, nothing forwarded) and the next retry is forwarded.
//! - **no answer** (an error, a timeout, every lookup slot busy, any other status): nothing
//!   changes; the retry is answered `409 in_doubt` as without a lookup.
//!
//! A retry whose `Idempotency-First-Token` predates the last store change and whose record is
//! gone ([`super::lost_first_attempt`]) has no record to complete or forget: the fence asks the
//! rail about its key ([`Resolver::ask_about_lost`]) only once nothing sent before the change
//! can still reach the rail (`proxy::fence`, the hold after a store change), and then:
//!
//! - **the rail does not have it**: nothing railguard sent under the key before the change can
//!   still land, and nothing after it was sent without a record (a record that survived would
//!   have been found). The retry goes on as the key's first request: its compare-and-set makes
//!   its record, and it is forwarded.
//! - **the rail has it**: the retry is answered `409 in_doubt`, saying the first attempt was
//!   paid. With no record, nothing says whether the retry is the request the rail has (another
//!   body under the key would be told it was paid), so the rail's answer is not replayed.
//! - **no answer**: `409 in_doubt`, as without a lookup.
//!
//! Until nothing sent before the change can still reach the rail, the rail is not asked and
//! the retry is answered `503` (nothing changed, retry later).
//!
//! Only an answer that names the key it looked up (`Idempotency-Key: KEY`, echoed, on the `200`
//! and on the `404`) is an answer about the payment: a `404` of a wrong path, a gateway or an
//! authentication layer, or a `200` of a listing, is no answer and changes nothing. And a
//! `404` counts only if the rail was asked once forget would forget the record — checked before
//! the question is sent, so that a "not found" given while the request could still land is
//! never acted on after.
//!
//! The lookup runs on the retry, not in the background: a record in doubt that nobody retries
//! needs no answer, and the retry that needs it waits for it within its own deadline.
//!
//! [`IdempotencyStore::complete_from_the_rail`]: crate::store::records::IdempotencyStore::complete_from_the_rail
//! [`IdempotencyStore::forget_not_on_the_rail`]: crate::store::records::IdempotencyStore::forget_not_on_the_rail

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use http::uri::PathAndQuery;
use prometheus::{IntCounterVec, Opts, Registry};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::replay;
use crate::config::LookupTemplate;
use crate::proxy::{BoxError, ProxyResponse};
use crate::railsim::LOOKUP_KEY_HEADER;
use crate::store::records::{BoxFuture, Records};
use crate::store::records::{Forgot, StoredResponse};
use crate::token::AccountId;

/// Sends the lookup's `GET` to the rail (the forward's connections and TLS, in the server).
pub trait AskTheRail: Send + Sync + 'static {
    fn get(&self, path: PathAndQuery) -> BoxFuture<'static, Result<ProxyResponse, BoxError>>;
}

/// What a lookup resolved: `railguard_in_doubt_resolved_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The rail has the payment: its answer is the record's.
    Paid,
    /// The rail does not have it, and nothing sent can still reach it: forgotten.
    NotPaid,
    /// The rail does not have it, but its owner may still send it, or it may still arrive:
    /// still in doubt.
    Unresolved,
    /// No answer from the rail: still in doubt.
    Failed,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Self::Paid => "paid",
            Self::NotPaid => "not_paid",
            Self::Unresolved => "unresolved",
            Self::Failed => "failed",
        }
    }
}

/// What a retry of a record in doubt is answered after the lookup.
#[derive(Debug)]
pub enum Resolved {
    /// The rail's answer, to replay.
    Paid(StoredResponse),
    /// Forgotten: the next retry is forwarded.
    Forgotten,
    /// The record is no longer in doubt (its owner's late answer completed it meanwhile, or an
    /// operator forgot it): answer from what is there now.
    Changed,
    /// Still in doubt.
    InDoubt,
}

/// Asks the rail about payments in doubt; see the module docs.
pub struct Resolver {
    rail: Arc<dyn AskTheRail>,
    template: LookupTemplate,
    timeout: Duration,
    slots: Arc<Semaphore>,
    max_response_bytes: usize,
    resolved: IntCounterVec,
}

/// The rail's answer to one lookup.
enum Answer {
    Has(StoredResponse),
    HasNot,
}

impl Resolver {
    /// `resolved` is [`Resolver::register`]'s counter.
    pub fn new(
        rail: Arc<dyn AskTheRail>,
        template: LookupTemplate,
        timeout: Duration,
        max_concurrent: usize,
        max_response_bytes: usize,
        resolved: IntCounterVec,
    ) -> Self {
        Self {
            rail,
            template,
            timeout,
            slots: Arc::new(Semaphore::new(max_concurrent.max(1))),
            max_response_bytes,
            resolved,
        }
    }

    /// `railguard_in_doubt_resolved_total{outcome}`, registered in `registry`; every outcome is
    /// shown from the start, at zero. Should it not register (a second resolver on one
    /// registry), it still counts, unseen, and says so.
    pub fn register(registry: &Registry) -> IntCounterVec {
        let counter = IntCounterVec::new(
            Opts::new(
                "railguard_in_doubt_resolved_total",
                "Retries of a payment in doubt answered after asking the rail by idempotency key \
                 (rail_lookup), by outcome: paid (the rail has it: its answer replayed, or, for \
                 a key whose record went back with the store, left in doubt), not_paid (it has \
                 not, and nothing sent can still reach it: forgotten, or forwarded as the key's \
                 first request), unresolved (it has not, or was not asked, while the request \
                 may still arrive), failed (no answer)",
            ),
            &["outcome"],
        )
        .expect("a valid metric definition");
        for outcome in [
            Outcome::Paid,
            Outcome::NotPaid,
            Outcome::Unresolved,
            Outcome::Failed,
        ] {
            counter.with_label_values(&[outcome.label()]);
        }
        if let Err(e) = registry.register(Box::new(counter.clone())) {
            tracing::warn!(error = %e, "railguard_in_doubt_resolved_total is not exported");
        }
        counter
    }

    fn count(&self, outcome: Outcome) {
        self.resolved.with_label_values(&[outcome.label()]).inc();
    }

    /// Asks the rail whether it has the payment of `key` on `account`, by `deadline` and within
    /// `rail_lookup.timeout_ms`; `Err` with why there is no answer.
    async fn ask(
        &self,
        account: &AccountId,
        key: &str,
        deadline: Instant,
    ) -> Result<Answer, String> {
        let until = deadline.min(Instant::now() + self.timeout);
        // In a path, `.` and `..` name another resource once a server normalises it.
        if [account.as_str(), key]
            .iter()
            .any(|part| matches!(*part, "." | ".."))
        {
            return Err("an account or key of dots cannot be looked up".into());
        }
        let path = self
            .template
            .fill(account.as_str(), key)
            .map_err(|e| format!("the lookup's path: {e}"))?;
        let asked = async {
            let _slot = self
                .slots
                .acquire()
                .await
                .map_err(|_| "the lookups have stopped".to_string())?;
            let response = self.rail.get(path).await.map_err(|e| e.to_string())?;
            // Only an answer that names the key it looked up is about this payment: a `404` of
            // a wrong path, a gateway or an authentication layer, or a `200` of a listing,
            // names none, and changes nothing.
            let echoed = response
                .headers()
                .get(LOOKUP_KEY_HEADER)
                .is_some_and(|value| value.as_bytes() == key.as_bytes());
            if !echoed {
                return Err(format!(
                    "the rail answered {} without `{LOOKUP_KEY_HEADER}: {key}`: not an answer \
                     about this payment",
                    response.status()
                ));
            }
            match response.status() {
                StatusCode::OK => {
                    let (_, stored) = replay::capture(response, self.max_response_bytes)
                        .await
                        .map_err(|e| format!("the rail's answer broke off: {e}"))?;
                    Ok(Answer::Has(stored))
                }
                StatusCode::NOT_FOUND => Ok(Answer::HasNot),
                other => Err(format!("the rail answered {other}")),
            }
        };
        tokio::time::timeout_at(until, asked)
            .await
            .unwrap_or_else(|_| Err("no answer in time".to_string()))
    }

    /// A retry of `key` on `account` whose first attempt's record went back with the store
    /// (see the module docs), asked by the fence once nothing sent before the change can still
    /// reach the rail: `Some(true)` if the rail has no payment under the key (audited first),
    /// `Some(false)` if it has one, `None` if there is no answer (or no audit record).
    pub async fn ask_about_lost(
        &self,
        records: &dyn Records,
        account: &AccountId,
        key: &str,
        deadline: Instant,
    ) -> Option<bool> {
        match self.ask(account, key, deadline).await {
            Err(why) => {
                self.count(Outcome::Failed);
                tracing::warn!(%account, key, error = why,
                    "could not ask the rail about a payment whose record went back with the \
                     store; it stays in doubt");
                None
            }
            Ok(Answer::Has(_)) => {
                self.count(Outcome::Paid);
                tracing::info!(%account, key,
                    "the rail has a payment under a key whose record went back with the store: \
                     the first attempt was paid, and its retry is not forwarded");
                Some(false)
            }
            Ok(Answer::HasNot) => {
                if let Err(e) = records
                    .audit_first_request_after_store_change(account, key)
                    .await
                {
                    self.count(Outcome::Failed);
                    tracing::warn!(%account, key, error = %e,
                        "the rail has no payment under a key whose record went back with the \
                         store, but its audit record could not be written: the retry stays in \
                         doubt");
                    return None;
                }
                self.count(Outcome::NotPaid);
                tracing::info!(%account, key,
                    "the rail has no payment under a key whose record went back with the store, \
                     and nothing sent before the change can still reach it: the retry goes on \
                     as the key's first request (audited)");
                Some(true)
            }
        }
    }

    /// Counts a lookup not made because the request could still reach the rail.
    pub fn not_asked_yet(&self) {
        self.count(Outcome::Unresolved);
    }

    /// A retry of `key` on `account`, whose record is in doubt: asks the rail, and completes
    /// or forgets the record as the module docs say.
    pub async fn resolve(
        &self,
        records: &dyn Records,
        account: &AccountId,
        key: &str,
        deadline: Instant,
    ) -> Resolved {
        // A "not found" is the procedure's step 3 only if the rail was asked once nothing the
        // owner sent could still reach it: that is decided, by the database's clock, before
        // the question is sent, and checked again when the record is forgotten.
        let asked_when_final = matches!(
            records.forget_not_on_the_rail(account, key, true).await,
            Ok(Forgot::WouldForget(_))
        );
        match self.ask(account, key, deadline).await {
            Err(why) => {
                self.count(Outcome::Failed);
                tracing::warn!(%account, key, error = why,
                    "could not ask the rail about a payment in doubt; it stays in doubt");
                Resolved::InDoubt
            }
            Ok(Answer::Has(stored)) => {
                self.count(Outcome::Paid);
                match records
                    .complete_from_the_rail(account, key, stored.clone())
                    .await
                {
                    Ok(true) => {
                        tracing::info!(%account, key, status = stored.status,
                            "the rail has the payment in doubt: its answer is the record's");
                        Resolved::Paid(stored)
                    }
                    Ok(false) => Resolved::Changed,
                    // The rail has it whatever the database says: its answer is the retry's.
                    Err(e) => {
                        tracing::warn!(%account, key, error = %e,
                            "the rail has the payment in doubt; its answer is replayed but not \
                             stored yet (the next retry asks again)");
                        Resolved::Paid(stored)
                    }
                }
            }
            Ok(Answer::HasNot) if !asked_when_final => {
                self.count(Outcome::Unresolved);
                tracing::info!(%account, key,
                    "the rail does not have the payment in doubt yet, but was asked while the \
                     request could still reach it: it stays in doubt");
                Resolved::InDoubt
            }
            Ok(Answer::HasNot) => match records.forget_not_on_the_rail(account, key, false).await {
                Ok(Forgot::Forgotten(because)) => {
                    self.count(Outcome::NotPaid);
                    tracing::info!(%account, key, owner_stopped = because.as_str(),
                        "the rail does not have the payment in doubt, and nothing sent can \
                         still reach it: its record is forgotten, the next retry is forwarded");
                    Resolved::Forgotten
                }
                Ok(Forgot::Completed | Forgot::NotFound) => {
                    self.count(Outcome::Unresolved);
                    Resolved::Changed
                }
                Ok(verdict) => {
                    self.count(Outcome::Unresolved);
                    tracing::info!(%account, key, ?verdict,
                        "the rail does not have the payment in doubt yet, but the request may \
                         still reach it: it stays in doubt");
                    Resolved::InDoubt
                }
                Err(e) => {
                    self.count(Outcome::Failed);
                    tracing::warn!(%account, key, error = %e,
                        "the rail does not have the payment in doubt, and the record could \
                         not be checked: it stays in doubt");
                    Resolved::InDoubt
                }
            },
        }
    }
}
