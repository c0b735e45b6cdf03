//! Derived rows: what the views show, computed from the mirror, the config's rules and
//! the time — pool aggregates, backing, slot, request and event rows, idle timers,
//! heartbeat health, and each view's filtered and sorted keys with its selection kept on
//! its row. `State::settle` rebuilds the [`Index`] and the views' keys through here.
//!
//! Pure: no NATS, no terminal, no clock.

use crate::format::{idle_name, node_state_name, request_state_name, state_name};
use crate::mirror::Mirror;
use crate::rules::Rules;
use slotpool_config::timing;
use slotpool_config::warm::Arrivals;
use slotpool_protocol::layout::seat_key;
use slotpool_protocol::model::{
    BackingNode, BackingState, Event, IdleBehaviour, Node, NodeRequest, RequestState,
};
use slotpool_protocol::time::{after, UnixMillis};
use std::collections::{BTreeMap, HashMap};

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

    pub fn index(self) -> usize {
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
///
/// The selection follows what the operator selected, never an index: its row is found
/// again by key and checked by identity (in the Backing view the backing node's id, as a
/// seat is taken again by the next node launched into it; in the Slots view the backing
/// id and slot number, so a re-sort or a slot leaving the filter never moves it to
/// another slot, and choosing another backing node starts afresh). When that row goes away
/// nothing is selected (an order then has no target) until the operator moves; [`Gone`]
/// remembers what it was, to say so and to select it again should it come back.
#[derive(Clone, Debug, Default)]
pub struct ViewState {
    /// Index into the view's rows of the selected row, or of where the gone one was.
    pub selected: usize,
    /// The selected row's key; `None` when nothing is selected.
    pub selected_key: Option<String>,
    /// What the selected row is (see [`ViewState`]); `None` when nothing is selected.
    pub selected_id: Option<String>,
    /// The row that was selected and went away, while nothing else is selected.
    pub gone: Option<Gone>,
    /// First row shown.
    pub offset: usize,
    pub filter: String,
    /// Requests view: the finished requests are shown, not folded into one row.
    pub unfolded: bool,
    /// Only the backing nodes of this pool (Backing view; Enter on a pool sets it).
    pub pool: Option<PoolScope>,
    /// Index into [`View::sorts`].
    pub sort: usize,
    pub reverse: bool,
    /// The rows' keys after filter and sort.
    pub rows: Vec<String>,
}

/// The key of the Requests view's row that the finished requests fold into.
pub const FOLD_KEY: &str = "~finished";

/// Whether a request is over: failed, canceled, reclaimed, or fulfilled and every node
/// given back.
pub fn is_finished(r: &NodeRequest) -> bool {
    r.is_finished()
}

/// One pool's label: what Enter on a Pools row narrows the Backing view to.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolScope {
    pub provider: String,
    pub pool: String,
    pub label: String,
}

impl PoolScope {
    pub fn holds(&self, b: &BackingNode) -> bool {
        b.provider == self.provider && b.pool == self.pool && b.label == self.label
    }
}

impl std::fmt::Display for PoolScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.provider, self.pool, self.label)
    }
}

/// A selected row that went away: its key and its identity.
#[derive(Clone, Debug, PartialEq)]
pub struct Gone {
    pub key: String,
    pub id: String,
}

impl ViewState {
    /// Whether row `i` is the selected one.
    pub fn is_selected(&self, i: usize) -> bool {
        self.selected_key.is_some() && i == self.selected
    }

    /// Selects row `i` (clamped), whose identity is `id`.
    pub fn select(&mut self, i: usize, id: impl Fn(&str) -> Option<String>) {
        self.selected = i.min(self.rows.len().saturating_sub(1));
        self.selected_key = self.rows.get(self.selected).cloned();
        self.selected_id = self.selected_key.as_deref().and_then(id);
        self.gone = None;
    }

    /// Selects the row of `key`, whose identity is `id`, at the next [`set_rows`].
    pub fn choose(&mut self, key: String, id: Option<String>) {
        self.selected_key = Some(key);
        self.selected_id = id;
        self.gone = None;
    }

