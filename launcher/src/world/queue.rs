//! The one queue of every launcher's open requests: per label, each open request still
//! short of nodes of that label, with how many it still needs, its tenant and the
//! launcher that drives it. It is derived from the mirror (requests and their claims),
//! so every launcher orders the same requests the same way.
//!
//! The rule it serves (applied by [`World`](super::World), which knows the free slots):
//!
//! - **Order.** A label's queue is served tenant by tenant ([`Queue::order`]): the next
//!   request is the one at the head of the tenant furthest below its share of the
//!   label's slots — first the tenants holding fewer than their `guaranteed` slots of
//!   it, then by slots held (and already given to requests ahead in this order) per
//!   unit of `weight`, the least first; ties go to the older head. This is weighted
//!   max-min fairness per label: slots of different labels are different machines, so
//!   a team's use of one label does not lower its turn on another (dominant-resource
//!   fairness would). Within a tenant, requests are served by (priority, creation time,
//!   id): priority orders a tenant's own requests, not the tenants, so no team can
//!   take more than its share by asking with a better priority. With one tenant (no
//!   `tenants` configured) this is plain priority, then age. A tenant at its
//!   `max-slots` is passed over: its requests neither take nor keep slots from others
//!   until it gives some back. Nothing is ever taken back from a running job: a share
//!   is what a tenant gets of the slots that free.
//! - **Who stands.** A request *stands* in the queue of each label it needs: the free
//!   slots it needs are kept from every request after it in the order. A single-node
//!   request stands at once. A node set (more than one node, all handed out together)
//!   stands once it has waited [`SET_PATIENCE_MS`] and every label it needs can hold
//!   what it asks (slots that exist or can still be launched,
//!   [`super::World::attainable`]). Until then, the requests after it may take the free
//!   slots it cannot use yet: this is the only overtaking the all-or-nothing rule
//!   allows, and it is bounded — once the set stands, every slot of its labels that
//!   frees goes to it (or to a request before it), so it is served once the slots it
//!   waits for come back, however many requests arrive after it. A request whose
//!   launcher is gone does not stand; the launcher that takes it over puts it back.
//! - **Who takes.** A request may claim a free slot of a label when the free slots
//!   outnumber what the standing requests before it need of that label; a node set
//!   claims only when that holds for every node it asks for (or when the rest is
//!   booting, see `request::plan`).
//! - **Who is woken.** After any change, a launcher wakes exactly its own requests that
//!   could now claim ([`super::World::take_wakes`]): a walk of each changed label's
//!   order from its head that ends where the standing requests have used up the free
//!   slots. So a change costs a launcher O((free slots + sets not yet standing) x log
//!   tenants) for each label it touches, however long the queue, and a request that
//!   cannot progress is never woken to look again.

use slotpool_protocol::time::UnixMillis;
use slotpool_protocol::{LauncherId, RequestId};
use std::cmp::Ordering;
use std::collections::{btree_map, BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::iter::Peekable;

/// How long a node set waits before it stands in its labels' queues and keeps their
/// free slots from the requests behind it.
pub const SET_PATIENCE_MS: u64 = 30_000;

/// A request's place in its tenant's queue: (priority, creation time, id).
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
    /// Its tenant (an index of the configuration's tenants).
    pub tenant: usize,
}

/// Where a queued request stands ([`Queue::place_of`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Place {
    pub tenant: usize,
    pub pos: QueuePosition,
    /// Nodes it still needs, by label.
    pub needs: Vec<(String, u32)>,
}

/// The queues of all labels ([`Queue::put`], [`Queue::remove`]): per label, one queue
/// per tenant.
#[derive(Debug, Default)]
pub struct Queue {
    by_label: HashMap<String, BTreeMap<usize, BTreeMap<QueuePosition, Entry>>>,
    of: HashMap<RequestId, Place>,
    /// Per label, the nodes all its queued requests still need.
    demand: HashMap<String, u32>,
    /// Per label, the requests queued for it.
    count: HashMap<String, usize>,
    /// Per label, the node sets queued for it: whether they stand in their other
    /// labels' queues hangs on this label's capacity.
    sets: HashMap<String, BTreeSet<RequestId>>,
    /// Every queued request, by (priority, creation time, id) whatever its tenant: the
    /// order the pools' seats go in (`super::seats`).
    order: BTreeSet<QueuePosition>,
}

