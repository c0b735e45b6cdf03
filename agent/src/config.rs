//! Command-line flags and the validated [`AgentConfig`] built from them.
//!
//! Everything is checked once here; after [`Args::into_config`] the config is plain data.
//! The secret never comes from argv (it would show in `ps`): only from the environment
//! ([`SECRET_ENV`]) or a file (`--secret-file`), and only its SHA-256 is kept.

use crate::isolation::uid_range::UidRange;
use clap::Parser;
use slotpool_config::bus::NatsArgs;
use slotpool_protocol::connect::NatsOptions;
use slotpool_protocol::{model, BackingId};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Environment variable holding the agent's secret (the alternative to `--secret-file`).
pub const SECRET_ENV: &str = "SLOTPOOL_AGENT_SECRET";

/// slotpool agent: prepares and wipes the slots of one backing node and reports its health.
#[derive(Clone, Debug, Parser)]
#[command(name = "slotpool-agent", version, about)]
pub struct Args {
    /// Log format: `text`, or `json` (one object a line, with the fields of the slot's
    /// spans) for a log system.
    #[arg(long, env = "SLOTPOOL_LOG_FORMAT", default_value = "text")]
    pub log_format: slotpool_protocol::logging::LogFormat,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// The backing node this agent runs on (given by the launcher at launch).
    #[arg(long, env = "SLOTPOOL_BACKING_ID", value_name = "ID")]
    pub backing_id: String,
    /// File holding the agent secret (otherwise it is read from SLOTPOOL_AGENT_SECRET).
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// Directory for slot workspaces and agent state.
    #[arg(
        long,
        env = "SLOTPOOL_AGENT_WORK_DIR",
        value_name = "DIR",
        default_value = "/var/lib/slotpool/agent"
    )]
    pub work_dir: PathBuf,
    /// Number of slots this node is carved into (valid slot indexes are 0..N).
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub slots: u32,
    /// Time between heartbeats, in milliseconds. For a fleet of N backing nodes,
    /// max(2000, N / 5), so that the bus takes at most 5,000 heartbeats a second.
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    pub heartbeat_interval_ms: u64,
    /// How long a heartbeat lives in KV, in whole seconds (>= 1, longer than the interval;
    /// 3 x the interval).
    #[arg(long, value_name = "SECS", default_value_t = slotpool_protocol::model::DEFAULT_HEARTBEAT_TTL_SECS)]
    pub heartbeat_ttl_secs: u64,
    /// How slots are isolated: `users` (a Unix user and cgroup per slot; needs root; the
    /// default when root) or `none` (a directory per slot only, for unprivileged
    /// development runs).
    #[arg(long, value_enum, value_name = "MODE")]
    pub isolation: Option<IsolationMode>,
    /// Start of slot user names: `<prefix><8 hex of sha256(backing id)>s<slot>`.
    #[arg(long, value_name = "PREFIX", default_value = "sp")]
    pub user_prefix: String,
    /// uids of slot users, FIRST-LAST: handed out in order and wrapping only at the end,
    /// so a slot's next user never gets the uid just freed. Agents sharing a host need
    /// ranges of their own.
    #[arg(long, value_name = "FIRST-LAST", default_value = crate::isolation::uid_range::DEFAULT_RANGE)]
    pub slot_uid_range: String,
    /// In users mode, keep slot users off the bus and off slotpool's own listeners: an
    /// nftables table rejects TCP from the slot uid range to the port of every --nats
    /// URL, of --metrics and of every --guard-port, on any address (needs `nft`). `off`
    /// leaves them reachable from every slot (logged loudly).
    #[arg(long, value_enum, value_name = "ON|OFF", default_value = "on")]
    pub bus_guard: Switch,
    /// One more TCP port slot users must not reach (repeat for several): the port of a
    /// launcher's `--http` listener on this host, say. The local provider passes its
    /// launcher's.
    #[arg(long = "guard-port", value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    pub guard_ports: Vec<u16>,
    /// In users mode, give every slot a network namespace of its own (its own loopback;
    /// out through the host by a veth pair and masquerading). On by default in users mode;
    /// `off` lets slots share the host's network, loopback included (logged loudly). See
    /// docs/slot-network.md.
    #[arg(long, value_enum, value_name = "ON|OFF")]
    pub slot_netns: Option<Switch>,
    /// IPv4 range the slots' veth pairs are numbered from (a /30 per slot), shared by
    /// the agents of a host: each takes a free block of it at start.
    #[arg(long, value_name = "CIDR", default_value = crate::isolation::netns::DEFAULT_RANGE)]
    pub slot_netns_range: String,
    /// The host's resolver configuration, read at start: when it names only servers a
    /// slot's network namespace cannot reach (loopback, IPv6), slots get a resolv.conf of
    /// their own. See docs/slot-network.md.
    #[arg(long, value_name = "FILE", default_value = crate::isolation::slot_dns::HOST_RESOLV_CONF)]
    pub resolv_conf: PathBuf,
    /// systemd-resolved's list of upstream servers, given to slots when the host's
    /// resolv.conf names only a resolver on loopback.
    #[arg(long, value_name = "FILE", default_value = crate::isolation::slot_dns::UPSTREAM_RESOLV_CONF)]
    pub upstream_resolv_conf: PathBuf,
    /// In users mode, give every slot a /tmp, /var/tmp and /dev/shm of its own (tmpfs
    /// mounts in a mount namespace of the slot's, counted in its memory limit), gone with
    /// the slot at release however many files they hold. `off` lets slots share the
    /// host's, whose entries are then removed one by one within the release's budget. See
    /// docs/isolation.md.
    #[arg(long, value_enum, value_name = "ON|OFF", default_value = "on")]
    pub slot_private_tmp: Switch,
    /// Most processes and threads of a slot whose label sets no `limits.pids`.
    #[arg(long, value_name = "N", default_value_t = crate::isolation::default_limits::DEFAULT_PIDS_MAX)]
    pub default_pids_max: u32,
    /// Memory of a slot whose label sets no `limits.memory-mb`, in MiB; `auto`: 90% of
    /// the host's memory divided by --slots.
    #[arg(long, value_name = "MIB|auto", default_value = "auto")]
    pub default_memory_max_mb: String,
    /// Disk quota of a slot whose label sets no `limits.disk-mb`, in MiB: its workspace
    /// is a loop-mounted ext4 image of that size (users mode; needs loop devices and
    /// mkfs.ext4). Unset: such slots write to the work dir's file system, unbounded.
    #[arg(long, value_name = "MIB")]
    pub slot_disk_quota_mb: Option<u64>,
    /// In users mode, make /proc show each slot user only its own processes
    /// (`hidepid=invisible`, for every user but root and --hide-processes-gid), in the
    /// mount namespace of --mount-namespace. `off` lets every slot see the command lines
    /// of its neighbours' processes.
    #[arg(long, value_enum, value_name = "ON|OFF", default_value = "on")]
    pub hide_processes: Switch,
    /// A group whose members still see every process (operators' monitoring).
    #[arg(long, value_name = "GID")]
    pub hide_processes_gid: Option<u32>,
    /// Mount namespace file where slot logins live (sshd's), for the agent's mounts
    /// (workspace images, /proc): `/proc/1/ns/mnt` when the agent runs in a namespace of
    /// its own (systemd's ProtectSystem=). Unset: the agent's own namespace.
    #[arg(long, value_name = "FILE")]
    pub mount_namespace: Option<PathBuf>,
    /// Serve this agent's Prometheus metrics at `/metrics` over HTTP on this IP:PORT (off
    /// by default). Port 0 picks a free port; the log says which ("metrics listening
    /// on").
    #[arg(long, env = "SLOTPOOL_AGENT_METRICS", value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
    /// A file holding the bearer token scrapers must send (`Authorization: Bearer …`).
    /// Required for a --metrics address that is not loopback.
    #[arg(long, value_name = "FILE", requires = "metrics")]
    pub metrics_token_file: Option<PathBuf>,
    /// At most this many metrics connections at once; more wait in the kernel's backlog
    /// until one closes.
    #[arg(long, value_name = "N", default_value_t = crate::metrics_http::DEFAULT_MAX_CONNECTIONS)]
    pub metrics_max_connections: usize,
    /// cgroup directory (under each hierarchy's mount) holding the slot groups.
    #[arg(long, value_name = "NAME", default_value = "slotpool")]
    pub cgroup_parent: String,
    /// At release (users mode), how long a slot's processes have after SIGTERM to exit
    /// before they are killed; the release goes on as soon as they have. 0: kill at once.
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    pub slot_term_grace_ms: u64,
    /// On stop, remove every slot (its user, cgroup, workspace and state) instead of
    /// keeping the slots for the next start, leaving the host as it was before the agent
    /// started. For benchmarks, demos and tests; a production agent keeps its slots.
    #[arg(long)]
    pub remove_slots_on_stop: bool,
    /// Directory of the placement sockets `enter-slot` connects to.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_RUN_DIR)]
    pub run_dir: PathBuf,
    /// SSH port slot users log in on (reported to launchers and put on nodes).
    #[arg(long, value_name = "PORT", default_value_t = 22)]
    pub ssh_port: u16,
    /// Directory of the sshd host keys to report (`ssh_host_*_key.pub`).
    #[arg(long, value_name = "DIR", default_value = "/etc/ssh")]
    pub ssh_host_keys_dir: PathBuf,
    /// Health probe, run with `sh -c`: the node is healthy only once it exits 0, and
    /// while it keeps doing so.
    #[arg(long, value_name = "COMMAND")]
    pub health_probe: Option<String>,
    /// Time between health probe runs, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 10_000)]
    pub health_probe_interval_ms: u64,
    /// Longest a health probe run may take, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 30_000)]
    pub health_probe_timeout_ms: u64,
    /// Unhealthy when less memory than this is available, in MiB (0: no check).
    #[arg(long, value_name = "MIB", default_value_t = 0)]
    pub min_memory_available_mb: u64,
    /// Unhealthy when less disk than this is available in the work dir, in MiB (0: no check).
    #[arg(long, value_name = "MIB", default_value_t = 0)]
    pub min_disk_available_mb: u64,
    /// Watch the instance metadata service at this base URL (IMDSv2, e.g.
    /// `http://169.254.169.254`) for a spot interruption notice, and report one in the
    /// heartbeat; the EC2 provider sets it for spot sizes. Off by default.
    #[arg(long, value_name = "URL")]
    pub spot_notice_url: Option<String>,
}

