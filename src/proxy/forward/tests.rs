use super::*;

#[test]
fn strips_hop_by_hop_and_connection_named_headers() {
    let mut h = HeaderMap::new();
    h.insert("connection", "keep-alive, x-secret".parse().unwrap());
    h.insert("keep-alive", "timeout=5".parse().unwrap());
    h.insert("x-secret", "1".parse().unwrap());
    h.insert("transfer-encoding", "chunked".parse().unwrap());
    h.insert("te", "trailers".parse().unwrap());
    h.insert("upgrade", "h2c".parse().unwrap());
    h.insert("fencing-token", "42".parse().unwrap());
    strip_hop_by_hop(&mut h);
    assert_eq!(h.len(), 1);
    assert!(h.contains_key("fencing-token"));
}

mod forwarded_for {
    use super::*;
    use proptest::prelude::*;

    /// The chain built the obvious way: every earlier value that is text, then `ip`, joined.
    fn by_strings(headers: &HeaderMap, ip: std::net::IpAddr) -> Option<HeaderValue> {
        let mut chain: Vec<String> = headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(str::to_string)
            .collect();
        chain.push(ip.to_string());
        HeaderValue::from_str(&chain.join(", ")).ok()
    }

    proptest! {
        #[test]
        fn the_chain_is_the_earlier_text_values_then_the_client(
            values in proptest::collection::vec(
                proptest::collection::vec(
                    prop_oneof![Just(b'\t'), 0x20u8..0x7f, 0x80u8..=0xff], 0..12),
                0..4),
            ip in any::<std::net::IpAddr>(),
        ) {
            let mut headers = HeaderMap::new();
            for value in &values {
                headers.append(X_FORWARDED_FOR, HeaderValue::from_bytes(value).unwrap());
            }
            let expected = by_strings(&headers, ip);
            append_forwarded_for(&mut headers, ip);
            let got: Vec<_> = headers.get_all(&X_FORWARDED_FOR).iter().cloned().collect();
            prop_assert_eq!(got, expected.into_iter().collect::<Vec<_>>());
        }
    }
}

#[test]
fn forwarded_for_appends_to_the_chain() {
    let mut h = HeaderMap::new();
    h.append("x-forwarded-for", "10.0.0.1".parse().unwrap());
    h.append("x-forwarded-for", "10.0.0.2".parse().unwrap());
    append_forwarded_for(&mut h, "127.0.0.1".parse().unwrap());
    assert_eq!(
        h.get("x-forwarded-for").unwrap(),
        "10.0.0.1, 10.0.0.2, 127.0.0.1"
    );
}
