//! The execute channel over HTTP, for clients without NATS: `/api/v1/nodes/{id}/exec`
//! (a WebSocket: stdin in, stdout and stderr out, the exit at the end) and
//! `/api/v1/nodes/{id}/file?path=P` (PUT a file into the node's workspace, GET one out).
//! The contract is docs/http.md, "Running commands".
//!
//! Each route is a bridge onto the bus's execute channel ([`slotpool_protocol::exec`]),
//! run by the launcher *as the HTTP caller*: the request goes through
//! [`crate::exec_api::start`], the same check as on the bus (the node is the caller's
//! and ready), with the caller's inbox, so the agent binds the session to that client
//! exactly as for a bus client. Flow control is kept end to end: an output chunk is
//! acknowledged to the agent only once it is written to the HTTP connection, and stdin
//! is read from the connection only while the agent's stdin window has room, so neither
//! a slow HTTP reader nor a fast writer grows the launcher's memory.

use crate::exec_api;
use crate::nodes;
use crate::shared::Shared;
use bytes::Bytes;
use futures::{SinkExt, Stream, StreamExt};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use rand::distr::{Alphanumeric, SampleString};
use serde::{Deserialize, Serialize};
use slotpool_protocol::api::{ApiError, ErrorCode};
use slotpool_protocol::connect::Incoming;
use slotpool_protocol::exec::{
    self, ExecExit, ExecRequest, IN_ACK, IN_SIGNAL, IN_STDIN, MAX_CHUNK_BYTES, OUT_EXIT,
    OUT_STDERR, OUT_STDIN_ACK, OUT_STDOUT, SIGNALS, STDIN_WINDOW,
};
use slotpool_protocol::model::NodeState;
use slotpool_protocol::{NodeId, UserName, PROTOCOL_VERSION};
use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;

/// Tag of a stdout frame (the first byte of a binary message the server sends).
pub const FRAME_STDOUT: u8 = 1;
/// Tag of a stderr frame.
pub const FRAME_STDERR: u8 = 2;
/// How often an exec WebSocket is pinged while nothing moves, to stay under the
/// listener's idle limit while a command runs silently.
pub(crate) const PING_EVERY: Duration = Duration::from_secs(20);
/// How long the client may take to send the command after the upgrade.
const START_MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);
/// How much of a failed file command's stderr is kept for the error answer.
const ERROR_TEXT_BYTES: usize = 4096;
/// The longest a close handshake may take.
const CLOSE_LIMIT: Duration = Duration::from_secs(5);

/// The first message a client sends on an exec WebSocket (a text message).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecStart {
    /// The command and its arguments (no shell unless `argv` names one).
    pub argv: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Kill the command after this many seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
}

/// A text message the client sends after [`ExecStart`]: a signal for the command, or
/// the end of its stdin.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum ExecControl {
    /// One of `INT`, `TERM`, `KILL`, `HUP`, `QUIT`.
    Signal(String),
    /// No more stdin (as an empty binary message).
    Eof(bool),
}

/// A text message the server sends: the command started, how it ended, or why it could
/// not run or was cut off (each of the last two is the last message before the close).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecEvent {
    Started { session: String },
    Exit(ExecExit),
    Error(ApiError),
}

/// What came out of the command.
pub(crate) enum Out {
    Stdout(Bytes),
    Stderr(Bytes),
    Exit(ExecExit),
    /// The agent took more stdin: [`Channel::may_send_stdin`] may have changed.
    StdinTaken,
    /// The node is no longer the caller's ready node, or the bus went away.
    Lost(ApiError),
}

/// One command running in a node, driven from the launcher for an HTTP caller.
pub(crate) struct Channel {
    shared: Arc<Shared>,
    caller: UserName,
    node: NodeId,
    input: String,
    output: Pin<Box<dyn Stream<Item = Incoming> + Send>>,
    received: u64,
    stdin_sent: u64,
    stdin_acked: u64,
    /// Bumped by every write of the node's slot record (and its request's): the node
    /// is looked at again then, and only then.
    node_changed: tokio::sync::watch::Receiver<u64>,
    ended: bool,
}

