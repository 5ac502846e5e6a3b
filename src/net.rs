//! Loopback port selection for embedded servers and tests.

use std::net::{Ipv4Addr, TcpListener};

/// A loopback TCP port that was free a moment ago, chosen at random below the kernel's
/// ephemeral range (32768+) so that outgoing connections cannot take it between our check
/// and the server's bind. Parallel tests each get their own.
pub fn free_loopback_port() -> u16 {
    use std::hash::{BuildHasher, RandomState};
    let state = RandomState::new();
    for attempt in 0u32..10_000 {
        let port = 20_000 + (state.hash_one(attempt) % 12_000) as u16;
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return port;
        }
    }
    // Everything below the ephemeral range is taken: let the kernel choose.
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}
