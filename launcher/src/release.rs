//! Giving a slot back: [`release`] is the one entry point, by node id, used by the API
//! (a client's release), operators' `release_node`, the request worker (slots of a
//! request that failed or ended without them, a refused prepare, a node whose backing
//! node died) and the sweep of releases and claims left behind ([`sweep_left_behind`]).
//!
//! A release is two writes around an agent call: the node is marked `releasing`
//! (revision-checked; from then on the release is durable, whoever finishes it), the agent
//! cleans the slot, and the slot key is deleted. Every part is safe to run twice.

use crate::nodes::{call_agent, SlotError, AGENT_TIMEOUT};
use crate::shared::{Shared, Work};
use slotpool_protocol::api::{AgentCommand, SlotReleased};
use slotpool_protocol::layout::{self, FINISHED_REQUEST_TTL_SECS};
use slotpool_protocol::model::{Node, NodeRequest, NodeState, RequestState};
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::{now_ms, UnixMillis};
use slotpool_protocol::{LauncherId, NodeId, RequestId};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// When the caller hears back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Finish {
    /// Once the agent cleaned the slot and its key is deleted.
    Wait,
    /// Once the node is marked releasing; the rest runs in the background (an API
    /// reply need not wait for the agent).
    Background,
}

/// Gives back node `id`, only while its slot still holds it: never whatever node the
/// slot holds by then (a slot given back is claimed for another request at once, and a
/// release by slot key would take that one's node away). Idempotent; tolerates a slot
/// that was never prepared. False when there was nothing to release: `id` names no
/// slot, or its slot is free or holds another node.
///
/// From the moment it starts, this launcher's mirror never offers the node to be
/// prepared or handed out again ([`crate::world::World::give_back`]), whatever an older
/// record it still holds says; the mirror gets the node's `releasing` record and its
/// deletion as they are written, not only once the watch brings them back.
pub async fn release(shared: &Arc<Shared>, id: &NodeId, finish: Finish) -> Result<bool, SlotError> {
    Ok(release_unless(shared, id, finish, None).await? == Begun::Marked)
}

/// What a give-back by a request's worker came to ([`give_back`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GaveBack {
    /// The node was released (or already being released).
    Released,
    /// There was nothing to release: the slot is free or holds another node.
    Nothing,
    /// Left alone: by KV, the request is another launcher's now, or was handed the node
    /// ([`may_give_back`]). The worker looks again once its mirror says so.
    Refused,
}

/// Gives back node `id` of request `request`, which this launcher's worker drives and
/// which has not ended: [`release`], but only while KV says the request is still this
/// launcher's and was not handed the node ([`may_give_back`]).
///
/// Two launchers can drive one request for a while (one took it over while the other's
/// watches were away), each preparing the same claimed node; the one whose
/// fulfilment's claim check ([`crate::request::exec::claims_stand`]) conflicts gives the
/// node back, by then perhaps handed to the client by the other. The request is read
/// after the node's record, and the node marked releasing expecting that record's
/// revision: the other launcher took the request over, then wrote the node's record
/// again (its claim check) before it wrote the request fulfilled; so either the read
/// sees the request theirs, or the mark lands before their claim check, which then
/// conflicts and hands nothing out.
pub async fn give_back(
    shared: &Arc<Shared>,
    request: &RequestId,
    id: &NodeId,
) -> Result<GaveBack, SlotError> {
    Ok(
        match release_unless(shared, id, Finish::Wait, Some(request)).await? {
            Begun::Marked => GaveBack::Released,
            Begun::Nothing => GaveBack::Nothing,
            Begun::Refused => GaveBack::Refused,
        },
    )
}

/// Whether the worker of a request may give back its node `id`, with `r` the request as
/// KV has it (`None`: no record, so nothing holds the node through it): not once another
/// launcher owns the request, nor once the request was handed the node.
pub(crate) fn may_give_back(r: Option<&NodeRequest>, me: &LauncherId, id: &NodeId) -> bool {
    r.is_none_or(|r| {
        r.owner.as_ref() == Some(me)
            && !(r.state == RequestState::Fulfilled && r.nodes.contains(id))
    })
}

