//! The records slotpool keeps in KV. Field names are the JSON names (snake_case);
//! every record carries `"v"`, the protocol version.

use crate::ids::{BackingId, EventId, LauncherId, NodeId, RequestId};
use crate::time::UnixMillis;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::BTreeMap;

/// Free-form attributes copied onto nodes (`node-attributes` in the config).
pub type Attributes = BTreeMap<String, serde_json::Value>;

/// Lifecycle of a [`NodeRequest`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestState {
    /// Accepted, waiting for slots.
    Requested,
    /// Every label has a node; `nodes` lists them.
    Fulfilled,
    /// Cannot be served; `failure` says why.
    Failed,
    /// Canceled by the requestor before it was fulfilled.
    Canceled,
    /// Was fulfilled; its nodes were taken back because its keep-alive lapsed or a
    /// label's `max-hold-time` passed. `failure` says which.
    Reclaimed,
}

impl RequestState {
    pub fn is_final(self) -> bool {
        !matches!(self, RequestState::Requested)
    }
}

/// A node set asked for by one requestor: all its nodes are handed out together.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeRequest {
    pub v: u32,
    pub id: RequestId,
    /// One label per node wanted, e.g. `["small", "small", "medium"]`.
    pub labels: Vec<String>,
    pub requestor: String,
    /// Lower is served first; FIFO within a priority.
    pub priority: i32,
    /// Fail the request if it is not fulfilled this many seconds after `created_at`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// Installed for the slot users once agents enforce isolation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_public_key: Option<String>,
    pub created_at: UnixMillis,
    pub state: RequestState,
    /// One line a human understands, e.g. "waiting for a backing node of large-node to boot".
    pub status: String,
    /// The nodes handed out, in the order of `labels` (set when fulfilled).
    #[serde(default)]
    pub nodes: Vec<NodeId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    pub updated_at: UnixMillis,
    /// The launcher driving the request (set by the launcher that accepted it). Another
    /// launcher takes it over, by a revision-checked write of this field, only once the
    /// owner's liveness lease is gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<LauncherId>,
    /// The bus user who submitted it (from the subject; only it may see, release or
    /// cancel the request and its nodes). `None` for a request of an anonymous bus.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<crate::UserName>,
    /// When the last node of a fulfilled request was released. A fulfilled request is
    /// kept while any of its nodes is held (so a claimed node without a request record
    /// is always a stray); once this is set, the record expires
    /// [`crate::layout::FINISHED_REQUEST_TTL_SECS`] later, like a failed or canceled one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes_released_at: Option<UnixMillis>,
    /// The keep-alive period asked for at submit: unless the client renews the request
    /// (`keepalive`) before `alive_until`, its nodes are reclaimed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_alive_secs: Option<u64>,
    /// When the keep-alive lapses: `keep_alive_secs` after the submit or the last renewal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alive_until: Option<UnixMillis>,
    /// When the request was fulfilled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fulfilled_at: Option<UnixMillis>,
    /// When its nodes are reclaimed whatever the client does: `fulfilled_at` plus the
    /// shortest `max-hold-time` of the labels (as configured in the pools of its nodes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_until: Option<UnixMillis>,
    /// Nodes of a fulfilled request that failed while it held them (their backing node
    /// failed: killed, its agent gone): whatever ran on them is lost. They stay the
    /// request's until released, like the others; `status` says why the last one failed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes_failed: Vec<NodeId>,
    /// Why the request waits and how long each cause has held it, written with `status`
    /// once a wait lasts (a wait of a moment is not written); kept once it ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<Waiting>,
}

/// Why a request waits ([`NodeRequest::waiting`]): its cause now, since when, and the
/// time each earlier cause held it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiting {
    pub cause: WaitCause,
    /// When `cause` began to hold it.
    pub since: UnixMillis,
    /// Milliseconds each earlier cause held it, by cause (the time under `cause` now is
    /// `updated_at - since` and more).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub held_ms: BTreeMap<WaitCause, u64>,
}

