//! One agent with user isolation, driven directly over NATS (no launcher): for tests that
//! prepare and release slots themselves and look at what the agent did.

use crate::isolation::{in_namespace, set_mode, unmount_all_under, ClientKey, IsolationEnv, Sshd};
use crate::nats::NatsServer;
use crate::process::{bin_path, ChildGuard};
use slotpool_protocol::api::{AgentCommand, SlotLimits, SlotOccupants, SlotPrepared};
use slotpool_protocol::connect::{Bus, BusError};
use slotpool_protocol::layout::subjects;
use slotpool_protocol::model::AgentHeartbeat;
use slotpool_protocol::{BackingId, NodeId};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tempfile::TempDir;

/// How long a test waits for an agent's answer (a release may wipe a big tree).
pub const AGENT_CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// A nats-server and one `slotpool-agent --isolation users`, killed on drop. Declare the
/// [`IsolationEnv`] before it, so the agent is gone before its users are removed.
pub struct SlotAgent {
    pub nats: NatsServer,
    pub bus: Bus,
    pub backing: BackingId,
    /// Holds the work dir (`work/agent`); slot users can pass through it.
    pub dir: TempDir,
    /// The agent's arguments but for the bus and the backing id.
    args: Vec<String>,
    /// The mount namespace it runs in (the environment's), if not the test's.
    ns: Option<PathBuf>,
    child: ChildGuard,
}

/// Starts `slotpool-agent` for `backing` with `args`, logging (appending) to
/// `<dir>/agent.log`.
fn spawn(
    nats: &NatsServer,
    backing: &BackingId,
    dir: &Path,
    args: &[String],
    ns: Option<&Path>,
) -> ChildGuard {
    let mut cmd = in_namespace(ns, bin_path("slotpool-agent"));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("agent.log"))
        .expect("agent log");
    cmd.args(nats.args_as(slotpool_protocol::auth::Role::Agent, backing.as_str()))
        .args(["--backing-id", backing.as_str()])
        .args(args)
        .env("SLOTPOOL_AGENT_SECRET", "test")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    ChildGuard::spawn("agent", cmd).expect("starting the agent")
}

impl SlotAgent {
    /// Starts an agent with `slots` slots and `extra` arguments; waits for its heartbeat.
    pub async fn start(env: &IsolationEnv, slots: u32, extra: &[String]) -> SlotAgent {
        let nats = NatsServer::start().await;
        let bus = nats.bus().await;
        let dir = crate::isolation::slot_visible_tempdir("slotpool-agent-");
        set_mode(dir.path(), 0o711);
        let backing = BackingId::parse("bn-iso").expect("backing id");
        let mut args = vec![
            "--slots".to_string(),
            slots.to_string(),
            "--work-dir".into(),
            dir.path().join("agent").display().to_string(),
        ];
        args.extend(env.agent_args());
        args.extend_from_slice(extra);
        let ns = env.mounts.as_ref().map(|m| m.ns_file());
        let child = spawn(&nats, &backing, dir.path(), &args, ns.as_deref());
        let mut agent = SlotAgent {
            nats,
            bus,
            backing,
            dir,
            args,
            ns,
            child,
        };
        agent.wait_for_heartbeat().await;
        agent
    }

    /// Waits for a heartbeat of the running agent process (not a previous one's).
    async fn wait_for_heartbeat(&mut self) {
        let pid = self.child.id();
        let log = self.dir.path().join("agent.log");
        let what = format!("the agent's heartbeat (log: {})", log.display());
        crate::wait_for(what, Duration::from_secs(30), || async {
            self.bus
                .agents
                .get::<AgentHeartbeat>(self.backing.as_str())
                .await
                .ok()
                .flatten()
                .is_some_and(|beat| beat.value.pid == pid && !beat.value.draining)
        })
        .await;
    }

