//! The request worker: one task per node request this launcher owns (`owner` in the
//! request; see [`crate::liveness::Liveness`] for how ownership passes on). It claims a
//! slot for every label of the node set, has the agents prepare them, and marks the
//! request fulfilled — or failed, with a reason a human can act on.
//!
//! Every decision is made in one place, the pure [`plan::next`]; [`observe`] gathers
//! what it needs, [`exec`] carries its steps out, and the worker loops over the three.
//! The submit fast path in [`crate::api`] asks the same plan for a request it creates.
//!
//! Resumable: everything it has done is in KV (slots name their request), so a worker
//! that takes a request over from a dead launcher adopts the slots already claimed.

pub(crate) mod exec;
#[cfg(test)]
mod model;
pub(crate) mod observe;
pub mod plan;
pub mod reference;
pub(crate) mod worker;

use crate::metrics;
use crate::nodes::SlotError;
use crate::shared::{Shared, Work};
use observe::Memory;
use plan::Ownership;
use slotpool_protocol::layout;
use slotpool_protocol::model::Lease;
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::now_ms;
use slotpool_protocol::RequestId;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// The work item of a request's worker ([`Shared::start_work`]).
fn work_key(id: &RequestId) -> Work {
    Work::Request(id.clone())
}

/// Whether request `id` needs a worker of this launcher: it is open, nobody here drives
/// it, and it is this launcher's, or nobody's, or its owner's liveness lease is gone.
pub fn wants_driver(shared: &Shared, id: &RequestId) -> bool {
    let world = shared.world();
    let Some(req) = world.requests.get(id) else {
        return false;
    };
    matches!(
        observe::ownership(&world, &shared.id, &req.value),
        Ownership::Mine | Ownership::TakeOver
    ) && !shared.is_working_on(&work_key(id))
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
    spawn_remembering(shared, id, Memory::default());
}

/// Starts the worker of a request marked with [`begin`], knowing what the submit fast
/// path already did for it (nodes prepared, a prepare refused, claims lost).
pub fn spawn_remembering(shared: &Arc<Shared>, id: RequestId, memory: Memory) {
    let key = work_key(&id);
    let sh = shared.clone();
    let span = tracing::info_span!("request", request_id = %id);
    shared.spawn_task(
        async move {
            match take(&sh, &id).await {
                Ok(true) => drive(&sh, id, memory).await,
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
        let ownership = observe::ownership(&sh.world(), &sh.id, &req.value);
        match ownership {
            Ownership::Mine => return Ok(true),
            Ownership::Ended | Ownership::Theirs => return Ok(false),
            Ownership::TakeOver => {}
        }
        if let Some(owner) = &req.value.owner {
            // The mirror says the owner's lease is gone. A watch re-created after a
            // leader change may have loaded from a replica that lags behind and let
            // the lease expire there while its launcher renews it with the leader:
            // the leader has the last word before a live launcher's request is taken.
            let key = layout::launcher_lease_key(owner);
            if sh
                .bus
                .leases
                .get_from_leader::<Lease>(&key)
                .await?
                .is_some()
            {
                tracing::info!(%owner, "the owner's lease stands at the bucket's leader; not taken over");
                return Ok(false);
            }
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
                if previous.is_some() {
                    metrics::lease_takeover();
                }
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

/// How long a request worker rides out bus errors, from the first, before it leaves the
/// request to another pass: beyond a bucket's leader election (nats-server starts one
/// 4–9 s after it last heard the dead leader, and it takes a few seconds more).
const WORKER_BUS_PATIENCE: Duration = Duration::from_secs(20);
/// The longest a worker waits after its first bus error for the bus to be back before
/// it tries again itself; it doubles after each, up to [`WORKER_RETRY_PAUSE_MAX`].
const WORKER_RETRY_PAUSE: Duration = Duration::from_millis(100);
const WORKER_RETRY_PAUSE_MAX: Duration = Duration::from_secs(1);

async fn drive(sh: &Arc<Shared>, id: RequestId, memory: Memory) {
    let mut lost = sh.liveness.token();
    let mut memory = memory;
    let mut first_bus_error: Option<tokio::time::Instant> = None;
    let mut pause = WORKER_RETRY_PAUSE;
    loop {
        // What the submit did counts for the first run only.
        match worker::run(sh, &id, &lost, std::mem::take(&mut memory)).await {
            // A write in flight when a bucket's leader died, or one sent while the bucket
            // elects another ("no stream found"): the bucket answers again once it has a
            // leader, and every write of the worker is revision-checked, so it goes on as
            // soon as the bus is back (re-reading what a conflict says changed) rather
            // than waiting for another pass.
            Err(SlotError::Kv(err @ (KvError::Timeout { .. } | KvError::Transport { .. })))
                if first_bus_error
                    .get_or_insert_with(tokio::time::Instant::now)
                    .elapsed()
                    < WORKER_BUS_PATIENCE =>
            {
                tracing::warn!(%err, at_most = ?pause, "request worker met a bus error; driving the request on once the bus is back");
                tokio::select! {
                    _ = sh.shutdown.cancelled() => return,
                    _ = crate::shared::bus_back(sh, &err, pause) => {}
                }
                pause = (pause * 2).min(WORKER_RETRY_PAUSE_MAX);
                continue;
            }
            Err(err) => {
                tracing::warn!(%err, "request worker stopped; another pass will resume it");
                return;
            }
            Ok(()) => {}
        }
        if !lost.is_cancelled() {
            return;
        }
        // The liveness lease was lost: go on as soon as it is taken again, if the request
        // is still this launcher's (another may have taken it over meanwhile).
        lost = tokio::select! {
            _ = sh.shutdown.cancelled() => return,
            token = sh.liveness.taken_again() => token,
        };
        match take(sh, &id).await {
            Ok(true) => tracing::info!("liveness lease taken again; driving the request on"),
            Ok(false) => return,
            Err(err) => {
                tracing::warn!(%err, "cannot take the request over");
                return;
            }
        }
    }
}