impl Waiting {
    /// The record after the cause is `cause` at `now`: the same cause keeps its start;
    /// another one ends the current cause's time and starts its own.
    pub fn next(old: Option<&Waiting>, cause: WaitCause, now: UnixMillis) -> Waiting {
        match old {
            Some(w) if w.cause == cause => w.clone(),
            Some(w) => {
                let mut held_ms = w.held_ms.clone();
                *held_ms.entry(w.cause).or_default() += now.saturating_sub(w.since);
                Waiting {
                    cause,
                    since: now,
                    held_ms,
                }
            }
            None => Waiting {
                cause,
                since: now,
                held_ms: BTreeMap::new(),
            },
        }
    }

    /// Each cause that held the request by `end` with its milliseconds, longest first:
    /// "why did it wait", in one line ([`Waiting::summary`]).
    pub fn breakdown(&self, end: UnixMillis) -> Vec<(WaitCause, u64)> {
        let mut all: Vec<(WaitCause, u64)> = WaitCause::ALL
            .into_iter()
            .map(|c| (c, self.held(c, end)))
            .filter(|(_, ms)| *ms > 0)
            .collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        all
    }

    /// `booting 31.2s, behind 1.0s`: [`Waiting::breakdown`] for humans.
    pub fn summary(&self, end: UnixMillis) -> String {
        self.breakdown(end)
            .iter()
            .map(|(c, ms)| format!("{} {:.1}s", c.name(), *ms as f64 / 1000.0))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Milliseconds `cause` has held the request by `now`, this time and before.
    pub fn held(&self, cause: WaitCause, now: UnixMillis) -> u64 {
        let before = self.held_ms.get(&cause).copied().unwrap_or(0);
        if self.cause == cause {
            before + now.saturating_sub(self.since)
        } else {
            before
        }
    }
}

/// What holds a waiting request, for [`Waiting`] and the metrics by cause.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitCause {
    /// Requests served before it in the queue's order (a better priority, or a tenant
    /// further below its share) take the free slots.
    Behind,
    /// Its tenant holds its `max-slots`.
    TenantLimit,
    /// A provider is out of capacity for the backing node it needs.
    OutOfCapacity,
    /// The backing node it needs waits for its provider's create limits
    /// (`max-creates-per-second`, `max-concurrent-creates`).
    RateLimited,
    /// A backing node for it is booting.
    Booting,
    /// Every pool serving the label is at `max-servers`.
    PoolsFull,
    /// The slots are in use and nothing is coming yet.
    Taken,
}

impl WaitCause {
    pub const ALL: [WaitCause; 7] = [
        WaitCause::Behind,
        WaitCause::TenantLimit,
        WaitCause::OutOfCapacity,
        WaitCause::RateLimited,
        WaitCause::Booting,
        WaitCause::PoolsFull,
        WaitCause::Taken,
    ];

    /// Its name on the wire and in metrics.
    pub fn name(self) -> &'static str {
        match self {
            WaitCause::Behind => "behind",
            WaitCause::TenantLimit => "tenant_limit",
            WaitCause::OutOfCapacity => "out_of_capacity",
            WaitCause::RateLimited => "rate_limited",
            WaitCause::Booting => "booting",
            WaitCause::PoolsFull => "pools_full",
            WaitCause::Taken => "taken",
        }
    }
}

impl NodeRequest {
    /// The request's deadline, if it has a timeout.
    pub fn deadline(&self) -> Option<UnixMillis> {
        self.timeout_secs
            .map(|s| self.created_at.saturating_add(s.saturating_mul(1000)))
    }

    /// Whether the request's nodes are held: it is fulfilled and not all of them were
    /// released.
    pub fn holds_nodes(&self) -> bool {
        self.state == RequestState::Fulfilled && self.nodes_released_at.is_none()
    }

    /// Whether the request is over and holds nothing: failed, canceled, reclaimed, or
    /// fulfilled and every node given back. Such a record is written with
    /// [`crate::layout::FINISHED_REQUEST_TTL_SECS`]; nothing drives it any more.
    pub fn is_finished(&self) -> bool {
        match self.state {
            RequestState::Requested => false,
            RequestState::Fulfilled => self.nodes_released_at.is_some(),
            RequestState::Failed | RequestState::Canceled | RequestState::Reclaimed => true,
        }
    }