impl Channel {
    /// Starts `argv` in `node` as `caller` (the same checks as the bus API's `exec`).
    pub(crate) async fn open(
        shared: &Arc<Shared>,
        caller: &UserName,
        node: NodeId,
        start: ExecStart,
    ) -> Result<Channel, ApiError> {
        let request = ExecRequest {
            v: PROTOCOL_VERSION,
            node_id: node.clone(),
            argv: start.argv,
            env: start.env,
            timeout_secs: start.timeout_secs,
            session: Alphanumeric.sample_string(&mut rand::rng(), 26),
            inbox: format!("_INBOX.client.{caller}"),
            window: None,
        };
        // Output from the agent of the node's own backing node only.
        let output = exec::output_of(&request)
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no node {node}")))?;
        let output = shared
            .bus
            .serve(&format!("{output}.>"), None)
            .await
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        let record = nodes::record(shared, &node)
            .await
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no node {node}")))?;
        let node_changed = shared
            .signals
            .subscribe(&crate::shared::request_topic(&record.request_id));
        let started = exec_api::start(shared, caller, request).await?;
        Ok(Channel {
            shared: shared.clone(),
            caller: caller.clone(),
            node,
            input: started.input,
            output: Box::pin(output),
            received: 0,
            stdin_sent: 0,
            stdin_acked: 0,
            node_changed,
            ended: false,
        })
    }

    /// The next output (stdin acknowledgements are taken in passing). After a chunk,
    /// call [`Channel::ack`] once it has been passed on.
    pub(crate) async fn next(&mut self) -> Out {
        loop {
            tokio::select! {
                msg = self.output.next() => {
                    let Some(msg) = msg else {
                        return Out::Lost(ApiError::new(ErrorCode::Unavailable, "the launcher lost its bus connection"));
                    };
                    match msg.subject.rsplit('.').next().unwrap_or_default() {
                        OUT_STDOUT => return Out::Stdout(msg.payload),
                        OUT_STDERR => return Out::Stderr(msg.payload),
                        OUT_STDIN_ACK => {
                            if let Some(n) = std::str::from_utf8(&msg.payload).ok().and_then(|s| s.parse().ok()) {
                                self.stdin_acked = n;
                                return Out::StdinTaken;
                            }
                        }
                        OUT_EXIT => {
                            self.ended = true;
                            let exit = serde_json::from_slice(&msg.payload).unwrap_or_else(|e| ExecExit {
                                error: Some(format!("unreadable exit message: {e}")),
                                ..ExecExit::default()
                            });
                            return Out::Exit(exit);
                        }
                        _ => {}
                    }
                }
                changed = self.node_changed.changed() => {
                    if changed.is_err() {
                        return Out::Lost(ApiError::new(ErrorCode::Unavailable, "the launcher is stopping"));
                    }
                    if let Some(lost) = self.lost().await {
                        return Out::Lost(lost);
                    }
                }
            }
        }
    }

    /// Why the node no longer runs this command, if it does not.
    async fn lost(&mut self) -> Option<ApiError> {
        match nodes::record(&self.shared, &self.node).await {
            Ok(Some(n))
                if n.state == NodeState::Ready && n.client.as_ref() == Some(&self.caller) =>
            {
                None
            }
            Ok(_) => Some(ApiError::new(
                ErrorCode::Ended,
                format!("node {} was lost while the command ran", self.node),
            )),
            Err(_) => None,
        }
    }

    /// Tells the agent one more output chunk was taken.
    pub(crate) async fn ack(&mut self) {
        self.received += 1;
        let _ = self
            .shared
            .bus
            .publish_raw(
                format!("{}.{IN_ACK}", self.input),
                self.received.to_string().into(),
            )
            .await;
    }

    /// Whether the agent's stdin window has room for another chunk.
    pub(crate) fn may_send_stdin(&self) -> bool {
        self.stdin_sent.saturating_sub(self.stdin_acked) < STDIN_WINDOW
    }

