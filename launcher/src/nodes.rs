//! Operations on one slot: claim it for a request, have its agent prepare it, release it.
//! Each is a revision-checked write; a slot key is created only if absent, which is what
//! makes double-booking impossible across any number of launchers.
//!
//! With `host-key-checking: true` on the label, a prepared slot is handed out only after
//! a real key scan (`ssh-keyscan`) of the node's host and port finds keys the agent
//! reported; otherwise the slot is given back and the backing node is marked failed.

use crate::shared::Shared;
use crate::world::SlotRef;
use slotpool_protocol::api::SlotLimits;
use slotpool_protocol::api::{AgentCommand, SlotPrepared};
use slotpool_protocol::connect::BusError;
use slotpool_protocol::layout::{self, subjects, FINISHED_REQUEST_TTL_SECS};
use slotpool_protocol::model::{
    BackingNode, BackingState, Node, NodeRequest, NodeState, RequestState, SlotLogin,
};
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::now_ms;
use slotpool_protocol::{BackingId, NodeId, RequestId, PROTOCOL_VERSION};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// How long an agent may take to prepare or release a slot.
pub const AGENT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a host key scan may take.
pub const KEYSCAN_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("agent of {backing_id}: {source}")]
    Agent {
        backing_id: BackingId,
        source: BusError,
    },
    #[error("backing node {0} is gone")]
    BackingGone(BackingId),
    #[error("backing node {backing_id}: host key check failed: {reason}")]
    HostKey {
        backing_id: BackingId,
        reason: String,
    },
    #[error("backing node {backing_id}: prepare reply refused: {reason}")]
    ForgedReply {
        backing_id: BackingId,
        reason: String,
    },
}

/// Claims `slot` for node `index` of `request`: creates the slot key (fails with a
/// conflict if anyone holds it).
///
/// When the agent's heartbeat says what a prepare of the slot will answer (its
/// [`SlotLoginPlan`](crate::world::SlotLoginPlan)), the node is created `ready` with that
/// workspace and login, and [`prepare`] has nothing left to write: it only has the agent
/// prepare the slot, and the request is fulfilled after that. Otherwise it is created
/// `preparing` and [`prepare`] writes what the agent answers.
pub async fn claim(
    shared: &Shared,
    slot: &SlotRef,
    request: &NodeRequest,
    index: u32,
) -> Result<Versioned<Node>, SlotError> {
    let key = slot.key();
    let (host, attributes, tombstone, planned) = {
        let world = shared.world();
        let planned = world
            .agents
            .get(&slot.backing_id)
            .and_then(|a| a.login.as_ref())
            .map(|plan| plan.of_slot(slot.slot));
        let tombstone = world.tombstones.get(&key).copied();
        let b = world
            .backing
            .get(&slot.seat_key)
            .ok_or_else(|| SlotError::BackingGone(slot.backing_id.clone()))?;
        let mut attributes = b.value.attributes.clone();
        if let Some(site) = shared
            .config
            .label_in(&b.value.provider, &b.value.pool, &b.value.label)
        {
            attributes.extend(site.label.node_attributes.clone());
        }
        let host = b
            .value
            .instance
            .as_ref()
            .map(|i| i.host.clone())
            .unwrap_or_default();
        (host, attributes, tombstone, planned)
    };
    let (state, workspace, login) = match planned {
        Some((workspace, login)) => (NodeState::Ready, Some(workspace), login),
        None => (NodeState::Preparing, None, SlotLogin::default()),
    };
    let node = Node {
        v: PROTOCOL_VERSION,
        id: NodeId::for_slot(&slot.backing_id, slot.slot),
        request_id: request.id.clone(),
        index,
        label: request.labels[index as usize].clone(),
        backing_id: slot.backing_id.clone(),
        slot: slot.slot,
        state,
        requestor: request.requestor.clone(),
        client: request.client.clone(),
        host,
        workspace,
        attributes,
        allocated_at: now_ms(),
        released_at: None,
        failure: None,
        login,
    };
    let revision = shared
        .bus
        .slots
        .create_over(&key, &node, None, tombstone)
        .await?;
    Ok(Versioned {
        key,
        revision,
        value: node,
    })
}

