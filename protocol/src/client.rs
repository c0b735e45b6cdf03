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
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

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

    /// One watch on the requests bucket that serves any number of waits: the efficient
    /// way to wait for many requests. [`Client::wait`] opens a watch (a JetStream
    /// consumer) per request, which costs a server round trip to set up and tear down
    /// and a consumer per waiting request; a CI system with many requests in flight
    /// should keep one `RequestWatcher` instead.
    pub async fn watcher(&self) -> Result<RequestWatcher, BusError> {
        RequestWatcher::start(self.clone()).await
    }

    /// Waits until each of `nodes` holds its slot no more: its release is finished (the
    /// agent wiped the slot and the slot record is deleted). A release is acknowledged
    /// once the node is marked `releasing`, before that. Event-driven (a KV watch on each
    /// slot key).
    pub async fn wait_released(&self, nodes: &[NodeId]) -> Result<(), BusError> {
        let bucket = self.bus.slots.bucket();
        for id in nodes {
            let Some((backing, slot)) = id.slot() else {
                continue;
            };
            let key = crate::layout::slot_key(&backing, slot);
            let mut changes = Box::pin(self.bus.slots.watch_keys(&key).await?);
            let mut holds = false;
            loop {
                match changes.next().await {
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
                            holds = &node.value.id == id;
                        }
                        Change::Removed { .. } => holds = false,
                        Change::Synced => {}
                    },
                }
                if !holds {
                    break;
                }
            }
        }
        Ok(())
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

type Waiters = Arc<Mutex<HashMap<RequestId, oneshot::Sender<Result<NodeRequest, KvError>>>>>;

/// Waits for many requests through one KV watch (see [`Client::watcher`]).
///
/// The watch delivers only changes made after it started, so a wait must be registered
/// before the request can change: [`RequestWatcher::submit_and_wait`] picks the request
/// id on the client side, registers it, and only then submits.
pub struct RequestWatcher {
    client: Client,
    waiters: Waiters,
    task: tokio::task::JoinHandle<()>,
}

impl RequestWatcher {
    async fn start(client: Client) -> Result<RequestWatcher, BusError> {
        let bucket = client.bus.requests.bucket();
        let changes = client.bus.requests.watch_new(">").await?;
        let waiters: Waiters = Arc::default();
        let w = waiters.clone();
        let task = tokio::spawn(async move {
            let mut changes = Box::pin(changes);
            while let Some(change) = changes.next().await {
                let (key, outcome) = match change {
                    Ok(Change::Put {
                        key,
                        revision,
                        value,
                    }) => match Change::decode::<NodeRequest>(bucket, &key, revision, &value) {
                        Ok(r) if r.value.state.is_final() => (key, Ok(r.value)),
                        Ok(_) => continue,
                        Err(err) => (key, Err(err)),
                    },
                    Ok(Change::Removed { key, .. }) => {
                        let err = KvError::NotFound {
                            bucket: bucket.to_string(),
                            key: key.clone(),
                        };
                        (key, Err(err))
                    }
                    Ok(Change::Synced) => continue,
                    Err(err) => {
                        tracing::warn!(%err, "request watch failed; pending waits end");
                        break;
                    }
                };
                let Ok(id) = RequestId::parse(&key) else {
                    continue;
                };
                let waiter = w.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                if let Some(tx) = waiter {
                    let _ = tx.send(outcome);
                }
            }
            // Dropping the senders ends every pending wait with an error.
            w.lock().unwrap_or_else(|p| p.into_inner()).clear();
        });
        Ok(RequestWatcher {
            client,
            waiters,
            task,
        })
    }

    /// Submits `req` (with an id chosen here unless it has one) and waits until it is
    /// fulfilled, failed or canceled.
    pub async fn submit_and_wait(&self, req: &SubmitRequest) -> Result<NodeRequest, BusError> {
        let mut req = req.clone();
        let id = req.id.get_or_insert_with(RequestId::generate).clone();
        let (tx, rx) = oneshot::channel();
        self.waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), tx);
        if let Err(err) = self.client.submit(&req).await {
            self.waiters
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
            return Err(err);
        }
        match rx.await {
            Ok(outcome) => Ok(outcome?),
            Err(_) => Err(BusError::Request {
                subject: id.to_string(),
                message: "request watch ended".into(),
            }),
        }
    }
}

impl Drop for RequestWatcher {
    fn drop(&mut self) {
        self.task.abort();
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
