//! The mounts the agent makes where slot logins see them: each quota'd slot's workspace
//! image ([`crate::isolation::disk_quota`]) and a `/proc` that hides other users' processes
//! ([`MountNamespace::hide_processes`]).
//!
//! Mounts only matter in the mount namespace sshd (so every slot login) lives in. A
//! service manager may run the agent in a namespace of its own, from which no mount
//! propagates back (systemd does for `ProtectSystem=`): `--mount-namespace FILE` (the
//! package sets `/proc/1/ns/mnt`) names the namespace to mount in, and `mount`/`umount`
//! then run through `nsenter --mount=FILE`. Without it the agent mounts in its own
//! namespace (the tests run the agent and its sshd in a private one). What the agent
//! mounts in the host's namespace reaches its own through ordinary propagation.

use crate::isolation::cgroup::{parse_mountinfo, MountEntry};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Mount options of a workspace image: no device files, no set-uid programs.
pub const IMAGE_MOUNT_OPTIONS: &str = "loop,nodev,nosuid";

/// Why a mount or unmount did not happen.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("running {command}: {error}")]
    Spawn {
        command: String,
        error: std::io::Error,
    },
    #[error("{command} failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("/proc in the slots' mount namespace has options {options:?} after mounting it with hidepid=invisible")]
    NotHidden { options: Vec<String> },
}

/// How a busy workspace came off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unmounted {
    /// Unmounted at once.
    Now,
    /// Detached (`umount -l`): gone from every path, freed when its last user is.
    Lazily,
}

/// The mount namespace slot logins live in.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MountNamespace {
    /// A namespace file to enter (`/proc/1/ns/mnt`); `None`: the agent's own.
    enter: Option<PathBuf>,
}

/// A command running `program` in the mount namespace `ns` (a `/proc/<pid>/ns/mnt`
/// file, entered with `nsenter`), or in this process's own when `None`. `nsenter` execs
/// `program`, so the child's pid is the program's.
pub fn in_namespace(ns: Option<&Path>, program: impl AsRef<OsStr>) -> Command {
    match ns {
        Some(ns) => {
            let mut cmd = Command::new("nsenter");
            cmd.arg(format!("--mount={}", ns.display()))
                .arg("--")
                .arg(program);
            cmd
        }
        None => Command::new(program),
    }
}

/// Whether `dir` is the root of a mount in this process's namespace
/// (`STATX_ATTR_MOUNT_ROOT`, Linux 5.8): `Some(false)` when nothing is there, `None`
/// when the kernel does not say (older kernels) or `dir` cannot be examined.
fn is_mount_root(dir: &Path) -> Option<bool> {
    use rustix::fs::{AtFlags, StatxAttributes, StatxFlags};
    match rustix::fs::statx(
        rustix::fs::CWD,
        dir,
        AtFlags::NO_AUTOMOUNT | AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::empty(),
    ) {
        Ok(stat)
            if stat
                .stx_attributes_mask
                .contains(StatxAttributes::MOUNT_ROOT) =>
        {
            Some(stat.stx_attributes.contains(StatxAttributes::MOUNT_ROOT))
        }
        Ok(_) => None,
        // Nothing can be mounted on a path that does not exist in this namespace.
        Err(rustix::io::Errno::NOENT) => Some(false),
        Err(_) => None,
    }
}

impl MountNamespace {
    pub fn new(enter: Option<PathBuf>) -> MountNamespace {
        MountNamespace { enter }
    }

    /// `program` with `args`, run in this namespace.
    fn command(&self, program: &str, args: &[&OsStr]) -> Command {
        let mut cmd = in_namespace(self.enter.as_deref(), program);
        cmd.args(args).env("LC_ALL", "C");
        cmd
    }

