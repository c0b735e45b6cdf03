//! The event log: one record per backing-node state change and operator order, in the
//! `slotpool_events` bucket, for the console's Events view and `slotpool list events`.
//!
//! Recording never holds up the work it describes: the write runs as its own task, and a
//! failed write is logged, not retried (the change itself is in KV regardless).

use crate::shared::Shared;
use slotpool_protocol::model::{Event, EventKind};
use slotpool_protocol::time::now_ms;
use slotpool_protocol::{BackingId, EventId, NodeId, PROTOCOL_VERSION};

/// What an event is about, besides its message.
#[derive(Clone, Debug, Default)]
pub struct Subject {
    pub backing_id: Option<BackingId>,
    pub node_id: Option<NodeId>,
}

impl Subject {
    pub fn backing(id: &BackingId) -> Subject {
        Subject {
            backing_id: Some(id.clone()),
            node_id: None,
        }
    }

    pub fn node(id: &NodeId) -> Subject {
        Subject {
            backing_id: id.slot().map(|(b, _)| b),
            node_id: Some(id.clone()),
        }
    }
}

/// Records a state change made by this launcher.
pub fn backing_changed(sh: &Shared, id: &BackingId, message: impl Into<String>) {
    let actor = sh.id.to_string();
    record(
        sh,
        EventKind::Backing,
        actor,
        Subject::backing(id),
        message.into(),
    );
}

/// Records a state change made by this launcher, with a word to filter on
/// ([`Event::reason`]).
pub fn backing_changed_for(sh: &Shared, id: &BackingId, message: impl Into<String>, reason: &str) {
    let actor = sh.id.to_string();
    write(
        sh,
        EventKind::Backing,
        actor,
        Subject::backing(id),
        message.into(),
        Some(reason.to_string()),
    );
}

/// Records the deletion of a machine no backing record owned (reason `leak`).
pub fn leak_deleted(sh: &Shared, backing_id: Option<&BackingId>, message: impl Into<String>) {
    let about = Subject {
        backing_id: backing_id.cloned(),
        node_id: None,
    };
    let reason = Some(slotpool_protocol::model::EVENT_REASON_LEAK.to_string());
    write(
        sh,
        EventKind::Backing,
        sh.id.to_string(),
        about,
        message.into(),
        reason,
    );
}

/// Records an operator's order.
pub fn operator(sh: &Shared, actor: &str, about: Subject, message: impl Into<String>) {
    record(
        sh,
        EventKind::Operator,
        actor.to_string(),
        about,
        message.into(),
    );
}

/// Records a record of `bucket` that cannot be read, and what is done about it.
pub fn unreadable(sh: &Shared, bucket: &str, key: &str, revision: u64, error: &str, what: &str) {
    let about = match slotpool_protocol::layout::parse_slot_key(key) {
        Some((backing, slot)) if bucket == sh.bus.slots.bucket() => Subject {
            node_id: Some(NodeId::for_slot(&backing, slot)),
            backing_id: Some(backing),
        },
        _ => Subject::default(),
    };
    record(
        sh,
        EventKind::Backing,
        sh.id.to_string(),
        about,
        format!("unreadable record {bucket}/{key} at revision {revision} ({error}): {what}"),
    );
}

fn record(sh: &Shared, kind: EventKind, actor: String, about: Subject, message: String) {
    write(sh, kind, actor, about, message, None);
}

fn write(
    sh: &Shared,
    kind: EventKind,
    actor: String,
    about: Subject,
    message: String,
    reason: Option<String>,
) {
    let event = Event {
        v: PROTOCOL_VERSION,
        id: EventId::generate(),
        at: now_ms(),
        kind,
        actor,
        backing_id: about.backing_id,
        node_id: about.node_id,
        message,
        reason,
    };
    let events = sh.bus.events.clone();
    sh.tracker.spawn(async move {
        if let Err(err) = events.create(event.id.as_str(), &event, None).await {
            tracing::warn!(%err, event = %event.message, "cannot record an event");
        }
    });
}