    /// Sends one stdin chunk (at most [`MAX_CHUNK_BYTES`]; empty is the end of stdin).
    pub(crate) async fn stdin(&mut self, chunk: Bytes) {
        debug_assert!(chunk.len() <= MAX_CHUNK_BYTES);
        self.stdin_sent += 1;
        let _ = self
            .shared
            .bus
            .publish_raw(format!("{}.{IN_STDIN}", self.input), chunk)
            .await;
    }

    /// Sends signal `name` (one of [`SIGNALS`]) to the command.
    pub(crate) async fn signal(&mut self, name: &'static str) {
        let _ = self
            .shared
            .bus
            .publish_raw(
                format!("{}.{IN_SIGNAL}", self.input),
                Bytes::from_static(name.as_bytes()),
            )
            .await;
    }

    /// Sends `data` as stdin, chunk by chunk, waiting for the window; output that comes
    /// meanwhile is kept (the first [`ERROR_TEXT_BYTES`]) in `kept`. Returns the exit if
    /// the command ended (or the node was lost) before all was sent.
    pub(crate) async fn send_all(&mut self, data: Bytes, kept: &mut Vec<u8>) -> Option<Out> {
        let mut rest = data;
        loop {
            while !self.may_send_stdin() {
                match self.next().await {
                    Out::Stdout(b) | Out::Stderr(b) => {
                        keep(kept, &b);
                        self.ack().await;
                    }
                    Out::StdinTaken => {}
                    end => return Some(end),
                }
            }
            let n = rest.len().min(MAX_CHUNK_BYTES);
            let chunk = rest.split_to(n);
            self.stdin(chunk).await;
            if rest.is_empty() {
                return None;
            }
        }
    }
}

impl Drop for Channel {
    /// A command whose HTTP caller went away is killed, not left running.
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let bus = self.shared.bus.clone();
        let subject = format!("{}.{IN_SIGNAL}", self.input);
        self.shared.tracker.spawn(async move {
            let _ = bus.publish_raw(subject, Bytes::from_static(b"KILL")).await;
        });
    }
}

fn keep(kept: &mut Vec<u8>, bytes: &[u8]) {
    let room = ERROR_TEXT_BYTES.saturating_sub(kept.len());
    kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
}

/// The WebSocket's limits: no message or frame larger than a stdin chunk (plus room for
/// a JSON command of [`slotpool_protocol::exec::MAX_ARGS`] arguments).
pub(crate) fn websocket_config() -> WebSocketConfig {
    let most = MAX_CHUNK_BYTES.max(slotpool_protocol::MAX_MESSAGE_BYTES);
    WebSocketConfig::default()
        .max_message_size(Some(most))
        .max_frame_size(Some(most))
}

/// Runs the exec WebSocket on the upgraded connection: reads the command, starts it,
/// bridges it until it ends, the client leaves or the launcher shuts down.
pub(crate) async fn run_websocket(
    shared: Arc<Shared>,
    caller: UserName,
    node: NodeId,
    upgraded: Upgraded,
    shutdown: CancellationToken,
) {
    let mut ws = WebSocketStream::from_raw_socket(
        TokioIo::new(upgraded),
        Role::Server,
        Some(websocket_config()),
    )
    .await;
    let (code, reason) = bridge(&shared, &caller, &node, &mut ws, &shutdown).await;
    let frame = CloseFrame {
        code,
        reason: reason.into(),
    };
    let _ = tokio::time::timeout(CLOSE_LIMIT, async {
        if ws.close(Some(frame)).await.is_ok() {
            while let Some(Ok(_)) = ws.next().await {}
        }
    })
    .await;
}

type Ws = WebSocketStream<TokioIo<Upgraded>>;

async fn send_event(ws: &mut Ws, event: &ExecEvent) -> bool {
    let text = serde_json::to_string(event).expect("events serialize");
    ws.send(Message::text(text)).await.is_ok()
}

