//! Capacity planning: when unmet demand for a label exceeds the slots free or coming,
//! take seats (create backing node records) in the pools serving it, lowest pool priority
//! first, never more than a pool's `max-servers` (backing nodes of every size together),
//! each of the size [`choose_sizes`] picks among the label's `sizes`.
//!
//! Every launcher plans from the same mirror and picks the lowest free seat, so two
//! launchers planning at once race for the same seat key and one of them loses the
//! create: demand is not met twice.

use super::lifecycle;
use crate::provider::FixedIdentity;
use crate::shared::Shared;
use crate::world::World;
use slotpool_config::{warm, BackingSize, Config, LabelSite};
use slotpool_protocol::layout;
use slotpool_protocol::model::{secret_digest, BackingNode, BackingState, IdleBehaviour};
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::now_ms;
use slotpool_protocol::{BackingId, PROTOCOL_VERSION};
use std::collections::HashSet;

/// A seat to take: its index and, when reusing a failed seat, the revision it holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FreeSeat {
    pub seat: u32,
    pub reuse_revision: Option<u64>,
}

/// Seats of a pool that may be taken now, lowest first.
pub fn free_seats<'a>(
    max_servers: u32,
    taken: impl Fn(u32) -> Option<&'a Versioned<BackingNode>>,
    unreadable: &HashSet<u32>,
    now: u64,
) -> Vec<FreeSeat> {
    (0..max_servers)
        .filter(|seat| !unreadable.contains(seat))
        .filter_map(|seat| match taken(seat) {
            None => Some(FreeSeat {
                seat,
                reuse_revision: None,
            }),
            Some(b) if rest_end(&b.value).is_some_and(|end| now >= end) => Some(FreeSeat {
                seat,
                reuse_revision: Some(b.revision),
            }),
            Some(_) => None,
        })
        .collect()
}

/// When a failed backing node's seat ends its rest and may be launched into again
/// ([`lifecycle::seat_rest_end`]).
fn rest_end(b: &BackingNode) -> Option<u64> {
    lifecycle::seat_rest_end(b)
}

/// When the first seat serving `label` that rests now ends its rest, while the label's
/// demand is unmet: the supervisor plans the label again then, rather than at its resync.
pub(crate) fn rest_ends_at(shared: &Shared, label: &str) -> Option<u64> {
    let world = shared.world();
    let min_ready = ready_now(&shared.config, &world, label);
    if deficit(
        world.planned_demand(label),
        world.coming_capacity(label),
        min_ready,
    ) <= 0
    {
        return None;
    }
    let now = now_ms();
    shared
        .config
        .sites(label)
        .iter()
        .flat_map(|site| {
            world
                .seats_of(&site.provider.name, &site.pool.name)
                .into_values()
                .filter_map(|b| rest_end(&b.value))
                .filter(|end| *end > now)
                .collect::<Vec<_>>()
        })
        .min()
}

/// Whether a pool's provider is out of capacity: one of its seats waits out the
/// back-off after a capacity or quota error and has not launched since. Such a seat
/// counts as no capacity coming, and no more seats are taken in its pool, so that the
/// next pool by priority is tried; once a launch there succeeds, the pool is first again.
pub fn out_of_capacity<'a>(mut seats: impl Iterator<Item = &'a Versioned<BackingNode>>) -> bool {
    seats.any(|b| {
        b.value.out_of_capacity
            && matches!(
                b.value.state,
                BackingState::Requested | BackingState::Launching
            )
    })
}

/// Slots of a label to bring up: what the waiting requests want, plus the label's
/// `min-ready` (free slots kept ready for requests yet to come), beyond the slots free
/// now or coming. Negative or zero: nothing to launch.
pub fn deficit(unmet: u32, coming: u32, min_ready: u32) -> i64 {
    i64::from(unmet) + i64::from(min_ready) - i64::from(coming)
}

