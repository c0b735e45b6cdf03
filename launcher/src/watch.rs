//! Keeps the [`crate::world::World`] mirror current from KV watches, wakes the workers
//! waiting on what changed, and tells the supervisor which work items to look at.
//!
//! After a dropped watch it watches again from the current values, and forgets keys that
//! disappeared while it was away.

use crate::shared::{label_topic, request_topic, seat_topic, Shared};
use futures::StreamExt;
use slotpool_protocol::model::{AgentHeartbeat, BackingNode, Node, NodeRequest, RequestState};
use slotpool_protocol::store::{Change, Store, Versioned};
use slotpool_protocol::{layout, RequestId};
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

/// Applies one change to the mirror and signals whoever cares.
fn apply(shared: &Shared, mirror: Mirror, dirty: &mpsc::UnboundedSender<Dirty>, change: &Change) {
    let bucket = mirror.store(shared).bucket();
    let mut wake: Vec<String> = Vec::new();
    let mut todo: Vec<Dirty> = Vec::new();
    {
        let mut world = shared.world();
        match (mirror, change) {
            (_, Change::Synced) => {}
            (
                Mirror::Requests,
                Change::Put {
                    key,
                    revision,
                    value,
                },
            ) => {
                if let Some(r) = decode::<NodeRequest>(bucket, key, *revision, value) {
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
            }
            (Mirror::Requests, Change::Removed { key, revision }) => {
                world.remove_request(key, *revision)
            }
            (
                Mirror::Slots,
                Change::Put {
                    key,
                    revision,
                    value,
                },
            ) => {
                if let Some(n) = decode::<Node>(bucket, key, *revision, value) {
                    if let Some(seat) = world.seat_of.get(&n.value.backing_id) {
                        wake.push(seat_topic(seat));
                        todo.push(Dirty::Seat(seat.clone()));
                    }
                    wake.push(request_topic(&n.value.request_id));
                    world.put_slot(n);
                }
            }
            (Mirror::Slots, Change::Removed { key, revision }) => {
                if let Some(old) = world.slots.get(key).map(|n| n.value.clone()) {
                    if let Some(seat) = world.seat_of.get(&old.backing_id) {
                        wake.push(seat_topic(seat));
                        todo.push(Dirty::Seat(seat.clone()));
                    }
                    wake.push(label_topic(&old.label));
                    wake.push(request_topic(&old.request_id));
                }
                world.remove_slot(key, *revision);
            }
            (
                Mirror::Backing,
                Change::Put {
                    key,
                    revision,
                    value,
                },
            ) => {
                if let Some(b) = decode::<BackingNode>(bucket, key, *revision, value) {
                    wake.push(seat_topic(key));
                    wake.push(label_topic(&b.value.label));
                    todo.push(Dirty::Seat(key.clone()));
                    todo.push(Dirty::Label(b.value.label.clone()));
                    world.put_backing(b);
                }
            }
            (Mirror::Backing, Change::Removed { key, revision }) => {
                if let Some(old) = world.backing.get(key) {
                    wake.push(label_topic(&old.value.label));
                    todo.push(Dirty::Label(old.value.label.clone()));
                }
                wake.push(seat_topic(key));
                world.remove_backing(key, *revision);
            }
            (
                Mirror::Agents,
                Change::Put {
                    key,
                    revision,
                    value,
                },
            ) => {
                if let Some(hb) = decode::<AgentHeartbeat>(bucket, key, *revision, value) {
                    let summary = |a: Option<&AgentHeartbeat>| {
                        a.map(|a| (a.secret_sha256.clone(), a.health.healthy, a.draining))
                    };
                    let before = summary(world.agents.get(&hb.value.backing_id));
                    let after = summary(Some(&hb.value));
                    if before != after {
                        wake_backing(&world, &hb.value.backing_id, &mut wake, &mut todo);
                    }
                    world.put_agent(hb.value);
                }
            }
            (Mirror::Agents, Change::Removed { key, .. }) => {
                if let Ok(id) = slotpool_protocol::BackingId::parse(key) {
                    wake_backing(&world, &id, &mut wake, &mut todo);
                }
                world.remove_agent(key);
            }
            (
                Mirror::Leases,
                Change::Put {
                    key,
                    revision,
                    value,
                },
            ) => {
                if let Some(l) = decode(bucket, key, *revision, value) {
                    world.leases.insert(key.clone(), l);
                }
            }
            (Mirror::Leases, Change::Removed { key, .. }) => {
                world.leases.remove(key);
                if let Some(id) = key
                    .strip_prefix("request.")
                    .and_then(|id| RequestId::parse(id).ok())
                {
                    todo.push(Dirty::Request(id));
                } else if let Some(seat) = key.strip_prefix("backing.") {
                    todo.push(Dirty::Seat(seat.to_string()));
                }
            }
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

/// The lease keys of a work item, for the supervisor.
pub fn lease_key(d: &Dirty) -> Option<String> {
    match d {
        Dirty::Request(id) => Some(layout::request_lease_key(id)),
        Dirty::Seat(seat) => Some(layout::backing_lease_key(seat)),
        Dirty::Label(_) => None,
    }
}
