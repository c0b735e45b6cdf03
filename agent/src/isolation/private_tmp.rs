//! A private `/tmp`, `/var/tmp` and `/dev/shm` per slot, and IPC of its own
//! (`--slot-private-tmp on`, users mode; the default).
//!
//! Without it a slot's files in the host's shared directories are found and removed at
//! release one by one ([`crate::isolation::shared_dirs`]), within the release's budget: a
//! job that leaves more entries than the budget makes its slot dirty for good. With it
//! those directories are, for the slot's logins, tmpfs mounts of the slot's own, which
//! leave with the slot as one piece, however many files they hold:
//!
//! - **A clean copy of the host's mounts.** Once, when the agent starts, a thread of it
//!   makes a mount namespace from the one slot logins live in (`--mount-namespace`, else
//!   the agent's), its mounts slaves of those, and detaches there every namespace file
//!   bound on the host (the slots' own, other agents', [`crate::isolation::netns`]'s) and
//!   the agents' namespace directories: every slot's namespaces are copies of this one,
//!   and a copy of a mount table costs in proportion to its mounts (twice at each
//!   warm-up, once more at each release), whereas these would only keep other slots'
//!   namespaces alive. The agent holds it open ([`SlotMounts::base_mounts`]).
//! - **Namespaces.** At warm-up the agent starts a holder process ([`Holder`]). Still
//!   root, it enters that clean copy (or, for a workspace that is an image of its own,
//!   mounted after the clean copy was made, the logins' namespace itself), unshares a
//!   mount namespace of its own, turns its mounts into slaves (nothing it mounts reaches
//!   the host; what the host mounts later, a workspace image say, still reaches it) and mounts
//!   a tmpfs on each of [`PRIVATE_DIRS`] (mode 1777, `nosuid,nodev`, at most
//!   [`MAX_INODES`] entries). Both namespaces are owned by the host's user namespace, in
//!   which no process of a slot has a capability: nobody in the slot can unmount the
//!   tmpfs to reach the host's directory beneath (and a user namespace a job makes gets
//!   a copy whose mounts the kernel locks). The agent bind-mounts
//!   `/proc/<holder>/ns/{mnt,ipc}` on `<run-dir>/mntns/<namespace>/<slot>.{mnt,ipc}`
//!   (directory 0700, root) and kills the holder.
//! - **A workspace under one of them** (an agent whose work directory is in `/tmp`, as in
//!   tests) is bind-mounted back on its own path in the tmpfs, so the slot still finds
//!   its home.
//! - **IPC.** The holder also makes an IPC namespace, mounted on `<slot>.ipc`: System V
//!   objects and POSIX message queues of the slot's logins are the slot's alone,
//!   invisible to other slots, and gone with the namespace at release (the host's
//!   `/dev/mqueue` need not even be mounted).
//! - **Logins** are started inside (with [`crate::isolation::netns`]) the network
//!   namespace, then the mount and IPC namespaces, by the agent as root before they
//!   become the slot user ([`crate::isolation::start`]).
//! - **Size.** A tmpfs's pages are charged to the memory cgroup of the process that
//!   writes them: a slot's `/tmp` counts in its memory limit, not its disk limit. Its
//!   entries are bounded by [`MAX_INODES`] per directory.
//! - **Release** kills the slot's processes and unmounts the namespace files: the last
//!   reference to the mount namespace goes, and the tmpfs mounts with it. The files stay,
//!   empty, as the mount points of the next warm-up (removing a slot removes them).

use std::fs;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The directories each slot has its own tmpfs on.
pub const PRIVATE_DIRS: [&str; 3] = ["/tmp", "/var/tmp", "/dev/shm"];
/// The descriptor the holder keeps a covered workspace open on while it mounts.
const KEEP_FD: libc::c_int = 999;
/// The descriptor the holder keeps the slots' resolv.conf open on while it mounts (the
/// file may be under a directory the tmpfs covers).
const RESOLV_FD: libc::c_int = 998;
/// Most entries (inodes) in one of a slot's private directories.
pub const MAX_INODES: u64 = 262_144;

/// A step of setting up or removing a slot's private directories that failed.
#[derive(Debug, thiserror::Error)]
#[error("{action}: {reason}")]
pub struct PrivateTmpError {
    pub action: String,
    pub reason: String,
}