impl Queue {
    /// Puts request `id` of `tenant` at `pos` in the queues of the labels it still
    /// `needs` (none: it leaves every queue). Returns the labels whose queue changed.
    pub fn put(
        &mut self,
        id: &RequestId,
        pos: QueuePosition,
        owner: Option<LauncherId>,
        set: bool,
        tenant: usize,
        needs: Vec<(String, u32)>,
    ) -> Vec<String> {
        let same = self.of.get(id).is_some_and(|p| {
            p.pos == pos
                && p.needs == needs
                && p.tenant == tenant
                && p.needs.first().is_none_or(|(l, _)| {
                    self.entry(l, tenant, &pos)
                        .is_some_and(|e| e.owner == owner)
                })
        });
        if same {
            return Vec::new();
        }
        let mut changed = self.remove(id);
        for (label, need) in &needs {
            self.by_label
                .entry(label.clone())
                .or_default()
                .entry(tenant)
                .or_default()
                .insert(
                    pos.clone(),
                    Entry {
                        owner: owner.clone(),
                        need: *need,
                        set,
                        tenant,
                    },
                );
            *self.demand.entry(label.clone()).or_default() += need;
            *self.count.entry(label.clone()).or_default() += 1;
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
            self.order.insert(pos.clone());
            self.of.insert(id.clone(), Place { tenant, pos, needs });
        }
        changed
    }

    fn entry(&self, label: &str, tenant: usize, pos: &QueuePosition) -> Option<&Entry> {
        self.by_label.get(label)?.get(&tenant)?.get(pos)
    }

    /// Takes request `id` out of every queue; returns the labels whose queue changed.
    pub fn remove(&mut self, id: &RequestId) -> Vec<String> {
        let Some(place) = self.of.remove(id) else {
            return Vec::new();
        };
        self.order.remove(&place.pos);
        let mut changed = Vec::with_capacity(place.needs.len());
        for (label, need) in place.needs {
            if let Some(queues) = self.by_label.get_mut(&label) {
                if let Some(queue) = queues.get_mut(&place.tenant) {
                    queue.remove(&place.pos);
                    if queue.is_empty() {
                        queues.remove(&place.tenant);
                    }
                }
                if queues.is_empty() {
                    self.by_label.remove(&label);
                }
            }
            if let Some(d) = self.demand.get_mut(&label) {
                *d -= need;
                if *d == 0 {
                    self.demand.remove(&label);
                }
            }
            if let Some(n) = self.count.get_mut(&label) {
                *n -= 1;
                if *n == 0 {
                    self.count.remove(&label);
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

    /// Every entry of `label`'s queue, tenant by tenant (not in serving order: see
    /// [`Queue::order`]).
    pub fn of_label<'a>(
        &'a self,
        label: &str,
    ) -> impl Iterator<Item = (&'a QueuePosition, &'a Entry)> + 'a {
        self.by_label
            .get(label)
            .into_iter()
            .flat_map(|queues| queues.values().flatten())
    }

    /// The tenants with a request waiting for `label`.
    pub fn tenants_of(&self, label: &str) -> impl Iterator<Item = usize> + '_ {
        self.by_label
            .get(label)
            .into_iter()
            .flat_map(|queues| queues.keys().copied())
    }

    /// The labels tenant `tenant` has requests waiting for.
    pub fn labels_of_tenant(&self, tenant: usize) -> Vec<String> {
        self.by_label
            .iter()
            .filter(|(_, queues)| queues.contains_key(&tenant))
            .map(|(label, _)| label.clone())
            .collect()
    }

    /// `label`'s queue in serving order ([`Order`]), as far as the request of `stop`
    /// (tenant, position; it need not be queued) if given: the walk ends where it would
    /// be served.
    pub fn order<'a, F>(
        &'a self,
        label: &str,
        shares: &[Share],
        stop: Option<(usize, &'a QueuePosition)>,
        stands: F,
    ) -> Order<'a, F>
    where
        F: Fn(&QueuePosition, &Entry) -> bool,
    {
        Order::new(self.by_label.get(label), shares, stop, stands)
    }

    /// Every queued request by (priority, creation time, id), whatever its tenant, with
    /// what it still needs by label.
    pub fn in_order(&self) -> impl Iterator<Item = (&QueuePosition, &[(String, u32)])> + '_ {
        self.order.iter().filter_map(|pos| {
            self.of
                .get(&pos.2)
                .map(|place| (&place.pos, place.needs.as_slice()))
        })
    }

