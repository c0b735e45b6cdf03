//! A real nats-server with JetStream, one per test.

use crate::process::{workspace_root, ChildGuard};
use slotpool_protocol::connect::{Bus, NatsOptions};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;
use tempfile::TempDir;
use tokio::time::Instant;

/// How long a server may take from spawn until JetStream answers. Generous: CI machines
/// have two cores shared by parallel tests.
pub const NATS_START_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a stopped server gets to shut down cleanly before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// The nats-server binary the tests use: `$SLOTPOOL_NATS_SERVER`, or else whatever
/// `scripts/nats-server.sh` prints (it provisions one if needed). The script runs once per
/// test process. Panics with the script's message when no binary can be had.
pub fn nats_server_binary() -> &'static Path {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BINARY.get_or_init(find_binary) {
        Ok(path) => path,
        Err(message) => panic!("{message}"),
    }
}

fn find_binary() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("SLOTPOOL_NATS_SERVER").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    let script = workspace_root().join("scripts").join("nats-server.sh");
    let out = Command::new(&script)
        .stdin(Stdio::null())
        .output()
        .map_err(|err| {
            format!(
                "no nats-server for the tests: running {}: {err}",
                script.display()
            )
        })?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!(
            "no nats-server for the tests: {} failed ({}):\n{stderr}\n\
             set SLOTPOOL_NATS_SERVER to a nats-server >= 2.11, or fix what the script asks for",
            script.display(),
            out.status
        ));
    }
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !path.is_file() {
        return Err(format!(
            "no nats-server for the tests: {} printed {:?}, which is not a file\n{stderr}",
            script.display(),
            path
        ));
    }
    Ok(path)
}

/// The config file [`NatsServer::start_with_config`] writes, in the server's temp dir.
const CONFIG_FILE: &str = "nats-server.conf";

/// A nats-server with JetStream on 127.0.0.1, a free port and a store in its own temp dir.
///
/// It is killed and reaped on drop, also when the test panics; `PR_SET_PDEATHSIG` kills it
/// when the test process dies. After [`NatsServer::start`] returns, JetStream answers and
/// slotpool's buckets exist (readiness is checked with [`Bus::connect`]). When the test
/// panics, the tail of the server's log is printed.
pub struct NatsServer {
    child: Option<ChildGuard>,
    port: u16,
    dir: TempDir,
    /// The config file given with `-c`, if any.
    config: Option<PathBuf>,
    /// How clients reach the server, all but the URL (see [`NatsServer::options`]).
    client: NatsOptions,
}

impl NatsServer {
    /// Starts a server on a port it picks itself and waits until JetStream answers.
    pub async fn start() -> NatsServer {
        NatsServer::launch(None, NatsOptions::default()).await
    }

    /// Starts a server with `config` as its config file (a `tls { }` block, say) and waits
    /// until a client with `client`'s options gets JetStream answers. Address, port,
    /// JetStream and store still come from the command line, which overrides the file.
    /// `client.url` is ignored: the server's own goes in its place, `tls://` when `client`
    /// has a CA or a certificate (see [`NatsServer::url`]). Later [`NatsServer::options`]
    /// and [`NatsServer::bus`] use `client` too.
    pub async fn start_with_config(config: &str, client: NatsOptions) -> NatsServer {
        NatsServer::launch(Some(config), client).await
    }

    async fn launch(config: Option<&str>, client: NatsOptions) -> NatsServer {
        let dir = tempfile::Builder::new()
            .prefix("slotpool-nats-")
            .tempdir()
            .expect("creating a temp dir for nats-server");
        let config = config.map(|text| {
            let path = dir.path().join(CONFIG_FILE);
            std::fs::write(&path, text)
                .unwrap_or_else(|err| panic!("writing {}: {err}", path.display()));
            path
        });
        let (child, port) = spawn(dir.path(), None, config.as_deref()).await;
        let server = NatsServer {
            child: Some(child),
            port,
            dir,
            config,
            client,
        };
        server.wait_ready().await;
        server
    }