/// Default directory of the placement sockets.
pub const DEFAULT_RUN_DIR: &str = "/run/slotpool";

/// How slots are isolated from each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IsolationMode {
    /// A Unix user, a 0700 home and a cgroup with limits per slot (root only).
    Users,
    /// A private directory per slot and nothing else: no protection between slots.
    None,
}

impl IsolationMode {
    pub fn as_str(self) -> &'static str {
        match self {
            IsolationMode::Users => "users",
            IsolationMode::None => "none",
        }
    }
}

/// The health probe settings.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeConfig {
    pub command: String,
    pub interval: Duration,
    pub timeout: Duration,
}

/// The longest `--slot-term-grace-ms`: the release that waits it answers the launcher,
/// which waits 30 s, and the kill after it may take up to 10 s.
pub const MAX_TERM_GRACE_MS: u64 = 15_000;

/// The agent's validated settings. Plain data.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentConfig {
    pub backing_id: BackingId,
    /// SHA-256 (hex) of the agent secret; the secret itself is not kept.
    pub secret_sha256: String,
    pub work_dir: PathBuf,
    /// Slots this node has; valid indexes are `0..slots`.
    pub slots: u32,
    pub heartbeat_interval: Duration,
    pub heartbeat_ttl: Duration,
    pub isolation: IsolationMode,
    /// User-name namespace of this agent: `<prefix><8 hex of sha256(backing id)>`.
    pub namespace: String,
    pub cgroup_parent: String,
    /// How long a slot's processes get to exit on SIGTERM at release.
    pub slot_term_grace: Duration,
    /// Remove every slot when stopping (`--remove-slots-on-stop`).
    pub remove_slots_on_stop: bool,
    /// Where slot users' uids come from.
    pub slot_uids: UidRange,
    /// The ports slot users are kept from (users mode with --bus-guard on): the bus's,
    /// --guard-port's and --metrics' (a metrics port 0 is added once bound).
    pub bus_guard_ports: Option<Vec<u16>>,
    /// The block of the slots' veth addresses, when every slot has a network namespace
    /// of its own (users mode with --slot-netns on).
    pub slot_netns: Option<crate::isolation::netns::AddressRange>,
    /// `--resolv-conf` and `--upstream-resolv-conf`.
    pub resolv_conf: PathBuf,
    pub upstream_resolv_conf: PathBuf,
    /// Whether every slot has a private `/tmp` (users mode with --slot-private-tmp on).
    pub slot_private_tmp: bool,
    pub run_dir: PathBuf,
    pub ssh_port: u16,
    pub ssh_host_keys_dir: PathBuf,
    pub probe: Option<ProbeConfig>,
    pub thresholds: crate::health::Thresholds,
    /// Limits of a slot whose label sets none (see [`crate::isolation::default_limits`]).
    pub default_limits: crate::isolation::default_limits::DefaultLimits,
    /// Hide other users' processes in /proc (users mode with --hide-processes on).
    pub hide_processes: Option<HideProcesses>,
    /// Where the agent's mounts go (see [`crate::isolation::mounts`]).
    pub mount_namespace: Option<PathBuf>,
    /// Where and how to serve `/metrics` (`--metrics`).
    pub metrics: Option<crate::metrics_http::MetricsSettings>,
    /// The instance metadata service's `host:port` to read the spot interruption notice
    /// from (`--spot-notice-url`).
    pub spot_notice: Option<String>,
}

