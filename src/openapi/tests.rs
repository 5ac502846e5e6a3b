use std::collections::BTreeSet;

use http::{HeaderMap, Method};
use http_body_util::BodyExt;
use serde_json::Value;

use super::*;
use crate::lock::api::{ApiError, Operation};
use crate::proxy::error::{examples, rejection};

/// The parsed document, and how to look things up in it.
struct Doc(Value);

/// What one alternative of a schema allows: its properties, which are required, and the
/// values its `error` and `outcome` may take (`None`: not narrowed).
#[derive(Debug, Clone, Default)]
struct Shape {
    properties: BTreeSet<String>,
    required: BTreeSet<String>,
    errors: Option<BTreeSet<String>>,
    outcomes: Option<BTreeSet<String>>,
    closed: bool,
}

fn narrow(a: &Option<BTreeSet<String>>, b: &Option<BTreeSet<String>>) -> Option<BTreeSet<String>> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.intersection(b).cloned().collect()),
        (Some(x), None) | (None, Some(x)) => Some(x.clone()),
        (None, None) => None,
    }
}

impl Shape {
    fn and(&self, other: &Shape) -> Shape {
        Shape {
            properties: self.properties.union(&other.properties).cloned().collect(),
            required: self.required.union(&other.required).cloned().collect(),
            errors: narrow(&self.errors, &other.errors),
            outcomes: narrow(&self.outcomes, &other.outcomes),
            closed: self.closed || other.closed,
        }
    }
}

/// A rendered response: status, headers and body (JSON, or the text as a JSON string).
struct Rendered {
    status: StatusCode,
    headers: HeaderMap,
    body: Value,
}

