//! The launcher's mirror of KV: every request, slot, backing node, agent heartbeat and
//! lease, kept current by watches. It is a cache, never the truth: every decision taken
//! from it is written back with a revision check, and a lost check means "re-read".
//!
//! Besides the mirror it holds one piece of local bookkeeping: slots this launcher is
//! about to claim (`reserved`), so two of its own workers do not race for the same key.
//!
//! What each backing node offers its label is kept indexed ([`capacity`]), so that
//! handing out a slot or counting capacity does not walk every backing node. The index
//! is updated by the methods that change what it depends on (backing nodes, agents,
//! slots, reservations): change the mirror only through them.

mod agent;
pub mod capacity;
pub mod queue;
pub mod released;
pub mod seats;

pub use agent::{agent_ok, AgentReport, SlotLoginPlan};

use capacity::{CapacityIndex, Offer, Standing};
pub use queue::QueuePosition;
use queue::{Entry, Queue, Share, SET_PATIENCE_MS};
use slotpool_config::tenants::Tenants;
use slotpool_config::warm::Arrivals;
use slotpool_config::Config;
use slotpool_protocol::layout::{self, parse_slot_key, LeaseOf};
use slotpool_protocol::model::{
    BackingNode, HeartbeatGist, IdleBehaviour, Lease, Node, NodeRequest, NodeState, RequestState,
    DEFAULT_HEARTBEAT_TTL_SECS,
};
use slotpool_protocol::store::Versioned;
use slotpool_protocol::time::{now_ms, UnixMillis};
use slotpool_protocol::{BackingId, LauncherId, NodeId, RequestId, UserName};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

/// How many open seats of one packing rank a claim looks across for the slot free the
/// longest. Backing nodes equally full are equally good to pack; looking across a few
/// of them lets a slot just released warm up again before it is handed out (a client
/// that allocates and releases one node at a time would otherwise get the same few
/// slots of one node back, each still warming), while a claim still costs no more than
/// this many nodes' slots when thousands of empty nodes tie.
pub const TIED_SEATS: usize = 4;

/// A backing node together with what is known about it.
#[derive(Clone, Debug)]
pub struct BackingView {
    pub seat_key: String,
    pub record: Versioned<BackingNode>,
}

/// Where a free slot is.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotRef {
    pub backing_id: BackingId,
    pub seat_key: String,
    pub slot: u32,
}

impl SlotRef {
    pub fn key(&self) -> String {
        layout::slot_key(&self.backing_id, self.slot)
    }
}

/// A bucket whose records a launcher also puts into its mirror from its own
/// acknowledged writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Watched {
    Requests,
    Slots,
    Backing,
}

/// The highest revision each bucket's watch has delivered. A watch delivers in revision
/// order (a reload from the current values may go back, never past a revision it
/// skipped), so the mirror holds every record up to the mark as the watch brought it,
/// or a later one. A launcher's own write acknowledged at or below the mark has been
/// overtaken (say a request it wrote was canceled meanwhile, and the mirror let the
/// finished request go), and is not put in: it would bring back a record KV no longer
/// holds, for good.
#[derive(Default)]
struct Delivered {
    requests: u64,
    slots: u64,
    backing: u64,
}

#[derive(Default)]
pub struct World {
    /// Requests that are open or hold nodes. A finished one
    /// ([`NodeRequest::is_finished`]) leaves at once: its record stays in KV for its
    /// TTL, for its client's status call, but a launcher has nothing left to do with
    /// it, so the mirror does not grow with the requests served.
    pub requests: HashMap<RequestId, Versioned<NodeRequest>>,
    /// Requests seen finished, until the watch brings that revision (or a later one):
    /// an older revision the watch delivers meanwhile must not bring the request back,
    /// and the echo of this launcher's own write still has its effects. Holds only
    /// writes whose echo is in flight.
    finished: HashMap<RequestId, Versioned<NodeRequest>>,
    /// The highest revision each bucket's watch has delivered ([`World::watch_delivered`]).
    delivered: Delivered,
    /// Slot key → node.
    pub slots: HashMap<String, Versioned<Node>>,
    pub node_keys: HashMap<NodeId, String>,
    pub nodes_by_request: HashMap<RequestId, BTreeSet<String>>,
    /// Backing id → slot indexes in use.
    pub used: HashMap<BackingId, BTreeSet<u32>>,
    /// Backing id → slot indexes whose node is being released (of `used`).
    releasing: HashMap<BackingId, BTreeSet<u32>>,
    /// Seat key → backing node.
    pub backing: HashMap<String, Versioned<BackingNode>>,
    pub seat_of: HashMap<BackingId, String>,
    pub agents: HashMap<BackingId, AgentReport>,
    pub leases: HashMap<String, Versioned<Lease>>,
    /// When a slot of each backing node was last returned (local clock).
    pub last_release: HashMap<BackingId, UnixMillis>,
    /// Heartbeats the mirror held and lost (expired, or gone in a reload): when, and the
    /// record's TTL. Kept until the agent heartbeats again or its backing node is gone.
    pub lost_heartbeats: HashMap<BackingId, LostHeartbeat>,
    /// Slot keys this launcher's workers are claiming right now.
    pub reserved: HashSet<String>,
    /// Requests of this launcher that last looked and found themselves behind others for
    /// a label's free slots ([`HeldBack::Behind`]), by label. What they wait behind ends
    /// with the claims of those ahead, which leave no slot free and so wake nobody; they
    /// are woken once a change leaves the label no free slot, to say what they wait for
    /// now.
    behind: HashMap<String, HashSet<RequestId>>,
    /// Nodes this launcher began to give back ([`World::give_back`]) that the mirror
    /// still holds: never prepared or handed out again, whatever record it holds.
    pub given_back: HashSet<NodeId>,
    /// Slot key → revision of its tombstone, for free slots whose deletion was seen: a
    /// claim writes over it in one round trip ([`slotpool_protocol::store::Store::create_over`]).
    pub tombstones: HashMap<String, u64>,
    /// Requests not yet fulfilled, failed or canceled: fulfilled ones holding their
    /// nodes stay in `requests`, and demand must not be counted by walking all of them.
    pub open_requests: HashSet<RequestId>,
    /// Fulfilled requests holding their nodes until a deadline (a keep-alive or a
    /// label's max-hold-time): each needs a driver, its timer.
    pub held_requests: HashSet<RequestId>,
    /// Slot keys whose record cannot be read → its revision. Such a slot counts as in
    /// use (in `used`): it is never handed out, and no claim is tried on it.
    pub unreadable_slots: HashMap<String, u64>,
    /// Seat keys whose backing record cannot be read → its revision. Such a seat counts
    /// as taken: the planner never launches into it (its creation would conflict for
    /// ever), and nothing else is assumed about it.
    pub unreadable_seats: HashMap<String, u64>,
    /// Requests whose record cannot be read → its revision. They are out of
    /// `requests`; the slots claimed for them are released by the sweep.
    pub unreadable_requests: HashMap<RequestId, u64>,
    /// Slot key → the revision last seen and the server's time of its write: what
    /// the sweep judges a slot's age by, never a time inside the record.
    pub slot_written: HashMap<String, (u64, UnixMillis)>,
    /// Request key → the same, for the requests in `requests`.
    pub request_written: HashMap<String, (u64, UnixMillis)>,
    /// Heartbeat key (a backing id) → the same, for agents' heartbeats: how old the last
    /// one is (`/metrics`).
    pub heartbeat_written: HashMap<String, (u64, UnixMillis)>,
    /// The one queue of every launcher's requests ([`queue`]).
    queue: Queue,
    /// Labels whose free slots or queue changed since the last [`World::take_wakes`].
    touched: BTreeSet<String>,
    /// Labels whose backing nodes or agents changed since then: why a request of theirs
    /// waits may have changed (a node booting, a provider out of capacity), which its
    /// status says.
    causes_touched: BTreeSet<String>,
    /// The pools serving each label, for what can still be launched
    /// ([`World::attainable`]).
    pools: PoolBook,
    /// Seats taken (by a backing record, readable or not), by pool (`provider.pool`).
    seats_taken: HashMap<String, u32>,
    /// The teams sharing the pool, as configured.
    tenants: Tenants,
    /// Slots held, by (tenant, label) and by tenant.
    held: HashMap<(usize, String), u32>,
    held_total: HashMap<usize, u32>,
    /// Open requests (in `open_requests`), by tenant: what `max-waiting` bounds.
    open_by_tenant: HashMap<usize, u32>,
    /// When each tenant with a `max-submits-per-second` made its requests of the last
    /// second (every launcher's, as the mirror sees them), oldest first.
    submits: HashMap<usize, std::collections::VecDeque<UnixMillis>>,
    /// This launcher.
    pub me: Option<LauncherId>,
    /// The launchers holding their liveness lease, for [`World::lane`].
    live_launchers: BTreeSet<LauncherId>,
    /// What each backing node offers its label.
    capacity: CapacityIndex,
    /// Every request seen, finished or not, by label and creation time, for the labels
    /// that set a `warm-window` ([`slotpool_config::warm`]); set up from the config.
    pub arrivals: Arrivals,
    /// Empty ready nodes a backing decision kept only because requests of their label
    /// waited (`lifecycle::Observed::waiting`), by label: looked at again once the
    /// queue no longer keeps them ([`World::kept_for`]), since nothing else about them
    /// changes then.
    pub kept_for_queue: HashMap<String, BTreeSet<String>>,
    /// Nodes that left their slots lately, with their clients: a release sent again
    /// is answered as the first was.
    pub released: released::Released,
}

/// The pools serving each label, as the configuration has them: what
/// [`World::attainable`] counts as still launchable.
#[derive(Debug, Default)]
pub struct PoolBook {
    /// Label → (pool key `provider.pool`, max-servers, slots of the label's largest
    /// size there).
    sites: HashMap<String, Vec<(String, u32, u32)>>,
}

impl PoolBook {
    pub fn of(config: &Config) -> PoolBook {
        let mut sites: HashMap<String, Vec<(String, u32, u32)>> = HashMap::new();
        for provider in &config.providers {
            for pool in &provider.pools {
                for label in &pool.labels {
                    sites.entry(label.name.clone()).or_default().push((
                        format!("{}.{}", provider.name, pool.name),
                        pool.max_servers,
                        label.largest().slots,
                    ));
                }
            }
        }
        PoolBook { sites }
    }

    /// The labels pool `pool` (`provider.pool`) serves.
    fn labels_in<'a>(&'a self, pool: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.sites
            .iter()
            .filter(move |(_, sites)| sites.iter().any(|(p, _, _)| p == pool))
            .map(|(label, _)| label.as_str())
    }

    fn sites<'a>(&'a self, label: &str) -> impl Iterator<Item = (&'a str, u32, u32)> + 'a {
        self.sites
            .get(label)
            .into_iter()
            .flatten()
            .map(|(pool, max, slots)| (pool.as_str(), *max, *slots))
    }
}

/// The key of backing node `b`'s pool in [`PoolBook`] and `World::seats_taken`.
fn pool_key(b: &BackingNode) -> String {
    format!("{}.{}", b.provider, b.pool)
}

/// A heartbeat the mirror lost ([`World::lost_heartbeats`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LostHeartbeat {
    /// When the mirror lost it (local clock).
    pub at: UnixMillis,
    /// The TTL the record had.
    pub ttl: Duration,
}

/// Why the queue, not the lack of slots, holds a request back ([`World::held_back`]).
#[derive(Clone, Debug, PartialEq)]
pub enum HeldBack {
    TenantLimit { tenant: String, max_slots: u32 },
    Behind { requests: u32 },
}

/// A hard limit of a tenant that a submit would pass ([`World::admits`]).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum OverLimit {
    #[error("tenant {tenant:?} has {max} requests waiting, its max-waiting: let some end first")]
    Waiting { tenant: String, max: u32 },
    #[error("tenant {tenant:?} submits more than its max-submits-per-second of {max}: slow down and submit again")]
    Rate { tenant: String, max: f64 },
}

impl World {
    /// An empty mirror for launcher `me`, logging `arrivals`.
    pub fn of(me: LauncherId, arrivals: Arrivals) -> World {
        World {
            me: Some(me),
            arrivals,
            ..World::default()
        }
    }

    /// An empty mirror for launcher `me` under `config`.
    pub fn for_config(me: LauncherId, config: &Config) -> World {
        World {
            pools: PoolBook::of(config),
            tenants: config.tenants.clone(),
            ..World::of(me, Arrivals::of(config))
        }
    }

    // ---- applying watch changes ------------------------------------------------------

    // Writers apply their own successful writes at once, and the watch delivers them
    // again later: a change older than what is held is ignored.

    pub fn put_request(&mut self, r: Versioned<NodeRequest>) {
        self.arrivals.note(
            r.value.id.as_str(),
            r.value.client.as_ref(),
            &r.value.labels,
            r.value.created_at,
        );
        if r.revision <= self.delivered.requests
            || self
                .requests
                .get(&r.value.id)
                .is_some_and(|old| old.revision >= r.revision)
            || self
                .unreadable_requests
                .get(&r.value.id)
                .is_some_and(|rev| *rev >= r.revision)
            || self.finished_at(r.value.id.as_str(), r.revision).is_some()
        {
            return;
        }
        self.unreadable_requests.remove(&r.value.id);
        if r.value.is_finished() {
            let id = r.value.id.clone();
            self.request_written.remove(&r.key);
            self.forget_request(&id);
            self.finished.insert(id, r);
            return;
        }
        self.finished.remove(&r.value.id);
        let tenant = self.tenants.of(r.value.client.as_ref());
        if !self.requests.contains_key(&r.value.id) {
            self.note_submit(tenant, r.value.created_at);
        }
        if r.value.state == RequestState::Requested {
            if self.open_requests.insert(r.value.id.clone()) {
                *self.open_by_tenant.entry(tenant).or_default() += 1;
            }
        } else if self.open_requests.remove(&r.value.id) {
            self.close_of(tenant);
        }
        if r.value.hold_deadline().is_some() {
            self.held_requests.insert(r.value.id.clone());
        } else {
            self.held_requests.remove(&r.value.id);
        }
        let id = r.value.id.clone();
        self.requests.insert(id.clone(), r);
        self.requeue(&id);
    }

