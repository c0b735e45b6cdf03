//! Logins into slots: the agent's placement socket and the `slotpool-agent enter-slot`
//! helper.
//!
//! sshd runs the helper for every login of a slot user (`ForceCommand`, see
//! ARCHITECTURE.md for the `sshd_config` lines). The helper runs as the slot user; it
//! connects to `<run-dir>/<namespace>.sock` (the namespace is its user name without
//! `s<slot>`) and sends a [`LoginRequest`] (the command and its environment) with its
//! standard input, output and error attached (`SCM_RIGHTS`). The agent believes only
//! the kernel about who asks: the uid and pid come from `SO_PEERCRED`, so a user only
//! ever starts a login in its own slot, and the login's resource limits and umask are
//! the helper's, read from the kernel (what sshd gave it; a user cannot raise a hard
//! limit by asking). The agent moves the helper into the slot's cgroup and starts the
//! user's shell inside the slot ([`crate::isolation::start`]: cgroup, namespaces, then
//! the user's ids), on the helper's descriptors, and answers `started <pid>`. The helper then waits: it passes
//! on the signals it gets (`signal <n>`, see [`RELAYED_SIGNALS`]), and ends as the shell
//! ended (`exit <code>`, or `killed <signal>`: it kills itself with that signal), so sshd
//! reports the shell's status. A helper that goes before the shell ends hangs up the
//! shell (SIGHUP to its process group), as a closed terminal would. When the agent does
//! not answer, or refuses, the login is refused: a login never runs outside its slot.
//!
//! The shell is the agent's child, not the helper's: only root can join a slot's
//! namespaces, which are the host's (owned by the host's user namespace) and kept from
//! one tenancy to the next. An agent that restarts while a login runs leaves it running
//! in its slot; its helper ends with status 255 and says so.
//!
//! The socket is open to every user of the host (it has to be: sshd runs the helper as
//! the slot user), so it is bounded like slotpool's other listeners: at most
//! [`MAX_PLACING`] logins being set up at once (more connections wait in the kernel's
//! backlog, holding no descriptor of the agent), at most [`MAX_PLACING_PER_UID`] of one
//! uid (more are refused at once, so one slot cannot make the others' logins wait);
//! requests of at most [`MAX_REQUEST`] bytes and 3 descriptors, read within
//! [`ENTER_TIMEOUT`]; once a login runs, its helper's lines of at most
//! [`MAX_SIGNAL_LINE`] bytes (a longer one hangs the login up, as a helper gone does); at most
//! [`MAX_LOGINS_PER_UID`] logins running per slot user and [`MAX_LOGINS`] in all; a
//! pause after an accept error, and the line logged per login limited to [`LOG_BURST`]
//! per slot and [`LOG_EVERY`] (the next one says how many were not logged).

use crate::isolation::passwd;
use crate::isolation::start::{limits_of, Settings, SlotEntry};
use crate::isolation::SlotIsolation;
use slotpool_protocol::listener::{AcceptErrors, Throttle};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

/// The agent's answer once the login runs: `started <pid>`.
const STARTED: &str = "started";
/// The agent's last answer when the login's shell exited: `exit <code>`.
const EXIT: &str = "exit";
/// The agent's last answer when a signal ended the login's shell: `killed <signal>`.
const KILLED: &str = "killed";
/// A signal the helper passes on: `signal <n>`.
const SIGNAL: &str = "signal";

/// Longest the helper waits for the login to start, and the agent for its request.
pub const ENTER_TIMEOUT: Duration = Duration::from_secs(10);
/// Logins being set up at once, all uids together.
pub const MAX_PLACING: usize = 64;
/// Logins being set up at once for one uid; more are refused at once.
pub const MAX_PLACING_PER_UID: usize = 16;
/// Logins running at once for one slot user; more are refused.
pub const MAX_LOGINS_PER_UID: usize = 64;
/// Logins running at once on this agent, all slots together; more are refused.
pub const MAX_LOGINS: usize = 1024;
/// Longest login request (its command and environment), in bytes.
pub const MAX_REQUEST: usize = 128 * 1024;
/// Most variables in a login's environment.
pub const MAX_ENV: usize = 1024;
/// Longest line a helper sends once its login runs (`signal <n>`).
pub const MAX_SIGNAL_LINE: usize = 32;
/// The signals the helper passes on to the login's shell.
pub const RELAYED_SIGNALS: [i32; 6] = [
    libc::SIGHUP,
    libc::SIGINT,
    libc::SIGQUIT,
    libc::SIGTERM,
    libc::SIGUSR1,
    libc::SIGUSR2,
];
/// Placements of one slot logged at once, then one per [`LOG_EVERY`] / [`LOG_BURST`].
pub const LOG_BURST: u32 = 20;
pub const LOG_EVERY: Duration = Duration::from_secs(60);

