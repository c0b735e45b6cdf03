//! The seats of a pool go to the queue in its order. Labels that share a pool's seats
//! (`max-servers` counts the backing nodes of all its labels) compete for them: a node
//! launched for one label, or kept idle for it, is a seat another label's request may
//! need. Were an idle node kept while any request of its label waits, even one it cannot
//! help complete, two labels' node sets could each hold the seats the other needs and
//! every request of both would wait for good.
//!
//! So [`World::seat_shares`] walks the open requests in the queue's order, and each
//! takes what it still needs: first the free slots of nodes in use, then the slots of
//! idle nodes of its labels, then those of nodes booting, then new nodes in the free
//! seats of its labels' pools. That is the order its claims take them in: a request
//! waiting for a booting node claims an idle one that turns up meanwhile (a slot given
//! back, a node the planner launched for a request already served), so that idle node
//! is kept and the booting one, empty once ready, goes after its grace-time. (Taking the
//! booting slots first gave the idle node back at once with a grace-time of 0, while the
//! request was claiming it, and had it wait for the boot.) A request short of seats
//! keeps what it took, and the pools it is short in are closed to the requests behind
//! it: they take no idle node and no seat there (they may still claim free slots, by the
//! queue's rule, `queue.rs`). A request that all the seats of its pools could not hold
//! at once is passed over, so it keeps nothing.
//!
//! The planner launches for what the walk gave each label ([`SeatShares::demand`]), and
//! an idle node is kept only when the walk took its slots ([`SeatShares::idle_taken`],
//! counted over the label's idle nodes in the order slots are claimed from); the others are given back after their grace-time, so
//! the seats they free go to the first request short of them.
//!
//! The walk costs O(requests walked × labels each asks for); it ends once no free
//! slot and no open seat is left, so a full pool costs next to nothing however long
//! the queue.

use super::World;
use slotpool_protocol::model::BackingState;
use std::collections::{HashMap, HashSet};

/// What the walk of the queue gave each label.
#[derive(Debug, Default)]
pub struct SeatShares {
    /// Slots of each label the walk gave out: of nodes taking slots or booting, and of
    /// nodes to launch into free seats.
    pub demand: HashMap<String, u32>,
    /// Slots of each label's idle nodes the walk gave out: the idle nodes that hold
    /// them, in the order slots are claimed from, are kept.
    pub idle_taken: HashMap<String, u32>,
}

impl World {
    /// Walks the queue in its order and shares the free slots and the pools' free seats
    /// out ([module docs](self)).
    pub fn seat_shares(&self) -> SeatShares {
        let mut shares = SeatShares::default();
        // Free slots of idle nodes, of booting ones, and of nodes in use, by label.
        let mut idle: HashMap<&str, u32> = HashMap::new();
        for b in self.backing.values() {
            if self.takes_slots(&b.value) && self.used_count(&b.value.id) == 0 {
                *idle.entry(b.value.label.as_str()).or_default() += b.value.slots;
            }
        }
        let mut booting: HashMap<&str, u32> = HashMap::new();
        let mut busy: HashMap<&str, u32> = HashMap::new();
        for label in self.queue.labels() {
            let i = idle.get(label).copied().unwrap_or(0);
            let n = self.capacity.booting(label);
            booting.insert(label, n);
            busy.insert(label, self.capacity.coming(label).saturating_sub(i + n));
        }
        let mut left: u64 = idle
            .values()
            .chain(busy.values())
            .chain(booting.values())
            .map(|v| u64::from(*v))
            .sum();
        // Free seats by pool, and the pools closed to those behind a request short there.
        // A failed node's record holds its seat until it is launched into again (after
        // the seat's rest, which the planner waits out): that seat is open here.
        let mut failed: HashMap<String, u32> = HashMap::new();
        for b in self.backing.values() {
            if b.value.state == BackingState::Failed {
                *failed.entry(super::pool_key(&b.value)).or_default() += 1;
            }
        }
        let mut open: HashMap<&str, u32> = HashMap::new();
        for label in self.queue.labels() {
            for (pool, max, _) in self.pools.sites(label) {
                let taken = self.seats_taken.get(pool).copied().unwrap_or(0);
                let relaunchable = failed.get(pool).copied().unwrap_or(0);
                open.insert(pool, max.saturating_sub(taken.saturating_sub(relaunchable)));
            }
        }
        let mut closed: HashSet<&str> = HashSet::new();
        for (_, needs) in self.queue.in_order() {
            let seats_left = open
                .iter()
                .any(|(pool, n)| *n > 0 && !closed.contains(pool));
            if left == 0 && !seats_left {
                break;
            }
            if !self.holdable(needs) {
                continue;
            }
            let mut short: Vec<&str> = Vec::new();
            for (label, need) in needs {
                let label = label.as_str();
                let mut rest = *need;
                let from_busy = rest.min(busy.get(label).copied().unwrap_or(0));
                rest -= from_busy;
                let all_closed = self.pools.sites(label).all(|(p, _, _)| closed.contains(p));
                let from_idle = if all_closed {
                    0
                } else {
                    rest.min(idle.get(label).copied().unwrap_or(0))
                };
                rest -= from_idle;
                let from_booting = rest.min(booting.get(label).copied().unwrap_or(0));
                rest -= from_booting;
                let mut from_seats = 0;
                // Slots of the nodes launched for it that it does not need: the
                // requests behind take them first.
                let mut spare = 0;
                for (pool, _, slots) in self.pools.sites(label) {
                    if rest == 0 {
                        break;
                    }
                    if closed.contains(pool) || slots == 0 {
                        continue;
                    }
                    let free = open.get_mut(pool).expect("every site is counted");
                    let nodes = rest.div_ceil(slots).min(*free);
                    *free -= nodes;
                    let launched = nodes * slots;
                    spare += launched.saturating_sub(rest);
                    rest = rest.saturating_sub(launched);
                    from_seats += launched;
                }
                if let Some(b) = busy.get_mut(label) {
                    *b -= from_busy;
                }
                *booting.entry(label).or_default() -= from_booting;
                *booting.entry(label).or_default() += spare;
                left += u64::from(spare);
                if let Some(i) = idle.get_mut(label) {
                    *i -= from_idle;
                }
                left -= u64::from(from_busy + from_idle + from_booting);
                if from_idle > 0 {
                    *shares.idle_taken.entry(label.to_string()).or_default() += from_idle;
                }
                *shares.demand.entry(label.to_string()).or_default() +=
                    from_busy + from_idle + from_booting + from_seats - spare;
                if rest > 0 {
                    short.push(label);
                }
            }
            for label in short {
                closed.extend(self.pools.sites(label).map(|(p, _, _)| p));
            }
        }
        shares
    }