    /// When the nodes of a request holding them are reclaimed (its keep-alive lapses, or
    /// its `hold_until` comes), if ever.
    pub fn hold_deadline(&self) -> Option<UnixMillis> {
        if !self.holds_nodes() {
            return None;
        }
        match (self.alive_until, self.hold_until) {
            (Some(a), Some(h)) => Some(a.min(h)),
            (a, h) => a.or(h),
        }
    }
}

/// Lifecycle of a [`Node`] (one slot handed to one request).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// Slot claimed; the agent is preparing it.
    Preparing,
    /// Handed out; the requestor may use it.
    Ready,
    /// Being returned: the agent is cleaning the slot.
    Releasing,
    /// Its backing node died or was killed; release it to free the record.
    Failed,
}

/// One slot of a backing node, handed to one request. Stored under the slot's key, so a
/// slot can never hold two nodes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub v: u32,
    pub id: NodeId,
    pub request_id: RequestId,
    /// Position of this node in the request's `labels`.
    pub index: u32,
    pub label: String,
    pub backing_id: BackingId,
    pub slot: u32,
    pub state: NodeState,
    pub requestor: String,
    /// The bus user whose request holds it (see [`NodeRequest::client`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<crate::UserName>,
    /// Where to reach the node (the backing node's host).
    pub host: String,
    /// The slot's workspace directory on the backing node (set once prepared).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
    /// The backing node's attributes overlaid with the label's `node-attributes`.
    #[serde(default)]
    pub attributes: Attributes,
    pub allocated_at: UnixMillis,
    /// When the node was marked releasing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_at: Option<UnixMillis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// How to log in (set once prepared): fields `username`, `port`, `host_keys`.
    #[serde(flatten)]
    pub login: SlotLogin,
}

/// How a requestor logs in to a slot: its Unix user and the backing node's SSH endpoint.
/// Flattened into [`Node`] and the agent's `SlotPrepared` reply.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SlotLogin {
    /// The slot's Unix user on the backing node (with user isolation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// The SSH port of the backing node, when the agent reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The backing node's SSH host public keys, one `<type> <base64>` line each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_keys: Vec<String>,
}

/// Lifecycle of a [`BackingNode`]. Allowed transitions (see [`BackingState::can_become`]):
///
/// ```text
/// requested → launching → ready → retiring → releasing → gone
///      ↘          ↘          ↘         ↘           ↘
///                         failed  (→ releasing, to clean up the instance)
/// releasing → ready when a slot was claimed before the agent closed (release aborted)
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackingState {
    /// A seat is taken; nothing launched yet.
    Requested,
    /// The provider was asked for an instance; waiting for its agent.
    Launching,
    /// Its agent reports in; slots are handed out.
    Ready,
    /// Takes no new slots (past max-age, drained or unhealthy); released once empty.
    Retiring,
    /// The provider is deleting the instance.
    Releasing,
    /// Deleted. Never stored: the seat key is deleted instead.
    Gone,
    /// Launch or agent failed; `failure` says why. The seat may be taken again.
    Failed,
}

impl BackingState {
    /// Whether the state machine allows going from `self` to `next`.
    pub fn can_become(self, next: BackingState) -> bool {
        use BackingState::*;
        matches!(
            (self, next),
            (Requested, Launching)
                | (Launching, Launching) // a retry
                | (Launching, Ready)
                | (Ready, Retiring)
                | (Ready, Releasing)
                | (Retiring, Releasing)
                | (Releasing, Gone)
                | (Releasing, Ready) // a slot was claimed before the agent closed: abort
                | (Requested | Launching | Ready | Retiring | Releasing, Failed)
                | (Failed, Releasing)
                | (Failed, Gone)
                | (Failed, Requested)
        )
    }

    /// Whether new slots may be handed out on a backing node in this state.
    pub fn takes_slots(self) -> bool {
        self == BackingState::Ready
    }
}

