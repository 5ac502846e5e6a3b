//! The lock service: its behavioural suite on every backend, T-042 on every backend, the token
//! source against the marks, the PostgreSQL backend's release listener, and the etcd test
//! harness the etcd cases stand on.
//!
//! One test binary: each file is a module, named for the behaviour it covers.

mod etcd_harness;
mod release_listener;
mod suite;
mod t042;
mod token_source;
