//! The launcher's own policy: requests decided by `request::plan::next`, seats and their
//! sizes by `planner::choose_seats`, backing nodes by `lifecycle::next`, free slots handed
//! out smallest node first, then fullest (`capacity::packing_rank`), through the
//! launcher's `CapacityIndex`. This module only carries
//! the steps out on records it keeps, as the executors do on KV.

use super::ledger::{Ledger, Report};
use super::rng::Rng;
use super::trace::Job;
use super::{boot_ms, kind_of, Events, Policy, Setup, SimError, EPOCH_MS};
use slotpool_config::warm::{self, Arrivals};
use slotpool_launcher::backing::lifecycle::{self, AgentSeen, Step};
use slotpool_launcher::backing::planner::{self, Choice, SiteSeats, SizeOffer};
use slotpool_launcher::request::plan::{self, NodeSeen, RequestStep, WaitCause};
use slotpool_launcher::world::capacity::{self, CapacityIndex, Standing};
use slotpool_launcher::world::queue::{Queue, Share};
use slotpool_launcher::world::SlotRef;
use slotpool_protocol::layout;
use slotpool_protocol::model::{
    BackingNode, BackingState, IdleBehaviour, Instance, NodeRequest, NodeState, RequestState,
};
use slotpool_protocol::store::Versioned;
use slotpool_protocol::{LauncherId, NodeId, RequestId};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

/// How often a decision may loop on one record without waiting before the run stops as
/// a bug rather than spinning.
const MAX_STEPS: usize = 64;

enum Event {
    Arrive(usize),
    /// A job ends and gives back its slots (of its tenant, by label).
    JobEnd {
        slots: Vec<SlotRef>,
        tenant: usize,
        labels: Vec<String>,
    },
    /// The agent of the node at a seat heartbeats for the first time (for launch
    /// attempt `attempt`).
    Booted {
        seat: String,
        attempt: u32,
    },
    /// A time a backing node's decision asked to be looked at again.
    Look(String),
}

struct Node {
    record: Versioned<BackingNode>,
    used: BTreeSet<u32>,
    booted: bool,
    last_release: Option<u64>,
    /// When its current launch succeeded (its paid time starts).
    paid_from: Option<u64>,
    /// The time a `Look` is queued for.
    look_at: Option<u64>,
}

struct Waiting {
    job: usize,
    /// Its tenant in the configuration (by the job's tenant name; the default tenant
    /// when the configuration does not name it).
    tenant: usize,
    record: NodeRequest,
    nodes: Vec<NodeSeen>,
    slots: BTreeMap<String, SlotRef>,
}

struct Sim<'a> {
    jobs: &'a [Job],
    setup: &'a Setup,
    now: u64,
    events: Events<Event>,
    nodes: BTreeMap<String, Node>,
    capacity: CapacityIndex,
    waiting: Vec<Waiting>,
    rng: Rng,
    ledger: Ledger,
    me: LauncherId,
    labels: Vec<String>,
    /// The requests that have arrived, for the predictive warm slots, counted as the
    /// launcher counts them.
    arrivals: Arrivals,
    /// Slots held by running jobs, by (tenant, label) and by tenant: the shares the
    /// queue's order weighs.
    held: HashMap<(usize, String), u32>,
    held_total: HashMap<usize, u32>,
}

