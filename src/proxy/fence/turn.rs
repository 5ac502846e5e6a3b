//! An account's turn at the rail, which a forward holds until the rail has answered.

use super::ordering::Ticket;
use crate::store::handover::Entry;

/// An account's turn at the rail (see `ordering`): while it is alive, no forward for a higher
/// token of the account starts, in this process or — through its entry — in another.
/// Dropping it passes the turn on.
pub struct Turn {
    pub(super) _ticket: Ticket,
    pub(super) entry: Option<Entry>,
}

impl Turn {
    /// Resolves once this process has been unable to write its forwards' row for so long that
    /// a forward still waiting for the rail must close its connection (`store::handover`);
    /// never, for a forward whose account other processes do not wait on.
    pub async fn silenced(&self) {
        match &self.entry {
            Some(entry) => entry.silenced().await,
            None => std::future::pending().await,
        }
    }

    /// The forward was written and its answer never came: this process's turn passes on now,
    /// and other processes take the forward as on its way for `proxy.rail_transit_ms` more.
    pub fn unanswered(mut self) {
        if let Some(entry) = self.entry.take() {
            entry.unanswered();
        }
    }
}
