//! Every metric `/metrics` serves, named and described here and nowhere else.
//!
//! Two kinds, named apart in the README ("Monitoring"):
//! - **pool-wide** gauges, computed at scrape time from this launcher's mirror of KV
//!   ([`crate::world::World`]): every launcher serves the same values;
//! - **per-process** counters and the allocation and boot histograms, for what this
//!   launcher did ([`crate::metrics::PROCESS`]), bumped where it happens, read only
//!   when scraped.

use crate::metrics::{
    pass_age, place, with, DeletionReason, Family, Labels, LaunchOutcome, ProviderCall,
    ProviderErrorKind, PROCESS,
};
use crate::shared::Shared;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use slotpool_protocol::model::BackingState;
use slotpool_protocol::time::{now_ms, UnixMillis};
use std::collections::BTreeMap;
use std::sync::Arc;

/// How long a request must have waited before `slotpool_requests_servable_waiting`
/// counts it: under load a slot is free for a moment before the request behind takes it.
const SERVABLE_AFTER_MS: u64 = 30_000;

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

/// The pool-wide values, read from the mirror under its lock in one pass.
#[derive(Default)]
struct PoolView {
    backing: BTreeMap<Labels, i64>,
    slots: BTreeMap<Labels, i64>,
    waiting: BTreeMap<String, (i64, UnixMillis)>,
    /// Per label: requests waiting over [`SERVABLE_AFTER_MS`] that fit the free slots.
    servable: BTreeMap<String, u32>,
    /// Per provider and pool: seats waiting out a capacity back-off.
    backoff: BTreeMap<Labels, i64>,
    /// Per provider, pool and label: the oldest heartbeat of a ready or retiring
    /// backing node's agent (seconds), and how many such nodes have none.
    heartbeat_age: BTreeMap<Labels, i64>,
    heartbeat_missing: BTreeMap<Labels, i64>,
    /// Open requests by the cause their record names (`queued`: none written yet).
    by_cause: BTreeMap<Labels, i64>,
    /// Per tenant: slots held, its weighted share of the ready slots, its `max-slots`
    /// (those with one), its open requests.
    tenant_slots: BTreeMap<Labels, i64>,
    tenant_share: BTreeMap<Labels, i64>,
    tenant_max: BTreeMap<Labels, i64>,
    tenant_waiting: BTreeMap<Labels, i64>,
}

/// The states a stored backing record can be in (`Gone` never is).
const BACKING_STATES: [BackingState; 6] = [
    BackingState::Requested,
    BackingState::Launching,
    BackingState::Ready,
    BackingState::Retiring,
    BackingState::Releasing,
    BackingState::Failed,
];

fn state_name(state: BackingState) -> String {
    serde_json::to_value(state)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{state:?}").to_lowercase())
}

/// Every (provider, pool, label) of the configuration, as labels.
fn places(config: &crate::config::Config) -> Vec<Labels> {
    let mut out = Vec::new();
    for provider in &config.providers {
        for pool in &provider.pools {
            for label in &pool.labels {
                out.push(vec![
                    ("provider", provider.name.clone()),
                    ("pool", pool.name.clone()),
                    ("label", label.name.clone()),
                ]);
            }
        }
    }
    out
}

