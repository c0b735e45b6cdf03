//! The backing node state machine as a pure function: given the record (desired state and
//! what was last written) and what is observed now, [`next`] says the one step to take.
//! A launch's retries and time-out are decided here too: [`next`] says when to launch
//! again and for how long, `attempt` what an attempt writes first, `after_attempt`
//! what its end writes. A machine the cloud takes back (a spot interruption its agent
//! reports) fails at once, and its seat rests not ([`seat_rest_end`]). Unit tested
//! without NATS; the backing worker carries the steps out.

use crate::metrics::{DeletionReason, LaunchOutcome, ProviderErrorKind};
use crate::provider::CAPACITY_BACKOFF;
use slotpool_config::timing::{self, IdleRules};
use slotpool_protocol::model::{
    Attributes, BackingNode, BackingState, IdleBehaviour, Instance, Interruption, SPOT_INTERRUPTION,
};
use slotpool_protocol::time::{after, UnixMillis};
use std::time::Duration;

/// How long a failed backing node's record is kept for operators to see.
pub(crate) const FAILED_RETENTION: Duration = Duration::from_secs(600);
/// How long a failed seat rests before the planner launches into it again (quota back-off).
pub const FAILED_SEAT_COOLDOWN: Duration = Duration::from_secs(10);
/// How long, beyond a heartbeat's TTL, a launcher back on the bus (connected, mirrors
/// synced) waits for a heartbeat missing from KV before it takes the agent for gone. An
/// agent may come back up to 4 s after the launcher (the NATS client's longest pause
/// between reconnect attempts), and its first write after an outage can wait out its
/// acknowledgement timeout (5 s).
pub(crate) const HEARTBEAT_RECONNECT_MARGIN: Duration = Duration::from_secs(10);
/// How long, beyond a heartbeat's TTL, a launcher waits for a heartbeat missing from KV
/// once the heartbeats bucket is back from a time it could take none (a clustered bucket
/// electing its leader, a read that got no answer: [`crate::heartbeat_clock`]). The agent
/// stayed connected, but a write it sent meanwhile can wait out its acknowledgement
/// timeout (5 s) before it writes again.
pub(crate) const HEARTBEAT_BUCKET_MARGIN: Duration = Duration::from_secs(5);

/// What is known of a backing node's agent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AgentSeen {
    /// No heartbeat (never, or it expired): judged with [`Observed::synced_since`].
    Absent,
    /// A heartbeat under this id, but with another secret: not the instance we launched.
    Impostor,
    Up {
        draining: bool,
    },
    /// Its own agent, on a machine the cloud is taking back (a spot interruption notice).
    Interrupted(Interruption),
}

/// The configured rules for the backing node's label (None: no longer configured).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rules {
    /// Grace-time, min-retention-time and max-age.
    pub idle: IdleRules,
    pub boot_timeout: Duration,
    /// How long the provider may take to launch an instance (`launch-timeout`).
    pub launch_timeout: Duration,
    pub launch_retries: u32,
    /// Slots a node hands out in its life (`max-uses`); `None`: no limit.
    pub max_uses: Option<u32>,
}

impl Rules {
    /// The rules of a label as configured in its pool.
    pub fn of(site: &slotpool_config::LabelSite<'_>) -> Rules {
        Rules {
            idle: site.label.idle_rules(),
            boot_timeout: site.pool.boot_timeout,
            launch_timeout: site.pool.launch_timeout,
            launch_retries: site.pool.launch_retries,
            max_uses: site.label.max_uses,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observed {
    pub agent: AgentSeen,
    /// Slots currently held.
    pub used: u32,
    /// When a slot was last returned, if seen by this process.
    pub last_release: Option<UnixMillis>,
    pub rules: Option<Rules>,
    /// Since when this launcher has been connected with its mirrors synced; `None` while
    /// it is not. A heartbeat counts as missing only over that time: KV expires the
    /// heartbeats of live agents during a bus outage.
    pub synced_since: Option<UnixMillis>,
    /// Since when the heartbeats bucket takes heartbeats again after it last could not
    /// ([`crate::heartbeat_clock::HeartbeatClock::back_at`]); a heartbeat counts as
    /// missing only after that too.
    pub heartbeats_back_at: Option<UnixMillis>,
    /// When the mirror lost the agent's heartbeat (expired, or gone in a reload), if it
    /// held one.
    pub heartbeat_lost_at: Option<UnixMillis>,
    /// The TTL of the agent's heartbeat record.
    pub heartbeat_ttl: Duration,
    /// Free slots of the node's label the pools keep ready (`min-ready`, summed over
    /// every pool serving it).
    pub min_ready: u32,
    /// Free slots of the label on the ready nodes kept ahead of this one
    /// ([`free_ahead`]); asked only while `min_ready` is above 0.
    pub free_ahead: u32,
    /// When `min_ready` may fall without any change being seen: the oldest arrival the
    /// label's `warm-window` counts leaves the window then (`None`: no warm-window, or
    /// nothing in it).
    pub ready_falls_at: Option<UnixMillis>,
    /// Requests of every launcher short of a node of this label (its queue,
    /// `World::queue`): an empty node is not idle while they wait, it is about to be
    /// claimed (with a grace-time of 0, it would otherwise be released between becoming
    /// ready and the claim, and the requests launch another).
    pub waiting: u32,
    pub now: UnixMillis,
}

pub use slotpool_config::timing::free_ahead;

/// Why `step` gives `b` back, if it does: a release or a failure.
pub(crate) fn deletion_reason(
    b: &BackingNode,
    step: &Step,
    obs: &Observed,
) -> Option<DeletionReason> {
    Some(match step {
        Step::Fail(_) if b.kill_ordered() => DeletionReason::Kill,
        Step::Fail(_) => DeletionReason::Failure,
        Step::Interrupted(_) => DeletionReason::SpotInterruption,
        Step::Release(_) if b.state == BackingState::Retiring => {
            let aged = obs
                .rules
                .and_then(|rules| max_age_at(b, &rules))
                .is_some_and(|at| obs.now >= at);
            if aged {
                DeletionReason::MaxAge
            } else {
                DeletionReason::Retired
            }
        }
        Step::Release(_) if b.idle == IdleBehaviour::Drain => DeletionReason::Drain,
        Step::Release(_) => DeletionReason::Grace,
        _ => return None,
    })
}

/// Whether `step` gives up on a launch attempt whose instance exists but whose agent did
/// not come up within boot-timeout (a relaunch or a failure for it): the instance's
/// console output is then read into the event that says so, before the instance is
/// deleted.
pub(crate) fn boot_failed(b: &BackingNode, step: &Step, obs: &Observed) -> bool {
    let timed_out = match (obs.rules, b.launched_at) {
        (Some(rules), Some(at)) => obs.now >= after(at, rules.boot_timeout),
        _ => false,
    };
    b.state == BackingState::Launching
        && b.instance.is_some()
        && !b.kill_ordered()
        && timed_out
        && matches!(step, Step::Launch { .. } | Step::Fail(_))
}

/// The one step to take next.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Start a launch attempt (the first, or a retry after `reason`).
    /// Ask the provider for an instance, within `timeout` (`launch-timeout`).
    Launch {
        retry_reason: Option<String>,
        timeout: Duration,
    },
    BecomeReady,
    /// Record when the node became empty (or that it is in use again).
    SetIdleSince(Option<UnixMillis>),
    /// No new slots from now on.
    Retire(String),
    /// Start releasing.
    Release(String),
    /// Delete the instance and the seat.
    FinishRelease,
    Fail(String),
    /// The cloud takes the machine back: fail the node and the nodes on its slots
    /// ([`interruption_failure`]), recording the notice, so that its seat takes no rest.
    Interrupted(Interruption),
    /// Delete a failed node's instance.
    CleanUp,
    /// Drop a failed node's record.
    Forget,
    /// Nothing to do until something changes or the time (if any) comes.
    Wait(Option<UnixMillis>),
    /// The last attempt's end was never recorded ([`interrupted`]): ask the provider for
    /// what it started under this backing id and adopt it ([`found`]), or, when it
    /// started nothing, launch again within `timeout` without counting the attempt.
    FindLaunched {
        timeout: Duration,
    },
}

/// Whether `b`'s last launch attempt was interrupted: its record says it began, and
/// nothing of how it ended (no instance, no failure, no refusal for capacity). Its
/// launcher died while the provider launched, or could not write the end: the provider
/// may have started a machine, and its agent may already run.
pub(crate) fn interrupted(b: &BackingNode) -> bool {
    b.state == BackingState::Launching
        && b.launched_at.is_some()
        && b.instance.is_none()
        && b.failure.is_none()
        && !b.out_of_capacity
}

/// What an interrupted attempt ([`interrupted`]) left, from the instances the provider
/// lists under the backing id: the one to adopt as the attempt's instance (its agent
/// was started with the attempt's secret, which the record holds), and any others to
/// delete. `None`: it started nothing, and the attempt is made again.
pub(crate) fn found(listed: Vec<Instance>) -> Option<(Instance, Vec<Instance>)> {
    let mut listed = listed.into_iter();
    let adopted = listed.next()?;
    Some((adopted, listed.collect()))
}

/// The record of a new launch attempt of `b`, written before the provider is asked:
/// `launching`, with the new instance's secret digest and every trace of an earlier
/// attempt cleared. An attempt after a refusal for capacity is not counted against
/// `launch-retries` (the provider said nothing about the node, only about its quota),
/// nor one after an interrupted attempt that started nothing (the provider was never
/// heard: the interrupted attempt stands for this one).
pub(crate) fn attempt(b: &BackingNode, secret_sha256: String, now: UnixMillis) -> BackingNode {
    BackingNode {
        state: BackingState::Launching,
        attempts: if b.out_of_capacity || interrupted(b) {
            b.attempts
        } else {
            b.attempts + 1
        },
        out_of_capacity: false,
        create_queued: false,
        launched_at: Some(now),
        instance: None,
        failure: None,
        ready_at: None,
        idle_since: None,
        secret_sha256,
        ..b.clone()
    }
}

/// How a launch attempt ended, in the lifecycle's terms.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum AttemptEnd {
    Launched {
        instance: Instance,
        attributes: Attributes,
    },
    /// The provider's error, and its kind.
    Refused {
        error: String,
        kind: ProviderErrorKind,
    },
}

/// What the end of an attempt writes and means ([`after_attempt`]).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Ended {
    /// The attempt's record after it: with its instance, or with why it failed.
    pub record: BackingNode,
    /// How `/metrics` counts it.
    pub counted: LaunchOutcome,
    /// Whether instances the provider lists for the node but no record names are
    /// deleted first: a launch that timed out may have started one.
    pub delete_unrecorded: bool,
    /// What the event log says.
    pub note: String,
}