/// Has the agent prepare a claimed slot, then marks the node ready with what the agent
/// answered, unless the claim already said just that (see [`claim`]).
pub async fn prepare(
    shared: &Shared,
    node: Versioned<Node>,
    ssh_public_key: Option<String>,
) -> Result<Versioned<Node>, SlotError> {
    let (limits, host_key_checking, seat_key) = label_settings(shared, &node.value);
    let cmd = AgentCommand::PrepareSlot {
        slot: node.value.slot,
        node_id: node.value.id.clone(),
        ssh_public_key,
        limits,
    };
    let prepared: SlotPrepared = call_agent(shared, &node.value.backing_id, &cmd).await?;
    // The reply must say what the agent's own heartbeat said a prepare of this slot
    // would: only the agent's credential may write its heartbeat, so a reply that
    // disagrees (a forged one, say, sent to the launcher's inbox by another party) is
    // never handed to a client. The backing node is failed: something on it speaks for
    // its agent.
    if let Err(reason) = check_reply(shared, &node.value, &prepared) {
        let backing_id = node.value.backing_id.clone();
        tracing::warn!(%backing_id, %reason, "prepare reply refused: no more slots on this backing node");
        if let Some(seat_key) = &seat_key {
            fail_backing(
                shared,
                seat_key,
                &format!("prepare reply refused: {reason}"),
            )
            .await;
        }
        return Err(SlotError::ForgedReply { backing_id, reason });
    }
    if host_key_checking {
        let port = prepared.login.port.unwrap_or(22);
        if let Err(reason) =
            check_host_keys(&node.value.host, port, &prepared.login.host_keys).await
        {
            let backing_id = node.value.backing_id.clone();
            tracing::warn!(%backing_id, %reason, "host key check failed: no more slots on this backing node");
            if let Some(seat_key) = seat_key {
                fail_backing(
                    shared,
                    &seat_key,
                    &format!("host key check failed: {reason}"),
                )
                .await;
            }
            return Err(SlotError::HostKey { backing_id, reason });
        }
    }
    let mut ready = node.value.clone();
    ready.state = NodeState::Ready;
    ready.workspace = Some(prepared.workspace);
    ready.login = prepared.login;
    if ready == node.value {
        return Ok(node);
    }
    let revision = shared
        .bus
        .slots
        .update(&node.key, &ready, node.revision, None)
        .await?;
    Ok(Versioned {
        key: node.key,
        revision,
        value: ready,
    })
}

/// Checks a prepare reply against the agent's heartbeat: the workspace, user name, port
/// and host keys must be the ones the heartbeat's slot plan names for this slot.
fn check_reply(shared: &Shared, node: &Node, prepared: &SlotPrepared) -> Result<(), String> {
    let plan = shared
        .world()
        .agents
        .get(&node.backing_id)
        .and_then(|a| a.login.clone())
        .ok_or_else(|| {
            "the agent's heartbeat names no slot login to check it against".to_string()
        })?;
    let (workspace, login) = plan.of_slot(node.slot);
    if prepared.workspace != workspace {
        return Err(format!(
            "workspace {:?}, where the heartbeat says {workspace:?}",
            prepared.workspace
        ));
    }
    if prepared.login != login {
        return Err(format!(
            "login {:?} port {:?} with {} host key(s), where the heartbeat says {:?} port {:?} with {}",
            prepared.login.username,
            prepared.login.port,
            prepared.login.host_keys.len(),
            login.username,
            login.port,
            login.host_keys.len()
        ));
    }
    Ok(())
}

/// Sends `cmd` to the agent of `backing_id` and decodes its reply (waiting at most
/// [`AGENT_TIMEOUT`]).
async fn call_agent<R: serde::de::DeserializeOwned>(
    shared: &Shared,
    backing_id: &BackingId,
    cmd: &AgentCommand,
) -> Result<R, SlotError> {
    shared
        .bus
        .call(&subjects::agent(backing_id), cmd, AGENT_TIMEOUT)
        .await
        .map_err(|source| SlotError::Agent {
            backing_id: backing_id.clone(),
            source,
        })
}

/// The label's limits and host-key-checking, and the seat key of the node's backing node.
fn label_settings(shared: &Shared, node: &Node) -> (SlotLimits, bool, Option<String>) {
    let world = shared.world();
    let Some(b) = world.backing_by_id(&node.backing_id) else {
        return (SlotLimits::default(), false, None);
    };
    let seat_key = Some(b.key.clone());
    match shared
        .config
        .label_in(&b.value.provider, &b.value.pool, &b.value.label)
    {
        Some(site) => (site.label.limits, site.label.host_key_checking, seat_key),
        None => (SlotLimits::default(), false, seat_key),
    }
}

/// `<type> <base64>` pairs in `ssh-keyscan` output (`<host> <type> <base64>` lines).
pub fn parse_keyscan(output: &str) -> Vec<String> {
    output
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            let _host = parts.next()?;
            Some(format!("{} {}", parts.next()?, parts.next()?))
        })
        .collect()
}