/// How /proc hides processes from slot users.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HideProcesses {
    /// Members of this group still see every process.
    pub exempt_gid: Option<u32>,
}

/// Why the flags do not make a valid configuration.
/// A feature switch on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    On,
    Off,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--bus-guard: {0}")]
    BusGuard(crate::isolation::bus_guard::GuardError),
    #[error("invalid --backing-id: {0}")]
    BackingId(slotpool_protocol::ids::InvalidId),
    #[error("no agent secret: set {SECRET_ENV} or pass --secret-file")]
    NoSecret,
    #[error("agent secret given twice: set {SECRET_ENV} or pass --secret-file, not both")]
    TwoSecrets,
    #[error("reading secret file {path}: {error}")]
    SecretFile {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("the agent secret from {origin} is empty")]
    EmptySecret { origin: String },
    #[error("{SECRET_ENV} is not valid utf-8")]
    SecretNotUtf8,
    #[error("--slots must be at least 1, got {0}")]
    NoSlots(u32),
    #[error("--heartbeat-interval-ms must be at least 1, got {0}")]
    ZeroInterval(u64),
    #[error("--heartbeat-ttl-secs must be at least 1, got {0}")]
    ZeroTtl(u64),
    #[error(
        "--heartbeat-ttl-secs ({ttl_secs} s) must be longer than --heartbeat-interval-ms ({interval_ms} ms)"
    )]
    TtlNotAboveInterval { ttl_secs: u64, interval_ms: u64 },
    #[error("--isolation users needs root (it creates users and cgroups); run as root, or pass --isolation none for an unprivileged development run without isolation")]
    UsersNeedRoot,
    #[error(
        "invalid --user-prefix {0:?}: use 1 to 12 of a-z, 0-9, '_' and '-', starting with a letter"
    )]
    UserPrefix(String),
    #[error(
        "invalid --cgroup-parent {0:?}: use one directory name of A-Z, a-z, 0-9, '_', '-' and '.'"
    )]
    CgroupParent(String),
    #[error("--slot-term-grace-ms must be 0 to {MAX_TERM_GRACE_MS} (a release answers the launcher within 30 s), got {0}")]
    TermGrace(u64),
    #[error("--slot-uid-range: {0}")]
    UidRange(crate::isolation::uid_range::UidError),
    #[error("--slot-netns-range: {0}")]
    NetnsRange(String),
    #[error("--slot-netns on needs --isolation users")]
    NetnsNeedsUsers,
    #[error("--default-pids-max must be at least 1, got 0")]
    DefaultPids,
    #[error("--default-memory-max-mb: {0}")]
    DefaultMemory(String),
    #[error("--slot-disk-quota-mb must be at least {min} MiB, got {0}", min = slotpool_protocol::api::MIN_DISK_MB)]
    DiskQuota(u64),
    #[error("--slot-disk-quota-mb needs --isolation users")]
    DiskQuotaNeedsUsers,
    #[error("--health-probe-interval-ms and --health-probe-timeout-ms must be at least 100")]
    ProbeTiming,
    #[error(transparent)]
    SpotNoticeUrl(crate::spot::NoticeError),
}

