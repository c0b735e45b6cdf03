//! Keeps the [`crate::world::World`] mirror current from KV watches, wakes the workers
//! waiting on what changed, and tells the supervisor which work items to look at.
//!
//! After a dropped watch, and after the connection came back, it watches again from the
//! current values and forgets keys that disappeared while it was away (the removal of an
//! expired key is announced by a marker that lives about a second: a watch that resumed
//! would miss it). [`crate::mirror_sync::MirrorSync`] hears when each mirror is synced.

use crate::shared::{request_topic, seat_topic, Shared, Topic};
use crate::world::{Watched, World};
use futures::StreamExt;
use slotpool_protocol::layout::{self, LeaseOf};
use slotpool_protocol::model::{
    BackingNode, HeartbeatGist, Lease, Node, NodeRequest, NodeState, RequestState,
};
use slotpool_protocol::store::{Change, Store, Versioned};
use slotpool_protocol::time::UnixMillis;
use slotpool_protocol::{BackingId, LauncherId, RequestId};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// A work item the supervisor should look at: what changed ([`Topic`]).
pub type Dirty = Topic;

/// Which bucket a watcher mirrors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mirror {
    Requests,
    Slots,
    Backing,
    Agents,
    Leases,
}

impl Mirror {
    pub const ALL: [Mirror; 5] = [
        Mirror::Requests,
        Mirror::Slots,
        Mirror::Backing,
        Mirror::Agents,
        Mirror::Leases,
    ];

    fn store(self, shared: &Shared) -> &Store {
        let bus = &shared.bus;
        match self {
            Mirror::Requests => &bus.requests,
            Mirror::Slots => &bus.slots,
            Mirror::Backing => &bus.backing,
            Mirror::Agents => &bus.agents,
            Mirror::Leases => &bus.leases,
        }
    }
}

const REWATCH_PAUSE: Duration = Duration::from_secs(1);

