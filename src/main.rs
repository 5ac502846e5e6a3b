//! The `railguard` command. Only this file knows about flags and the process environment.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use railguard::config::{Config, LockBackendKind, LogFormat};
use railguard::db::Database;
use railguard::demo::{self, DemoOptions, Verdict};
use railguard::railsim::RailSim;
use railguard::{fast_forward, http, server, telemetry};

#[derive(Parser)]
#[command(
    name = "railguard",
    version,
    about = "Fenced proxy and lock service for a non-idempotent payment rail"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Play T-042, the stalled survivor, in one process and check it: an embedded PostgreSQL
    /// in a temp dir, the lock service, the proxy and the rail simulator on free loopback
    /// ports; W1's lease expires while it stalls, W2 takes over and pays, W1 wakes and is
    /// fenced out. Exits 0 only if the rail paid once and the fence held; needs only the
    /// PostgreSQL server binaries (and etcd for --backend etcd).
    Demo {
        /// Lock backend: postgres, or etcd (a throwaway member of the `etcd` on PATH).
        #[arg(long, value_enum, default_value_t = DemoBackend::Postgres)]
        backend: DemoBackend,
        /// W1's lease, in milliseconds (the etcd backend rounds it up to whole seconds).
        #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u64).range(100..=30_000))]
        ttl_ms: u64,
    },
    /// Run the rail proxy, the lock service and the admin listener until SIGTERM/SIGINT.
    ///
    /// SIGHUP reloads the credentials file, the listeners' TLS files and `log.level`, and
    /// logs by name every other changed key as needing a restart; it never stops railguard.
    ///
    /// Every config key can be overridden as RAILGUARD__SECTION__KEY, e.g.
    /// RAILGUARD__PROXY__LISTEN=0.0.0.0:8080.
    Serve {
        /// TOML config file (see config/railguard.toml for every key, commented). Default:
        /// $RAILGUARD_CONFIG, else config/railguard.toml in the working directory.
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Check a config file (and the RAILGUARD__… overrides in the environment) without starting
    /// anything, as `nginx -t` does: exit 0 with a one-line summary, or 2 naming the key and the
    /// file (or variable) that is wrong.
    CheckConfig {
        /// TOML config file. Default: $RAILGUARD_CONFIG, else config/railguard.toml in the
        /// working directory.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Also print the effective configuration, as `nginx -T` does: every key with its
        /// value and, in a comment, where it came from (the file, a RAILGUARD__… variable, or
        /// the default); passwords redacted. The output is TOML; the summary line follows it
        /// as a comment.
        #[arg(long)]
        print: bool,
    },
    /// Show who holds a lock key, asking the running railguard's lock API: holder, lease left
    /// and grant age, for diagnosis. Never a token, and never usable for a correctness decision
    /// (FR-07).
    Inspect {
        /// The running railguard's config file (for lock.listen).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// The lock key (by default the account id, see fencing.lock_key_template).
        key: String,
    },
    /// Read one account's high-water mark from the running railguard's admin listener — for
    /// an operator diagnosing a fenced-out account. Only the admin listener offers it: a
    /// worker must never learn a mark (ADR-002 §A2.3).
    Marks {
        /// The running railguard's config file (for admin.listen).
        #[arg(long, short)]
        config: Option<PathBuf>,
        account: String,
    },
    /// Move the lock backend's token source past every fencing mark (C1 §1.7), before traffic
    /// resumes after a restore of lockdb or a switch of `lock.backend`: PostgreSQL by setval,
    /// etcd by writes to a scratch key (with progress; safe to interrupt and run again). Then
    /// a fresh draw must come out above the marks. Exit 0: done and verified; 3: nothing to
    /// do (already above); 1: failed or interrupted (run it again); 2: bad config or flags.
    FastForward {
        /// The config of the railguard whose source to move: `lock.backend` (the one being
        /// switched to), `[etcd]`, and `[database]` for the marks.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Also pass max(COLUMN) of this paydb table (the fenced UPDATE's fence, C1 §1.6).
        #[arg(long, requires = "paydb_table")]
        paydb_url: Option<String>,
        /// The paydb table (`table` or `schema.table`).
        #[arg(long, default_value = "account", requires = "paydb_url")]
        paydb_table: String,
        /// The paydb column holding each row's fencing token.
        #[arg(long, default_value = "fence")]
        paydb_column: String,
        /// Print what would be done and move nothing (exit 0 if something would be done, 3
        /// if nothing). Like every command that opens the database, it applies pending schema
        /// migrations first (`railguard migrate --status` shows them without applying).
        #[arg(long)]
        dry_run: bool,
    },
    /// Make a poisoned account payable again: its mark is above anything the token source
    /// has issued, so every grant of its lock key is fenced out. Moves the token source past
    /// that mark (never lowering any mark) through the running railguard's admin listener,
    /// recorded in railguard_audit with REASON. Exit 0 when recovered or nothing was needed.
    RecoverAccount {
        /// The running railguard's config file (for admin.listen).
        #[arg(long, short)]
        config: Option<PathBuf>,
        account: String,
        /// Why, for the audit record (required).
        #[arg(long)]
        reason: String,
    },
    /// Apply pending database migrations, bring indexes up to date (built without blocking
    /// writes), and exit (serve does both too, the indexes in the background).
    Migrate {
        /// TOML config file; only `[database]` and `[log]` are used.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// List every migration and whether it is applied, pending or changed, and apply
        /// nothing. Exit 0 when the schema is current, 1 when it is not. Needs a
        /// `postgres://` database.url: the embedded database is private to `railguard serve`
        /// (whose /readyz says whether its schema is current).
        #[arg(long)]
        status: bool,
    },
    /// Remove an idempotency record left "in doubt" (its forward ended without the rail's
    /// answer), so that a retry of that key is forwarded again. Follow the procedure below: if
    /// the payment did happen, forgetting the key lets it happen twice. Asks a running
    /// railguard (its admin listener), which refuses while the record's owner may still send
    /// it or what it sent may still reach the rail, and says until when.
    #[command(after_help = railguard::admin::IN_DOUBT_PROCEDURE)]
    IdempotencyForget {
        /// The running railguard's config file (for admin.listen).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// The account the key belongs to (the Fencing-Account of the request).
        #[arg(long)]
        account: String,
        /// The Idempotency-Key.
        #[arg(long)]
        key: String,
        /// Only when forget answers that nothing shows the record's owner has stopped (it
        /// crashed, or may be paused): the owner's instance, named in that answer and logged by
        /// that railguard when it started, once you have seen that process stop. Paused is not
        /// stopped. An owner holding its instance lock is refused whatever this says; the audit
        /// record says the forget rested on your word. `unrecorded` is for a record that names
        /// no owner (made by a railguard older than migration 0004): every railguard running
        /// when it was made has stopped.
        #[arg(long, value_name = "INSTANCE|unrecorded")]
        owner_stopped: Option<railguard::proxy::idempotency::OwnerStopped>,
        /// Decide and change nothing: say whether the record would be forgotten now, or why
        /// not and until when (step 2 of the procedure). Exit 0 if it would be, 1 if not.
        #[arg(long)]
        dry_run: bool,
    },
    /// Make a new bearer secret for the credentials file (`[auth] credentials_file`): prints
    /// the secret (give it to the worker or operator, once) and the `sha256:` line to list
    /// in the file. railguard never stores or logs the secret itself.
    CredentialsNewSecret,
    /// Run the rail simulator: a non-idempotent rail that accepts every POST as a new payment
    /// and lists what it received at GET /ledger.
    RailSim {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:9090")]
        listen: SocketAddr,
        /// Delay before answering each payment, to make overlaps visible.
        #[arg(long, default_value_t = 0)]
        latency_ms: u64,
        /// Random delay up to this long before a payment is recorded, so that requests can
        /// arrive in a different order than they were sent.
        #[arg(long, default_value_t = 0)]
        jitter_ms: u64,
        /// Behave like a payment API that deduplicates by Idempotency-Key: a second POST with
        /// a key already seen on the account is answered with the first one's response and is
        /// not a new payment.
        #[arg(long)]
        dedupe_idempotency_keys: bool,
    },
    /// The M4 fault harness: real worker processes, real faults, a recorded history and an
    /// independent checker (`railguard harness --help`). Runs `railguard-harness`, built
    /// beside this binary (`cargo build -p railguard-harness`).
    #[command(disable_help_flag = true)]
    Harness {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum DemoBackend {
    Postgres,
    Etcd,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Harness { args } = &cli.command {
        return harness(args);
    }
    // `serve` reads its configuration before the runtime starts: `runtime.worker_threads`
    // decides how the runtime is built.
    let served = match &cli.command {
        Command::Serve { config } => {
            let path = config_path(config.clone());
            match read(&path) {
                Ok((config, env)) => {
                    let log = telemetry::init(
                        config.log.format,
                        &config.log.level,
                        rust_log().as_deref(),
                    );
                    Some((config, env, log, path.path))
                }
                Err(code) => return code,
            }
        }
        _ => None,
    };
    // Always set, so that tokio never reads `TOKIO_WORKER_THREADS` (it panics on a bad value):
    // the configuration is the one place this is decided.
    let threads = match served
        .as_ref()
        .map_or(0, |(c, ..)| c.runtime.worker_threads)
    {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let runtime = match build_runtime(threads) {
        Ok(runtime) => runtime,
        Err(e) => return fail(&format!("cannot start the async runtime: {e}")),
    };
    let code = runtime.block_on(async move {
        match cli.command {
            Command::Demo { backend, ttl_ms } => {
                // The narration is the point: railguard's own logs only from warn up.
                telemetry::init(LogFormat::Pretty, "warn", rust_log().as_deref());
                let options = DemoOptions {
                    backend: match backend {
                        DemoBackend::Postgres => LockBackendKind::Postgres,
                        DemoBackend::Etcd => LockBackendKind::Etcd,
                    },
                    ttl: Duration::from_millis(ttl_ms),
                    search_path: search_path(),
                };
                match demo::run(options).await {
                    Ok(Verdict::Passed) => ExitCode::SUCCESS,
                    Ok(Verdict::Failed(_)) => ExitCode::FAILURE,
                    Err(e) => {
                        eprintln!("railguard demo: {e}");
                        ExitCode::from(e.exit_code())
                    }
                }
            }
            Command::Serve { .. } => {
                let (config, env, log, path) = served.expect("loaded before the runtime started");
                // Installed before binding, so that a signal during start-up is not lost, and
                // a SIGHUP then never ends the process.
                let shutdown = server::shutdown_signal();
                let reload = railguard::reload::Reload {
                    path,
                    env,
                    log,
                    requests: server::hangup_requests(),
                };
                let listeners = match server::Listeners::bind(&config).await {
                    Ok(l) => l,
                    Err(e) => return fail(&e),
                };
                match server::run_reloading(listeners, config, shutdown, Some(reload)).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => fail(&e),
                }
            }
            Command::IdempotencyForget {
                config,
                account,
                key,
                owner_stopped,
                dry_run,
            } => {
                let config = match load(&config_path(config)) {
                    Ok(c) => c,
                    Err(code) => return code,
                };
                match railguard::admin::forget_idempotency_key(
                    &admin_endpoint(&config),
                    &account,
                    &key,
                    owner_stopped,
                    dry_run,
                )
                .await
                {
                    Ok(message) => {
                        println!("{message}");
                        ExitCode::SUCCESS
                    }
                    Err(message) => fail(&message),
                }
            }
            Command::CredentialsNewSecret => {
                let secret = railguard::auth::secret::generate();
                println!("secret: {secret}");
                println!(
                    "for the credentials file: secrets = [\"{}\"]",
                    railguard::auth::secret::digest_text(&secret)
                );
                ExitCode::SUCCESS
            }
            Command::CheckConfig { config, print } => {
                let path = config_path(config);
                match load(&path) {
                    Ok(config) => {
                        let file = path.path.display();
                        match tls_files(&config).and_then(|()| check_credentials(&config)) {
                            Ok(identities) => {
                                for (key, why) in config.warnings() {
                                    eprintln!("railguard: warning: {file}: {key}: {why}");
                                }
                                let ok = format!("{file}: ok — {}{identities}", summary(&config));
                                if print {
                                    #[allow(clippy::disallowed_methods)]
                                    // main reads the environment
                                    let vars = std::env::vars_os();
                                    let text = match railguard::config::Effective::render(
                                        &path.path, vars,
                                    ) {
                                        Ok(text) => format!("{text}\n# {ok}\n"),
                                        Err(e) => {
                                            eprintln!("railguard: configuration error: {e}");
                                            return ExitCode::from(2);
                                        }
                                    };
                                    // A reader that stops early (`| head`) is not an error.
                                    use std::io::Write as _;
                                    return match std::io::stdout().lock().write_all(text.as_bytes())
                                    {
                                        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                                            fail(&e)
                                        }
                                        _ => ExitCode::SUCCESS,
                                    };
                                }
                                println!("{ok}");
                                ExitCode::SUCCESS
                            }
                            Err(e) => {
                                eprintln!("railguard: configuration error: {file}: {e}");
                                ExitCode::from(2)
                            }
                        }
                    }
                    Err(code) => code,
                }
            }
            Command::Marks { config, account } => {
                let config = match load(&config_path(config)) {
                    Ok(c) => c,
                    Err(code) => return code,
                };
                match railguard::admin::read_mark(&admin_endpoint(&config), &account).await {
                    Ok(0) => {
                        println!("{account}: no mark (no token accepted yet)");
                        ExitCode::SUCCESS
                    }
                    Ok(mark) => {
                        println!("{account}: mark {mark}");
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(&format!("marks {account}: {e}")),
                }
            }
            Command::Inspect { config, key } => {
                let config = match load(&config_path(config)) {
                    Ok(c) => c,
                    Err(code) => return code,
                };
                let listen = config.lock.listen;
                if config.lock.listener.settings().tls.is_some() {
                    return fail(&format!(
                        "inspect {key}: the lock listener at {listen} serves TLS only \
                         (lock.tls_cert_file) and this command speaks plain HTTP: nothing was \
                         sent (not ${} either)",
                        railguard::admin::SECRET_VAR
                    ));
                }
                let host = if listen.ip().is_unspecified() {
                    SocketAddr::from(([127, 0, 0, 1], listen.port()))
                } else {
                    listen
                };
                let mut client = railguard::sdk::LockClient::new(format!("http://{host}"))
                    .with_timeout(Duration::from_secs(5));
                if let Some(secret) = cli_secret() {
                    client = match client.with_bearer(&secret) {
                        Ok(client) => client,
                        Err(e) => return fail(&format!("${}: {e}", railguard::admin::SECRET_VAR)),
                    };
                }
                match client.inspect(&key).await {
                    Ok(status) => {
                        println!("{}", describe(&status));
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(&format!("inspect {key} at http://{host}: {e}")),
                }
            }
            Command::Migrate {
                config,
                status: true,
            } => {
                let config = match load(&config_path(config)) {
                    Ok(c) => c,
                    Err(code) => return code,
                };
                migration_status(&config).await
            }
            Command::Migrate { config, .. } => {
                let config = match load(&config_path(config)) {
                    Ok(c) => c,
                    Err(code) => return code,
                };
                match Database::open(&config.database).await {
                    Ok(db) => {
                        tracing::info!(
                            version = railguard::db::migrate::latest_version(),
                            "schema is current"
                        );
                        // Index changes that `serve` would make in the background, made here
                        // and waited for (ahead of a rollout, on a large table). Not needed to
                        // serve: their failure is reported, not fatal.
                        use railguard::db::maintenance::{Maintenance, run_once};
                        let mut said_busy = false;
                        loop {
                            match run_once(&db.url, config.database.timeout).await {
                                Ok(Maintenance::Done { .. }) => {
                                    tracing::info!("indexes are current");
                                    break;
                                }
                                // A railguard at it, or the server session of one killed
                                // mid-build finishing it: waited for.
                                Ok(Maintenance::Busy) => {
                                    if !said_busy {
                                        tracing::info!(
                                            "another session is bringing the indexes up to \
                                             date; waiting for it"
                                        );
                                        said_busy = true;
                                    }
                                    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                                }
                                Err(e) => {
                                    tracing::warn!(error = %e,
                                        "could not bring the indexes up to date; `serve` retries");
                                    break;
                                }
                            }
                        }
                        db.shutdown().await;
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(&e),
                }
            }
            Command::FastForward {
                config,
                paydb_url,
                paydb_table,
                paydb_column,
                dry_run,
            } => {
                let config = match load(&config_path(config)) {
                    Ok(c) => c,
                    Err(code) => return code,
                };
                let paydb = match paydb_url {
                    None => None,
                    Some(url) => {
                        let checked =
                            fast_forward::parse_identifier(&paydb_table, "--paydb-table", true)
                                .and_then(|table| {
                                    fast_forward::parse_identifier(
                                        &paydb_column,
                                        "--paydb-column",
                                        false,
                                    )
                                    .map(|column| fast_forward::PaydbFence { url, table, column })
                                });
                        match checked {
                            Ok(p) => Some(p),
                            Err(e) => {
                                eprintln!("railguard fast-forward: {e}");
                                return ExitCode::from(2);
                            }
                        }
                    }
                };
                run_fast_forward(&config, paydb, dry_run).await
            }
            Command::RecoverAccount {
                config,
                account,
                reason,
            } => {
                let config = match load(&config_path(config)) {
                    Ok(c) => c,
                    Err(code) => return code,
                };
                match railguard::admin::recover_account(&admin_endpoint(&config), &account, &reason)
                    .await
                {
                    Ok(answer) => {
                        println!("{answer}");
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(&format!("recover-account {account}: {e}")),
                }
            }
            Command::Harness { .. } => unreachable!("handled before the runtime starts"),
            Command::RailSim {
                listen,
                latency_ms,
                jitter_ms,
                dedupe_idempotency_keys,
            } => {
                telemetry::init(LogFormat::Pretty, "info", rust_log().as_deref());
                let listener = match tokio::net::TcpListener::bind(listen).await {
                    Ok(l) => l,
                    Err(e) => return fail(&format!("cannot listen on {listen}: {e}")),
                };
                let mut sim = RailSim::new(Duration::from_millis(latency_ms))
                    .with_jitter(Duration::from_millis(jitter_ms));
                if dedupe_idempotency_keys {
                    sim = sim.deduplicating();
                }
                tracing::info!(%listen, latency_ms, jitter_ms, "rail simulator listening");
                http::serve(
                    listener,
                    move |_peer| {
                        let sim = sim.clone();
                        hyper::service::service_fn(move |request| sim.clone().handle(request))
                    },
                    server::shutdown_signal(),
                    Duration::from_secs(5),
                )
                .await;
                ExitCode::SUCCESS
            }
        }
    });
    // Dropping a runtime waits for every `spawn_blocking` task still running, however long: a
    // TLS listener's check of its certificate files on a mount that hangs would keep a process
    // that has already drained and closed everything from ever exiting. What is left by now is
    // background work whose result nobody waits for.
    runtime.shutdown_timeout(BLOCKING_WORK_AT_EXIT);
    code
}

/// How long the end of a command waits for blocking work still running (see `main`).
const BLOCKING_WORK_AT_EXIT: Duration = Duration::from_secs(2);

/// Replaces this process with `railguard-harness` from beside this binary (as `git foo` runs
/// `git-foo`): the harness links the test kit, which the server binary does not.
#[allow(clippy::disallowed_methods)] // main finds its own executable
fn harness(args: &[std::ffi::OsString]) -> ExitCode {
    use std::os::unix::process::CommandExt;
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("railguard-harness")));
    let Some(binary) = beside.filter(|b| b.is_file()) else {
        eprintln!(
            "railguard: railguard-harness is not built beside this binary; build it with \
             `cargo build --release -p railguard-harness` (or use scripts/harness.sh)"
        );
        return ExitCode::from(2);
    };
    let error = std::process::Command::new(&binary).args(args).exec();
    eprintln!("railguard: cannot run {}: {error}", binary.display());
    ExitCode::from(2)
}

/// `railguard fast-forward`: see the command's help.
async fn run_fast_forward(
    config: &Config,
    paydb: Option<fast_forward::PaydbFence>,
    dry_run: bool,
) -> ExitCode {
    use fast_forward::{FastForward, ProgressLine};
    use std::io::{IsTerminal, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    let database = match Database::open(&config.database).await {
        Ok(db) => db,
        Err(e) => return fail(&e),
    };
    let timeout = config.database.timeout.max(Duration::from_secs(5));
    let lock_database = railguard::lock::LockDatabase {
        pool: &database.pool,
        url: &database.url,
        timeout,
    };
    let source =
        railguard::lock::token_source(&config.lock, &config.etcd, &config.guard, &lock_database);
    let outcome = async {
        let target = fast_forward::target(&database.pool, timeout, paydb.as_ref()).await?;
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let interrupt = {
            let stop = stop.clone();
            tokio::spawn(async move {
                server::shutdown_signal().await;
                eprintln!("\ninterrupted: stopping the writes in flight");
                stop.store(true, Ordering::Relaxed);
            })
        };
        let line = ProgressLine::default();
        let terminal = std::io::stderr().is_terminal();
        let last = std::sync::Mutex::new(std::time::Instant::now());
        let progress = |p| {
            let mut last = last.lock().expect("progress");
            if terminal {
                eprint!("\r{}   ", line.render(p));
                let _ = std::io::stderr().flush();
            } else if last.elapsed() >= Duration::from_secs(2) || p.position >= p.target {
                *last = std::time::Instant::now();
                eprintln!("{}", line.render(p));
            }
        };
        println!(
            "token source: {} ({}); highest fencing mark{}: {target}",
            source.name(),
            if source.name() == "etcd" {
                "cluster revision"
            } else {
                "fencing_token_seq"
            },
            if paydb.is_some() {
                " (railguard and paydb)"
            } else {
                ""
            },
        );
        let result = fast_forward::fast_forward(&source, target, dry_run, &progress, &stop).await;
        if terminal {
            eprintln!();
        }
        interrupt.abort();
        result
    }
    .await;
    database.shutdown().await;
    match outcome {
        Ok(FastForward::NothingToDo { position, target }) => {
            println!("nothing to do: the source is at {position}, above {target}");
            ExitCode::from(3)
        }
        Ok(FastForward::WouldMove { position, target }) => {
            let how = match source.name() {
                "etcd" => format!(
                    "about {} writes to the scratch key {}",
                    target + 1 - position,
                    match &source {
                        railguard::lock::source::TokenSource::Etcd { scratch_key, .. } => {
                            scratch_key.as_str()
                        }
                        _ => "",
                    }
                ),
                _ => format!("setval('fencing_token_seq', {})", target + 1),
            };
            println!("dry run: would move the source from {position} past {target}: {how}");
            ExitCode::SUCCESS
        }
        Ok(FastForward::Done {
            from,
            target,
            drawn,
        }) => {
            println!(
                "done: moved the source from {from} past {target}; a fresh draw came out at \
                 {drawn}. Grants resume at each railguard's next guard check."
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(&format!("fast-forward: {e}")),
    }
}

/// `railguard migrate --status`: read only.
async fn migration_status(config: &Config) -> ExitCode {
    use railguard::db::migrate::{self, MigrationState};
    let railguard::config::DatabaseUrl::Postgres(_) = &config.database.url else {
        return fail(
            &"migrate --status needs database.url = \"postgres://…\": the embedded database is \
              private to `railguard serve`; its /readyz says whether the schema is current",
        );
    };
    let timeout = config.database.timeout.max(Duration::from_secs(2));
    let url = railguard::db::url_of(&config.database);
    let connected = tokio::time::timeout(timeout, railguard::db::connect(&url, timeout)).await;
    let client = match connected {
        Ok(Ok((client, _connection))) => client,
        Ok(Err(e)) => return fail(&format!("database.url: {e}")),
        Err(_) => return fail(&"database.url: no answer from the database"),
    };
    let list = match migrate::status(&client).await {
        Ok(list) => list,
        Err(e) => return fail(&format!("cannot read the schema's migrations: {e}")),
    };
    let mut current = true;
    for (version, name, state) in &list {
        let what = match state {
            MigrationState::Applied { applied_at } => format!("applied {applied_at}"),
            MigrationState::Changed { applied_at } => {
                current = false;
                format!("CHANGED since it was applied {applied_at}: railguard will not start")
            }
            MigrationState::Pending => {
                current = false;
                "pending (railguard migrate, or serve, applies it)".to_string()
            }
            MigrationState::Unknown { applied_at, .. } => {
                current = false;
                format!("applied {applied_at} by a newer railguard: this binary will not start")
            }
        };
        println!("{version:04} {name:<36} {what}");
    }
    if current {
        println!("schema is current (version {})", migrate::latest_version());
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// A key's status for people: who holds it and for how long — no token (FR-07).
fn describe(status: &railguard::sdk::KeyStatus) -> String {
    if !status.held {
        return format!("{}: free", status.key);
    }
    let mut line = format!(
        "{}: held by {}",
        status.key,
        status.holder.as_deref().unwrap_or("?")
    );
    if let Some(left) = status.lease_remaining_ms {
        line.push_str(&format!(", lease {left} ms left"));
    }
    if let Some(age) = status.grant_age_ms {
        line.push_str(&format!(", granted {age} ms ago"));
    }
    line
}

/// What a config makes railguard do, in one line (no credentials: the database URL is not
/// printed).
fn summary(config: &Config) -> String {
    let database = match &config.database.url {
        railguard::config::DatabaseUrl::Embedded => {
            format!(
                "embedded PostgreSQL in {}",
                config.database.data_dir.display()
            )
        }
        railguard::config::DatabaseUrl::Postgres(_) => "PostgreSQL by URL".to_string(),
    };
    format!(
        "proxy {} → {}, lock API {} ({} backend), admin {}, database: {database}, fencing {}",
        config.proxy.listen,
        config.proxy.upstream,
        config.lock.listen,
        config.lock.backend.name(),
        config.admin.listen,
        if config.fencing.enforce {
            "enforced"
        } else {
            "OFF (kill switch)"
        }
    )
}

/// `RUST_LOG`, which wins over `log.level` when set.
#[allow(clippy::disallowed_methods)] // main reads the environment
fn rust_log() -> Option<String> {
    std::env::var("RUST_LOG").ok()
}

/// `PATH`, where the demo looks for `etcd`.
#[allow(clippy::disallowed_methods)] // main reads the environment
fn search_path() -> Option<std::ffi::OsString> {
    std::env::var_os("PATH")
}

/// The variable that names the config file when `--config` is not given.
const CONFIG_VAR: &str = "RAILGUARD_CONFIG";

/// Where the config file is read from when neither `--config` nor `$RAILGUARD_CONFIG` says.
const DEFAULT_CONFIG: &str = "config/railguard.toml";

/// The config file a command reads, and what named it.
struct ConfigPath {
    path: PathBuf,
    from: ConfigFrom,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ConfigFrom {
    Flag,
    Variable,
    Default,
}

/// `--config`, else `$RAILGUARD_CONFIG` (if set and not empty), else [`DEFAULT_CONFIG`].
#[allow(clippy::disallowed_methods)] // main reads the environment
fn config_path(flag: Option<PathBuf>) -> ConfigPath {
    if let Some(path) = flag {
        return ConfigPath {
            path,
            from: ConfigFrom::Flag,
        };
    }
    match std::env::var_os(CONFIG_VAR).filter(|v| !v.is_empty()) {
        Some(path) => ConfigPath {
            path: path.into(),
            from: ConfigFrom::Variable,
        },
        None => ConfigPath {
            path: DEFAULT_CONFIG.into(),
            from: ConfigFrom::Default,
        },
    }
}

/// Reads the config file with the process environment's `RAILGUARD__…` overrides; returns
/// them too (a reload applies the same ones).
#[allow(clippy::disallowed_methods)] // main reads the environment
fn read(path: &ConfigPath) -> Result<(Config, BTreeMap<String, String>), ExitCode> {
    let loaded = railguard::config::overrides_from(std::env::vars_os())
        .and_then(|env| Config::load(&path.path, &env).map(|config| (config, env)));
    loaded.map_err(|e| {
        let unreadable = e.key.is_none() && e.message.starts_with("cannot read the file");
        let hint = match path.from {
            ConfigFrom::Default if unreadable => format!(
                "\nrailguard: without --config or ${CONFIG_VAR}, railguard reads \
                 {DEFAULT_CONFIG} relative to the working directory{}: run it from the \
                 repository, pass --config PATH, or set {CONFIG_VAR}=PATH",
                std::env::current_dir()
                    .map(|dir| format!(" ({})", dir.display()))
                    .unwrap_or_default()
            ),
            ConfigFrom::Variable if unreadable => {
                format!("\nrailguard: this path came from ${CONFIG_VAR}")
            }
            _ => String::new(),
        };
        eprintln!("railguard: configuration error: {e}{hint}");
        ExitCode::from(2)
    })
}

/// [`read`], then starts logging as the configuration says.
fn load(path: &ConfigPath) -> Result<Config, ExitCode> {
    let (config, _) = read(path)?;
    telemetry::init(config.log.format, &config.log.level, rust_log().as_deref());
    Ok(config)
}

/// `$RAILGUARD_SECRET`, if set and not empty: the bearer secret the operator commands send.
#[allow(clippy::disallowed_methods)] // main reads the environment
fn cli_secret() -> Option<String> {
    std::env::var(railguard::admin::SECRET_VAR)
        .ok()
        .filter(|s| !s.trim().is_empty())
}

fn admin_endpoint(config: &Config) -> railguard::admin::AdminEndpoint {
    railguard::admin::AdminEndpoint {
        addr: config.admin.listen,
        secret: cli_secret(),
        tls: config.admin.listener.settings().tls.is_some(),
    }
}

/// Reads the credentials file, if there is one: what `check-config` adds to its summary.
fn check_credentials(config: &Config) -> Result<String, String> {
    if !config.auth.enabled() {
        return Ok(", authentication off".into());
    }
    let template = &config.fencing.lock_key_template;
    let shape = railguard::auth::LockKeyShape {
        prefix: template.prefix().to_string(),
        suffix: template.suffix().to_string(),
    };
    let credentials = railguard::auth::Credentials::load(&config.auth.credentials_file, &shape)
        .map_err(|e| format!("auth.credentials_file: {e}"))?;
    Ok(format!(", {} identities", credentials.names().len()))
}

/// Reads the TLS files the config names (the rail's; the database URL's `sslmode` and CA), as
/// `serve` will, without connecting to anything.
fn tls_files(config: &Config) -> Result<(), String> {
    railguard::tls::client::rail_tls(&config.proxy).map_err(|e| e.to_string())?;
    if let railguard::config::DatabaseUrl::Postgres(_) = &config.database.url {
        railguard::tls::postgres::connect_config(&railguard::db::url_of(&config.database))
            .map_err(|e| format!("database.url: {e}"))?;
    }
    Ok(())
}

/// The multi-threaded runtime with `threads` workers. tokio panics, rather than returning an
/// error, when the system refuses a worker thread (a process or memory limit below what
/// `runtime.worker_threads` asks for), and the unwinding then waits forever for the workers
/// already started. So while it builds, a panic ends the process at once with a message.
fn build_runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let cause = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("a panic");
        eprintln!(
            "railguard: cannot start the async runtime with {threads} worker threads \
             (runtime.worker_threads): {cause}"
        );
        std::process::exit(1);
    }));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build();
    std::panic::set_hook(default_hook);
    runtime
}

fn fail(error: &dyn std::fmt::Display) -> ExitCode {
    tracing::error!("{error}");
    eprintln!("railguard: {error}");
    ExitCode::FAILURE
}
