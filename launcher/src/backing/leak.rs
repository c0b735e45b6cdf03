//! The leak sweep: machines a provider lists that no backing record owns (a launch
//! interrupted before its instance was recorded, an instance a relaunch or a failed
//! delete left behind) are deleted, one grace after they were first seen unowned.
//!
//! [`Sightings::sweep`] is the decision, pure and unit tested; [`spawn`] runs one task per
//! provider that creates machines. Every `leak-sweep-interval` each launcher tries to
//! take the provider's sweep lease ([`layout::leak_sweep_lease_key`]), so only one
//! launcher sweeps a provider at a time; the holder lists the provider's machines, reads
//! every backing record from KV (not the mirror, which may be behind) and deletes what
//! the decision names, each deletion recorded in the event log with reason `leak`.
//!
//! A machine is owned when a backing record of its provider names it (by instance id),
//! or when its backing id is that of a record whose launch may still be in flight
//! (`requested`, or `launching` with no instance recorded yet): such a record's launch
//! writes its instance only once the provider returns. A machine listed without a
//! backing id is left alone while any launch of the provider is in flight. The providers
//! report no creation time, so a machine's age is counted from when this launcher first
//! listed it unowned: a launcher that starts (or takes the sweep over) waits one grace
//! before deleting anything.

use crate::events;
use crate::lease;
use crate::metrics;
use crate::provider::{ListedInstance, Provider};
use crate::shared::Shared;
use slotpool_protocol::layout;
use slotpool_protocol::model::{BackingNode, BackingState, Instance};
use slotpool_protocol::store::KvError;
use slotpool_protocol::time::{now_ms, UnixMillis};
use slotpool_protocol::BackingId;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// What the sweep makes of one listed machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A backing record names it.
    Owned,
    /// A launch that may still be in flight could own it.
    InFlight,
    /// Nobody owns it: `why` says so in words.
    Unowned { why: String },
}

/// Whether the backing records `records` (all of the listed machine's provider) own
/// `listed`.
pub fn judge(listed: &ListedInstance, records: &[&BackingNode]) -> Verdict {
    let id = &listed.instance.id;
    if records
        .iter()
        .any(|r| r.instance.as_ref().is_some_and(|i| &i.id == id))
    {
        return Verdict::Owned;
    }
    let in_flight = |r: &&&BackingNode| {
        r.state == BackingState::Requested
            || (r.state == BackingState::Launching && r.instance.is_none())
    };
    match &listed.backing_id {
        Some(backing_id) => match records.iter().find(|r| &r.id == backing_id) {
            None => Verdict::Unowned {
                why: format!("no backing record has id {backing_id}"),
            },
            Some(r) if in_flight(&r) => Verdict::InFlight,
            Some(r) => Verdict::Unowned {
                why: match &r.instance {
                    Some(i) => format!(
                        "backing node {backing_id} ({:?}) records instance {} instead",
                        r.state, i.id
                    ),
                    None => format!(
                        "backing node {backing_id} ({:?}) records no instance",
                        r.state
                    ),
                },
            },
        },
        None if records.iter().any(|r| in_flight(&r)) => Verdict::InFlight,
        None => Verdict::Unowned {
            why: "listed without a backing id and no backing record names it".into(),
        },
    }
}

/// A machine the sweep deletes.
#[derive(Clone, Debug, PartialEq)]
pub struct Leak {
    pub instance: Instance,
    pub backing_id: Option<BackingId>,
    pub why: String,
    /// How long it has been seen unowned.
    pub unowned_for: Duration,
}

/// When each unowned machine of one provider was first seen unowned (by instance id).
/// Pure bookkeeping: the clock comes in as an argument.
#[derive(Debug, Default)]
pub struct Sightings {
    first_seen: HashMap<String, UnixMillis>,
}