    /// Runs `program`; its stdout when it exits 0.
    fn run(&self, program: &str, args: &[&OsStr]) -> Result<String, MountError> {
        let mut cmd = self.command(program, args);
        let command = format!("{cmd:?}");
        let out = cmd.output().map_err(|error| MountError::Spawn {
            command: command.clone(),
            error,
        })?;
        if !out.status.success() {
            return Err(MountError::Failed {
                command,
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Loop-mounts the ext4 `image` on `dir` with [`IMAGE_MOUNT_OPTIONS`].
    pub fn mount_image(&self, image: &Path, dir: &Path) -> Result<(), MountError> {
        self.run(
            "mount",
            &[
                OsStr::new("-t"),
                OsStr::new("ext4"),
                OsStr::new("-o"),
                OsStr::new(IMAGE_MOUNT_OPTIONS),
                image.as_os_str(),
                dir.as_os_str(),
            ],
        )
        .map(drop)
    }

    /// Unmounts `dir`; lazily when it is busy. A loop device set up by `mount -o loop`
    /// detaches itself once the file system is gone.
    pub fn unmount(&self, dir: &Path) -> Result<Unmounted, MountError> {
        match self.run("umount", &[dir.as_os_str()]) {
            Ok(_) => Ok(Unmounted::Now),
            Err(first) => {
                self.run("umount", &[OsStr::new("-l"), dir.as_os_str()])
                    .map_err(|lazy| MountError::Failed {
                        command: format!("umount (then umount -l) {}", dir.display()),
                        status: "both failed".into(),
                        stderr: format!("{first}; {lazy}"),
                    })?;
                Ok(Unmounted::Lazily)
            }
        }
    }

    /// The mounts of this namespace (as its `/proc/self/mountinfo` lists them; the
    /// agent's own is read directly).
    pub fn mounts(&self) -> Result<Vec<MountEntry>, MountError> {
        let text = match &self.enter {
            Some(_) => self.run("cat", &[OsStr::new("/proc/self/mountinfo")])?,
            None => std::fs::read_to_string("/proc/self/mountinfo").map_err(|error| {
                MountError::Spawn {
                    command: "reading /proc/self/mountinfo".into(),
                    error,
                }
            })?,
        };
        Ok(parse_mountinfo(&text))
    }

    /// Whether `dir` is a mount point in this namespace (where slot logins see it, not
    /// only where the agent does). `true` when the mounts cannot be read, so a release
    /// tries to unmount and fails (the slot goes dirty) rather than believing it clean.
    pub fn is_mount_point(&self, dir: &Path) -> bool {
        // In the agent's own namespace the kernel says it of the path itself, without
        // rendering every mount of the host (a release asks twice per slot).
        if self.enter.is_none() {
            if let Some(root) = is_mount_root(dir) {
                return root;
            }
        }
        match self.mounts() {
            Ok(mounts) => mounts.iter().any(|m| m.mount_point == dir),
            Err(err) => {
                tracing::warn!(dir = %dir.display(), %err, "cannot read the mounts; assuming a mount point");
                true
            }
        }
    }

    /// Makes `/proc` of this namespace show each user only their own processes
    /// (`hidepid=invisible`), but to root and to members of `gid`: a fresh proc instance
    /// is mounted over `/proc` unless the top one already hides. Returns whether it
    /// mounted one.
    ///
    /// A fresh instance rather than a remount: since Linux 5.8 each proc mount has its
    /// options of its own, so nothing outside this namespace changes; in the host's
    /// namespace, every process opening `/proc` from now on sees the new one.
    pub fn hide_processes(&self, gid: Option<u32>) -> Result<bool, MountError> {
        let wanted = hide_options(gid);
        if proc_hides(&self.mounts()?, gid).is_ok() {
            return Ok(false);
        }
        self.run(
            "mount",
            &[
                OsStr::new("-t"),
                OsStr::new("proc"),
                OsStr::new("-o"),
                OsStr::new(&wanted),
                OsStr::new("proc"),
                OsStr::new("/proc"),
            ],
        )?;
        proc_hides(&self.mounts()?, gid).map_err(|options| MountError::NotHidden { options })?;
        Ok(true)
    }
}

/// The proc mount options hiding processes from all but root and `gid`.
pub fn hide_options(gid: Option<u32>) -> String {
    match gid {
        Some(gid) => format!("hidepid=invisible,gid={gid}"),
        None => "hidepid=invisible".into(),
    }
}

/// Whether the top `/proc` mount of `mounts` hides processes (exempting `gid`); `Err`
/// holds its options when it does not.
fn proc_hides(mounts: &[MountEntry], gid: Option<u32>) -> Result<(), Vec<String>> {
    let Some(top) = mounts
        .iter()
        .rev()
        .find(|m| m.mount_point == Path::new("/proc"))
    else {
        return Err(Vec::new());
    };
    let has = |o: &str| top.super_options.iter().any(|x| x == o);
    let gid_ok = gid.is_none_or(|g| has(&format!("gid={g}")));
    if top.fs_type == "proc" && has("hidepid=invisible") && gid_ok {
        Ok(())
    } else {
        Err(top.super_options.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTS: &str = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
65 22 0:40 / /proc rw,relatime - proc proc rw,gid=4,hidepid=invisible
70 27 7:0 / /var/lib/slotpool/agent/slots/3 rw,nosuid,nodev - ext4 /dev/loop0 rw
";

    #[test]
    fn the_kernel_and_the_mount_table_agree_on_what_is_a_mount_point() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("gone");
        let table = parse_mountinfo(&std::fs::read_to_string("/proc/self/mountinfo").unwrap());
        for (path, mounted) in [
            (Path::new("/"), true),
            (Path::new("/proc"), true),
            (dir.path(), false),
            (missing.as_path(), false),
        ] {
            assert_eq!(is_mount_root(path), Some(mounted), "{}", path.display());
            assert_eq!(
                table.iter().any(|m| m.mount_point == path),
                mounted,
                "{}",
                path.display()
            );
            assert_eq!(
                MountNamespace::default().is_mount_point(path),
                mounted,
                "{}",
                path.display()
            );
        }
    }

    #[test]
    fn the_top_proc_mount_decides() {
        let mounts = parse_mountinfo(MOUNTS);
        assert_eq!(proc_hides(&mounts, None), Ok(()));
        assert_eq!(proc_hides(&mounts, Some(4)), Ok(()));
        assert!(proc_hides(&mounts, Some(5)).is_err());
        assert_eq!(proc_hides(&mounts[..1], None), Err(vec!["rw".to_string()]));
        assert!(proc_hides(&[], None).is_err());
        assert_eq!(hide_options(Some(4)), "hidepid=invisible,gid=4");
    }

    #[test]
    fn commands_enter_the_namespace_when_asked() {
        let own = MountNamespace::new(None).command("umount", &[OsStr::new("/x")]);
        assert_eq!(own.get_program(), "umount");
        let host = MountNamespace::new(Some("/proc/1/ns/mnt".into()))
            .command("umount", &[OsStr::new("/x")]);
        assert_eq!(host.get_program(), "nsenter");
        let args: Vec<_> = host.get_args().collect();
        assert_eq!(args, ["--mount=/proc/1/ns/mnt", "--", "umount", "/x"]);
    }
}
