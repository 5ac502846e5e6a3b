//! The alerting rules (config/prometheus/railguard.rules.yml) and the Grafana dashboard
//! (config/grafana/railguard.json) against the real thing:
//!
//! - T-042's stale token, sent through a real `railguard serve` scraped by a real Prometheus
//!   that evaluates the repository's rules, fires `RailguardFencedOut` — which nothing fired
//!   before it, though the lease had expired, the key been taken over and the payment made;
//! - every metric an alert or a panel names is one that railguard exports (read from its
//!   `/metrics`), so that a typo cannot leave an alert silent forever;
//! - every alert has a severity, a runbook section in docs/operations.md and a promtool test,
//!   and its `runbook_url` leads to that section as the admin listener serves it (`/runbook`);
//! - railguard exports `railguard_build_info` and the process metrics.
//!
//! `promtool test rules` (scripts/test.sh) checks each rule's firing and sparing series.

use railguard_testkit as support;

use std::collections::BTreeSet;
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use http::StatusCode;
use railguard::sdk::SdkError;
use serde_json::Value;
use support::payment::grant;
use support::{Pg, Prometheus, Rail, Railguard, World, init_tracing};
use tokio::time::{Instant, sleep};

const RULES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/config/prometheus/railguard.rules.yml"
);
const RULE_TESTS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/config/prometheus/railguard.rules.test.yml"
);
const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/config/grafana/railguard.json");
const RUNBOOKS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md");