/// Mirrors one bucket until shutdown; `synced` is told once the first full load is in.
pub async fn run(
    shared: Arc<Shared>,
    mirror: Mirror,
    dirty: mpsc::UnboundedSender<Dirty>,
    synced: tokio::sync::oneshot::Sender<()>,
) {
    let mut synced = Some(synced);
    let mut present: HashSet<String> = HashSet::new();
    let mut link = shared.bus.link_state();
    let mut reconnects = link.borrow_and_update().reconnects;
    loop {
        let store = mirror.store(&shared).clone();
        // Whether to watch again at once (the connection came back, or a leader changed).
        let mut rewatch_now = false;
        match store.watch_timed().await {
            Ok(changes) => {
                let mut changes = Box::pin(changes);
                // From now on, a leader elected for a bucket reloads the mirror.
                let mut recoveries = store.recoveries();
                let watching_since = tokio::time::Instant::now();
                let mut seen: Option<HashSet<String>> = Some(HashSet::new());
                loop {
                    let next = tokio::select! {
                        // A lost connection is heard of before anything that comes after
                        // it: what a watch resumed after a reconnect delivers is not
                        // trusted until the mirror is synced again.
                        biased;
                        _ = shared.shutdown.cancelled() => return,
                        Ok(()) = link.changed() => {
                            let state = *link.borrow_and_update();
                            if !state.up {
                                shared.mirror_sync.lost(mirror as usize);
                            }
                            if state.reconnects != reconnects {
                                reconnects = state.reconnects;
                                tracing::info!(bucket = store.bucket(), "reconnected; reloading the mirror");
                                rewatch_now = true;
                                break;
                            }
                            continue;
                        }
                        // Writes to the buckets failed and are answered again: a leader
                        // was elected, and this watch's consumer may have died with the
                        // old one, which the watch would notice only when the server's
                        // idle heartbeats stop coming (seconds later), the mirror stale
                        // meanwhile.
                        // At most one reload a second: writes of a loaded server that
                        // time out and land in turn cost no reload each.
                        Ok(()) = recoveries.changed(), if watching_since.elapsed() >= REWATCH_PAUSE => {
                            tracing::info!(bucket = store.bucket(), "the buckets take writes again after a leader change; reloading the mirror");
                            rewatch_now = true;
                            break;
                        }
                        next = changes.next() => next,
                    };
                    let next = next.map(|item| item.map(|t| (t.change, t.written_at)));
                    match next {
                        None => break,
                        Some(Err(err)) => {
                            tracing::warn!(bucket = store.bucket(), %err, "watch failed; watching again");
                            break;
                        }
                        Some(Ok((Change::Synced, _))) => {
                            if let Some(seen) = seen.take() {
                                for gone in present.difference(&seen).cloned().collect::<Vec<_>>() {
                                    apply(
                                        &shared,
                                        mirror,
                                        &dirty,
                                        &Change::Removed {
                                            key: gone.clone(),
                                            revision: u64::MAX,
                                        },
                                        None,
                                    );
                                    present.remove(&gone);
                                }
                            }
                            tracing::debug!(bucket = store.bucket(), "mirror synced");
                            shared.mirror_sync.synced(mirror as usize);
                            if let Some(tx) = synced.take() {
                                let _ = tx.send(());
                            }
                        }
                        Some(Ok((change, written_at))) => {
                            let held = apply(&shared, mirror, &dirty, &change, written_at);
                            match &change {
                                // A key the mirror does not hold (a finished request)
                                // cannot vanish from it: it is not kept here either.
                                Change::Put { key, .. } if held => {
                                    present.insert(key.clone());
                                    if let Some(seen) = seen.as_mut() {
                                        seen.insert(key.clone());
                                    }
                                }
                                Change::Put { key, .. } | Change::Removed { key, .. } => {
                                    present.remove(key);
                                }
                                Change::Synced => {}
                            }
                        }
                    }
                }
            }
            Err(err) => {
                tracing::warn!(bucket = mirror.store(&shared).bucket(), %err, "cannot watch; retrying")
            }
        }
        shared.mirror_sync.lost(mirror as usize);
        if rewatch_now {
            continue;
        }
        // A watch fails while its bucket elects a leader: watched again as soon as a
        // write to the bucket is answered again, or after the pause.
        tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            _ = mirror.store(&shared).answering_again(REWATCH_PAUSE) => {}
        }
    }
}

fn decode<T: serde::de::DeserializeOwned>(
    bucket: &str,
    key: &str,
    revision: u64,
    value: &[u8],
) -> Option<Versioned<T>> {
    Change::decode(bucket, key, revision, value)
        .map_err(|err| tracing::warn!(%err, "ignoring an unreadable record"))
        .ok()
}

/// A request, slot or backing record, or [`Record::Unreadable`] when it cannot be
/// decoded: those buckets must not lose a key to a bad record (a slot or a seat would
/// look free, a request's claims would never be given back).
fn decode_or_note<'a, T: serde::de::DeserializeOwned>(
    bucket: &str,
    key: &'a str,
    revision: u64,
    value: &[u8],
    wrap: impl FnOnce(Versioned<T>) -> Record<'a>,
) -> Record<'a> {
    match Change::decode(bucket, key, revision, value) {
        Ok(v) => wrap(v),
        Err(err) => Record::Unreadable {
            key,
            revision,
            error: err.to_string(),
        },
    }
}

/// A change as read from the wire, before the world lock is taken.
enum Record<'a> {
    Request(Versioned<NodeRequest>),
    Slot(Versioned<Node>),
    Backing(Versioned<BackingNode>),
    /// Only what decides slots: heartbeats are most of the traffic.
    Heartbeat(HeartbeatGist<'a>),
    Lease(Versioned<Lease>),
    /// A request, slot or backing record that cannot be decoded.
    Unreadable {
        key: &'a str,
        revision: u64,
        error: String,
    },
    Removed {
        key: &'a str,
        revision: u64,
    },
}

