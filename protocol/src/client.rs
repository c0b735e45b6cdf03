//! The typed client: what `slotpool request`, CI systems and tests use.

use crate::api::{
    self, ApiError, BackingOrder, CancelRequest, Canceled, ErrorCode, KeepAlive, KeptAlive,
    LogTail, LogTailQuery, NodesQuery, OrderTaken, ReleaseNodeOrder, ReleaseNodes, Released,
    RequestStatus, SlotOccupants, SlotOccupantsQuery, StillHeld, SubmitRequest, Submitted,
    WaitReleased,
};
use crate::connect::{Bus, BusError, NatsOptions};
use crate::layout;
use crate::layout::subjects::{self, ApiOp};
use crate::model::{
    AgentHeartbeat, BackingNode, Event, Node, NodeRequest, OperatorAction, ProviderStatus,
};
use crate::store::{KvError, Versioned};
use crate::{BackingId, NodeId, RequestId, UserName};
use std::time::Duration;

/// How long API calls wait for a launcher's answer.
pub const API_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a call waits for a launcher's answer (past the wait it asked for, if any)
/// before it sends the same message again, beside the first; each further wait is
/// twice as long, within [`API_TIMEOUT`]. A message or a reply lost with a server that
/// died costs this, not [`API_TIMEOUT`]. Every operation sent this way is answered
/// alike when it comes twice (docs/protocol.md, "Sending a call again").
pub const API_RESEND: Duration = Duration::from_secs(1);
/// How often a read is sent again while no launcher answers.
const RETRY_INTERVAL: Duration = Duration::from_millis(100);
/// How long one status or wait_released call is held open: a launcher killed while it
/// holds the call costs a waiting client at most this plus [`REPLY_MARGIN`].
const WAIT_SLICE: Duration = Duration::from_secs(3);
/// How much longer than the wait it asked for a client gives a launcher to answer.
const REPLY_MARGIN: Duration = Duration::from_secs(2);

/// A slotpool client on one NATS connection.
#[derive(Clone)]
pub struct Client {
    bus: Bus,
}

impl Client {
    pub async fn connect(opts: &NatsOptions) -> Result<Client, BusError> {
        Ok(Client {
            bus: Bus::connect(opts).await?,
        })
    }

    pub fn from_bus(bus: Bus) -> Client {
        Client { bus }
    }

    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// Submits a node request; returns its id at once (it is fulfilled later). The
    /// request gets an id of the client's if it has none, so that the submit may be sent
    /// again while no launcher answered.
    pub async fn submit(&self, req: &SubmitRequest) -> Result<RequestId, BusError> {
        let mut req = req.clone();
        req.id.get_or_insert_with(RequestId::generate);
        let s: Submitted = self.call(ApiOp::Submit, &req).await?;
        Ok(s.request_id)
    }

    /// Submits `req` and waits until the request is fulfilled, failed or canceled. The
    /// submit itself is held open until the request ends (or [`WAIT_SLICE`] has passed,
    /// and [`Client::wait`] follows it from there), so a request served at once costs one
    /// call, not a submit and a `status`. The request gets an id of the client's if it
    /// has none, so that sending the submit again (no launcher answered in time) is safe.
    pub async fn submit_and_wait(&self, req: &SubmitRequest) -> Result<NodeRequest, BusError> {
        let mut req = req.clone();
        let id = req.id.get_or_insert_with(RequestId::generate).clone();
        req.wait_ms = Some(WAIT_SLICE.as_millis() as u64);
        let submitted: Submitted = self.call_read(ApiOp::Submit, &req, WAIT_SLICE).await?;
        match submitted.request {
            Some(r) if r.state.is_final() => Ok(*r),
            _ => self.wait(&id, |_| {}).await,
        }
    }

    /// Renews the keep-alive of request `id` (submitted with `keep_alive_secs`) for
    /// another period from now. An [`ErrorCode::Ended`] error says the request is over
    /// (its keep-alive lapsed, or it failed, was canceled or its nodes were released):
    /// stop renewing.
    pub async fn keep_alive(&self, id: &RequestId) -> Result<KeptAlive, BusError> {
        let msg = KeepAlive {
            v: crate::PROTOCOL_VERSION,
            request_id: id.clone(),
        };
        self.call(ApiOp::KeepAlive, &msg).await
    }