pub fn run(jobs: &[Job], setup: &Setup) -> Result<Report, SimError> {
    let mut labels: Vec<String> = jobs.iter().flat_map(|j| j.labels.clone()).collect();
    labels.sort();
    labels.dedup();
    let mut sim = Sim {
        jobs,
        setup,
        now: EPOCH_MS,
        events: Events::new(),
        nodes: BTreeMap::new(),
        capacity: CapacityIndex::default(),
        waiting: Vec::new(),
        rng: Rng::new(setup.seed),
        ledger: Ledger::default(),
        me: LauncherId::parse("launcher-sim").expect("a valid id"),
        labels,
        arrivals: Arrivals::of(&setup.config),
        held: HashMap::new(),
        held_total: HashMap::new(),
    };
    for (i, j) in jobs.iter().enumerate() {
        sim.events.at(EPOCH_MS + j.arrival_ms, Event::Arrive(i));
    }
    let until = run_until(jobs);
    // Slots kept ready (min-ready) are launched before the first job.
    sim.plan()?;
    while let Some((at, event)) = sim.events.pop() {
        if at > until {
            break;
        }
        sim.now = at;
        sim.handle(event)?;
        sim.serve()?;
        sim.plan()?;
    }
    sim.ledger.unserved(sim.waiting.len());
    for n in sim.nodes.values() {
        if let Some(from) = n.paid_from {
            sim.ledger
                .paid(from, sim.now, &kind_of(setup, &n.record.value));
        }
    }
    Ok(sim.ledger.report(Policy::Slotpool))
}

/// When a run stops even if something is still going on (a policy that never serves a
/// job): a day after the last job would have ended had it started on arrival.
pub(crate) fn run_until(jobs: &[Job]) -> u64 {
    let last = jobs
        .iter()
        .map(|j| j.arrival_ms + j.duration_ms)
        .max()
        .unwrap_or(0);
    EPOCH_MS + last + 86_400_000
}

