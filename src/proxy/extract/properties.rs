use http::HeaderValue;
use proptest::prelude::*;

use super::*;

fn names() -> [HeaderName; 3] {
    [
        HeaderName::from_static("fencing-token"),
        HeaderName::from_static("fencing-account"),
        HeaderName::from_static("idempotency-key"),
    ]
}

fn request(token: &str, account: &str, key: &str) -> HeaderMap {
    let [t, a, k] = names();
    let mut headers = HeaderMap::new();
    headers.append(t, token.parse().unwrap());
    headers.append(a, account.parse().unwrap());
    headers.append(k, key.parse().unwrap());
    headers
}

proptest! {
    #[test]
    fn every_well_formed_request_is_read_as_sent(
        token in 1..=i64::MAX,
        account in "[!-~]{1,128}",
        key in "[!-~]{1,255}",
    ) {
        let [t, a, k] = names();
        let headers = request(&token.to_string(), &account, &key);
        let (read, read_account) = fencing_headers(&headers, &t, &a, 128).unwrap();
        prop_assert_eq!(read.get(), token);
        prop_assert_eq!(read_account.as_str(), account.as_str());
        prop_assert_eq!(idempotency_key(&headers, &k, true).unwrap(), Some(key));
    }

    #[test]
    fn a_repeated_header_is_refused_whatever_its_values(
        token in 1..=i64::MAX,
        second in "[!-~]{1,20}",
        which in 0..3usize,
    ) {
        let names = names();
        let mut headers = request(&token.to_string(), "acct-1", "pay-1");
        headers.append(&names[which], second.parse().unwrap());
        let refused = if which == 2 {
            idempotency_key(&headers, &names[2], false).map(|_| ()).unwrap_err()
        } else {
            fencing_headers(&headers, &names[0], &names[1], 128).map(|_| ()).unwrap_err()
        };
        let BadRequest::Header { header, reason } = refused else {
            panic!("not a header error");
        };
        prop_assert_eq!(&header, &names[which]);
        prop_assert_eq!(reason, HeaderError::Repeated.to_string());
    }

    #[test]
    fn a_value_with_a_byte_outside_visible_ascii_is_refused(
        text in "[!-~]{0,20}",
        other in prop_oneof![Just(b' '), Just(b'\t'), 0x80u8..=0xff],
        at in any::<prop::sample::Index>(),
        which in 0..3usize,
    ) {
        let mut bad = text.clone().into_bytes();
        bad.insert(at.index(bad.len() + 1), other);
        let names = names();
        let mut headers = request("5", "acct-1", "pay-1");
        headers.insert(&names[which], HeaderValue::from_bytes(&bad).unwrap());
        let refused = match which {
            2 => idempotency_key(&headers, &names[2], false).is_err(),
            _ => fencing_headers(&headers, &names[0], &names[1], 128).is_err(),
        };
        prop_assert!(refused, "{:?} accepted", String::from_utf8_lossy(&bad));
    }
}
