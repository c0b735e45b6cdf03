//! Carrying out the steps [`lifecycle::next`] decides: each a revision-checked write of
//! the backing record, with the provider and agent calls it needs around it.

use super::lifecycle::{self, AttemptEnd, Observed, Step};
use crate::events;
use crate::metrics::{self, DeletionReason, ProviderErrorKind};
use crate::nodes;
use crate::provider::{CreateQueue, LaunchSpec, Provider, CAPACITY_BACKOFF};
use crate::shared::Shared;
use slotpool_protocol::api::{AgentCommand, SlotsClosed};
use slotpool_protocol::layout::subjects;
use slotpool_protocol::model::{
    secret_digest, BackingNode, BackingState, Interruption, SPOT_INTERRUPTION,
};
use slotpool_protocol::store::{KvError, Versioned};
use slotpool_protocol::time::now_ms;
use std::sync::Arc;
use std::time::Duration;

/// Pause before retrying a step whose I/O failed (provider or KV trouble).
pub(super) const STEP_RETRY_PAUSE: Duration = Duration::from_secs(2);
/// How long a step that needs a provider missing from the configuration waits before
/// looking again (the configuration may bring it back).
const PROVIDER_GONE_PAUSE: Duration = Duration::from_secs(60);

/// Why a step of a node whose provider is no longer configured cannot be taken.
fn provider_gone(provider: &str) -> String {
    format!("provider {provider} is no longer in the configuration")
}

/// How long an agent may take to answer a close/open command.
const AGENT_COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// Carries out one backing node's steps; the worker's loop ([`super::worker`]) asks it.
pub(super) struct Executor {
    pub(super) sh: Arc<Shared>,
    pub(super) seat_key: String,
}

/// The outcome of carrying out a step.
pub(super) enum Outcome {
    Continue,
    Wait(Option<u64>),
    /// The seat is empty now: the worker ends.
    Gone,
}

impl Executor {
    /// Sends `close` or `open` to the node's agent.
    pub(super) async fn agent_command(
        &self,
        b: &BackingNode,
        cmd: AgentCommand,
    ) -> Result<SlotsClosed, slotpool_protocol::connect::BusError> {
        self.sh
            .bus
            .call(&subjects::agent(&b.id), &cmd, AGENT_COMMAND_TIMEOUT)
            .await
    }

