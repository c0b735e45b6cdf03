//! slotpool agent: runs on one backing node, prepares and wipes its slots on the
//! launcher's command, and reports its health and occupancy in a heartbeat.
//!
//! Code map:
//! - [`config`]: flags and the validated [`AgentConfig`];
//! - [`health`]: figures from `/proc` and `statvfs`;
//! - [`isolation`]: the [`isolation::SlotIsolation`] trait and its mode-`none` impl;
//! - [`user_isolation`]: mode `users`, a Unix user and a cgroup per slot, built from
//!   [`users`] (names, useradd/userdel, kill by uid) and [`cgroup`] (v2/v1 drivers);
//! - [`enter`]: the placement socket and the `enter-slot` helper sshd runs for logins;
//! - [`slots`]: who holds which slot, the prepare/release rules, dirty slots;
//! - [`commands`]: serving `slotpool.agent.v2.<backing id>`;
//! - [`heartbeat`]: the TTL'd record in the agents bucket; [`ssh`]: port and host keys.
//!
//! - [`reconcile`]: at start, releasing the prepared slots whose node is gone from KV.
//!
//! The agent writes only its own heartbeat key. It wipes a slot on its own only at start,
//! when the slots bucket no longer holds the node it prepared the slot for; otherwise the
//! launcher decides when a slot is released.

pub mod bus_guard;
pub mod cgroup;
pub mod commands;
pub mod config;
pub mod default_limits;
pub mod disk_quota;
pub mod enter;
pub mod health;
pub mod heartbeat;
pub mod isolation;
pub mod log_tail;
pub mod metrics;
pub mod metrics_http;
pub mod mounts;
pub mod netns;
pub mod reconcile;
pub mod shared_dirs;
pub mod slots;
pub mod ssh;
pub mod step_clock;
pub mod uid_range;
pub mod user_isolation;
pub mod users;
pub mod wipe;

pub use config::{AgentConfig, Args};

use config::{IsolationMode, ProbeConfig};
use health::ProbeStatus;
use heartbeat::Heartbeat;
use isolation::{IsolationError, SlotIsolation, WorkspaceOnly};
use log_tail::LogTail;
use slotpool_protocol::connect::{Bus, BusError};
use slotpool_protocol::layout::subjects;
use slotpool_protocol::time::now_ms;
use slots::Slots;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use user_isolation::UserIsolation;

