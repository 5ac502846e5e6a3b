//! railguard's M4 fault harness (see `railguard harness --help` and docs/harness.md): real worker processes drive a real deployment while real faults are
//! injected; every step is recorded, and an independent checker judges the invariants from
//! what the stores themselves recorded.
//!
//! - [`coordinator`]: starts everything, runs the faults, saves the records, checks them;
//! - [`worker`]: one payment worker, an OS process of its own;
//! - [`history`]: the recorded history; [`check`]: the checker;
//! - [`faults`]: the fault kinds and their schedule; [`paydb`]: the workload's database;
//! - [`lockdb`]: railguard's own PostgreSQL, one cluster or a Patroni cluster;
//! - [`operator`]: the operator who follows the in-doubt procedure (`--operator-forgets`);
//! - [`reread`]: the §A2.3 bug, on purpose, for the negative control;
//! - [`takeover`]: a superseded grant across a store that goes back, the interleaving forced.

pub mod check;
pub mod coordinator;
pub mod faults;
pub mod history;
pub mod lockdb;
pub mod operator;
pub mod paydb;
pub mod progress;
pub mod reread;
pub mod rng;
pub mod takeover;
pub mod worker;
