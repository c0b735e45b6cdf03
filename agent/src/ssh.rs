//! What the agent tells launchers about logging in to its slots: the sshd port and the
//! host's public host keys (`<dir>/ssh_host_*_key.pub`), reported in every heartbeat and
//! copied onto each prepared node so clients can pin them.

use std::path::Path;

/// The SSH facts of this host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SshInfo {
    pub port: u16,
    /// One `<type> <base64>` line per host key, sorted; comments dropped.
    pub host_keys: Vec<String>,
}

/// `<type> <base64>` of a public key line, without its comment.
pub fn key_without_comment(line: &str) -> Option<String> {
    let mut parts = line.split_whitespace();
    let kind = parts.next()?;
    let blob = parts.next()?;
    Some(format!("{kind} {blob}"))
}

/// The host public keys in `dir` (`ssh_host_*_key.pub`); unreadable files are skipped
/// with a warning, a missing directory gives none.
pub fn read_host_keys(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        tracing::warn!(dir = %dir.display(), "no ssh host keys to report: cannot read the directory");
        return Vec::new();
    };
    let mut keys: Vec<String> = entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("ssh_host_") && name.ends_with("_key.pub")
        })
        .filter_map(|e| match std::fs::read_to_string(e.path()) {
            Ok(text) => text.lines().find_map(key_without_comment),
            Err(err) => {
                tracing::warn!(path = %e.path().display(), %err, "cannot read ssh host key");
                None
            }
        })
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_public_host_keys_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("ssh_host_ed25519_key.pub"),
            "ssh-ed25519 AAAAC3Nz root@host\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("ssh_host_ed25519_key"), "PRIVATE").unwrap();
        std::fs::write(
            dir.path().join("ssh_host_rsa_key.pub"),
            "ssh-rsa AAAAB3 x\n",
        )
        .unwrap();
        assert_eq!(
            read_host_keys(dir.path()),
            vec!["ssh-ed25519 AAAAC3Nz", "ssh-rsa AAAAB3"]
        );
        assert!(read_host_keys(&dir.path().join("missing")).is_empty());
    }
}
