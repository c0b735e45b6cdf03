//! The console's state and its reducer: [`update`] takes a [`Msg`] (a batch of watch
//! changes, a key, a tick, an order's result) and changes [`State`]; [`State::settle`]
//! then rebuilds the derived view model (pool aggregates, sorted and filtered rows).
//!
//! Pure: no NATS, no terminal, no clock. The time is whatever the last [`Msg::Tick`] said,
//! so every timer here is computed from the records and that `now`.

use crate::rules::Rules;
use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use slotpool_config::timing;
use slotpool_protocol::model::{
    AgentHeartbeat, BackingNode, BackingState, Event, IdleBehaviour, Node, NodeRequest, NodeState,
    OperatorAction, RequestState,
};
use slotpool_protocol::time::UnixMillis;
use slotpool_protocol::{BackingId, NodeId};
use std::collections::{BTreeMap, HashMap};

/// How many event log entries the console keeps (and asks the watch for).
pub const EVENT_HISTORY: usize = 500;
/// Longest reason an operator can type.
pub const MAX_REASON_CHARS: usize = 200;

/// The buckets the console watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Bucket {
    Backing,
    Slots,
    Requests,
    Agents,
    Events,
}

impl Bucket {
    pub const ALL: [Bucket; 5] = [
        Bucket::Backing,
        Bucket::Slots,
        Bucket::Requests,
        Bucket::Agents,
        Bucket::Events,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// A decoded record from a watch.
#[derive(Clone, Debug)]
pub enum Record {
    Backing(Box<BackingNode>),
    Slot(Box<Node>),
    Request(Box<NodeRequest>),
    Agent(Box<AgentHeartbeat>),
    Event(Box<Event>),
}

impl Record {
    pub fn bucket(&self) -> Bucket {
        match self {
            Record::Backing(_) => Bucket::Backing,
            Record::Slot(_) => Bucket::Slots,
            Record::Request(_) => Bucket::Requests,
            Record::Agent(_) => Bucket::Agents,
            Record::Event(_) => Bucket::Events,
        }
    }
}

/// What a watch reports.
#[derive(Clone, Debug)]
pub enum Change {
    Put {
        key: String,
        record: Record,
    },
    Removed {
        bucket: Bucket,
        key: String,
    },
    /// Everything that existed when the watch (re)started has been delivered: keys not
    /// seen since [`Change::Restarted`] are gone.
    Synced(Bucket),
    /// A new watch of the bucket starts (first start, or after the connection came back).
    Restarted(Bucket),
    /// The watch failed; the feed retries.
    Failed {
        bucket: Bucket,
        error: String,
    },
}

/// Everything that changes the state.
#[derive(Clone, Debug)]
pub enum Msg {
    /// A batch of watch changes (applied together, rendered once).
    Feed(Vec<Change>),
    /// The NATS connection went down (false) or came back (true).
    Link(bool),
    Key(KeyEvent),
    /// The terminal's size.
    Resize(u16, u16),
    /// The time now, in ms since the epoch.
    Tick(UnixMillis),
    /// An order came back: `Ok(message)` or `Err(error)`.
    OrderDone {
        what: String,
        result: Result<String, String>,
    },
}

/// What the reducer asks the event loop to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    Quit,
    Order {
        action: OperatorAction,
        backing_id: BackingId,
        reason: Option<String>,
    },
    ReleaseNode {
        node_id: NodeId,
        reason: Option<String>,
    },
}

/// The views, in Tab order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum View {
    Pools,
    Backing,
    Slots,
    Requests,
    Events,
}

impl View {
    pub const ALL: [View; 5] = [
        View::Pools,
        View::Backing,
        View::Slots,
        View::Requests,
        View::Events,
    ];

    pub fn title(self) -> &'static str {
        match self {
            View::Pools => "Pools",
            View::Backing => "Backing nodes",
            View::Slots => "Slots",
            View::Requests => "Requests",
            View::Events => "Events",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// The columns `s` cycles through.
    pub fn sorts(self) -> &'static [&'static str] {
        match self {
            View::Pools => &["pool", "waiting", "used"],
            View::Backing => &["seat", "state", "age", "used", "label", "timer"],
            View::Slots => &["slot", "state", "held"],
            View::Requests => &["age", "state", "requestor"],
            View::Events => &["time", "kind"],
        }
    }
}

/// Selection, scroll, filter and sort of one view.
#[derive(Clone, Debug, Default)]
pub struct ViewState {
    /// Index into the view's rows.
    pub selected: usize,
    /// The selected row's key, so the selection follows its row when rows move.
    pub selected_key: Option<String>,
    /// First row shown.
    pub offset: usize,
    pub filter: String,
    /// Index into [`View::sorts`].
    pub sort: usize,
    pub reverse: bool,
    /// The rows' keys after filter and sort.
    pub rows: Vec<String>,
}

/// A modal input, if one is open.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    None,
    /// Typing a filter for the current view.
    Filter(String),
    Help,
    /// A destructive order waiting for confirmation, with the reason typed so far.
    Confirm {
        order: PendingOrder,
        reason: String,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub enum PendingOrder {
    Kill(BackingId),
    Release(NodeId),
}

impl PendingOrder {
    pub fn describe(&self) -> String {
        match self {
            PendingOrder::Kill(id) => {
                format!("Kill backing node {id} now? Its slots fail and their requestors see why.")
            }
            PendingOrder::Release(id) => format!("Release node {id}? Its requestor loses it."),
        }
    }
}

/// One line of the status bar.
#[derive(Clone, Debug, PartialEq)]
pub struct Status {
    pub text: String,
    pub error: bool,
}

/// A record with the watch epoch it was last seen in.
#[derive(Clone, Debug)]
struct Seen<T> {
    value: T,
    epoch: u32,
}

/// Per (provider, pool, label): what the Pools view shows.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct PoolRow {
    pub provider: String,
    pub pool: String,
    pub label: String,
    /// Backing nodes per state: requested, launching, ready, retiring, releasing, failed.
    pub by_state: [usize; 6],
    pub used: u32,
    pub total: u32,
    pub max_servers: Option<u32>,
    pub waiting: usize,
    /// Age of the oldest waiting request for the label.
    pub oldest_wait_ms: Option<u64>,
}

impl PoolRow {
    pub fn key(&self) -> String {
        format!("{}/{}/{}", self.provider, self.pool, self.label)
    }
    pub fn nodes(&self) -> usize {
        self.by_state.iter().sum()
    }
}

fn state_slot(s: BackingState) -> Option<usize> {
    match s {
        BackingState::Requested => Some(0),
        BackingState::Launching => Some(1),
        BackingState::Ready => Some(2),
        BackingState::Retiring => Some(3),
        BackingState::Releasing => Some(4),
        BackingState::Failed => Some(5),
        BackingState::Gone => None,
    }
}

/// When an empty backing node goes away, as far as the console can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdleTimer {
    /// In use, or not in a state where idleness matters.
    None,
    /// Released this many ms from now (grace-time and min-retention from the config).
    ReleaseIn(u64),
    /// Empty for this many ms (no config: the grace-time is unknown).
    IdleFor(u64),
    /// `hold`: never released automatically.
    Held,
    /// `drain`: released as soon as it is empty.
    Draining,
}

