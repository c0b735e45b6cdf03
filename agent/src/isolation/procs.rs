//! A slot user's processes, IPC objects and SSH logins, found by scanning `/proc`.
//!
//! Processes are found by scanning `<proc>` for any of the real, effective, saved or
//! file-system uid (from each process's pidfd where the kernel says them, Linux 6.13;
//! else from `<proc>/<pid>/status`); [`kill_uid`] kills them with `kill(-1, SIGKILL)` run *as the
//! slot user*, which the kernel applies to every process of that user at once, and
//! repeats until a scan finds none. Every function takes the `/proc` root as a
//! parameter.

use super::passwd::MIN_SLOT_UID;
use super::IsolationError;
use rustix::process::{kill_process, Pid, Signal};
use slotpool_protocol::api::SlotSession;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// Longest a kill by uid keeps trying.
pub const KILL_TIMEOUT: Duration = Duration::from_secs(10);

/// The uids (real, effective, saved, fs) in `/proc/<pid>/status` text.
pub fn parse_status_uids(text: &str) -> Vec<u32> {
    status_uids(text).collect()
}

/// The uids on the `Uid:` line of status text, without allocating.
fn status_uids(text: &str) -> impl Iterator<Item = u32> + '_ {
    text.lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .into_iter()
        .flat_map(|rest| rest.split_whitespace().filter_map(|u| u.parse().ok()))
}

/// The processes of which any uid is `uid`.
pub fn processes_of(proc_root: &Path, uid: u32) -> Vec<i32> {
    processes_of_any(proc_root, &[uid])
        .into_iter()
        .map(|(_, pid)| pid)
        .collect()
}

/// The processes of which any uid is one of `uids`, as `(uid, pid)`, from one scan of
/// `proc_root` (each status file read once, into one reused buffer).
pub fn processes_of_any(proc_root: &Path, uids: &[u32]) -> Vec<(u32, i32)> {
    processes_of_any_with(proc_root, uids, &mut PidfdCache::default())
}

/// Pidfds of the processes a scan saw, kept for the next scan of the same `/proc`: a
/// process seen before is asked for its uids on the pidfd it has (one system call),
/// where opening and closing a pidfd cost the kernel a file and a dentry each time
/// (about 8 % of a users-mode cycle's machine time, two scans per release). A pid that
/// named another process meanwhile is found out: its old pidfd answers that its
/// process is gone, and the pid is opened again. At most [`PidfdCache::most`] are kept.
#[derive(Debug, Default)]
pub struct PidfdCache {
    fds: std::collections::HashMap<i32, std::os::fd::OwnedFd>,
    /// 0: none kept.
    most: usize,
}

impl PidfdCache {
    /// A cache of at most a quarter of this process's soft descriptor limit, and at
    /// most [`MAX_CACHED_PIDFDS`].
    pub fn within_own_limit() -> PidfdCache {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into the struct we own.
        let soft = match unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } {
            0 => limit.rlim_cur,
            _ => 0,
        };
        PidfdCache {
            fds: Default::default(),
            most: usize::try_from(soft / 4)
                .unwrap_or(usize::MAX)
                .min(MAX_CACHED_PIDFDS),
        }
    }
}

/// Most pidfds a [`PidfdCache`] keeps open.
pub const MAX_CACHED_PIDFDS: usize = 4096;

