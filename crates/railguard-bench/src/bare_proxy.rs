//! `bare-proxy`: the wire suite's floor for a Rust proxy. A hyper 1 server (`service_fn`, a
//! multi-thread tokio runtime) that reads each request's body whole, forwards method, path and
//! query, headers and body to the upstream through hyper-util's pooled legacy client
//! (HTTP/1.1, keep-alive), reads the answer's body whole and returns it. No fencing, no
//! database, no logging: what railguard costs per request above this is its own work.
//!
//! `bare-proxy --listen 127.0.0.1:PORT --upstream http://127.0.0.1:PORT`

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use clap::Parser;
use http::uri::{PathAndQuery, Uri};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

type Upstream = Client<HttpConnector, Full<Bytes>>;

/// A plain HTTP/1.1 reverse proxy, the floor railguard's CPU per request is compared against.
#[derive(Parser)]
#[command(name = "bare-proxy")]
struct Cli {
    /// Address to listen on.
    #[arg(long)]
    listen: SocketAddr,
    /// Where to forward: `http://host:port`.
    #[arg(long)]
    upstream: Uri,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> std::io::Result<()> {
    let cli = Cli::parse();
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Upstream = Client::builder(TokioExecutor::new()).build(connector);
    let listener = tokio::net::TcpListener::bind(cli.listen).await?;
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (client, upstream) = (client.clone(), cli.upstream.clone());
        tokio::spawn(async move {
            let service =
                service_fn(move |request| forward(client.clone(), upstream.clone(), request));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn forward(
    client: Upstream,
    upstream: Uri,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (mut parts, body) = request.into_parts();
    let Ok(body) = body.collect().await else {
        return Ok(status(StatusCode::BAD_REQUEST));
    };
    let mut uri = upstream.into_parts();
    uri.path_and_query = Some(
        parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/")),
    );
    let Ok(uri) = Uri::from_parts(uri) else {
        return Ok(status(StatusCode::BAD_REQUEST));
    };
    parts.uri = uri;
    let Ok(answer) = client
        .request(Request::from_parts(parts, Full::new(body.to_bytes())))
        .await
    else {
        return Ok(status(StatusCode::BAD_GATEWAY));
    };
    let (parts, body) = answer.into_parts();
    match body.collect().await {
        Ok(body) => Ok(Response::from_parts(parts, Full::new(body.to_bytes()))),
        Err(_) => Ok(status(StatusCode::BAD_GATEWAY)),
    }
}

fn status(code: StatusCode) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = code;
    response
}