    /// Selects nothing in particular: the first row, at the next [`set_rows`].
    pub fn reset_selection(&mut self) {
        self.selected = 0;
        self.selected_key = None;
        self.selected_id = None;
        self.gone = None;
    }

    /// The row `delta` rows away from the selection; from a gone row, the gap it left
    /// counts as the first step (down: the row that took its place; up: the one above).
    pub fn moved(&self, delta: isize) -> usize {
        let last = self.rows.len() as isize - 1;
        let from = self.selected as isize;
        let to = if self.selected_key.is_none() && self.gone.is_some() && delta > 0 {
            from + delta - 1
        } else {
            from + delta
        };
        to.clamp(0, last.max(0)) as usize
    }
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
    /// Empty but kept: its free slots are part of the label's `min-ready` (this many).
    KeptWarm(u32),
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

/// Indexes rebuilt by each settle: slots in use per backing node, the seat key of each
/// backing id, and the pool aggregates.
#[derive(Debug, Default)]
pub struct Index {
    pools: Vec<PoolRow>,
    /// One row per tenant, when the config names tenants.
    tenants: Vec<TenantRow>,
    /// One row per launcher whose liveness lease stands.
    launchers: Vec<LauncherRow>,
    /// Requests that wait for free slots while no launcher decides, if any.
    unattended: Option<Unattended>,
    used_by_backing: HashMap<String, u32>,
    backing_by_id: HashMap<String, String>,
    /// The requests of the labels with a `warm-window`, as the launcher counts them.
    arrivals: Arrivals,
}

impl Index {
    /// The pool aggregates, as of the last build.
    pub fn pools(&self) -> &[PoolRow] {
        &self.pools
    }

    /// The tenants' rows, as of the last build (none without a `tenants` section).
    pub fn tenants(&self) -> &[TenantRow] {
        &self.tenants
    }

    /// The launchers' rows, as of the last build.
    pub fn launchers(&self) -> &[LauncherRow] {
        &self.launchers
    }

    /// Requests that wait for free slots while no launcher decides, as of the last build.
    pub fn unattended(&self) -> Option<&Unattended> {
        self.unattended.as_ref()
    }

    /// Rederives the launchers' rows and [`Index::unattended`] at `now`: their ages move
    /// with the clock in every view, not only when the rows are rebuilt.
    pub fn refresh_liveness(&mut self, mirror: &Mirror, rules: &Rules, now: UnixMillis) {
        self.launchers = launcher_rows(mirror, rules, now);
        self.unattended = unattended(mirror, &self.used_by_backing, &self.launchers);
    }

    pub fn build(mirror: &Mirror, rules: &Rules, now: UnixMillis) -> Index {
        let mut used_by_backing: HashMap<String, u32> = HashMap::new();
        for s in mirror.slots() {
            *used_by_backing.entry(s.backing_id.to_string()).or_default() += 1;
        }
        let backing_by_id = mirror
            .backing_nodes()
            .map(|(k, b)| (b.id.to_string(), k.clone()))
            .collect();
        let mut arrivals = rules.arrivals();
        if !arrivals.is_empty() {
            for (_, r) in mirror.requests() {
                arrivals.note(r.id.as_str(), r.client.as_ref(), &r.labels, r.created_at);
            }
        }
        let launchers = launcher_rows(mirror, rules, now);
        let unattended = unattended(mirror, &used_by_backing, &launchers);
        let mut index = Index {
            pools: Vec::new(),
            tenants: tenant_rows(mirror, rules, now),
            launchers,
            unattended,
            used_by_backing,
            backing_by_id,
            arrivals,
        };
        index.pools = Facts {
            mirror,
            rules,
            now,
            index: &index,
        }
        .aggregate_pools();
        index
    }
}

/// One tenant in the Pools view: what it holds against its share and limit, what it
/// waits for, and how long its requests waited.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantRow {
    pub name: String,
    pub weight: u32,
    /// Slots its nodes hold.
    pub held: u32,
    /// Its weighted share of the ready slots among the tenants holding or waiting
    /// ([`slotpool_config::tenants::Tenants::shares`], as the launcher's metrics say).
    pub share: u64,
    pub max_slots: Option<u32>,
    /// Its open requests.
    pub waiting: u32,
    /// The 95th percentile of submission to fulfilment of its requests fulfilled in the
    /// last [`TENANT_WAIT_WINDOW_MS`] (those still in KV); `None` when there were none.
    pub p95_wait_ms: Option<UnixMillis>,
}

