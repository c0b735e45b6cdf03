//! Namespace files bound on paths (a slot's network, user, mount and IPC namespaces
//! kept by a bind mount): telling one from the empty mount point a failed set-up
//! leaves, and opening one.

use rustix::fd::OwnedFd;
use std::path::Path;

/// `statfs` type of the namespace file system.
const NSFS_MAGIC: rustix::fs::FsWord = 0x6e73_6673;

/// Opens the namespace file `path`, refusing anything that is not one (an empty mount
/// point left by a failed set-up). The error reads `opening <path>: <why>`.
pub fn open(path: &Path) -> Result<OwnedFd, (String, String)> {
    let action = || format!("opening {}", path.display());
    let fd = rustix::fs::open(
        path,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| (action(), e.to_string()))?;
    if !rustix::fs::fstatfs(&fd).is_ok_and(|s| s.f_type == NSFS_MAGIC) {
        return Err((action(), "not a namespace".into()));
    }
    Ok(fd)
}

/// Whether `path` is a namespace file (bound there), not an empty mount point.
pub fn is_bound(path: &Path) -> bool {
    rustix::fs::statfs(path).is_ok_and(|s| s.f_type == NSFS_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_file_opens_and_a_plain_file_does_not() {
        let own = Path::new("/proc/self/ns/net");
        assert!(is_bound(own));
        assert!(open(own).is_ok());
        let dir = std::env::temp_dir().join(format!("nsfs-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plain = dir.join("net");
        std::fs::write(&plain, "").unwrap();
        let refused = open(&plain);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(!is_bound(&plain));
        let (action, why) = refused.unwrap_err();
        assert_eq!(
            (action, why),
            (
                format!("opening {}", plain.display()),
                "not a namespace".into()
            )
        );
    }
}