/// Decodes a change of `mirror`'s bucket; `None` for the end of the initial load and for
/// records that cannot be read (logged).
fn read<'a>(mirror: Mirror, bucket: &str, change: &'a Change) -> Option<Record<'a>> {
    let (key, revision, value) = match change {
        Change::Synced => return None,
        Change::Removed { key, revision } => {
            return Some(Record::Removed {
                key,
                revision: *revision,
            })
        }
        Change::Put {
            key,
            revision,
            value,
        } => (key.as_str(), *revision, value),
    };
    Some(match mirror {
        Mirror::Requests => decode_or_note(bucket, key, revision, value, Record::Request),
        Mirror::Slots => decode_or_note(bucket, key, revision, value, Record::Slot),
        Mirror::Backing => decode_or_note(bucket, key, revision, value, Record::Backing),
        Mirror::Agents => Record::Heartbeat(
            HeartbeatGist::from_json(value)
                .map_err(
                    |err| tracing::warn!(bucket, key, %err, "ignoring an unreadable heartbeat"),
                )
                .ok()?,
        ),
        // Providers' status records share the bucket; the provider status book reads them.
        Mirror::Leases
            if key.starts_with(layout::PROVIDER_STATUS_PREFIX)
                || key.starts_with(layout::REVOCATION_PREFIX) =>
        {
            return None
        }
        Mirror::Leases => Record::Lease(decode(bucket, key, revision, value)?),
    })
}

/// What a change asks for: topics to wake, and work items for the supervisor.
#[derive(Default)]
struct Effects {
    wake: Vec<Topic>,
    todo: Vec<Dirty>,
    /// A record seen unreadable for the first time at its revision, to report once.
    unreadable: Option<Unreadable>,
    /// A launcher came alive or went: which one plans may have changed.
    launchers_changed: bool,
}

/// An unreadable record, as reported to operators.
struct Unreadable {
    mirror: Mirror,
    key: String,
    revision: u64,
    error: String,
}

impl Effects {
    /// A request changed; `ended_before`: it was already final (a keep-alive renewal
    /// of a held request, say), so the queues and the planner have nothing new to see.
    fn request(&mut self, r: &NodeRequest, ended_before: bool) {
        self.wake.push(request_topic(&r.id));
        if !ended_before {
            for label in &r.labels {
                self.todo.push(Dirty::Label(label.clone()));
            }
        }
        if r.state == RequestState::Requested || r.hold_deadline().is_some() {
            self.todo.push(Dirty::Request(r.id.clone()));
        }
    }

    fn slot(&mut self, world: &World, n: &Node) {
        if n.state == NodeState::Releasing {
            // Whoever began it finishes it; if nobody does, the supervisor will.
            self.todo
                .push(Dirty::Release(layout::slot_key(&n.backing_id, n.slot)));
        }
        if let Some(seat) = world.seat_of.get(&n.backing_id) {
            self.wake.push(seat_topic(seat));
            self.todo.push(Dirty::Seat(seat.clone()));
        }
        self.wake.push(request_topic(&n.request_id));
    }

    fn backing(&mut self, seat: &str, b: &BackingNode) {
        self.wake.push(seat_topic(seat));
        self.todo.push(Dirty::Seat(seat.to_string()));
        self.todo.push(Dirty::Label(b.label.clone()));
    }

    /// A change of the agent of backing node `id`.
    fn agent(&mut self, world: &World, id: &BackingId) {
        if let Some(seat) = world.seat_of.get(id) {
            self.wake.push(seat_topic(seat));
            self.todo.push(Dirty::Seat(seat.clone()));
        }
    }

    fn send(self, shared: &Shared, dirty: &mpsc::UnboundedSender<Dirty>) {
        if let Some(u) = self.unreadable {
            let bucket = u.mirror.store(shared).bucket();
            let what = match u.mirror {
                Mirror::Slots => {
                    "the slot counts as occupied until the record is replaced or deleted"
                }
                Mirror::Backing => {
                    "the seat counts as taken (nothing is launched into it) until the record is \
                     replaced or deleted"
                }
                _ => "the request is ignored and the slots claimed for it are released",
            };
            tracing::warn!(bucket, key = %u.key, revision = u.revision, error = %u.error, "unreadable record: {what}");
            crate::events::unreadable(shared, bucket, &u.key, u.revision, &u.error, what);
        }
        for topic in self.wake {
            shared.signals.bump(&topic);
        }
        for d in self.todo {
            let _ = dirty.send(d);
        }
    }
}