async fn render(response: Response<ResponseBody>) -> Rendered {
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.expect("body").to_bytes();
    let json = parts.headers[header::CONTENT_TYPE] == "application/json";
    let body = if json {
        serde_json::from_slice(&bytes).expect("a JSON body")
    } else {
        Value::String(String::from_utf8_lossy(&bytes).into_owned())
    };
    Rendered {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

impl Doc {
    fn load() -> Self {
        Doc(serde_yaml::from_str(DOCUMENT)
            .expect("docs/openapi.yaml is YAML whose keys are strings"))
    }

    fn at(&self, reference: &str) -> Option<&Value> {
        self.0.pointer(reference.strip_prefix('#')?)
    }

    /// `value`, with its `$ref`s followed.
    fn resolve<'a>(&'a self, mut value: &'a Value) -> &'a Value {
        while let Some(reference) = value.get("$ref").and_then(Value::as_str) {
            value = self
                .at(reference)
                .unwrap_or_else(|| panic!("unresolved $ref {reference}"));
        }
        value
    }

    fn paths(&self) -> &serde_json::Map<String, Value> {
        self.0["paths"].as_object().expect("paths")
    }

    /// Every operation: (path, method, operation), for the paths tagged `tag`.
    fn operations(&self, tag: &str) -> Vec<(&str, Method, &Value)> {
        let mut found = Vec::new();
        for (path, item) in self.paths() {
            for method in METHODS {
                let Some(operation) = item.get(method) else {
                    continue;
                };
                let tagged = operation["tags"]
                    .as_array()
                    .is_some_and(|tags| tags.iter().any(|t| t == tag));
                if tagged {
                    let method = Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
                    found.push((path.as_str(), method, operation));
                }
            }
        }
        found
    }

    fn operation(&self, tag: &str, path: &str, method: &Method) -> Option<&Value> {
        self.operations(tag)
            .into_iter()
            .find(|(p, m, _)| *p == path && m == method)
            .map(|(_, _, operation)| operation)
    }

    /// The responses of requests that match no operation on the listener `tag`.
    fn unrouted(&self, tag: &str) -> &Value {
        &self.0["x-railguard-unrouted"][tag]["responses"]
    }

    /// The alternatives a schema allows (`oneOf`/`anyOf` branch, `allOf` merges).
    fn shapes(&self, schema: &Value) -> Vec<Shape> {
        let schema = self.resolve(schema);
        let values = |name: &str| -> Option<BTreeSet<String>> {
            let property = self.resolve(schema.get("properties")?.get(name)?);
            if let Some(one) = property.get("const") {
                return Some([one.as_str()?.to_string()].into());
            }
            let all = property.get("enum")?.as_array()?;
            Some(
                all.iter()
                    .filter_map(|v| Some(v.as_str()?.to_string()))
                    .collect(),
            )
        };
        let own = Shape {
            properties: schema
                .get("properties")
                .and_then(Value::as_object)
                .map(|p| p.keys().cloned().collect())
                .unwrap_or_default(),
            required: schema
                .get("required")
                .and_then(Value::as_array)
                .map(|r| {
                    r.iter()
                        .filter_map(|v| Some(v.as_str()?.to_string()))
                        .collect()
                })
                .unwrap_or_default(),
            errors: values("error"),
            outcomes: values("outcome"),
            closed: schema.get("additionalProperties") == Some(&Value::Bool(false))
                || schema.get("unevaluatedProperties") == Some(&Value::Bool(false)),
        };
        let mut shapes = vec![own];
        for part in schema["allOf"].as_array().into_iter().flatten() {
            let parts = self.shapes(part);
            shapes = shapes
                .iter()
                .flat_map(|s| parts.iter().map(move |p| s.and(p)))
                .collect();
        }
        for keyword in ["oneOf", "anyOf"] {
            if let Some(branches) = schema[keyword].as_array() {
                let branches: Vec<Shape> = branches.iter().flat_map(|b| self.shapes(b)).collect();
                shapes = shapes
                    .iter()
                    .flat_map(|s| branches.iter().map(move |b| s.and(b)))
                    .collect();
            }
        }
        shapes
    }

    /// Why `rendered` is not described by `responses` (an operation's, or an unrouted
    /// listener's), if it is not.
    fn undocumented(&self, responses: &Value, rendered: &Rendered) -> Option<String> {
        let status = rendered.status.as_str();
        let Some(response) = responses.get(status) else {
            return Some(format!("no {status} response"));
        };
        let response = self.resolve(response);
        for name in [header::RETRY_AFTER, header::ALLOW] {
            if rendered.headers.contains_key(&name) {
                let documented = response["headers"]
                    .as_object()
                    .is_some_and(|h| h.keys().any(|k| k.eq_ignore_ascii_case(name.as_str())));
                if !documented {
                    return Some(format!("{status} does not document its {name} header"));
                }
            }
        }
        let content_type = rendered.headers[header::CONTENT_TYPE].to_str().unwrap();
        let Some(media) = response["content"].get(content_type) else {
            return Some(format!("{status} has no {content_type} content"));
        };
        // A text body (admin) has nothing more to check.
        let body = rendered.body.as_object()?;
        let code = body["error"].as_str().expect("an error body has a code");
        let outcome = body
            .get("outcome")
            .map(|o| o.as_str().expect("a string outcome"));
        let keys: BTreeSet<String> = body.keys().cloned().collect();
        let shapes = self.shapes(&media["schema"]);
        let fits = shapes.iter().any(|shape| {
            shape.errors.as_ref().is_some_and(|e| e.contains(code))
                && outcome.is_none_or(|o| shape.outcomes.as_ref().is_some_and(|v| v.contains(o)))
                && keys.is_subset(&shape.properties)
                && shape.required.is_subset(&keys)
        });
        (!fits).then(|| {
            format!(
                "{status} documents no body like {} (schemas allow {shapes:?})",
                rendered.body
            )
        })
    }
}

/// Every `$ref` in `value`.
fn refs<'a>(value: &'a Value, found: &mut Vec<&'a str>) {
    match value {
        Value::Object(map) => {
            if let Some(reference) = map.get("$ref").and_then(Value::as_str) {
                found.push(reference);
            }
            map.values().for_each(|v| refs(v, found));
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, found)),
        _ => {}
    }
}

