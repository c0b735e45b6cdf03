//! slotpool agent: runs on one backing node, prepares and wipes its slots on the
//! launcher's command, and reports its health and occupancy in a heartbeat.
//!
//! Code map:
//! - [`config`]: flags and the validated [`AgentConfig`];
//! - [`health`]: figures from `/proc` and `statvfs`;
//! - [`isolation`]: the [`isolation::SlotIsolation`] trait, its mode-`none` impl and, in
//!   its submodules, mode `users` and the mechanisms it is built from (users, `/proc`,
//!   cgroups, disk quotas, mounts, network namespaces, the bus guard, the placement
//!   socket and the `enter-slot` helper sshd runs for logins);
//! - [`slots`]: who holds which slot, the prepare/release rules, dirty slots;
//! - [`stack`]: the isolation the configuration asks for, and the slot table, bus guard
//!   and placement socket around it, set up and taken down in one step each;
//! - [`commands`]: serving `slotpool.agent.v2.<backing id>`;
//! - [`heartbeat`]: the TTL'd record in the agents bucket; [`ssh`]: port and host keys.
//!
//! - [`reconcile`]: at start, releasing the prepared slots whose node is gone from KV;
//! - [`spot`]: the spot interruption notice of the instance metadata service.
//!
//! The agent writes only its own heartbeat key. It wipes a slot on its own only at start,
//! when the slots bucket no longer holds the node it prepared the slot for; otherwise the
//! launcher decides when a slot is released.

pub mod commands;
pub mod config;
pub mod exec;
pub mod health;
pub mod heartbeat;
pub mod isolation;
pub mod log_tail;
pub mod metrics;
pub mod metrics_http;
pub mod reconcile;
pub mod slots;
pub mod spot;
pub mod ssh;
pub mod stack;
pub mod step_clock;

pub use config::{AgentConfig, Args};

use isolation::{bus_guard, disk_quota, enter, mounts, netns, uid_range};

use config::ProbeConfig;
use health::ProbeStatus;
use heartbeat::Heartbeat;
use isolation::{IsolationError, SlotIsolation};
use log_tail::LogTail;
use slotpool_protocol::connect::{Bus, BusError};
use slotpool_protocol::layout::subjects;
use slotpool_protocol::time::now_ms;
use stack::SlotStack;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Longest wait for the command subscription to be set up.
pub const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait at shutdown for replies to leave (only tried while connected).
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// How often processes of slot users outside their slot's cgroup are moved into it
/// (only while some slot is prepared).
pub const PLACEMENT_SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// Where cgroup mounts are looked up.
pub(crate) const PROC_ROOT: &str = "/proc";

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
    #[error("keeping slot users off the bus: {0}")]
    BusGuard(bus_guard::GuardError),
    #[error("slot network namespaces: {0}")]
    Netns(netns::NetnsError),
    #[error("slot private /tmp: {0}")]
    PrivateTmp(isolation::private_tmp::PrivateTmpError),
    #[error("setting up slot isolation: {0}")]
    Isolation(IsolationError),
    #[error("setting up slot uids: {0}")]
    Uids(uid_range::UidError),
    #[error("default slot limits: cannot read the host's memory from {path}: {message}")]
    DefaultLimits { path: PathBuf, message: String },
    #[error("setting up login placement: {0}")]
    Enter(enter::EnterError),
    #[error("--slot-disk-quota-mb: {0}")]
    DiskQuota(disk_quota::QuotaUnavailable),
    #[error("--metrics: {0}")]
    Metrics(metrics_http::MetricsError),
    #[error("hiding processes (--hide-processes): {0}")]
    HideProcesses(mounts::MountError),
}

/// Runs the agent with the isolation `config` asks for until `shutdown` is cancelled.
pub async fn run(
    mut config: AgentConfig,
    bus: Bus,
    tail: LogTail,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    std::fs::create_dir_all(&config.work_dir).map_err(|error| AgentError::WorkDir {
        path: config.work_dir.clone(),
        error,
    })?;
    // Bound first, so that its port (picked by the kernel for port 0) is guarded too.
    let metrics = match &config.metrics {
        Some(settings) => Some(
            metrics_http::MetricsListener::bind(settings)
                .await
                .map_err(AgentError::Metrics)?,
        ),
        None => None,
    };
    if let (Some(ports), Some(Ok(addr))) = (
        config.bus_guard_ports.as_mut(),
        metrics.as_ref().map(|m| m.local_addr()),
    ) {
        if !ports.contains(&addr.port()) {
            ports.push(addr.port());
        }
    }
    let isolation = stack::isolation_of(&config)?;
    run_with(config, bus, isolation, metrics, tail, shutdown).await
}