/// Applies one change to the mirror and signals whoever cares. `written_at`: the
/// server's time of the write, kept for the sweep to judge ages by. False when the
/// mirror does not hold the key after it (a finished request leaves at once).
fn apply(
    shared: &Shared,
    mirror: Mirror,
    dirty: &mpsc::UnboundedSender<Dirty>,
    change: &Change,
    written_at: Option<UnixMillis>,
) -> bool {
    note_written(&mut shared.world(), mirror, change, written_at);
    let mut fx = Effects::default();
    if !echo(shared, mirror, change, &mut fx) {
        let Some(record) = read(mirror, mirror.store(shared).bucket(), change) else {
            return true;
        };
        store(&mut shared.world(), mirror, record, &mut fx);
        // The label the unreadable seat served is unknown; a new planner launcher
        // (`World::is_planner`) has every label to look at: every label is planned again.
        if (mirror == Mirror::Backing && fx.unreadable.is_some()) || fx.launchers_changed {
            for label in shared.config.label_names() {
                fx.todo.push(Dirty::Label(label.to_string()));
            }
        }
    }
    let watched = match mirror {
        Mirror::Requests => Some(Watched::Requests),
        Mirror::Slots => Some(Watched::Slots),
        Mirror::Backing => Some(Watched::Backing),
        Mirror::Agents | Mirror::Leases => None,
    };
    let held = match (watched, change) {
        (Some(watched), Change::Put { key, revision, .. }) => {
            let mut world = shared.world();
            world.watch_delivered(watched, *revision);
            watched != Watched::Requests || world.request_delivered(key, *revision)
        }
        (Some(watched), Change::Removed { revision, .. }) => {
            shared.world().watch_delivered(watched, *revision);
            true
        }
        _ => true,
    };
    fx.send(shared, dirty);
    held
}

/// Keeps the server's time of the last write of every slot, request and heartbeat key.
fn note_written(world: &mut World, mirror: Mirror, change: &Change, at: Option<UnixMillis>) {
    let times = match mirror {
        Mirror::Slots => &mut world.slot_written,
        Mirror::Requests => &mut world.request_written,
        Mirror::Agents => &mut world.heartbeat_written,
        _ => return,
    };
    match change {
        Change::Put { key, revision, .. } => match at {
            // In place when the key is known: a heartbeat rewrites it every few seconds.
            Some(at) => match times.get_mut(key) {
                Some(time) => *time = (*revision, at),
                None => {
                    times.insert(key.clone(), (*revision, at));
                }
            },
            None => {
                times.remove(key);
            }
        },
        Change::Removed { key, .. } => {
            times.remove(key);
        }
        Change::Synced => {}
    }
}

/// A launcher puts its own writes into the mirror once they are acknowledged, and the
/// watch brings each back: for those only the signals are left to give, from the record
/// already held, without decoding the change again. True when `change` was such an echo.
/// A request held at a later revision than the change stands for it too (its id and
/// labels never change, and its newer state is what matters now).
fn echo(shared: &Shared, mirror: Mirror, change: &Change, fx: &mut Effects) -> bool {
    let Change::Put { key, revision, .. } = change else {
        return false;
    };
    let world = shared.world();
    match mirror {
        Mirror::Requests => match world.requests.get(key.as_str()) {
            Some(r) if r.revision >= *revision => fx.request(&r.value, false),
            _ => match world.finished_at(key, *revision) {
                Some(r) => fx.request(&r.value, false),
                None => return false,
            },
        },
        Mirror::Slots => match world.slots.get(key) {
            Some(n) if n.revision == *revision => fx.slot(&world, &n.value),
            _ => return false,
        },
        Mirror::Backing => match world.backing.get(key) {
            Some(b) if b.revision == *revision => fx.backing(key, &b.value),
            _ => return false,
        },
        Mirror::Agents | Mirror::Leases => return false,
    }
    true
}

