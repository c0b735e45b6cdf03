//! Removing trees a job controls, without recursion and without trusting the tree.
//!
//! A job may leave anything in its workspace: a directory tree tens of thousands of
//! levels deep, millions of files, symlinks pointing anywhere, a directory it took write
//! access away from. [`remove_entry`] removes one entry of a directory (a file, a symlink
//! or a whole tree) with an explicit stack instead of recursion, so no depth can exhaust
//! the agent's stack, and with only two directory descriptors open at a time, so no depth
//! can exhaust its descriptors either:
//! - every step is relative to an open directory (`openat`, `fstatat`, `unlinkat`), and
//!   nothing is followed: directories are opened with `O_NOFOLLOW | O_DIRECTORY` and
//!   entries looked at with `AT_SYMLINK_NOFOLLOW`, so a symlink is removed, never entered;
//! - a directory on another device than the tree's top (a mount point) is not entered:
//!   the removal stops with [`WipeError::OtherFileSystem`];
//! - going back up is `openat(dir, "..")`, checked to be the very directory (device and
//!   inode) the walk came down through: a tree moved under the walk stops it with
//!   [`WipeError::Moved`] rather than letting it remove elsewhere;
//! - a [`Budget`] bounds the entries looked at and the time taken; an exhausted budget is
//!   an error like any other, so the caller never reports a partial removal as success.

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, Stat};
use rustix::io::Errno;
use std::ffi::{CString, OsStr};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Most entries one release may look at (workspace and shared directories together).
pub const MAX_ENTRIES: u64 = 2_000_000;
/// Longest one release may spend removing files.
pub const TIME_BUDGET: Duration = Duration::from_secs(120);

/// Why a removal stopped. The path is the entry the removal was asked to remove; `depth`
/// and `entry` say where inside it the problem was (depth 0: the entry itself).
#[derive(Debug, thiserror::Error)]
pub enum WipeError {
    #[error("removing {path}: {action} {entry:?} at depth {depth}: {error}")]
    Io {
        path: PathBuf,
        action: &'static str,
        entry: String,
        depth: usize,
        error: std::io::Error,
    },
    #[error("removing {path}: more than {max} entries (budget exhausted)")]
    TooManyEntries { path: PathBuf, max: u64 },
    #[error("removing {path}: not done within {limit:?} (budget exhausted)")]
    OutOfTime { path: PathBuf, limit: Duration },
    #[error("removing {path}: {entry:?} at depth {depth} is another file system (a mount point); left alone")]
    OtherFileSystem {
        path: PathBuf,
        entry: String,
        depth: usize,
    },
    #[error("removing {path}: the directory at depth {depth} was moved during the removal")]
    Moved { path: PathBuf, depth: usize },
}

impl WipeError {
    /// The entry the removal was asked to remove.
    pub fn path(&self) -> &Path {
        match self {
            WipeError::Io { path, .. }
            | WipeError::TooManyEntries { path, .. }
            | WipeError::OutOfTime { path, .. }
            | WipeError::OtherFileSystem { path, .. }
            | WipeError::Moved { path, .. } => path,
        }
    }
}

/// How much one clean-up may do: entries looked at and time spent, shared by every
/// removal it makes.
#[derive(Clone, Debug)]
pub struct Budget {
    max_entries: u64,
    entries: u64,
    limit: Duration,
    deadline: Instant,
}

impl Budget {
    /// A budget of `max_entries` entries and `limit` from now.
    pub fn new(max_entries: u64, limit: Duration) -> Budget {
        Budget {
            max_entries,
            entries: 0,
            limit,
            deadline: Instant::now() + limit,
        }
    }

    /// The budget of one release: [`MAX_ENTRIES`] and [`TIME_BUDGET`].
    pub fn for_release() -> Budget {
        Budget::new(MAX_ENTRIES, TIME_BUDGET)
    }

    /// Entries looked at so far.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// Counts one entry; fails when either limit is passed.
    fn spend(&mut self, path: &Path) -> Result<(), WipeError> {
        self.entries += 1;
        if self.entries > self.max_entries {
            return Err(WipeError::TooManyEntries {
                path: path.to_path_buf(),
                max: self.max_entries,
            });
        }
        if Instant::now() >= self.deadline {
            return Err(WipeError::OutOfTime {
                path: path.to_path_buf(),
                limit: self.limit,
            });
        }
        Ok(())
    }
}

/// A directory the walk went down through: its name in its parent and its identity.
struct Level {
    name: CString,
    dev: u64,
    ino: u64,
    /// Subdirectories listed but not visited yet.
    pending: Vec<CString>,
}

fn same(stat: &Stat, level: &Level) -> bool {
    stat.st_dev == level.dev && stat.st_ino == level.ino
}

