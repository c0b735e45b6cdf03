//! A whole pool for end-to-end tests: a nats-server, `slotpool serve` processes on a
//! generated config with the local provider, and a client. Local agents are real
//! `slotpool-agent` processes; they are killed (by their pid files) when the pool drops.

use crate::nats::NatsServer;
use crate::process::{bin_path, ChildGuard};
use slotpool_protocol::api::Released;
use slotpool_protocol::client::{submission, Client};
use slotpool_protocol::model::{BackingNode, BackingState, Node, NodeRequest, RequestState};
use slotpool_protocol::{NodeId, RequestId};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use tempfile::TempDir;

/// Agents in tests heartbeat fast so a dead one is noticed quickly. They run without
/// isolation unless a test asks for it ([`Pool::start_with`]): the isolation tests create
/// users and cgroups with names of their own and clean them up ([`crate::IsolationEnv`]).
/// How long a test waits for a release to finish in the background.
const RELEASE_WAIT: Duration = Duration::from_secs(30);

pub const AGENT_ARGS: [&str; 6] = [
    "--heartbeat-interval-ms",
    "300",
    "--heartbeat-ttl-secs",
    "2",
    "--isolation",
    "none",
];

pub struct Pool {
    pub nats: NatsServer,
    pub client: Client,
    dir: TempDir,
    config: PathBuf,
    launchers: Vec<ChildGuard>,
    /// Arguments each launcher gets after the usual ones ([`Pool::start_serving_with`]).
    serve_extra: Vec<String>,
}

/// A launcher config with the local provider, [`AGENT_ARGS`] and `labels`.
pub fn config_yaml(work_dir: &Path, max_servers: u32, lease_ttl: u32, labels: &str) -> String {
    config_yaml_with(work_dir, max_servers, lease_ttl, labels, &AGENT_ARGS)
}

/// A launcher config with the local provider, the given agent args and `labels`.
pub fn config_yaml_with(
    work_dir: &Path,
    max_servers: u32,
    lease_ttl: u32,
    labels: &str,
    agent_args: &[&str],
) -> String {
    let agent_args = serde_json::to_string(agent_args).expect("args serialize");
    format!(
        "launcher:\n  lease-ttl: {lease_ttl}\nproviders:\n  - name: local\n    driver: local\n    local:\n      work-dir: {}\n      agent-args: {agent_args}\n    pools:\n      - name: main\n        max-servers: {max_servers}\n        boot-timeout: 20\n        labels:\n{labels}",
        work_dir.display()
    )
}

/// One label entry (indented for [`config_yaml`]).
pub fn label(name: &str, slots: u32, grace: u32, extra: &[&str]) -> String {
    let mut s = format!("          - name: {name}\n            backing-label: vm\n            max-parallel-jobs: {slots}\n            grace-time: {grace}\n");
    for e in extra {
        s.push_str(&format!("            {e}\n"));
    }
    s
}

impl Pool {
    /// Starts a nats-server and `launchers` launcher processes on a config with `labels`.
    pub async fn start(max_servers: u32, lease_ttl: u32, labels: &str, launchers: usize) -> Pool {
        Pool::start_with(max_servers, lease_ttl, labels, launchers, &AGENT_ARGS).await
    }

    /// [`Pool::start`] with the agents' arguments chosen by the test.
    pub async fn start_with(
        max_servers: u32,
        lease_ttl: u32,
        labels: &str,
        launchers: usize,
        agent_args: &[&str],
    ) -> Pool {
        Pool::start_serving_with(max_servers, lease_ttl, labels, launchers, agent_args, &[]).await
    }

    /// [`Pool::start_with`], each launcher started with `serve_extra` added to its
    /// `slotpool serve` arguments.
    pub async fn start_serving_with(
        max_servers: u32,
        lease_ttl: u32,
        labels: &str,
        launchers: usize,
        agent_args: &[&str],
        serve_extra: &[&str],
    ) -> Pool {
        Pool::start_configured(
            |work_dir| config_yaml_with(work_dir, max_servers, lease_ttl, labels, agent_args),
            launchers,
            serve_extra,
        )
        .await
    }

    /// Starts a nats-server and `launchers` launcher processes (each with `serve_extra`
    /// added to its arguments) on the config `config` writes for the agents' work dir:
    /// for a pool file of the test's own making.
    pub async fn start_configured(
        config: impl FnOnce(&Path) -> String,
        launchers: usize,
        serve_extra: &[&str],
    ) -> Pool {
        let nats = NatsServer::start().await;
        // Agents in users mode keep their slots' workspaces here.
        let dir = crate::isolation::slot_visible_tempdir("slotpool-pool-");
        let yaml = config(&dir.path().join("agents"));
        let config = dir.path().join("pool.yaml");
        std::fs::write(&config, yaml).expect("writing config");
        let client = Client::from_bus(nats.bus().await);
        let mut pool = Pool {
            nats,
            client,
            dir,
            config,
            launchers: Vec::new(),
            serve_extra: serve_extra.iter().map(|s| s.to_string()).collect(),
        };
        for _ in 0..launchers {
            pool.spawn_launcher();
        }
        pool.wait_served().await;
        pool
    }

