//! Runs the checker at bounds given on the command line: the exhaustive runs behind the
//! numbers in `docs/protocol.md`, at sizes too big for CI.
//!
//! ```text
//! cargo run --release -p railguard-model -- [--backend postgres|etcd|both] [--workers N]
//!     [--accounts N] [--acquires N] [--grants N] [--payments N] [--retries N]
//!     [--proxies N] [--restarts N] [--lossy | --no-loss] [--postgres-goes-back]
//!     [--etcd-goes-back]
//!     [--variant NAME|all] [--threads N] [--no-symmetry]
//! ```
//!
//! The bounds start from `Bounds::THREE_WORKERS` (CI's) and each flag changes one of them;
//! `--postgres-goes-back` and `--etcd-goes-back` let that store go back once to an earlier copy
//! (etcd's only on the etcd backend).
//! Without `--variant` it checks the protocol as designed, up to a renaming of workers unless
//! `--no-symmetry`, and fails (exit 1) on any violation or unreached `sometimes`;
//! `--variant all` checks every variant at the given bounds (breadth-first, one thread) and
//! fails if one is not caught. Variant names are the `Variant` names in kebab case
//! (`reread-token-at-write`, `no-forward-order`, …).

use std::process::ExitCode;

use railguard_model::{Backend, Bounds, FencingModel, Variant, run};

fn kebab(variant: Variant) -> String {
    let mut out = String::new();
    for (i, c) in format!("{variant:?}").chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('-');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

struct Args {
    backends: Vec<Backend>,
    bounds: Bounds,
    variants: Vec<Variant>,
    threads: usize,
    symmetry: bool,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut parsed = Args {
        backends: vec![Backend::Postgres, Backend::Etcd],
        bounds: Bounds::THREE_WORKERS,
        variants: Vec::new(),
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        symmetry: true,
    };
    let number = |value: Option<String>, flag: &str| -> Result<u8, String> {
        value
            .ok_or(format!("{flag} needs a value"))?
            .parse()
            .map_err(|e| format!("{flag}: {e}"))
    };
    while let Some(flag) = args.next() {
        let b = &mut parsed.bounds;
        match flag.as_str() {
            "--backend" => {
                parsed.backends = match args.next().as_deref() {
                    Some("postgres") => vec![Backend::Postgres],
                    Some("etcd") => vec![Backend::Etcd],
                    Some("both") => vec![Backend::Postgres, Backend::Etcd],
                    other => return Err(format!("--backend: {other:?}")),
                }
            }
            "--workers" => b.workers = number(args.next(), &flag)?,
            "--accounts" => b.accounts = number(args.next(), &flag)?,
            "--acquires" => b.acquires_per_worker = number(args.next(), &flag)?,
            "--grants" => b.max_grants = number(args.next(), &flag)?,
            "--payments" => b.payments_per_account = number(args.next(), &flag)?,
            "--retries" => b.retries = number(args.next(), &flag)?,
            "--proxies" => b.proxies = number(args.next(), &flag)?,
            "--restarts" => b.restarts = number(args.next(), &flag)?,
            "--lossy" => b.lossy = true,
            "--postgres-goes-back" => b.postgres_goes_back = true,
            "--etcd-goes-back" => b.etcd_goes_back = true,
            "--no-symmetry" => parsed.symmetry = false,
            "--no-loss" => b.lossy = false,
            "--threads" => parsed.threads = number(args.next(), &flag)?.into(),
            "--variant" => {
                let name = args.next().ok_or("--variant needs a value")?;
                parsed.variants = if name == "all" {
                    Variant::ALL.to_vec()
                } else {
                    vec![
                        *Variant::ALL
                            .iter()
                            .find(|v| kebab(**v) == name)
                            .ok_or(format!("unknown variant {name}"))?,
                    ]
                };
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(parsed)
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("railguard-model: {e}");
            return ExitCode::from(2);
        }
    };
    let mut failed = false;
    if args.variants.is_empty() {
        for backend in args.backends {
            let mut model = FencingModel::correct(backend, args.bounds);
            if args.symmetry {
                model = model.with_symmetry();
            }
            let outcome = run(model, args.threads, None);
            println!("{}", outcome.summary());
            for name in outcome.violations() {
                failed = true;
                println!(
                    "VIOLATED {name}:\n{}",
                    outcome.trace(name).unwrap_or_default()
                );
            }
            for name in outcome.unreached() {
                failed = true;
                println!("UNREACHED {name}");
            }
        }
    }
    for variant in args.variants {
        let outcome = run(
            FencingModel::with_variant(variant, args.bounds),
            1,
            Some(variant.breaks()),
        );
        println!("{}", outcome.summary());
        match outcome.trace(variant.breaks()) {
            Some(trace) => println!("caught: {}\n{trace}", variant.breaks()),
            None => {
                failed = true;
                println!("NOT CAUGHT: {}", variant.breaks());
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
