//! Carries out the steps [`plan::next`](super::plan::next) decides: the KV writes, the
//! agent calls and the releases. Each step is one idempotent piece of work; a conflict
//! (someone wrote first) comes back as an error the worker answers by looking again.

use super::observe::Memory;
use super::plan::RequestStep;
use crate::metrics;
use crate::nodes::{self, SlotError};
use crate::release::{self, claimed_for, Finish, GaveBack};
use crate::shared::{request_topic, Shared};
use crate::world::SlotRef;
use slotpool_protocol::layout::FINISHED_REQUEST_TTL_SECS;
use slotpool_protocol::model::{Node, NodeRequest, RequestState};
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::{now_ms, UnixMillis};
use slotpool_protocol::NodeId;
use std::sync::Arc;
use std::time::Duration;

/// How long a worker whose give-back was refused ([`release::give_back`]) waits before
/// it looks again, unless its request changes first (its mirror catching up with the
/// launcher that owns it now).
const GIVE_BACK_RECHECK_MS: UnixMillis = 1_000;

/// What the worker does once a step is carried out.
#[derive(Debug, PartialEq)]
pub enum After {
    /// Look again at once.
    Again,
    /// The request needs this worker no more.
    Stop,
    /// Look again at this time (or when this launcher loses its lease).
    Pause(UnixMillis),
    /// Wait for a change of the request (or a slot it could claim), or `until`.
    Wait { until: Option<UnixMillis> },
}

/// Carries out `step` for `req`, remembering what the plan needs to know next time.
pub async fn carry_out(
    sh: &Arc<Shared>,
    req: &Versioned<NodeRequest>,
    step: RequestStep,
    memory: &mut Memory,
) -> Result<After, SlotError> {
    let r = &req.value;
    match step {
        RequestStep::Leave => {
            tracing::info!(owner = ?r.owner, "taken over by another launcher");
            Ok(After::Stop)
        }
        RequestStep::Stop { strays } => {
            give_back_all(sh, &strays).await;
            Ok(After::Stop)
        }
        RequestStep::Hold { strays, until } => {
            give_back_all(sh, &strays).await;
            Ok(After::Wait { until: Some(until) })
        }
        RequestStep::Reclaim {
            reason,
            nodes,
            strays,
        } => {
            tracing::info!(%reason, ?nodes, "reclaiming the request's nodes");
            let mut reclaimed = r.clone();
            reclaimed.state = RequestState::Reclaimed;
            reclaimed.status = format!("reclaimed: {reason}");
            reclaimed.failure = Some(reason);
            // Recorded first: from then on every node of it is a stray, which the sweep
            // releases should this launcher die before it does.
            finish(sh, req, reclaimed).await?;
            let released = futures::future::join_all(
                nodes
                    .iter()
                    .map(|id| release::release(sh, id, Finish::Wait)),
            )
            .await;
            for (id, outcome) in nodes.iter().zip(released) {
                if let Err(err) = outcome {
                    tracing::warn!(node_id = %id, %err, "cannot release a reclaimed node; the sweep will");
                }
            }
            give_back_all(sh, &strays).await;
            Ok(After::Stop)
        }
        RequestStep::Fail { reason, release } => {
            tracing::info!(%reason, "request failed");
            let mut failed = r.clone();
            failed.state = RequestState::Failed;
            failed.status = format!("failed: {reason}");
            failed.failure = Some(reason);
            finish(sh, req, failed).await?;
            give_back_all(sh, &release).await;
            Ok(After::Stop)
        }
        RequestStep::Release(nodes) => {
            let mut refused = false;
            for id in nodes {
                refused |= release::give_back(sh, &r.id, &id).await? == GaveBack::Refused;
            }
            // Left alone because KV says the request is another launcher's (or was
            // handed the node): the worker waits until its mirror says so too.
            Ok(match refused {
                true => After::Wait {
                    until: Some(now_ms() + GIVE_BACK_RECHECK_MS),
                },
                false => After::Again,
            })
        }
        RequestStep::Claim { slots, .. } => {
            // The claims won leave the queue as they enter the mirror: the requests
            // behind this one need not wait for its prepares.
            let claimed = claim_noting(sh, r, &slots, memory).await;
            claimed.error.map_or(Ok(After::Again), Err)
        }
        RequestStep::Prepare { nodes, .. } => {
            prepare_all(sh, r, &nodes, memory).await?;
            Ok(After::Again)
        }
        RequestStep::Pause { until } => Ok(After::Pause(until)),
        RequestStep::Wait {
            until,
            status,
            waiting,
            ..
        } => {
            memory.waiting_since.get_or_insert_with(now_ms);
            if let Some(status) = status {
                set_status(sh, req, status, waiting).await?;
            }
            Ok(After::Wait { until })
        }
        RequestStep::Fulfil { nodes, hold_until } => {
            if !claims_stand(sh, &nodes, memory).await? {
                return Ok(After::Again);
            }
            let done = fulfilled(r, nodes, hold_until);
            // A hold with a deadline keeps this worker: its timer reclaims the nodes.
            let held = done.hold_deadline().is_some();
            let noted = done.clone();
            finish(sh, req, done).await?;
            note_fulfilled(sh, &noted);
            Ok(if held { After::Again } else { After::Stop })
        }
    }
}

