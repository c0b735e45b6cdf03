//! Serving [`AgentCommand`]s from launchers on `slotpool.agent.v2.<backing id>`.
//!
//! Each slot has its own queue and worker task (a "lane"), and `close`/`open` share one
//! more, so commands for different slots run concurrently while commands for one slot
//! run one at a time, in arrival order. A command is answered as soon as it is done.
//! It pokes the heartbeat only when it changed something launchers act on (a release
//! that left its slot dirty); occupancy they read from the slots bucket, so the regular
//! beats carrying it for the console are enough.
//!
//! Replies (see [`slotpool_protocol::api::Reply`]):
//! - `prepare_slot` → `{"ok":{"workspace":"<work-dir>/slots/<slot>","username":"...",
//!   "port":22,"host_keys":["ssh-ed25519 AAAA..."]}}` (username with user isolation)
//! - `release_slot` → `{"ok":{}}`
//! - `close`, `open` → `{"ok":{"prepared":[<slot>, ...]}}`
//! - `slot_occupants` → `{"ok":{"processes":3,"logins":[...]}}`
//! - `exec` → `{"ok":{}}` once the command runs (see [`crate::exec`])
//! - `log_tail` → `{"ok":{"lines":["<time>  INFO <spans>: <target>: <message> <fields>", ...]}}`
//! - failures → `{"error":{"code":"<code>","message":"..."}}` with code `bad_request`
//!   (malformed, slot out of range, an `ssh_public_key` that is not one plain key), `too_large`, `unavailable` (prepare while closed,
//!   or of a dirty slot) or `internal` (slot held by another node, isolation failure,
//!   a release that could not clean its slot, queue full)

use crate::exec::Runner;
use crate::isolation::Limits;
use crate::log_tail::LogTail;
use crate::slots::{ReleaseOutcome, SlotError, Slots};
use crate::ssh::SshInfo;
use futures::{Stream, StreamExt};
use slotpool_protocol::api::{
    AgentCommand, ApiError, ErrorCode, LogTail as LogLines, Reply, SlotPrepared, SlotReleased,
    SlotsClosed,
};
use slotpool_protocol::connect::{Bus, Incoming};
use slotpool_protocol::model::SlotLogin;
use slotpool_protocol::ssh_key::validate_public_key;
use slotpool_protocol::{NodeId, MAX_MESSAGE_BYTES};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

/// Longest wait for a reply to be handed to the NATS connection.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// Commands one lane may have waiting; more are refused with an internal error.
pub const SLOT_QUEUE_DEPTH: usize = 16;
/// How long shutdown waits for commands already accepted to finish.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// The JSON a reply carries, whatever the command.
type AnyReply = Reply<serde_json::Value>;

/// Decodes a command, refusing oversized or malformed messages with a message that says
/// what was wrong.
pub fn decode(payload: &[u8]) -> Result<AgentCommand, ApiError> {
    if payload.len() > MAX_MESSAGE_BYTES {
        return Err(ApiError::new(
            ErrorCode::TooLarge,
            format!(
                "agent command is {} bytes; the limit is {MAX_MESSAGE_BYTES}",
                payload.len()
            ),
        ));
    }
    serde_json::from_slice(payload).map_err(|err| {
        ApiError::new(
            ErrorCode::BadRequest,
            format!("malformed agent command: {err}"),
        )
    })
}

/// The operation name, and the slot and node a command is about (none for close/open).
fn target(command: &AgentCommand) -> (&'static str, Option<(u32, &NodeId)>) {
    match command {
        AgentCommand::PrepareSlot { slot, node_id, .. } => ("prepare_slot", Some((*slot, node_id))),
        AgentCommand::ReleaseSlot { slot, node_id } => ("release_slot", Some((*slot, node_id))),
        AgentCommand::Close => ("close", None),
        AgentCommand::Open => ("open", None),
        // Read-only: on the close/open lane, never behind a slot's slow release.
        AgentCommand::SlotOccupants { .. } => ("slot_occupants", None),
        AgentCommand::LogTail { .. } => ("log_tail", None),
        AgentCommand::Exec { slot, node_id, .. } => ("exec", Some((*slot, node_id))),
    }
}

fn api_error(err: &SlotError) -> ApiError {
    let code = match err {
        SlotError::OutOfRange { .. } => ErrorCode::BadRequest,
        SlotError::Closed { .. } | SlotError::Dirty { .. } => ErrorCode::Unavailable,
        SlotError::Held { .. }
        | SlotError::Isolation { .. }
        | SlotError::Task { .. }
        | SlotError::Unclean { .. } => ErrorCode::Internal,
    };
    ApiError::new(code, err.to_string())
}

