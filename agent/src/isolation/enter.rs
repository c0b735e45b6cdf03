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
//! When slots have namespaces of their own (a network namespace,
//! [`crate::isolation::netns`]; a private `/tmp`, [`crate::isolation::private_tmp`]) the
//! answer is `ok ns` and their kinds in the order to join them (`ok ns user net mnt`),
//! with the namespaces attached (`SCM_RIGHTS`): the helper joins each, returns to its
//! working directory, then execs; a helper that cannot join refuses the login rather
//! than run it in the host's network or `/tmp`.
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
/// How the agent's answer starts when the login was placed and must join the namespaces
/// sent with it, whose kinds follow in order.
const OK_NS: &str = "ok ns";
/// Most namespaces sent with an answer.
const MAX_NAMESPACES: usize = 4;

/// A namespace a login joins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NsKind {
    User,
    Net,
    Mnt,
    Ipc,
}

impl NsKind {
    fn as_str(self) -> &'static str {
        match self {
            NsKind::User => "user",
            NsKind::Net => "net",
            NsKind::Mnt => "mnt",
            NsKind::Ipc => "ipc",
        }
    }

    fn parse(word: &str) -> Option<NsKind> {
        [NsKind::User, NsKind::Net, NsKind::Mnt, NsKind::Ipc]
            .into_iter()
            .find(|k| k.as_str() == word)
    }
}

/// The answer for a login that joins `namespaces`, in their order.
fn ok_answer(namespaces: &[(NsKind, OwnedFd)]) -> String {
    if namespaces.is_empty() {
        return OK.to_string();
    }
    let kinds: Vec<&str> = namespaces.iter().map(|(k, _)| k.as_str()).collect();
    format!("{OK_NS} {}\n", kinds.join(" "))
}

/// The kinds an `ok ns` answer lists, or `None` for any other answer.
fn parse_ok_ns(answer: &str) -> Option<Vec<NsKind>> {
    let rest = answer
        .strip_suffix('\n')?
        .strip_prefix(OK_NS)?
        .strip_prefix(' ')?;
    let kinds: Option<Vec<NsKind>> = rest.split_whitespace().map(NsKind::parse).collect();
    kinds.filter(|k| !k.is_empty() && k.len() <= MAX_NAMESPACES)
}

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
            if answer != OK && !answer.starts_with(OK_NS) {
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
) -> (String, Option<Vec<OwnedFd>>) {
    let result = tokio::task::spawn_blocking({
        let isolation = isolation.clone();
        move || {
            let slot = isolation.place(uid, pid)?;
            let namespaces = match slot {
                Some(slot) => isolation.login_namespaces(slot)?,
                None => Vec::new(),
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
                    namespaces = namespaces.len(),
                    not_logged = quiet,
                    "login placed in its slot cgroup"
                );
            }
            let answer = ok_answer(&namespaces);
            let fds: Vec<OwnedFd> = namespaces.into_iter().map(|(_, fd)| fd).collect();
            (answer, (!fds.is_empty()).then_some(fds))
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
    fds: &[OwnedFd],
) -> std::io::Result<()> {
    use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let borrowed: Vec<std::os::fd::BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
    let sent = stream
        .async_io(tokio::io::Interest::WRITABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_NAMESPACES))];
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
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_NAMESPACES))];
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

/// Joins `fds`, namespaces of the `kinds` in that order; a mount namespace moves the
/// process to its root, so it goes back to the directory it was in.
fn join_namespaces(kinds: &[NsKind], fds: &[OwnedFd]) -> Result<(), EnterSlotError> {
    use rustix::thread::{move_into_link_name_space, LinkNameSpaceType};
    if kinds.len() != fds.len() {
        return Err(EnterSlotError::Refused(format!(
            "the agent named {} namespaces but sent {}",
            kinds.len(),
            fds.len()
        )));
    }
    let cwd = std::env::current_dir().ok();
    for (kind, fd) in kinds.iter().zip(fds) {
        let link = match kind {
            NsKind::User => LinkNameSpaceType::User,
            NsKind::Net => LinkNameSpaceType::Network,
            NsKind::Mnt => LinkNameSpaceType::Mount,
            NsKind::Ipc => LinkNameSpaceType::InterProcessCommunication,
        };
        move_into_link_name_space(fd.as_fd(), Some(link)).map_err(|e| {
            EnterSlotError::Namespace {
                kind: kind.as_str(),
                error: e.into(),
            }
        })?;
    }
    if kinds.contains(&NsKind::Mnt) {
        if let Some(cwd) = cwd {
            // Where the login started (its home): there in the new namespace too.
            let _ = std::env::set_current_dir(cwd);
        }
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
        // The slot has namespaces of its own: the login runs in them or not at all.
        other => match parse_ok_ns(other) {
            Some(kinds) => {
                if let Err(err) = join_namespaces(&kinds, &namespaces) {
                    return err;
                }
                drop(namespaces);
            }
            None => return EnterSlotError::Refused(answer.trim().to_string()),
        },
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
    fn an_ok_ns_answer_lists_its_kinds_in_order_and_nothing_else_passes() {
        assert_eq!(ok_answer(&[]), OK);
        assert_eq!(
            parse_ok_ns("ok ns user net mnt\n"),
            Some(vec![NsKind::User, NsKind::Net, NsKind::Mnt])
        );
        assert_eq!(
            parse_ok_ns("ok ns user mnt\n"),
            Some(vec![NsKind::User, NsKind::Mnt])
        );
        assert_eq!(
            parse_ok_ns("ok ns user net mnt ipc\n"),
            Some(vec![NsKind::User, NsKind::Net, NsKind::Mnt, NsKind::Ipc])
        );
        for bad in [
            "ok\n",
            "ok ns\n",
            "ok ns pid\n",
            "ok nsuser\n",
            "ok ns user",
            "ok ns user net mnt ipc user\n",
            "error: ok ns user\n",
        ] {
            assert_eq!(parse_ok_ns(bad), None, "{bad:?}");
        }
    }
}
