//! One cgroup per slot, behind [`CgroupDriver`]: create with limits, add a process, list
//! its processes, kill them all, remove.
//!
//! **Detection** ([`detect`]) happens once at start-up from `/proc/self/mountinfo` and is
//! logged:
//! - **v2** when a `cgroup2` mount offers the `cpu`, `memory` and `pids` controllers in
//!   its `cgroup.controllers` (a pure v2 host, or a hybrid one with controllers on v2);
//! - otherwise **v1** when `cgroup` (v1) hierarchies carry `cpu`, `memory`, `pids` and
//!   `freezer` (a hybrid host whose unified mount has no controllers delegated);
//! - otherwise start-up fails, naming what is missing.
//!
//! Layout: `<mount>/<parent>/<name>` in v2; the same path in each of the cpu, memory, pids
//! and freezer hierarchies in v1. `<parent>` is the agent's `--cgroup-parent` and `<name>`
//! the slot's user name, so several agents on one host never share a group.
//!
//! **Terminate** ([`CgroupDriver::terminate`]), before the kill at release: SIGTERM to
//! every process of the group, then a wait of at most the grace for the group to empty:
//! v2 sleeps on `cgroup.events` (inotify) until it says `populated 0`; v1, which has no
//! such file, looks at `cgroup.procs` every [`TERM_POLL`].
//!
//! **Kill** ([`CgroupDriver::kill_all`]): v2 writes `1` to `cgroup.kill` (Linux 5.14+) or
//! else freezes the group; v1 freezes the group through the freezer hierarchy. While the
//! group is frozen no process in it can fork, so one SIGKILL to every pid in
//! `cgroup.procs` gets them all; the group is thawed (killed processes only die once
//! thawed) and the whole round repeats until `cgroup.procs` is empty.
//!
//! **Closed to other slots.** The parent directory is root's, 0711, and its own files
//! (the totals of every slot below it) are readable by root only; a slot's directory is
//! root's with the slot user's group, 0750 ([`close_parent`], [`close_slot_dir`]). A job
//! reads its own group (its limits and usage, at the path `/proc/self/cgroup` names, as
//! runtimes that size themselves to their limits do) but cannot enter a neighbour's to
//! read its `cgroup.procs` or usage, nor list the parent to find it.
//!
//! Every function takes its roots as data ([`CgroupLayout`]), so unit tests run on a
//! temp dir.

use super::Limits;
use crate::isolation::IsolationError;
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::fs::inotify;
use rustix::process::{kill_process, Pid, Signal};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Longest a kill or remove keeps retrying before it reports the group as not empty.
pub const KILL_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between rounds of a kill (or while a freeze settles).
const KILL_ROUND_PAUSE: Duration = Duration::from_millis(5);
/// Pause between looks at a v1 group's processes while they exit on SIGTERM.
pub const TERM_POLL: Duration = Duration::from_millis(10);
/// CFS period used for the cpu limit, in microseconds.
pub const CPU_PERIOD_US: u64 = 100_000;

/// Mode of the parent directory: slot users pass through it to their own group and
/// list nothing.
pub const PARENT_DIR_MODE: u32 = 0o711;
/// Mode of a slot's group directory (root's, the slot user's group): only its own
/// slot gets in.
pub const SLOT_DIR_MODE: u32 = 0o750;

/// The v1 controllers a slot group lives in.
pub const V1_CONTROLLERS: [&str; 4] = ["cpu", "memory", "pids", "freezer"];
/// The v2 controllers slotpool needs enabled.
pub const V2_CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];

/// Where the cgroup hierarchies are, as found by [`detect`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CgroupLayout {
    /// The unified hierarchy mounted at `mount`.
    V2 { mount: PathBuf },
    /// v1 hierarchies: `(controller, mount)` for each of [`V1_CONTROLLERS`].
    V1 { mounts: Vec<(String, PathBuf)> },
}

/// A mount from `/proc/self/mountinfo`: where, its type and its super options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: PathBuf,
    pub fs_type: String,
    pub super_options: Vec<String>,
}

/// The mounts in `/proc/self/mountinfo` text (octal escapes in paths decoded).
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mount_point = left.split(' ').nth(4)?;
            let mut right = right.split(' ');
            let fs_type = right.next()?.to_string();
            let _source = right.next()?;
            let super_options = right
                .next()
                .unwrap_or("")
                .split(',')
                .map(str::to_string)
                .collect();
            Some(MountEntry {
                mount_point: PathBuf::from(unescape_octal(mount_point)),
                fs_type,
                super_options,
            })
        })
        .collect()
}