fn reply_with<T: serde::Serialize>(result: Result<T, ApiError>) -> AnyReply {
    match result {
        Ok(value) => Reply::Ok(serde_json::to_value(value).expect("replies serialize")),
        Err(err) => Reply::Error(err),
    }
}

/// What commands other than a slot's prepare and release are answered from.
#[derive(Clone)]
pub struct Answers {
    /// The SSH facts a prepare's reply carries.
    pub ssh: Arc<SshInfo>,
    /// The agent's own newest log lines, for `log_tail`.
    pub tail: LogTail,
    /// The commands run in slots, for `exec`.
    pub runner: Runner,
}

/// A command carried out: its reply, and whether it changed what the heartbeat tells
/// launchers.
struct Done {
    reply: AnyReply,
    changes_heartbeat: bool,
}

impl From<AnyReply> for Done {
    fn from(reply: AnyReply) -> Done {
        Done {
            reply,
            changes_heartbeat: false,
        }
    }
}

/// Whether a release's outcome changed the heartbeat: only a release that could not clean
/// its slot does (the slot joins the dirty slots).
fn release_changes_heartbeat(result: &Result<ReleaseOutcome, SlotError>) -> bool {
    matches!(result, Err(SlotError::Unclean { .. }))
}

/// Carries out one command.
async fn execute(slots: &Slots, answers: &Answers, command: AgentCommand) -> Done {
    let Answers { ssh, tail, runner } = answers;
    match command {
        AgentCommand::PrepareSlot {
            slot,
            node_id,
            ssh_public_key,
            limits,
        } => {
            // The key becomes a line of authorized_keys: nothing but one plain key.
            if let Some(Err(err)) = ssh_public_key.as_deref().map(validate_public_key) {
                tracing::warn!(%err, "refusing prepare: bad ssh_public_key");
                return reply_with::<SlotPrepared>(Err(ApiError::new(
                    ErrorCode::BadRequest,
                    format!("invalid ssh_public_key: {err}"),
                )))
                .into();
            }
            let started = std::time::Instant::now();
            let limits = Limits::from(&limits);
            let result = slots.prepare(slot, &node_id, ssh_public_key, limits).await;
            crate::metrics::prepared(started.elapsed());
            match &result {
                Ok(p) => tracing::info!(
                    workspace = %p.workspace.display(),
                    username = p.username.as_deref().unwrap_or(""),
                    ?limits,
                    "slot prepared"
                ),
                Err(err) => tracing::warn!(%err, "prepare failed"),
            }
            reply_with(result.map_err(|e| api_error(&e)).map(|p| SlotPrepared {
                workspace: p.workspace.display().to_string(),
                login: SlotLogin {
                    username: p.username,
                    port: Some(ssh.port),
                    host_keys: ssh.host_keys.clone(),
                },
            }))
            .into()
        }
        AgentCommand::ReleaseSlot { slot, node_id } => {
            let started = std::time::Instant::now();
            let result = slots.release(slot, &node_id).await;
            crate::metrics::released(started.elapsed());
            match &result {
                Ok(ReleaseOutcome::Wiped) => tracing::info!("slot released"),
                Ok(ReleaseOutcome::HeldByOther(holder)) => tracing::warn!(
                    %holder,
                    "release names a node that does not hold the slot; holder left alone"
                ),
                Err(err) => tracing::warn!(%err, "release failed"),
            }
            Done {
                changes_heartbeat: release_changes_heartbeat(&result),
                reply: reply_with(
                    result
                        .map_err(|e| api_error(&e))
                        .map(|outcome| SlotReleased {
                            held_by: match outcome {
                                ReleaseOutcome::Wiped => None,
                                ReleaseOutcome::HeldByOther(holder) => Some(holder),
                            },
                        }),
                ),
            }
        }
        AgentCommand::Close => {
            let prepared = slots.close().await;
            tracing::info!(?prepared, "closed to new slots");
            reply_with(Ok(SlotsClosed { prepared })).into()
        }
        AgentCommand::Open => {
            let prepared = slots.open().await;
            tracing::info!(?prepared, "open to new slots");
            reply_with(Ok(SlotsClosed { prepared })).into()
        }
        AgentCommand::SlotOccupants { slot } => {
            reply_with(slots.occupants(slot).await.map_err(|e| api_error(&e))).into()
        }
        AgentCommand::LogTail { lines } => reply_with(Ok(LogLines {
            lines: tail.newest(lines),
        }))
        .into(),
        AgentCommand::Exec {
            slot,
            node_id,
            client,
            request,
        } => reply_with(
            runner
                .start(slots, slot, &node_id, client, request)
                .map(|()| serde_json::json!({})),
        )
        .into(),
    }
}

