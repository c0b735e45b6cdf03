//! Operations on one slot: claim it for a request, have its agent prepare it, release it.
//! Each is a revision-checked write; a slot key is created only if absent, which is what
//! makes double-booking impossible across any number of launchers.

use crate::shared::Shared;
use crate::world::SlotRef;
use slotpool_protocol::api::{AgentCommand, SlotPrepared};
use slotpool_protocol::connect::BusError;
use slotpool_protocol::layout::subjects;
use slotpool_protocol::model::{Node, NodeRequest, NodeState};
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::now_ms;
use slotpool_protocol::{BackingId, NodeId, PROTOCOL_VERSION};
use std::sync::Arc;
use std::time::Duration;

/// How long an agent may take to prepare or release a slot.
pub const AGENT_TIMEOUT: Duration = Duration::from_secs(30);

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
}

/// Claims `slot` for node `index` of `request`: creates the slot key (fails with a
/// conflict if anyone holds it).
pub async fn claim(
    shared: &Shared,
    slot: &SlotRef,
    request: &NodeRequest,
    index: u32,
) -> Result<Versioned<Node>, SlotError> {
    let (host, attributes) = {
        let world = shared.world();
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
        (host, attributes)
    };
    let node = Node {
        v: PROTOCOL_VERSION,
        id: NodeId::for_slot(&slot.backing_id, slot.slot),
        request_id: request.id.clone(),
        index,
        label: request.labels[index as usize].clone(),
        backing_id: slot.backing_id.clone(),
        slot: slot.slot,
        state: NodeState::Preparing,
        requestor: request.requestor.clone(),
        host,
        workspace: None,
        attributes,
        allocated_at: now_ms(),
        failure: None,
    };
    let key = slot.key();
    let revision = shared.bus.slots.create(&key, &node, None).await?;
    Ok(Versioned {
        key,
        revision,
        value: node,
    })
}

/// Has the agent prepare a claimed slot, then marks the node ready.
pub async fn prepare(
    shared: &Shared,
    node: Versioned<Node>,
    ssh_public_key: Option<String>,
) -> Result<Versioned<Node>, SlotError> {
    let cmd = AgentCommand::PrepareSlot {
        slot: node.value.slot,
        node_id: node.value.id.clone(),
        ssh_public_key,
    };
    let prepared: SlotPrepared = shared
        .bus
        .call(
            &subjects::agent(&node.value.backing_id),
            &cmd,
            AGENT_TIMEOUT,
        )
        .await
        .map_err(|source| SlotError::Agent {
            backing_id: node.value.backing_id.clone(),
            source,
        })?;
    let mut ready = node.value.clone();
    ready.state = NodeState::Ready;
    ready.workspace = Some(prepared.workspace);
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

/// Returns a slot to its backing node: marks the node releasing, has the agent clean the
/// slot (skipped when the agent is gone: there is nothing left to clean), and deletes the
/// slot key. Idempotent; tolerates a slot that was never prepared. Returns false when
/// the slot was already free.
pub async fn release(shared: &Arc<Shared>, key: &str) -> Result<bool, SlotError> {
    release_read(shared, key, None).await
}

/// [`release`], starting from a record just read (saves reading it again); a stale one
/// only costs a conflict and a re-read.
pub async fn release_read(
    shared: &Arc<Shared>,
    key: &str,
    mut read: Option<Versioned<Node>>,
) -> Result<bool, SlotError> {
    loop {
        let current = match read.take() {
            Some(current) => current,
            None => match shared.bus.slots.get::<Node>(key).await? {
                Some(current) => current,
                None => return Ok(false),
            },
        };
        let mut node = current.value.clone();
        let revision = if node.state == NodeState::Releasing {
            current.revision
        } else {
            node.state = NodeState::Releasing;
            match shared
                .bus
                .slots
                .update(key, &node, current.revision, None)
                .await
            {
                Ok(rev) => rev,
                Err(KvError::Conflict { .. }) => continue,
                Err(err) => return Err(err.into()),
            }
        };
        let agent_alive = shared.world().agents.contains_key(&node.backing_id);
        if agent_alive {
            let cmd = AgentCommand::ReleaseSlot {
                slot: node.slot,
                node_id: node.id.clone(),
            };
            shared
                .bus
                .call::<_, serde_json::Value>(
                    &subjects::agent(&node.backing_id),
                    &cmd,
                    AGENT_TIMEOUT,
                )
                .await
                .map_err(|source| SlotError::Agent {
                    backing_id: node.backing_id.clone(),
                    source,
                })?;
        }
        match shared.bus.slots.delete(key, revision).await {
            Ok(()) => return Ok(true),
            Err(KvError::Conflict { .. }) => continue,
            Err(err) => return Err(err.into()),
        }
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
