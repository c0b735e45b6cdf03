//! Commands run in slots for the clients that hold them ([`AgentCommand::Exec`], the
//! wire contract in [`slotpool_protocol::exec`]).
//!
//! A launcher has checked that the client holds the node; the agent checks the slot is
//! prepared for that node, starts the command and binds the session to the client. Input
//! is accepted only from that client's own subject (the bus lets no one else publish
//! there), output goes to that client's inbox (no one else may read it) under a subject
//! naming this backing node: the only output subjects its credential may publish to, so
//! it cannot speak in sessions on other nodes.
//!
//! Placement: with slot users the command is started inside the slot as its user exactly
//! as a login's shell is ([`crate::isolation::start`]: its cgroup, its namespaces, its
//! ids), run by the user's shell as `ssh node CMD` would, in a session of its own.
//! Without slot users it runs as the agent's user in the workspace, in a process group
//! of its own.
//!
//! Memory: the agent reads a pipe only while the client may receive another chunk (at
//! most `window` unacknowledged), so a slow reader stalls the command in its pipe,
//! never the agent; stdin waits in a queue of [`STDIN_WINDOW`] chunks.
//!
//! [`AgentCommand::Exec`]: slotpool_protocol::api::AgentCommand::Exec

use crate::isolation::passwd;
use crate::isolation::start::{Settings, SlotEntry};
use crate::slots::Slots;
use bytes::Bytes;
use slotpool_protocol::api::{ApiError, ErrorCode};
use slotpool_protocol::connect::{Bus, BusError, Incoming};
use slotpool_protocol::exec::{
    check_request, signal_number, ExecExit, ExecRequest, CALLER_SILENCE_SECS, DEFAULT_WINDOW,
    IN_ACK, IN_SIGNAL, IN_STDIN, MAX_CHUNK_BYTES, OUT_EXIT, OUT_STDERR, OUT_STDIN_ACK, OUT_STDOUT,
    STDIN_WINDOW,
};
use slotpool_protocol::layout::subjects;
use slotpool_protocol::{BackingId, NodeId, UserName};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Most commands running at once on this agent; more are refused `unavailable`.
pub const MAX_SESSIONS: usize = 256;
/// How long output is still forwarded after the command exited (a child it left
/// holding the pipes is killed with its process group; one that escaped it is cut off).
pub const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(5);
/// The `PATH` a command starts with unless the request sets one.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin";

/// What a client sent to one of its running commands.
#[derive(Debug)]
enum Input {
    Stdin(Bytes),
    Ack(u64),
    Signal(i32),
}

/// Where a running command's input goes. Stdin chunks queue (a caller keeps to the
/// stdin window, so the queue never fills unless it does not; then chunks are dropped).
/// Acknowledgements are cumulative and a signal is the latest sent (KILL, once sent, is
/// never replaced), so neither queues: a caller's flood of acks can never push out its
/// KILL.
struct SessionInput {
    stdin: mpsc::Sender<Bytes>,
    acked: watch::Sender<u64>,
    signal: watch::Sender<Option<i32>>,
}

/// The running command's side of [`SessionInput`].
struct InputRx {
    stdin: mpsc::Receiver<Bytes>,
    acked: watch::Receiver<u64>,
    signal: watch::Receiver<Option<i32>>,
}

fn session_input() -> (SessionInput, InputRx) {
    let (stdin, stdin_rx) = mpsc::channel(STDIN_WINDOW as usize + 8);
    let (acked, acked_rx) = watch::channel(0);
    let (signal, signal_rx) = watch::channel(None);
    (
        SessionInput {
            stdin,
            acked,
            signal,
        },
        InputRx {
            stdin: stdin_rx,
            acked: acked_rx,
            signal: signal_rx,
        },
    )
}

impl SessionInput {
    fn take(&self, input: Input) {
        match input {
            Input::Stdin(bytes) => {
                if self.stdin.try_send(bytes).is_err() {
                    tracing::warn!("stdin chunk beyond the window dropped");
                }
            }
            Input::Ack(n) => self.acked.send_modify(|a| *a = (*a).max(n)),
            // KILL, once sent, is never replaced by a weaker signal.
            Input::Signal(n) => self.signal.send_modify(|s| {
                if *s != Some(libc::SIGKILL) {
                    *s = Some(n);
                }
            }),
        }
    }
}

/// Each running command's input, by client and session.
type Sessions = HashMap<(UserName, String), SessionInput>;

/// The running commands, by (client, session), and what they need to start.
#[derive(Clone)]
pub struct Runner {
    sessions: Arc<Mutex<Sessions>>,
    bus: Bus,
    /// This agent's backing node: the output subjects its credential may publish to
    /// name it.
    backing: BackingId,
    shutdown: CancellationToken,
}

