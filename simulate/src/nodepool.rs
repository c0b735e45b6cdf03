//! Nodepool's policy, for the comparison: backing nodes of one fixed size per label (of
//! a label with several sizes, the largest), launched when the waiting jobs want more
//! slots than are free or booting; a job takes the first node with a free slot in
//! creation order; a cleanup pass every
//! `cleanup_interval_ms` releases the nodes that have been empty for the label's grace
//! time. Not the launcher's code: this is the policy slotpool is measured against.

use super::ledger::{Ledger, NodeKind, Report};
use super::rng::Rng;
use super::trace::Job;
use super::{boot_ms, Events, Policy, Setup, SimError, EPOCH_MS};
use slotpool_launcher::provider::CAPACITY_BACKOFF;
use std::collections::{HashMap, HashSet};

enum Event {
    Arrive(usize),
    JobEnd(Vec<u64>),
    /// A launch attempt for node `id`.
    Launch(u64),
    Booted(u64),
    Cleanup,
}

struct Node {
    id: u64,
    label: String,
    kind: NodeKind,
    slots: u32,
    used: u32,
    ready: bool,
    /// Its launch succeeded at this time (paid from then).
    paid_from: Option<u64>,
    idle_since: Option<u64>,
}

pub fn run(jobs: &[Job], setup: &Setup) -> Result<Report, SimError> {
    let mut events = Events::new();
    for (i, j) in jobs.iter().enumerate() {
        events.at(EPOCH_MS + j.arrival_ms, Event::Arrive(i));
    }
    let interval = setup.cleanup_interval_ms.max(1);
    events.at(EPOCH_MS + interval, Event::Cleanup);
    let mut rng = Rng::new(setup.seed);
    let mut ledger = Ledger::default();
    // In creation order.
    let mut nodes: Vec<Node> = Vec::new();
    let mut waiting: Vec<usize> = Vec::new();
    let mut next_id = 0;
    let mut now = EPOCH_MS;
    let site = |label: &str| setup.config.sites(label)[0];
    let until = super::slotpool::run_until(jobs);
    while let Some((at, event)) = events.pop() {
        if at > until {
            break;
        }
        now = at;
        match event {
            Event::Arrive(job) => {
                ledger.arrived(now);
                waiting.push(job);
            }
            Event::JobEnd(ids) => {
                for id in ids {
                    let n = nodes.iter_mut().find(|n| n.id == id).expect("a node");
                    n.used -= 1;
                    if n.used == 0 {
                        n.idle_since = Some(now);
                    }
                }
            }
            Event::Launch(id) => {
                if rng.unit() < setup.provider.capacity_error_rate {
                    events.at(now + CAPACITY_BACKOFF.as_millis() as u64, Event::Launch(id));
                } else {
                    let n = nodes.iter_mut().find(|n| n.id == id).expect("a node");
                    n.paid_from = Some(now);
                    ledger.launched(now, &n.kind);
                    events.at(now + boot_ms(&setup.provider, &mut rng), Event::Booted(id));
                }
            }
            Event::Booted(id) => {
                let n = nodes.iter_mut().find(|n| n.id == id).expect("a node");
                n.ready = true;
                n.idle_since = Some(now);
            }
            Event::Cleanup => {
                nodes.retain(|n| {
                    let grace = site(&n.label).label.grace_time.as_millis() as u64;
                    let idle =
                        n.ready && n.used == 0 && n.idle_since.is_some_and(|t| now >= t + grace);
                    if idle {
                        ledger.released(n.paid_from.expect("ready"), now, &n.kind);
                    }
                    !idle
                });
                if !events.is_empty() || !nodes.is_empty() {
                    events.at(now + interval, Event::Cleanup);
                }
            }
        }
        // First fit by creation order, in queue order; a label a job ahead waits for
        // is not handed to a job behind it.
        let mut blocked: HashSet<&str> = HashSet::new();
        waiting.retain(|&job| {
            let j = &jobs[job];
            if j.labels.iter().any(|l| blocked.contains(l.as_str())) {
                blocked.extend(j.labels.iter().map(String::as_str));
                return true;
            }
            let mut taken: HashMap<u64, u32> = HashMap::new();
            let mut picks = Vec::new();
            for label in &j.labels {
                let found = nodes.iter().find(|n| {
                    n.ready
                        && &n.label == label
                        && n.used + taken.get(&n.id).copied().unwrap_or(0) < n.slots
                });
                match found {
                    Some(n) => {
                        *taken.entry(n.id).or_default() += 1;
                        picks.push(n.id);
                    }
                    None => {
                        blocked.extend(j.labels.iter().map(String::as_str));
                        return true;
                    }
                }
            }
            for id in &picks {
                let n = nodes.iter_mut().find(|n| n.id == *id).expect("a node");
                n.used += 1;
                n.idle_since = None;
            }
            let arrival = EPOCH_MS + j.arrival_ms;
            ledger.served(arrival, now);
            ledger.busy(now, now + j.duration_ms, picks.len());
            events.at(now + j.duration_ms, Event::JobEnd(picks));
            false
        });
        // Launch for what the waiting jobs want beyond the slots free or booting.
        let mut labels: Vec<&str> = waiting
            .iter()
            .flat_map(|&j| jobs[j].labels.iter().map(String::as_str))
            .collect();
        labels.sort_unstable();
        labels.dedup();
        for label in labels {
            let want = waiting
                .iter()
                .flat_map(|&j| &jobs[j].labels)
                .filter(|l| *l == label)
                .count() as i64;
            let of_label = || nodes.iter().filter(|n| n.label == label);
            let have: i64 = of_label().map(|n| (n.slots - n.used) as i64).sum();
            let count = of_label().count() as u32;
            let s = site(label);
            // One fixed size: of a label with several, the largest.
            let size = s.label.largest();
            let kind = NodeKind {
                backing_label: size.backing_label.clone(),
                slots: size.slots,
                cost_per_hour: size
                    .cost_per_hour
                    .unwrap_or(setup.provider.node_cost_per_hour),
            };
            let slots = size.slots;
            let mut deficit = want - have;
            let mut room = s.pool.max_servers.saturating_sub(count);
            while deficit > 0 && room > 0 {
                next_id += 1;
                nodes.push(Node {
                    id: next_id,
                    label: label.to_string(),
                    kind: kind.clone(),
                    slots,
                    used: 0,
                    ready: false,
                    paid_from: None,
                    idle_since: None,
                });
                events.at(now, Event::Launch(next_id));
                deficit -= slots as i64;
                room -= 1;
            }
        }
    }
    ledger.unserved(waiting.len());
    for n in &nodes {
        if let Some(from) = n.paid_from {
            ledger.paid(from, now, &n.kind);
        }
    }
    Ok(ledger.report(Policy::Nodepool))
}
