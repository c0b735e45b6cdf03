//! What every backing node offers its label, indexed by label, so that handing out a
//! slot and planning cost a lookup instead of a walk over every backing node; and the
//! order slots are handed out in ([`packing_rank`]: smallest node first, then fullest).
//!
//! The [`World`](super::World) works out a node's [`Standing`] whenever something it
//! depends on changes and hands it to [`CapacityIndex::set`]; this module only keeps the
//! books.

use slotpool_protocol::model::{BackingNode, BackingState, IdleBehaviour};
use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};

/// What the backing node `b` offers its label, given, when it takes slots (ready, with
/// a healthy agent, not held), its [`Use`]; `agent_unseen`: no heartbeat of its agent has
/// reached this mirror yet.
pub fn offer(b: &BackingNode, serving: Option<Use>, agent_unseen: bool) -> Offer {
    match (b.state, serving) {
        // A seat whose provider said it is out of capacity brings nothing until a
        // launch succeeds: counting it would keep the planner from the next pool.
        (BackingState::Requested | BackingState::Launching, _) if b.out_of_capacity => {
            Offer::Nothing
        }
        (BackingState::Requested | BackingState::Launching, _) => Offer::Booting { slots: b.slots },
        // Made ready by a worker that saw its agent's heartbeat, whose own watch has not
        // brought it here yet (two buckets, two watches): its slots are coming, as a
        // booting node's. Counted as nothing, they had the planner launch another node
        // for the request about to claim one of them. A heartbeat that was seen and then
        // lapsed is not this.
        (BackingState::Ready, None) if agent_unseen && b.idle == IdleBehaviour::Run => {
            Offer::Booting { slots: b.slots }
        }
        (_, Some(u)) => Offer::Serving {
            slots: b.slots,
            used: u.used,
            held: u.held,
            open: u.open,
        },
        (_, None) => Offer::Nothing,
    }
}

/// How a backing node taking slots uses them now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Use {
    /// Slots holding a node, releasing ones included.
    pub used: u32,
    /// Of those, the ones not being released: what the node is packed by.
    pub held: u32,
    /// Whether one of the others can be handed out now (not dirty, not reserved).
    pub open: bool,
}

/// What one backing node offers its label now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Offer {
    /// Requested or launching: all its slots are coming.
    Booting { slots: u32 },
    /// Taking slots, `used` of `slots` in use, `held` of them not being released;
    /// `open` when one of the others can be handed out now (not dirty, not reserved).
    Serving {
        slots: u32,
        used: u32,
        held: u32,
        open: bool,
    },
    /// Nothing now or soon: held, draining, failed, without a healthy agent…
    Nothing,
}

impl Offer {
    /// Slots free now or soon. A slot being released is coming back once its agent has
    /// cleaned it (milliseconds, or the slot's term grace): counting it as taken would
    /// launch a backing node, which takes far longer, for a request waiting out a burst
    /// of releases.
    fn coming(&self) -> u32 {
        match *self {
            Offer::Booting { slots } => slots,
            Offer::Serving { slots, held, .. } => slots.saturating_sub(held),
            Offer::Nothing => 0,
        }
    }

    /// Slots of a node not taking slots yet that will: booting, or ready with its
    /// agent's heartbeat not seen yet.
    fn booting(&self) -> u32 {
        match *self {
            Offer::Booting { slots } => slots,
            _ => 0,
        }
    }

    /// Slots free now: not in use (dirty and reserved slots count as free here).
    fn free(&self) -> u32 {
        match *self {
            Offer::Serving { slots, used, .. } => slots.saturating_sub(used),
            _ => 0,
        }
    }

    /// Slots the node has or will have: all of them, unless it offers nothing.
    fn total(&self) -> u32 {
        match *self {
            Offer::Booting { slots } | Offer::Serving { slots, .. } => slots,
            Offer::Nothing => 0,
        }
    }