/// What an idle backing node does (set by operators).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IdleBehaviour {
    /// Normal: released after grace-time once empty.
    #[default]
    Run,
    /// No new slots; never released automatically.
    Hold,
    /// No new slots; released as soon as it is empty.
    Drain,
}

/// What the provider returned for a launched instance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Instance {
    /// The provider's id (a cloud instance id, a pid, a host name).
    pub id: String,
    /// Where slots are reached (host name or address).
    pub host: String,
    /// Provider-specific data kept for delete.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub data: serde_json::Value,
}

/// A VM or host carved into slots. Stored under its seat key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BackingNode {
    pub v: u32,
    pub id: BackingId,
    pub provider: String,
    pub pool: String,
    pub seat: u32,
    /// The label whose nodes it serves.
    pub label: String,
    /// What kind of machine it is (the provider's label/flavour): of a label with several
    /// sizes, the one the planner chose.
    pub backing_label: String,
    /// Slots it is carved into (its size's `max-parallel-jobs`).
    pub slots: u32,
    pub state: BackingState,
    #[serde(default)]
    pub idle: IdleBehaviour,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<Instance>,
    /// SHA-256 (hex) of the secret given to its agent at launch.
    pub secret_sha256: String,
    pub created_at: UnixMillis,
    /// When the current launch attempt started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launched_at: Option<UnixMillis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_at: Option<UnixMillis>,
    /// When its last slot was returned (grace-time counts from here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since: Option<UnixMillis>,
    /// Launch attempts made so far (attempts refused for capacity do not count).
    #[serde(default)]
    pub attempts: u32,
    /// The last launch attempt was refused because the provider is out of quota or
    /// capacity: the launcher tries again after a back-off, without counting the attempt.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub out_of_capacity: bool,
    /// The current launch attempt waits for its provider's create limits
    /// (`max-creates-per-second`, `max-concurrent-creates`) and has not reached the
    /// provider yet: a status hint, written before the wait and cleared with the
    /// attempt's end.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub create_queued: bool,
    /// Slots claimed on it so far, counted only for a label with `max-uses`: bumped by
    /// a revision-checked write before each claim, so that launchers claiming at once
    /// never hand out more than max-uses.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub uses: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    #[serde(default)]
    pub attributes: Attributes,
    /// The last operator order given for it (who, when, why). A `kill` order makes its
    /// launcher fail and delete it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<OperatorOrder>,
    /// The cloud took its machine back (its agent's [`Interruption`] notice): it failed
    /// for that, and its seat is taken again without a failed seat's rest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interruption: Option<Interruption>,
    pub updated_at: UnixMillis,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl BackingNode {
    /// Whether an operator ordered it killed.
    pub fn kill_ordered(&self) -> bool {
        self.order
            .as_ref()
            .is_some_and(|o| o.action == OperatorAction::Kill)
    }
}

/// What an operator can order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OperatorAction {
    /// No new slots; never released automatically.
    Hold,
    /// No new slots; released as soon as it is empty (grace-time ignored).
    Drain,
    /// Back to normal.
    Run,
    /// Terminate now: its slots fail, and their requestors see why.
    Kill,
    /// Release one slot (its node record goes away).
    ReleaseNode,
}

impl OperatorAction {
    pub const ALL: [OperatorAction; 5] = [
        OperatorAction::Hold,
        OperatorAction::Drain,
        OperatorAction::Run,
        OperatorAction::Kill,
        OperatorAction::ReleaseNode,
    ];

    /// The name used in subjects and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            OperatorAction::Hold => "hold",
            OperatorAction::Drain => "drain",
            OperatorAction::Run => "run",
            OperatorAction::Kill => "kill",
            OperatorAction::ReleaseNode => "release_node",
        }
    }

    /// The idle behaviour a backing-node order sets, if it sets one.
    pub fn idle(self) -> Option<IdleBehaviour> {
        match self {
            OperatorAction::Hold => Some(IdleBehaviour::Hold),
            OperatorAction::Drain => Some(IdleBehaviour::Drain),
            OperatorAction::Run => Some(IdleBehaviour::Run),
            OperatorAction::Kill | OperatorAction::ReleaseNode => None,
        }
    }
}

