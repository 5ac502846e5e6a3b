//! TLS with rustls and its ring provider (the same rustls etcd-client's TLS uses; no
//! aws-lc-rs): railguard's listeners ([`server`]), and railguard as a client of the rail
//! ([`client`]) and of PostgreSQL ([`postgres`]).

pub mod client;
pub mod postgres;
pub mod server;
