//! Logging and traces: `pretty` for people, `json` for pipelines.
//!
//! Spans on the request path carry `lock.token` and `account` (C4 §4.8), so one trace shows
//! which grant a request belonged to at every step. The level can be changed while running
//! ([`LogLevel`], SIGHUP with a new `log.level`).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use tracing::level_filters::LevelFilter;
use tracing::subscriber::Interest;
use tracing::{Metadata, Subscriber, span};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::{DefaultFields, Writer};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, fmt};

use crate::config::LogFormat;

/// Installs the global subscriber. `rust_log` (the `RUST_LOG` variable, as `main` read it),
/// when set and valid, wins over `level`. Returns the handle that changes the level later, or
/// `None` when a subscriber was already installed.
pub fn init(format: LogFormat, level: &str, rust_log: Option<&str>) -> Option<LogLevel> {
    let from_rust_log = rust_log.and_then(|filter| LogFilter::parse(filter).ok());
    let rust_log_wins = from_rust_log.is_some();
    let filter = from_rust_log.unwrap_or_else(|| {
        LogFilter::parse(level)
            .unwrap_or_else(|_| Filter::Directives(Box::new(EnvFilter::new(level))))
    });
    let filter = Arc::new(LogFilter::new(filter));
    use std::io::IsTerminal;
    // Colours only for a person at a terminal, never into a file or a log pipeline.
    let ansi = std::io::stderr().is_terminal();
    let registry = tracing_subscriber::registry().with(FilterLayer(filter.clone()));
    let installed = match format {
        LogFormat::Pretty => registry
            .with(
                fmt::layer()
                    .fmt_fields(SpanText)
                    .with_writer(std::io::stderr)
                    .with_ansi(ansi)
                    .with_target(false),
            )
            .try_init(),
        LogFormat::Json => registry
            .with(
                fmt::layer()
                    .json()
                    .with_current_span(true)
                    .with_span_list(true)
                    .with_writer(std::io::stderr)
                    .with_ansi(ansi),
            )
            .try_init(),
    };
    installed.ok().map(|()| LogLevel {
        filter,
        rust_log_wins,
    })
}

/// The pretty format's text of a span's (or an event's) fields, as `DefaultFields` writes it,
/// written whole.
///
/// Every span keeps its fields' text for the lines logged inside it. Written field by field
/// into the span's string, it grows through several allocations (about six for a request's
/// span, the largest count of any site on the request path); written first into a buffer on
/// the stack, the string is allocated once at its length (and once more when `lock.token`
/// and `account` are added to it). An event's fields go the same way into the line being
/// written; fields longer than the buffer are written into a string first. The buffer's
/// writer escapes ANSI sequences in values, as the layer's own does by default (which this
/// layer keeps); a field that fails to format leaves nothing rather than part of its text.
struct SpanText;

impl<'writer> FormatFields<'writer> for SpanText {
    fn format_fields<R: RecordFields>(
        &self,
        mut writer: Writer<'writer>,
        fields: R,
    ) -> std::fmt::Result {
        // With colours (a person at a terminal), field names are styled by the writer they go
        // to: written there directly.
        if writer.has_ansi_escapes() {
            return DefaultFields::new().format_fields(writer, fields);
        }
        let mut text = StackText::default();
        DefaultFields::new().format_fields(Writer::new(&mut text), fields)?;
        writer.write_str(text.as_str())
    }
}

/// Text written into a buffer on the stack, and into a string once it outgrows it.
struct StackText {
    bytes: [u8; 256],
    len: usize,
    spilled: Option<String>,
}

impl Default for StackText {
    fn default() -> Self {
        Self {
            bytes: [0; 256],
            len: 0,
            spilled: None,
        }
    }
}

impl StackText {
    fn as_str(&self) -> &str {
        match &self.spilled {
            Some(text) => text,
            // Whole strings are copied in, so the bytes are always UTF-8.
            None => std::str::from_utf8(&self.bytes[..self.len]).unwrap_or_default(),
        }
    }
}

impl std::fmt::Write for StackText {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        if let Some(text) = &mut self.spilled {
            text.push_str(s);
            return Ok(());
        }
        let end = self.len + s.len();
        if let Some(room) = self.bytes.get_mut(self.len..end) {
            room.copy_from_slice(s.as_bytes());
            self.len = end;
        } else {
            let mut text = String::with_capacity(end * 2);
            text.push_str(self.as_str());
            text.push_str(s);
            self.spilled = Some(text);
        }
        Ok(())
    }
}

