//! Operators' orders, served on `slotpool.admin.v2.<operator>.<action>`: hold, drain, run and kill a
//! backing node, and release one node; and two questions, relayed to the node's agent:
//! who is in a slot (`slot_occupants`) and the agent's newest log lines (`log_tail`). An order is a revision-checked write of the backing
//! node's record (its `idle` behaviour and `order`); the launcher that drives the node
//! (whichever holds its lease) carries it out through the state machine, so orders survive
//! a launcher restart. Every order is recorded in the event log with who (the operator's bus user name, from the subject: never what the message
//! says), when and why. An operator may also revoke a user's credentials (`revoke`,
//! [`crate::revocation`]), recorded likewise.

use crate::events::{self, Subject};
use crate::inbound::{bad, decode, internal};
use crate::release::{self, Finish};
use crate::revocation::{self, RevokeError};
use crate::shared::{seat_topic, Shared};
use slotpool_protocol::api::{
    AgentCommand, ApiError, BackingOrder, ErrorCode, LogTail, LogTailQuery, OrderTaken,
    ReleaseNodeOrder, Released, RevokeOrder, RevokeTaken, SlotOccupants, SlotOccupantsQuery,
};
use slotpool_protocol::auth::{BusUser, Role};
use slotpool_protocol::connect::{BusError, Incoming};
use slotpool_protocol::layout::subjects;
use slotpool_protocol::model::{
    BackingNode, BackingState, IdleBehaviour, OperatorAction, OperatorOrder,
};
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::now_ms;
use slotpool_protocol::{BackingId, UserName};
use std::sync::Arc;
use std::time::Duration;

const MAX_REASON_LEN: usize = 1024;

fn check_why(reason: Option<&String>) -> Result<(), ApiError> {
    if reason.is_some_and(|r| r.len() > MAX_REASON_LEN || r.contains('\n')) {
        return Err(bad(format!(
            "reason must be one line of at most {MAX_REASON_LEN} characters"
        )));
    }
    Ok(())
}

fn describe(order: &OperatorOrder) -> String {
    let mut s = format!("{} by {}", order.action.as_str(), order.actor);
    if let Some(r) = &order.reason {
        s.push_str(": ");
        s.push_str(r);
    }
    s
}

/// Serves `revoke`: records the revocation of every credential of the user named,
/// issued until now, and answers once the server holds it (its connections are closed
/// then).
pub async fn revoke(
    sh: &Arc<Shared>,
    operator: &UserName,
    msg: &Incoming,
) -> Result<RevokeTaken, ApiError> {
    let o: RevokeOrder = decode(msg, "revoke order", |o: &RevokeOrder| o.v)?;
    check_why(o.reason.as_ref())?;
    if o.role == Role::Launcher {
        return Err(bad(
            "a launcher's credential is not revoked this way: launchers hold the keys that \
             revoke; make a new installation (slotpool nats-setup) to shut one out",
        ));
    }
    let Some(desk) = sh.agent_bus.revocation().cloned() else {
        return Err(ApiError::new(
            ErrorCode::Unavailable,
            RevokeError::NoKeys.to_string(),
        ));
    };
    let user = BusUser {
        role: o.role,
        name: o.name.clone(),
    };
    let (key, revoked_at) =
        revocation::record(sh, &user, operator.as_str(), o.reason.clone(), None)
            .await
            .map_err(|err| match err {
                RevokeError::NoKeys => ApiError::new(ErrorCode::Unavailable, err.to_string()),
                RevokeError::Kv(err) => internal(err),
            })?;
    let mut message = format!("revoke {user} by {operator}");
    if let Some(r) = &o.reason {
        message.push_str(": ");
        message.push_str(r);
    }
    events::operator(sh, operator.as_str(), Subject::default(), message);
    if !desk
        .wait_held(&key, revoked_at, revocation::TAKEN_WITHIN)
        .await
    {
        return Err(ApiError::new(
            ErrorCode::Unavailable,
            format!(
                "the revocation of {user} is recorded, but the NATS server has not taken it \
                 within {:?}; launchers go on pushing it (see their logs)",
                revocation::TAKEN_WITHIN
            ),
        ));
    }
    Ok(RevokeTaken { key, revoked_at })
}

