//! A keyed retry whose first attempt's record went back with the store, with the rail's
//! lookup (`[rail_lookup]`): asked only once nothing sent before the change can still reach the
//! rail.

use std::time::Duration;

use super::{FencePoint, HighWater};
use crate::proxy::FencedRequest;
use crate::store::handover::WaitError;

/// What the rail's lookup said of a retry whose first attempt's record went back with the
/// store ([`FencePoint::ask_the_rail_about_a_lost_attempt`]).
pub(super) enum LostAttempt {
    /// The rail has no payment under the key, and nothing sent before could still arrive: the
    /// retry goes on as the key's first request.
    NotOnTheRail,
    /// The rail has the payment: the first attempt was paid; the retry is not forwarded.
    OnTheRail,
    /// A request sent before the change may still reach the rail (for about this long, or
    /// until this railguard's own forward of the account settles): not asked yet, nothing
    /// changed — 503, retry later.
    NotYet(Duration),
    /// No lookup configured, or no answer: in doubt.
    Unknown,
}

impl<H: HighWater> FencePoint<H> {
    /// A keyed retry whose first attempt's record went back with the store
    /// (`idempotency::lost_first_attempt`): true if the rail has no payment under its key,
    /// asked only once nothing sent under it before the change can still reach the rail —
    /// the hold after a store change has ended for the account (the quiet bound has passed —
    /// on the embedded server too, whose earlier run's row goes back with a restored data
    /// directory — and no other process names a forward of it below the floor:
    /// `Handover::wait_until_nothing_from_before_can_arrive`, asked of the database every time,
    /// so a change this process has not met yet is met here), and no forward of this process
    /// for the account is unsettled. A forward sent
    /// after the change had a record, and a record that survived would have been found. So a
    /// "not found" then is final, and the retry may go on as the key's first request: its
    /// compare-and-set makes its record, and a concurrent retry finds that record.
    pub(super) async fn ask_the_rail_about_a_lost_attempt(
        &self,
        request: &FencedRequest,
    ) -> LostAttempt {
        let (Some(resolver), Some(records), Some(handover), Some(epoch), Some(key)) = (
            &self.resolver,
            &self.records,
            &self.handover,
            &self.epoch,
            request.idempotency.as_ref(),
        ) else {
            return LostAttempt::Unknown;
        };
        let account = &request.account;
        match handover
            .wait_until_nothing_from_before_can_arrive(account, request.deadline.instant())
            .await
        {
            // Settled as the newer grants' forwards see it: nothing from before is pending.
            Ok(Some(settled)) => epoch.change_settled(settled),
            Ok(None) => {}
            Err(WaitError::Db(e)) => {
                tracing::warn!(%account, key = key.key, error = %e,
                    "a retry whose record went back with the store: whether a request sent \
                     before the change can still reach the rail could not be read");
                return LostAttempt::Unknown;
            }
            Err(e) => {
                resolver.not_asked_yet();
                tracing::info!(%account, key = key.key, error = %e,
                    "a retry whose record went back with the store: a request sent before the \
                     change may still reach the rail; the rail is not asked yet");
                return LostAttempt::NotYet(match e {
                    WaitError::Held(left) => left,
                    _ => Duration::from_secs(1),
                });
            }
        }
        if handover.has_pending(account) {
            resolver.not_asked_yet();
            tracing::info!(%account, key = key.key,
                "a retry whose record went back with the store: this railguard still has a \
                 forward for the account on its way; the rail is not asked yet");
            return LostAttempt::NotYet(Duration::from_secs(1));
        }
        match resolver
            .ask_about_lost(&**records, account, &key.key, request.deadline.instant())
            .await
        {
            Some(true) => LostAttempt::NotOnTheRail,
            Some(false) => LostAttempt::OnTheRail,
            None => LostAttempt::Unknown,
        }
    }
}
