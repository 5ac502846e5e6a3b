//! TLS on railguard's listeners, over real sockets: a listener serving TLS, mutual TLS (a
//! client certificate from the trusted CA is accepted and its fingerprint reaches the service;
//! one from another CA, or none when one is required, is refused at the handshake), a
//! certificate replaced on disk served to the next handshake without a restart, a certificate
//! file that hangs holding up no handshake nor the exit after SIGTERM, and every refusal counted.

use railguard_testkit as support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use prometheus::IntCounterVec;
use railguard::config::{ClientAuth, ListenerLimits, ListenerTls};
use railguard::http::{Arrival, Listener, Peer, Refusal, serve};
use railguard::tls::server::{Checked, STALLED_AFTER, TlsServer, reload_counter};
use support::{Http, Issued, Pg, Pki, Rail, Railguard, TlsClient, hex, init_tracing};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// A TLS listener in this process whose service answers with the client certificate's
/// fingerprint as the accept loop handed it over (`none` without one).
struct Echo {
    addr: SocketAddr,
    refusals: IntCounterVec,
    reloads: IntCounterVec,
    tls: Arc<TlsServer>,
    _stop: oneshot::Sender<()>,
}

impl Echo {
    async fn start(tls: ListenerTls, limits: ListenerLimits) -> Echo {
        init_tracing();
        let reloads = reload_counter();
        let refusals = Refusal::counter();
        let server =
            Arc::new(TlsServer::load(tls, "proxy", reloads.clone()).expect("TLS files load"));
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let listener = Listener::new(tcp, "proxy")
            .with_limits(limits)
            .with_tls(server.clone())
            .counting_refusals_in(refusals.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(serve(
            listener,
            |peer: Peer| {
                hyper::service::service_fn(move |request: http::Request<_>| {
                    // The request carries, in its Arrival, the Peer the factory was given.
                    let same = Arrival::of(request.extensions()).map(|a| a.peer) == Some(peer);
                    let body = match peer.client_cert_sha256 {
                        Some(sha) if same => hex(&sha),
                        None if same => "none".to_string(),
                        _ => "the request's Peer differs from the connection's".to_string(),
                    };
                    async move {
                        Ok::<_, Infallible>(Response::new(
                            Full::new(Bytes::from(body)).map_err(|never| match never {}),
                        ))
                    }
                })
            },
            async move {
                let _ = stopped.await;
            },
            Duration::from_secs(1),
        ));
        Echo {
            addr,
            refusals,
            reloads,
            tls: server,
            _stop: stop,
        }
    }

    fn refused(&self, reason: Refusal) -> u64 {
        crate::refusals::refused(&self.refusals, reason)
    }

    async fn wait_refused(&self, reason: Refusal, n: u64) {
        crate::refusals::wait_refused(&self.refusals, reason, n).await
    }
}

use http_body_util::BodyExt as _;

fn files(server: &Issued, ca: Option<&Path>, client_auth: ClientAuth) -> ListenerTls {
    ListenerTls {
        cert_file: server.cert.clone(),
        key_file: server.key.clone(),
        client_ca_file: ca.map(Path::to_path_buf),
        client_auth,
    }
}

/// An [`Echo`] with default limits serving `pki`'s certificate for `railguard`, and checking
/// client certificates against `pki`'s CA as `client_auth` says.
async fn echo_checking_clients(pki: &Pki, client_auth: ClientAuth) -> Echo {
    let server = pki.server("railguard");
    Echo::start(
        files(&server, Some(&pki.ca), client_auth),
        ListenerLimits::default(),
    )
    .await
}

/// A client trusting `pki`'s CA, with a certificate from another CA, is refused by `echo` at the
/// handshake: its `refusals`th TLS handshake refused.
async fn refuses_another_cas_client(pki: &Pki, echo: &Echo, refusals: u64) {
    // The other CA lives as long as its files are used.
    let other = Pki::new();
    let stranger = other.client("worker-eu");
    let refused = TlsClient::new(&pki.ca, Some(&stranger))
        .get(echo.addr, "/")
        .await;
    assert!(refused.is_err(), "{refused:?}");
    echo.wait_refused(Refusal::TlsHandshake, refusals).await;
}

#[tokio::test]
async fn a_tls_listener_serves_https_and_refuses_cleartext_at_the_handshake() {
    let pki = Pki::new();
    let server = pki.server("railguard");
    let echo = Echo::start(
        files(&server, None, ClientAuth::None),
        ListenerLimits::default(),
    )
    .await;
    let reply = TlsClient::new(&pki.ca, None)
        .get(echo.addr, "/")
        .await
        .expect("an HTTPS request");
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, "none", "no client certificate was asked for");
    assert_eq!(reply.server_cert_sha256, server.fingerprint_sha256());
    assert_eq!(reply.alpn.as_deref(), Some(&b"http/1.1"[..]));

