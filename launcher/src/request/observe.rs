//! What a request worker (or the submit fast path) sees before it asks [`plan::next`]:
//! one look at the mirror under its lock, reserving the free slots the request could
//! claim now. Reservations are in-memory only; every look is followed by a claim of
//! them or by [`unreserve`].

use super::plan::{self, NodeSeen, Observed, UnknownLabel, WaitCause};
use crate::config::Config;
use crate::release::claimed_for;
use crate::shared::Shared;
use crate::world::{HeldBack, QueuePosition, World};
use slotpool_protocol::layout;
use slotpool_protocol::model::{BackingState, Node, NodeRequest};
use slotpool_protocol::store::Versioned;
use slotpool_protocol::time::UnixMillis;
use slotpool_protocol::{LauncherId, NodeId};
use std::collections::{BTreeMap, HashMap};

/// What a request worker remembers between looks.
#[derive(Debug, Default)]
pub struct Memory {
    /// The nodes it had their agents prepare, with the record each prepare left: a
    /// fulfilment is conditioned on it ([`super::exec::claims_stand`]).
    pub prepared: HashMap<NodeId, Versioned<Node>>,
    /// The nodes whose claim this worker won, with when it sent the claim.
    pub claimed: HashMap<NodeId, UnixMillis>,
    /// When a prepare was last refused.
    pub refused_at: Option<UnixMillis>,
    /// Since when it waits for slots.
    pub waiting_since: Option<UnixMillis>,
    /// Slot keys whose claim it lost → until when it passes over them: the mirror has
    /// not caught up with the winner yet, and trying again at once would only lose again.
    pub lost_claims: HashMap<String, UnixMillis>,
    /// Claims lost in a row, for the back-off.
    pub conflicts: u32,
}

/// Shortest pause before a slot whose claim was lost is tried again.
const CONFLICT_BACKOFF_MIN_MS: u64 = 50;
/// Longest such pause.
const CONFLICT_BACKOFF_MAX_MS: u64 = 5_000;

impl Memory {
    /// Notes that the claim of slot `key` was lost at `now`: the slot is passed over
    /// for a back-off that doubles with every loss in a row, with jitter, so that
    /// the request moves on to other free slots and never retries one at once.
    pub fn claim_lost(&mut self, key: String, now: UnixMillis) {
        let ceiling = CONFLICT_BACKOFF_MIN_MS
            .saturating_mul(1 << self.conflicts.min(16))
            .min(CONFLICT_BACKOFF_MAX_MS);
        let pause = rand::random_range(ceiling / 2..=ceiling);
        self.conflicts = self.conflicts.saturating_add(1);
        self.lost_claims.insert(key, now + pause);
    }

    /// Notes the claim of `node` that landed, sent at `sent_at`: the back-off starts
    /// over.
    pub fn claim_won(&mut self, node: &NodeId, sent_at: UnixMillis) {
        self.conflicts = 0;
        self.claimed.insert(node.clone(), sent_at);
    }

    /// Forgets lost claims whose pause is over; returns when the next one ends.
    pub fn next_retry(&mut self, now: UnixMillis) -> Option<UnixMillis> {
        self.lost_claims.retain(|_, until| *until > now);
        self.lost_claims.values().min().copied()
    }
}

/// The request's place in the queue for free slots.
pub fn position(r: &NodeRequest) -> QueuePosition {
    (r.priority, r.created_at, r.id.clone())
}

/// Looks at the mirror for request `r`, reserving a free slot for every label without
/// a node that can have one now (in the queue's order).
pub fn look(sh: &Shared, r: &NodeRequest, memory: &Memory) -> Observed {
    let now = slotpool_protocol::time::now_ms();
    look_in(&mut sh.world(), &sh.config, &sh.id, r, memory, now)
}

/// [`look`] at `world` under `config`, for launcher `me`, at `now`: pure, so that the
/// scheduler's tests drive it without a bus.
pub fn look_in(
    world: &mut World,
    config: &Config,
    me: &LauncherId,
    r: &NodeRequest,
    memory: &Memory,
    now: UnixMillis,
) -> Observed {
    let unknown = r
        .labels
        .iter()
        .find(|l| config.sites(l).is_empty())
        .map(|label| UnknownLabel {
            label: label.clone(),
            served: config.label_names().into_iter().map(String::from).collect(),
        });
    let nodes: Vec<NodeSeen> = world
        .nodes_of(&r.id)
        .into_iter()
        .filter(|n| claimed_for(r, &n.value))
        .map(|n| NodeSeen {
            index: n.value.index,
            id: n.value.id.clone(),
            key: n.key.clone(),
            state: n.value.state,
            prepared_here: memory.prepared.contains_key(&n.value.id),
            given_back: world.given_back.contains(&n.value.id),
        })
        .collect();
    let mut reserved = BTreeMap::new();
    let mut causes = BTreeMap::new();
    let mut launch_failures = BTreeMap::new();
    if !r.state.is_final() && unknown.is_none() {
        let pos = position(r);
        let tenant = world.tenant_of(r);
        for (index, label) in r.labels.iter().enumerate() {
            let index = index as u32;
            if nodes.iter().any(|n| n.index == index) {
                continue;
            }
            let lost = |key: &str| {
                memory
                    .lost_claims
                    .get(key)
                    .is_some_and(|until| *until > now)
            };
            match world.reserve_slot_avoiding(tenant, &pos, label, lost, now) {
                Some(slot) => {
                    reserved.insert(index, slot);
                }
                None if !causes.contains_key(label) => {
                    let cause = match world.held_back(tenant, &pos, label, now) {
                        Some(HeldBack::TenantLimit { tenant, max_slots }) => {
                            WaitCause::TenantLimit { tenant, max_slots }
                        }
                        Some(HeldBack::Behind { requests }) => {
                            world.note_behind(label, &r.id);
                            WaitCause::Behind { requests }
                        }
                        None => wait_cause(config, world, label),
                    };
                    causes.insert(label.clone(), cause);
                    if let Some(why) = launch_failure(world, r, label) {
                        launch_failures.insert(label.clone(), why);
                    }
                }
                None => {}
            }
        }
    }
    let max_hold = if r.labels.iter().any(|l| config.hold_limited(l)) {
        max_hold(config, world, r)
    } else {
        None
    };
    Observed {
        max_hold,
        me: me.clone(),
        nodes,
        reserved,
        unknown,
        causes,
        launch_failures,
        refused_at: memory.refused_at,
        waiting_since: memory.waiting_since,
    }
}