/// Runs the probe every interval until `shutdown`, recording its outcome and poking the
/// heartbeat when it changes.
async fn probe_loop(
    probe: ProbeConfig,
    status: Arc<Mutex<ProbeStatus>>,
    poke: Arc<Notify>,
    shutdown: CancellationToken,
) {
    loop {
        let result = tokio::select! {
            () = shutdown.cancelled() => return,
            r = health::run_probe(&probe.command, probe.timeout) => r,
        };
        let new = match result {
            Ok(()) => ProbeStatus::Passed,
            Err(why) => ProbeStatus::Failed(why),
        };
        let old = std::mem::replace(
            &mut *status.lock().unwrap_or_else(|e| e.into_inner()),
            new.clone(),
        );
        if old != new {
            match &new {
                ProbeStatus::Failed(why) => {
                    tracing::warn!(reason = why, "health probe failed: node unhealthy")
                }
                _ => tracing::info!("health probe passed"),
            }
            poke.notify_one();
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(probe.interval) => {}
        }
    }
}

/// Runs the agent with the given isolation until `shutdown` is cancelled: recovers the
/// slots prepared before a restart, subscribes to commands, heartbeats at once and then
/// every interval, and on shutdown writes a last heartbeat with `draining: true`.
pub async fn run_with(
    config: AgentConfig,
    bus: Bus,
    isolation: Arc<dyn SlotIsolation>,
    metrics: Option<metrics_http::MetricsListener>,
    tail: LogTail,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    let span = tracing::info_span!("agent", backing_id = %config.backing_id);
    async move {
        let started_at = now_ms();
        let background = shutdown.child_token();
        let stack = SlotStack::start(&config, isolation, &bus, &background).await?;
        let slots = stack.slots.clone();
        let ssh = Arc::new(ssh::SshInfo {
            port: config.ssh_port,
            host_keys: ssh::read_host_keys(&config.ssh_host_keys_dir),
        });
        let mut tasks = Vec::new();
        if let Some(listener) = metrics {
            tasks.push(tokio::spawn(
                metrics_http::serve(listener, slots.clone(), background.clone()).in_current_span(),
            ));
        }
        slots.warm_free_slots();
        tracing::info!(
            isolation = slots.isolation_name(),
            work_dir = %config.work_dir.display(),
            slots = config.slots,
            prepared = ?slots.reports(),
            warm = ?slots.warm_slots(),
            dirty = ?slots.dirty_slots(),
            ssh_port = ssh.port,
            ssh_host_keys = ssh.host_keys.len(),
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

        let poke = Arc::new(Notify::new());
        let probe_status = Arc::new(Mutex::new(match &config.probe {
            Some(_) => ProbeStatus::Pending,
            None => ProbeStatus::None,
        }));
        if let Some(probe) = config.probe.clone() {
            tracing::info!(command = probe.command, interval = ?probe.interval, "health probe configured");
            tasks.push(tokio::spawn(
                probe_loop(probe, probe_status.clone(), poke.clone(), background.clone())
                    .in_current_span(),
            ));
        }
        let interruption = Arc::new(Mutex::new(None));
        if let Some(addr) = &config.spot_notice {
            tracing::info!(imds = %addr, interval = ?spot::POLL_INTERVAL, "watching for a spot interruption notice");
            let (imds, slots, notice, poke) = (
                spot::Imds::at(addr),
                slots.clone(),
                interruption.clone(),
                poke.clone(),
            );
            let shutdown = background.clone();
            tasks.push(tokio::spawn(
                async move {
                    if let Some(found) = spot::watch(imds, shutdown).await {
                        // Refuse prepares already on their way: the machine is going.
                        slots.close().await;
                        *notice.lock().unwrap_or_else(|e| e.into_inner()) = Some(found);
                        poke.notify_one();
                    }
                }
                .in_current_span(),
            ));
        }
        let heartbeat = Heartbeat::new(
            &config,
            bus.agents.clone(),
            slots.clone(),
            started_at,
            probe_status,
            ssh.clone(),
            interruption,
        );
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

        let runner = exec::Runner::new(
            bus.clone(),
            config.backing_id.clone(),
            background.clone(),
        );
        let input = runner
            .subscribe_input(&config.backing_id)
            .await
            .map_err(AgentError::Subscribe)?;
        tasks.push(tokio::spawn(
            runner.clone().serve_input(input).in_current_span(),
        ));
        let ended = commands::serve(
            &bus,
            &slots,
            commands::Answers { ssh, tail, runner },
            commands,
            poke,
            &shutdown,
        )
        .await;

        stop_beating.cancel();
        if let Err(err) = beating.await {
            tracing::warn!(%err, "heartbeat task failed");
        }
        match heartbeat
            .send(true, heartbeat::DRAINING_WRITE_TIMEOUT)
            .await
        {
            Ok(revision) => tracing::info!(revision, "draining heartbeat written"),
            Err(err) => tracing::warn!(%err, "cannot write draining heartbeat"),
        }
        background.cancel();
        for task in tasks {
            if let Err(err) = task.await {
                tracing::warn!(%err, "background task failed");
            }
        }
        stack.stop(&config).await;
        // Without a connection nothing can leave: do not wait for one.
        if bus.is_connected() {
            match tokio::time::timeout(FLUSH_TIMEOUT, bus.flush()).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => tracing::warn!(%err, "cannot flush replies at shutdown"),
                Err(_) => tracing::warn!(
                    timeout = ?FLUSH_TIMEOUT,
                    "flushing replies at shutdown timed out"
                ),
            }
        } else {
            tracing::warn!("not connected to NATS at shutdown: replies not yet sent are lost");
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
