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
use slotpool_protocol::layout::{self, subjects};
use slotpool_protocol::model::{
    BackingNode, BackingState, Node, NodeRequest, NodeState, SlotLogin,
};
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::{now_ms, UnixMillis};
use slotpool_protocol::{BackingId, NodeId, PROTOCOL_VERSION};
use std::time::Duration;

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
    #[error("backing node {backing_id} handed out its max-uses {max_uses} slots")]
    UsedUp {
        backing_id: BackingId,
        max_uses: u32,
    },
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
    let (host, attributes, tombstone, planned, max_uses) = {
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
        let site = shared
            .config
            .label_in(&b.value.provider, &b.value.pool, &b.value.label);
        if let Some(site) = site {
            attributes.extend(site.label.node_attributes.clone());
        }
        let max_uses = site.and_then(|s| s.label.max_uses);
        let host = b
            .value
            .instance
            .as_ref()
            .map(|i| i.host.clone())
            .unwrap_or_default();
        (host, attributes, tombstone, planned, max_uses)
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
    if let Some(max_uses) = max_uses {
        count_use(shared, slot, max_uses).await?;
    }
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

/// Writes attempts at one more use of a backing node before a claim gives up (each lost
/// to another launcher's write of the record).
const COUNT_USE_ATTEMPTS: u32 = 5;

/// Counts one more use of the backing node of `slot`, for a label with `max-uses`: a
/// revision-checked write of its `uses`, refused once it reached `max_uses`, so that
/// launchers claiming at once never hand out more. Counted before the claim: a claim
/// that then fails wastes a use (the node retires early), never hands out one too many.
async fn count_use(shared: &Shared, slot: &SlotRef, max_uses: u32) -> Result<(), SlotError> {
    let gone = || SlotError::BackingGone(slot.backing_id.clone());
    let mut current = shared.world().backing.get(&slot.seat_key).cloned();
    for _ in 0..COUNT_USE_ATTEMPTS {
        let b = current.take().ok_or_else(gone)?;
        if b.value.id != slot.backing_id {
            return Err(gone());
        }
        if b.value.uses >= max_uses {
            return Err(SlotError::UsedUp {
                backing_id: slot.backing_id.clone(),
                max_uses,
            });
        }
        let mut counted = b.value.clone();
        counted.uses += 1;
        match shared
            .bus
            .backing
            .update(&slot.seat_key, &counted, b.revision, None)
            .await
        {
            Ok(revision) => {
                shared.world().put_backing(Versioned {
                    key: b.key,
                    revision,
                    value: counted,
                });
                return Ok(());
            }
            Err(KvError::Conflict { .. }) => {
                current = shared
                    .bus
                    .backing
                    .get::<BackingNode>(&slot.seat_key)
                    .await?;
            }
            Err(err) => return Err(err.into()),
        }
    }
    Err(KvError::Conflict {
        bucket: shared.bus.backing.bucket().to_string(),
        key: slot.seat_key.clone(),
    }
    .into())
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
    // A claim written `ready` needs no second write: one write claims a slot and hands
    // it out. Whether the claim still stands when its request is fulfilled is for the
    // fulfilment to check (`request::exec::claims_stand`).
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

/// How long the launcher waits for an agent's answer before it sends the command again
/// (beside the first, whose answer still counts); each further wait is twice as long.
/// A request or a reply in flight through a server that dies is lost, and the agent's
/// prepare and release are idempotent for the same node: a resend after this wait, not
/// [`AGENT_TIMEOUT`], bounds what a server's death costs a request.
pub const AGENT_RESEND: Duration = Duration::from_secs(1);

/// Sends `cmd` to the agent of `backing_id` and decodes its reply, waiting at most
/// [`AGENT_TIMEOUT`] and sending `cmd` again after [`AGENT_RESEND`], then twice that,
/// and so on, while no answer came. The first answer wins; an error other than a
/// time-out (no agent subscribed when the first was sent, say) ends the call at once,
/// as a refusal does (docs/protocol.md, "Sending a call again").
pub(crate) async fn call_agent<R: serde::de::DeserializeOwned>(
    shared: &Shared,
    backing_id: &BackingId,
    cmd: &AgentCommand,
) -> Result<R, SlotError> {
    shared
        .bus
        .call_resending(
            &subjects::agent(backing_id),
            cmd,
            AGENT_TIMEOUT,
            AGENT_RESEND,
        )
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

/// Marks a node failed (its backing node died), keeping it until its requestor releases
/// it, and tells its request when it held the node ([`note_failed_node`]): a client
/// following the request by `status` learns that the node it holds is gone.
pub async fn mark_failed(
    shared: &Shared,
    node: &Versioned<Node>,
    reason: &str,
) -> Result<(), KvError> {
    match node.value.state {
        NodeState::Releasing => return Ok(()),
        NodeState::Failed => {}
        _ => {
            let mut failed = node.value.clone();
            failed.state = NodeState::Failed;
            failed.failure = Some(reason.to_string());
            match shared
                .bus
                .slots
                .update(&node.key, &failed, node.revision, None)
                .await
            {
                Ok(_) => {}
                Err(KvError::Conflict { .. }) => return Ok(()),
                Err(err) => return Err(err),
            }
        }
    }
    let reason = node.value.failure.as_deref().unwrap_or(reason);
    note_failed_node(shared, &node.value, reason).await
}

/// Writes into `node`'s request that the node failed while the request held it
/// ([`with_failed_node`]); nothing when the request does not hold it or says so
/// already. Revision-checked; run again by the sweep for a launcher that died between
/// the node's failure and this write.
pub async fn note_failed_node(shared: &Shared, node: &Node, reason: &str) -> Result<(), KvError> {
    let mut read = shared.world().requests.get(&node.request_id).cloned();
    for _ in 0..NOTE_FAILED_ATTEMPTS {
        let current = match read.take() {
            Some(current) => current,
            None => match shared
                .bus
                .requests
                .get::<NodeRequest>(node.request_id.as_str())
                .await?
            {
                Some(current) => current,
                None => return Ok(()),
            },
        };
        let Some(told) = with_failed_node(&current.value, &node.id, reason, now_ms()) else {
            return Ok(());
        };
        match shared
            .bus
            .requests
            .update(&current.key, &told, current.revision, None)
            .await
        {
            Ok(revision) => {
                tracing::info!(request_id = %told.id, node_id = %node.id, "the request is told its node failed");
                shared.world().put_request(Versioned {
                    key: current.key,
                    revision,
                    value: told,
                });
                shared
                    .signals
                    .bump(&crate::shared::request_topic(&node.request_id));
                return Ok(());
            }
            Err(KvError::Conflict { .. }) => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

/// Writes of a request lost to others before [`note_failed_node`] leaves it to the
/// sweep.
const NOTE_FAILED_ATTEMPTS: u32 = 5;

/// Request `r` told that its node `id` failed for `reason` at `now`: listed in
/// `nodes_failed`, and said in `status`. `None` when there is nothing to tell: `r` is
/// not fulfilled, does not hold `id` (released, or not its node), or lists it already.
pub fn with_failed_node(
    r: &NodeRequest,
    id: &NodeId,
    reason: &str,
    now: UnixMillis,
) -> Option<NodeRequest> {
    if !r.holds_nodes() || !r.nodes.contains(id) || r.nodes_failed.contains(id) {
        return None;
    }
    let mut told = r.clone();
    told.nodes_failed.push(id.clone());
    told.status = format!(
        "fulfilled: {} node(s), {} failed: node {id}: {reason}",
        r.nodes.len(),
        told.nodes_failed.len()
    );
    told.updated_at = now;
    Some(told)
}

#[cfg(test)]
mod tests {
    use super::*;
    use slotpool_protocol::model::RequestState;

    #[test]
    fn a_fulfilled_request_is_told_once_of_each_of_its_nodes_that_failed() {
        let mut r = crate::world::tests_support::request("req-1", &["a", "b"]);
        let (a, b) = (
            NodeId::parse("node-a").unwrap(),
            NodeId::parse("node-b").unwrap(),
        );
        r.state = RequestState::Fulfilled;
        r.nodes = vec![a.clone(), b.clone()];
        let told = with_failed_node(&r, &b, "backing node bn-1 failed: gone", 7).unwrap();
        assert_eq!(told.nodes_failed, vec![b.clone()]);
        assert_eq!(told.state, RequestState::Fulfilled, "the nodes stay held");
        assert_eq!(told.nodes, r.nodes);
        assert_eq!(
            told.status,
            "fulfilled: 2 node(s), 1 failed: node node-b: backing node bn-1 failed: gone"
        );
        assert_eq!(told.updated_at, 7);
        assert_eq!(with_failed_node(&told, &b, "again", 8), None, "told once");
        let both = with_failed_node(&told, &a, "too", 9).unwrap();
        assert_eq!(both.nodes_failed, vec![b.clone(), a.clone()]);
        // Nothing to tell a request that does not hold the node.
        let other = NodeId::parse("node-c").unwrap();
        assert_eq!(with_failed_node(&r, &other, "x", 1), None);
        let mut released = r.clone();
        released.nodes_released_at = Some(5);
        assert_eq!(with_failed_node(&released, &a, "x", 1), None);
        let mut waiting = r.clone();
        waiting.state = RequestState::Requested;
        assert_eq!(with_failed_node(&waiting, &a, "x", 1), None);
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
