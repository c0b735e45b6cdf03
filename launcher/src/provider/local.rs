//! Driver `local`: every backing node is a `slotpool-agent` process on the launcher's own
//! host (for demos and tests).
//!
//! Each agent gets a directory `<work-dir>/<backing id>/`, which is also its `--work-dir`
//! and holds `agent.pid` and `agent.log` (its stdout and stderr, appended; 0600, since
//! slot users pass through the directory to their homes). The agent is
//! started in a session of its own with stdin closed, so it outlives the launcher like a
//! VM would: neither a Ctrl-C at the launcher's terminal nor the launcher's death reaches
//! it. (Under systemd, that needs `KillMode=process` or `mixed` on the launcher's unit.)
//! While the launcher lives, a task waits on the agent so it never lingers as a zombie.
//! The demo's launcher asks for the opposite ([`AgentLifetime::EndWithLauncher`]): its
//! agents die with it, even when it is killed with SIGKILL.
//!
//! The secret goes to the agent in `SLOTPOOL_AGENT_SECRET`, and its bus credential in
//! `agent.creds` (mode 0600), never on its command line. It gets the launcher's own TLS
//! files ([`crate::agent_bus::LocalTls`]), for a server that asks for client certificates.
//!
//! `list` names the agents of the pid files and, found through `/proc`, those started
//! with a directory of the work dir whose launch ended before it wrote `agent.pid`.
//!
//! `delete` reads `agent.pid`, checks that `/proc/<pid>/cmdline` still carries
//! `--backing-id <id>` (so a recycled pid is never killed), sends SIGTERM, waits up to
//! [`STOP_GRACE`] and then SIGKILLs the agent's process group; then it removes the
//! directory. An agent that is already gone is not an error. [`LocalProvider::delete_all`]
//! deletes every agent it lists at once (the demo and the benchmark clean up with it,
//! while nats-server still runs, so each agent writes its last heartbeat and exits).

use super::{LaunchSpec, Launched, ListedInstance, Provider, ProviderError};
use rustix::process::{kill_process, kill_process_group, Pid, Signal};
use slotpool_protocol::model::Instance;
use slotpool_protocol::BackingId;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::time::Instant;

/// How long an agent may take to exit after SIGTERM before it is killed: what the
/// packaged unit gives it (`TimeoutStopSec=` in `slotpool-agent.service`, checked by a
/// test). In users mode an agent stops every slot process and, with
/// `--remove-slots-on-stop`, removes its slot users, cgroups and bus guard; on a loaded
/// host that takes more than a few seconds, and an agent killed half-way leaves them
/// behind on the host.
pub const STOP_GRACE: Duration = Duration::from_secs(30);
/// How long to wait for the kernel to finish an agent off after SIGKILL.
const KILL_GRACE: Duration = Duration::from_secs(2);
/// How often to look whether a stopping agent has exited (it is not our child, in
/// general, so there is nothing to wait on).
const EXIT_POLL: Duration = Duration::from_millis(20);
/// The agent's bus credential in its directory (mode 0600).
const CREDS_FILE: &str = "agent.creds";

/// The environment variable the agent reads its secret from.
const SECRET_ENV: &str = "SLOTPOOL_AGENT_SECRET";
/// Spawn attempts after the first when the agent binary is busy (ETXTBSY).
const SPAWN_RETRIES: u32 = 5;
const PID_FILE: &str = "agent.pid";
const LOG_FILE: &str = "agent.log";
/// The most of an agent's log read back as its machine's console.
const CONSOLE_READ: u64 = 64 * 1024;
/// Where slots of local backing nodes are reached.
const HOST: &str = "127.0.0.1";

/// Whether local agents outlive the launcher that started them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AgentLifetime {
    /// Like VMs: a launcher that stops or dies leaves them running, and a restarted one
    /// takes them up again (`slotpool serve`).
    #[default]
    OutliveLauncher,
    /// The kernel kills each (SIGKILL) when the launcher's thread that started it ends,
    /// which a runtime worker does only with the process, however that ends (see
    /// [`end_with_parent`]): the demo's, which must leave nothing behind.
    EndWithLauncher,
}

