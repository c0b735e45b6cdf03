//! How slotpool's daemons (the launcher, the agent, the console's log file) write their
//! log: `--log-format text` (the default, for people) or `json` (one object a line, for
//! a log system). JSON lines carry the event's fields at the top level and the fields
//! of the spans it is in (`request_id`, `node_id`, `backing_id`, ...) under `spans`,
//! so one request can be followed across processes.

use tracing_subscriber::fmt::MakeWriter;
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
        LogFormat::Text => base.with(output.with_ansi(ansi)).init(),
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
