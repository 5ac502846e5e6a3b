//! `railguard check-config`, the `nginx -t` habit: a good file gets exit 0 and one line that
//! says what railguard would do; a bad one gets exit 2 naming the key and the file (or the
//! environment variable). Nothing is started either way.

use railguard_testkit as support;

use std::process::Command;

fn check(config: &std::path::Path, env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(support::railguard_binary())
        .args(["check-config", "--config"])
        .arg(config)
        .envs(env.iter().copied())
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_shipped_config_checks_ok_in_one_line() {
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/railguard.toml");
    let (code, stdout, stderr) = check(&shipped, &[]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    for part in [
        "railguard.toml: ok",
        "proxy 127.0.0.1:8080",
        "postgres backend",
        "fencing enforced",
    ] {
        assert!(stdout.contains(part), "{part} in {stdout}");
    }
    // An override is checked too, and shows.
    let (code, stdout, _) = check(&shipped, &[("RAILGUARD__FENCING__ENFORCE", "false")]);
    assert_eq!(code, 0);
    assert!(stdout.contains("fencing OFF"), "{stdout}");
}

#[test]
fn a_bad_key_or_value_names_the_key_and_where_it_came_from() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "[proxy]\nrequest_timout_ms = 5\n").unwrap();
    let (code, stdout, stderr) = check(&file, &[]);
    assert_eq!(code, 2, "{stdout}{stderr}");
    assert!(stderr.contains("request_timout_ms"), "{stderr}");
    assert!(stderr.contains("bad.toml"), "{stderr}");

    std::fs::write(&file, "[proxy]\nrequest_timeout_ms = 5000\n").unwrap();
    let (code, _, stderr) = check(&file, &[("RAILGUARD__PROXY__MAX_BODY_BYTES", "lots")]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("RAILGUARD__PROXY__MAX_BODY_BYTES"),
        "{stderr}"
    );

    let (code, _, stderr) = check(&dir.path().join("missing.toml"), &[]);
    assert_eq!(code, 2);
    assert!(stderr.contains("missing.toml"), "{stderr}");
}
