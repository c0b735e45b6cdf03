//! The backing worker: one task per backing seat this launcher holds the lease of. It
//! carries out the steps of [`crate::lifecycle::next`]: launch, wait for the agent, hand
//! the node to the allocator, retire, release, or fail — each a revision-checked write.

use crate::config::warm;
use crate::events;
use crate::heartbeat_clock::{Probe, Verdict};
use crate::lease::{self, LeaseGuard};
use crate::lifecycle::{self, AgentSeen, Observed, Rules, Step};
use crate::metrics::{self, DeletionReason, LaunchOutcome};
use crate::nodes;
use crate::planner;
use crate::provider::{LaunchSpec, Provider, ProviderError};
use crate::shared::{label_topic, seat_topic, wait_for_change, Shared, Work};
use slotpool_protocol::api::{AgentCommand, SlotsClosed};
use slotpool_protocol::layout::{self, subjects};
use slotpool_protocol::model::{
    secret_digest, BackingNode, BackingState, HeartbeatGist, DEFAULT_HEARTBEAT_TTL_SECS,
};
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::now_ms;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// Pause before retrying a step whose I/O failed (provider or KV trouble).
const STEP_RETRY_PAUSE: Duration = Duration::from_secs(2);
/// How long a step that needs a provider missing from the configuration waits before
/// looking again (the configuration may bring it back).
const PROVIDER_GONE_PAUSE: Duration = Duration::from_secs(60);

/// Why a step of a node whose provider is no longer configured cannot be taken.
fn provider_gone(provider: &str) -> String {
    format!("provider {provider} is no longer in the configuration")
}
/// How long an agent may take to answer a close/open command.
const AGENT_COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

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
                    let_go = Worker {
                        sh: sh.clone(),
                        seat_key: seat_key.clone(),
                    }
                    .run(&lease)
                    .await;
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

/// The record and what is observed of it now.
fn observe(shared: &Shared, seat_key: &str) -> Option<(Versioned<BackingNode>, Observed)> {
    let mut world = shared.world();
    let b = world.backing.get(seat_key)?.clone();
    let agent = match world.agents.get(&b.value.id) {
        None => AgentSeen::Absent,
        Some(a) if a.secret_sha256 != b.value.secret_sha256 => AgentSeen::Impostor,
        Some(a) => AgentSeen::Up {
            draining: a.draining,
        },
    };
    let rules = shared
        .config
        .label_in(&b.value.provider, &b.value.pool, &b.value.label)
        .map(|s| Rules::of(&s));
    let lost = world.lost_heartbeats.get(&b.value.id).copied();
    let used = world.used_count(&b.value.id);
    let min_ready = planner::ready_now(&shared.config, &world, &b.value.label);
    let free_ahead = if min_ready > 0 && used == 0 {
        lifecycle::free_ahead(
            (seat_key, b.value.slots),
            world
                .backing
                .values()
                .filter(|o| o.key != seat_key && o.value.label == b.value.label)
                .filter(|o| world.takes_slots(&o.value))
                .map(|o| (o.key.as_str(), o.value.slots, world.used_count(&o.value.id))),
        )
    } else {
        0
    };
    let now = now_ms();
    let label = &b.value.label;
    // Only a node that takes slots is about to be claimed by the label's queue: one held,
    // drained, or whose agent is unhealthy is not kept for it.
    let waiting = match world.wanting.get(label) {
        Some(queue) if world.takes_slots(&b.value) => queue.len() as u32,
        _ => 0,
    };
    if waiting > 0 && used == 0 {
        world
            .kept_for_queue
            .entry(label.clone())
            .or_default()
            .insert(seat_key.to_string());
    }
    let obs = Observed {
        agent,
        used,
        last_release: world.last_release.get(&b.value.id).copied(),
        rules,
        synced_since: shared.mirror_sync.since(),
        heartbeats_back_at: shared.heartbeat_clock.back_at(),
        heartbeat_lost_at: lost.map(|l| l.at),
        heartbeat_ttl: lost.map_or(Duration::from_secs(DEFAULT_HEARTBEAT_TTL_SECS), |l| l.ttl),
        min_ready,
        free_ahead,
        ready_falls_at: warm::ready_falls_at(&shared.config, label, &world.arrivals, now),
        waiting,
        now,
    };
    Some((b, obs))
}

