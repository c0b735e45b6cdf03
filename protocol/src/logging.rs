//! How slotpool's daemons (the launcher, the agent, the console's log file) write their
//! log: `--log-format text` (the default, for people) or `json` (one object a line, for
//! a log system). JSON lines carry the event's fields at the top level and the fields
//! of the spans it is in (`request_id`, `node_id`, `backing_id`, ...) under `spans`,
//! so one request can be followed across processes.
//!
//! Text from outside (a client's `requestor`, a slot user's name or path, a server's
//! error) reaches the log in field values and messages. In the text format every value
//! and message is written through [`crate::text::printable`] ([`EscapedFields`]): a
//! control character or a bidirectional override shows as an escape, so nothing in the
//! log moves a terminal's cursor or forges a line. JSON lines escape control characters
//! by their encoding.

use std::fmt;
use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FormatFields, MakeWriter};
use tracing_subscriber::layer::{Identity, Layered, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("unknown log format {s:?}: text or json")),
        }
    }
}

/// Installs the process's log subscriber: `filter` on `writer`, in `format`; `ansi`
/// colours text (never JSON).
pub fn init<W>(format: LogFormat, filter: EnvFilter, writer: W, ansi: bool)
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    init_with(format, filter, writer, ansi, Identity::new());
}

/// [`init`], with one more layer that sees every event the filter lets through (the
/// agent keeps its newest lines in memory this way).
pub fn init_with<W, L>(format: LogFormat, filter: EnvFilter, writer: W, ansi: bool, extra: L)
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
    L: Layer<Layered<EnvFilter, Registry>> + Send + Sync + 'static,
{
    let output = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_target(false)
        // A log whose reader has gone (`slotpool demo 2>&1 | head`) is dropped: reporting
        // that on the same stream would panic.
        .log_internal_errors(false);
    let base = tracing_subscriber::registry().with(filter).with(extra);
    match format {
        LogFormat::Text => base
            .with(output.with_ansi(ansi).fmt_fields(EscapedFields))
            .init(),
        LogFormat::Json => base
            .with(
                output
                    .json()
                    .flatten_event(true)
                    .with_current_span(false)
                    .with_span_list(true),
            )
            .init(),
    }
}

/// The text format's fields, as tracing-subscriber's default writes them (the message
/// bare and first, then `name=value` separated by spaces, names in italics on a
/// terminal), with every value and message passed through [`crate::text::printable`].
#[derive(Clone, Copy, Debug, Default)]
pub struct EscapedFields;

impl<'w> FormatFields<'w> for EscapedFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut visitor = EscapingVisitor {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct EscapingVisitor<'w> {
    writer: Writer<'w>,
    first: bool,
    result: fmt::Result,
}

impl EscapingVisitor<'_> {
    fn write(&mut self, field: &Field, value: &str) {
        if self.result.is_err() {
            return;
        }
        let name = field.name();
        if name.starts_with("log.") {
            return;
        }
        let name = name.strip_prefix("r#").unwrap_or(name);
        let value = crate::text::printable(value);
        let sep = if self.first { "" } else { " " };
        self.first = false;
        self.result = if name == "message" {
            write!(self.writer, "{sep}{value}")
        } else if self.writer.has_ansi_escapes() {
            write!(self.writer, "{sep}\x1b[3m{name}\x1b[0m={value}")
        } else {
            write!(self.writer, "{sep}{name}={value}")
        };
    }
}

impl Visit for EscapingVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.write(field, value);
        } else {
            self.write(field, &format!("{value:?}"));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.write(field, &format!("{value:?}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn text_log_lines_escape_what_a_client_sent() {
        let out = Captured::default();
        let writer = {
            let out = out.clone();
            move || out.clone()
        };
        let subscriber = tracing_subscriber::fmt()
            .with_writer(writer)
            .with_ansi(false)
            .fmt_fields(EscapedFields)
            .finish();
        let requestor = "ci\0\x1b[2J\nINFO forged line\u{202e}";
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("request", request_id = %requestor);
            let _in = span.enter();
            tracing::info!(%requestor, quoted = requestor, "submitted by {requestor}");
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.matches('\n').count(), 1, "one line: {text:?}");
        assert!(!text.contains('\x1b') && !text.contains('\0') && !text.contains('\u{202e}'));
        let escaped = "ci\\u{0}\\u{1b}[2J\\u{a}INFO forged line\\u{202e}";
        assert!(
            text.contains(&format!("submitted by {escaped}"))
                && text.contains(&format!("requestor={escaped}"))
                && text.contains(&format!("request{{request_id={escaped}}}")),
            "{text}"
        );
        // A Debug-formatted value keeps its quotes, escaped by Rust already.
        assert!(text.contains("quoted=\"ci\\0\\u{1b}[2J\\nINFO"), "{text}");
    }
}
