//! TLS with rustls (the `ring` provider).

pub mod server;
