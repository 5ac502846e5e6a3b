//! The scenario the demo plays — W1 stalls, W2 takes over and pays, W1 wakes and is fenced
//! out — what it observes, and the checks its verdict rests on.

use super::*;

/// T-042 itself, against a running railguard.
pub(super) struct Scenario<'a> {
    pub(super) say: &'a Narrator,
    pub(super) http: &'a HttpGet,
    pub(super) rail: &'a RailSim,
    pub(super) addrs: &'a Addrs,
    pub(super) lock_key: &'a str,
    pub(super) ttl: Duration,
}

/// What happened, for the checks.
pub(super) struct Observed {
    t1: i64,
    t2: i64,
    w2_status: StatusCode,
    stale: Result<StatusCode, SdkError>,
    ledger: Vec<LedgerEntry>,
    fenced_before: Option<f64>,
    fenced_after: Option<f64>,
}

impl Scenario<'_> {
    pub(super) async fn play(&self) -> Result<Verdict, DemoError> {
        let say = self.say;
        let key = self.lock_key;
        let locks = LockClient::new(format!("http://{}", self.addrs.lock));
        let proxy = RailClient::new(format!("http://{}", self.addrs.proxy));
        let sdk = |step| move |source| DemoError::Sdk { step, source };
        let fenced_before = self.fenced_out_total().await?;

        let w1 = locks
            .acquire(key, "W1", self.ttl, Duration::ZERO)
            .await
            .map_err(sdk("W1's acquire"))?;
        let t1 = w1.token().get();
        say.line(format_args!(
            "W1 acquires {key} → token {t1} (lease {})",
            secs(w1.ttl())
        ));
        say.line("W1 stalls (a long GC pause, a SIGSTOP): it stops renewing its lease");

        say.line(format_args!(
            "W2 asks for {key}, waiting up to {}: W1 still holds it",
            secs(W2_WAIT)
        ));
        let expiry = async {
            tokio::time::sleep_until(w1.lease_floor()).await;
            say.line(format_args!(
                "W1's lease expires: {} without a renewal; the lock service may grant {key} again",
                secs(w1.ttl())
            ));
        };
        let (w2, ()) = tokio::join!(locks.acquire(key, "W2", W2_TTL, W2_WAIT), expiry);
        let w2 = w2.map_err(sdk("W2's acquire"))?;
        let t2 = w2.token().get();
        say.line(format_args!(
            "W2 acquires {key} → token {t2} (a newer grant: {t2} > {t1})"
        ));

        let paid = proxy
            .post(
                &w2,
                ACCOUNT,
                "/payments",
                Bytes::from_static(b"{\"amount\":100,\"to\":\"merchant-1\"}"),
                Some(W2_PAYMENT),
            )
            .await
            .map_err(sdk("W2's payment"))?;
        say.line(format_args!(
            "W2 pays 100 on {ACCOUNT} through the proxy (Fencing-Token {t2}, Idempotency-Key \
             {W2_PAYMENT}) → {} {}",
            paid.status,
            String::from_utf8_lossy(&paid.body).trim()
        ));
        match self
            .rail
            .ledger()
            .iter()
            .find(|entry| entry.idempotency_key.as_deref() == Some(W2_PAYMENT))
        {
            Some(entry) => say.line(format_args!(
                "the rail records it as payment {} (token seen: {}); the proxy raised {ACCOUNT}'s \
                 high-water mark to {t2}",
                entry.seq,
                entry.token.as_deref().unwrap_or("none")
            )),
            None => say.line("the rail has no record of W2's payment"),
        }

        say.line(format_args!(
            "W1 wakes up, unaware that its lease expired, and submits its payment with its own \
             handle (Fencing-Token {t1}, Idempotency-Key {W1_PAYMENT})"
        ));
        let stale = self.stale_submit(&proxy, &w1).await;

        match locks.release(w2).await {
            Ok(()) => say.line(format_args!("W2 releases {key}")),
            Err(e) => say.line(format_args!("W2's release failed: {e}")),
        }

        let ledger = self.rail.ledger();
        print_ledger(&ledger);
        let metrics = self.metrics_text().await?;
        print_metrics(&metrics, self.addrs.admin);

        let observed = Observed {
            t1,
            t2,
            w2_status: paid.status,
            stale,
            ledger,
            fenced_before,
            fenced_after: metric(&metrics, FENCED_OUT),
        };
        Ok(check(&observed))
    }

    /// W1's submit with its own handle; narrates the answer.
    async fn stale_submit(
        &self,
        proxy: &RailClient,
        w1: &LockHandle,
    ) -> Result<StatusCode, SdkError> {
        let answer = proxy
            .post(
                w1,
                ACCOUNT,
                "/payments",
                Bytes::from_static(b"{\"amount\":100,\"to\":\"merchant-1\"}"),
                Some(W1_PAYMENT),
            )
            .await;
        match &answer {
            Err(SdkError::FencedOut {
                account,
                token,
                body,
            }) => {
                self.say.line(format_args!(
                    "→ 409 FencedOut: the proxy refused token {token} on {account}; the rail \
                     never saw it"
                ));
                self.say.line(format_args!("  409 body: {}", body.trim()));
            }
            Err(e) => self.say.line(format_args!("→ {e}")),
            Ok(response) => self.say.line(format_args!(
                "→ {} {}  (NOT fenced out)",
                response.status,
                String::from_utf8_lossy(&response.body).trim()
            )),
        }
        answer.map(|response| response.status)
    }

    async fn metrics_text(&self) -> Result<String, DemoError> {
        let url = format!("http://{}/metrics", self.addrs.admin);
        match self.http.get(&url, Duration::from_secs(5)).await {
            Ok((StatusCode::OK, text)) => Ok(text),
            Ok((status, body)) => Err(DemoError::Http {
                url,
                message: format!("{status}: {}", body.trim()),
            }),
            Err(message) => Err(DemoError::Http { url, message }),
        }
    }

    async fn fenced_out_total(&self) -> Result<Option<f64>, DemoError> {
        Ok(metric(&self.metrics_text().await?, FENCED_OUT))
    }
}