/// Request `r` fulfilled with `nodes` (in label order), as [`RequestStep::Fulfil`] says.
pub fn fulfilled(
    r: &NodeRequest,
    nodes: Vec<NodeId>,
    hold_until: Option<UnixMillis>,
) -> NodeRequest {
    let now = now_ms();
    let mut done = r.clone();
    done.status = format!("fulfilled: {} node(s) ready", nodes.len());
    done.nodes = nodes;
    done.state = RequestState::Fulfilled;
    done.fulfilled_at = Some(now);
    done.updated_at = now;
    done.hold_until = hold_until;
    done
}

/// Counts and logs a fulfilment once its write is acknowledged.
pub fn note_fulfilled(sh: &Shared, done: &NodeRequest) {
    let tenants = &sh.config.tenants;
    metrics::fulfilled(
        &tenants.get(tenants.of(done.client.as_ref())).name,
        done.created_at,
        done.fulfilled_at.unwrap_or(done.created_at),
    );
    tracing::info!(request_id = %done.id, requestor = %done.requestor, nodes = ?done.nodes, "fulfilled");
}

/// Has the agents prepare the claimed nodes in slots `keys` at once, noting in `memory`
/// those prepared and when one was refused (its slot is given back then). Only nodes
/// the mirror holds for `r` are prepared: never another request's node that took a
/// slot meanwhile, which would get `r`'s SSH key.
pub async fn prepare_all(
    sh: &Arc<Shared>,
    r: &NodeRequest,
    keys: &[String],
    memory: &mut Memory,
) -> Result<(), SlotError> {
    let claimed: Vec<Versioned<Node>> = {
        let world = sh.world();
        keys.iter()
            .filter_map(|k| world.slots.get(k))
            .filter(|n| n.value.request_id == r.id && claimed_for(r, &n.value))
            .filter(|n| !world.given_back.contains(&n.value.id))
            .cloned()
            .collect()
    };
    let prepared = futures::future::join_all(
        claimed
            .into_iter()
            .map(|n| prepare(sh, n, r.ssh_public_key.clone())),
    )
    .await;
    let mut result = Ok(());
    for (id, outcome) in prepared {
        match outcome {
            Prepared::Ready(record) => {
                memory.prepared.insert(id, *record);
            }
            Prepared::GivenBack => memory.refused_at = Some(now_ms()),
            Prepared::GivingBackFailed(err) => {
                memory.refused_at = Some(now_ms());
                result = Err(err);
            }
            Prepared::Failed(err) => result = Err(err),
        }
    }
    result
}