/// The close code and reason the session ends with.
async fn bridge(
    shared: &Arc<Shared>,
    caller: &UserName,
    node: &NodeId,
    ws: &mut Ws,
    shutdown: &CancellationToken,
) -> (CloseCode, String) {
    let start = match tokio::time::timeout(START_MESSAGE_TIMEOUT, ws.next()).await {
        Ok(Some(Ok(Message::Text(text)))) => serde_json::from_str::<ExecStart>(&text),
        Ok(Some(Ok(_))) => {
            return (
                CloseCode::Policy,
                "the first message is the command, as JSON text".into(),
            )
        }
        Ok(_) => return (CloseCode::Normal, "the client left".into()),
        Err(_) => {
            return (
                CloseCode::Policy,
                format!("no command within {START_MESSAGE_TIMEOUT:?}"),
            )
        }
    };
    let start = match start {
        Ok(start) => start,
        Err(e) => {
            let err = ApiError::new(ErrorCode::BadRequest, format!("the command: {e}"));
            send_event(ws, &ExecEvent::Error(err)).await;
            return (CloseCode::Policy, "bad command".into());
        }
    };
    let mut channel = match Channel::open(shared, caller, node.clone(), start).await {
        Ok(channel) => channel,
        Err(err) => {
            send_event(ws, &ExecEvent::Error(err)).await;
            return (CloseCode::Policy, "the command could not start".into());
        }
    };
    tracing::info!(node_id = %node, client = %caller, "http exec started");
    let session = channel
        .input
        .rsplit('.')
        .next()
        .unwrap_or_default()
        .to_string();
    if !send_event(ws, &ExecEvent::Started { session }).await {
        return (CloseCode::Normal, "the client left".into());
    }
    let mut stdin_open = true;
    let mut ping = tokio::time::interval(PING_EVERY);
    ping.reset();
    loop {
        tokio::select! {
            out = channel.next() => match out {
                Out::StdinTaken => {}
                Out::Stdout(b) | Out::Stderr(b) if b.is_empty() => channel.ack().await,
                out @ (Out::Stdout(_) | Out::Stderr(_)) => {
                    let (tag, b) = match out {
                        Out::Stdout(b) => (FRAME_STDOUT, b),
                        Out::Stderr(b) => (FRAME_STDERR, b),
                        _ => unreachable!(),
                    };
                    let mut frame = Vec::with_capacity(b.len() + 1);
                    frame.push(tag);
                    frame.extend_from_slice(&b);
                    // Acknowledged only once written: a slow reader holds the agent back.
                    if ws.send(Message::binary(frame)).await.is_err() {
                        return (CloseCode::Normal, "the client left".into());
                    }
                    channel.ack().await;
                }
                Out::Exit(exit) => {
                    send_event(ws, &ExecEvent::Exit(exit)).await;
                    return (CloseCode::Normal, "the command ended".into());
                }
                Out::Lost(err) => {
                    send_event(ws, &ExecEvent::Error(err)).await;
                    return (CloseCode::Error, "the node was lost".into());
                }
            },
            msg = ws.next(), if !stdin_open || channel.may_send_stdin() => match msg {
                Some(Ok(Message::Binary(b))) if stdin_open => {
                    if b.is_empty() {
                        stdin_open = false;
                    }
                    channel.stdin(b).await;
                }
                Some(Ok(Message::Binary(_))) => {
                    let err = ApiError::new(ErrorCode::BadRequest, "stdin after its end");
                    send_event(ws, &ExecEvent::Error(err)).await;
                    return (CloseCode::Policy, "stdin after its end".into());
                }
                Some(Ok(Message::Text(text))) => match serde_json::from_str::<ExecControl>(&text) {
                    Ok(ExecControl::Signal(name)) => match SIGNALS.iter().find(|s| **s == name) {
                        Some(signal) => channel.signal(signal).await,
                        None => {
                            let err = ApiError::new(ErrorCode::BadRequest, format!("signal {name:?} is not one of {SIGNALS:?}"));
                            send_event(ws, &ExecEvent::Error(err)).await;
                            return (CloseCode::Policy, "unknown signal".into());
                        }
                    },
                    Ok(ExecControl::Eof(true)) if stdin_open => {
                        stdin_open = false;
                        channel.stdin(Bytes::new()).await;
                    }
                    Ok(ExecControl::Eof(_)) => {}
                    Err(e) => {
                        let err = ApiError::new(ErrorCode::BadRequest, format!("a control message: {e}"));
                        send_event(ws, &ExecEvent::Error(err)).await;
                        return (CloseCode::Policy, "bad control message".into());
                    }
                },
                Some(Ok(_)) => {}
                // Gone, or a message over the size limit: the command is killed (Drop).
                Some(Err(e)) => return (CloseCode::Policy, format!("{e}")),
                None => return (CloseCode::Normal, "the client left".into()),
            },
            _ = ping.tick() => {
                if ws.send(Message::Ping(Bytes::new())).await.is_err() {
                    return (CloseCode::Normal, "the client left".into());
                }
            }
            _ = shutdown.cancelled() => {
                return (CloseCode::Away, "shutting down; the command was killed".into());
            }
        }
    }
}

