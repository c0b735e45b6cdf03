//! Wall-clock timestamps as they appear on the wire: milliseconds since the Unix epoch.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub type UnixMillis = u64;

/// The current wall-clock time in milliseconds since the Unix epoch.
pub fn now_ms() -> UnixMillis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_millis() as u64
}

/// How long until `deadline` (zero when it has passed).
pub fn until(deadline: UnixMillis) -> Duration {
    Duration::from_millis(deadline.saturating_sub(now_ms()))
}

/// `at` plus `d`, in milliseconds.
pub fn after(at: UnixMillis, d: Duration) -> UnixMillis {
    at.saturating_add(d.as_millis() as u64)
}
