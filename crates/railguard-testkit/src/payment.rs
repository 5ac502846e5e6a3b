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

/// [`pay`] after a change of PostgreSQL server: repeated while the proxy answers 503 — newer
/// grants' forwards are held until nothing sent before the change can still reach the rail,
/// and a request that cannot wait that long is answered 503 with nothing sent — for at most
/// `limit`; the first other answer.
pub async fn pay_after_the_hold(
    proxy: &RailClient,
    grant: &LockHandle,
    account: &str,
    id: &str,
    limit: std::time::Duration,
) -> Result<StatusCode, SdkError> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let paid = pay(proxy, grant, account, id).await;
        if !matches!(paid, Ok(StatusCode::SERVICE_UNAVAILABLE))
            || tokio::time::Instant::now() >= deadline
        {
            return paid;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}