    /// Where the node ranks among those with a slot to hand out ([`Rank`]).
    fn rank(&self) -> Option<Rank> {
        match *self {
            Offer::Serving {
                slots,
                held,
                open: true,
                ..
            } => Some(packing_rank(slots, held)),
            _ => None,
        }
    }
}

/// The order in which the nodes of a label with a slot to hand out are claimed from,
/// lowest first (then by seat key).
pub type Rank = (u32, Reverse<u32>);

/// The packing rule, the one the launcher's claims and the simulator follow: the
/// smallest node first (fewest slots), then the fullest (`held`: slots holding a node
/// not being released). When load falls, the big nodes are the ones left empty, and
/// lifecycle releases them after their grace-time; among nodes of one size, the fullest
/// is filled, so the others empty. A slot being released does not count: its node is
/// about to be that much emptier, and counting it would send a client that releases a
/// node and asks for the next one back to the same node each time, to a slot still
/// warming up again there while equally full nodes have warm ones.
pub fn packing_rank(slots: u32, held: u32) -> Rank {
    (slots, Reverse(held))
}

impl Offer {}

/// A backing node's label and offer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Standing {
    pub label: String,
    pub offer: Offer,
}

/// One label's totals.
#[derive(Debug, Default, PartialEq, Eq)]
struct LabelCapacity {
    /// Seats with a slot to hand out now, in [`packing_rank`] order, then by seat key.
    open: BTreeSet<(Rank, String)>,
    coming: u32,
    /// Of those, the slots of nodes not taking slots yet ([`Offer::booting`]).
    booting: u32,
    /// Slots not in use on the nodes taking slots ([`Offer::free`]).
    free: u32,
    /// Slots of the nodes taking slots or booting, in use or not ([`Offer::total`]).
    total: u32,
}

/// Standings by seat key, and their sums by label.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CapacityIndex {
    by_seat: HashMap<String, Standing>,
    by_label: HashMap<String, LabelCapacity>,
}

impl CapacityIndex {
    /// Records what the node at `seat` offers now (`None`: there is no node there).
    pub fn set(&mut self, seat: &str, standing: Option<Standing>) {
        if self.by_seat.get(seat) == standing.as_ref() {
            return;
        }
        if let Some(old) = self.by_seat.remove(seat) {
            self.leave(seat, &old);
        }
        if let Some(new) = standing {
            let (coming, rank) = (new.offer.coming(), new.offer.rank());
            let (free, total) = (new.offer.free(), new.offer.total());
            if coming > 0 || rank.is_some() || total > 0 {
                let label = self.by_label.entry(new.label.clone()).or_default();
                label.coming += coming;
                label.booting += new.offer.booting();
                label.free += free;
                label.total += total;
                if let Some(rank) = rank {
                    label.open.insert((rank, seat.to_string()));
                }
            }
            self.by_seat.insert(seat.to_string(), new);
        }
    }

    fn leave(&mut self, seat: &str, old: &Standing) {
        let Some(label) = self.by_label.get_mut(&old.label) else {
            return;
        };
        label.coming -= old.offer.coming();
        label.booting -= old.offer.booting();
        label.free -= old.offer.free();
        label.total -= old.offer.total();
        if let Some(rank) = old.offer.rank() {
            label.open.remove(&(rank, seat.to_string()));
        }
        if label.open.is_empty() && label.coming == 0 && label.total == 0 {
            self.by_label.remove(&old.label);
        }
    }

    /// The seat of the node of `label` a slot is claimed from first ([`packing_rank`]).
    pub fn first_open(&self, label: &str) -> Option<&str> {
        let (_, seat) = self.by_label.get(label)?.open.first()?;
        Some(seat)
    }

