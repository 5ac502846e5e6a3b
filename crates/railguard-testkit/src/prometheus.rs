//! A strict parser of the Prometheus text exposition format, so that a test reading a metric
//! also checks that `/metrics` is well-formed.

use std::collections::BTreeMap;

/// Samples of a Prometheus text exposition, keyed `name{labels}` exactly as exposed.
#[derive(Debug)]
pub struct Metrics(pub BTreeMap<String, f64>);

impl Metrics {
    /// Parses strictly: every sample line is `name[{labels}] value`, every sample belongs to a
    /// family announced by `# TYPE`, and every value is a number. Panics otherwise.
    pub fn parse(text: &str) -> Metrics {
        let mut types = BTreeMap::new();
        let mut samples = BTreeMap::new();
        for line in text.lines() {
            if line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split(' ');
                let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
                assert!(
                    ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                    "{line}"
                );
                types.insert(name.to_string(), kind.to_string());
                continue;
            }
            if line.starts_with("# HELP ") {
                continue;
            }
            assert!(!line.starts_with('#'), "unexpected comment: {line}");
            let (key, value) = line
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("bad sample: {line}"));
            let name = key.split('{').next().unwrap();
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
                "bad metric name: {line}"
            );
            if key.contains('{') {
                assert!(key.ends_with('}'), "bad labels: {line}");
            }
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s)
                        .filter(|f| types.get(*f).is_some_and(|t| t == "histogram"))
                })
                .unwrap_or(name);
            assert!(types.contains_key(family), "sample without # TYPE: {line}");
            let value: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("bad value: {line}"));
            samples.insert(key.to_string(), value);
        }
        Metrics(samples)
    }

    pub fn get(&self, key: &str) -> f64 {
        *self
            .0
            .get(key)
            .unwrap_or_else(|| panic!("metric {key} missing from {:?}", self.0.keys()))
    }
}