/// What the end of the attempt recorded in `b` (by [`attempt`]) writes. A failed
/// attempt is decided on by [`next`] from the record: launched again (after
/// [`CAPACITY_BACKOFF`] when refused for capacity, uncounted) or failed once
/// `launch-retries` are used.
pub(crate) fn after_attempt(b: &BackingNode, end: AttemptEnd) -> Ended {
    match end {
        AttemptEnd::Launched {
            instance,
            attributes,
        } => Ended {
            note: format!(
                "launched on {} (attempt {}); waiting for its agent",
                instance.host, b.attempts
            ),
            record: BackingNode {
                instance: Some(instance),
                attributes,
                create_queued: false,
                ..b.clone()
            },
            counted: LaunchOutcome::Launched,
            delete_unrecorded: false,
        },
        AttemptEnd::Refused { error, kind } => {
            let capacity = kind == ProviderErrorKind::Capacity;
            Ended {
                note: if capacity {
                    format!(
                        "provider out of capacity, asking again in {}s: {error}",
                        CAPACITY_BACKOFF.as_secs()
                    )
                } else {
                    format!("launch attempt {} failed: {error}", b.attempts)
                },
                record: BackingNode {
                    failure: Some(error),
                    out_of_capacity: capacity,
                    create_queued: false,
                    ..b.clone()
                },
                counted: if capacity {
                    LaunchOutcome::Capacity
                } else {
                    LaunchOutcome::Failed
                },
                delete_unrecorded: kind == ProviderErrorKind::Timeout,
            }
        }
    }
}

fn min_opt(a: Option<UnixMillis>, b: Option<UnixMillis>) -> Option<UnixMillis> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// When the node reaches max-age, if it has one ([`timing::max_age_at`]).
pub(crate) fn max_age_at(b: &BackingNode, rules: &Rules) -> Option<UnixMillis> {
    timing::max_age_at(b, &rules.idle)
}

/// When an empty node may be released ([`timing::release_at`], the rule the console
/// counts down to).
pub fn release_at(b: &BackingNode, obs: &Observed, rules: &Rules) -> UnixMillis {
    timing::release_at(b, obs.last_release, obs.now, &rules.idle)
}

pub fn next(b: &BackingNode, obs: &Observed) -> Step {
    use BackingState::*;
    if let Some(why) = kill_reason(b) {
        if matches!(b.state, Requested | Launching | Ready | Retiring) {
            return Step::Fail(why);
        }
    }
    if let AgentSeen::Interrupted(notice) = obs.agent {
        // Whatever else is due: the machine is going, with what runs on it. A notice
        // read before this launch attempt began is not about its machine (a host that
        // outlived its node, a static host): no slots go there, and the attempt runs
        // out its boot-timeout as any whose agent does not come up, seat rest included.
        let of_this_attempt = b.launched_at.is_none_or(|at| notice.noticed_at >= at);
        if of_this_attempt && matches!(b.state, Launching | Ready | Retiring) {
            return Step::Interrupted(notice);
        }
    }
    match b.state {
        Requested => match obs.rules {
            Some(rules) => Step::Launch {
                retry_reason: None,
                timeout: rules.launch_timeout,
            },
            None => Step::Fail("its label is no longer in the config".into()),
        },
        Launching => launching(b, obs),
        Ready => ready(b, obs),
        Retiring => match obs.agent {
            AgentSeen::Absent => match agent_gone(obs) {
                Ok(why) => Step::Fail(format!("retiring: {why}")),
                Err(at) => Step::Wait(at),
            },
            _ if b.idle == IdleBehaviour::Hold => Step::Wait(None),
            _ if obs.used == 0 => Step::Release("retired and empty".into()),
            _ => Step::Wait(None),
        },
        Releasing => Step::FinishRelease,
        Gone => Step::Wait(None),
        Failed if b.instance.is_some() => Step::CleanUp,
        Failed => {
            let forget_at = after(b.updated_at, FAILED_RETENTION);
            if obs.now >= forget_at {
                Step::Forget
            } else {
                Step::Wait(Some(forget_at))
            }
        }
    }
}

