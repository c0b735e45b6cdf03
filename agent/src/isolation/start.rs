//! Starting a process inside a slot, as its user: the agent's side of every login
//! ([`crate::isolation::enter`]) and of every `slotpool exec` command ([`crate::exec`]).
//!
//! The agent forks; the child, still root, does every step below before the first
//! instruction of the slot's program, so nothing of that program ever runs outside the
//! slot:
//!
//! 1. gives every signal its default action, starts a session of its own, and takes
//!    its terminal when its input is one (a login with a pty: the terminal's hang-up and
//!    job control then reach the shell);
//! 2. sets the resource limits it is given (a login's: those sshd gave its helper; an
//!    agent without `CAP_SYS_RESOURCE` gives no hard limit above its own);
//! 3. joins the slot's cgroup, writing `0` to each `cgroup.procs` it was handed open
//!    (first, where the kernel lets it, its helper's groups in the hierarchies the slot
//!    has none in: on a v1 host a login stays in its sshd's service or session there,
//!    not in the agent's);
//! 4. sets the user's group as its only group, joins the slot's namespaces in their
//!    order (network, mount, IPC), becomes the slot's uid and gid (real, effective,
//!    saved), goes to its working directory in the slot's mount namespace (`/` when that
//!    is not there), sets its umask
//! 5. and execs. The exec as a non-root uid drops every capability.
//!
//! A step that fails makes the start fail with the step's error; the process never
//! runs.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// A namespace a process started in a slot joins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NsKind {
    User,
    Net,
    Mnt,
    Ipc,
}

/// What a process needs to enter a slot: who it becomes and what it joins.
#[derive(Debug)]
pub struct SlotEntry {
    pub slot: u32,
    pub user: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    pub shell: PathBuf,
    /// `cgroup.procs` of groups to join first where the kernel lets it (see
    /// [`crate::isolation::cgroup::procs_beside`]), open for writing.
    pub beside_procs: Vec<OwnedFd>,
    /// `cgroup.procs` of each of the slot's cgroup directories, open for writing.
    pub cgroup_procs: Vec<OwnedFd>,
    /// The slot's namespaces, in the order to join them.
    pub namespaces: Vec<(NsKind, OwnedFd)>,
}

/// A resource limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rlimit {
    pub resource: u32,
    pub soft: u64,
    pub hard: u64,
}

/// The resources a login's limits are carried for (what `pam_limits` sets).
pub const CARRIED_LIMITS: [u32; 11] = [
    libc::RLIMIT_AS,
    libc::RLIMIT_CORE,
    libc::RLIMIT_CPU,
    libc::RLIMIT_DATA,
    libc::RLIMIT_FSIZE,
    libc::RLIMIT_MEMLOCK,
    libc::RLIMIT_NOFILE,
    libc::RLIMIT_NPROC,
    libc::RLIMIT_STACK,
    libc::RLIMIT_MSGQUEUE,
    libc::RLIMIT_SIGPENDING,
];

/// The limits of [`CARRIED_LIMITS`] of process `pid`, as the kernel says them.
pub fn limits_of(pid: i32) -> Vec<Rlimit> {
    CARRIED_LIMITS
        .iter()
        .filter_map(|&resource| {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: prlimit writes the limit into the struct we own and sets none.
            let rc = unsafe { libc::prlimit(pid, resource as _, std::ptr::null(), &mut limit) };
            (rc == 0).then_some(Rlimit {
                resource,
                soft: limit.rlim_cur,
                hard: limit.rlim_max,
            })
        })
        .collect()
}

/// How the started process stands towards its caller.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    /// Its working directory inside the slot (`/` when that is not there).
    pub cwd: PathBuf,
    /// Limits to set (resources outside [`CARRIED_LIMITS`] are ignored).
    pub limits: Vec<Rlimit>,
    /// Its umask; `None` keeps the agent's.
    pub umask: Option<u32>,
}

impl SlotEntry {
    /// Makes `command` start inside the slot as its user (see the module's doc); its
    /// program, arguments, environment and standard descriptors are the caller's.
    pub fn apply(self, command: &mut tokio::process::Command, settings: Settings) {
        let cwd = c_path(&settings.cwd).unwrap_or_else(|| c"/".into());
        let limits: Vec<Rlimit> = settings
            .limits
            .into_iter()
            .filter(|l| CARRIED_LIMITS.contains(&l.resource))
            .collect();
        let umask = settings.umask.map(|m| m & 0o777);
        let SlotEntry {
            uid,
            gid,
            beside_procs,
            cgroup_procs,
            namespaces,
            ..
        } = self;
        // SAFETY: the closure runs in the forked child, between fork and exec, and makes
        // only async-signal-safe system calls on values moved into it.
        unsafe {
            command.pre_exec(move || {
                for procs in &beside_procs {
                    libc::write(procs.as_raw_fd(), b"0".as_ptr().cast(), 1);
                }
                enter(uid, gid, &cgroup_procs, &namespaces, &cwd, &limits, umask)
            });
        }
    }
}