    /// The name this client acts under (its bus user's).
    pub fn name(&self) -> &UserName {
        &self.bus.user().name
    }

    /// Sends `msg` on the caller's API subject for `op`, again after [`API_RESEND`] (then
    /// twice that, and so on) while no launcher answered, for up to [`API_TIMEOUT`].
    async fn call<Q: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        op: ApiOp,
        msg: &Q,
    ) -> Result<R, BusError> {
        self.bus
            .call_resending(
                &subjects::api(self.name(), op),
                msg,
                API_TIMEOUT,
                API_RESEND,
            )
            .await
    }

    /// Like `call`, for reads that are safe to repeat, held open by the launcher for up
    /// to `wait`: each attempt gets `wait` + [`REPLY_MARGIN`] for its answer, sent again
    /// beside it after `wait` + [`API_RESEND`] (then as `call` does), and while no
    /// launcher answers (one died holding the call, or all are restarting) the read is
    /// sent again, for up to `wait` + [`API_TIMEOUT`] in all.
    async fn call_read<Q: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        op: ApiOp,
        msg: &Q,
        wait: Duration,
    ) -> Result<R, BusError> {
        let subject = subjects::api(self.name(), op);
        let deadline = tokio::time::Instant::now() + wait + API_TIMEOUT;
        loop {
            let resent =
                self.bus
                    .call_resending(&subject, msg, wait + REPLY_MARGIN, wait + API_RESEND);
            match resent.await {
                Err(BusError::NoResponders { .. } | BusError::Timeout { .. })
                    if tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(RETRY_INTERVAL).await;
                }
                other => return other,
            }
        }
    }

    /// The request as a launcher sees it now; with `wait`, as soon as it is final or
    /// `wait` (at most [`api::MAX_WAIT_MS`]) has passed. `None`: no such request of
    /// this client's.
    async fn status(
        &self,
        id: &RequestId,
        wait: Duration,
    ) -> Result<Option<NodeRequest>, BusError> {
        let wait = wait.min(Duration::from_millis(api::MAX_WAIT_MS));
        let msg = RequestStatus {
            v: crate::PROTOCOL_VERSION,
            request_id: id.clone(),
            wait_ms: wait.as_millis() as u64,
        };
        match self.call_read(ApiOp::Status, &msg, wait).await {
            Ok(r) => Ok(Some(r)),
            Err(BusError::Api(ApiError {
                code: ErrorCode::NotFound,
                ..
            })) => Ok(None),
            Err(err) => Err(err),
        }
    }

    /// The request's current record (this client's own requests only).
    pub async fn request(&self, id: &RequestId) -> Result<Option<NodeRequest>, BusError> {
        self.status(id, Duration::ZERO).await
    }

    /// Waits until the request is fulfilled, failed or canceled, calling `progress` with
    /// every state of it seen on the way. A launcher answers each call as soon as the
    /// request ends (or after [`api::MAX_WAIT_MS`], and the wait asks again), so no
    /// polling interval adds to the wait.
    pub async fn wait(
        &self,
        id: &RequestId,
        mut progress: impl FnMut(&NodeRequest),
    ) -> Result<NodeRequest, BusError> {
        let mut last = None;
        loop {
            let req = match self.status(id, WAIT_SLICE).await {
                Ok(req) => req,
                // No launcher answered for a while: the request lives on in KV; ask again.
                Err(BusError::NoResponders { .. } | BusError::Timeout { .. }) => continue,
                Err(err) => return Err(err),
            };
            let Some(req) = req else {
                return Err(BusError::Api(ApiError::new(
                    ErrorCode::NotFound,
                    format!("no request {id} of {}", self.name()),
                )));
            };
            if last.as_ref() != Some(&(req.state, req.status.clone())) {
                progress(&req);
                last = Some((req.state, req.status.clone()));
            }
            if req.state.is_final() {
                return Ok(req);
            }
        }
    }

    /// A helper for waiting on many requests (see [`RequestWatcher`]).
    pub async fn watcher(&self) -> Result<RequestWatcher, BusError> {
        Ok(RequestWatcher {
            client: self.clone(),
        })
    }

    /// Waits until each of `nodes` holds its slot no more: its release is finished (the
    /// agent wiped the slot and the slot record is deleted). A release is acknowledged
    /// once the node is marked `releasing`, before that.
    pub async fn wait_released(&self, nodes: &[NodeId]) -> Result<(), BusError> {
        self.wait_held(nodes, false).await
    }

    /// Waits until `node` is no longer ready (releasing, failed, gone): a command
    /// running in it has lost its node. Answered by the launchers as the node changes,
    /// not polled.
    pub async fn wait_not_ready(&self, node: &NodeId) -> Result<(), BusError> {
        self.wait_held(std::slice::from_ref(node), true).await
    }

    async fn wait_held(&self, nodes: &[NodeId], until_not_ready: bool) -> Result<(), BusError> {
        let mut held = nodes.to_vec();
        while !held.is_empty() {
            let msg = WaitReleased {
                v: crate::PROTOCOL_VERSION,
                nodes: held.clone(),
                wait_ms: WAIT_SLICE.as_millis() as u64,
                until_not_ready,
            };
            match self.call_read(ApiOp::WaitReleased, &msg, WAIT_SLICE).await {
                Ok(StillHeld { held: still }) => held = still,
                Err(BusError::NoResponders { .. } | BusError::Timeout { .. }) => continue,
                Err(err) => return Err(err),
            }
        }
        Ok(())
    }

    /// Like [`Client::wait_released`], for operators (whose users may read the slots
    /// bucket): waits on a KV watch of each slot key, for nodes of any client.
    pub async fn watch_released(&self, nodes: &[NodeId]) -> Result<(), BusError> {
        use crate::store::Change;
        use futures::StreamExt;
        let bucket = self.bus.slots.bucket();
        for id in nodes {
            let Some((backing, slot)) = id.slot() else {
                continue;
            };
            let key = layout::slot_key(&backing, slot);
            let mut changes = Box::pin(self.bus.slots.watch_keys(&key).await?);
            loop {
                let holds = match changes.next().await {
                    None => {
                        return Err(BusError::Request {
                            subject: key,
                            message: "watch ended".into(),
                        })
                    }
                    Some(change) => match change? {
                        Change::Put {
                            key,
                            revision,
                            value,
                        } => {
                            let node: Versioned<Node> =
                                Change::decode(bucket, &key, revision, &value)?;
                            &node.value.id == id
                        }
                        Change::Removed { .. } => false,
                        Change::Synced => continue,
                    },
                };
                if !holds {
                    break;
                }
            }
        }
        Ok(())
    }

    /// The records of this client's `nodes` (host, workspace, login), in that order;
    /// those that hold no slot any more are left out.
    pub async fn nodes(&self, nodes: &[NodeId]) -> Result<Vec<Node>, BusError> {
        let msg = NodesQuery {
            v: crate::PROTOCOL_VERSION,
            nodes: nodes.to_vec(),
        };
        self.call_read(ApiOp::Nodes, &msg, Duration::ZERO).await
    }

    /// Returns nodes to the pool.
    pub async fn release(&self, nodes: Vec<NodeId>) -> Result<Released, BusError> {
        let msg = ReleaseNodes {
            v: crate::PROTOCOL_VERSION,
            nodes,
        };
        self.call(ApiOp::Release, &msg).await
    }

    /// Cancels a request that is still waiting.
    pub async fn cancel(&self, request_id: RequestId) -> Result<Canceled, BusError> {
        let msg = CancelRequest {
            v: crate::PROTOCOL_VERSION,
            request_id,
        };
        self.call(ApiOp::Cancel, &msg).await
    }

    /// An operator's order on a backing node: hold, drain, run or kill (`action` must be
    /// one of those; [`OperatorAction::ReleaseNode`] goes through [`Client::release_node`]).
    pub async fn order(
        &self,
        action: OperatorAction,
        backing_id: BackingId,
        reason: Option<String>,
    ) -> Result<OrderTaken, BusError> {
        let msg = BackingOrder {
            v: crate::PROTOCOL_VERSION,
            backing_id,
            actor: String::new(),
            reason,
        };
        self.bus
            .call(&subjects::admin(self.name(), action), &msg, API_TIMEOUT)
            .await
    }

    /// Revokes every credential of `user` issued until now (operators only): answered
    /// once the NATS server holds the revocation.
    pub async fn revoke(
        &self,
        user: &crate::auth::BusUser,
        reason: Option<String>,
    ) -> Result<api::RevokeTaken, BusError> {
        let msg = api::RevokeOrder {
            v: crate::PROTOCOL_VERSION,
            role: user.role,
            name: user.name.clone(),
            reason,
        };
        // The launcher waits for the server to take it (up to 10 s) before answering.
        self.bus
            .call(&subjects::revoke(self.name()), &msg, API_TIMEOUT * 3)
            .await
    }

    /// Who is in slot `slot` of backing node `backing` (operators only): the launcher
    /// asks the node's agent.
    pub async fn slot_occupants(
        &self,
        backing: &BackingId,
        slot: u32,
    ) -> Result<SlotOccupants, BusError> {
        let q = SlotOccupantsQuery {
            v: crate::PROTOCOL_VERSION,
            backing_id: backing.clone(),
            slot,
        };
        self.bus
            .call(&subjects::slot_occupants(self.name()), &q, API_TIMEOUT)
            .await
    }

    /// The newest `lines` lines of backing node `backing`'s agent log (operators only):
    /// the launcher asks the node's agent.
    pub async fn log_tail(&self, backing: &BackingId, lines: u32) -> Result<LogTail, BusError> {
        let q = LogTailQuery {
            v: crate::PROTOCOL_VERSION,
            backing_id: backing.clone(),
            lines,
        };
        self.bus
            .call(&subjects::log_tail(self.name()), &q, API_TIMEOUT)
            .await
    }

    /// An operator releases one node (slot), whoever holds it.
    pub async fn release_node(
        &self,
        node_id: NodeId,
        reason: Option<String>,
    ) -> Result<Released, BusError> {
        let msg = ReleaseNodeOrder {
            v: crate::PROTOCOL_VERSION,
            node_id,
            actor: String::new(),
            reason,
        };
        self.bus
            .call(
                &subjects::admin(self.name(), OperatorAction::ReleaseNode),
                &msg,
                API_TIMEOUT,
            )
            .await
    }

    pub async fn list_events(&self) -> Result<Vec<Event>, BusError> {
        let mut events = values(self.bus.events.list().await?);
        events.sort_by(|a: &Event, b| a.id.cmp(&b.id));
        Ok(events)
    }

    pub async fn list_requests(&self) -> Result<Vec<NodeRequest>, BusError> {
        Ok(values(self.bus.requests.list().await?))
    }

    pub async fn list_nodes(&self) -> Result<Vec<Node>, BusError> {
        Ok(values(self.bus.slots.list().await?))
    }

    pub async fn list_backing(&self) -> Result<Vec<BackingNode>, BusError> {
        Ok(values(self.bus.backing.list().await?))
    }

    /// Each provider's last error, for those whose last call failed.
    pub async fn list_providers(&self) -> Result<Vec<ProviderStatus>, BusError> {
        Ok(values(
            self.bus
                .leases
                .list_keys(layout::PROVIDER_STATUS_KEYS)
                .await?,
        ))
    }

    pub async fn list_agents(&self) -> Result<Vec<AgentHeartbeat>, BusError> {
        Ok(values(self.bus.agents.list().await?))
    }
}