    pub fn remove_request(&mut self, key: &str, revision: u64) {
        if let Ok(id) = RequestId::parse(key) {
            if self
                .unreadable_requests
                .get(&id)
                .is_some_and(|rev| *rev < revision)
            {
                self.unreadable_requests.remove(&id);
            }
            if self
                .finished
                .get(&id)
                .is_some_and(|r| r.revision < revision)
            {
                self.finished.remove(&id);
            }
            if self
                .requests
                .get(&id)
                .is_some_and(|old| old.revision < revision)
            {
                self.forget_request(&id);
            }
        }
    }

    /// The watch of `bucket` has brought a change at `revision` (`u64::MAX`, a key found
    /// gone when the watch reloaded, is no revision). Called only by the watch, once the
    /// change is applied: a launcher's own writes never move the mark.
    pub fn watch_delivered(&mut self, bucket: Watched, revision: u64) {
        if revision == u64::MAX {
            return;
        }
        let mark = match bucket {
            Watched::Requests => &mut self.delivered.requests,
            Watched::Slots => &mut self.delivered.slots,
            Watched::Backing => &mut self.delivered.backing,
        };
        *mark = (*mark).max(revision);
    }

    /// The watch has brought revision `revision` of request `key` (decoded or not):
    /// a request that finished at that revision or an older one needs no tombstone any
    /// more, since the watch will bring nothing older. Whether the mirror holds the
    /// request (or its unreadable record) now.
    pub fn request_delivered(&mut self, key: &str, revision: u64) -> bool {
        if self
            .finished
            .get(key)
            .is_some_and(|r| r.revision <= revision)
        {
            self.finished.remove(key);
            self.request_written.remove(key);
        }
        self.requests.contains_key(key) || self.unreadable_requests.contains_key(key)
    }

    /// Takes request `id` out of the mirror and its queues.
    fn forget_request(&mut self, id: &RequestId) {
        for behind in self.behind.values_mut() {
            behind.remove(id);
        }
        let gone = self.requests.remove(id);
        if self.open_requests.remove(id) {
            let tenant = self
                .tenants
                .of(gone.as_ref().and_then(|r| r.value.client.as_ref()));
            self.close_of(tenant);
        }
        self.held_requests.remove(id);
        self.requeue(id);
    }

    /// Request `key` as it finished, if it did at `revision` or later and the watch
    /// has not brought that revision yet (it left `requests` then).
    pub fn finished_at(&self, key: &str, revision: u64) -> Option<&Versioned<NodeRequest>> {
        self.finished.get(key).filter(|r| r.revision >= revision)
    }

    /// Notes that request `key` holds a record that cannot be read at `revision`: it
    /// leaves the mirror. True the first time this revision is seen (to log it once).
    pub fn put_unreadable_request(&mut self, key: &str, revision: u64) -> bool {
        let Ok(id) = RequestId::parse(key) else {
            return false;
        };
        if self
            .requests
            .get(&id)
            .is_some_and(|r| r.revision >= revision)
            || self
                .unreadable_requests
                .get(&id)
                .is_some_and(|rev| *rev >= revision)
            || self.finished_at(key, revision).is_some()
        {
            return false;
        }
        self.finished.remove(&id);
        self.forget_request(&id);
        self.unreadable_requests.insert(id, revision);
        true
    }

    /// Notes that seat `key` holds a backing record that cannot be read at `revision`:
    /// the seat counts as taken until a readable record or a deletion replaces it. True
    /// the first time this revision is seen (to log it once).
    pub fn put_unreadable_seat(&mut self, key: &str, revision: u64) -> bool {
        if self
            .backing
            .get(key)
            .is_some_and(|b| b.revision >= revision)
            || self
                .unreadable_seats
                .get(key)
                .is_some_and(|rev| *rev >= revision)
        {
            return false;
        }
        self.remove_backing(key, revision);
        self.unreadable_seats.insert(key.to_string(), revision);
        true
    }

    /// The seats of `provider`'s `pool` whose record cannot be read.
    pub fn unreadable_seats_of(&self, provider: &str, pool: &str) -> HashSet<u32> {
        let prefix = format!("{provider}.{pool}.");
        self.unreadable_seats
            .keys()
            .filter_map(|k| k.strip_prefix(&prefix)?.parse().ok())
            .collect()
    }

    /// Notes that slot `key` holds a record that cannot be read at `revision`: the slot
    /// counts as in use until a readable record or a deletion replaces it. True the
    /// first time this revision is seen (to log it once).
    pub fn put_unreadable_slot(&mut self, key: &str, revision: u64) -> bool {
        let Some((backing, slot)) = parse_slot_key(key) else {
            return false;
        };
        if self.slots.get(key).is_some_and(|n| n.revision >= revision)
            || self
                .unreadable_slots
                .get(key)
                .is_some_and(|rev| *rev >= revision)
        {
            return false;
        }
        self.unindex_slot(key);
        self.reserved.remove(key);
        self.tombstones.remove(key);
        self.unreadable_slots.insert(key.to_string(), revision);
        self.used.entry(backing.clone()).or_default().insert(slot);
        self.restand_backing(&backing);
        true
    }

    /// Forgets that slot `key` was unreadable, unless `revision` is older than that.
    /// False when the unreadable record is newer.
    fn forget_unreadable_slot(&mut self, key: &str, revision: u64) -> bool {
        match self.unreadable_slots.get(key) {
            None => true,
            Some(rev) if *rev >= revision => false,
            Some(_) => {
                self.unreadable_slots.remove(key);
                if let Some((backing, slot)) = parse_slot_key(key) {
                    if let Some(set) = self.used.get_mut(&backing) {
                        set.remove(&slot);
                        if set.is_empty() {
                            self.used.remove(&backing);
                        }
                    }
                    self.restand_backing(&backing);
                }
                true
            }
        }
    }

    pub fn put_slot(&mut self, n: Versioned<Node>) {
        let key = n.key.clone();
        // A record older than the slot's deletion (a claim given back meanwhile) would
        // bring back a node nobody holds.
        if n.revision <= self.delivered.slots
            || self
                .tombstones
                .get(&key)
                .is_some_and(|gone| *gone >= n.revision)
        {
            return;
        }
        if !self.forget_unreadable_slot(&key, n.revision) {
            return;
        }
        if let Some(old) = self.slots.get(&key) {
            if old.revision >= n.revision {
                return;
            }
            if old.value.id != n.value.id {
                self.unindex_slot(&key);
            }
        }
        // A new node in the slot (not a later revision of the one there).
        let fresh = !self.slots.contains_key(&key);
        self.node_keys.insert(n.value.id.clone(), key.clone());
        self.nodes_by_request
            .entry(n.value.request_id.clone())
            .or_default()
            .insert(key.clone());
        self.used
            .entry(n.value.backing_id.clone())
            .or_default()
            .insert(n.value.slot);
        let releasing = self
            .releasing
            .entry(n.value.backing_id.clone())
            .or_default();
        if n.value.state == NodeState::Releasing {
            releasing.insert(n.value.slot);
        } else {
            releasing.remove(&n.value.slot);
            if releasing.is_empty() {
                self.releasing.remove(&n.value.backing_id);
            }
        }
        self.reserved.remove(&key);
        self.tombstones.remove(&key);
        let backing = n.value.backing_id.clone();
        let request = n.value.request_id.clone();
        self.touched.insert(n.value.label.clone());
        if fresh {
            self.hold(&n.value, true);
        }
        self.slots.insert(key, n);
        self.restand_backing(&backing);
        self.requeue(&request);
    }

    pub fn remove_slot(&mut self, key: &str, revision: u64) {
        if self.unreadable_slots.contains_key(key) {
            if self.forget_unreadable_slot(key, revision) && revision != u64::MAX {
                self.tombstones.insert(key.to_string(), revision);
            }
            return;
        }
        match self.slots.get(key) {
            Some(old) if old.revision >= revision => return,
            // A tombstone of a slot never seen in use (the first load after a start).
            None => {
                if revision != u64::MAX {
                    self.tombstones.insert(key.to_string(), revision);
                }
                return;
            }
            Some(_) => {}
        }
        self.unindex_slot(key);
        if revision != u64::MAX {
            self.tombstones.insert(key.to_string(), revision);
        }
        if let Some((backing, _)) = parse_slot_key(key) {
            self.last_release.insert(backing, now_ms());
        }
    }

    /// Notes that this launcher began to give node `id` back ([`crate::release`]):
    /// from now on it is never prepared or handed out again, even while the mirror still
    /// holds an older record of it (the write marking it releasing may have timed out, or
    /// the watch that would bring it back be away). Forgotten once the mirror drops the
    /// node.
    pub fn give_back(&mut self, id: &NodeId) {
        if self.node_keys.contains_key(id) {
            self.given_back.insert(id.clone());
        }
    }

    fn unindex_slot(&mut self, key: &str) {
        let Some(old) = self.slots.remove(key) else {
            return;
        };
        let node = old.value;
        self.released
            .note(node.id.clone(), node.client.clone(), now_ms());
        self.given_back.remove(&node.id);
        self.node_keys.remove(&node.id);
        if let Some(set) = self.nodes_by_request.get_mut(&node.request_id) {
            set.remove(key);
            if set.is_empty() {
                self.nodes_by_request.remove(&node.request_id);
            }
        }
        for index in [&mut self.used, &mut self.releasing] {
            if let Some(set) = index.get_mut(&node.backing_id) {
                set.remove(&node.slot);
                if set.is_empty() {
                    index.remove(&node.backing_id);
                }
            }
        }
        self.restand_backing(&node.backing_id);
        self.hold(&node, false);
        self.touched.insert(node.label);
        self.requeue(&node.request_id);
    }

    /// Counts node `n`'s slot as held by its tenant (or no more). A tenant with a
    /// `max-slots` that gives one back may take a slot of any label it waits for now.
    fn hold(&mut self, n: &Node, held: bool) {
        let tenant = self.tenants.of(n.client.as_ref());
        for count in [
            self.held.entry((tenant, n.label.clone())).or_default(),
            self.held_total.entry(tenant).or_default(),
        ] {
            if held {
                *count += 1;
            } else {
                *count = count.saturating_sub(1);
            }
        }
        if !held && self.tenants.get(tenant).max_slots.is_some() {
            let labels = self.queue.labels_of_tenant(tenant);
            self.touched.extend(labels);
        }
    }

    /// Brings request `id`'s place in the [`queue`] up to date: for every label it is
    /// still short of, how many nodes it needs, while it is open.
    fn requeue(&mut self, id: &RequestId) {
        let Some(r) = self
            .requests
            .get(id)
            .filter(|_| self.open_requests.contains(id))
        else {
            let changed = self.queue.remove(id);
            self.touched.extend(changed);
            return;
        };
        let r = &r.value;
        let mut needs: Vec<(String, u32)> = Vec::new();
        for label in &r.labels {
            if needs.iter().any(|(l, _)| l == label) {
                continue;
            }
            let want = r.labels.iter().filter(|l| *l == label).count() as u32;
            let have = self
                .nodes_of(id)
                .iter()
                .filter(|n| &n.value.label == label)
                .count() as u32;
            if have < want {
                needs.push((label.clone(), want - have));
            }
        }
        let pos: QueuePosition = (r.priority, r.created_at, r.id.clone());
        let tenant = self.tenants.of(r.client.as_ref());
        let changed = self
            .queue
            .put(id, pos, r.owner.clone(), r.labels.len() > 1, tenant, needs);
        self.touched.extend(changed);
    }

    pub fn put_backing(&mut self, b: Versioned<BackingNode>) {
        if b.revision <= self.delivered.backing {
            return;
        }
        match self.unreadable_seats.get(&b.key) {
            Some(rev) if *rev >= b.revision => return,
            Some(_) => {
                self.unreadable_seats.remove(&b.key);
            }
            None => {}
        }
        if let Some(old) = self.backing.get(&b.key) {
            if old.revision >= b.revision {
                return;
            }
            if old.value.id != b.value.id {
                self.seat_of.remove(&old.value.id);
            }
            self.touched.insert(old.value.label.clone());
            self.causes_touched.insert(old.value.label.clone());
        } else {
            let pool = pool_key(&b.value);
            *self.seats_taken.entry(pool.clone()).or_default() += 1;
            self.touch_pool(&pool);
        }
        self.touched.insert(b.value.label.clone());
        self.causes_touched.insert(b.value.label.clone());
        self.seat_of.insert(b.value.id.clone(), b.key.clone());
        let seat = b.key.clone();
        self.backing.insert(b.key.clone(), b);
        self.restand(&seat);
    }

    pub fn remove_backing(&mut self, key: &str, revision: u64) {
        if self
            .unreadable_seats
            .get(key)
            .is_some_and(|rev| *rev < revision)
        {
            self.unreadable_seats.remove(key);
        }
        if self
            .backing
            .get(key)
            .is_none_or(|old| old.revision >= revision)
        {
            return;
        }
        if let Some(old) = self.backing.remove(key) {
            self.touched.insert(old.value.label.clone());
            self.causes_touched.insert(old.value.label.clone());
            self.take_seat_back(&pool_key(&old.value));
            self.seat_of.remove(&old.value.id);
            self.lost_heartbeats.remove(&old.value.id);
            for slot in 0..old.value.slots {
                self.tombstones
                    .remove(&layout::slot_key(&old.value.id, slot));
            }
        }
        self.restand(key);
    }

