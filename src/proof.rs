//! Grant proofs (C2 §2.3 b): evidence, checked without a database round trip, that a token
//! was granted by the lock service *for one lock key*.
//!
//! Tokens come from one global sequence (PostgreSQL) or the cluster revision (etcd), so a
//! token alone says nothing about which key it fences: a fresh grant on any key is above every
//! account's mark, and a number nobody was ever granted (`9223372036854775807`) would poison
//! a mark for good. So every grant carries a proof, `v1.` followed by the hex HMAC-SHA256 of
//! (lock key, token) under a key that only railguard holds, and the proxy recomputes it for
//! the lock key of the request's account before the compare-and-set.
//!
//! The key lives in PostgreSQL (`railguard_secret`), written once by the first process that
//! starts, so that every railguard process sharing a database — lock service and proxy alike —
//! signs and checks with the same key without any configuration.
//!
//! A proof is not a secret: it only lets its holder present *that* token for *that* key,
//! which the grant already allowed. It never lets anyone learn or make another grant's proof.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::token::FencingToken;

/// Prefix of the wire form of a proof that binds (lock key, token).
const VERSION: &str = "v1.";
/// Prefix of a proof that also binds the holder's authenticated identity.
const VERSION_BOUND: &str = "v2.";
/// Separates the fields of the signed message; lock keys and tokens never contain it.
const SEPARATOR: u8 = 0;
/// Name of the proof key's row in `railguard_secret`.
const SECRET_NAME: &str = "grant_proof";

/// The key that signs and checks grant proofs.
#[derive(Clone)]
pub struct ProofKey {
    mac: Hmac<Sha256>,
}

impl std::fmt::Debug for ProofKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProofKey(..)")
    }
}

impl ProofKey {
    /// A key from its raw bytes (at least 32).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self {
            mac: Hmac::<Sha256>::new_from_slice(bytes).expect("HMAC takes keys of any length"),
        }
    }

    fn mac_of(&self, lock_key: &str, token: FencingToken) -> Hmac<Sha256> {
        let mut mac = self.mac.clone();
        mac.update(b"railguard grant");
        mac.update(&[SEPARATOR]);
        mac.update(lock_key.as_bytes());
        mac.update(&[SEPARATOR]);
        mac.update(Decimal::of(token).as_bytes());
        mac
    }

    fn bound_mac_of(&self, lock_key: &str, token: FencingToken, holder: &str) -> Hmac<Sha256> {
        let mut mac = self.mac.clone();
        mac.update(b"railguard grant to");
        mac.update(&[SEPARATOR]);
        mac.update(holder.as_bytes());
        mac.update(&[SEPARATOR]);
        mac.update(lock_key.as_bytes());
        mac.update(&[SEPARATOR]);
        mac.update(Decimal::of(token).as_bytes());
        mac
    }

    /// The proof of a grant of `lock_key` with `token` to the authenticated identity
    /// `holder`: with authentication on, the proxy accepts it only from that identity.
    pub fn sign_for(&self, lock_key: &str, token: FencingToken, holder: &str) -> String {
        let tag = self
            .bound_mac_of(lock_key, token, holder)
            .finalize()
            .into_bytes();
        let mut text = String::with_capacity(VERSION_BOUND.len() + 64);
        text.push_str(VERSION_BOUND);
        text.push_str(&hex(&tag));
        text
    }

    /// Whether `proof` is the proof of a grant of `lock_key` with `token` to `holder`.
    /// Compares in constant time. A proof without a holder (`v1.`) is not one.
    pub fn verify_for(
        &self,
        lock_key: &str,
        token: FencingToken,
        holder: &str,
        proof: &str,
    ) -> bool {
        let Some(tag) = proof
            .strip_prefix(VERSION_BOUND)
            .and_then(unhex_array::<32>)
        else {
            return false;
        };
        self.bound_mac_of(lock_key, token, holder)
            .verify_slice(&tag)
            .is_ok()
    }

    /// The proof of a grant of `lock_key` with `token`, in its wire form.
    pub fn sign(&self, lock_key: &str, token: FencingToken) -> String {
        let tag = self.mac_of(lock_key, token).finalize().into_bytes();
        let mut text = String::with_capacity(VERSION.len() + 64);
        text.push_str(VERSION);
        text.push_str(&hex(&tag));
        text
    }

    /// Whether `proof` is the proof of a grant of `lock_key` with `token`. Compares in
    /// constant time.
    pub fn verify(&self, lock_key: &str, token: FencingToken, proof: &str) -> bool {
        let Some(tag) = proof.strip_prefix(VERSION).and_then(unhex_array::<32>) else {
            return false;
        };
        self.mac_of(lock_key, token).verify_slice(&tag).is_ok()
    }

    /// The database's proof key, created by whichever process gets there first.
    pub async fn load_or_create(
        client: &impl tokio_postgres::GenericClient,
    ) -> Result<Self, tokio_postgres::Error> {
        let candidate = random_bytes::<32>();
        client
            .execute(
                "INSERT INTO railguard_secret (name, value) VALUES ($1, $2)
                 ON CONFLICT (name) DO NOTHING",
                &[&SECRET_NAME, &candidate.as_slice()],
            )
            .await?;
        let row = client
            .query_one(
                "SELECT value FROM railguard_secret WHERE name = $1",
                &[&SECRET_NAME],
            )
            .await?;
        let value: Vec<u8> = row.get(0);
        Ok(Self::from_bytes(&value))
    }
}

