//! railguard as an operator runs it: the command line, the admin commands, the embedded PostgreSQL, the
//! container image, the alerting rules and dashboard, and `railguard demo`.
//!
//! One test binary: each file is a module, named for the behaviour it covers.

mod admin_cli;
mod alerts;
mod cli;
mod container;
mod demo;
mod embedded;

/// Asserts that `text` contains each of `parts`, naming the first it lacks.
#[track_caller]
fn assert_says(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(text.contains(part), "{part} in {text}");
    }
}