    /// Stops the agent with SIGTERM (as a service manager does) and starts it again with
    /// the same arguments; waits for the new process's heartbeat.
    pub async fn restart(&mut self) {
        let status = self.child.terminate(Duration::from_secs(30)).await;
        assert!(
            status.success(),
            "the agent stopped with {status}:\n{}",
            self.log()
        );
        self.child = spawn(
            &self.nats,
            &self.backing,
            self.dir.path(),
            &self.args,
            self.ns.as_deref(),
        );
        self.wait_for_heartbeat().await;
    }

    /// Stops the agent with SIGTERM and waits for it to exit; panics unless it exited
    /// successfully.
    pub async fn stop(&mut self) {
        let status = self.child.terminate(Duration::from_secs(30)).await;
        assert!(
            status.success(),
            "the agent stopped with {status}:\n{}",
            self.log()
        );
    }

    /// The agent's work dir.
    pub fn work_dir(&self) -> PathBuf {
        self.dir.path().join("agent")
    }

    /// The agent's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// `what`, followed by the agent's log as it is when shown: for the `what` of a
    /// [`crate::wait_for`] whose timeout should say what the agent was doing.
    pub fn with_log<'a>(&'a self, what: &'a str) -> impl std::fmt::Display + 'a {
        WithLog { what, agent: self }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the agent process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().is_none()
    }

    /// Why `slot` is dirty, if it is.
    pub fn dirty(&self, slot: u32) -> Option<String> {
        std::fs::read_to_string(self.work_dir().join("dirty").join(slot.to_string())).ok()
    }

    /// Whether the agent's state says `slot` is warm (free, its user made).
    pub fn warm(&self, slot: u32) -> bool {
        std::fs::read_to_string(self.work_dir().join(format!("state/{slot}.json")))
            .is_ok_and(|s| s.contains("\"user\"") && !s.contains("node_id"))
    }

    /// What the launcher's claim writes under the slot's key before it has the agent
    /// prepare the slot.
    pub async fn claim(&self, slot: u32, node: &str) -> u64 {
        claim_slot(&self.bus, &self.backing, slot, node).await
    }

    /// Sends `prepare_slot` for `node`.
    pub async fn prepare(
        &self,
        slot: u32,
        node: &str,
        key: Option<&str>,
    ) -> Result<SlotPrepared, BusError> {
        self.prepare_with(slot, node, key, SlotLimits::default())
            .await
    }

    /// Prepares `slot` for `node` with the public key `key` installed, and returns its
    /// login (see [`login_of`]). Panics when the agent refuses.
    pub async fn prepare_login(&self, slot: u32, node: &str, key: &str) -> (String, PathBuf) {
        let prepared = self
            .prepare(slot, node, Some(key))
            .await
            .unwrap_or_else(|err| {
                panic!(
                    "preparing slot {slot} for {node}: {err}\nagent log:\n{}",
                    self.log()
                )
            });
        login_of(&prepared)
    }

    /// Sends `prepare_slot` for `node` with a label's `limits`.
    pub async fn prepare_with(
        &self,
        slot: u32,
        node: &str,
        key: Option<&str>,
        limits: SlotLimits,
    ) -> Result<SlotPrepared, BusError> {
        let command = AgentCommand::PrepareSlot {
            slot,
            node_id: NodeId::parse(node).expect("node id"),
            ssh_public_key: key.map(str::to_string),
            limits,
        };
        self.bus
            .call(
                &subjects::agent(&self.backing),
                &command,
                AGENT_CALL_TIMEOUT,
            )
            .await
    }

    /// Sends `slot_occupants`: who is in `slot` now.
    pub async fn occupants(&self, slot: u32) -> SlotOccupants {
        self.bus
            .call(
                &subjects::agent(&self.backing),
                &AgentCommand::SlotOccupants { slot },
                AGENT_CALL_TIMEOUT,
            )
            .await
            .unwrap_or_else(|err| panic!("slot_occupants of slot {slot}: {err}"))
    }

