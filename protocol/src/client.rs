//! The typed client: what `slotpool request`, CI systems and tests use.

use crate::api::{
    self, BackingOrder, CancelRequest, Canceled, OrderTaken, ReleaseNodeOrder, ReleaseNodes,
    Released, SubmitRequest, Submitted,
};
use crate::connect::{Bus, BusError, NatsOptions};
use crate::layout::subjects;
use crate::model::{AgentHeartbeat, BackingNode, Event, Node, NodeRequest, OperatorAction};
use crate::store::{Change, KvError, Versioned};
use crate::{BackingId, NodeId, RequestId};
use futures::StreamExt;
use std::time::Duration;

/// How long API calls wait for a launcher's answer.
pub const API_TIMEOUT: Duration = Duration::from_secs(10);

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

    /// Submits a node request; returns its id at once (it is fulfilled later).
    pub async fn submit(&self, req: &SubmitRequest) -> Result<RequestId, BusError> {
        let s: Submitted = self.bus.call(subjects::SUBMIT, req, API_TIMEOUT).await?;
        Ok(s.request_id)
    }

    /// The request's current record.
    pub async fn request(
        &self,
        id: &RequestId,
    ) -> Result<Option<Versioned<NodeRequest>>, BusError> {
        Ok(self.bus.requests.get(id.as_str()).await?)
    }

    /// Waits until the request is fulfilled, failed or canceled, calling `progress` with
    /// every change of it seen on the way. Event-driven (a KV watch on its key).
    pub async fn wait(
        &self,
        id: &RequestId,
        mut progress: impl FnMut(&NodeRequest),
    ) -> Result<NodeRequest, BusError> {
        let bucket = self.bus.requests.bucket();
        let mut changes = Box::pin(self.bus.requests.watch_keys(id.as_str()).await?);
        while let Some(change) = changes.next().await {
            match change? {
                Change::Put {
                    key,
                    revision,
                    value,
                } => {
                    let req: Versioned<NodeRequest> =
                        Change::decode(bucket, &key, revision, &value)?;
                    progress(&req.value);
                    if req.value.state.is_final() {
                        return Ok(req.value);
                    }
                }
                Change::Removed { key, .. } => {
                    return Err(KvError::NotFound {
                        bucket: bucket.to_string(),
                        key,
                    }
                    .into());
                }
                Change::Synced => {}
            }
        }
        Err(BusError::Request {
            subject: id.to_string(),
            message: "watch ended".into(),
        })
    }

    /// Returns nodes to the pool.
    pub async fn release(&self, nodes: Vec<crate::NodeId>) -> Result<Released, BusError> {
        let msg = ReleaseNodes {
            v: crate::PROTOCOL_VERSION,
            nodes,
        };
        self.bus.call(subjects::RELEASE, &msg, API_TIMEOUT).await
    }

    /// Cancels a request that is still waiting.
    pub async fn cancel(&self, request_id: RequestId) -> Result<Canceled, BusError> {
        let msg = CancelRequest {
            v: crate::PROTOCOL_VERSION,
            request_id,
        };
        self.bus.call(subjects::CANCEL, &msg, API_TIMEOUT).await
    }

    /// An operator's order on a backing node: hold, drain, run or kill (`action` must be
    /// one of those; [`OperatorAction::ReleaseNode`] goes through [`Client::release_node`]).
    pub async fn order(
        &self,
        action: OperatorAction,
        backing_id: BackingId,
        actor: impl Into<String>,
        reason: Option<String>,
    ) -> Result<OrderTaken, BusError> {
        let msg = BackingOrder {
            v: crate::PROTOCOL_VERSION,
            backing_id,
            actor: actor.into(),
            reason,
        };
        self.bus
            .call(&subjects::admin(action), &msg, API_TIMEOUT)
            .await
    }

    /// An operator releases one node (slot), whoever holds it.
    pub async fn release_node(
        &self,
        node_id: NodeId,
        actor: impl Into<String>,
        reason: Option<String>,
    ) -> Result<Released, BusError> {
        let msg = ReleaseNodeOrder {
            v: crate::PROTOCOL_VERSION,
            node_id,
            actor: actor.into(),
            reason,
        };
        self.bus
            .call(
                &subjects::admin(OperatorAction::ReleaseNode),
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

    pub async fn list_agents(&self) -> Result<Vec<AgentHeartbeat>, BusError> {
        Ok(values(self.bus.agents.list().await?))
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
    }
}

/// Who the local user is, for recording operators' orders: `user@host`.
pub fn default_actor() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    if host.is_empty() {
        user
    } else {
        format!("{user}@{host}")
    }
}

pub use api::Reply;
