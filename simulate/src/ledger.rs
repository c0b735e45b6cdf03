//! What a run costs and how long jobs waited: slot-seconds paid (a backing node's slots
//! from its launch to its release) and busy (a job's nodes while it runs), in time bins,
//! and each job's wait from arrival to its nodes.

use super::{Policy, EPOCH_MS};
use serde::Serialize;
use std::collections::BTreeMap;

/// Width of the time bins the plot draws.
pub const BIN_MS: u64 = 300_000;
const HOUR_MS: u64 = 3_600_000;

#[derive(Debug, Default)]
pub struct Ledger {
    /// Slot-milliseconds paid and busy per bin.
    paid: Vec<f64>,
    busy: Vec<f64>,
    /// Money paid in all.
    cost: f64,
    /// By backing label: launches, slot-milliseconds and money paid.
    by_size: BTreeMap<String, SizeReport>,
    launched: Vec<u32>,
    /// Backing nodes released (deleted) before the run ended.
    released: u32,
    /// (arrival, wait) of each served job, in milliseconds from the start.
    waits: Vec<(u64, u64)>,
    arrivals: Vec<u64>,
    unserved: usize,
    /// Each served job's tenant, from arrival to end: for the report by tenant.
    spans: Vec<TenantSpan>,
}

/// A served job of a tenant: when it arrived, started and ended (ms from the start of
/// simulated time), and the slots it held.
#[derive(Clone, Debug)]
struct TenantSpan {
    tenant: String,
    weight: u32,
    arrival: u64,
    start: u64,
    end: u64,
    slots: usize,
}

/// Width of the windows Jain's fairness index is taken over.
pub const FAIRNESS_WINDOW_MS: u64 = 60_000;

fn spread(bins: &mut Vec<f64>, from: u64, to: u64, weight: f64) {
    let (from, to) = (from - EPOCH_MS, to - EPOCH_MS);
    let mut t = from;
    while t < to {
        let bin = (t / BIN_MS) as usize;
        let end = ((bin as u64 + 1) * BIN_MS).min(to);
        if bins.len() <= bin {
            bins.resize(bin + 1, 0.0);
        }
        bins[bin] += (end - t) as f64 * weight;
        t = end;
    }
}

/// What kind of backing node a launch or a payment is for.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeKind {
    pub backing_label: String,
    pub slots: u32,
    /// What one costs an hour.
    pub cost_per_hour: f64,
}

impl Ledger {
    /// A backing node of `kind` was paid for from `from` to `to`.
    pub fn paid(&mut self, from: u64, to: u64, kind: &NodeKind) {
        spread(&mut self.paid, from, to, kind.slots as f64);
        let hours = to.saturating_sub(from) as f64 / HOUR_MS as f64;
        self.cost += hours * kind.cost_per_hour;
        let size = self.size(kind);
        size.paid_slot_hours += hours * kind.slots as f64;
        size.cost += hours * kind.cost_per_hour;
    }

    fn size(&mut self, kind: &NodeKind) -> &mut SizeReport {
        self.by_size
            .entry(kind.backing_label.clone())
            .or_insert_with(|| SizeReport {
                backing_label: kind.backing_label.clone(),
                slots: kind.slots,
                cost_per_hour: kind.cost_per_hour,
                launched: 0,
                paid_slot_hours: 0.0,
                cost: 0.0,
            })
    }

    /// A backing node of `kind`, paid for from `from`, was released at `at`.
    pub fn released(&mut self, from: u64, at: u64, kind: &NodeKind) {
        self.paid(from, at, kind);
        self.released += 1;
    }

    /// `nodes` slots were busy from `from` to `to`.
    pub fn busy(&mut self, from: u64, to: u64, nodes: usize) {
        spread(&mut self.busy, from, to, nodes as f64);
    }

    pub fn launched(&mut self, at: u64, kind: &NodeKind) {
        self.size(kind).launched += 1;
        let hour = ((at - EPOCH_MS) / HOUR_MS) as usize;
        if self.launched.len() <= hour {
            self.launched.resize(hour + 1, 0);
        }
        self.launched[hour] += 1;
    }

    pub fn arrived(&mut self, at: u64) {
        self.arrivals.push(at - EPOCH_MS);
    }