/// Serves `hold`, `drain`, `run` and `kill`.
pub async fn order_backing(
    sh: &Arc<Shared>,
    operator: &UserName,
    action: OperatorAction,
    msg: &Incoming,
) -> Result<OrderTaken, ApiError> {
    let o: BackingOrder = decode(msg, "backing order", |o: &BackingOrder| o.v)?;
    check_why(o.reason.as_ref())?;
    let order = OperatorOrder {
        action,
        actor: operator.to_string(),
        reason: o.reason.clone(),
        at: now_ms(),
    };
    let seat = seat_of(sh, &o.backing_id).await?;
    loop {
        let current = match sh.bus.backing.get::<BackingNode>(&seat).await {
            Ok(Some(b)) if b.value.id == o.backing_id => b,
            Ok(_) => return Err(not_found(&o.backing_id)),
            Err(err) => return Err(internal(err)),
        };
        let b = &current.value;
        if matches!(b.state, BackingState::Releasing | BackingState::Failed) {
            let already = match b.state {
                BackingState::Failed => "failed",
                _ => "being released",
            };
            if action == OperatorAction::Kill {
                return Ok(taken(b, format!("{} is already {already}", b.id)));
            }
            return Err(ApiError::new(
                ErrorCode::Unavailable,
                format!(
                    "{} is already {already}; hold, drain and run apply to backing nodes that are requested, launching, ready or retiring",
                    b.id
                ),
            ));
        }
        let mut next = b.clone();
        if let Some(idle) = action.idle() {
            next.idle = idle;
        }
        next.order = Some(order.clone());
        next.updated_at = now_ms();
        match sh
            .bus
            .backing
            .update(&seat, &next, current.revision, None)
            .await
        {
            Ok(revision) => {
                let (used, last_release) = {
                    let world = sh.world();
                    (
                        world.used_count(&next.id),
                        world.last_release.get(&next.id).copied(),
                    )
                };
                let now = now_ms();
                // An empty node run again after its grace-time ran out while it was held
                // is released at once: say so rather than "after grace-time".
                let released_now = used == 0
                    && next.idle == IdleBehaviour::Run
                    && next.idle_since.is_some()
                    && sh
                        .config
                        .sites(&next.label)
                        .iter()
                        .find(|s| s.provider.name == next.provider && s.pool.name == next.pool)
                        .is_some_and(|s| {
                            let rules = s.label.idle_rules();
                            slotpool_config::timing::release_at(&next, last_release, now, &rules)
                                <= now
                        });
                let message = outcome_message(&next, used, released_now);
                tracing::info!(backing_id = %next.id, order = %describe(&order), "operator order taken");
                events::operator(
                    sh,
                    &order.actor,
                    Subject::backing(&next.id),
                    format!("{} on {}: {message}", describe(&order), next.id),
                );
                sh.world().put_backing(Versioned {
                    key: seat.clone(),
                    revision,
                    value: next.clone(),
                });
                sh.signals.bump(&seat_topic(&seat));
                return Ok(taken(&next, message));
            }
            Err(KvError::Conflict { .. }) => continue,
            Err(err) => return Err(internal(err)),
        }
    }
}

/// What happens next, in words.
fn outcome_message(b: &BackingNode, used: u32, released_now: bool) -> String {
    let in_use = format!("{used} of {} slots in use", b.slots);
    if b.kill_ordered() {
        return format!("killed: it is deleted now and its {used} nodes fail");
    }
    match b.idle {
        IdleBehaviour::Hold => {
            format!("held: takes no new slots and is never released automatically ({in_use})")
        }
        IdleBehaviour::Drain if used == 0 => "draining: empty, released now".into(),
        IdleBehaviour::Drain => {
            format!(
                "draining: takes no new slots; released once its {used} slots in use are returned"
            )
        }
        IdleBehaviour::Run if released_now => "running: empty and idle past its grace-time: \
            released now, unless a request takes a slot first"
            .into(),
        IdleBehaviour::Run => {
            format!(
                "running: takes slots again and is released after grace-time when idle ({in_use})"
            )
        }
    }
}