/// Series that Prometheus makes itself, not railguard.
const PROMETHEUS_OWN: &[&str] = &["up", "ALERTS"];
/// How long Prometheus may take to fire the alert after the stale request.
const FIRE_TIMEOUT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn a_stale_token_fires_the_fenced_out_alert_and_nothing_fires_before() {
    init_tracing();
    // Durable: a server without fsync is a risk an alert names (RailguardReplicationAtRisk).
    let pg = Pg::builder().durable(true).start().await.unwrap();
    let rail = Rail::start().await;
    let rg = Railguard::start_process(&pg.url(), &rail.url(), &[]).await;
    let prometheus = Prometheus::start("railguard", &[rg.admin], &[PathBuf::from(RULES)]).await;
    let instance = rg.admin.to_string();
    let lock = rg.lock_client();
    let proxy = railguard::sdk::RailClient::new(rg.proxy_url(""));

    // T-042: W1 acquires k and stalls past its lease; W2 takes k and pays.
    let ttl = Duration::from_millis(300);
    let w1 = grant(&lock, "k", "w1", ttl, Duration::ZERO).await;
    let w2 = grant(&lock, "k", "w2", Duration::from_secs(30), ttl * 10).await;
    assert!(w2.token().get() > w1.token().get());
    support::payment::paid_keyed(&proxy, &w2, "k", r#"{"amount":100}"#, "pay-w2").await;

    // Before W1 wakes: Prometheus has scraped all of that, and evaluated the rules on it
    // twice since, and the fenced-out rule's own increase is computable and zero. No alert is
    // pending or firing: an expired lease, a takeover and a payment are not incidents.
    eventually(
        &prometheus,
        "two scrapes of lock_fenced_out_total",
        || async {
            let samples = prometheus
                .query(&format!(
                    "count_over_time(lock_fenced_out_total{{instance=\"{instance}\"}}[1m])"
                ))
                .await
                .ok()?;
            (sample_value(samples.first()?)? >= 2.0).then_some(())
        },
    )
    .await;
    for _ in 0..2 {
        let last = last_evaluation(&prometheus, "RailguardFencedOut").await;
        eventually(&prometheus, "the next rule evaluation", || async {
            (last_evaluation(&prometheus, "RailguardFencedOut").await != last).then_some(())
        })
        .await;
    }
    let increase = prometheus
        .query(&format!(
            "increase(lock_fenced_out_total{{instance=\"{instance}\"}}[5m])"
        ))
        .await
        .unwrap();
    assert_eq!(increase.len(), 1, "{increase:?}");
    assert_eq!(sample_value(&increase[0]), Some(0.0), "{increase:?}");
    let before = prometheus.alerts().await;
    assert!(
        before.is_empty(),
        "alerts before the stale request: {before:#?}"
    );

    // W1 wakes up and submits with its stale token: fenced out.
    let stale = support::payment::pay_keyed(&proxy, &w1, "k", r#"{"amount":100}"#, "pay-w1").await;
    assert!(
        matches!(stale, Err(SdkError::FencedOut { .. })),
        "W1's stale submit must be fenced out: {stale:?}"
    );
    rail.assert_paid(1, "the rail saw W2's payment only");

    let sent = Instant::now();
    let alert =
        eventually(&prometheus, "RailguardFencedOut firing", || async {
            prometheus.alerts().await.into_iter().find(|a| {
                a["labels"]["alertname"] == "RailguardFencedOut" && a["state"] == "firing"
            })
        })
        .await;
    tracing::info!(after = ?sent.elapsed(), "RailguardFencedOut fired");
    let labels = &alert["labels"];
    assert_eq!(labels["severity"], "page", "{alert:#}");
    assert_eq!(labels["job"], "railguard", "{alert:#}");
    assert_eq!(labels["instance"], instance.as_str(), "{alert:#}");
    let annotations = &alert["annotations"];
    let runbook = format!("http://{instance}/runbook#railguardfencedout");
    assert_eq!(annotations["runbook_url"], runbook.as_str(), "{alert:#}");
    // The link works: the instance that fired serves the runbook, with the section's anchor.
    let (status, page) = support::Http::new()
        .get(runbook.split('#').next().unwrap())
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK, "{runbook}");
    assert!(page.contains(" id=\"railguardfencedout\""), "{runbook}");
    assert!(
        annotations["summary"]
            .as_str()
            .is_some_and(|s| s.contains(&instance)),
        "{alert:#}"
    );
    assert!(
        annotations["description"]
            .as_str()
            .is_some_and(|s| s.contains(&instance) && s.contains("lock_fenced_out_total")),
        "{alert:#}"
    );
    let firing: Vec<Value> = prometheus
        .alerts()
        .await
        .into_iter()
        .filter(|a| a["state"] == "firing")
        .map(|a| a["labels"]["alertname"].clone())
        .collect();
    assert_eq!(
        firing,
        ["RailguardFencedOut"],
        "only the fenced-out alert fires"
    );

    // The dashboard sees it too, and every one of its queries is PromQL this Prometheus runs.
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(DASHBOARD).unwrap())
        .expect("the dashboard is JSON");
    for (title, expr) in dashboard_queries(&dashboard) {
        let promql = expr
            .replace("$__rate_interval", "1m")
            .replace("$__range", "5m")
            .replace("$instance", ".+");
        let result = prometheus.query(&promql).await;
        let samples = result.unwrap_or_else(|e| panic!("panel {title:?}: {promql}\n{e}"));
        if title == "Fenced out (range)" {
            let value = samples.first().and_then(sample_value);
            assert!(value.is_some_and(|v| v > 0.0), "{title}: {samples:?}");
        }
    }
}