    /// How many requests wait in `label`'s queue.
    pub fn len(&self, label: &str) -> usize {
        self.count.get(label).copied().unwrap_or(0)
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
    pub fn place_of(&self, id: &RequestId) -> Option<&Place> {
        self.of.get(id)
    }

    /// The labels whose queues hold a node set that also waits for one of `labels`:
    /// with these labels' capacity, whether such a set stands in those queues changes.
    pub fn linked_labels(&self, labels: &BTreeSet<String>) -> BTreeSet<String> {
        let mut linked = BTreeSet::new();
        for label in labels {
            for id in self.sets.get(label).into_iter().flatten() {
                if let Some(place) = self.of.get(id) {
                    linked.extend(place.needs.iter().map(|(l, _)| l.clone()));
                }
            }
        }
        linked
    }

    /// Whether request `id` waits for `label`.
    pub fn is_short_of(&self, id: &RequestId, label: &str) -> bool {
        self.of
            .get(id)
            .is_some_and(|p| p.needs.iter().any(|(l, _)| l == label))
    }
}

/// What a tenant has of one label when its queue is walked ([`Queue::order`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Share {
    /// Its share against the others' (`weight`, at least 1).
    pub weight: u32,
    /// Slots of the label it gets first (`guaranteed`).
    pub guaranteed: u32,
    /// Slots of the label it holds now.
    pub held: u32,
    /// Slots of any label it gets first (`guaranteed-slots`), and those it holds now.
    pub guaranteed_total: u32,
    pub held_total: u32,
    /// Slots of any label it may still take before its `max-slots` (None: no limit).
    pub room: Option<u32>,
}

/// One request in serving order: its place, its entry, and whether it keeps the free
/// slots it needs from those after it.
pub struct Served<'a> {
    pub pos: &'a QueuePosition,
    pub entry: &'a Entry,
    /// It stands (and its tenant is not at its `max-slots`).
    pub stands: bool,
    /// Its tenant is at its `max-slots`: it may not take a slot now.
    pub capped: bool,
}

/// A tenant's place in the walk: the key it is picked by, least first.
struct Turn {
    /// 0 below its guarantee, 1 above.
    class: u8,
    /// Slots held and given in this walk, per `weight` (compared as fractions).
    used: u64,
    weight: u64,
    head: QueuePosition,
    tenant: usize,
}

impl Turn {
    fn cmp_key(&self, other: &Turn) -> Ordering {
        self.class
            .cmp(&other.class)
            .then_with(|| (self.used * other.weight).cmp(&(other.used * self.weight)))
            .then_with(|| self.head.1.cmp(&other.head.1))
            .then_with(|| self.head.cmp(&other.head))
            .then_with(|| self.tenant.cmp(&other.tenant))
    }
}