/// Puts a decoded change into the mirror, noting what it asks for.
fn store(world: &mut World, mirror: Mirror, record: Record<'_>, fx: &mut Effects) {
    match record {
        Record::Request(r) => {
            let ended_before = world
                .requests
                .get(&r.value.id)
                .is_some_and(|old| old.value.state.is_final() && r.value.state.is_final());
            fx.request(&r.value, ended_before);
            world.put_request(r);
        }
        Record::Slot(n) => {
            fx.slot(world, &n.value);
            world.put_slot(n);
        }
        Record::Backing(b) => {
            fx.backing(&b.key, &b.value);
            world.put_backing(b);
        }
        Record::Heartbeat(hb) => {
            let id = BackingId::parse(&hb.backing_id);
            if world.put_agent(hb) {
                if let Ok(id) = id {
                    fx.agent(world, &id);
                }
            }
        }
        Record::Lease(l) => fx.launchers_changed |= world.put_lease(l),
        Record::Unreadable {
            key,
            revision,
            error,
        } => {
            let first = match mirror {
                Mirror::Slots => world.put_unreadable_slot(key, revision),
                Mirror::Backing => world.put_unreadable_seat(key, revision),
                Mirror::Requests => {
                    if let Ok(id) = RequestId::parse(key) {
                        // Its worker, if any, must see it gone.
                        fx.wake.push(request_topic(&id));
                    }
                    world.put_unreadable_request(key, revision)
                }
                _ => false,
            };
            if first {
                fx.unreadable = Some(Unreadable {
                    mirror,
                    key: key.to_string(),
                    revision,
                    error,
                });
            }
        }
        Record::Removed { key, revision } => match mirror {
            Mirror::Requests => world.remove_request(key, revision),
            Mirror::Slots => {
                if let Some(old) = world.slots.get(key).map(|n| &n.value) {
                    if let Some(seat) = world.seat_of.get(&old.backing_id) {
                        fx.wake.push(seat_topic(seat));
                        fx.todo.push(Dirty::Seat(seat.clone()));
                    }
                    fx.wake.push(request_topic(&old.request_id));
                } else if world.tombstones.get(key) == Some(&revision) {
                    // The echo of this launcher's own deletion, put into the mirror when
                    // it was acknowledged (`release.rs`): its seat is told now.
                    let seat = layout::parse_slot_key(key)
                        .and_then(|(backing, _)| world.seat_of.get(&backing));
                    if let Some(seat) = seat {
                        fx.wake.push(seat_topic(seat));
                        fx.todo.push(Dirty::Seat(seat.clone()));
                    }
                }
                world.remove_slot(key, revision);
            }
            Mirror::Backing => {
                if let Some(old) = world.backing.get(key) {
                    fx.todo.push(Dirty::Label(old.value.label.clone()));
                }
                fx.wake.push(seat_topic(key));
                world.remove_backing(key, revision);
            }
            Mirror::Agents => {
                if let Ok(id) = BackingId::parse(key) {
                    fx.agent(world, &id);
                }
                world.remove_agent(key);
            }
            Mirror::Leases => {
                fx.launchers_changed |= world.remove_lease(key);
                match layout::parse_lease_key(key) {
                    // A launcher is gone: its open requests are free to take over.
                    Some(LeaseOf::Launcher(launcher)) => fx
                        .todo
                        .extend(owned_by(world, &launcher).map(Dirty::Request)),
                    Some(LeaseOf::Seat(seat)) => fx.todo.push(Dirty::Seat(seat)),
                    None => {}
                }
            }
        },
    }
}

/// The open and held requests `launcher` owns.
fn owned_by<'a>(
    world: &'a World,
    launcher: &'a LauncherId,
) -> impl Iterator<Item = RequestId> + 'a {
    world
        .open_requests
        .iter()
        .chain(world.held_requests.iter())
        .filter(move |id| {
            world
                .requests
                .get(*id)
                .is_some_and(|r| r.value.owner.as_ref() == Some(launcher))
        })
        .cloned()
}
