use super::*;

fn entry(seq: u64, token: i64, key: &str) -> LedgerEntry {
    LedgerEntry {
        seq,
        method: "POST".into(),
        path: "/payments".into(),
        account: Some(ACCOUNT.into()),
        token: Some(token.to_string()),
        idempotency_key: Some(key.into()),
        body_sha256: String::new(),
        forwarded_for: None,
        headers: Vec::new(),
        received_unix_ms: 0,
    }
}

fn fenced(token: i64) -> Result<StatusCode, SdkError> {
    Err(SdkError::FencedOut {
        account: ACCOUNT.into(),
        token,
        body: format!(
            "{{\"error\":\"fenced_out\",\"message\":\"below the mark\",\"origin\":\"client\",\
                 \"account\":\"{ACCOUNT}\",\"token\":{token},\"request_id\":\"0a5-2\"}}"
        ),
    })
}

fn t042() -> Observed {
    Observed {
        t1: 3,
        t2: 5,
        w2_status: StatusCode::CREATED,
        stale: fenced(3),
        ledger: vec![entry(1, 5, W2_PAYMENT)],
        fenced_before: Some(0.0),
        fenced_after: Some(1.0),
    }
}

#[test]
fn the_expected_outcome_passes() {
    assert_eq!(check(&t042()), Verdict::Passed);
}

#[test]
fn a_duplicate_payment_an_unfenced_submit_and_a_silent_counter_each_fail() {
    let observed = Observed {
        stale: Ok(StatusCode::CREATED),
        ledger: vec![entry(1, 5, W2_PAYMENT), entry(2, 3, W1_PAYMENT)],
        fenced_after: Some(0.0),
        ..t042()
    };
    let Verdict::Failed(why) = check(&observed) else {
        panic!("a duplicate payment must fail the demo");
    };
    assert_eq!(why.len(), 3, "{why:?}");
    assert!(
        why[0].contains("fenced out") && why[0].contains("201"),
        "{why:?}"
    );
    assert!(why[1].contains("seq 2"), "{why:?}");
    assert!(why[2].contains("from 0 to 0"), "{why:?}");
}

#[test]
fn a_missing_counter_or_a_wrong_token_fails() {
    let observed = Observed {
        stale: fenced(4),
        fenced_after: None,
        ..t042()
    };
    assert!(matches!(check(&observed), Verdict::Failed(why) if why.len() == 2));
}

#[test]
fn a_409_that_reveals_the_mark_fails() {
    let body =
        format!("{{\"error\":\"fenced_out\",\"account\":\"{ACCOUNT}\",\"token\":3,\"mark\":5}}");
    assert!(reveals_mark(&body, 5));
    assert!(reveals_mark("{\"message\":\"the mark is 5\"}", 5));
    assert!(!reveals_mark("{\"token\":3,\"request_id\":\"5a-5\"}", 5));
    let observed = Observed {
        stale: Err(SdkError::FencedOut {
            account: ACCOUNT.into(),
            token: 3,
            body,
        }),
        ..t042()
    };
    assert!(matches!(check(&observed), Verdict::Failed(why) if why.len() == 1));
}

#[test]
fn metrics_are_read_from_prometheus_text() {
    let text = "# HELP lock_fenced_out_total x\n# TYPE lock_fenced_out_total counter\n\
                    lock_fenced_out_total 2\n\
                    railguard_requests_total{outcome=\"forwarded\"} 7\n";
    assert_eq!(metric(text, FENCED_OUT), Some(2.0));
    assert_eq!(metric(text, "railguard_requests_total"), None);
    assert_eq!(samples(text).count(), 2);
}
