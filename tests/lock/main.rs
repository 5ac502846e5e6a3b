//! The lock service: its behavioural suite on every backend, T-042 on every backend, the token
//! source against the marks, and the etcd test harness the etcd cases stand on.
//!
//! One test binary: each file is a module, named for the behaviour it covers.

mod etcd_harness;
mod suite;
mod t042;
mod token_source;
