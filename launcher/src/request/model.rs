//! A model of several launchers over one KV store, for generated request mixes.
//!
//! Each launcher has its own mirror ([`World`]) and request workers that do what
//! `worker.rs` does: look ([`observe::look_in`]), ask ([`plan::next`]), carry the step
//! out on the model's KV (create-if-absent claims, revision-checked request writes), and
//! wait until woken. Every KV change reaches each other launcher's mirror only when an
//! op delivers it, so the mirrors lag as the generated op sequence says; a worker's
//! request write reaches its own mirror when its launcher next runs, and the watch
//! brings it back too, maybe first, with later changes. There is no bus, clock or task:
//! each op is one step, so a failing mix shrinks to a minimal case.
//!
//! The invariants, checked after every op and once everything is delivered and every
//! worker sleeps:
//! - a worker never takes more than [`STEP_BOUND`] steps in a row without waiting
//!   (a pass is bounded: no spin);
//! - no slot is held by two requests, and every node a fulfilled request holds is in
//!   KV under that request;
//! - once the model settles, no waiting request could be served by the free slots in
//!   the queue's order ([`super::reference::servable_yet_waiting`]): nothing is left waiting that free
//!   capacity can serve, and no two sets block each other.

use super::observe::{self, Memory};
use super::plan::{self, RequestStep};
use super::reference::{servable_yet_waiting, unserved_in_seats};
use crate::backing::{lifecycle, planner};
use crate::config::Config;
use crate::world::{tests_support, Watched, World};
use slotpool_protocol::layout;
use slotpool_protocol::model::{
    BackingNode, BackingState, IdleBehaviour, Lease, Node, NodeRequest, RequestState,
};
use slotpool_protocol::store::Versioned;
use slotpool_protocol::time::UnixMillis;
use slotpool_protocol::{LauncherId, NodeId, RequestId, UserName};
use std::collections::{BTreeMap, VecDeque};

/// The most steps a worker may take in a row without waiting.
pub const STEP_BOUND: u32 = 200;

/// How many labels a fleet has, at most.
pub const MAX_LABELS: usize = 3;

/// The grace-time of every label, in seconds: how long an idle node stays.
const GRACE_SECS: u64 = 2;

/// A fleet: per label, how many ready backing nodes of how many slots; or labels that
/// share the seats of one pool, whose nodes are launched for the queue and given back
/// once idle, as the planner and the backing lifecycle decide.
#[derive(Clone, Debug)]
pub struct Fleet {
    /// (slots per node, nodes) of label `l<index>` (nodes: none at first with `seats`).
    pub labels: Vec<(u32, u32)>,
    /// The pool's max-servers when its labels share its seats: nodes come and go.
    pub seats: Option<u32>,
}

impl Fleet {
    pub fn label(i: usize) -> String {
        format!("l{i}")
    }

    /// Slots of label `i` in the fleet.
    pub fn capacity(&self, i: usize) -> u32 {
        let (slots, nodes) = self.labels[i];
        slots * self.seats.unwrap_or(nodes)
    }

    fn config(&self) -> Config {
        let nodes: u32 = self.labels.iter().map(|(_, n)| n).sum();
        let mut yaml = format!(
            "providers:\n  - name: p\n    driver: local\n    pools:\n      - name: main\n        max-servers: {}\n        labels:\n",
            self.seats.unwrap_or(nodes)
        );
        for (i, (slots, _)) in self.labels.iter().enumerate() {
            yaml.push_str(&format!(
                "          - name: {}\n            backing-label: b{i}\n            max-parallel-jobs: {slots}\n            grace-time: {}\n",
                Fleet::label(i),
                GRACE_SECS
            ));
        }
        Config::parse(std::path::Path::new("model.yaml"), &yaml)
            .unwrap_or_else(|e| panic!("model config: {e}\n{yaml}"))
    }

    /// The backing records, one seat each (none when the labels share seats).
    fn backing(&self) -> Vec<Versioned<BackingNode>> {
        let mut out = Vec::new();
        if self.seats.is_some() {
            return out;
        }
        let mut seat = 0;
        for (i, (slots, nodes)) in self.labels.iter().enumerate() {
            for _ in 0..*nodes {
                let id = format!("bn-{seat}");
                let mut b =
                    tests_support::backing(&id, &Fleet::label(i), *slots, BackingState::Ready);
                b.key = layout::seat_key("p", "main", seat);
                b.value.seat = seat;
                b.value.backing_label = format!("b{i}");
                b.value.ready_at = Some(0);
                out.push(b);
                seat += 1;
            }
        }
        out
    }
}

/// One thing that happens.
#[derive(Clone, Debug)]
pub enum Op {
    /// A client submits a node set (label index, count) at `priority` to `launcher`.
    Submit {
        launcher: usize,
        client: usize,
        set: Vec<(usize, u32)>,
        priority: i32,
    },
    /// Every change not yet in `launcher`'s mirror reaches it.
    Deliver { launcher: usize },
    /// `launcher`'s awake workers step until every one waits.
    Run { launcher: usize },
    /// The client of the `pick`th request holding nodes releases them.
    Release { pick: usize },
    /// The client of the `pick`th open request cancels it.
    Cancel { pick: usize },
    /// Time passes.
    Tick { ms: u64 },
    /// An operator holds (or runs again) the `node`th backing node.
    Hold { node: usize, hold: bool },
    /// `launcher`'s planner takes seats for every label's demand (shared seats only).
    Plan { launcher: usize },
    /// `launcher` decides once for every backing node whether it stays (shared seats
    /// only): an idle one is given back after its grace-time unless kept for the queue.
    Idle { launcher: usize },
}