fn is_dir(stat: &Stat) -> bool {
    FileType::from_raw_mode(stat.st_mode) == FileType::Directory
}

/// How many entries of a directory are listed at a time.
const BATCH: usize = 256;

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

/// Opens `dir` itself (a trusted path, such as the slots directory or `/tmp`) as the
/// starting point of removals; its last component must not be a symlink.
fn open_start(dir: &Path) -> std::io::Result<OwnedFd> {
    Ok(rustix::fs::open(dir, DIR_FLAGS, Mode::empty())?)
}

/// Removes the entry `name` of directory `dir`: a file, a symlink (not what it points
/// to) or a whole directory tree. Returns how many entries were removed; `Ok(0)` when
/// there is no such entry.
pub fn remove_entry(dir: &Path, name: &OsStr, budget: &mut Budget) -> Result<u64, WipeError> {
    let path = dir.join(name);
    let io = |action: &'static str, entry: &[u8], depth: usize| {
        let path = path.clone();
        let entry = String::from_utf8_lossy(entry).into_owned();
        move |e: Errno| WipeError::Io {
            path,
            action,
            entry,
            depth,
            error: e.into(),
        }
    };
    let start = open_start(dir).map_err(|error| WipeError::Io {
        path: path.clone(),
        action: "opening parent",
        entry: dir.display().to_string(),
        depth: 0,
        error,
    })?;
    let top = CString::new(name.as_bytes()).map_err(|_| WipeError::Io {
        path: path.clone(),
        action: "naming",
        entry: name.to_string_lossy().into_owned(),
        depth: 0,
        error: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })?;
    budget.spend(&path)?;
    let stat = match rustix::fs::statat(&start, &top, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(stat) => stat,
        Err(Errno::NOENT) => return Ok(0),
        Err(e) => return Err(io("looking at", name.as_bytes(), 0)(e)),
    };
    if !is_dir(&stat) {
        return match rustix::fs::unlinkat(&start, &top, AtFlags::empty()) {
            Ok(()) => Ok(1),
            Err(Errno::NOENT) => Ok(0),
            Err(e) => Err(io("removing", name.as_bytes(), 0)(e)),
        };
    }
    let dev = stat.st_dev;
    let mut stack = vec![Level {
        name: top,
        dev,
        ino: stat.st_ino,
        pending: Vec::new(),
    }];
    let fd = open_dir(&start, &stack[0])
        .map_err(|e| io("opening", name.as_bytes(), 0)(e))?
        .ok_or_else(|| WipeError::Moved {
            path: path.clone(),
            depth: 0,
        })?;
    // The directory being emptied, read from its start each time the walk comes back to
    // it (what was removed is gone from the listing).
    let mut current = Dir::new(fd).map_err(|e| io("listing", b"", 1)(e))?;
    let mut removed = 0u64;
    let mut batch: Vec<(CString, FileType)> = Vec::with_capacity(BATCH);
    loop {
        let depth = stack.len();
        // Directories of the last batch not visited yet come first: the listing is read
        // again only once they are gone, so a wide directory is not listed over and over.
        let pending = stack.last_mut().and_then(|level| level.pending.pop());
        let child = match pending {
            Some(child) => Some(child),
            None => {
                let (mut dirs, listed_all) =
                    next_batch(&mut current, &mut batch, budget, &path, depth, &mut removed)?;
                if dirs.is_empty() && !listed_all {
                    continue;
                }
                let child = dirs.pop();
                if let Some(level) = stack.last_mut() {
                    level.pending = dirs;
                }
                child
            }
        };
        let fd = current.fd().map_err(|e| io("listing", b"", depth)(e))?;
        if let Some(child) = child {
            let opened = match rustix::fs::openat(fd, &child, DIR_FLAGS, Mode::empty()) {
                Ok(opened) => opened,
                // Replaced by something else meanwhile: look again.
                Err(Errno::NOENT) | Err(Errno::NOTDIR) | Err(Errno::LOOP) => continue,
                Err(e) => return Err(io("opening", child.to_bytes(), depth)(e)),
            };
            let stat = rustix::fs::fstat(&opened)
                .map_err(|e| io("looking at", child.to_bytes(), depth)(e))?;
            if stat.st_dev != dev {
                return Err(WipeError::OtherFileSystem {
                    path,
                    entry: child.to_string_lossy().into_owned(),
                    depth,
                });
            }
            stack.push(Level {
                name: child,
                dev,
                ino: stat.st_ino,
                pending: Vec::new(),
            });
            current = Dir::new(opened).map_err(|e| io("listing", b"", depth + 1)(e))?;
            continue;
        }
        // `current` is empty: remove it from its parent, reached through "..", which must
        // be the directory the walk came down through.
        let done = stack.pop().expect("the stack holds the current directory");
        let Some(up) = stack.last() else {
            return match rustix::fs::unlinkat(&start, &done.name, AtFlags::REMOVEDIR) {
                Ok(()) => Ok(removed + 1),
                Err(e) => Err(io("removing", done.name.to_bytes(), 0)(e)),
            };
        };
        let parent = rustix::fs::openat(fd, c"..", DIR_FLAGS, Mode::empty())
            .map_err(|e| io("opening", b"..", depth)(e))?;
        let stat = rustix::fs::fstat(&parent).map_err(|e| io("looking at", b"..", depth)(e))?;
        if !same(&stat, up) {
            return Err(WipeError::Moved {
                path,
                depth: depth - 1,
            });
        }
        match rustix::fs::unlinkat(&parent, &done.name, AtFlags::REMOVEDIR) {
            Ok(()) => removed += 1,
            Err(e) => return Err(io("removing", done.name.to_bytes(), depth - 1)(e)),
        }
        current = Dir::new(parent).map_err(|e| io("listing", b"", depth - 1)(e))?;
    }
}

