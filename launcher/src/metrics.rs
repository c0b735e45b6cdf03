//! The launcher's metric vocabulary and this process's counters: what a launch, a
//! deletion or a provider error is called, and the one-line calls (`launch`,
//! `deletion`, `booted`, `fulfilled`, `lease_takeover`, `provider_error`) that count
//! them where they happen. It imports nothing of the launcher: the domain bumps these
//! counters, and `/metrics` ([`crate::http`]) reads them when scraped.
//!
//! Labels come from the configuration (provider, pool, label), never from a backing
//! node or a request, so the number of series does not grow with the pool.

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use slotpool_protocol::model::BackingNode;
use slotpool_protocol::time::UnixMillis;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

/// How a launch attempt ended ([`launch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchOutcome {
    /// The provider created the instance.
    Launched,
    /// The provider was out of capacity; asked again after a back-off.
    Capacity,
    /// Any other error.
    Failed,
}

impl LaunchOutcome {
    pub(crate) const ALL: [LaunchOutcome; 3] = [Self::Launched, Self::Capacity, Self::Failed];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Launched => "launched",
            Self::Capacity => "capacity",
            Self::Failed => "failed",
        }
    }
}

/// Why a backing node's instance is given back, or the node failed (`/metrics` counts
/// each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeletionReason {
    /// Idle for its grace-time.
    Grace,
    /// Retired at its max-age, then released once empty.
    MaxAge,
    /// Retired for another reason (its agent shutting down, its label gone), then
    /// released once empty.
    Retired,
    /// Drained by an operator.
    Drain,
    /// Killed by an operator.
    Kill,
    /// Failed: its launch, its boot or its agent.
    Failure,
    /// Failed because the cloud took its machine back (a spot interruption).
    SpotInterruption,
    /// An instance no backing node records, found by the leak sweep.
    Leak,
}

impl DeletionReason {
    pub(crate) const ALL: [DeletionReason; 8] = [
        Self::Grace,
        Self::MaxAge,
        Self::Retired,
        Self::Drain,
        Self::Kill,
        Self::Failure,
        Self::SpotInterruption,
        Self::Leak,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Grace => "grace",
            Self::MaxAge => "max-age",
            Self::Retired => "retired",
            Self::Drain => "drain",
            Self::Kill => "kill",
            Self::Failure => "failure",
            Self::SpotInterruption => "spot-interruption",
            Self::Leak => "leak",
        }
    }
}

/// A provider call ([`provider_error`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProviderCall {
    Launch,
    Delete,
    List,
}

impl ProviderCall {
    pub(crate) const ALL: [ProviderCall; 3] = [Self::Launch, Self::Delete, Self::List];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Launch => "launch",
            Self::Delete => "delete",
            Self::List => "list",
        }
    }
}

/// How a provider call failed ([`provider_error`]): the kinds of the provider's errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProviderErrorKind {
    Failed,
    Timeout,
    Capacity,
}

impl ProviderErrorKind {
    pub(crate) const ALL: [ProviderErrorKind; 3] = [Self::Failed, Self::Timeout, Self::Capacity];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Failed => "failed",
            Self::Timeout => "timeout",
            Self::Capacity => "capacity",
        }
    }
}

/// Upper bounds (seconds) of the allocation-latency buckets: a warm slot is handed out
/// in milliseconds, a cold one waits for a backing node to boot (minutes).
const LATENCY_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Upper bounds (seconds) of the boot-time buckets: a local process is up in a second,
/// a cloud machine in one to a few minutes.
const BOOT_BOUNDS: &[f64] = &[
    0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0,
];

/// Upper bounds (seconds) of a request's wait by tenant: from a warm slot's
/// milliseconds to a queue's minutes.
const WAIT_BOUNDS: &[f64] = &[
    0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
];

/// Upper bounds (seconds) of a supervisor pass's duration: a pass takes well under a
/// millisecond unless it plans (a few KV writes).
const PASS_BOUNDS: &[f64] = &[
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0,
];

/// Most buckets a [`Histogram`] has, the one above every bound included.
const MAX_BUCKETS: usize = 16;