/// How [`begin_release`] ended.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Begun {
    Marked,
    Nothing,
    Refused,
}

async fn release_unless(
    shared: &Arc<Shared>,
    id: &NodeId,
    finish: Finish,
    worker_of: Option<&RequestId>,
) -> Result<Begun, SlotError> {
    let Some((backing, slot)) = id.slot() else {
        return Ok(Begun::Nothing);
    };
    let key = layout::slot_key(&backing, slot);
    // The mirror's record, when it has one, saves a read (a stale one costs a conflict
    // and a re-read).
    let mirrored = {
        let mut world = shared.world();
        world.give_back(id);
        world.slots.get(&key).filter(|n| &n.value.id == id).cloned()
    };
    let node = match begin_release(shared, &key, id, mirrored, worker_of).await? {
        Ok(node) => node,
        Err(begun) => return Ok(begun),
    };
    match finish {
        Finish::Wait => finish_release(shared, node).await?,
        Finish::Background => spawn_finish_release(shared, node),
    }
    Ok(Begun::Marked)
}

/// Marks node `expect` in slot `key` releasing (revision-checked), starting from `read`
/// when the caller has a recent record (a stale one costs a conflict and a re-read);
/// with `worker_of`, only while [`may_give_back`] says so of that request, read after
/// the node's record. `Err(Nothing)` when the slot is free or holds another node. Once
/// this returns the record, the release is durable: whoever finishes it.
async fn begin_release(
    shared: &Shared,
    key: &str,
    expect: &NodeId,
    mut read: Option<Versioned<Node>>,
    worker_of: Option<&RequestId>,
) -> Result<Result<Versioned<Node>, Begun>, SlotError> {
    loop {
        let current = match read.take() {
            Some(current) => current,
            None => match shared.bus.slots.get::<Node>(key).await? {
                Some(current) => current,
                None => return Ok(Err(Begun::Nothing)),
            },
        };
        if *expect != current.value.id {
            return Ok(Err(Begun::Nothing));
        }
        if current.value.state == NodeState::Releasing {
            return Ok(Ok(current));
        }
        if let Some(request) = worker_of {
            // From the leader: a replica lagging behind a leader change could still show
            // the request as this launcher's after another took it over.
            let r = readable(
                shared
                    .bus
                    .requests
                    .get_from_leader::<NodeRequest>(request.as_str())
                    .await,
            )?;
            if !may_give_back(r.as_ref().map(|r| &r.value), &shared.id, expect) {
                tracing::warn!(
                    node_id = %expect,
                    %request,
                    owner = ?r.as_ref().and_then(|r| r.value.owner.clone()),
                    "not giving the node back: the request is another launcher's now, or \
                     was handed the node"
                );
                return Ok(Err(Begun::Refused));
            }
        }
        let mut node = current.value.clone();
        node.state = NodeState::Releasing;
        node.released_at = Some(now_ms());
        match shared
            .bus
            .slots
            .update(key, &node, current.revision, None)
            .await
        {
            Ok(revision) => {
                let marked = Versioned {
                    key: key.to_string(),
                    revision,
                    value: node,
                };
                shared.world().put_slot(marked.clone());
                return Ok(Ok(marked));
            }
            Err(KvError::Conflict { .. }) => continue,
            Err(err) => return Err(err.into()),
        }
    }
}