    /// Sends `release_slot` for `node`; sends it again while the answer times out (a
    /// release may take longer than a NATS request waits; it is idempotent and queued
    /// behind the one running, as the launcher's retries are).
    pub async fn release(&self, slot: u32, node: &str) -> Result<(), BusError> {
        let command = AgentCommand::ReleaseSlot {
            slot,
            node_id: NodeId::parse(node).expect("node id"),
        };
        let deadline = tokio::time::Instant::now() + AGENT_CALL_TIMEOUT;
        loop {
            let result = self
                .bus
                .call::<_, serde_json::Value>(
                    &subjects::agent(&self.backing),
                    &command,
                    AGENT_CALL_TIMEOUT,
                )
                .await;
            match result {
                Err(BusError::Timeout { .. }) if tokio::time::Instant::now() < deadline => {}
                result => return result.map(|_| ()),
            }
        }
    }
}

/// See [`SlotAgent::with_log`].
struct WithLog<'a> {
    what: &'a str,
    agent: &'a SlotAgent,
}

impl std::fmt::Display for WithLog<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}\nagent log:\n{}", self.what, self.agent.log())
    }
}

impl Drop for SlotAgent {
    fn drop(&mut self) {
        self.child.kill();
        // Workspace images a failed test or a killed agent left mounted.
        unmount_all_under(&self.work_dir());
        // What a test's jobs left may be too deep for the temp dir's recursive removal.
        let mut budget =
            slotpool_agent::isolation::wipe::Budget::new(u64::MAX, Duration::from_secs(600));
        if let Err(err) =
            slotpool_agent::isolation::wipe::remove_path(&self.work_dir(), &mut budget)
        {
            eprintln!("cleanup: {err}");
        }
    }
}

/// The uid of a user name, if the user exists.
pub fn uid_of(user: &str) -> Option<u32> {
    slotpool_agent::isolation::passwd::lookup(user).map(|i| i.uid)
}

/// Whether `path` exists (as anything, symlinks included).
pub fn exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// An sshd, a client key and an agent with `slots` slots whose logins go through that
/// sshd. Slot users can reach their homes.
pub async fn login_env(env: &IsolationEnv, slots: u32) -> (Sshd, ClientKey, SlotAgent) {
    login_env_with(env, slots, &[]).await
}

/// [`login_env`] with more agent arguments.
pub async fn login_env_with(
    env: &IsolationEnv,
    slots: u32,
    extra: &[&str],
) -> (Sshd, ClientKey, SlotAgent) {
    let sshd = Sshd::start(env).await;
    let key = ClientKey::new();
    let mut args = vec![
        "--ssh-port".to_string(),
        sshd.port.to_string(),
        "--ssh-host-keys-dir".into(),
        sshd.dir.path().display().to_string(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let agent = SlotAgent::start(env, slots, &args).await;
    (sshd, key, agent)
}

/// The user and workspace of a prepared slot.
pub fn login_of(prepared: &SlotPrepared) -> (String, PathBuf) {
    (
        prepared.login.username.clone().expect("a slot user"),
        PathBuf::from(&prepared.workspace),
    )
}

/// Writes slot `slot` of `backing` in the slots bucket as a launcher's claim does (a
/// `ready` node named `node`), before the agent is asked to prepare it; returns the
/// revision.
pub async fn claim_slot(bus: &Bus, backing: &BackingId, slot: u32, node: &str) -> u64 {
    use slotpool_protocol::model::{Node, NodeState};
    use slotpool_protocol::{NodeId, RequestId};
    let record = Node {
        v: slotpool_protocol::PROTOCOL_VERSION,
        id: NodeId::parse(node).unwrap(),
        request_id: RequestId::parse("req-test").unwrap(),
        index: 0,
        label: "test".into(),
        backing_id: backing.clone(),
        slot,
        state: NodeState::Ready,
        requestor: "test".into(),
        client: None,
        host: "127.0.0.1".into(),
        workspace: None,
        attributes: Default::default(),
        allocated_at: 0,
        released_at: None,
        failure: None,
        login: Default::default(),
    };
    bus.slots
        .create(
            &slotpool_protocol::layout::slot_key(backing, slot),
            &record,
            None,
        )
        .await
        .unwrap()
}
