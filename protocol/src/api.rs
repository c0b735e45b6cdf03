//! Request-reply messages: the launcher's API (clients, operators) and agent commands.
//!
//! Every reply is `{"ok": <payload>}` or `{"error": {"code": "...", "message": "..."}}`.

use crate::ids::{BackingId, NodeId, RequestId};
use crate::model::{BackingState, IdleBehaviour};
use serde::{Deserialize, Serialize};

/// A reply to any request-reply message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply<T> {
    Ok(T),
    Error(ApiError),
}

impl<T> Reply<T> {
    pub fn into_result(self) -> Result<T, ApiError> {
        match self {
            Reply::Ok(v) => Ok(v),
            Reply::Error(e) => Err(e),
        }
    }
}

impl<T> From<Result<T, ApiError>> for Reply<T> {
    fn from(r: Result<T, ApiError>) -> Self {
        match r {
            Ok(v) => Reply::Ok(v),
            Err(e) => Reply::Error(e),
        }
    }
}

/// Why a request-reply message was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Not valid JSON, or not the expected message.
    BadRequest,
    /// Larger than [`crate::MAX_MESSAGE_BYTES`] or too many labels.
    TooLarge,
    /// A label no pool serves.
    UnknownLabel,
    /// The request or node does not exist.
    NotFound,
    /// The message's protocol version is not supported.
    UnsupportedVersion,
    /// The responder cannot do it now (an agent closed to new slots, say).
    Unavailable,
    /// The responder failed; retrying may help.
    Internal,
    /// The caller may not do this: the request or node belongs to another client.
    Forbidden,
    /// The request has ended: a `keepalive` came after its keep-alive lapsed, or for a
    /// request that failed, was canceled, was reclaimed or whose nodes were all released.
    Ended,
    /// The record in question cannot be read (corrupt or written by something else);
    /// retrying does not help.
    Unreadable,
    /// A hard limit of the caller's tenant (`max-waiting`, `max-submits-per-second`)
    /// refused the submit; the message names the limit. Retrying later may succeed.
    OverLimit,
    /// The subject names an operation the API does not have
    /// (`slotpool.api.v2.<client>.<op>`, `slotpool.admin.v2.<operator>.<action>`).
    UnknownOperation,
}

impl ErrorCode {
    /// Every code, in the order docs/protocol.md lists them.
    pub const ALL: [ErrorCode; 12] = [
        ErrorCode::BadRequest,
        ErrorCode::TooLarge,
        ErrorCode::UnknownLabel,
        ErrorCode::Forbidden,
        ErrorCode::Ended,
        ErrorCode::NotFound,
        ErrorCode::OverLimit,
        ErrorCode::UnsupportedVersion,
        ErrorCode::Unavailable,
        ErrorCode::Unreadable,
        ErrorCode::UnknownOperation,
        ErrorCode::Internal,
    ];

    /// Its position in [`ErrorCode::ALL`]: a code added to the enum is a compile error
    /// here until it is listed there too.
    pub fn index(self) -> usize {
        match self {
            ErrorCode::BadRequest => 0,
            ErrorCode::TooLarge => 1,
            ErrorCode::UnknownLabel => 2,
            ErrorCode::Forbidden => 3,
            ErrorCode::Ended => 4,
            ErrorCode::NotFound => 5,
            ErrorCode::OverLimit => 6,
            ErrorCode::UnsupportedVersion => 7,
            ErrorCode::Unavailable => 8,
            ErrorCode::Unreadable => 9,
            ErrorCode::UnknownOperation => 10,
            ErrorCode::Internal => 11,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
        }
    }
}

fn default_version() -> u32 {
    crate::PROTOCOL_VERSION
}

/// Most labels one request may ask for.
pub const MAX_LABELS_PER_REQUEST: usize = 64;