    /// Applies a heartbeat; true when it changed what decides whether the node gets
    /// slots (most heartbeats change nothing and cost no copy).
    pub fn put_agent(&mut self, hb: HeartbeatGist<'_>) -> bool {
        let Ok(id) = BackingId::parse(&hb.backing_id) else {
            return false;
        };
        if self
            .agents
            .get(&id)
            .is_some_and(|a| a.says_the_same_as(&hb))
        {
            return false;
        }
        self.lost_heartbeats.remove(&id);
        self.agents.insert(id.clone(), hb.into());
        self.restand_backing(&id);
        self.touch_backing(&id);
        true
    }

    /// Applies a lease; true when a launcher came alive (the planner may change).
    pub fn put_lease(&mut self, lease: Versioned<Lease>) -> bool {
        let mut came = false;
        if let Some(LeaseOf::Launcher(id)) = layout::parse_lease_key(&lease.key) {
            if self.live_launchers.insert(id) {
                self.touch_every_queue();
                came = true;
            }
        }
        self.leases.insert(lease.key.clone(), lease);
        came
    }

    /// Removes a lease; true when it was a launcher's liveness (the planner may change).
    pub fn remove_lease(&mut self, key: &str) -> bool {
        let mut went = false;
        if let Some(LeaseOf::Launcher(id)) = layout::parse_lease_key(key) {
            if self.live_launchers.remove(&id) {
                self.touch_every_queue();
                went = true;
            }
        }
        self.leases.remove(key);
        went
    }

    /// Every queue's order of who stands changes with the launchers alive.
    fn touch_every_queue(&mut self) {
        let labels: Vec<String> = self.queue.labels().map(String::from).collect();
        self.touched.extend(labels);
    }

    /// The label of backing node `id` has new capacity to look at, and perhaps a new
    /// reason to wait.
    fn touch_backing(&mut self, id: &BackingId) {
        if let Some(b) = self.backing_by_id(id) {
            let label = b.value.label.clone();
            self.touched.insert(label.clone());
            self.causes_touched.insert(label);
        }
    }

    /// A seat of pool `pool` is free again.
    fn take_seat_back(&mut self, pool: &str) {
        if let Some(n) = self.seats_taken.get_mut(pool) {
            *n -= 1;
            if *n == 0 {
                self.seats_taken.remove(pool);
            }
        }
        self.touch_pool(pool);
    }

    /// Marks every label `pool` serves as changed: a seat taken or freed there changes
    /// what each of them can still launch ([`World::attainable`]), so whether their node
    /// sets stand.
    fn touch_pool(&mut self, pool: &str) {
        let labels: Vec<String> = self.pools.labels_in(pool).map(str::to_string).collect();
        self.touched.extend(labels);
    }

    pub fn remove_agent(&mut self, key: &str) {
        if let Ok(id) = BackingId::parse(key) {
            if let Some(old) = self.agents.remove(&id) {
                let ttl_secs = old.ttl_secs.unwrap_or(DEFAULT_HEARTBEAT_TTL_SECS);
                self.lost_heartbeats.insert(
                    id.clone(),
                    LostHeartbeat {
                        at: now_ms(),
                        ttl: Duration::from_secs(ttl_secs),
                    },
                );
                self.restand_backing(&id);
                self.touch_backing(&id);
            }
        }
    }

    // ---- the capacity index -----------------------------------------------------------

    /// What the backing node `b` offers its label now ([`capacity::offer`]).
    fn offer(&self, b: &BackingNode) -> Offer {
        capacity::offer(
            b,
            self.takes_slots(b).then(|| {
                let used = self.used_count(&b.id);
                capacity::Use {
                    used,
                    held: self.held_count(&b.id),
                    open: used < b.slots && self.first_free(b).is_some(),
                }
            }),
            !self.agents.contains_key(&b.id) && !self.lost_heartbeats.contains_key(&b.id),
        )
    }

    /// Brings the index up to date for the seat `seat`.
    fn restand(&mut self, seat: &str) {
        let standing = self.backing.get(seat).map(|b| Standing {
            label: b.value.label.clone(),
            offer: self.offer(&b.value),
        });
        self.capacity.set(seat, standing);
    }

    /// Brings the index up to date for the backing node `id`, if it has a seat.
    fn restand_backing(&mut self, id: &BackingId) {
        if let Some(seat) = self.seat_of.get(id).cloned() {
            self.restand(&seat);
        }
    }

    // ---- questions -------------------------------------------------------------------

    pub fn backing_by_id(&self, id: &BackingId) -> Option<&Versioned<BackingNode>> {
        self.backing.get(self.seat_of.get(id)?)
    }

    pub fn used_count(&self, id: &BackingId) -> u32 {
        self.used.get(id).map_or(0, |s| s.len() as u32)
    }

    /// Slots of backing node `id` holding a node that is not being released: what it
    /// is packed by ([`capacity::packing_rank`]).
    pub fn held_count(&self, id: &BackingId) -> u32 {
        let releasing = self.releasing.get(id).map_or(0, |s| s.len() as u32);
        self.used_count(id).saturating_sub(releasing)
    }

    /// Whether new slots may go to this backing node now.
    pub fn takes_slots(&self, b: &BackingNode) -> bool {
        b.state.takes_slots() && b.idle == IdleBehaviour::Run && agent_ok(b, self.agents.get(&b.id))
    }

    /// Nodes already claimed for a request.
    pub fn nodes_of(&self, request: &RequestId) -> Vec<&Versioned<Node>> {
        self.nodes_by_request
            .get(request)
            .map(|keys| keys.iter().filter_map(|k| self.slots.get(k)).collect())
            .unwrap_or_default()
    }

    /// This launcher's [`Lane`]: its place among the live launchers, by id.
    fn lane(&self) -> Lane {
        match &self.me {
            Some(me) => self.lane_of(me),
            None => Lane::ALONE,
        }
    }

    /// Whether this launcher is the planner, the one that takes seats for the queue and
    /// `min-ready` (`backing::planner::plan`): the live launcher with the lowest id, this
    /// one counted live. Planners each deciding from a mirror that lags the other's seats
    /// by a watch's delay would both launch for one deficit (a seat taken is a
    /// create-if-absent, but a seat the other is freeing meanwhile is free for one and
    /// taken for the other); one planner's mirror holds its own seats at once. When it
    /// dies, the next launcher plans once its liveness lease is gone.
    pub fn is_planner(&self) -> bool {
        self.lane().index == 0
    }

    /// The [`Lane`] of launcher `id` (this one, or a live one).
    fn lane_of(&self, id: &LauncherId) -> Lane {
        let me_too = self
            .me
            .as_ref()
            .filter(|me| !self.live_launchers.contains(*me));
        let index = self.live_launchers.range::<LauncherId, _>(..id).count()
            + usize::from(me_too.is_some_and(|me| me < id));
        let count = self.live_launchers.len() + usize::from(me_too.is_some());
        Lane { index, count }
    }

    /// The one queue of every launcher's requests.
    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    /// Whether request `id` stands in the queue for `label`.
    pub fn is_short_of(&self, id: &RequestId, label: &str) -> bool {
        self.queue.is_short_of(id, label)
    }

    /// Whether a request driven by `owner` is driven by this launcher or another alive
    /// now: a request whose launcher is gone waits for a launcher to take it over.
    fn driven(&self, owner: Option<&LauncherId>) -> bool {
        owner.is_some_and(|o| {
            Some(o) == self.me.as_ref() || self.leases.contains_key(&layout::launcher_lease_key(o))
        })
    }

    /// Whether the queue entry at `pos` keeps the free slots it needs from the requests
    /// behind it at `now` ([`queue`]: a single node at once, a node set once it waited
    /// its patience and can be held at all).
    fn stands(&self, pos: &QueuePosition, e: &Entry, now: UnixMillis) -> bool {
        if !self.driven(e.owner.as_ref()) {
            return false;
        }
        if !e.set {
            return true;
        }
        now >= pos.1.saturating_add(SET_PATIENCE_MS)
            && self.queue.place_of(&pos.2).is_some_and(|place| {
                place
                    .needs
                    .iter()
                    .all(|(label, need)| *need <= self.attainable(label))
            })
    }

    /// The tenant of request `r` (by its client).
    pub fn tenant_of(&self, r: &NodeRequest) -> usize {
        self.tenants.of(r.client.as_ref())
    }

    /// The teams sharing the pool, as configured.
    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// Slots tenant `tenant` holds, and its open requests.
    pub fn tenant_load(&self, tenant: usize) -> (u32, u32) {
        (
            self.held_total.get(&tenant).copied().unwrap_or(0),
            self.open_by_tenant.get(&tenant).copied().unwrap_or(0),
        )
    }

    /// One open request of `tenant` fewer.
    fn close_of(&mut self, tenant: usize) {
        if let Some(open) = self.open_by_tenant.get_mut(&tenant) {
            *open = open.saturating_sub(1);
        }
    }

    /// Notes a request of `tenant` made at `at`, if its submits are counted.
    fn note_submit(&mut self, tenant: usize, at: UnixMillis) {
        if self.tenants.get(tenant).max_submits_per_second.is_none() {
            return;
        }
        let log = self.submits.entry(tenant).or_default();
        let place = log.partition_point(|t| *t <= at);
        log.insert(place, at);
        let newest = log.back().copied().unwrap_or(at);
        while log.front().is_some_and(|t| *t + 1_000 <= newest) {
            log.pop_front();
        }
    }

    /// Why the request of tenant `tenant` at `pos` gets no slot of `label` at `now`, when
    /// it is the queue and not the lack of slots: its tenant is at `max-slots` (with the
    /// slots its own requests before it take), or there are free slots but requests
    /// served before it take them all (how many).
    pub fn held_back(
        &self,
        tenant: usize,
        pos: &QueuePosition,
        label: &str,
        now: UnixMillis,
    ) -> Option<HeldBack> {
        let shares = self.shares(label);
        let free = self.capacity.free(label);
        let (mut ahead, mut mine, mut taken) = (0u32, 0u32, 0u32);
        for served in self.order(label, &shares, Some((tenant, pos)), now) {
            if served.stands {
                ahead += 1;
                taken += served.entry.need;
                if served.entry.tenant == tenant {
                    mine += served.entry.need;
                }
            }
        }
        let t = self.tenants.get(tenant);
        if let (Some(max), Some(room)) = (t.max_slots, shares[tenant].room) {
            if mine >= room {
                return Some(HeldBack::TenantLimit {
                    tenant: t.name.clone(),
                    max_slots: max,
                });
            }
        }
        (free > 0 && taken >= free && ahead > 0).then_some(HeldBack::Behind { requests: ahead })
    }

    /// Whether client `client` may submit one more request at `now`: its tenant's hard
    /// limits (`max-waiting`, `max-submits-per-second`), counted over every launcher's
    /// requests as the mirror holds them. A submit another launcher took a moment ago
    /// may not be seen yet: the limits hold across launchers within the bus's delay.
    pub fn admits(&self, client: Option<&UserName>, now: UnixMillis) -> Result<(), OverLimit> {
        let index = self.tenants.of(client);
        let tenant = self.tenants.get(index);
        if let Some(max) = tenant.max_waiting {
            let open = self.open_by_tenant.get(&index).copied().unwrap_or(0);
            if open >= max {
                return Err(OverLimit::Waiting {
                    tenant: tenant.name.clone(),
                    max,
                });
            }
        }
        if let Some(max) = tenant.max_submits_per_second {
            let recent = self.submits.get(&index).map_or(0, |log| {
                log.iter().rev().take_while(|t| **t + 1_000 > now).count()
            });
            if recent as f64 >= max {
                return Err(OverLimit::Rate {
                    tenant: tenant.name.clone(),
                    max,
                });
            }
        }
        Ok(())
    }

    /// Each tenant's weight, guarantee and holdings of `label`, and its room left under
    /// `max-slots`, for walking the label's queue.
    fn shares(&self, label: &str) -> Vec<Share> {
        self.tenants
            .iter()
            .enumerate()
            .map(|(i, t)| Share {
                weight: t.weight,
                guaranteed: t.guaranteed(label),
                held: self.held.get(&(i, label.to_string())).copied().unwrap_or(0),
                guaranteed_total: t.guaranteed_slots,
                held_total: self.held_total.get(&i).copied().unwrap_or(0),
                room: t
                    .max_slots
                    .map(|max| max.saturating_sub(self.held_total.get(&i).copied().unwrap_or(0))),
            })
            .collect()
    }

    /// `label`'s queue in serving order at `now` ([`Queue::order`]), up to the request
    /// of tenant `tenant` at `pos` if given.
    fn order<'a>(
        &'a self,
        label: &str,
        shares: &[Share],
        stop: Option<(usize, &'a QueuePosition)>,
        now: UnixMillis,
    ) -> queue::Order<'a, impl Fn(&QueuePosition, &Entry) -> bool + 'a> {
        self.queue
            .order(label, shares, stop, move |pos, e| self.stands(pos, e, now))
    }

    /// The most slots of `label` one request could hold at once: those of its backing
    /// nodes taking slots or booting, and of those still launchable into the free seats
    /// of the pools serving it (at the largest size).
    pub fn attainable(&self, label: &str) -> u32 {
        let launchable: u32 = self
            .pools
            .sites(label)
            .map(|(pool, max_servers, slots)| {
                let taken = self.seats_taken.get(pool).copied().unwrap_or(0);
                max_servers.saturating_sub(taken).saturating_mul(slots)
            })
            .fold(0u32, u32::saturating_add);
        self.capacity.total(label).saturating_add(launchable)
    }

    /// Whether `need` slots of `label` are free for the request of tenant `tenant` at
    /// `pos` at `now`, beyond what the standing requests before it in the serving order
    /// need, and its tenant has room for them (counting every slot not in use: an upper
    /// bound of what can be handed out).
    fn fits(
        &self,
        tenant: usize,
        pos: &QueuePosition,
        label: &str,
        need: u32,
        now: UnixMillis,
    ) -> bool {
        let mut avail = self.capacity.free(label);
        if avail < need {
            return false;
        }
        let shares = self.shares(label);
        let mut mine = 0;
        for served in self.order(label, &shares, Some((tenant, pos)), now) {
            if served.stands {
                avail = avail.saturating_sub(served.entry.need);
                if avail < need {
                    return false;
                }
                if served.entry.tenant == tenant {
                    mine += served.entry.need;
                }
            }
        }
        shares[tenant].room.is_none_or(|room| mine + need <= room)
    }