fn c_path(path: &Path) -> Option<CString> {
    CString::new(path.as_os_str().as_bytes()).ok()
}

fn check(rc: libc::c_long) -> std::io::Result<()> {
    match rc {
        -1 => Err(std::io::Error::last_os_error()),
        _ => Ok(()),
    }
}

/// The steps of the module's doc, in the forked child.
///
/// # Safety
/// Between fork and exec only.
unsafe fn enter(
    uid: u32,
    gid: u32,
    cgroup_procs: &[OwnedFd],
    namespaces: &[(NsKind, OwnedFd)],
    cwd: &CString,
    limits: &[Rlimit],
    umask: Option<u32>,
) -> std::io::Result<()> {
    // SAFETY: plain system calls on values of this frame.
    unsafe {
        // Every signal as a login's shell gets it from sshd: its default action (an agent
        // may ignore some, and an ignored signal stays ignored across exec).
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        for signal in 1..libc::SIGRTMAX() {
            if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                libc::sigaction(signal, &default, std::ptr::null_mut());
            }
        }
        check(libc::setsid() as libc::c_long)?;
        if libc::isatty(0) == 1 {
            // Steal it from the helper's session: the caller is root here.
            check(libc::ioctl(0, libc::TIOCSCTTY, 1) as libc::c_long)?;
        }
        for limit in limits {
            let mut set = libc::rlimit {
                rlim_cur: limit.soft,
                rlim_max: limit.hard,
            };
            if libc::setrlimit(limit.resource as _, &set) != 0 {
                // Without CAP_SYS_RESOURCE no hard limit goes above the agent's.
                let mut now = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                check(libc::getrlimit(limit.resource as _, &mut now) as libc::c_long)?;
                set.rlim_max = set.rlim_max.min(now.rlim_max);
                set.rlim_cur = set.rlim_cur.min(set.rlim_max);
                check(libc::setrlimit(limit.resource as _, &set) as libc::c_long)?;
            }
        }
        for procs in cgroup_procs {
            if libc::write(procs.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                return Err(std::io::Error::last_os_error());
            }
        }
        check(libc::syscall(libc::SYS_setgroups, 1 as libc::c_long, &gid))?;
        for (kind, fd) in namespaces {
            let flag = match kind {
                NsKind::User => libc::CLONE_NEWUSER,
                NsKind::Net => libc::CLONE_NEWNET,
                NsKind::Mnt => libc::CLONE_NEWNS,
                NsKind::Ipc => libc::CLONE_NEWIPC,
            };
            check(libc::setns(fd.as_raw_fd(), flag) as libc::c_long)?;
        }
        check(libc::syscall(libc::SYS_setresgid, gid, gid, gid))?;
        check(libc::syscall(libc::SYS_setresuid, uid, uid, uid))?;
        if libc::chdir(cwd.as_ptr()) != 0 {
            check(libc::chdir(c"/".as_ptr()) as libc::c_long)?;
        }
        if let Some(mask) = umask {
            libc::umask(mask as libc::mode_t);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process started with an entry runs with the limits and umask it was given, in a
    /// session of its own, as the entry's uid and gid with that gid its only group.
    #[tokio::test]
    async fn a_started_process_has_the_ids_limits_and_umask_it_was_given() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let own = limits_of(std::process::id() as i32);
        let nofile = own
            .iter()
            .find(|l| l.resource == libc::RLIMIT_NOFILE)
            .expect("this process's descriptor limit");
        // Whether this process has CAP_SYS_RESOURCE (24), which raising a hard limit takes.
        let can_raise = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|c| u64::from_str_radix(c.trim(), 16).ok())
                .is_some_and(|c| c & (1 << 24) != 0)
        });
        // Above this process's own hard limit where it may raise one; else at it.
        let raised = if can_raise {
            nofile.hard + 1000
        } else {
            nofile.hard
        };
        let entry = SlotEntry {
            slot: 0,
            user: "nobody".into(),
            uid: 65534,
            gid: 65534,
            home: "/".into(),
            shell: "/bin/sh".into(),
            beside_procs: Vec::new(),
            cgroup_procs: Vec::new(),
            namespaces: Vec::new(),
        };
        let mut command = tokio::process::Command::new("/bin/sh");
        command
            .arg("-c")
            .arg("ulimit -Sn; ulimit -Hn; umask; id -u; id -G; ps -o sid= -p $$; echo $$")
            .stdout(std::process::Stdio::piped());
        entry.apply(
            &mut command,
            Settings {
                cwd: "/".into(),
                limits: vec![Rlimit {
                    resource: libc::RLIMIT_NOFILE,
                    soft: 900,
                    hard: raised,
                }],
                umask: Some(0o027),
            },
        );
        let out = command.output().await.unwrap();
        let out = String::from_utf8_lossy(&out.stdout).into_owned();
        let lines: Vec<&str> = out.lines().map(str::trim).collect();
        assert_eq!(
            lines[..5],
            ["900", &raised.to_string(), "0027", "65534", "65534"],
            "{out}"
        );
        assert_eq!(lines[5], lines[6], "not a session leader: {out}");
    }
}