/// A KV change, as a watch delivers it.
#[derive(Clone, Debug)]
enum Change {
    Request(Versioned<NodeRequest>),
    Slot(Versioned<Node>),
    SlotGone { key: String, revision: u64 },
    Backing(Versioned<BackingNode>),
    BackingGone { key: String, revision: u64 },
}

/// A request worker of the model.
#[derive(Debug, Default)]
struct Worker {
    memory: Memory,
    /// Its request's topic was bumped since it last looked.
    awake: bool,
    /// Steps taken since it last waited.
    steps: u32,
    /// When its wait ends on its own (a status to write, a lost claim's pause).
    until: Option<UnixMillis>,
}

struct Launcher {
    id: LauncherId,
    world: World,
    workers: BTreeMap<RequestId, Worker>,
    pending: VecDeque<Change>,
    /// Request writes of its workers that KV acknowledged and that are not yet in its
    /// mirror: a worker puts its write in once its task runs again (the next `Run`),
    /// and meanwhile the watch may bring that write and later ones (`Deliver`). The
    /// worker waits until then.
    acks: Vec<(RequestId, Versioned<NodeRequest>)>,
}

/// The model: KV and the launchers.
pub struct Model {
    config: Config,
    now: UnixMillis,
    revision: u64,
    requests: BTreeMap<RequestId, Versioned<NodeRequest>>,
    slots: BTreeMap<String, Versioned<Node>>,
    /// Seat key → backing node.
    backing: BTreeMap<String, Versioned<BackingNode>>,
    /// Slots per node of each label.
    label_slots: Vec<u32>,
    /// The pool's seats when its labels share them.
    seats: Option<u32>,
    /// When an idle node's grace-time ends, as the last decisions said.
    backing_timers: Vec<UnixMillis>,
    launched: u64,
    /// Whether a set the seats cannot hold at once is refused at submit, as the
    /// launcher's API does (off: one accepted before a reload shrank the pool).
    pub refuse_unholdable: bool,
    launchers: Vec<Launcher>,
    submitted: u64,
    /// Steps taken by all workers, for the report.
    pub steps: u64,
    /// The most steps a worker took in a row without waiting.
    pub longest: u32,
}

impl Model {
    pub fn new(fleet: &Fleet, launchers: usize) -> Model {
        let config = fleet.config();
        let backing = fleet.backing();
        let ids: Vec<LauncherId> = (0..launchers)
            .map(|i| LauncherId::parse(&format!("launcher-{i}")).unwrap())
            .collect();
        let launchers = ids
            .iter()
            .map(|id| {
                let mut world = World::for_config(id.clone(), &config);
                for other in &ids {
                    world.put_lease(Versioned {
                        key: layout::launcher_lease_key(other),
                        revision: 1,
                        value: Lease {
                            v: 1,
                            holder: other.clone(),
                            acquired_at: 0,
                            renewed_at: None,
                            passed_at: None,
                        },
                    });
                }
                for b in &backing {
                    world.put_backing(b.clone());
                    world.put_agent(tests_support::agent(b.value.id.as_str()));
                }
                Launcher {
                    id: id.clone(),
                    world,
                    workers: BTreeMap::new(),
                    pending: VecDeque::new(),
                    acks: Vec::new(),
                }
            })
            .collect();
        Model {
            config,
            now: 1_000_000,
            revision: 100,
            requests: BTreeMap::new(),
            slots: BTreeMap::new(),
            backing: backing.into_iter().map(|b| (b.key.clone(), b)).collect(),
            label_slots: fleet.labels.iter().map(|(s, _)| *s).collect(),
            seats: fleet.seats,
            backing_timers: Vec::new(),
            launched: 0,
            refuse_unholdable: true,
            launchers,
            submitted: 0,
            steps: 0,
            longest: 0,
        }
    }

    fn next_revision(&mut self) -> u64 {
        self.revision += 1;
        self.revision
    }

    /// Sends `change` to every launcher's mirror but `skip`'s (which applied it).
    fn publish(&mut self, change: Change, skip: Option<usize>) {
        for (i, l) in self.launchers.iter_mut().enumerate() {
            if Some(i) != skip {
                l.pending.push_back(change.clone());
            }
        }
    }

    pub fn apply(&mut self, op: &Op) -> Result<(), String> {
        match op {
            Op::Submit {
                launcher,
                client,
                set,
                priority,
            } => self.submit(*launcher % self.launchers.len(), *client, set, *priority),
            Op::Deliver { launcher } => self.deliver(*launcher % self.launchers.len()),
            Op::Run { launcher } => self.run(*launcher % self.launchers.len())?,
            Op::Release { pick } => self.release(*pick),
            Op::Cancel { pick } => self.cancel(*pick),
            Op::Tick { ms } => self.tick(*ms),
            Op::Hold { node, hold } => self.hold(*node, *hold),
            Op::Plan { launcher } => {
                self.plan(*launcher % self.launchers.len());
            }
            Op::Idle { launcher } => {
                self.idle(*launcher % self.launchers.len());
            }
        }
        self.check_no_double_booking()
    }