/// The agent's heartbeat as the console judges it.
#[derive(Clone, Debug, PartialEq)]
pub enum Heartbeat {
    /// No heartbeat record (never, or it expired).
    Missing,
    /// A heartbeat with another secret than the backing node's: not the launched instance.
    Impostor {
        age_ms: u64,
    },
    Healthy {
        age_ms: u64,
    },
    Unhealthy {
        age_ms: u64,
        reason: String,
    },
    /// The agent is shutting down.
    Draining {
        age_ms: u64,
    },
}

impl Heartbeat {
    pub fn is_bad(&self) -> bool {
        !matches!(self, Heartbeat::Healthy { .. })
    }
}

/// The Backing nodes view's model of one row.
#[derive(Clone, Debug, PartialEq)]
pub struct BackingRow {
    pub key: String,
    pub id: String,
    pub provider: String,
    pub pool: String,
    pub seat: u32,
    pub label: String,
    pub state: BackingState,
    pub idle: IdleBehaviour,
    pub used: u32,
    pub slots: u32,
    pub age_ms: u64,
    pub timer: IdleTimer,
    /// Until min-retention-time is over, if it still applies.
    pub retained_ms: Option<u64>,
    /// Until max-age is reached (negative: past it).
    pub max_age_ms: Option<i64>,
    pub heartbeat: Heartbeat,
    /// Why it failed, or why its agent is unhealthy.
    pub reason: Option<String>,
    /// The last operator order, as "drain by alice: reason".
    pub order: Option<String>,
}

/// One slot of the selected backing node.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotRow {
    pub slot: u32,
    pub node: Option<Node>,
    pub held_ms: Option<u64>,
}

/// The whole console state.
#[derive(Debug)]
pub struct State {
    pub now: UnixMillis,
    pub rules: Rules,
    /// Where the console is connected (shown in the header).
    pub endpoint: String,
    pub link_up: bool,
    pub view: View,
    pub views: [ViewState; 5],
    pub input: Input,
    pub status: Option<Status>,
    pub size: (u16, u16),
    /// The backing node whose slots the Slots view shows.
    pub focus: Option<String>,
    backing: HashMap<String, Seen<BackingNode>>,
    slots: HashMap<String, Seen<Node>>,
    requests: HashMap<String, Seen<NodeRequest>>,
    agents: HashMap<String, Seen<AgentHeartbeat>>,
    events: BTreeMap<String, Seen<Event>>,
    epochs: [u32; 5],
    synced: [bool; 5],
    dirty: bool,
    /// Derived by [`State::settle`].
    pools: Vec<PoolRow>,
    used_by_backing: HashMap<String, u32>,
    backing_by_id: HashMap<String, String>,
    /// When a slot of each backing node (by id) was last seen coming back: a term of the
    /// release rule ([`slotpool_config::timing::release_at`]).
    last_release: HashMap<String, UnixMillis>,
}

impl State {
    pub fn new(rules: Rules, endpoint: impl Into<String>) -> State {
        State {
            now: 0,
            rules,
            endpoint: endpoint.into(),
            link_up: true,
            view: View::Backing,
            views: Default::default(),
            input: Input::None,
            status: None,
            size: (80, 24),
            focus: None,
            backing: HashMap::new(),
            slots: HashMap::new(),
            requests: HashMap::new(),
            agents: HashMap::new(),
            events: BTreeMap::new(),
            epochs: [0; 5],
            synced: [false; 5],
            dirty: true,
            pools: Vec::new(),
            used_by_backing: HashMap::new(),
            backing_by_id: HashMap::new(),
            last_release: HashMap::new(),
        }
    }

    /// Whether every bucket's initial values have arrived.
    pub fn loaded(&self) -> bool {
        self.synced.iter().all(|s| *s)
    }

    pub fn backing_count(&self) -> usize {
        self.backing.len()
    }

    pub fn pools(&self) -> &[PoolRow] {
        &self.pools
    }

    pub fn view_state(&self) -> &ViewState {
        &self.views[self.view.index()]
    }

    fn view_state_mut(&mut self) -> &mut ViewState {
        &mut self.views[self.view.index()]
    }

    /// Rows of the table body that fit on screen (see `view::layout`).
    pub fn page_rows(&self) -> usize {
        crate::view::table_rows(self.size, self.view) as usize
    }

    /// Totals for the header: backing nodes, slots used, slots total, waiting requests.
    pub fn totals(&self) -> (usize, u32, u32, usize) {
        let used = self.slots.len() as u32;
        let total = self.backing.values().map(|b| b.value.slots).sum();
        let waiting = self
            .requests
            .values()
            .filter(|r| r.value.state == RequestState::Requested)
            .count();
        (self.backing.len(), used, total, waiting)
    }

    fn apply(&mut self, change: Change) {
        match change {
            Change::Put { key, record } => {
                let epoch = self.epochs[record.bucket().index()];
                match record {
                    Record::Backing(v) => {
                        self.backing.insert(key, Seen { value: *v, epoch });
                    }
                    Record::Slot(v) => {
                        self.slots.insert(key, Seen { value: *v, epoch });
                    }
                    Record::Request(v) => {
                        self.requests.insert(key, Seen { value: *v, epoch });
                    }
                    Record::Agent(v) => {
                        self.agents.insert(key, Seen { value: *v, epoch });
                    }
                    Record::Event(v) => {
                        self.events.insert(key, Seen { value: *v, epoch });
                        while self.events.len() > EVENT_HISTORY {
                            self.events.pop_first();
                        }
                    }
                }
            }
            Change::Removed { bucket, key } => match bucket {
                Bucket::Backing => drop(self.backing.remove(&key)),
                Bucket::Slots => {
                    if let Some(gone) = self.slots.remove(&key) {
                        self.last_release
                            .insert(gone.value.backing_id.to_string(), self.now);
                    }
                }
                Bucket::Requests => drop(self.requests.remove(&key)),
                Bucket::Agents => drop(self.agents.remove(&key)),
                Bucket::Events => drop(self.events.remove(&key)),
            },
            Change::Restarted(bucket) => {
                self.epochs[bucket.index()] += 1;
                self.synced[bucket.index()] = false;
            }
            Change::Synced(bucket) => {
                let epoch = self.epochs[bucket.index()];
                match bucket {
                    Bucket::Backing => self.backing.retain(|_, s| s.epoch == epoch),
                    Bucket::Slots => self.slots.retain(|_, s| s.epoch == epoch),
                    Bucket::Requests => self.requests.retain(|_, s| s.epoch == epoch),
                    Bucket::Agents => self.agents.retain(|_, s| s.epoch == epoch),
                    Bucket::Events => self.events.retain(|_, s| s.epoch == epoch),
                }
                self.synced[bucket.index()] = true;
            }
            Change::Failed { bucket, error } => {
                self.status = Some(Status {
                    text: format!("watch of {bucket:?} failed: {error}; retrying"),
                    error: true,
                });
            }
        }
        self.dirty = true;
    }

