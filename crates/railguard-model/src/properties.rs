//! What must always hold, and what must be reachable for the model to mean anything.
//!
//! The `always` properties (INV-05 split in two: at the rail, at paydb) judge the system by its
//! ground truth: the lock service's ledger of grants (in the order they were made), the rail's
//! arrivals (each with the grant that really sent it) and paydb's record of the grant that
//! wrote each row last. A token is only what a request *says*; these properties ask what
//! actually happened.
//!
//! The `sometimes` properties show that the model is not vacuous: the checker must reach a
//! takeover, a stale writer fenced at each fencing point, a completed payment, and T-042 itself;
//! with more than one proxy process, a request that waits for another process's forward.
//!
//! When a store may go back ([`crate::epoch`]) the same `always` properties are checked across
//! the event, INV-02 with no exception: a payment whose idempotency record PostgreSQL lost is
//! retried with the first grant's token (`Idempotency-First-Token`), which the proxy answers
//! `in_doubt` — or, once nothing sent before the change can still reach the rail and the rail
//! has no such payment, forwards as the key's first request ([`LOST_ATTEMPT_NOT_ON_THE_RAIL`]
//! shows that it happens). Without the header, or with the rail asked before the hold, it is
//! paid again (the variants `NoFirstToken` and `LostLookupBeforeHold`). More `sometimes` show
//! the event is not vacuous either: a grant from before it refused below the floor, a grant
//! made after it reaching the rail, and (etcd restored) a grant withdrawn because its token was
//! not above its key's `lock_issued`; with more than one proxy process instance and PostgreSQL
//! going back, a request held after the change that may go on once another process's forward
//! from before reached the rail.

use stateright::Property;

use crate::lock::{GrantStatus, Key};
use crate::model::{FencingModel, ProtocolState};
use crate::network::Arrival;
use crate::paydb::PaymentState;

pub const INV_02: &str = "INV-02 the rail never receives the same payment twice";
pub const INV_04: &str = "INV-04 tokens for a key strictly increase across grants";
pub const INV_05_RAIL: &str =
    "INV-05 (rail) no request of a superseded grant is recorded by the rail after a newer grant's";
pub const INV_05_PAYDB: &str =
    "INV-05 (paydb) no fenced UPDATE of a superseded grant matches after a newer grant's";
pub const INV_06: &str = "INV-06 at most one unexpired grant per key (lock service's view)";
pub const EQUAL_TOKEN_SAME_GRANT: &str = "equal token => same grant";

pub const TAKEOVER: &str = "sometimes: a grant takes over a key whose lease expired";
pub const FENCED_AT_PROXY: &str = "sometimes: a stale writer is fenced at the proxy";
pub const FENCED_AT_PAYDB: &str = "sometimes: a stale writer is fenced at paydb";
pub const PAYMENT_COMPLETES: &str = "sometimes: a payment completes";
pub const T_042: &str =
    "sometimes: T-042, a stalled survivor fenced out after the new holder reached the rail";
pub const HANDED_OVER: &str =
    "sometimes: a request waiting for another process's forward may go on once it reached the rail";
pub const HELD_AFTER_STORE_CHANGE: &str = "sometimes: a request held after the store changed \
     may go on once another process's forward from before it reached the rail";
pub const FENCED_BY_FLOOR: &str =
    "sometimes: a grant from before the store went back is refused below the floor";
pub const PAID_AFTER_GOING_BACK: &str =
    "sometimes: a grant made after the store went back reaches the rail";
pub const WITHDRAWN: &str =
    "sometimes: an etcd grant not above its key's lock_issued is withdrawn (etcd went back)";
pub const LOST_ATTEMPT_NOT_ON_THE_RAIL: &str = "sometimes: a retry whose first token is below \
     the floor and whose key has no record goes on, the rail having no such payment";

/// Things seen happen that no component's state keeps: stale writes that matched, tokens
/// shared by two grants at paydb, and refusals. They only ever go from false to true.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Observations {
    /// A paydb UPDATE of a grant matched after a newer grant had written the row.
    pub stale_paydb_write: bool,
    /// A paydb UPDATE matched a row whose fence equalled its token but was written by another
    /// grant.
    pub paydb_token_shared: bool,
    pub fenced_at_proxy: bool,
    pub fenced_at_paydb: bool,
    /// The proxy refused a request of a grant after a newer grant of the key reached the rail.
    pub t042: bool,
    /// The compare-and-set refused a token below the fencing floor.
    pub fenced_by_floor: bool,
    /// An etcd grant was withdrawn: its token was not above its key's `lock_issued`.
    pub withdrawn: bool,
    /// A forward reaching the rail settled the last entry a request of another process waited
    /// for.
    pub handed_over: bool,
    /// A forward from before the store change reaching the rail let a request held after the
    /// change go on.
    pub held_after_change: bool,
    /// A retry whose first attempt's record may have gone back with the store went on as the
    /// key's first request: the rail's lookup, asked once nothing sent before the change could
    /// still reach it, found no such payment.
    pub lost_attempt_not_on_the_rail: bool,
}

