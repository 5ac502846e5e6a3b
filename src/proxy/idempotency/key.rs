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
    crate::proof::hex(&hash.finalize())
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

/// Properties of the key grammar and the fingerprint, over generated requests (the fuzz
/// target `idempotency_fingerprint` checks the same on arbitrary bytes).
#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn a_fingerprint_changes_when_any_byte_of_the_body_changes(
            body in prop::collection::vec(any::<u8>(), 1..512),
            at in any::<prop::sample::Index>(),
            flip in 1..=255u8,
        ) {
            let print = fingerprint("POST", "/pay", &body);
            prop_assert_eq!(&print, &fingerprint("POST", "/pay", &body), "deterministic");
            let mut changed = body.clone();
            changed[at.index(body.len())] ^= flip;
            prop_assert_ne!(&print, &fingerprint("POST", "/pay", &changed));
            prop_assert_ne!(&print, &fingerprint("POST", "/pay", &body[..body.len() - 1]));
        }

        #[test]
        fn a_fingerprint_tells_where_the_path_ends_and_the_body_begins(
            path in "/[a-z0-9/?=&]{0,30}",
            body in "[a-z0-9]{1,30}",
            split in any::<prop::sample::Index>(),
        ) {
            // Move a prefix of the body onto the path: the concatenation is the same, the
            // request is not.
            let at = 1 + split.index(body.len());
            let moved = format!("{path}{}", &body[..at]);
            prop_assert_ne!(
                fingerprint("POST", &path, body.as_bytes()),
                fingerprint("POST", &moved, &body.as_bytes()[at..])
            );
        }

        #[test]
        fn every_visible_ascii_key_of_1_to_255_bytes_is_accepted(key in "[!-~]{1,255}") {
            prop_assert_eq!(parse_key(&key), Ok(key.clone()));
        }

        #[test]
        fn a_key_with_any_other_byte_is_refused(
            key in "[!-~]{0,254}",
            other in any::<char>().prop_filter("not visible ASCII", |c| !c.is_ascii_graphic()),
            at in any::<prop::sample::Index>(),
        ) {
            let mut bad = key.clone();
            bad.insert(at.index(key.len() + 1), other);
            prop_assert!(parse_key(&bad).is_err(), "{:?} accepted", bad);
        }

        #[test]
        fn a_key_longer_than_255_bytes_is_refused(key in "[!-~]{256,400}") {
            prop_assert!(parse_key(&key).is_err());
        }
    }

    proptest::proptest! {
        #[test]
        fn fingerprint_hex_is_the_two_lowercase_digits_of_each_byte(
            method in "[A-Z]{0,8}",
            path in "\\PC{0,24}",
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
        ) {
            let mut hash = Sha256::new();
            hash.update(method.as_bytes());
            hash.update([0]);
            hash.update(path.as_bytes());
            hash.update([0]);
            hash.update(&body);
            let formatted: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
            proptest::prop_assert_eq!(fingerprint(&method, &path, &body), formatted);
        }
    }
}