    /// Rebuilds the derived view model if anything changed since the last call.
    pub fn settle(&mut self) {
        if !self.dirty {
            return;
        }
        self.dirty = false;
        self.used_by_backing.clear();
        for s in self.slots.values() {
            *self
                .used_by_backing
                .entry(s.value.backing_id.to_string())
                .or_default() += 1;
        }
        self.backing_by_id = self
            .backing
            .iter()
            .map(|(k, b)| (b.value.id.to_string(), k.clone()))
            .collect();
        self.pools = self.aggregate_pools();
        for view in View::ALL {
            let rows = self.rows_of(view);
            let vs = &mut self.views[view.index()];
            // The event log follows the newest entry while the selection is on top.
            let follow = view == View::Events && vs.selected == 0;
            vs.rows = rows;
            if follow {
                vs.selected_key = None;
            }
            if let Some(key) = &vs.selected_key {
                if let Some(i) = vs.rows.iter().position(|k| k == key) {
                    vs.selected = i;
                }
            }
            vs.selected = vs.selected.min(vs.rows.len().saturating_sub(1));
            vs.selected_key = vs.rows.get(vs.selected).cloned();
        }
        if self.focus.is_none() {
            self.focus = self.views[View::Backing.index()]
                .selected_key
                .as_ref()
                .and_then(|k| self.backing.get(k))
                .map(|b| b.value.id.to_string());
        }
        for i in 0..self.views.len() {
            self.scroll_into_view(i);
        }
    }

    fn scroll_into_view(&mut self, view_index: usize) {
        let page = crate::view::table_rows(self.size, View::ALL[view_index]).max(1) as usize;
        let vs = &mut self.views[view_index];
        if vs.selected < vs.offset {
            vs.offset = vs.selected;
        } else if vs.selected >= vs.offset + page {
            vs.offset = vs.selected + 1 - page;
        }
        vs.offset = vs.offset.min(vs.rows.len().saturating_sub(page));
    }

    fn aggregate_pools(&self) -> Vec<PoolRow> {
        let mut rows: BTreeMap<(String, String, String), PoolRow> = BTreeMap::new();
        for site in self.rules.sites() {
            rows.insert(
                (site.0.clone(), site.1.clone(), site.2.clone()),
                PoolRow {
                    provider: site.0.clone(),
                    pool: site.1.clone(),
                    label: site.2.clone(),
                    ..Default::default()
                },
            );
        }
        for b in self.backing.values() {
            let b = &b.value;
            let row = rows
                .entry((b.provider.clone(), b.pool.clone(), b.label.clone()))
                .or_insert_with(|| PoolRow {
                    provider: b.provider.clone(),
                    pool: b.pool.clone(),
                    label: b.label.clone(),
                    ..Default::default()
                });
            if let Some(i) = state_slot(b.state) {
                row.by_state[i] += 1;
            }
            row.total += b.slots;
            row.used += self
                .used_by_backing
                .get(b.id.as_str())
                .copied()
                .unwrap_or(0);
        }
        let mut waiting: HashMap<&str, (usize, u64)> = HashMap::new();
        for r in self.requests.values() {
            let r = &r.value;
            if r.state != RequestState::Requested {
                continue;
            }
            let mut labels: Vec<&str> = r.labels.iter().map(String::as_str).collect();
            labels.sort();
            labels.dedup();
            for l in labels {
                let w = waiting.entry(l).or_insert((0, u64::MAX));
                w.0 += 1;
                w.1 = w.1.min(r.created_at);
            }
        }
        for label in waiting.keys() {
            if !rows.keys().any(|k| k.2 == *label) {
                rows.insert(
                    ("-".into(), "-".into(), label.to_string()),
                    PoolRow {
                        provider: "-".into(),
                        pool: "-".into(),
                        label: label.to_string(),
                        ..Default::default()
                    },
                );
            }
        }
        rows.into_values()
            .map(|mut row| {
                row.max_servers = self.rules.max_servers(&row.provider, &row.pool);
                if let Some((n, oldest)) = waiting.get(row.label.as_str()) {
                    row.waiting = *n;
                    row.oldest_wait_ms = Some(self.now.saturating_sub(*oldest));
                }
                row
            })
            .collect()
    }

    fn matches(filter: &str, haystack: &[&str]) -> bool {
        if filter.is_empty() {
            return true;
        }
        let needle = filter.to_lowercase();
        haystack.iter().any(|h| h.to_lowercase().contains(&needle))
    }

