//! How slotpool's daemons (the launcher, the agent, the console's log file) write their
//! log: `--log-format text` (the default, for people) or `json` (one object a line, for
//! a log system). JSON lines carry the event's fields at the top level and the fields
//! of the spans it is in (`request_id`, `node_id`, `backing_id`, ...) under `spans`,
//! so one request can be followed across processes.

use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

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
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_target(false)
        // A log whose reader has gone (`slotpool demo 2>&1 | head`) is dropped: reporting
        // that on the same stream would panic.
        .log_internal_errors(false);
    match format {
        LogFormat::Text => builder.with_ansi(ansi).init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(true)
            .init(),
    }
}