/// [`processes_of_any`], keeping pidfds in `cache` from one scan to the next.
fn processes_of_any_with(
    proc_root: &Path,
    uids: &[u32],
    cache: &mut PidfdCache,
) -> Vec<(u32, i32)> {
    use std::io::Read;
    let mut found = Vec::new();
    if uids.is_empty() {
        return found;
    }
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return found;
    };
    let mut text = String::with_capacity(2048);
    let live = proc_root == Path::new("/proc") && pidfd_info_works();
    let mut seen = std::collections::HashSet::with_capacity(cache.fds.len());
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        if live {
            let cached = cache.fds.get(&pid).and_then(uids_of_pidfd);
            let ids = cached.or_else(|| {
                let fd = open_pidfd(pid)?;
                let ids = uids_of_pidfd(&fd);
                if ids.is_some() && (cache.fds.len() < cache.most || cache.fds.contains_key(&pid)) {
                    cache.fds.insert(pid, fd);
                }
                ids
            });
            if let Some(ids) = ids {
                seen.insert(pid);
                if let Some(uid) = ids.into_iter().find(|u| uids.contains(u)) {
                    found.push((uid, pid));
                }
                continue;
            }
        }
        text.clear();
        let read = std::fs::File::open(entry.path().join("status"))
            .and_then(|mut f| f.read_to_string(&mut text));
        if read.is_err() {
            continue;
        }
        if let Some(uid) = status_uids(&text).find(|u| uids.contains(u)) {
            found.push((uid, pid));
        }
    }
    // The pids this scan did not see are gone: their pidfds too.
    cache.fds.retain(|pid, _| seen.contains(pid));
    found
}

/// `PIDFD_GET_INFO` (Linux 6.13): `_IOWR(0xFF, 11, struct pidfd_info)` with the
/// first version of the struct (64 bytes; the kernel takes any size from that one on).
const PIDFD_GET_INFO: libc::c_ulong = (3 << 30) | (64 << 16) | (0xFF << 8) | 11;
/// `PIDFD_INFO_CREDS`: ask for the credentials.
const PIDFD_INFO_CREDS: u64 = 1 << 1;

/// `struct pidfd_info` as Linux 6.13 made it.
const _: () = assert!(size_of::<PidfdInfo>() == 64);
#[repr(C)]
#[derive(Default)]
struct PidfdInfo {
    mask: u64,
    cgroupid: u64,
    pid: u32,
    tgid: u32,
    ppid: u32,
    ruid: u32,
    rgid: u32,
    euid: u32,
    egid: u32,
    suid: u32,
    sgid: u32,
    fsuid: u32,
    fsgid: u32,
    exit_code: i32,
}

/// The real, effective, saved and file-system uids of process `pid` from its pidfd
/// (`PIDFD_GET_INFO`): three system calls instead of the kernel rendering the whole
/// `status` file. `None` when the kernel cannot say (too old, the process gone); the
/// caller then reads `status`.
fn pidfd_uids(pid: i32) -> Option<[u32; 4]> {
    uids_of_pidfd(&open_pidfd(pid)?)
}