/// A histogram of durations as atomics, so observing one costs three atomic adds.
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bound, the last one for everything above them.
    buckets: [AtomicU64; MAX_BUCKETS],
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl Histogram {
    const fn new(bounds: &'static [f64]) -> Self {
        assert!(bounds.len() < MAX_BUCKETS);
        Histogram {
            bounds,
            buckets: [const { AtomicU64::new(0) }; MAX_BUCKETS],
            count: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
        }
    }

    fn observe_ms(&self, ms: u64) {
        self.observe(Duration::from_millis(ms));
    }

    fn observe(&self, took: Duration) {
        let secs = took.as_secs_f64();
        let bucket = self
            .bounds
            .iter()
            .position(|bound| secs <= *bound)
            .unwrap_or(self.bounds.len());
        self.buckets[bucket].fetch_add(1, Relaxed);
        self.sum_us
            .fetch_add(u64::try_from(took.as_micros()).unwrap_or(u64::MAX), Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    pub(crate) fn encode(
        &self,
        encoder: &mut DescriptorEncoder,
        name: &str,
        help: &str,
    ) -> Result<(), std::fmt::Error> {
        self.encode_into(encoder.encode_descriptor(name, help, None, MetricType::Histogram)?)
    }

    fn encode_into(
        &self,
        mut family: prometheus_client::encoding::MetricEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        let buckets: Vec<(f64, u64)> = self
            .bounds
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(self.buckets.iter().map(|b| b.load(Relaxed)))
            .collect();
        family.encode_histogram::<NoLabelSet>(
            self.sum_us.load(Relaxed) as f64 / 1_000_000.0,
            self.count.load(Relaxed),
            &buckets,
            None,
        )
    }
}

/// The counter families whose labels come from the configuration (provider, pool,
/// label): few, and kept in one map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Family {
    Launches,
    Deletions,
    ProviderErrors,
}

/// This process's counters, read only when scraped.
pub struct Process {
    /// Counts by family and label set; an event is rare (a launch, a deletion, a
    /// provider error), so a lock is cheap here.
    counts: Mutex<BTreeMap<(Family, Labels), u64>>,
    lease_takeovers: AtomicU64,
    worker_spins: AtomicU64,
    /// When the supervisor last finished a pass (Unix ms; 0: not yet).
    last_pass_ms: AtomicU64,
    pub(crate) pass: Histogram,
    pub(crate) allocation: Histogram,
    /// Submission to fulfilment by tenant name (from the configuration: few).
    wait_by_tenant: Mutex<BTreeMap<String, Histogram>>,
    pub(crate) boot: Histogram,
}

/// The counters of this process.
pub static PROCESS: Process = Process {
    counts: Mutex::new(BTreeMap::new()),
    lease_takeovers: AtomicU64::new(0),
    worker_spins: AtomicU64::new(0),
    last_pass_ms: AtomicU64::new(0),
    pass: Histogram::new(PASS_BOUNDS),
    allocation: Histogram::new(LATENCY_BOUNDS),
    wait_by_tenant: Mutex::new(BTreeMap::new()),
    boot: Histogram::new(BOOT_BOUNDS),
};

impl Process {
    fn add(&self, family: Family, labels: Labels) {
        *self
            .counts
            .lock()
            .expect("metrics lock")
            .entry((family, labels))
            .or_default() += 1;
    }

    /// The labelled counts so far.
    pub(crate) fn counts(&self) -> BTreeMap<(Family, Labels), u64> {
        self.counts.lock().expect("metrics lock").clone()
    }

    /// Request workers paused for stepping their bound ([`worker_spin`]).
    pub(crate) fn worker_spins(&self) -> u64 {
        self.worker_spins.load(Relaxed)
    }

    /// Requests taken over so far ([`lease_takeover`]).
    pub(crate) fn lease_takeovers(&self) -> u64 {
        self.lease_takeovers.load(Relaxed)
    }
}

/// A metric's labels, in order.
pub(crate) type Labels = Vec<(&'static str, String)>;

pub(crate) fn place(b: &BackingNode) -> Labels {
    vec![
        ("provider", b.provider.clone()),
        ("pool", b.pool.clone()),
        ("label", b.label.clone()),
    ]
}

pub(crate) fn with(mut labels: Labels, name: &'static str, value: &str) -> Labels {
    labels.push((name, value.to_string()));
    labels
}

/// A launch attempt of `b` ended with `outcome`.
pub fn launch(b: &BackingNode, outcome: LaunchOutcome) {
    PROCESS.add(
        Family::Launches,
        with(place(b), "outcome", outcome.as_str()),
    );
}

/// `b`'s instance is being given back (or `b` failed) for `reason`.
pub fn deletion(b: &BackingNode, reason: DeletionReason) {
    PROCESS.add(Family::Deletions, with(place(b), "reason", reason.as_str()));
}

/// An instance of `provider` found by the leak sweep is being deleted.
pub fn leak_deletion(provider: &str) {
    let labels = vec![
        ("provider", provider.to_string()),
        ("pool", String::new()),
        ("label", String::new()),
        ("reason", DeletionReason::Leak.as_str().to_string()),
    ];
    PROCESS.add(Family::Deletions, labels);
}

/// A `call` to `provider` failed with an error of `kind`.
pub fn provider_error(provider: &str, call: ProviderCall, kind: ProviderErrorKind) {
    let labels = vec![
        ("provider", provider.to_string()),
        ("call", call.as_str().to_string()),
        ("kind", kind.as_str().to_string()),
    ];
    PROCESS.add(Family::ProviderErrors, labels);
}

/// This launcher took over a request whose owner's liveness lease had lapsed.
pub fn lease_takeover() {
    PROCESS.lease_takeovers.fetch_add(1, Relaxed);
}

/// A request worker took `request::worker::STEP_BOUND` steps without waiting.
pub fn worker_spin() {
    PROCESS.worker_spins.fetch_add(1, Relaxed);
}

/// The supervisor finished a pass that took `took`, at `at`.
pub fn pass_done(took: Duration, at: UnixMillis) {
    PROCESS.pass.observe(took);
    PROCESS.last_pass_ms.store(at, Relaxed);
}

/// When the supervisor last finished a pass, if it has.
pub fn last_pass() -> Option<UnixMillis> {
    Some(PROCESS.last_pass_ms.load(Relaxed)).filter(|ms| *ms > 0)
}

/// How long ago at `now` the supervisor last finished a pass (since `started`, before
/// its first).
pub fn pass_age(now: UnixMillis, started: UnixMillis) -> Duration {
    let last = PROCESS.last_pass_ms.load(Relaxed).max(started);
    Duration::from_millis(now.saturating_sub(last))
}

/// A request of tenant `tenant` submitted at `created_at` was fulfilled at
/// `fulfilled_at`.
pub fn fulfilled(tenant: &str, created_at: UnixMillis, fulfilled_at: UnixMillis) {
    let took = fulfilled_at.saturating_sub(created_at);
    PROCESS.allocation.observe_ms(took);
    let mut by_tenant = PROCESS
        .wait_by_tenant
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    by_tenant
        .entry(tenant.to_string())
        .or_insert_with(|| Histogram::new(WAIT_BOUNDS))
        .observe_ms(took);
}

/// Encodes the submission-to-fulfilment histogram of each tenant (those named by
/// `tenants` first at zero, so a quantile exists before the first fulfilment).
pub(crate) fn encode_tenant_waits<'a>(
    encoder: &mut DescriptorEncoder,
    tenants: impl IntoIterator<Item = &'a str>,
) -> Result<(), std::fmt::Error> {
    let mut by_tenant = PROCESS
        .wait_by_tenant
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    for t in tenants {
        by_tenant
            .entry(t.to_string())
            .or_insert_with(|| Histogram::new(WAIT_BOUNDS));
    }
    let mut family = encoder.encode_descriptor(
        "tenant_wait_seconds",
        "Time from a request's submission to its fulfilment, by tenant (requests this launcher fulfilled).",
        None,
        MetricType::Histogram,
    )?;
    for (tenant, h) in by_tenant.iter() {
        let labels: Labels = vec![("tenant", tenant.clone())];
        h.encode_into(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A backing node whose launch started at `launched_at` had its agent report in at
/// `ready_at`.
pub fn booted(launched_at: UnixMillis, ready_at: UnixMillis) {
    PROCESS
        .boot
        .observe_ms(ready_at.saturating_sub(launched_at));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_lands_in_the_first_bucket_that_holds_it() {
        let h = Histogram::new(LATENCY_BOUNDS);
        h.observe_ms(300); // 0.3 s: the 0.5 s bucket
        h.observe_ms(1_000_000); // above every bound
        let grew: Vec<usize> = (0..MAX_BUCKETS)
            .filter(|i| h.buckets[*i].load(Relaxed) > 0)
            .collect();
        assert_eq!(grew, vec![6, LATENCY_BOUNDS.len()]);
        assert_eq!(h.count.load(Relaxed), 2);
        assert_eq!(h.sum_us.load(Relaxed), 1_000_300_000);
    }
}