/// `slotpool.api.v2.<client>.submit`: ask for a node set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    #[serde(default = "default_version")]
    pub v: u32,
    /// Optional client-chosen id (`req-...`); submitting the same id twice is idempotent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<RequestId>,
    pub labels: Vec<String>,
    pub requestor: String,
    /// Lower first; default 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_public_key: Option<String>,
    /// Ask for a keep-alive of this many seconds ([`MIN_KEEP_ALIVE_SECS`] to
    /// [`MAX_KEEP_ALIVE_SECS`]): unless renewed with [`KeepAlive`] within each period,
    /// the request fails (while waiting) or its nodes are reclaimed (once fulfilled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_alive_secs: Option<u64>,
    /// Hold the reply until the request is final or this many milliseconds have passed
    /// (at most [`MAX_WAIT_MS`]); the reply then carries the request as it stands
    /// ([`Submitted::request`]), which spares the `status` call a client would make
    /// next. Absent: the reply comes at once, with the id only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
}

/// Shortest keep-alive period a request may ask for.
pub const MIN_KEEP_ALIVE_SECS: u64 = 2;
/// Longest keep-alive period a request may ask for.
pub const MAX_KEEP_ALIVE_SECS: u64 = 3_600;

/// `slotpool.api.v2.<client>.keepalive`: renew the keep-alive of the caller's request,
/// for another `keep_alive_secs` from now.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeepAlive {
    #[serde(default = "default_version")]
    pub v: u32,
    pub request_id: RequestId,
}

/// Reply to [`KeepAlive`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeptAlive {
    pub request_id: RequestId,
    /// Its state (requested or fulfilled).
    pub state: crate::model::RequestState,
    /// When the keep-alive now lapses (Unix milliseconds, the launcher's clock).
    pub alive_until: crate::time::UnixMillis,
}

/// Default priority of a request that names none.
pub const DEFAULT_PRIORITY: i32 = 100;

/// Reply to [`SubmitRequest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Submitted {
    pub request_id: RequestId,
    /// With [`SubmitRequest::wait_ms`]: the request once it was final, or as it stood
    /// when the wait was over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<Box<crate::model::NodeRequest>>,
}

/// `slotpool.api.v2.<client>.release`: return nodes. Releasing a node twice is not an error.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseNodes {
    #[serde(default = "default_version")]
    pub v: u32,
    pub nodes: Vec<NodeId>,
}

/// `slotpool.api.v2.<client>.status`: the caller's request as it is now, or, with
/// `wait_ms`, as soon as it is final (fulfilled, failed or canceled) or `wait_ms` has
/// passed, whichever comes first. Answered with the [`crate::model::NodeRequest`] record;
/// another client's request is `not_found`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestStatus {
    #[serde(default = "default_version")]
    pub v: u32,
    pub request_id: RequestId,
    /// Wait this long for the request to end (at most [`MAX_WAIT_MS`]); 0: answer now.
    #[serde(default)]
    pub wait_ms: u64,
}

/// Longest a launcher holds a status or wait_released call open before it answers with
/// what is now (the caller asks again).
pub const MAX_WAIT_MS: u64 = 8_000;

/// `slotpool.api.v2.<client>.wait_released`: answers once none of `nodes` holds its
/// slot any more (each release finished: the agent wiped the slot), or after `wait_ms`
/// with those that still do. With `until_not_ready`, a node counts as gone as soon as
/// it is not `ready` (releasing, failed): how a client running a command in it learns
/// the node was lost.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitReleased {
    #[serde(default = "default_version")]
    pub v: u32,
    pub nodes: Vec<NodeId>,
    #[serde(default)]
    pub wait_ms: u64,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub until_not_ready: bool,
}

/// `slotpool.api.v2.<client>.nodes`: the records of the caller's nodes (host, workspace,
/// login, attributes), in the order asked; nodes that no longer hold a slot are left out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodesQuery {
    #[serde(default = "default_version")]
    pub v: u32,
    pub nodes: Vec<NodeId>,
}

/// Reply to [`WaitReleased`]: the nodes that still hold their slots (empty: all done).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StillHeld {
    pub held: Vec<NodeId>,
}

