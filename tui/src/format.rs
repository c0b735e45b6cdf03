//! Names and durations as the console shows them: state names (also what filters match),
//! durations for humans, and the backing id a node id names. Used by the derived rows
//! (filters) and by the view; depends on nothing else in the console.

use slotpool_protocol::model::{BackingState, IdleBehaviour, NodeState, RequestState};

pub fn state_name(s: BackingState) -> &'static str {
    match s {
        BackingState::Requested => "requested",
        BackingState::Launching => "launching",
        BackingState::Ready => "ready",
        BackingState::Retiring => "retiring",
        BackingState::Releasing => "releasing",
        BackingState::Gone => "gone",
        BackingState::Failed => "failed",
    }
}

pub fn idle_name(i: IdleBehaviour) -> &'static str {
    match i {
        IdleBehaviour::Run => "run",
        IdleBehaviour::Hold => "hold",
        IdleBehaviour::Drain => "drain",
    }
}

pub fn node_state_name(s: NodeState) -> &'static str {
    match s {
        NodeState::Preparing => "preparing",
        NodeState::Ready => "ready",
        NodeState::Releasing => "releasing",
        NodeState::Failed => "failed",
    }
}

pub fn request_state_name(s: RequestState) -> &'static str {
    match s {
        RequestState::Requested => "waiting",
        RequestState::Fulfilled => "fulfilled",
        RequestState::Failed => "failed",
        RequestState::Canceled => "canceled",
        RequestState::Reclaimed => "reclaimed",
    }
}

/// A duration for humans: `42s`, `5m03s`, `2h05m`, `3d04h`.
pub fn fmt_duration(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

/// `HH:MM:SS` (UTC) of a timestamp.
pub fn clock(ms: u64) -> String {
    let s = ms / 1000 % 86400;
    format!("{:02}:{:02}:{:02}", s / 3600, s % 3600 / 60, s % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(fmt_duration(42_000), "42s");
        assert_eq!(fmt_duration(303_000), "5m03s");
        assert_eq!(fmt_duration(7_500_000), "2h05m");
        assert_eq!(fmt_duration(3 * 86_400_000 + 4 * 3_600_000), "3d04h");
    }
}