/// Finishes the release of a node marked releasing: has the agent clean the slot
/// (skipped when the agent is gone: there is nothing left to clean) and deletes the slot
/// key. Safe to run twice, by two launchers at once or by a late copy of the agent call:
/// the agent wipes only the node named, the key is deleted only while it still holds
/// that node, and another node the agent holds is wiped only once KV proves it has no
/// claim ([`release_unclaimed_holder`]).
async fn finish_release(shared: &Shared, mut node: Versioned<Node>) -> Result<(), SlotError> {
    let agent_alive = shared.world().agents.contains_key(&node.value.backing_id);
    if agent_alive {
        let cmd = AgentCommand::ReleaseSlot {
            slot: node.value.slot,
            node_id: node.value.id.clone(),
        };
        let answer: SlotReleased = call_agent(shared, &node.value.backing_id, &cmd).await?;
        if let Some(holder) = answer.held_by {
            if let Some(confirmed) = release_unclaimed_holder(shared, &node, holder).await? {
                node = confirmed;
            }
        }
    }
    loop {
        match shared.bus.slots.delete(&node.key, node.revision).await {
            Ok(tombstone) => {
                shared.world().remove_slot(&node.key, tombstone);
                break;
            }
            Err(KvError::Conflict { .. }) => match shared.bus.slots.get::<Node>(&node.key).await? {
                // Marked again by a second releaser: still ours to delete.
                Some(again) if again.value.id == node.value.id => node = again,
                _ => break,
            },
            Err(err) => return Err(err.into()),
        }
    }
    expire_when_released(shared, &node.value.request_id, Some(&node.value.id)).await?;
    Ok(())
}

/// What to make of the agent holding the slot of `releasing` (a node being released)
/// for `holder`, another node, given what the slot's key holds now.
#[derive(Debug, PartialEq)]
enum HolderStep {
    /// The key still names `releasing`: rewrite its record unchanged expecting this
    /// revision. A write that lands proves the key named `releasing`, not `holder`,
    /// after the agent answered; `holder` was prepared before, so its claim was written
    /// before that and is gone (a node id is claimed once): `holder` is a stray, and is
    /// wiped at the agent.
    Confirm { revision: u64 },
    /// The key names `holder` (its claim stands: this release reached the agent after
    /// another releaser finished it and the slot was claimed again), or holds no node or
    /// a third one (another releaser finished this release; nothing here proves `holder`
    /// has no claim). Left alone: a stray holder is found again by the next claim's
    /// refused prepare, whose own release proves it.
    LeaveAlone,
}

/// [`HolderStep`] for the agent's answer `holder` to the release of `releasing`, with
/// `now` the slot's record as read after that answer.
fn holder_step(releasing: &NodeId, now: Option<&Versioned<Node>>) -> HolderStep {
    match now {
        Some(n) if &n.value.id == releasing && n.value.state == NodeState::Releasing => {
            HolderStep::Confirm {
                revision: n.revision,
            }
        }
        _ => HolderStep::LeaveAlone,
    }
}

/// The agent holds the slot of `node` (being released) for `holder`, another node.
/// A holder without a claim (a prepare that reached the agent after its node was
/// released, say) would have every later prepare of the slot refused, for ever; so once
/// KV proves `holder` has no claim ([`HolderStep::Confirm`]) the agent is told to
/// release it too. Never on what a read alone says: this release may be a late copy,
/// arriving after another launcher finished it and the slot was claimed and prepared
/// for a node a client now holds (or a lagging replica may answer the read). Returns
/// `node`'s record as rewritten, when it was.
async fn release_unclaimed_holder(
    shared: &Shared,
    node: &Versioned<Node>,
    holder: NodeId,
) -> Result<Option<Versioned<Node>>, SlotError> {
    let mut now = Some(node.clone());
    loop {
        let HolderStep::Confirm { revision } = holder_step(&node.value.id, now.as_ref()) else {
            tracing::warn!(
                backing_id = %node.value.backing_id,
                slot = node.value.slot,
                %holder,
                "the agent holds this slot for another node, and this release was \
                 finished elsewhere; the holder is left alone"
            );
            return Ok(None);
        };
        let current = now.take().expect("confirmed from a record");
        match shared
            .bus
            .slots
            .update(&current.key, &current.value, revision, None)
            .await
        {
            Ok(revision) => {
                let confirmed = Versioned {
                    revision,
                    ..current
                };
                shared.world().put_slot(confirmed.clone());
                release_stale_holder(shared, &confirmed.value, holder).await?;
                return Ok(Some(confirmed));
            }
            Err(KvError::Conflict { .. }) => {
                now = shared.bus.slots.get::<Node>(&current.key).await?;
            }
            Err(err) => return Err(err.into()),
        }
    }
}

