//! A real nats-server with JetStream, one per test.

use crate::process::{workspace_root, ChildGuard};
use slotpool_local_run as local_run;
use slotpool_protocol::auth::setup::{self, ClusterPlan, SetupFiles, SetupPlan};
use slotpool_protocol::auth::{BusUser, Minter, Role};
use slotpool_protocol::connect::{Bus, NatsOptions};
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

/// A nats-server with JetStream on 127.0.0.1, a free port and a store in its own temp dir,
/// with slotpool's shipped authorisation: its configuration and credentials are written
/// by the same code as `slotpool nats-setup` ([`setup::write`]), so every test runs on an
/// authenticated bus, each party with the permissions it has in production.
///
/// It is killed and reaped on drop, also when the test panics; `PR_SET_PDEATHSIG` kills it
/// when the test process dies. After [`NatsServer::start`] returns, JetStream answers and
/// slotpool's buckets exist (readiness is checked with [`Bus::connect`]). When the test
/// panics, the tail of the server's log is printed.
pub struct NatsServer {
    child: Option<ChildGuard>,
    port: u16,
    dir: TempDir,
    files: SetupFiles,
    /// How clients reach the server besides the URL and credentials: its TLS files, when
    /// started with [`NatsServer::start_with_config`].
    client: NatsOptions,
}

impl NatsServer {
    /// Starts a server on a port it picks itself and waits until JetStream answers.
    pub async fn start() -> NatsServer {
        NatsServer::launch("", NatsOptions::default()).await
    }

    /// Starts a server with `config` added to its configuration (a `tls { }` block, say)
    /// and waits until a client with `client`'s TLS options gets JetStream answers.
    /// Address, port, JetStream and store still come from the command line, which
    /// overrides the file. Later [`NatsServer::options_as`] and [`NatsServer::bus`] use
    /// `client`'s TLS files too, and [`NatsServer::url`] is `tls://` when it has any.
    pub async fn start_with_config(config: &str, client: NatsOptions) -> NatsServer {
        NatsServer::launch(config, client).await
    }