/// The `failure` of a node whose machine the cloud takes back: [`SPOT_INTERRUPTION`],
/// then what the notice said.
pub(crate) fn interruption_failure(notice: &Interruption) -> String {
    let action = notice.action.as_str();
    match notice.at {
        Some(at) => {
            let at = std::time::UNIX_EPOCH + Duration::from_millis(at);
            format!(
                "{SPOT_INTERRUPTION}: the cloud takes the machine back ({action} at {})",
                humantime::format_rfc3339_seconds(at)
            )
        }
        None => format!("{SPOT_INTERRUPTION}: the cloud takes the machine back ({action})"),
    }
}

/// When a failed backing node's seat may be launched into again: [`FAILED_SEAT_COOLDOWN`]
/// after the failure, so that a launch or an image that keeps failing is not retried in a
/// tight loop; at once after a spot interruption, since nothing is wrong with the seat
/// and the jobs the machine ran are being asked for again. `None` for a seat that is not
/// resting: not failed, or its instance not yet deleted.
pub(crate) fn seat_rest_end(b: &BackingNode) -> Option<UnixMillis> {
    if b.state != BackingState::Failed || b.instance.is_some() {
        return None;
    }
    Some(match b.interruption {
        Some(_) => b.updated_at,
        None => after(b.updated_at, FAILED_SEAT_COOLDOWN),
    })
}

/// Why the node must die now, if an operator ordered it killed.
fn kill_reason(b: &BackingNode) -> Option<String> {
    let order = b.order.as_ref().filter(|_| b.kill_ordered())?;
    Some(match &order.reason {
        Some(reason) => format!("killed by {}: {reason}", order.actor),
        None => format!("killed by {}", order.actor),
    })
}

/// Whether a heartbeat missing from the mirror means the agent is gone (`Ok`, with how
/// long it was missing while this launcher was connected), or until when to wait for it
/// (`Err`; `None`: until the launcher is back on the bus).
///
/// It is gone when KV expired it with the launcher watching a bucket that could take
/// heartbeats: its last write (the TTL before the mirror lost it) came after the launcher
/// was connected and synced, and after the bucket was last back. Otherwise (it expired
/// during an outage or an election, or before this launcher started) it is gone once the
/// launcher has been back for the heartbeat's TTL and [`HEARTBEAT_RECONNECT_MARGIN`], and
/// the bucket for the TTL and [`HEARTBEAT_BUCKET_MARGIN`], without seeing it: a live
/// agent writes again within that time.
fn agent_gone(obs: &Observed) -> Result<String, Option<UnixMillis>> {
    let Some(synced) = obs.synced_since else {
        return Err(None);
    };
    let watching = obs
        .heartbeats_back_at
        .map_or(synced, |back| back.max(synced));
    let last_write = obs
        .heartbeat_lost_at
        .map(|at| at.saturating_sub(obs.heartbeat_ttl.as_millis() as u64));
    let expired_while_watching = last_write.is_some_and(|w| w >= watching);
    let reconnected = after(synced, obs.heartbeat_ttl + HEARTBEAT_RECONNECT_MARGIN);
    let deadline = obs.heartbeats_back_at.map_or(reconnected, |back| {
        reconnected.max(after(back, obs.heartbeat_ttl + HEARTBEAT_BUCKET_MARGIN))
    });
    if !expired_while_watching && obs.now < deadline {
        return Err(Some(deadline));
    }
    let since = last_write.map_or(watching, |w| w.max(watching));
    Ok(format!(
        "agent heartbeat absent for {}s while connected",
        obs.now.saturating_sub(since) / 1000
    ))
}

fn launching(b: &BackingNode, obs: &Observed) -> Step {
    let Some(rules) = obs.rules else {
        return Step::Fail("its label is no longer in the config".into());
    };
    if b.instance.is_some() && matches!(obs.agent, AgentSeen::Up { draining: false }) {
        return Step::BecomeReady;
    }
    let retry_or_fail = |reason: String| {
        if b.attempts < rules.launch_retries {
            Step::Launch {
                retry_reason: Some(reason),
                timeout: rules.launch_timeout,
            }
        } else {
            Step::Fail(format!(
                "{reason} (attempt {} of {})",
                b.attempts, rules.launch_retries
            ))
        }
    };
    let Some(launched_at) = b.launched_at else {
        return retry_or_fail("launch was interrupted".into());
    };
    if b.instance.is_none() && b.out_of_capacity {
        // Quota back-off: ask again later; requests keep waiting meanwhile.
        let again = after(launched_at, CAPACITY_BACKOFF);
        if obs.now < again {
            return Step::Wait(Some(again));
        }
        return Step::Launch {
            retry_reason: b.failure.clone(),
            timeout: rules.launch_timeout,
        };
    }
    if interrupted(b) {
        return Step::FindLaunched {
            timeout: rules.launch_timeout,
        };
    }
    if let (None, Some(failure)) = (&b.instance, &b.failure) {
        return retry_or_fail(failure.clone());
    }
    let deadline = after(launched_at, rules.boot_timeout);
    if obs.now >= deadline {
        let why = match obs.agent {
            AgentSeen::Impostor => "an agent with the wrong secret answered",
            _ => "its agent did not report",
        };
        return retry_or_fail(format!(
            "{why} within boot-timeout {}s",
            rules.boot_timeout.as_secs()
        ));
    }
    Step::Wait(Some(deadline))
}

