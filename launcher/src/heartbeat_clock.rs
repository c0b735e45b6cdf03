//! Since when the heartbeats bucket has been able to take and deliver heartbeats, as far as
//! this launcher knows: a heartbeat missing from KV counts only over that time
//! ([`crate::backing::lifecycle`]).
//!
//! The connection and the mirror's watch are covered by [`crate::mirror_sync::MirrorSync`].
//! A clustered bucket electing its leader is not: the launcher stays connected, its watch
//! stays open, yet no agent's heartbeat can be written, and the new leader then expires
//! every heartbeat whose TTL ran out meanwhile. So before a backing node is failed for a
//! missing heartbeat, the worker takes one look at the bucket (its [`Probe`]), and
//! [`next`] decides: the node fails, or the clock restarts for every node at the moment
//! the bucket was known to be back (its leader's election, or now when it did not
//! answer), giving each missing heartbeat a fresh grace from then. No look is taken
//! otherwise.

use slotpool_protocol::time::UnixMillis;
use std::sync::Mutex;

/// What one look at the heartbeats bucket found, taken before a backing node is failed
/// for a missing heartbeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The agent's heartbeat is in KV after all (the mirror had not seen it yet).
    Present,
    /// KV answered without the heartbeat. `leader_since`: since when the bucket's leader
    /// leads, in a cluster that says.
    Absent { leader_since: Option<UnixMillis> },
    /// The bucket did not answer: the read timed out or failed, or it has no leader.
    Unavailable,
}

/// What to do with the node after a [`Probe`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The agent is alive: decide again, with its heartbeat in the mirror.
    Alive,
    /// The bucket could not deliver heartbeats until `back_at`, later than the clock knew:
    /// the clock restarts there for every node; decide again.
    Restart { back_at: UnixMillis },
    /// Nothing new: the heartbeat is missing over time the bucket could deliver it.
    Confirmed,
}

/// The decision, pure: `back_at` is the clock's current start ([`HeartbeatClock::back_at`]).
pub fn next(back_at: Option<UnixMillis>, probe: Probe, now: UnixMillis) -> Verdict {
    let known = back_at.unwrap_or(0);
    match probe {
        Probe::Present => Verdict::Alive,
        // Back at the earliest now; never moved backwards (a leader's clock may run ahead).
        Probe::Unavailable => Verdict::Restart {
            back_at: now.max(known),
        },
        Probe::Absent {
            leader_since: Some(elected),
        } if elected > known => Verdict::Restart { back_at: elected },
        Probe::Absent { .. } => Verdict::Confirmed,
    }
}

/// The clock shared by every backing worker of this launcher.
#[derive(Default)]
pub struct HeartbeatClock {
    back_at: Mutex<Option<UnixMillis>>,
}

impl HeartbeatClock {
    /// Since when the bucket is known to deliver heartbeats again after it last could not
    /// (`None`: never seen unable).
    pub fn back_at(&self) -> Option<UnixMillis> {
        *self.back_at.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decides on `probe` ([`next`]) and moves the clock as the verdict says.
    pub fn apply(&self, probe: Probe, now: UnixMillis) -> Verdict {
        let mut back_at = self.back_at.lock().unwrap_or_else(|p| p.into_inner());
        let verdict = next(*back_at, probe, now);
        if let Verdict::Restart { back_at: at } = verdict {
            *back_at = Some(at);
        }
        verdict
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_found_in_kv_keeps_the_node() {
        assert_eq!(next(None, Probe::Present, 10_000), Verdict::Alive);
        assert_eq!(next(Some(5_000), Probe::Present, 10_000), Verdict::Alive);
    }

    #[test]
    fn a_bucket_that_does_not_answer_restarts_the_clock_now() {
        assert_eq!(
            next(None, Probe::Unavailable, 10_000),
            Verdict::Restart { back_at: 10_000 }
        );
        assert_eq!(
            next(Some(4_000), Probe::Unavailable, 10_000),
            Verdict::Restart { back_at: 10_000 }
        );
        // A start ahead of this launcher's clock is kept, not moved back.
        assert_eq!(
            next(Some(12_000), Probe::Unavailable, 10_000),
            Verdict::Restart { back_at: 12_000 }
        );
    }

    #[test]
    fn a_leader_elected_since_the_clock_started_restarts_it_at_the_election() {
        let elected = Probe::Absent {
            leader_since: Some(8_000),
        };
        assert_eq!(
            next(None, elected, 10_000),
            Verdict::Restart { back_at: 8_000 }
        );
        assert_eq!(
            next(Some(3_000), elected, 10_000),
            Verdict::Restart { back_at: 8_000 }
        );
        // The same leader seen again: nothing new, the absence stands.
        assert_eq!(next(Some(8_000), elected, 10_000), Verdict::Confirmed);
        assert_eq!(next(Some(9_000), elected, 10_000), Verdict::Confirmed);
    }

    #[test]
    fn an_absence_on_a_single_server_is_confirmed() {
        let single = Probe::Absent { leader_since: None };
        assert_eq!(next(None, single, 10_000), Verdict::Confirmed);
        assert_eq!(next(Some(9_000), single, 10_000), Verdict::Confirmed);
    }

    #[test]
    fn the_shared_clock_moves_only_on_a_restart() {
        let clock = HeartbeatClock::default();
        assert_eq!(clock.back_at(), None);
        clock.apply(Probe::Absent { leader_since: None }, 1_000);
        assert_eq!(clock.back_at(), None);
        clock.apply(
            Probe::Absent {
                leader_since: Some(2_000),
            },
            3_000,
        );
        assert_eq!(clock.back_at(), Some(2_000));
        clock.apply(Probe::Unavailable, 4_000);
        assert_eq!(clock.back_at(), Some(4_000));
        // An older election does not move it back.
        clock.apply(
            Probe::Absent {
                leader_since: Some(2_000),
            },
            5_000,
        );
        assert_eq!(clock.back_at(), Some(4_000));
    }
}
