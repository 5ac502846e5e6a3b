//! The config loader: a TOML file's text and `RAILGUARD__SECTION__KEY` overrides, through
//! `Config::parse`, the function `Config::load` hands the file's text to.
//!
//! The input is the file's text, then optionally a NUL and environment lines `NAME=VALUE`.
//! Checked: nothing panics; parsing is deterministic; an accepted config written back as
//! TOML parses, with no environment, to the same config; an error names where the bad value
//! came from (the file, or a variable that was set) and the key it names.
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use railguard::config::Config;

const FILE: &str = "fuzz.toml";

fuzz_target!(|data: &[u8]| {
    let (text, env_text) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    // `Config::load` reads the file as UTF-8 and refuses anything else before parsing.
    let (Ok(text), Ok(env_text)) = (std::str::from_utf8(text), std::str::from_utf8(env_text))
    else {
        return;
    };
    let env: BTreeMap<String, String> = env_text
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect();

    let parsed = Config::parse(text, FILE, &env);
    assert_eq!(parsed, Config::parse(text, FILE, &env), "deterministic");
    match parsed {
        Ok(config) => {
            let written = toml::to_string(&config).expect("a parsed config serializes");
            let reread = Config::parse(&written, "written.toml", &BTreeMap::new());
            assert_eq!(
                reread.as_ref(),
                Ok(&config),
                "round trip through\n{written}"
            );
        }
        Err(error) => {
            let from_env = error
                .origin
                .strip_prefix("environment variable ")
                .is_some_and(|var| env.contains_key(var));
            assert!(
                error.origin == FILE || from_env,
                "origin {:?}",
                error.origin
            );
            let shown = error.to_string();
            assert!(shown.starts_with(&error.origin), "{shown}");
            if let Some(key) = &error.key {
                assert!(shown.contains(key.as_str()), "{shown}");
            }
        }
    }
});