/// Whether every scanned key is one the agent reported (and at least one was scanned).
pub fn keys_match(scanned: &[String], reported: &[String]) -> Result<(), String> {
    if reported.is_empty() {
        return Err("the agent reported no host keys".into());
    }
    if scanned.is_empty() {
        return Err("the key scan found no host keys".into());
    }
    let reported: Vec<String> = reported
        .iter()
        .filter_map(|k| {
            let mut p = k.split_whitespace();
            Some(format!("{} {}", p.next()?, p.next()?))
        })
        .collect();
    match scanned.iter().find(|k| !reported.contains(k)) {
        Some(k) => Err(format!(
            "the host presents a {} key the agent did not report",
            k.split(' ').next().unwrap_or("?")
        )),
        None => Ok(()),
    }
}

/// Scans `host:port` with `ssh-keyscan` and compares the keys with `reported`.
async fn check_host_keys(host: &str, port: u16, reported: &[String]) -> Result<(), String> {
    let scan = tokio::process::Command::new("ssh-keyscan")
        .args(["-T", "5", "-p", &port.to_string(), host])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = match tokio::time::timeout(KEYSCAN_TIMEOUT, scan).await {
        Err(_) => {
            return Err(format!(
                "ssh-keyscan of {host}:{port} took over {KEYSCAN_TIMEOUT:?}"
            ))
        }
        Ok(Err(err)) => return Err(format!("running ssh-keyscan: {err}")),
        Ok(Ok(out)) => out,
    };
    let scanned = parse_keyscan(&String::from_utf8_lossy(&out.stdout));
    keys_match(&scanned, reported).map_err(|e| format!("{host}:{port}: {e}"))
}

/// Marks a ready backing node failed (revision-checked; a conflict means someone else
/// changed it first, and the next prepare checks again).
async fn fail_backing(shared: &Shared, seat_key: &str, reason: &str) {
    let current = match shared.bus.backing.get::<BackingNode>(seat_key).await {
        Ok(Some(b)) => b,
        Ok(None) => return,
        Err(err) => {
            tracing::warn!(seat_key, %err, "cannot read backing node to mark it failed");
            return;
        }
    };
    if !current.value.state.can_become(BackingState::Failed)
        || current.value.state == BackingState::Failed
    {
        return;
    }
    let mut failed = current.value.clone();
    failed.state = BackingState::Failed;
    failed.failure = Some(reason.to_string());
    failed.updated_at = now_ms();
    if let Err(err) = shared
        .bus
        .backing
        .update(seat_key, &failed, current.revision, None)
        .await
    {
        tracing::warn!(seat_key, %err, "cannot mark backing node failed");
    }
}

/// Returns a slot to its backing node and waits until it is done: marks the node
/// releasing, then [`finish_release`]. Idempotent; tolerates a slot that was never
/// prepared. Returns false when the slot was already free.
pub async fn release(shared: &Arc<Shared>, key: &str) -> Result<bool, SlotError> {
    match begin_release(shared, key, None, None).await? {
        Some(node) => finish_release(shared, node).await.map(|()| true),
        None => Ok(false),
    }
}

/// Marks the node in slot `key` releasing (revision-checked), starting from `read` when
/// the caller has a recent record (a stale one costs a conflict and a re-read). With
/// `expect`, only that node is released: `None` when the slot is free or holds another
/// node. Once this returns the record, the release is durable: whoever finishes it.
pub async fn begin_release(
    shared: &Shared,
    key: &str,
    expect: Option<&NodeId>,
    mut read: Option<Versioned<Node>>,
) -> Result<Option<Versioned<Node>>, SlotError> {
    loop {
        let current = match read.take() {
            Some(current) => current,
            None => match shared.bus.slots.get::<Node>(key).await? {
                Some(current) => current,
                None => return Ok(None),
            },
        };
        if expect.is_some_and(|id| *id != current.value.id) {
            return Ok(None);
        }
        if current.value.state == NodeState::Releasing {
            return Ok(Some(current));
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
                return Ok(Some(Versioned {
                    key: key.to_string(),
                    revision,
                    value: node,
                }))
            }
            Err(KvError::Conflict { .. }) => continue,
            Err(err) => return Err(err.into()),
        }
    }
}