/// Changes the level of the subscriber [`init`] installed.
pub struct LogLevel {
    filter: Arc<LogFilter>,
    /// `RUST_LOG` was set and valid: it stays in force, whatever `log.level` says.
    rust_log_wins: bool,
}

/// What [`LogLevel::set`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum LevelChange {
    /// The new level is in force.
    Applied,
    /// `RUST_LOG` is set and wins over `log.level`: nothing changed.
    RustLogWins,
}

impl LogLevel {
    /// Puts `level` (a tracing filter, `log.level`) in force.
    pub fn set(&self, level: &str) -> Result<LevelChange, String> {
        if self.rust_log_wins {
            return Ok(LevelChange::RustLogWins);
        }
        self.filter.set(LogFilter::parse(level)?);
        Ok(LevelChange::Applied)
    }
}

/// What decides which spans and events are logged.
enum Filter {
    /// One level for every target (`info`, the default).
    Level(LevelFilter),
    /// Directives (`info,railguard::proxy=debug`).
    Directives(Box<EnvFilter>),
}

/// `log.level` in force, changed while running by [`LogLevel::set`].
///
/// A plain level is one byte, read when a callsite is first used or the level changes: nothing
/// is kept or locked per span. Only a filter with directives is an `EnvFilter`, behind a lock
/// taken by its callbacks (each span's entry and exit among them); with a plain level they
/// read the byte and return. (A `reload::Layer<EnvFilter>` would take two shared locks each
/// time any span is entered or left, whatever the filter says.)
struct LogFilter {
    /// The plain level in force ([`level_code`]), or [`DIRECTIVES`].
    level: AtomicU8,
    /// Shared out of the lock before it is asked anything, so that nothing it calls (a field's
    /// formatting, which may log) runs while the lock is held.
    directives: RwLock<Option<Arc<EnvFilter>>>,
}

/// `LogFilter::level` when directives decide.
const DIRECTIVES: u8 = u8::MAX;

fn level_code(level: LevelFilter) -> u8 {
    match level.into_level() {
        None => 0,
        Some(tracing::Level::ERROR) => 1,
        Some(tracing::Level::WARN) => 2,
        Some(tracing::Level::INFO) => 3,
        Some(tracing::Level::DEBUG) => 4,
        Some(tracing::Level::TRACE) => 5,
    }
}

fn level_of(code: u8) -> LevelFilter {
    match code {
        0 => LevelFilter::OFF,
        1 => LevelFilter::ERROR,
        2 => LevelFilter::WARN,
        3 => LevelFilter::INFO,
        4 => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    }
}

impl LogFilter {
    fn new(filter: Filter) -> Self {
        let this = Self {
            level: AtomicU8::new(DIRECTIVES),
            directives: RwLock::new(None),
        };
        this.put(filter);
        this
    }

    /// `text` as a filter: a plain level, or directives. (An empty text is no directive at
    /// all, which enables nothing, as an `EnvFilter` reads it; `LevelFilter` would read it as
    /// `error`.)
    fn parse(text: &str) -> Result<Filter, String> {
        if !text.is_empty()
            && let Ok(level) = text.parse::<LevelFilter>()
        {
            return Ok(Filter::Level(level));
        }
        EnvFilter::try_new(text)
            .map(|filter| Filter::Directives(Box::new(filter)))
            .map_err(|e| format!("{text:?} is not a tracing filter: {e}"))
    }

    fn put(&self, filter: Filter) {
        let mut directives = self
            .directives
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        match filter {
            Filter::Level(level) => {
                self.level.store(level_code(level), Ordering::Release);
                *directives = None;
            }
            Filter::Directives(filter) => {
                *directives = Some(Arc::new(*filter));
                self.level.store(DIRECTIVES, Ordering::Release);
            }
        }
    }

    /// Puts `filter` in force, and has every callsite ask again whether it is enabled.
    fn set(&self, filter: Filter) {
        self.put(filter);
        tracing::callsite::rebuild_interest_cache();
    }

    /// What decides now: the plain level, or the directives.
    fn current(&self) -> Decides {
        loop {
            match self.level.load(Ordering::Acquire) {
                DIRECTIVES => {
                    let directives = self
                        .directives
                        .read()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clone();
                    // `None`: a plain level replaced them just now; it is read again.
                    if let Some(directives) = directives {
                        return Decides::Directives(directives);
                    }
                }
                code => return Decides::Level(level_of(code)),
            }
        }
    }

    /// The plain level in force, or `None` when directives decide.
    fn plain(&self) -> Option<LevelFilter> {
        match self.level.load(Ordering::Acquire) {
            DIRECTIVES => None,
            code => Some(level_of(code)),
        }
    }

