//! The request worker: one task per node request this launcher owns (`owner` in the
//! request; see [`crate::lease::Liveness`] for how ownership passes on). It
//! claims a slot for every label of the node set, has the agents prepare them, and marks
//! the request fulfilled — or failed, with a reason a human can act on.
//!
//! Resumable: everything it has done is in KV (slots name their request), so a worker
//! that takes a request over from a dead launcher adopts the slots already claimed.

use crate::nodes::{self, SlotError};
use crate::shared::{label_topic, request_topic, wait_for_change, Shared};
use crate::world::QueuePosition;
use slotpool_protocol::layout::{self, FINISHED_REQUEST_TTL_SECS};
use slotpool_protocol::model::{BackingState, Node, NodeRequest, NodeState, RequestState};
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::now_ms;
use slotpool_protocol::{NodeId, RequestId};
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Pause after a failed prepare before trying again, so a broken agent cannot make a
/// worker spin (the backing worker will fail the node if its agent is really gone).
const PREPARE_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// How long a request waits before its status says what it waits for (see
/// [`Worker::waiting_status`]).
pub const STATUS_DELAY: Duration = Duration::from_millis(250);

/// The work key of a request's worker ([`Shared::start_work`]).
fn work_key(id: &RequestId) -> String {
    format!("request.{id}")
}

/// Whether request `id` needs a worker of this launcher: it is open, nobody here drives
/// it, and it is this launcher's, or nobody's, or its owner's liveness lease is gone.
pub fn wants_driver(shared: &Shared, id: &RequestId) -> bool {
    let world = shared.world();
    let Some(req) = world.requests.get(id) else {
        return false;
    };
    !req.value.state.is_final()
        && !shared.is_working_on(&work_key(id))
        && req.value.owner.as_ref().is_none_or(|owner| {
            *owner == shared.id || world.lease(&layout::launcher_lease_key(owner)).is_none()
        })
}

/// Marks request `id` as driven by this process (before it exists, for a request being
/// created, so that no other worker starts on it meanwhile); false if it already is.
/// Follow with [`spawn_started`], or [`abandon`].
pub fn begin(shared: &Shared, id: &RequestId) -> bool {
    shared.start_work(&work_key(id))
}

/// Gives up a [`begin`] without starting a worker.
pub fn abandon(shared: &Shared, id: &RequestId) {
    shared.end_work(&work_key(id));
}

/// Starts a worker for `id` unless this process already has one. A request owned by
/// no live launcher is taken over first.
pub fn spawn(shared: &Arc<Shared>, id: RequestId) {
    if begin(shared, &id) {
        spawn_started(shared, id);
    }
}

/// Starts the worker of a request marked with [`begin`].
pub fn spawn_started(shared: &Arc<Shared>, id: RequestId) {
    let key = work_key(&id);
    let sh = shared.clone();
    let span = tracing::info_span!("request", request_id = %id);
    shared.spawn_task(
        async move {
            match take(&sh, &id).await {
                Ok(true) => drive(&sh, id).await,
                Ok(false) => tracing::debug!("another launcher drives this request"),
                Err(err) => tracing::warn!(%err, "cannot take the request over"),
            }
            sh.end_work(&key);
        }
        .instrument(span),
    );
}

/// Makes this launcher the request's owner unless a live launcher owns it (a
/// revision-checked write: of two launchers taking it over, one wins). True when it is
/// this launcher's to drive.
async fn take(sh: &Shared, id: &RequestId) -> Result<bool, KvError> {
    loop {
        let Some(req) = sh.world().requests.get(id).cloned() else {
            return Ok(false);
        };
        if req.value.state.is_final() {
            return Ok(false);
        }
        match &req.value.owner {
            Some(owner) if *owner == sh.id => return Ok(true),
            Some(owner)
                if sh
                    .world()
                    .lease(&layout::launcher_lease_key(owner))
                    .is_some() =>
            {
                return Ok(false)
            }
            _ => {}
        }
        let mut mine = req.value.clone();
        let previous = mine.owner.replace(sh.id.clone());
        mine.updated_at = now_ms();
        match sh
            .bus
            .requests
            .update(&req.key, &mine, req.revision, None)
            .await
        {
            Ok(revision) => {
                tracing::info!(previous_owner = ?previous, "took the request over");
                sh.world().put_request(Versioned {
                    key: req.key,
                    revision,
                    value: mine,
                });
                return Ok(true);
            }
            Err(KvError::Conflict { .. }) => match sh.bus.requests.get(&req.key).await? {
                Some(fresh) => sh.world().put_request(fresh),
                None => return Ok(false),
            },
            Err(err) => return Err(err),
        }
    }
}

