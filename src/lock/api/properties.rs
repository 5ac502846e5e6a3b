use proptest::prelude::*;

use super::*;

fn message(error: ApiError) -> String {
    match error {
        ApiError::BadRequest(message) => message,
        other => panic!("not a 400: {other}"),
    }
}

fn secret() -> impl Strategy<Value = [u8; 32]> {
    any::<[u8; 32]>()
}

proptest! {
    #[test]
    fn every_acquire_within_the_limits_is_read_as_sent(
        holder in "[ -~]{1,256}",
        ttl_ms in 10..=3_600_000u64,
        wait_ms in prop::option::of(0..=300_000u64),
    ) {
        let mut body = serde_json::json!({ "holder": holder, "ttl_ms": ttl_ms });
        if let Some(wait_ms) = wait_ms {
            body["wait_ms"] = wait_ms.into();
        }
        let asked = parse_acquire(body.to_string().as_bytes(), &LockLimits::default());
        prop_assert_eq!(
            asked.unwrap(),
            AcquireAsked {
                holder: Some(holder),
                ttl: Duration::from_millis(ttl_ms),
                wait: Duration::from_millis(wait_ms.unwrap_or(0)),
            }
        );
    }

    #[test]
    fn a_ttl_or_wait_outside_the_limits_is_refused(
        ttl_ms in prop_oneof![0..10u64, 3_600_001..=u64::MAX],
        wait_ms in 300_001..=u64::MAX,
    ) {
        let limits = LockLimits::default();
        let ttl = serde_json::json!({ "holder": "w", "ttl_ms": ttl_ms }).to_string();
        prop_assert!(message(parse_acquire(ttl.as_bytes(), &limits).unwrap_err())
            .contains("ttl_ms"));
        let wait = serde_json::json!({ "holder": "w", "ttl_ms": 100, "wait_ms": wait_ms });
        prop_assert!(message(parse_acquire(wait.to_string().as_bytes(), &limits).unwrap_err())
            .contains("wait_ms"));
    }

    #[test]
    fn a_holder_with_any_byte_outside_printable_ascii_is_refused_and_an_empty_one_is_absent(
        holder in "[ -~]{0,20}",
        other in any::<char>().prop_filter("not printable", |c| !(' '..='~').contains(c)),
        at in any::<prop::sample::Index>(),
    ) {
        let mut bad = holder.clone();
        bad.insert(at.index(holder.len() + 1), other);
        let body = serde_json::json!({ "holder": bad, "ttl_ms": 100 }).to_string();
        prop_assert!(message(parse_acquire(body.as_bytes(), &LockLimits::default())
            .unwrap_err()).contains("holder"));
        let empty = serde_json::json!({ "holder": "", "ttl_ms": 100 }).to_string();
        prop_assert_eq!(
            parse_acquire(empty.as_bytes(), &LockLimits::default()).unwrap().holder,
            None
        );
    }

    #[test]
    fn an_unknown_field_is_refused_and_named(
        field in "[a-z_]{1,12}".prop_filter("unknown", |f| {
            !["holder", "ttl_ms", "wait_ms", "token", "lease_secret"].contains(&f.as_str())
        }),
        bytes in secret(),
    ) {
        let named = format!("`{field}`");
        let acquire = serde_json::json!({ "holder": "w", "ttl_ms": 100, &field: 1 });
        let error = parse_acquire(acquire.to_string().as_bytes(), &LockLimits::default());
        prop_assert!(message(error.unwrap_err()).contains(&named));
        let token = serde_json::json!({
            "token": 1, "lease_secret": LeaseSecret(bytes).to_wire(), &field: 1,
        });
        let error = parse_token_body(token.to_string().as_bytes());
        prop_assert!(message(error.unwrap_err()).contains(&named));
    }

    #[test]
    fn every_token_and_secret_is_read_as_sent(token in 1..=i64::MAX, bytes in secret()) {
        let secret = LeaseSecret(bytes);
        let body = serde_json::json!({ "token": token, "lease_secret": secret.to_wire() });
        let (read, read_secret) = parse_token_body(body.to_string().as_bytes()).unwrap();
        prop_assert_eq!(read.get(), token);
        prop_assert!(read_secret == secret);
    }

    #[test]
    fn a_token_below_one_is_refused(token in i64::MIN..=0, bytes in secret()) {
        let body = serde_json::json!({
            "token": token, "lease_secret": LeaseSecret(bytes).to_wire(),
        });
        prop_assert!(message(parse_token_body(body.to_string().as_bytes()).unwrap_err())
            .contains("token"));
    }

    #[test]
    fn only_an_object_is_a_body(value in prop_oneof![
        Just(serde_json::json!([1, "w", 100])),
        any::<i64>().prop_map(serde_json::Value::from),
        "[a-z]{0,8}".prop_map(serde_json::Value::from),
    ]) {
        let body = value.to_string();
        prop_assert!(parse_acquire(body.as_bytes(), &LockLimits::default()).is_err());
        prop_assert!(parse_token_body(body.as_bytes()).is_err());
    }
}