    pub fn served(&mut self, arrival: u64, at: u64) {
        self.waits.push((arrival - EPOCH_MS, at - arrival));
    }

    /// A job of tenant `tenant` (weight `weight`) that arrived at `arrival` held `slots`
    /// slots from `start` to `end`.
    pub fn tenant_job(
        &mut self,
        tenant: &str,
        weight: u32,
        arrival: u64,
        start: u64,
        end: u64,
        slots: usize,
    ) {
        self.spans.push(TenantSpan {
            tenant: tenant.to_string(),
            weight,
            arrival: arrival - EPOCH_MS,
            start: start - EPOCH_MS,
            end: end - EPOCH_MS,
            slots,
        });
    }

    /// Each tenant's jobs and waits, and Jain's index over the contended windows.
    fn fairness(&self) -> Fairness {
        let mut by_tenant: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
        for s in &self.spans {
            by_tenant
                .entry(&s.tenant)
                .or_default()
                .push(s.start - s.arrival);
        }
        let tenants = by_tenant
            .into_iter()
            .map(|(name, mut waits)| {
                waits.sort_unstable();
                TenantReport {
                    tenant: name.to_string(),
                    jobs: waits.len(),
                    wait_p50_secs: quantile(&waits, 0.5),
                    wait_p95_secs: quantile(&waits, 0.95),
                }
            })
            .collect::<Vec<_>>();
        let end = self.spans.iter().map(|s| s.end).max().unwrap_or(0);
        let mut indices = Vec::new();
        let mut from = 0;
        while tenants.len() > 1 && from < end {
            let to = from + FAIRNESS_WINDOW_MS;
            let overlap = |a: u64, b: u64| b.min(to).saturating_sub(a.max(from));
            // Contended: some job waited in the window.
            if self.spans.iter().any(|s| overlap(s.arrival, s.start) > 0) {
                let mut x: BTreeMap<&str, f64> = BTreeMap::new();
                for s in self.spans.iter().filter(|s| overlap(s.arrival, s.end) > 0) {
                    *x.entry(&s.tenant).or_default() +=
                        (overlap(s.start, s.end) as f64 * s.slots as f64) / f64::from(s.weight);
                }
                let (sum, squares) = x.values().fold((0.0, 0.0), |(a, b), v| (a + v, b + v * v));
                if x.len() > 1 && squares > 0.0 {
                    indices.push(sum * sum / (x.len() as f64 * squares));
                }
            }
            from = to;
        }
        Fairness {
            jain_mean: (!indices.is_empty())
                .then(|| indices.iter().sum::<f64>() / indices.len() as f64),
            jain_min: indices.iter().copied().reduce(f64::min),
            contended_windows: indices.len(),
            tenants: if tenants.len() > 1 {
                tenants
            } else {
                Vec::new()
            },
        }
    }

    pub fn unserved(&mut self, n: usize) {
        self.unserved += n;
    }