/// Free slots of `label` to keep ready ([`warm::ready_target`]), from the launcher's
/// arrival log now.
pub(crate) fn ready_now(config: &Config, world: &World, label: &str) -> u32 {
    warm::ready_from(config, label, &world.arrivals, now_ms())
}

/// One size a pool may launch for a label, as the planner weighs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeOffer {
    /// Slots of a backing node of this size.
    pub slots: u32,
    /// What one costs an hour, in millionths of the configured money (whole numbers, so
    /// that sums compare exactly). A size without a price (the single-size form, where
    /// nothing is chosen) costs one unit a slot.
    pub price: u64,
}

impl SizeOffer {
    pub fn of(size: &BackingSize) -> SizeOffer {
        SizeOffer {
            slots: size.slots,
            price: match size.cost_per_hour {
                Some(cost) => (cost * 1e6).round() as u64,
                None => u64::from(size.slots) * 1_000_000,
            },
        }
    }
}

/// What a set of backing nodes costs, compared in this order: the price, then the slots
/// it brings (beyond the need: waste), then how many nodes it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Weight {
    price: u64,
    slots: u64,
    nodes: u64,
}

impl Weight {
    fn plus(self, size: &SizeOffer) -> Weight {
        Weight {
            price: self.price + size.price,
            slots: self.slots + u64::from(size.slots),
            nodes: self.nodes + 1,
        }
    }
}

/// A cheapest cover of every `need` from 0 up, by the last size added and the weight.
type Covers = Vec<Option<(Weight, usize)>>;

/// The sizes of the backing nodes to launch for `need` slots with at most `seats` nodes,
/// as indexes into `sizes`, largest first: the cheapest set that covers `need` (of equal
/// price, the one with the fewest slots to spare, then the fewest nodes); when `seats`
/// cannot cover it, the cheapest of those covering the most. So 3 waiting take one
/// 4-slot node rather than an 8-slot one or two 2-slot ones, and 20 take 8-slot nodes
/// where those are cheapest a slot. Pure: the launcher and the simulator both ask it.
pub(crate) fn choose_sizes(need: u32, sizes: &[SizeOffer], seats: usize) -> Vec<usize> {
    let Some(most) = sizes.iter().map(|s| u64::from(s.slots)).max() else {
        return Vec::new();
    };
    // More than the seats can hold cannot be covered: cover what they can.
    let need = u64::from(need).min(seats as u64 * most) as usize;
    if need == 0 {
        return Vec::new();
    }
    // Without the seats' bound first: each cover of d is a cover of d - slots plus one
    // node. When it takes no more nodes than there are seats, it is also the cheapest
    // within them.
    let mut best: Covers = vec![None; need + 1];
    best[0] = Some((Weight::default(), usize::MAX));
    for d in 1..=need {
        best[d] = cheapest_step(sizes, |i| {
            best[d.saturating_sub(sizes[i].slots as usize)].map(|(w, _)| w)
        });
    }
    let unbounded = unwind(&best, sizes, need);
    if unbounded.len() <= seats {
        return unbounded;
    }
    // Too many nodes for the seats (so fewer seats than the need): the cheapest with at
    // most k nodes, for k = 1..seats. Of each step only the size it added to a cover is
    // kept for the walk back (`KEPT`: the cover with a node fewer was no dearer).
    const KEPT: u16 = u16::MAX;
    let mut weights: Vec<Option<Weight>> = best.iter().map(|_| None).collect();
    weights[0] = Some(Weight::default());
    let mut added: Vec<Vec<u16>> = Vec::with_capacity(seats);
    for _ in 0..seats {
        let prev = weights.clone();
        let mut step = vec![KEPT; need + 1];
        for d in 1..=need {
            let with = cheapest_step(sizes, |i| prev[d.saturating_sub(sizes[i].slots as usize)]);
            match (prev[d], with) {
                (Some(kept), Some((w, _))) if kept <= w => {}
                (_, Some((w, size))) => {
                    weights[d] = Some(w);
                    step[d] = u16::try_from(size).unwrap_or(KEPT);
                }
                (_, None) => {}
            }
        }
        added.push(step);
    }
    let mut out = Vec::new();
    let mut d = need;
    for step in added.iter().rev() {
        if d == 0 {
            break;
        }
        if step[d] != KEPT {
            let size = usize::from(step[d]);
            out.push(size);
            d = d.saturating_sub(sizes[size].slots as usize);
        }
    }
    out.sort_by_key(|i| std::cmp::Reverse(sizes[*i].slots));
    out
}

