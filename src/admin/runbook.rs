//! `GET /runbook`: docs/operations.md, built into the binary, as a minimal HTML page whose
//! headings carry the anchors GitHub gives them (`### RailguardFencedOut` is
//! `#railguardfencedout`). Each alert rule's `runbook_url` points at its section on the admin
//! listener of the instance that fired it (config/prometheus/railguard.rules.yml), so the link
//! in an alert opens the runbook of the very binary that raised it.
//!
//! The page is the Markdown text itself, in `<pre>` blocks between the headings: nothing is
//! lost in translation and nothing needs a renderer. It holds nothing secret (it ships with
//! every copy of railguard), so the route needs no credentials, like `/healthz`: an on-call
//! engineer follows the link from a browser, which has no bearer secret to send.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The runbook, as it was when this binary was built.
pub const MARKDOWN: &str = include_str!("../../docs/operations.md");

/// The runbook as an HTML page.
pub fn html() -> String {
    let mut out = String::with_capacity(MARKDOWN.len() * 11 / 10 + 512);
    out.push_str(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>railguard runbook</title>\n\
         <style>body{max-width:60rem;margin:auto;padding:1rem;font-family:sans-serif}\
         pre{white-space:pre-wrap;font-size:0.95rem}:target{background:#ffec99}</style>\n\
         </head>\n<body>\n",
    );
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut block = String::new();
    let mut in_code = false;
    for line in MARKDOWN.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        }
        let heading = (!in_code)
            .then(|| heading(line))
            .flatten()
            .filter(|(level, _)| *level <= 6);
        let Some((level, text)) = heading else {
            block.push_str(line);
            block.push('\n');
            continue;
        };
        flush(&mut out, &mut block);
        let anchor = unique(&mut seen, slug(text));
        let _ = writeln!(
            out,
            "<h{level} id=\"{anchor}\"><a href=\"#{anchor}\">{}</a></h{level}>",
            escape(text)
        );
    }
    flush(&mut out, &mut block);
    out.push_str("</body>\n</html>\n");
    out
}

/// The anchors of every heading of the runbook, in order.
pub fn anchors() -> Vec<String> {
    let mut seen = BTreeMap::new();
    let mut in_code = false;
    let mut anchors = Vec::new();
    for line in MARKDOWN.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        }
        if !in_code && let Some((_, text)) = heading(line) {
            anchors.push(unique(&mut seen, slug(text)));
        }
    }
    anchors
}

/// `### Text` as (3, "Text"): an ATX heading, one to six `#` and a space.
fn heading(line: &str) -> Option<(usize, &str)> {
    let level = line.chars().take_while(|&c| c == '#').count();
    let text = line[level..].strip_prefix(' ')?;
    (1..=6).contains(&level).then(|| (level, text.trim()))
}

/// GitHub's anchor of a heading: lower case, punctuation other than `-` and `_` dropped,
/// spaces made `-`.
fn slug(text: &str) -> String {
    text.chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .flat_map(char::to_lowercase)
        .collect()
}

/// `slug`, or `slug-1`, `slug-2`… for a heading text seen before (GitHub's rule).
fn unique(seen: &mut BTreeMap<String, usize>, slug: String) -> String {
    let count = seen.entry(slug.clone()).or_insert(0);
    let anchor = match *count {
        0 => slug,
        n => format!("{slug}-{n}"),
    };
    *count += 1;
    anchor
}

fn flush(out: &mut String, block: &mut String) {
    if !block.trim().is_empty() {
        let _ = writeln!(out, "<pre>{}</pre>", escape(block.trim_matches('\n')));
    }
    block.clear();
}

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_are_githubs() {
        assert_eq!(slug("RailguardFencedOut"), "railguardfencedout");
        assert_eq!(
            slug("Switching the lock backend (postgres ⇄ etcd)"),
            "switching-the-lock-backend-postgres--etcd"
        );
        assert_eq!(
            slug("In doubt: what it means and how to resolve it"),
            "in-doubt-what-it-means-and-how-to-resolve-it"
        );
        let mut seen = BTreeMap::new();
        assert_eq!(unique(&mut seen, "a".into()), "a");
        assert_eq!(unique(&mut seen, "a".into()), "a-1");
    }

    #[test]
    fn every_heading_has_its_anchor_and_comments_in_code_are_not_headings() {
        let page = html();
        let anchors = anchors();
        assert!(anchors.contains(&"railguardfencedout".to_string()));
        for anchor in &anchors {
            assert!(page.contains(&format!(" id=\"{anchor}\"")), "{anchor}");
        }
        // The shell comments inside the runbook's code blocks stay text.
        assert_eq!(page.matches(" id=\"").count(), anchors.len(), "{page}");
        assert!(!anchors.iter().any(|a| a.starts_with("the-position")));
        assert!(!page.contains("<script"));
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            escape("<a href=\"x\">&</a>"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&lt;/a&gt;"
        );
    }
}