async fn drive(sh: &Arc<Shared>, id: RequestId) {
    let worker = Worker {
        sh: sh.clone(),
        id,
        prepared: Mutex::default(),
    };
    let lost = sh.liveness.token();
    if let Err(err) = worker.run(&lost).await {
        tracing::warn!(%err, "request worker stopped; another pass will resume it");
    }
}

struct Worker {
    sh: Arc<Shared>,
    id: RequestId,
    /// The nodes this worker had their agents prepare. A node is claimed `ready` when
    /// its agent says ahead what the prepare will answer ([`nodes::claim`]), so the
    /// record alone does not say whether the agent has prepared it: a worker prepares
    /// every node it has not prepared itself (again, after a takeover: a prepare for the
    /// node already holding the slot changes nothing) before it fulfils the request.
    prepared: Mutex<HashSet<NodeId>>,
}

/// What one pass over the request found.
enum Pass {
    Done,
    /// Some labels could not get a slot yet.
    Waiting {
        missing: Vec<String>,
    },
    /// Something changed under us; look again at once.
    Again,
    /// A prepare failed; look again shortly.
    Pause,
}

impl Worker {
    /// Drives the request until it is final, taken over by another launcher, or `lost`
    /// (this launcher's liveness lease) is cancelled.
    async fn run(&self, lost: &CancellationToken) -> Result<(), SlotError> {
        let mut request_rx = self.sh.signals.subscribe(&request_topic(&self.id));
        let mut label_rxs = Vec::new();
        let mut subscribed: Vec<String> = Vec::new();
        let mut queued: Option<QueuePosition> = None;
        let mut waiting_since: Option<tokio::time::Instant> = None;
        let result = loop {
            if lost.is_cancelled() {
                break Ok(());
            }
            let Some(req) = self.sh.world().requests.get(&self.id).cloned() else {
                break Ok(());
            };
            if req.value.owner.as_ref() != Some(&self.sh.id) {
                tracing::info!(owner = ?req.value.owner, "taken over by another launcher");
                break Ok(());
            }
            let pos: QueuePosition = (req.value.priority, req.value.created_at, self.id.clone());
            // A pass may join the queue; whatever ends this worker, it leaves it.
            queued = Some(pos.clone());
            let pass = match self.pass(&req).await {
                Ok(p) => p,
                Err(SlotError::Kv(KvError::Conflict { .. })) => Pass::Again,
                Err(err) => break Err(err),
            };
            let still_missing = match &pass {
                Pass::Waiting { missing } => missing.clone(),
                _ => Vec::new(),
            };
            self.set_waiting(&pos, still_missing);
            match pass {
                Pass::Done => break Ok(()),
                Pass::Again => continue,
                Pass::Pause => {
                    tokio::select! {
                        _ = tokio::time::sleep(PREPARE_RETRY_PAUSE) => {}
                        _ = lost.cancelled() => {}
                    }
                }
                Pass::Waiting { missing } => {
                    if subscribed != missing {
                        label_rxs = missing
                            .iter()
                            .map(|l| self.sh.signals.subscribe(&label_topic(l)))
                            .collect();
                        subscribed = missing.clone();
                    }
                    // A short wait (a slot being wiped, a burst) is not worth a write:
                    // the status says what the request waits for once it has waited
                    // STATUS_DELAY.
                    let now = tokio::time::Instant::now();
                    let status_at = *waiting_since.get_or_insert(now) + STATUS_DELAY;
                    let mut wake_at = (now < status_at).then_some(status_at);
                    if wake_at.is_none() {
                        let status = self.waiting_status(&req.value, &missing);
                        if status != req.value.status {
                            match self.set_status(&req, status).await {
                                Ok(()) => {}
                                Err(SlotError::Kv(KvError::Conflict { .. })) => continue,
                                Err(err) => break Err(err),
                            }
                        }
                    }
                    if let Some(d) = req.value.deadline() {
                        let d = now + slotpool_protocol::time::until(d);
                        wake_at = Some(wake_at.map_or(d, |w| w.min(d)));
                    }
                    let deadline = wake_at;
                    let mut rxs = label_rxs.clone();
                    rxs.push(request_rx.clone());
                    for rx in rxs.iter_mut() {
                        rx.mark_unchanged();
                    }
                    // Re-check after subscribing so a change in between is not missed.
                    if self.could_progress(&pos) {
                        continue;
                    }
                    wait_for_change(&mut rxs, deadline, lost).await;
                    request_rx.mark_unchanged();
                }
            }
        };
        if let Some(pos) = queued {
            self.set_waiting(&pos, Vec::new());
        }
        result
    }