fn unescape_octal(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Picks v2 or v1 from the mounts; `read` reads a file (the v2 `cgroup.controllers`).
pub fn choose_layout(
    mounts: &[MountEntry],
    read: impl Fn(&Path) -> Option<String>,
) -> Result<CgroupLayout, String> {
    let mut v2_note = String::from("no cgroup2 mount");
    for m in mounts.iter().filter(|m| m.fs_type == "cgroup2") {
        let controllers = read(&m.mount_point.join("cgroup.controllers")).unwrap_or_default();
        let have: Vec<&str> = controllers.split_whitespace().collect();
        let missing: Vec<&str> = V2_CONTROLLERS
            .iter()
            .copied()
            .filter(|c| !have.contains(c))
            .collect();
        if missing.is_empty() {
            return Ok(CgroupLayout::V2 {
                mount: m.mount_point.clone(),
            });
        }
        v2_note = format!(
            "cgroup2 at {} lacks controllers {}",
            m.mount_point.display(),
            missing.join(",")
        );
    }
    let mut v1 = Vec::new();
    let mut missing = Vec::new();
    for controller in V1_CONTROLLERS {
        match mounts
            .iter()
            .find(|m| m.fs_type == "cgroup" && m.super_options.iter().any(|o| o == controller))
        {
            Some(m) => v1.push((controller.to_string(), m.mount_point.clone())),
            None => missing.push(controller),
        }
    }
    if missing.is_empty() {
        return Ok(CgroupLayout::V1 { mounts: v1 });
    }
    Err(format!(
        "no usable cgroup hierarchy: {v2_note}, and no cgroup v1 hierarchy for {}",
        missing.join(",")
    ))
}

/// Detects the layout from `<proc_root>/self/mountinfo`.
pub fn detect(proc_root: &Path) -> Result<CgroupLayout, IsolationError> {
    let path = proc_root.join("self/mountinfo");
    let text = fs::read_to_string(&path).map_err(IsolationError::new("reading", &path))?;
    choose_layout(&parse_mountinfo(&text), |p| fs::read_to_string(p).ok())
        .map_err(|message| IsolationError::new("detecting cgroups from", &path)(io_other(message)))
}

/// Builds the driver for a layout; groups go under `<mount>/<parent>/`.
pub fn driver(layout: &CgroupLayout, parent: &str) -> Box<dyn CgroupDriver> {
    match layout {
        CgroupLayout::V2 { mount } => Box::new(CgroupV2 {
            mount: mount.clone(),
            parent: parent.to_string(),
        }),
        CgroupLayout::V1 { mounts } => Box::new(CgroupV1 {
            mounts: mounts.clone(),
            parent: parent.to_string(),
        }),
    }
}

/// One cgroup per slot. Calls block; `name` is a single path component.
pub trait CgroupDriver: Send + Sync + 'static {
    /// `v2` or `v1`, for logs.
    fn version(&self) -> &'static str;
    /// Creates the group (if absent), open to the group `gid` (the slot user's) only
    /// ([`CgroupDriver::reown`]), and applies `limits` ([`CgroupDriver::limit`]).
    fn create(&self, name: &str, gid: u32, limits: &Limits) -> Result<(), IsolationError>;
    /// Gives the group's directories, which [`CgroupDriver::create`] made, the group
    /// `gid` and their mode; an error when one is gone.
    fn reown(&self, name: &str, gid: u32) -> Result<(), IsolationError>;
    /// Applies `limits` to the group [`CgroupDriver::create`] made (a missing limit
    /// means `max`; `disk_bytes` is not the group's).
    fn limit(&self, name: &str, limits: &Limits) -> Result<(), IsolationError>;
    /// Moves process `pid` into the group.
    fn add(&self, name: &str, pid: i32) -> Result<(), IsolationError>;
    /// The processes in the group (empty when it does not exist).
    fn procs(&self, name: &str) -> Result<Vec<i32>, IsolationError>;
    /// Kills every process in the group and waits until it is empty.
    fn kill_all(&self, name: &str) -> Result<(), IsolationError>;
    /// Sends SIGTERM to every process in the group and waits at most `grace` for the
    /// group to empty; whether it did. What remains is for [`CgroupDriver::kill_all`].
    /// This default looks at `procs` every [`TERM_POLL`] (v1 has nothing to wait on).
    fn terminate(&self, name: &str, grace: Duration) -> Result<bool, IsolationError> {
        let pids = self.procs(name)?;
        if pids.is_empty() {
            return Ok(true);
        }
        signal_all(&pids, Signal::TERM);
        let deadline = Instant::now() + grace;
        loop {
            if self.procs(name)?.is_empty() {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(TERM_POLL.min(deadline.saturating_duration_since(Instant::now())));
        }
    }
    /// Removes the group (fine when it does not exist).
    fn remove(&self, name: &str) -> Result<(), IsolationError>;
    /// Empties the group the last tenancy left, for the next to find it as a new one
    /// would be: no process (the caller killed them) and nothing charged to it (the page
    /// cache its processes read in, reclaimed); fine when it does not exist. Making and
    /// removing a group in every hierarchy cost more than a tenth of a users-mode cycle.
    fn empty(&self, name: &str) -> Result<(), IsolationError>;
    /// Every group directory of this parent, for logs and clean-up checks.
    fn paths(&self, name: &str) -> Vec<PathBuf>;
}

fn io_other(message: impl Into<String>) -> std::io::Error {
    std::io::Error::other(message.into())
}

/// Writes `value` to a control file; the error names the value and the file.
fn write_control(path: &Path, value: &str) -> Result<(), IsolationError> {
    fs::write(path, value).map_err(|error| IsolationError {
        action: "writing",
        path: path.to_path_buf(),
        error: std::io::Error::new(error.kind(), format!("value {value:?}: {error}")),
    })
}

fn read_pids(path: &Path) -> Result<Vec<i32>, IsolationError> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(text
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(IsolationError::new("reading", path)(e)),
    }
}