impl Runner {
    pub fn new(bus: Bus, backing: BackingId, shutdown: CancellationToken) -> Runner {
        Runner {
            sessions: Arc::default(),
            bus,
            backing,
            shutdown,
        }
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts `request` in `slot` for `client`; returns once it runs.
    pub fn start(
        &self,
        slots: &Slots,
        slot: u32,
        node_id: &NodeId,
        client: UserName,
        request: ExecRequest,
    ) -> Result<(), ApiError> {
        check_request(&request, client.as_str())
            .map_err(|m| ApiError::new(ErrorCode::BadRequest, m))?;
        if !slots
            .reports()
            .iter()
            .any(|r| r.slot == slot && &r.node_id == node_id)
        {
            return Err(ApiError::new(
                ErrorCode::NotFound,
                format!("slot {slot} is not prepared for node {node_id}"),
            ));
        }
        let key = (client.clone(), request.session.clone());
        let (tx, rx) = session_input();
        {
            let mut sessions = self.sessions();
            if sessions.len() >= MAX_SESSIONS {
                return Err(ApiError::new(
                    ErrorCode::Unavailable,
                    format!("{MAX_SESSIONS} commands already run on this node; retry later"),
                ));
            }
            if sessions.contains_key(&key) {
                return Err(ApiError::new(
                    ErrorCode::BadRequest,
                    format!("session {} is already running", request.session),
                ));
            }
            sessions.insert(key.clone(), tx);
        }
        let isolation = slots.isolation();
        let workspace = isolation.workspace(slot);
        let entry = match isolation.username(slot) {
            None => Ok(None),
            Some(name) => passwd::lookup(&name)
                .ok_or_else(|| format!("slot user {name} does not exist"))
                .and_then(|user| {
                    isolation
                        .slot_entry(user.uid, None)
                        .map_err(|e| e.to_string())
                })
                .and_then(|entry| {
                    entry
                        .map(Some)
                        .ok_or_else(|| format!("slot {slot} has no prepared user"))
                }),
        };
        let child = match entry
            .map_err(std::io::Error::other)
            .and_then(|entry| self.spawn(&request, workspace, entry))
        {
            Ok(child) => child,
            Err(err) => {
                self.sessions().remove(&key);
                return Err(ApiError::new(
                    ErrorCode::Internal,
                    format!("cannot start {:?}: {err}", request.argv[0]),
                ));
            }
        };
        let runner = self.clone();
        let span = tracing::info_span!("exec", slot, %node_id, %client, session = %request.session);
        tokio::spawn(
            async move {
                let output =
                    subjects::exec_output(&request.inbox, &request.session, &runner.backing);
                let exit = runner.run(child, &request, &output, rx).await;
                tracing::info!(code = ?exit.code, signal = ?exit.signal, timed_out = exit.timed_out, error = ?exit.error, "command ended");
                let json = serde_json::to_vec(&exit).expect("exit serializes");
                if let Err(err) = runner
                    .bus
                    .publish_raw(format!("{output}.{OUT_EXIT}"), json.into())
                    .await
                {
                    tracing::warn!(%err, "cannot send the exit");
                }
                runner.sessions().remove(&key);
            }
            .instrument(span),
        );
        Ok(())
    }

    /// Starts the command: inside the slot as its user, or directly.
    fn spawn(
        &self,
        request: &ExecRequest,
        workspace: PathBuf,
        entry: Option<SlotEntry>,
    ) -> std::io::Result<tokio::process::Child> {
        let mut command = match entry {
            Some(entry) => {
                let mut c = tokio::process::Command::new(&entry.shell);
                let base = entry
                    .shell
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "sh".into());
                c.arg0(base)
                    .arg("-c")
                    .arg(shell_command(&request.argv))
                    .env_clear()
                    .env("HOME", &entry.home)
                    .env("USER", &entry.user)
                    .env("LOGNAME", &entry.user)
                    .env("SHELL", &entry.shell);
                // A session of its own, so its process group is its pid.
                entry.apply(
                    &mut c,
                    Settings {
                        cwd: workspace,
                        ..Settings::default()
                    },
                );
                c
            }
            None => {
                let mut c = tokio::process::Command::new(&request.argv[0]);
                c.args(&request.argv[1..])
                    .env_clear()
                    .env("HOME", &workspace)
                    .current_dir(&workspace)
                    .process_group(0);
                c
            }
        };
        command
            .env("PATH", DEFAULT_PATH)
            .envs(&request.env)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        command.spawn()
    }

