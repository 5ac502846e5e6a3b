//! railguard's three listeners over real sockets: their limits, TLS and mutual TLS,
//! authentication and authorisation, and all of these under attack.
//!
//! One test binary: each file is a module, named for the behaviour it covers.

mod auth;
mod identities;
mod limits;
mod refusals;
mod security;
mod shared_port;
mod tls;