fn fail(action: impl Into<String>) -> impl FnOnce(String) -> PrivateTmpError {
    let action = action.into();
    move |reason| PrivateTmpError { action, reason }
}

/// The per-slot mount namespaces of one agent.
#[derive(Clone, Debug)]
pub struct SlotMounts {
    dir: PathBuf,
    /// The clean copy of the logins' mount namespace every slot's is made from (see the
    /// module's doc).
    base: std::sync::Arc<OwnedFd>,
    /// The mount namespace slot logins live in (`--mount-namespace`); `None`: the agent's.
    logins: Option<std::sync::Arc<OwnedFd>>,
    /// A file bound on `/etc/resolv.conf` for the slot's logins
    /// ([`crate::isolation::slot_dns`]).
    resolv_conf: Option<PathBuf>,
}

/// What a slot's mount namespace is copied from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyOf {
    /// The clean copy made at start: for a workspace that is a directory.
    Clean,
    /// The logins' namespace as it is now, with every mount the host has: for a
    /// workspace that is an image of its own, mounted after the clean copy was made (the
    /// host's mounts need not propagate to copies).
    Logins,
}

impl SlotMounts {
    /// Uses (and creates, 0700) `dir` for the namespace mounts, and makes it a mount of
    /// private propagation (bound on itself unless it is a mount already).
    ///
    /// A mount namespace's file cannot be bind-mounted where the mount would propagate
    /// into a namespace as new as the one it names (the kernel refuses a reference
    /// loop, `EINVAL`): on a host whose mounts are shared (systemd's default) the slot's
    /// own namespace, a copy of the host's, would receive the bind of its own file. The
    /// private mount keeps the binds here.
    pub fn new(dir: PathBuf, logins_ns: Option<PathBuf>) -> Result<SlotMounts, PrivateTmpError> {
        crate::isolation::create_private_dir_all(&dir)
            .map_err(|e| fail(format!("creating {}", dir.display()))(e.to_string()))?;
        if !is_mount_root(&dir)? {
            rustix::mount::mount_bind(&dir, &dir).map_err(|e| {
                fail(format!("bind-mounting {} on itself", dir.display()))(e.to_string())
            })?;
        }
        rustix::mount::mount_change(&dir, rustix::mount::MountPropagationFlags::PRIVATE)
            .map_err(|e| fail(format!("making {} private", dir.display()))(e.to_string()))?;
        let base = base_mounts(&dir, logins_ns.as_deref())?;
        let logins = logins_ns
            .map(|path| {
                rustix::fs::open(
                    &path,
                    rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                    rustix::fs::Mode::empty(),
                )
                .map_err(|e| fail(format!("opening {}", path.display()))(e.to_string()))
            })
            .transpose()?;
        Ok(SlotMounts {
            dir,
            base: std::sync::Arc::new(base),
            logins: logins.map(std::sync::Arc::new),
            resolv_conf: None,
        })
    }

    /// Binds `file` on `/etc/resolv.conf` in every slot's mount namespace (a path the
    /// mount namespace of slot logins sees).
    pub fn with_resolv_conf(mut self, file: PathBuf) -> SlotMounts {
        self.resolv_conf = Some(file);
        self
    }

    /// The mount namespace every slot's is copied from, to look into (tests).
    pub fn base_mounts(&self) -> &OwnedFd {
        &self.base
    }

    /// Unmounts the directory [`SlotMounts::new`] made a mount of and removes it (when
    /// the agent removes its slots on stop); the slots' files must be gone.
    pub fn close(&self) -> Vec<String> {
        let mut problems = Vec::new();
        match rustix::mount::unmount(&self.dir, rustix::mount::UnmountFlags::DETACH) {
            Ok(()) | Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => {}
            Err(e) => problems.push(format!("unmounting {}: {e}", self.dir.display())),
        }
        match fs::remove_dir(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => problems.push(format!("removing {}: {e}", self.dir.display())),
        }
        problems
    }

    /// The file the slot's mount namespace is mounted on.
    pub fn mnt_file(&self, slot: u32) -> PathBuf {
        self.dir.join(format!("{slot}.mnt"))
    }

    /// The file the slot's IPC namespace is mounted on.
    pub fn ipc_file(&self, slot: u32) -> PathBuf {
        self.dir.join(format!("{slot}.ipc"))
    }

