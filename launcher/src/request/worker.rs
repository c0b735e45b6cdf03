//! The request worker's loop: look ([`observe::look`]), ask ([`plan::next`]), carry
//! the step out ([`exec::carry_out`]), and wait where the step says so, until the
//! request needs this worker no more.

use super::exec::{self, After};
use super::observe::{self, Memory};
use super::plan::{self, RequestStep};
use crate::metrics;
use crate::nodes::SlotError;
use crate::shared::{request_topic, wait_for_change, Shared};
use slotpool_protocol::model::NodeRequest;
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::{now_ms, until, UnixMillis};
use slotpool_protocol::RequestId;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Steps a worker may take in a row without waiting before it counts as spinning: it
/// is logged, counted (`slotpool_request_worker_spins_total`) and paused for
/// [`SPIN_PAUSE`]. A step that does not wait wrote something (a claim, a prepare, a
/// release, a lost claim's retry); a request needs a handful.
pub const STEP_BOUND: u32 = 200;

/// How many of a spin's last steps its warning shows, each with the request's revision
/// and state as the worker saw them and what came of the step.
const SPIN_STEPS_SHOWN: u32 = 3;

/// How long a spinning worker pauses.
const SPIN_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// Drives request `id` until it is final, taken over by another launcher, or `lost`
/// (this launcher's liveness lease) is cancelled, starting from what `memory` holds.
///
/// Each step looks, asks and carries out once; a step that waits sleeps until its
/// request's topic is bumped (the request changed, or a slot it could claim now freed:
/// [`crate::shared::WorldGuard`]) or its deadline comes. It never looks again on its
/// own: a request that cannot progress costs nothing until something changes for it.
pub async fn run(
    sh: &Arc<Shared>,
    id: &RequestId,
    lost: &CancellationToken,
    mut memory: Memory,
) -> Result<(), SlotError> {
    let mut request_rx = sh.signals.subscribe(&request_topic(id));
    let mut steps = 0u32;
    // The last steps of a run without waiting, for the warning a spin logs.
    let mut last_steps: Vec<String> = Vec::new();
    loop {
        if lost.is_cancelled() {
            return Ok(());
        }
        // From here on, a change that concerns the request wakes it, so the wait below
        // never sleeps through what the look misses.
        request_rx.mark_unchanged();
        steps += 1;
        if steps > STEP_BOUND {
            metrics::worker_spin();
            tracing::warn!(
                steps = STEP_BOUND,
                last_steps = ?last_steps,
                "request worker took its steps without waiting; pausing"
            );
            steps = 0;
            last_steps.clear();
            tokio::select! {
                _ = tokio::time::sleep(SPIN_PAUSE) => {}
                _ = lost.cancelled() => return Ok(()),
            }
        }
        // A worker that never waits still lets the others run.
        tokio::task::consume_budget().await;
        let req = match current(sh, id).await? {
            Some(req) => req,
            None => return Ok(()),
        };
        let obs = observe::look(sh, &req.value, &memory);
        let step = plan::next(&req.value, &obs, now_ms());
        let shown = (steps + SPIN_STEPS_SHOWN > STEP_BOUND)
            .then(|| format!("rev {} {:?}: {step:?}", req.revision, req.value.state));
        if !matches!(step, RequestStep::Claim { .. }) {
            observe::unreserve(sh, &obs);
        }
        let outcome = exec::carry_out(sh, &req, step, &mut memory).await;
        if let Some(shown) = shown {
            last_steps.push(match &outcome {
                Ok(after) => format!("{shown} -> {after:?}"),
                Err(err) => format!("{shown} -> {err}"),
            });
        }
        let after = match outcome {
            Ok(after) => after,
            Err(SlotError::Kv(KvError::Conflict { .. })) => After::Again,
            Err(err) => return Err(err),
        };
        match after {
            After::Stop => return Ok(()),
            After::Again => continue,
            After::Pause(at) => {
                steps = 0;
                last_steps.clear();
                tokio::select! {
                    _ = tokio::time::sleep(until(at)) => {}
                    _ = lost.cancelled() => {}
                }
            }
            After::Wait { until: at } => {
                steps = 0;
                last_steps.clear();
                // A slot passed over after a lost claim may be tried again then.
                let at = match (at, memory.next_retry(now_ms())) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                wait_for_change(
                    std::slice::from_mut(&mut request_rx),
                    at.map(instant_of),
                    lost,
                )
                .await;
            }
        }
    }
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
