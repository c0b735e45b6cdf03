//! Per-slot disk quota: a slot with a disk limit (`limits.disk-mb` of its label, or the
//! agent's `--slot-disk-quota-mb`) gets a file system of its own as its workspace, so a
//! job that fills it gets `ENOSPC` and nobody else notices.
//!
//! The host's file system need not support project quotas: each such workspace is a
//! sparse file `<work-dir>/images/<slot>.img` (root-only directory) holding an ext4
//! file system, made with `mkfs.ext4` (no reserved blocks: the whole size is the job's;
//! lazy inode-table and journal init, so it takes milliseconds) and loop-mounted
//! `nodev,nosuid` on the workspace directory ([`crate::isolation::mounts`]). The file system's root
//! belongs to the slot user, mode 0700; the directory under it belongs to root, 0700,
//! so nothing is ever written to the host's file system through it.
//!
//! Release unmounts it (lazily when something still holds it) and deletes the image:
//! the wipe of the workspace is then nothing. A failure of either is a reason for the
//! slot to be dirty.
//!
//! Not covered: world-writable directories of the host (`/tmp`, `/var/tmp`, `/dev/shm`)
//! are on the host's file systems; see the agent's documentation. Images are sparse, so
//! slots × quota may exceed the host's free space: size the quotas to fit.

use crate::isolation::mounts::{MountNamespace, Unmounted};
use crate::isolation::{make_private_dir, IsolationError};
use std::fs;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The directory of the images under the work dir.
const IMAGES_DIR: &str = "images";
/// Where the kernel hands out loop devices.
const LOOP_CONTROL: &str = "/dev/loop-control";

/// Why quota'd workspaces cannot be made on this host.
#[derive(Debug, thiserror::Error)]
#[error("per-slot disk quotas need loop devices and mkfs.ext4: {0}")]
pub struct QuotaUnavailable(pub String);

/// The slots' workspace images and where they are mounted.
pub struct WorkspaceImages {
    dir: PathBuf,
    mounts: MountNamespace,
    /// Why images cannot be made here (checked once at start), if they cannot.
    unavailable: Option<String>,
}

impl WorkspaceImages {
    /// Uses (and creates, root-only) `<work_dir>/images`; checks once whether loop
    /// devices and `mkfs.ext4` are there.
    pub fn new(work_dir: &Path, mounts: MountNamespace) -> Result<WorkspaceImages, IsolationError> {
        let dir = work_dir.join(IMAGES_DIR);
        fs::create_dir_all(&dir).map_err(IsolationError::new("creating", &dir))?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
            .map_err(IsolationError::new("setting mode 0700 on", &dir))?;
        Ok(WorkspaceImages {
            dir,
            mounts,
            unavailable: check_available().err().map(|e| e.0),
        })
    }

    /// Whether quota'd workspaces can be made here; `Err` says why not.
    pub fn available(&self) -> Result<(), QuotaUnavailable> {
        match &self.unavailable {
            Some(why) => Err(QuotaUnavailable(why.clone())),
            None => Ok(()),
        }
    }

    /// The image file of `slot`.
    pub fn image(&self, slot: u32) -> PathBuf {
        self.dir.join(format!("{slot}.img"))
    }

    /// Whether `workspace` has a file system mounted on it (mountinfo names mount
    /// points by their real path: a work dir behind a symlink is resolved first).
    pub fn mounted(&self, workspace: &Path) -> bool {
        let real = fs::canonicalize(workspace).unwrap_or_else(|_| workspace.to_path_buf());
        self.mounts.is_mount_point(&real)
    }