fn make_dir(path: &Path) -> Result<(), IsolationError> {
    match fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(IsolationError::new("creating", path)(e)),
    }
}

/// Makes the parent directory [`PARENT_DIR_MODE`] and its own files readable by their
/// owner (root) only: they hold the totals of every slot below. Skipped when the
/// directory already has that mode, which is set last.
pub fn close_parent(parent: &Path) -> Result<(), IsolationError> {
    let meta = fs::metadata(parent).map_err(IsolationError::new("reading", parent))?;
    if meta.permissions().mode() & 0o7777 == PARENT_DIR_MODE {
        return Ok(());
    }
    let entries = fs::read_dir(parent).map_err(IsolationError::new("listing", parent))?;
    for entry in entries {
        let entry = entry.map_err(IsolationError::new("listing", parent))?;
        let path = entry.path();
        let meta = match entry.metadata() {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(IsolationError::new("reading", &path)(e)),
        };
        let mode = meta.permissions().mode() & 0o7777;
        if meta.is_file() && mode & 0o077 != 0 {
            fs::set_permissions(&path, fs::Permissions::from_mode(mode & !0o077))
                .map_err(IsolationError::new("closing", &path))?;
        }
    }
    fs::set_permissions(parent, fs::Permissions::from_mode(PARENT_DIR_MODE))
        .map_err(IsolationError::new("closing", parent))
}

/// Gives a slot's group directory the group `gid` and [`SLOT_DIR_MODE`] (one `stat`
/// when it has them already).
pub fn close_slot_dir(dir: &Path, gid: u32) -> Result<(), IsolationError> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(dir).map_err(IsolationError::new("reading", dir))?;
    if meta.gid() != gid {
        std::os::unix::fs::chown(dir, None, Some(gid))
            .map_err(IsolationError::new("closing", dir))?;
    }
    if meta.permissions().mode() & 0o7777 != SLOT_DIR_MODE {
        fs::set_permissions(dir, fs::Permissions::from_mode(SLOT_DIR_MODE))
            .map_err(IsolationError::new("closing", dir))?;
    }
    Ok(())
}

/// The `cgroup.procs` files of the groups process `pid` is in, in every hierarchy but the
/// ones the slot's groups `slot_dirs` are in: where a process started for that process
/// (a login's shell, for its helper) goes besides its slot's groups, so that it stays
/// with the helper's service or session (on a v1 host, systemd's own hierarchy; other
/// v1 controllers) rather than the agent's. Empty when it cannot be read.
pub fn procs_beside(pid: i32, slot_dirs: &[PathBuf]) -> Vec<PathBuf> {
    let (Ok(groups), Ok(mounts)) = (
        fs::read_to_string(format!("/proc/{pid}/cgroup")),
        fs::read_to_string("/proc/self/mountinfo"),
    ) else {
        return Vec::new();
    };
    groups_beside(&groups, &parse_mountinfo(&mounts), slot_dirs)
}