    /// The file earlier agents mounted a slot's user namespace on: unmounted and removed
    /// with the slot's other files.
    pub fn user_file(&self, slot: u32) -> PathBuf {
        self.dir.join(format!("{slot}.user"))
    }

    /// Makes the slot's mount and IPC namespaces, the mount namespace a copy of `copy_of`
    /// with `workspace` seen through; on failure removes what was made.
    pub fn create(
        &self,
        slot: u32,
        workspace: &Path,
        copy_of: CopyOf,
    ) -> Result<(), PrivateTmpError> {
        let result = self.try_create(slot, workspace, copy_of);
        if result.is_err() {
            let _ = self.remove(slot);
        }
        result
    }

    fn try_create(
        &self,
        slot: u32,
        workspace: &Path,
        copy_of: CopyOf,
    ) -> Result<(), PrivateTmpError> {
        for file in [self.mnt_file(slot), self.ipc_file(slot)] {
            fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(&file)
                .map_err(|e| fail(format!("creating {}", file.display()))(e.to_string()))?;
        }
        // Everything the child needs, made before the holder starts (no allocation in it).
        let targets: Vec<std::ffi::CString> = PRIVATE_DIRS
            .iter()
            .map(|d| std::ffi::CString::new(*d).expect("no nul"))
            .collect();
        let options =
            std::ffi::CString::new(format!("mode=1777,nr_inodes={MAX_INODES}")).expect("no nul");
        // None: the agent's own, which the holder starts in.
        let source_raw = match copy_of {
            CopyOf::Clean => Some(self.base.as_raw_fd()),
            CopyOf::Logins => self.logins.as_ref().map(|fd| fd.as_raw_fd()),
        };
        // A workspace under a private directory: the directories to make in the tmpfs
        // down to it, and where to bind it from.
        let covered = PRIVATE_DIRS
            .iter()
            .find(|d| workspace.starts_with(d) && workspace != Path::new(d));
        let (keep_dirs, keep_from, keep_at) = match covered {
            None => (Vec::new(), None, None),
            Some(dir) => {
                let mut dirs = Vec::new();
                let mut at = PathBuf::from(dir);
                let rest = workspace.strip_prefix(dir).expect("under it");
                for part in rest.components() {
                    at.push(part);
                    dirs.push(c_path(&at)?);
                }
                let from =
                    std::ffi::CString::new(format!("/proc/self/fd/{KEEP_FD}")).expect("no nul");
                (dirs, Some(from), Some(c_path(workspace)?))
            }
        };
        let resolv = self.resolv_conf.as_deref().map(c_path).transpose()?;
        let resolv_from =
            std::ffi::CString::new(format!("/proc/self/fd/{RESOLV_FD}")).expect("no nul");
        // The kernel refuses to bind a mount namespace's file from a namespace whose id is
        // not below it (a guard against reference loops). Ids are handed out in batches
        // per CPU, so a namespace made after the agent's may still have a lower id when
        // made on another CPU: the holder tries each CPU the agent may use, keeping the
        // first namespace newer than the agent's. (Kernels before 6.8 cannot say the ids;
        // theirs grow with time, and the first holder is kept.)
        let agent_ns = mntns_id(Path::new("/proc/thread-self/ns/mnt"));
        let mut choices: Vec<Option<libc::cpu_set_t>> = vec![None];
        if agent_ns.is_some() {
            choices.extend(allowed_cpus().into_iter().map(Some));
        }
        let mut tried = Vec::new();
        let mut child = None;
        for cpu_set in choices {
            let targets = targets.clone();
            let options = options.clone();
            let keep_dirs = keep_dirs.clone();
            let keep_from = keep_from.clone();
            let keep_at = keep_at.clone();
            let resolv = resolv.clone();
            let resolv_from = resolv_from.clone();
            let mut steps = move || -> std::io::Result<()> {
                // SAFETY: only async-signal-safe system calls, on memory made before the
                // holder (see `Holder::spawn`).
                unsafe {
                    let check = |r: libc::c_int| {
                        if r != 0 {
                            Err(std::io::Error::last_os_error())
                        } else {
                            Ok(())
                        }
                    };
                    if let Some(set) = &cpu_set {
                        check(libc::sched_setaffinity(
                            0,
                            size_of::<libc::cpu_set_t>(),
                            set,
                        ))?;
                    }
                    if let Some(fd) = source_raw {
                        check(libc::setns(fd, libc::CLONE_NEWNS))?;
                    }
                    check(libc::unshare(libc::CLONE_NEWNS))?;
                    check(libc::mount(
                        c"none".as_ptr(),
                        c"/".as_ptr(),
                        std::ptr::null(),
                        libc::MS_REC | libc::MS_SLAVE,
                        std::ptr::null(),
                    ))?;
                    if let Some(file) = &resolv {
                        let fd = libc::open(file.as_ptr(), libc::O_PATH | libc::O_CLOEXEC);
                        if fd < 0 || libc::dup2(fd, RESOLV_FD) < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    // The workspace as this namespace sees it, before the tmpfs covers it.
                    if let Some(at) = &keep_at {
                        let fd = libc::open(at.as_ptr(), libc::O_PATH | libc::O_CLOEXEC);
                        if fd < 0 || libc::dup2(fd, KEEP_FD) < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    for target in &targets {
                        check(libc::mount(
                            c"tmpfs".as_ptr(),
                            target.as_ptr(),
                            c"tmpfs".as_ptr(),
                            libc::MS_NOSUID | libc::MS_NODEV,
                            options.as_ptr().cast(),
                        ))?;
                    }
                    if let (Some(from), Some(at)) = (&keep_from, &keep_at) {
                        for dir in &keep_dirs {
                            check(libc::mkdir(dir.as_ptr(), 0o755))?;
                        }
                        check(libc::mount(
                            from.as_ptr(),
                            at.as_ptr(),
                            std::ptr::null(),
                            libc::MS_BIND | libc::MS_REC,
                            std::ptr::null(),
                        ))?;
                    }
                    if resolv.is_some() {
                        check(libc::mount(
                            resolv_from.as_ptr(),
                            c"/etc/resolv.conf".as_ptr(),
                            std::ptr::null(),
                            libc::MS_BIND,
                            std::ptr::null(),
                        ))?;
                    }
                    check(libc::unshare(libc::CLONE_NEWIPC))?;
                    Ok(())
                }
            };
            // SAFETY: the steps are async-signal-safe system calls on memory made before
            // the holder.
            let child_now = unsafe { Holder::spawn(&mut steps) }.map_err(|e| {
                fail(format!("making the private /tmp of slot {slot}"))(e.to_string())
            })?;
            let made_ns = mntns_id(Path::new(&format!("/proc/{}/ns/mnt", child_now.id())));
            match (agent_ns, made_ns) {
                (Some(agent), Some(made)) if made <= agent => {
                    tried.push(made);
                }
                _ => {
                    child = Some(child_now);
                    break;
                }
            }
        }
        let Some(child) = child else {
            return Err(fail(format!("making the private /tmp of slot {slot}"))(
                format!(
                    "every CPU made a mount namespace older than the agent's ({:?}, ids {tried:?})",
                    agent_ns
                ),
            ));
        };
        let made = self.set_up(slot, child.id());
        drop(child);
        made
    }

    fn set_up(&self, slot: u32, pid: u32) -> Result<(), PrivateTmpError> {
        let proc = PathBuf::from(format!("/proc/{pid}"));
        for (kind, file) in [("mnt", self.mnt_file(slot)), ("ipc", self.ipc_file(slot))] {
            let source = proc.join("ns").join(kind);
            rustix::mount::mount_bind(&source, &file).map_err(|e| {
                fail(format!(
                    "bind-mounting {} on {}",
                    source.display(),
                    file.display()
                ))(format!("{e} ({})", self.diagnose(&source)))
            })?;
        }
        Ok(())
    }

    /// What a failed bind of `source` may depend on: whose mount namespace this thread
    /// is in, the one bound, and how the directory is mounted.
    fn diagnose(&self, source: &Path) -> String {
        let link = |p: &Path| {
            format!(
                "{} id {:?}",
                fs::read_link(p).map_or_else(|e| e.to_string(), |l| l.display().to_string()),
                mntns_id(p)
            )
        };
        let mount = fs::read_to_string("/proc/thread-self/mountinfo")
            .ok()
            .and_then(|text| {
                text.lines()
                    .find(|l| l.split(' ').nth(4) == Some(&*self.dir.to_string_lossy()))
                    .map(str::to_string)
            })
            .unwrap_or_else(|| "not a mount".into());
        format!(
            "agent in {}, binding {}, directory: {mount}",
            link(Path::new("/proc/thread-self/ns/mnt")),
            link(source)
        )
    }

    /// Unmounts and removes the slot's namespace files; returns what failed.
    pub fn remove(&self, slot: u32) -> Vec<String> {
        let mut problems = self.unmount(slot);
        for file in self.files(slot) {
            match fs::remove_file(&file) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => problems.push(format!("removing {}: {e}", file.display())),
            }
        }
        problems
    }

    /// Unmounts the slot's namespace files and keeps them, empty, for its next warm-up
    /// (a release: a file made and removed at every tenancy costs an inode each time);
    /// returns what failed.
    pub fn unmount(&self, slot: u32) -> Vec<String> {
        let mut problems = Vec::new();
        for file in self.files(slot) {
            match rustix::mount::unmount(&file, rustix::mount::UnmountFlags::DETACH) {
                // EINVAL: not a mount point; ENOENT: no file.
                Ok(()) | Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => {}
                Err(e) => problems.push(format!("unmounting {}: {e}", file.display())),
            }
        }
        problems
    }

    /// What is left of the slot's namespaces after [`SlotMounts::unmount`] (a file still
    /// naming a namespace) or, unless `files_kept`, after [`SlotMounts::remove`] (any
    /// file).
    pub fn leftovers(&self, slot: u32, files_kept: bool) -> Vec<String> {
        self.files(slot)
            .into_iter()
            .filter(|f| {
                if files_kept {
                    super::nsfs::is_bound(f)
                } else {
                    fs::symlink_metadata(f).is_ok()
                }
            })
            .map(|f| format!("namespace mount {}", f.display()))
            .collect()
    }

    /// Every file a slot's namespaces may be mounted on.
    fn files(&self, slot: u32) -> [PathBuf; 3] {
        [
            self.mnt_file(slot),
            self.ipc_file(slot),
            self.user_file(slot),
        ]
    }

    /// The slot's mount and IPC namespaces, for a login to join.
    pub fn open(&self, slot: u32) -> Result<SlotNamespaces, PrivateTmpError> {
        Ok(SlotNamespaces {
            mnt: open_nsfs(&self.mnt_file(slot))?,
            ipc: open_nsfs(&self.ipc_file(slot))?,
        })
    }
}

/// How long a holder lives at most, should the agent not kill it (as `sleep 600` did).
pub(crate) const HOLDER_LIFETIME_SECS: libc::c_uint = 600;

/// A child of the agent that set up a slot's namespaces and waits, doing nothing, for
/// the agent to bind them; killed (and reaped) when dropped. It runs no other program:
/// an `exec` (of `sleep`, before) cost as much as the rest of the warm-up's namespace
/// work. It dies with the thread that made it, and after [`HOLDER_LIFETIME_SECS`] in
/// any case.
///
/// It shares the agent's memory (`clone` with `CLONE_VM`, on a stack of its own) rather
/// than being a fork: a fork copied the agent's page tables and write-protected its
/// memory, so every page the agent's threads wrote next took a fault, twice per warm-up
/// (1.6 ms of the agents' CPU per allocation and release, docs/benchmarks.md). A holder
/// stays root: it never runs as a slot's user, whose processes could otherwise reach
/// the memory it shares with the agent.
pub(crate) struct Holder {
    pid: libc::pid_t,
    /// Unmapped after the holder is reaped (fields drop after [`Drop::drop`]).
    _stack: HolderStack,
}

/// Size of a holder's stack: its steps are a few system calls.
const HOLDER_STACK_BYTES: usize = 128 * 1024;

/// A holder's stack, with a guard page below it.
struct HolderStack {
    base: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is owned by this value alone; nothing else refers to it once the
// holder on it is reaped.
unsafe impl Send for HolderStack {}

impl HolderStack {
    fn new() -> std::io::Result<HolderStack> {
        // SAFETY: a new private anonymous mapping, owned by the value returned.
        unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                HOLDER_STACK_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK | libc::MAP_NORESERVE,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return Err(std::io::Error::last_os_error());
            }
            let stack = HolderStack {
                base,
                len: HOLDER_STACK_BYTES,
            };
            let page = usize::try_from(libc::sysconf(libc::_SC_PAGESIZE)).unwrap_or(4096);
            if libc::mprotect(base, page, libc::PROT_NONE) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(stack)
        }
    }

