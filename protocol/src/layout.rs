//! Where slotpool state lives: KV buckets, their keys, and NATS subjects.
//!
//! Subjects are laid out so NATS permissions can separate the four kinds of users:
//! - clients publish to `slotpool.api.v1.>` and read the requests and slots buckets;
//! - an agent subscribes to `slotpool.agent.v1.<its backing id>` and writes only
//!   `$KV.slotpool_agents.<its backing id>`;
//! - operators publish to `slotpool.admin.v1.>`;
//! - launchers may do everything.

use crate::ids::{BackingId, LauncherId};
use crate::store::BucketSpec;

/// Node requests, key = request id.
pub const REQUESTS: BucketSpec = BucketSpec {
    name: "slotpool_requests",
    history: 1,
    per_key_ttl: true,
    max_value_size: 64 * 1024,
    max_age_secs: 0,
    max_bytes: -1,
};
/// Slots in use, key = `<backing id>.<slot index>`, value = the [`crate::model::Node`]
/// holding it. Created only if absent: this is what makes double-booking impossible.
pub const SLOTS: BucketSpec = BucketSpec {
    name: "slotpool_slots",
    history: 1,
    per_key_ttl: false,
    max_value_size: 64 * 1024,
    max_age_secs: 0,
    max_bytes: -1,
};
/// Backing nodes, key = `<provider>.<pool>.<seat>`. A pool has `max-servers` seats, so a
/// pool can never hold more backing nodes than that, whatever several launchers do.
pub const BACKING: BucketSpec = BucketSpec {
    name: "slotpool_backing",
    history: 1,
    per_key_ttl: false,
    max_value_size: 64 * 1024,
    max_age_secs: 0,
    max_bytes: -1,
};
/// Agent heartbeats, key = backing id, each with a TTL so a dead agent's entry expires.
pub const AGENTS: BucketSpec = BucketSpec {
    name: "slotpool_agents",
    history: 1,
    per_key_ttl: true,
    max_value_size: 64 * 1024,
    max_age_secs: 0,
    max_bytes: -1,
};
/// Launcher leases, key = `request.<request id>` or `backing.<provider>.<pool>.<seat>`.
pub const LEASES: BucketSpec = BucketSpec {
    name: "slotpool_leases",
    history: 1,
    per_key_ttl: true,
    max_value_size: 4 * 1024,
    max_age_secs: 0,
    max_bytes: -1,
};

/// The event log ([`crate::model::Event`]), key = event id (time-ordered). Written once
/// per key; kept for a day and at most 64 MiB, oldest dropped first.
pub const EVENTS: BucketSpec = BucketSpec {
    name: "slotpool_events",
    history: 1,
    per_key_ttl: false,
    max_value_size: 16 * 1024,
    max_age_secs: 24 * 3600,
    max_bytes: 64 * 1024 * 1024,
};

/// Every bucket, for creating them all at start-up.
pub const ALL_BUCKETS: [BucketSpec; 6] = [REQUESTS, SLOTS, BACKING, AGENTS, LEASES, EVENTS];

/// How long a finished (fulfilled, failed, canceled) request record is kept.
pub const FINISHED_REQUEST_TTL_SECS: u64 = 3600;

/// Key of a slot in [`SLOTS`].
pub fn slot_key(backing: &BackingId, slot: u32) -> String {
    format!("{backing}.{slot}")
}

/// Splits a [`SLOTS`] key into backing id and slot index.
pub fn parse_slot_key(key: &str) -> Option<(BackingId, u32)> {
    let (backing, slot) = key.rsplit_once('.')?;
    Some((BackingId::parse(backing).ok()?, slot.parse().ok()?))
}

/// Key of a seat in [`BACKING`].
pub fn seat_key(provider: &str, pool: &str, seat: u32) -> String {
    format!("{provider}.{pool}.{seat}")
}

/// Key of a launcher's liveness lease in [`LEASES`]: while it stands, no other launcher
/// takes over the requests that launcher owns.
pub fn launcher_lease_key(launcher: &LauncherId) -> String {
    format!("launcher.{launcher}")
}

/// Key of a backing seat's lease in [`LEASES`].
pub fn backing_lease_key(seat_key: &str) -> String {
    format!("backing.{seat_key}")
}

/// Subjects of the launcher's API and the agents' commands.
pub mod subjects {
    use crate::ids::BackingId;

    /// Submit a node request ([`crate::api::SubmitRequest`] → [`crate::api::Submitted`]).
    pub const SUBMIT: &str = "slotpool.api.v1.submit";
    /// Return nodes ([`crate::api::ReleaseNodes`] → [`crate::api::Released`]).
    pub const RELEASE: &str = "slotpool.api.v1.release";
    /// Cancel a waiting request ([`crate::api::CancelRequest`] → [`crate::api::Canceled`]).
    pub const CANCEL: &str = "slotpool.api.v1.cancel";
    /// Queue group all launchers serve the API in, so each message is handled once.
    pub const LAUNCHER_QUEUE: &str = "slotpool-launchers";

    /// Operators' orders on backing nodes and slots: `slotpool.admin.v1.<action>` with
    /// action `hold`, `drain`, `run`, `kill` ([`crate::api::BackingOrder`]) or
    /// `release_node` ([`crate::api::ReleaseNodeOrder`]). NATS permissions can grant
    /// operators `slotpool.admin.v1.>`, or single actions.
    pub fn admin(action: crate::model::OperatorAction) -> String {
        format!("slotpool.admin.v1.{}", action.as_str())
    }
    /// Every admin subject, for serving them.
    pub const ADMIN_ALL: &str = "slotpool.admin.v1.>";

    /// Commands from launchers to one agent ([`crate::api::AgentCommand`]).
    pub fn agent(backing: &BackingId) -> String {
        format!("slotpool.agent.v1.{backing}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_keys_round_trip() {
        let b = BackingId::parse("bn-01abc").unwrap();
        assert_eq!(parse_slot_key(&slot_key(&b, 7)), Some((b, 7)));
        assert_eq!(parse_slot_key("nodots"), None);
        assert_eq!(parse_slot_key("bn-1.x"), None);
    }
}