/// Has the agent release `stale`, which holds `node`'s slot without a claim
/// ([`release_unclaimed_holder`]).
async fn release_stale_holder(
    shared: &Shared,
    node: &Node,
    stale: NodeId,
) -> Result<(), SlotError> {
    tracing::warn!(
        backing_id = %node.backing_id,
        slot = node.slot,
        %stale,
        "the agent holds this slot for a node without a claim; releasing it there"
    );
    let cmd = AgentCommand::ReleaseSlot {
        slot: node.slot,
        node_id: stale,
    };
    call_agent::<SlotReleased>(shared, &node.backing_id, &cmd).await?;
    Ok(())
}

/// Once no node of a fulfilled request holds a slot any more, marks the request
/// released and lets its record expire ([`FINISHED_REQUEST_TTL_SECS`]). Until then the
/// record stays, so that a claimed node without a request is always a stray
/// ([`left_behind`]), whatever its age. `released` is a node just deleted (not read
/// again). Revision-checked and idempotent: run after every release, and by the sweep
/// for a launcher that died in between. Costs one write for a one-node request.
pub async fn expire_when_released(
    shared: &Shared,
    id: &RequestId,
    released: Option<&NodeId>,
) -> Result<(), SlotError> {
    let mut read = shared.world().requests.get(id).cloned();
    loop {
        let current = match read.take() {
            Some(current) => current,
            None => match readable(shared.bus.requests.get::<NodeRequest>(id.as_str()).await)? {
                Some(current) => current,
                None => return Ok(()),
            },
        };
        let r = &current.value;
        if r.state != RequestState::Fulfilled || r.nodes_released_at.is_some() {
            return Ok(());
        }
        for node in r.nodes.iter().filter(|n| Some(*n) != released) {
            if holds_slot(shared, node).await? {
                return Ok(());
            }
        }
        let mut done = r.clone();
        done.nodes_released_at = Some(now_ms());
        let ttl = Some(Duration::from_secs(FINISHED_REQUEST_TTL_SECS));
        match shared
            .bus
            .requests
            .update(&current.key, &done, current.revision, ttl)
            .await
        {
            Ok(_) => return Ok(()),
            Err(KvError::Conflict { .. }) => continue,
            Err(err) => return Err(err.into()),
        }
    }
}

/// A request as read from KV, `None` when its record cannot be read: nothing can be
/// served for it, so its claims count as left behind.
fn readable(
    read: Result<Option<Versioned<NodeRequest>>, KvError>,
) -> Result<Option<Versioned<NodeRequest>>, KvError> {
    match read {
        Err(KvError::Decode { .. }) => Ok(None),
        other => other,
    }
}

/// Whether node `id` holds its slot, read from KV (the mirror may lag a release).
async fn holds_slot(shared: &Shared, id: &NodeId) -> Result<bool, KvError> {
    let Some((backing, slot)) = id.slot() else {
        return Ok(false);
    };
    let key = layout::slot_key(&backing, slot);
    Ok(shared
        .bus
        .slots
        .get::<Node>(&key)
        .await?
        .is_some_and(|n| &n.value.id == id))
}

/// The pause before the first retry of a release that could not be finished, and before
/// a launcher finishes a release it saw begun and not finished; it doubles up to
/// [`RELEASE_RETRY_MAX`].
pub const RELEASE_RETRY_FIRST: Duration = Duration::from_secs(1);
pub const RELEASE_RETRY_MAX: Duration = Duration::from_secs(30);

/// The pause before retry `attempt` (0 = the first): [`RELEASE_RETRY_FIRST`] doubling up
/// to [`RELEASE_RETRY_MAX`], each within ±25 % so that launchers retrying the same
/// release spread out.
pub fn retry_pause(attempt: u32) -> Duration {
    let base = RELEASE_RETRY_FIRST
        .saturating_mul(1 << attempt.min(16))
        .min(RELEASE_RETRY_MAX);
    base.mul_f64(rand::random_range(0.75..1.25))
}