/// For a child's `pre_exec`: has the kernel send the child `signal` when the *thread*
/// that forked it ends (`PR_SET_PDEATHSIG`), and ends the child at once if `parent` (the
/// forking process's pid) is gone already. Fork only from a thread that lives as long as
/// the child should: the main thread, or a tokio runtime worker (which ends with its
/// runtime), never a blocking-pool thread, which ends after a while idle. Calls only
/// async-signal-safe functions (prctl, getppid, _exit).
pub fn end_with_parent(parent: u32, signal: Signal) -> io::Result<()> {
    rustix::process::set_parent_process_death_signal(Some(signal))?;
    // The parent may have died before prctl took effect.
    if rustix::process::getppid().map(|p| p.as_raw_nonzero().get() as u32) != Some(parent) {
        // SAFETY: _exit ends this (forked) process at once; it touches no memory.
        unsafe { libc::_exit(1) };
    }
    Ok(())
}

/// Starts agents as local processes.
#[derive(Debug)]
pub struct LocalProvider {
    name: String,
    command: PathBuf,
    args: Vec<String>,
    work_dir: PathBuf,
    lifetime: AgentLifetime,
    tls: crate::agent_bus::LocalTls,
}

impl LocalProvider {
    /// `command` is the agent binary; `args` are added after the ones the provider sets.
    pub fn new(name: &str, command: PathBuf, args: Vec<String>, work_dir: PathBuf) -> Self {
        LocalProvider {
            name: name.to_string(),
            command,
            args,
            work_dir,
            lifetime: AgentLifetime::default(),
            tls: Default::default(),
        }
    }

    /// The same provider, whose agents reach the bus with these TLS files.
    pub fn with_tls(self, tls: crate::agent_bus::LocalTls) -> Self {
        LocalProvider { tls, ..self }
    }

    /// The same provider, whose agents live as `lifetime` says.
    pub(crate) fn with_lifetime(self, lifetime: AgentLifetime) -> Self {
        LocalProvider { lifetime, ..self }
    }

    fn failed(&self, message: String) -> ProviderError {
        ProviderError::Failed {
            provider: self.name.clone(),
            message,
        }
    }

    fn instance(&self, backing_id: &str, pid: i32) -> Instance {
        let dir = self.work_dir.join(backing_id);
        Instance {
            id: backing_id.to_string(),
            host: HOST.to_string(),
            data: serde_json::json!({ "pid": pid, "dir": dir.display().to_string() }),
        }
    }

    /// Deletes every instance [`Provider::list`] finds, concurrently; returns the first
    /// error once all were tried.
    pub async fn delete_all(&self) -> Result<(), ProviderError> {
        let listed = self.list().await?;
        let deletes = listed.iter().map(|l| self.delete(&l.instance));
        futures::future::join_all(deletes)
            .await
            .into_iter()
            .collect()
    }

    /// Live agents started with `--work-dir <work-dir>/<id> --backing-id <id>`, found
    /// through `/proc`: what a launch interrupted before it wrote the pid file left.
    fn started_without_pid_file(&self) -> Vec<(i32, BackingId)> {
        let root = self.work_dir.as_os_str().as_bytes();
        let value_of = |args: &[&[u8]], flag: &[u8]| {
            args.windows(2)
                .find(|w| w[0] == flag)
                .map(|w| w[1].to_vec())
        };
        let mut found = Vec::new();
        for pid in processes_where(|args| {
            value_of(args, b"--work-dir").is_some_and(|dir| {
                dir.strip_prefix(root)
                    .and_then(|rest| rest.strip_prefix(b"/"))
                    .is_some_and(|id| value_of(args, b"--backing-id").as_deref() == Some(id))
            })
        }) {
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            let id = value_of(&args, b"--backing-id").unwrap_or_default();
            if let Ok(id) = BackingId::parse(&String::from_utf8_lossy(&id)) {
                if is_alive(pid) {
                    found.push((pid, id));
                }
            }
        }
        found
    }