    /// The top of the stack (it grows down), 16-byte aligned: the mapping is whole pages.
    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of the mapping.
        unsafe { self.base.cast::<u8>().add(self.len).cast() }
    }
}

impl Drop for HolderStack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer used.
        unsafe {
            libc::munmap(self.base, self.len);
        }
    }
}

/// What a holder starts with.
struct HolderStart<'a> {
    steps: &'a mut dyn FnMut() -> std::io::Result<()>,
    /// Where it writes its steps' outcome.
    done: libc::c_int,
}

/// A holder's life: its steps, their outcome written to the agent, then waiting to be
/// killed.
extern "C" fn holder_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `HolderStart` of `Holder::spawn`, whose thread waits in `read`
    // until this writes `done`; after that write nothing here refers to it. Only system
    // calls follow (see `Holder::spawn`).
    unsafe {
        let start = &mut *arg.cast::<HolderStart<'_>>();
        let done = start.done;
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGALRM] {
            libc::sigaction(signal, &default, std::ptr::null_mut());
        }
        libc::alarm(HOLDER_LIFETIME_SECS);
        let code: libc::c_int = match (start.steps)() {
            Ok(()) => 0,
            Err(e) => e.raw_os_error().unwrap_or(libc::EIO),
        };
        libc::write(
            done,
            (&code as *const libc::c_int).cast(),
            size_of::<libc::c_int>(),
        );
        if code != 0 {
            libc::_exit(1);
        }
        loop {
            libc::pause();
        }
    }
}