/// Compares what happened with T-042's expected outcome; prints each check.
pub(super) fn check(o: &Observed) -> Verdict {
    let mut failed = Vec::new();
    let mut check = |ok: bool, what: String, otherwise: String| {
        if ok {
            println!("  ok      {what}");
        } else {
            println!("  FAILED  {what}: {otherwise}");
            failed.push(format!("{what}: {otherwise}"));
        }
    };
    println!("checks:");
    check(
        o.t2 > o.t1,
        format!("W2's token is above W1's ({} > {})", o.t2, o.t1),
        "it is not".into(),
    );
    check(
        o.w2_status.is_success(),
        "W2's payment was forwarded and accepted".into(),
        format!("the proxy answered {}", o.w2_status),
    );
    let fenced = match &o.stale {
        Err(SdkError::FencedOut {
            account,
            token,
            body,
        }) if account == ACCOUNT && *token == o.t1 => Ok(body),
        Err(e) => Err(format!("it got {e}")),
        Ok(status) => Err(format!("it got {status}")),
    };
    check(
        fenced.is_ok(),
        format!("W1's stale submit (token {}) was fenced out", o.t1),
        fenced.as_ref().err().cloned().unwrap_or_default(),
    );
    if let Ok(body) = fenced {
        let names = names_account_and_token(body, o.t1);
        let reveals = reveals_mark(body, o.t2);
        check(
            names && !reveals,
            "the 409 names the account and the presented token, and not the mark".into(),
            format!("body {body}"),
        );
    }
    let ledger: Vec<String> = o.ledger.iter().map(ledger_line).collect();
    let only_w2 = matches!(o.ledger.as_slice(), [entry]
        if entry.account.as_deref() == Some(ACCOUNT)
            && entry.token.as_deref() == Some(o.t2.to_string().as_str())
            && entry.idempotency_key.as_deref() == Some(W2_PAYMENT));
    check(
        only_w2,
        format!("the rail holds exactly W2's payment (token {})", o.t2),
        format!("its ledger: [{}]", ledger.join("; ")),
    );
    let rose = match (o.fenced_before, o.fenced_after) {
        (Some(before), Some(after)) => after - before,
        _ => f64::NAN,
    };
    check(
        rose == 1.0,
        format!("{FENCED_OUT} rose by 1"),
        format!(
            "it went from {} to {}",
            show(o.fenced_before),
            show(o.fenced_after)
        ),
    );
    if failed.is_empty() {
        println!("T-042 holds: the stalled survivor was fenced out and the rail paid once.");
        Verdict::Passed
    } else {
        println!("T-042 FAILED: {} check(s) did not hold.", failed.len());
        Verdict::Failed(failed)
    }
}

pub(super) fn show(value: Option<f64>) -> String {
    value.map_or_else(|| "(absent)".into(), |v| v.to_string())
}

/// Whether the 409 body is `fenced_out` for [`ACCOUNT`] and `token`.
pub(super) fn names_account_and_token(body: &str, token: i64) -> bool {
    serde_json::from_str::<serde_json::Value>(body)
        .is_ok_and(|v| v["error"] == "fenced_out" && v["account"] == ACCOUNT && v["token"] == token)
}

/// Whether any field of the 409 body is the mark, as a number or a string, or a message
/// mentions it.
pub(super) fn reveals_mark(body: &str, mark: i64) -> bool {
    let Ok(serde_json::Value::Object(fields)) = serde_json::from_str(body) else {
        return false;
    };
    let text = mark.to_string();
    let spoken = format!(" {text}");
    fields.values().any(|value| {
        *value == mark
            || value
                .as_str()
                .is_some_and(|s| s == text || s.contains(&spoken))
    })
}

pub(super) fn ledger_line(entry: &LedgerEntry) -> String {
    let or_none = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    format!(
        "seq {}  account {}  token {}  idempotency-key {}",
        entry.seq,
        or_none(&entry.account),
        or_none(&entry.token),
        or_none(&entry.idempotency_key)
    )
}

pub(super) fn print_ledger(ledger: &[LedgerEntry]) {
    println!(
        "rail ledger ({} entr{}):",
        ledger.len(),
        if ledger.len() == 1 { "y" } else { "ies" }
    );
    for entry in ledger {
        println!("  {}", ledger_line(entry));
    }
}

/// The samples of [`SHOWN_METRICS`]; request outcomes that never happened are left out.
pub(super) fn print_metrics(text: &str, admin: SocketAddr) {
    println!("metrics (http://{admin}/metrics):");
    for (series, value) in samples(text) {
        let name = series.split('{').next().unwrap_or(series);
        if !SHOWN_METRICS.contains(&name) {
            continue;
        }
        if name == "railguard_requests_total" && value == 0.0 {
            continue;
        }
        println!("  {series} {value}");
    }
}

/// `(series, value)` of every sample line of a Prometheus text exposition.
pub(super) fn samples(text: &str) -> impl Iterator<Item = (&str, f64)> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.trim(), value.trim().parse().ok()?))
        })
}

/// The value of the unlabelled series `name`.
pub(super) fn metric(text: &str, name: &str) -> Option<f64> {
    samples(text)
        .find(|(series, _)| *series == name)
        .map(|(_, v)| v)
}

pub(super) fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

#[cfg(test)]
mod tests;
