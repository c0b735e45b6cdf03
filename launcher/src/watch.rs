//! Keeps the [`crate::world::World`] mirror current from KV watches, wakes the workers
//! waiting on what changed, and tells the supervisor which work items to look at.
//!
//! After a dropped watch it watches again from the current values, and forgets keys that
//! disappeared while it was away.

use crate::shared::{label_topic, request_topic, seat_topic, Shared};
use futures::StreamExt;
use slotpool_protocol::model::{
    BackingNode, HeartbeatGist, Lease, Node, NodeRequest, RequestState,
};
use slotpool_protocol::store::{Change, Store, Versioned};
use slotpool_protocol::{BackingId, LauncherId, RequestId};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// A work item the supervisor should look at.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dirty {
    Request(RequestId),
    Seat(String),
    Label(String),
}

/// Which bucket a watcher mirrors.
#[derive(Clone, Copy, Debug)]
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
    loop {
        let store = mirror.store(&shared).clone();
        match store.watch().await {
            Ok(changes) => {
                let mut changes = Box::pin(changes);
                let mut seen: Option<HashSet<String>> = Some(HashSet::new());
                loop {
                    let next = tokio::select! {
                        _ = shared.shutdown.cancelled() => return,
                        next = changes.next() => next,
                    };
                    match next {
                        None => break,
                        Some(Err(err)) => {
                            tracing::warn!(bucket = store.bucket(), %err, "watch failed; watching again");
                            break;
                        }
                        Some(Ok(Change::Synced)) => {
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
                                    );
                                    present.remove(&gone);
                                }
                            }
                            if let Some(tx) = synced.take() {
                                let _ = tx.send(());
                            }
                        }
                        Some(Ok(change)) => {
                            match &change {
                                Change::Put { key, .. } => {
                                    present.insert(key.clone());
                                    if let Some(seen) = seen.as_mut() {
                                        seen.insert(key.clone());
                                    }
                                }
                                Change::Removed { key, .. } => {
                                    present.remove(key);
                                }
                                Change::Synced => {}
                            }
                            apply(&shared, mirror, &dirty, &change);
                        }
                    }
                }
            }
            Err(err) => {
                tracing::warn!(bucket = mirror.store(&shared).bucket(), %err, "cannot watch; retrying")
            }
        }
        tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            _ = tokio::time::sleep(REWATCH_PAUSE) => {}
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

/// A change as read from the wire, before the world lock is taken.
enum Record<'a> {
    Request(Versioned<NodeRequest>),
    Slot(Versioned<Node>),
    Backing(Versioned<BackingNode>),
    /// Only what decides slots: heartbeats are most of the traffic.
    Heartbeat(HeartbeatGist<'a>),
    Lease(Versioned<Lease>),
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
        Mirror::Requests => Record::Request(decode(bucket, key, revision, value)?),
        Mirror::Slots => Record::Slot(decode(bucket, key, revision, value)?),
        Mirror::Backing => Record::Backing(decode(bucket, key, revision, value)?),
        Mirror::Agents => Record::Heartbeat(
            HeartbeatGist::from_json(value)
                .map_err(
                    |err| tracing::warn!(bucket, key, %err, "ignoring an unreadable heartbeat"),
                )
                .ok()?,
        ),
        Mirror::Leases => Record::Lease(decode(bucket, key, revision, value)?),
    })
}