    /// Stops the agent recorded in `dir` (if it still runs as `backing_id`).
    async fn stop_recorded(&self, dir: &Path, backing_id: &str) -> Result<(), ProviderError> {
        let mut pids = started_in(dir, backing_id);
        if let Some(pid) = read_pid(dir).map_err(|err| self.failed(err))? {
            if !pids.contains(&pid) {
                pids.push(pid);
            }
        }
        for pid in pids {
            self.stop(pid, backing_id).await?;
        }
        Ok(())
    }

    /// Stops `pid` if it still runs as `backing_id`.
    async fn stop(&self, pid: i32, backing_id: &str) -> Result<(), ProviderError> {
        if !runs_as(pid, backing_id) {
            return Ok(());
        }
        tracing::debug!(backing_id, pid, "stopping local agent");
        signal(pid, Signal::TERM);
        if wait_exit(pid, STOP_GRACE).await {
            // Whatever the agent left behind in its group goes too.
            signal(-pid, Signal::KILL);
            return Ok(());
        }
        tracing::warn!(backing_id, pid, grace = ?STOP_GRACE, "local agent ignored SIGTERM, killing it");
        signal(-pid, Signal::KILL);
        signal(pid, Signal::KILL);
        if wait_exit(pid, KILL_GRACE).await {
            Ok(())
        } else {
            Err(self.failed(format!(
                "agent {backing_id} (pid {pid}) did not exit after SIGKILL"
            )))
        }
    }
}

#[async_trait::async_trait]
impl Provider for LocalProvider {
    fn name(&self) -> &str {
        &self.name
    }

    /// Spawns the agent and returns at once; it does not wait for the agent to connect.
    /// A leftover agent of the same backing id (an earlier attempt) is stopped first.
    async fn launch(&self, spec: &LaunchSpec) -> Result<Launched, ProviderError> {
        let backing_id = spec.backing_id.as_str();
        let dir = self.work_dir.join(backing_id);
        self.stop_recorded(&dir, backing_id).await?;
        std::fs::create_dir_all(&dir)
            .map_err(|err| self.failed(format!("creating {}: {err}", dir.display())))?;
        let log_path = dir.join(LOG_FILE);
        let log = open_log(&log_path)
            .map_err(|err| self.failed(format!("opening {}: {err}", log_path.display())))?;
        let log_err = log
            .try_clone()
            .map_err(|err| self.failed(format!("opening {}: {err}", log_path.display())))?;

        let mut cmd = tokio::process::Command::new(&self.command);
        if let Some(creds) = &spec.credentials {
            // The credential goes in a file only its owner can read; the command line
            // (readable by every process on the host) names the file.
            let path = dir.join(CREDS_FILE);
            creds
                .write_private(&path)
                .map_err(|err| self.failed(format!("writing the agent's credentials: {err}")))?;
            cmd.arg("--creds").arg(path);
        }
        cmd.arg("--nats")
            .arg(&spec.nats_url)
            .arg("--backing-id")
            .arg(backing_id)
            .arg("--work-dir")
            .arg(&dir)
            .arg("--slots")
            .arg(spec.slots.to_string())
            .args(self.tls.args())
            .args(&self.args)
            .env(SECRET_ENV, &spec.secret)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .kill_on_drop(false);
        let (end_with_launcher, launcher) = (
            self.lifetime == AgentLifetime::EndWithLauncher,
            std::process::id(),
        );
        // SAFETY: setsid and end_with_parent are async-signal-safe and touch no memory
        // of the parent. This runs on a runtime worker (see `AgentLifetime`).
        unsafe {
            cmd.pre_exec(move || {
                rustix::process::setsid()?;
                if end_with_launcher {
                    end_with_parent(launcher, Signal::KILL)?;
                }
                Ok(())
            });
        }
        let mut child = spawn(&mut cmd)
            .await
            .map_err(|err| self.failed(format!("starting {}: {err}", self.command.display())))?;
        let pid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| self.failed("the agent exited before its pid was known".into()))?;