    /// Pumps one command's input and output until it ended; returns how.
    async fn run(
        &self,
        mut child: tokio::process::Child,
        request: &ExecRequest,
        output: &str,
        mut input: InputRx,
    ) -> ExecExit {
        let pgid = child.id().map(|p| p as i32);
        let kill = |signal: i32| {
            if let Some(pgid) = pgid {
                // SAFETY: kill(2) on the command's own process group.
                unsafe { libc::kill(-pgid, signal) };
            }
        };
        let mut stdout = child.stdout.take();
        let mut stderr = child.stderr.take();
        let stdin = child.stdin.take();
        // Stdin is written by a task of its own, so a command that does not read its
        // input never stops its output from flowing.
        let (stdin_tx, stdin_rx) = mpsc::channel::<Bytes>(STDIN_WINDOW as usize);
        let writer = tokio::spawn(write_stdin(
            stdin,
            stdin_rx,
            self.bus.clone(),
            format!("{output}.{OUT_STDIN_ACK}"),
        ));
        let mut stdin_tx = Some(stdin_tx);
        let window = u64::from(request.window.unwrap_or(DEFAULT_WINDOW));
        let deadline = request
            .timeout_secs
            .map(|s| Instant::now() + Duration::from_secs(s));
        let silence = Duration::from_secs(CALLER_SILENCE_SECS);
        let (mut sent, mut acked) = (0u64, 0u64);
        let mut last_heard = Instant::now();
        let mut out_buf = vec![0u8; MAX_CHUNK_BYTES];
        let mut err_buf = vec![0u8; MAX_CHUNK_BYTES];
        let mut exit = ExecExit::default();
        let mut status = None;
        let mut drain_until = None;
        let far = Instant::now() + Duration::from_secs(365 * 24 * 3600);
        loop {
            if status.is_some() && stdout.is_none() && stderr.is_none() {
                break;
            }
            let credit = sent - acked < window;
            tokio::select! {
                read = read_some(&mut stdout, &mut out_buf), if credit && stdout.is_some() => {
                    match read {
                        Some(n) => {
                            sent += 1;
                            if self.send(output, OUT_STDOUT, &out_buf[..n]).await.is_err() { break; }
                        }
                        None => stdout = None,
                    }
                }
                read = read_some(&mut stderr, &mut err_buf), if credit && stderr.is_some() => {
                    match read {
                        Some(n) => {
                            sent += 1;
                            if self.send(output, OUT_STDERR, &err_buf[..n]).await.is_err() { break; }
                        }
                        None => stderr = None,
                    }
                }
                got = input.stdin.recv() => {
                    if let Some(bytes) = got {
                        last_heard = Instant::now();
                        match (&stdin_tx, bytes.is_empty()) {
                            (Some(_), true) => stdin_tx = None,
                            (Some(tx), false) => {
                                if tx.try_send(bytes).is_err() {
                                    tracing::warn!("stdin chunk beyond the window dropped");
                                }
                            }
                            (None, _) => {}
                        }
                    }
                }
                Ok(()) = input.acked.changed() => {
                    last_heard = Instant::now();
                    let n = *input.acked.borrow_and_update();
                    acked = acked.max(n.min(sent));
                }
                Ok(()) = input.signal.changed() => {
                    last_heard = Instant::now();
                    let signal = *input.signal.borrow_and_update();
                    if let Some(signal) = signal {
                        tracing::info!(signal, "signal from the caller");
                        kill(signal);
                    }
                }
                waited = child.wait(), if status.is_none() => {
                    let waited = waited.ok();
                    status = Some(waited);
                    // What it left in its process group goes with it.
                    kill(libc::SIGKILL);
                    drain_until = Some(Instant::now() + DRAIN_AFTER_EXIT);
                }
                () = tokio::time::sleep_until(deadline.unwrap_or(far)), if deadline.is_some() && status.is_none() && !exit.timed_out => {
                    tracing::info!("time limit reached; killing the command");
                    exit.timed_out = true;
                    kill(libc::SIGKILL);
                }
                () = tokio::time::sleep_until(last_heard + silence), if !credit => {
                    exit.error = Some(format!("the caller acknowledged nothing for {CALLER_SILENCE_SECS}s; command stopped"));
                    kill(libc::SIGKILL);
                    break;
                }
                () = tokio::time::sleep_until(drain_until.unwrap_or(far)), if drain_until.is_some() => {
                    tracing::warn!("output still open after the command exited; cut off");
                    break;
                }
                () = self.shutdown.cancelled() => {
                    exit.error = Some("the agent is stopping".into());
                    kill(libc::SIGKILL);
                    break;
                }
            }
        }
        drop(stdin_tx);
        writer.abort();
        let status = match status {
            Some(s) => s,
            None => {
                kill(libc::SIGKILL);
                child.wait().await.ok()
            }
        };
        if let Some(status) = status {
            use std::os::unix::process::ExitStatusExt;
            exit.code = status.code();
            exit.signal = status.signal();
        }
        exit
    }