struct Worker {
    sh: Arc<Shared>,
    seat_key: String,
}

/// The outcome of carrying out a step.
enum Outcome {
    Continue,
    Wait(Option<u64>),
    /// The seat is empty now: the worker ends.
    Gone,
}

impl Worker {
    /// Carries out steps until the seat is empty, the lease is lost, or nothing is due
    /// within the lease TTL and nothing was done for as long (then it lets go of the
    /// lease and returns true: the supervisor starts a worker again when needed).
    async fn run(&self, lease: &LeaseGuard) -> bool {
        let mut rx = self.sh.signals.subscribe(&seat_topic(&self.seat_key));
        let linger = self.sh.config.lease_ttl;
        let mut last_step = tokio::time::Instant::now();
        let mut probed = false;
        loop {
            if lease.lost.is_cancelled() {
                return false;
            }
            rx.mark_unchanged();
            let Some((b, obs)) = observe(&self.sh, &self.seat_key) else {
                return false;
            };
            let step = lifecycle::next(&b.value, &obs);
            tracing::trace!(?step, state = ?b.value.state, "step");
            // One look at the heartbeats bucket per decision: a failure that still stands
            // after the clock restarted does not wait on the bucket (an operator's kill).
            if matches!(step, Step::Fail(_)) && obs.agent == AgentSeen::Absent && !probed {
                let probe = self.probe_heartbeats(&b.value).await;
                match self.sh.heartbeat_clock.apply(probe, now_ms()) {
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
            let outcome = match self.carry_out(&b, step, &obs).await {
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

    /// Sends `close` or `open` to the node's agent.
    async fn agent_command(
        &self,
        b: &BackingNode,
        cmd: AgentCommand,
    ) -> Result<SlotsClosed, slotpool_protocol::connect::BusError> {
        self.sh
            .bus
            .call(&subjects::agent(&b.id), &cmd, AGENT_COMMAND_TIMEOUT)
            .await
    }

    /// One look at the heartbeats bucket before the node is failed for a missing
    /// heartbeat ([`crate::heartbeat_clock`]): whether KV has a heartbeat of the node's
    /// agent that the mirror lacks (each bucket has its own watch, so the mirror can hold
    /// a backing node before its agent's heartbeat, or have lost it in a watch that failed
    /// and is starting again; it is put into the mirror), and otherwise whether the bucket
    /// answers, has a leader, and since when.
    async fn probe_heartbeats(&self, b: &BackingNode) -> Probe {
        let agents = &self.sh.bus.agents;
        match agents.get_bytes(b.id.as_str()).await {
            Ok(Some((_, bytes))) => {
                if let Ok(gist) = HeartbeatGist::from_json(&bytes) {
                    let mut world = self.sh.world();
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
        match self.sh.bus.backing.get::<BackingNode>(&self.seat_key).await {
            Ok(Some(b)) => self.sh.world().put_backing(b),
            Ok(None) => self.sh.world().remove_backing(&self.seat_key, u64::MAX),
            Err(err) => tracing::debug!(%err, "cannot re-read the record"),
        }
    }

    async fn carry_out(
        &self,
        b: &Versioned<BackingNode>,
        step: Step,
        obs: &Observed,
    ) -> Result<Outcome, KvError> {
        let now = now_ms();
        let deletion = lifecycle::deletion_reason(&b.value, &step, obs);
        match step {
            Step::Wait(at) => Ok(Outcome::Wait(at)),
            Step::Launch { retry_reason } => self.launch(b, retry_reason).await,
            Step::BecomeReady => {
                // An agent that outlived an earlier release of this seat (a static host)
                // is still closed to new slots: open it first.
                if let Err(err) = self.agent_command(&b.value, AgentCommand::Open).await {
                    tracing::warn!(%err, "agent did not confirm open; will retry");
                    return Ok(Outcome::Wait(Some(
                        now + STEP_RETRY_PAUSE.as_millis() as u64,
                    )));
                }
                tracing::info!("ready");
                let outcome = self
                    .write(b, BackingState::Ready, |n| {
                        n.ready_at = Some(now);
                        n.idle_since = Some(now);
                    })
                    .await?;
                if let Some(launched_at) = b.value.launched_at {
                    metrics::booted(launched_at, now);
                }
                self.note(b, "ready: its agent reports in");
                Ok(outcome)
            }
            Step::SetIdleSince(at) => self.write(b, b.value.state, |n| n.idle_since = at).await,
            Step::Retire(reason) => {
                tracing::info!(%reason, "retiring: no new slots");
                let outcome = self.write(b, BackingState::Retiring, |_| {}).await?;
                self.note(b, format!("retiring (no new slots): {reason}"));
                Ok(outcome)
            }
            Step::Release(reason) => {
                tracing::info!(%reason, "releasing");
                let outcome = self.write(b, BackingState::Releasing, |_| {}).await?;
                if let Some(reason) = deletion {
                    metrics::deletion(&b.value, reason);
                }
                self.note(b, format!("releasing: {reason}"));
                Ok(outcome)
            }
            Step::FinishRelease => self.finish_release(b).await,
            Step::Fail(reason) => {
                self.fail(b, reason, deletion.unwrap_or(DeletionReason::Failure))
                    .await
            }
            Step::CleanUp => {
                if let Err(retry_at) = self.delete_instance(&b.value, "the failed instance").await {
                    return Ok(Outcome::Wait(Some(retry_at)));
                }
                if let Some(provider) = self.sh.providers.get(&b.value.provider).cloned() {
                    self.delete_unrecorded(provider.as_ref(), &b.value).await;
                }
                let outcome = self
                    .write(b, BackingState::Failed, |n| n.instance = None)
                    .await?;
                self.note(b, "failed node's instance deleted");
                Ok(outcome)
            }
            Step::Forget => {
                self.sh.bus.backing.delete(&b.key, b.revision).await?;
                Ok(Outcome::Gone)
            }
        }
    }

    /// Records a state change in the event log.
    fn note(&self, b: &Versioned<BackingNode>, message: impl Into<String>) {
        events::backing_changed(&self.sh, &b.value.id, message);
    }

    /// Writes a new state (checked against the state machine) and applies it locally.
    async fn write(
        &self,
        b: &Versioned<BackingNode>,
        state: BackingState,
        change: impl FnOnce(&mut BackingNode),
    ) -> Result<Outcome, KvError> {
        debug_assert!(
            state == b.value.state || b.value.state.can_become(state),
            "{:?} -> {state:?}",
            b.value.state
        );
        let mut n = b.value.clone();
        n.state = state;
        change(&mut n);
        n.updated_at = now_ms();
        let revision = self
            .sh
            .bus
            .backing
            .update(&b.key, &n, b.revision, None)
            .await?;
        let label = n.label.clone();
        self.sh.world().put_backing(Versioned {
            key: b.key.clone(),
            revision,
            value: n,
        });
        self.sh.signals.bump(&label_topic(&label));
        Ok(Outcome::Continue)
    }

    async fn launch(
        &self,
        b: &Versioned<BackingNode>,
        retry_reason: Option<String>,
    ) -> Result<Outcome, KvError> {
        let v = &b.value;
        let Some(provider) = self.sh.providers.get(&v.provider).cloned() else {
            return self
                .fail(b, provider_gone(&v.provider), DeletionReason::Failure)
                .await;
        };
        if let Some(reason) = &retry_reason {
            tracing::warn!(%reason, attempt = v.attempts + 1, "launching again");
        }
        if let Some(instance) = &v.instance {
            if let Err(err) = provider.delete(instance).await {
                tracing::warn!(%err, "cannot delete the previous attempt's instance");
            }
        }
        if v.state == BackingState::Launching {
            self.delete_unrecorded(provider.as_ref(), v).await;
        }
        let secret = match provider.fixed_identity(&v.pool, v.seat) {
            Some(fixed) => fixed.secret,
            None => new_secret(),
        };
        let Outcome::Continue = self
            .write(b, BackingState::Launching, |n| {
                // An attempt refused for capacity is not counted against launch-retries.
                if !n.out_of_capacity {
                    n.attempts += 1;
                }
                n.out_of_capacity = false;
                n.launched_at = Some(now_ms());
                n.instance = None;
                n.failure = None;
                n.ready_at = None;
                n.idle_since = None;
                n.secret_sha256 = secret_digest(&secret);
            })
            .await?
        else {
            unreachable!("write continues")
        };
        let Some(current) = self.sh.world().backing.get(&b.key).cloned() else {
            return Ok(Outcome::Continue);
        };
        let timeout = self
            .sh
            .config
            .pool(&v.provider, &v.pool)
            .map(|(_, p)| p.launch_timeout)
            .unwrap_or(Duration::from_secs(300));
        let max_age = self
            .sh
            .config
            .label_in(&v.provider, &v.pool, &v.label)
            .map_or(Duration::ZERO, |site| site.label.max_age);
        let credentials = match self.sh.agent_bus.credential(&v.id, max_age) {
            Ok(c) => c,
            Err(err) => {
                tracing::error!(%err, "cannot mint the agent's bus credential");
                None
            }
        };
        let spec = LaunchSpec {
            backing_id: v.id.clone(),
            secret,
            provider: v.provider.clone(),
            pool: v.pool.clone(),
            backing_label: v.backing_label.clone(),
            slots: v.slots,
            nats_url: self.sh.agent_bus.url.clone(),
            credentials,
            timeout,
        };
        // The provider applies launch-timeout (`provider::limit`), after its create limits.
        let result = provider.launch(&spec).await;
        if let Err(ProviderError::Timeout { .. }) = &result {
            self.delete_unrecorded(provider.as_ref(), v).await;
        }
        match result {
            Ok(launched) => {
                tracing::info!(instance = %launched.instance.id, host = %launched.instance.host, "launched; waiting for its agent");
                metrics::launch(v, LaunchOutcome::Launched);
                let message = format!(
                    "launched on {} (attempt {}); waiting for its agent",
                    launched.instance.host, current.value.attempts
                );
                let outcome = self
                    .write(&current, BackingState::Launching, |n| {
                        n.instance = Some(launched.instance);
                        n.attributes = launched.attributes;
                    })
                    .await?;
                self.note(b, message);
                Ok(outcome)
            }
            Err(err) => {
                let capacity = matches!(err, ProviderError::Capacity { .. });
                metrics::launch(
                    v,
                    if capacity {
                        LaunchOutcome::Capacity
                    } else {
                        LaunchOutcome::Failed
                    },
                );
                if capacity {
                    tracing::warn!(%err, backoff = ?lifecycle::CAPACITY_BACKOFF, "provider out of capacity; will ask again");
                    self.note(
                        b,
                        format!(
                            "provider out of capacity, asking again in {}s: {err}",
                            lifecycle::CAPACITY_BACKOFF.as_secs()
                        ),
                    );
                } else {
                    tracing::warn!(%err, "launch failed");
                    self.note(
                        b,
                        format!("launch attempt {} failed: {err}", current.value.attempts),
                    );
                }
                self.write(&current, BackingState::Launching, |n| {
                    n.failure = Some(err.to_string());
                    n.out_of_capacity = capacity;
                })
                .await
            }
        }
    }

    /// Deletes every instance the provider lists for this backing node that its record
    /// does not name: what a launch that timed out or was interrupted started before its
    /// instance was recorded. Best effort: what it misses, the leak sweep finds.
    async fn delete_unrecorded(&self, provider: &dyn Provider, v: &BackingNode) {
        if !provider.creates_machines() {
            return;
        }
        let listed = match provider.list().await {
            Ok(listed) => listed,
            Err(err) => {
                tracing::warn!(%err, "cannot list the provider's instances of this backing node");
                return;
            }
        };
        let recorded = v.instance.as_ref().map(|i| i.id.as_str());
        for l in listed {
            if l.backing_id.as_ref() != Some(&v.id) || Some(l.instance.id.as_str()) == recorded {
                continue;
            }
            match provider.delete(&l.instance).await {
                Ok(()) => {
                    tracing::info!(instance = %l.instance.id, "deleted an instance no attempt recorded")
                }
                Err(err) => {
                    tracing::warn!(instance = %l.instance.id, %err, "cannot delete an instance no attempt recorded")
                }
            }
        }
    }

    /// Closes the agent to new slots, makes sure none is in use, deletes the instance and
    /// frees the seat. A slot claimed in the meantime aborts the release.
    async fn finish_release(&self, b: &Versioned<BackingNode>) -> Result<Outcome, KvError> {
        let v = &b.value;
        let agent_up = self.sh.world().agents.contains_key(&v.id);
        if agent_up {
            match self.agent_command(v, AgentCommand::Close).await {
                Ok(closed)
                    if closed.prepared.is_empty() && self.sh.world().used_count(&v.id) == 0 => {}
                Ok(closed) => {
                    tracing::info!(prepared = ?closed.prepared, "a slot was claimed meanwhile; release aborted");
                    self.note(b, "release aborted: a slot was claimed meanwhile");
                    let _ = self.agent_command(v, AgentCommand::Open).await;
                    return self
                        .write(b, BackingState::Ready, |n| n.idle_since = None)
                        .await;
                }
                Err(err) => tracing::warn!(%err, "agent did not confirm close; releasing anyway"),
            }
        }
        if let Err(retry_at) = self.delete_instance(v, "the instance").await {
            return Ok(Outcome::Wait(Some(retry_at)));
        }
        self.sh.bus.backing.delete(&b.key, b.revision).await?;
        tracing::info!("released");
        self.note(b, "released: instance deleted, seat free");
        Ok(Outcome::Gone)
    }

    /// Deletes the node's instance, if it has one, through the provider that launched
    /// it. On failure, when to try again: soon after a provider error, a minute later when
    /// the provider is no longer in the configuration (the instance cannot be deleted
    /// until it is back; the warning names it for an operator).
    async fn delete_instance(
        &self,
        v: &BackingNode,
        what: &str,
    ) -> Result<(), slotpool_protocol::time::UnixMillis> {
        let Some(instance) = &v.instance else {
            return Ok(());
        };
        let Some(provider) = self.sh.providers.get(&v.provider) else {
            tracing::warn!(
                ?instance,
                reason = provider_gone(&v.provider),
                "cannot delete {what}"
            );
            return Err(now_ms() + PROVIDER_GONE_PAUSE.as_millis() as u64);
        };
        provider.delete(instance).await.map_err(|err| {
            tracing::warn!(%err, "cannot delete {what}; will retry");
            now_ms() + STEP_RETRY_PAUSE.as_millis() as u64
        })
    }

    async fn fail(
        &self,
        b: &Versioned<BackingNode>,
        reason: String,
        counted_as: DeletionReason,
    ) -> Result<Outcome, KvError> {
        tracing::warn!(%reason, "backing node failed");
        let outcome = self
            .write(b, BackingState::Failed, |n| {
                n.failure = Some(reason.clone())
            })
            .await?;
        metrics::deletion(&b.value, counted_as);
        self.note(b, format!("failed: {reason}"));
        let on_it: Vec<_> = self
            .sh
            .world()
            .slots
            .values()
            .filter(|n| n.value.backing_id == b.value.id)
            .cloned()
            .collect();
        for node in on_it {
            nodes::mark_failed(
                &self.sh,
                &node,
                &format!("backing node {} failed: {reason}", b.value.id),
            )
            .await?;
        }
        Ok(outcome)
    }
}

fn new_secret() -> String {
    let bytes: [u8; 24] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