    fn submit(&mut self, l: usize, client: usize, set: &[(usize, u32)], priority: i32) {
        if let Some(seats) = self.seats.filter(|_| self.refuse_unholdable) {
            // The launcher refuses a set the pool's seats cannot hold at once.
            let nodes: u32 = set
                .iter()
                .map(|(label, count)| count.div_ceil(self.label_slots[*label]))
                .sum();
            if nodes > seats {
                return;
            }
        }
        self.submitted += 1;
        let id = RequestId::parse(&format!("req-{}", self.submitted)).unwrap();
        let labels: Vec<&str> = Vec::new();
        let mut r = tests_support::request(id.as_str(), &labels);
        for (label, count) in set {
            for _ in 0..*count {
                r.labels.push(Fleet::label(*label));
            }
        }
        r.priority = priority;
        r.created_at = self.now;
        r.updated_at = self.now;
        r.owner = Some(self.launchers[l].id.clone());
        r.client = Some(UserName::parse(&format!("client-{client}")).unwrap());
        r.status = "queued".into();
        let v = Versioned {
            key: id.to_string(),
            revision: self.next_revision(),
            value: r,
        };
        self.requests.insert(id.clone(), v.clone());
        self.launchers[l].world.put_request(v.clone());
        self.publish(Change::Request(v), Some(l));
        self.launchers[l].workers.insert(
            id,
            Worker {
                awake: true,
                ..Worker::default()
            },
        );
    }

    fn deliver(&mut self, l: usize) {
        let now = self.now;
        let launcher = &mut self.launchers[l];
        while let Some(change) = launcher.pending.pop_front() {
            // The topics the watch bumps (`watch.rs`): a request's, for a change of it
            // or of one of its slots.
            let topic = match change {
                Change::Request(r) => {
                    let (id, key, revision) = (r.value.id.clone(), r.key.clone(), r.revision);
                    launcher.world.put_request(r);
                    launcher.world.request_delivered(&key, revision);
                    launcher.world.watch_delivered(Watched::Requests, revision);
                    Some(id)
                }
                Change::Slot(n) => {
                    let id = n.value.request_id.clone();
                    let revision = n.revision;
                    launcher.world.put_slot(n);
                    launcher.world.watch_delivered(Watched::Slots, revision);
                    Some(id)
                }
                Change::SlotGone { key, revision } => {
                    let id = launcher
                        .world
                        .slots
                        .get(&key)
                        .map(|n| n.value.request_id.clone());
                    launcher.world.remove_slot(&key, revision);
                    launcher.world.watch_delivered(Watched::Slots, revision);
                    id
                }
                Change::Backing(b) => {
                    let id = b.value.id.to_string();
                    let revision = b.revision;
                    launcher.world.put_backing(b);
                    launcher.world.watch_delivered(Watched::Backing, revision);
                    launcher.world.put_agent(tests_support::agent(&id));
                    None
                }
                Change::BackingGone { key, revision } => {
                    launcher.world.remove_backing(&key, revision);
                    launcher.world.watch_delivered(Watched::Backing, revision);
                    None
                }
            };
            Self::wake(launcher, topic.iter());
            Self::flush(launcher, now);
        }
    }