/// [`procs_beside`] from a `/proc/<pid>/cgroup` text and the mounts.
fn groups_beside(groups: &str, mounts: &[MountEntry], slot_dirs: &[PathBuf]) -> Vec<PathBuf> {
    groups
        .lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            let mount = mounts.iter().find(|m| {
                if controllers.is_empty() {
                    m.fs_type == "cgroup2"
                } else {
                    m.fs_type == "cgroup"
                        && controllers
                            .split(',')
                            .all(|c| m.super_options.iter().any(|o| o == c))
                }
            })?;
            if slot_dirs.iter().any(|d| d.starts_with(&mount.mount_point)) {
                return None;
            }
            let relative = path.trim_start_matches('/');
            Some(mount.mount_point.join(relative).join("cgroup.procs"))
        })
        .collect()
}

/// Removes a group directory, retrying while the kernel still counts exiting processes.
fn remove_dir(path: &Path) -> Result<(), IsolationError> {
    let deadline = Instant::now() + KILL_TIMEOUT;
    loop {
        match fs::remove_dir(path) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                std::thread::sleep(KILL_ROUND_PAUSE)
            }
            Err(e) => return Err(IsolationError::new("removing cgroup", path)(e)),
        }
    }
}

/// Sends `signal` to each of `pids` (never to 0, 1 or a negative pid).
fn signal_all(pids: &[i32], signal: Signal) {
    for pid in pids
        .iter()
        .filter(|&&pid| pid > 1)
        .filter_map(|&p| Pid::from_raw(p))
    {
        let _ = kill_process(pid, signal);
    }
}

/// An inotify watch on one file, to sleep until the kernel changes it (`cgroup.events`).
struct FileWatch(std::os::fd::OwnedFd);

impl FileWatch {
    fn new(path: &Path) -> std::io::Result<FileWatch> {
        let fd = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)?;
        inotify::add_watch(&fd, path, inotify::WatchFlags::MODIFY)?;
        Ok(FileWatch(fd))
    }

    /// Waits until `done` says so, looking again at each change of the file, for at
    /// most `limit`; whether `done` said so.
    fn wait(&self, limit: Duration, mut done: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if done() {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            let timeout = Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: i64::from(left.subsec_nanos()),
            };
            let mut pfd = [PollFd::new(&self.0, PollFlags::IN)];
            let _ = poll(&mut pfd, Some(&timeout));
            let mut buf = [0u8; 1024];
            while rustix::io::read(&self.0, &mut buf).is_ok_and(|n| n > 0) {}
        }
    }
}

/// Whether a v2 group's `cgroup.events` says it has no process (left or below).
fn unpopulated(events: &Path) -> bool {
    fs::read_to_string(events).map_or(true, |text| text.lines().any(|l| l.trim() == "populated 0"))
}

fn sigkill_all(pids: &[i32]) {
    signal_all(pids, Signal::KILL);
}

/// The cpu quota (µs per [`CPU_PERIOD_US`]) for a limit in thousandths of a CPU.
pub fn cpu_quota_us(cpu_millis: u32) -> u64 {
    (u64::from(cpu_millis) * CPU_PERIOD_US / 1000).max(1000)
}

/// cgroup v2: one directory in the unified hierarchy.
#[derive(Clone, Debug)]
pub struct CgroupV2 {
    pub mount: PathBuf,
    pub parent: String,
}

impl CgroupV2 {
    fn dir(&self, name: &str) -> PathBuf {
        self.mount.join(&self.parent).join(name)
    }

    /// Enables the controllers for the children of `dir`.
    fn delegate(dir: &Path) -> Result<(), IsolationError> {
        let control = dir.join("cgroup.subtree_control");
        let current = fs::read_to_string(&control).unwrap_or_default();
        let wanted: Vec<String> = V2_CONTROLLERS
            .iter()
            .filter(|c| !current.split_whitespace().any(|x| x == **c))
            .map(|c| format!("+{c}"))
            .collect();
        if wanted.is_empty() {
            return Ok(());
        }
        write_control(&control, &wanted.join(" "))
    }
}