impl Holder {
    /// Starts a holder that runs `steps`, then waits to be killed; returns once the steps
    /// are done, or with their error.
    ///
    /// # Safety
    /// `steps` runs in a child that shares the agent's memory, its thread-local storage
    /// (errno) that of the calling thread, which waits meanwhile. It may only make
    /// async-signal-safe system calls, on memory made before the call, and must not
    /// change its ids (see [`Holder`]; and glibc's `setuid` family would signal every
    /// thread glibc knows of, the agent's).
    pub(crate) unsafe fn spawn(
        steps: &mut dyn FnMut() -> std::io::Result<()>,
    ) -> std::io::Result<Holder> {
        // SAFETY: a child on a stack of its own that runs the caller's steps
        // (async-signal-safe, as the caller promises) and then only system calls, on
        // descriptors this function owns; this thread waits for it in `read`.
        unsafe {
            use std::os::fd::FromRawFd;
            let stack = HolderStack::new()?;
            let mut fds = [0; 2];
            if libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let (ready, done) = (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]));
            let mut start = HolderStart {
                steps,
                done: done.as_raw_fd(),
            };
            let pid = libc::clone(
                holder_main,
                stack.top(),
                libc::CLONE_VM | libc::SIGCHLD,
                (&mut start as *mut HolderStart<'_>).cast(),
            );
            if pid < 0 {
                return Err(std::io::Error::last_os_error());
            }
            drop(done);
            let holder = Holder { pid, _stack: stack };
            let mut code: libc::c_int = 0;
            let read = loop {
                let n = libc::read(
                    ready.as_raw_fd(),
                    (&mut code as *mut libc::c_int).cast(),
                    size_of::<libc::c_int>(),
                );
                if n < 0
                    && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
                {
                    continue;
                }
                break n;
            };
            if read != size_of::<libc::c_int>() as isize {
                return Err(std::io::Error::other(
                    "the holder ended before it was ready",
                ));
            }
            if code != 0 {
                return Err(std::io::Error::from_raw_os_error(code));
            }
            Ok(holder)
        }
    }

    pub(crate) fn id(&self) -> u32 {
        self.pid as u32
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        // SAFETY: `pid` is this holder's child, not reaped before.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            let mut status = 0;
            while libc::waitpid(self.pid, &mut status, 0) < 0
                && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
            {
            }
        }
    }
}