/// Reply to [`ReleaseNodes`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Released {
    pub released: Vec<NodeId>,
    /// Nodes that hold no slot and did not leave one of the caller's lately (never handed
    /// out to the caller, or released long ago). A node released by an earlier sending
    /// of the same release is listed in `released` (docs/protocol.md, "Sending a call
    /// again").
    pub not_found: Vec<NodeId>,
}

/// `slotpool.api.v2.<client>.cancel`: give up a waiting request (its partial slots are freed).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelRequest {
    #[serde(default = "default_version")]
    pub v: u32,
    pub request_id: RequestId,
}

/// Reply to [`CancelRequest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Canceled {
    pub request_id: RequestId,
    /// Its state after the call (a fulfilled request is not canceled: release its nodes).
    pub state: crate::model::RequestState,
}

/// `slotpool.admin.v2.<operator>.{hold,drain,run,kill}`: an operator's order on one backing node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackingOrder {
    #[serde(default = "default_version")]
    pub v: u32,
    pub backing_id: BackingId,
    /// Ignored: the order is recorded under the operator's bus user name, taken from
    /// the subject the server let it publish on (kept so older senders still decode).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub actor: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Reply to [`BackingOrder`]: the backing node as the order left it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OrderTaken {
    pub backing_id: BackingId,
    pub state: BackingState,
    pub idle: IdleBehaviour,
    /// What happens next, e.g. "released once its 2 slots in use are returned".
    pub message: String,
}

/// `slotpool.admin.v2.<operator>.release_node`: an operator releases one slot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseNodeOrder {
    #[serde(default = "default_version")]
    pub v: u32,
    pub node_id: NodeId,
    /// Ignored, as in [`BackingOrder`].
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub actor: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Commands a launcher sends to an agent on `slotpool.agent.v2.<backing id>`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum AgentCommand {
    /// Make slot `slot` ready for `node_id` (idempotent for the same node).
    PrepareSlot {
        slot: u32,
        node_id: NodeId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ssh_public_key: Option<String>,
        /// Resource limits of the slot's cgroup (from the label's `limits`).
        #[serde(default, skip_serializing_if = "SlotLimits::is_empty")]
        limits: SlotLimits,
    },
    /// Kill everything of the slot and wipe it (idempotent; tolerates a slot never prepared).
    ReleaseSlot { slot: u32, node_id: NodeId },
    /// Refuse new `prepare_slot`s from now on (the backing node is about to be released);
    /// replies [`SlotsClosed`] with the slots still prepared.
    Close,
    /// Accept `prepare_slot`s again (a release was aborted); replies [`SlotsClosed`].
    Open,
    /// Who is in slot `slot` now: replies [`SlotOccupants`]. Asked on demand (an
    /// operator's detail view), never part of the heartbeat.
    SlotOccupants { slot: u32 },
    /// The newest `lines` lines of the agent's own log (at most [`LOG_TAIL_MAX_LINES`]):
    /// replies [`LogTail`]. Read-only, asked on demand (an operator's detail view).
    LogTail { lines: u32 },
    /// Run a command in slot `slot` for `client`, whom the launcher found holding
    /// `node_id`: replies `{}` once it started (see [`crate::exec`]).
    Exec {
        slot: u32,
        node_id: NodeId,
        client: crate::UserName,
        request: crate::exec::ExecRequest,
    },
}

/// Most lines a [`AgentCommand::LogTail`] answers, whatever it asks.
pub const LOG_TAIL_MAX_LINES: u32 = 200;
/// Most bytes of text a [`LogTail`] carries: with JSON's escaping it stays well under
/// the bus's largest message (1 MiB by default).
pub const LOG_TAIL_MAX_BYTES: usize = 48 * 1024;