    /// `f` of the directives, when they decide.
    fn directives(&self, f: impl FnOnce(&EnvFilter)) {
        if self.plain().is_none()
            && let Decides::Directives(directives) = self.current()
        {
            f(&directives);
        }
    }
}

/// What [`LogFilter::current`] found.
enum Decides {
    Level(LevelFilter),
    Directives(Arc<EnvFilter>),
}

/// The subscriber's filter: [`LogFilter`], shared with [`LogLevel`].
struct FilterLayer(Arc<LogFilter>);

impl<S> Layer<S> for FilterLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        match self.0.current() {
            Decides::Level(level) if *metadata.level() <= level => Interest::always(),
            Decides::Level(_) => Interest::never(),
            Decides::Directives(f) => Layer::<S>::register_callsite(&*f, metadata),
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>, cx: Context<'_, S>) -> bool {
        match self.0.current() {
            Decides::Level(level) => *metadata.level() <= level,
            Decides::Directives(f) => Layer::<S>::enabled(&*f, metadata, cx),
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        match self.0.current() {
            Decides::Level(level) => Some(level),
            Decides::Directives(f) => Layer::<S>::max_level_hint(&*f),
        }
    }

    // With a plain level the span callbacks read one byte and return: nothing is kept per span.

    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, cx: Context<'_, S>) {
        self.0
            .directives(|f| Layer::<S>::on_new_span(f, attrs, id, cx));
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, cx: Context<'_, S>) {
        self.0
            .directives(|f| Layer::<S>::on_record(f, id, values, cx));
    }

    fn on_enter(&self, id: &span::Id, cx: Context<'_, S>) {
        self.0.directives(|f| Layer::<S>::on_enter(f, id, cx));
    }

    fn on_exit(&self, id: &span::Id, cx: Context<'_, S>) {
        self.0.directives(|f| Layer::<S>::on_exit(f, id, cx));
    }

    fn on_close(&self, id: span::Id, cx: Context<'_, S>) {
        self.0.directives(|f| Layer::<S>::on_close(f, id, cx));
    }
}

/// What a test's subscriber writes, kept to be read back: a writer for a fmt layer
/// (`with_writer(move || buffer.clone())`).
#[cfg(test)]
#[derive(Clone, Default)]
pub(crate) struct LogBuffer(Arc<std::sync::Mutex<Vec<u8>>>);