/// A slot's namespaces of this module, open, for a login to join.
pub struct SlotNamespaces {
    pub mnt: OwnedFd,
    pub ipc: OwnedFd,
}

/// Makes the clean copy of the mount namespace at `logins_ns` (`None`: the agent's) that
/// every slot's is made from: its mounts slaves of the original's, without the
/// namespace files bound there nor the namespace directories of the agents beside
/// `dir` (see the module's doc). Made by a thread of its own, which no other thread
/// shares file-system state with, so the agent's own namespace is never changed.
fn base_mounts(dir: &Path, logins_ns: Option<&Path>) -> Result<OwnedFd, PrivateTmpError> {
    let agents_dir = dir.parent().unwrap_or(dir).to_path_buf();
    let logins = logins_ns
        .map(|path| {
            rustix::fs::open(
                path,
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .map_err(|e| fail(format!("opening {}", path.display()))(e.to_string()))
        })
        .transpose()?;
    let made = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let step = |what: &str, r: libc::c_int| {
                    if r == 0 {
                        Ok(())
                    } else {
                        Err(format!("{what}: {}", std::io::Error::last_os_error()))
                    }
                };
                // SAFETY: plain system calls on this thread's own state, on descriptors
                // and strings that outlive them.
                unsafe {
                    step(
                        "unsharing the file-system state",
                        libc::unshare(libc::CLONE_FS),
                    )?;
                    if let Some(fd) = &logins {
                        step(
                            "entering the logins' mount namespace",
                            libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNS),
                        )?;
                    }
                    step(
                        "unsharing a mount namespace",
                        libc::unshare(libc::CLONE_NEWNS),
                    )?;
                    step(
                        "making its mounts slaves",
                        libc::mount(
                            c"none".as_ptr(),
                            c"/".as_ptr(),
                            std::ptr::null(),
                            libc::MS_REC | libc::MS_SLAVE,
                            std::ptr::null(),
                        ),
                    )?;
                }
                let table = fs::read_to_string("/proc/thread-self/mountinfo")
                    .map_err(|e| format!("reading its mounts: {e}"))?;
                for point in to_detach(
                    &crate::isolation::cgroup::parse_mountinfo(&table),
                    &agents_dir,
                ) {
                    // Gone with a mount above it, or busy: what stays is only copied.
                    let _ = rustix::mount::unmount(&point, rustix::mount::UnmountFlags::DETACH);
                }
                rustix::fs::open(
                    "/proc/thread-self/ns/mnt",
                    rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                    rustix::fs::Mode::empty(),
                )
                .map_err(|e| format!("opening its namespace: {e}"))
            })
            .join()
            .unwrap_or_else(|_| Err("the thread making it panicked".into()))
    });
    made.map_err(fail("making the mount namespace slots are copied from"))
}

