//! railguard's command line as a newcomer and an operator meet it, run as the real binary:
//! every command's help (a one-line summary, then details; help for every argument), shell
//! completions and the manual page, commands named in the docs that exist, flags' defaults
//! that hold, and an error said once.

use railguard_testkit as support;

use std::path::Path;
use std::process::Output;

/// `railguard ARGS`, with no configuration or log filter from the test's environment.
fn railguard(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_railguard"))
        .args(args)
        .env_remove("RAILGUARD_CONFIG")
        .env_remove("RUST_LOG")
        .output()
        .expect("run the railguard binary")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `railguard args`, which must exit 2 (a usage error) with `says` in its stderr.
#[track_caller]
fn usage_error(args: &[&str], says: &str) {
    let unknown = railguard(args);
    assert_eq!(unknown.status.code(), Some(2), "{unknown:?}");
    assert!(stderr(&unknown).contains(says), "{unknown:?}");
}

/// The lines of `text` from the one after `heading` to the next blank line.
fn section<'a>(text: &'a str, heading: &str) -> Vec<&'a str> {
    text.lines()
        .skip_while(|line| *line != heading)
        .skip(1)
        .take_while(|line| !line.is_empty())
        .collect()
}

/// Every command `railguard --help` lists, with its summary there (`help` left out).
fn commands() -> Vec<(String, String)> {
    let out = railguard(&["--help"]);
    assert!(out.status.success(), "{out:?}");
    let help = stdout(&out);
    let listed: Vec<(String, String)> = section(&help, "Commands:")
        .into_iter()
        .map(|line| {
            assert!(
                line.starts_with("  ") && !line.starts_with("   "),
                "each command's summary fits on its line in the list: {line:?} in\n{help}"
            );
            let (name, summary) = line.trim().split_once(' ').unwrap_or((line.trim(), ""));
            (name.to_string(), summary.trim().to_string())
        })
        .filter(|(name, _)| name != "help")
        .collect();
    assert!(listed.len() >= 12, "{help}");
    listed
}

/// Each command's help starts with a one-line summary (the one the list shows), then a blank
/// line, then the details; `serve`'s summary names both things it serves to workers.
#[test]
fn every_command_has_a_one_line_summary_then_details() {
    for (name, listed) in commands() {
        let out = railguard(&["help", &name]);
        assert!(out.status.success(), "{name}: {out:?}");
        let help = stdout(&out);
        let lines: Vec<&str> = help.lines().collect();
        assert!(
            !listed.is_empty() && listed.len() <= 74 && lines[0].trim_end_matches('.') == listed,
            "{name}: a short summary, the same in the list ({listed:?}) and first in its help:\n{help}"
        );
        assert_eq!(
            lines[1], "",
            "{name}: a blank line after the summary:\n{help}"
        );
        assert!(
            !lines[2].is_empty() && !lines[2].starts_with("Usage:"),
            "{name}: details after the summary:\n{help}"
        );
    }
    let serve = railguard(&["help", "serve"]);
    let summary = stdout(&serve)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string();
    assert!(
        summary.contains("proxy") && summary.contains("lock API"),
        "{summary}"
    );
}

/// Every argument and option of every command says what it is.
#[test]
fn every_argument_of_every_command_has_help() {
    for (name, _) in commands() {
        let help = stdout(&railguard(&["help", &name]));
        let mut entries = 0;
        for heading in ["Arguments:", "Options:"] {
            let lines: Vec<&str> = help
                .lines()
                .skip_while(|line| *line != heading)
                .skip(1)
                .take_while(|line| line.is_empty() || line.starts_with(' '))
                .collect();
            for (i, line) in lines.iter().enumerate() {
                let entry = line.starts_with("  ") && !line.starts_with("   ");
                if !entry {
                    continue;
                }
                entries += 1;
                // Its help is on the same line, after two spaces, or indented on the next.
                let inline = line.trim().contains("  ");
                let below = lines
                    .get(i + 1)
                    .is_some_and(|next| next.starts_with("   ") && !next.trim().is_empty());
                assert!(
                    inline || below,
                    "{name}: {:?} has no help:\n{help}",
                    line.trim()
                );
            }
        }
        assert!(
            entries > 0,
            "{name}: no arguments or options found in\n{help}"
        );
    }
    // The ones an operator types most.
    let check = stdout(&railguard(&["check-config", "-h"]));
    assert!(
        check
            .lines()
            .any(|l| l.contains("-c, --config <CONFIG>") && l.contains("config file")),
        "{check}"
    );
    for command in ["marks", "recover-account"] {
        let help = stdout(&railguard(&[command, "-h"]));
        assert!(
            help.lines().any(|l| {
                l.trim_start().starts_with("<ACCOUNT>") && l.trim().len() > "<ACCOUNT>  ".len()
            }),
            "{command}: {help}"
        );
    }
}

