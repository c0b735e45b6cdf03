//! Every metric `/metrics` serves, defined here and nowhere else.
//!
//! Two kinds, named apart in the README ("Monitoring"):
//! - **pool-wide** gauges, computed at scrape time from this launcher's mirror of KV
//!   ([`crate::world::World`]): every launcher serves the same values;
//! - **per-process** counters and the allocation-latency histogram, for what this
//!   launcher did: plain atomics ([`PROCESS`]), bumped by one-line calls where it
//!   happens, read only when scraped.

use crate::shared::Shared;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use slotpool_protocol::model::BackingState;
use slotpool_protocol::time::{now_ms, UnixMillis};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

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
    const ALL: [LaunchOutcome; 3] = [Self::Launched, Self::Capacity, Self::Failed];

    fn as_str(self) -> &'static str {
        match self {
            Self::Launched => "launched",
            Self::Capacity => "capacity",
            Self::Failed => "failed",
        }
    }
}

/// Why a backing node's instance is given back ([`deletion`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeletionReason {
    /// Idle for its grace-time.
    Grace,
    /// Retired (max-age, its agent shutting down, its label gone) and empty.
    Retired,
    /// Drained by an operator.
    Drain,
    /// Failed: its launch, its agent, or killed by an operator.
    Failure,
    /// An instance no backing node records, found by the leak sweep.
    Leak,
}

impl DeletionReason {
    const ALL: [DeletionReason; 5] = [
        Self::Grace,
        Self::Retired,
        Self::Drain,
        Self::Failure,
        Self::Leak,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Self::Grace => "grace",
            Self::Retired => "retired",
            Self::Drain => "drain",
            Self::Failure => "failure",
            Self::Leak => "leak",
        }
    }
}

/// Upper bounds (seconds) of the allocation-latency buckets: a warm slot is handed out
/// in milliseconds, a cold one waits for a backing node to boot (minutes).
const LATENCY_BOUNDS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// This process's counters: atomics, so recording one costs an atomic add.
pub struct Process {
    launches: [AtomicU64; 3],
    deletions: [AtomicU64; 5],
    /// Per bucket of [`LATENCY_BOUNDS`], the last one for everything above them.
    latency_buckets: [AtomicU64; LATENCY_BOUNDS.len() + 1],
    latency_count: AtomicU64,
    latency_sum_ms: AtomicU64,
}

/// The counters of this process.
pub static PROCESS: Process = Process {
    launches: [const { AtomicU64::new(0) }; 3],
    deletions: [const { AtomicU64::new(0) }; 5],
    latency_buckets: [const { AtomicU64::new(0) }; LATENCY_BOUNDS.len() + 1],
    latency_count: AtomicU64::new(0),
    latency_sum_ms: AtomicU64::new(0),
};

/// A launch attempt ended with `outcome`.
pub fn launch(outcome: LaunchOutcome) {
    PROCESS.launches[outcome as usize].fetch_add(1, Relaxed);
}

/// A backing node's instance is being given back for `reason`.
pub fn deletion(reason: DeletionReason) {
    PROCESS.deletions[reason as usize].fetch_add(1, Relaxed);
}

/// A request submitted at `created_at` was fulfilled at `fulfilled_at`.
pub fn fulfilled(created_at: UnixMillis, fulfilled_at: UnixMillis) {
    let ms = fulfilled_at.saturating_sub(created_at);
    let secs = ms as f64 / 1000.0;
    let bucket = LATENCY_BOUNDS
        .iter()
        .position(|bound| secs <= *bound)
        .unwrap_or(LATENCY_BOUNDS.len());
    PROCESS.latency_buckets[bucket].fetch_add(1, Relaxed);
    PROCESS.latency_sum_ms.fetch_add(ms, Relaxed);
    PROCESS.latency_count.fetch_add(1, Relaxed);
}

/// The registry `/metrics` encodes: one collector that reads the mirror and the counters
/// when scraped.
pub fn registry(shared: Arc<Shared>) -> Registry {
    let mut registry = Registry::with_prefix("slotpool");
    registry.register_collector(Box::new(Collector(shared)));
    registry
}

struct Collector(Arc<Shared>);

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("slotpool collector")
    }
}