#[cfg(test)]
impl LogBuffer {
    /// Everything written so far.
    pub(crate) fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

#[cfg(test)]
impl std::io::Write for LogBuffer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// What a pretty subscriber wrote, its span texts by [`SpanText`] or by `DefaultFields`:
    /// a span with fields made with it and recorded later, one of them longer than the stack's
    /// buffer and one with an escape character.
    fn logged(span_text: bool) -> String {
        let buffer = LogBuffer::default();
        let out = buffer.clone();
        let layer = fmt::layer()
            .without_time()
            .with_ansi(false)
            .with_target(false)
            .with_writer(move || out.clone());
        let run = || {
            let long = "x".repeat(300);
            let span = tracing::info_span!(
                "proxy.request",
                method = "POST",
                path = "/payments",
                request_id = "id-\u{1b}[31m-1",
                lock.token = tracing::field::Empty,
                account = tracing::field::Empty
            );
            let _entered = span.enter();
            tracing::info!("before");
            span.record("lock.token", 42);
            tracing::info!("between");
            span.record("account", long.as_str());
            tracing::info!("after");
        };
        if span_text {
            tracing::subscriber::with_default(
                tracing_subscriber::registry().with(layer.fmt_fields(SpanText)),
                run,
            );
        } else {
            tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), run);
        }
        buffer.text()
    }

    // The span's text written whole is the text the default writes field by field, recorded
    // fields, a value longer than the stack's buffer and an escaped one included.
    #[test]
    fn a_spans_text_is_the_defaults() {
        let ours = logged(true);
        assert_eq!(ours.lines().count(), 3, "{ours}");
        assert!(ours.contains("lock.token=42"), "{ours}");
        assert!(
            ours.contains(&format!("account=\"{}\"", "x".repeat(300))),
            "{ours}"
        );
        assert!(!ours.contains('\u{1b}'), "the escape is escaped: {ours}");
        assert_eq!(ours, logged(false));
    }

    /// The messages of the events a subscriber with `filter` lets through.
    #[derive(Clone, Default)]
    struct Written(Arc<Mutex<Vec<String>>>);

    impl<S: Subscriber> Layer<S> for Written {
        fn on_event(&self, event: &tracing::Event<'_>, _cx: Context<'_, S>) {
            struct Message(String);
            impl tracing::field::Visit for Message {
                fn record_debug(
                    &mut self,
                    field: &tracing::field::Field,
                    value: &dyn std::fmt::Debug,
                ) {
                    if field.name() == "message" {
                        self.0 = format!("{value:?}");
                    }
                }
            }
            let mut message = Message(String::new());
            event.record(&mut message);
            self.0.lock().unwrap().push(message.0);
        }
    }

    mod quiet {
        pub(super) fn log() {
            tracing::info!("quiet info");
            tracing::debug!("quiet debug");
        }
    }

    mod loud {
        pub(super) fn log() {
            tracing::info!("loud info");
            tracing::debug!("loud debug");
            let span = tracing::debug_span!("loud_span");
            let _entered = span.enter();
            tracing::debug!("loud debug in a span");
        }
    }

    // A plain level and directives each let through what they say, and either replaces the
    // other while the subscriber runs, the callsites' cached interest with it.
    #[test]
    fn a_plain_level_and_directives_replace_each_other_while_running() {
        let written = Written::default();
        let filter = Arc::new(LogFilter::new(LogFilter::parse("info").unwrap()));
        let subscriber = tracing_subscriber::registry()
            .with(FilterLayer(filter.clone()))
            .with(written.clone());
        let level = LogLevel {
            filter,
            rust_log_wins: false,
        };
        let taken = || std::mem::take(&mut *written.0.lock().unwrap());
        tracing::subscriber::with_default(subscriber, || {
            quiet::log();
            loud::log();
            assert_eq!(taken(), ["quiet info", "loud info"]);

            let loud_only = format!("info,{}::loud=debug", module_path!());
            assert_eq!(level.set(&loud_only), Ok(LevelChange::Applied));
            quiet::log();
            loud::log();
            assert_eq!(
                taken(),
                [
                    "quiet info",
                    "loud info",
                    "loud debug",
                    "loud debug in a span"
                ]
            );

            // A span's directive: what is written inside the span, which the filter follows
            // as it is entered and left.
            assert_eq!(
                level.set("info,[loud_span]=debug"),
                Ok(LevelChange::Applied)
            );
            quiet::log();
            loud::log();
            assert_eq!(taken(), ["quiet info", "loud info", "loud debug in a span"]);

            assert_eq!(level.set("debug"), Ok(LevelChange::Applied));
            quiet::log();
            assert_eq!(taken(), ["quiet info", "quiet debug"]);

            assert_eq!(level.set("warn"), Ok(LevelChange::Applied));
            quiet::log();
            loud::log();
            assert!(taken().is_empty());

            assert!(level.set("info,=[").is_err(), "not a filter");
            quiet::log();
            assert!(taken().is_empty(), "a refused filter changes nothing");
        });
    }

    // A plain level in any of the spellings an `EnvFilter` takes for one is a level; an empty
    // filter is no directive and enables nothing.
    #[test]
    fn plain_levels_in_any_spelling_are_levels_and_an_empty_filter_enables_nothing() {
        for (text, level) in [
            ("info", LevelFilter::INFO),
            ("INFO", LevelFilter::INFO),
            ("Debug", LevelFilter::DEBUG),
            ("off", LevelFilter::OFF),
            ("3", LevelFilter::INFO),
            ("5", LevelFilter::TRACE),
        ] {
            match LogFilter::parse(text) {
                Ok(Filter::Level(parsed)) => assert_eq!(parsed, level, "{text:?}"),
                _ => panic!("{text:?} is not read as a plain level"),
            }
        }
        for text in ["", "info,hyper=warn", "railguard=debug"] {
            assert!(
                matches!(LogFilter::parse(text), Ok(Filter::Directives(_))),
                "{text:?} is read as directives"
            );
        }
        let written = Written::default();
        let filter = Arc::new(LogFilter::new(LogFilter::parse("").unwrap()));
        let subscriber = tracing_subscriber::registry()
            .with(FilterLayer(filter))
            .with(written.clone());
        tracing::subscriber::with_default(subscriber, || {
            tracing::error!("an error");
            quiet::log();
        });
        assert!(
            written.0.lock().unwrap().is_empty(),
            "an empty filter enables nothing"
        );
    }

    #[test]
    fn rust_log_stays_in_force() {
        let level = LogLevel {
            filter: Arc::new(LogFilter::new(Filter::Level(LevelFilter::INFO))),
            rust_log_wins: true,
        };
        assert_eq!(level.set("debug"), Ok(LevelChange::RustLogWins));
        assert_eq!(level.filter.plain(), Some(LevelFilter::INFO));
    }
}
