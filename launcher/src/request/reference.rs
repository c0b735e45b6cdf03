//! The queue's rule written out on its own (`world/queue.rs` is the launcher's, with its
//! indexes): what the free slots of the ready backing nodes could serve, in the queue's
//! order. A reference to hold the launcher to, from what KV says: the generated mixes
//! of `model.rs` and the end-to-end mixes of real launchers (`tests/tests/mix.rs`) ask
//! it once things settle, and a request it names is one nobody serves.

use super::observe::position;
use crate::world::queue::SET_PATIENCE_MS;
use slotpool_protocol::model::{
    BackingNode, BackingState, IdleBehaviour, Node, NodeRequest, RequestState,
};
use slotpool_protocol::time::UnixMillis;
use std::collections::BTreeMap;

/// The first open request that the free slots could serve at `now`, in words, or
/// `None`. The open requests are taken by (priority, age, id); each takes what it asks
/// for if the free slots left hold all of it, and one that cannot keeps what it needs of
/// them from those behind it when it stands (a single node, or a set that waited its
/// patience and that the usable nodes can hold). Free slots are those of ready backing
/// nodes that take slots (not held or draining) that no node record occupies.
pub fn servable_yet_waiting(
    requests: &[&NodeRequest],
    slots: &[&Node],
    backing: &[&BackingNode],
    now: UnixMillis,
) -> Option<String> {
    let mut free: BTreeMap<&str, u32> = BTreeMap::new();
    let mut total: BTreeMap<&str, u32> = BTreeMap::new();
    for b in backing {
        if b.idle != IdleBehaviour::Run || b.state != BackingState::Ready {
            continue;
        }
        let used = slots.iter().filter(|n| n.backing_id == b.id).count() as u32;
        *free.entry(b.label.as_str()).or_default() += b.slots.saturating_sub(used);
        *total.entry(b.label.as_str()).or_default() += b.slots;
    }
    let mut open: Vec<&NodeRequest> = requests
        .iter()
        .copied()
        .filter(|r| r.state == RequestState::Requested)
        .collect();
    open.sort_by_key(|r| position(r));
    for r in open {
        let mut need: BTreeMap<&str, u32> = BTreeMap::new();
        for l in &r.labels {
            *need.entry(l.as_str()).or_default() += 1;
        }
        for n in slots.iter().filter(|n| n.request_id == r.id) {
            if let Some(c) = need.get_mut(n.label.as_str()) {
                *c = c.saturating_sub(1);
            }
        }
        if need
            .iter()
            .all(|(l, c)| free.get(l).copied().unwrap_or(0) >= *c)
        {
            return Some(format!(
                "{} ({:?} at priority {}) waits, yet the free slots {:?} hold all it needs {:?}",
                r.id, r.labels, r.priority, free, need
            ));
        }
        let stands = r.labels.len() == 1
            || (now >= r.created_at + SET_PATIENCE_MS
                && need
                    .iter()
                    .all(|(l, c)| total.get(l).copied().unwrap_or(0) >= *c));
        if stands {
            for (l, c) in need {
                if let Some(f) = free.get_mut(l) {
                    *f = f.saturating_sub(c);
                }
            }
        }
    }
    None
}

/// With the labels of one pool sharing its `seats` (nodes launched for the queue and
/// given back once idle): the first open request, in the queue's order, that the seats
/// could hold once the idle nodes are given back, in words, or `None`. Nodes with a slot
/// in use, or that take no slots (held, draining, not ready), keep their seats; the
/// others are free. Each request in turn takes the free slots of the nodes in use, then
/// the seats for the rest of what it needs (whole nodes of `label_slots[label]` slots);
/// one the seats cannot hold now is owed them first: it keeps what it can take from
/// those behind it. A request that all the seats together could not hold is passed over
/// (it can never be served; nothing is kept for it).
pub fn unserved_in_seats(
    requests: &[&NodeRequest],
    slots: &[&Node],
    backing: &[&BackingNode],
    seats: u32,
    label_slots: &BTreeMap<String, u32>,
) -> Option<String> {
    let mut free: BTreeMap<&str, u32> = BTreeMap::new();
    let mut kept = 0u32;
    for b in backing {
        let used = slots.iter().filter(|n| n.backing_id == b.id).count() as u32;
        let serving = b.idle == IdleBehaviour::Run && b.state == BackingState::Ready;
        if used > 0 || !serving {
            kept += 1;
        }
        if used > 0 && serving {
            *free.entry(b.label.as_str()).or_default() += b.slots.saturating_sub(used);
        }
    }
    let mut open_seats = seats.saturating_sub(kept);
    let seats_for = |need: &BTreeMap<&str, u32>, free: &BTreeMap<&str, u32>| -> u32 {
        need.iter()
            .map(|(l, c)| {
                let rest = c.saturating_sub(free.get(l).copied().unwrap_or(0));
                let per = label_slots.get(*l).copied().unwrap_or(1).max(1);
                rest.div_ceil(per)
            })
            .sum()
    };
    let mut open: Vec<&NodeRequest> = requests
        .iter()
        .copied()
        .filter(|r| r.state == RequestState::Requested)
        .collect();
    open.sort_by_key(|r| position(r));
    for r in open {
        let mut need: BTreeMap<&str, u32> = BTreeMap::new();
        for l in &r.labels {
            *need.entry(l.as_str()).or_default() += 1;
        }
        for n in slots.iter().filter(|n| n.request_id == r.id) {
            if let Some(c) = need.get_mut(n.label.as_str()) {
                *c = c.saturating_sub(1);
            }
        }
        if seats_for(&need, &BTreeMap::new()) > seats {
            continue;
        }
        let wanted = seats_for(&need, &free);
        if wanted <= open_seats {
            return Some(format!(
                "{} ({:?} at priority {}) waits, yet {open_seats} of the {seats} seats are \
                 free or idle and it needs {wanted} (besides the free slots {free:?} of the \
                 nodes in use)",
                r.id, r.labels, r.priority
            ));
        }
        open_seats -= open_seats.min(wanted);
        for (l, c) in need {
            if let Some(f) = free.get_mut(l) {
                *f = f.saturating_sub(c);
            }
        }
    }
    None
}