/// An operator's order, as recorded on the backing node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OperatorOrder {
    pub action: OperatorAction,
    /// Who gave it (as the operator's client says; NATS permissions say who may).
    pub actor: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub at: UnixMillis,
}

/// What an event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// An operator's order.
    Operator,
    /// A backing node changed state.
    Backing,
}

/// One entry of the event log (bucket `slotpool_events`, key = `id`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub v: u32,
    pub id: EventId,
    pub at: UnixMillis,
    pub kind: EventKind,
    /// The operator, or the launcher that made the change.
    pub actor: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing_id: Option<BackingId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<NodeId>,
    /// One line a human understands, e.g. "drain: rebooting the host (by alice)".
    pub message: String,
    /// A word to filter on, when the change has one: [`EVENT_REASON_LEAK`],
    /// [`SPOT_INTERRUPTION`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// [`Event::reason`] of the deletion of a machine no backing record owns.
pub const EVENT_REASON_LEAK: &str = "leak";

/// Health figures an agent reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Health {
    pub load1: f64,
    pub mem_total_kb: u64,
    pub mem_available_kb: u64,
    pub disk_total_kb: u64,
    pub disk_available_kb: u64,
    pub uptime_secs: u64,
    /// False when a health check fails; `reason` says which.
    pub healthy: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A slot the agent has prepared and not yet released.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlotReport {
    pub slot: u32,
    pub node_id: NodeId,
}

/// The TTL of an agent's heartbeat record unless it says otherwise
/// ([`AgentHeartbeat::ttl_secs`]); the agent's `--heartbeat-ttl-secs` default.
pub const DEFAULT_HEARTBEAT_TTL_SECS: u64 = 6;

/// A cloud's notice that it takes a backing node's machine back (an EC2 spot
/// interruption), as the node's agent read it (`slotpool-agent --spot-notice-url`).
/// Launchers place nothing more on the node, fail it and the nodes on its slots for a
/// [`SPOT_INTERRUPTION`], and take its seat again without a failed seat's rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interruption {
    /// What happens to the machine.
    pub action: InterruptionAction,
    /// When it happens, as the notice says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<UnixMillis>,
    /// When the agent read the notice.
    pub noticed_at: UnixMillis,
}

/// What the cloud does to an interrupted machine (EC2's `instance-action`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InterruptionAction {
    Terminate,
    Stop,
    Hibernate,
    /// An action this version does not know: the machine is taken back all the same.
    #[serde(other)]
    Other,
}

impl InterruptionAction {
    pub fn as_str(self) -> &'static str {
        match self {
            InterruptionAction::Terminate => "terminate",
            InterruptionAction::Stop => "stop",
            InterruptionAction::Hibernate => "hibernate",
            InterruptionAction::Other => "other",
        }
    }
}

/// Why a backing node whose machine the cloud takes back failed: its `failure` and that
/// of the nodes on its slots begin with it, and it is the [`Event::reason`] of the failure.
pub const SPOT_INTERRUPTION: &str = "spot interruption";

/// The longest reason for a dirty slot a heartbeat carries, in characters.
pub const DIRTY_REASON_MAX_CHARS: usize = 300;