impl Sim<'_> {
    /// Free slots of `label` to keep ready now ([`warm::ready_target`]), from the
    /// requests that have arrived, as the launcher counts them.
    fn ready_target(&self, label: &str) -> u32 {
        warm::ready_from(&self.setup.config, label, &self.arrivals, self.now)
    }

    /// Requests waiting for a node of `label` they have not got yet (the launcher's
    /// queue of the label).
    fn queued(&self, label: &str) -> u32 {
        self.waiting
            .iter()
            .filter(|w| {
                w.record.labels.iter().enumerate().any(|(index, l)| {
                    l == label && !w.nodes.iter().any(|n| n.index == index as u32)
                })
            })
            .count() as u32
    }

    fn handle(&mut self, event: Event) -> Result<(), SimError> {
        match event {
            Event::Arrive(job) => {
                self.ledger.arrived(self.now);
                self.arrivals.note(
                    &format!("req-{job}"),
                    None,
                    &self.jobs[job].labels,
                    self.now,
                );
                let record = NodeRequest {
                    v: slotpool_protocol::PROTOCOL_VERSION,
                    id: RequestId::parse(&format!("req-{job}")).expect("a valid id"),
                    labels: self.jobs[job].labels.clone(),
                    requestor: "simulate".into(),
                    priority: 100,
                    timeout_secs: None,
                    ssh_public_key: None,
                    created_at: self.now,
                    state: RequestState::Requested,
                    status: "queued".into(),
                    nodes: Vec::new(),
                    failure: None,
                    updated_at: self.now,
                    owner: Some(self.me.clone()),
                    client: None,
                    nodes_released_at: None,
                    keep_alive_secs: None,
                    alive_until: None,
                    fulfilled_at: None,
                    hold_until: None,
                    nodes_failed: Vec::new(),
                    waiting: None,
                };
                let tenants = &self.setup.config.tenants;
                let tenant = self.jobs[job]
                    .tenant
                    .as_deref()
                    .and_then(|name| tenants.named(name))
                    .unwrap_or(tenants.len() - 1);
                self.waiting.push(Waiting {
                    job,
                    tenant,
                    record,
                    nodes: Vec::new(),
                    slots: BTreeMap::new(),
                });
            }
            Event::JobEnd {
                slots,
                tenant,
                labels,
            } => {
                self.hold(tenant, &labels, false);
                for slot in slots {
                    self.give_back(&slot);
                }
            }
            Event::Booted { seat, attempt } => {
                if let Some(n) = self.nodes.get_mut(&seat) {
                    if n.record.value.attempts == attempt && n.record.value.instance.is_some() {
                        n.booted = true;
                        self.step_node(&seat)?;
                    }
                }
            }
            Event::Look(seat) => {
                if let Some(n) = self.nodes.get_mut(&seat) {
                    if n.look_at == Some(self.now) {
                        n.look_at = None;
                    }
                }
                self.step_node(&seat)?;
            }
        }
        Ok(())
    }

    fn give_back(&mut self, slot: &SlotRef) {
        if let Some(n) = self.nodes.get_mut(&slot.seat_key) {
            n.used.remove(&slot.slot);
            n.last_release = Some(self.now);
        }
        self.restand(&slot.seat_key);
        // A node whose decision changes with its use is looked at now.
        self.look_now(&slot.seat_key);
        self.look_at_warm(&slot.seat_key);
    }

    /// When the label of the node at `seat` keeps slots ready, looks at its other empty
    /// nodes: one kept for min-ready may go now (as the launcher's supervisor does).
    fn look_at_warm(&mut self, seat: &str) {
        let Some(label) = self.nodes.get(seat).map(|n| n.record.value.label.clone()) else {
            return;
        };
        if self.setup.config.min_ready(&label) == 0 && self.setup.config.warm(&label).is_none() {
            return;
        }
        let empty: Vec<String> = self
            .nodes
            .iter()
            .filter(|(key, n)| {
                key.as_str() != seat
                    && n.record.value.label == label
                    && n.record.value.state == BackingState::Ready
                    && n.used.is_empty()
            })
            .map(|(key, _)| key.clone())
            .collect();
        for key in empty {
            self.look_now(&key);
        }
    }

    fn look_now(&mut self, seat: &str) {
        self.events.at(self.now, Event::Look(seat.to_string()));
    }

    /// Brings the capacity index up to date for `seat`, as the launcher's `World` does.
    fn restand(&mut self, seat: &str) {
        let standing = self.nodes.get(seat).map(|n| {
            let b = &n.record.value;
            let used = n.used.len() as u32;
            // A release is one step here: no slot is ever seen being released.
            let serving = (b.state.takes_slots() && b.idle == IdleBehaviour::Run && n.booted)
                .then_some(capacity::Use {
                    used,
                    held: used,
                    open: used < b.slots,
                });
            Standing {
                label: b.label.clone(),
                // One view here, which sees each heartbeat as it comes.
                offer: capacity::offer(b, serving, false),
            }
        });
        self.capacity.set(seat, standing);
    }

    /// A free slot of `label`, in packing order, other than those in `avoid`.
    fn pick(&self, label: &str, avoid: &HashSet<String>) -> Option<SlotRef> {
        self.capacity.open_seats(label).find_map(|seat| {
            let n = self.nodes.get(seat)?;
            let b = &n.record.value;
            // A node that handed out max-uses slots refuses the claim (`SlotError::UsedUp`).
            if self.max_uses(b).is_some_and(|max| b.uses >= max) {
                return None;
            }
            let slot = (0..b.slots)
                .find(|s| !n.used.contains(s) && !avoid.contains(&layout::slot_key(&b.id, *s)))?;
            Some(SlotRef {
                backing_id: b.id.clone(),
                seat_key: seat.to_string(),
                slot,
            })
        })
    }

    /// The `max-uses` of `b`'s label, if it sets one.
    fn max_uses(&self, b: &BackingNode) -> Option<u32> {
        let site = self.setup.config.label_in(&b.provider, &b.pool, &b.label)?;
        site.label.max_uses
    }

    /// Why each label without a free slot waits, as `request::observe` says it.
    fn causes(&self) -> BTreeMap<String, WaitCause> {
        let mut causes = BTreeMap::new();
        for n in self.nodes.values() {
            let b = &n.record.value;
            if matches!(b.state, BackingState::Requested | BackingState::Launching) {
                let cause = if b.out_of_capacity {
                    WaitCause::OutOfCapacity {
                        provider: b.provider.clone(),
                        backing_label: b.backing_label.clone(),
                        failure: b.failure.clone(),
                        backoff: slotpool_launcher::provider::CAPACITY_BACKOFF,
                    }
                } else {
                    WaitCause::Booting {
                        backing_label: b.backing_label.clone(),
                    }
                };
                causes.entry(b.label.clone()).or_insert(cause);
            }
        }
        causes
    }

    /// Counts the slots of a job of `tenant` for `labels` as held (or no more).
    fn hold(&mut self, tenant: usize, labels: &[String], held: bool) {
        for label in labels {
            for count in [
                self.held.entry((tenant, label.clone())).or_default(),
                self.held_total.entry(tenant).or_default(),
            ] {
                if held {
                    *count += 1;
                } else {
                    *count = count.saturating_sub(1);
                }
            }
        }
    }

    /// Puts the waiting requests in the launcher's serving order
    /// ([`slotpool_launcher::world::queue::Queue::order`]): with several tenants, each
    /// label's free slots go to the tenant furthest below its weighted share, priority
    /// and age within a tenant; a request takes the earliest place any of its labels
    /// gives it. Requests of a tenant at its `max-slots` are left out (`capped`): they
    /// wait. With one tenant the order is arrival order, as it is kept.
    fn order_waiting(&mut self) -> HashSet<RequestId> {
        let tenants = &self.setup.config.tenants;
        if tenants.is_single() || self.waiting.len() < 2 {
            return HashSet::new();
        }
        let mut queue = Queue::default();
        for w in &self.waiting {
            let mut needs: BTreeMap<String, u32> = BTreeMap::new();
            for (index, label) in w.record.labels.iter().enumerate() {
                if !w.nodes.iter().any(|n| n.index == index as u32) {
                    *needs.entry(label.clone()).or_default() += 1;
                }
            }
            queue.put(
                &w.record.id,
                (w.record.priority, w.record.created_at, w.record.id.clone()),
                Some(self.me.clone()),
                w.record.labels.len() > 1,
                w.tenant,
                needs.into_iter().collect(),
            );
        }
        let mut rank: HashMap<RequestId, usize> = HashMap::new();
        let mut capped: HashSet<RequestId> = HashSet::new();
        for label in &self.labels {
            let shares: Vec<Share> = tenants
                .iter()
                .enumerate()
                .map(|(i, t)| Share {
                    weight: t.weight,
                    guaranteed: t.guaranteed(label),
                    held: self.held.get(&(i, label.clone())).copied().unwrap_or(0),
                    guaranteed_total: t.guaranteed_slots,
                    held_total: self.held_total.get(&i).copied().unwrap_or(0),
                    room: t.max_slots.map(|max| {
                        max.saturating_sub(self.held_total.get(&i).copied().unwrap_or(0))
                    }),
                })
                .collect();
            for (place, served) in queue.order(label, &shares, None, |_, _| true).enumerate() {
                let id = &served.pos.2;
                let best = rank.entry(id.clone()).or_insert(place);
                *best = (*best).min(place);
                if served.capped {
                    capped.insert(id.clone());
                }
            }
        }
        self.waiting
            .sort_by_key(|w| rank.get(&w.record.id).copied().unwrap_or(usize::MAX));
        capped
    }

    /// Every waiting request, in queue order, takes the steps its decision says; a label
    /// a request ahead waits for is not handed to a request behind it.
    fn serve(&mut self) -> Result<(), SimError> {
        let capped = self.order_waiting();
        let causes = self.causes();
        let mut blocked: HashSet<String> = HashSet::new();
        let mut touched = BTreeSet::new();
        let mut i = 0;
        while i < self.waiting.len() {
            if capped.contains(&self.waiting[i].record.id) {
                i += 1;
                continue;
            }
            let mut reserved = BTreeMap::new();
            let mut avoid = HashSet::new();
            let w = &self.waiting[i];
            for (index, label) in w.record.labels.iter().enumerate() {
                let index = index as u32;
                if blocked.contains(label) || w.nodes.iter().any(|n| n.index == index) {
                    continue;
                }
                if let Some(slot) = self.pick(label, &avoid) {
                    avoid.insert(slot.key());
                    reserved.insert(index, slot);
                }
            }
            let mut done = false;
            for _ in 0..MAX_STEPS {
                let w = &self.waiting[i];
                let obs = plan::Observed {
                    me: self.me.clone(),
                    nodes: w.nodes.clone(),
                    reserved: reserved.clone(),
                    unknown: None,
                    causes: causes.clone(),
                    launch_failures: BTreeMap::new(),
                    refused_at: None,
                    waiting_since: Some(w.record.created_at),
                    max_hold: None,
                };
                match plan::next(&w.record, &obs, self.now) {
                    RequestStep::Claim { slots, .. } => {
                        for (index, slot) in slots {
                            reserved.remove(&index);
                            // Counted before the claim, only for a label with max-uses, as
                            // `nodes::count_use` does.
                            let counts = self
                                .nodes
                                .get(&slot.seat_key)
                                .is_some_and(|n| self.max_uses(&n.record.value).is_some());
                            let n = self.nodes.get_mut(&slot.seat_key).expect("a reserved node");
                            if counts {
                                n.record.value.uses += 1;
                            }
                            n.used.insert(slot.slot);
                            let key = slot.key();
                            touched.insert(slot.seat_key.clone());
                            let w = &mut self.waiting[i];
                            w.nodes.push(NodeSeen {
                                index,
                                id: NodeId::for_slot(&slot.backing_id, slot.slot),
                                key: key.clone(),
                                state: NodeState::Ready,
                                prepared_here: false,
                                given_back: false,
                            });
                            w.slots.insert(key, slot.clone());
                            self.restand(&slot.seat_key);
                        }
                    }
                    RequestStep::Prepare { nodes, .. } => {
                        // The agent prepares at once: a warm slot's prepare is milliseconds.
                        let w = &mut self.waiting[i];
                        for n in w.nodes.iter_mut().filter(|n| nodes.contains(&n.key)) {
                            n.prepared_here = true;
                        }
                    }
                    RequestStep::Release(ids) => {
                        let w = &mut self.waiting[i];
                        let keys: Vec<String> = w
                            .nodes
                            .iter()
                            .filter(|n| ids.contains(&n.id))
                            .map(|n| n.key.clone())
                            .collect();
                        w.nodes.retain(|n| !keys.contains(&n.key));
                        let slots: Vec<SlotRef> =
                            keys.iter().filter_map(|k| w.slots.remove(k)).collect();
                        for slot in slots {
                            self.give_back(&slot);
                        }
                    }
                    RequestStep::Fulfil { .. } => {
                        let w = self.waiting.remove(i);
                        let job = &self.jobs[w.job];
                        self.ledger.served(w.record.created_at, self.now);
                        let end = self.now + job.duration_ms;
                        self.ledger.busy(self.now, end, w.slots.len());
                        let tenants = &self.setup.config.tenants;
                        self.ledger.tenant_job(
                            job.tenant
                                .as_deref()
                                .unwrap_or(slotpool_config::tenants::DEFAULT_TENANT),
                            tenants.get(w.tenant).weight,
                            w.record.created_at,
                            self.now,
                            end,
                            w.slots.len(),
                        );
                        self.hold(w.tenant, &w.record.labels, true);
                        self.events.at(
                            end,
                            Event::JobEnd {
                                slots: w.slots.into_values().collect(),
                                tenant: w.tenant,
                                labels: w.record.labels.clone(),
                            },
                        );
                        done = true;
                        break;
                    }
                    RequestStep::Wait {
                        missing, status, ..
                    } => {
                        if let Some(status) = status {
                            self.waiting[i].record.status = status;
                        }
                        blocked.extend(missing);
                        break;
                    }
                    other => return Err(SimError::Unmodelled(format!("{other:?}"))),
                }
            }
            if !done {
                i += 1;
            }
        }
        for seat in touched {
            self.step_node(&seat)?;
        }
        Ok(())
    }

    /// Takes the seats the planner chooses for each label's deficit.
    fn plan(&mut self) -> Result<(), SimError> {
        for label in self.labels.clone() {
            let unmet: u32 = self
                .waiting
                .iter()
                .map(|w| {
                    let want = w.record.labels.iter().filter(|l| **l == label).count();
                    let have = w
                        .nodes
                        .iter()
                        .filter(|n| w.record.labels[n.index as usize] == label)
                        .count();
                    want.saturating_sub(have) as u32
                })
                .sum();
            let deficit = planner::deficit(
                unmet,
                self.capacity.coming(&label),
                self.ready_target(&label),
            );
            if deficit <= 0 {
                continue;
            }
            let sites = self.setup.config.sites(&label);
            let seats: Vec<SiteSeats> = sites
                .iter()
                .map(|site| {
                    let taken: BTreeMap<u32, &Versioned<BackingNode>> = self
                        .nodes
                        .values()
                        .filter(|n| {
                            n.record.value.provider == site.provider.name
                                && n.record.value.pool == site.pool.name
                        })
                        .map(|n| (n.record.value.seat, &n.record))
                        .collect();
                    let out = planner::out_of_capacity(taken.values().copied());
                    SiteSeats {
                        out_of_capacity: out,
                        free: if out {
                            Vec::new()
                        } else {
                            planner::free_seats(
                                site.pool.max_servers,
                                |s| taken.get(&s).copied(),
                                &HashSet::new(),
                                self.now,
                            )
                        },
                        sizes: site.label.sizes.iter().map(SizeOffer::of).collect(),
                    }
                })
                .collect();
            for Choice { site, seat, size } in planner::choose_seats(deficit, &seats) {
                let site = &sites[site];
                let size = &site.label.sizes[size];
                let record = planner::requested_record(site, size, seat.seat, None, self.now);
                let key = layout::seat_key(&site.provider.name, &site.pool.name, seat.seat);
                self.nodes.insert(
                    key.clone(),
                    Node {
                        record: Versioned {
                            key: key.clone(),
                            revision: 1,
                            value: record,
                        },
                        used: BTreeSet::new(),
                        booted: false,
                        last_release: None,
                        paid_from: None,
                        look_at: None,
                    },
                );
                self.restand(&key);
                self.step_node(&key)?;
            }
        }
        Ok(())
    }

    /// The `min-ready` of the label of the node at `seat` and, when it is empty, the free
    /// slots of the ready nodes kept ahead of it ([`lifecycle::free_ahead`]), as the
    /// launcher's backing worker observes them.
    fn warm(&self, seat: &str) -> (u32, u32) {
        let Some(me) = self.nodes.get(seat) else {
            return (0, 0);
        };
        let label = &me.record.value.label;
        let min_ready = self.ready_target(label);
        if min_ready == 0 || !me.used.is_empty() {
            return (min_ready, 0);
        }
        let others = self
            .nodes
            .iter()
            .filter(|(key, n)| {
                key.as_str() != seat
                    && n.record.value.label == *label
                    && n.booted
                    && n.record.value.state == BackingState::Ready
                    && n.record.value.idle == IdleBehaviour::Run
            })
            .map(|(key, n)| (key.as_str(), n.record.value.slots, n.used.len() as u32));
        (
            min_ready,
            lifecycle::free_ahead((seat, me.record.value.slots), others),
        )
    }

    /// Carries out `lifecycle::next` for the node at `seat` until it waits.
    fn step_node(&mut self, seat: &str) -> Result<(), SimError> {
        for _ in 0..MAX_STEPS {
            let (min_ready, free_ahead) = self.warm(seat);
            let Some(label) = self.nodes.get(seat).map(|n| n.record.value.label.clone()) else {
                return Ok(());
            };
            let waiting = self.queued(&label);
            let ready_falls_at =
                warm::ready_falls_at(&self.setup.config, &label, &self.arrivals, self.now);
            let Some(n) = self.nodes.get_mut(seat) else {
                return Ok(());
            };
            let b = &mut n.record.value;
            let rules = self
                .setup
                .config
                .label_in(&b.provider, &b.pool, &b.label)
                .map(|s| lifecycle::Rules::of(&s));
            let obs = lifecycle::Observed {
                agent: if n.booted {
                    AgentSeen::Up { draining: false }
                } else {
                    AgentSeen::Absent
                },
                used: n.used.len() as u32,
                last_release: n.last_release,
                rules,
                synced_since: Some(EPOCH_MS),
                heartbeats_back_at: None,
                heartbeat_lost_at: None,
                heartbeat_ttl: Duration::from_secs(
                    slotpool_protocol::model::DEFAULT_HEARTBEAT_TTL_SECS,
                ),
                min_ready,
                free_ahead,
                ready_falls_at,
                waiting,
                now: self.now,
            };
            let step = lifecycle::next(b, &obs);
            b.updated_at = self.now;
            match step {
                // The simulator's launches are never interrupted: a look for what an
                // interrupted one started is a launch.
                Step::Launch { .. } | Step::FindLaunched { .. } => {
                    b.attempts += 1;
                    b.launched_at = Some(self.now);
                    b.state = BackingState::Launching;
                    n.booted = false;
                    if self.rng.unit() < self.setup.provider.capacity_error_rate {
                        b.out_of_capacity = true;
                        b.instance = None;
                        b.failure = Some("simulated capacity error".into());
                    } else {
                        b.out_of_capacity = false;
                        b.failure = None;
                        b.instance = Some(Instance {
                            id: seat.to_string(),
                            host: "simulated".into(),
                            data: serde_json::Value::Null,
                        });
                        n.paid_from = Some(self.now);
                        self.ledger.launched(self.now, &kind_of(self.setup, b));
                        let boot = boot_ms(&self.setup.provider, &mut self.rng);
                        let attempt = b.attempts;
                        self.events.at(
                            self.now + boot,
                            Event::Booted {
                                seat: seat.to_string(),
                                attempt,
                            },
                        );
                    }
                }
                Step::BecomeReady => {
                    b.state = BackingState::Ready;
                    b.ready_at = Some(self.now);
                    // The write lands and every waiting request sees the new slots
                    // before the node's next step (with a grace time of 0, its release).
                    self.restand(seat);
                    self.look_now(seat);
                    self.look_at_warm(seat);
                    return Ok(());
                }
                Step::SetIdleSince(at) => b.idle_since = at,
                Step::Retire(_) => b.state = BackingState::Retiring,
                Step::Release(_) => b.state = BackingState::Releasing,
                Step::FinishRelease
                | Step::Fail(_)
                | Step::Interrupted(_)
                | Step::CleanUp
                | Step::Forget => {
                    let n = self.nodes.remove(seat).expect("the node");
                    if let Some(from) = n.paid_from {
                        let kind = kind_of(self.setup, &n.record.value);
                        self.ledger.released(from, self.now, &kind);
                    }
                    if matches!(step, Step::Fail(_) | Step::Interrupted(_)) && !n.used.is_empty() {
                        return Err(SimError::Unmodelled(format!("{step:?} with slots in use")));
                    }
                    self.capacity.set(seat, None);
                    return Ok(());
                }
                Step::Wait(at) => {
                    if let Some(at) = at.filter(|at| n.look_at != Some(*at)) {
                        n.look_at = Some(at);
                        self.events.at(at, Event::Look(seat.to_string()));
                    }
                    self.restand(seat);
                    return Ok(());
                }
            }
            self.restand(seat);
        }
        Err(SimError::Unmodelled(format!(
            "backing node {seat} took {MAX_STEPS} steps without waiting"
        )))
    }
}
