//! The agent's newest log lines, kept in memory for the `log_tail` command: a log layer
//! formats every event the log filter lets through as a compact text line (time, level,
//! span names, target, message, fields, then the spans' fields; no colours) into a ring of at most [`TAIL_LINES`] lines and
//! [`TAIL_BYTES`] bytes. Nothing is read from a file; the oldest lines go first.
//!
//! A slot's tenant can make the agent log text of its choosing (a user name, a path, an
//! `SSH_CONNECTION`), so each line is stored with its control characters escaped
//! ([`printable`]) and cut to [`LINE_BYTES`].

use slotpool_protocol::api::{LOG_TAIL_MAX_BYTES, LOG_TAIL_MAX_LINES};
use slotpool_protocol::text::printable;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::{DefaultFields, Writer};
use tracing_subscriber::fmt::{FormatFields, MakeWriter};

/// Lines the ring keeps.
pub const TAIL_LINES: usize = LOG_TAIL_MAX_LINES as usize;
/// Bytes of text the ring keeps, over all its lines.
pub const TAIL_BYTES: usize = 64 * 1024;
/// Longest line kept; a longer one is cut, marked with `…`.
pub const LINE_BYTES: usize = 2 * 1024;

/// The ring of newest log lines; clones share it.
#[derive(Clone, Debug)]
pub struct LogTail {
    ring: Arc<Mutex<Ring>>,
}

#[derive(Debug)]
struct Ring {
    lines: VecDeque<String>,
    bytes: usize,
    max_lines: usize,
    max_bytes: usize,
}

impl Default for LogTail {
    fn default() -> Self {
        LogTail::new(TAIL_LINES, TAIL_BYTES)
    }
}

impl LogTail {
    /// An empty ring of at most `max_lines` lines and `max_bytes` bytes.
    pub fn new(max_lines: usize, max_bytes: usize) -> LogTail {
        LogTail {
            ring: Arc::new(Mutex::new(Ring {
                lines: VecDeque::new(),
                bytes: 0,
                max_lines,
                max_bytes,
            })),
        }
    }

    /// The log layer that fills this ring.
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S> + Send + Sync + 'static
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        tracing_subscriber::fmt::layer()
            .fmt_fields(TailFields::default())
            .compact()
            .with_writer(self.clone())
            .with_ansi(false)
            .with_target(true)
            .log_internal_errors(false)
    }

    /// Keeps `line` (escaped, cut to [`LINE_BYTES`]) as the newest, dropping the oldest
    /// lines while the ring is over either bound.
    pub fn push(&self, line: &str) {
        let line = line.trim_end_matches('\n');
        let line = cut(printable(line).into_owned(), LINE_BYTES);
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.bytes += line.len();
        ring.lines.push_back(line);
        while ring.lines.len() > ring.max_lines || ring.bytes > ring.max_bytes {
            let Some(old) = ring.lines.pop_front() else {
                break;
            };
            ring.bytes -= old.len();
        }
    }

    /// The newest `lines` lines (at most [`LOG_TAIL_MAX_LINES`]) whose text fits in
    /// [`LOG_TAIL_MAX_BYTES`], oldest first.
    pub fn newest(&self, lines: u32) -> Vec<String> {
        let wanted = lines.min(LOG_TAIL_MAX_LINES) as usize;
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let mut bytes = 0;
        let mut out: Vec<String> = ring
            .lines
            .iter()
            .rev()
            .take(wanted)
            .take_while(|l| {
                bytes += l.len();
                bytes <= LOG_TAIL_MAX_BYTES
            })
            .cloned()
            .collect();
        out.reverse();
        out
    }
}

/// The text log's field format under a type of its own. A span's fields are formatted
/// once per field format type and kept in the span; two layers with the same type (this
/// one and stderr's) would both append what a span records later (`op`, `slot`), and
/// every such field would show twice, in both logs.
#[derive(Debug, Default)]
pub struct TailFields(DefaultFields);

impl<'w> FormatFields<'w> for TailFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'w>, fields: R) -> std::fmt::Result {
        self.0.format_fields(writer, fields)
    }
}

/// `line` cut to at most `max` bytes at a character boundary, marked with `…`.
fn cut(mut line: String, max: usize) -> String {
    if line.len() <= max {
        return line;
    }
    let mut end = max - '…'.len_utf8();
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    line.truncate(end);
    line.push('…');
    line
}