    fn rows_of<'s>(&'s self, view: View) -> Vec<String> {
        let vs = &self.views[view.index()];
        let filter = vs.filter.as_str();
        let sort = view.sorts()[vs.sort.min(view.sorts().len() - 1)];
        let mut rows: Vec<String> = match view {
            View::Pools => {
                let mut pools: Vec<&PoolRow> = self
                    .pools
                    .iter()
                    .filter(|p| Self::matches(filter, &[&p.provider, &p.pool, &p.label]))
                    .collect();
                match sort {
                    "waiting" => pools.sort_by_key(|p| std::cmp::Reverse(p.waiting)),
                    "used" => pools.sort_by_key(|p| std::cmp::Reverse(p.used)),
                    _ => {}
                }
                pools.into_iter().map(PoolRow::key).collect()
            }
            View::Backing => {
                let mut nodes: Vec<(&String, &BackingNode)> = self
                    .backing
                    .iter()
                    .map(|(k, b)| (k, &b.value))
                    .filter(|(k, b)| {
                        Self::matches(
                            filter,
                            &[
                                k,
                                b.id.as_str(),
                                &b.label,
                                state_name(b.state),
                                idle_name(b.idle),
                                b.failure.as_deref().unwrap_or(""),
                            ],
                        )
                    })
                    .collect();
                // Keys borrow from the records: no allocation per comparison.
                let seat = |&(k, b): &(&'s String, &'s BackingNode)| {
                    (b.provider.as_str(), b.pool.as_str(), b.seat, k.as_str())
                };
                match sort {
                    "state" => nodes.sort_by_key(|n| (state_order(n.1.state), seat(n))),
                    "age" => nodes.sort_by_key(|n| (n.1.created_at, seat(n))),
                    "used" => nodes.sort_by_key(|n| {
                        (
                            std::cmp::Reverse(self.used_by_backing.get(n.1.id.as_str()).copied()),
                            seat(n),
                        )
                    }),
                    "label" => nodes.sort_by_key(|n| (n.1.label.as_str(), seat(n))),
                    "timer" => nodes.sort_by_cached_key(|n| {
                        let t = match self.idle_timer(n.1) {
                            IdleTimer::ReleaseIn(ms) => ms,
                            IdleTimer::Draining => 0,
                            IdleTimer::IdleFor(ms) => u64::MAX / 2 - ms,
                            _ => u64::MAX,
                        };
                        (t, seat(n))
                    }),
                    _ => nodes.sort_by_key(seat),
                }
                nodes.into_iter().map(|(k, _)| k.clone()).collect()
            }
            View::Slots => {
                let Some(b) = self.focused() else {
                    return Vec::new();
                };
                let mut slots: Vec<SlotRow> = self.slot_rows(b);
                slots.retain(|s| match &s.node {
                    Some(n) => Self::matches(
                        filter,
                        &[n.id.as_str(), &n.requestor, node_state_name(n.state)],
                    ),
                    None => Self::matches(filter, &["free"]),
                });
                match sort {
                    "state" => {
                        slots.sort_by_key(|s| (s.node.as_ref().map(|n| n.state as u8), s.slot))
                    }
                    "held" => slots.sort_by_key(|s| (std::cmp::Reverse(s.held_ms), s.slot)),
                    _ => {}
                }
                slots
                    .into_iter()
                    .map(|s| slotpool_protocol::layout::slot_key(&b.id, s.slot))
                    .collect()
            }
            View::Requests => {
                let mut reqs: Vec<(&String, &NodeRequest)> = self
                    .requests
                    .iter()
                    .map(|(k, r)| (k, &r.value))
                    .filter(|(_, r)| {
                        Self::matches(
                            filter,
                            &[
                                r.id.as_str(),
                                &r.requestor,
                                &r.labels.join(","),
                                request_state_name(r.state),
                                r.failure.as_deref().unwrap_or(""),
                            ],
                        )
                    })
                    .collect();
                match sort {
                    "state" => reqs.sort_by_key(|&(k, r)| {
                        (
                            r.state != RequestState::Requested,
                            r.state as u8,
                            std::cmp::Reverse(r.created_at),
                            k.as_str(),
                        )
                    }),
                    "requestor" => reqs.sort_by_key(|&(k, r)| (r.requestor.as_str(), k.as_str())),
                    // Waiting first, then newest first.
                    _ => reqs.sort_by_key(|&(k, r)| {
                        (
                            r.state != RequestState::Requested,
                            std::cmp::Reverse(r.created_at),
                            k.as_str(),
                        )
                    }),
                }
                reqs.into_iter().map(|(k, _)| k.clone()).collect()
            }
            View::Events => {
                let mut events: Vec<(&String, &Event)> = self
                    .events
                    .iter()
                    .rev()
                    .map(|(k, e)| (k, &e.value))
                    .filter(|(_, e)| {
                        Self::matches(
                            filter,
                            &[
                                &e.message,
                                &e.actor,
                                e.backing_id.as_ref().map(|b| b.as_str()).unwrap_or(""),
                                e.node_id.as_ref().map(|b| b.as_str()).unwrap_or(""),
                            ],
                        )
                    })
                    .collect();
                if sort == "kind" {
                    events.sort_by_key(|(_, e)| e.kind as u8);
                }
                events.into_iter().map(|(k, _)| k.clone()).collect()
            }
        };
        if vs.reverse {
            rows.reverse();
        }
        rows
    }

    /// The backing node the Slots view is about.
    pub fn focused(&self) -> Option<&BackingNode> {
        let id = self.focus.as_ref()?;
        let key = self.backing_by_id.get(id)?;
        self.backing.get(key).map(|b| &b.value)
    }

    pub fn slot_rows(&self, b: &BackingNode) -> Vec<SlotRow> {
        let mut out: Vec<SlotRow> = (0..b.slots)
            .map(|slot| {
                let node = self
                    .slots
                    .get(&slotpool_protocol::layout::slot_key(&b.id, slot))
                    .map(|s| s.value.clone());
                SlotRow {
                    slot,
                    held_ms: node
                        .as_ref()
                        .map(|n| self.now.saturating_sub(n.allocated_at)),
                    node,
                }
            })
            .collect();
        // Slot records beyond the node's slot count should not exist; show them anyway.
        for s in self.slots.values() {
            if s.value.backing_id == b.id && s.value.slot >= b.slots {
                out.push(SlotRow {
                    slot: s.value.slot,
                    held_ms: Some(self.now.saturating_sub(s.value.allocated_at)),
                    node: Some(s.value.clone()),
                });
            }
        }
        out
    }

    /// The Slots view row of `key` (a slot key).
    pub fn slot_row(&self, key: &str) -> Option<SlotRow> {
        let (backing, slot) = slotpool_protocol::layout::parse_slot_key(key)?;
        let node = self.slots.get(key).map(|s| s.value.clone());
        if node.is_none() && !self.backing_by_id.contains_key(backing.as_str()) {
            return None;
        }
        Some(SlotRow {
            slot,
            held_ms: node
                .as_ref()
                .map(|n| self.now.saturating_sub(n.allocated_at)),
            node,
        })
    }

    pub fn pool_row(&self, key: &str) -> Option<&PoolRow> {
        self.pools.iter().find(|p| p.key() == key)
    }

    pub fn request(&self, key: &str) -> Option<&NodeRequest> {
        self.requests.get(key).map(|r| &r.value)
    }

    pub fn event(&self, key: &str) -> Option<&Event> {
        self.events.get(key).map(|e| &e.value)
    }

    pub fn backing(&self, key: &str) -> Option<&BackingNode> {
        self.backing.get(key).map(|b| &b.value)
    }

    fn used(&self, b: &BackingNode) -> u32 {
        self.used_by_backing
            .get(b.id.as_str())
            .copied()
            .unwrap_or(0)
    }

    /// The idle timer of `b`, by the launcher's own rule ([`timing::release_at`]):
    /// grace-time counts from `idle_since` or the last slot seen coming back, and an
    /// empty node is never released before `launched_at + min-retention-time`.
    pub fn idle_timer(&self, b: &BackingNode) -> IdleTimer {
        if self.used(b) > 0 {
            return IdleTimer::None;
        }
        match (b.state, b.idle) {
            (BackingState::Ready | BackingState::Retiring, IdleBehaviour::Hold) => IdleTimer::Held,
            (BackingState::Ready | BackingState::Retiring, IdleBehaviour::Drain) => {
                IdleTimer::Draining
            }
            (BackingState::Ready, IdleBehaviour::Run) => {
                let Some(idle_since) = b.idle_since else {
                    return IdleTimer::None;
                };
                match self.rules.label(&b.provider, &b.pool, &b.label) {
                    Some(r) => {
                        let last_release = self.last_release.get(b.id.as_str()).copied();
                        let at = timing::release_at(b, last_release, self.now, &r.idle());
                        IdleTimer::ReleaseIn(at.saturating_sub(self.now))
                    }
                    None => IdleTimer::IdleFor(self.now.saturating_sub(idle_since)),
                }
            }
            _ => IdleTimer::None,
        }
    }

    /// The view model of one Backing nodes row.
    pub fn backing_row(&self, key: &str) -> Option<BackingRow> {
        let b = &self.backing.get(key)?.value;
        let rules = self.rules.label(&b.provider, &b.pool, &b.label);
        let launched = b.launched_at.unwrap_or(b.created_at);
        let retained_ms = rules
            .filter(|r| r.min_retention_ms > 0)
            .map(|r| (launched + r.min_retention_ms).saturating_sub(self.now))
            .filter(|ms| *ms > 0 && b.state == BackingState::Ready);
        let ages = b.state == BackingState::Ready;
        let max_age_ms = rules.filter(|r| ages && r.max_age_ms > 0).map(|r| {
            let at = b.ready_at.or(b.launched_at).unwrap_or(b.created_at) + r.max_age_ms;
            at as i64 - self.now as i64
        });
        let heartbeat = match self.agents.get(b.id.as_str()).map(|a| &a.value) {
            None => Heartbeat::Missing,
            Some(a) => {
                let age_ms = self.now.saturating_sub(a.sent_at);
                if !b.secret_sha256.is_empty() && a.secret_sha256 != b.secret_sha256 {
                    Heartbeat::Impostor { age_ms }
                } else if a.draining {
                    Heartbeat::Draining { age_ms }
                } else if !a.health.healthy {
                    Heartbeat::Unhealthy {
                        age_ms,
                        reason: a
                            .health
                            .reason
                            .clone()
                            .unwrap_or_else(|| "unhealthy".into()),
                    }
                } else {
                    Heartbeat::Healthy { age_ms }
                }
            }
        };
        let reason = match (&b.failure, &heartbeat) {
            (Some(f), _) if b.state == BackingState::Failed => Some(f.clone()),
            (_, Heartbeat::Unhealthy { reason, .. }) => Some(reason.clone()),
            (_, Heartbeat::Impostor { .. }) => Some("heartbeat has another secret".into()),
            (Some(f), _) => Some(f.clone()),
            _ => None,
        };
        Some(BackingRow {
            key: key.to_string(),
            id: b.id.to_string(),
            provider: b.provider.clone(),
            pool: b.pool.clone(),
            seat: b.seat,
            label: b.label.clone(),
            state: b.state,
            idle: b.idle,
            used: self.used(b),
            slots: b.slots,
            age_ms: self.now.saturating_sub(b.created_at),
            timer: self.idle_timer(b),
            retained_ms,
            max_age_ms,
            heartbeat,
            reason,
            order: b.order.as_ref().map(|o| {
                let mut s = format!("{} by {}", o.action.as_str(), o.actor);
                if let Some(r) = &o.reason {
                    s.push_str(": ");
                    s.push_str(r);
                }
                s
            }),
        })
    }

    /// The selected backing node (Backing view), or the focused one (Slots view).
    fn target_backing(&self) -> Option<&BackingNode> {
        match self.view {
            View::Backing => self
                .view_state()
                .selected_key
                .as_ref()
                .and_then(|k| self.backing.get(k))
                .map(|b| &b.value),
            View::Slots => self.focused(),
            _ => None,
        }
    }

    fn move_selection(&mut self, delta: isize) {
        let vs = self.view_state_mut();
        if vs.rows.is_empty() {
            return;
        }
        let last = vs.rows.len() as isize - 1;
        vs.selected = (vs.selected as isize + delta).clamp(0, last) as usize;
        vs.selected_key = vs.rows.get(vs.selected).cloned();
        if self.view == View::Backing {
            self.focus = self.target_backing().map(|b| b.id.to_string());
            self.dirty = true;
        }
        let i = self.view.index();
        self.scroll_into_view(i);
    }

    fn switch(&mut self, view: View) {
        self.view = view;
        self.dirty = true;
    }

    fn set_status(&mut self, text: impl Into<String>, error: bool) {
        self.status = Some(Status {
            text: text.into(),
            error,
        });
    }

    fn key(&mut self, key: KeyEvent) -> Option<Command> {
        let ctrl = key.modifiers.contains(KeyModifiers::CONTROL);
        if ctrl && key.code == KeyCode::Char('c') {
            return Some(Command::Quit);
        }
        match std::mem::replace(&mut self.input, Input::None) {
            Input::Help => {
                // Any key closes the help.
                return None;
            }
            Input::Filter(mut text) => {
                match key.code {
                    KeyCode::Esc => {}
                    KeyCode::Enter => {
                        self.view_state_mut().filter = text;
                        self.dirty = true;
                    }
                    KeyCode::Backspace => {
                        text.pop();
                        self.input = Input::Filter(text);
                    }
                    KeyCode::Char(c) if !ctrl => {
                        text.push(c);
                        self.input = Input::Filter(text);
                    }
                    _ => self.input = Input::Filter(text),
                }
                return None;
            }
            Input::Confirm { order, mut reason } => {
                match key.code {
                    KeyCode::Esc => self.set_status("canceled", false),
                    KeyCode::Enter => {
                        let reason = Some(reason.trim().to_string()).filter(|r| !r.is_empty());
                        return Some(match order {
                            PendingOrder::Kill(backing_id) => {
                                self.set_status(format!("kill {backing_id}: sent"), false);
                                Command::Order {
                                    action: OperatorAction::Kill,
                                    backing_id,
                                    reason,
                                }
                            }
                            PendingOrder::Release(node_id) => {
                                self.set_status(format!("release {node_id}: sent"), false);
                                Command::ReleaseNode { node_id, reason }
                            }
                        });
                    }
                    KeyCode::Backspace => {
                        reason.pop();
                        self.input = Input::Confirm { order, reason };
                    }
                    KeyCode::Char(c) if !ctrl => {
                        if reason.chars().count() < MAX_REASON_CHARS {
                            reason.push(c);
                        }
                        self.input = Input::Confirm { order, reason };
                    }
                    _ => self.input = Input::Confirm { order, reason },
                }
                return None;
            }
            Input::None => {}
        }
        let page = self.page_rows().max(1) as isize;
        match key.code {
            KeyCode::Char('q') => return Some(Command::Quit),
            KeyCode::Char('?') => self.input = Input::Help,
            KeyCode::Down | KeyCode::Char('j') => self.move_selection(1),
            KeyCode::Up | KeyCode::Char('k') => self.move_selection(-1),
            KeyCode::PageDown => self.move_selection(page),
            KeyCode::PageUp => self.move_selection(-page),
            KeyCode::Char('d') | KeyCode::Char('f') if ctrl => self.move_selection(page),
            KeyCode::Char('u') | KeyCode::Char('b') if ctrl => self.move_selection(-page),
            KeyCode::Home | KeyCode::Char('g') => self.move_selection(isize::MIN / 2),
            KeyCode::End | KeyCode::Char('G') => self.move_selection(isize::MAX / 2),
            KeyCode::Tab | KeyCode::Right | KeyCode::Char('l') => {
                self.switch(View::ALL[(self.view.index() + 1) % View::ALL.len()])
            }
            KeyCode::BackTab | KeyCode::Left | KeyCode::Char('h') => {
                self.switch(View::ALL[(self.view.index() + View::ALL.len() - 1) % View::ALL.len()])
            }
            KeyCode::Char(c @ '1'..='5') => self.switch(View::ALL[c as usize - '1' as usize]),
            KeyCode::Char('/') => self.input = Input::Filter(self.view_state().filter.clone()),
            KeyCode::Esc => {
                if !self.view_state().filter.is_empty() {
                    self.view_state_mut().filter.clear();
                    self.dirty = true;
                } else if self.view == View::Slots {
                    self.switch(View::Backing);
                }
            }
            KeyCode::Char('s') => {
                let n = self.view.sorts().len();
                let vs = self.view_state_mut();
                vs.sort = (vs.sort + 1) % n;
                self.dirty = true;
            }
            KeyCode::Char('S') => {
                let vs = self.view_state_mut();
                vs.reverse = !vs.reverse;
                self.dirty = true;
            }
            KeyCode::Enter => self.drill_in(),
            KeyCode::Char('H') => return self.backing_order(OperatorAction::Hold),
            KeyCode::Char('D') => return self.backing_order(OperatorAction::Drain),
            KeyCode::Char('R') => return self.backing_order(OperatorAction::Run),
            KeyCode::Char('K') => match self.target_backing() {
                Some(b) => {
                    self.input = Input::Confirm {
                        order: PendingOrder::Kill(b.id.clone()),
                        reason: String::new(),
                    }
                }
                None => self.set_status("kill: select a backing node first", true),
            },
            KeyCode::Char('X') => {
                let node = (self.view == View::Slots)
                    .then(|| self.view_state().selected_key.clone())
                    .flatten()
                    .and_then(|k| self.slot_row(&k))
                    .and_then(|r| r.node);
                match node {
                    Some(n) => {
                        self.input = Input::Confirm {
                            order: PendingOrder::Release(n.id),
                            reason: String::new(),
                        }
                    }
                    None => self.set_status("release: select a used slot in the Slots view", true),
                }
            }
            _ => {}
        }
        None
    }

    fn drill_in(&mut self) {
        match self.view {
            View::Pools => {
                let Some(row) = self
                    .view_state()
                    .selected_key
                    .as_ref()
                    .and_then(|k| self.pool_row(k))
                else {
                    return;
                };
                let filter = row.label.clone();
                self.views[View::Backing.index()].filter = filter;
                self.switch(View::Backing);
            }
            View::Backing => {
                if let Some(b) = self.target_backing() {
                    self.focus = Some(b.id.to_string());
                    self.views[View::Slots.index()].selected = 0;
                    self.views[View::Slots.index()].selected_key = None;
                    self.switch(View::Slots);
                }
            }
            View::Requests => {
                // Show the backing node of the request's first node.
                let node = self
                    .view_state()
                    .selected_key
                    .as_ref()
                    .and_then(|k| self.requests.get(k))
                    .and_then(|r| r.value.nodes.first().cloned());
                if let Some(id) = node.and_then(|n| backing_of_node(&n)) {
                    self.focus = Some(id);
                    self.switch(View::Slots);
                }
            }
            View::Slots | View::Events => {}
        }
    }

    fn backing_order(&mut self, action: OperatorAction) -> Option<Command> {
        match self.target_backing() {
            Some(b) => {
                let backing_id = b.id.clone();
                self.set_status(format!("{} {backing_id}: sent", action.as_str()), false);
                Some(Command::Order {
                    action,
                    backing_id,
                    reason: None,
                })
            }
            None => {
                self.set_status(
                    format!(
                        "{}: select a backing node (Backing or Slots view)",
                        action.as_str()
                    ),
                    true,
                );
                None
            }
        }
    }
}