/// Why the placement socket could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("{action} {path}: {error}")]
pub struct EnterError {
    pub action: &'static str,
    pub path: PathBuf,
    pub error: std::io::Error,
}

/// The socket path of an agent namespace.
pub fn socket_path(run_dir: &Path, namespace: &str) -> PathBuf {
    run_dir.join(format!("{namespace}.sock"))
}

/// Binds the placement socket (replacing a stale one), reachable by every user.
pub fn bind(run_dir: &Path, namespace: &str) -> Result<UnixListener, EnterError> {
    let err = |action: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |error| EnterError {
            action,
            path,
            error,
        }
    };
    std::fs::create_dir_all(run_dir).map_err(err("creating", run_dir))?;
    reachable_by_all(run_dir).map_err(err("making searchable by every user", run_dir))?;
    let path = socket_path(run_dir, namespace);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err("removing stale", &path)(e)),
    }
    let listener = UnixListener::bind(&path).map_err(err("binding", &path))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))
        .map_err(err("setting mode 0666 on", &path))?;
    Ok(listener)
}

/// Makes `run_dir` searchable by every user, as a slot user's login must be to reach the
/// socket in it. A run directory made 0700 (as one made by a recursive `DirBuilder` with
/// that mode was, before [`crate::isolation::create_private_dir_all`]) would refuse
/// every login; it gains the search bits only, never read.
fn reachable_by_all(run_dir: &Path) -> std::io::Result<()> {
    let mode = std::fs::metadata(run_dir)?.permissions().mode() & 0o7777;
    if mode & 0o011 == 0o011 {
        return Ok(());
    }
    tracing::warn!(
        run_dir = %run_dir.display(),
        mode = format!("{mode:o}"),
        "the run directory keeps slot users from the placement socket; adding search for all"
    );
    std::fs::set_permissions(run_dir, std::fs::Permissions::from_mode(mode | 0o011))
}

/// What the helper asks for: one JSON line, with its standard input, output and error
/// attached (`SCM_RIGHTS`, in that order).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoginRequest {
    /// The command to run with the user's shell (`$SSH_ORIGINAL_COMMAND`); none: a login
    /// shell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// The login's environment, `NAME=value` each; the slot's `HOME`, `USER`, `LOGNAME`
    /// and `SHELL` replace any of these names.
    #[serde(default)]
    pub env: Vec<String>,
}

impl LoginRequest {
    /// Parses and checks a request line.
    pub fn parse(line: &[u8]) -> Result<LoginRequest, String> {
        let request: LoginRequest =
            serde_json::from_slice(line).map_err(|e| format!("a bad login request: {e}"))?;
        if request.env.len() > MAX_ENV {
            return Err(format!(
                "the login's environment has {} variables; at most {MAX_ENV}",
                request.env.len()
            ));
        }
        for var in &request.env {
            match var.split_once('=') {
                Some((name, _)) if !name.is_empty() && !var.contains('\0') => {}
                _ => return Err(format!("not a NAME=value variable: {var:?}")),
            }
        }
        if request.command.as_deref().is_some_and(|c| c.contains('\0')) {
            return Err("the command holds a NUL byte".into());
        }
        Ok(request)
    }
}