/// One event's formatted text, kept when the formatter is done with it.
pub struct LineWriter {
    tail: LogTail,
    text: Vec<u8>,
}

impl std::io::Write for LineWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // Never more than a line's worth per event, however much is written.
        let room = (LINE_BYTES * 4).saturating_sub(self.text.len());
        self.text.extend_from_slice(&buf[..buf.len().min(room)]);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        if !self.text.is_empty() {
            self.tail.push(&String::from_utf8_lossy(&self.text));
        }
    }
}

impl<'a> MakeWriter<'a> for LogTail {
    type Writer = LineWriter;

    fn make_writer(&'a self) -> LineWriter {
        LineWriter {
            tail: self.clone(),
            text: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn the_ring_keeps_the_newest_lines_within_both_bounds() {
        let tail = LogTail::new(3, 1000);
        for i in 0..10 {
            tail.push(&format!("line {i}\n"));
        }
        assert_eq!(tail.newest(200), ["line 7", "line 8", "line 9"]);
        assert_eq!(tail.newest(2), ["line 8", "line 9"]);

        let tail = LogTail::new(100, 25);
        for i in 0..10 {
            tail.push(&format!("line {i} ......"));
        }
        // 14 bytes a line: only one fits in 25 bytes.
        assert_eq!(tail.newest(200), ["line 9 ......"]);
    }

    #[test]
    fn a_long_line_is_cut_and_the_answer_stays_under_its_bound() {
        let tail = LogTail::default();
        for _ in 0..(TAIL_LINES * 2) {
            tail.push(&"é".repeat(LINE_BYTES));
        }
        let newest = tail.newest(u32::MAX);
        assert!(newest
            .iter()
            .all(|l| l.len() <= LINE_BYTES && l.ends_with('…')));
        assert!(newest.iter().map(String::len).sum::<usize>() <= LOG_TAIL_MAX_BYTES);
        let ring = tail.ring.lock().unwrap();
        assert!(ring.bytes <= TAIL_BYTES && ring.lines.len() <= TAIL_LINES);
        assert_eq!(
            ring.bytes,
            ring.lines.iter().map(String::len).sum::<usize>()
        );
    }

    #[test]
    fn logged_events_arrive_as_lines_with_their_control_characters_escaped() {
        let tail = LogTail::new(10, 10_000);
        let subscriber = tracing_subscriber::registry().with(tail.layer());
        tracing::subscriber::with_default(subscriber, || {
            let _span = tracing::info_span!("agent", backing_id = "bn-1").entered();
            // With Display, as the agent logs names and paths: not quoted or escaped.
            tracing::info!(user = %"ev\x1b[2J\r\nil\u{202e}", "slot prepared");
        });
        let lines = tail.newest(10);
        assert_eq!(lines.len(), 1, "{lines:?}");
        let line = &lines[0];
        // The message first, the spans' fields last: a line cut at a pane's edge keeps
        // what happened.
        assert!(
            line.contains(" INFO agent: slotpool_agent::log_tail::tests: slot prepared user="),
            "{line}"
        );
        assert!(line.ends_with("backing_id=\"bn-1\""), "{line}");
        assert!(line.contains(r"\u{d}\u{a}il\u{202e}"), "{line:?}");
        assert!(
            !line.contains(|c: char| c.is_control() || c == '\u{202e}'),
            "{line:?}"
        );
    }

    #[test]
    fn a_field_a_span_records_later_shows_once_in_the_tail_and_in_the_other_log() {
        let (tail, stderr) = (LogTail::new(10, 10_000), LogTail::new(10, 10_000));
        let subscriber = tracing_subscriber::registry().with(tail.layer()).with(
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_writer(stderr.clone()),
        );
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("command", op = tracing::field::Empty);
            span.record("op", "open");
            let _entered = span.entered();
            tracing::info!("open to new slots");
        });
        for (log, lines) in [("tail", tail.newest(10)), ("other", stderr.newest(10))] {
            assert_eq!(lines.len(), 1, "{log}: {lines:?}");
            assert_eq!(lines[0].matches("op=").count(), 1, "{log}: {}", lines[0]);
        }
    }
}
