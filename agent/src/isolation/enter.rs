//! Putting SSH logins into their slot's cgroup: the agent's placement socket and the
//! `slotpool-agent enter-slot` helper.
//!
//! sshd runs the helper for every login of a slot user (`ForceCommand`, see
//! ARCHITECTURE.md for the `sshd_config` lines). The helper runs as the slot user; it
//! connects to `<run-dir>/<namespace>.sock` (the namespace is its user name without
//! `s<slot>`), and the agent moves the *connecting process* into the slot's cgroup. The
//! agent believes only the kernel: the uid and pid come from `SO_PEERCRED`, so a user
//! can only ever move itself into its own slot. On `ok` the helper execs the user's
//! shell (or `$SSH_ORIGINAL_COMMAND` through it), so the shell and everything it starts,
//! daemons included, are in the cgroup. When the agent does not answer, the login is
//! refused: a login never runs outside its slot's limits.
//!
//! When slots have network namespaces ([`crate::isolation::netns`]) the answer is `ok netns` with
//! the slot's user and network namespaces attached (`SCM_RIGHTS`): the helper joins the
//! user namespace, then the network namespace, then execs; a helper that cannot join
//! refuses the login rather than run it in the host's network.
//!
//! The socket is open to every user of the host (it has to be: sshd runs the helper as
//! the slot user), so it is bounded like slotpool's other listeners: at most
//! [`MAX_PLACING`] placements in flight (more connections wait in the kernel's backlog,
//! holding no descriptor of the agent), at most [`MAX_PLACING_PER_UID`] of one uid (more
//! are refused at once, so one slot cannot make the others' logins wait), a pause after
//! an accept error, and the line logged per placement limited to [`LOG_BURST`] per slot
//! and [`LOG_EVERY`] (the next one says how many were not logged).

use crate::isolation::passwd;
use crate::isolation::SlotIsolation;
use slotpool_protocol::listener::{AcceptErrors, Throttle};
use std::collections::HashMap;
use std::ffi::CString;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

/// The agent's answer when the login was placed.
const OK: &str = "ok\n";
/// The agent's answer when the login was placed and must join the two namespaces sent
/// with it (user, then network: see [`crate::isolation::netns`]).
const OK_NETNS: &str = "ok netns\n";

/// Longest the helper waits for the agent's answer.
pub const ENTER_TIMEOUT: Duration = Duration::from_secs(10);
/// Placements in flight at once, all uids together.
pub const MAX_PLACING: usize = 64;
/// Placements in flight at once for one uid; more are refused at once.
pub const MAX_PLACING_PER_UID: usize = 16;
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

/// Answers placement requests until `shutdown`, then removes the socket file.
pub async fn serve(
    listener: UnixListener,
    path: PathBuf,
    isolation: Arc<dyn SlotIsolation>,
    shutdown: CancellationToken,
) {
    let placing_places = Arc::new(tokio::sync::Semaphore::new(MAX_PLACING));
    let accept_errors = AcceptErrors::new("placement socket");
    let placing = Arc::new(PerUid::default());
    let logged = Arc::new(PlacementLog::default());
    loop {
        // A placement never waits on its client (the answer is a few bytes), so one in
        // flight ends soon; connections beyond wait in the kernel's backlog.
        let place = tokio::select! {
            () = shutdown.cancelled() => break,
            place = placing_places.clone().acquire_owned() => place.expect("never closed"),
        };
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let mut stream = match accepted {
            Ok((stream, _)) => stream,
            Err(err) => {
                accept_errors.failed(&err).await;
                continue;
            }
        };
        let isolation = isolation.clone();
        let placing = placing.clone();
        let logged = logged.clone();
        tokio::spawn(async move {
            let _place = place;
            let (answer, namespaces) = match stream.peer_cred() {
                Ok(cred) => match cred.pid() {
                    Some(pid) => match placing.enter(cred.uid()) {
                        Some(_turn) => place_login(&isolation, cred.uid(), pid, &logged).await,
                        None => (
                            format!(
                                "error: uid {} has {MAX_PLACING_PER_UID} logins being placed already; try again\n",
                                cred.uid()
                            ),
                            None,
                        ),
                    },
                    None => ("error: no peer pid\n".to_string(), None),
                },
                Err(err) => (format!("error: peer credentials: {err}\n"), None),
            };
            if answer != OK && answer != OK_NETNS {
                if let Some(quiet) = logged.refusals.take(std::time::Instant::now()) {
                    tracing::warn!(
                        answer = answer.trim(),
                        not_logged = quiet,
                        "login not placed"
                    );
                }
            }
            let sent = match &namespaces {
                None => stream.write_all(answer.as_bytes()).await,
                Some(fds) => send_with_fds(&stream, answer.as_bytes(), fds).await,
            };
            if let Err(err) = sent {
                tracing::debug!(%err, "cannot answer a login");
            }
        });
    }
    let _ = std::fs::remove_file(&path);
}

