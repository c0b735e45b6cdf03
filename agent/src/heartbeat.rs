//! The agent's heartbeat: an [`AgentHeartbeat`] put under its backing id with a per-key
//! TTL, so the entry of a dead agent expires on its own.
//!
//! A heartbeat is written every interval and, when poked, sooner: pokes come only when
//! something launchers act on changed (health, dirty slots, a spot interruption notice). Slot occupancy is not one
//! of them: launchers take it from the slots bucket, and the regular beats carry it for
//! the console. Pokes are coalesced: after a beat, the next one comes at the earliest
//! [`POKE_GAP`] later, so a burst of pokes costs one write.

use crate::config::AgentConfig;
use crate::health::{self, ProbeStatus, Thresholds};
use crate::slots::Slots;
use crate::ssh::SshInfo;
use slotpool_protocol::model::{AgentHeartbeat, Interruption};
use slotpool_protocol::store::{KvError, Store};
use slotpool_protocol::time::{now_ms, UnixMillis};
use slotpool_protocol::{BackingId, PROTOCOL_VERSION};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Longest wait for the server to acknowledge one heartbeat.
pub const HEARTBEAT_WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for the last, `draining` heartbeat at shutdown. Short: launchers that
/// miss it see the heartbeat expire after its TTL anyway, and a stopping agent should not
/// wait out an unreachable server (its stop grace is a few seconds).
pub const DRAINING_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// Shortest time from one heartbeat to a poked one: pokes within it are merged.
pub const POKE_GAP: Duration = Duration::from_millis(250);

/// Where health figures are read from.
const PROC_ROOT: &str = "/proc";

/// Why a heartbeat was not written.
#[derive(Debug, thiserror::Error)]
pub enum HeartbeatError {
    #[error("writing heartbeat: {0}")]
    Kv(KvError),
    #[error("writing heartbeat: no acknowledgement within {0:?}")]
    Timeout(Duration),
}

/// Everything needed to build and write this agent's heartbeat.
#[derive(Clone)]
pub struct Heartbeat {
    agents: Store,
    backing_id: BackingId,
    secret_sha256: String,
    hostname: String,
    pid: u32,
    started_at: UnixMillis,
    work_dir: PathBuf,
    proc_root: PathBuf,
    ttl: Duration,
    slots: Slots,
    thresholds: Thresholds,
    probe: Arc<Mutex<ProbeStatus>>,
    ssh: Arc<SshInfo>,
    /// The spot interruption notice, once read ([`crate::spot`]).
    interruption: Arc<Mutex<Option<Interruption>>>,
}

impl Heartbeat {
    pub fn new(
        config: &AgentConfig,
        agents: Store,
        slots: Slots,
        started_at: UnixMillis,
        probe: Arc<Mutex<ProbeStatus>>,
        ssh: Arc<SshInfo>,
        interruption: Arc<Mutex<Option<Interruption>>>,
    ) -> Self {
        Heartbeat {
            agents,
            backing_id: config.backing_id.clone(),
            secret_sha256: config.secret_sha256.clone(),
            hostname: health::hostname(),
            pid: std::process::id(),
            started_at,
            work_dir: config.work_dir.clone(),
            proc_root: PathBuf::from(PROC_ROOT),
            ttl: config.heartbeat_ttl,
            slots,
            thresholds: config.thresholds,
            probe,
            ssh,
            interruption,
        }
    }

    /// The heartbeat as of now.
    pub fn record(&self, draining: bool) -> AgentHeartbeat {
        let (mut health, errors) = health::read_health(&self.proc_root, &self.work_dir);
        for err in errors {
            tracing::debug!(%err, "health figure unavailable");
        }
        let probe = self.probe.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(reason) = health::verdict(&health, &self.thresholds, &probe) {
            health.healthy = false;
            health.reason = Some(reason);
        }
        AgentHeartbeat {
            v: PROTOCOL_VERSION,
            backing_id: self.backing_id.clone(),
            secret_sha256: self.secret_sha256.clone(),
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            hostname: self.hostname.clone(),
            pid: self.pid,
            started_at: self.started_at,
            sent_at: now_ms(),
            ttl_secs: Some(self.ttl.as_secs()),
            health,
            slots: self.slots.reports(),
            draining,
            dirty_slots: self.slots.dirty_slots(),
            dirty_reasons: self.slots.dirty_reasons(),
            isolation: Some(self.slots.isolation_name().to_string()),
            ssh_port: Some(self.ssh.port),
            ssh_host_keys: self.ssh.host_keys.clone(),
            slot_names: Some(self.slots.isolation().slot_names()),
            interruption: *self.interruption.lock().unwrap_or_else(|e| e.into_inner()),
        }
    }

