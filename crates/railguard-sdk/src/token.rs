//! The fencing token and the account it fences, as values.
//!
//! A [`FencingToken`] is obtained once, from a grant, and travels from there to every fencing
//! point as a parameter or a header (ADR-002 §A2.2, C2 §2.7). It has no setter and no
//! arithmetic: the only questions one asks of it are "which is larger" and "what is its wire
//! form". Nothing in this crate stores "the current token" anywhere a writer could read it.

use std::fmt;
use std::sync::Arc;

/// A fencing token: an integer in `1..=i64::MAX`, fixed when its grant was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(i64);

impl FencingToken {
    /// Wraps a token received from a grant or read from storage. Zero and negative values are
    /// not tokens.
    pub fn new(value: i64) -> Option<Self> {
        (value > 0).then_some(Self(value))
    }

    pub fn get(self) -> i64 {
        self.0
    }

    /// Parses the wire form (C2 §2.2): ASCII decimal digits only — no sign, no spaces —
    /// whose value is in `1..=i64::MAX`.
    pub fn parse(text: &str) -> Result<Self, TokenError> {
        if text.is_empty() {
            return Err(TokenError::Empty);
        }
        if !text.bytes().all(|b| b.is_ascii_digit()) {
            return Err(TokenError::NotDecimal);
        }
        let value: i64 = text.parse().map_err(|_| TokenError::OutOfRange)?;
        Self::new(value).ok_or(TokenError::OutOfRange)
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Why a token's wire form was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("is empty")]
    Empty,
    #[error("is not a decimal integer")]
    NotDecimal,
    #[error("is outside 1..=9223372036854775807")]
    OutOfRange,
}

/// The account a request moves money on: 1 to `max_len` bytes of visible ASCII.
///
/// Shared, not copied: a request's account goes into its batch rows, its place in the
/// account's order and its log lines, and each copy is a reference count, not an allocation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AccountId(Arc<str>);

impl AccountId {
    pub fn parse(text: &str, max_len: usize) -> Result<Self, AccountError> {
        if text.is_empty() {
            return Err(AccountError::Empty);
        }
        if text.len() > max_len {
            return Err(AccountError::TooLong { max_len });
        }
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(AccountError::NotVisibleAscii);
        }
        Ok(Self(Arc::from(text)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for AccountId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AccountError {
    #[error("is empty")]
    Empty,
    #[error("is longer than {max_len} bytes")]
    TooLong { max_len: usize },
    #[error("must be visible ASCII without spaces")]
    NotVisibleAscii,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_whole_positive_range() {
        assert_eq!(FencingToken::parse("1").unwrap().get(), 1);
        assert_eq!(FencingToken::parse("42").unwrap().get(), 42);
        assert_eq!(
            FencingToken::parse("9223372036854775807").unwrap().get(),
            i64::MAX
        );
        assert_eq!(FencingToken::parse("007").unwrap().get(), 7);
    }

    #[test]
    fn refuses_everything_else() {
        for (text, want) in [
            ("", TokenError::Empty),
            ("0", TokenError::OutOfRange),
            ("000", TokenError::OutOfRange),
            ("-5", TokenError::NotDecimal),
            ("+5", TokenError::NotDecimal),
            (" 5", TokenError::NotDecimal),
            ("5 ", TokenError::NotDecimal),
            ("4.2", TokenError::NotDecimal),
            ("0x2a", TokenError::NotDecimal),
            ("42, 57", TokenError::NotDecimal),
            ("abc", TokenError::NotDecimal),
            ("٤٢", TokenError::NotDecimal),
            ("9223372036854775808", TokenError::OutOfRange),
            ("99999999999999999999999", TokenError::OutOfRange),
        ] {
            assert_eq!(FencingToken::parse(text), Err(want), "{text:?}");
        }
    }

    #[test]
    fn tokens_order_by_value() {
        let t42 = FencingToken::new(42).unwrap();
        let t57 = FencingToken::new(57).unwrap();
        assert!(t42 < t57);
        assert_eq!(FencingToken::new(0), None);
        assert_eq!(FencingToken::new(-1), None);
    }

    #[test]
    fn account_grammar() {
        assert!(AccountId::parse("acct-1:eu/42", 128).is_ok());
        assert_eq!(AccountId::parse("", 128), Err(AccountError::Empty));
        assert_eq!(
            AccountId::parse("a b", 128),
            Err(AccountError::NotVisibleAscii)
        );
        assert_eq!(
            AccountId::parse("é", 128),
            Err(AccountError::NotVisibleAscii)
        );
        assert_eq!(
            AccountId::parse(&"a".repeat(129), 128),
            Err(AccountError::TooLong { max_len: 128 })
        );
    }
}

/// Properties of the wire forms, over generated inputs (the fuzz target `fence_headers`
/// checks the same on arbitrary bytes).
#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn every_token_prints_and_parses_back(value in 1..=i64::MAX, zeros in 0..5usize) {
            let token = FencingToken::new(value).unwrap();
            prop_assert_eq!(FencingToken::parse(&token.to_string()), Ok(token));
            let padded = format!("{}{token}", "0".repeat(zeros));
            prop_assert_eq!(FencingToken::parse(&padded), Ok(token));
        }

        #[test]
        fn a_token_with_any_other_byte_is_not_decimal(
            digits in "[0-9]{0,10}",
            other in any::<char>().prop_filter("not a digit", |c| !c.is_ascii_digit()),
            at in any::<prop::sample::Index>(),
        ) {
            let mut text = digits.clone();
            text.insert(at.index(digits.len() + 1), other);
            prop_assert_eq!(FencingToken::parse(&text), Err(TokenError::NotDecimal));
        }

        #[test]
        fn zero_and_too_large_are_out_of_range(
            value in prop_oneof![Just(0i128), (i64::MAX as i128 + 1)..=u64::MAX as i128 * 8],
        ) {
            prop_assert_eq!(
                FencingToken::parse(&value.to_string()),
                Err(TokenError::OutOfRange)
            );
        }

        #[test]
        fn zero_and_negative_values_are_not_tokens(value in i64::MIN..=0) {
            prop_assert_eq!(FencingToken::new(value), None);
        }

        #[test]
        fn every_visible_ascii_account_within_the_limit_is_accepted(
            text in "[!-~]{1,64}",
            slack in 0..8usize,
        ) {
            let account = AccountId::parse(&text, text.len() + slack).unwrap();
            prop_assert_eq!(account.as_str(), text.as_str());
            prop_assert_eq!(
                AccountId::parse(&text, text.len() - 1),
                Err(AccountError::TooLong { max_len: text.len() - 1 })
            );
        }

        #[test]
        fn an_account_with_any_other_byte_is_refused(
            text in "[!-~]{0,16}",
            other in any::<char>().prop_filter("not visible ASCII", |c| !c.is_ascii_graphic()),
            at in any::<prop::sample::Index>(),
        ) {
            let mut bad = text.clone();
            bad.insert(at.index(text.len() + 1), other);
            prop_assert_eq!(AccountId::parse(&bad, 1024), Err(AccountError::NotVisibleAscii));
        }
    }
}
