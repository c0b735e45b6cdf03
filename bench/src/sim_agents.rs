//! Simulated agents: many backing nodes' agents served from one process, for the scale
//! figures. They speak the real agent protocol, so the launcher cannot tell them from
//! `slotpool-agent`s: each backing id has a TTL'd heartbeat in the agents bucket with
//! the right secret hash (rewritten every `interval`, the writes spread evenly over it),
//! and one wildcard subscription on `slotpool.agent.v2.*` answers `prepare_slot`,
//! `release_slot`, `close` and `open` with the replies the real agent gives (see the
//! agent's `commands.rs`), keeping which slot holds which node and whether the node is
//! closed to new slots. Nothing is written to disk: a slot's "workspace" is a name.

use futures::StreamExt;
use slotpool_protocol::api::{
    AgentCommand, ApiError, ErrorCode, LogTail, Reply, SlotOccupants, SlotPrepared, SlotsClosed,
};
use slotpool_protocol::connect::{Bus, BusError};
use slotpool_protocol::layout::subjects;
use slotpool_protocol::model::{AgentHeartbeat, Health, SlotNames, SlotReport};
use slotpool_protocol::time::now_ms;
use slotpool_protocol::{BackingId, NodeId, PROTOCOL_VERSION};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What a simulated agent says of its slots, as a real one does.
fn slot_names(id: &BackingId) -> SlotNames {
    SlotNames {
        workspace: format!("/sim/{id}/slots/{}", SlotNames::SLOT),
        username: None,
    }
}

/// Subject prefix of agent commands (the backing id follows).
/// How often the heartbeat writer wakes to write the heartbeats that are due.
const HEARTBEAT_TICK: Duration = Duration::from_millis(20);

#[derive(Default)]
struct SimNode {
    prepared: BTreeMap<u32, NodeId>,
    closed: bool,
}

type Nodes = Arc<Mutex<HashMap<BackingId, SimNode>>>;

/// What the simulated agents look like.
pub struct SimSpec {
    pub ids: Vec<BackingId>,
    pub secret_sha256: String,
    pub slots: u32,
    pub interval: Duration,
    pub ttl: Duration,
}

/// Starts the simulated agents on `bus`; they run until `stop`. Returns once the command
/// subscription is in place and every heartbeat has been written once.
pub async fn start(
    bus: Bus,
    spec: SimSpec,
    tracker: &TaskTracker,
    stop: CancellationToken,
) -> Result<(), BusError> {
    let nodes: Nodes = Arc::new(Mutex::new(
        spec.ids
            .iter()
            .map(|id| (id.clone(), SimNode::default()))
            .collect(),
    ));
    let commands = bus.serve(subjects::AGENT_ALL, None).await?;
    {
        let (bus, nodes, stop, slots) = (bus.clone(), nodes.clone(), stop.clone(), spec.slots);
        tracker.spawn(async move {
            let mut commands = Box::pin(commands);
            loop {
                let msg = tokio::select! {
                    _ = stop.cancelled() => return,
                    m = commands.next() => match m { Some(m) => m, None => return },
                };
                let Some(reply_to) = msg.reply_to else {
                    continue;
                };
                let Some(id) = subjects::agent_backing(&msg.subject) else {
                    continue;
                };
                let reply = {
                    let mut nodes = nodes.lock().unwrap_or_else(|p| p.into_inner());
                    // An unknown id has no agent: like NATS, say nothing.
                    let Some(node) = nodes.get_mut(&id) else {
                        continue;
                    };
                    answer(node, &id, slots, &msg.payload)
                };
                if let Err(err) = bus.respond(&reply_to, &reply).await {
                    tracing::warn!(%err, "simulated agent cannot reply");
                }
            }
        });
    }
    // The first round of heartbeats at once, so every node is registered on return.
    let (sent_first, first) = tokio::sync::oneshot::channel();
    tracker.spawn(heartbeats(bus, spec, nodes, stop, sent_first));
    let _ = first.await;
    Ok(())
}

