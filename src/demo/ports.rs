//! Loopback ports for child processes that must be told their port before they start (the
//! demo's etcd; the test kit's PostgreSQL clusters and etcd members), claimed so that no other
//! process picking ports this way takes one while its server is down: a server stopped and
//! started again on its port (a crash, a restore) still finds it its own.
//!
//! A claim is a Unix socket bound to an abstract name made from the port
//! (`railguard-loopback-port-N`): no file, no directory or permissions to get wrong, scoped to
//! the network namespace the ports belong to, and released by the kernel when its holder
//! closes it or exits however it exits. Ports are taken from below the kernel's ephemeral range
//! (32768+), so that outgoing connections cannot take one between the check and the server's
//! bind.

use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The ports picked from: 20000 to 31999.
const FIRST: u16 = 20_000;
const COUNT: u16 = 12_000;

/// A loopback port nothing listened on when it was claimed, held for its holder until dropped.
#[derive(Debug)]
pub struct LoopbackPort {
    port: u16,
    _claim: UnixDatagram,
}

impl LoopbackPort {
    /// The port's number.
    pub fn number(&self) -> u16 {
        self.port
    }
}

/// Claims a loopback port that no other holder has claimed and nothing listens on, starting
/// from a random one and trying each in turn. An error when every one is taken or claimed.
pub fn claim_loopback_port() -> io::Result<LoopbackPort> {
    use std::hash::{BuildHasher, RandomState};
    let start = (RandomState::new().hash_one(std::process::id()) % u64::from(COUNT)) as u16;
    for offset in 0..COUNT {
        let port = FIRST + (start + offset) % COUNT;
        let Some(claim) = claim(port)? else {
            continue;
        };
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return Ok(LoopbackPort {
                port,
                _claim: claim,
            });
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        format!(
            "every loopback port from {FIRST} to {} is in use or claimed",
            FIRST + COUNT - 1
        ),
    ))
}

/// `port`'s claim, or `None` when another holder has it.
fn claim(port: u16) -> io::Result<Option<UnixDatagram>> {
    let name = format!("railguard-loopback-port-{port}");
    match UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?) {
        Ok(socket) => Ok(Some(socket)),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claimed_port_is_not_claimed_again_until_dropped() {
        let first = claim_loopback_port().unwrap();
        assert!(
            claim(first.number()).unwrap().is_none(),
            "{first:?} is held"
        );
        let second = claim_loopback_port().unwrap();
        assert_ne!(first.number(), second.number());
        let port = first.number();
        drop(first);
        assert!(claim(port).unwrap().is_some(), "released when dropped");
    }

    #[test]
    fn a_port_something_listens_on_is_passed_over() {
        let claimed = claim_loopback_port().unwrap();
        let port = claimed.number();
        drop(claimed);
        let _listening = TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
        // Its claim is free, but the port is not: whatever is claimed next is another one.
        for _ in 0..20 {
            assert_ne!(claim_loopback_port().unwrap().number(), port);
        }
    }
}