/// The mount points a slot's namespace need not have, outermost first: namespace files
/// (`nsfs`) and what is mounted at or under `agents_dir`; none under another.
fn to_detach(mounts: &[crate::isolation::cgroup::MountEntry], agents_dir: &Path) -> Vec<PathBuf> {
    let mut points: Vec<&Path> = mounts
        .iter()
        .filter(|m| m.fs_type == "nsfs" || m.mount_point.starts_with(agents_dir))
        .map(|m| m.mount_point.as_path())
        .collect();
    points.sort_by_key(|p| p.components().count());
    let mut outer: Vec<PathBuf> = Vec::new();
    for point in points {
        if !outer.iter().any(|o| point.starts_with(o)) {
            outer.push(point.to_path_buf());
        }
    }
    outer
}

/// The id the kernel orders mount namespaces by (`NS_GET_MNTNS_ID`, Linux 6.8), of the
/// namespace file `path`; `None` where the kernel does not say.
fn mntns_id(path: &Path) -> Option<u64> {
    const NS_GET_MNTNS_ID: libc::c_ulong = (2 << 30) | (8 << 16) | (0xb7 << 8) | 0x5;
    let file = fs::File::open(path).ok()?;
    let mut id: u64 = 0;
    // SAFETY: the ioctl writes one u64 into `id`.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), NS_GET_MNTNS_ID as _, &mut id) };
    (r == 0).then_some(id)
}

/// One CPU set per CPU this process may run on.
fn allowed_cpus() -> Vec<libc::cpu_set_t> {
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity fills it.
    let mut all: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = size_of::<libc::cpu_set_t>();
    // SAFETY: `all` is a valid cpu_set_t of `size` bytes.
    if unsafe { libc::sched_getaffinity(0, size, &mut all) } != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `cpu` is below CPU_SETSIZE.
        .filter(|cpu| unsafe { libc::CPU_ISSET(*cpu, &all) })
        .map(|cpu| {
            // SAFETY: a zeroed cpu_set_t is an empty set.
            let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: `cpu` is below CPU_SETSIZE.
            unsafe { libc::CPU_SET(cpu, &mut one) };
            one
        })
        .collect()
}

