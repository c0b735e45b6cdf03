//! The backing side, built like the request side (`request/`): [`lifecycle`] is the one
//! place a backing node's decisions are made (a pure `next(&BackingNode, &Observed) ->
//! Step`, and what a launch attempt writes and means); `observe` takes one look at the
//! mirror, `exec` carries the steps out, `worker` loops over the three under the
//! seat's lease. [`planner`] takes seats for unmet demand, [`leak`] deletes machines no
//! backing record owns. This module starts workers and says, from the mirror alone,
//! whether a backing node needs one now ([`due`]).

mod exec;
pub mod leak;
pub mod lifecycle;
mod observe;
pub mod planner;
mod worker;

use crate::lease;
use crate::shared::{Shared, Work};
use lifecycle::Step;
use observe::observe;
use slotpool_protocol::layout;
use std::sync::Arc;
use tracing::Instrument;
use worker::Worker;

/// Starts a worker for the seat `seat_key` unless this process already has one.
pub fn spawn(shared: &Arc<Shared>, seat_key: String) {
    let key = layout::backing_lease_key(&seat_key);
    let work = Work::Seat(seat_key.clone());
    if !shared.start_work(&work) {
        return;
    }
    let sh = shared.clone();
    let backing_id = sh
        .world()
        .backing
        .get(&seat_key)
        .map(|b| b.value.id.to_string())
        .unwrap_or_default();
    let span = tracing::info_span!("backing", seat = %seat_key, backing_id = %backing_id);
    shared.tracker.spawn(
        async move {
            let mut let_go = false;
            match lease::acquire(&sh, &key).await {
                Ok(Some(lease)) => {
                    let_go = Worker::new(sh.clone(), seat_key.clone()).run(&lease).await;
                    lease.release().await;
                }
                Ok(None) => tracing::debug!("another launcher drives this backing node"),
                Err(err) => tracing::warn!(%err, "cannot take the backing node's lease"),
            }
            sh.end_work(&work);
            // A change that came while this worker was letting go found it still
            // registered and was dropped: look once more now that it is gone.
            if let_go && !sh.shutdown.is_cancelled() && due(&sh, &seat_key) == Due::Now {
                spawn(&sh, seat_key);
            }
        }
        .instrument(span),
    );
}

/// Whether a backing node needs a worker, judged from the mirror without a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Due {
    /// A step is due now or within the lease TTL.
    Now,
    /// Nothing to do before this time (unless something changes).
    At(u64),
    /// Nothing to do until something changes (or there is no such seat).
    Never,
}

/// What the backing node at `seat_key` needs, by [`lifecycle::next`] on the mirror. A
/// node with nothing due within the lease TTL needs no worker and no lease: slot claims
/// are create-if-absent and need neither, and the supervisor starts a worker when a
/// change comes or the time given here is reached.
pub fn due(shared: &Shared, seat_key: &str) -> Due {
    let Some((b, obs)) = observe(shared, seat_key) else {
        return Due::Never;
    };
    let horizon = obs.now + shared.config.lease_ttl.as_millis() as u64;
    match lifecycle::next(&b.value, &obs) {
        Step::Wait(None) => Due::Never,
        Step::Wait(Some(at)) if at > horizon => Due::At(at),
        _ => Due::Now,
    }
}