/// Lists up to [`BATCH`] more entries of `dir` and removes all but the directories;
/// returns the directories and whether the listing reached its end.
fn next_batch(
    dir: &mut Dir,
    batch: &mut Vec<(CString, FileType)>,
    budget: &mut Budget,
    path: &Path,
    depth: usize,
    removed: &mut u64,
) -> Result<(Vec<CString>, bool), WipeError> {
    let io = |action: &'static str, entry: &[u8]| {
        let entry = String::from_utf8_lossy(entry).into_owned();
        move |e: Errno| WipeError::Io {
            path: path.to_path_buf(),
            action,
            entry,
            depth,
            error: e.into(),
        }
    };
    batch.clear();
    while batch.len() < BATCH {
        let Some(entry) = dir.read() else { break };
        let entry = entry.map_err(io("listing", b""))?;
        if entry.file_name() != c"." && entry.file_name() != c".." {
            batch.push((entry.file_name().to_owned(), entry.file_type()));
        }
    }
    let listed_all = batch.len() < BATCH;
    let fd = dir.fd().map_err(io("listing", b""))?;
    let mut dirs = Vec::new();
    for (name, kind) in batch.drain(..) {
        budget.spend(path)?;
        let kind = match kind {
            FileType::Unknown => match rustix::fs::statat(fd, &name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(stat) => FileType::from_raw_mode(stat.st_mode),
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(io("looking at", name.to_bytes())(e)),
            },
            kind => kind,
        };
        if kind == FileType::Directory {
            dirs.push(name);
            continue;
        }
        match rustix::fs::unlinkat(fd, &name, AtFlags::empty()) {
            Ok(()) => *removed += 1,
            Err(Errno::NOENT) => {}
            Err(e) => return Err(io("removing", name.to_bytes())(e)),
        }
    }
    // Visited in listing order.
    dirs.reverse();
    Ok((dirs, listed_all))
}

/// Removes `path` (a file, a symlink or a tree) as [`remove_entry`] does.
pub fn remove_path(path: &Path, budget: &mut Budget) -> Result<u64, WipeError> {
    match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) => remove_entry(dir, name, budget),
        _ => Err(WipeError::Io {
            path: path.to_path_buf(),
            action: "naming",
            entry: path.display().to_string(),
            depth: 0,
            error: std::io::Error::from(std::io::ErrorKind::InvalidInput),
        }),
    }
}