/// How far back the tenants' p95 wait looks.
pub const TENANT_WAIT_WINDOW_MS: UnixMillis = 3_600_000;

/// The tenants' rows from the records: none when the config names no tenants.
fn tenant_rows(mirror: &Mirror, rules: &Rules, now: UnixMillis) -> Vec<TenantRow> {
    let tenants = rules.tenants();
    if tenants.is_single() {
        return Vec::new();
    }
    let mut loads = vec![(0u32, 0u32); tenants.len()];
    for n in mirror.slots() {
        loads[tenants.of(n.client.as_ref())].0 += 1;
    }
    let mut waits: Vec<Vec<UnixMillis>> = vec![Vec::new(); tenants.len()];
    for (_, r) in mirror.requests() {
        let t = tenants.of(r.client.as_ref());
        if r.state == RequestState::Requested {
            loads[t].1 += 1;
        }
        if let Some(at) = r.fulfilled_at {
            if now.saturating_sub(at) <= TENANT_WAIT_WINDOW_MS {
                waits[t].push(at.saturating_sub(r.created_at));
            }
        }
    }
    let ready: u64 = mirror
        .backing_nodes()
        .filter(|(_, b)| b.state == BackingState::Ready)
        .map(|(_, b)| u64::from(b.slots))
        .sum();
    let shares = tenants.shares(ready, &loads);
    tenants
        .iter()
        .zip(loads)
        .zip(shares)
        .zip(waits)
        .map(|(((t, (held, waiting)), share), mut waits)| {
            waits.sort_unstable();
            TenantRow {
                name: t.name.clone(),
                weight: t.weight,
                held,
                share,
                max_slots: t.max_slots,
                waiting,
                p95_wait_ms: (!waits.is_empty())
                    .then(|| waits[((waits.len() * 95).div_ceil(100)).saturating_sub(1)]),
            }
        })
        .collect()
}

/// One launcher in the Pools view, from its liveness lease.
#[derive(Clone, Debug, PartialEq)]
pub struct LauncherRow {
    pub id: String,
    /// Since its lease was last written (taken or renewed), by the launcher's clock.
    pub lease_age_ms: u64,
    /// Since its supervisor last finished a pass; `None` before its first.
    pub pass_age_ms: Option<u64>,
    /// It has not finished a pass for longer than `stall-after` (or, before its first,
    /// since it took its lease): its `/readyz` says "stalled".
    pub stalled: bool,
}

/// The launchers' rows from their leases, by id.
fn launcher_rows(mirror: &Mirror, rules: &Rules, now: UnixMillis) -> Vec<LauncherRow> {
    let stall_after = u64::try_from(rules.stall_after().as_millis()).unwrap_or(u64::MAX);
    mirror
        .launchers()
        .map(|lease| {
            let pass_age_ms = lease.passed_at.map(|at| now.saturating_sub(at));
            let deciding_age = pass_age_ms.unwrap_or(now.saturating_sub(lease.acquired_at));
            LauncherRow {
                id: lease.holder.to_string(),
                lease_age_ms: now.saturating_sub(lease.renewed_at.unwrap_or(lease.acquired_at)),
                pass_age_ms,
                stalled: deciding_age > stall_after,
            }
        })
        .collect()
}

/// Requests waiting while slots of their labels are free on running nodes, and no
/// launcher decides: nobody hands those slots out.
#[derive(Clone, Debug, PartialEq)]
pub struct Unattended {
    /// Waiting requests with a free slot of one of their labels.
    pub waiting: usize,
    /// Free slots of those labels on ready, running nodes.
    pub free: u32,
    /// Launchers whose lease stands (all of them stalled).
    pub launchers: usize,
}