/// `railguard completions SHELL` prints a script that completes every command and its flags.
#[test]
fn completions_cover_every_command_for_each_shell() {
    let names: Vec<String> = commands().into_iter().map(|(name, _)| name).collect();
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let out = railguard(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = stdout(&out);
        for name in &names {
            assert!(
                script.contains(name.as_str()),
                "{shell}: {name} in\n{script}"
            );
        }
        assert!(script.contains("paydb-url"), "{shell}: flags too");
    }
    usage_error(&["completions", "tcsh"], "tcsh");
}

/// `railguard man` prints railguard(1), listing every command; `railguard man COMMAND` that
/// command's page.
#[test]
fn the_manual_pages_are_roff_for_railguard_and_each_command() {
    let out = railguard(&["man"]);
    assert!(out.status.success(), "{out:?}");
    let page = stdout(&out);
    assert!(page.contains(".TH railguard 1"), "{page}");
    assert!(page.contains(".SH SUBCOMMANDS"), "{page}");
    for (name, _) in commands() {
        let escaped = format!("railguard\\-{}", name.replace('-', "\\-"));
        assert!(page.contains(&escaped), "{escaped} in\n{page}");
        let out = railguard(&["man", &name]);
        assert!(out.status.success(), "{name}: {out:?}");
        let sub = stdout(&out);
        assert!(
            sub.contains(&format!(".TH railguard-{name} 1")),
            "{name}:\n{sub}"
        );
        assert!(sub.contains(".SH SYNOPSIS"), "{name}:\n{sub}");
    }
    let fast_forward = stdout(&railguard(&["man", "fast-forward"]));
    assert!(fast_forward.contains("paydb"), "{fast_forward}");
    usage_error(&["man", "fastforward"], "fast-forward");
}

/// Every `` `railguard COMMAND `` in the README, the docs and the shipped config names a
/// command the binary has.
#[test]
fn the_docs_name_only_commands_that_exist() {
    let names: Vec<String> = commands().into_iter().map(|(name, _)| name).collect();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md"), root.join("config/railguard.toml")];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    let mut seen = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (at, _) in text.match_indices("`railguard ") {
            let word: String = text[at + "`railguard ".len()..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '-')
                .collect();
            if !word.starts_with(|c: char| c.is_ascii_lowercase()) {
                continue;
            }
            seen += 1;
            assert!(
                names.contains(&word) || word == "help",
                "{}: `railguard {word}` is not a command (the commands: {})",
                file.display(),
                names.join(", ")
            );
        }
    }
    assert!(seen > 20, "found only {seen} commands named in {files:?}");
}