/// Answers login requests until `shutdown`, then removes the socket file. Logins
/// running then keep running; their helpers end (see the module's doc).
pub async fn serve(
    listener: UnixListener,
    path: PathBuf,
    isolation: Arc<dyn SlotIsolation>,
    shutdown: CancellationToken,
) {
    let placing_places = Arc::new(tokio::sync::Semaphore::new(MAX_PLACING));
    let running_places = Arc::new(tokio::sync::Semaphore::new(MAX_LOGINS));
    let accept_errors = AcceptErrors::new("placement socket");
    let placing = Arc::new(PerUid::default());
    let running = Arc::new(PerUid::default());
    let logged = Arc::new(PlacementLog::default());
    loop {
        // Setting a login up never waits long (its request is read within
        // ENTER_TIMEOUT); connections beyond wait in the kernel's backlog.
        let place = tokio::select! {
            () = shutdown.cancelled() => break,
            place = placing_places.clone().acquire_owned() => place.expect("never closed"),
        };
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(err) => {
                accept_errors.failed(&err).await;
                continue;
            }
        };
        let login = Login {
            isolation: isolation.clone(),
            placing: placing.clone(),
            running: running.clone(),
            running_places: running_places.clone(),
            logged: logged.clone(),
        };
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut stream = stream;
            let started = login.start(&mut stream, place).await;
            let (child, _running) = match started {
                Ok(started) => started,
                Err(refusal) => {
                    if let Some(quiet) = login.logged.refusals.take(std::time::Instant::now()) {
                        tracing::warn!(answer = refusal, not_logged = quiet, "login refused");
                    }
                    let _ = stream
                        .write_all(format!("error: {refusal}\n").as_bytes())
                        .await;
                    return;
                }
            };
            relay(stream, child, shutdown).await;
        });
    }
    let _ = std::fs::remove_file(&path);
}

/// What a connection needs to start its login.
struct Login {
    isolation: Arc<dyn SlotIsolation>,
    placing: Arc<PerUid>,
    running: Arc<PerUid>,
    running_places: Arc<tokio::sync::Semaphore>,
    logged: Arc<PlacementLog>,
}

/// A running login's places: one of the agent's, one of its uid's.
type Running = (tokio::sync::OwnedSemaphorePermit, Turn);

impl Login {
    /// Reads the request and starts the login's shell; answers `started <pid>`. The
    /// refusal otherwise.
    async fn start(
        &self,
        stream: &mut tokio::net::UnixStream,
        _place: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<(tokio::process::Child, Running), String> {
        let cred = stream
            .peer_cred()
            .map_err(|e| format!("peer credentials: {e}"))?;
        let uid = cred.uid();
        let pid = cred.pid().ok_or("no peer pid")?;
        let _turn = self
            .placing
            .enter(uid, MAX_PLACING_PER_UID)
            .ok_or_else(|| {
                format!(
                    "uid {uid} has {MAX_PLACING_PER_UID} logins being placed already; try again"
                )
            })?;
        let (line, fds) = tokio::time::timeout(ENTER_TIMEOUT, read_request(stream))
            .await
            .map_err(|_| format!("no login request within {ENTER_TIMEOUT:?}"))?
            .map_err(|e| format!("reading the login request: {e}"))?;
        let request = LoginRequest::parse(&line)?;
        let [stdin, stdout, stderr]: [OwnedFd; 3] = fds.try_into().map_err(|fds: Vec<_>| {
            format!(
                "a login request comes with 3 descriptors (stdin, stdout, stderr), not {}",
                fds.len()
            )
        })?;
        let running = self
            .running
            .enter(uid, MAX_LOGINS_PER_UID)
            .ok_or_else(|| format!("uid {uid} has {MAX_LOGINS_PER_UID} logins running"))?;
        let running_place = self
            .running_places
            .clone()
            .try_acquire_owned()
            .map_err(|_| format!("the agent runs {MAX_LOGINS} logins already"))?;
        let entry = tokio::task::spawn_blocking({
            let isolation = self.isolation.clone();
            move || {
                // The helper too: every process of the slot's user is in its cgroup.
                if isolation.place(uid, pid)?.is_none() {
                    return Ok(None);
                }
                isolation.slot_entry(uid, Some(pid))
            }
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("uid {uid} is not a slot user"))?;
        let slot = entry.slot;
        let namespaces = entry.namespaces.len();
        let settings = Settings {
            cwd: entry.home.clone(),
            limits: limits_of(pid),
            umask: umask_of(pid),
        };
        let child = start_shell(entry, request, settings, [stdin, stdout, stderr])
            .map_err(|e| format!("starting the login's shell: {e}"))?;
        let Some(shell_pid) = child.id() else {
            return Err("the login's shell is gone already".into());
        };
        if let Some(quiet) = self.logged.of_slot(slot) {
            tracing::info!(
                slot,
                uid,
                pid = shell_pid,
                namespaces,
                not_logged = quiet,
                "login started in its slot"
            );
        }
        // A helper gone already gets no answer; the relay hangs its shell up.
        if let Err(err) = stream
            .write_all(format!("{STARTED} {shell_pid}\n").as_bytes())
            .await
        {
            tracing::debug!(%err, "cannot tell a login's helper its shell started");
        }
        Ok((child, (running_place, running)))
    }
}

/// Starts the user's shell of `entry` inside its slot on `stdio`, as `request` asks.
fn start_shell(
    entry: SlotEntry,
    request: LoginRequest,
    settings: Settings,
    stdio: [OwnedFd; 3],
) -> std::io::Result<tokio::process::Child> {
    let base = entry
        .shell
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "sh".into());
    let mut command = tokio::process::Command::new(&entry.shell);
    match &request.command {
        Some(cmd) => {
            command.arg0(base).arg("-c").arg(cmd);
        }
        // A login shell: argv[0] starts with '-'.
        None => {
            command.arg0(format!("-{base}"));
        }
    }
    let own = ["HOME", "USER", "LOGNAME", "SHELL"];
    command.env_clear();
    for var in &request.env {
        if let Some((name, value)) = var.split_once('=') {
            if !own.contains(&name) {
                command.env(name, value);
            }
        }
    }
    command
        .env("HOME", &entry.home)
        .env("USER", &entry.user)
        .env("LOGNAME", &entry.user)
        .env("SHELL", &entry.shell);
    let [stdin, stdout, stderr] = stdio;
    command
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr));
    entry.apply(&mut command, settings);
    command.spawn()
}