/// The backing id a node id names (`node-<ulid>_<slot>_<backing id>`).
pub fn backing_of_node(node: &NodeId) -> Option<String> {
    let rest = node.as_str().strip_prefix("node-")?;
    let mut parts = rest.splitn(3, '_');
    parts.next()?;
    parts.next()?;
    parts.next().map(str::to_string)
}

/// Applies `msg`; returns what the event loop should do, if anything. Call
/// [`State::settle`] before drawing.
pub fn update(state: &mut State, msg: Msg) -> Option<Command> {
    match msg {
        Msg::Feed(changes) => {
            for c in changes {
                state.apply(c);
            }
            None
        }
        Msg::Link(up) => {
            state.link_up = up;
            None
        }
        Msg::Key(key) => state.key(key),
        Msg::Resize(w, h) => {
            state.size = (w, h);
            state.dirty = true;
            None
        }
        Msg::Tick(now) => {
            // Pool ages and timers are derived from `now`; rows only move for a timer sort.
            state.now = now;
            if state.view == View::Pools || state.view_state().sort != 0 {
                state.dirty = true;
            }
            None
        }
        Msg::OrderDone { what, result } => {
            match result {
                Ok(msg) => state.set_status(format!("{what}: {msg}"), false),
                Err(err) => state.set_status(format!("{what} failed: {err}"), true),
            }
            None
        }
    }
}