/// Claims reserved slots for request `r`, all at once, then gives up their
/// reservations. The claimed nodes are not yet in the mirror: the caller puts them
/// there (the submit fast path only once the request exists).
pub async fn claim(
    sh: &Shared,
    r: &NodeRequest,
    slots: &[(u32, SlotRef)],
) -> Vec<Result<Versioned<Node>, SlotError>> {
    let claims = futures::future::join_all(
        slots
            .iter()
            .map(|(index, slot)| nodes::claim(sh, slot, r, *index)),
    )
    .await;
    let mut world = sh.world();
    for (_, slot) in slots {
        world.unreserve(slot);
    }
    claims
}

/// What a batch of claims came to ([`claim_noting`]).
pub struct Claimed {
    /// The nodes claimed, in the mirror now.
    pub won: Vec<Versioned<Node>>,
    /// Whether a claim was not won.
    pub short: bool,
    /// The last error other than a claim lost.
    pub error: Option<SlotError>,
}

/// Claims reserved slots for request `r` ([`claim`]), puts the nodes won into the
/// mirror, and notes in `memory` the claims won and lost.
pub async fn claim_noting(
    sh: &Shared,
    r: &NodeRequest,
    slots: &[(u32, SlotRef)],
    memory: &mut Memory,
) -> Claimed {
    let sent_at = now_ms();
    let claims = claim(sh, r, slots).await;
    let mut claimed = Claimed {
        won: Vec::new(),
        short: false,
        error: None,
    };
    let mut world = sh.world();
    for (claim, (_, slot)) in claims.into_iter().zip(slots) {
        match claim {
            Ok(node) => {
                memory.claim_won(&node.value.id, sent_at);
                world.put_slot(node.clone());
                claimed.won.push(node);
                continue;
            }
            // Lost to another launcher (or the key holds a record this one cannot
            // read), or its node handed out its max-uses (it retires): the next look
            // passes over it for a while.
            Err(SlotError::Kv(KvError::Conflict { .. }) | SlotError::UsedUp { .. }) => {
                memory.claim_lost(slot.key(), now_ms())
            }
            Err(err) => claimed.error = Some(err),
        }
        claimed.short = true;
    }
    claimed
}

/// How one node's prepare ended ([`prepare`]).
enum Prepared {
    /// The agent prepared it; the mirror has its record, this one.
    Ready(Box<Versioned<Node>>),
    /// The agent refused it (or its reply or host keys were refused): it was given back.
    GivenBack,
    /// Refused, and giving it back failed: the mirror never offers it again
    /// ([`crate::world::World::give_back`]), and the worker gives it back again.
    GivingBackFailed(SlotError),
    /// Neither prepared nor refused (a KV write failed, say).
    Failed(SlotError),
}

/// Has the agent prepare a claimed node; a refused one is given back.
async fn prepare(
    sh: &Arc<Shared>,
    node: Versioned<Node>,
    ssh_public_key: Option<String>,
) -> (NodeId, Prepared) {
    let id = node.value.id.clone();
    let request = node.value.request_id.clone();
    match nodes::prepare(sh, node, ssh_public_key).await {
        Ok(ready) => {
            sh.world().put_slot(ready.clone());
            return (id, Prepared::Ready(Box::new(ready)));
        }
        Err(SlotError::Agent { backing_id, source }) => {
            tracing::warn!(%backing_id, err = %source, "prepare failed; giving the slot back");
        }
        Err(err @ (SlotError::HostKey { .. } | SlotError::ForgedReply { .. })) => {
            tracing::warn!(%err, "giving the slot back");
        }
        Err(err) => return (id, Prepared::Failed(err)),
    }
    match release::give_back(sh, &request, &id).await {
        Ok(_) => (id, Prepared::GivenBack),
        Err(err) => (id, Prepared::GivingBackFailed(err)),
    }
}