/// Passes the helper's signals on to the login's shell until it exits, then tells the
/// helper how it ended. A helper that goes first hangs the shell up.
async fn relay(
    stream: tokio::net::UnixStream,
    mut child: tokio::process::Child,
    shutdown: CancellationToken,
) {
    let (mut read, mut write) = stream.into_split();
    // What the helper sent of its next line; a line longer than any helper's is no
    // helper's, and ends the relay as a helper gone does.
    let mut pending: Vec<u8> = Vec::with_capacity(MAX_SIGNAL_LINE);
    let mut chunk = [0u8; MAX_SIGNAL_LINE];
    let mut helper_gone = false;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            read = read.read(&mut chunk), if !helper_gone => {
                let gone = match read {
                    Ok(0) | Err(_) => true,
                    Ok(n) => {
                        pending.extend_from_slice(&chunk[..n]);
                        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                            let line: Vec<u8> = pending.drain(..=end).collect();
                            let signal = std::str::from_utf8(&line[..end])
                                .ok()
                                .and_then(|l| l.strip_prefix(SIGNAL))
                                .and_then(|n| n.trim().parse::<i32>().ok())
                                .filter(|n| RELAYED_SIGNALS.contains(n));
                            if let (Some(signal), Some(pid)) = (signal, child.id()) {
                                // SAFETY: kill(2) on our unreaped child.
                                unsafe { libc::kill(pid as i32, signal) };
                            }
                        }
                        pending.len() >= MAX_SIGNAL_LINE
                    }
                };
                if gone {
                    helper_gone = true;
                    if let Some(pid) = child.id() {
                        // SAFETY: kill(2) on the process group of our unreaped child.
                        unsafe { libc::kill(-(pid as i32), libc::SIGHUP) };
                    }
                }
            }
            // The agent stops: the login goes on in its slot, without its helper.
            () = shutdown.cancelled() => return,
        }
    };
    let answer = match status {
        Ok(status) => match (status.code(), status.signal()) {
            (Some(code), _) => format!("{EXIT} {code}\n"),
            (None, Some(signal)) => format!("{KILLED} {signal}\n"),
            (None, None) => format!("{EXIT} 255\n"),
        },
        Err(err) => {
            tracing::warn!(%err, "cannot wait for a login's shell");
            format!("{EXIT} 255\n")
        }
    };
    let _ = write.write_all(answer.as_bytes()).await;
}

/// The umask of process `pid`, from its status file.
fn umask_of(pid: i32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let mask = status.lines().find_map(|l| l.strip_prefix("Umask:"))?;
    u32::from_str_radix(mask.trim(), 8).ok()
}