/// Whether `dir` is the root of a mount (`STATX_ATTR_MOUNT_ROOT`, Linux 5.8).
fn is_mount_root(dir: &Path) -> Result<bool, PrivateTmpError> {
    use rustix::fs::{AtFlags, StatxAttributes, StatxFlags};
    let stat = rustix::fs::statx(
        rustix::fs::CWD,
        dir,
        AtFlags::NO_AUTOMOUNT | AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::empty(),
    )
    .map_err(|e| fail(format!("examining {}", dir.display()))(e.to_string()))?;
    if !stat
        .stx_attributes_mask
        .contains(StatxAttributes::MOUNT_ROOT)
    {
        return Err(fail(format!("examining {}", dir.display()))(
            "the kernel does not say whether it is a mount (Linux 5.8 or later needed)".into(),
        ));
    }
    Ok(stat.stx_attributes.contains(StatxAttributes::MOUNT_ROOT))
}

fn c_path(path: &Path) -> Result<std::ffi::CString, PrivateTmpError> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| fail(format!("using {}", path.display()))(e.to_string()))
}

/// Opens a namespace file ([`super::nsfs::open`]).
pub fn open_nsfs(path: &Path) -> Result<OwnedFd, PrivateTmpError> {
    super::nsfs::open(path).map_err(|(action, reason)| PrivateTmpError { action, reason })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::cgroup::parse_mountinfo;

    /// A holder's steps change its own namespaces, never those of the process whose
    /// memory it shares, and it is killed and reaped when dropped.
    #[test]
    fn a_holder_changes_its_own_namespace_and_no_one_elses() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let ours = fs::read_link("/proc/self/ns/net").unwrap();
        // SAFETY: a plain system call.
        let mut steps = || match unsafe { libc::unshare(libc::CLONE_NEWNET) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        };
        // SAFETY: as above.
        let holder = unsafe { Holder::spawn(&mut steps) }.unwrap();
        let its = fs::read_link(format!("/proc/{}/ns/net", holder.id())).unwrap();
        assert_ne!(its, ours, "the holder has no namespace of its own");
        assert_eq!(fs::read_link("/proc/self/ns/net").unwrap(), ours);
        let status = fs::read_to_string(format!("/proc/{}/status", holder.id())).unwrap();
        assert_eq!(crate::isolation::procs::parse_status_uids(&status), [0; 4]);
        let pid = holder.id();
        drop(holder);
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "the holder is killed and reaped when dropped"
        );
    }

    #[test]
    fn a_holder_whose_steps_fail_says_why() {
        let mut steps = || Err(std::io::Error::from_raw_os_error(libc::EPERM));
        // SAFETY: steps without a system call.
        let err = unsafe { Holder::spawn(&mut steps) }.err().unwrap();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM));
    }

    #[test]
    fn namespace_files_and_agents_directories_are_detached_outermost_first() {
        let table = "\
1 0 8:1 / / rw - ext4 /dev/vda rw
2 1 0:4 net:[4026532] /run/netns/a rw - nsfs nsfs rw
3 1 8:1 /run/sp/mntns/a /run/sp/mntns/a rw - ext4 /dev/vda rw
4 3 0:4 mnt:[4026533] /run/sp/mntns/a/0.mnt rw - nsfs nsfs rw
5 3 0:4 user:[4026534] /run/sp/mntns/a/0.user rw - nsfs nsfs rw
6 1 8:1 /run/sp/mntns/b /run/sp/mntns/b rw - ext4 /dev/vda rw
7 1 0:5 / /tmp rw - tmpfs tmpfs rw
8 1 8:1 /run/sp/mntnsx /run/sp/mntnsx rw - ext4 /dev/vda rw
";
        let points = to_detach(&parse_mountinfo(table), Path::new("/run/sp/mntns"));
        let points: Vec<&str> = points.iter().map(|p| p.to_str().unwrap()).collect();
        assert_eq!(
            points,
            ["/run/netns/a", "/run/sp/mntns/a", "/run/sp/mntns/b"],
            "the files under a detached directory go with it; /tmp and a look-alike stay"
        );
    }
}