/// A pidfd of process `pid`.
fn open_pidfd(pid: i32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just returned open by the kernel and is owned by nobody else.
    Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The uids of the process of pidfd `fd`; `None` when it is gone (reaped) or the kernel
/// cannot say.
fn uids_of_pidfd(fd: &std::os::fd::OwnedFd) -> Option<[u32; 4]> {
    let mut info = PidfdInfo {
        mask: PIDFD_INFO_CREDS,
        ..PidfdInfo::default()
    };
    use std::os::fd::AsRawFd;
    // SAFETY: the kernel writes at most the 64 bytes the request's size names into
    // `info`, which is larger.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), PIDFD_GET_INFO as _, &mut info) };
    (r == 0 && info.mask & PIDFD_INFO_CREDS != 0)
        .then_some([info.ruid, info.euid, info.suid, info.fsuid])
}

/// Whether [`pidfd_uids`] answers for `/proc`'s processes: this kernel has
/// `PIDFD_GET_INFO`, and `/proc` is of this process's pid namespace (pids mean the same
/// processes there and to `pidfd_open`). Checked once.
fn pidfd_info_works() -> bool {
    static WORKS: OnceLock<bool> = OnceLock::new();
    *WORKS.get_or_init(|| {
        let me = std::process::id();
        let same_namespace = std::fs::read_link("/proc/self")
            .ok()
            .and_then(|l| l.to_str().and_then(|s| s.parse::<u32>().ok()))
            == Some(me);
        // SAFETY: getuid has no preconditions and cannot fail.
        let uid = unsafe { libc::getuid() };
        same_namespace && pidfd_uids(me as i32).is_some_and(|ids| ids[0] == uid)
    })
}

/// Scans of `/proc` shared by the threads that ask at the same time. A caller's uid
/// joins the next scan to start; one scan, of every status file once, answers every
/// uid that joined it. A scan that answers a caller always starts after the caller
/// asked, so it sees everything a scan of the caller's own would have seen: concurrent
/// releases of one agent (each scans twice: the kill by uid and the clean check) share
/// scans instead of reading every process's status each.
#[derive(Debug)]
pub struct SharedScans {
    proc_root: PathBuf,
    queue: Mutex<ScanQueue>,
    scanned: Condvar,
    /// Kept from one scan to the next (scans run one at a time).
    pidfds: Mutex<PidfdCache>,
}

/// A waiting caller's uid and where its answer goes.
type Waiting = (u32, Arc<OnceLock<Vec<i32>>>);

#[derive(Debug, Default)]
struct ScanQueue {
    /// A scan runs now (its callers are no longer in `waiting`).
    scanning: bool,
    /// The callers the next scan answers.
    waiting: Vec<Waiting>,
}

impl SharedScans {
    pub fn new(proc_root: PathBuf) -> SharedScans {
        SharedScans {
            proc_root,
            queue: Mutex::new(ScanQueue::default()),
            scanned: Condvar::new(),
            pidfds: Mutex::new(PidfdCache::within_own_limit()),
        }
    }

    /// The processes of which any uid is `uid`, from a scan that started after this
    /// call: the caller that finds no scan running makes the next one, for every uid
    /// waiting by then; the others wait for it.
    pub fn processes_of(&self, uid: u32) -> Vec<i32> {
        let answer = Arc::new(OnceLock::new());
        let mut queue = self.lock();
        queue.waiting.push((uid, answer.clone()));
        loop {
            if let Some(pids) = answer.get() {
                return pids.clone();
            }
            if queue.scanning {
                queue = self
                    .scanned
                    .wait(queue)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            queue.scanning = true;
            let batch = std::mem::take(&mut queue.waiting);
            drop(queue);
            // Whatever happens in the scan, the next caller may scan again.
            let finish = ScanDone(self);
            let mut uids: Vec<u32> = batch.iter().map(|(uid, _)| *uid).collect();
            uids.sort_unstable();
            uids.dedup();
            let found = processes_of_any_with(
                &self.proc_root,
                &uids,
                &mut self.pidfds.lock().unwrap_or_else(PoisonError::into_inner),
            );
            for (uid, answer) in batch {
                let pids = found
                    .iter()
                    .filter(|(u, _)| *u == uid)
                    .map(|(_, pid)| *pid)
                    .collect();
                let _ = answer.set(pids);
            }
            drop(finish);
            queue = self.lock();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ScanQueue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Ends a scan: lets the next caller scan and wakes the waiting ones.
struct ScanDone<'a>(&'a SharedScans);

impl Drop for ScanDone<'_> {
    fn drop(&mut self) {
        self.0.lock().scanning = false;
        self.0.scanned.notify_all();
    }
}

/// Kills every process of `uid` and waits until none is left.
pub fn kill_uid(proc_root: &Path, uid: u32, gid: u32) -> Result<(), IsolationError> {
    kill_uid_scanned(|uid| processes_of(proc_root, uid), uid, gid)
}

/// [`kill_uid`] with the scans of `scans`.
pub fn kill_uid_shared(scans: &SharedScans, uid: u32, gid: u32) -> Result<(), IsolationError> {
    kill_uid_scanned(|uid| scans.processes_of(uid), uid, gid)
}

/// [`kill_uid`], finding the processes of a uid with `processes_of`.
fn kill_uid_scanned(
    processes_of: impl Fn(u32) -> Vec<i32>,
    uid: u32,
    gid: u32,
) -> Result<(), IsolationError> {
    if uid < MIN_SLOT_UID {
        return Err(IsolationError::new(
            "killing processes of",
            Path::new("uid"),
        )(std::io::Error::other(format!(
            "refusing to kill uid {uid}: not a slot user"
        ))));
    }
    let deadline = Instant::now() + KILL_TIMEOUT;
    loop {
        let left = processes_of(uid);
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(IsolationError::new(
                "killing processes of",
                Path::new(&format!("uid {uid}")),
            )(std::io::Error::other(format!(
                "still running after {KILL_TIMEOUT:?}: {left:?}"
            ))));
        }
        // kill(-1) as the user reaches every process that user may signal: all of its own.
        let mut cmd = Command::new("/bin/true");
        cmd.uid(uid).gid(gid).env_clear();
        // SAFETY: only the async-signal-safe kill(2) runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::kill(-1, libc::SIGKILL);
                Ok(())
            });
        }
        match cmd.status() {
            Ok(_) => {}
            Err(err) => {
                tracing::debug!(uid, %err, "kill as the user failed; killing one by one");
            }
        }
        // Also one by one, for processes that only kept a saved or fs uid.
        for pid in processes_of(uid).into_iter().filter_map(Pid::from_raw) {
            let _ = kill_process(pid, Signal::KILL);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A System V IPC object: shared memory, semaphore set or message queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpcKind {
    Shm,
    Sem,
    Msg,
}

impl IpcKind {
    pub const ALL: [IpcKind; 3] = [IpcKind::Shm, IpcKind::Sem, IpcKind::Msg];

    fn table(self) -> &'static str {
        match self {
            IpcKind::Shm => "shm",
            IpcKind::Sem => "sem",
            IpcKind::Msg => "msg",
        }
    }
}

/// The ids of the objects of `kind` owned or created by `uid`, from the text of
/// `/proc/sysvipc/<kind>` (a header line naming the columns, then one line per object;
/// the id is the second column).
pub fn ipc_ids_of(table: &str, uid: u32) -> Vec<i32> {
    let mut lines = table.lines();
    let Some(header) = lines.next() else {
        return Vec::new();
    };
    let columns: Vec<&str> = header.split_whitespace().collect();
    let at = |name: &str| columns.iter().position(|c| *c == name);
    let (Some(uid_at), Some(cuid_at)) = (at("uid"), at("cuid")) else {
        return Vec::new();
    };
    lines
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let owned = [uid_at, cuid_at]
                .iter()
                .any(|&i| fields.get(i).and_then(|f| f.parse::<u32>().ok()) == Some(uid));
            if owned {
                fields.get(1)?.parse().ok()
            } else {
                None
            }
        })
        .collect()
}