/// Reads one request line, with the descriptors sent along with it.
async fn read_request(stream: &tokio::net::UnixStream) -> std::io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut line = Vec::new();
    let mut fds = Vec::new();
    loop {
        let mut buf = vec![0u8; 16 * 1024];
        let got = stream
            .async_io(tokio::io::Interest::READABLE, || {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
                let mut control = RecvAncillaryBuffer::new(&mut space);
                let msg = recvmsg(
                    stream,
                    &mut [std::io::IoSliceMut::new(&mut buf)],
                    &mut control,
                    RecvFlags::CMSG_CLOEXEC,
                )
                .map_err(std::io::Error::from)?;
                let mut received = Vec::new();
                for message in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(rights) = message {
                        received.extend(rights);
                    }
                }
                Ok((msg.bytes, received))
            })
            .await?;
        let (n, received) = got;
        fds.extend(received);
        if fds.len() > 3 {
            return Err(std::io::Error::other(format!(
                "more than 3 descriptors ({})",
                fds.len()
            )));
        }
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        line.extend_from_slice(&buf[..n]);
        if let Some(end) = line.iter().position(|&b| b == b'\n') {
            line.truncate(end);
            return Ok((line, fds));
        }
        if line.len() > MAX_REQUEST {
            return Err(std::io::Error::other(format!(
                "longer than {MAX_REQUEST} bytes"
            )));
        }
    }
}

/// Logins of each uid being set up or running.
#[derive(Default)]
struct PerUid(Arc<Mutex<HashMap<u32, usize>>>);

/// One login of a uid; ends on drop.
struct Turn {
    of: Arc<Mutex<HashMap<u32, usize>>>,
    uid: u32,
}

impl PerUid {
    /// A turn for `uid`, unless it has `most` already.
    fn enter(&self, uid: u32, most: usize) -> Option<Turn> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = map.entry(uid).or_insert(0);
        if *n >= most {
            return None;
        }
        *n += 1;
        Some(Turn {
            of: self.0.clone(),
            uid,
        })
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut map = self.of.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.uid);
            }
        }
    }
}

/// How many login lines each slot may still log, and the refusals'.
struct PlacementLog {
    slots: Mutex<HashMap<u32, Throttle>>,
    refusals: Throttle,
}

impl Default for PlacementLog {
    fn default() -> Self {
        PlacementLog {
            slots: Mutex::new(HashMap::new()),
            refusals: Throttle::new(LOG_BURST, LOG_EVERY),
        }
    }
}

impl PlacementLog {
    /// `Some(not logged since)` when a login of `slot` may be logged now.
    fn of_slot(&self, slot: u32) -> Option<u64> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots
            .entry(slot)
            .or_insert_with(|| Throttle::new(LOG_BURST, LOG_EVERY))
            .take(std::time::Instant::now())
    }
}

/// Why `enter-slot` refuses the login.
#[derive(Debug, thiserror::Error)]
pub enum EnterSlotError {
    #[error("uid {0} has no user name")]
    NoUser(u32),
    #[error("user {0} is not a slotpool slot user")]
    NotSlotUser(String),
    #[error("asking the slotpool agent at {path}: {error}")]
    Agent {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("the slotpool agent refused: {0}")]
    Refused(String),
    #[error(
        "the slotpool agent stopped answering; the login goes on in its slot without this session"
    )]
    AgentGone,
}

/// How the login's shell ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoginEnd {
    Exited(i32),
    Killed(i32),
}