/// The HTTP status for a refusal of the execute channel.
pub(crate) fn status_of(err: &ApiError) -> hyper::StatusCode {
    use hyper::StatusCode as S;
    match err.code {
        ErrorCode::BadRequest | ErrorCode::TooLarge | ErrorCode::UnsupportedVersion => {
            S::BAD_REQUEST
        }
        ErrorCode::NotFound => S::NOT_FOUND,
        ErrorCode::Forbidden => S::FORBIDDEN,
        ErrorCode::Ended => S::CONFLICT,
        ErrorCode::Unavailable => S::SERVICE_UNAVAILABLE,
        _ => S::INTERNAL_SERVER_ERROR,
    }
}

/// How a file command ended, as an HTTP answer: `Ok(())` when it exited 0, else the
/// status and the text to answer with.
fn file_outcome(
    end: Out,
    what: &str,
    kept: &[u8],
    failed: hyper::StatusCode,
) -> Result<(), (hyper::StatusCode, String)> {
    match end {
        Out::Exit(exit) if exit.code == Some(0) => Ok(()),
        Out::Exit(exit) => {
            let why = String::from_utf8_lossy(kept).trim().to_string();
            let why = match (why.is_empty(), &exit.error, exit.timed_out) {
                (false, _, _) => why,
                (true, Some(error), _) => error.clone(),
                (true, None, true) => "timed out".into(),
                (true, None, false) => format!("status {:?}, signal {:?}", exit.code, exit.signal),
            };
            Err((failed, format!("{what}: {why}")))
        }
        Out::Lost(err) => Err((status_of(&err), err.message)),
        Out::Stdout(_) | Out::Stderr(_) | Out::StdinTaken => Err((
            hyper::StatusCode::INTERNAL_SERVER_ERROR,
            format!("{what}: unexpected output"),
        )),
    }
}

/// `PUT /api/v1/nodes/{id}/file?path=P`: writes the request's body to `P` in the
/// node's workspace. `Ok(())` once written; else the status and why.
pub(crate) async fn put_file(
    shared: &Arc<Shared>,
    caller: &UserName,
    node: NodeId,
    path: &str,
    body: hyper::body::Incoming,
) -> Result<(), (hyper::StatusCode, String)> {
    // A slow upload does not hold the launcher's shutdown (the command is killed).
    tokio::select! {
        done = write_file(shared, caller, node, path, body) => done,
        () = shared.shutdown.cancelled() => Err((
            hyper::StatusCode::SERVICE_UNAVAILABLE,
            "the launcher is stopping".into(),
        )),
    }
}