/// Finishes a release in the background (the API replies once the node is marked),
/// retrying with [`retry_pause`] while the slot still holds the node releasing (an agent
/// that did not answer, a write that failed).
fn spawn_finish_release(shared: &Arc<Shared>, node: Versioned<Node>) {
    let work = Work::Release(node.value.id.clone());
    if !shared.start_work(&work) {
        return;
    }
    let sh = shared.clone();
    let span = tracing::info_span!("release", node_id = %node.value.id);
    shared.spawn_task(
        async move {
            let mut node = node;
            let mut attempt = 0;
            loop {
                let Err(err) = finish_release(&sh, node.clone()).await else {
                    break;
                };
                let pause = retry_pause(attempt);
                attempt += 1;
                tracing::warn!(%err, retry_in = ?pause, "cannot finish the release; retrying");
                // A write that failed while its bucket elected a leader is tried again
                // as soon as the bus is back.
                let back = async {
                    match &err {
                        SlotError::Kv(err) => crate::shared::bus_back(&sh, err, pause).await,
                        _ => tokio::time::sleep(pause).await,
                    }
                };
                tokio::select! {
                    _ = sh.shutdown.cancelled() => break,
                    _ = back => {}
                }
                match releasing(&sh, &node.key).filter(|n| n.value.id == node.value.id) {
                    Some(again) => node = again,
                    None => break,
                }
            }
            sh.end_work(&work);
        }
        .instrument(span),
    );
}

/// The node in slot `key` if the mirror has it releasing.
fn releasing(shared: &Shared, key: &str) -> Option<Versioned<Node>> {
    shared
        .world()
        .slots
        .get(key)
        .filter(|n| n.value.state == NodeState::Releasing)
        .cloned()
}

/// Finishes the release of the node in slot `key` if it is still releasing and no worker
/// of this launcher finishes it: the launcher that began it died, or is still at it (both
/// finishing is safe). The supervisor calls this [`RELEASE_RETRY_FIRST`] after it saw the
/// slot marked.
pub fn finish_left_behind(shared: &Arc<Shared>, key: &str) {
    if let Some(node) = releasing(shared, key) {
        if !shared.is_working_on(&Work::Release(node.value.id.clone())) {
            tracing::info!(node_id = %node.value.id, "finishing a release left behind");
            spawn_finish_release(shared, node);
        }
    }
}

/// How long a node may stay releasing before any launcher finishes its release (the
/// one that began it died, or its agent did not answer), and how long a node may be
/// claimed for a request that does not exist (its launcher died between claiming the
/// slot and creating the request: see [`crate::api`]) or that ended without it, before
/// it is released.
pub const STALE_RELEASE: Duration = Duration::from_secs(AGENT_TIMEOUT.as_secs() + 15);

/// Finishes releases left behind, and releases slots claimed for requests that were
/// never created or ended without them: all written longer than [`STALE_RELEASE`] ago
/// by the server's clock (the time of the KV write, as the watch brought it).
pub fn sweep_left_behind(shared: &Arc<Shared>) {
    let cutoff = now_ms().saturating_sub(STALE_RELEASE.as_millis() as u64);
    let (stale, orphans): (Vec<Versioned<Node>>, Vec<Versioned<Node>>) = {
        let world = shared.world();
        world
            .slots
            .values()
            .filter(|n| {
                // Ages are the server's: a time inside the record proves nothing.
                let old = written_before(world.slot_written_at(&n.key, n.revision), cutoff);
                match n.value.state {
                    NodeState::Releasing => old,
                    NodeState::Preparing | NodeState::Ready => {
                        // A request whose record cannot be read is not being created:
                        // its claims need not wait to be judged.
                        (old || world.unreadable_requests.contains_key(&n.value.request_id))
                            && left_behind(
                                &n.value,
                                world.requests.get(&n.value.request_id).map(|r| &r.value),
                            )
                    }
                    NodeState::Failed => false,
                }
            })
            .cloned()
            .partition(|n| n.value.state == NodeState::Releasing)
    };
    for node in stale {
        tracing::info!(node_id = %node.value.id, "finishing a release left behind");
        spawn_finish_release(shared, node);
    }
    for node in failed_untold(shared, cutoff) {
        let sh = shared.clone();
        shared.tracker.spawn(async move {
            let reason = node.failure.clone().unwrap_or_default();
            if let Err(err) = crate::nodes::note_failed_node(&sh, &node, &reason).await {
                tracing::warn!(node_id = %node.id, %err, "cannot tell a request its node failed");
            }
        });
    }
    for id in released_unmarked(shared, cutoff) {
        let sh = shared.clone();
        shared.tracker.spawn(async move {
            if let Err(err) = expire_when_released(&sh, &id, None).await {
                tracing::warn!(request_id = %id, %err, "cannot mark a request's nodes released");
            }
        });
    }
    for node in orphans {
        let sh = shared.clone();
        shared.tracker.spawn(async move {
            let id = node.value.id.clone();
            if let Err(err) = release_orphan(&sh, node).await {
                tracing::warn!(node_id = %id, %err, "cannot release an orphaned slot");
            }
        });
    }
}