/// How [`CgroupV2::kill_all_by`] gets every process of a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum V2Kill {
    /// Write `1` to `cgroup.kill` (Linux 5.14+): the kernel kills them all.
    KillFile,
    /// Freeze the group (`cgroup.freeze`), SIGKILL every pid, thaw.
    Freeze,
}

/// Runs `round` (given the pids `procs` lists) until `procs` lists none, pausing
/// [`KILL_ROUND_PAUSE`] between rounds, for at most [`KILL_TIMEOUT`]; `dir` names the group
/// in the error.
fn kill_rounds(
    dir: &Path,
    mut procs: impl FnMut() -> Result<Vec<i32>, IsolationError>,
    mut round: impl FnMut(&[i32]) -> Result<(), IsolationError>,
) -> Result<(), IsolationError> {
    let deadline = Instant::now() + KILL_TIMEOUT;
    loop {
        let pids = procs()?;
        if pids.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(IsolationError::new("killing processes of", dir)(io_other(
                format!("still running after {KILL_TIMEOUT:?}: {pids:?}"),
            )));
        }
        round(&pids)?;
        std::thread::sleep(KILL_ROUND_PAUSE);
    }
}

impl CgroupV2 {
    /// Kills every process in the group `how` says, round after round until it is empty
    /// (at most [`KILL_TIMEOUT`]). [`CgroupDriver::kill_all`] uses the kill file when the
    /// kernel has one, else the freezer; both work without any controller enabled.
    pub fn kill_all_by(&self, name: &str, how: V2Kill) -> Result<(), IsolationError> {
        let dir = self.dir(name);
        if !dir.exists() {
            return Ok(());
        }
        let kill_file = dir.join("cgroup.kill");
        let freeze = dir.join("cgroup.freeze");
        kill_rounds(
            &dir,
            || self.procs(name),
            |_| match how {
                V2Kill::KillFile => write_control(&kill_file, "1"),
                V2Kill::Freeze => {
                    write_control(&freeze, "1")?;
                    sigkill_all(&self.procs(name)?);
                    write_control(&freeze, "0")
                }
            },
        )
    }
}

impl CgroupDriver for CgroupV2 {
    fn version(&self) -> &'static str {
        "v2"
    }

    fn create(&self, name: &str, gid: u32, limits: &Limits) -> Result<(), IsolationError> {
        let parent = self.mount.join(&self.parent);
        CgroupV2::delegate(&self.mount)?;
        make_dir(&parent)?;
        CgroupV2::delegate(&parent)?;
        close_parent(&parent)?;
        make_dir(&self.dir(name))?;
        self.reown(name, gid)?;
        self.limit(name, limits)
    }

    fn reown(&self, name: &str, gid: u32) -> Result<(), IsolationError> {
        close_slot_dir(&self.dir(name), gid)
    }

    fn limit(&self, name: &str, limits: &Limits) -> Result<(), IsolationError> {
        let dir = self.dir(name);
        let cpu = match limits.cpu_millis {
            Some(m) => format!("{} {CPU_PERIOD_US}", cpu_quota_us(m)),
            None => format!("max {CPU_PERIOD_US}"),
        };
        write_control(&dir.join("cpu.max"), &cpu)?;
        let memory = limits
            .memory_bytes
            .map_or("max".to_string(), |b| b.to_string());
        write_control(&dir.join("memory.max"), &memory)?;
        let pids = limits.pids.map_or("max".to_string(), |p| p.to_string());
        write_control(&dir.join("pids.max"), &pids)
    }

    fn add(&self, name: &str, pid: i32) -> Result<(), IsolationError> {
        write_control(&self.dir(name).join("cgroup.procs"), &pid.to_string())
    }

    fn procs(&self, name: &str) -> Result<Vec<i32>, IsolationError> {
        read_pids(&self.dir(name).join("cgroup.procs"))
    }

    /// Waits on `cgroup.events` (inotify) for `populated 0`, so a release whose
    /// processes all exit on SIGTERM takes no longer than they do.
    fn terminate(&self, name: &str, grace: Duration) -> Result<bool, IsolationError> {
        let dir = self.dir(name);
        let events = dir.join("cgroup.events");
        if !dir.exists() || unpopulated(&events) {
            return Ok(true);
        }
        // Watched before the signal, so no exit goes unseen.
        let watch = FileWatch::new(&events).map_err(IsolationError::new("watching", &events))?;
        signal_all(&self.procs(name)?, Signal::TERM);
        Ok(watch.wait(grace, || unpopulated(&events)))
    }

    fn kill_all(&self, name: &str) -> Result<(), IsolationError> {
        let how = if self.dir(name).join("cgroup.kill").exists() {
            V2Kill::KillFile
        } else {
            V2Kill::Freeze
        };
        self.kill_all_by(name, how)
    }

    fn remove(&self, name: &str) -> Result<(), IsolationError> {
        remove_dir(&self.dir(name))
    }

    fn empty(&self, name: &str) -> Result<(), IsolationError> {
        let dir = self.dir(name);
        let current = fs::read_to_string(dir.join("memory.current"));
        match current.map(|c| c.trim().parse::<u64>()) {
            Ok(Ok(0)) => Ok(()),
            // What cannot be reclaimed (EAGAIN) stays charged, as it would to the parent.
            Ok(Ok(bytes)) => match fs::write(dir.join("memory.reclaim"), bytes.to_string()) {
                Err(e) if e.raw_os_error() != Some(libc::EAGAIN) => Err(IsolationError::new(
                    "writing",
                    &dir.join("memory.reclaim"),
                )(e)),
                _ => Ok(()),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(IsolationError::new("reading", &dir.join("memory.current"))(
                e,
            )),
            Ok(Err(_)) => Ok(()),
        }
    }

    fn paths(&self, name: &str) -> Vec<PathBuf> {
        vec![self.dir(name)]
    }
}

