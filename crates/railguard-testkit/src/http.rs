//! An HTTP client over real sockets that speaks like a worker: payments carry the grant proof a
//! worker's grant would.

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use railguard::proof::ProofKey;

use crate::Railguard;

/// An HTTP/1.1 client over real sockets.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    /// When set, [`Http::pay`] adds the proof of the token it sends, as the lock service
    /// would have issued it.
    proofs: Option<Arc<ProofKey>>,
}

/// A response, read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: String,
}

impl Reply {
    /// Fails the test, showing the body, unless the status is `status`.
    #[track_caller]
    pub fn assert_status(&self, status: StatusCode) {
        assert_eq!(self.status, status, "{}", self.body);
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

impl Default for Http {
    fn default() -> Self {
        Self::new()
    }
}

impl Http {
    pub fn new() -> Http {
        Http {
            client: Client::builder(TokioExecutor::new()).build_http(),
            proofs: None,
        }
    }

    pub fn http2() -> Http {
        Http {
            client: Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build_http(),
            proofs: None,
        }
    }

    pub fn with_proofs(mut self, proofs: Option<Arc<ProofKey>>) -> Http {
        self.proofs = proofs;
        self
    }

    /// The proof for a payment's headers: one valid token and one account, and no proof yet.
    fn proof_for(&self, headers: &[(&str, &str)]) -> Option<String> {
        let proofs = self.proofs.as_ref()?;
        let named = |name: &str| -> Vec<&str> {
            headers
                .iter()
                .filter(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| *v)
                .collect()
        };
        if !named("fencing-proof").is_empty() {
            return None;
        }
        let (tokens, accounts) = (named("fencing-token"), named("fencing-account"));
        match (tokens.as_slice(), accounts.as_slice()) {
            ([token], [account]) => {
                let token = railguard::token::FencingToken::parse(token).ok()?;
                Some(proofs.sign(account, token))
            }
            _ => None,
        }
    }

    pub async fn get(&self, url: &str) -> Result<(StatusCode, String), String> {
        let request = Request::get(url).body(Full::new(Bytes::new())).unwrap();
        let reply = self.send(request).await?;
        Ok((reply.status, reply.body))
    }

    pub async fn send(&self, request: Request<Full<Bytes>>) -> Result<Reply, String> {
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| format!("{e:?}"))?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }

    /// POSTs a payment with the given headers (name, value), repeated names allowed.
    ///
    /// With proofs (see [`Railguard::http`]) a grant proof is added for the token and account.
    pub async fn pay(&self, url: &str, headers: &[(&str, &str)], body: &str) -> Reply {
        let mut request = Request::builder().method(Method::POST).uri(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        if let Some(proof) = self.proof_for(headers) {
            request = request.header("Fencing-Proof", proof);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        self.send(request).await.expect("proxy answers")
    }

    /// POSTs with `Fencing-Token: token` and `Fencing-Account: account`.
    /// POSTs with `Fencing-Token: token` and `Fencing-Account: account`, and the proof of
    /// that grant.
    pub async fn pay_with(&self, rg: &Railguard, token: i64, account: &str) -> Reply {
        let proof = rg.proof(account, token);
        let token = token.to_string();
        self.pay(
            &rg.proxy_url("/payments"),
            &[
                ("Fencing-Token", &token),
                ("Fencing-Account", account),
                ("Fencing-Proof", &proof),
            ],
            &format!("{{\"account\":\"{account}\",\"amount\":100}}"),
        )
        .await
    }
}