    // Cleartext HTTP to a TLS port gets no HTTP answer, and is counted.
    let plain = Http::new().get(&format!("http://{}/", echo.addr)).await;
    assert!(plain.is_err(), "{plain:?}");
    echo.wait_refused(Refusal::TlsHandshake, 1).await;

    // A client that does not trust this CA refuses the server.
    let other = Pki::new();
    let refused = TlsClient::new(&other.ca, None).get(echo.addr, "/").await;
    assert!(refused.unwrap_err().starts_with("handshake"));
}

#[tokio::test]
async fn required_client_certificates_from_the_trusted_ca_pass_with_their_fingerprint_others_are_refused()
 {
    let pki = Pki::new();
    let echo = echo_checking_clients(&pki, ClientAuth::Required).await;
    let worker = pki.client("worker-eu");
    let reply = TlsClient::new(&pki.ca, Some(&worker))
        .get(echo.addr, "/")
        .await
        .expect("a trusted client certificate is accepted");
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(
        reply.body,
        worker.fingerprint_sha256(),
        "the service sees the SHA-256 of the client's certificate"
    );
    let another = pki.client("worker-us");
    let reply = TlsClient::new(&pki.ca, Some(&another))
        .get(echo.addr, "/")
        .await
        .unwrap();
    assert_eq!(reply.body, another.fingerprint_sha256());
    assert_ne!(reply.body, worker.fingerprint_sha256());
    assert_eq!(echo.refused(Refusal::TlsHandshake), 0);

    // A certificate from another CA: refused, and the request never reaches the service.
    refuses_another_cas_client(&pki, &echo, 1).await;

    // No certificate at all: refused too.
    let refused = TlsClient::new(&pki.ca, None).get(echo.addr, "/").await;
    assert!(refused.is_err(), "{refused:?}");
    echo.wait_refused(Refusal::TlsHandshake, 2).await;
}

#[tokio::test]
async fn optional_client_certificates_serve_clients_without_one_but_still_refuse_untrusted_ones() {
    let pki = Pki::new();
    let echo = echo_checking_clients(&pki, ClientAuth::Optional).await;
    let anonymous = TlsClient::new(&pki.ca, None)
        .get(echo.addr, "/")
        .await
        .unwrap();
    assert_eq!(anonymous.body, "none");
    let worker = pki.client("worker-eu");
    let reply = TlsClient::new(&pki.ca, Some(&worker))
        .get(echo.addr, "/")
        .await
        .unwrap();
    assert_eq!(reply.body, worker.fingerprint_sha256());
    refuses_another_cas_client(&pki, &echo, 1).await;
}

/// A file whose reads hang, as on a mount that does not answer: its path becomes a FIFO nobody
/// writes to, so opening it blocks. Dropping it answers the hanging read whatever the test's
/// outcome, so that no thread or process stays blocked: first the replacement, if any, goes to
/// the path as a regular file, then the FIFO (still reachable by a second name) gets a writer,
/// which sends the replacement's bytes too.
struct HangingFile {
    fifo: std::path::PathBuf,
    path: std::path::PathBuf,
    replacement: Option<std::path::PathBuf>,
}