/// The System V IPC objects `uid` still owns, as `(kind, id)`.
pub fn ipc_objects_of(proc_root: &Path, uid: u32) -> Vec<(IpcKind, i32)> {
    IpcKind::ALL
        .iter()
        .flat_map(|&kind| {
            let table = std::fs::read_to_string(proc_root.join("sysvipc").join(kind.table()))
                .unwrap_or_default();
            ipc_ids_of(&table, uid)
                .into_iter()
                .map(move |id| (kind, id))
        })
        .collect()
}

/// Removes the System V IPC objects (shared memory, semaphores, message queues) `uid`
/// owns or created: they outlive every process and would be handed to the next job,
/// whose user may get the same uid. Errors name the object.
pub fn remove_ipc_of(proc_root: &Path, uid: u32) -> Vec<String> {
    let mut errors = Vec::new();
    for (kind, id) in ipc_objects_of(proc_root, uid) {
        // SAFETY: plain syscalls on an id just read from the kernel's table; a stale id
        // fails with EINVAL/EIDRM, which is reported.
        let rc = unsafe {
            match kind {
                IpcKind::Shm => libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()),
                IpcKind::Sem => libc::semctl(id, 0, libc::IPC_RMID),
                IpcKind::Msg => libc::msgctl(id, libc::IPC_RMID, std::ptr::null_mut()),
            }
        };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINVAL) && err.raw_os_error() != Some(libc::EIDRM) {
                errors.push(format!("removing {} {id}: {err}", kind.table()));
            }
        }
    }
    errors
}