/// Releases a node the mirror says is [`left_behind`], once the request's record in KV
/// says so too (the mirror may not have the request yet).
async fn release_orphan(shared: &Arc<Shared>, node: Versioned<Node>) -> Result<(), SlotError> {
    let request = readable(
        shared
            .bus
            .requests
            .get::<NodeRequest>(node.value.request_id.as_str())
            .await,
    )?;
    if !left_behind(&node.value, request.as_ref().map(|r| &r.value)) {
        return Ok(());
    }
    tracing::info!(node_id = %node.value.id, request_id = %node.value.request_id, "releasing a slot claimed for a request that is gone or ended without it");
    release(shared, &node.value.id, Finish::Background)
        .await
        .map(|_| ())
}

/// Failed nodes, marked before `cutoff`, whose request holds them and does not say so
/// yet: their launcher died between the two writes ([`crate::nodes::mark_failed`]).
fn failed_untold(shared: &Shared, cutoff: u64) -> Vec<Node> {
    let world = shared.world();
    world
        .slots
        .values()
        .filter(|n| n.value.state == NodeState::Failed)
        .filter(|n| written_before(world.slot_written_at(&n.key, n.revision), cutoff))
        .filter(|n| {
            world.requests.get(&n.value.request_id).is_some_and(|r| {
                crate::nodes::with_failed_node(&r.value, &n.value.id, "", 0).is_some()
            })
        })
        .map(|n| n.value.clone())
        .collect()
}

/// Fulfilled requests that no mirrored slot holds a node of any more, not yet marked
/// released, and last written before `cutoff`: their launcher died between the last
/// release and [`expire_when_released`].
fn released_unmarked(shared: &Shared, cutoff: u64) -> Vec<RequestId> {
    let world = shared.world();
    let held: HashSet<&RequestId> = world.slots.values().map(|n| &n.value.request_id).collect();
    world
        .requests
        .values()
        .filter(|r| written_before(world.request_written_at(&r.key, r.revision), cutoff))
        .map(|r| &r.value)
        .filter(|r| {
            r.state == RequestState::Fulfilled
                && r.nodes_released_at.is_none()
                && !held.contains(&r.id)
        })
        .map(|r| r.id.clone())
        .collect()
}

/// Whether a record the server wrote at `written_at` is older than `cutoff`. Unknown
/// (a write of this launcher's whose echo the watch has not brought yet) is young: the
/// record's own times are never trusted, so a forged or broken one cannot shield its
/// slot from the sweep, nor a skewed clock free a slot early.
fn written_before(written_at: Option<UnixMillis>, cutoff: UnixMillis) -> bool {
    written_at.is_some_and(|at| at <= cutoff)
}

/// Whether a claimed node (`preparing` or `ready`) belongs to no request: its request
/// ended without it, or does not exist. A fulfilled request is kept while its nodes are
/// held ([`expire_when_released`]), so a node without a request record is a stray
/// whatever its age: a claim written by a launcher that died before creating the
/// request, or a forged one.
fn left_behind(node: &Node, request: Option<&NodeRequest>) -> bool {
    match request {
        Some(r) => is_stray_of(node, r),
        None => true,
    }
}

