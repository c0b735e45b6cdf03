//! Running a command in a node the caller holds: the messages of the execute channel.
//!
//! The caller asks a launcher (`slotpool.api.v2.<client>.exec`, [`ExecRequest`]); the
//! launcher checks the node is the caller's and ready, and hands the command to the
//! node's agent ([`crate::api::AgentCommand::Exec`]), which starts it in the slot and
//! binds the session to the caller. From then on bytes flow between the caller and the
//! agent directly, never through a launcher:
//!
//! - agent → caller on `<caller's inbox prefix>.exec.<session>.<backing>.<kind>`
//!   ([`crate::layout::subjects::exec_output`]; only the agent of `<backing>` may
//!   publish there, only the caller subscribe): kinds [`OUT_STDOUT`], [`OUT_STDERR`]
//!   (raw bytes, never empty), [`OUT_STDIN_ACK`] and [`OUT_EXIT`] ([`ExecExit`], JSON, the
//!   last message of a session);
//! - caller → agent on `slotpool.exec.v2.<caller>.<backing>.<session>.<kind>`
//!   ([`crate::layout::subjects::exec_input`]): kinds [`IN_STDIN`] (raw bytes; empty is
//!   end of input), [`IN_ACK`] and [`IN_SIGNAL`].
//!
//! Flow control is by chunk counts in both directions, so neither side buffers more
//! than a window: the agent has at most `window` output chunks (stdout and stderr
//! together) unacknowledged, and reads the command's pipes only when it may send, so a
//! slow reader stalls the command, not the agent's memory. The full contract, for
//! clients in any language, is docs/protocol.md, section "Execute".

use crate::ids::NodeId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Largest output chunk the agent sends, and largest stdin chunk it accepts.
pub const MAX_CHUNK_BYTES: usize = 64 * 1024;
/// The output window when the request names none.
pub const DEFAULT_WINDOW: u32 = 16;
/// The largest output window a request may ask for.
pub const MAX_WINDOW: u32 = 64;
/// How many stdin chunks the agent holds unwritten at most: a caller sends the next one
/// only while fewer than this many are unacknowledged.
pub const STDIN_WINDOW: u64 = 8;
/// How long the agent waits for an acknowledgement while it may not send before it
/// takes the caller for gone and stops the command.
pub const CALLER_SILENCE_SECS: u64 = 60;
/// Most arguments of a command, and most environment variables.
pub const MAX_ARGS: usize = 1024;

/// Output kinds (the last token of an output subject).
pub const OUT_STDOUT: &str = "stdout";
pub const OUT_STDERR: &str = "stderr";
pub const OUT_STDIN_ACK: &str = "stdin_ack";
pub const OUT_EXIT: &str = "exit";
/// Input kinds (the last token of an input subject).
pub const IN_STDIN: &str = "stdin";
pub const IN_ACK: &str = "ack";
pub const IN_SIGNAL: &str = "signal";
/// The signals a caller may send, by name ([`IN_SIGNAL`]'s payload).
pub const SIGNALS: [&str; 5] = ["INT", "TERM", "KILL", "HUP", "QUIT"];

/// `slotpool.api.v2.<client>.exec`: run `argv` in node `node_id`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    #[serde(default = "default_version")]
    pub v: u32,
    pub node_id: NodeId,
    /// The command and its arguments (no shell unless `argv` names one).
    pub argv: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Kill the command after this many seconds (none: no limit but the node's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// The caller's name for this run: 1 to 64 of `A-Z a-z 0-9 - _`, unique among its
    /// runs (a random one each time).
    pub session: String,
    /// The caller's inbox prefix (`_INBOX.<role>.<user>`, as it connected): output
    /// goes to `<inbox>.exec.<session>.<backing>.<kind>`, `<backing>` the backing node
    /// named in `node_id` ([`output_of`]). Subscribe before sending the request.
    pub inbox: String,
    /// Output chunks the agent may have unacknowledged (default [`DEFAULT_WINDOW`], at
    /// most [`MAX_WINDOW`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<u32>,
}

fn default_version() -> u32 {
    crate::PROTOCOL_VERSION
}

/// The reply to [`ExecRequest`]: the command started.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExecStarted {
    pub session: String,
    /// Where to send input: [`crate::layout::subjects::exec_input`] without its kind.
    pub input: String,
    /// Where output comes: [`crate::layout::subjects::exec_output`].
    pub output: String,
}

/// The last message of a session ([`OUT_EXIT`]): how the command ended.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExecExit {
    /// Its exit status, when it exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<i32>,
    /// The signal that ended it, when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// It was killed for running past `timeout_secs`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
    /// It could not be run, or the session broke (the caller went silent...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The output subject of `request` (without its kind; subscribe to it with `.>`): the