    pub fn report(&self, policy: Policy) -> Report {
        let hours = |v: &[f64]| v.iter().sum::<f64>() / HOUR_MS as f64;
        let (paid, busy) = (hours(&self.paid), hours(&self.busy));
        let mut waits: Vec<u64> = self.waits.iter().map(|w| w.1).collect();
        waits.sort_unstable();
        let bins_per_hour = (HOUR_MS / BIN_MS) as usize;
        let n_hours = self
            .paid
            .len()
            .max(self.busy.len())
            .div_ceil(bins_per_hour)
            .max(self.launched.len());
        let table = (0..n_hours)
            .map(|h| {
                let slice = |v: &[f64]| {
                    v.iter()
                        .skip(h * bins_per_hour)
                        .take(bins_per_hour)
                        .sum::<f64>()
                        / HOUR_MS as f64
                };
                let (paid, busy) = (slice(&self.paid), slice(&self.busy));
                let in_hour = |t: u64| (t / HOUR_MS) as usize == h;
                let mut w: Vec<u64> = self
                    .waits
                    .iter()
                    .filter(|(a, _)| in_hour(*a))
                    .map(|w| w.1)
                    .collect();
                w.sort_unstable();
                HourRow {
                    hour: h as u32,
                    jobs: self.arrivals.iter().filter(|a| in_hour(**a)).count(),
                    paid_slot_hours: paid,
                    busy_slot_hours: busy,
                    efficiency: ratio(busy, paid),
                    wait_p99_secs: quantile(&w, 0.99),
                    launched: self.launched.get(h).copied().unwrap_or(0),
                }
            })
            .collect();
        Report {
            fairness: self.fairness(),
            policy,
            jobs: self.arrivals.len(),
            unserved: self.unserved,
            paid_slot_hours: paid,
            busy_slot_hours: busy,
            efficiency: ratio(busy, paid),
            cost: self.cost,
            sizes: {
                let mut sizes: Vec<SizeReport> = self.by_size.values().cloned().collect();
                sizes.sort_by(|a, b| (a.slots, &a.backing_label).cmp(&(b.slots, &b.backing_label)));
                sizes
            },
            backing_nodes_launched: self.launched.iter().sum(),
            backing_nodes_released: self.released,
            wait_p50_secs: quantile(&waits, 0.5),
            wait_p99_secs: quantile(&waits, 0.99),
            wait_max_secs: waits.last().map_or(0.0, |w| *w as f64 / 1000.0),
            hours: table,
            series: Series {
                bin_secs: BIN_MS / 1000,
                paid_slots: self.paid.iter().map(|s| s / BIN_MS as f64).collect(),
                busy_slots: self.busy.iter().map(|s| s / BIN_MS as f64).collect(),
                waits_secs: waits.iter().map(|w| *w as f64 / 1000.0).collect(),
            },
        }
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// The `q` quantile of sorted milliseconds, in seconds (nearest rank).
fn quantile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1000.0
}

/// What a run cost and how long its jobs waited.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    pub policy: Policy,
    pub jobs: usize,
    /// Jobs still waiting when the run ended.
    pub unserved: usize,
    pub paid_slot_hours: f64,
    pub busy_slot_hours: f64,
    /// Busy ÷ paid.
    pub efficiency: f64,
    /// Backing node hours × each node's cost per hour (its size's `cost-per-hour`, or
    /// the simulated provider's price of a node without one).
    pub cost: f64,
    /// What each size (backing label) was launched and paid, smallest first.
    pub sizes: Vec<SizeReport>,
    pub backing_nodes_launched: u32,
    /// Of those, released before the run ended (the rest were still paid for then).
    pub backing_nodes_released: u32,
    pub wait_p50_secs: f64,
    pub wait_p99_secs: f64,
    pub wait_max_secs: f64,
    pub hours: Vec<HourRow>,
    /// By tenant, when the trace names more than one.
    pub fairness: Fairness,
    /// For the plot; not in the JSON.
    #[serde(skip)]
    pub series: Series,
}

/// One size's share of a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SizeReport {
    pub backing_label: String,
    pub slots: u32,
    pub cost_per_hour: f64,
    pub launched: u32,
    pub paid_slot_hours: f64,
    pub cost: f64,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series {
    pub bin_secs: u64,
    /// Mean slots paid and busy in each bin.
    pub paid_slots: Vec<f64>,
    pub busy_slots: Vec<f64>,
    /// Every served job's wait, sorted.
    pub waits_secs: Vec<f64>,
}

/// How the tenants of a trace fared: each one's waits, and Jain's fairness index of
/// their weighted slot-time over the one-minute windows in which some job waited (1:
/// every tenant active in the window got the same slot-time per weight; 1/n: one got
/// all).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Fairness {
    pub tenants: Vec<TenantReport>,
    pub jain_mean: Option<f64>,
    pub jain_min: Option<f64>,
    pub contended_windows: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TenantReport {
    pub tenant: String,
    pub jobs: usize,
    pub wait_p50_secs: f64,
    pub wait_p95_secs: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HourRow {
    pub hour: u32,
    /// Jobs that arrived in the hour.
    pub jobs: usize,
    pub paid_slot_hours: f64,
    pub busy_slot_hours: f64,
    pub efficiency: f64,
    /// Of the jobs that arrived in the hour.
    pub wait_p99_secs: f64,
    pub launched: u32,
}