    /// Requests of a live launcher waiting for `label` since `min_age` ms before `now`
    /// that the free slots could serve now in the queue's order ([`World::each_fitting`]):
    /// one that stays means no launcher acts on it. Asked when metrics are scraped.
    pub fn servable_waiting(&self, label: &str, now: UnixMillis, min_age: u64) -> u32 {
        let mut servable = 0;
        self.each_fitting(label, now, |pos, e| {
            if now.saturating_sub(pos.1) >= min_age && self.driven(e.owner.as_ref()) {
                servable += 1;
            }
        });
        servable
    }

    /// Marks every label as changed, for the next [`World::take_wakes`] (after a start
    /// or a reload).
    pub fn touch_all(&mut self) {
        self.touch_every_queue();
    }

    /// Notes that request `id` looked and found itself behind others for `label`'s free
    /// slots: it is woken once a change leaves the label no free slot
    /// ([`World::take_wakes`]).
    pub fn note_behind(&mut self, label: &str, id: &RequestId) {
        self.behind
            .entry(label.to_string())
            .or_default()
            .insert(id.clone());
    }

    /// This launcher's requests that could claim now ([`World::each_fitting`]), for
    /// every label whose free slots or queue changed since the last call (and the labels
    /// of the sets waiting for one of those); and all of its requests waiting for a label
    /// whose backing nodes or agents changed (their status may say something new); and
    /// those that last found themselves behind others for a changed label left with no
    /// free slot ([`World::note_behind`]).
    pub fn take_wakes(&mut self, now: UnixMillis) -> Vec<RequestId> {
        if self.touched.is_empty() && self.causes_touched.is_empty() {
            return Vec::new();
        }
        let mut wake: HashSet<RequestId> = HashSet::new();
        // A change of a label's backing nodes (rare, unlike its slots) may change why
        // its requests wait: every one of this launcher's is woken to say so.
        for label in std::mem::take(&mut self.causes_touched) {
            for (pos, e) in self.queue.of_label(&label) {
                if e.owner.is_some() && e.owner == self.me {
                    wake.insert(pos.2.clone());
                }
            }
        }
        let mut touched = std::mem::take(&mut self.touched);
        // A set that needs a touched label may stand differently in its other queues.
        let linked = self.queue.linked_labels(&touched);
        touched.extend(linked);
        for label in &touched {
            // Behind no more once no slot is left free (while some are, what they wait
            // behind still stands, and a flood behind a set stays asleep).
            if self.capacity.free(label) == 0 {
                if let Some(behind) = self.behind.remove(label) {
                    wake.extend(behind);
                }
            }
            self.each_fitting(label, now, |pos, e| {
                if e.owner.is_some() && e.owner == self.me {
                    wake.insert(pos.2.clone());
                }
            });
        }
        wake.into_iter().collect()
    }

    /// Calls `visit` with each request of `label`'s queue that the free slots could
    /// serve now in serving order (all it needs, of every label, fits): a walk from the
    /// head that ends where the standing requests have used up the free slots. Counts
    /// every slot not in use as free (an upper bound of what can be handed out).
    fn each_fitting(
        &self,
        label: &str,
        now: UnixMillis,
        mut visit: impl FnMut(&QueuePosition, &Entry),
    ) {
        let mut avail = self.capacity.free(label);
        if avail == 0 {
            return;
        }
        let shares = self.shares(label);
        for served in self.order(label, &shares, None, now) {
            let (pos, e) = (served.pos, served.entry);
            if !served.capped && e.need <= avail {
                let rest_fits = self.queue.place_of(&pos.2).is_some_and(|place| {
                    place
                        .needs
                        .iter()
                        .filter(|(l, _)| l != label)
                        .all(|(l, need)| self.fits(e.tenant, pos, l, *need, now))
                });
                if rest_fits {
                    visit(pos, e);
                }
            }
            if served.stands {
                avail = avail.saturating_sub(e.need);
                if avail == 0 {
                    break;
                }
            }
        }
    }

    /// Picks a free slot for `label` and reserves it, leaving the free slots that the
    /// standing requests ahead of `me` need ([`queue`]). Packs by
    /// [`capacity::packing_rank`]: the smallest usable backing node first, then the
    /// fullest, so big and emptier ones can go idle and be released.
    pub fn reserve_slot(
        &mut self,
        me: &QueuePosition,
        label: &str,
        now: UnixMillis,
    ) -> Option<SlotRef> {
        let tenant = self
            .queue
            .place_of(&me.2)
            .map_or(self.tenants.len() - 1, |p| p.tenant);
        self.reserve_slot_avoiding(tenant, me, label, |_| false, now)
    }

    /// [`World::reserve_slot`], passing over the slot keys `avoid` names (slots whose
    /// claim just lost a race: the mirror has not caught up with the winner yet).
    ///
    /// A request takes a slot when more are free than the standing requests ahead of
    /// it need of the label: it need not wait until those (which another launcher may
    /// drive) are seen to have claimed theirs, and they still find enough free. It
    /// takes from its launcher's [`Lane`] (in [`World::free_slots_in`]'s order), passing
    /// over one slot for each slot needed ahead in the same lane; only when the lane has none left does it take from the others. So requests
    /// that two launchers claim for at the same time, each not yet seeing the other's,
    /// go for different slots. `tenant`: the request's; a tenant at its `max-slots`
    /// gets nothing. Costs O((free slots + node sets not standing ahead) x log tenants).
    pub fn reserve_slot_avoiding(
        &mut self,
        tenant: usize,
        me: &QueuePosition,
        label: &str,
        avoid: impl Fn(&str) -> bool,
        now: UnixMillis,
    ) -> Option<SlotRef> {
        let r = {
            let (lane, avoid): (Lane, &dyn Fn(&str) -> bool) = (self.lane(), &avoid);
            // The free slots the standing requests before it need, and one for this
            // one, counted side by side so that a long queue costs no more than the free
            // slots there are.
            let mut free = self.free_slots_in(label, avoid, |_| true);
            let mut in_my_lane = 0;
            let shares = self.shares(label);
            let mut mine = 0;
            for served in self.order(label, &shares, Some((tenant, me)), now) {
                if !served.stands {
                    continue;
                }
                let e = served.entry;
                for _ in 0..e.need {
                    free.next()?;
                }
                if e.owner.as_ref().is_none_or(|o| self.lane_of(o) == lane) {
                    in_my_lane += e.need as usize;
                }
                if e.tenant == tenant {
                    mine += e.need;
                }
            }
            if shares[tenant].room.is_some_and(|room| mine >= room) {
                return None;
            }
            let last = free.next()?;
            // Those ahead in other lanes go for their own lanes' slots first.
            let (b, slot) = self
                .free_slots_in(label, avoid, move |slot| lane.holds(slot))
                .nth(in_my_lane)
                .unwrap_or(last);
            SlotRef {
                backing_id: b.value.id.clone(),
                seat_key: b.key.clone(),
                slot,
            }
        };
        self.reserved.insert(r.key());
        self.restand(&r.seat_key);
        Some(r)
    }

    /// The first free slot of [`World::free_slots_avoiding`]'s order (a dirty slot is
    /// never handed out again until an operator acts).
    fn first_free(&self, b: &BackingNode) -> Option<u32> {
        self.free_slots_avoiding(b, |_| false).next()
    }

    /// The free slots of `label` that `which` selects: by [`capacity::packing_rank`];
    /// among up to [`TIED_SEATS`] seats of one rank (by seat key), the slot free the
    /// longest first ([`World::free_slots_avoiding`]), then by seat key and slot;
    /// passing over those `avoid` names.
    fn free_slots_in<'a>(
        &'a self,
        label: &'a str,
        avoid: &'a dyn Fn(&str) -> bool,
        which: impl Fn(u32) -> bool + Copy + 'a,
    ) -> impl Iterator<Item = (&'a Versioned<BackingNode>, u32)> + 'a {
        let mut seats = self
            .capacity
            .ranked_open_seats(label)
            .filter_map(|(rank, seat)| self.backing.get(seat).map(|b| (rank, b)))
            .peekable();
        let tied = std::iter::from_fn(move || {
            let (rank, first) = seats.next()?;
            let mut group = vec![first];
            while group.len() < TIED_SEATS {
                match seats.next_if(|(r, _)| *r == rank) {
                    Some((_, b)) => group.push(b),
                    None => break,
                }
            }
            Some(group)
        });
        tied.flat_map(move |group| {
            let mut free: Vec<(u64, usize, u32)> = group
                .iter()
                .enumerate()
                .flat_map(|(i, b)| {
                    self.aged_free_slots(&b.value, avoid)
                        .filter(move |(_, slot)| which(*slot))
                        .map(move |(age, slot)| (age, i, slot))
                })
                .collect();
            free.sort_unstable();
            free.into_iter().map(move |(_, i, slot)| (group[i], slot))
        })
    }

    /// The slots of `b` that are neither used, reserved, reported dirty by the agent,
    /// nor named by `avoid`: the one free the longest first (never used, then by the
    /// revision of its deletion), then the lowest. An agent makes a released slot warm
    /// again after answering the release (in mode `users` a new uid, cgroup and
    /// namespaces: tens of milliseconds), and a prepare on it waits for that; a slot
    /// free for longer is warm already. Every launcher sees the same revisions, so the
    /// order is the same in each.
    fn free_slots_avoiding<'a>(
        &'a self,
        b: &'a BackingNode,
        avoid: impl Fn(&str) -> bool + 'a,
    ) -> impl Iterator<Item = u32> + 'a {
        let mut free: Vec<(u64, u32)> = self.aged_free_slots(b, avoid).collect();
        free.sort_unstable();
        free.into_iter().map(|(_, s)| s)
    }

    /// The free slots of [`World::free_slots_avoiding`], unordered, each with the
    /// revision of its deletion (0: never used since this launcher started).
    fn aged_free_slots<'a>(
        &'a self,
        b: &'a BackingNode,
        avoid: impl Fn(&str) -> bool + 'a,
    ) -> impl Iterator<Item = (u64, u32)> + 'a {
        let used = self.used.get(&b.id);
        let dirty = self
            .agents
            .get(&b.id)
            .map(|a| a.dirty_slots.as_slice())
            .unwrap_or_default();
        (0..b.slots)
            .filter(move |s| !used.is_some_and(|u| u.contains(s)) && !dirty.contains(s))
            .filter_map(move |s| {
                let key = layout::slot_key(&b.id, s);
                (!self.reserved.contains(&key) && !avoid(&key))
                    .then(|| (self.tombstones.get(&key).copied().unwrap_or(0), s))
            })
    }

    pub fn unreserve(&mut self, r: &SlotRef) {
        if self.reserved.remove(&r.key()) {
            self.restand_backing(&r.backing_id);
        }
    }

    // ---- capacity ---------------------------------------------------------------------

    /// Slots wanted for `label` by unfinished requests and not yet claimed.
    pub fn unmet_demand(&self, label: &str) -> u32 {
        self.queue.demand(label)
    }

    /// Slots of `label` the planner launches for, beyond those free or coming: what the
    /// queue, walked in its order, gives the label of the free slots and seats
    /// ([`seats`]).
    pub fn planned_demand(&self, label: &str) -> u32 {
        if !self.queue.is_waited_for(label) {
            return 0;
        }
        self.seat_shares().demand.get(label).copied().unwrap_or(0)
    }

    /// How many requests the empty ready node `b` is kept for
    /// (`lifecycle::Observed::waiting`): those of its label's queue, when it takes slots
    /// and the queue, walked in its order, takes its label's idle slots ([`seats`]);
    /// otherwise none, and it is given back after its grace-time.
    pub fn kept_for(&self, b: &BackingNode) -> u32 {
        if !self.takes_slots(b) || self.used_count(&b.id) > 0 || !self.queue.is_waited_for(&b.label)
        {
            return 0;
        }
        self.kept_by(b, &self.seat_shares())
    }

    /// [`World::kept_for`] with the walk's `shares` at hand.
    pub fn kept_by(&self, b: &BackingNode, shares: &seats::SeatShares) -> u32 {
        if !self.takes_slots(b) || !self.queue.is_waited_for(&b.label) {
            return 0;
        }
        let taken = shares.idle_taken.get(&b.label).copied().unwrap_or(0);
        // The idle slots of the label on the nodes claimed from before this one.
        let me = (b.slots, self.seat_of.get(&b.id));
        let ahead: u32 = self
            .backing
            .values()
            .filter(|o| o.value.label == b.label && o.value.id != b.id)
            .filter(|o| self.takes_slots(&o.value) && self.used_count(&o.value.id) == 0)
            .filter(|o| (o.value.slots, Some(&o.key)) < me)
            .map(|o| o.value.slots)
            .sum();
        if ahead < taken {
            self.queue.len(&b.label) as u32
        } else {
            0
        }
    }

    /// Slots of `label` free now or soon (on backing nodes still booting, unless their
    /// provider is out of capacity).
    pub fn coming_capacity(&self, label: &str) -> u32 {
        self.capacity.coming(label)
    }

    /// Seats of a pool currently taken, by index.
    pub fn seats_of(&self, provider: &str, pool: &str) -> BTreeMap<u32, &Versioned<BackingNode>> {
        self.backing
            .values()
            .filter(|b| b.value.provider == provider && b.value.pool == pool)
            .map(|b| (b.value.seat, b))
            .collect()
    }

    /// The server's time of the write of revision `revision` of slot `key`, when the
    /// watch has brought it.
    pub fn slot_written_at(&self, key: &str, revision: u64) -> Option<UnixMillis> {
        self.slot_written
            .get(key)
            .filter(|(rev, _)| *rev == revision)
            .map(|(_, at)| *at)
    }

    /// The same for request `key`.
    pub fn request_written_at(&self, key: &str, revision: u64) -> Option<UnixMillis> {
        self.request_written
            .get(key)
            .filter(|(rev, _)| *rev == revision)
            .map(|(_, at)| *at)
    }

    /// The lease on `key`, if one is held.
    pub fn lease(&self, key: &str) -> Option<&Versioned<Lease>> {
        self.leases.get(key)
    }
}