    /// The launchers' config file.
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    pub fn work_dir(&self) -> PathBuf {
        self.dir.path().join("agents")
    }

    /// The pool's own temp dir (parent of [`Pool::work_dir`]).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The work dir of the agent of `backing_id`.
    pub fn agent_dir(&self, backing_id: &str) -> PathBuf {
        self.work_dir().join(backing_id)
    }

    /// Submits a request for `labels` carrying `ssh_public_key`.
    pub async fn submit_with_key(&self, labels: &[&str], ssh_public_key: &str) -> RequestId {
        let mut sub = submission(labels.iter().map(|s| s.to_string()).collect(), "test");
        sub.ssh_public_key = Some(ssh_public_key.to_string());
        self.client.submit(&sub).await.expect("submit")
    }

    /// Starts one more `slotpool serve`; returns its index.
    pub fn spawn_launcher(&mut self) -> usize {
        let n = self.launchers.len();
        let launcher = self.launcher(n);
        self.launchers.push(launcher);
        n
    }

    fn launcher(&self, n: usize) -> ChildGuard {
        let mut args = self.nats.serve_args(&self.config);
        args.extend(self.serve_extra.iter().cloned());
        spawn_serve(
            &format!("launcher-{n}"),
            &args,
            &self.dir.path().join(format!("launcher-{n}.log")),
        )
    }

    /// The process id of launcher `n`.
    pub fn launcher_pid(&self, n: usize) -> u32 {
        self.launchers[n].id()
    }

    /// The log of launcher `n` so far.
    pub fn launcher_log(&self, n: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("launcher-{n}.log")))
            .unwrap_or_default()
    }

    /// An operator's HTTP token: it sees everything the launchers' `--http` serves.
    pub fn operator_token(&self) -> String {
        self.nats
            .http_token(slotpool_protocol::auth::Role::Operator, "ops")
    }

    /// Where launcher `n` serves HTTP (started with `--http`), once its log says.
    pub async fn http_addr(&self, n: usize) -> std::net::SocketAddr {
        crate::wait_for_some(
            "the launcher to say where it serves HTTP",
            Duration::from_secs(30),
            || async move { crate::metrics::http_addr_in(&self.launcher_log(n)) },
        )
        .await
    }

    /// SIGKILLs launcher `n`, as a crash would.
    pub fn kill_launcher(&mut self, n: usize) {
        self.launchers[n].kill();
    }

    /// Stops launcher `n` as its service manager would (SIGTERM, SIGKILL after `grace`).
    pub async fn stop_launcher(&mut self, n: usize, grace: Duration) -> std::process::ExitStatus {
        self.launchers[n].terminate(grace).await
    }

    /// Starts launcher `n` again (after [`Pool::kill_launcher`]), logging to the same file.
    pub fn restart_launcher(&mut self, n: usize) {
        self.launchers[n].kill();
        self.launchers[n] = self.launcher(n);
    }

    /// Waits until some launcher answers the API.
    pub async fn wait_served(&self) {
        wait_served(&self.client).await
    }

    /// Submits a request for `labels`.
    pub async fn submit(&self, labels: &[&str]) -> RequestId {
        let sub = submission(labels.iter().map(|s| s.to_string()).collect(), "test");
        self.client.submit(&sub).await.expect("submit")
    }

    /// The changes of request `id`'s record, from its value now (if any) on.
    pub async fn request_changes(
        &self,
        id: &RequestId,
    ) -> impl futures::Stream<
        Item = Result<slotpool_protocol::store::Change, slotpool_protocol::store::KvError>,
    > + Unpin {
        use futures::StreamExt;
        self.client
            .bus()
            .requests
            .watch_keys(id.as_str())
            .await
            .expect("watching a request's record")
            .boxed()
    }

    /// Waits until the request is final and returns it.
    pub async fn wait_final(&self, id: &RequestId, timeout: Duration) -> NodeRequest {
        tokio::time::timeout(timeout, self.client.wait(id, |_| {}))
            .await
            .unwrap_or_else(|_| panic!("request {id} not final within {timeout:?}"))
            .expect("wait")
    }

    pub async fn fulfilled(&self, id: &RequestId) -> NodeRequest {
        let r = self.wait_final(id, Duration::from_secs(60)).await;
        assert_eq!(r.state, RequestState::Fulfilled, "request {id}: {r:?}");
        r
    }

    pub async fn backing(&self) -> Vec<BackingNode> {
        self.client.list_backing().await.expect("list backing")
    }

    pub async fn backing_in(&self, states: &[BackingState]) -> Vec<BackingNode> {
        self.backing()
            .await
            .into_iter()
            .filter(|b| states.contains(&b.state))
            .collect()
    }

    /// Releases `nodes` and waits until their slots are wiped and free (a release is
    /// acknowledged before that).
    pub async fn release_and_wait(&self, nodes: &[NodeId]) -> Released {
        let released = self.client.release(nodes.to_vec()).await.expect("release");
        tokio::time::timeout(RELEASE_WAIT, self.client.wait_released(nodes))
            .await
            .expect("release finished in time")
            .expect("watch the slots");
        released
    }

    pub async fn nodes(&self) -> Vec<Node> {
        self.client.list_nodes().await.expect("list nodes")
    }

    /// The record of node `id`, which must hold its slot.
    pub async fn node(&self, id: &NodeId) -> Node {
        self.nodes()
            .await
            .into_iter()
            .find(|n| &n.id == id)
            .unwrap_or_else(|| panic!("node {id} holds no slot"))
    }

    /// The launchers' logs (for failure messages).
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for n in 0..self.launchers.len() {
            let text = std::fs::read_to_string(self.dir.path().join(format!("launcher-{n}.log")))
                .unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(400).collect();
            out.push_str(&format!("--- launcher-{n} (last lines)\n"));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for l in &mut self.launchers {
            l.kill();
        }
        kill_agents(&self.work_dir());
        if std::thread::panicking() {
            // The test failed: show what the launchers were doing, and keep their files
            // when asked to (SLOTPOOL_KEEP_FAILED=1), for a closer look.
            eprintln!("{}", self.logs());
            if std::env::var_os("SLOTPOOL_KEEP_FAILED").is_some() {
                let kept =
                    std::mem::replace(&mut self.dir, tempfile::tempdir().expect("temp dir")).keep();
                eprintln!("pool files kept in {}", kept.display());
            }
        }
    }
}

