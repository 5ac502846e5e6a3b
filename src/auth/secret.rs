//! Bearer secrets: how they are made, and the digest the credentials file keeps of them.

use sha2::{Digest as _, Sha256};

use super::credentials::Digest;
use crate::proof::{hex, random_bytes};

/// Prefix of every secret railguard makes, so a leaked one is easy to recognise in a scan.
pub const PREFIX: &str = "rgs_";

/// A new secret: `rgs_` and 256 random bits in hex.
pub fn generate() -> String {
    format!("{PREFIX}{}", hex(&random_bytes::<32>()))
}

/// The SHA-256 of a secret as sent.
pub fn digest(secret: &str) -> Digest {
    Sha256::digest(secret.as_bytes()).into()
}

/// The digest in the credentials file's form: `sha256:` and hex.
pub fn digest_text(secret: &str) -> String {
    format!("sha256:{}", hex(&digest(secret)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_fresh_and_their_digests_parse_back() {
        let (a, b) = (generate(), generate());
        assert_ne!(a, b);
        assert!(a.starts_with(PREFIX) && a.len() == PREFIX.len() + 64);
        let text = digest_text(&a);
        assert_eq!(
            super::super::credentials::parse_digest(&text).unwrap(),
            digest(&a)
        );
        // The known SHA-256 of "abc".
        assert_eq!(
            digest_text("abc"),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