    /// Bumps the topics of `requests` on `launcher`.
    fn wake<'a>(launcher: &mut Launcher, requests: impl Iterator<Item = &'a RequestId>) {
        for id in requests {
            if let Some(w) = launcher.workers.get_mut(id) {
                w.awake = true;
            }
        }
    }

    /// What the world's guard does when it goes: wakes the requests that the changes
    /// made under it let claim ([`World::take_wakes`]).
    fn flush(launcher: &mut Launcher, now: UnixMillis) {
        let wakes = launcher.world.take_wakes(now);
        Self::wake(launcher, wakes.iter());
    }

    /// Puts `l`'s acknowledged request writes into its mirror, then steps its awake
    /// workers until all of them wait (or wait for a write of theirs to be put in).
    fn run(&mut self, l: usize) -> Result<(), String> {
        let now = self.now;
        let launcher = &mut self.launchers[l];
        for (_, write) in std::mem::take(&mut launcher.acks) {
            launcher.world.put_request(write);
            Self::flush(launcher, now);
        }
        loop {
            let launcher = &self.launchers[l];
            let awake: Vec<RequestId> = launcher
                .workers
                .iter()
                .filter(|(id, w)| w.awake && !launcher.acks.iter().any(|(a, _)| a == *id))
                .map(|(id, _)| id.clone())
                .collect();
            if awake.is_empty() {
                return Ok(());
            }
            for id in awake {
                self.step(l, &id)?;
            }
        }
    }

    /// One step of the worker of request `id` on launcher `l`: what `worker::run`'s loop
    /// does once.
    fn step(&mut self, l: usize, id: &RequestId) -> Result<(), String> {
        self.steps += 1;
        let now = self.now;
        let config = &self.config;
        let launcher = &mut self.launchers[l];
        let Some(w) = launcher.workers.get_mut(id) else {
            return Ok(());
        };
        // Its topic is marked unchanged before it looks.
        w.awake = false;
        w.until = None;
        w.steps += 1;
        self.longest = self.longest.max(w.steps);
        if w.steps > STEP_BOUND {
            return Err(format!(
                "the worker of {id} on launcher {l} took {STEP_BOUND} steps in a row without waiting"
            ));
        }
        let req = match launcher.world.requests.get(id).cloned() {
            Some(r) => r,
            None => {
                // Finished: give back what is still claimed for it, as `current` does.
                let strays: Vec<String> = launcher
                    .world
                    .nodes_of(id)
                    .iter()
                    .map(|n| n.key.clone())
                    .collect();
                launcher.workers.remove(id);
                for key in strays {
                    self.delete_slot(l, &key);
                }
                return Ok(());
            }
        };
        let me = launcher.id.clone();
        let memory = std::mem::take(&mut w.memory);
        let obs = observe::look_in(&mut launcher.world, config, &me, &req.value, &memory, now);
        let step = plan::next(&req.value, &obs, now);
        if !matches!(step, RequestStep::Claim { .. }) {
            for slot in obs.reserved.values() {
                launcher.world.unreserve(slot);
            }
        }
        Self::flush(launcher, now);
        let mut memory = memory;
        let after = self.carry_out(l, &req, step, &mut memory);
        let launcher = &mut self.launchers[l];
        Self::flush(launcher, now);
        let Some(w) = launcher.workers.get_mut(id) else {
            return Ok(());
        };
        w.memory = memory;
        match after {
            After::Stop => {
                launcher.workers.remove(id);
            }
            After::Again => w.awake = true,
            After::Wait(until) => {
                let at = match (until, w.memory.next_retry(now)) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                w.until = at;
                // It sleeps unless its topic was bumped since it looked.
                if !w.awake {
                    w.steps = 0;
                }
            }
        }
        Ok(())
    }

    fn carry_out(
        &mut self,
        l: usize,
        req: &Versioned<NodeRequest>,
        step: RequestStep,
        memory: &mut Memory,
    ) -> After {
        let r = &req.value;
        match step {
            RequestStep::Leave => After::Stop,
            RequestStep::Stop { strays } | RequestStep::Hold { strays, .. } => {
                for id in strays {
                    self.give_back(l, &id);
                }
                After::Stop
            }
            RequestStep::Reclaim { .. } => After::Stop,
            RequestStep::Fail { reason, release } => {
                let mut failed = r.clone();
                failed.state = RequestState::Failed;
                failed.failure = Some(reason);
                if self.write_request(l, req, failed).is_err() {
                    return After::Again;
                }
                for id in release {
                    self.give_back(l, &id);
                }
                After::Stop
            }
            RequestStep::Release(nodes) => {
                for id in nodes {
                    self.give_back(l, &id);
                }
                After::Again
            }
            RequestStep::Claim { slots, .. } => {
                for (index, slot) in slots {
                    let key = slot.key();
                    self.launchers[l].world.unreserve(&slot);
                    if self.slots.contains_key(&key) {
                        memory.claim_lost(key, self.now);
                        continue;
                    }
                    let mut node = tests_support::node(
                        slot.backing_id.as_str(),
                        slot.slot,
                        r.id.as_str(),
                        &r.labels[index as usize],
                    );
                    node.value.id = NodeId::for_slot(&slot.backing_id, slot.slot);
                    memory.claim_won(&node.value.id, self.now);
                    node.value.index = index;
                    node.value.client = r.client.clone();
                    node.revision = self.next_revision();
                    self.slots.insert(key, node.clone());
                    self.launchers[l].world.put_slot(node.clone());
                    self.publish(Change::Slot(node), Some(l));
                }
                After::Again
            }
            RequestStep::Prepare { nodes, .. } => {
                for key in nodes {
                    if let Some(n) = self.slots.get(&key) {
                        if n.value.request_id == r.id {
                            memory.prepared.insert(n.value.id.clone(), n.clone());
                        }
                    }
                }
                After::Again
            }
            RequestStep::Pause { .. } => After::Again,
            RequestStep::Wait {
                until,
                status,
                waiting,
                ..
            } => {
                memory.waiting_since.get_or_insert(self.now);
                if let Some(status) = status {
                    let mut r2 = r.clone();
                    r2.status = status;
                    r2.waiting = waiting;
                    if self.write_request(l, req, r2).is_err() {
                        return After::Again;
                    }
                }
                After::Wait(until)
            }
            RequestStep::Fulfil { nodes, .. } => {
                let mut done = r.clone();
                done.state = RequestState::Fulfilled;
                done.nodes = nodes;
                done.fulfilled_at = Some(self.now);
                if self.write_request(l, req, done).is_err() {
                    return After::Again;
                }
                After::Stop
            }
        }
    }

    /// A revision-checked write of request `req`, applied to launcher `l`'s mirror.
    fn write_request(
        &mut self,
        l: usize,
        req: &Versioned<NodeRequest>,
        value: NodeRequest,
    ) -> Result<(), ()> {
        let current = self.requests.get(&req.value.id).map(|r| r.revision);
        if current != Some(req.revision) {
            // Conflict: the mirror catches up first.
            self.deliver(l);
            return Err(());
        }
        let v = Versioned {
            key: req.key.clone(),
            revision: self.next_revision(),
            value,
        };
        self.requests.insert(req.value.id.clone(), v.clone());
        self.launchers[l]
            .acks
            .push((req.value.id.clone(), v.clone()));
        // The watch brings the write back to its own launcher too.
        self.publish(Change::Request(v), None);
        Ok(())
    }

    /// Gives back node `id` by launcher `l`, only while its slot holds it (as
    /// `release::release` does).
    fn give_back(&mut self, l: usize, id: &NodeId) {
        let (backing, slot) = id.slot().expect("a slot's node id");
        let key = layout::slot_key(&backing, slot);
        if self.slots.get(&key).is_some_and(|n| &n.value.id == id) {
            self.delete_slot(l, &key);
        }
    }

    /// Gives back slot `key` (by launcher `l`).
    fn delete_slot(&mut self, l: usize, key: &str) {
        if self.slots.remove(key).is_none() {
            return;
        }
        let revision = self.next_revision();
        let now = self.now;
        let launcher = &mut self.launchers[l];
        launcher.world.remove_slot(key, revision);
        Self::flush(launcher, now);
        self.publish(
            Change::SlotGone {
                key: key.to_string(),
                revision,
            },
            Some(l),
        );
    }

    fn release(&mut self, pick: usize) {
        let holders: Vec<RequestId> = self
            .requests
            .values()
            .filter(|r| r.value.holds_nodes())
            .map(|r| r.value.id.clone())
            .collect();
        if holders.is_empty() {
            return;
        }
        let id = holders[pick % holders.len()].clone();
        let keys: Vec<String> = self
            .slots
            .iter()
            .filter(|(_, n)| n.value.request_id == id)
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            self.slots.remove(&key);
            let revision = self.next_revision();
            self.publish(Change::SlotGone { key, revision }, None);
        }
        let mut r = self.requests[&id].clone();
        r.value.nodes_released_at = Some(self.now);
        r.revision = self.next_revision();
        self.requests.insert(id, r.clone());
        self.publish(Change::Request(r), None);
    }

    fn cancel(&mut self, pick: usize) {
        let open: Vec<RequestId> = self
            .requests
            .values()
            .filter(|r| r.value.state == RequestState::Requested)
            .map(|r| r.value.id.clone())
            .collect();
        if open.is_empty() {
            return;
        }
        let id = open[pick % open.len()].clone();
        let mut r = self.requests[&id].clone();
        r.value.state = RequestState::Canceled;
        r.revision = self.next_revision();
        self.requests.insert(id, r.clone());
        self.publish(Change::Request(r), None);
    }

    fn hold(&mut self, node: usize, hold: bool) {
        if self.backing.is_empty() {
            return;
        }
        let i = node % self.backing.len();
        let revision = self.next_revision();
        let b = self.backing.values_mut().nth(i).expect("in range");
        b.value.idle = if hold {
            IdleBehaviour::Hold
        } else {
            IdleBehaviour::Run
        };
        b.revision = revision;
        let b = b.clone();
        self.publish(Change::Backing(b), None);
    }

    /// What `backing::planner::plan` does for each label in turn, from launcher `l`'s
    /// mirror, when `l` is the planner: takes the lowest free seats for the label's
    /// deficit, each a create-if-absent of the seat's key; the node is ready with its
    /// agent at once. Returns whether it took a seat.
    fn plan(&mut self, l: usize) -> bool {
        let Some(seats) = self.seats else {
            return false;
        };
        if !self.launchers[l].world.is_planner() {
            return false;
        }
        let mut took = false;
        for i in 0..self.label_slots.len() {
            let label = Fleet::label(i);
            let slots = self.label_slots[i];
            let world = &self.launchers[l].world;
            let deficit = planner::deficit(
                world.planned_demand(&label),
                world.coming_capacity(&label),
                0,
            );
            let mut wanted = deficit.max(0) as u64;
            for seat in 0..seats {
                if wanted == 0 {
                    break;
                }
                let key = layout::seat_key("p", "main", seat);
                if self.launchers[l].world.backing.contains_key(&key) {
                    continue;
                }
                if self.backing.contains_key(&key) {
                    // Another launcher took it: the create conflicts, the planner stops.
                    break;
                }
                self.launched += 1;
                let id = format!("bn-{}", self.launched);
                let mut b = tests_support::backing(&id, &label, slots, BackingState::Ready);
                b.key = key.clone();
                b.value.seat = seat;
                b.value.backing_label = format!("b{i}");
                b.value.created_at = self.now;
                b.value.ready_at = Some(self.now);
                b.revision = self.next_revision();
                self.backing.insert(key, b.clone());
                let world = &mut self.launchers[l].world;
                world.put_backing(b.clone());
                world.put_agent(tests_support::agent(&id));
                Self::flush(&mut self.launchers[l], self.now);
                self.publish(Change::Backing(b), Some(l));
                wanted = wanted.saturating_sub(u64::from(slots));
                took = true;
            }
        }
        took
    }

    /// What each backing worker of launcher `l` decides ([`lifecycle::next`] on what
    /// `backing::observe` sees), for the idle timers: an empty node records since when,
    /// and is given back after its grace-time unless kept for the queue
    /// ([`World::kept_for`]). Every write is revision-checked; a node is given back only
    /// while no slot of it is claimed. Returns whether it wrote anything.
    fn idle(&mut self, l: usize) -> bool {
        if self.seats.is_none() {
            return false;
        }
        let now = self.now;
        let mut wrote = false;
        let keys: Vec<String> = self.launchers[l].world.backing.keys().cloned().collect();
        for key in keys {
            let world = &self.launchers[l].world;
            let Some(b) = world.backing.get(&key).cloned() else {
                continue;
            };
            let rules = self
                .config
                .label_in("p", "main", &b.value.label)
                .map(|site| lifecycle::Rules::of(&site));
            let obs = lifecycle::Observed {
                agent: lifecycle::AgentSeen::Up { draining: false },
                used: world.used_count(&b.value.id),
                last_release: None,
                rules,
                synced_since: Some(0),
                heartbeats_back_at: None,
                heartbeat_lost_at: None,
                heartbeat_ttl: std::time::Duration::from_secs(10),
                min_ready: 0,
                free_ahead: 0,
                ready_falls_at: None,
                waiting: world.kept_for(&b.value),
                now,
            };
            let current = self.backing.get(&key).map(|c| c.revision);
            if current != Some(b.revision) {
                continue;
            }
            match lifecycle::next(&b.value, &obs) {
                lifecycle::Step::SetIdleSince(since) => {
                    let mut v = b.clone();
                    v.value.idle_since = since;
                    v.revision = self.next_revision();
                    self.backing.insert(key, v.clone());
                    let launcher = &mut self.launchers[l];
                    launcher.world.put_backing(v.clone());
                    Self::flush(launcher, now);
                    self.publish(Change::Backing(v), Some(l));
                    wrote = true;
                }
                lifecycle::Step::Release(_) => {
                    if self
                        .slots
                        .values()
                        .any(|n| n.value.backing_id == b.value.id)
                    {
                        continue;
                    }
                    self.backing.remove(&key);
                    let revision = self.next_revision();
                    let launcher = &mut self.launchers[l];
                    launcher.world.remove_backing(&key, revision);
                    Self::flush(launcher, now);
                    self.publish(Change::BackingGone { key, revision }, Some(l));
                    wrote = true;
                }
                lifecycle::Step::Wait(Some(at)) if at > now => self.backing_timers.push(at),
                _ => {}
            }
        }
        wrote
    }

    /// Time passes: the workers whose wait ends wake.
    fn tick(&mut self, ms: u64) {
        self.now += ms;
        let now = self.now;
        for l in &mut self.launchers {
            for w in l.workers.values_mut() {
                if w.until.is_some_and(|at| at <= now) {
                    w.awake = true;
                }
            }
        }
    }

    /// Delivers and runs until nothing is pending and every worker waits, letting time
    /// pass to the next wait's end while one is set.
    pub fn settle(&mut self) -> Result<(), String> {
        // A first round plans and decides the idle nodes.
        let mut wrote = self.seats.is_some();
        for _ in 0..1_000 {
            let busy = wrote
                || self.launchers.iter().any(|l| {
                    !l.pending.is_empty()
                        || !l.acks.is_empty()
                        || l.workers.values().any(|w| w.awake)
                });
            if !busy {
                let now = self.now;
                let next = self
                    .launchers
                    .iter()
                    .flat_map(|l| l.workers.values().filter_map(|w| w.until))
                    .chain(self.backing_timers.iter().copied().filter(|at| *at > now))
                    .min();
                match next {
                    Some(at) => self.tick(at.saturating_sub(self.now)),
                    None => return self.check_progress(),
                }
            }
            self.backing_timers.clear();
            wrote = false;
            for l in 0..self.launchers.len() {
                self.deliver(l);
                self.run(l)?;
                self.check_no_double_booking()?;
                wrote |= self.plan(l);
                wrote |= self.idle(l);
            }
        }
        Err("the model does not settle in 1,000 rounds".into())
    }

    fn check_no_double_booking(&self) -> Result<(), String> {
        let mut held: BTreeMap<&NodeId, &RequestId> = BTreeMap::new();
        for r in self.requests.values().filter(|r| r.value.holds_nodes()) {
            for n in &r.value.nodes {
                if let Some(other) = held.insert(n, &r.value.id) {
                    return Err(format!("node {n} held by {other} and {}", r.value.id));
                }
                let (b, slot) = n.slot().expect("a slot's node id");
                match self.slots.get(&layout::slot_key(&b, slot)) {
                    Some(s) if s.value.id == *n && s.value.request_id == r.value.id => {}
                    other => {
                        return Err(format!(
                            "{} holds node {n}, but its slot holds {:?}",
                            r.value.id,
                            other.map(|s| (&s.value.id, &s.value.request_id))
                        ))
                    }
                }
            }
        }
        Ok(())
    }

    /// Once settled: no open request could be served by the free slots.
    fn check_progress(&self) -> Result<(), String> {
        let requests: Vec<&NodeRequest> = self.requests.values().map(|r| &r.value).collect();
        let slots: Vec<&Node> = self.slots.values().map(|n| &n.value).collect();
        let backing: Vec<&BackingNode> = self.backing.values().map(|b| &b.value).collect();
        if let Some(why) = servable_yet_waiting(&requests, &slots, &backing, self.now) {
            return Err(why);
        }
        if let Some(seats) = self.seats {
            let label_slots: BTreeMap<String, u32> = (0..self.label_slots.len())
                .map(|i| (Fleet::label(i), self.label_slots[i]))
                .collect();
            if let Some(why) = unserved_in_seats(&requests, &slots, &backing, seats, &label_slots) {
                return Err(why);
            }
        }
        Ok(())
    }

    /// Requests fulfilled, open, and ended otherwise.
    pub fn tally(&self) -> (usize, usize, usize) {
        let mut t = (0, 0, 0);
        for r in self.requests.values() {
            match r.value.state {
                RequestState::Fulfilled => t.0 += 1,
                RequestState::Requested => t.1 += 1,
                _ => t.2 += 1,
            }
        }
        t
    }
}