/// cgroup v1: the same group in the cpu, memory, pids and freezer hierarchies.
#[derive(Clone, Debug)]
pub struct CgroupV1 {
    pub mounts: Vec<(String, PathBuf)>,
    pub parent: String,
}

impl CgroupV1 {
    fn dir(&self, controller: &str, name: &str) -> Option<PathBuf> {
        self.mounts
            .iter()
            .find(|(c, _)| c == controller)
            .map(|(_, m)| m.join(&self.parent).join(name))
    }

    fn dirs(&self, name: &str) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = self
            .mounts
            .iter()
            .map(|(_, m)| m.join(&self.parent).join(name))
            .collect();
        dirs.dedup();
        dirs
    }

    fn freezer_state(&self, dir: &Path, state: &str) -> Result<(), IsolationError> {
        let file = dir.join("freezer.state");
        write_control(&file, state)?;
        let deadline = Instant::now() + KILL_TIMEOUT;
        while fs::read_to_string(&file).unwrap_or_default().trim() != state {
            if Instant::now() >= deadline {
                return Err(IsolationError::new("waiting for", &file)(io_other(
                    format!("not {state} after {KILL_TIMEOUT:?}"),
                )));
            }
            std::thread::sleep(KILL_ROUND_PAUSE);
        }
        Ok(())
    }
}