/// Places the login `pid` of `uid`; the answer for the helper and the namespaces to
/// send with it.
async fn place_login(
    isolation: &Arc<dyn SlotIsolation>,
    uid: u32,
    pid: i32,
    logged: &PlacementLog,
) -> (String, Option<[OwnedFd; 2]>) {
    let result = tokio::task::spawn_blocking({
        let isolation = isolation.clone();
        move || {
            let slot = isolation.place(uid, pid)?;
            let namespaces = match slot {
                Some(slot) => isolation.network_namespaces(slot)?,
                None => None,
            };
            Ok::<_, crate::isolation::IsolationError>((slot, namespaces))
        }
    })
    .await;
    match result {
        Ok(Ok((Some(slot), namespaces))) => {
            if let Some(quiet) = logged.of_slot(slot) {
                tracing::info!(
                    slot,
                    uid,
                    pid,
                    netns = namespaces.is_some(),
                    not_logged = quiet,
                    "login placed in its slot cgroup"
                );
            }
            match namespaces {
                Some(ns) => (OK_NETNS.to_string(), Some(ns)),
                None => (OK.to_string(), None),
            }
        }
        Ok(Ok((None, _))) => (format!("error: uid {uid} is not a slot user\n"), None),
        Ok(Err(err)) => (format!("error: {err}\n"), None),
        Err(err) => (format!("error: {err}\n"), None),
    }
}

/// Placements in flight per uid.
#[derive(Default)]
struct PerUid(Mutex<HashMap<u32, usize>>);

/// One placement of a uid in flight; ends on drop.
struct Turn<'a> {
    of: &'a PerUid,
    uid: u32,
}

impl PerUid {
    /// A turn for `uid`, unless it has [`MAX_PLACING_PER_UID`] in flight.
    fn enter(&self, uid: u32) -> Option<Turn<'_>> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = map.entry(uid).or_insert(0);
        if *n >= MAX_PLACING_PER_UID {
            return None;
        }
        *n += 1;
        Some(Turn { of: self, uid })
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut map = self.of.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.uid);
            }
        }
    }
}

/// How many placement lines each slot may still log, and the refusals'.
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
    /// `Some(not logged since)` when a placement of `slot` may be logged now.
    fn of_slot(&self, slot: u32) -> Option<u64> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots
            .entry(slot)
            .or_insert_with(|| Throttle::new(LOG_BURST, LOG_EVERY))
            .take(std::time::Instant::now())
    }
}

/// Sends `bytes` with `fds` attached (`SCM_RIGHTS`) in one message.
async fn send_with_fds(
    stream: &tokio::net::UnixStream,
    bytes: &[u8],
    fds: &[OwnedFd; 2],
) -> std::io::Result<()> {
    use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let borrowed = [fds[0].as_fd(), fds[1].as_fd()];
    let sent = stream
        .async_io(tokio::io::Interest::WRITABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            control.push(SendAncillaryMessage::ScmRights(&borrowed));
            sendmsg(
                stream,
                &[std::io::IoSlice::new(bytes)],
                &mut control,
                SendFlags::NOSIGNAL,
            )
            .map_err(std::io::Error::from)
        })
        .await?;
    if sent != bytes.len() {
        return Err(std::io::Error::other("short write of the answer"));
    }
    Ok(())
}

