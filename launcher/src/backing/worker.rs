//! The backing worker: one task per backing seat this launcher holds the lease of. It
//! loops over [`observe`], [`lifecycle::next`] and [`Executor::carry_out`]: launch, wait
//! for the agent, hand the node to the allocator, retire, release, or fail, each a
//! revision-checked write, until nothing is due for a while.

use super::exec::{Executor, Outcome, STEP_RETRY_PAUSE};
use super::lifecycle::{self, AgentSeen, Step};
use super::observe::observe;
use crate::heartbeat_clock::{Probe, Verdict};
use crate::lease::LeaseGuard;
use crate::shared::{seat_topic, wait_for_change, Shared};
use slotpool_protocol::model::{BackingNode, HeartbeatGist};
use slotpool_protocol::store::KvError;
use slotpool_protocol::time::now_ms;
use std::sync::Arc;

pub(super) struct Worker {
    ex: Executor,
}

impl Worker {
    pub(super) fn new(sh: Arc<Shared>, seat_key: String) -> Worker {
        Worker {
            ex: Executor { sh, seat_key },
        }
    }

    /// Carries out steps until the seat is empty, the lease is lost, or nothing is due
    /// within the lease TTL and nothing was done for as long (then it lets go of the
    /// lease and returns true: the supervisor starts a worker again when needed).
    pub(super) async fn run(&self, lease: &LeaseGuard) -> bool {
        let mut rx = self.ex.sh.signals.subscribe(&seat_topic(&self.ex.seat_key));
        let linger = self.ex.sh.config.lease_ttl;
        let mut last_step = tokio::time::Instant::now();
        let mut probed = false;
        loop {
            if lease.lost.is_cancelled() {
                return false;
            }
            rx.mark_unchanged();
            let Some((b, obs)) = observe(&self.ex.sh, &self.ex.seat_key) else {
                return false;
            };
            let step = lifecycle::next(&b.value, &obs);
            tracing::trace!(?step, state = ?b.value.state, "step");
            // One look at the heartbeats bucket per decision: a failure that still stands
            // after the clock restarted does not wait on the bucket (an operator's kill).
            if matches!(step, Step::Fail(_)) && obs.agent == AgentSeen::Absent && !probed {
                let probe = self.probe_heartbeats(&b.value).await;
                match self.ex.sh.heartbeat_clock.apply(probe, now_ms()) {
                    Verdict::Confirmed => {}
                    Verdict::Alive => continue,
                    Verdict::Restart { back_at } => {
                        probed = true;
                        tracing::info!(
                            back_at,
                            ?probe,
                            "heartbeat clock restarted: a missing heartbeat counts from then"
                        );
                        continue;
                    }
                }
            }
            probed = false;
            let outcome = match self.ex.carry_out(&b, step, &obs).await {
                Ok(o) => o,
                Err(KvError::Conflict { .. }) => {
                    // Someone else wrote it (an operator's order, say): read it afresh
                    // rather than wait for the watch to bring it.
                    self.refresh().await;
                    Outcome::Continue
                }
                Err(err) => {
                    tracing::warn!(%err, "step failed; retrying");
                    Outcome::Wait(Some(now_ms() + STEP_RETRY_PAUSE.as_millis() as u64))
                }
            };
            match outcome {
                Outcome::Continue => last_step = tokio::time::Instant::now(),
                Outcome::Gone => return false,
                Outcome::Wait(at) => {
                    let now = tokio::time::Instant::now();
                    let mut deadline = at.map(|t| now + slotpool_protocol::time::until(t));
                    // Nothing due within the lease TTL: keep the lease a while after the
                    // last step (a busy node would otherwise churn leases), then let go.
                    if deadline.is_none_or(|d| d > now + linger) {
                        let until = last_step + linger;
                        if now >= until {
                            tracing::debug!("nothing due; letting go of the lease");
                            return true;
                        }
                        deadline = Some(deadline.map_or(until, |d| d.min(until)));
                    }
                    wait_for_change(std::slice::from_mut(&mut rx), deadline, &lease.lost).await;
                }
            }
        }
    }

    /// One look at the heartbeats bucket before the node is failed for a missing
    /// heartbeat ([`crate::heartbeat_clock`]): whether KV has a heartbeat of the node's
    /// agent that the mirror lacks (each bucket has its own watch, so the mirror can hold
    /// a backing node before its agent's heartbeat, or have lost it in a watch that failed
    /// and is starting again; it is put into the mirror), and otherwise whether the bucket
    /// answers, has a leader, and since when.
    async fn probe_heartbeats(&self, b: &BackingNode) -> Probe {
        let agents = &self.ex.sh.bus.agents;
        match agents.get_bytes(b.id.as_str()).await {
            Ok(Some((_, bytes))) => {
                if let Ok(gist) = HeartbeatGist::from_json(&bytes) {
                    let mut world = self.ex.sh.world();
                    world.put_agent(gist);
                    if world.agents.contains_key(&b.id) {
                        tracing::info!("the agent's heartbeat was in KV but not yet in the mirror");
                        return Probe::Present;
                    }
                }
            }
            Ok(None) => {}
            Err(err) => {
                tracing::info!(%err, "cannot read the agent's heartbeat");
                return Probe::Unavailable;
            }
        }
        match agents.placement().await {
            Ok(None) => Probe::Absent { leader_since: None },
            Ok(Some(p)) if p.leader.is_some() => Probe::Absent {
                leader_since: p.leader_since,
            },
            Ok(Some(_)) => {
                tracing::info!("the heartbeats bucket has no leader");
                Probe::Unavailable
            }
            Err(err) => {
                tracing::info!(%err, "cannot read where the heartbeats bucket lives");
                Probe::Unavailable
            }
        }
    }

    /// Reads the record from KV into the mirror.
    async fn refresh(&self) {
        match self
            .ex
            .sh
            .bus
            .backing
            .get::<BackingNode>(&self.ex.seat_key)
            .await
        {
            Ok(Some(b)) => self.ex.sh.world().put_backing(b),
            Ok(None) => self
                .ex
                .sh
                .world()
                .remove_backing(&self.ex.seat_key, u64::MAX),
            Err(err) => tracing::debug!(%err, "cannot re-read the record"),
        }
    }
}