#[test]
fn the_document_is_an_openapi_3_1_document_whose_refs_all_resolve() {
    let doc = Doc::load();
    assert_eq!(doc.0["openapi"], "3.1.0");
    assert!(doc.0["info"]["title"].is_string() && doc.0["info"]["version"].is_string());
    let tags: BTreeSet<&str> = doc.0["tags"]
        .as_array()
        .expect("tags")
        .iter()
        .map(|t| t["name"].as_str().expect("a tag's name"))
        .collect();
    assert_eq!(tags, ["admin", "lock", "proxy"].into());
    let servers: BTreeSet<&str> = doc.0["servers"]
        .as_array()
        .expect("servers")
        .iter()
        .map(|s| s["url"].as_str().expect("a server's url"))
        .collect();
    assert_eq!(servers.len(), 3, "the lock, proxy and admin listeners");

    let mut all = Vec::new();
    refs(&doc.0, &mut all);
    assert!(!all.is_empty());
    for reference in all {
        assert!(reference.starts_with("#/"), "only local refs: {reference}");
        assert!(
            doc.at(reference).is_some_and(Value::is_object),
            "unresolved $ref {reference}"
        );
    }

    let mut operation_ids = BTreeSet::new();
    for (path, item) in doc.paths() {
        for server in item["servers"]
            .as_array()
            .expect("each path names its listener")
        {
            let url = server["url"].as_str().unwrap();
            assert!(
                servers.contains(url),
                "{path}: server {url} is not a listener"
            );
        }
        let mut parameters: Vec<&Value> = item["parameters"]
            .as_array()
            .into_iter()
            .flatten()
            .collect();
        let mut operations = 0;
        for method in METHODS {
            let Some(operation) = item.get(method) else {
                continue;
            };
            operations += 1;
            parameters.extend(operation["parameters"].as_array().into_iter().flatten());
            let id = operation["operationId"].as_str().expect("an operationId");
            assert!(operation_ids.insert(id), "operationId {id} twice");
            let op_tags = operation["tags"].as_array().expect("tags");
            assert_eq!(op_tags.len(), 1, "{id}: one tag");
            assert!(
                tags.contains(op_tags[0].as_str().unwrap()),
                "{id}: undeclared tag"
            );
            let responses = operation["responses"].as_object().expect("responses");
            assert!(!responses.is_empty(), "{id}");
            for (status, response) in responses {
                let valid = status == "default"
                    || (status.len() == 3
                        && status.parse::<u16>().is_ok_and(|s| (100..600).contains(&s)));
                assert!(valid, "{id}: response key {status}");
                assert!(
                    doc.resolve(response)["description"].is_string(),
                    "{id} {status}: description"
                );
            }
        }
        assert!(operations > 0, "{path}: no operation");
        // Every `{name}` in the template is a required path parameter.
        for name in path
            .split('{')
            .skip(1)
            .filter_map(|s| s.split_once('}'))
            .map(|(n, _)| n)
        {
            let declared = parameters
                .iter()
                .map(|p| doc.resolve(p))
                .any(|p| p["in"] == "path" && p["name"] == name && p["required"] == true);
            assert!(declared, "{path}: path parameter {name}");
        }
    }
}

/// The bounds the document gives an acquire are the server's: a client generated from it
/// sends no `ttl_ms` the server refuses, and the admin listener's account is what the
/// proxy reads as one.
#[test]
fn the_documented_bounds_of_request_fields_are_the_servers() {
    let doc = Doc::load();
    let ttl = &doc.at("#/components/schemas/AcquireRequest").unwrap()["properties"]["ttl_ms"];
    let limits = crate::lock::service::LockLimits::default();
    assert_eq!(
        ttl["minimum"].as_u64(),
        Some(limits.min_ttl.as_millis() as u64),
        "ttl_ms minimum: {ttl}"
    );
    for schema in ["AccountRequest", "ForgetRequest", "RecoverRequest"] {
        let account = doc.resolve(
            &doc.at(&format!("#/components/schemas/{schema}")).unwrap()["properties"]["account"],
        );
        assert_eq!(account["minLength"], 1, "{schema}.account: {account}");
        assert_eq!(
            account["pattern"], "^[!-~]+$",
            "{schema}.account: {account}"
        );
    }
}