async fn write_file(
    shared: &Arc<Shared>,
    caller: &UserName,
    node: NodeId,
    path: &str,
    mut body: hyper::body::Incoming,
) -> Result<(), (hyper::StatusCode, String)> {
    use http_body_util::BodyExt;
    let start = ExecStart {
        argv: exec::copy_in_argv(path),
        env: BTreeMap::new(),
        timeout_secs: None,
    };
    let mut channel = Channel::open(shared, caller, node, start)
        .await
        .map_err(|e| (status_of(&e), e.message))?;
    let what = format!("writing {path}");
    let mut kept = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            (
                hyper::StatusCode::BAD_REQUEST,
                format!("reading the request's body: {e}"),
            )
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        if let Some(end) = channel.send_all(data, &mut kept).await {
            return file_outcome(end, &what, &kept, hyper::StatusCode::CONFLICT);
        }
    }
    if let Some(end) = channel.send_all(Bytes::new(), &mut kept).await {
        return file_outcome(end, &what, &kept, hyper::StatusCode::CONFLICT);
    }
    loop {
        match channel.next().await {
            Out::Stdout(b) | Out::Stderr(b) => {
                keep(&mut kept, &b);
                channel.ack().await;
            }
            Out::StdinTaken => {}
            end => return file_outcome(end, &what, &kept, hyper::StatusCode::CONFLICT),
        }
    }
}

/// A body chunk of a file read out of a node, or the error that cut it short.
pub(crate) type FileChunk = Result<hyper::body::Frame<Bytes>, std::io::Error>;

/// `GET /api/v1/nodes/{id}/file?path=P`: the file's bytes as they are read, through a
/// channel of one chunk (each is acknowledged to the agent once the connection took
/// the one before). Refused (before any byte) when `P` cannot be read.
pub(crate) async fn get_file(
    shared: &Arc<Shared>,
    caller: &UserName,
    node: NodeId,
    path: &str,
) -> Result<tokio::sync::mpsc::Receiver<FileChunk>, (hyper::StatusCode, String)> {
    let start = ExecStart {
        argv: exec::copy_out_argv(path),
        env: BTreeMap::new(),
        timeout_secs: None,
    };
    let mut channel = Channel::open(shared, caller, node, start)
        .await
        .map_err(|e| (status_of(&e), e.message))?;
    channel.stdin(Bytes::new()).await;
    let what = format!("reading {path}");
    let mut kept = Vec::new();
    let (tx, rx) = tokio::sync::mpsc::channel::<FileChunk>(1);
    // The first chunk decides the answer: a read that fails at once is a 404.
    let first = loop {
        match channel.next().await {
            Out::Stdout(b) if !b.is_empty() => break b,
            Out::Stdout(_) => channel.ack().await,
            Out::Stderr(b) => {
                keep(&mut kept, &b);
                channel.ack().await;
            }
            Out::StdinTaken => {}
            end => {
                file_outcome(end, &what, &kept, hyper::StatusCode::NOT_FOUND)?;
                return Ok(rx);
            }
        }
    };
    let shutdown = shared.shutdown.clone();
    let stopping = tx.clone();
    shared.tracker.spawn(async move {
        // A reader that stalls does not hold the launcher's shutdown: its body ends
        // short (and the command is killed).
        tokio::select! {
            () = stream_file(first, channel, tx, what, kept) => {}
            () = shutdown.cancelled() => {
                let _ = stopping.try_send(Err(std::io::Error::other("the launcher is stopping")));
            }
        }
    });
    Ok(rx)
}

/// Sends the rest of a file read out of a node, from its `first` chunk, into `tx`.
async fn stream_file(
    first: Bytes,
    mut channel: Channel,
    tx: tokio::sync::mpsc::Sender<FileChunk>,
    what: String,
    mut kept: Vec<u8>,
) {
    let mut chunk = first;
    loop {
        if tx.send(Ok(hyper::body::Frame::data(chunk))).await.is_err() {
            return; // the client left: the channel's drop kills the command
        }
        channel.ack().await;
        chunk = loop {
            match channel.next().await {
                Out::Stdout(b) if !b.is_empty() => break b,
                Out::Stdout(_) => channel.ack().await,
                Out::Stderr(b) => {
                    keep(&mut kept, &b);
                    channel.ack().await;
                }
                Out::StdinTaken => {}
                end => {
                    if let Err((_, why)) =
                        file_outcome(end, &what, &kept, hyper::StatusCode::NOT_FOUND)
                    {
                        let _ = tx.send(Err(std::io::Error::other(why))).await;
                    }
                    return;
                }
            }
        };
    }
}