/// Applies every message then settles: the convenient form for tests.
pub fn apply_all(state: &mut State, msgs: impl IntoIterator<Item = Msg>) -> Vec<Command> {
    let out = msgs.into_iter().filter_map(|m| update(state, m)).collect();
    state.settle();
    out
}

pub fn state_name(s: BackingState) -> &'static str {
    match s {
        BackingState::Requested => "requested",
        BackingState::Launching => "launching",
        BackingState::Ready => "ready",
        BackingState::Retiring => "retiring",
        BackingState::Releasing => "releasing",
        BackingState::Gone => "gone",
        BackingState::Failed => "failed",
    }
}

fn state_order(s: BackingState) -> u8 {
    match s {
        BackingState::Failed => 0,
        BackingState::Releasing => 1,
        BackingState::Retiring => 2,
        BackingState::Launching => 3,
        BackingState::Requested => 4,
        BackingState::Ready => 5,
        BackingState::Gone => 6,
    }
}

pub fn idle_name(i: IdleBehaviour) -> &'static str {
    match i {
        IdleBehaviour::Run => "run",
        IdleBehaviour::Hold => "hold",
        IdleBehaviour::Drain => "drain",
    }
}

pub fn node_state_name(s: NodeState) -> &'static str {
    match s {
        NodeState::Preparing => "preparing",
        NodeState::Ready => "ready",
        NodeState::Releasing => "releasing",
        NodeState::Failed => "failed",
    }
}

pub fn request_state_name(s: RequestState) -> &'static str {
    match s {
        RequestState::Requested => "waiting",
        RequestState::Fulfilled => "fulfilled",
        RequestState::Failed => "failed",
        RequestState::Canceled => "canceled",
    }
}