/// backing node in it is the one `node_id` names, whose agent alone may publish there.
/// `None` for a node id that names no slot (the launcher refuses it as `not_found`).
pub fn output_of(request: &ExecRequest) -> Option<String> {
    let (backing, _slot) = request.node_id.slot()?;
    Some(crate::layout::subjects::exec_output(
        &request.inbox,
        &request.session,
        &backing,
    ))
}

/// Whether `session` is a valid session name (one subject token of safe characters).
pub fn valid_session(session: &str) -> bool {
    (1..=64).contains(&session.len())
        && session
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Whether `inbox` may receive `caller`'s output: its own inbox prefix, as a client or
/// an operator (agents may publish to those exec inboxes only).
pub fn valid_inbox(inbox: &str, caller: &str) -> bool {
    inbox == format!("_INBOX.client.{caller}") || inbox == format!("_INBOX.operator.{caller}")
}

/// Checks what the launcher and the agent both refuse; the message says what is wrong.
pub fn check_request(r: &ExecRequest, caller: &str) -> Result<(), String> {
    if r.argv.is_empty() || r.argv[0].is_empty() {
        return Err("argv is empty: name the command to run".into());
    }
    if r.argv.len() > MAX_ARGS || r.env.len() > MAX_ARGS {
        return Err(format!(
            "at most {MAX_ARGS} arguments and {MAX_ARGS} variables"
        ));
    }
    if r.argv.iter().any(|a| a.contains('\0')) {
        return Err("an argument contains a NUL byte".into());
    }
    for (k, v) in &r.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(format!("bad environment variable {k:?}"));
        }
    }
    if !valid_session(&r.session) {
        return Err(format!(
            "session {:?} must be 1 to 64 of A-Z a-z 0-9 - _",
            r.session
        ));
    }
    if !valid_inbox(&r.inbox, caller) {
        return Err(format!(
            "inbox {:?} is not {caller}'s: use _INBOX.client.{caller} (or _INBOX.operator.{caller})",
            r.inbox
        ));
    }
    if let Some(w) = r.window {
        if !(1..=MAX_WINDOW).contains(&w) {
            return Err(format!("window {w} must be 1 to {MAX_WINDOW}"));
        }
    }
    if r.timeout_secs == Some(0) {
        return Err("timeout_secs must be at least 1".into());
    }
    Ok(())
}

/// The command that writes its stdin to file `path` (relative to the workspace),
/// making its directory: how a file is copied into a node over this channel.
pub fn copy_in_argv(path: &str) -> Vec<String> {
    const COPY_IN: &str = "mkdir -p -- \"$(dirname -- \"$1\")\" && cat > \"$1\"";
    ["sh", "-c", COPY_IN, "sh", path].map(String::from).to_vec()
}

/// The command that writes file `path` (relative to the workspace) to its stdout: how a
/// file is copied out of a node over this channel.
pub fn copy_out_argv(path: &str) -> Vec<String> {
    ["cat", "--", path].map(String::from).to_vec()
}

/// The signal number of a signal name in [`SIGNALS`] (Linux numbering).
pub fn signal_number(name: &str) -> Option<i32> {
    Some(match name {
        "HUP" => 1,
        "INT" => 2,
        "QUIT" => 3,
        "KILL" => 9,
        "TERM" => 15,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> ExecRequest {
        ExecRequest {
            v: 1,
            node_id: NodeId::parse("node-a").unwrap(),
            argv: vec!["true".into()],
            env: BTreeMap::new(),
            timeout_secs: None,
            session: "s1".into(),
            inbox: "_INBOX.client.ci".into(),
            window: None,
        }
    }

    #[test]
    fn requests_are_checked() {
        assert_eq!(check_request(&request(), "ci"), Ok(()));
        let err = check_request(&request(), "other").unwrap_err();
        assert!(err.contains("is not other's"), "{err}");
        let mut r = request();
        r.argv.clear();
        assert!(check_request(&r, "ci")
            .unwrap_err()
            .contains("argv is empty"));
        let mut r = request();
        r.session = "a.b".into();
        assert!(check_request(&r, "ci").is_err());
        let mut r = request();
        r.window = Some(MAX_WINDOW + 1);
        assert!(check_request(&r, "ci").is_err());
        let mut r = request();
        r.env.insert("A=B".into(), "x".into());
        assert!(check_request(&r, "ci").is_err());
    }

    #[test]
    fn signals_have_numbers() {
        for s in SIGNALS {
            assert!(signal_number(s).is_some(), "{s}");
        }
        assert_eq!(signal_number("STOP"), None);
    }
}