        let reaped_id = backing_id.to_string();
        let log = dir.join(LOG_FILE);
        tokio::spawn(async move {
            match child.wait().await {
                // An agent stopped by a signal or ending well is news to nobody; one that
                // fails on its own (a bad option in `agent-args`, a bus it cannot reach)
                // would otherwise be seen only when its boot-timeout ends.
                Ok(status) if status.code().is_some_and(|code| code != 0) => {
                    tracing::warn!(
                        backing_id = reaped_id,
                        pid,
                        %status,
                        log = %log.display(),
                        "local agent failed; its log says why"
                    )
                }
                Ok(status) => {
                    tracing::info!(backing_id = reaped_id, pid, %status, "local agent exited")
                }
                Err(err) => {
                    tracing::warn!(backing_id = reaped_id, pid, error = %err, "waiting for local agent")
                }
            }
        });

        if let Err(err) = write_pid(&dir, pid) {
            signal(-pid, Signal::KILL);
            return Err(self.failed(err));
        }
        tracing::debug!(backing_id, pid, "started local agent");
        Ok(Launched {
            instance: self.instance(backing_id, pid),
            attributes: Default::default(),
        })
    }

    async fn delete(&self, instance: &Instance) -> Result<(), ProviderError> {
        let backing_id = BackingId::parse(&instance.id)
            .map_err(|err| self.failed(format!("deleting instance: {err}")))?;
        let dir = self.work_dir.join(backing_id.as_str());
        self.stop_recorded(&dir, backing_id.as_str()).await?;
        // The pid file may be gone (an interrupted delete): also try the launch's pid.
        let launched_pid = instance.data.get("pid").and_then(|p| p.as_i64());
        if let Some(pid) = launched_pid.and_then(|p| i32::try_from(p).ok()) {
            if pid > 1 {
                self.stop(pid, backing_id.as_str()).await?;
            }
        }
        match tokio::fs::remove_dir_all(&dir).await {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(err) => Err(self.failed(format!("removing {}: {err}", dir.display()))),
        }
    }

    /// Every agent under the work dir that is still running as its directory's id.
    async fn list(&self) -> Result<Vec<ListedInstance>, ProviderError> {
        let entries = match std::fs::read_dir(&self.work_dir) {
            Ok(entries) => entries,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(err) => {
                return Err(self.failed(format!("reading {}: {err}", self.work_dir.display())))
            }
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|err| {
                self.failed(format!("reading {}: {err}", self.work_dir.display()))
            })?;
            let Some(id) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let Ok(backing_id) = BackingId::parse(&id) else {
                continue;
            };
            // An unreadable or garbled pid file is not an agent we can stop: skip it.
            let Ok(Some(pid)) = read_pid(&entry.path()) else {
                continue;
            };
            if runs_as(pid, &id) {
                out.push(ListedInstance {
                    instance: self.instance(&id, pid),
                    backing_id: Some(backing_id),
                });
            }
        }
        // Agents whose launch was cut short before their pid file was written.
        for (pid, backing_id) in self.started_without_pid_file() {
            if !out
                .iter()
                .any(|l| l.backing_id.as_ref() == Some(&backing_id))
            {
                out.push(ListedInstance {
                    instance: self.instance(backing_id.as_str(), pid),
                    backing_id: Some(backing_id),
                });
            }
        }
        out.sort_by(|a, b| a.instance.id.cmp(&b.instance.id));
        Ok(out)
    }

    /// The end of the agent's log (its stdout and stderr): what a local machine printed.
    async fn console(&self, instance: &Instance) -> Result<Option<String>, ProviderError> {
        let Ok(backing_id) = BackingId::parse(&instance.id) else {
            return Ok(None);
        };
        let path = self.work_dir.join(backing_id.as_str()).join(LOG_FILE);
        match read_end(&path, CONSOLE_READ) {
            Ok(text) => Ok(Some(text)),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(Some(String::new())),
            Err(err) => Err(self.failed(format!("reading {}: {err}", path.display()))),
        }
    }
}

/// The last `max` bytes of the file at `path`, as text.
fn read_end(path: &Path, max: u64) -> io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(max)))?;
    let mut bytes = Vec::new();
    file.take(max).read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Spawns `cmd`, retrying briefly on ETXTBSY: the agent binary may have been written a