#[tokio::test]
async fn every_metric_the_rules_and_the_dashboard_name_is_one_railguard_exports() {
    let started = std::time::SystemTime::now();
    let (_pg, _rail, rg) = World::postgres_process(Rail::start().await, &[])
        .await
        .parts();
    let metrics = rg.metrics().await;
    // Sample names as exposed: a histogram's are its _bucket, _sum and _count.
    let exported: BTreeSet<String> = metrics
        .0
        .keys()
        .map(|k| k.split('{').next().unwrap().to_string())
        .collect();

    // Which railguard this is, and the process metrics of the `railguard serve` child.
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let build_info = format!(
        "railguard_build_info{{profile=\"{profile}\",version=\"{}\"}}",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(metrics.get(&build_info), 1.0);
    assert_eq!(
        metrics
            .0
            .keys()
            .filter(|k| k.starts_with("railguard_build_info"))
            .count(),
        1,
        "one build_info series, no other labels"
    );
    let since_epoch = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    let start_time = metrics.get("process_start_time_seconds");
    assert!(
        start_time >= since_epoch(started) - 2.0
            && start_time <= since_epoch(std::time::SystemTime::now()) + 1.0,
        "process_start_time_seconds {start_time}: not the railguard started by this test"
    );
    assert!(metrics.get("process_resident_memory_bytes") > 1e6);
    assert!(
        metrics.get("process_open_fds") >= 3.0 + 3.0,
        "stdio and three listeners"
    );
    // Whole seconds (the prometheus crate counts CPU time in whole seconds): present, not yet 1.
    assert!(metrics.get("process_cpu_seconds_total") >= 0.0);
    assert!(metrics.get("process_max_fds") >= metrics.get("process_open_fds"));
    let known = |name: &str| exported.contains(name) || PROMETHEUS_OWN.contains(&name);

    let rules = std::fs::read_to_string(RULES).unwrap();
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(DASHBOARD).unwrap())
        .expect("the dashboard is JSON");
    let mut queries: Vec<(String, String)> = yaml_values(&rules, "expr")
        .into_iter()
        .map(|e| ("rules".to_string(), e))
        .collect();
    queries.extend(dashboard_queries(&dashboard));
    let mut used = BTreeSet::new();
    let mut unknown = Vec::new();
    for (place, expr) in &queries {
        for name in metric_names(expr) {
            if !known(&name) {
                unknown.push(format!("{name} ({place}: {expr})"));
            }
            used.insert(name);
        }
    }
    assert!(
        unknown.is_empty(),
        "not exported by railguard:\n{}\nexported: {exported:?}",
        unknown.join("\n")
    );

    // The panels the dashboard must have, by the metrics they show.
    let dashboard_names: BTreeSet<String> = dashboard_queries(&dashboard)
        .iter()
        .flat_map(|(_, e)| metric_names(e))
        .collect();
    for name in [
        "railguard_requests_total",
        "lock_fenced_out_total",
        "railguard_would_have_fenced_total",
        "railguard_fence_check_duration_seconds_bucket",
        "railguard_upstream_duration_seconds_bucket",
        "railguard_fence_batch_size_bucket",
        "lock_grants_total",
        "lock_renewals_total",
        "lock_expiries_total",
        "lock_takeovers_total",
        "lock_waiters",
        "railguard_token_source_behind",
        "railguard_idempotency_outcomes_pending",
        "railguard_idempotency_outcomes_lost_total",
    ] {
        assert!(
            dashboard_names.contains(name),
            "no panel shows {name}: {dashboard_names:?}"
        );
    }
    // And the alerts watch what the issue asks for.
    for name in [
        "lock_fenced_out_total",
        "railguard_fencing_enforced",
        "railguard_fencing_proof_required",
        "railguard_would_have_fenced_total",
        "railguard_token_source_behind",
        "railguard_implausible_tokens_total",
        "railguard_requests_total",
        "up",
        "railguard_idempotency_outcomes_pending",
        "railguard_idempotency_outcomes_lost_total",
        "railguard_fence_check_duration_seconds_bucket",
        "railguard_upstream_duration_seconds_bucket",
    ] {
        assert!(used.contains(name), "no alert or panel uses {name}");
    }
}

