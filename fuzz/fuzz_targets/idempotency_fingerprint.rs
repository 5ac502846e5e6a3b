//! The idempotency key grammar and the request fingerprint that tells "the same request"
//! from another one under one key.
//!
//! The input is `[method length, path length, mutation seed (2 bytes), method, path, body]`.
//! Checked: nothing panics; a fingerprint is 64 lowercase hex digits and deterministic; it
//! changes when any byte of the body changes, when the body grows or shrinks by a byte, when
//! a byte moves across the path/body boundary, and when the method changes; an accepted key is
//! 1 to 255 bytes of visible ASCII and comes back unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use railguard::proxy::idempotency::{fingerprint, parse_key};

fn check_key(text: &str) {
    let valid = (1..=255).contains(&text.len()) && text.bytes().all(|b| b.is_ascii_graphic());
    match parse_key(text) {
        Ok(key) => {
            assert!(valid, "{text:?} accepted");
            assert_eq!(key, text);
        }
        Err(_) => assert!(!valid, "{text:?} refused"),
    }
}

fuzz_target!(|data: &[u8]| {
    let [m_len, p_len, seed_a, seed_b, rest @ ..] = data else {
        return;
    };
    let m_len = usize::from(*m_len % 16).min(rest.len());
    let (method, rest) = rest.split_at(m_len);
    let p_len = usize::from(*p_len).min(rest.len());
    let (path, body) = rest.split_at(p_len);
    if let Ok(text) = std::str::from_utf8(body) {
        check_key(text);
    }
    // What a request can carry: a valid method and target (`http` refuses NUL in both, which
    // is what keeps the fingerprint's separators unambiguous).
    let Ok(method) = http::Method::from_bytes(method) else {
        return;
    };
    let Ok(path) = http::uri::PathAndQuery::try_from(path) else {
        return;
    };
    let (method, path) = (method.as_str(), path.as_str());
    let print = fingerprint(method, path, body);
    assert_eq!(print.len(), 64);
    assert!(
        print
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    );
    assert_eq!(print, fingerprint(method, path, body), "deterministic");

    let seed = usize::from(*seed_a) << 8 | usize::from(*seed_b);
    if !body.is_empty() {
        let mut changed = body.to_vec();
        changed[seed % body.len()] ^= 1 << (seed % 8);
        assert_ne!(
            print,
            fingerprint(method, path, &changed),
            "one bit of the body"
        );
        assert_ne!(print, fingerprint(method, path, &body[1..]), "body shorter");
    }
    let mut longer = body.to_vec();
    longer.push(*seed_a);
    assert_ne!(print, fingerprint(method, path, &longer), "body longer");
    if let Some(last) = path
        .len()
        .checked_sub(1)
        .filter(|&i| path.is_char_boundary(i))
    {
        let moved = [&path.as_bytes()[last..], body].concat();
        assert_ne!(
            print,
            fingerprint(method, &path[..last], &moved),
            "boundary"
        );
    }
    let other = if method == "POST" { "PUT" } else { "POST" };
    assert_ne!(print, fingerprint(other, path, body), "method");
});