/// Checks of the capacity index against a walk over every backing node, for tests.
#[cfg(test)]
use slotpool_protocol::model::BackingState;

#[cfg(test)]
impl World {
    /// Panics unless the index says what the walk says, for every label.
    pub fn check_capacity_index(&self) {
        // Walked: the slots in use less those whose node is being released.
        let held = |b: &BackingNode| {
            let releasing = self
                .slots
                .values()
                .filter(|n| n.value.backing_id == b.id && n.value.state == NodeState::Releasing)
                .count() as u32;
            self.used_count(&b.id) - releasing
        };
        let mut fresh = CapacityIndex::default();
        for (seat, b) in &self.backing {
            let standing = Standing {
                label: b.value.label.clone(),
                offer: self.offer(&b.value),
            };
            fresh.set(seat, Some(standing));
        }
        assert_eq!(self.capacity, fresh, "the capacity index is out of date");
        let labels: BTreeSet<&str> = self
            .backing
            .values()
            .map(|b| b.value.label.as_str())
            .collect();
        for label in labels {
            let nodes = || {
                self.backing
                    .values()
                    .map(|b| &b.value)
                    .filter(|b| b.label == label)
            };
            let first = nodes()
                .filter(|b| {
                    self.takes_slots(b)
                        && self.used_count(&b.id) < b.slots
                        && self.first_free(b).is_some()
                })
                .map(|b| capacity::packing_rank(b.slots, held(b)))
                .min();
            let picked = self.capacity.first_open(label).map(|seat| {
                let b = &self.backing[seat].value;
                capacity::packing_rank(b.slots, held(b))
            });
            assert_eq!(
                picked, first,
                "not the first usable node of {label} to pack"
            );
            let coming: u32 = nodes()
                .map(|b| match b.state {
                    BackingState::Requested | BackingState::Launching if b.out_of_capacity => 0,
                    BackingState::Requested | BackingState::Launching => b.slots,
                    BackingState::Ready if self.takes_slots(b) => b.slots.saturating_sub(held(b)),
                    // Ready, its agent's heartbeat not seen here yet, nor lost.
                    BackingState::Ready
                        if b.idle == IdleBehaviour::Run
                            && !self.agents.contains_key(&b.id)
                            && !self.lost_heartbeats.contains_key(&b.id) =>
                    {
                        b.slots
                    }
                    _ => 0,
                })
                .sum();
            assert_eq!(
                self.coming_capacity(label),
                coming,
                "coming capacity of {label}"
            );
        }
    }
}

#[cfg(test)]
pub mod tests_support {
    use super::*;

    /// A waiting request for `labels`, with every optional field empty: tests set the
    /// few fields they are about.
    pub fn request(id: &str, labels: &[&str]) -> NodeRequest {
        NodeRequest {
            v: 1,
            id: RequestId::parse(id).unwrap(),
            labels: labels.iter().map(|l| l.to_string()).collect(),
            requestor: "t".into(),
            client: None,
            priority: 100,
            timeout_secs: None,
            ssh_public_key: None,
            created_at: 0,
            state: RequestState::Requested,
            status: String::new(),
            nodes: vec![],
            failure: None,
            updated_at: 0,
            owner: None,
            nodes_released_at: None,
            keep_alive_secs: None,
            alive_until: None,
            fulfilled_at: None,
            hold_until: None,
            nodes_failed: Vec::new(),
            waiting: None,
        }
    }
    /// A ready node of `request` in slot `slot` of backing node `backing`, at revision 2.
    pub fn node(backing: &str, slot: u32, request: &str, label: &str) -> Versioned<Node> {
        let b = BackingId::parse(backing).unwrap();
        Versioned {
            key: layout::slot_key(&b, slot),
            revision: 2,
            value: Node {
                v: 1,
                id: NodeId::for_slot(&b, slot),
                request_id: RequestId::parse(request).unwrap(),
                index: 0,
                label: label.into(),
                backing_id: b.clone(),
                slot,
                state: NodeState::Ready,
                requestor: "t".into(),
                client: None,
                host: "h".into(),
                workspace: None,
                attributes: Default::default(),
                allocated_at: 0,
                released_at: None,
                failure: None,
                login: Default::default(),
            },
        }
    }

    use slotpool_protocol::model::HealthGist;

    pub fn backing(
        id: &str,
        label: &str,
        slots: u32,
        state: BackingState,
    ) -> Versioned<BackingNode> {
        Versioned {
            key: format!("p.main.{id}"),
            revision: 1,
            value: BackingNode {
                v: 1,
                id: BackingId::parse(id).unwrap(),
                provider: "p".into(),
                pool: "main".into(),
                seat: 0,
                label: label.into(),
                backing_label: "large".into(),
                slots,
                state,
                idle: IdleBehaviour::Run,
                instance: None,
                secret_sha256: "s".into(),
                created_at: 0,
                launched_at: None,
                ready_at: None,
                idle_since: None,
                attempts: 1,
                out_of_capacity: false,
                create_queued: false,
                uses: 0,
                failure: None,
                attributes: Default::default(),
                order: None,
                interruption: None,
                updated_at: 0,
            },
        }
    }

    pub fn agent(id: &str) -> HeartbeatGist<'static> {
        HeartbeatGist {
            backing_id: id.to_string().into(),
            secret_sha256: "s".into(),
            health: HealthGist { healthy: true },
            ttl_secs: None,
            draining: false,
            dirty_slots: vec![],
            ssh_port: None,
            ssh_host_keys: vec![],
            slot_names: None,
            interruption: None,
        }
    }
}

/// The slots a launcher takes first: with `count` launchers live, the one at `index`
/// (by id) prefers slot `index`, `index + count`, … of every backing node, so that
/// launchers claiming at the same time rarely go for the same slot. A launcher takes
/// the others' slots too when its own are used up; a claim stays a create-if-absent
/// either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lane {
    pub index: usize,
    pub count: usize,
}

impl Lane {
    /// A launcher alone: every slot is in its lane.
    pub const ALONE: Lane = Lane { index: 0, count: 1 };

