//! What railguard keeps in PostgreSQL, spoken in SQL, knowing nothing of HTTP or the proxy's
//! types: callers hand it plain values and get plain values back.
//!
//! - [`completions`]: the statement that stores the rail's answers to keyed requests.
//! - [`epoch`]: which server the database was last acknowledged on, and the fencing floor
//!   that a store going back (a failover, a rewound data directory, a restored etcd) raises.
//! - [`handover`]: which forwards each railguard process may still have on their way to the
//!   rail, so that several processes keep an account's tokens in order at the rail.
//! - [`replication`]: replication and durability settings under which PostgreSQL can lose a
//!   commit it acknowledged.

pub mod completions;
pub mod epoch;
pub mod handover;
pub mod replication;
