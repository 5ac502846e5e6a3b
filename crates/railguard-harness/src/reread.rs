//! The `reread` negative control: the bug of ADR-002 §A2.3, on purpose.
//!
//! A worker with this bug asks the lock backend for "the current token" of its key at write
//! time — the PostgreSQL backend's `lock_entry.token`, the etcd key's ModRevision — and
//! presents that instead of its grant's own. After a takeover it presents its successor's
//! token and walks through every fence. The SDK cannot do this (a [`LockHandle`] is the only
//! source of a token it sends), so the buggy worker reads the backend itself and sends the
//! payment with its own HTTP client, as such a worker would.
//!
//! [`LockHandle`]: railguard_sdk::LockHandle

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use railguard_sdk::{RailResponse, SdkError};

pub enum Rereader {
    Postgres(tokio_postgres::Client),
    Etcd {
        client: Box<etcd_client::Client>,
        prefix: String,
    },
}

impl Rereader {
    pub async fn connect(
        lockdb_url: Option<&str>,
        etcd_endpoints: &[String],
        etcd_prefix: &str,
    ) -> Result<Self, String> {
        if let Some(url) = lockdb_url {
            return crate::paydb::connect(url)
                .await
                .map(Rereader::Postgres)
                .map_err(|e| format!("reread: cannot connect to the lock database: {e}"));
        }
        if etcd_endpoints.is_empty() {
            return Err("--control reread needs --lockdb-url or --etcd-endpoints".into());
        }
        let options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(Duration::from_secs(1));
        let client = etcd_client::Client::connect(etcd_endpoints, Some(options))
            .await
            .map_err(|e| format!("reread: cannot connect to etcd: {e}"))?;
        Ok(Rereader::Etcd {
            client: Box::new(client),
            prefix: etcd_prefix.to_string(),
        })
    }

    /// The key's "current token", or `None` when the backend cannot say.
    pub async fn current_token(&mut self, key: &str) -> Option<i64> {
        match self {
            Rereader::Postgres(client) => client
                .query_opt("SELECT token FROM lock_entry WHERE key = $1", &[&key])
                .await
                .ok()
                .flatten()
                .map(|r| r.get(0)),
            Rereader::Etcd { client, prefix } => {
                let response = client.get(format!("{prefix}{key}"), None).await.ok()?;
                response.kvs().first().map(|kv| kv.mod_revision())
            }
        }
    }
}

/// A payment sent with a bare token and no grant proof.
pub struct StalePost {
    http: Client<HttpConnector, Full<Bytes>>,
}

impl Default for StalePost {
    fn default() -> Self {
        Self {
            http: Client::builder(TokioExecutor::new()).build_http(),
        }
    }
}

impl StalePost {
    pub async fn post(
        &self,
        base: &str,
        token: i64,
        account: &str,
        path: &str,
        body: Bytes,
        idempotency_key: Option<&str>,
    ) -> Result<RailResponse, SdkError> {
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(format!("{base}{path}"))
            .header("Fencing-Token", token.to_string())
            .header("Fencing-Account", account)
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(key) = idempotency_key {
            request = request.header("Idempotency-Key", key);
        }
        let request = request
            .body(Full::new(body))
            .map_err(|e| SdkError::BadRequest(e.to_string()))?;
        let exchange = async {
            let response = self
                .http
                .request(request)
                .await
                .map_err(|e| SdkError::Unavailable(e.to_string()))?;
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| SdkError::Transport(e.to_string()))?
                .to_bytes();
            Ok::<_, SdkError>(RailResponse { status, body })
        };
        let response = tokio::time::timeout(Duration::from_secs(10), exchange)
            .await
            .map_err(|_| SdkError::Unavailable("no answer within 10s".into()))??;
        let fenced = response.status == StatusCode::CONFLICT
            && serde_json::from_slice::<serde_json::Value>(&response.body)
                .is_ok_and(|v| v["error"] == "fenced_out");
        if fenced {
            return Err(SdkError::FencedOut {
                account: account.to_string(),
                token,
                body: String::from_utf8_lossy(&response.body).into_owned(),
            });
        }
        Ok(response)
    }
}
