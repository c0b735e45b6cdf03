//! The slots and what keeps them apart, set up in one step before the agent takes
//! commands and taken down in one after: the isolation mechanism the configuration asks
//! for ([`isolation_of`]), and around it ([`SlotStack`]) the slot table with the slots
//! prepared before a restart, the bus guard, and the login placement socket with its
//! sweep.

use crate::config::IsolationMode;
use crate::isolation::{
    self, bus_guard, cgroup, disk_quota, enter, mounts, netns, netns_blocks, private_tmp,
    shared_dirs, slot_dns, uid_range, user_isolation::UserIsolation, SlotIsolation, WorkspaceOnly,
};
use crate::slots::Slots;
use crate::{health, reconcile, AgentConfig, AgentError, PLACEMENT_SWEEP_INTERVAL, PROC_ROOT};
use slotpool_protocol::connect::Bus;
use std::sync::Arc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// The isolation mechanism `config` asks for: mode `none`, or mode `users` built from
/// the cgroup layout found, the slot uids, the shared directories, the mount namespace
/// (hiding processes), disk quotas and, if asked, a network namespace per slot.
pub fn isolation_of(config: &AgentConfig) -> Result<Arc<dyn SlotIsolation>, AgentError> {
    Ok(match config.isolation {
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
            .with_warm_limits(resolve_default_limits(config)?)
            .with_term_grace(config.slot_term_grace);
            match config.slot_netns {
                Some(range) => {
                    let networks = netns::SlotNetworks::new(
                        config.run_dir.join("netns").join(&config.namespace),
                        config.namespace.clone(),
                        range,
                        config.slots,
                        std::path::Path::new(netns_blocks::CLAIMS_DIR),
                        config.bus_guard_ports.clone().unwrap_or_default(),
                    )
                    .map_err(AgentError::Netns)?;
                    tracing::info!(
                        block = %networks.block(),
                        "every slot gets a network namespace of its own"
                    );
                    isolation = isolation.with_network(networks);
                }
                None => tracing::warn!(
                    "slots share the host's network namespace (--slot-netns off): a service \
                 on loopback in one slot is reachable from the others"
                ),
            }
            if config.slot_netns.is_some() && !config.slot_private_tmp {
                if let slot_dns::SlotDns::Own(_) | slot_dns::SlotDns::Unreachable =
                    read_slot_dns(config)
                {
                    tracing::warn!(
                        resolv_conf = %config.resolv_conf.display(),
                        "slots cannot reach the resolvers the host names (on loopback) and, \
                         without --slot-private-tmp, get no resolv.conf of their own"
                    );
                }
            }
            if config.slot_private_tmp {
                let mounts = private_tmp::SlotMounts::new(
                    config.run_dir.join("mntns").join(&config.namespace),
                    config.mount_namespace.clone(),
                )
                .map_err(AgentError::PrivateTmp)?;
                tracing::info!("every slot gets a /tmp, /var/tmp and /dev/shm of its own");
                let mounts = match slot_resolv_conf(config)? {
                    Some(file) => mounts.with_resolv_conf(file),
                    None => mounts,
                };
                isolation = isolation.with_private_tmp(mounts);
            }
            Arc::new(isolation)
        }
    })
}

/// What a slot's resolv.conf is, from the files the configuration names.
fn read_slot_dns(config: &AgentConfig) -> slot_dns::SlotDns {
    let host = std::fs::read_to_string(&config.resolv_conf).unwrap_or_default();
    let upstream = std::fs::read_to_string(&config.upstream_resolv_conf).ok();
    slot_dns::slot_dns(&host, upstream.as_deref())
}

/// The resolv.conf to bind in slots' mount namespaces, written to the run dir (0644),
/// when slots have network namespaces and cannot reach the host's resolvers.
fn slot_resolv_conf(config: &AgentConfig) -> Result<Option<std::path::PathBuf>, AgentError> {
    if config.slot_netns.is_none() {
        return Ok(None);
    }
    match read_slot_dns(config) {
        slot_dns::SlotDns::Host => Ok(None),
        slot_dns::SlotDns::Unreachable => {
            tracing::warn!(
                resolv_conf = %config.resolv_conf.display(),
                upstream = %config.upstream_resolv_conf.display(),
                "no DNS server a slot's network namespace can reach: the host names only \
                 resolvers on loopback (or IPv6) and no upstream server is known; slots \
                 resolve no names"
            );
            Ok(None)
        }
        slot_dns::SlotDns::Own(_) if !std::path::Path::new("/etc/resolv.conf").exists() => {
            tracing::warn!(
                "slots cannot reach the resolvers the host names, and there is no \
                 /etc/resolv.conf to put one of their own on"
            );
            Ok(None)
        }
        slot_dns::SlotDns::Own(text) => {
            let file = config
                .run_dir
                .join(format!("{}.resolv.conf", config.namespace));
            let partial = file.with_extension("conf.partial");
            std::fs::write(&partial, text)
                .and_then(|()| {
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o644))
                })
                .and_then(|()| std::fs::rename(&partial, &file))
                .map_err(|e| {
                    AgentError::PrivateTmp(private_tmp::PrivateTmpError {
                        action: format!("writing {}", file.display()),
                        reason: e.to_string(),
                    })
                })?;
            tracing::info!(
                file = %file.display(),
                "slots get a resolv.conf of their own: the host's resolvers are on loopback"
            );
            Ok(Some(file))
        }
    }
}

/// The slot table and what runs beside it for as long as the agent takes commands.
pub struct SlotStack {
    pub slots: Slots,
    guard: Option<bus_guard::BusGuard>,
    /// The placement socket and sweep (mode `users`), ended by the `background` token
    /// given to [`SlotStack::start`].
    tasks: Vec<JoinHandle<()>>,
}

impl SlotStack {
    /// Recovers the slots prepared before a restart (releasing those whose node is gone
    /// from KV), installs the bus guard and starts the login placement socket and sweep,
    /// which end with `background`.
    pub async fn start(
        config: &AgentConfig,
        isolation: Arc<dyn SlotIsolation>,
        bus: &Bus,
        background: &CancellationToken,
    ) -> Result<SlotStack, AgentError> {
        let default_limits = resolve_default_limits(config)?;
        tracing::info!(?default_limits, "limits of slots whose label sets none");
        let slots = Slots::recover(isolation.clone(), config.slots)
            .await
            .and_then(|s| s.with_dirty_dir(config.work_dir.join("dirty")))
            .map_err(AgentError::Slots)?
            .with_default_limits(default_limits);
        let released = reconcile::reconcile(&slots, &bus.slots, &config.backing_id).await;
        if !released.is_empty() {
            tracing::info!(
                ?released,
                "released the slots of nodes gone while the agent was down"
            );
        }
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
        Ok(SlotStack {
            slots,
            guard,
            tasks,
        })
    }

    /// After `background` was cancelled: waits for its tasks and for warm-ups, stops
    /// every slot process (and with `--remove-slots-on-stop` removes the slots) and
    /// removes the bus guard.
    pub async fn stop(self, config: &AgentConfig) {
        for task in self.tasks {
            if let Err(err) = task.await {
                tracing::warn!(%err, "background task failed");
            }
        }
        let (slots, guard) = (self.slots, self.guard);
        let isolation = slots.isolation().clone();
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
fn resolve_default_limits(config: &AgentConfig) -> Result<isolation::Limits, AgentError> {
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