/// An agent's heartbeat, written every few seconds with a TTL under its backing id.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AgentHeartbeat {
    pub v: u32,
    pub backing_id: BackingId,
    /// SHA-256 (hex) of the secret it was started with; must match the backing node's.
    pub secret_sha256: String,
    pub agent_version: String,
    pub hostname: String,
    pub pid: u32,
    pub started_at: UnixMillis,
    pub sent_at: UnixMillis,
    /// How long the record lives in KV unless written again, in seconds (older agents do
    /// not say: [`DEFAULT_HEARTBEAT_TTL_SECS`]). A launcher that was away from the bus
    /// waits this long, and a margin, for a heartbeat after it is back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_secs: Option<u64>,
    pub health: Health,
    #[serde(default)]
    pub slots: Vec<SlotReport>,
    /// True once the agent is shutting down.
    #[serde(default)]
    pub draining: bool,
    /// Slots that could not be cleaned: never handed out again until an operator acts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dirty_slots: Vec<u32>,
    /// Why each dirty slot is dirty, as the agent recorded it (at most
    /// [`DIRTY_REASON_MAX_CHARS`] characters each); older agents send none.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub dirty_reasons: BTreeMap<u32, String>,
    /// How slots are isolated (`users` or `none`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<String>,
    /// The SSH port slot users log in on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_port: Option<u16>,
    /// The host's SSH host public keys, one `<type> <base64>` line each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ssh_host_keys: Vec<String>,
    /// How the agent names a slot's workspace and user: what a prepare of the slot will
    /// answer. A launcher writes them into the node when it claims the slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot_names: Option<SlotNames>,
    /// The cloud is taking the machine back (an EC2 spot interruption notice); older
    /// agents never say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interruption: Option<Interruption>,
}

/// The workspace and user of every slot of an agent, as templates in which `{slot}`
/// stands for the slot index (`"/var/lib/slotpool/slots/{slot}"`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotNames {
    pub workspace: String,
    /// Only with user isolation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
}

impl SlotNames {
    /// The placeholder of the slot index in a template.
    pub const SLOT: &'static str = "{slot}";

    /// Slot `slot`'s workspace.
    pub fn workspace_of(&self, slot: u32) -> String {
        Self::expand(&self.workspace, slot)
    }

    /// Slot `slot`'s user, with user isolation.
    pub fn username_of(&self, slot: u32) -> Option<String> {
        self.username.as_deref().map(|t| Self::expand(t, slot))
    }

    fn expand(template: &str, slot: u32) -> String {
        template.replace(Self::SLOT, &slot.to_string())
    }
}

/// The part of an [`AgentHeartbeat`] that decides whether its backing node gets slots,
/// read straight from the JSON without copying: a launcher mirrors every heartbeat of
/// every agent (thousands a second), and almost none of them change this part.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct HeartbeatGist<'a> {
    #[serde(borrow)]
    pub backing_id: Cow<'a, str>,
    #[serde(borrow)]
    pub secret_sha256: Cow<'a, str>,
    pub health: HealthGist,
    #[serde(default)]
    pub ttl_secs: Option<u64>,
    #[serde(default)]
    pub draining: bool,
    #[serde(default)]
    pub dirty_slots: Vec<u32>,
    /// With `slot_names`, what a node claimed on this backing node says before its
    /// agent prepared it.
    #[serde(default)]
    pub ssh_port: Option<u16>,
    #[serde(default, borrow)]
    pub ssh_host_keys: Vec<Cow<'a, str>>,
    #[serde(default, borrow)]
    pub slot_names: Option<SlotNamesGist<'a>>,
    #[serde(default)]
    pub interruption: Option<Interruption>,
}

/// [`SlotNames`] as read by [`HeartbeatGist`], without copying.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct SlotNamesGist<'a> {
    #[serde(borrow)]
    pub workspace: Cow<'a, str>,
    #[serde(default, borrow)]
    pub username: Option<Cow<'a, str>>,
}

/// The verdict of a heartbeat's [`Health`].
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
pub struct HealthGist {
    pub healthy: bool,
}

impl<'a> HeartbeatGist<'a> {
    /// Reads the gist of a heartbeat record.
    pub fn from_json(bytes: &'a [u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// A launcher's claim on a piece of work; its KV revision is the fencing token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Lease {
    pub v: u32,
    pub holder: LauncherId,
    pub acquired_at: UnixMillis,
    /// When the holder last wrote the lease (taken or renewed), by its clock: how old the
    /// lease is, for an operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renewed_at: Option<UnixMillis>,
    /// When the holder's supervisor last finished a pass, as of the lease's last
    /// renewal: how an operator sees that a launcher still decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passed_at: Option<UnixMillis>,
}

/// Which provider call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderCall {
    Launch,
    Delete,
    List,
}

/// A provider's last error, in the leases bucket under
/// [`crate::layout::provider_status_key`]. Written
/// only when it changes: at each failure (the count goes up), and deleted at the next
/// success. Several launchers write it, last writer wins.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProviderStatus {
    pub v: u32,
    pub provider: String,
    /// The error, as the provider reported it (cut to [`ProviderStatus::MAX_ERROR`] bytes).
    pub error: String,
    pub call: ProviderCall,
    pub at: UnixMillis,
    /// Failures in a row, of any launcher, since the last success.
    pub failures: u32,
    /// Set when the provider refused a launch for capacity: seats ask again then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_until: Option<UnixMillis>,
    /// The launcher whose call failed.
    pub launcher: LauncherId,
}

