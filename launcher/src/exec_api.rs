//! Serves `exec` ([`ExecRequest`]): the one check between a caller and a command in a
//! slot. The bus says who the caller is (the subject), but not which nodes it holds —
//! that changes with every request — so the launcher checks, here and only here, that
//! the node is the caller's and ready, then hands the command to the node's agent, which
//! binds the session to the caller. The bytes then flow between caller and agent on
//! subjects only they may use (see [`slotpool_protocol::exec`]), never through here.

use crate::inbound::{bad, check_owner, decode, internal};
use crate::nodes;
use crate::shared::Shared;
use slotpool_protocol::api::{AgentCommand, ApiError, ErrorCode};
use slotpool_protocol::connect::{BusError, Incoming};
use slotpool_protocol::exec::{check_request, ExecRequest, ExecStarted};
use slotpool_protocol::layout::subjects;
use slotpool_protocol::model::NodeState;
use slotpool_protocol::UserName;
use std::sync::Arc;
use std::time::Duration;

/// How long the launcher waits for the agent to start the command.
const AGENT_START_TIMEOUT: Duration = Duration::from_secs(10);

pub async fn exec(
    sh: &Arc<Shared>,
    caller: &UserName,
    msg: &Incoming,
) -> Result<ExecStarted, ApiError> {
    let r: ExecRequest = decode(msg, "exec request", |r: &ExecRequest| r.v)?;
    start(sh, caller, r).await
}

/// Checks `r` of `caller` and has the node's agent start it: for the bus API above and
/// for the HTTP listener's exec routes, which call it with the HTTP caller's name.
pub(crate) async fn start(
    sh: &Arc<Shared>,
    caller: &UserName,
    r: ExecRequest,
) -> Result<ExecStarted, ApiError> {
    check_request(&r, caller.as_str()).map_err(bad)?;
    let id = &r.node_id;
    let node = nodes::record(sh, id)
        .await
        .map_err(internal)?
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no node {id}")))?;
    check_owner(caller, node.client.as_ref(), || format!("node {id}"))?;
    if node.state != NodeState::Ready {
        return Err(ApiError::new(
            ErrorCode::Ended,
            format!(
                "node {id} is {:?}, not ready: a command runs only in a ready node",
                node.state
            ),
        ));
    }
    let command = AgentCommand::Exec {
        slot: node.slot,
        node_id: id.clone(),
        client: caller.clone(),
        request: r.clone(),
    };
    match sh
        .bus
        .call::<_, serde_json::Value>(
            &subjects::agent(&node.backing_id),
            &command,
            AGENT_START_TIMEOUT,
        )
        .await
    {
        Ok(_) => {}
        Err(BusError::Api(err)) => return Err(err),
        Err(err @ (BusError::NoResponders { .. } | BusError::Timeout { .. })) => {
            return Err(ApiError::new(
                ErrorCode::Unavailable,
                format!("the agent of node {id} does not answer: {err}"),
            ))
        }
        Err(err) => return Err(internal(err)),
    }
    tracing::info!(node_id = %id, session = %r.session, "command started");
    Ok(ExecStarted {
        input: subjects::exec_input(caller, &node.backing_id, &r.session, "")
            .trim_end_matches('.')
            .to_string(),
        output: subjects::exec_output(&r.inbox, &r.session, &node.backing_id),
        session: r.session,
    })
}
