//! The agent's heartbeat: an [`AgentHeartbeat`] put under its backing id with a per-key
//! TTL, so the entry of a dead agent expires on its own.

use crate::config::AgentConfig;
use crate::health::{self, ProbeStatus, Thresholds};
use crate::slots::Slots;
use crate::ssh::SshInfo;
use slotpool_protocol::model::AgentHeartbeat;
use slotpool_protocol::store::{KvError, Store};
use slotpool_protocol::time::{now_ms, UnixMillis};
use slotpool_protocol::{BackingId, PROTOCOL_VERSION};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Longest wait for the server to acknowledge one heartbeat.
pub const HEARTBEAT_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

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
}

impl Heartbeat {
    pub fn new(
        config: &AgentConfig,
        agents: Store,
        slots: Slots,
        started_at: UnixMillis,
        probe: Arc<Mutex<ProbeStatus>>,
        ssh: Arc<SshInfo>,
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
            health,
            slots: self.slots.reports(),
            draining,
            dirty_slots: self.slots.dirty_slots(),
            isolation: Some(self.slots.isolation_name().to_string()),
            ssh_port: Some(self.ssh.port),
            ssh_host_keys: self.ssh.host_keys.clone(),
        }
    }

    /// Writes the heartbeat as of now; returns its KV revision.
    pub async fn send(&self, draining: bool) -> Result<u64, HeartbeatError> {
        let record = self.record(draining);
        let put = self
            .agents
            .put(self.backing_id.as_str(), &record, Some(self.ttl));
        match tokio::time::timeout(HEARTBEAT_WRITE_TIMEOUT, put).await {
            Ok(result) => result.map_err(HeartbeatError::Kv),
            Err(_) => Err(HeartbeatError::Timeout(HEARTBEAT_WRITE_TIMEOUT)),
        }
    }
}

/// Sends a heartbeat now, then every `interval` and whenever `poke` is notified, until
/// `shutdown`. Failures are logged when the heartbeat starts failing and when it
/// recovers, not at every beat.
pub async fn beat(
    heartbeat: Heartbeat,
    interval: Duration,
    poke: Arc<Notify>,
    shutdown: CancellationToken,
) {
    let mut failing = false;
    loop {
        match heartbeat.send(false).await {
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
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
            () = poke.notified() => {}
        }
    }
}