    /// Records what this request still waits for, and wakes the requests queued behind it
    /// for every label it no longer blocks.
    fn set_waiting(&self, pos: &QueuePosition, missing: Vec<String>) {
        let freed = self.sh.world().set_waiting(pos, missing);
        for label in freed {
            self.sh.signals.bump(&label_topic(&label));
        }
    }

    /// Whether a slot for any waiting label is free now (checked with the world lock).
    fn could_progress(&self, pos: &QueuePosition) -> bool {
        let mut world = self.sh.world();
        let labels = world.waiting.get(pos).cloned().unwrap_or_default();
        for label in labels {
            if let Some(slot) = world.reserve_slot(pos, &label) {
                world.unreserve(&slot);
                return true;
            }
        }
        false
    }

    /// One look at the request: finish, fail, or claim what can be claimed.
    async fn pass(&self, req: &Versioned<NodeRequest>) -> Result<Pass, SlotError> {
        let r = &req.value;
        if r.state.is_final() {
            self.release_strays(r).await;
            return Ok(Pass::Done);
        }
        if let Some(label) = r.labels.iter().find(|l| self.sh.config.sites(l).is_empty()) {
            let known = self.sh.config.label_names().join(", ");
            return self
                .fail(
                    req,
                    format!("unknown label {label:?}; this pool serves: {known}"),
                )
                .await;
        }
        if r.deadline().is_some_and(|d| now_ms() >= d) {
            let why = format!(
                "timed out after {}s: {}",
                r.timeout_secs.unwrap_or(0),
                r.status
            );
            return self.fail(req, why).await;
        }
        let pos: QueuePosition = (r.priority, r.created_at, r.id.clone());
        let mut have: BTreeMap<u32, Versioned<Node>> = BTreeMap::new();
        for node in self.sh.world().nodes_of(&r.id).into_iter().cloned() {
            have.insert(node.value.index, node);
        }
        let mut to_prepare = Vec::new();
        let mut unassigned = Vec::new();
        for (index, label) in r.labels.iter().enumerate() {
            let index = index as u32;
            match have.remove(&index) {
                Some(n) if self.has_prepared(&n.value) => {}
                Some(n) if matches!(n.value.state, NodeState::Ready | NodeState::Preparing) => {
                    to_prepare.push(n)
                }
                Some(n) => {
                    // Its backing node failed before the request was fulfilled: start over.
                    nodes::release(&self.sh, &n.key).await?;
                    return Ok(Pass::Again);
                }
                None => unassigned.push((index, label)),
            }
        }
        // Reserve what is free in one look, and leave the queue for those labels at once:
        // the requests behind this one need not wait for its claims and prepares.
        let (reserved, missing) = {
            let mut world = self.sh.world();
            let mut reserved = Vec::new();
            let mut missing = Vec::new();
            for (index, label) in unassigned {
                match world.reserve_slot(&pos, label) {
                    Some(slot) => reserved.push((index, slot)),
                    None => missing.push(label.clone()),
                }
            }
            (reserved, missing)
        };
        self.set_waiting(&pos, missing.clone());
        let claims = futures::future::join_all(
            reserved
                .iter()
                .map(|(index, slot)| nodes::claim(&self.sh, slot, r, *index)),
        )
        .await;
        let mut lost_race = false;
        {
            let mut world = self.sh.world();
            for (_, slot) in &reserved {
                world.unreserve(slot);
            }
            for claim in claims {
                match claim {
                    Ok(node) => {
                        world.put_slot(node.clone());
                        to_prepare.push(node);
                    }
                    Err(SlotError::Kv(KvError::Conflict { .. })) => lost_race = true,
                    Err(err) => return Err(err),
                }
            }
        }
        let prepared =
            futures::future::join_all(to_prepare.into_iter().map(|n| self.prepare(n, r))).await;
        for ok in prepared {
            if !ok? {
                return Ok(Pass::Pause);
            }
        }
        if lost_race {
            return Ok(Pass::Again);
        }
        if !missing.is_empty() {
            if let Some(why) = self.launch_failure(r, &missing) {
                return self.fail(req, why).await;
            }
            return Ok(Pass::Waiting { missing });
        }
        self.fulfil(req).await
    }

