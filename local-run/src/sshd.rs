//! A private sshd on loopback that logs slot users in as a backing node's sshd does,
//! through the drop-in slotpool ships (`packaging/etc/sshd/slotpool-slots.conf`, built
//! in here so that what runs is what ships), and an ssh client key to log in with: the
//! SSH path the benchmark measures beside `slotpool exec`, and the tests' sshd.
//!
//! Only the files and the command lines are made here; the caller spawns sshd the way
//! it keeps its processes and waits until [`SshdFiles::port`] accepts connections.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Where Debian's openssh-server puts sshd.
pub const SSHD: &str = "/usr/sbin/sshd";

/// The sshd drop-in slotpool ships for slot logins.
pub const SHIPPED_DROP_IN: &str = include_str!("../../packaging/etc/sshd/slotpool-slots.conf");

/// The user pattern and login command of [`SHIPPED_DROP_IN`], which
/// [`slot_match_block`] replaces.
const SHIPPED_MATCH: &str = "Match User sp*";
const SHIPPED_LOGIN: &str = "/usr/bin/slotpool-agent enter-slot";

/// Why sshd's files or the client key could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SshdError {
    #[error("{SSHD} is missing: install openssh-server")]
    Missing,
    #[error(
        "the shipped sshd drop-in no longer has the lines replaced here \
         ({SHIPPED_MATCH:?}, {SHIPPED_LOGIN:?})"
    )]
    DropIn,
    #[error("running {command}: {source}")]
    Spawn { command: String, source: io::Error },
    #[error("{command} failed: {output}")]
    Failed { command: String, output: String },
    #[error("{what} {path}: {source}")]
    Files {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

fn files_error(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> SshdError {
    let path = path.to_path_buf();
    move |source| SshdError::Files { what, path, source }
}

/// The shipped drop-in's `Match` block for users starting with `prefix`, whose logins
/// run `login_command` instead of `/usr/bin/slotpool-agent enter-slot`.
pub fn slot_match_block(prefix: &str, login_command: &str) -> Result<String, SshdError> {
    if !SHIPPED_DROP_IN.contains(SHIPPED_MATCH) || !SHIPPED_DROP_IN.contains(SHIPPED_LOGIN) {
        return Err(SshdError::DropIn);
    }
    Ok(SHIPPED_DROP_IN
        .replace(SHIPPED_MATCH, &format!("Match User {prefix}*"))
        .replace(SHIPPED_LOGIN, login_command))
}

/// Runs `ssh-keygen` for a new ed25519 key without passphrase at `path`.
fn keygen(path: &Path, comment: &str) -> Result<(), SshdError> {
    let mut cmd = Command::new("ssh-keygen");
    cmd.args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
        .arg(path)
        .stdin(Stdio::null());
    run(&mut cmd)
}

fn run(cmd: &mut Command) -> Result<(), SshdError> {
    let command = format!("{cmd:?}");
    let out = cmd.output().map_err(|source| SshdError::Spawn {
        command: command.clone(),
        source,
    })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(SshdError::Failed {
            command,
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        })
    }
}

/// A port that was free a moment ago.
fn free_port() -> Result<u16, SshdError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(files_error(
            "binding a free port on",
            Path::new("127.0.0.1"),
        ))
}

/// The files of a private sshd in one directory: its host key and its `sshd_config`,
/// which listens on 127.0.0.1 only, lets in the users of one prefix with their keys
/// alone, and logs them in through the shipped drop-in.
#[derive(Clone, Debug)]
pub struct SshdFiles {
    pub port: u16,
    pub dir: PathBuf,
}

impl SshdFiles {
    /// Writes them in `dir` (which must exist) for users named `<user_prefix>…`,
    /// whose logins run `login_command` (`<agent> enter-slot [--run-dir DIR]`; the
    /// binary must be one slot users may run). Picks a free port.
    pub fn write(
        dir: &Path,
        user_prefix: &str,
        login_command: &str,
    ) -> Result<SshdFiles, SshdError> {
        if !Path::new(SSHD).is_file() {
            return Err(SshdError::Missing);
        }
        let files = SshdFiles {
            port: free_port()?,
            dir: dir.to_path_buf(),
        };
        let key = dir.join("ssh_host_ed25519_key");
        keygen(&key, "slotpool-local")?;
        // sshd insists on its privilege separation directory.
        let privsep = Path::new("/run/sshd");
        std::fs::create_dir_all(privsep).map_err(files_error("creating", privsep))?;
        let config = files.config();
        std::fs::write(
            &config,
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {key}\nPidFile {pid}\n\
                 UsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n\
                 PubkeyAuthentication yes\nAuthorizedKeysFile .ssh/authorized_keys\n\
                 StrictModes yes\nAllowUsers {user_prefix}*\nLogLevel VERBOSE\n{slots}",
                port = files.port,
                key = key.display(),
                pid = dir.join("sshd.pid").display(),
                slots = slot_match_block(user_prefix, login_command)?,
            ),
        )
        .map_err(files_error("writing", &config))?;
        Ok(files)
    }

    /// The `sshd_config` it runs with.
    pub fn config(&self) -> PathBuf {
        self.dir.join("sshd_config")
    }

    /// Where [`SshdFiles::arguments`] has sshd write its log.
    pub fn log(&self) -> PathBuf {
        self.dir.join("sshd.log")
    }

    /// `cmd` (sshd, or a program that runs it) made to run sshd in the foreground with
    /// this config, its log in [`SshdFiles::log`].
    pub fn arguments(&self, cmd: &mut Command) -> Result<(), SshdError> {
        let log = self.log();
        let log = std::fs::File::create(&log).map_err(files_error("creating", &log))?;
        cmd.arg("-D")
            .arg("-e")
            .arg("-f")
            .arg(self.config())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        Ok(())
    }
}

/// An ssh client key pair (`id`, `id.pub`) in a directory.
#[derive(Clone, Debug)]
pub struct ClientKey {
    pub dir: PathBuf,
}

impl ClientKey {
    /// Makes a new key pair in `dir` (which must exist).
    pub fn generate(dir: &Path) -> Result<ClientKey, SshdError> {
        keygen(&dir.join("id"), "requester")?;
        Ok(ClientKey {
            dir: dir.to_path_buf(),
        })
    }

    /// The public key, one line, for a submission's `ssh_public_key`.
    pub fn public(&self) -> Result<String, SshdError> {
        let path = self.dir.join("id.pub");
        std::fs::read_to_string(&path)
            .map(|k| k.trim().to_string())
            .map_err(files_error("reading", &path))
    }

    /// `ssh` with this key to `user` on 127.0.0.1:`port`, non-interactive, trusting any
    /// host key; the caller adds what to do (a command, `-N -L …`).
    pub fn command(&self, port: u16, user: &str) -> Command {
        let mut cmd = Command::new("ssh");
        cmd.args([
            "-F",
            "/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "ConnectTimeout=10",
            "-i",
        ])
        .arg(self.dir.join("id"))
        .args(["-p", &port.to_string(), &format!("{user}@127.0.0.1")])
        .stdin(Stdio::null());
        cmd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_match_block_is_the_shipped_one_with_the_prefix_and_command_given() {
        let block = slot_match_block("sptx", "/opt/agent enter-slot --run-dir /r").unwrap();
        assert!(block.contains("Match User sptx*\n"), "{block}");
        assert!(block.contains("ForceCommand /opt/agent enter-slot --run-dir /r\n"));
        assert!(!block.contains("/usr/bin/slotpool-agent"));
        assert_eq!(
            block.lines().count(),
            SHIPPED_DROP_IN.lines().count(),
            "only the two lines change"
        );
    }
}