/// The admin listener's errors are JSON in the documented shape, and its 405 says in
/// `Allow` what the path takes.
#[tokio::test]
async fn the_admin_listeners_error_answers_are_documented() {
    let doc = Doc::load();
    let unrouted = doc.unrouted("admin");
    for response in [
        crate::admin::method_not_allowed("GET"),
        crate::admin::error(http::StatusCode::NOT_FOUND, "not_found", "no".into()),
    ] {
        let rendered = render(response).await;
        if let Some(why) = doc.undocumented(unrouted, &rendered) {
            panic!("admin, unrouted: {why}");
        }
    }
    let marks = &doc.operation("admin", "/marks", &Method::POST).unwrap()["responses"];
    for response in [
        crate::admin::error(http::StatusCode::BAD_REQUEST, "bad_request", "no".into()),
        crate::admin::error(
            http::StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "database: down".into(),
        ),
    ] {
        let rendered = render(response).await;
        if let Some(why) = doc.undocumented(marks, &rendered) {
            panic!("admin, /marks: {why}");
        }
    }
}

#[tokio::test]
async fn every_lock_route_and_refusal_is_documented() {
    let doc = Doc::load();
    for operation in Operation::ALL {
        assert!(
            doc.operation("lock", &operation.path(), &operation.method())
                .is_some(),
            "{} {} is not in docs/openapi.yaml",
            operation.method(),
            operation.path()
        );
    }
    // And the document describes no lock route the API does not serve.
    for (path, method, _) in doc.operations("lock") {
        let served = Operation::ALL
            .iter()
            .any(|o| o.path() == path && o.method() == method);
        assert!(
            served,
            "docs/openapi.yaml has {method} {path}, which the lock API does not serve"
        );
    }
    for (error, operations) in ApiError::examples() {
        let what = error.to_string();
        let rendered = render(error.into_response()).await;
        let unrouted = doc.undocumented(doc.unrouted("lock"), &rendered);
        if operations.is_empty() {
            assert!(
                unrouted.is_none(),
                "lock API, unrouted: {what}: {}",
                unrouted.unwrap()
            );
        }
        for operation in operations {
            let path = operation.path();
            let responses =
                &doc.operation("lock", &path, &operation.method()).unwrap()["responses"];
            if let Some(why) = doc.undocumented(responses, &rendered) {
                panic!("{} {path}: {what}: {why}", operation.method());
            }
        }
    }
}