/// The helper: has the agent start this login's shell (running `command` if given)
/// inside its slot on this process's standard descriptors, passes signals on, and
/// returns how the shell ended.
pub fn enter_slot(run_dir: &Path, command: Option<String>) -> Result<LoginEnd, EnterSlotError> {
    let uid = rustix::process::getuid().as_raw();
    let Some(name) = passwd::name_of(uid) else {
        return Err(EnterSlotError::NoUser(uid));
    };
    let Some((namespace, _slot)) = passwd::split_user_name(&name) else {
        return Err(EnterSlotError::NotSlotUser(name));
    };
    let path = socket_path(run_dir, namespace);
    let agent = |error| EnterSlotError::Agent {
        path: path.clone(),
        error,
    };
    let request = LoginRequest {
        command,
        env: std::env::vars_os()
            .filter_map(|(k, v)| {
                Some(format!(
                    "{}={}",
                    k.into_string().ok()?,
                    v.into_string().ok()?
                ))
            })
            .collect(),
    };
    let mut line = serde_json::to_vec(&request).expect("serialisable");
    line.push(b'\n');
    // Signals are blocked from here on and read from a signalfd, to pass on.
    let signals = block_relayed_signals().map_err(agent)?;
    let stream = UnixStream::connect(&path).map_err(agent)?;
    stream
        .set_read_timeout(Some(ENTER_TIMEOUT))
        .map_err(agent)?;
    send_request(&stream, &line).map_err(agent)?;
    let mut answers = Answers::new(&stream);
    let first = answers.next().map_err(agent)?;
    match first.as_deref() {
        Some(a) if a.starts_with(STARTED) => {}
        Some(a) => {
            return Err(EnterSlotError::Refused(
                a.strip_prefix("error: ").unwrap_or(a).to_string(),
            ))
        }
        None => return Err(agent(std::io::ErrorKind::UnexpectedEof.into())),
    }
    stream.set_read_timeout(None).map_err(agent)?;
    stream.set_nonblocking(true).map_err(agent)?;
    loop {
        // Whatever the agent sent already, then wait for more or a signal.
        while let Some(answer) = answers.buffered() {
            let mut words = answer.split_whitespace();
            let (kind, n) = (words.next(), words.next().and_then(|n| n.parse().ok()));
            match (kind, n) {
                (Some(EXIT), Some(code)) => return Ok(LoginEnd::Exited(code)),
                (Some(KILLED), Some(signal)) => return Ok(LoginEnd::Killed(signal)),
                _ => {}
            }
        }
        use rustix::event::{poll, PollFd, PollFlags};
        let mut fds = [
            PollFd::new(&stream, PollFlags::IN),
            PollFd::new(&signals, PollFlags::IN),
        ];
        match poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(agent(e.into())),
        }
        let (stream_ready, signal_ready) =
            (!fds[0].revents().is_empty(), !fds[1].revents().is_empty());
        if signal_ready {
            if let Some(signal) = read_signal(&signals) {
                let _ = (&stream).write_all(format!("{SIGNAL} {signal}\n").as_bytes());
            }
        }
        if stream_ready && !answers.fill().map_err(agent)? {
            return Err(EnterSlotError::AgentGone);
        }
    }
}

/// Ends this process as the login's shell ended: with its exit code, or killed by its
/// signal (128 + the signal when that signal does not kill).
pub fn end_as(end: LoginEnd) -> ! {
    match end {
        LoginEnd::Exited(code) => std::process::exit(code),
        LoginEnd::Killed(signal) => {
            // SAFETY: the default action of the signal, unblocked, sent to ourselves.
            unsafe {
                libc::signal(signal, libc::SIG_DFL);
                let mut set = MaybeUninit::<libc::sigset_t>::uninit();
                libc::sigemptyset(set.as_mut_ptr());
                libc::sigaddset(set.as_mut_ptr(), signal);
                libc::sigprocmask(libc::SIG_UNBLOCK, set.as_ptr(), std::ptr::null_mut());
                libc::raise(signal);
            }
            std::process::exit(128 + signal)
        }
    }
}