    /// The seats of `label` with a slot to hand out now, in [`packing_rank`] order.
    pub fn open_seats<'a>(&'a self, label: &str) -> impl Iterator<Item = &'a str> + 'a {
        self.ranked_open_seats(label).map(|(_, seat)| seat)
    }

    /// [`CapacityIndex::open_seats`], each with its rank.
    pub fn ranked_open_seats<'a>(
        &'a self,
        label: &str,
    ) -> impl Iterator<Item = (Rank, &'a str)> + 'a {
        self.by_label
            .get(label)
            .into_iter()
            .flat_map(|l| l.open.iter().map(|(rank, seat)| (*rank, seat.as_str())))
    }

    /// Slots of `label` free now or soon.
    pub fn coming(&self, label: &str) -> u32 {
        self.by_label.get(label).map_or(0, |l| l.coming)
    }

    /// Of [`CapacityIndex::coming`], the slots of `label` on nodes not taking slots yet
    /// (booting, or ready with no heartbeat seen yet).
    pub fn booting(&self, label: &str) -> u32 {
        self.by_label.get(label).map_or(0, |l| l.booting)
    }

    /// Slots of `label` not in use on the nodes taking slots: at least as many as can
    /// be handed out now (dirty and reserved slots count here).
    pub fn free(&self, label: &str) -> u32 {
        self.by_label.get(label).map_or(0, |l| l.free)
    }

    /// Slots of `label` on the nodes taking slots or booting, in use or not: the most
    /// a request can ever hold of them without another launch.
    pub fn total(&self, label: &str) -> u32 {
        self.by_label.get(label).map_or(0, |l| l.total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serving(label: &str, used: u32, open: bool) -> Option<Standing> {
        Some(Standing {
            label: label.into(),
            offer: Offer::Serving {
                slots: 4,
                used,
                held: used,
                open,
            },
        })
    }

    #[test]
    fn the_fullest_open_node_comes_first_and_totals_follow_changes() {
        let mut idx = CapacityIndex::default();
        idx.set("s.a", serving("small", 1, true));
        idx.set("s.b", serving("small", 3, true));
        idx.set("s.c", serving("small", 4, false));
        idx.set(
            "s.d",
            Some(Standing {
                label: "small".into(),
                offer: Offer::Booting { slots: 4 },
            }),
        );
        assert_eq!(idx.first_open("small"), Some("s.b"));
        assert_eq!(idx.coming("small"), 3 + 1 + 4);
        assert_eq!(idx.free("small"), 3 + 1);
        assert_eq!(idx.total("small"), 4 * 4);

        idx.set("s.b", serving("small", 3, false)); // its last slot reserved
        assert_eq!(idx.first_open("small"), Some("s.a"));
        assert_eq!(idx.coming("small"), 8, "reserved is not used");

        idx.set("s.a", serving("big", 1, true)); // a seat taken over by another label
        assert_eq!(idx.first_open("small"), None);
        assert_eq!(idx.first_open("big"), Some("s.a"));
        assert_eq!(idx.coming("small"), 1 + 4);

        for seat in ["s.a", "s.b", "s.c", "s.d"] {
            idx.set(seat, None);
        }
        assert_eq!(idx, CapacityIndex::default(), "nothing left behind");
    }

    #[test]
    fn the_smallest_open_node_comes_first_then_the_fullest() {
        let open = |slots, used| {
            Some(Standing {
                label: "small".into(),
                offer: Offer::Serving {
                    slots,
                    used,
                    held: used,
                    open: true,
                },
            })
        };
        let mut idx = CapacityIndex::default();
        idx.set("s.a", open(8, 7));
        idx.set("s.b", open(2, 0));
        idx.set("s.c", open(4, 3));
        idx.set("s.d", open(2, 1));
        let order: Vec<&str> = idx.open_seats("small").collect();
        assert_eq!(order, ["s.d", "s.b", "s.c", "s.a"]);
    }

    #[test]
    fn ties_go_to_the_lowest_seat_key() {
        let mut idx = CapacityIndex::default();
        idx.set("s.b", serving("small", 2, true));
        idx.set("s.a", serving("small", 2, true));
        assert_eq!(idx.first_open("small"), Some("s.a"));
    }
}
