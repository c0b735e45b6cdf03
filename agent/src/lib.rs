//! slotpool agent: runs on one backing node, prepares and wipes its slots on the
//! launcher's command, and reports its health and occupancy in a heartbeat.
//!
//! Code map:
//! - [`config`]: flags and the validated [`AgentConfig`];
//! - [`health`]: figures from `/proc` and `statvfs`;
//! - [`isolation`]: the [`isolation::SlotIsolation`] trait and its `workspace-only` impl;
//! - [`slots`]: who holds which slot, and the prepare/release rules;
//! - [`commands`]: serving `slotpool.agent.v1.<backing id>`;
//! - [`heartbeat`]: the TTL'd record in the agents bucket.
//!
//! The agent writes only its own heartbeat key and never wipes slots on its own: the
//! launcher decides when a slot is released, even across agent restarts.

pub mod commands;
pub mod config;
pub mod health;
pub mod heartbeat;
pub mod isolation;
pub mod slots;

pub use config::{AgentConfig, Args};

use heartbeat::Heartbeat;
use isolation::{IsolationError, SlotIsolation, WorkspaceOnly};
use slotpool_protocol::connect::{Bus, BusError};
use slotpool_protocol::layout::subjects;
use slotpool_protocol::time::now_ms;
use slots::Slots;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Longest wait for the command subscription to be set up.
pub const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait at shutdown for replies and the last heartbeat to leave.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the agent stopped.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("creating work dir {path}: {error}")]
    WorkDir {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("setting up slots: {0}")]
    Slots(IsolationError),
    #[error("subscribing to agent commands: {0}")]
    Subscribe(BusError),
    #[error("subscribing to {subject}: no answer within {timeout:?}")]
    SubscribeTimeout { subject: String, timeout: Duration },
    #[error("command subscription on {subject} ended: the NATS connection was closed")]
    CommandsEnded { subject: String },
}

/// Runs the agent with `workspace-only` isolation until `shutdown` is cancelled.
pub async fn run(
    config: AgentConfig,
    bus: Bus,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    std::fs::create_dir_all(&config.work_dir).map_err(|error| AgentError::WorkDir {
        path: config.work_dir.clone(),
        error,
    })?;
    let isolation = Arc::new(WorkspaceOnly::new(&config.work_dir).map_err(AgentError::Slots)?);
    run_with(config, bus, isolation, shutdown).await
}

/// Runs the agent with the given isolation until `shutdown` is cancelled: recovers the
/// slots prepared before a restart, subscribes to commands, heartbeats at once and then
/// every interval, and on shutdown writes a last heartbeat with `draining: true`.
pub async fn run_with(
    config: AgentConfig,
    bus: Bus,
    isolation: Arc<dyn SlotIsolation>,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    let span = tracing::info_span!("agent", backing_id = %config.backing_id);
    async move {
        let started_at = now_ms();
        let slots = Slots::recover(isolation, config.slots)
            .await
            .map_err(AgentError::Slots)?;
        tracing::info!(
            isolation = slots.isolation_name(),
            work_dir = %config.work_dir.display(),
            slots = config.slots,
            prepared = ?slots.reports(),
            "agent starting"
        );
        // Subscribe before the first heartbeat, so a launcher that sees the heartbeat
        // can send commands at once.
        let subject = subjects::agent(&config.backing_id);
        let commands = tokio::time::timeout(SUBSCRIBE_TIMEOUT, bus.serve(&subject, None))
            .await
            .map_err(|_| AgentError::SubscribeTimeout {
                subject: subject.clone(),
                timeout: SUBSCRIBE_TIMEOUT,
            })?
            .map_err(AgentError::Subscribe)?;

        let heartbeat = Heartbeat::new(&config, bus.agents.clone(), slots.clone(), started_at);
        let poke = Arc::new(Notify::new());
        let stop_beating = shutdown.child_token();
        let beating = tokio::spawn(
            heartbeat::beat(
                heartbeat.clone(),
                config.heartbeat_interval,
                poke.clone(),
                stop_beating.clone(),
            )
            .in_current_span(),
        );

        let ended = commands::serve(&bus, &slots, config.slots, commands, poke, &shutdown).await;

        stop_beating.cancel();
        if let Err(err) = beating.await {
            tracing::warn!(%err, "heartbeat task failed");
        }
        match heartbeat.send(true).await {
            Ok(revision) => tracing::info!(revision, "draining heartbeat written"),
            Err(err) => tracing::warn!(%err, "cannot write draining heartbeat"),
        }
        match tokio::time::timeout(FLUSH_TIMEOUT, bus.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::warn!(%err, "cannot flush replies at shutdown"),
            Err(_) => {
                tracing::warn!(timeout = ?FLUSH_TIMEOUT, "flushing replies at shutdown timed out")
            }
        }
        if ended {
            return Err(AgentError::CommandsEnded { subject });
        }
        tracing::info!("agent stopped");
        Ok(())
    }
    .instrument(span)
    .await
}
