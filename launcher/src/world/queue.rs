//! The one queue of every launcher's open requests: per label, each open request still
//! short of nodes of that label, in queue order, with how many it still needs and
//! which launcher drives it. It is derived from the mirror (requests and their claims),
//! so every launcher orders the same requests the same way.
//!
//! The rule it serves (applied by [`World`](super::World), which knows the free slots):
//!
//! - **Order.** Requests are served by (priority, creation time, id): a lower priority
//!   first, first come first served within a priority, across all launchers.
//! - **Who stands.** A request *stands* in the queue of each label it needs: the free
//!   slots it needs are kept from every request behind it. A single-node request stands
//!   at once. A node set (more than one node, all handed out together) stands once it
//!   has waited [`SET_PATIENCE_MS`] and every label it needs can hold what it asks
//!   (slots that exist or can still be launched, [`super::World::attainable`]). Until
//!   then, the requests behind it may take the free slots it cannot use yet: this is
//!   the only overtaking the all-or-nothing rule allows, and it is bounded — once the
//!   set stands, every slot of its labels that frees goes to it (or to a request ahead
//!   of it), so it is served once the slots it waits for come back, however many
//!   requests arrive behind it. A request whose launcher is gone does not stand; the
//!   launcher that takes it over puts it back.
//! - **Who takes.** A request may claim a free slot of a label when the free slots
//!   outnumber what the standing requests ahead of it need of that label; a node set
//!   claims only when that holds for every node it asks for (or when the rest is
//!   booting, see `request::plan`).
//! - **Who is woken.** After any change, a launcher wakes exactly its own requests that
//!   could now claim ([`super::World::take_wakes`]): a walk of each changed label's
//!   queue from its head that ends where the standing requests have used up the free
//!   slots. So a change costs a launcher O(free slots + sets not yet standing) for each
//!   label it touches, however long the queue, and a request that cannot progress is
//!   never woken to look again.

use slotpool_protocol::time::UnixMillis;
use slotpool_protocol::{LauncherId, RequestId};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// How long a node set waits before it stands in its labels' queues and keeps their
/// free slots from the requests behind it.
pub const SET_PATIENCE_MS: u64 = 30_000;

/// A request's place in the queue: (priority, creation time, id).
pub type QueuePosition = (i32, UnixMillis, RequestId);

/// One request in one label's queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The launcher that drives it.
    pub owner: Option<LauncherId>,
    /// Nodes of the label it still needs.
    pub need: u32,
    /// Whether it is a node set (asks for more than one node in all).
    pub set: bool,
}

/// The queues of all labels ([`Queue::put`], [`Queue::remove`]).
#[derive(Debug, Default)]
pub struct Queue {
    by_label: HashMap<String, BTreeMap<QueuePosition, Entry>>,
    /// Where each queued request stands: its position and what it needs, by label.
    of: HashMap<RequestId, (QueuePosition, Vec<(String, u32)>)>,
    /// Per label, the nodes all its queued requests still need.
    demand: HashMap<String, u32>,
    /// Per label, the node sets queued for it: whether they stand in their other
    /// labels' queues hangs on this label's capacity.
    sets: HashMap<String, BTreeSet<RequestId>>,
}

impl Queue {
    /// Puts request `id` at `pos` in the queues of the labels it still `needs` (none:
    /// it leaves every queue). Returns the labels whose queue changed.
    pub fn put(
        &mut self,
        id: &RequestId,
        pos: QueuePosition,
        owner: Option<LauncherId>,
        set: bool,
        needs: Vec<(String, u32)>,
    ) -> Vec<String> {
        let same = self.of.get(id).is_some_and(|(p, n)| {
            *p == pos
                && *n == needs
                && n.first().is_none_or(|(l, _)| {
                    self.by_label
                        .get(l)
                        .and_then(|q| q.get(&pos))
                        .is_some_and(|e| e.owner == owner)
                })
        });
        if same {
            return Vec::new();
        }
        let mut changed = self.remove(id);
        for (label, need) in &needs {
            self.by_label.entry(label.clone()).or_default().insert(
                pos.clone(),
                Entry {
                    owner: owner.clone(),
                    need: *need,
                    set,
                },
            );
            *self.demand.entry(label.clone()).or_default() += need;
            if set {
                self.sets
                    .entry(label.clone())
                    .or_default()
                    .insert(id.clone());
            }
            if !changed.contains(label) {
                changed.push(label.clone());
            }
        }
        if !needs.is_empty() {
            self.of.insert(id.clone(), (pos, needs));
        }
        changed
    }

    /// Takes request `id` out of every queue; returns the labels whose queue changed.
    pub fn remove(&mut self, id: &RequestId) -> Vec<String> {
        let Some((pos, needs)) = self.of.remove(id) else {
            return Vec::new();
        };
        let mut changed = Vec::with_capacity(needs.len());
        for (label, need) in needs {
            if let Some(queue) = self.by_label.get_mut(&label) {
                queue.remove(&pos);
                if queue.is_empty() {
                    self.by_label.remove(&label);
                }
            }
            if let Some(d) = self.demand.get_mut(&label) {
                *d -= need;
                if *d == 0 {
                    self.demand.remove(&label);
                }
            }
            if let Some(sets) = self.sets.get_mut(&label) {
                sets.remove(id);
                if sets.is_empty() {
                    self.sets.remove(&label);
                }
            }
            changed.push(label);
        }
        changed
    }

