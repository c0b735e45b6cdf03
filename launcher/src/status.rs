//! What a client may read of its own requests and nodes, served on
//! `slotpool.api.v2.<client>.status`, `.wait_released` and `.nodes`. Clients have no read access
//! to the buckets (a request holds its requestor's SSH key and its nodes' logins), so
//! these calls are how they follow their own work. Each answers from this
//! launcher's mirror and, when asked to wait, holds the call open until the change
//! arrives (woken by the mirror's change signals, never by polling) or the wait ends.

use crate::inbound::{check_owner, decode, internal};
use crate::nodes;
use crate::shared::{request_topic, wait_for_change, Shared};
use slotpool_protocol::api::{
    ApiError, ErrorCode, NodesQuery, RequestStatus, StillHeld, WaitReleased,
    MAX_LABELS_PER_REQUEST, MAX_WAIT_MS,
};
use slotpool_protocol::connect::Incoming;
use slotpool_protocol::model::{Node, NodeRequest, NodeState};
use slotpool_protocol::{RequestId, UserName};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

fn deadline(wait_ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(wait_ms.min(MAX_WAIT_MS))
}

/// The caller's request, once it is final or the wait is over.
pub async fn request(
    sh: &Shared,
    caller: &UserName,
    msg: &Incoming,
) -> Result<NodeRequest, ApiError> {
    let q: RequestStatus = decode(msg, "status request", |q: &RequestStatus| q.v)?;
    let changes = follow_from_now(sh, &q.request_id);
    follow(sh, caller, &q.request_id, q.wait_ms, changes).await
}

/// The change signal of request `id`, to [`follow`] it: taken before the first look at
/// the request (or before the caller writes it), so a change in between still wakes it.
pub fn follow_from_now(sh: &Shared, id: &RequestId) -> watch::Receiver<u64> {
    sh.signals.subscribe(&request_topic(id))
}

/// The caller's request `id`, once it is final or `wait_ms` (at most [`MAX_WAIT_MS`])
/// has passed; `changes` from [`follow_from_now`]. Woken by the mirror's change signal of
/// the request, never by polling.
pub async fn follow(
    sh: &Shared,
    caller: &UserName,
    id: &RequestId,
    wait_ms: u64,
    changes: watch::Receiver<u64>,
) -> Result<NodeRequest, ApiError> {
    let until = deadline(wait_ms);
    let mut changes = [changes];
    loop {
        let req = current(sh, id).await?;
        // Another client's request is answered like a missing one: its existence is
        // not the caller's business.
        let req = req
            .filter(|r| r.client.as_ref() == Some(caller))
            .ok_or_else(|| {
                ApiError::new(ErrorCode::NotFound, format!("no request {id} of {caller}"))
            })?;
        if req.state.is_final() || Instant::now() >= until || sh.shutdown.is_cancelled() {
            return Ok(req);
        }
        wait_for_change(&mut changes, Some(until), &sh.shutdown).await;
    }
}

/// The request from the mirror, or from KV when the mirror has not seen it yet (it was
/// just submitted through another launcher).
async fn current(sh: &Shared, id: &RequestId) -> Result<Option<NodeRequest>, ApiError> {
    let mirrored = sh
        .world()
        .requests
        .get(id.as_str())
        .map(|r| r.value.clone());
    match mirrored {
        Some(r) => Ok(Some(r)),
        None => Ok(sh
            .bus
            .requests
            .get::<NodeRequest>(id.as_str())
            .await
            .map_err(internal)?
            .map(|r| r.value)),
    }
}

/// The records of the caller's nodes that hold their slots, in the order asked.
pub async fn nodes(sh: &Shared, caller: &UserName, msg: &Incoming) -> Result<Vec<Node>, ApiError> {
    let q: NodesQuery = decode(msg, "nodes query", |q: &NodesQuery| q.v)?;
    too_many(q.nodes.len())?;
    let mut out = Vec::with_capacity(q.nodes.len());
    for id in &q.nodes {
        if let Some(node) = nodes::record(sh, id).await.map_err(internal)? {
            check_owner(caller, node.client.as_ref(), || format!("node {id}"))?;
            out.push(node);
        }
    }
    Ok(out)
}

fn too_many(n: usize) -> Result<(), ApiError> {
    if n > MAX_LABELS_PER_REQUEST {
        return Err(ApiError::new(
            ErrorCode::TooLarge,
            format!("{n} nodes; at most {MAX_LABELS_PER_REQUEST} per call"),
        ));
    }
    Ok(())
}

/// Answers once none of the caller's `nodes` holds its slot, or when the wait is over
/// with those that still do.
pub async fn released(
    sh: &Shared,
    caller: &UserName,
    msg: &Incoming,
) -> Result<StillHeld, ApiError> {
    let q: WaitReleased = decode(msg, "wait_released request", |q: &WaitReleased| q.v)?;
    too_many(q.nodes.len())?;
    let until = deadline(q.wait_ms);
    let mut held = Vec::new();
    let mut changes = Vec::new();
    for id in &q.nodes {
        if let Some(node) = nodes::record(sh, id).await.map_err(internal)? {
            check_owner(caller, node.client.as_ref(), || format!("node {id}"))?;
            changes.push(sh.signals.subscribe(&request_topic(&node.request_id)));
            held.push(id.clone());
        }
    }
    loop {
        held.retain(|id| {
            nodes::mirrored(sh, id)
                .is_some_and(|n| !q.until_not_ready || n.state == NodeState::Ready)
        });
        if held.is_empty() || Instant::now() >= until || sh.shutdown.is_cancelled() {
            return Ok(StillHeld { held });
        }
        wait_for_change(&mut changes, Some(until), &sh.shutdown).await;
    }
}