    /// Whether the seats of the pools serving `needs`' labels could hold all of it at
    /// once, were no other node there (each label's nodes at its largest size).
    fn holdable(&self, needs: &[(String, u32)]) -> bool {
        let mut seats: HashMap<&str, u32> = HashMap::new();
        for (label, need) in needs {
            let mut rest = *need;
            for (pool, max, slots) in self.pools.sites(label) {
                if rest == 0 || slots == 0 {
                    break;
                }
                let free = seats.entry(pool).or_insert(max);
                let nodes = rest.div_ceil(slots).min(*free);
                *free -= nodes;
                rest = rest.saturating_sub(nodes * slots);
            }
            if rest > 0 {
                return false;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests_support::{agent, backing, node, request};
    use super::*;
    use crate::config::Config;
    use slotpool_protocol::layout;
    use slotpool_protocol::model::{BackingNode, BackingState};
    use slotpool_protocol::store::Versioned;
    use slotpool_protocol::LauncherId;

    /// `small` (4 slots) and `medium` (2 slots) share the three seats of `main`.
    fn world() -> World {
        world_of(3)
    }

    fn world_of(seats: u32) -> World {
        let yaml = format!(
            "providers:
  - name: p
    driver: local
    pools:
      - name: main
        max-servers: {seats}
        labels:
          - {{name: small, backing-label: vm, max-parallel-jobs: 4}}
          - {{name: medium, backing-label: vm, max-parallel-jobs: 2}}
"
        );
        let config = Config::parse(std::path::Path::new("seats.yaml"), &yaml).unwrap();
        World::for_config(LauncherId::parse("launcher-0").unwrap(), &config)
    }

    fn idle_node(w: &mut World, seat: u32, label: &str, slots: u32) -> Versioned<BackingNode> {
        let id = format!("bn-{seat}");
        let mut b = backing(&id, label, slots, BackingState::Ready);
        b.key = layout::seat_key("p", "main", seat);
        b.value.seat = seat;
        w.put_backing(b.clone());
        w.put_agent(agent(&id));
        b
    }

    fn wait(w: &mut World, id: &str, labels: &[&str], priority: i32) {
        let mut r = request(id, labels);
        r.priority = priority;
        r.owner = w.me.clone();
        w.put_request(Versioned {
            key: id.into(),
            revision: 1,
            value: r,
        });
    }

    /// A failed node's record keeps its seat (for the seat's rest, and until its instance
    /// is gone), but that seat is launched into again, not lost: the walk counts it open,
    /// and the planner waits out the rest.
    #[test]
    fn a_failed_nodes_seat_is_open_to_the_queue() {
        let mut w = world_of(1);
        let mut failed = backing("bn-0", "small", 4, BackingState::Failed);
        failed.key = layout::seat_key("p", "main", 0);
        w.put_backing(failed);
        wait(&mut w, "req-a", &["small"], 100);
        assert_eq!(w.planned_demand("small"), 1);
    }

    #[test]
    fn the_head_of_the_queue_keeps_the_idle_nodes_it_needs_and_no_other() {
        let mut w = world();
        let small_a = idle_node(&mut w, 0, "small", 4);
        let small_b = idle_node(&mut w, 1, "small", 4);
        let medium = idle_node(&mut w, 2, "medium", 2);
        // Ahead: one small and four medium, short of a seat for a second medium node.
        wait(
            &mut w,
            "req-a",
            &["small", "medium", "medium", "medium", "medium"],
            0,
        );
        // Behind: eight small, which the two small nodes would hold.
        wait(&mut w, "req-b", &["small"; 8], 100);
        let shares = w.seat_shares();
        assert_eq!(shares.idle_taken.get("small"), Some(&1));
        assert_eq!(shares.idle_taken.get("medium"), Some(&2));
        assert!(
            w.kept_for(&small_a.value) > 0,
            "holds the head's small node"
        );
        assert_eq!(
            w.kept_for(&small_b.value),
            0,
            "its seat goes to the head's second medium node"
        );
        assert!(w.kept_for(&medium.value) > 0);
        // No seat is free yet: nothing to launch beyond the idle medium node.
        assert_eq!(w.planned_demand("medium"), 2);
        assert_eq!(w.planned_demand("small"), 1, "none for the set behind");
        w.remove_backing(&small_b.key, 10);
        assert_eq!(
            w.planned_demand("medium"),
            4,
            "the freed seat goes to the head"
        );
        // The set behind takes the head's small node's other three slots, and is short.
        assert_eq!(w.planned_demand("small"), 4);
    }

    /// A request waiting for a booting node claims an idle one that turns up first: the
    /// walk gives it that one, so the idle node is kept (not given back at once with a
    /// grace-time of 0 while the request claims it), and nothing more is launched.
    #[test]
    fn a_waiting_request_keeps_the_idle_node_it_claims_before_a_booting_one() {
        let mut w = world();
        let mut boot = backing("bn-1", "small", 4, BackingState::Launching);
        boot.key = layout::seat_key("p", "main", 1);
        boot.value.seat = 1;
        w.put_backing(boot);
        wait(&mut w, "req-a", &["small"], 0);
        let idle = idle_node(&mut w, 0, "small", 4);
        assert_eq!(w.kept_for(&idle.value), 1);
        assert_eq!(w.seat_shares().idle_taken.get("small"), Some(&1));
        assert_eq!(w.planned_demand("small"), 1);
        assert!(w.planned_demand("small") <= w.coming_capacity("small"));
    }

    /// A full pool of 1,000 backing nodes (every slot in use) with `waiting` single
    /// requests of `small` queued at mixed priorities, and one of its nodes.
    fn full_pool(waiting: usize) -> (World, Versioned<BackingNode>) {
        let mut w = world_of(1_000);
        let mut first = None;
        for seat in 0..1_000 {
            let b = idle_node(&mut w, seat, "small", 4);
            for slot in 0..4 {
                w.put_slot(node(&format!("bn-{seat}"), slot, "req-held", "small"));
            }
            first.get_or_insert(b);
        }
        for i in 0..waiting {
            wait(
                &mut w,
                &format!("req-{i}"),
                &["small"],
                (i % 7) as i32 * 100,
            );
        }
        (w, first.expect("a node"))
    }

    /// The figure for a long queue: what one backing decision and one planning of a
    /// label cost with 10,000 requests waiting on a full pool of 1,000 nodes, against
    /// 10 waiting, measured in one run and printed (a figure, not a bound: the walk
    /// ends at once on a full pool, so both are about the same).
    #[test]
    fn the_cost_of_deciding_with_ten_thousand_waiting_is_printed() {
        let cost = |waiting: usize| {
            let (w, b) = full_pool(waiting);
            let rounds = 200;
            let started = std::time::Instant::now();
            for _ in 0..rounds {
                std::hint::black_box(w.planned_demand("small"));
                std::hint::black_box(w.kept_for(&b.value));
                std::hint::black_box(w.seat_shares());
            }
            started.elapsed() / rounds
        };
        let few = cost(10);
        let many = cost(10_000);
        eprintln!(
            "seat walk, planning and a backing decision on a full pool of 1,000 nodes: \
             {:.1} us with 10 requests waiting, {:.1} us with 10,000 ({:.2}x)",
            few.as_secs_f64() * 1e6,
            many.as_secs_f64() * 1e6,
            many.as_secs_f64() / few.as_secs_f64()
        );
    }
}