type Labels = Vec<(&'static str, String)>;

/// The pool-wide values, read from the mirror under its lock in one pass.
#[derive(Default)]
struct PoolView {
    backing: BTreeMap<Labels, i64>,
    slots: BTreeMap<Labels, i64>,
    waiting: BTreeMap<String, (i64, UnixMillis)>,
}

fn state_name(state: BackingState) -> String {
    serde_json::to_value(state)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{state:?}").to_lowercase())
}

impl Collector {
    fn pool_view(&self) -> PoolView {
        let world = self.0.world();
        let mut view = PoolView::default();
        for label in self.0.config.label_names() {
            for state in ["used", "free", "dirty"] {
                view.slots.insert(
                    vec![("label", label.to_string()), ("state", state.into())],
                    0,
                );
            }
        }
        for b in world.backing.values() {
            let b = &b.value;
            *view
                .backing
                .entry(vec![
                    ("provider", b.provider.clone()),
                    ("pool", b.pool.clone()),
                    ("label", b.label.clone()),
                    ("state", state_name(b.state)),
                ])
                .or_default() += 1;
            let used = world.used_count(&b.id);
            let (dirty, free) = if b.state == BackingState::Ready {
                let dirty = world.agents.get(&b.id).map_or(0, |a| {
                    a.dirty_slots
                        .iter()
                        .filter(|s| !world.used.get(&b.id).is_some_and(|u| u.contains(s)))
                        .count() as u32
                });
                (dirty, b.slots.saturating_sub(used + dirty))
            } else {
                (0, 0)
            };
            for (state, n) in [("used", used), ("free", free), ("dirty", dirty)] {
                *view
                    .slots
                    .entry(vec![("label", b.label.clone()), ("state", state.into())])
                    .or_default() += i64::from(n);
            }
        }
        for (label, queue) in &world.wanting {
            if let Some(oldest) = queue.keys().map(|(_, created, _)| *created).min() {
                view.waiting
                    .insert(label.clone(), (queue.len() as i64, oldest));
            }
        }
        for label in self.0.config.label_names() {
            view.waiting.entry(label.to_string()).or_insert((0, 0));
        }
        view
    }
}

fn gauges(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: impl IntoIterator<Item = (Labels, i64)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in values {
        ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

fn counters(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: impl IntoIterator<Item = (Labels, u64)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in values {
        ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let view = self.pool_view();
        let now = now_ms();
        // Pool-wide: the same on every launcher.
        gauges(
            &mut encoder,
            "backing_nodes",
            "Backing nodes by provider, pool, label and state (pool-wide, from KV).",
            view.backing,
        )?;
        gauges(
            &mut encoder,
            "slots",
            "Slots of backing nodes by label and state: used, free, dirty (could not be cleaned) (pool-wide, from KV).",
            view.slots,
        )?;
        gauges(
            &mut encoder,
            "requests_waiting",
            "Open requests still short of a node of the label (pool-wide, from KV).",
            view.waiting
                .iter()
                .map(|(l, (n, _))| (vec![("label", l.clone())], *n)),
        )?;
        gauges(
            &mut encoder,
            "requests_oldest_waiting_seconds",
            "Age of the oldest request waiting for the label, 0 when none (pool-wide).",
            view.waiting.iter().map(|(l, (n, oldest))| {
                let age = if *n > 0 {
                    now.saturating_sub(*oldest) / 1000
                } else {
                    0
                };
                (vec![("label", l.clone())], age as i64)
            }),
        )?;
        // Per process: what this launcher did; sum across launchers.
        counters(
            &mut encoder,
            "launches",
            "Launch attempts by outcome (this launcher).",
            LaunchOutcome::ALL.map(|o| {
                (
                    vec![("outcome", o.as_str().to_string())],
                    PROCESS.launches[o as usize].load(Relaxed),
                )
            }),
        )?;
        counters(
            &mut encoder,
            "backing_deletions",
            "Backing nodes given back, by reason (this launcher).",
            DeletionReason::ALL.map(|r| {
                (
                    vec![("reason", r.as_str().to_string())],
                    PROCESS.deletions[r as usize].load(Relaxed),
                )
            }),
        )?;
        ConstCounter::new(slotpool_protocol::store::conflicts()).encode(
            encoder.encode_descriptor(
                "kv_conflicts",
                "KV writes refused because the record changed since it was read (this process).",
                None,
                MetricType::Counter,
            )?,
        )?;
        let mut latency = encoder.encode_descriptor(
            "allocation_seconds",
            "Time from a request's submission to its fulfilment (requests this launcher fulfilled).",
            None,
            MetricType::Histogram,
        )?;
        let buckets: Vec<(f64, u64)> = LATENCY_BOUNDS
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(PROCESS.latency_buckets.iter().map(|b| b.load(Relaxed)))
            .collect();
        latency.encode_histogram::<NoLabelSet>(
            PROCESS.latency_sum_ms.load(Relaxed) as f64 / 1000.0,
            PROCESS.latency_count.load(Relaxed),
            &buckets,
            None,
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_latency_lands_in_the_first_bucket_that_holds_it() {
        let before: Vec<u64> = PROCESS
            .latency_buckets
            .iter()
            .map(|b| b.load(Relaxed))
            .collect();
        fulfilled(1_000, 1_300); // 0.3 s: the 0.5 s bucket
        fulfilled(0, 1_000_000); // above every bound
        let after: Vec<u64> = PROCESS
            .latency_buckets
            .iter()
            .map(|b| b.load(Relaxed))
            .collect();
        let grew: Vec<usize> = (0..after.len())
            .filter(|i| after[*i] > before[*i])
            .collect();
        assert_eq!(grew, vec![6, LATENCY_BOUNDS.len()]);
    }
}
