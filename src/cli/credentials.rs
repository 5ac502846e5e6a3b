//! `railguard credentials-new-secret`.

use std::process::ExitCode;

use railguard::auth::secret;

/// Make a new bearer secret for the credentials file.
///
/// Prints the secret (give it to the worker or operator, once) and the `sha256:` line to list
/// in the credentials file (`[auth] credentials_file`). railguard never stores or logs the
/// secret itself.
#[derive(clap::Args)]
pub(crate) struct NewSecret {}

pub(crate) fn new_secret(_: NewSecret) -> ExitCode {
    let secret = secret::generate();
    println!("secret: {secret}");
    println!(
        "for the credentials file: secrets = [\"{}\"]",
        secret::digest_text(&secret)
    );
    ExitCode::SUCCESS
}