/// Applies one change to the mirror and signals whoever cares.
fn apply(shared: &Shared, mirror: Mirror, dirty: &mpsc::UnboundedSender<Dirty>, change: &Change) {
    let Some(record) = read(mirror, mirror.store(shared).bucket(), change) else {
        return;
    };
    let mut wake: Vec<String> = Vec::new();
    let mut todo: Vec<Dirty> = Vec::new();
    {
        let mut world = shared.world();
        match record {
            Record::Request(r) => {
                wake.push(request_topic(&r.value.id));
                for label in &r.value.labels {
                    todo.push(Dirty::Label(label.clone()));
                    if r.value.state.is_final() {
                        wake.push(label_topic(label));
                    }
                }
                if r.value.state == RequestState::Requested {
                    todo.push(Dirty::Request(r.value.id.clone()));
                }
                world.put_request(r);
            }
            Record::Slot(n) => {
                if let Some(seat) = world.seat_of.get(&n.value.backing_id) {
                    wake.push(seat_topic(seat));
                    todo.push(Dirty::Seat(seat.clone()));
                }
                wake.push(request_topic(&n.value.request_id));
                world.put_slot(n);
            }
            Record::Backing(b) => {
                wake.push(seat_topic(&b.key));
                wake.push(label_topic(&b.value.label));
                todo.push(Dirty::Seat(b.key.clone()));
                todo.push(Dirty::Label(b.value.label.clone()));
                world.put_backing(b);
            }
            Record::Heartbeat(hb) => {
                let id = BackingId::parse(&hb.backing_id);
                if world.put_agent(hb) {
                    if let Ok(id) = id {
                        wake_backing(&world, &id, &mut wake, &mut todo);
                    }
                }
            }
            Record::Lease(l) => {
                world.leases.insert(l.key.clone(), l);
            }
            Record::Removed { key, revision } => match mirror {
                Mirror::Requests => world.remove_request(key, revision),
                Mirror::Slots => {
                    if let Some(old) = world.slots.get(key).map(|n| &n.value) {
                        if let Some(seat) = world.seat_of.get(&old.backing_id) {
                            wake.push(seat_topic(seat));
                            todo.push(Dirty::Seat(seat.clone()));
                        }
                        wake.push(label_topic(&old.label));
                        wake.push(request_topic(&old.request_id));
                    }
                    world.remove_slot(key, revision);
                }
                Mirror::Backing => {
                    if let Some(old) = world.backing.get(key) {
                        wake.push(label_topic(&old.value.label));
                        todo.push(Dirty::Label(old.value.label.clone()));
                    }
                    wake.push(seat_topic(key));
                    world.remove_backing(key, revision);
                }
                Mirror::Agents => {
                    if let Ok(id) = BackingId::parse(key) {
                        wake_backing(&world, &id, &mut wake, &mut todo);
                    }
                    world.remove_agent(key);
                }
                Mirror::Leases => {
                    world.leases.remove(key);
                    if let Some(launcher) = key
                        .strip_prefix("launcher.")
                        .and_then(|id| LauncherId::parse(id).ok())
                    {
                        // A launcher is gone: its open requests are free to take over.
                        todo.extend(owned_by(&world, &launcher).map(Dirty::Request));
                    } else if let Some(seat) = key.strip_prefix("backing.") {
                        todo.push(Dirty::Seat(seat.to_string()));
                    }
                }
            },
        }
    }
    for topic in wake {
        shared.signals.bump(&topic);
    }
    for d in todo {
        let _ = dirty.send(d);
    }
}

fn wake_backing(
    world: &crate::world::World,
    id: &slotpool_protocol::BackingId,
    wake: &mut Vec<String>,
    todo: &mut Vec<Dirty>,
) {
    if let Some(seat) = world.seat_of.get(id) {
        wake.push(seat_topic(seat));
        todo.push(Dirty::Seat(seat.clone()));
        if let Some(b) = world.backing.get(seat) {
            wake.push(label_topic(&b.value.label));
        }
    }
}

/// The open requests `launcher` owns.
fn owned_by<'a>(
    world: &'a crate::world::World,
    launcher: &'a LauncherId,
) -> impl Iterator<Item = RequestId> + 'a {
    world
        .open_requests
        .iter()
        .filter(move |id| {
            world
                .requests
                .get(id)
                .is_some_and(|r| r.value.owner.as_ref() == Some(launcher))
        })
        .cloned()
}