    pub(super) async fn carry_out(
        &self,
        b: &Versioned<BackingNode>,
        step: Step,
        obs: &Observed,
    ) -> Result<Outcome, KvError> {
        let now = now_ms();
        let deletion = lifecycle::deletion_reason(&b.value, &step, obs);
        // What the instance printed, for the event of a boot that timed out.
        let console = if lifecycle::boot_failed(&b.value, &step, obs) {
            self.console_of(&b.value).await
        } else {
            String::new()
        };
        match step {
            Step::Wait(at) => Ok(Outcome::Wait(at)),
            Step::Launch {
                retry_reason,
                timeout,
            } => {
                if let (false, Some(reason)) = (console.is_empty(), &retry_reason) {
                    let attempt = b.value.attempts;
                    self.note(
                        b,
                        format!("launch attempt {attempt} failed: {reason}{console}"),
                    );
                }
                self.launch(b, obs, retry_reason, timeout).await
            }
            Step::FindLaunched { timeout } => self.find_launched(b, obs, timeout).await,
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
                self.write(b, BackingState::Ready, |n| {
                    n.ready_at = Some(now);
                    n.idle_since = Some(now);
                })
                .await?;
                if let Some(launched_at) = b.value.launched_at {
                    metrics::booted(launched_at, now);
                }
                self.note(b, "ready: its agent reports in");
                Ok(Outcome::Continue)
            }
            Step::SetIdleSince(at) => {
                self.write(b, b.value.state, |n| n.idle_since = at).await?;
                Ok(Outcome::Continue)
            }
            Step::Retire(reason) => {
                tracing::info!(%reason, "retiring: no new slots");
                self.write(b, BackingState::Retiring, |_| {}).await?;
                self.note(b, format!("retiring (no new slots): {reason}"));
                Ok(Outcome::Continue)
            }
            Step::Release(reason) => {
                tracing::info!(%reason, "releasing");
                self.write(b, BackingState::Releasing, |_| {}).await?;
                if let Some(reason) = deletion {
                    metrics::deletion(&b.value, reason);
                }
                self.note(b, format!("releasing: {reason}"));
                Ok(Outcome::Continue)
            }
            Step::FinishRelease => self.finish_release(b).await,
            Step::Fail(reason) => {
                let counted_as = deletion.unwrap_or(DeletionReason::Failure);
                self.fail(b, reason, counted_as, None, &console).await
            }
            Step::Interrupted(notice) => {
                let reason = lifecycle::interruption_failure(&notice);
                self.fail(
                    b,
                    reason,
                    DeletionReason::SpotInterruption,
                    Some(notice),
                    "",
                )
                .await
            }
            Step::CleanUp => {
                if let Err(retry_at) = self.delete_instance(&b.value, "the failed instance").await {
                    return Ok(Outcome::Wait(Some(retry_at)));
                }
                if let Some(provider) = self.sh.providers.get(&b.value.provider).cloned() {
                    self.delete_unrecorded(provider.as_ref(), &b.value).await;
                }
                self.write(b, BackingState::Failed, |n| n.instance = None)
                    .await?;
                self.note(b, "failed node's instance deleted");
                Ok(Outcome::Continue)
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

    /// Writes a new state (checked against the state machine) and applies it locally;
    /// returns the record as written.
    async fn write(
        &self,
        b: &Versioned<BackingNode>,
        state: BackingState,
        change: impl FnOnce(&mut BackingNode),
    ) -> Result<Versioned<BackingNode>, KvError> {
        let mut n = b.value.clone();
        n.state = state;
        change(&mut n);
        self.put(b, n).await
    }

    /// Writes `n` over `b` (at `b`'s revision) and applies it locally; returns the
    /// record as written.
    async fn put(
        &self,
        b: &Versioned<BackingNode>,
        mut n: BackingNode,
    ) -> Result<Versioned<BackingNode>, KvError> {
        debug_assert!(
            n.state == b.value.state || b.value.state.can_become(n.state),
            "{:?} -> {:?}",
            b.value.state,
            n.state
        );
        n.updated_at = now_ms();
        let revision = self
            .sh
            .bus
            .backing
            .update(&b.key, &n, b.revision, None)
            .await?;
        let written = Versioned {
            key: b.key.clone(),
            revision,
            value: n,
        };
        self.sh.world().put_backing(written.clone());
        Ok(written)
    }

    /// Carries out a launch attempt: the record of the attempt, the provider's launch
    /// within `timeout`, and the record of how it ended ([`lifecycle::attempt`],
    /// [`lifecycle::after_attempt`]).
    async fn launch(
        &self,
        b: &Versioned<BackingNode>,
        obs: &Observed,
        retry_reason: Option<String>,
        timeout: Duration,
    ) -> Result<Outcome, KvError> {
        let v = &b.value;
        let Some(provider) = self.sh.providers.get(&v.provider).cloned() else {
            return self
                .fail(
                    b,
                    provider_gone(&v.provider),
                    DeletionReason::Failure,
                    None,
                    "",
                )
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
        let attempt = lifecycle::attempt(v, secret_digest(&secret), now_ms());
        let mut current = self.put(b, attempt).await?;
        let max_age = obs.rules.map_or(Duration::ZERO, |r| r.idle.max_age);
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
            create_queue: Some(Arc::new(CreateQueue::default())),
        };
        // The provider applies the timeout (`provider::limit`), after its create limits;
        // the record says when the launch waits for them ([`CreateQueue`]).
        let launch = provider.launch(&spec);
        tokio::pin!(launch);
        let queue = spec.create_queue.clone().expect("set above");
        let mut create_queued = false;
        let launched = loop {
            tokio::select! {
                result = &mut launch => break result,
                () = queue.queued.notified(), if !create_queued => create_queued = true,
                () = queue.admitted.notified(), if create_queued => create_queued = false,
            }
            let marked = BackingNode {
                create_queued,
                ..current.value.clone()
            };
            match self.put(&current, marked).await {
                Ok(written) => current = written,
                // The attempt's end is written over the same revision and meets the same
                // conflict: nothing is lost here.
                Err(err) => tracing::warn!(%err, create_queued, "cannot mark the launch's wait"),
            }
        };
        let end = match launched {
            Ok(launched) => {
                tracing::info!(instance = %launched.instance.id, host = %launched.instance.host, "launched; waiting for its agent");
                AttemptEnd::Launched {
                    instance: launched.instance,
                    attributes: launched.attributes,
                }
            }
            Err(err) => {
                let kind = err.kind();
                match kind {
                    ProviderErrorKind::Capacity => {
                        tracing::warn!(%err, backoff = ?CAPACITY_BACKOFF, "provider out of capacity; will ask again")
                    }
                    _ => tracing::warn!(%err, "launch failed"),
                }
                AttemptEnd::Refused {
                    error: err.to_string(),
                    kind,
                }
            }
        };
        let ended = lifecycle::after_attempt(&current.value, end);
        if ended.delete_unrecorded {
            self.delete_unrecorded(provider.as_ref(), v).await;
        }
        metrics::launch(v, ended.counted);
        self.put(&current, ended.record).await?;
        self.note(b, ended.note);
        Ok(Outcome::Continue)
    }

    /// After an interrupted attempt ([`lifecycle::interrupted`]): adopts the instance
    /// the provider lists under this backing id (its agent runs with the attempt's
    /// secret) and deletes any other, or, when it lists none, launches again without
    /// counting the attempt. A provider that cannot list now is asked again soon.
    async fn find_launched(
        &self,
        b: &Versioned<BackingNode>,
        obs: &Observed,
        timeout: Duration,
    ) -> Result<Outcome, KvError> {
        let v = &b.value;
        let Some(provider) = self.sh.providers.get(&v.provider).cloned() else {
            return self
                .fail(
                    b,
                    provider_gone(&v.provider),
                    DeletionReason::Failure,
                    None,
                    "",
                )
                .await;
        };
        let interrupted = "the launch was interrupted before its end was recorded".to_string();
        if !provider.creates_machines() {
            return self.launch(b, obs, Some(interrupted), timeout).await;
        }
        let listed = match provider.list().await {
            Ok(listed) => listed,
            Err(err) => {
                tracing::warn!(%err, "cannot list the provider's instances to find what an interrupted launch started; will retry");
                return Ok(Outcome::Wait(Some(
                    now_ms() + STEP_RETRY_PAUSE.as_millis() as u64,
                )));
            }
        };
        let mine = listed
            .into_iter()
            .filter(|l| l.backing_id.as_ref() == Some(&v.id))
            .map(|l| l.instance)
            .collect();
        let Some((instance, others)) = lifecycle::found(mine) else {
            return self
                .launch(
                    b,
                    obs,
                    Some(format!(
                        "{interrupted}, and the provider lists nothing for it"
                    )),
                    timeout,
                )
                .await;
        };
        tracing::info!(instance = %instance.id, host = %instance.host, "adopting the instance an interrupted launch started");
        let ended = lifecycle::after_attempt(
            v,
            AttemptEnd::Launched {
                instance: instance.clone(),
                attributes: Default::default(),
            },
        );
        metrics::launch(v, ended.counted);
        self.put(b, ended.record).await?;
        for other in others {
            if let Err(err) = provider.delete(&other).await {
                tracing::warn!(instance = %other.id, %err, "cannot delete an instance no attempt recorded");
            }
        }
        self.note(
            b,
            format!(
                "found on {} the instance an interrupted launch started (attempt {}); waiting for its agent",
                instance.host, v.attempts
            ),
        );
        Ok(Outcome::Continue)
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
                    self.write(b, BackingState::Ready, |n| n.idle_since = None)
                        .await?;
                    return Ok(Outcome::Continue);
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
        let deleted = match &v.instance {
            None => Ok(()),
            Some(instance) => match self.sh.providers.get(&v.provider) {
                None => {
                    tracing::warn!(
                        ?instance,
                        reason = provider_gone(&v.provider),
                        "cannot delete {what}"
                    );
                    Err(now_ms() + PROVIDER_GONE_PAUSE.as_millis() as u64)
                }
                Some(provider) => provider.delete(instance).await.map_err(|err| {
                    tracing::warn!(%err, "cannot delete {what}; will retry");
                    now_ms() + STEP_RETRY_PAUSE.as_millis() as u64
                }),
            },
        };
        // A launched node's agent credential goes with it, once the machine is gone (its
        // agent would spend its stop reconnecting otherwise); a static host's stays, as
        // the host does.
        let launched = self
            .sh
            .providers
            .get(&v.provider)
            .is_some_and(|p| p.fixed_identity(&v.pool, v.seat).is_none());
        if deleted.is_ok() && launched {
            let max_age = self
                .sh
                .config
                .label_in(&v.provider, &v.pool, &v.label)
                .map_or(Duration::ZERO, |site| site.label.max_age);
            crate::revocation::revoke_agent(&self.sh, &v.id, max_age).await;
        }
        deleted
    }

    /// What the node's instance printed on its console, as the end of an event's message
    /// (`; its console ends: …`, [`crate::provider::console_tail`]); empty when its
    /// provider cannot tell. Asked once, within the provider's console time limit.
    async fn console_of(&self, v: &BackingNode) -> String {
        let (Some(instance), Some(provider)) = (&v.instance, self.sh.providers.get(&v.provider))
        else {
            return String::new();
        };
        match provider.console(instance).await {
            Ok(None) => String::new(),
            Ok(Some(output)) => match crate::provider::console_tail(&output) {
                Some(tail) => format!("; its console ends: {tail}"),
                None => "; its console is empty".into(),
            },
            Err(err) => {
                tracing::warn!(%err, "cannot read the instance's console");
                // The provider's stderr, bounded and escaped like a console.
                let err = crate::provider::console_tail(&err.to_string()).unwrap_or_default();
                format!("; its console could not be read: {err}")
            }
        }
    }

    /// Fails the node for `reason` and the nodes on its slots with it; `interruption`:
    /// the cloud's notice that it takes the machine back, recorded (the seat then takes
    /// no rest) and said in the event's `reason`; `detail` ends the event's message only
    /// (what the console said).
    async fn fail(
        &self,
        b: &Versioned<BackingNode>,
        reason: String,
        counted_as: DeletionReason,
        interruption: Option<Interruption>,
        detail: &str,
    ) -> Result<Outcome, KvError> {
        tracing::warn!(%reason, "backing node failed");
        self.write(b, BackingState::Failed, |n| {
            n.failure = Some(reason.clone());
            n.interruption = interruption;
        })
        .await?;
        metrics::deletion(&b.value, counted_as);
        let message = format!("failed: {reason}{detail}");
        match interruption {
            Some(_) => {
                events::backing_changed_for(&self.sh, &b.value.id, message, SPOT_INTERRUPTION)
            }
            None => self.note(b, message),
        }
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
        Ok(Outcome::Continue)
    }
}

fn new_secret() -> String {
    let bytes: [u8; 24] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