/// The SSH logins of `user` (uid `uid`) still open: each process of the uid started by
/// sshd for a connection (the login's shell or command), oldest first, with the client's
/// address from its environment (`SSH_CONNECTION`).
///
/// A login is known by its ancestry, not by names or variables the job controls: its
/// parent is the session's sshd process (running as the slot user) and that one's parent
/// sshd's privileged monitor, running as root. A job can name a process `sshd` and set
/// `SSH_CONNECTION` in its children, but it cannot give them a root sshd as grandparent:
/// its processes descend from its login's shell, or from init once orphaned.
pub fn ssh_sessions(proc_root: &Path, uid: u32, user: &str) -> Vec<SlotSession> {
    let boot_ms = boot_time_ms(proc_root);
    let stat_of = |pid: i32| -> Option<(i32, u64)> {
        parse_stat(&std::fs::read_to_string(proc_root.join(format!("{pid}/stat"))).ok()?)
    };
    // The process `pid` is sshd's (its command name says so) and runs as `owner`.
    let sshd_of = |pid: i32, owner: u32| -> bool {
        let comm = std::fs::read_to_string(proc_root.join(format!("{pid}/comm")));
        let status = std::fs::read_to_string(proc_root.join(format!("{pid}/status")));
        comm.is_ok_and(|c| c.starts_with("sshd"))
            && status.is_ok_and(|s| {
                let uids: Vec<u32> = status_uids(&s).collect();
                !uids.is_empty() && uids.iter().all(|u| *u == owner)
            })
    };
    let mut sessions: Vec<SlotSession> = processes_of(proc_root, uid)
        .into_iter()
        .filter_map(|pid| {
            let (ppid, start_ticks) = stat_of(pid)?;
            let (monitor, _) = stat_of(ppid)?;
            if !(sshd_of(ppid, uid) && sshd_of(monitor, 0)) {
                return None;
            }
            let environ = std::fs::read(proc_root.join(format!("{pid}/environ"))).ok()?;
            Some(SlotSession {
                user: user.to_string(),
                from: ssh_client(&environ)?,
                since: boot_ms? + start_ticks * 1000 / clock_ticks(),
            })
        })
        .collect();
    sessions.sort_by_key(|s| s.since);
    sessions
}

/// The parent pid and start time (clock ticks after boot) from a `/proc/<pid>/stat` line.
pub fn parse_stat(stat: &str) -> Option<(i32, u64)> {
    // The command name, in parentheses, may hold spaces and parentheses itself.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state (0), ppid (1), ..., starttime (19).
    Some((fields.get(1)?.parse().ok()?, fields.get(19)?.parse().ok()?))
}

/// `address:port` of the client from an environment's `SSH_CONNECTION`
/// (`client-address client-port server-address server-port`). The job can rewrite its
/// own environment, so only an IP address and a port number are taken from it: anything
/// else (text meant for an operator's terminal, say) is no login at all.
pub fn ssh_client(environ: &[u8]) -> Option<String> {
    let value = environ
        .split(|b| *b == 0)
        .find_map(|var| var.strip_prefix(b"SSH_CONNECTION="))?;
    let value = std::str::from_utf8(value).ok()?;
    let mut parts = value.split(' ');
    let address: std::net::IpAddr = parts.next()?.parse().ok()?;
    let port: u16 = parts.next()?.parse().ok()?;
    Some(std::net::SocketAddr::new(address, port).to_string())
}

fn boot_time_ms(proc_root: &Path) -> Option<u64> {
    let stat = std::fs::read_to_string(proc_root.join("stat")).ok()?;
    let secs: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(secs * 1000)
}