/// Sends a reply if the message asked for one. Errors are logged here.
async fn respond(bus: &Bus, reply_to: Option<&str>, reply: &AnyReply) {
    let Some(reply_to) = reply_to else {
        tracing::debug!("command has no reply subject; not answering");
        return;
    };
    match tokio::time::timeout(REPLY_TIMEOUT, bus.respond(reply_to, reply)).await {
        Ok(Ok(())) => {}
        Ok(Err(err)) => tracing::warn!(%err, "cannot send reply"),
        Err(_) => tracing::warn!(timeout = ?REPLY_TIMEOUT, "cannot send reply: timed out"),
    }
}

/// A command waiting in a slot's queue.
struct Job {
    command: AgentCommand,
    reply_to: Option<String>,
    span: tracing::Span,
}

/// Runs one lane's commands in order until its queue is closed.
async fn slot_worker(
    mut jobs: mpsc::Receiver<Job>,
    slots: Slots,
    answers: Answers,
    bus: Bus,
    poke: Arc<Notify>,
) {
    while let Some(job) = jobs.recv().await {
        let span = job.span;
        let done = async {
            let done = execute(&slots, &answers, job.command).await;
            respond(&bus, job.reply_to.as_deref(), &done.reply).await;
            done
        }
        .instrument(span)
        .await;
        if done.changes_heartbeat {
            poke.notify_one();
        }
    }
}

/// Serves commands from `commands` until `shutdown` or the stream ends, then waits
/// (at most [`SHUTDOWN_GRACE`]) for accepted commands to finish. Returns `false` when the
/// stream ended without a shutdown.
pub async fn serve(
    bus: &Bus,
    slots: &Slots,
    answers: Answers,
    commands: impl Stream<Item = Incoming>,
    poke: Arc<Notify>,
    shutdown: &CancellationToken,
) -> bool {
    let tracker = TaskTracker::new();
    // Lanes 0..count are the slots; the last one is for close/open.
    let queues: Vec<mpsc::Sender<Job>> = (0..=slots.count())
        .map(|_| {
            let (tx, rx) = mpsc::channel(SLOT_QUEUE_DEPTH);
            tracker.spawn(slot_worker(
                rx,
                slots.clone(),
                answers.clone(),
                bus.clone(),
                poke.clone(),
            ));
            tx
        })
        .collect();
    let mut commands = Box::pin(commands);
    let ended = loop {
        let message = tokio::select! {
            () = shutdown.cancelled() => break false,
            message = commands.next() => message,
        };
        let Some(message) = message else { break true };
        if let Err(err) = dispatch(&queues, slots, message.payload.as_ref(), &message.reply_to) {
            tracing::warn!(code = ?err.code, message = %err.message, "refusing agent command");
            let bus = bus.clone();
            let reply_to = message.reply_to;
            tracker.spawn(async move {
                respond(&bus, reply_to.as_deref(), &Reply::Error(err)).await;
            });
        }
    };
    // Unsubscribe at once, so launchers get "no responders" rather than a timeout.
    drop(commands);
    drop(queues);
    tracker.close();
    if tokio::time::timeout(SHUTDOWN_GRACE, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!(grace = ?SHUTDOWN_GRACE, "slot commands still running at shutdown");
    }
    ended
}