/// A command's failure is said once on stderr, not once as a log line and again as a message:
/// an operator command's as `railguard: …`, `serve`'s as its log line.
#[test]
fn a_failure_is_said_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = support::config_without_a_database(dir.path(), "[log]\nlevel = \"info\"\n");
    let config = config.to_str().unwrap();

    // Nothing listens on the admin port.
    let marks = railguard(&["marks", "acct-once", "--config", config]);
    assert_eq!(marks.status.code(), Some(1), "{marks:?}");
    let text = stderr(&marks);
    assert_eq!(text.matches("marks acct-once").count(), 1, "{text}");
    assert!(text.starts_with("railguard: marks acct-once"), "{text}");

    // Nothing listens on the database's port.
    let serve = railguard(&["serve", "--config", config]);
    assert_eq!(serve.status.code(), Some(1), "{serve:?}");
    let text = stderr(&serve);
    assert_eq!(
        text.matches("cannot connect to PostgreSQL").count(),
        1,
        "{text}"
    );
    assert!(text.contains("ERROR"), "said as a log line: {text}");

    let status = railguard(&["migrate", "--status", "--config", config]);
    assert_eq!(status.status.code(), Some(1), "{status:?}");
    let text = stderr(&status);
    assert_eq!(
        text.matches("cannot connect to PostgreSQL").count(),
        1,
        "{text}"
    );
}

/// A database that accepts connections and never answers their start-up (a stopped server
/// whose kernel still accepts, a proxy whose backend is gone) stops `serve` and `migrate` within
/// `database.timeout_ms`, saying so, instead of holding them silently for ever.
#[tokio::test]
async fn a_database_that_never_answers_stops_the_start_within_the_timeout_saying_so() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let holding = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let dir = tempfile::tempdir().unwrap();
    // database.timeout_ms = 500, as config_without_a_database writes it.
    let config = support::config_without_a_database(dir.path(), "");
    let url = format!("postgres://rg:pw@{silent_addr}/rg");
    for command in [&["serve"][..], &["migrate", "--status"][..]] {
        let run = tokio::process::Command::new(support::railguard_binary())
            .args(command)
            .arg("--config")
            .arg(&config)
            .env("RAILGUARD__DATABASE__URL", &url)
            .env_remove("RUST_LOG")
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(std::time::Duration::from_secs(20), run)
            .await
            .unwrap_or_else(|_| panic!("{command:?} still waits for the database after 20 s"))
            .expect("run railguard");
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{command:?}: {text}");
        // serve's limit is the file's database.timeout_ms; migrate --status waits at least 2 s.
        let limit = if command == ["serve"] { 500 } else { 2000 };
        assert!(
            text.contains(&format!("no connection within {limit} ms")),
            "{command:?} gave up at its limit: {text}"
        );
        assert!(
            text.contains(&format!(
                "cannot connect to PostgreSQL at postgres://rg@{silent_addr}/rg"
            )) && text.contains("no connection within")
                && text.contains("did not answer its start-up"),
            "{command:?} names the server and says what it did not do: {text}"
        );
    }
    holding.abort();
}

/// `fast-forward --paydb-url URL` alone uses the table and column its help shows as defaults
/// (`account`, `fence`); those flags without --paydb-url are refused.
#[tokio::test]
async fn fast_forward_uses_the_paydb_defaults_its_help_shows() {
    support::init_tracing();
    let pg = support::Pg::start().await;
    pg.client()
        .await
        .batch_execute(
            "CREATE TABLE account (id text PRIMARY KEY, fence bigint);
             INSERT INTO account VALUES ('a', 41), ('b', 777), ('c', NULL)",
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("rg.toml");
    std::fs::write(&config, format!("[database]\nurl = \"{}\"\n", pg.url())).unwrap();
    let config = config.to_str().unwrap();
    let help = stdout(&railguard(&["help", "fast-forward"]));
    assert!(
        help.contains("[default: account]") && help.contains("[default: fence]"),
        "{help}"
    );

    let url = pg.url();
    let out = railguard(&[
        "fast-forward",
        "--dry-run",
        "--paydb-url",
        &url,
        "--config",
        config,
    ]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}{}", stderr(&out));
    assert!(
        text.contains("highest fencing mark (railguard and paydb): 777"),
        "{text}"
    );
    assert!(text.contains("dry run: would move the source"), "{text}");

    for flag in ["--paydb-table", "--paydb-column"] {
        let out = railguard(&["fast-forward", flag, "x", "--config", config]);
        assert_eq!(out.status.code(), Some(2), "{flag}: {out:?}");
        assert!(stderr(&out).contains("--paydb-url"), "{flag}: {out:?}");
    }
}