    async fn launch(extra_config: &str, client: NatsOptions) -> NatsServer {
        let dir = tempfile::Builder::new()
            .prefix("slotpool-nats-")
            .tempdir()
            .expect("creating a temp dir for nats-server");
        let files = install(dir.path(), extra_config);
        let (child, port) = spawn(dir.path(), &files.server_config, None).await;
        let server = NatsServer {
            child: Some(child),
            port,
            dir,
            files,
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

    /// Options reaching this server as its launcher (who may do everything).
    pub fn options(&self) -> NatsOptions {
        self.options_as(Role::Launcher, "launcher")
    }

    /// Options reaching this server as `role` `name` (credentials minted on first use).
    pub fn options_as(&self, role: Role, name: &str) -> NatsOptions {
        NatsOptions {
            url: self.url(),
            name: format!("slotpool-test-{role}-{name}"),
            creds: Some(self.creds(role, name)),
            ..self.client.clone()
        }
    }

    /// The credentials file of `role` `name`, minted with the installation's signing
    /// key when it does not exist yet (for an agent, `name` is its backing id).
    pub fn creds(&self, role: Role, name: &str) -> PathBuf {
        creds(self.dir.path(), &self.files, role, name)
    }

    /// The HTTP API token of `role` `name` (see `slotpool http-token`).
    pub fn http_token(&self, role: Role, name: &str) -> String {
        let text = std::fs::read_to_string(self.creds(role, name)).expect("reading credentials");
        slotpool_protocol::auth::http_token::http_token(
            &slotpool_protocol::auth::Credentials::from_text(text),
        )
        .expect("a token of test credentials")
    }

    /// The installation's signing key (for `slotpool serve --agent-signing-key`).
    pub fn signing_key(&self) -> &Path {
        &self.files.signing_key
    }

    /// `--nats <url> --creds <launcher creds> serve --agent-signing-key <key> --config
    /// <config>`: how a `slotpool serve` of this server is started.
    pub fn serve_args(&self, config: &Path) -> Vec<String> {
        serve_args(&self.url(), self.dir.path(), &self.files, config)
    }

    /// `--nats <url> --creds <creds of role name>`.
    pub fn args_as(&self, role: Role, name: &str) -> Vec<String> {
        vec![
            "--nats".into(),
            self.url(),
            "--creds".into(),
            self.creds(role, name).display().to_string(),
        ]
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

    /// Sends `signal` to the server (`SIGSTOP` freezes it with its connections open, as
    /// a stalled server would be; `SIGCONT` lets it go on).
    pub fn signal(&mut self, signal: libc::c_int) {
        if let Some(child) = self.child.as_mut() {
            child.signal(signal);
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
        let (child, port) =
            spawn(self.dir.path(), &self.files.server_config, Some(self.port)).await;
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

/// Writes slotpool's installation for a test bus into `<dir>/auth`, as `slotpool
/// nats-setup` does, with `extra_config` added to the server configuration.
fn install(dir: &Path, extra_config: &str) -> SetupFiles {
    install_with(dir, extra_config, None)
}

/// [`install`], of a cluster's servers too when `cluster` (as `slotpool nats-setup
/// --cluster` writes them).
fn install_with(dir: &Path, extra_config: &str, cluster: Option<ClusterPlan>) -> SetupFiles {
    setup::write(&SetupPlan {
        dir: dir.join("auth"),
        users: vec![
            BusUser::new(Role::Launcher, "launcher").expect("a name"),
            BusUser::new(Role::Operator, "operator").expect("a name"),
            BusUser::new(Role::Client, "client").expect("a name"),
        ],
        extra_config: extra_config.to_string(),
        cluster,
        ..Default::default()
    })
    .expect("writing the test installation")
}

/// The credentials file of `role` `name` in the installation under `dir`, minted with
/// its signing key when it does not exist yet.
fn creds(dir: &Path, files: &SetupFiles, role: Role, name: &str) -> PathBuf {
    let user = BusUser::new(role, name).expect("a user name token");
    let path = setup::creds_path(&dir.join("auth"), &user);
    if !path.exists() {
        Minter::load(&files.signing_key)
            .and_then(|m| m.mint(&user, None))
            .and_then(|c| c.write_private(&path))
            .unwrap_or_else(|err| panic!("minting test credentials for {user}: {err}"));
    }
    path
}

/// `--nats <url> --creds <launcher creds> serve --agent-signing-key <key> --config <config>`.
fn serve_args(url: &str, dir: &Path, files: &SetupFiles, config: &Path) -> Vec<String> {
    vec![
        "--nats".into(),
        url.to_string(),
        "--creds".into(),
        creds(dir, files, Role::Launcher, "launcher")
            .display()
            .to_string(),
        "serve".into(),
        "--agent-signing-key".into(),
        files.signing_key.display().to_string(),
        "--config".into(),
        config.display().to_string(),
    ]
}

/// A JetStream cluster of servers on 127.0.0.1, each with its own name (`n1`, `n2`…),
/// client port, route port, store and log under one temp dir, all with the same
/// installation as [`NatsServer`]'s. Every server is killed and reaped on drop.
///
/// After [`NatsCluster::start`] returns, JetStream answers and slotpool's buckets exist
/// with one replica per server.
pub struct NatsCluster {
    dir: TempDir,
    files: SetupFiles,
    servers: Vec<ClusterServer>,
}

struct ClusterServer {
    name: String,
    /// The server's own dir: its store (`js/`), ports file and log.
    dir: PathBuf,
    config: PathBuf,
    /// Its client port, chosen before the first start and kept for restarts.
    port: Option<u16>,
    child: Option<ChildGuard>,
}

impl NatsCluster {
    /// Starts `size` servers routed to each other and waits until a launcher can create
    /// slotpool's buckets with `size` replicas.
    pub async fn start(size: usize) -> NatsCluster {
        let dir = tempfile::Builder::new()
            .prefix("slotpool-cluster-")
            .tempdir()
            .expect("creating a temp dir for the cluster");
        // The servers' configurations are `slotpool nats-setup --cluster`'s, on ports free
        // now (every server must know the others' route ports before any starts).
        let ports = free_ports(2 * size);
        let (client_ports, route_ports) = ports.split_at(size);
        let plan = ClusterPlan {
            name: "slotpool-test".into(),
            servers: (0..size)
                .map(|i| setup::ClusterServer {
                    name: format!("n{}", i + 1),
                    listen: format!("127.0.0.1:{}", client_ports[i]),
                    route: format!("127.0.0.1:{}", route_ports[i]),
                })
                .collect(),
            extra_config: String::new(),
        };
        let files = install_with(dir.path(), "", Some(plan.clone()));
        let servers = plan
            .servers
            .iter()
            .zip(&files.server_configs)
            .zip(client_ports)
            .map(|((server, config), port)| {
                let server_dir = dir.path().join(&server.name);
                std::fs::create_dir_all(&server_dir).expect("creating a server dir");
                ClusterServer {
                    name: server.name.clone(),
                    dir: server_dir,
                    config: config.clone(),
                    port: Some(*port),
                    child: None,
                }
            })
            .collect();
        let mut cluster = NatsCluster {
            dir,
            files,
            servers,
        };
        for i in 0..size {
            cluster.spawn(i).await;
        }
        cluster.wait_ready().await;
        cluster
    }

    async fn spawn(&mut self, i: usize) {
        let server = &mut self.servers[i];
        let (child, port) = spawn(&server.dir, &server.config, server.port).await;
        server.port = Some(port);
        server.child = Some(child);
    }

    async fn wait_ready(&self) {
        let opts = self.options();
        let replicas = self.servers.len();
        // A cluster elects its JetStream leaders first: allow for that too.
        let deadline = Instant::now() + NATS_START_TIMEOUT * 2;
        loop {
            let last_error =
                match tokio::time::timeout_at(deadline, Bus::connect_replicated(&opts, replicas))
                    .await
                {
                    Ok(Ok(_bus)) => return,
                    Ok(Err(err)) => err.to_string(),
                    Err(_) => "connect attempt still pending at the deadline".into(),
                };
            if Instant::now() >= deadline {
                panic!(
                    "the nats cluster at {} did not take R{replicas} buckets: {last_error}\n{}",
                    self.url(),
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The names of the servers, `n1`…
    pub fn names(&self) -> Vec<String> {
        self.servers.iter().map(|s| s.name.clone()).collect()
    }

    fn index(&self, name: &str) -> usize {
        self.servers
            .iter()
            .position(|s| s.name == name)
            .unwrap_or_else(|| panic!("no server {name} in the cluster"))
    }

    /// The name of the server listening on client port `port`.
    pub fn name_of_port(&self, port: u16) -> Option<String> {
        self.servers
            .iter()
            .find(|s| s.port == Some(port))
            .map(|s| s.name.clone())
    }

    /// The server that process `pid` has a client connection to (the first found), read
    /// from its sockets in `/proc`.
    pub fn server_of(&self, pid: u32) -> Option<String> {
        let inodes: std::collections::HashSet<String> =
            std::fs::read_dir(format!("/proc/{pid}/fd"))
                .ok()?
                .flatten()
                .filter_map(|fd| {
                    let link = std::fs::read_link(fd.path()).ok()?;
                    let link = link.to_string_lossy();
                    Some(
                        link.strip_prefix("socket:[")?
                            .strip_suffix(']')?
                            .to_string(),
                    )
                })
                .collect();
        let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).ok()?;
        table.lines().skip(1).find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (remote, inode) = (fields.get(2)?, fields.get(9)?);
            if !inodes.contains(*inode) {
                return None;
            }
            let port = u16::from_str_radix(remote.rsplit_once(':')?.1, 16).ok()?;
            self.name_of_port(port)
        })
    }

    /// The client ports of the servers.
    pub fn ports(&self) -> Vec<u16> {
        self.servers.iter().filter_map(|s| s.port).collect()
    }

    /// Every server's URL, comma-separated, as a client that may use any of them gets it.
    pub fn url(&self) -> String {
        self.ports()
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Options reaching the cluster as its launcher.
    pub fn options(&self) -> NatsOptions {
        NatsOptions {
            url: self.url(),
            name: "slotpool-test-launcher".into(),
            creds: Some(creds(
                self.dir.path(),
                &self.files,
                Role::Launcher,
                "launcher",
            )),
            ..Default::default()
        }
    }

    /// Options reaching the cluster as `role` `name`.
    pub fn options_as(&self, role: Role, name: &str) -> NatsOptions {
        NatsOptions {
            url: self.url(),
            name: format!("slotpool-test-{role}-{name}"),
            creds: Some(creds(self.dir.path(), &self.files, role, name)),
            ..Default::default()
        }
    }

    /// How a `slotpool serve` of this cluster is started (see [`NatsServer::serve_args`]).
    pub fn serve_args(&self, config: &Path) -> Vec<String> {
        serve_args(&self.url(), self.dir.path(), &self.files, config)
    }

    /// A new launcher connection to the cluster (panics if it fails).
    pub async fn bus(&self) -> Bus {
        Bus::connect_replicated(&self.options(), self.servers.len())
            .await
            .unwrap_or_else(|err| panic!("connecting to the test cluster at {}: {err}", self.url()))
    }

    /// Kills server `name` with SIGKILL, as a crash would; its port and store are kept
    /// for [`NatsCluster::resume`].
    pub fn crash(&mut self, name: &str) {
        let i = self.index(name);
        if let Some(mut child) = self.servers[i].child.take() {
            child.kill();
        }
    }

    /// Starts crashed server `name` again on its port with its store (it rejoins the
    /// cluster and catches up by itself).
    pub async fn resume(&mut self, name: &str) {
        let i = self.index(name);
        assert!(
            self.servers[i].child.is_none(),
            "resume: server {name} is still running"
        );
        self.spawn(i).await;
    }

    /// The last lines of every server's log, for failure messages.
    pub fn logs(&self) -> String {
        self.servers.iter().map(|s| log_tail(&s.dir)).collect()
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for server in &mut self.servers {
            if let Some(mut child) = server.child.take() {
                child.kill();
            }
        }
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
    }
}

/// `n` distinct ports free on 127.0.0.1 now (for a cluster's routes, which every server
/// must know before any starts). Another process could take one in between; the server
/// then fails to start and says so.
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("binding a free port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("a bound address").port())
        .collect()
}

/// Spawns the server in `dir` on `port` (`None` = any free port) and waits for the ports
/// file that tells which port it took.
async fn spawn(dir: &Path, config: &Path, port: Option<u16>) -> (ChildGuard, u16) {
    let binary = nats_server_binary();
    let cmd = local_run::server_command(binary, dir, Some(config), port)
        .unwrap_or_else(|err| panic!("preparing {}: {err}", binary.display()));
    let mut child = ChildGuard::spawn("nats-server", cmd)
        .unwrap_or_else(|err| panic!("starting {}: {err}", binary.display()));

    // The server writes its ports file once it listens.
    let pid = child.id();
    let deadline = Instant::now() + NATS_START_TIMEOUT;
    loop {
        if let Some(port) = local_run::listening_port(dir, pid) {
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
                "nats-server wrote no ports file within {NATS_START_TIMEOUT:?}\n{}",
                log_tail(dir)
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The client port from a ports file such as `{"nats":["nats://127.0.0.1:40123"]}`;
/// `None` until the file is complete.
/// The last lines of the server's log, for failure messages.
fn log_tail(dir: &Path) -> String {
    const LINES: usize = 40;
    let path = local_run::log_path(dir);
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