impl PartialEq for Turn {
    fn eq(&self, other: &Self) -> bool {
        self.cmp_key(other) == Ordering::Equal
    }
}
impl Eq for Turn {}
impl PartialOrd for Turn {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Turn {
    /// Reversed: the heap pops the least key first.
    fn cmp(&self, other: &Self) -> Ordering {
        other.cmp_key(self)
    }
}

type TenantQueue<'a> = Peekable<btree_map::Range<'a, QueuePosition, Entry>>;

/// A label's queue in serving order ([`Queue::order`]): weighted max-min fairness among
/// tenants, each tenant's own requests by position. O(log tenants) a step.
pub struct Order<'a, F> {
    queues: Vec<(usize, TenantQueue<'a>)>,
    /// Per queue (same index): slots given in this walk, and the state of its tenant.
    given: Vec<u32>,
    shares: Vec<Share>,
    heap: BinaryHeap<Turn>,
    /// Queues whose tenant reached its `max-slots`: walked last, as capped.
    capped: Vec<usize>,
    stop: Option<(usize, &'a QueuePosition)>,
    stands: F,
    ended: bool,
}

impl<'a, F> Order<'a, F>
where
    F: Fn(&QueuePosition, &Entry) -> bool,
{
    fn new(
        queues: Option<&'a BTreeMap<usize, BTreeMap<QueuePosition, Entry>>>,
        shares: &[Share],
        stop: Option<(usize, &'a QueuePosition)>,
        stands: F,
    ) -> Self {
        let mut order = Order {
            queues: Vec::new(),
            given: Vec::new(),
            shares: Vec::new(),
            heap: BinaryHeap::new(),
            capped: Vec::new(),
            stop,
            stands,
            ended: false,
        };
        let mut tenants: Vec<usize> = queues.into_iter().flat_map(|q| q.keys().copied()).collect();
        if let Some((t, _)) = stop {
            if !tenants.contains(&t) {
                tenants.push(t);
            }
        }
        for tenant in tenants {
            let range = match (queues.and_then(|q| q.get(&tenant)), stop) {
                (Some(q), Some((t, pos))) if t == tenant => q.range(..pos.clone()),
                (Some(q), _) => q.range(..),
                (None, _) => EMPTY.range(..),
            };
            let i = order.queues.len();
            order.queues.push((tenant, range.peekable()));
            order.given.push(0);
            order
                .shares
                .push(shares.get(tenant).copied().unwrap_or(Share {
                    weight: 1,
                    ..Share::default()
                }));
            order.schedule(i);
        }
        order
    }

    /// Puts queue `i` back in the heap with the key of its head (or, past its last
    /// request, the stop's position, if it is the stop's tenant).
    fn schedule(&mut self, i: usize) {
        let (tenant, queue) = &mut self.queues[i];
        let head = match queue.peek() {
            Some((pos, _)) => (*pos).clone(),
            None => match self.stop {
                Some((t, pos)) if t == *tenant => pos.clone(),
                _ => return,
            },
        };
        let share = self.shares[i];
        if share.room.is_some_and(|room| self.given[i] >= room) {
            self.capped.push(i);
            return;
        }
        let used = u64::from(share.held) + u64::from(self.given[i]);
        let used_total = u64::from(share.held_total) + u64::from(self.given[i]);
        let guaranteed =
            used < u64::from(share.guaranteed) || used_total < u64::from(share.guaranteed_total);
        self.heap.push(Turn {
            class: u8::from(!guaranteed),
            used,
            weight: u64::from(share.weight.max(1)),
            head,
            tenant: *tenant,
        });
    }

    fn index_of(&self, tenant: usize) -> usize {
        self.queues
            .iter()
            .position(|(t, _)| *t == tenant)
            .expect("a queue per tenant walked")
    }
}

/// No requests: the queue of a tenant that has none but the stop's.
static EMPTY: BTreeMap<QueuePosition, Entry> = BTreeMap::new();

impl<'a, F> Iterator for Order<'a, F>
where
    F: Fn(&QueuePosition, &Entry) -> bool,
{
    type Item = Served<'a>;

    fn next(&mut self) -> Option<Served<'a>> {
        if self.ended {
            return None;
        }
        if let Some(turn) = self.heap.pop() {
            let i = self.index_of(turn.tenant);
            let Some((pos, entry)) = self.queues[i].1.next() else {
                // The stop's request comes next: the walk ends.
                self.ended = true;
                return None;
            };
            let stands = (self.stands)(pos, entry);
            if stands {
                self.given[i] += entry.need;
            }
            self.schedule(i);
            return Some(Served {
                pos,
                entry,
                stands,
                capped: false,
            });
        }
        // Only capped tenants are left (the stop's among them, or not waiting at all).
        while let Some(&i) = self.capped.first() {
            if let Some((pos, entry)) = self.queues[i].1.next() {
                return Some(Served {
                    pos,
                    entry,
                    stands: false,
                    capped: true,
                });
            }
            self.capped.remove(0);
        }
        self.ended = true;
        None
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

    fn one(label: &str, need: u32) -> Vec<(String, u32)> {
        vec![(label.to_string(), need)]
    }

    #[test]
    fn entries_follow_their_request_and_demand_sums_the_needs() {
        let mut q = Queue::default();
        let a = id("req-a");
        let needs = vec![("x".to_string(), 3), ("y".to_string(), 1)];
        let changed = q.put(&a, pos(100, 1, "req-a"), None, true, 0, needs.clone());
        assert_eq!(changed, ["x", "y"]);
        q.put(
            &id("req-b"),
            pos(50, 2, "req-b"),
            None,
            false,
            0,
            one("x", 1),
        );
        assert_eq!((q.demand("x"), q.len("x")), (4, 2));
        let order: Vec<&RequestId> = q
            .order("x", &[], None, |_, _| true)
            .map(|s| &s.pos.2)
            .collect();
        assert_eq!(order, [&id("req-b"), &a], "priority first");
        assert_eq!(
            q.order("x", &[], Some((0, &pos(100, 1, "req-a"))), |_, _| true)
                .count(),
            1,
            "the walk stops where req-a is served"
        );
        assert!(
            q.put(&a, pos(100, 1, "req-a"), None, true, 0, needs)
                .is_empty(),
            "the same place again changes nothing"
        );
        assert_eq!(
            q.put(&a, pos(100, 1, "req-a"), None, true, 0, one("x", 2)),
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
            0,
            vec![("x".into(), 2), ("z".into(), 1)],
        );
        assert_eq!(
            q.linked_labels(&["z".to_string()].into()),
            ["x".to_string(), "z".to_string()].into()
        );
        q.remove(&a);
        q.remove(&id("req-b"));
        assert_eq!(q.labels().count(), 0, "nothing left behind");
        assert!(q.sets.is_empty() && q.count.is_empty() && q.demand.is_empty());
        assert!(q.order.is_empty());
    }

    fn share(weight: u32, guaranteed: u32, held: u32) -> Share {
        Share {
            weight,
            guaranteed,
            held,
            room: None,
            ..Share::default()
        }
    }

    /// Three tenants' requests for one label, in the order they are served.
    fn served(shares: &[Share], per_tenant: usize) -> Vec<usize> {
        let mut q = Queue::default();
        for tenant in 0..shares.len() {
            for n in 0..per_tenant {
                let name = format!("req-{tenant}-{n}");
                q.put(
                    &id(&name),
                    pos(100, n as u64, &name),
                    None,
                    false,
                    tenant,
                    one("x", 1),
                );
            }
        }
        q.order("x", shares, None, |_, _| true)
            .map(|s| s.entry.tenant)
            .collect()
    }

    #[test]
    fn tenants_take_turns_by_weight_and_holdings() {
        // Equal weights, nothing held: round robin, oldest head first.
        assert_eq!(
            served(&[share(1, 0, 0), share(1, 0, 0)], 3),
            [0, 1, 0, 1, 0, 1]
        );
        // Weight 2 against 1: two for one.
        assert_eq!(
            served(&[share(2, 0, 0), share(1, 0, 0)], 4)[..6],
            [0, 1, 0, 1, 0, 0]
        );
        // A tenant holding 3 already waits until the other caught up.
        assert_eq!(
            served(&[share(1, 0, 3), share(1, 0, 0)], 4)[..5],
            [1, 1, 1, 0, 1]
        );
        // A tenant below its guarantee goes first, however much the other is below.
        assert_eq!(served(&[share(1, 0, 0), share(1, 2, 5)], 3)[..3], [0, 0, 0]);
        assert_eq!(served(&[share(1, 0, 5), share(1, 7, 5)], 3)[..3], [1, 1, 0]);
    }

    #[test]
    fn a_tenant_below_its_guarantee_of_every_label_goes_first() {
        // Tenant 1 holds 5 of this label already but only 1 of its 3 guaranteed slots of
        // all labels together: it goes first twice, then shares by holdings.
        let mut below = share(1, 0, 5);
        below.guaranteed_total = 3;
        below.held_total = 1;
        assert_eq!(served(&[share(1, 0, 0), below], 3)[..4], [1, 1, 0, 0]);
        // Holding its guarantee elsewhere, it gets no turn ahead.
        below.held_total = 3;
        assert_eq!(served(&[share(1, 0, 0), below], 3)[..3], [0, 0, 0]);
    }

    #[test]
    fn a_tenant_at_its_limit_comes_last_and_takes_nothing() {
        let mut shares = [share(1, 0, 0), share(1, 0, 0)];
        shares[0].room = Some(1);
        let mut q = Queue::default();
        for (tenant, n) in [(0, 0), (0, 1), (1, 2)] {
            let name = format!("req-{n}");
            q.put(
                &id(&name),
                pos(100, n, &name),
                None,
                false,
                tenant,
                one("x", 1),
            );
        }
        let walk: Vec<(String, bool, bool)> = q
            .order("x", &shares, None, |_, _| true)
            .map(|s| (s.pos.2.to_string(), s.stands, s.capped))
            .collect();
        assert_eq!(
            walk,
            [
                ("req-0".to_string(), true, false),
                ("req-2".to_string(), true, false),
                ("req-1".to_string(), false, true),
            ]
        );
    }

    #[test]
    fn a_walk_to_a_request_not_yet_queued_ends_where_it_would_be_served() {
        let shares = [share(1, 0, 0), share(1, 0, 0)];
        let mut q = Queue::default();
        for n in 0..3 {
            let name = format!("req-b{n}");
            q.put(&id(&name), pos(100, n, &name), None, false, 1, one("x", 1));
        }
        let me = pos(100, 10, "req-new");
        let before: Vec<String> = q
            .order("x", &shares, Some((0, &me)), |_, _| true)
            .map(|s| s.pos.2.to_string())
            .collect();
        assert_eq!(
            before,
            ["req-b0"],
            "tenant 0 has had nothing: it is next after one"
        );
    }
}
