//! railguard: makes a non-idempotent payment rail safe to drive from many workers that
//! coordinate through leases.
//!
//! Map of the crate:
//!
//! - [`token`] — `FencingToken` and `AccountId`, the values everything else passes around.
//! - [`proxy`] — the rail proxy: a tower stack that forwards a request only if its token
//!   passes the account's high-water mark.
//! - [`lock`] — the lock service: grants with fencing tokens, the PostgreSQL backend, the
//!   HTTP API; [`sdk`] is what a worker uses (`LockClient`, `LockHandle`, `RailClient`, the
//!   paydb fenced UPDATE).
//! - [`proof`] — grant proofs: a token is good only for the lock key it was granted on.
//! - [`db`] — the pool, migrations, and the embedded/throwaway PostgreSQL server;
//!   [`store`] — what railguard keeps there, in SQL: [`store::epoch`] notices a store that
//!   went back (a failover, a rewound data directory, a restored etcd) and raises the
//!   fencing floor.
//! - [`admin`], [`metrics`], [`telemetry`] — what operators see; [`openapi`] — the document
//!   of every listener's HTTP contract (`docs/openapi.yaml`), served by the admin listener.
//! - [`railsim`] — a non-idempotent rail simulator for tests and demos; [`demo`] — T-042
//!   played in one process (`railguard demo`).
//! - [`fast_forward`] — moving the token source past every mark after a restore or a
//!   backend switch (C1 §1.7); [`lock::guard`] refuses grants until it has happened.
//! - [`config`], [`server`] — how it is configured, started and stopped; [`http`] — the body
//!   type and accept loop every listener shares, with its limits; [`tls`] — TLS on the
//!   listeners (certificates reloaded from their files, client certificates for mutual TLS)
//!   and to the rail and PostgreSQL.
//!
//! The design rests on ADR-002: a token is fixed when its grant is made and travels as a
//! value. No API here re-reads a token, and nothing stores one where a writer could pick it up.

pub mod admin;
pub mod auth;
pub mod config;
pub mod db;
pub mod demo;
pub mod fast_forward;
pub mod http;
pub mod lock;
pub mod metrics;
pub mod openapi;
pub mod proof;
pub mod proxy;
pub mod railsim;
pub mod reload;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod work;

/// The worker SDK, which also defines the values and wire types the server speaks.
pub use railguard_sdk as sdk;
pub use railguard_sdk::token;
