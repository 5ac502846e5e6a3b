//! The OpenAPI 3.1 document of railguard's HTTP surfaces — the lock API, the proxy's wire
//! contract and the admin listener — so that workers in any language can be written against
//! it. It lives in the repository as `docs/openapi.yaml`, is compiled in from there, and the
//! admin listener serves it at `GET /openapi.yaml`: the served document is the file.
//!
//! The tests below hold the document to the code, reading the code's own lists rather than a
//! copy of them:
//! - lock API: every operation in `lock::api::Operation::ALL` is a documented route, and every
//!   refusal in `ApiError::examples()` (exhaustive over its variants) is documented under the
//!   operations that can give it: status, `error` code, `outcome`, `Retry-After`, and every
//!   field of the rendered body;
//! - proxy: the same for every error in `proxy::error::examples()`, which has an example for
//!   each of the proxy's responders (`every_responder_has_an_example`), under every proxy
//!   operation; the request headers are the configured defaults, and the replay headers are
//!   those `idempotency` sets;
//! - admin: `src/admin.rs` routes with a `match`, so its arms, and the statuses each arm
//!   names (itself or in the functions of that file it calls), are read from its source.
//!
//! A status the code can answer but the document does not describe fails them. The document
//! may describe more than the code does today (routes and codes being added in parallel).

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

#[cfg(test)]
mod tests;