impl HangingFile {
    fn install(path: &Path, replacement: Option<&Path>) -> HangingFile {
        let fifo = path.with_extension("hanging-fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let second_name = path.with_extension("fifo");
        std::fs::hard_link(&fifo, &second_name).unwrap();
        std::fs::rename(&second_name, path).unwrap();
        HangingFile {
            fifo,
            path: path.to_path_buf(),
            replacement: replacement.map(Path::to_path_buf),
        }
    }
}

impl Drop for HangingFile {
    fn drop(&mut self) {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let bytes = match &self.replacement {
            Some(replacement) => {
                let aside = self.path.with_extension("new");
                let _ = std::fs::copy(replacement, &aside);
                let _ = std::fs::rename(&aside, &self.path);
                std::fs::read(replacement).unwrap_or_default()
            }
            None => Vec::new(),
        };
        // O_NONBLOCK: opening without a reader fails instead of waiting for one.
        if let Ok(mut writer) = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(0o4000)
            .open(&self.fifo)
        {
            let _ = writer.write_all(&bytes);
        }
    }
}

/// Two server certificates from one CA, and the files a listener serves (`live`, in `dir`,
/// not written yet) for a test to rotate between them.
struct Rotation {
    pki: Pki,
    first: Issued,
    second: Issued,
    dir: tempfile::TempDir,
    live: Issued,
}

impl Rotation {
    fn new() -> Rotation {
        let pki = Pki::new();
        let (first, second) = (pki.server("first"), pki.server("second"));
        let dir = tempfile::tempdir().unwrap();
        let live = Issued {
            cert: dir.path().join("cert.pem"),
            key: dir.path().join("key.pem"),
        };
        Rotation {
            pki,
            first,
            second,
            dir,
            live,
        }
    }
}

impl Rotation {
    /// The first certificate installed and served by an [`Echo`] listener: it, and a client
    /// that trusts the CA.
    async fn serving_first(&self) -> (Echo, TlsClient) {
        install(&self.first, &self.live);
        let tls = files(&self.live, None, ClientAuth::None);
        let echo = Echo::start(tls, ListenerLimits::default()).await;
        (echo, TlsClient::new(&self.pki.ca, None))
    }
}

/// Replaces the `live` files with `from`'s the way a rotation does: write aside, then rename
/// over.
fn install(from: &Issued, live: &Issued) {
    for (src, dst) in [(&from.cert, &live.cert), (&from.key, &live.key)] {
        let aside = dst.with_extension("new");
        std::fs::copy(src, &aside).unwrap();
        std::fs::rename(&aside, dst).unwrap();
    }
}

#[tokio::test]
async fn a_replaced_certificate_is_served_to_the_next_handshake_and_a_broken_one_is_not() {
    let rotation = Rotation::new();
    let (first, second, live) = (&rotation.first, &rotation.second, &rotation.live);
    let (echo, client) = rotation.serving_first().await;
    let served = || async { client.get(echo.addr, "/").await.unwrap().server_cert_sha256 };
    assert_eq!(served().await, first.fingerprint_sha256());

    // The first handshake a second or more after the last check waits for the check it
    // starts, and gets the new certificate.
    install(second, live);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        served().await,
        second.fingerprint_sha256(),
        "the new certificate at the next handshake, without a restart"
    );
    let ok = |reloads: &IntCounterVec, result| reloads.with_label_values(&["proxy", result]).get();
    assert_eq!(ok(&echo.reloads, "ok"), 1);

    // A key that does not parse: the error is counted, the second certificate stays.
    std::fs::write(&live.key, "-----BEGIN PRIVATE KEY-----\nnot a key\n").unwrap();
    let _ = support::within(Duration::from_secs(5), || async {
        assert_eq!(served().await, second.fingerprint_sha256());
        (ok(&echo.reloads, "error") >= 1).then_some(())
    })
    .await;
    assert_eq!(ok(&echo.reloads, "error"), 1);
    assert_eq!(served().await, second.fingerprint_sha256());
}