/// An operator's question on `slotpool.admin.v2.<operator>.log_tail`: the newest `lines`
/// lines of backing node `backing_id`'s agent log. The launcher asks the node's agent
/// ([`AgentCommand::LogTail`]) and relays its [`LogTail`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LogTailQuery {
    #[serde(default = "default_version")]
    pub v: u32,
    pub backing_id: BackingId,
    pub lines: u32,
}

/// Reply to [`AgentCommand::LogTail`]: log lines as the agent writes them (time, level,
/// target, spans, message, fields), oldest first, with every control character escaped
/// ([`crate::text::printable`]), so no line can move a terminal's cursor.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LogTail {
    pub lines: Vec<String>,
}

/// An operator's question on `slotpool.admin.v2.<operator>.slot_occupants`: who is in
/// slot `slot` of backing node `backing_id`. The launcher asks the node's agent
/// ([`AgentCommand::SlotOccupants`]) and relays its [`SlotOccupants`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlotOccupantsQuery {
    #[serde(default = "default_version")]
    pub v: u32,
    pub backing_id: BackingId,
    pub slot: u32,
}

/// An operator's order to revoke every credential of one bus user issued until now, on
/// `slotpool.admin.v2.<operator>.revoke`: the NATS server refuses them from then on and
/// closes their connections, and the launchers' HTTP API refuses their tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RevokeOrder {
    #[serde(default = "default_version")]
    pub v: u32,
    /// `client`, `operator` or `agent` (a static host's agent: its backing id as name).
    pub role: crate::auth::Role,
    pub name: crate::UserName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Reply to a [`RevokeOrder`]: once sent, the server holds the revocation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RevokeTaken {
    /// The user's nkey, as the revocation names it.
    pub key: String,
    /// Credentials of that key issued until then (seconds since the epoch) are revoked.
    pub revoked_at: u64,
}

/// Reply to [`AgentCommand::SlotOccupants`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SlotOccupants {
    /// Processes of the slot's user (0 without a slot user, mode `none`).
    pub processes: u32,
    /// The SSH logins into the slot still open, oldest first.
    #[serde(default)]
    pub logins: Vec<SlotSession>,
}

/// One SSH login into a slot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlotSession {
    /// The slot user logged in as.
    pub user: String,
    /// Where from: the client's address and port.
    pub from: String,
    /// When the login's shell started.
    pub since: crate::time::UnixMillis,
}

/// Reply to [`AgentCommand::Close`] and [`AgentCommand::Open`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SlotsClosed {
    /// Slots prepared and not yet released.
    pub prepared: Vec<u32>,
}

/// Smallest workspace file system a slot may ask for ([`SlotLimits::disk_bytes`]), in MiB:
/// below it the file system's own structures take most of it.
pub const MIN_DISK_MB: u64 = 16;

/// Resource limits of one slot; a missing field means no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotLimits {
    /// CPU time in thousandths of a CPU (1500 = one and a half CPUs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_millis: Option<u32>,
    /// Memory (RAM) in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Most processes and threads at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u32>,
    /// Size of the workspace's own file system in bytes (a disk quota); agents in
    /// `users` mode give such a slot a file-system image of that size as its workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
}

impl SlotLimits {
    pub fn is_empty(&self) -> bool {
        *self == SlotLimits::default()
    }
}

/// Reply to [`AgentCommand::ReleaseSlot`]: `{}` when the slot was wiped (or was
/// free); `held_by` when another node holds it, which the agent leaves alone.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SlotReleased {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_by: Option<NodeId>,
}

/// Reply to [`AgentCommand::PrepareSlot`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlotPrepared {
    pub workspace: String,
    /// How to log in: fields `username`, `port`, `host_keys`.
    #[serde(flatten)]
    pub login: crate::model::SlotLogin,
}

#[cfg(test)]
mod tests {
    use super::ErrorCode;

    #[test]
    fn all_lists_every_code_once_in_its_place() {
        for (i, code) in ErrorCode::ALL.into_iter().enumerate() {
            assert_eq!(code.index(), i, "{code:?}");
        }
    }
}