impl Unattended {
    /// Who is missing: no launcher at all, or none that passed within `stall_after`.
    pub fn nobody(&self, stall_after: std::time::Duration) -> String {
        if self.launchers == 0 {
            "no launcher holds a liveness lease".to_string()
        } else {
            format!(
                "no launcher finished a pass in the last {}s",
                stall_after.as_secs()
            )
        }
    }

    /// What it says, in a line.
    pub fn line(&self, stall_after: std::time::Duration) -> String {
        format!(
            "nobody acts: {} requests wait with {} slots of their labels free, and {}",
            self.waiting,
            self.free,
            self.nobody(stall_after)
        )
    }
}

fn unattended(
    mirror: &Mirror,
    used_by_backing: &HashMap<String, u32>,
    launchers: &[LauncherRow],
) -> Option<Unattended> {
    if launchers.iter().any(|l| !l.stalled) {
        return None;
    }
    let mut free_by_label: HashMap<&str, u32> = HashMap::new();
    for (_, b) in mirror.backing_nodes() {
        if b.state != BackingState::Ready || b.idle != IdleBehaviour::Run {
            continue;
        }
        let used = used_by_backing.get(b.id.as_str()).copied().unwrap_or(0);
        let dirty = mirror
            .agent(b.id.as_str())
            .map_or(0, |a| a.dirty_slots.len() as u32);
        *free_by_label.entry(b.label.as_str()).or_default() +=
            b.slots.saturating_sub(used).saturating_sub(dirty);
    }
    let mut labels = std::collections::BTreeSet::new();
    let waiting = mirror
        .requests()
        .filter(|(_, r)| r.state == RequestState::Requested)
        .filter(|(_, r)| {
            let free: Vec<&String> = r
                .labels
                .iter()
                .filter(|l| free_by_label.get(l.as_str()).is_some_and(|f| *f > 0))
                .collect();
            labels.extend(free.iter().map(|l| l.as_str()));
            !free.is_empty()
        })
        .count();
    let free = labels.iter().map(|l| free_by_label[l]).sum();
    (waiting > 0).then_some(Unattended {
        waiting,
        free,
        launchers: launchers.len(),
    })
}

/// What every row is derived from: the records, the rules, the time and the index.
#[derive(Clone, Copy)]
pub struct Facts<'a> {
    pub mirror: &'a Mirror,
    pub rules: &'a Rules,
    pub now: UnixMillis,
    pub index: &'a Index,
}

