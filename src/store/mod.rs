//! What railguard keeps in PostgreSQL, spoken in SQL, knowing nothing of HTTP or the proxy's
//! types: callers hand it plain values and get plain values back.
//!
//! - [`batch`]: the one group-commit batcher behind the compare-and-sets, the last looks and
//!   the completions.
//! - [`marks`]: the accounts' high-water marks: the compare-and-set and the last look.
//! - [`records`]: idempotency records: created with the compare-and-set, completed with the
//!   rail's answer, found, forgotten, swept.
//! - [`instance`]: this process as the owner of the records it makes, and its clean stop.
//! - [`completions`]: the statement that stores the rail's answers to keyed requests.
//! - [`epoch`]: which server the database was last acknowledged on, and the fencing floor
//!   that a store going back (a failover, a rewound data directory, a restored etcd) raises.
//! - [`handover`]: which forwards each railguard process may still have on their way to the
//!   rail, so that several processes keep an account's tokens in order at the rail.
//! - [`replication`]: replication and durability settings under which PostgreSQL can lose a
//!   commit it acknowledged.

pub mod batch;
pub mod completions;
pub mod epoch;
pub mod handover;
pub mod instance;
pub mod marks;
pub mod records;
pub mod replication;
