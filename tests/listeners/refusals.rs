//! The refusals a listener in this process counts, and waiting for them: the server counts a
//! refusal after the client has seen it.

use railguard_testkit as support;

use std::time::Duration;

use prometheus::IntCounterVec;
use railguard::http::Refusal;

/// How many times the proxy listener counted `reason`.
pub(crate) fn refused(refusals: &IntCounterVec, reason: Refusal) -> u64 {
    refusals
        .with_label_values(&["proxy", reason.as_str()])
        .get()
}

/// Waits (10 s at most) until `reason` has been counted `n` times, and checks it was not
/// counted more.
pub(crate) async fn wait_refused(refusals: &IntCounterVec, reason: Refusal, n: u64) {
    let _ = support::within(Duration::from_secs(10), || async {
        (refused(refusals, reason) >= n).then_some(())
    })
    .await;
    assert_eq!(refused(refusals, reason), n, "{} refusals", reason.as_str());
}