    async fn send(&self, output: &str, kind: &str, bytes: &[u8]) -> Result<(), ()> {
        self.bus
            .publish_raw(format!("{output}.{kind}"), Bytes::copy_from_slice(bytes))
            .await
            .map_err(|err| tracing::warn!(%err, "cannot send output"))
    }

    /// Subscribes to clients' input to the commands of backing node `backing`.
    pub async fn subscribe_input(
        &self,
        backing: &BackingId,
    ) -> Result<impl futures::Stream<Item = Incoming> + Send + 'static, BusError> {
        self.bus
            .serve(&subjects::exec_input_to(backing.as_str()), None)
            .await
    }

    /// Routes clients' input to their sessions until shutdown. Input for no running
    /// session of that client (ended, or someone else's) is dropped.
    pub async fn serve_input(self, messages: impl futures::Stream<Item = Incoming>) {
        use futures::StreamExt;
        let mut messages = Box::pin(messages);
        loop {
            let msg = tokio::select! {
                () = self.shutdown.cancelled() => return,
                msg = messages.next() => match msg { Some(m) => m, None => return },
            };
            self.route(&msg);
        }
    }

    fn route(&self, msg: &Incoming) {
        let Some((client, _backing, session, kind)) = subjects::parse_exec_input(&msg.subject)
        else {
            return;
        };
        let input = match kind {
            IN_STDIN if msg.payload.len() <= MAX_CHUNK_BYTES => Input::Stdin(msg.payload.clone()),
            IN_ACK => match std::str::from_utf8(&msg.payload)
                .ok()
                .and_then(|s| s.trim().parse().ok())
            {
                Some(n) => Input::Ack(n),
                None => return,
            },
            IN_SIGNAL => match std::str::from_utf8(&msg.payload)
                .ok()
                .and_then(signal_number)
            {
                Some(n) => Input::Signal(n),
                None => return,
            },
            _ => return,
        };
        let sessions = self.sessions();
        if let Some(tx) = sessions.get(&(client, session.to_string())) {
            tx.take(input);
        }
    }
}

/// Reads a chunk from `pipe`: `None` at its end (or on an error).
async fn read_some<R: tokio::io::AsyncRead + Unpin>(
    pipe: &mut Option<R>,
    buf: &mut [u8],
) -> Option<usize> {
    let p = pipe.as_mut()?;
    match p.read(buf).await {
        Ok(0) | Err(_) => None,
        Ok(n) => Some(n),
    }
}

/// Writes stdin chunks as they come, acknowledging each (the running count) once
/// written; closes the command's stdin when the queue closes.
async fn write_stdin(
    stdin: Option<tokio::process::ChildStdin>,
    mut chunks: mpsc::Receiver<Bytes>,
    bus: Bus,
    ack_subject: String,
) {
    let Some(mut stdin) = stdin else { return };
    let mut written = 0u64;
    while let Some(chunk) = chunks.recv().await {
        if stdin.write_all(&chunk).await.is_err() {
            // The command closed its input: keep acknowledging so the caller finishes.
            while chunks.recv().await.is_some() {
                written += 1;
                let _ = bus
                    .publish_raw(ack_subject.clone(), written.to_string().into())
                    .await;
            }
            return;
        }
        written += 1;
        let _ = bus
            .publish_raw(ack_subject.clone(), written.to_string().into())
            .await;
    }
}

/// `argv` as one POSIX shell command line that runs exactly `argv` (each word quoted).
pub fn shell_command(argv: &[String]) -> String {
    argv.iter()
        .map(|a| format!("'{}'", a.replace('\'', r"'\''")))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_acks_never_pushes_out_a_signal() {
        let (input, mut rx) = session_input();
        for n in 0..10_000 {
            input.take(Input::Ack(n));
        }
        input.take(Input::Signal(libc::SIGKILL));
        input.take(Input::Signal(libc::SIGTERM));
        for _ in 0..100 {
            input.take(Input::Stdin(Bytes::from_static(b"x")));
        }
        assert_eq!(*rx.acked.borrow_and_update(), 9_999);
        assert_eq!(*rx.signal.borrow_and_update(), Some(libc::SIGKILL));
        // Stdin beyond the window is dropped, not queued without end.
        let mut queued = 0;
        while rx.stdin.try_recv().is_ok() {
            queued += 1;
        }
        assert_eq!(queued, STDIN_WINDOW as usize + 8);
    }

    #[test]
    fn shell_command_keeps_every_word() {
        let argv: Vec<String> = ["sh", "-c", "echo 'a b' \"$X\"; exit 3", ""]
            .map(String::from)
            .to_vec();
        let line = shell_command(&argv);
        let out = std::process::Command::new("sh")
            .args([
                "-c",
                &format!("for a in {line}; do printf '[%s]' \"$a\"; done"),
            ])
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8(out.stdout).unwrap(),
            "[sh][-c][echo 'a b' \"$X\"; exit 3][]"
        );
    }
}