fn clock_ticks() -> u64 {
    match rustix::param::clock_ticks_per_second() {
        0 => 100,
        ticks => ticks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_status(root: &Path, pid: i32, uid: u32) {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("status"),
            format!("Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t0\t0\t0\t0\n"),
        )
        .unwrap();
    }

    /// The pidfd's uids are the ones `status` shows, for every process of this host,
    /// and a scan finds a process that has the uid only as its real one.
    #[test]
    fn pidfd_uids_agree_with_the_status_files() {
        if !pidfd_info_works() {
            eprintln!("this kernel has no PIDFD_GET_INFO: only status files are read");
            return;
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("needs root to start a process of another uid");
            return;
        }
        let uid = 2_999_123;
        let mut child = Command::new("sleep")
            .arg("30")
            .uid(uid)
            .gid(uid)
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let mut compared = 0;
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Some(p) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            // Twice, for a process of the host that changed its uids in between.
            let read = || {
                Some((
                    pidfd_uids(p)?.to_vec(),
                    parse_status_uids(&std::fs::read_to_string(entry.path().join("status")).ok()?),
                ))
            };
            let Some((ids, status)) = read().filter(|(a, b)| a == b).or_else(read) else {
                continue;
            };
            assert_eq!(ids, status, "pid {p}");
            compared += 1;
        }
        assert!(compared > 1, "{compared}");
        assert_eq!(pidfd_uids(pid), Some([uid; 4]));
        let found = processes_of(Path::new("/proc"), uid);
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(found, vec![pid]);
    }

    /// Callers at the same time share scans, and each sees what a scan started after
    /// its call sees: a process written just before asking is always found, whatever
    /// scan runs meanwhile.
    /// A scan that kept pidfds from the one before sees what a fresh scan sees: a
    /// process's uids as they are now (one that changed them meanwhile under its kept
    /// pidfd), and nothing of a process gone, whose pidfd is let go.
    #[test]
    fn a_scan_with_kept_pidfds_sees_uids_as_they_are_now() {
        if !rustix::process::geteuid().is_root() || !pidfd_info_works() {
            eprintln!("skipped: needs root and PIDFD_GET_INFO");
            return;
        }
        let uid = 2_999_000 + std::process::id() % 997;
        let mut child = Command::new("python3")
            .arg("-c")
            .arg(format!(
                "import os, sys, time; sys.stdin.read(1); os.setresuid({uid}, {uid}, {uid}); \
                 print('changed', flush=True); time.sleep(30)"
            ))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let mut cache = PidfdCache {
            fds: Default::default(),
            most: 100_000,
        };
        let proc = Path::new("/proc");
        assert!(processes_of_any_with(proc, &[uid], &mut cache).is_empty());
        assert!(
            cache.fds.contains_key(&pid),
            "the child's pidfd is not kept"
        );
        use std::io::Write;
        child.stdin.take().unwrap().write_all(b"x").unwrap();
        // The child says when its uids changed.
        let mut changed = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut changed)
            .unwrap();
        assert_eq!(changed.trim(), "changed");
        assert_eq!(
            processes_of_any_with(proc, &[uid], &mut cache),
            [(uid, pid)],
            "the kept pidfd answered with the old uids"
        );
        assert_eq!(
            processes_of_any_with(proc, &[uid], &mut cache),
            processes_of_any(proc, &[uid])
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(processes_of_any_with(proc, &[uid], &mut cache).is_empty());
        assert!(
            !cache.fds.contains_key(&pid),
            "a gone process's pidfd is kept"
        );
    }

    #[test]
    fn shared_scans_answer_each_caller_from_a_scan_after_its_call() {
        let root = tempfile::tempdir().unwrap();
        for pid in 1..200 {
            write_status(root.path(), pid, 70_000 + (pid as u32 % 4));
        }
        let scans = Arc::new(SharedScans::new(root.path().to_path_buf()));
        let threads: Vec<_> = (0..8u32)
            .map(|t| {
                let (scans, root) = (scans.clone(), root.path().to_path_buf());
                std::thread::spawn(move || {
                    for round in 0..50 {
                        let uid = 80_000 + t * 1000 + round;
                        assert!(scans.processes_of(uid).is_empty());
                        let pid = 1000 + (t * 100 + round) as i32;
                        write_status(&root, pid, uid);
                        assert_eq!(scans.processes_of(uid), vec![pid], "thread {t}");
                        std::fs::remove_dir_all(root.join(pid.to_string())).unwrap();
                        assert!(scans.processes_of(uid).is_empty(), "thread {t}");
                    }
                    let mut some = scans.processes_of(70_000 + t % 4);
                    some.sort_unstable();
                    assert_eq!(some.len(), if t % 4 == 0 { 49 } else { 50 });
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn stat_gives_parent_and_start_even_with_a_strange_command_name() {
        let stat = "4242 (sh (x) y) S 4200 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 2400000 150";
        assert_eq!(parse_stat(stat), Some((4200, 987654)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn the_ssh_client_comes_from_ssh_connection() {
        let env = b"HOME=/w\0SSH_CONNECTION=127.0.0.1 51234 127.0.0.1 2222\0USER=s\0";
        assert_eq!(ssh_client(env), Some("127.0.0.1:51234".into()));
        assert_eq!(ssh_client(b"HOME=/w\0"), None);
        // Written by the job: only an address and a port pass.
        for forged in [
            &b"SSH_CONNECTION=\x1b[2J\x1b[31mroot@console 22 10.0.0.1 22\0"[..],
            b"SSH_CONNECTION=10.0.0.7 99999 10.0.0.1 22\0",
            b"SSH_CONNECTION=localhost 22 10.0.0.1 22\0",
        ] {
            assert_eq!(
                ssh_client(forged),
                None,
                "{}",
                String::from_utf8_lossy(forged)
            );
        }
        assert_eq!(
            ssh_client(b"SSH_CONNECTION=fe80::1 2222 fe80::2 22\0"),
            Some("[fe80::1]:2222".into())
        );
    }

    #[test]
    fn ipc_tables_are_read_by_their_header() {
        let shm = "       key      shmid perms                  size  cpid  lpid nattch   uid   gid  cuid  cgid      atime      dtime      ctime                   rss                  swap\n\
                            0         12   600                  1024   100   100      0  1042  1042  1042  1042          0          0 1763770000                     0                     0\n\
                            0         13   600                  1024   100   100      0     0     0  1042     0          0          0 1763770000                     0                     0\n\
                            0         14   600                  1024   100   100      0     0     0     0     0          0          0 1763770000                     0                     0\n";
        assert_eq!(
            ipc_ids_of(shm, 1042),
            vec![12, 13],
            "owned or created by the uid"
        );
        let sem = "       key      semid perms      nsems   uid   gid  cuid  cgid      otime      ctime\n\
                            1          7   600          1  1042  1042  1042  1042          0 1763770000\n";
        assert_eq!(ipc_ids_of(sem, 1042), vec![7]);
        assert!(ipc_ids_of(sem, 1043).is_empty());
        assert!(ipc_ids_of("", 1042).is_empty());
        assert!(ipc_ids_of("garbage without columns\n1 2 3\n", 1042).is_empty());
    }

    #[test]
    fn status_uids() {
        let text = "Name:\tsleep\nUid:\t1001\t1001\t1001\t1001\nGid:\t5\t5\t5\t5\n";
        assert_eq!(parse_status_uids(text), vec![1001; 4]);
        assert!(parse_status_uids("Name: x\n").is_empty());
    }

    #[test]
    fn root_is_never_killed_by_uid() {
        let err = kill_uid(Path::new("/proc"), 0, 0).unwrap_err().to_string();
        assert!(err.contains("refusing"), "{err}");
    }
}