fn ready(b: &BackingNode, obs: &Observed) -> Step {
    match obs.agent {
        AgentSeen::Absent => {
            return match agent_gone(obs) {
                Ok(why) => Step::Fail(format!("{why}: the backing node or its agent is gone")),
                Err(at) => Step::Wait(at),
            }
        }
        AgentSeen::Impostor => {
            return Step::Fail(
                "agent reports a different secret: not the instance that was launched".into(),
            )
        }
        AgentSeen::Up { draining: true } => {
            return Step::Retire("its agent is shutting down".into())
        }
        // A notice older than the launch (see `next`): its slots go on, no new ones.
        AgentSeen::Interrupted(_) => {
            return Step::Retire("its agent reports a spot interruption notice".into())
        }
        AgentSeen::Up { draining: false } => {}
    }
    let Some(rules) = obs.rules else {
        return Step::Retire("its label is no longer in the config".into());
    };
    let max_age = max_age_at(b, &rules);
    if max_age.is_some_and(|t| obs.now >= t) {
        return Step::Retire(format!("max-age {}s reached", rules.idle.max_age.as_secs()));
    }
    if let Some(max_uses) = rules.max_uses.filter(|n| b.uses >= *n) {
        return Step::Retire(format!("max-uses {max_uses} reached"));
    }
    if obs.used > 0 {
        return match b.idle_since {
            Some(_) => Step::SetIdleSince(None),
            None => Step::Wait(max_age),
        };
    }
    if b.idle_since.is_none() {
        return Step::SetIdleSince(Some(obs.now));
    }
    match b.idle {
        IdleBehaviour::Hold => Step::Wait(max_age),
        IdleBehaviour::Drain => Step::Release("drained by an operator".into()),
        IdleBehaviour::Run => {
            let at = release_at(b, obs, &rules);
            if obs.waiting > 0 {
                // Requests of its label wait: one of them claims it next. The queue
                // emptying wakes it (the supervisor looks at such nodes again).
                Step::Wait(max_age)
            } else if obs.free_ahead < obs.min_ready {
                // Its free slots keep the label's min-ready: kept, however long idle,
                // until the nodes ahead of it have enough free (a change wakes it), or
                // until the arrivals that keep it leave the warm-window.
                Step::Wait(min_opt(obs.ready_falls_at, max_age))
            } else if obs.now >= at {
                Step::Release("idle for its grace-time".into())
            } else {
                Step::Wait(min_opt(Some(at), max_age))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slotpool_protocol::model::Instance;
    use slotpool_protocol::BackingId;

    fn rules() -> Rules {
        Rules {
            idle: IdleRules {
                grace_time: Duration::from_secs(2),
                min_retention_time: Duration::ZERO,
                max_age: Duration::ZERO,
            },
            boot_timeout: Duration::from_secs(10),
            launch_timeout: Duration::from_secs(30),
            launch_retries: 2,
            max_uses: None,
        }
    }

    /// [`rules`] with one of its idle timers changed.
    fn with_idle(change: impl FnOnce(&mut IdleRules)) -> Rules {
        let mut r = rules();
        change(&mut r.idle);
        r
    }

    fn node(state: BackingState) -> BackingNode {
        BackingNode {
            v: 1,
            id: BackingId::parse("bn-1").unwrap(),
            provider: "p".into(),
            pool: "main".into(),
            seat: 0,
            label: "small".into(),
            backing_label: "large".into(),
            slots: 4,
            state,
            idle: IdleBehaviour::Run,
            instance: Some(Instance {
                id: "i".into(),
                host: "h".into(),
                data: serde_json::Value::Null,
            }),
            secret_sha256: "s".into(),
            created_at: 1_000,
            launched_at: Some(1_000),
            ready_at: Some(2_000),
            idle_since: Some(10_000),
            attempts: 1,
            out_of_capacity: false,
            create_queued: false,
            uses: 0,
            failure: None,
            attributes: Default::default(),
            order: None,
            interruption: None,
            updated_at: 2_000,
        }
    }

    fn obs(now: UnixMillis, used: u32) -> Observed {
        Observed {
            agent: AgentSeen::Up { draining: false },
            used,
            last_release: None,
            rules: Some(rules()),
            synced_since: Some(0),
            heartbeats_back_at: None,
            heartbeat_lost_at: None,
            heartbeat_ttl: Duration::from_secs(2),
            min_ready: 0,
            free_ahead: 0,
            ready_falls_at: None,
            waiting: 0,
            now,
        }
    }

    #[test]
    fn an_empty_node_is_not_released_while_requests_of_its_label_wait() {
        let b = node(BackingState::Ready); // idle since 10 s, grace 2 s
        let waiting = |waiting| Observed {
            waiting,
            ..obs(60_000, 0)
        };
        assert_eq!(
            next(&b, &waiting(1)),
            Step::Wait(None),
            "about to be claimed"
        );
        assert!(matches!(next(&b, &waiting(0)), Step::Release(_)));
        // Grace-time 0: a node that has just become ready is not released before the
        // request it was launched for claims it.
        let mut fresh = node(BackingState::Ready);
        fresh.idle_since = Some(60_000);
        let zero = Observed {
            rules: Some(with_idle(|i| i.grace_time = Duration::ZERO)),
            ..waiting(1)
        };
        assert_eq!(next(&fresh, &zero), Step::Wait(None));
        assert!(matches!(
            next(&fresh, &Observed { waiting: 0, ..zero }),
            Step::Release(_)
        ));
    }

    #[test]
    fn a_node_kept_for_the_warm_window_is_looked_at_when_an_arrival_leaves_it() {
        let b = node(BackingState::Ready);
        let kept = Observed {
            min_ready: 1,
            free_ahead: 0,
            ready_falls_at: Some(90_000),
            ..obs(60_000, 0)
        };
        assert_eq!(next(&b, &kept), Step::Wait(Some(90_000)));
    }

    #[test]
    fn an_idle_node_whose_free_slots_keep_min_ready_is_not_released() {
        let b = node(BackingState::Ready); // idle since 10 s, grace 2 s
        let late = 60_000;
        let warm = |min_ready, free_ahead| Observed {
            min_ready,
            free_ahead,
            ..obs(late, 0)
        };
        assert!(matches!(next(&b, &warm(0, 0)), Step::Release(_)));
        assert_eq!(
            next(&b, &warm(2, 0)),
            Step::Wait(None),
            "kept for min-ready"
        );
        assert_eq!(
            next(&b, &warm(2, 1)),
            Step::Wait(None),
            "one ahead is not two"
        );
        assert!(
            matches!(next(&b, &warm(2, 2)), Step::Release(_)),
            "the nodes ahead keep min-ready without it"
        );
        let mut aged = b.clone();
        aged.launched_at = Some(1_000);
        let rules = with_idle(|i| i.max_age = Duration::from_secs(30));
        let obs = Observed {
            rules: Some(rules),
            ..warm(2, 0)
        };
        assert!(
            matches!(next(&aged, &obs), Step::Retire(_)),
            "max-age still retires a warm node"
        );
    }

    #[test]
    fn a_node_that_handed_out_max_uses_slots_is_retired() {
        let mut b = node(BackingState::Ready);
        b.idle_since = None; // in use
        let used_up = Observed {
            rules: Some(Rules {
                max_uses: Some(3),
                ..rules()
            }),
            ..obs(3_000, 1)
        };
        b.uses = 2;
        assert_eq!(next(&b, &used_up), Step::Wait(None), "one use left");
        b.uses = 3;
        assert_eq!(
            next(&b, &used_up),
            Step::Retire("max-uses 3 reached".into())
        );
        assert_eq!(next(&b, &obs(3_000, 1)), Step::Wait(None), "no max-uses");
    }

    #[test]
    fn of_two_empty_nodes_only_the_later_counts_on_the_other() {
        let empty_a = ("p.main.0", 4, 0);
        let empty_b = ("p.main.1", 4, 0);
        let busy_c = ("p.main.2", 4, 3);
        assert_eq!(
            free_ahead(("p.main.0", 4), [empty_b, busy_c].into_iter()),
            1
        );
        assert_eq!(
            free_ahead(("p.main.1", 4), [empty_a, busy_c].into_iter()),
            4 + 1
        );
        // min-ready 2: node 0 stays (1 free ahead), node 1 may go (5): never both.
    }

    #[test]
    fn of_two_empty_nodes_the_bigger_counts_on_the_smaller() {
        let big = ("p.main.0", 8, 0);
        let small = ("p.main.1", 2, 0);
        assert_eq!(free_ahead(("p.main.0", 8), [small].into_iter()), 2);
        assert_eq!(free_ahead(("p.main.1", 2), [big].into_iter()), 0);
        // min-ready 2: the 2-slot node stays, the 8-slot one (on a lower seat) may go.
    }

    #[test]
    fn out_of_capacity_backs_off_and_retries_without_failing() {
        let mut b = node(BackingState::Launching);
        b.launched_at = Some(1_000);
        b.attempts = rules().launch_retries; // no counted attempts left
        b.out_of_capacity = true;
        b.instance = None;
        b.failure = Some("quota exceeded".into());
        let backoff = CAPACITY_BACKOFF.as_millis() as u64;
        assert_eq!(
            next(&b, &obs(1_000 + backoff - 1, 0)),
            Step::Wait(Some(1_000 + backoff))
        );
        assert_eq!(
            next(&b, &obs(1_000 + backoff, 0)),
            Step::Launch {
                retry_reason: Some("quota exceeded".into()),
                timeout: rules().launch_timeout,
            }
        );
    }

    #[test]
    fn a_kill_order_fails_the_node_in_any_live_state() {
        use slotpool_protocol::model::{OperatorAction, OperatorOrder};
        let order = OperatorOrder {
            action: OperatorAction::Kill,
            actor: "alice".into(),
            reason: Some("disk broken".into()),
            at: 1,
        };
        for state in [
            BackingState::Requested,
            BackingState::Launching,
            BackingState::Ready,
            BackingState::Retiring,
        ] {
            let mut b = node(state);
            b.order = Some(order.clone());
            assert_eq!(
                next(&b, &obs(10_000, 1)),
                Step::Fail("killed by alice: disk broken".into()),
                "{state:?}"
            );
        }
        let mut releasing = node(BackingState::Releasing);
        releasing.order = Some(order);
        assert_eq!(
            next(&releasing, &obs(10_000, 0)),
            Step::FinishRelease,
            "a node already being released just finishes"
        );
    }

    #[test]
    fn empty_node_is_released_after_grace_time_never_before() {
        let b = node(BackingState::Ready);
        assert_eq!(next(&b, &obs(11_999, 0)), Step::Wait(Some(12_000)));
        assert_eq!(
            next(&b, &obs(12_000, 0)),
            Step::Release("idle for its grace-time".into())
        );
    }

    #[test]
    fn a_later_slot_return_seen_locally_restarts_the_grace_time() {
        let b = node(BackingState::Ready);
        let mut o = obs(12_500, 0);
        o.last_release = Some(11_000);
        assert_eq!(next(&b, &o), Step::Wait(Some(13_000)));
    }

    #[test]
    fn min_retention_holds_an_idle_node_past_grace() {
        let b = node(BackingState::Ready);
        let mut o = obs(12_000, 0);
        o.rules = Some(with_idle(|i| {
            i.min_retention_time = Duration::from_secs(30)
        }));
        assert_eq!(next(&b, &o), Step::Wait(Some(31_000)));
    }

    #[test]
    fn max_age_retires_and_empty_retiring_node_is_released() {
        let b = node(BackingState::Ready);
        let mut o = obs(7_000, 2);
        o.rules = Some(with_idle(|i| i.max_age = Duration::from_secs(5)));
        assert_eq!(next(&b, &o), Step::Retire("max-age 5s reached".into()));
        let r = node(BackingState::Retiring);
        assert_eq!(next(&r, &o), Step::Wait(None));
        assert_eq!(
            next(&r, &obs(7_000, 0)),
            Step::Release("retired and empty".into())
        );
    }

    #[test]
    fn each_release_and_failure_is_counted_for_its_reason() {
        use slotpool_protocol::model::{OperatorAction, OperatorOrder};
        let reason = |b: &BackingNode, o: &Observed| deletion_reason(b, &next(b, o), o);
        let idle = node(BackingState::Ready);
        assert_eq!(reason(&idle, &obs(99_000, 0)), Some(DeletionReason::Grace));
        let mut drained = node(BackingState::Ready);
        drained.idle = IdleBehaviour::Drain;
        assert_eq!(
            reason(&drained, &obs(99_000, 0)),
            Some(DeletionReason::Drain)
        );
        let retiring = node(BackingState::Retiring);
        let mut aged = obs(7_000, 0);
        aged.rules = Some(with_idle(|i| i.max_age = Duration::from_secs(5)));
        assert_eq!(reason(&retiring, &aged), Some(DeletionReason::MaxAge));
        assert_eq!(
            reason(&retiring, &obs(7_000, 0)),
            Some(DeletionReason::Retired),
            "retired for another reason (no max-age)"
        );
        let mut killed = node(BackingState::Ready);
        killed.order = Some(OperatorOrder {
            action: OperatorAction::Kill,
            actor: "alice".into(),
            at: 1,
            reason: None,
        });
        assert_eq!(reason(&killed, &obs(5_000, 1)), Some(DeletionReason::Kill));
        let mut lost = obs(20_000, 0);
        lost.agent = AgentSeen::Absent;
        lost.heartbeat_lost_at = Some(10_000);
        assert_eq!(
            reason(&node(BackingState::Ready), &lost),
            Some(DeletionReason::Failure)
        );
        assert_eq!(reason(&node(BackingState::Ready), &obs(5_000, 1)), None);
    }

    #[test]
    fn busy_node_clears_idle_since_and_empty_one_sets_it() {
        let b = node(BackingState::Ready);
        assert_eq!(next(&b, &obs(5_000, 1)), Step::SetIdleSince(None));
        let mut fresh = node(BackingState::Ready);
        fresh.idle_since = None;
        assert_eq!(
            next(&fresh, &obs(5_000, 0)),
            Step::SetIdleSince(Some(5_000))
        );
    }

    #[test]
    fn hold_and_drain() {
        let mut b = node(BackingState::Ready);
        b.idle = IdleBehaviour::Hold;
        assert_eq!(next(&b, &obs(99_000, 0)), Step::Wait(None));
        b.idle = IdleBehaviour::Drain;
        assert_eq!(
            next(&b, &obs(10_001, 0)),
            Step::Release("drained by an operator".into())
        );
    }

    #[test]
    fn lost_agent_fails_a_ready_node() {
        let b = node(BackingState::Ready);
        let mut o = obs(20_000, 2);
        o.agent = AgentSeen::Absent;
        o.heartbeat_lost_at = Some(20_000);
        assert_eq!(
            next(&b, &o),
            Step::Fail(
                "agent heartbeat absent for 2s while connected: \
                 the backing node or its agent is gone"
                    .into()
            ),
            "expired while connected: the TTL ran out with the launcher watching"
        );
        o.agent = AgentSeen::Impostor;
        assert!(matches!(next(&b, &o), Step::Fail(r) if r.contains("different secret")));
    }

    #[test]
    fn a_missing_heartbeat_counts_only_while_connected_and_synced() {
        let b = node(BackingState::Ready);
        let grace = (2_000 + HEARTBEAT_RECONNECT_MARGIN.as_millis()) as u64;
        let mut o = obs(50_000, 2);
        o.agent = AgentSeen::Absent;
        o.synced_since = None;
        assert_eq!(
            next(&b, &o),
            Step::Wait(None),
            "disconnected: nothing to judge"
        );
        // Back on the bus at 50 s; the heartbeat expired during the outage, and the
        // reload found it gone.
        o.synced_since = Some(50_000);
        o.heartbeat_lost_at = Some(50_010);
        assert_eq!(next(&b, &o), Step::Wait(Some(50_000 + grace)));
        o.now = 50_000 + grace - 1;
        assert_eq!(next(&b, &o), Step::Wait(Some(50_000 + grace)));
        // Written after the launcher was back, then expired with it watching: KV's word.
        let mut expired = o;
        expired.heartbeat_lost_at = Some(53_000);
        expired.now = 53_000;
        assert!(
            matches!(next(&b, &expired), Step::Fail(r) if r.starts_with("agent heartbeat absent for 2s"))
        );
        o.now = 50_000 + grace;
        assert_eq!(
            next(&b, &o),
            Step::Fail(format!(
                "agent heartbeat absent for {}s while connected: \
                 the backing node or its agent is gone",
                grace / 1000
            ))
        );
        let retiring = node(BackingState::Retiring);
        o.now = 50_001;
        assert_eq!(next(&retiring, &o), Step::Wait(Some(50_000 + grace)));
        o.now = 50_000 + grace;
        assert!(
            matches!(next(&retiring, &o), Step::Fail(r) if r.starts_with("retiring: agent heartbeat absent"))
        );
    }

    #[test]
    fn a_missing_heartbeat_counts_only_after_the_heartbeats_bucket_is_back() {
        let b = node(BackingState::Ready);
        let grace = (2_000 + HEARTBEAT_BUCKET_MARGIN.as_millis()) as u64;
        // Connected since 0. The bucket's leader died at 10 s, one was elected at 14.5 s,
        // which expired the heartbeat last written at 10 s: the mirror lost it at 14.5 s.
        let mut o = obs(14_500, 2);
        o.agent = AgentSeen::Absent;
        o.heartbeat_lost_at = Some(14_500);
        assert!(
            matches!(next(&b, &o), Step::Fail(_)),
            "before the election is known, the expiry looks like KV's word"
        );
        // The look at the bucket found the election: the clock restarts there.
        o.heartbeats_back_at = Some(14_500);
        assert_eq!(next(&b, &o), Step::Wait(Some(14_500 + grace)));
        o.now = 14_500 + grace - 1;
        assert_eq!(next(&b, &o), Step::Wait(Some(14_500 + grace)));
        // A dead agent is failed one grace after the bucket is back.
        o.now = 14_500 + grace;
        assert_eq!(
            next(&b, &o),
            Step::Fail(format!(
                "agent heartbeat absent for {}s while connected: \
                 the backing node or its agent is gone",
                grace / 1000
            ))
        );
        // A heartbeat written after the bucket was back, then expired: KV's word.
        let mut expired = o;
        expired.heartbeat_lost_at = Some(17_000);
        expired.now = 17_000;
        assert!(
            matches!(next(&b, &expired), Step::Fail(r) if r.starts_with("agent heartbeat absent for 2s"))
        );
        // A bucket back long ago changes nothing.
        let mut old = expired;
        old.heartbeats_back_at = Some(1_000);
        assert_eq!(next(&b, &old), next(&b, &expired));
        // The later of a reconnect's grace and the bucket's wins.
        let mut both = o;
        both.synced_since = Some(14_000);
        both.now = 14_500 + grace;
        let reconnect_grace = (2_000 + HEARTBEAT_RECONNECT_MARGIN.as_millis()) as u64;
        assert_eq!(next(&b, &both), Step::Wait(Some(14_000 + reconnect_grace)));
        both.synced_since = None;
        assert_eq!(next(&b, &both), Step::Wait(None));
    }

    #[test]
    fn launching_waits_for_the_agent_then_retries_then_fails() {
        let mut b = node(BackingState::Launching);
        let mut o = obs(5_000, 0);
        o.agent = AgentSeen::Absent;
        assert_eq!(next(&b, &o), Step::Wait(Some(11_000)));
        o.now = 11_000;
        assert!(
            matches!(next(&b, &o), Step::Launch { retry_reason: Some(r), .. } if r.contains("did not report"))
        );
        b.attempts = 2;
        assert!(matches!(next(&b, &o), Step::Fail(r) if r.contains("attempt 2 of 2")));
        o.agent = AgentSeen::Up { draining: false };
        assert_eq!(next(&b, &o), Step::BecomeReady);
    }

    #[test]
    fn a_requested_node_launches_within_its_pools_launch_timeout_or_fails_without_a_label() {
        let b = node(BackingState::Requested);
        let mut o = obs(5_000, 0);
        assert_eq!(
            next(&b, &o),
            Step::Launch {
                retry_reason: None,
                timeout: Duration::from_secs(30),
            }
        );
        o.rules = None;
        assert!(
            matches!(next(&b, &o), Step::Fail(r) if r.contains("no longer in the config")),
            "no machine is made for a label the configuration dropped"
        );
    }

    #[test]
    fn an_attempt_counts_against_launch_retries_unless_the_last_was_refused_for_capacity() {
        // (attempts, refused for capacity) -> attempts counted after the new one
        for (attempts, capacity, counted) in
            [(0, false, 1), (1, false, 2), (1, true, 1), (2, true, 2)]
        {
            let mut b = node(BackingState::Launching);
            b.attempts = attempts;
            b.out_of_capacity = capacity;
            b.failure = Some("earlier".into());
            let a = attempt(&b, "digest".into(), 7_000);
            assert_eq!(
                a.attempts, counted,
                "attempts {attempts}, capacity {capacity}"
            );
            assert_eq!(a.state, BackingState::Launching);
            assert_eq!(
                (
                    a.launched_at,
                    a.instance,
                    a.failure,
                    a.ready_at,
                    a.idle_since
                ),
                (Some(7_000), None, None, None, None),
                "nothing of the earlier attempt is left"
            );
            assert!(!a.out_of_capacity);
            assert_eq!(a.secret_sha256, "digest");
        }
    }

    #[test]
    fn the_end_of_an_attempt_decides_what_is_written_counted_and_cleaned_up() {
        let mut b = attempt(&node(BackingState::Requested), "d".into(), 1_000);
        b.attempts = 2;
        let refused = |kind| AttemptEnd::Refused {
            error: "no".into(),
            kind,
        };
        // end -> (instance recorded, failure, out of capacity, counted, unrecorded deleted)
        let cases = [
            (
                AttemptEnd::Launched {
                    instance: Instance {
                        id: "i-1".into(),
                        host: "h".into(),
                        data: serde_json::Value::Null,
                    },
                    attributes: Default::default(),
                },
                (true, None, false, LaunchOutcome::Launched, false),
            ),
            (
                refused(ProviderErrorKind::Capacity),
                (false, Some("no"), true, LaunchOutcome::Capacity, false),
            ),
            (
                refused(ProviderErrorKind::Timeout),
                (false, Some("no"), false, LaunchOutcome::Failed, true),
            ),
            (
                refused(ProviderErrorKind::Failed),
                (false, Some("no"), false, LaunchOutcome::Failed, false),
            ),
        ];
        for (end, want) in cases {
            let e = after_attempt(&b, end.clone());
            let got = (
                e.record.instance.is_some(),
                e.record.failure.as_deref(),
                e.record.out_of_capacity,
                e.counted,
                e.delete_unrecorded,
            );
            assert_eq!(got, want, "{end:?}");
            assert_eq!(e.record.attempts, 2, "the end of an attempt counts nothing");
            assert_eq!(e.record.state, BackingState::Launching);
        }
        // What `next` then does with the record: a capacity refusal waits out the
        // back-off and is not counted; a failure is retried until launch-retries.
        let capacity = after_attempt(&b, refused(ProviderErrorKind::Capacity)).record;
        assert!(matches!(
            next(&capacity, &obs(1_000, 0)),
            Step::Wait(Some(_))
        ));
        let relaunched = attempt(&capacity, "d".into(), 20_000);
        assert_eq!(relaunched.attempts, 2);
        let failed = after_attempt(&b, refused(ProviderErrorKind::Failed)).record;
        assert!(
            matches!(next(&failed, &obs(1_000, 0)), Step::Fail(r) if r.contains("attempt 2 of 2")),
            "launch-retries 2 are used"
        );
    }

    #[test]
    fn a_boot_that_timed_out_is_told_apart_from_other_ends_of_an_attempt() {
        let b = node(BackingState::Launching); // launched at 1 s, boot-timeout 10 s
        let mut o = obs(11_000, 0);
        o.agent = AgentSeen::Absent;
        let relaunch = next(&b, &o);
        assert!(matches!(relaunch, Step::Launch { .. }), "{relaunch:?}");
        assert!(boot_failed(&b, &relaunch, &o), "the first attempt's boot");
        let mut last = b.clone();
        last.attempts = 2;
        let fail = next(&last, &o);
        assert!(matches!(fail, Step::Fail(_)), "{fail:?}");
        assert!(boot_failed(&last, &fail, &o), "the last attempt's boot");
        o.agent = AgentSeen::Impostor;
        assert!(
            boot_failed(&b, &next(&b, &o), &o),
            "the wrong agent came up"
        );
        // Not a boot that timed out: the launch itself failed (no instance), the time is
        // not up, an operator killed it, or its label is gone.
        o.agent = AgentSeen::Absent;
        let mut refused = b.clone();
        refused.instance = None;
        refused.failure = Some("quota".into());
        assert!(!boot_failed(&refused, &next(&refused, &o), &o));
        let early = obs(5_000, 0);
        assert!(!boot_failed(&b, &next(&b, &early), &early));
        let mut killed = b.clone();
        killed.order = Some(slotpool_protocol::model::OperatorOrder {
            action: slotpool_protocol::model::OperatorAction::Kill,
            actor: "alice".into(),
            at: 1,
            reason: None,
        });
        assert!(!boot_failed(&killed, &next(&killed, &o), &o));
        let gone = Observed { rules: None, ..o };
        assert!(!boot_failed(&b, &next(&b, &gone), &gone));
        let ready = node(BackingState::Ready);
        assert!(!boot_failed(&ready, &Step::Fail("x".into()), &o));
    }

    #[test]
    fn failed_launch_attempt_is_retried_with_its_reason() {
        let mut b = node(BackingState::Launching);
        b.instance = None;
        b.failure = Some("quota exceeded".into());
        let mut o = obs(5_000, 0);
        o.agent = AgentSeen::Absent;
        assert_eq!(
            next(&b, &o),
            Step::Launch {
                retry_reason: Some("quota exceeded".into()),
                timeout: rules().launch_timeout,
            }
        );
    }

    /// A launcher killed after the provider started the machine and before the end of
    /// the attempt was written left a record that says the attempt began and nothing
    /// else: its successor asks the provider for the machine and adopts it, never fails
    /// the node for it (with `launch-retries: 1` that failed the node and its waiting
    /// requests, and left the machine's agent running with nothing owning it).
    #[test]
    fn an_interrupted_attempt_is_looked_for_at_the_provider_and_not_counted() {
        let mut b = attempt(&node(BackingState::Requested), "d".into(), 1_000);
        b.attempts = rules().launch_retries; // no counted attempts left
        assert!(interrupted(&b));
        for agent in [AgentSeen::Absent, AgentSeen::Up { draining: false }] {
            let mut o = obs(2_000, 0);
            o.agent = agent;
            assert_eq!(
                next(&b, &o),
                Step::FindLaunched {
                    timeout: rules().launch_timeout
                },
                "{agent:?}"
            );
        }
        // It started nothing: the next attempt stands for it.
        let again = attempt(&b, "e".into(), 3_000);
        assert_eq!(again.attempts, b.attempts, "not counted");
        // What ended, one way or another, is not interrupted.
        let mut failed = b.clone();
        failed.failure = Some("no".into());
        let mut launched = b.clone();
        launched.instance = node(BackingState::Ready).instance;
        let mut capacity = failed.clone();
        capacity.out_of_capacity = true;
        for ended in [failed, launched, capacity] {
            assert!(!interrupted(&ended), "{ended:?}");
        }
        assert!(!interrupted(&node(BackingState::Ready)));
        let i = |id: &str| Instance {
            id: id.into(),
            host: "h".into(),
            data: serde_json::Value::Null,
        };
        assert_eq!(found(vec![]), None);
        assert_eq!(
            found(vec![i("a"), i("b")]),
            Some((i("a"), vec![i("b")])),
            "one adopted, the others deleted"
        );
    }

    fn notice() -> Interruption {
        Interruption {
            action: slotpool_protocol::model::InterruptionAction::Terminate,
            at: Some(1_505_722_920_000),
            noticed_at: 5_000,
        }
    }

    #[test]
    fn a_spot_interruption_fails_the_node_at_once_whatever_else_is_due() {
        let mut o = obs(5_000, 2);
        o.agent = AgentSeen::Interrupted(notice());
        for state in [
            BackingState::Launching,
            BackingState::Ready,
            BackingState::Retiring,
        ] {
            let b = node(state);
            assert_eq!(next(&b, &o), Step::Interrupted(notice()), "{state:?}");
            assert_eq!(
                deletion_reason(&b, &next(&b, &o), &o),
                Some(DeletionReason::SpotInterruption)
            );
        }
        // Past max-age, idle, or held: failed all the same.
        let mut held = node(BackingState::Ready);
        held.idle = IdleBehaviour::Hold;
        let idle = Observed { used: 0, ..o };
        assert_eq!(next(&held, &idle), Step::Interrupted(notice()));
        // A node already on its way out goes on as it was.
        assert_eq!(
            next(&node(BackingState::Releasing), &o),
            Step::FinishRelease
        );
        assert_eq!(next(&node(BackingState::Failed), &o), Step::CleanUp);
        // A notice read before this attempt launched is not about its machine: no
        // failure for it (and no slots: the agent is not up).
        let mut relaunched = node(BackingState::Launching);
        relaunched.launched_at = Some(6_000);
        assert_eq!(next(&relaunched, &o), Step::Wait(Some(16_000)));
        // An operator's kill says more than the cloud.
        let mut killed = node(BackingState::Ready);
        killed.order = Some(slotpool_protocol::model::OperatorOrder {
            action: slotpool_protocol::model::OperatorAction::Kill,
            actor: "alice".into(),
            at: 1,
            reason: None,
        });
        assert_eq!(next(&killed, &o), Step::Fail("killed by alice".into()));
    }

    #[test]
    fn an_interruption_failure_says_so_first_then_what_and_when() {
        assert_eq!(
            interruption_failure(&notice()),
            "spot interruption: the cloud takes the machine back (terminate at 2017-09-18T08:22:00Z)"
        );
        let mut n = notice();
        n.at = None;
        n.action = slotpool_protocol::model::InterruptionAction::Stop;
        assert_eq!(
            interruption_failure(&n),
            "spot interruption: the cloud takes the machine back (stop)"
        );
    }

    #[test]
    fn a_failed_seat_rests_unless_its_machine_was_taken_back() {
        let mut b = node(BackingState::Failed);
        b.updated_at = 7_000;
        assert_eq!(seat_rest_end(&b), None, "its instance is not deleted yet");
        b.instance = None;
        assert_eq!(
            seat_rest_end(&b),
            Some(7_000 + FAILED_SEAT_COOLDOWN.as_millis() as u64)
        );
        b.interruption = Some(notice());
        assert_eq!(seat_rest_end(&b), Some(7_000), "no rest");
        assert_eq!(seat_rest_end(&node(BackingState::Ready)), None);
    }

    mod generated {
        use super::*;
        use proptest::prelude::*;

        fn any_state() -> impl Strategy<Value = BackingState> {
            prop::sample::select(vec![
                BackingState::Requested,
                BackingState::Launching,
                BackingState::Ready,
                BackingState::Retiring,
                BackingState::Releasing,
                BackingState::Failed,
            ])
        }

        /// Agents as seen; a notice read from 2 s before the attempt (launched at 1 s)
        /// to 3 s after it.
        fn any_agent() -> impl Strategy<Value = AgentSeen> {
            prop_oneof![
                Just(AgentSeen::Absent),
                Just(AgentSeen::Impostor),
                any::<bool>().prop_map(|draining| AgentSeen::Up { draining }),
                (0u64..4_000).prop_map(|noticed_at| AgentSeen::Interrupted(Interruption {
                    noticed_at,
                    ..notice()
                })),
            ]
        }

        fn any_idle() -> impl Strategy<Value = IdleBehaviour> {
            prop::sample::select(vec![
                IdleBehaviour::Run,
                IdleBehaviour::Hold,
                IdleBehaviour::Drain,
            ])
        }

        proptest! {
            /// Whatever the node and the world: a node on a machine being taken back is
            /// never made ready nor kept as if nothing happened; one whose notice is of
            /// its launch attempt fails for it unless it is already going or killed, and
            /// is never launched into again; nothing but such a notice fails a node for
            /// an interruption.
            #[test]
            fn an_interrupted_machine_is_failed_for_it_and_nothing_else_is(
                state in any_state(),
                agent in any_agent(),
                idle in any_idle(),
                has_instance in any::<bool>(),
                killed in any::<bool>(),
                used in 0u32..4,
                now in 0u64..200_000,
                waiting in 0u32..3,
                min_ready in 0u32..3,
                max_age_secs in 0u64..20,
            ) {
                let mut b = node(state);
                b.idle = idle;
                if !has_instance {
                    b.instance = None;
                }
                if killed {
                    b.order = Some(slotpool_protocol::model::OperatorOrder {
                        action: slotpool_protocol::model::OperatorAction::Kill,
                        actor: "alice".into(),
                        at: 1,
                        reason: None,
                    });
                }
                let mut o = obs(now, used);
                o.agent = agent;
                o.waiting = waiting;
                o.min_ready = min_ready;
                o.rules = Some(Rules {
                    idle: IdleRules {
                        max_age: Duration::from_secs(max_age_secs),
                        ..rules().idle
                    },
                    ..rules()
                });
                let step = next(&b, &o);
                let live = matches!(
                    state,
                    BackingState::Launching | BackingState::Ready | BackingState::Retiring
                );
                match agent {
                    AgentSeen::Interrupted(n) => {
                        prop_assert!(
                            !matches!(step, Step::BecomeReady | Step::SetIdleSince(_)),
                            "{state:?} on a machine being taken back: {step:?}"
                        );
                        let of_this_attempt = n.noticed_at >= b.launched_at.unwrap();
                        if of_this_attempt && live {
                            prop_assert!(
                                !matches!(
                                    step,
                                    Step::Retire(_)
                                        | Step::Release(_)
                                        | Step::Launch { .. }
                                        | Step::Wait(_)
                                ),
                                "{state:?} on a machine being taken back: {step:?}"
                            );
                            if !killed {
                                prop_assert_eq!(&step, &Step::Interrupted(n));
                            }
                        } else {
                            prop_assert!(!matches!(step, Step::Interrupted(_)), "{step:?}");
                        }
                    }
                    _ => prop_assert!(!matches!(step, Step::Interrupted(_)), "{step:?}"),
                }
                let reason = deletion_reason(&b, &step, &o);
                prop_assert_eq!(
                    reason == Some(DeletionReason::SpotInterruption),
                    matches!(step, Step::Interrupted(_))
                );
            }
        }
    }

    #[test]
    fn failed_node_is_cleaned_up_then_forgotten() {
        let mut b = node(BackingState::Failed);
        assert_eq!(next(&b, &obs(5_000, 0)), Step::CleanUp);
        b.instance = None;
        let forget = after(b.updated_at, FAILED_RETENTION);
        assert_eq!(next(&b, &obs(5_000, 0)), Step::Wait(Some(forget)));
        assert_eq!(next(&b, &obs(forget, 0)), Step::Forget);
    }
}