#[tokio::test]
async fn every_proxy_refusal_request_header_and_replay_header_is_documented() {
    let doc = Doc::load();
    let operations = doc.operations("proxy");
    assert!(
        operations.iter().any(|(_, m, _)| m == Method::POST),
        "the proxy's POST"
    );
    let defaults = crate::config::ProxyConfig::default();
    let headers = [
        &defaults.token_header,
        &defaults.account_header,
        &defaults.proof_header,
        &defaults.idempotency_header,
    ];
    for (path, method, operation) in &operations {
        let item = &doc.paths()[*path];
        let parameters: Vec<&Value> = item["parameters"]
            .as_array()
            .into_iter()
            .chain(operation["parameters"].as_array())
            .flatten()
            .map(|p| doc.resolve(p))
            .collect();
        for name in headers {
            let documented = parameters.iter().any(|p| {
                p["in"] == "header"
                    && p["name"]
                        .as_str()
                        .is_some_and(|n| n.eq_ignore_ascii_case(name.as_str()))
            });
            assert!(documented, "{method} {path}: request header {name}");
        }
        let passed_through = doc.resolve(&operation["responses"]["default"]);
        for name in [
            crate::proxy::idempotency::REPLAYED.as_str(),
            crate::proxy::idempotency::BODY_OMITTED.as_str(),
            "x-request-id",
        ] {
            let documented = passed_through["headers"]
                .as_object()
                .is_some_and(|h| h.keys().any(|k| k.eq_ignore_ascii_case(name)));
            assert!(
                documented,
                "{method} {path}: the rail's answer's header {name}"
            );
        }
    }
    for error in examples() {
        let mut refusal = rejection(&error);
        // Set by the respond layer on every refusal.
        refusal.request_id = Some("0a1b2c3d-1".into());
        let rendered = render(refusal.into_response()).await;
        let unrouted = doc.undocumented(doc.unrouted("proxy"), &rendered);
        // Under every operation, or (`CONNECT`) as the answer to none of them.
        for (path, method, operation) in &operations {
            let why = doc.undocumented(&operation["responses"], &rendered);
            if let (Some(why), Some(unrouted)) = (why, &unrouted) {
                panic!("{method} {path}: {error}: {why}; nor unrouted: {unrouted}");
            }
        }
    }
}

#[tokio::test]
async fn the_proxy_listeners_overload_answer_is_documented() {
    let doc = Doc::load();
    let rendered = render(crate::proxy::error::overloaded()).await;
    for (path, method, operation) in doc.operations("proxy") {
        if let Some(why) = doc.undocumented(&operation["responses"], &rendered) {
            panic!("{method} {path}: the max_in_flight refusal: {why}");
        }
    }
}

#[test]
fn a_fenced_out_body_can_never_carry_the_mark() {
    let doc = Doc::load();
    let fenced_out = doc.shapes(&doc.0["components"]["schemas"]["FencedOut"]);
    assert_eq!(fenced_out.len(), 1);
    let shape = &fenced_out[0];
    assert!(shape.closed, "FencedOut must forbid other properties");
    assert!(
        shape.properties.iter().all(|p| !p.contains("mark")),
        "{:?}",
        shape.properties
    );
    assert!(shape.required.contains("account") && shape.required.contains("token"));
}

/// What `src/admin.rs` says about itself: it routes with a `match` whose arms read
/// `(Method::GET, "/metrics") => ...`, and names each status it answers as
/// `StatusCode::NAME`, in the arm or in a function the arm calls.
struct AdminSource(&'static str);

impl AdminSource {
    /// Each routed arm: its method, path, and the statuses it can answer.
    fn arms(&self) -> Vec<(Method, String, BTreeSet<StatusCode>)> {
        let mut arms = Vec::new();
        let mut lines = self.0.lines().peekable();
        while let Some(line) = lines.next() {
            let Some(rest) = line.trim_start().strip_prefix("(Method::") else {
                continue;
            };
            let parsed = rest.split_once(", \"").and_then(|(method, rest)| {
                let (path, _) = rest.split_once('"')?;
                Some((
                    Method::from_bytes(method.as_bytes()).ok()?,
                    path.to_string(),
                ))
            });
            let Some((method, path)) = parsed else {
                continue;
            };
            // The arm ends where a line as indented as its start begins another arm.
            let indent = line.len() - line.trim_start().len();
            let mut arm = line.to_string();
            while let Some(next) = lines.peek() {
                let next_indent = next.len() - next.trim_start().len();
                let closes = next.trim_start().starts_with(['}', ')']);
                if next_indent <= indent && !closes {
                    break;
                }
                arm.push('\n');
                arm.push_str(lines.next().unwrap());
            }
            let statuses = self.statuses(&arm, &mut BTreeSet::new());
            arms.push((method, path, statuses));
        }
        arms
    }

    /// The statuses `text` names, and those of the functions of this file it calls.
    fn statuses(&self, text: &str, seen: &mut BTreeSet<String>) -> BTreeSet<StatusCode> {
        let mut found: BTreeSet<StatusCode> = text
            .split("StatusCode::")
            .skip(1)
            .map(|rest| {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || *c == '_')
                    .collect();
                status_named(&name)
            })
            .collect();
        for (name, body) in self.functions() {
            let called = text.contains(&format!("{name}("));
            if called && seen.insert(name.to_string()) {
                found.extend(self.statuses(body, seen));
            }
        }
        found
    }

    /// Every `fn` of the file: its name and its text, to the brace that closes it.
    fn functions(&self) -> Vec<(&'static str, &'static str)> {
        let source = self.0;
        let mut functions = Vec::new();
        let mut offset = 0;
        for line in source.lines() {
            let start = offset;
            offset += line.len() + 1;
            let trimmed = line.trim_start();
            let Some(at) = trimmed.find("fn ") else {
                continue;
            };
            let prefix = &trimmed[..at];
            if !prefix
                .split_whitespace()
                .all(|w| ["pub", "async", "pub(crate)", "pub(super)"].contains(&w))
            {
                continue;
            }
            let name: &str = trimmed[at + 3..]
                .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .next()
                .unwrap_or("");
            let indent = &line[..line.len() - trimmed.len()];
            let close = format!("\n{indent}}}\n");
            let end = source[start..]
                .find(&close)
                .map_or(source.len(), |e| start + e + close.len());
            functions.push((name, &source[start..end]));
        }
        functions
    }
}