/// Longest wait for the command subscription to be set up.
pub const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait at shutdown for replies to leave (only tried while connected).
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// How often processes of slot users outside their slot's cgroup are moved into it
/// (only while some slot is prepared).
pub const PLACEMENT_SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// Where cgroup mounts are looked up.
const PROC_ROOT: &str = "/proc";

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
    config: AgentConfig,
    bus: Bus,
    tail: LogTail,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    std::fs::create_dir_all(&config.work_dir).map_err(|error| AgentError::WorkDir {
        path: config.work_dir.clone(),
        error,
    })?;
    let isolation: Arc<dyn SlotIsolation> = match config.isolation {
        IsolationMode::None => {
            tracing::warn!(
                "ISOLATION IS OFF (--isolation none): slots share one user, see each other's \
                 files and processes and have no resource limits; use this for development only"
            );
            Arc::new(WorkspaceOnly::new(&config.work_dir).map_err(AgentError::Slots)?)
        }
        IsolationMode::Users => {
            let layout =
                cgroup::detect(std::path::Path::new(PROC_ROOT)).map_err(AgentError::Isolation)?;
            tracing::info!(
                ?layout,
                parent = config.cgroup_parent,
                "cgroup layout detected"
            );
            let driver = cgroup::driver(&layout, &config.cgroup_parent);
            let uids = uid_range::UidAllocator::open(&config.work_dir, config.slot_uids)
                .map_err(AgentError::Uids)?;
            tracing::info!(range = %config.slot_uids, "slot uids");
            let shared = shared_dirs::of_host();
            tracing::info!(dirs = ?shared, "shared directories cleaned of a slot user's entries at release");
            let mounts = mounts::MountNamespace::new(config.mount_namespace.clone());
            if let Some(hide) = config.hide_processes {
                let mounted = mounts
                    .hide_processes(hide.exempt_gid)
                    .map_err(AgentError::HideProcesses)?;
                tracing::info!(
                    exempt_gid = hide.exempt_gid,
                    mounted,
                    "slot users see only their own processes in /proc"
                );
            } else {
                tracing::warn!(
                    "PROCESSES NOT HIDDEN (--hide-processes off): every slot sees the command lines of the others' processes"
                );
            }
            let images = disk_quota::WorkspaceImages::new(&config.work_dir, mounts)
                .map_err(AgentError::Isolation)?;
            let default_disk = config.default_limits.disk_bytes();
            match (images.available(), default_disk) {
                (Err(why), Some(_)) => return Err(AgentError::DiskQuota(why)),
                (Err(why), None) => {
                    tracing::info!(%why, "labels asking for a disk quota will fail to prepare")
                }
                (Ok(()), _) => tracing::info!(
                    default_mb = config.default_limits.disk_mb,
                    "per-slot disk quotas available"
                ),
            }
            let mut isolation = UserIsolation::new(
                &config.work_dir,
                config.namespace.clone(),
                config.backing_id.to_string(),
                driver,
                uids,
                shared,
            )
            .map_err(AgentError::Isolation)?
            .with_disk_quotas(images, default_disk)
            .with_term_grace(config.slot_term_grace);
            match config.slot_netns {
                Some(range) => {
                    let networks = netns::SlotNetworks::new(
                        config.run_dir.join("netns").join(&config.namespace),
                        config.namespace.clone(),
                        range,
                        config.bus_guard_ports.clone().unwrap_or_default(),
                    )
                    .map_err(AgentError::Netns)?;
                    tracing::info!(%range, "every slot gets a network namespace of its own");
                    isolation = isolation.with_network(networks);
                }
                None => tracing::info!(
                    "slots share the host's network namespace (--slot-netns off): a service \
                     on loopback in one slot is reachable from the others"
                ),
            }
            Arc::new(isolation)
        }
    };
    run_with(config, bus, isolation, tail, shutdown).await
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

/// Moves stray slot processes into their cgroups every [`PLACEMENT_SWEEP_INTERVAL`]
/// while some slot is prepared (free slots, warm or not, have no processes to place).
async fn sweep_loop(slots: Slots, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(PLACEMENT_SWEEP_INTERVAL) => {}
        }
        if slots.reports().is_empty() {
            continue;
        }
        let iso = slots.isolation().clone();
        match tokio::task::spawn_blocking(move || iso.sweep()).await {
            Ok(0) => {}
            Ok(moved) => tracing::info!(
                moved,
                "placement sweep moved slot processes into their cgroups"
            ),
            Err(err) => tracing::warn!(%err, "placement sweep failed"),
        }
    }
}

/// The default slot limits for this host (its memory read once, from `/proc/meminfo`).
fn resolve_default_limits(
    config: &AgentConfig,
) -> Result<slotpool_protocol::api::SlotLimits, AgentError> {
    let path = std::path::Path::new(PROC_ROOT).join("meminfo");
    let memory = std::fs::read_to_string(&path)
        .map_err(|e| e.to_string())
        .and_then(|text| {
            health::parse_meminfo(&text).ok_or_else(|| "no MemTotal or MemAvailable".into())
        })
        .map_err(|message| AgentError::DefaultLimits {
            path: path.clone(),
            message,
        })?;
    Ok(config.default_limits.resolve(memory.total_kb, config.slots))
}