/// Opens directory `level.name` of `dir` without following a symlink; `None` when what
/// was opened is not the directory `level` names (replaced meanwhile).
fn open_dir<Fd: AsFd>(dir: Fd, level: &Level) -> Result<Option<OwnedFd>, Errno> {
    let fd = rustix::fs::openat(dir, &level.name, DIR_FLAGS, Mode::empty())?;
    let stat = rustix::fs::fstat(&fd)?;
    Ok(same(&stat, level).then_some(fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::PermissionsExt;

    fn budget() -> Budget {
        Budget::new(1_000_000, Duration::from_secs(60))
    }

    /// A tree `depth` levels deep made with relative paths (no long path is ever built).
    fn deep_tree(top: &Path, depth: usize) {
        fs::create_dir(top).unwrap();
        let mut fd = open_start(top).unwrap();
        for _ in 0..depth {
            rustix::fs::mkdirat(&fd, c"d", Mode::from_raw_mode(0o755)).unwrap();
            let _ = rustix::fs::openat(
                &fd,
                c"f",
                OFlags::CREATE | OFlags::WRONLY | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o644),
            )
            .unwrap();
            fd = rustix::fs::openat(&fd, c"d", DIR_FLAGS, Mode::empty()).unwrap();
        }
    }

    #[test]
    fn a_very_deep_tree_is_removed_without_recursion() {
        let tmp = tempfile::tempdir().unwrap();
        let top = tmp.path().join("deep");
        deep_tree(&top, 10_000);
        // On a thread with a small stack: recursion would overflow it.
        let path = top.clone();
        let removed = std::thread::Builder::new()
            .stack_size(64 * 1024)
            .spawn(move || remove_path(&path, &mut budget()))
            .unwrap()
            .join()
            .unwrap()
            .unwrap();
        assert_eq!(removed, 20_001);
        assert!(fs::symlink_metadata(&top).is_err());
    }

    #[test]
    fn a_wide_tree_is_listed_once() {
        let tmp = tempfile::tempdir().unwrap();
        let top = tmp.path().join("wide");
        for i in 0..1000 {
            let sub = top.join(format!("dir-{i}"));
            fs::create_dir_all(&sub).unwrap();
            fs::write(sub.join("file"), "").unwrap();
        }
        // Every entry counted once: 1000 directories, 1000 files and the top.
        let mut budget = Budget::new(2001, Duration::from_secs(60));
        assert_eq!(remove_path(&top, &mut budget).unwrap(), 2001);
        assert_eq!(budget.entries(), 2001);
    }

    #[test]
    fn symlinks_are_removed_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("precious"), "x").unwrap();
        let top = tmp.path().join("ws");
        fs::create_dir_all(top.join("a/b")).unwrap();
        std::os::unix::fs::symlink(&outside, top.join("a/b/link")).unwrap();
        std::os::unix::fs::symlink(&outside, top.join("link")).unwrap();
        fs::write(top.join("a/file"), "x").unwrap();
        // A directory the job took every permission away from (root removes it anyway;
        // unprivileged runs of this test need the owner's write bit, so keep 0o300).
        fs::set_permissions(top.join("a"), fs::Permissions::from_mode(0o300)).unwrap();
        assert_eq!(remove_path(&top, &mut budget()).unwrap(), 6);
        assert!(outside.join("precious").exists());
        // A symlink at the top is removed, its target kept.
        std::os::unix::fs::symlink(&outside, &top).unwrap();
        assert_eq!(remove_path(&top, &mut budget()).unwrap(), 1);
        assert!(outside.join("precious").exists());
        // Nothing there: nothing to do.
        assert_eq!(remove_path(&top, &mut budget()).unwrap(), 0);
    }

    #[test]
    fn another_file_system_inside_the_tree_is_left_alone() {
        // Mounting needs root, as the agent's tests have (they fail loudly without it).
        let tmp = tempfile::tempdir().unwrap();
        let top = tmp.path().join("ws");
        let mnt = top.join("sub/mnt");
        fs::create_dir_all(&mnt).unwrap();
        let mount = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "slotpool-wipe-test"])
            .arg(&mnt)
            .status()
            .unwrap();
        assert!(mount.success(), "mounting a tmpfs (run as root)");
        fs::write(mnt.join("precious"), "x").unwrap();
        let result = remove_path(&top, &mut budget());
        let kept = mnt.join("precious").exists();
        let umount = std::process::Command::new("umount")
            .arg(&mnt)
            .status()
            .unwrap();
        assert!(umount.success());
        let err = result.unwrap_err();
        assert!(
            matches!(&err, WipeError::OtherFileSystem { entry, depth: 2, .. } if entry == "mnt"),
            "{err}"
        );
        assert!(kept, "the mounted file system was emptied");
        remove_path(&top, &mut budget()).unwrap();
    }

    #[test]
    fn an_exhausted_budget_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let top = tmp.path().join("wide");
        fs::create_dir(&top).unwrap();
        for i in 0..50 {
            fs::write(top.join(i.to_string()), "").unwrap();
        }
        let err = remove_path(&top, &mut Budget::new(10, Duration::from_secs(60))).unwrap_err();
        assert!(
            matches!(err, WipeError::TooManyEntries { max: 10, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("wide"), "{err}");
        let err = remove_path(&top, &mut Budget::new(100, Duration::ZERO)).unwrap_err();
        assert!(matches!(err, WipeError::OutOfTime { .. }), "{err}");
        // A fresh budget finishes the job.
        remove_path(&top, &mut budget()).unwrap();
        assert!(!top.exists());
    }

    #[test]
    fn errors_name_the_path_and_where_inside() {
        let tmp = tempfile::tempdir().unwrap();
        let err = remove_path(&tmp.path().join("nodir/x"), &mut budget()).unwrap_err();
        assert!(err.to_string().contains("nodir/x"), "{err}");
    }
}
