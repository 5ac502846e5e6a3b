//! The PostgreSQL store: the store going back (epoch), failover on Patroni, replication that
//! can lose a compare-and-set, several railguard processes on one database, the hold after a
//! change of server, the session settings, stalled statements, statement plans, online
//! schema maintenance, and the PostgreSQL test harness they stand on.
//!
//! One test binary: each file is a module, named for the behaviour it covers.

mod cross_process;
mod epoch;
mod failover;
mod hold;
mod pg_harness;
mod replication;
mod schema_maintenance;
mod serve;
mod session_settings;
mod stalled_statements;
mod statement_plans;