impl Sightings {
    /// Judges every listed machine against `records` at `now` and returns the leaks: those
    /// seen unowned for at least `grace`. Machines owned again, or no longer listed, are
    /// forgotten (should one come back unowned, its grace starts over).
    pub fn sweep(
        &mut self,
        listed: &[ListedInstance],
        records: &[&BackingNode],
        now: UnixMillis,
        grace: Duration,
    ) -> Vec<Leak> {
        let mut seen = HashMap::new();
        let mut leaks = Vec::new();
        for l in listed {
            let Verdict::Unowned { why } = judge(l, records) else {
                continue;
            };
            let id = &l.instance.id;
            let first = self.first_seen.get(id).copied().unwrap_or(now).min(now);
            seen.insert(id.clone(), first);
            let unowned_for = Duration::from_millis(now - first);
            if unowned_for >= grace {
                leaks.push(Leak {
                    instance: l.instance.clone(),
                    backing_id: l.backing_id.clone(),
                    why,
                    unowned_for,
                });
            }
        }
        self.first_seen = seen;
        leaks
    }
}

/// Starts the sweep of every configured provider that creates machines (not `static`).
pub fn spawn(shared: &Arc<Shared>) {
    for p in &shared.config.providers {
        let Some(provider) = shared.providers.get(&p.name).cloned() else {
            continue;
        };
        if !provider.creates_machines() {
            continue;
        }
        let span = tracing::info_span!("leak_sweep", provider = %p.name);
        let (sh, interval, grace) = (shared.clone(), p.leak_sweep_interval, p.leak_grace);
        shared
            .tracker
            .spawn(run(sh, provider, interval, grace).instrument(span));
    }
}