/// The cheapest of adding one node of each size to the cover `before(size)` weighs, with
/// the size added.
fn cheapest_step(
    sizes: &[SizeOffer],
    before: impl Fn(usize) -> Option<Weight>,
) -> Option<(Weight, usize)> {
    (0..sizes.len())
        .filter_map(|i| before(i).map(|w| (w.plus(&sizes[i]), i)))
        .min()
}

/// The sizes of the cover of `d` in `best`, largest first.
fn unwind(best: &Covers, sizes: &[SizeOffer], mut d: usize) -> Vec<usize> {
    let mut out = Vec::new();
    while d > 0 {
        let (_, size) = best[d].expect("every need has a cover");
        out.push(size);
        d = d.saturating_sub(sizes[size].slots as usize);
    }
    out.sort_by_key(|i| std::cmp::Reverse(sizes[*i].slots));
    out
}

/// What the planner knows of one pool serving a label, in the order pools are tried.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteSeats {
    /// Its provider is out of capacity ([`out_of_capacity`]): the pool is passed over.
    pub out_of_capacity: bool,
    /// Its seats that may be taken now ([`free_seats`]), lowest first.
    pub free: Vec<FreeSeat>,
    /// The sizes the label may be launched in there (`LabelConfig::sizes`, in order).
    pub sizes: Vec<SizeOffer>,
}

/// A seat to take and the size to launch into it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    /// Index into the sites.
    pub site: usize,
    pub seat: FreeSeat,
    /// Index into the site's sizes.
    pub size: usize,
}

/// The seats to take for `deficit` slots: lowest pool priority first, each pool the
/// sizes [`choose_sizes`] picks for what is still wanted and its free seats, until the
/// deficit is covered or every pool is full or out of capacity. Pure: the launcher
/// writes the seats in this order (stopping at the first that another launcher takes),
/// the simulator takes them.
pub fn choose_seats(deficit: i64, sites: &[SiteSeats]) -> Vec<Choice> {
    let mut wanted = deficit;
    let mut chosen = Vec::new();
    for (index, site) in sites.iter().enumerate() {
        if wanted <= 0 {
            break;
        }
        if site.out_of_capacity {
            continue;
        }
        let need = u32::try_from(wanted).unwrap_or(u32::MAX);
        let sizes = choose_sizes(need, &site.sizes, site.free.len());
        for (seat, size) in site.free.iter().zip(sizes) {
            chosen.push(Choice {
                site: index,
                seat: *seat,
                size,
            });
            wanted -= i64::from(site.sizes[size].slots);
        }
    }
    chosen
}

/// The record of a seat taken for `label` in `site` at `now`: a backing node of `size`
/// to launch.
pub fn requested_record(
    site: &LabelSite<'_>,
    size: &BackingSize,
    seat: u32,
    identity: Option<&FixedIdentity>,
    now: u64,
) -> BackingNode {
    BackingNode {
        v: PROTOCOL_VERSION,
        id: identity
            .map(|i| i.backing_id.clone())
            .unwrap_or_else(BackingId::generate),
        provider: site.provider.name.clone(),
        pool: site.pool.name.clone(),
        seat,
        label: site.label.name.clone(),
        backing_label: size.backing_label.clone(),
        slots: size.slots,
        state: BackingState::Requested,
        idle: IdleBehaviour::Run,
        instance: None,
        secret_sha256: identity
            .map(|i| secret_digest(&i.secret))
            .unwrap_or_default(),
        created_at: now,
        launched_at: None,
        ready_at: None,
        idle_since: None,
        attempts: 0,
        out_of_capacity: false,
        create_queued: false,
        uses: 0,
        failure: None,
        attributes: Default::default(),
        order: None,
        interruption: None,
        updated_at: now,
    }
}