impl Collector {
    fn pool_view(&self, now: UnixMillis) -> PoolView {
        let config = &self.0.config;
        let world = self.0.world();
        let mut view = PoolView::default();
        for label in config.label_names() {
            for state in ["used", "free", "dirty"] {
                view.slots.insert(
                    vec![("label", label.to_string()), ("state", state.into())],
                    0,
                );
            }
        }
        for place in places(config) {
            for state in BACKING_STATES {
                view.backing
                    .insert(with(place.clone(), "state", &state_name(state)), 0);
            }
            view.backoff.insert(place[..2].to_vec(), 0);
            view.heartbeat_age.insert(place.clone(), 0);
            view.heartbeat_missing.insert(place, 0);
        }
        for b in world.backing.values() {
            let b = &b.value;
            *view
                .backing
                .entry(with(place(b), "state", &state_name(b.state)))
                .or_default() += 1;
            if b.state == BackingState::Launching && b.instance.is_none() && b.out_of_capacity {
                *view.backoff.entry(place(b)[..2].to_vec()).or_default() += 1;
            }
            if matches!(b.state, BackingState::Ready | BackingState::Retiring) {
                let written = world.heartbeat_written.get(b.id.as_str());
                match (world.agents.contains_key(&b.id), written) {
                    (false, _) => *view.heartbeat_missing.entry(place(b)).or_default() += 1,
                    (true, Some((_, at))) => {
                        let age = (now.saturating_sub(*at) / 1000) as i64;
                        let max = view.heartbeat_age.entry(place(b)).or_default();
                        *max = (*max).max(age);
                    }
                    // Read from KV directly, not through the watch: its write time is
                    // not known yet (the watch brings it).
                    (true, None) => {}
                }
            }
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
        view.by_cause
            .insert(vec![("cause", "queued".to_string())], 0);
        for cause in slotpool_protocol::model::WaitCause::ALL {
            view.by_cause
                .insert(vec![("cause", cause.name().to_string())], 0);
        }
        for id in &world.open_requests {
            let cause = world
                .requests
                .get(id)
                .and_then(|r| r.value.waiting.as_ref())
                .map_or("queued", |w| w.cause.name());
            *view
                .by_cause
                .entry(vec![("cause", cause.to_string())])
                .or_default() += 1;
        }
        let ready_slots: i64 = world
            .backing
            .values()
            .filter(|b| b.value.state == BackingState::Ready)
            .map(|b| i64::from(b.value.slots))
            .sum();
        let tenants = world.tenants();
        let loads: Vec<(u32, u32)> = (0..tenants.len()).map(|i| world.tenant_load(i)).collect();
        let shares = tenants.shares(ready_slots.max(0) as u64, &loads);
        for ((t, (held, open)), share) in tenants.iter().zip(&loads).zip(shares) {
            let name = vec![("tenant", t.name.clone())];
            let share = share as i64;
            view.tenant_slots.insert(name.clone(), i64::from(*held));
            view.tenant_share.insert(name.clone(), share);
            view.tenant_waiting.insert(name.clone(), i64::from(*open));
            if let Some(max) = t.max_slots {
                view.tenant_max.insert(name, i64::from(max));
            }
        }
        let queue = world.queue();
        for label in queue.labels() {
            if let Some(oldest) = queue
                .of_label(label)
                .map(|((_, created, _), _)| *created)
                .min()
            {
                view.waiting
                    .insert(label.to_string(), (queue.len(label) as i64, oldest));
            }
        }
        for label in config.label_names() {
            view.waiting.entry(label.to_string()).or_insert((0, 0));
            view.servable.insert(
                label.to_string(),
                world.servable_waiting(label, now, SERVABLE_AFTER_MS),
            );
        }
        view
    }

    /// This process's labelled counters, with a zero for every combination the
    /// configuration names (so a rate over them exists before the first event).
    fn process_counts(&self) -> BTreeMap<(Family, Labels), u64> {
        let config = &self.0.config;
        let mut counts = BTreeMap::new();
        for place in places(config) {
            for o in LaunchOutcome::ALL {
                counts.insert(
                    (Family::Launches, with(place.clone(), "outcome", o.as_str())),
                    0,
                );
            }
            for r in DeletionReason::ALL {
                if r != DeletionReason::Leak {
                    counts.insert(
                        (Family::Deletions, with(place.clone(), "reason", r.as_str())),
                        0,
                    );
                }
            }
        }
        for provider in &config.providers {
            for call in ProviderCall::ALL {
                for kind in ProviderErrorKind::ALL {
                    let labels = vec![
                        ("provider", provider.name.clone()),
                        ("call", call.as_str().to_string()),
                        ("kind", kind.as_str().to_string()),
                    ];
                    counts.insert((Family::ProviderErrors, labels), 0);
                }
            }
        }
        counts.extend(PROCESS.counts());
        counts
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

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: i64,
) -> Result<(), std::fmt::Error> {
    ConstGauge::new(value).encode(encoder.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    ConstCounter::new(value).encode(encoder.encode_descriptor(
        name,
        help,
        None,
        MetricType::Counter,
    )?)
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let now = now_ms();
        let view = self.pool_view(now);
        // Pool-wide: the same on every launcher ("pool-wide" in each help text).
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
            "Age of the oldest request waiting for the label, 0 when none (pool-wide, from KV).",
            view.waiting.iter().map(|(l, (n, oldest))| {
                let age = if *n > 0 {
                    now.saturating_sub(*oldest) / 1000
                } else {
                    0
                };
                (vec![("label", l.clone())], age as i64)
            }),
        )?;
        gauges(
            &mut encoder,
            "capacity_backoff_seats",
            "Seats whose last launch the provider refused for capacity, waiting out the back-off, by provider and pool (pool-wide, from KV).",
            view.backoff,
        )?;
        gauges(
            &mut encoder,
            "agent_heartbeat_age_max_seconds",
            "Age of the oldest last heartbeat among the agents of ready or retiring backing nodes, by provider, pool and label (pool-wide, from KV).",
            view.heartbeat_age,
        )?;
        gauges(
            &mut encoder,
            "agent_heartbeats_missing",
            "Ready or retiring backing nodes with no live heartbeat of their agent, by provider, pool and label (pool-wide, from KV).",
            view.heartbeat_missing,
        )?;
        // Per process: what this launcher did ("this launcher" in each help text); sum
        // across launchers.
        let counts = self.process_counts();
        let family = |f: Family| {
            counts
                .iter()
                .filter(move |((family, _), _)| *family == f)
                .map(|((_, labels), n)| (labels.clone(), *n))
        };
        counters(
            &mut encoder,
            "launches",
            "Launch attempts by provider, pool, label and outcome (this launcher).",
            family(Family::Launches),
        )?;
        counters(
            &mut encoder,
            "backing_deletions",
            "Backing nodes given back or failed, by provider, pool, label and reason (this launcher).",
            family(Family::Deletions),
        )?;
        counters(
            &mut encoder,
            "provider_errors",
            "Failed provider calls by provider, call and kind (this launcher).",
            family(Family::ProviderErrors),
        )?;
        counter(
            &mut encoder,
            "kv_conflicts",
            "KV writes refused because the record changed since it was read (this launcher).",
            slotpool_protocol::store::conflicts(),
        )?;
        counter(
            &mut encoder,
            "kv_retries",
            "KV writes sent again while no server took them, or read back after a timeout (this launcher).",
            slotpool_protocol::store::retries(),
        )?;
        counter(
            &mut encoder,
            "lease_takeovers",
            "Requests this launcher took over because their owner's liveness lease had lapsed (this launcher).",
            PROCESS.lease_takeovers(),
        )?;
        counter(
            &mut encoder,
            "request_worker_spins",
            "Times a request worker stepped its bound without waiting and was paused: a scheduling bug, never expected (this launcher).",
            PROCESS.worker_spins(),
        )?;
        PROCESS.allocation.encode(
            &mut encoder,
            "allocation_seconds",
            "Time from a request's submission to its fulfilment (requests this launcher fulfilled).",
        )?;
        PROCESS.pass.encode(
            &mut encoder,
            "launcher_pass_seconds",
            "How long each pass of this launcher's supervisor took: the work the changes and the resync hand it (this launcher).",
        )?;
        gauge(
            &mut encoder,
            "launcher_pass_age_seconds",
            "Seconds since this launcher's supervisor last finished a pass; it passes at least every resync (15 s), so a growing age is a stalled launcher (this launcher).",
            pass_age(now, self.0.started_at).as_secs() as i64,
        )?;
        gauges(
            &mut encoder,
            "requests_servable_waiting",
            "Requests waiting over 30 s that the free slots could serve now in the queue's order: one that stays means no launcher acts on it (pool-wide, from KV).",
            view.servable
                .iter()
                .map(|(l, n)| (vec![("label", l.clone())], i64::from(*n))),
        )?;
        gauges(
            &mut encoder,
            "requests_waiting_by_cause",
            "Open requests by the cause their record says holds them (queued: waiting under 250 ms, none written yet) (pool-wide, from KV).",
            view.by_cause,
        )?;
        gauges(
            &mut encoder,
            "tenant_slots",
            "Slots the tenant's nodes hold (pool-wide, from KV).",
            view.tenant_slots,
        )?;
        gauges(
            &mut encoder,
            "tenant_share_slots",
            "The tenant's weighted share of the ready backing nodes' slots among the tenants holding or waiting (0 for one that does neither) (pool-wide, from KV).",
            view.tenant_share,
        )?;
        gauges(
            &mut encoder,
            "tenant_max_slots",
            "The tenant's max-slots, for the tenants with one (configuration).",
            view.tenant_max,
        )?;
        gauges(
            &mut encoder,
            "tenant_requests_waiting",
            "The tenant's open requests (pool-wide, from KV).",
            view.tenant_waiting,
        )?;
        crate::metrics::encode_tenant_waits(
            &mut encoder,
            self.0.config.tenants.iter().map(|t| t.name.as_str()),
        )?;
        PROCESS.boot.encode(
            &mut encoder,
            "boot_seconds",
            "Time from a backing node's launch to its agent's first heartbeat (backing nodes this launcher marked ready).",
        )?;
        Ok(())
    }
}