impl Args {
    /// Validates the flags. `secret_env` is the value of [`SECRET_ENV`], if set.
    pub fn into_config_as(
        self,
        secret_env: Option<std::ffi::OsString>,
        running_as_root: bool,
    ) -> Result<AgentConfig, ConfigError> {
        let backing_id = BackingId::parse(&self.backing_id).map_err(ConfigError::BackingId)?;
        let secret = load_secret(secret_env, self.secret_file.as_deref())?;
        if self.slots == 0 {
            return Err(ConfigError::NoSlots(self.slots));
        }
        if self.heartbeat_interval_ms == 0 {
            return Err(ConfigError::ZeroInterval(self.heartbeat_interval_ms));
        }
        if self.heartbeat_ttl_secs == 0 {
            return Err(ConfigError::ZeroTtl(self.heartbeat_ttl_secs));
        }
        let heartbeat_interval = Duration::from_millis(self.heartbeat_interval_ms);
        let heartbeat_ttl = Duration::from_secs(self.heartbeat_ttl_secs);
        if heartbeat_ttl <= heartbeat_interval {
            return Err(ConfigError::TtlNotAboveInterval {
                ttl_secs: self.heartbeat_ttl_secs,
                interval_ms: self.heartbeat_interval_ms,
            });
        }
        let isolation = match self.isolation {
            Some(mode) => mode,
            None if running_as_root => IsolationMode::Users,
            None => return Err(ConfigError::UsersNeedRoot),
        };
        if isolation == IsolationMode::Users && !running_as_root {
            return Err(ConfigError::UsersNeedRoot);
        }
        if !crate::isolation::passwd::valid_prefix(&self.user_prefix) {
            return Err(ConfigError::UserPrefix(self.user_prefix));
        }
        let parent_ok = !self.cgroup_parent.is_empty()
            && self.cgroup_parent != "."
            && self.cgroup_parent != ".."
            && self
                .cgroup_parent
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
        if !parent_ok {
            return Err(ConfigError::CgroupParent(self.cgroup_parent));
        }
        let slot_uids = UidRange::parse(&self.slot_uid_range).map_err(ConfigError::UidRange)?;
        let bus_guard_ports = match (isolation, self.bus_guard) {
            (IsolationMode::Users, Switch::On) => {
                let mut ports = crate::isolation::bus_guard::ports_of(&self.nats.url)
                    .map_err(ConfigError::BusGuard)?;
                let metrics = self.metrics.map(|a| a.port()).filter(|p| *p != 0);
                for port in self.guard_ports.iter().copied().chain(metrics) {
                    if !ports.contains(&port) {
                        ports.push(port);
                    }
                }
                Some(ports)
            }
            _ => None,
        };
        let slot_netns = match (isolation, self.slot_netns) {
            (_, Some(Switch::Off)) | (IsolationMode::None, None) => None,
            (IsolationMode::None, Some(Switch::On)) => return Err(ConfigError::NetnsNeedsUsers),
            (IsolationMode::Users, Some(Switch::On) | None) => {
                let range = crate::isolation::netns::AddressRange::parse(&self.slot_netns_range)
                    .map_err(ConfigError::NetnsRange)?;
                if range.capacity() < self.slots {
                    return Err(ConfigError::NetnsRange(format!(
                        "{range} holds {} slots (a /30 each), not {}",
                        range.capacity(),
                        self.slots
                    )));
                }
                Some(range)
            }
        };
        if self.slot_term_grace_ms > MAX_TERM_GRACE_MS {
            return Err(ConfigError::TermGrace(self.slot_term_grace_ms));
        }
        if self.default_pids_max == 0 {
            return Err(ConfigError::DefaultPids);
        }
        if let Some(mb) = self.slot_disk_quota_mb {
            if mb < slotpool_protocol::api::MIN_DISK_MB {
                return Err(ConfigError::DiskQuota(mb));
            }
            if isolation != IsolationMode::Users {
                return Err(ConfigError::DiskQuotaNeedsUsers);
            }
        }
        let default_limits = crate::isolation::default_limits::DefaultLimits {
            pids: self.default_pids_max,
            memory: self
                .default_memory_max_mb
                .parse()
                .map_err(ConfigError::DefaultMemory)?,
            disk_mb: self.slot_disk_quota_mb,
        };
        let hide_processes = (isolation == IsolationMode::Users
            && self.hide_processes == Switch::On)
            .then_some(HideProcesses {
                exempt_gid: self.hide_processes_gid,
            });
        if self.health_probe_interval_ms < 100 || self.health_probe_timeout_ms < 100 {
            return Err(ConfigError::ProbeTiming);
        }
        let spot_notice = self
            .spot_notice_url
            .as_deref()
            .map(crate::spot::address_of)
            .transpose()
            .map_err(ConfigError::SpotNoticeUrl)?;
        let probe = self.health_probe.map(|command| ProbeConfig {
            command,
            interval: Duration::from_millis(self.health_probe_interval_ms),
            timeout: Duration::from_millis(self.health_probe_timeout_ms),
        });
        Ok(AgentConfig {
            secret_sha256: model::secret_digest(&secret),
            namespace: crate::isolation::passwd::namespace(&self.user_prefix, backing_id.as_str()),
            backing_id,
            work_dir: self.work_dir,
            slots: self.slots,
            heartbeat_interval,
            heartbeat_ttl,
            isolation,
            cgroup_parent: self.cgroup_parent,
            slot_term_grace: Duration::from_millis(self.slot_term_grace_ms),
            remove_slots_on_stop: self.remove_slots_on_stop,
            slot_uids,
            bus_guard_ports,
            slot_netns,
            resolv_conf: self.resolv_conf,
            upstream_resolv_conf: self.upstream_resolv_conf,
            slot_private_tmp: matches!(isolation, IsolationMode::Users)
                && matches!(self.slot_private_tmp, Switch::On),
            run_dir: self.run_dir,
            ssh_port: self.ssh_port,
            ssh_host_keys_dir: self.ssh_host_keys_dir,
            probe,
            thresholds: crate::health::Thresholds {
                min_memory_available_kb: self.min_memory_available_mb.saturating_mul(1024),
                min_disk_available_kb: self.min_disk_available_mb.saturating_mul(1024),
            },
            default_limits,
            hide_processes,
            mount_namespace: self.mount_namespace,
            metrics: self
                .metrics
                .map(|addr| crate::metrics_http::MetricsSettings {
                    addr,
                    token_file: self.metrics_token_file,
                    max_connections: self.metrics_max_connections,
                }),
            spot_notice,
        })
    }