enum After {
    Again,
    Stop,
    Wait(Option<UnixMillis>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Fixed fleets, and as often labels sharing the seats of one pool.
    fn fleet() -> impl Strategy<Value = Fleet> {
        (
            prop::collection::vec((1u32..=4, 1u32..=3), 1..=MAX_LABELS),
            prop::option::of(1u32..=4),
        )
            .prop_map(|(labels, seats)| Fleet { labels, seats })
    }

    fn op(fleet: &Fleet, launchers: usize) -> impl Strategy<Value = Op> {
        let caps: Vec<u32> = (0..fleet.labels.len()).map(|i| fleet.capacity(i)).collect();
        let n = caps.len();
        let set = prop::collection::btree_map(0..n, 1u32..=16, 1..=n.min(3)).prop_map(move |m| {
            m.into_iter()
                .map(|(l, c)| (l, 1 + (c - 1) % caps[l]))
                .collect::<Vec<_>>()
        });
        prop_oneof![
            4 => (0..launchers, 0usize..2, set, prop::sample::select(vec![0, 100, 100, 500, 1000]))
                .prop_map(|(launcher, client, set, priority)| Op::Submit { launcher, client, set, priority }),
            3 => (0..launchers).prop_map(|launcher| Op::Deliver { launcher }),
            4 => (0..launchers).prop_map(|launcher| Op::Run { launcher }),
            2 => any::<usize>().prop_map(|pick| Op::Release { pick }),
            1 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
            1 => (1u64..40_000).prop_map(|ms| Op::Tick { ms }),
            1 => (any::<usize>(), any::<bool>()).prop_map(|(node, hold)| Op::Hold { node, hold }),
            2 => (0..launchers).prop_map(|launcher| Op::Plan { launcher }),
            2 => (0..launchers).prop_map(|launcher| Op::Idle { launcher }),
        ]
    }

    fn case() -> impl Strategy<Value = (Fleet, usize, Vec<Op>)> {
        (fleet(), 1usize..=3).prop_flat_map(|(fleet, launchers)| {
            let ops = prop::collection::vec(op(&fleet, launchers), 1..60);
            (Just(fleet), Just(launchers), ops)
        })
    }

    fn play(fleet: &Fleet, launchers: usize, ops: &[Op]) -> Result<Model, String> {
        let mut m = Model::new(fleet, launchers);
        for op in ops {
            m.apply(op)?;
        }
        m.settle()?;
        Ok(m)
    }

    fn submit(launcher: usize, set: &[(usize, u32)], priority: i32) -> Op {
        Op::Submit {
            launcher,
            client: 0,
            set: set.to_vec(),
            priority,
        }
    }

    /// The wedge: a set that free slots could not complete (one of the label's two
    /// nodes held) was woken at once after every look, and its worker spun.
    #[test]
    fn a_set_short_of_slots_waits_without_spinning() {
        let fleet = Fleet {
            labels: vec![(1, 2)],
            seats: None,
        };
        let ops = [
            Op::Hold {
                node: 0,
                hold: true,
            },
            submit(0, &[(0, 2)], 0),
            Op::Deliver { launcher: 0 },
            submit(0, &[(0, 1)], 0),
        ];
        play(&fleet, 1, &ops).unwrap();
    }

    /// A node set stopped standing in the queue of `l1` when a node of its other label
    /// `l0` was held, and the request behind it in `l1`'s queue was not woken.
    #[test]
    fn a_set_that_stops_standing_wakes_those_behind_it_in_its_other_labels() {
        let fleet = Fleet {
            labels: vec![(1, 2), (2, 3)],
            seats: None,
        };
        let mut ops = vec![submit(1, &[(1, 2)], 0)];
        ops.extend((0..5).map(|_| submit(0, &[(0, 1)], 0)));
        ops.extend([
            submit(1, &[(1, 5)], 100),
            Op::Run { launcher: 1 },
            submit(0, &[(0, 2), (1, 2)], 0),
            submit(0, &[(0, 1)], 0),
            Op::Tick { ms: 30_000 },
            Op::Run { launcher: 1 },
            Op::Release { pick: 0 },
            Op::Hold {
                node: 0,
                hold: true,
            },
        ]);
        play(&fleet, 3, &ops).unwrap();
    }

    /// Two labels sharing two seats: a set that the seats cannot hold at once (one
    /// node of `l0` and two of `l1`) took a seat for each label, its idle nodes were kept
    /// for it for good, and `{l1: 4}` behind it waited for ever with both seats idle.
    #[test]
    fn a_set_the_seats_cannot_hold_keeps_no_seat_from_the_others() {
        let fleet = Fleet {
            labels: vec![(1, 1), (2, 3)],
            seats: Some(2),
        };
        let ops = [submit(0, &[(0, 1), (1, 3)], 0), submit(2, &[(1, 4)], 500)];
        // Accepted, as before a reload that took seats away.
        let mut m = Model::new(&fleet, 3);
        m.refuse_unholdable = false;
        for op in &ops {
            m.apply(op).unwrap();
        }
        m.settle().unwrap();
    }

    /// A waiting request's status write is acknowledged, and before its worker puts it
    /// into the mirror the client cancels the request, the watch brings both, and the
    /// mirror lets the finished request go. The late put brought the request back as
    /// open: its worker, woken by the slot the release freed, wrote on a revision KV had
    /// moved past, for good (`tests/tests/mix.rs` saw it as requests never ending).
    #[test]
    fn a_write_put_in_after_its_request_was_canceled_does_not_bring_it_back() {
        let fleet = Fleet {
            labels: vec![(1, 1)],
            seats: None,
        };
        let ops = [
            submit(0, &[(0, 1)], 0),
            submit(0, &[(0, 1)], 0),
            Op::Run { launcher: 0 },
            Op::Tick { ms: 250 },
            Op::Run { launcher: 0 },
            Op::Cancel { pick: 0 },
            Op::Release { pick: 0 },
            Op::Deliver { launcher: 0 },
            submit(0, &[(0, 1)], 0),
        ];
        play(&fleet, 1, &ops).unwrap();
    }

    /// Two labels sharing four seats, each with a set waiting that its nodes could not
    /// complete: `l0`'s nodes were kept idle for `{l0: 3}`, and `{l1: 5}` ahead of it,
    /// short of one seat, waited for ever with three seats free or idle.
    #[test]
    fn labels_sharing_seats_do_not_hold_the_seats_the_head_of_the_queue_needs() {
        let fleet = Fleet {
            labels: vec![(1, 1), (4, 1)],
            seats: Some(4),
        };
        let ops = [
            submit(0, &[(0, 3)], 0),
            submit(0, &[(1, 5)], 0),
            Op::Plan { launcher: 0 },
            submit(0, &[(0, 1)], 0),
            Op::Run { launcher: 0 },
            Op::Deliver { launcher: 0 },
            submit(0, &[(0, 3)], 0),
            Op::Release { pick: 0 },
        ];
        play(&fleet, 1, &ops).unwrap();
    }

    /// Two labels sharing two seats: a seat taken by `l0` left `{l1: 4}` unable to stand
    /// in `l1`'s queue, but nothing woke `{l1: 1}` behind it, which waited with a free
    /// slot of `l1` (a seat taken or freed now touches every label of its pool).
    #[test]
    fn a_seat_taken_by_one_label_wakes_the_queue_of_the_other() {
        let fleet = Fleet {
            labels: vec![(2, 2), (2, 2)],
            seats: Some(2),
        };
        let ops = [
            submit(0, &[(1, 4)], 100),
            submit(0, &[(1, 4)], 0),
            submit(0, &[(0, 1)], 0),
            Op::Tick { ms: 30_000 },
            Op::Plan { launcher: 0 },
            submit(0, &[(0, 1)], 0),
            submit(0, &[(1, 1)], 0),
            Op::Run { launcher: 0 },
            submit(0, &[(1, 1)], 100),
            Op::Release { pick: 0 },
        ];
        play(&fleet, 1, &ops).unwrap();
    }

    /// Mixes tried per run: 256 in the suite; `SLOTPOOL_MIX_CASES=100000` for a long run.
    fn cases() -> u32 {
        std::env::var("SLOTPOOL_MIX_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(256)
    }

    #[test]
    fn any_mix_makes_progress_and_books_nothing_twice() {
        use proptest::test_runner::{TestCaseError, TestRunner};
        use std::cell::Cell;
        let (longest, steps) = (Cell::new(0u32), Cell::new(0u64));
        let ended = Cell::new((0usize, 0usize, 0usize));
        let mut runner = TestRunner::new(ProptestConfig {
            cases: cases(),
            // A failure shrinks to a minimal case, which is kept as a test of its own.
            failure_persistence: None,
            ..ProptestConfig::default()
        });
        let outcome = runner.run(&case(), |(fleet, launchers, ops)| {
            let m = play(&fleet, launchers, &ops).map_err(TestCaseError::fail)?;
            longest.set(longest.get().max(m.longest));
            steps.set(steps.get() + m.steps);
            let (f, o, e) = m.tally();
            let (tf, to, te) = ended.get();
            ended.set((tf + f, to + o, te + e));
            Ok(())
        });
        if let Err(err) = outcome {
            panic!("{err}");
        }
        let (fulfilled, open, other) = ended.get();
        eprintln!(
            "{} mixes: {fulfilled} requests fulfilled, {open} left waiting (none of them \
             servable), {other} canceled or failed; {} worker steps, the longest run without \
             waiting {} (bound {STEP_BOUND})",
            cases(),
            steps.get(),
            longest.get()
        );
    }
}