impl<'a> Facts<'a> {
    pub fn pools(&self) -> &'a [PoolRow] {
        &self.index.pools
    }

    /// Whether the row `gone` still exists (hidden by the filter, then), rather than
    /// having gone away.
    pub fn exists(&self, view: View, gone: &Gone) -> bool {
        let key = gone.key.as_str();
        match view {
            View::Pools => self.pool_row(key).is_some(),
            View::Backing => self.identity(view, key).as_deref() == Some(gone.id.as_str()),
            View::Slots => self.slot_row(key).is_some(),
            View::Requests => self.mirror.request(key).is_some(),
            View::Events => self.mirror.event(key).is_some(),
        }
    }

    /// What a row of `view` is, as the selection follows it: in the Backing view the
    /// backing node's id (its key, the seat, outlives it), in the Slots view the slot
    /// (backing id and slot number, whoever is in it), elsewhere the key.
    pub fn identity(&self, view: View, key: &str) -> Option<String> {
        match view {
            View::Backing => self.mirror.backing(key).map(|b| b.id.to_string()),
            View::Slots => slotpool_protocol::layout::parse_slot_key(key)
                .map(|(backing, slot)| format!("slot {slot} of {backing}")),
            _ => Some(key.to_string()),
        }
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
        for (_, b) in self.mirror.backing_nodes() {
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
            row.used += self.used(b);
        }
        let mut waiting: HashMap<&str, (usize, u64)> = HashMap::new();
        for (_, r) in self.mirror.requests() {
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

    /// The keys of `view`'s rows, filtered and sorted as `vs` says; the Slots view
    /// shows the slots of the backing node `focus` (a backing id).
    pub fn keys(&self, view: View, vs: &ViewState, focus: Option<&str>) -> Vec<String> {
        let filter = vs.filter.as_str();
        let sort = view.sorts()[vs.sort.min(view.sorts().len() - 1)];
        let mut rows: Vec<String> = match view {
            View::Pools => {
                let mut pools: Vec<&PoolRow> = self
                    .pools()
                    .iter()
                    .filter(|p| matches(filter, &[&p.provider, &p.pool, &p.label]))
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
                    .mirror
                    .backing_nodes()
                    .filter(|(_, b)| vs.pool.as_ref().is_none_or(|p| p.holds(b)))
                    .filter(|(k, b)| {
                        matches(
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
                let seat = |&(k, b): &(&'a String, &'a BackingNode)| {
                    (b.provider.as_str(), b.pool.as_str(), b.seat, k.as_str())
                };
                match sort {
                    "state" => nodes.sort_by_key(|n| (state_order(n.1.state), seat(n))),
                    "age" => nodes.sort_by_key(|n| (n.1.created_at, seat(n))),
                    "used" => nodes.sort_by_key(|n| {
                        (
                            std::cmp::Reverse(
                                self.index.used_by_backing.get(n.1.id.as_str()).copied(),
                            ),
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
                let Some(b) = self.focused(focus) else {
                    return Vec::new();
                };
                let mut slots: Vec<SlotRow> = self.slot_rows(b);
                slots.retain(|s| match &s.node {
                    Some(n) => matches(
                        filter,
                        &[n.id.as_str(), &n.requestor, node_state_name(n.state)],
                    ),
                    None => matches(filter, &["free"]),
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
                    .mirror
                    .requests()
                    .filter(|(_, r)| {
                        matches(
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
                if vs.reverse {
                    reqs.reverse();
                }
                // Finished requests fold into one row after the live ones.
                let (finished, live): (Vec<_>, Vec<_>) =
                    reqs.into_iter().partition(|(_, r)| is_finished(r));
                let mut keys: Vec<String> = live.into_iter().map(|(k, _)| k.clone()).collect();
                if !finished.is_empty() {
                    keys.push(FOLD_KEY.to_string());
                    if vs.unfolded {
                        keys.extend(finished.into_iter().map(|(k, _)| k.clone()));
                    }
                }
                return keys;
            }
            View::Events => {
                let mut events: Vec<(&String, &Event)> = self
                    .mirror
                    .events_newest_first()
                    .filter(|(_, e)| {
                        matches(
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

    /// The backing node `focus` (a backing id) names, if it exists.
    pub fn focused(&self, focus: Option<&str>) -> Option<&'a BackingNode> {
        let key = self.index.backing_by_id.get(focus?)?;
        self.mirror.backing(key)
    }

    pub fn slot_rows(&self, b: &BackingNode) -> Vec<SlotRow> {
        let mut out: Vec<SlotRow> = (0..b.slots)
            .map(|slot| {
                let node = self
                    .mirror
                    .slot(&slotpool_protocol::layout::slot_key(&b.id, slot))
                    .cloned();
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
        for s in self.mirror.slots() {
            if s.backing_id == b.id && s.slot >= b.slots {
                out.push(SlotRow {
                    slot: s.slot,
                    held_ms: Some(self.now.saturating_sub(s.allocated_at)),
                    node: Some(s.clone()),
                });
            }
        }
        out
    }

    /// The Slots view row of `key` (a slot key).
    pub fn slot_row(&self, key: &str) -> Option<SlotRow> {
        let (backing, slot) = slotpool_protocol::layout::parse_slot_key(key)?;
        let node = self.mirror.slot(key).cloned();
        if node.is_none() && !self.index.backing_by_id.contains_key(backing.as_str()) {
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

    pub fn pool_row(&self, key: &str) -> Option<&'a PoolRow> {
        self.pools().iter().find(|p| p.key() == key)
    }

    fn used(&self, b: &BackingNode) -> u32 {
        self.index
            .used_by_backing
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
                let rules = self.rules.label(&b.provider, &b.pool, &b.label);
                let ready = rules.map_or(0, |r| {
                    r.ready().target(|warm| {
                        self.index
                            .arrivals
                            .by_tenant(&b.label, warm.window, self.now)
                    })
                });
                match rules {
                    Some(_) if ready > 0 && self.free_ahead(b) < ready => {
                        IdleTimer::KeptWarm(ready)
                    }
                    Some(r) => {
                        let last_release = self.mirror.last_release(b.id.as_str());
                        let at = timing::release_at(b, last_release, self.now, &r.idle);
                        IdleTimer::ReleaseIn(at.saturating_sub(self.now))
                    }
                    None => IdleTimer::IdleFor(self.now.saturating_sub(idle_since)),
                }
            }
            _ => IdleTimer::None,
        }
    }

    /// The free slots `b` (empty) may count on once released, by the launcher's own
    /// rule ([`timing::free_ahead`]): those of the other nodes of its label that take
    /// slots, an empty one only when its seat comes first.
    fn free_ahead(&self, b: &BackingNode) -> u32 {
        let me = seat_key(&b.provider, &b.pool, b.seat);
        let takers = self
            .mirror
            .backing_nodes()
            .filter(|(key, o)| **key != me && o.label == b.label && self.takes_slots(o))
            .map(|(key, o)| (key.as_str(), o.slots, self.used(o)));
        timing::free_ahead((&me, b.slots), takers)
    }

    /// Whether new slots may be handed out on `b`, as the launcher judges it: ready,
    /// running (not held or drained) and its agent healthy and not draining.
    fn takes_slots(&self, b: &BackingNode) -> bool {
        b.state.takes_slots()
            && b.idle == IdleBehaviour::Run
            && self.mirror.agent(b.id.as_str()).is_some_and(|a| {
                a.secret_sha256 == b.secret_sha256 && a.health.healthy && !a.draining
            })
    }

    /// The view model of one Backing nodes row.
    pub fn backing_row(&self, key: &str) -> Option<BackingRow> {
        let b = self.mirror.backing(key)?;
        let rules = self.rules.label(&b.provider, &b.pool, &b.label);
        let launched = b.launched_at.unwrap_or(b.created_at);
        let retained_ms = rules
            .filter(|r| !r.idle.min_retention_time.is_zero())
            .map(|r| after(launched, r.idle.min_retention_time).saturating_sub(self.now))
            .filter(|ms| *ms > 0 && b.state == BackingState::Ready);
        let ages = b.state == BackingState::Ready;
        let max_age_ms = rules
            .filter(|_| ages)
            .and_then(|r| timing::max_age_at(b, &r.idle))
            .map(|at| at as i64 - self.now as i64);
        let heartbeat = match self.mirror.agent(b.id.as_str()) {
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
}

/// Whether any of `haystack` contains `filter`, ignoring case.
fn matches(filter: &str, haystack: &[&str]) -> bool {
    if filter.is_empty() {
        return true;
    }
    let needle = filter.to_lowercase();
    haystack.iter().any(|h| h.to_lowercase().contains(&needle))
}

/// Puts a view's freshly derived keys in place and keeps its selection on its row, as
/// told apart by `id` (a row's identity from its key). If the selected row went away,
/// nothing is selected: never the row that took its index or its key.
pub fn set_rows(
    view: View,
    vs: &mut ViewState,
    rows: Vec<String>,
    id: impl Fn(&str) -> Option<String>,
) {
    // The event log and the requests follow the newest entry while the selection is
    // on top.
    let follow = matches!(view, View::Events | View::Requests) && vs.selected == 0;
    vs.rows = rows;
    if follow {
        vs.reset_selection();
    }
    let wanted = match (&vs.selected_key, &vs.gone) {
        (Some(key), _) => Some((key.clone(), vs.selected_id.clone())),
        (None, Some(g)) => Some((g.key.clone(), Some(g.id.clone()))),
        (None, None) => None,
    };
    let Some((key, want)) = wanted else {
        // Nothing chosen yet: the row at the cursor (the first one at start).
        vs.select(vs.selected, id);
        return;
    };
    let at = vs
        .rows
        .iter()
        .position(|k| *k == key)
        .filter(|&i| match &want {
            Some(w) => id(&vs.rows[i]).as_deref() == Some(w.as_str()),
            None => true,
        });
    match (at, want) {
        (Some(i), _) => vs.select(i, id),
        (None, want) => {
            vs.gone = Some(Gone {
                id: want.unwrap_or_else(|| key.clone()),
                key,
            });
            vs.selected_key = None;
            vs.selected_id = None;
            vs.selected = vs.selected.min(vs.rows.len());
        }
    }
}

/// Scrolls `vs` so that its selection is on a page of `page` rows.
pub fn scroll_into_view(vs: &mut ViewState, page: usize) {
    if vs.selected < vs.offset {
        vs.offset = vs.selected;
    } else if vs.selected >= vs.offset + page {
        vs.offset = vs.selected + 1 - page;
    }
    vs.offset = vs.offset.min(vs.rows.len().saturating_sub(page));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(ks: &[&str]) -> Vec<String> {
        ks.iter().map(|k| k.to_string()).collect()
    }

    /// Identities of rows "a".."d": the key with a suffix the test changes.
    fn ids(suffix: &'static str) -> impl Fn(&str) -> Option<String> {
        move |k| Some(format!("{k}{suffix}"))
    }

    #[test]
    fn the_selection_follows_its_rows_identity_never_its_index() {
        let mut vs = ViewState::default();
        set_rows(View::Backing, &mut vs, keys(&["a", "b", "c"]), ids("1"));
        assert_eq!(
            vs.selected_key.as_deref(),
            Some("a"),
            "the first row at start"
        );
        vs.select(1, ids("1"));
        // Rows move: the selection moves with its row.
        set_rows(View::Backing, &mut vs, keys(&["c", "a", "b"]), ids("1"));
        assert_eq!((vs.selected, vs.selected_key.as_deref()), (2, Some("b")));
        // Its row goes away: nothing is selected, the gap is remembered.
        set_rows(View::Backing, &mut vs, keys(&["c", "a"]), ids("1"));
        assert_eq!(vs.selected_key, None);
        assert_eq!(vs.selected_id, None);
        assert!(!vs.is_selected(vs.selected));
        assert_eq!(
            vs.gone,
            Some(Gone {
                key: "b".into(),
                id: "b1".into()
            })
        );
        // Its key comes back as something else (a seat taken again): still nothing.
        set_rows(View::Backing, &mut vs, keys(&["c", "a", "b"]), ids("2"));
        assert_eq!(vs.selected_key, None);
        // It comes back itself: selected again.
        set_rows(View::Backing, &mut vs, keys(&["c", "a", "b"]), |k| {
            Some(format!("{k}{}", if k == "b" { "1" } else { "2" }))
        });
        assert_eq!((vs.selected, vs.selected_key.as_deref()), (2, Some("b")));
    }

    #[test]
    fn moving_from_a_gone_row_steps_into_its_gap() {
        let mut vs = ViewState::default();
        set_rows(View::Pools, &mut vs, keys(&["a", "b", "c"]), ids(""));
        vs.select(1, ids(""));
        set_rows(View::Pools, &mut vs, keys(&["a", "c"]), ids(""));
        assert_eq!(vs.selected_key, None);
        assert_eq!(
            vs.rows[vs.moved(1)],
            "c",
            "down: the row that took its place"
        );
        assert_eq!(vs.rows[vs.moved(-1)], "a", "up: the row above it");
        // The last row goes: down stays on the new last row.
        vs.select(1, ids(""));
        set_rows(View::Pools, &mut vs, keys(&["a"]), ids(""));
        assert_eq!(vs.rows[vs.moved(1)], "a");
    }
}
