//! The container image: what can be checked without building it.
//!
//! - The image's config (`config/container.toml`), read by the real binary: it refuses to start
//!   without an explicit rail, naming the key, the file and the variable that sets it; with
//!   one, its admin listener is on the container's loopback only.
//! - The Dockerfile's steps, read as text: `protoc` is installed before the first `cargo build`,
//!   the dependency layer is built from every workspace member's manifest before any source is
//!   copied, the sources are touched before the real build, the health check asks the admin
//!   listener where the image's config puts it, with a tool the image installs, the admin port
//!   is not exposed, and the build context leaves out build output, history and fuzzing state.
//!
//! These do not replace building the image (`docker build .`); they catch the mistakes that a
//! build would only show minutes in, or not at all (a health check that always fails).

use railguard_testkit as support;

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One instruction: its keyword (upper case) and its arguments, continuation lines joined.
#[derive(Debug)]
struct Instruction {
    keyword: String,
    args: String,
}

/// The Dockerfile's stages, each a list of instructions starting with its `FROM`.
fn stages() -> Vec<Vec<Instruction>> {
    let text = std::fs::read_to_string(repo().join("Dockerfile")).unwrap();
    let mut instructions = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                let (keyword, args) = current.split_once(' ').unwrap_or((&current, ""));
                instructions.push(Instruction {
                    keyword: keyword.to_uppercase(),
                    args: args.split_whitespace().collect::<Vec<_>>().join(" "),
                });
                current.clear();
            }
        }
    }
    assert!(current.is_empty(), "the Dockerfile ends in a continuation");
    let mut stages: Vec<Vec<Instruction>> = Vec::new();
    for instruction in instructions {
        if instruction.keyword == "FROM" {
            stages.push(Vec::new());
        }
        stages
            .last_mut()
            .expect("the Dockerfile starts with FROM")
            .push(instruction);
    }
    stages
}

fn position(stage: &[Instruction], what: &str, found: impl Fn(&Instruction) -> bool) -> usize {
    stage
        .iter()
        .position(found)
        .unwrap_or_else(|| panic!("no {what} in the stage: {stage:#?}"))
}

/// The workspace members, from the root manifest.
fn members() -> Vec<String> {
    let text = std::fs::read_to_string(repo().join("Cargo.toml")).unwrap();
    let manifest: toml::Table = toml::from_str(&text).unwrap();
    manifest["workspace"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap().to_string())
        .collect()
}

/// The `.dockerignore` patterns, without comments.
fn ignored() -> Vec<String> {
    std::fs::read_to_string(repo().join(".dockerignore"))
        .expect("a .dockerignore beside the Dockerfile")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.trim_end_matches('/').to_string())
        .collect()
}