async fn run(sh: Arc<Shared>, provider: Arc<dyn Provider>, interval: Duration, grace: Duration) {
    let mut sightings = Sightings::default();
    loop {
        tokio::select! {
            _ = sh.shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        if let Err(err) = sweep_once(&sh, provider.as_ref(), &mut sightings, grace).await {
            tracing::warn!(%err, "leak sweep skipped");
        }
    }
}

/// Why a sweep did not run to its end.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("listing machines: {0}")]
    List(#[from] crate::provider::ProviderError),
    /// A record that cannot be read might own any machine: nothing is deleted.
    #[error("a backing record is unreadable, so its machine cannot be told from a leak: {0}")]
    Unreadable(KvError),
}

/// One sweep of `provider`, if no other launcher is sweeping it.
async fn sweep_once(
    sh: &Arc<Shared>,
    provider: &dyn Provider,
    sightings: &mut Sightings,
    grace: Duration,
) -> Result<(), SweepError> {
    let key = layout::leak_sweep_lease_key(provider.name());
    let Some(lease) = lease::acquire(sh, &key).await? else {
        tracing::debug!("another launcher is sweeping this provider");
        return Ok(());
    };
    let result = sweep_held(sh, provider, sightings, grace, &lease.lost).await;
    lease.release().await;
    result
}

async fn sweep_held(
    sh: &Arc<Shared>,
    provider: &dyn Provider,
    sightings: &mut Sightings,
    grace: Duration,
    lost: &tokio_util::sync::CancellationToken,
) -> Result<(), SweepError> {
    let listed = provider.list().await?;
    let mut records = Vec::new();
    for r in sh.bus.backing.list::<BackingNode>().await? {
        match r {
            Ok(r) => records.push(r.value),
            Err(err) => return Err(SweepError::Unreadable(err)),
        }
    }
    let mine: Vec<&BackingNode> = records
        .iter()
        .filter(|r| r.provider == provider.name())
        .collect();
    let leaks = sightings.sweep(&listed, &mine, now_ms(), grace);
    tracing::debug!(listed = listed.len(), leaks = leaks.len(), "leak sweep");
    for leak in leaks {
        if lost.is_cancelled() {
            break;
        }
        let instance = &leak.instance;
        match provider.delete(instance).await {
            Ok(()) => {
                tracing::warn!(instance = %instance.id, host = %instance.host, why = %leak.why, "deleted a leaked machine");
                metrics::leak_deletion(provider.name());
                events::leak_deleted(
                    sh,
                    leak.backing_id.as_ref(),
                    format!(
                        "leaked machine {} on {} deleted (unowned for {}s): {}",
                        instance.id,
                        instance.host,
                        leak.unowned_for.as_secs(),
                        leak.why
                    ),
                );
            }
            Err(err) => {
                tracing::warn!(instance = %instance.id, %err, "cannot delete a leaked machine; the next sweep tries again")
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, state: BackingState, instance: Option<&str>) -> BackingNode {
        let mut b = crate::world::tests_support::backing(id, "small", 2, state).value;
        b.provider = "cloud".into();
        b.instance = instance.map(|i| Instance {
            id: i.into(),
            host: "10.0.0.1".into(),
            data: serde_json::Value::Null,
        });
        b
    }

    fn listed(id: &str, backing_id: Option<&str>) -> ListedInstance {
        ListedInstance {
            instance: Instance {
                id: id.into(),
                host: "10.0.0.9".into(),
                data: serde_json::Value::Null,
            },
            backing_id: backing_id.map(|b| BackingId::parse(b).unwrap()),
        }
    }

    #[test]
    fn a_recorded_instance_is_owned_whatever_the_backing_id_says() {
        let r = record("bn-a", BackingState::Ready, Some("i-1"));
        assert_eq!(judge(&listed("i-1", Some("bn-a")), &[&r]), Verdict::Owned);
        assert_eq!(judge(&listed("i-1", None), &[&r]), Verdict::Owned);
    }

    #[test]
    fn a_launch_in_flight_protects_its_backing_id() {
        for state in [BackingState::Requested, BackingState::Launching] {
            let r = record("bn-a", state, None);
            assert_eq!(
                judge(&listed("i-1", Some("bn-a")), &[&r]),
                Verdict::InFlight
            );
            assert_eq!(judge(&listed("i-1", None), &[&r]), Verdict::InFlight);
            assert!(matches!(
                judge(&listed("i-2", Some("bn-other")), &[&r]),
                Verdict::Unowned { .. }
            ));
        }
    }

    #[test]
    fn unowned_machines_say_why() {
        let ready = record("bn-a", BackingState::Ready, Some("i-1"));
        let failed = record("bn-f", BackingState::Failed, None);
        let why = |l: ListedInstance| match judge(&l, &[&ready, &failed]) {
            Verdict::Unowned { why } => why,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            why(listed("i-9", Some("bn-gone"))),
            "no backing record has id bn-gone"
        );
        assert!(
            why(listed("i-2", Some("bn-a"))).contains("records instance i-1 instead"),
            "an earlier attempt's instance"
        );
        assert!(why(listed("i-3", Some("bn-f"))).contains("records no instance"));
        assert!(why(listed("i-4", None)).contains("without a backing id"));
    }

    #[test]
    fn a_leak_is_deleted_only_after_the_grace() {
        let grace = Duration::from_secs(60);
        let r = record("bn-a", BackingState::Ready, Some("i-1"));
        let all = [listed("i-1", Some("bn-a")), listed("i-9", Some("bn-gone"))];
        let mut s = Sightings::default();
        assert!(s.sweep(&all, &[&r], 1_000, grace).is_empty(), "first seen");
        assert!(
            s.sweep(&all, &[&r], 60_999, grace).is_empty(),
            "still young"
        );
        let leaks = s.sweep(&all, &[&r], 61_000, grace);
        assert_eq!(leaks.len(), 1);
        assert_eq!(leaks[0].instance.id, "i-9");
        assert_eq!(leaks[0].unowned_for, grace);
    }

    #[test]
    fn a_machine_owned_again_or_gone_starts_its_grace_over() {
        let grace = Duration::from_secs(60);
        let l = [listed("i-1", Some("bn-a"))];
        let launching = record("bn-a", BackingState::Launching, None);
        let failed = record("bn-a", BackingState::Failed, None);
        let mut s = Sightings::default();
        assert!(s.sweep(&l, &[&failed], 0, grace).is_empty());
        // Its seat launched again: in flight, so forgotten.
        assert!(s.sweep(&l, &[&launching], 30_000, grace).is_empty());
        assert!(
            s.sweep(&l, &[&failed], 70_000, grace).is_empty(),
            "grace restarted"
        );
        assert!(
            s.sweep(&[], &[&failed], 80_000, grace).is_empty(),
            "not listed"
        );
        assert!(
            s.sweep(&l, &[&failed], 130_000, grace).is_empty(),
            "grace restarted"
        );
        assert_eq!(s.sweep(&l, &[&failed], 190_000, grace).len(), 1);
    }
}
