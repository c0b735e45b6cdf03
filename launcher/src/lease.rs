//! Leases: a launcher's claim on a backing seat, and its own liveness (which stands for
//! every request it owns), as KV keys with a TTL.
//!
//! Acquire is create-if-absent; the holder renews it every third of the TTL with a
//! revision-checked write; a launcher that stops renewing loses it when the TTL runs out,
//! and the watch tells every other launcher that the work is free. The revision is the
//! fencing token: a holder that finds it changed has lost the lease and stops at once.

use crate::shared::Shared;
use slotpool_protocol::model::Lease;
use slotpool_protocol::store::KvError;
use slotpool_protocol::time::{now_ms, UnixMillis};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A held lease. Renewal runs until [`LeaseGuard::release`] or drop; `lost` is cancelled
/// if renewal fails.
pub struct LeaseGuard {
    key: String,
    revision: Arc<AtomicU64>,
    /// Cancelled when the lease is lost (or the launcher shuts down).
    pub lost: CancellationToken,
    stop: CancellationToken,
    shared: Arc<Shared>,
}

/// Tries to take the lease `key`; `Ok(None)` when another launcher holds it.
pub async fn acquire(shared: &Arc<Shared>, key: &str) -> Result<Option<LeaseGuard>, KvError> {
    let ttl = shared.config.lease_ttl;
    let now = now_ms();
    let mut lease = Lease {
        v: slotpool_protocol::PROTOCOL_VERSION,
        holder: shared.id.clone(),
        acquired_at: now,
        renewed_at: Some(now),
        passed_at: crate::metrics::last_pass(),
    };
    let revision = match shared.bus.leases.create(key, &lease, Some(ttl)).await {
        Ok(rev) => rev,
        Err(KvError::Conflict { .. }) => return Ok(None),
        Err(err) => return Err(err),
    };
    let revision = Arc::new(AtomicU64::new(revision));
    let lost = shared.shutdown.child_token();
    let stop = CancellationToken::new();
    let (k, rev, l, s, sh) = (
        key.to_string(),
        revision.clone(),
        lost.clone(),
        stop.clone(),
        shared.clone(),
    );
    shared.tracker.spawn(async move {
        let period = ttl / 3;
        loop {
            tokio::select! {
                _ = s.cancelled() => return,
                _ = l.cancelled() => return,
                _ = tokio::time::sleep(period) => {}
            }
            let sent = Lease {
                renewed_at: Some(now_ms()),
                passed_at: crate::metrics::last_pass(),
                ..lease.clone()
            };
            let held = rev.load(Ordering::SeqCst);
            let err = match sh.bus.leases.update(&k, &sent, held, Some(ttl)).await {
                Ok(new) => {
                    rev.store(new, Ordering::SeqCst);
                    lease = sent;
                    continue;
                }
                Err(err) => err,
            };
            // The write's answer says nothing certain: one that timed out, or was sent
            // again and conflicted with itself, may have landed. The record decides.
            let found = sh.bus.leases.get::<Lease>(&k).await;
            let read = match &found {
                Ok(found) => Ok(found.as_ref().map(|v| (&v.value, v.revision))),
                Err(_) => Err(()),
            };
            match after_failed_renewal(&lease, held, read, now_ms(), ttl) {
                Renewal::Ours { revision, record } => {
                    tracing::debug!(lease = %k, %err, revision, "renewal failed, lease still ours");
                    rev.store(revision, Ordering::SeqCst);
                    if let (true, Ok(Some(found))) = (record, found) {
                        lease = found.value;
                    }
                }
                Renewal::Unknown => {
                    tracing::debug!(lease = %k, %err, "renewal failed and unreadable; retrying");
                }
                Renewal::Lost => {
                    let now = match &found {
                        Ok(None) => "gone: its ttl ran out".to_string(),
                        Ok(Some(v)) => format!(
                            "held by {} (taken at {}) at revision {}",
                            v.value.holder, v.value.acquired_at, v.revision
                        ),
                        Err(read) => format!("unreadable ({read}) for longer than its ttl"),
                    };
                    tracing::warn!(lease = %k, %err, found = %now, "lease lost; stopping its work");
                    l.cancel();
                    return;
                }
            }
        }
    });
    Ok(Some(LeaseGuard {
        key: key.to_string(),
        revision,
        lost,
        stop,
        shared: shared.clone(),
    }))
}