#[test]
fn every_alert_has_a_severity_a_runbook_and_a_promtool_test() {
    let rules = std::fs::read_to_string(RULES).unwrap();
    let tests = std::fs::read_to_string(RULE_TESTS).unwrap();
    let runbooks = std::fs::read_to_string(RUNBOOKS).unwrap();
    let alerts = yaml_values(&rules, "alert");
    let severities = yaml_values(&rules, "severity");
    let runbook_urls = yaml_values(&rules, "runbook_url");
    assert!(alerts.len() >= 10, "{alerts:?}");
    assert_eq!(alerts.len(), severities.len(), "one severity per alert");
    assert_eq!(alerts.len(), runbook_urls.len(), "one runbook per alert");
    let tested: BTreeSet<String> = yaml_values(&tests, "alertname").into_iter().collect();
    let sections: BTreeSet<&str> = runbooks
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .collect();
    // The anchors of the page the admin listener serves at /runbook.
    let page = railguard::admin::runbook::html();
    let anchors: BTreeSet<&str> = page
        .split(" id=\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .collect();
    for ((alert, severity), url) in alerts.iter().zip(&severities).zip(&runbook_urls) {
        assert!(
            ["page", "ticket"].contains(&severity.as_str()),
            "{alert}: severity {severity}"
        );
        // GitHub's anchor of a `### Name` heading is the name in lower case; /runbook gives
        // each heading the same.
        let anchor = alert.to_lowercase();
        let expected = match alert.as_str() {
            // Nothing is scraped, so no railguard can serve it: the repository's file.
            "RailguardTargetMissing" => format!("docs/operations.md#{anchor}"),
            // A railguard that is up serves it; with none up, the repository's file.
            "RailguardDown" => format!(
                "{{{{ with query `up{{job=\"railguard\"}} == 1` | sortByLabel \"instance\" }}}}\
                 http://{{{{ (index . 0).Labels.instance }}}}/runbook{{{{ else }}}}\
                 docs/operations.md{{{{ end }}}}#{anchor}"
            ),
            // The instance that fired serves it.
            _ => format!("http://{{{{ $labels.instance }}}}/runbook#{anchor}"),
        };
        assert_eq!(url, &expected, "{alert}");
        assert!(
            sections.contains(alert.as_str()),
            "docs/operations.md has no section ### {alert}"
        );
        assert!(
            anchors.contains(anchor.as_str()),
            "/runbook has no anchor #{anchor} for {alert}"
        );
        assert!(tested.contains(alert), "no promtool test for {alert}");
    }
}

#[test]
fn metric_names_are_read_out_of_promql() {
    let names = |e: &str| metric_names(e).into_iter().collect::<Vec<_>>();
    assert_eq!(
        names(
            "histogram_quantile(0.99, sum by (instance, le) \
             (rate(railguard_upstream_duration_seconds_bucket{instance=~\"$instance\"}[$__rate_interval])))"
        ),
        ["railguard_upstream_duration_seconds_bucket"]
    );
    assert_eq!(
        names(
            "increase(lock_fenced_out_totl[5m]) > 0 or (lock_fenced_out_total > 0 unless \
             lock_fenced_out_total offset 5m)"
        ),
        ["lock_fenced_out_total", "lock_fenced_out_totl"]
    );
    assert_eq!(
        names(
            "sum(up{job=\"railguard\", instance=~\"a|b\"}) or vector(0) \
             / on(instance) group_left max without (backend) (lock_waiters) and absent(x_y)"
        ),
        ["lock_waiters", "up", "x_y"]
    );
}

/// Polls `check` every 200 ms until it yields, for at most [`FIRE_TIMEOUT`].
async fn eventually<T, F, Fut>(prometheus: &Prometheus, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + FIRE_TIMEOUT;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        if Instant::now() > deadline {
            let alerts = prometheus.alerts().await;
            panic!(
                "{what}: not within {FIRE_TIMEOUT:?}; alerts: {alerts:#?}\nPrometheus log:\n{}",
                prometheus.log()
            );
        }
        sleep(Duration::from_millis(200)).await;
    }
}

/// The rule's `lastEvaluation`, after checking that it is healthy.
async fn last_evaluation(prometheus: &Prometheus, alert: &str) -> String {
    let rules = prometheus.alerting_rules().await;
    let rule = rules
        .iter()
        .find(|r| r["name"] == alert)
        .unwrap_or_else(|| panic!("Prometheus did not load {alert}: {rules:#?}"));
    assert_eq!(rule["health"], "ok", "{rule:#}");
    rule["lastEvaluation"].as_str().unwrap_or_default().into()
}

/// The value of an instant vector's sample (`{"metric": …, "value": [time, "1"]}`).
fn sample_value(sample: &Value) -> Option<f64> {
    sample["value"][1].as_str()?.parse().ok()
}