/// A duration for humans: `42s`, `5m03s`, `2h05m`, `3d04h`.
pub fn fmt_duration(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::*;
    use crossterm::event::KeyEvent;
    use slotpool_protocol::model::EventKind;

    fn key(c: char) -> Msg {
        Msg::Key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE))
    }

    fn code(code: KeyCode) -> Msg {
        Msg::Key(KeyEvent::new(code, KeyModifiers::NONE))
    }

    fn selected_backing(state: &State) -> String {
        state.views[View::Backing.index()]
            .selected_key
            .clone()
            .unwrap()
    }

    #[test]
    fn pools_aggregate_nodes_slots_and_waiting_requests() {
        let state = loaded(rules(), sample(), 80, 24);
        let pools = state.pools();
        assert_eq!(pools.len(), 1, "{pools:?}");
        let p = &pools[0];
        assert_eq!(
            (p.provider.as_str(), p.pool.as_str(), p.label.as_str()),
            ("cloud", "main", "small")
        );
        // requested, launching, ready, retiring, releasing, failed
        assert_eq!(p.by_state, [0, 1, 2, 0, 0, 1]);
        assert_eq!((p.used, p.total), (2, 16));
        assert_eq!(p.max_servers, Some(4));
        assert_eq!(p.waiting, 1);
        assert_eq!(p.oldest_wait_ms, Some(75 * SEC));
    }

    #[test]
    fn waiting_labels_no_pool_serves_get_a_row() {
        let changes = vec![put(Record::Request(Box::new(request(
            "req-9",
            &["gpu"],
            RequestState::Requested,
            NOW - 5 * SEC,
        ))))];
        let state = loaded(Rules::unknown(), changes, 80, 24);
        assert_eq!(state.pools().len(), 1);
        assert_eq!(state.pools()[0].label, "gpu");
        assert_eq!(state.pools()[0].provider, "-");
        assert_eq!(state.pools()[0].waiting, 1);
    }

    #[test]
    fn idle_timer_counts_down_grace_time_and_respects_min_retention() {
        let mut b = backing(1, BackingState::Ready, 2);
        b.idle_since = Some(NOW - 42 * SEC);
        let key = "cloud.main.1";
        let state = loaded(
            rules(),
            vec![put(Record::Backing(Box::new(b.clone())))],
            80,
            24,
        );
        assert_eq!(
            state.backing_row(key).unwrap().timer,
            IdleTimer::ReleaseIn((300 - 42) * SEC)
        );

        // min-retention later than grace-time: it wins.
        let mut r = rules();
        r.insert(
            "cloud",
            "main",
            "small",
            crate::rules::LabelRules {
                grace_time_ms: 300 * SEC,
                min_retention_ms: 7200 * SEC,
                max_age_ms: 0,
            },
        );
        let state = loaded(r, vec![put(Record::Backing(Box::new(b.clone())))], 80, 24);
        let row = state.backing_row(key).unwrap();
        assert_eq!(row.timer, IdleTimer::ReleaseIn(3600 * SEC));
        assert_eq!(row.retained_ms, Some(3600 * SEC));
        assert_eq!(row.max_age_ms, None);

        // No config: how long it has been idle.
        let state = loaded(
            Rules::unknown(),
            vec![put(Record::Backing(Box::new(b.clone())))],
            80,
            24,
        );
        assert_eq!(
            state.backing_row(key).unwrap().timer,
            IdleTimer::IdleFor(42 * SEC)
        );

        // Hold and drain override grace-time.
        b.idle = IdleBehaviour::Hold;
        let state = loaded(
            rules(),
            vec![put(Record::Backing(Box::new(b.clone())))],
            80,
            24,
        );
        assert_eq!(state.backing_row(key).unwrap().timer, IdleTimer::Held);
        b.idle = IdleBehaviour::Drain;
        let state = loaded(
            rules(),
            vec![put(Record::Backing(Box::new(b.clone())))],
            80,
            24,
        );
        assert_eq!(state.backing_row(key).unwrap().timer, IdleTimer::Draining);
    }

    #[test]
    fn timers_follow_the_tick_without_reading_the_clock() {
        let mut state = loaded(rules(), sample(), 80, 24);
        let before = state.backing_row("cloud.main.1").unwrap();
        apply_all(&mut state, [Msg::Tick(NOW + 10 * SEC)]);
        let after = state.backing_row("cloud.main.1").unwrap();
        assert_eq!(before.timer, IdleTimer::ReleaseIn(258 * SEC));
        assert_eq!(after.timer, IdleTimer::ReleaseIn(248 * SEC));
        assert_eq!(
            after.max_age_ms,
            Some((24 * 3600 - 3500 - 10) as i64 * SEC as i64)
        );
    }

    #[test]
    fn a_used_node_has_no_idle_timer_and_shows_its_slots() {
        let state = loaded(rules(), sample(), 80, 24);
        let row = state.backing_row("cloud.main.0").unwrap();
        assert_eq!(row.timer, IdleTimer::None);
        assert_eq!((row.used, row.slots), (2, 4));
        assert_eq!(row.heartbeat, Heartbeat::Healthy { age_ms: SEC });
        let b = state.backing("cloud.main.0").unwrap().clone();
        let slots = state.slot_rows(&b);
        assert_eq!(slots.len(), 4);
        assert_eq!(slots[2].held_ms, Some(95 * SEC));
        assert!(slots[1].node.is_none());
    }

    #[test]
    fn heartbeat_health_and_failure_reasons() {
        let b = backing(0, BackingState::Ready, 2);
        let mut hb = agent(&b, NOW - 3 * SEC);
        hb.health.healthy = false;
        hb.health.reason = Some("disk 98% full".into());
        let state = loaded(
            rules(),
            vec![
                put(Record::Backing(Box::new(b.clone()))),
                put(Record::Agent(Box::new(hb.clone()))),
            ],
            80,
            24,
        );
        let row = state.backing_row("cloud.main.0").unwrap();
        assert!(row.heartbeat.is_bad());
        assert_eq!(row.reason.as_deref(), Some("disk 98% full"));

        hb.secret_sha256 = "other".into();
        let state = loaded(
            rules(),
            vec![
                put(Record::Backing(Box::new(b))),
                put(Record::Agent(Box::new(hb))),
            ],
            80,
            24,
        );
        let row = state.backing_row("cloud.main.0").unwrap();
        assert_eq!(row.heartbeat, Heartbeat::Impostor { age_ms: 3 * SEC });

        let state = loaded(rules(), sample(), 80, 24);
        let failed = state.backing_row("cloud.main.2").unwrap();
        assert_eq!(failed.reason.as_deref(), Some("agent heartbeat expired"));
        assert_eq!(failed.heartbeat, Heartbeat::Missing);
    }

    #[test]
    fn a_restarted_watch_reconciles_on_synced() {
        let mut state = loaded(rules(), sample(), 80, 24);
        assert_eq!(state.backing_count(), 4);
        // The watch restarts (connection came back); only seats 0 and 3 still exist.
        let again: Vec<Change> = sample()
            .into_iter()
            .filter(|c| matches!(c, Change::Put { key, .. } if key == "cloud.main.0" || key == "cloud.main.3"))
            .collect();
        let mut batch = vec![Change::Restarted(Bucket::Backing)];
        batch.extend(again);
        apply_all(&mut state, [Msg::Feed(batch)]);
        assert!(!state.loaded());
        assert_eq!(state.backing_count(), 4, "nothing dropped before Synced");
        apply_all(
            &mut state,
            [Msg::Feed(vec![Change::Synced(Bucket::Backing)])],
        );
        assert!(state.loaded());
        assert_eq!(state.backing_count(), 2);
        assert_eq!(
            state.view_state().rows,
            vec!["cloud.main.0", "cloud.main.3"]
        );
    }

    #[test]
    fn removals_and_puts_update_rows_and_selection_follows_its_row() {
        let mut state = loaded(rules(), sample(), 80, 24);
        assert_eq!(state.view, View::Backing);
        apply_all(&mut state, [key('j'), key('j')]);
        assert_eq!(selected_backing(&state), "cloud.main.2");
        // Sort by state: failed first; the selection stays on the failed node.
        apply_all(&mut state, [key('s')]);
        assert_eq!(state.view_state().rows[0], "cloud.main.2");
        assert_eq!(selected_backing(&state), "cloud.main.2");
        assert_eq!(state.view_state().selected, 0);
        // It goes away: the selection stays at its index.
        apply_all(
            &mut state,
            [Msg::Feed(vec![Change::Removed {
                bucket: Bucket::Backing,
                key: "cloud.main.2".into(),
            }])],
        );
        assert_eq!(state.backing_count(), 3);
        assert_eq!(state.view_state().rows.len(), 3);
        assert_eq!(state.view_state().selected, 0);
    }

    #[test]
    fn filter_and_reverse_sort() {
        let mut state = loaded(rules(), sample(), 80, 24);
        let mut msgs = vec![key('/')];
        msgs.extend("fail".chars().map(key));
        msgs.push(code(KeyCode::Enter));
        apply_all(&mut state, msgs);
        assert_eq!(state.view_state().filter, "fail");
        assert_eq!(state.view_state().rows, vec!["cloud.main.2"]);
        apply_all(&mut state, [code(KeyCode::Esc)]);
        assert_eq!(state.view_state().rows.len(), 4);
        apply_all(&mut state, [key('S')]);
        assert_eq!(state.view_state().rows[0], "cloud.main.3");
    }

    #[test]
    fn drain_hold_and_run_order_the_selected_node() {
        let mut state = loaded(rules(), sample(), 80, 24);
        let cmds = apply_all(&mut state, [key('j'), key('D')]);
        assert_eq!(
            cmds,
            vec![Command::Order {
                action: OperatorAction::Drain,
                backing_id: bid(1),
                reason: None
            }]
        );
        let cmds = apply_all(&mut state, [key('H'), key('R')]);
        assert_eq!(cmds.len(), 2);
        assert!(matches!(
            cmds[0],
            Command::Order {
                action: OperatorAction::Hold,
                ..
            }
        ));
        assert!(matches!(
            cmds[1],
            Command::Order {
                action: OperatorAction::Run,
                ..
            }
        ));
        // Not in the Events view.
        let cmds = apply_all(&mut state, [key('5'), key('D')]);
        assert!(cmds.is_empty());
        assert!(state.status.as_ref().unwrap().error);
    }

    #[test]
    fn kill_asks_for_confirmation_and_a_reason() {
        let mut state = loaded(rules(), sample(), 80, 24);
        let cmds = apply_all(&mut state, [key('K')]);
        assert!(cmds.is_empty());
        assert!(matches!(state.input, Input::Confirm { .. }));
        // Esc cancels.
        let cmds = apply_all(&mut state, [code(KeyCode::Esc)]);
        assert!(cmds.is_empty());
        assert_eq!(state.input, Input::None);
        let mut msgs = vec![key('K')];
        msgs.extend("bad disk".chars().map(key));
        msgs.push(code(KeyCode::Enter));
        let cmds = apply_all(&mut state, msgs);
        assert_eq!(
            cmds,
            vec![Command::Order {
                action: OperatorAction::Kill,
                backing_id: bid(0),
                reason: Some("bad disk".into())
            }]
        );
        // 'q' typed into the reason is text, not quit.
        let cmds = apply_all(&mut state, [key('K'), key('q')]);
        assert!(cmds.is_empty());
    }

    #[test]
    fn enter_drills_into_slots_and_x_releases_one() {
        let mut state = loaded(rules(), sample(), 80, 24);
        apply_all(&mut state, [code(KeyCode::Enter)]);
        assert_eq!(state.view, View::Slots);
        assert_eq!(state.focused().unwrap().id, bid(0));
        assert_eq!(state.view_state().rows.len(), 4);
        // Slot 1 is free: nothing to release.
        let cmds = apply_all(&mut state, [key('j'), key('X')]);
        assert!(cmds.is_empty());
        let mut msgs = vec![key('j'), key('X')];
        msgs.extend("stuck".chars().map(key));
        msgs.push(code(KeyCode::Enter));
        let cmds = apply_all(&mut state, msgs);
        match &cmds[..] {
            [Command::ReleaseNode { node_id, reason }] => {
                assert!(node_id.as_str().ends_with(&format!("_2_{}", bid(0))));
                assert_eq!(reason.as_deref(), Some("stuck"));
            }
            other => panic!("{other:?}"),
        }
        apply_all(&mut state, [code(KeyCode::Esc)]);
        assert_eq!(state.view, View::Backing);
    }

    #[test]
    fn tab_and_number_keys_switch_views_and_q_quits() {
        let mut state = loaded(rules(), sample(), 80, 24);
        apply_all(&mut state, [code(KeyCode::Tab)]);
        assert_eq!(state.view, View::Slots);
        apply_all(&mut state, [code(KeyCode::BackTab), code(KeyCode::BackTab)]);
        assert_eq!(state.view, View::Pools);
        apply_all(&mut state, [key('5')]);
        assert_eq!(state.view, View::Events);
        // Newest event first.
        assert!(state.view_state().rows[0].ends_with("3"));
        apply_all(&mut state, [key('?')]);
        assert_eq!(state.input, Input::Help);
        assert!(
            apply_all(&mut state, [key('q')]).is_empty(),
            "q closes the help first"
        );
        assert_eq!(apply_all(&mut state, [key('q')]), vec![Command::Quit]);
    }

    #[test]
    fn paging_scrolls_and_keeps_the_selection_visible() {
        let changes = ready_backing(100, 2);
        let mut state = loaded(rules(), changes, 80, 24);
        let page = state.page_rows();
        assert_eq!(page, 17);
        apply_all(&mut state, [code(KeyCode::PageDown)]);
        assert_eq!(state.view_state().selected, 17);
        assert_eq!(state.view_state().offset, 1);
        apply_all(&mut state, [key('G')]);
        assert_eq!(state.view_state().selected, 99);
        assert_eq!(state.view_state().offset, 100 - page);
        apply_all(&mut state, [key('g')]);
        assert_eq!(state.view_state().offset, 0);
        // A smaller terminal keeps the selection on screen.
        apply_all(&mut state, [key('G'), Msg::Resize(80, 12)]);
        assert_eq!(state.view_state().offset, 100 - 5);
    }

    #[test]
    fn the_event_log_follows_new_entries_while_on_top() {
        let mut state = loaded(rules(), sample(), 80, 24);
        apply_all(&mut state, [key('5')]);
        let newest = put(Record::Event(Box::new(event(
            9,
            NOW,
            EventKind::Operator,
            &bid(0),
            "drain by bob",
        ))));
        apply_all(&mut state, [Msg::Feed(vec![newest])]);
        assert!(state
            .view_state()
            .selected_key
            .as_ref()
            .unwrap()
            .ends_with('9'));
        // Scrolled down: the selection stays on its entry.
        apply_all(&mut state, [key('j')]);
        let kept = state.view_state().selected_key.clone();
        let newer = put(Record::Event(Box::new(event(
            10,
            NOW,
            EventKind::Operator,
            &bid(0),
            "run by bob",
        ))));
        apply_all(&mut state, [Msg::Feed(vec![newer])]);
        assert_eq!(state.view_state().selected_key, kept);
    }

    #[test]
    fn the_event_log_keeps_the_latest_entries() {
        let b = bid(0);
        let changes: Vec<Change> = (0..(EVENT_HISTORY as u32 + 20))
            .map(|i| {
                put(Record::Event(Box::new(event(
                    i,
                    NOW,
                    EventKind::Backing,
                    &b,
                    "x",
                ))))
            })
            .collect();
        let state = loaded(rules(), changes, 80, 24);
        assert_eq!(state.views[View::Events.index()].rows.len(), EVENT_HISTORY);
    }

    #[test]
    fn order_results_and_connection_show_in_the_state() {
        let mut state = loaded(rules(), sample(), 80, 24);
        apply_all(
            &mut state,
            [Msg::OrderDone {
                what: "drain bn-1".into(),
                result: Err("no launcher answers".into()),
            }],
        );
        let s = state.status.clone().unwrap();
        assert!(s.error && s.text.contains("drain bn-1 failed"), "{s:?}");
        apply_all(&mut state, [Msg::Link(false)]);
        assert!(!state.link_up);
        apply_all(&mut state, [Msg::Link(true)]);
        assert!(state.link_up);
    }

    #[test]
    fn durations_and_node_ids() {
        assert_eq!(fmt_duration(42_000), "42s");
        assert_eq!(fmt_duration(303_000), "5m03s");
        assert_eq!(fmt_duration(7_500_000), "2h05m");
        assert_eq!(fmt_duration(3 * 86_400_000 + 4 * 3_600_000), "3d04h");
        let n = NodeId::parse("node-01abc_3_bn-x_y").unwrap();
        assert_eq!(backing_of_node(&n).as_deref(), Some("bn-x_y"));
    }
}