fn check_config(config: &Path, env: &[(&str, &str)]) -> (i32, String, String) {
    let out = support::railguard_command(&["check-config"], config, env);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_image_config_needs_an_explicit_upstream_and_keeps_admin_on_loopback() {
    let config = repo().join("config/container.toml");
    let (code, stdout, stderr) = check_config(&config, &[]);
    assert_eq!(code, 2, "no rail, no start: {stdout}{stderr}");
    crate::assert_says(
        &stderr,
        &[
            "container.toml",
            "key `proxy.upstream`",
            "must be set",
            "RAILGUARD__PROXY__UPSTREAM",
        ],
    );
    let (code, stdout, stderr) = check_config(
        &config,
        &[("RAILGUARD__PROXY__UPSTREAM", "http://rail.internal:9090")],
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    crate::assert_says(
        &stdout,
        &[
            "proxy 0.0.0.0:8080 → http://rail.internal:9090",
            "lock API 0.0.0.0:7070",
            "admin 127.0.0.1:9100",
            "embedded PostgreSQL in /var/lib/railguard/pg",
        ],
    );
}

#[test]
fn the_dockerfile_installs_protoc_first_and_builds_dependencies_before_sources() {
    let stages = stages();
    assert_eq!(stages.len(), 2, "a build stage and a runtime stage");
    let build = &stages[0];
    let cargo_builds: Vec<usize> = build
        .iter()
        .enumerate()
        .filter(|(_, i)| i.keyword == "RUN" && i.args.contains("cargo build"))
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        cargo_builds.len(),
        2,
        "a dependency build and the real one: {build:#?}"
    );
    for &n in &cargo_builds {
        assert!(
            build[n]
                .args
                .contains("cargo build --release --locked -p railguard --bin railguard"),
            "{:?}",
            build[n]
        );
    }
    let protoc = position(build, "protoc install", |i| {
        i.keyword == "RUN"
            && i.args.contains("apt-get install")
            && i.args.contains("protobuf-compiler")
            && i.args.contains("libprotobuf-dev")
    });
    assert!(protoc < cargo_builds[0], "protoc before any cargo build");

    // Every member's manifest, and nothing else of the workspace, before the first build.
    let copied_before: Vec<&str> = build[..cargo_builds[0]]
        .iter()
        .filter(|i| i.keyword == "COPY")
        .map(|i| i.args.as_str())
        .collect();
    assert!(
        copied_before.contains(&"Cargo.toml Cargo.lock ./"),
        "{copied_before:?}"
    );
    for member in members().iter().filter(|m| *m != ".") {
        let manifest = format!("{member}/Cargo.toml {member}/Cargo.toml");
        assert!(
            copied_before.contains(&manifest.as_str()),
            "workspace member {member}'s manifest is copied for the dependency layer: \
             {copied_before:?}"
        );
    }
    let sources = position(build, "COPY src", |i| {
        i.keyword == "COPY" && i.args == "src src"
    });
    assert!(cargo_builds[0] < sources && sources < cargo_builds[1]);
    assert!(
        build[cargo_builds[1]].args.contains("touch"),
        "the copied sources are touched before the real build: {:?}",
        build[cargo_builds[1]]
    );

    // Everything the stages copy from the context exists and is not left out of it.
    let ignored = ignored();
    for stage in &stages {
        for copy in stage
            .iter()
            .filter(|i| i.keyword == "COPY" && !i.args.starts_with("--from"))
        {
            let parts: Vec<&str> = copy.args.split(' ').collect();
            for source in &parts[..parts.len() - 1] {
                assert!(repo().join(source).exists(), "COPY {source}: no such path");
                assert!(
                    !ignored
                        .iter()
                        .any(|p| source == p || source.starts_with(&format!("{p}/"))),
                    "COPY {source} is left out of the build context by .dockerignore"
                );
            }
        }
    }
}

#[test]
fn the_image_checks_its_health_on_the_admin_listener_it_keeps_private() {
    let stages = stages();
    let runtime = stages.last().unwrap();
    let text = std::fs::read_to_string(repo().join("config/container.toml")).unwrap();
    let config: toml::Table = toml::from_str(&text).unwrap();
    let admin = config["admin"]["listen"].as_str().unwrap().to_string();
    assert!(
        admin.starts_with("127.0.0.1:"),
        "admin on loopback: {admin}"
    );
    let admin_port = admin.rsplit(':').next().unwrap();

    let env = position(runtime, "ENV RAILGUARD_CONFIG", |i| {
        i.keyword == "ENV" && i.args.starts_with("RAILGUARD_CONFIG=")
    });
    let config_path = runtime[env].args["RAILGUARD_CONFIG=".len()..].to_string();
    position(runtime, "COPY of the image's config", |i| {
        i.keyword == "COPY" && i.args == format!("config/container.toml {config_path}")
    });
    let entry = position(runtime, "ENTRYPOINT", |i| i.keyword == "ENTRYPOINT");
    assert_eq!(runtime[entry].args, r#"["railguard"]"#);

    let health = position(runtime, "HEALTHCHECK", |i| i.keyword == "HEALTHCHECK");
    let check = &runtime[health].args;
    let url = format!("http://127.0.0.1:{admin_port}/");
    assert!(
        check.contains(&format!("{url}healthz")) || check.contains(&format!("{url}readyz")),
        "the health check asks /healthz or /readyz at {url}: {check}"
    );
    assert!(check.contains("CMD curl -f"), "{check}");
    position(runtime, "curl install", |i| {
        i.keyword == "RUN" && i.args.contains("apt-get install") && i.args.contains(" curl")
    });

    let exposed: Vec<&str> = runtime
        .iter()
        .filter(|i| i.keyword == "EXPOSE")
        .flat_map(|i| i.args.split(' '))
        .collect();
    assert!(exposed.contains(&"8080") && exposed.contains(&"7070"));
    assert!(
        !exposed.contains(&admin_port),
        "the admin port is not exposed: {exposed:?}"
    );

    let ignored = ignored();
    for pattern in ["target", ".git", "fuzz"] {
        assert!(
            ignored.iter().any(|p| p == pattern),
            ".dockerignore leaves out {pattern}: {ignored:?}"
        );
    }
}