    /// `nats://127.0.0.1:<port>`, or `tls://127.0.0.1:<port>` when the server was started
    /// for TLS clients (see [`NatsServer::start_with_config`]).
    pub fn url(&self) -> String {
        let tls = self.client.tls_ca.is_some() || self.client.tls_cert.is_some();
        let scheme = if tls { "tls" } else { "nats" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Options reaching this server (with the client's TLS files and credentials, if it
    /// was started with [`NatsServer::start_with_config`]).
    pub fn options(&self) -> NatsOptions {
        NatsOptions {
            url: self.url(),
            name: if self.client.name.is_empty() {
                "slotpool-test".into()
            } else {
                self.client.name.clone()
            },
            ..self.client.clone()
        }
    }

    /// A new connection to this server (panics if it fails).
    pub async fn bus(&self) -> Bus {
        Bus::connect(&self.options()).await.unwrap_or_else(|err| {
            panic!(
                "connecting to the test nats-server at {}: {err}",
                self.url()
            )
        })
    }

    /// The server's temp dir (store in `js/`, log in `nats-server.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Whether the server process is running (it may be stopped by [`NatsServer::stop`]).
    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| c.try_wait().is_none())
    }

    /// Shuts the server down cleanly (SIGTERM; SIGKILL if it lingers). The port and the
    /// store are kept for [`NatsServer::resume`].
    pub async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.terminate(STOP_GRACE).await;
        }
    }

    /// Kills the server with SIGKILL, as a crash would. The port and the store are kept
    /// for [`NatsServer::resume`].
    pub fn crash(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill();
        }
    }

    /// Starts a stopped server again on the same port with the same store, and waits until
    /// JetStream answers. Connected clients reconnect by themselves.
    pub async fn resume(&mut self) {
        assert!(
            self.child.is_none(),
            "resume: the nats-server is still running"
        );
        let (child, port) = spawn(self.dir.path(), Some(self.port), self.config.as_deref()).await;
        assert_eq!(port, self.port, "restarted nats-server took another port");
        self.child = Some(child);
        self.wait_ready().await;
    }

    /// [`NatsServer::stop`] then [`NatsServer::resume`].
    pub async fn restart(&mut self) {
        self.stop().await;
        self.resume().await;
    }

    async fn wait_ready(&self) {
        let deadline = Instant::now() + NATS_START_TIMEOUT;
        let opts = self.options();
        let mut last_error;
        loop {
            match tokio::time::timeout_at(deadline, Bus::connect(&opts)).await {
                Ok(Ok(_bus)) => return,
                Ok(Err(err)) => last_error = err.to_string(),
                Err(_) => last_error = "connect attempt still pending at the deadline".into(),
            }
            if Instant::now() >= deadline {
                panic!(
                    "nats-server at {} did not answer JetStream within {NATS_START_TIMEOUT:?}: \
                     {last_error}\n{}",
                    self.url(),
                    log_tail(self.dir.path())
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill();
        }
        if std::thread::panicking() {
            eprintln!("{}", log_tail(self.dir.path()));
        }
    }
}

/// Spawns the server in `dir` on `port` (`None` = any free port), with the config file
/// `config` if given, and waits for the ports file that tells which port it took.
async fn spawn(dir: &Path, port: Option<u16>, config: Option<&Path>) -> (ChildGuard, u16) {
    let binary = nats_server_binary();
    let log = File::options()
        .create(true)
        .append(true)
        .open(dir.join("nats-server.log"))
        .expect("creating the nats-server log");
    let mut cmd = Command::new(binary);
    if let Some(config) = config {
        cmd.arg("-c").arg(config);
    }
    cmd.arg("-a")
        .arg("127.0.0.1")
        .arg("-p")
        .arg(port.map_or("-1".to_string(), |p| p.to_string()))
        .arg("-js")
        .arg("-sd")
        .arg(dir.join("js"))
        .arg("--ports_file_dir")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("cloning the log file handle"))
        .stderr(log);
    let mut child = ChildGuard::spawn("nats-server", cmd)
        .unwrap_or_else(|err| panic!("starting {}: {err}", binary.display()));

    // The server writes nats-server_<pid>.ports once it listens.
    let ports_file = dir.join(format!("nats-server_{}.ports", child.id()));
    let deadline = Instant::now() + NATS_START_TIMEOUT;
    loop {
        if let Some(port) = read_client_port(&ports_file) {
            return (child, port);
        }
        if let Some(status) = child.try_wait() {
            panic!(
                "nats-server exited during start-up ({status})\n{}",
                log_tail(dir)
            );
        }
        if Instant::now() >= deadline {
            panic!(
                "nats-server wrote no ports file {} within {NATS_START_TIMEOUT:?}\n{}",
                ports_file.display(),
                log_tail(dir)
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The client port from a ports file such as `{"nats":["nats://127.0.0.1:40123"]}`;
/// `None` until the file is complete.
fn read_client_port(path: &Path) -> Option<u16> {
    let text = std::fs::read_to_string(path).ok()?;
    let ports: serde_json::Value = serde_json::from_str(&text).ok()?;
    let url = ports.get("nats")?.get(0)?.as_str()?;
    url.rsplit(':').next()?.parse().ok()
}

/// The last lines of the server's log, for failure messages.
fn log_tail(dir: &Path) -> String {
    const LINES: usize = 40;
    let path = dir.join("nats-server.log");
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            let start = lines.len().saturating_sub(LINES);
            format!(
                "--- last lines of {} ---\n{}",
                path.display(),
                lines[start..].join("\n")
            )
        }
        Err(err) => format!("(no nats-server log at {}: {err})", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_client_port() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.ports");
        assert_eq!(read_client_port(&path), None);
        std::fs::write(&path, r#"{"nats":["nats://127.0.0.1:40"#).unwrap();
        assert_eq!(read_client_port(&path), None);
        std::fs::write(
            &path,
            r#"{"nats":["nats://127.0.0.1:40123"],"monitoring":["http://127.0.0.1:8222"]}"#,
        )
        .unwrap();
        assert_eq!(read_client_port(&path), Some(40123));
    }
}