/// Waits for many requests of one client at once (the benchmark's and the demo's load):
/// each wait is a [`Client::wait`], answered by a launcher as soon as its request ends.
pub struct RequestWatcher {
    client: Client,
}

impl RequestWatcher {
    /// Submits `req` (with an id chosen here unless it has one) and waits until it is
    /// fulfilled, failed or canceled.
    pub async fn submit_and_wait(&self, req: &SubmitRequest) -> Result<NodeRequest, BusError> {
        self.client.submit_and_wait(req).await
    }
}

/// Keeps the decodable values; a record this client cannot read (a newer version, say) is
/// skipped with a warning rather than hiding all the others.
fn values<T>(items: Vec<Result<Versioned<T>, KvError>>) -> Vec<T> {
    items
        .into_iter()
        .filter_map(|r| {
            r.map_err(|err| tracing::warn!(%err, "skipping record"))
                .ok()
        })
        .map(|v| v.value)
        .collect()
}

/// A submission with the defaults filled in, for callers that only know labels.
pub fn submission(labels: Vec<String>, requestor: impl Into<String>) -> SubmitRequest {
    SubmitRequest {
        v: crate::PROTOCOL_VERSION,
        id: None,
        labels,
        requestor: requestor.into(),
        priority: None,
        timeout_secs: None,
        ssh_public_key: None,
        keep_alive_secs: None,
        wait_ms: None,
    }
}

pub use api::Reply;