/// moment ago, and another thread's fork can still hold it open for writing.
async fn spawn(cmd: &mut tokio::process::Command) -> io::Result<tokio::process::Child> {
    let mut attempt = 0;
    loop {
        match cmd.spawn() {
            Err(err) if err.raw_os_error() == Some(libc::ETXTBSY) && attempt < SPAWN_RETRIES => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(5 * u64::from(attempt))).await;
            }
            other => return other,
        }
    }
}

/// Opens the agent's log for appending, readable by its owner only: the directory is
/// the agent's work dir, which slot users pass through to their homes, and the log
/// names every slot's node, uid and logins. A log left by an older version is closed
/// too.
fn open_log(path: &Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)?;
    log.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(log)
}

/// The pid recorded in `dir`, or None when there is no pid file.
fn read_pid(dir: &Path) -> Result<Option<i32>, String> {
    let path = dir.join(PID_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(format!("reading {}: {err}", path.display())),
    };
    match text.trim().parse::<i32>() {
        // Never 0 or 1: kill(0) and kill(-1) would hit far more than one agent.
        Ok(pid) if pid > 1 => Ok(Some(pid)),
        _ => Err(format!("{}: not a pid: {:?}", path.display(), text.trim())),
    }
}

/// Writes the pid file atomically (a temp file renamed over it).
fn write_pid(dir: &Path, pid: i32) -> Result<(), String> {
    let path = dir.join(PID_FILE);
    let tmp = dir.join(format!("{PID_FILE}.tmp"));
    std::fs::write(&tmp, format!("{pid}\n"))
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|err| format!("writing {}: {err}", path.display()))
}

/// The live agents of `backing_id` started with `--work-dir <dir>`, whether or not the
/// pid file names them: a launcher killed between starting an agent and recording its
/// pid leaves one behind, which the next launch or delete must stop too.
fn started_in(dir: &Path, backing_id: &str) -> Vec<i32> {
    let (dir, id) = (dir.as_os_str().as_bytes(), backing_id.as_bytes());
    let pair = |args: &[&[u8]], flag: &[u8], value: &[u8]| {
        args.windows(2).any(|w| w[0] == flag && w[1] == value)
    };
    processes_where(|args| pair(args, b"--backing-id", id) && pair(args, b"--work-dir", dir))
        .into_iter()
        .filter(|&pid| is_alive(pid))
        .collect()
}

/// Every process (but init) whose command line, split into its arguments, satisfies
/// `pred`: found through `/proc`, reading each command line once.
pub fn processes_where(pred: impl Fn(&[&[u8]]) -> bool) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid > 1)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
                pred(&args)
            })
        })
        .collect()
}

/// Whether `pid` is alive (not a zombie) and was started with `--backing-id <id>`.
fn runs_as(pid: i32, backing_id: &str) -> bool {
    if !is_alive(pid) {
        return false;
    }
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let id = backing_id.as_bytes();
    let joined = [b"--backing-id=".as_slice(), id].concat();
    args.windows(2)
        .any(|w| w[0] == b"--backing-id" && w[1] == id)
        || args.contains(&joined.as_slice())
}

/// Whether `pid` exists and has not exited (zombies count as exited).
fn is_alive(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the command name, which is in parentheses and may contain any byte.
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next());
    !matches!(state, Some("Z") | Some("X") | None)
}

/// Polls until `pid` has exited, for at most `limit`.
async fn wait_exit(pid: i32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if !is_alive(pid) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(EXIT_POLL).await;
    }
}