    /// Prepares a claimed node; false (after giving the slot back) when its agent failed.
    async fn prepare(&self, node: Versioned<Node>, r: &NodeRequest) -> Result<bool, SlotError> {
        let key = node.key.clone();
        match nodes::prepare(&self.sh, node, r.ssh_public_key.clone()).await {
            Ok(ready) => {
                self.prepared_set().insert(ready.value.id.clone());
                self.sh.world().put_slot(ready);
                Ok(true)
            }
            Err(SlotError::Agent { backing_id, source }) => {
                tracing::warn!(%backing_id, err = %source, "prepare failed; giving the slot back");
                nodes::release(&self.sh, &key).await?;
                Ok(false)
            }
            Err(err @ (SlotError::HostKey { .. } | SlotError::ForgedReply { .. })) => {
                tracing::warn!(%err, "giving the slot back");
                nodes::release(&self.sh, &key).await?;
                Ok(false)
            }
            Err(err) => Err(err),
        }
    }

    /// Whether `node` is ready and this worker had its agent prepare it.
    fn has_prepared(&self, node: &Node) -> bool {
        node.state == NodeState::Ready && self.prepared_set().contains(&node.id)
    }

    fn prepared_set(&self) -> std::sync::MutexGuard<'_, HashSet<NodeId>> {
        self.prepared.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn fulfil(&self, req: &Versioned<NodeRequest>) -> Result<Pass, SlotError> {
        let mut done = req.value.clone();
        let mut nodes: Vec<_> = self
            .sh
            .world()
            .nodes_of(&done.id)
            .into_iter()
            .filter(|n| self.has_prepared(&n.value))
            .map(|n| (n.value.index, n.value.id.clone()))
            .collect();
        nodes.sort();
        // One node per label; another claimed for the same index is a stray, released
        // by the sweep of claims left behind.
        nodes.dedup_by_key(|(index, _)| *index);
        done.nodes = nodes.into_iter().map(|(_, id)| id).collect();
        done.state = RequestState::Fulfilled;
        done.status = format!("fulfilled: {} node(s) ready", done.nodes.len());
        let (requestor, nodes) = (done.requestor.clone(), done.nodes.clone());
        self.finish(req, done).await?;
        tracing::info!(%requestor, ?nodes, "fulfilled");
        Ok(Pass::Done)
    }

    async fn fail(&self, req: &Versioned<NodeRequest>, reason: String) -> Result<Pass, SlotError> {
        tracing::info!(%reason, "request failed");
        let mut failed = req.value.clone();
        failed.state = RequestState::Failed;
        failed.status = format!("failed: {reason}");
        failed.failure = Some(reason);
        self.finish(req, failed).await?;
        self.release_strays(&req.value).await;
        Ok(Pass::Done)
    }