/// Starts `slotpool serve` with `args` (see [`NatsServer::serve_args`]) as `name`, its
/// log appended to `log`, killed when the guard drops.
pub fn spawn_serve(name: &str, args: &[String], log: &Path) -> ChildGuard {
    let log = File::options()
        .create(true)
        .append(true)
        .open(log)
        .expect("launcher log");
    let mut cmd = Command::new(bin_path("slotpool"));
    cmd.args(args)
        .args(["--log", "info,slotpool_launcher=debug"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    ChildGuard::spawn(name, cmd).expect("spawning slotpool serve")
}

/// Kills the local agents under a work dir when dropped (see [`kill_agents`]), for a test
/// that runs launchers without a [`Pool`].
pub struct AgentsGuard(pub PathBuf);

impl Drop for AgentsGuard {
    fn drop(&mut self) {
        kill_agents(&self.0);
    }
}

/// Waits until some launcher answers the API (a probe submission gets any answer but
/// "no responders").
pub async fn wait_served(client: &Client) {
    crate::wait_for(
        "a launcher to serve the API",
        Duration::from_secs(30),
        || async {
            let probe = submission(vec![], "probe");
            !matches!(
                client.submit(&probe).await,
                Err(slotpool_protocol::connect::BusError::NoResponders { .. })
            )
        },
    )
    .await;
}

/// Kills every local agent under `work_dir`: those its pid files name, and any other
/// process with an argument inside it (an agent started by a launcher that was killed
/// before it recorded the pid).
pub fn kill_agents(work_dir: &Path) {
    let mut pids = Vec::new();
    if let Ok(entries) = std::fs::read_dir(work_dir) {
        for e in entries.flatten() {
            let Ok(pid) = std::fs::read_to_string(e.path().join("agent.pid")) else {
                continue;
            };
            let Ok(pid) = pid.trim().parse::<i32>() else {
                continue;
            };
            let id = e.file_name().to_string_lossy().to_string();
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&id) {
                pids.push(pid);
            }
        }
    }
    let inside = |arg: &[u8]| {
        let dir = work_dir.as_os_str().as_encoded_bytes();
        arg.starts_with(dir) && arg.get(dir.len()) == Some(&b'/')
    };
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for pid in procs
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if pid > 1 && cmdline.split(|b| *b == 0).any(inside) {
                pids.push(pid);
            }
        }
    }
    for pid in pids {
        // SAFETY: killing a process we started, identified by its command line.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}