/// The reply the real agent gives to one command.
fn answer(
    node: &mut SimNode,
    id: &BackingId,
    slots: u32,
    payload: &[u8],
) -> Reply<serde_json::Value> {
    let command: AgentCommand = match serde_json::from_slice(payload) {
        Ok(c) => c,
        Err(err) => {
            return Reply::Error(ApiError::new(
                ErrorCode::BadRequest,
                format!("malformed agent command: {err}"),
            ))
        }
    };
    let out_of_range = |slot: u32| {
        Reply::Error(ApiError::new(
            ErrorCode::BadRequest,
            format!(
                "slot {slot} does not exist: this node has {slots} slots (0 to {})",
                slots.saturating_sub(1)
            ),
        ))
    };
    match command {
        AgentCommand::PrepareSlot { slot, node_id, .. } => {
            if slot >= slots {
                return out_of_range(slot);
            }
            if node.closed {
                return Reply::Error(ApiError::new(
                    ErrorCode::Unavailable,
                    format!("{id} is closed to new slots"),
                ));
            }
            match node.prepared.get(&slot) {
                Some(holder) if *holder != node_id => Reply::Error(ApiError::new(
                    ErrorCode::Internal,
                    format!("slot {slot} is held by {holder}"),
                )),
                _ => {
                    node.prepared.insert(slot, node_id);
                    value(&SlotPrepared {
                        workspace: slot_names(id).workspace_of(slot),
                        login: Default::default(),
                    })
                }
            }
        }
        AgentCommand::ReleaseSlot { slot, node_id } => {
            if slot >= slots {
                return out_of_range(slot);
            }
            if node.prepared.get(&slot) == Some(&node_id) {
                node.prepared.remove(&slot);
            }
            Reply::Ok(serde_json::json!({}))
        }
        AgentCommand::Close | AgentCommand::Open => {
            node.closed = matches!(command, AgentCommand::Close);
            value(&SlotsClosed {
                prepared: node.prepared.keys().copied().collect(),
            })
        }
        // A simulated node runs nothing.
        AgentCommand::SlotOccupants { slot } => {
            if slot >= slots {
                return out_of_range(slot);
            }
            value(&SlotOccupants::default())
        }
        AgentCommand::LogTail { .. } => value(&LogTail::default()),
        AgentCommand::Exec { .. } => Reply::Error(ApiError::new(
            ErrorCode::Unavailable,
            "a simulated node runs no commands",
        )),
    }
}

/// A successful reply carrying `v` (the agent's replies are `Reply<Value>`).
fn value<T: serde::Serialize>(v: &T) -> Reply<serde_json::Value> {
    Reply::Ok(serde_json::to_value(v).expect("replies serialize"))
}

/// Writes every node's heartbeat once per `interval`, spread evenly over it.
async fn heartbeats(
    bus: Bus,
    spec: SimSpec,
    nodes: Nodes,
    stop: CancellationToken,
    sent_first: tokio::sync::oneshot::Sender<()>,
) {
    let started_at = now_ms();
    let pid = std::process::id();
    let n = spec.ids.len();
    let per_tick = ((n as f64) * HEARTBEAT_TICK.as_secs_f64() / spec.interval.as_secs_f64())
        .ceil()
        .max(1.0) as usize;
    let record = |id: &BackingId| {
        let slots = nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .map(|node| {
                node.prepared
                    .iter()
                    .map(|(slot, node_id)| SlotReport {
                        slot: *slot,
                        node_id: node_id.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        AgentHeartbeat {
            v: PROTOCOL_VERSION,
            backing_id: id.clone(),
            secret_sha256: spec.secret_sha256.clone(),
            agent_version: "simulated".into(),
            hostname: "simulated".into(),
            pid,
            started_at,
            sent_at: now_ms(),
            ttl_secs: Some(spec.ttl.as_secs()),
            health: Health {
                healthy: true,
                ..Default::default()
            },
            slots,
            draining: false,
            dirty_slots: Vec::new(),
            dirty_reasons: Default::default(),
            isolation: Some("simulated".into()),
            ssh_port: None,
            ssh_host_keys: Vec::new(),
            slot_names: Some(slot_names(id)),
            interruption: None,
        }
    };
    let write = |batch: &[BackingId]| {
        let writes: Vec<_> = batch
            .iter()
            .map(|id| {
                let hb = record(id);
                let agents = bus.agents.clone();
                let ttl = spec.ttl;
                async move { agents.put(hb.backing_id.as_str(), &hb, Some(ttl)).await }
            })
            .collect();
        futures::future::join_all(writes)
    };
    // First round: everything, as fast as the server takes it.
    for chunk in spec.ids.chunks(512) {
        for result in write(chunk).await {
            if let Err(err) = result {
                tracing::warn!(%err, "simulated heartbeat failed");
            }
        }
    }
    let _ = sent_first.send(());
    let mut tick = tokio::time::interval(HEARTBEAT_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next = 0usize;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let end = (next + per_tick).min(n);
        for result in write(&spec.ids[next..end]).await {
            if let Err(err) = result {
                tracing::debug!(%err, "simulated heartbeat failed");
            }
        }
        next = if end >= n { 0 } else { end };
    }
}