    /// Whether `slot` (of any backing node) is in this lane.
    pub fn holds(self, slot: u32) -> bool {
        slot as usize % self.count.max(1) == self.index
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::{agent, backing, node, request};
    use super::*;

    fn pos(p: i32, t: u64, id: &str) -> QueuePosition {
        (p, t, RequestId::parse(id).unwrap())
    }

    /// A world whose pool file has `tenants` (YAML list items, indented for the list).
    fn with_tenants(tenants: &str) -> World {
        let yaml = format!(
            "providers:\n  - name: p\n    driver: local\n    pools:\n      - name: main\n        \
             max-servers: 4\n        labels:\n          - {{name: small, backing-label: vm, \
             max-parallel-jobs: 4}}\ntenants:\n{tenants}"
        );
        let config = Config::parse(std::path::Path::new("pool.yaml"), &yaml).unwrap();
        World {
            tenants: config.tenants.clone(),
            me: Some(LauncherId::parse("launcher-me").unwrap()),
            ..World::default()
        }
    }

    fn of_client(mut r: NodeRequest, client: &str, created_at: u64) -> Versioned<NodeRequest> {
        r.client = Some(UserName::parse(client).unwrap());
        r.created_at = created_at;
        r.owner = Some(LauncherId::parse("launcher-me").unwrap());
        Versioned {
            key: r.id.to_string(),
            revision: 1,
            value: r,
        }
    }

    fn held_by(mut n: Versioned<Node>, client: &str) -> Versioned<Node> {
        n.value.client = Some(UserName::parse(client).unwrap());
        n
    }

    const TWO_TEAMS: &str = "  - {name: a, clients: [ci-a]}\n  - {name: b, clients: [ci-b]}\n";

    /// A ready node whose agent's heartbeat this mirror has not seen yet (its watch is
    /// behind the backing record's) counts as coming, as a booting one does; once seen
    /// it serves; once its heartbeat lapses it counts for nothing.
    #[test]
    fn a_ready_node_counts_as_coming_until_its_heartbeat_is_seen_or_lost() {
        let mut w = World::of(
            LauncherId::parse("launcher-a").unwrap(),
            Arrivals::default(),
        );
        w.put_backing(backing("bn-1", "small", 4, BackingState::Ready));
        assert_eq!(w.coming_capacity("small"), 4, "not seen yet");
        let b = w.backing.values().next().unwrap().value.clone();
        assert!(!w.takes_slots(&b), "no slot goes to it yet");
        w.put_agent(agent("bn-1"));
        assert_eq!(w.coming_capacity("small"), 4, "serving, every slot free");
        w.remove_agent("bn-1");
        assert_eq!(w.coming_capacity("small"), 0, "its heartbeat lapsed");
        w.check_capacity_index();
    }

    /// One launcher plans: the live one with the lowest id, counting itself live before
    /// its own lease shows; the next plans once that one's lease is gone.
    #[test]
    fn the_live_launcher_with_the_lowest_id_plans() {
        let lease = |id: &str| Versioned {
            key: layout::launcher_lease_key(&LauncherId::parse(id).unwrap()),
            revision: 1,
            value: Lease {
                v: 1,
                holder: LauncherId::parse(id).unwrap(),
                acquired_at: 0,
                renewed_at: None,
                passed_at: None,
            },
        };
        let mut second = World::of(
            LauncherId::parse("launcher-b").unwrap(),
            Arrivals::default(),
        );
        assert!(second.is_planner(), "alone, before its own lease shows");
        assert!(second.put_lease(lease("launcher-a")), "a launcher came");
        assert!(!second.is_planner());
        assert!(
            !second.put_lease(lease("launcher-a")),
            "a renewal changes nothing"
        );
        assert!(second.put_lease(lease("launcher-b")), "its own lease shows");
        assert!(!second.is_planner());
        assert!(second.remove_lease(&lease("launcher-a").key));
        assert!(second.is_planner(), "the planner's lease is gone");
        assert!(second.put_lease(lease("launcher-c")));
        assert!(
            second.is_planner(),
            "a launcher with a higher id does not plan"
        );
    }

    #[test]
    fn a_quieter_tenant_is_served_before_the_backlog_of_a_busier_one() {
        let mut w = with_tenants(TWO_TEAMS);
        w.put_backing(backing("bn-a", "small", 4, BackingState::Ready));
        w.put_agent(agent("bn-a"));
        w.put_slot(held_by(node("bn-a", 0, "req-x", "small"), "ci-a"));
        w.put_slot(held_by(node("bn-a", 1, "req-y", "small"), "ci-a"));
        for t in 1..=5 {
            w.put_request(of_client(
                request(&format!("req-a{t}"), &["small"]),
                "ci-a",
                t,
            ));
        }
        w.put_request(of_client(request("req-b", &["small"]), "ci-b", 10));
        let now = 20;
        let mut fitting = Vec::new();
        w.each_fitting("small", now, |pos, _| fitting.push(pos.2.to_string()));
        assert_eq!(
            fitting,
            ["req-b", "req-a1"],
            "b holds none: first, though last in"
        );
        assert!(w
            .reserve_slot(&pos(100, 10, "req-b"), "small", now)
            .is_some());
        assert_eq!(
            w.held_back(0, &pos(100, 2, "req-a2"), "small", now),
            Some(HeldBack::Behind { requests: 2 }),
            "a's second request waits behind b's and a's first"
        );
    }

    #[test]
    fn a_tenant_at_its_max_slots_waits_and_says_so() {
        let mut w = with_tenants("  - {name: a, clients: [ci-a], max-slots: 2}\n");
        w.put_backing(backing("bn-a", "small", 4, BackingState::Ready));
        w.put_agent(agent("bn-a"));
        w.put_slot(held_by(node("bn-a", 0, "req-x", "small"), "ci-a"));
        w.put_slot(held_by(node("bn-a", 1, "req-y", "small"), "ci-a"));
        w.put_request(of_client(request("req-a", &["small"]), "ci-a", 1));
        w.put_request(of_client(request("req-z", &["small"]), "ci-z", 2));
        assert!(w.reserve_slot(&pos(100, 1, "req-a"), "small", 5).is_none());
        assert_eq!(
            w.held_back(0, &pos(100, 1, "req-a"), "small", 5),
            Some(HeldBack::TenantLimit {
                tenant: "a".into(),
                max_slots: 2
            })
        );
        assert!(
            w.reserve_slot(&pos(100, 2, "req-z"), "small", 5).is_some(),
            "another tenant's later request is served meanwhile"
        );
        w.remove_slot(&layout::slot_key(&BackingId::parse("bn-a").unwrap(), 0), 3);
        assert!(
            w.reserve_slot(&pos(100, 1, "req-a"), "small", 5).is_some(),
            "a slot given back makes room"
        );
    }

    #[test]
    fn hard_limits_count_open_requests_and_the_last_seconds_submits() {
        let mut w = with_tenants(
            "  - {name: a, clients: [ci-a], max-waiting: 2}\n  \
             - {name: b, clients: [ci-b], max-submits-per-second: 3}\n",
        );
        let a = UserName::parse("ci-a").unwrap();
        let b = UserName::parse("ci-b").unwrap();
        w.put_request(of_client(request("req-a1", &["small"]), "ci-a", 1));
        assert_eq!(w.admits(Some(&a), 1), Ok(()));
        w.put_request(of_client(request("req-a2", &["small"]), "ci-a", 2));
        assert!(matches!(
            w.admits(Some(&a), 3),
            Err(OverLimit::Waiting { max: 2, .. })
        ));
        assert_eq!(w.admits(None, 3), Ok(()), "the default tenant has no limit");
        let mut done = of_client(request("req-a1", &["small"]), "ci-a", 1);
        done.revision = 2;
        done.value.state = RequestState::Canceled;
        w.put_request(done);
        assert_eq!(w.admits(Some(&a), 4), Ok(()), "an ended request makes room");

        for t in 0..3 {
            w.put_request(of_client(
                request(&format!("req-b{t}"), &["small"]),
                "ci-b",
                1_000 + t,
            ));
        }
        assert!(matches!(
            w.admits(Some(&b), 1_500),
            Err(OverLimit::Rate { .. })
        ));
        assert_eq!(w.admits(Some(&b), 2_001), Ok(()), "a second later");
    }

    #[test]
    fn reserves_on_the_fullest_usable_backing_node() {
        let mut w = World::default();
        w.put_backing(backing("bn-a", "small", 4, BackingState::Ready));
        w.put_backing(backing("bn-b", "small", 4, BackingState::Ready));
        w.put_agent(agent("bn-a"));
        w.put_agent(agent("bn-b"));
        w.put_slot(node("bn-b", 0, "req-x", "small"));
        let r = w.reserve_slot(&pos(100, 1, "req-1"), "small", 0).unwrap();
        assert_eq!((r.backing_id.as_str(), r.slot), ("bn-b", 1));
        let r2 = w.reserve_slot(&pos(100, 1, "req-1"), "small", 0).unwrap();
        assert_eq!(
            (r2.backing_id.as_str(), r2.slot),
            ("bn-b", 2),
            "a reserved slot is not handed out twice"
        );
    }

    #[test]
    fn reserves_on_the_smallest_node_then_the_fullest() {
        let mut w = World::default();
        let mut big = backing("bn-big", "small", 8, BackingState::Ready);
        big.key = "p.main.0".into();
        let mut half = backing("bn-half", "small", 2, BackingState::Ready);
        half.key = "p.main.1".into();
        let mut empty = backing("bn-empty", "small", 2, BackingState::Ready);
        empty.key = "p.main.2".into();
        for b in [big, half, empty] {
            w.put_agent(agent(b.value.id.as_str()));
            w.put_backing(b);
        }
        for slot in 0..7 {
            w.put_slot(node("bn-big", slot, "req-x", "small"));
        }
        w.put_slot(node("bn-half", 0, "req-x", "small"));
        let order: Vec<String> = (1..=4)
            .map(|n| {
                let r = w
                    .reserve_slot(&pos(100, n, &format!("req-{n}")), "small", 0)
                    .unwrap();
                format!("{}/{}", r.backing_id, r.slot)
            })
            .collect();
        assert_eq!(
            order,
            ["bn-half/1", "bn-empty/0", "bn-empty/1", "bn-big/7"],
            "the 2-slot nodes first, the half-full one before the empty one; the 8-slot \
             node, though fuller, last"
        );
        w.check_capacity_index();
    }

    #[test]
    fn dirty_slots_are_never_handed_out() {
        let mut w = World::default();
        w.put_backing(backing("bn-a", "small", 3, BackingState::Ready));
        let mut a = agent("bn-a");
        a.dirty_slots = vec![0, 2];
        w.put_agent(a);
        let r = w.reserve_slot(&pos(100, 1, "req-1"), "small", 0).unwrap();
        assert_eq!(r.slot, 1);
        assert_eq!(w.reserve_slot(&pos(100, 1, "req-1"), "small", 0), None);
        let mut unhealthy = agent("bn-a");
        unhealthy.health.healthy = false;
        w.put_agent(unhealthy);
        w.unreserve(&r);
        assert_eq!(w.reserve_slot(&pos(100, 1, "req-1"), "small", 0), None);
    }

    #[test]
    fn no_slots_from_nodes_that_are_not_ready_held_or_without_agent() {
        let mut w = World::default();
        w.put_backing(backing("bn-a", "small", 4, BackingState::Launching));
        let mut held = backing("bn-b", "small", 4, BackingState::Ready);
        held.value.idle = IdleBehaviour::Hold;
        w.put_backing(held);
        w.put_agent(agent("bn-b"));
        w.put_backing(backing("bn-c", "small", 4, BackingState::Ready)); // no agent
        let mut bad = agent("bn-c");
        bad.secret_sha256 = "other".into();
        w.put_agent(bad);
        assert_eq!(w.reserve_slot(&pos(100, 1, "req-1"), "small", 0), None);
        assert_eq!(
            w.coming_capacity("small"),
            4,
            "only the launching node counts as coming"
        );
    }

    #[test]
    fn a_request_ahead_in_the_queue_goes_first() {
        let mut w = World::of(
            LauncherId::parse("launcher-a").unwrap(),
            Arrivals::default(),
        );
        w.put_backing(backing("bn-a", "small", 1, BackingState::Ready));
        w.put_agent(agent("bn-a"));
        w.put_request(open_request("req-urgent", 50, 9, "launcher-a"));
        assert_eq!(w.reserve_slot(&pos(100, 1, "req-1"), "small", 0), None);
        assert!(w
            .reserve_slot(&pos(50, 9, "req-urgent"), "small", 0)
            .is_some());
    }

    fn open_request(
        id: &str,
        priority: i32,
        created_at: u64,
        owner: &str,
    ) -> Versioned<NodeRequest> {
        let mut value = request(id, &["small"]);
        value.priority = priority;
        value.created_at = created_at;
        value.owner = Some(LauncherId::parse(owner).unwrap());
        Versioned {
            key: id.into(),
            revision: 1,
            value,
        }
    }

    fn live(w: &mut World, launcher: &str) {
        let key = layout::launcher_lease_key(&LauncherId::parse(launcher).unwrap());
        w.put_lease(Versioned {
            key: key.clone(),
            revision: 1,
            value: Lease {
                v: 1,
                holder: LauncherId::parse(launcher).unwrap(),
                acquired_at: 0,
                renewed_at: None,
                passed_at: None,
            },
        });
    }

    #[test]
    fn one_queue_orders_the_requests_of_every_launcher() {
        let mut w = World::of(
            LauncherId::parse("launcher-a").unwrap(),
            Arrivals::default(),
        );
        w.put_backing(backing("bn-a", "small", 1, BackingState::Ready));
        w.put_agent(agent("bn-a"));
        // Another launcher's request: more urgent, though newer.
        w.put_request(open_request("req-urgent", 10, 9, "launcher-b"));
        let mine = pos(100, 1, "req-mine");
        assert!(
            w.reserve_slot(&mine, "small", 0).is_some(),
            "its launcher is not alive: it does not hold the queue"
        );
        w.reserved.clear();
        w.restand_backing(&BackingId::parse("bn-a").unwrap());
        live(&mut w, "launcher-b");
        assert_eq!(w.reserve_slot(&mine, "small", 0), None, "it goes first");
        assert!(
            w.reserve_slot(&pos(5, 20, "req-first"), "small", 0)
                .is_some(),
            "a request ahead of it does not wait"
        );
        w.reserved.clear();
        w.restand_backing(&BackingId::parse("bn-a").unwrap());
        // Its node came: it is out of the queue (and the slot is taken).
        w.put_slot(node("bn-a", 0, "req-urgent", "small"));
        assert!(!w.is_short_of(&RequestId::parse("req-urgent").unwrap(), "small"));
        assert_eq!(w.queue().labels().count(), 0);
        let mut done = open_request("req-urgent", 10, 9, "launcher-b");
        done.revision = 2;
        done.value.state = RequestState::Fulfilled;
        w.put_request(done);
        w.remove_slot("bn-a.0", 3);
        assert!(w.reserve_slot(&mine, "small", 0).is_some());
        // This launcher's own open requests stand in the one queue too.
        w.reserved.clear();
        w.restand_backing(&BackingId::parse("bn-a").unwrap());
        w.put_request(open_request("req-own", 1, 1, "launcher-a"));
        assert!(w.reserve_slot(&pos(100, 5, "req-x"), "small", 0).is_none());
        assert!(w.reserve_slot(&pos(1, 1, "req-own"), "small", 0).is_some());
    }

    #[test]
    fn lanes_split_every_nodes_slots_between_the_launchers() {
        assert!((0..8).all(|s| Lane::ALONE.holds(s)));
        let lanes = |index| Lane { index, count: 3 };
        let of = |lane: Lane| (0..7).filter(|s| lane.holds(*s)).collect::<Vec<_>>();
        assert_eq!(of(lanes(0)), [0, 3, 6]);
        assert_eq!(of(lanes(1)), [1, 4]);
        assert_eq!(of(lanes(2)), [2, 5]);
    }

    #[test]
    fn behind_another_launchers_request_a_request_takes_the_next_free_slot() {
        let mut w = World::of(
            LauncherId::parse("launcher-a").unwrap(),
            Arrivals::default(),
        );
        w.put_backing(backing("bn-a", "small", 2, BackingState::Ready));
        w.put_agent(agent("bn-a"));
        live(&mut w, "launcher-b");
        w.put_request(open_request("req-first", 100, 1, "launcher-b"));
        let r = w
            .reserve_slot(&pos(100, 5, "req-later"), "small", 0)
            .unwrap();
        assert_eq!(
            r.slot, 0,
            "slot 1, in launcher-b's lane, stays free for its request ahead"
        );
        assert_eq!(
            w.reserve_slot(&pos(100, 6, "req-last"), "small", 0),
            None,
            "no slot left for a third"
        );
    }

    #[test]
    fn launchers_in_different_lanes_go_for_different_slots() {
        let slot_for = |me: &str| {
            let mut w = World::of(LauncherId::parse(me).unwrap(), Arrivals::default());
            w.put_backing(backing("bn-a", "small", 4, BackingState::Ready));
            w.put_agent(agent("bn-a"));
            live(&mut w, "launcher-a");
            live(&mut w, "launcher-b");
            let r = w.reserve_slot(&pos(100, 5, "req-1"), "small", 0).unwrap();
            r.slot
        };
        assert_eq!((slot_for("launcher-a"), slot_for("launcher-b")), (0, 1));
    }

    #[test]
    fn requests_ahead_are_counted_in_their_own_launchers_lane() {
        let mut w = World::of(
            LauncherId::parse("launcher-a").unwrap(),
            Arrivals::default(),
        );
        w.put_backing(backing("bn-a", "small", 4, BackingState::Ready));
        w.put_agent(agent("bn-a"));
        live(&mut w, "launcher-b");
        w.put_request(open_request("req-b", 100, 1, "launcher-b"));
        w.put_request(open_request("req-a", 100, 2, "launcher-a"));
        let r = w
            .reserve_slot(&pos(100, 5, "req-later"), "small", 0)
            .unwrap();
        assert_eq!(
            r.slot, 2,
            "slot 0 is left to this launcher's request ahead, slot 1 to launcher-b's"
        );
    }

    #[test]
    fn a_launcher_takes_other_lanes_slots_when_its_own_are_used() {
        let mut w = World::of(
            LauncherId::parse("launcher-b").unwrap(),
            Arrivals::default(),
        );
        w.put_backing(backing("bn-a", "small", 4, BackingState::Ready));
        w.put_agent(agent("bn-a"));
        live(&mut w, "launcher-a");
        w.put_slot(node("bn-a", 1, "req-x", "small"));
        w.put_slot(node("bn-a", 3, "req-y", "small"));
        let r = w.reserve_slot(&pos(100, 5, "req-1"), "small", 0).unwrap();
        assert_eq!(r.slot, 0, "its own lane (1, 3) is used: the first other");
    }

    #[test]
    fn a_claim_takes_the_slot_free_the_longest() {
        let mut w = World::of(
            LauncherId::parse("launcher-a").unwrap(),
            Arrivals::default(),
        );
        w.put_backing(backing("bn-a", "small", 3, BackingState::Ready));
        w.put_agent(agent("bn-a"));
        let b = BackingId::parse("bn-a").unwrap();
        let used = |w: &mut World, slot: u32, freed_at: u64| {
            let mut n = node("bn-a", slot, "req-x", "small");
            n.revision = freed_at - 1;
            w.put_slot(n);
            w.remove_slot(&layout::slot_key(&b, slot), freed_at);
        };
        used(&mut w, 0, 20);
        used(&mut w, 1, 10);
        let take = |w: &mut World, id: &str| {
            let r = w.reserve_slot(&pos(100, 5, id), "small", 0).unwrap();
            r.slot
        };
        assert_eq!(
            take(&mut w, "req-1"),
            2,
            "never used: warm since the agent started"
        );
        assert_eq!(take(&mut w, "req-2"), 1, "freed before slot 0");
        assert_eq!(take(&mut w, "req-3"), 0, "the one just freed comes last");
    }

    /// Nodes `ids` of label "small", `slots` each, ready with their agents.
    fn ready_nodes(ids: &[&str], slots: u32) -> World {
        let mut w = World::of(
            LauncherId::parse("launcher-a").unwrap(),
            Arrivals::default(),
        );
        for id in ids {
            w.put_backing(backing(id, "small", slots, BackingState::Ready));
            w.put_agent(agent(id));
        }
        w
    }

    /// Claims a slot for request `id` and puts a node in it at revision `at`, as the
    /// claim's echo would: (backing node, slot).
    fn claim(w: &mut World, id: &str, at: u64) -> (String, u32) {
        let r = w.reserve_slot(&pos(100, 5, id), "small", 0).unwrap();
        let mut n = node(r.backing_id.as_str(), r.slot, id, "small");
        n.revision = at;
        w.put_slot(n);
        (r.backing_id.as_str().to_string(), r.slot)
    }

    fn free(w: &mut World, (backing, slot): &(String, u32), at: u64) {
        let b = BackingId::parse(backing).unwrap();
        w.remove_slot(&layout::slot_key(&b, *slot), at);
    }

    #[test]
    fn one_node_at_a_time_goes_round_the_slots_of_equally_full_nodes() {
        let mut w = ready_nodes(&["bn-a", "bn-b", "bn-c"], 2);
        let mut taken = vec![];
        for i in 0..7u64 {
            let got = claim(&mut w, &format!("req-{i}"), 10 * i + 1);
            free(&mut w, &got, 10 * i + 2);
            taken.push(got);
        }
        let first_six: HashSet<_> = taken[..6].iter().collect();
        assert_eq!(
            first_six.len(),
            6,
            "a slot just released (still warming on its agent) was taken again while \
             another node as full had slots free for longer: {taken:?}"
        );
        assert_eq!(taken[6], taken[0], "then the one free the longest");
    }

    #[test]
    fn packing_comes_before_the_slot_free_the_longest() {
        let mut w = ready_nodes(&["bn-a", "bn-b"], 2);
        let held = claim(&mut w, "req-held", 1);
        let brief = claim(&mut w, "req-brief", 2);
        assert_eq!((held.0.as_str(), brief.0.as_str()), ("bn-a", "bn-a"));
        free(&mut w, &brief, 3);
        assert_eq!(
            claim(&mut w, "req-next", 4),
            brief,
            "the fuller node's slot just freed, not the empty node's never used"
        );
    }

    #[test]
    fn a_slot_being_released_does_not_make_its_node_the_fullest() {
        let mut w = ready_nodes(&["bn-a", "bn-b"], 2);
        let a0 = claim(&mut w, "req-1", 1);
        let a1 = claim(&mut w, "req-2", 2);
        let b0 = claim(&mut w, "req-3", 3);
        let b1 = claim(&mut w, "req-4", 4);
        assert_eq!((a0.0.as_str(), a1.0.as_str()), ("bn-a", "bn-a"));
        free(&mut w, &b0, 5);
        free(&mut w, &b1, 6);
        free(&mut w, &a1, 7);
        // bn-a's other node is being released: the client was answered, the agent
        // cleans the slot, then the key goes.
        let mut marked = node("bn-a", a0.1, "req-1", "small");
        marked.revision = 8;
        marked.value.state = NodeState::Releasing;
        w.put_slot(marked);
        assert_eq!(w.used_count(&BackingId::parse("bn-a").unwrap()), 1);
        assert_eq!(
            claim(&mut w, "req-next", 9),
            b0,
            "bn-a's slot freed last (warming up again) was taken over bn-b's, freed \
             before it, as if bn-a were fuller"
        );
    }

    #[test]
    fn a_claim_looks_across_a_bounded_number_of_tied_nodes() {
        let ids: Vec<String> = (0..TIED_SEATS + 1).map(|i| format!("bn-{i}")).collect();
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        let mut w = ready_nodes(&ids, 1);
        // Every node but the last used once, the first the latest.
        let mut order = vec![];
        for i in 0..TIED_SEATS as u64 {
            order.push(claim(&mut w, &format!("req-{i}"), 10 * i + 1));
        }
        for (i, got) in order.iter().rev().enumerate() {
            free(&mut w, got, 100 + i as u64);
        }
        let last = format!("bn-{TIED_SEATS}");
        let got = claim(&mut w, "req-next", 200);
        assert_ne!(
            got.0, last,
            "the node beyond the first {TIED_SEATS} tied ones"
        );
        assert_eq!(got, order[TIED_SEATS - 1], "of those, the one freed first");
    }

    #[test]
    fn a_node_set_stands_once_it_waited_its_patience_and_can_be_held() {
        let mut w = World::of(
            LauncherId::parse("launcher-a").unwrap(),
            Arrivals::default(),
        );
        w.put_backing(backing("bn-a", "small", 1, BackingState::Ready));
        w.put_agent(agent("bn-a"));
        live(&mut w, "launcher-b");
        let mut set = open_request("req-set", 10, 1, "launcher-b");
        set.value.labels = vec!["small".into(), "big".into()];
        w.put_request(set);
        assert!(w.is_short_of(&RequestId::parse("req-set").unwrap(), "small"));
        let later = pos(100, 5, "req-later");
        let due = 1 + SET_PATIENCE_MS;
        let takes = |w: &mut World, now| {
            let r = w.reserve_slot(&later, "small", now);
            if let Some(r) = &r {
                w.unreserve(r);
            }
            r.is_some()
        };
        assert!(
            takes(&mut w, due - 1),
            "a set that has not waited its patience keeps nothing from a later request"
        );
        assert!(
            takes(&mut w, due),
            "nor one that no node of a label it needs could ever hold"
        );
        let mut big = backing("bn-b", "big", 1, BackingState::Ready);
        big.key = "p.main.bn-b".into();
        w.put_backing(big);
        w.put_agent(agent("bn-b"));
        assert!(
            !takes(&mut w, due),
            "now it stands: the later request waits"
        );
        assert!(takes(&mut w, due - 1), "but not before its patience");
        // Held, the big node can hold nothing: the set stands no more.
        let mut held = backing("bn-b", "big", 1, BackingState::Ready);
        held.key = "p.main.bn-b".into();
        held.revision = 2;
        held.value.idle = IdleBehaviour::Hold;
        w.put_backing(held);
        assert!(takes(&mut w, due));
    }

    #[test]
    fn a_change_wakes_only_this_launchers_requests_that_can_claim() {
        let me = LauncherId::parse("launcher-a").unwrap();
        let mut w = World::of(me, Arrivals::default());
        live(&mut w, "launcher-b");
        w.put_backing(backing("bn-a", "small", 2, BackingState::Ready));
        w.put_agent(agent("bn-a"));
        w.put_slot(node("bn-a", 0, "req-x", "small"));
        w.put_slot(node("bn-a", 1, "req-y", "small"));
        w.put_request(open_request("req-theirs", 100, 1, "launcher-b"));
        w.put_request(open_request("req-1", 100, 2, "launcher-a"));
        w.put_request(open_request("req-2", 100, 3, "launcher-a"));
        let mut woken = w.take_wakes(0);
        woken.sort();
        assert_eq!(
            woken,
            [
                RequestId::parse("req-1").unwrap(),
                RequestId::parse("req-2").unwrap()
            ],
            "a new backing node: every request of its label looks (and says why it waits)"
        );
        assert!(w.take_wakes(0).is_empty(), "a full node: nobody can claim");
        w.remove_slot("bn-a.0", 5);
        assert_eq!(
            w.take_wakes(0),
            Vec::<RequestId>::new(),
            "one slot free: launcher-b's request ahead takes it"
        );
        w.remove_slot("bn-a.1", 6);
        assert_eq!(w.take_wakes(0), vec![RequestId::parse("req-1").unwrap()]);
        assert!(w.take_wakes(0).is_empty(), "nothing changed since");
    }

    /// Revision `revision` of request `id` in `state` (nodes released when fulfilled).
    fn versioned(id: &str, revision: u64, state: RequestState) -> Versioned<NodeRequest> {
        let mut value = request(id, &["small"]);
        value.state = state;
        if state == RequestState::Fulfilled {
            value.nodes_released_at = Some(1);
        }
        Versioned {
            key: id.into(),
            revision,
            value,
        }
    }

    #[test]
    fn the_mirror_holds_no_finished_request() {
        let mut w = World::default();
        let finished = [
            RequestState::Fulfilled,
            RequestState::Failed,
            RequestState::Canceled,
            RequestState::Reclaimed,
        ];
        // Revisions are the bucket's: one sequence for every key.
        for i in 0..1000u64 {
            let id = format!("req-{i}");
            let (opened, ended) = (2 * i + 1, 2 * i + 2);
            w.put_request(versioned(&id, opened, RequestState::Requested));
            w.request_written.insert(id.clone(), (opened, 5));
            // Finished by this launcher: applied at once, its echo still to come.
            w.put_request(versioned(&id, ended, finished[i as usize % 4]));
            assert!(!w.requests.contains_key(id.as_str()), "{id} left at once");
            // An older revision the watch delivers meanwhile does not bring it back.
            w.put_request(versioned(&id, opened, RequestState::Requested));
            assert!(!w.request_delivered(&id, opened));
            assert!(w.finished_at(&id, ended).is_some(), "waiting for its echo");
            // The echo ends the tombstone.
            assert!(!w.request_delivered(&id, ended));
        }
        assert!(w.requests.is_empty());
        assert!(w.open_requests.is_empty() && w.queue().labels().count() == 0);
        assert!(w.request_written.is_empty());
        assert!(w.finished.is_empty());
        // Finished by another launcher: the watch brings it, and nothing stays.
        w.put_request(versioned("req-x", 3001, RequestState::Requested));
        w.put_request(versioned("req-x", 3002, RequestState::Canceled));
        assert!(!w.request_delivered("req-x", 3002));
        assert!(w.requests.is_empty() && w.finished.is_empty());
        // A fulfilled request holding its nodes stays.
        let mut held = versioned("req-h", 3003, RequestState::Fulfilled);
        held.value.nodes_released_at = None;
        w.put_request(held);
        assert!(w.request_delivered("req-h", 3003));
        assert!(w.requests.contains_key("req-h") && w.held_requests.is_empty());
    }

    /// A worker's write is acknowledged, then its task waits to run while the watch
    /// brings that write and the cancel that overtook it, and the mirror lets the
    /// finished request go. The write put in late must not bring the request back: its
    /// worker would take it for open and write on a revision KV moved past, for good.
    /// (Found by `tests/tests/mix.rs`: a set canceled while its worker wrote its status.)
    #[test]
    fn a_write_the_watch_overtook_does_not_bring_its_request_back() {
        let mut w = World::default();
        // What the watch does with each change it brings.
        let deliver = |w: &mut World, r: Versioned<NodeRequest>| {
            let (key, revision) = (r.key.clone(), r.revision);
            w.put_request(r);
            w.request_delivered(&key, revision);
            w.watch_delivered(Watched::Requests, revision);
        };
        deliver(&mut w, versioned("req-1", 10, RequestState::Requested));
        // The worker's status write lands as revision 11; another launcher cancels at 12.
        let written = versioned("req-1", 11, RequestState::Requested);
        for (revision, state) in [(11, RequestState::Requested), (12, RequestState::Canceled)] {
            deliver(&mut w, versioned("req-1", revision, state));
        }
        assert!(w.requests.is_empty() && w.finished.is_empty());
        w.put_request(written);
        assert!(w.requests.is_empty(), "the overtaken write stays out");
        assert!(w.open_requests.is_empty() && w.queue().labels().count() == 0);
        // So does a record read from KV before the cancel, put in after it.
        w.put_request(versioned("req-1", 11, RequestState::Requested));
        assert!(w.requests.is_empty());
        // A removal the watch brings moves the mark too; a reload's (u64::MAX) does not.
        deliver(&mut w, versioned("req-2", 13, RequestState::Requested));
        w.remove_request("req-2", 14);
        w.watch_delivered(Watched::Requests, 14);
        w.watch_delivered(Watched::Requests, u64::MAX);
        w.put_request(versioned("req-2", 13, RequestState::Requested));
        assert!(w.requests.is_empty());
        // A write newer than anything the watch brought goes in at once.
        w.put_request(versioned("req-4", 15, RequestState::Requested));
        assert!(w.requests.contains_key("req-4"));
    }

    /// The same for a seat and a slot: an operator's order acknowledged late, after the
    /// watch brought it and the seat's deletion, must not take the seat again; nor may a
    /// claim put in after the watch brought it and its release.
    #[test]
    fn a_late_write_takes_no_seat_or_slot_again() {
        let mut w = World::default();
        let mut seat = backing("bn-a", "small", 2, BackingState::Ready);
        seat.revision = 20;
        w.put_backing(seat.clone());
        w.watch_delivered(Watched::Backing, 20);
        let mut ordered = seat.clone();
        ordered.revision = 21;
        ordered.value.idle = IdleBehaviour::Drain;
        w.put_backing(ordered.clone());
        w.watch_delivered(Watched::Backing, 21);
        w.remove_backing(&seat.key, 22);
        w.watch_delivered(Watched::Backing, 22);
        w.put_backing(ordered);
        assert!(w.backing.is_empty(), "the deleted seat stays free");

        let mut seat = backing("bn-b", "small", 2, BackingState::Ready);
        seat.revision = 23;
        w.put_backing(seat);
        let mut claim = node("bn-b", 0, "req-1", "small");
        claim.revision = 30;
        w.put_slot(claim.clone());
        w.watch_delivered(Watched::Slots, 30);
        w.remove_slot(&claim.key, 31);
        w.watch_delivered(Watched::Slots, 31);
        // The tombstones of a seat's slots go with the seat; the mark stays.
        w.tombstones.clear();
        w.put_slot(claim);
        assert!(w.slots.is_empty(), "the released slot stays free");
    }

    /// A request behind others for a label's free slots is woken when their claims leave
    /// none free, though none is left for it: it says what it waits for now (in the mix
    /// that found this, the launch its provider's create limits held). Not before: while
    /// a slot is free, what it waits behind stands, and a flood behind a set sleeps on.
    /// Once.
    #[test]
    fn a_request_behind_others_is_woken_when_they_claim() {
        let mut w = World::default();
        w.put_backing(backing("bn-a", "small", 2, BackingState::Ready));
        w.put_agent(agent("bn-a"));
        w.take_wakes(0);
        let behind = RequestId::parse("req-9").unwrap();
        w.note_behind("small", &behind);
        w.put_slot(node("bn-a", 0, "req-1", "small"));
        assert!(!w.take_wakes(0).contains(&behind), "a slot is still free");
        let claim = node("bn-a", 1, "req-2", "small");
        let key = claim.key.clone();
        w.put_slot(claim);
        assert_eq!(w.take_wakes(0), vec![behind.clone()]);
        w.remove_slot(&key, 3);
        let mut again = node("bn-a", 1, "req-3", "small");
        again.revision = 4;
        w.put_slot(again);
        assert_eq!(w.used_count(&BackingId::parse("bn-a").unwrap()), 2);
        assert!(
            !w.take_wakes(0).contains(&behind),
            "woken once; a look that finds it behind again notes it again"
        );
    }

    #[test]
    fn demand_counts_unclaimed_labels_only() {
        let mut w = World::default();
        let req = request("req-1", &["small", "small", "big"]);
        w.put_request(Versioned {
            key: "req-1".into(),
            revision: 1,
            value: req,
        });
        w.put_slot(node("bn-a", 0, "req-1", "small"));
        assert_eq!(w.unmet_demand("small"), 1);
        assert_eq!(w.unmet_demand("big"), 1);
        w.remove_slot("bn-a.0", 3);
        assert_eq!(w.unmet_demand("small"), 2);
        assert!(w
            .last_release
            .contains_key(&BackingId::parse("bn-a").unwrap()));
    }

    /// The node a request at the back of the queue would get now, as (backing id, slot);
    /// the reservation is given back.
    fn peek(w: &mut World, label: &str) -> Option<(String, u32)> {
        let r = w.reserve_slot(&pos(100, 1, "req-peek"), label, 0)?;
        w.unreserve(&r);
        w.check_capacity_index();
        Some((r.backing_id.to_string(), r.slot))
    }

    fn two_ready_nodes() -> World {
        let mut w = World::default();
        for id in ["bn-a", "bn-b"] {
            w.put_backing(backing(id, "small", 2, BackingState::Ready));
            w.put_agent(agent(id));
        }
        w.put_slot(node("bn-b", 0, "req-x", "small"));
        w.check_capacity_index();
        w
    }

    fn with_state(id: &str, state: BackingState, revision: u64) -> Versioned<BackingNode> {
        let mut b = backing(id, "small", 2, state);
        b.revision = revision;
        b
    }

    #[test]
    fn the_index_follows_the_backing_state() {
        let mut w = two_ready_nodes();
        assert_eq!(peek(&mut w, "small"), Some(("bn-b".into(), 1)));
        assert_eq!(w.coming_capacity("small"), 3);

        w.put_backing(with_state("bn-b", BackingState::Retiring, 2));
        assert_eq!(peek(&mut w, "small"), Some(("bn-a".into(), 0)));
        assert_eq!(w.coming_capacity("small"), 2);

        let mut held = with_state("bn-a", BackingState::Ready, 2);
        held.value.idle = IdleBehaviour::Hold;
        w.put_backing(held);
        assert_eq!(peek(&mut w, "small"), None);
        assert_eq!(w.coming_capacity("small"), 0);

        w.put_backing(with_state("bn-a", BackingState::Ready, 3));
        assert_eq!(peek(&mut w, "small"), Some(("bn-a".into(), 0)));

        w.remove_backing("p.main.bn-a", 4);
        assert_eq!(peek(&mut w, "small"), None);
        w.put_backing(with_state("bn-c", BackingState::Launching, 1));
        assert_eq!(w.coming_capacity("small"), 2, "a booting node counts whole");
        w.check_capacity_index();
    }

    #[test]
    fn a_slot_being_released_is_coming_back_but_not_free() {
        let mut w = two_ready_nodes();
        assert_eq!(
            (w.coming_capacity("small"), w.capacity.free("small")),
            (3, 3)
        );
        let mut releasing = node("bn-b", 0, "req-x", "small");
        releasing.revision = 3;
        releasing.value.state = NodeState::Releasing;
        w.put_slot(releasing);
        assert_eq!(
            w.coming_capacity("small"),
            4,
            "the planner launches nothing for a request the release will serve"
        );
        assert_eq!(
            w.capacity.free("small"),
            3,
            "nobody claims it before it is back"
        );
        w.check_capacity_index();
    }

    #[test]
    fn a_seat_out_of_capacity_brings_nothing_until_it_launches() {
        let mut w = World::default();
        let mut b = with_state("bn-c", BackingState::Launching, 1);
        b.value.out_of_capacity = true;
        w.put_backing(b.clone());
        assert_eq!(w.coming_capacity("small"), 0);
        w.check_capacity_index();
        b.revision = 2;
        b.value.out_of_capacity = false;
        w.put_backing(b);
        assert_eq!(w.coming_capacity("small"), 2, "launched again: coming");
        w.check_capacity_index();
    }

    #[test]
    fn an_unreadable_slot_counts_as_occupied_until_replaced_or_deleted() {
        let mut w = two_ready_nodes();
        assert!(w.put_unreadable_slot("bn-b.1", 5));
        assert!(
            !w.put_unreadable_slot("bn-b.1", 5),
            "reported once per revision"
        );
        assert_eq!(peek(&mut w, "small"), Some(("bn-a".into(), 0)));
        assert_eq!(w.coming_capacity("small"), 2, "never counted as free");
        assert!(
            w.reserve_slot_avoiding(0, &pos(100, 1, "req-1"), "small", |k| k == "bn-a.0", 0)
                .is_some_and(|r| r.key() == "bn-a.1"),
            "a slot passed over moves the claim on to the node's next free one"
        );
        w.reserved.clear();
        w.restand_backing(&BackingId::parse("bn-a").unwrap());
        let mut readable = node("bn-b", 1, "req-y", "small");
        readable.revision = 4;
        w.put_slot(readable.clone());
        assert!(w.unreadable_slots.contains_key("bn-b.1"), "an older record");
        readable.revision = 6;
        w.put_slot(readable);
        assert!(w.unreadable_slots.is_empty());
        assert!(w.put_unreadable_slot("bn-b.1", 7));
        w.remove_slot("bn-b.1", 8);
        assert_eq!(peek(&mut w, "small"), Some(("bn-b".into(), 1)));
        assert_eq!(w.coming_capacity("small"), 3);
        w.check_capacity_index();
    }

    #[test]
    fn a_claim_older_than_its_slots_deletion_is_not_brought_back() {
        let mut w = two_ready_nodes();
        let mut claim = node("bn-a", 0, "req-z", "small");
        claim.revision = 10;
        w.put_slot(claim.clone());
        w.remove_slot("bn-a.0", 12);
        w.put_slot(claim.clone());
        assert!(!w.slots.contains_key("bn-a.0"), "a stale claim came back");
        assert!(w.nodes_of(&RequestId::parse("req-z").unwrap()).is_empty());
        claim.revision = 13;
        w.put_slot(claim);
        assert!(w.slots.contains_key("bn-a.0"), "a newer claim is taken");
        w.check_capacity_index();
    }

    #[test]
    fn a_node_given_back_stays_given_back_until_the_mirror_drops_it() {
        let mut w = two_ready_nodes();
        let mut claim = node("bn-a", 0, "req-z", "small");
        claim.revision = 10;
        w.put_slot(claim.clone());
        let id = claim.value.id.clone();
        w.give_back(&id);
        assert!(w.given_back.contains(&id));
        // A newer record of the same node (the watch catching up) keeps it given back.
        claim.revision = 11;
        w.put_slot(claim.clone());
        assert!(w.given_back.contains(&id));
        w.remove_slot("bn-a.0", 12);
        assert!(w.given_back.is_empty(), "forgotten with the node");
        // A node the mirror does not hold is not remembered.
        w.give_back(&id);
        assert!(w.given_back.is_empty());
        // Another node in the slot is not the one given back.
        claim.revision = 15;
        w.put_slot(claim.clone());
        w.give_back(&id);
        assert!(w.given_back.contains(&id));
        let mut other = node("bn-a", 0, "req-y", "small");
        other.revision = 20;
        w.put_slot(other.clone());
        assert!(!w.given_back.contains(&other.value.id));
        assert!(w.given_back.is_empty());
        w.check_capacity_index();
    }

    #[test]
    fn the_index_follows_the_agents() {
        let mut w = two_ready_nodes();
        let mut draining = agent("bn-b");
        draining.draining = true;
        assert!(w.put_agent(draining.clone()));
        assert!(
            !w.put_agent(draining),
            "the same report again changes nothing"
        );
        assert_eq!(peek(&mut w, "small"), Some(("bn-a".into(), 0)));

        w.remove_agent("bn-a");
        assert_eq!(peek(&mut w, "small"), None, "no agent, no slots");
        assert_eq!(w.coming_capacity("small"), 0);

        assert!(w.put_agent(agent("bn-a")));
        assert!(w.put_agent(agent("bn-b")));
        assert_eq!(peek(&mut w, "small"), Some(("bn-b".into(), 1)));

        let mut dirty = agent("bn-b");
        dirty.dirty_slots = vec![1];
        assert!(w.put_agent(dirty));
        assert_eq!(
            peek(&mut w, "small"),
            Some(("bn-a".into(), 0)),
            "a node whose only free slot is dirty has nothing to hand out"
        );
        assert_eq!(
            w.coming_capacity("small"),
            3,
            "capacity counts slots not in use, dirty or not"
        );
    }

    #[test]
    fn a_node_whose_machine_is_being_taken_back_gets_no_slot_from_then_on() {
        use slotpool_protocol::model::{Interruption, InterruptionAction};
        let mut w = two_ready_nodes();
        assert_eq!(peek(&mut w, "small"), Some(("bn-b".into(), 1)));
        assert_eq!(w.coming_capacity("small"), 3);
        let mut noticed = agent("bn-b");
        noticed.interruption = Some(Interruption {
            action: InterruptionAction::Terminate,
            at: Some(120_000),
            noticed_at: 1_000,
        });
        assert!(w.put_agent(noticed.clone()), "a notice is news");
        assert!(!w.put_agent(noticed), "the same notice again is not");
        assert_eq!(
            peek(&mut w, "small"),
            Some(("bn-a".into(), 0)),
            "the next claim goes elsewhere"
        );
        assert_eq!(
            w.coming_capacity("small"),
            2,
            "its free slot is no capacity: a replacement is planned for the demand"
        );
    }

    #[test]
    fn the_index_follows_slots_and_reservations() {
        let mut w = two_ready_nodes();
        let me = pos(100, 1, "req-1");
        let first = w.reserve_slot(&me, "small", 0).unwrap();
        assert_eq!((first.backing_id.as_str(), first.slot), ("bn-b", 1));
        w.check_capacity_index();
        let second = w.reserve_slot(&me, "small", 0).unwrap();
        assert_eq!(
            (second.backing_id.as_str(), second.slot),
            ("bn-a", 0),
            "bn-b has no slot left that is neither used nor reserved"
        );
        w.check_capacity_index();

        w.put_slot(node("bn-b", 1, "req-1", "small")); // the claim landed
        w.unreserve(&first);
        w.unreserve(&second);
        assert_eq!(w.coming_capacity("small"), 2);
        assert_eq!(peek(&mut w, "small"), Some(("bn-a".into(), 0)));

        w.remove_slot("bn-b.0", 3);
        assert_eq!(peek(&mut w, "small"), Some(("bn-b".into(), 0)));
        assert_eq!(w.coming_capacity("small"), 3);
        w.put_slot(node("bn-a", 0, "req-2", "small"));
        w.put_slot(node("bn-a", 1, "req-2", "small"));
        // A claim written over the deletion (revision 3) comes after it.
        w.put_slot(Versioned {
            revision: 4,
            ..node("bn-b", 0, "req-2", "small")
        });
        assert_eq!(peek(&mut w, "small"), None, "every slot in use");
        assert_eq!(w.coming_capacity("small"), 0);
    }

    /// A small deterministic generator, so the sequence below can be replayed.
    struct XorShift(u64);

    impl XorShift {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    #[test]
    fn the_index_agrees_with_a_walk_over_every_node_after_any_change() {
        let states = [
            BackingState::Requested,
            BackingState::Launching,
            BackingState::Ready,
            BackingState::Ready,
            BackingState::Retiring,
            BackingState::Failed,
        ];
        let mut w = World::default();
        let mut rng = XorShift(0x5eed_1234_abcd);
        let mut revision = 1;
        let mut reservations = Vec::new();
        for step in 0..5_000 {
            revision += 1;
            // Five seats; a seat taken again gets a new backing id, as after a failure.
            let seat = rng.below(5);
            let id = format!("bn-s{seat}g{}", rng.below(2));
            let backing_id = BackingId::parse(&id).unwrap();
            let label = if rng.below(3) == 0 { "big" } else { "small" };
            let slot = rng.below(3) as u32;
            match rng.below(9) {
                0 | 1 => {
                    let state = states[rng.below(states.len() as u64) as usize];
                    let mut b = backing(&id, label, 1 + rng.below(3) as u32, state);
                    b.key = format!("p.main.{seat}");
                    b.revision = revision;
                    if rng.below(5) == 0 {
                        b.value.idle = IdleBehaviour::Hold;
                    }
                    w.put_backing(b);
                }
                2 => w.remove_backing(&format!("p.main.{seat}"), revision),
                3 => {
                    let mut a = agent(&id);
                    a.health.healthy = rng.below(6) != 0;
                    a.draining = rng.below(6) == 0;
                    if rng.below(4) == 0 {
                        a.dirty_slots = vec![slot];
                    }
                    w.put_agent(a);
                }
                4 => w.remove_agent(&id),
                5 => {
                    let mut n = node(&id, slot, "req-r", label);
                    n.revision = revision;
                    if rng.below(3) == 0 {
                        n.value.state = NodeState::Releasing;
                    }
                    w.put_slot(n);
                }
                6 => w.remove_slot(&layout::slot_key(&backing_id, slot), revision),
                7 => {
                    if let Some(r) = w.reserve_slot(&pos(100, step, "req-r"), label, 0) {
                        assert!(!w
                            .used
                            .get(&r.backing_id)
                            .is_some_and(|u| u.contains(&r.slot)));
                        reservations.push(r);
                    }
                }
                _ => {
                    if !reservations.is_empty() {
                        let i = rng.below(reservations.len() as u64) as usize;
                        let r = reservations.swap_remove(i);
                        w.unreserve(&r);
                    }
                }
            }
            w.check_capacity_index();
        }
    }
}