impl CgroupDriver for CgroupV1 {
    fn version(&self) -> &'static str {
        "v1"
    }

    fn create(&self, name: &str, gid: u32, limits: &Limits) -> Result<(), IsolationError> {
        for (_, mount) in &self.mounts {
            let parent = mount.join(&self.parent);
            make_dir(&parent)?;
            close_parent(&parent)?;
            make_dir(&parent.join(name))?;
        }
        self.reown(name, gid)?;
        self.limit(name, limits)
    }

    fn reown(&self, name: &str, gid: u32) -> Result<(), IsolationError> {
        for dir in self.dirs(name) {
            close_slot_dir(&dir, gid)?;
        }
        Ok(())
    }

    fn limit(&self, name: &str, limits: &Limits) -> Result<(), IsolationError> {
        if let Some(dir) = self.dir("cpu", name) {
            write_control(&dir.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
            let quota = limits
                .cpu_millis
                .map_or("-1".to_string(), |m| cpu_quota_us(m).to_string());
            write_control(&dir.join("cpu.cfs_quota_us"), &quota)?;
        }
        if let Some(dir) = self.dir("memory", name) {
            let memory = limits
                .memory_bytes
                .map_or("-1".to_string(), |b| b.to_string());
            write_control(&dir.join("memory.limit_in_bytes"), &memory)?;
        }
        if let Some(dir) = self.dir("pids", name) {
            let pids = limits.pids.map_or("max".to_string(), |p| p.to_string());
            write_control(&dir.join("pids.max"), &pids)?;
        }
        Ok(())
    }

    fn add(&self, name: &str, pid: i32) -> Result<(), IsolationError> {
        for dir in self.dirs(name) {
            write_control(&dir.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    fn procs(&self, name: &str) -> Result<Vec<i32>, IsolationError> {
        let mut all = Vec::new();
        for dir in self.dirs(name) {
            all.extend(read_pids(&dir.join("cgroup.procs"))?);
        }
        all.sort_unstable();
        all.dedup();
        Ok(all)
    }

    fn kill_all(&self, name: &str) -> Result<(), IsolationError> {
        let Some(freezer) = self.dir("freezer", name) else {
            return Err(IsolationError::new("killing", Path::new(name))(io_other(
                "no freezer hierarchy",
            )));
        };
        kill_rounds(
            &freezer,
            || self.procs(name),
            |pids| {
                if freezer.exists() {
                    self.freezer_state(&freezer, "FROZEN")?;
                    sigkill_all(&self.procs(name)?);
                    self.freezer_state(&freezer, "THAWED")
                } else {
                    sigkill_all(pids);
                    Ok(())
                }
            },
        )
    }

    fn remove(&self, name: &str) -> Result<(), IsolationError> {
        for dir in self.dirs(name) {
            remove_dir(&dir)?;
        }
        Ok(())
    }

    fn empty(&self, name: &str) -> Result<(), IsolationError> {
        let Some(dir) = self.dir("memory", name) else {
            return Ok(());
        };
        let usage = fs::read_to_string(dir.join("memory.usage_in_bytes"));
        match usage.map(|u| u.trim().parse::<u64>()) {
            Ok(Ok(0)) | Ok(Err(_)) => Ok(()),
            Ok(Ok(_)) => write_control(&dir.join("memory.force_empty"), "0"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(IsolationError::new(
                "reading",
                &dir.join("memory.usage_in_bytes"),
            )(e)),
        }
    }

    fn paths(&self, name: &str) -> Vec<PathBuf> {
        self.dirs(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn a_login_joins_its_helpers_groups_where_its_slot_has_none() {
        let mounts = parse_mountinfo(
            "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n\
             35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n\
             36 31 0:33 / /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices\n\
             40 31 0:37 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd\n\
             41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
        );
        let helper = "12:name=systemd:/system.slice/ssh.service\n\
                      5:devices:/system.slice/ssh.service\n\
                      4:memory:/system.slice/ssh.service\n\
                      3:cpu,cpuacct:/system.slice/ssh.service\n\
                      0::/system.slice/ssh.service\n";
        let slot = [
            PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/slotpool/u"),
            PathBuf::from("/sys/fs/cgroup/memory/slotpool/u"),
        ];
        assert_eq!(
            groups_beside(helper, &mounts, &slot),
            [
                "/sys/fs/cgroup/systemd/system.slice/ssh.service/cgroup.procs",
                "/sys/fs/cgroup/devices/system.slice/ssh.service/cgroup.procs",
                "/sys/fs/cgroup/unified/system.slice/ssh.service/cgroup.procs",
            ]
            .map(PathBuf::from)
        );
        // A v2 host: the slot's group is in the one hierarchy there is.
        let v2 = parse_mountinfo("30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
        assert_eq!(
            groups_beside(
                "0::/system.slice/ssh.service\n",
                &v2,
                &[PathBuf::from("/sys/fs/cgroup/slotpool/u")]
            ),
            Vec::<PathBuf>::new()
        );
    }

    #[test]
    fn hybrid_without_delegated_controllers_falls_back_to_v1() {
        let mounts = parse_mountinfo(HYBRID);
        assert_eq!(mounts.len(), 7);
        let layout = choose_layout(&mounts, |_| Some(String::new())).unwrap();
        let CgroupLayout::V1 { mounts } = layout else {
            panic!("expected v1: {layout:?}")
        };
        assert_eq!(
            mounts,
            V1_CONTROLLERS
                .iter()
                .map(|c| (c.to_string(), PathBuf::from(format!("/sys/fs/cgroup/{c}"))))
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn v2_with_controllers_wins() {
        let mounts = parse_mountinfo(HYBRID);
        let layout = choose_layout(&mounts, |p| {
            (p == Path::new("/sys/fs/cgroup/unified/cgroup.controllers"))
                .then(|| "cpuset cpu io memory pids\n".to_string())
        })
        .unwrap();
        assert_eq!(
            layout,
            CgroupLayout::V2 {
                mount: "/sys/fs/cgroup/unified".into()
            }
        );
    }

    #[test]
    fn nothing_usable_says_what_is_missing() {
        let text = "41 31 0:38 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let err = choose_layout(&parse_mountinfo(text), |_| Some("cpu io".into())).unwrap_err();
        assert!(err.contains("lacks controllers memory,pids"), "{err}");
        assert!(err.contains("cpu,memory,pids,freezer"), "{err}");
    }

    #[test]
    fn mount_points_are_unescaped() {
        let text = "1 2 0:3 / /mnt/with\\040space rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            parse_mountinfo(text)[0].mount_point,
            PathBuf::from("/mnt/with space")
        );
    }

    #[test]
    fn v2_writes_limits_and_errors_name_value_and_path() {
        let root = tempfile::tempdir().unwrap();
        let v2 = CgroupV2 {
            mount: root.path().to_path_buf(),
            parent: "sp".into(),
        };
        let limits = Limits {
            cpu_millis: Some(1500),
            memory_bytes: Some(1 << 20),
            pids: Some(64),
            disk_bytes: None,
        };
        fs::create_dir(root.path().join("sp")).unwrap();
        fs::write(root.path().join("sp/memory.current"), "7").unwrap();
        let gid = rustix::process::getegid().as_raw();
        v2.create("u1", gid, &limits).unwrap();
        let dir = root.path().join("sp/u1");
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&root.path().join("sp")), PARENT_DIR_MODE);
        assert_eq!(mode(&root.path().join("sp/memory.current")), 0o600);
        assert_eq!(mode(&dir), SLOT_DIR_MODE);
        {
            use std::os::unix::fs::MetadataExt;
            assert_eq!(fs::metadata(&dir).unwrap().gid(), gid);
        }
        let read = |f: &str| fs::read_to_string(dir.join(f)).unwrap();
        assert_eq!(read("cpu.max"), "150000 100000");
        assert_eq!(read("memory.max"), "1048576");
        assert_eq!(read("pids.max"), "64");
        assert_eq!(
            fs::read_to_string(root.path().join("sp/cgroup.subtree_control")).unwrap(),
            "+cpu +memory +pids"
        );
        assert!(v2.procs("absent").unwrap().is_empty());
        let err = v2.add("absent", 42).unwrap_err().to_string();
        assert!(
            err.contains("sp/absent/cgroup.procs") && err.contains("\"42\""),
            "{err}"
        );
    }

    #[test]
    fn v1_creates_the_group_in_every_hierarchy() {
        let root = tempfile::tempdir().unwrap();
        let mounts: Vec<(String, PathBuf)> = V1_CONTROLLERS
            .iter()
            .map(|c| (c.to_string(), root.path().join(c)))
            .collect();
        for (_, m) in &mounts {
            fs::create_dir(m).unwrap();
        }
        let v1 = CgroupV1 {
            mounts,
            parent: "sp".into(),
        };
        v1.create(
            "u1",
            rustix::process::getegid().as_raw(),
            &Limits {
                pids: Some(10),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            fs::read_to_string(root.path().join("cpu/sp/u1/cpu.cfs_quota_us")).unwrap(),
            "-1"
        );
        assert_eq!(
            fs::read_to_string(root.path().join("pids/sp/u1/pids.max")).unwrap(),
            "10"
        );
        assert_eq!(v1.paths("u1").len(), 4);
        for c in V1_CONTROLLERS {
            let mode = |p: &str| {
                fs::metadata(root.path().join(c).join(p))
                    .unwrap()
                    .permissions()
                    .mode()
                    & 0o7777
            };
            assert_eq!(
                (mode("sp"), mode("sp/u1")),
                (PARENT_DIR_MODE, SLOT_DIR_MODE)
            );
        }
        fs::write(root.path().join("pids/sp/u1/cgroup.procs"), "7\n3\n").unwrap();
        fs::write(root.path().join("cpu/sp/u1/cgroup.procs"), "3\n").unwrap();
        assert_eq!(v1.procs("u1").unwrap(), vec![3, 7]);
    }

    #[test]
    fn cpu_quota() {
        assert_eq!(cpu_quota_us(1000), 100_000);
        assert_eq!(cpu_quota_us(250), 25_000);
        assert_eq!(cpu_quota_us(1), 1000);
    }
}
