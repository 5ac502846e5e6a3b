//! Name patterns for what an identity may touch: `acct-eu-*`, `locks/acct-eu-*`, `*`.
//!
//! A pattern is literal text in which `*` stands for any run of characters (none included),
//! matched against the whole name. There is no other wildcard and no escape: account ids and
//! lock keys may contain `*` too, but in a pattern it is always the wildcard.

/// A compiled pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    text: String,
    /// The literal pieces between the stars.
    pieces: Vec<String>,
    starts_with_star: bool,
    ends_with_star: bool,
}

impl Pattern {
    /// Parses a pattern; empty patterns and control characters are refused.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Err("a pattern may not be empty (use \"*\" for everything)".into());
        }
        if text.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err(format!(
                "{text:?} contains whitespace or a control character"
            ));
        }
        Ok(Self {
            text: text.to_string(),
            pieces: text
                .split('*')
                .filter(|p| !p.is_empty())
                .map(str::to_string)
                .collect(),
            starts_with_star: text.starts_with('*'),
            ends_with_star: text.ends_with('*'),
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether `name`, whole, matches.
    pub fn matches(&self, name: &str) -> bool {
        let mut rest = name;
        let last = self.pieces.len().saturating_sub(1);
        for (i, piece) in self.pieces.iter().enumerate() {
            let first = i == 0;
            if first && !self.starts_with_star {
                match rest.strip_prefix(piece.as_str()) {
                    Some(after) => rest = after,
                    None => return false,
                }
                if i == last && !self.ends_with_star {
                    return rest.is_empty();
                }
                continue;
            }
            if i == last && !self.ends_with_star {
                // The last piece is anchored at the end; it must not overlap what came before.
                return rest.len() >= piece.len() && rest.ends_with(piece.as_str());
            }
            // Leftmost match is always safe for a `*`-separated literal.
            match rest.find(piece.as_str()) {
                Some(at) => rest = &rest[at + piece.len()..],
                None => return false,
            }
        }
        // No pieces: the pattern is all stars (matches anything) — or the loop consumed the
        // pieces and the pattern ends with a star.
        self.pieces.is_empty() || self.ends_with_star
    }

    /// This pattern with `prefix` and `suffix` around it: an account pattern turned into the
    /// pattern of those accounts' lock keys.
    pub fn wrapped(&self, prefix: &str, suffix: &str) -> Self {
        Self::parse(&format!("{prefix}{}{suffix}", self.text)).expect("a valid pattern wrapped")
    }
}

/// Whether any of `patterns` matches `name`.
pub fn any_matches(patterns: &[Pattern], name: &str) -> bool {
    patterns.iter().any(|p| p.matches(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(pattern: &str, name: &str) -> bool {
        Pattern::parse(pattern).unwrap().matches(name)
    }

    #[test]
    fn literal_patterns_match_only_themselves() {
        assert!(m("acct-1", "acct-1"));
        assert!(!m("acct-1", "acct-10"));
        assert!(!m("acct-1", "xacct-1"));
        assert!(!m("acct-1", ""));
    }

    #[test]
    fn stars_match_any_run_including_none() {
        assert!(m("*", ""));
        assert!(m("*", "anything"));
        assert!(m("**", "x"));
        assert!(m("acct-eu-*", "acct-eu-"));
        assert!(m("acct-eu-*", "acct-eu-17"));
        assert!(!m("acct-eu-*", "acct-us-17"));
        assert!(!m("acct-eu-*", "xacct-eu-17"));
        assert!(m("*-eu", "acct-eu"));
        assert!(!m("*-eu", "acct-eu-1"));
        assert!(m("a*b*c", "abc"));
        assert!(m("a*b*c", "a-b-b-c"));
        assert!(!m("a*b*c", "a-c-b"));
        assert!(m("locks/*/x", "locks/a/b/x"));
    }

    #[test]
    fn an_anchored_end_may_not_reuse_the_anchored_start() {
        // "ab*ba" needs at least "abba"-like text: the start and the end are distinct pieces.
        assert!(!m("ab*ba", "aba"));
        assert!(m("ab*ba", "abba"));
        assert!(!m("a*a", "a"));
        assert!(m("a*a", "aa"));
    }

    #[test]
    fn bad_patterns_are_refused() {
        for bad in ["", " acct", "acct\n", "a b"] {
            assert!(Pattern::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn an_account_pattern_wraps_into_a_lock_key_pattern() {
        let keys = Pattern::parse("acct-eu-*").unwrap().wrapped("locks/", "");
        assert!(keys.matches("locks/acct-eu-9"));
        assert!(!keys.matches("acct-eu-9"));
    }
}
