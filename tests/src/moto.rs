//! moto's server mode: an EC2 API (the query protocol, as AWS serves it) on a free
//! loopback port, one server and one state per test, for the EC2 provider's tests.
//!
//! The binary comes from `$SLOTPOOL_MOTO_SERVER`, or else from `scripts/moto-server.sh`,
//! which installs the pinned `moto[server]` into a venv of its own under `.tools/moto`.
//! When neither works the tests fail with the script's message; they never skip.

use crate::process::{workspace_root, ChildGuard};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;
use tempfile::TempDir;
use tokio::time::Instant;

/// How long moto may take from spawn until it listens (it imports every service's
/// models at start: seconds on a busy machine).
pub const MOTO_START_TIMEOUT: Duration = Duration::from_secs(60);

/// The moto_server binary the tests use.
pub fn moto_server_binary() -> &'static Path {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BINARY.get_or_init(find_binary) {
        Ok(path) => path,
        Err(message) => panic!("{message}"),
    }
}

fn find_binary() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("SLOTPOOL_MOTO_SERVER").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    let script = workspace_root().join("scripts").join("moto-server.sh");
    let out = Command::new(&script)
        .stdin(Stdio::null())
        .output()
        .map_err(|err| {
            format!(
                "no moto_server for the tests: running {}: {err}",
                script.display()
            )
        })?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!(
            "no moto_server for the tests: {} failed ({}):\n{stderr}",
            script.display(),
            out.status
        ));
    }
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !path.is_file() {
        return Err(format!(
            "no moto_server for the tests: {} printed {path:?}, which is not a file\n{stderr}",
            script.display()
        ));
    }
    Ok(path)
}

/// A moto server on 127.0.0.1 and a port of its own, with a state of its own; killed on
/// drop (and with the test process, `PR_SET_PDEATHSIG`). Its log is printed when the test
/// panics.
pub struct Moto {
    _child: ChildGuard,
    port: u16,
    dir: TempDir,
}

impl Moto {
    pub async fn start() -> Moto {
        let dir = TempDir::new().expect("temp dir for moto");
        let log = dir.path().join("moto.log");
        let mut cmd = Command::new(moto_server_binary());
        cmd.args(["-H", "127.0.0.1", "-p", "0"])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).expect("moto log"))
            .stderr(std::fs::File::create(dir.path().join("moto.err")).expect("moto log"));
        let mut child = ChildGuard::spawn("moto_server", cmd).expect("starting moto_server");
        let deadline = Instant::now() + MOTO_START_TIMEOUT;
        let port = loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default()
                + &std::fs::read_to_string(dir.path().join("moto.err")).unwrap_or_default();
            if let Some(port) = listening_port(&text) {
                break port;
            }
            if let Some(status) = child.try_wait() {
                panic!("moto_server exited ({status}) before it listened:\n{text}");
            }
            assert!(
                Instant::now() < deadline,
                "moto_server did not listen within {MOTO_START_TIMEOUT:?}:\n{text}"
            );
            tokio::time::sleep(crate::POLL_INTERVAL).await;
        };
        Moto {
            _child: child,
            port,
            dir,
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The endpoint URL to point an EC2 client at.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The environment an AWS SDK needs to talk to this server (moto takes any keys).
    pub fn aws_env() -> [(&'static str, &'static str); 4] {
        [
            ("AWS_ACCESS_KEY_ID", "testing"),
            ("AWS_SECRET_ACCESS_KEY", "testing"),
            ("AWS_SESSION_TOKEN", "testing"),
            // No instance metadata service is asked for credentials or a region.
            ("AWS_EC2_METADATA_DISABLED", "true"),
        ]
    }
}

/// The port of werkzeug's "Running on http://127.0.0.1:PORT" line.
fn listening_port(log: &str) -> Option<u16> {
    let at = log.find("Running on http://127.0.0.1:")?;
    let rest = &log[at + "Running on http://127.0.0.1:".len()..];
    rest.chars()
        .take_while(|c| c.is_ascii_digit())
        .collect::<String>()
        .parse()
        .ok()
}

impl Drop for Moto {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text =
                std::fs::read_to_string(self.dir.path().join("moto.err")).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            eprintln!(
                "--- moto_server log (last 40 lines)\n{}",
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_port_is_read_from_the_log() {
        let log = "WARNING: dev server\n * Running on http://127.0.0.1:40123\nPress CTRL+C";
        assert_eq!(super::listening_port(log), Some(40123));
        assert_eq!(super::listening_port("starting"), None);
    }
}
