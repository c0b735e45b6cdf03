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
use slotpool_protocol::time::now_ms;
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
    let mut lease = Lease {
        v: slotpool_protocol::PROTOCOL_VERSION,
        holder: shared.id.clone(),
        acquired_at: now_ms(),
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
                passed_at: crate::metrics::last_pass(),
                ..lease.clone()
            };
            match sh
                .bus
                .leases
                .update(&k, &sent, rev.load(Ordering::SeqCst), Some(ttl))
                .await
            {
                Ok(new) => {
                    rev.store(new, Ordering::SeqCst);
                    lease = sent;
                }
                // A timed-out write may have landed; the next renewal will tell.
                Err(KvError::Timeout { .. }) => continue,
                // Still ours when the record is the one we wrote: an earlier renewal
                // that timed out had landed after all.
                Err(err @ KvError::Conflict { .. }) => match sh.bus.leases.get::<Lease>(&k).await {
                    Ok(Some(now)) if now.value == lease || now.value == sent => {
                        rev.store(now.revision, Ordering::SeqCst);
                        lease = now.value;
                    }
                    _ => {
                        tracing::warn!(lease = %k, %err, "lease lost; stopping its work");
                        l.cancel();
                        return;
                    }
                },
                Err(err) => {
                    tracing::warn!(lease = %k, %err, "lease lost; stopping its work");
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
