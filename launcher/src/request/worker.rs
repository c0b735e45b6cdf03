//! The request worker's loop: look ([`observe::look`]), ask ([`plan::next`]), carry
//! the step out ([`exec::carry_out`]), and wait where the step says so, until the
//! request needs this worker no more.

use super::exec::{self, After};
use super::observe::{self, position, Memory};
use super::plan::{self, RequestStep};
use crate::nodes::SlotError;
use crate::shared::{label_topic, request_topic, wait_for_change, Shared};
use crate::world::{QueuePosition, World};
use slotpool_protocol::model::NodeRequest;
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::{now_ms, until, UnixMillis};
use slotpool_protocol::RequestId;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Drives request `id` until it is final, taken over by another launcher, or `lost`
/// (this launcher's liveness lease) is cancelled, starting from what `memory` holds.
pub async fn run(
    sh: &Arc<Shared>,
    id: &RequestId,
    lost: &CancellationToken,
    mut memory: Memory,
) -> Result<(), SlotError> {
    let mut request_rx = sh.signals.subscribe(&request_topic(id));
    let mut label_rxs = Vec::new();
    let mut subscribed: Vec<String> = Vec::new();
    let mut queued: Option<QueuePosition> = None;
    let result = loop {
        if lost.is_cancelled() {
            break Ok(());
        }
        let req = match current(sh, id).await {
            Ok(Some(req)) => req,
            Ok(None) => break Ok(()),
            Err(err) => break Err(err),
        };
        let pos = position(&req.value);
        let obs = observe::look(sh, &req.value, &memory);
        let step = plan::next(&req.value, &obs, now_ms());
        if !matches!(step, RequestStep::Claim { .. }) {
            observe::unreserve(sh, &obs);
        }
        // A step may join the queue; whatever ends this worker, it leaves it.
        if !matches!(step, RequestStep::Leave) {
            queued = Some(pos.clone());
        }
        let still_missing = step.missing().to_vec();
        let after = match exec::carry_out(sh, &req, step, &mut memory).await {
            Ok(after) => after,
            Err(SlotError::Kv(KvError::Conflict { .. })) => After::Again,
            Err(err) => break Err(err),
        };
        exec::set_waiting(sh, &pos, still_missing);
        match after {
            After::Stop => break Ok(()),
            After::Again => continue,
            After::Pause(at) => {
                tokio::select! {
                    _ = tokio::time::sleep(until(at)) => {}
                    _ = lost.cancelled() => {}
                }
            }
            After::Wait { missing, until: at } => {
                // A slot passed over after a lost claim may be tried again then.
                let at = match (at, memory.next_retry(now_ms())) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                if subscribed != missing {
                    label_rxs = missing
                        .iter()
                        .map(|l| sh.signals.subscribe(&label_topic(l)))
                        .collect();
                    subscribed = missing.clone();
                }
                let mut rxs = label_rxs.clone();
                rxs.push(request_rx.clone());
                for rx in rxs.iter_mut() {
                    rx.mark_unchanged();
                }
                // Re-check after subscribing so a change in between is not missed.
                if could_progress(sh, &pos, &memory) {
                    continue;
                }
                wait_for_change(&mut rxs, at.map(instant_of), lost).await;
                request_rx.mark_unchanged();
            }
        }
    };
    if let Some(pos) = queued {
        exec::set_waiting(sh, &pos, Vec::new());
    }
    result
}

/// The request as the mirror has it. A finished request has left the mirror; while
/// slots are still claimed for it, it is looked at once more (as this launcher saw it
/// finish, or from KV), so that [`plan::next`] gives those back at once.
async fn current(sh: &Shared, id: &RequestId) -> Result<Option<Versioned<NodeRequest>>, SlotError> {
    let (held, claims) = {
        let world = sh.world();
        let held = world
            .requests
            .get(id)
            .or_else(|| world.finished_at(id.as_str(), 0))
            .cloned();
        (held, !world.nodes_of(id).is_empty())
    };
    match held {
        Some(req) => Ok(Some(req)),
        None if claims => match sh.bus.requests.get::<NodeRequest>(id.as_str()).await {
            Ok(read) => Ok(read.filter(|r| r.value.is_finished())),
            // An unreadable record's claims are the sweep's.
            Err(KvError::Decode { .. }) => Ok(None),
            Err(err) => Err(err.into()),
        },
        None => Ok(None),
    }
}

/// The monotonic instant of wall-clock time `at`.
fn instant_of(at: UnixMillis) -> tokio::time::Instant {
    tokio::time::Instant::now() + until(at)
}

/// Whether a slot for any waiting label is free now (checked with the world lock),
/// other than those passed over after a lost claim.
fn could_progress(sh: &Shared, pos: &QueuePosition, memory: &Memory) -> bool {
    could_progress_in(&mut sh.world(), pos, memory, now_ms())
}

/// [`could_progress`] at `world`, at `now`.
pub(crate) fn could_progress_in(
    world: &mut World,
    pos: &QueuePosition,
    memory: &Memory,
    now: UnixMillis,
) -> bool {
    let labels = world.waiting.get(pos).cloned().unwrap_or_default();
    for label in labels {
        let lost = |key: &str| memory.lost_claims.get(key).is_some_and(|t| *t > now);
        if let Some(slot) = world.reserve_slot_avoiding(pos, &label, lost) {
            world.unreserve(&slot);
            return true;
        }
    }
    false
}
