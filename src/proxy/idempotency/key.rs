//! The `Idempotency-Key` grammar, the request fingerprint that tells "the same request" from
//! a different one under one key, and the owner id of the request that creates a record.

use sha2::{Digest, Sha256};

/// What identifies "the same request" for one key: method, path and query, and body.
pub fn fingerprint(method: &str, path_and_query: &str, body: &[u8]) -> String {
    let mut hash = Sha256::new();
    hash.update(method.as_bytes());
    hash.update([0]);
    hash.update(path_and_query.as_bytes());
    hash.update([0]);
    hash.update(body);
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A random id for the request that may create a record (128 bits, hex).
pub fn new_owner() -> String {
    use std::hash::{BuildHasher, RandomState};
    let state = RandomState::new();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{:016x}{:016x}",
        state.hash_one(nanos),
        state.hash_one((nanos, std::process::id()))
    )
}

/// A key as received: 1 to 255 bytes of visible ASCII.
pub fn parse_key(text: &str) -> Result<String, String> {
    if text.is_empty() || text.len() > 255 {
        return Err("must be 1 to 255 bytes".into());
    }
    if !text.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("must be visible ASCII without spaces".into());
    }
    Ok(text.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_separate_method_path_and_body() {
        let a = fingerprint("POST", "/pay", b"{}");
        assert_eq!(a, fingerprint("POST", "/pay", b"{}"));
        assert_ne!(a, fingerprint("PUT", "/pay", b"{}"));
        assert_ne!(a, fingerprint("POST", "/pay?x=1", b"{}"));
        assert_ne!(a, fingerprint("POST", "/pay", b"{ }"));
        assert_ne!(
            fingerprint("POST", "/a", b"b"),
            fingerprint("POST", "/ab", b"")
        );
    }

    #[test]
    fn key_grammar() {
        assert!(parse_key("pay-2026-12-02-0001").is_ok());
        assert!(parse_key("").is_err());
        assert!(parse_key("a b").is_err());
        assert!(parse_key(&"k".repeat(256)).is_err());
    }
}