/// `N` bytes from the operating system's random source.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).expect("the operating system's random source works");
    bytes
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        text.push(DIGITS[usize::from(b >> 4)] as char);
        text.push(DIGITS[usize::from(b & 15)] as char);
    }
    text
}

/// A token's decimal digits, as its text form has them, written without allocating.
struct Decimal {
    digits: [u8; 20],
    start: usize,
}

impl Decimal {
    fn of(token: FencingToken) -> Self {
        // Tokens are positive: at most 19 digits.
        let mut digits = [0u8; 20];
        let mut start = digits.len();
        let mut n = token.get().unsigned_abs();
        loop {
            start -= 1;
            digits[start] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        Self { digits, start }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.digits[self.start..]
    }
}

/// A hex digit's value.
fn digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Parses lower- or upper-case hex; `None` for anything else.
pub fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    let mut bytes = Vec::with_capacity(text.len() / 2);
    for pair in text.as_bytes().chunks_exact(2) {
        bytes.push(digit(pair[0])? << 4 | digit(pair[1])?);
    }
    Some(bytes)
}

/// Parses exactly `N` bytes of lower- or upper-case hex, without allocating (a proof's tag on
/// every request); `None` for anything else.
pub fn unhex_array<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N {
        return None;
    }
    let mut bytes = [0u8; N];
    for (byte, pair) in bytes.iter_mut().zip(text.as_bytes().chunks_exact(2)) {
        *byte = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: i64) -> FencingToken {
        FencingToken::new(v).unwrap()
    }

    #[test]
    fn a_proof_binds_key_and_token() {
        let key = ProofKey::from_bytes(&[7; 32]);
        let proof = key.sign("acct-B", t(42));
        assert!(proof.starts_with("v1.") && proof.len() == 3 + 64, "{proof}");
        assert!(key.verify("acct-B", t(42), &proof));
        assert!(key.verify("acct-B", t(42), &proof.to_uppercase().replace("V1.", "v1.")));
        assert!(!key.verify("acct-A", t(42), &proof), "another key");
        assert!(!key.verify("acct-B", t(43), &proof), "another token");
        assert!(
            !key.verify("acct-B", t(4), &key.sign("acct-B2", t(4))),
            "a longer key"
        );
        // The separator keeps (key, token) pairs apart that would concatenate alike.
        assert_ne!(key.sign("a1", t(23)), key.sign("a", t(123)));
        let other = ProofKey::from_bytes(&[8; 32]);
        assert!(
            !other.verify("acct-B", t(42), &proof),
            "another railguard's key"
        );
    }

    #[test]
    fn a_bound_proof_binds_the_holder_too() {
        let key = ProofKey::from_bytes(&[7; 32]);
        let proof = key.sign_for("acct-B", t(42), "eu");
        assert!(proof.starts_with("v2.") && proof.len() == 3 + 64, "{proof}");
        assert!(key.verify_for("acct-B", t(42), "eu", &proof));
        assert!(
            !key.verify_for("acct-B", t(42), "us", &proof),
            "another identity"
        );
        assert!(
            !key.verify_for("acct-A", t(42), "eu", &proof),
            "another key"
        );
        assert!(
            !key.verify_for("acct-B", t(41), "eu", &proof),
            "another token"
        );
        assert!(!key.verify("acct-B", t(42), &proof), "not a v1 proof");
        let unbound = key.sign("acct-B", t(42));
        assert!(
            !key.verify_for("acct-B", t(42), "eu", &unbound),
            "an unbound proof is no proof of a grant to anyone"
        );
        // Separators keep (holder, key) pairs apart that would concatenate alike.
        assert_ne!(key.sign_for("b", t(1), "a"), key.sign_for("", t(1), "ab"));
    }

    #[test]
    fn malformed_proofs_are_refused() {
        let key = ProofKey::from_bytes(&[7; 32]);
        let good = key.sign("k", t(1));
        for bad in [
            "",
            "v1.",
            &good[3..],
            &good[..good.len() - 1],
            &format!("v2.{}", &good[3..]),
            &format!("{good}00"),
            "v1.zz",
        ] {
            assert!(!key.verify("k", t(1), bad), "{bad:?}");
        }
    }

    #[test]
    fn hex_round_trips() {
        let bytes = random_bytes::<32>();
        assert_eq!(unhex(&hex(&bytes)).unwrap(), bytes);
        assert_eq!(unhex("0"), None);
        assert_eq!(unhex("g0"), None);
        assert_eq!(unhex_array::<2>("0aFf"), Some([0x0a, 0xff]));
        assert_eq!(unhex_array::<2>("0aF"), None);
        assert_eq!(unhex_array::<2>("0aFf00"), None);
        assert_eq!(unhex_array::<2>("0aFg"), None);
        for token in [1, 9, 10, 4711, i64::MAX] {
            let token = FencingToken::new(token).unwrap();
            assert_eq!(Decimal::of(token).as_bytes(), token.to_string().as_bytes());
        }
    }
}
