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
