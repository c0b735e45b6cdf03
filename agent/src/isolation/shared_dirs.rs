//! The host's shared directories, where a slot user can leave files outside its
//! workspace, and removing what a uid left there.
//!
//! Which directories are world-writable differs between hosts, so they are found at
//! start-up ([`scan`]) rather than listed: each of [`SCAN_ROOTS`] and the directories up
//! to [`SCAN_DEPTH`] levels below it that have the `o+w` bit (symlinks are not followed;
//! each listing is bounded). The spools where setuid tools write files owned by the user
//! (crontabs, at jobs, mail) are added by name ([`SPOOL_DIRS`]). At release, every
//! top-level entry the slot's uid owns in these directories is removed with
//! [`crate::isolation::wipe`] (no recursion, nothing followed, within the release's budget);
//! an entry that cannot be removed is returned, and makes the slot dirty. The listing is
//! the check: it is made once no process of the uid is left to add an entry.
//!
//! Not covered: entries deeper than the top level of these directories that are owned by
//! the uid inside a directory owned by someone else, and world-writable directories
//! deeper than [`SCAN_DEPTH`] or made after start-up.

use crate::isolation::wipe::{self, Budget, WipeError};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;

/// Where world-writable directories are looked for.
pub const SCAN_ROOTS: [&str; 8] = [
    "/tmp",
    "/var/tmp",
    "/dev/shm",
    "/run",
    "/run/lock",
    "/dev/mqueue",
    "/var/spool",
    "/var/crash",
];
/// How many levels below a root are looked at.
pub const SCAN_DEPTH: usize = 2;
/// Most entries read from one directory while scanning.
pub const MAX_SCAN_ENTRIES: usize = 4096;
/// Most shared directories kept.
pub const MAX_SHARED_DIRS: usize = 256;
/// Spools where tools write files owned by the user, though they are not world-writable.
pub const SPOOL_DIRS: [&str; 6] = [
    "/var/spool/cron",
    "/var/spool/cron/crontabs",
    "/var/spool/cron/atjobs",
    "/var/spool/at",
    "/var/mail",
    "/var/spool/mail",
];

/// The world-writable directories among `roots` and below them (to [`SCAN_DEPTH`]
/// levels), in scan order, without duplicates and at most [`MAX_SHARED_DIRS`].
pub fn scan(roots: &[PathBuf]) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    // (directory, depth below its root); an explicit stack, depth-first.
    let mut todo: Vec<(PathBuf, usize)> = roots.iter().rev().map(|r| (r.clone(), 0)).collect();
    while let Some((dir, depth)) = todo.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&dir) else {
            continue;
        };
        if !meta.is_dir() || !seen.insert((meta.dev(), meta.ino())) {
            continue;
        }
        if meta.permissions().mode() & 0o002 != 0 && found.len() < MAX_SHARED_DIRS {
            found.push(dir.clone());
        }
        if depth >= SCAN_DEPTH {
            continue;
        }
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut children: Vec<PathBuf> = entries
            .take(MAX_SCAN_ENTRIES)
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .collect();
        children.sort();
        todo.extend(children.into_iter().rev().map(|c| (c, depth + 1)));
    }
    found
}

/// The shared directories of this host: [`scan`] of [`SCAN_ROOTS`] and the
/// [`SPOOL_DIRS`] that exist.
pub fn of_host() -> Vec<PathBuf> {
    let roots: Vec<PathBuf> = SCAN_ROOTS.iter().map(PathBuf::from).collect();
    let mut dirs = scan(&roots);
    let spools: Vec<PathBuf> = SPOOL_DIRS.iter().map(PathBuf::from).collect();
    for spool in real_dirs(&spools) {
        if !dirs.contains(&spool) {
            dirs.push(spool);
        }
    }
    dirs
}

/// The paths that are directories themselves, not symlinks to one (`/var/spool/mail` is
/// often a link to `/var/mail`, listed on its own): removals start from a directory
/// opened without following its last component.
fn real_dirs(paths: &[PathBuf]) -> Vec<PathBuf> {
    paths
        .iter()
        .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir()))
        .cloned()
        .collect()
}

/// The top-level entries of `dirs` owned by `uid`.
pub fn owned_by(dirs: &[PathBuf], uid: u32) -> Vec<PathBuf> {
    let mut owned = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.metadata().is_ok_and(|m| m.uid() == uid) {
                owned.push(entry.path());
            }
        }
    }
    owned
}

/// Removes every top-level entry of `dirs` owned by `uid` (trees included) within
/// `budget`; returns what could not be removed.
pub fn remove_owned(dirs: &[PathBuf], uid: u32, budget: &mut Budget) -> Vec<WipeError> {
    let mut errors = Vec::new();
    for path in owned_by(dirs, uid) {
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            continue;
        };
        if let Err(err) = wipe::remove_entry(dir, name, budget) {
            errors.push(err);
        }
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::path::Path;

    fn chmod(path: &Path, mode: u32) {
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn scan_finds_world_writable_dirs_to_its_depth_and_follows_no_symlink() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        for d in ["a/open", "a/closed/open-but-deep/deeper", "b"] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        chmod(&root, 0o1777);
        chmod(&root.join("a/open"), 0o1777);
        chmod(&root.join("a/closed"), 0o755);
        chmod(&root.join("a/closed/open-but-deep"), 0o777);
        chmod(&root.join("a/closed/open-but-deep/deeper"), 0o777);
        std::os::unix::fs::symlink(root.join("a/open"), root.join("b/link")).unwrap();
        let missing = tmp.path().join("missing");
        let found = scan(&[root.clone(), missing, root.join("a/open")]);
        assert_eq!(
            found,
            vec![root.clone(), root.join("a/open")],
            "depth 2 at most, once each, no symlink"
        );
    }

    #[test]
    fn spools_reached_through_a_symlink_are_left_to_their_real_path() {
        let tmp = tempfile::tempdir().unwrap();
        let mail = tmp.path().join("mail");
        fs::create_dir(&mail).unwrap();
        std::os::unix::fs::symlink(&mail, tmp.path().join("spool-mail")).unwrap();
        let candidates = [
            mail.clone(),
            tmp.path().join("spool-mail"),
            tmp.path().join("none"),
        ];
        assert_eq!(real_dirs(&candidates), vec![mail]);
    }

    #[test]
    fn owned_entries_are_removed_and_others_kept() {
        // Needs root to own files as another uid; skips the ownership part otherwise.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        fs::write(dir.join("mine"), "").unwrap();
        fs::create_dir_all(dir.join("tree/sub")).unwrap();
        fs::write(dir.join("tree/sub/file"), "").unwrap();
        let me = fs::metadata(&dir).unwrap().uid();
        fs::write(dir.join("theirs"), "").unwrap();
        let other = me + 4242;
        let chowned = std::os::unix::fs::chown(dir.join("theirs"), Some(other), None).is_ok();
        let dirs = vec![dir.clone()];
        let mut budget = Budget::new(100, std::time::Duration::from_secs(10));
        if chowned {
            assert!(remove_owned(&dirs, other, &mut budget).is_empty());
            assert!(!dir.join("theirs").exists());
            assert!(dir.join("mine").exists() && dir.join("tree/sub/file").exists());
            assert!(owned_by(&dirs, other).is_empty());
        }
        let mut owned = owned_by(&dirs, me);
        owned.sort();
        assert_eq!(owned, vec![dir.join("mine"), dir.join("tree")]);
        assert!(remove_owned(&dirs, me, &mut budget).is_empty());
        assert!(owned_by(&dirs, me).is_empty());
    }
}