/// Reads the agent's answer to the end, with the namespaces sent along with it.
fn read_answer(stream: &UnixStream) -> std::io::Result<(String, Vec<OwnedFd>)> {
    use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut answer = Vec::new();
    let mut fds = Vec::new();
    loop {
        let mut buf = [0u8; 512];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let msg = recvmsg(
            stream,
            &mut [std::io::IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )?;
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        if msg.bytes == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..msg.bytes]);
        if answer.len() > MAX_ANSWER {
            return Err(std::io::Error::other("the answer is too long"));
        }
    }
    Ok((String::from_utf8_lossy(&answer).into_owned(), fds))
}

/// Longest answer the helper reads.
const MAX_ANSWER: usize = 4096;

/// Joins the slot's user namespace, then its network namespace.
fn join_namespaces(fds: &[OwnedFd]) -> Result<(), EnterSlotError> {
    use rustix::thread::{move_into_link_name_space, LinkNameSpaceType};
    let [user, net] = fds else {
        return Err(EnterSlotError::Refused(format!(
            "the agent sent {} namespaces, not 2 (user, network)",
            fds.len()
        )));
    };
    for (fd, kind, name) in [
        (user, LinkNameSpaceType::User, "user"),
        (net, LinkNameSpaceType::Network, "network"),
    ] {
        move_into_link_name_space(fd.as_fd(), Some(kind)).map_err(|e| {
            EnterSlotError::Namespace {
                kind: name,
                error: e.into(),
            }
        })?;
    }
    Ok(())
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
    #[error("joining the slot's {kind} namespace: {error}")]
    Namespace {
        kind: &'static str,
        error: std::io::Error,
    },
    #[error("running {shell}: {error}")]
    Exec {
        shell: PathBuf,
        error: std::io::Error,
    },
}

/// The helper: has the agent place this process in its slot's cgroup, then replaces
/// itself with the user's shell (running `command` if given). Returns only on error.
pub fn enter_slot(run_dir: &Path, command: Option<String>) -> EnterSlotError {
    let uid = rustix::process::getuid().as_raw();
    let Some(name) = passwd::name_of(uid) else {
        return EnterSlotError::NoUser(uid);
    };
    let Some((namespace, _slot)) = passwd::split_user_name(&name) else {
        return EnterSlotError::NotSlotUser(name);
    };
    let path = socket_path(run_dir, namespace);
    let answer = (|| {
        let stream = UnixStream::connect(&path)?;
        stream.set_read_timeout(Some(ENTER_TIMEOUT))?;
        read_answer(&stream)
    })();
    let (answer, namespaces) = match answer {
        Ok(a) => a,
        Err(error) => return EnterSlotError::Agent { path, error },
    };
    let shell = passwd::lookup(&name)
        .map(|u| u.shell)
        .filter(|s| !s.as_os_str().is_empty())
        .unwrap_or_else(|| PathBuf::from("/bin/sh"));
    match answer.as_str() {
        OK if namespaces.is_empty() => {}
        // The slot has a network namespace: the login runs in it or not at all.
        OK_NETNS => {
            if let Err(err) = join_namespaces(&namespaces) {
                return err;
            }
            drop(namespaces);
        }
        _ => return EnterSlotError::Refused(answer.trim().to_string()),
    }
    exec_shell(&shell, command)
}

fn exec_shell(shell: &Path, command: Option<String>) -> EnterSlotError {
    use std::os::unix::ffi::OsStrExt;
    let exec_error = |error| EnterSlotError::Exec {
        shell: shell.to_path_buf(),
        error,
    };
    let Ok(c_shell) = CString::new(shell.as_os_str().as_bytes()) else {
        return exec_error(std::io::ErrorKind::InvalidInput.into());
    };
    let base = shell
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "sh".into());
    let args: Vec<CString> = match command {
        Some(cmd) => match CString::new(cmd) {
            Ok(cmd) => vec![CString::new(base).expect("no nul"), c"-c".into(), cmd],
            Err(_) => return exec_error(std::io::ErrorKind::InvalidInput.into()),
        },
        // A login shell: argv[0] starts with '-'.
        None => vec![CString::new(format!("-{base}")).expect("no nul")],
    };
    let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    // SAFETY: argv is a null-terminated array of valid C strings that outlive the call;
    // execv only returns on failure.
    unsafe { libc::execv(c_shell.as_ptr(), argv.as_ptr()) };
    exec_error(std::io::Error::last_os_error())
}