impl LeaseGuard {
    /// The current fencing token.
    pub fn revision(&self) -> u64 {
        self.revision.load(Ordering::SeqCst)
    }

    /// Stops renewal and deletes the lease so others need not wait for the TTL.
    pub async fn release(self) {
        self.stop.cancel();
        if !self.lost.is_cancelled() || self.shared.shutdown.is_cancelled() {
            if let Err(err) = self
                .shared
                .bus
                .leases
                .delete(&self.key, self.revision())
                .await
            {
                tracing::debug!(lease = %self.key, %err, "lease release");
            }
        }
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// What a renewal whose write failed finds when it reads the lease back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Renewal {
    /// The record is still this holder's lease, now at `revision`; `record`: the record
    /// read is a write of its own newer than the one held (take it as the held record).
    Ours { revision: u64, record: bool },
    /// It could not be read, and the lease may still stand: try again next period.
    Unknown,
    /// Gone, or another holder's (or another taking of this holder's): stop its work.
    Lost,
}

/// Decides after a failed renewal (a time-out, a conflict, a transport error) from what
/// is under the key now: `held` at `held_revision` is the record last known written,
/// `found` the record read back with its revision (`Err` when it could not be read).
///
/// A renewal whose answer was lost may have landed, and one sent again then conflicts
/// with its own first landing; so the verdict is the record's, not the error's: the same
/// holder and the same taking (`acquired_at`) at a revision not older than the one held
/// is still this lease. Unreadable, the lease is kept until its TTL may have run out
/// since the last write known to have landed (`renewed_at`, or `acquired_at`).
pub fn after_failed_renewal(
    held: &Lease,
    held_revision: u64,
    found: Result<Option<(&Lease, u64)>, ()>,
    now: UnixMillis,
    ttl: Duration,
) -> Renewal {
    let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
    match found {
        // A read from a server behind the held revision proves nothing.
        Ok(Some((record, revision)))
            if record.holder == held.holder
                && record.acquired_at == held.acquired_at
                && revision < held_revision =>
        {
            unread(held, now, ttl_ms)
        }
        Ok(Some((record, revision)))
            if record.holder == held.holder && record.acquired_at == held.acquired_at =>
        {
            let landed = record.renewed_at.unwrap_or(record.acquired_at);
            if now.saturating_sub(landed) >= ttl_ms {
                // Read from a server that lags: the TTL may have ended it already.
                Renewal::Lost
            } else {
                Renewal::Ours {
                    revision,
                    record: revision > held_revision,
                }
            }
        }
        Ok(_) => Renewal::Lost,
        Err(()) => unread(held, now, ttl_ms),
    }
}

/// Nothing certain read: kept while the TTL of the last write known to have landed lasts.
fn unread(held: &Lease, now: UnixMillis, ttl_ms: u64) -> Renewal {
    let landed = held.renewed_at.unwrap_or(held.acquired_at);
    if now.saturating_sub(landed) >= ttl_ms {
        Renewal::Lost
    } else {
        Renewal::Unknown
    }
}

/// Pause between attempts to take the liveness lease again.
const LIVENESS_RETRY: Duration = Duration::from_secs(1);

/// Takes this launcher's liveness lease; an error when the bus cannot be written.
pub async fn take_liveness(shared: &Arc<Shared>) -> Result<LeaseGuard, KvError> {
    let key = slotpool_protocol::layout::launcher_lease_key(&shared.id);
    match acquire(shared, &key).await? {
        Some(guard) => {
            shared.liveness.set(guard.lost.clone());
            Ok(guard)
        }
        None => Err(KvError::Conflict {
            bucket: shared.bus.leases.bucket().to_string(),
            key,
        }),
    }
}

/// Keeps the liveness lease until shutdown (then deletes it, so other launchers take
/// this one's requests over at once), taking it again whenever it is lost.
pub async fn keep_alive(shared: Arc<Shared>, mut guard: LeaseGuard) {
    loop {
        tokio::select! {
            biased;
            _ = shared.shutdown.cancelled() => {
                guard.release().await;
                return;
            }
            _ = guard.lost.cancelled() => {}
        }
        tracing::warn!("liveness lease lost: request workers stop until it is taken again");
        guard = loop {
            match take_liveness(&shared).await {
                Ok(guard) => break guard,
                Err(err) => tracing::debug!(%err, "cannot take the liveness lease yet"),
            }
            tokio::select! {
                _ = shared.shutdown.cancelled() => return,
                _ = tokio::time::sleep(LIVENESS_RETRY) => {}
            }
        };
        tracing::info!("liveness lease taken again");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slotpool_protocol::LauncherId;

    const TTL: Duration = Duration::from_secs(10);

    fn lease(holder: &str, acquired_at: u64, renewed_at: u64, passed_at: u64) -> Lease {
        Lease {
            v: 1,
            holder: LauncherId::parse(holder).unwrap(),
            acquired_at,
            renewed_at: Some(renewed_at),
            passed_at: Some(passed_at),
        }
    }

    /// A renewal timed out (its answer lost in an election) but landed; the next one,
    /// with a newer `passed_at`, conflicts with it. The record is its own: kept.
    #[test]
    fn a_renewal_that_landed_unanswered_is_still_ours() {
        let held = lease("launcher-a1", 1_000, 1_000, 900);
        let landed = lease("launcher-a1", 1_000, 4_300, 4_000);
        assert_eq!(
            after_failed_renewal(&held, 5, Ok(Some((&landed, 6))), 7_700, TTL),
            Renewal::Ours {
                revision: 6,
                record: true
            }
        );
        // Sent again after the time-out, it conflicts with its own first landing.
        assert_eq!(
            after_failed_renewal(&held, 5, Ok(Some((&landed, 6))), 4_400, TTL),
            Renewal::Ours {
                revision: 6,
                record: true
            }
        );
        // It did not land: the record is still the one held.
        assert_eq!(
            after_failed_renewal(&held, 5, Ok(Some((&held, 5))), 4_400, TTL),
            Renewal::Ours {
                revision: 5,
                record: false
            }
        );
    }

    #[test]
    fn another_holder_or_another_taking_or_nothing_is_lost() {
        let held = lease("launcher-a1", 1_000, 4_000, 900);
        let other = lease("launcher-b2", 9_000, 9_000, 8_000);
        let retaken = lease("launcher-a1", 9_000, 9_000, 8_000);
        for found in [Some((&other, 7)), Some((&retaken, 7)), None] {
            assert_eq!(
                after_failed_renewal(&held, 5, Ok(found), 9_100, TTL),
                Renewal::Lost,
                "{found:?}"
            );
        }
    }

    /// A read from a server that lags behind the held revision proves nothing either way.
    #[test]
    fn a_read_behind_the_held_revision_is_no_proof() {
        let held = lease("launcher-a1", 1_000, 4_000, 900);
        let older = lease("launcher-a1", 1_000, 1_000, 900);
        assert_eq!(
            after_failed_renewal(&held, 5, Ok(Some((&older, 4))), 4_100, TTL),
            Renewal::Unknown
        );
        assert_eq!(
            after_failed_renewal(&held, 5, Ok(Some((&older, 4))), 14_100, TTL),
            Renewal::Lost
        );
    }

    #[test]
    fn unreadable_is_kept_until_its_ttl_may_have_run_out() {
        let held = lease("launcher-a1", 1_000, 4_000, 900);
        assert_eq!(
            after_failed_renewal(&held, 5, Err(()), 13_999, TTL),
            Renewal::Unknown
        );
        assert_eq!(
            after_failed_renewal(&held, 5, Err(()), 14_000, TTL),
            Renewal::Lost
        );
        // Read back ours, but older than the TTL: it may be expiring as we look.
        assert_eq!(
            after_failed_renewal(&held, 5, Ok(Some((&held, 5))), 14_000, TTL),
            Renewal::Lost
        );
    }
}