    /// Validates the flags for a process running as root or not (`into_config` asks the
    /// kernel); tests use this to be independent of who runs them.
    pub fn into_config(
        self,
        secret_env: Option<std::ffi::OsString>,
    ) -> Result<AgentConfig, ConfigError> {
        let root = rustix::process::geteuid().is_root();
        self.into_config_as(secret_env, root)
    }

    /// How to reach NATS; the connection is named after the backing node.
    pub fn nats_options(&self) -> NatsOptions {
        self.nats
            .options(&format!("slotpool-agent-{}", self.backing_id))
    }
}

/// The secret from exactly one of the environment or a file. A file's trailing newline
/// is not part of the secret.
fn load_secret(
    env: Option<std::ffi::OsString>,
    file: Option<&Path>,
) -> Result<String, ConfigError> {
    let (secret, origin) = match (env, file) {
        (Some(_), Some(_)) => return Err(ConfigError::TwoSecrets),
        (None, None) => return Err(ConfigError::NoSecret),
        (Some(value), None) => (
            value
                .into_string()
                .map_err(|_| ConfigError::SecretNotUtf8)?,
            SECRET_ENV.to_string(),
        ),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).map_err(|error| ConfigError::SecretFile {
                path: path.to_path_buf(),
                error,
            })?;
            (
                // Surrounding whitespace is not part of a secret, as for static hosts'
                // secret files on the launcher side: both hash the same bytes.
                text.trim().to_string(),
                path.display().to_string(),
            )
        }
    };
    if secret.is_empty() {
        return Err(ConfigError::EmptySecret { origin });
    }
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut argv = vec!["slotpool-agent", "--backing-id", "bn-1"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).expect("flags parse")
    }

    fn env_secret() -> Option<std::ffi::OsString> {
        Some("s3cret".into())
    }

    #[test]
    fn defaults_make_a_valid_config() {
        let c = args(&[]).into_config_as(env_secret(), true).unwrap();
        assert_eq!(c.backing_id.as_str(), "bn-1");
        assert_eq!(c.slots, 8);
        assert_eq!(c.heartbeat_interval, Duration::from_millis(2000));
        assert_eq!(c.heartbeat_ttl, Duration::from_secs(6));
        assert_eq!(c.secret_sha256, model::secret_digest("s3cret"));
        assert_eq!(
            c.default_limits,
            crate::isolation::default_limits::DefaultLimits {
                pids: 4096,
                memory: crate::isolation::default_limits::MemoryDefault::Auto,
                disk_mb: None,
            }
        );
        assert_eq!(
            c.hide_processes,
            Some(HideProcesses { exempt_gid: None }),
            "users mode hides processes by default"
        );
        assert_eq!(c.mount_namespace, None);
    }

    #[test]
    fn slot_term_grace_defaults_to_two_seconds_and_is_bounded() {
        let c = args(&[]).into_config_as(env_secret(), true).unwrap();
        assert_eq!(c.slot_term_grace, Duration::from_secs(2));
        let c = args(&["--slot-term-grace-ms", "0"])
            .into_config_as(env_secret(), true)
            .unwrap();
        assert_eq!(c.slot_term_grace, Duration::ZERO);
        let err = args(&["--slot-term-grace-ms", "15001"])
            .into_config_as(env_secret(), true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--slot-term-grace-ms must be 0 to 15000"),
            "{err}"
        );
    }

    #[test]
    fn disk_quota_and_process_hiding_are_checked() {
        let c = args(&["--slot-disk-quota-mb", "64", "--hide-processes-gid", "4"])
            .into_config_as(env_secret(), true)
            .unwrap();
        assert_eq!(c.default_limits.disk_mb, Some(64));
        assert_eq!(
            c.hide_processes,
            Some(HideProcesses {
                exempt_gid: Some(4)
            })
        );
        assert!(args(&["--slot-disk-quota-mb", "1"])
            .into_config_as(env_secret(), true)
            .is_err());
        assert!(args(&["--isolation", "none", "--slot-disk-quota-mb", "64"])
            .into_config_as(env_secret(), false)
            .is_err());
        let none = args(&["--isolation", "none"])
            .into_config_as(env_secret(), false)
            .unwrap();
        assert_eq!(none.hide_processes, None, "only users mode hides processes");
        let off = args(&["--hide-processes", "off"])
            .into_config_as(env_secret(), true)
            .unwrap();
        assert_eq!(off.hide_processes, None);
    }

    #[test]
    fn default_limits_cannot_be_switched_off() {
        for bad in [
            &["--default-pids-max", "0"][..],
            &["--default-memory-max-mb", "0"],
            &["--default-memory-max-mb", "none"],
        ] {
            assert!(
                args(bad).into_config_as(env_secret(), true).is_err(),
                "{bad:?}"
            );
        }
        let c = args(&["--default-pids-max", "64", "--default-memory-max-mb", "512"])
            .into_config_as(env_secret(), true)
            .unwrap();
        assert_eq!(c.default_limits.pids, 64);
        assert_eq!(
            c.default_limits.memory,
            crate::isolation::default_limits::MemoryDefault::Mib(512)
        );
    }

    #[test]
    fn secret_comes_from_exactly_one_place() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("secret");
        std::fs::write(&file, "from-file\n").unwrap();
        let file_flag = ["--secret-file", file.to_str().unwrap()];

        let c = args(&file_flag).into_config_as(None, true).unwrap();
        assert_eq!(c.secret_sha256, model::secret_digest("from-file"));
        assert!(matches!(
            args(&file_flag).into_config_as(env_secret(), true),
            Err(ConfigError::TwoSecrets)
        ));
        assert!(matches!(
            args(&[]).into_config_as(None, true),
            Err(ConfigError::NoSecret)
        ));
        assert!(matches!(
            args(&[]).into_config_as(Some("".into()), true),
            Err(ConfigError::EmptySecret { .. })
        ));
        let missing = dir.path().join("nope");
        let err = args(&["--secret-file", missing.to_str().unwrap()])
            .into_config_as(None, true)
            .unwrap_err()
            .to_string();
        assert!(err.contains(missing.to_str().unwrap()), "{err}");
    }

    #[test]
    fn bad_values_are_refused() {
        let bad_id = Args::try_parse_from(["slotpool-agent", "--backing-id", "bn.1"]).unwrap();
        let err = bad_id
            .into_config_as(env_secret(), true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("invalid --backing-id") && err.contains("bn.1"),
            "{err}"
        );
        let cases: [(&[&str], &str); 4] = [
            (&["--slots", "0"], "--slots"),
            (&["--heartbeat-interval-ms", "0"], "--heartbeat-interval-ms"),
            (&["--heartbeat-ttl-secs", "0"], "at least 1"),
            (
                &[
                    "--heartbeat-interval-ms",
                    "3000",
                    "--heartbeat-ttl-secs",
                    "3",
                ],
                "must be longer",
            ),
        ];
        for (flags, wanted) in cases {
            let err = args(flags)
                .into_config_as(env_secret(), true)
                .unwrap_err()
                .to_string();
            assert!(err.contains(wanted), "{flags:?}: {err}");
        }
    }

    #[test]
    fn slot_netns_is_on_by_default_in_users_mode_and_needs_room() {
        let c = args(&["--isolation", "none"])
            .into_config_as(env_secret(), false)
            .unwrap();
        assert_eq!(c.slot_netns, None);
        let c = args(&["--slot-netns", "off"])
            .into_config_as(env_secret(), true)
            .unwrap();
        assert_eq!(c.slot_netns, None);
        let c = args(&[]).into_config_as(env_secret(), true).unwrap();
        assert_eq!(
            c.slot_netns.map(|r| r.to_string()).as_deref(),
            Some(crate::isolation::netns::DEFAULT_RANGE)
        );
        let on_none = ["--slot-netns", "on", "--isolation", "none"];
        assert!(matches!(
            args(&on_none).into_config_as(env_secret(), false),
            Err(ConfigError::NetnsNeedsUsers)
        ));
        let small = ["--slot-netns", "on", "--slots", "3"];
        let err = args(&[&small[..], &["--slot-netns-range", "10.1.2.0/29"]].concat())
            .into_config_as(env_secret(), true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("holds 2 slots"), "{err}");
        let err = args(&["--slot-netns", "on", "--slot-netns-range", "10.1.2.3/24"])
            .into_config_as(env_secret(), true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--slot-netns-range"), "{err}");
    }

    #[test]
    fn isolation_defaults_to_users_for_root_only() {
        let c = args(&[]).into_config_as(env_secret(), true).unwrap();
        assert_eq!(c.isolation, IsolationMode::Users);
        assert!(c.namespace.starts_with("sp") && c.namespace.len() == 10);
        let err = args(&[]).into_config_as(env_secret(), false).unwrap_err();
        assert!(err.to_string().contains("--isolation none"), "{err}");
        assert!(matches!(
            args(&["--isolation", "users"]).into_config_as(env_secret(), false),
            Err(ConfigError::UsersNeedRoot)
        ));
        let c = args(&["--isolation", "none"])
            .into_config_as(env_secret(), false)
            .unwrap();
        assert_eq!(c.isolation, IsolationMode::None);
        assert_eq!(
            c.slot_uids.to_string(),
            crate::isolation::uid_range::DEFAULT_RANGE
        );
        let c = args(&["--slot-uid-range", "3000000-3000999"])
            .into_config_as(env_secret(), true)
            .unwrap();
        assert_eq!(
            (c.slot_uids.first, c.slot_uids.last),
            (3_000_000, 3_000_999)
        );
        let err = args(&["--slot-uid-range", "10-20"])
            .into_config_as(env_secret(), true)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("--slot-uid-range: invalid uid range 10-20"),
            "{err}"
        );
        for bad in [
            &["--user-prefix", "Bad"][..],
            &["--cgroup-parent", "a/b"][..],
            &["--cgroup-parent", ".."][..],
            &["--health-probe-interval-ms", "5"][..],
        ] {
            assert!(
                args(bad).into_config_as(env_secret(), true).is_err(),
                "{bad:?}"
            );
        }
        let c = args(&["--health-probe", "true", "--min-disk-available-mb", "2"])
            .into_config_as(env_secret(), true)
            .unwrap();
        assert_eq!(c.probe.unwrap().command, "true");
        assert_eq!(c.thresholds.min_disk_available_kb, 2048);
    }

    #[test]
    fn the_spot_notice_is_watched_only_when_asked_at_an_http_address() {
        let c = args(&[]).into_config_as(env_secret(), true).unwrap();
        assert_eq!(c.spot_notice, None);
        let c = args(&["--spot-notice-url", "http://169.254.169.254"])
            .into_config_as(env_secret(), true)
            .unwrap();
        assert_eq!(c.spot_notice.as_deref(), Some("169.254.169.254:80"));
        let err = args(&["--spot-notice-url", "https://169.254.169.254"])
            .into_config_as(env_secret(), true)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "--spot-notice-url \"https://169.254.169.254\": expected http://HOST[:PORT]"
        );
    }

    #[test]
    fn secret_is_not_a_flag() {
        assert!(
            Args::try_parse_from(["slotpool-agent", "--backing-id", "bn-1", "--secret", "x"])
                .is_err()
        );
    }
}