    /// Makes `workspace` (which must not exist) a fresh file system of `bytes` owned by
    /// `uid`:`gid`. Leaves nothing behind when it fails.
    pub fn create(
        &self,
        slot: u32,
        bytes: u64,
        workspace: &Path,
        uid: u32,
        gid: u32,
    ) -> Result<(), IsolationError> {
        let image = self.image(slot);
        let fail = |action: &'static str, path: &Path| IsolationError::new(action, path);
        if let Err(err) = self.available() {
            return Err(fail("making a quota'd workspace", workspace)(
                std::io::Error::other(err),
            ));
        }
        let result = (|| {
            make_private_dir(workspace)?;
            let _ = fs::remove_file(&image);
            let file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&image)
                .map_err(fail("creating", &image))?;
            file.set_len(bytes).map_err(fail("sizing", &image))?;
            drop(file);
            mkfs(&image, uid, gid)?;
            self.mounts
                .mount_image(&image, workspace)
                .map_err(|e| fail("mounting", workspace)(std::io::Error::other(e)))?;
            let lost = workspace.join("lost+found");
            fs::remove_dir(&lost).map_err(fail("removing", &lost))?;
            fs::set_permissions(workspace, fs::Permissions::from_mode(0o700))
                .map_err(fail("setting mode 0700 on", workspace))
        })();
        if result.is_err() {
            let _ = self.remove(slot, workspace);
        }
        result
    }

    /// Unmounts `workspace` if something is mounted there and deletes the image of
    /// `slot`; the problems met, for the slot's dirty reason (empty: nothing is mounted
    /// on the workspace any more and the image is gone; release relies on it). The
    /// workspace directory itself stays.
    pub fn remove(&self, slot: u32, workspace: &Path) -> Vec<String> {
        let mut problems = Vec::new();
        if self.mounted(workspace) {
            match self.mounts.unmount(workspace) {
                Ok(Unmounted::Now) => {}
                Ok(Unmounted::Lazily) => tracing::info!(
                    slot,
                    workspace = %workspace.display(),
                    "workspace was busy: detached it (its loop device goes when its last user does)"
                ),
                Err(err) => problems.push(format!("unmounting the workspace: {err}")),
            }
        }
        let image = self.image(slot);
        match fs::remove_file(&image) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => problems.push(format!("removing {}: {e}", image.display())),
        }
        problems
    }

    /// Mounts the existing image of `slot` on `workspace` again (after a reboot).
    pub fn remount(&self, slot: u32, workspace: &Path) -> Result<(), IsolationError> {
        self.mounts
            .mount_image(&self.image(slot), workspace)
            .map_err(|e| IsolationError::new("mounting", workspace)(std::io::Error::other(e)))
    }

    /// What is left of `slot`'s image: a mount on `workspace` or the image file.
    pub fn leftovers(&self, slot: u32, workspace: &Path) -> Vec<String> {
        let mut left = Vec::new();
        if self.mounted(workspace) {
            left.push(format!("a file system mounted on {}", workspace.display()));
        }
        let image = self.image(slot);
        if fs::symlink_metadata(&image).is_ok() {
            left.push(format!("image {}", image.display()));
        }
        left
    }
}

/// An ext4 file system in `image`, its root owned by `uid`:`gid`.
fn mkfs(image: &Path, uid: u32, gid: u32) -> Result<(), IsolationError> {
    let options =
        format!("nodiscard,lazy_itable_init=1,lazy_journal_init=1,root_owner={uid}:{gid}");
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0", "-E", &options])
        .arg(image)
        .env("LC_ALL", "C")
        .output()
        .map_err(IsolationError::new("running mkfs.ext4 on", image))?;
    if out.status.success() {
        return Ok(());
    }
    Err(IsolationError::new("running mkfs.ext4 on", image)(
        std::io::Error::other(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    ))
}

/// Whether this host can loop-mount images: a loop control device, a free loop device
/// (`losetup -f` makes one if needed) and `mkfs.ext4`.
pub fn check_available() -> Result<(), QuotaUnavailable> {
    if fs::symlink_metadata(LOOP_CONTROL).is_err() {
        return Err(QuotaUnavailable(format!(
            "{LOOP_CONTROL} is missing (load the loop module, or give the container loop devices)"
        )));
    }
    for (tool, args) in [("losetup", &["-f"][..]), ("mkfs.ext4", &["-V"][..])] {
        match Command::new(tool).args(args).env("LC_ALL", "C").output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => {
                return Err(QuotaUnavailable(format!(
                    "`{tool} {}` failed ({}): {}",
                    args.join(" "),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                )))
            }
            Err(e) => return Err(QuotaUnavailable(format!("running {tool}: {e}"))),
        }
    }
    Ok(())
}