/// Takes as many seats as the label's unmet demand and its `min-ready` need, and returns
/// the keys of the seats it took: their backing nodes are `requested`, for the caller to
/// start a backing worker on each.
pub(crate) async fn plan(shared: &Shared, label: &str) -> Vec<String> {
    let mut taken = Vec::new();
    let sites = shared.config.sites(label);
    // Only the planner launcher takes seats (`World::is_planner`), and from one look at
    // the mirror: the deficit and the free seats as of the same moment, so that a seat
    // it sees taken is also counted as coming.
    let (deficit, seats) = {
        let world = shared.world();
        if !world.is_planner() {
            return taken;
        }
        let deficit = deficit(
            world.planned_demand(label),
            world.coming_capacity(label),
            ready_now(&shared.config, &world, label),
        );
        if deficit <= 0 {
            return taken;
        }
        let seats: Vec<SiteSeats> = sites
            .iter()
            .map(|site| {
                let (provider, pool) = (&site.provider.name, &site.pool.name);
                let taken = world.seats_of(provider, pool);
                let out_of_capacity = out_of_capacity(taken.values().copied());
                if out_of_capacity {
                    tracing::debug!(%provider, %pool, %label, "provider out of capacity; trying the next pool");
                }
                let unreadable = world.unreadable_seats_of(provider, pool);
                SiteSeats {
                    out_of_capacity,
                    free: if out_of_capacity {
                        Vec::new()
                    } else {
                        free_seats(
                            site.pool.max_servers,
                            |s| taken.get(&s).copied(),
                            &unreadable,
                            now_ms(),
                        )
                    },
                    sizes: site.label.sizes.iter().map(SizeOffer::of).collect(),
                }
            })
            .collect();
        (deficit, seats)
    };
    for Choice {
        site,
        seat: free,
        size,
    } in choose_seats(deficit, &seats)
    {
        let site = &sites[site];
        let provider = &site.provider.name;
        let pool = &site.pool.name;
        let identity = shared
            .providers
            .get(provider)
            .and_then(|p| p.fixed_identity(pool, free.seat));
        let size = &site.label.sizes[size];
        let record = requested_record(site, size, free.seat, identity.as_ref(), now_ms());
        let key = layout::seat_key(provider, pool, free.seat);
        let written = match free.reuse_revision {
            None => shared.bus.backing.create(&key, &record, None).await,
            Some(rev) => shared.bus.backing.update(&key, &record, rev, None).await,
        };
        match written {
            Ok(revision) => {
                tracing::info!(seat = %key, backing_id = %record.id, %label, backing_label = %record.backing_label, slots = record.slots, "requested a backing node");
                shared.world().put_backing(Versioned {
                    key: key.clone(),
                    revision,
                    value: record,
                });
                taken.push(key);
            }
            Err(KvError::Conflict { .. }) => {
                // Another launcher took it; the watch will show its capacity.
                break;
            }
            Err(err) => {
                tracing::warn!(seat = %key, %err, "cannot take a seat");
                break;
            }
        }
    }
    taken
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool with seats `0..free` open (none reusing a record) offering `sizes`.
    fn site(free: u32, sizes: &[SizeOffer]) -> SiteSeats {
        SiteSeats {
            out_of_capacity: false,
            free: (0..free)
                .map(|seat| FreeSeat {
                    seat,
                    reuse_revision: None,
                })
                .collect(),
            sizes: sizes.to_vec(),
        }
    }

    #[test]
    fn min_ready_counts_in_the_deficit() {
        assert_eq!(deficit(0, 0, 0), 0, "no demand, no warm slots: nothing");
        assert_eq!(
            deficit(0, 0, 2),
            2,
            "no request, yet two slots to keep ready"
        );
        assert_eq!(deficit(0, 3, 2), -1, "three free or coming cover it");
        assert_eq!(deficit(1, 2, 2), 1, "a claim took one of them: one more");
        assert_eq!(deficit(3, 0, 0), 3);
        let site = |free: u32| site(free, &[SizeOffer { slots: 4, price: 4 }]);
        assert_eq!(choose_seats(deficit(0, 0, 2), &[site(2)]).len(), 1);
        assert_eq!(
            choose_seats(deficit(0, 0, 6), &[site(1)]).len(),
            1,
            "never beyond max-servers"
        );
        assert!(choose_seats(deficit(0, 4, 2), &[site(2)]).is_empty());
    }

    /// 2, 4 and 8 slots, a little cheaper a slot the bigger (0.10, 0.19, 0.36 an hour).
    const SIZES: [SizeOffer; 3] = [
        SizeOffer {
            slots: 2,
            price: 100_000,
        },
        SizeOffer {
            slots: 4,
            price: 190_000,
        },
        SizeOffer {
            slots: 8,
            price: 360_000,
        },
    ];

    fn slots_of(sizes: &[SizeOffer], chosen: &[usize]) -> Vec<u32> {
        chosen.iter().map(|i| sizes[*i].slots).collect()
    }

    #[test]
    fn the_size_launched_follows_the_queue_and_the_price() {
        let pick = |need, seats| slots_of(&SIZES, &choose_sizes(need, &SIZES, seats));
        assert_eq!(pick(0, 10), Vec::<u32>::new());
        assert_eq!(pick(1, 10), [2], "one waiting: the smallest");
        assert_eq!(pick(2, 10), [2]);
        assert_eq!(pick(3, 10), [4], "one 4-slot node, not an 8 nor two 2s");
        assert_eq!(pick(5, 10), [4, 2]);
        assert_eq!(pick(7, 10), [8], "0.36 for 8 slots, not 0.38 for 4 + 4");
        assert_eq!(pick(8, 10), [8]);
        assert_eq!(pick(20, 10), [8, 8, 4], "a burst: 8-slot nodes");
        assert_eq!(pick(64, 10), [8; 8]);
        // The seats bound the count: the cheapest of the covers with as few nodes.
        assert_eq!(pick(10, 2), [8, 2]);
        assert_eq!(pick(6, 1), [8]);
        assert_eq!(pick(100, 3), [8, 8, 8], "all the seats can hold");
        assert_eq!(pick(5, 0), Vec::<u32>::new(), "no seat, nothing");
        // Of equal price, the least waste, then the fewest nodes.
        let linear = [
            SizeOffer { slots: 2, price: 2 },
            SizeOffer { slots: 4, price: 4 },
            SizeOffer { slots: 8, price: 8 },
        ];
        let pick = |need, seats| slots_of(&linear, &choose_sizes(need, &linear, seats));
        assert_eq!(pick(3, 10), [4]);
        assert_eq!(pick(20, 10), [8, 8, 4]);
        assert_eq!(pick(16, 10), [8, 8]);
        // A big node far cheaper a slot wins even for one request.
        let bulk = [
            SizeOffer {
                slots: 2,
                price: 10,
            },
            SizeOffer { slots: 8, price: 9 },
        ];
        assert_eq!(slots_of(&bulk, &choose_sizes(1, &bulk, 5)), [8]);
        // Small nodes far cheaper a slot, but too few seats for them: the cheapest cover
        // within the seats.
        let retail = [
            SizeOffer { slots: 2, price: 1 },
            SizeOffer {
                slots: 8,
                price: 100,
            },
        ];
        let pick = |need, seats| slots_of(&retail, &choose_sizes(need, &retail, seats));
        assert_eq!(pick(10, 10), [2, 2, 2, 2, 2]);
        assert_eq!(pick(10, 2), [8, 2]);
        assert_eq!(pick(12, 3), [8, 2, 2], "not 8 + 8");
        assert_eq!(pick(17, 3), [8, 8, 2]);
        // A long queue and a bound on seats: 8x + 2y >= 2000 with x + y <= 300 nodes is
        // cheapest at 234 eights and 64 twos.
        let many = pick(2000, 300);
        let count = |slots| many.iter().filter(|s| **s == slots).count();
        assert_eq!((count(8), count(2)), (234, 64));
        // One size: as many as the need, as before sizes.
        let one = [SizeOffer { slots: 4, price: 4 }];
        assert_eq!(slots_of(&one, &choose_sizes(9, &one, 10)), [4, 4, 4]);
    }

    #[test]
    fn seats_are_taken_pool_by_pool_with_the_sizes_each_offers() {
        let chosen = choose_seats(3, &[site(4, &SIZES)]);
        assert_eq!(
            chosen,
            [Choice {
                site: 0,
                seat: FreeSeat {
                    seat: 0,
                    reuse_revision: None
                },
                size: 1
            }]
        );
        // The first pool has one seat: an 8 there, the rest (12) in the next pool.
        let chosen = choose_seats(20, &[site(1, &SIZES), site(9, &SIZES)]);
        let got: Vec<(usize, u32, u32)> = chosen
            .iter()
            .map(|c| (c.site, c.seat.seat, SIZES[c.size].slots))
            .collect();
        assert_eq!(got, [(0, 0, 8), (1, 0, 8), (1, 1, 4)]);
        let mut full = site(3, &SIZES);
        full.out_of_capacity = true;
        let chosen = choose_seats(1, &[full, site(3, &SIZES)]);
        assert_eq!((chosen.len(), chosen[0].site), (1, 1));
    }

    #[test]
    fn a_pool_is_out_of_capacity_while_a_seat_waits_out_a_capacity_error() {
        use crate::world::tests_support::backing;
        let ready = backing("bn-r", "small", 4, BackingState::Ready);
        let mut waiting = backing("bn-w", "small", 4, BackingState::Launching);
        assert!(!out_of_capacity([&ready, &waiting].into_iter()));
        waiting.value.out_of_capacity = true;
        assert!(out_of_capacity([&ready, &waiting].into_iter()));
        let mut failed = backing("bn-f", "small", 4, BackingState::Failed);
        failed.value.out_of_capacity = true;
        assert!(
            !out_of_capacity([&ready, &failed].into_iter()),
            "a failed seat is not waiting for capacity"
        );
        assert!(!out_of_capacity(std::iter::empty()));
    }

    #[test]
    fn free_seats_are_the_absent_ones_and_rested_failed_ones() {
        let mut failed =
            crate::world::tests_support::backing("bn-f", "small", 4, BackingState::Failed);
        failed.value.updated_at = 1_000;
        let ready = crate::world::tests_support::backing("bn-r", "small", 4, BackingState::Ready);
        let taken = |s: u32| match s {
            0 => Some(&ready),
            1 => Some(&failed),
            _ => None,
        };
        let early = free_seats(3, taken, &HashSet::new(), 1_000);
        assert_eq!(
            early,
            vec![FreeSeat {
                seat: 2,
                reuse_revision: None
            }]
        );
        let later = free_seats(
            3,
            taken,
            &HashSet::new(),
            1_000 + lifecycle::FAILED_SEAT_COOLDOWN.as_millis() as u64,
        );
        assert_eq!(
            later[0],
            FreeSeat {
                seat: 1,
                reuse_revision: Some(1)
            }
        );
    }
}