    /// The queue of `label`, in order.
    pub fn of_label<'a>(
        &'a self,
        label: &str,
    ) -> impl DoubleEndedIterator<Item = (&'a QueuePosition, &'a Entry)> + 'a {
        self.by_label.get(label).into_iter().flatten()
    }

    /// The entries of `label`'s queue ahead of `pos`, in order.
    pub fn ahead<'a>(
        &'a self,
        label: &str,
        pos: &QueuePosition,
    ) -> impl Iterator<Item = (&'a QueuePosition, &'a Entry)> + 'a {
        let pos = pos.clone();
        self.by_label
            .get(label)
            .into_iter()
            .flat_map(move |q| q.range(..pos.clone()))
    }

    /// How many requests wait in `label`'s queue.
    pub fn len(&self, label: &str) -> usize {
        self.by_label.get(label).map_or(0, BTreeMap::len)
    }

    /// Whether any request waits for `label`.
    pub fn is_waited_for(&self, label: &str) -> bool {
        self.by_label.contains_key(label)
    }

    /// The labels with a queue.
    pub fn labels(&self) -> impl Iterator<Item = &str> {
        self.by_label.keys().map(String::as_str)
    }

    /// Nodes of `label` that the queued requests still need.
    pub fn demand(&self, label: &str) -> u32 {
        self.demand.get(label).copied().unwrap_or(0)
    }

    /// Where request `id` stands and what it needs, if it is queued.
    pub fn place_of(&self, id: &RequestId) -> Option<(&QueuePosition, &[(String, u32)])> {
        self.of.get(id).map(|(p, n)| (p, n.as_slice()))
    }

    /// The labels whose queues hold a node set that also waits for one of `labels`:
    /// with these labels' capacity, whether such a set stands in those queues changes.
    pub fn linked_labels(&self, labels: &BTreeSet<String>) -> BTreeSet<String> {
        let mut linked = BTreeSet::new();
        for label in labels {
            for id in self.sets.get(label).into_iter().flatten() {
                if let Some((_, needs)) = self.of.get(id) {
                    linked.extend(needs.iter().map(|(l, _)| l.clone()));
                }
            }
        }
        linked
    }

    /// Whether request `id` waits for `label`.
    pub fn is_short_of(&self, id: &RequestId, label: &str) -> bool {
        self.of
            .get(id)
            .is_some_and(|(_, needs)| needs.iter().any(|(l, _)| l == label))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> RequestId {
        RequestId::parse(s).unwrap()
    }

    fn pos(p: i32, t: u64, s: &str) -> QueuePosition {
        (p, t, id(s))
    }

    #[test]
    fn entries_follow_their_request_and_demand_sums_the_needs() {
        let mut q = Queue::default();
        let a = id("req-a");
        let changed = q.put(
            &a,
            pos(100, 1, "req-a"),
            None,
            true,
            vec![("x".into(), 3), ("y".into(), 1)],
        );
        assert_eq!(changed, ["x", "y"]);
        q.put(
            &id("req-b"),
            pos(50, 2, "req-b"),
            None,
            false,
            vec![("x".into(), 1)],
        );
        assert_eq!(q.demand("x"), 4);
        let order: Vec<&RequestId> = q.of_label("x").map(|(p, _)| &p.2).collect();
        assert_eq!(order, [&id("req-b"), &a], "priority first");
        assert_eq!(q.ahead("x", &pos(100, 1, "req-a")).count(), 1);
        assert!(
            q.put(
                &a,
                pos(100, 1, "req-a"),
                None,
                true,
                vec![("x".into(), 3), ("y".into(), 1)]
            )
            .is_empty(),
            "the same place again changes nothing"
        );
        assert_eq!(
            q.put(&a, pos(100, 1, "req-a"), None, true, vec![("x".into(), 2)]),
            ["x", "y"]
        );
        assert_eq!((q.demand("x"), q.demand("y")), (3, 0));
        assert!(!q.is_waited_for("y"));
        let x: BTreeSet<String> = ["x".to_string()].into();
        assert_eq!(q.linked_labels(&x), x, "the set waits for x alone now");
        q.put(
            &a,
            pos(100, 1, "req-a"),
            None,
            true,
            vec![("x".into(), 2), ("z".into(), 1)],
        );
        assert_eq!(
            q.linked_labels(&["z".to_string()].into()),
            ["x".to_string(), "z".to_string()].into()
        );
        q.remove(&a);
        q.remove(&id("req-b"));
        assert_eq!(q.labels().count(), 0, "nothing left behind");
        assert!(q.sets.is_empty());
        assert_eq!(q.demand("x"), 0);
    }
}