/// Every property the model checks (those about a store going back only when one may).
pub fn all(model: &FencingModel) -> Vec<Property<FencingModel>> {
    let mut properties: Vec<Property<FencingModel>> = vec![
        Property::always(INV_02, |m, s: &ProtocolState| {
            m.judge(INV_02, no_payment_twice(s))
        }),
        Property::always(INV_04, |m, s: &ProtocolState| {
            m.judge(INV_04, tokens_strictly_increase(s))
        }),
        Property::always(INV_05_RAIL, |m, s: &ProtocolState| {
            m.judge(INV_05_RAIL, rail_in_grant_order(s))
        }),
        Property::always(INV_05_PAYDB, |m, s: &ProtocolState| {
            m.judge(INV_05_PAYDB, !s.seen.stale_paydb_write)
        }),
        Property::always(INV_06, |m, s: &ProtocolState| {
            m.judge(INV_06, one_live_grant_per_key(s))
        }),
        Property::always(EQUAL_TOKEN_SAME_GRANT, |m, s: &ProtocolState| {
            m.judge(EQUAL_TOKEN_SAME_GRANT, equal_token_same_grant(s))
        }),
        Property::sometimes(TAKEOVER, |_, s: &ProtocolState| {
            s.lock.grants.iter().any(|g| g.took_over)
        }),
        Property::sometimes(FENCED_AT_PROXY, |_, s: &ProtocolState| {
            s.seen.fenced_at_proxy
        }),
        Property::sometimes(FENCED_AT_PAYDB, |_, s: &ProtocolState| {
            s.seen.fenced_at_paydb
        }),
        Property::sometimes(PAYMENT_COMPLETES, |_, s: &ProtocolState| {
            s.paydb
                .accounts
                .iter()
                .any(|a| a.payments.contains(&PaymentState::Done))
        }),
        Property::sometimes(T_042, |_, s: &ProtocolState| s.seen.t042),
    ];
    if model.handover() {
        properties.push(Property::sometimes(HANDED_OVER, |_, s: &ProtocolState| {
            s.seen.handed_over
        }));
    }
    if model.store_may_go_back() {
        properties.push(Property::sometimes(
            FENCED_BY_FLOOR,
            |_, s: &ProtocolState| s.seen.fenced_by_floor,
        ));
        properties.push(Property::sometimes(
            PAID_AFTER_GOING_BACK,
            |_, s: &ProtocolState| {
                s.rail
                    .arrivals
                    .iter()
                    .any(|a| s.past.after_going_back(a.grant))
            },
        ));
    }
    if model.holds_after_store_change() && model.bounds.postgres_goes_back {
        properties.push(Property::sometimes(
            HELD_AFTER_STORE_CHANGE,
            |_, s: &ProtocolState| s.seen.held_after_change,
        ));
    }
    if model.etcd_may_go_back() {
        properties.push(Property::sometimes(WITHDRAWN, |_, s: &ProtocolState| {
            s.seen.withdrawn
        }));
    }
    if model.bounds.postgres_goes_back && model.rules().idempotency {
        properties.push(Property::sometimes(
            LOST_ATTEMPT_NOT_ON_THE_RAIL,
            |_, s: &ProtocolState| s.seen.lost_attempt_not_on_the_rail,
        ));
    }
    properties
}

/// Whether `a` repeats a payment among `earlier` arrivals.
fn repeated(earlier: &[Arrival], a: &Arrival) -> bool {
    earlier
        .iter()
        .any(|b| (a.account, a.payment) == (b.account, b.payment))
}

/// INV-02: no (account, payment) arrives at the rail twice.
fn no_payment_twice(s: &ProtocolState) -> bool {
    let arrivals = &s.rail.arrivals;
    arrivals
        .iter()
        .enumerate()
        .all(|(i, a)| !repeated(&arrivals[..i], a))
}

/// INV-04: in the order grants were made, each key's tokens strictly increase.
fn tokens_strictly_increase(s: &ProtocolState) -> bool {
    let grants = &s.lock.grants;
    grants.iter().enumerate().all(|(i, g)| {
        grants[..i]
            .iter()
            .filter(|earlier| earlier.key == g.key)
            .all(|earlier| earlier.token < g.token)
    })
}

/// INV-05 at the rail: per account, the grants of the rail's arrivals never go back to an
/// older grant. (At paydb: no UPDATE of a grant matched after a newer grant had written the
/// row, which [`Observations::stale_paydb_write`] records.)
fn rail_in_grant_order(s: &ProtocolState) -> bool {
    let arrivals = &s.rail.arrivals;
    arrivals.iter().enumerate().all(|(i, a)| {
        arrivals[..i]
            .iter()
            .filter(|earlier| earlier.account == a.account)
            .all(|earlier| earlier.grant <= a.grant)
    })
}

/// INV-06: per key, at most one grant is live in the lock service's ledger.
fn one_live_grant_per_key(s: &ProtocolState) -> bool {
    let keys = s.lock.grants.iter().map(|g| g.key).max();
    keys.is_none_or(|max: Key| {
        (0..=max).all(|k| {
            s.lock
                .grants
                .iter()
                .filter(|g| g.key == k && g.status == GrantStatus::Live)
                .count()
                <= 1
        })
    })
}

/// Equal token ⇒ same grant: no two grants of a key carry one token, no two grants reach the
/// rail for one account under one token, and paydb never took one token from two grants.
fn equal_token_same_grant(s: &ProtocolState) -> bool {
    let grants = &s.lock.grants;
    let distinct_grant_tokens = grants.iter().enumerate().all(|(i, g)| {
        grants[..i]
            .iter()
            .all(|earlier| earlier.key != g.key || earlier.token != g.token)
    });
    let arrivals = &s.rail.arrivals;
    let distinct_rail_tokens = arrivals.iter().enumerate().all(|(i, a)| {
        arrivals[..i].iter().all(|earlier| {
            earlier.account != a.account || earlier.token != a.token || earlier.grant == a.grant
        })
    });
    distinct_grant_tokens && distinct_rail_tokens && !s.seen.paydb_token_shared
}