/// Every PromQL query in the dashboard, with the title of its panel: panel targets (rows
/// included), annotation queries and the `query` variables.
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    fn panels(list: &Value, out: &mut Vec<(String, String)>) {
        for panel in list.as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or_default();
            for target in panel["targets"].as_array().into_iter().flatten() {
                let expr = target["expr"].as_str();
                out.push((title.into(), expr.expect("a target has an expr").into()));
            }
            panels(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    panels(&dashboard["panels"], &mut out);
    for annotation in dashboard["annotations"]["list"].as_array().unwrap() {
        if let Some(expr) = annotation["expr"].as_str() {
            out.push((format!("annotation {}", annotation["name"]), expr.into()));
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if variable["type"] == "query" {
            let query = variable["query"]["query"].as_str().expect("a query");
            // label_values(SELECTOR, LABEL): the selector is PromQL.
            let selector = query
                .strip_prefix("label_values(")
                .and_then(|q| q.rsplit_once(','))
                .map_or(query, |(selector, _)| selector);
            out.push((format!("variable {}", variable["name"]), selector.into()));
        }
    }
    assert!(
        !out.is_empty(),
        "the dashboard has no queries: {dashboard:#}"
    );
    out
}

/// The metric names a PromQL expression selects: identifiers that are not functions,
/// keywords, label names (in `{…}`, `by (…)`, `on (…)`, …), durations or Grafana variables.
fn metric_names(promql: &str) -> BTreeSet<String> {
    const AGGREGATIONS: &[&str] = &[
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    const LABEL_LISTS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    const KEYWORDS: &[&str] = &[
        "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan",
    ];
    let chars: Vec<char> = promql.chars().collect();
    let word_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = BTreeSet::new();
    let mut label_list_next = false;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if matches!(c, '"' | '\'' | '`') {
            i = skip_string(&chars, i);
        } else if c == '{' {
            i = skip_to(&chars, i, '}');
        } else if c == '[' {
            i = skip_to(&chars, i, ']');
        } else if c == '(' && label_list_next {
            i = skip_to(&chars, i, ')');
            label_list_next = false;
        } else if c == '$' || c.is_ascii_digit() || c == '.' {
            // A Grafana variable, a number or a duration (`5m`, `1e3`).
            i += 1;
            while i < chars.len() && (word_char(chars[i]) || chars[i] == '.') {
                i += 1;
            }
        } else if word_char(c) {
            let start = i;
            while i < chars.len() && word_char(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = chars[i..].iter().find(|c| !c.is_whitespace());
            if LABEL_LISTS.contains(&word.as_str()) {
                label_list_next = next == Some(&'(');
            } else if !(AGGREGATIONS.contains(&word.as_str())
                || KEYWORDS.contains(&word.as_str())
                || next == Some(&'('))
            {
                names.insert(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// The index after the string literal that starts at `start`.
fn skip_string(chars: &[char], start: usize) -> usize {
    let quote = chars[start];
    let mut i = start + 1;
    while i < chars.len() && chars[i] != quote {
        i += if chars[i] == '\\' && quote != '`' {
            2
        } else {
            1
        };
    }
    i + 1
}

/// The index after the `close` that ends the bracket at `start`, past any strings inside.
fn skip_to(chars: &[char], start: usize, close: char) -> usize {
    let mut i = start + 1;
    while i < chars.len() && chars[i] != close {
        i = if matches!(chars[i], '"' | '\'' | '`') {
            skip_string(chars, i)
        } else {
            i + 1
        };
    }
    i + 1
}

/// The values of `key:` in a YAML file: inline scalars unquoted, block scalars (`|`, `>-`)
/// joined into one line. Enough for the rules and their tests, which keep to that.
fn yaml_values(yaml: &str, key: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let indent = |line: &str| line.len() - line.trim_start().len();
    let mut values = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let trimmed = trimmed.strip_prefix("- ").unwrap_or(trimmed);
        let Some(rest) = trimmed.strip_prefix(key).and_then(|r| r.strip_prefix(':')) else {
            continue;
        };
        let rest = rest.trim();
        if rest.starts_with('|') || rest.starts_with('>') {
            let block: Vec<&str> = lines[n + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || indent(l) > indent(line))
                .map(|l| l.trim())
                .collect();
            values.push(block.join(" ").trim().to_string());
        } else {
            let unquoted = rest
                .strip_prefix('"')
                .and_then(|r| r.strip_suffix('"'))
                .or_else(|| rest.strip_prefix('\'').and_then(|r| r.strip_suffix('\'')))
                .unwrap_or(rest);
            values.push(unquoted.to_string());
        }
    }
    values
}
