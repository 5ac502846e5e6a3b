//! The answers of `POST /idempotency/forget`: what forget did, or why it did not — a stable
//! code, the facts, and the section of docs/operations.md that says what to do.

use http::{Response, StatusCode};

use super::{error, reply};
use crate::db::DbError;
use crate::http::ResponseBody;
use crate::store::instance::InstanceId;
use crate::store::records::{Because, Forgot, OwnerStopped};
use crate::token::AccountId;

/// The answer to a forget of `key` on `account` that came to `forgot`.
pub(super) fn answer(
    forgot: Result<Forgot, DbError>,
    account: &AccountId,
    key: &str,
) -> Response<ResponseBody> {
    let answer = match forgot {
        // Deleted together with its audit record, in one transaction.
        Ok(Forgot::Forgotten(because)) => {
            tracing::warn!(account = %account, key,
                owner = because.owner().map(InstanceId::get), because = because.as_str(),
                "an operator forgot an idempotency record in doubt");
            ForgetAnswer::Done("forgotten: the next retry of this key will be forwarded".into())
        }
        Ok(Forgot::WouldForget(because)) => ForgetAnswer::Done(format!(
            "dry run, nothing was changed: the record would be forgotten now ({}). Ask the \
             rail about the payment now{} (step 3 of the in-doubt procedure, docs/operations.md, \
             \"In doubt\"); forget without --dry-run only if the rail does not have it",
            because_words(because),
            if matches!(because, Because::OwnerStoppedCleanly(_)) {
                ""
            } else {
                ", once proxy.rail_transit_ms has passed since the process you saw stop stopped"
            }
        )),
        Ok(Forgot::MayStillArrive {
            because,
            after,
            in_secs,
            transit_ms,
        }) => ForgetAnswer::Refused(
            ForgetRefusal::MayStillArrive,
            format!(
                "the request may still be on its way to the rail until {after} (by the \
                 database's clock, in about {in_secs} s): its owner has stopped ({}), but what \
                 it sent can take up to proxy.rail_transit_ms ({transit_ms} ms) to arrive",
                because_words(because)
            ),
        ),
        Ok(Forgot::Completed) => ForgetAnswer::Refused(
            ForgetRefusal::Completed,
            "the record is complete: the rail answered and repeats get its response".into(),
        ),
        Ok(Forgot::StillInFlight) => ForgetAnswer::Refused(
            ForgetRefusal::StillInFlight,
            "the record is in flight and not yet in doubt: its owner's deadline has not \
             passed, and its forward may still be running"
                .into(),
        ),
        Ok(Forgot::OwnerMayStillSend { owner, named }) => ForgetAnswer::Refused(
            ForgetRefusal::OwnerRunning,
            format!(
                "the railguard process that owns the record, instance {owner}, holds its \
                 instance lock: it is running (perhaps paused), and may still send it{}",
                match named {
                    Some(OwnerStopped::Unrecorded) => {
                        "; \"unrecorded\" is for records that name no owner"
                    }
                    Some(OwnerStopped::Instance(_)) => {
                        "; a stopped instance named while the owner holds its lock is not heard"
                    }
                    None => "",
                }
            ),
        ),
        Ok(Forgot::OwnerNotSeenStopping {
            owner,
            created,
            named,
        }) => ForgetAnswer::Refused(
            ForgetRefusal::OwnerNotSeenStopping,
            format!(
                "the railguard process that owns the record, instance {owner} (the record was \
                 made at {created}), does not hold its instance lock, but nothing shows it \
                 has stopped: it may have crashed, or be paused with its database session \
                 lost{}",
                match named {
                    Some(OwnerStopped::Instance(named)) => {
                        format!("; the instance named as stopped, {named}, is not the owner")
                    }
                    Some(OwnerStopped::Unrecorded) => {
                        "; \"unrecorded\" is for records that name no owner".to_string()
                    }
                    None => String::new(),
                }
            ),
        ),
        Ok(Forgot::OwnerUnrecorded { created }) => ForgetAnswer::Refused(
            ForgetRefusal::OwnerUnrecorded,
            format!(
                "the record names no owner: a railguard older than migration 0004 made it, \
                 at {created}, and nothing shows that process has stopped"
            ),
        ),
        Ok(Forgot::NotFound) => {
            return error(
                StatusCode::NOT_FOUND,
                "not_found",
                "no record for this account and key".into(),
            );
        }
        Err(e) => {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                format!("database: {e}"),
            );
        }
    };

    match answer {
        ForgetAnswer::Done(message) => reply(StatusCode::OK, "text/plain", format!("{message}\n")),
        ForgetAnswer::Refused(refusal, message) => {
            let body = serde_json::json!({
                "error": refusal.code(),
                "message": format!("{message}. Nothing was changed"),
                "see": refusal.see(),
            });
            reply(
                StatusCode::CONFLICT,
                "application/json",
                format!("{body}\n"),
            )
        }
    }
}

/// What forget did, or why it did not.
enum ForgetAnswer {
    /// 200, text: forgotten, or (a dry run) it would be.
    Done(String),
    /// 409, `{"error": code, "message", "see"}`: nothing changed.
    Refused(ForgetRefusal, String),
}

/// Why forget changed nothing: a stable code in the answer's `error`, and the section of
/// docs/operations.md ("What forget answers, and what to do") that says what to do, whose
/// anchor is the code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForgetRefusal {
    /// The rail answered: nothing to forget.
    Completed,
    /// Its owner's deadline has not passed.
    StillInFlight,
    /// The owning process holds its instance lock.
    OwnerRunning,
    /// The owner holds no lock, and nothing shows it stopped.
    OwnerNotSeenStopping,
    /// Made before owners were recorded.
    OwnerUnrecorded,
    /// The owner stopped, but what it sent may still arrive.
    MayStillArrive,
}

impl ForgetRefusal {
    pub const ALL: [ForgetRefusal; 6] = [
        Self::Completed,
        Self::StillInFlight,
        Self::OwnerRunning,
        Self::OwnerNotSeenStopping,
        Self::OwnerUnrecorded,
        Self::MayStillArrive,
    ];

    pub fn code(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::StillInFlight => "still_in_flight",
            Self::OwnerRunning => "owner_running",
            Self::OwnerNotSeenStopping => "owner_not_seen_stopping",
            Self::OwnerUnrecorded => "owner_unrecorded",
            Self::MayStillArrive => "may_still_arrive",
        }
    }

    /// Where what to do is written: docs/operations.md, also served at `/runbook` here.
    pub fn see(self) -> String {
        format!(
            "docs/operations.md#{0} (GET /runbook#{0} on the admin listener)",
            self.code()
        )
    }
}

/// What a forget rests on, in the answer's words.
fn because_words(because: Because) -> String {
    match because {
        Because::OwnerStoppedCleanly(owner) => {
            format!("its owner, instance {owner}, recorded a clean stop")
        }
        Because::OperatorSawOwnerStop(owner) => {
            format!("on your word that its owner, instance {owner}, has stopped")
        }
        Because::NoOwner => {
            "on your word that every railguard running when it was made has stopped".into()
        }
    }
}