/// Decodes a message and queues it for its lane's worker.
fn dispatch(
    queues: &[mpsc::Sender<Job>],
    slots: &Slots,
    payload: &[u8],
    reply_to: &Option<String>,
) -> Result<(), ApiError> {
    let command = decode(payload)?;
    let span = tracing::info_span!(
        "command",
        op = tracing::field::Empty,
        slot = tracing::field::Empty,
        node_id = tracing::field::Empty
    );
    let (op, target) = target(&command);
    span.record("op", op);
    let lane = match target {
        Some((slot, node_id)) => {
            slots.check(slot).map_err(|e| api_error(&e))?;
            span.record("slot", slot);
            span.record("node_id", tracing::field::display(node_id));
            slot as usize
        }
        None => queues.len() - 1,
    };
    let job = Job {
        command,
        reply_to: reply_to.clone(),
        span,
    };
    queues[lane].try_send(job).map_err(|_| {
        ApiError::new(
            ErrorCode::Internal,
            format!("{op} refused: {SLOT_QUEUE_DEPTH} commands already waiting in its queue; retry later"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bad_request(json: &str) -> String {
        let err = decode(json.as_bytes()).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest, "{json}: {err}");
        err.message
    }

    #[test]
    fn decodes_commands() {
        let prepare = decode(
            br#"{"op":"prepare_slot","slot":2,"node_id":"node-a","ssh_public_key":"ssh-ed25519 AAAA"}"#,
        )
        .unwrap();
        let node_a = NodeId::parse("node-a").unwrap();
        assert_eq!(target(&prepare), ("prepare_slot", Some((2, &node_a))));
        let release = decode(br#"{"op":"release_slot","slot":0,"node_id":"node-b"}"#).unwrap();
        assert_eq!(target(&release).0, "release_slot");
        assert_eq!(decode(br#"{"op":"close"}"#).unwrap(), AgentCommand::Close);
        assert_eq!(decode(br#"{"op":"open"}"#).unwrap(), AgentCommand::Open);
    }

    #[test]
    fn malformed_commands_say_what_is_wrong() {
        assert!(bad_request("not json").contains("expected"));
        assert!(bad_request(r#"{"op":"explode","slot":1}"#).contains("unknown variant `explode`"));
        assert!(bad_request(r#"{"slot":1,"node_id":"node-a"}"#).contains("missing field `op`"));
        assert!(
            bad_request(r#"{"op":"prepare_slot","slot":1}"#).contains("missing field `node_id`")
        );
        assert!(
            bad_request(r#"{"op":"release_slot","slot":-1,"node_id":"node-a"}"#)
                .contains("invalid value")
        );
        assert!(bad_request(r#"{"op":"release_slot","slot":1,"node_id":"a.b"}"#).contains("a.b"));
        assert!(
            bad_request(r#"{"op":"release_slot","slot":1,"node_id":"node-a","x":1}"#)
                .contains("unknown field `x`")
        );
    }

    #[test]
    fn only_a_release_that_leaves_its_slot_dirty_changes_the_heartbeat() {
        let node_a = NodeId::parse("node-a").unwrap();
        assert!(!release_changes_heartbeat(&Ok(ReleaseOutcome::Wiped)));
        assert!(!release_changes_heartbeat(&Ok(
            ReleaseOutcome::HeldByOther(node_a)
        )));
        let refused = SlotError::OutOfRange { slot: 9, slots: 8 };
        let unclean = SlotError::Unclean {
            slot: 1,
            cause: Box::new(SlotError::Task {
                slot: 1,
                action: "release",
                message: "panicked".into(),
            }),
        };
        assert_eq!(
            unclean.to_string(),
            "slot 1: release task failed: panicked; the slot is now dirty"
        );
        assert_eq!(api_error(&unclean).code, ErrorCode::Internal);
        assert!(!release_changes_heartbeat(&Err(refused)));
        assert!(release_changes_heartbeat(&Err(unclean)));
    }

    #[test]
    fn oversized_commands_are_too_large() {
        let big = vec![b' '; MAX_MESSAGE_BYTES + 1];
        assert_eq!(decode(&big).unwrap_err().code, ErrorCode::TooLarge);
    }

    #[test]
    fn reply_json_shapes() {
        let ok = reply_with::<SlotPrepared>(Ok(SlotPrepared {
            workspace: "/w/slots/1".into(),
            login: Default::default(),
        }));
        assert_eq!(
            serde_json::to_string(&ok).unwrap(),
            r#"{"ok":{"workspace":"/w/slots/1"}}"#
        );
        let closed = reply_with(Ok(SlotsClosed {
            prepared: vec![0, 3],
        }));
        assert_eq!(
            serde_json::to_string(&closed).unwrap(),
            r#"{"ok":{"prepared":[0,3]}}"#
        );
        let released = reply_with(Ok(serde_json::json!({})));
        assert_eq!(serde_json::to_string(&released).unwrap(), r#"{"ok":{}}"#);
        let err = api_error(&SlotError::OutOfRange { slot: 9, slots: 8 });
        assert_eq!(
            serde_json::to_string(&reply_with::<()>(Err(err))).unwrap(),
            r#"{"error":{"code":"bad_request","message":"slot 9 does not exist: this node has 8 slots (0 to 7)"}}"#
        );
    }
}