fn taken(b: &BackingNode, message: String) -> OrderTaken {
    OrderTaken {
        backing_id: b.id.clone(),
        state: b.state,
        idle: b.idle,
        message,
    }
}

fn not_found(id: &BackingId) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("no backing node {id} (see `slotpool list backing`)"),
    )
}

/// The seat key of a backing node: from the mirror, or by a scan of the bucket when the
/// mirror has not seen it yet.
async fn seat_of(sh: &Shared, id: &BackingId) -> Result<String, ApiError> {
    if let Some(seat) = sh.world().seat_of.get(id).cloned() {
        return Ok(seat);
    }
    let all = sh
        .bus
        .backing
        .list::<BackingNode>()
        .await
        .map_err(internal)?;
    all.into_iter()
        .flatten()
        .find(|b| &b.value.id == id)
        .map(|b| b.key)
        .ok_or_else(|| not_found(id))
}

/// Serves `release_node`: frees one slot whoever holds it.
pub async fn release_node(
    sh: &Arc<Shared>,
    operator: &UserName,
    msg: &Incoming,
) -> Result<Released, ApiError> {
    let o: ReleaseNodeOrder = decode(msg, "release-node order", |o: &ReleaseNodeOrder| o.v)?;
    check_why(o.reason.as_ref())?;
    let mut out = Released::default();
    let order = OperatorOrder {
        action: OperatorAction::ReleaseNode,
        actor: operator.to_string(),
        reason: o.reason.clone(),
        at: now_ms(),
    };
    if release::release(sh, &o.node_id, Finish::Background)
        .await
        .map_err(internal)?
    {
        tracing::info!(node_id = %o.node_id, order = %describe(&order), "node released by an operator");
        events::operator(
            sh,
            &order.actor,
            Subject::node(&o.node_id),
            format!("{} on {}", describe(&order), o.node_id),
        );
        out.released.push(o.node_id);
    } else {
        out.not_found.push(o.node_id);
    }
    Ok(out)
}

/// How long a question relayed to an agent (`slot_occupants`, `log_tail`) waits for it.
const AGENT_QUESTION_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves `slot_occupants`: asks the backing node's agent who is in the slot. Operators
/// only (the subject is under `slotpool.admin`); not an order, so nothing is recorded.
pub async fn slot_occupants(sh: &Arc<Shared>, msg: &Incoming) -> Result<SlotOccupants, ApiError> {
    let q: SlotOccupantsQuery =
        decode(msg, "slot_occupants question", |q: &SlotOccupantsQuery| q.v)?;
    ask_agent(
        sh,
        &q.backing_id,
        &AgentCommand::SlotOccupants { slot: q.slot },
    )
    .await
}

/// Serves `log_tail`: asks the backing node's agent for its newest log lines. Operators
/// only, like [`slot_occupants`]; nothing is recorded.
pub async fn log_tail(sh: &Arc<Shared>, msg: &Incoming) -> Result<LogTail, ApiError> {
    let q: LogTailQuery = decode(msg, "log_tail question", |q: &LogTailQuery| q.v)?;
    ask_agent(sh, &q.backing_id, &AgentCommand::LogTail { lines: q.lines }).await
}

/// Relays a read-only question to the agent of a known backing node (`not_found` for
/// one with no record) and its answer back; an agent that does not answer is
/// `unavailable`.
async fn ask_agent<T: serde::de::DeserializeOwned>(
    sh: &Arc<Shared>,
    backing_id: &BackingId,
    asked: &AgentCommand,
) -> Result<T, ApiError> {
    seat_of(sh, backing_id).await?;
    match sh
        .bus
        .call(&subjects::agent(backing_id), asked, AGENT_QUESTION_TIMEOUT)
        .await
    {
        Ok(answer) => Ok(answer),
        Err(BusError::Api(err)) => Err(err),
        Err(err @ (BusError::NoResponders { .. } | BusError::Timeout { .. })) => {
            Err(ApiError::new(
                ErrorCode::Unavailable,
                format!("the agent of {backing_id} does not answer: {err}"),
            ))
        }
        Err(err) => Err(internal(err)),
    }
}