    /// Writes a final state: a failed or canceled request is kept for
    /// [`FINISHED_REQUEST_TTL_SECS`], a fulfilled one while its nodes are held (see
    /// [`crate::nodes::expire_when_released`]).
    async fn finish(
        &self,
        req: &Versioned<NodeRequest>,
        mut done: NodeRequest,
    ) -> Result<(), SlotError> {
        done.updated_at = now_ms();
        let ttl = (done.state != RequestState::Fulfilled)
            .then(|| Duration::from_secs(FINISHED_REQUEST_TTL_SECS));
        let revision = self
            .sh
            .bus
            .requests
            .update(&req.key, &done, req.revision, ttl)
            .await?;
        self.sh.world().put_request(Versioned {
            key: req.key.clone(),
            revision,
            value: done,
        });
        // A client waiting on this launcher's status call hears of the end now, from the
        // acknowledged write, not once the watch brings it back.
        self.sh.signals.bump(&request_topic(&req.value.id));
        Ok(())
    }

    async fn set_status(
        &self,
        req: &Versioned<NodeRequest>,
        status: String,
    ) -> Result<(), SlotError> {
        let mut r = req.value.clone();
        r.status = status;
        r.updated_at = now_ms();
        let revision = self
            .sh
            .bus
            .requests
            .update(&req.key, &r, req.revision, None)
            .await?;
        self.sh.world().put_request(Versioned {
            key: req.key.clone(),
            revision,
            value: r,
        });
        Ok(())
    }

    /// Gives back slots claimed for a request that ended without them.
    async fn release_strays(&self, r: &NodeRequest) {
        let strays: Vec<String> = self
            .sh
            .world()
            .nodes_of(&r.id)
            .into_iter()
            .filter(|n| r.state != RequestState::Fulfilled || !r.nodes.contains(&n.value.id))
            .map(|n| n.key.clone())
            .collect();
        for key in strays {
            if let Err(err) = nodes::release(&self.sh, &key).await {
                tracing::warn!(slot = %key, %err, "cannot release a slot of an ended request");
            }
        }
    }

    /// A reason to give up: a backing node launched for a missing label failed for good
    /// after this request was made, and nothing else is coming for it.
    fn launch_failure(&self, r: &NodeRequest, missing: &[String]) -> Option<String> {
        let world = self.sh.world();
        missing.iter().find_map(|label| {
            if world.coming_capacity(label) > 0 {
                return None;
            }
            world
                .backing
                .values()
                .map(|b| &b.value)
                .filter(|b| {
                    &b.label == label
                        && b.state == BackingState::Failed
                        && b.ready_at.is_none()
                        && b.updated_at >= r.created_at
                })
                .find_map(|b| {
                    b.failure.as_ref().map(|f| {
                        format!(
                            "could not launch a backing node of {} for label {label:?}: {f}",
                            b.backing_label
                        )
                    })
                })
        })
    }

    /// One line a human understands, saying what the request waits for.
    fn waiting_status(&self, r: &NodeRequest, missing: &[String]) -> String {
        let assigned = r.labels.len() - missing.len();
        let progress = format!("({assigned} of {} slots assigned)", r.labels.len());
        let world = self.sh.world();
        let label = &missing[0];
        let booting = world.backing.values().map(|b| &b.value).find(|b| {
            &b.label == label
                && matches!(b.state, BackingState::Requested | BackingState::Launching)
        });
        if let Some(b) = booting {
            if b.out_of_capacity {
                return format!(
                    "waiting for capacity: provider {} is out of capacity for {} ({}); asking again every {}s {progress}",
                    b.provider,
                    b.backing_label,
                    b.failure.as_deref().unwrap_or("no reason given"),
                    crate::lifecycle::CAPACITY_BACKOFF.as_secs()
                );
            }
            return format!(
                "waiting for a backing node of {} to boot {progress}",
                b.backing_label
            );
        }
        let full = self.sh.config.sites(label).iter().all(|s| {
            world.seats_of(&s.provider.name, &s.pool.name).len() as u32 >= s.pool.max_servers
        });
        if full {
            return format!("waiting for a free slot of {label}: every pool serving it is at max-servers {progress}");
        }
        format!("waiting for a free slot of {label} {progress}")
    }
}