    /// Writes the heartbeat as of now, waiting at most `timeout` for the server to
    /// acknowledge it; returns its KV revision.
    pub async fn send(&self, draining: bool, timeout: Duration) -> Result<u64, HeartbeatError> {
        let record = self.record(draining);
        let put = self
            .agents
            .put(self.backing_id.as_str(), &record, Some(self.ttl));
        let result = match tokio::time::timeout(timeout, put).await {
            Ok(result) => result.map_err(HeartbeatError::Kv),
            Err(_) => Err(HeartbeatError::Timeout(timeout)),
        };
        crate::metrics::heartbeat(result.is_ok());
        result
    }
}

/// When the beat after one written at `last` is due: `interval` later, or, once poked,
/// [`POKE_GAP`] later (never later than the interval).
fn next_beat(last: Instant, interval: Duration, poked: bool) -> Instant {
    last + if poked {
        POKE_GAP.min(interval)
    } else {
        interval
    }
}

/// Waits for the beat after one written at `last`: until [`next_beat`], counting a poke
/// that arrives meanwhile (or arrived since the last beat began). Returns `false` on
/// `shutdown`.
async fn until_next_beat(
    last: Instant,
    interval: Duration,
    poke: &Notify,
    shutdown: &CancellationToken,
) -> bool {
    let mut poked = false;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return false,
            () = tokio::time::sleep_until(next_beat(last, interval, poked)) => return true,
            () = poke.notified(), if !poked => poked = true,
        }
    }
}

/// Sends a heartbeat now, then every `interval` and, at most every [`POKE_GAP`], when
/// `poke` is notified, until `shutdown`. Failures are logged when the heartbeat starts
/// failing and when it recovers, not at every beat.
pub async fn beat(
    heartbeat: Heartbeat,
    interval: Duration,
    poke: Arc<Notify>,
    shutdown: CancellationToken,
) {
    let mut failing = false;
    loop {
        let started = Instant::now();
        match heartbeat.send(false, HEARTBEAT_WRITE_TIMEOUT).await {
            Ok(revision) if failing => {
                failing = false;
                tracing::info!(revision, "heartbeat written again");
            }
            Ok(revision) => tracing::trace!(revision, "heartbeat written"),
            Err(err) if !failing => {
                failing = true;
                tracing::warn!(%err, "heartbeat failed; retrying every interval");
            }
            Err(err) => tracing::debug!(%err, "heartbeat still failing"),
        }
        if !until_next_beat(started, interval, &poke, &shutdown).await {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INTERVAL: Duration = Duration::from_secs(2);

    #[test]
    fn a_poke_brings_the_next_beat_forward_to_the_gap() {
        let last = Instant::now();
        assert_eq!(next_beat(last, INTERVAL, false), last + INTERVAL);
        assert_eq!(next_beat(last, INTERVAL, true), last + POKE_GAP);
        // A poke never delays a beat of a short interval.
        let short = Duration::from_millis(100);
        assert_eq!(next_beat(last, short, true), last + short);
    }

    /// Counts the beats `until_next_beat` lets through within `window` of paused
    /// (virtual) time while `pokes` pokes arrive at once after each beat.
    async fn beats_in(window: Duration, pokes: usize) -> u32 {
        let poke = Notify::new();
        let shutdown = CancellationToken::new();
        let end = Instant::now() + window;
        let mut beats = 0;
        loop {
            let last = Instant::now();
            for _ in 0..pokes {
                poke.notify_one();
            }
            tokio::select! {
                biased;
                () = tokio::time::sleep_until(end) => return beats,
                _ = until_next_beat(last, INTERVAL, &poke, &shutdown) => beats += 1,
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_of_pokes_costs_one_beat_per_gap() {
        let second = Duration::from_millis(1000);
        assert_eq!(beats_in(second * 10, 0).await, 4, "every interval");
        assert_eq!(
            beats_in(second, 100).await,
            3,
            "poked without pause: one beat per {POKE_GAP:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_ends_the_wait() {
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        assert!(!until_next_beat(Instant::now(), INTERVAL, &Notify::new(), &shutdown).await);
    }
}