/// A check on demand, as SIGHUP makes one: a replaced certificate is in force for the very next
/// handshake, with no wait for the periodic check; unchanged files are said to be unchanged; a
/// broken key is reported and the certificate in use stays.
#[tokio::test]
async fn a_check_on_demand_puts_a_replaced_certificate_in_force_at_once() {
    let rotation = Rotation::new();
    let (first, second, live) = (&rotation.first, &rotation.second, &rotation.live);
    let (echo, client) = rotation.serving_first().await;
    let served = || async { client.get(echo.addr, "/").await.unwrap().server_cert_sha256 };
    assert_eq!(served().await, first.fingerprint_sha256());
    assert_eq!(echo.tls.check_now().await, Checked::Unchanged);

    install(second, live);
    assert_eq!(echo.tls.check_now().await, Checked::Reloaded);
    // Within the second after a check, handshakes start none of their own: what they get is
    // what the check on demand loaded.
    assert_eq!(served().await, second.fingerprint_sha256());
    assert_eq!(echo.reloads.with_label_values(&["proxy", "ok"]).get(), 1);

    std::fs::write(&live.key, "-----BEGIN PRIVATE KEY-----\nnot a key\n").unwrap();
    match echo.tls.check_now().await {
        Checked::Failed(why) => assert!(why.contains("key.pem"), "{why}"),
        other => panic!("a broken key is reported: {other:?}"),
    }
    assert_eq!(served().await, second.fingerprint_sha256());
}

/// A certificate file whose reads hang — a FIFO with no writer stands in for a stale NFS mount
/// — holds up no handshake: the check waits on its own thread while handshakes go on with the
/// certificate in use, the stall is counted once, and once the file answers again, checks resume
/// and pick up a rotation.
/// The listener runs on a runtime of its own with two worker threads and the client on another,
/// so that a listener whose threads were stuck would show as a client timeout, not a hang.
#[test]
fn a_certificate_file_that_hangs_holds_up_no_handshake() {
    let Rotation {
        pki,
        first,
        second,
        dir: _dir,
        live,
    } = Rotation::new();
    std::fs::copy(&first.cert, &live.cert).unwrap();
    std::fs::copy(&first.key, &live.key).unwrap();
    let listener_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // A handshake that waits for the check it started must not be refused for it: the wait
    // (up to CHECK_WAIT, 500 ms) is the server's, not part of the client's time to say hello.
    let limits = ListenerLimits {
        header_read_timeout: Duration::from_millis(450),
        ..ListenerLimits::default()
    };
    let echo = listener_runtime.block_on(Echo::start(files(&live, None, ClientAuth::None), limits));
    let client_runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = TlsClient::new(&pki.ca, None);
    let served = || {
        client_runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), client.get(echo.addr, "/"))
                .await
                .expect("a handshake while a certificate file hangs is answered within 5 s")
                .unwrap()
                .server_cert_sha256
        })
    };
    assert_eq!(served(), first.fingerprint_sha256());

    // The certificate's path hangs; when it answers again it holds the second certificate.
    let unhang = HangingFile::install(&live.cert, Some(&second.cert));
    std::fs::copy(&second.key, &live.key).unwrap();

    // Past the point where the check counts as stalled, every handshake is answered, with the
    // certificate in use; the stall is counted once.
    let reloads = |result| echo.reloads.with_label_values(&["proxy", result]).get();
    let until = std::time::Instant::now() + STALLED_AFTER + Duration::from_millis(1500);
    let mut handshakes = 0;
    while std::time::Instant::now() < until {
        assert_eq!(served(), first.fingerprint_sha256());
        handshakes += 1;
        client_runtime.block_on(async { tokio::time::sleep(Duration::from_millis(200)).await });
    }
    assert!(handshakes >= 20, "{handshakes} handshakes");
    assert_eq!(
        (reloads("ok"), reloads("error"), reloads("stalled")),
        (0, 0, 1)
    );

    // The file answers again (the second certificate, with its key): the stuck check returns,
    // and the next one loads the rotation.
    drop(unhang);
    let mut seen = served();
    for _ in 0..100 {
        if seen == second.fingerprint_sha256() {
            break;
        }
        client_runtime.block_on(async { tokio::time::sleep(Duration::from_millis(50)).await });
        seen = served();
    }
    assert_eq!(seen, second.fingerprint_sha256(), "checks resumed");
    assert_eq!(reloads("ok"), 1);
    // The stalled check stamped what it read from the FIFO but loaded the files renamed over
    // it; were the stamps not of the bytes loaded, the next check would reload again.
    client_runtime.block_on(async { tokio::time::sleep(Duration::from_millis(1100)).await });
    assert_eq!(served(), second.fingerprint_sha256());
    assert_eq!(
        (reloads("ok"), reloads("error")),
        (1, 0),
        "one rotation, one reload"
    );
    drop(echo);
    listener_runtime.shutdown_timeout(Duration::from_secs(5));
}