/// Blocks [`RELAYED_SIGNALS`] and returns a signalfd that reads them.
fn block_relayed_signals() -> std::io::Result<OwnedFd> {
    // SAFETY: a sigset on our stack, filled and passed to sigprocmask and signalfd.
    unsafe {
        let mut set = MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigemptyset(set.as_mut_ptr());
        for signal in RELAYED_SIGNALS {
            libc::sigaddset(set.as_mut_ptr(), signal);
        }
        if libc::sigprocmask(libc::SIG_BLOCK, set.as_ptr(), std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = libc::signalfd(-1, set.as_ptr(), libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// The next signal from the signalfd, if one is there.
fn read_signal(signals: &OwnedFd) -> Option<i32> {
    let mut info = MaybeUninit::<libc::signalfd_siginfo>::uninit();
    let size = size_of::<libc::signalfd_siginfo>();
    // SAFETY: reads at most `size` bytes into `info`.
    let n = unsafe { libc::read(signals.as_raw_fd(), info.as_mut_ptr().cast(), size) };
    // SAFETY: a full read filled the struct.
    (n == size as isize).then(|| unsafe { info.assume_init() }.ssi_signo as i32)
}

/// Sends the request line with this process's stdin, stdout and stderr attached.
fn send_request(stream: &UnixStream, line: &[u8]) -> std::io::Result<()> {
    use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    // SAFETY: descriptors 0, 1 and 2 stay open for as long as this process lives.
    let stdio = [0, 1, 2].map(|fd| unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) });
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&stdio));
    let sent = sendmsg(
        stream,
        &[std::io::IoSlice::new(line)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    // The descriptors went with the first bytes; the rest of a long line follows.
    (&*stream).write_all(&line[sent..])
}

/// The agent's answer lines, as they come.
struct Answers<'a> {
    stream: &'a UnixStream,
    buf: Vec<u8>,
}

impl<'a> Answers<'a> {
    fn new(stream: &'a UnixStream) -> Answers<'a> {
        Answers {
            stream,
            buf: Vec::new(),
        }
    }

    /// The next whole line read already.
    fn buffered(&mut self) -> Option<String> {
        let end = self.buf.iter().position(|&b| b == b'\n')?;
        let line: Vec<u8> = self.buf.drain(..=end).collect();
        Some(String::from_utf8_lossy(&line[..end]).into_owned())
    }

    /// Reads what is there; false at the end of the stream.
    fn fill(&mut self) -> std::io::Result<bool> {
        let mut chunk = [0u8; 512];
        match (&*self.stream).read(&mut chunk) {
            Ok(0) => Ok(false),
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                if self.buf.len() > MAX_ANSWER {
                    return Err(std::io::Error::other("the answer is too long"));
                }
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(e),
        }
    }

    /// The next line, reading (blocking) until it is there; `None` at the end.
    fn next(&mut self) -> std::io::Result<Option<String>> {
        loop {
            if let Some(line) = self.buffered() {
                return Ok(Some(line));
            }
            if !self.fill()? {
                return Ok(None);
            }
        }
    }
}

/// Longest answer the helper reads.
const MAX_ANSWER: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    fn mode_of(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    /// On a fresh boot the run directory does not exist: the slots' namespace
    /// directories, made first, leave it searchable; and the socket's bind makes a run
    /// directory left 0700 searchable by every user, without read.
    #[tokio::test]
    async fn every_user_reaches_the_placement_socket_whatever_made_the_run_dir() {
        let work = tempfile::tempdir().unwrap();
        let run_dir = work.path().join("run");
        crate::isolation::create_private_dir_all(&run_dir.join("netns").join("sp1")).unwrap();
        assert_eq!(mode_of(&run_dir.join("netns").join("sp1")), 0o700);
        let made = mode_of(&run_dir);
        assert_eq!(made & 0o011, 0o011, "run dir {made:o}");
        assert_eq!(mode_of(&run_dir.join("netns")) & 0o011, 0o011);

        std::fs::set_permissions(&run_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let _listener = bind(&run_dir, "sp1").unwrap();
        assert_eq!(mode_of(&run_dir), 0o711);
        assert_eq!(mode_of(&socket_path(&run_dir, "sp1")), 0o666);
    }

    #[test]
    fn a_login_request_is_checked_before_anything_starts() {
        let ok = LoginRequest::parse(br#"{"command":"id","env":["A=b c","PATH=/bin"]}"#).unwrap();
        assert_eq!(ok.command.as_deref(), Some("id"));
        assert_eq!(ok.env, ["A=b c", "PATH=/bin"]);
        assert_eq!(LoginRequest::parse(b"{}").unwrap(), LoginRequest::default());
        for (bad, says) in [
            (&br#"{"env":["NOEQUALS"]}"#[..], "not a NAME=value"),
            (br#"{"env":["=v"]}"#, "not a NAME=value"),
            (br#"{"env":["A=\u0000"]}"#, "not a NAME=value"),
            (br#"{"command":"a\u0000b"}"#, "NUL"),
            (br#"{"shell":"/bin/evil"}"#, "unknown field"),
            (
                br#"{"limits":[{"resource":7,"soft":1,"hard":1}]}"#,
                "unknown field",
            ),
            (b"not json", "a bad login request"),
        ] {
            let err = LoginRequest::parse(bad).unwrap_err();
            assert!(err.contains(says), "{err}");
        }
        let many = serde_json::to_vec(&LoginRequest {
            env: (0..=MAX_ENV).map(|i| format!("V{i}=x")).collect(),
            ..LoginRequest::default()
        })
        .unwrap();
        assert!(LoginRequest::parse(&many).unwrap_err().contains("at most"));
    }

    #[test]
    fn logins_of_a_uid_are_counted_until_they_end() {
        let per_uid = PerUid::default();
        let a: Vec<Turn> = (0..3).map(|_| per_uid.enter(7, 3).unwrap()).collect();
        assert!(per_uid.enter(7, 3).is_none());
        assert!(per_uid.enter(8, 3).is_some());
        drop(a);
        assert!(per_uid.enter(7, 3).is_some());
    }
}