/// The status whose constant in `http` is `StatusCode::NAME`.
fn status_named(name: &str) -> StatusCode {
    (100..600)
        .filter_map(|n| StatusCode::from_u16(n).ok())
        .find(|s| {
            s.canonical_reason()
                .is_some_and(|reason| reason.to_uppercase().replace([' ', '-'], "_") == name)
        })
        .unwrap_or_else(|| panic!("StatusCode::{name} is no status this test knows"))
}

#[test]
fn every_admin_route_and_status_is_documented() {
    let doc = Doc::load();
    // The listener's routes, and the module of forget's answers they call.
    let source = AdminSource(concat!(
        include_str!("../admin.rs"),
        include_str!("../admin/forget.rs")
    ));
    let arms = source.arms();
    assert!(
        arms.iter()
            .any(|(m, p, _)| m == Method::GET && p == "/openapi.yaml"),
        "the admin listener serves this document"
    );
    assert!(
        arms.iter()
            .any(|(_, p, s)| p == "/idempotency/forget" && s.contains(&StatusCode::CONFLICT)),
        "the source is read as this test expects: {arms:?}"
    );
    for (method, path, statuses) in &arms {
        let operation = doc.operation("admin", path, method).unwrap_or_else(|| {
            panic!(
                "the admin listener serves {method} {path}; docs/openapi.yaml does not describe it"
            )
        });
        for status in statuses {
            assert!(
                operation["responses"].get(status.as_str()).is_some(),
                "{method} {path} can answer {status}; docs/openapi.yaml does not say so"
            );
        }
    }
    // What no route answers (404, 405) answers a request that matched none.
    let unrouted = doc.unrouted("admin");
    let routed: BTreeSet<StatusCode> = arms.iter().flat_map(|(_, _, s)| s.clone()).collect();
    for status in source.statuses(source.0, &mut BTreeSet::new()) {
        assert!(
            routed.contains(&status) || unrouted.get(status.as_str()).is_some(),
            "src/admin.rs answers {status}; docs/openapi.yaml does not say when"
        );
    }
}

#[tokio::test]
async fn the_admin_listener_serves_the_file() {
    let rendered = super::response();
    assert_eq!(rendered.headers()[header::CONTENT_TYPE], "application/yaml");
    let body = rendered.into_body().collect().await.unwrap().to_bytes();
    let file = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.yaml")).unwrap();
    assert_eq!(body, file);
}
