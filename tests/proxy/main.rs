//! The rail proxy end to end, over real sockets: forwarding and fencing, idempotency keys,
//! payments in doubt, late answers, what becomes of a keyed request's record when the forward
//! ends badly, TLS to the rail, and safety under faults.
//!
//! One test binary: each file is a module, named for the behaviour it covers.

mod faults;
mod forward;
mod idempotency;
mod in_doubt;
mod late_answer;
mod rail_tls;
mod record_guard;