/// Whether `node`, claimed under request `r`'s id, was claimed for `r`: by a submit of
/// `r`'s own client. A request id is the client's choice and may be known to another
/// (printed in a job's log, say); a claim that another client's submit made under it
/// (before its create failed: the id was taken) must never become one of `r`'s nodes,
/// which would hand `r` a slot prepared with the other's key. Nor is a claim whose label
/// is not the one `r` asks for at its index (a submit of the same id with other labels).
/// Such a claim is its submit's to give back, or the sweep's
/// ([`sweep_left_behind`]).
pub(crate) fn claimed_for(r: &NodeRequest, node: &Node) -> bool {
    node.client == r.client && r.labels.get(node.index as usize) == Some(&node.label)
}

/// Whether `node`, claimed under request `r`'s id, is not `r`'s to keep: `r` ended
/// without it, or another client's submit claimed it under `r`'s id
/// ([`claimed_for`]).
pub fn is_stray_of(node: &Node, r: &NodeRequest) -> bool {
    !claimed_for(r, node)
        || (r.state.is_final()
            && !(r.state == RequestState::Fulfilled && r.nodes.contains(&node.id)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use slotpool_protocol::{BackingId, PROTOCOL_VERSION};

    #[test]
    fn a_node_claimed_under_a_requests_id_by_another_client_is_not_the_requests() {
        let mut r = crate::world::tests_support::request("req-1", &["small"]);
        r.client = Some(slotpool_protocol::UserName::parse("ci").unwrap());
        let mut node = crate::world::tests_support::node("bn-1", 0, "req-1", "small").value;
        node.client = r.client.clone();
        assert!(claimed_for(&r, &node));
        node.client = Some(slotpool_protocol::UserName::parse("mallory").unwrap());
        assert!(
            !claimed_for(&r, &node),
            "another client's claim under the id"
        );
        assert!(is_stray_of(&node, &r));
        node.client = r.client.clone();
        node.label = "big".into();
        assert!(
            !claimed_for(&r, &node),
            "a claim for another label at the index"
        );
        node.label = "small".into();
        node.index = 1;
        assert!(
            !claimed_for(&r, &node),
            "a claim for an index the request has not"
        );
    }

    /// Two launchers drove one request: one took it over while the other's watches were
    /// away. The other's fulfilment check conflicted (the first had rewritten the node
    /// preparing it), so it gave the node back, by then handed to the client by the
    /// first: the give-back wiped it under the client. A worker gives back a node only
    /// while KV says the request is its own and was not handed the node.
    #[test]
    fn a_worker_gives_back_no_node_of_a_request_another_launcher_owns_or_handed_out() {
        let me = LauncherId::parse("launcher-a").unwrap();
        let other = LauncherId::parse("launcher-b").unwrap();
        let n = node(NodeState::Ready, 1).id;
        let mut r = request(RequestState::Requested, vec![]);
        r.owner = Some(me.clone());
        assert!(may_give_back(Some(&r), &me, &n), "its own open request");
        assert!(may_give_back(None, &me, &n), "no request holds it");
        let mut theirs = r.clone();
        theirs.owner = Some(other.clone());
        assert!(!may_give_back(Some(&theirs), &me, &n), "taken over");
        theirs.state = RequestState::Fulfilled;
        theirs.nodes = vec![n.clone()];
        assert!(
            !may_give_back(Some(&theirs), &me, &n),
            "handed out by the other"
        );
        let mut handed = theirs.clone();
        handed.owner = Some(me.clone());
        assert!(!may_give_back(Some(&handed), &me, &n), "handed out");
        handed.nodes = vec![NodeId::for_slot(&BackingId::parse("bn-1").unwrap(), 0)];
        assert!(
            may_give_back(Some(&handed), &me, &n),
            "fulfilled without it: a stray of its own"
        );
    }

    #[test]
    fn a_holder_is_wiped_only_while_the_key_names_the_node_being_released() {
        let at = |value: Node, revision| Versioned {
            key: "slot".into(),
            revision,
            value,
        };
        let releasing = node(NodeState::Releasing, 1);
        assert_eq!(
            holder_step(&releasing.id, Some(&at(releasing.clone(), 7))),
            HolderStep::Confirm { revision: 7 }
        );
        // Another releaser finished this release and the slot was claimed again: the
        // agent's holder is that claim's node, which a client may hold by now.
        let mut claimed = node(NodeState::Ready, 2);
        claimed.id = NodeId::for_slot(&releasing.backing_id, 0);
        assert_ne!(claimed.id, releasing.id);
        assert_eq!(
            holder_step(&releasing.id, Some(&at(claimed.clone(), 9))),
            HolderStep::LeaveAlone
        );
        claimed.state = NodeState::Preparing;
        assert_eq!(
            holder_step(&releasing.id, Some(&at(claimed, 9))),
            HolderStep::LeaveAlone
        );
        assert_eq!(holder_step(&releasing.id, None), HolderStep::LeaveAlone);
        let mut ready = releasing.clone();
        ready.state = NodeState::Ready;
        assert_eq!(
            holder_step(&releasing.id, Some(&at(ready, 8))),
            HolderStep::LeaveAlone,
            "a record that does not say releasing is not this release's"
        );
    }

    #[test]
    fn retries_start_at_a_second_and_double_to_thirty_with_jitter() {
        let within = |d: Duration, base: f64| {
            let s = d.as_secs_f64();
            s >= base * 0.75 && s <= base * 1.25
        };
        for _ in 0..100 {
            assert!(within(retry_pause(0), 1.0));
            assert!(within(retry_pause(1), 2.0));
            assert!(within(retry_pause(4), 16.0));
            assert!(within(retry_pause(5), 30.0));
            assert!(within(retry_pause(40), 30.0));
        }
    }

    fn node(state: NodeState, allocated_at: u64) -> Node {
        let backing = BackingId::parse("bn-1").unwrap();
        Node {
            v: PROTOCOL_VERSION,
            id: NodeId::for_slot(&backing, 0),
            request_id: RequestId::parse("req-1").unwrap(),
            index: 0,
            label: "small".into(),
            backing_id: backing,
            slot: 0,
            state,
            requestor: "t".into(),
            client: None,
            host: String::new(),
            workspace: None,
            attributes: Default::default(),
            allocated_at,
            released_at: None,
            failure: None,
            login: Default::default(),
        }
    }

    fn request(state: RequestState, nodes: Vec<NodeId>) -> NodeRequest {
        let mut r = crate::world::tests_support::request("req-1", &["small"]);
        r.state = state;
        r.nodes = nodes;
        r
    }

    #[test]
    fn a_claimed_node_is_left_behind_when_its_request_ended_without_it_or_never_was() {
        let hour = FINISHED_REQUEST_TTL_SECS * 1000;
        let now = 10 * hour;
        for age in [60_000, hour + 1, 5 * hour] {
            for state in [NodeState::Preparing, NodeState::Ready] {
                let n = node(state, now - age);
                let mine = request(RequestState::Fulfilled, vec![n.id.clone()]);
                let other = request(
                    RequestState::Fulfilled,
                    vec![NodeId::parse("node-x").unwrap()],
                );
                assert!(!left_behind(&n, Some(&mine)), "{state:?}: its own");
                assert!(left_behind(&n, Some(&other)), "{state:?}: a stray");
                let waiting = request(RequestState::Requested, vec![]);
                assert!(!left_behind(&n, Some(&waiting)), "{state:?}: its worker's");
                for ended in [RequestState::Failed, RequestState::Canceled] {
                    let r = request(ended, vec![]);
                    assert!(left_behind(&n, Some(&r)), "{state:?}: {ended:?}");
                }
                // A fulfilled request is kept while its nodes are held: a node without
                // one is a stray however long ago it was claimed (a forged claim too).
                assert!(left_behind(&n, None), "{state:?} {age} ms old: no request");
            }
        }
    }

    #[test]
    fn ages_are_the_servers_time_of_the_write() {
        let cutoff = 100 * 3_600_000;
        assert!(written_before(Some(cutoff), cutoff));
        assert!(!written_before(Some(cutoff + 1), cutoff), "written since");
        assert!(
            !written_before(None, cutoff),
            "a write not seen back yet is young"
        );
    }
}
