//! Payments as tests send them: [`pay`], as a worker sends one through the SDK (its id as the
//! body and as the idempotency key, fenced by its grant), and [`Payment`], one over HTTP whose
//! every header a test chooses.

use http::StatusCode;
use railguard_sdk::{LockHandle, RailClient, RailResponse, SdkError};

/// POSTs payment `id` on `account` under `grant`, keyed by `id`; the rail's status.
pub async fn pay(
    proxy: &RailClient,
    grant: &LockHandle,
    account: &str,
    id: &str,
) -> Result<StatusCode, SdkError> {
    pay_keyed(proxy, grant, account, &format!("{{\"id\":\"{id}\"}}"), id)
        .await
        .map(|r| r.status)
}

/// POSTs `body` to `/payments` on `account` under `grant`, keyed by `key`: the answer.
pub async fn pay_keyed(
    proxy: &RailClient,
    grant: &LockHandle,
    account: &str,
    body: &str,
    key: &str,
) -> Result<RailResponse, SdkError> {
    proxy
        .post(
            grant,
            account,
            "/payments",
            body.to_string().into(),
            Some(key),
        )
        .await
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

/// A payment through a railguard's proxy, as a test sends it over HTTP: `Fencing-Token` and
/// `Fencing-Account` always, the grant's proof unless the test says otherwise, an idempotency
/// key, a body and more headers if the test gives them, and the status it must get.
///
/// ```ignore
/// rg.payment("acct-1", 7).key("k1").expect(StatusCode::OK).send().await;
/// let stale = rg.payment("acct-1", 6).without_proof().send().await;
/// ```
#[must_use = "a payment is sent by `send` or `spawn`"]
pub struct Payment {
    url: String,
    http: crate::Http,
    account: String,
    token: String,
    proof: Proof,
    key: Option<String>,
    body: String,
    headers: Vec<(String, String)>,
    expect: Option<StatusCode>,
}

/// Which `Fencing-Proof` a [`Payment`] carries.
enum Proof {
    /// The grant's, as the lock service issued it (none on a database the test cannot read).
    OfTheGrant(Option<String>),
    Given(String),
    Without,
}

/// The body of a payment whose body the test does not choose.
pub const BODY: &str = r#"{"amount":1}"#;

impl Payment {
    /// Payment of `token` on `account` (the default lock key mapping) through `rg`.
    pub fn new(rg: &crate::Railguard, account: &str, token: i64) -> Payment {
        let proof = rg.proof_if_known(account, token);
        Payment {
            url: rg.proxy_url("/payments"),
            http: crate::Http::new(),
            account: account.to_string(),
            token: token.to_string(),
            proof: Proof::OfTheGrant(proof),
            key: None,
            body: BODY.to_string(),
            headers: Vec::new(),
            expect: None,
        }
    }

    /// A `Fencing-Token` value that need not be a valid token (`"abc"`, `"-1"`): no proof.
    pub fn raw_token(mut self, token: &str) -> Payment {
        self.token = token.to_string();
        self.proof = Proof::Without;
        self
    }

    /// With `Idempotency-Key: key`.
    pub fn key(mut self, key: &str) -> Payment {
        self.key = Some(key.to_string());
        self
    }

    /// With `Fencing-Proof: proof` instead of the grant's.
    pub fn proof(mut self, proof: &str) -> Payment {
        self.proof = Proof::Given(proof.to_string());
        self
    }

    /// With `Fencing-Proof: proof` if there is one, else none: a grant as the lock API
    /// answered it, proof or not.
    pub fn with_proof(self, proof: Option<&str>) -> Payment {
        match proof {
            Some(proof) => self.proof(proof),
            None => self.without_proof(),
        }
    }

    /// With no `Fencing-Proof`.
    pub fn without_proof(mut self) -> Payment {
        self.proof = Proof::Without;
        self
    }

    /// With this body instead of [`BODY`].
    pub fn body(mut self, body: &str) -> Payment {
        self.body = body.to_string();
        self
    }

    /// With one more header (after the fencing headers and the key).
    pub fn header(mut self, name: &str, value: &str) -> Payment {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// Sent by `http` (an HTTP/2 client, say) instead of a fresh HTTP/1.1 one; the proof is
    /// still this payment's.
    pub fn over(mut self, http: &crate::Http) -> Payment {
        self.http = http.clone().with_proofs(None);
        self
    }

    /// Fails the test, naming the payment and showing the body, unless the proxy answers
    /// `status`.
    pub fn expect(mut self, status: StatusCode) -> Payment {
        self.expect = Some(status);
        self
    }

    /// Sends it and reads the whole reply.
    pub async fn send(self) -> crate::Reply {
        let mut headers: Vec<(&str, &str)> = vec![
            ("Fencing-Token", &self.token),
            ("Fencing-Account", &self.account),
        ];
        match &self.proof {
            Proof::OfTheGrant(Some(proof)) | Proof::Given(proof) => {
                headers.push(("Fencing-Proof", proof))
            }
            Proof::OfTheGrant(None) | Proof::Without => {}
        }
        if let Some(key) = &self.key {
            headers.push(("Idempotency-Key", key));
        }
        headers.extend(self.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())));
        let reply = self.http.pay(&self.url, &headers, &self.body).await;
        if let Some(status) = self.expect {
            assert_eq!(
                reply.status, status,
                "payment of token {} on {} (key {:?}): {}",
                self.token, self.account, self.key, reply.body
            );
        }
        reply
    }

    /// Sends it in a task of its own: a payment the test lets travel while it goes on.
    pub fn spawn(self) -> tokio::task::JoinHandle<crate::Reply> {
        tokio::spawn(self.send())
    }
}

/// [`pay`], which must be paid (201).
pub async fn paid(proxy: &RailClient, grant: &LockHandle, account: &str, id: &str) {
    let status = pay(proxy, grant, account, id).await;
    assert!(
        matches!(status, Ok(StatusCode::CREATED)),
        "payment {id} on {account} under token {}: {status:?}",
        grant.token().get()
    );
}

/// POSTs `body` to `/payments` on `account` under `grant`, keyed by `key`, which the rail must
/// answer `201 Created`.
pub async fn paid_keyed(
    proxy: &RailClient,
    grant: &LockHandle,
    account: &str,
    body: &str,
    key: &str,
) {
    let token = grant.token().get();
    let answer = pay_keyed(proxy, grant, account, body, key)
        .await
        .unwrap_or_else(|e| panic!("payment {key} on {account} under token {token}: {e:?}"));
    assert_eq!(
        answer.status,
        StatusCode::CREATED,
        "payment {key} on {account} under token {token}: {:?}",
        answer.body
    );
}

/// [`pay`], which the proxy must refuse as fenced out (`SdkError::FencedOut`).
pub async fn fenced_out(proxy: &RailClient, grant: &LockHandle, account: &str, id: &str) {
    let refused = pay(proxy, grant, account, id).await;
    assert!(
        matches!(refused, Err(SdkError::FencedOut { .. })),
        "payment {id} on {account} under token {}: {refused:?}",
        grant.token().get()
    );
}

/// A grant of lock key `key` for `holder` (lease `ttl`, waiting up to `wait`), which must be
/// granted.
pub async fn grant(
    lock: &railguard_sdk::LockClient,
    key: &str,
    holder: &str,
    ttl: std::time::Duration,
    wait: std::time::Duration,
) -> LockHandle {
    lock.acquire(key, holder, ttl, wait)
        .await
        .unwrap_or_else(|e| panic!("{holder} is granted {key}: {e:?}"))
}