/// Sends `sig` to `pid` (a negative pid: its process group). Errors (it is gone) are
/// ignored: callers check liveness themselves.
fn signal(pid: i32, sig: Signal) {
    debug_assert!(pid.abs() > 1);
    // A negative pid names a process group, as for kill(2).
    let _ = match Pid::from_raw(pid.abs()) {
        Some(p) if pid < 0 => kill_process_group(p, sig),
        Some(p) => kill_process(p, sig),
        None => Ok(()),
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A stand-in agent: a shell loop whose command line carries the provider's args.
    fn fake_agent(dir: &Path) -> PathBuf {
        let path = dir.join("fake-agent");
        std::fs::write(
            &path,
            "#!/bin/sh\necho \"fake agent up for $4\"\nwhile :; do sleep 1; done\n",
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    fn spec(backing_id: &str) -> LaunchSpec {
        LaunchSpec {
            backing_id: BackingId::parse(backing_id).unwrap(),
            secret: "s3cret-value".into(),
            provider: "local".into(),
            pool: "main".into(),
            backing_label: "big".into(),
            slots: 3,
            nats_url: "nats://127.0.0.1:4222".into(),
            credentials: None,
            timeout: Duration::from_secs(5),
            create_queue: None,
        }
    }

    /// Kills what a failed test left behind.
    struct Cleanup(Vec<i32>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            for pid in &self.0 {
                if ["bn-local-test", "bn-local-a", "bn-local-b", "bn-local-c"]
                    .iter()
                    .any(|id| runs_as(*pid, id))
                {
                    signal(-*pid, Signal::KILL);
                }
            }
        }
    }

    /// The session id of a process, field 6 of `/proc/<pid>/stat`.
    fn session_of(pid: &str) -> i32 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let after_name = &stat[stat.rfind(')').unwrap() + 2..];
        after_name.split(' ').nth(3).unwrap().parse().unwrap()
    }

    #[tokio::test]
    async fn an_agent_its_pid_file_does_not_name_is_stopped_by_the_next_launch() {
        let tmp = tempfile::tempdir().unwrap();
        let work_dir = tmp.path().join("work");
        let p = LocalProvider::new("local", fake_agent(tmp.path()), vec![], work_dir.clone());
        let first = p.launch(&spec("bn-local-c")).await.unwrap();
        let first = first.instance.data["pid"].as_i64().unwrap() as i32;
        let mut cleanup = Cleanup(vec![first]);
        // A launcher killed between starting the agent and recording its pid.
        std::fs::remove_file(work_dir.join("bn-local-c").join("agent.pid")).unwrap();
        let listed = p.list().await.unwrap();
        assert_eq!(listed.len(), 1, "listed from /proc: {listed:?}");
        assert_eq!(listed[0].instance, p.instance("bn-local-c", first));
        let second = p.launch(&spec("bn-local-c")).await.unwrap();
        let second = second.instance.data["pid"].as_i64().unwrap() as i32;
        cleanup.0.push(second);
        assert!(!is_alive(first), "the unrecorded agent still runs");
        assert!(is_alive(second));
        p.delete(&p.instance("bn-local-c", second)).await.unwrap();
        assert!(!is_alive(second));
    }

    #[test]
    fn an_agent_gets_the_time_to_stop_the_packaged_unit_gives_it() {
        let unit = include_str!("../../../packaging/systemd/slotpool-agent.service");
        let line = unit
            .lines()
            .find_map(|l| l.strip_prefix("TimeoutStopSec="))
            .expect("the unit sets TimeoutStopSec");
        assert_eq!(line, format!("{}s", STOP_GRACE.as_secs()));
    }

    #[tokio::test]
    async fn delete_all_stops_every_agent() {
        let tmp = tempfile::tempdir().unwrap();
        let p = LocalProvider::new(
            "local",
            fake_agent(tmp.path()),
            vec![],
            tmp.path().join("work"),
        );
        let mut pids = Vec::new();
        for id in ["bn-local-a", "bn-local-b"] {
            let launched = p.launch(&spec(id)).await.unwrap();
            pids.push(launched.instance.data["pid"].as_i64().unwrap() as i32);
        }
        let _cleanup = Cleanup(pids.clone());
        assert_eq!(p.list().await.unwrap().len(), 2);
        p.delete_all().await.unwrap();
        assert!(pids.iter().all(|pid| !is_alive(*pid)));
        assert!(p.list().await.unwrap().is_empty());
        p.delete_all().await.unwrap();
    }

    #[tokio::test]
    async fn launch_list_and_delete_an_agent() {
        let tmp = tempfile::tempdir().unwrap();
        let work_dir = tmp.path().join("work");
        let p = LocalProvider::new(
            "local",
            fake_agent(tmp.path()),
            vec!["--extra".into()],
            work_dir.clone(),
        );
        assert!(p.list().await.unwrap().is_empty());

        let started = Instant::now();
        let launched = p.launch(&spec("bn-local-test")).await.unwrap();
        assert!(started.elapsed() < Duration::from_millis(500));
        let pid = launched.instance.data["pid"].as_i64().unwrap() as i32;
        let mut cleanup = Cleanup(vec![pid]);
        let dir = work_dir.join("bn-local-test");
        assert_eq!(launched.instance.id, "bn-local-test");
        assert_eq!(launched.instance.host, "127.0.0.1");
        assert_eq!(
            launched.instance.data["dir"],
            serde_json::json!(dir.display().to_string())
        );
        assert_eq!(read_pid(&dir).unwrap(), Some(pid));
        assert!(dir.join("agent.log").exists());
        // Its console is what it printed.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let console = p.console(&launched.instance).await.unwrap().unwrap();
            if console.contains("fake agent up for bn-local-test") {
                break;
            }
            assert!(Instant::now() < deadline, "console: {console:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        assert!(is_alive(pid));
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let want = format!(
            "--nats nats://127.0.0.1:4222 --backing-id bn-local-test --work-dir {} --slots 3 --extra",
            dir.display()
        );
        assert!(cmdline.contains(&want), "{cmdline}");
        assert!(!cmdline.contains("s3cret-value"), "{cmdline}");
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        assert!(environ
            .split(|b| *b == 0)
            .any(|v| v == b"SLOTPOOL_AGENT_SECRET=s3cret-value"));
        // Its own session, so the launcher's terminal and process group do not reach it.
        // Read from /proc: a session led from outside our pid namespace (as in a
        // container) has the id 0 here, which getsid(2) reports but rustix's Pid
        // cannot hold.
        let sid = session_of(&pid.to_string());
        let ours = session_of("self");
        assert_eq!(sid, pid);
        assert_ne!(sid, ours);

        let listed = p.list().await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].instance, launched.instance);
        assert_eq!(
            listed[0].backing_id.as_ref().unwrap().as_str(),
            "bn-local-test"
        );

        // A second launch of the same backing node replaces the first agent.
        let again = p.launch(&spec("bn-local-test")).await.unwrap();
        let pid2 = again.instance.data["pid"].as_i64().unwrap() as i32;
        cleanup.0.push(pid2);
        assert_ne!(pid2, pid);
        assert!(!is_alive(pid));
        assert!(is_alive(pid2));

        p.delete(&again.instance).await.unwrap();
        assert!(!is_alive(pid2));
        assert!(!dir.exists());
        assert!(p.list().await.unwrap().is_empty());
        p.delete(&again.instance).await.unwrap();
        p.delete(&launched.instance).await.unwrap();
    }

    #[tokio::test]
    async fn a_recycled_pid_is_not_killed() {
        let tmp = tempfile::tempdir().unwrap();
        let p = LocalProvider::new("local", "/bin/true".into(), vec![], tmp.path().into());
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let dir = tmp.path().join("bn-gone");
        std::fs::create_dir_all(&dir).unwrap();
        write_pid(&dir, other.id() as i32).unwrap();

        assert!(p.list().await.unwrap().is_empty());
        let instance = p.instance("bn-gone", other.id() as i32);
        p.delete(&instance).await.unwrap();
        assert!(
            other.try_wait().unwrap().is_none(),
            "unrelated process was killed"
        );
        assert!(!dir.exists());
        other.kill().unwrap();
        other.wait().unwrap();
    }

    #[tokio::test]
    async fn a_missing_agent_binary_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let missing = tmp.path().join("no-such-agent");
        let p = LocalProvider::new("local", missing.clone(), vec![], tmp.path().into());
        let err = p.launch(&spec("bn-x")).await.unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("local: starting {}:", missing.display())),
            "{err}"
        );
    }
}