/// Runs the agent with the given isolation until `shutdown` is cancelled: recovers the
/// slots prepared before a restart, subscribes to commands, heartbeats at once and then
/// every interval, and on shutdown writes a last heartbeat with `draining: true`.
pub async fn run_with(
    config: AgentConfig,
    bus: Bus,
    isolation: Arc<dyn SlotIsolation>,
    tail: LogTail,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    let span = tracing::info_span!("agent", backing_id = %config.backing_id);
    async move {
        let started_at = now_ms();
        let default_limits = resolve_default_limits(&config)?;
        tracing::info!(?default_limits, "limits of slots whose label sets none");
        let slots = Slots::recover(isolation.clone(), config.slots)
            .await
            .and_then(|s| s.with_dirty_dir(config.work_dir.join("dirty")))
            .map_err(AgentError::Slots)?
            .with_default_limits(default_limits);
        let released = reconcile::reconcile(&slots, &bus.slots, &config.backing_id).await;
        if !released.is_empty() {
            tracing::info!(?released, "released the slots of nodes gone while the agent was down");
        }
        let ssh = Arc::new(ssh::SshInfo {
            port: config.ssh_port,
            host_keys: ssh::read_host_keys(&config.ssh_host_keys_dir),
        });
        let guard = match &config.bus_guard_ports {
            Some(ports) => {
                let (first, last) = (config.slot_uids.first, config.slot_uids.last);
                let table = format!("slotpool_{}", config.namespace);
                let guard = tokio::task::spawn_blocking({
                    let ports = ports.clone();
                    move || bus_guard::BusGuard::install(&table, first, last, &ports)
                })
                .await
                .expect("the bus guard task does not panic")
                .map_err(AgentError::BusGuard)?;
                Some(guard)
            }
            None => {
                if config.isolation == IsolationMode::Users {
                    tracing::warn!(
                        "BUS GUARD OFF (--bus-guard off): every slot can reach the NATS port"
                    );
                }
                None
            }
        };
        let background = shutdown.child_token();
        let mut tasks = Vec::new();
        if config.isolation == IsolationMode::Users {
            let listener =
                enter::bind(&config.run_dir, &config.namespace).map_err(AgentError::Enter)?;
            let path = enter::socket_path(&config.run_dir, &config.namespace);
            tracing::info!(socket = %path.display(), "login placement socket ready");
            tasks.push(tokio::spawn(
                enter::serve(listener, path, isolation.clone(), background.clone())
                    .in_current_span(),
            ));
            tasks.push(tokio::spawn(
                sweep_loop(slots.clone(), background.clone()).in_current_span(),
            ));
        }
        if let Some((addr, token_file)) = &config.metrics {
            let listener = metrics_http::MetricsListener::bind(*addr, token_file.as_deref())
                .await
                .map_err(AgentError::Metrics)?;
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
        let heartbeat = Heartbeat::new(
            &config,
            bus.agents.clone(),
            slots.clone(),
            started_at,
            probe_status,
            ssh.clone(),
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

        let ended =
            commands::serve(&bus, &slots, ssh, tail, commands, poke, &shutdown).await;

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
        // Let warm-ups finish, so none races the kill below or leaves a half-made slot.
        slots.warm_ups_done().await;
        // No slot process outlives the agent; workspaces stay for a restarted agent.
        let iso = isolation.clone();
        match tokio::task::spawn_blocking(move || iso.stop_all()).await {
            Ok(Ok(())) => tracing::info!("slot processes stopped"),
            Ok(Err(err)) => tracing::error!(%err, "cannot stop every slot process"),
            Err(err) => tracing::error!(%err, "stopping slot processes failed"),
        }
        if config.remove_slots_on_stop {
            let iso = isolation.clone();
            let count = config.slots;
            match tokio::task::spawn_blocking(move || iso.remove_all(count)).await {
                Ok(problems) if problems.is_empty() => tracing::info!("slots removed"),
                Ok(problems) => {
                    for err in problems {
                        tracing::error!(%err, "cannot remove a slot");
                    }
                }
                Err(err) => tracing::error!(%err, "removing the slots failed"),
            }
        }
        if let Some(guard) = guard {
            let table = guard.table().to_string();
            match tokio::task::spawn_blocking(move || guard.remove()).await {
                Ok(Ok(())) => tracing::info!(table, "bus guard removed"),
                Ok(Err(err)) => tracing::warn!(%err, "cannot remove the bus guard"),
                Err(err) => tracing::warn!(%err, "removing the bus guard failed"),
            }
        }
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
