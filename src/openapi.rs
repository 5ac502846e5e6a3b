//! The OpenAPI 3.1 document of railguard's HTTP surfaces — the lock API, the proxy's wire
//! contract and the admin listener — so that workers in any language can be written against
//! it. It lives in the repository as `docs/openapi.yaml`, is compiled in from there, and the
//! admin listener serves it at `GET /openapi.yaml`: the served document is the file.

use http::{Response, StatusCode, header};

use crate::http::{ResponseBody, full};

/// `docs/openapi.yaml`, as built into this binary.
pub const DOCUMENT: &str = include_str!("../docs/openapi.yaml");

/// The admin listener's answer to `GET /openapi.yaml`.
pub fn response() -> Response<ResponseBody> {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/yaml")
        .body(full(DOCUMENT))
        .expect("static response parts")
}
