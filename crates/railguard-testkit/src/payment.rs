//! A payment as a worker sends it through the SDK: its id as the body and as the
//! idempotency key, fenced by its grant.

use http::StatusCode;
use railguard_sdk::{LockHandle, RailClient, SdkError};

/// POSTs payment `id` on `account` under `grant`, keyed by `id`; the rail's status.
pub async fn pay(
    proxy: &RailClient,
    grant: &LockHandle,
    account: &str,
    id: &str,
) -> Result<StatusCode, SdkError> {
    proxy
        .post(
            grant,
            account,
            "/payments",
            format!("{{\"id\":\"{id}\"}}").into(),
            Some(id),
        )
        .await
        .map(|r| r.status)
}
