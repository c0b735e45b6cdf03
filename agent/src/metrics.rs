//! This agent's metric counters, bumped where things happen (`prepared`, `released`,
//! `wipe_failed`, `heartbeat`). It imports nothing of the agent: the slot table and the
//! command handlers bump these, and the listener ([`crate::metrics_http`]) reads them
//! when scraped.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use std::sync::LazyLock;
use std::time::Duration;

/// Upper bounds (seconds) of the prepare and release buckets: a warm slot is prepared
/// in milliseconds, a release that wipes a big workspace may take minutes.
const DURATION_BOUNDS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0, 120.0,
];

/// The counters and histograms of this process, bumped where things happen.
pub struct AgentMetrics {
    pub(crate) prepare_seconds: Histogram,
    pub(crate) release_seconds: Histogram,
    pub(crate) wipe_failures: Counter,
    pub(crate) heartbeats: Family<[(&'static str, &'static str); 1], Counter>,
}

/// The metrics of this process.
pub static METRICS: LazyLock<AgentMetrics> = LazyLock::new(|| AgentMetrics {
    prepare_seconds: Histogram::new(DURATION_BOUNDS),
    release_seconds: Histogram::new(DURATION_BOUNDS),
    wipe_failures: Counter::default(),
    heartbeats: Family::default(),
});

/// A prepare command took `took` (whatever its outcome).
pub fn prepared(took: Duration) {
    METRICS.prepare_seconds.observe(took.as_secs_f64());
}

/// A release command took `took` (whatever its outcome).
pub fn released(took: Duration) {
    METRICS.release_seconds.observe(took.as_secs_f64());
}

/// A slot could not be wiped and is dirty now.
pub fn wipe_failed() {
    METRICS.wipe_failures.inc();
}

/// A heartbeat was written (`ok`) or not.
pub fn heartbeat(ok: bool) {
    let outcome = if ok { "written" } else { "failed" };
    METRICS
        .heartbeats
        .get_or_create(&[("outcome", outcome)])
        .inc();
}