/// Whether the claims the prepares of `nodes` were made for still stand, as a
/// fulfilment with them requires.
///
/// The mirror is trusted for a node this worker claimed itself while every mirror has
/// stayed synced since ([`crate::mirror_sync`]): nothing but this worker gives such a
/// claim back before its request ends, and the mirror has seen every change of it. Any
/// other node (claimed by a launcher that drove the request before, or while a watch
/// was away, as during a leader election) has its record written again, unchanged,
/// expecting the revision its prepare left ([`Memory::prepared`]): whatever changed it
/// since, whatever the mirror still says, the write conflicts, that node is given back
/// ([`crate::world::World::give_back`]) and never handed out, and the plan looks again.
pub async fn claims_stand(
    sh: &Arc<Shared>,
    nodes: &[NodeId],
    memory: &mut Memory,
) -> Result<bool, SlotError> {
    let synced_since = sh.mirror_sync.since();
    let nodes: Vec<&NodeId> = nodes
        .iter()
        .filter(|id| {
            let trusted = memory
                .claimed
                .get(*id)
                .is_some_and(|sent| synced_since.is_some_and(|since| since <= *sent));
            !(trusted && memory.prepared.contains_key(*id))
        })
        .collect();
    let prepared: Vec<Option<Versioned<Node>>> = nodes
        .iter()
        .map(|id| memory.prepared.get(*id).cloned())
        .collect();
    let written = futures::future::join_all(prepared.iter().map(|p| async move {
        match p {
            Some(p) => Some(
                sh.bus
                    .slots
                    .update(&p.key, &p.value, p.revision, None)
                    .await,
            ),
            None => None,
        }
    }))
    .await;
    let mut stand = true;
    for ((id, p), outcome) in nodes.into_iter().zip(prepared).zip(written) {
        match (p, outcome) {
            (Some(p), Some(Ok(revision))) => {
                let touched = Versioned { revision, ..p };
                sh.world().put_slot(touched.clone());
                memory.prepared.insert(id.clone(), touched);
            }
            (_, Some(Err(err))) if !matches!(err, KvError::Conflict { .. }) => {
                return Err(err.into())
            }
            // A conflict, or a node no prepare of this worker's made ready.
            _ => {
                tracing::warn!(node_id = %id, "the node's claim changed since its prepare; not handed out");
                memory.prepared.remove(id);
                sh.world().give_back(id);
                stand = false;
            }
        }
    }
    Ok(stand)
}

/// Gives back nodes of a request that ended without them.
async fn give_back_all(sh: &Arc<Shared>, nodes: &[NodeId]) {
    for id in nodes {
        if let Err(err) = release::release(sh, id, Finish::Wait).await {
            tracing::warn!(node_id = %id, %err, "cannot release a node of an ended request");
        }
    }
}

/// Writes a final state: a failed or canceled request is kept for
/// [`FINISHED_REQUEST_TTL_SECS`], a fulfilled one while its nodes are held (see
/// [`crate::release::expire_when_released`]).
async fn finish(
    sh: &Shared,
    req: &Versioned<NodeRequest>,
    mut done: NodeRequest,
) -> Result<(), SlotError> {
    done.updated_at = now_ms();
    let ttl = (done.state != RequestState::Fulfilled)
        .then(|| Duration::from_secs(FINISHED_REQUEST_TTL_SECS));
    let revision = sh
        .bus
        .requests
        .update(&req.key, &done, req.revision, ttl)
        .await?;
    sh.world().put_request(Versioned {
        key: req.key.clone(),
        revision,
        value: done,
    });
    // A client waiting on this launcher's status call hears of the end now, from the
    // acknowledged write, not once the watch brings it back.
    sh.signals.bump(&request_topic(&req.value.id));
    Ok(())
}

async fn set_status(
    sh: &Shared,
    req: &Versioned<NodeRequest>,
    status: String,
    waiting: Option<slotpool_protocol::model::Waiting>,
) -> Result<(), SlotError> {
    let mut r = req.value.clone();
    r.status = status;
    if waiting.is_some() {
        r.waiting = waiting;
    }
    r.updated_at = now_ms();
    let revision = sh
        .bus
        .requests
        .update(&req.key, &r, req.revision, None)
        .await?;
    sh.world().put_request(Versioned {
        key: req.key.clone(),
        revision,
        value: r,
    });
    Ok(())
}