/// `railguard serve` whose certificate file hangs in the middle of a check still exits on
/// SIGTERM: the check's blocking thread is not waited for at exit (a runtime's drop would wait
/// for it forever).
#[tokio::test]
async fn serve_exits_on_sigterm_while_a_certificate_check_hangs() {
    init_tracing();
    let pki = Pki::new();
    let server = pki.server("railguard");
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::copy(&server.cert, &cert).unwrap();
    std::fs::copy(&server.key, &key).unwrap();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let (cert_text, key_text) = (cert.display().to_string(), key.display().to_string());
    let mut rg = Railguard::start_process(
        &pg.url(),
        &rail.url(),
        &[
            ("RAILGUARD__LOCK__TLS_CERT_FILE", &cert_text),
            ("RAILGUARD__LOCK__TLS_KEY_FILE", &key_text),
        ],
    )
    .await;
    let client = TlsClient::new(&pki.ca, None);
    let reply = client.get(rg.lock, "/v1/locks/acct-1").await.unwrap();
    reply.assert_status(StatusCode::OK);

    // The certificate's path hangs; a handshake a second later starts a check, which hangs
    // opening it.
    let _unhang = HangingFile::install(&cert, None);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let reply = client.get(rg.lock, "/v1/locks/acct-1").await.unwrap();
    reply.assert_status(StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let reply = client.get(rg.lock, "/v1/locks/acct-1").await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "served while the check hangs");

    let started = std::time::Instant::now();
    let status = rg.stop().await;
    assert!(status.success(), "{status}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "exited after {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_client_that_opens_a_connection_and_never_says_hello_is_dropped() {
    let pki = Pki::new();
    let server = pki.server("railguard");
    let limits = ListenerLimits {
        header_read_timeout: Duration::from_millis(300),
        ..ListenerLimits::default()
    };
    let echo = Echo::start(files(&server, None, ClientAuth::None), limits).await;
    let mut silent = TcpStream::connect(echo.addr).await.unwrap();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut buf))
        .await
        .expect("the server closes the connection");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    echo.wait_refused(Refusal::TlsHandshake, 1).await;
    // Meanwhile, and after, the listener serves.
    let reply = TlsClient::new(&pki.ca, None)
        .get(echo.addr, "/")
        .await
        .unwrap();
    assert_eq!(reply.status, StatusCode::OK);
}

#[tokio::test]
async fn railguard_serves_its_lock_api_over_mutual_tls_from_its_config() {
    init_tracing();
    let pki = Pki::new();
    let server = pki.server("railguard");
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let (cert, key, ca) = (
        server.cert.display().to_string(),
        server.key.display().to_string(),
        pki.ca.display().to_string(),
    );
    let rg = Railguard::start(
        &pg.url(),
        &rail.url(),
        &[
            ("RAILGUARD__LOCK__TLS_CERT_FILE", &cert),
            ("RAILGUARD__LOCK__TLS_KEY_FILE", &key),
            ("RAILGUARD__LOCK__TLS_CLIENT_CA_FILE", &ca),
            ("RAILGUARD__LOCK__TLS_CLIENT_AUTH", "required"),
        ],
    )
    .await;
    let worker = pki.client("worker-eu");
    let reply = TlsClient::new(&pki.ca, Some(&worker))
        .get(rg.lock, "/v1/locks/acct-1")
        .await
        .expect("the lock API over mutual TLS");
    reply.assert_status(StatusCode::OK);
    assert_eq!(reply.server_cert_sha256, server.fingerprint_sha256());

    let refused = TlsClient::new(&pki.ca, None)
        .get(rg.lock, "/v1/locks/acct-1")
        .await;
    assert!(refused.is_err(), "{refused:?}");
    let key = "railguard_listener_refusals_total{listener=\"lock\",reason=\"tls_handshake\"}";
    assert_eq!(rg.metric_reaches(key, 1.0).await, 1.0);
    // The other listeners stay plain: the admin listener answered the metrics over HTTP.
    assert_eq!(
        rg.metrics()
            .await
            .get("railguard_listener_refusals_total{listener=\"proxy\",reason=\"tls_handshake\"}"),
        0.0
    );
}