/// The shortest `max-hold-time` of the labels of the nodes claimed for `r`, as the
/// pool each node's backing node belongs to configures it.
fn max_hold(config: &Config, world: &World, r: &NodeRequest) -> Option<std::time::Duration> {
    world
        .nodes_of(&r.id)
        .into_iter()
        .filter_map(|n| {
            let b = &world.backing_by_id(&n.value.backing_id)?.value;
            config
                .label_in(&b.provider, &b.pool, &n.value.label)?
                .label
                .max_hold_time
        })
        .min()
}

/// Gives up the reservations of a look that is not followed by their claim.
pub fn unreserve(sh: &Shared, obs: &Observed) {
    if obs.reserved.is_empty() {
        return;
    }
    let mut world = sh.world();
    for slot in obs.reserved.values() {
        world.unreserve(slot);
    }
}

fn wait_cause(config: &Config, world: &World, label: &str) -> WaitCause {
    let booting = || {
        world.backing.values().map(|b| &b.value).filter(|b| {
            b.label == label && matches!(b.state, BackingState::Requested | BackingState::Launching)
        })
    };
    // A node booting in a fallback pool says more than one waiting for its provider's
    // create limits, which says more than a seat out of capacity.
    let booting = booting()
        .find(|b| !b.out_of_capacity && !b.create_queued)
        .or_else(|| booting().find(|b| !b.out_of_capacity))
        .or_else(|| booting().next());
    if let Some(b) = booting {
        if b.create_queued {
            return WaitCause::RateLimited {
                provider: b.provider.clone(),
                backing_label: b.backing_label.clone(),
            };
        }
        if b.out_of_capacity {
            return WaitCause::OutOfCapacity {
                provider: b.provider.clone(),
                backing_label: b.backing_label.clone(),
                failure: b.failure.clone(),
                backoff: crate::provider::CAPACITY_BACKOFF,
            };
        }
        return WaitCause::Booting {
            backing_label: b.backing_label.clone(),
        };
    }
    let full = config
        .sites(label)
        .iter()
        .all(|s| world.seats_of(&s.provider.name, &s.pool.name).len() as u32 >= s.pool.max_servers);
    if full {
        WaitCause::PoolsFull
    } else {
        WaitCause::Taken
    }
}

/// Why `label` cannot be served: a backing node launched for it failed for good after
/// this request was made, and nothing else is coming for it.
fn launch_failure(world: &World, r: &NodeRequest, label: &str) -> Option<String> {
    if world.coming_capacity(label) > 0 {
        return None;
    }
    world
        .backing
        .values()
        .map(|b| &b.value)
        .filter(|b| {
            b.label == label
                && b.state == BackingState::Failed
                && b.ready_at.is_none()
                && b.updated_at >= r.created_at
        })
        .find_map(|b| {
            b.failure.as_ref().map(|f| {
                format!(
                    "could not launch a backing node of {} for label {label:?}: {f}",
                    b.backing_label
                )
            })
        })
}

/// Who should drive request `r`, as the mirror `world` shows its owner's liveness lease
/// to launcher `me`.
pub fn ownership(world: &World, me: &LauncherId, r: &NodeRequest) -> plan::Ownership {
    let owner_alive = r
        .owner
        .as_ref()
        .is_some_and(|owner| world.lease(&layout::launcher_lease_key(owner)).is_some());
    plan::ownership(r, me, owner_alive)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_claim_backs_off_longer_each_time_in_a_row() {
        let mut m = Memory::default();
        m.claim_lost("bn-a.0".into(), 1_000);
        let first = m.lost_claims["bn-a.0"] - 1_000;
        assert!((CONFLICT_BACKOFF_MIN_MS / 2..=CONFLICT_BACKOFF_MIN_MS).contains(&first));
        for _ in 0..20 {
            m.claim_lost("bn-a.0".into(), 1_000);
        }
        let last = m.lost_claims["bn-a.0"] - 1_000;
        assert!((CONFLICT_BACKOFF_MAX_MS / 2..=CONFLICT_BACKOFF_MAX_MS).contains(&last));
        assert_eq!(m.next_retry(1_000), Some(1_000 + last));
        assert_eq!(m.next_retry(1_000 + last), None, "the pause is over");
        m.claim_won(&NodeId::generate(), 0);
        m.claim_lost("bn-a.1".into(), 0);
        assert!(
            m.lost_claims["bn-a.1"] <= CONFLICT_BACKOFF_MIN_MS,
            "starts over"
        );
    }
}