impl ProviderStatus {
    /// The longest error text kept, in bytes.
    pub const MAX_ERROR: usize = 1024;
}

/// A revoked bus credential, in the leases bucket under
/// [`crate::layout::revocation_key`] (the user's nkey). Every credential of that key
/// issued at or before `revoked_at` is refused: by the NATS server, once a launcher has
/// pushed the account with its revocations (connections open are closed), and by the
/// launchers' HTTP API. Written by launchers only (an operator's `revoke` order, a
/// deleted backing node's agent); kept, with a TTL, until the last credential it covers
/// has expired, or for good when that is not known.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Revocation {
    pub v: u32,
    /// The user's public nkey.
    pub key: String,
    /// Who the credential was for (`client ci`, `agent bn-…`).
    pub user: String,
    /// Seconds since the epoch (JWT time): credentials issued until then are revoked.
    pub revoked_at: u64,
    /// Who revoked it: an operator's name, or `launcher <id>` for a deleted node's agent.
    pub by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// SHA-256 of a secret, as hex: what records carry instead of the secret itself.
pub fn secret_digest(secret: &str) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(secret.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backing_state_transitions_follow_the_diagram() {
        use BackingState::*;
        assert!(Requested.can_become(Launching));
        assert!(Ready.can_become(Retiring));
        assert!(Failed.can_become(Requested));
        assert!(!Ready.can_become(Requested));
        assert!(!Gone.can_become(Ready));
        assert!(
            Releasing.can_become(Ready),
            "a release aborted by a late claim"
        );
        assert!(!Releasing.can_become(Launching));
        assert!(Ready.takes_slots() && !Retiring.takes_slots());
    }

    #[test]
    fn request_json_is_stable() {
        let r = NodeRequest {
            v: 1,
            id: RequestId::parse("req-1").unwrap(),
            labels: vec!["small".into()],
            requestor: "ci".into(),
            priority: 100,
            timeout_secs: None,
            ssh_public_key: None,
            created_at: 5,
            state: RequestState::Requested,
            status: "queued".into(),
            nodes: vec![],
            failure: None,
            updated_at: 5,
            owner: None,
            nodes_released_at: None,
            keep_alive_secs: None,
            alive_until: None,
            fulfilled_at: None,
            hold_until: None,
            nodes_failed: Vec::new(),
            waiting: None,
            client: None,
        };
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(
            json,
            r#"{"v":1,"id":"req-1","labels":["small"],"requestor":"ci","priority":100,"created_at":5,"state":"requested","status":"queued","nodes":[],"updated_at":5}"#
        );
        assert_eq!(serde_json::from_str::<NodeRequest>(&json).unwrap(), r);
    }

    #[test]
    fn a_heartbeat_gist_reads_the_fields_that_decide_slots() {
        let mut hb = AgentHeartbeat {
            v: 1,
            backing_id: BackingId::parse("bn-1").unwrap(),
            secret_sha256: "abc".into(),
            agent_version: "1".into(),
            hostname: "h".into(),
            pid: 7,
            started_at: 1,
            sent_at: 2,
            ttl_secs: Some(6),
            health: Health {
                healthy: true,
                reason: Some("fine \"really\"".into()),
                ..Default::default()
            },
            slots: vec![SlotReport {
                slot: 1,
                node_id: NodeId::parse("node-x").unwrap(),
            }],
            draining: false,
            dirty_slots: vec![],
            dirty_reasons: BTreeMap::new(),
            isolation: Some("users".into()),
            ssh_port: Some(22),
            ssh_host_keys: vec!["ssh-ed25519 AAAA".into()],
            slot_names: Some(SlotNames {
                workspace: "/w/slots/{slot}".into(),
                username: Some("sp0a1b2c3ds{slot}".into()),
            }),
            interruption: None,
        };
        let json = serde_json::to_vec(&hb).unwrap();
        let gist = HeartbeatGist::from_json(&json).unwrap();
        assert_eq!(gist.backing_id, "bn-1");
        assert_eq!(gist.secret_sha256, "abc");
        assert!(gist.health.healthy && !gist.draining && gist.dirty_slots.is_empty());
        assert_eq!(gist.ssh_port, Some(22));
        assert_eq!(gist.ssh_host_keys, vec!["ssh-ed25519 AAAA"]);
        let names = gist.slot_names.as_ref().unwrap();
        assert_eq!(names.workspace, "/w/slots/{slot}");
        assert_eq!(names.username.as_deref(), Some("sp0a1b2c3ds{slot}"));

        hb.health.healthy = false;
        hb.draining = true;
        hb.dirty_slots = vec![0, 3];
        let json = serde_json::to_vec(&hb).unwrap();
        let gist = HeartbeatGist::from_json(&json).unwrap();
        assert!(!gist.health.healthy && gist.draining);
        assert_eq!(gist.dirty_slots, vec![0, 3]);
        assert_eq!(gist.interruption, None);

        let notice = Interruption {
            action: InterruptionAction::Terminate,
            at: Some(9_000),
            noticed_at: 7_000,
        };
        hb.interruption = Some(notice);
        let json = serde_json::to_vec(&hb).unwrap();
        assert_eq!(
            HeartbeatGist::from_json(&json).unwrap().interruption,
            Some(notice)
        );
    }

    #[test]
    fn an_interruption_action_this_version_does_not_know_still_reads() {
        let n: Interruption =
            serde_json::from_str(r#"{"action": "evaporate", "noticed_at": 1}"#).unwrap();
        assert_eq!(n.action, InterruptionAction::Other);
        assert_eq!(n.at, None);
        let json = serde_json::to_string(&Interruption {
            action: InterruptionAction::Stop,
            at: Some(2),
            noticed_at: 1,
        })
        .unwrap();
        assert_eq!(json, r#"{"action":"stop","at":2,"noticed_at":1}"#);
    }

    #[test]
    fn slot_names_put_the_slot_index_into_their_templates() {
        let names = SlotNames {
            workspace: "/w/slots/{slot}".into(),
            username: Some("sp0a1b2c3ds{slot}".into()),
        };
        assert_eq!(names.workspace_of(7), "/w/slots/7");
        assert_eq!(names.username_of(12).as_deref(), Some("sp0a1b2c3ds12"));
        let no_users = SlotNames {
            workspace: "/w/{slot}".into(),
            username: None,
        };
        assert_eq!(no_users.username_of(0), None);
    }
}

#[cfg(test)]
mod waiting_tests {
    use super::*;

    #[test]
    fn each_cause_keeps_its_time_across_changes() {
        let w = Waiting::next(None, WaitCause::Booting, 1_000);
        let w = Waiting::next(Some(&w), WaitCause::Booting, 3_000);
        assert_eq!(w.since, 1_000, "the same cause keeps its start");
        let w = Waiting::next(Some(&w), WaitCause::Behind, 4_000);
        let w = Waiting::next(Some(&w), WaitCause::Booting, 4_500);
        assert_eq!(w.held(WaitCause::Booting, 10_000), 3_000 + 5_500);
        assert_eq!(w.held(WaitCause::Behind, 10_000), 500);
        assert_eq!(w.summary(10_000), "booting 8.5s, behind 0.5s");
        let json = serde_json::to_value(&w).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"cause": "booting", "since": 4_500,
                               "held_ms": {"booting": 3_000, "behind": 500}})
        );
    }
}