/// Finishes the release of a node marked releasing: has the agent clean the slot
/// (skipped when the agent is gone: there is nothing left to clean) and deletes the slot
/// key. Safe to run twice: the agent wipes only the node named, and the key is deleted
/// only while it still holds that node.
pub async fn finish_release(shared: &Shared, mut node: Versioned<Node>) -> Result<(), SlotError> {
    let agent_alive = shared.world().agents.contains_key(&node.value.backing_id);
    if agent_alive {
        let cmd = AgentCommand::ReleaseSlot {
            slot: node.value.slot,
            node_id: node.value.id.clone(),
        };
        call_agent::<serde_json::Value>(shared, &node.value.backing_id, &cmd).await?;
    }
    loop {
        match shared.bus.slots.delete(&node.key, node.revision).await {
            Ok(_) => break,
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
            None => match shared.bus.requests.get::<NodeRequest>(id.as_str()).await? {
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

/// Releases node `id` if its slot still holds it: marks it releasing, and finishes the
/// release in the background. False when the id names no slot, or its slot is free or
/// holds another node.
/// The node `id` as the mirror has it, while it holds its slot.
pub fn mirrored(shared: &Shared, id: &NodeId) -> Option<Node> {
    let (backing, slot) = id.slot()?;
    shared
        .world()
        .slots
        .get(&layout::slot_key(&backing, slot))
        .filter(|n| &n.value.id == id)
        .map(|n| n.value.clone())
}

/// The node `id` while it holds its slot: from the mirror, or from KV when the mirror
/// has not seen it yet.
pub async fn record(shared: &Shared, id: &NodeId) -> Result<Option<Node>, KvError> {
    if let Some(node) = mirrored(shared, id) {
        return Ok(Some(node));
    }
    let Some((backing, slot)) = id.slot() else {
        return Ok(None);
    };
    Ok(shared
        .bus
        .slots
        .get::<Node>(&layout::slot_key(&backing, slot))
        .await?
        .map(|n| n.value)
        .filter(|n| &n.id == id))
}

pub async fn release_node(shared: &Arc<Shared>, id: &NodeId) -> Result<bool, SlotError> {
    let Some((backing, slot)) = id.slot() else {
        return Ok(false);
    };
    let key = layout::slot_key(&backing, slot);
    let mirrored = shared
        .world()
        .slots
        .get(&key)
        .filter(|n| &n.value.id == id)
        .cloned();
    match begin_release(shared, &key, Some(id), mirrored).await? {
        Some(node) => {
            spawn_finish_release(shared, node);
            Ok(true)
        }
        None => Ok(false),
    }
}

/// Finishes a release in the background (the API replies once the node is marked).
pub fn spawn_finish_release(shared: &Arc<Shared>, node: Versioned<Node>) {
    let work = format!("release.{}", node.value.id);
    if !shared.start_work(&work) {
        return;
    }
    let sh = shared.clone();
    let span = tracing::info_span!("release", node_id = %node.value.id);
    shared.spawn_task(
        async move {
            if let Err(err) = finish_release(&sh, node).await {
                tracing::warn!(%err, "cannot finish the release; it is retried later");
            }
            sh.end_work(&work);
        }
        .instrument(span),
    );
}

/// How long a node may stay releasing before any launcher finishes its release (the
/// one that began it died, or its agent did not answer), and how long a node may be
/// claimed for a request that does not exist (its launcher died between claiming the
/// slot and creating the request: see [`crate::api`]) or that ended without it, before
/// it is released.
pub const STALE_RELEASE: Duration = Duration::from_secs(AGENT_TIMEOUT.as_secs() + 15);

/// Finishes releases left behind, and releases slots claimed for requests that were
/// never created or ended without them: all older than [`STALE_RELEASE`].
pub fn sweep_left_behind(shared: &Arc<Shared>) {
    let now = now_ms();
    let cutoff = now.saturating_sub(STALE_RELEASE.as_millis() as u64);
    let (stale, orphans): (Vec<Versioned<Node>>, Vec<Versioned<Node>>) = {
        let world = shared.world();
        world
            .slots
            .values()
            .filter(|n| match n.value.state {
                NodeState::Releasing => n.value.released_at.is_none_or(|at| at <= cutoff),
                NodeState::Preparing | NodeState::Ready => {
                    claimed_long_ago(n.value.allocated_at, now)
                        && left_behind(
                            &n.value,
                            world.requests.get(&n.value.request_id).map(|r| &r.value),
                        )
                }
                NodeState::Failed => false,
            })
            .cloned()
            .partition(|n| n.value.state == NodeState::Releasing)
    };
    for node in stale {
        tracing::info!(node_id = %node.value.id, "finishing a release left behind");
        spawn_finish_release(shared, node);
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
    let request = shared
        .bus
        .requests
        .get::<NodeRequest>(node.value.request_id.as_str())
        .await?;
    if !left_behind(&node.value, request.as_ref().map(|r| &r.value)) {
        return Ok(());
    }
    tracing::info!(node_id = %node.value.id, request_id = %node.value.request_id, "releasing a slot claimed for a request that is gone or ended without it");
    release_node(shared, &node.value.id).await.map(|_| ())
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
        .map(|r| &r.value)
        .filter(|r| {
            r.state == RequestState::Fulfilled
                && r.nodes_released_at.is_none()
                && r.updated_at <= cutoff
                && !held.contains(&r.id)
        })
        .map(|r| r.id.clone())
        .collect()
}

/// How far ahead of this launcher's clock a claim time may be before the sweep treats
/// it as forged (launchers' clocks agree to far better than this).
const FUTURE_CLAIM_SKEW: Duration = Duration::from_secs(600);

/// Whether a node claimed at `allocated_at` is old enough for the sweep to judge it
/// ([`STALE_RELEASE`]). A claim time further ahead than any clock skew is a forged or
/// broken record: it counts as old, so it cannot shield its slot from the sweep.
fn claimed_long_ago(allocated_at: u64, now: u64) -> bool {
    allocated_at <= now.saturating_sub(STALE_RELEASE.as_millis() as u64)
        || allocated_at > now + FUTURE_CLAIM_SKEW.as_millis() as u64
}

/// Whether a claimed node (`preparing` or `ready`) belongs to no request: its request
/// ended without it, or does not exist. A fulfilled request is kept while its nodes are
/// held ([`expire_when_released`]), so a node without a request record is a stray
/// whatever its age: a claim written by a launcher that died before creating the
/// request, or a forged one.
fn left_behind(node: &Node, request: Option<&NodeRequest>) -> bool {
    match request {
        Some(r) => {
            r.state.is_final()
                && !(r.state == RequestState::Fulfilled && r.nodes.contains(&node.id))
        }
        None => true,
    }
}

/// Marks a node failed (its backing node died), keeping it until its requestor releases it.
pub async fn mark_failed(
    shared: &Shared,
    node: &Versioned<Node>,
    reason: &str,
) -> Result<(), KvError> {
    if matches!(node.value.state, NodeState::Failed | NodeState::Releasing) {
        return Ok(());
    }
    let mut failed = node.value.clone();
    failed.state = NodeState::Failed;
    failed.failure = Some(reason.to_string());
    match shared
        .bus
        .slots
        .update(&node.key, &failed, node.revision, None)
        .await
    {
        Ok(_) | Err(KvError::Conflict { .. }) => Ok(()),
        Err(err) => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slotpool_protocol::{BackingId, RequestId};

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
        NodeRequest {
            v: PROTOCOL_VERSION,
            id: RequestId::parse("req-1").unwrap(),
            labels: vec!["small".into()],
            requestor: "t".into(),
            client: None,
            priority: 100,
            timeout_secs: None,
            ssh_public_key: None,
            created_at: 0,
            state,
            status: String::new(),
            nodes,
            failure: None,
            updated_at: 0,
            owner: None,
            nodes_released_at: None,
        }
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
    fn a_claim_is_judged_once_old_or_when_dated_in_the_future() {
        let now = 100 * 3_600_000;
        let stale = STALE_RELEASE.as_millis() as u64;
        assert!(!claimed_long_ago(now, now), "just claimed");
        assert!(!claimed_long_ago(now - stale + 1, now));
        assert!(claimed_long_ago(now - stale, now));
        assert!(
            !claimed_long_ago(now + 5_000, now),
            "a clock a little ahead"
        );
        assert!(
            claimed_long_ago(now + 3_600_000, now),
            "dated an hour ahead: forged"
        );
        assert!(claimed_long_ago(u64::MAX, now), "dated at the end of time");
    }

    #[test]
    fn keyscan_output_is_compared_with_reported_keys() {
        let out = "# 127.0.0.1:2222 SSH-2.0-OpenSSH_9.2\n[127.0.0.1]:2222 ssh-ed25519 AAAAC3\n[127.0.0.1]:2222 ssh-rsa AAAAB3\n";
        let scanned = parse_keyscan(out);
        assert_eq!(scanned, vec!["ssh-ed25519 AAAAC3", "ssh-rsa AAAAB3"]);
        let reported = vec![
            "ssh-rsa AAAAB3".to_string(),
            "ssh-ed25519 AAAAC3 root@h".to_string(),
        ];
        assert_eq!(keys_match(&scanned, &reported), Ok(()));
        let err = keys_match(&scanned, &reported[..1]).unwrap_err();
        assert!(
            err.contains("ssh-ed25519 key the agent did not report"),
            "{err}"
        );
        assert!(keys_match(&[], &reported).is_err());
        assert!(keys_match(&scanned, &[]).is_err());
    }
}
