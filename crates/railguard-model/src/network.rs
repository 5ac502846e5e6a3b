//! The network between workers, proxies and the rail, and the rail at its end.
//!
//! Messages in flight are a multiset: any of them may be delivered next (reordering), none
//! has to be delivered soon (delay), and with a lossy network any may be dropped. Calls to the
//! lock service and to paydb are single steps instead: a delayed answer from either is the
//! same, for every property here, as its caller pausing after an immediate answer, which the
//! model already allows between any two steps.
//!
//! The rail is non-idempotent and trusts nobody's token: it records every arrival (account,
//! payment, the token the request carried, and — ground truth for the properties — the grant
//! that sent it) and answers the proxy.

use crate::lock::{GrantId, Token};
use crate::proxy::Seq;

/// What the proxy answered a submit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reply {
    /// The rail took the payment (or the idempotency record replays that answer).
    Paid,
    /// 409 fenced_out: the token is below the account's mark, or was superseded on its way.
    FencedOut,
    /// 409 in_flight: a request with the same idempotency key is on its way.
    InFlight,
    /// 409 in_doubt: the submit's `Idempotency-First-Token` is below the floor and its key has
    /// no record: the first attempt's record may have gone back with the store.
    InDoubt,
    /// 504: the proxy gave up waiting for the rail; the payment is in doubt.
    UpstreamTimeout,
}

/// A message in flight.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    /// Worker → proxy: pay `payment` of `account`, `Fencing-Token: token`,
    /// `Idempotency-Key: payment`, `Idempotency-First-Token: first` (0: not sent).
    Submit {
        worker: u8,
        proxy: u8,
        account: u8,
        token: Token,
        grant: GrantId,
        payment: u8,
        first: Token,
    },
    /// Proxy → rail: an accepted request on its way; `seq` its handover entry's.
    Forward {
        proxy: u8,
        account: u8,
        token: Token,
        grant: GrantId,
        payment: u8,
        seq: Seq,
    },
    /// Rail → proxy: the rail's answer to a forward.
    RailAnswer {
        proxy: u8,
        account: u8,
        token: Token,
        grant: GrantId,
        payment: u8,
        seq: Seq,
    },
    /// Proxy → worker.
    Reply {
        worker: u8,
        grant: GrantId,
        payment: u8,
        reply: Reply,
    },
}

/// Messages in flight, kept sorted so that equal multisets are equal states.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Network {
    pub in_flight: Vec<Msg>,
}

impl Network {
    pub fn send(&mut self, msg: Msg) {
        let at = self.in_flight.partition_point(|m| *m < msg);
        self.in_flight.insert(at, msg);
    }

    /// Takes one copy of `msg` out of the network; false if none is in flight.
    pub fn take(&mut self, msg: &Msg) -> bool {
        match self.in_flight.iter().position(|m| m == msg) {
            Some(at) => {
                self.in_flight.remove(at);
                true
            }
            None => false,
        }
    }

    /// The distinct messages that could be delivered (or dropped) next.
    pub fn deliverable(&self) -> impl Iterator<Item = &Msg> {
        self.in_flight
            .iter()
            .enumerate()
            .filter(|(i, m)| *i == 0 || self.in_flight[i - 1] != **m)
            .map(|(_, m)| m)
    }
}

/// One request the rail received.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Arrival {
    pub account: u8,
    pub payment: u8,
    pub token: Token,
    pub grant: GrantId,
}

/// The rail: every arrival, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Rail {
    pub arrivals: Vec<Arrival>,
}

impl Rail {
    /// Whether a payment of `account` with idempotency key `payment` arrived: the rail's
    /// lookup by idempotency key.
    pub fn has(&self, account: u8, payment: u8) -> bool {
        self.arrivals
            .iter()
            .any(|a| a.account == account && a.payment == payment)
    }
}
