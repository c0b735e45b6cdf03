//! Capacity planning: when unmet demand for a label exceeds the slots free or coming,
//! take seats (create backing node records) in the pools serving it, lowest pool priority
//! first, never more than a pool's `max-servers`.
//!
//! Every launcher plans from the same mirror and picks the lowest free seat, so two
//! launchers planning at once race for the same seat key and one of them loses the
//! create: demand is not met twice.

use crate::backing;
use crate::lifecycle::FAILED_SEAT_COOLDOWN;
use crate::provider::FixedIdentity;
use crate::shared::Shared;
use slotpool_config::LabelSite;
use slotpool_protocol::layout;
use slotpool_protocol::model::{secret_digest, BackingNode, BackingState, IdleBehaviour};
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::{after, now_ms};
use slotpool_protocol::{BackingId, PROTOCOL_VERSION};
use std::collections::HashSet;
use std::sync::Arc;

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

/// When a failed backing node's seat ends its rest and may be launched into again;
/// `None` for a seat that is not resting (not failed, or its instance not yet deleted).
fn rest_end(b: &BackingNode) -> Option<u64> {
    (b.state == BackingState::Failed && b.instance.is_none())
        .then(|| after(b.updated_at, FAILED_SEAT_COOLDOWN))
}

/// When the first seat serving `label` that rests now ends its rest, while the label's
/// demand is unmet: the supervisor plans the label again then, rather than at its resync.
pub fn rest_ends_at(shared: &Shared, label: &str) -> Option<u64> {
    let world = shared.world();
    let min_ready = shared.config.min_ready(label);
    if deficit(
        world.unmet_demand(label),
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

/// What the planner knows of one pool serving a label, in the order pools are tried.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteSeats {
    /// Its provider is out of capacity ([`out_of_capacity`]): the pool is passed over.
    pub out_of_capacity: bool,
    /// Its seats that may be taken now ([`free_seats`]), lowest first.
    pub free: Vec<FreeSeat>,
    /// Slots of each backing node launched there.
    pub slots: u32,
}

/// The seats to take for `deficit` slots, as (index into `sites`, seat): lowest pool
/// priority first, each seat bringing its pool's slots, until the deficit is covered or
/// every pool is full or out of capacity. Pure: the launcher writes the seats in this
/// order (stopping at the first that another launcher takes), the simulator takes them.
pub fn choose_seats(mut deficit: i64, sites: &[SiteSeats]) -> Vec<(usize, FreeSeat)> {
    let mut chosen = Vec::new();
    for (index, site) in sites.iter().enumerate() {
        if site.out_of_capacity {
            continue;
        }
        for free in &site.free {
            if deficit <= 0 {
                return chosen;
            }
            chosen.push((index, *free));
            deficit -= site.slots as i64;
        }
    }
    chosen
}

/// The record of a seat taken for `label` in `site` at `now`: a backing node to launch.
pub fn requested_record(
    site: &LabelSite<'_>,
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
        backing_label: site.label.backing_label.clone(),
        slots: site.label.max_parallel_jobs,
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
        uses: 0,
        failure: None,
        attributes: Default::default(),
        order: None,
        updated_at: now,
    }
}

/// Takes as many seats as the label's unmet demand and its `min-ready` need.
pub async fn plan(shared: &Arc<Shared>, label: &str) {
    let deficit = {
        let world = shared.world();
        deficit(
            world.unmet_demand(label),
            world.coming_capacity(label),
            shared.config.min_ready(label),
        )
    };
    if deficit <= 0 {
        return;
    }
    let sites = shared.config.sites(label);
    let seats: Vec<SiteSeats> = {
        let world = shared.world();
        sites
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
                    slots: site.label.max_parallel_jobs,
                }
            })
            .collect()
    };
    for (index, free) in choose_seats(deficit, &seats) {
        let site = &sites[index];
        let provider = &site.provider.name;
        let pool = &site.pool.name;
        let identity = shared
            .providers
            .get(provider)
            .and_then(|p| p.fixed_identity(pool, free.seat));
        let record = requested_record(site, free.seat, identity.as_ref(), now_ms());
        let key = layout::seat_key(provider, pool, free.seat);
        let written = match free.reuse_revision {
            None => shared.bus.backing.create(&key, &record, None).await,
            Some(rev) => shared.bus.backing.update(&key, &record, rev, None).await,
        };
        match written {
            Ok(revision) => {
                tracing::info!(seat = %key, backing_id = %record.id, %label, "requested a backing node");
                shared.world().put_backing(Versioned {
                    key: key.clone(),
                    revision,
                    value: record,
                });
                backing::spawn(shared, key);
            }
            Err(KvError::Conflict { .. }) => {
                // Another launcher took it; the watch will show its capacity.
                return;
            }
            Err(err) => {
                tracing::warn!(seat = %key, %err, "cannot take a seat");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let site = |free: u32| SiteSeats {
            out_of_capacity: false,
            free: (0..free)
                .map(|seat| FreeSeat {
                    seat,
                    reuse_revision: None,
                })
                .collect(),
            slots: 4,
        };
        assert_eq!(choose_seats(deficit(0, 0, 2), &[site(2)]).len(), 1);
        assert_eq!(
            choose_seats(deficit(0, 0, 6), &[site(1)]).len(),
            1,
            "never beyond max-servers"
        );
        assert!(choose_seats(deficit(0, 4, 2), &[site(2)]).is_empty());
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
            1_000 + FAILED_SEAT_COOLDOWN.as_millis() as u64,
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
