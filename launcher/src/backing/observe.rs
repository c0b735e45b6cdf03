//! What a backing worker (or the supervisor, judging whether one is due) sees before it
//! asks [`lifecycle::next`]: one look at the mirror under its lock.

use super::lifecycle::{self, AgentSeen, Observed, Rules};
use super::planner;
use crate::config::warm;
use crate::shared::Shared;
use slotpool_protocol::model::{BackingNode, DEFAULT_HEARTBEAT_TTL_SECS};
use slotpool_protocol::store::Versioned;
use slotpool_protocol::time::now_ms;
use std::time::Duration;

/// The record and what is observed of it now.
pub(super) fn observe(
    shared: &Shared,
    seat_key: &str,
) -> Option<(Versioned<BackingNode>, Observed)> {
    let mut world = shared.world();
    let b = world.backing.get(seat_key)?.clone();
    let agent = match world.agents.get(&b.value.id) {
        None => AgentSeen::Absent,
        Some(a) if a.secret_sha256 != b.value.secret_sha256 => AgentSeen::Impostor,
        Some(a) => match a.interruption {
            Some(notice) => AgentSeen::Interrupted(notice),
            None => AgentSeen::Up {
                draining: a.draining,
            },
        },
    };
    let rules = shared
        .config
        .label_in(&b.value.provider, &b.value.pool, &b.value.label)
        .map(|s| Rules::of(&s));
    let lost = world.lost_heartbeats.get(&b.value.id).copied();
    let used = world.used_count(&b.value.id);
    let min_ready = planner::ready_now(&shared.config, &world, &b.value.label);
    let free_ahead = if min_ready > 0 && used == 0 {
        lifecycle::free_ahead(
            (seat_key, b.value.slots),
            world
                .backing
                .values()
                .filter(|o| o.key != seat_key && o.value.label == b.value.label)
                .filter(|o| world.takes_slots(&o.value))
                .map(|o| (o.key.as_str(), o.value.slots, world.used_count(&o.value.id))),
        )
    } else {
        0
    };
    let now = now_ms();
    let label = &b.value.label;
    // Only a node that takes slots is about to be claimed by the label's queue: one held,
    // drained, or whose agent is unhealthy is not kept for it.
    let waiting = world.kept_for(&b.value);
    if waiting > 0 && used == 0 {
        world
            .kept_for_queue
            .entry(label.clone())
            .or_default()
            .insert(seat_key.to_string());
    }
    let obs = Observed {
        agent,
        used,
        last_release: world.last_release.get(&b.value.id).copied(),
        rules,
        synced_since: shared.mirror_sync.since(),
        heartbeats_back_at: shared.heartbeat_clock.back_at(),
        heartbeat_lost_at: lost.map(|l| l.at),
        heartbeat_ttl: lost.map_or(Duration::from_secs(DEFAULT_HEARTBEAT_TTL_SECS), |l| l.ttl),
        min_ready,
        free_ahead,
        ready_falls_at: warm::ready_falls_at(&shared.config, label, &world.arrivals, now),
        waiting,
        now,
    };
    Some((b, obs))
}
